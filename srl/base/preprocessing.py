"""Named env preprocessings: the wrappers an ``EnvConfig`` may put around its env, and the training signal.

Owns: the fixed set of preprocessings a task may name (``PREPROCESSINGS``), which one an env id gets
when the config names none (``resolve_preprocessing``), registering the env packages srl knows by id
prefix (ALE's ``ALE/`` ids from ``ale-py``, ``MinAtar/`` ids from ``minatar``, srl's own ``srl/`` ids
from ``srl.base.partial``), the command that installs what an env needs when its import fails
(``install_command``, ``missing_dependency``), and the
``TrainingSignal``: what a worker sees instead of the env's own reward and end of episode while it
trains (clipped rewards, a lost life as a terminal step). Must never: import a module or build a
wrapper named by data; a name read from the board selects an entry of this file's table or is refused.

Why the training signal is not a wrapper: evaluation, history and progress report full games with
their real scores (a Pong game is 21 points, not the 1 point of a clipped reward, and ends at game
over, not at the first lost life), so the env itself stays whole and ``Rollout`` shows the worker
the clipped, life-cut version only while it trains.

The Atari preprocessing is the standard one of DQN (Mnih et al. 2015) as CleanRL's ``dqn_atari.py``
and Sample Factory apply it: up to 30 no-op starts, frame skip 4 with the max of the last two frames,
84x84 grey, a stack of the last 4 frames (shape (4, 84, 84), uint8), and for training only reward
clipping to its sign and a lost life as a terminal step. The env's own sticky actions
(``repeat_action_probability`` 0.25 in v5 ids, Machado et al. 2018) are kept; pass
``repeat_action_probability=0.0`` to turn them off. Several envs of an ALE game run on ale-py's C++ vector
env with the same preprocessing instead of these wrappers (``srl.base.ale_vector``, chosen by ``Rollout``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

PREPROCESSINGS = ("none", "atari", "minatar")
"""the preprocessings an ``EnvConfig`` may name"""
ATARI_FRAMES = 4
"""frames an Atari observation stacks"""
ATARI_SCREEN = 84


INSTALLS: tuple[tuple[str, str], ...] = (
    ("gymnasium.envs.mujoco", "pip install 'srl[mujoco]'"),  # gymnasium[mujoco]: mujoco and imageio both
    ("gymnasium.envs.box2d", "pip install 'gymnasium[box2d]'"),
    ("ale_py", "pip install 'srl[atari]'"),
    ("minatar", "pip install 'srl[minatar]'"),
)
"""module (an env's entry point's, or the missing one) -> the command that installs what its envs need"""
MISSING_MODULES: dict[str, str] = {"mujoco": "gymnasium.envs.mujoco", "Box2D": "gymnasium.envs.box2d"}
"""a missing module -> the package of envs it belongs to, where the env's entry point does not say"""


class PreprocessingError(ValueError):
    """A preprocessing that does not exist or does not fit the env."""


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def install_command(env_id: str, missing: str | None) -> str:
    """What to run so that ``env_id`` can be built, ``missing`` (a module) being what its import lacked:
    the command for the env's family, known by its entry point's module or else by the missing module
    (``INSTALLS``), or a pip install of the package that provides the missing module."""
    entry = gym.registry.get(env_id)
    entry_point = entry.entry_point if entry is not None else env_id
    where = (entry_point if isinstance(entry_point, str) else getattr(entry_point, "__module__", "")).partition(":")[0]
    top = (missing or "").partition(".")[0]
    for module in (where, MISSING_MODULES.get(top, top)):
        for package, command in INSTALLS:
            if module and _within(module, package):
                return command
    return f"pip install the package that provides {top!r}" if top else "install the env's package"


def missing_dependency(env_id: str, error: Exception) -> str:
    """One line for an env whose import failed (``ImportError``, or gymnasium's ``DependencyNotInstalled``):
    the env, the module missing, and the command that installs it (``install_command``)."""
    cause: BaseException | None = error
    missing: str | None = None
    while cause is not None and missing is None:  # gymnasium re-raises an import's error with the module unnamed
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            missing = cause.name
        cause = cause.__cause__
    command = install_command(env_id, missing)
    if missing is None:
        return f"env {env_id!r} cannot import what it needs ({error}): {command}"
    note = f" (gymnasium says: {error})" if isinstance(error, gym.error.DependencyNotInstalled) else ""
    return f"env {env_id!r} needs the module {missing!r}, which is not installed here: {command}{note}"


@dataclass(frozen=True)
class TrainingSignal:
    """What a training worker sees instead of the env's reward and episode end (see the module docstring)."""

    clip_reward: bool = False
    """rewards become their sign (-1, 0, 1)"""
    life_loss_terminal: bool = False
    """a step that loses a life (``info["lives"]`` falls) is terminal for the worker; the game goes on"""

    @property
    def active(self) -> bool:
        return self.clip_reward or self.life_loss_terminal


def check_preprocessing(name: str | None) -> None:
    """Refuse a name outside the set, with the closest one."""
    if name is None or name in PREPROCESSINGS:
        return
    close = difflib.get_close_matches(str(name)[:64], PREPROCESSINGS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise PreprocessingError(f"preprocessing {str(name)[:40]!r} is not one of {list(PREPROCESSINGS)}{hint}")


def register_known_envs(env_id: str) -> None:
    """Register the env package an id's prefix names (``ALE/``, ``MinAtar/``) when gymnasium does not
    know the id yet: a fixed import chosen here by prefix, never a module named by the id itself."""
    if env_id in gym.registry:
        return
    if env_id.startswith("srl/"):
        from srl.base.partial import register_partial_envs

        register_partial_envs()
    elif env_id.startswith("ALE/") or "NoFrameskip" in env_id:
        try:
            import ale_py
        except ImportError as e:
            raise PreprocessingError(
                f"env {env_id!r} is an Atari game and needs ale-py (its wheel ships the ROMs): "
                f"{install_command(env_id, 'ale_py')}") from e
        gym.register_envs(ale_py)
    elif env_id.startswith("MinAtar/"):
        try:
            import minatar.gym
        except ImportError as e:
            raise PreprocessingError(f"env {env_id!r} is a MinAtar game and needs minatar: "
                                     f"{install_command(env_id, 'minatar')}") from e
        minatar.gym.register_envs()


def resolve_preprocessing(env_id: str, name: str | None) -> str:
    """The preprocessing ``env_id`` gets: ``name`` when given, else "atari" for ALE's envs, "minatar" for
    MinAtar's and "none" for the rest."""
    check_preprocessing(name)
    if name is not None:
        return name
    entry = gym.registry.get(env_id)
    entry_point = str(entry.entry_point) if entry is not None else ""
    if "ale_py" in entry_point:
        return "atari"
    if env_id.startswith("MinAtar/"):
        return "minatar"
    return "none"


def training_signal(preprocessing: str) -> TrainingSignal:
    if preprocessing == "atari":
        return TrainingSignal(clip_reward=True, life_loss_terminal=True)
    return TrainingSignal()


def atari_make_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``gym.make`` gets for an ALE env under the Atari preprocessing: frame skipping is the
    preprocessing's (with the max of the last two frames), so the env's own is off."""
    if kwargs.get("frameskip", 1) != 1:
        raise PreprocessingError(
            f"the atari preprocessing skips 4 frames itself (with the max of the last two); the env's own "
            f"frameskip={kwargs['frameskip']!r} would skip again. Drop frameskip, or set preprocessing='none'")
    return {**kwargs, "frameskip": 1}


def wrap(env: gym.Env, preprocessing: str) -> gym.Env:
    """``env`` with the preprocessing's wrappers."""
    if preprocessing == "atari":
        space = env.observation_space
        if not isinstance(space, gym.spaces.Box) or space.dtype != np.uint8 or len(space.shape) != 3:
            raise PreprocessingError(f"the atari preprocessing takes RGB uint8 screens; this env observes {space}")
        env = gym.wrappers.AtariPreprocessing(
            env, noop_max=30, frame_skip=4, screen_size=ATARI_SCREEN, terminal_on_life_loss=False,
            grayscale_obs=True, scale_obs=False)
        return gym.wrappers.FrameStackObservation(env, ATARI_FRAMES)
    if preprocessing == "minatar":
        space = env.observation_space
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 3:
            raise PreprocessingError(f"the minatar preprocessing takes (10, 10, C) grids; this env observes {space}")
        height, width, channels = space.shape
        chw = gym.spaces.Box(0, 1, (channels, height, width), np.bool_)  # type: ignore[arg-type]
        return gym.wrappers.TransformObservation(
            env, lambda obs: np.ascontiguousarray(np.moveaxis(np.asarray(obs, bool), -1, 0)), chw)
    return env
