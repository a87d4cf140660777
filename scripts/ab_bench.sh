#!/usr/bin/env bash
# Compare a benchmark between an earlier revision and the working tree in one GPU call: runs
# alternate (earlier, current, earlier, current, ...) so that drift between runs hits both alike.
#
#   scripts/ab_bench.sh prepare REV              # here: the tree of REV into .ab/earlier
#   scripts/ab_bench.sh run "MODULE ARGS" [N]    # on the GPU machine (carry .ab): N pairs, default 2
#
# Each run's JSON goes to $OUT as ab-{earlier,current}-<i>-<name>.json; the printed figures to
# stdout. The earlier tree is installed (not editable) into .ab/site and imported ahead of the
# installed packages through PYTHONPATH, its own metadata included: the entry points that name
# its algorithms are the earlier tree's, not the working tree's.
set -euo pipefail
cd "$(dirname "$0")/.."
earlier="$PWD/.ab/earlier"
case "${1:-}" in
  prepare)
    rev="${2:?usage: scripts/ab_bench.sh prepare REV}"
    rm -rf "$earlier" && mkdir -p "$earlier"
    git archive "$rev" | tar -x -C "$earlier"
    git rev-parse --short "$rev" > "$earlier/REVISION"
    echo "prepared $(git rev-parse --short "$rev") in .ab/earlier; carry .ab in the GPU call"
    ;;
  run)
    read -r -a bench <<< "${2:?usage: scripts/ab_bench.sh run \"MODULE ARGS\" [N]}"
    pairs="${3:-2}"
    OUT="${OUT:-/tmp/iris-ab}"
    mkdir -p "$OUT"
    [ -d "$earlier" ] || { echo "no .ab/earlier: run 'scripts/ab_bench.sh prepare REV' first" >&2; exit 2; }
    python3 -m pip install -q --no-deps --no-build-isolation -e . -e iris_triton -e iris_gluon
    site="$PWD/.ab/site"
    rm -rf "$site"
    python3 -m pip install -q --no-deps --no-build-isolation --target "$site" \
      "$earlier" "$earlier/iris_triton" "$earlier/iris_gluon"
    for i in $(seq 1 "$pairs"); do
      for side in earlier current; do
        tree=$([ "$side" = earlier ] && echo "$earlier" || echo "$PWD")
        allowed=$([ "$side" = earlier ] && echo "('$tree/', '$site/')" || echo "('$PWD/',)")
        echo "== $side $i ($(cat "$tree/REVISION" 2>/dev/null || echo "working tree"))"
        export PYTHONPATH=$([ "$side" = earlier ] && echo "$site" || echo "")
        (cd "$tree" && python3 -c "import sys, iris, iris_triton; sys.exit(not all(
            m.__file__.startswith($allowed) for m in (iris, iris_triton)))" \
           || { echo "iris is not imported from $allowed" >&2; exit 1; })
        (cd "$tree" && python3 -m "benchmarks.${bench[0]}" "${bench[@]:1}" --out "/tmp/iris-ab-$side-$i" \
           | grep -v '^wrote')
        for json in "/tmp/iris-ab-$side-$i"/*.json; do
          cp "$json" "$OUT/ab-$side-$i-$(basename "$json")"
        done
      done
    done
    ;;
  *)
    sed -n 2,9p "$0" >&2
    exit 2
    ;;
esac
