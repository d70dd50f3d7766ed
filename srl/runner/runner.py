"""``Runner``: train, evaluate, save and load one algorithm on one env.

Owns: the single-process loop (the same Worker, Trainer and Memory objects the
distributed actor and trainer use) and checkpoints in a safe format. Must
never: hold distributed logic itself; ``train_distribution`` hands over to the
distribution client.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from srl.algorithms import config_class
from srl.base.arrays import load_arrays, save_arrays
from srl.base.config import config_from_dict, config_to_dict
from srl.base.env import EnvConfig, EnvSpec, env_spec
from srl.base.rl import Buffer, DataPath, Parameter, RLConfig, Trainer, TrainStats
from srl.base.rollout import Rollout
from srl.runner.progress import TrainProgress, ensure_logging

if TYPE_CHECKING:
    from srl.runner.distribution.redis_parameters import RedisParameters

logger = logging.getLogger("srl.runner")

FLUSH_TRANSITIONS = 32
"""transitions a one-process worker gathers before they go into the buffer"""
CHECKPOINT_FORMAT = "srl-checkpoint"
CHECKPOINT_VERSION = 2


def seed_everything(seed: int | None) -> None:
    if seed is None:
        return
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
        self._trainer: Trainer | None = None
        self.env_steps = 0
        self.episodes = 0
        self._train_count = 0  # loaded with weights, before a trainer exists

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
        return self._trainer.train_count if self._trainer is not None else self._train_count

    def task_config(self) -> dict[str, Any]:
        """The algorithm, its settings and the env as plain data (what a distributed task carries)."""
        return {
            "algorithm": self.rl_config.algorithm,
            "rl_config": config_to_dict(self.rl_config),
            "env": self.env_config.to_dict(),
        }

    # ---------------------------------------------------------------- train
    def train(
        self,
        max_train_count: int | None = None,
        max_steps: int | None = None,
        timeout: float | None = None,
        progress_interval: float | None = 5.0,
    ) -> None:
        """Train in this process until one limit is reached (at least one is required).

        ``max_train_count``: gradient steps; ``max_steps``: env steps (all envs together);
        ``timeout``: seconds. The same worker, buffer and trainer a distributed run uses, on the
        same data path: rows go into the buffer, and off-policy algorithms train
        ``1 / env_steps_per_train`` steps per env step.
        """
        if max_train_count is None and max_steps is None and timeout is None:
            raise ValueError("train() needs a limit: max_train_count=, max_steps= or timeout=")
        ensure_logging()
        config = self.rl_config
        parameter = self.parameter
        if self._buffer is None:
            self._buffer = config.make_buffer(self.spec)
        if self._trainer is None:
            self._trainer = config.make_trainer(self.spec, parameter, self._buffer)
            self._trainer.train_count = self._train_count
        trainer, buffer = self._trainer, self._buffer
        trainer.plan(None if max_steps is None else self.env_steps + max_steps,
                     None if max_train_count is None else trainer.train_count + max_train_count)
        data_path = config.data_path()
        worker = config.make_worker(self.spec, parameter, 0, 1, config.seed)
        rollout = Rollout(self.env_config, worker, config.envs_per_actor, config.seed, config.vectorization)
        progress = TrainProgress(progress_interval, max_train_count, max_steps, timeout)
        start_train, start_steps = trainer.train_count, self.env_steps
        deadline = None if timeout is None else time.perf_counter() + timeout
        # transitions are handed over in small batches (a buffer add and a priority pass per row would
        # cost more than the step); segments as soon as they are complete
        flush_rows = FLUSH_TRANSITIONS if data_path.rows == "transitions" else 1
        ratio = data_path.env_steps_per_train
        credit = 0.0
        try:
            while True:
                if max_train_count is not None and trainer.train_count - start_train >= max_train_count:
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
                if ratio is None:  # on-policy: train whenever the buffer holds an update's worth
                    self._record(trainer.train(), progress, data_path)
                else:
                    credit += rollout.num_envs / ratio
                    while credit >= 1.0:
                        stats = trainer.train()
                        if stats is None:  # warming up: steps before training starts earn nothing
                            credit = 0.0
                            break
                        credit -= max(1, stats.gradient_steps)
                        self._record(stats, progress, data_path)
                now = time.perf_counter()
                if progress.due(now):
                    logger.info(progress.line(self.env_steps - start_steps, trainer.train_count - start_train,
                                              self.episodes, now))
                if deadline is not None and now >= deadline:
                    break
        finally:
            rollout.close()
        elapsed = progress.elapsed()
        logger.info(
            "train done: %d train steps, %d env steps in %.1fs (%.0f train/s, %.0f env steps/s)",
            trainer.train_count - start_train, self.env_steps - start_steps, elapsed,
            (trainer.train_count - start_train) / max(elapsed, 1e-9),
            (self.env_steps - start_steps) / max(elapsed, 1e-9),
        )

    def _record(self, stats: TrainStats | None, progress: TrainProgress, data_path: DataPath) -> None:
        """Note an update; the params version moves as a distributed trainer's publications would."""
        if stats is None:
            return
        progress.loss = stats.loss
        parameter, trainer = self.parameter, self._trainer
        assert trainer is not None
        if data_path.publish_every == 0:
            parameter.version += 1
        else:
            parameter.version = trainer.train_count // data_path.publish_every

    # ---------------------------------------------------------------- evaluate
    def evaluate(self, max_episodes: int = 10, seed: int | None = None) -> list[float]:
        """Total reward of each of ``max_episodes`` episodes, acting greedily (DQN: ``test_epsilon``;
        PPO: the mean action). Runs ``min(envs_per_actor, max_episodes)`` envs at once, each for a
        fixed share of the episodes, so the result does not favour short episodes."""
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be >= 1, got {max_episodes}")
        config = self.rl_config
        if seed is None and config.seed is not None:
            seed = config.seed + 10_000
        num_envs = min(config.envs_per_actor, max_episodes)
        targets = [(max_episodes + i) // num_envs for i in range(num_envs)]
        worker = config.make_worker(self.spec, self.parameter, 0, 1, seed)
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
        """Write weights and settings as a ``.safetensors`` file (no pickle; the meta says what it is)."""
        meta = {
            "format": CHECKPOINT_FORMAT,
            "format_version": CHECKPOINT_VERSION,
            "train_count": self.train_count,
            "version": self.parameter.version,
            **self.task_config(),
        }
        save_arrays(path, self.parameter.to_arrays(), meta)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Load weights saved by :meth:`save` (or the final params of a distributed run)."""
        meta, arrays = load_arrays(path)
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not an srl checkpoint (format {meta.get('format')!r})")
        if meta.get("algorithm") != self.rl_config.algorithm:
            raise ValueError(
                f"{path} holds {meta.get('algorithm')!r} weights; this runner is {self.rl_config.algorithm!r}"
            )
        self.set_parameter_arrays(arrays, int(meta.get("version", 0)), int(meta.get("train_count", 0)))

    def set_parameter_arrays(self, arrays: dict[str, np.ndarray], version: int, train_count: int) -> None:
        """Replace the weights (``version``: the params version they are; ``train_count``: updates made)."""
        self.parameter.from_arrays(arrays)
        self.parameter.version = version
        self._train_count = train_count
        if self._trainer is not None:
            self._trainer.train_count = train_count
            self._trainer.on_parameters_loaded()

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> Runner:
        """A runner rebuilt from a checkpoint's stored algorithm, settings and env."""
        meta, _ = load_arrays(path)
        rl_config = config_from_dict(config_class(str(meta.get("algorithm"))), meta.get("rl_config", {}))
        runner = cls(EnvConfig.from_dict(meta.get("env", {})), rl_config)
        runner.load(path)
        return runner

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
        """Run this task across processes/machines; see ``srl.runner.distribution.client``."""
        from srl.runner.distribution.client import train_distribution

        train_distribution(
            self, redis_params, queue_params, actor_num=actor_num, max_train_count=max_train_count,
            max_steps=max_steps, timeout=timeout, progress_interval=progress_interval, **options,
        )
