"""SAC: the squashed Gaussian's maths, the temperature, the bounds, checkpoints, and a run on every backend."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import srl
from srl.algorithms import sac
from srl.base.env import BoxActions, DiscreteActions, EnvConfig, EnvError, EnvSpec, env_spec
from srl.rl.memories import MemoryConfig
from tests.nodes import short_distributed_run
from tests.test_queues import Broker, broker  # noqa: F401 - the parametrized broker fixture

PENDULUM = "Pendulum-v1"


def small(**changes: Any) -> sac.Config:
    config = sac.Config(batch_size=32, warmup_size=64, seed=0)
    config.hidden_block.set_mlp((32, 32))
    config.memory = MemoryConfig(kind="replay", capacity=2000)
    for k, v in changes.items():
        setattr(config, k, v)
    return config


def box_spec(low: list[float], high: list[float], obs_dim: int = 3) -> EnvSpec:
    actions = BoxActions((len(low),), np.array(low, np.float32), np.array(high, np.float32))
    return EnvSpec("test/Box", (obs_dim,), actions)


def filled_learner(config: sac.Config, spec: EnvSpec, rows: int = 256) -> sac.SACLearner:
    """A learner whose memory holds ``rows`` random transitions of ``spec``."""
    parameter = config.make_parameter(spec, torch.device("cpu"))
    memory = config.make_buffer(spec)
    rng = np.random.default_rng(0)
    dim = spec.obs_shape[0]
    act = spec.actions.shape
    memory.add({
        "obs": rng.normal(size=(rows, dim)).astype(np.float32),
        "action": rng.uniform(-1, 1, size=(rows, *act)).astype(np.float32),
        "reward": rng.normal(size=rows).astype(np.float32),
        "next_obs": rng.normal(size=(rows, dim)).astype(np.float32),
        "discount": np.full(rows, 0.99, np.float32),
        "version": np.ones(rows, np.int64),
    })
    learner = config.make_learner(spec, parameter, memory)
    assert isinstance(learner, sac.SACLearner)
    return learner


# ------------------------------------------------------------------------------------ the maths
def test_squashed_log_prob_is_the_gaussian_s_minus_tanh_s_log_jacobian() -> None:
    """By hand, for two dimensions: log N(u; m, s) - log(1 - tanh(u)^2), summed."""
    u, mean, log_std = [0.3, -2.5], [0.1, -1.0], [-0.5, 0.7]
    expected = 0.0
    for ui, mi, li in zip(u, mean, log_std, strict=True):
        s = math.exp(li)
        expected += -0.5 * ((ui - mi) / s) ** 2 - math.log(s) - 0.5 * math.log(2 * math.pi)
        expected -= math.log(1.0 - math.tanh(ui) ** 2)
    got = sac.squashed_log_prob(torch.tensor([u], dtype=torch.float64), torch.tensor([mean], dtype=torch.float64),
                                torch.tensor([log_std], dtype=torch.float64))
    assert got.shape == (1,)
    assert float(got[0]) == pytest.approx(expected, rel=1e-10)


def test_squashed_log_prob_stays_finite_where_tanh_saturates() -> None:
    u = torch.tensor([[30.0], [-30.0]])
    got = sac.squashed_log_prob(u, torch.zeros(2, 1), torch.zeros(2, 1))
    assert torch.isfinite(got).all()
    naive = torch.distributions.Normal(0.0, 1.0).log_prob(u).sum(1) - torch.log(1 - torch.tanh(u) ** 2).sum(1)
    assert not torch.isfinite(naive).all()  # what the stable form avoids


@pytest.mark.parametrize(("target_entropy", "direction"), [(-10.0, -1), (10.0, 1)])
def test_the_temperature_moves_toward_its_entropy_target(target_entropy: float, direction: int) -> None:
    """A policy more random than the target lowers α; one less random than the target raises it."""
    learner = filled_learner(small(target_entropy=target_entropy), box_spec([-1.0], [1.0]))
    before = learner.alpha()
    for _ in range(20):
        stats = learner.train()
        assert stats is not None and stats.gradient_steps == 1
    assert (learner.alpha() - before) * direction > 0
    assert stats.alpha == pytest.approx(learner.alpha(), rel=0.01)  # the temperature it learned with: a step before


def test_a_fixed_temperature_stays_put() -> None:
    learner = filled_learner(small(alpha=0.2), box_spec([-1.0], [1.0]))
    for _ in range(5):
        learner.train()
    assert learner.alpha() == 0.2


def test_training_moves_the_critics_the_actor_and_the_targets_only_by_tau() -> None:
    config = small(tau=0.5)
    learner = filled_learner(config, box_spec([-1.0, -1.0], [1.0, 1.0]))
    nets = learner.parameter.nets
    actor = [p.detach().clone() for p in nets.actor.parameters()]
    q1 = [p.detach().clone() for p in nets.q1.parameters()]
    target = [p.detach().clone() for p in learner.target_q1.parameters()]
    learner.train()
    assert all(not torch.equal(a, b) for a, b in zip(actor, nets.actor.parameters(), strict=True))
    moved_q1 = list(nets.q1.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(q1, moved_q1, strict=True))
    for old, new, online in zip(target, learner.target_q1.parameters(), moved_q1, strict=True):
        torch.testing.assert_close(new, old + 0.5 * (online.detach() - old))


# ------------------------------------------------------------------------------------ acting
def test_actions_respect_asymmetric_bounds_and_reach_both_ends() -> None:
    config = small(envs_per_actor=64)
    spec = box_spec([0.0, -3.0], [1.0, 5.0])
    parameter = config.make_parameter(spec, torch.device("cpu"))
    parameter.version = 2  # trained params: the policy acts, not the uniform warmup
    worker = config.make_worker(spec, parameter, 0, 1, seed=1)
    obs = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    for bias, end in ((100.0, [1.0, 5.0]), (-100.0, [0.0, -3.0])):
        with torch.no_grad():  # a saturated mean: every action at one end of its range
            parameter.nets.actor.mean.weight.fill_(0.0)
            parameter.nets.actor.mean.bias.fill_(bias)
        for training in (True, False):
            worker.training = training
            action = worker.act(obs)
            assert action.shape == (64, 2) and action.dtype == np.float32
            assert (action >= [0.0, -3.0]).all() and (action <= [1.0, 5.0]).all()
            np.testing.assert_allclose(action, np.tile(end, (64, 1)), atol=1e-4)
    with torch.no_grad():
        parameter.nets.actor.mean.bias.fill_(0.0)


def test_untrained_params_act_uniformly_over_the_bounds_and_trained_ones_by_the_policy() -> None:
    config = small(envs_per_actor=256)
    spec = box_spec([0.0, -3.0], [1.0, 5.0])
    parameter = config.make_parameter(spec, torch.device("cpu"))
    worker = config.make_worker(spec, parameter, 0, 1, seed=1)
    obs = np.zeros((256, 3), np.float32)
    parameter.version = 1  # the untrained weights every run starts from
    uniform = worker.act(obs)
    assert uniform[:, 1].min() < -2.5 and uniform[:, 1].max() > 4.5  # the whole range, not the middle
    np.testing.assert_allclose(worker._action, (uniform - [0.5, 1.0]) / [0.5, 4.0], atol=1e-5)  # rows: [-1, 1]
    parameter.version = 2
    policy = worker.act(obs)  # the untrained actor's own Gaussian: narrow around the middle
    assert policy[:, 1].max() - policy[:, 1].min() < 0.8 * (uniform[:, 1].max() - uniform[:, 1].min())
    config.uniform_warmup = False
    parameter.version = 1
    assert worker.act(obs)[:, 1].max() < 4.5


def test_the_worker_s_rows_are_n_step_transitions_bootstrapping_after_a_time_limit_only() -> None:
    config = small(n_step=2, gamma=0.5, envs_per_actor=2)
    spec = box_spec([-2.0], [2.0], obs_dim=1)
    worker = config.make_worker(spec, config.make_parameter(spec, torch.device("cpu")), 0, 1, seed=0)
    worker.reset(np.arange(2), np.zeros((2, 1), np.float32))
    obs = np.zeros((2, 1), np.float32)
    for t in range(3):
        worker.act(obs)
        nxt = np.full((2, 1), t + 1, np.float32)
        end = t == 2
        worker.observe(np.array([1.0, 1.0]), nxt, np.array([False, end]), np.array([end, False]))
        obs = nxt
    rows = worker.take()
    assert rows is not None and worker.pending() == 0
    got = [(float(rows["obs"][k, 0]), float(rows["reward"][k]), float(rows["next_obs"][k, 0]),
            float(rows["discount"][k])) for k in range(len(rows["obs"]))]
    # emitted as they complete: each env's first at t=1, then env 0's last two and env 1's at t=2
    by_env = {0: [got[0], got[2], got[3]], 1: [got[1], got[4], got[5]]}
    # env 0 is cut by a time limit at t=2: its last rows bootstrap from the final observation (3)
    assert by_env[0] == [(0.0, 1.5, 2.0, 0.25), (1.0, 1.5, 3.0, 0.25), (2.0, 1.0, 3.0, 0.5)]
    # env 1 terminates at t=2: nothing follows its final observation
    assert by_env[1] == [(0.0, 1.5, 2.0, 0.25), (1.0, 1.5, 3.0, 0.0), (2.0, 1.0, 3.0, 0.0)]
    assert ((rows["action"] >= -1) & (rows["action"] <= 1)).all()


def test_sac_refuses_discrete_and_unbounded_actions_saying_what_to_use() -> None:
    with pytest.raises(EnvError, match="use DQN, PPO or IMPALA"):
        srl.Runner("CartPole-v1", small()).train(max_steps=10)
    unbounded = EnvSpec("test/Free", (3,), BoxActions((1,), np.array([-np.inf], np.float32),
                                                       np.array([np.inf], np.float32)))
    with pytest.raises(EnvError, match="unbounded actions"):
        small().check_spec(unbounded)
    assert isinstance(env_spec(EnvConfig("CartPole-v1")).actions, DiscreteActions)


# ------------------------------------------------------------------------------------ one process: learn, save, resume
def test_a_short_run_learns_something_on_pendulum() -> None:
    """A small budget: the trained policy beats the untrained one on the same evaluation seeds."""
    runner = srl.Runner(PENDULUM, small(warmup_size=256, batch_size=64))
    untrained = float(np.mean(runner.evaluate(max_episodes=3, seed=3)))
    runner.train(max_train_count=2500)
    trained = float(np.mean(runner.evaluate(max_episodes=3, seed=3)))
    assert trained > untrained + 200, (untrained, trained)


def test_a_checkpoint_keeps_the_three_optimizers_the_targets_and_the_temperature(tmp_path: Path) -> None:
    runner = srl.Runner(PENDULUM, small())
    runner.train(max_train_count=100)
    scores = runner.evaluate(max_episodes=2, seed=7)
    runner.save(tmp_path / "sac.safetensors")
    again = srl.Runner.from_checkpoint(tmp_path / "sac.safetensors")
    assert again.evaluate(max_episodes=2, seed=7) == scores
    again.train(max_steps=1)  # builds the learner, which loads the trainer state
    before, after = runner._learner, again._learner
    assert isinstance(before, sac.SACLearner) and isinstance(after, sac.SACLearner)
    assert after.alpha() == before.alpha() != 1.0
    for name in ("optimizer", "actor_optimizer", "alpha_optimizer"):
        saved, loaded = getattr(before, name).state_dict()["state"], getattr(after, name).state_dict()["state"]
        assert saved and loaded.keys() == saved.keys(), name  # a fresh optimizer would hold no state
        for index, entries in saved.items():
            torch.testing.assert_close(loaded[index]["exp_avg"], entries["exp_avg"])
    for a, b in zip(before.target_q2.parameters(), after.target_q2.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    count = again.train_count
    again.train(max_train_count=50)
    assert again.train_count > count


# ------------------------------------------------------------------------------------ distributed
@pytest.mark.slow
def test_a_short_distributed_sac_run_ends_with_an_evaluation(
    broker: Broker, redis_url: str, namespace: str  # noqa: F811
) -> None:
    runner = srl.Runner(PENDULUM, small(warmup_size=128, publish_every=20))
    short_distributed_run(runner, redis_url, namespace, 100, broker.url)
