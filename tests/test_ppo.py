"""PPO in one process: GAE by hand, segments, continuous actions through the codec, learning CartPole."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

import srl
from srl.algorithms import ppo
from srl.base.env import EnvConfig, env_spec
from srl.base.rollout import Rollout
from srl.rl.actor_critic import SegmentWorker
from srl.rl.blocks import MLPBlockConfig
from srl.runner.distribution.wire.codec import BatchHeader, Codec


def test_gae_matches_a_hand_computed_example() -> None:
    gamma, lam = 0.9, 0.8
    reward = np.array([[1.0, 2.0, 3.0]], np.float32)
    value = np.array([[0.5, 1.0, 1.5]], np.float32)
    done = np.array([[False, True, False]])  # the episode ends at step 1; step 2 starts a new one
    last_value = np.array([2.0], np.float32)
    adv, ret = ppo.gae(reward, value, done, last_value, gamma, lam)
    d2 = 3.0 + 0.9 * 2.0 - 1.5  # bootstraps from the value after the segment
    d1 = 2.0 - 1.0  # terminal: no bootstrap, no advantage carried back across the episode boundary
    d0 = 1.0 + 0.9 * 1.0 - 0.5
    a2, a1 = d2, d1
    a0 = d0 + gamma * lam * a1
    np.testing.assert_allclose(adv, [[a0, a1, a2]], rtol=1e-6)
    np.testing.assert_allclose(ret, adv + value, rtol=1e-6)


def test_gae_with_lambda_one_and_no_ends_is_the_discounted_return_minus_value() -> None:
    rng = np.random.default_rng(0)
    reward, value = rng.normal(size=(2, 5)).astype(np.float32), rng.normal(size=(2, 5)).astype(np.float32)
    last = rng.normal(size=2).astype(np.float32)
    adv, _ = ppo.gae(reward, value, np.zeros((2, 5), bool), last, 0.95, 1.0)
    for t in range(5):
        expected = sum(0.95**k * reward[:, t + k] for k in range(5 - t)) + 0.95 ** (5 - t) * last - value[:, t]
        np.testing.assert_allclose(adv[:, t], expected, rtol=1e-5)


def make_worker(env_id: str, **changes: Any) -> tuple[SegmentWorker, ppo.Config]:
    config = ppo.Config(seed=0, envs_per_actor=2, segment_length=5, **changes)
    runner = srl.Runner(env_id, config)
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    assert isinstance(worker, SegmentWorker)
    return worker, config


def test_segments_are_one_per_env_every_T_steps_with_one_version() -> None:
    worker, config = make_worker("CartPole-v1")
    worker.parameter.version = 3
    with Rollout(EnvConfig("CartPole-v1"), worker, num_envs=2, seed=0) as rollout:
        for step in range(5):
            assert worker.may_load_params() == (step == 0)  # new params only between segments
            rollout.step()
            if step == 2:
                worker.parameter.version = 4  # params that arrive mid-segment do not relabel it
        rows = worker.take()
    assert rows is not None and worker.may_load_params()
    spec = env_spec(EnvConfig("CartPole-v1"))
    assert config.schema(spec).problem(rows) is None
    assert rows["obs"].shape == (2, 5, 4) and rows["action"].shape == (2, 5)
    np.testing.assert_array_equal(rows["version"], [3, 3])
    assert (rows["logprob"] <= 0).all()


def test_continuous_actions_are_clipped_for_the_env_and_kept_raw_in_the_row() -> None:
    worker, config = make_worker("Pendulum-v1")
    with torch.no_grad():
        worker.parameter.net.logstd.fill_(2.0)  # wide: many samples fall outside [-2, 2]
    obs = np.zeros((2, 3), np.float32)
    sent = []
    for _ in range(5):
        sent.append(worker.act(obs))
        worker.observe(np.zeros(2, np.float32), obs, np.zeros(2, bool), np.zeros(2, bool))
    rows = worker.take()
    assert rows is not None
    assert all((np.abs(a) <= 2.0).all() for a in sent)
    assert np.abs(rows["action"]).max() > 2.0  # the row keeps the sample its log-prob belongs to
    np.testing.assert_allclose(np.clip(rows["action"].swapaxes(0, 1), -2, 2), np.stack(sent))
    # the segment survives the wire exactly, checked against the algorithm's schema
    codec = Codec(secret="k", task="t")
    schema = config.schema(env_spec(EnvConfig("Pendulum-v1")))
    header = BatchHeader("a", 0, 1, 0, 0, 2, time.time())
    _, columns, _ = codec.decode_batch(codec.encode_batch(header, rows, None), schema)
    for name, column in rows.items():
        np.testing.assert_array_equal(columns[name], column)
        assert columns[name].dtype == column.dtype


def test_a_time_limit_bootstraps_the_last_reward() -> None:
    worker, config = make_worker("Pendulum-v1")
    resolved = config.resolved(env_spec(EnvConfig("Pendulum-v1")))
    obs = np.ones((2, 3), np.float32)
    for t in range(5):
        worker.act(obs)
        truncated = np.array([t == 4, False])
        worker.observe(np.full(2, -1.0, np.float32), obs * 2, np.zeros(2, bool), truncated)
    rows = worker.take()
    assert rows is not None
    with torch.no_grad():
        v_final = worker.parameter.net.value(torch.from_numpy(obs[:1] * 2)).item()
    assert rows["bootstrap"][0, 4] == pytest.approx(resolved.gamma * v_final, rel=1e-5)
    assert (rows["reward"] == -1.0).all()  # the env's rewards; the bootstrap goes apart (see the next test)
    assert (rows["bootstrap"][1] == 0.0).all() and (rows["bootstrap"][0, :4] == 0.0).all()
    assert rows["done"][0, 4] and not rows["done"][1, 4]


def test_reward_normalization_scales_the_rewards_not_the_time_limit_bootstrap(monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    # V(final) is in the critic's units, which are already the normalized rewards': the learner divides the
    # env's rewards by the return std and adds γ·V(final) after, as SB3 adds it to normalized rewards
    spec = env_spec(EnvConfig("Pendulum-v1"))
    worker, config = make_worker("Pendulum-v1")
    resolved = config.resolved(spec)
    assert resolved.normalize_reward and resolved.gamma is not None  # on by default for Box actions
    with torch.no_grad():  # V = 10 for every observation
        worker.parameter.net.critic_head.weight.zero_()
        worker.parameter.net.critic_head.bias.fill_(10.0)
    obs = np.ones((2, 3), np.float32)
    for t in range(5):
        worker.act(obs)
        worker.observe(np.full(2, -1.0, np.float32), obs * 2, np.zeros(2, bool), np.array([t == 4, False]))
    rows = worker.take()
    assert rows is not None
    buffer = config.make_buffer(spec)
    buffer.add(rows)
    learner = config.make_learner(spec, worker.parameter, buffer)
    with torch.no_grad():  # a return std of 2 that these ten returns do not move
        learner.return_rms.var.fill_(4.0)
        learner.return_rms.count.fill_(1e12)
    seen: list[np.ndarray] = []
    real_gae = ppo.gae

    def spy(reward: np.ndarray, *args: Any) -> tuple[np.ndarray, np.ndarray]:
        seen.append(reward.copy())
        return real_gae(reward, *args)

    monkeypatch.setattr(ppo, "gae", spy)
    assert learner.train() is not None
    expected = np.full((2, 5), -1.0 / 2.0)
    expected[0, 4] += resolved.gamma * 10.0  # not (-1 + γ·10) / 2
    np.testing.assert_allclose(seen[0], expected, rtol=1e-4)


def update_gradient_steps(actor_num: int, **changes: Any) -> tuple[int, int]:
    """(gradient steps, env steps) of one sync update on the segments of ``actor_num`` actors, as the
    distributed trainer builds its learner (one process is one actor)."""
    config = ppo.Config(seed=0, envs_per_actor=2, segment_length=4, epochs=3, **changes)
    runner = srl.Runner("CartPole-v1", config)
    spec = runner.spec
    buffer = config.make_buffer(spec, actor_num)
    for slot in range(actor_num):
        worker = config.make_worker(spec, runner.parameter, slot, actor_num, slot)
        with Rollout(EnvConfig("CartPole-v1"), worker, num_envs=2, seed=slot) as rollout:
            for _ in range(4):
                rollout.step()
        rows = worker.take()
        assert rows is not None
        buffer.add(rows)
    stats = config.make_learner(spec, runner.parameter, buffer, actor_num).train()
    assert stats is not None
    return stats.gradient_steps, actor_num * 2 * 4


def test_a_distributed_update_makes_the_gradient_steps_per_env_step_of_one_process() -> None:
    # the presets are RL Zoo's, whose batch_size is a minibatch's size: an update of N actors' segments takes
    # N times the minibatches of one actor's, so N actors learn as much from each env step as one process
    # does (with a count of minibatches per update, 2 actors made half the gradient steps per env step)
    one, one_steps = update_gradient_steps(1)
    two, two_steps = update_gradient_steps(2)
    assert one == 3  # the Discrete preset: one minibatch an epoch
    assert two / two_steps == one / one_steps, f"2 actors: {two} gradient steps for {two_steps} env steps, " \
        f"one process: {one} for {one_steps}"
    assert update_gradient_steps(2, minibatches=1)[0] == 3  # a count the user sets is the update's


def test_presets_follow_the_action_family() -> None:
    discrete = ppo.Config().resolved(env_spec(EnvConfig("CartPole-v1")))
    continuous = ppo.Config().resolved(env_spec(EnvConfig("Pendulum-v1")))
    assert (discrete.gamma, discrete.normalize_obs) == (0.98, False)
    assert (continuous.gamma, continuous.normalize_obs, continuous.minibatches) == (0.9, True, 32)
    assert ppo.Config(gamma=0.99).resolved(env_spec(EnvConfig("Pendulum-v1"))).gamma == 0.99  # a set field wins


def test_a_recurrent_config_takes_its_own_presets_where_they_differ(caplog: pytest.LogCaptureFixture) -> None:
    """Over Discrete vectors a recurrent config takes RL Zoo ppo_lstm's network (the cells read the observations,
    then one ReLU layer of 64 per head) with observations normalized; feed-forward keeps two tanh layers of 64
    and raw observations; a field set wins; the run says which preset it took."""
    novel = env_spec(EnvConfig("srl/CartPoleNoVel-v1"))
    recurrent, feed_forward = ppo.Config(recurrent="lstm").resolved(novel), ppo.Config().resolved(novel)
    assert recurrent.hidden_block == MLPBlockConfig((64,), "relu") and recurrent.normalize_obs is True
    assert feed_forward.hidden_block == MLPBlockConfig((64, 64), "tanh") and feed_forward.normalize_obs is False
    net = recurrent.make_parameter(novel, torch.device("cpu")).net
    assert recurrent.cell_first is True and {core.rnn.input_size for core in net.cores} == {4}  # the observation
    assert [m.out_features for m in net.actor_head.modules() if isinstance(m, torch.nn.Linear)] == [64, 2]
    encoders = net.encoders()  # what torch_compile compiles: the MLPs after the cells
    assert [[m.out_features for m in e.modules() if isinstance(m, torch.nn.Linear)] for e in encoders] == [[64]] * 2
    pendulum = ppo.Config(recurrent="lstm").resolved(env_spec(EnvConfig("srl/PendulumNoVel-v1")))
    assert pendulum.hidden_block == MLPBlockConfig((64, 64), "tanh")  # Box keeps its own preset
    assert pendulum.cell_first is False
    mine = MLPBlockConfig((32,), "tanh")
    set_by_hand = ppo.Config(recurrent="lstm", hidden_block=mine, normalize_obs=False).resolved(novel)
    assert (set_by_hand.hidden_block, set_by_hand.normalize_obs) == (mine, False)
    assert recurrent.hidden_block is not ppo.Config(recurrent="lstm").resolved(novel).hidden_block  # each a copy
    with caplog.at_level("INFO", logger="srl.ppo"):
        ppo.Config(recurrent="lstm").settled(EnvConfig("srl/CartPoleNoVel-v1"))
    assert "the recurrent discrete preset for 'srl/CartPoleNoVel-v1'" in caplog.text, caplog.text
    assert "normalize_obs True" in caplog.text and "hidden_block 64 relu" in caplog.text, caplog.text
    assert "cell_first True" in caplog.text, caplog.text
    for name in ppo.RECURRENT_PRESETS:  # a run's line names every field a preset set, recurrent ones too
        assert f" {name} " in caplog.text, (name, caplog.text)


def test_presets_tell_atari_images_from_small_grids() -> None:
    pytest.importorskip("ale_py")
    pytest.importorskip("minatar")
    config = ppo.Config()
    atari, grid = env_spec(EnvConfig("ALE/Pong-v5")), env_spec(EnvConfig("MinAtar/Breakout-v1"))
    assert (config.family(atari), config.family(grid)) == ("images", "grids")
    images, grids = config.resolved(atari), config.resolved(grid)
    assert images.lr == 2.5e-4 and grids.lr == 10 * images.lr  # CleanRL's ppo_atari; ten times that for grids
    assert (grids.segment_length, grids.epochs, grids.gamma) == (images.segment_length, images.epochs, images.gamma)
    assert ppo.Config(lr=1e-4).resolved(grid).lr == 1e-4


class TwoDials(gym.Env):
    """MultiDiscrete([3, 3]): reward 1 when both dials match the observed targets."""

    observation_space = gym.spaces.Box(0.0, 1.0, (6,), np.float32)
    action_space = gym.spaces.MultiDiscrete([3, 3])

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def _obs(self) -> np.ndarray:
        self.target = self.np_random.integers(0, 3, 2)
        obs = np.zeros(6, np.float32)
        obs[self.target[0]] = obs[3 + self.target[1]] = 1.0
        return obs

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = float((np.asarray(action) == self.target).all())
        self.t += 1
        return self._obs(), reward, False, self.t >= 20, {}


gym.register(id="srl-test/TwoDials-v0", entry_point=TwoDials)


@pytest.mark.slow
def test_ppo_learns_multi_discrete_dials() -> None:
    runner = srl.Runner("srl-test/TwoDials-v0", ppo.Config(seed=0))
    runner.train(max_steps=15_000, progress_interval=None)
    assert np.mean(runner.evaluate(max_episodes=10)) >= 15  # random play scores 20/9 ≈ 2.2


@pytest.mark.slow
def test_ppo_learns_cartpole_in_a_small_budget() -> None:
    runner = srl.Runner("CartPole-v1", ppo.Config(seed=1))
    runner.train(max_steps=25_000, progress_interval=None)
    assert runner.env_steps == 25_000  # 3,125 steps of 8 envs
    assert runner.train_count == 20 * (25_000 // 256)  # an update per 8 x 32 steps: K=20 epochs, one minibatch
    assert np.mean(runner.evaluate(max_episodes=10)) >= 195


def test_a_run_says_which_preset_its_unset_fields_take(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="srl.ppo"):
        config = ppo.Config(lr=3e-4)
        assert config.settled(EnvConfig("Pendulum-v1")) is config  # None stays None: resolved where used
    assert "the box preset for 'Pendulum-v1'" in caplog.text
    assert "segment_length 256" in caplog.text and " lr " not in caplog.text  # a field set is not the preset's
    caplog.clear()
    with caplog.at_level("INFO", logger="srl.ppo"):
        ppo.Config(**{name: ppo.PRESETS[name][0] for name in ppo.PRESETS}).settled(EnvConfig("CartPole-v1"))
    assert "preset" not in caplog.text  # nothing left to a preset: nothing said
