"""R2D2: Ape-X with an LSTM, learning from stored sequences (Kapturowski et al. 2019).

Read top to bottom: ``Config`` (every setting, documented; the data path: sequences of
``sequence_length`` steps that overlap by ``overlap``, into a prioritized replay of sequences, paced
by ``env_steps_per_train`` in one process and across actors alike), the network (encoder, recurrent
core, dueling head), ``Worker`` (ε-greedy in E envs, Ape-X's ε per env; keeps each env's recurrent
state, zeroed only when that env's episode starts, and emits every env's last ``sequence_length``
steps every ``sequence_length - overlap`` steps with the state it had at their start) and ``Learner``
(burn-in, n-step double-Q targets under the value rescaling h, sequence priorities). Must never: know
about Redis or queues.

A sequence row: ``obs`` (L, *obs) and ``last_obs`` (the observation after the last step: the last
targets bootstrap from it), or for stacked frames ``frames`` and ``first`` as PPO's segments carry them
(each frame once), ``action``, ``reward``, ``done``, ``state_h``/``state_c`` (the actor's state before
the first step), ``state_reset`` (the state was zeroed before that step: an episode began there) and
``version``. Sequences run across episode ends (as IMPALA's segments do): the learner zeroes the state
where the actor did and no target bootstraps across an end. A time limit is not a failure: the worker
adds γ max_a Q(final obs) to the last reward of a truncated episode and marks it done.

The learner, per batch of sequences: unroll the online and the target network from the stored state over
the first ``burn_in`` steps without gradients (the stored state was made by older weights; the burn-in
lets the current ones recover theirs), then over the rest; targets
h(Σ_k γ^k r_{t+k} + γ^n h⁻¹(Q_target(s_{t+n}, argmax_a Q(s_{t+n}, a)))) for each step after the burn-in,
the n-step sums cut at an episode's end and at the sequence's end (bootstrapping from ``last_obs``); the
squared TD error weighted by importance; each sequence's priority η max_t |δ_t| + (1 - η) mean_t |δ_t|.

Choices where the paper leaves room or is out of reach here: new sequences enter the replay at its
highest priority (the paper's actors compute one with their own weights; a sequence's priority needs
its whole burn-in and its targets, which an actor has only at the end); no previous action and reward
as network inputs (the paper feeds them; a user's own encoder can); Box actions are binned as DQN bins
them.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from srl.algorithms.dqn import action_count, action_table, env_epsilons, explore, rescale, unrescale
from srl.base.config import check_int, check_number
from srl.base.env import EnvConfig, EnvSpec, env_spec
from srl.base.rl import (
    Buffer,
    Columns,
    DataPath,
    Learner,
    Parameter,
    PolicyIO,
    RLConfig,
    TrainStats,
    Worker,
    concat_rows,
    preset_note,
    torch_from_arrays,
    torch_to_arrays,
)
from srl.base.schema import Column, Schema
from srl.rl.actor_critic import segment_observation_columns, segment_observations, segment_states
from srl.rl.ahead import DeviceSample, LearnerCompute
from srl.rl.blocks import MLPBlockConfig, make_adam, to_device
from srl.rl.memories import Memory, MemoryConfig
from srl.rl.memories.frames import check_stacks
from srl.rl.networks import EncoderConfig
from srl.rl.recurrent import RecurrentCore, check_recurrent, split_states, stack_states, state_columns

VALUE_BOUND = 1e9
"""rewards beyond this are refused as rows"""

logger = logging.getLogger("srl.r2d2")

# Per-family presets for the fields a Config leaves at None: (vectors, grids, images). Images keep the paper's
# (Atari, 10^10 frames); docs/memory.md, "R2D2's settings", says which envs chose the others and measures them.
PRESETS: dict[str, tuple[Any, Any, Any]] = {
    "lr": (1e-3, 1e-4, 1e-4),
    "apex_epsilon": (0.6, 0.4, 0.4),
}
FAMILIES = ("vectors", "grids", "images")
"""the columns of ``PRESETS``, as ``Config.family`` names them"""
TARGET_COPIES = 20
"""a run planned for N train steps copies its target network every N / ``TARGET_COPIES`` train steps (within
``TARGET_PERIOD``) when ``target_update_interval`` is None"""
TARGET_PERIOD = (100, 2500)
"""the fewest and the most train steps between two target copies a budget derives (2,500: the paper's, and
the period of a run without a planned end)"""


@dataclass
class Config(RLConfig):
    """R2D2 settings (the paper's values unless a field says otherwise)."""

    algorithm: ClassVar[str] = "r2d2"
    weights_depend_on: ClassVar[tuple[str, ...]] = ("value_rescale",)

    envs_per_actor: int = 8
    """envs each actor (and Runner.train) steps at once, one batched forward pass of the network"""
    hidden_block: MLPBlockConfig = field(default_factory=lambda: MLPBlockConfig((64, 64)))
    """the layers between a vector observation and the recurrent core (the ``mlp`` encoder)"""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """the network from observation to features (``srl.rl.networks``): "auto" is ``hidden_block`` for vectors,
    the Nature CNN for images of 36x36 and up (the paper's), the MinAtar CNN for smaller ones"""
    recurrent: str = "lstm"
    """the recurrent cell: "lstm" (the paper's) or "gru\""""
    recurrent_size: int = 128
    """units of the cell (the paper: 512, for Atari; 128 serves vector tasks and MinAtar at a quarter of the
    cost on a CPU)"""
    memory: MemoryConfig = field(default_factory=lambda: MemoryConfig(capacity=10_000, alpha=0.9,
                                                                        beta_initial=0.6))
    """replay of sequences (capacity counts sequences: 10,000 of 80 steps, 40 new each, hold 400,000 steps);
    the paper's priority exponent 0.9 and importance exponent 0.6 (annealed here to 1 over ``beta_steps``
    samples, as srl's prioritized replay does; the paper keeps it at 0.6)"""
    sequence_length: int = 80
    """L: steps per stored sequence, burn-in included"""
    overlap: int = 40
    """steps two successive sequences of an env share (a new sequence every L - overlap steps)"""
    burn_in: int = 40
    """steps at a sequence's start that only bring the recurrent state up to date (no loss on them)"""
    n_step: int = 5
    """steps summed into each return before bootstrapping"""
    gamma: float = 0.997
    """discount factor"""
    batch_size: int = 64
    """sequences per gradient step"""
    warmup_size: int = 100
    """sequences in memory before training starts"""
    env_steps_per_train: float | None = 40.0
    """env steps per train step, one process and distributed alike (40: one new sequence's worth per step of
    64 sequences); None: actors run flat out"""
    lr: float | None = None
    """Adam learning rate (with the paper's ε of 1e-3); None: the preset of the env's family (``PRESETS``: 1e-3
    vectors, 1e-4 grids and images, the paper's)"""
    target_update_interval: int | None = None
    """train steps between copies of the online network into the target network; None: derived from the run's
    budget, its planned train steps / ``TARGET_COPIES`` (20) within 100..2,500 (the paper's 2,500 is three
    copies in a run of 300k env steps; a run without a planned end takes 2,500)"""
    priority_eta: float = 0.9
    """η of a sequence's priority: η max |δ| + (1 - η) mean |δ| over its learned steps"""
    value_rescale: bool = True
    """learn h(Q) with h(x) = sign(x)(sqrt(|x|+1)-1) + 0.001x (the paper's), not Q"""
    epsilon: float = 0.1
    """exploration rate of a lone env (one process or one actor, stepping one env); several envs follow Ape-X's
    schedule (one ε for all of them: set ``apex_epsilon`` to it and ``apex_alpha`` to 0)"""
    apex_epsilon: float | None = None
    """Ape-X base ε: env i of N > 1 (every actor's envs) explores with apex_epsilon ** (1 + apex_alpha * i / (N - 1));
    None: the preset of the env's family (``PRESETS``: 0.6 for vectors, Ape-X's 0.4 for grids and images)"""
    apex_alpha: float = 7.0
    """Ape-X exponent spread across the envs"""
    test_epsilon: float = 0.0
    """exploration rate while evaluating"""
    max_grad_norm: float = 40.0
    """gradient norm clip"""
    publish_every: int = 10
    """distributed: train steps between params publications"""
    action_bins: int = 5
    """values per dimension when a Box action space is binned"""
    store_frames_once: bool = True
    """for stacked frames (Atari's 4): a sequence carries L + 4 frames, not 4 per step and 4 for last_obs"""

    def validate(self) -> None:
        super().validate()
        self.hidden_block.validate()
        self.encoder.validate()
        self.memory.validate()
        check_recurrent(self.recurrent, self.recurrent_size)
        if self.recurrent is None:
            raise ValueError("r2d2 is recurrent by definition: recurrent must be 'lstm' or 'gru'")
        check_int("sequence_length", self.sequence_length, 2, 4096)
        check_int("overlap", self.overlap, 0, self.sequence_length - 1)
        check_int("burn_in", self.burn_in, 0, self.sequence_length - 1)
        check_int("n_step", self.n_step, 1, 1000)
        check_number("gamma", self.gamma, 0.0, 1.0, low_open=True)
        check_int("batch_size", self.batch_size, 1, 1 << 14)
        check_int("warmup_size", self.warmup_size, 1, 1 << 30)
        if self.env_steps_per_train is not None:
            check_number("env_steps_per_train", self.env_steps_per_train, 0.0, 1e6, low_open=True)
        if self.lr is not None:
            check_number("lr", self.lr, 0.0, 1.0, low_open=True)
        if self.target_update_interval is not None:
            check_int("target_update_interval", self.target_update_interval, 1, 2**62)
        check_number("priority_eta", self.priority_eta, 0.0, 1.0)
        for name in ("epsilon", "apex_epsilon", "test_epsilon"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), 0.0, 1.0)
        check_number("apex_alpha", self.apex_alpha, 0.0, 1000.0)
        check_number("max_grad_norm", self.max_grad_norm, 0.0, 1e9, low_open=True)
        check_int("publish_every", self.publish_every, 1, 1 << 30)
        check_int("action_bins", self.action_bins, 2, 1024)
        if self.burn_in > self.overlap:
            raise ValueError(f"burn_in ({self.burn_in}) is longer than overlap ({self.overlap}): the steps between "
                             "them would only ever be burn-in, never learned from; make overlap at least burn_in")
        if self.warmup_size < self.batch_size:
            raise ValueError(f"warmup_size ({self.warmup_size}) must be at least batch_size ({self.batch_size})")
        if self.memory.capacity < self.warmup_size:
            raise ValueError(f"memory.capacity ({self.memory.capacity}) is smaller than warmup_size "
                             f"({self.warmup_size}); training would never start")

    def family(self, spec: EnvSpec) -> str:
        """The preset family of ``spec`` (``FAMILIES``): images (grids under the Nature CNN's smallest side, as
        MinAtar's), else vectors."""
        if spec.image:
            return "grids" if self.encoder.small_image(spec) else "images"
        return "vectors"

    def resolved(self, spec: EnvSpec) -> Config:
        """A copy with every ``None`` field of ``PRESETS`` set to the preset of ``spec``'s family."""
        column = FAMILIES.index(self.family(spec))
        changes = {name: preset[column] for name, preset in PRESETS.items() if getattr(self, name) is None}
        return dataclasses.replace(self, **changes) if changes else self

    def settled(self, env_config: EnvConfig) -> Config:
        if all(getattr(self, name) is not None for name in PRESETS):
            return self
        spec = env_spec(env_config)
        settled = self.resolved(spec)
        left = [name for name in PRESETS if getattr(self, name) is None]
        logger.info("%s", preset_note(self, self.family(spec), env_config.id,
                                      {name: getattr(settled, name) for name in left}))
        return settled

    def budget_settings(self, max_steps: int | None, max_train_count: int | None) -> dict[str, Any]:
        if self.target_update_interval is not None:
            return {}
        planned = planned_train_steps(max_steps, max_train_count, self.env_steps_per_train)
        low, high = TARGET_PERIOD
        period = high if planned is None else int(min(high, max(low, planned // TARGET_COPIES)))
        return {"target_update_interval": period}

    @property
    def period(self) -> int:
        """Steps between two sequences of an env (the new steps each brings)."""
        return self.sequence_length - self.overlap

    def actor_epsilon(self, actor_index: int, actor_num: int) -> np.ndarray:
        """ε of each env of actor ``actor_index`` of ``actor_num`` (Ape-X's schedule over all their envs); a config
        whose ``apex_epsilon`` is left to its family's preset must be ``resolved`` for an env first."""
        if self.apex_epsilon is None:
            raise ValueError("apex_epsilon is None (its family's preset): resolve the config for an env first "
                             "(Config.resolved(spec)), or set apex_epsilon")
        return env_epsilons(self.epsilon, self.apex_epsilon, self.apex_alpha, actor_index, actor_num,
                            self.envs_per_actor)

    def check_spec(self, spec: EnvSpec) -> None:
        action_table(spec, self.action_bins)
        self.encoder.check(spec)

    def data_path(self) -> DataPath:
        return DataPath(rows="segments", publish_every=self.publish_every, env_steps_per_train=self.env_steps_per_train,
                        warmup_rows=self.warmup_size, row_steps=self.period, row_lead=self.overlap)

    def frames(self, spec: EnvSpec) -> int:
        """The stack size when sequences carry each frame once (0: they carry stacks)."""
        return spec.frame_stack if self.store_frames_once and spec.frame_stack > 1 else 0

    def schema(self, spec: EnvSpec) -> Schema:
        length = self.sequence_length
        return Schema({
            **segment_observation_columns(spec, length, self.frames(spec)),
            **state_columns(self.recurrent, 1, self.recurrent_size),
            "state_reset": Column("bool", (length,)),
            "action": Column("int64", (length,), low=0, high=action_count(spec, self.action_bins) - 1),
            "reward": Column("float32", (length,), low=-VALUE_BOUND, high=VALUE_BOUND),
            "done": Column("bool", (length,)),
            "version": Column("int64", (), low=0),
        })  # no priorities from actors: new sequences enter at the replay's highest (see the module docstring)

    def make_parameter(self, spec: EnvSpec, device: torch.device) -> R2D2Parameter:
        return R2D2Parameter(self.resolved(spec), spec, device)

    def make_worker(
        self, spec: EnvSpec, parameter: Parameter, actor_index: int, actor_num: int, seed: int | None
    ) -> R2D2Worker:
        assert isinstance(parameter, R2D2Parameter)
        config = self.resolved(spec)
        return R2D2Worker(config, parameter, config.actor_epsilon(actor_index, actor_num), self.envs_per_actor, seed)

    def make_buffer(self, spec: EnvSpec, actor_num: int = 1) -> Memory:
        return self.memory.build(seed=self.seed, schema=self.schema(spec))

    def make_learner(self, spec: EnvSpec, parameter: Parameter, buffer: Buffer, actor_num: int = 1) -> R2D2Learner:
        assert isinstance(parameter, R2D2Parameter) and isinstance(buffer, Memory)
        return R2D2Learner(self.resolved(spec), parameter, buffer)


class RecurrentQNetwork(nn.Module):
    """Encoder, recurrent core, dueling head: Q values per step."""

    def __init__(self, config: Config, spec: EnvSpec, n_actions: int) -> None:
        super().__init__()
        self.body, size = config.encoder.build(spec, config.hidden_block)
        self.core = RecurrentCore(config.recurrent, size, config.recurrent_size)
        self.value = nn.Linear(config.recurrent_size, 1)
        self.advantage = nn.Linear(config.recurrent_size, n_actions)

    def initial_state(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        return stack_states([self.core.initial(batch, device)])

    def _head(self, features: torch.Tensor) -> torch.Tensor:
        adv = self.advantage(features)
        q: torch.Tensor = self.value(features) + adv - adv.mean(dim=-1, keepdim=True)
        return q

    def step(self, obs: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Q of one observation per env, and the next state (``(E, 1, size)``)."""
        out, state = self.core.step(self.body(obs), split_states(h, c)[0])
        h, c = stack_states([state])
        return self._head(out), h, c

    def unroll(self, obs: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None, resets: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Q over sequences ``obs`` ``(n, T, *obs)`` -> ``(n, T, actions)`` from the states ``(n, 1, size)``,
        zeroed where ``resets`` ``(n, T)``; and the state after the last step."""
        n, length = obs.shape[:2]
        features = self.body(obs.reshape(n * length, *obs.shape[2:])).view(n, length, -1)
        out, state = self.core.unroll(features, split_states(h, c)[0], resets)
        h, c = stack_states([state])
        return self._head(out), h, c


class R2D2Parameter(Parameter):
    """The online network (the target network is the learner's own)."""

    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        self.device = device
        self.n_actions = action_count(spec, config.action_bins)
        self.actions = action_table(spec, config.action_bins)
        self.frames = config.frames(spec)
        self.q = RecurrentQNetwork(config, spec, self.n_actions).to(device)

    def to_arrays(self) -> dict[str, np.ndarray]:
        return torch_to_arrays({"q": self.q})

    def from_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        torch_from_arrays({"q": self.q}, arrays)


def sequence_frames(obs: np.ndarray, last_obs: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stacked observations ``(n, L, S, ...)`` and ``last_obs`` ``(n, S, ...)`` as each frame once: ``frames``
    ``(n, L + S, ...)`` (the first stack's S frames, then the newest frame of every later observation) and
    ``first`` (an episode starts at that frame: ``starts`` ``(n, L)``), the columns ``segment_observations``
    rebuilds the stacks from."""
    n, length, stack = obs.shape[:3]
    frames = np.concatenate([obs[:, 0, : stack - 1], obs[:, :, -1], last_obs[:, None, -1]], axis=1)
    first = np.zeros((n, length + stack), bool)
    first[:, stack - 1 : stack - 1 + length] = starts
    return frames, first


class R2D2Worker(Worker):
    """ε-greedy over the recurrent Q network in E envs; the last L steps of every env every L - overlap steps."""

    def __init__(self, config: Config, parameter: R2D2Parameter, epsilon: float | np.ndarray, num_envs: int,
                 seed: int | None) -> None:
        self.config = config
        self.parameter = parameter
        self.epsilon = np.broadcast_to(np.asarray(epsilon, dtype=np.float64), (num_envs,))
        """each env's ε"""
        self.num_envs = num_envs
        self.rng = np.random.default_rng(seed)
        self.length = config.sequence_length
        self._h, self._c = parameter.q.initial_state(num_envs, parameter.device)
        self._resetting = np.ones(num_envs, bool)
        """the state was zeroed since the env's last step (an episode starts)"""
        self._steps = 0
        """steps recorded since the worker started (the ring holds the last L)"""
        self._ring: dict[str, np.ndarray] = {}
        self._ready: list[Columns] = []
        self._last: np.ndarray | None = None
        """the observations acted on last (stacked frames: the next ones must slide from them)"""

    def _record(self, slot: int, **values: np.ndarray) -> None:
        for name, value in values.items():
            if name not in self._ring:
                self._ring[name] = np.zeros((self.length, *value.shape), value.dtype)
            self._ring[name][slot] = value

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        index = torch.from_numpy(np.asarray(env_ids, np.int64)).to(self.parameter.device)
        with torch.inference_mode():  # only these envs' episodes start: the others keep their state
            self._h[index] = 0.0
            if self._c is not None:
                self._c[index] = 0.0
        self._resetting[env_ids] = True

    def act(self, obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.act_with(obs, self.policy(self.policy_inputs(obs)))

    def policy_inputs(self, obs: np.ndarray) -> PolicyIO:
        return torch.from_numpy(obs).to(self.parameter.device), self._h, self._c

    def policy(self, inputs: PolicyIO) -> PolicyIO:
        return tuple(self.parameter.q.step(*inputs))

    def act_with(self, obs: np.ndarray, outputs: PolicyIO) -> np.ndarray:
        before = self._h, self._c
        q, self._h, self._c = outputs
        action = q.argmax(dim=1).cpu().numpy().astype(np.int64)
        explore(self.rng, action, self.epsilon if self.training else self.config.test_epsilon,
                self.parameter.n_actions)
        if self.training:
            if self.parameter.frames:  # each frame goes once: the stacks must slide as the env made them
                if self._last is not None:
                    check_stacks(self._last, obs, self._resetting)
                self._last = obs
            state = {"state_h": before[0].cpu().numpy()}
            if before[1] is not None:
                state["state_c"] = before[1].cpu().numpy()
            self._record(self._steps % self.length, obs=obs, action=action, state_reset=self._resetting.copy(),
                         version=np.full(self.num_envs, self.parameter.version, np.int64), **state)
            self._resetting[:] = False
        table = self.parameter.actions
        return action if table is None else table[action]

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        if not self.training:
            return
        reward = reward.astype(np.float32).copy()
        cut = truncated & ~terminated
        if cut.any():  # a time limit, not a failure: bootstrap from the final observation
            index = torch.from_numpy(np.flatnonzero(cut)).to(self.parameter.device)
            with torch.inference_mode():
                c = None if self._c is None else self._c[index]
                q = self.parameter.q.step(torch.from_numpy(next_obs[cut]).to(self.parameter.device),
                                          self._h[index], c)[0].max(dim=1).values
                value = unrescale(q) if self.config.value_rescale else q
            reward[cut] += self.config.gamma * value.cpu().numpy()
        self._record(self._steps % self.length, reward=reward, done=terminated | truncated)
        self._steps += 1
        if self._steps >= self.length and (self._steps - self.length) % self.config.period == 0:
            self._emit(next_obs)

    def _emit(self, next_obs: np.ndarray) -> None:
        """Every env's last L steps become a sequence."""
        order = (self._steps + np.arange(self.length)) % self.length  # oldest first
        ring = self._ring
        obs, starts = ring["obs"][order].swapaxes(0, 1), ring["state_reset"][order].T.copy()
        if self.parameter.frames:
            frames, first = sequence_frames(obs, next_obs, starts)
            observations = {"frames": frames, "first": first}
        else:
            observations = {"obs": obs.copy(), "last_obs": np.array(next_obs, dtype=obs.dtype)}
        oldest = order[0]
        state: Columns = {name: ring[name][oldest].copy() for name in ("state_h", "state_c") if name in ring}
        self._ready.append({
            **observations, **state, "state_reset": starts,
            "action": ring["action"][order].T.copy(),
            "reward": ring["reward"][order].T.copy(),
            "done": ring["done"][order].T.copy(),
            "version": ring["version"][oldest].copy(),
        })

    def pending(self) -> int:
        return sum(len(rows["version"]) for rows in self._ready)

    def take(self) -> Columns | None:
        ready, self._ready = self._ready, []
        return concat_rows(ready)

    def stats(self) -> dict[str, float]:
        return {"epsilon": float(self.epsilon.mean())}  # the mean over its envs


def n_step_targets(reward: torch.Tensor, done: torch.Tensor, gamma: float, n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For steps ``(B, M)``: the n-step return of each, the discount its bootstrap gets (γ^k for a k-step
    sum, 0 after an episode's end) and the index of the observation it bootstraps from (``t + k``, at most
    M: the observation after the last step), the sums cut at an end and at the sequence's end."""
    steps = reward.shape[1]
    t = torch.arange(steps, device=reward.device)
    returns = torch.zeros_like(reward)
    discount = torch.ones_like(reward)
    for k in range(n):
        index = t + k
        inside = (index < steps).to(reward.dtype)
        clamped = index.clamp(max=steps - 1)
        returns = returns + discount * reward[:, clamped] * inside
        live = 1.0 - done[:, clamped].to(reward.dtype)
        discount = discount * (inside * gamma * live + (1.0 - inside))
    return returns, discount, (t + n).clamp(max=steps)


def sequence_priorities(td_abs: torch.Tensor, eta: float) -> torch.Tensor:
    """A priority per sequence from its |TD errors| ``(B, M)``: η max + (1 - η) mean (the paper's mix: the
    max alone would rank every sequence by its worst step, the mean would wash a rare large error out)."""
    return eta * td_abs.max(dim=1).values + (1.0 - eta) * td_abs.mean(dim=1)


@dataclass
class R2D2Stats(TrainStats):
    """One gradient step on a batch of sequences."""

    td_abs: float = 0.0
    """mean |TD error| over the learned steps (in h-space with value rescaling)"""
    q_mean: float = 0.0
    nonfinite_losses: int = 0
    """steps skipped so far because the loss was NaN or infinite"""


class R2D2Learner(Learner):
    """One gradient step per ``train()``: sample sequences, burn in, learn from the rest, update priorities."""

    optimizer: torch.optim.Optimizer

    def __init__(self, config: Config, parameter: R2D2Parameter, memory: Memory) -> None:
        self.config = config
        self.parameter = parameter
        self.memory = memory
        self.device = parameter.device
        self.target = copy.deepcopy(parameter.q)
        self.target.requires_grad_(False)
        assert config.lr is not None, "the learner is made from a resolved config (Config.resolved)"
        self.optimizer = make_adam(parameter.q.parameters(), config.lr, eps=1e-3)
        self.target_period = config.target_update_interval or TARGET_PERIOD[1]
        """train steps between target copies: the config's, else derived from the run's budget (``plan``)"""
        self.train_count = 0
        self.nonfinite_losses = 0
        self.compute = LearnerCompute.of(config, self.device)
        self.compute.prepare([parameter.q.body, self.target.body])  # the encoders: ``unroll`` is not a forward
        self.batches = self.compute.ahead(self._draw)

    def _draw(self) -> DeviceSample:
        """A sample of sequences on the device: the L + 1 observations (stacks rebuilt from frames), the
        recurrent state at each start and where the actor reset it, the action, reward and done after burn-in."""
        sample, dev, burn = self.memory.sample(self.config.batch_size), self.device, self.config.burn_in
        b = sample.batch
        observations, last_obs = segment_observations(b, self.parameter.frames)
        obs = torch.cat([to_device(observations, dev), to_device(last_obs, dev).unsqueeze(1)], dim=1)
        h, c, resets = segment_states(b, dev)
        columns = {"obs": obs, "state_h": h, "state_reset": torch.cat([resets, torch.zeros_like(resets[:, :1])], dim=1),
                   **({} if c is None else {"state_c": c})}
        for name in ("action", "reward", "done"):
            columns[name] = to_device(np.ascontiguousarray(b[name][:, burn:]), dev)
        return DeviceSample(columns, to_device(sample.weights, dev), sample.indices, sample.generations)

    def plan(self, max_steps: int | None, max_train_count: int | None, env_steps: int = 0) -> None:
        """With ``target_update_interval`` None, the target's period follows the run's budget
        (``Config.budget_settings``)."""
        derived = self.config.budget_settings(max_steps, max_train_count)
        if "target_update_interval" in derived:
            self.target_period = derived["target_update_interval"]

    def sync_target(self) -> None:
        self.target.load_state_dict(self.parameter.q.state_dict())

    def on_parameters_loaded(self) -> None:
        self.sync_target()

    def extra_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return torch_to_arrays({"target": self.target}), {}

    def load_extra_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        torch_from_arrays({"target": self.target}, dict(arrays))

    def train(self) -> R2D2Stats | None:
        config = self.config
        if len(self.memory) < config.warmup_size:
            return None
        sample = self.batches.take()
        b = sample.columns
        obs, h, c, resets = b["obs"], b["state_h"], b.get("state_c"), b["state_reset"]
        burn = config.burn_in
        q_net = self.parameter.q
        with self.compute.autocast():  # the Q-values back to float32 before the targets and the loss
            with torch.no_grad():
                if burn:
                    _, h_online, c_online = q_net.unroll(obs[:, :burn], h, c, resets[:, :burn])
                else:
                    h_online, c_online = h, c
                q_target = self.target.unroll(obs, h, c, resets)[0][:, burn:].float()
            q_all = q_net.unroll(obs[:, burn:], h_online, c_online, resets[:, burn:])[0].float()  # (B, M + 1, A)
            steps = q_all.shape[1] - 1
            q_sa = q_all[:, :steps].gather(2, b["action"].unsqueeze(2)).squeeze(2)
            with torch.no_grad():
                returns, discount, index = n_step_targets(b["reward"], b["done"], config.gamma, config.n_step)
                best = q_all.detach()[:, index].argmax(dim=2, keepdim=True)
                next_q = q_target[:, index].gather(2, best).squeeze(2)
                if config.value_rescale:
                    target = rescale(returns + discount * unrescale(next_q))
                else:
                    target = returns + discount * next_q
            td = target - q_sa
            loss = (sample.weights * 0.5 * (td**2).mean(dim=1)).mean()
        if not torch.isfinite(loss):  # one diverged batch must not poison the weights
            self.nonfinite_losses += 1
            return R2D2Stats(loss=float("nan"), gradient_steps=0, nonfinite_losses=self.nonfinite_losses)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(q_net.parameters(), config.max_grad_norm)
        self.optimizer.step()
        td_abs = td.detach().abs()
        priorities = sequence_priorities(td_abs, config.priority_eta)
        self.memory.update_priorities(sample.indices, priorities.cpu().numpy(), sample.generations)
        self.train_count += 1
        if self.train_count % self.target_period == 0:
            self.sync_target()
        return R2D2Stats(loss=float(loss.item()), td_abs=float(td_abs.mean().item()),
                         q_mean=float(q_sa.detach().mean().item()), nonfinite_losses=self.nonfinite_losses)


def planned_train_steps(max_steps: int | None, max_train_count: int | None,
                        env_steps_per_train: float | None) -> int | None:
    """The train steps a run's limits plan: ``max_train_count``, else ``max_steps`` at ``env_steps_per_train``
    (None: neither bounds them)."""
    if max_train_count is not None:
        return max_train_count
    if max_steps is None or env_steps_per_train is None:
        return None
    return int(max_steps / env_steps_per_train)
