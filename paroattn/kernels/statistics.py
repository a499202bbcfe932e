"""The statistics of the quantized modes in one Triton launch: K smoothing's mean (int8/int4 QK) and V's
per-channel max |V| (fp8/int8 PV), both float32 [B*H, D], read by the prologue and the attention kernel.

Their definitions are `reference.key_smoothing_mean` (the mean over tokens 0, s, 2s, ... of each
(batch, head)) and `reference.fake_quantize_v`'s amax, in one launch through `launcher.CachedLauncher`
instead of two torch reductions with their host time
(benchmarks/results/host-before-after-statistics-launch-nvidia-h100.json).

Grid (split, b*H + h): each (batch, head) is cut into `split` runs of tokens so that short-headed
problems (Wan2.1-1.3B: 12 heads, 32760 tokens) still spread over every SM. The split depends on the
sequence alone, not on the number of heads: the sum's order, and so a head's mean to the last bit, is the
same whether the head is computed with all of the model's heads or with a slice of them (each process under
Ulysses context parallelism runs a slice; its output equals one GPU's). Each program writes its
partial sum and partial max, then counts itself in an arrival counter of its (batch, head); the program
that arrives last adds the partials in split order (the result does not depend on which program that
is) and max-reduces them, writes the statistics and sets the counter back to zero for the next launch.
The sum of the sample runs in another order than torch's, so the mean differs from
`reference.key_smoothing_mean` by float32 rounding; the max is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_sparse_attention import _max_nan
from .launcher import CachedLauncher, aligned

TILES_PER_PROGRAM = 4  # tiles each program reads: short runs keep enough loads in flight to stream V at full speed
MAX_SPLIT = 64  # programs per (batch, head): bounds the partials and the last program's serial sum over them


@triton.jit
def _statistics_kernel(
    K, V, KMean, VAmax, KPartial, VPartial, Arrivals,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    N, H, SPLIT, ROWS_PER_PROGRAM, MEAN_STRIDE, SAMPLES, SAMPLES_PER_PROGRAM,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, K_MEAN: tl.constexpr, V_AMAX: tl.constexpr,
):
    s = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    bh64 = bh.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, BLOCK)
    partial = (bh64 * SPLIT + s) * HEAD_DIM + offs_d
    if K_MEAN:
        # samples j in [first, last): tokens j * MEAN_STRIDE of this (batch, head)
        k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
        first = s * SAMPLES_PER_PROGRAM
        last = tl.minimum(first + SAMPLES_PER_PROGRAM, SAMPLES)
        total = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
        for j0 in range(first, last, BLOCK):
            j = j0 + rows
            x = tl.load(k_base + (j * MEAN_STRIDE)[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=(j < last)[:, None], other=0.0)
            total += x.to(tl.float32)
        tl.store(KPartial + partial, tl.sum(total, 0))
    if V_AMAX:
        v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
        first = s * ROWS_PER_PROGRAM
        last = tl.minimum(first + ROWS_PER_PROGRAM, N)
        amax = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
        for n0 in range(first, last, BLOCK):
            n = n0 + rows
            x = tl.load(v_base + n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=(n < last)[:, None],
                        other=0.0)
            # NaN-propagating (tl.maximum drops NaN): a NaN in channel c makes its max, and its scale, NaN
            amax = _max_nan(amax, tl.abs(x.to(tl.float32)))
        tl.store(VPartial + partial, tl.reduce(amax, 0, _max_nan))
    # every thread's partials are stored before the (release) arrival; the last program's loads come
    # after its (acquire) arrival and bypass L1
    tl.debug_barrier()
    arrived = tl.atomic_add(Arrivals + bh, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        row = bh64 * SPLIT * HEAD_DIM + offs_d
        if K_MEAN:
            k_sum = tl.load(KPartial + row, volatile=True)
            for i in range(1, SPLIT):
                k_sum += tl.load(KPartial + row + i * HEAD_DIM, volatile=True)
            # IEEE division, as torch's mean (the GPU's plain `/` is approximate)
            tl.store(KMean + bh64 * HEAD_DIM + offs_d, tl.math.div_rn(k_sum, tl.zeros_like(k_sum) + SAMPLES))
        if V_AMAX:
            v_max = tl.load(VPartial + row, volatile=True)
            for i in range(1, SPLIT):
                v_max = _max_nan(v_max, tl.load(VPartial + row + i * HEAD_DIM, volatile=True))
            tl.store(VAmax + bh64 * HEAD_DIM + offs_d, v_max)
        tl.store(Arrivals + bh, 0)


def block_of(D: int) -> int:
    """Rows per tile: 64 of D = 128 or 128 of D = 64 (16 KiB of bf16 per load)."""
    return 64 if D >= 128 else 128


class Statistics:
    """The outputs and scratch of one launch: K's mean and V's amax [B, H, D] and the partials
    [split, B*H, D] of each, float32 in one allocation, and the int32 arrival counters [B*H] (zero between
    launches). `split` programs share the tokens of one (batch, head), `rows` tokens each (a multiple of
    the tile): TILES_PER_PROGRAM tiles each, at most MAX_SPLIT runs, whatever B and H are, unless `split` is
    given; `block` rows per tile (`block_of` unless given: tests take small ones)."""

    def __init__(self, B: int, H: int, N: int, D: int, device: torch.device, split: int | None = None,
                 block: int | None = None):
        BH = B * H
        self.block = block = block or block_of(D)
        if split is None:
            split = max(1, min(MAX_SPLIT, -(-N // (TILES_PER_PROGRAM * block))))
        self.rows = -(-max(1, -(-N // split)) // block) * block
        self.split = max(1, -(-N // self.rows))
        data = torch.empty(2 + 2 * self.split, BH, D, dtype=torch.float32, device=device)
        self.k_mean, self.v_amax = data[0].view(B, H, D), data[1].view(B, H, D)
        self.k_partial, self.v_partial = data[2:2 + self.split], data[2 + self.split:]
        self.arrivals = torch.zeros(BH, dtype=torch.int32, device=device)
        self.aligned = aligned(self.k_mean, self.v_amax, self.k_partial, self.v_partial, self.arrivals)


def compute(k: torch.Tensor, v: torch.Tensor, out: Statistics, mean_stride: int, k_mean: bool, v_amax: bool,
            launcher: CachedLauncher | None = None, key=None) -> None:
    """K's mean over every `mean_stride`-th token (with `k_mean`) and V's per-channel max |V| (with `v_amax`)
    of k, v [B, H, N, D] (any strides) into `out`. `launcher`: the process's `CachedLauncher` of the kernel
    (None: a full launch), `key` the launch's key there, which must hold k's and v's shape, dtype, strides and alignment, the mean's stride, and
    `out.split` and `out.aligned`."""
    B, H, N, D = k.shape
    if not (k_mean or v_amax) or k.numel() == 0:
        return
    split = out.split
    samples = -(-N // mean_stride)
    grid = (split, B * H)
    args = (k, v, out.k_mean, out.v_amax, out.k_partial, out.v_partial, out.arrivals, *k.stride(), *v.stride(),
            N, H, split, out.rows, mean_stride, samples, -(-samples // split))
    constexprs = dict(HEAD_DIM=D, BLOCK=out.block, K_MEAN=k_mean, V_AMAX=v_amax)
    if launcher is None:
        _statistics_kernel[grid](*args, **constexprs, num_warps=4)
    else:
        launcher(key, grid, args, constexprs, num_warps=4)
