"""The RoPE pass of the op (`paro_attention(rotary=...)`): q and k rotated in one Triton launch.

The models' own RoPE is a chain of float32 elementwise kernels (stack, casts, products, a sum, a
cast back, a strided copy; benchmarks/results/rope_h200.json). This pass reads q and k once and writes
rotated contiguous copies, which the attention kernels then read. Its definition is `reference.apply_rotary`.

Applying the rotation inside the attention kernels' own loads of q and k instead was measured slower
(docs/notes/end-to-end.md): each (batch, head) program re-reads the float32 tables, four times the bytes
of its rows, and the attention loop carries the extra registers. Here one program rotates
a block of tokens for several heads, so each table tile is read once per group of heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import CachedLauncher

_BLOCK_N = 32  # with 8 heads per program and 4 warps: the fastest of a sweep on the three models (H200)
_NUM_WARPS = 4
# heads one program rotates: each table tile is read once per program, and the heads' loads are issued
# together (an unrolled loop); at most this many, and no fewer programs than _TARGET_PROGRAMS allows
_MAX_HEADS_PER_PROGRAM = 8
_TARGET_PROGRAMS = 1024


@triton.jit
def _rotate_rows(X, Out, rows, valid, stride_n, stride_d, offs_d, cos, sin, rotated,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # one head's rows: x * cos + pairs_rotated(x) * sin in float32, rounded to x's dtype, where
    # pairs_rotated(x)[2i] = -x[2i + 1] and pairs_rotated(x)[2i + 1] = x[2i]; rows that are not rotated
    # (a text prefix) are copied. The pairs come from splitting the loaded tile, so loads and stores stay
    # vectorized (a gather of the partner columns d ^ 1 is not).
    x = tl.load(X + rows[:, None] * stride_n + offs_d[None, :] * stride_d, mask=valid[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(x.to(tl.float32), [BLOCK_N, HEAD_DIM // 2, 2]))
    cos_even, cos_odd = tl.split(tl.reshape(cos, [BLOCK_N, HEAD_DIM // 2, 2]))
    sin_even, sin_odd = tl.split(tl.reshape(sin, [BLOCK_N, HEAD_DIM // 2, 2]))
    out = tl.interleave(even * cos_even - odd * sin_even, odd * cos_odd + even * sin_odd).to(x.dtype)
    out = tl.where(rotated[:, None], out, x)
    tl.store(Out + rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=valid[:, None])


@triton.jit
def _rotate_kernel(
    Q, K, Cos, Sin, QOut, KOut,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    N, H, rope_start,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
):
    # grid (token block, b * head groups): the block's table tile once, then its rows of q and k for
    # HEADS_PER_PROGRAM heads; outputs are contiguous [B, H, N, D]
    nb = tl.program_id(0)
    groups = H // HEADS_PER_PROGRAM
    b = tl.program_id(1) // groups
    h0 = (tl.program_id(1) % groups) * HEADS_PER_PROGRAM
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < N
    rotated = valid & (rows >= rope_start)
    offs_d = tl.arange(0, HEAD_DIM)
    table = (rows - rope_start)[:, None] * HEAD_DIM + offs_d[None, :]
    cos = tl.load(Cos + table, mask=rotated[:, None], other=1.0)
    sin = tl.load(Sin + table, mask=rotated[:, None], other=0.0)
    b64 = b.to(tl.int64)
    for i in tl.static_range(HEADS_PER_PROGRAM):
        h = (h0 + i).to(tl.int64)
        dst = (b64 * H + h) * N * HEAD_DIM
        _rotate_rows(Q + b64 * stride_qb + h * stride_qh, QOut + dst, rows, valid, stride_qn, stride_qd, offs_d,
                     cos, sin, rotated, BLOCK_N, HEAD_DIM)
        _rotate_rows(K + b64 * stride_kb + h * stride_kh, KOut + dst, rows, valid, stride_kn, stride_kd, offs_d,
                     cos, sin, rotated, BLOCK_N, HEAD_DIM)


def heads_per_program(blocks: int, batch: int, heads: int) -> int:
    """The largest divisor of `heads` up to _MAX_HEADS_PER_PROGRAM that leaves >= _TARGET_PROGRAMS programs
    (1 when none does)."""
    best = 1
    for count in range(2, min(heads, _MAX_HEADS_PER_PROGRAM) + 1):
        if heads % count == 0 and blocks * batch * (heads // count) >= _TARGET_PROGRAMS:
            best = count
    return best


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              out: tuple[torch.Tensor, torch.Tensor] | None = None, launcher: CachedLauncher | None = None,
              key=None):
    """q, k [B, H, N, D] (any strides) with RoPE on their last S tokens (cos, sin: float32 [S, D]), as
    new contiguous tensors (or written into `out`, two contiguous [B, H, N, D] tensors of q's dtype):
    `reference.apply_rotary` of each. `launcher`: the process's `CachedLauncher` of the kernel (None: a full
    launch), `key` the launch's key there (None: a full launch), which must hold q's shape and dtype, q's and k's
    strides, S, the strides of cos and sin, and the alignment of q, k, cos, sin and `out`."""
    B, H, N, D = q.shape
    if out is None:
        q_out = torch.empty(B, H, N, D, dtype=q.dtype, device=q.device)
        out = (q_out, torch.empty_like(q_out))
    q_out, k_out = out
    if q_out.numel() == 0:
        return q_out, k_out
    cos, sin = cos.contiguous(), sin.contiguous()
    blocks = -(-N // _BLOCK_N)
    per_program = heads_per_program(blocks, B, H)
    grid = (blocks, B * (H // per_program))
    args = (q, k, cos, sin, q_out, k_out, *q.stride(), *k.stride(), N, H, N - cos.shape[0])
    constexprs = dict(HEAD_DIM=D, BLOCK_N=_BLOCK_N, HEADS_PER_PROGRAM=per_program)
    if launcher is None:
        _rotate_kernel[grid](*args, **constexprs, num_warps=_NUM_WARPS)
    else:
        launcher(key, grid, args, constexprs, num_warps=_NUM_WARPS)
    return q_out, k_out
