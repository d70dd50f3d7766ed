"""Operating srl: what an operator meets running it for a week (help, typos, bad input, bad
credentials, replaced and re-attached tasks, refusals, counters that reconcile)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from srl.cli import build_parser

SUBCOMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


@pytest.mark.parametrize("command", ["", *SUBCOMMANDS])
def test_every_subcommand_has_help(command: str) -> None:
    args = [sys.executable, "-m", "srl.cli", *([command] if command else []), "--help"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: srl" in done.stdout and "Traceback" not in done.stderr


def test_a_misspelled_setting_raises_with_the_closest_name() -> None:
    from srl.algorithms import dqn, impala, ppo
    from srl.runner.distribution import ActorOptions, RabbitMQParameters, RedisParameters, TrainerOptions

    config = dqn.Config()
    with pytest.raises(AttributeError, match=r"dqn\.Config has no setting 'lr_typo'; did you mean 'lr'"):
        config.lr_typo = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="MemoryConfig has no setting 'capcity'; did you mean 'capacity'"):
        config.memory.capcity = 10  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="did you mean 'layer_sizes'"):
        config.hidden_block.layer_size = (8,)  # type: ignore[attr-defined]
    for settings in (ppo.Config(), impala.Config(), ActorOptions(), TrainerOptions(), RedisParameters(),
                     RabbitMQParameters()):
        with pytest.raises(AttributeError, match="has no setting 'no_such_thing'"):
            settings.no_such_thing = 1  # type: ignore[attr-defined]
    config.lr, config.memory.capacity = 0.5, 10  # real settings still set
    assert (config.lr, config.memory.capacity) == (0.5, 10)
