"""Averaging block statistics over prompts and denoising steps, then deciding orders and masks.

Per (timestep bucket, layer) the accumulator keeps the mean of the block-mass maps of every
candidate order in the masks' blocks, [H, O, nq, nk] (query blocks of `query_block`, summed from the statistics'
square blocks as each map arrives: the selection reads nothing finer), and how many (batch item, step) maps went
into it. The per-step maxima and counts below eps are only needed as per-head scalars (incoherence, block-sparse
score) and are reduced at once. Maps of the bucket currently being captured are summed in float32 on the device
that computed them, or on `staging_device`, and folded into the stored mean when the bucket changes (a few times
per prompt). The stored means are float16 (each entry is at most the query block's rows, and one rounding per fold
keeps them within ~1e-3 of the float32 mean): memory is buckets * L * H * O * nq * nk * 2 bytes (CogVideoX-5B with
6 buckets and 128-row query blocks: 5.6 GB; Wan2.1-1.3B: 3.4 GB), kept in `store_device` (host memory by default
on CUDA when it would not fit comfortably on the GPU).

Staged in host memory, a GPU map travels through a pinned buffer, asynchronously: it is summed when the next map
arrives (by then the copy has long finished), so a captured call never waits for its own statistics. It travels in
float32: twice the bytes over the bus (a fraction of a millisecond), where widening float16 in host memory would
cost the CPU several times the sum itself.

A capture that chose each head's order while it ran (`CaptureConfig.order_steps`) calls `fix_orders` before
its first map: the accumulator then keeps one map per head, [H, 1, nb, nb] in the head's chosen order (the
memory of one order instead of six), and `finalize` keeps those orders and their scores. A capture that narrows
the candidates after its first bucket (`CaptureConfig.keep_orders`) calls `keep_orders`: the maps stored so far
keep each head's K kept orders, later maps come as [H, K, nb, nb], and `finalize` chooses among the K.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..plan.selection import (
    balance_masks,
    block_entries,
    bucket_densities,
    build_masks,
    dense_layer_indices,
    forced_blocks,
    incoherence,
    kept_blocks,
    kept_mass_fraction,
    leading_buckets,
    order_scores,
    pool_query_blocks,
    shared_bucket_densities,
    sparse_fraction,
    step_shares,
)


@dataclass
class CalibrationResult:
    candidate_orders: list[int]  # indices into ORDERS, the candidates that were measured
    orders: torch.Tensor  # int64 [L, H], indices into ORDERS
    block_mask: torch.Tensor  # bool [buckets, L, H, nq, nk]
    density: torch.Tensor  # float [buckets, L, H]: achieved block density
    kept_mass: torch.Tensor  # float [buckets, L, H]: share of attention mass inside the mask
    scores: torch.Tensor  # float [L, H, O]: order scores (lower is better)
    steps_per_bucket: list[int]  # captured (prompt, step) pairs per bucket
    # block-mass maps averaged over all buckets, for figures: [L_fig, H, nq, nk] in the original
    # order (FHW) and in each head's chosen order, for the layers in `figure_layers`
    figure_layers: list[int]
    figure_original: torch.Tensor | None
    figure_reordered: torch.Tensor | None
    dense_layers: list[int] = field(default_factory=list)  # layers whose masks keep every block (run densely)
    dense_buckets: list[int] = field(default_factory=list)  # leading buckets whose masks keep every block
    bucket_density: list[float] = field(default_factory=list)  # the density each bucket's masks were built for
    step_shares: list[float] = field(default_factory=list)  # share of the denoising steps in each bucket


class StatsAccumulator:
    def __init__(
        self,
        num_layers: int,
        num_buckets: int,
        candidate_orders: list[int],
        seq_len: int,
        block_size: int,
        store_device: torch.device | str = "cpu",
        store_dtype: torch.dtype = torch.float16,
        query_block: int | None = None,
        staging_device: torch.device | str | None = None,
    ):
        """Statistics come in square blocks of `block_size`; the masks (and the order choice) use query
        blocks of `query_block` (a multiple of it, default the same) by summing consecutive rows. The current
        bucket's sums are staged on `staging_device` (None: where each map was computed)."""
        self.num_layers = num_layers
        self.num_buckets = num_buckets
        self.candidate_orders = list(candidate_orders)
        self.seq_len = seq_len
        self.block_size = block_size
        query_block = query_block or block_size
        if query_block % block_size:
            raise ValueError(f"query_block must be a multiple of block_size {block_size}, got {query_block}")
        self.mask_block = (query_block, block_size)  # (bq, bk) of the masks
        self.store_device = torch.device(store_device)
        self.store_dtype = store_dtype
        self.staging_device = None if staging_device is None else torch.device(staging_device)
        self.mass: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, layer) -> [H, O, nq, nk] means
        self.weight = torch.zeros(num_buckets, num_layers)  # maps averaged into mass, batch items counted
        self.incoherence_sum: dict[int, torch.Tensor] = {}  # layer -> [H, O]
        self.sparse_sum: dict[int, torch.Tensor] = {}
        self.scalar_count = torch.zeros(num_layers)
        self.steps_per_bucket = [0] * num_buckets
        # the current bucket's float32 sums, [L, *map shape] in one tensor kept from bucket to bucket, and the batch
        # items summed into each layer's slot: one allocation, not one per layer and bucket, whose freed pieces the
        # host allocator keeps (1 GB of a CogVideoX-5B capture's host memory)
        self._staging: torch.Tensor | None = None
        self._staged_weight: dict[int, float] = {}
        # bucket -> [L, *map shape] the stored means, one tensor per bucket (mass[(bucket, layer)] are its slots)
        self._store: dict[int, torch.Tensor] = {}
        self._staging_bucket: int | None = None
        self._entries: dict[torch.device, torch.Tensor] = {}
        self._pinned: dict[tuple[int, ...], torch.Tensor] = {}  # shape -> host buffer of the GPU map in flight
        self._in_flight: tuple | None = None  # (layer, buffer, copy done, batch items)
        # [L, H, K] slots into candidate_orders of the orders each head's maps hold (fix_orders: K = 1; keep_orders)
        self.kept_slots: torch.Tensor | None = None
        self.fixed_scores: torch.Tensor | None = None  # [L, H, O] the scores fix_orders chose by

    def fix_orders(self, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Keep the order `slots` [L, H] (indices into candidate_orders) of every head, chosen by `scores`
        [L, H, O] (lower is better): from now on `add` takes maps [H, 1, nb, nb] in each head's order."""
        if self.mass or self._staged_weight:
            raise RuntimeError("fix_orders comes before the first map: maps of every order were added already")
        O = len(self.candidate_orders)
        if slots.dim() != 2 or slots.shape[0] != self.num_layers or tuple(scores.shape) != (*slots.shape, O):
            raise ValueError(f"fix_orders takes slots [L={self.num_layers}, H] and scores [L, H, {O}]; got "
                             f"{tuple(slots.shape)} and {tuple(scores.shape)}")
        if int(slots.min()) < 0 or int(slots.max()) >= O:
            raise ValueError(f"order slots must index the {O} candidate orders, got {slots.unique().tolist()}")
        self.kept_slots, self.fixed_scores = slots.long().cpu()[..., None], scores.float().cpu()

    def keep_orders(self, slots: torch.Tensor) -> None:
        """Keep the orders `slots` [L, H, K] (distinct indices into candidate_orders per head) of every head: the maps
        stored so far keep those K, and from now on `add` takes maps [H, K, nb, nb] in those orders."""
        O = len(self.candidate_orders)
        if self.kept_slots is not None:
            raise RuntimeError("the orders were narrowed already")
        if slots.dim() != 3 or slots.shape[0] != self.num_layers or not 1 <= slots.shape[2] <= O:
            raise ValueError(f"keep_orders takes slots [L={self.num_layers}, H, K <= {O}]; got {tuple(slots.shape)}")
        slots = slots.long().cpu()
        if int(slots.min()) < 0 or int(slots.max()) >= O:
            raise ValueError(f"order slots must index the {O} candidate orders, got {slots.unique().tolist()}")
        # every captured map narrowed into new stores, the staged sums among them without a wide store first (at
        # CogVideoX-5B the wide float16 means of the first bucket would add 0.9 GB to the 1.8 GB of its sums)
        self._land()
        keys = set(self.mass) | {(self._staging_bucket, layer) for layer in self._staged_weight}
        old = self._store
        self._store = {}
        for bucket, layer in sorted(keys):
            mean = self.mean_map(bucket, layer, self.store_device)
            pick = slots[layer].to(mean.device)
            narrowed = mean[torch.arange(pick.shape[0], device=mean.device)[:, None], pick]
            self._slot(bucket, layer, narrowed.shape).copy_(narrowed)
        del old
        self._staging, self._staged_weight, self._staging_bucket = None, {}, None
        for sums in (self.incoherence_sum, self.sparse_sum):
            for layer, total in sums.items():
                sums[layer] = total.gather(1, slots[layer])
        self.kept_slots = slots

    def stored_bytes(self) -> int:
        """Bytes of the stored means (what the accumulator holds between buckets)."""
        return sum(t.numel() * t.element_size() for t in self.mass.values())

    def add(self, layer: int, bucket: int, mass: torch.Tensor, pmax: torch.Tensor, below: torch.Tensor, batch: int):
        """Statistics of one layer at one step, [H, O, nb, nb] each, summed over `batch` items.
        pmax and below may be None (then the incoherence and block-sparse scores read 0). With fixed orders
        (`fix_orders`, `keep_orders`): [H, K, nb, nb] in each head's kept orders."""
        slots = len(self.candidate_orders) if self.kept_slots is None else self.kept_slots.shape[2]
        if mass.dim() != 4 or mass.shape[1] != slots:
            raise ValueError(f"expected block statistics [H, {slots}, nb, nb]"
                             f"{'' if self.kept_slots is None else ' in the kept orders of each head'}, got {tuple(mass.shape)}")
        if self._staging_bucket is not None and bucket != self._staging_bucket:
            self.flush()
        self._staging_bucket = bucket
        self._stage(layer, pool_query_blocks(mass, self.mask_block[0] // self.block_size), batch)
        self.weight[bucket, layer] += batch
        entries = self._entries.get(mass.device)
        if entries is None:
            entries = self._entries[mass.device] = block_entries(self.seq_len, self.block_size, mass.device)
        if pmax is None or below is None:  # statistics computed without the extras: mass only
            inc = sparse = torch.zeros(mass.shape[:2])
        else:
            inc = incoherence(mass, pmax, entries * batch).cpu()
            sparse = sparse_fraction(below, entries * batch).cpu()
        if layer in self.incoherence_sum:
            self.incoherence_sum[layer] += inc
            self.sparse_sum[layer] += sparse
        else:
            self.incoherence_sum[layer], self.sparse_sum[layer] = inc, sparse
        self.scalar_count[layer] += 1

    def step_done(self, bucket: int) -> None:
        """Count one captured denoising step of one prompt in `bucket` (for the report)."""
        self.steps_per_bucket[bucket] += 1

    def _stage(self, layer: int, mass: torch.Tensor, batch: float) -> None:
        """Add one map into the layer's staged sum: where it was computed, or on `staging_device`."""
        target = mass.device if self.staging_device is None else self.staging_device
        if mass.device.type == "cuda" and target.type == "cpu":
            self._land()
            buffer = self._pinned.get(tuple(mass.shape))
            if buffer is None:
                buffer = self._pinned[tuple(mass.shape)] = torch.empty(mass.shape, dtype=torch.float32, pin_memory=True)
            buffer.copy_(mass.float(), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._in_flight = (layer, buffer, done, batch)
            return
        self._add_staged(layer, mass.to(target), batch)

    def _land(self) -> None:
        """Sum the map in flight to host memory, once its copy has finished."""
        if self._in_flight is not None:
            layer, buffer, done, batch = self._in_flight
            self._in_flight = None
            done.synchronize()
            self._add_staged(layer, buffer, batch)

    def _add_staged(self, layer: int, mass: torch.Tensor, batch: float) -> None:
        sums = self._staging
        if sums is None or sums.shape[1:] != mass.shape or sums.device != mass.device:
            if self._staged_weight:
                raise RuntimeError(f"a map {tuple(mass.shape)} on {mass.device} in a bucket whose maps so far were "
                                   f"{tuple(sums.shape[1:])} on {sums.device}")
            self._staging = sums = None  # the old sums go before the new ones are made
            sums = self._staging = torch.empty((self.num_layers, *mass.shape), dtype=torch.float32, device=mass.device)
        if layer in self._staged_weight:
            sums[layer] += mass
        else:
            sums[layer].copy_(mass)  # the slot's first map this bucket: no zeroing pass
        self._staged_weight[layer] = self._staged_weight.get(layer, 0.0) + batch

    def flush(self) -> None:
        """Fold the staged sums of the current bucket into the stored means."""
        self._land()
        bucket = self._staging_bucket
        for layer, staged_weight in sorted(self._staged_weight.items()):
            key, staged = (bucket, layer), self._staging[layer]
            total = float(self.weight[bucket, layer])  # already counts the staged maps
            # blend where the staged sums are (the GPU during a calibration): the store moves in
            # float16 both ways, as many bytes as the float32 sums alone would take one way
            if key in self.mass:
                staged.add_(self.mass[key].to(staged.device).float(), alpha=total - staged_weight)
            staged.div_(total)
            self._slot(bucket, layer, staged.shape).copy_(staged)
        self._staged_weight = {}
        self._staging_bucket = None

    def _slot(self, bucket: int, layer: int, shape: torch.Size) -> torch.Tensor:
        """The stored mean of (bucket, layer): a slot of the bucket's [L, *shape] tensor, made on first use."""
        store = self._store.get(bucket)
        if store is None:
            store = self._store[bucket] = torch.empty((self.num_layers, *shape), dtype=self.store_dtype,
                                                      device=self.store_device)
        elif store.shape[1:] != shape:
            raise RuntimeError(f"bucket {bucket} stores maps {tuple(store.shape[1:])}, not {tuple(shape)}")
        self.mass[(bucket, layer)] = store[layer]
        return store[layer]

    def join_heads(self, join) -> None:
        """Replace each per-head statistic t by `join(t, dim)`, dim its head dimension: under Ulysses each process
        recorded a slice of the heads, and `join` gathers the slices (`calibrate.parallel`). Called by every
        process, in this order of tensors; the counts (weights, steps) are the same on each and stay."""
        self.flush()
        self._staging = None
        joined = {key: join(self.mass[key], 0) for key in sorted(self.mass)}
        self._store = {}
        for (bucket, layer), mean in joined.items():
            self._slot(bucket, layer, mean.shape).copy_(mean)
        del joined
        for sums in (self.incoherence_sum, self.sparse_sum):
            for layer in sorted(sums):
                sums[layer] = join(sums[layer], 0)
        if self.kept_slots is not None:
            self.kept_slots = join(self.kept_slots, 1)
        if self.fixed_scores is not None:
            self.fixed_scores = join(self.fixed_scores, 1)

    # -----------------------------------------------------------------------------------------
    def mean_map(self, bucket: int, layer: int, device: torch.device) -> torch.Tensor | None:
        """The mean block-mass maps of (bucket, layer) in mask blocks, float32 on `device` (the maps staged since the
        last fold included); None if not captured."""
        # moved in the stored float16 and widened where the selection runs (the GPU during a
        # calibration), not widened in host memory first: half the bytes over the bus, no host pass
        total = float(self.weight[bucket, layer])
        if total == 0:
            return None
        self._land()  # the weight counts the map in flight: sum it first
        staged = self._staged_weight.get(layer, 0.0) if bucket == self._staging_bucket else 0.0
        stored = self.mass[(bucket, layer)].to(device).float() if (bucket, layer) in self.mass else None
        if not staged:
            return stored
        mean = self._staging[layer].to(device, copy=True)  # the maps staged since the last fold
        if stored is not None:
            mean += stored * (total - staged)
        return mean.div_(total)

    def finalize(
        self,
        density: float,
        prefix: int,
        metric: str = "mass",
        quant_weight: float = 0.0,
        alpha: float = 0.5,
        compute_device: torch.device | str | None = None,
        figure_layers: list[int] | None = None,
        suffix: int = 0,
        layer_floor: float = 0.0,
        dilation: int = 0,
        dense_layers=(),
        bucket_steps: list[int] | None = None,
        dense_steps: float = 0.0,
        shared_budget: bool = False,
        ranks: int = 1,
    ) -> CalibrationResult:
        """Choose each head's order from the averaged statistics and build the masks of every bucket.
        A bucket without captured steps borrows the mean over all captured buckets (the report says so).
        `layer_floor`, `dilation` and `dense_layers` go to `build_masks`.

        `density` is the mean over denoising steps: each bucket counts by its share of the steps,
        `bucket_steps` (denoising steps per bucket; default: the captured ones). `dense_steps`: the fewest
        leading buckets holding that share of the steps keep every block, and the other buckets share what
        is left (`selection.bucket_densities`). `shared_budget`: one budget over every bucket instead of one
        per bucket (`selection.shared_bucket_densities`). `ranks` > 1: each layer's blocks spread evenly over that
        many GPUs' contiguous slices of the heads (`selection.balance_masks`), moved by the measured masses."""
        self.flush()
        self._staging = None  # nothing is staged after the last flush
        if compute_device is None:
            compute_device = self.store_device
        compute_device = torch.device(compute_device)
        L, B = self.num_layers, self.num_buckets
        missing_layers = [layer for layer in range(L) if self.scalar_count[layer] == 0]
        if missing_layers:
            raise RuntimeError(
                f"no attention statistics were captured for layers {missing_layers}: the capture hooks did "
                "not see them; check that the pipeline runs every self-attention layer"
            )
        step_weight = torch.tensor([float(w) for w in self.steps_per_bucket]).clamp_min(0)
        if float(step_weight.sum()) == 0:
            step_weight = torch.ones(B)
        if bucket_steps is not None and len(bucket_steps) != B:
            raise ValueError(f"bucket_steps has {len(bucket_steps)} entries for {B} buckets")
        shares = step_shares(self.steps_per_bucket if bucket_steps is None else bucket_steps)
        dense_buckets = leading_buckets(shares, dense_steps)
        targets = bucket_densities(density, shares, dense_buckets)  # refuses a budget the dense buckets exceed
        figure_layers = sorted(set(figure_layers or []) & set(range(L)))
        per_layer_scores = []
        per_layer_orders = []
        fig_original, fig_reordered = [], []
        original_slot = self.candidate_orders.index(0) if 0 in self.candidate_orders else 0
        fixed = self.fixed_scores is not None  # each head's order chosen during the capture
        narrowed = self.kept_slots is not None  # the maps hold each head's kept orders, not every candidate
        if narrowed and (metric != "mass" or quant_weight):
            raise ValueError(f"the capture chose or narrowed the orders by the mass metric; metric={metric!r} with "
                             f"quant_weight={quant_weight} needs a capture with every order (order_steps=None, "
                             "keep_orders=None)")
        picks = []  # each layer's [H] index of its chosen order among the orders its maps hold
        for layer in range(L):
            maps = [self.mean_map(b, layer, compute_device) for b in range(B)]
            captured = [m for m in maps if m is not None]
            overall = sum(captured) / len(captured)
            if fixed:
                scores, slot = self.fixed_scores[layer], self.kept_slots[layer, :, 0]
                pick = torch.zeros_like(slot)  # the maps hold each head's chosen order alone
            else:
                kept = torch.zeros(overall.shape[:2])
                used = 0.0
                for b, m in enumerate(maps):
                    if m is None:
                        continue
                    kept += float(step_weight[b]) * kept_mass_fraction(m, targets[b]).cpu()
                    used += float(step_weight[b])
                kept /= used
                count = float(self.scalar_count[layer])
                scores = order_scores(
                    kept, self.incoherence_sum[layer] / count, self.sparse_sum[layer] / count,
                    metric=metric, quant_weight=quant_weight, alpha=alpha,
                )
                slot = pick = scores.argmin(dim=-1)  # [H]
                if narrowed:  # scores of the kept orders; the orders dropped after the first bucket read NaN
                    kept_slots = self.kept_slots[layer]
                    slot = kept_slots.gather(1, pick[:, None])[:, 0]
                    scores = torch.full((len(slot), len(self.candidate_orders)), float("nan")).scatter_(
                        1, kept_slots, scores.float())
            per_layer_scores.append(scores)
            per_layer_orders.append(torch.tensor(self.candidate_orders)[slot])
            picks.append(pick)
            if layer in figure_layers and not narrowed:  # the original order's maps exist only with every order
                heads = torch.arange(slot.numel())
                fig_original.append(overall[:, original_slot].half().cpu())
                fig_reordered.append(overall[heads, slot.to(overall.device)].half().cpu())

        def chosen_maps(b: int) -> torch.Tensor:
            """[L, H, nq, nk] on the compute device: each head's map in its chosen order in bucket b, or the mean over
            the captured buckets where b was not captured. Read again from the stored means, one bucket at a time:
            every bucket's at once would double what the capture holds (2 GB at CogVideoX-5B)."""
            out = []
            for layer in range(L):
                m = self.mean_map(b, layer, compute_device)
                if m is None:
                    captured = [c for c in (self.mean_map(c, layer, compute_device) for c in range(B)) if c is not None]
                    m = sum(captured) / len(captured)
                out.append(m[torch.arange(m.shape[0]), picks[layer].to(m.device)])
            return torch.stack(out)

        if shared_budget:  # one budget over every bucket: their maps together where the selection runs
            together = [chosen_maps(b) for b in range(B)]
            kept_always = [kept_blocks(m.shape, prefix, self.mask_block, device=m.device, suffix=suffix,
                                       seq_len=self.seq_len, dense_layers=dense_layers) for m in together]
            targets = shared_bucket_densities(together, kept_always, density, shares, dense_buckets)
            del together, kept_always
        block_mask = None  # [B, L, H, nq, nk] in host memory, filled a bucket at a time (no stacked second copy)
        densities, kept_masses = [], []
        for b in range(B):
            mass = chosen_maps(b)
            if b in dense_buckets:
                mask = torch.ones(mass.shape, dtype=torch.bool, device=mass.device)
            else:
                mask = build_masks(mass, targets[b], prefix, self.mask_block, suffix=suffix, seq_len=self.seq_len,
                                   layer_floor=layer_floor, dilation=dilation, dense_layers=dense_layers)
                if ranks > 1:
                    forced = forced_blocks(mask.shape[-2:], prefix, self.mask_block, device=mask.device, suffix=suffix,
                                           seq_len=self.seq_len)
                    mask = balance_masks(mask, mass, ranks, forced)
            if block_mask is None:
                block_mask = torch.empty((B, *mask.shape), dtype=torch.bool)
            block_mask[b] = mask.cpu()
            densities.append(mask.float().mean(dim=(-1, -2)).cpu())
            total = mass.sum(dim=(-1, -2)).clamp_min(1e-30)
            kept_masses.append(((mass * mask).sum(dim=(-1, -2)) / total).cpu())
        return CalibrationResult(
            candidate_orders=self.candidate_orders,
            orders=torch.stack(per_layer_orders),
            block_mask=block_mask,
            density=torch.stack(densities),
            kept_mass=torch.stack(kept_masses),
            scores=torch.stack(per_layer_scores),
            steps_per_bucket=list(self.steps_per_bucket),
            figure_layers=figure_layers,
            figure_original=torch.stack(fig_original) if fig_original else None,
            figure_reordered=torch.stack(fig_reordered) if fig_reordered else None,
            dense_layers=dense_layer_indices(dense_layers, L),
            dense_buckets=dense_buckets,
            bucket_density=list(targets),
            step_shares=shares,
        )
