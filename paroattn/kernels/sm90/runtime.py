"""Run-time compilation and launch of CUDA C++ kernels: NVRTC (from torch's CUDA wheel) to a cubin,
cached on disk, loaded with the driver API; no nvcc and no build step.

The one place that talks to NVRTC and the CUDA driver (both through ctypes). Everything that can fail
here raises `KernelLoadError` with a sentence that says what failed; callers turn it into a refusal
(another kernel family runs the call).

Cache: `$PAROATTN_CACHE` or `~/.cache/paroattn`, one cubin per (source, defines, GPU arch, NVRTC
version), named by a hash of all of them.
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
from pathlib import Path

import torch


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
