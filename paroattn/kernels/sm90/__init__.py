"""The sm_90a CUDA C++ kernel family: block-sparse INT8-QK / FP8-PV attention (`attention.cu`) and its host
side, launched on the Triton K/V prologue's outputs:

    reason = refusal(q.shape, q.dtype, D, bq, bk, qk, pv, key_mask is not None, arch)  # None: it runs
    kernel = build(D, q.dtype, q.device, k_scale)  # compiled (or read from the disk cache) and loaded; KernelLoadError
    maps = tensor_maps(qq, kq, vq)           # once per buffer set
    launch(kernel, maps, qq, q_scale, kq, k_scales, vq, v_amax, out, orders, counts, indices, schedule, N=..., ...)

`build` compiles the source at first use with NVRTC (from torch's CUDA wheel; no nvcc and no build step) to a
cubin, cached on disk, and loads it with the driver API. This is the one place that talks to NVRTC and the CUDA
driver (both through ctypes); everything that can fail there raises `KernelLoadError` with a sentence that says
what failed, which callers turn into a refusal (another kernel family runs the call). Cache: `$PAROATTN_CACHE` or
`~/.cache/paroattn`, one cubin per (source, defines, GPU arch, NVRTC version), named by a hash of all of them.

The device's runtime keeps what `build` returns (`kernels.runtime.Runtime.cuda_kernel`): nothing here keeps
state. What it computes is `reference.paro_attention_reference`'s definition; the kernel reads the same
prologue buffers as the Triton kernel with `KernelConfig.q_tma` (reordered int8 Q with per-block scales), K's scales
per key block or, in the variant built for k_scale="token", per key.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import site
import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import torch

from ...modes import K_SCALES  # K's scale granularities: one build each

ARCH = "sm_90a"
HEAD_DIMS = (64, 128)
BLOCK_M, BLOCK_N = 128, 64
TILE_M = 64  # query rows per CTA: two CTAs per 128-row block of the lists
KERNEL_NAME = "paro_attention_int8_fp8"
OUT_DTYPES = (torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634
BARRIER_BYTES = 48  # attention.cu's kBarrierBytes: three mbarriers and the CTA's indices


def shared_bytes(head_dim: int, max_active: int, k_scale: str = "block") -> int:
    """Dynamic shared memory of a launch: the Q tile (64 rows), two K and two V^T blocks, with per-key K scales
    two buffers of two blocks' scales (float32), the barriers, and the active list (an index and a K scale per
    entry)."""
    key_scales = 4 * BLOCK_N * 4 if k_scale == "token" else 0
    return TILE_M * head_dim + 4 * BLOCK_N * head_dim + key_scales + BARRIER_BYTES + 8 * max_active


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


def defines(head_dim: int, dtype: torch.dtype, k_scale: str = "block") -> dict[str, int]:
    return {"PARO_HEAD_DIM": head_dim, "PARO_OUT_BF16": int(dtype == torch.bfloat16),
            "PARO_K_PER_KEY": int(k_scale == "token")}


# every variant `refusal` lets through (head dim, output dtype), for the compile check; each is built per K scale
# granularity (K_SCALES)
VARIANTS = [(d, dtype) for d in HEAD_DIMS for dtype in OUT_DTYPES]

# registers per thread at most, by head dim: what __launch_bounds__ allows for 3 CTAs of 128 threads per SM at
# 128, 4 at 64 (the compile check holds ptxas to it)
REGISTER_CEILING = {64: 128, 128: 168}


def build(head_dim: int, dtype: torch.dtype, device: torch.device, k_scale: str = "block") -> Kernel:
    """The kernel of a variant and K scale granularity compiled with NVRTC (once per machine: the cubin is cached
    on disk) and loaded on `device`; raises KernelLoadError saying what failed."""
    if k_scale not in K_SCALES:
        raise ValueError(f"k_scale={k_scale!r} is not one of {K_SCALES}")
    cubin = compile_cubin(source(), KERNEL_NAME, ARCH, defines(head_dim, dtype, k_scale))
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


def launch(kernel, maps: tuple[TensorMap, TensorMap, TensorMap], qq, q_scale, kq, k_scales, vq, v_amax, out, orders,
           counts, indices, schedule, *, N: int, prefix: int, frames: int, height: int, width: int, sm_scale: float,
           key_mask: torch.Tensor | None = None, k_scale: str = "block") -> None:
    """`kernel` (`build`'s, of granularity `k_scale`) with the tensor maps of the buffers it reads
    (`tensor_maps(qq, kq, vq)`): attention over the prologue's buffers (`launch.prepare_kv` with q, bq=128, bk=64
    and the same `k_scale`: `k_scales` [B*H, NK] per key block, [B*H, N_PAD] per key) into
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
    expected = (B * H, nk * BLOCK_N if k_scale == "token" else nk)
    if tuple(k_scales.shape) != expected or k_scales.dtype != torch.float32 or not k_scales.is_contiguous():
        raise ValueError(f"k_scales must be contiguous float32 {list(expected)} for k_scale={k_scale!r}, got "
                         f"{k_scales.dtype} {list(k_scales.shape)} with strides {k_scales.stride()}")
    args = [q_map, k_map, v_map, _pointer(q_scale), _pointer(k_scales), _pointer(v_amax), _pointer(out),
            _pointer(orders), _pointer(counts), _pointer(indices), _pointer(schedule), _pointer(mask),
            *(c_long(s) for s in out.stride()), *(c_long(s) for s in mask_strides),
            c_int(N), c_int(nk * BLOCK_N), c_int(H), c_int(nq), c_int(nk), c_int(indices.shape[-1]), c_int(prefix),
            c_int(frames), c_int(height), c_int(width), c_int(suffix_start), ctypes.c_float(sm_scale * LOG2E),
            c_int(int(key_mask is not None))]
    stream = torch.cuda.current_stream(out.device).cuda_stream
    kernel.launch((nq * BLOCK_M // TILE_M, B * H, 1), (128, 1, 1), args, stream,
                  shared_bytes(D, indices.shape[-1], k_scale))


# ---------------------------------------------------------------------------------------------
# NVRTC and the CUDA driver.


class KernelLoadError(RuntimeError):
    """A kernel could not be compiled or loaded; the message says what failed."""


def cache_dir() -> Path:
    root = os.environ.get("PAROATTN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "paroattn"


def _nvrtc_candidates() -> list[str]:
    """libnvrtc by soname (found when torch or the loader path has it), then inside the nvidia wheels that
    torch's CUDA builds install (nvidia/cu13/lib for CUDA 13, nvidia/cuda_nvrtc/lib for CUDA 12)."""
    major = (torch.version.cuda or "13").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    for root in roots:
        for pattern in (f"nvidia/cu{major}/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):
            names += sorted(glob.glob(os.path.join(root, pattern)))
    return names


@cache
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library (opened once: a handle, like the library itself, never changes)."""
    errors = []
    for name in _nvrtc_candidates():
        try:
            return ctypes.CDLL(name)
        except OSError as error:
            errors.append(f"{name}: {error}")
    raise KernelLoadError(
        "NVRTC (libnvrtc) was not found: install a CUDA build of torch (its wheels ship it) or the "
        f"nvidia-cuda-nvrtc package; tried {', '.join(errors[:3])}")


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check_nvrtc(result: int, what: str) -> None:
    if result != 0:
        lib = nvrtc()
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise KernelLoadError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(result).decode()}")


@cache
def driver() -> ctypes.CDLL:
    """The CUDA driver library (opened once)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise KernelLoadError(f"the CUDA driver library libcuda.so.1 could not be loaded: {error}") from error


def _check_cuda(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(result, ctypes.byref(text))
        raise KernelLoadError(f"CUDA driver {what} failed: {(text.value or b'error ' + str(result).encode()).decode()}")


def compile_cubin(source: str, name: str, arch: str, defines: dict[str, int]) -> bytes:
    """NVRTC's cubin of `source` for `arch` (e.g. "sm_90a") with `defines`, from the disk cache when an
    identical compile ran before."""
    version = nvrtc_version()
    options = [f"--gpu-architecture={arch}", "-std=c++17", "--use_fast_math",
               *(f"-D{key}={value}" for key, value in sorted(defines.items()))]
    digest = hashlib.sha256("\0".join([source, name, *options, f"nvrtc{version}"]).encode()).hexdigest()[:20]
    path = cache_dir() / "cubin" / f"{name}-{arch}-{digest}.cubin"
    if path.is_file():
        return path.read_bytes()
    cubin = _nvrtc_compile(source, name, options)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        tmp.replace(path)  # atomic: concurrent processes never read a partial file
    except OSError:
        pass  # an unwritable cache costs a compile per process, nothing else
    return cubin


def _nvrtc_compile(source: str, name: str, options: list[str]) -> bytes:
    lib = nvrtc()
    program = ctypes.c_void_p()
    _check_nvrtc(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None),
                 "nvrtcCreateProgram")
    try:
        encoded = [option.encode() for option in options]
        result = lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise KernelLoadError(f"NVRTC could not compile {name}: {log.value.decode(errors='replace')[:2000]}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


class TensorMap(ctypes.Structure):
    """A CUtensorMap: 128 opaque bytes that the driver encodes and a kernel takes by value (`__grid_constant__`).
    ctypes aligns a structure to 8 bytes at most, the driver wants 64: the map is encoded into an aligned spot of
    a larger buffer and copied here, and a launch copies it again from here into the kernel's parameters."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle by span in bytes
_L2_PROMOTION = {0: 0, 64: 1, 128: 2, 256: 3}  # CUtensorMapL2promotion by bytes


def encode_tensor_map(address: int, rows: int, row_bytes: int, row_stride: int, box_rows: int, box_bytes: int,
                      swizzle: int, l2_promotion: int = 0) -> TensorMap:
    """The tensor map of a 2-D byte array at device `address` (`rows` rows of `row_bytes` bytes, `row_stride`
    bytes apart) whose copies move boxes of `box_rows` x `box_bytes` into shared memory swizzled over `swizzle`
    bytes (0, 32, 64 or 128), their L2 fetches promoted to `l2_promotion` bytes (0: none, 64, 128, 256), with
    `cuTensorMapEncodeTiled`; raises KernelLoadError."""
    lib = driver()
    if not hasattr(lib, "cuTensorMapEncodeTiled"):
        raise KernelLoadError("the CUDA driver has no cuTensorMapEncodeTiled (TMA needs a CUDA 12 driver or newer)")
    buffer = ctypes.create_string_buffer(128 + 64)
    aligned = (ctypes.addressof(buffer) + 63) & ~63
    dims = (ctypes.c_uint64 * 2)(row_bytes, rows)
    strides = (ctypes.c_uint64 * 1)(row_stride)
    box = (ctypes.c_uint32 * 2)(box_bytes, box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    uint8, no_interleave, no_oob_fill = 0, 0, 0
    _check_cuda(lib.cuTensorMapEncodeTiled(
        ctypes.c_void_p(aligned), uint8, ctypes.c_uint32(2), ctypes.c_void_p(address), dims, strides, box, unit,
        no_interleave, _SWIZZLE[swizzle], _L2_PROMOTION[l2_promotion], no_oob_fill), "cuTensorMapEncodeTiled")
    return TensorMap.from_buffer_copy(ctypes.string_at(aligned, 128))


@dataclass
class Kernel:
    """One loaded `extern "C"` kernel of a cubin, in the current context of the device it was loaded on."""

    module: ctypes.c_void_p
    function: ctypes.c_void_p
    max_shared_bytes: int

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, stream: int,
               shared_bytes: int) -> None:
        """`args`: ctypes values in the kernel's parameter order (c_void_p pointers, c_int, c_longlong,
        c_float, TensorMap)."""
        if shared_bytes > self.max_shared_bytes:
            raise KernelLoadError(f"a launch needs {shared_bytes} bytes of shared memory, the kernel was loaded with "
                                  f"{self.max_shared_bytes}")
        pointers = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args))
        _check_cuda(driver().cuLaunchKernel(
            self.function, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_bytes,
            ctypes.c_void_p(stream), pointers, None), "cuLaunchKernel")


def load(cubin: bytes, name: str, device: torch.device, max_shared_bytes: int) -> Kernel:
    """`name` of `cubin` loaded on `device`, allowed up to `max_shared_bytes` of dynamic shared memory per launch
    (the device's runtime keeps what it loaded: `kernels.runtime.Runtime.cuda_kernel`)."""
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # the primary context is current on this thread
        lib = driver()
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check_cuda(lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        _check_cuda(lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()), "cuModuleGetFunction")
        max_dynamic_shared = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check_cuda(lib.cuFuncSetAttribute(function, max_dynamic_shared, max_shared_bytes), "cuFuncSetAttribute")
        return Kernel(module, function, max_shared_bytes)
