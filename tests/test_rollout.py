"""The one env step loop: several envs per worker, each ending and restarting alone."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import srl
from srl.algorithms import dqn
from srl.base.env import EnvConfig, EnvError
from srl.base.rl import Columns, Worker
from srl.base.rollout import Rollout


class CountEnv(gym.Env):
    """obs = steps since reset; the episode terminates after a length drawn at each reset (2..6)."""

    observation_space = gym.spaces.Box(0.0, 100.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t = 0
        self.length = int(self.np_random.integers(2, 7))
        return np.array([0.0], np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        return np.array([float(self.t)], np.float32), 1.0, self.t >= self.length, False, {}


gym.register(id="srl-test/Count-v0", entry_point=CountEnv)


class Recorder(Worker):
    """Records what the rollout tells it."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.resets: list[tuple[list[int], np.ndarray]] = []
        self.acted: list[np.ndarray] = []
        self.observed: list[tuple[np.ndarray, np.ndarray]] = []

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        self.resets.append((list(env_ids), obs.copy()))

    def act(self, obs: np.ndarray) -> np.ndarray:
        self.acted.append(obs.copy())
        return np.zeros(len(obs), np.int64)

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        self.observed.append((next_obs.copy(), terminated.copy()))

    def pending(self) -> int:
        return 0

    def take(self) -> Columns | None:
        return None


def test_one_env_ending_never_resets_the_others() -> None:
    worker = Recorder(4)
    with Rollout(EnvConfig("srl-test/Count-v0"), worker, num_envs=4, seed=3) as rollout:
        assert worker.resets[0][0] == [0, 1, 2, 3]
        ended_total = 0
        for _ in range(40):
            before = rollout.obs[:, 0].copy()
            episodes = rollout.step()
            after = rollout.obs[:, 0]
            final, terminated = worker.observed[-1]
            ended = {e.env_index for e in episodes}
            assert ended == set(np.flatnonzero(terminated))
            for i in range(4):
                if i in ended:
                    assert final[i, 0] == before[i] + 1  # the worker sees the episode's real last obs...
                    assert after[i] == 0.0  # ...and the env alone starts over
                else:
                    assert final[i, 0] == after[i] == before[i] + 1  # the others just go on
            if ended:
                ids, obs = worker.resets[-1]
                assert ids == sorted(ended) and (obs == 0.0).all()
            ended_total += len(ended)
        assert ended_total == rollout.episodes > 4
        assert rollout.env_steps == 160


def test_envs_are_seeded_apart_and_reproducibly() -> None:
    def lengths(seed: int) -> list[int]:
        with Rollout(EnvConfig("srl-test/Count-v0"), Recorder(3), num_envs=3, seed=seed) as rollout:
            return [e.length for _ in range(30) for e in rollout.step()]

    assert lengths(5) == lengths(5)
    assert lengths(5) != lengths(6)


def test_discrete_observations_are_one_hot() -> None:
    worker = Recorder(2)
    with Rollout(EnvConfig("FrozenLake-v1"), worker, num_envs=2, seed=0) as rollout:
        assert rollout.obs.shape == (2, 16) and (rollout.obs.sum(axis=1) == 1.0).all()
        rollout.step()
        assert worker.observed[-1][0].shape == (2, 16)


def test_async_envs_step_in_their_own_processes() -> None:
    worker = Recorder(2)
    with Rollout(EnvConfig("CartPole-v1"), worker, num_envs=2, seed=0, vectorization="async") as rollout:
        for _ in range(5):
            rollout.step()
        assert rollout.obs.shape == (2, 4) and rollout.env_steps == 10


def test_bad_env_counts_and_modes_are_refused() -> None:
    with pytest.raises(EnvError, match="num_envs"):
        Rollout(EnvConfig("CartPole-v1"), Recorder(1), num_envs=0)
    with pytest.raises(EnvError, match="vectorization"):
        Rollout(EnvConfig("CartPole-v1"), Recorder(1), vectorization="threads")


def test_a_training_worker_must_step_the_envs_it_was_built_for() -> None:
    config = dqn.Config(envs_per_actor=2)
    env_config = EnvConfig("CartPole-v1")
    runner = srl.Runner(env_config, config)
    worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
    with pytest.raises(ValueError, match=r"built for 2 env\(s\) but the Rollout steps 1.*envs_per_actor"):
        Rollout(env_config, worker, num_envs=1)
    worker.training = False  # evaluating may step fewer envs (Runner.evaluate does)
    with Rollout(env_config, worker, num_envs=1, seed=0) as rollout:
        rollout.step()
        assert rollout.env_steps == 1


def test_runner_trains_and_evaluates_several_envs() -> None:
    config = dqn.Config(batch_size=16, warmup_size=64, seed=1, envs_per_actor=4)
    config.hidden_block.set_mlp((16, 16))
    config.memory.set_replay_memory(1000)
    runner = srl.Runner("CartPole-v1", config)
    runner.train(max_steps=400, progress_interval=None)
    assert runner.env_steps == 400
    # one train step per env step past the warmup (env_steps_per_train = 1)
    assert 400 - 64 - 4 * 32 <= runner.train_count <= 400 - 64
    rewards = runner.evaluate(max_episodes=6)
    assert len(rewards) == 6 and all(r >= 1.0 for r in rewards)
    assert runner.evaluate(max_episodes=6, seed=9) == runner.evaluate(max_episodes=6, seed=9)
