"""How well the product of per-axis offset profiles describes the demo model's heads: at one size, the attention
mass (on that size's exact block statistics) kept by masks from those statistics, by masks derived from the size's
own profiles, and, with `--base`, by masks derived from a plan calibrated at another size, and by an identity-order
plan; and the correlation of predicted with measured block masses per head. Separates the error of the
description from that of carrying it to another size (QUALITY.md, One plan, many sizes).

    python scripts/demo_model_product_model_check.py --size 8x24x24 --base 8x32x32 --calibration-steps 8 \
        --out benchmarks/results/derived-shapes-product-model-check-demo-model-cpu.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paroattn import ORDERS
from paroattn.app import demo
from paroattn.calibrate.driver import capture, plan_from_stats
from paroattn.demo_model.model import load_demo_pipeline
from paroattn.plan.shapes import derive_plan, layer_block_masses, offset_weights


def kept_mass(plan, acc) -> float:
    """Mean over captured (bucket, layer, head) of the share of the measured mass inside the plan's masks."""
    kept = []
    for (bucket, layer), mass in acc.mass.items():
        slots = torch.tensor([acc.candidate_orders.index(int(o)) for o in plan.orders[layer]])
        chosen = mass.float()[torch.arange(len(slots)), slots]
        kept.append((chosen * plan.block_mask[bucket, layer]).sum((-1, -2)) / chosen.sum((-1, -2)))
    return float(torch.cat(kept).mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="8x24x24", help="FRAMESxHEIGHTxWIDTH in pixels")
    p.add_argument("--base", help="FRAMESxHEIGHTxWIDTH of a plan to derive from (calibrated the same way)")
    p.add_argument("--calibration-steps", type=int, default=1)
    p.add_argument("--densities", default="0.5,0.3")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    pipe = load_demo_pipeline(device="cpu", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def captured(text: str):
        frames, height, width = (int(x) for x in text.split("x"))
        size = {"num_frames": frames, "height": height, "width": width}
        config = demo.study_config(args.calibration_steps, size=size)
        return capture(pipe, demo.CALIBRATION_PROMPTS, config, order_sets={"identity": [ORDERS.index("FHW")]})

    stats = captured(args.size)
    base = captured(args.base) if args.base else None
    acc = stats.accumulators["all"]
    acc.flush()
    lines = [f"demo model at {args.size} ({stats.layout} tokens), CPU float32, {args.calibration_steps} calibration "
             f"step(s) of the {len(demo.CALIBRATION_PROMPTS)} calibration prompts; kept share of the attention mass "
             "(mean over buckets, layers and heads of that size's exact statistics)"]
    for density in (float(d) for d in args.densities.split(",")):
        plan, _ = plan_from_stats(stats, demo.study_selection(density))
        identity, _ = plan_from_stats(stats, demo.study_selection(density, order_set="identity"))
        own = derive_plan(plan, stats.layout)
        line = (f"d={density:g}: masks from the exact statistics {kept_mass(plan, acc):.4f}; derived from the size's "
                f"own axis profiles {kept_mass(own, acc):.4f}")
        if base is not None:
            derived = derive_plan(plan_from_stats(base, demo.study_selection(density))[0], stats.layout)
            line += f"; derived from the plan calibrated at {args.base} {kept_mass(derived, acc):.4f}"
        lines.append(line + f"; identity order {kept_mass(identity, acc):.4f}")
    bucket, layer = next(iter(acc.mass))
    for layer in range(plan.num_layers):
        mass = acc.mass[(bucket, layer)].float()
        slots = torch.tensor([acc.candidate_orders.index(int(o)) for o in plan.orders[layer]])
        true = mass[torch.arange(len(slots)), slots]
        pred = layer_block_masses([offset_weights(p[bucket, layer]) for p in plan.profiles], plan.orders[layer].long(),
                                  stats.layout, plan.block_size)
        corr = [float(torch.corrcoef(torch.stack([t.flatten(), q.flatten()]))[0, 1]) for t, q in zip(true, pred)]
        lines.append(f"bucket {bucket} layer {layer}: predicted vs measured block masses, correlation per head "
                     + ", ".join(f"{ORDERS[int(o)]} {c:.3f}" for o, c in zip(plan.orders[layer], corr)))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
