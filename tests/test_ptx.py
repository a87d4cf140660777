"""What the Triton device API compiles to on sm_90, checked in the PTX (no GPU needed).

The kernels live in ``tests/ptx_kernels.py``. One subprocess compiles all of them, without
``TRITON_INTERPRET`` (conftest sets it on CPU-only machines, and ``triton.jit`` returns interpreted
functions when it is set), and reports each kernel's memory instructions as JSON. The instruction
spellings below are Triton 3.6's, read off its output: e.g. ``atom.global.sys.acq_rel.add.f32``,
but ``atom.global.acq_rel.sys.cas.b32`` (cas prints the ordering before the scope), and a wait's
flag read ``ld.global.sys.acquire.b32`` (Triton turns an atomic add of 0 into an acquire load).
So scopes and orderings are compared as dot-separated components, not positions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tile_kernels import COLLECTIVES as TILE_COLLECTIVES

from iris.testing import run_without_interpreter

KERNELS = Path(__file__).with_name("ptx_kernels.py")
SEMS = ("relaxed", "acquire", "release", "acq_rel")
SCOPES = ("cta", "gpu", "sys")
#: Every atomic kernel in ptx_kernels.py uses all of these PTX operations (sub is an add of the
#: negated value; float min/max become signed max / unsigned min on the bits).
ATOMIC_OPS = {"add", "exch", "and", "or", "xor", "min", "max", "cas"}
#: The 16-byte vector access a contiguous block of each element type should compile to.
VECTOR_LOAD = {"fp32": "ld.global.v4.b32", "fp16": "ld.global.v4.b32", "bf16": "ld.global.v4.b32",
               "i8": "ld.global.v4.b32", "fp8": "ld.global.v4.b32", "i64": "ld.global.v2.b64"}


#: Who calls the device API: Triton's free functions, Triton's DeviceContext, Gluon's IrisDeviceCtx
#: (the ``*_ctx`` kernels are one source compiled by both front ends; Gluon's keys are prefixed).
APIS = {"free": "{}", "ctx": "{}_ctx", "gluon-ctx": "gluon:{}_ctx"}


def kernel_name(api: str, base: str, suffix: str = "") -> str:
    return APIS[api].format(base) + suffix


@pytest.fixture(scope="session")
def ptx() -> dict:
    return run_without_interpreter(KERNELS, timeout=600, cwd=KERNELS.parent, whole_stdout=True)  # indented JSON


def ops_of(ptx: dict, name: str) -> list[str]:
    assert name not in ptx["errors"], f"{name} did not compile:\n{ptx['errors'][name][-3000:]}"
    return ptx["ops"][name]


def atomics_of(ops: list[str]) -> list[str]:
    return [op for op in ops if op.startswith(("atom.", "red."))]


def assert_atomics(ops: list[str], sem: str, scope: str, name: str) -> None:
    """Every atomic carries exactly ``sem`` and ``scope``, and every kind of atomic is there."""
    atomics = atomics_of(ops)
    assert len(atomics) >= len(ATOMIC_OPS), f"{name}: too few atomics: {atomics}"
    for op in atomics:
        parts = set(op.split("."))
        assert parts & set(SCOPES) == {scope}, f"{name}: {op} is not at scope {scope!r}"
        assert parts & set(SEMS) == {sem}, f"{name}: {op} is not {sem!r}"
    kinds = set().union(*(op.split(".") for op in atomics))
    assert ATOMIC_OPS <= kinds, f"{name}: missing atomics {ATOMIC_OPS - kinds}: {atomics}"


# -- loads and stores keep 16-byte vectors ----------------------------------------------------------------


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("dtype", list(VECTOR_LOAD))
def test_remote_load_store_keeps_vector_width(ptx, dtype, masked, api):
    # 1-byte types (i8, fp8) are where translate's alignment hint is easiest to lose: there the
    # distance is divided by an element size of 1, which Triton folds away together with the
    # ``tl.multiple_of`` placed on the quotient. test_local_i8_control_is_vectorized shows what
    # the same block compiles to without iris.
    name = kernel_name(api, "load_store", f"_{dtype}{'_masked' if masked else ''}")
    ops = ops_of(ptx, name)
    vector_load = VECTOR_LOAD[dtype]
    vector_store = vector_load.replace("ld.", "st.", 1)
    assert vector_load in ops and vector_store in ops, f"{name}: {ops}"
    # The data moves only in vectors: the one other global load is of the heap bases (8 bytes).
    assert {op for op in ops if op.startswith("st.global")} == {vector_store}, f"{name}: {ops}"
    assert {op for op in ops if op.startswith("ld.global")} <= {vector_load, "ld.global.b64"}, f"{name}: {ops}"


def test_local_i8_control_is_vectorized(ptx):
    # What an i8 block compiles to without iris: the expectation for test_remote_load_store above.
    ops = ops_of(ptx, "control_local_i8")
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops


@pytest.mark.parametrize("name", ["get_put_copy_fp32", "get_put_copy_ctx_fp32", "gluon:get_put_copy_ctx_fp32",
                                  "get_put_copy_bf16"])
def test_get_put_copy_keep_vector_width(ptx, name):
    ops = ops_of(ptx, name)
    assert {op for op in ops if op.startswith("st.global")} == {"st.global.v4.b32"}, ops
    assert {op for op in ops if op.startswith("ld.global")} == {"ld.global.v4.b32", "ld.global.b64"}, ops


def test_vector_checks_can_fail(ptx):
    # The same translation without the alignment hint: scalar accesses, which the checks above reject.
    ops = ops_of(ptx, "control_unhinted_translate")
    assert "ld.global.b32" in ops and "st.global.b32" in ops, ops
    assert not any(".v4." in op or ".v2." in op for op in ops), ops


# -- atomics ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", list(APIS))
def test_atomics_default_to_acq_rel_at_system_scope(ptx, api):
    name = kernel_name(api, "atomics", "_default")
    ops = ops_of(ptx, name)
    assert_atomics(ops, "acq_rel", "sys", name)
    assert "atom.global.sys.acq_rel.add.f32" in ops and "atom.global.acq_rel.sys.cas.b32" in ops, ops


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("sem", SEMS)
def test_atomics_carry_requested_sem_and_scope(ptx, sem, scope, api):
    name = kernel_name(api, "atomics", f"_{sem}_{scope}")
    ops = ops_of(ptx, name)
    assert_atomics(ops, sem, scope, name)
    assert f"atom.global.{scope}.{sem}.add.f32" in ops and f"atom.global.{sem}.{scope}.cas.b64" in ops, ops


def test_explicit_none_sem_and_scope_mean_the_defaults(ptx):
    # docs/device-api.md writes the atomics as ``..., sem=None, scope=None)``, and upstream iris kernels
    # forward their own ``sem``/``scope`` arguments, None included. None must not fall through to
    # Triton's own default scope, "gpu", which a peer GPU does not observe.
    ops = ops_of(ptx, "atomics_explicit_none")
    atomics = atomics_of(ops)
    assert len(atomics) == 3, atomics
    for op in atomics:
        parts = set(op.split("."))
        assert parts & set(SCOPES) == {"sys"} and parts & set(SEMS) == {"acq_rel"}, (
            f"{op}: sem=None/scope=None passed explicitly did not give the defaults (acq_rel, sys)")


# -- flags and the device barrier -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("signal_default", "atom.global.sys.release.exch.b32"),
        ("signal_acq_rel_gpu", "atom.global.gpu.acq_rel.exch.b32"),
        ("signal_relaxed_cta", "atom.global.cta.relaxed.exch.b32"),
    ],
)
def test_signal_is_an_exchange_with_the_requested_ordering(ptx, name, expected):
    assert atomics_of(ops_of(ptx, name)) == [expected]


def flag_reads(ops: list[str]) -> set[str]:
    """The 32-bit global reads of a flag (plain or ordered loads, and atomics)."""
    return {op for op in ops if op.startswith("ld.global") and op.endswith(".b32")} | set(atomics_of(ops))


@pytest.mark.parametrize(
    "name, expected",
    [
        ("wait_default", "ld.global.sys.acquire.b32"),
        *[(f"wait_cmp_{cmp}", "ld.global.sys.acquire.b32") for cmp in ("eq", "ne", "gt", "ge", "lt", "le")],
        ("wait_relaxed_gpu", "ld.global.gpu.relaxed.b32"),
        ("wait_acquire_cta", "ld.global.cta.acquire.b32"),
    ],
)
def test_wait_until_reads_the_flag_with_the_requested_ordering(ptx, name, expected):
    # The only read of the flag is the ordered one: a plain (weak) ld.global.b32 would let the
    # spin see a stale value and the data after it be read before the flag.
    assert flag_reads(ops_of(ptx, name)) == {expected}


def test_wait_until_rejects_an_unknown_comparison(ptx):
    assert "wait_cmp_bogus" not in ptx["ops"]
    assert "CMP must be one of" in ptx["errors"]["wait_cmp_bogus"]


@pytest.mark.parametrize("name", ["signal_wait_ctx", "gluon:signal_wait_ctx"])
def test_device_context_signal_and_wait(ptx, name):
    ops = ops_of(ptx, name)
    assert flag_reads(ops) == {"atom.global.sys.release.exch.b32", "ld.global.sys.acquire.b32"}, ops


def test_device_barrier_releases_and_acquires_at_system_scope(ptx):
    ops = ops_of(ptx, "device_barrier")
    # The arrival is a system-scope release add; Tritons that see its result unused emit it as a
    # reduction (red) rather than an atomic (atom).
    arrivals = atomics_of(ops)
    assert arrivals in (["atom.global.sys.release.add.u32"], ["red.global.sys.release.add.u32"]), ops
    assert "ld.global.sys.acquire.b32" in ops, ops
    # The one plain 32-bit load is of this rank's own epoch, which only this rank writes (the
    # fault words are read with volatile loads, ld.volatile.global, which flag_reads leaves out).
    assert flag_reads(ops) == {arrivals[0], "ld.global.sys.acquire.b32", "ld.global.b32"}


# -- waits bounded in wall-clock time, give-ups recorded ---------------------------------------------------

#: Kernels of the device API that wait on a flag, with the flag read each must keep.
WAITS = {
    "wait_default": "ld.global.sys.acquire.b32",
    "wait_default_i32_timeout": "ld.global.sys.acquire.b32",
    **{f"wait_cmp_{cmp}": "ld.global.sys.acquire.b32" for cmp in ("eq", "ne", "gt", "ge", "lt", "le")},
    "wait_relaxed_gpu": "ld.global.gpu.relaxed.b32",
    "wait_acquire_cta": "ld.global.cta.acquire.b32",
    "signal_wait_ctx": "ld.global.sys.acquire.b32",
    "gluon:signal_wait_ctx": "ld.global.sys.acquire.b32",
}
#: The collective kernel with each collective's steps (ptx_kernels.CCL_STEPS; a rooted
#: collective's ``_root``: compiled for its root).
CCL_KERNELS = ["all_gather", "all_to_all", "reduce_scatter", "all_reduce_one_shot", "all_reduce_two_shot", "broadcast",
               "reduce", "reduce_root", "gather", "gather_root", "scatter", "scatter_root"]
#: iris's own kernels that wait on peers and record a give-up in the fault words, by both front
#: ends where both compile them.
FAIL_STOP_KERNELS = [
    "device_barrier",
    *[f"{frontend}ccl_{collective}" for frontend in ("", "gluon:")
      for collective in CCL_KERNELS],
    *[f"{frontend}low_latency_{dtype}" for frontend in ("", "gluon:") for dtype in ("i8", "bf16", "fp32", "i64")],
    *[f"{frontend}sentinel_{dtype}" for frontend in ("", "gluon:") for dtype in ("bf16", "fp32")],
    *[f"fused_{product}{loop}" for product in ("all_gather_matmul", "matmul_reduce_scatter") for loop in ("", "_tma")],
]


def markers_of(ptx: dict, name: str) -> list[str]:
    assert name not in ptx["errors"], f"{name} did not compile:\n{ptx['errors'][name][-3000:]}"
    return ptx["markers"][name]


@pytest.mark.parametrize("name, expected", list(WAITS.items()))
def test_wait_until_reads_the_global_timer_and_still_acquires_its_flag(ptx, name, expected):
    # A wait is bounded in nanoseconds of the GPU's global timer, not in a number of reads; the
    # timer is an extra read of a special register, and the flag is still read only with the
    # ordered load (the data after the wait must not be read before the flag). The ``*_ctx``
    # kernels also signal (a release exchange), which is not a read of the flag waited on.
    assert "%globaltimer" in markers_of(ptx, name), ptx["markers"][name]
    assert flag_reads(ops_of(ptx, name)) - {"atom.global.sys.release.exch.b32"} == {expected}


@pytest.mark.parametrize("name", ["signal_default", "load_store_fp32", "load_store_ctx_fp32", "fused_push_rows"])
def test_kernels_that_do_not_wait_do_not_read_the_timer(ptx, name):
    # Control for the timer checks: a kernel without a wait has no %globaltimer (nor a trap).
    assert markers_of(ptx, name) == []


@pytest.mark.parametrize("name", FAIL_STOP_KERNELS)
def test_waiting_kernels_are_bounded_by_the_timer_and_record_give_ups(ptx, name):
    # Every kernel of iris that waits on peers: its waits read the global timer and the flags
    # (or the first word of a self-announcing block) with acquire loads at system scope; a
    # give-up is written to the host-visible fault words with write-through stores (the host
    # reads them without a synchronisation), the trap flag is read with a volatile load, and the
    # trap instruction (on_timeout="trap") is there.
    ops, marks = ops_of(ptx, name), markers_of(ptx, name)
    assert "%globaltimer" in marks and "trap" in marks, marks
    assert "ld.global.sys.acquire.b32" in ops, ops
    assert "st.global.wt.b32" in ops, ops
    assert "ld.volatile.global.b32" in ops, ops


# -- collectives ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frontend", ["", "gluon:"], ids=["triton", "gluon"])
@pytest.mark.parametrize("collective", CCL_KERNELS)
def test_collective_kernels_move_vectors_and_signal_at_system_scope(ptx, frontend, collective):
    # The one collective kernel, with each collective's steps, compiled by each front end (with
    # the fault words, their host-visible copy, the timeout in nanoseconds and the output's
    # element count it takes now): data moves in 16-byte vectors (bf16), a signal is a release
    # exchange at system scope and a wait an acquire load at system scope; no other atomics.
    ops = ops_of(ptx, f"{frontend}ccl_{collective}")
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops
    assert atomics_of(ops) == ["atom.global.sys.release.exch.b32"], ops
    assert "ld.global.sys.acquire.b32" in ops, ops


@pytest.mark.parametrize("frontend", ["", "gluon:"], ids=["triton", "gluon"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_reductions_give_nan_for_a_nan_operand(ptx, frontend, op):
    # torch's max and min give NaN where any operand is NaN; a GPU's plain max.f32 returns the
    # other operand (the interpreter's numpy propagates NaN, so only the PTX shows it): the
    # reductions compare with .NaN (on bf16 data the compiler narrows the float32 comparison to
    # packed bf16 pairs, which gives the same result) and never without it.
    marks = [m for m in markers_of(ptx, f"{frontend}ccl_all_reduce_{op}") if m.startswith(f"{op}.")]
    assert marks and all(".NaN." in m for m in marks), marks


@pytest.mark.parametrize("frontend", ["", "gluon:"], ids=["triton", "gluon"])
@pytest.mark.parametrize("collective", TILE_COLLECTIVES)
def test_tile_collectives_move_vectors_and_signal_at_system_scope(ptx, frontend, collective):
    # A tile collective inside a kernel (iris_triton.tiles; bf16 tiles, the source compiled by each front
    # end): its tiles move as 16-byte vectors, never as single 16-bit elements; a tile's ready
    # and done signals are release exchanges at system scope, its waits acquire loads at system
    # scope, and nothing else is atomic.
    ops = ops_of(ptx, f"{frontend}tile_{collective}")
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops
    assert not any(op.startswith(("ld.global", "st.global")) and op.endswith(".b16") for op in ops), ops
    assert atomics_of(ops) == ["atom.global.sys.release.exch.b32"], ops
    assert "ld.global.sys.acquire.b32" in ops, ops


def test_a_tile_collective_without_a_sync_moves_vectors_and_signals_nothing(ptx):
    # Upstream iris's unsynchronised form (the host orders the ranks): the same vector traffic,
    # no flag, no wait.
    ops = ops_of(ptx, "tile_unsynchronised_all_gather")
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops
    assert not atomics_of(ops) and not any("acquire" in op for op in ops), ops


def test_an_upstream_style_gluon_kernel_compiles_with_the_warps_layout_and_not_with_amds(ptx):
    # Upstream's Gluon kernels lay blocks out over AMD's 64-lane wavefronts; with
    # iris_gluon.warp_layout() the same kernel compiles for NVIDIA's 32-lane warps.
    ops = ops_of(ptx, "gluon:upstream_style_warp_layout")
    assert {"ld.global.b32", "st.global.b32"} <= set(ops), ops
    assert "atom.global.sys.acq_rel.add.f32" in ops, ops
    # The same source with 64 lanes is refused ("Layout has 64 threads per warp, but the module
    # specifies 32" goes to the compiler's stderr; the exception only says that parsing failed).
    assert "error encountered during parsing" in ptx["errors"]["gluon:upstream_style_64_lanes"]


@pytest.mark.parametrize("frontend", ["", "gluon:"], ids=["triton", "gluon"])
@pytest.mark.parametrize("dtype", ["i8", "bf16", "fp32", "i64"])
def test_low_latency_all_reduce_pushes_flagged_words_without_fences(ptx, frontend, dtype):
    # Flagged 64-bit words go out as 16-byte vectors of two whole words and nothing orders them:
    # no atomic, no fence (the flag travels with the data). They are read with volatile loads,
    # and a receiver still waiting polls one word's flag with an acquire load at system scope.
    ops = ops_of(ptx, f"{frontend}low_latency_{dtype}")
    assert "st.global.v2.b64" in ops, ops
    assert any(op.startswith("ld.volatile.global.") and op.endswith("b64") for op in ops), ops
    assert "ld.global.sys.acquire.b32" in ops, ops
    assert not atomics_of(ops) and not any(op.startswith(("fence", "membar")) for op in ops), ops


@pytest.mark.parametrize("frontend", ["", "gluon:"], ids=["triton", "gluon"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sentinel_all_reduce_pushes_plain_vectors_without_fences(ptx, frontend, dtype):
    # Elements go out as 16-byte vectors and nothing orders them: no atomic, no fence (an element
    # that is not the sentinel is the data). They are read with volatile loads, and a receiver
    # still waiting polls one word with an acquire load at system scope.
    ops = ops_of(ptx, f"{frontend}sentinel_{dtype}")
    assert "st.global.v4.b32" in ops, ops
    assert any(op.startswith("ld.volatile.global.") for op in ops), ops
    assert "ld.global.sys.acquire.b32" in ops, ops
    assert not atomics_of(ops) and not any(op.startswith(("fence", "membar")) for op in ops), ops


# -- fused matmul + communication ------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", [f"fused_{product}{loop}" for product in ("all_gather_matmul",
                                                                           "matmul_reduce_scatter")
                                    for loop in ("", "_tma")])
def test_fused_gemms_use_hopper_tensor_cores_and_wait_at_system_scope(ptx, kernel):
    # bf16 tiles go through wgmma (sm_90's asynchronous tensor-core product), results leave in
    # 16-byte vectors, and a tile waits on its flag with an acquire load at system scope.
    ops = ops_of(ptx, kernel)
    assert any(op.startswith("wgmma.mma_async.") and op.endswith(".f32.bf16.bf16") for op in ops), ops
    assert "st.global.v4.b32" in ops, ops
    assert "ld.global.sys.acquire.b32" in ops, ops


@pytest.mark.parametrize("kernel", ["fused_all_gather_matmul_tma", "fused_matmul_reduce_scatter_tma"])
def test_fused_gemms_by_descriptors_copy_tiles_by_tma_after_a_proxy_fence(ptx, kernel):
    # The descriptor loop's blocks arrive by the tensor memory accelerator; what a wait acquired
    # is ordered before those copies by a proxy fence (an acquire orders the generic proxy only).
    # The plain loop has neither.
    def fenced(name: str) -> bool:
        return any(op.startswith("fence.proxy.async.global") for op in ops_of(ptx, name))

    assert "cp.async.bulk.tensor" in markers_of(ptx, kernel)
    assert fenced(kernel)
    plain = kernel.removesuffix("_tma")
    assert "cp.async.bulk.tensor" not in markers_of(ptx, plain)
    assert not fenced(plain)


@pytest.mark.parametrize("kernel", ["fused_push_rows", "fused_matmul_reduce_scatter"])
def test_fused_kernels_push_vectors_then_release_a_flag(ptx, kernel):
    # What goes to a peer is 16-byte vector stores, followed by one release exchange at system
    # scope per tile (the kernels' only atomic).
    ops = ops_of(ptx, kernel)
    assert "st.global.v4.b32" in ops, ops
    assert atomics_of(ops) == ["atom.global.sys.release.exch.b32"], ops


def test_every_kernel_compiled_except_the_bogus_comparison_and_amds_lanes(ptx):
    expected = {"wait_cmp_bogus", "gluon:upstream_style_64_lanes"}  # both refused on purpose (tests below)
    assert set(ptx["errors"]) == expected, {k: v[-1500:] for k, v in ptx["errors"].items() if k not in expected}
    assert len(ptx["ops"]) >= 90


# -- the device contexts' methods, compiled ----------------------------------------------------------------

_METHODS_SCRIPT = """
import json
import triton
from iris_gluon import IrisDeviceCtx
from iris_triton.device.context import DeviceContext, method_source
from iris_triton.device.functions import DEVICE_FUNCTIONS
print(json.dumps({name: {"jit": isinstance(getattr(DeviceContext, name), triton.runtime.JITFunction),
                         "source": getattr(DeviceContext, name).src == method_source(name),
                         "gluon_shares": getattr(IrisDeviceCtx, name) is getattr(DeviceContext, name)}
                  for name in DEVICE_FUNCTIONS}))
"""


def test_context_methods_are_jit_functions_of_their_generated_source():
    # Compiled (no interpreter), every generated method is a @triton.jit function whose source,
    # the one Triton and Gluon compile, is the generated one, and Gluon's context shares it.
    methods = run_without_interpreter("-c", _METHODS_SCRIPT, timeout=300, cwd=KERNELS.parent)
    assert methods and all(all(checks.values()) for checks in methods.values()), methods
