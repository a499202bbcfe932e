"""HunyuanVideo on tiny offline models: joint attention over [video ; text] with the text padded.

- dense plans equal the model's own attention (padded text included, fused and unfused RoPE), in a forward
  and a whole pipeline run, and come off bit-exact; sparse plans run and differ;
- the model's [B, 1, 1, N] key mask becomes the op's suffix_mask, None when no text token is padding; the
  Triton kernels (interpreter) run padded text, eagerly and under torch.compile, as the reference does;
- the token refiner's attention keeps its processor;
- a plan for another size or text length raises PlanError naming both and the fix;
- calibration statistics leave the padded text keys out, as the op does;
- calibration, `paro calibrate` and `paro generate --compare` on a saved pipeline folder.
- each layer against attention built from first principles with the plan's orders, masks and the padding (and
  against the reference op in `test_layer_oracle.py`).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    HUNYUAN_TEXT,
    HUNYUAN_VALID_TEXT,
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
from paroattn.app.generate import plan_fit_problem
from paroattn.pipelines import apply, family_of, layout_for, self_attention_layers
from paroattn.plan import load_plans, model_fingerprint

PIPELINE_LAYOUT = TokenLayout(0, 3, 4, 4, suffix=HUNYUAN_TEXT)


def make_plan(transformer, layout, *, density=1.0, orders="FHW", num_buckets=2, seed=0) -> Plan:
    return Plan.synthetic(
        layout=layout, num_layers=len(self_attention_layers(transformer)),
        num_heads=transformer.config.num_attention_heads, density=density, orders=orders, num_buckets=num_buckets,
        block_size=TINY_BLOCK, model_class=type(transformer).__name__,
        model_fingerprint=model_fingerprint(transformer.config), seed=seed,
    )


@pytest.fixture(scope="module")
def model():
    transformer = tiny_transformer("hunyuan_video")
    inputs = tiny_forward_inputs(transformer, timestep=700.0)
    assert not bool(inputs["encoder_attention_mask"].all())  # item 0's text is padded
    with torch.no_grad():
        reference = transformer(**inputs)[0]
    layout = family_of(transformer).call_inputs(transformer, inputs).layout
    return transformer, inputs, reference, layout


def run(transformer, inputs):
    with torch.no_grad():
        return transformer(**inputs)[0]


def test_layers_and_layout():
    transformer = tiny_transformer("hunyuan_video")
    assert self_attention_layers(transformer) == [
        "transformer_blocks.0.attn.processor", "single_transformer_blocks.0.attn.processor",
        "single_transformer_blocks.1.attn.processor"]
    # 720p x 129 frames: 33 latent frames of 90 x 160 -> 33 x 45 x 80 tokens, then 256 text tokens
    layout = layout_for(transformer, height=720, width=1280, frames=129)
    assert layout == TokenLayout(0, 33, 45, 80, suffix=256) and layout.seq_len == 119056


@pytest.mark.parametrize("orders", ["FHW", "random"])
@pytest.mark.parametrize("fuse_rope", [True, False])
def test_dense_plan_equals_the_default_processors(model, orders, fuse_rope):
    transformer, inputs, reference, layout = model
    refiner = transformer.context_embedder.token_refiner.refiner_blocks[0].attn.processor
    with apply(transformer, make_plan(transformer, layout, orders=orders), backend="torch", fuse_rope=fuse_rope):
        assert transformer.context_embedder.token_refiner.refiner_blocks[0].attn.processor is refiner
        out = run(transformer, inputs)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(run(transformer, inputs), reference)


def test_lone_processor_hands_the_refiner_to_its_own_processor(model):
    """`set_attn_processor(PAROProcessor(plan))` also lands on the token refiner's attention, which the processor
    hands to diffusers' `AttnProcessor2_0`, as the model has it: a dense plan gives the model's output."""
    from paroattn.pipelines import PAROProcessor

    transformer, inputs, reference, layout = model
    with lone_processor(transformer, PAROProcessor(make_plan(transformer, layout, orders="random"), backend="torch")):
        out = run(transformer, inputs)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_sparse_plan_runs_and_differs(model):
    transformer, inputs, reference, layout = model
    outs = []
    for fuse_rope in (True, False):
        with apply(transformer, make_plan(transformer, layout, density=0.5, orders="random"), backend="torch",
                   fuse_rope=fuse_rope):
            outs.append(run(transformer, inputs))
    assert torch.isfinite(outs[0]).all() and (outs[0] - reference).abs().max() > 1e-3
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)  # the op's RoPE tables = the model's RoPE


def test_padding_becomes_the_suffix_mask_and_none_without_padding(model):
    transformer, inputs, _, layout = model
    adapter = family_of(transformer)
    masks = []
    hook = transformer.transformer_blocks[0].attn.register_forward_pre_hook(
        lambda m, a, k: masks.append(k["attention_mask"]), with_kwargs=True)
    try:
        run(transformer, inputs)
        run(transformer, {**inputs, "encoder_attention_mask": torch.ones_like(inputs["encoder_attention_mask"])})
    finally:
        hook.remove()
    handled, padded = adapter.suffix_mask(masks[0], layout)
    assert handled and padded.shape == (2, HUNYUAN_TEXT)
    assert padded[0].tolist() == [True] * HUNYUAN_VALID_TEXT + [False] * (HUNYUAN_TEXT - HUNYUAN_VALID_TEXT)
    assert bool(padded[1].all())
    assert adapter.suffix_mask(masks[1], layout) == (True, None)  # nothing padded: the Triton kernels can run it


def test_every_layer_equals_first_principles_attention_with_the_padding():
    """Forward calls at falling timesteps through three buckets, item 0's text padded: each layer's output is
    softmax attention built from first principles (each grid token's (f, h, w) sorted by its head's order, the text
    kept after the grid, the mask of that layer and of the bucket the test derives from the timestep expanded
    through that permutation, padded text keys never attended), then the layer's output projections. Removing the
    padding, or taking another layer's, bucket's or head's entry, or the transposed mask, moves the result."""
    from test_layer_oracle import (
        TIMESTEPS,
        VISIBLE,
        LayerRecorder,
        _replace,
        discriminating_plan,
        grid_permutation,
    )

    from paroattn.layout import ORDERS

    transformer = tiny_transformer("hunyuan_video")
    adapter = family_of(transformer)
    calls = [tiny_forward_inputs(transformer, timestep=t, seed=i) for i, t in enumerate(TIMESTEPS)]
    layout = adapter.call_inputs(transformer, calls[0]).layout
    plan = discriminating_plan(transformer, layout, [1000.0, 750.0, 500.0, 0.0], seed=1)
    with torch.no_grad(), apply(transformer, plan, backend="torch"), LayerRecorder(transformer, plan) as recorder:
        for inputs in calls:
            transformer(**inputs)
    assert {bucket for _, bucket, _ in recorder.forwards} == {0, 1, 2}

    def first_principles(call, plan, bucket, padded=True):
        split = adapter.rotate(adapter.qkv(call["module"], call["hidden_states"], call["encoder_hidden_states"],
                                           call["rotary"]))
        q, k, v = split.q, split.k, split.v
        B, H, N, D = q.shape
        keys = torch.ones(B, N, dtype=torch.bool)
        if padded:  # the model's [B, 1, 1, N] mask: False at padded text keys
            keys = call["attention_mask"][:, 0, 0, :].bool()
        out = torch.empty_like(q)
        for h in range(H):
            position = torch.empty(N, dtype=torch.long)  # original token -> reordered position
            position[torch.tensor(grid_permutation(layout, ORDERS[int(plan.orders[call["layer"], h])]))] = torch.arange(N)
            block = position // TINY_BLOCK
            allowed = plan.block_mask[bucket, call["layer"], h][block[:, None], block[None, :]]
            scores = (q[:, h] @ k[:, h].transpose(-1, -2)) / D ** 0.5
            attended = allowed[None] & keys[:, None, :]
            weights = torch.softmax(scores.masked_fill(~attended, float("-inf")), dim=-1)
            # a query whose active blocks hold padded keys only attends to nothing: zeros (the op's contract)
            out[:, h] = torch.where(attended.any(-1, keepdim=True), weights, 0.0) @ v[:, h]
        return adapter.finish(call["module"], out, split)

    assert not bool(recorder.calls[0]["attention_mask"].all())
    for call in recorder.calls:
        _, bucket, _ = recorder.forwards[call["forward"]]
        with torch.no_grad():
            expected = first_principles(call, plan, bucket)
        for got, want in zip(call["output"], expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, c=call: f"layer {c['layer']}: {m}")

    call = next(c for c in recorder.calls if c["layer"] == plan.num_layers - 1 and recorder.forwards[c["forward"]][1] == 1)
    L = plan.num_layers
    with torch.no_grad():
        right = first_principles(call, plan, 1)[0]
        wrong = {
            "padding ignored": first_principles(call, plan, 1, padded=False)[0],
            "layer 0": first_principles(call, _replace(plan, orders=plan.orders[[0] * L],
                                                       block_mask=plan.block_mask[:, [0] * L]), 1)[0],
            "other bucket": first_principles(call, plan, 0)[0],
            "heads rolled": first_principles(call, _replace(plan, orders=plan.orders.roll(1, dims=1)), 1)[0],
            "transposed": first_principles(call, _replace(plan, block_mask=plan.block_mask.transpose(-1, -2)), 1)[0],
        }
    for what, moved in wrong.items():
        assert (moved - right).abs().max() > VISIBLE, what


@pytest.mark.skipif(torch.cuda.is_available(), reason="16-token blocks run in the interpreter only; the GPU's "
                    "padded-text checks are in test_key_mask.py")
@pytest.mark.slow
def test_triton_kernels_run_padded_text_eagerly_and_compiled():
    """fp16 at head dim 64 (the kernels' head dims): the Triton backend with item 0's text padded agrees with the
    reference op, and the compiled transformer (the adapter hands the traced mask to the custom op) equals the
    eager Triton run."""
    transformer = tiny_transformer("hunyuan_video", dtype=torch.float16, head_dim=64)
    inputs = tiny_forward_inputs(transformer, timestep=700.0)
    layout = family_of(transformer).call_inputs(transformer, inputs).layout
    plan = make_plan(transformer, layout, density=0.5, orders="random")
    outs = {}
    for backend in ("torch", "triton"):
        with apply(transformer, plan, backend=backend):
            outs[backend] = run(transformer, inputs)
    with apply(transformer, plan, backend="torch"):
        unmasked = run(transformer, {**inputs, "encoder_attention_mask": torch.ones_like(inputs["encoder_attention_mask"])})
    scale = outs["torch"].float().abs().max()
    error = float((outs["triton"].float() - outs["torch"].float()).abs().max() / scale)  # seen: 7e-4
    padding = float((unmasked[0].float() - outs["torch"][0].float()).abs().max() / scale)  # seen: 3.7e-2
    assert error < 3e-3 and padding > 10 * error  # item 0's padding matters, and the kernels follow it
    with apply(transformer, plan, backend="triton"), torch.no_grad():
        # dynamic=False, as the README asks: after other models' compiles in one process, dynamo's automatic dynamic
        # shapes would make this call's sizes symbolic, and a plan serves fixed sizes
        compiled = torch.compile(transformer, fullgraph=True, backend="aot_eager", dynamic=False)
        torch.testing.assert_close(compiled(**inputs)[0], outs["triton"], rtol=0, atol=0)
    torch._dynamo.reset()


def test_mismatches_name_the_calibrated_and_actual_sizes(model):
    transformer, inputs, _, layout = model
    pipe = tiny_pipeline("hunyuan_video")
    call = tiny_call_kwargs("hunyuan_video")
    plan = make_plan(pipe.transformer, TokenLayout(0, 3, 4, 6, suffix=HUNYUAN_TEXT))  # made for 64 x 96
    problem = plan_fit_problem(pipe, plan, call)
    assert "9 frames of 64x96" in problem and "9 frames of 64x64" in problem
    assert "paro calibrate MODEL_DIR --height 64 --width 64 --frames 9" in problem
    longer = make_plan(pipe.transformer, TokenLayout(0, 3, 4, 4, suffix=30))
    problem = plan_fit_problem(pipe, longer, call)
    assert "calibrated with 30 text tokens; this call has 21: pass max_sequence_length=30" in problem
    with apply(transformer, make_plan(transformer, TokenLayout(0, 4, 4, 4, suffix=30)), backend="torch"):
        with pytest.raises(PlanError, match="calibrated with 30 text tokens; this call has 21"):
            run(transformer, inputs)


def test_capture_statistics_leave_out_padded_text_keys(model):
    from test_calibrate import stats_of_real_keys

    from paroattn.calibrate.block_stats import block_stats
    from paroattn.pipelines import capture_attention

    transformer, inputs, reference, layout = model
    seen = []
    with capture_attention(transformer, lambda layer, q, k, layout, t, suffix_mask: seen.append((q, k, suffix_mask))):
        torch.testing.assert_close(run(transformer, inputs), reference, rtol=0, atol=0)
    assert len(seen) == len(self_attention_layers(transformer))
    real = inputs["encoder_attention_mask"].bool()
    for q, k, suffix_mask in seen:
        assert torch.equal(suffix_mask, real)  # item 0 has HUNYUAN_VALID_TEXT real text tokens
        orders = list(layout.distinct_orders())
        got = block_stats(q, k, layout, orders, TINY_BLOCK, backend="torch", suffix_mask=suffix_mask)
        want = stats_of_real_keys(q, k, layout, orders, TINY_BLOCK, suffix_mask, eps=1e-3)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
        assert torch.equal(got[2], want[2])


def test_calibration_gives_padded_text_keys_no_mass():
    from paroattn.calibrate.config import CaptureConfig
    from paroattn.calibrate.driver import capture

    pipe = tiny_pipeline("hunyuan_video")
    pipe.set_progress_bar_config(disable=True)
    kwargs = tiny_call_kwargs("hunyuan_video")
    extra = {key: kwargs[key] for key in ("max_sequence_length", "guidance_scale", "prompt_template")}
    config = CaptureConfig(block_size=TINY_BLOCK, steps=1, height=64, width=64, frames=9, num_buckets=1,
                           bucket_edges=[1000.0, 0.0], stat_every=1, pipeline_kwargs=extra, extras=True)
    # the tiny pipeline pads this prompt's text to 21 tokens, 14 of them real: tokens 62..68 are padding,
    # and key block 4 (tokens 64..68) holds nothing else
    stats = capture(pipe, ["a red fox in the snow"], config)
    assert stats.layout == PIPELINE_LAYOUT
    acc = stats.accumulators["all"]
    acc.flush()
    for layer in range(acc.num_layers):
        mass = acc.mass[(0, layer)].float()
        assert mass[..., 4].abs().max() == 0, f"layer {layer}: padded keys hold mass"
        # rows still sum to one over the real keys
        torch.testing.assert_close(mass.sum((-1, -2)), torch.full(mass.shape[:2], 69.0), rtol=2e-3, atol=0)


def test_pipeline_dense_plan_equals_default_and_calibration_runs(tmp_path):
    from paroattn.calibrate.config import CaptureConfig, SelectionConfig
    from paroattn.calibrate.driver import calibrate, save_calibration

    pipe = tiny_pipeline("hunyuan_video")
    pipe.set_progress_bar_config(disable=True)
    kwargs = {**tiny_call_kwargs("hunyuan_video"), "num_inference_steps": 3, "output_type": "latent"}

    def generate():
        with torch.no_grad():
            return pipe("a cat runs on the beach", generator=torch.Generator().manual_seed(0), **kwargs).frames

    reference = generate()
    with apply(pipe, make_plan(pipe.transformer, PIPELINE_LAYOUT, orders="random"), backend="torch"):
        torch.testing.assert_close(generate(), reference, rtol=1e-5, atol=1e-5)
    extra = {key: kwargs[key] for key in ("max_sequence_length", "guidance_scale", "prompt_template")}
    config = CaptureConfig(block_size=TINY_BLOCK, steps=3, height=64, width=64, frames=9, num_buckets=2,
                           stat_every=1, pipeline_kwargs=extra)
    plan, result = calibrate(pipe, ["a red fox in the snow"], config, SelectionConfig(density=0.5))
    assert plan.layout == PIPELINE_LAYOUT and plan.expert == "transformer"
    # the text blocks (tokens 48..68: key and query blocks 3 and 4) stay on in every mask
    assert plan.block_mask[..., 3:, :].all() and plan.block_mask[..., :, 3:].all()
    path, _ = save_calibration(plan, result, tmp_path / "plan.safetensors")
    with apply(pipe, load_plans(path), backend="torch"):
        out = generate()
    assert torch.isfinite(out).all() and (out - reference).abs().max() > 1e-4


@pytest.mark.slow
def test_cli_calibrate_and_generate_compare_on_a_saved_pipeline(tmp_path):
    pipe = tiny_pipeline("hunyuan_video")
    pipe.save_pretrained(tmp_path / "model")
    runner = CliRunner()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in the snow\n")
    size = ["--height", 64, "--width", 64, "--frames", 9]
    result = runner.invoke(app, [str(a) for a in [
        "calibrate", tmp_path / "model", "--out", tmp_path / "plan.safetensors", "--prompts", prompts,
        "--num-prompts", 1, "--steps", 3, "--stat-every", 1, "--buckets", 2, "--density", 0.5,
        "--block-size", TINY_BLOCK, "--device", "cpu", *size]])
    assert result.exit_code == 0, result.output
    assert Plan.load(tmp_path / "plan.safetensors").layout == TokenLayout(0, 3, 4, 4, suffix=256)
    result = runner.invoke(app, [str(a) for a in [
        "generate", tmp_path / "model", "--prompt", "a cat", "--plan", tmp_path / "plan.safetensors", "--compare",
        "--steps", 3, "--device", "cpu", "--backend", "torch", "--out", tmp_path / "out.gif", *size]])
    assert result.exit_code == 0, result.output
    assert "PARO vs dense: PSNR" in result.output
    assert (tmp_path / "out.gif").stat().st_size > 0 and (tmp_path / "out_dense.gif").stat().st_size > 0
