"""The ``iris`` command: ``info``, ``demo``, ``bench``, ``run``, ``tune`` and ``compile-check``.

Mistakes of the user (a bad option, a missing script, a benchmark that needs GPUs there are not)
end in one line ``iris: error: ...`` and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from iris.errors import IrisError

#: ``iris bench`` runs these modules of a source checkout's ``benchmarks`` package, with their
#: arguments for a full run and for ``--quick``; each writes its JSON (and some PNG) files into ``--out``.
#: ``iris bench --cpu`` runs them on 2 CPU ranks instead, in one launch (``benchmarks.cpu``),
#: each with its own tiny ``--cpu`` defaults.
BENCHMARKS = {
    "rma_bandwidth": ([], ["--min", "1MiB", "--max", "64MiB", "--repeats", "5", "--backends", "triton"]),
    "ccl": ([], ["--min", "8KiB", "--max", "4MiB", "--repeats", "5"]),
    "fused": ([], ["--tokens", "2048", "--repeats", "3"]),
    "torch_collectives": ([], ["--max", "4MiB", "--repeats", "5"]),
    "hierarchical": ([], ["--sizes", "8KiB,512KiB,4MiB", "--repeats", "5"]),
    "compiled_tp": ([], ["--tokens", "2048", "--repeats", "3"]),
}


class UsageError(Exception):
    """A mistake on the command line or in its environment, reported as one line."""


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# -- iris info -----------------------------------------------------------------------------------------


def _gpu_links() -> list[str]:
    """``nvidia-smi topo -m``'s GPU rows (link type between every pair), when it is installed."""
    if shutil.which("nvidia-smi") is None:
        return ["(nvidia-smi not found: link types unknown)"]
    proc = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    lines = [line.replace("\x1b[4m", "").replace("\x1b[0m", "") for line in proc.stdout.splitlines()]
    return [line for line in lines if line.strip().startswith(("GPU", "\tGPU")) or line.startswith("\t")][:17]


#: The distributions of iris itself: the collective algorithms they declare are iris's built-in ones.
BUILT_IN_DISTRIBUTIONS = ("iris", "iris-triton", "iris-gluon")


def _algorithm_origin(entry) -> str:
    """Where a registered collective algorithm (a :class:`iris.registry.PluginEntry`) comes from:
    built in (a distribution of iris's), a plugin distribution, or an in-process ``register``
    call; several distributions claiming one name make it unusable, which ``iris info`` says."""
    if entry.conflicting_distributions:
        claimants = ", ".join([entry.describe(), *(f"distribution {d!r}" for d in entry.conflicting_distributions)])
        return f"claimed by {claimants}: unusable until all but one are uninstalled"
    if entry.distribution is None:
        return "registered in process"
    kind = "built-in" if entry.distribution in BUILT_IN_DISTRIBUTIONS else "plugin"
    return f"{kind}, {entry.distribution} {_version(entry.distribution)}"


def algorithm_lines() -> list[str]:
    """One line per collective of ``ctx.ccl``: its registered algorithms, grouped by where they
    come from (:func:`_algorithm_origin`), built-in ones first; "none" where there is none."""
    from iris.collectives import COLLECTIVES, algorithm_registry

    lines = []
    for collective in COLLECTIVES:
        entries = algorithm_registry(collective).entries
        by_origin: dict[str, list[str]] = {}
        for name in sorted(entries):
            by_origin.setdefault(_algorithm_origin(entries[name]), []).append(name)
        groups = sorted(by_origin.items(), key=lambda item: (not item[0].startswith("built-in"), item[0]))
        listed = "; ".join(f"{', '.join(names)} ({origin})" for origin, names in groups)
        lines.append(f"  {collective}: {listed or 'none'}")
    return lines


def info(args: argparse.Namespace) -> int:
    import torch

    import iris
    from iris.registry import heap_providers

    print(f"iris {iris.__version__}")
    print(f"torch {torch.__version__}, triton {_version('triton')}, numpy {_version('numpy')}, "
          f"python {sys.version.split()[0]}")
    print("backends:")
    for entry in importlib.metadata.entry_points(group="iris.backends"):
        dist = f"{entry.dist.name} {entry.dist.version}" if entry.dist else "unknown distribution"
        status = "available" if iris.is_backend_available(entry.name) else "not importable"
        print(f"  {entry.name:10s} {entry.value:32s} from {dist} ({status})")
    print(f"heap providers: {', '.join(heap_providers.names())}")
    print("collective algorithms (where each comes from):")
    for line in algorithm_lines():
        print(line)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print(f"devices: no GPU visible; CPU ranks ({os.cpu_count()} cores)")
        return 0
    print(f"devices: {gpus} GPU(s)")
    for i in range(gpus):
        props = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    print("peer access (row can access column):")
    print("        " + " ".join(f"cuda:{j}" for j in range(gpus)))
    for i in range(gpus):
        row = ["self  " if i == j else ("yes   " if torch.cuda.can_device_access_peer(i, j) else "no    ")
               for j in range(gpus)]
        print(f"  cuda:{i} " + " ".join(row))
    print("links (nvidia-smi topo -m):")
    for line in _gpu_links():
        print(f"  {line}")
    return 0


# -- iris demo -----------------------------------------------------------------------------------------


def demo(args: argparse.Namespace) -> int:
    from iris.tools.demo import main

    if args.nprocs is not None and args.nprocs < 1:
        raise UsageError(f"--nprocs must be at least 1, got {args.nprocs}")
    return main(args.nprocs, args.trace)


# -- iris bench ----------------------------------------------------------------------------------------


def _benchmarks_root() -> Path:
    """The source checkout whose ``benchmarks`` package ``iris bench`` runs: the current
    directory, else the one an editable install of iris points to."""
    for candidate in (Path.cwd(), Path(__file__).resolve().parent.parent):
        if (candidate / "benchmarks" / "common.py").is_file():
            return candidate
    raise UsageError("iris bench runs the benchmarks/ folder of an iris source checkout, which is not installed "
                     "with the package: run it from the root of a clone of the iris repository (or install iris "
                     "from one: pip install -e '.[bench]')")


def bench(args: argparse.Namespace) -> int:
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise UsageError(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    if not args.cpu:
        import torch

        if torch.cuda.device_count() < 2:
            raise UsageError(f"the benchmarks measure 2 GPUs against each other; {torch.cuda.device_count()} "
                             "visible (--cpu runs them on CPU ranks: a check of the benchmarks, not of speed)")
    root = _benchmarks_root()
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("iris bench draws its plots with matplotlib, which is not installed: "
                         "pip install 'iris[bench]'")
    out = Path(args.out).resolve() if args.out else root / "benchmarks" / "runs"
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        return _bench_cpu(names, root, out)
    from tqdm import tqdm

    summary = []
    for name in tqdm(names, desc="iris bench", unit="benchmark"):
        full, quick = BENCHMARKS[name]
        command = [sys.executable, "-m", f"benchmarks.{name}", *(quick if args.quick else full), "--out", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        tqdm.write(proc.stdout.rstrip())
        if proc.returncode:
            tqdm.write(proc.stderr[-3000:])
        summary.append((name, proc.returncode == 0, seconds))
    print(f"\n{'benchmark':16s} {'result':8s} {'seconds':>8s}   (JSON and PNG in {out})")
    for name, ok, seconds in summary:
        print(f"{name:16s} {'ok' if ok else 'FAILED':8s} {seconds:8.1f}")
    return 0 if all(ok for _, ok, _ in summary) else 1


def _bench_cpu(names: list[str], root: Path, out: Path) -> int:
    """``iris bench --cpu``: the benchmarks ``names`` on 2 CPU ranks started once for all of them
    (``benchmarks.cpu``), their output as it comes; 0 when every benchmark's check passed."""
    command = [sys.executable, "-m", "benchmarks.cpu", "--only", ",".join(names), "--out", str(out)]
    start = time.perf_counter()
    code = subprocess.run(command, cwd=root, check=False).returncode
    print(f"iris bench --cpu: {'ok' if code == 0 else 'FAILED'} in {time.perf_counter() - start:.1f} s "
          f"(JSON and PNG in {out})")
    return code


# -- iris run ------------------------------------------------------------------------------------------


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command of a multi-machine run: this machine's ranks meet the other machines'
    at the rendezvous ``--rdzv-endpoint``."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nnodes}",
            f"--nproc-per-node={args.nprocs}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
            args.script, *args.script_args]


def _first_failure(procs: list[subprocess.Popen]) -> int | None:
    """Wait until every rank exited with status 0 (None) or one did not (its rank)."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            return failed[0] if failed else None
        time.sleep(0.1)


def run_local(command: list[str], nprocs: int, device: str) -> int:
    """Run ``command`` as ``nprocs`` ranks of one machine, torchrun's way (the ranks join as
    clients a store this process hosts), but listening on 127.0.0.1 only. Each rank dies with
    this process; when one fails, the others are stopped and its exit status is returned."""
    from iris.tools.spawn import (
        describe_exit,
        die_with_parent,
        end_processes,
        loopback_store,
        rank_environment,
    )

    def start_ranks(port: int) -> list[subprocess.Popen]:
        env = dict(os.environ, **rank_environment(nprocs, device, port))
        return [subprocess.Popen(command, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                                 # Safe here: no other thread runs yet (the store starts after the ranks).
                                 preexec_fn=functools.partial(die_with_parent, os.getpid()))  # noqa: PLW1509
                for rank in range(nprocs)]

    with loopback_store(start_ranks) as procs:
        by_pid = {proc.pid: proc for proc in procs}
        try:
            failed = _first_failure(procs)
        finally:
            end_processes(list(by_pid), lambda pid: by_pid[pid].poll() is None)
    if failed is None:
        return 0
    code = procs[failed].returncode
    print(f"iris: rank {failed} of {nprocs} {describe_exit(code)}; the other ranks were stopped", file=sys.stderr)
    return code if code > 0 else 128 - code


def run(args: argparse.Namespace) -> int:
    import torch

    if not Path(args.script).is_file():
        raise UsageError(f"no such script: {args.script}")
    if args.nprocs < 1:
        raise UsageError(f"-n must be at least 1, got {args.nprocs}")
    if args.nnodes != 1 and args.rdzv_endpoint is None:
        raise UsageError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, where the machines meet")
    cpu = args.cpu or torch.cuda.device_count() == 0
    if args.rdzv_endpoint is None:
        return run_local([sys.executable, args.script, *args.script_args], args.nprocs, "cpu" if cpu else "cuda")
    env = dict(os.environ)
    if cpu:
        # What the backend's CPU ranks need before it is imported (Triton's: its interpreter).
        from iris.tools.spawn import backend_environment

        env.update(backend_environment("cpu"), IRIS_DEVICE="cpu")
    return subprocess.run(torchrun_command(args), check=False, env=env).returncode


# -- iris tune -----------------------------------------------------------------------------------------


def _listed(value: str | None) -> list[str] | None:
    return None if value is None else [item.strip() for item in value.split(",") if item.strip()]


def tune(args: argparse.Namespace) -> int:
    import torch

    import iris
    from iris.config import parse_size
    from iris.tuning import TUNABLE, parse_dtype, tune_on_rank

    gpus = torch.cuda.device_count()
    device = args.device or ("cuda" if gpus else "cpu")
    if device == "cuda" and gpus == 0:
        raise UsageError("--device cuda: no GPU is visible; tune CPU ranks with --device cpu")
    nprocs = args.nprocs if args.nprocs is not None else (gpus if device == "cuda" else 2)
    if nprocs < 1:
        raise UsageError(f"--nprocs must be at least 1, got {nprocs}")
    if device == "cuda" and nprocs > gpus:
        raise UsageError(f"--nprocs {nprocs} needs a GPU per rank; {gpus} visible")
    options = dict(device=device, nprocs=nprocs, collectives=_listed(args.collectives), dtypes=_listed(args.dtypes),
                   sizes=_listed(args.sizes), hidden=args.rmsnorm_hidden, repeats=args.repeats, tokens=None)
    unknown = sorted(set(options["collectives"] or ()) - set(TUNABLE))
    if unknown:
        raise UsageError(f"cannot tune {', '.join(unknown)}; tunable collectives: {', '.join(TUNABLE)}")
    try:
        for name in options["dtypes"] or ():
            parse_dtype(name)
        for size in options["sizes"] or ():
            parse_size(size)
        if args.rmsnorm_tokens is not None:
            options["tokens"] = [int(t) for t in _listed(args.rmsnorm_tokens)]
    except (TypeError, ValueError) as error:
        raise UsageError(f"{error} (--dtypes, --sizes or --rmsnorm-tokens)") from None
    if args.repeats is not None and args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    print(f"iris tune: {nprocs} {'GPU' if device == 'cuda' else 'CPU'} ranks", flush=True)
    print(iris.spawn(tune_on_rank, nprocs, options, device=device)[0])
    return 0


# -- entry point ---------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iris", description="iris: symmetric-heap multi-GPU programming from "
                                     "Triton and Gluon kernels, on NVIDIA GPUs and CPU ranks.")
    parser.add_argument("--version", action="version", version=f"iris {_version('iris')} (iris-triton "
                        f"{_version('iris-triton')}, iris-gluon {_version('iris-gluon')})")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    p = commands.add_parser("info", help="versions, backends, heap providers, collective algorithms, devices and links")
    p.set_defaults(handler=info)
    p = commands.add_parser("demo", help="spawn ranks and check remote stores and every collective against torch")
    p.add_argument("--nprocs", type=int, default=None, help="ranks (default: every GPU, else 2 CPU ranks)")
    p.add_argument("--trace", metavar="PATH", default=None,
                   help="trace every rank's kernels and calls into PATH, a Chrome trace that Perfetto opens")
    p.set_defaults(handler=demo)
    p = commands.add_parser("bench", help="run the benchmarks of a source checkout (2 GPUs, or CPU ranks with "
                                          "--cpu), write JSON and plots")
    p.add_argument("--quick", action="store_true", help="small sizes only: a short run")
    p.add_argument("--cpu", action="store_true",
                   help="run them on 2 CPU ranks (Triton's interpreter) instead, with tiny sizes, gloo for NCCL and "
                        "no GPU-only baselines: checks the benchmarks, their JSON and plots (CI, no GPU needed); "
                        "the times are not a measure of speed (--quick is implied)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--out", default=None,
                   help="directory for JSON and PNG files (default benchmarks/runs, which git ignores)")
    p.set_defaults(handler=bench)
    p = commands.add_parser(
        "run", help="run a script on N ranks (CPU ranks when no GPU is visible)",
        description="Run a script on N ranks with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). "
                    "By default the run is on this machine only and listens on the loopback interface only: the "
                    "ranks meet at a store this command hosts on 127.0.0.1, and gloo and NCCL keep their sockets "
                    "on 'lo'. --rdzv-endpoint makes it a multi-machine run through torchrun instead.")
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks (on each machine)")
    p.add_argument("--cpu", action="store_true", help="CPU ranks even when GPUs are visible")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default=None,
                   help="run across machines with torchrun: every machine runs this command with the same HOST:PORT, "
                        "and the machine HOST names hosts the rendezvous. This listens on the network: torchrun's "
                        "TCP store (no authentication: whoever reaches it can join or disturb the run) on PORT and "
                        "on a second, free port of that machine, on every interface; and every rank's gloo and "
                        "NCCL sockets on the interface GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name (else the one "
                        "the host name resolves to). Use it on a trusted network only")
    p.add_argument("--nnodes", type=int, default=1, help="machines of a --rdzv-endpoint run (default 1)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(handler=run)
    p = commands.add_parser(
        "tune", help="time the collectives' algorithms on N local ranks and save the fastest in the tuning cache",
        description="Time every applying algorithm of the collectives (and, with --rmsnorm-hidden, the methods of "
                    "all_reduce_rmsnorm) on N ranks of this machine, choose for each dtype and size bucket the "
                    "fastest on the slowest rank, save the choices in the tuning cache ($IRIS_TUNING_CACHE, else "
                    "~/.cache/iris/tuning), which iris.create() then uses, and print them (docs/tuning.md).")
    p.add_argument("--nprocs", type=int, default=None, help="ranks (default: every GPU, else 2 CPU ranks)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="the ranks' device (default: cuda when a GPU is visible)")
    p.add_argument("--collectives", default=None,
                   help="comma-separated collectives (default: those with more than one candidate: algorithms, "
                        "launch shapes)")
    p.add_argument("--dtypes", default=None, help="comma-separated dtypes (default: bfloat16,float32 on GPUs)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated bytes per rank, e.g. 4KiB,1MiB, each rounded up to its power of two "
                        "(default: every power of two from 1 KiB to 64 MiB on GPUs)")
    p.add_argument("--rmsnorm-hidden", type=int, default=None,
                   help="also tune all_reduce_rmsnorm's method for rows of this many elements")
    p.add_argument("--rmsnorm-tokens", default=None,
                   help="comma-separated token counts for --rmsnorm-hidden (default: powers of two to 16384 on GPUs)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per candidate (default 25 on GPUs)")
    p.set_defaults(handler=tune)
    p = commands.add_parser(
        "compile-check", add_help=False,
        help="compile every kernel the installed backends launch, at every world size, for a GPU (none needed)")
    p.add_argument("options", nargs=argparse.REMAINDER, help="see iris compile-check --help")
    return parser


def compile_check(options: list[str]) -> int:
    """``iris compile-check OPTIONS``: the check (:mod:`iris.tools.compile_check`), in a process with
    Triton's interpreter off (this one may have it on, and would compile nothing)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "iris.tools.compile_check", *options], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile-check"]:  # its own options, parsed by the check's process
        return compile_check(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except (UsageError, IrisError) as error:
        print(f"iris: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
