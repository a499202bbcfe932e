"""One plan for every generation size: a description of each head's attention that does not depend on the
grid, and the block masks it gives for any grid of the same model.

The description: for each (timestep bucket, layer, head) and each grid axis (frames, rows, columns), the
attention mass a query gives to keys at each offset along that axis (`ProfileAccumulator`, measured at
calibration from a sample of queries of the dense model). Video DiT heads are local along axes, with RoPE
making a score a function of the offset, not of the position or the grid's size, so the offset is what
carries over to another size. A head's attention is modelled as the product of its three axis kernels,
each row-normalized on the new grid:

    P(i, j) = K_F[f_i, f_j] * K_H[y_i, y_j] * K_W[x_i, x_j],    K_a[u, v] = w_a(v - u) / sum_v' w_a(v' - u)

The offset weights w_a are fitted to the measured profile on the calibrated axis (`offset_weights`): a
query near the border spreads its mass over fewer keys, which raises the mean mass at large offsets, and
the fit takes that out. Offsets beyond the calibrated grid (a larger grid) take the outermost weight on
that side (a flat tail). `block_masses` sums this P over every (query block, key block) of an order on
the new layout exactly, through 2-D prefix sums of the axis kernels (a contiguous token range of an order
is at most three boxes of the grid). `derive_plan` then decides as calibration does, from these masses
instead of measured ones: each head's order (the one keeping the most mass at the bucket densities), and
masks under one budget per bucket (`selection.build_masks`) at the calibrated plan's bucket densities.
`ShapePlans` is what a processor asks for the plan of a call's layout: the calibrated plan where the
layout is one of its calibrated shapes, else one derived from the closest calibrated shape, once per
layout (cached). How close derived plans come to plans calibrated at that size: QUALITY.md, One plan,
many sizes.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from ..errors import PlanError
from ..layout import ORDERS, TokenLayout
from .model import Plan
from .selection import BALANCED_RANKS, balance_masks, build_masks, forced_blocks, kept_mass_fraction

AXES = "FHW"
PROFILE_OF_AXIS = {"F": 0, "H": 1, "W": 2}  # the profile (index into a plan's profiles) that describes each axis


# -- measuring: per-axis offset profiles from q, k --------------------------------------------------------

def axis_sizes(layout: TokenLayout) -> tuple[int, int, int]:
    return layout.frames, layout.height, layout.width


def offset_mass(q: torch.Tensor, k: torch.Tensor, layout: TokenLayout, queries: int = 1024,
                generator: torch.Generator | None = None, suffix_mask: torch.Tensor | None = None,
                chunk_bytes: int = 64 << 20) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Attention mass by offset along each grid axis, from grid queries of q, k [B, H, N, D] (after norms and
    RoPE, as the model attends). Returns (mass, count) per axis F, H, W: mass [H, 2n-1] float64, the sum over
    the sampled queries (and the batch) of the mass each gives to the grid keys at offset v - u (index
    offset + n - 1), and count [2n-1], how many sampled queries have that offset inside the grid. All grid
    queries when there are at most `queries`, else `queries` drawn without replacement. `suffix_mask` [B, suffix]
    (False at padded text keys after the grid) leaves those keys out of the softmax, as the model does."""
    B, H, N, D = q.shape
    F, Hh, W = axis_sizes(layout)
    G, prefix = layout.grid_tokens, layout.prefix
    if N != layout.seq_len:
        raise ValueError(f"q has {N} tokens; the layout {layout} has {layout.seq_len}")

    def grid_coords(index: torch.Tensor) -> torch.Tensor:
        """[S] grid token indices -> [S, 3] their (frame, row, column)"""
        return torch.stack([index // (Hh * W), (index // W) % Hh, index % W], dim=-1)

    if G <= queries:
        picked = torch.arange(G)
    else:
        picked = torch.randperm(G, generator=generator)[:queries].sort().values
    coords = grid_coords(picked)  # [S, 3]
    sizes = (F, Hh, W)
    mass = [torch.zeros(H, 2 * n - 1, dtype=torch.float64, device=q.device) for n in sizes]
    count = [torch.zeros(2 * n - 1, dtype=torch.float64) for n in sizes]
    for axis, n in enumerate(sizes):
        index = torch.arange(n)[None, :] - coords[:, axis : axis + 1] + n - 1  # [S, n]
        count[axis].index_add_(0, index.flatten(), torch.full((index.numel(),), float(B), dtype=torch.float64))
    scale = D ** -0.5
    # on the device once, through pinned memory: a pageable host tensor moved to the GPU synchronises the stream
    # (torch waits for the copy), and inside the loop that left the GPU idle while each chunk's launches were queued
    picked_on_device = picked.pin_memory().to(q.device, non_blocking=True) if q.is_cuda else picked
    grid_rows = picked_on_device + prefix
    padded = None if suffix_mask is None else ~suffix_mask.to(q.device)[:, None, None, :]
    # each sampled query's marginals along each axis, summed over the batch ([H, S, n]), added by offset at the end:
    # per chunk only the few large passes run, not a dozen small launches per axis
    marginals = [torch.empty(H, len(picked), n, device=q.device) for n in sizes]
    # float32 keys and logits of a few heads at a time: a capture runs inside the model's own generation, whose
    # GPU memory it should barely raise (one chunk's keys, logits and probabilities: about 3 x chunk_bytes)
    heads = max(1, min(H, chunk_bytes // (B * N * D * 4)))
    for h0 in range(0, H, heads):
        hs = slice(h0, min(H, h0 + heads))
        keys = k[:, hs].float()
        step = max(1, chunk_bytes // (B * keys.shape[1] * N * 4))
        for start in range(0, len(picked), step):
            rows = grid_rows[start : start + step]
            logits = torch.einsum("bhsd,bhnd->bhsn", q[:, hs, rows].float(), keys) * scale
            if suffix_mask is not None:
                logits[..., N - layout.suffix:] = logits[..., N - layout.suffix:].masked_fill(padded, float("-inf"))
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            p = torch.exp(logits[..., prefix : prefix + G] - lse).view(B, keys.shape[1], -1, F, Hh, W)  # the grid keys
            del logits
            frames_rows = p.sum(dim=5)  # [B, h, s, F, Hh]: the F and H marginals from it, without another full pass
            taken = slice(start, start + p.shape[2])
            marginals[0][hs, taken] = frames_rows.sum(dim=(0, 4))
            marginals[1][hs, taken] = frames_rows.sum(dim=(0, 3))
            marginals[2][hs, taken] = p.sum(dim=(0, 3, 4))
    coords = grid_coords(picked_on_device)
    for axis, n in enumerate(sizes):
        index = torch.arange(n, device=q.device)[None, :] - coords[:, axis : axis + 1] + n - 1  # [S, n]
        mass[axis].index_add_(1, index.flatten(), marginals[axis].reshape(H, -1).double())
    return [m.cpu() for m in mass], count


class ProfileAccumulator:
    """Sums of `offset_mass` per (bucket, layer) over captured steps; `finalize` gives the profiles."""

    def __init__(self, num_layers: int, num_buckets: int, layout: TokenLayout, num_heads: int):
        self.layout = layout
        sizes = axis_sizes(layout)
        self.mass = [torch.zeros(num_buckets, num_layers, num_heads, 2 * n - 1, dtype=torch.float64) for n in sizes]
        self.count = [torch.zeros(num_buckets, num_layers, 2 * n - 1, dtype=torch.float64) for n in sizes]

    def add(self, layer: int, bucket: int, mass: list[torch.Tensor], count: list[torch.Tensor]) -> None:
        for axis in range(3):
            self.mass[axis][bucket, layer] += mass[axis]
            self.count[axis][bucket, layer] += count[axis]

    def join_heads(self, join) -> None:
        """Replace the per-head sums t by `join(t, dim)`, dim their head dimension (`StatsAccumulator.join_heads`)."""
        self.mass = [join(mass, 2) for mass in self.mass]

    def finalize(self) -> list[torch.Tensor]:
        """Per axis float32 [buckets, L, H, 2n-1]: mean mass per query at each offset. A (bucket, layer) without
        captured steps borrows the mean over the buckets that have them."""
        profiles = []
        for mass, count in zip(self.mass, self.count):
            seen = count.sum(-1) > 0  # [buckets, L]
            overall_mass, overall_count = mass.sum(0), count.sum(0)  # [L, H, 2n-1], [L, 2n-1]
            mass = torch.where(seen[..., None, None], mass, overall_mass[None])
            count = torch.where(seen[..., None], count, overall_count[None])
            profiles.append((mass / count[:, :, None, :].clamp_min(1)).float())
        return profiles


# -- deriving: block masses of the product model on any layout ---------------------------------------------

def offset_weights(profile: torch.Tensor, iterations: int = 50) -> torch.Tensor:
    """profile [..., 2n-1] (`ProfileAccumulator.finalize`: mean mass per query at each offset, queries spread
    evenly over an axis of n positions) -> offset weights w [..., 2n-1], the largest 1 (float64), whose
    row-normalized kernel w(v - u) / sum_v' w(v' - u) on that axis gives the measured mass at every offset.
    Iterative proportional fitting: each pass scales w(d) by measured / modelled mass at offset d."""
    p = profile.double().clamp_min(0)
    n = (p.shape[-1] + 1) // 2
    offsets = torch.arange(n, device=p.device)[None, :] - torch.arange(n, device=p.device)[:, None] + n - 1
    # total mass at each offset over the n queries, rescaled to the n that rows of a kernel hold (text keys
    # took the rest of each query's mass)
    target = p * (n - (torch.arange(2 * n - 1, device=p.device) - (n - 1)).abs())
    target = target * n / target.sum(-1, keepdim=True).clamp_min(1e-300)
    w = p / p.amax(-1, keepdim=True).clamp_min(1e-300)
    for _ in range(iterations):
        kernel = w[..., offsets]  # [..., u, v]
        kernel = kernel / kernel.sum(-1, keepdim=True).clamp_min(1e-300)
        modelled = torch.zeros_like(w).index_add_(-1, offsets.flatten(), kernel.flatten(-2))
        w = torch.where(modelled > 0, w * target / modelled.clamp_min(1e-300), torch.zeros_like(w))
        w = w / w.amax(-1, keepdim=True).clamp_min(1e-300)
    return w


def _extended(weights: torch.Tensor, n: int) -> torch.Tensor:
    """weights [..., 2m-1] over offsets -(m-1)..m-1 -> [..., 2n-1] over -(n-1)..n-1: cut, or extended with
    the outermost value on each side."""
    m = (weights.shape[-1] + 1) // 2
    if n <= m:
        return weights[..., m - n : m + n - 1]
    left = weights[..., :1].expand(*weights.shape[:-1], n - m)
    right = weights[..., -1:].expand(*weights.shape[:-1], n - m)
    return torch.cat([left, weights, right], dim=-1)


def axis_kernel_sums(weights: torch.Tensor, n: int) -> torch.Tensor:
    """offset weights [..., 2m-1] -> D [..., n+1, n+1] float64: D[u, v] = sum over x < u, y < v of the
    row-normalized kernel K[x, y] = w(y - x) / sum_y' w(y' - x) on an axis of n positions."""
    p = _extended(weights.double().clamp_min(0), n)
    offsets = torch.arange(n)[None, :] - torch.arange(n)[:, None] + n - 1  # [x, y] -> index of y - x
    kernel = p[..., offsets]  # [..., n, n]
    rows = kernel.sum(-1, keepdim=True)
    kernel = torch.where(rows > 0, kernel / rows.clamp_min(1e-300), torch.full_like(kernel, 1.0 / n))
    out = torch.zeros(*kernel.shape[:-2], n + 1, n + 1, dtype=torch.float64, device=kernel.device)
    out[..., 1:, 1:] = kernel.cumsum(-1).cumsum(-2)
    return out


# A prefix of the grid tokens of an order (outer axis a, middle b, inner c, sizes na, nb, nc), the tokens
# before position (u_a, u_b, u_c), is three boxes: outer < u_a (every b, c); outer = u_a, middle < u_b (every
# c); outer = u_a, middle = u_b, inner < u_c. The mass between a query prefix (s) and a key prefix (t) is the
# sum over the 3 x 3 box pairs of the product of one kernel sum per axis. Kernel rows sum to one, so a sum
# over every key of an axis is the number of queries in the range, and the 9 pairs group by their outer
# axis factor as
#   H(s, t) = A_PP nb nc + A_PO (colB_P(t) nc + colB_O(t) colC_P(t)) + A_OP (s_b nc + s_c)
#           + A_OO (B_PP nc + B_PO colC_P(t) + B_OP s_c + B_OO C_PP)
# with X_PP = sum over x < u, y < v of K_X[x, y], X_PO = sum over x < u of K_X[x, v], X_OP = sum over y < v of
# K_X[u, y], X_OO = K_X[u, v] (u the query's coordinate on axis X, v the key's), and colX_P(t), colX_O(t) the
# kernel's column sums over y < v and at y = v.

def _corner_tables(D: torch.Tensor) -> dict[str, torch.Tensor]:
    """D [..., n+1, n+1] (`axis_kernel_sums`) -> X_PP, X_PO, X_OP, X_OO [..., n+1, n+1] as above (a point at
    u = n is empty)."""
    n = D.shape[-1] - 1
    nxt = torch.arange(1, n + 2, device=D.device).clamp_max(n)  # u + 1, clamped: the point at n is empty
    up = D[..., nxt, :]  # D[u + 1, v]
    return {"PP": D, "PO": D[..., :, nxt] - D, "OP": up - D, "OO": up[..., :, nxt] - up - D[..., :, nxt] + D}


def block_masses(weights: list[torch.Tensor], order: int, layout: TokenLayout, block_size: tuple[int, int],
                 device=None) -> torch.Tensor:
    """Attention mass of every (query block, key block) of one order on `layout` under the product model.
    weights: offset weights (`offset_weights`) per axis F, H, W, [heads, 2m-1] (any m). Returns float32
    [heads, nq, nk] over the whole sequence (text blocks hold 0: plans keep them whatever their mass); each grid
    query's row sums to one."""
    bq, bk = block_size
    prefix, G = layout.prefix, layout.grid_tokens
    sizes = dict(zip(AXES, axis_sizes(layout)))
    name = ORDERS[order]
    na, nb, nc = (sizes[a] for a in name)  # outer, middle, inner
    nq, nk = -(-layout.seq_len // bq), -(-layout.seq_len // bk)

    def coords(bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = (bounds - prefix).clamp(0, G)  # grid tokens before each block boundary
        return g // (nb * nc), (g // nc) % nb, g % nc

    sa, sb, sc = coords(torch.arange(nq + 1, device=device) * bq)
    ta, tb, tc = coords(torch.arange(nk + 1, device=device) * bk)
    A, B, C = (_corner_tables(axis_kernel_sums(weights[PROFILE_OF_AXIS[axis]].to(device), n))
               for axis, n in zip(name, (na, nb, nc)))

    def pair(table: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [h, n+1, n+1] -> [h, S, T]
        return table.index_select(-1, v).index_select(-2, u)  # whole rows copied last: the fast way round

    def col(table: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # column sums over every query -> [h, 1, T]
        n = table.shape[-1] - 1
        return table[..., n, :].index_select(-1, v)[:, None, :]

    sb_, sc_ = sb.double()[None, :, None], sc.double()[None, :, None]
    colB_P, colB_O, colC_P = col(B["PP"], tb), col(B["PO"], tb), col(C["PP"], tc)
    H = pair(A["PP"], sa, ta) * (nb * nc)
    H += pair(A["PO"], sa, ta) * (colB_P * nc + colB_O * colC_P)
    H += pair(A["OP"], sa, ta) * (sb_ * nc + sc_)
    inner = pair(B["PP"], sb, tb) * nc
    inner += pair(B["PO"], sb, tb) * colC_P
    inner += pair(B["OP"], sb, tb) * sc_
    inner += pair(B["OO"], sb, tb) * pair(C["PP"], sc, tc)
    H += pair(A["OO"], sa, ta) * inner
    mass = H[:, 1:, 1:] - H[:, :-1, 1:] - H[:, 1:, :-1] + H[:, :-1, :-1]
    return mass.clamp_min(0).float()


def layer_block_masses(weights: list[torch.Tensor], orders: torch.Tensor, layout: TokenLayout,
                       block_size: tuple[int, int], device=None) -> torch.Tensor:
    """Offset weights per axis [H, 2m-1] of one (bucket, layer), orders [H] -> [H, nq, nk] in each head's order."""
    H = orders.shape[0]
    nq, nk = -(-layout.seq_len // block_size[0]), -(-layout.seq_len // block_size[1])
    out = torch.empty(H, nq, nk, device=device)
    for order in orders.unique().tolist():
        heads = (orders == order).nonzero().flatten()
        out[heads.to(out.device)] = block_masses([w[heads] for w in weights], int(order), layout, block_size, device)
    return out


def order_kept_mass(weights: list[torch.Tensor], layout: TokenLayout, block_size: tuple[int, int], density: float,
                    device=None) -> torch.Tensor:
    """Offset weights per axis [H, 2m-1] of one (bucket, layer) -> float64 [H, O]: the share of each head's mass
    that its best `density` share of blocks keeps under each distinct order of `layout` (`distinct_orders`)."""
    return torch.stack([kept_mass_fraction(block_masses(weights, order, layout, block_size, device), density).double()
                        .cpu() for order in layout.distinct_orders()], dim=-1)


def choose_orders(weights: list[list[torch.Tensor]], plan: Plan, layout: TokenLayout, densities: list[float],
                  device=None) -> torch.Tensor:
    """Each head's order on `layout`, chosen as calibration chooses it (`StatsAccumulator.finalize`) from the
    product model's masses: the distinct order of the layout whose best `densities[b]` share of blocks keeps the
    most mass, averaged over the buckets weighted by their captured steps. weights[b][layer]: that (bucket,
    layer)'s offset weights per axis. Layers dense in every bucket keep the plan's orders. int [L, H]."""
    steps = [float(s) for s in plan.info.get("steps_per_bucket") or []]
    if len(steps) != plan.num_buckets or sum(steps) <= 0:
        steps = [1.0] * plan.num_buckets
    candidates = torch.tensor(layout.distinct_orders())
    orders = plan.orders.clone()
    for layer in range(plan.num_layers):
        buckets = [b for b in range(plan.num_buckets) if not bool(plan.dense[b, layer]) and steps[b] > 0]
        if buckets:
            kept = sum(steps[b] * order_kept_mass(weights[b][layer], layout, plan.block_size, densities[b], device)
                       for b in buckets)
            orders[layer] = candidates[kept.argmax(-1)].to(orders.dtype)
    return orders


def derive_plan(plan: Plan, layout: TokenLayout, device=None) -> Plan:
    """The plan for `layout` from a plan calibrated at another size of the same model: its dense flags, buckets
    and modes; each head's order (`choose_orders`) and masks built from its axis profiles with the calibration's
    budget at each bucket's calibrated density; balanced over GPUs where the plan is (`balance.py`)."""
    if plan.profiles is None:
        raise PlanError(f"the plan calibrated for {plan.layout} holds no axis profiles to derive other sizes from")
    start = time.perf_counter()
    B, L = plan.num_buckets, plan.num_layers
    weights = [[[offset_weights(p[b, layer].to(device)) for p in plan.profiles] for layer in range(L)]
               for b in range(B)]
    densities = [float(plan.density[b].mean()) for b in range(B)]
    orders = choose_orders(weights, plan, layout, densities, device)
    masks = []
    for b in range(B):
        dense_layers = [layer for layer in range(L) if bool(plan.dense[b, layer])]
        if len(dense_layers) == L:
            nq, nk = -(-layout.seq_len // plan.block_size[0]), -(-layout.seq_len // plan.block_size[1])
            masks.append(torch.ones(L, plan.num_heads, nq, nk, dtype=torch.bool))
            continue
        mass = torch.stack([layer_block_masses(weights[b][layer], orders[layer].long(), layout, plan.block_size,
                                               device) for layer in range(L)])
        mask = build_masks(mass, densities[b], layout.prefix, plan.block_size, suffix=layout.suffix,
                           seq_len=layout.seq_len, dense_layers=dense_layers)
        if (ranks := int(plan.info.get(BALANCED_RANKS) or 1)) > 1:
            forced = forced_blocks(mask.shape[-2:], layout.prefix, plan.block_size, device=mask.device,
                                   suffix=layout.suffix, seq_len=layout.seq_len)
            mask = balance_masks(mask, mass, ranks, forced)
        masks.append(mask.cpu())
    info = {key: value for key, value in plan.info.items() if key not in ("stats_file", "kept_mass", "kept_mass_min")}
    info["derived_from"] = list(plan.layout.fields)
    info["derive_s"] = time.perf_counter() - start
    return replace(plan, layout=layout, orders=orders, block_mask=torch.stack(masks), density=None, info=info,
                   profiles=None, extra_shapes=[])


def shape_distance(a: TokenLayout, b: TokenLayout) -> float:
    """How far two layouts are apart: the sum over the grid axes of |log(size ratio)|, text length last."""
    grid = sum(abs(math.log(x / y)) for x, y in zip(axis_sizes(a), axis_sizes(b)))
    return grid + 1e-3 * abs((a.prefix + a.suffix) - (b.prefix + b.suffix))


class ShapePlans:
    """The plan of each layout a processor meets: a calibrated shape's own plan, or one derived from the
    closest calibrated shape (once per layout, then cached; `derived` lists them)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.calibrated = {p.layout: p for p in plan.calibrated_plans()}
        self.derived: dict[TokenLayout, Plan] = {}
        self._sliced: dict[tuple[TokenLayout, tuple[int, int] | None], Plan] = {}

    def problem(self, layout: TokenLayout) -> str | None:
        """Why no plan can be had for `layout` (None: calibrated or derivable)."""
        if layout in self.calibrated:
            return None
        source = self.closest(layout)
        if source.profiles is None:
            made = ("plan format version 1 predates them" if source.format_version < 2 else
                    "it was calibrated without them")
            return (f"the plan holds no axis profiles ({made}), so it serves only its calibrated size; a plan "
                    "calibrated by this paroattn derives masks for every size of the model")
        if (layout.prefix > 0) != (source.layout.prefix > 0) or (layout.suffix > 0) != (source.layout.suffix > 0):
            return (f"the call's text tokens ({layout.prefix} before the grid, {layout.suffix} after) are laid out "
                    f"unlike the plan's ({source.layout.prefix} before, {source.layout.suffix} after)")
        return None

    def closest(self, layout: TokenLayout) -> Plan:
        return min(self.calibrated.values(), key=lambda p: shape_distance(p.layout, layout))

    def at(self, layout: TokenLayout, heads: tuple[int, int] | None = None, device=None) -> Plan:
        """The plan for `layout` (heads `heads[0]..heads[1]-1` of it when given), derived on `device` (the
        call's: the work is that of building masks) the first time. Raises PlanError when `problem(layout)`
        says why there is none."""
        key = (layout, heads)
        if key in self._sliced:
            return self._sliced[key]
        plan = self.calibrated.get(layout) or self.derived.get(layout)
        if plan is None:
            if problem := self.problem(layout):
                raise PlanError(problem)
            plan = self.derived[layout] = derive_plan(self.closest(layout), layout, device)
        self._sliced[key] = plan if heads is None else plan.head_slice(*heads)
        return self._sliced[key]
