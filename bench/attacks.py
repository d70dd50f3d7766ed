"""What a live trainer does with each hostile message, one at a time: a table for the operator.

    python bench/attacks.py [--redis-url redis://127.0.0.1:6379/0]

Starts a real trainer process (``srl trainer``) on a fresh task, sends each message of the hardening
table to the task's queue on its own, and records whether the trainer survived, how the message was
counted and noted (the dead-letter reason), and how much its peak RSS (VmHWM) grew. Before each
message the peak is reset to the current RSS ("5" to /proc/PID/clear_refs, Linux), so each row's
growth is that message's own; where the kernel refuses the reset, the column is the running peak
(a row shows only growth beyond every earlier message's) and the table says so. Then an actor
joins and the run must reach its train count on good batches.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srl
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import Board
from srl.runner.distribution.queues import open_queue
from tests.nodes import FAST_ACTOR, FAST_TRAINER, ClientThread, tiny_config, wait_for
from tests.test_attacks import hostile_messages, peak_rss_mib


def reset_peak_rss(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS, so the next peak is measured from here; False where
    that is refused (not Linux, an old kernel, no permission): VmHWM then stays the peak since it started."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def node(role: str, url: str, task: str, log: Path) -> subprocess.Popen[bytes]:
    args = FAST_TRAINER if role == "trainer" else FAST_ACTOR
    return subprocess.Popen([sys.executable, "-m", "srl.cli", role, "--url", url, "--task-name", task, *args],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=os.environ.copy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    task = f"bench-attacks-{uuid.uuid4().hex[:6]}"
    params = RedisParameters(url=args.redis_url, task_name=task)
    board = Board(params.connect(), task)
    logs = Path(tempfile.mkdtemp(prefix="srl-attacks-"))
    client = ClientThread(srl.Runner("Pendulum-v1", tiny_config()), params, max_train_count=1000)
    client.start()
    trainer = node("trainer", args.redis_url, task, logs / "trainer.log")
    procs = [trainer]
    rows = []
    each_own_peak = True
    try:
        wait_for(lambda: (s := board.get_status()) and s.params_version >= 1, 60, "the trainer")
        with open_queue(None, namespace=task, role="producer", redis_params=params) as queue:
            for name, message in hostile_messages().items():
                bad = board.get_counters().get("bad_messages", 0)
                each_own_peak = reset_peak_rss(trainer.pid) and each_own_peak
                rss = peak_rss_mib(trainer.pid)
                queue.put(message)
                wait_for(lambda b=bad: board.get_counters().get("bad_messages", 0) > b, 60, name)  # type: ignore[misc]
                time.sleep(0.3)  # let a late allocation show in VmHWM
                reason = board.get_dead_letters(1)[-1].reason
                rows.append((name, len(message), trainer.poll() is None, peak_rss_mib(trainer.pid) - rss, reason))
        procs.append(node("actor", args.redis_url, task, logs / "actor.log"))
        client.join(300)
        status = board.get_status()
        counters = board.get_counters()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    print(f"\nhostile messages against a live trainer (task {task}; logs in {logs})")
    peak = "peak RSS +MiB" if each_own_peak else "running peak +MiB"
    print(f"{'message':<52} {'bytes':>9} {'alive':>5} {peak:>17}  dead-letter reason")
    for name, size, alive, grew, reason in rows:
        print(f"{name:<52} {size:>9} {'yes' if alive else 'NO':>5} {grew:>17.1f}  {reason[:90]}")
    if not each_own_peak:
        print("(the peak could not be reset before each message: a row shows only growth beyond the trainer's "
              "peak so far)")
    assert status is not None
    print(f"\nafterwards: task {status.status.value} ({status.end_reason}), train_count {status.train_count}, "
          f"trainer epoch {status.trainer_epoch} (1 = never lost its lease), bad messages "
          f"{counters.get('bad_messages', 0):.0f}, good transitions ingested "
          f"{counters.get('received_transitions', 0):.0f}")
    board.delete_task()


if __name__ == "__main__":
    main()
