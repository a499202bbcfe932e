"""SageAttention2's sm90 path (int8 QK, fp8 PV with fp32 two-level accumulation) as a benchmark anchor, built on
the GPU machine from a checkout of its public source (thu-ml/SageAttention); timed, never shipped or vendored.

Two ways of timing it:
- the kernel alone (`kernel_call`): `qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf` of its `_qattn_sm90`
  extension on inputs quantized here, outside the timing ([B, H, N, D], per-thread Q/K scales, V transposed and
  padded to 128 keys);
- the whole call (`whole_call`): the checkout's own `sageattn_qk_int8_pv_fp8_cuda_sm90` (K's mean, its Triton
  per-thread quantization of Q and K, V padded, transposed and quantized by its `_fused` extension, then the
  kernel): the peer of a whole `paro_attention` call, whose time includes its prologue.

`build(checkout)` compiles both extensions with torch.utils.cpp_extension (nvcc, ninja; about 95 s for the kernel's
two translation units on 16 cores, less for `_fused`), linked with -lcuda through a `libcuda.so` link to the driver's
library made in the build folder. A second call in the same machine's life loads what the first built.
"""

from __future__ import annotations

import importlib
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

FLAGS = ["-O3", "-std=c++17", "--use_fast_math", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
         "-DENABLE_BF16", "-gencode", "arch=compute_90a,code=sm_90a"]
PER_THREAD = 3  # its qk_quant_gran for per-thread scales
HND = 1  # its tensor_layout for [B, H, N, D]
SOURCES = {"_qattn_sm90": ["qattn/pybind_sm90.cpp", "qattn/qk_int_sv_f8_cuda_sm90.cu"],
           "_fused": ["fused/pybind.cpp", "fused/fused.cu"]}


@dataclass
class Sage2:
    kernels: object  # the `_qattn_sm90` extension
    package: object | None  # the checkout's `sageattention` package, wired to the extensions built here

    def kernel_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(fn, args) timing the kernel alone: q, k, v [B, H, N, D] bf16 quantized here with one scale per
        tensor (the per-thread scale arrays filled with it), so the output approximates softmax(q k^T) v."""
        B, H, N, D = q.shape
        q_amax, k_amax = float(q.abs().amax()), float(k.abs().amax())
        qi = (q.float() * (127 / q_amax)).round().to(torch.int8)
        ki = (k.float() * (127 / k_amax)).round().to(torch.int8)
        n_pad = -(-N // 128) * 128
        vt = torch.zeros(B, H, D, n_pad, device=v.device, dtype=torch.float8_e4m3fn)
        v_scale = v.float().abs().amax(dim=2) / 448  # per channel [B, H, D]
        vt[..., :N] = (v.float() / v_scale[:, :, None, :]).transpose(2, 3).to(torch.float8_e4m3fn)
        vt = _permute_keys(vt)
        q_scale = torch.full((B, H, -(-N // 64) * 32), q_amax / 127, device=q.device)
        k_scale = torch.full((B, H, -(-N // 128) * 4), k_amax / 127, device=q.device)
        out = torch.empty(B, H, N, D, dtype=torch.bfloat16, device=q.device)
        run = self.kernels.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf

        def fn(qi, ki, vt, out, q_scale, k_scale, v_scale):
            run(qi, ki, vt, out, q_scale, k_scale, v_scale, HND, 0, PER_THREAD, 1 / math.sqrt(D), 0)
            return out

        return fn, (qi, ki, vt, out, q_scale, k_scale, v_scale.contiguous())

    def whole_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.package.sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout="HND", pv_accum_dtype="fp32+fp32")


def _permute_keys(vt: torch.Tensor) -> torch.Tensor:
    """V^T's keys in the order its kernel reads them, as its `_fused.transpose_pad_permute_cuda` stores them:
    position p of every 16 holds key ORDER[p] of those 16."""
    order = torch.tensor([0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15], device=vt.device)
    n = vt.shape[-1]
    index = (torch.arange(0, n, 16, device=vt.device)[:, None] + order[None, :]).reshape(-1)
    return vt.view(torch.uint8)[..., index].view(torch.float8_e4m3fn).contiguous()


def build_root(folder: str = "sage-sm90-build") -> Path:
    """A build folder under the temporary directory (kept across calls), with a libcuda.so link for -lcuda to the
    driver's library."""
    import ctypes
    import os

    root = Path(tempfile.gettempdir()) / folder
    root.mkdir(exist_ok=True)
    if not (root / "libcuda.so").exists():
        ctypes.CDLL("libcuda.so.1")
        driver = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                      if "libcuda.so" in line)
        try:
            os.symlink(driver, root / "libcuda.so")
        except FileExistsError:  # another process building the other extension made it
            pass
    return root


def build_extension(checkout: Path, name: str):
    """One of its extensions (`_qattn_sm90` or `_fused`) compiled from `checkout`, or loaded where built before;
    two processes may build the two at once."""
    from torch.utils import cpp_extension

    root = build_root()
    build_dir = root / name
    build_dir.mkdir(exist_ok=True)
    csrc = Path(checkout).resolve() / "csrc"
    return cpp_extension.load(name=name, sources=[str(csrc / s) for s in SOURCES[name]], extra_cuda_cflags=FLAGS,
                              extra_cflags=["-O3", "-std=c++17", "-DENABLE_BF16"], extra_ldflags=[f"-L{root}", "-lcuda"],
                              build_directory=str(build_dir), verbose=False)


def build(checkout: Path) -> Sage2:
    """Both extensions from `checkout`, and its `sageattention` package imported with them."""
    checkout = Path(checkout).resolve()
    kernels = build_extension(checkout, "_qattn_sm90")
    try:
        fused = build_extension(checkout, "_fused")
    except Exception as error:  # the kernel alone still times
        print(f"SageAttention2's _fused extension did not build ({type(error).__name__}): no whole-call rows")
        return Sage2(kernels, None)
    return Sage2(kernels, import_checkout(checkout, "sageattention", {"_qattn_sm90": kernels, "_fused": fused}))


def import_checkout(checkout: Path, package: str, extensions: dict):
    """The checkout's `package`, importing the `extensions` (submodule name -> module built here) as its own
    submodules, ahead of any installed copy of the package."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]
    for name, module in extensions.items():
        sys.modules[f"{package}.{name}"] = module
    sys.path.insert(0, str(checkout))
    try:
        return importlib.import_module(package)
    finally:
        sys.path.remove(str(checkout))


if __name__ == "__main__":  # python benchmarks/sage2_anchor.py CHECKOUT NAME: build one extension ahead of a run
    build_extension(Path(sys.argv[1]), sys.argv[2])
