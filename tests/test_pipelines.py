"""diffusers integration on tiny models of every family: PARO equals the model's own attention where
the plan keeps everything, differs (finitely) where it is sparse, comes off bit-exact, and refuses
plans that do not fit."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from tiny_models import TINY_BLOCK, lone_processor, tiny_forward_inputs, tiny_transformer

from paroattn import Plan, PlanError, TokenLayout
from paroattn.pipelines import (
    CallInputs,
    PAROProcessor,
    apply,
    capture_attention,
    family_of,
    layout_for,
    self_attention_layers,
)
from paroattn.plan import model_fingerprint

FAMILIES = ["cogvideox", "cogvideox1.5", "wan", "wan-i2v", "flux"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    """(family name, transformer, forward kwargs, reference output of the default processors)."""
    transformer = tiny_transformer(request.param)
    inputs = tiny_forward_inputs(transformer, timestep=700.0)
    with torch.no_grad():
        reference = transformer(**inputs)[0]
    return request.param, transformer, inputs, reference


def call_layout(transformer, inputs) -> TokenLayout:
    return family_of(transformer).call_inputs(transformer, inputs).layout


def make_plan(transformer, inputs, *, density=1.0, orders="FHW", num_buckets=3, block_size=TINY_BLOCK,
              **overrides) -> Plan:
    plan = Plan.synthetic(
        layout=call_layout(transformer, inputs),
        num_layers=len(self_attention_layers(transformer)),
        num_heads=transformer.config.num_attention_heads,
        density=density,
        orders=orders,
        num_buckets=num_buckets,
        block_size=block_size,
        model_class=type(transformer).__name__,
        model_fingerprint=model_fingerprint(transformer.config),
        **overrides,
    )
    return plan


def run(transformer, inputs):
    with torch.no_grad():
        return transformer(**inputs)[0]


# -- layers and capture -----------------------------------------------------------------------


def test_self_attention_layers_in_plan_order():
    assert self_attention_layers(tiny_transformer("cogvideox")) == [
        "transformer_blocks.0.attn1.processor", "transformer_blocks.1.attn1.processor"]
    assert self_attention_layers(tiny_transformer("wan-i2v")) == ["blocks.0.attn1.processor", "blocks.1.attn1.processor"]
    assert self_attention_layers(tiny_transformer("flux")) == [
        "transformer_blocks.0.attn.processor",
        "single_transformer_blocks.0.attn.processor",
        "single_transformer_blocks.1.attn.processor",
    ]


def test_capture_is_exact_and_reports_every_call(model):
    name, transformer, inputs, reference = model
    seen = []

    def callback(layer, q, k, layout, timestep, suffix_mask):
        seen.append((layer, q.shape, k.shape, layout, timestep))

    before = dict(transformer.attn_processors)
    with capture_attention(transformer, callback) as keys:
        out = run(transformer, inputs)
    assert torch.equal(out, reference)
    assert [s[0] for s in seen] == list(range(len(keys)))
    layout = call_layout(transformer, inputs)
    B, H = inputs["hidden_states"].shape[0], transformer.config.num_attention_heads
    for _, q_shape, k_shape, seen_layout, timestep in seen:
        assert seen_layout == layout
        assert q_shape == k_shape == (B, H, layout.seq_len, transformer.config.attention_head_dim)
        assert timestep == pytest.approx(700.0)
    after = transformer.attn_processors
    assert all(after[key] is before[key] for key in before)


# -- equivalence --------------------------------------------------------------------------------


@pytest.mark.parametrize("orders", ["FHW", "random"])
def test_all_true_mask_equals_default(model, orders):
    name, transformer, inputs, reference = model
    handle = apply(transformer, make_plan(transformer, inputs, orders=orders), backend="torch")
    try:
        out = run(transformer, inputs)
    finally:
        handle.remove()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_fused_rope_equals_the_models_own_rope(model):
    """The processor hands the model's RoPE to the op (fuse_rope=True, the default) instead of applying it
    with the model's code first: same outputs on a sparse plan, where the rotation matters."""
    name, transformer, inputs, reference = model
    plan = make_plan(transformer, inputs, density=0.5, orders="random")
    outs = []
    for fuse_rope in (True, False):
        with apply(transformer, plan, backend="torch", fuse_rope=fuse_rope):
            outs.append(run(transformer, inputs))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert (outs[0] - reference).abs().max() > 1e-3


def test_rotary_tables_are_converted_once_per_embedding():
    """The op's tables are built on the first layer of a forward and reused by the others; a new
    embedding (next forward, other size) is converted again."""
    from paroattn.pipelines.base import RotaryTables

    calls = []
    tables = RotaryTables(lambda cos, sin: calls.append(1) or (cos.float(), sin.float()))
    first = (torch.ones(4, 8), torch.zeros(4, 8))
    assert tables(first) is tables(first) and len(calls) == 1
    second = (first[0].clone(), first[1])  # equal values, another tensor: converted again
    tables(second)
    assert len(calls) == 2


def test_sparse_plan_differs_finitely_and_remove_is_bit_exact(model):
    name, transformer, inputs, reference = model
    plan = make_plan(transformer, inputs, density=0.4, orders="random")
    assert plan.achieved_density() < 0.9
    handle = apply(transformer, plan, backend="torch")
    out = run(transformer, inputs)
    handle.remove()
    assert torch.isfinite(out).all()
    assert (out - reference).abs().max() > 1e-3
    assert torch.equal(run(transformer, inputs), reference)


def test_lone_processor_finds_its_layers_and_matches_apply(model):
    """`transformer.set_attn_processor(PAROProcessor(plan))` as written: one instance on every
    attention module (Wan's cross-attention included), layers found from the modules it is called for."""
    name, transformer, inputs, reference = model
    plan = make_plan(transformer, inputs, density=0.4, orders="random")
    with apply(transformer, plan, backend="torch"):
        expected = run(transformer, inputs)
    with lone_processor(transformer, PAROProcessor(plan, backend="torch")):
        first = run(transformer, inputs)  # binds inside this forward, reading the transformer's frame
        second = run(transformer, inputs)  # through the forward pre-hook
    assert torch.equal(first, expected)
    assert torch.equal(second, expected)
    assert torch.equal(run(transformer, inputs), reference)


def test_timestep_picks_the_bucket(model):
    """Bucket 0 (t in (750, 1000]) keeps every block, the others are sparse: the output equals the
    default at t=900 and differs at t=300, on each family's own timestep scale (Flux gets t/1000)."""
    name, transformer, inputs, reference = model
    plan = make_plan(transformer, inputs, density=0.4, orders="random", num_buckets=3)
    mask = plan.block_mask.clone()
    mask[0] = True
    plan = Plan(**{**plan.__dict__, "block_mask": mask, "density": None})
    assert plan.bucket_edges == [1000.0, 750.0, 500.0, 0.0]
    late = tiny_forward_inputs(transformer, timestep=900.0)
    early = tiny_forward_inputs(transformer, timestep=300.0)
    with apply(transformer, plan, backend="torch"):
        out_late, out_early = run(transformer, late), run(transformer, early)
    torch.testing.assert_close(out_late, run(transformer, late), rtol=1e-5, atol=1e-5)
    assert (out_early - run(transformer, early)).abs().max() > 1e-3


def test_layers_marked_dense_run_the_models_attention(model):
    name, transformer, inputs, reference = model
    plan = make_plan(transformer, inputs, density=0.4, orders="random")
    plan.dense[:] = True
    with apply(transformer, plan, backend="torch"):
        assert torch.equal(run(transformer, inputs), reference)


# -- mismatches -------------------------------------------------------------------------------


def check_plan_error(excinfo, *fragments):
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert "paro calibrate" in message


def test_plan_for_another_model_class():
    wan = tiny_transformer("wan")
    flux = tiny_transformer("flux")
    plan = make_plan(flux, tiny_forward_inputs(flux))
    with pytest.raises(PlanError) as excinfo:
        apply(wan, plan)
    check_plan_error(excinfo, "FluxTransformer2DModel", "WanTransformer3DModel", "3 self-attention layers", "has 2")
    assert all(type(p).__name__ == "WanAttnProcessor" for p in wan.attn_processors.values())


def test_plan_for_another_config_head_count_or_layer_count(model):
    name, transformer, inputs, reference = model
    plan = make_plan(transformer, inputs)
    with pytest.raises(PlanError) as excinfo:
        apply(transformer, Plan(**{**plan.__dict__, "model_fingerprint": "0123456789abcdef"}))
    check_plan_error(excinfo, "0123456789abcdef", model_fingerprint(transformer.config))

    three_heads = Plan.synthetic(layout=plan.layout, num_layers=plan.num_layers, num_heads=3, block_size=TINY_BLOCK)
    with pytest.raises(PlanError) as excinfo:
        apply(transformer, three_heads)
    check_plan_error(excinfo, "plan has 3 heads", "this model has 2")

    missing = Plan.synthetic(layout=plan.layout, num_layers=plan.num_layers - 1, num_heads=2, block_size=TINY_BLOCK)
    with pytest.raises(PlanError) as excinfo:
        apply(transformer, missing)
    check_plan_error(excinfo, f"plan has {plan.num_layers - 1} self-attention layers", "a layer is missing")
    assert torch.equal(run(transformer, inputs), reference)  # nothing was left installed


@pytest.mark.parametrize("change", ["resolution", "frames"])
def test_call_at_another_size(model, change):
    name, transformer, inputs, reference = model
    if change == "frames" and name == "flux":
        pytest.skip("images have no frames")
    plan = make_plan(transformer, inputs, density=0.4)
    if change == "resolution":
        other = tiny_forward_inputs(transformer, height=12 if name != "flux" else 16, width=8 if name != "flux" else 12)
    else:
        other = tiny_forward_inputs(transformer, frames=2 if name == "cogvideox1.5" else 2 if name != "cogvideox" else 5)
    actual = call_layout(transformer, other)
    assert actual != plan.layout
    with apply(transformer, plan, backend="torch"):
        with pytest.raises(PlanError) as excinfo:
            run(transformer, other)
    check_plan_error(excinfo, str(plan.layout), str(actual), "calibrated for")
    family = family_of(transformer)
    size = family.pixel_size(transformer, actual)
    assert f"--height {size['height']} --width {size['width']}" in str(excinfo.value)

    with apply(transformer, plan, backend="torch", on_mismatch="dense"):
        with pytest.warns(UserWarning, match="running the model's own attention"):
            out = run(transformer, other)
    assert torch.equal(out, run(transformer, other))


@pytest.mark.parametrize("change", ["resolution", "frames"])
def test_a_plan_with_axis_profiles_runs_at_another_size(model, change, monkeypatch):
    """A plan that holds axis profiles derives its masks for another size, once: a full-density one equals the
    model's own attention there, a sparse one runs its own masks."""
    import paroattn.plan.shapes as shapes

    name, transformer, inputs, reference = model
    if change == "frames" and name == "flux":
        pytest.skip("images have no frames")
    if change == "resolution":
        other = tiny_forward_inputs(transformer, height=12 if name != "flux" else 16, width=8 if name != "flux" else 12)
    else:
        other = tiny_forward_inputs(transformer, frames=2 if name == "cogvideox1.5" else 2 if name != "cogvideox" else 5)
    actual = call_layout(transformer, other)
    derived = []
    original = shapes.derive_plan
    monkeypatch.setattr(shapes, "derive_plan", lambda plan, layout, *a: derived.append(layout) or original(plan, layout, *a))
    dense_other = run(transformer, other)
    with apply(transformer, make_plan(transformer, inputs, density=1.0, profiles=True), backend="torch"):
        torch.testing.assert_close(run(transformer, other), dense_other, rtol=1e-5, atol=1e-5)
    assert derived == [actual]
    with apply(transformer, make_plan(transformer, inputs, density=0.4, profiles=True), backend="torch") as handle:
        with pytest.warns(UserWarning, match=f"not calibrated for a {re.escape(str(actual))} token grid.*derived "
                                             f"from the {re.escape(str(call_layout(transformer, inputs)))} grid"):
            sparse = run(transformer, other)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            again = run(transformer, other)
        assert not [w for w in seen if "derived from" in str(w.message)]  # said once per size
        assert list(handle.processor.shapes.derived) == [actual]
        full = bool(handle.processor.shapes.derived[actual].block_mask.all())  # text and diagonal may be all
    assert derived == [actual, actual]  # once per plan and size: the second forward used the cached masks
    assert torch.isfinite(sparse).all() and torch.equal(sparse, again)
    assert torch.allclose(sparse, dense_other, rtol=1e-5, atol=1e-5) == full


def test_on_mismatch_dense_leaves_the_model_alone(model):
    name, transformer, inputs, reference = model
    plan = Plan.synthetic(layout=call_layout(transformer, inputs), num_layers=7, num_heads=2, block_size=TINY_BLOCK)
    with pytest.warns(UserWarning, match="plan does not fit this model"):
        handle = apply(transformer, plan, on_mismatch="dense")
    assert not handle.active
    assert torch.equal(run(transformer, inputs), reference)
    handle.remove()


def test_layout_for_matches_the_calls_of_the_tiny_models():
    cog = tiny_transformer("cogvideox")
    # 9 frames of 64x64: 3 latent frames of 8x8, patches of 2x2
    assert layout_for(cog, height=64, width=64, frames=9) == call_layout(cog, tiny_forward_inputs(cog))
    cog15 = tiny_transformer("cogvideox1.5")
    # 13 frames -> 4 latent frames -> 2 temporal patches; 9 frames -> 3 latent, padded to 4
    assert layout_for(cog15, height=64, width=64, frames=13) == call_layout(cog15, tiny_forward_inputs(cog15))
    assert layout_for(cog15, height=64, width=64, frames=9).frames == 2
    wan = tiny_transformer("wan")
    assert layout_for(wan, height=64, width=64, frames=9) == call_layout(wan, tiny_forward_inputs(wan))
    flux = tiny_transformer("flux")
    assert layout_for(flux, height=96, width=96, text_tokens=8) == call_layout(flux, tiny_forward_inputs(flux))
    assert layout_for(flux, height=1024, width=1024) == TokenLayout(512, 1, 64, 64)


# -- whole pipelines --------------------------------------------------------------------------


def pipeline_output(pipe, kwargs):
    out = pipe("a cat runs on the beach", generator=torch.Generator().manual_seed(0), **kwargs)
    return out.frames if hasattr(out, "frames") else out.images


@pytest.mark.parametrize("family", ["cogvideox", "wan", "flux"])
def test_tiny_pipeline_runs_two_steps_with_paro(family):
    from tiny_models import tiny_call_kwargs, tiny_pipeline

    pipe = tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {**tiny_call_kwargs(family), "output_type": "latent"}  # the VAE is not what is tested here
    layout = layout_for(pipe, height=kwargs["height"], width=kwargs["width"], frames=kwargs.get("num_frames"),
                        text_tokens=None if family == "wan" else kwargs["max_sequence_length"])
    transformer = pipe.transformer
    plan = Plan.synthetic(
        layout=layout, num_layers=len(self_attention_layers(pipe)), num_heads=transformer.config.num_attention_heads,
        density=0.4, orders="random", num_buckets=2, block_size=TINY_BLOCK,
        model_class=type(transformer).__name__, model_fingerprint=model_fingerprint(transformer.config),
    )
    with torch.no_grad():
        dense = pipeline_output(pipe, kwargs)
        handle = apply(pipe, plan)
        calls = []
        original_call = handle.processor.attend

        def counting_attend(binding, attn, layer, call, mask):
            calls.append((layer, binding.forward.bucket))
            return original_call(binding, attn, layer, call, mask)

        handle.processor.attend = counting_attend
        sparse = pipeline_output(pipe, kwargs)
        handle.remove()
    assert torch.isfinite(sparse).all()
    assert sparse.shape == dense.shape
    assert (sparse - dense).abs().max() > 1e-4
    # 2 steps (x2 for Wan's separate CFG calls), every self-attention layer, first steps in bucket 0
    per_forward = plan.num_layers
    assert len(calls) == per_forward * (4 if family == "wan" else 2)
    assert calls[0] == (0, 0) and calls[-1][1] == 1


def test_wan_pipeline_capture_sees_each_step_twice():
    from tiny_models import tiny_call_kwargs, tiny_pipeline

    pipe = tiny_pipeline("wan")
    pipe.set_progress_bar_config(disable=True)
    timesteps = []
    with torch.no_grad(), capture_attention(pipe, lambda layer, q, k, layout, t, suffix_mask: layer == 0 and timesteps.append(t)):
        pipeline_output(pipe, {**tiny_call_kwargs("wan"), "output_type": "latent"})
    assert len(timesteps) == 4 and timesteps[0] == timesteps[1] and timesteps[2] == timesteps[3]
    assert 0.0 <= timesteps[2] < timesteps[0] <= 1000.0


# -- the Triton path: active-block lists, prefetch ----------------------------------------------


@pytest.mark.parametrize("family", ["cogvideox"] + (["wan", "flux"] if torch.cuda.is_available() else []))
def test_triton_backend_through_the_processor_matches_torch(family):
    """Active-block lists built by the processor drive the Triton kernel, RoPE fused (interpreted on CPU,
    so one family only there: the lists do not depend on the family; CogVideoX rotates after a text prefix)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    transformer = tiny_transformer(family, dtype=torch.float16, head_dim=64).to(device)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in tiny_forward_inputs(transformer).items()}
    if family == "cogvideox":
        inputs["image_rotary_emb"] = tuple(t.to(device) for t in inputs["image_rotary_emb"])
    # compiled Triton needs blocks of >= 32 for its products; the interpreter runs the tiny blocks
    plan = make_plan(transformer, inputs, density=0.5, orders="random", block_size=TINY_BLOCK if device == "cpu" else 32)
    with apply(transformer, plan, backend="torch"):
        expected = run(transformer, inputs)
    with apply(transformer, plan, backend="triton") as handle:
        out = run(transformer, inputs)
        assert handle.stats()["mode"] == "lists"
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_streamed_masks_are_the_plans_and_gpu_memory_is_bounded():
    from paroattn.runner import MaskStore

    layout = TokenLayout(8, 4, 16, 16)
    plan = Plan.synthetic(layout=layout, num_layers=12, num_heads=4, density=0.3, orders="random", num_buckets=3)
    plan.dense[1, 5] = True
    store = MaskStore(plan, "cuda", lists=True, resident=False, slots=3)
    assert store.streaming
    largest = max(b.counts.numel() * 8 + b.indices.numel() * 4 for b in store.host.values())
    assert store.gpu_bytes <= 3 * largest
    for bucket in (0, 0, 1, 2, 1):  # forwards, bucket changes included
        store.begin(bucket)
        for layer in range(plan.num_layers):
            if plan.dense[bucket, layer]:
                continue
            blocks = store.get(bucket, layer)
            torch.cuda.current_stream().synchronize() if layer % 5 == 0 else None
            assert torch.equal(blocks.to_mask().cpu(), plan.block_mask[bucket, layer])
    assert store.hits >= 4 * 11 and store.misses <= 5


@pytest.mark.gpu
def test_streamed_and_resident_masks_give_the_same_outputs():
    transformer = tiny_transformer("cogvideox", dtype=torch.bfloat16, head_dim=64).cuda()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in tiny_forward_inputs(transformer).items()}
    inputs["image_rotary_emb"] = tuple(t.cuda() for t in inputs["image_rotary_emb"])
    plan = make_plan(transformer, inputs, density=0.5, orders="random", block_size=32)  # GPU kernels take >= 32
    outs = []
    for resident in (True, False):
        with apply(transformer, plan, resident=resident) as handle:
            outs.append(run(transformer, inputs))
            assert handle.stats()["resident"] is resident
    assert torch.equal(outs[0], outs[1])


# -- paro generate ----------------------------------------------------------------------------


def saved_tiny_pipeline(family, folder, density=0.5):
    from tiny_models import tiny_call_kwargs, tiny_pipeline

    pipe = tiny_pipeline(family)
    pipe.save_pretrained(folder / "model")
    kwargs = tiny_call_kwargs(family)
    layout = layout_for(pipe, height=kwargs["height"], width=kwargs["width"], frames=kwargs.get("num_frames"),
                        text_tokens=None if family == "wan" else kwargs["max_sequence_length"])
    transformer = pipe.transformer
    plan = Plan.synthetic(
        layout=layout, num_layers=len(self_attention_layers(pipe)), num_heads=2, density=density, orders="random",
        block_size=TINY_BLOCK, model_class=type(transformer).__name__, model_fingerprint=model_fingerprint(transformer.config),
    )
    plan.save(folder / "plan.safetensors")
    return kwargs


@pytest.mark.parametrize("family,suffix", [("wan", ".mp4"), ("flux", ".png")])
@pytest.mark.slow
def test_generate_command_compare(tmp_path, family, suffix):
    from typer.testing import CliRunner

    if suffix == ".mp4":
        pytest.importorskip("imageio_ffmpeg")  # a dependency; absent on the GPU machine, which has no registry

    from paroattn.app.cli import app

    kwargs = saved_tiny_pipeline(family, tmp_path)
    args = ["generate", str(tmp_path / "model"), "--prompt", "a cat runs", "--plan", str(tmp_path / "plan.safetensors"),
            "--height", str(kwargs["height"]), "--width", str(kwargs["width"]), "--steps", "2", "--compare",
            "--out", str(tmp_path / f"out{suffix}")]
    if "num_frames" in kwargs:
        args += ["--frames", str(kwargs["num_frames"])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (tmp_path / f"out{suffix}").stat().st_size > 0
    assert (tmp_path / f"out_dense{suffix}").stat().st_size > 0
    line = next(line for line in result.output.splitlines() if line.startswith("PARO vs dense"))
    psnr = float(line.split("PSNR ")[1].split(" dB")[0])
    assert 10.0 < psnr < 80.0  # sparse attention changes the output, but not into noise
    assert "SSIM" in line and "cosine" in line
    # a speedup on a GPU; on a CPU, the time ratio and that the torch reference ran
    assert ("speedup" in line) if torch.cuda.is_available() else ("dense / PARO" in line and "torch reference" in line)


def test_generate_command_reports_a_plan_that_does_not_fit(tmp_path):
    from typer.testing import CliRunner

    from paroattn.app.cli import app

    saved_tiny_pipeline("flux", tmp_path)
    result = CliRunner().invoke(app, ["generate", str(tmp_path / "model"), "--prompt", "a cat", "--plan",
                                      str(tmp_path / "plan.safetensors"), "--height", "128", "--width", "96",
                                      "--steps", "1", "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "8 + 1x6x6" in result.output and "8 + 1x8x6" in result.output
    assert f"paro calibrate {tmp_path / 'model'} --height 128 --width 96" in result.output


def test_a_per_token_timestep_is_bucketed_by_its_largest_entry_eager_and_traced():
    """Image-conditioned Wan 2.2 and diffusion forcing pass a timestep per token, 0 at the conditioning frames: the
    call is bucketed by the noisiest tokens', on the host and on the device alike."""
    plan = Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=1, num_heads=2, density=0.5, block_size=16,
                          num_buckets=3)
    per_token = torch.tensor([[0.0] * 16 + [900.0] * 16])
    inputs = CallInputs(timestep=per_token, layout=TokenLayout(0, 2, 4, 4))
    assert inputs.timestep_1000() == 900.0
    assert int(plan.bucket_tensor(per_token)) == plan.bucket_of(900.0) != plan.bucket_of(0.0)
