#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), check the code with ruff (pyproject.toml's [tool.ruff]), compile
# every kernel for sm_90 at every default world size (iris compile-check) and run the test suite,
# then the same on the newest Triton and numpy (scripts/test_latest.sh: the check and the
# multi-rank tests).
# Extra arguments go to pytest, on .venv only (no lint then).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
status=0
.venv/bin/ruff check . || status=$?
.venv/bin/iris compile-check --quiet || status=$?
.venv/bin/python -m pytest -q --durations=20 || status=$?  # the slowest tests: what to trim first
scripts/test_latest.sh || status=$?
exit $status
