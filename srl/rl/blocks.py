"""Network building blocks configured by data (used by every algorithm's Config).

Owns: ``MLPBlockConfig`` and the torch module it builds. Must never: know an algorithm.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from srl.base.config import Settings

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "elu": nn.ELU, "silu": nn.SiLU}
MAX_LAYERS = 16
MAX_UNITS = 16384
MAX_WEIGHTS = 50_000_000
"""weights between hidden layers a block may have (200 MB of float32): configs may come from a board"""


@dataclass
class MLPBlockConfig(Settings):
    """A stack of fully connected layers."""

    layer_sizes: tuple[int, ...] = (64, 64)
    """units of each hidden layer"""
    activation: str = "relu"
    """one of relu, tanh, elu, silu"""
    layer_norm: bool = False
    """normalize each hidden layer's pre-activations (Linear -> LayerNorm -> activation)"""

    def __str__(self) -> str:
        """``64x64 tanh``: the layers and their activation, as a run's preset line says them."""
        return f"{'x'.join(map(str, self.layer_sizes))} {self.activation}" + (" layer_norm" if self.layer_norm else "")

    def set_mlp(self, layer_sizes: tuple[int, ...] = (64, 64), activation: str = "relu") -> None:
        self.layer_sizes = tuple(int(s) for s in layer_sizes)
        self.activation = activation
        self.validate()

    def validate(self) -> None:
        sizes = self.layer_sizes
        if not sizes or len(sizes) > MAX_LAYERS or any(
            isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= MAX_UNITS for s in sizes
        ):
            raise ValueError(
                f"layer sizes must be 1..{MAX_LAYERS} integers in 1..{MAX_UNITS}, got {str(sizes)[:80]}"
            )
        weights = sum(a * b for a, b in itertools.pairwise(sizes))
        if weights > MAX_WEIGHTS:
            raise ValueError(f"layer sizes {sizes} need {weights:,} weights; at most {MAX_WEIGHTS:,} are allowed")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {str(self.activation)[:40]!r} is not one of {sorted(ACTIVATIONS)}")

    def build(self, in_features: int) -> tuple[nn.Module, int]:
        """The block and the size of its output."""
        self.validate()
        layers: list[nn.Module] = []
        size = in_features
        for units in self.layer_sizes:
            layers.append(nn.Linear(size, units))
            if self.layer_norm:
                layers.append(nn.LayerNorm(units))
            layers.append(ACTIVATIONS[self.activation]())
            size = units
        return nn.Sequential(*layers), size


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A learner's batch array as a tensor on ``device``. On the CPU it is the array's own memory (no
    copy). On CUDA the rows go through pinned (page-locked) host memory and a non-blocking copy: one
    DMA queued on the current stream behind the work already there, instead of a copy staged through
    pageable memory that the host waits for. The pinned block comes from torch's caching host
    allocator, which does not hand it out again before the copy has completed."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def make_adam(params: Iterable[torch.Tensor], lr: float, eps: float = 1e-8) -> torch.optim.Adam:
    """Adam with the fused kernel where this torch has one for the device (a third faster per step on
    CPU for small nets than the per-tensor loop torch picks by default there)."""
    params = list(params)
    try:
        return torch.optim.Adam(params, lr=lr, eps=eps, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr, eps=eps)
