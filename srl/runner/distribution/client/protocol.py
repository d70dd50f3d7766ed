"""What the client needs of an ``srl.Runner``, as a Protocol.

Owns: ``Runner``, the seam between ``srl.runner.runner`` and the client: the runner module calls the
client, and the client sees the runner only through this. Must never: import ``srl.runner.runner`` (that
would close an import circle through the nodes the client starts).
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from srl.base.env import EnvConfig, EnvSpec
from srl.base.rl import Parameter, RLConfig


class Runner(Protocol):
    """What the client needs of an ``srl.Runner`` (the runner module calls the client, never the reverse)."""

    env_config: EnvConfig
    rl_config: RLConfig
    env_steps: int
    episodes: int

    @property
    def spec(self) -> EnvSpec: ...

    @property
    def parameter(self) -> Parameter: ...

    @property
    def train_count(self) -> int: ...

    def task_config(self) -> dict[str, Any]: ...

    def replica(self) -> Runner: ...

    def evaluate(self, max_episodes: int = 10, seed: int | None = None) -> list[float]: ...

    def save(self, path: str | os.PathLike[str]) -> None: ...

    def own_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None: ...

    def load_checkpoint(self, meta: dict[str, Any], arrays: dict[str, np.ndarray], source: str = ...) -> None: ...

    def set_parameter_arrays(self, arrays: dict[str, np.ndarray], version: int, train_count: int) -> None: ...
