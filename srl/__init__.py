"""srl: distributed reinforcement learning in the Ape-X style.

``srl.Runner(env, rl_config)`` trains in one process (``train``) or across
machines (``train_distribution``), then ``evaluate``, ``save`` and ``load``.
"""

from srl.base.env import EnvConfig
from srl.runner.runner import Runner

__version__ = "0.1.0"

__all__ = ["EnvConfig", "Runner", "__version__"]
