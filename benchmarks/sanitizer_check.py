"""A few small paro_attention calls for compute-sanitizer: int8 QK + fp8 PV, 128 x 64 blocks, odd lengths, D = 128
and 64, B > 1, mixed orders per head, both K scale granularities, on the backend named (cuda, triton, auto):

    python benchmarks/sanitizer_check.py cuda                          # once: compiles the kernels (NVRTC cache)
    compute-sanitizer --tool memcheck python benchmarks/sanitizer_check.py cuda
    compute-sanitizer --tool racecheck python benchmarks/sanitizer_check.py cuda

Results: benchmarks/results/compute-sanitizer-sm90-int8fp8-nvidia-h200.txt.
"""
import sys

import torch

from paroattn import TokenLayout, paro_attention

backend = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(0)
for (B, H, layout, D) in ((1, 2, TokenLayout(7, 3, 10, 11), 128), (2, 3, TokenLayout(0, 2, 9, 13), 64)):
    N = layout.seq_len
    q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    nq, nk = -(-N // 128), -(-N // 64)
    mask = torch.rand(H, nq, nk, device="cuda", generator=g) < 0.5
    mask[:, :, 0] = True
    orders = torch.randint(0, 6, (H,), device="cuda", generator=g)
    for k_scale in ("block", "token"):
        out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=mask, block_size=(128, 64), qk="int8",
                             pv="fp8", backend=backend, k_scale=k_scale)
        torch.cuda.synchronize()
        print(backend, (B, H, N, D), k_scale, "finite" if torch.isfinite(out).all() else "NON-FINITE", flush=True)
