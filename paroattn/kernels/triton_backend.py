"""The launches of the kernels: what `dispatch.resolve` decided, executed.

`launch` runs the RoPE pass (`rotary.py`), the statistics and the K/V prologue (`prepare_kv`), all Triton,
then the attention kernel the decision names: `block_sparse_attention.py`'s Triton kernel with the
decision's tiles and loads, `hopper_attention.py`'s warp-specialized Gluon kernel, or the sm_90a CUDA
kernel of `sm90/` (compiled at run time with NVRTC). Their definition is
`reference.py`. The launches reuse one buffer set per stream and shape (`workspace.workspace`), skip
Triton's per-call argument binding after a key's first launch (`launcher.CachedLauncher`), and replay a
recorded sequence of launches for calls like an earlier one (`launcher.LaunchSequence`); the host time
this saves: docs/notes/host-overhead.md.
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import PAROInputError
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
from .dispatch import CUDA, GLUON, Launch, Refusal
from .launcher import CachedLauncher, LaunchSequence, Recording, _record, aligned
from .reference import key_mean_stride
from .rotary import rotate_qk
from .runtime import runtime_of
from .workspace import SEQUENCES, Buffers, allocate, stream_of, workspace

QK_CODES = {"bf16": QK_FP, "int8": QK_INT8, "int4": QK_INT4}
PV_CODES = {"bf16": PV_FP, "fp8": PV_FP8, "int8": PV_INT8}
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# The launches.


_PROLOGUE = CachedLauncher(_kv_prologue_kernel)
_ATTENTION = CachedLauncher(_attention_kernel)


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
                           None if key is None else (key, stats.split, stats.aligned))
        k_mean = stats.k_mean if qk != "bf16" else placeholder
        v_amax = stats.v_amax if pv != "bf16" else placeholder
    nq = -(-N // bq) if q is not None else 0
    q_src = q if q is not None else k
    mask_arg, mask_strides = (key_mask, key_mask.stride()) if key_mask is not None else (placeholder, (0, 0))
    _PROLOGUE(
        key, (nk, B * H),
        (k, v, k_mean, v_amax, buffers.kq, buffers.k_scale, buffers.vq, q_src, buffers.qq, buffers.q_scale, mask_arg,
         *k.stride(), *v.stride(), *q_src.stride(), *mask_strides, orders, N, n_pad, H, nq, prefix, frames, height,
         width, prefix + frames * height * width),
        dict(HEAD_DIM=D, BLOCK_N=bk, QK_MODE=QK_CODES[qk], PV_MODE=PV_CODES[pv], WRITE_Q=q is not None,
             BLOCK_Q=bq or bk, HAS_KEY_MASK=key_mask is not None),
        num_warps=4,  # 8 warps were slower (docs/notes/prologue.md)
    )
    return buffers.kq, buffers.k_scale, buffers.vq, v_amax, buffers.qq, buffers.q_scale


def decide(q: torch.Tensor, bq: int, bk: int, qk: str, pv: str, *, key_mask: bool, rotary: bool,
           out: torch.Tensor | None = None, backend: str = "triton") -> Launch | Refusal:
    """`dispatch.resolve` of a call of the kernels on q's device (memoized there)."""
    out_unit = out is None or out.stride(-1) == 1  # a new out is strided like q
    unit_stride = (rotary or q.stride(-1) == 1) and out_unit  # the RoPE pass writes contiguous copies
    return runtime_of(q.device).decide(q.shape[-1], q.dtype, bq, bk, qk, pv, key_mask, unit_stride, backend)


def decided_launch(q: torch.Tensor, bq: int, bk: int, qk: str, pv: str, *, key_mask: bool, rotary: bool,
                   out: torch.Tensor | None = None, backend: str = "triton") -> Launch:
    """The kernels' `Launch` of a call, or PAROInputError with the reason none runs it."""
    decision = decide(q, bq, bk, qk, pv, key_mask=key_mask, rotary=rotary, out=out, backend=backend)
    if isinstance(decision, Launch) and decision.backend == "torch":  # "auto" off the kernels: not here
        decision = decide(q, bq, bk, qk, pv, key_mask=key_mask, rotary=rotary, out=out)
    if isinstance(decision, Refusal):
        raise PAROInputError(f"{decision.reason}. Use backend='torch' (the reference, slow) or backend='auto'.")
    return decision


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
    q, k, v, orders, counts, indices, schedule,
    prefix: int, frames: int, height: int, width: int, bq: int, bk: int, qk: str, pv: str, sm_scale: float,
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None, reuse_buffers: bool = True, decision: Launch | None = None,
    backend: str = "triton",
) -> torch.Tensor:
    """Run the RoPE pass (with cos/sin: float32 [S, D] tables for the last S tokens), the prologue and
    the attention kernel of `decision` (by default the one `decided_launch` gives). Inputs are checked
    already. `key_mask`: bool [B, suffix] (any strides), False at the padded keys of the tokens after the
    grid (the op's `suffix_mask`). `out` (tests poison it) defaults to a new tensor shaped and strided like
    q. `reuse_buffers`: the stream's buffer set (`workspace`), else new ones."""
    B, H, N, D = q.shape
    if decision is None:
        decision = decided_launch(q, bq, bk, qk, pv, key_mask=key_mask is not None, rotary=cos is not None, out=out,
                                  backend=backend)
    if out is None:
        out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    q_tma = decision.q_tma
    if reuse_buffers:
        stream = stream_of(q.device)
        buffers = workspace(q, bq, bk, qk, pv, q_tma, cos is not None, stream)
    else:
        buffers = allocate(B, H, N, D, q.dtype, q.device, bq, bk, qk, pv, q_tma, cos is not None)
    arguments = (q, k, v, orders, counts, indices, schedule, prefix, frames, height, width, bq, bk, qk, pv, sm_scale,
                 cos, sin, key_mask, out)
    if buffers.sequences is None:
        _launch(arguments, buffers, decision)
        return out
    # calls into a kept buffer set replay the launches of the first call like them (`launcher.LaunchSequence`):
    # the key holds what the launches depend on besides the addresses of the call's own tensors (`slots`)
    slots = (q, k, v, out, orders, counts, indices, schedule, cos, sin, key_mask)
    call = (*_launch_keys(arguments), sm_scale, None if cos is None else (cos.shape, cos.stride(), sin.stride()),
            None if key_mask is None else key_mask.stride(), out.stride(),
            aligned(*(t for t in slots if t is not None)))
    sequence = buffers.sequences.get(call)
    if sequence is not None and sequence.replay(slots, stream):
        return out
    with Recording() as records:
        _launch(arguments, buffers, decision)
    if len(buffers.sequences) >= SEQUENCES:
        buffers.sequences.clear()
    # the kernels ran on the current device, the buffers live on q's: a replay launches on q's device's
    # stream (`stream`), so only where the two are one device
    same_device = q.device.type == "cuda" and torch.cuda.current_device() == q.device.index
    buffers.sequences[call] = LaunchSequence.build(records, slots, buffers.addresses()) if same_device else None
    return out


def _launch_keys(arguments: tuple) -> tuple:
    """(geometry, lists, q's, k's and v's strides) of `launch`'s arguments: what its launches vary in
    besides the buffers' shape (the `CachedLauncher` keys are built from them)."""
    q, k, v, orders, counts, indices, schedule, prefix, frames, height, width, bq, bk, qk, pv = arguments[:15]
    geometry = (q.shape, q.dtype, prefix, frames, height, width, bq, bk, qk, pv)
    lists = (indices.shape[-1], counts.dtype, indices.dtype, schedule.dtype, orders.dtype)
    return geometry, lists, q.stride(), k.stride(), v.stride()


def _launch(arguments: tuple, buffers: Buffers, decision: Launch) -> None:
    """`launch`'s kernels on its arguments, each through its `CachedLauncher`."""
    (q, k, v, orders, counts, indices, schedule, prefix, frames, height, width, bq, bk, qk, pv, sm_scale,
     cos, sin, key_mask, out) = arguments
    geometry, lists = _launch_keys(arguments)[:2]
    B, H, N, D = q.shape
    nq, nk = -(-N // bq), -(-N // bk)
    config = decision.config
    q_tma = decision.q_tma
    if cos is not None:
        q, k = rotate_qk(q, k, cos, sin, out=buffers.rotated)
    prologue_key = (geometry, k.stride(), v.stride(), q.stride(), aligned(k, v, q, orders))
    key = (geometry, lists, q.stride(), out.stride(), aligned(q, out, orders, counts, indices, schedule))
    if key_mask is not None:  # its strides and alignment (HAS_KEY_MASK, a constexpr, is in the keys already)
        prologue_key = (*prologue_key, key_mask.stride(), aligned(key_mask))
        key = (*key, key_mask.stride(), aligned(key_mask))
    kq, k_scale, vq, v_amax, qq, q_scale = prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv,
                                                      q if q_tma else None, bq, buffers, prologue_key, key_mask)
    if decision.kernel == CUDA:
        from . import sm90

        _record(None)  # launched outside the Triton launchers: a recorded sequence could not replay it
        sm90.launch(qq, q_scale, kq, k_scale, vq, v_amax, out, orders, counts, indices, schedule, N=N, prefix=prefix,
                    frames=frames, height=height, width=width, sm_scale=sm_scale, key_mask=key_mask)
        return
    if decision.kernel == GLUON:
        descriptors = buffers.descriptors.get("gluon")
        if descriptors is None:
            descriptors = buffers.descriptors["gluon"] = hopper_attention.descriptors(kq, vq)
        hopper_attention.launch(q, kq, vq, out, orders, counts, indices, schedule, N, nk * bk, H, nq, nk,
                                prefix, frames, height, width, sm_scale * LOG2E, stages=config.num_stages,
                                kv_descriptors=descriptors, key=key)
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
    _ATTENTION(
        key, (nq, B * H),
        (q, out, kq, k_scale, vq, v_amax, k_desc, v_desc, q_desc, q_scale, orders, counts, indices, schedule, mask_arg,
         *q.stride(), *out.stride(), *mask_strides,
         N, nk * bk, H, nq, nk, indices.shape[-1], prefix, frames, height, width, suffix_start, sm_scale * LOG2E),
        dict(HEAD_DIM=D, BLOCK_M=bq, BLOCK_N=bk, QK_MODE=QK_CODES[qk], PV_MODE=PV_CODES[pv], EVEN_N=(N % bk == 0),
             P_LOG2_SCALE=P_LOG2_SCALES[PV_CODES[pv]], USE_TMA=decision.kv_tma, OVERLAP_QK=config.overlap_qk,
             Q_TMA=q_tma, HAS_KEY_MASK=key_mask is not None),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


