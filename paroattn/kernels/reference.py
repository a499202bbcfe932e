"""Torch reference of the PARO attention op: the definition of its semantics and the oracle of
every kernel test. Runs anywhere (CPU included); memory stays bounded by looping over heads and
chunks of query blocks, so it also runs at N ~ 20k on a GPU.

Quantization is emulated in float32 with exactly the grid a kernel uses:
- Q: symmetric per block of `bq` reordered queries; K: a per-(batch, head) mean is subtracted first
  (softmax is invariant to subtracting any vector from every key; the mean makes the values small),
  then symmetric per block of `bk` keys, or with k_scale="token" per key (one scale per key token of
  each head: `quantize_symmetric` over its channels). The mean is taken over every s-th token of the original
  order (`key_mean_stride`: s <= 16 keeps >= 2048 tokens, and s shares no factor with the frame's
  H x W, so the sample visits every row and column alike): as exact as the full mean, since any
  vector may be subtracted, and it reads 1/s of K.
  Ranges: int8 +-127, int4 +-7. scale = max(amax, QUANT_EPS) / qmax, values x * (1 / scale) rounded
  to nearest (one IEEE reciprocal per block, then products, as the kernels compute it).
- P (after the row-max shift, so in [0, 1]): int8 with the fixed scale 1/127, or fp8 e4m3 as
  P * 448. V: symmetric per channel (over all tokens of a (batch, head)), int8 +-127 or e4m3 +-448,
  as V times the reciprocal of the channel's scale.
- The softmax denominator always uses the unquantized P.
A kernel subtracts a running row max (online softmax) where this reference subtracts the final row
max, so quantized-P modes agree with kernels to within the rounding of P, not bit for bit.

NaN inputs reach exactly the outputs `paro_attention`'s docstring lists (its "NaN" paragraph) in every
dtype: a NaN score keeps its row's sum NaN (rows with no active key are set to zero by the sum being 0),
NaN enters the quantization scales (torch's max reductions propagate it), and the P V product reads V
with NaN zeroed, then sets NaN where a row attends a NaN of V (over every key, 0 * NaN would reach rows
that mask its key out).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..layout import TokenLayout, reorder_table
from ..masks import dense_mask_from_blocks

QK_QMAX = {"int8": 127.0, "int4": 7.0}
PV_QMAX = {"int8": 127.0, "fp8": 448.0}
QUANT_EPS = 1e-8
MIN_K_MEAN_SAMPLES = 2048  # K smoothing's mean reads at least this many tokens (all of shorter sequences)
MAX_K_MEAN_STRIDE = 16
# queries per chunk of the reference loop: bounds its memory to ~CHUNK * N floats
_QUERY_CHUNK = 1024
# float32 without quantization goes through SDPA with a token mask of H * N * N floats up to this size
_SDPA_MASK_ELEMENTS = 1 << 25


def quant_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """max(amax, QUANT_EPS) / qmax with IEEE division, on every device: torch on CUDA divides by a
    Python number as a product with its rounded reciprocal, which can be an ulp away (and the kernels'
    `div_rn` is not)."""
    return amax.clamp_min(QUANT_EPS) / torch.full_like(amax, qmax)


def quantize_symmetric(x: torch.Tensor, dim, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Round x / scale to integers in [-qmax, qmax], scale = max|x| over `dim` / qmax, as x times the
    reciprocal of the scale. Returns the integer values (as float32) and the scale, broadcastable
    against x."""
    scale = quant_scale(x.abs().amax(dim=dim, keepdim=True), qmax)
    return torch.round(x * torch.reciprocal(scale)).clamp_(-qmax, qmax), scale


def quantize_per_block(x: torch.Tensor, block: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of x [B, N, D] with one scale per block of `block` tokens.
    Returns (integer values [B, N, D], scales [B, ceil(N/block)])."""
    B, N, D = x.shape
    nblocks = -(-N // block)
    padded = torch.zeros(B, nblocks * block, D, dtype=x.dtype, device=x.device)
    padded[:, :N] = x
    values, scale = quantize_symmetric(padded.view(B, nblocks, block, D), dim=(2, 3), qmax=qmax)
    return values.view(B, nblocks * block, D)[:, :N], scale.view(B, nblocks)


@functools.cache
def key_mean_stride(seq_len: int, height: int, width: int) -> int:
    """The sampling stride of K smoothing's mean: the largest s <= MAX_K_MEAN_STRIDE that shares no
    factor with height x width (so the sampled tokens cycle through every column and row of a frame: a
    stride dividing the width samples a few columns only, and with RoPE in K that mean is biased) and
    still samples >= MIN_K_MEAN_SAMPLES tokens; 1 (every token) for short sequences. The mean's
    sampling error shrinks as 1 / sqrt(samples), and with too few samples the op's int8 error grows."""
    for stride in range(MAX_K_MEAN_STRIDE, 1, -1):
        if math.gcd(stride, height * width) == 1 and -(-seq_len // stride) >= MIN_K_MEAN_SAMPLES:
            return stride
    return 1


def key_smoothing_mean(k: torch.Tensor, stride: int) -> torch.Tensor:
    """The vector K smoothing subtracts from every key of k [B, N, D] (original token order): the
    float32 mean over tokens 0, stride, 2 * stride, ... (`key_mean_stride`), [B, 1, D]."""
    return k[:, ::stride].float().mean(dim=1, keepdim=True)


def fake_quantize_p(p: torch.Tensor, pv: str) -> torch.Tensor:
    """P in [0, 1] as the PV product of a kernel sees it, in float32."""
    if pv == "bf16":
        return p
    if pv == "int8":
        return torch.round(p * 127.0) / 127.0
    return (p * 448.0).to(torch.float8_e4m3fn).float() / 448.0


def fake_quantize_v(v: torch.Tensor, pv: str) -> torch.Tensor:
    """V [B, N, D] after per-channel quantization and dequantization."""
    if pv == "bf16":
        return v
    # values are v times the per-channel reciprocal of the scale (what a kernel computes once per
    # channel, instead of one IEEE division per element)
    qmax = PV_QMAX[pv]
    scale = quant_scale(v.abs().amax(dim=1, keepdim=True), qmax)
    scaled = v * torch.reciprocal(scale)
    if pv == "int8":
        return torch.round(scaled).clamp_(-qmax, qmax) * scale
    return scaled.to(torch.float8_e4m3fn).float() * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs of the last S tokens of x [B, H, N, D] (cos, sin: [S, D]), the
    convention of CogVideoX, Wan 2.1 and FLUX.1: x * cos + pairs_rotated(x) * sin in float32, rounded
    to x's dtype, where pairs_rotated(x)[2i] = -x[2i + 1] and pairs_rotated(x)[2i + 1] = x[2i]."""
    start = x.shape[2] - cos.shape[0]
    tail = x[:, :, start:]
    pairs = tail.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    out = (tail.float() * cos.float() + rotated.float() * sin.float()).to(x.dtype)
    return torch.cat([x[:, :, :start], out], dim=2) if start else out


def expand_block_mask(block_mask_rows: torch.Tensor, bk: int, n: int) -> torch.Tensor:
    """[rows_in_blocks, nk] -> dense key mask [rows_in_blocks, n] (each key's block)."""
    key_block = torch.arange(n, device=block_mask_rows.device) // bk
    return block_mask_rows[:, key_block]


def paro_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TokenLayout,
    orders: torch.Tensor,
    block_mask: torch.Tensor,
    bq: int,
    bk: int,
    qk: str = "bf16",
    pv: str = "bf16",
    sm_scale: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    suffix_mask: torch.Tensor | None = None,
    k_scale: str = "block",
) -> torch.Tensor:
    """q, k, v: [B, H, N, D]; orders [H]; block_mask bool [H, ceil(N/bq), ceil(N/bk)] in reordered
    coordinates (both on any device: they are read on q's); rotary: RoPE tables (cos, sin) [S, D] for the last S tokens of q and k (`apply_rotary`),
    applied before everything else; suffix_mask: bool [B, layout.suffix], False where a suffix token is
    padding, a key no query attends (on top of the block mask); k_scale: K's scales with integer QK, one per
    key block ("block") or one per key ("token"). Returns [B, H, N, D] in q's dtype and
    original token order."""
    B, H, N, D = q.shape
    orders, block_mask = orders.to(q.device), block_mask.to(q.device)
    key_valid = None if suffix_mask is None else valid_keys(suffix_mask, N)  # [B, N], same in both orders
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    # traced by torch.compile, nothing may read a tensor's values on the host: the NaN tests below turn into
    # the same arithmetic applied unconditionally (it leaves NaN-free inputs bit for bit as they are)
    traced = torch.compiler.is_compiling()
    if qk == pv == "bf16" and q.dtype == torch.float32 and H * N * N <= _SDPA_MASK_ELEMENTS:
        if traced:
            return _masked_sdpa(q, k, v, layout, orders, block_mask, bq, bk, sm_scale, nan_safe=True,
                                key_valid=key_valid)
        if not (bool(torch.isnan(k).any()) or bool(torch.isnan(v).any())):
            # (NaN in k or v goes through the loop: SDPA's additive mask and its P V product over every key
            # would carry it into rows that mask its key out)
            return _masked_sdpa(q, k, v, layout, orders, block_mask, bq, bk, sm_scale, key_valid=key_valid)
    out = torch.empty(B, H, N, D, dtype=q.dtype, device=q.device)
    low_precision_p = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else None
    # every head's reordering, gathered by its order from the table of all 6 (no host read of the orders)
    indices = head_indices(layout, orders, q.device)
    stride = (key_mean_stride.__wrapped__ if traced else key_mean_stride)(N, layout.height, layout.width)
    for h in range(H):
        index = indices[h]
        qh = q[:, h].index_select(1, index).float()
        kh = k[:, h].index_select(1, index).float()
        vh = fake_quantize_v(v[:, h].index_select(1, index).float(), pv)
        # P V over all keys would turn a NaN in V into 0 * NaN = NaN in rows that mask its key out: the
        # product reads V with NaN zeroed, and the rows that attend a NaN are set NaN after it
        v_nan = torch.isnan(vh)
        if traced or bool(v_nan.any()):
            vh = vh.masked_fill(v_nan, 0.0)
        else:
            v_nan = None
        q_scale = key_scale = None  # key_scale: [B, N], each key's dequantization scale
        if qk != "bf16":
            kh = kh - key_smoothing_mean(k[:, h], stride)
            qh, q_scale = quantize_per_block(qh, bq, QK_QMAX[qk])
            if k_scale == "token":
                kh, key_scale = quantize_symmetric(kh, dim=-1, qmax=QK_QMAX[qk])
                key_scale = key_scale[..., 0]
            else:
                kh, key_scale = quantize_per_block(kh, bk, QK_QMAX[qk])
                key_scale = key_scale.repeat_interleave(bk, dim=1)[:, :N]
        out_h = torch.empty(B, N, D, dtype=torch.float32, device=q.device)
        for start in range(0, N, _QUERY_CHUNK):
            stop = min(start + _QUERY_CHUNK, N)
            rows = block_mask[h, torch.arange(start, stop, device=q.device) // bq]
            allowed = expand_block_mask(rows, bk, N)  # [rows, N], or [B, rows, N] with padded keys
            if key_valid is not None:
                allowed = allowed[None] & key_valid[:, None, :]
            scores = qh[:, start:stop] @ kh.transpose(1, 2)
            if qk != "bf16":
                row_scale = q_scale.repeat_interleave(bq, dim=1)[:, start:stop]
                scores = scores * row_scale[:, :, None] * key_scale[:, None, :]
            scores = scores * sm_scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            row_max = scores.amax(dim=-1, keepdim=True)
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            p = torch.exp(scores - row_max)
            denom = p.sum(dim=-1, keepdim=True)
            p = fake_quantize_p(p, pv)
            if pv == "bf16" and low_precision_p is not None:
                p = p.to(low_precision_p).float()  # a kernel feeds P to the PV product in the input dtype
            numer = p @ vh
            if v_nan is not None:  # NaN in V reaches the rows that attend its key, not the others
                numer = numer.masked_fill((allowed.to(torch.float32) @ v_nan.to(torch.float32)) > 0, float("nan"))
            # a row with no active key is zero; a NaN score keeps its row NaN (denom is NaN)
            empty = denom == 0
            out_h[:, start:stop] = torch.where(empty, torch.zeros_like(numer),
                                               numer / torch.where(empty, torch.ones_like(denom), denom))
        out[:, h, index] = out_h.to(q.dtype)
    return out


def valid_keys(suffix_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, N] bool: True for every key a query may attend: all tokens before the suffix, and the suffix tokens
    `suffix_mask` keeps. The suffix is never reordered, so this holds in both token orders."""
    B, suffix = suffix_mask.shape
    head = torch.ones(B, seq_len - suffix, dtype=torch.bool, device=suffix_mask.device)
    return torch.cat([head, suffix_mask.to(torch.bool)], dim=1)


def head_indices(layout: TokenLayout, orders: torch.Tensor, device) -> torch.Tensor:
    """[H, N] LongTensor: row h is `reorder_index(layout, orders[h])`, gathered from `reorder_table` on
    `device` (the orders are not read on the host)."""
    return reorder_table(layout, device=device).index_select(0, orders.to(device=device, dtype=torch.long))


def _masked_sdpa(q, k, v, layout, orders, block_mask, bq, bk, sm_scale, nan_safe: bool = False,
                 key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The float32, unquantized case in one fused call (the CPU path of `paro demo`): every head's
    tokens gathered into its order, a token-level mask expanded from the blocks, rows without an
    active key set to zero (SDPA would give NaN), and the rows scattered back to their positions.

    `nan_safe` (traced calls, which cannot test for NaN first): SDPA reads k and v with NaN zeroed, then
    the rows that attend a key with a NaN in k become NaN, and channel c of the rows that attend a NaN
    in v[:, c], as in the loop. NaN-free inputs give the very same result as without it."""
    B, H, N, D = q.shape
    index = head_indices(layout, orders, q.device)[None, :, :, None].expand(B, H, N, D)
    allowed = dense_mask_from_blocks(block_mask, bq, bk, N)[None]  # [1, H, N, N], reordered coordinates
    if key_valid is not None:  # [B, H, N, N]: padded keys masked for every query
        allowed = allowed & key_valid[:, None, None, :]
    # an additive 4-D mask takes torch's fused CPU kernel; a bool or 3-D one falls back to a slow path
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    gathered = [t.gather(2, index) for t in (q, k, v)]
    if nan_safe:
        k_nan, v_nan = torch.isnan(gathered[1]), torch.isnan(gathered[2])
        gathered[1] = gathered[1].masked_fill(k_nan, 0.0)
        gathered[2] = gathered[2].masked_fill(v_nan, 0.0)
    out = F.scaled_dot_product_attention(*gathered, attn_mask=bias, scale=sm_scale)
    if nan_safe:
        reach = allowed.to(q.dtype)  # [1 or B, H, N, N]: row i attends key j
        hit = (reach @ k_nan.any(dim=-1, keepdim=True).to(q.dtype) > 0) | (reach @ v_nan.to(q.dtype) > 0)
        out = out.masked_fill(hit, float("nan"))
    out = torch.where(allowed.any(dim=-1)[..., None], out, torch.zeros_like(out))
    return torch.empty_like(out).scatter_(2, index, out)
