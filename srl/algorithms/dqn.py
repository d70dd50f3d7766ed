"""DQN with the Ape-X pieces: n-step returns, double Q, dueling head, prioritized replay.

Read top to bottom: ``Config`` (every setting, documented, and the data path:
n-step transitions into a prioritized replay, params published every
``publish_every`` train steps, ``env_steps_per_train`` env steps per train step
in one process and across actors alike), the Q network, ``Parameter`` (the
online network and, for binned Box actions by default, the average of its
weights the greedy policy acts with; weights <-> arrays), ``Worker`` (acts
ε-greedily in E envs with one batched forward pass, greedily with the average;
builds n-step transitions per env, computes their initial priorities) and
``Learner`` (samples, learns, moves the average, returns priority updates). Must never: know about Redis or queues.

Actions: Discrete natively; a bounded Box is binned into ``action_bins`` values
per dimension and a MultiDiscrete into its product, both here (the worker maps
the chosen index to the env action); the ``action`` column is the index.

Exploration: Ape-X's schedule over every env of every actor: env i of the N = actors x
``envs_per_actor`` envs explores with ε_i = apex_epsilon ** (1 + apex_alpha * i / (N - 1)) (two envs an
actor by default, so one process or a lone actor explores with 0.4 and 0.0007); a lone env
(``envs_per_actor=1`` in one process or one actor) uses ``epsilon``, or with ``epsilon_decay`` anneals linearly from
``epsilon_start`` to it over that share of the run's planned env steps (the DQN paper's schedule); a worker
that joins a run under way (a replaced actor, a resumed run) takes it up where its params' version says the
run is.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from srl.base.config import check_int, check_number
from srl.base.env import BoxActions, DiscreteActions, EnvConfig, EnvError, EnvSpec, MultiDiscreteActions
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
    torch_from_arrays,
    torch_to_arrays,
)
from srl.base.schema import Column, Schema
from srl.rl.ahead import DeviceSample, LearnerCompute, sample_to_device
from srl.rl.blocks import MLPBlockConfig, make_adam, to_device
from srl.rl.memories import Memory, MemoryConfig
from srl.rl.memories.frames import (
    FrameMemory,
    FrameWriter,
    check_stacks,
    frame_row_columns,
    frame_rows_problem,
    stacks_of,
)
from srl.rl.networks import EncoderConfig

logger = logging.getLogger("srl.dqn")

VALUE_BOUND = 1e9
"""observations and returns beyond this are refused as rows (no env of sense produces them)"""
MAX_ACTIONS = 4096
GREEDY_AVERAGE_TAU_BOX = 0.0002
"""``greedy_average_tau`` when None and the env's actions are a (binned) Box"""
LOSSES: dict[str, Callable[..., torch.Tensor]] = {"mse": F.mse_loss, "huber": F.smooth_l1_loss}
"""the TD losses ``Config.loss`` names"""


@dataclass
class Config(RLConfig):
    """DQN settings. ``hidden_block.set_mlp((64, 64))``, ``memory.set_proportional_memory()``."""

    algorithm: ClassVar[str] = "dqn"
    saved_before: ClassVar[dict[str, Any]] = {"scale_obs": False, "value_rescale": False, "greedy_average_tau": 0.0,
                                              "advantage_learning": 0.0, "epsilon_decay": 0.0}
    weights_depend_on: ClassVar[tuple[str, ...]] = ("scale_obs", "value_rescale")

    envs_per_actor: int = 2
    """envs each actor steps (one process: envs it steps), each with its own ε of Ape-X's schedule: two, so
    that one process or a lone actor explores as two Ape-X actors do (ε 0.4 and 0.0007), not with one ε"""
    hidden_block: MLPBlockConfig = field(default_factory=MLPBlockConfig)
    """the layers between a vector observation and the Q head (the ``mlp`` encoder)"""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """the network from observation to features (``srl.rl.networks``): "auto" is ``hidden_block`` for vectors,
    the Nature CNN for images of 36x36 and up, the MinAtar CNN for smaller ones"""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """replay memory (uniform or proportional)"""
    batch_size: int = 64
    """transitions per gradient step"""
    warmup_size: int = 1000
    """transitions in memory before training starts"""
    env_steps_per_train: float | None = 1.0
    """env steps per train step, one process and distributed alike (in a distributed run all actors
    together step at most this many; None: actors run flat out, the Ape-X way for many actors and a
    big memory)"""
    publish_every: int = 100
    """distributed: train steps between params publications (actors act with params about this old)"""
    lr: float = 1e-3
    """Adam learning rate"""
    gamma: float = 0.99
    """discount factor"""
    n_step: int = 3
    """steps summed into each return before bootstrapping"""
    target_update_interval: int = 750
    """train steps between copies of the online network into the target network (with ``target_tau`` 0)"""
    target_tau: float = 0.0
    """0: copy the online network into the target every ``target_update_interval`` steps; in (0, 1]: move
    the target this far towards the online network after every step instead (Polyak averaging)"""
    double_q: bool = True
    """choose the next action with the online network, value it with the target network"""
    dueling: bool = True
    """split the head into state value and action advantages"""
    advantage_learning: float = 0.0
    """advantage learning (Bellemare et al. 2016): the target also subtracts this times the target network's
    gap between the best action and the taken one at the start of the transition, which widens the gap
    between the greedy action and the others (by up to 1 / (1 - this)) and leaves the greedy action as it
    is; 0: plain Q-learning"""
    epsilon: float = 0.1
    """exploration rate of a lone env (``envs_per_actor=1`` in one process or one actor), once ``epsilon_decay`` is
    over; several envs follow Ape-X's schedule (one ε for all of them: set ``apex_epsilon`` to it and
    ``apex_alpha`` to 0)"""
    epsilon_start: float = 1.0
    """with ``epsilon_decay``: a lone env's exploration rate when training starts, annealed linearly to
    ``epsilon``"""
    epsilon_decay: float = 0.0
    """the share of the run's planned env steps (``max_steps``, else ``warmup_size`` and ``max_train_count``
    train steps' worth at ``env_steps_per_train``) over which a lone env's ε falls from ``epsilon_start`` to
    ``epsilon`` (the DQN paper's schedule; SB3's and CleanRL's ``exploration_fraction``, 0.5 in CleanRL's
    classic control); a later ``train()`` call plans its end anew. 0 (the default), or a run that plans no
    env steps (a timeout alone; train steps with ``env_steps_per_train`` None): ``epsilon`` throughout"""
    apex_epsilon: float = 0.4
    """Ape-X base ε: env i of N > 1 (every actor's envs) explores with apex_epsilon ** (1 + apex_alpha * i / (N - 1))"""
    apex_alpha: float = 7.0
    """Ape-X exponent spread across the envs"""
    test_epsilon: float = 0.0
    """exploration rate while evaluating"""
    greedy_average_tau: float | None = None
    """the greedy policy (``runner.evaluate``, evaluation during training, the final params) acts with an
    average of the online network's weights: their mean over the steps so far, then an exponential average
    moved this far towards them after each gradient step (0.0002: about the last 5,000 steps; never more
    than the last quarter of a planned run); exploring actors keep the online network. 0: the online network
    itself. None: 0.0002 for a binned Box action space (its greedy choice among neighbouring bins flickers
    from step to step), 0 for Discrete and MultiDiscrete"""
    loss: str = "huber"
    """TD loss: "huber" (smooth L1: squared below an error of 1, linear beyond; Ape-X, SB3) or "mse" (squared
    error throughout; CleanRL)"""
    value_rescale: bool = False
    """learn h(Q) with R2D2's h(x) = sign(x)(sqrt(|x|+1)-1) + 0.001x, so returns of any scale fall in the
    loss's useful range"""
    max_grad_norm: float = 10.0
    """gradient norm clip"""
    reward_scale: float | None = 1.0
    """rewards are multiplied by this before learning. None: set before training to 1 / the reward std of
    1,000 random-action steps of the env, as a power of sqrt(10), at most 1 (``probe_reward_scale``)"""
    action_bins: int = 5
    """values per dimension when a Box action space is binned"""
    store_frames_once: bool = True
    """for stacked frames (Atari's 4): send and keep each frame once, the transitions pointing at them, and
    rebuild the stacks when sampling (``srl.rl.memories.frames``); False: every row carries its two stacks"""
    scale_obs: bool = False
    """map each observation dimension with finite bounds onto [-1, 1] before the network (e.g. MountainCar's
    velocity, within +-0.07, next to its position): a fixed map from the env's observation space, not running
    statistics, so stored transitions keep their targets"""

    def validate(self) -> None:
        super().validate()
        self.hidden_block.validate()
        self.encoder.validate()
        self.memory.validate()
        check_int("batch_size", self.batch_size, 1, 1 << 16)
        check_int("warmup_size", self.warmup_size, 0, 1 << 30)
        check_int("action_bins", self.action_bins, 2, 1024)
        check_int("publish_every", self.publish_every, 1, 1 << 30)
        if self.env_steps_per_train is not None:
            check_number("env_steps_per_train", self.env_steps_per_train, 0.0, 1e6, low_open=True)
        check_number("lr", self.lr, 0.0, 1.0, low_open=True)
        check_number("gamma", self.gamma, 0.0, 1.0, low_open=True)
        check_int("n_step", self.n_step, 1, 1000)
        check_int("target_update_interval", self.target_update_interval, 1, 2**62)
        check_number("target_tau", self.target_tau, 0.0, 1.0)
        check_number("advantage_learning", self.advantage_learning, 0.0, 0.99)
        if self.greedy_average_tau is not None:
            check_number("greedy_average_tau", self.greedy_average_tau, 0.0, 1.0)
        for name in ("epsilon", "epsilon_start", "epsilon_decay", "apex_epsilon", "test_epsilon"):
            check_number(name, getattr(self, name), 0.0, 1.0)
        check_number("apex_alpha", self.apex_alpha, 0.0, 1000.0)
        check_number("max_grad_norm", self.max_grad_norm, 0.0, 1e9, low_open=True)
        if self.reward_scale is not None:
            check_number("reward_scale", self.reward_scale, -1e9, 1e9)
        if self.loss not in LOSSES:
            close = difflib.get_close_matches(str(self.loss)[:64], list(LOSSES), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {str(self.loss)[:40]!r}{hint}")
        if self.warmup_size < self.batch_size:
            raise ValueError(f"warmup_size ({self.warmup_size}) must be at least batch_size ({self.batch_size})")
        if self.memory.capacity < self.warmup_size:
            raise ValueError(
                f"memory.capacity ({self.memory.capacity}) is smaller than warmup_size ({self.warmup_size}); "
                "training would never start"
            )

    def settled(self, env_config: EnvConfig) -> Config:
        if self.reward_scale is not None:
            return self
        scale, std = probe_reward_scale(env_config)
        logger.info("reward_scale %.3g: reward std %.3g over %d random-action steps of %r (set reward_scale to "
                    "choose it)", scale, std, REWARD_PROBE_STEPS, env_config.id)
        return dataclasses.replace(self, reward_scale=scale)

    def unsettled(self) -> list[str]:
        return ["reward_scale"] if self.reward_scale is None else []

    def greedy_average(self, spec: EnvSpec) -> float:
        """``greedy_average_tau``, or its default for ``spec``'s action space when None."""
        if self.greedy_average_tau is not None:
            return self.greedy_average_tau
        return GREEDY_AVERAGE_TAU_BOX if isinstance(spec.actions, BoxActions) else 0.0

    def actor_epsilon(self, actor_index: int, actor_num: int) -> np.ndarray:
        """ε of each env of actor ``actor_index`` of ``actor_num`` (Ape-X's schedule over all their envs)."""
        return env_epsilons(self.epsilon, self.apex_epsilon, self.apex_alpha, actor_index, actor_num,
                            self.envs_per_actor)

    def check_spec(self, spec: EnvSpec) -> None:
        action_table(spec, self.action_bins)
        self.encoder.check(spec)

    def data_path(self) -> DataPath:
        return DataPath(rows="transitions", publish_every=self.publish_every,
                        env_steps_per_train=self.env_steps_per_train, warmup_rows=self.warmup_size)

    def frame_rows(self, spec: EnvSpec) -> bool:
        """Whether rows are frames (``store_frames_once`` and a stacked observation), not transitions."""
        return self.store_frames_once and spec.frame_stack > 1

    def schema(self, spec: EnvSpec) -> Schema:
        """n-step transitions; ``discount`` is gamma**k, 0 after a terminal step; ``action`` an index. With
        ``frame_rows``: a row per frame, the transition on the row of its observation's newest frame."""
        n_actions = action_count(spec, self.action_bins)
        transition = {
            "action": Column("int64", (), low=0, high=n_actions - 1),
            "reward": Column("float32", (), low=-VALUE_BOUND, high=VALUE_BOUND),
            "discount": Column("float32", (), low=0.0, high=1.0),
            "version": Column("int64", (), low=0),
        }
        if self.frame_rows(spec):
            columns = {**frame_row_columns(spec.obs_shape[1:], spec.obs_dtype, self.n_step), **transition}
            return Schema(columns, priorities=True, counted_by="transition", split_at="stream_start",
                          check=functools.partial(frame_rows_problem, stack=spec.frame_stack))
        obs = spec.obs_column()
        return Schema({"obs": obs, "next_obs": obs, **transition}, priorities=True)

    def make_parameter(self, spec: EnvSpec, device: torch.device) -> DQNParameter:
        return DQNParameter(self, spec, device)

    def make_worker(
        self, spec: EnvSpec, parameter: Parameter, actor_index: int, actor_num: int, seed: int | None
    ) -> DQNWorker:
        assert isinstance(parameter, DQNParameter)
        return DQNWorker(self, parameter, self.actor_epsilon(actor_index, actor_num), self.envs_per_actor, seed,
                         anneal=actor_num * self.envs_per_actor == 1)

    def make_buffer(self, spec: EnvSpec, actor_num: int = 1) -> Memory:
        if not self.frame_rows(spec):
            return self.memory.build(seed=self.seed, schema=self.schema(spec))
        stack = spec.frame_stack
        refs = Column("int64", (stack,), low=0)
        transitions = Schema({"obs_frames": refs, "next_frames": refs,
                              **{k: c for k, c in self.schema(spec).columns.items()
                                 if k in ("action", "reward", "discount", "version")}}, priorities=True)
        capacity = self.memory.capacity
        # a batch sends the frames its first stacks reach back to again: room for 1/16 more frames
        return FrameMemory(self.memory.build(seed=self.seed, schema=transitions), stack, spec.obs_shape[1:],
                           spec.obs_dtype, capacity + capacity // 16 + FRAME_RING_SLACK)

    def make_learner(self, spec: EnvSpec, parameter: Parameter, buffer: Buffer, actor_num: int = 1) -> DQNLearner:
        assert isinstance(parameter, DQNParameter) and isinstance(buffer, Memory)
        return DQNLearner(self, parameter, buffer)


def apex_epsilon(epsilon: float, base: float, alpha: float, index: int, count: int) -> float:
    """ε of explorer ``index`` of ``count``: ``epsilon`` for a lone one, else the Ape-X schedule
    base ** (1 + alpha * i / (N - 1))."""
    if count <= 1:
        return epsilon
    return float(base ** (1.0 + alpha * index / (count - 1)))


def explore(rng: np.random.Generator, action: np.ndarray, epsilon: float | np.ndarray, n_actions: int) -> None:
    """ε-greedy in place: each env's greedy ``action`` becomes a uniform one with its ``epsilon`` (one for all, or
    one per env). Draws nothing when every ε is 0, so a greedy worker's random stream stays where it was."""
    if np.any(np.asarray(epsilon) > 0.0):
        chosen = rng.random(len(action)) < epsilon
        if chosen.any():
            action[chosen] = rng.integers(n_actions, size=int(chosen.sum()))


def env_epsilons(epsilon: float, base: float, alpha: float, actor_index: int, actor_num: int,
                 envs_per_actor: int) -> np.ndarray:
    """ε of each env of actor ``actor_index``: the Ape-X schedule over all ``actor_num * envs_per_actor`` envs
    (the paper's actors step one env each), so one actor stepping several envs explores as that many
    actors would: a near-greedy env sees the states the greedy policy reaches, an exploring one the rest."""
    count = actor_num * envs_per_actor
    return np.array([apex_epsilon(epsilon, base, alpha, actor_index * envs_per_actor + e, count)
                     for e in range(envs_per_actor)])


FRAME_RING_SLACK = 4096
"""frames the ring holds beyond ``capacity * 17 / 16`` (a small memory's batches reach back as far)"""
REWARD_PROBE_STEPS = 1000
"""random-action env steps ``probe_reward_scale`` looks at"""


def probe_reward_scale(env_config: EnvConfig, steps: int = REWARD_PROBE_STEPS) -> tuple[float, float]:
    """``(scale, std)``: 1 / the standard deviation of the rewards of ``steps`` random-action steps of the env,
    rounded to a power of sqrt(10) (1, 0.316, 0.1, ...) so that a near value gives the same scale, at most 1
    (rewards that barely vary, CartPole's +1 a step, are left alone). Seeded: an env always gets one scale."""
    env = env_config.make()
    rewards = np.empty(steps)
    try:
        env.action_space.seed(0)
        env.reset(seed=0)
        for i in range(steps):
            _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
            rewards[i] = float(reward)
            if terminated or truncated:
                env.reset()
    finally:
        env.close()
    std = float(rewards.std())
    if not math.isfinite(std) or std <= 0.0:
        return 1.0, std
    halves = round(-2.0 * math.log10(std))
    return (1.0 if halves >= 0 else 10.0 ** (halves / 2)), std


def action_count(spec: EnvSpec, action_bins: int) -> int:
    """How many discrete actions DQN chooses among for ``spec`` (EnvError if it cannot act there)."""
    actions = spec.actions
    if isinstance(actions, DiscreteActions):
        return actions.n
    if isinstance(actions, BoxActions):
        n = action_bins ** int(np.prod(actions.shape))
    else:
        n = int(np.prod(actions.nvec))
    if n > MAX_ACTIONS:
        raise EnvError(
            f"DQN would choose among {n} actions in {spec.actions} of {spec.env_id!r} (more than {MAX_ACTIONS}); "
            "lower action_bins or use an algorithm for continuous or multi-discrete actions (PPO)"
        )
    return n


def action_table(spec: EnvSpec, action_bins: int) -> np.ndarray | None:
    """Row i: the env action of DQN's action i (None for a Discrete space, where it is i itself)."""
    actions = spec.actions
    action_count(spec, action_bins)
    if isinstance(actions, DiscreteActions):
        return None
    if isinstance(actions, MultiDiscreteActions):
        return np.array(list(itertools.product(*(range(n) for n in actions.nvec))), dtype=np.int64)
    if not actions.bounded:
        raise EnvError(
            f"DQN bins Box actions but {spec.env_id!r} has unbounded actions {actions}; clip the action space "
            "with a wrapper first, or use PPO"
        )
    low, high = actions.low.reshape(-1), actions.high.reshape(-1)
    axes = [np.linspace(lo, hi, action_bins, dtype=np.float64) for lo, hi in zip(low, high, strict=True)]
    grid = np.array(list(itertools.product(*axes)), dtype=np.float32)
    return grid.reshape((grid.shape[0], *actions.shape))


class QNetwork(nn.Module):
    obs_center: torch.Tensor
    obs_inv_half: torch.Tensor

    def __init__(self, config: Config, spec: EnvSpec, n_actions: int,
                 obs_affine: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        super().__init__()
        self.scaled = obs_affine is not None
        if obs_affine is not None:
            # not persistent: both ends build it from the env's spec, so the params stay the net's own
            center, half = obs_affine
            self.register_buffer("obs_center", torch.from_numpy(center), persistent=False)
            self.register_buffer("obs_inv_half", torch.from_numpy(1.0 / half), persistent=False)
        self.body, size = config.encoder.build(spec, config.hidden_block)
        self.dueling = config.dueling
        if self.dueling:
            self.value = nn.Linear(size, 1)
            self.advantage = nn.Linear(size, n_actions)
        else:
            self.q = nn.Linear(size, n_actions)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        if self.scaled:
            obs = (obs - self.obs_center) * self.obs_inv_half
        h = self.body(obs)
        if self.dueling:
            adv = self.advantage(h)
            return self.value(h) + adv - adv.mean(dim=-1, keepdim=True)
        q: torch.Tensor = self.q(h)
        return q


class DQNParameter(Parameter):
    """The online Q network, and with ``greedy_average_tau`` the moving average of its weights that the
    greedy policy acts with (the target network is the trainer's own)."""

    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        self.device = device
        self.n_actions = action_count(spec, config.action_bins)
        self.actions = action_table(spec, config.action_bins)
        affine = spec.obs_affine() if config.scale_obs and not spec.image else None
        self.obs_dtype = spec.obs_dtype
        self.frame_stack = spec.frame_stack if config.frame_rows(spec) else 0
        """frames each observation stacks when rows are frames (0: rows are transitions)"""
        self.q = QNetwork(config, spec, self.n_actions, affine).to(device)
        self.average_tau = config.greedy_average(spec)
        """how far the greedy average moves towards the online weights after each step (0: no average)"""
        self.q_average: QNetwork | None = None
        if self.average_tau > 0.0:
            self.q_average = copy.deepcopy(self.q)
            self.q_average.requires_grad_(False)

    @property
    def greedy_q(self) -> QNetwork:
        """The network the greedy policy acts with."""
        return self.q if self.q_average is None else self.q_average

    def to_arrays(self) -> dict[str, np.ndarray]:
        return torch_to_arrays(self._modules())

    def from_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if self.q_average is not None and not any(key.startswith("q_average.") for key in arrays):
            # weights saved without an average (greedy_average_tau 0, or an older srl) start it at the online net
            arrays = {**arrays, **{f"q_average.{key[2:]}": v for key, v in arrays.items() if key.startswith("q.")}}
        torch_from_arrays(self._modules(), arrays)

    def _modules(self) -> dict[str, nn.Module]:
        return {"q": self.q} if self.q_average is None else {"q": self.q, "q_average": self.q_average}


RESCALE_EPS = 1e-3


def rescale(x: torch.Tensor) -> torch.Tensor:
    """h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x: the value transform of R2D2 (Pohlen et al. 2018)."""
    return torch.sign(x) * (torch.sqrt(x.abs() + 1.0) - 1.0) + RESCALE_EPS * x


def unrescale(x: torch.Tensor) -> torch.Tensor:
    """h^-1(x), exact."""
    eps = RESCALE_EPS
    root = (torch.sqrt(1.0 + 4.0 * eps * (x.abs() + 1.0 + eps)) - 1.0) / (2.0 * eps)
    return torch.sign(x) * (root * root - 1.0)


def td_targets(
    q_online_next: torch.Tensor, q_target_next: torch.Tensor, reward: torch.Tensor, discount: torch.Tensor,
    double_q: bool, value_rescale: bool = False, gap: torch.Tensor | None = None,
) -> torch.Tensor:
    """reward + discount * Q_target(s', a*), a* from the online net when double_q, minus ``gap`` (advantage
    learning's term, in return units) when given; with value_rescale the networks hold h(Q) and the target
    is h(reward + discount * h^-1(Q_target(s', a*)) - gap)."""
    if double_q:
        best = q_online_next.argmax(dim=1, keepdim=True)
        next_v = q_target_next.gather(1, best).squeeze(1)
    else:
        next_v = q_target_next.max(dim=1).values
    if value_rescale:
        target = reward + discount * unrescale(next_v)
        return rescale(target if gap is None else target - gap)
    target = reward + discount * next_v
    return target if gap is None else target - gap


def action_gap(q_target: torch.Tensor, action: torch.Tensor, scale: float, value_rescale: bool) -> torch.Tensor:
    """``scale`` * (max_a Q(s, a) - Q(s, a_t)) from the target network's values at s: advantage learning's
    correction, in return units (the networks hold h(Q) with value_rescale)."""
    q = unrescale(q_target) if value_rescale else q_target
    return scale * (q.max(dim=1).values - q.gather(1, action.unsqueeze(1)).squeeze(1))


class DQNWorker(Worker):
    """ε-greedy in E envs with one forward pass; n-step transitions per env.

    Columns: obs, action (index), reward (the n-step return), next_obs, discount (gamma**k for a k-step
    return that bootstraps, 0 when the episode terminated), version (of the params that chose the action).

    Initial priorities are |TD errors| from the Q values the worker computed to act (Ape-X's actors do the
    same): Q(s, a) when it acted in s, max Q(s') when it acted in s' next; a truncated episode's final
    observation, never acted in, and the next observations of transitions still waiting when rows are taken
    get one forward pass of their own.
    """

    def __init__(self, config: Config, parameter: DQNParameter, epsilon: float | np.ndarray, num_envs: int,
                 seed: int | None, anneal: bool = False) -> None:
        self.config = config
        self.parameter = parameter
        self.epsilon = np.broadcast_to(np.asarray(epsilon, dtype=np.float64), (num_envs,))
        """each env's ε (a lone env's follows the annealing once ``plan`` has set its length)"""
        self.anneal = anneal and config.epsilon_decay > 0.0
        """a lone env: ε anneals from ``epsilon_start`` to ``epsilon`` over ``_anneal_steps`` env steps"""
        self._anneal_steps = 0.0
        self._acted_steps = 0
        """env steps this worker has acted in while training"""
        self.reward_scale = 1.0 if config.reward_scale is None else config.reward_scale  # None: not settled
        self.num_envs = num_envs
        self.rng = np.random.default_rng(seed)
        self.n_actions = parameter.n_actions
        self._windows: list[deque[tuple[Any, int, float, int, float, float]]] = [deque() for _ in range(num_envs)]
        self._rows: dict[str, list[Any]] = {k: [] for k in ("obs", "action", "reward", "next_obs", "discount",
                                                           "version", "priority")}
        self._gammas = config.gamma ** np.arange(config.n_step + 1)
        self._obs: np.ndarray | None = None
        self._action = np.zeros(num_envs, dtype=np.int64)
        self._q = np.zeros((num_envs, self.n_actions), dtype=np.float32)
        """the Q values of each env's observation acted on last"""
        self._gaps: np.ndarray | None = None
        """with ``advantage_learning``: its term for each env's observation acted on last and the action taken"""
        self._waiting: list[list[list[float]]] = [[] for _ in range(num_envs)]
        """per env, the priorities ([return, discount, Q(s, a), advantage learning's term, |TD|]) waiting for Q
        of the next observation"""
        self._next_obs: np.ndarray | None = None
        self._taken: tuple[Columns, np.ndarray] | None = None
        self.frames: FrameWriter | None = None
        """with frame rows: each env's stream of frames (a window's obs is then its newest frame's index)"""
        if parameter.frame_stack:
            self.frames = FrameWriter(num_envs, parameter.frame_stack, config.n_step)
        self._newest = np.zeros(num_envs, dtype=np.int64)
        self._acted_version = parameter.version
        """the params version of the last act (each transition carries the version that chose its action)"""

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        frames = self.frames if self.training else None
        if frames is not None:
            check_stacks(obs, obs, np.ones(len(env_ids), bool))
        for k, i in enumerate(env_ids):
            self._windows[i].clear()
            if frames is not None:
                self._newest[i] = frames.start(int(i), obs[k])

    def act(self, obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.act_with(obs, self.policy(self.policy_inputs(obs)))

    def policy_inputs(self, obs: np.ndarray) -> PolicyIO:
        return (torch.from_numpy(obs).to(self.parameter.device),)

    def policy(self, inputs: PolicyIO) -> PolicyIO:
        net = self.parameter.q if self.training else self.parameter.greedy_q
        return (net(inputs[0]),)

    def plan(self, max_steps: int | None, max_train_count: int | None) -> None:
        """A lone env anneals its ε over ``epsilon_decay`` of the env steps these limits plan (``max_steps``,
        else the warmup and ``max_train_count`` train steps' worth; counted from the run's start); none
        planned: ``epsilon`` throughout."""
        if self.anneal:
            config = self.config
            ratio = config.env_steps_per_train
            planned = max_steps if max_steps is not None else (
                None if max_train_count is None or ratio is None else config.warmup_size + max_train_count * ratio)
            self._anneal_steps = 0.0 if planned is None else config.epsilon_decay * planned

    def _anneal(self) -> None:
        """ε for the env steps the run has taken: those this worker acted in, or (a worker that joins a run
        under way: a replaced actor, a resumed run) at least those its params' version implies."""
        config = self.config
        trained = max(0, self.parameter.version - DataPath.FIRST_VERSION) * config.publish_every
        joined = 0.0 if trained == 0 else config.warmup_size + trained * (config.env_steps_per_train or 0.0)
        done = min(1.0, max(self._acted_steps, joined) / self._anneal_steps)
        self.epsilon = np.full(self.num_envs, config.epsilon_start + (config.epsilon - config.epsilon_start) * done)
        self._acted_steps += self.num_envs

    def act_with(self, obs: np.ndarray, outputs: PolicyIO) -> np.ndarray:
        q = outputs[0]
        if self.training and self._anneal_steps > 0.0:
            self._anneal()
        if self.training:
            self._q = q.float().cpu().numpy()
            self._settle(np.arange(self.num_envs), self._q)
        action = q.argmax(dim=1).cpu().numpy().astype(np.int64)
        explore(self.rng, action, self.epsilon if self.training else self.config.test_epsilon, self.n_actions)
        if self.training and self.config.advantage_learning > 0.0:  # the gap of the action taken, from the same Q
            self._gaps = action_gap(torch.from_numpy(self._q).to(torch.float64), torch.from_numpy(action),
                                    self.config.advantage_learning, self.config.value_rescale).numpy()
        self._obs, self._action = obs, action
        self._acted_version = self.parameter.version  # a server may load newer params before the observe
        table = self.parameter.actions
        return action if table is None else table[action]

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        if not self.training or self._obs is None:
            return
        version = self._acted_version
        scale = self.reward_scale
        frames = self.frames
        if frames is not None:
            check_stacks(self._obs, next_obs, np.zeros(self.num_envs, bool))
        for i, window in enumerate(self._windows):
            obs: Any = self._obs[i]
            nxt: Any = next_obs[i]
            if frames is not None:  # the window keeps frame indices; the writer keeps the frames
                obs, nxt = self._newest[i], frames.step(i, next_obs[i])
                self._newest[i] = nxt
            action = int(self._action[i])
            gap = 0.0 if self._gaps is None else float(self._gaps[i])
            window.append((obs, action, float(reward[i]) * scale, version, float(self._q[i, action]), gap))
            bootstrap = not terminated[i]
            if len(window) == self.config.n_step:
                self._emit(i, window, nxt, bootstrap)
            if terminated[i] or truncated[i]:
                while window:
                    self._emit(i, window, nxt, bootstrap)
        self._next_obs = next_obs
        cut = np.flatnonzero(truncated & ~terminated)
        if len(cut) and any(self._waiting[i] for i in cut):  # a final observation no act will see
            self._settle_from(cut, next_obs[cut])
        # the other ended envs' transitions end in a terminal step: their next Q, whichever, counts for nothing

    def _emit(self, env: int, window: deque[tuple[Any, int, float, int, float, float]], next_obs: Any,
              bootstrap: bool) -> None:
        """The oldest step of the window becomes one transition; it leaves the window."""
        k = len(window)
        ret = float(sum(self._gammas[i] * window[i][2] for i in range(k)))
        obs, action, _, version, q_sa, gap = window.popleft()
        discount = float(self._gammas[k]) if bootstrap else 0.0
        priority = [ret, discount, q_sa, gap, 0.0]
        self._waiting[env].append(priority)  # settled by the next Q of this env (times 0 after a terminal step)
        if self.frames is not None:
            self.frames.transition(env, int(obs), int(next_obs), action, ret, discount, version, priority)
            return
        rows = self._rows
        rows["obs"].append(obs)
        rows["action"].append(action)
        rows["reward"].append(ret)
        rows["next_obs"].append(next_obs)
        rows["discount"].append(discount)
        rows["version"].append(version)
        rows["priority"].append(priority)

    def _settle(self, envs: np.ndarray, q: np.ndarray) -> None:
        """Give the priorities waiting in ``envs`` their |TD error|, now that ``q`` (one row per env) holds the Q
        values of their next observations: one computation for them all."""
        waiting = [(p, k) for k, i in enumerate(envs) for p in self._waiting[i]]
        if not waiting:
            return
        ret, discount, q_sa = (torch.tensor([p[j] for p, _ in waiting], dtype=torch.float64) for j in range(3))
        gap = (torch.tensor([p[3] for p, _ in waiting], dtype=torch.float64)
               if self.config.advantage_learning > 0.0 else None)
        value = torch.from_numpy(q.max(axis=1)[[k for _, k in waiting]]).to(torch.float64)[:, None]
        target = td_targets(value, value, ret, discount, True, self.config.value_rescale, gap)
        for (p, _), td in zip(waiting, (target - q_sa).abs().tolist(), strict=True):
            p[-1] = td
        for i in envs:
            self._waiting[i].clear()

    def _settle_from(self, envs: np.ndarray, obs: np.ndarray) -> None:
        """Settle the waiting priorities of ``envs`` with Q of ``obs`` (their next observations)."""
        with torch.inference_mode():
            q = self.parameter.q(torch.from_numpy(obs).to(self.parameter.device)).float().cpu().numpy()
        self._settle(envs, q)

    def pending(self) -> int:
        return len(self._rows["action"]) if self.frames is None else self.frames.pending()

    def take(self) -> Columns | None:
        waiting = np.array([i for i, w in enumerate(self._waiting) if w], dtype=np.int64)
        if len(waiting) and self._next_obs is not None:  # their next observation is each env's current one
            self._settle_from(waiting, self._next_obs[waiting])
        if self.frames is not None:
            columns = self.frames.take()
            if columns is None:
                return None
            priorities = columns.pop("priority")
        else:
            rows = self._rows
            if not rows["action"]:
                return None
            columns = {
                "obs": np.stack(rows["obs"]).astype(self.parameter.obs_dtype, copy=False),
                "action": np.asarray(rows["action"], dtype=np.int64),
                "reward": np.asarray(rows["reward"], dtype=np.float32),
                "next_obs": np.stack(rows["next_obs"]).astype(self.parameter.obs_dtype, copy=False),
                "discount": np.asarray(rows["discount"], dtype=np.float32),
                "version": np.asarray(rows["version"], dtype=np.int64),
            }
            priorities = np.array([p[-1] for p in rows["priority"]], dtype=np.float32)
            for v in rows.values():
                v.clear()
        self._taken = (columns, priorities)
        return columns

    def initial_priorities(self, columns: Columns) -> np.ndarray:
        """|TD error| with this worker's weights (its copy stands in for the target network): for the rows
        ``take`` returned, from the Q values it acted with; for other rows, computed now."""
        if self._taken is not None and self._taken[0] is columns:
            return self._taken[1]
        device = self.parameter.device
        rows: np.ndarray | None = None
        total = len(columns["action"])
        if self.frames is not None:  # the stacks the frame rows make, for their transition rows
            rows, obs_stacks, next_stacks = stacks_of(columns, self.frames.stack)
            columns = {"obs": obs_stacks, "next_obs": next_stacks,
                       **{name: columns[name][rows] for name in ("action", "reward", "discount")}}
        with torch.inference_mode():
            obs = to_device(columns["obs"], device)
            next_obs = to_device(columns["next_obs"], device)
            q_all = self.parameter.q(torch.cat([obs, next_obs]))
            q, q_next = q_all[: len(obs)], q_all[len(obs) :]
            action = to_device(columns["action"], device)
            q_sa = q.gather(1, action.unsqueeze(1)).squeeze(1)
            scale = self.config.advantage_learning
            target = td_targets(
                q_next, q_next, to_device(columns["reward"], device),
                to_device(columns["discount"], device), self.config.double_q, self.config.value_rescale,
                action_gap(q, action, scale, self.config.value_rescale) if scale > 0.0 else None,
            )
            td = (target - q_sa).abs().cpu().numpy().astype(np.float32)
        if rows is None:
            return td
        priorities = np.zeros(total, np.float32)  # a row without a transition has nothing to prioritize
        priorities[rows] = td
        return priorities

    def stats(self) -> dict[str, float]:
        return {"epsilon": float(self.epsilon.mean())}  # the mean over its envs


@dataclass
class DQNStats(TrainStats):
    """One gradient step."""

    td_abs: float = 0.0
    """mean |TD error| of the sampled batch, against the target that ``advantage_learning`` shapes (with
    ``value_rescale``: of h(Q), in h's units)"""
    nonfinite_losses: int = 0
    """steps skipped so far because the loss was NaN or infinite"""


class DQNLearner(Learner):
    """One gradient step per ``train()``: sample, the ``loss`` setting's TD loss weighted by importance,
    priority update."""

    optimizer: torch.optim.Optimizer

    def __init__(self, config: Config, parameter: DQNParameter, memory: Memory) -> None:
        self.config = config
        self.parameter = parameter
        self.memory = memory
        self.device = parameter.device
        self.target = copy.deepcopy(parameter.q)
        self.target.requires_grad_(False)
        # the same tensors for the trainer's life (loading weights copies into them): Polyak's lists, built once
        self._target_params: list[torch.Tensor] = list(self.target.parameters())
        self._online_params: list[torch.Tensor] = list(parameter.q.parameters())
        self._average_params: list[torch.Tensor] = (
            [] if parameter.q_average is None else list(parameter.q_average.parameters()))
        self.optimizer = make_adam(parameter.q.parameters(), config.lr)
        self.train_count = 0
        self.nonfinite_losses = 0
        self._average_floor = 0.0
        self.compute = LearnerCompute.of(config, self.device)
        self.compute.prepare([parameter.q, self.target])
        self.batches = self.compute.ahead(self._draw)

    def _draw(self) -> DeviceSample:
        return sample_to_device(self.memory.sample(self.config.batch_size), self.device)

    def plan(self, max_steps: int | None, max_train_count: int | None, env_steps: int = 0) -> None:
        """The greedy average spans at most the last quarter of the planned train steps (``max_train_count``,
        else ``max_steps / env_steps_per_train``)."""
        ratio = self.config.env_steps_per_train
        planned = max_train_count if max_train_count is not None else (
            None if max_steps is None or ratio is None else max_steps / ratio)
        self._average_floor = 0.0 if not planned else min(1.0, 4.0 / planned)

    def sync_target(self) -> None:
        self.target.load_state_dict(self.parameter.q.state_dict())

    def on_parameters_loaded(self) -> None:
        self.sync_target()

    def extra_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return torch_to_arrays({"target": self.target}), {}

    def load_extra_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        torch_from_arrays({"target": self.target}, dict(arrays))

    def train(self) -> DQNStats | None:
        if len(self.memory) < self.config.warmup_size:
            return None
        sample = self.batches.take()
        b, weights = sample.columns, sample.weights
        obs, next_obs, action = b["obs"], b["next_obs"], b["action"]

        q_net = self.parameter.q
        config = self.config
        with self.compute.autocast():
            q_all = q_net(torch.cat([obs, next_obs])).float()
            q, q_online_next = q_all[: len(obs)], q_all[len(obs) :].detach()
            q_sa = q.gather(1, action.unsqueeze(1)).squeeze(1)
            with torch.no_grad():
                if config.advantage_learning > 0.0:
                    q_target_all = self.target(torch.cat([obs, next_obs])).float()
                    q_target_next = q_target_all[len(obs) :]
                    gap = action_gap(q_target_all[: len(obs)], action, config.advantage_learning,
                                     config.value_rescale)
                else:
                    q_target_next, gap = self.target(next_obs).float(), None
                target = td_targets(q_online_next, q_target_next, b["reward"], b["discount"], config.double_q,
                                    config.value_rescale, gap)
            td = target - q_sa
            loss = (weights * LOSSES[self.config.loss](q_sa, target, reduction="none")).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # The loss and |TD| reach the host in one copy, after the backward pass is queued: on CUDA each
        # copy to the host waits for the device, so a step waits once instead of three times.
        host = torch.cat([loss.detach().view(1), td.detach().abs()]).cpu().numpy()
        loss_value, td_abs = float(host[0]), host[1:]
        if not math.isfinite(loss_value):
            # Diverged on this sample (e.g. extreme rewards): skip the step rather than poison the weights.
            self.nonfinite_losses += 1
            return DQNStats(loss=float("nan"), gradient_steps=0, nonfinite_losses=self.nonfinite_losses)
        nn.utils.clip_grad_norm_(q_net.parameters(), self.config.max_grad_norm)
        self.optimizer.step()

        self.memory.update_priorities(sample.indices, td_abs, sample.generations)
        self.train_count += 1
        if self._average_params:
            # the mean of every step's weights until 1 / tau steps, then an exponential average: the
            # untrained weights it starts from are gone after the first step, however small tau is; and
            # never longer than a quarter of a planned run (a short run's early weights would weigh)
            weight = max(self.parameter.average_tau, 1.0 / self.train_count, self._average_floor)
            with torch.no_grad():
                torch._foreach_lerp_(self._average_params, self._online_params, weight)
        tau = self.config.target_tau
        if tau > 0.0:
            with torch.no_grad():
                torch._foreach_lerp_(self._target_params, self._online_params, tau)
        elif self.train_count % self.config.target_update_interval == 0:
            self.sync_target()
        return DQNStats(loss=loss_value, td_abs=float(td_abs.mean()), nonfinite_losses=self.nonfinite_losses)
