"""The environment adapter: gymnasium envs as srl sees them.

Owns: ``EnvConfig`` (which env, with which keyword arguments and which named
preprocessing), building the env with a clear error when it does not exist (and
never importing a module a node did not allow), ``EnvSpec`` — the observation
shape and dtype and the action space an algorithm is built for — and
``ObsTransform``. Images (a uint8 or bool Box of 2 or 3 dimensions: Atari
frames, MinAtar grids) keep their dtype and shape; networks scale them. Other
observations are flattened to a float32 vector (a Discrete observation becomes
one-hot). Actions are native:
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

from srl.base.preprocessing import (
    ATARI_FRAMES,
    PreprocessingError,
    TrainingSignal,
    atari_make_kwargs,
    check_preprocessing,
    missing_dependency,
    register_known_envs,
    resolve_preprocessing,
    training_signal,
    wrap,
)
from srl.base.schema import Column

IMAGE_DTYPES = ("uint8", "bool")
"""the dtypes of observations kept as images (with 2 or 3 dimensions)"""
VALUE_BOUND = 1e9
"""float observations beyond this are refused as rows (no env of sense produces them)"""


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
    """Which gymnasium environment to run: ``EnvConfig("Pendulum-v1", g=9.81)``.

    ``preprocessing``: one of ``srl.base.preprocessing.PREPROCESSINGS`` — "atari" (the standard DQN
    preprocessing: no-op starts, frame skip 4 with max-pool, 84x84 grey, 4 frames stacked, and while
    training clipped rewards and a lost life as a terminal step), "minatar" (MinAtar's 10x10xC grids as
    channels first) or "none". None (the default) picks "atari" for ALE's ids ("ALE/Pong-v5"), "minatar"
    for "MinAtar/..." ids and "none" otherwise. Every other keyword goes to ``gymnasium.make``.
    """

    def __init__(self, id: str, preprocessing: str | None = None, **kwargs: Any) -> None:
        if not isinstance(id, str) or not id:
            raise EnvError(f"EnvConfig needs a gymnasium id such as 'CartPole-v1', got {id!r}")
        try:
            check_preprocessing(preprocessing)
        except PreprocessingError as e:
            raise EnvError(f"env {id!r}: {e}") from None
        self.id = id
        self.preprocessing = preprocessing
        self.kwargs = dict(kwargs)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"id": self.id, "kwargs": dict(self.kwargs)}
        if self.preprocessing is not None:
            data["preprocessing"] = self.preprocessing
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EnvConfig:
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise EnvError(f"an env config is an object with a text 'id', got {data!r}")
        kwargs = data.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise EnvError(f"env kwargs must be an object, got {kwargs!r}")
        preprocessing = data.get("preprocessing")
        if preprocessing is not None and not isinstance(preprocessing, str):
            raise EnvError(f"an env's preprocessing is a name, got {preprocessing!r}")
        return cls(data["id"], preprocessing, **kwargs)

    @classmethod
    def coerce(cls, env: str | EnvConfig) -> EnvConfig:
        return env if isinstance(env, EnvConfig) else cls(env)

    def resolved_preprocessing(self) -> str:
        """The preprocessing this env gets (``preprocessing``, or the one its id implies)."""
        try:
            register_known_envs(self.id)
            return resolve_preprocessing(self.id, self.preprocessing)
        except PreprocessingError as e:
            raise EnvError(str(e)) from None

    def frame_stack(self) -> int:
        """Frames this env's observations stack on their first axis (1: none)."""
        return ATARI_FRAMES if self.resolved_preprocessing() == "atari" else 1

    def training_signal(self) -> TrainingSignal:
        """What a training worker sees instead of the env's rewards and episode ends (clipped, cut at a
        lost life) under this env's preprocessing."""
        return training_signal(self.resolved_preprocessing())

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
        """Build the env; an unknown id raises :class:`EnvError` naming close registered ids, and an env
        whose import lacks a module one naming the module and the command that installs it.

        ``allow_modules``: on a node, the modules a ``module:Env`` id may import (see
        :meth:`check_allowed`); None (a user's own process) allows any.
        """
        self.check_allowed(allow_modules)
        preprocessing = self.resolved_preprocessing()
        try:
            extra: dict[str, Any] = {} if render_mode is None else {"render_mode": render_mode}
            kwargs = atari_make_kwargs(self.kwargs) if preprocessing == "atari" else self.kwargs
            return wrap(gym.make(self.id, **extra, **kwargs), preprocessing)
        except PreprocessingError as e:
            raise EnvError(f"env {self.id!r}: {e}") from None
        except (ImportError, gym.error.DependencyNotInstalled) as e:  # the id exists; a package it needs does not
            raise EnvError(missing_dependency(self.id, e)) from e
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
        args = "" if self.preprocessing is None else f", preprocessing={self.preprocessing!r}"
        args += "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
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
    """What an algorithm is built for: an observation (an image of its own dtype and shape, or a flat
    float32 vector) and a native action space."""

    env_id: str
    obs_shape: tuple[int, ...]
    actions: ActionSpace
    obs_onehot: int = 0
    """for a Discrete observation space: its size (the obs is one-hot encoded)"""
    obs_low: np.ndarray | None = field(default=None, repr=False, compare=False)
    """a Box observation space's lower bounds, flattened like the obs (each may be infinite)"""
    obs_high: np.ndarray | None = field(default=None, repr=False, compare=False)
    """its upper bounds"""
    obs_dtype: str = "float32"
    """"float32" for vectors; an image's own dtype ("uint8", "bool")"""
    frame_stack: int = 1
    """frames an image observation stacks on its first axis (4 under the atari preprocessing): each step's
    stack is the one before moved by a frame, so a frame can be sent and stored once"""

    @property
    def image(self) -> bool:
        """Whether the observation is an image (kept as it is: ``obs_dtype``, ``obs_shape``)."""
        return self.obs_dtype != "float32"

    @property
    def obs_bounds(self) -> tuple[float | None, float | None]:
        """The bounds a row's observation must lie in: 0..255 for uint8 images, none for bool (two values
        already), +-``VALUE_BOUND`` for float vectors."""
        if self.obs_dtype == "uint8":
            return 0, 255
        if self.obs_dtype == "bool":
            return None, None
        return -VALUE_BOUND, VALUE_BOUND

    def obs_column(self, *leading: int) -> Column:
        """The schema column of observations, each of shape ``(*leading, *obs_shape)`` (a segment's: (T,))."""
        low, high = self.obs_bounds
        return Column(self.obs_dtype, (*leading, *self.obs_shape), low=low, high=high)

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


def make_spec(env: gym.Env, env_id: str, frame_stack: int = 1) -> EnvSpec:
    """Describe ``env``'s spaces; EnvError for a space srl cannot flatten or act in. ``frame_stack``: the
    frames its image observations stack (``EnvConfig.frame_stack``)."""
    obs_space, act_space = env.observation_space, env.action_space
    onehot = 0
    obs_low = obs_high = None
    obs_dtype = "float32"
    if (isinstance(obs_space, gym.spaces.Box) and np.dtype(obs_space.dtype).name in IMAGE_DTYPES
            and len(obs_space.shape) in (2, 3)):
        obs_shape: tuple[int, ...] = tuple(int(s) for s in obs_space.shape)
        obs_dtype = np.dtype(obs_space.dtype).name
    elif isinstance(obs_space, gym.spaces.Box):
        obs_shape = (int(np.prod(obs_space.shape)),)
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
    stacked = obs_dtype != "float32" and len(obs_shape) == 3 and obs_shape[0] == frame_stack
    return EnvSpec(env_id, obs_shape, actions, onehot, obs_low, obs_high, obs_dtype, frame_stack if stacked else 1)


class ObsTransform:
    """Observations as algorithms see them: images as they are; the rest float32, flattened per env,
    Discrete ones one-hot."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec

    def one(self, obs: Any) -> np.ndarray:
        """One env's observation -> shape ``spec.obs_shape``."""
        if self.spec.image:
            return np.ascontiguousarray(obs, dtype=self.spec.obs_dtype)
        if self.spec.obs_onehot:
            out = np.zeros(self.spec.obs_onehot, dtype=np.float32)
            out[int(obs)] = 1.0
            return out
        return np.asarray(obs, dtype=np.float32).reshape(-1)

    def batch(self, obs: Any) -> np.ndarray:
        """``E`` envs' observations (a vector env's) -> shape ``(E, *spec.obs_shape)``."""
        if self.spec.image:
            return np.ascontiguousarray(obs, dtype=self.spec.obs_dtype)
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
        return make_spec(env, config.id, config.frame_stack())
    finally:
        env.close()
