"""`paro demo` end to end at a small setting (one prompt, two steps): what it writes and records, and a PARO
video measured against a floor the test computes from the dense model itself."""

from __future__ import annotations

import json
import math

import imageio.v2 as imageio
import numpy as np
import pytest
from typer.testing import CliRunner

from paroattn.app.cli import app
from paroattn.app.demo import GIF_SCALE, LABEL_HEIGHT, difference_gain, side_by_side

STEPS = 2


def _strict_json(text: str):
    """json.loads that refuses Infinity and NaN, which are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = CliRunner().invoke(app, ["demo", "--out-dir", str(out), "--steps", str(STEPS), "--num-prompts", "1",
                                      "--density", "0.5", "--qk", "int8", "--device", "cpu"])
    return out, result


@pytest.fixture(scope="module")
def dense_videos():
    """The demo pipeline and its dense videos of the first demo prompt at seeds 0 and 1 (STEPS steps)."""
    from paroattn.app.demo import EVAL_PROMPTS, sample
    from paroattn.demo_model.model import load_demo_pipeline

    pipe = load_demo_pipeline()
    pipe.set_progress_bar_config(disable=True)
    dense, _ = sample(pipe, EVAL_PROMPTS[:1], steps=STEPS, seed=0)
    other, _ = sample(pipe, EVAL_PROMPTS[:1], steps=STEPS, seed=1)
    return pipe, dense, other


@pytest.fixture(scope="module")
def seed_floor(dense_videos):
    """PSNR of the dense video against the dense video of another seed, same prompt and steps: what any
    plausible video of this prompt scores. A PARO video of the same seed must be far closer than that."""
    from paroattn.app.demo import compare

    _, dense, other = dense_videos
    return compare(dense, other)["psnr_db"]


@pytest.mark.slow
def test_demo_records_the_run_in_strict_json(demo_run):
    from paroattn.app.demo import EVAL_PROMPTS, shipped_plan_path
    from paroattn.plan import Plan

    out, result = demo_run
    assert result.exit_code == 0, result.output
    plan_path = shipped_plan_path(0.5).resolve()
    # the plan's path as the user can open it, from any folder
    assert f"plan: {plan_path} (achieved density" in result.output and plan_path.is_absolute()
    report = _strict_json((out / "metrics.json").read_text())
    plan = Plan.load(plan_path)
    assert report["plan"] == str(plan_path)
    assert report["target_density"] == 0.5 and report["density"] == pytest.approx(plan.achieved_density())
    assert (report["qk"], report["pv"], report["backend"]) == ("int8", "bf16", "auto")
    assert (report["steps"], report["seed"], report["device"]) == (STEPS, 0, "cpu")
    assert report["prompts"] == EVAL_PROMPTS[:1] and len(report["per_prompt"]) == 1
    assert report["dense_time"]["attention_s"] > 0 and report["paro_time"]["attention_s"] > 0
    metrics = report["metrics"]
    assert f"PSNR {metrics['psnr_db']:.2f} dB" in result.output
    # step bars of both passes
    assert "dense: 100%" in result.output and f"PARO d={report['density']:.2f}: 100%" in result.output


@pytest.mark.slow
def test_demo_paro_video_is_close_to_dense_against_a_computed_floor(demo_run, seed_floor):
    out, result = demo_run
    assert result.exit_code == 0, result.output
    metrics = _strict_json((out / "metrics.json").read_text())["metrics"]
    assert math.isfinite(metrics["psnr_db"]), metrics  # a d=0.5 plan changes the video: not identical to dense
    assert metrics["psnr_db"] > seed_floor + 10.0, (metrics, seed_floor)
    assert 0.0 < metrics["ssim"] <= 1.0 and 0.0 < metrics["cosine"] <= 1.0


@pytest.mark.slow
def test_demo_writes_a_labelled_gif_and_attention_pictures(demo_run):
    out, result = demo_run
    assert result.exit_code == 0, result.output
    report = _strict_json((out / "metrics.json").read_text())
    frames = imageio.mimread(out / "demo.gif")
    assert len(frames) == 8  # the model's frames
    side, gap = 32 * GIF_SCALE, 4
    # a band of column labels, then per prompt a band with the prompt above the row of dense | PARO | difference
    assert frames[0].shape[:2] == (2 * LABEL_HEIGHT + side, 3 * side + 2 * gap)
    picture = np.asarray(frames[0])[..., :3]
    columns = picture[:LABEL_HEIGHT]
    for column in range(3):
        assert columns[:, column * (side + gap):column * (side + gap) + side].min() < 100  # a label over each
    prompt_band = picture[LABEL_HEIGHT:2 * LABEL_HEIGHT]
    assert prompt_band.min() < 100 and prompt_band.max() == 255
    assert 110 <= imageio.get_reader(out / "demo.gif").get_meta_data()["duration"] <= 130  # ms per frame
    assert "|dense - PARO| x" in result.output and report["gif_difference_gain"] <= 4
    pictures = sorted((out / "attention").glob("*.png"))
    assert len(pictures) == 5 and [str(p) for p in pictures] == sorted(report["pictures"])


@pytest.mark.slow
def test_demo_prints_the_shipped_quality_summary_as_it_is(demo_run):
    """The line on what lower densities cost is the shipped summary's, whatever its numbers, and says that they
    were measured without this run's int8 QK."""
    from paroattn.app.demo import QUALITY_SUMMARY, density_cost_line

    out, result = demo_run
    summary = json.loads(QUALITY_SUMMARY.read_text())
    line = density_cost_line(qk="int8", pv="bf16")
    assert line is not None and line in result.output
    assert f"measured with qk={summary['qk']} pv={summary['pv']}, not this run's qk=int8 pv=bf16" in line
    for density, measured in summary["by_density"].items():
        assert f"d={float(density):g}: {measured['psnr_db']:.1f} dB / SSIM {measured['ssim']:.3f}" in line


@pytest.mark.slow
def test_demo_defaults_are_a_shipped_plan_close_to_dense(dense_videos, seed_floor):
    """The default density has a shipped plan, and with the default precisions its video is close to dense,
    measured here against the floor another seed's video sets (the shipped d=0.2 plan, 28 dB at these steps,
    would fail it; the default scores 58 dB). The CLI's defaults are the demo's, and the shipped quality summary
    covers the shipped densities."""
    import inspect

    from paroattn.app import demo
    from paroattn.app.cli import demo as cli_demo

    pipe, dense, _ = dense_videos
    plan, path, _ = demo.resolve_plan(pipe, demo.DEFAULT_DENSITY, demo.DEFAULT_QK, demo.DEFAULT_PV, log=lambda _: None)
    assert path == demo.shipped_plan_path(demo.DEFAULT_DENSITY).resolve()  # shipped, not calibrated on the spot
    paro, _ = demo.run_with_plan(pipe, plan, demo.EVAL_PROMPTS[:1], steps=STEPS, seed=0)
    measured = demo.compare(dense, paro)
    assert measured["psnr_db"] > seed_floor + 10.0 and measured["ssim"] >= 0.9, (measured, seed_floor)

    summary = json.loads(demo.QUALITY_SUMMARY.read_text())
    assert (summary["qk"], summary["pv"]) == (demo.DEFAULT_QK, demo.DEFAULT_PV)
    assert set(summary["by_density"]) >= {f"{d:.2f}" for d in demo.SHIPPED_DENSITIES if d > 0.2}
    cli = {name: p.default.default for name, p in inspect.signature(cli_demo).parameters.items()}
    assert (cli["density"], cli["qk"], cli["pv"]) == (demo.DEFAULT_DENSITY, demo.DEFAULT_QK, demo.DEFAULT_PV)
    run = inspect.signature(demo.run_demo).parameters
    assert (run["density"].default, run["qk"].default, run["pv"].default) == (0.5, "bf16", "bf16")


def test_density_cost_line_reads_the_summary(tmp_path):
    from paroattn.app.demo import density_cost_line

    assert density_cost_line(tmp_path / "missing.json") is None
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"device": "GPU X", "qk": "int8", "pv": "fp8", "eval_prompts": 3, "seeds": [0],
                                "by_density": {"0.70": {"psnr_db": 31.04, "ssim": 0.951},
                                               "0.30": {"psnr_db": 20.0, "ssim": 0.7}}}))
    assert density_cost_line(path) == ("PARO vs dense by density on this model (qk=int8 pv=fp8, 3 held-out prompts "
                                       "x 1 seeds, GPU X): d=0.7: 31.0 dB / SSIM 0.951, d=0.3: 20.0 dB / SSIM 0.700; "
                                       "QUALITY.md")


@pytest.mark.slow
def test_demo_calibrates_a_density_that_was_not_shipped(tmp_path, capsys):
    from paroattn.app.demo import run_demo
    from paroattn.plan import Plan

    lines = []
    # at 4 frames of 16 x 16 pixels (256 tokens, 4 x 4 blocks), where the statistics take seconds on a CPU
    report = run_demo(tmp_path, density=0.4, steps=1, num_prompts=1, calibration_steps=2, device="cpu",
                      height=16, width=16, frames=4, log=lines.append, progress=True)
    assert any("no shipped plan for density 0.4" in line for line in lines)
    shown = capsys.readouterr()
    assert "layers" in shown.out + shown.err and "2/2" in shown.out + shown.err  # the calibration's bars
    plan = Plan.load(tmp_path / "plan.safetensors")
    assert abs(plan.achieved_density() - 0.4) < 0.01 and abs(report["density"] - 0.4) < 0.01
    assert report["plan"] == str((tmp_path / "plan.safetensors").resolve())
    assert any(line == f"plan: {(tmp_path / 'plan.safetensors').resolve()} and its stats file" for line in lines)
    assert (tmp_path / "plan.stats.safetensors").is_file()
    assert len(list((tmp_path / "attention").glob("*.png"))) == 5


def test_metrics_of_identical_videos_are_written_as_json(tmp_path):
    """Identical videos have an infinite PSNR; metrics.json holds null there, not Infinity (not JSON)."""
    from paroattn.app.demo import _finite

    report = {"metrics": {"psnr_db": float("inf"), "ssim": 1.0}, "per_prompt": [{"psnr_db": float("nan")}]}
    text = json.dumps(_finite(report), allow_nan=False)
    assert _strict_json(text) == {"metrics": {"psnr_db": None, "ssim": 1.0}, "per_prompt": [{"psnr_db": None}]}


def test_demo_rejects_unknown_precision(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--out-dir", str(tmp_path / "d"), "--qk", "int3"])
    assert result.exit_code == 2
    assert "--qk 'int3' is not one of bf16, int8, int4" in result.output
    assert not (tmp_path / "d").exists()


def test_side_by_side_layout():
    a = np.zeros((2, 4, 4, 3), np.float32)
    b = np.ones((2, 4, 4, 3), np.float32)
    frames = side_by_side([[a, b], [b, a]], scale=2, gap=1)
    assert len(frames) == 2 and frames[0].shape == (2 * 8 + 1, 2 * 8 + 1, 3)
    assert frames[0][0, 0].tolist() == [0, 0, 0] and frames[0][0, -1].tolist() == [255, 255, 255]
    assert frames[0][-1, 0].tolist() == [255, 255, 255] and frames[0][-1, -1].tolist() == [0, 0, 0]


def test_side_by_side_labels_each_column_and_each_row():
    a = np.zeros((1, 8, 8, 3), np.float32)
    frames = side_by_side([[a, a], [a, a]], scale=4, gap=2, labels=["dense", "PARO"],
                          row_labels=["1: red circle", "2: a very long prompt " * 10])
    rows_start = [LABEL_HEIGHT, LABEL_HEIGHT + LABEL_HEIGHT + 32 + 2]
    assert frames[0].shape == (3 * LABEL_HEIGHT + 2 * 32 + 2, 2 * 32 + 2, 3)
    band = frames[0][:LABEL_HEIGHT]
    assert band[:, :32].min() < 100 and band[:, 34:].min() < 100 and band.max() == 255
    for start in rows_start:  # each row's label band is white with text, and its video (black) follows it
        row_band = frames[0][start:start + LABEL_HEIGHT]
        assert row_band.min() < 100 and row_band.max() == 255
        assert frames[0][start + LABEL_HEIGHT:start + LABEL_HEIGHT + 32, :32].max() == 0


def test_side_by_side_upscales_by_nearest_neighbour():
    video = np.random.default_rng(0).random((1, 3, 5, 3)).astype(np.float32)
    frame = side_by_side([[video]], scale=GIF_SCALE)[0]
    assert frame.shape == (3 * GIF_SCALE, 5 * GIF_SCALE, 3)
    expected = (video[0].clip(0, 1) * 255).round().astype(np.uint8)
    assert np.array_equal(frame[::GIF_SCALE, ::GIF_SCALE], expected)
    assert np.array_equal(frame, np.repeat(np.repeat(expected, GIF_SCALE, 0), GIF_SCALE, 1))


def test_difference_gain_keeps_the_panel_below_white():
    dense = np.zeros((1, 2, 8, 8, 3), np.float32)
    small = dense + 0.05
    assert difference_gain(dense, small) == 4.0  # 0.05 x 4 = 0.2: no saturation
    large = dense + 0.5
    gain = difference_gain(dense, large)
    assert gain == 2.0 and (np.abs(dense - large) * gain).max() <= 1.0
    assert difference_gain(dense, dense + 1.0) == 1.0  # never below 1



@pytest.mark.parametrize("density", [0.5, 0.1])
def test_shipped_plans_hold_axis_profiles_and_serve_other_sizes(density):
    """The shipped plans are in the current format, with the axis profiles that derive masks for any size."""
    from paroattn import TokenLayout
    from paroattn.app.demo import shipped_plan_path
    from paroattn.plan import FORMAT_VERSION, Plan
    from paroattn.plan.shapes import derive_plan

    plan = Plan.load(shipped_plan_path(density))
    assert plan.format_version == FORMAT_VERSION and plan.profiles is not None
    assert plan.layout == TokenLayout(0, 8, 16, 16)  # calibrated at the model's 8 frames of 32 x 32 pixels
    derived = derive_plan(plan, TokenLayout(0, 4, 12, 12))
    assert derived.layout == TokenLayout(0, 4, 12, 12)
    assert abs(derived.achieved_density() - plan.achieved_density()) < 0.1
