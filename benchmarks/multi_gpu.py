"""Multi-GPU benchmark: one denoising step of a video transformer split over N GPUs with diffusers' Ulysses context
parallelism, dense vs PARO (each GPU runs its contiguous slice of the plan's heads over the whole sequence).

    torchrun --nproc-per-node N benchmarks/multi_gpu.py [--models wan-14b-720p,hunyuanvideo-720p] [--iters 3] --out RESULTS.json
    python benchmarks/multi_gpu.py --models wan-1.3b --out RESULTS.json     # N = 1: one GPU, no parallelism
    ... --check      # every mode under Ulysses N against the same mode on one GPU, same plan and inputs
    ... --modes "dense,paro d=0.2 int8+fp8,paro d=0.2 int8+fp8 balanced"    # a subset (dense is always run)
    ... --baseline ONE_GPU.json ... # the one-GPU times from N = 1 runs (or --check runs) of the models (not run again)
    ... --outputs DIR   # N = 1: save each mode's output there; N > 1: compare with those saved (a check without
                        # running one GPU again; the balanced and pipelined modes only where they were balanced
                        # for the same N and groups)
    python benchmarks/multi_gpu.py --smoke [--models ...] [--out ...]    # tiny models on CPU (also under torchrun)
    python benchmarks/multi_gpu.py --table RESULTS.json ...   # markdown tables of results files (no GPU)

Models, built by `e2e.py` from the released configs with random bf16 weights (timing does not depend on them), at
their default generation sizes (one CFG branch unless noted):
- wan-1.3b: Wan2.1-1.3B, 81 frames of 480x832: 12 heads x 32760 tokens;
- wan-14b-720p: Wan2.1-14B, 81 frames of 720x1280: 40 heads x 75600 tokens;
- cogvideox-5b: CogVideoX-5B, 49 frames of 480x720, CFG batched (B=2): 48 heads x (226 text + 17550) tokens; the
  17550 video tokens do not split over 4 or 8 GPUs evenly: such runs use `ulysses_anything` (chunks of unequal length);
- hunyuanvideo-720p: HunyuanVideo, 129 frames of 720x1280: 24 heads x (118800 + 256 padded text) tokens;
- hunyuanvideo-1.5-720p: HunyuanVideo-1.5, 121 frames of 720x1280: 16 heads x (111600 + 1985 padded text) tokens;
- skyreels-v2-720p: SkyReels-V2-14B, 121 frames of 720x1280: 40 heads x 111600 tokens;
- wan-vace-14b: Wan2.1-VACE-14B, 81 frames of 480x832: 40 heads x 32760 tokens in 40 main + 8 VACE blocks.
CogVideoX and HunyuanVideo (1 and 1.5) hold their text whole on every GPU; their own attention cannot run under
Ulysses, so their dense rows on N GPUs are the model's attention call through PARO's processor (every layer flagged
dense: the same exchange as PARO's), on one GPU the model's own processors.

Modes: `e2e.py`'s (dense SDPA; PARO d=0.5 and 0.2, bf16 or int8 QK + fp8 PV) and "paro d=0.2 int8+fp8 balanced", the
same plan balanced over the N GPUs when applied (`apply(..., balance_ranks=N)`: each layer's blocks spread evenly over
the GPUs' slices of the heads, moved by the mass its axis profiles estimate), and "paro d=0.2 int8+fp8 pipelined":
the exchange pipelined over G groups of each GPU's heads (`exchange_groups=G`: `--pipeline-groups`, by default the
most up to 4 that divide a GPU's heads) with the plan balanced over the N x G groups (each group's all-to-all waits
for every GPU); on one GPU it runs the same N x G-balanced plan without an exchange, so that `--check` compares every
mode with the same plan on one GPU (the balanced mode's differs: it is balanced over N). Plans are synthetic, all masks resident: random orders, banded
and scattered masks whose density varies per head as calibrated plans' do (log-normal around the target, sigma
`--head-spread`: 0.35 by default, within the 0.26-0.42 of the demo model's shipped plans), and random axis profiles.

N is WORLD_SIZE. With N > 1, rank 0 first runs every mode alone on its GPU (the one-GPU time the scaling column
divides by; `--baseline` reads it instead), then all N processes run it under `ContextParallelConfig(ulysses_degree=N)`
with the family's context-parallel plan; a step's time is the slowest process's median. Columns: step time, speedup over
dense at the same N, scaling (one-GPU time / N-GPU time), peak GPU memory (the largest over processes), and, from one
profiled step under Ulysses: the share of the step in NCCL kernels (the largest over processes; all-to-alls and the
gathers of RoPE tables and output; a GPU waiting in an all-to-all for a slower one counts; pipelined exchanges run
beside attention, so there the share is not time the step waits), the all-to-alls' share alone, and each GPU's
time in attention kernels (PARO's or SDPA's), whose slowest over mean says how balanced the GPUs are. Weights and
inputs are broadcast from rank 0, so every process computes the same step.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e  # noqa: E402

from paroattn import Plan, TokenLayout  # noqa: E402
from paroattn.masks import synthetic_block_mask  # noqa: E402
from paroattn.pipelines import apply, family_of, self_attention_layers  # noqa: E402
from paroattn.pipelines.base import TEXT_WHOLE  # noqa: E402
from paroattn.pipelines.context_parallel import (  # noqa: E402
    enable_ulysses,
    join_process_group,
    sequence_problem,
    ulysses_problem,
)
from paroattn.plan import default_bucket_edges, model_fingerprint  # noqa: E402

# name -> (e2e config key, label)
MODELS = {
    "wan-1.3b": ("wan", "Wan2.1-1.3B 480p"),
    "wan-14b-720p": ("wan-14b-720p", "Wan2.1-14B 720p"),
    "cogvideox-5b": ("cogvideox", "CogVideoX-5B"),
    "hunyuanvideo-720p": ("hunyuan", "HunyuanVideo 720p"),
    "hunyuanvideo-1.5-720p": ("hunyuanvideo-1.5-720p", "HunyuanVideo-1.5 720p"),
    "skyreels-v2-720p": ("skyreels-v2-720p", "SkyReels-V2-14B 720p"),
    "wan-vace-14b": ("wan-vace-14b", "Wan2.1-VACE-14B 480p"),
}
SMOKE_MODELS = ("wan-1.3b",)  # --smoke builds the shrunk Wan of e2e.py whatever the model
BALANCED = "paro d=0.2 int8+fp8 balanced"
PIPELINED = "paro d=0.2 int8+fp8 pipelined"
# (label, density, qk, pv, balanced, pipelined)
MODE_SPECS = [(label, density, qk, pv, False, False) for label, density, qk, pv in e2e.MODES] + [
    (BALANCED, 0.2, "int8", "fp8", True, False), (PIPELINED, 0.2, "int8", "fp8", True, True)]
MODES = [spec[0] for spec in MODE_SPECS]


def build(name: str, device, dtype, smoke: bool, smoke_heads: int | None = None):
    """(transformer, forward inputs) of `name`, identical on every process (broadcast from rank 0); `smoke_heads`:
    the shrunk model's heads (default: e2e's 2)."""
    from unittest import mock

    key, _ = MODELS[name]
    torch.manual_seed(0)
    heads = {"num_attention_heads": smoke_heads} if smoke and smoke_heads else {}
    with mock.patch.dict(e2e.SMOKE_CONFIG, heads):
        transformer = e2e.build_transformer(key, device, dtype, smoke)
    inputs = e2e.step_inputs(key, transformer, device, dtype, smoke)
    if dist.is_initialized():
        with torch.no_grad():
            for tensor in list(transformer.parameters()) + list(transformer.buffers()):
                dist.broadcast(tensor.data, 0)
            for value in inputs.values():
                for tensor in value if isinstance(value, tuple) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        dist.broadcast(tensor, 0)
    return transformer, inputs


def synthetic_plan(transformer, layout: TokenLayout, density: float, block: tuple[int, int], spread: float,
                   seed: int = 0) -> Plan:
    """A plan of random orders, banded and scattered masks whose density per (layer, head) is log-normal around
    `density` with sigma `spread` (the mean kept at `density`), and random axis profiles (what balancing at apply
    time estimates masses from). `e2e.DISTINCT_MASKS` distinct layers, cycled (timing does not depend on which)."""
    layers = len(self_attention_layers(transformer))
    heads = transformer.config.num_attention_heads
    nq, nk = -(-layout.seq_len // block[0]), -(-layout.seq_len // block[1])
    g = torch.Generator().manual_seed(seed)
    distinct = []
    for _ in range(min(e2e.DISTINCT_MASKS, layers)):
        scale = torch.exp(spread * torch.randn(heads, generator=g))
        per_head = (density * scale / scale.mean()).clamp(1.0 / nk, 1.0)
        distinct.append(torch.cat([synthetic_block_mask(1, nq, nk, float(d), generator=g) for d in per_head]))
    masks = torch.stack([distinct[layer % len(distinct)] for layer in range(layers)])[None]
    sizes = (layout.frames, layout.height, layout.width)
    return Plan(
        model_class=type(transformer).__name__, model_fingerprint=model_fingerprint(transformer.config), layout=layout,
        block_size=block, orders=torch.randint(0, 6, (layers, heads), generator=g), block_mask=masks,
        bucket_edges=default_bucket_edges(1), target_density=density,
        profiles=[torch.rand(1, layers, heads, 2 * n - 1, generator=g) for n in sizes],
    )


def all_dense(plan: Plan) -> Plan:
    """`plan` with every layer run by the model's own attention (through PARO's processor, which exchanges)."""
    return replace(plan, dense=torch.ones_like(plan.dense))


def slowest(value: float, device, gpus: int) -> float:
    """The largest of every process's `value` when `gpus` processes ran the step (rank 0 alone: its own)."""
    if gpus == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def every(value: float, device, gpus: int) -> list[float]:
    """Every process's `value`, in rank order."""
    if gpus == 1:
        return [value]
    tensor = torch.zeros(gpus, dtype=torch.float64, device=device)
    tensor[dist.get_rank()] = value
    dist.all_reduce(tensor)
    return tensor.tolist()


def profiled_step(transformer, inputs) -> dict:
    """One profiled step on this process's GPU: its wall seconds and seconds in NCCL kernels, in the all-to-alls
    (NCCL's send/receive kernels) and in attention kernels (`e2e.kernel_class`)."""
    seconds, kernels = e2e.kernel_seconds(transformer, inputs)
    found = {"step_s": seconds, "nccl_s": 0.0, "alltoall_s": 0.0, "attention_s": 0.0}
    for kernel, device_s in kernels.items():
        name = kernel.lower()
        if "nccl" in name:
            found["nccl_s"] += device_s
            if "sendrecv" in name or "alltoall" in name:
                found["alltoall_s"] += device_s
        elif e2e.kernel_class(kernel) == "attention":
            found["attention_s"] += device_s
    return found


def pipeline_groups(heads_per_gpu: int, given: int | None = None) -> int:
    """The groups of heads the pipelined mode exchanges a GPU's heads in: `given`, or the most up to 4 that divide
    them."""
    return given or max(g for g in range(1, 5) if heads_per_gpu % g == 0)


def mode_balance(balanced: bool, pipelined: bool, heads: int, balance_for: int, given: int | None = None
                 ) -> tuple[int, int]:
    """(the groups of heads the mode's plan is balanced over, the groups each GPU's exchange is pipelined over):
    the balanced mode's plan over `balance_for` GPUs, the pipelined mode's over `balance_for` x G groups, the rest
    as calibrated. The same on one GPU as on N, so that `--check` compares each mode with the same plan on one GPU
    (where the pipelined mode has no exchange to pipeline and runs its N x G-balanced plan directly)."""
    groups = pipeline_groups(heads // balance_for, given) if pipelined else 1
    return (balance_for * groups if balanced else 1), groups


def mode_plan(label: str, density: float, plans: dict, transformer, layout, block, args) -> Plan:
    """The synthetic plan of `density` (built once per density for every N: building a full-size one takes seconds)."""
    if density not in plans:
        plans[density] = synthetic_plan(transformer, layout, density, block, args.head_spread)
    return copy.copy(plans[density])


def run_modes(transformer, inputs, layout, args, device, block, backend: str, gpus: int, outputs: dict | None,
              plans: dict, balance_for: int):
    """{mode: (row, output of the step)} of every mode at this parallelism; `outputs` given: compare with them.
    `plans`: the synthetic plan of each density, filled on first use; `balance_for`: the GPUs the balanced mode
    balances over (the run's N, on one GPU too)."""
    results = {}
    family = family_of(transformer)
    for label, density, qk, pv, balanced, pipelined in MODE_SPECS:
        if label not in args.modes:
            continue
        handle = None
        balance_ranks, groups = mode_balance(balanced, pipelined, transformer.config.num_attention_heads, balance_for,
                                             args.pipeline_groups)
        if density is not None:
            plan = mode_plan(label, density, plans, transformer, layout, block, args)
            plan.qk, plan.pv = qk, pv
            start = time.perf_counter()
            # one GPU has no exchange to pipeline: the same plan, its groups' attention in one call
            handle = apply(transformer, plan, backend=backend, resident=True, balance_ranks=balance_ranks,
                           exchange_groups=groups if gpus > 1 else 1)
            handle.processor.prepare(handle.binding, device)
            balance_s = time.perf_counter() - start if balanced else None
        elif gpus > 1 and family.ulysses_text == TEXT_WHOLE:  # the model's attention through PARO's exchange
            plan = mode_plan(label, 0.2, plans, transformer, layout, block, args)
            handle = apply(transformer, all_dense(plan), backend=backend, resident=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        seconds, _ = e2e.time_step(transformer, inputs, args.iters, device)
        row = {"mode": label, "gpus": gpus, "step_s": slowest(seconds, device, gpus)}
        if gpus > 1 and handle is not None:
            row["exchange_groups"] = groups
        if balanced:
            row["balance_s"] = balance_s
            row["balanced_for"] = balance_ranks
        if density is not None:
            from paroattn.plan.balance import rank_imbalance

            # in blocks, of the plan the processor runs: the slowest GPU's attention over the mean GPU's, minus one
            row["block_imbalance"] = float(rank_imbalance(handle.processor.plan, balance_for).max())
        if device.type == "cuda":
            row["peak_gib"] = slowest(torch.cuda.max_memory_allocated(device) / 2**30, device, gpus)
            if gpus > 1:
                profiled = profiled_step(transformer, inputs)
                row["nccl_share"] = slowest(profiled["nccl_s"] / profiled["step_s"], device, gpus)
                row["alltoall_share"] = slowest(profiled["alltoall_s"] / profiled["step_s"], device, gpus)
                row["attention_s_per_gpu"] = every(profiled["attention_s"], device, gpus)
        out = None
        if args.check or args.outputs:
            with torch.no_grad():
                out = transformer(**inputs)[0].float().cpu()
        if handle is not None:
            row["mask_gpu_mib"] = handle.stats().get("gpu_bytes", 0) / 2**20  # this process's masks
            handle.remove()
        if outputs is not None and out is not None and label in outputs:
            reference = outputs[label]
            error = (out - reference).abs().max()
            row["check_max_abs"] = float(error)
            row["check_rel"] = float(error / reference.abs().max().clamp_min(1e-12))
        results[label] = (row, out)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"  {label:30s} on {gpus} GPU(s): {row['step_s'] * 1000:8.1f} ms", flush=True)
    return results


def baseline_times(paths: list[Path], label: str) -> dict[str, float]:
    """{mode: one-GPU step seconds} of model `label` from results files: an N = 1 run's step times, or the one-GPU
    times that a run over several GPUs measured itself (`--check`, or no `--baseline`). The first file naming a mode
    wins."""
    times: dict[str, float] = {}
    for path in paths:
        data = json.loads(path.read_text())
        key = "step_s" if data["info"]["gpus"] == 1 else "step_s_1gpu"
        for row in data["rows"]:
            if row["model"] == label and key in row:
                times.setdefault(row["mode"], row[key])
    if BALANCED in times:  # files of runs that timed the pipelined mode's plan on one GPU as the balanced mode's
        times.setdefault(PIPELINED, times[BALANCED])
    return times


def output_path(directory: Path, label: str, mode: str, balance_for: int, groups: int = 1) -> Path:
    """Where the one-GPU output of (`label`, `mode`) is saved; a balanced plan depends on the GPUs (and, pipelined, the
    groups of each GPU's heads) it was balanced for, so its file names them."""
    name = f"{label}-{mode}" + (f"-for-{balance_for}" if mode == BALANCED else
                                f"-for-{balance_for}x{groups}" if mode == PIPELINED else "")
    return directory / ("".join(c if c.isalnum() or c in "-." else "_" for c in name) + ".pt")


def saved_outputs(directory: Path | None, label: str, modes, balance_for: int, groups: int = 1) -> dict | None:
    """{mode: output} saved by an N = 1 run with `--outputs` (modes without a file are left out), or None."""
    if directory is None:
        return None
    found = {}
    for mode in modes:
        if (path := output_path(directory, label, mode, balance_for, groups)).is_file():
            found[mode] = torch.load(path)
    return found


def bench_model(name: str, args, device, dtype, world: int, rank: int) -> list[dict]:
    label = MODELS[name][1] + (" (smoke)" if args.smoke else "")
    t0 = time.perf_counter()
    transformer, inputs = build(name, device, dtype, args.smoke, args.smoke_heads)
    family = family_of(transformer)
    layout = family.call_inputs(transformer, inputs).layout
    heads = transformer.config.num_attention_heads
    if problem := ulysses_problem(heads, world):
        raise SystemExit(f"{label}: {problem}")
    uneven = world > 1 and sequence_problem(layout, world, family.ulysses_text) is not None
    block = (16, 16) if args.smoke else (args.query_block, 64)
    backend = "torch" if device.type == "cpu" else "auto"
    if rank == 0:
        print(f"[{label}] built in {time.perf_counter() - t0:.1f} s: {heads} heads, {layout} ({layout.seq_len} tokens), "
              f"{world} GPU(s)" + (", chunks of unequal length (ulysses_anything)" if uneven else ""), flush=True)
    groups = mode_balance(True, True, heads, world, args.pipeline_groups)[1]  # the pipelined mode's
    given = baseline_times(args.baseline, label) if args.baseline else {}
    if args.baseline and (missing := sorted(args.modes - given.keys())):
        raise SystemExit(f"--baseline {' '.join(map(str, args.baseline))} lacks {label}'s modes {', '.join(missing)}: "
                         "run them on one GPU")
    one, plans = {}, {}
    if not given and (rank == 0 or world == 1):  # the one-GPU baseline, on rank 0 alone
        one = run_modes(transformer, inputs, layout, args, device, block, backend, 1, None, plans, world)
        if world == 1 and args.outputs:
            args.outputs.mkdir(parents=True, exist_ok=True)
            for mode, (_, out) in one.items():
                torch.save(out, output_path(args.outputs, label, mode, world, groups))
    if world > 1:
        dist.barrier()
        enable_ulysses(transformer, world, uneven=uneven)
        reference = None
        if rank == 0:
            reference = ({mode: out for mode, (_, out) in one.items()} if args.check
                         else saved_outputs(args.outputs, label, args.modes, world, groups))
        parallel = run_modes(transformer, inputs, layout, args, device, block, backend, world, reference, plans, world)
    else:
        parallel = one
    rows = []
    if rank != 0:
        return rows
    one_s = given or {mode: row["step_s"] for mode, (row, _) in one.items()}
    dense_n = parallel["dense"][0]["step_s"]
    for mode, (row, _) in parallel.items():
        row = {"model": label, "heads": heads, "tokens": layout.seq_len, "uneven": uneven, **row,
               "speedup_vs_dense": dense_n / row["step_s"], "step_s_1gpu": one_s[mode],
               "speedup_vs_dense_1gpu": one_s["dense"] / one_s[mode], "scaling": one_s[mode] / row["step_s"]}
        if "attention_s_per_gpu" in row and (times := row["attention_s_per_gpu"]) and sum(times) > 0:
            row["attention_imbalance"] = max(times) / (sum(times) / len(times)) - 1
        rows.append(row)
    del transformer, inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(paths: list[Path]) -> str:
    """Markdown: one table per results file, its environment above it."""
    parts = []
    for path in paths:
        data = json.loads(path.read_text())
        info, n = data["info"], data["info"]["gpus"]
        parts.append(f"`{path.name}`: {info['device']} x {n}, driver {info.get('driver', '?')}, torch {info['torch']}, "
                     f"triton {info.get('triton', '?')}, {info['date']}, {info['parallelism']}, plans of "
                     f"{info['block'][0]} x {info['block'][1]} blocks, head densities spread by "
                     f"{info.get('head_spread', 0)}\n")
        parts.append(f"| model (tokens) | mode | 1 GPU | {n} GPUs | vs dense on {n} | scaling 1 -> {n} | peak GiB per GPU "
                     f"| masks per GPU | NCCL share (all-to-all) | attention, slowest GPU vs mean (blocks) "
                     f"| output vs 1 GPU, max abs (rel) |")
        parts.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in data["rows"]:
            check = f"{r['check_max_abs']:.1e} ({r['check_rel']:.1e})" if "check_max_abs" in r else "-"
            peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
            share = (f"{r['nccl_share']:.0%} ({r.get('alltoall_share', float('nan')):.0%})" if "nccl_share" in r
                     else "-")
            masks = f"{r['mask_gpu_mib']:.0f} MiB" if r.get("mask_gpu_mib") else "-"
            balance = (f"{r['attention_imbalance']:+.1%}" if "attention_imbalance" in r else "-") + (
                f" ({r['block_imbalance']:+.1%})" if "block_imbalance" in r else "")
            model = f"{r['model']} ({r['tokens']}{', unequal chunks' if r.get('uneven') else ''})"
            mode = r["mode"] + (f" [{r['exchange_groups']} groups]" if r.get("exchange_groups", 1) > 1 else "")
            parts.append(f"| {model} | {mode} | {r['step_s_1gpu'] * 1000:.1f} ms | "
                         f"{r['step_s'] * 1000:.1f} ms | {r['speedup_vs_dense']:.2f}x | {r['scaling']:.2f}x "
                         f"({r['scaling'] / n:.0%}) | {peak} | {masks} | {share} | {balance} | {check} |")
        parts.append("")
    return "\n".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="wan-14b-720p,wan-1.3b", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated, of: " + ", ".join(MODES) + " (dense is always run)")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    parser.add_argument("--query-block", type=int, default=128, help="query block of the plans (key blocks are 64)")
    parser.add_argument("--head-spread", type=float, default=0.35,
                        help="sigma of the log-normal spread of the plans' per-head densities (0: all alike)")
    parser.add_argument("--pipeline-groups", type=int, default=None,
                        help="groups of heads each GPU's exchange is pipelined over in the pipelined mode (default: "
                             "the most up to 4 that divide a GPU's heads)")
    parser.add_argument("--check", action="store_true", help="also compare each mode under Ulysses N with one GPU")
    parser.add_argument("--baseline", type=Path, nargs="+", default=None,
                        help="results files with the one-GPU times of the same models and modes (N = 1 runs, or runs "
                             "that measured them with --check): those times are used")
    parser.add_argument("--outputs", type=Path, default=None,
                        help="N = 1: save each mode's output in this folder; N > 1: compare with the outputs saved there")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (written by rank 0)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU, torch backend: checks the script")
    parser.add_argument("--smoke-heads", type=int, default=None,
                        help="--smoke: heads of the shrunk model (default 2; 4 leaves 2 per GPU on 2 processes, so "
                             "the pipelined mode has groups to pipeline)")
    parser.add_argument("--table", metavar="JSON", nargs="+", type=Path,
                        help="print markdown tables of results files and exit (reads JSON only: no GPU)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return []
    args.modes = {"dense", *(m.strip() for m in args.modes.split(",") if m.strip())}
    if unknown := sorted(args.modes - set(MODES)):
        raise SystemExit(f"--modes {', '.join(unknown)}: expected some of {', '.join(MODES)}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := [m for m in models if m not in MODELS]:
        raise SystemExit(f"--models {', '.join(unknown)}: expected some of {', '.join(MODELS)}")
    if args.baseline is not None and args.check:
        raise SystemExit("--check compares with the one-GPU outputs of this run: leave --baseline out")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.baseline is not None and world == 1:
        raise SystemExit("--baseline gives the one-GPU times of a run over several GPUs: run this under torchrun")
    # torchrun sets OMP_NUM_THREADS=1, which makes building full-size plans on the host minutes long
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.smoke:
        if "--models" not in (argv if argv is not None else sys.argv):
            models = list(SMOKE_MODELS)
        if torch.accelerator.device_count() == 0:  # diffusers places processes on accelerator rank % count
            torch.accelerator.device_count = lambda: 1
    elif not torch.cuda.is_available():
        raise SystemExit("the multi-GPU benchmark needs CUDA GPUs (or --smoke for a CPU check of the script)")
    rank, device = 0, "cpu" if args.smoke else "cuda"
    if world > 1:
        rank, device = join_process_group(world, device)
    device = torch.device(device)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "gpus": world,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "head_spread": args.head_spread,
            "block": [16 if args.smoke else args.query_block, 16 if args.smoke else 64],
            "parallelism": f"diffusers ContextParallelConfig(ulysses_degree={world})" if world > 1 else "none",
            "pipeline_groups": args.pipeline_groups or "default"}
    if args.baseline is not None:
        info["baseline"] = [path.name for path in args.baseline]
    if device.type == "cuda":
        info.update(e2e.environment())
        import triton

        info["triton"] = triton.__version__
    if rank == 0:
        print(info, flush=True)
    rows = []
    for name in models:
        rows += bench_model(name, args, device, dtype, world, rank)
        if rank == 0 and args.out:
            args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    if rank == 0:
        check = "  max abs err   rel err" if any("check_max_abs" in r for r in rows) else ""
        print(f"\nmodel                   mode                           GPUs  step ms  vs dense  1-GPU ms  scaling"
              f"  peak GiB  NCCL  attn imbalance{check}")
        for r in rows:
            print(f"{r['model']:23s} {r['mode']:30s} {r['gpus']:4d} {r['step_s'] * 1000:8.1f}  "
                  f"{r['speedup_vs_dense']:7.2f}x  {r['step_s_1gpu'] * 1000:8.1f}  {r['scaling']:6.2f}x  "
                  f"{r.get('peak_gib', float('nan')):8.1f}  {r.get('nccl_share', float('nan')):4.0%}  "
                  f"{r.get('attention_imbalance', float('nan')):+13.1%}"
                  + (f"  {r['check_max_abs']:11.3e}  {r['check_rel']:8.2e}" if "check_max_abs" in r else ""))
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
