"""GPU time of each part of one captured self-attention call (what a `plan="auto"` learning generation or
`paro calibrate` adds to a dense call), at the shapes of Wan2.1-1.3B 480p x 81 and CogVideoX-5B 720 x 480 x 49:

- `sdpa_ms`: the dense call itself (torch SDPA, bf16), for scale;
- `stats_6_orders_ms`: block statistics of every order at the cheap capture's sampled rows (query_stride 8), what
  the first timestep bucket captures; `stats_2_kept_ms`: each head's 2 kept orders, what the later buckets capture;
  `stats_1_order_stride1_ms`: one order, every row (the full capture's cost per order);
- `profile_ms`: the axis profiles (`offset_mass`, 1024 sampled queries), once per bucket and layer;
- `add_{6,2}_gpu_ms`, `add_{6,2}_cpu_ms_per_call`: the accumulator taking one call's maps (pooled to 128-row query
  blocks, sent to pinned host memory in the background, the previous map summed there): its GPU time and the host's.

Random q and k (the time does not depend on the values); CUDA-event medians of 5 calls after one warm-up.

    python benchmarks/capture_call.py --out benchmarks/results/capture-call-parts-wan2.1-1.3b-cogvideox-5b-nvidia-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paroattn import TokenLayout  # noqa: E402
from paroattn.calibrate.accumulate import StatsAccumulator  # noqa: E402
from paroattn.calibrate.block_stats import block_stats  # noqa: E402
from paroattn.plan.shapes import offset_mass  # noqa: E402

SHAPES = {  # layout, [B, H, N, D] of one self-attention call (CogVideoX batches cond and uncond)
    "wan2.1-1.3b": (TokenLayout(0, 21, 30, 52), (1, 12, 32760, 128)),
    "cogvideox-5b": (TokenLayout(226, 13, 30, 45), (2, 48, 17776, 64)),
}


def gpu_ms(fn, n: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[n // 2]


def measure(name: str) -> dict:
    layout, shape = SHAPES[name]
    B, H, N, _ = shape
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    orders = list(layout.distinct_orders())

    def kept(stride: int, count: int):
        return [block_stats(q, k, layout, None, 64, extras=False, query_stride=stride,
                            head_orders=[orders[(h + i) % len(orders)] for h in range(H)])[0] for i in range(count)]

    record = {"model": name, "shape": list(shape), "layout": str(layout), "torch_threads": torch.get_num_threads()}
    record["sdpa_ms"] = gpu_ms(lambda: F.scaled_dot_product_attention(q, k, v))
    record["stats_6_orders_ms"] = gpu_ms(lambda: block_stats(q, k, layout, orders, 64, extras=False, query_stride=8))
    record["stats_2_kept_ms"] = gpu_ms(lambda: kept(8, 2))
    record["stats_1_order_stride1_ms"] = gpu_ms(lambda: kept(1, 1))
    record["profile_ms"] = gpu_ms(lambda: offset_mass(q, k, layout, 1024, torch.Generator().manual_seed(0)), n=3)
    maps = {"6": block_stats(q, k, layout, orders, 64, extras=False, query_stride=8)[0],
            "2": torch.cat(kept(8, 2), 1)}
    for label, mass in maps.items():
        candidates = orders if label == "6" else orders[:2]
        acc = StatsAccumulator(1, 1, candidates, N, 64, store_device="cpu", query_block=128, staging_device="cpu")
        acc.add(0, 0, mass, None, None, batch=B)
        acc.flush()
        record[f"add_{label}_gpu_ms"] = gpu_ms(lambda: acc.add(0, 0, mass, None, None, batch=B))
        acc._land()  # the map in flight summed (what the next call's add does first)
        start = time.perf_counter()
        for _ in range(5):
            acc.add(0, 0, mass, None, None, batch=B)
        acc._land()
        record[f"add_{label}_cpu_ms_per_call"] = (time.perf_counter() - start) / 5 * 1000
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("capture_call.py times GPU work: run it on a CUDA GPU")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "results": [measure(name) for name in args.models]}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    keys = ["sdpa_ms", "stats_6_orders_ms", "stats_2_kept_ms", "profile_ms", "add_6_gpu_ms", "add_2_gpu_ms"]
    print(f"{'model':14s} " + " ".join(f"{k[:-3]:>16s}" for k in keys))
    for r in report["results"]:
        print(f"{r['model']:14s} " + " ".join(f"{r[k]:16.2f}" for k in keys))


if __name__ == "__main__":
    main()
