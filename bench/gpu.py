"""The learners and the acting of DQN, PPO, IMPALA, R2D2 and SAC on the CPU and on CUDA, with a net worth a GPU.

    python bench/gpu.py                           # 256x256, batch 256: CPU, and CUDA when torch sees one
    python bench/gpu.py --hidden 64,64 --batch 64 --seconds 5
    python bench/gpu.py --cpu-threads 1,4         # the CPU rows at each torch thread count
    python bench/gpu.py --algorithms ppo,impala   # only the segment learners (the DQN rows need --memory rows)

One command checks a lent GPU: every row runs the algorithm's real code on the device, so a tensor on the
wrong device fails here, not in a user's run.

What is timed is ``DQNLearner.train()`` alone, the loop a trainer process runs: sample a batch from
a proportional replay memory already full (``--memory`` rows of Pendulum-v1's shapes, random but
valid), move it to the device, the double-DQN TD loss, backward, clip, Adam, and the priority update
(|TD| back on the host). After ``--warmup`` untimed steps (CUDA's context and kernels), as many steps
as fit in ``--seconds``; on CUDA the clock stops after ``torch.cuda.synchronize()``.

Rows:
  cpu, N threads          the learner on the CPU (srl's default ``torch_threads`` is 1)
  cuda, pinned            srl's path: each batch through pinned host memory, copied non-blocking
  cuda, pageable          the same with a plain ``tensor.to(device)`` per column, for comparison

PPO and IMPALA (CartPole-v1, ``envs_per_actor`` 8): what is timed is the worker's ``act`` on 8 envs'
observations (the sampling path: a categorical draw from the worker's CPU generator, the log-probability
and value on the device) and the learner's ``train()`` on one update's segments (PPO: K epochs over
every env's segment; IMPALA: a V-trace step on ``batch_segments``), the segments refilled before each.
R2D2 (the same env, its defaults: LSTM 128, batches of 64 sequences of 80 steps, burn-in 40): the worker's
``act`` and one ``train()`` (both networks unrolled over every sequence, the loss on the last 40 steps,
the priority update); its row adds sequences/s (updates/s x 64), the figure to compare with the CPU's.

SAC (Pendulum-v1's shapes, ``--hidden`` and ``--batch``, a uniform memory of 10,000 valid random rows): the
worker's ``act`` on 8 envs and one ``train()`` (a critic step on both critics, an actor step through them, the
temperature step, the Polyak targets), with the CUDA ÷ CPU ratio of the learner.

Inference (central inference's server, SEED RL): IMPALA's Nature CNN on Pong frames, the forward pass one
server runs for 4 actors x 8 envs joined (``policy_inputs`` of each actor's worker, one ``policy``, each
worker's ``act_with``), as inference steps/s (envs acted for per second) on the CPU and on CUDA, and their ratio.

Learner options (``compute``): each of ``RLConfig``'s learner options alone and then together, on the CPU and on
CUDA: ``draw_ahead`` (a replay learner's next batch drawn on a side thread while the current step runs),
``torch_compile`` and ``autocast_bf16``. DQN's train steps/s (the learner above: an MLP, a proportional memory;
``draw_ahead`` off in its "plain" row, as the CPU's default) and IMPALA's updates/s on Pong (the Nature CNN, 8
segments of 16 steps; a segment learner draws in line, so its "all three" row is compile and bf16). The
compile rows leave the compiler's time in the ``--warmup`` steps (DQN) and the 5 untimed updates (IMPALA).

    python bench/gpu.py --algorithms compute

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
from srl.algorithms import dqn, impala, ppo, r2d2, sac
from srl.base.rl import RLConfig, Worker
from srl.base.rollout import Rollout
from srl.rl import ahead
from srl.rl.blocks import MLPBlockConfig

ENV = "Pendulum-v1"
SECTIONS = ("dqn", "ppo", "impala", "r2d2", "sac", "inference", "compute")


def make_learner(device: str, hidden: tuple[int, ...], batch: int, memory_rows: int,
                 threads: int = 1, **options: bool) -> dqn.DQNLearner:
    """A DQN learner on ``device`` (``threads`` torch CPU threads; ``options``: ``RLConfig``'s compute fields,
    ``draw_ahead`` off unless given) whose proportional memory holds ``memory_rows`` valid random rows."""
    warmup_size = min(max(batch, 1000), memory_rows)
    if memory_rows < batch:  # the learner would not train at all and every row would read 0 steps/s
        raise SystemExit(f"--memory {memory_rows} is below the batch of {batch} rows")
    config = dqn.Config(batch_size=batch, warmup_size=warmup_size, device=device, seed=0,
                        torch_threads=threads, **{"draw_ahead": False, **options})
    config.hidden_block.set_mlp(hidden)
    config.memory.set_proportional_memory(memory_rows)
    runner = srl.Runner(ENV, config)
    memory = config.make_buffer(runner.spec)
    trainer = config.make_learner(runner.spec, runner.parameter, memory)
    assert isinstance(trainer, dqn.DQNLearner)
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
    pinned = ahead.to_device

    def plain(array: np.ndarray, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    ahead.to_device = plain
    try:
        yield
    finally:
        ahead.to_device = pinned


def steps_per_second(trainer: dqn.DQNLearner, seconds: float, warmup: int) -> float:
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


def segment_rates(algorithm: str, device: str, hidden: tuple[int, ...], seconds: float,
                  threads: int = 1) -> tuple[float, float]:
    """(worker act() calls/s, learner updates/s) of PPO, IMPALA or R2D2 on ``device``."""
    config: ppo.Config | impala.Config | r2d2.Config = {
        "ppo": lambda: ppo.Config(seed=0, device=device, torch_threads=threads),
        "impala": lambda: impala.Config(seed=0, device=device, torch_threads=threads),
        "r2d2": lambda: r2d2.Config(seed=0, device=device, torch_threads=threads, warmup_size=64),
    }[algorithm]()
    config.hidden_block = MLPBlockConfig(hidden)  # PPO's and IMPALA's is None (a preset) until set
    worker, update = segment_learner("CartPole-v1", config, max(8, config.envs_per_actor))
    obs = np.random.default_rng(0).normal(size=(config.envs_per_actor, 4)).astype(np.float32)  # CartPole's
    return calls_per_second(lambda: worker.act(obs), device, seconds), calls_per_second(update, device, seconds)


def segment_learner(env: str, config: RLConfig, segments_wanted: int) -> tuple[Worker, Callable[[], object]]:
    """A worker of ``config`` in ``env`` and one update of its learner on the ``segments_wanted`` segments (or
    more) the worker made, refilled whenever the learner took them."""
    runner = srl.Runner(env, config)
    runner.rl_config = config = runner.rl_config.settled(runner.env_config)
    spec, parameter = runner.spec, runner.parameter
    worker = config.make_worker(spec, parameter, 0, 1, 0)
    buffer = config.make_buffer(spec)
    trainer = config.make_learner(spec, parameter, buffer)
    segments = []
    with Rollout(runner.env_config, worker, config.envs_per_actor, seed=0) as rollout:
        while sum(len(s["version"]) for s in segments) < segments_wanted:
            rollout.step()
            if (rows := worker.take()) is not None:
                segments.append(rows)

    def update() -> object:
        while (stats := trainer.train()) is None:
            for rows in segments:
                buffer.add(rows)
        return stats

    return worker, update


def sac_rates(device: str, hidden: tuple[int, ...], batch: int, seconds: float, threads: int = 1
              ) -> tuple[float, float]:
    """(worker act() calls/s on 8 envs, learner train steps/s) of SAC on ``device``."""
    config = sac.Config(seed=0, device=device, torch_threads=threads, batch_size=batch, warmup_size=batch,
                        envs_per_actor=8)
    config.hidden_block.set_mlp(hidden)
    config.memory.set_replay_memory(10_000)
    runner = srl.Runner(ENV, config)
    spec, parameter = runner.spec, runner.parameter
    memory = config.make_buffer(spec)
    rng = np.random.default_rng(0)
    n, dim = 10_000, spec.obs_shape[0]
    memory.add({"obs": rng.normal(size=(n, dim)).astype(np.float32),
                "action": rng.uniform(-1.0, 1.0, size=(n, *spec.actions.shape)).astype(np.float32),
                "reward": rng.uniform(-16.0, 0.0, n).astype(np.float32),
                "next_obs": rng.normal(size=(n, dim)).astype(np.float32),
                "discount": np.full(n, config.gamma, np.float32), "version": np.zeros(n, np.int64)})
    trainer = config.make_learner(spec, parameter, memory)
    worker = config.make_worker(spec, parameter, 0, 1, 0)
    obs = rng.normal(size=(8, dim)).astype(np.float32)
    return calls_per_second(lambda: worker.act(obs), device, seconds), calls_per_second(trainer.train, device, seconds)


def calls_per_second(step: Callable[[], object], device: str, seconds: float) -> float:
    """How many times ``step`` runs a second on ``device``, after 5 untimed calls (CUDA's context and
    kernels); on CUDA the clock stops after the device finished."""
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    sync()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        count += 1
    sync()
    return count / (time.perf_counter() - t0)


COMPUTE_OPTIONS: tuple[tuple[str, dict[str, bool]], ...] = (
    ("plain", {}),
    ("draw ahead", {"draw_ahead": True}),
    ("torch.compile", {"torch_compile": True}),
    ("bf16 autocast", {"autocast_bf16": True}),
    ("all three", {"draw_ahead": True, "torch_compile": True, "autocast_bf16": True}),
)
"""the rows of the compute section: each of ``RLConfig``'s learner options alone, then together"""


def pong_learner_rate(device: str, seconds: float, threads: int = 1, **options: bool) -> float:
    """IMPALA's learner updates/s on Pong (the Nature CNN, ``batch_segments`` 8 of 16 steps of 4 stacked
    84x84 frames): one update on the same segments again and again."""
    config = impala.Config(seed=0, device=device, torch_threads=threads, envs_per_actor=8, **options)
    _, update = segment_learner("ALE/Pong-v5", config, config.batch_segments)
    return calls_per_second(update, device, seconds)


def compute_rows(devices: list[str], hidden: tuple[int, ...], batch: int, memory_rows: int, seconds: float,
                 warmup: int, repeat: int, threads: int) -> None:
    """The learner options (``draw_ahead``, ``torch_compile``, ``autocast_bf16``) on and off, on each device:
    DQN's train steps/s (replay, an MLP) and IMPALA's updates/s on Pong (segments, the Nature CNN)."""
    print(f"\nLearner options: DQN ({ENV} shapes, hidden {hidden}, batch {batch}, proportional memory of "
          f"{memory_rows:,} rows) and IMPALA on Pong (Nature CNN, 8 segments x 16 steps); torch {torch.__version__}")
    print(f"{'device, options':<30} {'DQN steps/s':>12} {'÷ plain':>8} {'IMPALA upd/s':>13} {'÷ plain':>8}")
    for device in devices:
        dqn_plain = pong_plain = 0.0
        for label, options in COMPUTE_OPTIONS:
            trainer = make_learner(device, hidden, batch, memory_rows, threads=threads, **options)
            dqn_rate = statistics.median(steps_per_second(trainer, seconds, warmup) for _ in range(repeat))
            trainer.batches.close()
            dqn_plain = dqn_plain or dqn_rate
            pong = "-"
            ratio = "-"
            segment_options = {k: v for k, v in options.items() if k != "draw_ahead"}  # a segment learner draws in line
            if segment_options or not options:
                pong_rate = pong_learner_rate(device, seconds, threads, **segment_options)
                pong_plain = pong_plain or pong_rate
                pong, ratio = f"{pong_rate:,.2f}", f"{pong_rate / pong_plain:.2f}"
            print(f"{device + ', ' + label:<30} {dqn_rate:>12,.0f} {dqn_rate / dqn_plain:>8.2f} {pong:>13} {ratio:>8}")


def inference_rate(device: str, seconds: float, threads: int = 1, actors: int = 4, envs: int = 8) -> float:
    """Envs acted for per second by a central inference server's batch on ``device``: ``actors`` workers of
    ``envs`` envs each, their inputs joined into one forward pass of IMPALA's Nature CNN on Pong frames."""
    from srl.base.rl import join_policy_io, split_policy_io

    config = impala.Config(seed=0, device=device, torch_threads=threads, envs_per_actor=envs)
    runner = srl.Runner("ALE/Pong-v5", config)
    spec, parameter = runner.spec, runner.parameter
    workers = [config.make_worker(spec, parameter, i, actors, i) for i in range(actors)]
    frame = np.random.default_rng(0).integers(0, 255, size=(envs, 1, *spec.obs_shape[1:]), dtype=np.uint8)
    obs = np.repeat(frame, spec.obs_shape[0], axis=1)  # one frame stacked: the stacks slide as the worker checks

    def batch() -> None:
        with torch.inference_mode():
            outputs = workers[0].policy(join_policy_io([w.policy_inputs(obs) for w in workers]))
            for w, part in zip(workers, split_policy_io(outputs, [envs] * actors), strict=True):
                w.act_with(obs, part)  # no observe: the same step of the segment, again

    return calls_per_second(batch, device, seconds) * actors * envs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", default="256,256", help="hidden layer sizes (default 256,256)")
    parser.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    parser.add_argument("--memory", type=int, default=100_000, help="rows in the replay memory (default 100,000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed window per row (default 10)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps first (default 200)")
    parser.add_argument("--repeat", type=int, default=3, help="windows per row; the median is printed (default 3)")
    parser.add_argument("--cpu-threads", default="1", help="torch CPU thread counts, comma-separated (default 1)")
    parser.add_argument("--algorithms", default=",".join(SECTIONS),
                        help=f"comma-separated sections (default {','.join(SECTIONS)})")
    args = parser.parse_args()
    algorithms = args.algorithms.split(",")
    unknown = sorted(set(algorithms) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown algorithm(s) {unknown}; known: {', '.join(SECTIONS)}")
    hidden = tuple(int(x) for x in args.hidden.split(","))
    threads = [int(x) for x in args.cpu_threads.split(",")]

    cuda = torch.cuda.is_available()
    if "compute" in algorithms:
        compute_rows(["cpu", "cuda"] if cuda else ["cpu"], hidden, args.batch, args.memory, args.seconds,
                     args.warmup, args.repeat, threads[0])
        if not cuda:
            print("cuda: torch sees no CUDA device here")
    if "inference" in algorithms:
        print(f"\nCentral inference: IMPALA's Nature CNN on Pong frames, 4 actors x 8 envs per forward pass; "
              f"torch {torch.__version__}")
        print(f"{'device':<22} {'inference steps/s':>18} {'÷ cpu':>8}  note")
        cpu_steps = inference_rate("cpu", args.seconds, threads[0])
        print(f"{'cpu, ' + str(threads[0]) + ' thread' + ('s' if threads[0] > 1 else ''):<22} {cpu_steps:>18,.0f} "
              f"{1.0:>8.2f}")
        if cuda:
            steps = inference_rate("cuda", args.seconds, threads[0])
            print(f"{'cuda':<22} {steps:>18,.0f} {steps / cpu_steps:>8.2f}  {torch.cuda.get_device_name(0)}")
        else:
            print(f"{'cuda':<22} {'-':>18} {'-':>8}  torch sees no CUDA device here")
    if "sac" in algorithms:
        print(f"\nSAC on {ENV}, hidden {hidden}, batch {args.batch}; torch {torch.__version__}")
        print(f"{'device':<22} {'act calls/s':>12} {'train steps/s':>14}  note")
        sac_cpu = 0.0
        for n in threads:
            act, learn = sac_rates("cpu", hidden, args.batch, args.seconds, n)
            sac_cpu = sac_cpu or learn
            print(f"{'cpu, ' + str(n) + ' thread' + ('s' if n > 1 else ''):<22} {act:>12,.0f} {learn:>14,.1f}")
        if cuda:
            act, learn = sac_rates("cuda", hidden, args.batch, args.seconds, threads[0])
            print(f"{'cuda':<22} {act:>12,.0f} {learn:>14,.1f}  {learn / sac_cpu:.1f}x the CPU's learner; "
                  f"{torch.cuda.get_device_name(0)}")
        else:
            print(f"{'cuda':<22} {'-':>12} {'-':>14}  torch sees no CUDA device here")
    for algorithm in (a for a in algorithms if a not in ("dqn", "inference", "sac", "compute")):
        print(f"\n{algorithm.upper()} on CartPole-v1, hidden {hidden}; torch {torch.__version__}")
        print(f"{'device':<22} {'act calls/s':>12} {'updates/s':>10}  note")
        per_update = r2d2.Config().batch_size if algorithm == "r2d2" else 0
        cpu_rate = 0.0
        for n in threads:
            act, learn = segment_rates(algorithm, "cpu", hidden, args.seconds, n)
            cpu_rate = cpu_rate or learn
            note = f"{learn * per_update:,.0f} sequences/s" if per_update else ""
            print(f"{'cpu, ' + str(n) + ' thread' + ('s' if n > 1 else ''):<22} {act:>12,.0f} {learn:>10,.1f}  {note}")
        if cuda:
            act, learn = segment_rates(algorithm, "cuda", hidden, args.seconds, threads[0])
            note = (f"{learn * per_update:,.0f} sequences/s, {learn / cpu_rate:.1f}x the CPU's; "
                    if per_update and cpu_rate else "")
            print(f"{'cuda':<22} {act:>12,.0f} {learn:>10,.1f}  {note}{torch.cuda.get_device_name(0)}")
        else:
            print(f"{'cuda':<22} {'-':>12} {'-':>10}  torch sees no CUDA device here")
    if "dqn" not in algorithms:
        return 0
    print(f"\nDQN learner, {ENV} shapes, hidden {hidden}, batch {args.batch}, proportional memory of "
          f"{args.memory:,} rows; torch {torch.__version__}")
    rows: list[tuple[str, float | None, str]] = []
    for n in threads:
        trainer = make_learner("cpu", hidden, args.batch, args.memory, threads=n)
        assert torch.get_num_threads() == n
        rates = [steps_per_second(trainer, args.seconds, args.warmup) for _ in range(args.repeat)]
        rows.append((f"cpu, {n} thread{'s' if n > 1 else ''}", statistics.median(rates), ""))
    if cuda:
        name = torch.cuda.get_device_name(0)
        for label, copies in (("cuda, pinned", nullcontext), ("cuda, pageable", pageable_copies)):
            trainer = make_learner("cuda", hidden, args.batch, args.memory, threads=threads[0])
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
