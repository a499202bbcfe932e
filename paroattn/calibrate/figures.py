"""Pictures of a plan: for chosen heads, the block-attention map before and after reordering and
the mask of every timestep bucket (`paro inspect PLAN --png DIR`).

A plan holds masks, not statistics. The maps come from the stats file that `paro calibrate`
writes beside the plan (`plan.stats.safetensors`: block-mass maps averaged over prompts and steps,
in the original order and in each head's chosen order, for a few layers, by default the first,
middle and last; `--figure-layers` chooses others). The plan records that file's absolute path and
name; it is looked up by that name (a bare file name) in the plan's folder and nowhere else, or passed
as `stats=`. Without it, or for a layer it does not hold, only the masks are drawn and the picture
says why.

Maps are drawn as log10 of the block mass (the sum of P inside each block, per query row), over
the three decades below each map's maximum, with a colour scale; masks white where a block is
computed, dark where it is skipped, with a legend.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..layout import ORDERS
from ..plan import Plan

PANEL = 320  # pixels of the longer side of each panel
DECADES = 3.0
MASKS_PER_ROW = 3  # masks of more buckets wrap onto further rows, so a picture stays about as wide as it is tall
FONT_SIZE = 15
KEPT_COLOUR = (255, 255, 255)  # a block the mask computes
SKIPPED_COLOUR = (40, 40, 40)
# a perceptually ordered ramp (dark blue -> teal -> yellow), interpolated linearly
_RAMP = torch.tensor(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=torch.float32
)


def load_stats(plan: Plan, stats: str | Path | None = None, plan_path: str | Path | None = None) -> dict | None:
    """The tensors of the plan's stats file, or None when there is none. `stats`: that file, given; else, with
    `plan_path` (the plan's file), the file the plan names (`info["stats_file"]["name"]`, taken as a bare file name)
    or `<plan stem>.stats.safetensors`, in the plan's folder and nowhere else: a plan is a shared file, and the
    paths it records are not followed. Without either, None."""
    from safetensors.torch import load_file

    if stats is not None:
        if not Path(stats).is_file():
            raise FileNotFoundError(f"no stats file at {stats}: `paro calibrate` writes it beside the plan")
        return load_file(str(stats))
    if plan_path is None:
        return None
    folder, name = Path(plan_path).parent, Path(plan_path).name
    entry = plan.info.get("stats_file")
    recorded = entry.get("name") if isinstance(entry, dict) else None
    candidates = []
    if isinstance(recorded, str) and (bare := Path(recorded.replace("\\", "/")).name) not in ("", ".", ".."):
        candidates.append(folder / bare)
    stem = name[: -len(".safetensors")] if name.endswith(".safetensors") else Path(name).stem
    candidates.append(folder / f"{stem}.stats.safetensors")
    for path in candidates:
        if path.is_file():
            return load_file(str(path))
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

    kept = torch.tensor(KEPT_COLOUR, dtype=torch.uint8)
    skipped = torch.tensor(SKIPPED_COLOUR, dtype=torch.uint8)
    pixels = torch.where(mask[..., None], kept, skipped).contiguous()
    return Image.fromarray(pixels.numpy(), mode="RGB")


def _font(size: int = FONT_SIZE):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType: a scalable font
    except (TypeError, OSError, ImportError):
        return ImageFont.load_default()


def _text_size(text: str, font) -> tuple[int, int]:
    from PIL import Image, ImageDraw

    left, top, right, bottom = ImageDraw.Draw(Image.new("RGB", (1, 1))).textbbox((0, 0), text, font=font)
    return right - left, bottom - top


def _panel(image, title: str, side: int = PANEL):
    """`image` enlarged (nearest neighbour) to about `side` pixels on its longer side, `title` above it."""
    from PIL import Image, ImageDraw

    w, h = image.size
    scale = max(1, side // max(w, h))
    image = image.resize((w * scale, h * scale), Image.NEAREST)
    font = _font()
    text_w, text_h = _text_size(title, font)
    band = text_h + 10
    panel = Image.new("RGB", (max(image.width, text_w + 8), image.height + band + 1), (255, 255, 255))
    ImageDraw.Draw(panel).text((2, 3), title, fill=(0, 0, 0), font=font)
    panel.paste(image, (0, band))
    ImageDraw.Draw(panel).rectangle((0, band - 1, image.width - 1, band + image.height), outline=(128, 128, 128))
    return panel


def _colour_scale(height: int):
    """A vertical bar of the maps' ramp, labelled in decades of the block mass below each map's largest."""
    from PIL import Image, ImageDraw

    font = _font(FONT_SIZE - 2)
    title = "block mass"
    labels = ["max"] + [f"max/{10 ** d:g}" for d in range(1, int(DECADES) + 1)]
    label_w = max(_text_size(text, font)[0] for text in labels + [title])
    bar_w, top = 18, _text_size(title, font)[1] + 10
    bar_h = max(60, height - top - 8)
    values = torch.linspace(1, 0, bar_h)[:, None].expand(bar_h, bar_w)
    canvas = Image.new("RGB", (bar_w + label_w + 12, top + bar_h + 8), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((0, 2), title, fill=(0, 0, 0), font=font)
    canvas.paste(Image.fromarray(_colorize(values).numpy(), mode="RGB"), (0, top))
    for d, text in enumerate(labels):
        y = top + round(d / DECADES * (bar_h - 1))
        draw.line((bar_w, y, bar_w + 4, y), fill=(0, 0, 0))
        draw.text((bar_w + 7, max(top, min(y - 6, top + bar_h - 12))), text, fill=(0, 0, 0), font=font)
    return canvas


def _mask_legend():
    """Two swatches: a block the mask keeps (computed) and one it skips."""
    from PIL import Image, ImageDraw

    font = _font(FONT_SIZE - 2)
    entries = [(KEPT_COLOUR, "kept block (computed)"), (SKIPPED_COLOUR, "skipped block")]
    text_w = max(_text_size(text, font)[0] for _, text in entries)
    canvas = Image.new("RGB", (text_w + 30, 2 * 24 + 4), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, (colour, text) in enumerate(entries):
        y = 4 + 24 * i
        draw.rectangle((0, y, 16, y + 16), fill=colour, outline=(128, 128, 128))
        draw.text((24, y + 1), text, fill=(0, 0, 0), font=font)
    return canvas


def _stack(rows, title: str, note: str | None):
    """The rows of panels (each a list of images) one under the other, `title` above and `note` below."""
    from PIL import Image, ImageDraw

    gap = 12
    font = _font(FONT_SIZE + 2)
    title_h = _text_size(title, font)[1] + gap
    note_font = _font()
    note_h = _text_size(note, note_font)[1] + gap if note else 0
    widths = [sum(p.width for p in row) + gap * (len(row) + 1) for row in rows]
    heights = [max(p.height for p in row) + gap for row in rows]
    width = max(widths + [_text_size(title, font)[0] + 2 * gap, _text_size(note or "", note_font)[0] + 2 * gap])
    canvas = Image.new("RGB", (width, gap + title_h + sum(heights) + note_h + gap), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((gap, gap), title, fill=(0, 0, 0), font=font)
    y = gap + title_h
    for row, row_h in zip(rows, heights):
        x = gap
        for p in row:
            canvas.paste(p, (x, y))
            x += p.width + gap
        y += row_h
    if note:
        draw.text((gap, y), note, fill=(160, 0, 0), font=note_font)
    return canvas


def head_picture_path(out_dir: str | Path, layer: int, head: int) -> Path:
    """The PNG `draw_plan_heads` writes for (layer, head) in `out_dir`."""
    return Path(out_dir) / f"layer{layer:03d}_head{head:03d}.png"


def draw_plan_heads(plan: Plan, heads: list[tuple[int, int]], out_dir: str | Path,
                    stats: str | Path | None = None, plan_path: str | Path | None = None) -> list[Path]:
    """One PNG per (layer, head): block map in the original order (FHW) and in the head's chosen order, with
    their colour scale, and the mask of each bucket, with a legend of kept blocks. Returns the paths written.
    `plan_path`: where the plan was loaded from (its stats file is looked up in that folder alone); `stats`:
    the stats file itself. Each PNG is written under a temporary name and then renamed: a run stopped midway
    leaves any earlier picture whole."""
    from ..files import written_together

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
        maps, note = [], None
        if tensors is None:
            note = "block maps unavailable: no stats file beside the plan (paro calibrate writes it there)"
        elif layer not in figure_layers or "figure_original" not in tensors:
            note = f"block maps were saved for layers {figure_layers} only (paro calibrate --figure-layers)"
        else:
            slot = figure_layers.index(layer)
            maps.append(_panel(_map_image(tensors["figure_original"][slot, head]), "original order FHW"))
            maps.append(_panel(_map_image(tensors["figure_reordered"][slot, head]), f"reordered {order}"))
            maps.append(_colour_scale(maps[0].height))
        masks = []
        side = PANEL if plan.num_buckets <= MASKS_PER_ROW else PANEL * 2 // 3
        for b in range(plan.num_buckets):
            mask = plan.layer_mask(b, layer)[head]
            title = (f"mask, t in ({plan.bucket_edges[b + 1]:g}, {plan.bucket_edges[b]:g}]: "
                     f"density {float(plan.density[b, layer, head]):.2f}")
            masks.append(_panel(_mask_image(mask), title, side))
        rows = [maps] if maps else []
        rows += [masks[i:i + MASKS_PER_ROW] for i in range(0, len(masks), MASKS_PER_ROW)]
        rows[-1] = rows[-1] + [_mask_legend()]
        path = head_picture_path(out_dir, layer, head)
        picture = _stack(rows, f"layer {layer}, head {head}: order {order}, {plan.num_buckets} timestep bucket(s)", note)
        with written_together(path) as (partial,):
            picture.save(partial)
        written.append(path)
    return written
