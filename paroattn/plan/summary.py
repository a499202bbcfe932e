"""Human-readable summaries of plans (for `paro inspect`)."""

from __future__ import annotations

import textwrap
from collections import Counter

from ..layout import ORDERS
from .model import Plan

SHOWN_PROMPTS = 3
PROMPT_WIDTH = 100  # characters of a prompt's line


def describe_plan(plan: Plan, size_on_disk: int | None = None) -> str:
    L, H = plan.num_layers, plan.num_heads
    nq, nk = plan.mask_blocks
    lines = [
        f"model        {plan.model_class or '(unspecified)'}  fingerprint {plan.model_fingerprint or '-'}"
        + (f"  expert {plan.expert}" if plan.expert else ""),
        f"layout       {plan.layout}  ({plan.layout.seq_len} tokens, prefix {plan.layout.prefix}"
        + (f", suffix {plan.layout.suffix})" if plan.layout.suffix else ")"),
        "sizes        calibrated: " + ", ".join(f"{p.layout}" for p in plan.calibrated_plans()) + "; " + (
            "any other size of the model derives its masks from the closest of them (axis profiles)"
            if all(p.profiles is not None for p in plan.calibrated_plans()) else
            "no axis profiles (plan format version 1, or calibrated without them): other sizes need their own "
            "calibration"),
        f"attention    {L} layers x {H} heads, blocks {plan.block_size[0]}x{plan.block_size[1]} ({nq}x{nk} per head)",
        f"quantization qk={plan.qk} pv={plan.pv}" + (f" k_scale={plan.k_scale}" if plan.qk != "bf16" else ""),
        f"density      target {plan.target_density:.3f}, achieved {plan.achieved_density():.3f}",
        "buckets      " + ", ".join(
            f"{b}: ({plan.bucket_edges[b + 1]:g}, {plan.bucket_edges[b]:g}]" for b in range(plan.num_buckets)
        ),
    ]
    if size_on_disk is not None:
        lines.append(f"file size    {size_on_disk / 1024:.1f} KiB")
    if plan.prompts:  # one line each, long ones shortened at a word boundary
        shown = SHOWN_PROMPTS if len(plan.prompts) > SHOWN_PROMPTS + 1 else len(plan.prompts)
        lines.append(f"prompts      {len(plan.prompts)}:")
        lines += [f"  {textwrap.shorten(p, PROMPT_WIDTH, placeholder=' ...')}" for p in plan.prompts[:shown]]
        if len(plan.prompts) > shown:
            lines.append(f"  (and {len(plan.prompts) - shown} more)")
    counts = Counter(int(o) for o in plan.orders.flatten().tolist())
    lines.append("orders       " + "  ".join(f"{ORDERS[o]}:{counts.get(o, 0)}" for o in range(len(ORDERS))))
    lines.append("density per layer (mean over heads; one column per bucket, 'dense' = model's own attention):")
    for layer in range(L):
        cells = []
        for b in range(plan.num_buckets):
            if bool(plan.dense[b, layer]):
                cells.append(" dense")
            else:
                cells.append(f"{float(plan.density[b, layer].mean()):6.3f}")
        lines.append(f"  layer {layer:3d} " + " ".join(cells))
    return "\n".join(lines)
