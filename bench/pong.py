"""Pong with PPO: srl's distributed sync PPO and async PPO (APPO), and Sample Factory's beside them.

    python bench/pong.py                      # a GPU box: the scale preset trains Pong (target >= 18)
    python bench/pong.py --budget 100000      # a CPU box: sync and async PPO, 2 actors x 8 envs, side by side
    python bench/pong.py --budget 100000 --peer   # and Sample Factory's PPO and APPO, same settings, one run
    python bench/pong.py --central 2,db       # and async PPO with central inference: 2 servers, double-buffered

One command for each (``--compile``, ``--bf16``: the learner options ``bench/gpu.py`` measures, off unless
given). ``ALE/Pong-v5`` with srl's Atari preprocessing (docs/pixels.md: 30 no-op starts,
frame skip 4 with max-pool, 84x84 grey, 4 frames stacked, rewards clipped while training), the Nature CNN,
``ppo.Config()``'s images preset: CleanRL's ``ppo_atari.py`` (rollout 128, 4 epochs x 4 minibatches per
actor's segments, lr 2.5e-4 annealed, gamma 0.99, GAE 0.95, entropy 0.01, clip 0.2). Each mode is
``Runner.train_distribution`` on an embedded Redis, the trainer and the actors as local processes,
run to ``--budget`` agent steps, then evaluated.

Preset by machine (each flag overrides it):

  a CUDA GPU   actors = cores - 2 (8 envs each, local inference: on a lent H200 with 16 cores,
               ``bench/inference.py`` measured local 3,712 agent steps/s against central 2,147 on Pong),
               sync PPO, a budget of 2.5M agent steps (10M frames, CleanRL's), evaluation over 5 episodes
  no GPU       2 actors x 8 envs, sync and async PPO, ``--budget`` 100,000 agent steps, 2 episodes

Columns per mode:

  agent steps      env steps the actors made (one agent step = 4 frames)
  trained on       agent steps in the updates the learner made: its updates (params versions) x the
                   rows of one update, less the rows refused as stale (async)
  wall s           from submitting the task to its end (the processes' start included, as for the peer)
  trained/s        trained-on agent steps per wall second; frames/s is 4x that
  stale            rows refused as too old for the learner (async PPO's ``max_policy_lag``)
  stalled          seconds the actors waited, summed: on a full queue, for the next params (sync), or at
                   their lead on the learner (async: rate-limited)
  lag p50/p95      the policy lag of the rows trained on, in train steps (the trainer's last report)
  GPU util         mean of ``nvidia-smi``'s utilization over the run ("-": no nvidia-smi)
  eval             mean return of ``--eval-episodes`` greedy episodes of the final params (-21..21)

``--peer`` runs Sample Factory 2.x's ``sf_examples.atari.train_atari`` (its PPO with ``--async_rl False``,
its APPO with True) with the same network (``convnet_atari``), rollout, epochs, minibatch size, workers and
envs (its learning rate held: 2.1 has no linear decay; its input and return normalization off, as srl's
images preset has them), from a Python that has it (``--sf-python``; default ``.venv-sf/bin/python``).
Install it apart from srl, torch first so pip takes the CPU wheel:

    python -m venv .venv-sf && .venv-sf/bin/pip install torch
    .venv-sf/bin/pip install sample-factory "ale-py==0.9.*" && .venv-sf/bin/pip uninstall -y shimmy

(ale-py 0.9 ships the ROMs and works with the gymnasium 0.29 Sample Factory needs; shimmy's gymnasium plugin
imports ale-py half-way and breaks its registration.) ``bench/sf_atari.py`` starts Sample Factory's example
with ale-py's games registered in each of its processes.

Its rate is read from its own log ("Total num frames") over its wall time, also from launch. Quote ratios
from one run of this command, nothing else running.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srl
from srl.algorithms import ppo
from srl.base.rl import DataPath
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.client.embedded import start_embedded_redis
from srl.runner.distribution.client.report import BoardSnapshot

ENV = "ALE/Pong-v5"
FRAME_SKIP = 4
ROOT = Path(__file__).resolve().parents[1]
GPU_BUDGET = 2_500_000
"""agent steps on a GPU box: 10M frames, the budget CleanRL's ppo_atari reports Pong at (20.4)"""
CPU_BUDGET = 100_000
TARGET = 18.0


@dataclass
class Result:
    name: str
    agent_steps: int
    trained_on: int
    wall_s: float
    stale: int = 0
    stalled_s: float | None = None
    lag: str = "-"
    gpu_util: str = "-"
    evaluation: float | None = None
    note: str = ""

    @property
    def trained_per_s(self) -> float:
        return self.trained_on / self.wall_s if self.wall_s > 0 else 0.0


class GpuUtilization:
    """Samples ``nvidia-smi``'s GPU utilization once a second in a thread, while in a ``with`` block."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = shutil.which("nvidia-smi") is not None

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.samples.append(statistics.mean(float(v) for v in out.split()))
            except (OSError, ValueError, subprocess.SubprocessError, statistics.StatisticsError):
                continue

    def __enter__(self) -> GpuUtilization:
        if self.available:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> str:
        return f"{statistics.mean(self.samples):.0f}%" if self.samples else "-"


def has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def srl_run(sync: bool, actors: int, envs: int, budget: int, eval_episodes: int, seed: int,
            timeout: float | None, central: tuple[int, bool] | None = None, **learner: bool) -> Result:
    """One srl run: ``train_distribution`` of PPO (``sync``) on an embedded Redis, local processes; ``central``:
    (servers, double_buffer) of central inference (async only), None for local inference; ``learner``:
    ``RLConfig``'s learner options (``torch_compile``, ``autocast_bf16``)."""
    config = ppo.Config(sync=sync, envs_per_actor=envs, seed=seed, **learner)
    runner = srl.Runner(ENV, config)
    name = f"srl {'sync PPO' if sync else 'async PPO'}"
    inference: dict[str, Any] = {}
    if central is not None:
        servers, double = central
        name += f", central x{servers}" + (" db" if double else "")
        inference = {"inference": "central", "inference_servers": servers, "double_buffer": double,
                     "inference_options": {"max_wait_ms": 0.0}}
    print(f"{name}: {actors} actors x {envs} envs, {budget:,} agent steps ...", flush=True)
    with start_embedded_redis() as server, GpuUtilization() as gpu:
        params = server.parameters.replace(task_name=f"pong-{'sync' if sync else 'async'}")
        started = time.perf_counter()
        runner.train_distribution(params, actor_num=actors, max_steps=budget, timeout=timeout,
                                  progress_interval=30.0, local_processes=True, **inference)
        wall = time.perf_counter() - started
        board = Board(params.connect(), params.task_name)
        snapshot, status = BoardSnapshot.read(board, actors), board.get_status()
    trainer = snapshot.reports.trainer
    stale = int(snapshot.counters.get("stale_rows", 0))
    resolved = config.resolved(runner.spec)
    update_rows = (resolved.segment_length or 0) * config.data_path().update_segments(actors, envs)
    # PPO publishes a version per update (train_count counts its gradient steps: epochs x minibatches each)
    updates = 0 if status is None else max(0, status.params_version - DataPath.FIRST_VERSION)
    trained_on = max(0, min(runner.env_steps, updates * update_rows) - (0 if sync else stale))
    stalled = sum(a.backpressure_wait_s + a.sync_wait_s + a.rate_limited_s for a in snapshot.reports.actors.values())
    lag = "-" if trainer is None or trainer.lag_steps_p50 is None else \
        f"{trainer.lag_steps_p50:g}/{trainer.lag_steps_p95:g}"
    print(f"{name}: evaluating over {eval_episodes} episodes ...", flush=True)
    evaluation = float(np.mean(runner.evaluate(max_episodes=eval_episodes))) if eval_episodes else None
    return Result(name, runner.env_steps, trained_on, wall, stale, stalled, lag, gpu.summary(), evaluation)


# ---------------------------------------------------------------- the peer
SF_FRAMES = re.compile(r"Total num frames: (\d+)")
SF_THROUGHPUT = re.compile(r"Throughput: 0: ([0-9]+(?:\.[0-9]+)?)")
SF_REWARD = re.compile(r"Avg episode reward: \[\(0, '([-0-9.]+)'\)\]|Avg episode reward: ([-0-9.]+)")


def sf_python(path: str | None) -> str | None:
    candidate = path or os.environ.get("SRL_SF_PYTHON") or str(ROOT / ".venv-sf" / "bin" / "python")
    if not Path(candidate).exists():
        return None
    ok = subprocess.run([candidate, "-c", "import ale_py, sample_factory, sf_examples.atari.train_atari"],
                        capture_output=True, timeout=120).returncode == 0
    return candidate if ok else None


def sf_run(python: str, sync: bool, actors: int, envs: int, budget: int, device: str, seed: int) -> Result:
    """Sample Factory's PPO (``sync``) or APPO on Pong with the settings srl's run has; its rate from its log."""
    name = f"Sample Factory {'PPO (sync)' if sync else 'APPO'}"
    print(f"{name}: {actors} workers x {envs} envs, {budget:,} agent steps ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="sf-pong-") as train_dir:
        minibatch = actors * envs * 128 // (4 * actors)  # srl's preset: 4 minibatches per actor's segments
        cmd = [python, str(ROOT / "bench" / "sf_atari.py"), "--env", "atari_pong", "--algo", "APPO",
               "--experiment", "pong", "--train_dir", train_dir, "--device", device, "--seed", str(seed),
               "--num_workers", str(actors), "--num_envs_per_worker", str(envs), "--worker_num_splits", "1",
               "--rollout", "128", "--num_epochs", "4", "--batch_size", str(minibatch),
               "--num_batches_per_epoch", str(4 * actors), "--encoder_conv_architecture", "convnet_atari",
               "--async_rl", str(not sync), "--with_vtrace", "False", "--ppo_clip_ratio", "0.2",
               "--learning_rate", "0.00025", "--lr_schedule", "constant", "--exploration_loss_coeff", "0.01",
               "--normalize_input", "False", "--normalize_returns", "False",
               "--train_for_env_steps", str(budget * FRAME_SKIP), "--save_every_sec", "100000",
               "--keep_checkpoints", "1", "--with_wandb", "False"]
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=train_dir)
        wall = time.perf_counter() - started
    log = proc.stdout + proc.stderr
    frames = [int(m) for m in SF_FRAMES.findall(log)]
    rewards = [float(a or b) for a, b in SF_REWARD.findall(log)]
    rates = [float(r) for r in SF_THROUGHPUT.findall(log)]
    if proc.returncode != 0 or not frames:
        tail = "\n".join(log.splitlines()[-25:])
        return Result(name, 0, 0, wall, note=f"failed (exit {proc.returncode}):\n{tail}")
    steps = max(frames) // FRAME_SKIP
    said = [f"its own last throughput {rates[-1]:.0f} agent steps/s (a window of its run, start not counted)"
            ] if rates else []
    said += [f"its last training reward {rewards[-1]:.1f}"] if rewards else []
    return Result(name, steps, steps, wall, note="; ".join(said))


# ---------------------------------------------------------------- the table
def print_table(results: list[Result], actors: int, envs: int, budget: int) -> None:
    print(f"\n{ENV}, PPO (CleanRL's Atari settings), {actors} actors x {envs} envs, {budget:,} agent steps, "
          f"{os.cpu_count()} CPU cores{', CUDA' if has_cuda() else ''}\n")
    header = (f"| {'run':<28} | {'agent steps':>11} | {'trained on':>10} | {'wall s':>7} | {'trained/s':>9} | "
              f"{'frames/s':>8} | {'stale':>6} | {'stalled s':>9} | {'lag p50/p95':>11} | {'GPU util':>8} | "
              f"{'eval':>6} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for r in results:
        stale = "-" if not r.agent_steps else f"{100 * r.stale / r.agent_steps:.1f}%"
        stalled = "-" if r.stalled_s is None else f"{r.stalled_s:.0f}"
        evaluation = "-" if r.evaluation is None else f"{r.evaluation:.1f}"
        print(f"| {r.name:<28} | {r.agent_steps:>11,} | {r.trained_on:>10,} | {r.wall_s:>7.0f} | "
              f"{r.trained_per_s:>9.0f} | {FRAME_SKIP * r.trained_per_s:>8.0f} | {stale:>6} | {stalled:>9} | "
              f"{r.lag:>11} | {r.gpu_util:>8} | {evaluation:>6} |")
    by_name = {r.name: r for r in results}
    pairs = (("srl sync PPO", "Sample Factory PPO (sync)"), ("srl async PPO", "Sample Factory APPO"))
    for srl_name, peer_name in pairs:
        ours, theirs = by_name.get(srl_name), by_name.get(peer_name)
        if ours and theirs and theirs.trained_per_s > 0:
            print(f"{srl_name} / {peer_name}, trained-on agent steps/s: "
                  f"{ours.trained_per_s / theirs.trained_per_s:.2f}")
    for r in results:
        if r.note:
            print(f"{r.name}: {r.note}")
    for r in results:
        if r.evaluation is not None and budget >= GPU_BUDGET:
            verdict = "reached" if r.evaluation >= TARGET else "did not reach"
            print(f"{r.name} {verdict} Pong >= {TARGET:g} ({r.evaluation:.1f}) in {r.wall_s / 60:.1f} minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=None,
                        help=f"agent steps per run (default: {GPU_BUDGET:,} with CUDA, else {CPU_BUDGET:,})")
    parser.add_argument("--modes", default=None, help="sync, async or both, comma-separated "
                        "(default: sync with CUDA, else sync,async)")
    parser.add_argument("--actors", type=int, default=None, help="actor processes (default: cores - 2 with "
                        "CUDA, else 2)")
    parser.add_argument("--envs", type=int, default=8, help="envs per actor")
    parser.add_argument("--eval-episodes", type=int, default=None, help="greedy episodes evaluated after each "
                        "srl run (default: 5 with CUDA, else 2; 0: none)")
    parser.add_argument("--minutes", type=float, default=None, help="end each srl run after this many minutes "
                        "whatever its budget (the task's timeout)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer", action="store_true", help="also run Sample Factory's PPO and APPO")
    parser.add_argument("--compile", action="store_true", help="the learner's networks torch.compiled (torch_compile)")
    parser.add_argument("--bf16", action="store_true", help="the learner's passes under bf16 autocast (autocast_bf16)")
    parser.add_argument("--sf-python", default=None, help="a Python with sample-factory (default: "
                        "$SRL_SF_PYTHON, else .venv-sf/bin/python)")
    parser.add_argument("--central", default=None, metavar="SERVERS[,db]",
                        help="also run async PPO with central inference on SERVERS servers (',db': actors "
                        "double-buffered), e.g. 2,db; async PPO with local inference is run beside it")
    args = parser.parse_args()
    cuda = has_cuda()
    budget = args.budget or (GPU_BUDGET if cuda else CPU_BUDGET)
    modes = (args.modes or ("sync" if cuda else "sync,async")).split(",")
    unknown = set(modes) - {"sync", "async"}
    if unknown:
        parser.error(f"--modes: {', '.join(sorted(unknown))}: expected sync and/or async")
    actors = args.actors or (max(1, (os.cpu_count() or 4) - 2) if cuda else 2)
    episodes = args.eval_episodes if args.eval_episodes is not None else (5 if cuda else 2)
    timeout = None if args.minutes is None else args.minutes * 60
    python = None
    if args.peer:
        python = sf_python(args.sf_python)
        if python is None:
            parser.error("--peer: no Python with sample-factory found (--sf-python, $SRL_SF_PYTHON or "
                         ".venv-sf/bin/python); install it as this script's docstring says, or leave --peer out")
    central = None
    if args.central is not None:
        parts = args.central.split(",")
        if not parts[0].isdigit() or int(parts[0]) < 1 or parts[1:] not in ([], ["db"]):
            parser.error(f"--central: expected SERVERS or SERVERS,db (e.g. 2,db), found {args.central!r}")
        central = (int(parts[0]), parts[1:] == ["db"])
        if "async" not in modes:
            modes.append("async")  # sync PPO's actors act in lockstep: central inference is for async PPO
    results: list[Result] = []
    if central is not None:
        results.append(srl_run(False, actors, args.envs, budget, episodes, args.seed, timeout, central,
                               torch_compile=args.compile, autocast_bf16=args.bf16))
    for mode in modes:
        results.append(srl_run(mode == "sync", actors, args.envs, budget, episodes, args.seed, timeout,
                               torch_compile=args.compile, autocast_bf16=args.bf16))
        if python is not None:
            results.append(sf_run(python, mode == "sync", actors, args.envs, budget, "gpu" if cuda else "cpu",
                                  args.seed))
    print_table(results, actors, args.envs, budget)


if __name__ == "__main__":
    main()
