"""Pendulum DQN over its whole start distribution: what a run's evaluation is worth, and how often it gets stuck.

    python bench/pendulum_starts.py --modes one,dist --seeds 10        # train, then measure each run
    python bench/pendulum_starts.py --modes lagged --seeds 10 --set target_tau=0.005
    python bench/pendulum_starts.py --checkpoints a.safetensors b.safetensors   # measure saved runs

``runner.evaluate()`` is the mean of 10 episodes from 10 random starts, and a run that fails does so
because one of them gets stuck: from rest where one torque balances gravity (about 0.2 rad from the
bottom for a torque of 1, 0.41 rad for 2), a policy that keeps choosing that torque stays there for all
200 steps (about -1,490). Such a basin covers a fraction of a percent of the starts, so ten episodes
find it by chance: whether a 5-run group meets a bar is mostly luck unless one measures it. Here every
run is played from a grid of 360 x 41 starts spanning Pendulum-v1's (angle uniform in [-pi, pi], angular
velocity uniform in [-1, 1]), all at once with the env's own equations (tested against gymnasium) and
one batched forward pass a step, about 2 s a run. Per run: the expected 10-episode evaluation, the share
of starts stuck (an episode below -600) and the chance that a 10-episode evaluation meets one.

The summary per mode estimates the bar of the README's distributed job, "5 runs: median >= -160, none
below -250", by resampling: 5 of the measured runs drawn with replacement, each evaluated on 10 of its
grid's starts drawn at random, 20,000 times. With 10 runs a mode the estimate moves by about +-0.1;
it uses far more of each run than the 10 episodes ``runner.evaluate`` plays.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import learning

import srl
from srl.algorithms import dqn

GRAVITY, MAX_SPEED, MAX_TORQUE, DT = 10.0, 8.0, 2.0, 0.05
"""Pendulum-v1's constants (mass and length 1)"""
EPISODE_STEPS = 200
STUCK_BELOW = -600.0
"""an episode below this stayed near the bottom (a swing-up costs about -100...-400, a stuck one -1,490)"""
BAR_MEDIAN, BAR_FLOOR, BAR_RUNS = -160.0, -250.0, 5


def start_grid(angles: int = 360, speeds: int = 41) -> tuple[np.ndarray, np.ndarray]:
    """Starts spanning Pendulum-v1's reset distribution evenly: angle cell centres over [-pi, pi), speeds
    over [-1, 1]."""
    theta = np.linspace(-np.pi, np.pi, angles, endpoint=False) + np.pi / angles
    theta_dot = np.linspace(-1.0, 1.0, speeds)
    t, v = np.meshgrid(theta, theta_dot)
    return t.ravel(), v.ravel()


def greedy_returns(q: torch.nn.Module, actions: np.ndarray, theta: np.ndarray, theta_dot: np.ndarray,
                   steps: int = EPISODE_STEPS) -> np.ndarray:
    """Each start's episode return under the greedy policy of ``q`` (``actions``: the env action of each
    index), with gymnasium's Pendulum-v1 step, all starts at once."""
    th, thdot = theta.astype(np.float64), theta_dot.astype(np.float64)
    total = np.zeros_like(th)
    table = np.asarray(actions, dtype=np.float64).reshape(len(actions), -1)[:, 0]
    for _ in range(steps):
        obs = torch.from_numpy(np.stack([np.cos(th), np.sin(th), thdot], axis=1).astype(np.float32))
        with torch.inference_mode():
            index = q(obs).argmax(dim=1).numpy()
        u = np.clip(table[index], -MAX_TORQUE, MAX_TORQUE)
        angle = ((th + np.pi) % (2 * np.pi)) - np.pi
        total -= angle**2 + 0.1 * thdot**2 + 0.001 * u**2
        thdot = np.clip(thdot + (3 * GRAVITY / 2 * np.sin(th) + 3.0 * u) * DT, -MAX_SPEED, MAX_SPEED)
        th = th + thdot * DT
    return total


@dataclass
class Measured:
    name: str
    mode: str
    evaluation: float
    """``runner.evaluate()``: 10 episodes"""
    returns: np.ndarray
    """one per start of the grid"""

    @property
    def expected(self) -> float:
        return float(self.returns.mean())

    @property
    def stuck(self) -> float:
        return float((self.returns < STUCK_BELOW).mean())

    @property
    def fail10(self) -> float:
        """chance that a 10-episode evaluation meets a stuck start"""
        return 1.0 - (1.0 - self.stuck) ** 10


def measure(runner: srl.Runner) -> np.ndarray:
    """Each grid start's return under the runner's greedy policy (the one ``runner.evaluate`` plays)."""
    parameter = runner.parameter
    if not isinstance(parameter, dqn.DQNParameter) or runner.spec.env_id != "Pendulum-v1":
        raise SystemExit(f"this measures DQN on Pendulum-v1, not {runner.rl_config.algorithm} on "
                         f"{runner.spec.env_id}")
    assert parameter.actions is not None  # a Box action space: binned
    theta, theta_dot = start_grid()
    return greedy_returns(parameter.greedy_q, parameter.actions, theta, theta_dot)


def bar_chance(runs: list[Measured], trials: int = 20_000, seed: int = 0) -> float:
    """Estimated chance that 5 runs of this kind meet "median >= -160, none below -250" (10 episodes each)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(len(runs), size=(trials, BAR_RUNS))
    evals = np.empty((trials, BAR_RUNS))
    for i, run in enumerate(runs):
        where = picks == i
        starts = rng.integers(len(run.returns), size=(int(where.sum()), 10))
        evals[where] = run.returns[starts].mean(axis=1)
    met = (np.median(evals, axis=1) >= BAR_MEDIAN) & (evals.min(axis=1) >= BAR_FLOOR)
    return float(met.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="one,dist", help="comma-separated: one, dist, lagged")
    parser.add_argument("--seeds", type=int, default=10, help="runs with seeds 0..N-1 per mode")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--actors", type=int, default=1, help="actors of a distributed run (the README's job: 1)")
    parser.add_argument("--queue", default="redis", choices=sorted(learning.QUEUES))
    parser.add_argument("--lag", type=int, default=150, help="mode lagged: train steps between weight refreshes, "
                        "as in bench/learning.py")
    parser.add_argument("--chunk", type=int, default=128, help="mode lagged: rows handed over at a time")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="change a config field, as in bench/learning.py")
    parser.add_argument("--save", default=None, metavar="DIR", help="keep each trained run as a checkpoint here")
    parser.add_argument("--checkpoints", nargs="*", default=None, help="measure these saved runs instead")
    parser.add_argument("--json", default=None, help="write one line per run here")
    args = parser.parse_args()
    logging.getLogger("srl").setLevel(logging.WARNING)
    runs: list[Measured] = []

    def report(run: Measured) -> None:
        runs.append(run)
        print(f"{run.name} {run.mode}: evaluate() {run.evaluation:.1f}, expected {run.expected:.1f}, "
              f"stuck {100 * run.stuck:.2f}% of starts, a 10-episode evaluation meets one {100 * run.fail10:.1f}%",
              flush=True)

    if args.checkpoints is not None:
        for path in args.checkpoints:
            runner = srl.Runner.from_checkpoint(path)
            report(Measured(Path(path).stem, "saved", float(np.mean(runner.evaluate())), measure(runner)))
    else:
        changes = learning.set_changes(parser, args.set)
        case = learning.CASES["dqn-pendulum"]
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            if mode not in learning.MODES:
                parser.error(f"unknown mode {mode!r}; known: {', '.join(learning.MODES)}")
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                runner, _ = learning.train_run(case, mode, seed, case.budget, args.actors, args.queue,
                                               learning.Lagged(args.lag, args.chunk), changes)
                if args.save:
                    Path(args.save).mkdir(parents=True, exist_ok=True)
                    runner.save(Path(args.save) / f"{mode}-{seed}.safetensors")
                report(Measured(f"seed {seed}", mode, float(np.mean(runner.evaluate())), measure(runner)))
    if args.json:
        with open(args.json, "w") as f:
            for r in runs:
                f.write(json.dumps({"name": r.name, "mode": r.mode, "evaluation": round(r.evaluation, 2),
                                    "expected": round(r.expected, 2), "stuck": round(r.stuck, 5)}) + "\n")
    setup = ("saved runs" if args.checkpoints is not None else
             f"{learning.CASES['dqn-pendulum'].budget}; dist: {args.actors} actor(s) over {args.queue}; "
             f"lagged: lag {args.lag}, chunk {args.chunk}")
    print_summary(runs, args.set, setup)


def print_summary(runs: list[Measured], changes: list[str], setup: str) -> None:
    """The table per mode, titled with what the runs were trained with (``setup``: budget, actors, queue, the
    lagged mode's lag and chunk), so two summaries are compared only at equal settings."""
    setting = f"; changed: {' '.join(changes)}" if changes else ""
    print(f"\nPendulum-v1 DQN, the README's config{setting}; {setup}")
    print("starts: a grid of 360 x 41 over the reset distribution")
    header = (f"{'mode':<7} {'runs':>4} {'evaluate() median':>17} {'< -250':>6} {'expected median':>15} "
              f"{'runs stuck anywhere':>19} {'P(10 eps meet one)':>18} {'P(5 runs meet the bar)':>22}")
    print(header)
    print("-" * len(header))
    modes: dict[str, list[Measured]] = {}
    for r in runs:
        modes.setdefault(r.mode, []).append(r)
    for mode, group in modes.items():
        evals = [r.evaluation for r in group]
        print(f"{mode:<7} {len(group):>4} {statistics.median(evals):>17.1f} {sum(e < BAR_FLOOR for e in evals):>6} "
              f"{statistics.median(r.expected for r in group):>15.1f} {sum(r.stuck > 0 for r in group):>19} "
              f"{np.mean([r.fail10 for r in group]):>18.3f} {bar_chance(group):>22.2f}")


if __name__ == "__main__":
    main()
