"""``iris compile-check``: it compiles what the host side launches, and it fails where the compiler does.

The check compiles kernels, so it runs in processes with Triton's interpreter off (conftest turns
it on for this process on CPU-only machines). The whole check at every default world size runs in
``scripts/test.sh``; here, one kernel family at a time.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import iris_triton
from iris.context.bootstrap import Communicator
from iris.testing import compiling_environment, run_without_interpreter
from iris.tools.compile_check import compile_check
from iris.tools.compile_check.cases import contexts_checked
from iris.tools.compile_check.ptx import ptx_violations
from iris.tools.compile_check.world import StandInCommunicator

#: What the compiler said of the fused kernel's loop before it was fixed.
REASSIGNED = "cannot be reassigned"


def _check(*options: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "iris.tools.cli", "compile-check", "--quiet", *options],
                          env=compiling_environment(pythonpath), capture_output=True, text=True, timeout=900)


def _script(source: str, tmp_path: Path) -> dict:
    """Run ``source`` (which prints one JSON line last) as a file (Triton reads kernels' source
    from it) with the interpreter off."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return run_without_interpreter(script, timeout=900)


def test_it_catches_the_fused_kernels_constexpr_reassigned_at_world_3(tmp_path):
    """The fused matmul_reduce_scatter kernel as it was (an annotated constexpr assigned in a
    static loop) compiles at world 2, where the loop runs once, and fails from world 3: the
    check exits 1 with the compiler's message for world 3 and nothing for world 2. The same
    check of the kernel as it is passes."""
    overlay = tmp_path / "iris_triton"
    shutil.copytree(Path(iris_triton.__file__).parent, overlay, ignore=shutil.ignore_patterns("__pycache__"))
    fused = overlay / "operations" / "fused.py"
    fixed = "owner = (RANK + step) % WORLD"
    source = fused.read_text()
    assert fixed in source, "the fused kernel's loop changed: update this test"
    fused.write_text(source.replace(fixed, "owner: tl.constexpr = (RANK + step) % WORLD", 1))

    options = ("--worlds", "2,3", "--backends", "triton", "--only", "matmul_reduce_scatter_kernel", "--focused")
    old = _check(*options, pythonpath=tmp_path)
    assert old.returncode == 1, old.stdout[-3000:] + old.stderr[-3000:]
    failures = [block for block in old.stdout.split("FAILED ")[1:] if block.startswith("matmul_reduce_scatter_kernel")]
    assert failures, old.stdout[-3000:]
    assert all(block.startswith("matmul_reduce_scatter_kernel: triton, world 3") for block in failures), failures[0]
    assert all(REASSIGNED in block for block in failures), failures[0]
    assert {f"world 3, rank {r}:" for r in range(3)} <= {block.split(", ", 1)[1].split(" ops.")[0]
                                                         for block in failures}, "every rank of world 3 fails"

    new = _check(*options)
    assert new.returncode == 0, new.stdout[-3000:]
    assert "0 failure(s)" in new.stdout and "FAILED" not in new.stdout


def test_registered_algorithms_are_compiled_at_every_rank(tmp_path):
    """A plugin's algorithm registered in process is compiled as iris's own are: at each rank of
    each world, and a kernel of it that does not compile is a failure naming it."""
    found = _script('''
        import json
        import triton, triton.language as tl
        from iris.collectives import Algorithm, register_algorithm
        from iris.tools.compile_check import compile_check

        @triton.jit
        def plugin_gather_kernel(inp, out, n, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            for q in tl.static_range(WORLD):
                tl.store(out + q * n + offs, tl.load(inp + offs, mask=offs < n), mask=offs < n)

        @triton.jit
        def plugin_broken_kernel(inp, out, n, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
            for q in tl.static_range(1, WORLD):
                peer: tl.constexpr = (RANK + q) % WORLD
                tl.store(out + peer, tl.load(inp))

        def launcher(kernel):
            def run(call):
                ctx = call.context
                kernel[(1,)](call.input, call.output, call.input.numel(), RANK=ctx.rank, WORLD=ctx.world_size,
                             BLOCK=1024)
            return run

        register_algorithm(Algorithm(name="plugin_gather", collective="all_gather", run=launcher(plugin_gather_kernel),
                                     languages={"triton"}))
        register_algorithm(Algorithm(name="plugin_broken", collective="all_gather",
                                     run=launcher(plugin_broken_kernel), languages={"triton"}))
        report = compile_check([3], backends=["triton"], only=["plugin_gather_kernel", "plugin_broken_kernel"],
                               jobs=2)
        print(json.dumps({"compiled": report.compiled,
                          "failed": sorted({(f.family, f.where.split(":")[0]) for f in report.failures})}))
    ''', tmp_path)
    assert found["compiled"]["plugin_gather_kernel"] >= 3, found  # each rank of world 3
    failed = {tuple(f) for f in found["failed"]}
    assert {("plugin_broken_kernel", f"triton, world 3, rank {r}") for r in range(3)} <= failed, found
    assert not any(family == "plugin_gather_kernel" for family, _ in failed), found


def test_a_kernel_whose_wgmma_ptxas_serializes_fails(tmp_path):
    """What ptxas reports is read for every kernel on tensor cores (``tests/test_ptxas.py`` shows
    it finds a real serialization): here a stand-in reports one for every kernel with wgmma, and
    each fused product's kernel fails with it while the device barrier's, which has none, passes."""
    found = _script('''
        import json
        import iris.tools.compile_check as check

        def serialized(ptx, target, options, report=""):
            return [f"(C7515) stand-in, sm_{target.arch}, {options['num_warps']} warps"] \
                if "wgmma.mma_async" in ptx else []

        check.serialized_tensor_cores = serialized
        report = check.compile_check([2], backends=["triton"], ranks=[0], focused=True, jobs=1,
                                     only=["all_gather_matmul_kernel", "device_barrier_kernel"])
        print(json.dumps({"compiled": report.compiled,
                          "failed": sorted({(f.family, f.message.split(": ")[-1]) for f in report.failures})}))
    ''', tmp_path)
    assert found["compiled"]["all_gather_matmul_kernel"] >= 2 and found["compiled"]["device_barrier_kernel"], found
    assert found["failed"] == [["all_gather_matmul_kernel", "(C7515) stand-in, sm_90, 8 warps"]], found


def test_every_launch_site_is_found_and_an_unreached_one_fails(tmp_path):
    """The coverage check finds the launch sites of every kernel family in the backends'
    sources, by both launch forms, and reports a site whose kernel no call launched."""
    found = _script('''
        import json
        from iris.tools.compile_check.coverage import launch_sites, uncovered_launch_sites
        sites = list(launch_sites(["triton", "gluon"]))
        names = sorted({name for _, _, name in sites})
        missing = uncovered_launch_sites(["triton"], set(names) - {"collective_kernel"})
        print(json.dumps({"names": names, "missing": missing}))
    ''', tmp_path)
    assert {"collective_kernel", "device_barrier_kernel", "all_gather_matmul_kernel", "tile_collective",
            "push_kernel", "wait_for_peers_kernel"} <= set(found["names"]), found["names"]
    assert found["missing"] and all(site.endswith(" collective_kernel") for site in found["missing"]), found


def test_a_world_of_one_alone_needs_no_launch_of_the_kernels_that_announce_calls_to_peers():
    proc = _check("--worlds", "1", "--only", "announce_kernel")
    assert proc.returncode == 0 and "0 failure(s)" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_the_stand_in_communicator_overrides_every_exchange():
    """A compile-only context never reaches torch.distributed: each public method of the
    communicator is overridden by the stand-in (a new exchange must be added to it)."""
    public = {name for name in vars(Communicator) if not name.startswith("_") and callable(getattr(Communicator, name))}
    assert public, "no public methods found"
    assert public <= set(vars(StandInCommunicator)), public - set(vars(StandInCommunicator))


def _contexts(*args) -> set[tuple]:
    return {(c.backend, c.world_size, c.rank, c.full, c.tracing) for c in contexts_checked(*args)}


def test_the_contexts_checked_are_every_rank_up_to_4_and_the_ends_above_or_the_ranks_asked_for():
    by_default = _contexts(("triton", "gluon"), (1, 2, 3, 4, 5, 8))
    triton = {(w, r) for b, w, r, full, tracing in by_default if b == "triton" and not tracing}
    assert triton == {(1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2), (4, 0), (4, 1), (4, 2), (4, 3), (5, 0), (5, 4),
                      (8, 0), (8, 7)}
    # The full calls where a world of 3 or more compiles fastest, tracing in the largest.
    assert {c for c in by_default if c[3] or c[4]} == {("triton", 3, 0, True, False), ("triton", 8, 0, False, True)}
    assert {c[1:4] for c in _contexts(("triton",), (1, 2)) if c[3]} == {(2, 0, True)}  # no world of 3 or more
    assert {c[1:3] for c in by_default if c[0] == "gluon"} == {(3, 0), (3, 2), (8, 0)}
    # One rank: where the world has it, the full calls and tracing on it in the largest world.
    assert _contexts(("triton", "gluon"), (1, 3), (1,)) == {
        ("triton", 3, 1, True, False), ("triton", 3, 1, False, True), ("gluon", 3, 1, False, False)}
    assert _contexts(("triton",), (3,), (1,), False) == {("triton", 3, 1, False, False), ("triton", 3, 1, False, True)}


def test_ranks_outside_every_world_are_refused():
    with pytest.raises(ValueError, match=r"ranks must be ranks \(0 and up\) of at least one of the worlds \(2, 3\), "
                                         r"got \(3,\)"):
        compile_check((2, 3), ranks=(3,))


class _Launch:
    """What :func:`ptx_violations` reads of a launch."""

    def __init__(self, name: str, aligned: bool, world: int = 2):
        segment = "H" if name in ("push_kernel", "return_kernel", "reduce_kernel") else "m"
        self.kernel = SimpleNamespace(fn=SimpleNamespace(__name__=name), arg_names=["x", segment, "WORLD"])
        self.attrs = {(1,): [["tt.divisibility", 16]] if aligned else []}
        self.constexprs = {(2,): world}


@pytest.mark.parametrize("line, scoped", [
    ("atom.global.sys.release.exch.b32 %r1, [%rd2], %r3;", True),
    ("ld.global.sys.acquire.b32 %r1, [%rd2];", True),
    ("atom.global.acq_rel.sys.cas.b32 %r1, [%rd2], %r3, %r4;", True),
    ("@%p1 atom.global.gpu.release.exch.b32 %r1, [%rd2], %r3;", False),
    ("st.global.gpu.release.b32 [%rd2], %r3;", False),
    ("ld.global.acquire.cta.b32 %r1, [%rd2];", False),
    ("atom.global.gpu.acq_rel.add.u32 %r1, [%rd2], %r3;", False),
    ("atom.global.gpu.relaxed.add.u64 %rd1, [%rd2], 1;", True),  # orders nothing: a local counter
])
def test_flags_must_be_released_and_acquired_at_system_scope(line, scoped):
    problems = ptx_violations(_Launch("any_kernel", False), f"\t{line}\n")
    assert (problems == []) == scoped, problems


def test_the_collectives_copy_loops_must_move_16_byte_vectors():
    vector = "\tld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\n"
    scalar = "\tld.global.b16 %rs1, [%rd1];\n\tst.global.b16 [%rd2], %rs1;\n"
    assert ptx_violations(_Launch("collective_kernel", True), vector) == []
    assert "16-byte" in " ".join(ptx_violations(_Launch("collective_kernel", True), scalar))
    assert ptx_violations(_Launch("collective_kernel", False), scalar) == []  # unaligned segments: no rule
    assert ptx_violations(_Launch("low_latency_kernel", True), scalar) == []  # not a copy loop
    for moe in ("push_kernel", "return_kernel", "reduce_kernel"):  # the MoE kernels' row copies
        assert "16-byte" in " ".join(ptx_violations(_Launch(moe, True), scalar)), moe
    assert ptx_violations(_Launch("return_kernel", True, world=1), scalar) == []  # a rank's own rows stay
