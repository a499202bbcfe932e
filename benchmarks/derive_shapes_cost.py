"""What deriving a plan's masks for a new size costs (`paroattn.plan.shapes.derive_plan`): once per size,
when a plan first meets it. Default shape: Wan2.1-14B at 720p (40 layers x 40 heads, 21x45x80 latent grid,
128x64 blocks, 6 timestep buckets), random axis profiles and orders (the cost does not depend on their values).

Each head's order is chosen from the product model's block masses under every distinct order of the layout, then
the masses of the chosen orders are computed again and the masks chosen under one budget per bucket: all per
(bucket, layer), so the time is linear in buckets x layers. `--layers N` times N layers of one bucket (the order
choice, the masses and the budget over them) and scales that to the whole plan; `--layers 0` derives the whole
plan (memory: a bucket's masses, layers x heads x nq x nk float32, 4.5 GB at this shape).

    python benchmarks/derive_shapes_cost.py --device cuda --layers 0 \
        --out benchmarks/results/derive-shapes-cost-wan14b-720p-nvidia-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paroattn import Plan, TokenLayout
from paroattn.plan.selection import build_masks
from paroattn.plan.shapes import derive_plan, layer_block_masses, offset_weights, order_kept_mass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", default="21x45x80", help="FRAMESxHEIGHTxWIDTH of the latent grid (tokens)")
    p.add_argument("--num-layers", type=int, default=40)
    p.add_argument("--num-heads", type=int, default=40)
    p.add_argument("--buckets", type=int, default=6)
    p.add_argument("--block", default="128x64", help="query x key block")
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--layers", type=int, default=2, help="layers of one bucket to time (0: the whole plan)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    frames, height, width = (int(x) for x in args.grid.split("x"))
    layout = TokenLayout(0, frames, height, width)
    bq, bk = (int(x) for x in args.block.split("x"))
    g = torch.Generator().manual_seed(0)
    profiles = [torch.rand(args.buckets, args.num_layers, args.num_heads, 2 * n - 1, generator=g)
                for n in (frames, height, width)]
    orders = torch.randint(0, 6, (args.num_layers, args.num_heads), generator=g)
    threads = torch.get_num_threads()
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device
    result = {"date": time.strftime("%Y-%m-%d"), "device": device, "machine": platform.machine(),
              "torch_threads": threads, "layout": str(layout), "block_size": [bq, bk], "layers": args.num_layers,
              "heads": args.num_heads, "buckets": args.buckets, "density": args.density}
    if args.layers == 0:
        small = TokenLayout(0, 2, 2, 2)  # a stand-in calibrated size: the cost does not depend on the profiles
        plan = Plan(model_class="", model_fingerprint="", layout=small, block_size=(bq, bk), orders=orders,
                    block_mask=torch.ones(args.buckets, args.num_layers, args.num_heads, 1, 1, dtype=torch.bool),
                    bucket_edges=[1000.0 - 1000.0 * b / args.buckets for b in range(args.buckets)] + [0.0],
                    target_density=args.density,
                    profiles=[torch.rand(args.buckets, args.num_layers, args.num_heads, 3, generator=g)] * 3)
        plan.density.fill_(args.density)  # the per-bucket density the derived masks are built for
        start = time.perf_counter()
        derive_plan(plan, layout, args.device)
        result.update(measured="whole plan", seconds=time.perf_counter() - start)
    else:
        start = time.perf_counter()
        weights = [[offset_weights(p[0, layer].to(args.device)) for p in profiles] for layer in range(args.layers)]
        for layer in range(args.layers):
            order_kept_mass(weights[layer], layout, (bq, bk), args.density, args.device)
        orders_s = time.perf_counter() - start
        start = time.perf_counter()
        mass = torch.stack([layer_block_masses(weights[layer], orders[layer], layout, (bq, bk), args.device)
                            for layer in range(args.layers)])
        masses_s = time.perf_counter() - start
        start = time.perf_counter()
        build_masks(mass, args.density, 0, (bq, bk))
        masks_s = time.perf_counter() - start
        scale = args.buckets * args.num_layers / args.layers
        spent = orders_s + masses_s + masks_s
        result.update(measured=f"{args.layers} layers of one bucket, scaled by {scale:g}", orders_s=orders_s,
                      masses_s=masses_s, masks_s=masks_s, per_layer_s=spent / args.layers, seconds=spent * scale)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
