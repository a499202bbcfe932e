"""Calibration: block statistics (Triton vs torch vs naive), order selection on planted locality,
mask density, and calibrate -> save -> load -> apply -> generate on tiny pipelines."""

from dataclasses import replace

import pytest
import torch

from paroattn import Plan, TokenLayout
from paroattn.calibrate.accumulate import StatsAccumulator
from paroattn.calibrate.block_stats import block_stats
from paroattn.calibrate.block_stats_reference import block_stats_naive, block_stats_torch
from paroattn.calibrate.synthetic import innermost_axis, planted_qk
from paroattn.layout import reorder_index
from paroattn.plan.selection import build_masks, forced_blocks, kept_mass_fraction, pool_query_blocks

# the Triton statistics kernel runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _close(got, want, atol=2e-5):
    for name, a, b in zip(("mass", "pmax", "below"), got, want):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, atol=atol, rtol=1e-4), f"{name}: max diff {float((a - b).abs().max())}"


@pytest.mark.parametrize("layout", [TokenLayout(5, 2, 3, 4), TokenLayout(0, 1, 5, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_block_stats_match_naive(layout, dtype):
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(2, 2, layout.seq_len, 24, generator=g) * 2).to(dtype)
    k = (torch.randn(2, 2, layout.seq_len, 24, generator=g) * 2).to(dtype)
    orders = list(layout.distinct_orders())
    want = block_stats_naive(q.float(), k.float(), layout, orders, 16, eps=1e-2)
    got = block_stats(q.to(KERNEL_DEVICE), k.to(KERNEL_DEVICE), layout, orders, 16, eps=1e-2, backend="triton")
    got = [t.cpu() for t in got]
    # fp16 inputs: the kernel multiplies fp16 values exactly in fp32, as the naive form does after .float();
    # entries of P right at eps may still land on either side
    _close(got[:2], want[:2], atol=1e-4)
    assert (got[2] - want[2]).abs().max() <= (0 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("layout", [TokenLayout(0, 3, 4, 5), TokenLayout(7, 2, 5, 6), TokenLayout(9, 1, 6, 6)])
def test_torch_block_stats_match_naive_and_conserve_mass(layout):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, layout.seq_len, 16, generator=g) * 2
    k = torch.randn(2, 3, layout.seq_len, 16, generator=g) * 2
    orders = list(range(6))
    want = block_stats_naive(q, k, layout, orders, 16)
    got = block_stats_torch(q, k, layout, orders, 16, query_chunk=16)  # one block per chunk
    _close(got, want)
    # every row of P sums to one: each map holds B * N
    assert torch.allclose(want[0].sum((-1, -2)), torch.full((3, 6), 2.0 * layout.seq_len), rtol=1e-5)
    # orders that give the same sequence give the same statistics
    distinct = layout.distinct_orders()
    assert len(distinct) == (2 if layout.frames == 1 else 6)


def stats_of_real_keys(q, k, layout, orders, block_size, suffix_mask, eps):
    """The statistics with the padded text keys removed: per batch item, softmax over the real keys only,
    written back into their columns (the padded columns stay empty), then tiled like the naive form."""
    B, H, N, _ = q.shape
    nb = -(-N // block_size)
    real = torch.cat([torch.ones(B, N - layout.suffix, dtype=torch.bool), suffix_mask], dim=1)
    mass = torch.zeros(H, len(orders), nb, nb)
    pmax, below = torch.zeros_like(mass), torch.zeros_like(mass)
    for b in range(B):
        keys = real[b].nonzero().flatten()
        for h in range(H):
            p = torch.zeros(N, N)
            p[:, keys] = torch.softmax(q[b, h].float() @ k[b, h, keys].float().T / q.shape[-1] ** 0.5, dim=-1)
            for oi, order in enumerate(orders):
                index = reorder_index(layout, order)
                pr, kept = p[index][:, index], real[b][index]
                for i in range(nb):
                    for j in range(nb):
                        tile = pr[i * block_size:(i + 1) * block_size, j * block_size:(j + 1) * block_size]
                        tile_kept = kept[j * block_size:(j + 1) * block_size]
                        mass[h, oi, i, j] += tile.sum()
                        pmax[h, oi, i, j] = max(pmax[h, oi, i, j], tile.max())
                        below[h, oi, i, j] += ((tile < eps) & tile_kept).sum()
    return mass, pmax, below


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.slow
def test_block_stats_leave_out_padded_text_keys(backend):
    layout = TokenLayout(0, 2, 3, 4, suffix=13)  # 37 tokens: the text crosses a block edge
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(2, 2, layout.seq_len, 16, generator=g) * 2).half()
    k = (torch.randn(2, 2, layout.seq_len, 16, generator=g) * 2).half()
    suffix_mask = torch.ones(2, 13, dtype=torch.bool)
    suffix_mask[0, 5:] = False  # item 0: 8 padded text keys, item 1: none
    orders = list(layout.distinct_orders())
    want = stats_of_real_keys(q, k, layout, orders, 16, suffix_mask, eps=1e-2)
    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    got = block_stats(q.to(device), k.to(device), layout, orders, 16, eps=1e-2, backend=backend,
                      suffix_mask=suffix_mask.to(device))
    got = [t.cpu() for t in got]
    _close(got[:2], want[:2], atol=1e-4)
    key_mask = torch.cat([torch.ones(2, layout.seq_len - 13, dtype=torch.bool), suffix_mask], dim=1)
    _close(block_stats_naive(q.float(), k.float(), layout, orders, 16, eps=1e-2, key_mask=key_mask), want)
    assert (got[2] - want[2]).abs().max() <= 2  # fp16: entries of P right at eps may land on either side
    # the padded keys take no mass away from the real ones: every row still sums to one
    assert torch.allclose(got[0].sum((-1, -2)), torch.full(got[0].shape[:2], 2.0 * layout.seq_len), rtol=1e-4)
    # an all-True mask is no mask
    unmasked = block_stats(q.to(device), k.to(device), layout, orders, 16, eps=1e-2, backend=backend)
    all_real = block_stats(q.to(device), k.to(device), layout, orders, 16, eps=1e-2, backend=backend,
                           suffix_mask=torch.ones(2, 13, dtype=torch.bool, device=device))
    _close([t.cpu() for t in all_real], [t.cpu() for t in unmasked], atol=0)
    with pytest.raises(ValueError, match=r"suffix_mask must be a bool \[B, suffix\] = \[2, 13\]"):
        block_stats(q, k, layout, orders, 16, backend="torch", suffix_mask=suffix_mask[:, :12])


@pytest.mark.parametrize("layout, distinct", [(TokenLayout(4, 1, 4, 8), ["FHW", "FWH"]),
                                              (TokenLayout(4, 2, 4, 8), ["FHW", "FWH", "HFW", "HWF", "WFH", "WHF"])])
def test_block_stats_default_orders_are_the_distinct_ones(layout, distinct):
    """Without `orders`, one map per distinct order, in ORDERS' sequence: an image (one frame) has two, since
    an order that only moves F gives the same token sequence as one that keeps it outermost."""
    from paroattn.layout import ORDERS

    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, layout.seq_len, 16, generator=g), torch.randn(1, 2, layout.seq_len, 16, generator=g)
    default = block_stats(q, k, layout, block_size=16, backend="torch")
    named = block_stats(q, k, layout, [ORDERS.index(o) for o in distinct], block_size=16, backend="torch")
    _close(default, named, atol=0)
    every = block_stats(q, k, layout, list(range(6)), block_size=16, backend="torch")[0]
    for o, order in enumerate(ORDERS):  # every order's map is one of the distinct ones, each of those differs
        same = [d for d in distinct if torch.equal(every[:, o], every[:, ORDERS.index(d)])]
        assert len(same) == 1 and (order == same[0] or layout.frames == 1), (order, same)


PLANTED = [TokenLayout(0, 4, 8, 8), TokenLayout(8, 3, 8, 12), TokenLayout(16, 5, 6, 8),
           TokenLayout(0, 8, 6, 5), TokenLayout(16, 1, 20, 20)]


@pytest.mark.slow
def test_planted_locality_selects_the_local_axis_innermost_and_masks_keep_the_mass():
    g = torch.Generator().manual_seed(0)
    hits = total = 0
    for layout in PLANTED:
        axes = [1, 2] * 3 if layout.is_image else [0, 1, 2] * 2
        q, k = planted_qk(layout, axes, generator=g)
        orders = list(layout.distinct_orders())
        acc = StatsAccumulator(1, 1, orders, layout.seq_len, 16)
        acc.add(0, 0, *block_stats(q, k, layout, orders, 16, backend="torch"), batch=1)
        acc.step_done(0)
        result = acc.finalize(0.3, layout.prefix)
        chosen = [innermost_axis(int(o)) for o in result.orders[0]]
        hits += sum(a == b for a, b in zip(chosen, axes))
        total += len(axes)
        assert abs(float(result.density.mean()) - 0.3) <= 0.02, layout
        assert float(result.kept_mass.mean()) >= 0.95, (layout, result.kept_mass)
    assert hits / total >= 0.95, f"{hits}/{total} heads got their local axis innermost"


@pytest.mark.slow
def test_planted_locality_with_the_triton_kernel():
    layout = TokenLayout(4, 3, 4, 4)
    g = torch.Generator().manual_seed(3)
    axes = [0, 2]
    q, k = planted_qk(layout, axes, head_dim=16, generator=g)
    orders = list(layout.distinct_orders())
    acc = StatsAccumulator(1, 1, orders, layout.seq_len, 16)
    stats = block_stats(q.to(KERNEL_DEVICE), k.to(KERNEL_DEVICE), layout, orders, 16, backend="triton")
    acc.add(0, 0, *(t.cpu() for t in stats), batch=1)
    result = acc.finalize(0.5, layout.prefix)
    assert [innermost_axis(int(o)) for o in result.orders[0]] == axes


# heads local along one axis with some locality along the next (`planted_qk(secondary=)`): the order that keeps a
# query's keys nearest is the third axis outermost, the next one in the middle, the local axis innermost
PLANTED_ORDER = {0: "WHF", 1: "FWH", 2: "HFW"}
PLANTED_LAYERS = [[0, 1, 2, 2], [2, 0, 1, 0]]  # [layer][head] -> local axis


def _planted_stats():
    """CapturedStats of a 2-layer, 4-head model whose heads carry `PLANTED_LAYERS`'s locality, in 2 buckets."""
    from paroattn.calibrate.config import CaptureConfig
    from paroattn.calibrate.driver import CapturedStats

    layout = TokenLayout(0, 6, 8, 8)
    orders = list(layout.distinct_orders())
    acc = StatsAccumulator(len(PLANTED_LAYERS), 2, orders, layout.seq_len, 16)
    g = torch.Generator().manual_seed(0)
    for bucket in range(2):
        for layer, axes in enumerate(PLANTED_LAYERS):
            q, k = planted_qk(layout, axes, secondary=[0.8] * len(axes), generator=g)
            acc.add(layer, bucket, *block_stats(q, k, layout, orders, 16, backend="torch"), batch=1)
        acc.step_done(bucket)
    return CapturedStats(config=CaptureConfig(block_size=16, num_buckets=2), layout=layout, prompts=["planted"],
                         model_class="Planted", model_fingerprint="", accumulators={"all": acc}, timings={})


def _assert_planted_orders(plan) -> None:
    from paroattn import ORDERS

    chosen = [[ORDERS[int(o)] for o in layer] for layer in plan.orders]
    assert chosen == [[PLANTED_ORDER[a] for a in axes] for axes in PLANTED_LAYERS], chosen


@pytest.mark.slow
def test_calibration_picks_the_planted_order_of_every_layer_and_head():
    """Each head's whole order (not just its range) is the one its planted locality calls for, in every layer."""
    from paroattn.calibrate.config import SelectionConfig
    from paroattn.calibrate.driver import plan_from_stats

    plan, result = plan_from_stats(_planted_stats(), SelectionConfig(density=0.2), compute_device="cpu")
    _assert_planted_orders(plan)
    assert float(result.kept_mass.mean()) >= 0.95


def _rolled_orders(scores):  # each candidate's score read one slot over: orders mislabelled by axis
    return scores.roll(1, dims=-1)


@pytest.mark.parametrize("mutation", [
    lambda scores: -scores,  # the worst order instead of the best
    _rolled_orders,
    lambda scores: scores.flip(-2),  # heads reversed
])
@pytest.mark.slow
def test_a_wrong_order_choice_fails_the_planted_check(monkeypatch, mutation):
    """The planted check above catches a selection that reads the wrong axis, head or sign of the score."""
    import paroattn.calibrate.accumulate as accumulate
    from paroattn.calibrate.config import SelectionConfig
    from paroattn.calibrate.driver import plan_from_stats

    original = accumulate.order_scores
    monkeypatch.setattr(accumulate, "order_scores", lambda *a, **kw: mutation(original(*a, **kw)))
    plan, _ = plan_from_stats(_planted_stats(), SelectionConfig(density=0.2), compute_device="cpu")
    with pytest.raises(AssertionError):
        _assert_planted_orders(plan)


@pytest.mark.parametrize("density", [0.1, 0.2, 0.3, 0.5])
@pytest.mark.parametrize("prefix,nb", [(0, 40), (40, 64), (20, 61)])
def test_masks_hit_the_target_density_with_one_global_budget(density, prefix, nb):
    g = torch.Generator().manual_seed(4)
    L, H = 3, 4
    # heads differ in how spread their attention is: a head with flat mass needs more blocks
    spread = torch.tensor([0.5, 2.0, 8.0, 32.0]).view(1, H, 1, 1)
    i = torch.arange(nb).float()
    distance = (i[:, None] - i[None, :]).abs()
    mass = torch.exp(-distance / spread) * (1 + 0.1 * torch.rand(L, H, nb, nb, generator=g))
    masks = build_masks(mass, density, prefix, 16)
    assert masks.shape == (L, H, nb, nb)
    assert abs(float(masks.float().mean()) - density) <= 0.02
    assert bool(masks[..., forced_blocks(nb, prefix, 16)].all()), "diagonal and text blocks must stay on"
    per_head = masks.float().mean(dim=(0, 2, 3))
    free_budget = density - float(forced_blocks(nb, prefix, 16).float().mean())
    if free_budget > 0.05:
        assert per_head[3] > per_head[0], "the spread-out head should get more blocks than the local one"


def test_masks_hold_only_the_forced_blocks_when_they_exceed_the_budget():
    mass = torch.rand(1, 2, 8, 8)
    masks = build_masks(mass, 0.1, prefix=40, block_size=16)  # 3 text blocks of 8: 39 + 5 of 64 forced
    assert torch.equal(masks, forced_blocks(8, 40, 16).expand(1, 2, 8, 8))


def test_forced_blocks_of_larger_query_blocks_cover_their_token_range():
    """Query blocks of 128 over key blocks of 64: the 'diagonal' is every key block inside the query
    block's token range; text rows and columns count in their own block sizes."""
    forced = forced_blocks((3, 5), 0, (128, 64))
    expected = torch.zeros(3, 5, dtype=torch.bool)
    for i, cols in enumerate([(0, 1), (2, 3), (4,)]):
        expected[i, list(cols)] = True
    assert torch.equal(forced, expected)
    expected[0, :] = True  # 70 text tokens: query block 0 of 128, key blocks 0 and 1 of 64
    expected[:, :2] = True
    assert torch.equal(forced_blocks((3, 5), 70, (128, 64)), expected)
    assert torch.equal(forced_blocks(6, 40, 16), forced_blocks((6, 6), 40, (16, 16)))


def test_query_blocks_pool_the_rows_of_square_statistics():
    """StatsAccumulator(query_block=2 * block_size): statistics in square blocks, masks at (2b, b) from
    summed row pairs (a ragged last pair keeps its one row); the plan's masks still hit the density and
    keep the forced blocks."""
    mass = torch.arange(5 * 4, dtype=torch.float32).view(5, 4)
    pooled = pool_query_blocks(mass, 2)
    assert torch.equal(pooled, torch.stack([mass[0] + mass[1], mass[2] + mass[3], mass[4]]))
    layout = TokenLayout(8, 3, 8, 12)  # 296 tokens: 19 blocks of 16, 10 query blocks of 32
    q, k = planted_qk(layout, [0, 1, 2], generator=torch.Generator().manual_seed(5))
    orders = list(layout.distinct_orders())
    acc = StatsAccumulator(1, 1, orders, layout.seq_len, 16, query_block=32)
    acc.add(0, 0, *block_stats(q, k, layout, orders, 16, backend="torch"), batch=1)
    result = acc.finalize(0.3, layout.prefix)
    assert result.block_mask.shape == (1, 1, 3, 10, 19)
    assert abs(float(result.density.mean()) - 0.3) <= 0.02
    assert bool(result.block_mask[0, 0][:, forced_blocks((10, 19), layout.prefix, (32, 16))].all())
    assert float(result.kept_mass.mean()) >= 0.9
    with pytest.raises(ValueError, match="multiple of block_size"):
        StatsAccumulator(1, 1, orders, layout.seq_len, 16, query_block=24)


def test_kept_mass_fraction_counts_the_best_blocks():
    mass = torch.zeros(1, 4, 5)
    mass[0, 0, :3] = torch.tensor([5.0, 3.0, 2.0])
    # 0.1 * 20 = 2 blocks: 5 + 3 of 10; 0.05 -> 1 block; 0.5 -> everything
    assert torch.allclose(kept_mass_fraction(mass, 0.1), torch.tensor([0.8]))
    assert torch.allclose(kept_mass_fraction(mass, 0.05), torch.tensor([0.5]))
    assert torch.allclose(kept_mass_fraction(mass, 0.5), torch.tensor([1.0]))


def test_paper_metric_scores_block_sparsity_as_a_benefit_and_incoherence_as_a_cost():
    from paroattn.plan.selection import order_scores

    # order 0 is the most block-sparse and the most incoherent: -0.5 * 0.5 + 0.5 * 1.2 / 3.2 = -0.0625
    sparse, incoherent = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([1.2, 1.0, 1.0])
    scores = order_scores(torch.zeros(3), incoherent, sparse, metric="paper")
    assert torch.allclose(scores, torch.tensor([-0.0625, 0.03125, 0.03125]))
    # all weight on one term: the most sparse order wins, or the least incoherent
    assert order_scores(torch.zeros(3), incoherent, sparse, metric="paper", alpha=1.0).argmin() == 0
    assert order_scores(torch.zeros(3), incoherent, sparse, metric="paper", alpha=0.0).argmin() == 1


@pytest.mark.parametrize("layout", [TokenLayout(0, 4, 8, 8), TokenLayout(8, 3, 8, 12), TokenLayout(16, 1, 20, 20)])
def test_paper_metric_picks_the_orders_its_formula_gives(layout):
    """`metric="paper"` chooses per head the order minimizing -alpha S_o / sum(S) + (1 - alpha) Q_o / sum(Q), S the
    share of blocks with >= 90% of P below eps and Q the mean max(P) / mean(P) of the blocks with mass, computed
    here from the block statistics (on these heads the incoherence term decides at alpha 1/2, so alpha 1 and 0
    check each term alone). At the default alpha it picks other orders than the mass metric on video, and on an
    image the planted ones."""
    axes = [1, 2] * 2 if layout.is_image else [0, 1, 2, 0]
    q, k = planted_qk(layout, axes, generator=torch.Generator().manual_seed(5))
    orders = list(layout.distinct_orders())
    mass, pmax, below = block_stats(q, k, layout, orders, 16, backend="torch")
    acc = StatsAccumulator(1, 1, orders, layout.seq_len, 16)
    acc.add(0, 0, mass, pmax, below, batch=1)
    acc.step_done(0)

    sizes = torch.full((-(-layout.seq_len // 16),), 16.0)
    sizes[-1] = layout.seq_len - 16 * (len(sizes) - 1)
    entries = sizes[:, None] * sizes[None, :]
    sparse = (below >= 0.9 * entries).float().mean((-1, -2))
    mean = mass / entries
    with_mass = mean > 0  # a mean P below float32's smallest normal number is taken as that number
    incoherent = torch.where(with_mass, pmax / mean.clamp_min(torch.finfo(torch.float32).tiny), 0).sum((-1, -2))
    incoherent = incoherent / with_mass.sum((-1, -2))
    for alpha in (0.5, 1.0, 0.0):
        score = -alpha * sparse / sparse.sum(-1, keepdim=True) + (1 - alpha) * incoherent / incoherent.sum(-1, True)
        paper = acc.finalize(0.3, layout.prefix, metric="paper", alpha=alpha).orders[0]
        assert paper.tolist() == [orders[int(i)] for i in score.argmin(-1)], alpha
    paper = acc.finalize(0.3, layout.prefix, metric="paper").orders[0]
    if layout.is_image:
        assert [innermost_axis(int(o)) for o in paper] == axes
    else:
        assert not torch.equal(paper, acc.finalize(0.3, layout.prefix).orders[0])  # the option changes the choice
    with pytest.raises(ValueError, match="unknown order metric"):
        acc.finalize(0.3, layout.prefix, metric="nope")


def test_stored_means_follow_the_float32_average_over_interleaved_buckets():
    """The store keeps float16 means, folded in when the bucket changes: after prompts that visit the
    buckets in turn, each stored mean is the float32 average of every map added to it (weighted by
    batch items), to float16 precision."""
    g = torch.Generator().manual_seed(6)
    acc = StatsAccumulator(2, 3, [0, 1], seq_len=64, block_size=16)
    added, items = {}, {}
    # steps of each prompt, timestep buckets in order; prompts differ in steps and batch size, so a
    # plain average of per-fold means would be off
    for steps, batch in [((0, 0, 0, 1, 2), 1), ((0, 1, 1, 1, 2, 2), 2), ((0, 1, 2, 2, 2, 2), 3)]:
        for bucket in steps:
            for layer in range(2):
                mass = torch.rand(2, 2, 4, 4, generator=g) * 16 * batch  # per item at most the block size
                acc.add(layer, bucket, mass, None, None, batch=batch)
                added.setdefault((bucket, layer), []).append(mass)
                items[(bucket, layer)] = items.get((bucket, layer), 0) + batch
    acc.flush()
    for (bucket, layer), maps in added.items():
        stored = acc.mass[(bucket, layer)]
        assert stored.dtype == torch.float16
        expected = torch.stack(maps).sum(0) / items[(bucket, layer)]
        assert torch.allclose(acc.mean_map(bucket, layer, expected.device), expected, rtol=2e-3, atol=1e-3)


def test_means_read_before_a_fold_include_the_staged_maps_and_the_store_is_one_tensor_per_bucket():
    """mean_map reads the maps staged since the last fold (the order narrowing reads them before any fold); each
    bucket's means are slots of one tensor, and the staged sums are one tensor reused from bucket to bucket (freed
    pieces of per-layer tensors stay in the host allocator: memory a capture never gives back)."""
    g = torch.Generator().manual_seed(3)
    acc = StatsAccumulator(3, 2, [0, 1], seq_len=64, block_size=16)
    added = {}
    for bucket in (0, 0, 1, 1, 0):  # bucket 0 again after 1: the staged maps blend with a stored mean
        for layer in range(3):
            mass = torch.rand(2, 2, 4, 4, generator=g) * 16
            acc.add(layer, bucket, mass, None, None, batch=1)
            added.setdefault((bucket, layer), []).append(mass)
        staging = acc._staging.data_ptr()
        for layer in range(3):  # before the fold: stored (bucket 0's first two maps) and staged together
            expected = torch.stack(added[(bucket, layer)]).mean(0)
            assert torch.allclose(acc.mean_map(bucket, layer, "cpu"), expected, rtol=2e-3, atol=1e-3), (bucket, layer)
            other = 1 - bucket  # the other bucket's mean holds none of this bucket's staged maps
            if (other, layer) in added:
                expected = torch.stack(added[(other, layer)]).mean(0)
                assert torch.allclose(acc.mean_map(other, layer, "cpu"), expected, rtol=2e-3, atol=1e-3), (other, layer)
    assert acc._staging.data_ptr() == staging
    acc.flush()
    for bucket in range(2):
        store = acc._store[bucket]
        assert store.shape == (3, 2, 2, 4, 4)
        for layer in range(3):
            assert acc.mass[(bucket, layer)].data_ptr() == store[layer].data_ptr()
            expected = torch.stack(added[(bucket, layer)]).mean(0)
            assert torch.allclose(acc.mean_map(bucket, layer, "cpu"), expected, rtol=2e-3, atol=1e-3)


def test_narrowing_staged_maps_gives_the_means_narrowing_folded_maps_gives():
    """keep_orders straight from the staged sums (no wide store made) keeps the same means as after a fold, in
    one narrowed store per bucket; the picks are per (layer, head), for the order scores' sums too."""
    g = torch.Generator().manual_seed(4)
    maps = [(layer, torch.rand(3, 4, 4, 4, generator=g) * 16) for _ in range(2) for layer in range(2)]
    slots = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)]).view(2, 3, 2)
    narrowed = []
    for fold_first in (False, True):
        acc = StatsAccumulator(2, 2, [0, 1, 2, 3], seq_len=64, block_size=16)
        for layer, mass in maps:
            acc.add(layer, 0, mass, mass * torch.rand(mass.shape, generator=g), torch.rand(mass.shape, generator=g),
                    batch=1)
        if fold_first:
            acc.flush()
        scores = [{layer: sums[layer].clone() for layer in range(2)} for sums in (acc.incoherence_sum, acc.sparse_sum)]
        acc.keep_orders(slots)
        for before, after in zip(scores, (acc.incoherence_sum, acc.sparse_sum)):
            for layer in range(2):
                assert torch.equal(after[layer], before[layer].gather(1, slots[layer])), layer
        assert acc._staging is None and acc._store[0].shape == (2, 3, 2, 4, 4)
        narrowed.append([acc.mean_map(0, layer, "cpu") for layer in range(2)])
    for layer in range(2):
        mean = torch.stack([m for lay, m in maps if lay == layer]).mean(0)
        expected = mean[torch.arange(3)[:, None], slots[layer]]
        for got in (narrowed[0][layer], narrowed[1][layer]):
            assert torch.allclose(got, expected, rtol=2e-3, atol=1e-3)


# -- end to end on tiny pipelines (CPU) ---------------------------------------------------------
@pytest.mark.parametrize("family", ["cogvideox", "wan", "flux"])
@pytest.mark.slow
def test_tiny_pipeline_calibrate_save_load_apply_generate(family, tmp_path):
    from tiny_models import tiny_call_kwargs, tiny_pipeline

    from paroattn import apply
    from paroattn.calibrate import CaptureConfig, SelectionConfig, calibrate
    from paroattn.calibrate.driver import save_calibration
    from paroattn.calibrate.figures import draw_plan_heads
    from paroattn.pipelines import self_attention_layers

    pipe = tiny_pipeline(family)
    kwargs = tiny_call_kwargs(family)
    steps = kwargs.pop("num_inference_steps")
    kwargs.pop("output_type")
    size = {"height": kwargs.pop("height"), "width": kwargs.pop("width"), "frames": kwargs.pop("num_frames", None)}
    # Wan's plan uses query blocks twice the key blocks (the fast D=128 tiles), the others square ones
    config = CaptureConfig(block_size=16, query_block=32 if family == "wan" else None, steps=steps,
                           num_buckets=2, stat_every=1, pipeline_kwargs=kwargs, **size)
    plan, result = calibrate(pipe, ["a red fox in the snow", "a city at night"], config, SelectionConfig(density=0.5))
    plan_path, stats_path = save_calibration(plan, result, tmp_path / "plan.safetensors")
    loaded = Plan.load(plan_path)
    assert loaded.model_class == type(pipe.transformer).__name__
    assert torch.equal(loaded.block_mask, plan.block_mask) and torch.equal(loaded.orders, plan.orders)
    assert loaded.num_layers == len(self_attention_layers(pipe))
    assert loaded.block_size == ((32, 16) if family == "wan" else (16, 16))
    assert sum(result.steps_per_bucket) == 2 * steps  # every step of both prompts was captured
    frames = size["frames"]
    call = dict(kwargs, height=size["height"], width=size["width"], num_inference_steps=steps, output_type="latent")
    if frames:
        call["num_frames"] = frames
    dense = pipe(prompt="a dog", generator=torch.Generator().manual_seed(0), **call)
    with apply(pipe, loaded, backend="torch") as handle:
        assert handle.active
        sparse = pipe(prompt="a dog", generator=torch.Generator().manual_seed(0), **call)
    out = sparse[0] if isinstance(sparse, tuple) else getattr(sparse, "frames", getattr(sparse, "images", None))
    ref = dense[0] if isinstance(dense, tuple) else getattr(dense, "frames", getattr(dense, "images", None))
    assert torch.isfinite(out).all() and out.shape == ref.shape
    pngs = draw_plan_heads(loaded, [(0, 0), (loaded.num_layers - 1, 1)], tmp_path / "png")
    assert [p.stat().st_size > 0 for p in pngs] == [True, True]


@pytest.mark.slow
def test_one_capture_builds_any_plan_and_calibrate_is_capture_then_plan_from_stats():
    """`calibrate` = `capture` + `plan_from_stats`; one capture (every prompt in one batch here) gives
    plans for other densities, quantizations and order sets without running the pipeline again."""
    from tiny_models import tiny_call_kwargs, tiny_pipeline

    from paroattn import ORDERS
    from paroattn.calibrate.config import CaptureConfig, SelectionConfig
    from paroattn.calibrate.driver import calibrate, capture, plan_from_stats

    pipe = tiny_pipeline("wan")
    kwargs = tiny_call_kwargs("wan")
    steps = kwargs.pop("num_inference_steps")
    kwargs.pop("output_type")
    size = {"height": kwargs.pop("height"), "width": kwargs.pop("width"), "frames": kwargs.pop("num_frames")}
    config = CaptureConfig(block_size=16, steps=steps, num_buckets=2, stat_every=1, batch_prompts=True,
                           pipeline_kwargs=kwargs, **size)
    prompts = ["a red fox in the snow", "a city at night"]
    stats = capture(pipe, prompts, replace(config, extras=True), order_sets={"identity": [ORDERS.index("FHW")]})
    assert sorted(stats.accumulators) == ["all", "identity"] and stats.prompts == prompts
    assert stats.accumulators["all"].steps_per_bucket == stats.accumulators["identity"].steps_per_bucket
    assert sum(stats.accumulators["all"].steps_per_bucket) == steps  # one batched call: each step once

    half = SelectionConfig(density=0.5)
    plan, result = plan_from_stats(stats, half)
    again, _ = calibrate(pipe, prompts, config, half)
    assert torch.equal(plan.orders, again.orders) and torch.equal(plan.block_mask, again.block_mask)
    assert plan.info["calibration"]["batch_prompts"] is True and plan.prompts == prompts

    sparse, _ = plan_from_stats(stats, SelectionConfig(density=0.25, qk="int8", pv="fp8", metric="paper"))
    assert (sparse.qk, sparse.pv) == ("int8", "fp8") and sparse.achieved_density() < plan.achieved_density()
    identity, identity_result = plan_from_stats(stats, replace(half, order_set="identity"))
    assert bool((identity.orders == ORDERS.index("FHW")).all()) and identity_result.candidate_orders == [0]
    assert identity.info["calibration"]["order_set"] == "identity"
    assert result.candidate_orders == list(stats.layout.distinct_orders())

    with pytest.raises(ValueError, match="no statistics for the order set 'W'"):
        plan_from_stats(stats, replace(half, order_set="W"))
    mass_only = capture(pipe, prompts[:1], config)  # extras follow the config: mass only
    with pytest.raises(ValueError, match=r"capture with CaptureConfig\(extras=True\)"):
        plan_from_stats(mass_only, SelectionConfig(metric="paper"))


@pytest.mark.slow
def test_cli_calibrate_then_inspect_png(tmp_path):
    from tiny_models import tiny_pipeline
    from typer.testing import CliRunner

    from paroattn.app.cli import app

    model_dir = tmp_path / "tiny-wan"
    tiny_pipeline("wan").save_pretrained(model_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# comment\na cat on a sofa\n\na boat on a lake\n")
    out = tmp_path / "plan.safetensors"
    runner = CliRunner()
    result = runner.invoke(app, [
        "calibrate", str(model_dir), "--out", str(out), "--prompts", str(prompts), "--steps", "2",
        "--block-size", "16", "--height", "64", "--width", "64", "--frames", "9", "--buckets", "2",
        "--density", "0.5",
    ])
    assert result.exit_code == 0, result.output
    assert "attention mass inside the masks" in result.output
    plan = Plan.load(out)
    assert plan.prompts == ["a cat on a sofa", "a boat on a lake"]
    assert (tmp_path / "plan.stats.safetensors").is_file()
    result = runner.invoke(app, ["inspect", str(out), "--png", str(tmp_path / "png"), "--heads", "0:0,1:1"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["layer000_head000.png", "layer001_head001.png"]


def test_figures_without_stats_draw_the_masks_and_say_why(tmp_path):
    from PIL import Image

    from paroattn.calibrate.figures import draw_plan_heads

    plan = Plan.synthetic(layout=TokenLayout(0, 2, 8, 8), num_layers=1, num_heads=2, density=0.4, num_buckets=2,
                          block_size=16)
    (path,) = draw_plan_heads(plan, [(0, 1)], tmp_path)
    with Image.open(path) as image:
        assert image.width > 2 * 100 and image.height > 100
    with pytest.raises(ValueError, match="not in the plan"):
        draw_plan_heads(plan, [(3, 0)], tmp_path)


def test_calibration_refuses_bucket_edges_off_the_timestep_scale_before_running():
    from paroattn.calibrate.config import CaptureConfig

    with pytest.raises(ValueError, match="from 1000 down to 0"):
        CaptureConfig(bucket_edges=[1.0, 0.5, 0.0])
    assert CaptureConfig(bucket_edges=[1000.0, 800.0, 500.0, 0.0]).edges() == [1000.0, 800.0, 500.0, 0.0]


@pytest.mark.parametrize("stage, options, option, expected", [
    ("capture", {"block_size": 48}, "block_size", "power of two >= 16"),
    ("capture", {"query_block": 96}, "query_block", "power-of-two multiple of the block size 64"),
    ("capture", {"steps": 0}, "steps", ">= 1"),
    ("capture", {"stat_every": 0}, "stat_every", ">= 1"),
    ("capture", {"num_buckets": 0}, "num_buckets", ">= 1"),
    ("capture", {"backend": "cuda"}, "backend", "'auto', 'triton' or 'torch'"),
    ("capture", {"height": 0}, "height", "positive size"),
    ("selection", {"density": 0.0}, "density", "(0, 1]"),
    ("selection", {"density": 1.5}, "density", "(0, 1]"),
    ("selection", {"qk": "int3"}, "qk/pv", "qk='int3'"),
    ("selection", {"metric": "entropy"}, "metric", "mass, paper"),
    ("selection", {"quant_weight": -1.0}, "quant_weight", ">= 0"),
    ("selection", {"layer_floor": 1.5}, "layer_floor", "[0, 1]"),
    ("selection", {"dilation": -1}, "dilation", ">= 0"),
    ("selection", {"dense_steps": 1.0}, "dense_steps", "[0, 1)"),
    ("selection", {"density": 0.3, "dense_steps": 0.3}, "dense_steps", "spends all of the density 0.3"),
])
def test_each_stage_config_checks_its_options_when_made(stage, options, option, expected):
    """Options are checked once, in the constructor of their stage's config, and `replace` checks again."""
    from paroattn.calibrate.config import CaptureConfig, ConfigError, SelectionConfig

    cls = CaptureConfig if stage == "capture" else SelectionConfig
    with pytest.raises(ConfigError) as error:
        cls(**options)
    assert error.value.option == option and expected in str(error.value), str(error.value)
    with pytest.raises(ConfigError):
        replace(cls(), **options)


def test_plan_from_stats_takes_a_selection_config_only():
    from paroattn.calibrate.config import CaptureConfig
    from paroattn.calibrate.driver import plan_from_stats

    with pytest.raises(TypeError, match="takes a SelectionConfig, got CaptureConfig"):
        plan_from_stats(None, CaptureConfig())
