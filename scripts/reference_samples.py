"""Draw the README's sample grid of the reference model: one row per prompt, the video on the left
and its caption's ground truth (the procedural renderer) on the right, as a looping GIF.

    python scripts/reference_samples.py --out assets/reference/samples.gif
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paroattn import demo
from paroattn.reference_data import parse_caption, render
from paroattn.reference_model import load_reference_pipeline


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    prompts = demo.EVAL_PROMPTS
    pipe = load_reference_pipeline()
    frames, timing = demo.sample(pipe, prompts, steps=args.steps, seed=args.seed)
    rows = []
    for i, (prompt, video) in enumerate(zip(prompts, frames)):
        truth = render(parse_caption(prompt), torch.Generator().manual_seed(args.seed + i))
        truth = ((truth[0].permute(1, 2, 3, 0) + 1) / 2).numpy()  # [F, H, W, 3]
        rows.append([video, truth])
        print(f"row {i}: {prompt}")
    demo.write_gif(demo.side_by_side(rows, scale=4), args.out)
    print(f"wrote {args.out} ({timing['total_s']:.1f} s of sampling)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
