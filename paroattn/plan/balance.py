"""Balanced GPUs under Ulysses context parallelism.

Each GPU runs a contiguous slice of every layer's heads (`pipelines/context_parallel.py`), and every layer waits, at
the exchange of its output, for the GPU whose slice holds the most active blocks: heads whose attention is spread out
get more blocks than local ones, so one slice may hold far more than another. Balancing moves blocks between the
slices of each (bucket, layer) until each holds as many, to one block (`selection.balance_layer`): the layer keeps
its number of blocks, so each bucket's budget is unchanged. A slice over its share drops its kept blocks of least
attention mass, one under it takes its free blocks of most mass; blocks every mask keeps (diagonal, text) never
move. The cost in quality is that of the blocks moved: some heads lose blocks they had earned, others gain blocks
of less mass (`scripts/demo_model_quality.py` measures it on the demo model: variants "balanced 2 GPUs", "balanced 4
GPUs").

The number of GPUs is given
- at calibration (`SelectionConfig(ulysses=N)`, `paro calibrate --ulysses N`): the measured masses decide;
- or when the plan is applied (`balance_plan`; `paroattn.apply(..., balance_ranks=N)`, `PAROProcessor(balance_ranks=
  N)`): masses estimated from the plan's axis profiles (the product model of `shapes`), computed on the model's
  device, as deriving a plan for another size does; plans without profiles cannot be balanced there.
The plan records it (`info["balanced_ranks"]`); plans derived from it for other sizes are balanced alike. Balanced
for N, a plan is balanced for every number of GPUs that divides N (each GPU's slice is a union of N's slices); under
another number it runs correctly, unbalanced (`balance_problem` says so).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import PlanError
from .model import Plan
from .selection import BALANCED_RANKS, balance_layer, forced_blocks, rank_blocks, ranks_problem
from .shapes import layer_block_masses, offset_weights


def plan_forced_blocks(plan: Plan, device=None) -> torch.Tensor:
    """bool [nq, nk]: the blocks every mask of the plan keeps (diagonal and text)."""
    layout = plan.layout
    return forced_blocks(plan.mask_blocks, layout.prefix, plan.block_size, device=device, suffix=layout.suffix,
                         seq_len=layout.seq_len)


def rank_imbalance(plan: Plan, ranks: int) -> torch.Tensor:
    """float [buckets]: how much longer than the mean GPU the slowest GPU's attention runs per step in each bucket,
    counting blocks: the sum over the sparse layers of the largest slice's active blocks over the sum of the mean
    slice's, minus one (0: balanced; layers run densely count for every GPU alike and are left out)."""
    if problem := ranks_problem(plan.num_heads, ranks):
        raise PlanError(problem)
    counts = rank_blocks(plan.block_mask, ranks).double()  # [B, L, ranks]
    sparse = (~plan.dense).double()[..., None]
    slowest = (counts.amax(-1, keepdim=True) * sparse).sum(dim=(1, 2))
    mean = (counts.mean(-1, keepdim=True) * sparse).sum(dim=(1, 2))
    return torch.where(mean > 0, slowest / mean.clamp_min(1) - 1, torch.zeros_like(mean))


def balance_plan(plan: Plan, ranks: int, device=None) -> Plan:
    """The plan with each (bucket, layer)'s blocks spread evenly over `ranks` GPUs' slices of the heads, moved by
    the attention mass its axis profiles estimate (on `device`); its other calibrated sizes balanced alike. Raises
    PlanError when `ranks` does not divide the heads or the plan holds no profiles."""
    if problem := ranks_problem(plan.num_heads, ranks):
        raise PlanError(problem)
    if plan.profiles is None:
        raise PlanError(
            f"the plan calibrated for {plan.layout} holds no axis profiles, from which the attention mass of the blocks "
            f"to move between GPUs is estimated: calibrate it balanced instead (`paro calibrate --ulysses {ranks}`), "
            "or calibrate with this paroattn, whose plans hold them"
        )
    masks = plan.block_mask.clone()
    forced = plan_forced_blocks(plan, device)
    spread = rank_blocks(masks, ranks)
    for b in range(plan.num_buckets):
        for layer in range(plan.num_layers):
            if bool(plan.dense[b, layer]) or int(spread[b, layer].max() - spread[b, layer].min()) <= 1:
                continue  # run densely, or balanced already: no mass to estimate
            weights = [offset_weights(p[b, layer].to(device)) for p in plan.profiles]
            mass = layer_block_masses(weights, plan.orders[layer].long(), plan.layout, plan.block_size, device)
            masks[b, layer] = balance_layer(masks[b, layer].to(mass.device), mass, ranks, forced).cpu()
    return replace(plan, block_mask=masks, density=None, info={**plan.info, BALANCED_RANKS: ranks},
                   extra_shapes=[balance_plan(other, ranks, device) for other in plan.extra_shapes])


def balance_problem(plan: Plan, degree: int) -> str | None:
    """Why a plan's GPUs are unbalanced under Ulysses `degree` though it was balanced (for a number of GPUs that
    `degree` does not divide), or None."""
    balanced = int(plan.info.get(BALANCED_RANKS) or 1)
    if balanced <= 1 or degree <= 1 or balanced % degree == 0:
        return None
    return (
        f"the plan's masks are balanced for {balanced} GPUs, whose slices of the heads the {degree} GPUs of this run "
        f"do not group: their attention work differs (the output does not); balance it for {degree} GPUs with "
        f"paroattn.apply(..., balance_ranks={degree}) or `paro calibrate --ulysses {degree}`"
    )
