"""Which order metric picks the best order? A CPU study on synthetic heads with planted locality.

    python benchmarks/order_metric.py [--heads 48] [--density 0.3] [--out benchmarks/results/order_metric.json]

Ground truth, per head: for every candidate order, the mask that keeps the best `density` share of
that order's blocks (diagonal and text blocks forced, as plans do) is applied with the reference
op, and the relative L2 error of the output against dense attention is measured. The best order is
the one with the smallest error. Each metric then picks an order from the block statistics alone;
reported: how often its pick is within 2% of the best error, and the mean output error of its
picks next to the mean of the best (oracle) errors.

Heads are harder than the test's: random width along the local axis, random sharpness on the two
others, a random share of locality along a second axis, random noise, a text prefix on half the
layouts; run unquantized (bf16 plan) and with INT8 QK + INT8 PV (where the incoherence term
should matter if it ever does).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paroattn import TokenLayout  # noqa: E402
from paroattn.calibrate.block_stats import block_stats  # noqa: E402
from paroattn.calibrate.synthetic import planted_qk  # noqa: E402
from paroattn.kernels.reference import paro_attention_reference  # noqa: E402
from paroattn.plan.selection import (  # noqa: E402
    block_entries,
    build_masks,
    incoherence,
    kept_mass_fraction,
    order_scores,
    sparse_fraction,
)

LAYOUTS = [TokenLayout(0, 4, 8, 12), TokenLayout(16, 6, 6, 10), TokenLayout(0, 8, 10, 6), TokenLayout(16, 3, 12, 12)]
METRIC_CHOICES = {
    "mass": dict(metric="mass", quant_weight=0.0),
    "mass+incoherence 0.01": dict(metric="mass", quant_weight=0.01),
    "mass+incoherence 0.05": dict(metric="mass", quant_weight=0.05),
    "paper alpha=0.5": dict(metric="paper", alpha=0.5),
    "paper alpha=0.9": dict(metric="paper", alpha=0.9),
    "paper, sparse term added (literal)": dict(metric="paper-literal", alpha=0.5),
}


def scores_for(choice, kept, inc, sparse):
    if choice["metric"] == "paper-literal":
        # the other reading of the paper's formula: both normalized terms added, lowest wins
        a = choice["alpha"]
        return a * sparse / sparse.sum(-1, keepdim=True).clamp_min(1e-12) + (1 - a) * inc / inc.sum(-1, keepdim=True)
    return order_scores(kept, inc, sparse, **choice)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=48, help="heads per layout")
    parser.add_argument("--density", type=float, default=0.3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    bs, d = args.block_size, args.density
    tallies = {mode: {name: {"best": 0, "error": 0.0} for name in METRIC_CHOICES} for mode in ("bf16", "int8")}
    oracle = {"bf16": 0.0, "int8": 0.0}
    count = 0
    for layout in LAYOUTS:
        orders = list(layout.distinct_orders())
        for _ in range(args.heads):
            axis = int(torch.randint(0, 3, (1,), generator=g))
            spread = float(torch.empty(1).uniform_(0.7, 3.0, generator=g))
            sharp = float(torch.empty(1).uniform_(1.0, 6.0, generator=g))
            second = float(torch.empty(1).uniform_(0.0, 0.8, generator=g))
            noise = float(torch.empty(1).uniform_(0.5, 1.5, generator=g))
            q, k = planted_qk(layout, [axis], head_dim=32, spread=spread, sharpness=sharp, noise=noise,
                              secondary=[second], generator=g)
            v = torch.randn(q.shape, generator=g)
            mass, pmax, below = block_stats(q, k, layout, orders, bs, backend="torch")
            entries = block_entries(layout.seq_len, bs)
            kept = kept_mass_fraction(mass[0], d)
            inc = incoherence(mass[0], pmax[0], entries)
            sparse = sparse_fraction(below[0], entries)
            dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            for mode in ("bf16", "int8"):
                errors = []
                for slot, order in enumerate(orders):
                    mask = build_masks(mass[:, slot][None], d, layout.prefix, bs)[0]
                    out = paro_attention_reference(q, k, v, layout, torch.tensor([order]), mask, bs, bs,
                                                   qk=mode, pv=mode)
                    errors.append(float((out - dense).norm() / dense.norm()))
                errors = torch.tensor(errors)
                best = float(errors.min())
                oracle[mode] += best
                for name, choice in METRIC_CHOICES.items():
                    pick = int(scores_for(choice, kept, inc, sparse).argmin())
                    tallies[mode][name]["best"] += int(float(errors[pick]) <= best * 1.02)
                    tallies[mode][name]["error"] += float(errors[pick])
            count += 1
    report = {"heads": count, "density": d, "block_size": bs, "layouts": [str(x) for x in LAYOUTS], "results": {}}
    for mode, table in tallies.items():
        report["results"][mode] = {
            name: {"picks_best": t["best"] / count, "mean_error": t["error"] / count} for name, t in table.items()
        }
        report["results"][mode]["oracle (best order per head)"] = {"picks_best": 1.0, "mean_error": oracle[mode] / count}
    print(f"{count} heads, density {d}, blocks {bs}")
    for mode, table in report["results"].items():
        print(f"-- qk/pv {mode}")
        for name, row in table.items():
            print(f"  {name:36s} picks a best order {100 * row['picks_best']:5.1f}%   "
                  f"mean relative output error {row['mean_error']:.4f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
