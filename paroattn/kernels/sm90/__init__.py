"""The sm_90a CUDA C++ kernel family: block-sparse INT8-QK / FP8-PV attention (`attention.cu`),
compiled at first use with NVRTC (`runtime.py`) and launched on the Triton K/V prologue's outputs.

    reason = refusal(q.shape, q.dtype, D, bq, bk, qk, pv, key_mask is not None, arch)  # None: it runs
    kernel = build(D, q.dtype, q.device)     # compiled (or read from the disk cache) and loaded; KernelLoadError
    maps = tensor_maps(qq, kq, vq)           # once per buffer set
    launch(kernel, maps, qq, q_scale, kq, k_scale, vq, v_amax, out, orders, counts, indices, schedule, N=..., ...)

The device's runtime keeps what `build` returns (`kernels.runtime.Runtime.cuda_kernel`): nothing here keeps
state. What it computes is `reference.paro_attention_reference`'s definition; the kernel reads the same
prologue buffers as the Triton kernel with `KernelConfig.q_tma` (reordered int8 Q with per-block scales).
"""

from __future__ import annotations

import ctypes
from functools import cache
from importlib import resources

import torch

from .runtime import KernelLoadError, TensorMap, compile_cubin, encode_tensor_map, load

ARCH = "sm_90a"
HEAD_DIMS = (64, 128)
BLOCK_M, BLOCK_N = 128, 64
TILE_M = 64  # query rows per CTA: two CTAs per 128-row block of the lists
KERNEL_NAME = "paro_attention_int8_fp8"
OUT_DTYPES = (torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634
BARRIER_BYTES = 48  # attention.cu's kBarrierBytes: three mbarriers and the CTA's indices


def shared_bytes(head_dim: int, max_active: int) -> int:
    """Dynamic shared memory of a launch: the Q tile (64 rows), two K and two V^T blocks, the barriers, and the
    active list (an index and a K scale per entry)."""
    return TILE_M * head_dim + 4 * BLOCK_N * head_dim + BARRIER_BYTES + 8 * max_active


MAX_SHARED_BYTES = 227 * 1024  # sm_90's opt-in shared memory per block
MAX_SEQ_LEN = 1 << 20  # lists of up to N / 64 = 16384 entries fit beside the tiles


def refusal(q_shape: tuple[int, ...], dtype: torch.dtype, head_dim: int, bq: int, bk: int, qk: str, pv: str,
            has_key_mask: bool, arch: tuple[int, int] | None) -> str | None:
    """Why this family does not run a call (a sentence), or None when it does. `arch`: the GPU's
    (major, minor) compute capability, None without a CUDA device. A key padding mask is supported."""
    if arch != (9, 0):
        found = "no CUDA device" if arch is None else f"sm_{arch[0]}{arch[1]}"
        return f"the sm90 CUDA kernels need an sm_90 GPU (H100/H200: wgmma), found {found}"
    if qk not in ("int8", "int4") or pv != "fp8":
        return (f"the sm90 CUDA kernels run qk='int8'/'int4' with pv='fp8' only, got qk={qk!r}, pv={pv!r} "
                "(the Triton/Gluon kernels run the others)")
    if head_dim not in HEAD_DIMS:
        return f"the sm90 CUDA kernels take head dims {HEAD_DIMS}, got {head_dim}"
    if (bq, bk) != (BLOCK_M, BLOCK_N):
        return f"the sm90 CUDA kernels take {BLOCK_M} x {BLOCK_N} blocks (bq x bk), got {bq} x {bk}"
    if dtype not in OUT_DTYPES:
        return f"the sm90 CUDA kernels take bfloat16 or float16 inputs, got {dtype}"
    if len(q_shape) != 4 or q_shape[2] > MAX_SEQ_LEN:
        return f"the sm90 CUDA kernels take q [B, H, N, D] with N <= {MAX_SEQ_LEN}, got {tuple(q_shape)}"
    return None


@cache
def source() -> str:
    return resources.files(__package__).joinpath("attention.cu").read_text()


def defines(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    return {"PARO_HEAD_DIM": head_dim, "PARO_OUT_BF16": int(dtype == torch.bfloat16)}


# every variant `refusal` lets through (head dim, output dtype), for the compile check
VARIANTS = [(d, dtype) for d in HEAD_DIMS for dtype in OUT_DTYPES]

# registers per thread at most, by head dim: what __launch_bounds__ allows for 3 CTAs of 128 threads per SM at
# 128, 4 at 64 (the compile check holds ptxas to it)
REGISTER_CEILING = {64: 128, 128: 168}

def build(head_dim: int, dtype: torch.dtype, device: torch.device):
    """The kernel of a variant compiled with NVRTC (once per machine: the cubin is cached on disk) and loaded on
    `device`; raises KernelLoadError saying what failed."""
    cubin = compile_cubin(source(), KERNEL_NAME, ARCH, defines(head_dim, dtype))
    return load(cubin, KERNEL_NAME, device, MAX_SHARED_BYTES)


def _pointer(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def tensor_maps(qq: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor) -> tuple[TensorMap, TensorMap, TensorMap]:
    """The kernel's TMA tensor maps of the prologue's reordered Q [B*H, NQ*128, D], K [B*H, N_PAD, D] (8-bit)
    and transposed V [B*H, D, N_PAD] (e4m3), each seen as 2-D rows of bytes: Q and K in boxes of 64 rows x D
    (swizzled over D bytes), V in boxes of D rows x 64 keys (64-byte swizzle)."""
    D = kq.shape[-1]
    for name, t in (("qq", qq), ("kq", kq), ("vq", vq)):
        if t.dim() != 3 or t.element_size() != 1 or not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be a contiguous 8-bit [B*H, rows, columns] tensor at a 16-byte aligned "
                             f"address, got {t.dtype} {tuple(t.shape)} with strides {t.stride()}")
        if t.numel() // t.shape[-1] >= 2**31:
            raise ValueError(f"{name} has {t.numel() // t.shape[-1]} rows, more than TMA's int32 coordinates reach")
    return (encode_tensor_map(qq.data_ptr(), qq.numel() // D, D, D, TILE_M, D, D),
            encode_tensor_map(kq.data_ptr(), kq.numel() // D, D, D, BLOCK_N, D, D),
            encode_tensor_map(vq.data_ptr(), vq.numel() // vq.shape[-1], vq.shape[-1], vq.shape[-1], D, BLOCK_N,
                              BLOCK_N))


def launch(kernel, maps: tuple[TensorMap, TensorMap, TensorMap], qq, q_scale, kq, k_scale, vq, v_amax, out, orders,
           counts, indices, schedule, *, N: int, prefix: int, frames: int, height: int, width: int, sm_scale: float,
           key_mask: torch.Tensor | None = None) -> None:
    """`kernel` (`build`'s) with the tensor maps of the buffers it reads (`tensor_maps(qq, kq, vq)`): attention
    over the prologue's buffers (`triton_backend.prepare_kv` with q and bq=128, bk=64) into
    `out` [B, H, N, D] (any strides), rows at their original positions. `orders` int32 [H]; `counts`,
    `schedule` int32 [H, nq] and `indices` int32 [H, nq, max_active] (contiguous, `ActiveBlocks`);
    `key_mask` bool [B, suffix], False at padded keys of the tokens after the grid."""
    B, H, _, D = out.shape
    nq, nk = -(-N // BLOCK_M), -(-N // BLOCK_N)
    for name, t in (("counts", counts), ("indices", indices), ("schedule", schedule), ("orders", orders)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32, got {t.dtype} with strides {t.stride()}")
    q_map, k_map, v_map = maps
    suffix_start = prefix + frames * height * width
    if key_mask is not None:
        mask, mask_strides = key_mask.view(torch.uint8), key_mask.stride()
    else:
        mask, mask_strides = counts, (0, 0)  # not read
    c_long, c_int = ctypes.c_longlong, ctypes.c_int
    args = [q_map, k_map, v_map, _pointer(q_scale), _pointer(k_scale), _pointer(v_amax), _pointer(out),
            _pointer(orders), _pointer(counts), _pointer(indices), _pointer(schedule), _pointer(mask),
            *(c_long(s) for s in out.stride()), *(c_long(s) for s in mask_strides),
            c_int(N), c_int(nk * BLOCK_N), c_int(H), c_int(nq), c_int(nk), c_int(indices.shape[-1]), c_int(prefix),
            c_int(frames), c_int(height), c_int(width), c_int(suffix_start), ctypes.c_float(sm_scale * LOG2E),
            c_int(int(key_mask is not None))]
    stream = torch.cuda.current_stream(out.device).cuda_stream
    kernel.launch((nq * BLOCK_M // TILE_M, B * H, 1), (128, 1, 1), args, stream, shared_bytes(D, indices.shape[-1]))


__all__ = ["KernelLoadError", "build", "launch", "refusal", "tensor_maps"]
