"""Wan 2.2 on tiny offline pipelines: the A14B-like expert pair (`transformer` for the high-noise steps,
`transformer_2` for the low-noise ones, switched at `boundary_ratio`) and the TI2V-like model (a VAE that
compresses space by 16, per-token timesteps).

- dense plans equal the model's own attention in a whole pipeline run, through the expert switch;
- sparse plans run and change the result of the expert they are bound to, and only that one;
- calibration captures both experts in one run, writes a plan per expert, each naming its expert, and
  `load_plans` reads the pair back from either file;
- a plan for the wrong expert, a missing expert, or another size raise PlanError naming what the plan
  was calibrated for and what the pipeline or call has; sizes come from the pipeline's own VAE factors;
- `paro calibrate` and `paro generate --compare` run on saved pipeline folders of both.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import (
    TINY_BLOCK,
    WAN22_TI2V_HEADS,
    tiny_call_kwargs,
    tiny_forward_inputs,
    tiny_pipeline,
    tiny_transformer,
)
from typer.testing import CliRunner

from paroattn import Plan, PlanError, TokenLayout
from paroattn.app.cli import app
from paroattn.app.generate import plan_fit_problem
from paroattn.calibrate.config import CaptureConfig, SelectionConfig
from paroattn.calibrate.driver import (
    calibrate_experts,
    capture,
    save_expert_calibrations,
)
from paroattn.pipelines import apply, layout_for, pipeline_experts, self_attention_layers
from paroattn.plan import expert_plan_path, load_plans, model_fingerprint

PAIR_LAYOUT = TokenLayout(0, 3, 4, 4)  # 9 frames of 64 x 64, VAE 8 in space
TI2V_LAYOUT = TokenLayout(0, 3, 4, 4)  # 9 frames of 128 x 128, VAE 16 in space
STEPS = 4  # the pair: t = 1000, 858 on `transformer`, 602, 9 on `transformer_2`


def expert_plan(transformer, layout: TokenLayout, expert: str, *, density: float = 1.0, seed: int = 0,
                num_buckets: int = 3) -> Plan:
    plan = Plan.synthetic(
        layout=layout, num_layers=len(self_attention_layers(transformer)),
        num_heads=transformer.config.num_attention_heads, density=density,
        orders="random" if density < 1 else "FHW", num_buckets=num_buckets, block_size=TINY_BLOCK,
        model_class=type(transformer).__name__, model_fingerprint=model_fingerprint(transformer.config), seed=seed,
    )
    plan.expert = expert
    return plan


def pair_plans(pipe, density: float = 1.0) -> list[Plan]:
    return [expert_plan(module, PAIR_LAYOUT, name, density=density, seed=i)
            for i, (name, module) in enumerate(pipeline_experts(pipe))]


def generate_latents(pipe, family: str, steps: int = STEPS) -> torch.Tensor:
    kwargs = {**tiny_call_kwargs(family), "num_inference_steps": steps, "output_type": "latent"}
    with torch.no_grad():
        return pipe("a cat runs on the beach", generator=torch.Generator().manual_seed(0), **kwargs).frames


@pytest.fixture(scope="module")
def pair():
    pipe = tiny_pipeline("wan2.2")
    pipe.set_progress_bar_config(disable=True)
    return pipe, generate_latents(pipe, "wan2.2")


@pytest.fixture(scope="module")
def ti2v():
    pipe = tiny_pipeline("wan2.2-ti2v")
    pipe.set_progress_bar_config(disable=True)
    return pipe, generate_latents(pipe, "wan2.2-ti2v")


def calls_per_expert(pipe, family: str) -> dict[str, list[float]]:
    """The timesteps each expert is called at in a tiny run (cond and uncond)."""
    seen: dict[str, list[float]] = {}
    hooks = [module.register_forward_pre_hook(
        lambda m, a, k, name=name: seen.setdefault(name, []).append(float(k["timestep"].max())), with_kwargs=True)
        for name, module in pipeline_experts(pipe)]
    try:
        generate_latents(pipe, family)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


# -- the tiny pair itself ---------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_pair_switches_experts_within_a_run(pair):
    pipe, _ = pair
    assert [name for name, _ in pipeline_experts(pipe)] == ["transformer", "transformer_2"]
    seen = calls_per_expert(pipe, "wan2.2")
    assert len(seen["transformer"]) == len(seen["transformer_2"]) == 4  # two steps each, cond and uncond
    assert min(seen["transformer"]) >= 700 > max(seen["transformer_2"])


# -- equivalence and sparsity -----------------------------------------------------------------------


def test_dense_plans_equal_the_default_processors_across_the_switch(pair):
    pipe, reference = pair
    with apply(pipe, pair_plans(pipe), backend="torch") as handle:
        assert set(handle.experts) == {"transformer", "transformer_2"}
        assert all(h.active for h in handle.experts.values())
        out = generate_latents(pipe, "wan2.2")
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert all(type(p).__name__ != "PAROProcessor" for _, m in pipeline_experts(pipe) for p in m.attn_processors.values())
    assert torch.equal(generate_latents(pipe, "wan2.2"), reference)  # removed bit-exact


@pytest.mark.parametrize("sparse_expert", ["transformer", "transformer_2"])
def test_each_expert_runs_its_own_plan(pair, sparse_expert):
    """Sparse on one expert, dense on the other: under one `apply`, the sparse expert's forward differs from
    the model's own and the dense one's equals it; the whole run differs and stays finite."""
    pipe, reference = pair
    plans = [expert_plan(module, PAIR_LAYOUT, name, density=0.5 if name == sparse_expert else 1.0, seed=i)
             for i, (name, module) in enumerate(pipeline_experts(pipe))]
    inputs = tiny_forward_inputs(pipe.transformer, timestep=800.0, batch=1)
    with torch.no_grad():
        own = {name: module(**inputs)[0] for name, module in pipeline_experts(pipe)}
        with apply(pipe, plans, backend="torch"):
            paro = {name: module(**inputs)[0] for name, module in pipeline_experts(pipe)}
            out = generate_latents(pipe, "wan2.2")
    for name in own:
        if name == sparse_expert:
            assert (paro[name] - own[name]).abs().max() > 1e-3, name
        else:
            torch.testing.assert_close(paro[name], own[name], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all() and (out - reference).abs().max() > 1e-4


def test_ti2v_dense_plan_equals_default_and_sparse_runs(ti2v):
    pipe, reference = ti2v
    transformer = pipe.transformer
    assert transformer.config.num_attention_heads == WAN22_TI2V_HEADS
    layout = layout_for(pipe, height=128, width=128, frames=9)
    assert layout == TI2V_LAYOUT  # 128 / 16 (VAE) / 2 (patch) = 4
    with apply(pipe, expert_plan(transformer, layout, "transformer"), backend="torch"):
        dense = generate_latents(pipe, "wan2.2-ti2v")
    torch.testing.assert_close(dense, reference, rtol=1e-5, atol=1e-5)
    with apply(pipe, expert_plan(transformer, layout, "transformer", density=0.5), backend="torch"):
        sparse = generate_latents(pipe, "wan2.2-ti2v")
    assert torch.isfinite(sparse).all() and (sparse - reference).abs().max() > 1e-3


# -- mismatches name what the plan was calibrated for and what the pipeline has --------------------------


def test_a_plan_for_the_wrong_expert_raises_naming_both(pair):
    pipe, _ = pair
    high, low = pair_plans(pipe)
    with pytest.raises(PlanError) as info:
        apply(pipe, [high, high], backend="torch")
    assert "two plans were given for expert transformer" in str(info.value)
    assert "no plan for expert transformer_2 (low-noise steps, t < 700)" in str(info.value)
    assert "calibrated for transformer, transformer" in str(info.value)
    with pytest.raises(PlanError, match="no plan for expert transformer_2") as info:
        apply(pipe, high, backend="torch")
    # Wan 2.1-like pipeline (one transformer) given the low-noise expert's plan
    single = tiny_pipeline("wan")
    with pytest.raises(PlanError) as info:
        apply(single, low, backend="torch")
    message = str(info.value)
    assert "calibrated for expert transformer_2" in message and "this pipeline (WanPipeline) has transformer" in message
    # nothing stays installed after a refusal
    assert all(type(p).__name__ != "PAROProcessor" for _, m in pipeline_experts(pipe) for p in m.attn_processors.values())


def test_a_missing_expert_runs_dense_with_a_warning_under_on_mismatch_dense(pair):
    pipe, reference = pair
    high, _ = pair_plans(pipe)
    with pytest.warns(UserWarning, match="no plan for expert transformer_2"):
        handle = apply(pipe, [high], backend="torch", on_mismatch="dense")
    with handle:
        assert handle.experts["transformer"].active and not handle.experts["transformer_2"].active
        out = generate_latents(pipe, "wan2.2")
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_wrong_size_names_pixel_sizes_from_the_pipelines_own_vae(ti2v, pair):
    pipe, _ = ti2v
    plan = expert_plan(pipe.transformer, TokenLayout(0, 3, 8, 8), "transformer")  # made for 256 x 256
    call = {**tiny_call_kwargs("wan2.2-ti2v")}
    problem = plan_fit_problem(pipe, plan, call)
    assert "9 frames of 256x256" in problem and "9 frames of 128x128" in problem
    assert "paro calibrate MODEL_DIR --height 128 --width 128 --frames 9" in problem
    with apply(pipe, plan, backend="torch"), pytest.raises(PlanError, match="9 frames of 256x256"):
        generate_latents(pipe, "wan2.2-ti2v", steps=1)
    # the pair: each expert's plan is checked, and the message says which
    pair_pipe, _ = pair
    high, low = pair_plans(pair_pipe)
    low = Plan(**{**low.__dict__, "layout": TokenLayout(0, 3, 8, 8), "block_mask": expert_plan(
        pair_pipe.transformer_2, TokenLayout(0, 3, 8, 8), "transformer_2").block_mask, "density": None, "dense": None})
    problem = plan_fit_problem(pair_pipe, [high, low], tiny_call_kwargs("wan2.2"))
    assert problem.startswith("transformer_2: ") and "9 frames of 128x128" in problem and "9 frames of 64x64" in problem


def test_a_bare_ti2v_transformer_is_sized_by_the_vae_released_with_its_config():
    from paroattn.pipelines.base import PixelScale, pixel_scale_of
    from paroattn.pipelines.wan import WanAdapter

    tiny = tiny_transformer("wan2.2-ti2v")
    adapter = WanAdapter()
    assert pixel_scale_of(tiny, adapter) == PixelScale(4, 8)  # 6 latent channels: not the 48 of Wan 2.2's VAE
    tiny.register_to_config(out_channels=48)
    assert pixel_scale_of(tiny, adapter) == PixelScale(4, 16)
    assert adapter.describe_size(tiny, TokenLayout(0, 31, 22, 40), pixel_scale_of(tiny, adapter)) == "121 frames of 704x1280"


# -- calibration of both experts in one run -------------------------------------------------------------


HALF = SelectionConfig(density=0.5)


def calibration_config(family: str, **changes) -> CaptureConfig:
    kwargs = tiny_call_kwargs(family)
    extra = {"max_sequence_length": kwargs["max_sequence_length"], "guidance_scale": kwargs["guidance_scale"]}
    return CaptureConfig(**{"block_size": TINY_BLOCK, "steps": STEPS, "height": kwargs["height"],
                            "width": kwargs["width"], "frames": kwargs["num_frames"],
                            "bucket_edges": [1000.0, 900.0, 500.0, 0.0], "stat_every": 1,
                            "pipeline_kwargs": extra, **changes})


@pytest.mark.slow
def test_calibration_captures_both_experts_in_one_run_and_writes_a_plan_each(pair, tmp_path):
    pipe, reference = pair
    runs = []
    original = type(pipe).__call__

    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        runs.append(1)
        return original(self, *args, **kwargs)

    try:
        type(pipe).__call__ = counted
        calibrations = calibrate_experts(pipe, ["a red fox in the snow"], calibration_config("wan2.2"), HALF)
    finally:
        type(pipe).__call__ = original
    assert len(runs) == 1  # one pipeline run for both experts
    (high, high_result), (low, low_result) = calibrations
    assert (high.expert, low.expert) == ("transformer", "transformer_2")
    assert high.layout == low.layout == PAIR_LAYOUT
    # t = 1000 (bucket 0) and 858 (bucket 1) on the high-noise expert; 602 (bucket 1) and 9 (bucket 2) below
    assert high_result.steps_per_bucket == [1, 1, 0] and low_result.steps_per_bucket == [0, 1, 1]
    assert not torch.equal(high.block_mask[1], low.block_mask[1])  # bucket 1 seen by both, each its own

    paths = save_expert_calibrations(calibrations, tmp_path / "plan.safetensors")
    assert [p for p, _ in paths] == [tmp_path / "plan.safetensors", tmp_path / "plan.transformer_2.safetensors"]
    assert expert_plan_path(tmp_path / "plan.safetensors", "transformer_2") == paths[1][0]
    for path in (paths[0][0], paths[1][0]):  # either file gives the pair, in expert order
        loaded = load_plans(path)
        assert [p.expert for p in loaded] == ["transformer", "transformer_2"]
        assert torch.equal(loaded[1].block_mask, low.block_mask) and torch.equal(loaded[0].orders, high.orders)
    with apply(pipe, load_plans(paths[0][0]), backend="torch"):
        out = generate_latents(pipe, "wan2.2")
    assert torch.isfinite(out).all() and (out - reference).abs().max() > 1e-4

    paths[1][0].unlink()
    with pytest.raises(PlanError, match="transformer_2 plan .*plan.transformer_2.safetensors is missing"):
        load_plans(paths[0][0])
    high.save(paths[1][0])  # the high-noise plan under the low-noise file name
    with pytest.raises(PlanError, match="should hold the transformer_2 plan .* it holds the transformer plan"):
        load_plans(paths[0][0])


def test_single_expert_capture_refuses_a_pair_and_names_an_expert_that_never_ran(pair):
    pipe, _ = pair
    with pytest.raises(ValueError, match="capture_experts"):
        capture(pipe, ["a cat"], calibration_config("wan2.2"))
    with pytest.raises(RuntimeError, match=r"expert transformer_2 \(low-noise steps, t < 700\) ran in no captured step"):
        calibrate_experts(pipe, ["a cat"], calibration_config("wan2.2", steps=1), HALF)


def test_ti2v_calibration_plan_names_its_expert_and_sizes(ti2v):
    pipe, _ = ti2v
    [(plan, result)] = calibrate_experts(pipe, ["a red fox"], calibration_config("wan2.2-ti2v", steps=2), HALF)
    assert plan.expert == "transformer" and plan.layout == TI2V_LAYOUT and plan.num_heads == WAN22_TI2V_HEADS


# -- the command line on saved pipeline folders ------------------------------------------------------------


@pytest.mark.parametrize("family", ["wan2.2", "wan2.2-ti2v"])
@pytest.mark.slow
def test_cli_calibrate_and_generate_compare_on_a_saved_pipeline(family, tmp_path):
    pipe = tiny_pipeline(family)
    pipe.save_pretrained(tmp_path / "model")
    kwargs = tiny_call_kwargs(family)
    size = ["--height", kwargs["height"], "--width", kwargs["width"], "--frames", kwargs["num_frames"]]
    runner = CliRunner()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in the snow\n")
    result = runner.invoke(app, [str(a) for a in [
        "calibrate", tmp_path / "model", "--out", tmp_path / "plan.safetensors", "--prompts", prompts,
        "--num-prompts", 1, "--steps", STEPS, "--stat-every", 1, "--bucket-edges", "1000,900,500,0",
        "--density", 0.5, "--block-size", TINY_BLOCK, "--device", "cpu", *size]])
    assert result.exit_code == 0, result.output
    plans = load_plans(tmp_path / "plan.safetensors")
    if family == "wan2.2":
        assert "transformer and transformer_2" in result.output and "-- expert transformer_2" in result.output
        assert [p.expert for p in plans] == ["transformer", "transformer_2"]
        assert (tmp_path / "plan.transformer_2.stats.safetensors").is_file()
    else:
        assert [p.expert for p in plans] == ["transformer"]
    result = runner.invoke(app, [str(a) for a in [
        "generate", tmp_path / "model", "--prompt", "a cat", "--plan", tmp_path / "plan.safetensors", "--compare",
        "--steps", STEPS, "--device", "cpu", "--backend", "torch", "--out", tmp_path / "out.gif", *size]])
    assert result.exit_code == 0, result.output
    assert "PSNR" in result.output or "psnr" in result.output.lower()
    if family == "wan2.2":
        assert "experts transformer and transformer_2" in result.output
    assert (tmp_path / "out.gif").stat().st_size > 0 and (tmp_path / "out_dense.gif").stat().st_size > 0
