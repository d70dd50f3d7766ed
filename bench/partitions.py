"""Partitions of 60 s on real processes with the default lease settings: an actor, the trainer (with a
standby trainer) and the client, each cut off from Redis (the board and the experience queue) in turn.

    python bench/partitions.py                          # the three cases, 60 s cuts, lease TTL 5 s
    python bench/partitions.py --cases trainer --cut 90

The cases are ``tests/partitions.py`` (the test suite runs them with cuts of three 2 s TTLs): the node
reaches an embedded Redis through ``tests/wan_proxy.py``, whose partition holds the traffic as a dropped
route does (TCP keeps the connections and retransmits; the peers hear nothing) and delivers it on healing.
A cut of 60 s is as long as redis-py's socket timeout in srl (60 s): commands sent before the cut may time
out and be sent again on a new connection while the first copy is still on its way, which is where a
batch could arrive twice. The table says, per case, whether the task finished, what the lease events
were, the client's batch accounts (sent = received + refused + still queued) and the duplicates the
trainer recognised and dropped.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srl.runner.distribution.client.embedded import start_embedded_redis
from tests.nodes import Node
from tests.partitions import CASES, PartitionResult, check, run_case

DEFAULT_NODE = ("--lease-ttl", "5", "--heartbeat-interval", "1", "--task-poll-interval", "1")
"""srl's defaults for every node (tests/nodes.py starts nodes with faster ones)"""


def verdict(result: PartitionResult) -> str:
    try:
        check(result)
    except AssertionError as e:
        return f"FAILED: {e}"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated among {', '.join(CASES)}")
    parser.add_argument("--cut", type=float, default=60.0, help="seconds each partition lasts")
    parser.add_argument("--more-training", type=int, default=2000,
                        help="train steps after healing before the task is ended")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    rows = []
    with start_embedded_redis() as server, tempfile.TemporaryDirectory() as tmp:
        url = f"redis://127.0.0.1:{server.port}/0"
        for case in cases:
            nodes: list[Node] = []
            try:
                result = run_case(case, url, f"bench-partition-{case}-{uuid.uuid4().hex[:6]}", Path(tmp), nodes,
                                  cut_s=args.cut, node_args=DEFAULT_NODE, lease_ttl_s=5.0,
                                  more_training=args.more_training)
            finally:
                for node in nodes:
                    node.stop()
            rows.append(result)
            print(f"{case}: {verdict(result)}", flush=True)
    print(f"\n| node cut off for {args.cut:g} s | task | lease events | batches | duplicates dropped | verdict |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        events = "; ".join(e for e in r.lease_events if "took lease" not in e) or "none"
        print(f"| {r.case} | {r.status} at train {r.train_count} | {events} | {r.accounts} | {r.duplicates} | "
              f"{verdict(r)} |")


if __name__ == "__main__":
    main()
