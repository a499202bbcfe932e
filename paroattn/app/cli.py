"""`paro`: the command line. Each command is a thin wrapper; the work lives in the modules it names.

Every command checks its options and paths before it loads a model or writes a file; a bad one ends the
command with one line on stderr that names the option and what to pass, and exit code 2."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import typer
from typer.core import TyperCommand

from ..pipelines.registry import SUPPORTED_MODELS
from .bench import DENSITIES, MODEL_SHAPES, MODES, SHAPES
from .options import MAX_FRAMES, MAX_PIXELS

# click's UsageError as the installed typer raises it (newer typer releases vendor their own click)
_UsageError = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "UsageError")


class _Command(TyperCommand):
    """A command whose usage line names required arguments plainly (MODEL_DIR, not typer's {MODEL_DIR}) and
    that reports a malformed command line (a missing or unknown option, a value of the wrong type) in one
    line, as its own checks do."""

    def collect_usage_pieces(self, ctx):
        return [piece[1:-1] if piece.startswith("{") and piece.endswith("}") else piece
                for piece in super().collect_usage_pieces(ctx)]

    def parse_args(self, ctx, args):
        if problem := self.empty_value(args):
            _fail(f"{problem} (`paro {self.name} --help` lists the options)")
        typed = list(args)  # click's parser consumes `args`
        try:
            return super().parse_args(ctx, args)
        except _UsageError as exc:
            _fail(f"{self.bad_value(exc, typed) or exc.format_message()} (`paro {self.name} --help` lists the options)")

    @staticmethod
    def bad_value(exc, args: list[str]) -> str | None:
        """A value click could not convert, as `--flag 'value': expected ...` with the flag and value as typed;
        None for other usage errors (a missing or unknown option)."""
        param = getattr(exc, "param", None)
        if param is None or getattr(param, "param_type_name", None) != "option":
            return None
        typed = None  # the last value given (click keeps the last)
        for i, item in enumerate(args):
            flag, sep, value = item.partition("=")
            if sep and flag in param.opts:
                typed = flag, value
            elif item in param.opts and i + 1 < len(args):
                typed = item, args[i + 1]
        return None if typed is None else f"{typed[0]} {typed[1]!r}: expected {_describe(param)}"

    def empty_value(self, args: list[str]) -> str | None:
        """Why the command line gives an option or argument an empty value (`--out ''`, `--out=`, `''`), naming it
        as typed, or None. Checked before click converts it: an empty path would read as the current folder."""
        takes_value = {opt: param for param in self.params if not getattr(param, "is_flag", True)
                       for opt in getattr(param, "opts", [])}
        arguments = [param for param in self.params if param.param_type_name == "argument"]
        position = 0
        items = iter(args)
        for item in items:
            if item == "--":
                break
            flag, sep, value = item.partition("=")
            if item.startswith("-") and sep and flag in takes_value:
                if not value.strip():
                    return f"{flag} is empty; expected {_describe(takes_value[flag])}"
            elif item in takes_value:
                value = next(items, None)
                if value is not None and not value.strip():
                    return f"{item} is empty; expected {_describe(takes_value[item])}"
            elif not item.startswith("-") or item == "-":
                if not item.strip() and position < len(arguments):
                    argument = arguments[position]
                    name = getattr(argument, "metavar", None) or argument.name.upper()
                    return f"{name} is empty; expected {_describe(argument)}"
                position += 1
        return None

    def invoke(self, ctx):
        # a warning from the libraries a command runs reads as one line, like the command's own messages
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return super().invoke(ctx)


def _describe(param) -> str:
    """What a parameter takes, for a message: a number or an integer, else its help up to the first semicolon."""
    # click parameters name their type; the installed typer's keep the annotation instead
    name = getattr(getattr(param, "type", None), "name", None)
    if name is None:
        name = {int: "integer", float: "float"}.get(getattr(getattr(param, "type_descriptor", None), "annotation", None))
    kind = {"integer": "an integer", "float": "a number"}.get(name)
    return kind or (getattr(param, "help", None) or "").split(";")[0].strip() or "a value"


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    import sys

    from tqdm import tqdm

    # through tqdm, so that a pipeline's step bar is redrawn below the line instead of running into it
    text = "warning: " + " ".join(str(message).split())
    tqdm.write(typer.style(text, fg=typer.colors.YELLOW) if sys.stderr.isatty() else text, file=sys.stderr)


# plain click help (rich_markup_mode=None): no <bool> type column beside flags, no boxes; -h as well as --help
app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        from .. import __version__

        try:
            installed = version("paroattn")
        except PackageNotFoundError:
            installed = __version__
        typer.echo(f"paroattn {installed}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """PAROAttention for diffusers video and image models: calibrate a plan, inspect it, generate and
    benchmark with it.

    GPU: `paro bench` needs a CUDA GPU (except --table); `paro calibrate` and `paro generate` also run on
    the CPU, which is practical for small models only; `paro demo` and `paro inspect` run anywhere."""


def _fail(message: str) -> None:
    """End the command: `message` as one line on stderr, exit code 2."""
    typer.secho("error: " + " ".join(str(message).split()), fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _check(problem: str | None) -> None:
    if problem:
        _fail(problem)


@app.command(cls=_Command, short_help="Print a readable summary of a plan (and draw its masks with --png).")
def inspect(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="plan file written by `paro calibrate`"),
    png: Path | None = typer.Option(None, "--png", help="also draw block maps and masks as PNGs into this folder (the block maps come from the plan's stats file, read only from the plan's folder)"),
    heads: str | None = typer.Option(None, help="layer:head pairs to draw with --png (default: 0:0,0:1, those of them the plan has)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="with --png: replace PNGs of an earlier run in that folder (default: refuse)"),
) -> None:
    """Print a readable summary of a plan."""
    from ..errors import PlanError
    from ..plan import Plan
    from ..plan.summary import describe_plan

    if png is None and (heads is not None or overwrite):
        _fail(f"{'--heads' if heads is not None else '--overwrite'} goes with --png (the heads it draws, the folder it "
              "writes): pass --png DIR too, or leave it out")
    pairs = _parse_heads(heads) if heads is not None else None
    try:
        plan = Plan.load(plan_path)
    except PlanError as exc:
        _fail(str(exc))
    if png is not None:  # checked before anything is printed or drawn
        if pairs is None:
            pairs = [(0, head) for head in (0, 1) if head < plan.num_heads]
        outside = [f"{layer}:{head}" for layer, head in pairs if layer >= plan.num_layers or head >= plan.num_heads]
        if outside:
            _fail(f"--heads {','.join(outside)} not in the plan ({plan.num_layers} layers x {plan.num_heads} heads): "
                  f"pass layer:head pairs with layer < {plan.num_layers} and head < {plan.num_heads}")
        from ..calibrate.figures import head_picture_path
        from .options import folder_problem, replace_problem

        if png.exists() and not overwrite:
            _check(replace_problem([head_picture_path(png, layer, head) for layer, head in pairs], "--png"))
        if problem := folder_problem(png, "--png folder"):
            _fail(problem)
    typer.echo(describe_plan(plan, size_on_disk=plan_path.stat().st_size))
    if png is not None:
        from ..calibrate.figures import draw_plan_heads

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


@app.command(cls=_Command, short_help="Calibrate a plan: each head's order and its block masks, from a few prompts.")
def calibrate(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR", show_default=False,
                                     help=f"local diffusers pipeline folder of a supported model ({SUPPORTED_MODELS})"),
    out: Path = typer.Option(..., "--out", help="plan file to write, ending in .safetensors; block statistics go beside it (.stats.safetensors)"),
    prompts: Path | None = typer.Option(None, help="calibration prompts, one per line (default: video.txt or image.txt of paroattn/assets/prompts/, installed with the package; for `paro demo-pipeline`'s folder, its prompts.txt)"),
    num_prompts: int = typer.Option(2, help="use the first N prompts of the file, N >= 1 (the paper finds 1-2 enough)"),
    density: float = typer.Option(0.3, help="target mean block density of the masks, in (0, 1]; what lower densities cost: QUALITY.md"),
    qk: str = typer.Option("bf16", help="QK precision the plan asks for: bf16, int8, int4"),
    pv: str = typer.Option("bf16", help="PV precision the plan asks for: bf16, fp8, int8"),
    height: int | None = typer.Option(None, help="generation height in pixels (default: the pipeline's)"),
    width: int | None = typer.Option(None, help="generation width in pixels (default: the pipeline's)"),
    frames: int | None = typer.Option(None, help="frames of a video generation (default: the pipeline's)"),
    sizes: str | None = typer.Option(None, help="calibrate several generation sizes into one plan, HEIGHTxWIDTHxFRAMES (HEIGHTxWIDTH for images) comma-separated, e.g. 480x832x81,720x1280x81 (instead of --height/--width/--frames); any size is served, other sizes derived from the closest calibrated one"),
    steps: int = typer.Option(50, help="denoising steps of each calibration run, >= 1"),
    buckets: int | None = typer.Option(None, help="timestep buckets, 1 to 100 (default: 6): timesteps above 500 split into N-1, one shared by the rest"),
    bucket_edges: str | None = typer.Option(None, help="explicit descending edges from 1000 to 0, e.g. '1000,800,500,0' (instead of --buckets)"),
    stat_every: int | None = typer.Option(None, help="capture statistics at every k-th step, k >= 1 (the pipeline still runs every step; default: 1 with the cheap capture, which keeps at most 2 steps per timestep bucket, 2 with --full-capture)"),
    full_capture: bool = typer.Option(False, "--full-capture", help="capture every call, every query row and every order at every --stat-every-th step (about 3x the time and memory of the default cheap capture, whose plans measure as close to dense: QUALITY.md)"),
    metric: str = typer.Option("mass", help="how each head's order is chosen: mass (the order whose mask at --density keeps the most attention mass) or paper (the PAROAttention paper's score: the share of nearly empty blocks, weighed against incoherence)"),
    quant_weight: float = typer.Option(0.0, help="weight >= 0 of incoherence in the mass metric: a block's largest attention value over its mean, which makes it harder to quantize; 0 (the default) ignores it"),
    block_size: int = typer.Option(64, help="block size of the masks: a power of two >= 16"),
    query_block: int | None = typer.Option(None, help="query block of the masks, a power-of-two multiple of --block-size (128 with 64 runs the kernels' wider query tiles at head dim 128; default: --block-size)"),
    figure_layers: str | None = typer.Option(None, help="layers whose block maps are saved for `paro inspect --png`, e.g. '0,5' (default: first, middle, last)"),
    dense_layers: str | None = typer.Option(None, help="layers run densely, paid for out of the same budget, e.g. '0,-1' (negative: from the end); off by default (cost: QUALITY.md)"),
    layer_floor: float = typer.Option(0.0, help="share of --density every layer gets before the global competition, in [0, 1]; 0 (the default) turns it off (cost: QUALITY.md)"),
    dilation: int = typer.Option(0, help="grow each mask's chosen blocks by N >= 0 blocks; 0 (the default) turns it off (cost: QUALITY.md)"),
    dense_steps: float = typer.Option(0.0, help="share of the denoising steps, from the first (noisiest), whose buckets run densely, in [0, 1), paid for by the later buckets so that --density stays the mean over steps; 0 (the default) turns it off"),
    shared_budget: bool = typer.Option(False, "--shared-budget", help="one block budget over all timestep buckets (a bucket's blocks cost by its share of the steps) instead of one per bucket"),
    ulysses: int = typer.Option(1, help="balance the masks for generations split over N GPUs (`paro generate --ulysses N`): each layer's blocks spread evenly over the GPUs' slices of the heads, the budget unchanged; N divides the heads per layer; 1 (the default) leaves them as the budget chose them (docs/notes/multi-gpu.md)"),
    seed: int = typer.Option(0, help="seed of the calibration runs"),
    device: str | None = typer.Option(None, help="cuda, cuda:N or cpu (default: cuda when present)"),
    dtype: str | None = typer.Option(None, help="model dtype: bfloat16, float16 or float32 (default: bfloat16 on cuda, float32 on cpu)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing plan at --out and the files beside it (default: refuse)"),
) -> None:
    """Calibrate a plan: run the dense model on a few prompts, choose each head's order and the block masks.

    Runs on one GPU (or, slowly, the CPU); the plan it writes also serves generations split over several GPUs
    (`paro generate --ulysses N`). What each option costs in quality: QUALITY.md."""
    from ..calibrate.config import CHEAP, CaptureConfig, ConfigError, SelectionConfig
    from ..calibrate.driver import (
        calibrate_sizes,
        calibration_outputs,
        default_prompts_file,
        describe_result,
        read_prompts,
        save_expert_calibrations,
    )
    from ..demo_model.pipeline import PROMPTS_FILE, is_demo_pipeline, prompts_problem
    from ..modes import mode_flags_problem
    from ..pipelines import family_of, pipeline_experts, resolve_transformer
    from ..pipelines.registry import SUPPORTED
    from ..plan import bucket_edges_problem
    from ..plan.selection import METRICS
    from ..plan.summary import describe_plan
    from .generate import indexed_family, load_pipeline, pipeline_folder_problem, size_fit_problem
    from .options import (
        MAX_BLOCK,
        MAX_BUCKETS,
        MAX_DILATION,
        MAX_GPUS,
        MAX_PROMPTS,
        MAX_QUANT_WEIGHT,
        MAX_STEPS,
        device_problem,
        dtype_problem,
        folder_problem,
        range_problem,
        replace_problem,
        seed_problem,
        size_problem,
    )

    # every option, the model folder, the prompts file and the output path are checked before anything loads
    _check(pipeline_folder_problem(model_dir))
    if out.is_dir():
        _fail(f"--out {out} is a folder: pass a plan file path such as {out / 'plan.safetensors'}")
    if out.suffix.lower() != ".safetensors":
        _fail(f"--out {out}: paro calibrate writes a safetensors plan, not {out.suffix or 'a file without extension'}: "
              f"pass a path ending in .safetensors, e.g. --out {out.with_suffix('.safetensors').name}")
    if not overwrite:  # the plan and its stats file; an expert pair's other files are checked once they are known
        _check(replace_problem(calibration_outputs(out), "--out"))
    _check(folder_problem(out.parent, "--out folder", keep=False))
    _check(range_problem("--num-prompts", num_prompts, 1, MAX_PROMPTS, "prompts"))
    prompt_list = _read_prompts(read_prompts, prompts, num_prompts) if prompts is not None else None
    if not (0.0 < density <= 1.0):
        _fail(f"--density {density}: pass a mean block density in (0, 1] (1 keeps every block)")
    _check(mode_flags_problem(qk, pv))
    _check(size_problem(steps=steps, height=height, width=width, frames=frames))
    _check(range_problem("--buckets", buckets, 1, MAX_BUCKETS, "timestep buckets"))
    edges = None
    if bucket_edges is not None and buckets is not None:
        _fail("--buckets and --bucket-edges both choose the timestep buckets (the edges would win): pass one of them")
    if bucket_edges is not None:
        edges = _parse_numbers(bucket_edges, "--bucket-edges", "1000,800,500,0")
        if problem := bucket_edges_problem(edges):
            _fail(f"--bucket-edges {bucket_edges!r}: {problem.replace('bucket_edges', 'the edges', 1)}")
    if stat_every is not None:
        _check(range_problem("--stat-every", stat_every, 1, MAX_STEPS, "steps k", "1 captures every step"))
    if metric not in METRICS:
        _fail(f"--metric {metric!r} is not one of {', '.join(METRICS)}: pass one of them")
    if not (math.isfinite(quant_weight) and 0 <= quant_weight <= MAX_QUANT_WEIGHT):
        _fail(f"--quant-weight {quant_weight}: pass a weight from 0 to {MAX_QUANT_WEIGHT:g} (0, the default, turns "
              "the term off)")
    if not 16 <= block_size <= MAX_BLOCK or block_size & (block_size - 1):
        _fail(f"--block-size {block_size}: pass a power of two from 16 to {MAX_BLOCK}, e.g. 64")
    if query_block is not None and (query_block < block_size or query_block % block_size
                                    or query_block & (query_block - 1) or query_block > MAX_BLOCK):
        _fail(f"--query-block {query_block}: pass a power-of-two multiple of --block-size {block_size}, up to "
              f"{MAX_BLOCK}, e.g. {2 * block_size}")
    _check(range_problem("--dilation", dilation, 0, MAX_DILATION, "blocks", "0, the default, turns it off"))
    _check(range_problem("--ulysses", ulysses, 1, MAX_GPUS, "GPUs",
                         "1, the default, leaves the masks as the budget chose them"))
    layers_for_figures = _parse_layers(figure_layers, "--figure-layers", negative=False) if figure_layers else None
    layers_to_keep_dense = _parse_layers(dense_layers, "--dense-layers") if dense_layers else []
    size_list = _parse_sizes(sizes, height, width, frames) if sizes else None
    for size in size_list or [{"height": height, "width": width, "frames": frames}]:
        where = f"--sizes {sizes}: " if size_list else ""
        _check(size_fit_problem(model_dir, size["height"], size["width"], size.get("frames"), where))
    # the mask options are checked by SelectionConfig below (a ConfigError names the flag)
    _check(seed_problem(seed) or device_problem(device) or dtype_problem(dtype))
    indexed = indexed_family(model_dir)  # video or image, where model_index.json tells
    if frames is not None and indexed is not None and not indexed.is_video:
        _fail(f"--frames is for video models; {model_dir} holds an image model ({indexed.models}): leave --frames out")
    if prompt_list is None and is_demo_pipeline(model_dir) and (model_dir / PROMPTS_FILE).is_file():
        prompts = model_dir / PROMPTS_FILE  # the demo model's own calibration prompts, in its vocabulary
        prompt_list = _read_prompts(read_prompts, prompts, num_prompts)
    if prompt_list is None and indexed is not None:
        prompts = default_prompts_file(indexed.is_video)
        prompt_list = _read_prompts(read_prompts, prompts, num_prompts)
    if prompt_list is not None and (problem := prompts_problem(model_dir, prompt_list)):
        _fail(f"--prompts {prompts}: {problem}; pass a file of prompts in its words, e.g. {model_dir / PROMPTS_FILE}")
    capture_options = {} if full_capture else dict(CHEAP)  # the full capture: CaptureConfig's own defaults
    if stat_every is not None:
        capture_options["stat_every"] = stat_every
    try:
        capture_config = CaptureConfig(
            block_size=block_size, query_block=query_block, steps=steps, height=height, width=width, frames=frames,
            num_buckets=buckets or CaptureConfig.num_buckets, seed=seed, bucket_edges=edges, **capture_options,
        )
        selection = SelectionConfig(
            density=density, qk=qk, pv=pv, metric=metric, quant_weight=quant_weight, figure_layers=layers_for_figures,
            dense_layers=layers_to_keep_dense, layer_floor=layer_floor, dilation=dilation,
            dense_steps=dense_steps, shared_budget=shared_budget, ulysses=ulysses,
        )
    except ConfigError as exc:  # the option's flag, its value and what was expected
        flag = {"num_buckets": "--buckets", "qk/pv": "--qk/--pv"}.get(exc.option, "--" + exc.option.replace("_", "-"))
        _fail(f"{flag} {exc.value}: {exc.reason}")
    except ValueError as exc:
        _fail(str(exc))
    try:
        pipe = load_pipeline(model_dir, device=device, dtype=dtype)
    except (ValueError, OSError) as exc:
        _fail(str(exc).splitlines()[0] if str(exc) else f"{model_dir} could not be loaded as a diffusers pipeline")
    pipe.set_progress_bar_config(disable=True)  # calibration shows its own bars
    transformer = resolve_transformer(pipe)
    family = family_of(transformer)
    if family is None:
        _fail(f"{model_dir} holds a {type(transformer).__name__}; paro calibrate supports {SUPPORTED}")
    if frames is not None and not family.is_video:
        _fail(f"--frames is for video models; {type(transformer).__name__} makes images: leave --frames out")
    if layers_to_keep_dense or layers_for_figures:  # the first point the layer count is known; before any capture
        from ..pipelines import self_attention_layers
        from ..plan.selection import dense_layer_indices

        num_layers = len(self_attention_layers(transformer))
        try:
            dense_layer_indices(layers_to_keep_dense, num_layers)
        except ValueError:
            _fail(f"--dense-layers {dense_layers}: {model_dir} has {num_layers} attention layers; pass indices in "
                  f"0..{num_layers - 1} (or -{num_layers}..-1 from the end)")
        if outside := [layer for layer in layers_for_figures or [] if layer >= num_layers]:
            _fail(f"--figure-layers {figure_layers}: {model_dir} has {num_layers} attention layers, not layer "
                  f"{outside[0]}; pass indices in 0..{num_layers - 1}")
    if prompt_list is None:
        prompt_list = _read_prompts(read_prompts, default_prompts_file(family.is_video), num_prompts)
    experts = [name for name, _ in pipeline_experts(pipe)]
    if not overwrite:
        _check(replace_problem(calibration_outputs(out, experts), "--out"))
    what = type(transformer).__name__ + (f" ({' and '.join(experts)})" if len(experts) > 1 else "")
    typer.echo(f"calibrating {what} on {len(prompt_list)} prompts, {steps} steps")
    try:
        calibrations = calibrate_sizes(pipe, prompt_list, capture_config, selection, size_list, progress=True,
                                       log=typer.echo)
    except ValueError as exc:  # a budget the capture shows cannot be met (dense buckets holding more steps)
        _fail(str(exc))
    for (plan, result), (plan_path, stats_path) in zip(calibrations, save_expert_calibrations(calibrations, out)):
        if len(calibrations) > 1:
            typer.echo(f"-- expert {plan.expert}")
        typer.echo(describe_plan(plan, size_on_disk=plan_path.stat().st_size))
        typer.echo(describe_result(plan, result))
        typer.echo(f"wrote {plan_path} and {stats_path}")


def _parse_sizes(text: str, height, width, frames) -> list[dict]:
    """`--sizes 480x832x81,720x1280x81` -> [{height, width, frames}, ...]; exits with the expected form otherwise."""
    if height is not None or width is not None or frames is not None:
        _fail("--sizes names every calibrated size: drop --height, --width and --frames")
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) not in (2, 3) or not all(part.isdigit() and int(part) > 0 for part in parts):
            _fail(f"--sizes {text!r}: expected comma-separated HEIGHTxWIDTHxFRAMES (or HEIGHTxWIDTH for images) in "
                  "pixels and frames, e.g. --sizes 480x832x81,720x1280x81")
        size = dict(zip(("height", "width", "frames"), (int(p) for p in parts)))
        if max(size["height"], size["width"]) > MAX_PIXELS or size.get("frames", 1) > MAX_FRAMES:
            _fail(f"--sizes {text!r}: {item.strip()} is past what can run: pass heights and widths up to {MAX_PIXELS} "
                  f"pixels and up to {MAX_FRAMES} frames")
        out.append(size)
    return out


def _read_prompts(read_prompts, path: Path, limit: int) -> list[str]:
    """The first `limit` prompts of `path`; exits naming --prompts when the file cannot be read or is empty."""
    if path.is_dir():
        _fail(f"--prompts {path} is a folder: pass a text file with one prompt per line")
    if not path.is_file():
        _fail(f"--prompts {path} does not exist: pass a text file with one prompt per line")
    try:
        return read_prompts(path, limit)
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"--prompts {path} cannot be read ({getattr(exc, 'strerror', None) or exc}): pass a UTF-8 text file "
              "with one prompt per line")
    except ValueError as exc:
        _fail(f"--prompts {exc}")


def _parse_numbers(text: str, option: str, example: str) -> list[float]:
    """`--bucket-edges 1000,500,0` -> [1000.0, 500.0, 0.0]; exits with the expected form on anything else."""
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) for v in values):
        _fail(f"{option} {text!r}: expected comma-separated numbers, e.g. {option} {example}")
    return values


def _parse_layers(text: str, option: str, negative: bool = True) -> list[int]:
    """`--dense-layers 0,-1` -> [0, -1]; exits with the expected form on anything else."""
    try:
        layers = [int(item) for item in text.split(",")]
    except ValueError:
        layers = None
    if layers is None or (not negative and any(layer < 0 for layer in layers)):
        what = "integers, negative from the end" if negative else "integers >= 0"
        _fail(f"{option} {text!r}: expected comma-separated layer indices ({what}), "
              f"e.g. {option} {'0,-1' if negative else '0,5'}")
    return layers


@app.command(cls=_Command, short_help="Time the attention op against SDPA on this GPU (--table prints saved results).")
def bench(
    shapes: str | None = typer.Option(None, help=f"attention shapes to time, comma-separated, of {', '.join(SHAPES)} "
                                                 f"(default: {','.join(MODEL_SHAPES)}; with --table: all in the file)"),
    modes: str | None = typer.Option(None, help="qk+pv precision pairs, comma-separated, qk of bf16, int8, int4 and pv "
                                                f"of bf16, fp8, int8 (default: {','.join('+'.join(m) for m in MODES)}; "
                                                "with --table: all in the file)"),
    densities: str | None = typer.Option(None, help="block densities of the synthetic masks, in (0, 1], comma-separated "
                                                    f"(default: {','.join(map(str, DENSITIES))}; with --table: all "
                                                    "in the file)"),
    block_q: int | None = typer.Option(None, help="query block of the masks: 64 or 128 (default: 64)"),
    block_k: int | None = typer.Option(None, help="key block of the masks: 64 or 128 (default: 64)"),
    backend: str | None = typer.Option(None, help="attention backend of the op: auto, triton or cuda (the sm_90a kernels; default: auto)"),
    out: Path | None = typer.Option(None, "--out", help="results file to write, .json (default: "
                                    "paro-bench-<GPU>.json in this folder, numbered so that no earlier run is replaced)"),
    table: list[Path] | None = typer.Option(None, "--table", metavar="RESULTS.json",
                                            help="print the table of a saved results file and exit; needs no GPU "
                                                 "(repeat for several files)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out (default: refuse)"),
) -> None:
    """Attention benchmark: time paro_attention against SDPA (torch's default attention, cuDNN on Hopper GPUs) on
    this CUDA GPU at the attention shapes of video and image models, print the table and save it as JSON.

    Each paro row names the kernel that ran it. --table prints saved results (of paro bench, or of the source
    checkout's benchmarks/attention.py, which times more methods) on any machine."""
    import torch

    from .bench import read_results, run
    from .bench import table as results_table

    chosen = {option: _bench_list(option, text) for option, text in
              (("--shapes", shapes), ("--modes", modes), ("--densities", densities)) if text is not None}
    select = dict(shapes=chosen.get("--shapes"), modes=chosen.get("--modes"), densities=chosen.get("--densities"))
    if table:
        run_only = [flag for flag, value in (("--out", out), ("--block-q", block_q), ("--block-k", block_k),
                                             ("--backend", backend), ("--overwrite", overwrite or None))
                    if value is not None]
        if run_only:
            _fail(f"{run_only[0]} goes with a run, not with --table (which prints saved results): leave one out")
        loaded = []
        for path in table:
            try:
                loaded.append((path, read_results(path)))
            except ValueError as exc:
                _fail(f"--table {path} {exc}: pass a results JSON written by paro bench")
        for path, results in loaded:
            typer.echo(f"`{path.name}`: {results_table(results, **select)}\n")
        return
    block_q, block_k, backend = block_q or 64, block_k or 64, backend or "auto"
    for option, value in (("--block-q", block_q), ("--block-k", block_k)):
        if value not in (64, 128):
            _fail(f"{option} {value}: pass 64 or 128")
    if backend not in ("auto", "triton", "cuda"):
        _fail(f"--backend {backend!r} is not one of auto, triton, cuda: pass one of them")
    if out is not None:
        from .options import folder_problem, replace_problem

        if out.suffix != ".json" or out.is_dir():
            _fail(f"--out {out}: pass the path of a .json file to write, e.g. {out.with_suffix('.json').name}")
        if not overwrite:
            _check(replace_problem([out], "--out"))
        _check(folder_problem(out.parent, "--out folder", keep=False))
    if not torch.cuda.is_available():
        _fail("paro bench times kernels on a CUDA GPU and this machine has none: run it on a GPU machine, or pass "
              "--table RESULTS.json to print saved results")
    defaults = dict(shapes=MODEL_SHAPES, modes=MODES, densities=DENSITIES)
    results = run(**{key: value or defaults[key] for key, value in select.items()}, block=(block_q, block_k),
                  backend=backend, log=typer.echo)
    from .options import written_together

    out = out or _free_results_path(results["gpu"])
    with written_together(out) as (partial,):
        partial.write_text(json.dumps(results, indent=1))
    typer.echo(f"\n{results_table(results)}\n\nwrote {out}")


def _size(nbytes: int) -> str:
    """A byte count for a person: KiB under a MiB, MiB under a GiB, else GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def masks_line(masks: dict | None, device: str) -> str | None:
    """The mask memory `handle.stats()` reported, in words true on `device` (a CPU run has no device memory apart
    from the host's); None when it reported none."""
    if not masks:
        return None
    parts = [masks] if "gpu_bytes" in masks or "host_bytes" in masks else [m for m in masks.values()
                                                                           if isinstance(m, dict) and m]
    parts = [m for m in parts if "gpu_bytes" in m or "host_bytes" in m]  # an expert pair: by expert
    if not parts:
        return None
    gpu, host = (sum(int(m.get(key, 0)) for m in parts) for key in ("gpu_bytes", "host_bytes"))
    if not device.startswith("cuda"):
        return f"masks: {_size(gpu + host)} in memory (this run is on the CPU)"
    return f"masks: {_size(gpu)} on the GPU, {_size(host)} in host memory"


def _bench_list(option: str, text: str) -> list:
    """The items of `paro bench`'s --shapes, --modes or --densities; exits naming the option on a bad one."""
    from ..modes import PV_MODES, QK_MODES, modes_problem

    takes, example = {"--shapes": (f"shape names of {', '.join(SHAPES)}", "cogvideox-5b,flux.1-dev"),
                      "--modes": (f"qk+pv pairs (qk: {', '.join(QK_MODES)}; pv: {', '.join(PV_MODES)})",
                                  "bf16+bf16,int8+fp8"),
                      "--densities": ("densities in (0, 1]", "1.0,0.5")}[option]
    items = [item.strip() for item in text.split(",") if item.strip()]
    for item in items or [""]:
        pair = tuple(item.split("+"))
        if not (item in SHAPES if option == "--shapes" else len(pair) == 2 and not modes_problem(*pair)
                if option == "--modes" else _is_density(item)):
            _fail(f"{option} {text!r}: expected comma-separated {takes}" + (f", and {item!r} is not one" if item
                                                                           else "") + f"; e.g. {option} {example}")
    return [tuple(item.split("+")) for item in items] if option == "--modes" else \
        [float(item) for item in items] if option == "--densities" else items


def _is_density(text: str) -> bool:
    try:
        return 0.0 < float(text) <= 1.0
    except ValueError:
        return False


def _free_results_path(gpu: str) -> Path:
    """paro-bench-<gpu>.json in the current folder, numbered (-2, -3, ...) so that no earlier run is replaced."""
    import itertools
    import re

    stem = "paro-bench-" + re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return next(path for n in itertools.count(1) if not (path := Path(f"{stem}-{n}.json" if n > 1 else f"{stem}.json"))
                .exists())


@app.command(cls=_Command, short_help="Generate a video or image with a plan (PARO) or without (dense).")
def generate(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR", show_default=False,
                                     help=f"local diffusers pipeline folder of a supported model ({SUPPORTED_MODELS})"),
    prompt: str = typer.Option(..., "--prompt", help="text prompt"),
    plan: str | None = typer.Option(None, "--plan", help="plan file from `paro calibrate` (an expert pair's other plan is read from beside it), or auto: the plan cached for this model at --density, --qk and --pv, learnt by the first such run, which runs dense (cache: $PAROATTN_CACHE, else ~/.cache/paroattn; a file named auto: ./auto) (default: dense, the model's own attention)"),
    density: float | None = typer.Option(None, help="with --plan auto: the mean block density of the plan, in (0, 1] (default 0.3)"),
    qk: str = typer.Option("bf16", help="with --plan auto: how Q and K enter the score product: bf16, int8 or int4"),
    pv: str = typer.Option("bf16", help="with --plan auto: how P and V enter the output product: bf16, fp8 or int8"),
    height: int | None = typer.Option(None, help="height in pixels (default: the pipeline's)"),
    width: int | None = typer.Option(None, help="width in pixels (default: the pipeline's)"),
    frames: int | None = typer.Option(None, help="frames of a video (default: the pipeline's)"),
    steps: int | None = typer.Option(None, help="denoising steps, >= 1 (default: the pipeline's)"),
    seed: int = typer.Option(0, help="seed of the initial noise"),
    out: Path | None = typer.Option(None, "--out", help="output file: .mp4 or .gif for video, .png or .jpg for images (default: out.mp4 / out.png, or out-2.mp4, ... when it exists: a run never replaces an earlier one's)"),
    compare: bool = typer.Option(False, "--compare", help="also generate dense with the same seed; report PSNR, SSIM, cosine and both times"),
    backend: str = typer.Option("auto", help="attention backend of PARO layers: auto, triton, cuda (the sm_90a kernels) or torch"),
    on_mismatch: str = typer.Option("error", help="when the plan does not fit: error, or dense (warn and run the model's own attention)"),
    ulysses: int = typer.Option(1, help="split each generation over N GPUs (every supported model; heads per GPU under diffusers' Ulysses context parallelism): launch with `torchrun --nproc-per-node N --no-python paro generate ... --ulysses N`; rank 0 writes the outputs"),
    exchange_groups: int = typer.Option(1, help="with --ulysses: pipeline each GPU's exchange over G groups of its heads, so one group's attention runs while the others' exchanges are in flight; pays off on long sequences with a plan balanced per group (`paro calibrate --ulysses` GPUs x G) and costs on short ones: docs/notes/multi-gpu.md"),
    linear: str | None = typer.Option(None, "--linear", help="fp8: the transformer blocks' linear layers in fp8 too (torchao: `pip install paroattn[fp8]`; a GPU of sm_89 or newer; bfloat16 weights), with or without --plan"),
    compile_mode: str | None = typer.Option(None, "--compile", help="compile the transformer before each run (default: eager): blocks (each repeated block on its own, diffusers' regional compilation: the fastest to compile), whole (one graph) or graphs (one graph under CUDA graphs: for short steps such as FLUX.1-dev's); each run's time includes compiling"),
    device: str | None = typer.Option(None, help="cuda, cuda:N or cpu (default: cuda when present)"),
    dtype: str | None = typer.Option(None, help="model dtype: bfloat16, float16 or float32 (default: bfloat16 on cuda, float32 on cpu)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out (and, with --compare, its _dense twin); default: refuse"),
) -> None:
    """Generate a video or image, with a plan (PARO) or without (dense); --compare runs both.

    Runs where the model fits: a GPU for the real models (the CPU works for small ones, slowly); PARO's
    speed needs the Triton kernels, which need a CUDA GPU."""
    import torch.distributed as dist

    from ..errors import PlanError
    from .generate import generate as run_generate

    try:
        result = run_generate(
            model_dir, prompt, plan=plan if plan in (None, "auto") else Path(plan), density=density, qk=qk, pv=pv,
            height=height, width=width, frames=frames, steps=steps, seed=seed,
            out=out, compare=compare, device=device, dtype=dtype, backend=backend, on_mismatch=on_mismatch,
            ulysses=ulysses, exchange_groups=exchange_groups, linear=linear, compile_mode=compile_mode,
            overwrite=overwrite, log=typer.echo,
        )
    except (PlanError, ValueError, OSError) as exc:
        _fail(str(exc))
    finally:
        if ulysses > 1 and dist.is_initialized():
            dist.destroy_process_group()
    if "rank" in result:  # another process of a --ulysses run: rank 0 reports
        return
    what = ("PARO" if plan is not None else "dense") + (f" + {linear} linear" if linear else "")
    compiled = f" (compiled: {compile_mode}, compiling included)" if compile_mode else ""
    if "dense_path" in result:
        typer.echo(f"dense: {result['dense_s']:.2f} s{compiled} -> {result['dense_path']}")
    if "paro_s" in result and result.get("ran_dense"):
        typer.echo(f"dense (the plan did not fit, --on-mismatch dense): {result['paro_s']:.2f} s{compiled} -> "
                   f"{result['path']}")
    elif "paro_s" in result:
        typer.echo(f"{what}: {result['paro_s']:.2f} s{compiled} -> {result['path']}")
    else:
        typer.echo(f"dense: {result['dense_s']:.2f} s{compiled} -> {result['path']}")
    if line := masks_line(result.get("masks"), result["device"]):
        typer.echo(line)
    if compare and result.get("ran_dense") and not linear:
        typer.echo("no PARO vs dense comparison: both runs used the model's own attention")
    elif compare:
        quality = f"{what} vs dense: PSNR {result['psnr_db']:.2f} dB, SSIM {result['ssim']:.4f}, cosine {result['cosine']:.5f}"
        if result["device"].startswith("cpu") or backend == "torch":
            typer.echo(f"{quality}; time dense / PARO {result['speedup']:.2f}x (PARO ran the torch reference op, "
                       "which emulates the kernels and is no faster than dense; PARO's speed needs the Triton kernels "
                       "on a CUDA GPU)")
        else:
            typer.echo(f"{quality}, speedup {result['speedup']:.2f}x")


@app.command(cls=_Command, short_help="Offline demo: dense vs PARO on the bundled demo model (CPU or GPU).")
def demo(
    out_dir: Path | None = typer.Option(None, "--out-dir", show_default=False, help="folder for demo.gif, attention PNGs and metrics.json (default: paro-demo, or paro-demo-2, -3, ... when it exists: a run never replaces an earlier one's)"),
    density: float = typer.Option(0.5, help="block density of the plan, in (0, 1]: shipped plans 0.5, 0.3, 0.2, 0.15, 0.1; 1 keeps every block (nothing to calibrate); another density is calibrated first, at --steps steps, on the demo's 2 calibration prompts; what each costs: QUALITY.md"),
    qk: str = typer.Option("bf16", "--qk", help="QK precision: bf16 (no quantization: the model's own type, float32 on a CPU), int8 or int4"),
    pv: str = typer.Option("bf16", "--pv", help="PV precision: bf16 (no quantization, as --qk), fp8 or int8"),
    steps: int = typer.Option(20, help="denoising steps, >= 1"),
    num_prompts: int = typer.Option(2, help="how many of the demo's 8 prompts to generate, 1 to 8"),
    height: int | None = typer.Option(None, help="video height in pixels, even, up to 128 (default: 32, the size the shipped plans were calibrated at; they derive their masks at other sizes)"),
    width: int | None = typer.Option(None, help="video width in pixels, even, up to 128 (default: 32)"),
    frames: int | None = typer.Option(None, help="video frames, up to 64 (default: 8)"),
    seed: int = typer.Option(0, help="seed of the initial noise"),
    backend: str = typer.Option("auto", help="attention backend of PARO layers: auto, triton or cuda (both need a CUDA GPU) or torch"),
    device: str | None = typer.Option(None, help="cuda, cuda:N or cpu (default: cuda when present)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace the files of an earlier run in --out-dir (default: refuse)"),
) -> None:
    """Offline demo on the bundled demo model (a small trained Wan transformer): dense vs PARO on the same
    seeds, a side-by-side GIF, attention maps and masks, PSNR / SSIM / cosine and times.

    Runs on the CPU or a CUDA GPU; nothing is downloaded. `paro demo-pipeline DIR` writes the same model as a
    diffusers pipeline folder, to try the other commands on."""
    from ..errors import PlanError
    from .demo import run_demo

    try:  # run_demo checks every option and the output folder before the model loads
        run_demo(out_dir, density=density, qk=qk, pv=pv, steps=steps, num_prompts=num_prompts, seed=seed, device=device,
                 backend=backend, height=height, width=width, frames=frames, log=typer.echo, progress=True,
                 overwrite=overwrite)
    except (PlanError, ValueError, OSError) as exc:
        _fail(str(exc))


@app.command("demo-pipeline", cls=_Command,
             short_help="Write the demo model as a diffusers pipeline folder, to try the other commands offline.")
def demo_pipeline(
    directory: Path = typer.Argument(..., metavar="DIR", show_default=False,
                                     help="new folder to write (an existing one must be empty)"),
) -> None:
    """Write the bundled demo model as a diffusers pipeline folder (model_index.json, transformer, text encoder,
    scheduler, and prompts.txt with calibration prompts in its vocabulary), to try `paro calibrate`, `paro
    inspect` and `paro generate` offline, on the CPU or a GPU.

    It is the pipeline `paro demo` runs: 8 frames of 32x32 pixels by default, prompts made of the words of its
    captions (prompts.txt). In Python, `paroattn.demo_model.model.DemoVideoPipeline.from_pretrained(DIR)` loads it."""
    from ..demo_model.pipeline import PROMPTS_FILE, write_demo_pipeline

    try:
        path = write_demo_pipeline(directory)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    typer.echo(f"wrote {path}: the demo model as a diffusers pipeline (DemoVideoPipeline), and {path / PROMPTS_FILE}")
    typer.echo("try:")
    typer.echo(f"  paro calibrate {path} --prompts {path / PROMPTS_FILE} --out demo-d0.3.safetensors --density 0.3 "
               "--steps 10 --num-prompts 1 --device cpu")  # the cheap capture's every step: fills all 6 buckets
    typer.echo("  paro inspect demo-d0.3.safetensors --png figures/")
    typer.echo(f"  paro generate {path} --plan demo-d0.3.safetensors --prompt \"red circle moving left quickly, cloudy "
               "background\" --steps 10 --compare --out demo.gif --device cpu")


if __name__ == "__main__":
    app()
