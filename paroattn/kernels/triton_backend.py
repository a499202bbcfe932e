"""`backend="triton"` of `paroattn.paro_attention`: input checks, the launches, and the
`torch.library` custom op that makes the call opaque to torch.compile and CUDA-graph friendly.

The kernels are in `block_sparse_attention.py` (and the RoPE pass in `rotary.py`), plus, for bf16 at
128 x 64 blocks on sm_90, the warp-specialized Gluon kernel of `hopper_attention.py`; their definition
is `reference.py`. Which of them runs, with which tiles, is `dispatch.py`'s table.

Host-side work per call is kept small and sync-free: device `orders` (or CPU orders, converted once
and cached); prebuilt `ActiveBlocks` on the GPU, which processors pass, or a bool `block_mask`,
converted on the device without a sync (lists as wide as the key blocks) and cached per mask. The
launches reuse one buffer set per stream and shape (`workspace`) and skip Triton's per-call argument
binding after a key's first launch (`launcher.CachedLauncher`); docs/notes/host-overhead.md has the
numbers.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

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
from .dispatch import KernelChoice, arch_of, kernel_choice, unsupported_reason
from .launcher import CachedLauncher, LaunchSequence, Recording, aligned
from .reference import key_mean_stride
from .rotary import rotate_qk
from .statistics import Statistics

QK_CODES = {"bf16": QK_FP, "int8": QK_INT8, "int4": QK_INT4}
PV_CODES = {"bf16": PV_FP, "fp8": PV_FP8, "int8": PV_INT8}
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# The launches.


@dataclass
class Buffers:
    """What a call writes and then reads back: the statistics of the quantized modes, the prologue's
    reordered (quantized) K, V and Q with their scales, the RoPE pass's rotated q and k, and the
    descriptors the attention kernels read them by. `placeholder` (1 element) where the modes do not use a
    part, and for pointer arguments a mode does not read: one per set, as the set's memory is (a placeholder
    kept across calls, made in a CUDA-graph pool, would outlive what the graph trees account for)."""

    kq: torch.Tensor
    k_scale: torch.Tensor
    vq: torch.Tensor
    qq: torch.Tensor
    q_scale: torch.Tensor
    placeholder: torch.Tensor
    rotated: tuple[torch.Tensor, torch.Tensor] | None = None
    statistics: Statistics | None = None
    descriptors: dict = field(default_factory=dict)  # built once per buffer set, by the launch that reads them
    # the launches of earlier calls into this set, by what they depend on (`launch`); None: a set of one
    # call (a graph capture, the custom op), which records nothing
    sequences: dict | None = None

    def addresses(self) -> set[int]:
        """Where this set's buffers (its placeholder included) live."""
        tensors = [self.kq, self.k_scale, self.vq, self.qq, self.q_scale, self.placeholder, *(self.rotated or ())]
        if self.statistics is not None:
            stats = self.statistics
            tensors += [stats.k_mean, stats.v_amax, stats.k_partial, stats.v_partial, stats.arrivals]
        return {t.data_ptr() for t in tensors}


def allocate(B: int, H: int, N: int, D: int, dtype: torch.dtype, device, bq: int, bk: int, qk: str, pv: str,
             write_q: bool, rotary: bool = False) -> Buffers:
    nk, nq = -(-N // bk), -(-N // bq)
    n_pad = nk * bk
    placeholder = torch.zeros(1, dtype=torch.float32, device=device)
    k_scale = qq = q_scale = placeholder
    if qk != "bf16":
        kq = torch.empty(B * H, n_pad, D, dtype=torch.int8, device=device)  # int8 or int4 values
        k_scale = torch.empty(B * H, nk, dtype=torch.float32, device=device)
    else:
        kq = torch.empty(B * H, n_pad, D, dtype=dtype, device=device)
    if pv != "bf16":
        vq = torch.empty(B * H, D, n_pad, dtype=torch.float8_e4m3fn if pv == "fp8" else torch.int8, device=device)
    else:
        vq = torch.empty(B * H, n_pad, D, dtype=dtype, device=device)
    if write_q:
        qq = torch.empty(B * H, nq * bq, D, dtype=dtype if qk == "bf16" else torch.int8, device=device)
        if qk != "bf16":
            q_scale = torch.empty(B * H, nq, dtype=torch.float32, device=device)
    rotated = None
    if rotary:
        q_rot = torch.empty(B, H, N, D, dtype=dtype, device=device)
        rotated = (q_rot, torch.empty_like(q_rot))
    stats = Statistics(B, H, N, D, device) if qk != "bf16" or pv != "bf16" else None
    return Buffers(kq, k_scale, vq, qq, q_scale, placeholder, rotated, stats)


# Eager calls reuse one buffer set per (device, stream, shape, dtype, blocks, modes): allocating the four to
# six buffers and building their descriptors cost more host time than the rest of a call (about 25 and
# 10 us, docs/notes/host-overhead.md). Calls on one stream run in order, so a call's prologue writes the
# buffers only after the previous call's kernels read them; a call on another stream gets its own set.
# While a CUDA graph is captured, each call allocates (from the graph's pool). The oldest set goes
# beyond WORKSPACES sets, its memory back to torch's allocator.
WORKSPACES = 4
SEQUENCES = 16  # recorded launch sequences per buffer set (one per distinct call into it, e.g. strides)
_WORKSPACES: OrderedDict[tuple, Buffers] = OrderedDict()


def _stream_of(device: torch.device) -> int | None:
    """The current stream's handle on a CUDA device (None: capturing a graph, no reuse); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    if torch.cuda.is_current_stream_capturing():
        return None
    from triton.runtime import driver

    return driver.active.get_current_stream(device.index)


def workspace(q: torch.Tensor, bq: int, bk: int, qk: str, pv: str, write_q: bool, rotary: bool,
              stream: int | None) -> Buffers:
    """The reused buffer set of `stream` (`_stream_of(q.device)`) and this call's shape (a fresh set while
    a graph is captured)."""
    B, H, N, D = q.shape
    if stream is None:
        return allocate(B, H, N, D, q.dtype, q.device, bq, bk, qk, pv, write_q, rotary)
    key = (q.device, stream, q.shape, q.dtype, bq, bk, qk, pv, write_q, rotary)
    buffers = _WORKSPACES.get(key)
    if buffers is None:
        buffers = _WORKSPACES[key] = allocate(B, H, N, D, q.dtype, q.device, bq, bk, qk, pv, write_q, rotary)
        buffers.sequences = {}
        while len(_WORKSPACES) > WORKSPACES:
            _WORKSPACES.popitem(last=False)
    elif len(_WORKSPACES) > 1:
        _WORKSPACES.move_to_end(key)
    return buffers


def release_workspaces() -> None:
    """Drop the reused buffer sets (their memory returns to torch's caching allocator)."""
    _WORKSPACES.clear()


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
        num_warps=4,  # 8 warps: int8+fp8 11-12% slower (H200, docs/notes/prologue.md)
    )
    return buffers.kq, buffers.k_scale, buffers.vq, v_amax, buffers.qq, buffers.q_scale


def launch_choice(q: torch.Tensor, bq: int, bk: int, qk: str, pv: str) -> KernelChoice:
    """The table's choice for this call's GPU (`dispatch.kernel_choice`)."""
    return kernel_choice(arch_of(q.device), q.shape[-1], bq, bk, qk, pv)


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
    out: torch.Tensor | None = None, reuse_buffers: bool = True,
) -> torch.Tensor:
    """Run the RoPE pass (with cos/sin: float32 [S, D] tables for the last S tokens), the prologue and
    the attention kernel. Inputs are checked already. `key_mask`: bool [B, suffix] (any strides), False
    at the padded keys of the tokens after the grid (the op's `suffix_mask`). `out` (tests poison it)
    defaults to a new tensor shaped and strided like q. `reuse_buffers`: the stream's buffer set
    (`workspace`), else new ones."""
    B, H, N, D = q.shape
    if out is None:
        out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    choice = launch_choice(q, bq, bk, qk, pv)
    # the Gluon kernel reads q with unit stride along D (`hopper_attention.takes_strides`); the RoPE pass
    # writes contiguous copies. It takes no key mask: calls with padded suffix keys run the Triton kernel,
    # which masks them (the Gluon kernel's pipelined consumers cannot be checked in the interpreter, and
    # the padded model, HunyuanVideo, runs integer QK, which is the Triton kernel's anyway)
    warp_specialized = (choice.warp_specialized and key_mask is None and (cos is not None or q.stride(-1) == 1)
                        and out.stride(-1) == 1)
    q_tma = choice.q_tma and not warp_specialized
    if reuse_buffers:
        stream = _stream_of(q.device)
        buffers = workspace(q, bq, bk, qk, pv, q_tma, cos is not None, stream)
    else:
        buffers = allocate(B, H, N, D, q.dtype, q.device, bq, bk, qk, pv, q_tma, cos is not None)
    arguments = (q, k, v, orders, counts, indices, schedule, prefix, frames, height, width, bq, bk, qk, pv, sm_scale,
                 cos, sin, key_mask, out)
    if buffers.sequences is None:
        _launch(arguments, buffers, choice, warp_specialized, q_tma)
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
        _launch(arguments, buffers, choice, warp_specialized, q_tma)
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


def _launch(arguments: tuple, buffers: Buffers, choice: KernelChoice, warp_specialized: bool, q_tma: bool) -> None:
    """`launch`'s kernels on its arguments, each through its `CachedLauncher`."""
    (q, k, v, orders, counts, indices, schedule, prefix, frames, height, width, bq, bk, qk, pv, sm_scale,
     cos, sin, key_mask, out) = arguments
    geometry, lists = _launch_keys(arguments)[:2]
    B, H, N, D = q.shape
    nq, nk = -(-N // bq), -(-N // bk)
    config = choice.config
    if cos is not None:
        q, k = rotate_qk(q, k, cos, sin, out=buffers.rotated)
    prologue_key = (geometry, k.stride(), v.stride(), q.stride(), aligned(k, v, q, orders))
    key = (geometry, lists, q.stride(), out.stride(), aligned(q, out, orders, counts, indices, schedule))
    if key_mask is not None:  # its strides and alignment (HAS_KEY_MASK, a constexpr, is in the keys already)
        prologue_key = (*prologue_key, key_mask.stride(), aligned(key_mask))
        key = (*key, key_mask.stride(), aligned(key_mask))
    kq, k_scale, vq, v_amax, qq, q_scale = prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv,
                                                      q if q_tma else None, bq, buffers, prologue_key, key_mask)
    if warp_specialized:
        descriptors = buffers.descriptors.get("gluon")
        if descriptors is None:
            descriptors = buffers.descriptors["gluon"] = hopper_attention.descriptors(kq, vq)
        hopper_attention.launch(q, kq, vq, out, orders, counts, indices, schedule, N, nk * bk, H, nq, nk,
                                prefix, frames, height, width, sm_scale * LOG2E, stages=config.num_stages,
                                kv_descriptors=descriptors, key=key)
        return
    k_desc, v_desc, q_desc = kq, vq, qq
    if choice.kv_tma or q_tma:
        descriptors = buffers.descriptors.get("triton")
        if descriptors is None:
            k_desc, v_desc = _descriptors(kq, vq, bk, D, pv) if choice.kv_tma else (kq, vq)
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
             P_LOG2_SCALE=P_LOG2_SCALES[PV_CODES[pv]], USE_TMA=choice.kv_tma, OVERLAP_QK=config.overlap_qk,
             Q_TMA=q_tma, HAS_KEY_MASK=key_mask is not None),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


@torch.library.custom_op("paroattn::block_sparse_attention", mutates_args=())
def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    orders: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor, schedule: torch.Tensor,
    prefix: int, frames: int, height: int, width: int, bq: int, bk: int, qk: str, pv: str, sm_scale: float,
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PARO op on prepared arguments (device int32 orders, active-block lists, schedule, optional
    float32 RoPE tables, optional bool key mask [B, suffix] of the suffix tokens). One opaque node for
    torch.compile; its output has q's shape, dtype and strides. Its buffers are allocated per call: with mode="reduce-overhead", the CUDA-graph trees run the op's
    warm-up calls in their graphs' memory pool and reuse that memory, where a kept buffer set would live."""
    return launch(q, k, v, orders, counts, indices, schedule, prefix, frames, height, width, bq, bk, qk, pv, sm_scale,
                  cos, sin, key_mask, reuse_buffers=False)


@block_sparse_attention.register_fake
def _block_sparse_attention_fake(q, k, v, orders, counts, indices, schedule, prefix, frames, height, width,
                                 bq, bk, qk, pv, sm_scale, cos=None, sin=None, key_mask=None):
    return torch.empty_like(q)


# ---------------------------------------------------------------------------------------------
# The entry point `paroattn.paro_attention(backend="triton")` calls.

_ORDERS_CACHE: dict[tuple, torch.Tensor] = {}


def _device_orders(orders: torch.Tensor, device: torch.device) -> torch.Tensor:
    if orders.device == device:
        return orders if orders.dtype == torch.int32 and orders.is_contiguous() else orders.to(torch.int32).contiguous()
    if orders.device.type == "cpu":
        key = (str(device), tuple(int(x) for x in orders.tolist()))
        cached = _ORDERS_CACHE.get(key)
        if cached is None:
            cached = _ORDERS_CACHE[key] = torch.tensor(key[1], dtype=torch.int32, device=device)
        return cached
    return orders.to(device=device, dtype=torch.int32)


# Lists built from bool masks, reused while a mask is unchanged. Keyed by the mask's memory and view; the
# entry holds the mask, so no other tensor can take that memory while it is cached, and an in-place
# write through torch (on any view of the mask) bumps the version counter the entry is checked against.
# Inference tensors have no version counter: theirs are built on every call, as while compiling.
MASK_LISTS = 64
_MASK_LISTS: OrderedDict[tuple, tuple[torch.Tensor, int, ActiveBlocks]] = OrderedDict()


def lists_of(mask: torch.Tensor, device: torch.device) -> ActiveBlocks:
    """`ActiveBlocks` of a bool block mask on `device`, built there without a host sync
    (`ActiveBlocks.from_mask(sync=False)`), or the cached ones of this mask."""
    if torch.compiler.is_compiling() or mask.is_inference():
        return ActiveBlocks.from_mask(_on_device(mask, device), sync=False)
    key = (mask.data_ptr(), mask.shape, mask.stride(), mask.device, device)
    entry = _MASK_LISTS.get(key)
    if entry is not None and entry[1] == mask._version:
        return entry[2]
    blocks = ActiveBlocks.from_mask(_on_device(mask, device), sync=False)
    _MASK_LISTS[key] = (mask, mask._version, blocks)
    _MASK_LISTS.move_to_end(key)
    while len(_MASK_LISTS) > MASK_LISTS:
        _MASK_LISTS.popitem(last=False)
    return blocks


def _on_device(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`mask` on `device` without waiting for the GPU: a copy from pageable host memory would wait for
    the work queued on the stream, one from pinned memory is queued behind it."""
    if mask.device == device:
        return mask
    if mask.device.type == "cpu" and device.type == "cuda":
        return mask.pin_memory().to(device, non_blocking=True)
    return mask.to(device)


def check_triton_inputs(q: torch.Tensor, bq: int, bk: int, qk: str, pv: str) -> None:
    reason = unsupported_reason(q, bq, bk, qk, pv)
    if reason is not None:
        raise PAROInputError(f"{reason}. Use backend='torch' (the reference, slow) or backend='auto'.")


def paro_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: TokenLayout,
    orders: torch.Tensor,
    block_mask: torch.Tensor | ActiveBlocks,
    bq: int,
    bk: int,
    qk: str = "bf16",
    pv: str = "bf16",
    sm_scale: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    suffix_mask: torch.Tensor | None = None,
    supported: bool = False,
) -> torch.Tensor:
    """See `paroattn.paro_attention`; inputs were checked against the op contract by the caller, and with
    `supported` the kernels' support of the call too (`dispatch.unsupported_reason`)."""
    if not supported:
        check_triton_inputs(q, bq, bk, qk, pv)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise PAROInputError(
            "the triton backend is inference-only (no backward): q, k or v requires grad. Run under "
            "torch.no_grad() / torch.inference_mode() (diffusers pipelines do), or use backend='torch' to train"
        )
    device = q.device
    blocks = block_mask if isinstance(block_mask, ActiveBlocks) else lists_of(block_mask, device)
    if blocks.counts.device != device:
        blocks = blocks.to(device)
    schedule = blocks.schedule
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    args = (q, k, v, _device_orders(orders, device), blocks.counts, blocks.indices, schedule,
            layout.prefix, layout.frames, layout.height, layout.width, bq, bk, qk, pv, float(sm_scale),
            *(rotary if rotary is not None else (None, None)), suffix_mask)
    if torch.compiler.is_compiling():
        return block_sparse_attention(*args)  # one opaque node in the graph
    return launch(*args)  # eager: the same function without the custom-op dispatch (~tens of us)


__all__ = ["block_sparse_attention", "launch", "paro_attention_triton", "prepare_kv"]
