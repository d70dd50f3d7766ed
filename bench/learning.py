"""Learning you can rely on: algorithm x env x mode x seeds, in one table beside published references.

    python bench/learning.py                      # the standard suite, 10 seeds a row (hours on 2 cores)
    python bench/learning.py --seeds 3            # the same, 3 seeds a row (about an hour on 2 cores)
    python bench/learning.py --quick              # a smoke run: one seed, small budgets
    python bench/learning.py --cases sac-pendulum --modes one,dist --seeds 5
    python bench/learning.py --cases ppo-cartpole --modes dist --actors 2 --queue amqp --csv runs.csv
    python bench/learning.py --list               # the cases, their budgets and references
    python bench/learning.py --suite first-run    # each algorithm as it comes, on the envs its docs name

Each run trains from scratch with the user-facing defaults of its case (the config the README shows,
or the algorithm's ``Config()`` as it comes) and ends with ``runner.evaluate()`` (20 episodes,
``EVAL_EPISODES`` says why; ``--eval-episodes``). "one" is ``Runner.train`` in this process; "dist" is
``Runner.train_distribution`` on an embedded Redis with the trainer and ``--actors`` actors as local
processes, experience over ``--queue``; "hand" is "dist" the way a user runs it: ``--actors`` ``srl actor``
processes started first, then one ``srl trainer``, each a process of its own on the Redis at ``--redis-url``
(one task name per run), then the client, unseeded (the seed only numbers the run); "central" is "dist" with
central inference (an inference server
acts for the actors, SEED RL's way); "lagged" (off-policy and asynchronous cases) is one process
given a distributed run's data path, so the two can be told apart seed by seed: the worker acts with a
copy of the weights refreshed every ``--lag`` train steps (so up to that old) and hands its transitions
over ``--chunk`` at a time, its segments as they complete (defaults 150 and 128, near what a 1-actor
DQN run shows: params published every 100 train steps and picked up within a 0.1 s poll; a
rate-limited actor's batches of up to 256 rows, 103 on average; a 2-actor IMPALA run's segments are
about 40 train steps old at p95), reproducible from its seed. Seeds are 0..N-1 (``--first-seed`` moves them): in one
process a seed fixes the run (on one kind of CPU: another's floating-point kernels can sum in another
order and send the run elsewhere); in a distributed run it fixes the initial weights, each actor's envs
and exploration, but not the interleaving of processes, so two runs of one seed differ.

The table gives each row's budget, the distribution of the evaluations over the seeds (median,
interquartile range, worst, and how many runs ended below the case's floor), the median env
steps and wall time (and, for distributed CartPole rows, wall seconds per env step ÷ distributed sync
PPO's in the same run: the budgets differ, so whole wall times are not compared), env steps and train
steps per second, the target and floor (a row meets them when its median reaches the target and no
run is below the floor), and the published references for the same env, each with the env steps
it was reached at (RLlib's are pass bars of its tuned examples, not results). ``--quick`` runs below
those budgets, so its table leaves the reference and the verdict out.
``--csv`` writes one row per run. Run nothing else on the machine meanwhile: rates are wall-clock.

The first-run suite (``--suite first-run``) is what a new user tries first: every algorithm's ``Config()`` as it
comes (the recurrent ones with ``recurrent="lstm"``) on the envs its docs name (DQN and SAC: CartPole, Acrobot,
Pendulum; PPO and IMPALA: those and MinAtar Breakout; recurrent PPO and IMPALA, R2D2: CartPoleNoVel, and
PendulumNoVel for Box actions; R2D2 and DQN: MinAtar Breakout), at the budgets the docs give, 10 seeds a row, in
one process and with hand-started nodes. A row passes when its median reaches the target and no run ends below
its floor (CartPole-family: 400, DQN's 300; MinAtar Breakout: 5x random; elsewhere a level a learning run passes
and a random policy does not). The whole suite takes days on 2 cores; ``--cases`` and ``--seeds`` take a part.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srl
from srl.algorithms import dqn, impala, ppo, r2d2, sac
from srl.base.config import ConfigError, config_from_dict, config_to_dict
from srl.base.rl import RLConfig
from srl.base.rollout import Rollout
from srl.rl.blocks import MLPBlockConfig
from srl.runner.distribution import RedisParameters
from srl.runner.distribution.board.board import Board
from srl.runner.progress import reward_summary
from srl.runner.run_log import RunLog


def dqn_readme() -> dqn.Config:
    """The README's seed config: Pendulum-v1 DQN, 64x64, proportional replay of 5,000."""
    config = dqn.Config()
    config.hidden_block.set_mlp((64, 64))
    config.memory.set_proportional_memory()
    config.memory.capacity = 5000
    return config


def dqn_minatar() -> dqn.Config:
    """DQN on MinAtar as the MinAtar paper's DQN learns (Young & Tian 2019): batches of 32, a train step
    every 4 env steps, the target copied every 1,000 train steps, a replay of 100,000 (here prioritized,
    with Ape-X's n-step 3 and ε per actor: one env an actor, as its rows were measured); the network is srl's
    "auto" for 10x10 grids (the paper's)."""
    config = dqn.Config(batch_size=32, env_steps_per_train=4.0, target_update_interval=1000, warmup_size=5000,
                        envs_per_actor=1)
    config.memory.capacity = 100_000
    return config


def ppo_lstm() -> ppo.Config:
    """Recurrent PPO with RL Zoo ppo_lstm's layers for the NoVel envs in the order srl first had them: an LSTM
    per head (128 units here, 64 there) after one ReLU layer of 64 (the Zoo's cell reads the observations
    and its layer comes after: ``cell_first``, the preset now), observations normalized; the rest
    ``ppo.Config()``'s Discrete preset (the Zoo's CartPoleNoVel settings: 32 steps x 8 envs, 20 epochs, lr
    1e-3 annealed). Every field set, so its rows in the docs reproduce whatever the presets are."""
    return ppo.Config(recurrent="lstm", normalize_obs=True, hidden_block=MLPBlockConfig((64,), "relu"),
                      cell_first=False)


def ppo_lstm_default() -> ppo.Config:
    """``ppo.Config(recurrent="lstm")`` as it comes: over Discrete vectors the recurrent preset (RL Zoo
    ppo_lstm's network: the cells read the normalized observations, one ReLU layer of 64 after each), over
    Box the Box preset with two tanh layers of 64 per head before the cells."""
    return ppo.Config(recurrent="lstm")


def impala_lstm() -> impala.Config:
    """``impala.Config(recurrent="lstm")`` as it comes."""
    return impala.Config(recurrent="lstm")


def r2d2_small() -> r2d2.Config:
    """R2D2 for a budget of 10^5 env steps: the paper's settings but a learning rate of 5e-4 and the target
    copied every 500 train steps (the paper's 1e-4 and 2,500 are made for 10^9 frames: at 300k env steps
    that is 3 target copies)."""
    return r2d2.Config(lr=5e-4, target_update_interval=500)


def r2d2_default() -> r2d2.Config:
    """``r2d2.Config()`` as it comes."""
    return r2d2.Config()


def ppo_lunarlander() -> ppo.Config:
    """PPO as RL Zoo runs LunarLander (its 242 @ 1M is with these): 16 envs (2 actors x 8) x 1,024 steps,
    minibatches of 64 (256 a pass), 4 passes, lr 3e-4 held constant, gamma 0.999, GAE lambda 0.98, entropy
    0.01; the network and the rest ``ppo.Config()`` as it comes (two tanh layers of 64 per head)."""
    return ppo.Config(segment_length=1024, minibatches=256, epochs=4, lr=3e-4, anneal_lr=False, gamma=0.999,
                      gae_lambda=0.98, ent_coef=0.01)


def appo() -> ppo.Config:
    """Asynchronous PPO: ``ppo.Config(sync=False)``, everything else as it comes."""
    return ppo.Config(sync=False)


CARTPOLE_NOVEL = "srl/CartPoleNoVel-v1"
PENDULUM_NOVEL = "srl/PendulumNoVel-v1"
ACROBOT_NOVEL = "srl/AcrobotNoVel-v1"
MINATAR_BREAKOUT = "MinAtar/Breakout-v1"
RANDOM_MINATAR_BREAKOUT = 0.41
"""the mean return of uniform random actions on MinAtar Breakout-v1 (300 episodes, seeds 0..299)"""
RANDOM_MINATAR = {"SpaceInvaders": 4.25, "Asterix": 0.50}
"""the same for the MinAtar games PPO's grids preset was checked on, not chosen on (docs/benchmarks.md)"""


@dataclass(frozen=True)
class Reference:
    """A published figure and the env steps it was reached at (a train-step budget is not comparable)."""
    figure: str
    env_steps: str
    pass_bar: bool = False
    """the figure is a tuned example's stopping threshold, passed within ``env_steps``, not a result"""
    note: str = ""

    def __str__(self) -> str:
        at = f"within {self.env_steps} env steps (pass bar)" if self.pass_bar else f"@ {self.env_steps} env steps"
        return f"{self.figure} {at}" + (f", {self.note}" if self.note else "")


@dataclass(frozen=True)
class Case:
    name: str
    env: str
    make_config: Callable[[], RLConfig]
    budget: str
    """"train:N" (gradient steps) or "steps:N" (env steps)"""
    references: tuple[Reference, ...]
    """published figures for the same env, each with its budget: none where none was found with one"""
    target: float
    quick_budget: str
    needs: str = ""
    """a module that must be importable (Box2D for LunarLander)"""
    floor: float | None = None
    """no run should end below this: the table counts the runs that do (None: no floor set)"""

    @property
    def reference(self) -> str:
        return "; ".join(map(str, self.references)) or "none cited"


CASES = {case.name: case for case in [
    Case("dqn-pendulum", "Pendulum-v1", dqn_readme, "train:20000", (), -160.0, "train:3000", floor=-250.0),
    Case("dqn-cartpole", "CartPole-v1", dqn.Config, "train:50000",
         (Reference("SB3 zoo DQN 500", "50k"), Reference("CleanRL DQN ~488", "500k"),
          Reference("SB3 with the zoo's settings, 20 seeds (bench/reference_dqn.py): median 500, 7 below 300", "50k")),
         475.0, "train:3000", floor=300.0),
    Case("dqn-acrobot", "Acrobot-v1", dqn.Config, "train:30000",
         (Reference("SB3 zoo DQN -72", "100k"), Reference("CleanRL DQN ~-91", "500k")),
         -100.0, "train:3000", floor=-150.0),
    Case("ppo-cartpole", "CartPole-v1", ppo.Config, "steps:100000",
         (Reference("SB3 zoo PPO 500", "100k"), Reference("CleanRL PPO ~490", "500k")),
         475.0, "steps:20000", floor=400.0),
    Case("ppo-pendulum", "Pendulum-v1", ppo.Config, "steps:200000",
         (Reference("SB3 zoo PPO -172", "100k", note="with gSDE (ours: 200k, no gSDE)"),), -250.0, "steps:20000",
         floor=-400.0),
    Case("appo-cartpole", "CartPole-v1", appo, "steps:200000",
         (Reference("RLlib tuned APPO 450", "2M", pass_bar=True),), 475.0, "steps:20000", floor=400.0),
    Case("impala-cartpole", "CartPole-v1", impala.Config, "steps:300000",
         (Reference("RLlib tuned IMPALA 150 (older) / 450 (newer)", "50M", pass_bar=True),), 475.0,
         "steps:20000", floor=400.0),
    Case("impala-acrobot", "Acrobot-v1", impala.Config, "steps:300000", (), -100.0, "steps:20000", floor=-150.0),
    Case("sac-pendulum", "Pendulum-v1", sac.Config, "train:20000",
         (Reference("RL Zoo SAC -157.0 ± 88.7", "20k"),), -160.0, "train:2000", floor=-250.0),
    Case("sac-lunarlander-box", "LunarLanderContinuous-v3", sac.Config, "train:200000",
         (Reference("RL Zoo SAC 260.4 ± 65.5", "500k"),), 200.0, "train:5000", needs="Box2D", floor=100.0),
    Case("sac-halfcheetah", "HalfCheetah-v5", sac.Config, "train:300000",
         (Reference("CleanRL SAC ~9,600", "1M"), Reference("RL Zoo SAC 9,535 (HalfCheetah-v3)", "1M")), 5000.0,
         "train:5000", needs="mujoco"),
    Case("ppo-lunarlander", "LunarLander-v3", ppo_lunarlander, "steps:1000000",
         (Reference("RL Zoo PPO 242", "1M"),), 200.0, "steps:20000", needs="Box2D", floor=100.0),
    Case("dqn-lunarlander", "LunarLander-v3", dqn.Config, "train:200000",
         (Reference("SB3 zoo DQN 210", "100k"),), 200.0, "train:5000", needs="Box2D"),
    Case("dqn-mountaincar", "MountainCar-v0", dqn.Config, "train:30000",
         (Reference("SB3 DQN with the zoo's tuned settings -101", "120k"),), -110.0, "train:3000"),
    Case("dqn-lunarlander-box", "LunarLanderContinuous-v3", dqn.Config, "train:50000",
         (), 0.0, "train:3000", needs="Box2D"),
    Case("ppo-minatar", MINATAR_BREAKOUT, ppo.Config, "steps:5000000",
         (Reference("MinAtar paper AC(λ) and DQN learning curves (Young & Tian 2019, fig. 2)", "5M"),
          Reference("gymnax-blines PPO 28 on gymnax's Breakout-MinAtar", "10M")), 20.0,
         "steps:50000", needs="minatar", floor=5 * RANDOM_MINATAR_BREAKOUT),
    *(Case(f"ppo-minatar-{game.lower()}", f"MinAtar/{game}-v1", ppo.Config, "steps:2000000",
           (Reference(f"5x the random policy's {random} (measured: 300 episodes)", "-"),), 5 * random,
           "steps:50000", needs="minatar") for game, random in RANDOM_MINATAR.items()),
    Case("dqn-minatar", MINATAR_BREAKOUT, dqn_minatar, "steps:2000000",
         (Reference("MinAtar paper DQN learning curve (Young & Tian 2019, fig. 2)", "5M"),), 10.0,
         "steps:20000", needs="minatar"),
    Case("impala-minatar", MINATAR_BREAKOUT, impala.Config, "steps:3000000",
         (Reference(f"5x the random policy's {RANDOM_MINATAR_BREAKOUT} (measured: 300 episodes)", "-"),),
         5 * RANDOM_MINATAR_BREAKOUT, "steps:50000", needs="minatar", floor=5 * RANDOM_MINATAR_BREAKOUT),
    Case("ppo-lstm-cartpolenovel", CARTPOLE_NOVEL, ppo_lstm, "steps:100000",
         (Reference("RL Zoo ppo_lstm 500 ± 0", "100k"),), 475.0, "steps:20000"),
    Case("ppo-lstm-default-cartpolenovel", CARTPOLE_NOVEL, ppo_lstm_default, "steps:100000",
         (Reference("RL Zoo ppo_lstm 500 ± 0", "100k"),), 475.0, "steps:20000", floor=400.0),
    Case("ppo-cartpolenovel", CARTPOLE_NOVEL, ppo.Config, "steps:100000",
         (Reference("feed-forward: expected to fail", "-"),), 475.0, "steps:20000"),
    Case("r2d2-cartpolenovel", CARTPOLE_NOVEL, r2d2_small, "steps:300000", (), 475.0, "steps:20000"),
    Case("ppo-lstm-pendulumnovel", PENDULUM_NOVEL, ppo_lstm_default, "steps:500000",
         (Reference("RL Zoo ppo_lstm -217.9 ± 140.1", "100k", note="with gSDE"),), -300.0, "steps:20000", floor=-400.0),
    Case("ppo-pendulumnovel", PENDULUM_NOVEL, ppo.Config, "steps:500000",
         (Reference("feed-forward: expected to fail", "-"),), -300.0, "steps:20000"),
    Case("impala-lstm-minatar", MINATAR_BREAKOUT, impala_lstm, "steps:1000000",
         (Reference(f"5x the random policy's {RANDOM_MINATAR_BREAKOUT} (measured: 300 episodes)", "-"),),
         5 * RANDOM_MINATAR_BREAKOUT, "steps:50000", needs="minatar"),
    # the first-run suite's own cases: each algorithm's Config() as it comes, where the cases above set fields
    Case("dqn-pendulum-default", "Pendulum-v1", dqn.Config, "train:20000", (), -160.0, "train:3000", floor=-250.0),
    Case("ppo-acrobot", "Acrobot-v1", ppo.Config, "steps:300000",
         (Reference("RL Zoo PPO -74.6 ± 11.5 (sb3/ppo-Acrobot-v1)", "1M"),), -100.0, "steps:20000", floor=-150.0),
    Case("impala-pendulum", "Pendulum-v1", impala.Config, "steps:500000", (), -250.0, "steps:20000",
         floor=-400.0),
    Case("impala-lstm-cartpolenovel", CARTPOLE_NOVEL, impala_lstm, "steps:300000", (), 475.0, "steps:20000",
         floor=400.0),
    Case("impala-lstm-pendulumnovel", PENDULUM_NOVEL, impala_lstm, "steps:500000", (), -300.0, "steps:20000",
         floor=-400.0),
    Case("r2d2-default-cartpolenovel", CARTPOLE_NOVEL, r2d2_default, "steps:300000", (), 475.0, "steps:20000",
         floor=400.0),
    # where R2D2's vector preset was chosen (docs/benchmarks.md, "R2D2 as it comes"): not judged there
    Case("r2d2-cartpole", "CartPole-v1", r2d2_default, "steps:100000", (), 475.0, "steps:20000"),
    Case("r2d2-acrobot", "Acrobot-v1", r2d2_default, "steps:100000", (), -100.0, "steps:20000"),
    # where IMPALA's Box preset was chosen (docs/benchmarks.md, "IMPALA's Box preset"): not judged there
    Case("impala-invdoublependulum", "InvertedDoublePendulum-v5", impala.Config, "steps:1000000", (), 9000.0,
         "steps:20000", needs="mujoco"),
    Case("impala-hopper", "Hopper-v5", impala.Config, "steps:1000000", (), 1000.0, "steps:20000", needs="mujoco"),
    # where the recurrent presets are chosen: Acrobot without its velocities, not judged there
    Case("ppo-lstm-default-acrobotnovel", ACROBOT_NOVEL, ppo_lstm_default, "steps:200000", (), -100.0,
         "steps:20000"),
    Case("ppo-lstm-acrobotnovel", ACROBOT_NOVEL, ppo_lstm, "steps:200000", (), -100.0, "steps:20000"),
    Case("impala-lstm-acrobotnovel", ACROBOT_NOVEL, impala_lstm, "steps:300000", (), -100.0, "steps:20000"),
    # recurrent IMPALA's collapse, looked at where memory is not needed: feed-forward IMPALA learns Acrobot-v1
    Case("impala-lstm-acrobot", "Acrobot-v1", impala_lstm, "steps:100000", (), -100.0, "steps:20000", floor=-150.0),
    Case("dqn-minatar-default", MINATAR_BREAKOUT, dqn.Config, "steps:2000000",
         (Reference("MinAtar paper DQN learning curve (Young & Tian 2019, fig. 2)", "5M"),), 10.0, "steps:20000",
         needs="minatar", floor=5 * RANDOM_MINATAR_BREAKOUT),
    Case("r2d2-minatar", MINATAR_BREAKOUT, r2d2_default, "steps:2000000",
         (Reference(f"5x the random policy's {RANDOM_MINATAR_BREAKOUT} (measured: 300 episodes)", "-"),),
         5 * RANDOM_MINATAR_BREAKOUT, "steps:20000", needs="minatar", floor=5 * RANDOM_MINATAR_BREAKOUT),
]}
FIRST_RUN_CASES = (
    # DQN and SAC: CartPole, Acrobot, Pendulum (SAC: Box actions only)
    "dqn-cartpole", "dqn-acrobot", "dqn-pendulum-default", "sac-pendulum",
    # PPO and IMPALA: CartPole, Acrobot, Pendulum, MinAtar Breakout
    "ppo-cartpole", "ppo-acrobot", "ppo-pendulum", "ppo-minatar",
    "impala-cartpole", "impala-acrobot", "impala-pendulum", "impala-minatar",
    # recurrent PPO and IMPALA, R2D2: CartPoleNoVel, PendulumNoVel for Box actions
    "ppo-lstm-default-cartpolenovel", "impala-lstm-cartpolenovel", "r2d2-default-cartpolenovel",
    "ppo-lstm-pendulumnovel", "impala-lstm-pendulumnovel",
    # R2D2 and DQN: MinAtar Breakout
    "r2d2-minatar", "dqn-minatar-default",
)
"""the first-run suite: each algorithm as it comes (``Config()``, or ``Config(recurrent="lstm")``) on the envs its
docs name, at the budgets the docs give, in one process and with hand-started nodes (what a new user tries first)"""
SUITES = ("standard", "first-run")
STANDARD = [("dqn-pendulum", "one"), ("dqn-pendulum", "dist"), ("dqn-cartpole", "one"), ("dqn-acrobot", "one"),
            ("ppo-cartpole", "one"), ("ppo-cartpole", "dist"), ("ppo-cartpole", "hand"), ("ppo-pendulum", "one"),
            ("appo-cartpole", "dist"),
            ("impala-cartpole", "one"), ("impala-cartpole", "dist"), ("sac-pendulum", "one"), ("sac-pendulum", "dist")]
MODES = ("one", "dist", "hand", "central", "lagged")
HAND_REDIS_URL = "redis://127.0.0.1:6379/0"
"""mode hand's board: a Redis every node reaches (an embedded one lives inside the client, after the nodes)"""
NODE_READY_S = 120.0
"""seconds a hand-started node has to say it is ready (imports on a loaded machine)"""
EVAL_EPISODES = 20
"""episodes of a run's final evaluation: enough that one unlucky episode cannot decide a run. A CartPole
policy that balances for 500 steps but drops one episode at 100 scores 480 over 20 episodes (still above
475), 460 over 10; one Pendulum episode that starts upside down and costs 400 instead of 150 moves 20
episodes' mean by 12.5. More are cheap (an episode is 200-1,000 steps), but a run's training is the cost"""
QUEUES = {
    "redis": lambda: None,
    "amqp": lambda: "amqp://guest:guest@127.0.0.1:5672/",
    "mqtt": lambda: "mqtt://127.0.0.1:1883",
    "pubsub": lambda: "pubsub://srl-bench?emulator_host=127.0.0.1:8085",
}


@dataclass
class Run:
    case: str
    mode: str
    seed: int
    evaluation: float
    wall_s: float
    env_steps: int
    train_count: int


def limits(budget: str) -> dict[str, Any]:
    kind, _, amount = budget.partition(":")
    return {"max_train_count" if kind == "train" else "max_steps": int(amount)}


def set_changes(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """``--set FIELD=JSON`` items as config changes; an item that is not FIELD=JSON is the parser's error."""
    changes: dict[str, Any] = {}
    for item in items:
        name, _, value = item.partition("=")  # no "=": an empty value, which is not JSON either
        try:
            changes[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            parser.error(f"--set takes FIELD=JSON (batch_size=64, 'loss=\"mse\"', value_rescale=true), not {item!r}")
    return changes


def configured(case: Case, changes: dict[str, Any] | None) -> RLConfig:
    """The case's config with ``--set`` changes, built as a task's config is (types checked, nested fields
    as objects); ConfigError names a field the algorithm lacks or a value of the wrong type."""
    config = case.make_config()
    if not changes:
        return config
    return config_from_dict(type(config), merged(config_to_dict(config), changes), where=case.name)


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes``; a nested object changes only the fields it names."""
    out = dict(base)
    for name, value in changes.items():
        out[name] = merged(out[name], value) if isinstance(value, dict) and isinstance(out.get(name), dict) else value
    return out


def laggable(config: RLConfig) -> bool:
    """Whether a run of ``config`` can act with stale weights: off-policy, or on-policy without a handoff per
    version (IMPALA, asynchronous PPO); sync PPO's actors wait for every version, so its rows are never old."""
    path = config.data_path()
    return path.env_steps_per_train is not None or path.max_policy_lag != 0


@dataclass(frozen=True)
class Lagged:
    """Mode lagged's data path (see the module docstring)."""

    lag: int = 150
    """train steps between refreshes of the worker's weights (0: it acts with the trainer's own)"""
    chunk: int = 128
    """transitions handed over at a time (segments go as they complete)"""
    delay: int = 0
    """hand-overs held back before the buffer gets them (a queue's and a FIFO's depth)"""


def train_lagged(runner: srl.Runner, lagged: Lagged, max_train_count: int | None = None,
                 max_steps: int | None = None, curve: float | None = None,
                 log_dir: Path | None = None) -> tuple[int, int]:
    """One process on a distributed run's data path: the worker's weights are a copy refreshed every
    ``lagged.lag`` train steps, its rows reach the buffer ``lagged.chunk`` at a time, ``lagged.delay``
    hand-overs late; one train step per env step as in ``Runner.train`` (on-policy: one whenever a batch
    is in). ``curve``: evaluate the trained weights every that many seconds (5 episodes, as
    ``Runner.train``'s ``eval_interval``) into ``log_dir``'s eval.csv. Returns (env steps, train steps);
    ``runner.evaluate`` then uses the trained weights."""
    lag, chunk, delay = lagged.lag, lagged.chunk, lagged.delay
    config = runner.rl_config = runner.rl_config.settled(runner.env_config)  # as Runner.train does
    spec = runner.spec
    path = config.data_path()
    if not laggable(config):
        raise ValueError(f"mode 'lagged' needs an off-policy or asynchronous case, not sync {config.algorithm}")
    parameter = runner.parameter
    buffer = config.make_buffer(spec)
    trainer = config.make_learner(spec, parameter, buffer)
    trainer.plan(max_steps, max_train_count)
    acting = parameter  # lag 0: the worker acts with the trainer's own weights, as in Runner.train
    if lag > 0:
        acting = config.make_parameter(spec, config.resolve_device())
        acting.from_arrays(parameter.to_arrays())
    worker = config.make_worker(spec, acting, 0, 1, config.seed)
    worker.plan(max_steps, max_train_count)
    env_steps, credit, refreshed = 0, 0.0, 0
    in_transit: deque[dict[str, np.ndarray]] = deque()
    run_log = None if curve is None or log_dir is None else RunLog(log_dir, tensorboard=False)
    next_eval = time.monotonic() + (curve or 0.0)
    with Rollout(runner.env_config, worker, config.envs_per_actor, config.seed, config.vectorization) as rollout:
        while (max_train_count is None or trainer.train_count < max_train_count) and (
                max_steps is None or env_steps < max_steps):
            rollout.step()
            env_steps += rollout.num_envs
            if worker.pending() >= (chunk if path.rows == "transitions" else 1):  # segments: when complete
                rows = worker.take()
                if rows is not None:
                    in_transit.append(rows)
                while len(in_transit) > delay:  # the queue's and the FIFO's batches ahead of these
                    rows = in_transit.popleft()
                    buffer.add(rows, worker.initial_priorities(rows))
            # off-policy: the replay ratio's train steps, as Runner.train; on-policy: one per batch that is in
            credit = math.inf if path.env_steps_per_train is None else credit + path.train_credit(rollout.num_envs)
            while credit >= 1.0:
                stats = trainer.train()
                if stats is None:  # warming up, or waiting for segments
                    credit = 0.0
                    break
                credit -= max(1, stats.gradient_steps)
                if lag > 0 and trainer.train_count - refreshed >= lag:  # a "publication": rows carry its version
                    acting.from_arrays(parameter.to_arrays())
                    refreshed = trainer.train_count
                    parameter.version = acting.version = parameter.version + 1
            if run_log is not None and curve is not None and time.monotonic() >= next_eval:
                rewards = runner.evaluate(max_episodes=5)
                run_log.add_eval({"train_count": trainer.train_count, "env_steps": env_steps,
                                  "version": parameter.version, **reward_summary(rewards, "eval")})
                next_eval = time.monotonic() + curve
    if run_log is not None:
        run_log.close()
    return env_steps, trainer.train_count


class HandNodes:
    """Mode hand's nodes, as a user starts them: ``actors`` ``srl actor`` processes, each up and waiting for a
    task before one ``srl trainer`` starts, all ``--run-once`` on ``redis_url`` under a task name of this run's
    own; their logs go to a temporary directory, shown when a node fails."""

    def __init__(self, redis_url: str, queue_url: str | None, actors: int) -> None:
        self.task_name = f"bench-hand-{uuid.uuid4().hex[:10]}"
        self.redis_url = redis_url
        self.logs = Path(tempfile.mkdtemp(prefix="srl-bench-hand-"))
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        common = ["--url", redis_url, "--task-name", self.task_name, "--run-once",
                  *(["--queue-url", queue_url] if queue_url else [])]
        try:
            for i in range(actors):
                self._start(f"actor-{i}", ["actor", *common], "ready; waiting for a task")
            self._start("trainer", ["trainer", *common], "ready (cuda available")
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, args: list[str], ready: str) -> None:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:  # the child holds its own descriptor
            proc = subprocess.Popen([sys.executable, "-m", "srl.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        self.procs.append((name, proc, log))
        deadline = time.monotonic() + NODE_READY_S
        while ready not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mode hand: {name} ({' '.join(args[:1])}) did not get ready "
                                   f"(exit code {proc.poll()}); its log {log}:\n{tail}")
            time.sleep(0.2)

    def stop(self, grace: float = 60.0) -> None:
        """Wait for the run-once nodes to leave after their task, then interrupt, then kill what is left; then
        remove the task's keys (after the nodes: one that saw them vanish first would stop as on a lost task)."""
        deadline = time.monotonic() + grace
        for _, proc, _ in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        try:
            Board(RedisParameters(url=self.redis_url).connect(), self.task_name).delete_task()
        except Exception as e:  # a board that went away keeps the keys; the next run has a name of its own
            print(f"mode hand: could not remove task {self.task_name}'s keys: {e}", flush=True)
        failed = [(name, proc.returncode, log) for name, proc, log in self.procs if proc.returncode not in (0, None)]
        if not failed:
            shutil.rmtree(self.logs, ignore_errors=True)
        for name, code, log in failed:
            print(f"mode hand: {name} exited with {code}; its log is {log}", flush=True)


def train_run(case: Case, mode: str, seed: int, budget: str, actors: int, queue: str, lagged: Lagged = Lagged(),
              changes: dict[str, Any] | None = None, curve: float | None = None,
              log_dir: Path | None = None, curve_every: int | None = None,
              redis_url: str = HAND_REDIS_URL) -> tuple[srl.Runner, Run]:
    """A runner trained from scratch on ``case`` in ``mode`` with ``seed``, and its run (no evaluation yet).
    ``curve`` / ``curve_every``: evaluate every that many seconds / train steps into ``log_dir``'s eval.csv.
    Mode hand is unseeded, as a user's first run: ``seed`` only numbers it."""
    config = configured(case, changes)
    config.seed = None if mode == "hand" else seed
    runner = srl.Runner(case.env, config)
    started = time.perf_counter()
    if mode == "lagged":
        env_steps, train_count = train_lagged(runner, lagged, **limits(budget), curve=curve, log_dir=log_dir)
    else:
        logging_: dict[str, Any] = {} if curve is None and curve_every is None else {
            "log_dir": log_dir, "eval_interval": curve, "eval_every": curve_every}
        if mode == "one":
            runner.train(progress_interval=None, **logging_, **limits(budget))
        elif mode == "hand":
            nodes = HandNodes(redis_url, QUEUES[queue](), actors)
            try:
                runner.train_distribution(RedisParameters(url=redis_url, task_name=nodes.task_name),
                                          QUEUES[queue](), actor_num=actors, progress_interval=None,
                                          local_processes=False, **logging_, **limits(budget))
            finally:
                nodes.stop()
        else:
            runner.train_distribution(RedisParameters(), QUEUES[queue](), actor_num=actors, progress_interval=None,
                                      inference="central" if mode == "central" else "local", **logging_,
                                      **limits(budget))
        env_steps, train_count = runner.env_steps, runner.train_count
    wall = time.perf_counter() - started
    return runner, Run(case.name, mode, seed, float("nan"), wall, env_steps, train_count)


def run_once(case: Case, mode: str, seed: int, budget: str, actors: int, queue: str, episodes: int = EVAL_EPISODES,
             lagged: Lagged = Lagged(), changes: dict[str, Any] | None = None, curve: float | None = None,
             curve_dir: Path | None = None, curve_every: int | None = None, redis_url: str = HAND_REDIS_URL) -> Run:
    log_dir = None if curve_dir is None else curve_dir / f"{case.name}-{mode}-{seed}"
    if log_dir is not None and log_dir.exists():
        # a run from scratch: a log dir holding an earlier run would be continued (its curve appended to)
        print(f"{case.name} {mode} seed {seed}: replacing the earlier run's files in {log_dir}", flush=True)
        shutil.rmtree(log_dir)
    runner, run = train_run(case, mode, seed, budget, actors, queue, lagged, changes, curve, log_dir, curve_every,
                            redis_url)
    run.evaluation = float(np.mean(runner.evaluate(max_episodes=episodes)))
    if log_dir is not None and (log_dir / "eval.csv").exists():
        with open(log_dir / "eval.csv") as f:
            points = [(int(float(r["env_steps"])), r["eval_mean"]) for r in csv.DictReader(f) if r.get("eval_mean")]
        print(f"{case.name} {mode} seed {seed} curve (env steps: mean evaluation): "
              + ", ".join(f"{steps}: {float(mean):.1f}" for steps, mean in points), flush=True)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="", help=f"comma-separated among {', '.join(CASES)} (default: the "
                                                    "standard suite)")
    parser.add_argument("--modes", default="", help="comma-separated: one, dist, hand, central, lagged (default: the "
                                                    "suite's)")
    parser.add_argument("--suite", default="standard", choices=SUITES,
                        help="without --cases: the standard suite, or first-run (each algorithm as it comes on the "
                        "envs its docs name, one process and hand-started nodes)")
    parser.add_argument("--seeds", type=int, default=10, help="runs with seeds 0..N-1")
    parser.add_argument("--first-seed", type=int, default=0, help="start the seeds here instead of 0")
    parser.add_argument("--eval-episodes", type=int, default=EVAL_EPISODES, help="episodes of the final evaluation")
    parser.add_argument("--actors", type=int, default=2, help="actors of a distributed run")
    parser.add_argument("--queue", default="redis", choices=sorted(QUEUES),
                        help="experience queue of a distributed run")
    parser.add_argument("--redis-url", default=HAND_REDIS_URL,
                        help="mode hand: the Redis its separately started nodes and the client meet on")
    parser.add_argument("--lag", type=int, default=150, help="mode lagged: train steps between weight refreshes "
                        "(0: the trainer's own weights)")
    parser.add_argument("--chunk", type=int, default=128, help="mode lagged: transitions handed over at a time")
    parser.add_argument("--delay", type=int, default=0, help="mode lagged: hand-overs held back before the buffer "
                        "gets them (a queue's depth)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="change a config field of every case run, checked before any runs (repeatable): "
                        "--set batch_size=32, --set 'memory={\"capacity\": 10000}'")
    parser.add_argument("--budget", default=None, metavar="train:N|steps:N",
                        help="every case's budget instead of its own (a study at another length)")
    parser.add_argument("--quick", action="store_true", help="one seed, small budgets: a smoke run")
    parser.add_argument("--csv", default=None, help="write one row per run here")
    parser.add_argument("--curve", type=float, default=None, metavar="SECONDS",
                        help="evaluate every SECONDS during each run (5 episodes) and print the curve")
    parser.add_argument("--curve-every", type=int, default=None, metavar="TRAIN_STEPS",
                        help="evaluate every TRAIN_STEPS train steps instead (5 episodes; one process and dist): "
                        "one process then evaluates at the same points on every machine")
    parser.add_argument("--log-dir", default="bench-runs",
                        help="with --curve or --curve-every: each run's log_dir goes under here")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args()
    if args.list:
        for case in CASES.values():
            print(f"{case.name:<16} {case.env:<15} {case.budget:<13} target {case.target:>6g}  {case.reference}")
        return
    logging.getLogger("srl").setLevel(logging.WARNING)
    if args.cases:
        names = [n.strip() for n in args.cases.split(",") if n.strip()]
        unknown = [n for n in names if n not in CASES]
        if unknown:
            parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
        modes = [m.strip() for m in (args.modes or "one").split(",")]
        plan = [(n, m) for n in names for m in modes]
    else:
        modes = [m.strip() for m in args.modes.split(",")] if args.modes else list(MODES)
        plan = suite_plan(args.suite, modes)
    if unknown_modes := [m for m in modes if m not in MODES]:
        parser.error(f"unknown mode(s) {unknown_modes}; known: {', '.join(MODES)}")
    if synced := sorted({n for n, m in plan if m == "lagged" and not laggable(CASES[n].make_config())}):
        parser.error(f"mode lagged needs an off-policy or asynchronous case; {', '.join(synced)} wait for every "
                     "version (sync)")
    if any(m == "hand" for _, m in plan):
        try:
            RedisParameters(url=args.redis_url).connect().ping()
        except Exception as e:
            parser.error(f"mode hand needs a Redis its nodes reach at --redis-url {args.redis_url}: {e} (start one, "
                         "e.g. redis-server, or leave hand out with --modes)")
    if args.curve_every is not None and (args.curve_every < 1 or any(m == "lagged" for _, m in plan)):
        parser.error("--curve-every takes a positive number of train steps, for one process and dist runs "
                     "(lagged runs: --curve)")
    if not plan:
        parser.error(f"nothing to run: the standard suite has no {args.modes!r} runs; name cases with --cases "
                     "(--list shows them)")
    seeds = 1 if args.quick else args.seeds
    changes = set_changes(parser, args.set)
    for name in dict.fromkeys(n for n, _ in plan):
        try:
            configured(CASES[name], changes)
        except ConfigError as e:
            parser.error(f"--set does not fit case {name}: {e}")
    runs: list[Run] = []
    for name, mode in plan:
        case = CASES[name]
        if case.needs and importlib.util.find_spec(case.needs) is None:
            extra = "box2d" if case.needs == "Box2D" else f"'srl[{case.needs}]'"
            print(f"skipping {name}: {case.needs} is not installed (pip install {extra})", flush=True)
            continue
        budget = args.budget or (case.quick_budget if args.quick else case.budget)
        for seed in range(args.first_seed, args.first_seed + seeds):
            run = run_once(case, mode, seed, budget, args.actors, args.queue, args.eval_episodes,
                           Lagged(args.lag, args.chunk, args.delay), changes, args.curve,
                           None if args.curve is None and args.curve_every is None else Path(args.log_dir),
                           args.curve_every, args.redis_url)
            runs.append(run)
            print(f"{name} {mode} seed {seed}: evaluation {run.evaluation:.1f} in {run.wall_s:.0f}s "
                  f"({run.env_steps} env steps, {run.train_count} train steps)", flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["case", "mode", "seed", "evaluation", "wall_s", "env_steps", "train_count"])
            for r in runs:
                writer.writerow([r.case, r.mode, r.seed, f"{r.evaluation:.2f}", f"{r.wall_s:.2f}", r.env_steps,
                                 r.train_count])
    print_table(runs, args)


def suite_plan(suite: str, modes: list[str]) -> list[tuple[str, str]]:
    """The (case, mode) runs of ``suite`` ("standard" or "first-run") in ``modes``."""
    runs = STANDARD if suite == "standard" else [(n, m) for n in FIRST_RUN_CASES for m in ("one", "hand")]
    return [(n, m) for n, m in runs if m in modes]


def seconds_per_step(group: list[Run]) -> float:
    """Median wall seconds per env step: the budgets differ between cases (and at a train-step budget
    between modes), so wall times are compared per env step, never whole."""
    return statistics.median(r.wall_s / max(r.env_steps, 1) for r in group)


def print_table(runs: list[Run], args: Any) -> None:
    dist = (f"dist = {args.actors} actors over {args.queue}; hand = the same as separately started srl actor and "
            "srl trainer processes, actors first, unseeded")
    quick = "quick: small budgets, so no reference or verdict; " if args.quick else ""
    print(f"\nlearning suite ({quick}evaluation: mean of {args.eval_episodes} episodes; {dist})")
    header = (f"{'case':<16} {'mode':<6} {'budget':<12} {'runs':>4} {'median':>8} {'IQR':>17} {'worst':>8} "
              f"{'<floor':>6} {'env steps':>9} {'wall s':>7} {'s/step ÷ dist PPO':>17} {'env/s':>7} {'train/s':>7} "
              f"{'target':>7} {'floor':>7} {'met':>4}  reference")
    print(header)
    print("-" * len(header))
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.case, r.mode), []).append(r)
    sync_ppo = groups.get(("ppo-cartpole", mode_of_sync := "dist"))
    sync_per_step = seconds_per_step(sync_ppo) if sync_ppo else None
    for (name, mode), group in groups.items():
        case = CASES[name]
        budget = args.budget or (case.quick_budget if args.quick else case.budget)
        evals = [r.evaluation for r in group]
        q1, _, q3 = np.percentile(evals, [25, 50, 75])
        below = "-" if case.floor is None else str(sum(e < case.floor for e in evals))
        wall = statistics.median(r.wall_s for r in group)
        env_steps = statistics.median(r.env_steps for r in group)
        env_rate = statistics.median(r.env_steps / r.wall_s for r in group)
        train_rate = statistics.median(r.train_count / r.wall_s for r in group)
        met = "" if args.quick else "yes" if statistics.median(evals) >= case.target and below in ("-", "0") else "no"
        reference = "" if args.quick else case.reference
        versus = f"{seconds_per_step(group) / sync_per_step:.2f}" if sync_per_step and mode in (mode_of_sync, "hand") \
            and case.env == "CartPole-v1" and not name.startswith("dqn") else "-"
        floor = "-" if case.floor is None else f"{case.floor:g}"
        print(f"{name:<16} {mode:<6} {budget:<12} {len(group):>4} {statistics.median(evals):>8.1f} "
              f"{f'{q1:.1f}..{q3:.1f}':>17} {min(evals):>8.1f} {below:>6} {env_steps:>9.0f} {wall:>7.0f} "
              f"{versus:>17} {env_rate:>7.0f} {train_rate:>7.0f} {case.target:>7g} {floor:>7} {met:>4}  {reference}")

if __name__ == "__main__":
    main()
