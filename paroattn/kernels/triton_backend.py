"""`backend="triton"` of `paroattn.paro_attention`: input checks, tile configs, the launches, and
the `torch.library` custom op that makes the call opaque to torch.compile and CUDA-graph friendly.

The kernels are in `block_sparse_attention.py` (and the RoPE pass in `rotary.py`), plus, for bf16 at
128 x 64 blocks on sm_90, the warp-specialized Gluon kernel of `hopper_attention.py`; their definition
is `reference.py`.

Host-side work per call is kept small and sync-free when the caller passes what a processor has:
device `orders` (or CPU orders, converted once and cached) and prebuilt `ActiveBlocks` on the GPU.
A bool `block_mask` is converted to `ActiveBlocks` on every call (it syncs to size the lists):
convenient for tests, not for a hot loop.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import PAROInputError
from ..layout import TokenLayout
from . import hopper_attention, interpreting
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
from .reference import key_mean_stride
from .rotary import rotate_qk

QK_CODES = {"bf16": QK_FP, "int8": QK_INT8, "int4": QK_INT4}
PV_CODES = {"bf16": PV_FP, "fp8": PV_FP8, "int8": PV_INT8}
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Tile configs. The tiles are the mask blocks (BLOCK_M = bq, BLOCK_N = bk); what remains to choose
# is warps, pipeline depth and the load/overlap options, per (head dim, block sizes, QK mode, PV mode). The table holds the
# choice measured on an H100/H200 (benchmarks/attention.py --sweep); anything not in it falls back to
# a rule. Looked up once per key and cached: never re-tuned per call.


@dataclass(frozen=True)
class KernelConfig:
    num_warps: int
    num_stages: int
    # bf16/fp16 K and V: gather them from the caller's tensors in the attention kernel (True), or
    # let the prologue write reordered copies that the kernel reads contiguously (False)
    gather_kv: bool = False
    # read the prologue's K/V tiles with the Hopper tensor-memory accelerator (descriptor loads)
    # instead of per-thread pointer loads; needs gather_kv=False
    tma: bool = False
    # issue the QK product of the next key block before this block's softmax (software pipelining
    # by one block, so the asynchronous wgmma overlaps the exp2 work)
    overlap_qk: bool = False
    # the prologue also writes the reordered Q (int8/int4 values and per-block scales for integer QK)
    # and the kernel reads each query tile by one descriptor load instead of gathering and quantizing
    # it in registers; needs tma and bq >= bk (the prologue's key-block grid covers the query blocks)
    q_tma: bool = False
    # run `hopper_attention`'s warp-specialized Gluon kernel (a loader warp, two consumer warpgroups) on
    # the prologue's reordered Q/K/V copies: bf16/fp16, or int8/int4 QK + fp8 PV, at 128 x 64 blocks,
    # sm_90 only (other GPUs run the Triton kernel with the remaining fields)
    warp_specialized: bool = False


# (head_dim, bq, bk, qk, pv) -> config, measured on an H200 (benchmarks/attention.py sweeps, 2026-11-21).
# 64 x 64 tiles: the fastest of {4 warps x 2/3/4 stages} x {pointer loads, TMA} x {overlap_qk or not}
# over d = 1.0 and 0.2 on the CogVideoX-5B shape (D=64) and Wan2.1-1.3B / FLUX.1-dev (D=128); where the
# two D=128 shapes disagreed, Wan's choice (the longer sequence) is kept (Flux loses <= 10%). int8 QK +
# bf16 PV was not in that sweep: its entries are the earlier 4-warp sweep.
T, O, TQ = dict(tma=True), dict(overlap_qk=True), dict(tma=True, q_tma=True)
_MEASURED: dict[tuple, KernelConfig] = {
    (64, 64, 64, "bf16", "bf16"): KernelConfig(4, 4, **T),
    (64, 64, 64, "int8", "bf16"): KernelConfig(4, 4),
    (64, 64, 64, "int8", "fp8"): KernelConfig(4, 3, **O),
    (64, 64, 64, "int8", "int8"): KernelConfig(4, 3),
    (64, 64, 64, "int4", "fp8"): KernelConfig(4, 3, **O),  # int4 values run the int8 kernel: its configs
    (128, 64, 64, "bf16", "bf16"): KernelConfig(4, 2, **T, **O),
    (128, 64, 64, "int8", "bf16"): KernelConfig(4, 4),
    (128, 64, 64, "int8", "fp8"): KernelConfig(4, 3, **T, **O),
    (128, 64, 64, "int8", "int8"): KernelConfig(4, 3, **O),
    (128, 64, 64, "int4", "fp8"): KernelConfig(4, 3, **T, **O),  # (the int8 + fp8 entry)
    # 128-row query tiles, 64-key blocks: the fastest of {8 warps x 2/3 stages, 4 warps x 3 stages} at
    # d=0.5 (an earlier sweep, before TMA and overlap_qk existed; 4 warps, one warpgroup issuing two m64
    # products, won everywhere but D=64 bf16 and D=128 int8 PV), replaced where 4 warps with TMA loads of
    # K, V and Q (q_tma) were faster at d = 1.0 / 0.5 / 0.2 (fifth session, H200, BENCHMARKS.md): D=128
    # bf16 12.42 / 6.06 / 2.53 ms vs 14.56 / 7.09 / 2.97 (Wan2.1-1.3B), int8+fp8 10.16 / 5.22 / 2.30 vs
    # 13.08 / 6.05 / 2.67; D=64 int8+fp8 17.74 / 9.12 / 4.06 vs 20.80 / 9.77 / 4.40 (CogVideoX-5B), where
    # bf16 stays as it was (20.06 / 9.97 / 4.33 vs 20.18 / 9.54 / 4.07). D=128 int8+bf16 with q_tma: 10.91
    # / 5.51 / 2.44 ms (not compared with the old config); int8+int8 with it was slow (16.75 ms at d=1.0).
    (64, 128, 64, "bf16", "bf16"): KernelConfig(8, 3),
    (64, 128, 64, "int8", "bf16"): KernelConfig(4, 3),
    (64, 128, 64, "int8", "fp8"): KernelConfig(4, 3, **TQ),
    (64, 128, 64, "int8", "int8"): KernelConfig(4, 3),
    (64, 128, 64, "int4", "fp8"): KernelConfig(4, 3, **TQ),
    # D=128 bf16: the warp-specialized Gluon kernel (hopper_attention) on sm_90, 3 K/V stages; measured
    # against this table's previous entry, KernelConfig(4, 2, **TQ), in one run on an H100 (sixth session,
    # BENCHMARKS.md), ms at d = 1.0 / 0.5 / 0.2: Wan2.1-1.3B 11.74 / 6.00 / 2.52 vs 12.33 / 6.42 / 2.87,
    # Wan2.1-14B 720p 212.4 / 111.4 / 44.8 vs 240.8 / 129.3 / 47.9, FLUX.1-dev dense 0.561 vs 0.617. Other
    # GPUs run the Triton kernel with the remaining fields (3 stages: 3% slower there than 2, H200).
    (128, 128, 64, "bf16", "bf16"): KernelConfig(4, 3, **TQ, warp_specialized=True),
    (128, 128, 64, "int8", "bf16"): KernelConfig(4, 3, **TQ),
    # int8 QK + fp8 PV stays on the Triton kernel: the Gluon kernel's version of it is slower, Wan2.1-1.3B
    # 10.57 / 5.40 / 2.56 ms vs 9.81 / 4.98 / 2.25 (H100, one run, seventh session; 12.62 / 6.46 / 2.92
    # before P stopped moving between registers)
    (128, 128, 64, "int8", "fp8"): KernelConfig(4, 3, **TQ),
    (128, 128, 64, "int8", "int8"): KernelConfig(8, 3),
    (128, 128, 64, "int4", "fp8"): KernelConfig(4, 3, **TQ),
    # 128 x 128 tiles (a plan with block_size=128): the fastest of {8 warps x 3 stages} x {TMA, overlap_qk}
    # and 8 warps x 2 stages with TMA, same sweep as the 64 x 64 entries; 4 warps was 2x slower at D=128
    # (also with q_tma: Wan2.1-1.3B bf16 23.40 vs 14.77 ms at d=1.0). At D=64, 4 warps with q_tma (fifth
    # session): bf16 18.94 / 9.38 / 4.07 ms vs 24.96 / 10.90 / 4.70, int8+fp8 16.89 / 8.80 / 3.92 vs 23.87 /
    # 10.70 / 4.87 (d = 1.0 / 0.5 / 0.2, CogVideoX-5B)
    (64, 128, 128, "bf16", "bf16"): KernelConfig(4, 2, **TQ),
    (64, 128, 128, "int8", "fp8"): KernelConfig(4, 2, **TQ),
    (128, 128, 128, "bf16", "bf16"): KernelConfig(8, 2, **T),
    (128, 128, 128, "int8", "fp8"): KernelConfig(8, 3, **O),
}
del T, O, TQ
_CHOSEN: dict[tuple, KernelConfig] = {}


# for keys not in the table. Measured (H200): 8 warps on a 64-row tile is 1.7x slower than 4, and 4
# warps won most 128-row sweeps too; reordered K/V copies beat in-kernel gathers by 1.3-1.5x (index
# arithmetic per key row, scattered rows)
_DEFAULT_CONFIG = KernelConfig(4, 3, gather_kv=False)


def kernel_config(head_dim: int, bq: int, bk: int, qk: str, pv: str) -> KernelConfig:
    key = (head_dim, bq, bk, qk, pv)
    config = _CHOSEN.get(key)
    if config is None:
        override = os.environ.get("PARO_KERNEL_CONFIG")  # for sweeps
        if override:
            # "warps,stages[,gather[,tma[,overlap[,q_tma[,warp_specialized]]]]]"
            warps, stages, *flags = (int(x) for x in override.split(","))
            flags += [0] * 5
            config = KernelConfig(warps, stages, *(bool(f) for f in flags[:5]))
        else:
            config = _MEASURED.get(key, _DEFAULT_CONFIG)
        _CHOSEN[key] = config
    return config


def config_problem(config: KernelConfig, bq: int, bk: int, qk: str = "bf16", pv: str = "bf16") -> str | None:
    """What makes `config` unusable for blocks (bq, bk) and modes (qk, pv) (None when nothing does)."""
    if config.warp_specialized and ((bq, bk) != (hopper_attention.BLOCK_M, hopper_attention.BLOCK_N)
                                    or (qk, pv) not in hopper_attention.MODES or config.gather_kv):
        return (f"KernelConfig(warp_specialized=True) runs (qk, pv) in {hopper_attention.MODES} at blocks "
                f"({hopper_attention.BLOCK_M}, {hopper_attention.BLOCK_N}) with gather_kv=False; got {config} for "
                f"blocks ({bq}, {bk}), modes ({qk}, {pv})")
    if config.q_tma and (not config.tma or config.gather_kv or bq < bk):
        return (f"KernelConfig(q_tma=True) needs tma=True, gather_kv=False and query blocks at least as large as "
                f"key blocks; got {config} for blocks ({bq}, {bk})")
    return None


def set_kernel_config(head_dim: int, bq: int, bk: int, qk: str, pv: str, config: KernelConfig | None) -> None:
    """Pin (or with None, forget) the config of one key; the benchmark sweep uses this."""
    key = (head_dim, bq, bk, qk, pv)
    if config is not None and (problem := config_problem(config, bq, bk, qk, pv)):
        raise ValueError(problem)
    if config is None:
        _CHOSEN.pop(key, None)
    else:
        _CHOSEN[key] = config


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


def prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv, gather_kv=True, q=None, bq=None):
    """The statistics and the K/V prologue: returns (kq, k_scale, vq, v_amax, qq, q_scale), placeholders
    for the parts the modes do not use. With q (and its block bq >= bk) it also writes the reordered Q:
    in q's dtype, or int8/int4 values with per-block scales for integer QK. Separate so benchmarks can
    time the prologue alone."""
    B, H, N, D = k.shape
    nk = -(-N // bk)
    n_pad = nk * bk
    qk_code, pv_code = QK_CODES[qk], PV_CODES[pv]
    device = k.device
    k_mean, v_amax = _statistics(k, v, qk, pv, key_mean_stride(N, height, width))
    placeholder = _placeholder(device)
    kq = k_scale = vq = placeholder
    if qk_code != QK_FP:
        kq = torch.empty(B * H, n_pad, D, dtype=torch.int8, device=device)  # int8 or int4 values
        k_scale = torch.empty(B * H, nk, dtype=torch.float32, device=device)
    elif not gather_kv:
        kq = torch.empty(B * H, n_pad, D, dtype=k.dtype, device=device)
    if pv_code != PV_FP:
        vq = torch.empty(B * H, D, n_pad, dtype=torch.float8_e4m3fn if pv_code == PV_FP8 else torch.int8, device=device)
    elif not gather_kv:
        vq = torch.empty(B * H, n_pad, D, dtype=v.dtype, device=device)
    qq = q_scale = placeholder
    nq = 0
    if q is not None:
        nq = -(-N // bq)
        qq = torch.empty(B * H, nq * bq, D, dtype=q.dtype if qk_code == QK_FP else torch.int8, device=device)
        if qk_code != QK_FP:
            q_scale = torch.empty(B * H, nq, dtype=torch.float32, device=device)
    if qk_code != QK_FP or pv_code != PV_FP or not gather_kv or q is not None:
        _kv_prologue_kernel[(nk, B * H)](
            k, v, k_mean if k_mean is not None else placeholder, v_amax if v_amax is not None else placeholder,
            kq, k_scale, vq, q if q is not None else k, qq, q_scale,
            *k.stride(), *v.stride(), *(q if q is not None else k).stride(),
            orders, N, n_pad, H, nq, prefix, frames, height, width,
            HEAD_DIM=D, BLOCK_N=bk, QK_MODE=qk_code, PV_MODE=pv_code, GATHER_KV=gather_kv, WRITE_Q=q is not None,
            BLOCK_Q=bq or bk, num_warps=4,  # 8: int8+fp8 11-12% slower (H200, ninth session)
        )
    return kq, k_scale, vq, v_amax if v_amax is not None else placeholder, qq, q_scale


_TMA_DEVICES: dict[torch.device, bool] = {}


def _has_tma(device: torch.device) -> bool:
    """Hopper or newer (the configs were tuned on an H200; older GPUs read the same tiles by pointer)."""
    if interpreting():
        return True
    has = _TMA_DEVICES.get(device)
    if has is None:
        has = _TMA_DEVICES[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return has


def _runs_warp_specialized(config: KernelConfig, bq: int, bk: int, qk: str, pv: str, q: torch.Tensor,
                           out: torch.Tensor) -> bool:
    """Whether a launch with this config runs hopper_attention's kernel (else the Triton kernel)."""
    return (config.warp_specialized and hopper_attention.available(q.device)
            and config_problem(config, bq, bk, qk, pv) is None and hopper_attention.takes_strides(q, out))


def prologue_writes_q(config: KernelConfig, bq: int, bk: int, qk: str, pv: str, q: torch.Tensor,
                      out: torch.Tensor) -> bool:
    """Whether the prologue writes the reordered Q for this launch: for the Triton kernel's descriptor
    loads of Q (KernelConfig.q_tma on Hopper or newer; elsewhere the same config gathers Q by pointer
    loads, as it reads K and V), and for the warp-specialized kernel's int8/int4 Q, which is quantized
    per 128-row tile across its two consumer warpgroups (its bf16/fp16 consumers gather their rows)."""
    return _writes_q(config, bq, bk, qk, q.device, _runs_warp_specialized(config, bq, bk, qk, pv, q, out))


def _writes_q(config: KernelConfig, bq: int, bk: int, qk: str, device: torch.device, warp_specialized: bool) -> bool:
    if warp_specialized:
        return qk != "bf16"
    return config.q_tma and _has_tma(device) and config_problem(config, bq, bk) is None


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
    config = kernel_config(D, bq, bk, qk, pv)
    use_tma = config.tma and not config.gather_kv and _has_tma(q.device)
    warp_specialized = _runs_warp_specialized(config, bq, bk, qk, pv, q, out)
    q_tma = _writes_q(config, bq, bk, qk, q.device, warp_specialized)
    kq, k_scale, vq, v_amax, qq, q_scale = prepare_kv(k, v, orders, prefix, frames, height, width, bk, qk, pv,
                                                      config.gather_kv, q if q_tma else None, bq)
    if warp_specialized:
        return hopper_attention.launch(q, qq if q_tma else None, kq, vq, out, orders, counts, indices, schedule,
                                       N, nk * bk, H, nq, nk, prefix, frames, height, width, sm_scale * LOG2E,
                                       k_scale, q_scale, v_amax, stages=config.num_stages)
    k_desc, v_desc = _descriptors(kq, vq, bk, D, pv) if use_tma else (kq, vq)
    q_desc = TensorDescriptor.from_tensor(qq.reshape(-1, D), [bq, D]) if q_tma else qq
    _attention_kernel[(nq, B * H)](
        q, k, v, out, kq, k_scale, vq, v_amax, k_desc, v_desc, q_desc, q_scale,
        orders, counts, indices, schedule,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        N, nk * bk, H, nq, nk, indices.shape[-1], prefix, frames, height, width, sm_scale * LOG2E,
        HEAD_DIM=D, BLOCK_M=bq, BLOCK_N=bk, QK_MODE=QK_CODES[qk], PV_MODE=PV_CODES[pv], EVEN_N=(N % bk == 0),
        GATHER_KV=config.gather_kv, P_LOG2_SCALE=P_LOG2_SCALES[PV_CODES[pv]], USE_TMA=use_tma,
        OVERLAP_QK=config.overlap_qk, Q_TMA=q_tma,
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


def unsupported_reason(q: torch.Tensor, bq: int, bk: int) -> str | None:
    """Why the Triton kernels cannot run this call (None when they can)."""
    D = q.shape[-1]
    if D not in HEAD_DIMS:
        return f"the triton backend supports head dims {HEAD_DIMS}; got D={D}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the triton backend takes float16 or bfloat16 q, k, v; got {q.dtype} (cast them)"
    if not (q.is_cuda or interpreting()):
        return f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for tests); got {q.device}"
    allowed = (16, 32, 64, 128) if interpreting() else (32, 64, 128)
    if bq not in allowed or bk not in allowed:
        return f"the triton backend supports block sizes {allowed}; got (bq, bk) = ({bq}, {bk})"
    return None


def check_triton_inputs(q: torch.Tensor, bq: int, bk: int) -> None:
    reason = unsupported_reason(q, bq, bk)
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
    check_triton_inputs(q, bq, bk)
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


__all__ = [
    "KernelConfig", "block_sparse_attention", "kernel_config", "paro_attention_triton", "set_kernel_config",
    "unsupported_reason",
]
