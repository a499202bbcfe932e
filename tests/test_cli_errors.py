"""Every `paro` command fails early and clearly: exit code 2, one line naming the input and the fix,
no traceback, and nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from paroattn import Plan, TokenLayout
from paroattn.cli import app

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


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*"))


def saved_tiny_flux(folder: Path) -> dict:
    """A tiny FLUX pipeline saved to folder/model and a plan for its tiny size in folder/plan.safetensors."""
    from paroattn.pipelines import layout_for, self_attention_layers
    from paroattn.plan import model_fingerprint
    from paroattn.testing import TINY_BLOCK, tiny_call_kwargs, tiny_pipeline

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
    result = invoke(["generate", tmp_path / "no-model", "--prompt", "a cat", "--backend", "cuda"])
    assert_clean_failure(result, "--backend 'cuda'", "auto, triton, torch")
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
    assert "paro calibrate MODEL_DIR --height 128 --width 96" in result.output
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

    from paroattn.pipelines.generate import _write

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
    result = invoke(["demo", "--out-dir", tmp_path / "d", "--backend", "cuda"])
    assert_clean_failure(result, "--backend 'cuda'")
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
    assert with_maps.width > masks_only.width + 300  # two block-map panels beside the mask


# -- paro bench ------------------------------------------------------------------------------------

def test_bench_help_lists_the_benchmarks_options():
    result = invoke(["bench", "--help"])
    assert result.exit_code == 0, result.output
    assert "paro bench" in result.output
    for option in ("--shapes", "--densities", "--table", "--summary"):
        assert option in result.output


# -- paro calibrate: mask options --------------------------------------------------------------

@pytest.mark.parametrize("option, value, fragments", [
    ("--dense-layers", "0,x", ["--dense-layers '0,x'", "comma-separated layer indices"]),
    ("--dense-layers", "1.5", ["--dense-layers '1.5'", "e.g. --dense-layers 0,-1"]),
    ("--layer-floor", "1.5", ["--layer-floor 1.5", "[0, 1]"]),
    ("--layer-floor", "-0.1", ["--layer-floor -0.1", "[0, 1]"]),
    ("--dilation", "-1", ["--dilation -1", ">= 0"]),
    ("--dense-steps", "1", ["--dense-steps 1.0", "[0, 1)"]),
    ("--dense-steps", "-0.2", ["--dense-steps -0.2", "[0, 1)"]),
    ("--dense-steps", "0.3", ["--dense-steps 0.3 spends all of --density 0.3", "lower --dense-steps"]),
])
def test_calibrate_rejects_bad_mask_options_before_loading(tmp_path, monkeypatch, option, value, fragments):
    import paroattn.pipelines.generate as generate

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
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.output.rstrip().endswith(errors[0]), result.output
    for fragment in ("--dense-layers 0,9", "has 3 attention layers", "0..2", "-3..-1"):
        assert fragment in errors[0], result.output
    assert not (tmp_path / "out.safetensors").exists()


def test_calibrate_passes_the_mask_options_to_the_config(tmp_path, monkeypatch):
    import paroattn.calibrate.driver as driver

    saved_tiny_flux(tmp_path)
    seen = {}

    def fake_calibrate(pipe, prompts, config, **kwargs):
        seen["config"] = config
        return []

    monkeypatch.setattr(driver, "calibrate_experts", fake_calibrate)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors",
                     "--dense-layers", "0,-1", "--layer-floor", "0.25", "--dilation", "1", "--dense-steps", "0.2",
                     "--shared-budget"])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.dense_layers, config.layer_floor, config.dilation) == ([0, -1], 0.25, 1)
    assert (config.dense_steps, config.shared_budget) == (0.2, True)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "out.safetensors"])
    assert result.exit_code == 0, result.output
    assert (seen["config"].dense_layers, seen["config"].layer_floor, seen["config"].dilation) == ([], 0.0, 0)
    assert (seen["config"].dense_steps, seen["config"].shared_budget) == (0.0, False)


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
