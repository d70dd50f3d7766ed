"""The environment adapter: gymnasium envs as srl sees them.

Owns: ``EnvConfig`` (which env, with which keyword arguments), building the
env with a clear error when it does not exist (and never importing a module a
node did not allow), ``EnvSpec`` — the observation shape and the action space
an algorithm is built for — and ``ObsTransform``. Observations are flattened to
a float32 vector (a Discrete observation becomes one-hot). Actions are native:
``DiscreteActions`` (an int), ``BoxActions`` (a float array, bounded or not)
and ``MultiDiscreteActions`` (an int array); an algorithm that needs another
form (DQN bins a Box) does that itself. Must never: know about algorithms, or
anything distributed.
"""

from __future__ import annotations

import difflib
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
            extra: dict[str, Any] = {} if render_mode is None else {"render_mode": render_mode}
            return gym.make(self.id, **extra, **self.kwargs)
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


@dataclass(frozen=True)
class DiscreteActions:
    """``n`` actions, 0 .. n-1."""

    n: int

    @property
    def shape(self) -> tuple[int, ...]:
        return ()

    @property
    def dtype(self) -> str:
        return "int64"


@dataclass(frozen=True)
class BoxActions:
    """Real-valued actions of ``shape`` in [low, high] (each bound may be infinite)."""

    shape: tuple[int, ...]
    low: np.ndarray = field(repr=False, compare=False)
    high: np.ndarray = field(repr=False, compare=False)

    @property
    def dtype(self) -> str:
        return "float32"

    @property
    def bounded(self) -> bool:
        return bool(np.all(np.isfinite(self.low)) and np.all(np.isfinite(self.high)))


@dataclass(frozen=True)
class MultiDiscreteActions:
    """One choice per dimension: dimension i takes 0 .. nvec[i]-1."""

    nvec: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.nvec),)

    @property
    def dtype(self) -> str:
        return "int64"


ActionSpace = DiscreteActions | BoxActions | MultiDiscreteActions


@dataclass(frozen=True)
class EnvSpec:
    """What an algorithm is built for: a flat float32 observation and a native action space."""

    env_id: str
    obs_shape: tuple[int, ...]
    actions: ActionSpace
    obs_onehot: int = 0
    """for a Discrete observation space: its size (the obs is one-hot encoded)"""
    obs_low: np.ndarray | None = field(default=None, repr=False, compare=False)
    """a Box observation space's lower bounds, flattened like the obs (each may be infinite)"""
    obs_high: np.ndarray | None = field(default=None, repr=False, compare=False)
    """its upper bounds"""

    def obs_affine(self, max_range: float = 1e4) -> tuple[np.ndarray, np.ndarray] | None:
        """``(center, half_range)`` per obs dimension that maps a bounded dimension onto [-1, 1]
        (``(obs - center) / half_range``); a dimension whose bounds are infinite, equal or further
        apart than ``max_range`` (a bound that only says "a float") keeps center 0 and half range 1.
        None when no dimension is bounded that way (or the obs is one-hot)."""
        if self.obs_low is None or self.obs_high is None or self.obs_onehot:
            return None
        low, high = self.obs_low.astype(np.float64), self.obs_high.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            span = high - low
            use = np.isfinite(low) & np.isfinite(high) & (span > 0) & (span <= max_range)
            center = np.where(use, (low + high) / 2, 0.0).astype(np.float32)
        if not use.any():
            return None
        half = np.where(use, span / 2, 1.0).astype(np.float32)
        return center, half

    def unsupported(self, algorithm: str, takes: str) -> EnvError:
        """The error an algorithm raises for an action space it does not take."""
        return EnvError(f"{algorithm} cannot use the action space {self.actions} of {self.env_id!r}: it takes {takes}")


def make_spec(env: gym.Env, env_id: str) -> EnvSpec:
    """Describe ``env``'s spaces; EnvError for a space srl cannot flatten or act in."""
    obs_space, act_space = env.observation_space, env.action_space
    onehot = 0
    obs_low = obs_high = None
    if isinstance(obs_space, gym.spaces.Box):
        obs_shape: tuple[int, ...] = (int(np.prod(obs_space.shape)),)
        with np.errstate(over="ignore"):  # float64 bounds beyond float32 become infinite: "no bound"
            obs_low = np.asarray(obs_space.low, np.float32).reshape(-1)
            obs_high = np.asarray(obs_space.high, np.float32).reshape(-1)
    elif isinstance(obs_space, gym.spaces.Discrete):
        onehot = int(obs_space.n)
        obs_shape = (onehot,)
    else:
        raise EnvError(
            f"srl cannot use the observation space {obs_space} of {env_id!r}: it takes Box or Discrete "
            "observations. Wrap the env (e.g. gymnasium.wrappers.FlattenObservation) and register the "
            "wrapped env under its own id."
        )
    actions: ActionSpace
    if isinstance(act_space, gym.spaces.Discrete):
        if int(act_space.start) != 0:
            raise EnvError(f"{env_id!r}: a Discrete action space must start at 0, found start={act_space.start}")
        actions = DiscreteActions(int(act_space.n))
    elif isinstance(act_space, gym.spaces.Box):
        actions = BoxActions(tuple(int(s) for s in act_space.shape), np.asarray(act_space.low, np.float32),
                             np.asarray(act_space.high, np.float32))
    elif isinstance(act_space, gym.spaces.MultiDiscrete):
        if np.any(np.asarray(act_space.start) != 0) or act_space.nvec.ndim != 1:
            raise EnvError(f"{env_id!r}: srl takes one-dimensional MultiDiscrete actions starting at 0")
        actions = MultiDiscreteActions(tuple(int(n) for n in act_space.nvec))
    else:
        raise EnvError(
            f"srl cannot use the action space {act_space} of {env_id!r}: it takes Discrete, Box or MultiDiscrete"
        )
    return EnvSpec(env_id, obs_shape, actions, onehot, obs_low, obs_high)


class ObsTransform:
    """Observations as algorithms see them: float32, flattened per env; Discrete ones one-hot."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec

    def one(self, obs: Any) -> np.ndarray:
        """One env's observation -> shape ``spec.obs_shape``."""
        if self.spec.obs_onehot:
            out = np.zeros(self.spec.obs_onehot, dtype=np.float32)
            out[int(obs)] = 1.0
            return out
        return np.asarray(obs, dtype=np.float32).reshape(-1)

    def batch(self, obs: Any) -> np.ndarray:
        """``E`` envs' observations (a vector env's) -> shape ``(E, *spec.obs_shape)``."""
        if self.spec.obs_onehot:
            index = np.asarray(obs, dtype=np.int64).reshape(-1)
            out = np.zeros((index.size, self.spec.obs_onehot), dtype=np.float32)
            out[np.arange(index.size), index] = 1.0
            return out
        array = np.asarray(obs, dtype=np.float32)
        return array.reshape(array.shape[0], -1)


def env_spec(config: EnvConfig, allow_modules: Collection[str] | None = None) -> EnvSpec:
    """Build ``config``'s env once to read its spaces."""
    env = config.make(allow_modules=allow_modules)
    try:
        return make_spec(env, config.id)
    finally:
        env.close()
