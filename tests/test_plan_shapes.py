"""One plan, many sizes: axis profiles measured at calibration give the masks of other grids (`paroattn/plan/shapes.py`).

The oracle: heads with planted, asymmetric locality (a Gaussian in the offset along each axis, shifted along
some), whose exact block masses on any grid come from `block_stats`. A plan calibrated at one size must,
derived at another, keep nearly the mass that masks built from that size's exact statistics keep; a
derivation that reads the wrong axis, flips the offsets, or takes another head's or bucket's profile must not.
The offset weights must give back the profile they were fitted to, and each head's order on the new grid must
be the one whose masses keep the most.
"""

from __future__ import annotations

import pytest
import torch

import paroattn.plan.shapes as shapes
from paroattn import Plan, PlanError, TokenLayout
from paroattn.calibrate.accumulate import StatsAccumulator
from paroattn.calibrate.block_stats import block_stats
from paroattn.calibrate.config import CaptureConfig, SelectionConfig
from paroattn.calibrate.driver import CapturedStats, plan_from_stats
from paroattn.plan.selection import build_masks
from paroattn.plan.shapes import ProfileAccumulator, ShapePlans, derive_plan, offset_mass, offset_weights

CALIBRATED = TokenLayout(0, 4, 6, 8)
OTHERS = [TokenLayout(0, 4, 10, 12), TokenLayout(0, 6, 6, 8), TokenLayout(0, 3, 4, 6)]  # larger, more frames, smaller
BLOCK = 16
# [bucket][head] -> (width along F, H, W in grid steps, shift along F, H, W): local along some axes, and
# shifted (a head that looks at the next frames or columns), different per head and per bucket
HEADS = [
    [((0.7, 0.2, 0.2), (1, 0, 0)), ((0.2, 1.0, 0.2), (0, 0, 0)), ((0.2, 0.2, 1.2), (0, 0, 2)), ((9, 0.2, 0.7), (0, 0, -1))],
    [((0.2, 0.2, 1.0), (0, 0, -2)), ((0.8, 0.2, 0.2), (-1, 0, 0)), ((0.2, 0.9, 0.2), (0, 1, 0)), ((0.2, 9, 0.2), (0, 0, 0))],
]


def shifted_qk(layout: TokenLayout, heads, noise: float = 0.3, seed: int = 0):
    """q, k [1, H, N, D] with logits q_i . k_j / sqrt(D) = -sum_a (c_a(j) - c_a(i) - shift_a)^2 / (2 width_a^2) + noise."""
    g = torch.Generator().manual_seed(seed)
    F, Hh, W = layout.frames, layout.height, layout.width
    grid = torch.stack(torch.meshgrid(torch.arange(F), torch.arange(Hh), torch.arange(W), indexing="ij"), -1)
    grid = grid.reshape(-1, 3).double()
    D = 16
    qs, ks = [], []
    for widths, shifts in heads:
        w = 1.0 / (2 * torch.tensor(widths, dtype=torch.float64) ** 2)
        target = grid + torch.tensor(shifts, dtype=torch.float64)
        # -w (c_j - t_i)^2 = 2 w t_i c_j - w c_j^2 - w t_i^2 (the last is constant along a row)
        q = torch.cat([2 * w * target, -w.expand(len(grid), 3)], -1)
        k = torch.cat([grid, grid**2], -1)
        q = torch.cat([q, noise * torch.randn(len(grid), D - 6, generator=g, dtype=torch.float64)], -1)
        k = torch.cat([k, noise * torch.randn(len(grid), D - 6, generator=g, dtype=torch.float64)], -1)
        qs.append(q * D**0.25)
        ks.append(k * D**0.25)
    return torch.stack(qs)[None].float(), torch.stack(ks)[None].float()


def calibrated_plan(density: float, layout: TokenLayout = CALIBRATED) -> Plan:
    """A plan of 1 layer x 4 heads x 2 buckets calibrated on the planted heads at `layout`, with profiles."""
    orders = list(layout.distinct_orders())
    acc = StatsAccumulator(1, 2, orders, layout.seq_len, BLOCK)
    profiles = ProfileAccumulator(1, 2, layout, 4)
    for bucket, heads in enumerate(HEADS):
        q, k = shifted_qk(layout, heads, seed=bucket)
        acc.add(0, bucket, *block_stats(q, k, layout, orders, BLOCK, backend="torch"), batch=1)
        acc.step_done(bucket)
        profiles.add(0, bucket, *offset_mass(q, k, layout))
    stats = CapturedStats(config=CaptureConfig(block_size=BLOCK, num_buckets=2), layout=layout, prompts=["planted"],
                          model_class="Planted", model_fingerprint="", accumulators={"all": acc}, timings={},
                          profiles=profiles)
    return plan_from_stats(stats, SelectionConfig(density=density), compute_device="cpu")[0]


def exact_masses(layout: TokenLayout, orders: torch.Tensor) -> list[torch.Tensor]:
    """Per bucket, [1, H, nq, nk]: the planted heads' block masses on `layout` in each head's order."""
    out = []
    for bucket, heads in enumerate(HEADS):
        q, k = shifted_qk(layout, heads, seed=bucket)
        mass, _, _ = block_stats(q, k, layout, list(range(6)), BLOCK, backend="torch")  # [H, 6, nb, nb]
        out.append(mass[torch.arange(len(heads)), orders.long()][None])
    return out


def kept_share(plan: Plan, layout: TokenLayout) -> float:
    """Share of the planted heads' exact mass on `layout` (in the plan's orders) inside the plan's masks."""
    masses = exact_masses(layout, plan.orders[0])
    kept = [(m * plan.block_mask[b]).sum() / m.sum() for b, m in enumerate(masses)]
    return float(sum(kept) / len(kept))


@pytest.mark.parametrize("layout", OTHERS, ids=str)
@pytest.mark.slow
def test_derived_masks_keep_the_mass_of_masks_from_that_size(layout):
    plan = calibrated_plan(0.1)
    derived = derive_plan(plan, layout)
    assert derived.layout == layout
    diagonal = 1 / derived.mask_blocks[1]  # the budget, unless the diagonal alone exceeds it (the smallest grid)
    assert plan.achieved_density() - 0.03 <= derived.achieved_density() <= max(plan.achieved_density(), diagonal) + 0.03
    masses = exact_masses(layout, derived.orders[0])
    oracle = [build_masks(m, float(plan.density[b].mean()), 0, BLOCK) for b, m in enumerate(masses)]
    best = float(sum((m * o).sum() / m.sum() for m, o in zip(masses, oracle)) / len(masses))
    got = kept_share(derived, layout)
    assert got >= best - 0.01, (got, best)


MUTATIONS = {
    # each axis kernel built from another axis's profile (F and W exchanged)
    "wrong axis": lambda monkeypatch: monkeypatch.setattr(shapes, "PROFILE_OF_AXIS", {"F": 2, "H": 1, "W": 0}),
    # offsets read as v - u the other way round
    "transposed offsets": lambda monkeypatch: monkeypatch.setattr(
        shapes, "_extended", (lambda original: lambda p, n: original(p.flip(-1), n))(shapes._extended)),
    # each head's masses from the next head's profiles
    "wrong head": lambda monkeypatch: monkeypatch.setattr(
        shapes, "layer_block_masses", (lambda original: lambda profiles, *a, **kw: original(
            [p.roll(1, 0) for p in profiles], *a, **kw))(shapes.layer_block_masses)),
}


@pytest.mark.parametrize("layout", OTHERS[:2], ids=str)
@pytest.mark.parametrize("mutation", ["wrong axis", "transposed offsets", "wrong head", "wrong bucket"])
@pytest.mark.slow
def test_a_wrong_derivation_loses_mass_the_check_above_sees(monkeypatch, mutation, layout):
    plan = calibrated_plan(0.1)
    right = kept_share(derive_plan(plan, layout), layout)
    if mutation == "wrong bucket":  # every bucket's masses from the first bucket's profiles
        plan.profiles = [p[[0, 0]] for p in plan.profiles]
    else:
        MUTATIONS[mutation](monkeypatch)
    wrong = kept_share(derive_plan(plan, layout), layout)
    assert wrong < right - 0.03, (mutation, wrong, right)


def profile_of(weights: torch.Tensor) -> torch.Tensor:
    """The mean mass per query at each offset of the row-normalized kernel of `weights` [2n-1], every query of
    an axis of n positions counted once (what `offset_mass` measures of such a head)."""
    n = (weights.shape[-1] + 1) // 2
    offsets = torch.arange(n)[None, :] - torch.arange(n)[:, None] + n - 1
    kernel = weights.double()[offsets]
    kernel = kernel / kernel.sum(-1, keepdim=True)
    mass = torch.zeros(2 * n - 1, dtype=torch.float64).index_add_(0, offsets.flatten(), kernel.flatten())
    return mass / (n - (torch.arange(2 * n - 1) - (n - 1)).abs())


@pytest.mark.parametrize("n", [2, 5, 9])
def test_offset_weights_give_back_the_weights_of_the_measured_profile(n):
    # a local peak off the centre on a floor, as the heads above: border queries raise the measured mean at large
    # offsets, so the profile is not the weights, and the fit must undo that
    d = torch.arange(2 * n - 1, dtype=torch.float64) - (n - 1)
    planted = 0.05 + torch.exp(-((d - 1) ** 2) / 2)
    profile = profile_of(planted)
    fitted = offset_weights(profile[None].float(), iterations=200)[0]
    torch.testing.assert_close(fitted, planted / planted.max(), rtol=2e-3, atol=2e-4)
    torch.testing.assert_close(profile_of(fitted), profile, rtol=2e-3, atol=2e-4)
    if n > 2:
        assert (profile / profile.max() - planted / planted.max()).abs().max() > 0.01  # the fit has work to do


@pytest.mark.parametrize("layout", OTHERS[:2], ids=str)
@pytest.mark.slow
def test_each_head_takes_the_order_that_keeps_the_most_at_the_new_size(monkeypatch, layout):
    """Orders are chosen again from the derived masses: with every head's calibrated order replaced by another
    one, the derived plan still keeps what a plan calibrated at that size keeps; keeping the plan's orders loses."""
    plan = calibrated_plan(0.1)
    at_size = calibrated_plan(0.1, layout)  # orders and masks from that size's exact statistics
    plan.orders = (plan.orders + 3) % 6
    derived = derive_plan(plan, layout)
    assert kept_share(derived, layout) >= kept_share(at_size, layout) - 0.01, (derived.orders, at_size.orders)
    monkeypatch.setattr(shapes, "choose_orders", lambda weights, plan, *args, **kwargs: plan.orders.clone())
    assert kept_share(derive_plan(plan, layout), layout) < kept_share(derived, layout) - 0.03


@pytest.mark.slow
def test_shape_plans_keep_calibrated_sizes_and_derive_others_once():
    plan = calibrated_plan(0.5)
    other = calibrated_plan(0.5, OTHERS[1])
    plan.extra_shapes = [other]
    plan.validate()
    plans = ShapePlans(plan)
    assert plans.at(CALIBRATED) is plan and plans.at(OTHERS[1]) is other  # exact masks where calibrated
    calls = []
    original = shapes.derive_plan
    shapes.derive_plan = lambda *a, **kw: calls.append(a[1]) or original(*a, **kw)
    try:
        first = plans.at(OTHERS[0])
        assert plans.at(OTHERS[0]) is first and calls == [OTHERS[0]]  # cached: derived once
        plans.at(TokenLayout(0, 6, 8, 8))
    finally:
        shapes.derive_plan = original
    # derived from the closest calibrated size: 6 frames of 8x8 is nearer 6x6x8 than 4x6x8
    assert calls[-1] == TokenLayout(0, 6, 8, 8)
    assert plans.derived[TokenLayout(0, 6, 8, 8)].info["derived_from"] == list(OTHERS[1].fields)
    assert plans.derived[OTHERS[0]].info["derived_from"] == list(CALIBRATED.fields)


@pytest.mark.slow
def test_plans_with_profiles_and_extra_sizes_round_trip_and_old_ones_load(tmp_path):
    plan = calibrated_plan(0.5)
    plan.extra_shapes = [calibrated_plan(0.5, OTHERS[1])]
    plan.save(tmp_path / "plan.safetensors")
    loaded = Plan.load(tmp_path / "plan.safetensors")
    assert [p.layout for p in loaded.calibrated_plans()] == [CALIBRATED, OTHERS[1]]
    for a, b in zip(loaded.calibrated_plans(), plan.calibrated_plans()):
        assert torch.equal(a.block_mask, b.block_mask) and all(torch.equal(x, y) for x, y in zip(a.profiles, b.profiles))
    old = Plan.synthetic(layout=CALIBRATED, num_layers=1, num_heads=4, density=0.5)
    old.format_version = 1
    old.save(tmp_path / "old.safetensors")
    old = Plan.load(tmp_path / "old.safetensors")
    assert old.profiles is None and old.format_version == 1
    problem = ShapePlans(old).problem(OTHERS[0])
    assert "no axis profiles" in problem and "format version 1 predates" in problem and "only its calibrated size" in problem
    with pytest.raises(PlanError, match="no axis profiles"):
        ShapePlans(old).at(OTHERS[0])
    assert ShapePlans(old).at(CALIBRATED) is old
    with pytest.raises(PlanError, match=r"profile_f must be \[buckets, layers, heads, 2n-1\]"):
        Plan(**{**{f: getattr(plan, f) for f in ("model_class", "model_fingerprint", "layout", "block_size", "orders",
                                                  "block_mask", "bucket_edges")},
                "profiles": [plan.profiles[2], plan.profiles[1], plan.profiles[0]]})


def test_text_layouts_the_plan_cannot_describe_are_refused():
    plan = calibrated_plan(0.5)
    assert "text tokens" in ShapePlans(plan).problem(TokenLayout(16, 4, 6, 8))
    with pytest.raises(PlanError, match="laid out unlike the plan's"):
        ShapePlans(plan).at(TokenLayout(0, 4, 6, 8, 8))


@pytest.mark.slow
def test_paro_calibrate_sizes_writes_one_plan_that_runs_at_a_third_size(tmp_path):
    """`paro calibrate --sizes` calibrates two sizes of a tiny Wan into one plan, `paro inspect` lists them and
    says other sizes are derived, and the plan runs a third size, where a full-density plan equals dense."""
    from tiny_models import tiny_pipeline
    from typer.testing import CliRunner

    from paroattn import apply
    from paroattn.app.cli import app

    pipe = tiny_pipeline("wan")
    model_dir = tmp_path / "tiny-wan"
    pipe.save_pretrained(model_dir)
    out = tmp_path / "plan.safetensors"
    runner = CliRunner()
    common = ["--steps", "2", "--block-size", "16", "--buckets", "2", "--num-prompts", "1"]
    result = runner.invoke(app, ["calibrate", str(model_dir), "--out", str(out), "--sizes", "64x64x9,64x96x9",
                                 "--density", "1", *common])
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert [p.layout for p in plan.calibrated_plans()] == [TokenLayout(0, 3, 4, 4), TokenLayout(0, 3, 4, 6)]
    assert all(p.profiles is not None for p in plan.calibrated_plans())
    result = runner.invoke(app, ["inspect", str(out)])
    assert "calibrated: 3x4x4, 3x4x6; any other size of the model derives its masks" in result.output, result.output
    bad = runner.invoke(app, ["calibrate", str(model_dir), "--out", str(out.with_name("bad.safetensors")), "--sizes",
                              "64x64x", *common])
    assert bad.exit_code != 0 and "expected comma-separated HEIGHTxWIDTHxFRAMES" in bad.output

    call = {"height": 96, "width": 96, "num_frames": 5, "num_inference_steps": 2, "output_type": "latent"}
    dense = pipe(prompt="a dog", generator=torch.Generator().manual_seed(0), **call).frames
    with apply(pipe, plan, backend="torch") as handle:
        full = pipe(prompt="a dog", generator=torch.Generator().manual_seed(0), **call).frames
        (derived,) = handle.processor.shapes.derived.values()
    assert derived.layout == TokenLayout(0, 2, 6, 6) and bool(derived.block_mask.all())
    torch.testing.assert_close(full, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_compiled_transformer_derives_a_new_size_in_a_graph_of_its_own():
    """Under torch.compile a new size is a new graph, as for the model's own attention: the compiled run at the
    new size equals the eager run there with the derived masks."""
    from tiny_models import TINY_BLOCK, tiny_forward_inputs, tiny_transformer
    from torch._dynamo.testing import CompileCounterWithBackend

    from paroattn import apply
    from paroattn.pipelines import family_of, self_attention_layers
    from paroattn.plan import model_fingerprint

    torch._dynamo.reset()
    transformer = tiny_transformer("wan")
    inputs = tiny_forward_inputs(transformer, timestep=700.0)
    plan = Plan.synthetic(layout=family_of(transformer).call_inputs(transformer, inputs).layout,
                          num_layers=len(self_attention_layers(transformer)),
                          num_heads=transformer.config.num_attention_heads, density=0.5, orders="random",
                          num_buckets=3, block_size=TINY_BLOCK, model_class=type(transformer).__name__,
                          model_fingerprint=model_fingerprint(transformer.config), profiles=True)
    other = tiny_forward_inputs(transformer, timestep=700.0, height=12, width=8)
    counter = CompileCounterWithBackend("aot_eager")
    # dynamic=False: a size is a static graph (a dynamic-shape graph would make the token layout symbolic)
    compiled = torch.compile(transformer, fullgraph=True, backend=counter, dynamic=False)
    with apply(transformer, plan, backend="torch") as handle, torch.no_grad():
        torch.testing.assert_close(compiled(**inputs)[0], transformer(**inputs)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled(**other)[0], transformer(**other)[0], rtol=1e-5, atol=1e-5)
        assert len(handle.processor.shapes.derived) == 1
    assert counter.frame_count == 2
    torch._dynamo.reset()


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 4096])
def test_offset_mass_sums_each_sampled_querys_probabilities_by_axis_offset(chunk_bytes, device):
    """Against the probabilities written out, for every head, batch item and sampled query, with text tokens
    before and after the grid and padded text keys left out: in one chunk, and chunked by heads and rows; on a GPU
    the sampled rows and offsets travel to it once, asynchronously."""
    layout = TokenLayout(3, 2, 3, 4, suffix=2)
    F, Hh, W, G = 2, 3, 4, 24
    B, H, N, D = 2, 3, layout.seq_len, 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    keep = torch.tensor([[True, True], [True, False]])
    mass, count = offset_mass(q.to(device), k.to(device), layout, queries=10,
                              generator=torch.Generator().manual_seed(1), suffix_mask=keep.to(device),
                              chunk_bytes=chunk_bytes)
    picked = torch.randperm(G, generator=torch.Generator().manual_seed(1))[:10].sort().values
    logits = (q.double() @ k.double().transpose(-1, -2)) * D**-0.5
    logits[..., N - 2:] = logits[..., N - 2:].masked_fill(~keep[:, None, None, :], float("-inf"))
    p = logits.softmax(-1)[:, :, layout.prefix + picked, layout.prefix : layout.prefix + G].reshape(B, H, -1, F, Hh, W)
    expected = [torch.zeros(H, 2 * n - 1, dtype=torch.float64) for n in (F, Hh, W)]
    expected_count = [torch.zeros(2 * n - 1, dtype=torch.float64) for n in (F, Hh, W)]
    for s, token in enumerate(picked.tolist()):
        at = (token // (Hh * W), (token // W) % Hh, token % W)
        for axis, n in enumerate((F, Hh, W)):
            marginal = p[:, :, s].sum(dim=tuple(d for d in (2, 3, 4) if d != axis + 2)).sum(0)  # [H, n]
            for v in range(n):
                expected[axis][:, v - at[axis] + n - 1] += marginal[:, v]
                expected_count[axis][v - at[axis] + n - 1] += B
    for axis in range(3):
        torch.testing.assert_close(mass[axis], expected[axis], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(count[axis], expected_count[axis])
