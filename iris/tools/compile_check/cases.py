"""The calls a compile-only context makes: every kernel launch the host side can choose.

The calls come from the library's declarations, so a new algorithm, launch shape, method or tile
is covered without touching this module:

- every collective's registered algorithms (:func:`iris.collectives.algorithm_registry`, plugins
  included) that apply at the world size, each with each of its GPU launch shapes
  (:attr:`iris.collectives.Algorithm.launch_shapes`) and with its own choice, and the automatic
  choice; with each dtype and reduction it takes; rooted ones with this rank as the root and with
  another;
- the uneven all-to-alls, send and recv (to the next rank, from the previous one);
- every method of ``ctx.ops``'s products (:meth:`method_names`: the fused tiles included), with
  an even and an uneven ``K``, all_reduce_rmsnorm by each of its methods, with and without
  ``residual_out``; MoE dispatch and combine, with and without fp8;
- the device barrier, and the backend's own kernels that no public call launches
  (``DeviceOps._compile_check_calls``: tile collectives inside a kernel, clocks, the demo).

A context's calls are *focused* or *full*: every context makes the focused calls (each
algorithm, method and root, one dtype and reduction); the full calls add every launch shape, tile,
dtype and reduction each takes, and odd sizes, on the contexts :func:`contexts_checked` marks full.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
import torch

from iris.collectives import (COLLECTIVES, MOVED_ONLY_DTYPES, POINT_TO_POINT, REDUCE_OPS, REDUCIBLE_DTYPES, REDUCING,
                              ROOT_ONLY, SUPPORTED_DTYPES, UNEVEN, algorithm_registry)

__all__ = ["Call", "Checked", "calls", "contexts_checked", "ranks_checked"]

#: One call of a context: what it is (for the report), and the call.
Call = tuple[str, Callable[[], object]]

#: The collectives of ``ctx.ccl`` with one tensor per side, by how their tensors are shaped.
EVEN_COLLECTIVES = tuple(c for c in COLLECTIVES if c not in UNEVEN + POINT_TO_POINT)
#: Ranks up to this world size are each checked; above it, the first and last.
EVERY_RANK_UP_TO = 4
#: The element type of the focused calls (the one large models move most).
FOCUS_DTYPE = torch.bfloat16
#: Elements per rank of the collectives' calls: a multiple of 16 (Triton's alignment
#: specialization) per rank, and, in the full calls, an odd one.
EVEN_ELEMENTS, ODD_ELEMENTS = 1024, 257


@attrs.frozen
class Checked:
    """One compile-only context the check makes calls on."""

    backend: str
    world_size: int
    rank: int
    full: bool
    """Whether it makes the full calls (every dtype, reduction, launch shape, tile), not only the
    focused ones."""
    tracing: bool


def contexts_checked(backends: tuple[str, ...], worlds: tuple[int, ...], ranks: tuple[int, ...] | None = None,
                     full: bool = True) -> list[Checked]:
    """The contexts the check makes calls on. The first backend's (every kernel of iris): in each
    world the ranks of :func:`ranks_checked` (or those of ``ranks`` the world has); its first
    such rank makes the full calls in the smallest world of 3 ranks or more (unless not
    ``full``), and in the largest world the focused calls again with device-side tracing on. A
    kernel's code grows with the world (its loops over peers are unrolled), and so its compile
    time: the full calls' dtypes and shapes are crossed with the world where that costs least
    beyond the two-rank case, while every world compiles each algorithm and method (the focused
    calls). The other backends compile the same kernel sources
    with another front end, whose rank-dependent branches the first backend's contexts cover: their
    first and last rank in the smallest world of 3 ranks or more (the first with a rank that is
    neither first nor last), and their first in the largest, of those checked."""
    larger = [w for w in worlds if w >= 3] or [max(worlds)]
    largest, smallest_larger = max(worlds), min(larger)
    checked = []
    for world in worlds:
        chosen = ranks_checked(world) if ranks is None else [r for r in sorted(set(ranks)) if r < world]
        for rank in chosen:
            checked.append(Checked(backends[0], world, rank, full and world == smallest_larger and rank == chosen[0],
                                   False))
            ends = (chosen[0], chosen[-1]) if world == smallest_larger else (chosen[0],) if world == largest else ()
            if rank in ends:
                checked += [Checked(backend, world, rank, False, False) for backend in backends[1:]]
        if world == largest and chosen:
            checked.append(Checked(backends[0], world, chosen[0], False, True))
    return checked


def ranks_checked(world_size: int) -> list[int]:
    """The ranks of a world that are checked by default: every rank up to :data:`EVERY_RANK_UP_TO`
    ranks, else the first and the last (which differ from it in every rank-dependent branch)."""
    return list(range(world_size)) if world_size <= EVERY_RANK_UP_TO else [0, world_size - 1]


def calls(ctx, full: bool) -> Iterator[Call]:
    """Every call ``ctx`` makes (see the module)."""
    yield from _collective_calls(ctx, full)
    yield from _uneven_calls(ctx, full)
    yield from _point_to_point_calls(ctx, full)
    yield from _operation_calls(ctx, full)
    yield "device_barrier()", ctx.device_barrier
    yield from ctx._compile_check_calls(full)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- collectives ----------------------------------------------------------------------------------


def _variants(collective: str, full: bool) -> Iterator[tuple[torch.dtype, str | None, int]]:
    """(dtype, op, elements per rank) of the calls of ``collective``: the focused one, then (full)
    every other dtype, every other reduction and an odd size."""
    reducing = collective in REDUCING
    yield FOCUS_DTYPE, "sum" if reducing else None, EVEN_ELEMENTS
    if not full:
        return
    yield FOCUS_DTYPE, "sum" if reducing else None, ODD_ELEMENTS
    for dtype in REDUCIBLE_DTYPES if reducing else SUPPORTED_DTYPES:
        if dtype is not FOCUS_DTYPE:
            yield dtype, "sum" if reducing else None, EVEN_ELEMENTS
    if reducing:
        for op in REDUCE_OPS:
            if op != "sum":
                yield torch.float32, op, EVEN_ELEMENTS


def _collective_calls(ctx, full: bool) -> Iterator[Call]:
    """Each collective by the automatic choice and by each algorithm that applies, rooted ones
    with this rank as the root and with another (what a kernel's branches on its root tell
    apart); full: also each launch shape, dtype, reduction and an odd size (root 0)."""
    for collective in EVEN_COLLECTIVES:
        rooted = collective in ROOT_ONLY or collective == "broadcast"
        registry = algorithm_registry(collective)
        for index, (dtype, op, elements) in enumerate(_variants(collective, full)):
            # The input of the call (:func:`_collective`): a rank's part, or world parts of it.
            count = elements if collective in ("all_gather", "gather") else elements * ctx.world_size
            choices: list[tuple[str | None, list[int]]] = [(None, [0])]
            for name in ctx.ccl.algorithms(collective, applying_to=torch.empty(count, dtype=dtype), op=op):
                algorithm = registry.get(name)
                if index == 0:  # the focused call: this rank as the root, and another rank
                    choices.append((name, sorted({ctx.rank, (ctx.rank + 1) % ctx.world_size}) if rooted else [0]))
                    if full:
                        shapes = algorithm.launch_shapes.get(ctx.kernel_device_type, {})
                        choices += [(f"{name}/{shape}", [0]) for shape in shapes]
                else:
                    choices.append((name, [0]))
            for algorithm, roots in choices:
                for root in roots:
                    what = (f"ccl.{collective}({elements * ctx.world_size} x {_name(dtype)}"
                            + (f", op={op}" if op else "") + (f", root={root}" if rooted else "")
                            + f", algorithm={algorithm})")
                    yield what, _collective(ctx, collective, dtype, op, elements, root, algorithm)


def _collective(ctx, collective: str, dtype: torch.dtype, op: str | None, elements: int, root: int,
                algorithm: str | None) -> Callable[[], object]:
    """The call of ``collective`` on ``elements`` per rank (its input is ``world x elements``)."""
    world, rank = ctx.world_size, ctx.rank

    def call():
        whole = ctx.zeros(world * elements, dtype=dtype)
        part = ctx.zeros(elements, dtype=dtype)
        ccl = ctx.ccl
        if collective == "all_reduce":
            return ccl.all_reduce(whole, op=op, algorithm=algorithm)
        if collective == "all_gather":
            return ccl.all_gather(whole, part, algorithm=algorithm)
        if collective == "reduce_scatter":
            return ccl.reduce_scatter(part, whole, op=op, algorithm=algorithm)
        if collective == "all_to_all":
            return ccl.all_to_all(ctx.zeros(world * elements, dtype=dtype), whole, algorithm=algorithm)
        if collective == "broadcast":
            return ccl.broadcast(whole, src=root, algorithm=algorithm)
        if collective == "reduce":
            return ccl.reduce(whole, dst=root, op=op, algorithm=algorithm)
        if collective == "gather":
            return ccl.gather(whole if rank == root else None, part, dst=root, algorithm=algorithm)
        return ccl.scatter(part, whole if rank == root else None, src=root, algorithm=algorithm)

    return call


def _uneven_calls(ctx, full: bool) -> Iterator[Call]:
    world, rank = ctx.world_size, ctx.rank
    for dtype in (FOCUS_DTYPE, torch.float32) + MOVED_ONLY_DTYPES[:1] if full else (FOCUS_DTYPE,):
        name = _name(dtype)
        sends = [1 + (rank + q) % 3 for q in range(world)]  # rows to each rank
        receives = [1 + (q + rank) % 3 for q in range(world)]  # rank q sends 1 + (q + rank) % 3 here

        def single(dtype=dtype, sends=sends, receives=receives):
            source = ctx.zeros(sum(sends), 16, dtype=dtype)
            return ctx.ccl.all_to_all_single(ctx.zeros(sum(receives), 16, dtype=dtype), source, receives, sends)

        def vdev(dtype=dtype, sends=sends):
            source = ctx.zeros(sum(sends), 16, dtype=dtype)
            splits = torch.tensor(sends, dtype=torch.int64, device=ctx.device)
            return ctx.ccl.all_to_all_vdev(ctx.zeros(3 * world, 16, dtype=dtype), source, splits,
                                           torch.zeros(world, dtype=torch.int64, device=ctx.device))

        yield f"ccl.all_to_all_single({name})", single
        yield f"ccl.all_to_all_vdev({name})", vdev


def _point_to_point_calls(ctx, full: bool) -> Iterator[Call]:
    world, rank = ctx.world_size, ctx.rank
    if world == 1:
        return
    for dtype in (FOCUS_DTYPE, torch.float32) if full else (FOCUS_DTYPE,):
        name = _name(dtype)
        yield (f"ccl.send({name}, dst={(rank + 1) % world})",
               lambda dtype=dtype: ctx.ccl.send(ctx.zeros(1000, dtype=dtype), (rank + 1) % world))
        yield (f"ccl.recv({name}, src={(rank - 1) % world})",
               lambda dtype=dtype: ctx.ccl.recv(ctx.zeros(1000, dtype=dtype), (rank - 1) % world))


# -- operations -----------------------------------------------------------------------------------

#: The products' extents: rows of A per rank, N, and an even and an uneven K. Rows of the even K
#: are whole 16-byte units, which the fused kernels read by tensor descriptors; those of the uneven
#: one are not (the plain loop).
ROWS, N, EVEN_K, UNEVEN_K = 64, 128, 256, 196
#: Products of these dtypes: the focused one, and the others in the full calls.
PRODUCT_DTYPES = (FOCUS_DTYPE, torch.float16, torch.float32)


def _operation_calls(ctx, full: bool) -> Iterator[Call]:
    """Each product by each method (the fused one with its built-in tile), all_reduce_rmsnorm by
    each method, MoE; full: also every fused tile, an uneven K, the other dtypes, a column-major
    ``b`` of matmul_reduce_scatter (matmul_all_reduce's is row-major), rmsnorm with
    ``residual_out``, fp8 MoE."""
    ops = ctx.ops
    for dtype in PRODUCT_DTYPES if full else PRODUCT_DTYPES[:1]:
        focused = dtype is FOCUS_DTYPE
        if dtype is torch.float32:
            methods = ("sequential",)  # the only method float32 takes
        else:
            methods = tuple(m for m in ops.method_names() if full and focused or "/" not in m)
        for method in methods:
            for k in (EVEN_K, UNEVEN_K) if full and focused else (EVEN_K,):
                for product in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                                "matmul_all_gather"):
                    if product == "matmul_all_gather" and method != "sequential":
                        continue  # it runs sequentially only
                    column_major = full and product == "matmul_reduce_scatter"
                    yield (f"ops.{product}({_name(dtype)}, K={k}, method={method}"
                           f"{', b column-major' if column_major else ''})",
                           _product(ctx, product, dtype, k, method, column_major))
        for method in ops.method_names("all_reduce_rmsnorm"):
            for residual_out in (False, True) if full and focused else (False,):
                yield (f"ops.all_reduce_rmsnorm({_name(dtype)}, method={method}, residual_out={residual_out})",
                       _rmsnorm(ctx, dtype, method, residual_out))
    for fp8 in (False, True) if full else (False,):
        yield f"ops.moe_dispatch / moe_combine(fp8={fp8})", _moe(ctx, fp8)


def _product(ctx, product: str, dtype: torch.dtype, k: int, method: str,
             column_major: bool = False) -> Callable[[], object]:
    world = ctx.world_size

    def call():
        b = ctx.zeros(N, k, dtype=dtype).t() if column_major else ctx.zeros(k, N, dtype=dtype)
        if product in ("all_gather_matmul", "matmul_all_gather"):
            return getattr(ctx.ops, product)(ctx.zeros(world * ROWS, N, dtype=dtype), ctx.zeros(ROWS, k, dtype=dtype),
                                             b, method=method)
        if product == "matmul_reduce_scatter":
            return ctx.ops.matmul_reduce_scatter(ctx.zeros(ROWS, N, dtype=dtype),
                                                 ctx.zeros(world * ROWS, k, dtype=dtype), b, method=method)
        return ctx.ops.matmul_all_reduce(ctx.zeros(world * ROWS, N, dtype=dtype),
                                         ctx.zeros(world * ROWS, k, dtype=dtype), b, method=method)

    return call


def _rmsnorm(ctx, dtype: torch.dtype, method: str, residual_out: bool) -> Callable[[], object]:
    tokens, hidden = 8, 4096

    def call():
        x, residual = ctx.zeros(tokens, hidden, dtype=dtype), ctx.zeros(tokens, hidden, dtype=dtype)
        out = ctx.zeros(tokens, hidden, dtype=dtype)
        kept = ctx.zeros(tokens, hidden, dtype=dtype) if residual_out else None
        return ctx.ops.all_reduce_rmsnorm(out, x, residual, ctx.zeros(hidden, dtype=dtype), residual_out=kept,
                                          method=method)

    return call


def _moe(ctx, fp8: bool) -> Callable[[], object]:
    tokens, hidden, experts, top_k = 16, 7168, 4 * ctx.world_size, 2  # a hidden size of large MoE models

    def call():
        x = ctx.zeros(tokens, hidden, dtype=FOCUS_DTYPE)
        ids = torch.arange(tokens * top_k, device=ctx.device).view(tokens, top_k) % experts
        weights = torch.full((tokens, top_k), 1 / top_k, device=ctx.device)
        dispatched = ctx.ops.moe_dispatch(x, ids, weights, experts, fp8=fp8)
        return ctx.ops.moe_combine(torch.zeros_like(dispatched.tokens, dtype=FOCUS_DTYPE), dispatched)

    return call
