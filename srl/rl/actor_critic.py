"""The policy network and the segment worker that PPO, asynchronous PPO and IMPALA share.

Owns: ``ActorCritic`` (separate policy and value MLPs with orthogonal init; a
categorical policy for Discrete and MultiDiscrete actions, a Gaussian with a
state-independent log-std for Box actions; optional observation normalization
whose statistics are buffers, so they travel with the params),
``ActorCriticParameter``, ``SegmentWorker`` (samples actions for E envs with
one forward pass, records behaviour log-probabilities and values, cuts one
segment per env every T steps, all acted with one params version) and
``segment_schema``. The algorithms keep their learners (the maths) in their
own files. Must never: know about Redis or queues, or learn.

A segment row: ``obs`` (T, *obs), ``action`` (T, ...), ``logprob`` (the
behaviour policy's), ``value`` (the behaviour critic's), ``reward`` (the env's),
``bootstrap``, ``done`` (the episode ended at that step), ``last_obs`` (the
observation after the last step, to bootstrap from) and ``version``. A time
limit is not a failure: the worker records γ·V(final obs) as the ``bootstrap``
of a truncated episode's last step (0 elsewhere) and marks it done; learners
add it to that step's reward (``segment_rewards``). It stays apart from the
reward because V is in the critic's units, which are the learner's rewards
after any normalization: a learner that scales rewards scales the env's and
adds the bootstrap after (as SB3 adds γ·V to normalized rewards).

Stacked frames (Atari's 4) go once: instead of ``obs`` and ``last_obs`` a
segment carries ``frames`` (T + S: the S frames of its first observation's
stack, then the newest frame of each later one and of ``last_obs``) and
``first`` (which of them start an episode: a reset stack is copies of its
frame); ``segment_observations`` rebuilds the stacks for the learner.

With a recurrent core (``recurrent="lstm"`` or ``"gru"``, ``srl.rl.recurrent``) the worker keeps
each env's state, zeroed only when that env's episode starts, and a segment also
carries ``state_h`` (and ``state_c``), the state before its first step, and
``state_reset`` (the state was zeroed before that step); learners unroll the
segment from it (``evaluate_sequence``, ``bootstrapped_values``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, TypeVar, cast

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from srl.base.env import BoxActions, DiscreteActions, EnvConfig, EnvSpec, MultiDiscreteActions, env_spec
from srl.base.rl import (
    Columns,
    Learner,
    Parameter,
    PolicyIO,
    Worker,
    concat_rows,
    preset_note,
    torch_from_arrays,
    torch_to_arrays,
    worker_generator,
)
from srl.base.schema import Column, Schema
from srl.rl.blocks import MLPBlockConfig, to_device
from srl.rl.memories.frames import check_stacks, stack_rows
from srl.rl.networks import EncoderConfig, orthogonal_init
from srl.rl.recurrent import RecurrentCore, split_states, stack_states, state_columns

VALUE_BOUND = 1e9
"""observations, rewards and raw actions beyond this are refused as rows"""


class ActorCriticSettings(Protocol):
    """What the shared pieces read from an algorithm's config (resolved: no preset field left at None)."""

    @property
    def hidden_block(self) -> MLPBlockConfig | None: ...  # PPO's None until resolved; IMPALA's always set
    encoder: EncoderConfig
    normalize_obs: bool | None
    store_frames_once: bool
    recurrent: str | None
    recurrent_size: int
    @property
    def cell_first(self) -> bool | None: ...  # PPO's None until resolved (and for a feed-forward config)


def segment_frames(config: ActorCriticSettings, spec: EnvSpec) -> int:
    """Frames a stacked observation holds when segments carry each frame once (0: they carry stacks)."""
    return spec.frame_stack if config.store_frames_once and spec.frame_stack > 1 else 0


def segment_cores(config: ActorCriticSettings, spec: EnvSpec) -> int:
    """Recurrent cells the network has: 0 feed-forward, 1 shared by both heads (an image encoder), 2 (one
    for the policy, one for the value) over vectors."""
    if config.recurrent is None:
        return 0
    return 2 if config.encoder.check(spec) == "mlp" else 1


def segment_observation_columns(spec: EnvSpec, horizon: int, frames: int = 0) -> dict[str, Column]:
    """The observations of ``horizon`` steps and the one after them: ``obs`` and ``last_obs``, or with
    ``frames`` (the stack size) each frame once, ``frames`` and ``first`` (see the module docstring)."""
    if frames:
        low, high = spec.obs_bounds
        return {"frames": Column(spec.obs_dtype, (horizon + frames, *spec.obs_shape[1:]), low, high),
                "first": Column("bool", (horizon + frames,))}
    return {"obs": spec.obs_column(horizon), "last_obs": spec.obs_column()}


def segment_schema(spec: EnvSpec, horizon: int, frames: int = 0, recurrent: str | None = None, cores: int = 0,
                   recurrent_size: int = 0) -> Schema:
    """Columns of a segment of ``horizon`` steps of one env (see the module docstring); ``frames``: the stack
    size when each frame goes once (``segment_frames``); ``recurrent``: the cell whose state at the segment's
    start goes with it (``state_h``, ``state_c``: ``cores`` x ``recurrent_size``) with ``state_reset`` (the
    state was zeroed before that step: an episode began)."""
    observations = segment_observation_columns(spec, horizon, frames)
    if recurrent is not None:
        observations.update(state_columns(recurrent, cores, recurrent_size))
        observations["state_reset"] = Column("bool", (horizon,))
    return _segment_schema(spec, horizon, observations)


def config_segment_schema(config: ActorCriticSettings, spec: EnvSpec, horizon: int) -> Schema:
    """``segment_schema`` as ``config`` (PPO's or IMPALA's) asks for it."""
    return segment_schema(spec, horizon, segment_frames(config, spec), config.recurrent,
                          segment_cores(config, spec), config.recurrent_size)


def segment_observations(segments: Mapping[str, np.ndarray], frames: int) -> tuple[np.ndarray, np.ndarray]:
    """``(obs, last_obs)`` of segments, ``(n, T, *obs)`` and ``(n, *obs)``: the columns, or the stacks rebuilt
    from ``frames`` and ``first``."""
    if not frames:
        return segments["obs"], segments["last_obs"]
    # the segments as one run of streams, each beginning with its first stack's older frames (context)
    first = segments["first"].copy()
    first[:, : frames - 1] = False  # context, never an episode's start
    n, length = first.shape
    start = np.zeros((n, length), bool)
    start[:, 0] = True
    sources, _ = stack_rows(first.reshape(-1), start.reshape(-1), frames)
    flat = segments["frames"].reshape(n * length, *segments["frames"].shape[2:])
    stacks = flat[sources.reshape(n, length, frames)[:, frames - 1 :]]  # (n, T + 1, S, H, W)
    return stacks[:, :-1], stacks[:, -1]


def segment_states(segments: Mapping[str, np.ndarray], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The recurrent state at each segment's start, ``(n, cores, size)`` (``c`` None for a GRU), and where
    the actor reset it, ``(n, T)``, as tensors on ``device``."""
    c = segments.get("state_c")
    return (to_device(segments["state_h"], device), None if c is None else to_device(c, device),
            to_device(segments["state_reset"], device))


def segment_rewards(segments: Mapping[str, np.ndarray],
                    scale: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """The rewards ``(n, T)`` a learner learns from: the env's, through ``scale(reward, done)`` where the
    learner normalizes them, plus the time-limit ``bootstrap``, added after: it is a value of the critic,
    in the units of the rewards it learned from, so scaling it again would shrink it twice."""
    reward = segments["reward"] if scale is None else scale(segments["reward"], segments["done"])
    return (reward + segments["bootstrap"]).astype(np.float32)


def bootstrapped_values(net: ActorCritic, obs: torch.Tensor, last_obs: torch.Tensor, h: torch.Tensor,
                        c: torch.Tensor | None, resets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V over recurrent segments ``(n, T)`` and V(last_obs) ``(n,)``, one unroll over the T + 1
    observations (the state is not reset before ``last_obs``: its value counts only where the episode
    goes on)."""
    all_obs, all_resets = with_last(obs, last_obs, resets)
    values = net.sequence_values(all_obs, h, c, all_resets)
    return values[:, :-1], values[:, -1]


def with_last(obs: torch.Tensor, last_obs: torch.Tensor, resets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments' T observations and ``last_obs`` as T + 1, and their resets with none before ``last_obs``
    (it is the final observation of the segment's last step, in the same episode)."""
    return (torch.cat([obs, last_obs.unsqueeze(1)], dim=1),
            torch.cat([resets, torch.zeros_like(resets[:, :1])], dim=1))


def _segment_schema(spec: EnvSpec, horizon: int, observations: dict[str, Column]) -> Schema:
    actions = spec.actions
    if isinstance(actions, DiscreteActions):
        action = Column("int64", (horizon,), low=0, high=actions.n - 1)
    elif isinstance(actions, MultiDiscreteActions):
        action = Column("int64", (horizon, len(actions.nvec)), low=0, high=max(actions.nvec) - 1)
    else:
        action = Column("float32", (horizon, *actions.shape), low=-VALUE_BOUND, high=VALUE_BOUND)
    return Schema({
        **observations,
        "action": action,
        "logprob": Column("float32", (horizon,), low=-VALUE_BOUND, high=VALUE_BOUND),
        "value": Column("float32", (horizon,), low=-VALUE_BOUND, high=VALUE_BOUND),
        "reward": Column("float32", (horizon,), low=-VALUE_BOUND, high=VALUE_BOUND),
        "bootstrap": Column("float32", (horizon,), low=-VALUE_BOUND, high=VALUE_BOUND),
        "done": Column("bool", (horizon,)),
        "version": Column("int64", (), low=0),
    })


def check_actions(spec: EnvSpec, algorithm: str) -> None:
    """The action spaces the shared policy takes."""
    if isinstance(spec.actions, BoxActions) and len(spec.actions.shape) != 1:
        raise spec.unsupported(algorithm, "Box actions of one dimension (shape (n,))")


def check_cell_first(cell_first: bool | None, recurrent: str | None, spec: EnvSpec | None = None,
                     kind: str = "mlp") -> None:
    """ValueError where ``cell_first=True`` (a user's: presets set it only where it applies) would change
    nothing: a config without a cell, or observations of ``spec`` that do not go through the ``mlp`` encoder
    (``kind``, the encoder ``spec`` gets; without ``spec`` only the config is checked)."""
    if not cell_first:
        return
    if recurrent is None:
        raise ValueError("cell_first=True puts the recurrent cells before the hidden layers, and this config has "
                         "no cell (recurrent=None): set recurrent='lstm' or 'gru', or leave cell_first unset")
    if spec is not None and kind != "mlp":
        raise ValueError(f"cell_first=True applies to vector observations through the 'mlp' encoder; "
                         f"{spec.env_id!r} gets the {kind!r} encoder, whose features the cell reads after it: "
                         "leave cell_first unset")


def normalized_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages centred and scaled over the batch (``norm_adv``); one alone is left as it is."""
    if advantages.numel() <= 1:
        return advantages
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class RunningMeanStd(nn.Module):
    """Running mean and variance (Welford over batches); buffers, so they travel with the params."""

    mean: torch.Tensor
    var: torch.Tensor
    count: torch.Tensor

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    def update(self, x: torch.Tensor) -> None:
        x = x.to(torch.float64).reshape(-1, *self.mean.shape)
        batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        delta, total = batch_mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var = (self.var * self.count + batch_var * n + delta**2 * self.count * n / total) / total
        self.count = total

    def normalize(self, x: torch.Tensor, clip: float = 10.0) -> torch.Tensor:
        return torch.clamp((x - self.mean.float()) / torch.sqrt(self.var.float() + 1e-8), -clip, clip)

    def state(self) -> dict[str, Any]:
        """The statistics as JSON numbers (exact: a float64 round-trips through JSON), for the small ones
        a params message carries."""
        return {"mean": self.mean.tolist(), "var": self.var.tolist(), "count": self.count.item()}

    def load_state(self, state: Any, what: str) -> None:
        """Load what ``state`` wrote; ValueError naming ``what`` when it does not fit these statistics (read
        from the board: any value may come)."""
        if not isinstance(state, Mapping) or set(state) != {"mean", "var", "count"}:
            raise ValueError(f"{what}: expected an object of mean, var and count, got {str(state)[:80]!r}")
        try:
            mean, var, count = (np.asarray(state[k], np.float64) for k in ("mean", "var", "count"))
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{what}: mean, var and count must be numbers") from None
        if mean.shape != tuple(self.mean.shape) or var.shape != mean.shape or count.shape != ():
            raise ValueError(f"{what}: shapes {mean.shape}, {var.shape}, {count.shape}; these statistics have "
                             f"{tuple(self.mean.shape)} and a scalar count")
        if not (np.isfinite(mean).all() and np.isfinite(var).all() and (var >= 0).all()
                and math.isfinite(float(count)) and float(count) > 0):
            raise ValueError(f"{what}: the mean and var must be finite, the var not negative, the count positive")
        self.mean.copy_(torch.from_numpy(mean))
        self.var.copy_(torch.from_numpy(var))
        self.count.fill_(float(count))


class LinearAnneal:
    """A linear decay over the run's budget: 1 at the start, ``floor`` at the end of ``max_steps`` env steps,
    else of ``max_train_count`` gradient steps; 1 throughout when neither is known. The env steps are the
    run's: where its owner says the run is when it plans (one process: the runner's count; a trainer: the
    board's total, so one taking a run over goes on at the same fraction), then those consumed since."""

    def __init__(self, floor: float = 0.02) -> None:
        self.floor = floor
        self.steps_seen = 0
        self.max_steps: int | None = None
        self.max_train_count: int | None = None

    def plan(self, max_steps: int | None, max_train_count: int | None, env_steps: int = 0) -> None:
        """The budget, and the run's ``env_steps`` so far."""
        self.max_steps, self.max_train_count = max_steps, max_train_count
        self.steps_seen = max(0, int(env_steps))

    def advance(self, env_steps: int, train_count: int) -> float:
        """Count ``env_steps`` more consumed; the fraction now."""
        self.steps_seen += env_steps
        if self.max_steps:
            return max(1.0 - self.steps_seen / self.max_steps, self.floor)
        if self.max_train_count:
            return max(1.0 - train_count / self.max_train_count, self.floor)
        return 1.0


MLP_64_64_TANH = MLPBlockConfig((64, 64), "tanh")
"""PPO's ``hidden_block`` preset (IMPALA's default is the same): CleanRL's two tanh layers of 64 per head"""
MLP_64_RELU = MLPBlockConfig((64,), "relu")
"""PPO's recurrent preset over Discrete vectors: RL Zoo ppo_lstm's one ReLU layer of 64 per head"""

ACTION_FAMILIES = ("discrete", "box", "images", "grids")
"""the preset families of an actor-critic config: Discrete / MultiDiscrete and Box over vectors, images, and grids
(images under the Nature CNN's smallest side, as MinAtar's)"""


P = TypeVar("P", bound="FamilyPresets")


class FamilyPresets:
    """What PPO's and IMPALA's configs share: ``presets`` gives each field a config may leave at None one value per
    family of ``ACTION_FAMILIES``; ``resolved`` sets them where the config is used, ``settled`` says which.
    A recurrent config (``recurrent`` set) takes ``recurrent_presets`` where that gives a field its own columns."""

    presets: ClassVar[dict[str, tuple[Any, ...]]] = {}
    recurrent_presets: ClassVar[dict[str, tuple[Any, ...]]] = {}
    weights_depend_on: ClassVar[tuple[str, ...]] = ("recurrent", "recurrent_size", "cell_first", "hidden_block",
                                                    "normalize_obs", "encoder")
    """the settings that shape the network (a checkpoint made under others is refused, saying which)"""
    algorithm: ClassVar[str]
    encoder: EncoderConfig
    recurrent: str | None

    def family(self, spec: EnvSpec) -> str:
        """The preset family of ``spec``: its images, small or not, else its action space."""
        if spec.image:
            return "grids" if self.encoder.small_image(spec) else "images"
        return "box" if isinstance(spec.actions, BoxActions) else "discrete"

    def preset_columns(self) -> dict[str, tuple[Any, ...]]:
        """Each preset field's values by family: ``presets``, with ``recurrent_presets`` over them when the
        config is recurrent."""
        return self.presets if self.recurrent is None else {**self.presets, **self.recurrent_presets}

    def resolved(self: P, spec: EnvSpec) -> P:
        """A copy with every ``None`` field set to the preset of ``spec``'s family (``family``)."""
        column = ACTION_FAMILIES.index(self.family(spec))
        changes = {name: copy.deepcopy(preset[column]) for name, preset in self.preset_columns().items()
                   if getattr(self, name) is None}
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore[type-var]

    def settled(self: P, env_config: EnvConfig) -> P:
        """Itself: the fields left at None stay None (``resolved`` sets them where the config is used); it says
        which preset they take, where it depends on the family (a field with one value for every family is the
        algorithm's default, as its docstring says)."""
        left = [name for name, column in self.preset_columns().items()
                if getattr(self, name) is None and any(value != column[0] for value in column)]
        if left:
            spec = env_spec(env_config)
            resolved, family = self.resolved(spec), self.family(spec)
            said = family if self.recurrent is None else f"recurrent {family}"
            logging.getLogger(f"srl.{self.algorithm}").info(
                "%s", preset_note(self, said, env_config.id,  # type: ignore[arg-type]
                                  {name: getattr(resolved, name) for name in left}))
        return self


class ReturnScaledLearner(Learner):
    """A learner that can scale rewards by the running std of their discounted returns (CleanRL's and SB3's
    reward normalization): ``return_rms`` is its state, kept in checkpoints and handed to a trainer that
    takes the run over (every params message carries it)."""

    def __init__(self) -> None:
        self.return_rms = RunningMeanStd(())

    def scale_rewards(self, reward: np.ndarray, done: np.ndarray, gamma: float) -> np.ndarray:
        """Divide ``(N, T)`` env rewards by the running std of their discounted returns (accumulated within
        each segment), clipped to ±10; the time-limit bootstrap joins them after (``segment_rewards``)."""
        running = np.zeros(reward.shape[0], np.float64)
        returns = np.zeros_like(reward, dtype=np.float64)
        for t in range(reward.shape[1]):
            running = running * gamma + reward[:, t]
            returns[:, t] = running
            running[done[:, t]] = 0.0
        self.return_rms.update(torch.from_numpy(returns))
        scale = float(np.sqrt(self.return_rms.var.item() + 1e-8))
        return np.clip(reward / scale, -10.0, 10.0).astype(np.float32)

    def extra_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return torch_to_arrays({"return_rms": self.return_rms}), {}

    def load_extra_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        torch_from_arrays({"return_rms": self.return_rms}, dict(arrays))

    def takeover_state(self) -> dict[str, Any]:
        return {"return_rms": self.return_rms.state()}

    def load_takeover_state(self, meta: Mapping[str, Any]) -> None:
        if "return_rms" in meta:
            self.return_rms.load_state(meta["return_rms"], "return_rms")


class ActorCritic(nn.Module):
    """Separate policy and value MLPs over vectors (CleanRL's ``Agent``); over images one encoder (a CNN)
    that both heads share (CleanRL's ``ppo_atari.py``). With ``recurrent``, a cell between the encoder and
    the heads (CleanRL's ``ppo_atari_lstm.py``), or with ``cell_first`` over vectors a cell that reads the
    observations before each head's MLP (SB3-contrib's ``RecurrentPPO``): actors ``step`` it, learners
    ``unroll`` it over segments."""

    def __init__(self, config: ActorCriticSettings, spec: EnvSpec) -> None:
        super().__init__()
        self.normalize_obs = bool(config.normalize_obs) and not spec.image
        # an image's statistics would be a float64 per pixel in every params message: images are scaled
        # by their encoder instead, so the (unused) statistics keep one entry
        self.obs_rms = RunningMeanStd((1,) if spec.image else spec.obs_shape)
        self.shared: nn.Module | None = None
        block = config.hidden_block
        assert block is not None, "the config is resolved (its presets set) before a network is built"
        vectors = config.encoder.check(spec) == "mlp"
        self.cell_first = cell_first = vectors and config.recurrent is not None and bool(config.cell_first)
        """over vectors the cells read the observations and each head's hidden_block comes after its cell
        (SB3-contrib RecurrentPPO's order); otherwise the blocks come before the cells (CleanRL's)"""
        self.critic_body: nn.Module
        self.actor_body: nn.Module
        self.critic_head: nn.Module
        if cell_first:
            self.critic_body = self.actor_body = nn.Identity()
            size = spec.obs_shape[0]
        elif vectors:
            self.critic_body, size = config.encoder.build(spec, block)
            if config.recurrent is None:
                self.critic_head = layer_init(nn.Linear(size, 1), std=1.0)
            self.actor_body, size = config.encoder.build(spec, block)
            orthogonal_init(self.critic_body)
            orthogonal_init(self.actor_body)
        else:
            self.shared, size = config.encoder.build(spec, block)
            orthogonal_init(self.shared)
            self.critic_body = self.actor_body = nn.Identity()
        self.recurrent = config.recurrent
        """the cell between the encoder and the heads (None: feed-forward): one the heads share over images,
        one for each of them over vectors (SB3-contrib RecurrentPPO's default)"""
        self.cores = nn.ModuleList()
        if config.recurrent is not None:
            for _ in range(1 if self.shared is not None else 2):
                self.cores.append(RecurrentCore(config.recurrent, size, config.recurrent_size))
            size = config.recurrent_size
        if cell_first:
            self.critic_head = self._after_cell(block, size, 1, std=1.0)
        elif self.shared is not None or config.recurrent is not None:
            self.critic_head = layer_init(nn.Linear(size, 1), std=1.0)
        actions = spec.actions
        self.continuous = isinstance(actions, BoxActions)
        if isinstance(actions, DiscreteActions):
            self.splits: list[int] = [actions.n]
        elif isinstance(actions, MultiDiscreteActions):
            self.splits = list(actions.nvec)
        else:
            self.splits = [int(np.prod(actions.shape))]
            self.logstd = nn.Parameter(torch.zeros(1, self.splits[0]))
        self.actor_head = (self._after_cell(block, size, sum(self.splits), std=0.01) if cell_first
                           else layer_init(nn.Linear(size, sum(self.splits)), std=0.01))

    @staticmethod
    def _after_cell(block: MLPBlockConfig, size: int, outputs: int, std: float) -> nn.Module:
        """A head that ends in ``block`` then a linear layer of ``outputs`` over a cell's ``size`` features."""
        body, features = block.build(size)
        orthogonal_init(body)
        return nn.Sequential(body, layer_init(nn.Linear(features, outputs), std=std))

    def encoders(self) -> list[nn.Module]:
        """The modules that turn observations into features (what ``torch_compile`` compiles): the shared CNN,
        or the actor's and the critic's MLP (with ``cell_first``, the MLPs in the heads after the cells)."""
        if self.shared is not None:
            return [self.shared]
        if self.cell_first:  # each head is Sequential(its MLP, its output layer)
            return [cast(nn.Sequential, head)[0] for head in (self.actor_head, self.critic_head)]
        return [self.actor_body, self.critic_body]

    def prepare(self, obs: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            features: torch.Tensor = self.shared(obs)
            return features
        return self.obs_rms.normalize(obs) if self.normalize_obs else obs

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        assert self.recurrent is None, "a recurrent network steps or unrolls with its state"
        return self.critic_head(self.critic_body(self.prepare(obs))).squeeze(-1)

    def distribution(self, obs: torch.Tensor) -> Normal | list[Categorical]:
        assert self.recurrent is None, "a recurrent network steps or unrolls with its state"
        return self._distribution(self.actor_body(self.prepare(obs)))

    # ------------------------------------------------------------ acting: the heads' raw outputs, no distribution
    # objects (building them costs more than a small network's forward pass); ``sample_actions`` samples
    def action_outputs(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy head's output (logits, or the Gaussian's mean) and V(obs), a shared encoder run once."""
        assert self.recurrent is None, "a recurrent network steps or unrolls with its state"
        if self.shared is not None:
            features = self.shared(obs)
            return self.actor_head(self.actor_body(features)), self.critic_head(features).squeeze(-1)
        x = self.prepare(obs)
        return self.actor_head(self.actor_body(x)), self.critic_head(self.critic_body(x)).squeeze(-1)

    def actor_output(self, obs: torch.Tensor) -> torch.Tensor:
        """The policy head's output alone (what acting greedily needs)."""
        assert self.recurrent is None, "a recurrent network steps or unrolls with its state"
        return self.actor_head(self.actor_body(self.prepare(obs)))

    def step_outputs(self, obs: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One step of E envs: the policy head's output, V(obs) and the next state."""
        states = split_states(h, c)
        if self.shared is not None:
            out, state = self._core(0).step(self.shared(obs), states[0])
            h, c = stack_states([state])
            return self.actor_head(out), self.critic_head(out).squeeze(-1), h, c
        x = self.prepare(obs)
        actor_out, actor_state = self._core(0).step(self.actor_body(x), states[0])
        critic_out, critic_state = self._core(1).step(self.critic_body(x), states[1])
        h, c = stack_states([actor_state, critic_state])
        return self.actor_head(actor_out), self.critic_head(critic_out).squeeze(-1), h, c

    def sample(self, out: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """An action per row of the policy head's ``out`` and its log-probability (see ``sample_actions``)."""
        return sample_actions(out, noise, self.splits, self.logstd if self.continuous else None)

    def _distribution(self, features: torch.Tensor) -> Normal | list[Categorical]:
        out = self.actor_head(features)
        if self.continuous:
            return Normal(out, self.logstd.expand_as(out).exp())
        return [Categorical(logits=logits) for logits in torch.split(out, self.splits, dim=-1)]

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """log π(action|obs), entropy, V(obs)."""
        assert self.recurrent is None, "a recurrent network steps or unrolls with its state"
        if self.shared is not None:  # the shared encoder once for both heads
            features = self.shared(obs)
            dist = self._distribution(self.actor_body(features))
            logprob, entropy = self._logprob_entropy(dist, action)
            return logprob, entropy, self.critic_head(features).squeeze(-1)
        dist = self.distribution(obs)
        logprob, entropy = self._logprob_entropy(dist, action)
        return logprob, entropy, self.value(obs)

    # ------------------------------------------------------------ recurrent: state in, state out
    def _core(self, index: int) -> RecurrentCore:
        core = self.cores[index]
        assert isinstance(core, RecurrentCore)
        return core

    def initial_state(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Zero states for ``batch`` envs, ``(batch, cores, size)`` (``c`` None for a GRU)."""
        return stack_states([self._core(k).initial(batch, device) for k in range(len(self.cores))])

    def unroll(self, obs: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, resets: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Features of the policy and of the value head, ``(n, T, size)``, over segments ``obs`` ``(n, T,
        *obs)`` from their start states, reset where ``resets`` ``(n, T)`` says an episode began."""
        n, horizon = obs.shape[:2]
        flat = obs.reshape(n * horizon, *obs.shape[2:])
        states = split_states(h, c)
        if self.shared is not None:
            features = self.shared(flat)
            out, _ = self._core(0).unroll(features.view(n, horizon, -1), states[0], resets)
            return out, out
        x = self.prepare(flat)
        actor_out, _ = self._core(0).unroll(self.actor_body(x).view(n, horizon, -1), states[0], resets)
        critic_out, _ = self._core(1).unroll(self.critic_body(x).view(n, horizon, -1), states[1], resets)
        return actor_out, critic_out

    def evaluate_sequence(self, obs: torch.Tensor, action: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
                          resets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``evaluate`` over segments ``(n, T)`` from their start states: log π, entropy and V, each ``(n, T)``."""
        actor_out, critic_out = self.unroll(obs, h, c, resets)
        logprob, entropy = self._logprob_entropy(self._distribution(actor_out), action)
        return logprob, entropy, self.critic_head(critic_out).squeeze(-1)

    def evaluate_bootstrapped(self, obs: torch.Tensor, last_obs: torch.Tensor, action: torch.Tensor, h: torch.Tensor,
                              c: torch.Tensor | None, resets: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``evaluate_sequence`` and V(last_obs) ``(n,)`` from one unroll over the T + 1 observations (the
        state is not reset before ``last_obs``: its value counts only where the episode goes on)."""
        all_obs, all_resets = with_last(obs, last_obs, resets)
        actor_out, critic_out = self.unroll(all_obs, h, c, all_resets)
        logprob, entropy = self._logprob_entropy(self._distribution(actor_out[:, :-1]), action)
        values = self.critic_head(critic_out).squeeze(-1)
        return logprob, entropy, values[:, :-1], values[:, -1]

    def sequence_values(self, obs: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, resets: torch.Tensor
                        ) -> torch.Tensor:
        """V over segments ``(n, T)`` from their start states."""
        _, critic_out = self.unroll(obs, h, c, resets)
        values: torch.Tensor = self.critic_head(critic_out).squeeze(-1)
        return values

    @staticmethod
    def _logprob_entropy(dist: Normal | list[Categorical], action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(dist, Normal):
            logprob, entropy = dist.log_prob(action).sum(-1), dist.entropy().sum(-1)
        elif len(dist) == 1:
            logprob, entropy = dist[0].log_prob(action), dist[0].entropy()
        else:
            logprob = torch.stack([d.log_prob(action[..., i]) for i, d in enumerate(dist)]).sum(0)
            entropy = torch.stack([d.entropy() for d in dist]).sum(0)
        return logprob, entropy


class ActorCriticParameter(Parameter):
    """The actor-critic (with the observation statistics, when normalizing)."""

    def __init__(self, config: ActorCriticSettings, spec: EnvSpec, device: torch.device) -> None:
        self.device = device
        self.spec = spec
        self.frames = segment_frames(config, spec)
        """the stack size when segments carry each frame once (0: they carry stacks)"""
        self.net = ActorCritic(config, spec).to(device)

    def to_arrays(self) -> dict[str, np.ndarray]:
        return torch_to_arrays({"net": self.net})

    def from_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        torch_from_arrays({"net": self.net}, arrays)


def sample_actions(out: torch.Tensor, noise: torch.Tensor | None, splits: list[int],
                   logstd: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An action per row of a policy head's ``out`` and its log-probability, in a few batched ops.

    Discrete (``logstd`` None): ``out`` holds the logits of each of ``splits``; with ``noise`` (a uniform
    per logit, ``SegmentWorker._noise``) the Gumbel-max draw (distributed as ``torch.multinomial``'s), else
    the most probable. Box: ``out`` is the Gaussian's mean, ``exp(logstd)`` its deviation; with ``noise`` (a
    normal per dimension) mean + std x noise, else the mean. The log-probability is the distribution's."""
    if logstd is not None:
        std = logstd.expand_as(out).exp()
        action = out if noise is None else out + std * noise
        density = -((action - out) ** 2) / (2 * std**2) - logstd - 0.5 * math.log(2 * math.pi)
        return action, density.sum(-1)
    parts: list[torch.Tensor] = []
    logprob: torch.Tensor | None = None
    start = 0
    for width in splits:
        logp = torch.log_softmax(out[:, start : start + width], dim=-1)
        if noise is None:
            a = logp.argmax(-1)
        else:
            a = (logp - torch.log(-torch.log(noise[:, start : start + width]))).argmax(-1)
        start += width
        parts.append(a)
        chosen = logp.gather(-1, a.unsqueeze(-1)).squeeze(-1)
        logprob = chosen if logprob is None else logprob + chosen
    assert logprob is not None
    return (parts[0] if len(parts) == 1 else torch.stack(parts, dim=-1)), logprob


class SegmentWorker(Worker):
    """Samples actions for E envs at once; every T steps each env's last T steps become a segment."""

    def __init__(self, parameter: ActorCriticParameter, horizon: int, gamma: float, num_envs: int,
                 seed: int | None) -> None:
        self.parameter = parameter
        self.num_envs = num_envs
        self.T = horizon
        self.gamma = gamma
        self.generator = worker_generator(seed)
        spec = parameter.spec
        act = spec.actions
        act_dtype = np.float32 if isinstance(act, BoxActions) else np.int64
        self.frames = parameter.frames
        if self.frames:  # each frame once: the first stack's frames, then the newest of each observation
            self._frames = np.zeros((self.T + self.frames, num_envs, *spec.obs_shape[1:]), spec.obs_dtype)
            self._first = np.zeros((self.T + self.frames, num_envs), bool)
            self._starting = np.zeros(num_envs, bool)  # an episode starts at the next observation
            self._last: np.ndarray | None = None  # the observations acted on last, to check the stacks slide
        else:
            self._obs = np.zeros((self.T, num_envs, *spec.obs_shape), spec.obs_dtype)
        self._action = np.zeros((self.T, num_envs, *act.shape), act_dtype)
        self._logprob = np.zeros((self.T, num_envs), np.float32)
        self._value = np.zeros((self.T, num_envs), np.float32)
        self._reward = np.zeros((self.T, num_envs), np.float32)
        self._bootstrap = np.zeros((self.T, num_envs), np.float32)
        self._done = np.zeros((self.T, num_envs), bool)
        self._t = 0
        self._version = 0
        self._ready: list[Columns] = []
        net = parameter.net
        self.recurrent = net.recurrent is not None
        if self.recurrent:  # each env's state now, and at its segment's start
            self._h, self._c = net.initial_state(num_envs, parameter.device)
            self._h0 = np.zeros(tuple(self._h.shape), np.float32)
            self._c0 = None if self._c is None else np.zeros(tuple(self._c.shape), np.float32)
            self._resets = np.zeros((self.T, num_envs), bool)
            self._resetting = np.ones(num_envs, bool)  # the state was zeroed since the env's last step
        self._low: np.ndarray | None = None
        self._high: np.ndarray | None = None
        if isinstance(act, BoxActions):
            self._low = np.where(np.isfinite(act.low), act.low, -np.inf).astype(np.float32)
            self._high = np.where(np.isfinite(act.high), act.high, np.inf).astype(np.float32)

    def _noise(self, envs: int) -> torch.Tensor | None:
        """The draws that sample ``envs`` actions while training (None: greedy): a uniform per logit (the
        Gumbel-max trick) or a normal per action dimension. They come from the worker's CPU generator
        whatever the network's device (the same stream on a CPU and a GPU: a CUDA tensor cannot take a CPU
        generator), so a server acting for many workers at once draws each worker's from its own."""
        if not self.training:
            return None
        net = self.parameter.net
        width = sum(net.splits)
        draw = torch.randn if net.continuous else torch.rand
        return draw((envs, width), generator=self.generator).to(self.parameter.device)

    def act(self, obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.act_with(obs, self.policy(self.policy_inputs(obs)))

    def policy_inputs(self, obs: np.ndarray) -> PolicyIO:
        x = torch.from_numpy(obs).to(self.parameter.device)
        if self.recurrent:
            return x, self._h, self._c, self._noise(len(obs))
        return x, None, None, self._noise(len(obs))

    def policy(self, inputs: PolicyIO) -> PolicyIO:
        """(action, log-probability, value, h, c): the action sampled with the inputs' draws (greedy without
        them), value None while evaluating feed-forward, h and c None without a core."""
        net = self.parameter.net
        x, h, c, noise = inputs
        if self.recurrent:
            out, value, h, c = net.step_outputs(x, h, c)
        elif noise is not None:
            out, value = net.action_outputs(x)
        else:
            out, value = net.actor_output(x), None
        action, logprob = net.sample(out, noise)
        return action, logprob, value, h, c

    def act_with(self, obs: np.ndarray, outputs: PolicyIO) -> np.ndarray:
        action_t, logprob, value, h, c = outputs
        if self.recurrent:
            state = self._h, self._c
            self._h, self._c = h, c
        action = action_t.cpu().numpy()
        if self.training and value is not None:
            if self._t == 0:
                self._version = self.parameter.version
            t = self._t
            if self.recurrent:
                if t == 0:
                    self._h0[:] = state[0].cpu().numpy()
                    if self._c0 is not None and state[1] is not None:
                        self._c0[:] = state[1].cpu().numpy()
                self._resets[t] = self._resetting
                self._resetting[:] = False
            if self.frames:
                self._keep_frames(t, obs)
            else:
                self._obs[t] = obs
            self._action[t] = action
            self._logprob[t], self._value[t] = logprob.cpu().numpy(), value.cpu().numpy()
        if self._low is not None and self._high is not None:  # the env gets it clipped; the row keeps the sample
            return np.clip(action, self._low, self._high).astype(np.float32)
        return action.astype(np.int64)

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        if not self.training:
            return
        t = self._t
        bootstrap = np.zeros(self.num_envs, np.float32)
        cut = truncated & ~terminated
        if cut.any():  # a time limit, not a failure: bootstrap from the final observation
            with torch.inference_mode():
                final = torch.from_numpy(next_obs[cut]).to(self.parameter.device)
                if self.recurrent:
                    index = torch.from_numpy(np.flatnonzero(cut)).to(self.parameter.device)
                    c = None if self._c is None else self._c[index]
                    final_value = self.parameter.net.step_outputs(final, self._h[index], c)[1]
                else:
                    final_value = self.parameter.net.value(final)
            bootstrap[cut] = self.gamma * final_value.cpu().numpy()
        self._reward[t], self._bootstrap[t], self._done[t] = reward, bootstrap, terminated | truncated
        self._t += 1
        if self._t == self.T:
            self._t = 0
            if self.frames:
                assert self._last is not None
                check_stacks(self._last, next_obs, np.zeros(self.num_envs, bool))
                self._frames[-1], self._first[-1] = next_obs[:, -1], False
                observations = {"frames": self._frames.swapaxes(0, 1).copy(), "first": self._first.T.copy()}
            else:
                observations = {"obs": self._obs.swapaxes(0, 1).copy(),
                                "last_obs": np.array(next_obs, dtype=self._obs.dtype)}
            self._ready.append({
                **observations,
                "action": self._action.swapaxes(0, 1).copy(),
                "logprob": self._logprob.T.copy(),
                "value": self._value.T.copy(),
                "reward": self._reward.T.copy(),
                "bootstrap": self._bootstrap.T.copy(),
                "done": self._done.T.copy(),
                "version": np.full(self.num_envs, self._version, np.int64),
                **self._state_columns(),
            })

    def _state_columns(self) -> Columns:
        if not self.recurrent:
            return {}
        columns = {"state_h": self._h0.copy(), "state_reset": self._resets.T.copy()}
        if self._c0 is not None:
            columns["state_c"] = self._c0.copy()
        return columns

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        if self.frames:
            self._starting[env_ids] = True
        if self.recurrent:  # only these envs' episodes start: the others keep their state
            index = torch.from_numpy(np.asarray(env_ids, np.int64)).to(self.parameter.device)
            with torch.inference_mode():
                self._h[index] = 0.0
                if self._c is not None:
                    self._c[index] = 0.0
            self._resetting[env_ids] = True

    def _keep_frames(self, t: int, obs: np.ndarray) -> None:
        """Step ``t``'s observations as frames (all of the first stack's at ``t`` 0), checked against the last."""
        start = self.frames - 1
        if self._last is not None:
            check_stacks(self._last, obs, self._starting)
        if t == 0:
            self._frames[:start] = obs[:, :start].swapaxes(0, 1)
        self._frames[start + t], self._first[start + t] = obs[:, -1], self._starting
        self._starting[:] = False
        self._last = obs

    def pending(self) -> int:
        return sum(len(rows["version"]) for rows in self._ready)

    def take(self) -> Columns | None:
        ready, self._ready = self._ready, []
        return concat_rows(ready)

    def may_load_params(self) -> bool:
        return self._t == 0  # a segment is acted with one params version
