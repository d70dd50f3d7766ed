"""Attacks by anyone who can write to Redis or the queue, against live trainer and actor processes.

Each row of the hardening table is here: the node survives, counts what it refused, notes its source,
keeps its lease (no re-claim loop), goes on ingesting good batches, and its peak RSS stays bounded.
"""

from __future__ import annotations

import json
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import srl
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import EVENT_TEXT_LIMIT, TaskState
from srl.runner.distribution.queues import open_queue
from srl.runner.distribution.wire.codec import (
    ERROR_TEXT_LIMIT,
    BatchHeader,
    Codec,
)
from tests.forge import forge_batch, layout
from tests.nodes import ClientThread, Node, board_for, kill_all, lease_holder_pid, start, tiny_config, wait_for

pytestmark = pytest.mark.slow

MiB = 2**20




def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def pendulum_columns(n: int, **changes: np.ndarray) -> dict[str, np.ndarray]:
    columns = {"obs": np.zeros((n, 3), np.float32), "action": np.zeros(n, np.int64),
               "reward": np.zeros(n, np.float32), "next_obs": np.zeros((n, 3), np.float32),
               "discount": np.zeros(n, np.float32), "version": np.ones(n, np.int64)}
    columns.update(changes)
    return columns


def hostile_messages() -> dict[str, bytes]:
    """The hostile messages of the hardening table (and a few more), all unsigned."""
    one_column = {"obs": np.zeros((4, 3), np.float32)}
    return {
        "garbage": b"\x00garbage" * 10,
        "a pickle": pickle.dumps({"x": 1}),
        "created_at = NaN": forge_batch(pendulum_columns(4), created_at=float("nan")),
        "a forged first batch with one column 'junk'": forge_batch({"junk": np.zeros((4, 3), np.float32)}),
        "one 64 MiB row (compressed)": forge_batch({"obs": np.zeros((1, 16 * MiB), np.float32)}, compressed=True),
        "rows of 2**64 bytes claimed, none sent": forge_batch(
            one_column, layout_bytes=layout(one_column, {"obs": (2**32 - 1, 2**32 - 1)})),
        "4 billion rows claimed, none sent": forge_batch(one_column, count=2**32 - 1),
        "1,024 columns of 16 MiB rows claimed (compressed)": forge_batch(
            one_column, count=1, compressed=True,
            layout_bytes=layout({f"x{i}": np.zeros((1, 16 * MiB), np.uint8) for i in range(1024)})),
        "16 KB of malformed layout": forge_batch(one_column, layout_bytes=bytes(range(256)) * 62),
        "a 64 KB actor id": forge_batch(one_column, actor=b"a" * 65_000),
        "an action index far out of range": forge_batch(pendulum_columns(4, action=np.full(4, 10**9, np.int64)),
                                                        seq=1),
        "NaN observations": forge_batch(pendulum_columns(4, obs=np.full((4, 3), np.nan, np.float32)), seq=2),
        "a 40 MiB payload (left unread by the bounded read)": b"\0" * 40 * MiB,
        "another 40 MiB payload": b"\1" * 40 * MiB,
    }


def test_hostile_messages_are_counted_skipped_and_memory_stays_bounded(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=600)
    client.start()
    board = board_for(redis_url, namespace)
    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path)
    wait_for(lambda: (s := board.get_status()) and s.params_version >= 1, 60, "the trainer's first params")
    rss_before = peak_rss_mib(trainer.proc.pid)
    attacks = hostile_messages()
    with open_queue(None, namespace=namespace, role="producer",
                    redis_params=RedisParameters(url=redis_url, task_name=namespace)) as queue:
        queue.put_many(list(attacks.values()))  # before any real batch: the forged one is the "first"
    wait_for(lambda: board.get_counters().get("bad_messages", 0) >= len(attacks), 60, "every attack counted")
    assert trainer.alive(), trainer.output()
    rss_growth = peak_rss_mib(trainer.proc.pid) - rss_before
    start(nodes, "actor", redis_url, namespace, tmp_path)  # good batches after the bad ones
    client.join(180)
    assert client.error is None, client.error
    status = board.get_status()
    assert status is not None and status.status == TaskState.END and status.train_count >= 600
    assert status.trainer_epoch == 1, "the trainer lost its lease (a re-claim loop)"
    counters = board.get_counters()
    assert counters["bad_messages"] == len(attacks)
    assert counters["received_transitions"] >= tiny_config().warmup_size
    # bounded: nothing above allocates more than the task's message bound (a few hundred KB)
    assert rss_growth < 64, f"peak RSS grew by {rss_growth:.0f} MiB while refusing the attacks"
    letters = board.get_dead_letters()
    assert len(letters) == len(attacks)
    assert all(letter.source.startswith("redis stream") and len(letter.reason) <= ERROR_TEXT_LIMIT
               for letter in letters)
    assert sum("over the" in letter.reason and "read limit" in letter.reason for letter in letters) == 2
    assert all(len(e.text) <= EVENT_TEXT_LIMIT for e in board.get_events(1000))
    out = trainer.output()
    assert 1 <= out.count("skipped a bad message") < len(attacks)  # at most one line per heartbeat
    assert "Traceback" not in out


def test_signed_task_refuses_replays_foreign_and_tampered_data(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    secret = "s3cret"
    env = {"SRL_SECRET": secret}
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=2_000_000,
                          secret=secret)
    client.start()
    board = board_for(redis_url, namespace)
    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path, env=env)
    actor = start(nodes, "actor", redis_url, namespace, tmp_path, env=env)
    wait_for(lambda: board.get_counters().get("received_batches", 0) >= 2, 90, "the actor's batches to arrive")
    codec = Codec(secret=secret, task=namespace)

    def batch(seq: int, actor_id: str = "replayer", c: Codec = codec) -> bytes:
        return c.encode_batch(BatchHeader(actor_id, 0, 1, seq, 1, 1, time.time()), pendulum_columns(1), None)

    first = batch(0)
    fresh = [batch(seq) for seq in range(1, 4098)]  # 4,097 newer batches from the same actor
    foreign = batch(0, c=Codec(secret=secret, task="another-task"))  # valid bytes of another task
    unsigned = batch(1, c=Codec(secret="", task=namespace))
    before = board.get_counters()
    with open_queue(None, namespace=namespace, role="producer",
                    redis_params=RedisParameters(url=redis_url, task_name=namespace)) as queue:
        queue.put_many([first, *fresh])
        wait_for(lambda: board.get_counters().get("received_batches", 0) - before.get("received_batches", 0) >= 4098,
                 60, "the replayer's batches")
        queue.put_many([first, fresh[5], foreign, unsigned])  # an old replay, a recent replay, two forgeries
    wait_for(lambda: board.get_counters().get("duplicates", 0) - before.get("duplicates", 0) >= 2, 30,
             "both replays recognised")
    wait_for(lambda: board.get_counters().get("bad_messages", 0) - before.get("bad_messages", 0) >= 2, 30,
             "both forgeries refused")
    reasons = " ".join(letter.reason for letter in board.get_dead_letters())
    assert "another task" in reasons and "unsigned message refused" in reasons

    # an older signed params blob written back under a newer version: actors refuse it
    record = board.get_params()
    assert record is not None
    old_blob, old_version = record.blob, record.version
    wait_for(lambda: (r := board.get_params()) and r.version >= old_version + 2, 30, "newer params")
    bad_before = board.get_counters().get("bad_messages", 0)
    key = board.prefix
    trainer.signal(signal.SIGSTOP)  # so its next publish does not overwrite the forgery at once
    try:
        board.client.hset(key + "params", mapping={"blob": old_blob, "version": old_version + 1000})
        board.client.hset(key + "task", "params_version", old_version + 1000)
        wait_for(lambda: "old blob written back" in actor.output(), 30, "the actor to refuse the blob")
    finally:
        trainer.signal(signal.SIGCONT)
    wait_for(lambda: board.get_counters().get("bad_messages", 0) > bad_before, 30, "the refusal counted")

    # the task config changed on the board after the client signed it: nodes refuse it, and live on
    config = json.loads(board.client.hget(key + "task", "config"))
    config["rl_config"]["memory"]["capacity"] = 10**13
    board.end_task("END", "replaced by a forgery")
    client.join(60)
    wait_for(lambda: "stopped: task END" in trainer.output() and "stopped: task END" in actor.output(), 30,
             "both nodes to finish the real task")
    board.client.hset(key + "task", mapping={"config": json.dumps(config), "status": "ACTIVE", "end_reason": ""})
    wait_for(lambda: "refuses the task" in trainer.output() and "refuses the task" in actor.output(), 30,
             "both nodes to refuse the forged config")
    assert "signature does not match" in trainer.output()
    assert trainer.alive() and actor.alive()
    status = board.get_status()
    assert status is not None and status.status == TaskState.ACTIVE  # the nodes never ran it
    assert any("refuses the task" in e.text for e in board.get_events(50))
    board.end_task("END", "test over")


def test_unbuildable_configs_fail_the_task_and_the_nodes_live_on(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """Without a secret a writer to Redis can change the config: bounded fields and the module allow-list
    turn each forgery into a FAILED task with a reason, never a traceback or an import."""
    base = srl.Runner("Pendulum-v1", tiny_config()).task_config()
    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path)
    actor = start(nodes, "actor", redis_url, namespace, tmp_path)
    board = board_for(redis_url, namespace)
    forgeries: list[tuple[dict, str]] = [
        ({**base, "env": {"id": "unittest.__main__:CartPole-v1", "kwargs": {}}}, "does not allow"),
        ({**base, "rl_config": {**base["rl_config"], "memory": {**base["rl_config"]["memory"], "capacity": 10**13}}},
         "MemoryConfig.capacity"),
        ({**base, "actor_num": 10**7}, "actor_num"),
        ({**base, "rl_config": {**base["rl_config"], "hidden_block": {"layer_sizes": [16384] * 16}}}, "layer sizes"),
        ({**base, "rl_config": {**base["rl_config"], "lr": "1e400"}}, "lr"),
        ({**base, "actor_num": 10**400}, "integer of 401 digits"),  # math.isfinite would raise OverflowError
        ({**base, "rl_config": {**base["rl_config"], "lr": 10**400}}, "integer of 401 digits"),
    ]
    def forge(config: dict) -> None:
        """A valid task, then its config replaced with one HSET (what an intruder does)."""
        board.create_task(json.dumps({**base, "max_train_count": 50}), overwrite=True)
        board.client.hset(board.prefix + "task", "config", json.dumps({**config, "max_train_count": 50}))
        board.set_active()

    for config, why in forgeries:
        forge(config)
        status = wait_for(lambda: (s := board.get_status()) and s.status.finished and s, 30, f"FAILED ({why})")
        assert status.status == TaskState.FAILED and why in status.end_reason, status.end_reason
    # another queue scheme: the nodes refuse to serve it (it is not theirs) and wait
    forge({**base, "queue": {"scheme": "amqp", "capacity": 8}})
    wait_for(lambda: "refuses the task" in trainer.output() and "refuses the task" in actor.output(), 30,
             "the nodes to refuse another queue")
    assert trainer.alive() and actor.alive()
    for node in (trainer, actor):
        out = node.output()
        assert "Traceback" not in out and "Ran 0 tests" not in out  # unittest's CLI never ran
    # a module the node allows is built
    allowed = start(nodes, "trainer", redis_url, namespace + "-ok", tmp_path, "--allow-env-modules",
                    "gymnasium.envs.classic_control", "--run-once")
    ok_board = board_for(redis_url, namespace + "-ok")
    ok_board.create_task(json.dumps({**base, "env": {"id": "gymnasium.envs.classic_control:CartPole-v1",
                                                     "kwargs": {}}, "timeout": 1.0}))
    ok_board.set_active()
    wait_for(lambda: lease_holder_pid(ok_board, "trainer") == allowed.proc.pid or
             ((s := ok_board.get_status()) is not None and s.status.finished), 30, "the allowed env to be built")
    status = ok_board.get_status()
    assert status is not None and status.status != TaskState.FAILED, status.end_reason
    board.end_task("END", "test over")
    ok_board.end_task("END", "test over")


def test_numbers_no_reader_could_hold_in_every_record_leave_the_run_and_its_client_going(
    redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    """A 400-digit integer (and 1e400) written into every kind of board record mid-run: the client's progress
    lines, history and summary, the nodes' heartbeats and ``srl status`` skip what they cannot hold as a data
    error, and the run ends as it would have."""
    from srl.cli import main

    huge = "1" + "0" * 400
    runner = srl.Runner("Pendulum-v1", tiny_config())
    client = ClientThread(runner, RedisParameters(url=redis_url, task_name=namespace), max_train_count=600,
                          progress_interval=0.2)
    client.start()
    trainer = start(nodes, "trainer", redis_url, namespace, tmp_path)
    actor = start(nodes, "actor", redis_url, namespace, tmp_path)
    board = board_for(redis_url, namespace)
    wait_for(lambda: not client.is_alive() or ((s := board.get_status()) and s.train_count >= 100), 120,
             "training to be under way")
    p, r = board.prefix, board.client
    for n in (huge, "1e400"):
        r.hset(p + "counters", "intruder", f'{{"env_steps": {n}, "received_batches": {n}}}')
        r.hset(p + "counters", "actor:0", f'{{"env_steps": {n}, "sent_batches": {n}}}')  # the actor's own totals
        r.set(p + "stats:intruder", f'{{"updated_at": {time.time()}, "loss": {n}, "train_count": {n}}}')
        r.sadd(p + "roles", "intruder")
        r.lpush(p + "events", f'{{"ts": {n}, "level": "ERROR", "text": "forged"}}')
        r.lpush(p + "history", f'{{"train_count": {n}, "env_steps": {n}}}')
        r.hset(p + "refusals", "intruder", f'{{"role": "trainer", "reason": "forged", "ts": {n}}}')
        r.lpush(p + "deadletters", f'{{"ts": {n}, "source": "forged", "reason": "x", "size": {n}}}')
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    assert main(["status", "--host", host, "--port", port, "--task-name", namespace, "--events", "5",
                 "--dead-letters", "5"]) == 0
    client.join(240)
    assert not client.is_alive(), "the run did not end"
    assert client.error is None, f"the client crashed: {client.error!r}"
    status = board.get_status()
    assert status is not None and status.status == TaskState.END, status
    assert trainer.alive() and actor.alive()
    for node in (trainer, actor):
        assert "Traceback" not in node.output() and "crashed" not in node.output()


def test_a_redis_pause_longer_than_the_old_retry_limit(tmp_path: Path, nodes: list[Node]) -> None:
    """Redis paused (SIGSTOP) for 65 s, far past the 2 s lease TTL and the 60 s a node used to wait:
    both nodes live on, the trainer takes its own lease back and keeps its memory and train_count."""
    from tests.queue_fixtures import PrivateRedis

    server = PrivateRedis()
    server.start()
    try:
        url, ns = server.url, "pause"
        runner = srl.Runner("Pendulum-v1", tiny_config())
        client = ClientThread(runner, RedisParameters(url=url, task_name=ns), max_train_count=10**7)
        client.start()
        board = board_for(url, ns)
        trainer = start(nodes, "trainer", url, ns, tmp_path)
        actor = start(nodes, "actor", url, ns, tmp_path)
        wait_for(lambda: (s := board.get_status()) and s.train_count >= 300, 90, "training under way")
        before = board.get_status()
        assert before is not None
        memory_before = int(board.get_all_stats()["trainer"]["memory"])
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        time.sleep(65)
        server.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: "took its lapsed lease back" in trainer.output(), 30, "the trainer to re-take its lease")
        wait_for(lambda: (s := board.get_status()) and s.train_count > before.train_count + 200, 60,
                 "training to go on")
        after = board.get_status()
        assert after is not None and after.trainer_epoch == before.trainer_epoch == 1  # no new epoch
        assert int(board.get_all_stats()["trainer"]["memory"]) >= memory_before  # memory kept
        assert trainer.alive() and actor.alive()
        assert "fenced off" not in trainer.output()
        board.end_task("END", "test over")
        client.join(30)
    finally:
        kill_all(nodes)
        server.cleanup()
