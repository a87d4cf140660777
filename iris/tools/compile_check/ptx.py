"""What the PTX of iris's kernels must hold at every world size.

- Every acquire and release (flags, and atomics that order memory) is at system scope: a peer GPU
  observes only ordering made at system scope, and a flag released at GPU scope is never seen
  (the peer waits until it gives up). Relaxed atomics order nothing (a trace buffer's local
  event counter, say) and may have any scope.
- The collectives' copy loops (:func:`iris_triton.collectives.kernels.collective_kernel`) and the MoE
  kernels' row copies (:mod:`iris_triton.operations.moe_kernels`) move 16-byte vectors
  (``ld``/``st.global.v4.b32`` or ``.v2.b64``) where their segments (rows) are 16-element aligned,
  as local copies do: losing the vector width costs a large share of the link.

Instructions are the first token of a PTX line, without its predicate.
"""

from __future__ import annotations

import re

__all__ = ["VECTOR_KERNELS", "ptx_violations"]

_MEMORY = re.compile(r"^(?:@%?!?\w+\s+)?((?:ld|st|atom|red|fence|membar)\.[\w.]+)")
_ORDERED = ("acquire", "release", "acq_rel")
#: Kernels whose copy loops must move 16-byte vectors: the argument (elements per segment) that must
#: be specialized as 16-aligned for it, and the smallest world size at which the kernel copies
#: anything (combine's return copies only rows of other ranks).
VECTOR_KERNELS = {"collective_kernel": ("m", 1), "push_kernel": ("H", 1), "return_kernel": ("H", 2),
                  "reduce_kernel": ("H", 1)}
_VECTOR = re.compile(r"^(ld|st)\.(volatile\.)?global\.(v4\.b32|v2\.b64|v4\.b64)$")


def instructions(ptx: str) -> list[str]:
    """The memory instructions of ``ptx``, in order."""
    found = (_MEMORY.match(line.strip()) for line in ptx.splitlines())
    return [match.group(1) for match in found if match]


def ptx_violations(launch, ptx: str) -> list[str]:
    """What ``ptx`` (of ``launch``) breaks of the module's rules, as messages."""
    ops = instructions(ptx)
    problems = []
    unscoped = sorted({op for op in ops if set(op.split(".")) & set(_ORDERED) and "sys" not in op.split(".")})
    if unscoped:
        problems.append(f"PTX: acquire/release instructions not at system scope: {', '.join(unscoped)}")
    aligned, copies_from = VECTOR_KERNELS.get(launch.kernel.fn.__name__, (None, 0))
    if (aligned is not None and _aligned(launch, aligned) and _world(launch) >= copies_from
            and not any(_VECTOR.match(op) for op in ops)):
        problems.append(f"PTX: no 16-byte global load or store in the copy loop (its segments, {aligned}, are "
                        f"16-element aligned): {', '.join(sorted(set(ops)))}")
    return problems


def _world(launch) -> int:
    """The launch's ``WORLD`` constexpr (1 where it has none)."""
    names = launch.kernel.arg_names
    return next((value for path, value in launch.constexprs.items() if names[path[0]] == "WORLD"), 1)


def _aligned(launch, name: str) -> bool:
    """Whether the JIT specialized argument ``name`` of ``launch`` as a multiple of 16."""
    index = launch.kernel.arg_names.index(name)
    return ["tt.divisibility", 16] in launch.attrs.get((index,), [])
