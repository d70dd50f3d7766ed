"""Partitions on real processes (the cases are in tests/partitions.py): one node, an actor, the trainer or
the client, cut off from Redis (the board and the queue) for three lease TTLs, then healed. In each case the
leases lapse and are taken back (or over) as designed, a fenced trainer writes nothing, every batch sent is
received or refused exactly once (the client's end-of-run accounts), and the task finishes.
``python bench/partitions.py`` runs the same cases with 60 s cuts and the default lease settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.nodes import Node
from tests.partitions import CASES, check, run_case

pytestmark = pytest.mark.slow

LEASE_TTL_S = 2.0
"""tests/nodes.py's fast nodes' lease TTL"""


@pytest.mark.parametrize("case", CASES)
def test_a_node_cut_off_for_three_lease_ttls_loses_nothing_and_the_task_finishes(
    case: str, redis_url: str, namespace: str, tmp_path: Path, nodes: list[Node]
) -> None:
    result = run_case(case, redis_url, namespace, tmp_path, nodes, cut_s=3 * LEASE_TTL_S, lease_ttl_s=LEASE_TTL_S)
    check(result)
