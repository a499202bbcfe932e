"""A warp-specialized attention kernel for Hopper (sm_90), written in Gluon, at 128-row query tiles and
64-key blocks (`KernelConfig.warp_specialized`): bf16/fp16 QK and PV (pinned at D=128, where it is the
fastest kernel), or int8/int4 QK + fp8 PV (correct, but slower than the Triton kernel: not pinned).

Why a second kernel: at D=128 the Triton kernel of `block_sparse_attention.py` computes a query tile
with one warpgroup whose tensor-core products and softmax mostly alternate, and Triton 3.6's automatic
warp specialization does not apply to it (BENCHMARKS.md, fifth session). Here the roles are split by
hand, as FlashAttention-3 does:

- a loader warp issues the TMA loads: the tile's two 64-row query halves once, then the active key
  blocks' K and V tiles into a ring of `STAGES` shared-memory slots (ready / empty mbarriers);
- two consumer warpgroups, one per 64-row half, each run the online softmax over the same key blocks
  with Q and P as register operands of wgmma. Each issues block i's QK product together with block
  i-1's P V product and runs block i's softmax while the P V product is still on the tensor cores;
  the two warpgroups, running independently, fill each other's gaps.

The inputs are the prologue's buffers (`triton_backend.prepare_kv`): K and V reordered and contiguous,
so every tile is one descriptor load; bf16/fp16 consumers gather their query rows from the caller's q,
int8/int4 Q (quantized per 128-row tile) comes from the prologue too. 8-bit V holds the keys of every 16
in the order the P V product reads P from registers (`block_sparse_attention._pv_key_at`). Its
definition is the same as the Triton kernel's (`reference.py`), and the tests compare the two on the
GPU; the Triton interpreter cannot run Gluon.
"""

from __future__ import annotations

import functools

import torch
import triton

from .. import layout

try:  # Gluon is experimental in triton; without it the Triton kernel runs instead
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed triton
    gluon = None

QUERY_HALF = 64  # rows per consumer warpgroup (the wgmma M of one warpgroup)
BLOCK_M = 2 * QUERY_HALF
BLOCK_N = 64
# (qk, pv) modes: int4 values are stored one per byte and run the int8 product (block_sparse_attention)
MODES = (("bf16", "bf16"), ("int8", "fp8"), ("int4", "fp8"))


# Gluon's API changes between triton releases: the kernel is used with the releases it was tested with
# on a GPU, and elsewhere the Triton kernel runs (same result, slower at D=128)
TESTED_TRITON = ("3.6",)


def takes_strides(q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel reads q and writes out as laid out: unit stride along D. (A stride passed to a
    Gluon worker partition is a runtime value, so 1 must be built in for 16-byte accesses.)"""
    return q.stride(-1) == 1 and out.stride(-1) == 1


def available(device: torch.device) -> bool:
    """Whether this kernel runs on `device`: a tested triton with Gluon and an sm_90 GPU (wgmma is
    Hopper's; Blackwell has other matrix instructions)."""
    return (gluon is not None and triton.__version__.startswith(TESTED_TRITON) and device.type == "cuda"
            and _capability(device) == (9, 0))


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    # asked on every call of the op: torch's query costs more host time than the rest of this check
    return torch.cuda.get_device_capability(device)


if gluon is not None:
    from . import block_sparse_attention as triton_kernels
    from .index_math import jit_mirror

    _order_axes = jit_mirror(layout.order_axis_sizes_and_strides, jit=gluon.jit)
    _reordered_to_original = jit_mirror(layout.reordered_to_original, jit=gluon.jit,
                                        order_axis_sizes_and_strides=_order_axes)
    # the Triton kernel's integer-score offset, P key order and quantization constants, shared, not restated
    _offset_int_scores = jit_mirror(triton_kernels._offset_int_scores.fn, jit=gluon.jit)
    _INT_SCORE_OFFSET = triton_kernels.INT_SCORE_OFFSET
    _in_pv_key_order = jit_mirror(triton_kernels._in_pv_key_order.fn, jit=gluon.jit)
    _QUANT_EPS = triton_kernels.QUANT_EPS
    _FP8_P_LOG2_SCALE = gl.constexpr(triton_kernels.P_LOG2_SCALES[triton_kernels.PV_FP8])

    @gluon.jit
    def _tile(Schedule, H, NQ):
        # (b*H + h, head, query block, mask row) of this program; query blocks run heaviest first, and
        # the program id's fast axis is the query block, so the programs resident at a time share a
        # head's K and V in L2 (with the head as the fast axis, sparse rows ran up to 1.2x slower)
        bh = gl.program_id(1)
        h = bh % H
        qb = gl.load(Schedule + h * NQ + gl.program_id(0))
        return bh, h, qb, h * NQ + qb

    @gluon.jit
    def _loader(args, Q_GATHER: gl.constexpr):
        (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
         Q, stride_qb, stride_qh, stride_qn,
         Out, Orders, Counts, Indices, Schedule, KScale, QScale, VAmax, stride_ob, stride_oh, stride_on,
         N, N_PAD, H, NQ, NK, MAX_ACTIVE, prefix, frames, height, width, qk_scale) = args
        STAGES: gl.constexpr = k_smem.shape[0]
        HALF: gl.constexpr = q_smem.shape[1]
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        BN: gl.constexpr = k_smem.shape[1]
        QUANTIZED: gl.constexpr = q_smem.dtype == gl.int8
        bh, h, qb, row = _tile(Schedule, H, NQ)
        if not Q_GATHER:
            for c in gl.static_range(2):
                mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [(bh * NQ + qb) * 2 * HALF + c * HALF, 0], q_ready.index(c),
                                                q_smem.index(c))
        count = gl.load(Counts + row)
        active = Indices + row.to(gl.int64) * MAX_ACTIVE
        for i in range(count):
            slot = i % STAGES
            kb = gl.load(active + i)
            # mbarriers start with phase 1 complete: the first pass over the ring does not wait
            mbarrier.wait(kv_empty.index(slot), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [bh * N_PAD + kb * BN, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            if QUANTIZED:  # 8-bit V is stored transposed, [B*H*D, N_PAD]: the PV product reads it K-major
                tma.async_copy_global_to_shared(v_desc, [bh * HEAD_DIM, kb * BN], v_ready.index(slot),
                                                v_smem.index(slot))
            else:
                tma.async_copy_global_to_shared(v_desc, [bh * N_PAD + kb * BN, 0], v_ready.index(slot),
                                                v_smem.index(slot))

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale, key0, N, MASKED: gl.constexpr, s_layout: gl.constexpr,
                      P_LOG2_SCALE: gl.constexpr, INT_SCORES: gl.constexpr):
        # one key block's online-softmax update in base 2 on raw scores s (qk_scale takes them to log2
        # units; integer ones come offset, as in the Triton kernel); returns P (unnormalized, times
        # 2**P_LOG2_SCALE: fp8 P's multiplier, which the row sum carries too), the new row max and sum,
        # and the factor alpha that rescales what came before
        if MASKED:
            offs_n = key0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(offs_n < N, 0), s, float("-inf"))
        block_max = gl.max(s, axis=1)
        if INT_SCORES:
            block_max -= _INT_SCORE_OFFSET
        m_new = gl.maximum(m_i, block_max * qk_scale)  # qk_scale > 0: the max commutes with it
        alpha = gl.exp2(m_i - m_new)
        p_shift = m_new - P_LOG2_SCALE
        if INT_SCORES:
            p_shift += _INT_SCORE_OFFSET * qk_scale
        p = gl.exp2(s * qk_scale - gl.expand_dims(p_shift, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _block_scale(score_scale, KScale, active, i, bh, NK, QUANTIZED: gl.constexpr):
        # the multiplier that takes key block i's raw scores to log2 units: the softmax scale with log2 e,
        # and for int8 QK the query tile's and the key block's scales
        if QUANTIZED:
            return score_scale * gl.load(KScale + bh * NK + gl.load(active + i))
        else:
            return score_scale

    @gluon.jit
    def _as_float(s, QUANTIZED: gl.constexpr):
        if QUANTIZED:
            return _offset_int_scores(s)
        else:
            return s

    @gluon.jit
    def _consumer(args, HALF_INDEX: gl.constexpr, Q_GATHER: gl.constexpr):
        (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
         Q, stride_qb, stride_qh, stride_qn,
         Out, Orders, Counts, Indices, Schedule, KScale, QScale, VAmax, stride_ob, stride_oh, stride_on,
         N, N_PAD, H, NQ, NK, MAX_ACTIVE, prefix, frames, height, width, qk_scale) = args
        STAGES: gl.constexpr = k_smem.shape[0]
        HALF: gl.constexpr = q_smem.shape[1]
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        BN: gl.constexpr = k_smem.shape[1]
        # int8 QK + fp8 PV (int8 Q and K, fp8 V stored transposed), or bf16/fp16 throughout
        QUANTIZED: gl.constexpr = q_smem.dtype == gl.int8
        P_DTYPE: gl.constexpr = gl.float8e4nv if QUANTIZED else q_smem.dtype
        P_LOG2_SCALE: gl.constexpr = _FP8_P_LOG2_SCALE if QUANTIZED else 0.0  # log2(448): fp8 P's range
        BITS: gl.constexpr = q_smem.dtype.primitive_bitwidth  # 8 or 16, for Q, K, P and V alike
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 256 // BITS])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 256 // BITS])
        # Q and P are the products' A operands, from registers: with Q read from shared memory, a 64 x 64
        # QK product would need shared memory's whole bandwidth (2 KB of Q and 2 KB of K per 32 clocks)
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=32 // BITS)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=32 // BITS)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        acc_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

        bh, h, qb, row = _tile(Schedule, H, NQ)
        count = gl.load(Counts + row)
        active = Indices + row.to(gl.int64) * MAX_ACTIVE
        # the sequence's last key block holds positions >= N; if active it is the list's last entry
        last = gl.load(active + gl.maximum(count - 1, 0))
        tail = (N % BN != 0) & (count > 0) & (last == NK - 1)
        tail_key0 = (NK - 1) * BN
        score_scale = qk_scale
        if QUANTIZED:
            score_scale = gl.load(QScale + bh * NQ + qb) * qk_scale  # Q is quantized per 128-row tile

        m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([HALF], gl.float32, row_layout)
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        zero_s = gl.zeros([HALF, BN], gl.int32 if QUANTIZED else gl.float32, s_layout)
        if Q_GATHER:
            q = _gather_query_half(Q, stride_qb, stride_qh, stride_qn, bh, h, qb, HALF_INDEX, N, H, Orders,
                                   prefix, frames, height, width, HALF, HEAD_DIM, q_layout)
        else:
            mbarrier.wait(q_ready.index(HALF_INDEX), 0)
            q = q_smem.index(HALF_INDEX).load(q_layout)
        if count > 0:
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = _as_float(warpgroup_mma_wait(num_outstanding=0, deps=(s,)), QUANTIZED)
            scale = _block_scale(score_scale, KScale, active, 0, bh, NK, QUANTIZED)
            if tail & (count == 1):
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, scale, tail_key0, N, True, s_layout, P_LOG2_SCALE,
                                                   QUANTIZED)
            else:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, scale, tail_key0, N, False, s_layout, P_LOG2_SCALE,
                                                   QUANTIZED)
            slot = 0
            for i in range(1, count):
                prev = slot
                slot = i % STAGES
                scale = _block_scale(score_scale, KScale, active, i, bh, NK, QUANTIZED)
                # block i's scores and block i-1's P V go out together; the softmax of block i then
                # runs while the P V product is on the tensor cores
                mbarrier.wait(k_ready.index(slot), (i // STAGES) & 1)
                mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
                s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                acc = warpgroup_mma(_p_operand(p, P_DTYPE, p_layout), _v_operand(v_smem.index(prev), QUANTIZED), acc,
                                    is_async=True)
                s = _as_float(warpgroup_mma_wait(num_outstanding=1, deps=(s,)), QUANTIZED)
                if tail & (i == count - 1):
                    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, scale, tail_key0, N, True, s_layout,
                                                       P_LOG2_SCALE, QUANTIZED)
                else:
                    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, scale, tail_key0, N, False, s_layout,
                                                       P_LOG2_SCALE, QUANTIZED)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, acc_row_layout), 1)
            mbarrier.wait(v_ready.index(slot), ((count - 1) // STAGES) & 1)
            acc = warpgroup_mma(_p_operand(p, P_DTYPE, p_layout), _v_operand(v_smem.index(slot), QUANTIZED), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        # epilogue: normalize (l carries P's multiplier), dequantize 8-bit V per channel, write each row
        # at its original position (a row with no active block writes zeros)
        l_acc = gl.convert_layout(l_i, acc_row_layout)
        out = acc / gl.expand_dims(gl.where(l_acc > 0.0, l_acc, 1.0), 1)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        if QUANTIZED:
            v_scale = gl.maximum(gl.load(VAmax + bh.to(gl.int64) * HEAD_DIM + offs_d), _QUANT_EPS) / 448.0
            out = out * gl.expand_dims(v_scale, 0)
        offs_m = qb * 2 * HALF + HALF_INDEX * HALF + gl.arange(0, HALF, layout=acc_row_layout)
        order = gl.load(Orders + h)
        orig_m = _reordered_to_original(offs_m, order, prefix, frames, height, width)
        ptr = (Out + (bh // H).to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
               + gl.expand_dims(orig_m.to(gl.int64) * stride_on, 1) + gl.expand_dims(offs_d, 0))
        gl.store(ptr, out.to(Out.dtype.element_ty), mask=gl.expand_dims(offs_m < N, 1))

    @gluon.jit
    def _gather_query_half(Q, stride_qb, stride_qh, stride_qn, bh, h, qb, HALF_INDEX: gl.constexpr, N, H,
                           Orders, prefix, frames, height, width, HALF: gl.constexpr, HEAD_DIM: gl.constexpr,
                           q_layout: gl.constexpr):
        # this warpgroup's 64 rows of the reordered query tile, straight from the caller's q (16-byte
        # loads along D, then into the A-operand layout): the prologue need not copy Q
        rows: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
        offs_m = qb * 2 * HALF + HALF_INDEX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, rows))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows))
        orig_m = _reordered_to_original(offs_m, gl.load(Orders + h), prefix, frames, height, width)
        ptr = (Q + (bh // H).to(gl.int64) * stride_qb + h.to(gl.int64) * stride_qh
               + gl.expand_dims(orig_m.to(gl.int64) * stride_qn, 1) + gl.expand_dims(offs_d, 0))
        q = gl.load(ptr, mask=gl.expand_dims(offs_m < N, 1), other=0.0)
        return gl.convert_layout(q, q_layout)

    @gluon.jit
    def _p_operand(p, P_DTYPE: gl.constexpr, p_layout: gl.constexpr):
        # P (fp32, the QK accumulator's layout) as the PV product's A operand, converted where it is
        # used: a loop-carried 8-bit tensor is kept one byte per register and repacked before each
        # product (three PRMT per register)
        if P_DTYPE == gl.float8e4nv:  # the one 8-bit P of MODES (the asm below converts to e4m3)
            # keys in 8-bit V's order (_in_pv_key_order): the same registers, no data moves
            p = gl.convert_layout(_in_pv_key_order(p), p_layout, assert_trivial=True)
            # four keys to one 32-bit register in place; Triton's own conversion unpacks the bytes
            # and packs them again
            packed = gl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
                "=r,r,r,r,r", [p], dtype=gl.int8, is_pure=True, pack=4)
            return packed.to(P_DTYPE, bitcast=True)
        else:
            return gl.convert_layout(p.to(P_DTYPE), p_layout)

    @gluon.jit
    def _v_operand(tile, QUANTIZED: gl.constexpr):
        # the PV product's B operand [keys, D]: 8-bit V tiles are stored [D, keys] (K-major)
        if QUANTIZED:
            return tile.permute((1, 0))
        else:
            return tile

    @gluon.jit
    def _first_half(args, Q_GATHER: gl.constexpr):
        _consumer(args, 0, Q_GATHER)

    @gluon.jit
    def _second_half(args, Q_GATHER: gl.constexpr):
        _consumer(args, 1, Q_GATHER)

    @gluon.jit
    def _warp_specialized_kernel(
        q_desc, k_desc, v_desc, Q, Out, Orders, Counts, Indices, Schedule, KScale, QScale, VAmax,
        stride_qb, stride_qh, stride_qn, stride_ob, stride_oh, stride_on,
        N, N_PAD, H, NQ, NK, MAX_ACTIVE, prefix, frames, height, width, qk_scale,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, Q_GATHER: gl.constexpr,
    ):
        HALF: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(q_ready.index(c), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumer warpgroups release a slot
        args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                Q, stride_qb, stride_qh, stride_qn,
                Out, Orders, Counts, Indices, Schedule, KScale, QScale, VAmax, stride_ob, stride_oh, stride_on,
                N, N_PAD, H, NQ, NK, MAX_ACTIVE, prefix, frames, height, width, qk_scale)
        gl.warp_specialize([(_first_half, (args, Q_GATHER)), (_second_half, (args, Q_GATHER)), (_loader, (args, Q_GATHER))],
                           [4, 1], [CONSUMER_REGS, 24])


_GLUON_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int8: "int8",
                 torch.float8_e4m3fn: "float8e4nv"}


def descriptors(qq: torch.Tensor | None, kq: torch.Tensor, vq: torch.Tensor):
    """Gluon tensor descriptors of the prologue's buffers, seen 2-D so one descriptor serves every
    (batch, head): reordered Q [B*H, NQ*128, D] and K [B*H, N_PAD, D] (bf16/fp16, or int8 values), and V
    [B*H, N_PAD, D] (bf16/fp16) or, fp8 and transposed, [B*H, D, N_PAD]. Without qq (the consumers
    gather Q) K's descriptor, of the same tile shape and dtype, stands in for Q's, which is not read."""
    D = kq.shape[-1]

    def make(t, block):
        return TensorDescriptor.from_tensor(t.reshape(-1, t.shape[-1]), list(block), _shared_layout(block, t.dtype))

    k_desc = make(kq, (BLOCK_N, D))
    v_block = (D, BLOCK_N) if vq.dtype == torch.float8_e4m3fn else (BLOCK_N, D)
    return k_desc if qq is None else make(qq, (QUERY_HALF, D)), k_desc, make(vq, v_block)


@functools.cache
def _shared_layout(block: tuple, dtype: torch.dtype):
    # built once per tile shape: get_default_for costs ~6 us of host time per call
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GLUON_DTYPES[dtype]))


def launch(q, qq, kq, vq, out, orders, counts, indices, schedule, N, n_pad, H, nq, nk,
           prefix, frames, height, width, qk_scale, k_scale, q_scale, v_amax, stages: int = 3,
           consumer_regs: int = 240):
    """Run the kernel on the prologue's buffers (for int8 QK + fp8 PV with their scales: per key block,
    per 128-row query tile, per-channel max |V|; placeholders otherwise); `out` is the caller's
    [B, H, N, D] output. With `qq` None (bf16/fp16) the consumers gather their query rows from the
    caller's `q` [B, H, N, D] themselves. q and out have unit stride along D (`takes_strides`)."""
    q_gather = qq is None
    q_desc, k_desc, v_desc = descriptors(qq, kq, vq)
    # 4 + 4 + 1 warps are allocated as three warpgroups: maxnreg x 12 warps x 32 fits the SM's 64K
    # registers (one program per SM), and setmaxnreg gives the consumers `consumer_regs` each and the
    # loader 24. Measured (H100, Wan2.1 shapes): one tile per program ran as fast as persistent
    # programs with an atomic tile counter (commit history), so the simpler grid stays.
    _warp_specialized_kernel[(nq, kq.shape[0])](
        q_desc, k_desc, v_desc, q, out, orders, counts, indices, schedule, k_scale, q_scale, v_amax, *q.stride()[:3],
        *out.stride()[:3], N, n_pad, H, nq, nk, indices.shape[-1], prefix, frames, height, width, qk_scale,
        STAGES=stages, CONSUMER_REGS=consumer_regs, Q_GATHER=q_gather, num_warps=4, maxnreg=168,
    )
    return out
