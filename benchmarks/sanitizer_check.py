"""A few small paro_attention calls for compute-sanitizer: int8 QK + fp8 PV, 128 x 64 blocks, odd lengths, D = 128
and 64, B > 1, mixed orders per head, both K scale granularities, on the backend named (cuda, triton, auto):

    python benchmarks/sanitizer_check.py cuda                          # once: compiles the kernels (NVRTC cache)
    compute-sanitizer --tool memcheck python benchmarks/sanitizer_check.py cuda
    compute-sanitizer --tool racecheck python benchmarks/sanitizer_check.py cuda --lineinfo

`--lineinfo` compiles the CUDA kernel with NVRTC's -lineinfo into a cache of its own (a temporary folder, so the
user's cache never holds these cubins): the sanitizer's reports then name attention.cu's lines, not only offsets
into the kernel's code, which depend on the NVRTC build.

Results: benchmarks/results/compute-sanitizer-sm90-int8fp8-nvidia-h200.txt.
"""
import argparse
import os
import tempfile

import torch

from paroattn import TokenLayout, paro_attention
from paroattn.kernels import sm90


def compile_with_line_info():
    """Every NVRTC compile of this process adds -lineinfo, its cubins cached in a fresh folder."""
    os.environ["PAROATTN_CACHE"] = tempfile.mkdtemp(prefix="paroattn-lineinfo-")
    compile_program = sm90._nvrtc_compile
    sm90._nvrtc_compile = lambda source, name, options: compile_program(source, name, [*options, "-lineinfo"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backend", choices=["cuda", "triton", "auto"])
    parser.add_argument("--lineinfo", action="store_true", help="compile the CUDA kernel with source line information")
    args = parser.parse_args()
    if args.lineinfo:
        compile_with_line_info()
    g = torch.Generator(device="cuda").manual_seed(0)
    for (B, H, layout, D) in ((1, 2, TokenLayout(7, 3, 10, 11), 128), (2, 3, TokenLayout(0, 2, 9, 13), 64)):
        N = layout.seq_len
        q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        nq, nk = -(-N // 128), -(-N // 64)
        mask = torch.rand(H, nq, nk, device="cuda", generator=g) < 0.5
        mask[:, :, 0] = True
        orders = torch.randint(0, 6, (H,), device="cuda", generator=g)
        for k_scale in ("block", "token"):
            out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=mask, block_size=(128, 64),
                                 qk="int8", pv="fp8", backend=args.backend, k_scale=k_scale)
            torch.cuda.synchronize()
            print(args.backend, (B, H, N, D), k_scale, "finite" if torch.isfinite(out).all() else "NON-FINITE",
                  flush=True)


if __name__ == "__main__":
    main()
