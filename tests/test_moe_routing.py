"""The routing step of MoE dispatch on the device (iris_triton.operations.moe_routing) against a
plain Python walk of the pairs, on random routings with every kind of pair: routed, -1, a repeat
of an earlier slot's expert, and ids out of range."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from iris_triton.operations.moe_routing import ROUTE_BLOCK, final_positions, route_chunk, scan_chunks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _route_kernel(ids, positions, chunk_counts, T, E, K: tl.constexpr, K_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                  BLOCK_T: tl.constexpr):
    route_chunk(ids, positions, chunk_counts, tl.program_id(0), T, E, K, K_BLOCK, E_BLOCK, BLOCK_T)


@triton.jit
def _scan_kernel(chunk_counts, row, chunks, E, E_BLOCK: tl.constexpr):
    counts, outside = scan_chunks(chunk_counts, chunks, E, E_BLOCK)
    experts = tl.arange(0, E_BLOCK)
    tl.store(row + experts, counts, mask=experts < E)
    tl.store(row + E, outside)


@triton.jit
def _final_kernel(ids, positions, chunk_offsets, T, E, K: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                  TOKENS: tl.constexpr):
    final_positions(ids, positions, chunk_offsets, T, E, K, K_BLOCK, BLOCK_T, TOKENS)


def route(topk_ids: torch.Tensor, experts: int, programs: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The three steps as a dispatch runs them: every chunk routed, the chunks scanned, then the
    positions made final by ``programs`` programs (tokens strided over them, two a step)."""
    T, k = topk_ids.shape
    chunks = triton.cdiv(T, ROUTE_BLOCK)
    k_block, e_block = triton.next_power_of_2(k), triton.next_power_of_2(experts)
    positions = torch.empty(T, k, dtype=torch.int32, device=topk_ids.device)
    chunk_counts = torch.empty(chunks, experts + 1, dtype=torch.int32, device=topk_ids.device)
    row = torch.empty(experts + 1, dtype=torch.int32, device=topk_ids.device)
    _route_kernel[(chunks,)](topk_ids, positions, chunk_counts, T, experts, K=k, K_BLOCK=k_block, E_BLOCK=e_block,
                             BLOCK_T=ROUTE_BLOCK)
    _scan_kernel[(1,)](chunk_counts, row, chunks, experts, E_BLOCK=e_block)
    _final_kernel[(programs,)](topk_ids, positions, chunk_counts, T, experts, K=k, K_BLOCK=k_block,
                               BLOCK_T=ROUTE_BLOCK, TOKENS=2)
    return positions, row


def _reference(ids: torch.Tensor, experts: int) -> tuple[list[list[int]], list[int]]:
    counts = [0] * experts
    positions = []
    for token in ids.tolist():
        row = []
        for j, e in enumerate(token):
            if 0 <= e < experts and e not in token[:j]:
                row.append(counts[e])
                counts[e] += 1
            else:
                row.append(-1)
        positions.append(row)
    outside = int(any(e < -1 or e >= experts for token in ids.tolist() for e in token))
    return positions, counts + [outside]


def _routing(tokens: int, topk: int, experts: int, seed: int, dtype, outside: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, experts, (tokens, topk), generator=g)
    repeat = torch.rand(tokens, topk, generator=g) < 0.2  # a slot naming the expert of the slot before
    ids[:, 1:] = torch.where(repeat[:, 1:], ids[:, :-1], ids[:, 1:])
    if outside:
        ids[tokens // 2, topk - 1] = experts + 3
    return ids.to(dtype)


@pytest.mark.parametrize("tokens, topk, experts", [(1, 1, 1), (5, 2, 8), (ROUTE_BLOCK + 7, 8, 64), (70, 3, 6),
                                                   (3 * ROUTE_BLOCK, 4, 12)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_positions_and_counts_match_a_walk_of_the_pairs(tokens, topk, experts, dtype):
    ids = _routing(tokens, topk, experts, seed=tokens * topk + experts, dtype=dtype, outside=False)
    positions, row = route(ids.to(DEVICE), experts)
    expected_positions, expected_row = _reference(ids, experts)
    assert positions.cpu().tolist() == expected_positions
    assert row.cpu().tolist() == expected_row


def test_an_id_out_of_range_sends_nothing_and_is_flagged():
    ids = _routing(40, 4, 16, seed=1, dtype=torch.int64, outside=True)
    positions, row = route(ids.to(DEVICE), 16)
    expected_positions, expected_row = _reference(ids, 16)
    assert expected_row[-1] == 1 and row.cpu().tolist() == expected_row
    assert positions.cpu().tolist() == expected_positions and positions[20, 3].item() == -1


def test_more_chunks_than_one_step_of_the_scan_takes():
    """70 chunks of tokens: the scan of their counts takes more than one step (SCAN_BLOCK)."""
    ids = _routing(70 * ROUTE_BLOCK + 5, 2, 5, seed=7, dtype=torch.int64, outside=False)
    positions, row = route(ids.to(DEVICE), 5)
    expected_positions, expected_row = _reference(ids, 5)
    assert positions.cpu().tolist() == expected_positions
    assert row.cpu().tolist() == expected_row
