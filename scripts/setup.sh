#!/usr/bin/env bash
# Create .venv with iris, iris-triton and iris-gluon (editable) and what they need.
# A torch or Triton already installed system-wide (e.g. a CUDA build on a GPU machine) is reused;
# otherwise the CPU build of torch 2.13.0 and Triton 3.6.0 are installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv --system-site-packages .venv
venv_python=.venv/bin/python
wanted=("numpy<2.4" "pytest>=8" "build")
"$venv_python" -c "import torch" 2>/dev/null || wanted+=("torch==2.13.0")
"$venv_python" -c "import triton" 2>/dev/null || wanted+=("triton==3.6.0")
"$venv_python" -m pip install -q --disable-pip-version-check "${wanted[@]}" -e . -e iris_triton -e iris_gluon
