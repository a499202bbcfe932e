"""Torch forms of the block statistics: the naive oracle and a memory-bounded fallback.

For one layer's q, k [B, H, N, D] and a list of candidate orders, the statistics of
P = softmax(q k^T * sm_scale) (rows over all N keys) grouped into (query block, key block) tiles of
the sequence *reordered* by each order:

    mass  [H, O, nq, nk]  sum of P inside the tile, summed over the batch
    pmax  [H, O, nq, nk]  max of P inside the tile, max over the batch
    below [H, O, nq, nk]  number of entries of P < eps inside the tile, summed over the batch

Every row of P sums to one, so `mass.sum((-1, -2)) == B * N` for every head and order: masses of
different heads, layers and steps are on one scale and can be ranked against each other.

`key_mask` ([B, N] bool over the original token positions, True = a real key; None: all real) drops
keys as the op's `suffix_mask` does (HunyuanVideo's padded text): the softmax runs over the real keys
alone, so a dropped key's entries hold no mass and count neither in the max nor below eps.

`block_stats_naive` materializes each head's N x N map and is the oracle of the Triton kernel in
`block_stats.py` (small shapes only). `block_stats_torch` gives the same numbers with memory bounded
by `query_chunk * N` floats; it is the CPU path and the fallback where Triton is unavailable.
"""

from __future__ import annotations

import math

import torch

from ..layout import TokenLayout, reorder_index


def _pad_to_blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad the last two dims of x up to (rows, cols)."""
    return torch.nn.functional.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def block_stats_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: TokenLayout,
    orders: list[int],
    block_size: int,
    eps: float = 1e-3,
    sm_scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition: full softmax map per (batch, head), permuted, cut into tiles. Small N only."""
    B, H, N, D = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    n_blocks = -(-N // block_size)
    padded = n_blocks * block_size
    O = len(orders)
    mass = torch.zeros(H, O, n_blocks, n_blocks, dtype=torch.float32, device=q.device)
    pmax = torch.zeros_like(mass)
    below = torch.zeros_like(mass)
    indices = [reorder_index(layout, o, device=q.device) for o in orders]
    for b in range(B):
        for h in range(H):
            keep = torch.ones(N, dtype=torch.bool, device=q.device) if key_mask is None else key_mask[b]
            scores = (q[b, h].float() @ k[b, h].float().T) * sm_scale
            p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
            for oi, index in enumerate(indices):
                pr = p[index][:, index]
                tiles = _pad_to_blocks(pr, padded, padded).view(n_blocks, block_size, n_blocks, block_size)
                small = _pad_to_blocks(((pr < eps) & keep[index]).float(), padded, padded)
                small = small.view(n_blocks, block_size, n_blocks, block_size)
                mass[h, oi] += tiles.sum(dim=(1, 3))
                pmax[h, oi] = torch.maximum(pmax[h, oi], tiles.amax(dim=(1, 3)))
                below[h, oi] += small.sum(dim=(1, 3))
    return mass, pmax, below


def row_logsumexp_torch(q: torch.Tensor, k: torch.Tensor, sm_scale: float, query_chunk: int = 1024,
                        key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, N] natural-log log-sum-exp of each row of q k^T * sm_scale over the keys `key_mask` keeps,
    in chunks of queries."""
    B, H, N, D = q.shape
    lse = torch.empty(B, H, N, dtype=torch.float32, device=q.device)
    for b in range(B):
        for h in range(H):
            kh = k[b, h].float()
            for start in range(0, N, query_chunk):
                scores = (q[b, h, start : start + query_chunk].float() @ kh.T) * sm_scale
                if key_mask is not None:
                    scores = scores.masked_fill(~key_mask[b], float("-inf"))
                lse[b, h, start : start + query_chunk] = torch.logsumexp(scores, dim=-1)
    return lse


def block_stats_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: TokenLayout,
    orders: list[int],
    block_size: int,
    eps: float = 1e-3,
    sm_scale: float | None = None,
    query_chunk: int = 1024,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same results as `block_stats_naive` with memory bounded by about 3 * query_chunk * N floats:
    pass 1 computes each row's log-sum-exp once (it does not depend on the order), pass 2 walks the
    reordered query blocks in chunks and reduces each chunk's rows of P into tiles."""
    B, H, N, D = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    n_blocks = -(-N // block_size)
    padded_cols = n_blocks * block_size
    rows_per_chunk = max(1, query_chunk // block_size) * block_size
    O = len(orders)
    mass = torch.zeros(H, O, n_blocks, n_blocks, dtype=torch.float32, device=q.device)
    pmax = torch.zeros_like(mass)
    below = torch.zeros_like(mass)
    lse = row_logsumexp_torch(q, k, sm_scale, query_chunk, key_mask)
    indices = [reorder_index(layout, o, device=q.device) for o in orders]
    for oi, index in enumerate(indices):
        for b in range(B):
            for h in range(H):
                qh = q[b, h].index_select(0, index).float()
                kh = k[b, h].index_select(0, index).float()
                lse_h = lse[b, h].index_select(0, index)
                keep = None if key_mask is None else key_mask[b].index_select(0, index)
                for start in range(0, N, rows_per_chunk):
                    stop = min(start + rows_per_chunk, N)
                    p = torch.exp((qh[start:stop] @ kh.T) * sm_scale - lse_h[start:stop, None])
                    if keep is None:
                        small = (p < eps).float()
                    else:
                        p = p.masked_fill(~keep, 0.0)
                        small = ((p < eps) & keep).float()
                    rows = -(-(stop - start) // block_size) * block_size
                    first = start // block_size
                    nb = rows // block_size
                    p = _pad_to_blocks(p, rows, padded_cols).view(nb, block_size, n_blocks, block_size)
                    small = _pad_to_blocks(small, rows, padded_cols).view(nb, block_size, n_blocks, block_size)
                    mass[h, oi, first : first + nb] += p.sum(dim=(1, 3))
                    pmax[h, oi, first : first + nb] = torch.maximum(pmax[h, oi, first : first + nb], p.amax(dim=(1, 3)))
                    below[h, oi, first : first + nb] += small.sum(dim=(1, 3))
    return mass, pmax, below


# -- sampled query rows ------------------------------------------------------------------------------------------
# A query block's mass is a sum over its rows, so a subset of its rows, scaled up, estimates it: with
# `query_stride` s, the rows r * s + phase of every block of the reordered sequence (r = 0 .. block_size / s - 1)
# stand for the block, and each block's sums are scaled by its rows over its sampled rows, so every query block
# still holds its rows' worth of mass. `phase` (0 .. s - 1) picks which rows; a caller that rotates it over its
# calls covers every row. The cost of the statistics falls by s.

def sampled_query_rows(seq_len: int, block_size: int, query_stride: int, phase: int, device=None):
    """(positions, block, scale): the sampled positions of the reordered sequence (long [M]), the query block of
    each (long [M]), and each query block's rows over its sampled rows (float [nb]; 0 for a last, partial block
    that no sampled row reaches)."""
    if not 0 <= phase < query_stride:
        raise ValueError(f"phase must be in [0, query_stride={query_stride}), got {phase}")
    nb = -(-seq_len // block_size)
    starts = torch.arange(nb, device=device) * block_size
    within = torch.arange(block_size // query_stride, device=device) * query_stride + phase
    positions = (starts[:, None] + within[None, :]).flatten()
    keep = positions < seq_len
    positions = positions[keep]
    block = positions // block_size
    rows = torch.clamp(seq_len - starts, max=block_size).float()
    sampled = torch.zeros(nb, device=device).index_add_(0, block, torch.ones_like(block, dtype=torch.float32))
    scale = torch.where(sampled > 0, rows / sampled.clamp_min(1), torch.zeros_like(rows))
    return positions, block, scale


def block_stats_sampled_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: TokenLayout,
    order_table: list[list[int]],
    block_size: int,
    query_stride: int,
    phase: int = 0,
    sm_scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    query_chunk: int = 1024,
) -> torch.Tensor:
    """mass [H, O, nq, nk] from the sampled query rows (see above), summed over the batch. `order_table[o][h]`:
    the order (index into ORDERS) of head h in output slot o, so slot o may hold a different order for each head."""
    B, H, N, D = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    n_blocks = -(-N // block_size)
    positions, block, scale = sampled_query_rows(N, block_size, query_stride, phase, device=q.device)
    mass = torch.zeros(H, len(order_table), n_blocks, n_blocks, dtype=torch.float32, device=q.device)
    indices: dict[int, torch.Tensor] = {}
    for oi, row in enumerate(order_table):
        for h in range(H):
            order = int(row[h])
            if order not in indices:
                indices[order] = reorder_index(layout, order, device=q.device)
            index = indices[order]
            rows = index[positions]  # original positions of the sampled queries
            kh_all = k[:, h].float()
            for b in range(B):
                for start in range(0, rows.numel(), query_chunk):
                    chunk = rows[start:start + query_chunk]
                    scores = (q[b, h, chunk].float() @ kh_all[b].T) * sm_scale
                    if key_mask is not None:
                        scores = scores.masked_fill(~key_mask[b], float("-inf"))
                    p = torch.softmax(scores, dim=-1)[:, index]  # key columns in the reordered sequence
                    p = torch.nn.functional.pad(p, (0, n_blocks * block_size - N))
                    per_key_block = p.view(p.shape[0], n_blocks, block_size).sum(-1)
                    mass[h, oi].index_add_(0, block[start:start + query_chunk], per_key_block)
    return mass * scale[None, None, :, None]
