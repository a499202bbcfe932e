"""`paro demo` end to end at a small setting (one prompt, two steps), and its argument checks."""

from __future__ import annotations

import json

import imageio.v2 as imageio
import numpy as np
from typer.testing import CliRunner

from paroattn.cli import app
from paroattn.demo_model.demo import LABEL_HEIGHT, difference_gain, side_by_side


def test_demo_writes_gif_pictures_and_metrics(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--out-dir", str(tmp_path), "--steps", "2", "--num-prompts", "1",
                                      "--density", "0.5", "--qk", "int8", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "plan: paroattn/demo_model/assets/plans/d0.50.safetensors" in result.output
    report = json.loads((tmp_path / "metrics.json").read_text())
    assert report["qk"] == "int8" and abs(report["density"] - 0.5) < 0.01
    metrics = report["metrics"]
    # a d=0.5 plan changes the video, but little: it must neither equal dense nor be unrelated to it
    assert 15.0 < metrics["psnr_db"] < 80.0, metrics
    assert 0.9 < metrics["cosine"] < 1.0 and 0.3 < metrics["ssim"] <= 1.0, metrics
    assert report["dense_time"]["attention_s"] > 0 and report["paro_time"]["attention_s"] > 0
    frames = imageio.mimread(tmp_path / "demo.gif")
    assert len(frames) == 8
    # a band of column labels over dense | PARO | difference, 4x
    assert frames[0].shape[:2] == (LABEL_HEIGHT + 32 * 4, 3 * 32 * 4 + 2 * 2)
    band = np.asarray(frames[0])[:LABEL_HEIGHT, :, :3]
    for column in range(3):
        assert band[:, column * 130:column * 130 + 128].min() < 100  # text in each column's label
    assert 110 <= imageio.get_reader(tmp_path / "demo.gif").get_meta_data()["duration"] <= 130  # ms per frame
    assert "|dense - PARO| x" in result.output and report["gif_difference_gain"] <= 4
    # step bars of both passes
    assert "dense: 100%" in result.output and f"PARO d={report['density']:.2f}: 100%" in result.output
    pictures = sorted((tmp_path / "attention").glob("*.png"))
    assert len(pictures) == 5
    assert f"PSNR {metrics['psnr_db']:.2f} dB" in result.output
    assert "PARO vs dense by density on this model (qk=bf16 pv=bf16, 8 held-out prompts x 2 seeds" in result.output
    assert "d=0.5: 44.9 dB / SSIM 0.997" in result.output and "d=0.3: 28.2 dB" in result.output


def test_demo_defaults_are_a_shipped_plan_measured_close_to_dense():
    """The default density has a shipped plan, and the shipped quality summary measured it at SSIM >= 0.9
    vs dense with the default precisions; the CLI's defaults are the demo's."""
    import inspect

    from paroattn.cli import demo as cli_demo
    from paroattn.demo_model import demo

    assert demo.shipped_plan_path(demo.DEFAULT_DENSITY).is_file()
    summary = json.loads(demo.QUALITY_SUMMARY.read_text())
    assert (summary["qk"], summary["pv"]) == (demo.DEFAULT_QK, demo.DEFAULT_PV)
    assert summary["by_density"][f"{demo.DEFAULT_DENSITY:.2f}"]["ssim"] >= 0.9
    assert set(summary["by_density"]) >= {f"{d:.2f}" for d in demo.SHIPPED_DENSITIES if d > 0.2}
    cli = {name: p.default.default for name, p in inspect.signature(cli_demo).parameters.items()}
    assert (cli["density"], cli["qk"], cli["pv"]) == (demo.DEFAULT_DENSITY, demo.DEFAULT_QK, demo.DEFAULT_PV)
    run = inspect.signature(demo.run_demo).parameters
    assert (run["density"].default, run["qk"].default, run["pv"].default) == (0.5, "bf16", "bf16")


def test_density_cost_line_reads_the_summary(tmp_path):
    from paroattn.demo_model.demo import density_cost_line

    assert density_cost_line(tmp_path / "missing.json") is None
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"device": "GPU X", "qk": "int8", "pv": "fp8", "eval_prompts": 3, "seeds": [0],
                                "by_density": {"0.70": {"psnr_db": 31.04, "ssim": 0.951},
                                               "0.30": {"psnr_db": 20.0, "ssim": 0.7}}}))
    assert density_cost_line(path) == ("PARO vs dense by density on this model (qk=int8 pv=fp8, 3 held-out prompts "
                                       "x 1 seeds, GPU X): d=0.7: 31.0 dB / SSIM 0.951, d=0.3: 20.0 dB / SSIM 0.700; "
                                       "QUALITY.md")


def test_demo_calibrates_a_density_that_was_not_shipped(tmp_path, capsys):
    from paroattn.demo_model.demo import run_demo
    from paroattn.plan import Plan

    lines = []
    report = run_demo(tmp_path, density=0.4, steps=1, num_prompts=1, calibration_steps=2, device="cpu",
                      log=lines.append, progress=True)
    assert any("no shipped plan for density 0.4" in line for line in lines)
    shown = capsys.readouterr()
    assert "layers" in shown.out + shown.err and "2/2" in shown.out + shown.err  # the calibration's bars
    plan = Plan.load(tmp_path / "plan.safetensors")
    assert abs(plan.achieved_density() - 0.4) < 0.01 and abs(report["density"] - 0.4) < 0.01
    assert (tmp_path / "plan.stats.safetensors").is_file()
    assert len(list((tmp_path / "attention").glob("*.png"))) == 5


def test_demo_rejects_unknown_precision(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--out-dir", str(tmp_path), "--qk", "int3"])
    assert result.exit_code == 2
    assert "qk='int3' is not one of ('bf16', 'int8', 'int4')" in result.output


def test_side_by_side_layout():
    a = np.zeros((2, 4, 4, 3), np.float32)
    b = np.ones((2, 4, 4, 3), np.float32)
    frames = side_by_side([[a, b], [b, a]], scale=2, gap=1)
    assert len(frames) == 2 and frames[0].shape == (2 * 8 + 1, 2 * 8 + 1, 3)
    assert frames[0][0, 0].tolist() == [0, 0, 0] and frames[0][0, -1].tolist() == [255, 255, 255]


def test_side_by_side_labels_each_column():
    a = np.zeros((1, 8, 8, 3), np.float32)
    frames = side_by_side([[a, a]], scale=4, gap=2, labels=["dense", "PARO"])
    assert frames[0].shape == (LABEL_HEIGHT + 32, 2 * 32 + 2, 3)
    band = frames[0][:LABEL_HEIGHT]
    assert band[:, :32].min() < 100 and band[:, 34:].min() < 100 and band.max() == 255


def test_difference_gain_keeps_the_panel_below_white():
    dense = np.zeros((1, 2, 8, 8, 3), np.float32)
    small = dense + 0.05
    assert difference_gain(dense, small) == 4.0  # 0.05 x 4 = 0.2: no saturation
    large = dense + 0.5
    gain = difference_gain(dense, large)
    assert gain == 2.0 and (np.abs(dense - large) * gain).max() <= 1.0
    assert difference_gain(dense, dense + 1.0) == 1.0  # never below 1
