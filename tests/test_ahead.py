"""A replay learner's next batch drawn during the current step (``BatchAhead``), and the learner's compute
options (``torch_compile``, ``autocast_bf16``): what they change and what they must not."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import srl
from srl.algorithms import dqn, impala, ppo, sac
from srl.base.config import ConfigError, config_from_dict
from srl.base.env import EnvConfig, env_spec
from srl.base.rl import Learner, RLConfig
from srl.rl.ahead import BatchAhead
from srl.rl.memories import MemoryConfig, SegmentBuffer
from tests.test_recurrent import rows_of, small_r2d2

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------ BatchAhead
def test_the_next_batch_is_drawn_on_a_side_thread_during_the_step_and_never_more_than_one_ahead() -> None:
    drawn: list[tuple[int, str]] = []
    second_drawn = threading.Event()

    def draw() -> int:
        drawn.append((len(drawn) + 1, threading.current_thread().name))
        if len(drawn) == 2:
            second_drawn.set()
        return len(drawn)

    ahead = BatchAhead(draw, CPU, enabled=True)
    assert ahead.take() == 1  # the first batch has nobody to draw it ahead: drawn in line
    assert second_drawn.wait(10), "the next batch was not drawn while the caller went on"
    assert ahead.take() == 2 and ahead.take() == 3
    ahead.close()  # lets the draw under way (the fourth) finish
    assert [n for n, _ in drawn] == [1, 2, 3, 4], "more than one batch was drawn ahead of the takes"
    assert drawn[0][1] == threading.current_thread().name
    assert all(name.startswith("srl-batch-ahead") for _, name in drawn[1:])


def test_off_every_batch_is_drawn_in_line_by_its_take() -> None:
    threads: list[str] = []
    ahead = BatchAhead(lambda: threads.append(threading.current_thread().name) or len(threads), CPU, enabled=False)
    assert [ahead.take() for _ in range(3)] == [1, 2, 3]
    assert threads == [threading.current_thread().name] * 3


def test_a_draw_that_fails_raises_from_the_take_that_wanted_its_batch() -> None:
    calls = []

    def draw() -> int:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the memory refused")
        return len(calls)

    ahead = BatchAhead(draw, CPU, enabled=True)
    assert ahead.take() == 1
    with pytest.raises(RuntimeError, match="the memory refused"):
        ahead.take()
    assert ahead.take() == 3  # the failure is not remembered: the next draw goes on
    ahead.close()


# ------------------------------------------------------------------------------------ the replay learners
def _dqn() -> tuple[RLConfig, str]:
    config = dqn.Config(batch_size=16, warmup_size=32, seed=3, memory=MemoryConfig(kind="replay", capacity=500))
    config.hidden_block.set_mlp((16,))
    return config, "CartPole-v1"


def _sac() -> tuple[RLConfig, str]:
    config = sac.Config(batch_size=16, warmup_size=32, seed=3, memory=MemoryConfig(kind="replay", capacity=500))
    config.hidden_block.set_mlp((16,))
    return config, "Pendulum-v1"


def _r2d2() -> tuple[RLConfig, str]:
    return small_r2d2(memory=MemoryConfig(kind="replay", capacity=200)), "srl/CartPoleNoVel-v1"


def _ppo() -> tuple[RLConfig, str]:
    return ppo.Config(seed=3, envs_per_actor=4, segment_length=8, epochs=2, minibatches=2), "CartPole-v1"


def _impala() -> tuple[RLConfig, str]:
    return impala.Config(seed=3, envs_per_actor=4, segment_length=8, batch_segments=4), "CartPole-v1"


LEARNERS = {"dqn": _dqn, "sac": _sac, "r2d2": _r2d2}
EVERY_LEARNER = {**LEARNERS, "ppo": _ppo, "impala": _impala}


def trained(config: RLConfig, env: str, rows: dict[str, np.ndarray], steps: int) -> tuple[Learner, list[float]]:
    """A learner of ``config`` (weights from seed 0) on a memory holding ``rows``, after ``steps`` steps;
    its losses."""
    spec = env_spec(EnvConfig(env))
    config = config.settled(EnvConfig(env))
    torch.manual_seed(0)
    parameter = config.make_parameter(spec, CPU)
    memory = config.make_buffer(spec)
    memory.add(rows)
    learner = config.make_learner(spec, parameter, memory)
    losses = []
    for step in range(steps):
        if step and isinstance(memory, SegmentBuffer):  # a segment learner takes what it trains on
            memory.add(rows)
        stats = learner.train()
        assert stats is not None
        losses.append(stats.loss)
    return learner, losses


def weights(learner: Any) -> dict[str, np.ndarray]:
    return learner.parameter.to_arrays()  # type: ignore[no-any-return]


@pytest.mark.parametrize("algorithm", sorted(LEARNERS))
def test_drawing_ahead_from_a_uniform_memory_trains_on_the_same_batches_to_the_same_weights(algorithm: str) -> None:
    """A uniform memory's samples do not depend on the priorities, so drawing ahead changes when each batch is
    drawn and nothing else: the same losses and bit-identical weights as drawing in line."""
    config, env = LEARNERS[algorithm]()
    _, rows = rows_of(config, env, 80, envs=config.envs_per_actor)
    config.draw_ahead = False
    inline, inline_losses = trained(config, env, rows, 12)
    config.draw_ahead = True
    ahead, ahead_losses = trained(config, env, rows, 12)
    assert ahead_losses == inline_losses
    assert all(np.isfinite(ahead_losses))
    inline_weights, ahead_weights = weights(inline), weights(ahead)
    assert inline_weights.keys() == ahead_weights.keys()
    for name, value in inline_weights.items():
        np.testing.assert_array_equal(ahead_weights[name], value, err_msg=name)
    assert ahead.batches.enabled  # type: ignore[attr-defined]


@pytest.mark.parametrize("algorithm", sorted(EVERY_LEARNER))
def test_compiled_and_bf16_learners_learn_and_publish_weights_under_the_same_names(algorithm: str) -> None:
    config, env = EVERY_LEARNER[algorithm]()
    segments = algorithm in ("ppo", "impala")  # rows are segments: one update's worth
    _, rows = rows_of(config.settled(EnvConfig(env)), env, 4 if segments else 80, envs=config.envs_per_actor)
    _, plain_losses = trained(config, env, rows, 1)
    config.torch_compile, config.autocast_bf16 = True, True
    fast, losses = trained(config, env, rows, 6)
    assert all(np.isfinite(losses)), losses
    assert losses[0] != plain_losses[0], "the same weights and batch gave float32's loss: no bf16 forward ran"
    compiled = [m for m in vars(fast.parameter).values() if isinstance(m, torch.nn.Module)]  # type: ignore[attr-defined]
    assert any(getattr(sub, "_compiled_call_impl", None) is not None for m in compiled for sub in m.modules())
    before, after = weights(trained(dataclasses.replace(config, torch_compile=False, autocast_bf16=False), env,
                                    rows, 0)[0]), weights(fast)
    assert after.keys() == before.keys(), "compiling renamed the weights: a params blob would not load elsewhere"
    assert all(after[name].dtype == before[name].dtype for name in before), "bf16 leaked into the weights"
    assert any(not np.array_equal(after[name], before[name]) for name in before), "no step moved a weight"


def test_a_one_process_run_with_every_option_on_ends_and_its_weights_load_in_a_plain_config() -> None:
    config, env = _dqn()
    config.draw_ahead, config.torch_compile, config.autocast_bf16 = True, True, True
    runner = srl.Runner(env, config)
    runner.train(max_train_count=40)
    assert runner.train_count == 40
    plain, _ = _dqn()
    other = srl.Runner(env, plain)
    other.parameter.from_arrays(runner.parameter.to_arrays())
    for name, value in runner.parameter.to_arrays().items():
        np.testing.assert_array_equal(other.parameter.to_arrays()[name], value)


@pytest.mark.parametrize(("field", "value"), [("draw_ahead", "yes"), ("torch_compile", 1), ("autocast_bf16", None)])
def test_a_board_config_with_an_option_of_the_wrong_type_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        config_from_dict(dqn.Config, {field: value})


def test_bench_gpu_measures_each_option_on_and_off_in_one_command() -> None:
    """``bench/gpu.py``'s learner-option rows run as they would on a lent GPU (there, with CUDA rows too)."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    done = subprocess.run([sys.executable, str(bench), "--algorithms", "compute", "--seconds", "0.2", "--repeat", "1",
                           "--warmup", "2", "--memory", "600", "--batch", "32", "--hidden", "32"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("cpu, ")]
    labels = [" ".join(row[1:-4]) for row in rows]
    assert labels == ["plain", "draw ahead", "torch.compile", "bf16 autocast", "all three"], done.stdout
    assert all(float(row[-4].replace(",", "")) > 0 for row in rows), done.stdout
    assert [row[-2] == "-" for row in rows] == [False, True, False, False, False], done.stdout
