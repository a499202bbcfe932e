"""Pictures of a plan: for chosen heads, the block-attention map before and after reordering and
the mask of every timestep bucket (`paro inspect PLAN --png DIR`).

A plan holds masks, not statistics. The maps come from the stats file that `paro calibrate`
writes beside the plan (`plan.stats.safetensors`: block-mass maps averaged over prompts and steps,
in the original order and in each head's chosen order, for a few layers, by default the first,
middle and last; `--figure-layers` chooses others). The plan records that file's absolute path and
name; it is looked up there, then by name beside the plan file (`plan_path=`: the plan's folder, so a
folder moved with its stats file still finds it), or passed as `stats=`. Without `plan_path`, the
name is looked up in the current folder. Without
it, or for a layer it does not hold, only the masks are drawn and the picture says why.

Maps are drawn as log10 of the block mass (the sum of P inside each block, per query row), over
the three decades below each map's maximum; masks white where a block is computed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..layout import ORDERS
from ..plan import Plan

PANEL = 320  # pixels of the longer side of each panel
DECADES = 3.0
# a perceptually ordered ramp (dark blue -> teal -> yellow), interpolated linearly
_RAMP = torch.tensor(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=torch.float32
)


def load_stats(plan: Plan, stats: str | Path | None = None, plan_path: str | Path | None = None) -> dict | None:
    """The tensors of the plan's stats file, or None when it cannot be found. `plan_path`: the plan's
    file, whose folder the recorded name (or `<plan stem>.stats.safetensors`) is resolved against."""
    from safetensors.torch import load_file

    candidates = []
    if stats is not None:
        candidates.append(Path(stats))
    entry = plan.info.get("stats_file") or {}
    if entry.get("path"):
        candidates.append(Path(entry["path"]))
    if plan_path is not None:
        folder = Path(plan_path).parent
        if entry.get("name"):
            candidates.append(folder / Path(entry["name"]).name)
        name = Path(plan_path).name
        stem = name[: -len(".safetensors")] if name.endswith(".safetensors") else Path(name).stem
        candidates.append(folder / f"{stem}.stats.safetensors")
    elif entry.get("name"):
        candidates.append(Path(entry["name"]))
    for path in candidates:
        if path.is_file():
            return load_file(str(path))
    if stats is not None:
        raise FileNotFoundError(f"no stats file at {stats}: `paro calibrate` writes it beside the plan")
    return None


def _colorize(values: torch.Tensor) -> torch.Tensor:
    """[h, w] floats in [0, 1] -> uint8 [h, w, 3] on the ramp."""
    x = values.clamp(0, 1) * (len(_RAMP) - 1)
    low = x.floor().long().clamp(max=len(_RAMP) - 2)
    frac = (x - low)[..., None]
    return (_RAMP[low] * (1 - frac) + _RAMP[low + 1] * frac).round().to(torch.uint8)


def _map_image(mass: torch.Tensor):
    from PIL import Image

    mass = mass.float()
    peak = float(mass.max())
    if peak <= 0:
        scaled = torch.zeros_like(mass)
    else:
        scaled = (torch.log10(mass.clamp_min(peak * 10 ** (-DECADES - 1)) / peak) + DECADES) / DECADES
    return Image.fromarray(_colorize(scaled).numpy(), mode="RGB")


def _mask_image(mask: torch.Tensor):
    from PIL import Image

    pixels = (mask.to(torch.uint8) * 255)[..., None].expand(*mask.shape, 3).contiguous()
    return Image.fromarray(pixels.numpy(), mode="RGB")


def _panel(image, title: str):
    from PIL import Image, ImageDraw

    w, h = image.size
    scale = max(1, PANEL // max(w, h))
    image = image.resize((w * scale, h * scale), Image.NEAREST)
    panel = Image.new("RGB", (max(image.width, 8 * len(title) + 8), image.height + 22), (255, 255, 255))
    ImageDraw.Draw(panel).text((4, 4), title, fill=(0, 0, 0))
    panel.paste(image, (0, 22))
    return panel


def _row(panels, note: str | None):
    from PIL import Image, ImageDraw

    gap = 12
    width = sum(p.width for p in panels) + gap * (len(panels) + 1)
    height = max(p.height for p in panels) + 2 * gap + (20 if note else 0)
    canvas = Image.new("RGB", (max(width, 8 * len(note or "") + 2 * gap), height), (255, 255, 255))
    x = gap
    for p in panels:
        canvas.paste(p, (x, gap))
        x += p.width + gap
    if note:
        ImageDraw.Draw(canvas).text((gap, height - 22), note, fill=(160, 0, 0))
    return canvas


def draw_plan_heads(plan: Plan, heads: list[tuple[int, int]], out_dir: str | Path,
                    stats: str | Path | None = None, plan_path: str | Path | None = None) -> list[Path]:
    """One PNG per (layer, head): block map in the original order (FHW), block map in the head's
    chosen order, and the mask of each bucket. Returns the paths written. `plan_path`: where the plan
    was loaded from (its stats file is looked up beside it)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_stats(plan, stats, plan_path)
    figure_layers = tensors["figure_layers"].tolist() if tensors is not None else []
    written = []
    for layer, head in heads:
        if not (0 <= layer < plan.num_layers and 0 <= head < plan.num_heads):
            raise ValueError(
                f"head {layer}:{head} is not in the plan ({plan.num_layers} layers x {plan.num_heads} heads); "
                "pass layer:head pairs within range"
            )
        order = ORDERS[int(plan.orders[layer, head])]
        panels, note = [], None
        if tensors is None:
            note = "block maps unavailable: the plan's stats file was not found (paro calibrate writes it beside the plan)"
        elif layer not in figure_layers or "figure_original" not in tensors:
            note = f"block maps were saved for layers {figure_layers} only (paro calibrate --figure-layers)"
        else:
            slot = figure_layers.index(layer)
            panels.append(_panel(_map_image(tensors["figure_original"][slot, head]), "original order FHW"))
            panels.append(_panel(_map_image(tensors["figure_reordered"][slot, head]), f"reordered {order}"))
        for b in range(plan.num_buckets):
            mask = plan.block_mask[b, layer, head]
            title = (f"mask t in ({plan.bucket_edges[b + 1]:g},{plan.bucket_edges[b]:g}] "
                     f"d={float(plan.density[b, layer, head]):.2f}")
            panels.append(_panel(_mask_image(mask), title))
        path = out_dir / f"layer{layer:03d}_head{head:03d}.png"
        _row(panels, note).save(path)
        written.append(path)
    return written
