"""`paro`: the command line. Each command is a thin wrapper; the work lives in the modules it names."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="PAROAttention for diffusers video and image models.")


@app.callback()
def main() -> None:
    """PAROAttention for diffusers: calibrate a plan, inspect it, generate and benchmark with it."""


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


@app.command()
def inspect(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="plan file written by `paro calibrate`"),
    png: Path | None = typer.Option(None, "--png", help="also draw block maps and masks as PNGs into this folder"),
    heads: str = typer.Option("0:0,0:1", help="layer:head pairs to draw with --png"),
) -> None:
    """Print a readable summary of a plan."""
    from .errors import PlanError
    from .plan import Plan
    from .summary import describe_plan

    try:
        plan = Plan.load(plan_path)
    except PlanError as exc:
        _fail(str(exc))
    pairs = _parse_heads(heads)
    if png is not None:  # checked before anything is printed or drawn
        outside = [f"{layer}:{head}" for layer, head in pairs if layer >= plan.num_layers or head >= plan.num_heads]
        if outside:
            _fail(f"--heads {','.join(outside)} not in the plan ({plan.num_layers} layers x {plan.num_heads} heads): "
                  f"pass layer:head pairs with layer < {plan.num_layers} and head < {plan.num_heads}")
        from .pipelines.generate import folder_problem

        if problem := folder_problem(png, "--png folder"):
            _fail(problem)
    typer.echo(describe_plan(plan, size_on_disk=plan_path.stat().st_size))
    if png is not None:
        from .calibrate.figures import draw_plan_heads

        for path in draw_plan_heads(plan, pairs, png, plan_path=plan_path):
            typer.echo(f"wrote {path}")


def _parse_heads(text: str) -> list[tuple[int, int]]:
    """`--heads 0:0,3:1` -> [(0, 0), (3, 1)]; exits with the expected form on anything else."""
    pairs = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
            _fail(f"--heads {text!r}: expected comma-separated layer:head pairs of non-negative integers, "
                  "e.g. --heads 0:0,0:1")
        pairs.append((int(parts[0]), int(parts[1])))
    return pairs


@app.command()
def calibrate(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR", help="diffusers pipeline folder of a supported model"),
    out: Path = typer.Option(..., "--out", help="plan file to write; block statistics go beside it (.stats.safetensors)"),
    prompts: Path | None = typer.Option(None, help="calibration prompts, one per line (default: video.txt or image.txt of paroattn/assets/prompts/, installed with the package)"),
    num_prompts: int = typer.Option(2, help="use the first N prompts of the file (the paper finds 1-2 enough)"),
    density: float = typer.Option(0.3, help="target mean block density of the masks"),
    qk: str = typer.Option("bf16", help="QK precision the plan asks for: bf16, int8, int4"),
    pv: str = typer.Option("bf16", help="PV precision the plan asks for: bf16, fp8, int8"),
    height: int | None = typer.Option(None, help="generation height in pixels (default: the pipeline's)"),
    width: int | None = typer.Option(None, help="generation width in pixels (default: the pipeline's)"),
    frames: int | None = typer.Option(None, help="frames of a video generation (default: the pipeline's)"),
    steps: int = typer.Option(50, help="denoising steps of each calibration run"),
    buckets: int = typer.Option(6, help="timestep buckets: timesteps above 500 split into N-1, one shared by the rest"),
    bucket_edges: str | None = typer.Option(None, help="explicit descending edges on 0..1000, e.g. '1000,800,500,0' (overrides --buckets)"),
    stat_every: int = typer.Option(2, help="capture statistics at every k-th step (the pipeline still runs every step)"),
    metric: str = typer.Option("mass", help="order metric: mass (kept attention mass, default) or paper"),
    quant_weight: float = typer.Option(0.0, help="weight of the incoherence (max/mean) term in the mass metric"),
    block_size: int = typer.Option(64, help="block size of the masks"),
    query_block: int | None = typer.Option(None, help="query block of the masks, a multiple of --block-size (128 with 64: the fastest kernels at head dim 128; default: --block-size)"),
    figure_layers: str | None = typer.Option(None, help="layers whose block maps are saved for `paro inspect --png` (default: first, middle, last)"),
    dense_layers: str | None = typer.Option(None, help="layers run densely, paid for out of the same budget, e.g. '0,-1' (negative: from the end); off by default: on the demo model it cost 5-6 dB at d=0.2 (QUALITY.md)"),
    layer_floor: float = typer.Option(0.0, help="share of --density every layer gets before the global competition, 0..1; off by default (0): +0.35 dB at d=0.2, -0.2 dB at d=0.1 on the demo model (QUALITY.md)"),
    dilation: int = typer.Option(0, help="grow each mask's chosen blocks by N blocks; off by default (0): cost 5.2-6.2 dB at the same density on the demo model (QUALITY.md)"),
    dense_steps: float = typer.Option(0.0, help="share of the denoising steps, from the first (noisiest), whose buckets run densely, paid for by the later buckets so that --density stays the mean over steps, e.g. 0.2; 0 (the default) turns it off"),
    shared_budget: bool = typer.Option(False, "--shared-budget", help="one block budget over all timestep buckets (a bucket's blocks cost by its share of the steps) instead of one per bucket"),
    seed: int = typer.Option(0, help="seed of the calibration runs"),
    device: str | None = typer.Option(None, help="cuda or cpu (default: cuda when present)"),
    dtype: str | None = typer.Option(None, help="model dtype (default: bfloat16 on cuda, float32 on cpu)"),
) -> None:
    """Calibrate a plan: run the dense model on a few prompts, choose each head's order and the block masks.
    Runs on one GPU; the plan it writes also serves generations split over several (`paro generate --ulysses N`)."""
    from .calibrate.driver import (
        CalibrationConfig,
        calibrate_experts,
        default_prompts_file,
        describe_result,
        read_prompts,
        save_expert_calibrations,
    )
    from .pipelines import family_of, pipeline_experts, resolve_transformer
    from .pipelines.generate import folder_problem, load_pipeline, pipeline_folder_problem
    from .pipelines.registry import SUPPORTED
    from .summary import describe_plan

    # the model folder and the output path are checked before anything loads
    if problem := pipeline_folder_problem(model_dir):
        _fail(problem)
    if out.is_dir():
        _fail(f"--out {out} is a folder: pass a plan file path such as {out / 'plan.safetensors'}")
    if problem := folder_problem(out.parent, "--out folder", keep=False):
        _fail(problem)

    layers_to_keep_dense = _parse_layers(dense_layers, "--dense-layers") if dense_layers else []
    if not 0.0 <= layer_floor <= 1.0:
        _fail(f"--layer-floor {layer_floor}: expected a share of --density in [0, 1] (0, the default, turns it off)")
    if dilation < 0:
        _fail(f"--dilation {dilation}: expected a number of blocks >= 0 (0, the default, turns it off)")
    if not 0.0 <= dense_steps < 1.0:
        _fail(f"--dense-steps {dense_steps}: expected a share of the denoising steps in [0, 1) (0, the default, "
              "turns it off)")
    if dense_steps >= density and density < 1.0:
        _fail(f"--dense-steps {dense_steps} spends all of --density {density} (the mean density over steps) on the "
              "dense steps: lower --dense-steps or raise --density")
    try:
        config = CalibrationConfig(
            density=density, qk=qk, pv=pv, block_size=block_size, query_block=query_block, steps=steps, height=height, width=width,
            frames=frames, num_buckets=buckets, stat_every=stat_every, metric=metric, seed=seed, quant_weight=quant_weight,
            bucket_edges=[float(x) for x in bucket_edges.split(",")] if bucket_edges else None,
            figure_layers=[int(x) for x in figure_layers.split(",")] if figure_layers else None,
            dense_layers=layers_to_keep_dense, layer_floor=layer_floor, dilation=dilation,
            dense_steps=dense_steps, shared_budget=shared_budget,
        )
        config.validate()
    except ValueError as exc:
        _fail(str(exc))
    try:
        pipe = load_pipeline(model_dir, device=device, dtype=dtype)
    except (ValueError, OSError) as exc:
        _fail(str(exc).splitlines()[0] if str(exc) else f"{model_dir} could not be loaded as a diffusers pipeline")
    pipe.set_progress_bar_config(disable=True)  # calibration shows its own bars
    family = family_of(resolve_transformer(pipe))
    if family is None:
        _fail(f"{model_dir} holds a {type(resolve_transformer(pipe)).__name__}; paro calibrate supports {SUPPORTED}")
    if layers_to_keep_dense:  # the first point the layer count is known; before any capture
        from .calibrate.selection import dense_layer_indices
        from .pipelines import self_attention_layers

        num_layers = len(self_attention_layers(resolve_transformer(pipe)))
        try:
            dense_layer_indices(layers_to_keep_dense, num_layers)
        except ValueError:
            _fail(f"--dense-layers {dense_layers}: {model_dir} has {num_layers} attention layers; pass indices in "
                  f"0..{num_layers - 1} (or -{num_layers}..-1 from the end)")
    try:
        prompt_list = read_prompts(prompts or default_prompts_file(family.is_video), num_prompts)
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    experts = [name for name, _ in pipeline_experts(pipe)]
    what = type(resolve_transformer(pipe)).__name__ + (f" ({' and '.join(experts)})" if len(experts) > 1 else "")
    typer.echo(f"calibrating {what} on {len(prompt_list)} prompts, {steps} steps")
    try:
        calibrations = calibrate_experts(pipe, prompt_list, config, progress=True, log=typer.echo)
    except ValueError as exc:  # a budget the capture shows cannot be met (dense buckets holding more steps)
        _fail(str(exc))
    for (plan, result), (plan_path, stats_path) in zip(calibrations, save_expert_calibrations(calibrations, out)):
        if len(calibrations) > 1:
            typer.echo(f"-- expert {plan.expert}")
        typer.echo(describe_plan(plan, size_on_disk=plan_path.stat().st_size))
        typer.echo(describe_result(plan, result))
        typer.echo(f"wrote {plan_path} and {stats_path}")


def _parse_layers(text: str, option: str) -> list[int]:
    """`--dense-layers 0,-1` -> [0, -1]; exits with the expected form on anything else."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        _fail(f"{option} {text!r}: expected comma-separated layer indices (integers, negative from the end), "
              f"e.g. {option} 0,-1")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def bench(ctx: typer.Context) -> None:
    """Attention kernel benchmark on the GPU (paroattn/bench.py); every option passes through to it:
    `paro bench --help` lists them (--shapes, --densities, --modes, --sweep, --rope, --graph, --out,
    --table RESULTS.json [--summary] without a GPU, ...)."""
    import sys

    import torch

    args = list(ctx.args)
    if args[:1] == ["--"]:
        args = args[1:]
    if not torch.cuda.is_available() and "--table" not in args and "--help" not in args and "-h" not in args:
        _fail("paro bench needs a CUDA GPU; this machine has none (--table RESULTS.json prints saved results without one)")
    from .bench import main as run_benchmark

    program, sys.argv[0] = sys.argv[0], "paro bench"  # argparse names itself after argv[0] in its usage line
    try:
        run_benchmark(args)
    finally:
        sys.argv[0] = program


@app.command()
def generate(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR", help="local diffusers pipeline folder of a CogVideoX, Wan 2.1 / 2.2 or FLUX.1 model"),
    prompt: str = typer.Option(..., "--prompt", help="text prompt"),
    plan: Path | None = typer.Option(None, "--plan", help="plan file from `paro calibrate`; an expert pair's other plan is read from beside it (default: dense, the model's own attention)"),
    height: int | None = typer.Option(None, help="height in pixels (default: the pipeline's)"),
    width: int | None = typer.Option(None, help="width in pixels (default: the pipeline's)"),
    frames: int | None = typer.Option(None, help="frames of a video (default: the pipeline's)"),
    steps: int | None = typer.Option(None, help="denoising steps (default: the pipeline's)"),
    seed: int = typer.Option(0, help="seed of the initial noise"),
    out: Path | None = typer.Option(None, "--out", help="output file: .mp4 or .gif for video, .png or .jpg for images (default: out.mp4 / out.png)"),
    compare: bool = typer.Option(False, "--compare", help="also generate dense with the same seed; report PSNR, SSIM, cosine and both times"),
    backend: str = typer.Option("auto", help="attention backend of PARO layers: auto, triton or torch"),
    on_mismatch: str = typer.Option("error", help="when the plan does not fit: error, or dense (warn and run the model's own attention)"),
    ulysses: int = typer.Option(1, help="split each generation over N GPUs (Wan, FLUX; heads per GPU under diffusers' Ulysses context parallelism): launch with `torchrun --nproc-per-node N --no-python paro generate ... --ulysses N`; rank 0 writes the outputs"),
    device: str | None = typer.Option(None, help="cuda or cpu (default: cuda when present)"),
    dtype: str | None = typer.Option(None, help="model dtype (default: bfloat16 on cuda, float32 on cpu)"),
) -> None:
    """Generate a video or image, with a plan (PARO) or without (dense); --compare runs both."""
    import torch.distributed as dist

    from .errors import PlanError
    from .pipelines.generate import generate as run_generate

    try:
        result = run_generate(
            model_dir, prompt, plan=plan, height=height, width=width, frames=frames, steps=steps, seed=seed,
            out=out, compare=compare, device=device, dtype=dtype, backend=backend, on_mismatch=on_mismatch,
            ulysses=ulysses, log=typer.echo,
        )
    except (PlanError, ValueError, OSError) as exc:
        _fail(str(exc))
    finally:
        if ulysses > 1 and dist.is_initialized():
            dist.destroy_process_group()
    if "rank" in result:  # another process of a --ulysses run: rank 0 reports
        return
    if "dense_path" in result:
        typer.echo(f"dense: {result['dense_s']:.2f} s -> {result['dense_path']}")
    if "paro_s" in result and result.get("ran_dense"):
        typer.echo(f"dense (the plan did not fit, --on-mismatch dense): {result['paro_s']:.2f} s -> {result['path']}")
    elif "paro_s" in result:
        typer.echo(f"PARO: {result['paro_s']:.2f} s -> {result['path']}")
    else:
        typer.echo(f"dense: {result['dense_s']:.2f} s -> {result['path']}")
    if result.get("masks"):
        masks = result["masks"]
        parts = [masks] if "gpu_bytes" in masks else [m for m in masks.values() if m]  # an expert pair: by expert
        gpu, host = (sum(m.get(key, 0) for m in parts) for key in ("gpu_bytes", "host_bytes"))
        typer.echo(f"masks: {gpu / 2**20:.1f} MiB on the device, {host / 2**20:.1f} MiB on the host")
    if compare and result.get("ran_dense"):
        typer.echo("no PARO vs dense comparison: both runs used the model's own attention")
    elif compare:
        typer.echo(
            f"PARO vs dense: PSNR {result['psnr_db']:.2f} dB, SSIM {result['ssim']:.4f}, cosine {result['cosine']:.5f}, "
            f"speedup {result['speedup']:.2f}x"
        )


@app.command()
def demo(
    out_dir: Path = typer.Option(Path("paro-demo"), "--out-dir", help="folder for demo.gif, attention PNGs and metrics.json"),
    density: float = typer.Option(0.5, help="block density of the plan (shipped: 0.5, 0.3, 0.2, 0.15, 0.1; others are "
                                            "calibrated); 0.5 is hard to tell from dense on this model (QUALITY.md)"),
    qk: str = typer.Option("bf16", "--qk", help="QK precision: bf16, int8 or int4"),
    pv: str = typer.Option("bf16", "--pv", help="PV precision: bf16, fp8 or int8"),
    steps: int = typer.Option(20, help="denoising steps"),
    num_prompts: int = typer.Option(2, help="how many of the demo prompts to generate (1-8)"),
    seed: int = typer.Option(0, help="seed of the initial noise"),
    backend: str = typer.Option("auto", help="attention backend of PARO layers: auto, triton or torch"),
    device: str | None = typer.Option(None, help="cuda or cpu (default: cuda when present)"),
) -> None:
    """Offline demo on the bundled demo model (a small trained Wan transformer): dense vs PARO
    on the same seeds, side-by-side GIF, attention maps and masks, PSNR / SSIM / cosine and times."""
    from .demo_model.demo import run_demo
    from .errors import PlanError

    try:  # run_demo checks the modes (paroattn.modes), density and prompt count before loading the model
        run_demo(out_dir, density=density, qk=qk, pv=pv, steps=steps, num_prompts=num_prompts, seed=seed, device=device,
                 backend=backend, log=typer.echo, progress=True)
    except (PlanError, ValueError, OSError) as exc:
        _fail(str(exc))


if __name__ == "__main__":
    app()
