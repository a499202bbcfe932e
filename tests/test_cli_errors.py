"""Every `paro` command fails early and clearly: exit code 2, one line naming the input and the fix,
no traceback, and nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from paroattn import Plan, TokenLayout
from paroattn.app.cli import app

runner = CliRunner()


def invoke(args):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_failure(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and len(lines) <= 2, result.output
    for fragment in fragments:
        assert fragment in errors[0], result.output


def assert_failure_after_loading(result, *fragments):
    """`assert_clean_failure` for an error found once the pipeline has loaded: its loading bars may come first, the
    one `error: ...` line is last."""
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.output.rstrip().endswith(errors[0]), result.output
    for fragment in fragments:
        assert fragment in errors[0], result.output


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*"))


def saved_tiny_flux(folder: Path) -> dict:
    """A tiny FLUX pipeline saved to folder/model and a plan for its tiny size in folder/plan.safetensors."""
    from tiny_models import TINY_BLOCK, tiny_call_kwargs, tiny_pipeline

    from paroattn.pipelines import layout_for, self_attention_layers
    from paroattn.plan import model_fingerprint

    pipe = tiny_pipeline("flux")
    pipe.save_pretrained(folder / "model")
    kwargs = tiny_call_kwargs("flux")
    layout = layout_for(pipe, height=kwargs["height"], width=kwargs["width"], text_tokens=kwargs["max_sequence_length"])
    transformer = pipe.transformer
    plan = Plan.synthetic(
        layout=layout, num_layers=len(self_attention_layers(pipe)), num_heads=2, density=0.5, orders="random",
        block_size=TINY_BLOCK, model_class=type(transformer).__name__,
        model_fingerprint=model_fingerprint(transformer.config),
    )
    plan.save(folder / "plan.safetensors")
    return kwargs


# -- paro generate: options and output path before the model loads ----------------------------

def test_generate_rejects_a_bad_backend_before_loading(tmp_path):
    result = invoke(["generate", tmp_path / "no-model", "--prompt", "a cat", "--backend", "gpu"])
    assert_clean_failure(result, "--backend 'gpu'", "auto, triton, cuda, torch")
    assert "loading" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_generate_refuses_the_cuda_kernels_without_a_gpu(tmp_path):
    result = invoke(["generate", tmp_path / "no-model", "--prompt", "a cat", "--backend", "cuda"])
    assert_clean_failure(result, "--backend cuda", "H100/H200")
    assert "loading" not in result.output


def test_generate_rejects_a_bad_on_mismatch_before_loading(tmp_path):
    result = invoke(["generate", tmp_path / "no-model", "--prompt", "a cat", "--on-mismatch", "skip"])
    assert_clean_failure(result, "--on-mismatch 'skip'", "error, dense")
    assert "loading" not in result.output


def test_generate_rejects_an_unwritable_extension_before_loading(tmp_path):
    result = invoke(["generate", tmp_path / "no-model", "--prompt", "a cat", "--out", tmp_path / "x.xyz"])
    assert_clean_failure(result, "x.xyz", ".mp4", ".png", "not .xyz")
    assert files_under(tmp_path) == []


def test_generate_rejects_an_unwritable_folder_before_loading(tmp_path):
    result = invoke(["generate", tmp_path / "no-model", "--prompt", "a cat", "--out", "/proc/paro-test/x.png"])
    assert_clean_failure(result, "/proc/paro-test", "not writable")


def test_generate_rejects_a_folder_without_model_index(tmp_path):
    (tmp_path / "model").mkdir()
    result = invoke(["generate", tmp_path / "model", "--prompt", "a cat", "--out", tmp_path / "x.png"])
    assert_clean_failure(result, "model_index.json")
    assert files_under(tmp_path) == [tmp_path / "model"]


def test_generate_rejects_a_video_extension_for_an_image_model(tmp_path):
    saved_tiny_flux(tmp_path)
    before = files_under(tmp_path)
    result = invoke(["generate", tmp_path / "model", "--prompt", "a cat", "--steps", "1", "--height", "96",
                     "--width", "96", "--out", tmp_path / "x.mp4"])
    assert result.exit_code == 2 and "image model" in result.output and ".png" in result.output, result.output
    assert files_under(tmp_path) == before


# -- paro generate --compare: the plan is checked against the size before the dense pass -------

def test_generate_compare_checks_the_plan_before_the_dense_pass(tmp_path):
    saved_tiny_flux(tmp_path)
    before = files_under(tmp_path)
    result = invoke(["generate", tmp_path / "model", "--prompt", "a cat", "--plan", tmp_path / "plan.safetensors",
                     "--height", "128", "--width", "96", "--steps", "1", "--compare", "--out", tmp_path / "x.png"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "8 + 1x6x6" in result.output and "8 + 1x8x6" in result.output
    assert f"paro calibrate {tmp_path / 'model'} --height 128 --width 96" in result.output  # the folder given
    assert "dense run" not in result.output
    assert files_under(tmp_path) == before  # no x_dense.png


def test_generate_on_mismatch_dense_says_it_ran_dense(tmp_path):
    saved_tiny_flux(tmp_path)
    result = invoke(["generate", tmp_path / "model", "--prompt", "a cat", "--plan", tmp_path / "plan.safetensors",
                     "--height", "128", "--width", "96", "--steps", "1", "--on-mismatch", "dense",
                     "--out", tmp_path / "x.png"])
    assert result.exit_code == 0, result.output
    assert "PARO:" not in result.output
    assert "dense (the plan did not fit" in result.output
    assert (tmp_path / "x.png").stat().st_size > 0


def test_generate_writes_a_gif_for_a_video_model(tmp_path):
    import imageio.v2 as imageio
    import numpy as np

    from paroattn.app.generate import _write

    pixels = np.random.default_rng(0).random((3, 8, 8, 3), dtype=np.float32)
    path = _write(pixels, tmp_path / "v.gif", video=True, fps=8)
    reader = imageio.get_reader(path)
    assert len(list(reader)) == 3 and 110 <= reader.get_meta_data()["duration"] <= 130  # ms, in steps of 10


# -- paro demo: the output folder before the model loads ---------------------------------------

def test_demo_rejects_an_existing_file_as_out(tmp_path):
    target = tmp_path / "taken"
    target.write_text("x")
    result = invoke(["demo", "--out-dir", target])
    assert_clean_failure(result, str(target), "existing file", "folder")
    assert "demo model" not in result.output and target.read_text() == "x"


def test_demo_rejects_a_folder_it_cannot_create():
    result = invoke(["demo", "--out-dir", "/proc/paro-demo"])
    assert_clean_failure(result, "/proc/paro-demo", "not writable", "pass a folder you can write to")
    assert "demo model" not in result.output


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_demo_rejects_a_read_only_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        result = invoke(["demo", "--out-dir", folder])
        assert_clean_failure(result, str(folder), "not writable")
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o755)


def test_demo_rejects_a_bad_backend_before_loading(tmp_path):
    result = invoke(["demo", "--out-dir", tmp_path / "d", "--backend", "gpu"])
    assert_clean_failure(result, "--backend 'gpu'")
    assert not (tmp_path / "d").exists()
    if not torch.cuda.is_available():  # a valid backend that needs a GPU: refused before anything is made
        result = invoke(["demo", "--out-dir", tmp_path / "d", "--backend", "cuda"])
        assert_clean_failure(result, "--backend cuda", "H100/H200")
        assert not (tmp_path / "d").exists()


# -- paro calibrate: a pipeline folder is expected ---------------------------------------------

@pytest.mark.parametrize("content", ["empty", "no-index"])
def test_calibrate_rejects_a_folder_that_is_not_a_pipeline(tmp_path, content):
    model = tmp_path / "model"
    model.mkdir()
    if content == "no-index":
        (model / "config.json").write_text("{}")
    before = files_under(tmp_path)
    result = invoke(["calibrate", model, "--out", tmp_path / "plan.safetensors"])
    assert_clean_failure(result, str(model), "model_index.json", "diffusers pipeline folder")
    assert files_under(tmp_path) == before


def test_calibrate_rejects_an_unwritable_out_before_loading(tmp_path):
    saved_tiny_flux(tmp_path)
    result = invoke(["calibrate", tmp_path / "model", "--out", "/proc/paro-test/plan.safetensors"])
    assert_clean_failure(result, "/proc/paro-test", "not writable")


# -- paro inspect --------------------------------------------------------------------------------

def small_plan(path: Path) -> Plan:
    plan = Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=2, num_heads=2, density=0.5, orders="HWF",
                          num_buckets=1, block_size=16)
    plan.save(path)
    return plan


@pytest.mark.parametrize("heads", ["abc", "9", "1:2:3", "0:x"])
def test_inspect_rejects_malformed_heads(tmp_path, heads):
    small_plan(tmp_path / "plan.safetensors")
    result = invoke(["inspect", tmp_path / "plan.safetensors", "--png", tmp_path / "png", "--heads", heads])
    assert_clean_failure(result, f"--heads {heads!r}", "layer:head", "0:0,0:1")
    assert not (tmp_path / "png").exists()


def test_inspect_rejects_heads_outside_the_plan(tmp_path):
    small_plan(tmp_path / "plan.safetensors")
    result = invoke(["inspect", tmp_path / "plan.safetensors", "--png", tmp_path / "png", "--heads", "0:0,9:9"])
    assert_clean_failure(result, "9:9", "2 layers x 2 heads")
    assert not (tmp_path / "png").exists()


def test_inspect_png_finds_the_stats_file_beside_the_plan(tmp_path, monkeypatch):
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    folder = tmp_path / "moved"
    folder.mkdir()
    plan = Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=2, num_heads=2, density=0.5, orders="HWF",
                          num_buckets=1, block_size=16)
    # recorded where calibration wrote it; the folder has moved since
    plan.info["stats_file"] = {"name": "plan.stats.safetensors", "path": str(tmp_path / "gone" / "plan.stats.safetensors")}
    plan.save(folder / "plan.safetensors")
    nb = plan.block_mask.shape[-1]
    save_file({"figure_layers": torch.tensor([0]), "figure_original": torch.rand(1, 2, nb, nb),
               "figure_reordered": torch.rand(1, 2, nb, nb)}, str(folder / "plan.stats.safetensors"))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = invoke(["inspect", folder / "plan.safetensors", "--png", tmp_path / "png", "--heads", "0:0,1:0"])
    assert result.exit_code == 0, result.output
    with_maps = Image.open(tmp_path / "png" / "layer000_head000.png")
    masks_only = Image.open(tmp_path / "png" / "layer001_head000.png")  # layer 1 has no saved maps
    assert with_maps.height > masks_only.height + 300  # a row of two block-map panels above the mask


# -- paro calibrate: mask options --------------------------------------------------------------

@pytest.mark.parametrize("option, value, fragments", [
    ("--dense-layers", "0,x", ["--dense-layers '0,x'", "comma-separated layer indices"]),
    ("--dense-layers", "1.5", ["--dense-layers '1.5'", "e.g. --dense-layers 0,-1"]),
    ("--layer-floor", "1.5", ["--layer-floor 1.5", "[0, 1]"]),
    ("--layer-floor", "-0.1", ["--layer-floor -0.1", "[0, 1]"]),
    ("--dilation", "-1", ["--dilation -1", "from 0 to 1024"]),
    ("--dense-steps", "1", ["--dense-steps 1.0", "[0, 1)"]),
    ("--dense-steps", "-0.2", ["--dense-steps -0.2", "[0, 1)"]),
    ("--dense-steps", "0.3", ["--dense-steps 0.3: spends all of the density 0.3", "lower the dense steps"]),
    ("--buckets", "0", ["--buckets 0", "timestep buckets from 1 to 100"]),
    ("--ulysses", "0", ["--ulysses 0", "number of GPUs from 1 to 1024"]),
])
def test_calibrate_rejects_bad_mask_options_before_loading(tmp_path, monkeypatch, option, value, fragments):
    import paroattn.app.generate as generate

    saved_tiny_flux(tmp_path)
    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: pytest.fail("loaded the model"))
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors", option, value])
    assert_clean_failure(result, *fragments)


def test_calibrate_rejects_dense_layers_the_model_lacks_before_capture(tmp_path, monkeypatch):
    import paroattn.calibrate.driver as driver

    saved_tiny_flux(tmp_path)
    monkeypatch.setattr(driver, "calibrate_experts", lambda *a, **k: pytest.fail("captured"))
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors", "--dense-layers", "0,9"])
    # the layer count is known once the pipeline has loaded (its loading bars come before the error)
    assert_failure_after_loading(result, "--dense-layers 0,9", "has 3 attention layers", "0..2", "-3..-1")
    assert not (tmp_path / "out.safetensors").exists()


def test_calibrate_rejects_gpus_the_heads_do_not_split_over_before_capture(tmp_path, monkeypatch):
    import paroattn.calibrate.driver as driver

    saved_tiny_flux(tmp_path)
    monkeypatch.setattr(driver, "capture_experts", lambda *a, **k: pytest.fail("captured"))
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors", "--ulysses", "3"])
    assert_failure_after_loading(result, "ulysses=3", "2 heads per layer", "3 does not divide 2", "(1, 2)")
    assert not (tmp_path / "out.safetensors").exists()


def test_calibrate_passes_the_mask_options_to_the_config(tmp_path, monkeypatch):
    import paroattn.calibrate.driver as driver

    saved_tiny_flux(tmp_path)
    seen = {}

    def fake_calibrate(pipe, prompts, capture_config, selection, **kwargs):
        seen["config"], seen["capture"] = selection, capture_config
        return []

    monkeypatch.setattr(driver, "calibrate_experts", fake_calibrate)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors",
                     "--dense-layers", "0,-1", "--layer-floor", "0.25", "--dilation", "1", "--dense-steps", "0.2",
                     "--shared-budget", "--ulysses", "2"])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.dense_layers, config.layer_floor, config.dilation) == ((0, -1), 0.25, 1)
    assert (config.dense_steps, config.shared_budget, config.ulysses) == (0.2, True, 2)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors"])
    assert result.exit_code == 0, result.output
    assert (seen["config"].dense_layers, seen["config"].layer_floor, seen["config"].dilation) == ((), 0.0, 0)
    assert (seen["config"].dense_steps, seen["config"].shared_budget, seen["config"].ulysses) == (0.0, False, 1)


def test_calibrate_reports_dense_steps_the_captured_schedule_cannot_pay_for(tmp_path, monkeypatch):
    import paroattn.calibrate.driver as driver

    saved_tiny_flux(tmp_path)

    def refuse(*args, **kwargs):  # what plan_from_stats raises once the steps per bucket are known
        raise ValueError("dense buckets [0] hold 0.300 of the denoising steps, as much as density 0.3 or more")

    monkeypatch.setattr(driver, "calibrate_experts", refuse)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors", "--density", "0.3",
                     "--dense-steps", "0.2"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.rstrip().splitlines()[-1].startswith("error: dense buckets [0] hold 0.300")
    assert not (tmp_path / "out.safetensors").exists()


# -- every command: options out of range, bad devices and paths, before anything loads -------------

def no_model_loads(monkeypatch):
    """Make any model load fail the test: the checks must come first."""
    import paroattn.app.generate as generate
    import paroattn.demo_model.model as demo_model

    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(demo_model, "load_demo_pipeline", lambda *a, **k: pytest.fail("loaded the demo model"))


no_cuda = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")


@pytest.mark.parametrize("args, fragments", [
    (["--steps", "0"], ["--steps 0", "denoising steps from 1 to 1000"]),
    (["--steps", "-1"], ["--steps -1", "denoising steps from 1 to 1000"]),
    (["--num-prompts", "0"], ["--num-prompts 0", "1 to 8"]),
    (["--num-prompts", "9"], ["--num-prompts 9", "1 to 8"]),
    (["--density", "0"], ["--density 0.0", "(0, 1]"]),
    (["--density", "1.5"], ["--density 1.5", "(0, 1]"]),
    (["--qk", "int3"], ["--qk 'int3' is not one of bf16, int8, int4"]),
    (["--pv", "fp4"], ["--pv 'fp4' is not one of bf16, fp8, int8"]),
    (["--height", "63"], ["--height 63", "2 to 128 pixels, in multiples of 2"]),
    (["--width", "130"], ["--width 130", "2 to 128 pixels"]),
    (["--frames", "65"], ["--frames 65", "1 to 64 frames"]),
    (["--density", "nan"], ["--density nan", "(0, 1]"]),
    (["--seed", "-1"], ["--seed -1", "0 to 2**64 - 1"]),
    (["--device", "tpu"], ["--device 'tpu'", "cuda, cuda:N or cpu"]),
    (["--device", "cuda:x"], ["--device 'cuda:x'", "cuda, cuda:N or cpu"]),
    (["--backend", "gpu"], ["--backend 'gpu'", "auto, triton, cuda, torch"]),
])
def test_demo_rejects_bad_options_before_loading(tmp_path, monkeypatch, args, fragments):
    no_model_loads(monkeypatch)
    result = invoke(["demo", "--out-dir", tmp_path / "d", *args])
    assert_clean_failure(result, *fragments)
    assert not (tmp_path / "d").exists()


@no_cuda
@pytest.mark.parametrize("args, fragments", [
    (["--device", "cuda"], ["--device cuda", "no CUDA GPU", "pass --device cpu"]),
    (["--device", "cuda:0"], ["--device cuda:0", "no CUDA GPU"]),
    (["--backend", "triton"], ["--backend triton", "need a CUDA GPU", "--backend auto"]),
])
def test_demo_says_in_one_line_that_cuda_is_missing(tmp_path, monkeypatch, args, fragments):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    no_model_loads(monkeypatch)
    result = invoke(["demo", "--out-dir", tmp_path / "d", *args])
    assert_clean_failure(result, *fragments)
    assert not (tmp_path / "d").exists()


def test_a_failed_demo_removes_the_folder_it_made_and_keeps_one_it_did_not(tmp_path, monkeypatch):
    import paroattn.demo_model.model as demo_model

    def broken(*args, **kwargs):
        raise OSError("weights unreadable")

    monkeypatch.setattr(demo_model, "load_demo_pipeline", broken)
    result = invoke(["demo", "--out-dir", tmp_path / "new" / "d", "--device", "cpu"])
    assert_clean_failure(result, "weights unreadable")
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("x")
    result = invoke(["demo", "--out-dir", kept, "--device", "cpu"])
    assert_clean_failure(result, "weights unreadable")
    assert files_under(kept) == [kept / "mine.txt"]


@pytest.mark.parametrize("args, fragments", [
    (["--num-prompts", "0"], ["--num-prompts 0", "prompts from 1 to 1000"]),
    (["--density", "0"], ["--density 0.0", "(0, 1]"]),
    (["--density", "0", "--dense-steps", "0.2"], ["--density 0.0", "(0, 1]"]),
    (["--qk", "int3"], ["--qk 'int3' is not one of bf16, int8, int4"]),
    (["--out", "plan.pt"], ["--out plan.pt", "ending in .safetensors"]),
    (["--steps", "0"], ["--steps 0", "denoising steps from 1 to 1000"]),
    (["--height", "0"], ["--height 0", "pixels from 1 to 8192"]),
    (["--width", "-8"], ["--width -8", "pixels from 1 to 8192"]),
    (["--frames", "0"], ["--frames 0", "frames from 1 to 1024"]),
    (["--buckets", "0"], ["--buckets 0", "from 1 to 100"]),
    (["--bucket-edges", "1000,x,0"], ["--bucket-edges '1000,x,0'", "comma-separated numbers"]),
    (["--bucket-edges", "1000,nan,0"], ["--bucket-edges '1000,nan,0'", "comma-separated numbers"]),
    (["--bucket-edges", "1000,400,600,0"], ["--bucket-edges '1000,400,600,0'", "strictly descending"]),
    (["--bucket-edges", "900,0"], ["--bucket-edges '900,0'", "from 1000 down to 0"]),
    (["--stat-every", "0"], ["--stat-every 0", "steps k from 1 to 1000"]),
    (["--metric", "entropy"], ["--metric 'entropy'", "mass, paper"]),
    (["--quant-weight", "-1"], ["--quant-weight -1.0", "from 0 to 1000"]),
    (["--block-size", "48"], ["--block-size 48", "power of two from 16 to 1024"]),
    (["--block-size", "8"], ["--block-size 8", "power of two from 16 to 1024"]),
    (["--query-block", "96"], ["--query-block 96", "multiple of --block-size 64"]),
    (["--query-block", "32"], ["--query-block 32", "multiple of --block-size 64"]),
    (["--figure-layers", "a"], ["--figure-layers 'a'", "layer indices"]),
    (["--figure-layers", "-1"], ["--figure-layers '-1'", "integers >= 0"]),
    (["--seed", "-1"], ["--seed -1", "0 to 2**64 - 1"]),
    (["--device", "tpu"], ["--device 'tpu'", "cuda, cuda:N or cpu"]),
    (["--dtype", "int8"], ["--dtype 'int8'", "bfloat16, float16, float32"]),
    (["--frames", "3"], ["--frames is for video models", "image model (FLUX.1)", "leave --frames out"]),
    (["--prompts", "/nonexistent/prompts.txt"], ["--prompts /nonexistent/prompts.txt", "does not exist"]),
])
def test_calibrate_rejects_bad_options_before_loading(tmp_path, monkeypatch, args, fragments):
    saved_tiny_flux(tmp_path)
    no_model_loads(monkeypatch)
    before = files_under(tmp_path)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "new" / "plan.safetensors", *args])
    assert_clean_failure(result, *fragments)
    assert files_under(tmp_path) == before  # no plan, no empty folder


@pytest.mark.parametrize("content, fragments", [
    ("folder", ["is a folder", "one prompt per line"]),
    ("# only a comment\n\n", ["holds no prompts"]),
    (b"\xff\xfe\x00bad", ["cannot be read", "UTF-8"]),
])
def test_calibrate_rejects_a_prompts_file_it_cannot_use_before_loading(tmp_path, monkeypatch, content, fragments):
    saved_tiny_flux(tmp_path)
    no_model_loads(monkeypatch)
    prompts = tmp_path / "prompts"
    if content == "folder":
        prompts.mkdir()
    elif isinstance(content, bytes):
        prompts.write_bytes(content)
    else:
        prompts.write_text(content)
    before = files_under(tmp_path)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors", "--prompts", prompts])
    assert_clean_failure(result, "--prompts", *fragments)
    assert files_under(tmp_path) == before


@no_cuda
def test_calibrate_says_in_one_line_that_cuda_is_missing(tmp_path, monkeypatch):
    saved_tiny_flux(tmp_path)
    no_model_loads(monkeypatch)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "new.safetensors", "--device", "cuda"])
    assert_clean_failure(result, "--device cuda", "no CUDA GPU")


def test_calibrate_rejects_figure_layers_the_model_lacks_before_capture(tmp_path, monkeypatch):
    import paroattn.calibrate.driver as driver

    saved_tiny_flux(tmp_path)
    monkeypatch.setattr(driver, "calibrate_experts", lambda *a, **k: pytest.fail("captured"))
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors", "--figure-layers", "0,7"])
    assert_failure_after_loading(result, "--figure-layers 0,7", "has 3 attention layers", "not layer 7", "0..2")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("args, fragments", [
    (["--steps", "0"], ["--steps 0", "denoising steps from 1 to 1000"]),
    (["--height", "0"], ["--height 0", "pixels from 1 to 8192"]),
    (["--frames", "-1"], ["--frames -1", "frames from 1 to 1024"]),
    (["--seed", "-1"], ["--seed -1", "0 to 2**64 - 1"]),
    (["--device", "tpu"], ["--device 'tpu'", "cuda, cuda:N or cpu"]),
    (["--dtype", "float64x"], ["--dtype 'float64x'", "bfloat16, float16, float32"]),
    (["--ulysses", "0"], ["--ulysses 0", "number of GPUs"]),
    (["--compare"], ["--compare", "--plan PLAN"]),
])
def test_generate_rejects_bad_options_before_loading(tmp_path, monkeypatch, args, fragments):
    no_model_loads(monkeypatch)
    result = invoke(["generate", tmp_path / "no-model", "--prompt", "a cat", "--out", tmp_path / "o" / "x.png", *args])
    assert_clean_failure(result, *fragments)
    assert files_under(tmp_path) == []


@no_cuda
@pytest.mark.parametrize("args, fragments", [
    (["--device", "cuda"], ["--device cuda", "no CUDA GPU"]),
    (["--backend", "triton"], ["--backend triton", "need a CUDA GPU"]),
])
def test_generate_says_in_one_line_that_cuda_is_missing(tmp_path, monkeypatch, args, fragments):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    no_model_loads(monkeypatch)
    result = invoke(["generate", tmp_path / "no-model", "--prompt", "a cat", *args])
    assert_clean_failure(result, *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["--frames", "3"], ["--frames is for video models", "image model (FLUX.1)"]),
    (["--out", "VIDEO"], ["an image model writes .png", "not .mp4"]),
    (["--plan", "FOLDER"], ["is a folder", "pass a plan file"]),
    (["--plan", "MISSING"], ["no plan file at", "paro calibrate"]),
])
def test_generate_checks_the_model_kind_and_plan_path_before_loading(tmp_path, monkeypatch, args, fragments):
    saved_tiny_flux(tmp_path)
    no_model_loads(monkeypatch)
    swap = {"VIDEO": tmp_path / "x.mp4", "FOLDER": tmp_path, "MISSING": tmp_path / "missing.safetensors"}
    before = files_under(tmp_path)
    result = invoke(["generate", tmp_path / "model", "--prompt", "a cat", *[swap.get(a, a) for a in args]])
    assert_clean_failure(result, *fragments)
    assert files_under(tmp_path) == before


# -- paro inspect: paths and prompts ---------------------------------------------------------------

def test_inspect_of_a_folder_asks_for_a_plan_file(tmp_path):
    result = invoke(["inspect", tmp_path])
    assert_clean_failure(result, str(tmp_path), "is a folder", "pass a plan file")
    assert "--out" not in result.output.split("`paro calibrate --out`")[0]


def test_inspect_shows_prompts_whole_or_cut_at_a_word(tmp_path):
    long = ("a red fox runs through deep fresh snow under a pale winter sky while the camera slowly pans left "
            "across the quiet frozen valley at dawn")
    plan = Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=1, num_heads=2, density=0.5, orders="HWF",
                          num_buckets=1, block_size=16)
    plan.prompts = ["short prompt", long, "third", "fourth", "fifth"]
    plan.save(tmp_path / "plan.safetensors")
    result = invoke(["inspect", tmp_path / "plan.safetensors"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    shown = lines[lines.index("prompts      5:") + 1:][:4]
    assert shown[0].strip() == "short prompt"
    cut = shown[1].strip()
    assert cut.endswith(" ...") and long.startswith(cut[:-4]) and long[len(cut) - 4] == " "
    assert shown[2].strip() == "third" and shown[3].strip() == "(and 2 more)"


# -- help and version ------------------------------------------------------------------------------

COMMANDS = ["inspect", "calibrate", "generate", "demo", "demo-pipeline", "bench"]


def test_version():
    import paroattn

    result = invoke(["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"paroattn {paroattn.__version__}", result.output


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
def test_help_has_no_type_markers_and_no_measured_numbers(command):
    import re

    result = invoke([*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output and "{" not in result.output, result.output
    if "Commands:" in result.output:  # click cuts a command's help in this list to fit: each has a short one
        listed = result.output.split("Commands:")[1]
        assert not any(line.rstrip().endswith("...") for line in listed.splitlines()), listed
    # help says what an option does; what it costs is measured in QUALITY.md, which goes stale in no help text
    assert not re.search(r"\d\s*(dB|ms|seconds|minutes)\b|\d\s*s\b", result.output), result.output


@pytest.mark.parametrize("command", ["generate", "calibrate"])
def test_help_lists_every_supported_family(command):
    from paroattn.pipelines.registry import FAMILIES

    text = " ".join(invoke([command, "--help"]).output.split())
    for family in FAMILIES:
        assert family.models and family.models in text, (family.models, text)
    assert len({family.models for family in FAMILIES}) == len(FAMILIES)  # each family under its own name
    for name in ("CogVideoX", "Wan 2.1 / 2.2", "HunyuanVideo", "FLUX.1"):
        assert name in text


@pytest.mark.parametrize("args, fragments", [
    (["demo", "--steps", "abc"], ["--steps 'abc': expected an integer", "`paro demo --help`"]),
    (["demo", "--frobnicate"], ["No such option: --frobnicate", "`paro demo --help`"]),
    (["calibrate", "x"], ["Missing option '--out'", "`paro calibrate --help`"]),
    (["generate"], ["Missing argument 'MODEL_DIR'", "`paro generate --help`"]),
    (["inspect", "p", "--heads"], ["--heads", "requires an argument"]),
])
def test_a_malformed_command_line_is_one_line_too(args, fragments):
    result = invoke(args)
    assert_clean_failure(result, *fragments)
    assert "Usage:" not in result.output
