"""``ctx.ops``: matrix products overlapped with their communication, for tensor-parallel layers.

Each operation checks its tensors, then runs one of three methods and returns ``out``:

- ``"copy_engine"`` (:mod:`iris_triton.operations.copy_engine`): the product split by the rows ranks own,
  each part by cuBLAS, while the copy engines move the other part's data on a second stream;
- ``"fused"`` (:mod:`iris_triton.operations.fused`): persistent Triton kernels whose GEMM waits on, or
  sends, tiles as they are ready, the data moved by the multiprocessors;
- ``"sequential"``: ``torch.matmul`` then an iris collective (or the other way round).

``method=None`` decides by an estimate of the communication's share of the product's time
(:func:`communication_share`): on GPUs the copy engines run when there is enough to hide
(:data:`COPY_ENGINE_MIN_SHARE`), otherwise the sequential path; the decision is logged at debug
level. CPU ranks run the fused kernels (the path worth testing there; there is no cuBLAS to
lose against). The estimate's rates and threshold are in :mod:`iris_triton.tuning`; how each
method compares on GPUs is in benchmarks/NOTES.md.

The buffers every method needs (a gathered ``A`` or a receive buffer; flags; call counts) live on
the heap, are allocated collectively the first time a call needs more than before, and are
reused afterwards: later calls allocate nothing and need no host synchronisation, so they can be
captured in CUDA graphs.
"""

from __future__ import annotations

import contextlib
import functools

import attrs
import torch
import triton

from iris.collectives import signature_of
from iris.calls.handles import register as register_operator_handle
from iris.calls.repeats import Kept, Repeats
from iris.calls.routing import declared
from iris.errors import IrisError
from iris.collectives.groups import namespace_for
from iris_triton.operations import moe, moe_plans
from iris_triton.operations.copy_engine import CopyEngineOps
from iris_triton.operations.fused import all_gather_matmul_kernel, matmul_reduce_scatter_kernel, push_rows_kernel
from iris_triton.operations.gemm import MOST_PARTS, descriptors, split_launch, split_slots
from iris_triton.tuning import (COPY_ENGINE_MIN_SHARE, GEMM_FLOPS_PER_SECOND, GEMM_TILES, LINK_BYTES_PER_SECOND,
                                PUSH_BLOCK_K, PUSH_PROGRAMS)

__all__ = ["FusedOps", "METHODS", "communication_share"]

#: Element types of the fused and copy-engine methods; the sequential one also takes float32.
DTYPES = (torch.bfloat16, torch.float16)
SEQUENTIAL_DTYPES = (*DTYPES, torch.float32)
#: What ``method=`` accepts (None: the automatic choice).
METHODS = ("copy_engine", "fused", "sequential")


def communication_share(flops: int, sent: int) -> float:
    """Estimated time to send ``sent`` bytes per rank over the link, over the time of ``flops``
    of bf16 product on the GPU."""
    return (sent / LINK_BYTES_PER_SECOND) / (flops / GEMM_FLOPS_PER_SECOND)


#: Elements the fused kernels' two data slots are aligned to (a multiple of 16, so that Triton
#: keeps the slots' 16-byte vector accesses).
SLOT_ALIGNMENT = 128


@attrs.frozen
class _Buffers:
    """Heap buffers of one fused kernel, views of two of the context's named workspaces: data
    (two slots, ``slot_stride`` elements apart) and int32 state words ``[headers[3, world], calls
    of the GEMM programs, calls of the push programs, flags[world, flag_stride]]`` (the headers: a
    row per call parity in which the peers announce their calls, then a row of announcements that
    stays 0, which the waits also read: :mod:`iris_triton.protocol.calls`). Both layouts follow the
    buffers' sizes, which only grow (collectively), not the call's shape: calls of different shapes
    use the same slots, and a later call never reads a flag where an earlier one wrote a count (the
    state is zeroed when allocated)."""

    programs: int
    flag_stride: int
    slot_stride: int
    data: torch.Tensor
    headers: torch.Tensor
    gemm_calls: torch.Tensor
    push_calls: torch.Tensor
    flags: torch.Tensor

    @classmethod
    def of(cls, context, name: str, slot_elements: int, dtype: torch.dtype, flag_stride: int) -> "_Buffers":
        """``name``'s buffers for slots of ``slot_elements`` and ``flag_stride`` flags per rank."""
        programs, world = context.get_cu_count(), context.world_size
        data_bytes = 2 * (slot_elements + SLOT_ALIGNMENT) * dtype.itemsize
        data = context.workspaces.get(f"{name}_data", data_bytes).view(dtype)
        state = context.workspaces.get(f"{name}_state", 4 * (3 * world + 2 * programs + world * flag_stride),
                                       fill=0).view(torch.int32)
        calls = state[3 * world:]
        return cls(programs=programs, flag_stride=(calls.numel() - 2 * programs) // world,
                   slot_stride=data.numel() // 2 // SLOT_ALIGNMENT * SLOT_ALIGNMENT, data=data,
                   headers=state[:3 * world], gemm_calls=calls[:programs], push_calls=calls[programs:2 * programs],
                   flags=calls[2 * programs:])


#: The arrival words of a split are a multiple of this many (128 bytes, so that the float32 tiles
#: after them keep 16-byte vector accesses).
SPLIT_WORDS_ALIGNMENT = 32


def _split_buffers(context, name: str, programs: int, slots: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partials, arrived)``: ``slots`` float32 partial tiles of ``block`` elements and the
    arrival words (int32, 0 between calls) of the fused kernel ``name`` whose last wave is split
    along K (:func:`iris_triton.operations.gemm.split_parts`), in one workspace: first as many
    words as any split on the context's ``programs`` (its units) can publish, whatever the call's
    shape (so that no call's tiles cover another's words), then the tiles. A kernel that splits
    nothing is passed both."""
    words = triton.cdiv(programs * (MOST_PARTS - 1), SPLIT_WORDS_ALIGNMENT) * SPLIT_WORDS_ALIGNMENT
    state = context.workspaces.get(f"{name}_split", 4 * (words + slots * block), fill=0)
    return state[4 * words:].view(torch.float32), state[:4 * words].view(torch.int32)


def _guarded(operation):
    """Run ``operation(out, ...)`` as one iris call of its context
    (:class:`iris.mixins.FailStopMixin`): refused on a failed context or from a second thread, and
    raising a failure it records; ``out`` then holds all-ones bits (NaN), also when the failure
    ended an inner step before anything wrote ``out``. An operation whose first parameter is not
    named ``out`` returns new tensors and poisons them itself: its first argument is an input."""
    writes_first = operation.__code__.co_varnames[1:2] == ("out",)

    @functools.wraps(operation)
    def call(self, out, *args, **kwargs):
        ctx = self._context
        outputs = (out,) if writes_first and isinstance(out, torch.Tensor) else ()
        ctx._refuse_across_nodes(f"ops.{operation.__name__}")
        with ctx._call(f"ops.{operation.__name__}", outputs):
            description, signature = _described(operation.__name__, (out, *args), kwargs)
            outer = ctx._describe_call(f"ops.{operation.__name__}", signature, description)
            try:
                return operation(self, out, *args, **kwargs)
            finally:
                ctx._end_call(outer)

    return call


def _compiled_as(compiled, again):
    """Decorate a public method whose results are not declared outputs (MoE's): under
    torch.compile it runs ``compiled(self, *args, **kwargs)``, which calls its custom operator,
    instead of the method (whose guard Dynamo cannot trace); eagerly, ``again(self, *args,
    **kwargs)`` first, which makes a call of a shape made before by its plan, or returns None
    (:mod:`iris_triton.operations.moe_plans`)."""

    def decorate(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if torch.compiler.is_compiling():
                return compiled(self, *args, **kwargs)
            made = again(self, *args, **kwargs)
            return method(self, *args, **kwargs) if made is None else made

        call.__iris_operator__ = method.__name__
        return call

    return decorate


@contextlib.contextmanager
def _announced_call(ctx, name: str, args: tuple, method: str):
    """The call of the operation ``name`` with tensors ``args`` by ``method`` (``"fused/<tile>"``
    or ``"copy_engine"``), described to the context (:meth:`iris.mixins.FailStopMixin._describe_call`)
    for its kernels to announce to their peers: yields the signature, which covers the operation,
    the tensors' shapes and dtypes, the method and the tile."""
    description, signature = _described(name, args, {"method": method})
    outer = ctx._describe_call(f"ops.{name}", signature, description)
    try:
        yield signature
    finally:
        ctx._end_call(outer)


#: :func:`_described`'s results, by the calls' shapes, dtypes and options.
_DESCRIPTIONS: dict = {}


def _described(name: str, args: tuple, kwargs: dict) -> tuple[str, int]:
    """:func:`_describe` and its signature, kept per distinct call (a repeated eager call formats
    no string)."""
    def part(value):
        if isinstance(value, torch.Tensor):
            return value.shape, value.dtype
        simple = value is None or isinstance(value, (bool, int, float, str))
        return (type(value), value) if simple else type(value)  # True, 1 and 1.0 are described apart

    key = (name, *map(part, args), *((k, part(v)) for k, v in kwargs.items()))
    found = _DESCRIPTIONS.get(key)
    if found is None:
        if len(_DESCRIPTIONS) >= 1024:
            _DESCRIPTIONS.clear()
        description = _describe(name, args, kwargs)
        found = _DESCRIPTIONS[key] = (description, signature_of(description))
    return found


def _describe(name: str, args: tuple, kwargs: dict) -> str:
    """A call of the operation ``name`` as errors name it: its tensors' shapes and dtypes, its
    other arguments (a workspace that grows exchanges it: :mod:`iris.context.failstop`)."""
    def one(value) -> str:
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        return repr(value) if value is None or isinstance(value, (bool, int, float, str)) else type(value).__name__

    return f"{name}({', '.join([*map(one, args), *(f'{k}={one(v)}' for k, v in kwargs.items())])})"


class FusedOps:
    """Fused matmul + communication of one context (``ctx.ops``). Every method is collective:
    all ranks call it in the same order with tensors of the same shapes."""

    #: Public methods without a custom operator (torch.ops.iris): they run eagerly, outside
    #: compiled regions.
    EAGER_ONLY = ("tune", "tune_matmul", "method_names")

    def __init__(self, context):
        self._context = context
        #: The world size, where compiled code reads it (a plain attribute, which Dynamo traces).
        self._world_size = context.world_size
        self._side_stream = None
        self._copy_engine = CopyEngineOps(context, self._alongside, self._join)
        #: MoE dispatches made so far: which of the two receive buffers the next one fills, and
        #: whether a combine's buffers were reused since (iris_triton.operations.moe_kernels).
        self._moe_calls = 0
        #: Views of the MoE workspaces as the kernels take them, by what they depend on, so that
        #: an eager call does not cut them again (iris_triton.operations.moe_kernels.memo).
        self._moe_views: dict = {}
        #: Plans of MoE calls of the shapes made so far (iris_triton.operations.moe_plans).
        self._moe_plans = Kept(moe_plans.MAX_PLANS)
        #: Repeats of earlier calls, by everything the calls' checks and launches depend on.
        self._repeats = Repeats(context)
        #: This object's handle for the custom operators (torch.ops.iris.*, iris.calls.handles).
        self._iris_handle = register_operator_handle(self)

    def _for_group(self, group) -> "FusedOps":
        """The operations that run calls with ``group=group`` (:mod:`iris.collectives.groups`)."""
        return namespace_for(self, group)

    # -- the operations -------------------------------------------------------------------------

    @declared
    @_guarded
    def all_gather_matmul(self, out: torch.Tensor, a_shard: torch.Tensor, b: torch.Tensor, *,
                          method: str | None = None) -> torch.Tensor:
        """``out`` (``world_size * m x N``) := ``all_gather(a_shard) @ b``: ``a_shard`` (``m x K``)
        is this rank's block of rows of ``A``, in rank order; ``b`` is ``K x N``. ``method``: one
        of :meth:`method_names` (:data:`METHODS`, ``"fused/<tile>"``), or None to choose (tuned,
        else by an estimate)."""
        ctx = self._context
        self._check("all_gather_matmul", out=out, a_shard=a_shard, b=b)
        m, K = a_shard.shape
        N = b.shape[1]
        self._check_shape("all_gather_matmul", "b", b, (K, N))
        self._check_shape("all_gather_matmul", "out", out, (ctx.world_size * m, N))
        method = self._method("all_gather_matmul", method, flops=2 * ctx.world_size * m * N * K,
                              sent=(ctx.world_size - 1) * a_shard.numel() * a_shard.element_size(),
                              dtype=a_shard.dtype, extents=(N, K, m))
        if method == "copy_engine":
            with _announced_call(ctx, "all_gather_matmul", (out, a_shard, b), method) as signature:
                return self._copy_engine.all_gather_matmul(out, a_shard, b, signature)
        if method == "sequential":
            gathered = torch.empty(ctx.world_size * m, K, dtype=a_shard.dtype, device=ctx.device)
            ctx._torch_ccl.all_gather(gathered, a_shard.contiguous())
            return torch.matmul(gathered, b, out=out)
        config = self._tile(method)
        tile = self._tile_name(method)
        block_m = config["BLOCK_M"]
        buffers = _Buffers.of(ctx, "all_gather_matmul", ctx.world_size * m * K, a_shard.dtype, triton.cdiv(m, block_m))
        push_programs = min(PUSH_PROGRAMS[ctx.kernel_device_type], triton.cdiv(m, block_m))
        tiles = ctx.world_size * triton.cdiv(m, block_m) * triton.cdiv(N, config["BLOCK_N"])
        parts, gemm_programs = split_launch(tiles, max(1, buffers.programs - PUSH_PROGRAMS[ctx.kernel_device_type]),
                                            triton.cdiv(K, config["BLOCK_K"]))
        partials, arrived = _split_buffers(ctx, "all_gather_matmul", buffers.programs,
                                           split_slots(tiles, gemm_programs, parts), block_m * config["BLOCK_N"])
        with _announced_call(ctx, "all_gather_matmul", (out, a_shard, b), f"fused/{tile}") as signature:
            common = dict(flags=buffers.flags, headers=buffers.headers, signature=signature,
                          context=ctx.get_device_context(), capacity=buffers.programs,
                          flag_stride=buffers.flag_stride, slot_stride=buffers.slot_stride, RANK=ctx.rank,
                          WORLD=ctx.world_size, TRACING=ctx.tracing.enabled)
            with self._alongside():
                push_rows_kernel[(push_programs,)](
                    shard=a_shard, gathered=buffers.data, calls=buffers.push_calls, m=m, K=K,
                    stride_sm=a_shard.stride(0), stride_sk=a_shard.stride(1), BLOCK_M=block_m,
                    BLOCK_K=PUSH_BLOCK_K[ctx.kernel_device_type], **common)
            tiles_of = descriptors(buffers.data, (2, ctx.world_size, m, K), (buffers.slot_stride, m * K, K, 1), b,
                                   config)
            all_gather_matmul_kernel[(gemm_programs,)](
                gathered=buffers.data, b=b, out=out, calls=buffers.gemm_calls, partials=partials, arrived=arrived,
                parts=parts, m=m, N=N, K=K,
                stride_bk=b.stride(0), stride_bn=b.stride(1), stride_om=out.stride(0), stride_on=out.stride(1),
                EVEN_K=K % config["BLOCK_K"] == 0, **tiles_of, **common, **config)
            self._join()
        return out

    @declared
    @_guarded
    def matmul_reduce_scatter(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                              method: str | None = None) -> torch.Tensor:
        """``out`` (``M / world_size x N``) := this rank's block of rows of ``a @ b`` (``a``:
        ``M x K``, ``b``: ``K x N``) summed over ranks (``reduce_scatter(a @ b)``, rank r getting
        rows ``[r * M / world_size, (r + 1) * M / world_size)``)."""
        ctx = self._context
        self._check("matmul_reduce_scatter", out=out, a=a, b=b)
        M, K = a.shape
        N = b.shape[1]
        if M % ctx.world_size:
            raise IrisError(f"matmul_reduce_scatter: a has {M} rows, not divisible by the world size "
                            f"{ctx.world_size}; pad M to a multiple of {ctx.world_size}")
        m = M // ctx.world_size
        self._check_shape("matmul_reduce_scatter", "b", b, (K, N))
        self._check_shape("matmul_reduce_scatter", "out", out, (m, N))
        method = self._method("matmul_reduce_scatter", method, flops=2 * M * N * K,
                              sent=(ctx.world_size - 1) * m * N * out.element_size(), dtype=out.dtype,
                              extents=(N, K, M))
        if method == "copy_engine":
            with _announced_call(ctx, "matmul_reduce_scatter", (out, a, b), method) as signature:
                return self._copy_engine.matmul_reduce_scatter(out, a, b, signature)
        if method == "sequential":
            return ctx._torch_ccl.reduce_scatter(out, torch.matmul(a, b))
        return self._fused_reduce_scatter(out, a, b, method, "matmul_reduce_scatter", (out, a, b))

    def _fused_reduce_scatter(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, method: str, name: str,
                              described: tuple) -> torch.Tensor:
        """:meth:`matmul_reduce_scatter` by a fused ``method`` (checked), as the operation ``name``
        with tensors ``described`` (what its kernel announces, and errors name)."""
        ctx = self._context
        m, N, K = out.shape[0], out.shape[1], a.shape[1]
        config = self._tile(method)
        tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
        buffers = _Buffers.of(ctx, "matmul_reduce_scatter", ctx.world_size * m * N, out.dtype, tiles)
        with _announced_call(ctx, name, described, f"fused/{self._tile_name(method)}") as signature:
            tiles_of = descriptors(a, (1, ctx.world_size, m, K), (a.stride(0) * a.shape[0], m * a.stride(0),
                                                                  a.stride(0), a.stride(1)), b, config)
            matmul_reduce_scatter_kernel[(max(1, min(buffers.programs, tiles)),)](
                ctx.get_device_context(), a, b, out, buffers.data, flags=buffers.flags, calls=buffers.gemm_calls,
                headers=buffers.headers, signature=signature, capacity=buffers.programs, m=m, N=N, K=K,
                stride_am=a.stride(0), stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1),
                stride_om=out.stride(0), stride_on=out.stride(1), flag_stride=buffers.flag_stride,
                slot_stride=buffers.slot_stride, RANK=ctx.rank, WORLD=ctx.world_size, TRACING=ctx.tracing.enabled,
                EVEN_K=K % config["BLOCK_K"] == 0, **tiles_of, **config)
        return out

    @declared
    @_guarded
    def matmul_all_reduce(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                          method: str | None = None) -> torch.Tensor:
        """``out`` (``M x N``) := ``a @ b`` summed over ranks (``all_reduce(a @ b)``). Other than
        sequentially, it is :meth:`matmul_reduce_scatter` by that method followed by
        ``ctx.ccl.all_gather``; when ``M`` is not divisible by the world size it runs
        sequentially."""
        ctx = self._context
        self._check("matmul_all_reduce", out=out, a=a, b=b)
        M, K = a.shape
        N = b.shape[1]
        self._check_shape("matmul_all_reduce", "b", b, (K, N))
        self._check_shape("matmul_all_reduce", "out", out, (M, N))
        self._check_method("matmul_all_reduce", method)
        divisible = M % ctx.world_size == 0
        if method not in (None, "sequential") and not divisible:
            raise IrisError(f"matmul_all_reduce: method={method!r} needs M divisible by the world size "
                            f"{ctx.world_size}, got M={M}; pass method=None to run it sequentially")
        sent = 2 * (ctx.world_size - 1) * (M // ctx.world_size) * N * out.element_size()
        method = self._method("matmul_all_reduce", method if divisible else "sequential", flops=2 * M * N * K,
                              sent=sent, dtype=out.dtype, extents=(N, K, M))
        if method == "sequential":
            return ctx._torch_ccl.all_reduce(torch.matmul(a, b, out=out))
        mine = torch.empty(M // ctx.world_size, N, dtype=out.dtype, device=ctx.device)
        if method == "copy_engine":
            with _announced_call(ctx, "matmul_all_reduce", (out, a, b), method) as signature:
                self._copy_engine.matmul_reduce_scatter(mine, a, b, signature)
        else:  # its kernel announces (and errors name) this call, not the reduce-scatter inside it
            self._fused_reduce_scatter(mine, a, b, method, "matmul_all_reduce", (out, a, b))
        return ctx._torch_ccl.all_gather(out, mine)

    @declared
    @_guarded
    def matmul_all_gather(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                          method: str | None = None) -> torch.Tensor:
        """``out`` (``world_size * m x N``) := ``all_gather(a @ b)``: ``a`` (``m x K``) is this
        rank's block of rows of ``A``, ``b`` is ``K x N``; rank r's product lands in rows
        ``[r * m, (r + 1) * m)``. It runs sequentially (the product, then ``ctx.ccl.all_gather``):
        ``method`` may be None or ``"sequential"``."""
        ctx = self._context
        self._check("matmul_all_gather", out=out, a=a, b=b)
        m, K = a.shape
        N = b.shape[1]
        self._check_shape("matmul_all_gather", "b", b, (K, N))
        self._check_shape("matmul_all_gather", "out", out, (ctx.world_size * m, N))
        self._check_method("matmul_all_gather", method)
        if method not in (None, "sequential"):
            raise IrisError(f"matmul_all_gather: method={method!r} is not available; it runs sequentially "
                            f"(method=None or 'sequential')")
        return ctx._torch_ccl.all_gather(out, torch.matmul(a, b))

    @declared
    @_guarded
    def all_reduce_rmsnorm(self, out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float = 1e-6, residual_out: torch.Tensor | None = None, *,
                           method: str | None = None) -> torch.Tensor:
        """``out`` (``tokens x hidden``) := ``rms_norm(all_reduce(x) + residual, (hidden,), weight,
        eps)``, computed in float32; ``residual_out``, if given, := ``all_reduce(x) + residual``.
        ``method``: ``"one_shot"``, ``"two_shot"`` or None (by size). One kernel
        (:mod:`iris_triton.operations.rmsnorm`)."""
        from iris_triton.operations.rmsnorm import all_reduce_rmsnorm

        return all_reduce_rmsnorm(self._context, out, x, residual, weight, eps, residual_out, method=method)

    def tune(self, hidden: int, tokens=None, dtypes=None, *, repeats: int | None = None, save: bool = True,
             timer=None):
        """Time ``all_reduce_rmsnorm``'s methods on this machine for rows of ``hidden`` elements,
        each of ``dtypes`` (default bfloat16) and token buckets, and make its automatic method
        take the fastest on the slowest rank (saved in the tuning cache if ``save``); returns the
        :class:`iris.tuning.TuningTable` of the decisions. Collective (docs/tuning.md)."""
        from iris.tuning import parse_dtype, tune_all_reduce_rmsnorm
        from iris_triton.operations.rmsnorm import DTYPES as RMSNORM_DTYPES
        from iris_triton.operations.rmsnorm import METHODS as RMSNORM_METHODS

        refused = [str(d) for d in map(parse_dtype, dtypes or ()) if d not in RMSNORM_DTYPES]
        if refused:
            raise IrisError(f"tune: all_reduce_rmsnorm takes torch.bfloat16, torch.float16 and torch.float32 "
                            f"tensors, not {', '.join(refused)}")
        return tune_all_reduce_rmsnorm(self, RMSNORM_METHODS, hidden, tokens, dtypes, repeats=repeats, save=save,
                                       timer=timer)

    def tune_matmul(self, operation: str, n: int, k: int, rows=None, dtypes=None, *, repeats: int | None = None,
                    save: bool = True, timer=None):
        """Time the methods of the fused product ``operation`` (``"all_gather_matmul"``,
        ``"matmul_reduce_scatter"`` or ``"matmul_all_reduce"``) on this machine for a ``k x n`` B,
        each of ``dtypes`` (default bfloat16) and buckets of the rows of A on each rank, and make
        its automatic method take the fastest on the slowest rank (saved in the tuning cache if
        ``save``); returns the :class:`iris.tuning.TuningTable` of the decisions. Collective
        (docs/tuning.md)."""
        from iris.tuning import parse_dtype, tune_matmul

        refused = [str(d) for d in map(parse_dtype, dtypes or ()) if d not in DTYPES]
        if refused:
            raise IrisError(f"tune_matmul: the fused methods take torch.bfloat16 or torch.float16 tensors, not "
                            f"{', '.join(refused)}")
        methods = tuple(m for m in self.method_names() if m != "fused")  # each tile of fused by its name
        return tune_matmul(self, operation, methods, n, k, rows, dtypes, repeats=repeats, save=save, timer=timer)

    @_compiled_as(moe.compiled_dispatch, moe_plans.dispatch_again)
    @_guarded
    def moe_dispatch(self, tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     num_experts: int, *, capacity: int | None = None, fp8: bool = False):
        """Send every token to the ranks holding its ``topk_ids`` experts (expert-parallel MoE;
        rank r holds experts ``[r * E / W, (r + 1) * E / W)``): returns a
        :class:`iris_triton.operations.moe.MoeDispatch`, this rank's experts' received tokens as
        ``[local experts, capacity, hidden]`` with device counts, and the handle
        :meth:`moe_combine` takes. ``tokens``: ``[T, hidden]`` bf16, fp16 or fp32, the same ``T``
        on every rank; ``topk_ids``: int32/int64 ``[T, k]`` (-1: the slot goes nowhere);
        ``topk_weights``: float32 ``[T, k]``. ``capacity``: rows per expert (default ``W * T``,
        which always holds; a routing that overflows it fails the call on every rank).
        ``fp8=True`` moves tokens as float8_e4m3fn with a float32 scale per token. No host
        synchronisation (CUDA-graph capturable after one eager call of the largest size). Under
        torch.compile the call is the operator ``torch.ops.iris.moe_dispatch`` (docs/moe.md)."""
        return moe.dispatch(self, tokens, topk_ids, topk_weights, num_experts, capacity, fp8)

    @_compiled_as(moe.compiled_combine, moe_plans.combine_again)
    @_guarded
    def moe_combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        """The inverse of :meth:`moe_dispatch`: ``expert_out`` (``[local experts, capacity,
        hidden]``, bf16, fp16 or fp32: the experts' outputs in the dispatch's slots) goes back to
        the tokens' ranks; returns ``[T, hidden]`` (``expert_out``'s dtype), token t :=
        ``sum_j topk_weights[t, j] * output of its j-th expert``, in float32. ``handle``: the
        dispatch's result or its ``.handle``. Under torch.compile: ``torch.ops.iris.moe_combine``."""
        return moe.combine(self, expert_out, handle)

    # -- checks, decisions, buffers, streams ----------------------------------------------------

    def _check(self, name: str, **tensors: torch.Tensor) -> None:
        """Every tensor: a 2-D torch tensor on the context's device, bf16, fp16 or (for the
        sequential method) fp32, all of one dtype; ``out`` contiguous."""
        ctx = self._context
        dtype = None
        for what, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.device != ctx.device:
                raise IrisError(f"{name}: {what} is on {tensor.device}, but this context runs on {ctx.device}; move "
                                f"it with .to({str(ctx.device)!r})")
            if tensor.dim() != 2:
                raise IrisError(f"{name}: {what} must be a matrix (2-D), got shape {tuple(tensor.shape)}")
            if tensor.dtype not in SEQUENTIAL_DTYPES:
                raise IrisError(f"{name}: {what} has dtype {tensor.dtype}; supported: torch.bfloat16, torch.float16 "
                                f"and, run sequentially, torch.float32")
            if dtype is not None and tensor.dtype != dtype:
                raise IrisError(f"{name}: {what} has dtype {tensor.dtype}, the others {dtype}; use one dtype")
            dtype = tensor.dtype
        if not tensors["out"].is_contiguous():
            raise IrisError(f"{name}: out is not contiguous; pass a contiguous tensor (e.g. torch.empty(...))")

    @staticmethod
    def _check_shape(name: str, what: str, tensor: torch.Tensor, shape: tuple) -> None:
        if tuple(tensor.shape) != shape:
            raise IrisError(f"{name}: {what} has shape {tuple(tensor.shape)}; expected {shape}")

    def method_names(self, operation: str | None = None) -> tuple[str, ...]:
        """What ``method=`` of ``operation`` takes on this context's device. The matrix products
        (``operation`` None or one of them): :data:`METHODS`, and ``"fused/<tile>"`` for each tile
        of ``GEMM_TILES`` (``"fused"``: the built-in tile); ``"all_reduce_rmsnorm"``: its methods."""
        if operation == "all_reduce_rmsnorm":
            from iris_triton.operations.rmsnorm import METHODS as RMSNORM_METHODS

            return RMSNORM_METHODS
        return METHODS + tuple(f"fused/{tile}" for tile in GEMM_TILES[self._context.kernel_device_type])

    def _check_method(self, name: str, method: str | None) -> None:
        if method is not None and method not in self.method_names():
            raise IrisError(f"{name}: method={method!r} is not one of {', '.join(self.method_names())} (or None to "
                            f"choose automatically)")

    def _tile(self, method: str) -> dict:
        """The GEMM tile of a fused ``method`` (``"fused"`` or ``"fused/<tile>"``)."""
        tiles = GEMM_TILES[self._context.kernel_device_type]
        return tiles[self._tile_name(method)]

    def _tile_name(self, method: str) -> str:
        """The name of a fused ``method``'s GEMM tile (``"fused"``: the built-in one, the first)."""
        return method.partition("/")[2] or next(iter(GEMM_TILES[self._context.kernel_device_type]))

    def _method(self, name: str, method: str | None, flops: int, sent: int, dtype: torch.dtype,
                extents: tuple[int, int, int]) -> str:
        """The method to run ``name`` by: as asked, else the tuned one for its ``extents`` (N, K and
        the rows of A on this rank; :mod:`iris.tuning`), else by the estimate (CPU ranks: fused);
        float32 runs sequentially."""
        if method is not None:
            self._check_method(name, method)
            if method != "sequential" and dtype not in DTYPES:
                raise IrisError(f"{name}: method={method!r} takes torch.bfloat16 or torch.float16, not {dtype}; "
                                f"pass method=None or 'sequential'")
            return method
        if dtype not in DTYPES:
            return "sequential"
        ctx = self._context
        tuned = ctx.tuning.method(name, self.method_names(), ctx.world_size, dtype, extents[:2], extents[2]) \
            if ctx.tuning.entries else None
        if tuned is not None:
            return tuned
        if ctx.kernel_device_type != "cuda":
            return "fused"
        share = communication_share(flops, sent)
        if share < COPY_ENGINE_MIN_SHARE:
            ctx.debug(f"{name}: sequential (estimated communication {share:.1%} of the product's time, under "
                      f"{COPY_ENGINE_MIN_SHARE:.0%}: overlapping would not pay)")
            return "sequential"
        ctx.debug(f"{name}: copy engines overlapped with the product (estimated communication {share:.1%} of "
                  f"the product's time)")
        return "copy_engine"

    @contextlib.contextmanager
    def _alongside(self):
        """Kernels launched inside run on a second stream (on GPUs), after everything queued so
        far on the current one; :meth:`_join` makes the current stream wait for them."""
        ctx = self._context
        if ctx.device.type != "cuda":
            yield
            return
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(ctx.device)
        self._side_stream.wait_stream(torch.cuda.current_stream(ctx.device))
        with torch.cuda.stream(self._side_stream):
            yield

    def _join(self) -> None:
        if self._side_stream is not None:
            torch.cuda.current_stream(self._context.device).wait_stream(self._side_stream)
