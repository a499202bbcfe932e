"""What balancing a plan over N GPUs costs in quality, on the demo model: its shipped plans applied as they are and
balanced for 2 and 4 GPUs when applied (`apply(..., balance_ranks=N)`, masses estimated from the plans' axis
profiles), each generating the held-out prompts, compared with dense videos of the same seeds. Balancing moves
blocks between the heads of a layer, so it runs on one device as under Ulysses: the masks are what changes.

    python scripts/demo_model_balance_quality.py --out results.jsonl                 # CPU: about 20 minutes (2 cores)
    python scripts/demo_model_balance_quality.py --densities 0.2 --eval-prompts 4 --out r.jsonl

One JSON row per (density, GPUs): PSNR / SSIM / cosine per video and their mean, and the plan's block imbalance
before balancing (`balance.rank_imbalance`: the slowest GPU's active blocks per step over the mean GPU's, minus one,
in the worst timestep bucket).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paroattn import Plan
from paroattn.app import demo
from paroattn.demo_model.model import DEFAULT_STEPS, load_demo_pipeline
from paroattn.pipelines import apply
from paroattn.plan.balance import rank_imbalance


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results, one JSON row per line")
    parser.add_argument("--densities", default="0.5,0.2", help="shipped plans' densities, comma-separated")
    parser.add_argument("--gpus", default="2,4", help="GPU counts to balance for, comma-separated")
    parser.add_argument("--eval-prompts", type=int, default=len(demo.EVAL_PROMPTS), help="first N held-out prompts")
    parser.add_argument("--seeds", default="0,1", help="sampling seeds, comma-separated (QUALITY.md's: 0,1)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    pipe = load_demo_pipeline(device=args.device)
    prompts = demo.EVAL_PROMPTS[: args.eval_prompts]
    seeds = [int(s) for s in args.seeds.split(",")]
    dense = {seed: demo.sample(pipe, prompts, steps=args.steps, seed=seed)[0] for seed in seeds}
    heads = pipe.transformer.config.num_attention_heads
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as results:
        for density in (float(d) for d in args.densities.split(",")):
            plan = Plan.load(demo.shipped_plan_path(density))
            for gpus in [1] + [int(n) for n in args.gpus.split(",")]:
                if heads % gpus:
                    raise SystemExit(f"--gpus {gpus}: the demo model's {heads} heads do not split over {gpus} GPUs")
                start = time.perf_counter()
                per_video = []
                with apply(pipe, plan, backend=args.backend, balance_ranks=gpus):
                    for seed in seeds:
                        frames, _ = demo.sample(pipe, prompts, steps=args.steps, seed=seed)
                        per_video += [demo.compare(dense[seed][i:i + 1], frames[i:i + 1]) for i in range(len(prompts))]
                row = {
                    "density": density, "gpus": gpus, "qk": plan.qk, "pv": plan.pv, "seeds": seeds,
                    "steps": args.steps, "device": args.device, "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "seconds": time.perf_counter() - start,
                    "block_imbalance_unbalanced": float(rank_imbalance(plan, gpus).max()) if gpus > 1 else 0.0,
                    **{key: sum(m[key] for m in per_video) / len(per_video) for key in per_video[0]},
                    "per_video": per_video,
                }
                results.write(json.dumps(row) + "\n")
                results.flush()
                print(f"d={density:g} balanced for {gpus} GPU(s): PSNR {row['psnr_db']:.2f} dB, SSIM {row['ssim']:.4f}"
                      f" (unbalanced slices {row['block_imbalance_unbalanced']:+.1%} apart in blocks), "
                      f"{row['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
