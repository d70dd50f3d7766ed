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
