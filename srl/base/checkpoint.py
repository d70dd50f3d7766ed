"""The checkpoint format: what a saved run holds, and how it is checked when loaded.

Owns: ``build_checkpoint`` (the weights, the trainer's state under ``trainer/``, the replay memory under
``memory/``, and the meta: format, counters, the algorithm, its settings and the env), ``split_checkpoint``
and ``checkpoint_memory`` (their inverse, with every field checked), and ``task_config`` (the algorithm,
its settings and the env as plain data, which a distributed task carries too). ``Runner`` saves and loads
them, a distributed trainer writes them and resumes from them. Must never: unpickle, or trust a field
it has not checked (a checkpoint may come through the board).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from srl.base.config import config_from_dict, config_to_dict, setting_data
from srl.base.env import EnvConfig, EnvSpec
from srl.base.rl import Learner, Parameter, RLConfig

CHECKPOINT_FORMAT = "srl-checkpoint"
CHECKPOINT_VERSION = 3
"""3: counters and the trainer's state (arrays under ``trainer/``); 2 (weights only) still loads. A setting
added since is read as ``RLConfig.saved_before`` says when a checkpoint's config lacks it"""
TRAINER_PREFIX = "trainer/"
MEMORY_PREFIX = "memory/"


def task_config(rl_config: RLConfig, env_config: EnvConfig) -> dict[str, Any]:
    """The algorithm, its settings and the env as plain data (a task's config, a checkpoint's meta)."""
    return {"algorithm": rl_config.algorithm, "rl_config": config_to_dict(rl_config), "env": env_config.to_dict()}


def build_checkpoint(
    parameter: Parameter, learner: Learner | None, task_config: dict[str, Any], train_count: int, env_steps: int,
    episodes: int, trainer_state: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None,
    memory: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """What a checkpoint holds: the weights, the trainer's state under ``trainer/`` (from ``learner``, else
    ``trainer_state``), the replay memory under ``memory/`` when given (``Buffer.state_arrays``), and the
    meta (format, counters, the algorithm, its settings and the env)."""
    arrays = dict(parameter.to_arrays())
    meta: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "train_count": train_count,
        "version": parameter.version,
        "env_steps": env_steps,
        "episodes": episodes,
        "saved_at": time.time(),
        **task_config,
    }
    state = learner.state_arrays() if learner is not None else trainer_state
    if state is not None:
        arrays.update({TRAINER_PREFIX + k: v for k, v in state[0].items()})
        meta["trainer_state"] = state[1]
    if memory is not None:
        arrays.update({MEMORY_PREFIX + k: v for k, v in memory[0].items()})
        meta["memory_state"] = memory[1]
    return arrays, meta


def split_checkpoint(
    meta: dict[str, Any], arrays: dict[str, np.ndarray], rl_config: RLConfig, source: str = "checkpoint",
    spec: EnvSpec | None = None,
) -> tuple[dict[str, np.ndarray], tuple[dict[str, np.ndarray], dict[str, Any]] | None]:
    """The weights and the trainer state (None if it holds none) of a checkpoint made for ``rl_config``'s
    algorithm under the same settings that change what weights mean (with ``spec``, as both configs resolve
    their presets for it); ValueError saying what is wrong otherwise."""
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{source} is not an srl checkpoint (format {str(meta.get('format'))[:40]!r})")
    algorithm = rl_config.algorithm
    if meta.get("algorithm") != algorithm:
        raise ValueError(f"{source} holds {str(meta.get('algorithm'))[:40]!r} weights; this task is {algorithm!r}")
    for name in ("version", "train_count", "env_steps", "episodes"):
        count_field(meta, name)
    check_weights_match(meta, rl_config, source, spec)
    weights = {k: v for k, v in arrays.items() if not k.startswith((TRAINER_PREFIX, MEMORY_PREFIX))}
    state = meta.get("trainer_state")
    if not isinstance(state, dict):
        return weights, None
    return weights, ({k[len(TRAINER_PREFIX):]: v for k, v in arrays.items() if k.startswith(TRAINER_PREFIX)}, state)


def checkpoint_memory(
    meta: dict[str, Any], arrays: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The replay memory a checkpoint keeps (for ``Buffer.load_state_arrays``), or None when it keeps none."""
    state = meta.get("memory_state")
    if not isinstance(state, dict):
        return None
    return {k[len(MEMORY_PREFIX):]: v for k, v in arrays.items() if k.startswith(MEMORY_PREFIX)}, state


def saved_rl_config(meta: dict[str, Any], config_cls: type[RLConfig]) -> dict[str, Any]:
    """A checkpoint's algorithm settings, with the fields added since it was written set to what their
    absence meant (``config_cls.saved_before``)."""
    raw = meta.get("rl_config", {})
    if not isinstance(raw, dict):
        raise ValueError(f"checkpoint field 'rl_config' is {type(raw).__name__}, not the algorithm's settings")
    return {**config_cls.saved_before, **raw}


def check_weights_match(meta: dict[str, Any], rl_config: RLConfig, source: str = "checkpoint",
                        spec: EnvSpec | None = None) -> None:
    """ValueError when a checkpoint's weights were made under other values of the settings that change
    what weights mean (``weights_depend_on``) than ``rl_config``'s. With ``spec`` both are compared as they
    resolve for it (a field left to a preset is the preset's); without, a field left to a preset on either
    side is not compared."""
    config_cls = type(rl_config)
    names = config_cls.weights_depend_on
    if not names:
        return
    saved: dict[str, Any] = saved_rl_config(meta, config_cls)
    ours: Any = rl_config
    whose = ""
    if spec is not None:
        ours = rl_config.resolved(spec)
        whose = " (as the presets resolve for this env)"
        try:
            theirs = config_from_dict(config_cls, saved, where=source).resolved(spec)
            saved = {name: getattr(theirs, name) for name in names}
        except (ValueError, TypeError, KeyError):  # settings this version cannot build: compare them as stored
            pass
    for name in names:
        mine = getattr(ours, name)
        if name not in saved or saved[name] is None or mine is None:
            continue
        if setting_data(saved[name]) != setting_data(mine):  # as stored: a built value equals its dict
            raise ValueError(
                f"{source} was trained with {name}={_shown(saved[name])}, this config has {name}={_shown(mine)}"
                f"{whose}: the weights mean something else under it. Set {name} as the checkpoint has it, or "
                "rebuild with Runner.from_checkpoint"
            )


def _shown(value: Any) -> str:
    return str(value)[:60]


def count_field(meta: dict[str, Any], name: str) -> int:
    """A checkpoint's counter ``name`` (0 when absent); ValueError when it is not a count."""
    value = meta.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise ValueError(f"checkpoint field {name!r} is {str(value)[:40]}, not a count")
    return value
