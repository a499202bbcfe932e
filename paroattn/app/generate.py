"""`paro generate`: one generation with a plan, optionally against the dense model with the same seed.

Kept apart from the CLI so tests and notebooks can call `generate(...)` and read its result dict.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..errors import PlanError
from ..metrics import compare_pixels
from ..pipelines.base import TEXT_WHOLE, pixel_scale_of
from ..pipelines.registry import EXPERTS, FAMILIES, SUPPORTED, family_of, pipeline_experts, resolve_transformer
from ..plan import Plan, load_plans
from .options import (
    MAX_GPUS,
    MAX_GROUPS,
    backend_device_problem,
    compile_option_problem,
    default_output,
    device_problem,
    dtype_problem,
    linear_option_problem,
    option_problem,
    output_problem,
    precision_label,
    range_problem,
    replace_problem,
    seed_problem,
    size_problem,
    written_together,
)
from .progress import log_progress

# frames per second of the exported videos, as the model cards use
_FPS = {"cogvideox": 8, "wan": 16, "hunyuan_video": 15, "skyreels_v2": 24, "wan_vace": 16, "hunyuan_video15": 24,
        "ltx": 25, "ltx2": 24}
def indexed_family(model_dir: str | Path):
    """The adapter of the family whose transformer class `model_dir/model_index.json` names, or None (no such
    file, or a class no adapter lists: the loaded pipeline decides then). Lets options that depend on the
    family (video or image) be checked before the model loads."""
    index = Path(model_dir) / "model_index.json"
    try:
        components = json.loads(index.read_text())
    except (OSError, ValueError):
        return None
    for name in EXPERTS:
        entry = components.get(name) if isinstance(components, dict) else None
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str):
            for family in FAMILIES:
                if entry[1] in family.transformer_classes:
                    return family()
    return None


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _vae_factors(model_dir: Path) -> tuple[int | None, int | None]:
    """(spatial, temporal) compression of the pipeline's VAE as its pipeline class computes them, read from
    `vae/config.json` for the VAEs whose config states them (Wan's, HunyuanVideo's, CogVideoX's); (None, None)
    where the config does not tell. The demo model's pipeline has no VAE: (1, 1)."""
    from ..demo_model.pipeline import is_demo_pipeline

    if is_demo_pipeline(model_dir):
        return 1, 1
    config = _read_json(model_dir / "vae" / "config.json") or {}
    name = config.get("_class_name")
    if name in ("AutoencoderKLWan",):
        return int(config.get("scale_factor_spatial") or 8), int(config.get("scale_factor_temporal") or 4)
    if name in ("AutoencoderKLHunyuanVideo",):
        return int(config.get("spatial_compression_ratio") or 8), int(config.get("temporal_compression_ratio") or 4)
    if name == "AutoencoderKLCogVideoX" and isinstance(config.get("block_out_channels"), list):
        return 2 ** (len(config["block_out_channels"]) - 1), int(config.get("temporal_compression_ratio") or 4)
    return None, None


def size_fit_problem(model_dir: str | Path, height: int | None, width: int | None, frames: int | None,
                     what: str = "") -> str | None:
    """Why the video pipeline in `model_dir` cannot generate this size, read from its config files before
    anything loads, or None (also None where the configs do not tell: the pipeline then checks). Heights and
    widths must be multiples of the VAE's spatial factor times the transformer's patch (the pipelines of these
    families raise, or the transformer's patches would drop a row), and a transformer with RoPE tables of
    `rope_max_seq_len` positions takes at most that many patches along each axis. `what` prefixes the flags
    (e.g. "--sizes 480x832x81: ")."""
    model_dir = Path(model_dir)
    family = indexed_family(model_dir)
    if family is None or not family.is_video or (height is None and width is None and frames is None):
        return None
    config = _read_json(model_dir / "transformer" / "config.json") or {}
    patch = config.get("patch_size")
    if isinstance(patch, int):
        patch = [config.get("patch_size_t") or 1, patch, patch]
    spatial, temporal = _vae_factors(model_dir)
    if not (isinstance(patch, list) and len(patch) == 3 and all(isinstance(p, int) and p > 0 for p in patch)
            and spatial is not None):
        return None
    rope = config.get("rope_max_seq_len")
    demo = spatial == 1 and temporal == 1  # no VAE: a latent frame is a frame
    for flag, value, step in (("--height", height, spatial * patch[1]), ("--width", width, spatial * patch[2])):
        if value is None:
            continue
        if value % step:
            why = (f"its patches are {patch[1]} pixels" if spatial == 1 else
                   f"its VAE compresses by {spatial} and its patches are {patch[1]} latent pixels")
            return (f"{what}{flag} {value}: this model takes {flag[2:]}s that are multiples of {step} pixels ({why}); "
                    f"pass e.g. {flag} {max(step, round(value / step) * step)}")
        if isinstance(rope, int) and value // step > rope:
            return (f"{what}{flag} {value}: this model's position tables cover {rope} patches of {step} pixels, "
                    f"{rope * step} pixels; pass {flag} {rope * step} or less")
    if frames is not None and isinstance(rope, int) and temporal:
        latent = frames if demo else (frames - 1) // temporal + 1
        if -(-latent // patch[0]) > rope:
            most = rope * patch[0] if demo else (rope * patch[0] - 1) * temporal + 1
            return (f"{what}--frames {frames}: this model's position tables cover {rope} patches along time, "
                    f"{most} frames; pass --frames {most} or less")
    return None


def pipeline_folder_problem(model_dir: str | Path) -> str | None:
    """Why `model_dir` is not a local diffusers pipeline folder, or None (also None for a path that does
    not exist locally and may be a hub id: diffusers reports those)."""
    path = Path(model_dir)
    if not path.exists():
        if str(model_dir).count("/") == 1 and not str(model_dir).startswith((".", "/")):
            return None  # looks like a hub id
        return f"{model_dir} does not exist: pass a diffusers pipeline folder (one with model_index.json)"
    if not path.is_dir():
        return f"{model_dir} is a file: pass a diffusers pipeline folder (one with model_index.json)"
    index = path / "model_index.json"
    if not index.is_file():
        return (f"{model_dir} has no model_index.json: pass a diffusers pipeline folder (one with model_index.json, "
                "as `pipe.save_pretrained` or a hub download writes it)")
    try:
        json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        return f"{index} is not readable JSON ({exc}): pass a complete diffusers pipeline folder"
    return None


def load_pipeline(model_dir: str | Path, device: str | None = None, dtype: str | None = None):
    """A diffusers pipeline from a local folder on `device` (default: CUDA when present) in `dtype`
    (default: bfloat16 on CUDA, float32 on CPU)."""
    from diffusers import DiffusionPipeline

    if problem := pipeline_folder_problem(model_dir):
        raise ValueError(problem)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if problem := device_problem(device) or dtype_problem(dtype):
        raise ValueError(problem)
    from ..demo_model.pipeline import is_demo_pipeline

    if is_demo_pipeline(model_dir):  # `paro demo-pipeline`'s folder: a pipeline class of this package
        from ..demo_model.model import load_demo_pipeline

        pipe = load_demo_pipeline(model_dir, device=device, dtype=getattr(torch, dtype))
        pipe.set_progress_bar_config(disable=False)  # as any other pipeline shows its steps
        return pipe
    return DiffusionPipeline.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device)


def _all_dense(plan: Plan) -> Plan:
    """`plan` with every layer of every bucket (and of its other calibrated sizes) run by the model's own attention."""
    return replace(plan, block_mask=plan.masks, dense=torch.ones_like(plan.dense),  # masks as held: not unpacked
                   extra_shapes=[_all_dense(p) for p in plan.extra_shapes])


def _ulysses_plan_problem(family, plans: list[Plan] | None, ulysses: int, auto: bool = False) -> str | None:
    """Why a run of `family` over `ulysses` GPUs without a plan cannot be made, or None (`auto`: plan 'auto' runs
    the model's own attention through its capture's exchange while it learns)."""
    if ulysses <= 1 or auto or plans is not None or family is None or family.ulysses_text != TEXT_WHOLE:
        return None
    return (f"--ulysses {ulysses} with {family.models}: its own attention runs on several GPUs only through PARO's "
            "processor, which needs a plan: pass --plan PLAN (with --compare for the model's own attention as well)")


def _auto_problem(auto: bool, density: float | None, qk: str, pv: str, ulysses: int, compare: bool = False,
                  compile_mode: str | None = None) -> str | None:
    """Why the options of `--plan auto` (or, without it, --density, --qk, --pv) cannot run, or None."""
    from ..modes import mode_flags_problem

    if not auto:
        given = [flag for flag, value, default in (("--density", density, None), ("--qk", qk, "bf16"),
                                                    ("--pv", pv, "bf16")) if value != default]
        if given:
            return (f"{', '.join(given)} choose the plan --plan auto learns; a plan file has its own: pass --plan auto, "
                    "or leave them out")
        return None
    if density is not None and not 0.0 < density <= 1.0:
        return f"--density {density}: pass a mean block density in (0, 1] (1 keeps every block)"
    if problem := mode_flags_problem(qk, pv):
        return problem
    if ulysses > 1 and (compare or compile_mode):
        # the GPUs agree on each generation (the cached plan, learning it, or dense while another process learns it);
        # a dense run beside it, or compiling a plan that may not exist yet, would need a second agreement
        flag = "--compare" if compare else f"--compile {compile_mode}"
        return (f"--plan auto with --ulysses runs one generation, which learns the plan or runs the cached one; "
                f"{flag} needs the plan first: run once without {flag} (it prints the plan's path), then pass that "
                f"path to --plan with {flag}")
    return None


@contextmanager
def _own_attention(pipe, family, plans: list[Plan] | None, ulysses: int, backend: str, resident: bool | str):
    """Dense runs: the model's own attention as it is, or, under Ulysses for families whose text every GPU holds
    whole (CogVideoX, HunyuanVideo: their own processors cannot run there), through PARO's processor, which does
    the exchange, with every layer of the plans flagged dense (the model's attention call, nothing of the plan)."""
    if ulysses <= 1 or family.ulysses_text != TEXT_WHOLE:
        yield
        return
    from ..pipelines import apply

    handle = apply(pipe, [_all_dense(p) for p in plans], backend=backend, on_mismatch="dense", resident=resident)
    try:
        yield
    finally:
        handle.remove()


# what `--compile` passes torch.compile (tests run the same code through a backend that compiles in seconds)
COMPILE_BACKEND = "inductor"


def repeated_blocks(transformer) -> list[torch.nn.Module]:
    """The blocks diffusers' regional compilation compiles one by one: the modules of the classes the model names in
    `_repeated_blocks` (CogVideoX names none: its `transformer_blocks`' class)."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    if not names and len(getattr(transformer, "transformer_blocks", ())):
        names = {type(transformer.transformer_blocks[0]).__name__}
    blocks = [module for module in transformer.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(f"--compile blocks: {type(transformer).__name__} names no repeated blocks to compile one by "
                         "one: pass --compile whole")
    return blocks


@contextmanager
def compiled(pipe, how: str | None):
    """Each denoising transformer of `pipe` compiled as `how` says (None: eager) for the run inside, then as it was:
    "blocks" each repeated block on its own (diffusers' regional compilation: a graph per kind of block, a
    fraction of the whole transformer's compile time), "whole" the transformer in one graph, "graphs" the transformer under CUDA graphs. Graphs are
    traced at the first call, so the processors are set first; dynamo's caches are reset after."""
    if how is None:
        yield
        return
    modules = [module for _, transformer in pipeline_experts(pipe)
               for module in (repeated_blocks(transformer) if how == "blocks" else [transformer])]
    options = {"fullgraph": True, "backend": COMPILE_BACKEND}
    if how == "graphs":
        options["mode"] = "reduce-overhead"
    try:
        for module in modules:
            module.compile(**options)
        yield
    finally:
        for module in modules:
            module._compiled_call_impl = None
        torch._dynamo.reset()


def _run(pipe, prompt: str, call: dict, seed: int) -> tuple[np.ndarray, float]:
    """(frames [F, H, W, 3] or image [1, H, W, 3] as float32 in [0, 1], seconds)."""
    device = resolve_transformer(pipe).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        # by keyword: FLUX.2's pipelines take an image first
        result = pipe(prompt=prompt, generator=generator, output_type="np", **call)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    pixels = result.frames[0] if hasattr(result, "frames") else result.images
    return np.asarray(pixels, dtype=np.float32), seconds


# outputs smaller than this on their longer side are enlarged (nearest neighbour) by a whole factor so that a person
# can see them: the demo model's 32 x 32 videos become 256 x 256, as `paro demo` draws them
VISIBLE_SIDE = 256


def visible_scale(height: int, width: int) -> int:
    """The whole factor that brings an output of `height` x `width` pixels to about VISIBLE_SIDE on its longer side
    (1: large enough as it is)."""
    return max(1, VISIBLE_SIDE // max(1, height, width))


def enlarged(pixels: np.ndarray, scale: int) -> np.ndarray:
    """Frames [..., H, W, 3] with each pixel repeated `scale` x `scale` times (nearest neighbour)."""
    if scale == 1:
        return pixels
    return np.repeat(np.repeat(pixels, scale, axis=-3), scale, axis=-2)


# final path -> the temporary file it is written to while `_written_together` holds it
_WRITING_TO: dict[Path, Path] = {}


@contextmanager
def _written_together(*targets: Path):
    """`written_together` of `targets`, with `_write` of each target writing its temporary file meanwhile."""
    with written_together(*targets) as partial:
        _WRITING_TO.update(zip(targets, partial))
        try:
            yield
        finally:
            for target in targets:
                _WRITING_TO.pop(target, None)


def _write(pixels: np.ndarray, path: Path, video: bool, fps: int) -> Path:
    """`pixels` as the video or image `path` (inside `_written_together`: into its temporary file)."""
    path = _WRITING_TO.get(path, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if video and path.suffix.lower() == ".gif":
        import imageio.v2 as imageio

        frames = [(frame.clip(0, 1) * 255).round().astype(np.uint8) for frame in pixels]
        imageio.mimsave(path, frames, duration=1000.0 / fps, loop=0)  # imageio >= 2.28: milliseconds per frame
    elif video:
        from diffusers.utils import export_to_video

        export_to_video(list(pixels), str(path), fps=fps)
    else:
        from PIL import Image

        Image.fromarray((pixels[0].clip(0, 1) * 255).round().astype(np.uint8)).save(path)
    return path


def _default_size(pipe, transformer, call: dict) -> dict | None:
    """height, width (and num_frames, None for the model's default) of a call: the call's own, else the
    pipeline's defaults (its signature's, or those it derives from the transformer config); None when
    they cannot be told."""
    import inspect

    params = inspect.signature(type(pipe).__call__).parameters
    size = {}
    for key in ("height", "width", "num_frames"):
        value = call.get(key)
        if value is None and key in params and params[key].default is not inspect.Parameter.empty:
            value = params[key].default
        size[key] = value
    scale = pixel_scale_of(pipe)
    config = transformer.config
    for key, config_key in (("height", "sample_height"), ("width", "sample_width")):
        if size[key] is None and getattr(config, config_key, None) is not None:  # CogVideoX
            size[key] = int(getattr(config, config_key)) * scale.spatial
    if size["height"] is None and getattr(pipe, "default_sample_size", None) is not None:  # Flux
        side = int(pipe.default_sample_size) * int(getattr(pipe, "vae_scale_factor", scale.spatial))
        size["height"] = size["height"] or side
        size["width"] = size["width"] or side
    if size["width"] is None and getattr(pipe, "default_sample_size", None) is not None:
        size["width"] = int(pipe.default_sample_size) * int(getattr(pipe, "vae_scale_factor", scale.spatial))
    if size["height"] is None or size["width"] is None:
        return None
    return size


def _call_layout(pipe, transformer, family, call: dict):
    """The token layout of a generation `call` (its size, else the pipeline's defaults), or None when it cannot be
    told before the first forward."""
    size = _default_size(pipe, transformer, call)
    if size is None:
        return None
    try:
        return family.layout_for(transformer, height=int(size["height"]), width=int(size["width"]),
                                 frames=None if size["num_frames"] is None else int(size["num_frames"]),
                                 text_tokens=call.get("max_sequence_length"), scale=pixel_scale_of(pipe, family))
    except ValueError:
        return None


def plan_fit_problem(pipe, plan: Plan | list[Plan], call: dict) -> str | None:
    """Why `plan` (an expert pair: the list of its plans) does not fit the pipeline's transformers or the size
    of `call` (what `apply` and the first forward would raise), or None; runs no model step."""
    from ..pipelines import expert_plans
    from ..pipelines.base import CallInputs
    from ..pipelines.processor import PAROProcessor

    pairs, problems = expert_plans(pipe, plan)
    if problems:
        return "; ".join(problems)
    for expert, transformer, expert_plan in pairs:
        family = family_of(transformer)
        scale = pixel_scale_of(pipe, family)
        processor = PAROProcessor(expert_plan, on_mismatch="dense", pixel_scale=scale)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            binding = processor.bind(transformer)
        try:
            size = _default_size(pipe, transformer, call)
            layout = None
            if size is not None:  # None: the first forward checks the layout
                try:
                    layout = binding.family.layout_for(
                        transformer, height=int(size["height"]), width=int(size["width"]),
                        frames=None if size["num_frames"] is None else int(size["num_frames"]),
                        text_tokens=call.get("max_sequence_length"), scale=scale,
                    )
                except ValueError as exc:
                    if not binding.static_problem:
                        return str(exc)
            if binding.static_problem:  # another model: calibrate it at the size asked for, where it is known
                problems = processor.plan_problems(binding)
                command = binding.family.calibrate_command(transformer, layout or expert_plan.layout, scale)
                problem = f"plan does not fit this model: {'; '.join(problems)}. Recalibrate for this model: `{command}`"
            elif layout is not None:
                problem = processor.layout_problem(binding, CallInputs(timestep=1000.0, layout=layout))
            else:
                problem = None
        finally:
            processor.unbind(binding)
        if problem:
            return f"{expert}: {problem}" if len(pairs) > 1 else problem
    return None


def _silent(message: str) -> None:
    pass


def _outputs(out: Path, compare: bool) -> list[Path]:
    """The files a generation writes: `out` and, with `compare`, its `_dense` twin beside it."""
    return [out] + ([out.with_name(out.stem + "_dense" + out.suffix)] if compare else [])


def generate(
    model_dir: str | Path,
    prompt: str,
    *,
    plan: str | Path | None = None,
    density: float | None = None,
    qk: str = "bf16",
    pv: str = "bf16",
    height: int | None = None,
    width: int | None = None,
    frames: int | None = None,
    steps: int | None = None,
    seed: int = 0,
    out: str | Path | None = None,
    compare: bool = False,
    device: str | None = None,
    dtype: str | None = None,
    backend: str = "auto",
    on_mismatch: str = "error",
    ulysses: int = 1,
    exchange_groups: int = 1,
    linear: str | None = None,
    compile_mode: str | None = None,
    extra_call: dict | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Generate with `plan` (or dense when None); with `compare`, also dense with the same seed.
`plan="auto"`: the cached plan of this model at `density` (default 0.3), `qk` and `pv`, or, without one, the
generation runs dense and learns it into the cache (`paroattn.calibrate.auto`); with `compare` the dense run learns
it and the PARO run uses it. The result's "auto" says which ("cached" or "learnt") and "plan_path" where it is.
    Under `ulysses` the processes run one generation that learns the plan (each process records its heads) or runs
    the cached one; "dense" while another process learns it.
    Returns paths written, seconds of each run and (compare) PSNR / SSIM / cosine of PARO vs dense.
    `linear="fp8"`: the transformer blocks' linear layers in fp8 as well (`paroattn.linear`); without a plan, beside
    the model's own attention (then "paro_s" is that run's time, and `compare` measures it against bf16).
    `compile_mode`: each run's transformers compiled first, "blocks", "whole" or "graphs" (`compiled`); the masks are
    then kept on the GPU (streamed masks run eagerly only), and each run's time includes its compiling.

    `ulysses` > 1: this is one of that many processes started by torchrun, one per GPU, running one generation
    together under diffusers' Ulysses context parallelism (each GPU runs its share of the heads); rank 0 logs and
    writes the outputs, the others return {"rank": r}. `exchange_groups`: the groups of heads each GPU's exchange is
    pipelined over (`PAROProcessor`'s; with plans balanced per group: `paro calibrate --ulysses` GPUs x groups).

    An existing `out` (or, with `compare`, its `_dense` twin) is refused unless `overwrite`; the outputs are written
    under temporary names and renamed together at the end, and outputs under VISIBLE_SIDE pixels are enlarged by a
    whole factor ("scale" in the result; the metrics compare the native pixels)."""
    from ..pipelines import apply
    from ..pipelines.context_parallel import (
        enable_ulysses,
        exchange_groups_problem,
        join_process_group,
        sequence_problem,
        ulysses_problem,
    )

    # every option and the output path are checked before the model loads
    auto = isinstance(plan, str) and plan == "auto"
    if problem := _auto_problem(auto, density, qk, pv, ulysses, compare, compile_mode):
        raise ValueError(problem)
    if compare and plan is None and linear is None:
        raise ValueError("--compare measures PARO against dense: pass --plan PLAN as well")
    if problem := range_problem("--ulysses", ulysses, 1, MAX_GPUS, "GPUs",
                                 "processes to split each generation over"):
        raise ValueError(problem)
    if problem := range_problem("--exchange-groups", exchange_groups, 1, MAX_GROUPS, "groups of each GPU's heads"):
        raise ValueError(problem)
    if exchange_groups != 1 and (ulysses <= 1 or plan is None):
        raise ValueError(f"--exchange-groups {exchange_groups} pipelines the exchange between GPUs of a PARO run: "
                         "pass --ulysses N and --plan PLAN too, or leave it out")
    if problem := option_problem(backend, on_mismatch):
        raise ValueError(problem)
    if problem := size_problem(steps=steps, height=height, width=width, frames=frames):
        raise ValueError(problem)
    if problem := seed_problem(seed) or device_problem(device) or dtype_problem(dtype):
        raise ValueError(problem)
    if problem := backend_device_problem(backend, device):
        raise ValueError(problem)
    if problem := linear_option_problem(linear, device, dtype):
        raise ValueError(problem)
    if problem := compile_option_problem(compile_mode, device, ulysses):
        raise ValueError(problem)
    if out is not None and (problem := output_problem(out)):
        raise ValueError(problem)
    if out is not None and not overwrite and (problem := replace_problem(_outputs(Path(out), compare), "--out")):
        raise ValueError(problem)
    if problem := pipeline_folder_problem(model_dir):
        raise ValueError(problem)
    from ..demo_model.pipeline import PROMPTS_FILE, prompts_problem

    if problem := prompts_problem(model_dir, [prompt]):
        raise ValueError(f"--prompt: {problem}; e.g. the prompts of {Path(model_dir) / PROMPTS_FILE}")
    # video or image, where model_index.json tells (the loaded pipeline is checked again below)
    indexed = indexed_family(model_dir)
    if frames is not None and indexed is not None and not indexed.is_video:
        raise ValueError(f"--frames is for video models; {model_dir} holds an image model ({indexed.models}): "
                         "leave --frames out")
    if out is not None and indexed is not None and (problem := output_problem(out, indexed.is_video)):
        raise ValueError(problem)
    if problem := size_fit_problem(model_dir, height, width, frames):
        raise ValueError(problem)
    # fail on a bad plan before loading the model; an expert pair's plans are read together
    try:
        loaded_plans = load_plans(plan) if plan is not None and not auto else None
    except PlanError as exc:
        raise PlanError(f"--plan: {exc}") from None
    loaded_plan = loaded_plans[0] if loaded_plans else None
    for expert_plan in loaded_plans or []:
        if problem := ulysses_problem(expert_plan.num_heads, ulysses):
            raise PlanError(f"--ulysses {ulysses}: {problem}")
        if exchange_groups != 1 and (problem := exchange_groups_problem(expert_plan.num_heads // ulysses,
                                                                        exchange_groups)):
            raise ValueError(f"--exchange-groups: {problem} ({expert_plan.num_heads} heads over {ulysses} GPUs)")
    if problem := _ulysses_plan_problem(indexed, loaded_plans, ulysses, auto):
        raise ValueError(problem)
    rank = 0
    if ulysses > 1:
        rank, device = join_process_group(ulysses, device)
        if rank != 0:
            log = _silent
    log(f"loading {model_dir}")
    pipe = load_pipeline(model_dir, device=device, dtype=dtype)
    transformer = resolve_transformer(pipe)
    family = family_of(transformer)
    if family is None:
        raise PlanError(
            f"{model_dir} holds a {type(transformer).__name__}; paro generate supports {SUPPORTED}"
        )
    if problem := _ulysses_plan_problem(family, loaded_plans, ulysses, auto):
        raise ValueError(problem)
    video = family.is_video
    out = Path(out) if out is not None else default_output(video, compare)
    if problem := output_problem(out, video):
        raise ValueError(problem)
    call = dict(extra_call or {})
    for key, value in (("height", height), ("width", width), ("num_inference_steps", steps)):
        if value is not None:
            call[key] = value
    if frames is not None:
        if not video:
            raise ValueError(f"--frames is for video models; {type(transformer).__name__} makes images: leave "
                             "--frames out")
        call["num_frames"] = frames
    text_tokens = 0 if loaded_plan is None else loaded_plan.layout.prefix + loaded_plan.layout.suffix
    if text_tokens and family.pads_text and "max_sequence_length" not in call:
        call["max_sequence_length"] = text_tokens  # text tokens are part of the plan's sequence
    if rank == 0:
        log_progress(pipe)  # in a log, the step bar prints a line every so often instead of only at its end
    if ulysses > 1:
        # token counts the GPUs do not divide (CogVideoX-5B's video under 4) are split in chunks of unequal length
        layout = _call_layout(pipe, transformer, family, call)
        uneven = layout is not None and sequence_problem(layout, ulysses, family.ulysses_text) is not None
        for _, expert in pipeline_experts(pipe):
            enable_ulysses(expert, ulysses, uneven=uneven)
        if rank != 0:
            pipe.set_progress_bar_config(disable=True)
    fps = _FPS.get(family.name, 8)
    result: dict = {"model": type(transformer).__name__, "device": str(transformer.device)}
    mismatch = None
    if loaded_plan is not None:  # does the plan fit this model and size? before any generation
        mismatch = plan_fit_problem(pipe, loaded_plans, call)
        if mismatch is not None:
            mismatch = mismatch.replace("paro calibrate MODEL_DIR", f"paro calibrate {model_dir}")
            if on_mismatch == "error":
                raise PlanError(mismatch + " (or pass --on-mismatch dense to run the model's own attention)")
            log(f"warning: {mismatch}; running the model's own attention (--on-mismatch dense)")
            result["ran_dense"] = mismatch
    if compile_mode:
        log(f"compiling the transformer{'s' if len(pipeline_experts(pipe)) > 1 else ''} ({compile_mode}) at each run's "
            "first step: its time includes that")
    resident = True if compile_mode else "auto"  # streamed masks run eagerly only
    learning = None
    if auto:
        from ..calibrate.auto import apply_auto

        learning = apply_auto(pipe, density=0.3 if density is None else density, qk=qk, pv=pv, backend=backend,
                              on_mismatch=on_mismatch, linear=linear, resident=resident, log=log)
        result["plan_path"] = str(learning.path)
        if ulysses > 1:  # the processes agree inside the handle's generation: it runs whatever they decide
            try:
                pixels, seconds = _run(pipe, prompt, call, seed)
            finally:
                learning.remove()
            outcome = "learnt" if learning.learnt else "cached" if learning.plan is not None else "dense"
            result.update({"auto": outcome, "ulysses": ulysses, "paro_s" if outcome == "cached" else "dense_s": seconds})
            if outcome == "dense":
                result["ran_dense"] = f"another process is learning the plan {learning.path}"
            return _finish(result, pixels, None, out, False, video, fps, log) if rank == 0 else {"rank": rank}
        if learning.plan is None and compile_mode:
            learning.remove()
            raise ValueError(f"--compile runs a plan that exists: no plan is cached at {learning.path} yet; run once "
                             "without --compile (it learns the plan), then with it")
        if learning.plan is not None:  # a hit: run as a plan file would, after the dense run of --compare
            loaded_plans = [learning.plan]
            loaded_plan = learning.plan
            learning.remove()
            learning = None
            result["auto"] = "cached"
    if compare:
        log("dense run (the model's own attention)" + (": it learns the plan" if learning is not None else ""))
        with _own_attention(pipe, family, loaded_plans, ulysses, backend, resident), compiled(pipe, compile_mode):
            dense_pixels, result["dense_s"] = _run(pipe, prompt, call, seed)
        if learning is not None:
            if learning.plan is None:
                learning.remove()
                raise PlanError(f"another process is learning the plan {result['plan_path']}; run again once it has "
                                "written it, or without --compare")
            loaded_plans = [learning.plan]
            loaded_plan = learning.plan
            learning.remove()
            learning = None
            result["auto"] = "learnt"
    if learning is not None:  # a miss without --compare: this run is dense and learns the plan
        try:
            pixels, result["dense_s"] = _run(pipe, prompt, call, seed)
        finally:
            learning.remove()
        result["auto"] = "learnt"
        return _finish(result, pixels, None, out, compare, video, fps, log)
    handle = None
    linears = " and fp8 linear layers" if linear else ""
    if loaded_plan is not None and mismatch is not None:
        log(f"dense run (the plan does not fit){linears}")
        if ulysses > 1 and family.ulysses_text == TEXT_WHOLE:
            handle = apply(pipe, [_all_dense(p) for p in loaded_plans], backend=backend, on_mismatch="dense",
                           exchange_groups=exchange_groups, linear=linear, resident=resident)
        elif linear:
            handle = apply(pipe, None, linear=linear)
    elif loaded_plan is not None:
        handle = apply(pipe, loaded_plans, backend=backend, on_mismatch=on_mismatch, exchange_groups=exchange_groups,
                       linear=linear, resident=resident)
        if not handle.active:  # on_mismatch="dense" and a mismatch the check above did not tell
            result["ran_dense"] = "the plan does not fit (see the warning above)"
        experts = f", experts {' and '.join(p.expert for p in loaded_plans)}" if len(loaded_plans) > 1 else ""
        dtype_of_model = transformer.dtype
        log(f"PARO run (plan {result.get('plan_path', plan)}: density {loaded_plan.achieved_density():.2f}, "
            f"qk={precision_label(loaded_plan.qk, dtype_of_model)}, pv={precision_label(loaded_plan.pv, dtype_of_model)}"
            f"{experts}){linears}")
    elif linear:
        handle = apply(pipe, None, linear=linear)
        log(f"dense run (no plan){linears}")
    else:
        log("dense run (no plan)")
    try:
        with compiled(pipe, compile_mode):
            pixels, seconds = _run(pipe, prompt, call, seed)
    finally:
        if handle is not None:
            result["masks"] = handle.stats()
            handle.remove()
    result["paro_s" if loaded_plan is not None or linear else "dense_s"] = seconds
    if linear:
        result["linear"] = linear
    if compile_mode:
        result["compile"] = compile_mode
    if ulysses > 1:
        result["ulysses"] = ulysses
        if rank != 0:  # every process holds the same output; rank 0 writes it
            return {"rank": rank}
    return _finish(result, pixels, dense_pixels if compare else None, out, compare, video, fps, log)


def _finish(result: dict, pixels, dense_pixels, out: Path, compare: bool, video: bool, fps: int, log) -> dict:
    """Write the outputs (under temporary names, renamed together) and complete `result`."""
    scale = visible_scale(*pixels.shape[-3:-1])
    targets = _outputs(out, compare)
    with _written_together(*targets):  # an interrupted write leaves earlier files as they were
        _write(enlarged(pixels, scale), targets[0], video, fps)
        if compare:
            _write(enlarged(dense_pixels, scale), targets[1], video, fps)
    result["path"] = str(out)
    if compare:
        result["dense_path"] = str(targets[1])
    result["scale"] = scale
    if scale > 1:
        height, width = pixels.shape[-3:-1]
        log(f"output enlarged {scale}x (nearest neighbour) from {width}x{height} to {width * scale}x{height * scale} "
            "pixels so it can be seen; the metrics compare the native pixels")
    if compare:
        result.update(compare_pixels(dense_pixels, pixels))
        result["speedup"] = result["dense_s"] / result["paro_s"]
    return result
