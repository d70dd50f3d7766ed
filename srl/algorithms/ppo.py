"""PPO: clipped surrogate, GAE(λ), K epochs over minibatches of segments (CleanRL's ppo.py, distributed).

Read top to bottom: ``Config`` (every setting, documented; the data path is
segments of ``segment_length`` steps, used once: in sync mode every actor
collects one segment per env with the current params, the trainer trains K
epochs over all of them and publishes the next version, actors wait for it),
the actor-critic network (orthogonal init; a categorical policy for Discrete
and MultiDiscrete actions, a Gaussian with a state-independent log-std for
Box actions, clipped to the bounds for the env), ``Worker`` (acts in E envs
with one forward pass, records log-probs and values, cuts a segment per env
every T steps) and ``Trainer`` (GAE, advantage normalization, the clipped
losses, lr annealing, gradient clipping, optional observation and reward
normalization). Must never: know about Redis or queues.

Truncated episodes (time limits) bootstrap: the worker adds γ·V(final obs) to
the last reward, as SB3 does, so Pendulum's 200-step cut is not a failure.

Defaults depend on the action space the way RL zoos ship per-family presets:
fields left at ``None`` take the Discrete or the continuous-control value
(``Config.resolved``), so ``ppo.Config()`` works on CartPole and Pendulum alike.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

from srl.base.env import BoxActions, DiscreteActions, EnvSpec, MultiDiscreteActions
from srl.base.rl import (
    Buffer,
    Columns,
    DataPath,
    Parameter,
    RLConfig,
    Trainer,
    TrainStats,
    Worker,
    check_int,
    check_number,
    torch_from_arrays,
    torch_to_arrays,
)
from srl.base.schema import Column, Schema
from srl.rl.blocks import MLPBlockConfig, make_adam
from srl.rl.memories import SegmentBuffer

VALUE_BOUND = 1e9

# Per-family presets for the fields a Config leaves at None: (Discrete / MultiDiscrete, Box).
PRESETS: dict[str, tuple[Any, Any]] = {
    "segment_length": (32, 256),
    "epochs": (20, 10),
    "minibatches": (1, 32),
    "lr": (1e-3, 1e-3),
    "gamma": (0.98, 0.9),
    "gae_lambda": (0.8, 0.95),
    "ent_coef": (0.0, 0.0),
    "normalize_obs": (False, True),
    "normalize_reward": (False, True),
}


@dataclass
class Config(RLConfig):
    """PPO settings; ``None`` fields take the preset of the env's action family (see ``PRESETS``)."""

    algorithm: ClassVar[str] = "ppo"

    envs_per_actor: int = 8
    """envs each actor (and Runner.train) steps at once; one segment per env per update"""
    hidden_block: MLPBlockConfig = field(default_factory=lambda: MLPBlockConfig((64, 64), "tanh"))
    """the layers of the policy and of the value network (separate, as in CleanRL)"""
    segment_length: int | None = None
    """T: steps per env per update (preset: 32 Discrete, 256 Box)"""
    epochs: int | None = None
    """K: passes over each update's data (preset: 20 Discrete, 10 Box)"""
    minibatches: int | None = None
    """minibatches per epoch (preset: 1 Discrete, 32 Box: minibatches of 64 steps, as CleanRL and SB3)"""
    lr: float | None = None
    """Adam learning rate (preset: 1e-3)"""
    anneal_lr: bool = True
    """decay the learning rate (and the clip range with it) linearly to 0 over the run's max_steps"""
    gamma: float | None = None
    """discount factor (preset: 0.98 Discrete, 0.9 Box)"""
    gae_lambda: float | None = None
    """GAE λ (preset: 0.8 Discrete, 0.95 Box)"""
    clip_coef: float = 0.2
    """surrogate clipping ε"""
    clip_vloss: bool = False
    """clip the value loss around the old values too"""
    ent_coef: float | None = None
    """entropy bonus (preset: 0)"""
    vf_coef: float = 0.5
    """value loss weight"""
    max_grad_norm: float = 0.5
    """gradient norm clip"""
    norm_adv: bool = True
    """normalize advantages per minibatch"""
    target_kl: float | None = None
    """stop an update's epochs early once the approximate KL exceeds this (None: never)"""
    normalize_obs: bool | None = None
    """normalize observations by running mean and std (preset: off Discrete, on Box); the statistics
    travel with the params, so actors normalize as the trainer does"""
    normalize_reward: bool | None = None
    """scale rewards by the running std of the discounted return (preset: off Discrete, on Box)"""
    sync: bool = True
    """distributed: actors collect with the current params and wait for the next version (the data
    is on-policy); the asynchronous mode comes with the IMPALA issue"""
    sync_wait_s: float = 30.0
    """sync: seconds the trainer waits for every actor's segments before going on with what it has"""
    min_segments: int = 1
    """sync: the fewest segments the trainer goes on with after sync_wait_s"""

    def resolved(self, spec: EnvSpec) -> Config:
        """A copy with every ``None`` field set to the preset of ``spec``'s action family."""
        family = 1 if isinstance(spec.actions, BoxActions) else 0
        changes = {name: preset[family] for name, preset in PRESETS.items() if getattr(self, name) is None}
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        super().validate()
        self.hidden_block.validate()
        if self.segment_length is not None:
            check_int("segment_length", self.segment_length, 1, 1 << 16)
        if self.epochs is not None:
            check_int("epochs", self.epochs, 1, 1000)
        if self.minibatches is not None:
            check_int("minibatches", self.minibatches, 1, 1 << 16)
        for name, low, high in (("lr", 0.0, 1.0), ("gamma", 0.0, 1.0), ("gae_lambda", 0.0, 1.0),
                                ("ent_coef", 0.0, 100.0)):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), low, high, low_open=name in ("lr", "gamma"))
        check_number("clip_coef", self.clip_coef, 0.0, 10.0, low_open=True)
        check_number("vf_coef", self.vf_coef, 0.0, 100.0)
        check_number("max_grad_norm", self.max_grad_norm, 0.0, 1e9, low_open=True)
        if self.target_kl is not None:
            check_number("target_kl", self.target_kl, 0.0, 100.0, low_open=True)
        check_number("sync_wait_s", self.sync_wait_s, 0.0, 1e6)
        check_int("min_segments", self.min_segments, 1, 1 << 30)

    def check_spec(self, spec: EnvSpec) -> None:
        if isinstance(spec.actions, BoxActions) and len(spec.actions.shape) != 1:
            raise spec.unsupported("ppo", "Box actions of one dimension (shape (n,))")

    def data_path(self) -> DataPath:
        return DataPath(rows="segments", publish_every=0, sync=self.sync,
                        max_policy_lag=0 if self.sync else None, sync_wait_s=self.sync_wait_s,
                        min_segments=self.min_segments)

    def schema(self, spec: EnvSpec) -> Schema:
        """One row per segment of T steps of one env; ``done[t]``: the episode ended at step t."""
        config = self.resolved(spec)
        t = int(config.segment_length or 1)
        obs = Column("float32", (t, *spec.obs_shape), low=-VALUE_BOUND, high=VALUE_BOUND)
        actions = spec.actions
        if isinstance(actions, DiscreteActions):
            action = Column("int64", (t,), low=0, high=actions.n - 1)
        elif isinstance(actions, MultiDiscreteActions):
            action = Column("int64", (t, len(actions.nvec)), low=0, high=max(actions.nvec) - 1)
        else:
            action = Column("float32", (t, *actions.shape), low=-VALUE_BOUND, high=VALUE_BOUND)
        return Schema({
            "obs": obs,
            "action": action,
            "logprob": Column("float32", (t,), low=-VALUE_BOUND, high=VALUE_BOUND),
            "value": Column("float32", (t,), low=-VALUE_BOUND, high=VALUE_BOUND),
            "reward": Column("float32", (t,), low=-VALUE_BOUND, high=VALUE_BOUND),
            "done": Column("bool", (t,)),
            "last_obs": Column("float32", spec.obs_shape, low=-VALUE_BOUND, high=VALUE_BOUND),
            "version": Column("int64", (), low=0),
        })

    def make_parameter(self, spec: EnvSpec, device: torch.device) -> PPOParameter:
        return PPOParameter(self.resolved(spec), spec, device)

    def make_worker(
        self, spec: EnvSpec, parameter: Parameter, actor_index: int, actor_num: int, seed: int | None
    ) -> PPOWorker:
        assert isinstance(parameter, PPOParameter)
        return PPOWorker(self.resolved(spec), parameter, self.envs_per_actor, seed)

    def make_buffer(self, spec: EnvSpec, actor_num: int = 1) -> SegmentBuffer:
        # one update holds a segment per env of every actor; room for a second set arriving early
        return SegmentBuffer(2 * actor_num * self.envs_per_actor, self.schema(spec))

    def make_trainer(self, spec: EnvSpec, parameter: Parameter, buffer: Buffer) -> PPOTrainer:
        assert isinstance(parameter, PPOParameter) and isinstance(buffer, SegmentBuffer)
        return PPOTrainer(self.resolved(spec), parameter, buffer)


# ---------------------------------------------------------------- networks
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


class ActorCritic(nn.Module):
    def __init__(self, config: Config, spec: EnvSpec) -> None:
        super().__init__()
        obs_size = spec.obs_shape[0]
        self.normalize_obs = bool(config.normalize_obs)
        self.obs_rms = RunningMeanStd(spec.obs_shape)
        self.critic_body, size = config.hidden_block.build(obs_size)
        self.critic_head = layer_init(nn.Linear(size, 1), std=1.0)
        self.actor_body, size = config.hidden_block.build(obs_size)
        for body in (self.critic_body, self.actor_body):
            for layer in body.modules():
                if isinstance(layer, nn.Linear):
                    layer_init(layer)
        actions = spec.actions
        self.continuous = isinstance(actions, BoxActions)
        if isinstance(actions, DiscreteActions):
            self.splits: list[int] = [actions.n]
        elif isinstance(actions, MultiDiscreteActions):
            self.splits = list(actions.nvec)
        else:
            self.splits = [int(np.prod(actions.shape))]
            self.logstd = nn.Parameter(torch.zeros(1, self.splits[0]))
        self.actor_head = layer_init(nn.Linear(size, sum(self.splits)), std=0.01)

    def prepare(self, obs: torch.Tensor) -> torch.Tensor:
        return self.obs_rms.normalize(obs) if self.normalize_obs else obs

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic_head(self.critic_body(self.prepare(obs))).squeeze(-1)

    def distribution(self, obs: torch.Tensor) -> Normal | list[Categorical]:
        out = self.actor_head(self.actor_body(self.prepare(obs)))
        if self.continuous:
            return Normal(out, self.logstd.expand_as(out).exp())
        return [Categorical(logits=logits) for logits in torch.split(out, self.splits, dim=-1)]

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """log π(action|obs), entropy, V(obs)."""
        dist = self.distribution(obs)
        if isinstance(dist, Normal):
            logprob, entropy = dist.log_prob(action).sum(-1), dist.entropy().sum(-1)
        elif len(dist) == 1:
            logprob, entropy = dist[0].log_prob(action), dist[0].entropy()
        else:
            logprob = torch.stack([d.log_prob(action[..., i]) for i, d in enumerate(dist)]).sum(0)
            entropy = torch.stack([d.entropy() for d in dist]).sum(0)
        return logprob, entropy, self.value(obs)


class PPOParameter(Parameter):
    """The actor-critic (with the observation statistics, when normalizing)."""

    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        self.device = device
        self.spec = spec
        self.net = ActorCritic(config, spec).to(device)

    def to_arrays(self) -> dict[str, np.ndarray]:
        return torch_to_arrays({"net": self.net})

    def from_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        torch_from_arrays({"net": self.net}, arrays)


# ---------------------------------------------------------------- worker
class PPOWorker(Worker):
    """Samples actions for E envs at once; every T steps each env's last T steps become a segment."""

    def __init__(self, config: Config, parameter: PPOParameter, num_envs: int, seed: int | None) -> None:
        self.config = config
        self.parameter = parameter
        self.num_envs = num_envs
        self.T = int(config.segment_length or 1)
        self.gamma = float(config.gamma or 0.99)
        spec = parameter.spec
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1)[0])
        self.generator = torch.Generator().manual_seed(seed)
        obs_shape, act = spec.obs_shape, spec.actions
        act_shape = act.shape
        act_dtype = np.float32 if isinstance(act, BoxActions) else np.int64
        self._obs = np.zeros((self.T, num_envs, *obs_shape), np.float32)
        self._action = np.zeros((self.T, num_envs, *act_shape), act_dtype)
        self._logprob = np.zeros((self.T, num_envs), np.float32)
        self._value = np.zeros((self.T, num_envs), np.float32)
        self._reward = np.zeros((self.T, num_envs), np.float32)
        self._done = np.zeros((self.T, num_envs), bool)
        self._t = 0
        self._version = 0
        self._ready: list[Columns] = []
        self._low = self._high = None
        if isinstance(act, BoxActions):
            self._low = np.where(np.isfinite(act.low), act.low, -np.inf).astype(np.float32)
            self._high = np.where(np.isfinite(act.high), act.high, np.inf).astype(np.float32)

    def _sample(self, dist: Normal | list[Categorical]) -> tuple[torch.Tensor, torch.Tensor]:
        """An action per env and its log-probability (greedy while evaluating)."""
        if isinstance(dist, Normal):
            if self.training:
                action = dist.mean + dist.stddev * torch.randn(dist.mean.shape, generator=self.generator)
            else:
                action = dist.mean
            return action, dist.log_prob(action).sum(-1)
        parts, logprob = [], torch.zeros(dist[0].logits.shape[0])
        for d in dist:
            if self.training:
                a = torch.multinomial(d.probs, 1, generator=self.generator).squeeze(-1)
            else:
                a = d.probs.argmax(-1)
            parts.append(a)
            logprob = logprob + d.log_prob(a)
        action = parts[0] if len(parts) == 1 else torch.stack(parts, dim=-1)
        return action, logprob

    def act(self, obs: np.ndarray) -> np.ndarray:
        net = self.parameter.net
        with torch.inference_mode():
            x = torch.from_numpy(obs).to(self.parameter.device)
            action_t, logprob = self._sample(net.distribution(x))
            value = net.value(x) if self.training else None
        action = action_t.cpu().numpy()
        if self.training:
            if self._t == 0:
                self._version = self.parameter.version
            t = self._t
            self._obs[t], self._action[t] = obs, action
            self._logprob[t], self._value[t] = logprob.cpu().numpy(), value.cpu().numpy()  # type: ignore[union-attr]
        if self._low is not None:  # the env gets the action clipped to its bounds; the row keeps the sample
            return np.clip(action, self._low, self._high).astype(np.float32)
        return action.astype(np.int64)

    def observe(self, reward: np.ndarray, next_obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        if not self.training:
            return
        t = self._t
        reward = reward.astype(np.float32).copy()
        cut = truncated & ~terminated
        if cut.any():  # a time limit, not a failure: bootstrap from the final observation
            with torch.inference_mode():
                final_value = self.parameter.net.value(torch.from_numpy(next_obs[cut]).to(self.parameter.device))
            reward[cut] += self.gamma * final_value.cpu().numpy()
        self._reward[t], self._done[t] = reward, terminated | truncated
        self._t += 1
        if self._t == self.T:
            self._t = 0
            self._ready.append({
                "obs": self._obs.swapaxes(0, 1).copy(),
                "action": self._action.swapaxes(0, 1).copy(),
                "logprob": self._logprob.T.copy(),
                "value": self._value.T.copy(),
                "reward": self._reward.T.copy(),
                "done": self._done.T.copy(),
                "last_obs": next_obs.astype(np.float32).copy(),
                "version": np.full(self.num_envs, self._version, np.int64),
            })

    def pending(self) -> int:
        return sum(len(rows["version"]) for rows in self._ready)

    def take(self) -> Columns | None:
        if not self._ready:
            return None
        ready, self._ready = self._ready, []
        if len(ready) == 1:
            return ready[0]
        return {name: np.concatenate([rows[name] for rows in ready]) for name in ready[0]}

    def may_load_params(self) -> bool:
        return self._t == 0  # a segment is acted with one params version


# ---------------------------------------------------------------- trainer
def gae(
    reward: np.ndarray, value: np.ndarray, done: np.ndarray, last_value: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns for segments ``(N, T)``: δ_t = r_t + γ V_{t+1} (1 - done_t) - V_t,
    A_t = δ_t + γ λ (1 - done_t) A_{t+1}, with V_T = ``last_value``; returns = A + V."""
    n, horizon = reward.shape
    advantages = np.zeros((n, horizon), np.float32)
    next_value, next_advantage = last_value.astype(np.float32), np.zeros(n, np.float32)
    for t in reversed(range(horizon)):
        live = 1.0 - done[:, t].astype(np.float32)
        delta = reward[:, t] + gamma * next_value * live - value[:, t]
        next_advantage = delta + gamma * lam * live * next_advantage
        advantages[:, t] = next_advantage
        next_value = value[:, t]
    return advantages, advantages + value


@dataclass
class PPOStats(TrainStats):
    """One update: K epochs over the segments it took."""

    policy_loss: float = 0.0
    value_loss: float = 0.0
    entropy: float = 0.0
    approx_kl: float = 0.0
    clip_fraction: float = 0.0
    explained_variance: float = 0.0
    lr: float = 0.0
    segments: int = 0


class PPOTrainer(Trainer):
    """``train()`` takes every segment in the buffer and runs one PPO update on them."""

    def __init__(self, config: Config, parameter: PPOParameter, buffer: SegmentBuffer) -> None:
        self.config = config
        self.parameter = parameter
        self.buffer = buffer
        self.device = parameter.device
        self.lr = float(config.lr or 1e-3)
        self.optimizer = make_adam(parameter.net.parameters(), self.lr)
        self.optimizer.param_groups[0]["eps"] = 1e-5
        self.return_rms = RunningMeanStd(())
        self.train_count = 0
        self.steps_seen = 0
        self.max_steps: int | None = None
        self.max_train_count: int | None = None

    def plan(self, max_steps: int | None, max_train_count: int | None) -> None:
        """The run's budget: the learning rate and the clip range anneal to 0 over ``max_steps`` env steps
        (else over ``max_train_count`` gradient steps)."""
        self.max_steps = max_steps
        self.max_train_count = max_train_count

    def _scale_rewards(self, reward: np.ndarray, done: np.ndarray) -> np.ndarray:
        """Divide by the running std of discounted returns (accumulated within each segment)."""
        gamma = float(self.config.gamma or 0.99)
        running = np.zeros(reward.shape[0], np.float64)
        returns = np.zeros_like(reward, dtype=np.float64)
        for t in range(reward.shape[1]):
            running = running * gamma + reward[:, t]
            returns[:, t] = running
            running[done[:, t]] = 0.0
        self.return_rms.update(torch.from_numpy(returns))
        scale = float(np.sqrt(self.return_rms.var.item() + 1e-8))
        return np.clip(reward / scale, -10.0, 10.0).astype(np.float32)

    def train(self) -> PPOStats | None:
        segments = self.buffer.take()
        if segments is None:
            return None
        config, net, dev = self.config, self.parameter.net, self.device
        n, horizon = segments["reward"].shape
        self.steps_seen += n * horizon
        frac = 1.0
        if config.anneal_lr and self.max_steps:
            frac = max(0.0, 1.0 - self.steps_seen / self.max_steps)
        elif config.anneal_lr and self.max_train_count:
            frac = max(0.0, 1.0 - self.train_count / self.max_train_count)
        lr, clip = self.lr * max(frac, 0.02), config.clip_coef * max(frac, 0.02)
        self.optimizer.param_groups[0]["lr"] = lr

        reward = segments["reward"]
        if config.normalize_reward:
            reward = self._scale_rewards(reward, segments["done"])
        with torch.no_grad():
            last_value = net.value(torch.from_numpy(segments["last_obs"]).to(dev)).cpu().numpy()
        advantages, returns = gae(reward, segments["value"], segments["done"], last_value,
                                  float(config.gamma or 0.99), float(config.gae_lambda or 0.95))

        obs = torch.from_numpy(segments["obs"].reshape(n * horizon, -1)).to(dev)
        action = torch.from_numpy(segments["action"].reshape(n * horizon, *segments["action"].shape[2:])).to(dev)
        old_logprob = torch.from_numpy(segments["logprob"].reshape(-1)).to(dev)
        old_value = torch.from_numpy(segments["value"].reshape(-1)).to(dev)
        adv = torch.from_numpy(advantages.reshape(-1)).to(dev)
        ret = torch.from_numpy(returns.reshape(-1)).to(dev)

        batch = n * horizon
        minibatch = max(1, batch // int(config.minibatches or 1))
        clip_fractions, kl, steps = [], torch.zeros(()), 0
        pg_loss = v_loss = entropy_loss = torch.zeros(())
        for _ in range(int(config.epochs or 1)):
            order = torch.randperm(batch)
            for start in range(0, batch, minibatch):
                idx = order[start : start + minibatch]
                logprob, entropy, value = net.evaluate(obs[idx], action[idx])
                log_ratio = logprob - old_logprob[idx]
                ratio = log_ratio.exp()
                with torch.no_grad():
                    kl = ((ratio - 1) - log_ratio).mean()
                    clip_fractions.append(((ratio - 1.0).abs() > clip).float().mean().item())
                mb_adv = adv[idx]
                if config.norm_adv and len(idx) > 1:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - clip, 1 + clip)).mean()
                if config.clip_vloss:
                    clipped = old_value[idx] + torch.clamp(value - old_value[idx], -clip, clip)
                    v_loss = 0.5 * torch.max((value - ret[idx]) ** 2, (clipped - ret[idx]) ** 2).mean()
                else:
                    v_loss = 0.5 * ((value - ret[idx]) ** 2).mean()
                entropy_loss = entropy.mean()
                loss = pg_loss - float(config.ent_coef or 0.0) * entropy_loss + config.vf_coef * v_loss
                if not torch.isfinite(loss):
                    continue  # one diverged minibatch must not poison the weights
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(net.parameters(), config.max_grad_norm)
                self.optimizer.step()
                steps += 1
            if config.target_kl is not None and kl.item() > config.target_kl:
                break
        if config.normalize_obs:  # the next version's actors normalize with what this update saw
            net.obs_rms.update(obs)
        self.train_count += steps
        variance = float(np.var(returns))
        explained = float("nan") if variance == 0 else 1.0 - float(np.var(returns - segments["value"])) / variance
        return PPOStats(
            loss=float((pg_loss + config.vf_coef * v_loss).item()), gradient_steps=steps,
            policy_loss=float(pg_loss.item()), value_loss=float(v_loss.item()), entropy=float(entropy_loss.item()),
            approx_kl=float(kl.item()), clip_fraction=float(np.mean(clip_fractions)) if clip_fractions else 0.0,
            explained_variance=explained, lr=lr, segments=n,
        )
