"""`backend="triton"` of `paroattn.paro_attention`: input checks, the launches, and the
`torch.library` custom op that makes the call opaque to torch.compile and CUDA-graph friendly.

The kernels are in `block_sparse_attention.py` (and the RoPE pass in `rotary.py`), plus, for bf16 at
128 x 64 blocks on sm_90, the warp-specialized Gluon kernel of `hopper_attention.py`; their definition
is `reference.py`. Which of them runs, with which tiles, is `dispatch.py`'s table.

Host-side work per call is kept small and sync-free when the caller passes what a processor has:
device `orders` (or CPU orders, converted once and cached) and prebuilt `ActiveBlocks` on the GPU.
A bool `block_mask` is converted to `ActiveBlocks` on every call (it syncs to size the lists):
convenient for tests, not for a hot loop.
"""

from __future__ import annotations

import math

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import PAROInputError
from ..layout import TokenLayout
from . import hopper_attention
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
from .reference import key_mean_stride
from .rotary import rotate_qk

QK_CODES = {"bf16": QK_FP, "int8": QK_INT8, "int4": QK_INT4}
PV_CODES = {"bf16": PV_FP, "fp8": PV_FP8, "int8": PV_INT8}
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# The launches.


def _statistics(k: torch.Tensor, v: torch.Tensor, qk: str, pv: str, mean_stride: int):
    """K smoothing's mean [B, H, D] (over every `mean_stride`-th token, `reference.key_smoothing_mean`)
    and V's per-channel max |V| [B, H, D], float32, one launch each and only where the modes need
    them; the kernels form the scales."""
    k_mean = v_amax = None
    if qk != "bf16":
        k_mean = torch.mean(k[:, :, ::mean_stride], dim=2, dtype=torch.float32)
    if pv != "bf16":
        v_amax = torch.linalg.vector_norm(v, float("inf"), dim=2, dtype=torch.float32)
    return k_mean, v_amax


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def _placeholder(device: torch.device) -> torch.Tensor:
    """A 1-element tensor for pointer arguments a mode does not read (allocated once per device)."""
    t = _PLACEHOLDERS.get(device)
    if t is None:
        t = _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return t


def prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv, q=None, bq=None):
    """The statistics and the K/V prologue: returns (kq, k_scale, vq, v_amax, qq, q_scale), placeholders
    for the parts the modes do not use. K and V are written reordered and contiguous, quantized in the
    integer/8-bit modes. With q (and its block bq >= bk) it also writes the reordered Q: in q's dtype,
    or int8/int4 values with per-block scales for integer QK. Separate so benchmarks can time the
    prologue alone."""
    B, H, N, D = k.shape
    nk = -(-N // bk)
    n_pad = nk * bk
    qk_code, pv_code = QK_CODES[qk], PV_CODES[pv]
    device = k.device
    k_mean, v_amax = _statistics(k, v, qk, pv, key_mean_stride(N, height, width))
    placeholder = _placeholder(device)
    k_scale = placeholder
    if qk_code != QK_FP:
        kq = torch.empty(B * H, n_pad, D, dtype=torch.int8, device=device)  # int8 or int4 values
        k_scale = torch.empty(B * H, nk, dtype=torch.float32, device=device)
    else:
        kq = torch.empty(B * H, n_pad, D, dtype=k.dtype, device=device)
    if pv_code != PV_FP:
        vq = torch.empty(B * H, D, n_pad, dtype=torch.float8_e4m3fn if pv_code == PV_FP8 else torch.int8, device=device)
    else:
        vq = torch.empty(B * H, n_pad, D, dtype=v.dtype, device=device)
    qq = q_scale = placeholder
    nq = 0
    if q is not None:
        nq = -(-N // bq)
        qq = torch.empty(B * H, nq * bq, D, dtype=q.dtype if qk_code == QK_FP else torch.int8, device=device)
        if qk_code != QK_FP:
            q_scale = torch.empty(B * H, nq, dtype=torch.float32, device=device)
    _kv_prologue_kernel[(nk, B * H)](
        k, v, k_mean if k_mean is not None else placeholder, v_amax if v_amax is not None else placeholder,
        kq, k_scale, vq, q if q is not None else k, qq, q_scale,
        *k.stride(), *v.stride(), *(q if q is not None else k).stride(),
        orders, N, n_pad, H, nq, prefix, frames, height, width,
        HEAD_DIM=D, BLOCK_N=bk, QK_MODE=qk_code, PV_MODE=pv_code, WRITE_Q=q is not None,
        BLOCK_Q=bq or bk, num_warps=4,  # 8 warps: int8+fp8 11-12% slower (H200, docs/notes/prologue.md)
    )
    return kq, k_scale, vq, v_amax if v_amax is not None else placeholder, qq, q_scale


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
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the RoPE pass (with cos/sin: float32 [S, D] tables for the last S tokens), the prologue and
    the attention kernel. Inputs are checked already. `out` (tests poison it) defaults to a new tensor
    shaped and strided like q."""
    B, H, N, D = q.shape
    if out is None:
        out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    if cos is not None:
        q, k = rotate_qk(q, k, cos, sin)
    nq, nk = -(-N // bq), -(-N // bk)
    choice = launch_choice(q, bq, bk, qk, pv)
    config = choice.config
    q_tma = choice.prologue_writes_q(q, out)
    kq, k_scale, vq, v_amax, qq, q_scale = prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv,
                                                      q if q_tma else None, bq)
    if choice.runs_warp_specialized(q, out):
        return hopper_attention.launch(q, kq, vq, out, orders, counts, indices, schedule, N, nk * bk, H, nq, nk,
                                       prefix, frames, height, width, sm_scale * LOG2E, stages=config.num_stages)
    k_desc, v_desc = _descriptors(kq, vq, bk, D, pv) if choice.kv_tma else (kq, vq)
    q_desc = TensorDescriptor.from_tensor(qq.reshape(-1, D), [bq, D]) if q_tma else qq
    _attention_kernel[(nq, B * H)](
        q, out, kq, k_scale, vq, v_amax, k_desc, v_desc, q_desc, q_scale,
        orders, counts, indices, schedule,
        *q.stride(), *out.stride(),
        N, nk * bk, H, nq, nk, indices.shape[-1], prefix, frames, height, width, sm_scale * LOG2E,
        HEAD_DIM=D, BLOCK_M=bq, BLOCK_N=bk, QK_MODE=QK_CODES[qk], PV_MODE=PV_CODES[pv], EVEN_N=(N % bk == 0),
        P_LOG2_SCALE=P_LOG2_SCALES[PV_CODES[pv]], USE_TMA=choice.kv_tma, OVERLAP_QK=config.overlap_qk, Q_TMA=q_tma,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


@torch.library.custom_op("paroattn::block_sparse_attention", mutates_args=())
def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    orders: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor, schedule: torch.Tensor,
    prefix: int, frames: int, height: int, width: int, bq: int, bk: int, qk: str, pv: str, sm_scale: float,
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PARO op on prepared arguments (device int32 orders, active-block lists, schedule, optional
    float32 RoPE tables). One opaque node for torch.compile; its output has q's shape, dtype and strides."""
    return launch(q, k, v, orders, counts, indices, schedule, prefix, frames, height, width, bq, bk, qk, pv, sm_scale,
                  cos, sin)


@block_sparse_attention.register_fake
def _block_sparse_attention_fake(q, k, v, orders, counts, indices, schedule, prefix, frames, height, width,
                                 bq, bk, qk, pv, sm_scale, cos=None, sin=None):
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
) -> torch.Tensor:
    """See `paroattn.paro_attention`; inputs were checked against the op contract by the caller."""
    check_triton_inputs(q, bq, bk, qk, pv)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise PAROInputError(
            "the triton backend is inference-only (no backward): q, k or v requires grad. Run under "
            "torch.no_grad() / torch.inference_mode() (diffusers pipelines do), or use backend='torch' to train"
        )
    device = q.device
    blocks = block_mask if isinstance(block_mask, ActiveBlocks) else ActiveBlocks.from_mask(block_mask.to(device))
    if blocks.counts.device != device:
        blocks = blocks.to(device)
    schedule = blocks.schedule
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    args = (q, k, v, _device_orders(orders, device), blocks.counts, blocks.indices, schedule,
            layout.prefix, layout.frames, layout.height, layout.width, bq, bk, qk, pv, float(sm_scale),
            *(rotary if rotary is not None else (None, None)))
    if torch.compiler.is_compiling():
        return block_sparse_attention(*args)  # one opaque node in the graph
    return launch(*args)  # eager: the same function without the custom-op dispatch (~tens of us)


__all__ = ["block_sparse_attention", "launch", "paro_attention_triton", "prepare_kv"]
