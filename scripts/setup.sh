#!/usr/bin/env bash
# Create .venv with iris, iris-triton and iris-gluon (editable) and what they need.
# A torch or Triton already installed system-wide (e.g. a CUDA build on a GPU machine) is reused;
# otherwise the CPU build of torch 2.13.0 and Triton 3.6.0 are installed.
#   scripts/setup.sh            .venv: Triton 3.6.0 with numpy<2.4 (the GPU machine's combination)
#   scripts/setup.sh --latest   .venv-latest: the newest Triton and numpy, as `pip install` gives them
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=.venv
pins=("numpy<2.4")
if [ "${1:-}" = "--latest" ]; then
  venv=.venv-latest
  pins=()
fi
[ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv"
venv_python="$venv/bin/python"
if [ "$venv" = .venv-latest ]; then
  "$venv_python" -m pip install -q --disable-pip-version-check --upgrade triton numpy
fi
wanted=("${pins[@]}" "pytest>=8" "build" "ruff" "matplotlib")
"$venv_python" -c "import torch" 2>/dev/null || wanted+=("torch==2.13.0")
"$venv_python" -c "import triton" 2>/dev/null || wanted+=("triton==3.6.0")
"$venv_python" -m pip install -q --disable-pip-version-check "${wanted[@]}" -e . -e iris_triton -e iris_gluon
