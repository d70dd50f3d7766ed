"""ale-py's own vector env as srl's Atari preprocessing: E games stepped and preprocessed in C++.

Owns: whether an env config can run on ``ale_py.vector_env.AtariVectorEnv`` (``ale_vector_kwargs``: an
ALE id under the "atari" preprocessing whose keyword arguments that env takes, with the reason when
not) and ``AleVectorEnv``, which builds it with the settings of the gymnasium path
(``srl.base.preprocessing``: up to 30 no-op starts, frame skip 4 with the max of the last two frames,
84x84 grey, 4 frames stacked, the id's sticky actions, no FIRE at reset, rewards unclipped, a game
ending at game over) and makes its output what that path gives ``Rollout``: a reset's stack padded with
copies of its first frame (ale-py pads with black frames), the final observation of an ended episode
whole, rewards as float32. Must never: clip rewards or end an episode at a lost life (``Rollout``'s
training signal does that, for training only), or know about workers.

Why it exists: gymnasium's ``AtariPreprocessing`` and ``FrameStackObservation`` cost Python per env
step (four ALE calls, a resize, a stack copy); here one call steps all E games on a C++ thread.

Where it differs from the gymnasium path (docs/pixels.md says the same): the same seed gives other
no-op counts and sticky-action draws (ale-py's own random streams), and a game is cut after
``max_num_frames_per_episode / 4`` agent steps counted from the end of its no-op start rather than at
that frame number counted from the reset (up to 30 frames later; the same for gymnasium's
``max_episode_steps``, which counts frames there).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from srl.base.preprocessing import ATARI_FRAMES, ATARI_SCREEN, PreprocessingError

FRAME_SKIP = 4
"""frames an agent step repeats its action for (as ``AtariPreprocessing(frame_skip=4)``)"""
NOOP_MAX = 30
"""a reset plays 1..30 no-ops (as ``AtariPreprocessing(noop_max=30)``)"""
THREADS = 1
"""C++ threads that step an actor's envs: one, since an actor is one process on one core"""
TAKEN = frozenset({"game", "repeat_action_probability", "full_action_space", "max_num_frames_per_episode",
                   "max_episode_steps", "frameskip", "obs_type"})
"""the ALE env keywords the vector env has a setting for (``frameskip`` only as the 1 that the atari
preprocessing gives gymnasium's env, ``obs_type`` only as "rgb"; ``max_episode_steps``, gymnasium's time
limit on that env, counts frames as ``max_num_frames_per_episode`` does)"""
NO_LIMIT = 2**31 - 1


def ale_vector_kwargs(env_id: str, preprocessing: str, kwargs: dict[str, Any]) -> dict[str, Any] | str:
    """``AtariVectorEnv``'s keyword arguments for this env, or why it cannot run there (the env is not
    an ALE game under the atari preprocessing, or names a setting the vector env does not have)."""
    entry = gym.registry.get(env_id)
    if entry is None or "ale_py" not in str(entry.entry_point) or "game" not in entry.kwargs:
        return f"{env_id!r} is not one of ale-py's games"
    if preprocessing != "atari":
        return f"its preprocessing is {preprocessing!r}, not 'atari'"
    if kwargs.get("frameskip", 1) != 1:
        return "the atari preprocessing skips frames itself (frameskip is refused)"
    settings = {**entry.kwargs, **kwargs}
    other = sorted(set(settings) - TAKEN)
    if other:
        return f"ale-py's vector env has no setting for {', '.join(other)}"
    if settings.get("obs_type", "rgb") != "rgb":
        return f"obs_type={settings['obs_type']!r}: the atari preprocessing takes RGB screens"
    limits = [int(f) for f in (settings.get("max_num_frames_per_episode"), settings.get("max_episode_steps"),
                               entry.max_episode_steps) if f]
    frames = min(limits, default=0)
    return {
        "game": str(settings["game"]),
        "repeat_action_probability": float(settings.get("repeat_action_probability", 0.25)),
        "full_action_space": bool(settings.get("full_action_space", False)),
        # frames both; ale-py counts them from the end of the no-op start, gymnasium's env from the reset
        "max_num_frames_per_episode": frames or NO_LIMIT,
    }


def pad_stacks(stacks: np.ndarray, ages: np.ndarray, rows: np.ndarray) -> None:
    """Where an env's stack in ``rows`` holds frames from before its episode (``ages``: agent steps
    since the reset, fewer than the stack's frames - 1), make them copies of the episode's first frame,
    as gymnasium's ``FrameStackObservation`` does (ale-py leaves them black)."""
    last = stacks.shape[1] - 1
    for i in rows[ages[rows] < last]:
        first = last - int(ages[i])
        stacks[i, :first] = stacks[i, first]


class AleVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` ALE games in ``AtariVectorEnv``, same-step autoreset, as ``Rollout`` steps them
    (see the module docstring). ``settings``: ``ale_vector_kwargs``'s answer."""

    def __init__(self, settings: dict[str, Any], num_envs: int) -> None:
        from ale_py.vector_env import AtariVectorEnv

        try:
            self.env = AtariVectorEnv(
                settings["game"], num_envs, num_threads=THREADS, batch_size=0,
                max_num_frames_per_episode=settings["max_num_frames_per_episode"],
                repeat_action_probability=settings["repeat_action_probability"],
                full_action_space=settings["full_action_space"], autoreset_mode=AutoresetMode.SAME_STEP,
                img_height=ATARI_SCREEN, img_width=ATARI_SCREEN, grayscale=True, stack_num=ATARI_FRAMES,
                frameskip=FRAME_SKIP, maxpool=True, noop_max=NOOP_MAX, episodic_life=False, life_loss_info=False,
                reward_clipping=False, use_fire_reset=False)
        except (AssertionError, RuntimeError, gym.error.Error) as e:
            raise PreprocessingError(f"ale-py's vector env cannot run {settings['game']!r}: {e}") from e
        self.num_envs = num_envs
        self.single_observation_space = self.env.single_observation_space
        self.single_action_space = self.env.single_action_space
        self.observation_space = self.env.observation_space
        self.action_space = self.env.action_space
        self.metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}
        self._ages = np.zeros(num_envs, dtype=np.int64)
        """each env's agent steps since its episode's reset"""

    def reset(self, *, seed: int | list[int] | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset every game; an int ``seed`` seeds game i with ``seed + i`` (ale-py takes 31-bit seeds),
        None goes on with each game's own random stream."""
        seeds = None if seed is None else (int(np.asarray(seed).reshape(-1)[0]) + np.arange(self.num_envs)) % 2**31
        obs, info = self.env.reset(seed=seeds)
        self._ages[:] = 0
        pad_stacks(obs, self._ages, np.arange(self.num_envs))
        return obs, info

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        actions = np.asarray(actions)
        if actions.dtype not in (np.int32, np.int64):
            actions = actions.astype(np.int64)
        obs, reward, terminated, truncated, info = self.env.step(actions.reshape(self.num_envs))
        done = terminated | truncated
        self._ages += 1
        if done.any():
            ended = np.flatnonzero(done)
            final = np.array(info["final_obs"])  # the ended games' last stacks, which may still start black
            pad_stacks(final, self._ages, ended)
            info = {**info, "final_obs": final, "_final_obs": done}
            self._ages[ended] = 0
        young = np.flatnonzero(self._ages < ATARI_FRAMES - 1)
        if young.size:
            pad_stacks(obs, self._ages, young)
        return obs, np.asarray(reward, dtype=np.float32), terminated, truncated, info

    def close_extras(self, **kwargs: Any) -> None:
        del self.env
