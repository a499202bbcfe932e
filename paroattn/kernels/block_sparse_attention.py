"""Triton kernels of the PARO op: the K/V prologue and the block-sparse attention kernel.

The torch reference beside them (`reference.py`) is their definition; `launch.py` launches
them. Data flow of one call, for a [B, H, N, D] problem with per-head orders:

1. statistics (`statistics.py`, one Triton kernel, only in the modes that need them): the per-(b, h) mean of K over
   every s-th token, s <= 16 (`reference.key_smoothing_mean`, which K smoothing subtracts, for
   int8/int4 QK; a sample of >= 2048 tokens reads 1/s of K) and the per-channel max |V| (fp8/int8
   PV, one pass over V; the scale max(amax, eps) / qmax is formed where it is used).
2. `_kv_prologue_kernel`, grid (key block, b*H + h): gathers the key block of the REORDERED
   sequence straight from the caller's k / v (index arithmetic, any strides) and writes it
   contiguously (and with `KernelConfig.q_tma` the query blocks too, for descriptor loads of Q): K in
   the input dtype, or with the mean subtracted and quantized per block (or with K_PER_TOKEN per key) to int8
   or int4 values, both stored one per byte, int4 ones times 16 (`_quantize_block`; Hopper has no INT4
   matrix instruction, so int4 values run the int8 product; nibble packing, which needs an unpack and
   two half-depth products per tile, measured slower than int8: attention-nvidia-h200-bq64-bk64-packed-int4.json
   against attention-int4-nvidia-h200.json); V in the input dtype, or quantized per channel (fp8 e4m3 or
   int8, stored transposed [D, N] so the PV product reads V K-major as Hopper's 8-bit MMA wants).
   Reordered copies, read as contiguous tiles, beat gathering the key rows inside the attention kernel
   (per-row index arithmetic, scattered rows; docs/notes/prologue.md): the kernel never gathers K or V.
3. `_attention_kernel`, grid (rank, b*H + h): the program takes the query block `schedule[h, rank]`
   (most active key blocks first), gathers its queries from the caller's q by index arithmetic and
   quantizes them per block in registers when QK is int8/int4 (each query block is read once), or
   with q_tma loads the prologue's copy through a descriptor (faster at 128-row tiles), then loops over its
   active key blocks only: online softmax in base 2 with `sm_scale * log2(e)` and the dequantization
   scales folded into one multiplier per key block, applied inside exp2's argument (with per-key K scales,
   K_PER_TOKEN, the scores are scaled per column before the row max instead); integer results
   become floats by magic-number adds (no I2F/F2I, which Hopper runs at a quarter rate). K and V tiles
   come from the prologue's buffers, by pointer loads or TMA descriptors (`KernelConfig.tma`);
   `KernelConfig.overlap_qk` issues the next block's QK
   product before this block's softmax. The epilogue writes every row at its ORIGINAL token position
   in the caller's layout; a row with no active key block writes zeros. NaN inputs reach the outputs
   the reference's do: the quantization scales take NaN-propagating maxima (Triton's max drops NaN),
   and the epilogue keeps a NaN row sum (integer P rounds NaN to a finite value).

Tiles are the mask's blocks: BLOCK_M = bq, BLOCK_N = bk. Only the last key block of the sequence can
hold positions >= N; when it is active it is the last entry of a row's (ascending) list, so the main
loop runs unmasked and that block alone runs with a column mask. With a key padding mask (HAS_KEY_MASK:
the suffix's `suffix_mask`) the key blocks that overlap the suffix [N - suffix, N) are likewise the last
entries of each list: the main loop stays unmasked and only those blocks run with a column mask (a
position < N that is not padding); a block holding padding only is skipped, so a row whose attended keys
are all padding keeps l = 0 and writes zeros (its running max stays -inf and never meets exp2(-inf + inf)).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .index_math import reordered_to_original

# QK modes
QK_FP, QK_INT8, QK_INT4 = 0, 1, 2
# PV modes
PV_FP, PV_FP8, PV_INT8 = 0, 1, 2
QUANT_EPS = tl.constexpr(1e-8)  # same as reference.QUANT_EPS
# log2 of P's quantization multiplier per PV mode (none, fp8 e4m3 448, int8 127)
P_LOG2_SCALES = (0.0, 8.807354922057604, 6.988684686772166)


# Quantization multiplies by the scale's reciprocal, formed once per block or channel with IEEE
# round-to-nearest (`div_rn`), as torch does in the reference: Triton's plain `/` on a GPU is the
# approximate division, and bf16 inputs can land exactly on rounding ties (x / scale = k + 0.5), where
# an ulp of error would round the other way. One IEEE reciprocal per block and products, with K's mean
# over sampled tokens, instead of a division per element and the mean over all tokens: faster prologue,
# benchmarks/results/prologue-reciprocal-ab-h200.json.


@triton.jit
def _round_half_even(x):
    # exact round-to-nearest-even for |x| < 2**22 in float32: adding 1.5 * 2**23 leaves no fraction bits
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _int_to_float(x):
    # exact int32 -> float32 for |x| < 2**22 without I2F, which Hopper issues at the exp2 unit's
    # quarter rate: x + bits(1.5 * 2**23) read as a float is 1.5 * 2**23 + x. Integer QK sums stay
    # below 2**21 (128 channels x 127 x 127), so this is the same value as .to(tl.float32).
    return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


# Integer scores enter the softmax offset by 1.5 * 2**23: the QK sum x read as a float is 1.5 * 2**23 + x
# (one integer add, as in _int_to_float), and the offset is taken out of the row max and folded into the
# per-row term of the exp2 FMA, saving a float subtraction per score. That term, 1.5 * 2**23 * scale, is
# rounded once: at most 1.5 integer units of score, against the ~100 units of int8 rounding in x itself.
INT_SCORE_OFFSET = tl.constexpr(12582912.0)


@triton.jit
def _offset_int_scores(x):
    # 1.5 * 2**23 + x, exactly, for |x| < 2**22 (see INT_SCORE_OFFSET)
    return (x + 0x4B400000).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_int(x):
    # round-to-nearest-even float32 -> int32 for |x| < 2**22 without F2I (quarter rate as I2F)
    return (x + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _quantize(x, scale, qmax):
    # the reference's grid (reference.quantize_symmetric): x times the IEEE reciprocal of the scale,
    # in [-qmax, qmax], rounded to nearest. Clamping before rounding (the same result, qmax being an
    # integer) keeps the product from being contracted with the rounding's add into one FMA, which
    # would round once where torch rounds twice.
    return _round_half_even(tl.minimum(tl.maximum(x * tl.math.div_rn(1.0, scale), -qmax), qmax))


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_block(x, QK_MODE: tl.constexpr):
    # a float32 tile on the per-block grid of integer QK (int8 +-127, int4 +-7): the values and their
    # scale max(max|x|, eps) / qmax, as the reference's quantize_per_block. int4 values are held in
    # int8 times 16, with the scale over 16 (both exact): the same products and results, but integer
    # scores 256 times larger, so INT_SCORE_OFFSET's rounding is as small for int4 as for int8
    qmax = 127.0 if QK_MODE == 1 else 7.0
    # NaN-propagating max (tl.max and tl.maximum drop NaN): a NaN in the tile makes its scale NaN, so
    # the scores of the block are NaN, as the reference's (the values themselves clamp to finite ones)
    amax = tl.reduce(tl.reduce(tl.abs(x), 1, _max_nan), 0, _max_nan)
    scale = tl.math.div_rn(tl.maximum(amax, QUANT_EPS, propagate_nan=tl.PropagateNan.ALL), qmax)
    values = _quantize(x, scale, qmax)
    if QK_MODE == 2:
        values *= 16.0
        scale *= 0.0625
    return values.to(tl.int8), scale


@triton.jit
def _quantize_rows(x, QK_MODE: tl.constexpr):
    # `_quantize_block` with one scale per row of the tile (per key: the reference's k_scale="token"), [rows]
    qmax = 127.0 if QK_MODE == 1 else 7.0
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.math.div_rn(tl.maximum(amax, QUANT_EPS, propagate_nan=tl.PropagateNan.ALL), qmax)
    values = _quantize(x, scale[:, None], qmax)
    if QK_MODE == 2:
        values *= 16.0
        scale *= 0.0625
    return values.to(tl.int8), scale


@triton.jit
def _kept_keys(KeyMask, stride_mb, stride_ms, b64, offs_n, N, suffix_start):
    # bool per position of offs_n (reordered key positions): a key a query may attend, i.e. a position < N
    # before the suffix or one the key mask [B, suffix] keeps (the suffix is never reordered: its positions
    # are the same in both orders)
    in_suffix = (offs_n >= suffix_start) & (offs_n < N)
    kept = tl.load(KeyMask + b64 * stride_mb + (offs_n - suffix_start) * stride_ms, mask=in_suffix, other=0)
    return (offs_n < suffix_start) | (in_suffix & (kept != 0))


@triton.jit
def _gather_rows(base, orig, valid, stride_n, stride_d, offs_d):
    # the rows `orig` (original token positions) of one (batch, head) of the caller's q, k or v, columns
    # offs_d; rows past the sequence read as 0
    return tl.load(base + orig[:, None] * stride_n + offs_d[None, :] * stride_d, mask=valid[:, None], other=0.0)


# 8-bit V is stored with the keys of every 16 in the order the 8-bit PV product reads them. The QK
# product leaves key columns {2t, 2t+1, 2t+8, 2t+9} of each 16 in a thread's registers, where an 8-bit
# A operand wants keys {4t, ..., 4t+3} (mma.sync and wgmma alike). Taking P's columns in that order
# (a permutation of index bits the compiler resolves to the same registers) and V's rows in the same
# order leaves the product unchanged, and P goes from one product to the next without shuffles.
@triton.jit
def _pv_key_at(j):
    # the key (a position in the reordered sequence) that 8-bit V holds at position j: bits 2-3 of j
    # move to bits 1-2 and bit 1 to bit 3, within its 16
    return (j & ~14) | ((j >> 1) & 6) | ((j & 2) << 2)


@triton.jit
def _in_pv_key_order(p):
    # P [M, BN] with its columns in 8-bit V's key order: column j holds key _pv_key_at(j)
    M: tl.constexpr = p.shape[0]
    BN: tl.constexpr = p.shape[1]
    return tl.reshape(tl.permute(tl.reshape(p, [M, BN // 16, 2, 4, 2]), (0, 1, 3, 2, 4)), [M, BN])


@triton.jit
def _kv_prologue_kernel(
    K, V, KMean, VAmax, KQ, KScale, VQ, Q, QQ, QScale, KeyMask,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_mb, stride_ms,
    Orders, N, N_PAD, H, NQ, prefix, frames, height, width, suffix_start,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QK_MODE: tl.constexpr, PV_MODE: tl.constexpr,
    WRITE_Q: tl.constexpr, BLOCK_Q: tl.constexpr, HAS_KEY_MASK: tl.constexpr, K_PER_TOKEN: tl.constexpr,
):
    kb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    order = tl.load(Orders + h)
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = offs_n < N
    orig = reordered_to_original(offs_n, order, prefix, frames, height, width)
    bh64 = bh.to(tl.int64)

    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    offs_d = tl.arange(0, HEAD_DIM)
    if QK_MODE == 0:
        # reordered copy in the input dtype, [bh, n, d]
        k = _gather_rows(k_base, orig, valid, stride_kn, stride_kd, offs_d)
        tl.store(KQ + bh64 * N_PAD * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :], k)
    else:
        k = _gather_rows(k_base, orig, valid, stride_kn, stride_kd, offs_d)
        mean = tl.load(KMean + bh64 * HEAD_DIM + offs_d)
        k = tl.where(valid[:, None], k.to(tl.float32) - mean[None, :], 0.0)
        if K_PER_TOKEN:  # KScale [B*H, N_PAD]: keys past the sequence are zeros, their scale eps / qmax
            kq, scale = _quantize_rows(k, QK_MODE)
            tl.store(KScale + bh64 * N_PAD + offs_n, scale)
        else:  # KScale [B*H, NK]
            kq, scale = _quantize_block(k, QK_MODE)
            tl.store(KScale + bh64 * (N_PAD // BLOCK_N) + kb, scale)
        tl.store(KQ + bh64 * N_PAD * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :], kq)

    if WRITE_Q and kb < NQ:
        # query block kb (BLOCK_Q >= BLOCK_N rows, so the key-block grid covers every query block),
        # reordered into [B*H, NQ*BLOCK_Q, D] in the input dtype or quantized per block (scales
        # [B*H, NQ]) on the grid the kernel's in-register quantization uses, for KernelConfig.q_tma
        offs_q = kb * BLOCK_Q + tl.arange(0, BLOCK_Q)
        valid_q = offs_q < N
        orig_q = reordered_to_original(offs_q, order, prefix, frames, height, width)
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        q = _gather_rows(q_base, orig_q, valid_q, stride_qn, stride_qd, offs_d)
        if QK_MODE != 0:
            q, q_scale = _quantize_block(q.to(tl.float32), QK_MODE)
            tl.store(QScale + bh64 * NQ + kb, q_scale)
        tl.store(QQ + (bh64 * NQ * BLOCK_Q + offs_q[:, None]) * HEAD_DIM + offs_d[None, :], q)

    # V rows of padded keys (HAS_KEY_MASK) are stored as zeros: their P is 0, and a NaN there must not reach
    # the P V product (0 * NaN). Their values still enter V's per-channel scales, as in the reference.
    if PV_MODE == 0:
        if HAS_KEY_MASK:
            valid = valid & _kept_keys(KeyMask, stride_mb, stride_ms, b.to(tl.int64), offs_n, N, suffix_start)
        v = _gather_rows(v_base, orig, valid, stride_vn, stride_vd, offs_d)
        tl.store(VQ + bh64 * N_PAD * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :], v)
    else:
        # row j of the tile is key _pv_key_at(j): the gather takes the rows in that order, and the
        # (transposed) store stays contiguous along keys
        offs_v = _pv_key_at(offs_n)
        orig_v = reordered_to_original(offs_v, order, prefix, frames, height, width)
        valid_v = offs_v < N
        if HAS_KEY_MASK:
            valid_v = valid_v & _kept_keys(KeyMask, stride_mb, stride_ms, b.to(tl.int64), offs_v, N, suffix_start)
        v = _gather_rows(v_base, orig_v, valid_v, stride_vn, stride_vd, offs_d)
        v_scale = tl.math.div_rn(tl.maximum(tl.load(VAmax + bh64 * HEAD_DIM + offs_d), QUANT_EPS),
                                 448.0 if PV_MODE == 1 else 127.0)
        # one IEEE reciprocal per channel, then products (as the reference): cheaper than a division per
        # element (benchmarks/results/prologue-reciprocal-ab-h200.json)
        v = v.to(tl.float32) * tl.math.div_rn(1.0, v_scale)[None, :]
        # transposed store: VQ[bh, d, j]
        dst = VQ + bh64 * HEAD_DIM * N_PAD + offs_d[None, :] * N_PAD + offs_n[:, None]
        if PV_MODE == 1:
            tl.store(dst, v.to(tl.float8e4nv))
        else:
            # clamped before rounding, as in _quantize (no FMA contraction of the product)
            tl.store(dst, _round_half_even(tl.minimum(tl.maximum(v, -127.0), 127.0)).to(tl.int8))


@triton.jit
def _load_key_rows(Buf_bh, Desc, bh, kb, N_PAD, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr, USE_TMA: tl.constexpr):
    # key block kb of a prologue buffer [B*H, N_PAD, WIDTH]: [BLOCK_N, WIDTH]
    if USE_TMA:
        tile = Desc.load([bh * N_PAD + kb * BLOCK_N, 0])
    else:
        offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        tile = tl.load(Buf_bh + offs_n[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :])
    return tile


@triton.jit
def _load_key_columns(Buf_bh, Desc, bh, kb, N_PAD, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      USE_TMA: tl.constexpr):
    # key block kb of a transposed prologue buffer [B*H, HEAD_DIM, N_PAD] (8-bit V): [BLOCK_N, HEAD_DIM]
    if USE_TMA:
        tile = Desc.load([bh * HEAD_DIM, kb * BLOCK_N]).T
    else:
        offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        tile = tl.load(Buf_bh + tl.arange(0, HEAD_DIM)[None, :] * N_PAD + offs_n[:, None])
    return tile


@triton.jit
def _key_block_scores(
    q, score_scale, kb, KQ_bh, KScale_bh, KDesc, bh, N, N_PAD,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QK_MODE: tl.constexpr, MASK_N: tl.constexpr,
    USE_TMA: tl.constexpr, K_PER_TOKEN: tl.constexpr,
):
    # raw scores of key block kb (integer ones offset by INT_SCORE_OFFSET), and the one multiplier that
    # takes them to log2 units (softmax scale, log2(e) and the Q/K dequantization scales): the update
    # applies it inside exp2's argument, so scaling and subtracting the row max are one FMA per score.
    # With a scale per key (K_PER_TOKEN) the scores come back times their key's scale, without the offset
    # (which no longer folds into one per-row term), and the multiplier holds the rest
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    if QK_MODE == 0:
        k = _load_key_rows(KQ_bh, KDesc, bh, kb, N_PAD, BLOCK_N, HEAD_DIM, USE_TMA)
        s = tl.dot(q, tl.trans(k))
        scale = score_scale
    elif K_PER_TOKEN:
        k = _load_key_rows(KQ_bh, KDesc, bh, kb, N_PAD, BLOCK_N, HEAD_DIM, USE_TMA)
        s = _int_to_float(tl.dot(q, tl.trans(k), out_dtype=tl.int32)) * tl.load(KScale_bh + offs_n)[None, :]
        scale = score_scale
    else:  # int8 or int4 values, one per byte
        k = _load_key_rows(KQ_bh, KDesc, bh, kb, N_PAD, BLOCK_N, HEAD_DIM, USE_TMA)
        s = _offset_int_scores(tl.dot(q, tl.trans(k), out_dtype=tl.int32))
        scale = score_scale * tl.load(KScale_bh + kb)
    if MASK_N:
        s = tl.where((offs_n < N)[None, :], s, float("-inf"))
    return s, scale


@triton.jit
def _key_block_update(
    acc, l_i, m_i, s, scale, kb, VQ_bh, VDesc, bh, N_PAD,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PV_MODE: tl.constexpr, P_LOG2_SCALE: tl.constexpr,
    USE_TMA: tl.constexpr, INT_SCORES: tl.constexpr,
):
    # online softmax over key block kb's scores, then the P V product
    block_max = tl.max(s, axis=1)
    if INT_SCORES:
        block_max -= INT_SCORE_OFFSET
    m_new = tl.maximum(m_i, block_max * scale)  # scale > 0, so the max commutes with it
    alpha = tl.math.exp2(m_i - m_new)
    # P's quantization multiplier (448 for fp8, 127 for int8) rides in the exponent: p is P * c, and so
    # is the row sum l, which the epilogue divides by
    p_shift = m_new - P_LOG2_SCALE
    if INT_SCORES:
        p_shift += INT_SCORE_OFFSET * scale
    p = tl.math.exp2(s * scale - p_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]

    if PV_MODE == 0:
        v = _load_key_rows(VQ_bh, VDesc, bh, kb, N_PAD, BLOCK_N, HEAD_DIM, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc=acc)
    elif PV_MODE == 1:
        v = _load_key_columns(VQ_bh, VDesc, bh, kb, N_PAD, BLOCK_N, HEAD_DIM, USE_TMA)
        acc = tl.dot(_in_pv_key_order(p).to(tl.float8e4nv), v, acc=acc)
    else:
        v = _load_key_columns(VQ_bh, VDesc, bh, kb, N_PAD, BLOCK_N, HEAD_DIM, USE_TMA)
        acc += _int_to_float(tl.dot(_in_pv_key_order(_round_to_int(p)).to(tl.int8), v, out_dtype=tl.int32))
    return acc, l_i, m_new


@triton.jit
def _attention_kernel(
    Q, Out, KQ, KScale, VQ, VAmax, KDesc, VDesc, QDesc, QScale,
    Orders, Counts, Indices, Schedule, KeyMask,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_ob, stride_oh, stride_on, stride_od, stride_mb, stride_ms,
    N, N_PAD, H, NQ, NK, MAX_ACTIVE, prefix, frames, height, width, suffix_start, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_MODE: tl.constexpr, PV_MODE: tl.constexpr, EVEN_N: tl.constexpr,
    P_LOG2_SCALE: tl.constexpr, USE_TMA: tl.constexpr, OVERLAP_QK: tl.constexpr, Q_TMA: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, K_PER_TOKEN: tl.constexpr,
):
    rank = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    bh64 = bh.to(tl.int64)
    qb = tl.load(Schedule + h * NQ + rank)  # the query block this program computes
    row = h * NQ + qb
    order = tl.load(Orders + h)

    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = offs_m < N
    orig_m = reordered_to_original(offs_m, order, prefix, frames, height, width)
    q_base = Q + b64 * stride_qb + h64 * stride_qh

    offs_d = tl.arange(0, HEAD_DIM)
    score_scale = qk_scale
    if Q_TMA:
        # the prologue's reordered (and for integer QK quantized) copy, by one descriptor load
        q = QDesc.load([(bh * NQ + qb) * BLOCK_M, 0])
        if QK_MODE != 0:
            score_scale = tl.load(QScale + bh64 * NQ + qb) * qk_scale
    else:
        # the query block, quantized per block in registers for integer QK (int8 or int4 values in int8):
        # each query block is read once, so a quantized copy would only add a write and a read
        q = _gather_rows(q_base, orig_m, valid_m, stride_qn, stride_qd, offs_d)
        if QK_MODE != 0:
            q, q_scale = _quantize_block(q.to(tl.float32), QK_MODE)
            score_scale = q_scale * qk_scale

    KQ_bh = KQ + bh64 * N_PAD * HEAD_DIM
    KScale_bh = KScale + bh64 * (N_PAD if K_PER_TOKEN else NK)  # a scale per key, or per key block
    # integer scores carry INT_SCORE_OFFSET into the update unless they were scaled per key
    OFFSET_SCORES: tl.constexpr = QK_MODE != 0 and not K_PER_TOKEN
    VQ_bh = VQ + bh64 * HEAD_DIM * N_PAD

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    count = tl.load(Counts + row)
    active = Indices + row.to(tl.int64) * MAX_ACTIVE
    n_unmasked = count
    if HAS_KEY_MASK:
        # the entries of the blocks from the suffix's first on (at most NK - first_masked of them) end the
        # ascending list; they include the last, partial block, so EVEN_N's tail below is not needed
        first_masked = suffix_start // BLOCK_N
        for j in range(0, tl.minimum(count, NK - first_masked)):
            n_unmasked -= (tl.load(active + count - 1 - j) >= first_masked).to(count.dtype)
    elif not EVEN_N:
        # the sequence's last key block holds positions >= N; if active it is the list's last entry
        last = tl.load(active + tl.maximum(count - 1, 0))
        has_tail = (count > 0) & (last == NK - 1)
        n_unmasked = count - has_tail.to(tl.int32)
    if OVERLAP_QK:
        # software-pipelined by one key block: the scores of block i+1 are issued before block i's
        # softmax, so the (asynchronous) QK product runs under the exp2 work. The last iteration
        # computes one product it does not use (its own block again).
        kb = tl.load(active)
        s, scale = _key_block_scores(
            q, score_scale, kb, KQ_bh, KScale_bh, KDesc, bh, N, N_PAD, HEAD_DIM, BLOCK_N, QK_MODE, False,
            USE_TMA, K_PER_TOKEN)
        for i in range(0, n_unmasked):
            kb_next = tl.load(active + tl.minimum(i + 1, n_unmasked - 1))
            s_next, scale_next = _key_block_scores(
                q, score_scale, kb_next, KQ_bh, KScale_bh, KDesc, bh, N, N_PAD, HEAD_DIM, BLOCK_N, QK_MODE,
                False, USE_TMA, K_PER_TOKEN)
            acc, l_i, m_i = _key_block_update(
                acc, l_i, m_i, s, scale, kb, VQ_bh, VDesc, bh, N_PAD, HEAD_DIM, BLOCK_N, PV_MODE,
                P_LOG2_SCALE, USE_TMA, OFFSET_SCORES)
            s, scale, kb = s_next, scale_next, kb_next
    else:
        for i in range(0, n_unmasked):
            kb = tl.load(active + i)
            s, scale = _key_block_scores(
                q, score_scale, kb, KQ_bh, KScale_bh, KDesc, bh, N, N_PAD, HEAD_DIM, BLOCK_N, QK_MODE, False,
                USE_TMA, K_PER_TOKEN)
            acc, l_i, m_i = _key_block_update(
                acc, l_i, m_i, s, scale, kb, VQ_bh, VDesc, bh, N_PAD, HEAD_DIM, BLOCK_N, PV_MODE,
                P_LOG2_SCALE, USE_TMA, OFFSET_SCORES)
    if HAS_KEY_MASK:
        for i in range(n_unmasked, count):
            kb = tl.load(active + i)
            kept = _kept_keys(KeyMask, stride_mb, stride_ms, b64, kb * BLOCK_N + tl.arange(0, BLOCK_N), N,
                              suffix_start)
            # the mask is one row for every query of the tile: a block of padding only adds nothing and is
            # skipped, so every block that runs has a finite score in each row (no -inf running max meets
            # another -inf in exp2's argument)
            if tl.max(kept.to(tl.int32), axis=0) > 0:
                s, scale = _key_block_scores(
                    q, score_scale, kb, KQ_bh, KScale_bh, KDesc, bh, N, N_PAD, HEAD_DIM, BLOCK_N, QK_MODE,
                    False, USE_TMA, K_PER_TOKEN)
                s = tl.where(kept[None, :], s, float("-inf"))
                acc, l_i, m_i = _key_block_update(
                    acc, l_i, m_i, s, scale, kb, VQ_bh, VDesc, bh, N_PAD, HEAD_DIM, BLOCK_N, PV_MODE,
                    P_LOG2_SCALE, USE_TMA, OFFSET_SCORES)
    elif not EVEN_N:
        if has_tail:
            s, scale = _key_block_scores(
                q, score_scale, NK - 1, KQ_bh, KScale_bh, KDesc, bh, N, N_PAD, HEAD_DIM, BLOCK_N, QK_MODE,
                True, USE_TMA, K_PER_TOKEN)
            acc, l_i, m_i = _key_block_update(
                acc, l_i, m_i, s, scale, NK - 1, VQ_bh, VDesc, bh, N_PAD, HEAD_DIM, BLOCK_N, PV_MODE,
                P_LOG2_SCALE, USE_TMA, OFFSET_SCORES)

    # epilogue: normalize, dequantize V per channel, write rows at their original positions
    offs_d = tl.arange(0, HEAD_DIM)
    # l is 0 in a row with no active block (zeros out) and NaN after a NaN score, which the division keeps
    # (integer P rounds NaN to a finite value, so acc alone would lose it)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if PV_MODE != 0:
        # l carries P's multiplier, so only V's per-channel scale is left. A NaN in a channel of V makes
        # its max NaN (propagated here: tl.maximum would drop it), so the channel is NaN in every row of
        # the head, as with the reference's scale; rows with no active block stay zero
        v_amax = tl.maximum(tl.load(VAmax + bh64 * HEAD_DIM + offs_d), QUANT_EPS, propagate_nan=tl.PropagateNan.ALL)
        out = tl.where(l_i[:, None] == 0.0, 0.0, out * (v_amax / (448.0 if PV_MODE == 1 else 127.0))[None, :])
    o_ptr = Out + b64 * stride_ob + h64 * stride_oh + orig_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=valid_m[:, None])
