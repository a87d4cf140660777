"""The context's tensor constructors against torch's, argument combination by argument combination.

Every result must be a plain ``torch.Tensor`` on the context's heap with torch's shape, dtype,
strides and values (random ones: the same values for the same generator seed). Where torch
refuses a combination, the context must refuse it with the same exception type and leave the heap
as it was. Device-generic: runs on the GPU when one is visible, else on CPU ranks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch

from iris.errors import HeapExhaustedError, IrisError, NotOnHeapError

pytestmark = pytest.mark.usefixtures("free_heap_after")

CONSTRUCTORS = ["empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like", "arange",
                "linspace", "rand", "randn", "randint", "uniform"]


FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ALL_DTYPES = FLOAT_DTYPES + [torch.int8, torch.int32, torch.int64, torch.bool, torch.complex64]

# Values made by the same torch op on the same device are identical; the tolerances are explicit
# and tight anyway (a dtype's worth of rounding), and exact for integers and random values.
TOLERANCES = {
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.complex64: dict(rtol=1e-6, atol=1e-6),
}
EXACT = dict(rtol=0, atol=0)

# Size forms: the arguments passed as-is to both torch and the context.
SIZE_FORMS = {
    "varargs": (2, 3, 5),
    "tuple": ((2, 3, 5),),
    "list": ([2, 3, 5],),
    "torch.Size": (torch.Size([2, 3, 5]),),
    "one int": (7,),
    "odd": (1, 17, 3),
    "scalar ()": ((),),
    "scalar []": ([],),
    "zero-size": (0,),
    "zero-size 3-d": (3, 0, 2),
    "zero-size tuple": ((4, 0),),
}
# The same shapes as one sequence, for full and randint (which take size as one argument).
SIZE_SEQUENCES = {
    "tuple": (2, 3, 5),
    "list": [2, 3, 5],
    "torch.Size": torch.Size([2, 3, 5]),
    "scalar ()": (),
    "zero-size": (3, 0),
    "odd": (17,),
}


# -- helpers ----------------------------------------------------------------------------------------


@pytest.fixture
def dev(ctx):
    return ctx.device


def gen(ctx, seed: int) -> torch.Generator:
    return torch.Generator(device=ctx.device).manual_seed(seed)


def assert_heap_tensor_like(ctx, got: Any, expected: torch.Tensor, *, values: bool = True, exact: bool = False):
    """``got`` is a plain heap tensor with ``expected``'s shape, dtype, strides, device (and values)."""
    assert type(got) is torch.Tensor
    assert ctx.is_symmetric(got), "result is not on the symmetric heap"
    assert got.device == ctx.device
    assert got.shape == expected.shape
    assert got.dtype == expected.dtype
    if got.numel() > 1:
        assert got.stride() == expected.stride()
    assert got.requires_grad == expected.requires_grad
    if values:
        tol = EXACT if exact else TOLERANCES.get(expected.dtype, EXACT)
        torch.testing.assert_close(got.detach(), expected.detach(), equal_nan=True, **tol)


def expect_like_torch(ctx, ours: Callable[[], Any], theirs: Callable[[], torch.Tensor], *,
                      values: bool = True, exact: bool = False):
    """Run torch's call, then ours: the same result, or the same exception type and no heap used."""
    used = ctx.heap.allocator.used_bytes
    try:
        expected = theirs()
    except Exception as exc:  # torch refuses this combination: so must the context
        # The context checks arguments on the meta device first, whose kernels report an
        # unsupported dtype as RuntimeError where CPU/CUDA kernels raise NotImplementedError (a
        # RuntimeError subclass); accept the base class there.
        expected_type = RuntimeError if isinstance(exc, NotImplementedError) else type(exc)
        with pytest.raises(expected_type):
            ours()
        assert ctx.heap.allocator.used_bytes == used, "a refused call leaked heap memory"
        return None
    got = ours()
    assert_heap_tensor_like(ctx, got, expected, values=values, exact=exact)
    return got


@contextlib.contextmanager
def default_dtype(dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def random_input(ctx, shape, dtype=torch.float32, seed=0):
    g = gen(ctx, seed)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, device=ctx.device).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, device=ctx.device).to(dtype)


# -- size forms -------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", SIZE_FORMS, ids=list(SIZE_FORMS))
@pytest.mark.parametrize("name", ["empty", "zeros", "ones"])
def test_size_forms_deterministic(ctx, dev, name, form):
    size = SIZE_FORMS[form]
    expect_like_torch(
        ctx,
        lambda: getattr(ctx, name)(*size),
        lambda: getattr(torch, name)(*size, device=dev),
        values=name != "empty",
    )


@pytest.mark.parametrize("form", SIZE_FORMS, ids=list(SIZE_FORMS))
@pytest.mark.parametrize("name", ["rand", "randn"])
def test_size_forms_random(ctx, dev, name, form):
    size = SIZE_FORMS[form]
    got = expect_like_torch(
        ctx,
        lambda: getattr(ctx, name)(*size, generator=gen(ctx, 7)),
        lambda: getattr(torch, name)(*size, generator=gen(ctx, 7), device=dev),
        exact=True,
    )
    assert got is not None


@pytest.mark.parametrize("form", SIZE_FORMS, ids=list(SIZE_FORMS))
def test_size_forms_uniform(ctx, dev, form):
    size = SIZE_FORMS[form]
    got = ctx.uniform(*size, low=-2.0, high=3.0, generator=gen(ctx, 3))
    expected = torch.empty(*size, device=dev).uniform_(-2.0, 3.0, generator=gen(ctx, 3))
    assert_heap_tensor_like(ctx, got, expected, exact=True)
    assert bool(((got >= -2.0) & (got < 3.0)).all())


@pytest.mark.parametrize("form", SIZE_SEQUENCES, ids=list(SIZE_SEQUENCES))
def test_size_sequences_full_and_randint(ctx, dev, form):
    size = SIZE_SEQUENCES[form]
    expect_like_torch(ctx, lambda: ctx.full(size, 2.5), lambda: torch.full(size, 2.5, device=dev))
    expect_like_torch(
        ctx,
        lambda: ctx.randint(-4, 9, size, generator=gen(ctx, 1)),
        lambda: torch.randint(-4, 9, size, generator=gen(ctx, 1), device=dev),
        exact=True,
    )


def test_no_size_is_type_error_like_torch(ctx):
    for name in ("empty", "zeros", "ones", "rand", "randn"):
        with pytest.raises(TypeError):
            getattr(torch, name)()
        with pytest.raises(TypeError):
            getattr(ctx, name)()


def test_sizes_that_torch_refuses_are_refused(ctx, dev):
    expect_like_torch(ctx, lambda: ctx.zeros(-1), lambda: torch.zeros(-1, device=dev))
    expect_like_torch(ctx, lambda: ctx.ones(2, "3"), lambda: torch.ones(2, "3", device=dev))
    expect_like_torch(ctx, lambda: ctx.empty(2.5), lambda: torch.empty(2.5, device=dev))


# -- dtypes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtypes_deterministic(ctx, dev, dtype):
    for name in ("zeros", "ones", "empty"):
        expect_like_torch(
            ctx,
            lambda: getattr(ctx, name)(3, 5, dtype=dtype),
            lambda: getattr(torch, name)(3, 5, dtype=dtype, device=dev),
            values=name != "empty",
        )
    for fill in (7, -3, 2.5, True):
        expect_like_torch(ctx, lambda: ctx.full((4, 3), fill, dtype=dtype),
                          lambda: torch.full((4, 3), fill, dtype=dtype, device=dev))
    expect_like_torch(ctx, lambda: ctx.full((4,), 1 + 2j, dtype=dtype),
                      lambda: torch.full((4,), 1 + 2j, dtype=dtype, device=dev))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtypes_random(ctx, dev, dtype):
    for name in ("rand", "randn"):
        expect_like_torch(
            ctx,
            lambda: getattr(ctx, name)(33, 5, dtype=dtype, generator=gen(ctx, 11)),
            lambda: getattr(torch, name)(33, 5, dtype=dtype, generator=gen(ctx, 11), device=dev),
            exact=True,
        )
    expect_like_torch(
        ctx,
        lambda: ctx.randint(0, 2 if dtype == torch.bool else 100, (33, 5), dtype=dtype, generator=gen(ctx, 12)),
        lambda: torch.randint(0, 2 if dtype == torch.bool else 100, (33, 5), dtype=dtype,
                              generator=gen(ctx, 12), device=dev),
        exact=True,
    )
    expect_like_torch(
        ctx,
        lambda: ctx.uniform(33, 5, low=-1.0, high=4.0, dtype=dtype, generator=gen(ctx, 13)),
        lambda: torch.empty(33, 5, dtype=dtype, device=dev).uniform_(-1.0, 4.0, generator=gen(ctx, 13)),
        exact=True,
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtypes_ranges(ctx, dev, dtype):
    expect_like_torch(ctx, lambda: ctx.arange(1, 40, 3, dtype=dtype),
                      lambda: torch.arange(1, 40, 3, dtype=dtype, device=dev))
    expect_like_torch(ctx, lambda: ctx.linspace(-3, 20, 13, dtype=dtype),
                      lambda: torch.linspace(-3, 20, 13, dtype=dtype, device=dev))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("like_dtype", [None, torch.float64, torch.int32], ids=["inherit", "f64", "i32"])
def test_dtypes_like(ctx, dev, dtype, like_dtype):
    x = random_input(ctx, (5, 3), dtype)
    for name in ("empty_like", "zeros_like", "ones_like"):
        expect_like_torch(
            ctx,
            lambda: getattr(ctx, name)(x, dtype=like_dtype),
            lambda: getattr(torch, name)(x, dtype=like_dtype),
            values=name != "empty_like",
        )
    for fill in (3, 2.5, True):
        expect_like_torch(ctx, lambda: ctx.full_like(x, fill, dtype=like_dtype),
                          lambda: torch.full_like(x, fill, dtype=like_dtype))


# -- dtype inference and defaults -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fill", "dtype"),
    [(7, torch.int64), (-2, torch.int64), (2.5, torch.float32), (True, torch.bool), (1 + 2j, torch.complex64)],
    ids=["int", "negative int", "float", "bool", "complex"],
)
def test_full_infers_dtype_from_fill_value(ctx, dev, fill, dtype):
    got = expect_like_torch(ctx, lambda: ctx.full((3, 4), fill), lambda: torch.full((3, 4), fill, device=dev))
    assert got.dtype == dtype
    assert bool((got == fill).all())


@pytest.mark.parametrize(
    ("args", "kwargs", "dtype"),
    [
        ((10,), {}, torch.int64),
        ((2, 11, 3), {}, torch.int64),
        ((10, 0, -3), {}, torch.int64),
        ((-5, 5), {}, torch.int64),
        ((0.0, 1.0, 0.1), {}, torch.float32),
        ((1, 2.5, 0.25), {}, torch.float32),
        ((4.0,), {}, torch.float32),
        ((), {"start": 1, "end": 9, "step": 2}, torch.int64),
        ((), {"end": 6}, torch.int64),
        ((), {"start": 0.5, "end": 3}, torch.float32),
    ],
    ids=["end", "start-end-step", "negative step", "negative start", "floats", "mixed", "float end",
         "keywords", "end keyword", "float start keyword"],
)
def test_arange_infers_dtype_like_torch(ctx, dev, args, kwargs, dtype):
    got = expect_like_torch(ctx, lambda: ctx.arange(*args, **kwargs), lambda: torch.arange(*args, **kwargs, device=dev))
    assert got.dtype == dtype


@pytest.mark.parametrize(
    ("args", "dtype"),
    [((0, 10, 7), None), ((-1, 1, 1), None), ((0, 1, 0), None), ((3, -3, 10), torch.float64),
     ((0, 10, 5), torch.int64), ((0, 1, 4), torch.complex64), ((0, 255, 17), torch.uint8)],
)
def test_linspace_like_torch(ctx, dev, args, dtype):
    got = expect_like_torch(ctx, lambda: ctx.linspace(*args, dtype=dtype),
                            lambda: torch.linspace(*args, dtype=dtype, device=dev))
    assert got.dtype == (dtype or torch.float32)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16, torch.bool, torch.complex64], ids=str)
def test_like_inherits_dtype_and_full_like_casts_fill(ctx, dtype):
    x = random_input(ctx, (6, 2), dtype)
    for name in ("empty_like", "zeros_like", "ones_like"):
        assert getattr(ctx, name)(x).dtype == dtype
    got = expect_like_torch(ctx, lambda: ctx.full_like(x, 2.75), lambda: torch.full_like(x, 2.75))
    assert got.dtype == dtype


def test_defaults_follow_torch_default_dtype(ctx, dev):
    for default in (torch.float32, torch.float64):
        with default_dtype(default):
            for ours, theirs in [
                (lambda: ctx.zeros(3), lambda: torch.zeros(3, device=dev)),
                (lambda: ctx.full((3,), 2.5), lambda: torch.full((3,), 2.5, device=dev)),
                (lambda: ctx.arange(0.0, 1.0, 0.25), lambda: torch.arange(0.0, 1.0, 0.25, device=dev)),
                (lambda: ctx.linspace(0, 1, 5), lambda: torch.linspace(0, 1, 5, device=dev)),
                (lambda: ctx.rand(3, generator=gen(ctx, 0)), lambda: torch.rand(3, generator=gen(ctx, 0), device=dev)),
                (lambda: ctx.uniform(3), lambda: torch.empty(3, device=dev)),
            ]:
                got = ours()
                assert got.dtype == theirs().dtype == default


def test_defaults_of_every_constructor(ctx, dev):
    x = random_input(ctx, (2, 3))
    cases = {
        "empty": (ctx.empty(4), torch.empty(4, device=dev)),
        "zeros": (ctx.zeros(4), torch.zeros(4, device=dev)),
        "ones": (ctx.ones(4), torch.ones(4, device=dev)),
        "empty_like": (ctx.empty_like(x), torch.empty_like(x)),
        "randint": (ctx.randint(5, (4,)), torch.randint(5, (4,), device=dev)),
        "rand": (ctx.rand(4), torch.rand(4, device=dev)),
        "randn": (ctx.randn(4), torch.randn(4, device=dev)),
        "uniform": (ctx.uniform(1000), torch.empty(1000, device=dev).uniform_()),
    }
    for name, (got, expected) in cases.items():
        assert_heap_tensor_like(ctx, got, expected, values=False)
        assert not got.requires_grad, name
    assert bool(((cases["uniform"][0] >= 0) & (cases["uniform"][0] < 1)).all())
    assert bool(((cases["randint"][0] >= 0) & (cases["randint"][0] < 5)).all())


# -- out= -------------------------------------------------------------------------------------------


OUT_CASES = {
    # name: (our call given out, torch's call given out, shape, dtype of out)
    "empty": (lambda c, o: c.empty(3, 5, out=o), lambda o: torch.empty(3, 5, out=o), (3, 5), torch.float32),
    "zeros": (lambda c, o: c.zeros(3, 5, out=o), lambda o: torch.zeros(3, 5, out=o), (3, 5), torch.float32),
    "ones": (lambda c, o: c.ones((3, 5), out=o), lambda o: torch.ones((3, 5), out=o), (3, 5), torch.float64),
    "full": (lambda c, o: c.full((3, 5), 4.5, out=o), lambda o: torch.full((3, 5), 4.5, out=o), (3, 5), torch.float32),
    "arange": (lambda c, o: c.arange(2, 17, out=o), lambda o: torch.arange(2, 17, out=o), (15,), torch.int64),
    "linspace": (lambda c, o: c.linspace(-1, 1, 9, out=o), lambda o: torch.linspace(-1, 1, 9, out=o), (9,),
                 torch.float32),
    "rand": (lambda c, o: c.rand(3, 5, out=o, generator=gen(c, 5)),
             lambda o: torch.rand(3, 5, out=o, generator=gen_like(o, 5)), (3, 5), torch.float32),
    "randn": (lambda c, o: c.randn(3, 5, out=o, generator=gen(c, 5)),
              lambda o: torch.randn(3, 5, out=o, generator=gen_like(o, 5)), (3, 5), torch.float16),
    "randint": (lambda c, o: c.randint(-9, 9, (3, 5), out=o, generator=gen(c, 5)),
                lambda o: torch.randint(-9, 9, (3, 5), out=o, generator=gen_like(o, 5)), (3, 5), torch.int64),
    "uniform": (lambda c, o: c.uniform(3, 5, low=2.0, high=3.0, out=o, generator=gen(c, 5)),
                lambda o: o.uniform_(2.0, 3.0, generator=gen_like(o, 5)), (3, 5), torch.float32),
}


def gen_like(t: torch.Tensor, seed: int) -> torch.Generator:
    return torch.Generator(device=t.device).manual_seed(seed)


@pytest.mark.parametrize("name", OUT_CASES)
def test_out_on_heap_is_filled_and_returned(ctx, dev, name):
    ours, theirs, shape, dtype = OUT_CASES[name]
    out = ctx.full(shape, 77, dtype=dtype)  # not what any constructor writes
    expected = theirs(torch.full(shape, 77, dtype=dtype, device=dev))
    offset = ctx.heap.offset_of(out)
    used = ctx.heap.allocator.used_bytes
    got = ours(ctx, out)
    assert got is out
    assert ctx.heap.allocator.used_bytes == used, "out= must not allocate"
    assert ctx.heap.offset_of(got) == offset
    assert_heap_tensor_like(ctx, got, expected, values=name != "empty", exact=True)


@pytest.mark.parametrize("name", OUT_CASES)
def test_out_not_on_heap_is_not_on_heap_error(ctx, dev, name):
    ours, _, shape, dtype = OUT_CASES[name]
    plain = torch.zeros(shape, dtype=dtype, device=dev)
    used = ctx.heap.allocator.used_bytes
    with pytest.raises(NotOnHeapError, match="symmetric heap"):
        ours(ctx, plain)
    assert ctx.heap.allocator.used_bytes == used
    assert bool((plain == 0).all()), "a refused out= was written"


@pytest.mark.parametrize("name", OUT_CASES)
def test_out_of_wrong_shape_is_runtime_error(ctx, name):
    ours, _, shape, dtype = OUT_CASES[name]
    wrong = ctx.zeros(shape[0] + 1, *shape[1:], dtype=dtype)
    used = ctx.heap.allocator.used_bytes
    with pytest.raises(RuntimeError, match="shape"):
        ours(ctx, wrong)
    assert wrong.shape[0] == shape[0] + 1, "a heap tensor was resized"
    assert ctx.heap.allocator.used_bytes == used


def test_out_takes_its_dtype_like_torch(ctx, dev):
    # Without dtype=, torch writes in out's dtype; with a different dtype= it refuses.
    cases = [
        (lambda o: ctx.zeros(4, out=o), lambda o: torch.zeros(4, out=o), torch.int32),
        (lambda o: ctx.full((4,), 2.5, out=o), lambda o: torch.full((4,), 2.5, out=o), torch.int64),
        (lambda o: ctx.arange(4, out=o), lambda o: torch.arange(4, out=o), torch.float64),
        (lambda o: ctx.linspace(0, 10, 4, out=o), lambda o: torch.linspace(0, 10, 4, out=o), torch.int32),
        (lambda o: ctx.randint(100, (4,), out=o, generator=gen(ctx, 2)),
         lambda o: torch.randint(100, (4,), out=o, generator=gen(ctx, 2)), torch.int16),
        (lambda o: ctx.rand(4, out=o, generator=gen(ctx, 2)),
         lambda o: torch.rand(4, out=o, generator=gen(ctx, 2)), torch.bfloat16),
    ]
    for ours, theirs, dtype in cases:
        got = ours(ctx.empty(4, dtype=dtype))
        assert_heap_tensor_like(ctx, got, theirs(torch.empty(4, dtype=dtype, device=dev)), exact=True)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.zeros(4, dtype=torch.float64, out=torch.empty(4, device=dev))
    with pytest.raises(RuntimeError, match="dtype"):
        ctx.zeros(4, dtype=torch.float64, out=ctx.empty(4))


def test_out_keeps_its_strides_like_torch(ctx, dev):
    out = ctx.empty(5, 4).t()
    expected = torch.arange(20.0, device=dev).reshape(4, 5)
    got = ctx.full((4, 5), 0.0, out=out)
    assert got is out and got.stride() == (1, 4)
    got.copy_(expected)
    got = ctx.rand(4, 5, out=out, generator=gen(ctx, 4))
    ref = torch.rand(4, 5, out=torch.empty(5, 4, device=dev).t(), generator=gen(ctx, 4))
    assert got.stride() == ref.stride()
    torch.testing.assert_close(got, ref, **EXACT)


def test_out_view_into_a_larger_heap_tensor(ctx, dev):
    big = ctx.zeros(10)
    got = ctx.arange(3, 7, dtype=torch.float32, out=big[2:6])
    torch.testing.assert_close(big, torch.tensor([0, 0, 3, 4, 5, 6, 0, 0, 0, 0.0], device=dev), **EXACT)
    assert got.data_ptr() == big[2:].data_ptr()


def test_empty_out_with_memory_format_is_refused_like_torch(ctx, dev):
    with pytest.raises(RuntimeError, match="memory_format"):
        torch.empty(2, 3, 4, 5, out=torch.empty(2, 3, 4, 5, device=dev), memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="memory_format"):
        ctx.empty(2, 3, 4, 5, out=ctx.empty(2, 3, 4, 5), memory_format=torch.channels_last)


def test_out_with_requires_grad(ctx):
    out = ctx.empty(3)
    got = ctx.ones(3, out=out, requires_grad=True)
    assert got is out and out.requires_grad and out.is_leaf


# -- requires_grad ----------------------------------------------------------------------------------


def _float_constructors(ctx, rg):
    x = random_input(ctx, (3, 4))
    return {
        "empty": lambda: ctx.empty(3, 4, requires_grad=rg),
        "zeros": lambda: ctx.zeros(3, 4, requires_grad=rg),
        "ones": lambda: ctx.ones(3, 4, requires_grad=rg),
        "full": lambda: ctx.full((3, 4), 1.5, requires_grad=rg),
        "empty_like": lambda: ctx.empty_like(x, requires_grad=rg),
        "zeros_like": lambda: ctx.zeros_like(x, requires_grad=rg),
        "ones_like": lambda: ctx.ones_like(x, requires_grad=rg),
        "full_like": lambda: ctx.full_like(x, 0.5, requires_grad=rg),
        "arange": lambda: ctx.arange(0.0, 12.0, requires_grad=rg),
        "linspace": lambda: ctx.linspace(0, 1, 12, requires_grad=rg),
        "rand": lambda: ctx.rand(3, 4, requires_grad=rg),
        "randn": lambda: ctx.randn(3, 4, requires_grad=rg),
        "uniform": lambda: ctx.uniform(3, 4, requires_grad=rg),
    }


@pytest.mark.parametrize("name", [n for n in CONSTRUCTORS if n != "randint"])
def test_requires_grad_on_float_makes_a_leaf_that_gets_gradients(ctx, name):
    t = _float_constructors(ctx, True)[name]()
    assert t.requires_grad and t.is_leaf and t.grad_fn is None
    assert ctx.is_symmetric(t)
    weights = torch.arange(t.numel(), dtype=t.dtype, device=t.device).reshape(t.shape)
    (t * weights).sum().backward()
    torch.testing.assert_close(t.grad, weights, **EXACT)
    assert not _float_constructors(ctx, False)[name]().requires_grad


INT_CALLS = {
    "empty": lambda c, d: c.empty(3, dtype=torch.int32, requires_grad=True, device=d),
    "zeros": lambda c, d: c.zeros(3, dtype=torch.int64, requires_grad=True, device=d),
    "ones": lambda c, d: c.ones(3, dtype=torch.int8, requires_grad=True, device=d),
    "full": lambda c, d: c.full((3,), 7, requires_grad=True, device=d),
    "zeros_like": lambda c, d: c.zeros_like(torch.ones(3, dtype=torch.int32, device=d), requires_grad=True),
    "full_like": lambda c, d: c.full_like(torch.ones(3, device=d), 1, dtype=torch.int32, requires_grad=True),
    "arange": lambda c, d: c.arange(5, requires_grad=True, device=d),
    "linspace": lambda c, d: c.linspace(0, 5, 3, dtype=torch.int32, requires_grad=True, device=d),
    "randint": lambda c, d: c.randint(5, (3,), requires_grad=True, device=d),
    "bool": lambda c, d: c.zeros(3, dtype=torch.bool, requires_grad=True, device=d),
}


@pytest.mark.parametrize("name", INT_CALLS)
def test_requires_grad_on_integers_is_runtime_error_like_torch(ctx, dev, name):
    call = INT_CALLS[name]
    with pytest.raises(RuntimeError, match="floating point"):
        call(torch, dev)
    used = ctx.heap.allocator.used_bytes
    with pytest.raises(RuntimeError, match="floating point"):
        call(ctx, dev)
    assert ctx.heap.allocator.used_bytes == used


def test_requires_grad_on_complex_works_like_torch(ctx, dev):
    got = ctx.zeros(3, dtype=torch.complex64, requires_grad=True)
    assert got.requires_grad and torch.zeros(3, dtype=torch.complex64, requires_grad=True).requires_grad


# -- memory_format ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "fmt"),
    [
        ((2, 3, 4, 5), torch.contiguous_format),
        ((2, 3, 4, 5), torch.channels_last),
        ((2, 3, 4, 5, 6), torch.channels_last_3d),
        ((1, 7, 1, 3), torch.channels_last),
        ((2, 3, 4), torch.channels_last),
        ((2, 3, 4, 5), torch.channels_last_3d),
        ((2, 3), torch.preserve_format),
    ],
    ids=["contiguous", "channels_last", "channels_last_3d", "channels_last odd", "channels_last 3-d",
         "channels_last_3d 4-d", "preserve"],
)
def test_empty_memory_format_like_torch(ctx, dev, shape, fmt):
    expect_like_torch(ctx, lambda: ctx.empty(*shape, memory_format=fmt),
                      lambda: torch.empty(*shape, memory_format=fmt, device=dev), values=False)


def _like_inputs(ctx):
    base4 = random_input(ctx, (2, 3, 4, 5), seed=1)
    base5 = random_input(ctx, (2, 3, 4, 5, 6), seed=2)
    return {
        "channels_last": base4.to(memory_format=torch.channels_last),
        "channels_last_3d": base5.to(memory_format=torch.channels_last_3d),
        "transposed": random_input(ctx, (6, 4), seed=3).t(),
        "permuted": base4.permute(2, 0, 3, 1),
        "strided slice": random_input(ctx, (5, 8), seed=4)[:, ::2],
        "expanded": random_input(ctx, (3, 1), seed=5).expand(3, 4),
        "contiguous": base4,
    }


LIKE_INPUTS = ["channels_last", "channels_last_3d", "transposed", "permuted", "strided slice", "expanded",
               "contiguous"]


@pytest.mark.parametrize("fmt", [torch.preserve_format, torch.contiguous_format, torch.channels_last],
                         ids=["preserve", "contiguous", "channels_last"])
@pytest.mark.parametrize("which", LIKE_INPUTS)
def test_like_memory_format_strides_like_torch(ctx, which, fmt):
    x = _like_inputs(ctx)[which]
    for name, extra in (("empty_like", ()), ("zeros_like", ()), ("ones_like", ()), ("full_like", (-1.25,))):
        expect_like_torch(
            ctx,
            lambda: getattr(ctx, name)(x, *extra, memory_format=fmt),
            lambda: getattr(torch, name)(x, *extra, memory_format=fmt),
            values=name != "empty_like",
        )


def test_preserve_format_keeps_channels_last_and_transposed_strides(ctx):
    inputs = _like_inputs(ctx)
    cl = ctx.zeros_like(inputs["channels_last"])
    assert cl.is_contiguous(memory_format=torch.channels_last) and not cl.is_contiguous()
    t = ctx.ones_like(inputs["transposed"])
    assert t.stride() == (1, 4) == inputs["transposed"].stride()


# -- generator --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1234, 2**40 + 7])
def test_same_seed_gives_torchs_values(ctx, dev, seed):
    shape = (129, 7)  # odd, not a multiple of any vector width
    pairs = {
        "rand": (ctx.rand(*shape, generator=gen(ctx, seed)), torch.rand(*shape, generator=gen(ctx, seed), device=dev)),
        "randn": (ctx.randn(shape, generator=gen(ctx, seed)), torch.randn(shape, generator=gen(ctx, seed), device=dev)),
        "randint": (ctx.randint(-1000, 1000, shape, generator=gen(ctx, seed)),
                    torch.randint(-1000, 1000, shape, generator=gen(ctx, seed), device=dev)),
        "randint high": (ctx.randint(7, shape, generator=gen(ctx, seed)),
                         torch.randint(7, shape, generator=gen(ctx, seed), device=dev)),
        "uniform": (ctx.uniform(*shape, low=-5.0, high=-1.0, generator=gen(ctx, seed)),
                    torch.empty(*shape, device=dev).uniform_(-5.0, -1.0, generator=gen(ctx, seed))),
    }
    for name, (got, expected) in pairs.items():
        assert_heap_tensor_like(ctx, got, expected, exact=True)
        assert got.unique().numel() > 5, f"{name}: values are not random"


def test_generator_state_advances_like_torch(ctx, dev):
    g_ours, g_ref = gen(ctx, 99), gen(ctx, 99)
    for _ in range(3):
        got = ctx.randn(50, generator=g_ours)
        expected = torch.randn(50, generator=g_ref, device=dev)
        torch.testing.assert_close(got, expected, **EXACT)
    assert not torch.equal(ctx.rand(50, generator=gen(ctx, 1)), ctx.rand(50, generator=gen(ctx, 2)))


def test_global_rng_is_used_without_generator(ctx, dev):
    torch.manual_seed(321)
    got = ctx.rand(64)
    torch.manual_seed(321)
    expected = torch.rand(64, device=dev)
    torch.testing.assert_close(got, expected, **EXACT)


def test_randint_keyword_forms_like_torch(ctx, dev):
    expect_like_torch(ctx, lambda: ctx.randint(low=3, high=9, size=(40,), generator=gen(ctx, 8)),
                      lambda: torch.randint(low=3, high=9, size=(40,), generator=gen(ctx, 8), device=dev), exact=True)
    expect_like_torch(ctx, lambda: ctx.randint(9, size=[40], generator=gen(ctx, 8)),
                      lambda: torch.randint(9, size=[40], generator=gen(ctx, 8), device=dev), exact=True)


def test_failing_fill_frees_its_block(ctx, dev):
    # The meta check passes, the fill fails: the block must go back to the heap.
    expect_like_torch(ctx, lambda: ctx.randint(5, 5, (10,)), lambda: torch.randint(5, 5, (10,), device=dev))
    expect_like_torch(ctx, lambda: ctx.rand(10, dtype=torch.int32),
                      lambda: torch.rand(10, dtype=torch.int32, device=dev))
    expect_like_torch(ctx, lambda: ctx.full((10,), 300, dtype=torch.int8),
                      lambda: torch.full((10,), 300, dtype=torch.int8, device=dev))


# -- device, layout, pin_memory ---------------------------------------------------------------------


def _all_calls(ctx, **kw):
    x = random_input(ctx, (2, 3))
    return {
        "empty": lambda: ctx.empty(2, 3, **kw),
        "zeros": lambda: ctx.zeros(2, 3, **kw),
        "ones": lambda: ctx.ones(2, 3, **kw),
        "full": lambda: ctx.full((2, 3), 1.0, **kw),
        "empty_like": lambda: ctx.empty_like(x, **kw),
        "zeros_like": lambda: ctx.zeros_like(x, **kw),
        "ones_like": lambda: ctx.ones_like(x, **kw),
        "full_like": lambda: ctx.full_like(x, 2.0, **kw),
        "arange": lambda: ctx.arange(6, **kw),
        "linspace": lambda: ctx.linspace(0, 1, 6, **kw),
        "rand": lambda: ctx.rand(2, 3, **kw),
        "randn": lambda: ctx.randn(2, 3, **kw),
        "randint": lambda: ctx.randint(0, 9, (2, 3), **kw),
        "uniform": lambda: ctx.uniform(2, 3, **kw),
    }


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_the_contexts_device_is_accepted(ctx, name):
    for device in (ctx.device, str(ctx.device), ctx.device.type):
        t = _all_calls(ctx, device=device)[name]()
        assert t.device == ctx.device and ctx.is_symmetric(t)


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_another_device_is_runtime_error_naming_the_contexts(ctx, name):
    others = ["meta", "cpu" if ctx.device.type == "cuda" else "cuda"]
    if ctx.device.type == "cuda":
        others.append(torch.device("cuda", ctx.device.index + 1))
    used = ctx.heap.allocator.used_bytes
    for other in others:
        with pytest.raises(RuntimeError) as info:
            _all_calls(ctx, device=other)[name]()
        assert str(ctx.device) in str(info.value)
    assert ctx.heap.allocator.used_bytes == used


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_layout(ctx, name):
    assert ctx.is_symmetric(_all_calls(ctx, layout=torch.strided)[name]())
    used = ctx.heap.allocator.used_bytes
    with pytest.raises(RuntimeError, match="layout"):
        _all_calls(ctx, layout=torch.sparse_coo)[name]()
    assert ctx.heap.allocator.used_bytes == used


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_pin_memory(ctx, name):
    # torch's constructors all take pin_memory; False is the default, True cannot apply to the heap.
    assert ctx.is_symmetric(_all_calls(ctx, pin_memory=False)[name]())
    used = ctx.heap.allocator.used_bytes
    with pytest.raises(RuntimeError, match="pin_memory"):
        _all_calls(ctx, pin_memory=True)[name]()
    assert ctx.heap.allocator.used_bytes == used


# -- as_symmetric, is_symmetric, free ---------------------------------------------------------------


@pytest.mark.parametrize("which", LIKE_INPUTS)
def test_as_symmetric_copies_like_empty_like(ctx, which):
    src = _like_inputs(ctx)[which]
    before = src.clone()
    copy = ctx.as_symmetric(src)
    assert_heap_tensor_like(ctx, copy, torch.empty_like(src).copy_(src), exact=True)
    copy.add_(1)
    torch.testing.assert_close(src, before, **EXACT)  # a copy, not an alias


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_as_symmetric_dtypes_and_scalars(ctx, dtype):
    for shape in ((), (0, 3), (37,)):
        src = random_input(ctx, shape, dtype, seed=9)
        copy = ctx.as_symmetric(src)
        assert_heap_tensor_like(ctx, copy, src, exact=True)


def test_as_symmetric_from_the_cpu_and_with_grad(ctx):
    src = torch.randn(4, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    copy = ctx.as_symmetric(src)
    assert copy.device == ctx.device and copy.requires_grad and copy.is_leaf
    torch.testing.assert_close(copy.detach().cpu(), src.detach(), **EXACT)
    with pytest.raises(TypeError):
        ctx.as_symmetric([1, 2, 3])


def test_is_symmetric(ctx, dev):
    t = ctx.randn(8, 8, generator=gen(ctx, 0))
    assert ctx.is_symmetric(t)
    assert ctx.is_symmetric(t[2:5, 1::3]) and ctx.is_symmetric(t.t()) and ctx.is_symmetric(t.view(-1))
    assert ctx.is_symmetric(ctx.zeros(0)) and ctx.is_symmetric(ctx.zeros(()))
    assert not ctx.is_symmetric(torch.randn(8, 8, device=dev))
    assert not ctx.is_symmetric(t.clone())
    assert not ctx.is_symmetric(torch.empty(0, device=dev))
    assert not ctx.is_symmetric(t.detach().to("meta"))
    assert not ctx.is_symmetric("not a tensor")
    assert not ctx.is_symmetric(t.tolist())


def test_heap_tensors_are_distinct_blocks(ctx):
    tensors = [ctx.full((n,), float(n)) for n in (1, 63, 64, 65, 1000, 0, 3)]
    for n, t in zip((1, 63, 64, 65, 1000, 0, 3), tensors):
        assert bool((t == n).all())  # no later allocation overwrote an earlier one
    spans = sorted((ctx.heap.offset_of(t), ctx.heap.offset_of(t) + max(t.numel(), 1) * 4) for t in tensors)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_free_then_reuse_the_same_offset(ctx):
    t = ctx.randn(1000, generator=gen(ctx, 1))
    offset = ctx.heap.offset_of(t)
    used = ctx.heap.allocator.used_bytes
    ctx.free(t)
    assert ctx.heap.allocator.used_bytes == used - 4096
    u = ctx.zeros(1000)
    assert ctx.heap.offset_of(u) == offset
    assert bool((u == 0).all())


def test_zero_size_tensors_can_be_freed(ctx):
    used = ctx.heap.allocator.used_bytes
    t = ctx.empty(0, 4)
    assert ctx.heap.allocator.used_bytes == used + 256
    ctx.free(t)
    assert ctx.heap.allocator.used_bytes == used


def test_free_of_a_view_is_value_error(ctx):
    t = ctx.zeros(4, 4)
    used = ctx.heap.allocator.used_bytes
    for view in (t[1:], t[:, 1], t[2, 3]):
        with pytest.raises(ValueError, match="not the start"):
            ctx.free(view)
    assert ctx.heap.allocator.used_bytes == used


def test_free_of_a_view_at_the_block_start_is_value_error(ctx):
    t = ctx.zeros(4, 4)
    with pytest.raises(ValueError):
        ctx.free(t[0])


def test_double_free_is_value_error(ctx):
    t = ctx.zeros(10)
    ctx.free(t)
    with pytest.raises(ValueError):
        ctx.free(t)


def test_free_of_a_tensor_not_on_the_heap_is_not_on_heap_error(ctx, dev):
    with pytest.raises(NotOnHeapError, match="as_symmetric"):
        ctx.free(torch.zeros(10, device=dev))
    with pytest.raises(ValueError):  # NotOnHeapError is also a ValueError
        ctx.free(torch.zeros(10, device=dev))


def test_peer_view_of_a_tensor_not_on_the_heap_is_not_on_heap_error(ctx, dev):
    with pytest.raises(NotOnHeapError, match=r"peer_view: the tensor \(shape \(10,\), torch.float32.*"
                                             r"ctx.as_symmetric\(t\)"):
        ctx.heap.peer_view(torch.zeros(10, device=dev), 0)


def test_peer_view_of_a_rank_outside_the_world_is_refused(ctx):
    t = ctx.zeros(10)
    with pytest.raises(IrisError, match=r"peer_view: rank 1 is not a rank of this context \(0\.\.0\)"):
        ctx.heap.peer_view(t, 1)
    with pytest.raises(IrisError, match=r"rank -1 is not a rank"):
        ctx.heap.peer_view(t, -1)  # not the last rank, as a Python index would make it
    ctx.free(t)


def test_heap_exhaustion_through_the_context(ctx):
    used = ctx.heap.allocator.used_bytes
    with pytest.raises(HeapExhaustedError) as info:
        ctx.empty(ctx.heap_size // 4 + 1)  # float32: just over the whole heap
    err = info.value
    assert isinstance(err, MemoryError)
    assert "heap_size" in str(err)
    assert err.requested == (ctx.heap_size // 4 + 1) * 4
    assert err.heap_size == ctx.heap_size
    with pytest.raises(HeapExhaustedError, match="heap_size"):
        ctx.randn(ctx.heap_size // 8, 3, generator=gen(ctx, 0))
    assert ctx.heap.allocator.used_bytes == used
    ctx.zeros(16)  # and the heap still works


# -- heap bases, device context, identity, broadcast -------------------------------------------------


def test_heap_bases(ctx):
    bases = ctx.get_heap_bases()
    assert bases.dtype == torch.int64 and bases.device == ctx.device
    assert bases.shape == (ctx.world_size,) == (1,)
    base = int(bases[0])
    assert base == ctx.heap.local.data_ptr() and base % 256 == 0
    t = ctx.zeros(100)
    assert base <= t.data_ptr() < base + ctx.heap_size
    assert ctx.heap_size == 64 << 20


def test_device_context_layout(ctx):
    dc = ctx.get_device_context()
    assert dc.dtype == torch.int64 and dc.device == ctx.device
    # Upstream iris's layout: rank, world size, the bases; then iris's own (the heap size, the trace
    # buffer's distance and capacity, 0 while tracing is off, the waits' timeout and fault words).
    fail_stop = [ctx.timeout_ns, ctx.faults.data_ptr(), ctx.host_faults.data_ptr()]
    assert dc.tolist() == [ctx.rank, ctx.world_size, *ctx.get_heap_bases().tolist(), ctx.heap_size, 0, 0, *fail_stop]
    assert dc.tolist() == [0, 1, ctx.heap.local.data_ptr(), ctx.heap_size, 0, 0, *fail_stop]
    assert ctx.get_heap_bases().data_ptr() == dc.data_ptr() + 2 * dc.element_size()


def test_identity(ctx):
    assert ctx.get_rank() == ctx.rank == 0
    assert ctx.get_num_ranks() == ctx.world_size == 1
    assert ctx.get_device() == ctx.device
    cus = ctx.get_cu_count()
    assert isinstance(cus, int) and cus > 0


def test_broadcast_object_in_a_world_of_one(ctx):
    value = {"a": [1, 2.5, "x"], "b": (None, True)}
    assert ctx.broadcast(value) == value
    assert ctx.broadcast(value, src=0) == value
    with pytest.raises(ValueError, match="src"):
        ctx.broadcast(value, src=1)


def test_broadcast_tensor_in_a_world_of_one(ctx, dev):
    t = ctx.randn(17, generator=gen(ctx, 4))
    expected = t.clone()
    result = ctx.broadcast(t)
    assert result is t
    torch.testing.assert_close(t, expected, **EXACT)
    plain = torch.arange(5, device=dev)
    torch.testing.assert_close(ctx.broadcast(plain), torch.arange(5, device=dev), **EXACT)


@pytest.mark.gpu
def test_on_a_gpu_the_heap_is_device_memory(ctx):
    assert ctx.device.type == "cuda"
    t = ctx.randn(1000, generator=gen(ctx, 0))
    assert t.is_cuda and ctx.is_symmetric(t)
    assert ctx.get_heap_bases().is_cuda and ctx.get_device_context().is_cuda
    assert ctx.get_cu_count() == torch.cuda.get_device_properties(ctx.device).multi_processor_count
