"""Which greedy policy dips least late in a one-process DQN run on CartPole: the online network, an average
of its weights, or the mean Q of its recent snapshots.

    python bench/dqn_greedy.py --seed 20                       # dqn.Config() as bench/learning.py's case runs it
    python bench/dqn_greedy.py --seed 20 --set n_step=5        # the same with a change (FIELD=JSON, as learning.py)

One process trains with ``Runner.train`` to ``--budget`` train steps (50,000). The explorer acts with the
online network as always, so the run's weights are those of ``bench/learning.py --cases dqn-cartpole --modes
one`` for the seed (the weight average below is kept beside them and moves nothing). Every ``--every`` (500)
train steps a callback copies the online network (a snapshot, the last ``--snapshots`` kept), and through the
second half of the run each of three greedy policies plays 5 episodes from fixed starts (seeds 100,000..100,004):

- ``online``: the online network, what ``dqn.Config()`` evaluates on a Discrete action space;
- ``snapshots``: argmax of the mean Q of the last ``--snapshots`` (5) snapshots, the newest taken at this pause;
- ``average``: the moving average of the online weights that ``greedy_average_tau`` keeps (``--tau``, 0.0002:
  about the last 5,000 steps, the default for binned Box actions).

At the end each plays 20 episodes from other fixed starts (seeds 200,000..200,019), and the summary counts the
second half's evaluations below 300 and those of its last 20% (40k-50k train steps of 50k).
"""

from __future__ import annotations

import argparse
import collections
import copy
import logging
import sys
from collections.abc import Callable
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
QFunction = Callable[[torch.Tensor], torch.Tensor]
POLICIES = ("online", "snapshots", "average")


def play(q: QFunction, env: gym.Env, episodes: int, first_seed: int) -> float:
    """The mean return of ``episodes`` greedy episodes from starts ``first_seed``, ``first_seed + 1``, ..."""
    total = 0.0
    for episode in range(episodes):
        obs, _ = env.reset(seed=first_seed + episode)
        done = False
        while not done:
            with torch.inference_mode():
                action = int(q(torch.as_tensor(np.asarray(obs, np.float32)[None])).argmax(dim=1)[0])
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
    return total / episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=50_000, help="train steps in all")
    parser.add_argument("--every", type=int, default=500, help="train steps between snapshots and evaluations")
    parser.add_argument("--snapshots", type=int, default=5, help="snapshots whose mean Q the snapshot policy takes")
    parser.add_argument("--tau", type=float, default=dqn.GREEDY_AVERAGE_TAU_BOX, help="the weight average's tau")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="change a dqn.Config field, e.g. --set n_step=5")
    args = parser.parse_args()
    if args.tau <= 0.0:
        parser.error("--tau must be above 0: it is the average this script compares")
    changes = learning.set_changes(parser, args.set)
    logging.getLogger("srl").setLevel(logging.WARNING)
    case = learning.CASES["dqn-cartpole"]
    config = learning.configured(case, {**changes, "greedy_average_tau": args.tau})
    assert isinstance(config, dqn.Config)
    config.seed = args.seed
    runner = srl.Runner(case.env, config)
    parameter = runner.parameter
    assert isinstance(parameter, dqn.DQNParameter) and parameter.q_average is not None
    env = gym.make(case.env)
    snapshots: collections.deque[dqn.QNetwork] = collections.deque(maxlen=args.snapshots)

    def policies() -> dict[str, QFunction]:
        assert parameter.q_average is not None
        return {"online": parameter.q, "average": parameter.q_average,
                "snapshots": lambda x: torch.stack([s(x) for s in snapshots]).mean(dim=0)}

    rows: list[tuple[int, dict[str, float]]] = []
    print(f"dqn-cartpole seed {args.seed} {changes or 'dqn.Config()'}: greedy policies, 5 episodes every "
          f"{args.every} train steps through the second half")
    print(f"{'train':>6} " + " ".join(f"{name:>9}" for name in POLICIES))

    def measure(runner: srl.Runner) -> None:
        snapshots.append(copy.deepcopy(parameter.q).eval())
        if runner.train_count <= args.budget // 2:
            return
        scores = {name: play(q, env, 5, 100_000) for name, q in policies().items()}
        rows.append((runner.train_count, scores))
        print(f"{runner.train_count:6d} " + " ".join(f"{scores[name]:9.1f}" for name in POLICIES), flush=True)

    runner.train(max_train_count=args.budget, progress_interval=None, checkpoint_interval=None,
                 callback=measure, callback_every=args.every)
    last_fifth = [scores for done, scores in rows if done > args.budget * 4 // 5]
    print(f"\n{'policy':>9} {'final (20)':>10} {'2nd half <300':>13} {'last 20% <300':>14}")
    for name, q in policies().items():
        final = play(q, env, 20, 200_000)
        half = sum(scores[name] < FLOOR for _, scores in rows)
        fifth = sum(scores[name] < FLOOR for scores in last_fifth)
        print(f"{name:>9} {final:10.1f} {f'{half}/{len(rows)}':>13} {f'{fifth}/{len(last_fifth)}':>14}")


if __name__ == "__main__":
    main()
