"""How the masks share one block budget: dense layers, a per-layer floor and dilation (selection.build_masks),
and that plan_from_stats / SelectionConfig pass them on."""

from __future__ import annotations

import pytest
import torch

from paroattn.plan.selection import build_masks, dilate, forced_blocks


def skewed_mass(L=4, H=2, nb=16, seed=0):
    """Layer 0 holds far more mass off the diagonal than the others: a global budget starves the rest."""
    g = torch.Generator().manual_seed(seed)
    mass = torch.rand(L, H, nb, nb, generator=g)
    mass[0] *= 50.0
    return mass


@pytest.mark.parametrize("dense_layers,expected", [([0, -1], [0, 3]), ([2], [2]), ([-4, 0], [0])])
def test_dense_layers_keep_every_block_and_the_others_pay_for_them(dense_layers, expected):
    mass = skewed_mass()
    masks = build_masks(mass, 0.6, 0, 16, dense_layers=dense_layers)
    assert abs(float(masks.float().mean()) - 0.6) <= 0.01
    for layer in range(4):
        if layer in expected:
            assert bool(masks[layer].all()), layer
        else:
            assert not bool(masks[layer].all()), layer
    plain = build_masks(mass, 0.6, 0, 16)
    sparse = [layer for layer in range(4) if layer not in expected]
    assert masks[sparse].float().mean() < plain[sparse].float().mean()  # the others got fewer blocks


def test_dense_layers_beyond_the_budget_or_the_model_are_refused():
    # with the diagonal blocks of the two other layers: (2 * 64 + 2 * 8) / 256
    with pytest.raises(ValueError, match=r"dense layers \[0, 1\] alone hold 0.562 of the blocks, more than density 0.3"):
        build_masks(torch.rand(4, 2, 8, 8), 0.3, 0, 16, dense_layers=[0, 1])
    with pytest.raises(ValueError, match="dense layer 4 does not exist: the model has 4 layers"):
        build_masks(torch.rand(4, 2, 8, 8), 0.9, 0, 16, dense_layers=[4])


@pytest.mark.parametrize("floor", [0.5, 1.0])
def test_layer_floor_gives_every_layer_its_share_of_the_density(floor):
    mass = skewed_mass()
    density = 0.3
    plain = build_masks(mass, density, 0, 16)
    assert float(plain[1:].float().mean()) < 0.5 * floor * density  # the global budget starves layers 1..3
    masks = build_masks(mass, density, 0, 16, layer_floor=floor)
    per_layer = masks.float().mean(dim=(1, 2, 3))
    assert abs(float(masks.float().mean()) - density) <= 0.01
    assert bool((per_layer >= floor * density - 0.01).all()), per_layer
    with pytest.raises(ValueError, match="layer_floor must be in"):
        build_masks(mass, density, 0, 16, layer_floor=1.5)
    # with a dense layer the floor shares what it leaves: the mean density stays on target
    masks = build_masks(mass, 0.5, 0, 16, layer_floor=floor, dense_layers=[-1])
    assert abs(float(masks.float().mean()) - 0.5) <= 0.01 and bool(masks[3].all())
    per_layer = masks[:3].float().mean(dim=(1, 2, 3))
    assert bool((per_layer >= floor * (4 * 0.5 - 1) / 3 - 0.01).all()), per_layer


def test_dilation_grows_the_chosen_blocks_within_the_budget():
    nb = 16
    mass = torch.zeros(1, 1, nb, nb)
    mass[0, 0, 8, 3] = 10.0  # one hot block off the diagonal, its neighbours cold
    mass[0, 0] += 1e-3 * torch.rand(nb, nb, generator=torch.Generator().manual_seed(1))
    density = (nb + 12) / nb**2  # the diagonal and 12 more blocks
    masks = build_masks(mass, density, 0, 16, dilation=1)
    assert int(masks.sum()) == nb + 12
    assert bool(masks[0, 0, 7:10, 2:5].all()), "the 3x3 neighbourhood of the hot block must be kept"
    plain = build_masks(mass, density, 0, 16)
    assert not bool(plain[0, 0, 7:10, 2:5].all())
    assert bool((masks & forced_blocks(nb, 0, 16)).eq(forced_blocks(nb, 0, 16)).all())


def test_dilate_is_a_max_filter_over_the_block_grid():
    mask = torch.zeros(2, 5, 6, dtype=torch.bool)
    mask[1, 2, 0] = True
    grown = dilate(mask, 1)
    assert int(grown[0].sum()) == 0 and int(grown[1].sum()) == 6
    assert bool(grown[1, 1:4, 0:2].all())
    assert torch.equal(dilate(mask, 0), mask)


@pytest.mark.slow
def test_plan_from_stats_and_the_config_pass_the_budget_options_on():
    from tiny_models import tiny_call_kwargs, tiny_pipeline

    from paroattn.calibrate.config import CaptureConfig, SelectionConfig
    from paroattn.calibrate.driver import capture, plan_from_stats

    pipe = tiny_pipeline("wan")
    kwargs = tiny_call_kwargs("wan")
    kwargs.pop("output_type")
    base = {"steps": kwargs.pop("num_inference_steps"), "height": kwargs.pop("height"), "width": kwargs.pop("width"),
            "frames": kwargs.pop("num_frames"), "block_size": 16, "num_buckets": 2, "stat_every": 1,
            "pipeline_kwargs": kwargs}
    stats = capture(pipe, ["a dog"], CaptureConfig(**base))
    L = stats.accumulators["all"].num_layers
    plan, result = plan_from_stats(stats, SelectionConfig(density=0.8, dense_layers=[-1]))
    assert result.dense_layers == [L - 1] and plan.info["calibration"]["dense_layers"] == [L - 1]
    assert bool(plan.dense[:, L - 1].all()) and not bool(plan.dense[:, : L - 1].any())
    assert bool(plan.block_mask[:, L - 1].all())
    plan, result = plan_from_stats(stats, SelectionConfig(density=0.8, dense_layers=[0], layer_floor=1.0, dilation=1))
    assert result.dense_layers == [0] and bool(plan.dense[:, 0].all())
    assert plan.info["calibration"]["layer_floor"] == 1.0 and plan.info["calibration"]["dilation"] == 1
    plan, result = plan_from_stats(stats, SelectionConfig(density=0.8))
    assert result.dense_layers == [] and not bool(plan.dense.any())
    with pytest.raises(ValueError, match=r"layer_floor 2.0: expected a share of the density in \[0, 1\]"):
        SelectionConfig(layer_floor=2.0)


# -- the budget between timestep buckets: dense leading steps, one budget over all buckets -----------------

def bucket_accumulator(buckets=3, L=2, H=2, nb=16, seed=0, spread=()):
    """A StatsAccumulator (identity order only) holding random block masses for every (bucket, layer), one
    captured step per bucket; the buckets in `spread` hold nearly uniform maps, the others peaked ones."""
    from paroattn.calibrate.accumulate import StatsAccumulator

    g = torch.Generator().manual_seed(seed)
    acc = StatsAccumulator(L, buckets, [0], nb * 16, 16)
    for b in range(buckets):
        for layer in range(L):
            mass = torch.rand(H, 1, nb, nb, generator=g) ** (1 if b in spread else 8)
            acc.add(layer, b, mass / mass.sum(-1, keepdim=True) * 16, None, None, batch=1)  # rows of P sum to 1
        acc.step_done(b)
    return acc


def weighted_density(block_mask, steps):
    shares = torch.tensor(steps, dtype=torch.float32) / sum(steps)
    return float((block_mask.float().mean(dim=(1, 2, 3, 4)) * shares).sum())


@pytest.mark.parametrize("dense_steps,dense_buckets", [(0.2, [0]), (0.25, [0, 1]), (0.3, [0, 1])])
def test_dense_steps_keep_the_leading_buckets_dense_and_the_step_weighted_mean_on_target(dense_steps, dense_buckets):
    steps = [4, 2, 14]  # shares 0.2, 0.1, 0.7: unequal, so a mean that ignores them misses the target
    acc = bucket_accumulator()
    result = acc.finalize(0.5, 0, compute_device="cpu", bucket_steps=steps, dense_steps=dense_steps)
    blocks = result.block_mask[0].numel()
    assert result.dense_buckets == dense_buckets
    for b in range(3):
        assert bool(result.block_mask[b].all()) == (b in dense_buckets), b
    assert abs(weighted_density(result.block_mask, steps) - 0.5) <= 1 / blocks
    rest = (0.5 - sum(steps[b] for b in dense_buckets) / 20) / (1 - sum(steps[b] for b in dense_buckets) / 20)
    assert result.bucket_density == pytest.approx([1.0 if b in dense_buckets else rest for b in range(3)])
    assert abs(float(result.block_mask[2].float().mean()) - rest) <= 1 / blocks
    # off: every bucket at the density, as before
    plain = acc.finalize(0.5, 0, compute_device="cpu", bucket_steps=steps)
    assert plain.dense_buckets == [] and abs(float(plain.block_mask.float().mean()) - 0.5) <= 1 / blocks


def test_dense_steps_that_spend_the_budget_are_refused():
    from paroattn.calibrate.config import SelectionConfig
    from paroattn.plan.selection import bucket_densities, leading_buckets

    acc = bucket_accumulator()
    # 0.15 of the steps rounds up to bucket 0, which holds 0.2 of them: all of density 0.2
    with pytest.raises(ValueError, match=r"dense buckets \[0\] hold 0.200 of the denoising steps, as much as density 0.2"):
        acc.finalize(0.2, 0, compute_device="cpu", bucket_steps=[4, 2, 14], dense_steps=0.15)
    with pytest.raises(ValueError, match=r"dense buckets \[0, 1, 2\] hold 1.000"):
        acc.finalize(0.5, 0, compute_device="cpu", bucket_steps=[4, 2, 14], dense_steps=0.45)
    with pytest.raises(ValueError, match=r"dense_steps must be a share of the denoising steps in \[0, 1\)"):
        leading_buckets([0.5, 0.5], 1.0)
    with pytest.raises(ValueError, match="dense_steps 0.3: spends all of the density 0.3"):
        SelectionConfig(density=0.3, dense_steps=0.3)
    with pytest.raises(ValueError, match=r"dense_steps -0.1: expected a share"):
        SelectionConfig(dense_steps=-0.1)
    assert bucket_densities(1.0, [0.5, 0.5], [0]) == [1.0, 1.0]  # at density 1 nothing is refused


@pytest.mark.parametrize("dense_steps", [0.0, 0.2])
def test_shared_budget_uses_one_mass_threshold_over_the_buckets_at_the_step_weighted_density(dense_steps):
    steps = [4, 2, 14]
    acc = bucket_accumulator(spread=(1,))  # bucket 1 spreads its attention, the others concentrate it
    result = acc.finalize(0.4, 0, compute_device="cpu", bucket_steps=steps, dense_steps=dense_steps, shared_budget=True)
    blocks = result.block_mask[0].numel()
    assert abs(weighted_density(result.block_mask, steps) - 0.4) <= 1 / blocks
    per_bucket = acc.finalize(0.4, 0, compute_device="cpu", bucket_steps=steps, dense_steps=dense_steps)
    sparse = [b for b in range(3) if b not in result.dense_buckets]
    assert result.dense_buckets == per_bucket.dense_buckets
    # the spread bucket gets more blocks than its per-bucket share, the large peaked bucket pays for them
    assert float(result.block_mask[1].float().mean()) > float(per_bucket.block_mask[1].float().mean()) + 0.02
    assert float(result.block_mask[2].float().mean()) < float(per_bucket.block_mask[2].float().mean())
    # one threshold: every block chosen in any sparse bucket holds at least the mass of every block left out
    forced = forced_blocks(16, 0, 16)
    maps = [torch.stack([acc.mean_map(b, layer, torch.device("cpu"))[:, 0] for layer in range(2)]) for b in range(3)]
    chosen = torch.cat([maps[b][result.block_mask[b] & ~forced] for b in sparse])
    left = torch.cat([maps[b][~result.block_mask[b]] for b in sparse])
    assert float(chosen.min()) >= float(left.max())


@pytest.mark.slow
def test_plan_from_stats_counts_every_denoising_step_and_records_the_dense_buckets(tmp_path):
    from tiny_models import tiny_call_kwargs, tiny_pipeline

    from paroattn.calibrate.config import CaptureConfig, SelectionConfig
    from paroattn.calibrate.driver import capture, plan_from_stats
    from paroattn.plan import Plan, bucket_index

    pipe = tiny_pipeline("wan")
    kwargs = tiny_call_kwargs("wan")
    kwargs.pop("output_type"), kwargs.pop("num_inference_steps")
    edges = [1000.0, 850.0, 0.0]
    config = CaptureConfig(steps=6, height=kwargs.pop("height"), width=kwargs.pop("width"),
                           frames=kwargs.pop("num_frames"), block_size=16, bucket_edges=edges, stat_every=2,
                           pipeline_kwargs=kwargs)
    stats = capture(pipe, ["a dog", "a cat"], config)
    pipe.scheduler.set_timesteps(6)
    expected = [0, 0]
    for t in pipe.scheduler.timesteps:
        expected[bucket_index(edges, float(t))] += 2  # two prompts, one call each
    assert stats.bucket_steps == expected and 0 < expected[0] < expected[1], expected
    assert stats.accumulators["all"].steps_per_bucket != expected  # only every 2nd step was captured
    share = expected[0] / sum(expected)
    plan, result = plan_from_stats(stats, SelectionConfig(density=0.9, dense_steps=share))
    assert result.dense_buckets == [0] and bool(plan.dense[0].all()) and not bool(plan.dense[1].any())
    assert bool(plan.block_mask[0].all()) and not bool(plan.block_mask[1].all())
    assert plan.info["dense_buckets"] == [0] and plan.info["calibration"]["dense_steps"] == share
    assert plan.info["step_shares"] == pytest.approx([share, 1 - share])
    assert plan.info["bucket_density"][0] == 1.0 and plan.info["bucket_density"][1] < 0.9
    plan.save(tmp_path / "plan.safetensors")
    loaded = Plan.load(tmp_path / "plan.safetensors")
    assert torch.equal(loaded.dense, plan.dense) and loaded.info["dense_buckets"] == [0]
    plan, result = plan_from_stats(stats, SelectionConfig(density=0.9, shared_budget=True))
    assert result.dense_buckets == [] and plan.info["calibration"]["shared_budget"] is True
