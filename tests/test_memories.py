"""Replay memories: sampling distribution, importance weights, ring eviction, validation, threads."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator

import numpy as np
import pytest

from srl.rl.memories import Memory, MemoryConfig, ProportionalMemory, ReplayMemory, Sample
from srl.rl.memories.replay import ColumnRing
from srl.rl.memories.sum_tree import TOP_LEVEL_BITS, SumTree

# Capacities above 2**TOP_LEVEL_BITS make the tree keep binary levels below its flat top,
# so the vectorised descent is exercised, not only the prefix-sum search.
SMALL_AND_DEEP = [5, 3000, 100_000]
assert 3000 > 2**TOP_LEVEL_BITS


def rows(values: Iterable[int] | np.ndarray) -> dict[str, np.ndarray]:
    """A batch whose columns all encode one integer per row, so any mix-up shows."""
    v = np.fromiter(values, dtype=np.int64)
    return {
        "b": v,
        "a": 2 * v,
        "obs": np.repeat(v[:, None], 3, axis=1).astype(np.float32),
    }


def make(kind: str, capacity: int, **kwargs: float) -> Memory:
    if kind == "replay":
        return ReplayMemory(capacity, seed=0)
    return ProportionalMemory(capacity, seed=0, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(params=["replay", "proportional"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture()
def fast_thread_switching() -> Iterator[None]:
    """Switch threads as often as the interpreter allows, so a missing lock shows up as torn rows."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


# ---------------------------------------------------------------- sum tree


@pytest.mark.parametrize("capacity", SMALL_AND_DEEP)
def test_sampling_frequency_matches_priorities(capacity: int) -> None:
    memory = ProportionalMemory(capacity, alpha=1.0, priority_epsilon=1e-9, beta_steps=0, seed=1)
    memory.add(rows([0, 1, 2, 3, 4]), priorities=np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    counts = np.zeros(5, dtype=np.int64)
    for _ in range(100):
        sample = memory.sample(500)
        counts += np.bincount(sample.indices, minlength=5)[:5]
        assert np.all(sample.batch["b"] == sample.indices), "row and slot disagree"
    frequency = counts / counts.sum()
    expected = np.arange(1, 6) / 15.0
    # 50k stratified draws: the spread is far below 0.005; a wrong descent is off by > 0.05.
    np.testing.assert_allclose(frequency, expected, atol=0.005)


def test_sum_tree_descent_over_scattered_leaves_and_exact_boundaries() -> None:
    tree = SumTree(100_000)
    slots = np.array([0, 1, 1500, 2047, 2048, 65_536, 99_999])
    masses = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    tree.set(slots, masses)
    assert tree.total == pytest.approx(28.0)
    assert tree.max_sum_error() == 0.0
    # A draw exactly on a boundary belongs to the next leaf; empty leaves in between are never hit.
    boundaries = np.concatenate([[0.0], np.cumsum(masses)[:-1]])
    np.testing.assert_array_equal(tree.find(boundaries), slots)
    np.testing.assert_array_equal(tree.find(boundaries + 0.5), slots)
    np.testing.assert_array_equal(tree.find(np.cumsum(masses) - 1e-9), slots)

    draws = np.random.default_rng(3).random(200)
    found = np.concatenate([tree.find_stratified(draws) for _ in range(250)])
    frequency = np.array([(found == s).mean() for s in slots])
    assert (found[:, None] == slots).any(axis=1).all(), "landed on a zero-priority leaf"
    np.testing.assert_allclose(frequency, masses / 28.0, atol=0.005)


def test_sum_tree_range_writes_wrap_and_keep_sums_exact() -> None:
    tree = SumTree(3000)
    values = np.random.default_rng(0).random(3000)
    tree.set_range(0, 3000, values)
    tree.set_range(2990, 3000, 0.5)
    tree.set_range(0, 7, values[:7] * 3)
    assert tree.max_sum_error() == 0.0
    assert tree.total == pytest.approx(float(tree.leaves.sum()), rel=1e-12)


# ---------------------------------------------------------------- importance weights and priorities


def test_importance_weights_hand_case() -> None:
    # p = [1, 4], alpha = 1, beta = 0.5, N = 2: P = [0.2, 0.8], (N P)^-beta = [1/sqrt(0.4), 1/sqrt(1.6)],
    # normalised by the max: [1.0, 0.5].
    memory = ProportionalMemory(4, alpha=1.0, beta_initial=0.5, beta_steps=10**9, priority_epsilon=1e-12)
    memory.add(rows([0, 1]), priorities=np.array([1.0, 4.0]))
    sample = memory.sample(64)
    assert set(sample.indices.tolist()) == {0, 1}
    assert sample.weights.dtype == np.float32
    np.testing.assert_allclose(sample.weights[sample.indices == 0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(sample.weights[sample.indices == 1], 0.5, rtol=1e-6)


def test_importance_weights_follow_the_per_formula() -> None:
    alpha, beta, eps = 0.7, 0.4, 1e-4
    memory = ProportionalMemory(8, alpha=alpha, beta_initial=beta, beta_steps=10**9, priority_epsilon=eps, seed=5)
    td = np.array([0.1, 0.5, 1.0, 2.0, 4.0, 0.0])
    memory.add(rows(range(6)), priorities=td)
    sample = memory.sample(16)
    p = (np.abs(td) + eps) ** alpha
    w = (len(memory) * p / p.sum()) ** -beta
    expected = w[sample.indices] / w[sample.indices].max()
    np.testing.assert_allclose(sample.weights, expected, rtol=1e-6)
    assert sample.weights.max() == pytest.approx(1.0)


def test_uniform_memory_samples_filled_slots_uniformly_with_unit_weights() -> None:
    memory = ReplayMemory(1000, seed=2)
    memory.add(rows(range(10)))
    sample = memory.sample(20_000)
    assert sample.indices.min() == 0 and sample.indices.max() == 9
    np.testing.assert_allclose(np.bincount(sample.indices) / 20_000, 0.1, atol=0.01)
    assert np.all(sample.weights == 1.0) and sample.weights.dtype == np.float32
    assert memory.beta == 1.0
    memory.update_priorities(sample.indices, np.ones(20_000), sample.generations)  # accepted, no effect


def test_update_priorities_changes_the_distribution() -> None:
    memory = ProportionalMemory(3000, alpha=0.6, priority_epsilon=1e-4, seed=4)
    memory.add(rows(range(4)))
    before = memory.sample(4000)
    assert abs(np.mean(before.indices == 3) - 0.25) < 0.02  # equal max priority for all

    memory.update_priorities(np.array([0, 1, 2, 3]), np.array([0.01, 0.01, -0.01, 100.0]))
    np.testing.assert_allclose(memory.tree.leaves[3], (100.0 + 1e-4) ** 0.6)
    np.testing.assert_allclose(memory.tree.leaves[2], (0.01 + 1e-4) ** 0.6)  # the sign is dropped
    after = memory.sample(4000)
    assert np.mean(after.indices == 3) > 0.9

    # Rows added afterwards without priorities get the largest priority seen so far,
    # whether it came from update_priorities or from add.
    memory.add(rows([4]))
    assert memory.tree.leaves[4] == memory.tree.leaves[3]
    memory.add(rows([5]), priorities=np.array([500.0]))
    memory.add(rows([6]))
    np.testing.assert_allclose(memory.tree.leaves[6], (500.0 + 1e-4) ** 0.6)


class EndOfMassDraws:
    """Stands in for the memory's generator: every draw at the very end of its segment,
    which is where float round-off can push the last draw past the filled leaves."""

    def random(self, n: int) -> np.ndarray:
        return np.ones(n)


@pytest.mark.parametrize("capacity", SMALL_AND_DEEP)
def test_draws_at_the_end_of_the_mass_land_on_filled_slots(capacity: int) -> None:
    memory = ProportionalMemory(capacity, seed=0)
    memory.add(rows([0, 1, 2]), priorities=np.array([1.0, 2.0, 3.0]))
    assert memory.tree.find(np.array([memory.tree.total]))[0] >= 3  # the raw tree overshoots
    memory._rng = EndOfMassDraws()  # type: ignore[assignment]
    sample = memory.sample(4)
    assert np.all(sample.indices < 3) and np.all(sample.batch["b"] == sample.indices)
    assert np.all(np.isfinite(sample.weights)) and np.all(sample.weights > 0)


def test_stale_generation_updates_are_ignored() -> None:
    memory = ProportionalMemory(4, alpha=1.0, priority_epsilon=1e-4, seed=0)
    memory.add(rows(range(4)), priorities=np.ones(4))
    sample = memory.sample(64)
    assert set(sample.indices.tolist()) == {0, 1, 2, 3}
    memory.add(rows([4, 5]), priorities=np.full(2, 7.0))  # overwrites slots 0 and 1

    memory.update_priorities(sample.indices, np.full(64, 50.0), sample.generations)
    leaves = memory.tree.leaves
    np.testing.assert_allclose(leaves[[0, 1]], 7.0 + 1e-4)  # new rows keep their own priority
    np.testing.assert_allclose(leaves[[2, 3]], 50.0 + 1e-4)  # untouched rows are updated
    assert memory.tree.max_sum_error() == 0.0

    # Without generations the caller asked for no check: the update lands.
    memory.update_priorities(np.array([0]), np.array([9.0]))
    np.testing.assert_allclose(memory.tree.leaves[0], 9.0 + 1e-4)


def test_update_priorities_refuses_bad_input() -> None:
    memory = ProportionalMemory(10, seed=0)
    memory.add(rows(range(3)))
    with pytest.raises(ValueError, match="finite"):
        memory.update_priorities(np.array([0, 1]), np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match=r"filled slots in \[0, 3\)"):
        memory.update_priorities(np.array([5]), np.array([1.0]))
    with pytest.raises(ValueError, match="one per row"):
        memory.update_priorities(np.array([0, 1]), np.array([1.0]))
    with pytest.raises(ValueError, match="generations"):
        memory.update_priorities(np.array([0, 1]), np.array([1.0, 2.0]), np.array([1]))
    with pytest.raises(ValueError, match="finite"):
        memory.add(rows([3]), priorities=np.array([np.inf]))
    assert memory.tree.max_sum_error() == 0.0 and np.isfinite(memory.tree.total)


# ---------------------------------------------------------------- ring


def slots_of_everything(memory: Memory) -> dict[int, int]:
    """slot -> stored value, by sampling until every filled slot has been seen."""
    seen: dict[int, int] = {}
    for _ in range(50):
        sample = memory.sample(256)
        seen.update(zip(sample.indices.tolist(), sample.batch["b"].tolist(), strict=True))
        if len(seen) == len(memory):
            break
    return seen


def test_ring_evicts_oldest_first(kind: str) -> None:
    memory = make(kind, 5)
    memory.add(rows([0, 1, 2]))
    memory.add(rows([3, 4, 5, 6]))
    assert len(memory) == 5 and memory.total_added == 7
    # Row number s always lands in slot s % capacity: 0 and 1 were the oldest and are gone.
    assert slots_of_everything(memory) == {0: 5, 1: 6, 2: 2, 3: 3, 4: 4}


def test_batch_larger_than_capacity_keeps_its_last_rows(kind: str) -> None:
    memory = make(kind, 5, alpha=1.0, priority_epsilon=1e-9)
    memory.add(rows([0, 1]), priorities=np.array([1.0, 1.0]))
    memory.add(rows(range(2, 14)), priorities=np.arange(2, 14, dtype=np.float64))
    assert len(memory) == 5 and memory.total_added == 14
    assert slots_of_everything(memory) == {s % 5: s for s in range(9, 14)}
    if isinstance(memory, ProportionalMemory):
        # Each kept row carries its own priority to its slot.
        expected = {s % 5: float(s) for s in range(9, 14)}
        np.testing.assert_allclose(memory.tree.leaves, [expected[i] for i in range(5)], rtol=1e-9)
        assert memory.tree.max_sum_error() == 0.0


def test_generations_count_writes_per_slot(kind: str) -> None:
    memory = make(kind, 3)
    memory.add(rows(range(3)))
    memory.add(rows([3]))  # slot 0 written twice
    sample = memory.sample(200)
    for index, generation in zip(sample.indices, sample.generations, strict=True):
        assert generation == (2 if index == 0 else 1)


def test_sample_is_a_copy(kind: str) -> None:
    memory = make(kind, 2)
    memory.add(rows([1, 1]))
    sample = memory.sample(4)
    memory.add(rows([7, 7]))
    assert np.all(sample.batch["b"] == 1)


def test_empty_memory_and_bad_batch_size_raise(kind: str) -> None:
    memory = make(kind, 10)
    with pytest.raises(ValueError, match="empty"):
        memory.sample(4)
    memory.add(rows([1]))
    with pytest.raises(ValueError, match="batch_size"):
        memory.sample(0)


# ---------------------------------------------------------------- column validation


def test_column_mismatch_raises_naming_the_column(kind: str) -> None:
    memory = make(kind, 10)
    memory.add(rows([1, 2]))
    good = rows([3])
    with pytest.raises(ValueError, match=r"missing: \['obs'\]"):
        memory.add({"a": good["a"], "b": good["b"]})
    with pytest.raises(ValueError, match=r"unexpected: \['extra'\]"):
        memory.add({**good, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"column 'obs' has row shape \(4,\) but the memory stores \(3,\)"):
        memory.add({**good, "obs": np.zeros((1, 4), dtype=np.float32)})
    with pytest.raises(ValueError, match="column 'a' has 2 rows but column 'b' has 1"):
        memory.add({"b": good["b"], "a": np.zeros(2, dtype=np.int64), "obs": good["obs"]})
    with pytest.raises(ValueError, match="column 'b' has dtype float64, which cannot be stored as int64"):
        memory.add({**good, "b": np.zeros(1)})
    with pytest.raises(ValueError, match="scalar"):
        memory.add({**good, "b": np.int64(3)})
    assert len(memory) == 2 and memory.total_added == 2  # nothing half-written
    # Same kind, narrower dtype: cast and stored.
    memory.add({**good, "obs": good["obs"].astype(np.float64)})
    assert len(memory) == 3


def test_first_batch_must_be_numeric_columns(kind: str) -> None:
    memory = make(kind, 10)
    with pytest.raises(ValueError, match="non-empty dict"):
        memory.add({})
    with pytest.raises(ValueError, match="numbers only"):
        memory.add({"note": np.array(["x", "y"])})


def test_empty_batch_stores_nothing_and_fixes_nothing(kind: str) -> None:
    memory = make(kind, 10)
    memory.add({"x": np.zeros((0, 7))}, priorities=np.zeros(0))
    assert len(memory) == 0 and memory.total_added == 0
    memory.add(rows([1, 2]))  # a different layout is still free to become the first
    assert len(memory) == 2


def test_layout_fixed_by_another_thread_between_validation_and_write_is_enforced() -> None:
    ring = ColumnRing(10)
    first = ring.conform(rows([1]))
    racing = ring.conform({**rows([2]), "obs": np.zeros((1, 5), dtype=np.float32)})
    ring.write(first)
    with pytest.raises(ValueError, match="column 'obs' has row shape"):
        ring.write(racing)
    assert ring.size == 1


# ---------------------------------------------------------------- threads


def test_concurrent_add_and_sample_never_tear_rows(kind: str, fast_thread_switching: None) -> None:
    capacity, add_batches, rows_per_batch = 3000, 1500, 64
    memory = make(kind, capacity)
    first_added, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def ingest() -> None:
        rng = np.random.default_rng(11)
        try:
            for i in range(add_batches):
                values = rng.integers(0, 1_000_000, rows_per_batch)
                memory.add(rows(values), priorities=rng.random(rows_per_batch) * 3)
                if i == 0:
                    first_added.set()
        except BaseException as e:  # surfaced by the main thread below
            errors.append(e)
        finally:
            first_added.set()
            done.set()

    adder = threading.Thread(target=ingest, name="ingest")
    adder.start()
    assert first_added.wait(timeout=10), "ingest thread never added a batch"
    rng = np.random.default_rng(12)
    samples = 0
    try:
        while not done.is_set() or samples < 200:
            sample: Sample = memory.sample(32)
            b, a, obs = sample.batch["b"], sample.batch["a"], sample.batch["obs"]
            assert np.all(a == 2 * b), "torn read: columns a and b come from different writes"
            assert np.all(obs == b[:, None].astype(np.float32)), "torn read inside a row"
            memory.update_priorities(sample.indices, rng.random(32) * 5, sample.generations)
            samples += 1
    finally:
        adder.join(timeout=30)
    assert not adder.is_alive()
    assert errors == []
    assert memory.total_added == add_batches * rows_per_batch
    assert len(memory) == min(memory.total_added, capacity)
    if isinstance(memory, ProportionalMemory):
        tree = memory.tree
        assert tree.total == pytest.approx(float(tree.leaves.sum()), rel=1e-9)
        assert tree.max_sum_error() == 0.0
        assert np.all(tree.leaves > 0)


# ---------------------------------------------------------------- config


def test_config_builds_each_kind() -> None:
    config = MemoryConfig()
    config.set_replay_memory(capacity=123)
    memory = config.build(seed=0)
    assert isinstance(memory, ReplayMemory) and memory.capacity == 123

    config.set_proportional_memory(alpha=0.5, beta_initial=0.3, beta_steps=7)
    memory = config.build(seed=0)
    assert isinstance(memory, ProportionalMemory)
    assert (memory.capacity, memory.alpha, memory.beta, memory.beta_steps) == (123, 0.5, 0.3, 7)


def test_config_kind_typo_lists_the_valid_kinds() -> None:
    with pytest.raises(ValueError, match="expected one of 'replay', 'proportional'") as info:
        MemoryConfig(kind="proportinal").build()
    assert "Did you mean 'proportional'" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("capacity", 0),
        ("capacity", -5),
        ("capacity", 10.5),
        ("capacity", True),
        ("alpha", 1.5),
        ("alpha", float("nan")),
        ("beta_initial", -0.1),
        ("beta_steps", -1),
        ("priority_epsilon", 0.0),
    ],
)
def test_config_refuses_bad_fields(field: str, value: object) -> None:
    config = MemoryConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"MemoryConfig.{field} is .*; expected"):
        config.build()


# ---------------------------------------------------------------- beta


def test_beta_anneals_linearly_to_one() -> None:
    memory = ProportionalMemory(10, beta_initial=0.4, beta_steps=10, seed=0)
    memory.add(rows(range(10)))
    assert memory.beta == pytest.approx(0.4)
    for _ in range(5):
        memory.sample(2)
    assert memory.beta == pytest.approx(0.7)
    for _ in range(5):
        memory.sample(2)
    assert memory.beta == 1.0
    memory.sample(2)
    assert memory.beta == 1.0


def test_a_segment_buffer_grown_keeps_its_rows_oldest_first_and_takes_more() -> None:
    """The learner's FIFO grows over a long round trip (the trainer's read window): rows held across the
    ring's wrap keep their order, and the new room is there at once."""
    from srl.base.schema import Column, Schema
    from srl.rl.memories.segments import SegmentBuffer

    buffer = SegmentBuffer(4, Schema({"x": Column("int64", (2,))}))

    def rows(*values: int) -> dict[str, np.ndarray]:
        return {"x": np.array([[v, -v] for v in values], dtype=np.int64)}

    buffer.add(rows(0, 1, 2))
    assert buffer.take(2) is not None  # the head moves: the next rows wrap around the ring
    buffer.add(rows(3, 4, 5))
    assert buffer.room() == 0
    assert not buffer.grow(4)  # not larger: nothing to do
    assert buffer.grow(10)
    assert (buffer.capacity, len(buffer), buffer.room()) == (10, 4, 6)
    buffer.add(rows(6, 7, 8, 9, 10, 11))
    taken = buffer.take()
    assert taken is not None and taken["x"][:, 0].tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert (taken["x"][:, 1] == -taken["x"][:, 0]).all()
