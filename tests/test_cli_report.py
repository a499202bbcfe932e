"""What a run prints is true on the device it ran on (modes that say what the CPU computes in, mask memory only
as reported and in words true there), output a person can see (tiny videos enlarged), progress that shows in a
log, and warnings that say what to do."""

from __future__ import annotations

import io
import json

import pytest
import torch
from test_offline_pipeline import PROMPT, invoke

import paroattn.app.generate as generation
from paroattn.app.cli import masks_line
from paroattn.app.demo import shipped_plan_path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "demo-pipeline"
    result = invoke(["demo-pipeline", path])
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="module")
def cpu_run(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "clip.gif"
    result = invoke(["generate", folder, "--prompt", PROMPT, "--plan", shipped_plan_path(0.5), "--steps", "2",
                     "--height", "32", "--width", "32", "--frames", "2", "--device", "cpu", "--compare",
                     "--out", out])
    assert result.exit_code == 0, result.output
    return result.output, out


def test_generate_on_the_cpu_names_what_it_computes_in(cpu_run):
    output, _ = cpu_run
    assert "qk=fp32, pv=fp32" in output and "bf16" not in output
    assert "on the device" not in output and "on the host" not in output


def test_generate_enlarges_a_tiny_video_and_says_by_how_much(cpu_run):
    import imageio.v2 as imageio

    output, out = cpu_run
    assert "enlarged 8x (nearest neighbour) from 32x32 to 256x256" in output
    for path in (out, out.with_name("clip_dense.gif")):
        frames = list(imageio.get_reader(path))
        assert len(frames) == 2 and frames[0].shape[:2] == (256, 256)
        # nearest neighbour: each 8 x 8 square is one pixel of the model's video
        assert (frames[0][:8, :8] == frames[0][0, 0]).all()


def test_visible_scale():
    assert generation.visible_scale(32, 32) == 8
    assert generation.visible_scale(16, 24) == 10
    assert generation.visible_scale(480, 832) == 1
    pixels = torch.rand(2, 3, 4, 3).numpy()
    assert generation.enlarged(pixels, 3).shape == (2, 9, 12, 3)


@pytest.mark.parametrize("masks, device, line", [
    ({}, "cpu", None),
    (None, "cuda:0", None),
    ({"mode": "bool masks"}, "cpu", None),
    ({"gpu_bytes": 0, "host_bytes": 3 * 2**10}, "cpu", "masks: 3.0 KiB in memory (this run is on the CPU)"),
    ({"gpu_bytes": 5 * 2**20, "host_bytes": 0}, "cuda:0", "masks: 5.0 MiB on the GPU, 0.0 KiB in host memory"),
    ({"transformer": {"gpu_bytes": 2**30, "host_bytes": 0}, "transformer_2": {"gpu_bytes": 2**30, "host_bytes": 0}},
     "cuda", "masks: 2.0 GiB on the GPU, 0.0 KiB in host memory"),
    ({"transformer": {}, "transformer_2": {}}, "cuda", None),
])
def test_the_masks_line_prints_what_stats_returned_in_words_true_on_the_device(masks, device, line):
    assert masks_line(masks, device) == line


def test_the_density_line_says_when_the_run_quantizes_and_the_summary_did_not(tmp_path):
    from paroattn.app.demo import density_cost_line

    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"device": "GPU X", "qk": "bf16", "pv": "bf16", "eval_prompts": 3, "seeds": [0],
                                "by_density": {"0.50": {"psnr_db": 31.04, "ssim": 0.951}}}))
    same = density_cost_line(path, qk="bf16", pv="bf16")
    assert "(qk=bf16 pv=bf16, 3 held-out" in same and "not this run's" not in same
    other = density_cost_line(path, qk="int8", pv="fp8")
    assert "measured with qk=bf16 pv=bf16, not this run's qk=int8 pv=fp8" in other


# -- progress in a log ---------------------------------------------------------------------------------

def test_a_pipelines_step_bar_prints_lines_in_a_log(monkeypatch):
    from tqdm import tqdm

    from paroattn.app import progress

    log = io.StringIO()
    assert progress.tqdm_options(log)["file"].stream is log
    monkeypatch.setattr(progress, "LOG_PERIOD_S", 0.0)
    for _ in tqdm(range(5), desc="dense", **progress.tqdm_options(log)):
        pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) >= 2, lines
    assert lines[0].startswith("dense:") and "5/5" in lines[-1]


def test_no_line_options_on_a_terminal():
    from paroattn.app import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert progress.tqdm_options(Terminal()) == {}


def test_generate_and_demo_bars_print_lines_when_stderr_is_not_a_terminal(folder, monkeypatch):
    from paroattn.app import demo, progress
    from paroattn.demo_model.model import load_demo_pipeline

    pipe = load_demo_pipeline(folder, device="cpu")
    monkeypatch.setattr("sys.stderr", io.StringIO())
    progress.log_progress(pipe)
    assert isinstance(pipe._progress_bar_config["file"], progress.LineStream)
    with demo.progress_bar(pipe, "dense"):
        assert isinstance(pipe._progress_bar_config["file"], progress.LineStream)
        assert pipe._progress_bar_config["desc"] == "dense"


def test_calibration_progress_prints_lines_in_a_log(monkeypatch):
    import paroattn.calibrate.driver as driver

    log = io.StringIO()
    monkeypatch.setattr(driver, "LOG_PERIOD_S", 0.0)
    with driver._Progress(True, 2, 10, 4, stream=log) as bar:
        bar.update("steps", completed=3)
        bar.update("layers", completed=4)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("calibration: prompts 0/2, steps 3/10, layers 0/4")
    assert lines[-1].startswith("calibration: prompts 0/2, steps 3/10, layers 4/4") and len(lines) == 3
    quiet = io.StringIO()
    monkeypatch.setattr(driver, "LOG_PERIOD_S", 3600.0)
    with driver._Progress(True, 2, 10, 4, stream=quiet) as bar:
        bar.update("steps", completed=3)
    assert len(quiet.getvalue().splitlines()) == 1  # the end only, within the period


# -- calibrate's warning about empty buckets --------------------------------------------------------------

def test_the_empty_bucket_warning_says_what_fills_them():
    from paroattn.calibrate.config import CaptureConfig
    from paroattn.calibrate.driver import empty_buckets_advice

    config = CaptureConfig(steps=10, stat_every=2, num_buckets=6)
    captured_less = empty_buckets_advice([3], config, [2, 2, 2, 1, 1, 12])
    assert "pass --stat-every 1" in captured_less and "raise --steps" not in captured_less
    never_ran = empty_buckets_advice([3], config, [2, 2, 2, 0, 1, 12])
    assert "none of the 10 denoising steps fell in buckets [3] (timesteps (600, 700])" in never_ran
    assert "raise --steps" in never_ran and "--buckets 5" in never_ran


def test_plan_from_stats_logs_the_advice(monkeypatch):
    import paroattn.calibrate.driver as driver

    logged = []
    monkeypatch.setattr(driver, "empty_buckets_advice", lambda empty, config, steps: f"ADVICE {empty}")

    class Stop(Exception):
        pass

    # the warning is logged where the plan is built; stop right after it
    monkeypatch.setattr(driver, "asdict", lambda *a: (_ for _ in ()).throw(Stop()))

    class Result:
        steps_per_bucket = [1, 0]
        block_mask = torch.zeros(2, 1, 1, 1, 1, dtype=torch.bool)
        dense_layers, dense_buckets = [], []

    class Accumulator:
        num_layers, mask_block = 1, 16

        def finalize(self, *a, **k):
            return Result()

    class Stats:
        config = driver.CaptureConfig(num_buckets=2)
        accumulators = {"all": Accumulator()}
        layout, timings, expert, bucket_steps = type("L", (), {"prefix": 0, "suffix": 0})(), {}, "", [1, 0]

    with pytest.raises(Stop):
        driver.plan_from_stats(Stats(), compute_device="cpu", log=logged.append)
    assert logged == ["warning: no captured step fell in buckets [1]; they use the mean over all captured steps. "
                      "ADVICE [1]"]


# -- attention pictures -----------------------------------------------------------------------------------

def test_attention_pictures_have_a_colour_scale_a_mask_legend_and_stay_compact(tmp_path):
    import numpy as np
    from PIL import Image
    from safetensors.torch import save_file

    from paroattn import Plan, TokenLayout
    from paroattn.calibrate import figures

    plan = Plan.synthetic(layout=TokenLayout(0, 4, 8, 8), num_layers=1, num_heads=1, density=0.5, num_buckets=6,
                          block_size=16)
    plan.save(tmp_path / "plan.safetensors")
    nb = plan.block_mask.shape[-1]
    save_file({"figure_layers": torch.tensor([0]), "figure_original": torch.rand(1, 1, nb, nb),
               "figure_reordered": torch.rand(1, 1, nb, nb)}, str(tmp_path / "plan.stats.safetensors"))
    [path] = figures.draw_plan_heads(plan, [(0, 0)], tmp_path / "png", plan_path=tmp_path / "plan.safetensors")
    picture = np.asarray(Image.open(path).convert("RGB"))
    height, width = picture.shape[:2]
    assert width < 1.5 * height  # six buckets' masks wrap into rows instead of a long strip

    scale = np.asarray(figures._colour_scale(300))
    column = scale[:, 5]  # a column through the bar: the ramp from its top colour down to its bottom one
    bar = column[(column[:, 0] != column[:, 1]) | (column[:, 1] != column[:, 2])]  # coloured rows: not the title
    ramp = figures._RAMP.numpy().astype(int)
    assert (np.abs(bar[0].astype(int) - ramp[-1]) <= 2).all() and (np.abs(bar[-1].astype(int) - ramp[0]) <= 2).all()
    legend = np.asarray(figures._mask_legend())
    for colour in (figures.KEPT_COLOUR, figures.SKIPPED_COLOUR):
        assert (legend.reshape(-1, 3) == colour).all(axis=1).sum() > 100  # a swatch of each
    # and both are in the picture: the bar's ramp and the legend's swatch of skipped blocks
    flat = picture.reshape(-1, 3)
    assert (flat == ramp[-1]).all(axis=1).any() and (flat == figures.SKIPPED_COLOUR).all(axis=1).any()


def test_a_picture_without_stats_says_why_it_has_no_maps(tmp_path):
    from paroattn import Plan, TokenLayout
    from paroattn.calibrate import figures

    plan = Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=1, num_heads=1, density=0.5, num_buckets=1,
                          block_size=16)
    plan.save(tmp_path / "plan.safetensors")
    [path] = figures.draw_plan_heads(plan, [(0, 0)], tmp_path / "png", plan_path=tmp_path / "plan.safetensors")
    assert path.is_file() and not [p for p in path.parent.iterdir() if ".partial-" in p.name]


def test_the_demo_pipelines_calibrate_recipe_fills_every_bucket(tmp_path):
    """The `paro calibrate` line `paro demo-pipeline` prints captures a step in every timestep bucket of the
    default 6 (its scheduler's timesteps at the recipe's --steps, captured every --stat-every steps), so it runs
    without the empty-bucket warning."""
    import re

    from paroattn.calibrate.recorder import bucket_index
    from paroattn.demo_model.model import load_demo_pipeline
    from paroattn.plan import default_bucket_edges

    result = invoke(["demo-pipeline", tmp_path / "dp"])
    assert result.exit_code == 0, result.output
    recipe = next(line for line in result.output.splitlines() if "paro calibrate" in line)
    steps = int(re.search(r"--steps (\d+)", recipe).group(1))
    every = int(m.group(1)) if (m := re.search(r"--stat-every (\d+)", recipe)) else 1  # the cheap capture's
    buckets = int(m.group(1)) if (m := re.search(r"--buckets (\d+)", recipe)) else 6
    scheduler = load_demo_pipeline(tmp_path / "dp", device="cpu").scheduler
    scheduler.set_timesteps(steps)
    edges = default_bucket_edges(buckets)
    captured = [bucket_index(edges, float(t)) for i, t in enumerate(scheduler.timesteps) if i % every == 0]
    assert sorted(set(captured)) == list(range(buckets)), (recipe, captured)
