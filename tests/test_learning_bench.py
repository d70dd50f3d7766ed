"""bench/learning.py's bookkeeping: a run's curve is that run's alone."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import learning


def test_a_rerun_of_a_seed_replaces_the_earlier_runs_curve(tmp_path: Path) -> None:
    case = learning.CASES["dqn-cartpole"]
    changes = {"warmup_size": 64, "batch_size": 16, "hidden_block": {"layer_sizes": [16]}}
    for _ in range(2):
        learning.run_once(case, "one", 0, "train:300", 1, "redis", episodes=1, changes=changes,
                          curve_dir=tmp_path, curve_every=100)
    with open(tmp_path / "dqn-cartpole-one-0" / "eval.csv") as f:
        steps = [int(float(row["train_count"])) for row in csv.DictReader(f)]
    assert steps == [100, 200, 300]
