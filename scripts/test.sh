#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), check the code with ruff (pyproject.toml's [tool.ruff]), run the
# test suite on Triton 3.6, compile every kernel for sm_90 at every default world size (iris
# compile-check), then the multi-rank tests on the newest Triton and numpy (scripts/test_latest.sh).
# The compile checks (and the newest Triton's set-up) run alongside the suites, the checks at the
# lowest CPU priority: they take the time the suites' ranks spend waiting on each other, and next
# to none of the suites'.
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
(if scripts/test_latest.sh --setup > "$logs/latest-setup.log" 2>&1; then echo 0; else echo 1; fi \
   > "$logs/latest-setup.status"
 nice -n 19 scripts/test_latest.sh --check > "$logs/latest-check.log" 2>&1) &
latest=$!
.venv/bin/python -m pytest -q --durations=20 || status=$?  # the slowest tests: what to trim first
while [ ! -s "$logs/latest-setup.status" ] && kill -0 "$latest" 2>/dev/null; do sleep 2; done  # .venv-latest ready
echo "== newest Triton: set-up"; cat "$logs/latest-setup.log"
if [ "$(cat "$logs/latest-setup.status" 2>/dev/null)" = 0 ]; then
  scripts/test_latest.sh --subset || status=$?
else
  status=1
fi
wait "$check" || status=1
echo "== iris compile-check (Triton 3.6)"; cat "$logs/compile-check.log"
wait "$latest" || status=1
echo "== iris compile-check (newest Triton)"; cat "$logs/latest-check.log"
exit $status
