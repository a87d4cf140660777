"""Two streams of work per context: the current stream and a second one beside it.

Algorithms that overlap transfers with other work (the copy-engine collectives and products)
enqueue the transfers on the context's second stream (``ctx.ccl.side_stream()``) and join it
back before they return, so the caller sees one stream and CUDA graph capture sees a fork and a
join. On CPU ranks there is one stream of work: everything runs in program order.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["alongside", "join"]


@contextlib.contextmanager
def alongside(context):
    """Work enqueued inside runs on ``context``'s second stream, after everything queued so far
    on the current one; :func:`join` makes the current stream wait for it."""
    side = context.ccl.side_stream()
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(context.device))
    with torch.cuda.stream(side):
        yield


def join(context) -> None:
    """Make the current stream wait for everything enqueued on ``context``'s second stream."""
    side = context.ccl.side_stream()
    if side is not None:
        torch.cuda.current_stream(context.device).wait_stream(side)
