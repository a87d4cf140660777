#!/usr/bin/env bash
# The multi-rank tests on the newest Triton and numpy, as `pip install` gives a laptop user: a
# second environment, .venv-latest (torch 2.13.0's CPU build unless one is installed system-wide).
# Extra arguments go to pytest; without any, the subset below runs (two-rank worlds: the full suite
# on .venv covers three ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv-latest/bin/python ] || "$python" -m venv --system-site-packages .venv-latest
venv_python=.venv-latest/bin/python
wanted=("pytest>=8" "build")
"$venv_python" -c "import torch" 2>/dev/null || wanted+=("torch==2.13.0")
"$venv_python" -m pip install -q --disable-pip-version-check --upgrade triton numpy
"$venv_python" -m pip install -q --disable-pip-version-check "${wanted[@]}" -e . -e iris_triton -e iris_gluon
"$venv_python" -c "import numpy, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
subset=(tests/test_ccl.py tests/test_device_api.py tests/test_fused.py tests/test_testing_plugin.py tests/test_ptx.py
        tests/test_context.py -k "not world3")
[ $# -gt 0 ] || set -- "${subset[@]}"
exec "$venv_python" -m pytest -q "$@"
