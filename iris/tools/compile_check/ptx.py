"""What the PTX of iris's kernels must hold at every world size.

- Every acquire and release (flags, and atomics that order memory) is at system scope: a peer GPU
  observes only ordering made at system scope, and a flag released at GPU scope is never seen
  (the peer waits until it gives up). Relaxed atomics order nothing (a trace buffer's local
  event counter, say) and may have any scope.
- The collectives' copy loops (:func:`iris_triton.collectives.kernels.collective_kernel`) move 16-byte vectors
  (``ld``/``st.global.v4.b32`` or ``.v2.b64``) where their segments are 16-element aligned, as local
  copies do: losing the vector width costs a large share of the link.

Instructions are the first token of a PTX line, without its predicate.
"""

from __future__ import annotations

import re

__all__ = ["VECTOR_KERNELS", "ptx_violations"]

_MEMORY = re.compile(r"^(?:@%?!?\w+\s+)?((?:ld|st|atom|red|fence|membar)\.[\w.]+)")
_ORDERED = ("acquire", "release", "acq_rel")
#: Kernels whose copy loops must move 16-byte vectors, with the argument (elements per segment)
#: that must be specialized as 16-aligned for it.
VECTOR_KERNELS = {"collective_kernel": "m"}
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
    aligned = VECTOR_KERNELS.get(launch.kernel.fn.__name__)
    if aligned is not None and _aligned(launch, aligned) and not any(_VECTOR.match(op) for op in ops):
        problems.append(f"PTX: no 16-byte global load or store in the copy loop (its segments, {aligned}, are "
                        f"16-element aligned): {', '.join(sorted(set(ops)))}")
    return problems


def _aligned(launch, name: str) -> bool:
    """Whether the JIT specialized argument ``name`` of ``launch`` as a multiple of 16."""
    index = launch.kernel.arg_names.index(name)
    return ["tt.divisibility", 16] in launch.attrs.get((index,), [])
