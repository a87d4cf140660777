#!/usr/bin/env bash
# The multi-rank tests on the newest Triton and numpy, as `pip install` gives a laptop user, in a
# second environment (scripts/setup.sh --latest: .venv-latest), after compiling every kernel with
# this Triton: iris compile-check of every kernel family, algorithm, method and root once (the
# focused calls, at the interior rank of a world of 3, with tracing and in Gluon); the check on
# .venv's Triton compiles every rank, world, dtype, launch shape and tile. Extra arguments go to
# pytest alone; without any, the check and the subset below run (the tests whose ranks run
# kernels, in two-rank worlds: the full suite on .venv covers three ranks). One step alone:
# --setup, --check (the compile check) or --subset (scripts/test.sh runs them alongside its own work).
set -euo pipefail
cd "$(dirname "$0")/.."
venv_python=.venv-latest/bin/python
subset=(tests/test_ccl.py tests/test_device_api.py tests/test_fused.py tests/test_ptx.py tests/test_context.py
        tests/test_upstream_device_api.py tests/test_upstream_launch.py tests/test_upstream_tiles.py
        tests/test_upstream_heap.py tests/test_all_to_all_v.py tests/test_p2p.py tests/test_torch_integration.py
        tests/test_tile_collectives.py tests/test_moe.py tests/test_all_reduce_rmsnorm.py tests/test_tracing.py
        -k "not world3 and not world4 and not world5")
steps=(setup check subset)
case "${1:-}" in
  --setup|--check|--subset) steps=("${1#--}"); shift ;;
esac
status=0
for step in "${steps[@]}"; do
  case "$step" in
    setup)
      scripts/setup.sh --latest
      "$venv_python" -c "import numpy, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
      if [ $# -gt 0 ]; then
        exec "$venv_python" -m pytest -q "$@"
      fi ;;
    check) .venv-latest/bin/iris compile-check --quiet --worlds 3 --ranks 1 --focused || status=$? ;;
    subset) "$venv_python" -m pytest -q "${subset[@]}" || status=$? ;;
  esac
done
exit $status
