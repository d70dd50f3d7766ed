#!/usr/bin/env bash
# The test suite, as CI runs it: brokers up, environment installed, lint, types, tests.
# Extra arguments go to pytest (e.g. scripts/test.sh -k codec -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh start
bash scripts/setup.sh
. .venv/bin/activate
export PUBSUB_EMULATOR_HOST=${PUBSUB_EMULATOR_HOST:-127.0.0.1:8085}
ruff check srl tests bench examples
mypy srl
python -m pytest -q "$@"
