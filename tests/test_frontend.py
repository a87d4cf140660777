"""Front ends: the repeat that :meth:`Frontend.launch` returns runs the kernel again, as the
first launch did, with and without Triton's launch hooks (which profilers install)."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl


def _add_one(x, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs, mask=offs < n) + 1, mask=offs < n)


@pytest.mark.gpu
@pytest.mark.parametrize("hooked", [False, True], ids=["bare", "with_launch_hook"])
def test_a_launch_repeat_runs_the_kernel_again(hooked, monkeypatch):
    from triton import knobs

    from iris_triton.device.frontend import TRITON

    seen = []
    if hooked:  # a hook set before the first launch sees every repeat
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: seen.append(metadata))
    n = 1000  # ragged against the 4 x 256 grid
    x = torch.randint(-1000, 1000, (n,), dtype=torch.int32, device="cuda")
    expected = x + 3
    repeat = TRITON.launch(_add_one, (4,), x=x, n=n, BLOCK=256)
    assert repeat is not None
    repeat()
    repeat()
    torch.cuda.synchronize()
    assert torch.equal(x, expected)
    assert len(seen) == (3 if hooked else 0)
