"""The trainer's ingest bookkeeping, in bounded memory: which batches it has seen."""

from __future__ import annotations

from srl.runner.distribution.trainer import SeenBatches


def test_replays_are_refused_within_and_beyond_the_window() -> None:
    seen = SeenBatches(window=4096)
    for seq in range(4098):
        assert seen.is_new("a", seq)
        seen.mark("a", seq)
    assert not seen.is_new("a", 4097)  # the newest, again
    assert not seen.is_new("a", 5)  # a recent one, again
    assert not seen.is_new("a", 0)  # 4,097 batches later: at or below the window, a replay
    assert seen.is_new("a", 5000)  # ahead: new
    assert seen.is_new("b", 0)  # another actor has its own numbering


def test_a_late_batch_within_the_window_is_accepted_once() -> None:
    seen = SeenBatches(window=64)
    for seq in (0, 1, 3, 4):
        seen.mark("a", seq)
    assert seen.is_new("a", 2)  # arrived out of order (a redelivery): still new
    seen.mark("a", 2)
    assert not seen.is_new("a", 2)
    seen.mark("a", 100)  # jumps far ahead: everything at or below 36 is now too old
    assert not seen.is_new("a", 36) and seen.is_new("a", 37) and not seen.is_new("a", 100)


def test_actors_are_forgotten_least_recently_heard_first() -> None:
    seen = SeenBatches(window=16, max_actors=3)
    for actor in ("a", "b", "c"):
        seen.mark(actor, 0)
    seen.mark("a", 1)  # a was heard from again: b is now the oldest
    seen.mark("d", 0)
    assert len(seen) == 3
    assert seen.is_new("b", 0)  # forgotten
    assert not seen.is_new("a", 1) and not seen.is_new("c", 0) and not seen.is_new("d", 0)
