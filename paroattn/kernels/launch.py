"""The launches of the kernels: what `dispatch.resolve` decided, executed.

`run` takes a checked call from the op. Eagerly it calls `launch`; while torch.compile traces, it prepares the
kernels' inputs in the graph (device int32 orders, active-block lists) and calls `block_sparse_attention`, a
`torch.library` custom op that is one opaque, CUDA-graph-friendly node of the graph and calls `launch` when the
graph runs.

`launch` takes the call's inputs as the kernels read them on its device (`runtime.Runtime.kernel_inputs`: host
orders copied once per value, a bool mask's active-block lists built on the device without a sync and kept per
mask, prebuilt `ActiveBlocks` as they are), builds the call's `dispatch.LaunchPlan` (the decided kernel and
config with the call's geometry, modes and strides) and takes the plan's buffer set from the runtime
(`runtime.Runtime.workspace`, one per stream and plan). A call whose plan ran into that set before replays the
launches recorded then (`launcher.LaunchSequences`); otherwise its launches run, recorded: the RoPE pass
(`rotary.py`), the statistics and the K/V prologue (`prepare_kv`), all Triton, then the attention kernel the plan
names: `block_sparse_attention.py`'s Triton kernel with the decision's tiles and loads, `hopper_attention.py`'s
warp-specialized Gluon kernel, or the sm_90a CUDA kernel of `sm90/` (compiled at run time with NVRTC). Each
Triton launch skips the per-call argument binding after its key's first launch (`launcher.CachedLauncher`, keyed
by the plan and the alignment of what it reads). Their definition is `reference.py`; the host time all this
saves: docs/notes/host-overhead.md. A recording or a compiled entry is only ever used for the plan it was made
for, so one kernel's or config's launches are never replayed for another.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import NamedTuple

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import PAROInputError
from ..layout import TokenLayout
from . import hopper_attention, statistics
from .block_lists import ActiveBlocks
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
from .launcher import aligned
from .reference import key_mean_stride
from .rotary import _rotate_kernel, rotate_qk
from .runtime import PROCESS, Buffers, Runtime, runtime_of, stream_of
from .statistics import _statistics_kernel

QK_CODES = {"bf16": QK_FP, "int8": QK_INT8, "int4": QK_INT4}
PV_CODES = {"bf16": PV_FP, "fp8": PV_FP8, "int8": PV_INT8}
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# The entry: eagerly, or one custom op in a compiled graph.


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: TokenLayout,
    orders: torch.Tensor,
    block_mask: torch.Tensor | ActiveBlocks,
    bq: int,
    bk: int,
    qk: str,
    pv: str,
    sm_scale: float | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    suffix_mask: torch.Tensor | None,
    decision: Launch,
    k_scale: str = "block",
) -> torch.Tensor:
    """See `paroattn.paro_attention`: a call checked against the op contract, run by the kernels of
    `decision` (eagerly, or through the custom op while torch.compile traces)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise PAROInputError(
            "the triton backend is inference-only (no backward): q, k or v requires grad. Run under "
            "torch.no_grad() / torch.inference_mode() (diffusers pipelines do), or use backend='torch' to train"
        )
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    rotary = rotary if rotary is not None else (None, None)
    geometry = (layout.prefix, layout.frames, layout.height, layout.width, bq, bk, qk, pv, float(sm_scale))
    if not torch.compiler.is_compiling():  # eager: the custom op's function without its dispatch
        return launch(decision, q, k, v, orders, block_mask, *geometry, *rotary, suffix_mask, k_scale=k_scale)
    # traced: one opaque node in the graph, its inputs prepared in the graph (traced code reads no runtime cache)
    blocks = block_mask if isinstance(block_mask, ActiveBlocks) else ActiveBlocks.from_mask(
        block_mask.to(q.device), sync=False)
    orders = orders.to(device=q.device, dtype=torch.int32).contiguous()
    return block_sparse_attention(q, k, v, orders, blocks.counts, blocks.indices, blocks.schedule, *geometry,
                                  decision.encode(), *rotary, suffix_mask, k_scale)


@torch.library.custom_op("paroattn::block_sparse_attention", mutates_args=())
def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    orders: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor, schedule: torch.Tensor,
    prefix: int, frames: int, height: int, width: int, bq: int, bk: int, qk: str, pv: str, sm_scale: float,
    launch_code: str, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None, k_scale: str = "block",
) -> torch.Tensor:
    """The PARO op on prepared arguments (device int32 orders, active-block lists, schedule, optional
    float32 RoPE tables, optional bool key mask [B, suffix] of the suffix tokens, K's scale granularity) with the
    kernel decided while
    the graph was traced (`dispatch.Launch.encode`). One opaque node for torch.compile; its output has q's
    shape, dtype and strides. On the device's default stream it takes the stream's kept buffer set, as an eager
    call does (a new set per call, its launches recorded anew, cost 210-260 us more host time per call at
    FLUX.1-dev: docs/notes/host-overhead.md); elsewhere it allocates one per call. With mode="reduce-overhead" the
    CUDA-graph trees run the op's warm-up calls on a stream of their own, allocating from their graphs' memory
    pool, whose memory they hand out again: a set kept from there would be overwritten."""
    blocks = ActiveBlocks(counts, indices, -(-q.shape[2] // bk), schedule)
    return launch(PROCESS.launch_of(launch_code), q, k, v, orders, blocks, prefix, frames, height, width, bq, bk, qk,
                  pv, sm_scale, cos, sin, key_mask, reuse_buffers=on_default_stream(q.device), k_scale=k_scale)


def on_default_stream(device: torch.device) -> bool:
    """Whether work for `device` goes to its default stream now (always, off CUDA)."""
    if device.type != "cuda":
        return True
    return torch.cuda.current_stream(device).cuda_stream == torch.cuda.default_stream(device).cuda_stream


@block_sparse_attention.register_fake
def _block_sparse_attention_fake(q, k, v, orders, counts, indices, schedule, prefix, frames, height, width,
                                 bq, bk, qk, pv, sm_scale, launch_code, cos=None, sin=None, key_mask=None,
                                 k_scale="block"):
    return torch.empty_like(q)


# ---------------------------------------------------------------------------------------------
# The launches.


def key_scales(qk: str, k_scale: str) -> str:
    """K's scale granularity as the kernels see it: without integer QK there are no K scales, and both
    granularities are one computation (one plan, one compiled kernel)."""
    return k_scale if qk != "bf16" else "block"


class Keys(NamedTuple):
    """Each kernel's `CachedLauncher` key for one call: the plan (less the softmax scale) and the strides and
    16-byte alignment of the tensors the kernel reads."""

    rotary: tuple | None  # the RoPE pass's (None: no RoPE tables)
    prologue: tuple  # the K/V prologue's (the statistics' derive from it)
    attention: tuple  # the attention kernel's


def launch(
    decision: Launch, q, k, v, orders, block_mask: torch.Tensor | ActiveBlocks,
    prefix: int, frames: int, height: int, width: int, bq: int, bk: int, qk: str, pv: str, sm_scale: float,
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None, reuse_buffers: bool = True, k_scale: str = "block",
) -> torch.Tensor:
    """Run the RoPE pass (with cos/sin: float32 [S, D] tables for the last S tokens), the prologue and the
    attention kernel of `decision` on q's device. Inputs are checked already; `orders` and `block_mask` (a bool
    mask or active-block lists) as the op takes them. `key_mask`: bool [B, suffix] (any strides), False at the
    padded keys of the tokens after the grid (the op's `suffix_mask`). `out` (tests poison it) defaults to a new
    tensor shaped and strided like q. `reuse_buffers`: the stream's buffer set of this plan
    (`Runtime.workspace`), else new ones. `k_scale`: K's scales per key block or per key ("token") with integer
    QK."""
    runtime = runtime_of(q.device)
    orders, blocks = runtime.kernel_inputs(orders, block_mask)
    counts, indices, schedule = blocks.counts, blocks.indices, blocks.schedule
    if out is None:
        out = torch.empty_like(q)
    plan = LaunchPlan(
        decision, q.shape, q.dtype, (prefix, frames, height, width), bq, bk, qk, pv, key_scales(qk, k_scale),
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
    recording = nullcontext()
    if buffers.sequences is not None:
        # calls of one plan into a kept buffer set replay the launches of the first one: the plan holds what the
        # launches depend on besides the addresses of the call's own tensors (`arguments`) and whether each address
        # is 16-byte aligned (what Triton specializes on)
        key = (plan, aligned(*(t for t in arguments if t is not None)))
        if buffers.sequences.replay(key, arguments, stream):
            return out
        # the kernels run on the current device, the buffers live on q's: a replay launches on q's device's
        # stream (`stream`), so only where the two are one device
        same_device = q.device.type == "cuda" and torch.cuda.current_device() == q.device.index
        recording = buffers.sequences.recording(key, arguments, replayable=same_device)
    # where the RoPE pass runs, the kernels after it read q and k rotated, from the set's buffers
    q_read, k_read = buffers.rotated if cos is not None else (q, k)
    kernel_key = plan.kernel_key
    masked = () if key_mask is None else (aligned(key_mask),)
    keys = Keys(None if cos is None else (kernel_key, aligned(q, k, cos, sin, q_read, k_read)),
                (kernel_key, k_read.stride(), v.stride(), q_read.stride(), aligned(k_read, v, q_read, orders), *masked),
                (kernel_key, q_read.stride(), aligned(q_read, out, orders, counts, indices, schedule), *masked))
    with recording:
        if cos is not None:
            q, k = rotate_qk(q, k, cos, sin, out=buffers.rotated, launcher=PROCESS.launcher(_rotate_kernel),
                             key=keys.rotary)
        _launch(runtime, plan, (q, k, v, orders, counts, indices, schedule, key_mask, out), buffers, keys)
    return out


def _launch(runtime: Runtime, plan: LaunchPlan, arguments: tuple, buffers: Buffers, keys: Keys) -> None:
    """`launch`'s kernels after the RoPE pass (q and k as they read them): the statistics, the K/V prologue and the
    attention kernel of the plan, each Triton one through the process's `CachedLauncher` of its kernel."""
    q, k, v, orders, counts, indices, schedule, key_mask, out = arguments
    decision = plan.launch
    B, H, N, D = plan.shape
    prefix, frames, height, width = plan.grid
    bq, bk, qk, pv, k_scale, sm_scale = plan.bq, plan.bk, plan.qk, plan.pv, plan.k_scale, plan.sm_scale
    nq, nk = -(-N // bq), -(-N // bk)
    config = decision.config
    q_tma = decision.q_tma
    key = keys.attention
    kq, k_scales, vq, v_amax, qq, q_scale = prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv,
                                                       buffers, q if q_tma else None, bq, keys.prologue, key_mask,
                                                       k_scale)
    if decision.kernel == CUDA:
        from . import sm90

        PROCESS.launches.record(None)  # launched outside the Triton launchers: a recorded sequence could not replay it
        kernel = runtime.cuda_kernel(D, plan.dtype, k_scale)
        maps = buffers.descriptors.get("cuda")
        if maps is None:
            maps = buffers.descriptors["cuda"] = sm90.tensor_maps(qq, kq, vq)
        sm90.launch(kernel, maps, qq, q_scale, kq, k_scales, vq, v_amax, out, orders, counts, indices, schedule, N=N,
                    prefix=prefix, frames=frames, height=height, width=width, sm_scale=sm_scale, key_mask=key_mask,
                    k_scale=k_scale)
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
        (q, out, kq, k_scales, vq, v_amax, k_desc, v_desc, q_desc, q_scale, orders, counts, indices, schedule, mask_arg,
         *q.stride(), *out.stride(), *mask_strides,
         N, nk * bk, H, nq, nk, indices.shape[-1], prefix, frames, height, width, suffix_start, sm_scale * LOG2E),
        dict(HEAD_DIM=D, BLOCK_M=bq, BLOCK_N=bk, QK_MODE=QK_CODES[qk], PV_MODE=PV_CODES[pv], EVEN_N=(N % bk == 0),
             P_LOG2_SCALE=P_LOG2_SCALES[PV_CODES[pv]], USE_TMA=decision.kv_tma, OVERLAP_QK=config.overlap_qk,
             Q_TMA=q_tma, HAS_KEY_MASK=key_mask is not None, K_PER_TOKEN=k_scale == "token"),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv, buffers: Buffers, q=None, bq=None, key=None,
               key_mask=None, k_scale="block"):
    """The statistics and the K/V prologue, into `buffers` (`runtime.allocate`): returns (kq, k_scales, vq, v_amax,
    qq, q_scale), placeholders for the parts the modes do not use. K and V are written reordered and contiguous,
    quantized in the integer/8-bit modes, K with a scale per key block ([B*H, NK]) or with k_scale="token" per key
    ([B*H, N_PAD]). With q (and its block bq >= bk) it also writes the reordered Q: in q's
    dtype, or int8/int4 values with per-block scales for integer QK. `key`: the launch's `CachedLauncher` key
    (None: a full launch). `key_mask` (bool [B, suffix], False at padded suffix keys): V's rows of padded keys are
    stored as zeros. Separate so benchmarks can time the prologue alone."""
    B, H, N, D = k.shape
    nk = -(-N // bk)
    n_pad = nk * bk
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
             BLOCK_Q=bq or bk, HAS_KEY_MASK=key_mask is not None, K_PER_TOKEN=k_scale == "token" and qk != "bf16"),
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
