"""How concentrated is the demo model's self-attention? An upper bound for any sparse mask.

For every self-attention call of a dense generation, the share of each query's attention mass
held by its best k% of keys (token level, any pattern: no block mask can keep more at that
density), averaged over queries, heads and steps, per layer. Printed as a Markdown table.

    python scripts/attention_concentration.py --steps 20            # CPU, about a minute
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paroattn.app.demo import CALIBRATION_PROMPTS
from paroattn.demo_model.model import load_demo_pipeline
from paroattn.pipelines import capture_attention, self_attention_layers

SHARES = (0.5, 0.3, 0.2, 0.1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--queries", type=int, default=512, help="queries sampled per call (all keys are used)")
    p.add_argument("--model-dir", type=Path, default=None, help="a demo model folder (default: the shipped one)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    pipe = load_demo_pipeline(args.model_dir, device=args.device)
    layers = len(self_attention_layers(pipe))
    sums = torch.zeros(layers, len(SHARES))
    entropy = torch.zeros(layers)
    calls = torch.zeros(layers)
    g = torch.Generator().manual_seed(0)

    def on_capture(layer, q, k, layout, timestep, suffix_mask):
        N, D = q.shape[-2:]
        rows = torch.randperm(N, generator=g)[: args.queries]
        scores = (q[:, :, rows].float() @ k.float().transpose(-1, -2)) / math.sqrt(D)
        p_ = scores.softmax(dim=-1)
        ranked = p_.sort(dim=-1, descending=True).values.cumsum(dim=-1)
        for i, share in enumerate(SHARES):
            sums[layer, i] += float(ranked[..., max(1, round(share * N)) - 1].mean())
        entropy[layer] += float(-(p_ * p_.clamp_min(1e-30).log()).sum(-1).mean() / math.log(N))
        calls[layer] += 1

    with torch.no_grad(), capture_attention(pipe, on_capture):
        pipe(CALIBRATION_PROMPTS[:1], num_inference_steps=args.steps, generator=torch.Generator().manual_seed(0),
             output_type="latent")
    mean = sums / calls[:, None]
    print("| layer | " + " | ".join(f"best {int(s * 100)}% of keys" for s in SHARES) + " | entropy / log N |")
    print("|---|" + "---|" * (len(SHARES) + 1))
    for layer in range(layers):
        print(f"| {layer} | " + " | ".join(f"{float(v):.3f}" for v in mean[layer]) +
              f" | {float(entropy[layer] / calls[layer]):.3f} |")
    print("| all | " + " | ".join(f"{float(v):.3f}" for v in mean.mean(0)) + f" | {float((entropy / calls).mean()):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
