"""Multi-GPU benchmark: one denoising step of a Wan transformer split over N GPUs with diffusers' Ulysses context
parallelism, dense vs PARO (each GPU runs its contiguous slice of the plan's heads over the whole sequence).

    torchrun --nproc-per-node N benchmarks/multi_gpu.py [--models wan-14b-720p,wan-1.3b] [--iters 3] --out RESULTS.json
    python benchmarks/multi_gpu.py --models wan-1.3b --out RESULTS.json     # N = 1: one GPU, no parallelism
    ... --check      # PARO under Ulysses N against PARO on one GPU, same plan and inputs: max abs and relative error
    ... --modes "dense,paro d=0.2 int8+fp8"    # a subset of the modes (dense is always run: the ratios divide by it)
    python benchmarks/multi_gpu.py --smoke [--out ...]    # tiny Wan on CPU (also under torchrun): checks the script
    python benchmarks/multi_gpu.py --table RESULTS.json ...   # markdown tables of results files (no GPU)

Models, built by `e2e.py` from the released configs with random bf16 weights (timing does not depend on them):
- wan-1.3b: Wan2.1-1.3B, 81 frames of 480x832, one CFG branch: 1 x 12 heads x 32760 tokens (N divides 12);
- wan-14b-720p: Wan2.1-14B, 81 frames of 720x1280: 1 x 40 heads x 75600 tokens (N divides 40).
Modes: `e2e.py`'s (dense SDPA; PARO d=0.5 and 0.2, bf16 or int8 QK + fp8 PV, synthetic plans with all masks resident).

N is WORLD_SIZE. With N > 1, rank 0 first runs every mode alone on its GPU (the one-GPU time the scaling column
divides by), then all N processes run it under `ContextParallelConfig(ulysses_degree=N)`; a step's time is the
slowest process's median. Columns: step time, speedup over dense at the same N, scaling (one-GPU time / N-GPU time),
peak GPU memory of the step (the largest over processes), and, under Ulysses, the share of the step spent in NCCL
kernels (one profiled step, the largest over processes; a rank waiting in an all-to-all for a slower one counts).
Weights and inputs are broadcast from rank 0, so every process computes the same step.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e  # noqa: E402

from paroattn.pipelines import apply, family_of  # noqa: E402
from paroattn.pipelines.context_parallel import enable_ulysses, join_process_group, ulysses_problem  # noqa: E402

# name -> (e2e config key, config overrides, latent [C, F, H, W], label)
MODELS = {
    "wan-1.3b": ("wan", {}, (16, 21, 60, 104), "Wan2.1-1.3B 480p"),
    "wan-14b-720p": ("wan-14b", {}, (16, 21, 90, 160), "Wan2.1-14B 720p"),
}
MODES = [mode[0] for mode in e2e.MODES]  # `e2e.py`'s modes by label, dense first
# Wan2.1-14B's released config: Wan2.1-1.3B's with 40 heads of 128, FFN 13824 and 40 layers
e2e.CONFIGS["wan-14b"] = ("WanTransformer3DModel", {**e2e.CONFIGS["wan"][1], "num_attention_heads": 40,
                                                     "ffn_dim": 13824, "num_layers": 40})


def build(name: str, device, dtype, smoke: bool):
    """(transformer, forward inputs) of `name`, identical on every process (broadcast from rank 0)."""
    key, _, latent, _ = MODELS[name]
    torch.manual_seed(0)
    transformer = e2e.build_transformer("wan" if smoke else key, device, dtype, smoke)
    inputs = e2e.step_inputs("wan", transformer, device, dtype, smoke)
    if not smoke:
        g = torch.Generator(device=device).manual_seed(1)
        inputs["hidden_states"] = torch.randn(1, *latent, generator=g, device=device, dtype=dtype)
    if dist.is_initialized():
        with torch.no_grad():
            for tensor in list(transformer.parameters()) + list(transformer.buffers()):
                dist.broadcast(tensor.data, 0)
            for value in inputs.values():
                if isinstance(value, torch.Tensor):
                    dist.broadcast(value, 0)
    return transformer, inputs


def slowest(seconds: float, device, gpus: int) -> float:
    """The largest of every process's `seconds` when `gpus` processes ran the step (rank 0 alone: its own)."""
    if gpus == 1:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def nccl_share(transformer, inputs) -> float:
    """Share of one step's wall time that this process's GPU spends in NCCL kernels (the all-to-alls)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        transformer(**inputs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    nccl_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages() if "nccl" in e.key.lower())
    return nccl_us / 1e6 / seconds


def run_modes(transformer, inputs, layout, args, device, block: int, backend: str, gpus: int, outputs: dict | None,
              plans: dict):
    """{mode: (seconds, output of the step)} of every mode at this parallelism; `outputs` given: compare with it.
    `plans`: the synthetic plan of each density, filled on first use."""
    results = {}
    for label, density, qk, pv in e2e.MODES:
        if label not in args.modes:
            continue
        handle = None
        if density is not None:
            if density not in plans:  # building a full-size plan takes seconds: one per density, for every N
                plans[density] = e2e.synthetic_plan(transformer, layout, density, "bf16", "bf16", block,
                                                    query_block=args.query_block)
            plan = copy.copy(plans[density])
            plan.qk, plan.pv = qk, pv
            handle = apply(transformer, plan, backend=backend, resident=True)
            handle.processor.prepare(handle.binding, device)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        seconds, _ = e2e.time_step(transformer, inputs, args.iters, device)
        row = {"mode": label, "gpus": gpus, "step_s": slowest(seconds, device, gpus)}
        if device.type == "cuda":
            row["peak_gib"] = slowest(torch.cuda.max_memory_allocated(device) / 2**30, device, gpus)
            if gpus > 1:
                row["nccl_share"] = slowest(nccl_share(transformer, inputs), device, gpus)
        out = None
        if args.check:
            with torch.no_grad():
                out = transformer(**inputs)[0].float().cpu()
        if handle is not None:
            row["mask_gpu_mib"] = handle.stats().get("gpu_bytes", 0) / 2**20  # this process's masks
            handle.remove()
        if outputs is not None and out is not None:
            reference = outputs[label]
            error = (out - reference).abs().max()
            row["check_max_abs"] = float(error)
            row["check_rel"] = float(error / reference.abs().max().clamp_min(1e-12))
        results[label] = (row, out)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"  {label:20s} on {gpus} GPU(s): {row['step_s'] * 1000:8.1f} ms", flush=True)
    return results


def bench_model(name: str, args, device, dtype, world: int, rank: int) -> list[dict]:
    label = MODELS[name][3] if not args.smoke else "tiny Wan (smoke)"
    t0 = time.perf_counter()
    transformer, inputs = build(name, device, dtype, args.smoke)
    layout = family_of(transformer).call_inputs(transformer, inputs).layout
    heads = transformer.config.num_attention_heads
    if problem := ulysses_problem(heads, world):
        raise SystemExit(f"{label}: {problem}")
    block = 16 if args.smoke else 64
    backend = "torch" if device.type == "cpu" else "auto"
    if rank == 0:
        print(f"[{label}] built in {time.perf_counter() - t0:.1f} s: {heads} heads, {layout} ({layout.seq_len} tokens), "
              f"{world} GPU(s)", flush=True)
    one, plans = {}, {}
    if rank == 0 or world == 1:  # the one-GPU baseline, on rank 0 alone
        one = run_modes(transformer, inputs, layout, args, device, block, backend, 1, None, plans)
    if world > 1:
        dist.barrier()
        enable_ulysses(transformer, world)
        reference = {mode: out for mode, (_, out) in one.items()} if args.check and rank == 0 else None
        parallel = run_modes(transformer, inputs, layout, args, device, block, backend, world, reference, plans)
    else:
        parallel = one
    rows = []
    if rank != 0:
        return rows
    dense_one, dense_n = one["dense"][0]["step_s"], parallel["dense"][0]["step_s"]
    for mode, (row, _) in parallel.items():
        row = {"model": label, "heads": heads, "tokens": layout.seq_len, **row,
               "speedup_vs_dense": dense_n / row["step_s"],
               "step_s_1gpu": one[mode][0]["step_s"], "speedup_vs_dense_1gpu": dense_one / one[mode][0]["step_s"],
               "scaling": one[mode][0]["step_s"] / row["step_s"]}
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
                     f"{info['block'][0]} x {info['block'][1]} blocks\n")
        parts.append(f"| model (tokens) | mode | 1 GPU | {n} GPUs | vs dense on {n} | scaling 1 -> {n} | peak GiB per GPU "
                     f"| masks per GPU | NCCL share | output vs 1 GPU, max abs (rel) |")
        parts.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in data["rows"]:
            check = f"{r['check_max_abs']:.1e} ({r['check_rel']:.1e})" if "check_max_abs" in r else "-"
            peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
            share = f"{r['nccl_share']:.0%}" if "nccl_share" in r else "-"
            masks = f"{r['mask_gpu_mib']:.0f} MiB" if r.get("mask_gpu_mib") else "-"
            parts.append(f"| {r['model']} ({r['tokens']}) | {r['mode']} | {r['step_s_1gpu'] * 1000:.1f} ms | "
                         f"{r['step_s'] * 1000:.1f} ms | {r['speedup_vs_dense']:.2f}x | {r['scaling']:.2f}x "
                         f"({r['scaling'] / n:.0%}) | {peak} | {masks} | {share} | {check} |")
        parts.append("")
    return "\n".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="wan-14b-720p,wan-1.3b", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated, of: " + ", ".join(MODES) + " (dense is always run)")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    parser.add_argument("--query-block", type=int, default=128, help="query block of the plans (key blocks are 64)")
    parser.add_argument("--check", action="store_true", help="also compare each mode under Ulysses N with one GPU")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (written by rank 0)")
    parser.add_argument("--smoke", action="store_true", help="tiny Wan on CPU, torch backend: checks the script")
    parser.add_argument("--table", metavar="JSON", nargs="+", type=Path,
                        help="print markdown tables of results files and exit (reads JSON only: no GPU)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return []
    args.modes = {"dense", *(m.strip() for m in args.modes.split(",") if m.strip())}
    if unknown := sorted(args.modes - set(MODES)):
        raise SystemExit(f"--modes {', '.join(unknown)}: expected some of {', '.join(MODES)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # torchrun sets OMP_NUM_THREADS=1, which makes building full-size plans on the host minutes long
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.smoke:
        args.query_block = None
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
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "block": [args.query_block or (16 if args.smoke else 64), 16 if args.smoke else 64],
            "parallelism": f"diffusers ContextParallelConfig(ulysses_degree={world})" if world > 1 else "none"}
    if device.type == "cuda":
        info.update(e2e.environment())
        import triton

        info["triton"] = triton.__version__
    if rank == 0:
        print(info, flush=True)
    rows = []
    for name in (["wan-1.3b"] if args.smoke else args.models.split(",")):
        if name not in MODELS:
            raise SystemExit(f"--models {name}: expected one of {', '.join(MODELS)}")
        rows += bench_model(name, args, device, dtype, world, rank)
        if rank == 0 and args.out:
            args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    if rank == 0:
        check = "  max abs err   rel err" if args.check else ""
        print(f"\nmodel              mode                 GPUs  step ms  vs dense  1-GPU ms  scaling  peak GiB  NCCL{check}")
        for r in rows:
            print(f"{r['model']:18s} {r['mode']:20s} {r['gpus']:4d} {r['step_s'] * 1000:8.1f}  {r['speedup_vs_dense']:7.2f}x"
                  f"  {r['step_s_1gpu'] * 1000:8.1f}  {r['scaling']:6.2f}x  {r.get('peak_gib', float('nan')):8.1f}"
                  f"  {r.get('nccl_share', float('nan')):4.0%}"
                  + (f"  {r['check_max_abs']:11.3e}  {r['check_rel']:8.2e}" if "check_max_abs" in r else ""))
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
