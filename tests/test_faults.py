"""A sample of bench/faults.py's fault matrix, different for every commit: at least one cell per built
fault and one per algorithm, drawn from the commit hash (``SRL_FAULTS_SEED`` where there is no git), so
a failing cell fails here with the command that replays it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import broker_unavailable, port_open, require_tool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import faults

pytestmark = pytest.mark.slow


def sample_seed() -> int:
    """The commit's hash as a number (a run of the same commit draws the same cells and moments)."""
    if seed := os.environ.get("SRL_FAULTS_SEED"):
        return int(seed)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return 0
    return int(head[:8], 16)


SEED = sample_seed()
SAMPLE = faults.ci_sample(SEED)
BROKER_PORTS = {"amqp": ("RabbitMQ", 5672), "mqtt": ("Mosquitto", 1883), "pubsub": ("Pub/Sub emulator", 8085)}


def test_the_sample_covers_every_built_fault_and_every_algorithm() -> None:
    built = {c.fault for c in faults.all_cells() if faults.runnable(c) and not c.known_failing()} - {"none"}
    assert built <= {c.fault for c in SAMPLE}
    algorithms = {a.removesuffix("-central") for a, spec in faults.ALGORITHMS.items() if not spec.not_applicable}
    assert {c.algorithm.removesuffix("-central") for c in SAMPLE} == algorithms
    assert any(faults.ALGORITHMS[c.algorithm].central for c in SAMPLE)
    assert not any(c.known_failing() or not faults.runnable(c) for c in SAMPLE)


@pytest.mark.parametrize("cell", SAMPLE, ids=[c.name for c in SAMPLE])
def test_a_cell_of_the_fault_matrix_ends_with_nothing_lost(cell: faults.Cell) -> None:
    require_tool("redis-server", "a private Redis for each cell")
    if cell.queue in BROKER_PORTS:
        what, port = BROKER_PORTS[cell.queue]
        if not port_open("127.0.0.1", port):
            broker_unavailable(what, "127.0.0.1", port)
    if cell.fault == "broker-restart" and cell.queue == "mqtt":
        require_tool("mosquitto", "a private Mosquitto to restart")
    if cell.fault == "broker-restart" and cell.queue == "amqp":
        require_tool("rabbitmq-server", "a private RabbitMQ node to restart")
    result = faults.run_cell(cell, SEED, scaled=False)  # minutes for the sample: the algorithms' budgets
    # "pass (the run ended before ...)": the run reached its budget with the fault in it, on its own
    assert result.verdict.startswith("pass"), (f"{result.row()}\n  accounts: {result.accounts}\n  logs: {result.logs}\n"
                                      f"  replay: {faults.replay_command(cell, SEED, scaled=False)}")
    assert result.evaluation is not None, result.row()  # the final params, by the client that loaded them


def test_a_cell_evaluated_below_its_no_fault_spread_fails_saying_so() -> None:
    passed = faults.Result("dqn/redis/actor-kill", 5, "pass", 2.0, 30.0, evaluation=12.0)
    failed = passed.below((20.0, 60.0, 3))
    assert failed.verdict == "FAIL: evaluation 12.0 below the no-fault spread 20.0..60.0 (3 runs)"
    assert passed.below((10.0, 60.0, 3)) is passed  # within (or above) the spread
    assert passed.below(None) is passed  # no spread asked for
    assert faults.Result("c", 1, "pass", None, 1.0).below((20.0, 60.0, 3)).verdict == "pass"  # not evaluated


def test_a_recorded_matrix_counts_passes_by_seed_and_names_failures_with_their_replay(tmp_path: Path) -> None:
    record = tmp_path / "faults.jsonl"
    cell = faults.Cell("dqn", "redis", "trainer-kill")
    for seed, verdict in ((1, "pass"), (1, "pass"), (2, "FAIL: accounts do not balance")):
        faults.write_record(record, faults.Result(cell.name, seed, verdict, 1.0, 10.0), scaled=True)
    record.open("a").write("not json\n")
    rows = faults.read_record(record)
    assert len(rows) == 3 and {r["commit"] for r in rows} != {""}
    assert faults.passed_seeds(rows) == {cell.name: {1}}  # the same seed twice is one seed
    table = faults.record_table(rows, [cell, faults.Cell("sac", "mqtt", "zombie")])
    assert "1/0/0 of 1" in table  # passed once, not with two seeds
    assert f"`{cell.name}` seed 2" in table and "--cell dqn/redis/trainer-kill --seed 2" in table
    faults.write_record(record, faults.Result(cell.name, 3, "pass", 1.0, 10.0), scaled=True)
    assert "1/1/0 of 1" in faults.record_table(faults.read_record(record), [cell])


def test_a_run_over_before_its_recovery_runs_again_longer_and_does_not_count_until_it_sees_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cell = faults.Cell("dqn", "redis", "zombie")
    missed = f"pass ({faults.ENDED_BEFORE} the standby took the stopped actor's slot)"
    calls: list[int] = []

    def runs(seen_at: int) -> object:
        def run_cell_at(c: faults.Cell, seed: int, stretch: int, scaled: bool = True) -> faults.Result:
            calls.append(stretch)
            return faults.Result(c.name, seed, "pass" if stretch >= seen_at else missed, 1.0, 10.0, stretch=stretch)
        return run_cell_at

    monkeypatch.setattr(faults, "run_cell_at", runs(3))
    result = faults.run_cell(cell, 7)
    assert calls == [1, 3] and result.stretch == 3 and result.wall_s == 20.0  # every run's wall time
    assert result.verdict.startswith("pass (at 3x its budget") and not result.missed_recovery
    calls.clear()
    monkeypatch.setattr(faults, "run_cell_at", runs(100))  # never seen: the longest run's pass, named as such
    result = faults.run_cell(cell, 7)
    assert calls == list(faults.STRETCHES) and result.missed_recovery
    record = tmp_path / "faults.jsonl"
    faults.write_record(record, result, scaled=True)
    assert faults.passed_seeds(faults.read_record(record)) == {}
    assert "1 passing runs ended before their fault's recovery" in faults.record_table(
        faults.read_record(record), [cell])
