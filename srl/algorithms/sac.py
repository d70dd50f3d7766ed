"""Soft actor-critic (Haarnoja et al. 2018) for Box actions, on the replay data path the Ape-X way.

Read top to bottom: ``Config`` (every setting, documented, and the data path: n-step transitions into a
replay, params published every ``publish_every`` train steps, ``env_steps_per_train`` env steps per train
step in one process and across actors alike, as DQN), the networks (a squashed-Gaussian actor and a soft Q
network, two of them), ``SACParameter`` (actor, both critics and the log temperature: the weights that
travel), ``SACWorker`` (samples actions for E envs with one forward pass, acts with the mean while
evaluating, builds n-step transitions per env) and ``SACLearner`` (one step of the critics, the actor and
the temperature per ``train()``, Polyak-averaged target critics). Must never: know about Redis or queues.

The maths is CleanRL's ``sac_continuous_action.py`` and Stable-Baselines3's, in one place:

- actions live in [-1, 1] inside the algorithm (a = tanh(u), u ~ N(mean, std)); the worker maps them to
  the env's bounds, and the ``action`` column holds the squashed value, so every critic sees one scale;
- log π(a|s) = log N(u; mean, std) - sum log(1 - tanh(u)^2), the second term written
  2 (log 2 - u - softplus(-2u)) so it stays finite where tanh saturates;
- the critics learn r + γ^n (min_i Q'_i(s', a') - α log π(a'|s')) with a' ~ π(s'), a target of 0 future
  value after a terminal step and the final observation's value after a time limit (with ``n_step`` > 1 the
  entropy bonus counts at the bootstrap state only, Ape-X's shortcut; the default n = 1 is exact);
- the actor minimizes α log π(a|s) - min_i Q_i(s, a); the temperature α = exp(log_alpha) minimizes
  -log_alpha (log π + target_entropy), target_entropy = -dim(A) unless set.

Choices, beyond the papers:

- **Every step updates the actor** (SB3, the paper), not every other step (TD3's delay, CleanRL's default).
- **One step takes every gradient from the same weights** (the original implementation's order; CleanRL and
  SB3 update the critics before the actor's loss is taken), so its losses, |TD| and the temperature come to
  the host in one copy: on CUDA each copy waits for the device.
- **Rows carry no actor priorities.** With a prioritized memory, new transitions enter at its highest
  priority and the learner sets |TD| (the mean over both critics) afterwards, as R2D2's; so a forged batch
  cannot lift later transitions. The default memory is uniform (CleanRL, SB3).
- **The critics travel with the actor.** Actors act with the actor alone, but a trainer that takes a task
  over goes on from the critics and temperature on the board, not from fresh critics beside a trained
  actor. The price: a params version is about three actors' weights.
- Stacked frames are sent and stored as stacks (no frame ring): pixel SAC is rare, and DQN's ring
  rebuilds stacks of Discrete-action transitions only.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from srl.base.config import check_int, check_number
from srl.base.env import BoxActions, EnvError, EnvSpec
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
    worker_generator,
)
from srl.base.schema import Column, Schema
from srl.rl.ahead import DeviceSample, LearnerCompute, sample_to_device
from srl.rl.blocks import MLPBlockConfig, make_adam
from srl.rl.memories import Memory, MemoryConfig
from srl.rl.networks import EncoderConfig

VALUE_BOUND = 1e9
"""observations and returns beyond this are refused as rows (no env of sense produces them)"""
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0
"""the actor's log standard deviation is squashed into this range (CleanRL's)"""


def _mlp_256() -> MLPBlockConfig:
    return MLPBlockConfig(layer_sizes=(256, 256))


def _uniform_memory() -> MemoryConfig:
    memory = MemoryConfig()
    memory.set_replay_memory(capacity=1_000_000)
    return memory


@dataclass
class Config(RLConfig):
    """SAC settings (CleanRL's and SB3's defaults, with CleanRL's learning rates)."""

    algorithm: ClassVar[str] = "sac"

    hidden_block: MLPBlockConfig = field(default_factory=_mlp_256)
    """the layers of each critic (its input: the observation and the action together, or an image encoder's
    features and the action) and, for vector observations, of the actor (the ``mlp`` encoder)"""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """the network from observation to features (``srl.rl.networks``): "auto" is ``hidden_block`` for vectors,
    the Nature CNN for images of 36x36 and up, the MinAtar CNN for smaller ones"""
    memory: MemoryConfig = field(default_factory=_uniform_memory)
    """replay memory: uniform, 1,000,000 transitions (CleanRL, SB3); proportional works too"""
    batch_size: int = 256
    """transitions per gradient step"""
    warmup_size: int = 5000
    """transitions in memory before training starts (CleanRL's learning_starts)"""
    uniform_warmup: bool = True
    """act uniformly at random in the bounds while the params are the untrained ones (version 1: the warmup
    and the first ``publish_every`` train steps), as CleanRL and SB3 act before learning starts; False: the
    untrained actor's own Gaussian, narrow around the middle of the range"""
    env_steps_per_train: float | None = 1.0
    """env steps per train step, one process and distributed alike (all actors together); None: actors run
    flat out"""
    publish_every: int = 100
    """distributed: train steps between params publications (actors act with params about this old)"""
    critic_lr: float = 1e-3
    """Adam learning rate of both critics (and of the temperature)"""
    actor_lr: float = 3e-4
    """Adam learning rate of the actor"""
    gamma: float = 0.99
    """discount factor"""
    n_step: int = 1
    """steps summed into each return before bootstrapping (Ape-X uses 3; SAC's papers 1)"""
    tau: float = 0.005
    """after each step the target critics move this far towards the critics"""
    alpha: float | None = None
    """a fixed entropy temperature (``initial_alpha`` and ``target_entropy`` then play no part); None: learned,
    starting at ``initial_alpha``, towards ``target_entropy``"""
    initial_alpha: float = 1.0
    """the learned temperature's first value"""
    target_entropy: float | None = None
    """the entropy the learned temperature aims the policy at; None: -dim(A) (the paper's heuristic)"""
    reward_scale: float = 1.0
    """rewards are multiplied by this (> 0) before learning"""

    def validate(self) -> None:
        super().validate()
        self.hidden_block.validate()
        self.encoder.validate()
        self.memory.validate()
        check_int("batch_size", self.batch_size, 1, 1 << 16)
        check_int("warmup_size", self.warmup_size, 0, 1 << 30)
        check_int("publish_every", self.publish_every, 1, 1 << 30)
        if self.env_steps_per_train is not None:
            check_number("env_steps_per_train", self.env_steps_per_train, 0.0, 1e6, low_open=True)
        check_number("critic_lr", self.critic_lr, 0.0, 1.0, low_open=True)
        check_number("actor_lr", self.actor_lr, 0.0, 1.0, low_open=True)
        check_number("gamma", self.gamma, 0.0, 1.0, low_open=True)
        check_int("n_step", self.n_step, 1, 1000)
        check_number("tau", self.tau, 0.0, 1.0, low_open=True)
        if self.alpha is not None:
            check_number("alpha", self.alpha, 0.0, 1e6)
        check_number("initial_alpha", self.initial_alpha, 0.0, 1e6, low_open=True)
        if self.target_entropy is not None:
            check_number("target_entropy", self.target_entropy, -1e6, 1e6)
        check_number("reward_scale", self.reward_scale, 0.0, 1e9, low_open=True)
        if self.warmup_size < self.batch_size:
            raise ValueError(f"warmup_size ({self.warmup_size}) must be at least batch_size ({self.batch_size})")
        if self.memory.capacity < self.warmup_size:
            raise ValueError(f"memory.capacity ({self.memory.capacity}) is smaller than warmup_size "
                             f"({self.warmup_size}); training would never start")

    def check_spec(self, spec: EnvSpec) -> None:
        box_actions(spec)
        self.encoder.check(spec)

    def data_path(self) -> DataPath:
        return DataPath(rows="transitions", publish_every=self.publish_every,
                        env_steps_per_train=self.env_steps_per_train, warmup_rows=self.warmup_size)

    def schema(self, spec: EnvSpec) -> Schema:
        """n-step transitions; ``action`` is the squashed action in [-1, 1]; ``discount`` is gamma**k, 0
        after a terminal step. No priorities from actors (see the module docstring)."""
        obs = spec.obs_column()
        return Schema({
            "obs": obs,
            "action": Column("float32", box_actions(spec).shape, low=-1.0, high=1.0),
            "reward": Column("float32", (), low=-VALUE_BOUND, high=VALUE_BOUND),
            "next_obs": obs,
            "discount": Column("float32", (), low=0.0, high=1.0),
            "version": Column("int64", (), low=0),
        })

    def make_parameter(self, spec: EnvSpec, device: torch.device) -> SACParameter:
        return SACParameter(self, spec, device)

    def make_worker(
        self, spec: EnvSpec, parameter: Parameter, actor_index: int, actor_num: int, seed: int | None
    ) -> SACWorker:
        assert isinstance(parameter, SACParameter)
        return SACWorker(self, parameter, self.envs_per_actor, seed)

    def make_buffer(self, spec: EnvSpec, actor_num: int = 1) -> Memory:
        return self.memory.build(seed=self.seed, schema=self.schema(spec))

    def make_learner(self, spec: EnvSpec, parameter: Parameter, buffer: Buffer, actor_num: int = 1) -> SACLearner:
        assert isinstance(parameter, SACParameter) and isinstance(buffer, Memory)
        return SACLearner(self, parameter, buffer)


def box_actions(spec: EnvSpec) -> BoxActions:
    """``spec``'s actions, when SAC can act there (EnvError saying what to use instead)."""
    actions = spec.actions
    if not isinstance(actions, BoxActions):
        raise EnvError(f"SAC acts in bounded Box action spaces; {spec.env_id!r} has {actions}: use DQN, PPO or "
                       "IMPALA for discrete actions")
    if not actions.bounded:
        raise EnvError(f"SAC squashes actions into the env's bounds, but {spec.env_id!r} has unbounded actions "
                       f"{actions}; clip the action space with a wrapper first, or use PPO")
    return actions


# ---------------------------------------------------------------------------------------------- networks
def squashed_log_prob(u: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """log π(tanh(u)) for u ~ N(mean, exp(log_std)), summed over the action's dimensions: the Gaussian's
    log-density minus log |d tanh(u) / du| = log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u))."""
    gaussian = -0.5 * ((u - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2.0 * math.pi)
    jacobian = 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))
    return (gaussian - jacobian).flatten(1).sum(-1)


class Actor(nn.Module):
    """Observation -> the mean and log std of u; the action is tanh(u)."""

    def __init__(self, config: Config, spec: EnvSpec, action_dim: int) -> None:
        super().__init__()
        self.body, size = config.encoder.build(spec, config.hidden_block)
        self.mean = nn.Linear(size, action_dim)
        self.log_std = nn.Linear(size, action_dim)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        log_std = torch.tanh(self.log_std(h))
        return self.mean(h), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1.0)

    def sample(self, obs: torch.Tensor, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An action in [-1, 1] per observation (reparameterized: gradients reach the weights) and its
        log-probability; ``noise``: the standard normals to use (drawn here when None)."""
        mean, log_std = self(obs)
        if noise is None:
            noise = torch.randn_like(mean)
        u = mean + log_std.exp() * noise
        return torch.tanh(u), squashed_log_prob(u, mean, log_std)


class SoftQ(nn.Module):
    """(observation, action in [-1, 1]) -> Q. For vectors the action joins the observation at the first
    layer (CleanRL, SB3); for images it joins the encoder's features."""

    def __init__(self, config: Config, spec: EnvSpec, action_dim: int) -> None:
        super().__init__()
        self.encoder: nn.Module | None = None
        if config.encoder.resolved_kind(spec) == "mlp":
            config.encoder.check(spec)
            features = spec.obs_shape[0]
        else:
            self.encoder, features = config.encoder.build(spec, config.hidden_block)
        self.body, size = config.hidden_block.build(features + action_dim)
        self.q = nn.Linear(size, 1)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = obs if self.encoder is None else self.encoder(obs)
        q: torch.Tensor = self.q(self.body(torch.cat([x, action.flatten(1)], dim=1)))
        return q.squeeze(1)


class SACNetworks(nn.Module):
    """Everything that learns: the actor, two critics and the log temperature."""

    def __init__(self, config: Config, spec: EnvSpec) -> None:
        super().__init__()
        dim = int(np.prod(box_actions(spec).shape))
        self.actor = Actor(config, spec, dim)
        self.q1 = SoftQ(config, spec, dim)
        self.q2 = SoftQ(config, spec, dim)
        alpha = config.initial_alpha if config.alpha is None else max(config.alpha, 1e-30)
        self.log_alpha = nn.Parameter(torch.tensor([math.log(alpha)], dtype=torch.float32))


class SACParameter(Parameter):
    """The weights that travel: actor, critics and log temperature (see the module docstring)."""

    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        self.device = device
        actions = box_actions(spec)
        self.action_shape = actions.shape
        self.obs_dtype = spec.obs_dtype
        low, high = actions.low.astype(np.float64), actions.high.astype(np.float64)
        self.action_center = ((high + low) / 2.0).astype(np.float32)
        self.action_half = ((high - low) / 2.0).astype(np.float32)
        self.action_low, self.action_high = actions.low.astype(np.float32), actions.high.astype(np.float32)
        self.nets = SACNetworks(config, spec).to(device)

    def to_env(self, action: np.ndarray) -> np.ndarray:
        """Actions in [-1, 1] -> the env's bounds (clipped: center + half can round a float32 step past them)."""
        env_action: np.ndarray = np.clip(self.action_center + self.action_half * action.astype(np.float32),
                                         self.action_low, self.action_high)
        return env_action

    def to_arrays(self) -> dict[str, np.ndarray]:
        return torch_to_arrays({"sac": self.nets})

    def from_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        torch_from_arrays({"sac": self.nets}, arrays)


# ---------------------------------------------------------------------------------------------- acting
class SACWorker(Worker):
    """Samples an action per env with one forward pass (the mean while evaluating); n-step transitions.

    Columns: obs, action (squashed, in [-1, 1]), reward (the n-step return), next_obs, discount (gamma**k
    for a k-step return that bootstraps, 0 when the episode terminated), version (of the params that chose
    the action). The sampling noise comes from the worker's own generator, so an inference server acting
    for many workers draws each one's from its own.
    """

    def __init__(self, config: Config, parameter: SACParameter, num_envs: int, seed: int | None) -> None:
        self.config = config
        self.parameter = parameter
        self.num_envs = num_envs
        self.generator = worker_generator(seed)
        self._action_dim = int(np.prod(parameter.action_shape))
        self._gammas = config.gamma ** np.arange(config.n_step + 1)
        self._windows: list[deque[tuple[np.ndarray, np.ndarray, float, int]]] = [deque() for _ in range(num_envs)]
        self._rows: dict[str, list[Any]] = {k: [] for k in ("obs", "action", "reward", "next_obs", "discount",
                                                           "version")}
        self._obs: np.ndarray | None = None
        self._action = np.zeros((num_envs, *parameter.action_shape), np.float32)
        self._acted_version = parameter.version

    def reset(self, env_ids: np.ndarray, obs: np.ndarray) -> None:
        for i in env_ids:
            self._windows[i].clear()

    def act(self, obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.act_with(obs, self.policy(self.policy_inputs(obs)))

    def policy_inputs(self, obs: np.ndarray) -> PolicyIO:
        """The observations and a standard normal per action dimension (zeros while evaluating: the mean
        action), so the inputs of workers training and evaluating join alike."""
        shape = (len(obs), self._action_dim)
        noise = torch.randn(shape, generator=self.generator) if self.training else torch.zeros(shape)
        return torch.from_numpy(obs).to(self.parameter.device), noise.to(self.parameter.device)

    def policy(self, inputs: PolicyIO) -> PolicyIO:
        """(tanh(mean + std * noise),): the action in [-1, 1]."""
        obs, noise = inputs
        mean, log_std = self.parameter.nets.actor(obs)
        return (torch.tanh(mean + log_std.exp() * noise),)

    def act_with(self, obs: np.ndarray, outputs: PolicyIO) -> np.ndarray:
        shape = (len(obs), *self.parameter.action_shape)
        if self.training and self.config.uniform_warmup and self.parameter.version <= DataPath.FIRST_VERSION:
            action = (2.0 * torch.rand(shape, generator=self.generator) - 1.0).numpy()  # untrained: uniform
        else:
            action = outputs[0].float().cpu().numpy().reshape(shape)
        self._obs, self._action = obs, action
        self._acted_version = self.parameter.version
        return self.parameter.to_env(action)

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        if not self.training or self._obs is None:
            return
        scale = self.config.reward_scale
        for i, window in enumerate(self._windows):
            window.append((self._obs[i], self._action[i], float(reward[i]) * scale, self._acted_version))
            bootstrap = not terminated[i]
            if len(window) == self.config.n_step:
                self._emit(window, next_obs[i], bootstrap)
            if terminated[i] or truncated[i]:
                while window:
                    self._emit(window, next_obs[i], bootstrap)

    def _emit(self, window: deque[tuple[np.ndarray, np.ndarray, float, int]], next_obs: np.ndarray,
              bootstrap: bool) -> None:
        """The oldest step of the window becomes one transition; it leaves the window."""
        k = len(window)
        ret = float(sum(self._gammas[j] * window[j][2] for j in range(k)))
        obs, action, _, version = window.popleft()
        rows = self._rows
        rows["obs"].append(obs)
        rows["action"].append(action)
        rows["reward"].append(ret)
        rows["next_obs"].append(next_obs)
        rows["discount"].append(float(self._gammas[k]) if bootstrap else 0.0)
        rows["version"].append(version)

    def pending(self) -> int:
        return len(self._rows["version"])

    def take(self) -> Columns | None:
        rows = self._rows
        if not rows["version"]:
            return None
        dtype = self.parameter.obs_dtype
        columns = {
            "obs": np.stack(rows["obs"]).astype(dtype, copy=False),
            "action": np.stack(rows["action"]).astype(np.float32, copy=False),
            "reward": np.asarray(rows["reward"], dtype=np.float32),
            "next_obs": np.stack(rows["next_obs"]).astype(dtype, copy=False),
            "discount": np.asarray(rows["discount"], dtype=np.float32),
            "version": np.asarray(rows["version"], dtype=np.int64),
        }
        for v in rows.values():
            v.clear()
        return columns


# ---------------------------------------------------------------------------------------------- learning
@dataclass
class SACStats(TrainStats):
    """One gradient step (``loss`` is the critics')."""

    actor_loss: float = 0.0
    alpha: float = 0.0
    """the entropy temperature the step learned with"""
    entropy: float = 0.0
    """-mean log π of the actions the actor sampled for the batch"""
    q: float = 0.0
    """mean of min(Q1, Q2) over the batch's observations, at the actions the actor sampled for them"""
    nonfinite_losses: int = 0
    """steps skipped so far because a loss was NaN or infinite"""


class SACLearner(Learner):
    """One step of the critics, the actor and the temperature per ``train()``; targets Polyak-averaged."""

    optimizer: torch.optim.Optimizer
    """the critics' (the checkpoint keeps all three: ``optimizers``)"""

    def __init__(self, config: Config, parameter: SACParameter, memory: Memory) -> None:
        self.config = config
        self.parameter = parameter
        self.memory = memory
        self.device = parameter.device
        nets = parameter.nets
        self.target_q1 = copy.deepcopy(nets.q1).requires_grad_(False)
        self.target_q2 = copy.deepcopy(nets.q2).requires_grad_(False)
        self._critic_params: list[torch.Tensor] = [*nets.q1.parameters(), *nets.q2.parameters()]
        self._target_params: list[torch.Tensor] = [*self.target_q1.parameters(), *self.target_q2.parameters()]
        self._actor_params: list[torch.Tensor] = list(nets.actor.parameters())
        self.optimizer = make_adam(self._critic_params, config.critic_lr)
        self.actor_optimizer = make_adam(nets.actor.parameters(), config.actor_lr)
        self.alpha_optimizer = make_adam([nets.log_alpha], config.critic_lr)
        dim = int(np.prod(parameter.action_shape))
        self.target_entropy = -float(dim) if config.target_entropy is None else config.target_entropy
        self.train_count = 0
        self.nonfinite_losses = 0
        self.compute = LearnerCompute.of(config, self.device)
        self.compute.prepare([nets.actor, nets.q1, nets.q2, self.target_q1, self.target_q2])
        self.batches = self.compute.ahead(self._draw)

    def _draw(self) -> DeviceSample:
        return sample_to_device(self.memory.sample(self.config.batch_size), self.device)

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"optimizer": self.optimizer, "actor_optimizer": self.actor_optimizer,
                "alpha_optimizer": self.alpha_optimizer}

    def on_parameters_loaded(self) -> None:
        self.target_q1.load_state_dict(self.parameter.nets.q1.state_dict())
        self.target_q2.load_state_dict(self.parameter.nets.q2.state_dict())

    def extra_state(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return torch_to_arrays({"target_q1": self.target_q1, "target_q2": self.target_q2}), {}

    def load_extra_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        torch_from_arrays({"target_q1": self.target_q1, "target_q2": self.target_q2}, dict(arrays))

    def train(self) -> SACStats | None:
        config = self.config
        if len(self.memory) < config.warmup_size:
            return None
        sample = self.batches.take()
        b, weights, dev = sample.columns, sample.weights, self.device
        obs, next_obs, action = b["obs"], b["next_obs"], b["action"]
        nets = self.parameter.nets
        alpha = nets.log_alpha.detach().exp() if config.alpha is None else torch.tensor([config.alpha], device=dev)

        with self.compute.autocast():  # every network output back to float32 before the losses use it
            with torch.no_grad():
                next_action, next_logp = nets.actor.sample(next_obs)
                next_q = torch.min(self.target_q1(next_obs, next_action), self.target_q2(next_obs, next_action))
                target = b["reward"] + b["discount"] * (next_q.float() - alpha * next_logp.float())
            td1, td2 = target - nets.q1(obs, action).float(), target - nets.q2(obs, action).float()
            critic_loss = (weights * (td1.pow(2) + td2.pow(2))).mean()
            new_action, logp = nets.actor.sample(obs)
            logp = logp.float()
            q_new = torch.min(nets.q1(obs, new_action), nets.q2(obs, new_action)).float()
            actor_loss = (alpha * logp - q_new).mean()
            alpha_loss = -(nets.log_alpha * (logp.detach() + self.target_entropy)).mean()
        # Every gradient from the same weights, before any step (the original implementation's order), so that
        # the losses, |TD| and the temperature reach the host in one copy: on CUDA each copy waits for the device
        for optimizer in self.optimizers().values():
            optimizer.zero_grad(set_to_none=True)
        critic_loss.backward(inputs=self._critic_params)
        actor_loss.backward(inputs=self._actor_params)
        if config.alpha is None:
            alpha_loss.backward(inputs=[nets.log_alpha])
        td_abs = 0.5 * (td1.detach().abs() + td2.detach().abs())
        host = torch.cat([torch.stack([critic_loss.detach(), actor_loss.detach(), logp.detach().mean(),
                                       q_new.detach().mean(), alpha.reshape(())]), td_abs]).cpu().numpy()
        if not np.isfinite(host[:4]).all():  # diverged on this sample: skip the step, not poison the weights
            self.nonfinite_losses += 1
            return SACStats(loss=float("nan"), gradient_steps=0, alpha=float(host[4]),
                            nonfinite_losses=self.nonfinite_losses)
        self.optimizer.step()
        self.actor_optimizer.step()
        if config.alpha is None:
            self.alpha_optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(self._target_params, self._critic_params, config.tau)

        self.memory.update_priorities(sample.indices, host[5:], sample.generations)
        self.train_count += 1
        return SACStats(loss=float(host[0]), actor_loss=float(host[1]), alpha=float(host[4]), entropy=-float(host[2]),
                        q=float(host[3]), nonfinite_losses=self.nonfinite_losses)

    def alpha(self) -> float:
        """The entropy temperature now."""
        fixed = self.config.alpha
        return float(self.parameter.nets.log_alpha.detach().exp()) if fixed is None else fixed
