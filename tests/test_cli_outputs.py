"""Commands never replace a user's file unless asked (--overwrite), siblings included; outputs and their siblings
are written under temporary names and renamed together, so a write that is stopped or killed leaves the earlier
files as they were; `inspect --png` reads a stats file from the plan's folder only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli_errors import assert_clean_failure, files_under, invoke, saved_tiny_flux

from paroattn import Plan, TokenLayout
from paroattn.files import replace_problem, written_together


def no_model_loads(monkeypatch):
    import paroattn.app.generate as generate
    import paroattn.demo_model.model as demo_model

    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(demo_model, "load_demo_pipeline", lambda *a, **k: pytest.fail("loaded the demo model"))


def contents(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in files_under(folder) if p.is_file()}


# -- the helpers ---------------------------------------------------------------------------------------

def test_written_together_renames_every_file_only_when_all_are_written(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("old a")
    b.write_text("old b")
    with pytest.raises(KeyboardInterrupt):
        with written_together(a, b) as (pa, pb):
            pa.write_text("new a")
            raise KeyboardInterrupt  # stopped before b is written
    assert (a.read_text(), b.read_text()) == ("old a", "old b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]  # no partial file left
    with written_together(a, b) as (pa, pb):
        assert pa.parent == tmp_path and pa.suffix == ".txt" and pa.name.startswith(".")
        pa.write_text("new a")
        pb.write_text("new b")
        assert (a.read_text(), b.read_text()) == ("old a", "old b")  # not before the end
    assert (a.read_text(), b.read_text()) == ("new a", "new b")


def test_a_killed_write_leaves_the_earlier_files_whole(tmp_path):
    plan, stats = tmp_path / "mine.safetensors", tmp_path / "mine.stats.safetensors"
    plan.write_bytes(b"earlier plan")
    stats.write_bytes(b"earlier stats")
    script = (f"import os, signal\nfrom paroattn.files import written_together\n"
              f"with written_together({str(stats)!r}, {str(plan)!r}) as (s, p):\n"
              f"    s.write_bytes(b'new stats')\n    p.write_bytes(b'half a pl')\n"
              f"    os.kill(os.getpid(), signal.SIGKILL)\n")
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(Path.cwd())},
                            capture_output=True, timeout=120)
    assert result.returncode == -9, result.stderr
    assert plan.read_bytes() == b"earlier plan" and stats.read_bytes() == b"earlier stats"


def test_replace_problem_names_the_first_existing_file_and_the_flag(tmp_path):
    assert replace_problem([tmp_path / "a", tmp_path / "b"], "--out") is None
    (tmp_path / "b").write_text("x")
    problem = replace_problem([tmp_path / "a", tmp_path / "b"], "--out")
    assert problem.startswith(f"--out: {tmp_path / 'b'} exists") and "--overwrite" in problem


# -- paro calibrate ----------------------------------------------------------------------------------

@pytest.mark.parametrize("existing", ["mine.safetensors", "mine.stats.safetensors"])
def test_calibrate_refuses_an_existing_plan_or_its_stats_file(tmp_path, monkeypatch, existing):
    saved_tiny_flux(tmp_path)
    no_model_loads(monkeypatch)
    (tmp_path / existing).write_bytes(b"the user's")
    before = contents(tmp_path)
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "mine.safetensors"])
    assert_clean_failure(result, f"{tmp_path / existing} exists", "--overwrite")
    assert contents(tmp_path) == before


def test_calibrate_refuses_an_existing_expert_sibling_once_the_experts_are_known(tmp_path, monkeypatch):
    import paroattn.calibrate.driver as driver
    import paroattn.pipelines as pipelines

    saved_tiny_flux(tmp_path)
    monkeypatch.setattr(pipelines, "pipeline_experts",
                        lambda pipe: [("transformer", pipe.transformer), ("transformer_2", pipe.transformer)])
    monkeypatch.setattr(driver, "calibrate_sizes", lambda *a, **k: pytest.fail("captured"))
    (tmp_path / "mine.transformer_2.stats.safetensors").write_bytes(b"the user's")
    result = invoke(["calibrate", tmp_path / "model", "--out", tmp_path / "mine.safetensors"])
    assert result.exit_code == 2 and "mine.transformer_2.stats.safetensors exists" in result.output, result.output
    assert (tmp_path / "mine.transformer_2.stats.safetensors").read_bytes() == b"the user's"


def calibration(plan: Plan):
    from paroattn.calibrate.accumulate import CalibrationResult

    shape = plan.block_mask.shape[:3]
    fields = {name: None for name in CalibrationResult.__dataclass_fields__}
    fields.update(kept_mass=torch.ones(shape), scores=torch.zeros(plan.num_layers, plan.num_heads, 6),
                  candidate_orders=list(range(6)), figure_layers=[0], figure_original=None, figure_reordered=None)
    return CalibrationResult(**fields)


def test_save_calibration_stopped_midway_leaves_the_earlier_plan_and_stats(tmp_path, monkeypatch):
    from paroattn.calibrate.driver import save_calibration

    plan = Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=2, num_heads=2, density=0.5, num_buckets=1,
                          block_size=16)
    path = tmp_path / "mine.safetensors"
    save_calibration(plan, calibration(plan), path)
    before = contents(tmp_path)
    assert sorted(p.name for p in before) == ["mine.safetensors", "mine.stats.safetensors"]

    def interrupted(self, target):
        raise KeyboardInterrupt  # after the stats file was written, before the plan

    monkeypatch.setattr(Plan, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_calibration(plan, calibration(plan), path)
    assert contents(tmp_path) == before  # and no partial file beside them
    monkeypatch.undo()
    save_calibration(Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=2, num_heads=2, density=0.25,
                                    num_buckets=1, block_size=16), calibration(plan), path)
    assert Plan.load(path).target_density == 0.25
    assert Plan.load(path).info["stats_file"]["name"] == "mine.stats.safetensors"  # the final name, not a partial


# -- paro generate -----------------------------------------------------------------------------------

def test_generate_compare_refuses_an_existing_dense_twin(tmp_path, monkeypatch):
    saved_tiny_flux(tmp_path)
    no_model_loads(monkeypatch)
    (tmp_path / "clip_dense.png").write_bytes(b"the user's")
    result = invoke(["generate", tmp_path / "model", "--prompt", "a cat", "--plan", tmp_path / "plan.safetensors",
                     "--compare", "--out", tmp_path / "clip.png"])
    assert_clean_failure(result, "clip_dense.png exists", "--overwrite")
    assert (tmp_path / "clip_dense.png").read_bytes() == b"the user's" and not (tmp_path / "clip.png").exists()


def test_generate_refuses_an_existing_out_and_replaces_it_with_overwrite(tmp_path):
    saved_tiny_flux(tmp_path)
    out = tmp_path / "x.png"
    out.write_bytes(b"the user's")
    args = ["generate", tmp_path / "model", "--prompt", "a cat", "--steps", "1", "--out", out]
    assert_clean_failure(invoke(args), "x.png exists", "--overwrite")
    assert out.read_bytes() == b"the user's"
    result = invoke([*args, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_generate_stopped_while_writing_leaves_both_earlier_outputs(tmp_path, monkeypatch):
    import numpy as np

    import paroattn.app.generate as generation

    out, dense = tmp_path / "clip.gif", tmp_path / "clip_dense.gif"
    out.write_bytes(b"earlier paro")
    dense.write_bytes(b"earlier dense")
    write = generation._write
    calls = []

    def stopped_after_one(pixels, path, video, fps):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return write(pixels, path, video, fps)

    monkeypatch.setattr(generation, "_write", stopped_after_one)
    frames = np.zeros((2, 4, 4, 3), np.float32)
    with pytest.raises(KeyboardInterrupt):
        with generation._written_together(out, dense):
            generation._write(frames, out, True, 8)
            generation._write(frames, dense, True, 8)
    assert out.read_bytes() == b"earlier paro" and dense.read_bytes() == b"earlier dense"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.gif", "clip_dense.gif"]


# -- paro demo ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("earlier", ["demo.gif", "metrics.json", "attention/layer000_head000.png"])
def test_demo_refuses_a_folder_holding_an_earlier_run(tmp_path, monkeypatch, earlier):
    no_model_loads(monkeypatch)
    out = tmp_path / "existing"
    (out / earlier).parent.mkdir(parents=True)
    (out / earlier).write_bytes(b"the user's")
    result = invoke(["demo", "--out-dir", out, "--device", "cpu"])
    assert_clean_failure(result, "--out-dir", earlier.split("/")[-1], "--overwrite")
    assert contents(out) == {Path(earlier): b"the user's"}


def test_demo_overwrite_runs_into_a_folder_of_an_earlier_run(tmp_path, monkeypatch):
    import paroattn.app.demo as demo

    out = tmp_path / "existing"
    out.mkdir()
    (out / "demo.gif").write_bytes(b"earlier")
    ran = []
    monkeypatch.setattr(demo, "_run_demo", lambda folder, **kwargs: ran.append(folder) or {})
    result = invoke(["demo", "--out-dir", out, "--device", "cpu", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert ran == [out]


# -- paro inspect --png ----------------------------------------------------------------------------

def plan_with_stats(folder: Path, recorded: dict) -> Path:

    folder.mkdir(parents=True, exist_ok=True)
    plan = Plan.synthetic(layout=TokenLayout(0, 2, 4, 4), num_layers=2, num_heads=2, density=0.5, num_buckets=1,
                          block_size=16)
    plan.info["stats_file"] = recorded
    plan.save(folder / "plan.safetensors")
    return folder / "plan.safetensors"


def stats_file(path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"figure_layers": torch.tensor([0]), "figure_original": torch.rand(1, 2, 2, 2),
               "figure_reordered": torch.rand(1, 2, 2, 2)}, str(path))
    return path


def test_inspect_png_refuses_pictures_of_an_earlier_run_unless_overwrite(tmp_path):
    plan = plan_with_stats(tmp_path / "p", {"name": "plan.stats.safetensors"})
    png = tmp_path / "png"
    png.mkdir()
    (png / "layer000_head001.png").write_bytes(b"the user's")
    result = invoke(["inspect", plan, "--png", png])
    assert_clean_failure(result, "layer000_head001.png exists", "--overwrite")
    assert contents(png) == {Path("layer000_head001.png"): b"the user's"}
    result = invoke(["inspect", plan, "--png", png, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert (png / "layer000_head001.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in png.iterdir()) == ["layer000_head000.png", "layer000_head001.png"]


@pytest.mark.parametrize("recorded", [
    {"name": "../elsewhere/secret.stats.safetensors"},
    {"name": "secret.stats.safetensors", "path": "ELSEWHERE"},
    {"name": "/abs/ELSEWHERE"},
])
def test_inspect_png_reads_no_stats_file_outside_the_plans_folder(tmp_path, monkeypatch, recorded):
    from paroattn.calibrate import figures

    secret = stats_file(tmp_path / "elsewhere" / "secret.stats.safetensors")
    recorded = {key: str(secret) if "ELSEWHERE" in value else value for key, value in recorded.items()}
    plan = plan_with_stats(tmp_path / "p", recorded)
    opened = []
    load = __import__("safetensors.torch", fromlist=["load_file"]).load_file
    monkeypatch.setattr("safetensors.torch.load_file", lambda path, *a: opened.append(path) or load(path, *a))
    assert figures.load_stats(Plan.load(plan), plan_path=plan) is None
    assert opened == []
    # the same name beside the plan is read
    stats_file(tmp_path / "p" / "secret.stats.safetensors")
    assert figures.load_stats(Plan.load(plan), plan_path=plan) is not None
    assert opened == [str(tmp_path / "p" / "secret.stats.safetensors")]


# -- paro bench --out --------------------------------------------------------------------------------

def test_bench_refuses_an_existing_results_file(tmp_path):
    out = tmp_path / "results.json"
    out.write_text("{}")
    result = invoke(["bench", "--out", out])
    assert_clean_failure(result, "results.json exists", "--overwrite")
    assert out.read_text() == "{}"
