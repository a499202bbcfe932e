"""Balanced GPUs under Ulysses (`paroattn.plan.balance`, `selection.balance_layer`): each (bucket, layer)'s blocks spread
evenly over the GPUs' contiguous slices of the heads, the layer's (and the bucket's) budget unchanged, the blocks
moved chosen by attention mass; given at calibration (`SelectionConfig(ulysses=N)`), or when a plan is applied
(`balance_plan`, `PAROProcessor(balance_ranks=N)`), and kept by plans derived for other sizes. A plan balanced for N
says so under a number of GPUs whose slices N's do not group."""

from __future__ import annotations

import warnings

import pytest
import torch

from paroattn import Plan, PlanError, TokenLayout
from paroattn.plan.balance import balance_plan, balance_problem, rank_imbalance
from paroattn.plan.selection import BALANCED_RANKS, balance_layer, forced_blocks, rank_blocks

LAYOUT = TokenLayout(0, 4, 8, 8)  # 256 tokens: 16 x 16 blocks of 16


def skewed_plan(heads=8, layers=3, buckets=2, seed=1, layout=LAYOUT) -> Plan:
    """A synthetic plan with axis profiles whose last half of the heads keep more blocks than the first half (as
    heads of spread-out attention do): the GPUs holding them run longer."""
    plan = Plan.synthetic(layout=layout, num_layers=layers, num_heads=heads, density=0.2, num_buckets=buckets,
                          block_size=16, profiles=True, seed=seed)
    g = torch.Generator().manual_seed(seed)
    masks = plan.block_mask.clone()
    masks[:, :, heads // 2:] |= torch.rand(masks[:, :, heads // 2:].shape, generator=g) < 0.3
    plan.block_mask, plan.density = masks, None
    plan.__post_init__()
    return plan


def spread(counts: torch.Tensor) -> int:
    """The largest difference between two GPUs' active blocks in any (bucket, layer)."""
    return int((counts.amax(-1) - counts.amin(-1)).max())


# -- one layer --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks", [2, 4])
def test_balance_layer_evens_the_slices_keeps_the_total_and_moves_by_mass(ranks):
    g = torch.Generator().manual_seed(0)
    heads, nb = 8, 12
    mass = torch.rand(heads, nb, nb, generator=g)
    mask = torch.rand(heads, nb, nb, generator=g) < torch.linspace(0.1, 0.7, heads)[:, None, None]
    forced = forced_blocks(nb, 16, 16, seq_len=nb * 16, suffix=16)  # the diagonal and a text suffix
    mask |= forced
    out = balance_layer(mask, mass, ranks, forced)
    before, after = rank_blocks(mask, ranks), rank_blocks(out, ranks)
    assert spread(before[None]) > 50 and spread(after[None]) <= 1
    assert int(out.sum()) == int(mask.sum())
    assert bool(out[:, forced].all())  # the blocks every mask keeps never move
    per = heads // ranks
    for r in range(ranks):
        part = slice(r * per, (r + 1) * per)
        old, new, w = mask[part], out[part], mass[part]
        dropped, added = old & ~new, new & ~old
        assert not (bool(dropped.any()) and bool(added.any()))  # a slice gives or takes, never both
        if dropped.any():  # it gave up its kept blocks of least mass
            assert float(w[dropped].max()) <= float(w[new & ~forced].min())
        if added.any():  # it took its free blocks of most mass
            assert float(w[added].min()) >= float(w[~new].max())


def test_balance_layer_leaves_a_balanced_or_whole_layer_alone_and_refuses_uneven_slices():
    mass = torch.rand(4, 6, 6)
    full = torch.ones(4, 6, 6, dtype=torch.bool)
    forced = forced_blocks(6, 16, 16, seq_len=96)
    assert torch.equal(balance_layer(full, mass, 4, forced), full)
    with pytest.raises(ValueError, match=r"3 does not divide 4: pass a number of GPUs that divides 4 \(1, 2, 4\)"):
        balance_layer(full, mass, 3, forced)


# -- plans ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks", [2, 4])
def test_balance_plan_evens_every_bucket_and_layer_with_the_same_budget(ranks):
    plan = skewed_plan()
    plan.extra_shapes = [skewed_plan(layout=TokenLayout(0, 3, 8, 8), seed=2)]
    plan.validate()
    assert float(rank_imbalance(plan, ranks).min()) > 0.2  # the GPUs of the spread-out heads run that much longer
    balanced = balance_plan(plan, ranks)
    for before, after in zip(plan.calibrated_plans(), balanced.calibrated_plans(), strict=True):
        counts = rank_blocks(after.block_mask, ranks)
        assert spread(counts) <= 1 and float(rank_imbalance(after, ranks).max()) < 0.01
        assert torch.equal(before.block_mask.sum(dim=(2, 3, 4)), after.block_mask.sum(dim=(2, 3, 4)))  # per layer
        assert torch.allclose(before.density.mean(dim=(1, 2)), after.density.mean(dim=(1, 2)))  # per bucket
        assert torch.equal(before.orders, after.orders) and torch.equal(before.dense, after.dense)
        assert after.info[BALANCED_RANKS] == ranks
    # no more blocks moved than the counts had to: each one changed is a GPU's excess dropped or deficit taken
    counts = rank_blocks(plan.block_mask, ranks)
    after = rank_blocks(balanced.block_mask, ranks)
    assert int((plan.block_mask ^ balanced.block_mask).sum()) == int((counts - after).abs().sum()) > 0


def test_a_plan_balanced_for_n_is_balanced_for_its_divisors_and_says_so_elsewhere():
    plan = balance_plan(skewed_plan(heads=12), 6)
    assert spread(rank_blocks(plan.block_mask, 2)) <= 3 and spread(rank_blocks(plan.block_mask, 3)) <= 2
    assert balance_problem(plan, 6) is None and balance_problem(plan, 3) is None and balance_problem(plan, 1) is None
    problem = balance_problem(plan, 4)
    assert "balanced for 6 GPUs" in problem and "balance_ranks=4" in problem and "paro calibrate --ulysses 4" in problem
    assert balance_problem(skewed_plan(heads=12), 4) is None  # never balanced: nothing to say


def test_balancing_refuses_head_counts_it_cannot_split_and_plans_without_profiles():
    plan = skewed_plan()
    with pytest.raises(PlanError, match="3 does not divide 8"):
        balance_plan(plan, 3)
    plan.profiles = None
    with pytest.raises(PlanError, match=r"no axis profiles.*paro calibrate --ulysses 2"):
        balance_plan(plan, 2)


def test_plans_derived_for_other_sizes_keep_the_balance():
    from paroattn.plan.shapes import derive_plan

    plan = skewed_plan()
    other = TokenLayout(0, 6, 8, 8)
    assert spread(rank_blocks(derive_plan(plan, other).block_mask, 2)) > 1  # as derived: unbalanced
    derived = derive_plan(balance_plan(plan, 2), other)
    assert derived.info[BALANCED_RANKS] == 2 and spread(rank_blocks(derived.block_mask, 2)) <= 1


@pytest.mark.slow
def test_processor_balances_its_plan_when_it_binds():
    from tiny_models import TINY_BLOCK, tiny_forward_inputs, tiny_transformer

    from paroattn.pipelines import apply, family_of, self_attention_layers
    from paroattn.plan import model_fingerprint

    transformer = tiny_transformer("wan", heads=4)
    inputs = tiny_forward_inputs(transformer)
    layout = family_of(transformer).call_inputs(transformer, inputs).layout
    plan = Plan.synthetic(layout=layout, num_layers=len(self_attention_layers(transformer)), num_heads=4, density=0.4,
                          num_buckets=2, block_size=TINY_BLOCK, model_class=type(transformer).__name__,
                          model_fingerprint=model_fingerprint(transformer.config), profiles=True, seed=4)
    plan.block_mask[:, :, 2:] |= torch.rand(plan.block_mask[:, :, 2:].shape) < 0.4  # the second GPU's heads heavier
    plan.density = None
    plan.__post_init__()
    assert spread(rank_blocks(plan.block_mask, 2)) > 1
    with apply(transformer, plan, backend="torch", balance_ranks=2) as handle:
        balanced = handle.processor.plan
        assert balanced.info[BALANCED_RANKS] == 2 and spread(rank_blocks(balanced.block_mask, 2)) <= 1
        with torch.no_grad():
            assert torch.isfinite(transformer(**inputs)[0]).all()
    with apply(transformer, balanced, backend="torch", balance_ranks=2) as handle:
        assert handle.processor.plan is balanced  # balanced for that number already: kept
    with pytest.raises(PlanError, match=r"balance_ranks=3: .*3 does not divide 4"):
        apply(transformer, plan, backend="torch", balance_ranks=3)


# -- calibration ------------------------------------------------------------------------------------------------

def test_calibration_balances_with_the_measured_masses():
    from paroattn.calibrate.accumulate import StatsAccumulator

    g = torch.Generator().manual_seed(0)
    L, H, nb, buckets = 2, 4, 16, 2
    acc = StatsAccumulator(L, buckets, [0], nb * 16, 16)
    for b in range(buckets):
        for layer in range(L):
            # heads 0, 1 peaked (a few blocks hold their mass), heads 2, 3 spread out
            mass = torch.rand(H, 1, nb, nb, generator=g) ** torch.tensor([8.0, 8.0, 1.0, 1.0]).view(H, 1, 1, 1)
            acc.add(layer, b, mass / mass.sum(-1, keepdim=True) * 16, None, None, batch=1)
        acc.step_done(b)
    plain = acc.finalize(0.3, 0)
    balanced = acc.finalize(0.3, 0, ranks=2)
    assert spread(rank_blocks(plain.block_mask, 2)) > 20 and spread(rank_blocks(balanced.block_mask, 2)) <= 1
    assert torch.equal(plain.block_mask.sum(dim=(2, 3, 4)), balanced.block_mask.sum(dim=(2, 3, 4)))
    assert torch.equal(plain.orders, balanced.orders)
    # the cost: some attention mass the budget had chosen, no more than what moved can carry
    assert float(balanced.kept_mass.mean()) < float(plain.kept_mass.mean())


def test_selection_config_and_calibrate_check_the_number_of_gpus_before_capturing():
    from tiny_models import tiny_pipeline

    from paroattn.calibrate.config import ConfigError, SelectionConfig
    from paroattn.calibrate.driver import calibrate

    with pytest.raises(ConfigError, match="number of GPUs >= 1"):
        SelectionConfig(ulysses=0)
    pipe = tiny_pipeline("wan")  # 2 heads per layer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before anything runs
        with pytest.raises(ValueError, match=r"ulysses=4: balancing for 4 GPUs .* 4 does not divide 2"):
            calibrate(pipe, ["a cat"], selection=SelectionConfig(ulysses=4))
