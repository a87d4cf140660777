"""Run upstream iris's own examples against this iris, unchanged but for launch glue.

Upstream's ``examples/`` (from a checkout of upstream iris, ``--upstream``) are copied to a scratch
folder and each example is run as upstream runs it (its own ``torch.multiprocessing.spawn``, or
``torchrun`` for the examples written for it), one at a time (several use fixed ports), with small
sizes: at world 1 on one GPU, on ``--ranks`` processes sharing the machine's GPUs where there are
more ranks than GPUs, or on ``--ranks`` CPU ranks under Triton's interpreter. Its outcome
is read from its own validation output, a whole line at a time (``"Validation successful."`` must
not match inside ``"Validation not successful."``), and its exit code.

The glue, applied to the scratch copy only:

- everywhere: Gluon blocks laid out over AMD's 64-lane wavefronts get NVIDIA's 32 lanes;
- on CPU ranks: ``cuda`` devices become the CPU (tensors, ``device_id=`` of the process group, the
  hard-coded ``nccl`` backends become ``gloo``), a ``sitecustomize`` module stubs the ``torch.cuda``
  calls a CPU build refuses (synchronize, streams, events, NVTX, the device's properties: 4
  multiprocessors), makes ``libdevice.fast_expf`` the interpreter's ``tl.exp`` and gives
  interpreted launches the register counts the examples print; and ``tl.assume(pid_m > 0)``, false
  for the first tile (the interpreter checks it), becomes ``>= 0``;
- on ranks sharing GPUs: every ``nccl`` process group becomes ``gloo`` (NCCL refuses two ranks on
  one GPU), with no ``device_id``; ``cuda:{r}`` devices and a ``sitecustomize`` module's
  ``torch.cuda.set_device(r)`` and ``get_device_properties(r)`` take GPU ``r`` modulo the GPUs
  there are (the ranks' kernels then time-slice a GPU: slow, never timed, but every memory access
  and wait is the hardware's).

Each example's outcome is one of: ``validated`` (its success line, no failure line, exit code 0),
``failed``, ``ran`` (no check of its own: exit code 0), ``upstream check`` (exit code 0, and the
check fails by upstream's own design, :data:`EXAMPLES` says why), or ``not run`` (with why). ::

    python scripts/upstream_examples.py --upstream ~/src/iris [--ranks 2] [--out DIR] [names ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from upstream_tests import CPU_TENSORS, LANES, SHARED_DEVICES  # noqa: E402 - the glue both runners apply, beside this script

HEAP = {"gpu": 1 << 30, "cpu": 1 << 26}
#: Lines of a failed example's output printed with its outcome.
FAILED_TAIL = 12
#: GEMM examples' small problem on CPU ranks.
_SMALL_GEMM = "-m 256 -n 128 -k 128 --BLK_M 64 --BLK_N 32 --BLK_K 32 --heap_size {heap} -v --datatype fp32"
_GPU_GEMM = "-m 1024 -n 1024 -k 1024 --heap_size {heap} -v"
_IRIS = r"(\[Iris\] \[\d+/\d+\] )?"


@dataclass(frozen=True)
class Example:
    """One upstream example: its script under ``examples/``, how it is launched (``spawn``: it
    starts its own ranks from ``{ranks}``; ``torchrun``), its arguments on one GPU and on CPU ranks
    (``{ranks}``, ``{heap}`` filled in), the whole line it prints when its check passes and one
    it prints when it fails (regular expressions; None: it has no check of its own), and what
    keeps it from meaning anything at some world sizes."""

    script: str
    launch: str
    gpu_args: str
    cpu_args: str
    success: str | None
    failure: str
    ranks: tuple[int, ...] = ()
    """The world sizes it takes; empty: any."""
    upstream_check: str = ""
    """Why its own check cannot pass (at world sizes ``broken_at``; empty: every size)."""
    broken_at: tuple[int, ...] = ()
    gpu_only: bool = False
    """Whether its kernels have no CPU form (Gluon has no interpreter)."""


def _line(text: str) -> str:
    return rf"^{_IRIS}{text}$"


_SUCCESSFUL, _FAILED = _line(r"Validation successful\."), _line(r"(Validation failed\.|Mismatch at index.*)")
_GEMM_PASSED, _GEMM_FAILED = _line(r"Final C validation passed\."), _line(r"Final C validation failed\.")
_SIZE = "-z 1048576 -p {heap} -n 2 -w 1 -d -v"
_SWEEP = "-m 1048576 -M 2097152 -p {heap} -x 2 -w 1 -d -v"
_CPU_SIZE, _CPU_SWEEP = "-z 4096 -p {heap} -n 2 -w 1 -d -v", "-m 4096 -M 8192 -p {heap} -x 2 -w 1 -d -v"
_CCL = "-v -m 64 -n 32 --heap_size {heap}"
_PASSED_AT = _line(r"Validation passed: output\[0,0\] = .*")

#: Every upstream example (upstream iris's main branch, March 2026), by name.
EXAMPLES: dict[str, Example] = {
    "00_load": Example("00_load/load_bench.py", "spawn", f"-r {{ranks}} {_SIZE}", f"-r {{ranks}} {_CPU_SIZE}",
                       _SUCCESSFUL, _FAILED, upstream_check="it loads ones and expects 0, 1, 2, ... (an arange "
                       "it never writes): only the first elements can match"),
    "01_store": Example("01_store/store_bench.py", "spawn", f"-r {{ranks}} -t fp32 {_SIZE}",
                        f"-r {{ranks}} {_CPU_SIZE}", _SUCCESSFUL, _FAILED),
    "02_all_load": Example("02_all_load/all_load_bench.py", "spawn", f"-r {{ranks}} {_SWEEP}",
                           f"-r {{ranks}} {_CPU_SWEEP}", _SUCCESSFUL, _FAILED, upstream_check="it sums buffers "
                           "of zeros and expects an arange it never writes"),
    "03_all_store": Example("03_all_store/all_store_bench.py", "spawn", f"-r {{ranks}} {_SWEEP}",
                            f"-r {{ranks}} {_CPU_SWEEP}", _SUCCESSFUL, _FAILED, broken_at=(1,),
                            upstream_check="it stores only to the other ranks, so one rank checks unwritten memory"),
    "04_atomic_add": Example("04_atomic_add/atomic_add_bench.py", "spawn", "-r {ranks} -z 1048576 -p {heap} -x 2 "
                             "-w 1 -d -v", "-r {ranks} -z 4096 -p {heap} -x 2 -w 1 -d -v", _SUCCESSFUL,
                             _line(r"First mismatch at index.*")),
    "05_atomic_xchg": Example("05_atomic_xchg/atomic_xchg_bench.py", "spawn", "-r {ranks} -z 4096 -p {heap} -x 2 "
                              "-w 1 -d -v", "-r {ranks} -z 4096 -p {heap} -x 2 -w 1 -d -v", _SUCCESSFUL, _FAILED,
                              upstream_check="it expects an arange where the exchange leaves the old values"),
    "06_load_store": Example("06_message_passing/message_passing_load_store.py", "spawn", "-r {ranks} -p {heap}",
                             "-r {ranks} -p {heap}", _SUCCESSFUL, _line(r"Validation failed\."), ranks=(2,)),
    "06_put": Example("06_message_passing/message_passing_put.py", "spawn", "-r {ranks} -p {heap}",
                      "-r {ranks} -p {heap}", _SUCCESSFUL, _line(r"Validation failed\."), ranks=(2,)),
    "06_device_context": Example("06_message_passing/message_passing_device_context.py", "spawn",
                                 "--num_ranks {ranks} --heap_size {heap}", "--num_ranks {ranks} --heap_size {heap}",
                                 _line(r"Consumer: Data received and verified successfully using DeviceContext API!"),
                                 _line(r"Consumer: Data verification failed!")),
    "06_gluon": Example("06_message_passing/message_passing_gluon.py", "spawn", "-r {ranks} -p {heap}",
                        "-r {ranks} -p {heap}", _SUCCESSFUL, _line(r"Validation failed\."), ranks=(2,), gpu_only=True),
    "07_gemm_all_scatter": Example("07_gemm_all_scatter/benchmark.py", "spawn", f"-r {{ranks}} {_GPU_GEMM}",
                                   f"-r {{ranks}} {_SMALL_GEMM} --gemm_sms 4", _GEMM_PASSED, _GEMM_FAILED),
    "08_gemm_all_reduce_atomics": Example("08_gemm_all_reduce_atomics/benchmark.py", "spawn",
                                          f"-r {{ranks}} {_GPU_GEMM}",
                                          f"-r {{ranks}} {_SMALL_GEMM} --gemm_sms 4 --total_sms 8", _GEMM_PASSED,
                                          _GEMM_FAILED),
    "09_gemm_one_shot_all_reduce": Example("09_gemm_one_shot_all_reduce/benchmark.py", "spawn",
                                           f"-r {{ranks}} {_GPU_GEMM}",
                                           f"-r {{ranks}} {_SMALL_GEMM} --gemm_sms 4 --total_sms 8", _GEMM_PASSED,
                                           _GEMM_FAILED),
    "10_gemm_all_scatter_wg_specialization": Example("10_gemm_all_scatter_wg_specialization/benchmark.py", "spawn",
                                                     f"-r {{ranks}} {_GPU_GEMM}",
                                                     f"-r {{ranks}} {_SMALL_GEMM} --gemm_sms 4 --num_sms 6",
                                                     _GEMM_PASSED, _GEMM_FAILED),
    "11_gemm_all_scatter_producer_consumer": Example("11_gemm_all_scatter_producer_consumer/benchmark.py", "spawn",
                                                     f"-r {{ranks}} {_GPU_GEMM}",
                                                     f"-r {{ranks}} {_SMALL_GEMM} --gemm_sms 4 --comm_sms 2",
                                                     _GEMM_PASSED, _GEMM_FAILED),
    "12_gemm_all_scatter_bulk_synchronous": Example("12_gemm_all_scatter_bulk_synchronous/benchmark.py", "spawn",
                                                    f"-r {{ranks}} {_GPU_GEMM}",
                                                    f"-r {{ranks}} {_SMALL_GEMM} --gemm_sms 4 --comm_sms 4",
                                                    _GEMM_PASSED, _GEMM_FAILED),
    "13_flash_decode": Example("13_flash_decode/example_run.py", "spawn",
                               "--num_ranks {ranks} --kv_len_per_rank 1024 --num_heads 16 --num_seqs 1",
                               "--num_ranks {ranks} --kv_len_per_rank 64 --num_heads 8 --head_dim 64 --num_seqs 1",
                               None, r"^Traceback"),
    "14_all_gather_gemm_pull": Example("14_all_gather_gemm/example_run_pull.py", "spawn", "--num_ranks {ranks}",
                                       "--num_ranks {ranks} --M 64 --N 64 --K 256 --BLOCK_SIZE_M 64 --BLOCK_SIZE_N 32 "
                                       "--BLOCK_SIZE_K 32 --GROUP_SIZE_M 1", r"^✅ Validation PASSED$",
                                       r"^❌ Validation FAILED"),
    "14_all_gather_gemm_push": Example("14_all_gather_gemm/example_run_push.py", "spawn", "--num_ranks {ranks}",
                                       "--num_ranks {ranks} --M 64 --N 64 --K 256 --BLOCK_SIZE_M 64 --BLOCK_SIZE_N 32 "
                                       "--BLOCK_SIZE_K 32 --GROUP_SIZE_M 1", r"^✅ Validation PASSED$",
                                       r"^❌ Validation FAILED"),
    "15_gemm_all_reduce_ring_based": Example("15_gemm_all_reduce_ring_based/benchmark.py", "spawn",
                                             f"-r {{ranks}} {_GPU_GEMM}",
                                             "-r {ranks} -m 256 -n 128 -k 128 --BLK_M 64 --BLK_N 64 --BLK_K 32 "
                                             "--heap_size {heap} -v --datatype fp32 --gemm_sms 4 --comm_sms 2",
                                             _GEMM_PASSED, _GEMM_FAILED, broken_at=(1,),
                                             upstream_check="with one rank its ring never stores C"),
    "16_all_reduce_ring_based": Example("16_all_reduce_ring_based/benchmark.py", "spawn",
                                        "-r {ranks} -m 1024 -n 1024 --heap_size {heap} -v",
                                        "-r {ranks} -m 256 -n 128 --BLK_M 64 --BLK_N 64 --heap_size {heap} -v "
                                        "--datatype fp32 --num_sms 2", _line(r"Final validation passed\. .*"),
                                        _line(r"Final validation failed\. .*")),
    "20_gemm_all_scatter_independent": Example("20_gemm_all_scatter_independent/benchmark.py", "spawn",
                                               f"-r {{ranks}} {_GPU_GEMM}",
                                               f"-r {{ranks}} {_SMALL_GEMM} --gemm_sms 4 --comm_sms 2",
                                               _line(r"Overall validation passed\."),
                                               _line(r"Overall validation failed\.")),
    "21_gemm_one_shot_all_reduce_independent": Example("21_gemm_one_shot_all_reduce_independent/benchmark.py",
                                                       "spawn", f"-r {{ranks}} {_GPU_GEMM}",
                                                       f"-r {{ranks}} {_SMALL_GEMM} --gemm_sms 4 --comm_sms 2",
                                                       _line(r"Overall validation passed\."),
                                                       _line(r"Overall validation failed\.")),
    "22_gemm_one_shot_reduce_scatter_wg_specialization": Example(
        "22_gemm_one_shot_reduce_scatter_wg_specialization/benchmark.py", "spawn", f"-r {{ranks}} {_GPU_GEMM}",
        "-r {ranks} -m 256 -n 128 -k 128 --BLK_M 64 --BLK_N 64 --BLK_K 32 --gsize_m 1 --heap_size {heap} -v "
        "--datatype fp32 --gemm_sms 4 --num_sms 6", _line("✅ Triton and Torch match"),
        _line("❌ Triton and Torch differ")),
    "23_gemm_all_scatter_tracing": Example("23_gemm_all_scatter_tracing/benchmark.py", "spawn",
                                           f"-r {{ranks}} {_GPU_GEMM} --trace",
                                           f"-r {{ranks}} {_SMALL_GEMM} --gemm_sms 4 --trace", _GEMM_PASSED,
                                           _GEMM_FAILED),
    "24_ccl_all_reduce": Example("24_ccl_all_reduce/example.py", "torchrun", "-v", _CCL, _PASSED_AT, r"^Traceback"),
    "25_ccl_all_gather": Example("25_ccl_all_gather/example.py", "torchrun", "-v", _CCL, _PASSED_AT, r"^Traceback"),
    "26_ccl_all_to_all": Example("26_ccl_all_to_all/example.py", "torchrun", "-v", _CCL, _PASSED_AT, r"^Traceback"),
    "28_ops_matmul_all_reduce": Example("28_ops_matmul_all_reduce/example.py", "torchrun", "-v",
                                        "-v -m 64 -n 32 -k 64 --heap_size {heap}", _PASSED_AT, r"^Traceback"),
    "29_ops_all_gather_matmul": Example("29_ops_all_gather_matmul/example.py", "torchrun", "-v",
                                        "-v -m 64 -n 32 --k_local 32 --heap_size {heap}", _PASSED_AT, r"^Traceback"),
    "30_ops_matmul_all_gather": Example("30_ops_matmul_all_gather/example.py", "torchrun", "-v",
                                        "-v -m 64 -n 32 -k 64 --heap_size {heap}", _PASSED_AT, r"^Traceback"),
    "31_expert_sharded_moe": Example("31_expert_sharded_moe/example_run.py", "spawn", "--num_ranks {ranks}",
                                     "--num_ranks {ranks}", r"^PASSED: sharded MoE matches reference$",
                                     r"^FAILED: .*"),
    "31_message_passing": Example("31_message_passing/example.py", "torchrun", "-v", "-v", _SUCCESSFUL,
                                  _line(r"Validation failed\..*"), ranks=(2,)),
}

#: A process group bound to no GPU (gloo's): (pattern, replacement).
_NO_DEVICE_ID = (r"""device_id=torch\.device\(f?["']cuda:\{\w+\}["']\)""", "device_id=None")
#: The CPU glue (see the module's docstring): (pattern, replacement).
_CPU_GLUE = (
    CPU_TENSORS,
    _NO_DEVICE_ID,
    (r"""torch\.device\(f?["']cuda(:\{?\w*\}?)?["']\)""", 'torch.device("cpu")'),
    (r"""backend=["']nccl["']""", 'backend="gloo"'),
    (r"""set_default_device\(["']cuda["']\)""", 'set_default_device("cpu")'),
    (r"\.cuda\(\)", ".cpu()"),
    (r"tl\.assume\((pid_[mn]) > 0\)", r"tl.assume(\1 >= 0)"),
)
#: The glue for ranks that share GPUs (see the module's docstring).
_SHARED_GPU_GLUE = (_NO_DEVICE_ID, (r"""["']nccl["']""", '"gloo"'), SHARED_DEVICES)
_SHARED_GPU_SITECUSTOMIZE = '''"""Launch glue for upstream's examples on ranks sharing GPUs
(scripts/upstream_examples.py)."""
import torch

_set_device, _properties = torch.cuda.set_device, torch.cuda.get_device_properties


def _shared_index(device):
    index = torch.device(device).index if isinstance(device, (str, torch.device)) else device
    return index if index is None or index < 0 else index % torch.cuda.device_count()  # None, -1: the current GPU


torch.cuda.set_device = lambda device: _set_device(_shared_index(device))
torch.cuda.get_device_properties = lambda device=None: _properties(_shared_index(device))
'''

_CPU_SITECUSTOMIZE = '''"""Launch glue for upstream's examples on CPU ranks (scripts/upstream_examples.py)."""
import os
import types

import torch

if not torch.cuda.is_available():
    class _Event:
        def __init__(self, *args, **kwargs): pass
        def record(self, *args, **kwargs): pass
        def synchronize(self): pass
        def elapsed_time(self, other): return 0.0

    class _Stream:
        def __init__(self, *args, **kwargs): pass
        def synchronize(self): pass
        def wait_stream(self, *args): pass

    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.nvtx.range_push = torch.cuda.nvtx.range_pop = lambda *args, **kwargs: None
    torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(multi_processor_count=4,
                                                                                      name="cpu")
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.interpreter import InterpretedFunction

    libdevice.fast_expf = lambda x, *args, **kwargs: tl.exp(x)
    _run = InterpretedFunction.run

    def _run_with_counts(self, *args, **kwargs):
        launched = _run(self, *args, **kwargs)
        return types.SimpleNamespace(n_regs=0, n_spills=0, asm={}) if launched is None else launched

    InterpretedFunction.run = _run_with_counts
'''


def glued_copy(upstream: Path, scratch: Path, on_cpu: bool, shared_gpus: bool = False) -> Path:
    """Upstream's ``examples/`` copied under ``scratch`` with the glue applied (``shared_gpus``:
    for more ranks than GPUs); returns the folder that holds ``examples/`` (the examples import
    ``examples.common`` from it)."""
    glue, site = (_CPU_GLUE, _CPU_SITECUSTOMIZE) if on_cpu else \
        (_SHARED_GPU_GLUE, _SHARED_GPU_SITECUSTOMIZE) if shared_gpus else ((), None)
    shutil.copytree(upstream / "examples", scratch / "examples")
    for path in (scratch / "examples").rglob("*.py"):
        text = re.sub(*LANES, path.read_text())
        for pattern, replacement in glue:
            text = re.sub(pattern, replacement, text)
        path.write_text(text)
    if site is not None:
        (scratch / "sitecustomize.py").write_text(site)
    return scratch


def outcome(example: Example, ranks: int, returncode: int, output: str) -> str:
    """What a run says: ``validated``, ``failed``, ``ran`` or ``upstream check`` (the module's
    docstring), from the example's whole lines and its exit code."""
    lines = [line.rstrip() for line in output.splitlines()]
    failed = any(re.match(example.failure, line) for line in lines)
    if example.success is None:
        return "ran" if returncode == 0 and not failed else "failed"
    if returncode == 0 and not failed and any(re.match(example.success, line) for line in lines):
        return "validated"
    if returncode == 0 and example.upstream_check and (not example.broken_at or ranks in example.broken_at):
        return "upstream check"
    return "failed"


def why_not(example: Example, ranks: int, on_cpu: bool) -> str | None:
    """Why ``example`` is not run at ``ranks`` here, or None."""
    if example.ranks and ranks not in example.ranks:
        return f"it takes {' or '.join(map(str, example.ranks))} ranks only"
    if example.gpu_only and on_cpu:
        return "its Gluon kernels need a GPU (Gluon has no interpreter)"
    return None


def command(example: Example, ranks: int, on_cpu: bool, root: Path) -> list[str]:
    args = (example.cpu_args if on_cpu else example.gpu_args).format(ranks=ranks, heap=HEAP["cpu" if on_cpu else "gpu"])
    script = str(root / "examples" / example.script)
    if example.launch == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone", script,
                *args.split()]
    return [sys.executable, script, *args.split()]


def _run(argv: list[str], cwd: Path, env: dict, timeout: float) -> tuple[str, int]:
    """``(stdout and stderr, exit code)`` of ``argv``; past ``timeout`` seconds its whole process
    group (the ranks it spawned too, which hold fixed ports) is killed, and the code is -1."""
    process = subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        return process.communicate(timeout=timeout)[0], process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return f"{process.communicate()[0]}\ntimed out after {timeout:g} s", -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, type=Path, help="a checkout of upstream iris")
    parser.add_argument("--ranks", type=int, default=None, help="world size (default: 1 on a GPU, 2 on CPU ranks)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one example may take")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "iris-upstream-examples")
    parser.add_argument("names", nargs="*", help=f"examples to run (default: all): {', '.join(EXAMPLES)}")
    args = parser.parse_args()
    import torch

    unknown = sorted(set(args.names) - set(EXAMPLES))
    if unknown:
        parser.error(f"unknown examples {unknown}; the examples are {sorted(EXAMPLES)}")
    on_cpu = not torch.cuda.is_available()
    gpus = 0 if on_cpu else torch.cuda.device_count()
    ranks = args.ranks or (2 if on_cpu else 1)
    shared_gpus = not on_cpu and ranks > gpus
    root = glued_copy(args.upstream, Path(tempfile.mkdtemp(prefix="iris-upstream-examples-")), on_cpu, shared_gpus)
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    if on_cpu:
        env["TRITON_INTERPRET"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.names or EXAMPLES:
        example = EXAMPLES[name]
        reason = why_not(example, ranks, on_cpu)
        if reason is not None:
            results[name] = {"outcome": "not run", "why": reason}
        else:
            started = time.monotonic()
            output, code = _run(command(example, ranks, on_cpu, root), args.out, env, args.timeout)
            (args.out / f"{name}.log").write_text(output)
            results[name] = {"outcome": outcome(example, ranks, code, output), "exit_code": code,
                             "seconds": round(time.monotonic() - started, 1)}
            if results[name]["outcome"] == "upstream check":
                results[name]["why"] = example.upstream_check
        print(f"{name:52s} {results[name]['outcome']:15s} {results[name].get('why', '')}", flush=True)
        if results[name]["outcome"] == "failed":  # what it said last, where the logs do not come back
            print("".join(f"    {line}\n" for line in output.splitlines()[-FAILED_TAIL:]), end="", flush=True)
        (args.out / "examples.json").write_text(json.dumps({"ranks": ranks, "device": "cpu" if on_cpu else "cuda",
                                                           "gpus": gpus, "results": results}, indent=1))  # so far
    return 0 if all(r["outcome"] != "failed" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
