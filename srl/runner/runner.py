"""``Runner``: train, evaluate, save and load one algorithm on one env.

Owns: the single-process loop (the same Worker, Learner and Memory objects the
distributed actor and trainer use) and checkpoints in a safe format. Must
never: hold distributed logic itself; ``train_distribution`` hands over to the
distribution client.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from srl.algorithms import config_class
from srl.base.arrays import load_arrays, save_arrays
from srl.base.checkpoint import build_checkpoint, count_field, saved_rl_config, split_checkpoint, task_config
from srl.base.config import config_from_dict
from srl.base.env import EnvConfig, EnvSpec, env_spec
from srl.base.rl import Buffer, DataPath, Learner, Parameter, RLConfig, TrainStats, budget_note, seed_everything
from srl.base.rollout import Rollout
from srl.runner.progress import TrainProgress, ensure_logging, reward_summary
from srl.runner.run_log import RunLog, write_checkpoint

if TYPE_CHECKING:
    from srl.runner.distribution.settings.redis_parameters import RedisParameters

logger = logging.getLogger("srl.runner")

FLUSH_TRANSITIONS = 32
"""transitions a one-process worker gathers before they go into the buffer"""


def continued_seed(seed: int | None, env_steps: int) -> int | None:
    """The envs' and the explorer's seed for a ``train`` call after ``env_steps`` steps: ``seed`` itself for a
    run's first call, else one derived from both, so a continued run (another ``train`` call, or a resumed
    checkpoint) plays new episode starts and explores anew instead of replaying its first call's."""
    if seed is None or env_steps == 0:
        return seed
    return int(np.random.SeedSequence([seed, env_steps]).generate_state(1)[0] & 0x7FFFFFFF)


class _Rates:
    """Env steps and train steps per second since the previous call."""

    def __init__(self, env_steps: int, train_count: int) -> None:
        self.last = (time.perf_counter(), env_steps, train_count)

    def update(self, env_steps: int, train_count: int) -> tuple[float, float]:
        now = time.perf_counter()
        then, steps, count = self.last
        self.last = (now, env_steps, train_count)
        dt = max(now - then, 1e-9)
        return (env_steps - steps) / dt, (train_count - count) / dt


class Runner:
    """One algorithm on one env: ``Runner("CartPole-v1", dqn.Config())``."""

    def __init__(self, env: str | EnvConfig, rl_config: RLConfig) -> None:
        if not isinstance(rl_config, RLConfig):
            raise TypeError(
                f"rl_config must be an algorithm Config (e.g. dqn.Config()), got {type(rl_config).__name__}"
            )
        self.env_config = EnvConfig.coerce(env)
        self.rl_config = rl_config
        rl_config.validate()
        self._spec: EnvSpec | None = None
        self._parameter: Parameter | None = None
        self._buffer: Buffer | None = None
        self._learner: Learner | None = None
        self.env_steps = 0
        self.episodes = 0
        self._train_count = 0  # loaded with weights, before a learner exists
        self._pending_state: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None  # for the next learner
        self._own_weights = False  # trained here or loaded: a distributed run goes on from them

    # ---------------------------------------------------------------- pieces
    @property
    def spec(self) -> EnvSpec:
        """The env's spaces as the algorithm sees them (EnvError if it cannot act there)."""
        if self._spec is None:
            spec = env_spec(self.env_config)
            self.rl_config.check_spec(spec)
            self._spec = spec
        return self._spec

    @property
    def parameter(self) -> Parameter:
        if self._parameter is None:
            torch.set_num_threads(max(1, self.rl_config.torch_threads))
            seed_everything(self.rl_config.seed)
            self._parameter = self.rl_config.make_parameter(self.spec, self.rl_config.resolve_device())
        return self._parameter

    @property
    def train_count(self) -> int:
        """Gradient steps made so far (continued from a checkpoint or a distributed run)."""
        return self._learner.train_count if self._learner is not None else self._train_count

    def replica(self) -> Runner:
        """A runner of the same env and settings with weights, env and worker of its own (an evaluator's)."""
        return type(self)(self.env_config, self.rl_config)

    def task_config(self) -> dict[str, Any]:
        """The algorithm, its settings and the env as plain data (what a distributed task carries)."""
        return task_config(self.rl_config, self.env_config)

    # ---------------------------------------------------------------- train
    def train(
        self,
        max_train_count: int | None = None,
        max_steps: int | None = None,
        timeout: float | None = None,
        progress_interval: float | None = 5.0,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        eval_interval: float | None = None,
        eval_every: int | None = None,
        eval_episodes: int = 5,
        checkpoint_interval: float | None = 600.0,
        keep_checkpoints: int = 5,
        progress_bar: bool | None = None,
        callback: Callable[[Runner], object] | None = None,
        callback_every: int = 1000,
    ) -> None:
        """Train in this process until one limit is reached (at least one is required).

        ``max_train_count``: gradient steps; ``max_steps``: env steps (all envs together);
        ``timeout``: seconds. The same worker, buffer and trainer a distributed run uses, on the
        same data path: rows go into the buffer, and off-policy algorithms train
        ``1 / env_steps_per_train`` steps per env step. A later call goes on with the same weights, memory
        and counters; its envs start new episodes, seeded from ``seed`` and the env steps so far (the first
        call's starts are not replayed).

        ``log_dir``: keep ``history.csv`` (a row per ``progress_interval``, 5 s if that is None),
        ``eval.csv``, TensorBoard events and ``checkpoints/`` (every ``checkpoint_interval`` seconds
        and at the end, the newest ``keep_checkpoints``; weights, optimizer state and counters) there;
        a directory that already holds a run's files is continued. ``eval_interval`` (seconds) /
        ``eval_every`` (train steps): evaluate ``eval_episodes`` episodes that often (into eval.csv,
        the history and the progress). ``progress_bar``: a tqdm bar instead of progress lines
        (default: when stderr is a terminal and tqdm is installed).

        ``callback``: called with this runner each time the train count passes a multiple of
        ``callback_every`` train steps (checked after each env step's training), in the loop: it may read
        ``parameter``, ``train_count`` and ``env_steps``, or ``evaluate()``; returning a false value other than
        None (False) ends the call there, as a limit would.
        """
        if max_train_count is None and max_steps is None and timeout is None:
            raise ValueError("train() needs a limit: max_train_count=, max_steps= or timeout=")
        if eval_episodes < 1:
            raise ValueError(f"eval_episodes must be >= 1, got {eval_episodes}")
        if callback_every < 1:
            raise ValueError(f"callback_every must be >= 1 train step, got {callback_every}")
        ensure_logging()
        config = self.rl_config = self.rl_config.settled(self.env_config)
        parameter = self.parameter
        if self._buffer is None:
            self._buffer = config.make_buffer(self.spec)
        if self._learner is None:
            self._learner = config.make_learner(self.spec, parameter, self._buffer)
            self._learner.train_count = self._train_count
            if self._pending_state is not None:
                self._learner.load_state_arrays(*self._pending_state)
                self._pending_state = None
        learner, buffer = self._learner, self._buffer
        self._own_weights = True
        run_log = RunLog(log_dir) if log_dir is not None else None
        log_every = progress_interval or 5.0
        next_log = time.perf_counter() + log_every
        next_checkpoint = None if checkpoint_interval is None else time.perf_counter() + checkpoint_interval
        next_eval_time = None if eval_interval is None else time.perf_counter() + eval_interval
        next_eval_count = None if eval_every is None else learner.train_count + eval_every
        next_callback = (learner.train_count // callback_every + 1) * callback_every
        last_eval: float | None = None
        rates = _Rates(self.env_steps, learner.train_count)
        planned = (None if max_steps is None else self.env_steps + max_steps,
                   None if max_train_count is None else learner.train_count + max_train_count)
        learner.plan(*planned, self.env_steps)
        if (note := budget_note(config, *planned)) is not None:
            logger.info("%s", note)
        data_path = config.resolved(self.spec).data_path()
        parameter.version = max(parameter.version, DataPath.FIRST_VERSION)  # as a trainer's first publication
        seed = continued_seed(config.seed, self.env_steps)
        worker = config.make_worker(self.spec, parameter, 0, 1, seed)
        worker.plan(*planned)
        rollout = Rollout(self.env_config, worker, config.envs_per_actor, seed, config.vectorization)
        progress = TrainProgress(progress_interval, max_train_count, max_steps, timeout, bar=progress_bar)
        start_train, start_steps = learner.train_count, self.env_steps
        deadline = None if timeout is None else time.perf_counter() + timeout
        # transitions are handed over in small batches (a buffer add and a priority pass per row would
        # cost more than the step); segments as soon as they are complete
        flush_rows = FLUSH_TRANSITIONS if data_path.rows == "transitions" else 1
        credit = 0.0
        try:
            while True:
                if max_train_count is not None and learner.train_count - start_train >= max_train_count:
                    break
                if max_steps is not None and self.env_steps - start_steps >= max_steps:
                    break
                episodes = rollout.step()
                self.env_steps += rollout.num_envs
                for episode in episodes:
                    self.episodes += 1
                    progress.rewards.append(episode.total_reward)
                if worker.pending() >= flush_rows or (episodes and worker.pending()):
                    rows = worker.take()
                    if rows is not None:
                        buffer.add(rows, worker.initial_priorities(rows))
                if data_path.env_steps_per_train is None:  # on-policy: train whenever an update's worth is in
                    self._record(learner.train(), progress, data_path)
                else:
                    credit += data_path.train_credit(rollout.num_envs)
                    while credit >= 1.0:
                        stats = learner.train()
                        if stats is None:  # warming up: steps before training starts earn nothing
                            credit = 0.0
                            break
                        credit -= max(1, stats.gradient_steps)
                        self._record(stats, progress, data_path)
                if callback is not None and learner.train_count >= next_callback:
                    next_callback = (learner.train_count // callback_every + 1) * callback_every
                    answer = callback(self)
                    if answer is not None and not answer:
                        break
                now = time.perf_counter()
                if progress.due(now):
                    progress.report(self.env_steps - start_steps, learner.train_count - start_train,
                                    self.episodes, now)
                if (next_eval_time is not None and now >= next_eval_time) or (
                        next_eval_count is not None and learner.train_count >= next_eval_count):
                    last_eval = self._evaluate_during_training(eval_episodes, run_log, progress)
                    now = time.perf_counter()
                    next_eval_time = None if eval_interval is None else now + eval_interval
                    next_eval_count = None if eval_every is None else learner.train_count + eval_every
                if run_log is not None and now >= next_log:
                    next_log = now + log_every
                    run_log.add_history(self._history_row(progress, rates, last_eval))
                if run_log is not None and next_checkpoint is not None and now >= next_checkpoint:
                    next_checkpoint = now + (checkpoint_interval or 0.0)
                    self._checkpoint(run_log, keep_checkpoints)
                if deadline is not None and now >= deadline:
                    break
            rows = worker.take() if worker.pending() else None  # what this call's worker completed last
            if rows is not None:
                buffer.add(rows, worker.initial_priorities(rows))
        finally:
            rollout.close()
            progress.close()
            if run_log is not None:
                run_log.add_history(self._history_row(progress, rates, last_eval))
                if checkpoint_interval is not None:
                    self._checkpoint(run_log, keep_checkpoints)
                run_log.close()
        elapsed = progress.elapsed()
        logger.info(
            "train done: %d train steps, %d env steps in %.1fs (%.0f train/s, %.0f env steps/s)",
            learner.train_count - start_train, self.env_steps - start_steps, elapsed,
            (learner.train_count - start_train) / max(elapsed, 1e-9),
            (self.env_steps - start_steps) / max(elapsed, 1e-9),
        )

    def _evaluate_during_training(self, episodes: int, run_log: RunLog | None, progress: TrainProgress) -> float:
        rewards = self.evaluate(max_episodes=episodes)
        row = {"train_count": self.train_count, "env_steps": self.env_steps, "version": self.parameter.version,
               **reward_summary(rewards, "eval")}
        if run_log is not None:
            run_log.add_eval(row)
        progress.eval = float(np.mean(rewards))
        logger.info("evaluation at train %d, env steps %d: %.1f (min %.1f, max %.1f over %d episodes)",
                    self.train_count, self.env_steps, np.mean(rewards), min(rewards), max(rewards), len(rewards))
        return float(np.mean(rewards))

    def _history_row(self, progress: TrainProgress, rates: _Rates, last_eval: float | None) -> dict[str, Any]:
        env_rate, train_rate = rates.update(self.env_steps, self.train_count)
        return {
            "train_count": self.train_count, "env_steps": self.env_steps, "episodes": self.episodes,
            **reward_summary(list(progress.rewards), "reward"), "eval_mean": last_eval,
            "env_steps_per_s": round(env_rate, 2), "train_per_s": round(train_rate, 2),
            "version": self.parameter.version,
            **{k: v for k, v in progress.stats.items() if k not in ("gradient_steps",)},
        }

    def _checkpoint(self, run_log: RunLog, keep: int) -> None:
        write_checkpoint(run_log.checkpoint_dir, self.train_count, *self._checkpoint_contents(), keep)

    def _record(self, stats: TrainStats | None, progress: TrainProgress, data_path: DataPath) -> None:
        """Note an update; the params version moves as a distributed trainer's publications would."""
        if stats is None:
            return
        progress.loss = stats.loss
        progress.stats = stats.scalars()
        parameter, learner = self.parameter, self._learner
        assert learner is not None
        parameter.version = data_path.next_version(parameter.version, learner.train_count)

    # ---------------------------------------------------------------- evaluate
    def evaluate(self, max_episodes: int = 10, seed: int | None = None) -> list[float]:
        """Total reward of each of ``max_episodes`` episodes, acting greedily (DQN: ``test_epsilon``;
        PPO: the mean action). Runs ``min(envs_per_actor, max_episodes)`` envs at once (a worker of as many),
        each for a fixed share of the episodes, so the result does not favour short episodes."""
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be >= 1, got {max_episodes}")
        config = self.rl_config
        if seed is None and config.seed is not None:
            seed = config.seed + 10_000
        num_envs = min(config.envs_per_actor, max_episodes)
        targets = [(max_episodes + i) // num_envs for i in range(num_envs)]
        worker = dataclasses.replace(config, envs_per_actor=num_envs).make_worker(self.spec, self.parameter, 0, 1, seed)
        worker.training = False
        done = [0] * num_envs
        rewards: list[list[float]] = [[] for _ in range(num_envs)]
        with Rollout(self.env_config, worker, num_envs, seed, config.vectorization) as rollout:
            while any(d < t for d, t in zip(done, targets, strict=True)):
                for episode in rollout.step():
                    i = episode.env_index
                    if done[i] < targets[i]:
                        rewards[i].append(episode.total_reward)
                        done[i] += 1
        return [r for per_env in rewards for r in per_env]

    # ---------------------------------------------------------------- checkpoints
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write weights, settings, counters and (once trained here) the trainer's state (optimizer,
        target network, running statistics) as one ``.safetensors`` file: no pickle, the meta says what
        it is. ``load`` / ``from_checkpoint`` read it back; training then goes on where it stopped."""
        save_arrays(path, *self._checkpoint_contents())

    def _checkpoint_contents(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return build_checkpoint(self.parameter, self._learner, self.task_config(), self.train_count, self.env_steps,
                                self.episodes, self._pending_state)

    def own_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """What this runner has to go on from, as a checkpoint's ``(meta, arrays)``: its weights, the trainer's
        state and its counters, once it trained here or loaded weights (:meth:`load`, a distributed run's final
        params); None while its weights are as built. ``train_distribution`` starts its trainer from it."""
        if not self._own_weights:
            return None
        arrays, meta = self._checkpoint_contents()
        return meta, arrays

    def load(self, path: str | os.PathLike[str]) -> None:
        """Load a checkpoint written by :meth:`save` (or by a distributed trainer): the weights, the
        counters, and the trainer's state for the next ``train`` when the file holds it."""
        meta, arrays = load_arrays(path)
        self.load_checkpoint(meta, arrays, str(path))

    def load_checkpoint(self, meta: dict[str, Any], arrays: dict[str, np.ndarray], source: str = "checkpoint") -> None:
        """Apply a checkpoint's ``(meta, arrays)`` (see :meth:`load`)."""
        weights, state = split_checkpoint(meta, arrays, self.rl_config, source, self.spec)
        self.set_parameter_arrays(weights, count_field(meta, "version"), count_field(meta, "train_count"))
        self.env_steps, self.episodes = count_field(meta, "env_steps"), count_field(meta, "episodes")
        if state is not None:
            if self._learner is not None:
                self._learner.load_state_arrays(*state)
            else:
                self._pending_state = state

    def set_parameter_arrays(self, arrays: dict[str, np.ndarray], version: int, train_count: int) -> None:
        """Replace the weights (``version``: the params version they are; ``train_count``: updates made)."""
        self.parameter.from_arrays(arrays)
        self.parameter.version = version
        self._own_weights = True
        self._train_count = train_count
        if self._learner is not None:
            self._learner.train_count = train_count
            self._learner.on_parameters_loaded()

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> Runner:
        """A runner rebuilt from a checkpoint's stored algorithm, settings and env."""
        meta, _ = load_arrays(path)
        config_cls = config_class(str(meta.get("algorithm")))
        rl_config = config_from_dict(config_cls, saved_rl_config(meta, config_cls))
        runner = cls(EnvConfig.from_dict(meta.get("env", {})), rl_config)
        runner.load(path)
        return runner

    def plot(self, log_dir: str | os.PathLike[str]) -> list[Path]:
        """PNGs of the run kept in ``log_dir`` (see ``srl.runner.plot``; needs ``srl[plot]``)."""
        from srl.runner.plot import plot

        return plot(log_dir)

    # ---------------------------------------------------------------- distributed
    def train_distribution(
        self,
        redis_params: RedisParameters,
        queue_params: Any = None,
        actor_num: int = 1,
        max_train_count: int | None = None,
        max_steps: int | None = None,
        timeout: float | None = None,
        progress_interval: float | None = 5.0,
        **options: Any,
    ) -> None:
        """Run this task across processes/machines; see ``srl.runner.distribution.client.train``. A runner that
        trained here or loaded weights goes on from them, as :meth:`train` would: the trainer starts from its
        weights, trainer state and counters, and the limits count from there."""
        from srl.runner.distribution.client.train import train_distribution

        train_distribution(
            self, redis_params, queue_params, actor_num=actor_num, max_train_count=max_train_count,
            max_steps=max_steps, timeout=timeout, progress_interval=progress_interval, **options,
        )
