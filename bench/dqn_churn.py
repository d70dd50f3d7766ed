"""How DQN's greedy policy on CartPole moves while it trains: its evaluations, its Q scale and its churn.

    python bench/dqn_churn.py --seed 22                       # dqn.Config() as bench/learning.py's case runs it
    python bench/dqn_churn.py --seed 22 --set batch_size=128  # the same with a change (FIELD=JSON, as learning.py)

One process trains with ``Runner.train`` (the run ``bench/learning.py --cases dqn-cartpole --modes one``
makes of the seed, step for step) to ``--budget`` train steps (50,000), its callback pausing every ``--chunk`` (250):
at each pause the greedy policy plays 5 episodes (seeds 100,000..100,004, the same every time) and the script records:

- the episodes' mean return and how each ended: ``5`` ran to 500 steps, ``t`` the pole fell, ``x`` the cart
  left the track;
- the mean of max_a Q(s, a) over the states those episodes visited, beside the value-iteration model
  100 (1 - gamma^(n_step * copies)): Q's fixed point with CartPole's +1 a step and truncation bootstrapped is
  1 / (1 - gamma) = 100, and each copy of the online network into the target moves the targets at most
  gamma^n_step of the remaining way;
- the median action gap |Q(s, 0) - Q(s, 1)| over the same states;
- churn: the share of a fixed set of states (every 10th state of the first evaluation that scored 500)
  whose greedy action differs from the pause before.

The summary counts the second half's evaluations below 300 and how their episodes ended, gives the churn's
median and spread, and splits both by whether a target copy (hard copies only) fell in the pause's chunk.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import learning

import srl
from srl.algorithms import dqn

FLOOR = 300.0
EPISODES = 5
EVAL_SEED = 100_000
Row = tuple[int, float, str, float, float, float | None]
"""train steps, mean return, ends, mean max Q, median action gap, churn (None before a probe set exists)"""


def play(worker: dqn.DQNWorker, env: gym.Env) -> tuple[list[int], str, np.ndarray]:
    """``EPISODES`` greedy episodes: their lengths, how each ended, and every state they visited."""
    lengths, ends, states = [], "", []
    for episode in range(EPISODES):
        obs, _ = env.reset(seed=EVAL_SEED + episode)
        steps, terminated, truncated = 0, False, False
        while not (terminated or truncated):
            states.append(obs)
            action = int(worker.act(np.asarray(obs, np.float32)[None])[0])
            obs, _, terminated, truncated, _ = env.step(action)
            steps += 1
        lengths.append(steps)
        ends += "5" if not terminated else ("x" if abs(float(obs[0])) > 2.4 else "t")
    return lengths, ends, np.asarray(states, np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=250, help="train steps between measurements")
    parser.add_argument("--budget", type=int, default=50_000, help="train steps in all")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="change a dqn.Config field, e.g. --set batch_size=128")
    args = parser.parse_args()
    changes = learning.set_changes(parser, args.set)
    logging.getLogger("srl").setLevel(logging.WARNING)
    case = learning.CASES["dqn-cartpole"]
    config = learning.configured(case, changes)
    assert isinstance(config, dqn.Config)
    config.seed = args.seed
    runner = srl.Runner(case.env, config)
    env = gym.make(case.env)
    probe: torch.Tensor | None = None
    previous: np.ndarray | None = None
    rows: list[Row] = []
    copies_move = config.gamma ** config.n_step
    print(f"dqn-cartpole seed {args.seed} {changes or 'dqn.Config()'}: measured every {args.chunk} train steps")
    print(f"{'train':>6} {'eval':>6} ends  {'max Q':>6} {'model':>6} {'gap':>6} {'churn':>6}")
    def measure(runner: srl.Runner) -> None:
        nonlocal probe, previous
        done = runner.train_count
        worker = config.make_worker(runner.spec, runner.parameter, 0, 1, 0)
        worker.training = False
        lengths, ends, states = play(worker, env)
        with torch.inference_mode():
            net = runner.parameter.greedy_q  # type: ignore[attr-defined]
            q = net(torch.from_numpy(states)).numpy()
            mean = float(np.mean(lengths))
            if probe is None and mean == 500.0:
                probe = torch.from_numpy(states[::10].copy())
            churn = None
            if probe is not None:
                greedy = net(probe).argmax(dim=1).numpy()
                if previous is not None:
                    churn = float(np.mean(greedy != previous))
                previous = greedy
        copies = done // config.target_update_interval if config.target_tau == 0 else None
        model = 100.0 * (1.0 - copies_move ** copies) if copies is not None else float("nan")
        gap = float(np.median(np.abs(q[:, 0] - q[:, 1])))
        rows.append((done, mean, ends, float(q.max(axis=1).mean()), gap, churn))
        print(f"{done:6d} {mean:6.1f} {ends} {rows[-1][3]:6.2f} {model:6.1f} {gap:6.3f} "
              + ("     -" if churn is None else f"{churn:6.3f}"), flush=True)

    runner.train(max_train_count=args.budget, progress_interval=None, checkpoint_interval=None,
                 callback=measure, callback_every=args.chunk)
    final = float(np.mean(runner.evaluate(max_episodes=learning.EVAL_EPISODES)))
    print(f"final evaluation ({learning.EVAL_EPISODES} episodes, as bench/learning.py's): {final:.1f}")
    summarize(rows, args.budget, config)


def median_churn(rows: list[Row]) -> float:
    churns = [r[5] for r in rows if r[5] is not None]
    return statistics.median(churns) if churns else float("nan")


def summarize(rows: list[Row], budget: int, config: dqn.Config) -> None:
    half = [r for r in rows if r[0] > budget // 2]
    dips = [r for r in half if r[1] < FLOOR]
    print(f"second half: {len(dips)} of {len(half)} evaluations below {FLOOR:.0f}; "
          f"ends of the episodes short of 500: {sum(r[2].count('t') for r in half)} pole, "
          f"{sum(r[2].count('x') for r in half)} track")
    churns = [r[5] for r in half if r[5] is not None]
    if churns:
        print(f"churn per chunk over the second half: median {statistics.median(churns):.3f}, "
              f"10%..90% {np.quantile(churns, 0.1):.3f}..{np.quantile(churns, 0.9):.3f}; "
              f"in chunks whose evaluation was 500: {median_churn([r for r in half if r[1] == 500.0]):.3f}")
    if config.target_tau == 0:
        every, chunk = config.target_update_interval, rows[0][0]
        copied = [r for r in half if r[0] // every != (r[0] - chunk) // every]  # a copy within the chunk
        others = [r for r in half if r not in copied]
        for name, group in (("chunks with a target copy", copied), ("the other chunks", others)):
            if group:
                print(f"{name}: {sum(r[1] < FLOOR for r in group)} of {len(group)} evaluations below "
                      f"{FLOOR:.0f}, churn median {median_churn(group):.3f}")


if __name__ == "__main__":
    main()
