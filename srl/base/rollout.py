"""The env step loop, written once: E envs (a gymnasium vector env) driven by one worker.

Owns: ``Rollout`` — building the vector env (``VECTORIZATIONS``: for ALE games
under the Atari preprocessing with several envs ale-py's own C++ vector env by
default, ``srl.base.ale_vector``; otherwise gymnasium's, sync by default or
async, one process per env, where the env itself is slow) with same-step autoreset (an
env whose episode ends is reset at once and alone: the others never notice),
turning observations into what algorithms see, asking the worker for all E
actions at once (batched inference), telling it what happened (the final
observation of an ended episode, not the reset one; while it trains, the
preprocessing's training signal: clipped rewards, a lost life as a terminal
step), and counting episodes with the env's own rewards and ends (full games,
real scores).
It serves ``Runner.train``, ``Runner.evaluate`` and the distributed actor.
Must never: learn, send anything, or know which algorithm runs.

The loop that uses it::

    rollout = Rollout(env_config, worker, num_envs=8, seed=0)
    while running:
        episodes = rollout.step()     # E env steps; the episodes that ended in them
        rows = worker.take()          # finished transitions or segments, or None
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from srl.base.ale_vector import AleVectorEnv, ale_vector_kwargs
from srl.base.env import EnvConfig, EnvError, EnvSpec, ObsTransform, make_spec
from srl.base.preprocessing import PreprocessingError

Vectorization = Literal["auto", "sync", "async", "ale"]
VECTORIZATIONS = ("auto", "sync", "async", "ale")
"""how a Rollout's envs run: "auto" is "ale" for an ALE game under the atari preprocessing with two envs or
more (where ale-py's vector env takes its settings) and "sync" otherwise; "sync" and "async" are
gymnasium's vector envs over gymnasium's wrappers (in turn in this process, or a process per env); "ale"
is ale-py's C++ ``AtariVectorEnv`` (``srl.base.ale_vector``)"""
MAX_ENVS = 4096


@dataclass(frozen=True)
class Episode:
    """One finished episode."""

    env_index: int
    total_reward: float
    length: int


def _make_env(config: EnvConfig, allow_modules: Collection[str] | None) -> gym.Env:
    return config.make(allow_modules=allow_modules)


def resolve_vectorization(env_config: EnvConfig, vectorization: str, num_envs: int) -> str:
    """The vector env ``vectorization`` means for these envs (see ``VECTORIZATIONS``): "auto" resolved,
    "ale" refused with the reason where ale-py's vector env cannot run this env."""
    if vectorization not in VECTORIZATIONS:
        raise EnvError(f"vectorization must be one of {list(VECTORIZATIONS)}, got {str(vectorization)[:40]!r}")
    if vectorization in ("sync", "async"):
        return vectorization
    settings = ale_vector_kwargs(env_config.id, env_config.resolved_preprocessing(), env_config.kwargs)
    if vectorization == "ale" and isinstance(settings, str):
        raise EnvError(f"vectorization 'ale' cannot run {env_config!r}: {settings}; use 'sync' (gymnasium's "
                       "wrappers) for it")
    if vectorization == "auto" and (isinstance(settings, str) or num_envs < 2):
        return "sync"
    return "ale"


class _Spaces:
    """What ``make_spec`` reads from an env: its two spaces."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        self.observation_space = observation_space
        self.action_space = action_space


class Rollout:
    """``num_envs`` copies of an env stepped together by ``worker`` (see the module docstring).

    ``seed`` seeds env i with ``seed + i`` at the first reset (later resets continue their own
    random streams). The worker is told about every episode start (``reset``) and every step
    (``observe``); its ``act`` gets the observations of all envs at once.
    """

    obs: np.ndarray
    """each env's observation now, what the worker acts on next"""

    def __init__(
        self,
        env_config: EnvConfig,
        worker: Any,
        num_envs: int = 1,
        seed: int | None = None,
        vectorization: str = "auto",
        allow_modules: Collection[str] | None = None,
    ) -> None:
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or not 1 <= num_envs <= MAX_ENVS:
            raise EnvError(f"num_envs must be an integer in 1..{MAX_ENVS}, got {num_envs!r}")
        built_for = getattr(worker, "num_envs", num_envs)
        if getattr(worker, "training", False) and built_for != num_envs:
            # a training worker keeps per-env state (n-step windows, segments, ε): it must step as many envs
            # as it was built for; an evaluating one (training False) may step fewer
            raise ValueError(
                f"this {type(worker).__name__} was built for {built_for} env(s) but the Rollout steps {num_envs}: "
                f"pass num_envs=config.envs_per_actor ({built_for}), or set envs_per_actor={num_envs} before "
                "making the worker")
        env_config.check_allowed(allow_modules)
        self.vectorization = resolve_vectorization(env_config, vectorization, num_envs)
        """the vector env these envs run in: "sync", "async" or "ale" (``VECTORIZATIONS``)"""
        fns = [functools.partial(_make_env, env_config, allow_modules) for _ in range(num_envs)]
        if self.vectorization == "ale":
            settings = ale_vector_kwargs(env_config.id, "atari", env_config.kwargs)
            assert isinstance(settings, dict)  # resolve_vectorization chose "ale" only for such envs
            try:
                self.envs: gym.vector.VectorEnv = AleVectorEnv(settings, num_envs)
            except PreprocessingError as e:
                raise EnvError(f"env {env_config.id!r}: {e}") from None
        elif self.vectorization == "sync":
            self.envs = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
        else:
            self.envs = AsyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP, context="fork")
        try:
            self.spec: EnvSpec = make_spec(
                _Spaces(self.envs.single_observation_space, self.envs.single_action_space),  # type: ignore[arg-type]
                env_config.id,
                env_config.frame_stack(),
            )
            self.transform = ObsTransform(self.spec)
            self.signal = env_config.training_signal()
            self.worker = worker
            self.num_envs = num_envs
            self.env_steps = 0
            self.episodes = 0
            self._returns = np.zeros(num_envs, dtype=np.float64)
            self._lengths = np.zeros(num_envs, dtype=np.int64)
            self._lives: np.ndarray | None = None
            """each env's lives after its last step (the training signal cuts the worker's episode at a loss)"""
            self.restart(seed)
        except BaseException:
            self.envs.close()
            raise

    def step(self) -> list[Episode]:
        """One step of every env; the episodes that ended in it."""
        actions = self.worker.act(self.obs)
        next_obs, reward, terminated, truncated, info = self.envs.step(actions)
        next_obs = self.transform.batch(next_obs)
        reward = np.asarray(reward, dtype=np.float32)
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        done = terminated | truncated
        final = next_obs
        if done.any():
            # same-step autoreset: next_obs already holds the new episode's first obs for ended envs
            final = next_obs.copy()
            mask = info.get("_final_obs", done)
            for i in np.flatnonzero(mask):
                final[i] = self.transform.one(info["final_obs"][i])
        if self.signal.active and self.worker.training:
            signal_reward, signal_terminated = self._training_signal(reward, terminated, done, info)
            self.worker.observe(signal_reward, final, signal_terminated, truncated)
        else:
            self.worker.observe(reward, final, terminated, truncated)
        self._returns += reward
        self._lengths += 1
        self.env_steps += self.num_envs
        episodes: list[Episode] = []
        if done.any():
            ended = np.flatnonzero(done)
            for i in ended:
                episodes.append(Episode(int(i), float(self._returns[i]), int(self._lengths[i])))
            self._returns[ended] = 0.0
            self._lengths[ended] = 0
            self.episodes += len(ended)
            self.worker.reset(ended, next_obs[ended])
        self.obs = next_obs
        self.worker.ahead(next_obs)
        return episodes

    @property
    def envs_per_step(self) -> int:
        """The envs one ``step`` steps: every one."""
        return self.num_envs

    def restart(self, seed: int | None = None) -> None:
        """Start every env's episode (``seed``: the first time); again, the episodes going on are dropped,
        not counted: for an actor whose inference server went away, which took its envs' state with it."""
        obs, reset_info = self.envs.reset(seed=seed)
        self.obs = self.transform.batch(obs)
        self._returns[:] = 0.0
        self._lengths[:] = 0
        lives = reset_info.get("lives")
        self._lives = None if lives is None else np.asarray(lives, dtype=np.int64)
        self.worker.reset(np.arange(self.num_envs), self.obs)
        self.worker.ahead(self.obs)

    def _training_signal(self, reward: np.ndarray, terminated: np.ndarray, done: np.ndarray,
                         info: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """The reward and terminal flags a training worker sees (see ``TrainingSignal``)."""
        if self.signal.clip_reward:
            reward = np.sign(reward).astype(np.float32)
        lives = info.get("lives")
        if self.signal.life_loss_terminal and lives is not None:
            lives = np.asarray(lives, dtype=np.int64)
            if self._lives is not None:
                # an env that just ended reports its new game's lives (same-step autoreset): not a loss
                terminated = terminated | ((lives < self._lives) & ~done)
            self._lives = lives
        return reward, terminated

    def close(self) -> None:
        self.envs.close()

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
