"""Front ends: the repeat that :meth:`Frontend.launch` returns runs the kernel again, as the
first launch did, on the stream it is handed, with and without Triton's launch hooks (which profilers install); a
:class:`LaunchCache` runs each call with that call's arguments."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl


def _add_one(x, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs, mask=offs < n) + 1, mask=offs < n)


@pytest.mark.gpu
@pytest.mark.parametrize("hooked", [False, True], ids=["bare", "with_launch_hook"])
def test_a_launch_repeat_runs_the_kernel_again(hooked, monkeypatch):
    from triton import knobs

    from iris_triton.device.frontend import TRITON, current_stream

    seen = []
    if hooked:  # a hook set before the first launch sees every repeat
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: seen.append(metadata))
    n = 1000  # ragged against the 4 x 256 grid
    x = torch.randint(-1000, 1000, (n,), dtype=torch.int32, device="cuda")
    expected = x + 3
    repeat = TRITON.launch(_add_one, (4,), x=x, n=n, BLOCK=256)
    assert repeat is not None
    repeat(current_stream())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    repeat(side.cuda_stream)  # on the stream it is handed
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(x, expected)
    assert len(seen) == (3 if hooked else 0)


@triton.jit
def _scaled_copy(src, dst, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n) * scale, mask=offs < n)


def test_a_launch_cache_runs_every_call_with_its_own_arguments():
    """Each call's tensors and values reach the kernel, cached launch or not: new tensors, a view
    whose address is not a multiple of 16 (which Triton compiles otherwise), another length."""
    from iris_triton.device.compiled import INTERPRETING
    from iris_triton.device.frontend import LaunchCache

    device = "cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda"
    cache = LaunchCache(_scaled_copy)
    g = torch.Generator(device).manual_seed(0)
    for n, offset, scale in [(1000, 0, 2.0), (1000, 0, -3.0), (999, 1, 0.5), (333, 0, 4.0), (999, 1, 1.5)]:
        src = torch.randn(n + offset, generator=g, device=device)[offset:]
        dst = torch.zeros(n + offset, device=device)[offset:]
        cache.launch((triton.cdiv(n, 256),), src, dst, n, scale, BLOCK=256)
        assert torch.equal(dst.cpu(), (src * scale).cpu()), (n, offset, scale)
    if device == "cuda":  # aligned and unaligned addresses, n a multiple of 16 or not: compiled apart
        assert len(cache._compiled) >= 2
