"""Replay memory settings: one dataclass that an algorithm's Config embeds as ``memory``.

Owns: the memory fields, their validation (with messages that say what was
expected, what came and what to do) and ``build``, the one place a config
turns into a ``Memory``.
Must never: hold experience or state of its own; it is data that travels to
the trainer as JSON and must rebuild the same memory there.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from srl.base.config import Settings
from srl.base.schema import Schema
from srl.rl.memories.proportional import ProportionalMemory
from srl.rl.memories.replay import Memory, ReplayMemory

MEMORY_KINDS = ("replay", "proportional")
MAX_CAPACITY = 1 << 30
"""most rows a memory may hold (the trainer also checks the bytes against what its machine allows)"""


@dataclass
class MemoryConfig(Settings):
    """Which replay memory the trainer builds, and how big and how prioritized it is."""

    kind: str = "proportional"
    """memory kind: "replay" (uniform) or "proportional" (prioritized, sum-tree)"""
    capacity: int = 100_000
    """most transitions kept; the oldest are overwritten first"""
    alpha: float = 0.6
    """priority exponent in [0, 1]: 0 samples uniformly, 1 fully in proportion to |TD error|"""
    beta_initial: float = 0.4
    """importance-sampling exponent in [0, 1] at the start; annealed linearly to 1.0"""
    beta_steps: int = 100_000
    """number of sample() calls over which beta reaches 1.0 (0: beta is 1.0 from the start)"""
    priority_epsilon: float = 1e-4
    """added to |TD error| before the exponent, so no transition has zero priority"""

    def set_replay_memory(self, capacity: int | None = None) -> None:
        """Uniform replay; keeps the current capacity unless one is given."""
        self.kind = "replay"
        if capacity is not None:
            self.capacity = capacity

    def set_proportional_memory(
        self,
        capacity: int | None = None,
        alpha: float = 0.6,
        beta_initial: float = 0.4,
        beta_steps: int = 100_000,
    ) -> None:
        """Proportional prioritized replay; keeps the current capacity unless one is given."""
        self.kind = "proportional"
        if capacity is not None:
            self.capacity = capacity
        self.alpha = alpha
        self.beta_initial = beta_initial
        self.beta_steps = beta_steps

    def validate(self) -> None:
        """Raise ValueError for the first field that cannot build a memory."""
        if self.kind not in MEMORY_KINDS:
            close = difflib.get_close_matches(str(self.kind)[:64], MEMORY_KINDS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"MemoryConfig.kind is {str(self.kind)[:40]!r}; expected one of {', '.join(map(repr, MEMORY_KINDS))}."
                f"{hint} Call set_replay_memory() or set_proportional_memory(), or set kind to one of those."
            )
        if not _is_int(self.capacity) or not 1 <= self.capacity <= MAX_CAPACITY:
            raise ValueError(
                f"MemoryConfig.capacity is {str(self.capacity)[:40]}; expected an int in 1..{MAX_CAPACITY} "
                f"(the most transitions kept, e.g. 100_000)"
            )
        if not _is_number(self.alpha) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(
                f"MemoryConfig.alpha is {self.alpha!r}; expected a number in [0, 1] "
                f"(0 = uniform, 1 = fully proportional; Ape-X uses 0.6)"
            )
        if not _is_number(self.beta_initial) or not 0.0 <= self.beta_initial <= 1.0:
            raise ValueError(
                f"MemoryConfig.beta_initial is {self.beta_initial!r}; expected a number in [0, 1] "
                f"(Ape-X uses 0.4, annealed to 1.0)"
            )
        if not _is_int(self.beta_steps) or not 0 <= self.beta_steps <= 2**62:
            raise ValueError(
                f"MemoryConfig.beta_steps is {self.beta_steps!r}; expected an int >= 0 "
                f"(sample() calls until beta reaches 1.0; 0 means 1.0 from the start)"
            )
        if not _is_number(self.priority_epsilon) or not self.priority_epsilon > 0.0:
            raise ValueError(
                f"MemoryConfig.priority_epsilon is {self.priority_epsilon!r}; expected a finite number > 0 "
                f"(e.g. 1e-4), so no transition ever has zero priority"
            )

    def build(self, seed: int | None = None, schema: Schema | None = None) -> Memory:
        """Validate, then make the memory this config describes; ``seed`` fixes its sampling.

        ``schema``: the rows it holds (allocated now, enforced on every add).
        """
        self.validate()
        if self.kind == "replay":
            return ReplayMemory(self.capacity, seed=seed, schema=schema)
        return ProportionalMemory(
            self.capacity,
            alpha=self.alpha,
            beta_initial=self.beta_initial,
            beta_steps=self.beta_steps,
            priority_epsilon=self.priority_epsilon,
            seed=seed,
            schema=schema,
        )


def _is_int(value: object) -> bool:
    # bool is an int subclass, but capacity=True is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
