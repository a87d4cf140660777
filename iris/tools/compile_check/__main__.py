"""``python -m iris.tools.compile_check``: what ``iris compile-check`` runs (with the interpreter off)."""

from __future__ import annotations

import argparse
import sys

from iris.tools.compile_check import DEFAULT_WORLDS, compile_check


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="iris compile-check",
        description="Compile, without a GPU and without running anything, every kernel the installed backends launch, "
                    "with every compile-time choice the host side can make, at each world size; print one line per "
                    "kernel family and every failure with its arguments and the compiler's message; exit 1 on any "
                    "failure.")
    p.add_argument("--worlds", default=",".join(map(str, DEFAULT_WORLDS)),
                   help="comma-separated world sizes (default %(default)s); every rank of worlds up to 4, the first "
                        "and last rank above")
    p.add_argument("--arch", default="sm_90",
                   help="target architecture (default %(default)s; sm_100 where the installed Triton targets it)")
    p.add_argument("--backends", default=None, help="comma-separated backends (default: every installed GPU backend)")
    p.add_argument("--only", default=None, help="comma-separated kernel families to compile (as the report names them)")
    p.add_argument("--ranks", default=None,
                   help="comma-separated ranks: only these ranks of each world (default: every rank of worlds up to 4, "
                        "the first and last rank above)")
    p.add_argument("--focused", action="store_true",
                   help="only the focused calls (each algorithm, method and root once, in one dtype), not the full "
                        "ones (every dtype, reduction, launch shape and tile)")
    p.add_argument("--jobs", type=int, default=None, help="compiler processes (default: the usable cores)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    worlds, ranks = _integers("--worlds", args.worlds), None if args.ranks is None else _integers("--ranks", args.ranks)
    report = compile_check(worlds, arch=args.arch, jobs=args.jobs, only=args.only.split(",") if args.only else None,
                           ranks=ranks, focused=args.focused,
                           backends=args.backends.split(",") if args.backends else None,
                           progress=None if args.quiet else lambda line: print(line, file=sys.stderr, flush=True))
    print("\n".join(report.lines()), flush=True)
    return 0 if report.ok else 1


def _integers(option: str, text: str) -> list[int]:
    try:
        return [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        parser().error(f"{option} takes comma-separated integers, got {text!r}")


if __name__ == "__main__":
    sys.exit(main())
