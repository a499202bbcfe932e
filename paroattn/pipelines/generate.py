"""`paro generate`: one generation with a plan, optionally against the dense model with the same seed.

Kept apart from the CLI so tests and notebooks can call `generate(...)` and read its result dict.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import PlanError
from ..plan import Plan
from .registry import family_of, resolve_transformer

# frames per second of the exported videos, as the model cards use
_FPS = {"cogvideox": 8, "wan": 16}


def load_pipeline(model_dir: str | Path, device: str | None = None, dtype: str | None = None):
    """A diffusers pipeline from a local folder on `device` (default: CUDA when present) in `dtype`
    (default: bfloat16 on CUDA, float32 on CPU)."""
    from diffusers import DiffusionPipeline

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; use bfloat16, float16 or float32")
    return DiffusionPipeline.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device)


def _run(pipe, prompt: str, call: dict, seed: int) -> tuple[np.ndarray, float]:
    """(frames [F, H, W, 3] or image [1, H, W, 3] as float32 in [0, 1], seconds)."""
    device = pipe.transformer.device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        result = pipe(prompt, generator=generator, output_type="np", **call)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    pixels = result.frames[0] if hasattr(result, "frames") else result.images
    return np.asarray(pixels, dtype=np.float32), seconds


def _write(pixels: np.ndarray, path: Path, video: bool, fps: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if video:
        from diffusers.utils import export_to_video

        export_to_video(list(pixels), str(path), fps=fps)
    else:
        from PIL import Image

        Image.fromarray((pixels[0].clip(0, 1) * 255).round().astype(np.uint8)).save(path)
    return path


def compare_pixels(dense: np.ndarray, sparse: np.ndarray) -> dict[str, float]:
    """PSNR (dB, data range 1), SSIM (torchmetrics, per frame, averaged) and cosine similarity."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    a = torch.from_numpy(dense).permute(0, 3, 1, 2).double()
    b = torch.from_numpy(sparse).permute(0, 3, 1, 2).double()
    cosine = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    return {
        "psnr_db": float(peak_signal_noise_ratio(b, a, data_range=1.0)),
        "ssim": float(structural_similarity_index_measure(b, a, data_range=1.0)),
        "cosine": float(cosine),
    }


def generate(
    model_dir: str | Path,
    prompt: str,
    *,
    plan: str | Path | None = None,
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
    extra_call: dict | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Generate with `plan` (or dense when None); with `compare`, also dense with the same seed.
    Returns paths written, seconds of each run and (compare) PSNR / SSIM / cosine of PARO vs dense."""
    from . import apply

    if compare and plan is None:
        raise ValueError("--compare measures PARO against dense: pass --plan PLAN as well")
    loaded_plan = Plan.load(plan) if plan is not None else None  # fail on a bad plan before loading the model
    log(f"loading {model_dir}")
    pipe = load_pipeline(model_dir, device=device, dtype=dtype)
    transformer = resolve_transformer(pipe)
    family = family_of(transformer)
    if family is None:
        raise PlanError(
            f"{model_dir} holds a {type(transformer).__name__}; paro generate supports CogVideoX, Wan 2.1 and FLUX.1"
        )
    video = family.is_video
    call = dict(extra_call or {})
    for key, value in (("height", height), ("width", width), ("num_inference_steps", steps)):
        if value is not None:
            call[key] = value
    if frames is not None:
        if not video:
            raise ValueError(f"--frames is for video models; {type(transformer).__name__} makes images")
        call["num_frames"] = frames
    if loaded_plan is not None and loaded_plan.layout.prefix and "max_sequence_length" not in call:
        call["max_sequence_length"] = loaded_plan.layout.prefix  # text tokens are part of the plan's sequence
    out = Path(out) if out is not None else Path("out.mp4" if video else "out.png")
    fps = _FPS.get(family.name, 8)
    result: dict = {"model": type(transformer).__name__, "device": str(transformer.device)}
    if compare:
        log("dense run (the model's own attention)")
        dense_pixels, result["dense_s"] = _run(pipe, prompt, call, seed)
        dense_path = out.with_name(out.stem + "_dense" + out.suffix)
        result["dense_path"] = str(_write(dense_pixels, dense_path, video, fps))
    handle = None
    if loaded_plan is not None:
        handle = apply(pipe, loaded_plan, backend=backend, on_mismatch=on_mismatch)
        log(f"PARO run (plan {plan}: density {loaded_plan.achieved_density():.2f}, qk={loaded_plan.qk}, pv={loaded_plan.pv})")
    else:
        log("dense run (no plan)")
    try:
        pixels, seconds = _run(pipe, prompt, call, seed)
    finally:
        if handle is not None:
            result["masks"] = handle.stats()
            handle.remove()
    result["paro_s" if loaded_plan is not None else "dense_s"] = seconds
    result["path"] = str(_write(pixels, out, video, fps))
    if compare:
        result.update(compare_pixels(dense_pixels, pixels))
        result["speedup"] = result["dense_s"] / result["paro_s"]
    return result
