"""The role interfaces every algorithm implements.

Owns: ``RLConfig`` (an algorithm's settings as one dataclass), ``Parameter``
(the weights, to and from bytes without pickle), ``Worker`` (acts in an env and
turns steps into transitions), ``Trainer`` (learns from a memory). Must never:
import anything distributed. The same objects run in one process
(``Runner.train``) and split across machines (actor and trainer processes).

The loops that call them::

    # an actor (or Runner.train)                # the trainer
    obs = env.reset(); worker.on_reset(obs)       while not done:
    while running:                                    stats = trainer.train()   # None: not enough data
        action = worker.act(obs)                      if stats and time_to_publish:
        next_obs, r, term, trunc = env.step(action)       blob = parameter.to_bytes()
        worker.on_step(obs, action, r, next_obs, term, trunc)
        if worker.pending() >= batch_size:
            columns = worker.take_transitions()
            priorities = worker.initial_priorities(columns)
            send(columns, priorities)              # or memory.add(columns, priorities)
"""

from __future__ import annotations

import dataclasses
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from srl.base.arrays import pack_arrays, unpack_arrays
from srl.base.env import EnvSpec
from srl.base.schema import Schema
from srl.rl.memories import Memory, MemoryConfig

Columns = dict[str, np.ndarray]
"""A batch of transitions as columns; every array has the same leading length."""

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]{1,2})?")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {str(value)[:40]}")


def check_number(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite number in [low, high] ((low, high] with ``low_open``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value < low or value > high or (low_open and value == low)):  # type: ignore[operator]
        ok = False
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a finite number in {bracket}{low:g}, {high:g}], got {str(value)[:40]}")


def check_int(name: str, value: object, low: int, high: int) -> None:
    """Raise ValueError unless ``value`` is an int in [low, high]."""
    _check_int(name, value, low, high)


@dataclass
class RLConfig(ABC):
    """Settings shared by every algorithm; each algorithm's ``Config`` extends it."""

    algorithm: ClassVar[str] = ""
    """registry name of the algorithm (e.g. "dqn")"""

    action_bins: int = 5
    """bins per dimension when a Box action space is discretized"""
    batch_size: int = 32
    """transitions per gradient step"""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """replay memory (uniform or proportional)"""
    warmup_size: int = 1000
    """transitions in memory before training starts"""
    device: str = "auto"
    """torch device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1", ..."""
    torch_threads: int = 1
    """torch CPU threads per process (small nets run fastest on one)"""
    seed: int | None = None
    """seed for torch, numpy and the env; None draws one"""

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for but CUDA is not available here; use 'auto' or 'cpu'")
        return device

    def validate(self) -> None:
        """Raise ValueError naming the field when a setting cannot work (or is beyond any sane bound:
        a config may come from an untrusted board)."""
        _check_int("batch_size", self.batch_size, 1, 1 << 16)
        _check_int("warmup_size", self.warmup_size, 0, 1 << 30)
        _check_int("action_bins", self.action_bins, 2, 1024)
        _check_int("torch_threads", self.torch_threads, 1, 256)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        if not isinstance(self.device, str) or not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {str(self.device)[:40]!r}")
        self.memory.validate()
        if self.warmup_size < self.batch_size:
            raise ValueError(
                f"warmup_size ({self.warmup_size}) must be at least batch_size ({self.batch_size})"
            )
        if self.memory.capacity < self.warmup_size:
            raise ValueError(
                f"memory.capacity ({self.memory.capacity}) is smaller than warmup_size ({self.warmup_size}); "
                "training would never start"
            )

    def copy(self) -> RLConfig:
        return dataclasses.replace(self)

    @abstractmethod
    def schema(self, spec: EnvSpec) -> Schema:
        """The columns this algorithm's worker emits for ``spec`` (what the trainer's buffer holds and
        what every batch from an actor must match)."""

    @abstractmethod
    def make_parameter(self, spec: EnvSpec, device: torch.device) -> Parameter: ...

    @abstractmethod
    def make_worker(
        self, spec: EnvSpec, parameter: Parameter, actor_index: int, actor_num: int, seed: int | None
    ) -> Worker: ...

    @abstractmethod
    def make_trainer(self, spec: EnvSpec, parameter: Parameter, memory: Memory) -> Trainer: ...

    def make_memory(self, spec: EnvSpec) -> Memory:
        return self.memory.build(seed=self.seed, schema=self.schema(spec))


class Parameter(ABC):
    """An algorithm's weights. ``version`` counts updates the trainer made."""

    version: int = 0

    @abstractmethod
    def to_arrays(self) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def from_arrays(self, arrays: dict[str, np.ndarray]) -> None: ...

    def to_bytes(self, meta: dict[str, Any] | None = None) -> bytes:
        return pack_arrays(self.to_arrays(), {"version": self.version, **(meta or {})})

    def from_bytes(self, blob: bytes) -> dict[str, Any]:
        """Load weights; returns the meta stored with them."""
        meta, arrays = unpack_arrays(blob)
        self.from_arrays(arrays)
        version = meta.get("version")
        if isinstance(version, int):
            self.version = version
        return meta


def torch_to_arrays(modules: dict[str, torch.nn.Module]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for prefix, module in modules.items():
        for name, tensor in module.state_dict().items():
            out[f"{prefix}.{name}"] = tensor.detach().to("cpu").numpy().copy()
    return out


def torch_from_arrays(modules: dict[str, torch.nn.Module], arrays: dict[str, np.ndarray]) -> None:
    """Load arrays into modules; missing/extra/mis-shaped entries raise ValueError naming them."""
    for prefix, module in modules.items():
        current = module.state_dict()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in current.items():
            key = f"{prefix}.{name}"
            if key not in arrays:
                raise ValueError(f"parameters lack {key!r}: they were made by another algorithm or network shape")
            if tuple(arrays[key].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"parameter {key!r} has shape {tuple(arrays[key].shape)}, this network expects "
                    f"{tuple(tensor.shape)}: the hidden layers or env differ"
                )
            state[name] = torch.as_tensor(np.array(arrays[key]), dtype=tensor.dtype)
        module.load_state_dict(state)


class Worker(ABC):
    """Acts in one env and turns its steps into transitions (see the module docstring)."""

    training: bool = True

    @abstractmethod
    def on_reset(self, obs: np.ndarray) -> None: ...

    @abstractmethod
    def act(self, obs: np.ndarray) -> int: ...

    @abstractmethod
    def on_step(
        self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray, terminated: bool, truncated: bool
    ) -> None: ...

    @abstractmethod
    def pending(self) -> int:
        """Transitions finished and not yet taken."""

    @abstractmethod
    def take_transitions(self) -> Columns | None:
        """The finished transitions as columns (None when there are none); they leave the worker."""

    def initial_priorities(self, columns: Columns) -> np.ndarray | None:
        """|TD error| per transition with the worker's own weights, or None (memory uses its max)."""
        return None


@dataclass
class TrainStats:
    """What one update reports."""

    loss: float
    extra: dict[str, float] = field(default_factory=dict)


class Trainer(ABC):
    """Samples from a memory and updates the parameter; ``train_count`` counts updates."""

    train_count: int = 0

    @abstractmethod
    def train(self) -> TrainStats | None:
        """One update, or None when the memory does not hold enough to start."""

    def on_parameters_loaded(self) -> None:  # noqa: B027 - an optional hook, empty on purpose
        """The parameter's weights were replaced (a checkpoint, or params restored from the board):
        bring any state derived from them (a target network) in line. Nothing by default."""
