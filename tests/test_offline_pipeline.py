"""`paro demo-pipeline DIR`: the demo model as a diffusers pipeline folder, on which `paro calibrate`, `paro
inspect` and `paro generate --compare` run offline on a CPU, as the README shows (at a small size here)."""

from __future__ import annotations

import json
import stat

import pytest
import torch
from typer.testing import CliRunner

from paroattn.app.cli import app

SMALL = ["--height", "16", "--width", "16", "--frames", "2"]  # 2 x 8 x 8 = 128 tokens: seconds on a CPU
PROMPT = "red circle moving left quickly, cloudy background"


def invoke(args):
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_clean_failure(result, *fragments):
    """Exit code 2 and one line `error: ...` holding every fragment, no traceback."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[0], result.output


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("offline") / "demo-pipeline"
    result = invoke(["demo-pipeline", path])
    assert result.exit_code == 0, result.output
    assert f"wrote {path}" in result.output and "paro calibrate" in result.output
    return path


@pytest.mark.slow
def test_the_folder_is_a_diffusers_pipeline_of_the_shipped_model(folder):
    from paroattn.demo_model.model import ASSETS, DemoVideoPipeline
    from paroattn.demo_model.pipeline import PROMPTS_FILE

    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "DemoVideoPipeline"
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    for component in ("transformer", "text_encoder", "scheduler"):
        for shipped in (ASSETS / component).iterdir():
            copy = folder / component / shipped.name
            assert copy.read_bytes() == shipped.read_bytes(), copy
            assert stat.S_IMODE(copy.stat().st_mode) & 0o044 == 0o044  # readable by others, like any output
    prompts = [line for line in (folder / PROMPTS_FILE).read_text().splitlines() if not line.startswith("#")]
    pipe = DemoVideoPipeline.from_pretrained(folder)  # diffusers' own loader reads it
    pipe.text_encoder.tokenize(prompts)  # every calibration prompt is in the model's vocabulary


@pytest.mark.slow
def test_paro_commands_load_it_as_the_demo_runs_it(folder):
    """The folder generates exactly what `paro demo`'s pipeline generates from the same seed."""
    from paroattn.app.demo import sample
    from paroattn.app.generate import load_pipeline
    from paroattn.demo_model.model import load_demo_pipeline

    size = {"num_frames": 2, "height": 16, "width": 16}
    loaded, _ = sample(load_pipeline(folder, device="cpu"), [PROMPT], steps=2, seed=3, size=size)
    shipped, _ = sample(load_demo_pipeline(), [PROMPT], steps=2, seed=3, size=size)
    assert torch.equal(torch.from_numpy(loaded), torch.from_numpy(shipped))


@pytest.mark.slow
def test_calibrate_inspect_and_generate_run_on_it(folder, tmp_path):
    plan = tmp_path / "demo-d0.3.safetensors"
    result = invoke(["calibrate", folder, "--prompts", folder / "prompts.txt", "--out", plan, "--density", "0.3",
                     "--steps", "2", "--num-prompts", "1", "--device", "cpu", *SMALL])
    assert result.exit_code == 0, result.output
    assert "calibrating WanTransformer3DModel on 1 prompts, 2 steps" in result.output
    assert plan.is_file() and stat.S_IMODE(plan.stat().st_mode) == 0o644
    result = invoke(["inspect", plan])
    assert result.exit_code == 0, result.output
    assert "WanTransformer3DModel" in result.output
    out = tmp_path / "demo.gif"
    result = invoke(["generate", folder, "--plan", plan, "--prompt", PROMPT, "--steps", "2", "--compare", "--out", out,
                     "--device", "cpu", *SMALL])
    assert result.exit_code == 0, result.output
    assert out.is_file() and (tmp_path / "demo_dense.gif").is_file()
    # on a CPU the comparison says that the torch reference ran, not that PARO is fast or slow
    line = next(line for line in result.output.splitlines() if line.startswith("PARO vs dense"))
    assert "torch reference op" in line and "speedup" not in line


@pytest.mark.slow
def test_a_shipped_plan_runs_on_it_at_another_size(folder, tmp_path):
    """The shipped plans hold axis profiles: at a size they were not calibrated for they derive masks (once,
    with a one-line notice), instead of asking for a calibration."""
    from paroattn.app.demo import shipped_plan_path

    result = invoke(["generate", folder, "--plan", shipped_plan_path(0.5), "--prompt", PROMPT, "--steps", "1",
                     "--out", tmp_path / "x.gif", "--device", "cpu", *SMALL])
    assert result.exit_code == 0, result.output
    notices = [line for line in result.output.splitlines() if line.startswith("warning: ")]
    assert len(notices) == 1 and "derived from the 8x16x16 grid" in notices[0], result.output
    assert "Warning" not in result.output and ".py:" not in result.output  # no raw Python warning


@pytest.mark.parametrize("args, fragments", [
    (["--height", "17"], ["--height 17", "multiples of 2 pixels", "its patches are 2 pixels", "pass e.g. --height 16"]),
    (["--width", "130"], ["--width 130", "64 patches", "--width 128 or less"]),
    (["--frames", "65"], ["--frames 65", "--frames 64 or less"]),
])
def test_a_size_the_model_cannot_take_is_refused_before_it_loads(folder, tmp_path, monkeypatch, args, fragments):
    import paroattn.app.generate as generate
    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: pytest.fail("loaded the model"))
    result = invoke(["generate", folder, "--prompt", PROMPT, "--out", tmp_path / "x.gif", *args])
    assert_clean_failure(result, *fragments)
    result = invoke(["calibrate", folder, "--out", tmp_path / "p.safetensors", *args])
    assert_clean_failure(result, *fragments)
    assert list(tmp_path.iterdir()) == []


def test_it_refuses_a_folder_that_is_not_empty_and_leaves_nothing_when_interrupted(tmp_path, monkeypatch):
    import shutil

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("x")
    assert_clean_failure(invoke(["demo-pipeline", taken]), "not empty")
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    (tmp_path / "file").write_text("x")
    assert_clean_failure(invoke(["demo-pipeline", tmp_path / "file"]), "existing file")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copytree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        from paroattn.demo_model.pipeline import write_demo_pipeline

        write_demo_pipeline(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "taken"]


def test_a_plan_of_another_model_names_the_size_asked_for_and_the_folder(folder, tmp_path):
    from paroattn import Plan, TokenLayout

    plan = Plan.synthetic(layout=TokenLayout(0, 8, 16, 16), num_layers=8, num_heads=2, model_class="WanTransformer3DModel")
    plan.save(tmp_path / "other.safetensors")
    result = invoke(["generate", folder, "--plan", tmp_path / "other.safetensors", "--prompt", PROMPT, "--out",
                     tmp_path / "x.gif", "--device", "cpu", *SMALL])
    assert result.exit_code == 2, result.output
    error = next(line for line in result.output.splitlines() if line.startswith("error: "))
    assert "plan has 2 heads per layer; this model has 4" in error and "[" not in error
    assert f"`paro calibrate {folder} --height 16 --width 16 --frames 2 --out plan.safetensors`" in error
    assert not (tmp_path / "x.gif").exists()


@pytest.mark.slow
def test_calibrate_reads_the_folders_own_prompts_by_default(folder, tmp_path):
    from paroattn import Plan
    from paroattn.app.demo import CALIBRATION_PROMPTS

    plan = tmp_path / "p.safetensors"
    result = invoke(["calibrate", folder, "--out", plan, "--steps", "1", "--num-prompts", "1", "--device", "cpu", *SMALL])
    assert result.exit_code == 0, result.output
    assert Plan.load(plan).prompts == CALIBRATION_PROMPTS[:1]


def test_prompts_outside_the_vocabulary_are_refused_before_it_loads(folder, tmp_path, monkeypatch):
    import paroattn.app.generate as generate

    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: pytest.fail("loaded the model"))
    result = invoke(["generate", folder, "--prompt", "a cat surfing", "--out", tmp_path / "x.gif"])
    assert_clean_failure(result, "--prompt: prompt 'a cat surfing'", "['a', 'cat', 'surfing']", "prompts.txt")
    other = tmp_path / "prompts.txt"
    other.write_text("red circle moving left quickly\na dog\n")
    result = invoke(["calibrate", folder, "--out", tmp_path / "p.safetensors", "--prompts", other])
    assert_clean_failure(result, f"--prompts {other}", "'a dog'", str(folder / "prompts.txt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt"]
