#!/usr/bin/env bash
# The whole GPU check in one call (for a machine with GPUs and no network): install the three
# packages offline, print versions and topology, run the test suite (GPU tests on all GPUs),
# then the benchmarks. Logs and JSON results go to $OUT (default /tmp/iris-gpu-check).
#   scripts/gpu_check.sh [--tests "pytest args"] [--step NAME ...] [--bench "module args" ...]
# Named steps, each within one 10-minute call on one H200 (ranks share the GPU, time-sliced):
#   shared-gpu-3-4, shared-gpu-8   every multi-rank path at worlds 3 and 4, and 8 (tests/test_shared_gpu.py;
#                                  $IRIS_SHARED_FAMILIES=moe,... re-runs some of its families)
#   faults-a, faults-b, faults-c   the fault matrix (tests/test_failstop.py, worlds 2 and 3 on GPU ranks)
#   upstream-a, upstream-b         upstream iris's own tests (x, ccl, ops; unittests) at world 1 ($UPSTREAM_RANKS
#                                  ranks sharing the GPU otherwise), from a checkout of upstream iris in
#                                  .upstream/ (ignored; pass carry [".upstream"]), Gluon kernels' 64 lanes made
#                                  32 (scripts/upstream_tests.py)
#   as-symmetric                   tensors mapped into cuda-vmm heaps in place (tests/test_as_symmetric.py,
#                                  worlds 1 to 3), then upstream's tests of as_symmetric and its virtual-memory
#                                  allocator at world 1 and on 2 ranks sharing the GPU (needs .upstream/)
#   upstream-examples              every example of that checkout at world 1 (scripts/upstream_examples.py)
#   upstream-examples-2            every example at 2 ranks (on one GPU: sharing it)
# The full check on one GPU is these steps: a call each.
# The whole suite takes longer than one 10-minute call: split it by files, e.g. --tests "-q
# tests/test_[a-f]*.py" in one call and --tests "-q tests/test_[g-z]*.py" in the next. The fault
# matrix (tests/test_failstop.py, on GPU ranks there) alone takes more than 10 minutes on one H200:
# split it by test (-k dead_peer, -k "killed_during or late_by_more", ...) across calls.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/iris-gpu-check}"
mkdir -p "$OUT"
tests="-q tests"
benches=()
upstream=()
upstream_select=""
upstream_ranks="${UPSTREAM_RANKS:-1}"
examples=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests="$2"; shift 2 ;;
    --step)
      case "$2" in
        shared-gpu-3-4) tests="-q tests/test_shared_gpu.py -k 'world3 or world4'" ;;
        shared-gpu-8) tests="-q tests/test_shared_gpu.py -k world8" ;;
        faults-a) tests="-q tests/test_failstop.py -k 'late_by_less or busy or mismatched'" ;;
        faults-b) tests="-q tests/test_failstop.py -k 'dead_peer or give_up or sentinel or trap'" ;;
        faults-c) tests="-q tests/test_failstop.py -k 'killed_during or late_by_more or threads'" ;;
        upstream-a) tests=""; upstream=(x ccl ops) ;;
        upstream-b) tests=""; upstream=(unittests) ;;
        as-symmetric) tests="-q tests/test_as_symmetric.py tests/test_descriptors.py"; upstream=(unittests)
                      upstream_select="as_symmetric or vmem or is_symmetric_imported"; upstream_ranks="1 2" ;;
        upstream-examples) tests=""; examples=1 ;;
        upstream-examples-2) tests=""; examples=2 ;;
        *) echo "unknown step $2" >&2; exit 2 ;;
      esac
      shift 2 ;;
    --bench) benches+=("$2"); shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
status=0
python3 -m pip install -q --no-deps --no-build-isolation -e . -e iris_triton -e iris_gluon || exit 1
python3 -c "import torch, triton, numpy, iris; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'gpus', torch.cuda.device_count(), 'backends', iris.available_backends())"
nvidia-smi topo -m 2>&1 | head -8
if [ -n "$tests" ]; then
  # The pytest arguments as written, quotes included (e.g. -k "a or b").
  eval "python3 -m pytest $tests" 2>&1 | tee "$OUT/pytest.log" | tail -40 || true
  grep -qE "(passed|skipped)" "$OUT/pytest.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/pytest.log" || status=1
fi
for ranks in $([ ${#upstream[@]} -gt 0 ] && echo "$upstream_ranks"); do
  python3 scripts/upstream_tests.py --upstream .upstream --ranks "$ranks" --out "$OUT/upstream-$ranks" \
    ${upstream_select:+-k "$upstream_select"} "${upstream[@]}" 2>&1 \
    | tee "$OUT/upstream-$ranks.log" | grep -v "^    " | tail -60 || status=1
done
if [ -n "$examples" ]; then
  python3 scripts/upstream_examples.py --upstream .upstream --ranks "$examples" --out "$OUT/examples-$examples" 2>&1 \
    | tee "$OUT/examples-$examples.log" || status=1
fi
for bench in "${benches[@]}"; do
  echo "== benchmark: $bench"
  # shellcheck disable=SC2086
  python3 -m benchmarks.$bench --out "$OUT" 2>&1 | tee -a "$OUT/bench.log" | tail -30 || status=1
done
exit $status
