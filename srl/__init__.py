"""srl: distributed reinforcement learning in the Ape-X style.

``srl.Runner(env, rl_config)`` trains in one process (``train``) or across
machines (``train_distribution``), then ``evaluate``, ``save`` and ``load``.

``Runner`` and ``EnvConfig`` are imported when first used, so ``srl status``
and the other commands that need no network start without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from srl.base.env import EnvConfig
    from srl.runner.runner import Runner

__version__ = "0.1.0"

__all__ = ["EnvConfig", "Runner", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Runner":
        from srl.runner.runner import Runner

        return Runner
    if name == "EnvConfig":
        from srl.base.env import EnvConfig

        return EnvConfig
    raise AttributeError(f"module 'srl' has no attribute {name!r}")
