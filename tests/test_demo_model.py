"""The demo model of `paro demo`: its data, its pipeline, PARO on it, and resumable training."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paroattn.demo_model.data import color_centroids, make_batch, parse_caption, render, sample_spec
from paroattn.layout import TokenLayout
from paroattn.plan import Plan, model_fingerprint

ROOT = Path(__file__).resolve().parent.parent


def test_batches_are_a_function_of_seed_and_index():
    a, captions_a = make_batch(3, 5, 4, frames=4, height=16, width=16)
    b, captions_b = make_batch(3, 5, 4, frames=4, height=16, width=16)
    c, _ = make_batch(3, 6, 4, frames=4, height=16, width=16)
    assert a.shape == (4, 3, 4, 16, 16)
    assert torch.equal(a, b) and captions_a == captions_b
    assert not torch.equal(a, c)
    assert float(a.min()) >= -1.0 and float(a.max()) <= 1.0


def test_captions_round_trip_through_the_parser():
    spec = sample_spec(64, torch.Generator().manual_seed(0))
    for caption in spec.captions():
        assert parse_caption(caption).captions() == [caption]
    with pytest.raises(ValueError, match="expected"):
        parse_caption("red circle moving sideways slowly, cloudy background")


@pytest.mark.parametrize("caption,sign", [
    ("red circle moving right quickly, cloudy background", 1),
    ("red circle moving left quickly, dotted background", -1),
    ("red square rotating slowly, pan right, plain background", -1),  # the camera pans right: the scene moves left
])
def test_rendered_motion_follows_the_caption(caption, sign):
    video = render(parse_caption(caption), torch.Generator().manual_seed(1))[0]
    x = color_centroids(video, "red")[:, 0]
    steps = x[1:] - x[:-1]
    assert bool((sign * steps > 0.3).all()), f"{caption}: centroid x per frame {x.tolist()}"


def test_color_centroids_say_when_a_color_is_absent():
    video = render(parse_caption("red circle moving right quickly, dotted background"), torch.Generator().manual_seed(2))[0]
    red, blue = color_centroids(video, "red"), color_centroids(video, "blue")
    assert red.shape == (8, 2) and not bool(red.isnan().any())
    assert bool(blue.isnan().all())  # no blue pixels: NaN, not a centroid at the origin


def test_tokenizer_names_unknown_words():
    from paroattn.demo_model.model import WordTextEncoder

    encoder = WordTextEncoder()
    ids = encoder.tokenize(["red circle moving left quickly, pan up, dotted background", ""])
    assert ids.shape == (2, 16) and int(ids[1].abs().sum()) == 0 and int((ids[0] > 0).sum()) == 9
    with pytest.raises(ValueError, match="does not know.*'purple'"):
        encoder.tokenize(["purple circle moving left quickly, dotted background"])


@pytest.fixture(scope="module")
def demo_pipe():
    from paroattn.demo_model.model import load_demo_pipeline

    return load_demo_pipeline()


def _small_run(pipe, **kwargs):
    return pipe("blue ring moving down slowly, zoom out, cloudy background", num_inference_steps=2, num_frames=2,
                height=16, width=16, generator=torch.Generator().manual_seed(0), **kwargs).frames


@pytest.mark.slow
def test_paro_runs_through_the_wan_processors_of_the_demo_model(demo_pipe):
    """A dense plan reproduces the model's own attention; a sparse one changes the video: the
    shipped model goes through paroattn.apply exactly like Wan 2.1."""
    from paroattn.pipelines import apply

    pipe = demo_pipe
    transformer = pipe.transformer
    layout = TokenLayout(0, 2, 8, 8)
    common = {"layout": layout, "num_layers": len(transformer.blocks),
              "num_heads": transformer.config.num_attention_heads, "block_size": 16,
              "model_class": type(transformer).__name__,
              "model_fingerprint": model_fingerprint(transformer.config), "orders": "random"}
    dense = _small_run(pipe)
    assert dense.shape == (1, 2, 16, 16, 3)
    with apply(pipe, Plan.synthetic(density=1.0, **common), backend="torch"):
        full = _small_run(pipe)
    with apply(pipe, Plan.synthetic(density=0.25, **common), backend="torch"):
        sparse = _small_run(pipe)
    assert torch.allclose(full, dense, atol=2e-4), float((full - dense).abs().max())
    assert float((sparse - dense).abs().max()) > 1e-2
    assert torch.equal(_small_run(pipe), dense)  # the handle put the model's own processors back


def test_shipped_plans_fit_the_shipped_model(demo_pipe):
    from paroattn.app.demo import SHIPPED_DENSITIES, shipped_plan_path, study_selection

    transformer = demo_pipe.transformer
    for density in SHIPPED_DENSITIES:
        plan = Plan.load(shipped_plan_path(density))
        assert plan.model_fingerprint == model_fingerprint(transformer.config)
        assert plan.layout == TokenLayout(0, 8, 16, 16)
        assert abs(plan.achieved_density() - density) < 0.01
        assert shipped_plan_path(density).with_name(plan.info["stats_file"]["name"]).is_file()
        # made with the demo's calibration (scripts/demo_model_quality.py --ship)
        calibration = plan.info["calibration"]
        study = study_selection(density)
        assert (calibration["shared_budget"], calibration["dense_steps"]) == (study.shared_budget, study.dense_steps)


def test_a_plan_for_another_size_names_pixel_sizes_of_a_pixel_space_model(demo_pipe):
    """The demo model has no VAE: the mismatch message and the recalibration command give its
    sizes in pixels and frames as the pipeline takes them (not through a video VAE's 8x / 4x). The shipped plans
    derive masks for any size; one without axis profiles (format version 1) serves its own size only."""
    import dataclasses

    from paroattn import PlanError
    from paroattn.app.demo import SHIPPED_DENSITIES, shipped_plan_path
    from paroattn.pipelines import apply, layout_for

    assert layout_for(demo_pipe, height=32, width=32, frames=8) == TokenLayout(0, 8, 16, 16)
    shipped = Plan.load(shipped_plan_path(SHIPPED_DENSITIES[0]))  # 8 frames of 32x32
    plan = dataclasses.replace(shipped, profiles=None, format_version=1)
    with apply(demo_pipe, plan, backend="torch"):
        with pytest.raises(PlanError) as error:
            _small_run(demo_pipe)  # 2 frames of 16x16
    message = str(error.value)
    assert "8 frames of 32x32" in message and "2 frames of 16x16" in message, message
    assert "--height 16 --width 16 --frames 2" in message, message


def _script(name: str):
    """scripts/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _training_script():
    return _script("train_demo_model")


def _train(out: Path, ckpt: Path, *extra: str) -> None:
    argv = ["--smoke", "--device", "cpu", "--out", str(out), "--ckpt-dir", str(ckpt), "--batch", "2",
            "--total-steps", "4", "--warmup", "2", *extra]
    assert _training_script().main(argv) == 0


@pytest.mark.slow
def test_training_resumed_in_chunks_equals_one_run(tmp_path):
    _train(tmp_path / "whole", tmp_path / "whole_ckpt")
    _train(tmp_path / "chunks", tmp_path / "chunks_ckpt", "--max-steps-this-chunk", "2")
    first = load_file(str(tmp_path / "chunks" / "transformer" / "diffusion_pytorch_model.safetensors"))
    _train(tmp_path / "chunks", tmp_path / "chunks_ckpt")
    whole = load_file(str(tmp_path / "whole" / "transformer" / "diffusion_pytorch_model.safetensors"))
    chunks = load_file(str(tmp_path / "chunks" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert whole.keys() == chunks.keys()
    assert all(torch.equal(whole[k], chunks[k]) for k in whole)
    assert any(not torch.equal(first[k], whole[k]) for k in whole)  # the second chunk did train


def test_training_refuses_chunks_over_ten_minutes(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _train(tmp_path / "o", tmp_path / "c", "--chunk-seconds", "900")
    assert "--chunk-seconds must be in (0, 600]" in capsys.readouterr().err


def test_local_init_makes_each_head_local_along_its_own_axes():
    """After `local_attention_init` each head of a fresh model gives a key at distance 0 along an axis of
    its pattern several times the attention of a far key, and about the same along the other axes:
    a wrong head offset, axis section or rotary pair breaks it."""
    from diffusers import WanTransformer3DModel

    from paroattn.pipelines import capture_attention

    train = _training_script()
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**train.SMOKE_TRANSFORMER).eval()
    video = dict(train.SMOKE_VIDEO)  # 4 frames of 16x16 pixels: a 4 x 8 x 8 token grid
    patterns = train.local_attention_init(transformer, video, seed=1)
    assert len(patterns) == transformer.config.num_layers
    assert len({p for layer in patterns for p in layer}) > 1  # the test sees more than one kind of head
    maps = {}

    def on_capture(layer, q, k, layout, timestep, suffix_mask):
        maps[layer] = ((q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5).softmax(-1)[0]

    x = torch.randn(1, 3, video["num_frames"], video["height"], video["width"])
    with torch.no_grad(), capture_attention(transformer, on_capture):
        transformer(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=torch.randn(1, 16, 64))
    grid = (video["num_frames"], video["height"] // 2, video["width"] // 2)
    coords = torch.stack(torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij"), -1).reshape(-1, 3)
    for layer, heads in enumerate(patterns):
        for head, pattern in enumerate(heads):
            attention = maps[layer][head]  # [N, N]
            for a, axis in enumerate("fhw"):
                distance = (coords[:, None, a] - coords[None, :, a]).abs()
                near, far = distance == 0, distance >= grid[a] // 2
                ratio = float((attention * near).sum() / near.sum() / ((attention * far).sum() / far.sum()))
                where = f"layer {layer} head {head} ({''.join(pattern)}) axis {axis}: near/far {ratio:.2f}"
                assert (ratio > 3.0) if axis in pattern else (ratio < 1.5), where


def test_quality_study_scales_the_named_tensors_per_token():
    """--qk-scales token-q: the reference's Q gets one scale per token, its K keeps one per block (they alternate,
    Q first); the values come back dequantized with block scales of 1, so the reference computes q k^T from them."""
    from paroattn.kernels import reference

    module = _script("demo_model_quality")
    quantize = module.finer_qk_scales(module.QK_SCALES["token-q"])
    x = torch.randn(2, 200, 64, generator=torch.Generator().manual_seed(0))
    x[:, ::7] *= 0.01  # quiet tokens: a block scale leaves them few levels, their own scale all 255
    q_values, q_scale = quantize(x, 128, 127.0)
    assert q_scale.shape == (2, 2) and bool((q_scale == 1).all())
    row_error = (q_values - x).abs().amax(dim=2)
    assert bool((row_error <= x.abs().amax(dim=2) / 254 * 1.001).all())
    block_values, block_scale = reference.quantize_per_block(x, 128, 127.0)
    assert float((q_values - x).norm()) < 0.9 * float((block_values * block_scale.repeat_interleave(128, 1)[:, :200, None]
                                                          - x).norm())
    k_values, k_scale = quantize(x, 64, 127.0)  # the second call: K, per block as the kernels quantize it
    expected = reference.quantize_per_block(x, 64, 127.0)
    assert torch.equal(k_values, expected[0]) and torch.equal(k_scale, expected[1])


def test_quality_study_scales_k_per_thread_group():
    """--qk-scales token-q-thread-k: K's keys 8a + 2t + e of each 64-key block share one scale per t (what one thread
    of the sm_90a kernel holds), a key block whose group 1 is loud and the rest quiet keeps the quiet keys fine."""
    module = _script("demo_model_quality")
    quantize = module.finer_qk_scales(module.QK_SCALES["token-q-thread-k"])
    q = torch.randn(1, 100, 64, generator=torch.Generator().manual_seed(1))
    quantize(q, 128, 127.0)  # the first call is Q's
    k = torch.randn(1, 100, 64, generator=torch.Generator().manual_seed(2)) * 0.01
    loud = torch.tensor([8 * a + 2 * 1 + e for a in range(8) for e in range(2)])
    k[:, loud] *= 100.0
    k_values, k_scale = quantize(k, 64, 127.0)
    assert bool((k_scale == 1).all())
    quiet = torch.ones(100, dtype=torch.bool)
    quiet[loud] = False
    group_bound = k[:, :64][:, quiet[:64]].abs().max() / 254 * 1.001  # a quiet group's own step
    assert float((k_values - k)[:, :64][:, quiet[:64]].abs().max()) <= float(group_bound)
    assert float((k_values - k)[:, loud].abs().max()) <= float(k[:, loud].abs().max()) / 254 * 1.001


@pytest.mark.parametrize("variant", ["channel-k", "channel-qk"])
def test_quality_study_moves_k_channel_ranges_into_q_and_keeps_the_product(variant):
    """--qk-scales channel-k / channel-qk: K's smoothed channel maxima are kept when its mean is taken, Q is quantized
    as Q * c and K as K / c per block; q k^T of the two dequantized factors stays the product within the quantization
    error; with half of a loud K channel's range moved (channel-qk) neither factor's block scale is set by it."""
    module = _script("demo_model_quality")
    key_mean, quantize = module.migrated_qk_scales(module.QK_SCALES[variant]["migrate"])
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 256, 64, generator=g), torch.randn(1, 256, 64, generator=g)
    k[..., 5] *= 50.0  # one loud channel
    smoothed = k - key_mean(k, 1)
    q_values, q_scale = quantize(q, 128, 127.0)
    k_values, k_scale = quantize(smoothed, 64, 127.0)
    assert bool((q_scale == 1).all()) and bool((k_scale == 1).all())
    exact = q @ smoothed.transpose(1, 2)
    migrated = q_values @ k_values.transpose(1, 2)
    from paroattn.kernels import reference

    qb, qs = reference.quantize_per_block(q, 128, 127.0)
    kb, ks = reference.quantize_per_block(smoothed, 64, 127.0)
    q_block, k_block = qb * qs.repeat_interleave(128, 1)[..., None], kb * ks.repeat_interleave(64, 1)[..., None]
    per_block = q_block @ k_block.transpose(1, 2)
    if variant == "channel-qk":  # half the range moved: both factors keep their quiet channels' levels
        assert float((migrated - exact).norm()) < 0.5 * float((per_block - exact).norm())
    key_mean, quantize = module.migrated_qk_scales(module.QK_SCALES[variant]["migrate"])
    smoothed = k - key_mean(k, 1)
    fine = quantize(q, 128, 2.0**22)[0] @ quantize(smoothed, 64, 2.0**22)[0].transpose(1, 2)
    torch.testing.assert_close(fine, exact, rtol=1e-4, atol=1e-3)  # the migration itself keeps q k^T


def test_quality_study_runs_k_scales_and_refuses_them_beside_qk_scales(tmp_path):
    """--k-scale: the granularities each integer-QK row runs (as the kernels do); --qk-scales replaces the
    reference's per-block quantization, which per-key K scales do not take, so the two are refused together."""
    module = _script("demo_model_quality")
    assert module.parse_args(["--out", str(tmp_path), "--k-scale", "block,token"]).k_scale == ["block", "token"]
    assert module.parse_args(["--out", str(tmp_path)]).k_scale == ["block"]
    for bad in (["--k-scale", "channel"], ["--k-scale", ","], ["--k-scale", "token", "--qk-scales", "token-qk"]):
        with pytest.raises(SystemExit):
            module.parse_args(["--out", str(tmp_path), *bad])


def test_quality_study_grids_take_sol_attn_in_bf16_and_shipped_plans_alone():
    """The variants 'sol-attn' and 'sol-attn no tail' are Sol-Attn's full-precision reference, no plan: rows of bf16
    grids beside PARO's, refused in a quantized grid. They and 'shipped' (a plan loaded, not calibrated) take no
    calibration variant beside them ('+')."""
    module = _script("demo_model_quality")
    rows = module.parse_grid("0.5,0.2:bf16:shipped,sol-attn,sol-attn no tail")
    assert rows == [(0.5, "bf16", "shipped"), (0.5, "bf16", "sol-attn"), (0.5, "bf16", "sol-attn no tail"),
                    (0.2, "bf16", "shipped"), (0.2, "bf16", "sol-attn"), (0.2, "bf16", "sol-attn no tail")]
    assert module.variant_arguments("sol-attn") == {} and module.variant_arguments("shipped") == {"shipped": True}
    assert module.parse_grid("0.2:int8fp8:shipped") == [(0.2, "int8fp8", "shipped")]
    for bad in ("0.5:int8fp8:sol-attn", "0.5:bf16:sol-attn+dense last", "0.5:bf16:shipped+dense last"):
        with pytest.raises(SystemExit):
            module.parse_grid(bad)
