"""The DQN learner's train steps/s on the CPU and on CUDA, with a net worth a GPU.

    python bench/gpu.py                           # 256x256, batch 256: CPU, and CUDA when torch sees one
    python bench/gpu.py --hidden 64,64 --batch 64 --seconds 5
    python bench/gpu.py --cpu-threads 1,4         # the CPU rows at each torch thread count

What is timed is ``DQNTrainer.train()`` alone, the loop a trainer process runs: sample a batch from
a proportional replay memory already full (``--memory`` rows of Pendulum-v1's shapes, random but
valid), move it to the device, the double-DQN TD loss, backward, clip, Adam, and the priority update
(|TD| back on the host). After ``--warmup`` untimed steps (CUDA's context and kernels), as many steps
as fit in ``--seconds``; on CUDA the clock stops after ``torch.cuda.synchronize()``.

Rows:
  cpu, N threads          the learner on the CPU (srl's default ``torch_threads`` is 1)
  cuda, pinned            srl's path: each batch through pinned host memory, copied non-blocking
  cuda, pageable          the same with a plain ``tensor.to(device)`` per column, for comparison

Without CUDA the CUDA rows say so and the CPU rows still run. Quote ratios from one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srl
from srl.algorithms import dqn

ENV = "Pendulum-v1"


def make_trainer(device: str, hidden: tuple[int, ...], batch: int, memory_rows: int,
                 threads: int = 1) -> dqn.DQNTrainer:
    """A DQN learner on ``device`` (``threads`` torch CPU threads) whose proportional memory holds
    ``memory_rows`` valid random rows."""
    warmup_size = max(batch, 1000)
    if memory_rows < warmup_size:  # the learner would not train at all and every row would read 0 steps/s
        raise SystemExit(f"--memory {memory_rows} is below the learner's warm-up of {warmup_size} rows")
    config = dqn.Config(batch_size=batch, warmup_size=warmup_size, device=device, seed=0,
                        torch_threads=threads)
    config.hidden_block.set_mlp(hidden)
    config.memory.set_proportional_memory(memory_rows)
    runner = srl.Runner(ENV, config)
    memory = config.make_buffer(runner.spec)
    trainer = config.make_trainer(runner.spec, runner.parameter, memory)
    assert isinstance(trainer, dqn.DQNTrainer)
    rng = np.random.default_rng(0)
    obs_shape = runner.spec.obs_shape
    n_actions = dqn.action_count(runner.spec, config.action_bins)
    for start in range(0, memory_rows, 10_000):
        n = min(10_000, memory_rows - start)
        memory.add({
            "obs": rng.normal(size=(n, *obs_shape)).astype(np.float32),
            "action": rng.integers(0, n_actions, n),
            "reward": rng.uniform(-16.0, 0.0, n).astype(np.float32),
            "next_obs": rng.normal(size=(n, *obs_shape)).astype(np.float32),
            "discount": np.full(n, config.gamma, np.float32),
            "version": np.zeros(n, np.int64),
        })
    return trainer


@contextmanager
def pageable_copies() -> Iterator[None]:
    """The learner's copies as a plain ``.to(device)`` instead of srl's pinned, non-blocking ones."""
    pinned = dqn.to_device

    def plain(array: np.ndarray, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    dqn.to_device = plain
    try:
        yield
    finally:
        dqn.to_device = pinned


def steps_per_second(trainer: dqn.DQNTrainer, seconds: float, warmup: int) -> float:
    sync: Callable[[], None] = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        trainer.train()
    sync()
    start, t0 = trainer.train_count, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            trainer.train()
    sync()
    return (trainer.train_count - start) / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", default="256,256", help="hidden layer sizes (default 256,256)")
    parser.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    parser.add_argument("--memory", type=int, default=100_000, help="rows in the replay memory (default 100,000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed window per row (default 10)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps first (default 200)")
    parser.add_argument("--repeat", type=int, default=3, help="windows per row; the median is printed (default 3)")
    parser.add_argument("--cpu-threads", default="1", help="torch CPU thread counts, comma-separated (default 1)")
    args = parser.parse_args()
    hidden = tuple(int(x) for x in args.hidden.split(","))
    threads = [int(x) for x in args.cpu_threads.split(",")]

    print(f"DQN learner, {ENV} shapes, hidden {hidden}, batch {args.batch}, proportional memory of "
          f"{args.memory:,} rows; torch {torch.__version__}")
    rows: list[tuple[str, float | None, str]] = []
    for n in threads:
        trainer = make_trainer("cpu", hidden, args.batch, args.memory, threads=n)
        assert torch.get_num_threads() == n
        rates = [steps_per_second(trainer, args.seconds, args.warmup) for _ in range(args.repeat)]
        rows.append((f"cpu, {n} thread{'s' if n > 1 else ''}", statistics.median(rates), ""))
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        for label, copies in (("cuda, pinned", nullcontext), ("cuda, pageable", pageable_copies)):
            trainer = make_trainer("cuda", hidden, args.batch, args.memory, threads=threads[0])
            with copies():
                rates = [steps_per_second(trainer, args.seconds, args.warmup) for _ in range(args.repeat)]
            rows.append((label, statistics.median(rates), name))
    else:
        rows.append(("cuda", None, "torch sees no CUDA device here"))

    base = rows[0][1]
    print(f"\n{'device':<22} {'train steps/s':>14} {'÷ ' + rows[0][0]:>18}  note")
    for label, rate, note in rows:
        if rate is None:
            print(f"{label:<22} {'-':>14} {'-':>18}  {note}")
        else:
            ratio = f"{rate / base:.2f}" if base else "-"
            print(f"{label:<22} {rate:>14,.0f} {ratio:>18}  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
