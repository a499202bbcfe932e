"""`paro demo` and the quality study of the demo model (QUALITY.md).

The demo model (`model.py`) is sampled densely and with PARO from the same seeds; the videos
are compared with PSNR / SSIM / cosine similarity and the time spent in self-attention layers is
measured with forward hooks.

Plans come from the calibration driver (`paroattn.calibrate.driver`): the quality study
(`scripts/demo_model_quality.py`) captures the block statistics once over the calibration prompts
(`study_config`: one batch, every step) for every candidate order and for the identity order alone,
then builds a plan for each density, quantization and order metric from them with
`plan_from_stats`. The plans shipped in `assets/plans/` were made that way; `paro demo` uses them (at any
size: they hold axis profiles), a full-density plan for density 1, or, for a density that was not shipped,
calibrates the same way at the run's steps and size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..demo_model.data import CALIBRATION_PROMPTS, EVAL_PROMPTS, MORE_CALIBRATION_PROMPTS  # noqa: F401
from ..demo_model.model import ASSETS, DEFAULT_GUIDANCE, DEFAULT_STEPS
from ..plan import Plan
from .options import precision_label  # noqa: F401  (the demo's labels; re-exported)

PLANS_DIR = ASSETS / "plans"
# PSNR / SSIM by density on the held-out prompts, written with the plans by scripts/demo_model_quality.py --ship
QUALITY_SUMMARY = PLANS_DIR / "quality_summary.json"
SHIPPED_DENSITIES = (0.5, 0.3, 0.2, 0.15, 0.1)
# what `paro demo` runs by default: the sparsest shipped plan whose videos are hard to tell from dense
# on the held-out prompts (QUALITY_SUMMARY; QUALITY.md, from
# benchmarks/results/quality-reference-local-heads-h100-heldout.jsonl). bf16, not int8 QK + fp8 PV: on a
# CPU the torch reference op emulates their quantization exactly, and that is much slower than dense attention
DEFAULT_DENSITY, DEFAULT_QK, DEFAULT_PV = 0.5, "bf16", "bf16"
QUANT_MODES = {  # label -> (qk, pv)
    "bf16": ("bf16", "bf16"),
    "int8 QK": ("int8", "bf16"),
    "int8 QK + fp8 PV": ("int8", "fp8"),
    "int4 QK": ("int4", "bf16"),
}


def shipped_plan_path(density: float) -> Path:
    """`assets/plans/d0.30.safetensors` of this package: one plan per density, for every quantization (its
    qk/pv are replaced by the run's; QUALITY.md measured orders chosen with the incoherence term
    for quantized runs, and they were worse)."""
    return PLANS_DIR / f"d{density:.2f}.safetensors"


def study_config(steps: int = DEFAULT_STEPS, *, seed: int = 0, block_size: int = 64,
                 query_block: int | None = None, size: dict | None = None, extras: bool = False):
    """The capture of the quality study and the shipped plans: the calibration prompts as one batch,
    statistics at every step, noise drawn on the CPU (as the pipeline does on every device).
    `size`: num_frames / height / width of the videos, if not the model's default."""
    from ..calibrate.config import CaptureConfig

    size = size or {}
    # the full capture, pinned whatever CaptureConfig's defaults: every call, every query row, every order to the end
    return CaptureConfig(steps=steps, seed=seed, block_size=block_size, query_block=query_block, stat_every=1,
                         calls="all", query_stride=1, steps_per_bucket=None, order_steps=None,
                         batch_prompts=True, generator_device="cpu", frames=size.get("num_frames"),
                         height=size.get("height"), width=size.get("width"), extras=extras)


def study_selection(density: float, **changes):
    """The selection of the quality study and the shipped plans at `density`: one block budget over all
    timestep buckets (QUALITY.md, Calibration options); `changes` override any other option."""
    from ..calibrate.config import SelectionConfig

    return SelectionConfig(**{"density": density, "shared_budget": True, **changes})


# -- generation and comparison --------------------------------------------------------------------

@contextmanager
def attention_timer(pipe):
    """Yields a dict whose "seconds" is the time spent inside self-attention modules (attn1:
    projections, norms, RoPE, attention, output projection), synchronized on CUDA."""
    from ..pipelines import self_attention_layers

    transformer = pipe.transformer
    names = [key.rsplit(".processor", 1)[0] for key in self_attention_layers(transformer)]
    modules = [transformer.get_submodule(name) for name in names]
    record = {"seconds": 0.0}
    cuda = transformer.device.type == "cuda"

    def before(module, args, kwargs=None):
        if cuda:
            torch.cuda.synchronize()
        module._paro_demo_start = time.perf_counter()

    def after(module, args, output):
        if cuda:
            torch.cuda.synchronize()
        record["seconds"] += time.perf_counter() - module._paro_demo_start

    handles = [m.register_forward_pre_hook(before) for m in modules] + [m.register_forward_hook(after) for m in modules]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


@contextmanager
def progress_bar(pipe, label: str | None):
    """The pipeline's step bar (tqdm, on stderr) labelled `label` while inside; none when `label` is None."""
    if label is None:
        yield
        return
    from .progress import tqdm_options

    previous = dict(getattr(pipe, "_progress_bar_config", {}))
    pipe.set_progress_bar_config(**{**previous, "disable": False, "desc": label, **tqdm_options()})
    try:
        yield
    finally:
        pipe._progress_bar_config = previous


def sample(pipe, prompts: list[str], *, steps: int = DEFAULT_STEPS, seed: int = 0,
           guidance_scale: float = DEFAULT_GUIDANCE, progress: str | None = None,
           size: dict | None = None) -> tuple[np.ndarray, dict]:
    """(frames [B, F, H, W, 3] float32 in [0, 1], {"total_s", "attention_s"}); `progress`: label of a step
    bar for the timed run (none by default); `size`: num_frames / height / width, if not the default."""
    size = size or {}
    cuda = pipe.transformer.device.type == "cuda"
    if cuda:
        # one untimed step first: Triton compiles its kernels and cuDNN picks its plans on first use
        pipe(prompts[:1], num_inference_steps=1, guidance_scale=guidance_scale, output_type="np", **size)
    with attention_timer(pipe) as timer, progress_bar(pipe, progress):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        frames = pipe(prompts, num_inference_steps=steps, guidance_scale=guidance_scale,
                      generator=torch.Generator().manual_seed(seed), output_type="np", **size).frames
        if cuda:
            torch.cuda.synchronize()
        total = time.perf_counter() - start
    return np.asarray(frames, dtype=np.float32), {"total_s": total, "attention_s": timer["seconds"]}


def compare(dense: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """Mean over videos of PSNR (dB), SSIM and cosine similarity vs dense; videos [B, F, H, W, 3]."""
    from ..metrics import compare_pixels

    per_video = [compare_pixels(d, o) for d, o in zip(dense, other)]
    return {key: float(np.mean([m[key] for m in per_video])) for key in per_video[0]}


def run_with_plan(pipe, plan: Plan, prompts, *, steps, seed, backend: str = "auto", guidance_scale=DEFAULT_GUIDANCE,
                  progress: str | None = None, size: dict | None = None):
    from ..pipelines import apply

    with apply(pipe, plan, backend=backend):
        return sample(pipe, prompts, steps=steps, seed=seed, guidance_scale=guidance_scale, progress=progress,
                      size=size)


# -- pictures -------------------------------------------------------------------------------------

GIF_FRAME_MS = 125  # 8 frames per second
DIFFERENCE_GAIN = 4.0
GIF_SCALE = 8  # each pixel of the model's 32x32 videos drawn as 8x8 (nearest neighbour), so the GIF can be seen
LABEL_HEIGHT = 24  # pixels of a label band: column labels above the first row, a prompt above each row
LABEL_FONT_SIZE = 15


def difference_gain(dense: np.ndarray, paro: np.ndarray, gain: float = DIFFERENCE_GAIN,
                    quantile: float = 99.5) -> float:
    """The gain of the GIF's |dense - PARO| panel: `gain`, lowered when that would push more than
    (100 - quantile)% of the differences past white, so the panel does not saturate (the gain is
    then 1 / that quantile of |dense - PARO|, rounded down to 0.1, and at least 1)."""
    level = float(np.percentile(np.abs(dense - paro), quantile))
    if level * gain <= 1.0:
        return gain
    return max(1.0, np.floor(10.0 / level) / 10.0)


def _font():
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=LABEL_FONT_SIZE)  # Pillow >= 10.1 with FreeType: a scalable font
    except (TypeError, OSError, ImportError):
        return ImageFont.load_default()


def _label_band(width: int, labels: list[str], centers: list[int | None]) -> np.ndarray:
    """A white band [LABEL_HEIGHT, width, 3] in [0, 1] with each label centered on its column (center None:
    left-aligned), shortened at a word boundary where it would not fit."""
    from PIL import Image, ImageDraw

    band = Image.new("RGB", (width, LABEL_HEIGHT), (255, 255, 255))
    draw = ImageDraw.Draw(band)
    font = _font()
    room = width // max(1, len(labels)) if len(labels) > 1 else width - 8
    for label, center in zip(labels, centers):
        words, text = label.split(), label
        while len(words) > 1 and draw.textlength(text, font=font) > room:
            words.pop()
            text = " ".join(words).rstrip(",") + " ..."
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        x = 4 if center is None else max(0, center - (right - left) // 2)
        draw.text((x, (LABEL_HEIGHT - (bottom - top)) // 2 - top), text, fill=(0, 0, 0), font=font)
    return np.asarray(band, dtype=np.float32) / 255.0


def side_by_side(rows: list[list[np.ndarray]], scale: int = GIF_SCALE, gap: int = 4,
                 labels: list[str] | None = None, row_labels: list[str] | None = None) -> list[np.ndarray]:
    """rows of videos [F, H, W, 3] in [0, 1] -> GIF frames (uint8 [H', W', 3]) with the videos of a
    row side by side and the rows stacked, each pixel scaled up `scale` times (nearest neighbour).
    `labels`: one per column, in a band of LABEL_HEIGHT pixels above the first row; `row_labels`: one
    per row (its prompt), in a band of LABEL_HEIGHT pixels above that row."""
    frames = rows[0][0].shape[0]
    widths = [video.shape[2] * scale for video in rows[0]]
    total = sum(widths) + gap * (len(widths) - 1)
    band = None
    if labels is not None:
        starts = [sum(widths[:i]) + gap * i for i in range(len(widths))]
        band = _label_band(total, labels, [start + w // 2 for start, w in zip(starts, widths)])
    row_bands = [_label_band(total, [text], [None]) for text in row_labels] if row_labels is not None else None
    out = []
    for f in range(frames):
        lines = [] if band is None else [band]
        for r, row in enumerate(rows):
            tiles = []
            for video in row:
                tile = np.repeat(np.repeat(video[f], scale, axis=0), scale, axis=1)
                tiles += [tile, np.ones((tile.shape[0], gap, 3), np.float32)]
            if row_bands is not None:
                lines.append(row_bands[r])
            line = np.concatenate(tiles[:-1], axis=1)
            lines += [line, np.ones((gap, line.shape[1], 3), np.float32)]
        out.append((np.concatenate(lines[:-1], axis=0).clip(0, 1) * 255).round().astype(np.uint8))
    return out


def write_gif(frames: list[np.ndarray], path: Path, frame_ms: int = GIF_FRAME_MS) -> Path:
    """An endlessly looping GIF showing each frame `frame_ms` milliseconds (imageio >= 2.28 reads a
    GIF's `duration` in milliseconds; GIFs store hundredths of a second)."""
    import imageio.v2 as imageio

    from .options import written_together

    with written_together(path) as (partial,):  # an interrupted write leaves an earlier GIF whole
        imageio.mimsave(partial, frames, duration=frame_ms, loop=0)
    return path


# -- paro demo ------------------------------------------------------------------------------------

def density_cost_line(path: Path = QUALITY_SUMMARY, qk: str | None = None, pv: str | None = None) -> str | None:
    """One line on what lower densities cost on this model, from the shipped quality summary (None
    without one). `qk`, `pv`: the run's modes; when they are not the summary's, the line says so (its numbers
    are the summary's modes', not this run's)."""
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    cells = ", ".join(f"d={float(d):g}: {m['psnr_db']:.1f} dB / SSIM {m['ssim']:.3f}"
                      for d, m in summary["by_density"].items())
    other = ((qk or summary["qk"]), (pv or summary["pv"])) != (summary["qk"], summary["pv"])
    measured = (f"measured with qk={summary['qk']} pv={summary['pv']}, not this run's qk={qk} pv={pv}, which "
                "quantizes as well" if other else f"qk={summary['qk']} pv={summary['pv']}")
    return (f"PARO vs dense by density on this model ({measured}, {summary['eval_prompts']} held-out prompts x "
            f"{len(summary['seeds'])} seeds, {summary['device']}): {cells}; QUALITY.md")

DEFAULT_OUT_DIR = "paro-demo"


def default_out_dir(parent: Path = Path(".")) -> Path:
    """Where a demo run without --out-dir writes: `paro-demo`, or `paro-demo-2`, `paro-demo-3`, ... when that
    exists, so that no run replaces the results of an earlier one."""
    candidate, n = parent / DEFAULT_OUT_DIR, 1
    while candidate.exists():
        n += 1
        candidate = parent / f"{DEFAULT_OUT_DIR}-{n}"
    return candidate


def demo_size(height: int | None = None, width: int | None = None, frames: int | None = None) -> dict:
    """num_frames / height / width of a demo run, the model's (VIDEO_SHAPE) where not given."""
    from ..demo_model.model import VIDEO_SHAPE

    return {"num_frames": frames if frames is not None else VIDEO_SHAPE["num_frames"],
            "height": height if height is not None else VIDEO_SHAPE["height"],
            "width": width if width is not None else VIDEO_SHAPE["width"]}


def demo_size_problem(height: int | None, width: int | None, frames: int | None) -> str | None:
    """Why the demo model cannot generate this size, or None (None: the model's own). It denoises pixels in
    patches of 1 x 2 x 2 (frames x pixels) and its RoPE tables cover `rope_max_seq_len` patches along each axis:
    heights and widths are even and at most twice that, frames at most that."""
    from ..demo_model.model import TRANSFORMER_CONFIG, VIDEO_SHAPE

    patch, rope = TRANSFORMER_CONFIG["patch_size"], TRANSFORMER_CONFIG["rope_max_seq_len"]
    for flag, value, step in (("--height", height, patch[1]), ("--width", width, patch[2]),
                              ("--frames", frames, patch[0])):
        if value is None:
            continue
        what = "frames" if flag == "--frames" else "pixels"
        default = VIDEO_SHAPE["num_frames" if flag == "--frames" else flag[2:]]
        if not (step <= value <= rope * step and value % step == 0):
            multiples = f", in multiples of {step}" if step > 1 else ""
            return (f"{flag} {value}: the demo model takes {step} to {rope * step} {what}{multiples} (patches of "
                    f"{'x'.join(str(p) for p in patch)}, position tables {rope} patches long); pass e.g. {flag} "
                    f"{default * 3 // 2 // step * step}, or leave {flag} out for its {default}")
    return None


def full_density_plan(pipe, size: dict) -> Plan:
    """A plan that keeps every block at the size of this run, in the original token order: PARO computing what
    the model's own attention computes, with no calibration."""
    from ..pipelines import layout_for, self_attention_layers
    from ..plan import model_fingerprint

    transformer = pipe.transformer
    layout = layout_for(pipe, height=size["height"], width=size["width"], frames=size["num_frames"])
    return Plan.synthetic(layout=layout, num_layers=len(self_attention_layers(transformer)),
                          num_heads=transformer.config.num_attention_heads, density=1.0,
                          model_class=type(transformer).__name__,
                          model_fingerprint=model_fingerprint(transformer.config))


def resolve_plan(pipe, density: float, qk: str, pv: str, log: Callable[[str], None],
                 calibration_steps: int = DEFAULT_STEPS, out: Path | None = None,
                 progress: bool = False, size: dict | None = None) -> tuple[Plan, Path | None, Path | None]:
    """The plan of a demo run, with this run's qk/pv: for density 1 a full-density plan (nothing to calibrate);
    the shipped plan of `density` when there is one (at another `size` it derives its masks there); else a
    calibration as the shipped plans were made (`study_config`, `study_selection`: the demo's calibration
    prompts, every step captured) at `calibration_steps` steps and this run's size, saved as
    `out/plan.safetensors` with its stats file. Returns the plan, the absolute path of its file (None for a
    plan that was not saved) and its stats file."""
    size = size or demo_size()
    if density >= 1.0:
        log("plan: full density (every block kept, original token order; nothing to calibrate)")
        return dataclasses.replace(full_density_plan(pipe, size), qk=qk, pv=pv), None, None
    path = shipped_plan_path(density).resolve()
    if path.is_file():
        plan = Plan.load(path)
        log(f"plan: {path} (achieved density {plan.achieved_density():.3f})")
        stats = path.with_name(path.name[: -len(".safetensors")] + ".stats.safetensors")
        return dataclasses.replace(plan, qk=qk, pv=pv), path, stats if stats.is_file() else None
    from ..calibrate.driver import calibrate, save_calibration, stats_path_for

    log(f"no shipped plan for density {density:g} (shipped: {', '.join(f'{d:g}' for d in SHIPPED_DENSITIES)}, and 1): "
        f"calibrating one as they were made, on the demo's {len(CALIBRATION_PROMPTS)} calibration prompts (held out "
        f"from the generated ones) at this run's {calibration_steps} steps and size")
    start = time.perf_counter()
    # the pipeline draws its noise on the CPU on every device: so does the calibration's generator (study_config)
    plan, result = calibrate(pipe, CALIBRATION_PROMPTS, study_config(calibration_steps, size=size),
                             study_selection(density, qk=qk, pv=pv), progress=progress)
    log(f"calibrated in {time.perf_counter() - start:.1f} s")
    if out is None:
        return plan, None, None
    path, stats = save_calibration(plan, result, Path(out) / "plan.safetensors")
    path = Path(path).resolve()
    log(f"plan: {path} and its stats file")
    return plan, path, stats_path_for(path)


def demo_problem(*, density: float, qk: str, pv: str, steps: int, num_prompts: int, seed: int, backend: str,
                 device: str | None, height: int | None = None, width: int | None = None,
                 frames: int | None = None) -> str | None:
    """Why `paro demo`'s options cannot run, or None: checked before the output folder is made and the model
    loads."""
    from ..attention import BACKENDS
    from ..modes import mode_flags_problem
    from .options import MAX_STEPS, backend_device_problem, device_problem, range_problem, seed_problem

    if problem := mode_flags_problem(qk, pv):
        return problem
    if not math.isfinite(density) or not 0.0 < density <= 1.0:
        return f"--density {density}: pass a block density in (0, 1] (1 keeps every block)"
    if problem := range_problem("--steps", steps, 1, MAX_STEPS, "denoising steps"):
        return problem
    if not 1 <= num_prompts <= len(EVAL_PROMPTS):
        return f"--num-prompts {num_prompts}: pass 1 to {len(EVAL_PROMPTS)} (the demo has {len(EVAL_PROMPTS)} prompts)"
    if problem := demo_size_problem(height, width, frames):
        return problem
    if backend not in BACKENDS:
        return f"--backend {backend!r} is not one of {', '.join(BACKENDS)}: pass one of them"
    return seed_problem(seed) or device_problem(device) or backend_device_problem(backend, device)


def run_demo(out: Path | None = None, *, density: float = DEFAULT_DENSITY, qk: str = DEFAULT_QK,
             pv: str = DEFAULT_PV, steps: int = DEFAULT_STEPS, num_prompts: int = 2, seed: int = 0,
             device: str | None = None, backend: str = "auto", height: int | None = None,
             width: int | None = None, frames: int | None = None, heads: list[tuple[int, int]] | None = None,
             calibration_steps: int | None = None, log: Callable[[str], None] = print,
             progress: bool = False, overwrite: bool = False) -> dict:
    """Dense vs PARO on the demo model; writes demo.gif, attention PNGs and metrics.json into `out` (default: a
    new folder, `default_out_dir`) and returns the metrics. `height`, `width` (pixels) and `frames`: the size
    of the videos (default: the model's 32 x 32 x 8; the shipped plans derive their masks at other sizes).
    `calibration_steps`: steps of the calibration of a density that was not shipped (default: `steps`).
    `progress`: step bars for the dense and PARO passes and the calibration (on stderr; in a log, a line every so
    often). Every option is checked before anything is written; a run that fails removes the folder it made. An
    `out` holding an earlier run's files is refused unless `overwrite`."""
    from .options import MAX_STEPS, folder_problem, range_problem, replace_problem

    if problem := demo_problem(density=density, qk=qk, pv=pv, steps=steps, num_prompts=num_prompts, seed=seed,
                               backend=backend, device=device, height=height, width=width, frames=frames):
        raise ValueError(problem)
    out = Path(out) if out is not None else default_out_dir()
    made = None  # the outermost folder this run creates, removed again if the run fails
    for folder in (out, *out.parents):
        if folder.exists():
            break
        made = folder
    if problem := range_problem("calibration_steps", calibration_steps, 1, MAX_STEPS, "denoising steps"):
        raise ValueError(problem)
    if not overwrite and out.is_dir() and (problem := replace_problem(demo_outputs(out), "--out-dir")):
        raise ValueError(problem)
    if problem := folder_problem(out, "--out-dir"):  # creates the folder; fails before the model loads
        raise ValueError(problem)
    try:
        return _run_demo(out, density=density, qk=qk, pv=pv, steps=steps, num_prompts=num_prompts, seed=seed,
                         device=device, backend=backend, size=demo_size(height, width, frames), heads=heads,
                         calibration_steps=calibration_steps if calibration_steps is not None else steps, log=log,
                         progress=progress)
    except BaseException:
        if made is not None:  # nothing of a failed run stays behind
            shutil.rmtree(made, ignore_errors=True)
        raise


def demo_outputs(out: Path) -> list[Path]:
    """The files of a demo run in `out` that another run would replace: its GIF, metrics, calibrated plan and
    stats file, and the attention pictures."""
    pictures = sorted((out / "attention").glob("layer*_head*.png")) if (out / "attention").is_dir() else []
    return [out / "demo.gif", out / "metrics.json", out / "plan.safetensors", out / "plan.stats.safetensors",
            *pictures]


def _finite(value):
    """`value` with every non-finite float replaced by None, so the report is strict JSON (PSNR is
    infinite for two identical videos)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _run_demo(out: Path, *, density, qk, pv, steps, num_prompts, seed, device, backend, size, heads,
              calibration_steps, log, progress) -> dict:
    from ..demo_model.model import load_demo_pipeline

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    prompts = EVAL_PROMPTS[:num_prompts]
    labels = f"{precision_label(qk, dtype)}/{precision_label(pv, dtype)}"
    log(f"demo model: {ASSETS} on {device} ({str(dtype).replace('torch.', '')}), {num_prompts} prompt(s), "
        f"{size['num_frames']} frames of {size['height']}x{size['width']}, {steps} steps, guidance {DEFAULT_GUIDANCE}; "
        f"writing to {out}")
    pipe = load_demo_pipeline(device=device, dtype=dtype)
    plan, plan_path, stats_file = resolve_plan(pipe, density, qk, pv, log, calibration_steps, out, progress=progress,
                                               size=size)

    dense, dense_t = sample(pipe, prompts, steps=steps, seed=seed, progress="dense" if progress else None, size=size)
    log(f"dense: {dense_t['total_s']:.1f} s total, {dense_t['attention_s']:.1f} s in self-attention layers")
    paro, paro_t = run_with_plan(pipe, plan, prompts, steps=steps, seed=seed, backend=backend, size=size,
                                 progress=f"PARO d={plan.achieved_density():.2f}" if progress else None)
    log(f"PARO d={plan.achieved_density():.2f} qk={precision_label(qk, dtype)} pv={precision_label(pv, dtype)}: "
        f"{paro_t['total_s']:.1f} s total, {paro_t['attention_s']:.1f} s in self-attention layers")
    if not device.startswith("cuda") or backend == "torch":
        log("  (PARO ran the torch reference op, which emulates the kernels exactly but is no faster than "
            "dense; the speedups are the Triton kernels' on a GPU: BENCHMARKS.md)")
    elif paro_t["attention_s"] >= dense_t["attention_s"]:
        log("  (this model's attention calls are tiny, 2048 tokens x 4 heads, so each is bound by host-side "
            "launch work, where PARO does more than SDPA; its speedups show at full-size shapes: BENCHMARKS.md)")
    metrics = compare(dense, paro)
    per_prompt = [compare(dense[i:i + 1], paro[i:i + 1]) for i in range(len(prompts))]
    for prompt, m in zip(prompts, per_prompt):
        log(f"  {prompt!r}: PSNR {m['psnr_db']:.2f} dB, SSIM {m['ssim']:.4f}, cosine {m['cosine']:.5f}")
    log(f"mean vs dense: PSNR {metrics['psnr_db']:.2f} dB, SSIM {metrics['ssim']:.4f}, cosine {metrics['cosine']:.5f}")
    if line := density_cost_line(qk=qk, pv=pv):
        log(line)

    gain = difference_gain(dense, paro)
    difference = f"|dense - PARO| x{gain:g}"
    rows = [[d, p, (np.abs(d - p) * gain).clip(0, 1)] for d, p in zip(dense, paro)]
    gif = write_gif(side_by_side(rows, labels=["dense", f"PARO d={plan.achieved_density():.2f} {labels}", difference],
                                 row_labels=[f"{i + 1}: {prompt}" for i, prompt in enumerate(prompts)]),
                    out / "demo.gif")
    log(f"wrote {gif}  (one row per prompt; left: dense, middle: PARO, right: |dense - PARO| x{gain:g}, clipped "
        "at white" + (f"; x{gain:g} instead of x{DIFFERENCE_GAIN:g} keeps 99.5% of it below white)"
                      if gain < DIFFERENCE_GAIN else ")"))
    pictures = []
    try:
        from ..calibrate.figures import draw_plan_heads

        chosen = heads or [(0, h) for h in range(plan.num_heads)] + [(plan.num_layers - 1, 0)]
        pictures = [str(p) for p in draw_plan_heads(plan, chosen, out / "attention", stats=stats_file)]
        log(f"wrote {len(pictures)} attention map/mask PNGs to {out / 'attention'}")
    except ImportError as exc:  # drawing needs Pillow
        log(f"attention pictures skipped: {exc}")
    report = {
        "prompts": prompts, "steps": steps, "seed": seed, "device": device, "dtype": str(dtype),
        "size": {"frames": size["num_frames"], "height": size["height"], "width": size["width"]},
        "plan": None if plan_path is None else str(plan_path), "target_density": density,
        "density": plan.achieved_density(), "qk": qk, "pv": pv, "computed_in": labels, "backend": backend,
        "metrics": metrics, "per_prompt": per_prompt, "dense_time": dense_t, "paro_time": paro_t,
        "gif": str(gif), "gif_difference_gain": gain, "pictures": pictures,
    }
    from .options import written_together

    with written_together(out / "metrics.json") as (partial,):
        partial.write_text(json.dumps(_finite(report), indent=1, allow_nan=False))
    return report
