"""The client's parts without Redis: its lines are pure functions of what was read from the board, and its
one finish takes the same steps in the same order whichever way a run ended."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from srl.runner.distribution.board.board import Refusal, TaskState, TaskStatus
from srl.runner.distribution.client import train
from srl.runner.distribution.client.check import TaskRequest
from srl.runner.distribution.client.evaluator import history_text
from srl.runner.distribution.client.report import BoardSnapshot, NodeHints, Serving, progress_text, summary_text
from srl.runner.distribution.node.stats import ActorStats, Reports, TrainerStats


def _status(state: TaskState = TaskState.ACTIVE, end_reason: str = "") -> TaskStatus:
    return TaskStatus(task_name="t", status=state, end_reason=end_reason, created_at=1.0, started_at=1.0,
                      ended_at=None, actor_num=4, max_train_count=None, max_steps=None, timeout=None, params_epoch=0,
                      params_version=0, train_count=0, board_format=1, srl_version="")


def _serving(**overrides: object) -> Serving:
    values: dict[str, object] = {
        "actor_num": 4, "central": False, "elastic": False, "trainer": None, "inference": [None],
        "actors": ["actor-0", None, None, None],
        "refusals": {"trainer": [Refusal("node-9", "trainer", "no GPU", 0.0)], "actor": [], "inference": []},
        "inference_addresses": [], "read_at": 100.0,
    }
    return Serving(**{**values, **overrides})  # type: ignore[arg-type]


SNAPSHOT = BoardSnapshot(
    Reports(trainer=TrainerStats(uid="trainer-1", train_count=40, updated_at=90.0),
            actors={0: ActorStats(uid="actor-0", env_steps=500, episodes=3, reward=-12.5)}),
    {"env_steps": 500.0, "sent_batches": 7.0, "received_batches": 6.0},
    (1, 9, 42),
)


def test_a_progress_line_is_formatted_from_a_snapshot_and_leaves_it_as_it_was() -> None:
    serving = _serving()
    lines = progress_text(SNAPSHOT, serving, _status(), 20.0, max_train_count=100, hints=NodeHints("--host h"))
    assert lines[0].startswith("task ACTIVE 20s elapsed") and "train 40/100" in lines[0], lines[0]
    assert lines[1] == "  trainer: MISSING for 10s — node-9 refuses the task: no GPU", lines[1]
    assert lines[2].startswith("  actor 0 actor-0:") and "reward -12.5" in lines[2], lines[2]
    assert lines[3] == "  actor 1: MISSING for 20s — start one: srl actor --host h (or actor_run_forever(...))"
    assert progress_text(SNAPSHOT, serving, _status(), 20.0, max_train_count=100, hints=NodeHints("--host h")) \
        == lines  # the refusal said once a line, not taken from the snapshot
    elastic = progress_text(SNAPSHOT, _serving(elastic=True), _status(), 20.0)
    assert elastic[-1] == "  actor slot(s) 1-3: free (elastic: 1 of up to 4 actors)", elastic


def test_the_summary_and_a_history_row_take_the_newer_train_count_of_stats_and_params() -> None:
    lines = summary_text(SNAPSHOT, _status(TaskState.END, "max_train_count 42 reached"), 10.0, queued=1)
    assert lines[0].startswith("run END after 10s (max_train_count 42 reached): train 42 (4/s)"), lines[0]
    assert lines[1] == "  batches: sent 7 = received 6 + refused 0 + still queued 1: all accounted for", lines[1]
    assert "params v9" in lines[2], lines[2]
    row = history_text(SNAPSHOT, eval_mean=-3.0)
    assert row["train_count"] == 42 and row["eval_mean"] == -3.0 and row["actor0_env_steps_per_s"] == 0


class _Recorder:
    """Stands in for the board, the runner, the evaluator, the checkpoints and log_dir, noting each step."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.dir = Path("log")
        self.env_steps = self.episodes = 0

    def stop(self) -> None:
        self.steps.append("evaluator stopped")

    def evaluate_now(self, final: bool = False) -> None:
        self.steps.append(f"evaluated (final={final})")

    def save(self, path: Path) -> None:
        self.steps.append(f"saved {path.name}")


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "cancelled"])
def test_the_finish_takes_the_same_steps_in_the_same_order_for_an_end_and_a_cancel(
    monkeypatch: pytest.MonkeyPatch, ended: bool
) -> None:
    fake = _Recorder()
    note = fake.steps.append
    monkeypatch.setattr(train, "await_trainer_end",
                        lambda board, announce_after=0.0: note(f"awaited ({announce_after})"))
    monkeypatch.setattr(train, "load_final_params", lambda board, runner, codec: note("params loaded"))
    monkeypatch.setattr(train, "_note_totals", lambda run: note("totals"))
    monkeypatch.setattr(train, "_keep_last_checkpoint",
                        lambda board, checkpoints, clear: note(f"checkpoint kept (clear={clear})"))
    monkeypatch.setattr(train, "record_history", lambda board, run_log, evaluator: note("history"))
    monkeypatch.setattr(train, "queue_depth", lambda queue_params, redis_params: 0)
    monkeypatch.setattr(train, "task_elapsed", lambda board, status: 1.0)
    monkeypatch.setattr(train, "summary_lines", lambda *args: ["summary"])
    monkeypatch.setattr(train.logger, "info", lambda fmt, *args: note(args[-1] if args else fmt))
    request = TaskRequest(**{**{f.name: None for f in dataclasses.fields(TaskRequest)}, "progress_interval": 5.0})
    fake_: Any = fake
    run = train.ClientRun(runner=fake_, request=request, resolved=fake_, embedded=None, codec=fake_, run_log=fake_,
                          resume=None, board=fake_, submitted=True, evaluator=fake_, checkpoints=fake_)
    train._finish(run, _status(TaskState.END) if ended else None)
    shared = ["evaluator stopped", f"awaited ({1.0 if ended else 0.0})", "params loaded",
              f"checkpoint kept (clear={ended})", "saved final.safetensors"]
    assert [step for step in fake.steps if step in shared] == shared, fake.steps
    if ended:
        assert fake.steps == [*shared[:3], "totals", shared[3], "history", "summary", "evaluated (final=True)",
                              shared[4]]
    else:
        assert fake.steps == shared


class _Clock:
    """A clock that moves only when the code under test pauses."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.now += seconds


def test_the_totals_wait_for_a_senders_count_that_lands_after_the_end() -> None:
    """A sender cut off from the board (its lease lapsed) counts its last send once the board answers again,
    after the task ended: the client reads the counters again until the senders' counts cover what arrived."""
    reads = [{"sent_batches": 11.0, "received_batches": 12.0}] * 3 + [{"sent_batches": 12.0, "received_batches": 12.0}]
    taken: list[dict[str, float]] = []

    def read() -> dict[str, float]:
        taken.append(reads[min(len(taken), len(reads) - 1)])
        return taken[-1]

    clock = _Clock()
    counters = train.settle_counters(read, wait_s=10.0, clock=clock, pause=clock.pause)
    assert counters["sent_batches"] == 12.0 and len(taken) == 4


def test_the_totals_wait_no_longer_than_their_budget_for_counts_that_never_come() -> None:
    clock = _Clock()
    reads: list[int] = []
    surplus = {"sent_batches": 5.0, "received_batches": 5.0, "refused_batches": 1.0}  # a killed sender's last

    def read() -> dict[str, float]:
        reads.append(1)
        return surplus

    assert train.settle_counters(read, wait_s=2.0, clock=clock, pause=clock.pause) is surplus
    assert 2.0 <= clock.now < 2.2 and len(reads) >= 20


@pytest.mark.parametrize("counters", [
    {"sent_batches": 12.0, "received_batches": 12.0},
    {"sent_batches": 12.0, "received_batches": 9.0},  # still queued
    {"sent_batches": 12.0, "received_batches": 13.0, "given_back_batches": 1.0},  # read again, queued
])
def test_balanced_or_queued_totals_are_read_once(counters: dict[str, float]) -> None:
    reads: list[int] = []

    def read() -> dict[str, float]:
        reads.append(1)
        return counters

    def pause(seconds: float) -> None:
        raise AssertionError("waited for counts that were all in")

    assert train.settle_counters(read, pause=pause) is counters and len(reads) == 1
