"""Every measured choice of the Triton backend, in one place: launch shapes, the sizes up to which
the automatic choice takes each all_reduce algorithm, the fused operations' tiles and their method
estimate. (What each algorithm can take, its hard limits and its priority among the others, are
declared with the algorithm.)

Each table is keyed by device type (``"cuda"``, ``"cpu"``) where it differs between GPUs and CPU
ranks. The GPU values were measured on 2 x H200 over NVLink; each comment names the benchmark and
the result it came from (``benchmarks/NOTES.md`` says how they were run, ``NOTES-archive.md`` has
the sweeps). The CPU values only keep Triton's interpreter fast (it runs programs one after
another); they are not measurements. Other GPUs, world sizes and links have not been measured:
there the GPU values are a starting point, not a tuning.

The automatic choices of the collectives' algorithms and of ``all_reduce_rmsnorm``'s method take a
machine's own tuning first (``iris tune``, :mod:`iris.tuning`, ``docs/tuning.md``): these tables
are the fallback where it has no entry for a call. So are the launch shapes and the fused GEMM's
tile, which the tuner times by name (``COLLECTIVE_LAUNCH_SHAPES``, ``GEMM_TILES``).
"""

from __future__ import annotations

__all__ = [
    "ALL_REDUCE_CHOSEN_UP_TO",
    "ALL_REDUCE_RMSNORM_ONE_SHOT_UP_TO",
    "COLLECTIVE_LAUNCH_SHAPES",
    "COLLECTIVE_SHAPES",
    "COPY_ENGINE_MIN_SHARE",
    "COMPILE_ONLY_PROGRAMS",
    "CPU_PROGRAMS",
    "GEMM_FLOPS_PER_SECOND",
    "GEMM_SHAPES",
    "GEMM_TILES",
    "LINK_BYTES_PER_SECOND",
    "LOW_LATENCY_SHAPES",
    "PUSH_BLOCK_K",
    "PUSH_PROGRAMS",
    "MOE_SHAPES",
    "RMSNORM_SHAPES",
    "SENTINEL_SHAPES",
    "collective_shape",
]

#: Programs (thread blocks) per collective kernel on CPU ranks (on GPUs: one per multiprocessor).
CPU_PROGRAMS = 2
#: Programs per collective kernel of a compile-only context (:mod:`iris.tools.compile_check`), which
#: has no GPU to count multiprocessors on: an H100's or H200's 132.
COMPILE_ONLY_PROGRAMS = 132

# -- collectives (iris_triton.collectives.kernels) --------------------------------------------------------------------

#: Launch shapes of the collective kernel by the call's input bytes per rank: the first entry whose
#: limit (None: any size) holds it. A shape is elements per block, blocks per round (unrolled),
#: most rounds per program and call, and warps. From the sweeps of ``benchmarks/ccl_configs.py``
#: (NOTES-archive.md), checked in ``results/ccl-triton-2026-11-30-v17.json``.
COLLECTIVE_SHAPES = {
    "cuda": ((16 << 20, dict(BLOCK=4096, ROUND=4, SYNCS=8, num_warps=8)),
             (64 << 20, dict(BLOCK=8192, ROUND=2, SYNCS=16, num_warps=16)),
             (None, dict(BLOCK=8192, ROUND=1, SYNCS=32, num_warps=16))),
    "cpu": ((None, dict(BLOCK=64, ROUND=2, SYNCS=2)),),
}

#: Launch shape of the low-latency all_reduce: 64-bit words per block (a power of two, at least 4)
#: and warps. From ``benchmarks/ccl_configs.py --all-reduce low_latency`` (NOTES-archive.md).
LOW_LATENCY_SHAPES = {"cuda": dict(BLOCK=256, num_warps=4), "cpu": dict(BLOCK=64)}

#: Launch shape of the sentinel all_reduce: elements per block (even), blocks a program pushes
#: ahead of the one it reduces, and warps. From ``benchmarks/ccl_configs.py --all-reduce sentinel``
#: (NOTES-archive.md, v15).
SENTINEL_SHAPES = {"cuda": dict(BLOCK=2048, LAG=1, num_warps=8), "cpu": dict(BLOCK=64, LAG=1)}

#: For the automatic choice of an all_reduce algorithm: the most bytes per rank each is chosen
#: for, by world size (``None``: the other world sizes; a missing algorithm has no limit). Of the
#: algorithms within their limit, the one of highest priority runs (low_latency, then sentinel,
#: then one_shot, then two_shot). From ``results/ccl-triton-2026-11-30-v17.json`` and the v16 run
#: (NOTES-archive.md) on 2 ranks; 3 ranks and more are untuned guesses, and take no sentinel.
ALL_REDUCE_CHOSEN_UP_TO = {
    "low_latency": {2: 256 << 10, None: 64 << 10},
    "sentinel": {2: 8 << 20, None: 0},
    "one_shot": {2: 8 << 20, 3: 1 << 20, None: 256 << 10},
}


#: For the automatic method of ``ctx.ops.all_reduce_rmsnorm`` (:mod:`iris_triton.operations.rmsnorm`): the
#: most bytes of ``x`` per rank that take ``"one_shot"`` (one exchange, every rank receiving every
#: peer's whole input), by world size (``None``: the other sizes); larger inputs take
#: ``"two_shot"`` (two exchanges, each rank receiving about twice its share). It is the trade-off
#: of all_reduce's one_shot against two_shot (one exchange's latency against moving
#: ``world_size - 1`` copies of the input), so it starts from their limits above; the fused
#: operation's own crossover has not been measured (``benchmarks/all_reduce_rmsnorm.py`` does).
ALL_REDUCE_RMSNORM_ONE_SHOT_UP_TO = dict(ALL_REDUCE_CHOSEN_UP_TO["one_shot"])

#: Launch shape of ``all_reduce_rmsnorm``: the most elements of a row one chunk holds (a row is
#: one program's; longer rows are done in chunks), and on GPUs the warps, one per
#: ``ELEMENTS_PER_WARP`` elements of a chunk (a 16-byte vector per thread), at most ``MAX_WARPS``.
#: A starting point, not a measurement: a chunk of 8192 holds a whole row of the common hidden sizes.
#: The CPU chunk is small so that tests reach rows of several chunks.
RMSNORM_SHAPES = {"cuda": dict(MAX_BLOCK=8192, MAX_WARPS=16, ELEMENTS_PER_WARP=256), "cpu": dict(MAX_BLOCK=64)}

#: Launch shape of the MoE kernels (:mod:`iris_triton.operations.moe_kernels`): the most elements of a
#: token's row one step moves (``MAX_BLOCK``; a whole row of the common hidden sizes), programs per
#: multiprocessor (``PER_UNIT``) and warps. A row copy is bound by the bytes each program has in
#: flight (one step's loads, issued together, before its stores): with a whole 16-bit row of 7168 per
#: step and two programs per multiprocessor, 132 multiprocessors keep about 3.7 MB in flight, what
#: HBM's rate times its latency asks for. A starting point from that estimate, not a measurement.
#: The CPU block is small so that tests reach rows of several steps.
MOE_SHAPES = {"cuda": dict(MAX_BLOCK=8192, PER_UNIT=2, num_warps=8), "cpu": dict(MAX_BLOCK=64, PER_UNIT=1)}


def collective_shape(device_type: str, nbytes: int, name: str | None = None) -> dict:
    """The launch shape of a call moving ``nbytes`` per rank: the one named (of
    :data:`COLLECTIVE_LAUNCH_SHAPES`, a tuned or requested shape), else :data:`COLLECTIVE_SHAPES`'s
    for its size."""
    if name is not None:
        return dict(COLLECTIVE_LAUNCH_SHAPES[device_type][name])
    return next(shape for limit, shape in COLLECTIVE_SHAPES[device_type] if limit is None or nbytes <= limit)


def _shape_name(shape: dict) -> str:
    return f"{shape['BLOCK']}x{shape['ROUND']}x{shape['SYNCS']}" + (f"w{shape['num_warps']}" if "num_warps" in shape
                                                                     else "")


#: The launch shapes of :data:`COLLECTIVE_SHAPES` by name (``BLOCKxROUNDxSYNCS`` and warps), by
#: device type: the candidates the tuner times for the algorithms of the collective kernel, and
#: what ``algorithm="two_shot/8192x2x16w16"`` names.
COLLECTIVE_LAUNCH_SHAPES = {device: {_shape_name(shape): shape for _, shape in shapes}
                            for device, shapes in COLLECTIVE_SHAPES.items()}


# -- fused operations (iris_triton.operations.fused_ops, iris_triton.operations.fused) ------------------------------

#: Tile shape and launch options of the fused kernels' matrix product. The GPU tile is from
#: ``benchmarks/fused.py`` (``results/fused-2026-11-30-v7.json``); the CPU one is the smallest
#: ``tl.dot`` accepts.
GEMM_SHAPES = {
    "cuda": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "cpu": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2),
}


def _tile_name(shape: dict) -> str:
    return f"{shape['BLOCK_M']}x{shape['BLOCK_N']}x{shape['BLOCK_K']}"


#: The fused kernels' tiles by name (``BLOCK_MxBLOCK_NxBLOCK_K``), by device type: the built-in
#: one and the alternatives the tuner times as ``method="fused/<tile>"`` (:mod:`iris.tuning`).
#: 128x128x64 with 5 stages is for few rows: its 4 tiles per 128x256 one fill a last wave better,
#: and 5 stages run them faster there than 4 (``benchmarks/gemm.py``; ``results/gemm-h100-2026-12-07-tiles.json``).
#: The CPU ones only give the interpreter a choice.
GEMM_TILES = {device: {_tile_name(shape): shape for shape in shapes} for device, shapes in {
    "cuda": (GEMM_SHAPES["cuda"], dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5),
             dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
    "cpu": (GEMM_SHAPES["cpu"], dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2)),
}.items()}

#: Programs of the kernel that pushes rows of A to the peers (fused all_gather_matmul; the GEMM
#: gets the remaining multiprocessors, so both kernels always run at once), and its K step.
PUSH_PROGRAMS = {"cuda": 8, "cpu": 1}
PUSH_BLOCK_K = {"cuda": 128, "cpu": 16}

#: The automatic method of ``ctx.ops`` on GPUs overlaps with the copy engines when the
#: communication's estimated time is at least this share of the product's, else runs the
#: product and the collective in sequence (``results/fused-2026-11-30-v7.json``).
COPY_ENGINE_MIN_SHARE = 0.02
#: The estimate's rates: bf16 tensor-core product and link bandwidth on H200
#: (``results/fused-2026-11-30-v7.json``, ``results/rma_bandwidth-triton-2026-11-30-run7.png``).
GEMM_FLOPS_PER_SECOND = 700e12
LINK_BYTES_PER_SECOND = 365e9
