"""Synthetic q, k with planted locality: for tests of order selection and masks, and the metric study.

Head h "looks along" one axis of the [F, H, W] grid: a query attends to keys that share its
coordinates on the two other axes and lie within a few steps of it on the looked-along axis. The
logits are a Gaussian kernel on the grid coordinates written as a dot product, the 3-D analogue of
RoPE's relative-position features:

    q_i . k_j = sum_a w_a * (2 c_a(i) c_a(j) - c_a(j)^2) = -sum_a w_a (c_a(i) - c_a(j))^2 + (row constant)

with a small weight on the looked-along axis and large weights on the others. Prefix (text)
tokens are keys that score `text_bias` below a query's best grid key; every token gets noise.
The order that puts the looked-along axis innermost makes each query's keys contiguous, so its
map becomes block-diagonal.
"""

from __future__ import annotations

import torch

from ..layout import TokenLayout

AXES = "FHW"


def planted_qk(
    layout: TokenLayout,
    axes: list[int],
    head_dim: int = 32,
    batch: int = 1,
    spread: float = 1.5,
    sharpness: float = 4.0,
    noise: float = 1.0,
    secondary: list[float] | None = None,
    text_bias: float = 4.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [batch, len(axes), N, head_dim] float32, with head h local along axis `axes[h]` (0=F,
    1=H, 2=W). `spread`: the attention width (in grid steps) along that axis; `sharpness`: the
    logit weight of the two other axes (large: keys must match there). `secondary[h]` (optional)
    is a weight in [0, 1] that blends in locality along the next axis, for heads that are not
    purely one-dimensional. Logits are returned pre-scaled so the default sm_scale (1/sqrt(D))
    applies."""
    if head_dim < 8:
        raise ValueError(f"head_dim must be >= 8 (7 feature dims + noise), got {head_dim}")
    F, Hh, W = layout.frames, layout.height, layout.width
    grid = torch.stack(
        torch.meshgrid(torch.arange(F), torch.arange(Hh), torch.arange(W), indexing="ij"), dim=-1
    ).reshape(-1, 3).float()  # [G, 3] row-major (f, y, x)
    G = grid.shape[0]
    N = layout.seq_len
    scale = head_dim ** 0.25  # q.k * D^-0.5 == features' dot product
    qs, ks = [], []
    for h, axis in enumerate(axes):
        weights = torch.full((3,), sharpness)
        weights[axis] = 1.0 / (2 * spread**2)
        if secondary is not None and secondary[h] > 0:
            other = (axis + 1) % 3
            weights[other] = (1 - secondary[h]) * sharpness + secondary[h] / (2 * spread**2)
        # noise lives on the dims after the 7 feature dims, so it perturbs logits by about
        # noise^2 * sqrt(head_dim - 7) whatever the size of the grid
        q = torch.zeros(batch, N, head_dim)
        k = torch.zeros(batch, N, head_dim)
        q[..., 7:] = torch.randn(batch, N, head_dim - 7, generator=generator) * noise
        k[..., 7:] = torch.randn(batch, N, head_dim - 7, generator=generator) * noise
        # Gaussian kernel features on dims 0..5: q = [2 w c, w], k = [c, -c^2] per axis; dim 6 lets
        # text keys score `text_bias` below a query's best grid key: q6 = sum w c^2 - text_bias, k6 = 1
        qg = torch.cat([2 * weights * grid, weights.expand(G, 3)], dim=-1)
        kg = torch.cat([grid, -(grid**2)], dim=-1)
        q[:, layout.prefix :, :6] += qg
        k[:, layout.prefix :, :6] += kg
        if layout.prefix:
            q[:, layout.prefix :, 6] += (weights * grid**2).sum(-1) - text_bias
            k[:, : layout.prefix, 6] += 1.0
        qs.append(q * scale)
        ks.append(k * scale)
    return torch.stack(qs, dim=1), torch.stack(ks, dim=1)


def innermost_axis(order: int) -> int:
    """Axis id (0=F, 1=H, 2=W) that an order enumerates innermost."""
    from ..layout import ORDERS

    return AXES.index(ORDERS[order][-1])
