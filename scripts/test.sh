#!/usr/bin/env bash
# The test suite, as CI runs it: brokers up, environment installed, lint, types, docs, tests.
# Extra arguments go to pytest (e.g. scripts/test.sh -k codec -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh start
bash scripts/setup.sh
. .venv/bin/activate
export PUBSUB_EMULATOR_HOST=${PUBSUB_EMULATOR_HOST:-127.0.0.1:8085}
ruff check srl tests bench examples
mypy srl
# the docs site (docs/, mkdocs.yml): a broken link in the docs fails the test command.
# No --quiet (nor -v): mkdocs 1.6 then drops warnings before strict mode counts them
# (mkdocs/mkdocs#4126). NO_MKDOCS_2_WARNING hides mkdocs-material's end-of-life banner.
NO_MKDOCS_2_WARNING=1 mkdocs build --strict
python -m pytest -q --durations=25 "$@"  # the slowest tests named: what keeps the suite from its 20-minute aim
