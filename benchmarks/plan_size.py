"""Plan file sizes and the memory of loading them, at a real model's size: Wan2.1-14B at 720p (81 frames of
1280x720: 21 x 45 x 80 = 75600 tokens, 40 layers x 40 heads, query blocks of 128 and key blocks of 64, so
591 x 1182 blocks per head), with one timestep bucket and with calibrate's default six.

Masks: synthetic (`paroattn.masks.synthetic_block_mask`, a band around the diagonal plus scattered blocks, at
density 0.5), in two arrangements: "e2e", as `benchmarks/e2e.py`'s `synthetic_plan` builds them (6 distinct
masks cycled over the layers, the same in every bucket), and "distinct", a different mask for every (bucket,
layer) (rolled copies of the 6, so that no chunk repeats another and deflate finds no structure between
buckets: an upper bound on the size of a calibrated plan, whose scattered blocks are not random). Each is
written in the current format (3: masks deflated per (bucket, layer)) and in format 2 (one flat tensor of
packed bits, what paroattn wrote before); each file is then loaded in a fresh process that reports its
resident memory before loading and its peak during. The demo model's calibrated plans (real masks) give the
ratio of the two formats on masks chosen by calibration.

    PYTHONPATH=$PWD python3 benchmarks/plan_size.py [--out-dir /tmp/plans] [--buckets 1 6]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from paroattn.app.demo import shipped_plan_path
from paroattn.layout import TokenLayout
from paroattn.masks import mask_shape, synthetic_block_mask
from paroattn.plan import BlockMasks, Plan, default_bucket_edges

LAYOUT = TokenLayout(0, 21, 45, 80)
LAYERS, HEADS, BLOCK = 40, 40, (128, 64)
DENSITY = 0.5
DISTINCT_MASKS = 6  # as benchmarks/e2e.py
CHECKPOINT_BYTES = 14.3e9 * 2  # Wan2.1-14B's transformer in bf16
RESULT = Path(__file__).parent / "results" / "plan-size-load-memory-wan2.1-14b-720p-cpu.json"

# run in a fresh process: after loading a small plan (the demo model's) once, resident memory (VmRSS) before
# loading, and its peak (VmHWM, reset to the current value first where the kernel allows) during Plan.load;
# the load's wall and CPU seconds (the CPU seconds hold on a machine shared with other work)
LOAD_PROBE = r"""
import gc, json, sys, time, warnings
import torch
from paroattn.plan import Plan
torch.set_num_threads(1)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
with warnings.catch_warnings():  # one-off costs (code pages, lazy imports) paid on a small plan first
    warnings.simplefilter("ignore")
    Plan.load(sys.argv[2])
gc.collect()
try:
    open("/proc/self/clear_refs", "w").write("5")
    reset = True
except OSError:
    reset = False
before = status("VmRSS")
start, start_cpu = time.perf_counter(), time.process_time()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    plan = Plan.load(sys.argv[1])
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
print(json.dumps({"rss_before": before, "peak_rss": status("VmHWM"), "rss_after": status("VmRSS"),
                  "peak_reset": reset, "load_s": seconds, "load_cpu_s": cpu_seconds,
                  "masks_held_bytes": plan.masks.stored_bytes(),
                  "masks_form": plan.masks.form}))
"""


def base_masks(seed: int = 0) -> list[torch.Tensor]:
    nq, nk = mask_shape(LAYOUT.seq_len, BLOCK)
    g = torch.Generator().manual_seed(seed)
    return [synthetic_block_mask(HEADS, nq, nk, DENSITY, generator=g) for _ in range(DISTINCT_MASKS)]


def build(masks: list[torch.Tensor], buckets: int, arrangement: str) -> Plan:
    nq, nk = mask_shape(LAYOUT.seq_len, BLOCK)
    if arrangement == "e2e":
        def layer_mask(b, layer):
            return masks[layer % len(masks)]
    else:
        def layer_mask(b, layer):
            return masks[(layer + b) % len(masks)].roll(layer + 1, dims=0)
    store = BlockMasks.from_layers((buckets, LAYERS, HEADS, nq, nk), layer_mask)
    g = torch.Generator().manual_seed(1)
    return Plan(model_class="WanTransformer3DModel", model_fingerprint="synthetic", layout=LAYOUT, block_size=BLOCK,
                orders=torch.randint(0, 6, (LAYERS, HEADS), generator=g), block_mask=store,
                bucket_edges=default_bucket_edges(buckets), target_density=DENSITY)


def probe(path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", LOAD_PROBE, str(path), str(shipped_plan_path(0.5))], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def demo_plans() -> list[dict]:
    """Sizes of the demo model's calibrated plans as shipped (format 2) and re-saved in the current format."""
    rows = []
    folder = Path(__file__).resolve().parents[1] / "paroattn" / "demo_model" / "assets" / "plans"
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted(folder.glob("d0.??.safetensors")):
            plan = Plan.load(path)
            flat, chunked = Path(tmp) / "flat.safetensors", Path(tmp) / "chunked.safetensors"
            replace(plan, format_version=2, block_mask=plan.masks).save(flat)
            replace(plan, format_version=3, block_mask=plan.masks).save(chunked)
            mask_flat = plan.masks.flat_bits().numel()
            mask_chunked = sum(t.numel() * t.element_size() for t in plan.masks.encode())
            rows.append({"plan": path.name, "mask_shape": list(plan.masks.shape),
                         "file_bytes_format2": flat.stat().st_size, "file_bytes_format3": chunked.stat().st_size,
                         "mask_bytes_format2": mask_flat, "mask_bytes_format3": mask_chunked,
                         "mask_ratio": round(mask_flat / mask_chunked, 2)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=None, help="where the plan files go (default: a temporary "
                        "folder, removed after)")
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--arrangements", nargs="+", default=["e2e", "distinct"], choices=["e2e", "distinct"])
    parser.add_argument("--result", type=Path, default=RESULT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = None
    if args.out_dir is None:
        tmp = tempfile.TemporaryDirectory()
        args.out_dir = Path(tmp.name)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    masks = base_masks()
    print(f"base masks {time.perf_counter() - start:.1f} s", flush=True)
    rows = []
    for arrangement in args.arrangements:
        for buckets in args.buckets:
            start = time.perf_counter()
            plan = build(masks, buckets, arrangement)
            built = time.perf_counter() - start
            for version in (3, 2):
                path = args.out_dir / f"wan14b-720p-{arrangement}-{buckets}b-v{version}.safetensors"
                start = time.perf_counter()
                replace(plan, format_version=version, block_mask=plan.masks).save(path)
                saved = time.perf_counter() - start
                row = {"masks": arrangement, "buckets": buckets, "format_version": version,
                       "file_bytes": path.stat().st_size, "build_s": round(built, 1), "save_s": round(saved, 1),
                       **probe(path)}
                row["peak_increase_bytes"] = row["peak_rss"] - row["rss_before"]
                row["peak_increase_over_file"] = round(row["peak_increase_bytes"] / row["file_bytes"], 3)
                row["file_share_of_checkpoint"] = round(row["file_bytes"] / CHECKPOINT_BYTES, 5)
                print(json.dumps(row), flush=True)
                rows.append(row)
                path.unlink()
    result = {
        "what": "plan file size and Plan.load memory, Wan2.1-14B 720p (40 layers x 40 heads, 75600 tokens, blocks "
                "128 x 64 = 591 x 1182 per head), synthetic masks at density 0.5; peak_increase: VmHWM during the "
                "load minus VmRSS before it, in a fresh process that loaded the demo model's plan once first (what "
                "the load adds, the interpreter and torch not counted); load_s wall and load_cpu_s CPU seconds of "
                "the load, one thread",
        "layout": str(LAYOUT), "layers": LAYERS, "heads": HEADS, "block_size": list(BLOCK), "density": DENSITY,
        "checkpoint_bytes_bf16": CHECKPOINT_BYTES,
        "before": "format 2 read by paroattn before this change (issue probe, main at ad95571): 1 bucket 133 MB "
                  "file, load 21 s, peak 5.7 GB; 6 buckets 838 MB file, load failed after 88 s asking for 26.8 GB",
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": 1},
        "plans": rows,
        "demo_model_plans": demo_plans(),
    }
    args.result.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.result}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
