"""IMPALA: actors never wait; the learner corrects for their lag with V-trace (Espeholt et al. 2018).

Read top to bottom: ``Config`` (every setting, documented; the data path is
segments of ``segment_length`` steps with the behaviour policy's
log-probabilities, each consumed once from a bounded FIFO, params published
every ``publish_every`` train steps, no version waited for), ``vtrace`` (the
paper's recursion, six lines), and ``Learner`` (``epochs`` gradient steps per batch of
segments, one as the paper's, twenty in the recurrent preset over Discrete vectors: V-trace targets with
the current network, the policy-gradient term
with the V-trace advantage, PPO-clipped where π has moved away from the acting
policy, the value loss and the entropy bonus). The
policy network and the actors' segment worker are the ones PPO uses
(``srl.rl.actor_critic``). Must never: know about Redis or queues.

Every row carries the params version it was acted with; the trainer reports
how far behind (in versions and in train steps) what it learns from is, and
``max_policy_lag`` refuses what is older (off by default: V-trace corrects).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from srl.base.config import check_int, check_number
from srl.base.env import EnvSpec
from srl.base.rl import (
    Buffer,
    DataPath,
    Parameter,
    RLConfig,
    TrainStats,
)
from srl.base.schema import Schema
from srl.rl.actor_critic import (
    ACTION_FAMILIES,
    MLP_64_64_TANH,
    MLP_64_RELU,
    ActorCriticParameter,
    FamilyPresets,
    LinearAnneal,
    ReturnScaledLearner,
    SegmentWorker,
    check_actions,
    check_cell_first,
    config_segment_schema,
    normalized_advantages,
    segment_observations,
    segment_rewards,
    segment_states,
)
from srl.rl.ahead import LearnerCompute
from srl.rl.blocks import MLPBlockConfig, make_adam, to_device
from srl.rl.memories import SegmentBuffer
from srl.rl.networks import EncoderConfig
from srl.rl.recurrent import check_recurrent

# Per-family presets for the fields a Config leaves at None: (Discrete / MultiDiscrete, Box, images, grids).
# Box normalizes observations and rewards, as CleanRL's continuous-action PPO does (ppo_continuous_action.py,
# made for MuJoCo); chosen on InvertedDoublePendulum and Hopper, judged on Pendulum (docs/benchmarks.md,
# "IMPALA's Box preset"). The others keep IMPALA's raw observations and rewards. The rest is the paper's
# learner for every family (one pass over each batch), with TorchBeast's unroll and rates.
PRESETS: dict[str, tuple[Any, Any, Any, Any]] = {
    "normalize_obs": (False, True, False, False),
    "normalize_reward": (False, True, False, False),
    "hidden_block": (MLP_64_64_TANH,) * 4,
    "cell_first": (False,) * 4,
    "segment_length": (16,) * 4,
    "epochs": (1,) * 4,
    "norm_adv": (False,) * 4,
    "lr": (2e-3,) * 4,
    "gamma": (0.99,) * 4,
    "vtrace_lambda": (1.0,) * 4,
    "entropy_cost": (0.01,) * 4,
    "max_grad_norm": (40.0,) * 4,
    "clip_ratio": (0.1,) * 4,
    "anneal_lr": (False,) * 4,
}
# A recurrent config's own columns over Discrete vectors: recurrent PPO's preset there (its network, RL Zoo's
# ppo_lstm for the NoVel envs, and its Discrete settings: 20 steps clipped at 0.2 on each batch of T = 32 with
# the advantages centred and scaled, γ 0.98, λ 0.8, the learning rate annealed to 0 over the run). With the
# paper's one pass the LSTM's policy collapses to one action in most runs whatever the rates (25 probes);
# chosen on Acrobot-v1 and srl/AcrobotNoVel-v1, judged on srl/CartPoleNoVel-v1 (docs/benchmarks.md, "Recurrent
# IMPALA's Discrete preset"). Box, images and grids keep the columns above.
RECURRENT_PRESETS: dict[str, tuple[Any, Any, Any, Any]] = {
    "normalize_obs": (True, True, False, False),
    "hidden_block": (MLP_64_RELU, MLP_64_64_TANH, MLP_64_64_TANH, MLP_64_64_TANH),
    "cell_first": (True, False, False, False),
    "segment_length": (32, 16, 16, 16),
    "epochs": (20, 1, 1, 1),
    "norm_adv": (True, False, False, False),
    "lr": (1e-3, 2e-3, 2e-3, 2e-3),
    "gamma": (0.98, 0.99, 0.99, 0.99),
    "vtrace_lambda": (0.8, 1.0, 1.0, 1.0),
    "entropy_cost": (0.0, 0.01, 0.01, 0.01),
    "max_grad_norm": (0.5, 40.0, 40.0, 40.0),
    "clip_ratio": (0.2, 0.1, 0.1, 0.1),
    "anneal_lr": (True, False, False, False),
}
FAMILIES = ACTION_FAMILIES
"""the columns of ``PRESETS``, as ``Config.family`` names them"""

@dataclass
class Config(FamilyPresets, RLConfig):
    """IMPALA settings; ``None`` fields take the preset of the env's family: its action space for vector
    observations, or images (see ``PRESETS``)."""

    algorithm: ClassVar[str] = "impala"
    presets: ClassVar[dict[str, tuple[Any, ...]]] = PRESETS
    recurrent_presets: ClassVar[dict[str, tuple[Any, ...]]] = RECURRENT_PRESETS
    saved_before: ClassVar[dict[str, Any]] = {"recurrent": None, "recurrent_size": 128, "cell_first": False,
                                              "adam_eps": 1e-8, "clip_ratio": 0.0, "normalize_reward": False,
                                              "epochs": 1, "norm_adv": False}

    envs_per_actor: int = 8
    """envs each actor steps at once (one segment per env per T steps)"""
    hidden_block: MLPBlockConfig | None = None
    """the layers of the policy and of the value network over vector observations (preset: two tanh layers of
    64, and one ReLU layer of 64 for a recurrent config over Discrete actions)"""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """the network from observation to features (``srl.rl.networks``): "auto" is ``hidden_block`` for vectors
    and a CNN both heads share for images ("impala_cnn": the paper's residual network)"""
    store_frames_once: bool = True
    """for stacked frames (Atari's 4): a segment carries T + 4 frames, not 4 per step and 4 for last_obs"""
    recurrent: str | None = None
    """a cell between the encoder and the heads: "lstm", "gru", or None (feed-forward). Actors keep its state
    per env and send it with each segment; the learner unrolls it over the segment from that state"""
    recurrent_size: int = 128
    """units of the recurrent cell"""
    cell_first: bool | None = None
    """over vectors with ``recurrent``: the cells read the observations and ``hidden_block`` comes after each
    (SB3-contrib RecurrentPPO's order); False: ``hidden_block`` before the cells (CleanRL's). Preset: True for a
    recurrent config over Discrete actions, False otherwise; True set elsewhere (no cell, or image observations)
    is refused"""
    normalize_obs: bool | None = None
    """normalize observations by running statistics (updated by the learner, published with the params;
    preset: off Discrete, on Box and for a recurrent config)"""
    normalize_reward: bool | None = None
    """scale rewards by the running std of the discounted return (preset: off Discrete, on Box)"""
    segment_length: int | None = None
    """T: steps per segment (the unroll length; preset: 16, and 32 for a recurrent config over Discrete actions)"""
    batch_segments: int = 8
    """segments per batch (each batch is taken from the FIFO once: smaller batches, more steps per env step)"""
    epochs: int | None = None
    """gradient steps on each batch. Each recomputes π, V and the V-trace targets with the weights as they are
    then, and ``clip_ratio`` bounds how far the steps move π from the acting policy, as APPO's epochs (1: the
    paper's one pass). Train counts, ``publish_every`` and params versions count gradient steps (preset: 1,
    and 20 for a recurrent config over Discrete actions)"""
    norm_adv: bool | None = None
    """centre and scale the V-trace advantages of each gradient step's batch (PPO's ``norm_adv``; preset: off,
    on for a recurrent config over Discrete actions)"""
    buffer_segments: int = 64
    """the learner's FIFO: when it is full the learner stops reading the queue and actors wait"""
    lr: float | None = None
    """Adam learning rate (held, unless anneal_lr; preset: 2e-3, and 1e-3 for a recurrent config over Discrete
    actions)"""
    adam_eps: float = 1e-3
    """Adam's ε. Large enough that steps shrink with the gradients once the advantages are mere noise (a
    solved task), instead of Adam rescaling that noise to steps of about ``lr`` that walk a good policy
    away (TorchBeast's IMPALA: RMSProp with ε 0.01; the study: docs/benchmarks.md)"""
    anneal_lr: bool | None = None
    """decay the learning rate linearly to 0 over the run's max_steps (else max_train_count), as the paper;
    by default it is held, as RLlib's and Sample Factory's IMPALA hold it: a run whose rows come late learns
    more slowly per env step, and a schedule that ends at zero can freeze it before it got there (the study:
    docs/benchmarks.md). Preset: held, and annealed for a recurrent config over Discrete actions, as recurrent
    PPO's is: with 20 steps on each batch a held rate walks a solved policy away again"""
    gamma: float | None = None
    """discount factor (preset: 0.99, and 0.98 for a recurrent config over Discrete actions)"""
    vtrace_lambda: float | None = None
    """λ of the V-trace targets (preset: 1, the paper's, and 0.8 for a recurrent config over Discrete actions)"""
    rho_bar: float = 1.0
    """ρ̄: clip of the importance weights in the value targets and the policy gradient"""
    c_bar: float = 1.0
    """c̄: clip of the trace-cutting coefficients"""
    baseline_cost: float = 0.5
    """value loss weight"""
    entropy_cost: float | None = None
    """entropy bonus weight (preset: 0.01, and 0 for a recurrent config over Discrete actions)"""
    max_grad_norm: float | None = None
    """gradient norm clip (preset: 40, and 0.5 for a recurrent config over Discrete actions)"""
    publish_every: int = 4
    """train steps between params publications"""
    max_policy_lag: int | None = None
    """refuse segments acted with params more than this many versions old (None: accept any; V-trace
    corrects the off-policy part)"""
    clip_ratio: float | None = None
    """bound each update's move away from the acting policy μ: the policy term is PPO's clipped surrogate of
    π/μ (clipped to 1 ± this) on the V-trace advantages, as APPO's. Rows that sit in a queue while the
    learner moves on otherwise let it push one way for as many steps as they are late, to a one-action
    policy it cannot leave (docs/benchmarks.md). On-policy rows (π = μ) train as without it. 0: no clip, the
    paper's ρ̄-clipped policy gradient (preset: 0.1, and 0.2 for a recurrent config over Discrete actions)"""

    def validate(self) -> None:
        super().validate()
        if self.hidden_block is not None:
            self.hidden_block.validate()
        self.encoder.validate()
        check_recurrent(self.recurrent, self.recurrent_size)
        check_cell_first(self.cell_first, self.recurrent)
        if self.segment_length is not None:
            check_int("segment_length", self.segment_length, 1, 1 << 16)
        check_int("batch_segments", self.batch_segments, 1, 1 << 16)
        if self.epochs is not None:
            check_int("epochs", self.epochs, 1, 1000)
        _check_bounded(self.epochs, self.clip_ratio, "")
        check_int("buffer_segments", self.buffer_segments, 1, 1 << 20)
        check_int("publish_every", self.publish_every, 1, 1 << 30)
        check_number("adam_eps", self.adam_eps, 0.0, 1.0, low_open=True)
        for name, low, high, low_open in (("lr", 0.0, 1.0, True), ("gamma", 0.0, 1.0, True),
                                          ("vtrace_lambda", 0.0, 100.0, False), ("rho_bar", 0.0, 100.0, False),
                                          ("c_bar", 0.0, 100.0, False), ("baseline_cost", 0.0, 1e3, False),
                                          ("entropy_cost", 0.0, 1e3, False), ("max_grad_norm", 0.0, 1e9, True)):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), low, high, low_open=low_open)
        if self.max_policy_lag is not None:
            check_int("max_policy_lag", self.max_policy_lag, 0, 1 << 30)
        if self.clip_ratio is not None:
            check_number("clip_ratio", self.clip_ratio, 0.0, 1.0)
        if self.buffer_segments < self.batch_segments:
            raise ValueError(f"buffer_segments ({self.buffer_segments}) must hold a batch ({self.batch_segments})")

    def check_spec(self, spec: EnvSpec) -> None:
        check_actions(spec, "impala")
        check_cell_first(self.cell_first, self.recurrent, spec, self.encoder.check(spec))
        resolved = self.resolved(spec)
        _check_bounded(resolved.epochs, resolved.clip_ratio, f" (the {self.family(spec)} preset's)")

    def data_path(self) -> DataPath:
        return DataPath(rows="segments", publish_every=self.publish_every, max_policy_lag=self.max_policy_lag,
                        lead_versions=DataPath.lead_of(self.max_policy_lag),
                        version_segments=self.batch_segments * self.publish_every,
                        segment_length=int(self.segment_length or 0))

    def schema(self, spec: EnvSpec) -> Schema:
        return config_segment_schema(self, spec, int(self.resolved(spec).segment_length or 1))

    def make_parameter(self, spec: EnvSpec, device: torch.device) -> ActorCriticParameter:
        return ActorCriticParameter(self.resolved(spec), spec, device)

    def make_worker(
        self, spec: EnvSpec, parameter: Parameter, actor_index: int, actor_num: int, seed: int | None
    ) -> SegmentWorker:
        assert isinstance(parameter, ActorCriticParameter)
        config = self.resolved(spec)
        return SegmentWorker(parameter, int(config.segment_length or 1), float(config.gamma or 0.0),
                             self.envs_per_actor, seed)

    def make_buffer(self, spec: EnvSpec, actor_num: int = 1) -> SegmentBuffer:
        # room for a batch plus every actor's next message, so no actor's segments wait on another's
        capacity = max(self.buffer_segments, self.batch_segments + actor_num * self.envs_per_actor)
        return SegmentBuffer(capacity, self.schema(spec))

    def make_learner(self, spec: EnvSpec, parameter: Parameter, buffer: Buffer, actor_num: int = 1) -> IMPALALearner:
        assert isinstance(parameter, ActorCriticParameter) and isinstance(buffer, SegmentBuffer)
        return IMPALALearner(self.resolved(spec), parameter, buffer)


def _check_bounded(epochs: int | None, clip_ratio: float | None, whose: str) -> None:
    """ValueError for several gradient steps on a batch with nothing to bound how far they move the policy."""
    if epochs is not None and epochs > 1 and clip_ratio == 0:
        raise ValueError(f"epochs={epochs}{whose} takes several steps on each batch, and with clip_ratio=0 (the "
                         "paper's policy gradient) nothing bounds how far they move the policy from the one that "
                         "acted: set clip_ratio (0.1, or leave it to the preset) or epochs=1")


def vtrace(
    log_rhos: torch.Tensor, discounts: torch.Tensor, rewards: torch.Tensor, values: torch.Tensor,
    bootstrap_value: torch.Tensor, rho_bar: float = 1.0, c_bar: float = 1.0, lam: float = 1.0,
    rho_weighted: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets ``vs`` and policy-gradient advantages for ``(N, T)`` tensors.

    v_s = V(x_s) + Σ_t γ^(t-s) (Π_{i<t} c_i) δ_t V, δ_t V = ρ_t (r_t + γ V(x_{t+1}) - V(x_t)),
    ρ_t = min(ρ̄, π/μ), c_i = λ min(c̄, π/μ); computed backwards: v_s - V(x_s) = δ_s + γ_s c_s (v_{s+1} - V(x_{s+1})).
    The advantage is ρ_s (r_s + γ v_{s+1} - V(x_s)), or without the ρ_s (``rho_weighted=False``) for a loss
    that weighs it by π/μ itself. ``discounts`` is γ (1 - done).
    """
    rhos = log_rhos.exp()
    clipped_rhos = rhos.clamp(max=rho_bar)
    cs = lam * rhos.clamp(max=c_bar)
    next_values = torch.cat([values[:, 1:], bootstrap_value[:, None]], dim=1)
    deltas = clipped_rhos * (rewards + discounts * next_values - values)
    acc = torch.zeros_like(bootstrap_value)
    vs_minus_v = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        acc = deltas[:, t] + discounts[:, t] * cs[:, t] * acc
        vs_minus_v[:, t] = acc
    vs = vs_minus_v + values
    next_vs = torch.cat([vs[:, 1:], bootstrap_value[:, None]], dim=1)
    advantages = rewards + discounts * next_vs - values
    return vs, clipped_rhos * advantages if rho_weighted else advantages


def policy_term(logprob: torch.Tensor, behaviour: torch.Tensor, advantages: torch.Tensor,
                clip_ratio: float | None) -> torch.Tensor:
    """The policy-gradient loss over ``(N, T)`` log π(a) (with gradients), log μ(a) and V-trace advantages:
    −mean(log π · A) with ρ-weighted advantages (``clip_ratio`` None, the paper's), else PPO's clipped
    surrogate −mean(min(r A, clip(r, 1 ± clip_ratio) A)), r = π/μ, with unweighted ones: the same gradient
    where r = 1, none that moves r further out of 1 ± clip_ratio in the advantage's direction."""
    if clip_ratio is None:
        return -(logprob * advantages).mean()
    ratio = (logprob - behaviour).exp()
    clipped = ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    return -torch.min(ratio * advantages, clipped * advantages).mean()


@dataclass
class IMPALAStats(TrainStats):
    """A batch of segments: its gradient steps (``epochs``), with the last one's figures."""

    policy_loss: float = 0.0
    value_loss: float = 0.0
    entropy: float = 0.0
    rho_mean: float = 0.0
    """mean importance weight π/μ before clipping (1: on-policy)"""
    rho_clipped: float = 0.0
    """fraction of importance weights clipped at ρ̄"""
    clip_fraction: float = 0.0
    """fraction of π/μ outside 1 ± clip_ratio (0 without the clip)"""
    lr: float = 0.0


@dataclass(frozen=True)
class _Steps:
    """The settings of a gradient step, as a resolved config (``Config.resolved``) gives them."""

    lr: float
    gamma: float
    vtrace_lambda: float
    entropy_cost: float
    max_grad_norm: float
    epochs: int
    norm_adv: bool
    clip_ratio: float
    """0: the paper's policy gradient (``clip`` None)"""
    anneal_lr: bool

    @property
    def clip(self) -> float | None:
        """The surrogate's clip (``policy_term``'s ``clip_ratio``): None for the paper's policy gradient."""
        return self.clip_ratio or None

    @classmethod
    def of(cls, config: Config) -> _Steps:
        values = {name: getattr(config, name) for name in (f.name for f in dataclasses.fields(cls))}
        left = sorted(name for name, value in values.items() if value is None)
        if left:
            raise ValueError(f"the IMPALA learner was given a config with {', '.join(left)} left to the preset: "
                             "give it config.resolved(spec)")
        return cls(**values)


class IMPALALearner(ReturnScaledLearner):
    """``train()`` takes ``batch_segments`` segments (None until that many arrived) and makes ``epochs`` steps."""

    optimizer: torch.optim.Optimizer

    def __init__(self, config: Config, parameter: ActorCriticParameter, buffer: SegmentBuffer) -> None:
        super().__init__()
        self.config = config
        self.steps = _Steps.of(config)
        self.parameter = parameter
        self.buffer = buffer
        self.device = parameter.device
        self.optimizer = make_adam(parameter.net.parameters(), self.steps.lr, eps=config.adam_eps)
        self.train_count = 0
        self.anneal = LinearAnneal()
        self.compute = LearnerCompute.of(config, self.device)
        self.compute.prepare(parameter.net.encoders())

    def plan(self, max_steps: int | None, max_train_count: int | None, env_steps: int = 0) -> None:
        self.anneal.plan(max_steps, max_train_count, env_steps)

    def _scaled(self, reward: np.ndarray, done: np.ndarray) -> np.ndarray:
        return self.scale_rewards(reward, done, self.steps.gamma)

    def train(self) -> IMPALAStats | None:
        segments = self.buffer.take(self.config.batch_segments)
        if segments is None:
            return None
        config, net, dev = self.config, self.parameter.net, self.device
        n, horizon = segments["reward"].shape
        frac = self.anneal.advance(n * horizon, self.train_count)
        lr = self.steps.lr * (frac if self.steps.anneal_lr else 1.0)
        self.optimizer.param_groups[0]["lr"] = lr
        observations, last_obs = segment_observations(segments, self.parameter.frames)
        if net.recurrent is not None:
            obs = to_device(observations, dev)
        else:
            obs = to_device(observations.reshape(n * horizon, *observations.shape[2:]), dev)
        batch = _Batch(obs, to_device(last_obs, dev), to_device(segments["action"], dev),
                       to_device(segments["logprob"], dev),
                       # the env's rewards (scaled once a batch) and a time limit's bootstrap
                       to_device(segment_rewards(segments, self._scaled if config.normalize_reward else None), dev),
                       self.steps.gamma * (1.0 - to_device(segments["done"], dev).float()),
                       segment_states(segments, dev) if net.recurrent is not None else None)
        steps = 0
        for _ in range(self.steps.epochs):
            numbers, stepped = self._step(batch)
            steps += stepped
        if self.parameter.net.normalize_obs:
            net.obs_rms.update(obs)
        self.train_count += steps
        loss_, policy_, value_, entropy_, rho_mean, rho_clipped, clip_fraction = numbers.tolist()  # one host copy
        return IMPALAStats(
            loss=loss_, gradient_steps=steps, policy_loss=policy_, value_loss=value_, entropy=entropy_,
            rho_mean=rho_mean, rho_clipped=rho_clipped, clip_fraction=clip_fraction, lr=lr,
        )

    def _step(self, batch: _Batch) -> tuple[torch.Tensor, int]:
        """One gradient step on ``batch``: its statistics (on the device, for one host copy) and 1, or 0 where
        the loss was not finite and the weights were left as they were."""
        config, steps, net = self.config, self.steps, self.parameter.net
        n, horizon = batch.rewards.shape
        with self.compute.autocast():  # the outputs back to float32 before V-trace and the losses use them
            if batch.states is not None:  # each segment unrolled from the state its actor started it with
                h, c, resets = batch.states
                logprob, entropy, value, bootstrap = net.evaluate_bootstrapped(
                    batch.obs, batch.last_obs, batch.action, h, c, resets)
                bootstrap = bootstrap.detach()
            else:
                action = batch.action.reshape(n * horizon, *batch.action.shape[2:])
                logprob, entropy, value = net.evaluate(batch.obs, action)
                logprob, entropy, value = logprob.view(n, horizon), entropy.view(n, horizon), value.view(n, horizon)
                with torch.no_grad():
                    bootstrap = net.value(batch.last_obs)
        logprob, entropy, value, bootstrap = logprob.float(), entropy.float(), value.float(), bootstrap.float()
        with torch.no_grad():
            log_rhos = logprob.detach() - batch.behaviour
            vs, advantages = vtrace(log_rhos, batch.discounts, batch.rewards, value.detach(), bootstrap,
                                    config.rho_bar, config.c_bar, steps.vtrace_lambda,
                                    rho_weighted=steps.clip is None)
            if steps.norm_adv:
                advantages = normalized_advantages(advantages)
        policy_loss = policy_term(logprob, batch.behaviour, advantages, steps.clip)
        value_loss = 0.5 * ((vs - value) ** 2).mean()
        entropy_mean = entropy.mean()
        loss = policy_loss + config.baseline_cost * value_loss - steps.entropy_cost * entropy_mean
        stepped = 0
        if torch.isfinite(loss):  # one diverged batch must not poison the weights
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), steps.max_grad_norm)
            self.optimizer.step()
            stepped = 1
        rhos = log_rhos.exp()
        outside = (rhos - 1.0).abs() > steps.clip if steps.clip is not None else torch.zeros_like(rhos)
        return torch.stack([loss.detach(), policy_loss.detach(), value_loss.detach(), entropy_mean.detach(),
                            rhos.mean(), (rhos > config.rho_bar).float().mean(), outside.float().mean()]), stepped


@dataclass
class _Batch:
    """A batch of segments on the learner's device, as every gradient step on it reads it."""

    obs: torch.Tensor
    """``(n, T, *obs)`` for a recurrent network (unrolled per segment), ``(n * T, *obs)`` otherwise"""
    last_obs: torch.Tensor
    action: torch.Tensor
    behaviour: torch.Tensor
    """log μ(a): the acting policy's log-probabilities"""
    rewards: torch.Tensor
    discounts: torch.Tensor
    """γ (1 - done)"""
    states: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None
    """h, c and the resets of a recurrent network's segments"""
