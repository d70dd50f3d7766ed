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


def test_the_first_run_suite_runs_every_algorithm_as_it_comes_on_the_envs_its_docs_name() -> None:
    """Each row is an algorithm's Config() as it comes (the recurrent ones with an LSTM) with a floor, on an env
    it can act in, and together they cover the envs each algorithm's docs name, one process and hand-started."""
    from srl.base.config import config_to_dict
    from srl.base.env import EnvConfig, env_spec

    covered: set[tuple[str, str]] = set()
    for name in learning.FIRST_RUN_CASES:
        case = learning.CASES[name]
        config = case.make_config()
        recurrent = getattr(config, "recurrent", None)
        default = type(config)(recurrent=recurrent) if recurrent else type(config)()  # type: ignore[call-arg]
        assert config_to_dict(config) == config_to_dict(default), f"{name} is not {type(config).__module__} as it comes"
        assert case.floor is not None and case.floor <= case.target, name
        algorithm = type(config).__module__.rsplit(".", 1)[1]
        algorithm += "-lstm" if recurrent and algorithm in ("ppo", "impala") else ""  # R2D2's is always there
        covered.add((algorithm, case.env))
        if not case.needs:
            config.check_spec(env_spec(EnvConfig(case.env)))
    expected = {("dqn", env) for env in ("CartPole-v1", "Acrobot-v1", "Pendulum-v1", learning.MINATAR_BREAKOUT)}
    expected |= {("sac", "Pendulum-v1"), ("r2d2", learning.CARTPOLE_NOVEL), ("r2d2", learning.MINATAR_BREAKOUT)}
    expected |= {(a, env) for a in ("ppo", "impala")
                 for env in ("CartPole-v1", "Acrobot-v1", "Pendulum-v1", learning.MINATAR_BREAKOUT)}
    expected |= {(f"{a}-lstm", env) for a in ("ppo", "impala")
                 for env in (learning.CARTPOLE_NOVEL, learning.PENDULUM_NOVEL)}
    assert covered == expected
    plan = learning.suite_plan("first-run", list(learning.MODES))
    assert plan == [(n, m) for n in learning.FIRST_RUN_CASES for m in ("one", "hand")]
    assert learning.suite_plan("first-run", ["one"]) == [(n, "one") for n in learning.FIRST_RUN_CASES]
