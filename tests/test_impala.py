"""IMPALA's V-trace against the paper's recursion by hand, and learning in one process."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import srl
from srl.algorithms import impala, ppo
from srl.base.checkpoint import saved_rl_config
from srl.base.env import EnvConfig, EnvSpec, env_spec
from srl.base.rollout import Rollout
from srl.rl.blocks import MLPBlockConfig


def test_vtrace_matches_the_recursion_computed_by_hand() -> None:
    gamma, lam, rho_bar, c_bar = 0.9, 1.0, 1.0, 1.0
    rhos = np.array([2.0, 0.5, 1.0])  # behaviour took the first action less often than the target would
    rewards = np.array([1.0, 0.0, 2.0])
    values = np.array([0.5, 1.0, 0.2])
    bootstrap = 3.0
    discounts = np.array([gamma, gamma, 0.0])  # the episode ends at step 2
    vs, adv = impala.vtrace(
        *(torch.from_numpy(np.array([x])) for x in (np.log(rhos), discounts, rewards, values, bootstrap)),
        rho_bar, c_bar, lam,
    )
    rho = np.minimum(rho_bar, rhos)
    c = lam * np.minimum(c_bar, rhos)
    next_v = np.array([values[1], values[2], bootstrap])
    delta = rho * (rewards + discounts * next_v - values)
    # v_s - V(x_s) = δ_s + γ_s c_s (v_{s+1} - V(x_{s+1})), backwards from the end
    d2 = delta[2]
    d1 = delta[1] + discounts[1] * c[1] * d2
    d0 = delta[0] + discounts[0] * c[0] * d1
    expected_vs = values + np.array([d0, d1, d2])
    np.testing.assert_allclose(vs.numpy()[0], expected_vs, rtol=1e-6)
    next_vs = np.array([expected_vs[1], expected_vs[2], bootstrap])
    np.testing.assert_allclose(adv.numpy()[0], rho * (rewards + discounts * next_vs - values), rtol=1e-6)


def test_vtrace_on_policy_is_the_lambda_return() -> None:
    """All ratios 1: V-trace's targets are the λ-returns (TD(λ) with the same critic)."""
    rng = np.random.default_rng(0)
    n, horizon, gamma, lam = 2, 6, 0.95, 0.8
    rewards, values = rng.normal(size=(n, horizon)), rng.normal(size=(n, horizon))
    done = np.zeros((n, horizon), bool)
    done[0, 3] = True
    discounts = gamma * (1.0 - done)
    bootstrap = rng.normal(size=n)
    vs, _ = impala.vtrace(torch.zeros(n, horizon, dtype=torch.float64), torch.tensor(discounts),
                          torch.tensor(rewards), torch.tensor(values), torch.tensor(bootstrap), lam=lam)
    # the λ-return G_t = r_t + γ_t ((1 - λ) V(x_{t+1}) + λ G_{t+1}), G_T = V(x_T)
    expected = np.zeros((n, horizon))
    next_g, next_v = bootstrap.copy(), bootstrap.copy()
    for t in reversed(range(horizon)):
        expected[:, t] = rewards[:, t] + discounts[:, t] * ((1 - lam) * next_v + lam * next_g)
        next_g, next_v = expected[:, t], values[:, t]
    np.testing.assert_allclose(vs.numpy(), expected, rtol=1e-6)
    # and it agrees with PPO's GAE returns, the same quantity written the other way round
    _, gae_returns = ppo.gae(rewards.astype(np.float32), values.astype(np.float32), done,
                             bootstrap.astype(np.float32), gamma, lam)
    np.testing.assert_allclose(vs.numpy(), gae_returns, rtol=1e-4, atol=1e-5)


def test_impala_takes_batches_from_its_fifo_once() -> None:
    config = impala.Config(seed=0, envs_per_actor=4, batch_segments=8, segment_length=5, publish_every=1)
    runner = srl.Runner("CartPole-v1", config)
    runner.train(max_steps=4 * 5 * 2 * 3, progress_interval=None)  # 24 segments: 3 batches of 8
    assert runner.train_count == 3
    assert runner.parameter.version == 1 + 3  # the first weights, and a version per publication it would make...
    trainer = runner._learner
    assert trainer is not None and len(trainer.buffer) == 0  # ...and every segment was used once


@pytest.mark.slow
def test_impala_learns_cartpole_in_a_small_budget() -> None:
    runner = srl.Runner("CartPole-v1", impala.Config(seed=0))
    runner.train(max_steps=100_000, progress_interval=None)
    assert np.mean(runner.evaluate(max_episodes=10)) >= 195


@pytest.mark.parametrize(("adam_eps", "moves"), [(None, False), (1e-8, True)])
def test_a_step_on_gradients_of_noise_moves_the_weights_little_unless_adam_eps_is_tiny(
    adam_eps: float | None, moves: bool
) -> None:
    """A solved task leaves the policy gradient tiny noise: with the default ``adam_eps`` a step on it is
    about gradient / eps * lr, far below lr; with Adam's usual 1e-8 it is lr-sized whatever the gradient
    (what walked solved CartPole policies away: docs/benchmarks.md)."""
    config = impala.Config(seed=0) if adam_eps is None else impala.Config(seed=0, adam_eps=adam_eps)
    spec = srl.Runner("CartPole-v1", config).spec
    parameter = config.make_parameter(spec, torch.device("cpu"))
    learner = config.make_learner(spec, parameter, config.make_buffer(spec))
    assert learner.optimizer.param_groups[0]["eps"] == config.adam_eps
    params = list(parameter.net.parameters())
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, 1e-6)
    learner.optimizer.param_groups[0]["lr"] = 1e-3
    learner.optimizer.step()
    largest = max(float((p.detach() - b).abs().max()) for p, b in zip(params, before, strict=True))
    assert (largest > 0.5e-3) if moves else (largest < 0.05e-3), largest


def test_the_clipped_policy_term_stops_pushing_a_ratio_out_of_its_range() -> None:
    """π/μ at 1.5 with a positive advantage: no gradient (the clip holds it); with a negative one the
    gradient brings it back; at 1 the gradient is the paper's (−A per row, mean over rows)."""
    behaviour = torch.log(torch.tensor([[0.4, 0.4, 0.4, 0.4]]))
    logprob = torch.log(torch.tensor([[0.6, 0.6, 0.4, 0.4]])).requires_grad_(True)  # r = 1.5, 1.5, 1, 1
    advantages = torch.tensor([[1.0, -1.0, 2.0, -3.0]])
    impala.policy_term(logprob, behaviour, advantages, 0.1).backward()
    assert logprob.grad is not None
    expected = torch.tensor([[0.0, 1.5 / 4, -2.0 / 4, 3.0 / 4]])  # d/dlogπ of −r A / 4 is −r A / 4
    assert torch.allclose(logprob.grad, expected), logprob.grad
    paper = logprob.detach().clone().requires_grad_(True)
    impala.policy_term(paper, behaviour, advantages, None).backward()
    assert paper.grad is not None and torch.allclose(paper.grad, -advantages / 4)


def test_on_policy_rows_train_the_same_with_and_without_the_clip() -> None:
    """One process acts with the learner's own weights (π = μ): the clip never binds, so the weights after
    a few steps match the paper's loss (up to float rounding), and they did move."""
    initial, trained = [], []
    for clip_ratio in (0.1, 0.0):
        config = impala.Config(seed=3, envs_per_actor=4, batch_segments=4, segment_length=8, clip_ratio=clip_ratio)
        runner = srl.Runner("CartPole-v1", config)
        initial.append(runner.parameter.to_arrays())
        runner.train(max_steps=4 * 8 * 5, progress_interval=None)
        assert runner.train_count == 5
        trained.append(runner.parameter.to_arrays())
    names = sorted(trained[0])
    assert names == sorted(trained[1])
    assert all(np.array_equal(initial[0][k], initial[1][k]) for k in names)
    assert not all(np.allclose(trained[0][k], initial[0][k], atol=1e-4) for k in names)
    for name in names:
        assert np.allclose(trained[0][name], trained[1][name], atol=1e-5), name


def test_presets_follow_the_action_family_and_a_field_set_wins(caplog: pytest.LogCaptureFixture) -> None:
    """Box normalizes observations and rewards (CleanRL's continuous-action PPO does); Discrete keeps them raw;
    a field the user sets is never the preset's; a run says what it took."""
    discrete = impala.Config().resolved(env_spec(EnvConfig("CartPole-v1")))
    box = impala.Config().resolved(env_spec(EnvConfig("Pendulum-v1")))
    assert (discrete.normalize_obs, discrete.normalize_reward) == (False, False)
    assert (box.normalize_obs, box.normalize_reward) == (True, True)
    assert impala.Config(normalize_reward=False).resolved(env_spec(EnvConfig("Pendulum-v1"))).normalize_reward is False
    with caplog.at_level("INFO", logger="srl.impala"):
        config = impala.Config(normalize_obs=False)
        assert config.settled(EnvConfig("Pendulum-v1")) is config  # None stays None: resolved where used
    assert "the box preset for 'Pendulum-v1': normalize_reward True (set them" in caplog.text, caplog.text
    # a checkpoint written before rewards could be scaled reads as unscaled, whatever the family
    saved = saved_rl_config({"rl_config": {"normalize_obs": False}}, impala.Config)
    assert saved["normalize_reward"] is False


def test_a_recurrent_config_over_discrete_vectors_takes_recurrent_ppos_preset_and_the_run_says_so(
    caplog: pytest.LogCaptureFixture
) -> None:
    """Recurrent over Discrete vectors: recurrent PPO's preset (its network, 20 steps clipped at 0.2 a batch of 32,
    the learning rate annealed, advantages centred and scaled, γ 0.98, λ 0.8); recurrent over Box, and
    feed-forward anywhere, the paper's learner as before; a field set wins; the data path's segment length is
    the preset's once resolved (actors' pacing counts served segments by it); the run's first line names every
    value that depends on the family."""
    novel = env_spec(EnvConfig("srl/CartPoleNoVel-v1"))
    recurrent = impala.Config(recurrent="lstm").resolved(novel)
    assert (recurrent.epochs, recurrent.segment_length, recurrent.norm_adv, recurrent.lr, recurrent.gamma,
            recurrent.vtrace_lambda, recurrent.entropy_cost, recurrent.max_grad_norm) == (20, 32, True, 1e-3, 0.98,
                                                                                          0.8, 0.0, 0.5)
    assert (recurrent.cell_first, recurrent.normalize_obs, recurrent.hidden_block) == (
        True, True, MLPBlockConfig((64,), "relu"))
    assert (recurrent.clip_ratio, recurrent.anneal_lr) == (0.2, True)
    for config, env in ((impala.Config(), "CartPole-v1"), (impala.Config(recurrent="lstm"), "srl/PendulumNoVel-v1"),
                        (impala.Config(), "Pendulum-v1")):
        paper = config.resolved(env_spec(EnvConfig(env)))
        assert (paper.epochs, paper.segment_length, paper.norm_adv, paper.lr, paper.gamma, paper.vtrace_lambda,
                paper.entropy_cost, paper.max_grad_norm, paper.cell_first, paper.hidden_block, paper.clip_ratio,
                paper.anneal_lr) == (1, 16, False, 2e-3, 0.99, 1.0, 0.01, 40.0, False, MLPBlockConfig((64, 64), "tanh"),
                                     0.1, False), env
    mine = impala.Config(recurrent="gru", epochs=4, segment_length=20, cell_first=False).resolved(novel)
    assert (mine.epochs, mine.segment_length, mine.cell_first, mine.norm_adv) == (4, 20, False, True)
    assert impala.Config(recurrent="lstm").data_path().segment_length == 0  # not known before the env is
    assert impala.Config(recurrent="lstm").resolved(novel).data_path().segment_length == 32
    with caplog.at_level("INFO", logger="srl.impala"):
        impala.Config(recurrent="lstm", lr=3e-4).settled(EnvConfig("srl/CartPoleNoVel-v1"))
    assert ("the recurrent discrete preset for 'srl/CartPoleNoVel-v1': normalize_obs True, normalize_reward False, "
            "hidden_block 64 relu, "
            "cell_first True, segment_length 32, epochs 20, norm_adv True, gamma 0.98, vtrace_lambda 0.8, "
            "entropy_cost 0, max_grad_norm 0.5, clip_ratio 0.2, anneal_lr True (set them") in caplog.text, caplog.text
    with pytest.raises(ValueError, match="anneal_lr, clip_ratio, entropy_cost, epochs, gamma, lr, max_grad_norm, "
                                         r"norm_adv, vtrace_lambda left to the preset: give it config\.resolved"):
        impala.IMPALALearner(impala.Config(), None, None)  # type: ignore[arg-type]


def test_scaled_rewards_train_and_their_statistics_travel_with_a_takeover() -> None:
    """With rewards scaled (the Box preset), a learner's return statistics move as it trains, are in its
    checkpoint state and its takeover state, and a successor that loads them scales as it did."""
    runner = srl.Runner("Pendulum-v1", impala.Config(seed=0, envs_per_actor=4, batch_segments=4))
    runner.train(max_steps=2_000)
    learner = runner._learner
    assert isinstance(learner, impala.IMPALALearner) and learner.config.normalize_reward
    assert float(learner.return_rms.count) > 1.0 and float(learner.return_rms.var) > 0.0
    arrays, _ = learner.extra_state()
    assert any(key.startswith("return_rms") for key in arrays)
    successor = impala.Config().make_learner(runner.spec, runner.parameter, impala.Config().make_buffer(runner.spec))
    successor.load_takeover_state(learner.takeover_state())
    reward, done = np.full((2, 16), -8.0, np.float32), np.zeros((2, 16), bool)
    assert np.array_equal(successor.scale_rewards(reward.copy(), done, 0.99),
                          learner.scale_rewards(reward.copy(), done, 0.99))


def one_batch(config: impala.Config, env: str) -> tuple[EnvSpec, dict[str, np.ndarray]]:
    """The spec of ``env`` and one batch of ``config.batch_segments`` segments a fresh worker acted there, with
    the weights ``torch.manual_seed(0)`` gives (as a learner built after the same seed has)."""
    spec = env_spec(EnvConfig(env))
    torch.manual_seed(0)
    parameter = config.make_parameter(spec, torch.device("cpu"))
    worker = config.make_worker(spec, parameter, 0, 1, 0)
    rows: dict[str, np.ndarray] | None = None
    with Rollout(EnvConfig(env), worker, config.envs_per_actor, seed=0) as rollout:
        while rows is None:
            rollout.step()
            rows = worker.take()
    assert len(rows["version"]) == config.batch_segments
    return spec, rows


@pytest.mark.parametrize("recurrent", [None, "lstm"])
def test_epochs_step_on_one_batch_as_the_same_batch_taken_that_many_times_would(recurrent: str | None) -> None:
    """``epochs=3`` is three gradient steps on one batch, each with π, V and the V-trace targets recomputed
    from the weights as they are: the weights end where three batches of the same segments take them, and the
    train count counts the gradient steps. (The observations' statistics stay out: they move once a batch.)"""
    config = impala.Config(seed=0, envs_per_actor=4, batch_segments=4, segment_length=8, recurrent=recurrent,
                           normalize_obs=False)
    spec, rows = one_batch(config, "srl/CartPoleNoVel-v1")
    ends = []
    for epochs, batches in ((3, 1), (1, 3)):
        each = dataclasses.replace(config, epochs=epochs)
        torch.manual_seed(0)
        parameter = each.make_parameter(spec, torch.device("cpu"))
        learner = each.make_learner(spec, parameter, each.make_buffer(spec))
        for _ in range(batches):
            learner.buffer.add({k: v.copy() for k, v in rows.items()})
        steps = [learner.train() for _ in range(batches)]
        assert [s.gradient_steps for s in steps if s is not None] == [epochs] * batches
        assert learner.train_count == 3 and len(learner.buffer) == 0
        ends.append(parameter.to_arrays())
    torch.manual_seed(0)
    initial = config.make_parameter(spec, torch.device("cpu")).to_arrays()
    assert not all(np.allclose(ends[0][k], initial[k], atol=1e-4) for k in initial)  # they moved
    for name in initial:
        np.testing.assert_allclose(ends[0][name], ends[1][name], atol=1e-6, err_msg=name)


def test_norm_adv_centres_each_batch_s_advantages() -> None:
    """On-policy rows (π = μ) make the policy term −mean(A): zero once the advantages are centred and
    scaled, and CartPole's rewards of 1 against an untrained critic make it far from zero without."""
    losses = {}
    for norm_adv in (False, True):
        config = impala.Config(seed=0, envs_per_actor=4, batch_segments=4, segment_length=8, norm_adv=norm_adv)
        spec, rows = one_batch(config, "CartPole-v1")
        torch.manual_seed(0)
        parameter = config.make_parameter(spec, torch.device("cpu"))
        learner = config.make_learner(spec, parameter, config.make_buffer(spec))
        learner.buffer.add(rows)
        stats = learner.train()
        assert stats is not None
        losses[norm_adv] = stats.policy_loss
    assert abs(losses[True]) < 1e-5 and abs(losses[False]) > 0.1, losses


def test_several_epochs_without_the_clip_are_refused() -> None:
    with pytest.raises(ValueError, match=r"epochs=4 takes .*clip_ratio=0 .*set clip_ratio"):
        impala.Config(epochs=4, clip_ratio=0.0).validate()
    config = impala.Config(recurrent="lstm", clip_ratio=0.0)
    config.validate()  # its epochs are the preset's: known once the env is
    config.check_spec(env_spec(EnvConfig("srl/PendulumNoVel-v1")))  # one a batch over Box
    with pytest.raises(ValueError, match=r"epochs=20 \(the discrete preset's\) takes .*clip_ratio=0 .*or epochs=1"):
        config.check_spec(env_spec(EnvConfig("srl/CartPoleNoVel-v1")))
    impala.Config(epochs=4).validate()
