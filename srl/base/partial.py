"""Partially observed envs srl registers itself: classic control with the velocities hidden.

Owns: ``MaskVelocity`` (an observation wrapper that zeroes the velocity entries of an observation, RL
Baselines3 Zoo's ``MaskVelocityWrapper``: the shape stays, the velocities read 0) and the ids it
registers, ``srl/CartPoleNoVel-v1`` (CartPole-v1 without the cart's and the pole's velocities, entries 1
and 3) and ``srl/PendulumNoVel-v1`` (Pendulum-v1 without the angular velocity, entry 2): the Zoo's
``CartPoleNoVel-v1`` and ``PendulumNoVel-v1``, on which a policy needs memory, as one frame tells the
position but not where it is going; and ``srl/AcrobotNoVel-v1`` (Acrobot-v1 without its two angular
velocities, entries 4 and 5), a third on which recurrent presets are chosen so that they are not judged
on the envs they were chosen on. ``register_partial_envs`` is called when an ``srl/`` id is first
made (``preprocessing.register_known_envs``). Must never: import anything a name chose.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

MASKED_VELOCITIES: dict[str, tuple[str, tuple[int, ...]]] = {
    "srl/CartPoleNoVel-v1": ("CartPole-v1", (1, 3)),
    "srl/PendulumNoVel-v1": ("Pendulum-v1", (2,)),
    "srl/AcrobotNoVel-v1": ("Acrobot-v1", (4, 5)),
}
"""srl's id -> (the env it hides velocities of, the observation entries that are velocities)"""


class MaskVelocity(gym.ObservationWrapper[np.ndarray, Any, np.ndarray]):
    """Zero the observation entries ``indices`` (the velocities)."""

    def __init__(self, env: gym.Env[np.ndarray, Any], indices: tuple[int, ...]) -> None:
        super().__init__(env)
        space = env.observation_space
        assert isinstance(space, gym.spaces.Box)
        self.mask = np.ones(space.shape, dtype=space.dtype)
        self.mask[list(indices)] = 0
        hidden = self.mask == 0
        self.observation_space = gym.spaces.Box(np.where(hidden, 0, space.low), np.where(hidden, 0, space.high),
                                                dtype=space.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return (observation * self.mask).astype(self.mask.dtype, copy=False)


def _make(env_id: str, **kwargs: Any) -> gym.Env[np.ndarray, Any]:
    base, indices = MASKED_VELOCITIES[env_id]
    return MaskVelocity(gym.make(base, **kwargs), indices)


def register_partial_envs() -> None:
    """Register srl's partially observed ids with gymnasium (once)."""
    for env_id, (base, _) in MASKED_VELOCITIES.items():
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=_entry(env_id), reward_threshold=gym.spec(base).reward_threshold,
                         disable_env_checker=True)


def _entry(env_id: str) -> Any:
    def make(**kwargs: Any) -> gym.Env[np.ndarray, Any]:
        return _make(env_id, **kwargs)
    return make
