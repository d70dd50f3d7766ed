"""Central inference (SEED RL) against each actor running its own network: what the actors get done.

    python bench/inference.py                              # every table
    python bench/inference.py --only throughput --seconds 30
    python bench/inference.py --only rtt
    python bench/inference.py --only batching              # the act path alone, in this process
    python bench/inference.py --envs MinAtar/Breakout-v1   # one env only

Tables (needs Redis on 127.0.0.1:6379; nodes are real ``srl`` processes; IMPALA's config as it comes):

  throughput  agent steps/s of ``--actors`` actors x ``--envs-per-actor`` envs, local inference (each actor
              runs the network, fetches params) against central (``srl inference`` servers batch the actors'
              requests: ``--servers`` of them, actors double-buffered or not: ``--double-buffer``), measured
              over ``--seconds`` after a warm-up, in the same run. No trainer
              learns meanwhile (it would take the same two cores): this process publishes a params version
              every ``--publish-interval`` seconds (IMPALA publishes every 4 train steps: several a second)
              and drains the queue, acking every batch. Beside each: the params bytes actors
              fetched per second, Redis's bytes out per second, the server's envs per forward pass and how
              long a request waited for its batch, and the server processes' CPU time (user + system, every
              thread, from /proc; every server's together) per agent step. On MinAtar Breakout (MinAtar's
              CNN) and on Pong frames (the Nature CNN).
  rtt         one actor's round trip (request out, actions back) to a server in another process, p50 and
              p99 over ``--round-trips``: CartPole with one env (the smallest request) and MinAtar with 8.
  batching    what batching buys the server, nothing else running in the way: the CPU time per env step of
              its act path (each worker's policy inputs, one forward pass over their joined envs, the split,
              each worker's actions and observations) for W workers x E envs in this process, one torch
              thread, no network, no other process. W = 1 is what a local actor runs; W = ``--actors`` is a
              server's batch when every actor's request is in it. Needs no Redis.

A ratio is taken within one run (with ``--repeat N``, the medians of N turns through every row). Nothing
else should run meanwhile (two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srl
from srl.algorithms import impala
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.actor.inference_client import InferenceClient
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.node.stop import StopFlag
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.wire.codec import Codec, task_tag

REDIS_URL = "redis://127.0.0.1:6379/0"
ENVS = ("MinAtar/Breakout-v1", "ALE/Pong-v5")
NODE_ARGS = ["--heartbeat-interval", "0.5", "--task-poll-interval", "0.2"]


class Task:
    """A task on the bench's Redis, with this process as its trainer: one params version published, every
    batch drained and acked."""

    def __init__(self, env: str, config: impala.Config, actors: int, inference: str,
                 publish_interval: float = 0.0, servers: int = 1, double_buffer: bool = False) -> None:
        self.name = f"bench-inference-{uuid.uuid4().hex[:8]}"
        self.redis_params = RedisParameters(url=REDIS_URL, task_name=self.name)
        board = Board(self.redis_params.connect(), self.name)
        runner = srl.Runner(env, config)
        task = {**runner.task_config(), "actor_num": actors, "max_steps": 10**12,
                "queue": {"scheme": "redis", "capacity": 64}, "inference": inference,
                **({"inference_servers": servers, "double_buffer": double_buffer} if inference == "central" else {})}
        status = board.create_task(json.dumps(task))
        self.board = board.bound(status.task_id)
        self.board.set_active()
        epoch = self.board.claim_trainer("bench-trainer", 600_000)
        assert epoch is not None
        self.epoch, self.codec, self.arrays = epoch, Codec(task=self.name), runner.parameter.to_arrays()
        self.version = 0
        self.publish()
        self.spec = runner.spec
        self.stop = threading.Event()
        self.drained = 0
        self._threads = [threading.Thread(target=self._drain_loop, daemon=True)]
        if publish_interval > 0:
            self._threads.append(threading.Thread(target=self._publish_loop, args=(publish_interval,), daemon=True))
        for thread in self._threads:
            thread.start()

    def publish(self) -> None:
        self.version += 1
        meta = {"epoch": self.epoch, "version": self.version, "train_count": self.version}
        blob = self.codec.encode_params(self.arrays, meta)
        assert self.board.publish_params("bench-trainer", self.epoch, self.version, blob, self.version)

    def _publish_loop(self, interval: float) -> None:
        while not self.stop.wait(interval):
            self.publish()

    def _drain_loop(self) -> None:
        queue = open_queue(None, namespace=self.name, role="consumer", redis_params=self.redis_params)
        try:
            while not self.stop.is_set():
                message = queue.get(timeout=0.2)
                if message is not None:
                    message.ack()
                    self.drained += 1
        finally:
            queue.close()

    def end(self) -> None:
        self.board.end_task("END", "bench over")
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=10)

    def delete(self) -> None:
        self.board.delete_task()


def start_node(role: str, task: Task, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "srl.cli", role, "--url", REDIS_URL, "--task-name", task.name, "--run-once",
           *NODE_ARGS, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_nodes(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def actor_totals(board: Board, actors: int) -> tuple[int, int] | None:
    """(env steps, params bytes fetched) of every actor as their heartbeats say; None until all report."""
    stats = board.get_all_stats()
    rows = [stats.get(f"actor:{i}") for i in range(actors)]
    if any(r is None or not r.get("env_steps") for r in rows):
        return None
    return (sum(int(r["env_steps"]) for r in rows if r), sum(int(r.get("params_fetched_bytes", 0)) for r in rows if r))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process ``pid`` has used (Linux ``/proc``; its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def net_out(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def throughput(env: str, mode: str, actors: int, envs: int, seconds: float, warmup: float, publish_interval: float,
               server_args: tuple[str, ...] = (), servers: int = 1, double_buffer: bool = False,
               actor_args: tuple[str, ...] = ()) -> dict[str, Any]:
    config = impala.Config(envs_per_actor=envs)
    task = Task(env, config, actors, mode, publish_interval, servers, double_buffer)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if mode == "central":
            procs += [start_node("inference", task, "--listen", "127.0.0.1:0", *server_args) for _ in range(servers)]
        server_pids = [p.pid for p in procs]
        procs += [start_node("actor", task, *actor_args) for _ in range(actors)]
        deadline = time.monotonic() + 120
        while actor_totals(task.board, actors) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode} actors on {env} did not start within 120 s")
            time.sleep(0.2)
        time.sleep(warmup)
        client = task.board.client
        cpu0 = sum(cpu_seconds(pid) for pid in server_pids)
        first, out0, t0 = actor_totals(task.board, actors), net_out(client), time.monotonic()
        time.sleep(seconds)
        last, out1, t1 = actor_totals(task.board, actors), net_out(client), time.monotonic()
        cpu1 = sum(cpu_seconds(pid) for pid in server_pids)
        assert first is not None and last is not None
        stats = task.board.get_all_stats()
        reports = [stats[name] for name in stats if name.startswith("inference")]
        elapsed = t1 - t0
        return {
            "steps_per_s": (last[0] - first[0]) / elapsed,
            "params_bytes_per_s": (last[1] - first[1]) / elapsed,
            "redis_out_per_s": (out1 - out0) / elapsed,
            "batch_envs": np.mean([r["batch_envs_mean"] for r in reports]) if reports else None,
            "batch_wait_ms": np.mean([r["batch_wait_ms_mean"] for r in reports]) if reports else None,
            # the actors' step counts come with their heartbeats: a long window keeps their lag small beside it
            "server_us_per_step": (cpu1 - cpu0) * 1e6 / max(1, last[0] - first[0]) if server_pids else None,
        }
    finally:
        task.end()
        stop_nodes(procs)
        task.delete()


def print_throughput(envs: list[str], args: argparse.Namespace) -> None:
    print(f"\nagent steps/s, {args.actors} actors x {args.envs_per_actor} envs, IMPALA as it comes, "
          f"{args.seconds:g} s each after {args.warmup:g} s warm-up (server: max_wait_ms "
          f"{', '.join(args.max_wait_ms)}, torch_threads {', '.join(args.server_threads)}; actors' central_nice "
          f"{', '.join(args.central_nice)}; a params version every "
          f"{args.publish_interval:g} s)")
    print(f"{'env':<22}{'mode':<44}{'steps/s':>9}{'central/local':>15}{'params B/s to actors':>22}"
          f"{'Redis out B/s':>15}{'envs/batch':>12}{'wait ms':>9}{'server CPU us/step':>20}")
    for env in envs:
        rows: dict[str, tuple[str, tuple[str, ...], int, bool, tuple[str, ...]]] = {
            "local": ("local", (), 1, False, ())}
        for servers in args.servers:
            for double in args.double_buffer:
                for wait in args.max_wait_ms:
                    for threads in args.server_threads:
                        for nice in args.central_nice:
                            label = "central" + (f", {servers} servers" if servers > 1 else "") + (
                                ", double-buffered" if double else "") + (
                                f", wait {wait} ms" if len(args.max_wait_ms) > 1 else "") + (
                                f", {threads} thread{'s' if threads != '1' else ''}" if len(args.server_threads) > 1
                                else "") + (f", actors' nice {nice}" if len(args.central_nice) > 1 else "")
                            rows[label] = ("central", ("--max-wait-ms", wait, "--torch-threads", threads), servers,
                                           double, ("--central-nice", nice))
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in rows}
        for _ in range(args.repeat):  # every row once, then again: a drift of the machine touches them all alike
            for label, (mode, server_args, servers, double, actor_args) in rows.items():
                runs[label].append(throughput(env, mode, args.actors, args.envs_per_actor, args.seconds, args.warmup,
                                              args.publish_interval, server_args, servers, double, actor_args))
        local = float(np.median([r["steps_per_s"] for r in runs["local"]]))
        for label, found in runs.items():
            r = {key: _median([run[key] for run in found]) for key in found[0]}
            spread = (f" ({min(x['steps_per_s'] for x in found):.0f}-{max(x['steps_per_s'] for x in found):.0f})"
                      if len(found) > 1 else "")
            batch = "" if r["batch_envs"] is None else f"{r['batch_envs']:.1f}"
            wait = "" if r["batch_wait_ms"] is None else f"{r['batch_wait_ms']:.2f}"
            cpu = "" if r["server_us_per_step"] is None else f"{r['server_us_per_step']:.1f}"
            print(f"{env:<22}{label:<44}{r['steps_per_s']:>9.0f}{r['steps_per_s'] / local:>15.2f}"
                  f"{r['params_bytes_per_s']:>22,.0f}{r['redis_out_per_s']:>15,.0f}{batch:>12}{wait:>9}{cpu:>20}"
                  f"{spread}", flush=True)


def _median(values: list[Any]) -> Any:
    return None if values[0] is None else float(np.median(values))


def round_trips(env: str, envs: int, count: int) -> tuple[float, float]:
    """p50 and p99 seconds of ``count`` round trips of one actor to a server in another process."""
    task = Task(env, impala.Config(envs_per_actor=envs), 1, "central")
    procs = [start_node("inference", task, "--listen", "127.0.0.1:0")]
    try:
        uid = "bench-actor"
        task.board.claim_lease("actor:0", uid, 600_000)
        deadline = time.monotonic() + 60
        while task.board.get_inference_address() is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the inference server did not start within 60 s")
            time.sleep(0.1)
        client = InferenceClient(task.board, task.spec, envs, 0, f"{uid}.0", task_tag(task.board.task_id),
                                 Codec(task=task.name), StopFlag())
        obs = np.zeros((envs, *task.spec.obs_shape), task.spec.obs_dtype)
        none = np.zeros(envs, bool)
        times = []
        for i in range(count + 200):
            started = time.perf_counter()
            client.act(obs)
            if i >= 200:
                times.append(time.perf_counter() - started)
            client.observe(np.zeros(envs, np.float32), obs, none, none)
        client.close()
        return float(np.percentile(times, 50)), float(np.percentile(times, 99))
    finally:
        task.end()
        stop_nodes(procs)
        task.delete()


def print_rtt(args: argparse.Namespace) -> None:
    print(f"\nround trip of one actor to an inference server in another process, {args.round_trips} requests")
    print(f"{'env':<22}{'envs':>5}{'p50 ms':>9}{'p99 ms':>9}")
    for env, envs in (("CartPole-v1", 1), ("MinAtar/Breakout-v1", 8)):
        p50, p99 = round_trips(env, envs, args.round_trips)
        print(f"{env:<22}{envs:>5}{1000 * p50:>9.3f}{1000 * p99:>9.3f}", flush=True)


def act_path_us(env: str, workers: int, envs: int, seconds: float = 2.0) -> float:
    """CPU microseconds per env step of the server's act path for ``workers`` x ``envs`` (see ``batching``)."""
    from srl.base.rl import join_policy_io, split_policy_io

    config = impala.Config(envs_per_actor=envs)
    spec = srl.Runner(env, config).spec
    parameter = config.make_parameter(spec, "cpu")
    group = [config.make_worker(spec, parameter, i, workers, i) for i in range(workers)]
    obs = np.zeros((envs, *spec.obs_shape), spec.obs_dtype)  # a stack of equal frames slides as frames sent once need
    reward, no = np.zeros(envs, np.float32), np.zeros(envs, bool)
    for worker in group:
        worker.training = True
        worker.reset(np.arange(envs), obs)

    def turn() -> None:
        with torch.inference_mode():
            outputs = group[0].policy(join_policy_io([worker.policy_inputs(obs) for worker in group]))
            for worker, part in zip(group, split_policy_io(outputs, [envs] * workers), strict=True):
                worker.act_with(obs, part)
                worker.observe(reward, obs, no, no)

    for _ in range(10):
        turn()
    turns, started, deadline = 0, time.thread_time(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        turn()
        turns += 1
    return (time.thread_time() - started) / (turns * workers * envs) * 1e6


def print_batching(envs: list[str], args: argparse.Namespace) -> None:
    sizes = sorted({1, args.actors})
    per_actor = sorted({8, 32, args.envs_per_actor})
    print("\nthe server's act path alone, CPU us per env step (this process, one torch thread; IMPALA as it comes)")
    print(f"{'env':<22}{'workers x envs':>16}{'us/step':>10}{'x of 1 worker':>15}")
    for env in envs:
        for e in per_actor:
            alone = 0.0  # one worker's, the first row
            for w in sizes:
                us = act_path_us(env, w, e, args.act_seconds)
                alone = alone or us
                print(f"{env:<22}{f'{w} x {e}':>16}{us:>10.1f}{alone / us:>15.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="throughput,rtt,batching",
                        help="comma-separated: throughput, rtt, batching")
    parser.add_argument("--envs", default=",".join(ENVS), help="comma-separated env ids for throughput")
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--envs-per-actor", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--act-seconds", type=float, default=2.0, help="seconds each batching row is timed")
    parser.add_argument("--publish-interval", type=float, default=0.25, help="seconds between params versions")
    parser.add_argument("--max-wait-ms", default="0", help="the server's max_wait_ms; comma-separated: a row each")
    parser.add_argument("--server-threads", default="1", help="the server's torch_threads; comma-separated: a row each")
    parser.add_argument("--central-nice", default="10",
                        help="the central actors' central_nice (their CPU priority below the server's); "
                             "comma-separated: a row each")
    parser.add_argument("--servers", default="1,2", help="inference servers; comma-separated: a row each")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure every row this many times, in turn; print the medians (and the range)")
    parser.add_argument("--double-buffer", default="off,on",
                        help="actors double-buffered: off, on, or off,on (a row each)")
    args = parser.parse_args()
    only = {o.strip() for o in args.only.split(",")}
    try:
        if only - {"batching"}:
            redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError:
        sys.exit(f"needs Redis on {REDIS_URL} (scripts/services.sh start)")
    torch.set_num_threads(1)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args.max_wait_ms = [w.strip() for w in args.max_wait_ms.split(",") if w.strip()]
    args.server_threads = [t.strip() for t in args.server_threads.split(",") if t.strip()]
    args.servers = [int(n) for n in args.servers.split(",") if n.strip()]
    args.central_nice = [n.strip() for n in args.central_nice.split(",") if n.strip()]
    args.double_buffer = [{"off": False, "on": True}[d.strip()] for d in args.double_buffer.split(",") if d.strip()]
    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    if "throughput" in only:
        print_throughput(envs, args)
    if "rtt" in only:
        print_rtt(args)
    if "batching" in only:
        print_batching(envs, args)


if __name__ == "__main__":
    main()
