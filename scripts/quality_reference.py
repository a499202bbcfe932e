"""The quality study of QUALITY.md on the reference model, and the plans that `paro demo` ships.

One dense capture over the calibration prompts gives the block statistics of every candidate order
and of the identity order (`paroattn.calibrate.driver.capture`); from them, plans for every density,
quantization and order choice. Each plan generates the fixed evaluation prompts with the fixed
seed, compared with the dense videos (PSNR / SSIM / cosine, mean over the prompts).

    python scripts/quality_reference.py --out /tmp/quality --ship paroattn/reference/assets/plans   # GPU: ~1 min
    python scripts/quality_reference.py --out /tmp/q --quick                              # CPU smoke: seconds

Writes `quality.json` and `quality_table.md` into --out; with --ship, the plans for densities
0.5 / 0.3 / 0.2 with their stats files.
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

from paroattn import ORDERS
from paroattn.calibrate.driver import capture, plan_from_stats, save_calibration
from paroattn.reference import demo
from paroattn.reference.model import DEFAULT_STEPS, load_reference_pipeline

DENSITIES = (1.0, 0.5, 0.3, 0.2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ship", type=Path, default=None, help="write the demo's plans (and stats files) here")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="sampling steps of every evaluated video")
    p.add_argument("--calibration-steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--prompts", type=int, default=len(demo.EVAL_PROMPTS), help="first N evaluation prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="auto", help="PARO op backend: auto (triton on CUDA), triton, torch")
    p.add_argument("--block-size", type=int, default=64, help="plan block size (the shipped plans use 64)")
    p.add_argument("--query-block", type=int, default=None, help="query block of the plans (default: --block-size)")
    p.add_argument("--densities", default=",".join(f"{d:g}" for d in DENSITIES), help="comma-separated densities")
    p.add_argument("--quants", default=",".join(demo.QUANT_MODES), help=f"comma-separated, from {list(demo.QUANT_MODES)}")
    p.add_argument("--no-paper", action="store_true", help="skip the rows with the paper's order metric")
    p.add_argument("--quant-weight", type=float, default=0.0,
                   help="weight of the incoherence term in the order choice of every row (as paro calibrate's)")
    p.add_argument("--quick", action="store_true", help="CPU smoke: 2 steps, 1 prompt, a few configurations")
    return p.parse_args(argv)


def configurations(args):
    """(density, quant label, identity order?, metric) of every row of the study."""
    quick = args.quick
    rows = []
    densities = (0.3,) if quick else tuple(float(d) for d in args.densities.split(","))
    quants = ("bf16", "int8 QK + fp8 PV") if quick else tuple(q.strip() for q in args.quants.split(","))
    unknown = [q for q in quants if q not in demo.QUANT_MODES]
    if unknown:
        raise SystemExit(f"--quants: unknown {unknown}; expected names from {list(demo.QUANT_MODES)}")
    for density in densities:
        for quant in quants:
            for identity in (False, True):
                if density >= 1.0 and quant == "bf16":
                    continue  # that is the dense model itself
                rows.append((density, quant, identity, "mass"))
    for density in (() if quick or args.no_paper else [d for d in densities if d < 1.0]):
        for quant in ("bf16", "int8 QK"):
            rows.append((density, quant, False, "paper"))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ship is not None and (args.block_size != 64 or args.query_block not in (None, 64)):
        raise SystemExit("--ship writes the demo's plans, which use 64-token blocks; drop --block-size")
    if args.quick:
        args.steps, args.calibration_steps, args.prompts = 2, 2, 1
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    pipe = load_reference_pipeline(device=args.device, dtype=dtype)
    log = []

    def say(line: str) -> None:
        print(line, flush=True)
        log.append(line)

    config = demo.study_config(args.calibration_steps, seed=args.seed, block_size=args.block_size,
                               query_block=args.query_block)
    stats = capture(pipe, demo.CALIBRATION_PROMPTS, config, order_sets={"identity": [ORDERS.index("FHW")]},
                    extras=True)
    capture_s = stats.timings["pipeline_s"]
    say(f"capture: {len(demo.CALIBRATION_PROMPTS)} prompts x {args.calibration_steps} steps in {capture_s:.1f} s, "
        f"layout {stats.layout}")

    if args.ship is not None:
        for density in demo.SHIPPED_DENSITIES:
            plan, result = plan_from_stats(stats, density)
            path = args.ship / demo.shipped_plan_path(density).name
            save_calibration(plan, result, path)
            plan.info["stats_file"] = {"name": path.name.replace(".safetensors", ".stats.safetensors")}
            plan.save(path)  # without the absolute path of this machine
            say(f"shipped {path}: kept mass {plan.info['kept_mass']:.4f}")

    prompts = demo.EVAL_PROMPTS[: args.prompts]
    dense, dense_t = demo.sample(pipe, prompts, steps=args.steps, seed=args.seed)
    say(f"dense: {dense_t['total_s']:.2f} s ({dense_t['attention_s']:.2f} s in self-attention)")
    rows = []
    for density, quant, identity, metric in configurations(args):
        qk, pv = demo.QUANT_MODES[quant]
        plan, result = plan_from_stats(stats, density, qk=qk, pv=pv, orders="identity" if identity else "all",
                                       metric=metric, quant_weight=args.quant_weight)
        backend = args.backend
        try:
            frames, timing = demo.run_with_plan(pipe, plan, prompts, steps=args.steps, seed=args.seed, backend=backend)
        except Exception as exc:  # noqa: BLE001 -- a kernel failure must not lose the rest of the table: say so, use the reference
            say(f"backend {backend} failed ({type(exc).__name__}: {exc}); torch reference for this row")
            backend = "torch"
            frames, timing = demo.run_with_plan(pipe, plan, prompts, steps=args.steps, seed=args.seed, backend=backend)
        metrics = demo.compare(dense, frames)
        row = {
            "density": density, "achieved_density": plan.achieved_density(), "quant": quant, "qk": qk, "pv": pv,
            "orders": "identity" if identity else "calibrated", "metric": metric,
            "kept_mass": float(result.kept_mass.mean()), "backend": backend, **metrics, **timing,
            "orders_histogram": {o: int((plan.orders == i).sum()) for i, o in enumerate(ORDERS)},
        }
        rows.append(row)
        say(f"d={density:.1f} {quant:17s} {row['orders']:10s} {metric:5s} kept={row['kept_mass']:.4f} "
            f"PSNR={metrics['psnr_db']:6.2f} SSIM={metrics['ssim']:.4f} cos={metrics['cosine']:.5f} "
            f"({timing['total_s']:.2f} s)")

    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "dtype": str(dtype), "steps": args.steps, "calibration_steps": args.calibration_steps,
        "block_size": args.block_size, "query_block": args.query_block, "quant_weight": args.quant_weight, "prompts": prompts, "calibration_prompts": demo.CALIBRATION_PROMPTS, "seed": args.seed,
        "dense_time": dense_t, "capture_s": capture_s, "rows": rows,
    }
    (args.out / "quality.json").write_text(json.dumps(report, indent=1))
    (args.out / "quality_table.md").write_text(markdown_table(rows))
    (args.out / "quality_log.txt").write_text("\n".join(log) + "\n")
    print(f"wrote {args.out / 'quality.json'} and {args.out / 'quality_table.md'}")
    return 0


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| density | quantization | orders | metric | kept mass | PSNR dB | SSIM | cosine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['density']:.1f} ({r['achieved_density']:.3f}) | {r['quant']} | {r['orders']} | {r['metric']} | "
            f"{r['kept_mass']:.4f} | {r['psnr_db']:.2f} | {r['ssim']:.4f} | {r['cosine']:.5f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
