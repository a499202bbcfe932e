"""The sm_90a CUDA kernel alone (its prologue outside the timing) in variants of its compile-time defines, with
FlashAttention-3 FP8's forward (kernel alone, `fa3-fwd`, when importable) beside it on the same shape.

    python benchmarks/sm90_kernel.py --shapes wan2.1-1.3b,cogvideox-5b --densities 1.0,0.2 \\
        --variant default: --variant five-stages:PARO_STAGES=5 --out sm90-variants.json
    ncu --kernel-name paro_attention_int8_fp8 --launch-skip 5 --launch-count 1 \\
        python benchmarks/sm90_kernel.py --shapes wan2.1-1.3b --densities 1.0 --profile

A variant is NAME:KEY=VALUE,KEY=VALUE (defines of attention.cu that replace the family's own), or
NAME@SOURCE.cu:KEY=VALUE,... to compile another source (an older kernel) with those defines. Each variant's
output is compared with the first variant's (relative L2) so a faster variant that computes something else
shows. Times: median of CUDA-event-timed launches, no L2 flush (the kernel reads K/V many times per call).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paroattn.bench import SHAPES  # noqa: E402
from paroattn.kernels import sm90  # noqa: E402
from paroattn.kernels.block_lists import ActiveBlocks  # noqa: E402
from paroattn.kernels.runtime import allocate  # noqa: E402
from paroattn.kernels.triton_backend import prepare_kv  # noqa: E402
from paroattn.masks import synthetic_block_mask  # noqa: E402


def parse_variant(text: str) -> tuple[str, str | None, dict[str, int]]:
    name, _, assignments = text.partition(":")
    name, _, source = name.partition("@")
    defines = {}
    for item in filter(None, assignments.split(",")):
        key, value = item.split("=")
        defines[key.strip()] = int(value)
    return name, Path(source).read_text() if source else None, defines


def median_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fa3_fp8_ms(q, k, v, calls: int) -> float | None:
    try:
        from fa3_fwd_interface import flash_attn_func
    except Exception:
        return None
    qf, kf, vf = (t.transpose(1, 2).contiguous().to(torch.float8_e4m3fn) for t in (q, k, v))
    ones = torch.ones(q.shape[0], q.shape[1], device="cuda", dtype=torch.float32)
    return median_ms(lambda: flash_attn_func(qf, kf, vf, q_descale=ones, k_descale=ones, v_descale=ones), calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="wan2.1-1.3b,cogvideox-5b")
    p.add_argument("--densities", default="1.0,0.2")
    p.add_argument("--variant", action="append", default=None, help="NAME:KEY=VALUE,... (repeatable)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="a few launches of each variant, untimed (for ncu)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    variants = [parse_variant(v) for v in (args.variant or ["default:"])]
    family_defines, family_source = sm90.defines, sm90.source
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        B, H, layout, D = SHAPES[shape]
        N = layout.seq_len
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        orders = torch.randint(0, 6, (H,), generator=torch.Generator().manual_seed(1)).to(torch.int32).cuda()
        nq, nk = -(-N // 128), -(-N // 64)
        fa3 = None if args.profile else fa3_fp8_ms(q, k, v, args.calls)
        for density in map(float, args.densities.split(",")):
            mask = synthetic_block_mask(H, nq, nk, density, generator=torch.Generator().manual_seed(2))
            blocks = ActiveBlocks.from_mask(mask).to("cuda")
            buffers = allocate(*q.shape, q.dtype, q.device, 128, 64, "int8", "fp8", True)
            kq, k_scale, vq, v_amax, qq, q_scale = prepare_kv(
                k, v, orders, layout.prefix, layout.frames, layout.height, layout.width, 64, "int8", "fp8", q=q,
                bq=128, buffers=buffers)
            active_tiles = float(mask.sum()) * 128 * 64 * B
            baseline = None
            for name, source, extra in variants:
                sm90.defines = lambda d, dt, w=None, extra=extra: {**family_defines(d, dt, w), **extra}
                sm90.source = (lambda source=source: source) if source else family_source
                sm90.forget()
                out = torch.empty_like(q)

                def call(out=out):
                    sm90.launch(qq, q_scale, kq, k_scale, vq, v_amax, out, orders, blocks.counts, blocks.indices,
                                blocks.schedule, N=N, prefix=layout.prefix, frames=layout.frames,
                                height=layout.height, width=layout.width, sm_scale=1 / math.sqrt(D))

                if args.profile:
                    for _ in range(8):
                        call()
                    torch.cuda.synchronize()
                    continue
                ms = median_ms(call, args.calls)
                baseline = out.float() if baseline is None else baseline
                rel = float((out.float() - baseline).norm() / baseline.norm())
                tops = 4 * active_tiles * D / (ms * 1e-3) / 1e12
                rows.append({"shape": shape, "density": density, "mask_density": float(mask.float().mean()),
                             "variant": name, "defines": {**family_defines(D, q.dtype), **extra}, "ms": ms,
                             "tops": tops, "rel_vs_first_variant": rel, "fa3_fp8_ms_dense": fa3})
                print(f"{shape:16s} d={density:<4} {name:24s} {ms:8.3f} ms {tops:6.0f} TOPS rel {rel:.1e}"
                      + (f"  (FA3 FP8 dense {fa3:.3f} ms)" if fa3 else ""), flush=True)
    sm90.defines, sm90.source = family_defines, family_source
    if args.out and rows:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "timing": "median of CUDA-event-timed launches, no L2 flush",
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
