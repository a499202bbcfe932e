"""The sm_90a CUDA kernel alone (its prologue outside the timing) beside its dense peers on the same shape:
cuDNN SDPA (bf16), FlashAttention-3 FP8's forward (`fa3-fwd`, when importable) and SageAttention2's sm90 kernel
(INT8 QK, FP8 PV with fp32 two-level accumulation; built from a checkout of its source with `--sageattention`,
benchmarks/sage2_anchor.py). The peers are their kernels alone on inputs already quantized and laid out as they
want them, dense.

    python benchmarks/sm90_kernel.py --shapes wan2.1-1.3b,cogvideox-5b --densities 1.0,0.2 \\
        --sageattention SageAttention/ --out sm90.json
    python benchmarks/sm90_kernel.py --variant default: --variant other@old_attention.cu: ...
    python benchmarks/sm90_kernel.py --compare paroattn.kernels.sm90_before ...
    ncu --kernel-name regex:"paro_attention|qk_int8_sv_f8" --launch-skip 5 --launch-count 2 \\
        python benchmarks/sm90_kernel.py --shapes wan2.1-1.3b --densities 1.0 --sageattention ... --profile

A variant is NAME:KEY=VALUE,KEY=VALUE (defines of attention.cu that replace the family's own), or
NAME@SOURCE.cu:KEY=VALUE,... to compile another source with the family's launch. `--compare PACKAGE` times
another implementation of the family's `launch` (e.g. an earlier version of `paroattn.kernels.sm90` copied
under another name) on the same buffers. Each output is compared with the first variant's (relative L2), so a
faster variant that computes something else shows. Times: median of CUDA-event-timed launches, no L2 flush
(the kernels read K/V many times per call), each sample CALLS_PER_SAMPLE launches back to back, so the host's
launch work hides behind the GPU's (one launch per sample would count it for sub-millisecond kernels, more for a
launch through Python and ctypes than through a compiled extension). TOPS: 4 * active query-key pairs * D over the
time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sage2_anchor  # noqa: E402  (beside this script)

from paroattn.app.bench import SHAPES, environment  # noqa: E402
from paroattn.kernels import sm90  # noqa: E402
from paroattn.kernels.block_lists import ActiveBlocks  # noqa: E402
from paroattn.kernels.launch import prepare_kv  # noqa: E402
from paroattn.kernels.runtime import allocate  # noqa: E402
from paroattn.masks import synthetic_block_mask  # noqa: E402


def parse_variant(text: str) -> tuple[str, str | None, dict[str, int]]:
    name, _, assignments = text.partition(":")
    name, _, source = name.partition("@")
    defines = {}
    for item in filter(None, assignments.split(",")):
        key, value = item.split("=")
        defines[key.strip()] = int(value)
    return name, Path(source).read_text() if source else None, defines


CALLS_PER_SAMPLE = 4


def median_ms(fn, calls: int) -> float:
    """Median over `calls` samples of the time per launch of CALLS_PER_SAMPLE launches queued back to back."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS_PER_SAMPLE):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS_PER_SAMPLE)
    return statistics.median(times)


def cudnn_ms(q, k, v, calls: int) -> float | None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), calls)
    except RuntimeError as error:
        print(f"cuDNN SDPA: {error}")
        return None


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
    p.add_argument("--compare", action="append", default=[], help="a package with the family's launch (repeatable)")
    p.add_argument("--sageattention", type=Path, help="a SageAttention checkout: build and time its sm90 kernel")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="a few launches of each kernel, untimed (for ncu)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    variants = [parse_variant(v) for v in (args.variant or ["default:"])]
    family_defines, family_source = sm90.defines, sm90.source
    sage = sage2_anchor.build(args.sageattention) if args.sageattention else None
    rows, peers = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        B, H, layout, D = SHAPES[shape]
        N = layout.seq_len
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        orders = torch.randint(0, 6, (H,), generator=torch.Generator().manual_seed(1)).to(torch.int32).cuda()
        nq, nk = -(-N // 128), -(-N // 64)
        dense_pairs = 4.0 * B * H * N * N * D
        sage_fn, sage_args = sage.kernel_call(q, k, v) if sage is not None else (None, None)
        if args.profile:
            for _ in range(4 if sage is not None else 0):
                sage_fn(*sage_args)
        else:
            found = {"cudnn_bf16_ms": cudnn_ms(q, k, v, args.calls), "fa3_fp8_ms": fa3_fp8_ms(q, k, v, args.calls),
                     "sage2_ms": median_ms(lambda: sage_fn(*sage_args), args.calls) if sage is not None else None}
            found.update({name.replace("_ms", "_tops"): dense_pairs / (ms * 1e-3) / 1e12
                          for name, ms in list(found.items()) if ms})
            peers[shape] = found
            print(f"{shape:16s} dense peers: " + ", ".join(f"{k} {v:.3f}" for k, v in found.items() if v), flush=True)
        for density in map(float, args.densities.split(",")):
            mask = synthetic_block_mask(H, nq, nk, density, generator=torch.Generator().manual_seed(2))
            blocks = ActiveBlocks.from_mask(mask).to("cuda")
            buffers = allocate(*q.shape, q.dtype, q.device, 128, 64, "int8", "fp8", True)
            kq, k_scale, vq, v_amax, qq, q_scale = prepare_kv(
                k, v, orders, layout.prefix, layout.frames, layout.height, layout.width, 64, "int8", "fp8", q=q,
                bq=128, buffers=buffers)
            active_tiles = float(mask.sum()) * 128 * 64 * B
            baseline = None
            runs = [(name, source, extra, sm90) for name, source, extra in variants]
            runs += [(package, None, {}, importlib.import_module(package)) for package in args.compare]
            for name, source, extra, family in runs:
                # the family's own launch takes its built kernel and tensor maps first; an earlier package's
                # (`--compare`) builds and keeps its own
                head = ()
                if family is sm90:
                    sm90.defines = lambda d, dt, extra=extra: {**family_defines(d, dt), **extra}
                    sm90.source = (lambda source=source: source) if source else family_source
                    head = (sm90.build(D, q.dtype, q.device), sm90.tensor_maps(qq, kq, vq))
                out = torch.empty_like(q)

                def call(out=out, family=family, head=head):
                    family.launch(*head, qq, q_scale, kq, k_scale, vq, v_amax, out, orders, blocks.counts,
                                  blocks.indices, blocks.schedule, N=N, prefix=layout.prefix, frames=layout.frames,
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
                row = {"shape": shape, "density": density, "mask_density": float(mask.float().mean()), "variant": name,
                       "defines": {**family_defines(D, q.dtype), **extra} if family is sm90 else None,
                       "ms": ms,
                       "tops": tops, "rel_vs_first_variant": rel, "finite": bool(torch.isfinite(out).all())}
                if peers.get(shape, {}).get("cudnn_bf16_ms"):
                    row["speedup_vs_cudnn"] = peers[shape]["cudnn_bf16_ms"] / ms
                rows.append(row)
                print(f"{shape:16s} d={density:<4} {name:24s} {ms:8.3f} ms {tops:6.0f} TOPS rel {rel:.1e}"
                      + (f" {row['speedup_vs_cudnn']:.2f}x cuDNN" if "speedup_vs_cudnn" in row else ""), flush=True)
    sm90.defines, sm90.source = family_defines, family_source
    if args.out and rows:
        args.out.write_text(json.dumps({**environment(),
                                        "timing": f"median of CUDA-event-timed samples of {CALLS_PER_SAMPLE} launches "
                                                  "back to back, no L2 flush",
                                        "peers_dense": peers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
