"""Env adapter, config-as-data, DQN worker/parameter pieces, Runner smoke runs."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

import srl
from srl.algorithms import UnknownAlgorithmError, config_class, dqn, r2d2
from srl.base.config import ConfigError, config_from_dict, config_to_dict
from srl.base.env import BoxActions, EnvConfig, EnvError, EnvSpec, MultiDiscreteActions, env_spec
from srl.base.preprocessing import install_command
from srl.base.rl import DataPath
from srl.rl.blocks import to_device


def random_rows(n: int, reward_std: float = 1.0) -> dict[str, np.ndarray]:
    """``n`` random one-step CartPole transitions (seeded: the same rows every call)."""
    rng = np.random.default_rng(0)
    return {
        "obs": rng.normal(size=(n, 4)).astype(np.float32), "action": rng.integers(0, 2, n),
        "reward": (reward_std * rng.normal(size=n)).astype(np.float32),
        "next_obs": rng.normal(size=(n, 4)).astype(np.float32),
        "discount": np.full(n, 0.99, np.float32), "version": np.zeros(n, np.int64),
    }


def small_config(**changes: object) -> dqn.Config:
    """A small DQN that steps one env, at ``epsilon``."""
    config = dqn.Config(batch_size=16, warmup_size=64, seed=1, envs_per_actor=1)
    config.hidden_block.set_mlp((16, 16))
    config.memory.set_replay_memory(1000)
    for k, v in changes.items():
        setattr(config, k, v)
    return config


# ------------------------------------------------------------------ env spaces (DQN's binning is its own)
def test_box_actions_are_binned_by_dqn_per_dimension() -> None:
    spec = env_spec(EnvConfig("Pendulum-v1"))
    assert isinstance(spec.actions, BoxActions) and spec.actions.shape == (1,)
    table = dqn.action_table(spec, action_bins=5)
    assert table is not None
    np.testing.assert_allclose(table.reshape(-1), [-2.0, -1.0, 0.0, 1.0, 2.0])
    assert dqn.action_count(spec, 5) == 5


def test_multi_dimensional_box_grid_is_the_cartesian_product() -> None:
    spec = EnvSpec("two-dim", (4,), BoxActions((2,), np.array([-1.0, 0.0], np.float32),
                                              np.array([1.0, 2.0], np.float32)))
    table = dqn.action_table(spec, action_bins=3)
    assert table is not None and table.shape == (9, 2)
    assert {tuple(r) for r in table.tolist()} == {(a, b) for a in (-1.0, 0.0, 1.0) for b in (0.0, 1.0, 2.0)}


def test_multi_discrete_actions_are_the_product_for_dqn() -> None:
    spec = EnvSpec("md", (2,), MultiDiscreteActions((2, 3)))
    table = dqn.action_table(spec, action_bins=5)
    assert table is not None and table.shape == (6, 2) and table.dtype == np.int64
    with pytest.raises(EnvError, match="more than 4096"):
        dqn.action_count(EnvSpec("big", (2,), MultiDiscreteActions((100, 100))), 5)


def test_obs_affine_maps_bounded_dimensions_onto_unit_range() -> None:
    pendulum = env_spec(EnvConfig("Pendulum-v1"))  # cos, sin in [-1, 1]; angular velocity in [-8, 8]
    affine = pendulum.obs_affine()
    assert affine is not None
    np.testing.assert_allclose(affine[0], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(affine[1], [1.0, 1.0, 8.0])
    cartpole = env_spec(EnvConfig("CartPole-v1"))  # the velocities are unbounded: left as they are
    affine = cartpole.obs_affine()
    assert affine is not None
    np.testing.assert_allclose(affine[1], [4.8, 1.0, 0.41887903, 1.0], rtol=1e-6)
    skewed = EnvSpec("skewed", (3,), MultiDiscreteActions((2,)), obs_low=np.array([0.0, -np.inf, -1e9], np.float32),
                     obs_high=np.array([1.0, 5.0, 1e9], np.float32))
    affine = skewed.obs_affine()
    assert affine is not None
    np.testing.assert_allclose(affine[0], [0.5, 0.0, 0.0])
    np.testing.assert_allclose(affine[1], [0.5, 1.0, 1.0])  # "any float" bounds are no scale
    assert EnvSpec("onehot", (4,), MultiDiscreteActions((2,)), obs_onehot=4).obs_affine() is None
    assert env_spec(EnvConfig("FrozenLake-v1")).obs_affine() is None


def test_dqn_scales_bounded_obs_inside_its_network_and_publishes_the_same_arrays() -> None:
    spec = env_spec(EnvConfig("Pendulum-v1"))
    scaled = dqn.DQNParameter(small_config(scale_obs=True), spec, torch.device("cpu"))
    plain = dqn.DQNParameter(small_config(), spec, torch.device("cpu"))
    assert scaled.to_arrays().keys() == plain.to_arrays().keys()  # the map is not part of the params
    plain.from_arrays(scaled.to_arrays())
    obs = torch.tensor([[-1.0, 0.1, 6.0], [0.5, -0.8, -2.0]])
    with torch.no_grad():
        torch.testing.assert_close(scaled.q(obs), plain.q(obs / torch.tensor([1.0, 1.0, 8.0])))
        assert not torch.allclose(scaled.q(obs), plain.q(obs))


def test_dqn_reward_scale_none_is_settled_from_the_env_before_training() -> None:
    scale, std = dqn.probe_reward_scale(EnvConfig("Pendulum-v1"))
    assert scale == 10**-0.5 and 10**0.25 < std < 10**0.75  # Pendulum's rewards lie in [-16.3, 0]
    assert dqn.probe_reward_scale(EnvConfig("CartPole-v1")) == (1.0, 0.0)  # +1 a step: left alone
    assert dqn.probe_reward_scale(EnvConfig("FrozenLake-v1"))[0] == 1.0  # small rewards are not blown up
    mine = small_config(reward_scale=None)
    auto = srl.Runner("Pendulum-v1", mine)
    auto.train(max_steps=200, progress_interval=None)
    assert auto.rl_config.reward_scale == 10**-0.5  # type: ignore[attr-defined]
    assert auto.task_config()["rl_config"]["reward_scale"] == 10**-0.5  # what a checkpoint or a task carries
    assert mine.reward_scale is None  # the runner's copy was settled: the same config may serve another env
    cartpole = srl.Runner("CartPole-v1", mine)
    cartpole.train(max_steps=10, progress_interval=None)
    assert cartpole.rl_config.reward_scale == 1.0  # type: ignore[attr-defined]
    chosen = srl.Runner("Pendulum-v1", small_config(reward_scale=10**-0.5))
    chosen.train(max_steps=200, progress_interval=None)
    for name, value in auto.parameter.to_arrays().items():  # the settled run is the run with that scale chosen
        np.testing.assert_array_equal(value, chosen.parameter.to_arrays()[name], err_msg=name)
    kept = srl.Runner("Pendulum-v1", small_config(reward_scale=0.5))
    kept.train(max_steps=10, progress_interval=None)
    assert kept.rl_config.reward_scale == 0.5  # type: ignore[attr-defined]


def test_a_node_refuses_a_task_whose_reward_scale_no_client_settled() -> None:
    import json

    from srl.runner.distribution.settings.task import TaskConfigError, build_task

    task = {**srl.Runner("Pendulum-v1", small_config(reward_scale=None)).task_config(), "actor_num": 1}
    with pytest.raises(TaskConfigError, match=r"reward_scale of dqn.Config are not set"):
        build_task(json.dumps(task))
    task["rl_config"]["reward_scale"] = 0.1
    assert build_task(json.dumps(task)).rl_config.reward_scale == 0.1  # type: ignore[attr-defined]


def test_misspelled_env_names_close_ids() -> None:
    with pytest.raises(EnvError, match="Pendulum-v1"):
        EnvConfig("Pendulm-v1").make()


@pytest.fixture
def env_needing_an_absent_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A registered env whose module imports one that is not installed, as gymnasium's MuJoCo envs
    import mujoco and imageio."""
    (tmp_path / "srl_test_env_with_a_dependency.py").write_text(
        "import srl_test_absent_dependency  # noqa: F401\n\nclass Env:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env_id = "srl-test/NeedsAbsent-v0"
    gym.register(env_id, entry_point="srl_test_env_with_a_dependency:Env")
    try:
        yield env_id
    finally:
        gym.registry.pop(env_id, None)


def test_an_env_whose_dependency_is_missing_names_it_and_what_to_install(env_needing_an_absent_module: str
                                                                         ) -> None:
    with pytest.raises(EnvError) as refused:
        _ = srl.Runner(env_needing_an_absent_module, dqn.Config()).spec
    message = str(refused.value)
    assert env_needing_an_absent_module in message and "'srl_test_absent_dependency'" in message
    assert "pip install" in message and "Did you mean" not in message


def test_a_registered_env_whose_module_is_missing_names_it() -> None:
    env_id = "srl-test/ModuleAbsent-v0"
    gym.register(env_id, entry_point="srl_test_absent_package.envs:Env")
    try:
        with pytest.raises(EnvError, match=r"ModuleAbsent-v0' needs the module 'srl_test_absent_package'.*pip install"):
            EnvConfig(env_id).make()
    finally:
        gym.registry.pop(env_id, None)


def test_mujoco_envs_say_to_install_srls_mujoco_extra() -> None:
    # whichever of mujoco and imageio is absent, the command is the extra that brings both
    for missing in ("mujoco", "imageio"):
        assert install_command("InvertedPendulum-v5", missing) == "pip install 'srl[mujoco]'"
    assert install_command("LunarLander-v3", "Box2D") == "pip install 'gymnasium[box2d]'"
    if importlib.util.find_spec("mujoco") is None or importlib.util.find_spec("imageio") is None:
        with pytest.raises(EnvError, match=r"'InvertedPendulum-v5' needs .*pip install 'srl\[mujoco\]'") as e:
            _ = srl.Runner("InvertedPendulum-v5", dqn.Config()).spec
        assert "Did you mean" not in str(e.value)


def test_unsupported_space_says_which_space() -> None:
    from gymnasium.spaces import Box, Dict, MultiBinary

    from srl.base.env import make_spec

    class DictObs:
        observation_space = Dict({"a": Box(0, 1, (2,))})
        action_space = MultiBinary(3)

    with pytest.raises(EnvError, match=r"cannot use the observation space Dict"):
        make_spec(DictObs(), "dict-env")  # type: ignore[arg-type]


# ------------------------------------------------------------------ config as data
def test_config_round_trips_through_plain_data() -> None:
    config = small_config(gamma=0.95, n_step=5)
    config.memory.set_proportional_memory(capacity=5000, alpha=0.7)
    data = config_to_dict(config)
    import json

    rebuilt = config_from_dict(config_class("dqn"), json.loads(json.dumps(data)))
    assert rebuilt == config
    assert rebuilt.hidden_block.layer_sizes == (16, 16)


def test_config_with_misspelled_field_names_it() -> None:
    data = config_to_dict(small_config())
    data["gamme"] = 0.9
    with pytest.raises(ConfigError, match=r"Config.gamme.*did you mean 'gamma'"):
        config_from_dict(dqn.Config, data)


def test_unknown_algorithm_lists_known() -> None:
    with pytest.raises(UnknownAlgorithmError, match=r"Did you mean 'dqn'"):
        config_class("dqm")


# ------------------------------------------------------------------ DQN pieces
def make_worker(config: dqn.Config) -> dqn.DQNWorker:
    runner = srl.Runner("CartPole-v1", config)
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    assert isinstance(worker, dqn.DQNWorker)
    return worker


def run_episode(worker: dqn.DQNWorker, obs: list[np.ndarray], rewards: list[float], terminated_at: int | None,
                truncated_at: int | None = None) -> list[int]:
    """Feed one env's episode to the worker; the actions it chose."""
    worker.reset(np.array([0]), obs[0][None])
    actions = []
    for t, r in enumerate(rewards):
        actions.append(int(worker.act(obs[t][None])[0]))
        worker.observe(np.array([r], np.float32), obs[t + 1][None], np.array([t == terminated_at]),
                       np.array([t == truncated_at]))
    return actions


def test_n_step_returns_match_a_hand_computed_episode() -> None:
    worker = make_worker(small_config(gamma=0.5, n_step=3))
    worker.parameter.version = 7
    obs = [np.full(4, i, np.float32) for i in range(6)]
    actions = run_episode(worker, obs, [1.0, 2.0, 4.0, 8.0, 16.0], terminated_at=4)
    cols = worker.take()
    assert cols is not None and worker.pending() == 0
    # t=0: 1 + .5*2 + .25*4 = 3, bootstraps from obs3 with .125
    # t=1: 2 + 2 + 2 = 6 from obs4; t=2: 4 + 4 + 4 = 12 from obs5 but episode terminated -> discount 0
    np.testing.assert_allclose(cols["reward"], [3.0, 6.0, 12.0, 16.0, 16.0])
    np.testing.assert_allclose(cols["discount"], [0.125, 0.125, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(cols["next_obs"][:, 0], [3, 4, 5, 5, 5])
    np.testing.assert_allclose(cols["obs"][:, 0], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(cols["action"], actions)
    np.testing.assert_array_equal(cols["version"], [7] * 5)  # the params version that chose each action


def test_truncated_episode_keeps_bootstrapping() -> None:
    worker = make_worker(small_config(gamma=0.5, n_step=3))
    o = [np.full(4, i, np.float32) for i in range(3)]
    run_episode(worker, o, [1.0, 1.0], terminated_at=None, truncated_at=1)
    cols = worker.take()
    assert cols is not None
    np.testing.assert_allclose(cols["reward"], [1.5, 1.0])
    np.testing.assert_allclose(cols["discount"], [0.25, 0.5])


def test_each_env_has_its_own_n_step_window() -> None:
    config = small_config(gamma=0.5, n_step=2, envs_per_actor=2)
    runner = srl.Runner("CartPole-v1", config)
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    obs = np.zeros((2, 4), np.float32)
    worker.reset(np.arange(2), obs)
    worker.act(obs)
    worker.observe(np.array([1.0, 10.0], np.float32), obs + 1, np.array([False, True]), np.array([False, False]))
    cols = worker.take()  # env 1 ended: its one transition comes out at once; env 0 waits for its second step
    assert cols is not None
    np.testing.assert_allclose(cols["reward"], [10.0])
    np.testing.assert_allclose(cols["discount"], [0.0])
    worker.act(obs + 1)
    worker.observe(np.array([2.0, 20.0], np.float32), obs + 2, np.array([False, False]), np.array([False, False]))
    cols = worker.take()
    assert cols is not None
    np.testing.assert_allclose(cols["reward"], [1.0 + 0.5 * 2.0])  # env 0's 2-step return; env 1 restarted


def test_apex_epsilon_schedule() -> None:
    config = dqn.Config(envs_per_actor=1)
    np.testing.assert_allclose(config.actor_epsilon(0, 1), [config.epsilon])
    np.testing.assert_allclose(config.actor_epsilon(0, 8), [0.4])
    np.testing.assert_allclose(config.actor_epsilon(7, 8), [0.4**8])
    np.testing.assert_allclose(config.actor_epsilon(3, 8), [0.4 ** (1 + 7 * 3 / 7)])


@pytest.mark.parametrize("module", [dqn, r2d2])
def test_apex_epsilon_spans_every_env_of_every_actor(module: Any) -> None:
    """An actor stepping E envs explores as E actors would: the schedule runs over actors x envs, and a lone
    actor with several envs has a near-greedy env beside exploring ones, not one ε for all."""
    config = module.Config(envs_per_actor=4, apex_epsilon=0.4)  # R2D2's is its family's preset otherwise
    schedule = [0.4 ** (1 + 7 * i / 7) for i in range(8)]
    np.testing.assert_allclose(np.concatenate([config.actor_epsilon(a, 2) for a in range(2)]), schedule)
    np.testing.assert_allclose(module.Config(envs_per_actor=2, apex_epsilon=0.4).actor_epsilon(0, 1), [0.4, 0.4**8])


def test_dqn_explores_with_two_apex_epsilons_in_one_process_by_default() -> None:
    """``dqn.Config()`` steps two envs an actor, so one process (or a lone actor) explores at 0.4 and 0.4**8
    rather than with one ε; two actors explore with four."""
    config = dqn.Config()
    np.testing.assert_allclose(config.actor_epsilon(0, 1), [0.4, 0.4**8])
    worker = make_worker(config)
    assert worker.num_envs == 2
    np.testing.assert_allclose(worker.epsilon, [0.4, 0.4**8])
    np.testing.assert_allclose(np.concatenate([config.actor_epsilon(a, 2) for a in range(2)]),
                               [0.4 ** (1 + 7 * i / 3) for i in range(4)])


def test_a_lone_env_anneals_epsilon_over_the_planned_env_steps() -> None:
    """ε falls linearly from epsilon_start to epsilon over epsilon_decay (half) of the 10,000 planned env steps."""
    worker = make_worker(small_config(epsilon_start=1.0, epsilon=0.05, epsilon_decay=0.5))
    worker.plan(10_000, None)
    seen = []
    for _ in range(6_001):
        worker.act(np.zeros((1, 4), np.float32))
        seen.append(float(worker.epsilon[0]))
    np.testing.assert_allclose([seen[0], seen[2_500], seen[5_000], seen[6_000]], [1.0, 0.525, 0.05, 0.05])
    assert np.all(np.diff(seen) <= 0.0)  # never back up
    assert worker.stats() == {"epsilon": pytest.approx(0.05)}


def test_a_worker_joining_a_run_under_way_anneals_from_where_its_params_are() -> None:
    """A replaced actor, or a resumed run's new worker, has acted in no env step yet: its params' version (one
    per publish_every train steps) says how far the run is: the warmup and 4 env steps per train step."""
    config = small_config(publish_every=10, env_steps_per_train=4.0, epsilon_start=1.0, epsilon=0.05,
                          epsilon_decay=1.0)
    worker = make_worker(config)
    worker.plan(None, 10_000)  # the warmup (64) and 40,000 env steps for the train steps
    worker.parameter.version = DataPath.FIRST_VERSION + 50  # 500 train steps: 64 + 2,000 env steps
    worker.act(np.zeros((1, 4), np.float32))
    np.testing.assert_allclose(worker.epsilon, [1.0 - 0.95 * 2_064 / 40_064])


@pytest.mark.parametrize(("changes", "plan"), [
    ({"epsilon_decay": 0.5}, (None, None)),  # a timeout alone plans no env steps
    ({"epsilon_decay": 0.5, "env_steps_per_train": None}, (None, 10_000)),  # actors flat out: nor do train steps
    ({"epsilon_decay": 0.0}, (None, 10_000)),
])
def test_epsilon_is_constant_without_planned_train_steps_or_decay(changes: dict[str, Any],
                                                                  plan: tuple[int | None, int | None]) -> None:
    worker = make_worker(small_config(**changes))
    worker.plan(*plan)
    worker.act(np.zeros((1, 4), np.float32))
    np.testing.assert_allclose(worker.epsilon, [worker.config.epsilon])


def test_several_envs_keep_apex_epsilons_whatever_the_plan() -> None:
    config = small_config()
    runner = srl.Runner("CartPole-v1", config)
    for actor_index, actor_num, envs in ((0, 1, 2), (1, 2, 1)):
        config.envs_per_actor = envs
        worker = config.make_worker(runner.spec, runner.parameter, actor_index, actor_num, 0)
        worker.plan(None, 10_000)
        worker.act(np.zeros((envs, 4), np.float32))
        np.testing.assert_allclose(worker.epsilon, config.actor_epsilon(actor_index, actor_num))


def test_runner_train_plans_the_workers_epsilon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runner.train hands its limits to the worker as absolute counts, as it does to the learner."""
    plans: list[tuple[int | None, int | None]] = []
    monkeypatch.setattr(dqn.DQNWorker, "plan", lambda self, steps, count: plans.append((steps, count)))
    runner = srl.Runner("CartPole-v1", small_config(warmup_size=16, batch_size=16))
    runner.train(max_train_count=20, progress_interval=None)
    runner.train(max_steps=30, progress_interval=None)
    assert plans == [(None, 20), (runner.env_steps, None)]


def test_each_env_explores_at_its_own_epsilon() -> None:
    worker = make_worker(small_config(envs_per_actor=2))
    parameter = worker.parameter
    np.testing.assert_allclose(worker.epsilon, [0.4, 0.4**8])
    worker.epsilon = np.array([1.0, 0.0])  # env 0 always uniform, env 1 always greedy
    obs = np.zeros((2, 4), np.float32)
    greedy = int(parameter.q(torch.from_numpy(obs[:1])).argmax())
    actions = np.array([worker.act(obs) for _ in range(400)])
    assert set(actions[:, 1]) == {greedy}
    assert 150 < int((actions[:, 0] != greedy).sum()) < 250  # about half of the uniform choices differ


def test_initial_priorities_are_abs_td_errors() -> None:
    config = small_config(double_q=False, n_step=1)
    worker = make_worker(config)
    cols = random_rows(8)
    pr = worker.initial_priorities(cols)
    with torch.no_grad():
        q = worker.parameter.q(torch.from_numpy(cols["obs"])).numpy()
        qn = worker.parameter.q(torch.from_numpy(cols["next_obs"])).numpy()
    expected = np.abs(cols["reward"] + 0.99 * qn.max(1) - q[np.arange(8), cols["action"]])
    np.testing.assert_allclose(pr, expected, rtol=1e-5, atol=1e-6)
    worker.config.advantage_learning = 0.5  # the target also subtracts half of the gap at s
    gap = q.max(1) - q[np.arange(8), cols["action"]]
    assert gap.max() > 0.01
    np.testing.assert_allclose(worker.initial_priorities(cols), np.abs(
        cols["reward"] + 0.99 * qn.max(1) - 0.5 * gap - q[np.arange(8), cols["action"]]), rtol=1e-5, atol=1e-6)


def test_parameter_round_trip_through_arrays() -> None:
    a = srl.Runner("CartPole-v1", small_config(seed=1))
    b = srl.Runner("CartPole-v1", small_config(seed=2))
    obs = torch.ones(1, 4)
    assert not torch.allclose(a.parameter.q(obs), b.parameter.q(obs))  # type: ignore[attr-defined]
    b.parameter.from_arrays(a.parameter.to_arrays())
    assert torch.allclose(a.parameter.q(obs), b.parameter.q(obs))  # type: ignore[attr-defined]


def test_parameters_of_another_shape_are_refused_by_name() -> None:
    a = srl.Runner("CartPole-v1", small_config())
    config = small_config()
    config.hidden_block.set_mlp((8,))
    b = srl.Runner("CartPole-v1", config)
    with pytest.raises(ValueError, match="has shape"):
        b.parameter.from_arrays(a.parameter.to_arrays())


def test_layer_norm_normalizes_each_hidden_layer_and_travels_with_the_config(tmp_path: object) -> None:
    config = small_config()
    config.hidden_block.layer_norm = True
    block, size = config.hidden_block.build(4)
    norms = [m for m in block if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 and size == 16
    pre = block[:2](torch.randn(32, 4) * 100.0)  # the first layer's pre-activations, normalized
    assert torch.allclose(pre.mean(dim=1), torch.zeros(32), atol=1e-5)
    assert torch.allclose(pre.std(dim=1, unbiased=False), torch.ones(32), atol=1e-3)
    runner = srl.Runner("CartPole-v1", config)
    runner.train(max_train_count=50, progress_interval=None)
    path = f"{tmp_path}/ln.safetensors"
    runner.save(path)
    assert srl.Runner.from_checkpoint(path).rl_config.hidden_block.layer_norm is True
    assert config_from_dict(dqn.Config, {"hidden_block": {"layer_sizes": [16, 16]}}).hidden_block.layer_norm is False


Weights = list[torch.Tensor]


def _target_after_steps(config: dqn.Config, steps: int) -> tuple[Weights, Weights, Weights]:
    """(target before, online after, target after) ``steps`` gradient steps on random CartPole rows."""
    runner = srl.Runner("CartPole-v1", config)
    memory = config.make_buffer(runner.spec)
    trainer = config.make_learner(runner.spec, runner.parameter, memory)
    memory.add(random_rows(config.warmup_size))
    before = [p.detach().clone() for p in trainer.target.parameters()]
    for _ in range(steps):
        assert trainer.train() is not None
    online = [p.detach().clone() for p in runner.parameter.q.parameters()]  # type: ignore[attr-defined]
    return before, online, [p.detach().clone() for p in trainer.target.parameters()]


def test_target_network_hard_copy_every_interval() -> None:
    before, online, after = _target_after_steps(small_config(target_update_interval=3), 2)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # not yet
    before, online, after = _target_after_steps(small_config(target_update_interval=3), 3)
    assert all(torch.equal(a, o) for a, o in zip(after, online, strict=True))  # copied at step 3


def test_target_network_polyak_moves_tau_of_the_way_each_step() -> None:
    before, online, after = _target_after_steps(small_config(target_tau=1.0), 1)
    assert all(torch.equal(a, o) for a, o in zip(after, online, strict=True))
    before, online, after = _target_after_steps(small_config(target_tau=0.25, target_update_interval=1), 1)
    for b, o, a in zip(before, online, after, strict=True):  # one step: target = b + 0.25 (online - b)
        torch.testing.assert_close(a, b + 0.25 * (o - b))
    assert not all(torch.equal(a, o) for a, o in zip(after, online, strict=True))


def _first_step(**changes: object) -> tuple[float, np.ndarray]:
    """(loss of the first gradient step, initial priorities of the rows) for a config on fixed random rows
    whose rewards of +-10 put TD errors well beyond Huber's quadratic zone; same seed, same weights."""
    runner = srl.Runner("CartPole-v1", small_config(**changes))
    config = runner.rl_config
    memory = config.make_buffer(runner.spec)
    trainer = config.make_learner(runner.spec, runner.parameter, memory)
    rows = random_rows(config.warmup_size, reward_std=10.0)
    priorities = config.make_worker(runner.spec, runner.parameter, 0, 1, 0).initial_priorities(rows)
    memory.add(rows, priorities)
    stats = trainer.train()
    assert stats is not None
    return stats.loss, priorities


def test_loss_setting_chooses_the_td_loss() -> None:
    mse, _ = _first_step(loss="mse")
    huber, _ = _first_step(loss="huber")
    assert mse > 2 * huber > 0  # squared errors of ~10 against |e| - 0.5


def test_value_rescale_reaches_the_trainer_and_the_priorities() -> None:
    plain_loss, plain_priorities = _first_step(loss="mse")
    loss, priorities = _first_step(loss="mse", value_rescale=True)
    assert loss < plain_loss / 4  # targets of ~10 become ~2.3 in h's units
    assert priorities.mean() < plain_priorities.mean() / 2


def test_value_rescale_is_invertible_and_shapes_the_target() -> None:
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-3)):  # float32: h^-1 divides by 2 * 0.001
        x = torch.tensor([-1e5, -700.0, -1.0, 0.0, 0.5, 100.0, 1e5], dtype=dtype)
        torch.testing.assert_close(dqn.unrescale(dqn.rescale(x)), x, rtol=tol, atol=tol)
    assert float(dqn.rescale(torch.tensor(-700.0))) > -30  # a Pendulum-sized value comes down to tens
    online = torch.tensor([[1.0, 3.0], [-2.0, -5.0]])  # chooses action 1, then action 0
    target = torch.tensor([[7.0, 4.0], [-6.0, -9.0]])  # values them: 4 and -6 (its own max would say 7)
    reward, discount = torch.tensor([1.0, -10.0]), torch.tensor([0.9, 0.5])
    plain = dqn.td_targets(online, target, reward, discount, double_q=True)
    torch.testing.assert_close(plain, torch.tensor([1.0 + 0.9 * 4.0, -10.0 + 0.5 * -6.0]))
    rescaled = dqn.td_targets(dqn.rescale(online), dqn.rescale(target), reward, discount, double_q=True,
                              value_rescale=True)
    torch.testing.assert_close(rescaled, dqn.rescale(plain), rtol=1e-4, atol=1e-4)  # the same target, in h's units
    terminal = dqn.td_targets(online, target, reward, torch.zeros(2), double_q=True, value_rescale=True)
    torch.testing.assert_close(terminal, dqn.rescale(reward))


def test_advantage_learning_subtracts_the_target_networks_action_gap() -> None:
    q_at_s = torch.tensor([[2.0, 5.0], [-1.0, -4.0]])  # the target network at s: best actions 1, then 0
    action = torch.tensor([0, 0])  # a suboptimal action, then the best one
    gap = dqn.action_gap(q_at_s, action, 0.5, value_rescale=False)
    torch.testing.assert_close(gap, torch.tensor([0.5 * 3.0, 0.0]))
    online, target = torch.tensor([[1.0, 3.0], [-2.0, -5.0]]), torch.tensor([[7.0, 4.0], [-6.0, -9.0]])
    reward, discount = torch.tensor([1.0, -10.0]), torch.tensor([0.9, 0.5])
    plain = dqn.td_targets(online, target, reward, discount, double_q=True)
    torch.testing.assert_close(dqn.td_targets(online, target, reward, discount, True, gap=gap), plain - gap)
    rescaled_gap = dqn.action_gap(dqn.rescale(q_at_s), action, 0.5, value_rescale=True)  # in return units
    torch.testing.assert_close(rescaled_gap, gap, rtol=1e-4, atol=1e-4)
    rescaled = dqn.td_targets(dqn.rescale(online), dqn.rescale(target), reward, discount, True, True, rescaled_gap)
    torch.testing.assert_close(rescaled, dqn.rescale(plain - gap), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("value_rescale", [False, True])
def test_the_learners_advantage_learning_term_is_the_target_networks_gap_at_the_start(value_rescale: bool) -> None:
    config = small_config(advantage_learning=0.5, n_step=1, value_rescale=value_rescale)
    runner = srl.Runner("CartPole-v1", config)
    memory = config.make_buffer(runner.spec)
    trainer = config.make_learner(runner.spec, runner.parameter, memory)
    rows = random_rows(config.warmup_size, reward_std=3.0)
    memory.add(rows)
    online = runner.parameter.q  # type: ignore[attr-defined]
    with torch.no_grad():  # the online network moves away from the target it was copied into
        for p in online.parameters():
            p.add_(0.3 * torch.randn_like(p))
    before = copy.deepcopy(online)
    updates: list[tuple[np.ndarray, np.ndarray]] = []
    update = memory.update_priorities
    memory.update_priorities = lambda i, td, g=None: (updates.append((i, td)), update(i, td, g))  # type: ignore
    assert trainer.train() is not None
    index, td = updates[0]
    (obs, nxt), action = (torch.from_numpy(rows[k][index]) for k in ("obs", "next_obs")), rows["action"][index]
    with torch.no_grad():
        raw = dqn.unrescale if value_rescale else (lambda x: x)
        q, q_next = raw(before(obs)).numpy(), before(nxt).numpy()
        t, t_next = raw(trainer.target(obs)).numpy(), raw(trainer.target(nxt)).numpy()
    rows_ = np.arange(len(index))
    target = rows["reward"][index] + rows["discount"][index] * t_next[rows_, q_next.argmax(1)]
    target -= 0.5 * (t.max(1) - t[rows_, action])  # the target network's gap at s, for the taken action
    if value_rescale:
        expected = np.abs(dqn.rescale(torch.from_numpy(target)).numpy()
                          - dqn.rescale(torch.from_numpy(q[rows_, action])).numpy())
    else:
        expected = np.abs(target - q[rows_, action])
    np.testing.assert_allclose(td, expected, rtol=1e-3, atol=1e-3)


def _learned_gap(advantage_learning: float) -> tuple[float, int]:
    """(Q(s, best) - Q(s, other), the greedy action) after training on one state whose action 0 pays 1 and
    action 1 pays 0.5, each ending the episode."""
    config = small_config(advantage_learning=advantage_learning, target_update_interval=25, n_step=1)
    runner = srl.Runner("CartPole-v1", config)
    memory = config.make_buffer(runner.spec)
    trainer = config.make_learner(runner.spec, runner.parameter, memory)
    n = config.warmup_size
    obs = np.tile(np.array([[0.1, -0.2, 0.05, 0.3]], np.float32), (n, 1))
    action = np.arange(n) % 2
    memory.add({"obs": obs, "action": action, "reward": np.where(action == 0, 1.0, 0.5).astype(np.float32),
                "next_obs": obs, "discount": np.zeros(n, np.float32), "version": np.zeros(n, np.int64)})
    for _ in range(1500):
        trainer.train()
    q = runner.parameter.q(torch.as_tensor(obs[:1])).detach()[0]  # type: ignore[attr-defined]
    return float(q[0] - q[1]), int(q.argmax())


def test_advantage_learning_widens_the_action_gap_and_keeps_the_greedy_action() -> None:
    plain_gap, plain_action = _learned_gap(0.0)
    gap, greedy = _learned_gap(0.5)
    assert plain_action == greedy == 0
    assert abs(plain_gap - 0.5) < 0.05  # Q-learning: the rewards' difference
    assert abs(gap - 1.0) < 0.1  # advantage learning's fixed point: 0.5 / (1 - 0.5)


def test_a_nonfinite_loss_skips_the_step_and_leaves_weights_and_priorities_alone() -> None:
    config = small_config()
    config.memory.set_proportional_memory(config.warmup_size)  # the next add replaces every row
    runner = srl.Runner("CartPole-v1", config)
    memory = config.make_buffer(runner.spec)
    trainer = config.make_learner(runner.spec, runner.parameter, memory)
    slots = np.arange(config.warmup_size)
    rows = random_rows(config.warmup_size)
    rows["reward"][:] = np.inf  # every sampled target is infinite: the loss cannot be finite
    memory.add(rows, np.ones(config.warmup_size, np.float32))
    weights = [p.detach().clone() for p in runner.parameter.q.parameters()]  # type: ignore[attr-defined]
    priorities = memory.tree.get(slots).copy()  # type: ignore[attr-defined]
    stats = trainer.train()
    assert stats is not None and stats.gradient_steps == 0 and stats.nonfinite_losses == 1
    assert np.isnan(stats.loss) and trainer.train_count == 0
    after = list(runner.parameter.q.parameters())  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(weights, after, strict=True))
    np.testing.assert_array_equal(memory.tree.get(slots), priorities)  # type: ignore[attr-defined]

    rows["reward"][:] = 1.0  # finite rows in every slot: the next step trains
    memory.add(rows, np.ones(config.warmup_size, np.float32))
    stats = trainer.train()
    assert stats is not None and stats.gradient_steps == 1 and trainer.train_count == 1
    assert not all(torch.equal(a, b) for a, b in zip(weights, after, strict=True))


def test_to_device_keeps_a_cpu_batch_in_place() -> None:
    array = np.arange(6, dtype=np.float32).reshape(3, 2)
    tensor = to_device(array, torch.device("cpu"))
    assert tensor.data_ptr() == array.ctypes.data and tensor.dtype == torch.float32  # no copy on the CPU
    assert torch.equal(tensor, torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]))


def test_invalid_config_is_refused_with_the_field_name() -> None:
    with pytest.raises(ValueError, match="target_tau"):
        srl.Runner("CartPole-v1", dqn.Config(target_tau=1.5))
    with pytest.raises(ValueError, match=r"loss must be one of \['huber', 'mse'\], got 'l2'"):
        srl.Runner("CartPole-v1", dqn.Config(loss="l2"))
    with pytest.raises(ValueError, match="did you mean 'huber'"):
        srl.Runner("CartPole-v1", dqn.Config(loss="hubber"))
    with pytest.raises(ValueError, match="warmup_size"):
        srl.Runner("CartPole-v1", dqn.Config(batch_size=64, warmup_size=10))


# ------------------------------------------------------------------ Runner
def test_smoke_train_evaluate_save_load(tmp_path: object) -> None:
    runner = srl.Runner("CartPole-v1", small_config())
    runner.train(max_train_count=200, progress_interval=None)
    assert runner.train_count == 200
    rewards = runner.evaluate(max_episodes=3)
    assert len(rewards) == 3 and all(r >= 1.0 for r in rewards)
    path = f"{tmp_path}/cartpole.safetensors"
    runner.save(path)
    # a plain safetensors file (no pickle): any safetensors reader opens it
    import safetensors.numpy

    stored = safetensors.numpy.load_file(path)
    weights = {k for k in stored if not k.startswith("trainer/")}
    assert weights == set(runner.parameter.to_arrays())
    assert any(k.startswith("trainer/optimizer/") for k in stored)  # and the trainer's state beside them
    other = srl.Runner.from_checkpoint(path)
    assert other.train_count == 200
    assert other.evaluate(max_episodes=3, seed=5) == runner.evaluate(max_episodes=3, seed=5)


def test_same_seed_same_run() -> None:
    def run() -> list[float]:
        runner = srl.Runner("CartPole-v1", small_config(seed=7))
        runner.train(max_train_count=150, progress_interval=None)
        return runner.evaluate(max_episodes=2)

    assert run() == run()


def test_a_continued_train_call_plays_new_starts_and_keeps_its_last_transitions() -> None:
    runner = srl.Runner("CartPole-v1", small_config(seed=7))
    runner.train(max_train_count=123, progress_interval=None)  # stops with finished transitions not handed over
    buffer = runner._buffer
    assert buffer is not None
    first_call = buffer.total_added
    # every transition is in but those of the open episode still waiting for their n steps
    assert first_call >= runner.env_steps - (runner.rl_config.n_step - 1)  # type: ignore[attr-defined]
    runner.train(max_train_count=100, progress_interval=None)
    obs = buffer.state_arrays()[0]["rows/obs"]
    assert len(obs) > first_call
    assert not np.array_equal(obs[first_call], obs[0])  # the second call does not replay the first's start


def test_train_calls_back_every_n_train_steps_without_moving_the_run() -> None:
    """The callback sees the runner at each multiple of ``callback_every`` train steps; one that evaluates
    leaves the run as it was (the same weights as a run without it); returning False ends the call there."""
    seen: list[tuple[int, int]] = []

    def look(runner: srl.Runner) -> None:
        seen.append((runner.train_count, runner.parameter.version))
        runner.evaluate(max_episodes=1)

    watched = srl.Runner("CartPole-v1", small_config())
    watched.train(max_train_count=300, progress_interval=None, callback=look, callback_every=100)
    assert [count for count, _ in seen] == [100, 200, 300]
    assert seen[-1][1] == watched.parameter.version
    plain = srl.Runner("CartPole-v1", small_config())
    plain.train(max_train_count=300, progress_interval=None)
    assert {k: v.tobytes() for k, v in watched.parameter.to_arrays().items()} == {
        k: v.tobytes() for k, v in plain.parameter.to_arrays().items()}

    stopped = srl.Runner("CartPole-v1", small_config())
    stopped.train(max_train_count=300, progress_interval=None, callback=lambda r: np.bool_(r.train_count < 200),
                  callback_every=50)
    assert stopped.train_count == 200
    stopped.train(max_train_count=20, progress_interval=None, callback=lambda r: False, callback_every=7)
    assert stopped.train_count == 203  # the next multiple of 7 past 200
    with pytest.raises(ValueError, match="callback_every"):
        stopped.train(max_train_count=1, callback=lambda r: None, callback_every=0)


def test_train_needs_a_limit() -> None:
    with pytest.raises(ValueError, match="needs a limit"):
        srl.Runner("CartPole-v1", small_config()).train()


@pytest.mark.slow
def test_dqn_learns_cartpole() -> None:
    config = dqn.Config(seed=3, lr=1e-3, batch_size=32, warmup_size=1000, target_update_interval=500, epsilon=0.1,
                        envs_per_actor=1)
    config.hidden_block.set_mlp((64, 64))
    config.memory.set_proportional_memory(capacity=20_000)
    runner = srl.Runner("CartPole-v1", config)
    runner.train(max_train_count=2_500, progress_interval=None)  # a fixed budget; one process: seed 3 repeats
    assert np.mean(runner.evaluate(max_episodes=10)) >= 195  # the final policy (341 over 10 episodes)


# ------------------------------------------------------------------ DQN's greedy average
@pytest.mark.parametrize(("tau", "planned", "weight"), [
    (0.2, 1_000, 0.2),  # a quarter of the plan is longer than 1 / tau: tau holds
    (1e-6, 20, 0.2),  # a quarter of the plan is 5 steps: each step weighs at least 1 / 5
])
def test_greedy_average_is_the_mean_of_the_first_steps_then_an_exponential_one(
        tau: float, planned: int, weight: float) -> None:
    runner = srl.Runner("CartPole-v1", small_config(greedy_average_tau=tau, warmup_size=16))
    parameter = runner.parameter
    assert isinstance(parameter, dqn.DQNParameter) and parameter.q_average is not None
    runner.train(max_train_count=1, progress_interval=None)  # builds the trainer; one step
    trainer = runner._learner
    assert trainer is not None
    trainer.plan(None, planned)
    history = [[p.detach().clone() for p in parameter.q.parameters()]]
    for _ in range(7):
        trainer.train()
        history.append([p.detach().clone() for p in parameter.q.parameters()])
    # steps 1-5: the plain mean of the weights after each step (1 / n >= weight); steps 6-8: weight of the newest
    expected = [torch.stack(ws[:5]).mean(dim=0) for ws in zip(*history, strict=True)]
    for step in range(5, 8):
        expected = [e.lerp(w, weight) for e, w in zip(expected, history[step], strict=True)]
    for e, a in zip(expected, parameter.q_average.parameters(), strict=True):
        torch.testing.assert_close(a, e)
    online = torch.cat([p.flatten() for p in parameter.q.parameters()])
    average = torch.cat([p.flatten() for p in parameter.q_average.parameters()])
    assert not torch.allclose(online, average)


def test_the_greedy_policy_acts_with_the_average_and_exploring_with_the_online_net() -> None:
    config = small_config(epsilon=0.0, greedy_average_tau=0.01)
    runner = srl.Runner("CartPole-v1", config)
    parameter = runner.parameter
    assert isinstance(parameter, dqn.DQNParameter) and parameter.q_average is not None
    with torch.no_grad():  # the average prefers action 1 everywhere, the online net action 0
        parameter.q_average.advantage.bias.copy_(torch.tensor([0.0, 1e6]))
        parameter.q.advantage.bias.copy_(torch.tensor([1e6, 0.0]))
    worker = config.make_worker(runner.spec, parameter, 0, 1, 0)
    obs = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    assert worker.act(obs).tolist() == [0] * 8
    worker.training = False
    assert worker.act(obs).tolist() == [1] * 8


def test_greedy_average_tau_none_averages_for_binned_box_actions_only() -> None:
    box = srl.Runner("Pendulum-v1", small_config()).parameter
    discrete = srl.Runner("CartPole-v1", small_config()).parameter
    assert isinstance(box, dqn.DQNParameter) and isinstance(discrete, dqn.DQNParameter)
    assert box.average_tau == dqn.GREEDY_AVERAGE_TAU_BOX and box.q_average is not None
    assert discrete.average_tau == 0.0 and discrete.q_average is None


def test_greedy_average_tau_zero_keeps_one_network() -> None:
    parameter = srl.Runner("CartPole-v1", small_config(greedy_average_tau=0.0)).parameter
    assert isinstance(parameter, dqn.DQNParameter)
    assert parameter.q_average is None and parameter.greedy_q is parameter.q
    assert all(key.startswith("q.") for key in parameter.to_arrays())
