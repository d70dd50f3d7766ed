"""The Redis blackboard against a real Redis: leases, fencing, task lifecycle, cleanup."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

import srl
from srl.runner.distribution.board.board import (
    BOARD_FORMAT_VERSION,
    DEADLETTER_CAP,
    EVENT_TEXT_LIMIT,
    Board,
    BoardDataError,
    BoardFormatError,
    DeadLetter,
    ParamsRecord,
    TaskExistsError,
    TaskNotFoundError,
    TaskState,
    count_token,
)
from srl.runner.distribution.client.evaluator import history_row
from srl.runner.distribution.client.report import progress_lines, summary_lines
from srl.runner.distribution.node.liveness import LeaseGuard, keep_lease
from srl.runner.distribution.node.serve import NodeOptions, serve
from srl.runner.distribution.settings.redis_parameters import RedisParameters
from tests.conftest import running
from tests.nodes import tiny_config, wait_for
from tests.queue_fixtures import PrivateRedis

CONFIG = json.dumps({"algorithm": "dqn", "fields": {"batch_size": 32}})


@pytest.fixture()
def private_client() -> Iterator[redis.Redis]:
    """A Redis of the test's own, for counting commands: the shared one also serves other tests' nodes."""
    with running(PrivateRedis()) as server:
        c = redis.Redis.from_url(server.url)
        yield c
        c.close()


@pytest.fixture()
def task(board: Board) -> Board:
    """A board with a task created on it."""
    board.create_task(CONFIG, actor_num=3)
    return board


def test_lease_claim_is_exclusive_under_a_race(board: Board) -> None:
    threads_n = 32
    barrier = threading.Barrier(threads_n)
    results: list[bool] = [False] * threads_n

    def claim(i: int) -> None:
        barrier.wait()
        results[i] = board.claim_lease("trainer", f"uid-{i}", 10_000)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1
    holder, ttl = board.lease_holder("trainer")
    assert holder == f"uid-{results.index(True)}"
    assert 0 < ttl <= 10_000


def test_claim_trainer_race_consumes_one_epoch(task: Board) -> None:
    board = task
    threads_n = 16
    barrier = threading.Barrier(threads_n)
    epochs: list[int | None] = [None] * threads_n

    def claim(i: int) -> None:
        barrier.wait()
        epochs[i] = board.claim_trainer(f"t-{i}", 10_000)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(e for e in epochs if e is not None) == [1]
    winner = f"t-{epochs.index(1)}"
    assert board.release_lease("trainer", winner)
    assert board.claim_trainer("t-next", 10_000) == 2


def test_renew_and_release_only_by_the_holder(board: Board) -> None:
    assert board.claim_lease("actor:0", "a", 5_000)
    assert not board.claim_lease("actor:0", "b", 5_000)
    assert not board.renew_lease("actor:0", "b", 60_000)
    assert not board.release_lease("actor:0", "b")
    assert board.renew_lease("actor:0", "a", 60_000)
    assert board.lease_holder("actor:0")[1] > 5_000
    assert board.release_lease("actor:0", "a")
    assert board.lease_holder("actor:0") == (None, -2)
    with pytest.raises(ValueError, match="lease name"):
        board.claim_lease("actor:x", "a", 1000)


def test_lease_expiry_frees_the_slot(task: Board) -> None:
    board = task
    assert board.claim_actor_slot("a", actor_num=1, ttl_ms=150) == 0
    assert board.claim_actor_slot("b", actor_num=1, ttl_ms=150) is None
    wait_for(lambda: board.lease_holder("actor:0")[0] is None, 5, "the lease to expire", interval=0.01)
    assert not board.renew_lease("actor:0", "a", 150)
    assert board.claim_actor_slot("b", actor_num=1, ttl_ms=10_000) == 0


def test_a_lease_is_kept_while_a_node_builds_its_run_and_lapses_after(board: Board) -> None:
    """A node renews its lease while it builds the run (which can outlast the TTL); after that, only its
    run's heartbeats keep it."""
    assert board.claim_lease("trainer", "a", 1000)
    with keep_lease(board, "trainer", "a", ttl_s=1.0, interval_s=0.1):
        time.sleep(3.0)  # a build three times the TTL: the time passing is the case under test
        assert board.lease_holder("trainer")[0] == "a"
    wait_for(lambda: board.lease_holder("trainer")[0] is None, 5, "the lease to lapse", interval=0.01)  # no heartbeats
    assert board.claim_lease("trainer", "b", 10_000)
    with keep_lease(board, "trainer", "a", ttl_s=1.0, interval_s=0.05):  # another's: renewing cannot take it
        time.sleep(0.2)
    assert board.lease_holder("trainer")[0] == "b"


def test_a_lease_guard_is_silent_while_heartbeats_are_on_time_and_renews_when_they_are_late(board: Board) -> None:
    """The guard renews only when the run's heartbeat is late by an interval (a slow params transfer in the
    heartbeat's thread); on time, it sends nothing."""
    assert board.claim_lease("trainer", "a", 1000)
    with LeaseGuard(board, "trainer", "a", ttl_s=1.0, interval_s=0.2) as guard:
        for _ in range(10):  # heartbeats every half interval: the guard never has to renew
            sent = time.monotonic()
            assert board.renew_lease("trainer", "a", 1000)
            guard.renewed(sent)
            time.sleep(0.1)
        assert guard.late_renewals == 0
        time.sleep(2.5)  # the heartbeat stuck for two and a half TTLs: the time passing is the case under test
        assert board.lease_holder("trainer")[0] == "a"
        assert guard.late_renewals >= 5


def test_a_lease_guard_that_finds_the_lease_taken_stops_until_the_run_took_it_back(board: Board) -> None:
    assert board.claim_lease("trainer", "b", 10_000)
    with LeaseGuard(board, "trainer", "a", ttl_s=1.0, interval_s=0.05) as guard:
        wait_for(lambda: not guard.armed, 5, "the guard to find the lease taken", interval=0.01)
        assert guard.late_renewals == 0 and board.lease_holder("trainer")[0] == "b"
        board.release_lease("trainer", "b")
        sent = time.monotonic()
        assert board.claim_lease("trainer", "a", 300)  # the run took it back and says so
        guard.renewed(sent)
        wait_for(lambda: guard.late_renewals > 0, 5, "the guard to renew again", interval=0.01)
    assert board.lease_holder("trainer")[0] == "a"


def test_a_renewal_dates_from_the_heartbeats_sending_not_its_answer(board: Board) -> None:
    """A cut link holds a heartbeat's answer: the renewal it reports was made before the cut, and the lease
    runs out a TTL after that. Counted from the answer, a run taking the lease back just after would say it
    was "0s without the board", and the guard would wait longer than an interval before renewing."""
    assert board.claim_lease("trainer", "a", 60_000)
    with LeaseGuard(board, "trainer", "a", ttl_s=60.0, interval_s=30.0) as guard:
        sent = time.monotonic()
        time.sleep(1.0)  # the heartbeat's answer held up by a cut: the time passing is the case under test
        guard.renewed(sent)
        assert guard.since_renewed() >= 1.0
        guard.renewed(sent - 10.0)  # an older heartbeat answered later still: the later renewal stands
        assert guard.since_renewed() < 10.0


def test_a_start_that_hangs_lets_its_lease_lapse(board: Board) -> None:
    """Renewing while a run starts stops after ``max_start_s``: a node whose start hangs (an env import,
    a CUDA init, a read that never returns) does not hold the slot for ever."""
    assert board.claim_lease("trainer", "a", 300)
    with keep_lease(board, "trainer", "a", ttl_s=0.3, interval_s=0.05, max_s=0.6):
        wait_for(lambda: board.lease_holder("trainer")[0] is None, 10, "the lease to lapse", interval=0.01)


def test_release_leases_of_frees_only_the_owners(board: Board) -> None:
    board.create_task(CONFIG, actor_num=3)
    assert board.claim_lease("trainer", "a", 10_000)
    assert board.claim_actor_slot("a", 3, 10_000, prefer=1) == 1
    assert board.claim_actor_slot("b", 3, 10_000) == 0
    assert board.release_leases_of("a", 3) == ["trainer", "actor:1"]
    assert board.held_leases(3) == ["actor:0"]
    assert board.release_leases_of("a", 3) == []


def test_a_node_stopped_mid_claim_releases_the_slot_the_board_granted(board: Board) -> None:
    """Ctrl-C can land after the board granted a slot and before the node learned which: the node still
    frees it on the way out, instead of leaving it held until its TTL runs out."""
    board.create_task({**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "actor_num": 2})
    board.set_active()

    def claim_then_stop(task_board: Board, task: object) -> int:
        assert task_board.claim_actor_slot("a", 2, 60_000, prefer=1) == 1
        raise KeyboardInterrupt

    def never_built(task_board: Board, task: object, slot: int) -> None:
        raise AssertionError("the node was stopped before building")

    with pytest.raises(KeyboardInterrupt):
        serve("actor", board, "here", NodeOptions(uid="a"), None, claim=claim_then_stop,
              lease_name=lambda slot: f"actor:{slot}", standby_note=lambda task_board, task: "",
              build_run=never_built)
    assert board.held_leases(2) == []


def test_a_node_stopped_before_its_run_reports_releases_its_slot(board: Board) -> None:
    """Ctrl-C while a run starts (a trainer restoring params, before the run's own end-of-run release)
    still frees the slot at once."""
    board.create_task({**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "actor_num": 2})
    board.set_active()

    class Interrupted:
        def run(self) -> str:
            assert board.held_leases(2) == ["actor:0"]
            raise KeyboardInterrupt

        def summary(self) -> str:
            return ""

    with pytest.raises(KeyboardInterrupt):
        serve("actor", board, "here", NodeOptions(uid="a"), None,
              claim=lambda task_board, task: task_board.claim_actor_slot("a", 2, 60_000),
              lease_name=lambda slot: f"actor:{slot}", standby_note=lambda task_board, task: "",
              build_run=lambda task_board, task, slot: Interrupted())
    assert board.held_leases(2) == []


def test_claim_actor_slot_fills_in_order(task: Board) -> None:
    board = task
    assert [board.claim_actor_slot(f"a{i}", 3, 10_000) for i in range(3)] == [0, 1, 2]
    assert board.claim_actor_slot("a3", 3, 10_000) is None
    assert board.claim_actor_slot("a1", 3, 10_000) == 1  # a holder keeps its own slot
    assert board.release_lease("actor:1", "a1")
    assert board.claim_actor_slot("a4", 3, 10_000) == 1


def test_claims_on_a_large_task_fill_every_slot_once_and_a_holder_takes_its_own_back(task: Board) -> None:
    from srl.runner.distribution.board.board import SMALL_TASK_SLOTS

    board, n = task, SMALL_TASK_SLOTS * 3
    slots = [board.claim_actor_slot(f"big{i}", n, 10_000) for i in range(n)]
    assert sorted(slots) == list(range(n))  # from random starts, but each slot exactly once
    assert board.claim_actor_slot("one-too-many", n, 10_000) is None
    holder = slots.index(7)
    assert board.claim_actor_slot(f"big{holder}", n, 10_000, prefer=7) == 7  # taking its own slot back
    assert board.release_lease("actor:7", f"big{holder}")
    assert board.claim_actor_slot("newcomer", n, 10_000, prefer=3) == 7  # 3 is taken: the free one


def test_fencing_refuses_older_epoch_and_non_holder(board: Board) -> None:
    board.create_task(CONFIG, actor_num=1)
    old = board.claim_trainer("old", 10_000)
    assert old == 1
    assert board.publish_params("old", old, 1, b"old-params", 10)
    assert board.get_params_version() == (1, 1)
    # the old trainer pauses, its lease lapses, a new one takes over
    assert board.release_lease("trainer", "old")
    new = board.claim_trainer("new", 10_000)
    assert new == 2
    assert board.publish_params("new", new, 1, b"new-params", 20)
    # the zombie wakes up: no lease, older epoch -> refused
    assert not board.publish_params("old", old, 2, b"zombie", 30)
    # even the lease holder cannot write with an older epoch
    assert not board.publish_params("new", old, 3, b"stale", 40)
    # a non-holder cannot write with the current epoch
    assert not board.publish_params("intruder", new, 4, b"intruder", 50)
    assert board.get_params() == ParamsRecord(2, 1, 20, b"new-params")
    assert board.get_params_version() == (2, 1)
    status = board.get_status()
    assert status is not None and (status.params_epoch, status.params_version, status.train_count) == (2, 1, 20)


def test_a_deleted_task_grows_no_keys_back(task: Board, client: redis.Redis) -> None:
    """Roles still finishing after delete_task must not recreate keys under the prefix."""
    board = task
    epoch = board.claim_trainer("t", 10_000)
    assert epoch is not None and board.claim_actor_slot("a", 3, 10_000) == 0
    board.delete_task()
    assert not board.publish_params("t", epoch, 1, b"x", 0)
    beat = board.heartbeat("actor:0", "a", 10_000, "actor:0", {"x": 1}, {"env_steps": 5})
    assert not beat and beat.task_status is None
    board.incr_counters("trainer", received_batches=1)
    board.put_stats("trainer", {"loss": 1.0})
    board.log_event("late")
    assert board.claim_trainer("t2", 10_000) is None
    assert board.claim_actor_slot("b", 3, 10_000) is None
    assert list(client.scan_iter(match=board.prefix + "*")) == []
    assert board.get_params() is None and board.get_params_version() is None


def test_task_lifecycle(board: Board) -> None:
    assert board.get_status() is None
    with pytest.raises(TaskNotFoundError):
        board.get_task_config()
    created = board.create_task(CONFIG, actor_num=2, max_train_count=100, timeout=60.0)
    assert created.status is TaskState.INIT and created.board_format == BOARD_FORMAT_VERSION
    assert (created.actor_num, created.max_train_count, created.max_steps, created.timeout) == (2, 100, None, 60.0)
    assert board.get_task_config() == json.loads(CONFIG)
    with pytest.raises(TaskExistsError, match=r"already exists and is INIT.*overwrite=True"):
        board.create_task(CONFIG, actor_num=1)
    assert board.set_active() and not board.set_active()
    with pytest.raises(TaskExistsError, match="ACTIVE"):
        board.create_task(CONFIG, actor_num=1)
    assert board.end_task(TaskState.END, "max_train_count reached")
    assert not board.end_task(TaskState.FAILED, "late")  # first end wins
    status = board.get_status()
    assert status is not None and status.status is TaskState.END and status.end_reason == "max_train_count reached"
    assert status.ended_at is not None and status.started_at is not None
    # an ended task may be replaced without overwrite; its old keys go
    board.log_event("old event")
    assert board.create_task(CONFIG, actor_num=1).status is TaskState.INIT
    assert board.get_events() == []


def test_create_task_from_a_mapping_takes_limits_from_it(board: Board) -> None:
    config = {"algorithm": "dqn", "actor_num": 4, "max_train_count": 50, "max_steps": None, "timeout": 9.5}
    status = board.create_task(config)
    assert (status.actor_num, status.max_train_count, status.max_steps, status.timeout) == (4, 50, None, 9.5)
    assert board.get_task_config() == config
    with pytest.raises(ValueError, match="JSON object"):
        board.create_task("[1, 2]", overwrite=True)


def test_overwrite_replaces_an_active_task_and_its_leases(board: Board) -> None:
    board.create_task(CONFIG, actor_num=1)
    board.set_active()
    assert board.claim_actor_slot("a", 1, 10_000) == 0
    board.create_task(CONFIG, actor_num=1, overwrite=True)
    status = board.get_status()
    assert status is not None and status.status is TaskState.INIT
    assert not board.heartbeat("actor:0", "a", 10_000, "actor:0")


def test_an_overwrite_never_leaves_the_name_without_a_task(board: Board, client: redis.Redis) -> None:
    """A node of the old task that looks while a client replaces it finds another task ("replaced"), never
    none ("gone: Redis restarted?"): the old record is swapped for the new in one step, its other keys go
    after. Each overwrite is watched by a reader polling as fast as it can; the old code's window (the old
    keys deleted one round trip, then the new record written the next) showed up in most of 30 overwrites."""
    import threading

    old = board.bound(board.create_task(CONFIG, actor_num=1).task_id)
    old.set_active()
    assert old.claim_actor_slot("a", 1, 60_000) == 0
    done = threading.Event()
    seen_missing = 0

    def watch() -> None:
        nonlocal seen_missing
        while not done.is_set():
            seen_missing += client.exists(board.prefix + "task") == 0

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(30):
            board.create_task(CONFIG, actor_num=1, overwrite=True)
    finally:
        done.set()
        watcher.join()
    assert seen_missing == 0
    beat = old.heartbeat("actor:0", "a", 10_000, "actor:0")
    assert beat.replaced and not beat and board.lease_holder("actor:0")[0] is None  # the old lease went too


def test_a_node_failing_an_old_config_does_not_end_the_task_that_replaced_it(
    board: Board, client: redis.Redis
) -> None:
    old = board.bound(board.create_task(CONFIG, actor_num=1).task_id)
    newer = json.dumps({"algorithm": "dqn", "fields": {"batch_size": 64}})
    new = board.bound(board.create_task(newer, actor_num=1, overwrite=True).task_id)  # while a node built the old
    assert old.task_id != new.task_id
    assert not old.end_task(TaskState.FAILED, "cannot build")
    status = board.get_status()
    assert status is not None and status.status is TaskState.INIT
    assert new.end_task(TaskState.FAILED, "cannot build")
    # a config that is not UTF-8 cannot be named exactly: reading it is a data error, not a guess
    client.hset(board.prefix + "task", "config", b'{"algorithm": "\xff"}')
    with pytest.raises(BoardDataError, match="UTF-8"):
        board.get_task_config_raw()


def test_other_board_format_is_a_clear_error(board: Board, client: redis.Redis) -> None:
    board.create_task(CONFIG, actor_num=1)
    client.hset(board.prefix + "task", "format", str(BOARD_FORMAT_VERSION + 1))
    for read in (board.get_task_config, board.get_status):
        with pytest.raises(BoardFormatError, match=f"board format {BOARD_FORMAT_VERSION + 1}.*same srl version"):
            read()


def test_heartbeat_is_one_round_trip_and_reports_task(private_client: redis.Redis, namespace: str) -> None:
    client = private_client  # commands are counted server-wide: on a Redis nothing else talks to
    board = Board(client, namespace)
    board.create_task(CONFIG, actor_num=1)
    epoch = board.claim_trainer("t", 10_000)
    assert epoch is not None and board.publish_params("t", epoch, 7, b"p", 3)
    assert board.claim_actor_slot("a", 1, 1_000) == 0
    # warm up: the first call may load the script
    board.heartbeat("actor:0", "a", 1_000, "actor:0", {"steps_per_s": 1.0}, {"env_steps": 1})
    before = int(client.info("stats")["total_commands_processed"])
    beat = board.heartbeat(
        "actor:0", "a", 5_000, "actor:0", {"steps_per_s": 812.5, "epsilon": 0.4},
        {"sent_batches": 2, "sent_transitions": 512, "env_steps": 511, "episodes": 2, "backpressure_wait_s": 0.25},
    )
    spent = int(client.info("stats")["total_commands_processed"]) - before - 1  # minus the INFO itself
    assert beat and beat.lease_held and beat.task_status is TaskState.INIT
    assert (beat.params_epoch, beat.params_version) == (1, 7)
    assert board.lease_holder("actor:0")[1] > 1_000
    assert spent <= 8, f"a heartbeat cost {spent} Redis commands"
    counters = board.get_counters()
    assert counters["env_steps"] == 512 and counters["backpressure_wait_s"] == 0.25
    assert board.get_role_counters()["actor:0"]["sent_transitions"] == 512
    stats = board.get_all_stats()
    assert stats["actor:0"]["steps_per_s"] == 812.5 and "updated_at" in stats["actor:0"]
    # a lost lease is reported, counters still land (the work was done)
    assert not board.heartbeat("actor:0", "someone-else", 5_000, "actor:9", None, {"env_steps": 1})
    assert board.get_counters()["env_steps"] == 513
    assert beat.total is None  # none asked
    # the trainer's heartbeat brings the run's env steps, every role's together, in the same round trip
    board.incr_counters("actor:1", env_steps=1000)
    client.hset(board.prefix + "counters", "forged", b"not json")  # skipped, as get_counters skips it
    before = int(client.info("stats")["total_commands_processed"])
    beat = board.heartbeat("trainer", "t", 10_000, "trainer", None, {"env_steps": 0}, total_of="env_steps")
    spent = int(client.info("stats")["total_commands_processed"]) - before - 1
    assert beat.total == 1513 == board.get_counters()["env_steps"]
    assert spent <= 9, f"a heartbeat with a total cost {spent} Redis commands"


def test_counters_sum_over_roles_and_stats_expire(client: redis.Redis, namespace: str) -> None:
    board = Board(client, namespace, stats_ttl_ms=100)
    board.create_task(CONFIG, actor_num=1)
    try:
        board.incr_counters("actor:0", received_batches=1, bad_messages=0)
        board.incr_counters("trainer", received_batches=2, train_count=10)
        board.incr_counters("trainer", received_batches=1, backpressure_wait_s=0.5)
        assert board.get_counters() == {"received_batches": 4, "train_count": 10, "backpressure_wait_s": 0.5}
        with pytest.raises(ValueError, match="counter name"):
            board.incr_counters("trainer", **{"bad-name": 1})
        board.put_stats("trainer", {"loss": 0.5})
        assert board.get_all_stats()["trainer"]["loss"] == 0.5
        wait_for(lambda: board.get_all_stats() == {}, 5, "the stats to expire", interval=0.01)
    finally:
        board.delete_task()


def test_a_count_sent_again_with_its_token_adds_nothing(board: Board) -> None:
    """A count's token is the same on each try of it: a retry after a lost reply adds nothing, a new count adds
    (a fresh token, or none); the trainer's count of a read says "noted" to its retry, as the ack waits for."""
    bound = board.bound(board.create_task(CONFIG, actor_num=1).task_id)
    assert bound.claim_trainer("t", 60_000) is not None
    sent = count_token()
    for _ in range(2):
        bound.incr_counters("actor:0", token=sent, sent_batches=2)
    bound.incr_counters("actor:0", token=count_token(), sent_batches=1)
    bound.incr_counters("actor:0", sent_batches=1)
    bound.incr_counters("actor:0", sent_batches=1)
    read = count_token()
    assert [bound.count_received("t", {"received_batches": 3}, [("a", 0)], read) for _ in range(2)] == ["noted"] * 2
    assert bound.count_received("t", {"received_batches": 1, "refused_batches": 1}, [], count_token()) == "noted"
    assert bound.get_counters() == {"sent_batches": 5, "received_batches": 4, "refused_batches": 1}
    assert board.prefix + "counted" in board.task_keys()
    with pytest.raises(ValueError, match="count token"):
        bound.incr_counters("actor:0", token="x" * 65, sent_batches=1)


def test_event_log_is_capped(client: redis.Redis, namespace: str) -> None:
    board = Board(client, namespace, event_cap=10)
    board.create_task(CONFIG, actor_num=1)
    try:
        for i in range(25):
            board.log_event(f"event {i}", "WARNING" if i % 2 else "INFO", source="test")
        assert client.llen(board.prefix + "events") == 10
        events = board.get_events(100)
        assert [e.text for e in events] == [f"event {i}" for i in range(15, 25)]
        assert events[-1].level == "INFO" and events[-2].level == "WARNING" and events[-1].source == "test"
        assert [e.text for e in board.get_events(2)] == ["event 23", "event 24"]
    finally:
        board.delete_task()


def test_delete_task_leaves_no_key(board: Board, client: redis.Redis, namespace: str) -> None:
    board.create_task(CONFIG, actor_num=3)
    epoch = board.claim_trainer("t", 60_000)
    assert epoch is not None
    board.publish_params("t", epoch, 1, b"blob", 1)
    for i in range(3):
        board.claim_actor_slot(f"a{i}", 3, 60_000)
        board.heartbeat(f"actor:{i}", f"a{i}", 60_000, f"actor:{i}", {"x": i}, {"env_steps": i + 1})
    board.log_event("hello")
    client.xadd(board.queue_key("batches"), {"b": b"x"})  # a queue backend's key under the prefix
    other = Board(client, namespace + "x")  # a neighbour whose name extends ours is untouched
    other.create_task(CONFIG, actor_num=1)
    try:
        keys = board.task_keys()
        assert board.prefix + "queue:batches" in keys and board.prefix + "stats:actor:2" in keys
        assert len(keys) >= 13
        assert board.delete_task() == len(keys)
        assert list(client.scan_iter(match=board.prefix + "*")) == []
        assert board.get_status() is None
        assert other.get_status() is not None
    finally:
        other.delete_task()


def test_rejects_decoded_client_and_bad_names(redis_url: str) -> None:
    with pytest.raises(ValueError, match="decode_responses"):
        Board(redis.Redis.from_url(redis_url, decode_responses=True), "t")
    with pytest.raises(ValueError, match="task name"):
        Board(redis.Redis.from_url(redis_url), "bad name*")


def test_scripts_reload_after_a_script_flush(board: Board, client: redis.Redis) -> None:
    """A restarted (or flushed) Redis forgets loaded scripts: EVALSHA falls back to loading them."""
    board.create_task(CONFIG, actor_num=1)
    assert board.claim_actor_slot("a", 1, 10_000) == 0
    client.script_flush()
    assert board.heartbeat("actor:0", "a", 10_000, "actor:0", {"x": 1}, {"env_steps": 1})
    assert board.get_counters() == {"env_steps": 1}


def test_a_lapsed_trainer_takes_its_own_lease_back_unless_another_took_over(task: Board) -> None:
    epoch = task.claim_trainer("t1", 10_000)
    assert epoch is not None
    assert task.release_lease("trainer", "t1")  # stands in for the lease expiring during an outage
    assert task.reclaim_trainer("t1", epoch, 10_000) == "taken"  # same epoch: its memory and counters stay valid
    assert task.lease_holder("trainer")[0] == "t1"
    assert task.publish_params("t1", epoch, 1, b"p", 5)
    assert task.release_lease("trainer", "t1")
    newer = task.claim_trainer("t2", 10_000)
    assert newer == epoch + 1
    assert task.reclaim_trainer("t1", epoch, 10_000) == "taken over"  # fenced: another trainer came in between
    status = task.get_status()
    assert status is not None and (status.trainer_uid, status.trainer_epoch) == ("t2", newer)
    assert task.release_lease("trainer", "t2")
    assert task.reclaim_trainer("t1", epoch, 10_000) == "taken over"  # the epoch moved on: still fenced


def test_an_actor_takes_its_own_slot_back_first(task: Board) -> None:
    assert task.claim_actor_slot("a", 3, 10_000, prefer=2) == 2
    assert task.release_lease("actor:2", "a")
    assert task.claim_actor_slot("b", 3, 10_000) == 0
    assert task.claim_actor_slot("a", 3, 10_000, prefer=2) == 2  # not the lowest free one (1)


def test_heartbeat_reports_the_server_clock_and_train_count(task: Board) -> None:
    epoch = task.claim_trainer("t", 10_000)
    assert epoch is not None and task.publish_params("t", epoch, 3, b"p", 1234)
    beat = task.heartbeat("trainer", "t", 10_000, "trainer")
    assert beat.train_count == 1234 and beat.params_version == 3
    assert abs(beat.server_time - task.server_time()) < 5.0
    task.set_active()
    status = task.get_status()
    assert status is not None and status.started_at is not None
    assert abs(status.started_at - beat.server_time) < 5.0


def test_malformed_records_are_board_data_errors_not_crashes(task: Board, client: redis.Redis) -> None:
    """Whoever can write to Redis may write anything: every read is parsed with bounds."""
    key = task.prefix + "task"
    for field, value in [("actor_num", "1e400"), ("params_version", "abc"), ("timeout", "inf"),
                         ("train_count", str(10**30)), ("status", "PWNED"), ("created_at", "nan")]:
        original = client.hget(key, field)
        client.hset(key, field, value)
        with pytest.raises(BoardDataError):
            task.get_status()
        client.hset(key, field, original or b"")
    client.hset(key, "params_version", "abc")
    assert task.claim_actor_slot("a", 3, 10_000) == 0
    with pytest.raises(BoardDataError):
        task.heartbeat("actor:0", "a", 10_000, "actor:0")
    client.hset(key, "params_version", "0")
    # garbage where counters, stats and events live: the writes go on, the reads skip it
    client.hset(task.prefix + "counters", "actor:0", "not json {")
    client.hset(task.prefix + "counters", "trainer", json.dumps({"env_steps": "many", "x": 1}))
    assert task.heartbeat("actor:0", "a", 10_000, "actor:0", {"r": 1}, {"env_steps": 5})
    assert task.get_role_counters()["actor:0"] == {"env_steps": 5}
    assert task.get_counters() == {"env_steps": 5, "x": 1}
    client.set(task.prefix + "stats:evil", "[1, 2")
    client.sadd(task.prefix + "roles", "evil", "bad role name!")
    assert set(task.get_all_stats()) == {"actor:0"}
    client.lpush(task.prefix + "events", "garbage", json.dumps({"ts": "x", "text": "ok"}))
    assert [e.text for e in task.get_events()][-1:] == ["ok"]


def test_a_view_reads_what_each_getter_reads(task: Board, client: redis.Redis) -> None:
    """``Board.view`` reads at once what the getters read one by one, parsed as they parse it: a forged entry
    skipped alike, a role outside the task's slots read too, and a value that cannot be read (a damaged
    config, inference address or params head) held as its error, raised only when it is asked for."""
    p = task.prefix
    status = task.get_status()
    assert status is not None
    node = task.bound(status.task_id)
    epoch = node.claim_trainer("t", 10_000)
    assert epoch is not None and node.publish_params("t", epoch, 2, b"v2", 20)
    assert node.heartbeat("trainer", "t", 10_000, "trainer", {"train_count": 20}, {"received_batches": 4})
    assert node.claim_lease("actor:1", "a1", 10_000)
    assert node.heartbeat("actor:1", "a1", 10_000, "actor:1", {"envs": 2}, {"env_steps": 3})
    assert node.claim_lease("inference", "i", 10_000) and node.set_inference_address("i", "127.0.0.1:5000", True)
    node.put_stats("evaluator", {"eval_mean": 1.5})
    node.note_refusal("n", "actor", "no GPU")
    client.hset(p + "counters", "intruder", '{"env_steps": 1e400, "x": 2}')
    client.set(p + "stats:intruder", json.dumps({"updated_at": time.time(), "loss": 1}))
    client.set(p + "stats:evil", "[1, 2")
    client.sadd(p + "roles", "intruder", "evil", "bad role name!")
    client.hset(p + "refusals", "forged", "{")

    view = task.view(status.actor_num)
    names = ["trainer", "inference", "actor:0", "actor:1", "actor:2"]
    assert view.stats == task.get_all_stats() and set(view.stats) == {"trainer", "actor:1", "evaluator", "intruder"}
    assert view.counters == task.get_counters() == {"received_batches": 4, "env_steps": 3, "x": 2}
    assert view.params_head == task.get_params_head() == (epoch, 2, 20)
    assert view.config == task.get_task_config() == json.loads(CONFIG)
    assert view.refusals == task.get_refusals() and [r.uid for r in view.refusals] == ["n"]
    assert view.holders == dict(zip(names, task.lease_holders(names), strict=True))
    assert view.holders == {"trainer": "t", "inference": "i", "actor:0": None, "actor:1": "a1", "actor:2": None}
    assert view.inference_address == task.get_inference_address() and view.inference_address is not None
    assert task.view(status.actor_num, refusal_age_s=-1.0).refusals == task.get_refusals(max_age_s=-1.0) == []
    assert set(task.view(status.actor_num, lease_slots=1).holders) == {"trainer", "inference", "actor:0"}

    client.hset(p + "task", "config", "[1, 2]")
    client.hset(p + "inference", "address", "no port")
    client.hset(p + "task", "params_version", "abc")
    damaged = task.view(status.actor_num)
    assert damaged.counters == view.counters and damaged.stats.keys() == view.stats.keys()
    with pytest.raises(BoardDataError, match="config is not a JSON object"):
        _ = damaged.config
    with pytest.raises(BoardDataError, match="not host:port"):
        _ = damaged.inference_address
    with pytest.raises(BoardDataError, match="params_version"):
        _ = damaged.params_head
    client.delete(p + "task")
    with pytest.raises(TaskNotFoundError):
        _ = task.view(status.actor_num).config


HUGE = "1" + "0" * 400
"""a JSON integer of 401 digits: Python reads it, and math.isfinite (a float) raises OverflowError on it"""
HOSTILE_NUMBERS = [HUGE, "-" + HUGE, "1e400", "NaN", "-Infinity"]


def test_huge_and_non_finite_numbers_in_any_record_are_data_errors_not_crashes(
        task: Board, client: redis.Redis) -> None:
    """A number no reader could hold, written into an entry of each of the board's lists and hashes, is a data
    error: it reads as missing (an event's time 0, a dead letter's size 0, a stats field None), and an entry
    that cannot stand without it (a refusal's time, the time stats were written) is skipped; the rest is read,
    never an OverflowError, and never a number that is not finite."""
    p = task.prefix
    now = time.time()
    for i, n in enumerate(HOSTILE_NUMBERS):
        client.hset(p + "counters", f"intruder{i}", f'{{"env_steps": {n}}}')
        client.set(p + f"stats:intruder{i}", f'{{"updated_at": {now}, "loss": {n}, "uid": "i{i}"}}')
        client.set(p + f"stats:late{i}", f'{{"updated_at": {n}}}')
        client.sadd(p + "roles", f"intruder{i}", f"late{i}")
        client.lpush(p + "events", f'{{"ts": {n}, "level": "INFO", "text": "forged {i}"}}')
        client.lpush(p + "history", f'{{"train_count": {n}, "i": {i}}}')
        client.hset(p + "refusals", f"intruder{i}", f'{{"role": "actor", "reason": "forged", "ts": {n}}}')
        client.lpush(p + "deadletters", f'{{"ts": {n}, "source": "forged {i}", "reason": "x", "size": {n}}}')
        client.hset(p + "ledger", f"intruder{i}", f'[["a", {n}], ["b", 3]]')
    task.incr_counters("actor:0", env_steps=21, episodes=2)
    task.put_stats("actor:0", {"loss": 0.5})
    task.note_refusal("good-node", "trainer", "a good refusal")

    assert task.get_role_counters()["actor:0"] == {"env_steps": 21, "episodes": 2}
    assert task.get_counters() == {"env_steps": 21, "episodes": 2}
    stats = task.get_all_stats()
    assert set(stats) == {"actor:0", *(f"intruder{i}" for i in range(len(HOSTILE_NUMBERS)))}
    assert all(stats[f"intruder{i}"]["loss"] is None for i in range(len(HOSTILE_NUMBERS)))
    events = task.get_events()
    assert [e.text for e in events] == [f"forged {i}" for i in range(len(HOSTILE_NUMBERS))]
    assert all(e.ts == 0.0 for e in events)
    assert task.get_history() == [{"train_count": None, "i": i} for i in range(len(HOSTILE_NUMBERS))]
    assert [r.uid for r in task.get_refusals()] == ["good-node"]
    assert [(d.source, d.ts, d.size) for d in task.get_dead_letters()] == [
        (f"forged {i}", 0.0, 0) for i in range(len(HOSTILE_NUMBERS))]
    ledgers = task.get_ledgers()
    assert len(ledgers) == len(HOSTILE_NUMBERS) and all(ledger == [("b", 3)] for ledger in ledgers.values())
    status = task.get_status()
    assert status is not None
    summary_lines(task, status, elapsed=1.0)  # the client's reading of all of it


def test_a_counters_entry_that_is_not_finite_never_fails_the_heartbeat(task: Board, client: redis.Redis) -> None:
    """cjson reads 1e400 or a 400-digit integer as inf, and then cannot encode the totals again: the role's own
    forged total is started over (its other totals kept), and a forged role is no part of a total, so every
    heartbeat goes on adding counters and renewing the lease."""
    p = task.prefix
    client.hset(p + "counters", "actor:0", f'{{"env_steps": {HUGE}, "episodes": 2, "bad": 1e400, "worse": NaN}}')
    for i, n in enumerate(HOSTILE_NUMBERS):
        client.hset(p + "counters", f"intruder{i}", f'{{"env_steps": {n}}}')
    client.hset(p + "counters", "near-max", '{"env_steps": 1.7e308}')  # one more would be inf
    assert task.claim_actor_slot("a", 3, 10_000) == 0
    for _ in range(3):  # every later heartbeat too, not just the first
        beat = task.heartbeat("actor:0", "a", 10_000, "actor:0", {"env_steps": 7}, {"env_steps": 7},
                              total_of="env_steps")
        assert beat.lease_held
    assert beat.total == 1.7e308  # what can be summed of the forged totals, never inf
    client.hdel(p + "counters", "near-max")
    assert task.heartbeat("actor:0", "a", 10_000, "actor:0", None, None, total_of="env_steps").total == 21
    assert task.get_role_counters()["actor:0"] == {"env_steps": 21, "episodes": 2}
    task.incr_counters("near-max", env_steps=1.7e308)
    task.incr_counters("near-max", env_steps=1.7e308)  # a total beyond a double's range starts over
    assert task.get_role_counters()["near-max"] == {"env_steps": 1.7e308}
    with pytest.raises(ValueError, match="finite"):
        task.incr_counters("actor:0", env_steps=math.inf)


@pytest.mark.parametrize("number", HOSTILE_NUMBERS)
def test_a_task_config_holding_a_number_no_field_could_hold_fails_the_task_with_a_reason(
        board: Board, number: str) -> None:
    """``build_task`` refuses the config (a data error: TaskConfigError), and ``serve`` ends the task FAILED
    saying why, rather than the node ending on an OverflowError."""
    from srl.runner.distribution.settings.task import TaskConfigError, build_task

    config = {**srl.Runner("Pendulum-v1", tiny_config()).task_config(), "actor_num": 1, "timeout": 60.0,
              "queue": {"scheme": "redis", "capacity": 8}}

    def forged(*path: str) -> str:
        """The config with the number at ``path``, as an intruder writes it (JSON text: no Python float)."""
        copy = json.loads(json.dumps(config))
        inner = copy
        for key in path[:-1]:
            inner = inner[key]
        inner[path[-1]] = "NUMBER"
        return json.dumps(copy).replace('"NUMBER"', number)

    for path in (("actor_num",), ("max_train_count",), ("timeout",), ("queue", "capacity"), ("rl_config", "lr"),
                 ("rl_config", "memory", "capacity"), ("rl_config", "seed"), ("env", "kwargs", "g")):
        with pytest.raises(TaskConfigError):
            build_task(forged(*path))
    board.create_task(json.dumps(config))
    board.client.hset(board.prefix + "task", "config", forged("actor_num"))
    board.set_active()
    serve("actor", board, "here", NodeOptions(uid="a", run_once=True), None,
          claim=lambda task_board, task: task_board.claim_actor_slot("a", 1, 60_000),
          lease_name=lambda slot: f"actor:{slot}", standby_note=lambda task_board, task: "",
          build_run=lambda task_board, task, slot: pytest.fail("a forged task was built"))
    status = board.get_status()
    assert status is not None and status.status == TaskState.FAILED, status
    assert "cannot build the task" in status.end_reason, status.end_reason


def test_a_params_blob_larger_than_the_network_is_not_fetched(task: Board) -> None:
    epoch = task.claim_trainer("t", 10_000)
    assert epoch is not None and task.publish_params("t", epoch, 1, b"x" * 5000, 1)
    assert task.get_params(max_bytes=5000) == ParamsRecord(epoch, 1, 1, b"x" * 5000)
    with pytest.raises(BoardDataError, match="5000 bytes"):
        task.get_params(max_bytes=4999)


def test_the_float32_master_beside_float16_params_is_read_by_a_trainer_only_and_never_an_older_one(
    task: Board,
) -> None:
    """A trainer that publishes float16 weights writes the same version's float32 ones beside them: nodes read
    the blob, a trainer taking over the master; a version published without one leaves none behind."""
    epoch = task.claim_trainer("t", 10_000)
    assert epoch is not None and task.publish_params("t", epoch, 1, b"half 1", 10, master=b"full 1")
    assert task.get_params() == ParamsRecord(epoch, 1, 10, b"half 1")
    assert task.get_newer_params(None) == ((epoch, 1, 10), ParamsRecord(epoch, 1, 10, b"half 1"))
    assert task.get_params(master=True) == ParamsRecord(epoch, 1, 10, b"full 1")
    with pytest.raises(BoardDataError, match="6 bytes"):  # the master is bounded like any params read
        task.get_params(max_bytes=5, master=True)
    assert task.publish_params("t", epoch, 2, b"full 2", 20)  # the last version: float32 itself
    assert task.get_params(master=True) == ParamsRecord(epoch, 2, 20, b"full 2")


def test_a_node_waiting_for_a_version_gets_it_with_its_head_in_one_round_trip(private_client: redis.Redis,
                                                                           namespace: str) -> None:
    client = private_client  # calls are counted server-wide: on a Redis nothing else talks to
    board = Board(client, namespace)
    task = board.bound(board.create_task(CONFIG, actor_num=1).task_id)  # nodes read as their task's
    assert task.get_newer_params(None) == (None, None)  # nothing published yet
    epoch = task.claim_trainer("t", 10_000)
    assert epoch is not None and task.publish_params("t", epoch, 3, b"v3", 30)
    calls = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert task.get_newer_params(2, max_bytes=100) == ((epoch, 3, 30), ParamsRecord(epoch, 3, 30, b"v3"))
    assert client.info("commandstats")["cmdstat_evalsha"]["calls"] == calls + 1  # one command: one round trip
    assert task.get_newer_params(3, max_bytes=100) == ((epoch, 3, 30), None)  # the version it holds: no blob
    assert task.publish_params("t", epoch, 4, b"x" * 5000, 40)
    with pytest.raises(BoardDataError, match="5000 bytes"):
        task.get_newer_params(3, max_bytes=4999)
    assert task.get_newer_params(4, max_bytes=4999) == ((epoch, 4, 40), None)  # held: its size does not matter
    other = task.bound("another-task-id")
    assert other.get_newer_params(3) == (None, None)  # another task's params: never acted with


def test_a_node_waiting_for_the_next_version_gets_it_as_it_is_published(board: Board, client: redis.Redis) -> None:
    """``await_params`` waits in Redis (a blocked XREAD on the params feed) and reads the params in the same
    round trip once a version is published; with nothing published it ends at its bound with the head."""
    task = board.bound(board.create_task(CONFIG, actor_num=1).task_id)
    epoch = task.claim_trainer("t", 10_000)
    assert epoch is not None and task.publish_params("t", epoch, 3, b"v3", 30)
    after, head, record = task.await_params(b"0-0", None, 10_000, max_bytes=100)  # the latest, at once
    assert (head, record) == ((epoch, 3, 30), ParamsRecord(epoch, 3, 30, b"v3"))
    answers: list[tuple[bytes, tuple[int, int, int] | None, ParamsRecord | None]] = []
    waiter = threading.Thread(target=lambda: answers.append(task.await_params(after, 3, 10_000, max_bytes=100)))
    waiter.start()
    wait_for(lambda: client.info("clients")["blocked_clients"] >= 1, 5.0, "the wait to block in Redis")
    assert not answers  # version 3 is held: nothing to return yet
    assert task.publish_params("t", epoch, 4, b"v4", 40)
    waiter.join(timeout=5.0)
    assert not waiter.is_alive() and answers[0][1:] == ((epoch, 4, 40), ParamsRecord(epoch, 4, 40, b"v4"))
    newest = answers[0][0]
    assert newest != after
    assert task.await_params(newest, 4, 20, max_bytes=100) == (newest, (epoch, 4, 40), None)  # its bound: the head
    assert task.publish_params("t", epoch, 5, b"x" * 5000, 50)
    with pytest.raises(BoardDataError, match="5000 bytes"):  # the size bound holds as for every params read
        task.await_params(newest, 4, 1000, max_bytes=4999)
    assert task.bound("another-task-id").await_params(b"0-0", 4, 1000)[1:] == (None, None)
    assert client.xlen(task.prefix + "params:feed") == 1  # one entry, the latest version's
    assert task.prefix + "params:feed" in task.task_keys()  # deleted with the task
    # a Redis user that may not XREAD: the same answer, at once (the node polls)
    client.acl_setuser("srl-noxread", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                       commands=["+@all", "-xread"])
    try:
        kwargs = client.connection_pool.connection_kwargs
        limited = redis.Redis(host=kwargs.get("host", "127.0.0.1"), port=kwargs.get("port", 6379),
                              db=kwargs.get("db", 0), username="srl-noxread", password="pw")
        polling = Board(limited, task.task_name, task_id=task.task_id)
        assert polling.awaits_in_redis
        assert polling.await_params(b"0-0", 4, 10_000, max_bytes=10_000)[1:] == (
            (epoch, 5, 50), ParamsRecord(epoch, 5, 50, b"x" * 5000))
        assert not polling.awaits_in_redis
        limited.close()
    finally:
        client.acl_deluser("srl-noxread")


def test_event_texts_and_dead_letters_are_capped(task: Board, client: redis.Redis) -> None:
    task.log_event("x" * 100_000, source="s" * 1000)
    event = task.get_events(1)[0]
    assert len(event.text) <= EVENT_TEXT_LIMIT and len(event.source) <= 128
    assert client.llen(task.prefix + "events") == 1
    task.add_dead_letters([DeadLetter(float(i), f"src {i}", "bad", i) for i in range(DEADLETTER_CAP + 30)])
    letters = task.get_dead_letters()
    assert len(letters) == DEADLETTER_CAP and letters[-1].source == f"src {DEADLETTER_CAP + 29}"


def test_end_of_run_summary_names_each_node_and_ignores_malformed_stats(board: Board) -> None:
    board.create_task(CONFIG, actor_num=2)
    board.set_active()
    board.incr_counters("actor:0", env_steps=1200, episodes=6, sent_batches=40)
    board.incr_counters("trainer", received_batches=39)
    board.put_stats("trainer", {"uid": "trainer-x", "epoch": 2, "device": "cpu", "train_count": 800, "loss": 0.5})
    board.put_stats("actor:1", {"uid": "actor-b", "env_steps": 700, "episodes": 3, "reward": -150.5})
    board.put_stats("actor:abc", {"uid": "not-a-slot"})  # a hostile writer's role id: no line, no crash
    board.end_task("END", "max_train_count 800 reached")
    status = board.get_status()
    assert status is not None

    lines = summary_lines(board, status, elapsed=10.0, queued=1)

    assert lines[0].startswith("run END after 10s (max_train_count 800 reached): train 800 (80/s), "
                               "env steps 1200 (120/s), episodes 6"), lines[0]
    assert lines[1] == "  batches: sent 40 = received 39 + refused 0 + still queued 1: all accounted for"
    assert lines[2] == "  trainer trainer-x (epoch 2, cpu): params v0, last loss 0.5"
    assert lines[3].startswith("  actor 1 actor-b: 700 env steps, 3 episodes, last reward -150.5"), lines[3]
    assert len(lines) == 4 and "not-a-slot" not in "\n".join(lines)
    assert "1 NOT ACCOUNTED FOR" in summary_lines(board, status, elapsed=10.0, queued=0)[1]
    assert "1 still queued or in flight (this broker does not tell" in summary_lines(board, status, 10.0)[1]
    over = summary_lines(board, status, elapsed=10.0, queued=3)[1]  # 2 counted, still queued: a trainer died
    assert "2 more than the senders counted as sent" in over and "a trainer died between counting" in over, over


def test_a_surplus_up_to_the_batches_republished_after_a_lost_connection_is_named_as_copies(board: Board) -> None:
    """A sender whose broker connection went before the broker confirmed its batches publishes them again: the
    broker may hold a copy of each. More queued than sent, up to those, is named as that (not as a loss, not as
    a dead trainer); more than those is still the other reasons."""
    board.create_task(CONFIG, actor_num=1)
    board.set_active()
    board.incr_counters("actor:0", sent_batches=30, republished_batches=2)
    board.incr_counters("trainer", received_batches=28)
    board.end_task("END", "done")
    status = board.get_status()
    assert status is not None
    copies = summary_lines(board, status, elapsed=10.0, queued=4)[1]
    assert copies == ("  batches: sent 30, received 28 + refused 0 + still queued 4: 2 more than the senders counted "
                      "as sent: 2 batch(es) were published again after a broker connection was lost before the "
                      "broker confirmed them, and the broker holds a copy of those it had taken (at-least-once: the "
                      "trainer drops a copy it reads as a duplicate)"), copies
    beyond = summary_lines(board, status, elapsed=10.0, queued=5)[1]
    assert "3 more than the senders counted as sent (an actor or an inference server stopped" in beyond, beyond
    assert summary_lines(board, status, elapsed=10.0, queued=2)[1].endswith(": all accounted for")


def test_the_batch_accounts_count_refused_batches_not_every_bad_message(board: Board) -> None:
    """sent = received + refused + still queued counts the batches the trainer refused, not the bad params an
    actor refused or the requests an inference server refused (bad messages too, but never batches sent);
    a board whose trainer counted refused batches only as bad messages reads them as refused."""
    board.create_task(CONFIG, actor_num=1)
    board.set_active()
    board.incr_counters("actor:0", sent_batches=10, bad_messages=2)  # two params refused
    board.incr_counters("inference", bad_messages=3)  # three requests refused
    board.incr_counters("trainer", received_batches=6, bad_messages=1, refused_batches=1)
    board.end_task("END", "done")
    status = board.get_status()
    assert status is not None
    accounts = summary_lines(board, status, elapsed=10.0, queued=3)[1]
    assert accounts == "  batches: sent 10 = received 6 + refused 1 + still queued 3: all accounted for", accounts
    assert "= received 6 + refused 1 + 3 still queued or in flight" in summary_lines(board, status, 10.0)[1]
    progress = progress_lines(board, status, 10.0)[0]
    assert "batches sent 10 received 6 refused 1 (in flight ~3) | bad 6" in progress, progress
    assert history_row(board, None)["queue_in_flight"] == 3

    board.client.hset(board.prefix + "counters", "trainer", json.dumps({"received_batches": 6, "bad_messages": 1}))
    assert board.get_counters()["refused_batches"] == 1  # a board written before refused batches were apart
    assert summary_lines(board, status, elapsed=10.0, queued=3)[1] == accounts


def test_batches_counted_and_given_back_to_the_queue_are_still_queued_in_the_accounts(board: Board) -> None:
    """A trainer whose lease lapsed gave a read back whose count then landed: its batches are received and
    still queued, and the board says so (``given_back_batches``), so the accounts balance; read again, they
    are no longer given back."""
    board.create_task(CONFIG, actor_num=1)
    board.set_active()
    board.incr_counters("actor:0", sent_batches=8)
    board.incr_counters("trainer", received_batches=6, given_back_batches=1)
    board.end_task("END", "done")
    status = board.get_status()
    assert status is not None
    accounts = summary_lines(board, status, elapsed=10.0, queued=3)[1]
    assert accounts.startswith("  batches: sent 8 = received 5 (and 1 more counted as received whose reads went back "
                               "to the queue, unacked, when a trainer's lease lapsed or its queue connection was "
                               "lost: still queued) + refused 0 + still queued 3"
                               ) and accounts.endswith(": all accounted for"), accounts
    assert history_row(board, None)["queue_in_flight"] == 3
    board.incr_counters("trainer", given_back_batches=-1)  # read again, as a duplicate: no longer queued
    accounts = summary_lines(board, status, elapsed=10.0, queued=2)[1]
    assert accounts == "  batches: sent 8 = received 6 + refused 0 + still queued 2: all accounted for", accounts

def test_a_progress_line_shows_every_slot_its_config_counts(board: Board) -> None:
    """A task whose config counts more actor slots than its record (created with another ``actor_num``) is
    shown with the config's slots, as before the view: their leases are read too."""
    status = board.create_task({"algorithm": "dqn", "actor_num": 3}, actor_num=1)
    assert status.actor_num == 1
    assert board.claim_lease("actor:2", "a2", 10_000)
    lines = progress_lines(board, status, 1.0)
    assert [line.split(":")[0] for line in lines[2:]] == ["  actor 0", "  actor 1", "  actor 2 a2"], lines


def test_a_progress_line_says_when_an_actor_lets_batches_past_the_queue_s_capacity(board: Board) -> None:
    """An actor on a slow link lets two round trips' worth of batches be on their way beyond the queue's capacity
    (``Sender.in_transit``): its heartbeat says how many and the progress line shows it, so a queue holding more
    than its capacity is explained; an actor on a LAN shows nothing of it."""
    from srl.runner.distribution.node.stats import ActorStats

    status = board.create_task({"algorithm": "dqn", "actor_num": 2}, actor_num=2)
    task = board.bound(status.task_id)
    for slot, uid, transit in ((0, "far", 13), (1, "near", 0)):
        assert task.claim_actor_slot(uid, 2, 10_000, prefer=slot) == slot
        task.put_stats(f"actor:{slot}", ActorStats(uid=uid, slot=slot, in_transit=transit).to_record())
    lines = progress_lines(task, status, 1.0)
    far = next(line for line in lines if line.startswith("  actor 0"))
    near = next(line for line in lines if line.startswith("  actor 1"))
    assert "13 batch(es) in transit beyond the queue's capacity" in far, far
    assert "in transit" not in near, near


def test_end_of_run_summary_of_a_run_no_node_reported_to(board: Board) -> None:
    board.create_task(CONFIG, actor_num=1)
    board.end_task("FAILED", "no trainer")
    status = board.get_status()
    assert status is not None
    assert summary_lines(board, status, elapsed=0.0)[2:] == ["  trainer: never reported", "  actors: none reported"]


def test_held_leases_lists_who_still_holds_one(board: Board) -> None:
    board.create_task(CONFIG, actor_num=3)
    assert board.held_leases(3) == []
    assert board.claim_lease("trainer", "t-1", 5000)
    assert board.claim_actor_slot("a-1", 3, 5000, prefer=2) == 2
    assert board.held_leases(3) == ["trainer", "actor:2"]
    board.release_lease("trainer", "t-1")
    assert board.held_leases(3) == ["actor:2"]


class SilencingProxy:
    """A TCP proxy to Redis whose open connections can be made to go silent: their bytes are
    dropped from then on, both ways, with the sockets left open (a route that died under a
    connection). New connections pass as before."""

    def __init__(self, port: int) -> None:
        import socket

        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.silenced: set[int] = set()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                inbound, _ = self.listener.accept()
            except OSError:
                return
            outbound = socket.create_connection(self.target)
            self.connections += 1
            number = self.connections
            for source, sink in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pump, args=(source, sink, number), daemon=True).start()

    def _pump(self, source: object, sink: object, number: int) -> None:
        while True:
            try:
                data = source.recv(65536)  # type: ignore[attr-defined]
            except OSError:
                return
            if not data:
                return
            if number not in self.silenced:
                sink.sendall(data)  # type: ignore[attr-defined]

    def silence_open_connections(self) -> None:
        self.silenced.update(range(1, self.connections + 1))

    def close(self) -> None:
        self.listener.close()


def test_a_redis_connection_that_goes_silent_is_given_up_and_retried(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read on a connection whose route died times out (srl's default socket_timeout) and the
    call is retried on a new connection, where it used to wait for ever."""
    from srl.runner.distribution.node.retry import with_retry
    from srl.runner.distribution.settings import redis_parameters

    monkeypatch.setattr(redis_parameters, "DEFAULT_SOCKET_TIMEOUT_S", 0.5)
    proxy = SilencingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    try:
        client = RedisParameters(url=f"redis://127.0.0.1:{proxy.port}/0").connect()
        assert client.ping()
        proxy.silence_open_connections()
        answers: list[object] = []
        thread = threading.Thread(target=lambda: answers.append(with_retry(client.ping, "ping")), daemon=True)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the ping still waits on the silent connection"
        assert answers == [True] and proxy.connections == 2
        client.close()
    finally:
        proxy.close()


def test_a_write_that_outlasts_the_socket_timeout_says_how_to_raise_it(caplog: pytest.LogCaptureFixture) -> None:
    from srl.runner.distribution.node.retry import with_retry

    errors = [redis.TimeoutError("Timeout writing to socket")]

    def publish() -> str:
        if errors:
            raise errors.pop()
        return "published"

    with caplog.at_level("WARNING", logger="srl.retry"):
        assert with_retry(publish, "publishing params") == "published"
    assert "Timeout writing to socket" in caplog.text and "'socket_timeout'" in caplog.text


def _redis_servers() -> list[str]:
    from tests.queue_fixtures import redis_server_binaries

    return redis_server_binaries()


@pytest.mark.parametrize("binary", _redis_servers())
def test_redis_refusing_for_a_while_is_named_and_waited_out(binary: str, caplog: pytest.LogCaptureFixture) -> None:
    """OOM, READONLY and BUSY, from a command or a script (Redis 6 wraps a script's in another error), are
    waited out like an outage: a heartbeat is "away", not a crashed thread, and a retried call goes on once
    Redis answers again, having said what it waits for."""
    from srl.runner.distribution.board.board import BOARD_AWAY
    from srl.runner.distribution.node.liveness import BoardWork
    from srl.runner.distribution.node.retry import with_retry
    from srl.runner.distribution.node.stop import StopFlag
    from tests.queue_fixtures import PrivateRedis, redis_refusing

    server = PrivateRedis(binary)
    server.start()
    try:
        board = Board(RedisParameters(url=server.url).connect(), "refusing")
        task = board.bound(board.create_task(CONFIG, actor_num=1).task_id)
        assert task.claim_actor_slot("a", 1, 60_000) == 0
        admin = redis.Redis(port=server.port)

        def write_stats() -> None:  # a script whose first write is one a full Redis refuses (Redis 6 checks only that)
            task.put_stats("actor:0", {"loss": 1.0})

        def log_after(refusal: str) -> Callable[[], None]:
            return lambda: done.append(with_retry(lambda: str(task.log_event(f"after {refusal}")), "logging an event"))

        for refusal in ("OOM", "READONLY", "BUSY"):
            done: list[str] = []
            stop = StopFlag()
            with redis_refusing(admin, refusal), caplog.at_level("WARNING"):
                with pytest.raises(BOARD_AWAY) as caught:
                    write_stats()
                error = caught.value
                assert getattr(error, "code", "") == refusal and str(error).startswith(refusal), error
                assert BoardWork("actor a", stop).run(write_stats, "heartbeat") == "away" and not stop.is_set()
                waiting = threading.Thread(target=log_after(refusal), daemon=True)
                waiting.start()
                wait_for(lambda: f"Redis refuses with {refusal}" in caplog.text, 60,  # noqa: B023
                         f"the wait for {refusal} to be logged")
                assert waiting.is_alive()
            waiting.join(60)
            assert done == ["None"], f"the call did not go on after {refusal}"
            assert f"board refusing with {refusal}" in caplog.text
            write_stats()
        assert [e.text for e in task.get_events()][-3:] == ["after OOM", "after READONLY", "after BUSY"]
    finally:
        server.cleanup()

