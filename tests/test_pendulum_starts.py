"""bench/pendulum_starts.py's batched Pendulum against gymnasium's, and its bar estimate on runs built by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import srl
from srl.algorithms import dqn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import pendulum_starts as ps


def test_batched_episodes_equal_gymnasium_episodes() -> None:
    config = dqn.Config(seed=3)
    config.hidden_block.set_mlp((16, 16))
    runner = srl.Runner("Pendulum-v1", config)  # untrained: an arbitrary greedy policy that uses every torque
    parameter = runner.parameter
    worker = config.make_worker(runner.spec, parameter, 0, 1, 0)
    worker.training = False
    theta = np.array([2.72, -1.0, 0.5, 3.0, -3.1])
    theta_dot = np.array([0.0, 0.7, -0.3, 0.9, -1.0])
    batched = ps.greedy_returns(parameter.greedy_q, parameter.actions, theta, theta_dot)  # what the worker acts with
    env = gym.make("Pendulum-v1")
    used: set[float] = set()
    for th, v, expected in zip(theta, theta_dot, batched, strict=True):
        env.reset(seed=0)
        env.unwrapped.state = np.array([th, v])  # type: ignore[attr-defined]
        obs = np.array([np.cos(th), np.sin(th), v], dtype=np.float32)
        total = 0.0
        for _ in range(ps.EPISODE_STEPS):
            action = worker.act(obs[None])[0]
            used.add(float(action[0]))
            obs, reward, *_ = env.step(action)
            total += float(reward)
        assert total == pytest.approx(expected, rel=1e-9, abs=1e-6)
    env.close()
    assert len(used) > 1  # the comparison covered more than one torque


def test_start_grid_spans_the_reset_distribution() -> None:
    theta, theta_dot = ps.start_grid(8, 3)
    assert theta.min() > -np.pi and theta.max() < np.pi
    assert np.allclose(np.sort(np.unique(theta_dot)), [-1.0, 0.0, 1.0])
    assert abs(theta.mean()) < 1e-12 and len(theta) == 24


def test_bar_chance_separates_reliable_runs_from_stuck_ones() -> None:
    good = ps.Measured("good", "one", -130.0, np.full(1000, -130.0))
    stuck_returns = np.full(1000, -130.0)
    stuck_returns[:100] = -1490.0  # one start in ten is stuck: ten episodes almost surely meet one
    stuck = ps.Measured("stuck", "one", -300.0, stuck_returns)
    assert stuck.stuck == pytest.approx(0.1) and stuck.fail10 == pytest.approx(1 - 0.9**10)
    assert ps.bar_chance([good] * 5) == 1.0
    assert ps.bar_chance([stuck] * 5) < 0.01
    # half the runs stuck this way: a group of 5 passes only if all of its runs dodge their stuck starts
    mixed = ps.bar_chance([good, stuck])
    assert 0.05 < mixed < 0.3
