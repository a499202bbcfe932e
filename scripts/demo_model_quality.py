"""The quality study of QUALITY.md on the demo model, and the plans that `paro demo` ships.

Dense captures over calibration prompts give the block statistics of every candidate order and of
the identity order (`paroattn.calibrate.driver.capture`); from them, plans for every density,
quantization and calibration variant (`plan_from_stats`). Each plan generates the held-out
evaluation prompts (`demo.EVAL_PROMPTS`) from every seed, compared with the dense videos of the same
seeds (PSNR / SSIM / cosine per video; mean, min and max over videos).

    python scripts/demo_model_quality.py --out /tmp/quality --ship paroattn/demo_model/assets/plans   # GPU: ~2 min
    python scripts/demo_model_quality.py --out /tmp/quality --add-profiles paroattn/demo_model/assets/plans
    python scripts/demo_model_quality.py --out /tmp/q --grid 0.5:bf16:calibrated,identity --steps 2 --eval-prompts 1
    python scripts/demo_model_quality.py --out DIR --grid "1:bf16:fp8 linear" \
        --grid "0.5,0.2:int8fp8:calibrated,fp8 linear"

A grid is DENSITIES:QUANTS:VARIANTS, each a comma-separated list (quants from QUANTS, variants from
VARIANTS, combined with '+': "more prompts+dense last"). The variant "fp8 linear" also runs the transformer blocks'
linear layers in fp8 (`apply(..., linear="fp8")`, a CUDA GPU of sm_89 or newer with torchao); at density 1 in
bf16 it is the dense model with fp8 linear layers and no plan. The variants "sol-attn" and "sol-attn no tail" are no
plan: the calibration-free peer Sol-Attn (comfy-kitchen's eager reference, benchmarks/sol_anchor.py; benchmark-only,
`pip install comfy-kitchen`) runs the self-attention at top-k ratio = the row's density, with and without its pooled
tail, in bf16 grids only; their computed density is its exact blocks (the ratio plus the forced diagonal +-1).
Writes `quality.jsonl` (one row per line, as soon as it is measured), `quality.json` and `quality_table.md` into
--out; with --ship, the demo's plans for `demo.SHIPPED_DENSITIES`, calibrated as the demo's driver does
(`demo.study_config`, `demo.study_selection`). `--k-scale block,token` runs each integer-QK row with K's scales per
key block and per key (`Plan.k_scale`, on any backend: the kernels run both), one row each.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paroattn import ORDERS
from paroattn.app import demo
from paroattn.calibrate import CHEAP
from paroattn.calibrate.driver import capture, plan_from_stats, save_calibration
from paroattn.demo_model.model import DEFAULT_STEPS, load_demo_pipeline
from paroattn.modes import k_scale_problem
from paroattn.pipelines import apply
from paroattn.plan import Plan
from paroattn.plan.balance import rank_imbalance

QUANTS = {"bf16": "bf16", "int8": "int8 QK", "int8fp8": "int8 QK + fp8 PV", "int4": "int4 QK"}
# calibration variants: SelectionConfig options on top of the shipped calibration (demo.study_selection);
# "capture" picks the prompts the statistics come from
VARIANTS = {
    "calibrated": {},
    # the demo's shipped plan of the row's density (assets/plans, which --ship writes: "calibrated"'s plan from a GPU's
    # capture), loaded instead of captured and calibrated here: for runs where the full capture costs too much
    "shipped": {"shipped": True},
    "identity": {"order_set": "identity"},
    "paper metric": {"metric": "paper"},
    "mass metric": {"metric": "mass"},
    "global budget": {"layer_floor": 0.0},
    "layer floor 0.5": {"layer_floor": 0.5},
    "layer floor 1": {"layer_floor": 1.0},
    "no dense layers": {"dense_layers": []},
    "dense first and last": {"dense_layers": [0, -1]},
    "dense last": {"dense_layers": [-1]},
    "dense first": {"dense_layers": [0]},
    "no dilation": {"dilation": 0},
    "dilation 1": {"dilation": 1},
    "more prompts": {"capture": "more"},
    # the cheap capture (`--cheap-capture`'s options) of the same 2 prompts, its orders chosen at the row's density
    "cheap capture": {"capture": "cheap"},
    # the same options on the first calibration prompt alone: what plan="auto" learns from one generation
    "cheap capture one prompt": {"capture": "cheap one"},
    # the same, its first 1 or 2 timestep buckets captured and the later buckets' masks their mean: the plan of a
    # first generation that would run sparse from its second (third) bucket on
    "cheap capture one prompt first bucket": {"capture": "cheap one", "capture_buckets": 1},
    "cheap capture one prompt first 2 buckets": {"capture": "cheap one", "capture_buckets": 2},
    "dense steps 0.2": {"dense_steps": 0.2},
    "dense steps 0.3": {"dense_steps": 0.3},
    "no dense steps": {"dense_steps": 0.0},
    "shared budget": {"shared_budget": True},
    "per-bucket budget": {"shared_budget": False},
    "fp8 linear": {"linear": "fp8"},
    # masks balanced over the GPUs' slices of the heads under Ulysses (the demo model's 4 heads: 2 per GPU, or 1)
    "balanced 2 GPUs": {"ulysses": 2},
    "balanced 4 GPUs": {"ulysses": 4},
}
# the calibration-free peer: Sol-Attn at top-k ratio = the row's density, with its pooled tail or without (the value)
SOL_VARIANTS = {"sol-attn": True, "sol-attn no tail": False}
ALONE = {"shipped", *SOL_VARIANTS}  # variants that take no calibration options ('+')
DEFAULT_GRIDS = (
    "0.5,0.3,0.2:bf16:calibrated,identity",
    "1,0.5:int8fp8:calibrated,identity",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ship", type=Path, default=None, help="write the demo's plans (and stats files) here")
    p.add_argument("--grid", action="append", default=None,
                   help=f"DENSITIES:QUANTS:VARIANTS (repeatable); default {' and '.join(DEFAULT_GRIDS)}")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="sampling steps of every evaluated video")
    p.add_argument("--calibration-steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--eval-prompts", type=int, default=len(demo.EVAL_PROMPTS), help="first N evaluation prompts")
    p.add_argument("--eval-start", type=int, default=0,
                   help="the evaluation prompts from this one on (more videos for a study whose first ones ran)")
    p.add_argument("--seeds", default="0,1", help="comma-separated sampling seeds of the evaluation")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="auto", help="PARO op backend: auto (triton on CUDA), triton, torch")
    p.add_argument("--block-size", type=int, default=64, help="plan block size (the shipped plans use 64)")
    p.add_argument("--query-block", type=int, default=None, help="query block of the plans (default: --block-size)")
    p.add_argument("--quant-weight", type=float, default=0.0,
                   help="weight of the incoherence term in the order choice of every row (as paro calibrate's)")
    p.add_argument("--model-dir", type=Path, default=None, help="a demo model folder (default: the shipped one)")
    p.add_argument("--frames", type=int, default=None, help="video frames (default: the model's)")
    p.add_argument("--height", type=int, default=None, help="video height in pixels (default: the model's)")
    p.add_argument("--width", type=int, default=None, help="video width in pixels (default: the model's)")
    p.add_argument("--ship-densities", default=",".join(f"{d:g}" for d in demo.SHIPPED_DENSITIES),
                   help="densities of the plans --ship writes")
    p.add_argument("--add-profiles", type=Path, default=None,
                   help="capture once as --ship does and write its axis profiles into the plans in this folder, "
                        "keeping their orders, masks and stats files (what the quality summary measured); then stop")
    p.add_argument("--cheap-capture", default=",".join(f"{k}={v}" for k, v in CHEAP.items()),
                   help="CaptureConfig options of the variant 'cheap capture', comma-separated name=value")
    p.add_argument("--time-limit", type=float, default=None, help="measure no new row after this many seconds")
    p.add_argument("--k-scale", default="block",
                   help="K's scales in the integer-QK rows, as the kernels run them (Plan.k_scale), comma list of "
                        "block, token: each such row once per granularity (default: block)")
    p.add_argument("--qk-scales", choices=tuple(QK_SCALES), default="block",
                   help="study only, with --backend torch: integer Q (and K) quantized with finer scales than the "
                        "kernels' one per block: per token, K per thread group, or K's channel ranges moved into Q "
                        "(QK_SCALES)")
    args = p.parse_args(argv)
    args.k_scale = [k.strip() for k in args.k_scale.split(",") if k.strip()]
    for k_scale in args.k_scale:
        if problem := k_scale_problem(k_scale):
            p.error(f"--k-scale {problem}: pass block, token or block,token")
    if not args.k_scale:
        p.error("--k-scale: pass block, token or block,token")
    if args.qk_scales != "block" and args.k_scale != ["block"]:
        p.error(f"--qk-scales {args.qk_scales} replaces the reference's per-block quantization, which --k-scale token "
                "does not use: pass one of them")
    return args


# how the torch reference quantizes Q and K under --qk-scales (the kernels: one scale per block of each): per token,
# or K per "thread group", the keys of a 64-key block that one thread of the sm_90a kernel's accumulator holds
# (columns 8a + 2t + e, a < 8, e < 2: 16 keys per group t < 4), which that kernel could scale at no cost per score
QK_SCALES = {"block": {}, "token-q": {"q": "token"}, "token-qk": {"q": "token", "k": "token"},
             "token-q-thread-k": {"q": "token", "k": "thread"},
             # K's channels equalised by a factor that Q takes on (their product unchanged), then both per block as the
             # kernels quantize them: c_d = max|k_d|^a / max|q_d|^(1-a) over the head's tokens; free in the loop
             "channel-k": {"migrate": 1.0}, "channel-qk": {"migrate": 0.5}}


def migrated_qk_scales(alpha: float):
    """Stand-ins for `reference.key_smoothing_mean` and `reference.quantize_per_block` that move K's channel ranges
    into Q before the per-block quantization: K's smoothed channel maxima are kept when its mean is taken (before
    Q is quantized), Q is quantized as Q * c and K as K / c per block, and both come back dequantized with block
    scales of 1, so the reference's product is the product of the two quantized factors."""
    from itertools import count

    from paroattn.kernels import reference

    per_block, smoothing_mean, calls, kept = reference.quantize_per_block, reference.key_smoothing_mean, count(), {}

    def key_mean(k, stride):
        mean = smoothing_mean(k, stride)
        kept["k_max"] = (k.float() - mean).abs().amax(dim=1, keepdim=True).clamp_min(1e-12)  # [B, 1, D]
        return mean

    def quantize(x, block, qmax):
        B, N, _ = x.shape
        if next(calls) % 2 == 0:  # Q, after K's mean
            q_max = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
            kept["c"] = kept["k_max"] ** alpha / q_max ** (1 - alpha)
            x = x * kept["c"]
        else:
            x = x / kept["c"]
        values, scale = per_block(x, block, qmax)
        dequantized = values * scale.repeat_interleave(block, dim=1)[:, :N, None]
        return dequantized, torch.ones(B, -(-N // block), dtype=x.dtype, device=x.device)

    return key_mean, quantize


def finer_qk_scales(scales: dict[str, str]):
    """A stand-in for `reference.quantize_per_block` with the finer scales `scales` names ({"q"/"k": "token" or
    "thread"}). The reference quantizes Q with the query block, then K with the key block; the stand-in tells them
    apart by call order and returns the values already multiplied by their scales, with block scales of 1, so the
    reference's dequantization (row scale x key scale) leaves them as they are."""
    from itertools import count

    from paroattn.kernels import reference

    per_block, calls = reference.quantize_per_block, count()

    def quantize(x, block, qmax):
        granularity = scales.get(("q", "k")[next(calls) % 2])
        if granularity is None:
            return per_block(x, block, qmax)
        B, N, D = x.shape
        if granularity == "token":
            values, scale = reference.quantize_symmetric(x, dim=2, qmax=qmax)
            dequantized = values * scale
        else:  # the key block's 4 thread groups: key 8a + 2t + e of the block in group t
            nb = -(-N // block)
            padded = torch.zeros(B, nb * block, D, dtype=x.dtype, device=x.device)
            padded[:, :N] = x
            groups = padded.view(B, nb, block // 8, 4, 2, D)
            values, scale = reference.quantize_symmetric(groups, dim=(2, 4, 5), qmax=qmax)
            dequantized = (values * scale).view(B, nb * block, D)[:, :N]
        return dequantized, torch.ones(B, -(-N // block), dtype=x.dtype, device=x.device)

    return quantize


def kept_on(stats, plan) -> float:
    """The mean share of the attention mass that `plan`'s orders and masks keep on the statistics `stats` (a capture
    with every order), over timestep buckets, layers and heads: plans from different captures on one scale."""
    acc = stats.accumulators["all"]
    slots = torch.tensor([[acc.candidate_orders.index(int(o)) for o in layer] for layer in plan.orders])
    kept = []
    for b in range(acc.num_buckets):
        for layer in range(acc.num_layers):
            mass = acc.mean_map(b, layer, torch.device("cpu"))
            if mass is None:
                continue
            mass = mass[torch.arange(mass.shape[0]), slots[layer]]  # [H, nq, nk] in each head's plan order
            mask = plan.block_mask[b, layer].to(mass.device)
            kept.append((mass * mask).sum((-1, -2)) / mass.sum((-1, -2)).clamp_min(1e-30))
    return float(torch.stack(kept).mean())


def parse_capture_options(spec: str) -> dict:
    """"name=value,..." -> CaptureConfig options (ints, floats, None, or strings), checked by CaptureConfig."""
    from paroattn.calibrate import CaptureConfig

    fields = set(CaptureConfig.__dataclass_fields__)
    options = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in fields or not value:
            raise SystemExit(f"--cheap-capture {item!r}: expected name=value with a CaptureConfig option name")
        for kind in (int, float):
            try:
                options[name] = kind(value)
                break
            except ValueError:
                options[name] = None if value == "None" else value
    CaptureConfig(**options)  # a bad value stops here, naming the option
    return options


def parse_grid(spec: str) -> list[tuple[float, str, str]]:
    """'0.5,0.3:bf16:calibrated,identity' -> [(0.5, 'bf16', 'calibrated'), ...]."""
    try:
        densities, quants, variants = spec.split(":")
    except ValueError:
        raise SystemExit(f"--grid {spec!r}: expected DENSITIES:QUANTS:VARIANTS") from None
    rows = []
    for d in densities.split(","):
        for q in quants.split(","):
            if q not in QUANTS:
                raise SystemExit(f"--grid {spec!r}: unknown quantization {q!r}; expected one of {list(QUANTS)}")
            for v in variants.split(","):
                if v in SOL_VARIANTS:
                    if q != "bf16":
                        raise SystemExit(f"--grid {spec!r}: {v!r} runs Sol-Attn's full-precision reference: "
                                         "put it in a bf16 grid")
                    rows.append((float(d), q, v))
                    continue
                unknown = [part for part in v.split("+") if part not in VARIANTS]
                if unknown:
                    raise SystemExit(f"--grid {spec!r}: unknown variant {unknown}; expected names from "
                                     f"{[*VARIANTS, *SOL_VARIANTS]}")
                if "+" in v and ALONE & set(v.split("+")):
                    raise SystemExit(f"--grid {spec!r}: {sorted(ALONE & set(v.split('+')))} take no other variant")
                rows.append((float(d), q, v))
    return rows


def variant_arguments(name: str) -> dict:
    if name in SOL_VARIANTS:
        return {}
    merged = {}
    for part in name.split("+"):
        merged.update(VARIANTS[part])
    return merged


def sol_anchor_module():
    """benchmarks/sol_anchor.py, with Sol-Attn's eager reference importable (comfy-kitchen is benchmark-only)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import sol_anchor

    try:
        sol_anchor.eager_reference()
    except RuntimeError as exc:
        raise SystemExit(f"--grid ... sol-attn: {exc}") from None
    return sol_anchor


def compute_density(plan) -> float:
    """Mean share of (query, key) blocks computed over denoising steps, layers and heads, dense layers and
    buckets as 1: each bucket counts by its share of the steps (`info["step_shares"]`; equal shares in plans
    without it)."""
    density = torch.where(plan.dense[..., None], torch.ones_like(plan.density), plan.density).mean(dim=(1, 2))
    shares = torch.tensor(plan.info.get("step_shares") or [1.0 / plan.num_buckets] * plan.num_buckets)
    return float((density * shares).sum() / shares.sum())


def summary(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "min": float(np.min(values)), "max": float(np.max(values)),
            "std": float(np.std(values))}


def main(argv=None) -> int:
    args = parse_args(argv)
    start_time = time.perf_counter()
    if args.qk_scales != "block":
        if args.backend != "torch":
            raise SystemExit(f"--qk-scales {args.qk_scales} changes the torch reference only: add --backend torch")
        from paroattn.kernels import reference

        scales = QK_SCALES[args.qk_scales]
        if "migrate" in scales:
            reference.key_smoothing_mean, reference.quantize_per_block = migrated_qk_scales(scales["migrate"])
        else:
            reference.quantize_per_block = finer_qk_scales(scales)
    args.out.mkdir(parents=True, exist_ok=True)
    rows_spec = [row for spec in (args.grid or DEFAULT_GRIDS) for row in parse_grid(spec)]
    for linear in {variant_arguments(variant).get("linear") for _, _, variant in rows_spec} - {None}:
        from paroattn.linear import linear_problem

        if problem := linear_problem(linear, args.device):
            raise SystemExit(f"--grid ... fp8 linear: {problem}")
    sol_anchor = sol_anchor_module() if any(v in SOL_VARIANTS for _, _, v in rows_spec) else None
    seeds = [int(s) for s in args.seeds.split(",")]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    pipe = load_demo_pipeline(args.model_dir, device=args.device, dtype=dtype)
    size = {k: v for k, v in (("num_frames", args.frames), ("height", args.height), ("width", args.width)) if v}
    log = []

    def say(line: str) -> None:
        print(line, flush=True)
        log.append(line)

    captures = {}
    cheap_options = parse_capture_options(args.cheap_capture)

    def stats_for(name: str, density: float | None = None, capture_buckets: int | None = None):
        if name.startswith("cheap"):  # orders chosen during the capture at the row's density: one capture per density
            key = f"{name} d={density:g}" + (f" first {capture_buckets} buckets" if capture_buckets else "")
            if key not in captures:
                config = replace(demo.study_config(args.calibration_steps, size=size, block_size=args.block_size,
                                                   query_block=args.query_block), order_density=density,
                                 capture_buckets=capture_buckets, **cheap_options)
                prompts = demo.CALIBRATION_PROMPTS[:1] if name == "cheap one" else demo.CALIBRATION_PROMPTS
                captures[key] = capture(pipe, prompts, config)
                acc = captures[key].accumulators["all"]
                say(f"capture {key!r} ({args.cheap_capture}): {captures[key].timings['pipeline_s']:.1f} s, "
                    f"statistics {captures[key].timings['stats_s']:.1f} s, {captures[key].timings['captured_layer_calls']} "
                    f"layer calls, stored means {acc.stored_bytes() / 1e6:.2f} MB")
            return captures[key]
        if name not in captures:
            prompts = demo.CALIBRATION_PROMPTS + (demo.MORE_CALIBRATION_PROMPTS if name == "more" else [])
            config = demo.study_config(args.calibration_steps, size=size, block_size=args.block_size,
                                       query_block=args.query_block, extras=True)
            captures[name] = capture(pipe, prompts, config, order_sets={"identity": [ORDERS.index("FHW")]})
            say(f"capture {name!r}: {len(prompts)} prompts x {args.calibration_steps} steps in "
                f"{captures[name].timings['pipeline_s']:.1f} s, statistics {captures[name].timings['stats_s']:.1f} s, "
                f"stored means {captures[name].accumulators['all'].stored_bytes() / 1e6:.2f} MB, "
                f"layout {captures[name].layout}")
        return captures[name]

    if args.add_profiles is not None:
        if args.model_dir is not None or size or args.block_size != 64 or args.query_block not in (None, 64):
            raise SystemExit("--add-profiles completes the demo's plans: drop --model-dir, the size and the block options")
        stats = stats_for("two")
        for density in (float(d) for d in args.ship_densities.split(",")):
            path = args.add_profiles / demo.shipped_plan_path(density).name
            add_profiles(path, stats, args.device, str(dtype))
            say(f"added axis profiles to {path}")
        (args.out / "quality_log.txt").write_text("\n".join(log) + "\n")
        return 0
    if args.ship is not None:
        if args.model_dir is not None or size or args.block_size != 64 or args.query_block not in (None, 64):
            raise SystemExit("--ship writes the demo's plans: the shipped model at its size, 64-token blocks; "
                             "drop --model-dir, the size and the block options")
        for density in (float(d) for d in args.ship_densities.split(",")):
            plan, result = plan_from_stats(stats_for("two"), demo.study_selection(density))
            path = args.ship / demo.shipped_plan_path(density).name
            save_calibration(plan, result, path)
            plan.info["stats_file"] = {"name": path.name.replace(".safetensors", ".stats.safetensors")}
            plan.save(path)  # without the absolute path of this machine
            say(f"shipped {path}: kept mass {plan.info['kept_mass']:.4f}, density {compute_density(plan):.3f}")

    prompts = demo.EVAL_PROMPTS[args.eval_start : args.eval_start + args.eval_prompts]
    dense = {}
    for seed in seeds:
        dense[seed], timing = demo.sample(pipe, prompts, steps=args.steps, seed=seed, size=size)
        say(f"dense, seed {seed}: {timing['total_s']:.2f} s ({timing['attention_s']:.2f} s in self-attention)")
    rows = []
    jsonl = (args.out / "quality.jsonl").open("w")
    for density, quant, variant in rows_spec:
        if args.time_limit is not None and time.perf_counter() - start_time > args.time_limit:
            say(f"time limit: skipped d={density} {quant} {variant} and the rows after it")
            break
        kwargs = {"quant_weight": args.quant_weight, **variant_arguments(variant)}
        linear = kwargs.pop("linear", None)
        if density >= 1.0 and quant == "bf16" and linear is None:
            continue  # the dense model itself
        qk, pv = demo.QUANT_MODES[QUANTS[quant]]
        sol_tail = SOL_VARIANTS.get(variant)  # None: a PARO row
        plan, result = None, None  # density 1 in bf16 with fp8 linear layers: no plan, the model's own attention
        if sol_tail is None and not (density >= 1.0 and quant == "bf16"):
            try:
                if kwargs.pop("shipped", False):  # its qk / pv replaced by the row's, as `paro demo` runs it
                    plan = replace(Plan.load(demo.shipped_plan_path(density)), qk=qk, pv=pv)
                else:
                    stats = stats_for(kwargs.pop("capture", "two"), density, kwargs.pop("capture_buckets", None))
                    plan, result = plan_from_stats(stats, demo.study_selection(density, qk=qk, pv=pv, **kwargs))
            except (ValueError, FileNotFoundError) as exc:
                say(f"d={density} {quant} {variant}: not built ({exc})")
                continue
        # the plan's K scale granularities: each integer-QK row once per --k-scale (the same orders and masks)
        for k_scale in (args.k_scale if qk != "bf16" else ["block"]):
            per_video = {"psnr_db": [], "ssim": [], "cosine": []}
            seconds = 0.0
            sol = None if sol_tail is None else sol_anchor.SolAttnProcessor(density, tail=sol_tail)
            for seed in seeds:
                swap = sol_anchor.installed(pipe, sol) if sol is not None else apply(
                    pipe, None if plan is None else replace(plan, k_scale=k_scale), backend=args.backend, linear=linear)
                with swap:
                    frames, timing = demo.sample(pipe, prompts, steps=args.steps, seed=seed, size=size)
                seconds += timing["total_s"]
                for i in range(len(prompts)):
                    m = demo.compare(dense[seed][i:i + 1], frames[i:i + 1])
                    for key in per_video:
                        per_video[key].append(m[key])
            row = {
                "density": density, "quant": quant, "qk": qk, "pv": pv, "k_scale": k_scale, "variant": variant,
                "linear": linear or "bf16", "eval_prompts": len(prompts), "seeds": seeds,
                **({"capture_options": args.cheap_capture} if variant.startswith("cheap") else {}),
                **{k: summary(v) for k, v in per_video.items()}, "per_video": per_video, "seconds": seconds,
            }
            if sol is not None:  # its exact blocks, the mean over every call (steps, layers, CFG calls, heads)
                row.update({"achieved_density": float(np.mean(sol.densities)), "kept_mass": None,
                            "attention": "Sol-Attn eager reference", "topk_ratio": density, "tail": sol_tail,
                            "comfy_kitchen": _version_of("comfy-kitchen")})
            elif plan is None:
                row.update({"achieved_density": 1.0, "kept_mass": 1.0})
            else:
                row.update({
                    "achieved_density": compute_density(plan),
                    **({"kept_mass": float(result.kept_mass.mean()), "dense_layers": result.dense_layers,
                        "dense_buckets": result.dense_buckets, "step_shares": result.step_shares} if result is not None
                       else {"kept_mass": plan.info["kept_mass"], "dense_buckets": plan.info.get("dense_buckets", []),
                             "step_shares": plan.info["step_shares"],  # a shipped plan: what its calibration recorded
                             "dense_layers": [i for i in range(plan.num_layers) if bool(plan.dense[:, i].all())]}),
                    "bucket_density": [round(float(d), 4) for d in plan.density.mean(dim=(1, 2))],
                    "orders_histogram": {o: int((plan.orders == i).sum()) for i, o in enumerate(ORDERS)},
                    "orders": plan.orders.tolist(),
                    # the share of the attention mass its orders and masks keep on the full capture's statistics
                    **({"kept_mass_on_full_capture": kept_on(captures["two"], plan)} if "two" in captures else {}),
                    # how much longer the slowest GPU's attention runs than the mean GPU's under Ulysses, in blocks
                    "gpu_imbalance": {gpus: float(rank_imbalance(plan, gpus).mean()) for gpus in (2, 4)},
                })
            rows.append(row)
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            kept = "-" if row["kept_mass"] is None else f"{row['kept_mass']:.4f}"
            say(f"d={density:.1f} {quant:7s} K per {k_scale:5s} {variant:28s} computed={row['achieved_density']:.3f} "
                f"kept={kept} PSNR={row['psnr_db']['mean']:6.2f} "
                f"[{row['psnr_db']['min']:5.2f}, {row['psnr_db']['max']:5.2f}] SSIM={row['ssim']['mean']:.4f} "
                f"[{row['ssim']['min']:.3f}] ({seconds:.1f} s)")
    jsonl.close()

    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "torchao": _torchao_version(), "dtype": str(dtype), "steps": args.steps,
        "model": str(args.model_dir or "paroattn/demo_model/assets"),
        "layout": str(next(iter(captures.values())).layout) if captures else None,
        "calibration_steps": args.calibration_steps, "prompts": prompts, "seeds": seeds,
        "block_size": args.block_size, "query_block": args.query_block, "quant_weight": args.quant_weight,
        "qk_scales": args.qk_scales, "k_scales": args.k_scale,
        "calibration_prompts": {name: stats.prompts for name, stats in captures.items()},
        "calibration": {k: v for k, v in {**vars(demo.study_config(args.calibration_steps)),
                                          **vars(demo.study_selection(0.5))}.items()
                        if k in ("metric", "layer_floor", "dilation", "dense_layers", "block_size", "dense_steps",
                                 "shared_budget")},
        "rows": rows,
    }
    (args.out / "quality.json").write_text(json.dumps(report, indent=1))
    if args.ship is not None:
        summary_path = args.ship / demo.QUALITY_SUMMARY.name
        summary_path.write_text(json.dumps(demo_summary(rows, report["device"], len(prompts), seeds), indent=1) + "\n")
        say(f"wrote {summary_path}")
    (args.out / "quality_table.md").write_text(markdown_table(rows))
    (args.out / "quality_log.txt").write_text("\n".join(log) + "\n")
    print(f"wrote {args.out / 'quality.json'} and {args.out / 'quality_table.md'}")
    return 0


def _torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


def _version_of(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def add_profiles(path: Path, stats, device: str, dtype: str) -> None:
    """Write the axis profiles of capture `stats` into the plan at `path`, which must have been calibrated with
    the same layout, buckets, prompts and steps; its orders, masks and everything else stay as they are. The plan
    records where its profiles come from (`info["profiles_capture"]`)."""
    import dataclasses

    from paroattn.plan import FORMAT_VERSION, Plan

    plan = Plan.load(path)
    calibration = plan.info.get("calibration", {})
    same = (stats.layout == plan.layout and stats.config.edges() == plan.bucket_edges and stats.prompts == plan.prompts
            and stats.config.steps == calibration.get("steps") and stats.config.stat_every == calibration.get("stat_every"))
    if not same:
        raise SystemExit(f"{path} was calibrated with another layout, buckets, prompts or steps than this capture")
    capture = {"device": device, "dtype": dtype, "torch": torch.__version__, "steps": stats.config.steps,
               "profile_queries": stats.config.profile_queries, "seed": stats.config.seed}
    dataclasses.replace(plan, profiles=stats.profiles.finalize(), format_version=FORMAT_VERSION,
                        info={**plan.info, "profiles_capture": capture}).save(path)


def demo_summary(rows: list[dict], device: str, prompts: int, seeds: list[int]) -> dict:
    """What `paro demo` prints about other densities: mean PSNR / SSIM of the calibrated rows with
    the demo's default quantization, by density."""
    qk, pv = demo.DEFAULT_QK, demo.DEFAULT_PV
    by_density = {f"{r['density']:.2f}": {"psnr_db": round(r["psnr_db"]["mean"], 2), "ssim": round(r["ssim"]["mean"], 3)}
                  for r in rows if r["variant"] == "calibrated" and (r["qk"], r["pv"]) == (qk, pv)
                  and r.get("k_scale", "block") == "block"}  # what the shipped plans run
    return {"device": device, "qk": qk, "pv": pv, "eval_prompts": prompts, "seeds": seeds,
            "by_density": dict(sorted(by_density.items(), reverse=True))}


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| density (computed) | quantization | K scales | variant | kept mass | PSNR dB mean [min, max] | SSIM mean [min] "
        "| slowest GPU's blocks over the mean, 2 / 4 GPUs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, s = r["psnr_db"], r["ssim"]
        gpus = r.get("gpu_imbalance", {})
        imbalance = " / ".join(f"{gpus[n]:+.1%}" for n in (2, 4)) if gpus else "-"
        kept = "-" if r["kept_mass"] is None else f"{r['kept_mass']:.3f}"  # none for Sol-Attn's rows
        lines.append(
            f"| {r['density']:g} ({r['achieved_density']:.3f}) | {QUANTS[r['quant']]} | "
            f"{'per key' if r.get('k_scale') == 'token' else 'per block' if r['qk'] != 'bf16' else '-'} | {r['variant']} | "
            f"{kept} | {p['mean']:.2f} [{p['min']:.2f}, {p['max']:.2f}] | {s['mean']:.3f} [{s['min']:.3f}] | {imbalance} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
