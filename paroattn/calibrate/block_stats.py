"""Block statistics of softmax(q k^T) for every candidate order, without materializing the map.

Two Triton passes per layer (the torch reference beside it: `block_stats_reference.py`):

  pass 1  `_row_lse_kernel`     each query row's log-sum-exp over all N keys (base 2; over the real
                                ones when a key mask drops padded text). It does not
                                depend on the order, so it runs once per (batch, head).
  pass 2  `_block_stats_kernel` one program per (reordered query block, head, order): walks every
                                key block of the reordered sequence and reduces its tile of
                                P = exp2(s - lse) to three numbers: sum, max, count below eps.
                                The batch is summed inside the program.

With sampled query rows (`query_stride` s > 1, the cheap capture) one kernel does both:
`_sampled_block_stats_kernel` gathers s query blocks' sampled rows into one tile, computes their
log-sum-exp itself (the sampled rows differ between orders, so a shared pass would cost a full one) and
reduces each key block's tile to one mass per query block: about 2/s of an order's cost.

Orders come as a table [O, H] (one order per output slot and head), so a capture that has fixed each
head's order computes only that order.

Tokens are never permuted in memory: a program maps its reordered positions to original ones with
the index arithmetic of `paroattn.layout` (jitted in `paroattn.kernels.index_math`) and gathers rows of q and k.
Output is [H, O, nq, nk] per statistic (267 MB for a CogVideoX-5B layer: 48 heads, 6 orders,
278 x 278 blocks), so memory stays bounded at any N; heads are launched in chunks when the outputs
would exceed `max_output_bytes`.
"""

from __future__ import annotations

import math

import torch

from ..kernels import interpreting
from ..kernels.dispatch import block_stats_backend
from ..layout import TokenLayout
from . import block_stats_reference as reference

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

LOG2E = 1.4426950408889634


if triton is not None:
    from ..kernels.index_math import reordered_to_original as _reordered_to_original

    @triton.jit
    def _log2_sum_exp2(
        q, K, KEEP, stride_kn, offs_d, d_valid, N, qk_scale_log2,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    ):
        """log2(sum_j exp2(q_m . k_j * qk_scale_log2)) of each row of the q tile [BLOCK_M, BLOCK_D] over the N keys
        of K (one batch item and head), online over key blocks; with HAS_KEY_MASK only over the keys j with
        KEEP[j] != 0."""
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None], mask=(offs_n[None, :] < N) & d_valid[:, None],
                        other=0.0)
            s = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale_log2
            key_valid = offs_n < N
            if HAS_KEY_MASK:
                key_valid = key_valid & (tl.load(KEEP + offs_n, mask=offs_n < N, other=0) != 0)
            s = tl.where(key_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # a row whose keys so far are all dropped keeps m = -inf: subtract 0 there, not -inf (NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_sub) + tl.sum(tl.exp2(s - m_sub[:, None]), axis=1)
            m_i = m_new
        return m_i + tl.log2(l_i)

    @triton.jit
    def _key_tile_probabilities(
        q, lse, q_valid, K, KEEP, rk, order, prefix, frames, height, width, stride_kn, offs_d, d_valid, N, qk_scale_log2,
        INPUT_PRECISION: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    ):
        """(P, valid) of the q tile against the keys at positions `rk` of the sequence reordered by `order`:
        P = exp2(q . k * qk_scale_log2 - lse) where valid (a query row and a key inside the sequence, the key not
        dropped by KEEP), 0 elsewhere. K and KEEP point at one batch item's (and head's) keys."""
        k_valid = rk < N
        ok = _reordered_to_original(rk, order, prefix, frames, height, width)
        ok = tl.where(k_valid, ok, 0)
        k = tl.load(K + ok[None, :] * stride_kn + offs_d[:, None], mask=k_valid[None, :] & d_valid[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale_log2
        if HAS_KEY_MASK:
            k_valid = k_valid & (tl.load(KEEP + ok, mask=k_valid, other=0) != 0)
        valid = q_valid[:, None] & k_valid[None, :]
        return tl.where(valid, tl.exp2(s - lse[:, None]), 0.0), valid

    @triton.jit
    def _row_lse_kernel(
        Q, K, LSE, KEEP,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        H, N, D, qk_scale_log2,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    ):
        """LSE[b, h, n] = log2(sum_j exp2(q_n . k_j * qk_scale_log2)), online over key blocks; with
        HAS_KEY_MASK only over the keys j with KEEP[b, j] != 0."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < N) & d_valid[None, :], other=0.0)
        lse = _log2_sum_exp2(q, K + b * stride_kb + h * stride_kh, KEEP + b * N, stride_kn, offs_d, d_valid, N,
                             qk_scale_log2, BLOCK_M, BLOCK_N, INPUT_PRECISION, HAS_KEY_MASK)
        tl.store(LSE + pid_bh * N + offs_m, lse, mask=offs_m < N)

    @triton.jit
    def _block_stats_kernel(
        Q, K, LSE, KEEP, ORDERS, MASS, PMAX, BELOW,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        B, H, N, D, head_offset, num_orders, num_blocks,
        prefix, frames, height, width,
        qk_scale_log2, eps,
        BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
        EXTRAS: tl.constexpr, INPUT_PRECISION: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    ):
        """Program (i, h, o): query block i of the sequence reordered by ORDERS[o, head], head
        head_offset + h (ORDERS: int32 [O, H], one order per output slot and head); adds into MASS (and, with EXTRAS, PMAX/BELOW)[h, o, i, :] (the outputs hold
        only this launch's heads). GROUP key blocks are handled per iteration: one [BLOCK, GROUP*BLOCK]
        tile, reduced to GROUP numbers, which amortizes the reductions' synchronization. With HAS_KEY_MASK,
        keys j with KEEP[b, j] == 0 are absent: no mass, and not counted below eps."""
        i = tl.program_id(0)
        h_local = tl.program_id(1)
        oi = tl.program_id(2)
        h = head_offset + h_local
        order = tl.load(ORDERS + oi * H + h)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        rq = i * BLOCK + tl.arange(0, BLOCK)
        q_valid = rq < N
        oq = _reordered_to_original(rq, order, prefix, frames, height, width)
        oq = tl.where(q_valid, oq, 0)
        out = ((h_local * num_orders + oi) * num_blocks + i) * num_blocks
        for b in range(0, B):
            q_ptrs = Q + b * stride_qb + h * stride_qh + oq[:, None] * stride_qn + offs_d[None, :]
            q = tl.load(q_ptrs, mask=q_valid[:, None] & d_valid[None, :], other=0.0)
            lse = tl.load(LSE + (b * H + h) * N + oq, mask=q_valid, other=0.0)
            for j0 in range(0, num_blocks, GROUP):
                p, valid = _key_tile_probabilities(
                    q, lse, q_valid, K + b * stride_kb + h * stride_kh, KEEP + b * N, j0 * BLOCK + tl.arange(0, GROUP * BLOCK),
                    order, prefix, frames, height, width, stride_kn, offs_d, d_valid, N, qk_scale_log2,
                    INPUT_PRECISION, HAS_KEY_MASK)
                js = j0 + tl.arange(0, GROUP)
                j_valid = js < num_blocks
                tile_mass = tl.sum(tl.sum(tl.reshape(p, [BLOCK, GROUP, BLOCK]), axis=2), axis=0)
                tl.store(MASS + out + js, tl.load(MASS + out + js, mask=j_valid, other=0.0) + tile_mass, mask=j_valid)
                if EXTRAS:
                    small = tl.where(valid & (p < eps), 1.0, 0.0)
                    tile_max = tl.max(tl.max(tl.reshape(p, [BLOCK, GROUP, BLOCK]), axis=2), axis=0)
                    tile_below = tl.sum(tl.sum(tl.reshape(small, [BLOCK, GROUP, BLOCK]), axis=2), axis=0)
                    old_max = tl.load(PMAX + out + js, mask=j_valid, other=0.0)
                    tl.store(PMAX + out + js, tl.maximum(old_max, tile_max), mask=j_valid)
                    old_below = tl.load(BELOW + out + js, mask=j_valid, other=0.0)
                    tl.store(BELOW + out + js, old_below + tile_below, mask=j_valid)

    @triton.jit
    def _sampled_block_stats_kernel(
        Q, K, KEEP, ORDERS, MASS,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        B, H, N, D, head_offset, num_orders, num_blocks,
        prefix, frames, height, width,
        qk_scale_log2, phase,
        BLOCK: tl.constexpr, STRIDE: tl.constexpr, BLOCK_D: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    ):
        """Program (g, h, o): query blocks g*STRIDE .. g*STRIDE+STRIDE-1 of the sequence reordered by ORDERS[o, head],
        BLOCK/STRIDE sampled rows of each (rows r*STRIDE + phase), gathered into one BLOCK-row tile. Pass 1 walks
        the keys in their original order for the sampled rows' log-sum-exp (only these rows need it); pass 2 walks
        the reordered key blocks and adds each tile's mass per query block into MASS[h, o, block, :] (unscaled:
        the launcher scales each block by its rows over its sampled rows)."""
        g = tl.program_id(0)
        h_local = tl.program_id(1)
        oi = tl.program_id(2)
        h = head_offset + h_local
        order = tl.load(ORDERS + oi * H + h)
        ROWS: tl.constexpr = BLOCK // STRIDE
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        m = tl.arange(0, BLOCK)
        rq = (g * STRIDE + m // ROWS) * BLOCK + (m % ROWS) * STRIDE + phase
        q_valid = rq < N
        oq = _reordered_to_original(rq, order, prefix, frames, height, width)
        oq = tl.where(q_valid, oq, 0)
        out_blocks = g * STRIDE + tl.arange(0, STRIDE)
        out = ((h_local * num_orders + oi) * num_blocks + out_blocks) * num_blocks  # [STRIDE]
        out_valid = out_blocks < num_blocks
        offs_n = tl.arange(0, BLOCK)
        for b in range(0, B):
            q_ptrs = Q + b * stride_qb + h * stride_qh + oq[:, None] * stride_qn + offs_d[None, :]
            q = tl.load(q_ptrs, mask=q_valid[:, None] & d_valid[None, :], other=0.0)
            lse = _log2_sum_exp2(q, K + b * stride_kb + h * stride_kh, KEEP + b * N, stride_kn, offs_d, d_valid, N,
                                 qk_scale_log2, BLOCK, BLOCK, INPUT_PRECISION, HAS_KEY_MASK)
            for j in range(0, num_blocks):
                p, _ = _key_tile_probabilities(
                    q, lse, q_valid, K + b * stride_kb + h * stride_kh, KEEP + b * N, j * BLOCK + offs_n, order, prefix,
                    frames, height, width, stride_kn, offs_d, d_valid, N, qk_scale_log2, INPUT_PRECISION, HAS_KEY_MASK)
                tile = tl.sum(tl.sum(tl.reshape(p, [STRIDE, ROWS, BLOCK]), axis=2), axis=1)  # [STRIDE]
                ptrs = MASS + out + j
                tl.store(ptrs, tl.load(ptrs, mask=out_valid, other=0.0) + tile, mask=out_valid)



def block_stats_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: TokenLayout,
    orders: list[int] | list[list[int]],
    block_size: int,
    eps: float = 1e-3,
    sm_scale: float | None = None,
    extras: bool = True,
    group: int = 1,
    max_output_bytes: int = 1 << 30,
    key_mask: torch.Tensor | None = None,
    query_stride: int = 1,
    phase: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Triton launcher; same contract and results as `block_stats_reference.block_stats_naive` (with
    `query_stride` > 1: as `block_stats_sampled_torch`, mass only). `orders`: the candidate orders, or a table
    [O][H] of one order per output slot and head. `extras=False` skips max and count below eps (returned as
    None); `group` key blocks per iteration (a power of two)."""
    B, H, N, D = q.shape
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the statistics kernel needs a power-of-two block_size >= 16, got {block_size}")
    table = _order_table(orders, H)
    sampled = query_stride > 1
    if sampled and extras:
        raise ValueError(f"query_stride={query_stride} estimates the block mass only; pass extras=False")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if interpreting() and q.dtype == torch.bfloat16:
        # the interpreter's bf16 dot is wrong; fp32 gives the same statistics
        q, k = q.float(), k.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_d = max(16, triton.next_power_of_2(D))
    scale_log2 = sm_scale * LOG2E
    keep = None if key_mask is None else key_mask.to(torch.int8).contiguous()
    lse = None
    if not sampled:
        lse = torch.empty(B, H, N, dtype=torch.float32, device=q.device)
        keep = lse if keep is None else keep  # lse: a pointer never read
        _row_lse_kernel[(triton.cdiv(N, 64), B * H)](
            q, k, lse, keep,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            H, N, D, scale_log2,
            BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d, INPUT_PRECISION=precision, HAS_KEY_MASK=key_mask is not None,
        )
    elif keep is None:
        keep = q  # a pointer never read
    n_blocks = triton.cdiv(N, block_size)
    O = len(table)
    order_tensor = torch.tensor(table, dtype=torch.int32, device=q.device).contiguous()
    if group < 1 or group & (group - 1):
        raise ValueError(f"group must be a power of two, got {group}")
    # a [BLOCK_D, GROUP * BLOCK] key tile per pipeline stage must fit in shared memory
    # (measured on an H200: D=128 with GROUP=4 asks for 400 KB; fp32 doubles it)
    group = min(group, max(1, (4 if q.dtype != torch.float32 else 2) * 64 // block_d))
    per_head = (3 if extras else 1) * O * n_blocks * n_blocks * 4
    heads_per_launch = max(1, min(H, max_output_bytes // per_head))
    results = []
    for head_offset in range(0, H, heads_per_launch):
        count = min(heads_per_launch, H - head_offset)
        mass = torch.zeros(count, O, n_blocks, n_blocks, dtype=torch.float32, device=q.device)
        if sampled:
            _sampled_block_stats_kernel[(triton.cdiv(n_blocks, query_stride), count, O)](
                q, k, keep, order_tensor, mass,
                q.stride(0), q.stride(1), q.stride(2),
                k.stride(0), k.stride(1), k.stride(2),
                B, H, N, D, head_offset, O, n_blocks,
                layout.prefix, layout.frames, layout.height, layout.width,
                scale_log2, phase,
                BLOCK=block_size, STRIDE=query_stride, BLOCK_D=block_d, INPUT_PRECISION=precision,
                HAS_KEY_MASK=key_mask is not None, num_warps=4,
            )
            results.append((mass, None, None))
            continue
        pmax = torch.zeros_like(mass) if extras else mass
        below = torch.zeros_like(mass) if extras else mass
        _block_stats_kernel[(n_blocks, count, O)](
            q, k, lse, keep, order_tensor, mass, pmax, below,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            B, H, N, D, head_offset, O, n_blocks,
            layout.prefix, layout.frames, layout.height, layout.width,
            scale_log2, eps,
            BLOCK=block_size, BLOCK_D=block_d, GROUP=group, EXTRAS=extras, INPUT_PRECISION=precision,
            HAS_KEY_MASK=key_mask is not None,
            num_warps=4 if group * block_size <= 128 else 8,
        )
        results.append((mass, pmax, below) if extras else (mass, None, None))
    if sampled:
        _, _, scale = reference.sampled_query_rows(N, block_size, query_stride, phase, device=q.device)
        mass = results[0][0] if len(results) == 1 else torch.cat([r[0] for r in results])
        return mass.mul_(scale[None, None, :, None]), None, None
    if len(results) == 1:
        return results[0]
    if not extras:
        return torch.cat([r[0] for r in results]), None, None
    return tuple(torch.cat([r[i] for r in results]) for i in range(3))


def _order_table(orders, heads: int) -> list[list[int]]:
    """[O][H] orders per output slot and head, from a list of candidate orders (the same for every head) or a
    table already."""
    table = [[int(o)] * heads if isinstance(o, int) else [int(x) for x in o] for o in orders]
    if any(len(row) != heads for row in table):
        raise ValueError(f"an order table needs one order per head ({heads}); got rows of {[len(r) for r in table]}")
    return table


def block_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: TokenLayout,
    orders: list[int] | None = None,
    block_size: int = 64,
    eps: float = 1e-3,
    sm_scale: float | None = None,
    backend: str = "auto",
    extras: bool = True,
    group: int = 1,
    suffix_mask: torch.Tensor | None = None,
    *,
    head_orders=None,
    query_stride: int = 1,
    phase: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mass, pmax, below), each float32 [H, O, nq, nk], for q, k [B, H, N, D] and the candidate
    `orders` (default: the layout's distinct orders: 6 for video, 2 for images). See
    `block_stats_reference` for the definitions. backend: "auto" (Triton on CUDA, torch elsewhere),
    "triton" or "torch". `extras=False`: only the mass (pmax and below come back as None), which is all
    the default order metric needs for unquantized plans; the Triton kernel then skips two reductions.
    `suffix_mask` [B, layout.suffix] bool (True = a real text token), as the op takes it: the False keys
    are absent from the statistics (softmax over the real keys only), as they are from the op's attention.

    `head_orders` (H ints, instead of `orders`): one order per head, mass [H, 1, nq, nk] in each head's order,
    at the cost of one order. `query_stride` s > 1 (a power of two up to the block size, with extras=False):
    the mass estimated from every s-th query row of each block starting at row `phase`, scaled to the block
    (`block_stats_reference.sampled_query_rows`), at about 2/s of the cost of one order per order (the
    sampled rows' log-sum-exp is computed with them); s = 1 is the exact statistics."""
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, H, N, D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[2] != layout.seq_len:
        raise ValueError(f"q has {q.shape[2]} tokens but the layout {layout} has {layout.seq_len}")
    H = q.shape[1]
    if head_orders is not None:
        if orders is not None:
            raise ValueError("pass either orders (the same candidates for every head) or head_orders (one per head)")
        head_orders = [int(o) for o in head_orders]
        if len(head_orders) != H:
            raise ValueError(f"head_orders needs one order per head ({H}), got {len(head_orders)}")
    if orders is None and head_orders is None:
        orders = list(layout.distinct_orders())
    if query_stride < 1 or query_stride & (query_stride - 1) or query_stride > block_size:
        raise ValueError(f"query_stride must be a power of two from 1 to the block size {block_size}, "
                         f"got {query_stride}")
    if query_stride > 1 and extras:
        raise ValueError(f"query_stride={query_stride} estimates the block mass only; pass extras=False")
    key_mask = None
    if suffix_mask is not None:
        B, N, S = q.shape[0], q.shape[2], layout.suffix
        if suffix_mask.dtype != torch.bool or tuple(suffix_mask.shape) != (B, S):
            raise ValueError(f"suffix_mask must be a bool [B, suffix] = [{B}, {S}] tensor for the layout {layout}; "
                             f"got {suffix_mask.dtype} {tuple(suffix_mask.shape)}")
        key_mask = torch.cat([suffix_mask.new_ones(B, N - S), suffix_mask.to(q.device)], dim=1)
    table = [head_orders] if head_orders is not None else _order_table(orders, H)
    if block_stats_backend(q.device, backend) == "triton":
        return block_stats_triton(q, k, layout, table, block_size, eps, sm_scale, extras=extras, group=group,
                                  key_mask=key_mask, query_stride=query_stride, phase=phase)
    if query_stride > 1:
        mass = reference.block_stats_sampled_torch(q, k, layout, table, block_size, query_stride, phase, sm_scale,
                                                   key_mask=key_mask)
        return mass, None, None
    if head_orders is not None:
        # each head's statistics from the exact form of its order
        distinct = sorted(set(head_orders))
        stats = reference.block_stats_torch(q, k, layout, distinct, block_size, eps, sm_scale, key_mask=key_mask)
        slots = torch.tensor([distinct.index(o) for o in head_orders], device=q.device)
        heads = torch.arange(H, device=q.device)
        mass, pmax, below = (t[heads, slots].unsqueeze(1) for t in stats)
    else:
        mass, pmax, below = reference.block_stats_torch(q, k, layout, orders, block_size, eps, sm_scale,
                                                        key_mask=key_mask)
    return (mass, pmax, below) if extras else (mass, None, None)
