"""Draw the README's sample grid of the demo model: one row per prompt, the video on the left
and its caption's ground truth (the procedural renderer) on the right, as a looping GIF; and check
that the objects move as their captions say.

    python scripts/demo_model_samples.py --out assets/demo_model/samples.gif

Motion check: each captioned object is followed by its color (`color_centroids`) in the model's
video and in the renderer's; its displacement from the first to the last frame (object motion and
camera together) counts as following the caption when it points the same way (cosine > 0.7) and has
0.5x to 2x the renderer's length, or, where the renderer's object moves less than 2 px, when the
model's moves less than 3 px.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paroattn.app import demo
from paroattn.demo_model.data import COLORS, color_centroids, parse_caption, render
from paroattn.demo_model.model import load_demo_pipeline


def displacement(video: torch.Tensor, color: str) -> torch.Tensor | None:
    """(dx, dy) in pixels of `color`'s centroid from its first to its last visible frame, scaled to
    the whole video; None where it is visible in fewer than two frames."""
    centroids = color_centroids(video, color)
    visible = (~centroids.isnan().any(dim=1)).nonzero().flatten()
    if visible.numel() < 2:
        return None
    first, last = int(visible[0]), int(visible[-1])
    return (centroids[last] - centroids[first]) * (video.shape[1] - 1) / (last - first)


def follows(model: torch.Tensor | None, truth: torch.Tensor | None) -> bool:
    if model is None or truth is None:
        return False
    if float(truth.norm()) < 2.0:
        return float(model.norm()) < 3.0
    ratio = float(model.norm() / truth.norm())
    return float(torch.nn.functional.cosine_similarity(model, truth, dim=0)) > 0.7 and 0.5 <= ratio <= 2.0


def shown(d: torch.Tensor | None) -> str:
    return "not found" if d is None else f"({float(d[0]):+.1f}, {float(d[1]):+.1f}) px"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, default=None, help="a demo model folder (default: the shipped one)")
    args = p.parse_args(argv)
    prompts = demo.EVAL_PROMPTS[:4]  # the grid in README.md
    pipe = load_demo_pipeline(args.model_dir)
    frames, timing = demo.sample(pipe, prompts, steps=args.steps, seed=args.seed)
    rows, followed, objects = [], 0, 0
    for i, (prompt, video) in enumerate(zip(prompts, frames)):
        spec = parse_caption(prompt)
        truth = render(spec, torch.Generator().manual_seed(args.seed + i))[0]  # [3, F, H, W] in [-1, 1]
        model = torch.from_numpy(video).permute(3, 0, 1, 2) * 2 - 1
        rows.append([video, ((truth.permute(1, 2, 3, 0) + 1) / 2).numpy()])
        print(f"row {i}: {prompt}")
        for j in range(int(spec.num_objects[0])):
            color = list(COLORS)[int(spec.color[0, j])]
            got, want = displacement(model, color), displacement(truth, color)
            ok = follows(got, want)
            followed, objects = followed + ok, objects + 1
            print(f"  {color}: model {shown(got)}, renderer {shown(want)} -> {'follows' if ok else 'does not follow'}")
    print(f"{followed} of {objects} objects move as their captions say")
    demo.write_gif(demo.side_by_side(rows, scale=4, gap=2), args.out)
    print(f"wrote {args.out} ({timing['total_s']:.1f} s of sampling)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
