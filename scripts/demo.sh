#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run the demo: CPU ranks when no GPU is visible, GPUs otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/iris demo "$@"
