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
from srl.base.env import EnvAdapter, EnvConfig, EnvSpec
from srl.base.rl import Parameter, RLConfig, Trainer
from srl.rl.memories import Memory
from srl.runner.progress import TrainProgress, ensure_logging

if TYPE_CHECKING:
    from srl.runner.distribution.redis_parameters import RedisParameters

logger = logging.getLogger("srl.runner")

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
        self._memory: Memory | None = None
        self._trainer: Trainer | None = None
        self.env_steps = 0
        self.episodes = 0
        self._train_count = 0  # loaded with weights, before a trainer exists

    # ---------------------------------------------------------------- pieces
    @property
    def spec(self) -> EnvSpec:
        if self._spec is None:
            env = EnvAdapter(self.env_config, self.rl_config.algorithm, self.rl_config.action_bins)
            self._spec = env.spec
            env.close()
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
        """Train in this process until one limit is reached (at least one is required)."""
        if max_train_count is None and max_steps is None and timeout is None:
            raise ValueError("train() needs a limit: max_train_count=, max_steps= or timeout=")
        ensure_logging()
        config = self.rl_config
        parameter = self.parameter
        if self._memory is None:
            self._memory = config.make_memory(self.spec)
        if self._trainer is None:
            self._trainer = config.make_trainer(self.spec, parameter, self._memory)
            self._trainer.train_count = self._train_count
        trainer, memory = self._trainer, self._memory
        env = EnvAdapter(self.env_config, config.algorithm, config.action_bins, seed=config.seed)
        worker = config.make_worker(self.spec, parameter, 0, 1, config.seed)
        progress = TrainProgress(progress_interval, max_train_count, max_steps, timeout)
        start_train, start_steps = trainer.train_count, self.env_steps
        deadline = None if timeout is None else time.perf_counter() + timeout
        flush_every = max(1, min(32, config.batch_size))

        obs = env.reset()
        worker.on_reset(obs)
        episode_reward = 0.0
        try:
            while True:
                if max_train_count is not None and trainer.train_count - start_train >= max_train_count:
                    break
                if max_steps is not None and self.env_steps - start_steps >= max_steps:
                    break
                action = worker.act(obs)
                next_obs, reward, terminated, truncated = env.step(action)
                worker.on_step(obs, action, reward, next_obs, terminated, truncated)
                self.env_steps += 1
                episode_reward += reward
                done = terminated or truncated
                if done or worker.pending() >= flush_every:
                    columns = worker.take_transitions()
                    if columns is not None:
                        memory.add(columns)
                if done:
                    self.episodes += 1
                    progress.rewards.append(episode_reward)
                    episode_reward = 0.0
                    obs = env.reset()
                    worker.on_reset(obs)
                else:
                    obs = next_obs
                stats = trainer.train()
                if stats is not None:
                    progress.loss = stats.loss
                now = time.perf_counter()
                if progress.due(now):
                    logger.info(progress.line(self.env_steps - start_steps, trainer.train_count - start_train,
                                              self.episodes, now))
                if deadline is not None and now >= deadline:
                    break
        finally:
            env.close()
        elapsed = progress.elapsed()
        logger.info(
            "train done: %d train steps, %d env steps in %.1fs (%.0f train/s, %.0f env steps/s)",
            trainer.train_count - start_train, self.env_steps - start_steps, elapsed,
            (trainer.train_count - start_train) / max(elapsed, 1e-9),
            (self.env_steps - start_steps) / max(elapsed, 1e-9),
        )

    # ---------------------------------------------------------------- evaluate
    def evaluate(self, max_episodes: int = 10, seed: int | None = None) -> list[float]:
        """Total reward of each of ``max_episodes`` episodes, acting with ``test_epsilon``."""
        if max_episodes < 1:
            raise ValueError(f"max_episodes must be >= 1, got {max_episodes}")
        config = self.rl_config
        if seed is None and config.seed is not None:
            seed = config.seed + 10_000
        env = EnvAdapter(self.env_config, config.algorithm, config.action_bins, seed=seed)
        worker = config.make_worker(self.spec, self.parameter, 0, 1, seed)
        worker.training = False
        rewards: list[float] = []
        try:
            for _ in range(max_episodes):
                obs = env.reset()
                worker.on_reset(obs)
                total = 0.0
                while True:
                    action = worker.act(obs)
                    obs, reward, terminated, truncated = env.step(action)
                    total += reward
                    if terminated or truncated:
                        break
                rewards.append(total)
        finally:
            env.close()
        return rewards

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
