"""The algorithm registry: name -> module, imported only when used.

Each module defines ``Config`` (an ``RLConfig`` dataclass) and reads top to bottom.
"""

from __future__ import annotations

import difflib
import importlib

from srl.base.rl import RLConfig

ALGORITHMS: dict[str, str] = {
    "dqn": "srl.algorithms.dqn",
    "ppo": "srl.algorithms.ppo",
    "impala": "srl.algorithms.impala",
    "r2d2": "srl.algorithms.r2d2",
    "sac": "srl.algorithms.sac",
}


class UnknownAlgorithmError(ValueError):
    """No algorithm is registered under that name."""


def config_class(name: str) -> type[RLConfig]:
    """The ``Config`` class of a registered algorithm."""
    if name not in ALGORITHMS:
        close = difflib.get_close_matches(name, list(ALGORITHMS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownAlgorithmError(
            f"no algorithm named {name!r}; this srl knows {sorted(ALGORITHMS)}.{hint} "
            "Run the same srl version on the client, actors and trainer."
        )
    module = importlib.import_module(ALGORITHMS[name])
    cls: type[RLConfig] = module.Config
    return cls
