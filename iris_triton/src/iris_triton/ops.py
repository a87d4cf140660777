"""``ctx.ops``: matrix products fused with their communication, for tensor-parallel layers.

Each operation checks its tensors, then runs either the fused kernels of
:mod:`iris_triton.fused` or the sequential path (``torch.matmul`` and an iris collective), and
returns ``out``. ``fused=None`` decides by an estimate: fusion pays when the communication is a
large enough share of the product's time to hide more than the fused GEMM loses against cuBLAS
(:data:`MIN_COMMUNICATION_SHARE`); the decision is logged at debug level. CPU ranks always fuse
(there is no cuBLAS to lose against, and it is the path worth testing). On H200 the estimate
currently keeps the Llama-3-70B TP=2 layers of benchmarks/fused.py sequential, where the fused
kernels measured slower.

The fused kernels' buffers (the gathered ``A`` or the receive buffer, two slots each; flags; call
counts) live on the heap, are allocated collectively the first time a call needs more than
before, and are reused afterwards: later calls allocate nothing and need no host
synchronisation, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from iris.errors import IrisError
from iris_triton.fused import all_gather_matmul_kernel, matmul_reduce_scatter_kernel, push_rows_kernel
from iris_triton.gemm import GEMM_CONFIGS

__all__ = ["FusedOps", "MIN_COMMUNICATION_SHARE", "communication_share"]

#: Element types of the fused operations.
DTYPES = (torch.bfloat16, torch.float16)
#: Time of the fused kernels' GEMM against cuBLAS's for the same product, as measured on H200
#: (benchmarks/NOTES.md: a plain persistent Triton GEMM, less the multiprocessors that push).
FUSED_GEMM_EFFICIENCY = 0.8
#: Fuse when the communication's estimated time is at least this share of the product's: only
#: then can hiding it make up for the slower GEMM (1 / efficiency - 1).
MIN_COMMUNICATION_SHARE = 1 / FUSED_GEMM_EFFICIENCY - 1
#: Estimates for that decision on GPUs: bf16 tensor-core rate and SM-issued link bandwidth
#: measured on H200 (benchmarks/NOTES.md).
GEMM_FLOPS_PER_SECOND = 700e12
LINK_BYTES_PER_SECOND = 365e9
#: Programs of the kernel that pushes rows of A to the peers (all_gather_matmul); the GEMM gets
#: the remaining multiprocessors, so both kernels always run at once.
PUSH_PROGRAMS = {"cuda": 8, "cpu": 1}
PUSH_BLOCK_K = {"cuda": 128, "cpu": 16}


def communication_share(flops: int, sent: int) -> float:
    """Estimated time to send ``sent`` bytes per rank over the link, over the time of ``flops``
    of bf16 product on the GPU."""
    return (sent / LINK_BYTES_PER_SECOND) / (flops / GEMM_FLOPS_PER_SECOND)


class _Buffers:
    """Heap buffers of one fused kernel: a data workspace (two slots) and int32 state words
    ``[calls of the GEMM programs, calls of the push programs, flags[world, flag_stride]]``."""

    def __init__(self, context, data_elements: int, dtype: torch.dtype, flag_stride: int):
        programs = context.get_cu_count()
        self.programs = programs
        self.flag_stride = flag_stride
        self.data = context.zeros(data_elements, dtype=dtype)
        self.state = context.zeros(2 * programs + context.world_size * flag_stride, dtype=torch.int32)
        self.gemm_calls = self.state[:programs]
        self.push_calls = self.state[programs : 2 * programs]
        self.flags = self.state[2 * programs :]

    def fits(self, data_elements: int, dtype: torch.dtype, flag_stride: int) -> bool:
        return self.data.dtype == dtype and self.data.numel() >= data_elements and self.flag_stride >= flag_stride

    def free(self, context) -> None:
        context.free(self.data)
        context.free(self.state)


class FusedOps:
    """Fused matmul + communication of one context (``ctx.ops``). Every method is collective:
    all ranks call it in the same order with tensors of the same shapes."""

    def __init__(self, context):
        self._context = context
        self._buffers: dict[str, _Buffers] = {}
        self._side_stream = None

    # -- the operations -------------------------------------------------------------------------

    def all_gather_matmul(self, out: torch.Tensor, a_shard: torch.Tensor, b: torch.Tensor, *,
                          fused: bool | None = None) -> torch.Tensor:
        """``out`` (``world_size * m x N``) := ``all_gather(a_shard) @ b``: ``a_shard`` (``m x K``)
        is this rank's block of rows of ``A``, in rank order; ``b`` is ``K x N``."""
        ctx = self._context
        self._check("all_gather_matmul", out=out, a_shard=a_shard, b=b)
        m, K = a_shard.shape
        N = b.shape[1]
        self._check_shape("all_gather_matmul", "b", b, (K, N))
        self._check_shape("all_gather_matmul", "out", out, (ctx.world_size * m, N))
        if not self._fuse("all_gather_matmul", fused, flops=2 * ctx.world_size * m * N * K,
                          sent=(ctx.world_size - 1) * a_shard.numel() * a_shard.element_size()):
            gathered = torch.empty(ctx.world_size * m, K, dtype=a_shard.dtype, device=ctx.device)
            ctx.ccl.all_gather(gathered, a_shard.contiguous())
            return torch.matmul(gathered, b, out=out)
        config = GEMM_CONFIGS[ctx.device.type]
        block_m = config["BLOCK_M"]
        buffers = self._buffers_for("all_gather_matmul", 2 * ctx.world_size * m * K, a_shard.dtype,
                                    triton.cdiv(m, block_m))
        push_programs = min(PUSH_PROGRAMS[ctx.device.type], triton.cdiv(m, block_m))
        tiles = ctx.world_size * triton.cdiv(m, block_m) * triton.cdiv(N, config["BLOCK_N"])
        gemm_programs = max(1, min(buffers.programs - PUSH_PROGRAMS[ctx.device.type], tiles))
        common = dict(flags=buffers.flags, heap_bases=ctx.get_heap_bases(), capacity=buffers.programs,
                      flag_stride=buffers.flag_stride, RANK=ctx.rank, WORLD=ctx.world_size)
        with self._alongside():
            push_rows_kernel[(push_programs,)](
                a_shard, buffers.data, calls=buffers.push_calls, m=m, K=K, stride_sm=a_shard.stride(0),
                stride_sk=a_shard.stride(1), BLOCK_M=block_m, BLOCK_K=PUSH_BLOCK_K[ctx.device.type], **common)
        all_gather_matmul_kernel[(gemm_programs,)](
            buffers.data, b, out, calls=buffers.gemm_calls, failures=ctx.wait_failures, m=m, N=N, K=K,
            stride_bk=b.stride(0), stride_bn=b.stride(1), stride_om=out.stride(0), stride_on=out.stride(1),
            max_spins=ctx.max_spins, EVEN_K=K % config["BLOCK_K"] == 0, **common, **config)
        self._join()
        return out

    def matmul_reduce_scatter(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                              fused: bool | None = None) -> torch.Tensor:
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
        if not self._fuse("matmul_reduce_scatter", fused, flops=2 * M * N * K,
                          sent=(ctx.world_size - 1) * m * N * out.element_size()):
            return ctx.ccl.reduce_scatter(out, torch.matmul(a, b))
        config = GEMM_CONFIGS[ctx.device.type]
        tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
        buffers = self._buffers_for("matmul_reduce_scatter", 2 * ctx.world_size * m * N, out.dtype, tiles)
        matmul_reduce_scatter_kernel[(max(1, min(buffers.programs, tiles)),)](
            a, b, out, buffers.data, buffers.flags, buffers.gemm_calls, ctx.get_heap_bases(), ctx.wait_failures,
            buffers.programs, m, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
            out.stride(1), buffers.flag_stride, ctx.max_spins, RANK=ctx.rank, WORLD=ctx.world_size,
            EVEN_K=K % config["BLOCK_K"] == 0, **config)
        return out

    def matmul_all_reduce(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                          fused: bool | None = None) -> torch.Tensor:
        """``out`` (``M x N``) := ``a @ b`` summed over ranks (``all_reduce(a @ b)``). Fused, it is
        :meth:`matmul_reduce_scatter` into a heap buffer followed by ``ctx.ccl.all_gather``;
        when ``M`` is not divisible by the world size it runs sequentially."""
        ctx = self._context
        self._check("matmul_all_reduce", out=out, a=a, b=b)
        M, K = a.shape
        N = b.shape[1]
        self._check_shape("matmul_all_reduce", "b", b, (K, N))
        self._check_shape("matmul_all_reduce", "out", out, (M, N))
        divisible = M % ctx.world_size == 0
        if fused and not divisible:
            raise IrisError(f"matmul_all_reduce: fused=True needs M divisible by the world size {ctx.world_size}, "
                            f"got M={M}; pass fused=None to run it sequentially")
        sent = 2 * (ctx.world_size - 1) * (M // ctx.world_size) * N * out.element_size()
        if not divisible or not self._fuse("matmul_all_reduce", fused, flops=2 * M * N * K, sent=sent):
            return ctx.ccl.all_reduce(torch.matmul(a, b, out=out))
        mine = torch.empty(M // ctx.world_size, N, dtype=out.dtype, device=ctx.device)
        self.matmul_reduce_scatter(mine, a, b, fused=True)
        return ctx.ccl.all_gather(out, mine)

    # -- checks, decisions, buffers, streams ----------------------------------------------------

    def _check(self, name: str, **tensors: torch.Tensor) -> None:
        """Every tensor: a 2-D torch tensor on the context's device, bf16 or fp16, all of one
        dtype; ``out`` contiguous."""
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
            if tensor.dtype not in DTYPES:
                raise IrisError(f"{name}: {what} has dtype {tensor.dtype}; supported: torch.bfloat16, torch.float16")
            if dtype is not None and tensor.dtype != dtype:
                raise IrisError(f"{name}: {what} has dtype {tensor.dtype}, the others {dtype}; use one dtype")
            dtype = tensor.dtype
        if not tensors["out"].is_contiguous():
            raise IrisError(f"{name}: out is not contiguous; pass a contiguous tensor (e.g. torch.empty(...))")

    @staticmethod
    def _check_shape(name: str, what: str, tensor: torch.Tensor, shape: tuple) -> None:
        if tuple(tensor.shape) != shape:
            raise IrisError(f"{name}: {what} has shape {tuple(tensor.shape)}; expected {shape}")

    def _fuse(self, name: str, fused: bool | None, flops: int, sent: int) -> bool:
        """Whether to run ``name`` fused: as asked, else by the estimate (CPU ranks: always)."""
        if fused is not None:
            return bool(fused)
        ctx = self._context
        if ctx.device.type != "cuda":
            return True
        share = communication_share(flops, sent)
        if share < MIN_COMMUNICATION_SHARE:
            ctx.debug(f"{name}: sequential (estimated communication {share:.0%} of the product's time, under "
                      f"{MIN_COMMUNICATION_SHARE:.0%}: fusion would not pay)")
            return False
        return True

    def _buffers_for(self, name: str, data_elements: int, dtype: torch.dtype, flag_stride: int) -> _Buffers:
        """``name``'s buffers, (re)allocated collectively when they are too small."""
        buffers = self._buffers.get(name)
        if buffers is None or not buffers.fits(data_elements, dtype, flag_stride):
            ctx = self._context
            ctx.barrier()  # no kernel of any rank still uses the old buffers
            if buffers is not None:
                buffers.free(ctx)
            buffers = self._buffers[name] = _Buffers(ctx, data_elements, dtype, flag_stride)
            ctx.barrier()  # every rank's buffers exist, zeroed, before anyone writes into them
        return buffers

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
