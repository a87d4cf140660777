"""``iris tune`` on each rank: a context with a heap large enough for the tuned calls, the tuning
its options ask for, saved."""

from __future__ import annotations

from iris.config import DEFAULT_HEAP_SIZE
from iris.tuning.cache import cache_directory
from iris.tuning.cases import DEFAULT_SIZES, DEFAULT_TOKENS, _normalized_sizes
from iris.tuning.table import bucket, format_table


def tuning_heap_size(device: str, world: int, largest: int) -> int:
    """A heap that holds the workspaces of the largest tuned call (two slots of every rank's
    input, for each algorithm's workspace), and at least the default."""
    return max(DEFAULT_HEAP_SIZE[device], 8 * world * largest + (64 << 20))


def tune_on_rank(rank: int, options: dict) -> str | None:
    """One rank of ``iris tune``: a context, the tuning ``options`` ask for, saved; rank 0
    returns the table as text and where it was saved."""
    import iris

    device, world = options["device"], options["nprocs"]
    largest = max(_normalized_sizes(options["sizes"] or DEFAULT_SIZES[device]))
    if options["hidden"]:
        tokens = options["tokens"] or DEFAULT_TOKENS[device]
        largest = max(largest, 4 * bucket(max(tokens)) * options["hidden"])
    ctx = iris.create(heap_size=tuning_heap_size(device, world, largest))
    try:
        tuned = ctx.ccl.tune(options["collectives"], options["dtypes"], options["sizes"],
                             repeats=options["repeats"])
        if options["hidden"]:
            tuned = tuned.merged(ctx.ops.tune(options["hidden"], options["tokens"], options["dtypes"],
                                              repeats=options["repeats"]).entries)
        text = f"{format_table(tuned)}\n\nsaved in {cache_directory() / tuned.key.file_name}"
        ctx.barrier()
    finally:
        ctx.destroy()
    return text if rank == 0 else None
