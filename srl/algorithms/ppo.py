"""PPO: clipped surrogate, GAE(λ), K epochs over minibatches of segments (CleanRL's ppo.py, distributed).

Read top to bottom: ``Config`` (every setting, documented), ``gae`` (the six
lines), and ``Learner`` (advantage normalization, the clipped losses, lr and
clip annealing, gradient clipping, optional reward normalization). The network
(orthogonal init; categorical for Discrete and MultiDiscrete actions, Gaussian
with a state-independent log-std for Box actions, clipped to the bounds for
the env; optional observation normalization) and the segment worker are
shared with IMPALA in ``srl.rl.actor_critic``. Must never: know about Redis or
queues.

Two data paths. Sync (``sync=True``, the default): every actor collects one
segment per env with the current params, the trainer trains K epochs over all
of them and publishes the next version, actors wait for it: on-policy.
Asynchronous PPO (``sync=False``, APPO): actors never wait; each update takes
the segments of ``actor_num x envs_per_actor`` envs as they come, with the
ratio taken against the behaviour policy's log-probabilities, advantages from
the current critic, and segments more than ``max_policy_lag`` versions old
refused (at arrival and again before training).

Defaults depend on the workload the way RL zoos ship per-family presets:
fields left at ``None`` take the value of the env's family (``Config.resolved``):
Discrete or continuous-control vectors, Atari-sized images, or small grids
(MinAtar), so ``ppo.Config()`` works on CartPole, Pendulum and Breakout alike.
"""

from __future__ import annotations

import math
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
    bootstrapped_values,
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
# The images column is CleanRL's ppo_atari.py (Atari's rewards are clipped by its preprocessing instead).
# Grids are images under the Nature CNN's smallest side (MinAtar's 10x10, the small CNN): the same, but
# with a learning rate ten times Atari's, within the range MinAtar's PPO baselines use (gymnax-blines
# 5e-4 constant, PQN's 5e-3 annealed); docs/benchmarks.md, "PPO on small grids", gives the measurements.
PRESETS: dict[str, tuple[Any, Any, Any, Any]] = {
    "segment_length": (32, 256, 128, 128),
    "epochs": (20, 10, 4, 4),
    "minibatches": (1, 32, 4, 4),
    "lr": (1e-3, 1e-3, 2.5e-4, 2.5e-3),
    "gamma": (0.98, 0.9, 0.99, 0.99),
    "gae_lambda": (0.8, 0.95, 0.95, 0.95),
    "ent_coef": (0.0, 0.0, 0.01, 0.01),
    "normalize_obs": (False, True, False, False),
    "normalize_reward": (False, True, False, False),
    "hidden_block": (MLP_64_64_TANH,) * 4,
}
# A recurrent config's own columns, where they differ: over Discrete vectors RL Zoo's ppo_lstm network for the
# NoVel envs (one ReLU layer of 64 per head before the cell) with observations normalized; chosen on
# srl/AcrobotNoVel-v1, judged on srl/CartPoleNoVel-v1 (docs/benchmarks.md, "Recurrent presets"). Box keeps its
# own (PendulumNoVel meets its target with it); images and grids go through their CNN.
RECURRENT_PRESETS: dict[str, tuple[Any, Any, Any, Any]] = {
    "normalize_obs": (True, True, False, False),
    "hidden_block": (MLP_64_RELU, MLP_64_64_TANH, MLP_64_64_TANH, MLP_64_64_TANH),
    "cell_first": (True, False, False, False),
}
FAMILIES = ACTION_FAMILIES
"""the columns of ``PRESETS``, as ``Config.family`` names them"""

@dataclass
class Config(FamilyPresets, RLConfig):
    """PPO settings; ``None`` fields take the preset of the env's family: its action space for vector
    observations, or images (see ``PRESETS``)."""

    algorithm: ClassVar[str] = "ppo"
    presets: ClassVar[dict[str, tuple[Any, ...]]] = PRESETS
    recurrent_presets: ClassVar[dict[str, tuple[Any, ...]]] = RECURRENT_PRESETS
    saved_before: ClassVar[dict[str, Any]] = {"recurrent": None, "recurrent_size": 128, "cell_first": False}

    envs_per_actor: int = 8
    """envs each actor (and Runner.train) steps at once; one segment per env per update"""
    hidden_block: MLPBlockConfig | None = None
    """the layers of the policy and of the value network over vector observations (separate, as in CleanRL;
    preset: two tanh layers of 64, and one ReLU layer of 64 for a recurrent config over Discrete actions)"""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """the network from observation to features (``srl.rl.networks``): "auto" is ``hidden_block`` for vectors
    and a CNN both heads share for images"""
    segment_length: int | None = None
    """T: steps per env per update (preset: 32 Discrete, 256 Box)"""
    epochs: int | None = None
    """K: passes over each update's data (preset: 20 Discrete, 10 Box)"""
    minibatches: int | None = None
    """minibatches per epoch (preset: 1 Discrete, 32 Box: minibatches of 64 steps, as CleanRL and SB3). The
    preset counts them in one actor's segments (``envs_per_actor``): an update on the segments of N actors
    takes N times as many, so its minibatches keep their size (RL Zoo's ``batch_size``) and N actors make as
    many gradient steps per env step as one process. A count you set is the whole update's"""
    lr: float | None = None
    """Adam learning rate (preset: 1e-3 vectors, 2.5e-4 images, 2.5e-3 grids)"""
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
    store_frames_once: bool = True
    """for stacked frames (Atari's 4): a segment carries T + 4 frames, not 4 per step and 4 for last_obs"""
    recurrent: str | None = None
    """a cell between the encoder and the heads: "lstm", "gru", or None (feed-forward). Actors keep its state
    per env and send it with each segment; the learner unrolls it over whole segments (minibatches of whole
    segments, truncated backpropagation through time within each)"""
    recurrent_size: int = 128
    """units of the recurrent cell"""
    cell_first: bool | None = None
    """over vectors with ``recurrent``: the cells read the observations and ``hidden_block`` comes after each
    (SB3-contrib RecurrentPPO's order); False: ``hidden_block`` before the cells (CleanRL's). Preset: True
    Discrete (RL Zoo ppo_lstm's network), False otherwise; True set elsewhere (no cell, or image observations)
    is refused"""
    normalize_obs: bool | None = None
    """normalize observations by running mean and std (preset: off Discrete, on Box and for a recurrent
    config); the statistics travel with the params, so actors normalize as the trainer does"""
    normalize_reward: bool | None = None
    """scale rewards by the running std of the discounted return (preset: off Discrete, on Box)"""
    sync: bool = True
    """distributed: actors collect with the current params and wait for the next version (on-policy);
    False: asynchronous PPO, actors never wait (see the module docstring)"""
    max_policy_lag: int = 10
    """asynchronous PPO: segments acted with params more than this many versions old are refused"""
    sync_wait_s: float = 30.0
    """sync: seconds the trainer waits for every actor's segments before going on with what it has"""
    min_segments: int = 1
    """sync: the fewest segments the trainer goes on with after sync_wait_s"""

    def validate(self) -> None:
        super().validate()
        if self.hidden_block is not None:
            self.hidden_block.validate()
        self.encoder.validate()
        check_recurrent(self.recurrent, self.recurrent_size)
        check_cell_first(self.cell_first, self.recurrent)
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
        check_int("max_policy_lag", self.max_policy_lag, 0, 1 << 30)

    def check_spec(self, spec: EnvSpec) -> None:
        check_actions(spec, "ppo")
        check_cell_first(self.cell_first, self.recurrent, spec, self.encoder.check(spec))

    def data_path(self) -> DataPath:
        return DataPath(rows="segments", publish_every=0, sync=self.sync,
                        max_policy_lag=0 if self.sync else self.max_policy_lag, sync_wait_s=self.sync_wait_s,
                        lead_versions=None if self.sync else DataPath.lead_of(self.max_policy_lag),
                        min_segments=self.min_segments, segment_length=int(self.segment_length or 0))

    def schema(self, spec: EnvSpec) -> Schema:
        """One row per segment of T steps of one env (``srl.rl.actor_critic.segment_schema``)."""
        return config_segment_schema(self, spec, int(self.resolved(spec).segment_length or 1))

    def make_parameter(self, spec: EnvSpec, device: torch.device) -> ActorCriticParameter:
        return ActorCriticParameter(self.resolved(spec), spec, device)

    def make_worker(
        self, spec: EnvSpec, parameter: Parameter, actor_index: int, actor_num: int, seed: int | None
    ) -> SegmentWorker:
        assert isinstance(parameter, ActorCriticParameter)
        resolved = self.resolved(spec)
        return SegmentWorker(parameter, int(resolved.segment_length or 1), float(resolved.gamma or 0.99),
                             self.envs_per_actor, seed)

    def make_buffer(self, spec: EnvSpec, actor_num: int = 1) -> SegmentBuffer:
        # an update is a segment per env of every actor; room for a second (sync) or three more (async:
        # past that the trainer stops reading the queue and actors wait)
        rounds = 2 if self.sync else 4
        return SegmentBuffer(rounds * actor_num * self.envs_per_actor, self.schema(spec))

    def make_learner(self, spec: EnvSpec, parameter: Parameter, buffer: Buffer, actor_num: int = 1) -> PPOLearner:
        assert isinstance(parameter, ActorCriticParameter) and isinstance(buffer, SegmentBuffer)
        return PPOLearner(self.resolved(spec), parameter, buffer,
                          self.data_path().update_segments(actor_num, self.envs_per_actor),
                          per_actor_minibatches=self.minibatches is None)


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
    stale_segments: int = 0
    """asynchronous: segments dropped at training time for being more than max_policy_lag versions old"""


class PPOLearner(ReturnScaledLearner):
    """``train()`` runs one PPO update: sync, on every segment in the buffer (the distributed trainer
    calls it once all of this version's are in); asynchronous, on the next ``segments_per_update``."""

    optimizer: torch.optim.Optimizer

    def __init__(self, config: Config, parameter: ActorCriticParameter, buffer: SegmentBuffer,
                 segments_per_update: int, per_actor_minibatches: bool = False) -> None:
        super().__init__()
        self.config = config
        self.actor_segments = config.envs_per_actor if per_actor_minibatches else 0
        """the segments ``config.minibatches`` is counted in (one actor's: the preset's); 0: the whole update"""
        self.parameter = parameter
        self.buffer = buffer
        self.segments_per_update = segments_per_update
        self.device = parameter.device
        self.lr = float(config.lr or 1e-3)
        self.optimizer = make_adam(parameter.net.parameters(), self.lr, eps=1e-5)
        self.train_count = 0
        self.anneal = LinearAnneal()
        self.compute = LearnerCompute.of(config, self.device)
        self.compute.prepare(parameter.net.encoders())

    def plan(self, max_steps: int | None, max_train_count: int | None, env_steps: int = 0) -> None:
        """The run's budget: the learning rate and the clip range anneal to 0 over ``max_steps`` env steps
        (else over ``max_train_count`` gradient steps), from where the run is (``env_steps``)."""
        self.anneal.plan(max_steps, max_train_count, env_steps)

    def _scaled(self, reward: np.ndarray, done: np.ndarray) -> np.ndarray:
        return self.scale_rewards(reward, done, float(self.config.gamma or 0.99))

    def train(self) -> PPOStats | None:
        config, net, dev = self.config, self.parameter.net, self.device
        segments = self.buffer.take() if config.sync else self.buffer.take(self.segments_per_update)
        if segments is None:
            return None
        stale = 0
        if not config.sync:  # they may have aged in the buffer: the lag bound holds at training time too
            fresh = self.parameter.version - segments["version"] <= config.max_policy_lag
            stale = int((~fresh).sum())
            if not fresh.any():
                return PPOStats(loss=float("nan"), gradient_steps=0, stale_segments=stale)
            segments = {name: column[fresh] for name, column in segments.items()}
        n, horizon = segments["reward"].shape
        frac = self.anneal.advance(n * horizon, self.train_count)
        if not config.anneal_lr:
            frac = 1.0
        lr, clip = self.lr * frac, config.clip_coef * frac
        self.optimizer.param_groups[0]["lr"] = lr

        reward = segment_rewards(segments, self._scaled if config.normalize_reward else None)
        values = segments["value"]
        observations, last_obs = segment_observations(segments, self.parameter.frames)
        recurrent = net.recurrent is not None
        if recurrent:  # whole segments, each unrolled from the state its actor started it with
            obs = to_device(observations, dev)
            h, c, resets = segment_states(segments, dev)
            with torch.no_grad():
                current, last = bootstrapped_values(net, obs, to_device(last_obs, dev), h, c, resets)
                last_value = last.cpu().numpy()
                if not config.sync:
                    values = current.cpu().numpy().astype(np.float32)
        else:
            obs = to_device(observations.reshape(n * horizon, *observations.shape[2:]), dev)
            with torch.no_grad():
                last_value = net.value(to_device(last_obs, dev)).cpu().numpy()
                if not config.sync:  # acted with older params: the current critic's values, not the actor's
                    values = net.value(obs).cpu().numpy().reshape(n, horizon).astype(np.float32)
        advantages, returns = gae(reward, values, segments["done"], last_value,
                                  float(config.gamma or 0.99), float(config.gae_lambda or 0.95))

        action = to_device(segments["action"].reshape(n * horizon, *segments["action"].shape[2:]), dev)
        old_logprob = to_device(segments["logprob"].reshape(-1), dev)
        old_value = to_device(values.reshape(-1), dev)
        adv = to_device(advantages.reshape(-1), dev)
        ret = to_device(returns.reshape(-1), dev)

        # a minibatch is steps, or whole segments when the network is recurrent (its state runs through them)
        batch = n if recurrent else n * horizon
        parts = int(config.minibatches or 1)
        if self.actor_segments:  # the preset's minibatch size, whatever the actors this update's segments came from
            parts *= max(1, math.ceil(n / self.actor_segments))
        minibatch = max(1, batch // parts)
        # per-minibatch statistics stay on the device until the end: a read on the host would wait for it
        clip_fractions: list[torch.Tensor] = []
        kl, steps = torch.zeros(()), 0
        pg_loss = v_loss = entropy_loss = torch.zeros(())
        for _ in range(int(config.epochs or 1)):
            order = torch.randperm(batch, device=dev)
            for start in range(0, batch, minibatch):
                idx = order[start : start + minibatch]
                with self.compute.autocast():  # the outputs back to float32 before the losses use them
                    if recurrent:
                        logprob, entropy, value = net.evaluate_sequence(
                            obs[idx], action.view(n, horizon, *action.shape[1:])[idx], h[idx],
                            None if c is None else c[idx], resets[idx])
                        logprob, entropy, value = logprob.reshape(-1), entropy.reshape(-1), value.reshape(-1)
                        idx = (idx.unsqueeze(1) * horizon + torch.arange(horizon, device=dev)).reshape(-1)
                    else:
                        logprob, entropy, value = net.evaluate(obs[idx], action[idx])
                logprob, entropy, value = logprob.float(), entropy.float(), value.float()
                log_ratio = logprob - old_logprob[idx]
                ratio = log_ratio.exp()
                with torch.no_grad():
                    kl = ((ratio - 1) - log_ratio).mean()
                    clip_fractions.append(((ratio - 1.0).abs() > clip).float().mean())
                mb_adv = adv[idx]
                if config.norm_adv:
                    mb_adv = normalized_advantages(mb_adv)
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
        if net.normalize_obs:  # the next version's actors normalize with what this update saw
            net.obs_rms.update(obs)
        self.train_count += steps
        variance = float(np.var(returns))
        explained = float("nan") if variance == 0 else 1.0 - float(np.var(returns - values)) / variance
        return PPOStats(
            loss=float((pg_loss + config.vf_coef * v_loss).item()), gradient_steps=steps,
            policy_loss=float(pg_loss.item()), value_loss=float(v_loss.item()), entropy=float(entropy_loss.item()),
            approx_kl=float(kl.item()),
            clip_fraction=float(torch.stack(clip_fractions).mean().item()) if clip_fractions else 0.0,
            explained_variance=explained, lr=lr, segments=n, stale_segments=stale,
        )
