"""The environment adapter: gymnasium envs as srl sees them.

Owns: ``EnvConfig`` (which env, with which keyword arguments), building the
env with a clear error when it does not exist, and ``EnvSpec`` — the shapes an
algorithm is built for. Observations are flattened to a float32 vector (a
Discrete observation becomes one-hot); a Box action space is discretized into
a fixed grid of actions for value-based algorithms. Must never: know about
algorithms beyond the spaces they accept, or anything distributed.
"""

from __future__ import annotations

import difflib
import itertools
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np


class EnvError(ValueError):
    """The environment cannot be built or used as asked."""


ALLOW_ENV_MODULES_ENV = "SRL_ALLOW_ENV_MODULES"
"""comma-separated modules whose ``module:Env`` ids a node may build (gymnasium imports the module)"""


def allowed_env_modules(option: str | Collection[str] | None = None) -> frozenset[str]:
    """The modules a node allows in ``module:Env`` ids: ``option`` plus ``$SRL_ALLOW_ENV_MODULES``."""
    names: list[str] = []
    for source in (option, os.environ.get(ALLOW_ENV_MODULES_ENV, "")):
        if not source:
            continue
        names += source.split(",") if isinstance(source, str) else list(source)
    return frozenset(n.strip() for n in names if n.strip())


def env_module(env_id: str) -> str | None:
    """The module gymnasium would import for ``env_id`` (``"pkg.mod:Env-v0"`` -> ``"pkg.mod"``), or None."""
    module, sep, _ = env_id.partition(":")
    return module if sep else None


class EnvConfig:
    """Which gymnasium environment to run: ``EnvConfig("Pendulum-v1", g=9.81)``."""

    def __init__(self, id: str, **kwargs: Any) -> None:
        if not isinstance(id, str) or not id:
            raise EnvError(f"EnvConfig needs a gymnasium id such as 'CartPole-v1', got {id!r}")
        self.id = id
        self.kwargs = dict(kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EnvConfig:
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise EnvError(f"an env config is an object with a text 'id', got {data!r}")
        kwargs = data.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise EnvError(f"env kwargs must be an object, got {kwargs!r}")
        return cls(data["id"], **kwargs)

    @classmethod
    def coerce(cls, env: str | EnvConfig) -> EnvConfig:
        return env if isinstance(env, EnvConfig) else cls(env)

    def check_allowed(self, allow_modules: Collection[str] | None) -> None:
        """Refuse a ``module:Env`` id whose module is not in ``allow_modules`` (None: no restriction).

        Building such an id imports the module, i.e. runs its code: a node that
        reads the env id from the board must not do that for a module it did not allow.
        """
        module = env_module(self.id)
        if module is None or allow_modules is None:
            return
        if any(module == m or module.startswith(m + ".") for m in allow_modules):
            return
        raise EnvError(
            f"env id {self.id!r} would import the module {module!r}, which this node does not allow; "
            f"start the node with --allow-env-modules {module} (or {ALLOW_ENV_MODULES_ENV}={module}) "
            "if you trust it, or register the env in an installed package and use its plain id"
        )

    def make(self, render_mode: str | None = None, allow_modules: Collection[str] | None = None) -> gym.Env:
        """Build the env; an unknown id raises :class:`EnvError` naming close registered ids.

        ``allow_modules``: on a node, the modules a ``module:Env`` id may import (see
        :meth:`check_allowed`); None (a user's own process) allows any.
        """
        self.check_allowed(allow_modules)
        try:
            return gym.make(self.id, render_mode=render_mode, **self.kwargs)
        except gym.error.Error as e:
            known = list(gym.registry.keys())
            close = difflib.get_close_matches(self.id, known, n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise EnvError(
                f"cannot make gymnasium env {self.id!r}: {e}.{hint} "
                "Use a registered id (gymnasium.pprint_registry() lists them) or register yours first."
            ) from e
        except TypeError as e:
            raise EnvError(f"env {self.id!r} rejected its keyword arguments {self.kwargs}: {e}") from e

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"EnvConfig({self.id!r}{args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EnvConfig) and self.to_dict() == other.to_dict()


@dataclass
class EnvSpec:
    """What an algorithm is built for: a flat float observation and ``n_actions`` discrete actions."""

    env_id: str
    obs_shape: tuple[int, ...]
    n_actions: int
    action_values: np.ndarray | None = field(default=None, repr=False)
    """for a discretized Box: row i is the env action of discrete action i"""
    obs_onehot: int = 0
    """for a Discrete observation space: its size (the obs is one-hot encoded)"""


def make_spec(env: gym.Env, env_id: str, algorithm: str, action_bins: int) -> EnvSpec:
    """Check the spaces against what ``algorithm`` takes and describe them."""
    obs_space, act_space = env.observation_space, env.action_space
    onehot = 0
    if isinstance(obs_space, gym.spaces.Box):
        obs_shape: tuple[int, ...] = (int(np.prod(obs_space.shape)),)
    elif isinstance(obs_space, gym.spaces.Discrete):
        onehot = int(obs_space.n)
        obs_shape = (onehot,)
    else:
        raise EnvError(
            f"{algorithm} cannot use the observation space {obs_space} of {env_id!r}: it takes Box or "
            "Discrete observations. Wrap the env (e.g. gymnasium.wrappers.FlattenObservation) and "
            "register the wrapped env under its own id."
        )
    if isinstance(act_space, gym.spaces.Discrete):
        return EnvSpec(env_id, obs_shape, int(act_space.n), None, onehot)
    if isinstance(act_space, gym.spaces.Box):
        if action_bins < 2:
            raise EnvError(f"action_bins must be at least 2 to discretize {act_space} of {env_id!r}, got {action_bins}")
        if not (np.all(np.isfinite(act_space.low)) and np.all(np.isfinite(act_space.high))):
            raise EnvError(
                f"{algorithm} discretizes Box actions but {env_id!r} has unbounded actions {act_space}; "
                "clip the action space with a wrapper first."
            )
        low, high = act_space.low.reshape(-1), act_space.high.reshape(-1)
        n_grid = action_bins ** low.size
        if n_grid > 4096:
            raise EnvError(
                f"discretizing {act_space} of {env_id!r} with {action_bins} bins per dimension gives {n_grid} "
                "actions (more than 4096); lower action_bins or use an algorithm for continuous actions."
            )
        axes = [np.linspace(lo, hi, action_bins, dtype=np.float64) for lo, hi in zip(low, high, strict=True)]
        grid = np.array(list(itertools.product(*axes)), dtype=act_space.dtype).reshape(
            (n_grid, *act_space.shape)
        )
        return EnvSpec(env_id, obs_shape, n_grid, grid, onehot)
    raise EnvError(
        f"{algorithm} cannot use the action space {act_space} of {env_id!r}: it takes Discrete actions, "
        "or Box actions that it discretizes (action_bins per dimension)."
    )


class EnvAdapter:
    """A gymnasium env that speaks flat float32 observations and integer actions."""

    def __init__(
        self,
        config: EnvConfig,
        algorithm: str,
        action_bins: int,
        seed: int | None = None,
        allow_modules: Collection[str] | None = None,
    ) -> None:
        self.config = config
        self.env = config.make(allow_modules=allow_modules)
        self.spec = make_spec(self.env, config.id, algorithm, action_bins)
        self._seed = seed
        self._first_reset = True

    def _obs(self, obs: Any) -> np.ndarray:
        if self.spec.obs_onehot:
            out = np.zeros(self.spec.obs_onehot, dtype=np.float32)
            out[int(obs)] = 1.0
            return out
        return np.asarray(obs, dtype=np.float32).reshape(-1)

    def reset(self) -> np.ndarray:
        seed = self._seed if self._first_reset else None
        self._first_reset = False
        obs, _ = self.env.reset(seed=seed)
        if seed is not None:
            self.env.action_space.seed(seed)
        return self._obs(obs)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool]:
        env_action: Any = int(action) if self.spec.action_values is None else self.spec.action_values[action]
        obs, reward, terminated, truncated, _ = self.env.step(env_action)
        return self._obs(obs), float(reward), bool(terminated), bool(truncated)

    def close(self) -> None:
        self.env.close()
