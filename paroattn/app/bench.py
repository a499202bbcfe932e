"""What `paro bench` runs: `paro_attention` timed against torch's default attention (SDPA; cuDNN on Hopper GPUs)
on this GPU at the attention shapes of CogVideoX-5B, Wan2.1-1.3B, Wan2.1-14B 720p and FLUX.1-dev, and the table
of a run or of a saved results file.

A time is the median of `triton.testing.do_bench` (CUDA events, L2 flushed between calls) while the call rotates
over bf16 input sets of at least 768 MB. The paro time is the whole op call (prologue included) given the active
blocks of a synthetic mask of the density (what a processor passes) and a random order per head. The source
checkout's benchmarks/attention.py times more methods and settings; its results files print here too."""

from __future__ import annotations

import datetime
import itertools
import json
import math
import re
import subprocess
from pathlib import Path

import torch

from ..layout import TokenLayout

SDPA = "sdpa-default"
# name: (B, H, layout, D)
SHAPES = {
    "cogvideox-5b": (2, 48, TokenLayout(226, 13, 30, 45), 64),
    "wan2.1-1.3b": (1, 12, TokenLayout(0, 21, 30, 52), 128),
    "flux.1-dev": (1, 24, TokenLayout(512, 1, 64, 64), 128),
    "short": (1, 24, TokenLayout(0, 1, 32, 32), 128),
    "wan2.1-14b-720p": (1, 40, TokenLayout(0, 21, 45, 80), 128),
}
LABELS = {"cogvideox-5b": "CogVideoX-5B", "wan2.1-1.3b": "Wan2.1-1.3B", "wan2.1-14b-720p": "Wan2.1-14B 720p",
          "flux.1-dev": "FLUX.1-dev", "short": "short sequence"}
# what `paro bench` times unless told otherwise
MODEL_SHAPES = ("cogvideox-5b", "wan2.1-1.3b", "wan2.1-14b-720p", "flux.1-dev")
MODES = (("bf16", "bf16"), ("int8", "fp8"))
DENSITIES = (1.0, 0.5, 0.2)
MIN_REPETITIONS = 10  # timed calls per measurement at least, however long a call is
ROW_FIELDS = {"shape": str, "B": int, "H": int, "N": int, "D": int, "method": str, "density": (int, float),
              "ms": (int, float, type(None))}


def environment() -> dict:
    """The GPU, driver (where nvidia-smi answers), torch, triton and date of a run on this machine."""
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat()}
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=10, check=True).stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return env


def input_sets(B: int, H: int, N: int, D: int, generator: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """q, k, v sets [B, H, N, D] bf16 on the GPU: 2 to 6 of them, >= 768 MB together (more than any L2 holds)."""
    count = max(2, min(6, math.ceil(3 * 2**28 / (3 * B * H * N * D * 2))))
    return [tuple(torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=generator)
                  for _ in range(3)) for _ in range(count)]


def median_ms(fn, sets, warmup: int = 25, rep: int = 100) -> float:
    """Median ms of `fn(*args)`, the args rotating over `sets`; at least MIN_REPETITIONS timed calls."""
    import triton.testing

    turn = itertools.count()

    def call():
        return fn(*sets[next(turn) % len(sets)])

    call()  # compiles; then one timed call sizes the budget (do_bench alone would time a 200 ms call once)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    stop.record()
    torch.cuda.synchronize()
    rep = max(rep, MIN_REPETITIONS * start.elapsed_time(stop))
    return float(triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median"))


def run(shapes=MODEL_SHAPES, modes=MODES, densities=DENSITIES, block=(64, 64), backend="auto", log=print) -> dict:
    """Time SDPA once per shape and paro per density and mode; the rows name the kernel that ran each call."""
    import torch.nn.functional as F

    from ..attention import decide, paro_attention
    from ..kernels.block_lists import ActiveBlocks
    from ..kernels.dispatch import Launch
    from ..masks import synthetic_block_mask

    results = {**environment(), "block": list(block), "backend": backend,
               "timing": "do_bench (eager calls, L2 flushed)", "rows": []}
    generator = torch.Generator(device="cuda").manual_seed(0)
    for name in shapes:
        B, H, layout, D = SHAPES[name]
        N = layout.seq_len
        sets = input_sets(B, H, N, D, generator)
        orders = torch.randint(0, 6, (H,), generator=torch.Generator().manual_seed(1))

        def record(method, density, fn, **extra):
            try:
                ms, error = median_ms(fn, sets), None
            except Exception as exc:  # a method that fails on a shape (memory, a kernel refusing it) is a row
                ms, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            results["rows"].append({"shape": name, "B": B, "H": H, "N": N, "D": D, "method": method,
                                    "density": density, "ms": ms, "error": error, **extra})
            log(f"{name:16s} {method:16s} d={density:<4} " + (f"{ms:8.3f} ms" if ms else f"failed: {error}"))

        record(SDPA, 1.0, F.scaled_dot_product_attention)
        for density in densities:
            mask = synthetic_block_mask(H, -(-N // block[0]), -(-N // block[1]), density,
                                        generator=torch.Generator().manual_seed(2))
            blocks = ActiveBlocks.from_mask(mask).to("cuda")
            for qk, pv in modes:
                decision = decide(sets[0][0], *block, qk, pv, backend)
                ran = decision.kernel if isinstance(decision, Launch) else f"refused: {decision.reason}"

                def paro(q, k, v, qk=qk, pv=pv):
                    return paro_attention(q, k, v, layout=layout, orders=orders, block_mask=blocks, qk=qk, pv=pv,
                                          block_size=tuple(block), backend=backend)

                record(f"paro-{qk}-{pv}", density, paro, kernel=ran, mask_density=float(mask.float().mean()))
        sets = None  # this shape's inputs freed before the next shape's
        torch.cuda.empty_cache()
    return results


def read_results(path: Path) -> dict:
    """The results saved by `paro bench` or benchmarks/attention.py; ValueError says what else `path` holds."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"is not a readable JSON file ({exc})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not rows or not isinstance(rows, list) or not all(
            isinstance(r, dict) and all(isinstance(r.get(k), t) for k, t in ROW_FIELDS.items()) for r in rows):
        found = (f"an object with keys {', '.join(map(str, data))}" if data else "an empty object") \
            if isinstance(data, dict) else (f"a list of {len(data)} items" if data else "an empty list") \
            if isinstance(data, list) else repr(data)
        raise ValueError(f"holds {found}, not the timings of paro bench (an object whose \"rows\" list has "
                         f"{', '.join(ROW_FIELDS)})")
    return data


def kernel_of(row: dict) -> str:
    """The kernel that ran a row. Files written before rows named it record the Triton kernel's config, whose
    `warp_specialized` flag sent a call to the warp-specialized Gluon kernel."""
    from ..kernels.dispatch import GLUON, TRITON

    if row.get("kernel"):
        return row["kernel"]
    config = row.get("config")
    return (GLUON if config.get("warp_specialized") else TRITON) if isinstance(config, dict) else "-"


def environment_line(results: dict) -> str:
    """GPU, driver, torch, triton, commit, date, blocks and timing of a results file (what it records)."""
    block = results.get("block", 64)
    block = block if isinstance(block, list) else [block, block]
    parts = [results.get("gpu", "unknown GPU")] + [f"{key} {results[key]}" for key in ("driver", "torch", "triton",
                                                                                       "commit") if key in results]
    return ", ".join(parts + [str(results.get("date", "undated")), f"blocks {block[0]} x {block[1]}",
                              results.get("timing", "do_bench (eager calls, L2 flushed)")])


def _ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def table(results: dict, shapes=None, modes=None, densities=None) -> str:
    """Markdown: per shape, SDPA's time and a row per other method with the kernel that ran it and, per density,
    its time and speedup over SDPA. `shapes`, `modes` (of paro rows) and `densities` select; default: all."""
    rows = [r for r in results["rows"] if not shapes or r["shape"] in shapes]
    densities = densities or sorted({r["density"] for r in rows if r["method"] != SDPA}, reverse=True)
    lines = [environment_line(results), "", "| model (B, H, N, D) | SDPA default | method | kernel | "
             + " | ".join(f"d={d:g}" for d in densities) + " |", "|---" * (len(densities) + 4) + "|"]
    for shape in shapes or dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        sdpa = next((r["ms"] for r in mine if r["method"] == SDPA and r["ms"]), None)
        head = [f"{LABELS.get(shape, shape)} ({', '.join(str(mine[0][k]) for k in 'BHND')})" if mine else shape,
                f"{_ms(sdpa)} ms" if sdpa else "n/a"]
        for method in dict.fromkeys(r["method"] for r in mine if r["method"] != SDPA):
            mode = re.fullmatch(r"paro-(?:sm90-)?([a-z0-9]+)-([a-z0-9]+)(?:-rope)?", method)
            if modes and mode and (mode[1], mode[2]) not in modes:
                continue
            timed = [r for r in mine if r["method"] == method]
            cells = []
            for d in densities:
                r = next((r for r in timed if r["density"] == d), None)
                cells.append("" if r is None else "failed" if not r["ms"] else
                             f"{_ms(r['ms'])} ms" + (f", {sdpa / r['ms']:.2f}x" if sdpa else ""))
            kernels = ", ".join(sorted({kernel_of(r) for r in timed}))
            lines.append(f"| {' | '.join(head)} | {method} | {kernels} | " + " | ".join(cells) + " |")
            head = ["", ""]
    return "\n".join(lines)
