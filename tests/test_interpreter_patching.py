"""Triton's interpreter with iris's patch-once (iris_triton.device.interpreter_patching): a launch
walks ``triton.language`` the same number of times however many device functions its kernel
calls, computes what it computed before, and leaves ``triton.language`` as it found it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.errors import InterpreterError

import iris_triton.device.functions  # noqa: F401 - installs the patch-once, as importing iris's backend does
from iris_triton.device.compiled import INTERPRETING

pytestmark = pytest.mark.skipif(not INTERPRETING, reason="about Triton's interpreter (TRITON_INTERPRET=1)")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _twice_plus_one(x):
    return _twice(x) + 1


@triton.jit
def _nested_calls(src, dst, n, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(src + offsets, mask=offsets < n)
    for _ in tl.static_range(CALLS):
        x = _twice_plus_one(x) - x  # x + 1, through two device-function calls
    tl.store(dst + offsets, x, mask=offsets < n)


def _walks_of_one_launch(monkeypatch, calls: int) -> int:
    walks = []
    walk = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: walks.append(1) or walk(*args))
    src = torch.randn(100)
    dst = torch.empty(100)
    _nested_calls[(1,)](src, dst, 100, CALLS=calls, BLOCK=128)
    monkeypatch.undo()
    torch.testing.assert_close(dst, src + calls)
    return len(walks)


def test_device_function_calls_do_not_walk_the_language_again(monkeypatch):
    assert getattr(interpreter._patch_lang, "patches_once", False)
    one, many = _walks_of_one_launch(monkeypatch, 1), _walks_of_one_launch(monkeypatch, 20)
    assert one == many > 0, (one, many)


def test_a_launch_leaves_the_language_as_it_found_it(monkeypatch):
    before = {name: getattr(tl, name) for name in ("load", "store", "arange", "static_range")}
    _walks_of_one_launch(monkeypatch, 3)
    assert {name: getattr(tl, name) for name in before} == before
    assert tl.core.is_builtin(tl.load)


def test_a_failed_launch_ends_its_patches_too(monkeypatch):
    # A kernel that raises mid-launch still undoes its patches, and the next launch patches afresh.
    with pytest.raises(InterpreterError, match="power of 2"):
        _nested_calls[(1,)](torch.randn(4), torch.empty(4), 4, CALLS=2, BLOCK=3)
    assert tl.core.is_builtin(tl.load)
    assert _walks_of_one_launch(monkeypatch, 2) > 0
