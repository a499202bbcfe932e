"""SkyReels-V2, Wan VACE, Qwen-Image, FLUX.2, HunyuanVideo 1.5, LTX-Video and LTX-2 on tiny offline models (each
layer against the reference op across buckets, and the mutations the oracle must see: `test_layer_oracle.py`; under
Ulysses: `test_context_parallel.py`):

- the self-attention layers PARO takes, in plan order, and the token layout of a generation size;
- a full-density plan reproduces the model's own output (fused and unfused RoPE, identity and random orders, and a
  lone processor installed on every attention module, which hands the others to their own processors), and a
  sparse one gives the same with the op's RoPE tables as with the model's RoPE code, differing from dense;
- layouts a plan cannot express are refused with a PlanError naming the reason (on_mismatch="dense" runs the model's
  own attention, the text padding included);
- Wan VACE, SkyReels-V2, LTX-Video, Qwen-Image and FLUX.2 [klein] pipelines: a dense plan equals the default;
  `paro calibrate` and `paro generate --compare` run on a saved pipeline folder of each (Qwen-Image: a prompt of
  another token count gets masks derived from the plan).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    FLUX2_TEXT,
    HUNYUAN15_TEXT,
    QWEN_TEXT,
    TINY_BLOCK,
    lone_processor,
    tiny_call_kwargs,
    tiny_forward_inputs,
    tiny_pipeline,
    tiny_transformer,
)
from typer.testing import CliRunner

from paroattn import Plan, PlanError, TokenLayout
from paroattn.app.cli import app
from paroattn.pipelines import apply, family_of, layout_for, self_attention_layers
from paroattn.plan import model_fingerprint

FAMILIES = ["skyreels_v2", "wan_vace", "qwen_image", "flux2", "hunyuan_video15", "ltx", "ltx2"]


def make_plan(transformer, layout, *, density=1.0, orders="FHW", num_buckets=2, seed=0) -> Plan:
    return Plan.synthetic(
        layout=layout, num_layers=len(self_attention_layers(transformer)),
        num_heads=transformer.config.num_attention_heads, density=density, orders=orders, num_buckets=num_buckets,
        block_size=TINY_BLOCK, model_class=type(transformer).__name__,
        model_fingerprint=model_fingerprint(transformer.config), seed=seed,
    )


def run(transformer, inputs):
    """Every output of the forward (LTX-2: video and audio), flattened into one tensor."""
    with torch.no_grad():
        return torch.cat([out.flatten() for out in transformer(**inputs)])


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    transformer = tiny_transformer(request.param)
    inputs = tiny_forward_inputs(transformer, timestep=700.0)
    reference = run(transformer, inputs)
    layout = family_of(transformer).call_inputs(transformer, inputs).layout
    return request.param, transformer, inputs, reference, layout


def test_layers_and_layouts():
    vace = tiny_transformer("wan_vace")
    assert self_attention_layers(vace) == [
        "blocks.0.attn1.processor", "blocks.1.attn1.processor",
        "vace_blocks.0.attn1.processor", "vace_blocks.1.attn1.processor"]
    assert self_attention_layers(tiny_transformer("skyreels_v2")) == ["blocks.0.attn1.processor",
                                                                      "blocks.1.attn1.processor"]
    assert self_attention_layers(tiny_transformer("qwen_image")) == [
        "transformer_blocks.0.attn.processor", "transformer_blocks.1.attn.processor"]
    assert self_attention_layers(tiny_transformer("flux2")) == [
        "transformer_blocks.0.attn.processor", "single_transformer_blocks.0.attn.processor",
        "single_transformer_blocks.1.attn.processor"]
    # 720p x 121 frames (SkyReels-V2 720P): 31 latent frames of 90 x 160 -> 31 x 45 x 80 tokens, no text
    assert layout_for(tiny_transformer("skyreels_v2"), height=720, width=1280, frames=121) == TokenLayout(0, 31, 45, 80)
    assert layout_for(vace, height=480, width=832, frames=81) == TokenLayout(0, 21, 30, 52)
    # 1024 x 1024: 128 x 128 latents, 2 x 2 per token -> 64 x 64 tokens after the text
    assert layout_for(tiny_transformer("qwen_image"), height=1024, width=1024, text_tokens=77) == TokenLayout(
        77, 1, 64, 64)
    assert layout_for(tiny_transformer("flux2"), height=1024, width=1024) == TokenLayout(512, 1, 64, 64)
    # HunyuanVideo 1.5 at 720p x 121 frames: its VAE compresses space by 16 -> 31 x 45 x 80, then 1985 text tokens
    hunyuan15 = tiny_transformer("hunyuan_video15")
    assert self_attention_layers(hunyuan15) == ["transformer_blocks.0.attn.processor",
                                                "transformer_blocks.1.attn.processor"]
    assert layout_for(hunyuan15, height=720, width=1280, frames=121) == TokenLayout(0, 31, 45, 80, suffix=1985)
    # LTX-Video's pipeline default, 161 frames of 512 x 704: its VAE compresses by 8 in time and 32 in space
    ltx = tiny_transformer("ltx")
    assert self_attention_layers(ltx) == ["transformer_blocks.0.attn1.processor", "transformer_blocks.1.attn1.processor"]
    assert layout_for(ltx, height=512, width=704, frames=161) == TokenLayout(0, 21, 16, 22)
    # LTX-2's pipeline default, 121 frames of 512 x 768 (VAE 8 in time, 32 in space)
    ltx2 = tiny_transformer("ltx2")
    assert self_attention_layers(ltx2) == ["transformer_blocks.0.attn1.processor", "transformer_blocks.1.attn1.processor"]
    assert layout_for(ltx2, height=512, width=768, frames=121) == TokenLayout(0, 16, 16, 24)


def test_call_layouts_of_the_tiny_models():
    expected = {"skyreels_v2": TokenLayout(0, 3, 4, 4), "wan_vace": TokenLayout(0, 3, 4, 4),
                "hunyuan_video15": TokenLayout(0, 4, 8, 8, suffix=sum(HUNYUAN15_TEXT)), "ltx": TokenLayout(0, 4, 8, 8),
                "ltx2": TokenLayout(0, 4, 8, 8),
                "qwen_image": TokenLayout(QWEN_TEXT, 1, 6, 6), "flux2": TokenLayout(FLUX2_TEXT, 1, 6, 6)}
    for family, layout in expected.items():
        transformer = tiny_transformer(family)
        inputs = tiny_forward_inputs(transformer)
        adapter = family_of(transformer)
        assert adapter.call_inputs(transformer, inputs).layout == layout, family
        size = adapter.pixel_size(transformer, layout, adapter.default_scale(transformer))
        assert layout_for(transformer, **size, text_tokens=layout.prefix + layout.suffix) == layout, family


@pytest.mark.parametrize("orders", ["FHW", "random"])
@pytest.mark.parametrize("fuse_rope", [True, False])
def test_dense_plan_equals_the_models_own_attention(model, orders, fuse_rope):
    _, transformer, inputs, reference, layout = model
    with apply(transformer, make_plan(transformer, layout, orders=orders), backend="torch", fuse_rope=fuse_rope):
        out = run(transformer, inputs)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(run(transformer, inputs), reference)  # and comes off bit-exact


def test_lone_processor_on_every_module_equals_the_models_own_attention(model):
    """`set_attn_processor(PAROProcessor(plan))` puts PARO on cross-attention and audio modules too: it must hand
    them to their default processors with every argument they came with (LTX-2's key_rotary_emb included)."""
    from paroattn.pipelines import PAROProcessor

    _, transformer, inputs, reference, layout = model
    with lone_processor(transformer, PAROProcessor(make_plan(transformer, layout, orders="random"), backend="torch")):
        out = run(transformer, inputs)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_sparse_plan_the_ops_rope_equals_the_models(model):
    _, transformer, inputs, reference, layout = model
    outs = []
    for fuse_rope in (True, False):
        with apply(transformer, make_plan(transformer, layout, density=0.5, orders="random"), backend="torch",
                   fuse_rope=fuse_rope):
            outs.append(run(transformer, inputs))
    assert torch.isfinite(outs[0]).all() and (outs[0] - reference).abs().max() > 1e-3
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


# -- refusals ------------------------------------------------------------------------------------------------------


def _refused(transformer, inputs, plan, match):
    with apply(transformer, plan, backend="torch"), pytest.raises(PlanError, match=match):
        run(transformer, inputs)
    with pytest.warns(UserWarning, match=match), apply(transformer, plan, backend="torch", on_mismatch="dense"):
        return run(transformer, inputs)


def test_skyreels_causal_blocks_are_refused():
    transformer = tiny_transformer("skyreels_v2")
    inputs = tiny_forward_inputs(transformer)
    transformer.register_to_config(num_frame_per_block=3)  # what causal_block_size=3 sets: one causal block here
    plan = make_plan(transformer, TokenLayout(0, 3, 4, 4))
    reference = run(transformer, inputs)
    out = _refused(transformer, inputs, plan, "attends causally over blocks of 3 frames")
    assert torch.equal(out, reference)


def test_qwen_image_padded_text_is_refused_and_dense_keeps_the_padding():
    transformer = tiny_transformer("qwen_image")
    inputs = tiny_forward_inputs(transformer)
    mask = torch.ones(2, QWEN_TEXT, dtype=torch.long)
    mask[0, 6:] = 0  # prompts of 6 and 10 tokens in one batch
    inputs["encoder_hidden_states_mask"] = mask
    reference = run(transformer, inputs)
    unpadded = run(transformer, {**inputs, "encoder_hidden_states_mask": None})
    assert (reference[0] - unpadded[0]).abs().max() > 1e-3  # the padding matters to the model
    out = _refused(transformer, inputs, make_plan(transformer, TokenLayout(QWEN_TEXT, 1, 6, 6)),
                   "prompts have different lengths")
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    # a mask with nothing padded is no mask: PARO runs
    ones = {**inputs, "encoder_hidden_states_mask": torch.ones(2, QWEN_TEXT, dtype=torch.long)}
    with apply(transformer, make_plan(transformer, TokenLayout(QWEN_TEXT, 1, 6, 6)), backend="torch"):
        torch.testing.assert_close(run(transformer, ones), unpadded, rtol=1e-5, atol=1e-5)


def test_qwen_image_edit_and_other_text_lengths_are_refused():
    transformer = tiny_transformer("qwen_image")
    inputs = tiny_forward_inputs(transformer)
    plan = make_plan(transformer, TokenLayout(QWEN_TEXT, 1, 6, 6))
    # the target and a 3 x 3 reference image (Qwen-Image-Edit), its tokens after the target's
    edit = {**inputs, "hidden_states": torch.cat([inputs["hidden_states"], inputs["hidden_states"][:, :9]], dim=1),
            "img_shapes": [[(1, 6, 6), (1, 3, 3)]] * 2}
    _refused(transformer, edit, plan, "more than one image per sample")
    shorter = {**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"][:, :7]}
    with apply(transformer, plan, backend="torch"), pytest.raises(PlanError, match=f"calibrated with {QWEN_TEXT} text"):
        run(transformer, shorter)


def test_flux2_reference_images_and_kv_cache_are_refused():
    transformer = tiny_transformer("flux2")
    inputs = tiny_forward_inputs(transformer)
    plan = make_plan(transformer, TokenLayout(FLUX2_TEXT, 1, 6, 6))
    ref_ids = inputs["img_ids"].clone()
    ref_ids[..., 0] = 10  # a reference image's tokens: time coordinate 10, after the target's
    conditioned = {**inputs, "hidden_states": torch.cat([inputs["hidden_states"]] * 2, dim=1),
                   "img_ids": torch.cat([inputs["img_ids"], ref_ids], dim=1)}
    reference = run(transformer, conditioned)
    out = _refused(transformer, conditioned, plan, r"1 reference image\(s\) after the target")
    assert torch.equal(out, reference)
    adapter = family_of(transformer)
    inputs_cached = {**inputs, "kv_cache_mode": "extract", "num_ref_tokens": 36}
    assert "reference KV cache" in adapter.call_inputs(transformer, inputs_cached).problem


def test_ltx_conditioning_tokens_after_the_grid_are_refused():
    transformer = tiny_transformer("ltx")
    inputs = tiny_forward_inputs(transformer)
    plan = make_plan(transformer, TokenLayout(0, 4, 8, 8))
    # a keyframe's 64 tokens appended after the 4 x 8 x 8 video, as LTXConditionPipeline conditions
    # (the RoPE then comes from each token's coordinates, `video_coords` [B, 3, N], as that pipeline passes them)
    coords = torch.stack(torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in (5, 8, 8)), indexing="ij"))
    conditioned = {**inputs, "hidden_states": torch.cat([inputs["hidden_states"], inputs["hidden_states"][:, :64]], 1),
                   "video_coords": coords.flatten(1)[None].expand(2, -1, -1)}
    problem = family_of(transformer).call_inputs(transformer, conditioned).problem
    assert "the call has 320 video tokens, not the 4x8x8 grid" in problem
    reference = run(transformer, conditioned)
    assert torch.equal(_refused(transformer, conditioned, plan, "320 video tokens"), reference)


def test_ltx2_split_rope_runs_as_the_model_applies_it():
    """LTX-2's other RoPE (`rope_type="split"`: the two halves of each head rotated, per-head tables): a dense plan
    equals the model's attention, a sparse one differs."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=2, caption_channels=16, rope_type="split").eval()
    assert transformer.transformer_blocks[0].attn1.rope_type == "split"
    with torch.no_grad():
        for parameter in transformer.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    inputs = tiny_forward_inputs(transformer)
    reference = run(transformer, inputs)
    layout = TokenLayout(0, 4, 8, 8)
    with apply(transformer, make_plan(transformer, layout, orders="random"), backend="torch"):
        torch.testing.assert_close(run(transformer, inputs), reference, rtol=1e-5, atol=1e-5)
    with apply(transformer, make_plan(transformer, layout, density=0.5, orders="random"), backend="torch"):
        assert (run(transformer, inputs) - reference).abs().max() > 1e-3


def test_ltx2_self_attention_mask_and_perturbed_attention_are_refused():
    transformer = tiny_transformer("ltx2")
    inputs = tiny_forward_inputs(transformer)
    plan = make_plan(transformer, TokenLayout(0, 4, 8, 8))
    masked = {**inputs, "video_self_attention_mask": torch.ones(2, 256, 256)}
    masked["video_self_attention_mask"][:, :, 128:] = 0  # the first half of the video may not see the second
    reference = run(transformer, masked)
    assert (reference - run(transformer, inputs)).abs().max() > 1e-3
    out = _refused(transformer, masked, plan, "masks the video self-attention")
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)  # the dense path keeps the model's mask

    perturbed = tiny_transformer("ltx2")
    perturbed.register_to_config(perturbed_attn=True)
    with pytest.raises(PlanError, match="perturbed_attn=True"):
        apply(perturbed, plan, backend="torch")


# -- pipelines -----------------------------------------------------------------------------------------------------


@pytest.fixture
def no_ftfy(monkeypatch):
    """These pipelines clean prompts with ftfy (not a dependency here): stand it in by the identity."""
    import types

    from diffusers.pipelines.skyreels_v2 import pipeline_skyreels_v2
    from diffusers.pipelines.wan import pipeline_wan_vace

    for module in (pipeline_skyreels_v2, pipeline_wan_vace):
        monkeypatch.setattr(module, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)


# the tiny Qwen-Image pipeline's tokenizer has one token per byte: this prompt gives 137 text tokens (the system
# prompt's tail included), before 6 x 6 image tokens
QWEN_PIPELINE_LAYOUT = TokenLayout(137, 1, 6, 6)
PIPELINE_LAYOUTS = {"skyreels_v2": TokenLayout(0, 3, 4, 4), "wan_vace": TokenLayout(0, 3, 4, 4),
                    "ltx": TokenLayout(0, 3, 4, 4), "qwen_image": QWEN_PIPELINE_LAYOUT,
                    "flux2": TokenLayout(FLUX2_TEXT, 1, 6, 6)}


@pytest.mark.parametrize("family", list(PIPELINE_LAYOUTS))
@pytest.mark.slow
def test_pipeline_dense_plan_equals_default(family, no_ftfy):
    pipe = tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {**tiny_call_kwargs(family), "output_type": "latent"}
    layout = PIPELINE_LAYOUTS[family]

    def generate():
        with torch.no_grad():
            result = pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), **kwargs)
        return result.images if family in ("qwen_image", "flux2") else result.frames

    reference = generate()
    with apply(pipe, make_plan(pipe.transformer, layout, orders="random"), backend="torch"):
        torch.testing.assert_close(generate(), reference, rtol=1e-5, atol=1e-5)
    with apply(pipe, make_plan(pipe.transformer, layout, density=0.5, orders="random"), backend="torch"):
        sparse = generate()
    assert torch.isfinite(sparse).all() and (sparse - reference).abs().max() > 1e-4


def cli_calibrate(tmp_path, family: str, prompt: str, options: list) -> tuple[CliRunner, object]:
    """The tiny `family` pipeline saved under tmp_path/model and `paro calibrate` run on it with one prompt (2
    buckets, d = 0.5, the tiny block) and `options`, into tmp_path/plan.safetensors: the runner and the result."""
    tiny_pipeline(family).save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(prompt + "\n")
    runner = CliRunner()
    result = runner.invoke(app, [str(a) for a in [
        "calibrate", tmp_path / "model", "--out", tmp_path / "plan.safetensors", "--prompts", prompts,
        "--num-prompts", 1, "--stat-every", 1, "--buckets", 2, "--density", 0.5, "--block-size", TINY_BLOCK,
        *options]])
    return runner, result


@pytest.mark.parametrize("family,size,layers", [("wan_vace", (64, 64, 9), 4), ("skyreels_v2", (64, 64, 9), 2),
                                                 ("ltx", (128, 128, 17), 2)])
@pytest.mark.slow
def test_cli_calibrate_and_generate_compare(tmp_path, no_ftfy, family, size, layers):
    size = ["--height", size[0], "--width", size[1], "--frames", size[2]]
    runner, result = cli_calibrate(tmp_path, family, "a red fox in the snow", ["--steps", 2, "--device", "cpu", *size])
    assert result.exit_code == 0, result.output
    plan = Plan.load(tmp_path / "plan.safetensors")
    assert plan.layout == TokenLayout(0, 3, 4, 4) and plan.num_layers == layers
    result = runner.invoke(app, [str(a) for a in [
        "generate", tmp_path / "model", "--prompt", "a cat", "--plan", tmp_path / "plan.safetensors", "--compare",
        "--steps", 2, "--device", "cpu", "--backend", "torch", "--out", tmp_path / "out.gif", *size]])
    assert result.exit_code == 0, result.output
    assert "PARO vs dense: PSNR" in result.output


@pytest.mark.slow
def test_cli_calibrate_and_generate_compare_flux2_klein(tmp_path):
    """FLUX.2 [klein] pads the prompt to max_sequence_length (512 by default): calibration at the default, and
    generation with the plan's text length (which `paro generate` passes)."""
    size = ["--height", 96, "--width", 96, "--steps", 2, "--device", "cpu"]
    runner, result = cli_calibrate(tmp_path, "flux2", "a red fox in the snow", size)
    assert result.exit_code == 0, result.output
    assert Plan.load(tmp_path / "plan.safetensors").layout == TokenLayout(512, 1, 6, 6)
    result = runner.invoke(app, [str(a) for a in [
        "generate", tmp_path / "model", "--prompt", "a cat", "--plan", tmp_path / "plan.safetensors", "--compare",
        "--backend", "torch", "--out", tmp_path / "out.png", *size]])
    assert result.exit_code == 0, result.output
    assert "PARO vs dense: PSNR" in result.output


@pytest.mark.slow
def test_cli_qwen_image_plan_serves_prompts_of_other_token_counts(tmp_path):
    """Qwen-Image does not pad prompts: a prompt of another token count is another layout, whose masks the plan
    derives from its axis profiles as for another size."""
    size = ["--height", 96, "--width", 96, "--steps", 2, "--device", "cpu"]
    runner, result = cli_calibrate(tmp_path, "qwen_image", "a red fox", size)
    assert result.exit_code == 0, result.output
    assert Plan.load(tmp_path / "plan.safetensors").layout == QWEN_PIPELINE_LAYOUT

    def generate(prompt):
        return runner.invoke(app, [str(a) for a in [
            "generate", tmp_path / "model", "--prompt", prompt, "--plan", tmp_path / "plan.safetensors", "--compare",
            "--backend", "torch", "--out", tmp_path / "out.png", "--overwrite", *size]])

    result = generate("a big cat")  # as many tokens as the calibration prompt
    assert result.exit_code == 0, result.output
    assert "PARO vs dense: PSNR" in result.output
    result = generate("a cat")  # 4 tokens fewer: masks derived for 133 text tokens from the plan's axis profiles
    assert result.exit_code == 0, result.output
    assert "PARO vs dense: PSNR" in result.output
    pipe = tiny_pipeline("qwen_image")
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad(), apply(pipe, Plan.load(tmp_path / "plan.safetensors"), backend="torch") as handle:
        pipe(prompt="a cat", **tiny_call_kwargs("qwen_image"))
        assert TokenLayout(133, 1, 6, 6) in handle.processor.shapes.derived
