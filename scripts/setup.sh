#!/usr/bin/env bash
# Create (or reuse) .venv and install srl with its pinned dev environment.
# torch is installed first and alone: on these machines `torch==2.13.0` is a
# local CPU wheel, while a torch range would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.srl-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -c constraints.txt -e ".[dev]"
  echo "$want" > "$stamp"
fi
# The dashboard's browser test drives Debian's chromium (playwright comes with the dev extra;
# no `playwright install` download). Best effort: a machine without apt-get or root skips it.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
    >/dev/null 2>&1 || echo "setup: chromium not installed (the dashboard browser test will skip)" >&2
fi
