"""The launches of the kernels: what `dispatch.resolve` decided, executed.

`launch` builds the call's `dispatch.LaunchPlan` (the decided kernel and config with the call's geometry,
modes and strides) and runs the RoPE pass (`rotary.py`), the statistics and the K/V prologue
(`prepare_kv`), all Triton, then the attention kernel the plan names: `block_sparse_attention.py`'s Triton
kernel with the decision's tiles and loads, `hopper_attention.py`'s warp-specialized Gluon kernel, or the
sm_90a CUDA kernel of `sm90/` (compiled at run time with NVRTC). Their definition is `reference.py`. The
launches reuse one buffer set per stream and plan (`runtime.Runtime.workspace`), skip Triton's per-call
argument binding after a key's first launch (`launcher.CachedLauncher`, keyed by the plan), and replay the
launches recorded for the same plan into the same buffers (`launcher.LaunchSequence`); the host time this
saves: docs/notes/host-overhead.md. A recording or a compiled entry is only ever used for the plan it was
made for, so one kernel's or config's launches are never replayed for another.
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import hopper_attention, statistics
from .block_sparse_attention import (
    P_LOG2_SCALES,
    PV_FP,
    PV_FP8,
    PV_INT8,
    QK_FP,
    QK_INT4,
    QK_INT8,
    _attention_kernel,
    _kv_prologue_kernel,
)
from .dispatch import CUDA, GLUON, Launch, LaunchPlan
from .launcher import LaunchSequence, aligned
from .reference import key_mean_stride
from .rotary import _rotate_kernel, rotate_qk
from .runtime import PROCESS, SEQUENCES, Buffers, Runtime, allocate, stream_of
from .statistics import _statistics_kernel

QK_CODES = {"bf16": QK_FP, "int8": QK_INT8, "int4": QK_INT4}
PV_CODES = {"bf16": PV_FP, "fp8": PV_FP8, "int8": PV_INT8}
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# The launches.


def prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv, q=None, bq=None, buffers=None, key=None,
               key_mask=None):
    """The statistics and the K/V prologue: returns (kq, k_scale, vq, v_amax, qq, q_scale), placeholders
    for the parts the modes do not use. K and V are written reordered and contiguous, quantized in the
    integer/8-bit modes. With q (and its block bq >= bk) it also writes the reordered Q: in q's dtype,
    or int8/int4 values with per-block scales for integer QK. Into `buffers` where given (`allocate`),
    else new ones; `key`: the launch's `CachedLauncher` key (None: a full launch). `key_mask` (bool
    [B, suffix], False at padded suffix keys): V's rows of padded keys are stored as zeros. Separate so
    benchmarks can time the prologue alone."""
    B, H, N, D = k.shape
    nk = -(-N // bk)
    n_pad = nk * bk
    device = k.device
    if buffers is None:
        buffers = allocate(B, H, N, D, k.dtype, device, bq or bk, bk, qk, pv, q is not None)
    stats = buffers.statistics
    k_mean = v_amax = placeholder = buffers.placeholder
    if stats is not None:
        statistics.compute(k, v, stats, key_mean_stride(N, height, width), qk != "bf16", pv != "bf16",
                           PROCESS.launcher(_statistics_kernel),
                           None if key is None else (key, stats.split, stats.aligned))
        k_mean = stats.k_mean if qk != "bf16" else placeholder
        v_amax = stats.v_amax if pv != "bf16" else placeholder
    nq = -(-N // bq) if q is not None else 0
    q_src = q if q is not None else k
    mask_arg, mask_strides = (key_mask, key_mask.stride()) if key_mask is not None else (placeholder, (0, 0))
    PROCESS.launcher(_kv_prologue_kernel)(
        key, (nk, B * H),
        (k, v, k_mean, v_amax, buffers.kq, buffers.k_scale, buffers.vq, q_src, buffers.qq, buffers.q_scale, mask_arg,
         *k.stride(), *v.stride(), *q_src.stride(), *mask_strides, orders, N, n_pad, H, nq, prefix, frames, height,
         width, prefix + frames * height * width),
        dict(HEAD_DIM=D, BLOCK_N=bk, QK_MODE=QK_CODES[qk], PV_MODE=PV_CODES[pv], WRITE_Q=q is not None,
             BLOCK_Q=bq or bk, HAS_KEY_MASK=key_mask is not None),
        num_warps=4,  # 8 warps were slower (docs/notes/prologue.md)
    )
    return buffers.kq, buffers.k_scale, buffers.vq, v_amax, buffers.qq, buffers.q_scale


def _descriptors(kq: torch.Tensor, vq: torch.Tensor, bk: int, D: int, pv: str):
    """Tensor descriptors of the prologue's K and V buffers, seen as 2-D [rows, width] so one
    descriptor serves every (batch, head): K [B*H*N_PAD, D], V the same in bf16 or,
    8-bit and transposed, [B*H*D, N_PAD]. (The reordered Q, when written, is laid out like K.)"""
    k2 = kq.reshape(-1, kq.shape[-1])
    k_desc = TensorDescriptor.from_tensor(k2, [bk, k2.shape[1]])
    v2 = vq.reshape(-1, vq.shape[-1])
    v_desc = TensorDescriptor.from_tensor(v2, [bk, D] if pv == "bf16" else [D, bk])
    return k_desc, v_desc


def launch(
    runtime: Runtime, decision: Launch, q, k, v, orders, counts, indices, schedule,
    prefix: int, frames: int, height: int, width: int, bq: int, bk: int, qk: str, pv: str, sm_scale: float,
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None, reuse_buffers: bool = True,
) -> torch.Tensor:
    """Run the RoPE pass (with cos/sin: float32 [S, D] tables for the last S tokens), the prologue and the
    attention kernel of `decision` on `runtime`'s device. Inputs are checked already. `key_mask`: bool
    [B, suffix] (any strides), False at the padded keys of the tokens after the grid (the op's `suffix_mask`).
    `out` (tests poison it) defaults to a new tensor shaped and strided like q. `reuse_buffers`: the stream's
    buffer set of this plan (`Runtime.workspace`), else new ones."""
    if out is None:
        out = torch.empty_like(q)
    plan = LaunchPlan(
        decision, q.shape, q.dtype, (prefix, frames, height, width), bq, bk, qk, pv,
        (q.stride(), k.stride(), v.stride(), out.stride()),
        None if cos is None else (cos.shape, cos.stride(), sin.stride()),
        None if key_mask is None else key_mask.stride(),
        (indices.shape[-1], counts.dtype, indices.dtype, schedule.dtype, orders.dtype),
        sm_scale,
    )
    runtime.last_launch = plan
    if out.numel() == 0:
        return out
    arguments = (q, k, v, orders, counts, indices, schedule, cos, sin, key_mask, out)
    stream = stream_of(q.device) if reuse_buffers else None
    buffers = runtime.workspace(plan, stream)
    if buffers.sequences is None:
        _launch(runtime, plan, arguments, buffers)
        return out
    # calls of one plan into a kept buffer set replay the launches of the first one (`launcher.LaunchSequence`):
    # the plan holds what the launches depend on besides the addresses of the call's own tensors (`arguments`)
    # and whether each address is 16-byte aligned (what Triton specializes on)
    key = (plan, aligned(*(t for t in arguments if t is not None)))
    sequence = buffers.sequences.get(key)
    if sequence is not None and sequence.replay(arguments, stream):
        return out
    with PROCESS.launches.recording() as records:
        _launch(runtime, plan, arguments, buffers)
    if len(buffers.sequences) >= SEQUENCES:
        buffers.sequences.clear()
    # the kernels ran on the current device, the buffers live on q's: a replay launches on q's device's
    # stream (`stream`), so only where the two are one device
    same_device = q.device.type == "cuda" and torch.cuda.current_device() == q.device.index
    buffers.sequences[key] = (LaunchSequence.build(PROCESS.launches, records, arguments, buffers.addresses())
                              if same_device else None)
    return out


def _launch(runtime: Runtime, plan: LaunchPlan, arguments: tuple, buffers: Buffers) -> None:
    """`launch`'s kernels on its arguments, each through the process's `CachedLauncher` of its kernel, keyed by
    the plan and the alignment of the tensors it reads."""
    q, k, v, orders, counts, indices, schedule, cos, sin, key_mask, out = arguments
    decision = plan.launch
    B, H, N, D = plan.shape
    prefix, frames, height, width = plan.grid
    bq, bk, qk, pv, sm_scale = plan.bq, plan.bk, plan.qk, plan.pv, plan.sm_scale
    nq, nk = -(-N // bq), -(-N // bk)
    config = decision.config
    q_tma = decision.q_tma
    if cos is not None:
        q, k = rotate_qk(q, k, cos, sin, out=buffers.rotated, launcher=PROCESS.launcher(_rotate_kernel))
    kernel_key = plan.kernel_key
    prologue_key = (kernel_key, k.stride(), v.stride(), q.stride(), aligned(k, v, q, orders))
    key = (kernel_key, q.stride(), aligned(q, out, orders, counts, indices, schedule))
    if key_mask is not None:
        prologue_key = (*prologue_key, aligned(key_mask))
        key = (*key, aligned(key_mask))
    kq, k_scale, vq, v_amax, qq, q_scale = prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv,
                                                      q if q_tma else None, bq, buffers, prologue_key, key_mask)
    if decision.kernel == CUDA:
        from . import sm90

        PROCESS.launches.record(None)  # launched outside the Triton launchers: a recorded sequence could not replay it
        maps = buffers.descriptors.get("cuda")
        if maps is None:
            maps = buffers.descriptors["cuda"] = sm90.tensor_maps(qq, kq, vq)
        sm90.launch(runtime.cuda_kernel(D, plan.dtype), maps, qq, q_scale, kq, k_scale, vq, v_amax, out, orders,
                    counts, indices, schedule, N=N, prefix=prefix, frames=frames, height=height, width=width,
                    sm_scale=sm_scale, key_mask=key_mask)
        return
    if decision.kernel == GLUON:
        descriptors = buffers.descriptors.get("gluon")
        if descriptors is None:
            descriptors = buffers.descriptors["gluon"] = hopper_attention.descriptors(kq, vq)
        hopper_attention.launch(q, kq, vq, out, orders, counts, indices, schedule, N, nk * bk, H, nq, nk,
                                prefix, frames, height, width, sm_scale * LOG2E, stages=config.num_stages,
                                kv_descriptors=descriptors,
                                launcher=PROCESS.launcher(hopper_attention._warp_specialized_kernel), key=key)
        return
    k_desc, v_desc, q_desc = kq, vq, qq
    if decision.kv_tma or q_tma:
        descriptors = buffers.descriptors.get("triton")
        if descriptors is None:
            k_desc, v_desc = _descriptors(kq, vq, bk, D, pv) if decision.kv_tma else (kq, vq)
            q_desc = TensorDescriptor.from_tensor(qq.reshape(-1, D), [bq, D]) if q_tma else qq
            descriptors = buffers.descriptors["triton"] = (k_desc, v_desc, q_desc)
        k_desc, v_desc, q_desc = descriptors
    suffix_start = prefix + frames * height * width
    mask_arg, mask_strides = (key_mask, key_mask.stride()) if key_mask is not None else (kq, (0, 0))  # kq: unread
    PROCESS.launcher(_attention_kernel)(
        key, (nq, B * H),
        (q, out, kq, k_scale, vq, v_amax, k_desc, v_desc, q_desc, q_scale, orders, counts, indices, schedule, mask_arg,
         *q.stride(), *out.stride(), *mask_strides,
         N, nk * bk, H, nq, nk, indices.shape[-1], prefix, frames, height, width, suffix_start, sm_scale * LOG2E),
        dict(HEAD_DIM=D, BLOCK_M=bq, BLOCK_N=bk, QK_MODE=QK_CODES[qk], PV_MODE=PV_CODES[pv], EVEN_N=(N % bk == 0),
             P_LOG2_SCALE=P_LOG2_SCALES[PV_CODES[pv]], USE_TMA=decision.kv_tma, OVERLAP_QK=config.overlap_qk,
             Q_TMA=q_tma, HAS_KEY_MASK=key_mask is not None),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
