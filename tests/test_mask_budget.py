"""How the masks share one block budget: dense layers, a per-layer floor and dilation (selection.build_masks),
and that plan_from_stats / CalibrationConfig pass them on."""

from __future__ import annotations

import pytest
import torch

from paroattn.calibrate.selection import build_masks, dilate, forced_blocks


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


def test_plan_from_stats_and_the_config_pass_the_budget_options_on():
    from paroattn.calibrate.driver import CalibrationConfig, capture, plan_from_stats
    from paroattn.testing import tiny_call_kwargs, tiny_pipeline

    pipe = tiny_pipeline("wan")
    kwargs = tiny_call_kwargs("wan")
    kwargs.pop("output_type")
    base = {"steps": kwargs.pop("num_inference_steps"), "height": kwargs.pop("height"), "width": kwargs.pop("width"),
            "frames": kwargs.pop("num_frames"), "block_size": 16, "num_buckets": 2, "stat_every": 1,
            "pipeline_kwargs": kwargs}
    stats = capture(pipe, ["a dog"], CalibrationConfig(**base))
    L = stats.accumulators["all"].num_layers
    plan, result = plan_from_stats(stats, 0.8, dense_layers=[-1])
    assert result.dense_layers == [L - 1] and plan.info["calibration"]["dense_layers"] == [L - 1]
    assert bool(plan.dense[:, L - 1].all()) and not bool(plan.dense[:, : L - 1].any())
    assert bool(plan.block_mask[:, L - 1].all())
    config = CalibrationConfig(**base, dense_layers=[0], layer_floor=1.0, dilation=1)
    stats = capture(pipe, ["a dog"], config)
    plan, result = plan_from_stats(stats, 0.8)
    assert result.dense_layers == [0] and bool(plan.dense[:, 0].all())
    assert plan.info["calibration"]["layer_floor"] == 1.0 and plan.info["calibration"]["dilation"] == 1
    plan, result = plan_from_stats(stats, 0.8, dense_layers=[], layer_floor=0.0, dilation=0)
    assert result.dense_layers == [] and not bool(plan.dense.any())
    with pytest.raises(ValueError, match="layer_floor must be in"):
        CalibrationConfig(layer_floor=2.0).validate()
