#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), check the code with ruff (pyproject.toml's [tool.ruff]), run the
# test suite on Triton 3.6, compile every kernel for sm_90 at every default world size (iris
# compile-check), then the multi-rank tests on the newest Triton and numpy (scripts/test_latest.sh).
# The compile checks and the newest Triton's set-up run alongside the suite at the lowest CPU
# priority: they take the time the suite's ranks spend waiting on each other, and none of the
# suite's.
# Extra arguments go to pytest, on .venv only (no lint then).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
status=0
.venv/bin/ruff check . || status=$?
logs=$(mktemp -d)
nice -n 19 .venv/bin/iris compile-check --quiet > "$logs/compile-check.log" 2>&1 &
check=$!
nice -n 19 scripts/test_latest.sh --prepare > "$logs/latest.log" 2>&1 &
latest=$!
.venv/bin/python -m pytest -q --durations=20 || status=$?  # the slowest tests: what to trim first
wait "$check" || status=1
echo "== iris compile-check (Triton 3.6)"; cat "$logs/compile-check.log"
wait "$latest" || status=1
echo "== newest Triton: set-up and iris compile-check"; cat "$logs/latest.log"
scripts/test_latest.sh --subset || status=$?
exit $status
