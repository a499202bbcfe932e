"""The checks of what a generation or a demo run is asked for, made before a model loads: output folders and
paths, devices, dtypes, backends, seeds, sizes, the fp8 linear option and compilation. Each returns None or one
sentence that names the option as typed and what to pass."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..files import folder_problem, replace_problem, written_together  # noqa: F401  (re-exported: the commands')

# what `_write` can write: videos through diffusers' export_to_video (.mp4) or imageio (.gif), images through Pillow
VIDEO_SUFFIXES = (".mp4", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def output_problem(out: str | Path, video: bool | None = None) -> str | None:
    """Why `paro generate --out` cannot be written, or None: its extension (`video` None: either kind)
    and its folder (probed without leaving anything behind)."""
    out = Path(out)
    suffix = out.suffix.lower()
    allowed = VIDEO_SUFFIXES if video else IMAGE_SUFFIXES if video is False else VIDEO_SUFFIXES + IMAGE_SUFFIXES
    if suffix not in allowed:
        kind = "a video model" if video else "an image model" if video is False else "paro generate"
        return (f"--out {out}: {kind} writes {', '.join(allowed)}, not {suffix or 'a file without extension'}; "
                f"pass --out with one of those extensions")
    if out.is_dir():
        return f"--out {out} is a folder: pass a file path such as {out / ('out' + allowed[0])}"
    if out.exists() and not os.access(out, os.W_OK):
        return f"--out {out} exists and is not writable: pass another path"
    return folder_problem(out.parent, "--out folder", keep=False)


def default_output(video: bool, compare: bool = False, folder: Path = Path(".")) -> Path:
    """Where `paro generate` without --out writes: out.mp4 (out.png for images), or out-2.mp4, out-3.mp4, ...
    when that (or, with --compare, its `_dense` twin) exists, so that no run replaces an earlier one's output."""
    suffix = ".mp4" if video else ".png"
    n = 1
    while True:
        path = folder / (f"out{suffix}" if n == 1 else f"out-{n}{suffix}")
        dense = path.with_name(path.stem + "_dense" + path.suffix)
        if not path.exists() and not (compare and dense.exists()):
            return path
        n += 1


def option_problem(backend: str, on_mismatch: str) -> str | None:
    """Why `backend` or `on_mismatch` is not a valid choice, or None."""
    from ..attention import BACKENDS
    from ..pipelines.plan_fit import ON_MISMATCH

    if backend not in BACKENDS:
        return f"--backend {backend!r} is not one of {', '.join(BACKENDS)}: pass one of them"
    if on_mismatch not in ON_MISMATCH:
        return f"--on-mismatch {on_mismatch!r} is not one of {', '.join(ON_MISMATCH)}: pass one of them"
    return None


DTYPES = ("bfloat16", "float16", "float32")


def precision_label(mode: str, dtype: torch.dtype) -> str:
    """What a qk or pv mode computes in with a model of `dtype`: "bf16" names the inputs' own type (no
    quantization), which is float32 for a model run in float32, as on a CPU ("fp32"); the quantized modes are
    themselves."""
    if mode != "bf16":
        return mode
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def device_problem(device: str | None) -> str | None:
    """Why `--device` cannot run here, or None (None: CUDA when present, else the CPU)."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cuda", "cpu"):
        return f"--device {device!r} is not a device paroattn runs on: pass cuda, cuda:N or cpu"
    if parsed.type == "cuda" and not torch.cuda.is_available():
        return (f"--device {device}: this machine has no CUDA GPU that torch can use: pass --device cpu, or leave "
                "--device out")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        return (f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered from 0: pass "
                "one of them")
    return None


def dtype_problem(dtype: str | None) -> str | None:
    """Why `--dtype` is not a model dtype, or None (None: bfloat16 on CUDA, float32 on the CPU)."""
    if dtype is None or dtype in DTYPES:
        return None
    return f"--dtype {dtype!r} is not a model dtype: pass one of {', '.join(DTYPES)}"


def backend_device_problem(backend: str, device: str | None) -> str | None:
    """Why `--backend` cannot run on `device` (None: CUDA when present), or None: the Triton kernels need a
    CUDA GPU (or Triton's interpreter, TRITON_INTERPRET=1, which tests use)."""
    on_cuda = device.startswith("cuda") if device is not None else torch.cuda.is_available()
    if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return ("--backend triton runs the Triton kernels, which need a CUDA GPU; this run is on the CPU: pass "
                "--backend auto (or torch), which runs the torch reference op there")
    if backend == "cuda" and not on_cuda:
        return ("--backend cuda runs the sm_90a CUDA kernels, which need an H100/H200 GPU; this run is on the CPU: "
                "pass --backend auto (or torch), which runs the torch reference op there")
    return None


def linear_option_problem(linear: str | None, device: str | None, dtype: str | None) -> str | None:
    """Why `--linear` cannot run with `--device` / `--dtype` (None: their defaults), or None; needs no model."""
    if linear is None:
        return None
    from ..linear import LINEAR_MODES, linear_problem

    if linear not in LINEAR_MODES:
        return f"--linear {linear!r} is not one of {', '.join(LINEAR_MODES)}: pass --linear fp8, or leave it out"
    if dtype is not None and dtype != "bfloat16":
        return (f"--linear fp8 quantizes bfloat16 weights (per-row scales take no other dtype) and --dtype is {dtype}: "
                "pass --dtype bfloat16, or leave --dtype out")
    if problem := linear_problem(linear, device):
        return problem.replace("linear='fp8'", "--linear fp8").replace("leave linear out", "leave --linear out")
    return None


# `paro generate --compile`: how each denoising transformer is compiled before its run
COMPILE_MODES = ("blocks", "whole", "graphs")


def compile_option_problem(mode: str | None, device: str | None, ulysses: int = 1) -> str | None:
    """Why `--compile` cannot run on `device` (None: CUDA when present) with `--ulysses`, or None; needs no model."""
    if mode is None:
        return None
    if mode not in COMPILE_MODES:
        return (f"--compile {mode!r} is not one of {', '.join(COMPILE_MODES)}: pass --compile blocks (the "
                "fastest to compile), or leave it out to run eagerly")
    if ulysses > 1:
        return (f"--compile {mode} with --ulysses is not supported: diffusers' context-parallel hooks need an eager "
                "forward before the first compiled one (README, several GPUs); leave one of them out")
    on_cuda = device.startswith("cuda") if device is not None else torch.cuda.is_available()
    if mode == "graphs" and not on_cuda:
        return ("--compile graphs captures CUDA graphs, which need a CUDA GPU; this run is on the CPU: pass "
                "--compile blocks or whole")
    return None


# The ranges every numeric option is checked against before anything loads: wide enough for every supported model,
# narrow enough that a slip of the keyboard (--steps 1000000000000) ends in one line instead of in the pipeline.
MAX_STEPS = 1000  # the schedulers are trained on 1000 timesteps; several refuse more steps than that
MAX_PIXELS = 8192  # height or width: above any supported model's position tables
MAX_FRAMES = 1024
MAX_PROMPTS = 1000
MAX_BUCKETS = 100  # timestep buckets over 0..1000
MAX_GPUS = 1024  # --ulysses: GPUs of one generation
MAX_GROUPS = 64  # --exchange-groups: groups of a GPU's heads
MAX_BLOCK = 1024  # --block-size and --query-block, in tokens
MAX_DILATION = 1024  # blocks a mask grows by
MAX_QUANT_WEIGHT = 1000.0
SEED_RANGE = (0, 2**64 - 1)


def range_problem(flag: str, value: int | None, low: int, high: int, what: str, note: str | None = None,
                  default: str | None = None) -> str | None:
    """Why `value` of `flag` is outside [low, high], or None (None: the option is left out). `what` names the
    unit ("denoising steps"); `note` adds what a value means; `default`, when the option can be left out, what
    leaving it out gives."""
    if value is None or low <= value <= high:
        return None
    note = f" ({note})" if note else ""
    leave = f" (or leave {flag} out for {default})" if default else ""
    return f"{flag} {value}: pass a number of {what} from {low} to {high}{note}{leave}"


_SIZES = {"steps": (MAX_STEPS, "denoising steps"), "frames": (MAX_FRAMES, "frames"), "height": (MAX_PIXELS, "pixels"),
          "width": (MAX_PIXELS, "pixels")}


def size_problem(**sizes: int | None) -> str | None:
    """Why one of `--height`, `--width`, `--frames`, `--steps` (given as keywords) is out of range, or None
    (None: the pipeline's default)."""
    for name, value in sizes.items():
        high, what = _SIZES[name]
        if problem := range_problem("--" + name.replace("_", "-"), value, 1, high, what,
                                    default="the pipeline's default"):
            return problem
    return None


def seed_problem(seed: int) -> str | None:
    """Why `--seed` is not a seed torch's generators take, or None."""
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        return f"--seed {seed}: pass a seed from 0 to 2**64 - 1"
    return None
