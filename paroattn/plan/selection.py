"""From block statistics to decisions: each head's order, and block masks under one global budget.

Order metrics (lower score is better; all computed per (layer, head, candidate order)):

- "mass" (default): the fraction of attention mass *lost* when only the best `density` share of
  blocks is kept, averaged over the timestep buckets with the map of each bucket; this is the
  quantity the masks then optimize, so it is right by construction. Optionally the incoherence
  term below is added with weight `quant_weight`, relative to the mean over the candidate orders
  (0.01: an order 1% more incoherent than average pays 0.0001 of mass). Default 0 (measured).
- "paper": PAROAttention's combination `alpha * sparse + (1 - alpha) * quant`, each term divided by
  its sum over the orders. The paper does not give alpha nor the sign of the sparse term; here the
  block-sparse score (share of blocks in which >= 90% of P is below eps) is a benefit, so it enters
  with a minus sign: score = -alpha * S_o / sum(S) + (1 - alpha) * Q_o / sum(Q).

Incoherence of a block: max(P) / mean(P) inside it; a head's incoherence is the mean over its
blocks with nonzero mass. Both per-step quantities are averaged over the captured steps.
`benchmarks/order_metric.py` measures which metric picks better orders (BENCHMARKS.md, Calibration).
"""

from __future__ import annotations

import torch

METRICS = ("mass", "paper")


def block_entries(n: int, block_size: int, device=None) -> torch.Tensor:
    """float [nb, nb]: number of (query, key) pairs in each tile (the last row/column are partial)."""
    nb = -(-n // block_size)
    sizes = torch.full((nb,), float(block_size), device=device)
    sizes[-1] = n - (nb - 1) * block_size
    return sizes[:, None] * sizes[None, :]


def kept_mass_fraction(mass: torch.Tensor, density: float) -> torch.Tensor:
    """mass [..., nq, nk] -> [...]: share of the total mass held by the `density` best blocks."""
    flat = mass.flatten(-2)
    keep = max(1, min(flat.shape[-1], round(density * flat.shape[-1])))
    total = flat.sum(-1).clamp_min(torch.finfo(flat.dtype).tiny)
    return flat.topk(keep, dim=-1, sorted=False).values.sum(-1) / total


def incoherence(mass: torch.Tensor, pmax: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """[..., nq, nk] statistics of one step -> [...]: mean over blocks with mass of max(P)/mean(P).
    `entries` [nq, nk] counts the (query, key) pairs behind each tile (batch included)."""
    mean = mass / entries
    has_mass = mean > 0
    ratio = torch.where(has_mass, pmax / mean.clamp_min(torch.finfo(mean.dtype).tiny), torch.zeros_like(mean))
    return ratio.flatten(-2).sum(-1) / has_mass.flatten(-2).sum(-1).clamp_min(1)


def sparse_fraction(below: torch.Tensor, entries: torch.Tensor, share: float = 0.9) -> torch.Tensor:
    """[..., nq, nk] -> [...]: share of blocks in which at least `share` of P is below eps."""
    return (below >= share * entries).float().flatten(-2).mean(-1)


def order_scores(
    kept_mass: torch.Tensor,
    incoherence_mean: torch.Tensor,
    sparse_mean: torch.Tensor,
    metric: str = "mass",
    quant_weight: float = 0.0,
    alpha: float = 0.5,
) -> torch.Tensor:
    """Each input [..., O] (the last axis over candidate orders) -> scores [..., O], lower is better."""
    if metric == "mass":
        score = 1.0 - kept_mass
        if quant_weight:
            relative = incoherence_mean / incoherence_mean.mean(-1, keepdim=True).clamp_min(1e-12)
            score = score + quant_weight * relative
        return score
    if metric == "paper":
        sparse = sparse_mean / sparse_mean.sum(-1, keepdim=True).clamp_min(1e-12)
        quant = incoherence_mean / incoherence_mean.sum(-1, keepdim=True).clamp_min(1e-12)
        return -alpha * sparse + (1.0 - alpha) * quant
    raise ValueError(f"unknown order metric {metric!r}; expected one of {METRICS}")


def forced_blocks(num_blocks: int | tuple[int, int], prefix: int, block_size: int | tuple[int, int],
                  device=None, *, suffix: int = 0, seq_len: int = 0) -> torch.Tensor:
    """bool [nq, nk]: blocks every mask keeps: the diagonal (with query blocks larger than key blocks,
    every key block inside the query block's token range), and every block whose query or key range
    holds a prefix or suffix (text) token (neither is ever reordered, so these are the same blocks under
    every order; the suffix is the last `suffix` of `seq_len` tokens). Square blocks may be given as
    single ints."""
    nq, nk = (num_blocks, num_blocks) if isinstance(num_blocks, int) else num_blocks
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    rows = torch.arange(nq, device=device)[:, None]
    cols = torch.arange(nk, device=device)[None, :]
    forced = (cols * bk < (rows + 1) * bq) & ((cols + 1) * bk > rows * bq)
    text_rows, text_cols = -(-prefix // bq), -(-prefix // bk)
    if prefix:
        forced[:text_rows, :] = True
        forced[:, :text_cols] = True
    if suffix:
        start = seq_len - suffix
        forced[start // bq:, :] = True
        forced[:, start // bk:] = True
    return forced


def pool_query_blocks(mass: torch.Tensor, factor: int) -> torch.Tensor:
    """[..., nb, nk] block masses -> [..., ceil(nb / factor), nk]: the mass of query blocks `factor`
    times larger (sums of consecutive rows; the last may hold fewer)."""
    if factor == 1:
        return mass
    nb = mass.shape[-2]
    pad = -nb % factor
    if pad:
        mass = torch.nn.functional.pad(mass, (0, 0, 0, pad))
    return mass.unflatten(-2, (-1, factor)).sum(-2)


def dilate(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """bool [..., nq, nk] -> the same with every block within `radius` blocks (rows and columns) of a
    kept one kept too."""
    if radius <= 0:
        return mask
    shape = mask.shape
    flat = mask.reshape(-1, 1, *shape[-2:]).float()
    grown = torch.nn.functional.max_pool2d(flat, 2 * radius + 1, stride=1, padding=radius)
    return grown.bool().reshape(shape)


def _top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """bool, shaped like `scores`: its `count` largest finite entries."""
    chosen = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
    count = min(count, int(torch.isfinite(scores).sum()))
    if count > 0:
        chosen[scores.flatten().topk(count, sorted=False).indices] = True
    return chosen.view(scores.shape)


def dense_layer_indices(dense_layers, num_layers: int) -> list[int]:
    """Layer indices (negative ones count from the end, as in Python) -> sorted distinct indices."""
    out = set()
    for layer in dense_layers or ():
        if not -num_layers <= int(layer) < num_layers:
            raise ValueError(f"dense layer {layer} does not exist: the model has {num_layers} layers "
                             f"(indices 0..{num_layers - 1}, or negative from the end)")
        out.add(int(layer) % num_layers)
    return sorted(out)


def kept_blocks(shape, prefix: int, block_size: int | tuple[int, int], device=None, *, suffix: int = 0,
                seq_len: int = 0, dense_layers=()) -> torch.Tensor:
    """bool `shape` = [L, H, nq, nk]: the blocks `build_masks` keeps before spending its budget: the forced
    ones (`forced_blocks`) and every block of the dense layers."""
    L, H, nq, nk = shape
    forced = forced_blocks((nq, nk), prefix, block_size, device=device, suffix=suffix, seq_len=seq_len)
    kept = forced.expand(L, H, nq, nk).clone()
    kept[dense_layer_indices(dense_layers, L)] = True
    return kept


def build_masks(
    mass: torch.Tensor,
    density: float,
    prefix: int,
    block_size: int | tuple[int, int],
    *,
    suffix: int = 0,
    seq_len: int = 0,
    layer_floor: float = 0.0,
    dilation: int = 0,
    dense_layers=(),
) -> torch.Tensor:
    """mass [L, H, nq, nk] of one timestep bucket, in each head's chosen order -> bool masks.
    `suffix`, `seq_len`: text tokens after the grid (HunyuanVideo), kept like the prefix.

    One budget for the whole bucket: round(density * L * H * nq * nk) blocks, the forced ones
    (diagonal, prefix) first, the rest going to the blocks with the most mass wherever they are,
    so heads with spread-out attention get more blocks than heads with local attention. Masses are
    comparable across heads and layers because every row of P sums to one. If the forced blocks
    alone exceed the budget the masks hold only them (the achieved density then says so).

    - `dense_layers`: layers that keep every block (run densely); they are paid for out of the same
      budget, so the other layers get fewer blocks and the mean density stays `density`.
    - `layer_floor` in [0, 1]: each other layer first gets `layer_floor` times its equal share of the
      budget (the best blocks of that layer, whichever heads they are in), then the global competition
      shares the rest; 1 gives every sparse layer the same density.
    - `dilation`: the mass-ranked choice is grown by `dilation` blocks in every direction of the block
      grid (in each head's order), with as many seeds as leave the budget, then topped up by mass."""
    L, H, nq, nk = mass.shape
    if not 0.0 <= layer_floor <= 1.0:
        raise ValueError(f"layer_floor must be in [0, 1], got {layer_floor}")
    if dilation < 0:
        raise ValueError(f"dilation must be >= 0 blocks, got {dilation}")
    masks = kept_blocks(mass.shape, prefix, block_size, device=mass.device, suffix=suffix, seq_len=seq_len,
                        dense_layers=dense_layers)
    dense = dense_layer_indices(dense_layers, L)
    total = round(density * masks.numel())
    if dense and int(masks.sum()) > total:
        raise ValueError(f"dense layers {dense} alone hold {int(masks.sum()) / masks.numel():.3f} of the blocks, "
                         f"more than density {density}: keep fewer layers dense or raise the density")
    scores = mass.float().masked_fill(masks, float("-inf"))
    sparse_layers = [layer for layer in range(L) if layer not in dense]
    if layer_floor > 0 and sparse_layers:
        # the floor shares what the dense layers leave of the budget
        per_layer = round(layer_floor * (total - int(masks[dense].sum())) / len(sparse_layers))
        for layer in sparse_layers:
            want = per_layer - int(masks[layer].sum())
            if want > 0:
                masks[layer] |= _top(scores[layer], want)
        scores = scores.masked_fill(masks, float("-inf"))
    budget = total - int(masks.sum())
    if budget <= 0:
        return masks
    if dilation:
        low, high = 0, budget  # the most seeds whose grown set still fits the budget
        while low < high:
            seeds = (low + high + 1) // 2
            grown = dilate(_top(scores, seeds), dilation) & ~masks
            if int(grown.sum()) <= budget:
                low = seeds
            else:
                high = seeds - 1
        masks |= dilate(_top(scores, low), dilation)
        scores = scores.masked_fill(masks, float("-inf"))
        budget = total - int(masks.sum())
    masks |= _top(scores, budget)
    return masks


# -- how the budget is shared between timestep buckets --------------------------------------------
# A bucket's density costs in proportion to the denoising steps that fall in it: the budget is the mean
# density over steps, `sum_b w_b * d_b = density` with w_b the share of the steps in bucket b.

def step_shares(steps_per_bucket) -> list[float]:
    """Denoising steps per bucket -> each bucket's share of the steps (equal shares if none was counted)."""
    steps = [max(0.0, float(s)) for s in steps_per_bucket]
    total = sum(steps)
    if total == 0:
        return [1.0 / len(steps)] * len(steps)
    return [s / total for s in steps]


def leading_buckets(shares: list[float], share: float) -> list[int]:
    """The fewest leading buckets (bucket 0 holds the first, noisiest steps) whose steps make up at least
    `share` of all steps; none for share 0."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"dense_steps must be a share of the denoising steps in [0, 1), got {share}")
    chosen, covered = [], 0.0
    for b, w in enumerate(shares):
        if covered >= share - 1e-9:
            break
        chosen.append(b)
        covered += w
    return chosen


def bucket_densities(density: float, shares: list[float], dense_buckets: list[int]) -> list[float]:
    """Per-bucket densities: 1 in `dense_buckets`, the same density d' in the others, with
    `sum_b shares[b] * d_b = density`. Raises ValueError when the dense buckets alone spend the budget."""
    dense_share = sum(shares[b] for b in dense_buckets)
    if not dense_buckets:
        return [density] * len(shares)
    if density >= 1.0:
        return [1.0] * len(shares)
    if dense_share >= density:
        raise ValueError(
            f"dense buckets {dense_buckets} hold {dense_share:.3f} of the denoising steps, as much as density "
            f"{density} or more, which leaves nothing to the other buckets: keep fewer steps dense (dense_steps) "
            "or raise the density")
    rest = (density - dense_share) / (1.0 - dense_share)
    return [1.0 if b in dense_buckets else rest for b in range(len(shares))]


def shared_bucket_densities(masses: list[torch.Tensor], kept: list[torch.Tensor], density: float,
                            shares: list[float], dense_buckets: list[int]) -> list[float]:
    """Per-bucket densities from one budget over every (bucket, layer, head) block: a block of bucket b costs
    shares[b] (the steps it runs in), so the blocks with the most mass per step are chosen wherever they are,
    down to one mass threshold for all buckets, until `sum_b shares[b] * d_b = density`.

    masses[b] [L, H, nq, nk]: bucket b's block masses in the chosen orders (comparable across buckets, as every
    row of P sums to one); kept[b]: bool, the same shape, the blocks its masks keep whatever the budget (diagonal,
    text, dense layers). Buckets in `dense_buckets` are 1; a bucket without steps gets the density the sparse
    buckets would each have under per-bucket budgets. Raises ValueError as `bucket_densities` does."""
    uniform = bucket_densities(density, shares, dense_buckets)
    sparse = [b for b in range(len(masses)) if b not in dense_buckets and shares[b] > 0]
    if not sparse or density >= 1.0:
        return uniform
    total = masses[0].numel()
    forced = {b: int(kept[b].sum()) for b in sparse}
    budget = density * total - sum(shares[b] * total for b in dense_buckets) - sum(shares[b] * forced[b] for b in sparse)
    scores = {b: masses[b].float().masked_fill(kept[b], float("-inf")).flatten() for b in sparse}

    def cost(threshold: float) -> float:
        return sum(shares[b] * int((scores[b] >= threshold).sum()) for b in sparse)

    free = (masses[b].float()[~kept[b]] for b in sparse)  # the blocks the budget decides, one bucket at a time
    ranges = [(float(m.min()), float(m.max())) for m in free if m.numel()]
    counts = {b: 0 for b in sparse}
    if budget > 0 and ranges:
        # cost(high) is the cheapest non-empty choice, cost(low) takes every block
        low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
        if cost(low) <= budget:
            high = low
        elif cost(high) <= budget:
            for _ in range(60):  # the lowest threshold whose blocks fit the budget (cost falls as it rises)
                mid = 0.5 * (low + high)
                if cost(mid) <= budget:
                    high = mid
                else:
                    low = mid
        else:
            high = float("inf")
        counts = {b: int((scores[b] >= high).sum()) for b in sparse}
    out = list(uniform)
    for b in sparse:
        out[b] = (forced[b] + counts[b]) / total
    return out


# -- balanced GPUs under Ulysses ----------------------------------------------------------------------------------
# Each GPU runs a contiguous slice of a layer's heads, and the layer waits for the slice with the most active blocks.

BALANCED_RANKS = "balanced_ranks"  # the plan info entry: the number of GPUs whose slices its masks are balanced over

def ranks_problem(heads: int, ranks: int) -> str | None:
    """Why masks of `heads` heads per layer cannot be balanced over `ranks` GPUs' equal slices of heads, or None."""
    if ranks < 1:
        return f"a number of GPUs >= 1 is needed to balance the masks over, got {ranks}"
    if heads % ranks:
        divisors = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        return (f"balancing for {ranks} GPUs splits the {heads} heads per layer in {ranks} equal slices, and {ranks} does "
                f"not divide {heads}: pass a number of GPUs that divides {heads} ({divisors})")
    return None


def rank_blocks(masks: torch.Tensor, ranks: int) -> torch.Tensor:
    """bool [..., H, nq, nk] -> int64 [..., ranks]: active blocks of each GPU's contiguous slice of the heads."""
    return masks.sum(dim=(-1, -2)).unflatten(-1, (ranks, -1)).sum(-1)


def balance_layer(mask: torch.Tensor, mass: torch.Tensor, ranks: int, forced: torch.Tensor) -> torch.Tensor:
    """One layer's masks bool [H, nq, nk] -> the same number of blocks, as many (to one block) in each of the `ranks`
    contiguous slices of the heads, moving as few as that takes: a slice over its share drops its kept blocks of
    least `mass` [H, nq, nk], one under it takes its free blocks of most mass (the extra blocks of a total the ranks
    do not divide stay with the slices that hold the most). `forced` [nq, nk]: blocks never dropped (diagonal, text)."""
    heads = mask.shape[0]
    if problem := ranks_problem(heads, ranks):
        raise ValueError(problem)
    out = mask.clone()
    if ranks == 1:
        return out
    slices = out.view(ranks, heads // ranks, *out.shape[1:])
    masses = mass.float().view(ranks, heads // ranks, *mass.shape[1:])
    counts = slices.flatten(1).sum(1)
    share, extra = divmod(int(counts.sum()), ranks)
    targets = torch.full_like(counts, share)
    targets[counts.argsort(descending=True, stable=True)[:extra]] += 1
    for r, change in enumerate((targets - counts).tolist()):
        if change < 0:
            removable = slices[r] & ~forced.to(out.device)
            slices[r] &= ~_top((-masses[r]).masked_fill(~removable, float("-inf")), -change)
        elif change > 0:
            slices[r] |= _top(masses[r].masked_fill(slices[r], float("-inf")), change)
    return out


def balance_masks(masks: torch.Tensor, mass: torch.Tensor, ranks: int, forced: torch.Tensor) -> torch.Tensor:
    """`balance_layer` of every layer of one bucket's masks [L, H, nq, nk] (masses alike): each layer keeps its
    blocks, so the bucket's budget is unchanged; layers kept whole (dense) are balanced already."""
    return torch.stack([balance_layer(m, w, ranks, forced) for m, w in zip(masks, mass)])
