"""One plan, many sizes, on the demo model: a plan calibrated at the model's size and derived at other sizes
vs plans calibrated at those sizes (calibrated orders and identity order), PSNR / SSIM vs dense.

For every size: a dense capture over the calibration prompts at that size (the "calibrated" and "identity"
plans, `demo.study_config` / `demo.study_selection`), the dense videos of the evaluation prompts, and for
each density the three plans' videos; the "derived" plan is the one calibrated at the base size, applied
as is (the processor derives its orders and masks for the size). A full-density plan is checked against dense at every
size over `--full-steps` steps. Rows go to `--out` (JSON lines) as they are measured; `--markdown` turns such
files (runs at other seeds, pooled) into the QUALITY.md section (written between its markers with `--quality-md`).

    python scripts/demo_model_derived_shapes.py --device cuda --steps 20 --calibration-steps 20 --eval-prompts 8 \
        --out benchmarks/results/quality-demo-model-derived-shapes-orders-per-size-h200.jsonl
    python scripts/demo_model_derived_shapes.py --quality-md QUALITY.md \
        --markdown benchmarks/results/quality-demo-model-derived-shapes-orders-per-size-h200.jsonl \
        benchmarks/results/quality-demo-model-derived-shapes-orders-per-size-seed1-h200.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paroattn import ORDERS
from paroattn.app import demo
from paroattn.calibrate.driver import capture, plan_from_stats
from paroattn.demo_model.model import load_demo_pipeline
from paroattn.pipelines import apply, layout_for

BASE = "8x32x32"
# the base size itself (the derived plan is the calibrated one there), fewer frames, smaller frames, larger
# frames, more frames (the model draws nothing at 48x48: not used)
SIZES = "8x32x32,5x32x32,8x24x24,8x36x36,10x32x32"
BEGIN, END = "<!-- derived-shapes table: begin -->", "<!-- derived-shapes table: end -->"


def parse_size(text: str) -> dict:
    frames, height, width = (int(x) for x in text.lower().split("x"))
    return {"num_frames": frames, "height": height, "width": width}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="JSON-lines file of the rows")
    p.add_argument("--markdown", type=Path, nargs="+",
                   help="print the QUALITY.md section of these rows files (runs at other seeds: pooled) and exit")
    p.add_argument("--quality-md", type=Path, help="with --markdown: write the section into this file's markers")
    p.add_argument("--base", default=BASE, help="FRAMESxHEIGHTxWIDTH (pixels) the derived plan is calibrated at")
    p.add_argument("--sizes", default=SIZES, help="comma-separated FRAMESxHEIGHTxWIDTH sizes to evaluate at")
    p.add_argument("--densities", default="0.5,0.3")
    # few steps: a CPU run captures statistics of 6 orders with the torch backend at every size
    p.add_argument("--steps", type=int, default=4, help="sampling steps of every evaluated video")
    p.add_argument("--calibration-steps", type=int, default=1)
    p.add_argument("--full-steps", type=int, default=1, help="steps of the full-density check")
    p.add_argument("--eval-prompts", type=int, default=1, help="first N of the held-out evaluation prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dense-png", type=Path, help="save each size's dense videos here (to check the model is sane there)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.markdown is not None:
        runs = [[json.loads(line) for line in path.read_text().splitlines() if line.strip()] for path in args.markdown]
        section = markdown(runs, args.markdown)
        if args.quality_md is not None:
            text = args.quality_md.read_text()
            start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
            args.quality_md.write_text(text[:start] + "\n" + section + text[end:])
        print(section)
        return 0
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    pipe = load_demo_pipeline(device=args.device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    prompts = demo.EVAL_PROMPTS[: args.eval_prompts]
    densities = [float(d) for d in args.densities.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = args.out.open("w")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({platform.machine()})"
    common = {"date": time.strftime("%Y-%m-%d"), "device": device, "torch": torch.__version__, "dtype": str(dtype),
              "steps": args.steps, "calibration_steps": args.calibration_steps, "prompts": prompts, "seed": args.seed,
              "base": args.base}

    def record(row: dict) -> None:
        out.write(json.dumps({**common, **row}) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)

    def captured(size_text: str):
        size = parse_size(size_text)
        config = demo.study_config(args.calibration_steps, size=size)
        start = time.perf_counter()
        stats = capture(pipe, demo.CALIBRATION_PROMPTS, config, order_sets={"identity": [ORDERS.index("FHW")]})
        print(f"capture at {size_text}: {time.perf_counter() - start:.0f} s, layout {stats.layout}", flush=True)
        return stats

    base_stats = captured(args.base)
    base_plans = {d: plan_from_stats(base_stats, demo.study_selection(d))[0] for d in densities + [1.0]}
    for size_text in args.sizes.split(","):
        size = parse_size(size_text)
        layout = layout_for(pipe, height=size["height"], width=size["width"], frames=size["num_frames"])
        # full density: derived masks keep every block, so PARO equals dense (a few steps suffice to show it)
        short_dense, _ = demo.sample(pipe, prompts, steps=args.full_steps, seed=args.seed, size=size)
        with apply(pipe, base_plans[1.0], backend="torch") as handle:
            short_full, _ = demo.sample(pipe, prompts, steps=args.full_steps, seed=args.seed, size=size)
            full_mask = bool(handle.processor.runner.plan_at(layout).block_mask.all())
        record({"size": size_text, "layout": str(layout), "density": 1.0, "variant": "derived", "steps_run": args.full_steps,
                "all_blocks_kept": full_mask, "max_abs_diff": float(np.abs(short_full - short_dense).max())})
        dense, timing = demo.sample(pipe, prompts, steps=args.steps, seed=args.seed, size=size)
        if args.dense_png is not None:
            from PIL import Image

            args.dense_png.mkdir(parents=True, exist_ok=True)
            strip = np.concatenate([np.concatenate(list(video), axis=1) for video in dense], axis=0)
            Image.fromarray((strip * 255).clip(0, 255).astype(np.uint8)).save(args.dense_png / f"dense-{size_text}.png")
        stats = base_stats if size_text == args.base else captured(size_text)
        for density in densities:
            plans = {"derived": base_plans[density]}
            if size_text != args.base:
                plans["calibrated"] = plan_from_stats(stats, demo.study_selection(density))[0]
            plans["identity"] = plan_from_stats(stats, demo.study_selection(density, order_set="identity"))[0]
            for variant, plan in plans.items():
                start = time.perf_counter()
                with apply(pipe, plan, backend="torch") as handle:
                    frames, _ = demo.sample(pipe, prompts, steps=args.steps, seed=args.seed, size=size)
                    used = handle.processor.runner.plan_at(layout)
                metrics = demo.compare(dense, frames)
                record({"size": size_text, "layout": str(layout), "density": density, "variant": variant,
                        "achieved_density": used.achieved_density(), "derived_from": used.info.get("derived_from"),
                        "derive_s": used.info.get("derive_s"), "psnr_db": metrics["psnr_db"], "ssim": metrics["ssim"],
                        "cosine": metrics["cosine"], "seconds": time.perf_counter() - start,
                        "dense_seconds": timing["total_s"]})
    out.close()
    return 0


def pooled(runs: list[list[dict]]) -> list[dict]:
    """Rows of runs at different seeds -> one row per (size, density, variant), PSNR averaged over the runs that
    have it (each run: the same prompts), `videos` counting them."""
    keys = {}
    for rows in runs:
        for r in rows:
            keys.setdefault((r["size"], r["density"], r["variant"]), []).append(r)
    out = []
    for same in keys.values():
        row = dict(same[0])
        if "psnr_db" in row:
            row["psnr_db"] = sum(r["psnr_db"] for r in same) / len(same)
        row["videos"] = len(same) * len(row["prompts"])
        row["seeds"] = sorted({r["seed"] for r in same})
        out.append(row)
    return out


def markdown(runs: list[list[dict]], sources: list[Path]) -> str:
    """The QUALITY.md section: one table, PSNR vs dense of each plan at each (size, density) (the mean over the
    runs' seeds), and the targets."""
    rows = pooled(runs)
    first = rows[0]
    seeds = sorted({r["seed"] for run in runs for r in run})
    lines = [
        f"Generated by `scripts/demo_model_derived_shapes.py --markdown {' '.join(p.as_posix() for p in sources)}` "
        f"({first['device']}, {first['date']}, {first['dtype']}, torch backend): {len(first['prompts'])} held-out "
        f"prompts at seed(s) {', '.join(map(str, seeds))} (the mean over {len(seeds) * len(first['prompts'])} "
        f"videos per cell where every seed ran it), {first['steps']} sampling steps, plans calibrated on the 2 "
        f"calibration prompts x {first['calibration_steps']} steps. PSNR vs dense (dB). \"derived\": the plan "
        f"calibrated at {first['base']} (frames x height x width in pixels), its orders and masks derived for the "
        "size; \"calibrated\" / \"identity\": plans calibrated at that size with calibrated orders / the identity "
        "order. Targets: derived within 1 dB of calibrated, and above identity.",
        "",
        "| size (tokens) | density | derived | calibrated at the size | identity order | derived - calibrated "
        "| derived - identity |",
        "|---|---|---|---|---|---|---|",
    ]
    full = []
    for size in dict.fromkeys(r["size"] for r in rows):
        here = [r for r in rows if r["size"] == size]
        full += [r for r in here if r["density"] == 1.0]
        for density in sorted({r["density"] for r in here if r["density"] < 1.0}, reverse=True):
            cell = {r["variant"]: r for r in here if r["density"] == density}

            def psnr(name):
                return f"{cell[name]['psnr_db']:.2f}" if name in cell else ""

            def versus(name, target):
                if name not in cell or "derived" not in cell:
                    return ""
                gap = cell["derived"]["psnr_db"] - cell[name]["psnr_db"]
                return f"{gap:+.2f}" + ("" if target(gap) else " (**missed**)")

            derived = psnr("derived") + (" (the calibrated plan)" if "calibrated" not in cell else "")
            lines.append(f"| {size} ({here[0]['layout']}) | {density:g} | {derived} | {psnr('calibrated')} | "
                         f"{psnr('identity')} | {versus('calibrated', lambda g: g >= -1.0)} | "
                         f"{versus('identity', lambda g: g > 0)} |")
    if full:
        lines += ["", "Full density, every size: every block kept: "
                  f"{all(r['all_blocks_kept'] for r in full)}; largest |PARO - dense| "
                  f"{max(r['max_abs_diff'] for r in full):.2g} over {full[0]['steps_run']} step(s) ({first['dtype']})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
