"""A warp-specialized attention kernel for Hopper (sm_90), written in Gluon, at 128-row query tiles and
64-key blocks, bf16/fp16 QK and PV (`KernelConfig.warp_specialized`; the kernel table picks it at
D=128, where it is the fastest kernel).

Why a second kernel: at D=128 the Triton kernel of `block_sparse_attention.py` computes a query tile
with one warpgroup whose tensor-core products and softmax mostly alternate, and Triton 3.6's automatic
warp specialization does not apply to it. Here the roles are split by hand, as FlashAttention-3 does:

- a loader warp issues the TMA loads of the active key blocks' K and V tiles into a ring of `STAGES`
  shared-memory slots (ready / empty mbarriers);
- two consumer warpgroups, one per 64-row half, each run the online softmax over the same key blocks
  with Q and P as register operands of wgmma. Each issues block i's QK product together with block
  i-1's P V product and runs block i's softmax while the P V product is still on the tensor cores;
  the two warpgroups, running independently, fill each other's gaps.

The inputs are the prologue's buffers (`launch.prepare_kv`): K and V reordered and contiguous,
so every tile is one descriptor load; the consumers gather their query rows from the caller's q. Its
definition is the same as the Triton kernel's (`reference.py`), and the tests compare the two on the
GPU; the Triton interpreter cannot run Gluon. (Integer QK with fp8 PV stays on the Triton kernel: a
Gluon version of it measured slower, `docs/notes/kernels-and-tiles.md`.)
"""

from __future__ import annotations

import functools

import torch

from .. import layout
from .launcher import CachedLauncher

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
MODES = (("bf16", "bf16"),)  # (qk, pv); "bf16" stands for the inputs' 16-bit type, fp16 included


# Gluon's API changes between triton releases: the kernel table picks it with the releases it was tested
# with on a GPU, and elsewhere the Triton kernel runs (same result, slower at D=128)
TESTED_TRITON = ("3.6",)


if gluon is not None:
    from .index_math import jit_mirror

    _order_axes = jit_mirror(layout.order_axis_sizes_and_strides, jit=gluon.jit)
    _reordered_to_original = jit_mirror(layout.reordered_to_original, jit=gluon.jit,
                                        order_axis_sizes_and_strides=_order_axes)
    _QUERY_HALF = gl.constexpr(QUERY_HALF)

    @gluon.jit
    def _tile(Schedule, H, NQ):
        # (b*H + h, head, query block, mask row) of this program; query blocks run heaviest first, and
        # the program id's fast axis is the query block, so the programs resident at a time share a
        # head's K and V in L2 (with the head as the fast axis, sparse rows ran slower:
        # benchmarks/results/hopper-warp-specialized-variants-h100.json)
        bh = gl.program_id(1)
        h = bh % H
        qb = gl.load(Schedule + h * NQ + gl.program_id(0))
        return bh, h, qb, h * NQ + qb

    @gluon.jit
    def _loader(args):
        (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty,
         Q, stride_qb, stride_qh, stride_qn,
         Out, Orders, Counts, Indices, Schedule, stride_ob, stride_oh, stride_on,
         N, N_PAD, H, NQ, NK, MAX_ACTIVE, prefix, frames, height, width, qk_scale) = args
        STAGES: gl.constexpr = k_smem.shape[0]
        BN: gl.constexpr = k_smem.shape[1]
        bh, h, qb, row = _tile(Schedule, H, NQ)
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
            tma.async_copy_global_to_shared(v_desc, [bh * N_PAD + kb * BN, 0], v_ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale, key0, N, MASKED: gl.constexpr, s_layout: gl.constexpr):
        # one key block's online-softmax update in base 2 on raw scores s (qk_scale takes them to log2
        # units); returns P (unnormalized), the new row max and sum, and the factor alpha that rescales
        # what came before
        if MASKED:
            offs_n = key0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(offs_n < N, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)  # qk_scale > 0: the max commutes with it
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _consumer(args, HALF_INDEX: gl.constexpr):
        (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty,
         Q, stride_qb, stride_qh, stride_qn,
         Out, Orders, Counts, Indices, Schedule, stride_ob, stride_oh, stride_on,
         N, N_PAD, H, NQ, NK, MAX_ACTIVE, prefix, frames, height, width, qk_scale) = args
        STAGES: gl.constexpr = k_smem.shape[0]
        HALF: gl.constexpr = _QUERY_HALF
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        BN: gl.constexpr = k_smem.shape[1]
        DTYPE: gl.constexpr = k_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        # Q and P are the products' A operands, from registers: with Q read from shared memory, a 64 x 64
        # QK product would need shared memory's whole bandwidth (2 KB of Q and 2 KB of K per 32 clocks)
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        acc_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

        bh, h, qb, row = _tile(Schedule, H, NQ)
        count = gl.load(Counts + row)
        active = Indices + row.to(gl.int64) * MAX_ACTIVE
        # the sequence's last key block holds positions >= N; if active it is the list's last entry
        last = gl.load(active + gl.maximum(count - 1, 0))
        tail = (N % BN != 0) & (count > 0) & (last == NK - 1)
        tail_key0 = (NK - 1) * BN

        m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([HALF], gl.float32, row_layout)
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        zero_s = gl.zeros([HALF, BN], gl.float32, s_layout)
        q = _gather_query_half(Q, stride_qb, stride_qh, stride_qn, bh, h, qb, HALF_INDEX, N, H, Orders,
                               prefix, frames, height, width, HALF, HEAD_DIM, q_layout)
        if count > 0:
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if tail & (count == 1):
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, tail_key0, N, True, s_layout)
            else:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, tail_key0, N, False, s_layout)
            slot = 0
            for i in range(1, count):
                prev = slot
                slot = i % STAGES
                # block i's scores and block i-1's P V go out together; the softmax of block i then
                # runs while the P V product is on the tensor cores
                mbarrier.wait(k_ready.index(slot), (i // STAGES) & 1)
                mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
                s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                acc = warpgroup_mma(gl.convert_layout(p.to(DTYPE), p_layout), v_smem.index(prev), acc,
                                    is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                if tail & (i == count - 1):
                    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, tail_key0, N, True, s_layout)
                else:
                    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, tail_key0, N, False, s_layout)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, acc_row_layout), 1)
            mbarrier.wait(v_ready.index(slot), ((count - 1) // STAGES) & 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(DTYPE), p_layout), v_smem.index(slot), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        # epilogue: normalize, write each row at its original position (a row with no active block
        # writes zeros)
        l_acc = gl.convert_layout(l_i, acc_row_layout)
        out = acc / gl.expand_dims(gl.where(l_acc > 0.0, l_acc, 1.0), 1)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
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
    def _first_half(args):
        _consumer(args, 0)

    @gluon.jit
    def _second_half(args):
        _consumer(args, 1)

    @gluon.jit
    def _warp_specialized_kernel(
        k_desc, v_desc, Q, Out, Orders, Counts, Indices, Schedule,
        stride_qb, stride_qh, stride_qn, stride_ob, stride_oh, stride_on,
        N, N_PAD, H, NQ, NK, MAX_ACTIVE, prefix, frames, height, width, qk_scale,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    ):
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, HEAD_DIM], v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumer warpgroups release a slot
        args = (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty,
                Q, stride_qb, stride_qh, stride_qn,
                Out, Orders, Counts, Indices, Schedule, stride_ob, stride_oh, stride_on,
                N, N_PAD, H, NQ, NK, MAX_ACTIVE, prefix, frames, height, width, qk_scale)
        gl.warp_specialize([(_first_half, (args,)), (_second_half, (args,)), (_loader, (args,))],
                           [4, 1], [CONSUMER_REGS, 24])


_GLUON_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def descriptors(kq: torch.Tensor, vq: torch.Tensor):
    """Gluon tensor descriptors of the prologue's reordered K and V [B*H, N_PAD, D], seen 2-D so one
    descriptor serves every (batch, head)."""
    D = kq.shape[-1]

    def make(t):
        return TensorDescriptor.from_tensor(t.reshape(-1, D), [BLOCK_N, D], _shared_layout((BLOCK_N, D), t.dtype))

    return make(kq), make(vq)


@functools.cache
def _shared_layout(block: tuple, dtype: torch.dtype):
    # built once per tile shape: get_default_for costs host time on every call
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GLUON_DTYPES[dtype]))


def launch(q, kq, vq, out, orders, counts, indices, schedule, N, n_pad, H, nq, nk,
           prefix, frames, height, width, qk_scale, stages: int = 3, consumer_regs: int = 240,
           kv_descriptors=None, launcher: CachedLauncher | None = None, key=None):
    """Run the kernel on the prologue's reordered K and V; the consumers gather their query rows from the
    caller's `q` [B, H, N, D] and write the caller's `out` of the same shape. q and out have unit stride
    along D (`dispatch`'s Gluon family refuses other calls). `kv_descriptors`: `descriptors(kq, vq)` built earlier (the caller keeps
    them with the buffers); `launcher`: the process's `CachedLauncher` of the kernel and `key` the launch's key
there; None for a full launch."""
    k_desc, v_desc = kv_descriptors or descriptors(kq, vq)
    # 4 + 4 + 1 warps are allocated as three warpgroups: maxnreg x 12 warps x 32 fits the SM's 64K
    # registers (one program per SM), and setmaxnreg gives the consumers `consumer_regs` each and the
    # loader 24. Measured (H100, Wan2.1 shapes): one tile per program ran as fast as persistent
    # programs with an atomic tile counter, so the simpler grid stays.
    grid = (nq, kq.shape[0])
    args = (k_desc, v_desc, q, out, orders, counts, indices, schedule, *q.stride()[:3], *out.stride()[:3],
            N, n_pad, H, nq, nk, indices.shape[-1], prefix, frames, height, width, qk_scale)
    constexprs = dict(STAGES=stages, CONSUMER_REGS=consumer_regs)
    if launcher is None:
        _warp_specialized_kernel[grid](*args, **constexprs, num_warps=4, maxnreg=168)
    else:
        launcher(key, grid, args, constexprs, num_warps=4, maxnreg=168)
    return out
