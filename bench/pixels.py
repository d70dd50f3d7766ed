"""Pixels: what a transition of ALE Pong costs on the wire and in replay, and what sending costs the actor.

    python bench/pixels.py                      # every table
    python bench/pixels.py --only wire,replay   # some of them
    python bench/pixels.py --steps 4000         # more env steps per measurement
    python bench/pixels.py --only vector --steps 20000   # one actor's envs: gymnasium's path against ale-py's

Tables (Pong with the standard Atari preprocessing: 4 stacked 84x84 grey frames, uint8):

  wire    bytes per transition of DQN batches as an actor encodes them (``batch_size`` 256 transitions,
          its default; E envs per actor), frame rows (srl's default) against rows of two stacks (the
          naive layout, ``store_frames_once=False``), raw and zstd-compressed (the actor's default for
          images); beside them one frame compressed alone.
  replay  bytes per stored transition of DQN's replay: what it reports (``nbytes / capacity``) and what the
          process's resident memory grew by when a memory of ``--replay-capacity`` was filled with real rows;
          the 1M-transition size it would reserve.
  actor   env steps/s of an actor's work (act, n-step rows, initial priorities, zstd encoding; no broker)
          against the same envs and CNN policy stepped bare (greedy, nothing kept), E = 8.
  vector  env steps/s of one actor's envs on one core (the process pinned to one CPU; torch, OpenCV and
          ale-py's vector env on one thread each), ``--envs`` envs, gymnasium's path (``AtariPreprocessing`` +
          ``FrameStackObservation`` in a ``SyncVectorEnv``, ``vectorization="sync"``) against ale-py's C++
          ``AtariVectorEnv`` (``vectorization="ale"``, the default for ALE games with several envs): random
          actions (the env path alone), then the Nature CNN acting greedily (an actor's inference).
  params  bytes one params version of the Nature CNN takes, and what a version costs Redis (bytes out) when
          16 or 64 actors of one machine each fetch it, against the machine's params cache (one fetch per
          machine). Needs Redis on 127.0.0.1:6379.

A ratio is taken within one run. Nothing else should run meanwhile (two cores).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import redis
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srl.algorithms import dqn
from srl.base.env import DiscreteActions, EnvConfig, env_spec
from srl.base.rollout import Rollout
from srl.rl.memories import MemoryConfig
from srl.runner.distribution.actor.params_cache import ParamsCache
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.wire.codec import BatchHeader, Codec, params_message_bytes

PONG = "ALE/Pong-v5"
FRAME = 84 * 84
NAIVE_BYTES = 2 * 4 * FRAME  # obs and next_obs stacks, uint8


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def config(envs: int, frames_once: bool, capacity: int = 10_000) -> dqn.Config:
    # uniform actions in every env (ε 1 for all, not Ape-X's schedule over the envs)
    return dqn.Config(envs_per_actor=envs, store_frames_once=frames_once, epsilon=1.0, apex_epsilon=1.0,
                      apex_alpha=0.0, seed=0, memory=MemoryConfig(capacity=capacity), warmup_size=64, batch_size=32)


def actor_batches(envs: int, frames_once: bool, steps: int, batch_size: int = 256) -> list[dict[str, np.ndarray]]:
    """The batches an actor of ``envs`` envs would send over ``steps`` env steps (taken at ``batch_size``
    transitions, as the actor does)."""
    cfg = config(envs, frames_once)
    spec = env_spec(EnvConfig(PONG))
    worker = cfg.make_worker(spec, cfg.make_parameter(spec, torch.device("cpu")), 0, 1, 0)
    batches = []
    with Rollout(EnvConfig(PONG), worker, envs, seed=0) as rollout:
        while rollout.env_steps < steps:
            rollout.step()
            if worker.pending() >= batch_size:
                rows = worker.take()
                assert rows is not None
                batches.append(rows)
    return batches


def encoded(batches: list[dict[str, np.ndarray]], codec: Codec, worker_priorities: bool = False) -> int:
    total = 0
    for seq, rows in enumerate(batches):
        priorities = np.ones(len(rows["action"]), np.float32)
        header = BatchHeader("bench", 0, 1, seq, 1, len(rows["action"]), time.time())
        total += len(codec.encode_batch(header, rows, priorities))
    return total


def transitions(batches: list[dict[str, np.ndarray]]) -> int:
    return sum(int(b["transition"].sum()) if "transition" in b else len(b["action"]) for b in batches)


def wire(steps: int) -> None:
    print(f"\n## wire: bytes per transition, DQN on {PONG} (4x84x84 uint8), batches of 256 transitions\n")
    print("| envs per actor | layout | frames per transition | raw B/transition | zstd B/transition "
          "| one frame zstd alone | zstd ÷ one frame |")
    print("|---|---|---|---|---|---|---|")
    for envs in (1, 8):
        naive = actor_batches(envs, False, steps)
        frames = actor_batches(envs, True, steps)
        alone = [frame for b in frames for frame in b["frame"]]
        writer = zstandard.ZstdCompressor(level=1)
        one_frame = float(np.mean([len(writer.compress(f.tobytes())) for f in alone[::7]]))
        for name, batches in (("rows of two stacks (naive)", naive), ("frame rows (srl)", frames)):
            n = transitions(batches)
            per_frame = sum(len(b["frame"]) for b in batches) / n if "frame" in batches[0] else 8.0
            raw = encoded(batches, Codec(compress=False)) / n
            packed = encoded(batches, Codec(compress=True)) / n
            print(f"| {envs} | {name} | {per_frame:.3f} | {raw:,.0f} | {packed:,.0f} | {one_frame:,.0f} "
                  f"| {packed / one_frame:.2f} |")
    print(f"\nnaive baseline (two stacks, uncompressed): {NAIVE_BYTES:,} B of frames per transition")


def replay(steps: int, capacity: int) -> None:
    print(f"\n## replay: bytes per stored transition, DQN on {PONG}\n")
    print("| layout | reported B/transition | RSS growth B/transition (filled) | 1M transitions reserve |")
    print("|---|---|---|---|")
    spec = env_spec(EnvConfig(PONG))
    for name, frames_once in (("rows of two stacks (naive)", False), ("frame ring (srl)", True)):
        cap = capacity if frames_once else capacity // 8  # the naive one is 8x bigger a row
        batches = actor_batches(1, frames_once, steps)
        gc.collect()
        before = rss_bytes()
        memory = config(1, frames_once, cap).make_buffer(spec)
        while len(memory) < cap or memory.total_added < cap + 2 * cap // 16:
            for rows in batches:
                memory.add(rows, np.ones(len(rows["action"]), np.float32))
        grown = rss_bytes() - before
        reported = memory.nbytes / cap
        # the frame ring's memory of a million is reserved, not touched (np.empty); rows of stacks would need
        # 53 GiB, more than this machine may reserve: their size is the reported one times a million
        million = config(1, True, 1_000_000).make_buffer(spec).nbytes if frames_once else 1_000_000 * reported
        print(f"| {name} | {reported:,.0f} | {grown / cap:,.0f} | {million / 2**30:.2f} GiB "
              f"({million / 1e6:,.0f} B/transition) |")
        del memory
    print(f"\ntargets: <= 1.1 x {FRAME:,} = {1.1 * FRAME:,.0f} B per transition; 1M transitions <= 8 GB "
          f"({8e9 / 2**30:.2f} GiB)")


def actor(steps: int) -> None:
    print(f"\n## actor: env steps/s, {PONG}, 8 envs, the Nature CNN policy on the CPU (torch threads 1)\n")
    torch.set_num_threads(1)
    envs = 8
    spec = env_spec(EnvConfig(PONG))
    results = {}
    for name in ("bare", "sending"):
        cfg = config(envs, True)
        cfg.epsilon = 0.0  # every action from the network, in both
        worker = cfg.make_worker(spec, cfg.make_parameter(spec, torch.device("cpu")), 0, 1, 0)
        worker.training = name == "sending"
        codec = Codec(compress=True)
        with Rollout(EnvConfig(PONG), worker, envs, seed=0) as rollout:
            for _ in range(20):
                rollout.step()
            t0 = time.perf_counter()
            start = rollout.env_steps
            seq = 0
            while rollout.env_steps - start < steps:
                rollout.step()
                if worker.pending() >= 256:
                    rows = worker.take()
                    assert rows is not None
                    priorities = worker.initial_priorities(rows)
                    codec.encode_batch(BatchHeader("bench", 0, 1, seq, 1, len(rows["action"]), time.time()),
                                       rows, priorities)
                    seq += 1
            results[name] = (rollout.env_steps - start) / (time.perf_counter() - t0)
    print("| bare (act only) | sending (act, rows, priorities, zstd) | ratio |")
    print("|---|---|---|")
    print(f"| {results['bare']:,.0f} steps/s | {results['sending']:,.0f} steps/s "
          f"| {results['sending'] / results['bare']:.2f} |")


class RandomActions:
    """A worker that acts uniformly at random and keeps nothing: the env path alone."""

    training = False

    def __init__(self, num_envs: int, n_actions: int) -> None:
        self.num_envs = num_envs
        self.n_actions = n_actions
        self.rng = np.random.default_rng(0)

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        pass

    def act(self, obs: np.ndarray) -> np.ndarray:
        return self.rng.integers(self.n_actions, size=len(obs))

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        pass


def vector(steps: int, envs: int) -> None:
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})  # one core: ale-py's C++ thread shares it with Python
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    print(f"\n## vector: env steps/s of one actor on one core (CPU {cpu}), {PONG}, {envs} envs, one thread\n")
    spec = env_spec(EnvConfig(PONG))
    n_actions = spec.actions.n if isinstance(spec.actions, DiscreteActions) else 0
    print("| actions | gymnasium's wrappers (sync) | ale-py's vector env (ale) | ale ÷ sync |")
    print("|---|---|---|---|")
    for name in ("random", "Nature CNN"):
        rates = {}
        for vectorization in ("sync", "ale"):
            if name == "random":
                worker: Any = RandomActions(envs, n_actions)
            else:
                cfg = config(envs, True)
                cfg.epsilon = 0.0  # every action from the network
                worker = cfg.make_worker(spec, cfg.make_parameter(spec, torch.device("cpu")), 0, 1, 0)
                worker.training = False
            with Rollout(EnvConfig(PONG), worker, envs, seed=0, vectorization=vectorization) as rollout:
                for _ in range(20):
                    rollout.step()
                start, t0 = rollout.env_steps, time.perf_counter()
                while rollout.env_steps - start < steps:
                    rollout.step()
                rates[vectorization] = (rollout.env_steps - start) / (time.perf_counter() - t0)
        print(f"| {name} | {rates['sync']:,.0f} steps/s | {rates['ale']:,.0f} steps/s "
              f"| {rates['ale'] / rates['sync']:.2f} |")


def fetch_params(board: Board, cache: ParamsCache | None, head: tuple[int, int], max_bytes: int) -> None:
    """What an actor does when the version on the board moves to ``head``."""
    get = partial(board.get_params, max_bytes)
    record = get() if cache is None else cache.get(head, get)
    assert record is not None and record.version >= head[1]


def params(versions: int) -> None:
    print("\n## params: what a version of the Nature CNN (DQN, dueling, 6 actions) costs Redis\n")
    spec = env_spec(EnvConfig(PONG))
    arrays: dict[str, Any] = dqn.Config().make_parameter(spec, torch.device("cpu")).to_arrays()
    weights = sum(a.size for a in arrays.values())
    blob = Codec(task="bench").encode_params(arrays, {"version": 1})
    print(f"{weights:,} weights; a params message of {len(blob) / 2**20:.2f} MiB "
          f"(bound {params_message_bytes(arrays) / 2**20:.2f} MiB)\n")
    print(f"N simulated actors on this one machine (threads, a Redis connection each) fetch each of {versions} "
          "versions as an actor does when the version on the board moves: each with its own GET (srl before), or "
          "through the machine's params cache (srl's default). Redis bytes out from INFO's "
          "total_net_output_bytes.\n")
    print("| actors on the machine | each fetches its own: MiB out per version | shared per machine | ratio |")
    print("|---|---|---|---|")
    client = redis.Redis(host="127.0.0.1")
    task = f"bench-params-{uuid.uuid4().hex[:6]}"
    board = Board(client, task)
    board = board.bound(board.create_task(json.dumps({"bench": True})).task_id)
    epoch = board.claim_trainer("bench", 3_600_000)
    assert epoch is not None
    version = 0
    for n in (16, 64):
        out = {}
        for mode in ("own", "shared"):
            with tempfile.TemporaryDirectory() as directory:
                boards = [Board(redis.Redis(host="127.0.0.1"), task).bound(board.task_id) for _ in range(n)]
                caches = [ParamsCache(Path(directory), f"bench {board.task_id}") for _ in range(n)]
                before = int(client.info("stats")["total_net_output_bytes"])
                for _ in range(versions):
                    version += 1
                    assert board.publish_params("bench", epoch, version, blob, version)
                    threads = [threading.Thread(target=fetch_params, args=(b, c if mode == "shared" else None,
                                                                           (epoch, version), len(blob)))
                               for b, c in zip(boards, caches, strict=True)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                out[mode] = (int(client.info("stats")["total_net_output_bytes"]) - before) / versions / 2**20
                for b in boards:
                    b.client.close()
        print(f"| {n} | {out['own']:,.1f} | {out['shared']:,.1f} | {out['shared'] / out['own']:.3f} |")
    board.delete_task()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="wire,replay,actor,vector,params")
    parser.add_argument("--steps", type=int, default=3000, help="env steps per measurement")
    parser.add_argument("--envs", type=int, default=8, help="envs of the actor in the vector table")
    parser.add_argument("--replay-capacity", type=int, default=100_000)
    parser.add_argument("--versions", type=int, default=5, help="params versions fetched per measurement")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if "wire" in parts:
        wire(args.steps)
    if "replay" in parts:
        replay(args.steps, args.replay_capacity)
    if "actor" in parts:
        actor(args.steps)
    if "vector" in parts:
        vector(args.steps, args.envs)
    if "params" in parts:
        params(args.versions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
