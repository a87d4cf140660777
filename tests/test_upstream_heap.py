"""Upstream iris's heap surface: ``ctx.heap.allocate(n, dtype)`` and the heap's queries, its
allocator's (``owns_tensor``, ``get_base_address``), ``iris.allocators`` and
``iris.tensor_creation``'s free constructors, against the context's own tensors and torch.

Single rank, in process (the session ``ctx``), on the GPU when one is visible, else on the CPU.
"""

from __future__ import annotations


import pytest
import torch

import iris.allocators as allocators
import iris.tensor_creation as tc
from iris.errors import IrisError
from iris.testing import seeded_generator

pytestmark = pytest.mark.usefixtures("free_heap_after")




@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("count", [0, 1, 6, 1000])
def test_heap_allocate_gives_a_flat_tensor_on_the_heap_at_an_aligned_offset(ctx, dtype, count):
    ctx.heap.allocate(3, torch.uint8)  # so that the next block is not at offset 0 by chance
    tensor = ctx.heap.allocate(count, dtype)
    assert tensor.shape == (count,) and tensor.dtype == dtype and tensor.device == ctx.device
    assert ctx.is_symmetric(tensor) and ctx.heap.is_symmetric(tensor) and ctx.heap.on_symmetric_heap(tensor)
    assert ctx.heap.offset_of(tensor) % 1024 == 0
    assert ctx.heap.offset_of(ctx.heap.allocate(5, dtype, alignment=4096)) % 4096 == 0
    values = torch.randn(count, generator=seeded_generator("heap.allocate", count)).to(dtype)
    tensor.copy_(values.to(ctx.device))
    assert torch.equal(tensor.cpu(), values)
    ctx.free(tensor)  # a block of its own, which the context takes back


def test_a_heap_allocation_serves_as_out_of_the_constructors(ctx):
    out = ctx.heap.allocate(6, torch.float32)
    result = ctx.zeros(2, 3, out=out)
    assert result.data_ptr() == out.data_ptr() and result.shape == (2, 3) and not result.any()
    with pytest.raises(RuntimeError, match="The output tensor has 4 elements, but 6 are required"):
        ctx.ones(2, 3, out=ctx.heap.allocate(4, torch.float32))
    with pytest.raises(RuntimeError, match="The output tensor has dtype torch.int32, but torch.float32 is required"):
        ctx.ones(2, 3, dtype=torch.float32, out=ctx.heap.allocate(6, torch.int32))


@pytest.mark.parametrize("bad", [(-1, torch.float32), (2.0, torch.float32), (True, torch.float32), (4, "float32")])
def test_heap_allocate_refuses_bad_arguments(ctx, bad):
    with pytest.raises((ValueError, TypeError), match="heap.allocate"):
        ctx.heap.allocate(*bad)


def test_the_heap_answers_upstreams_queries(ctx):
    heap = ctx.heap
    assert heap.heap_size == ctx.heap_size and heap.cur_rank == ctx.rank and heap.num_ranks == ctx.world_size
    assert heap.get_device() == ctx.device and heap.device_id == ctx.device.index
    assert torch.equal(heap.get_heap_bases(), ctx.get_heap_bases())
    assert heap.refresh_peer_access() is None
    plain = torch.ones(4, device=ctx.device)
    copy = heap.as_symmetric(plain)
    assert ctx.is_symmetric(copy) and torch.equal(copy, plain) and not heap.is_symmetric(plain)


def test_the_allocator_knows_where_the_heap_is(ctx):
    allocator = ctx.heap.allocator
    assert isinstance(allocator, allocators.TorchAllocator) and isinstance(allocator, allocators.BaseAllocator)
    assert allocator.get_base_address() == ctx.heap.local.data_ptr() == int(ctx.get_heap_bases()[ctx.rank])
    assert allocator.get_device() == ctx.device
    on_heap = ctx.zeros(10)
    assert allocator.owns_tensor(on_heap) and allocator.owns_tensor(on_heap[9:])
    assert not allocator.owns_tensor(torch.zeros(10, device=ctx.device))
    assert allocator.owns_tensor(torch.zeros(0, device=ctx.device))
    tiny = ctx.heap.allocate(1, torch.uint8, alignment=1)
    assert allocator.block_size(ctx.heap.offset_of(tiny)) == allocator.get_minimum_allocation_size() > 0


@pytest.mark.parametrize("name, args, torch_call", [
    ("zeros", ((2, 3),), lambda: torch.zeros(2, 3)),
    ("ones", ([4],), lambda: torch.ones(4)),
    ("full", ((2, 2), 7.5), lambda: torch.full((2, 2), 7.5)),
    ("empty", ((3,),), None),
    ("arange", (2, 11, 3), lambda: torch.arange(2, 11, 3)),
    ("linspace", (0.0, 1.0, 5), lambda: torch.linspace(0.0, 1.0, 5)),
])
def test_tensor_creation_matches_torch(ctx, name, args, torch_call):
    made = getattr(tc, name)(ctx.heap, ctx.device, *args)
    assert ctx.is_symmetric(made)
    if torch_call is not None:
        assert torch.equal(made.cpu(), torch_call())


def test_tensor_creation_random_and_like(ctx):
    generator = torch.Generator(device=ctx.device).manual_seed(5)
    drawn = tc.randn(ctx.heap, ctx.device, (3, 4), generator=generator)
    assert torch.equal(drawn, torch.randn(3, 4, generator=torch.Generator(device=ctx.device).manual_seed(5),
                                          device=ctx.device))
    ints = tc.randint(ctx.heap, ctx.device, 0, 5, (100,), dtype=torch.int32)
    assert ints.dtype == torch.int32 and 0 <= int(ints.min()) and int(ints.max()) < 5
    uniform = tc.uniform(ctx.heap, ctx.device, (50,), -2.0, -1.0)
    assert ctx.is_symmetric(uniform) and bool(((uniform >= -2.0) & (uniform < -1.0)).all())
    like = tc.zeros_like(ctx.heap, ctx.device, ctx.ones(2, 5, dtype=torch.float16))
    assert like.shape == (2, 5) and like.dtype == torch.float16 and not like.any() and ctx.is_symmetric(like)
    assert ctx.is_symmetric(tc.rand(ctx.heap, ctx.device, (2,))) and ctx.is_symmetric(tc.allocate(ctx.heap, 3,
                                                                                                   torch.float32))


def test_tensor_creation_checks_as_upstream(ctx):
    assert tc.parse_size(((2, 3),)) == ((2, 3), 6) and tc.parse_size((4, 5)) == ((4, 5), 20)
    assert tc.is_valid_device(None, ctx.device) and tc.is_valid_device(ctx.device.type, ctx.device)
    assert tc.is_valid_device(str(ctx.device), ctx.device) and not tc.is_valid_device("meta", ctx.device)
    with pytest.raises(RuntimeError, match="Device mismatch: requested device meta"):
        tc.zeros(ctx.heap, ctx.device, (2,), device="meta")
    with pytest.raises(RuntimeError, match="The output tensor has 4 elements, but 6 are required"):
        tc.throw_if_invalid_output_tensor(ctx.heap, ctx.zeros(4), 6, torch.float32)
    with pytest.raises(RuntimeError, match="The output tensor has dtype torch.int32, but torch.float32 is required"):
        tc.throw_if_invalid_output_tensor(ctx.heap, ctx.zeros(6, dtype=torch.int32), 6, torch.float32)
    with pytest.raises(RuntimeError, match="The output tensor is not on the symmetric heap"):
        tc.throw_if_invalid_output_tensor(ctx.heap, torch.zeros(6, device=ctx.device), 6, torch.float32)
    with pytest.raises(ValueError, match="torch.strided"):
        tc.apply_layout(ctx.zeros(2), torch.sparse_coo)
    with pytest.raises(TypeError, match="ctx.heap"):
        tc.zeros(object(), ctx.device, (2,))


def test_apply_memory_format_keeps_the_values_on_the_heap(ctx):
    values = torch.randn(2, 3, 4, 5, generator=seeded_generator("memory format"))
    tensor = ctx.as_symmetric(values.to(ctx.device))
    channels_last = tc.apply_memory_format(ctx.heap, tensor, (2, 3, 4, 5), torch.channels_last)
    assert channels_last.is_contiguous(memory_format=torch.channels_last) and ctx.is_symmetric(channels_last)
    assert torch.equal(channels_last.cpu(), values)
    assert tc.apply_memory_format(ctx.heap, tensor, (2, 3, 4, 5), torch.contiguous_format) is tensor


def test_a_heap_without_its_context_says_so(ctx, monkeypatch):
    monkeypatch.setattr(ctx.heap, "owner", None)  # as destroy() leaves it
    with pytest.raises(IrisError, match="belongs to no context"):
        ctx.heap.allocate(4, torch.float32)
    with pytest.raises(IrisError, match="belongs to no context"):
        tc.zeros(ctx.heap, ctx.device, (2,))
