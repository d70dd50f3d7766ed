#!/usr/bin/env bash
# The main job: a whole distributed DQN run on Pendulum-v1 on this machine
# (embedded Redis, one local trainer and one local actor), then an evaluation.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/distribution/all_local.py "$@"
