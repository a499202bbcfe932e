"""The benchmark scripts run end to end on CPU (`--smoke` / `--tiny`: shrunk models, torch backend, one process)
and their tables read back what they wrote, so a change to the library or a script that breaks it shows here and
not first on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str, script: str = "multi_gpu.py") -> subprocess.CompletedProcess:
    # a process of its own: the multi-GPU smoke run patches torch.accelerator's device count for diffusers
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


@pytest.mark.slow
def test_multi_gpu_smoke_run_writes_rows_its_table_reads(tmp_path):
    out = tmp_path / "multi.json"
    result = run_script("--smoke", "--modes", "paro d=0.2 int8+fp8 balanced", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # the smoke model: Wan2.1-1.3B's blocks shrunk (every family's exchange is tests/test_context_parallel.py's)
    models = ["Wan2.1-1.3B 480p (smoke)"]
    assert [(r["model"], r["mode"]) for r in rows] == [(m, mode) for m in models
                                                       for mode in ("dense", "paro d=0.2 int8+fp8 balanced")]
    assert all(r["gpus"] == 1 and r["scaling"] == 1.0 for r in rows)
    assert rows[0]["speedup_vs_dense"] == 1.0
    table = run_script("--table", str(out)).stdout
    assert "| paro d=0.2 int8+fp8 balanced |" in table and "multi.json" in table and "head densities spread" in table


@pytest.mark.slow
def test_multi_gpu_compares_with_one_gpu_outputs_saved_by_another_run(tmp_path):
    # one process saves its outputs and times; two processes (gloo) read both instead of running one GPU again
    modes, saved = "paro d=0.2 int8+fp8,paro d=0.2 int8+fp8 balanced", tmp_path / "outputs"
    one = run_script("--smoke", "--iters", "1", "--modes", modes, "--outputs", str(saved), "--out",
                     str(tmp_path / "one.json"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert len(list(saved.glob("*.pt"))) == 3
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(ROOT / "benchmarks" / "multi_gpu.py"), "--smoke", "--iters", "1", "--modes", modes,
                          "--outputs", str(saved), "--baseline", str(tmp_path / "one.json"), "--out",
                          str(tmp_path / "two.json")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert two.returncode == 0, two.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads((tmp_path / "two.json").read_text())["rows"]}
    one_rows = {r["mode"]: r for r in json.loads((tmp_path / "one.json").read_text())["rows"]}
    assert {mode: r["step_s_1gpu"] for mode, r in rows.items()} == {m: r["step_s"] for m, r in one_rows.items()}
    # the same step in fp32 on two processes: equal to the saved one; the balanced plan was balanced for one GPU
    # there and for two here, so it is not compared
    assert rows["dense"]["check_max_abs"] < 1e-5 and rows["paro d=0.2 int8+fp8"]["check_max_abs"] < 1e-5
    assert "check_max_abs" not in rows["paro d=0.2 int8+fp8 balanced"]


@pytest.mark.slow
def test_multi_gpu_refuses_an_unknown_mode():
    result = run_script("--smoke", "--modes", "d=0.3")
    assert result.returncode != 0 and "--modes d=0.3: expected some of dense" in result.stderr


@pytest.mark.slow
def test_e2e_regional_compile_rows_match_eager(tmp_path):
    """--compile regional (each block compiled on its own, as diffusers' compile_repeated_blocks does), dense and PARO
    on the shrunk Wan with inductor: each row's output within 1e-4 of its eager run."""
    out = tmp_path / "regional.json"
    result = run_script("--smoke", "--compile", "regional", "--iters", "1", "--json", str(out), script="e2e.py")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r["mode"], r["compile"]): r for r in json.loads(out.read_text())["rows"]}
    for mode in ("dense", "paro d=0.2 int8+fp8"):
        assert rows[(mode, "regional")]["max_error_vs_eager"] < 1e-4 and "error" not in rows[(mode, "regional")]


@pytest.mark.slow
def test_e2e_smoke_run_writes_rows_its_table_reads(tmp_path):
    out = tmp_path / "e2e.json"
    result = run_script("--smoke", "--iters", "1", "--modes", "dense,paro d=0.2 int8+fp8", "--resident-only",
                        "--json", str(out), script="e2e.py")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["mode"], r["masks"]) for r in rows] == [
        ("shrunk Wan (smoke)", "dense", "-"), ("shrunk Wan (smoke)", "paro d=0.2 int8+fp8", "resident")]
    assert all(r["step_s"] > 0 for r in rows) and rows[0]["speedup"] == 1.0
    table = run_script("--table", str(out), script="e2e.py").stdout
    assert "| shrunk Wan (smoke) (192, 1) |" in table and "e2e.json" in table


@pytest.mark.slow
def test_calibration_cost_tiny_run_measures_both_models(tmp_path):
    out = tmp_path / "cost.json"
    result = run_script("--tiny", "--steps", "2", "--prompts", "1", "--out", str(out), script="calibration_cost.py")
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(out.read_text())["results"]
    # the full-size builders shrunk: CogVideoX keeps its text before the grid, Wan has none
    assert [(r["model"], r["layers"], r["layout"]) for r in records] == [
        ("tiny-cogvideox", 2, "8 + 3x8x8"), ("tiny-wan", 2, "3x8x8")]
    for r in records:
        assert 0 < r["achieved_density"] < 1 and r["extrapolated"]["transformer_calls"] == 2 * r["calls_per_step"]


@pytest.mark.slow
def test_first_generation_tiny_run_learns_then_runs_sparse_through_the_pipelines(tmp_path):
    out = tmp_path / "first.json"
    result = run_script("--tiny", "--calibrate", "--out", str(out), script="first_generation.py")
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(out.read_text())["results"]
    assert [r["model"] for r in records] == ["wan2.1-1.3b", "cogvideox-5b"]
    for r in records:
        # the learning generation is the dense one, the plan is written, the next two run it
        assert r["learnt"] and r["learning_output_max_abs_diff_vs_dense"] == 0.0 and r["captured_layer_calls"] > 0
        assert len(r["sparse_s"]) == 2 and r["plan"]["buckets"] == 6 and 0 < r["plan"]["achieved_density"] < 1
        assert r["learning_options"]["calls"] == "all" and r["calibrate"]["seconds"] > 0
        assert r["calibrate_options"]["keep_orders"] == 2  # paro calibrate's own capture, not the full one
        # the host memory timelines: sampled through each phase, the peak one of the samples
        for timeline, peak in ((r["host_timeline"], r["host_rss_peak_at"]),
                               (r["calibrate"]["host_timeline"], r["calibrate"]["host_rss_peak_at"])):
            assert timeline and all(gb > 0 for _, gb in timeline) and peak in [list(s) for s in timeline]
        assert "learnt a plan at density 0.2" in r["log"][-1]


@pytest.mark.slow
def test_multi_gpu_models_are_models_the_step_benchmark_builds():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e
    import multi_gpu
    import pytest
    import torch

    assert {key for key, _ in multi_gpu.MODELS.values()} <= set(e2e.CONFIGS)
    # a name without step inputs of its own is refused, never handed another model's inputs
    with pytest.raises(ValueError, match="no step inputs for model 'wan-14b'"):
        e2e.step_inputs("wan-14b", None, "cpu", torch.float32, smoke=False)


@pytest.mark.slow
def test_demo_model_balance_quality_runs_balanced_plans(tmp_path):
    out = tmp_path / "balance.jsonl"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo_model_balance_quality.py"), "--densities",
                             "0.2", "--gpus", "2", "--eval-prompts", "1", "--steps", "1", "--seeds", "0",
                             "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=600,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["density"], r["gpus"]) for r in rows] == [(0.2, 1), (0.2, 2)]
    # the shipped plan's slices differ in blocks, so balancing moves blocks and the video changes
    assert rows[1]["block_imbalance_unbalanced"] > 0.05
    assert rows[0]["psnr_db"] != rows[1]["psnr_db"]


@pytest.mark.slow
def test_multi_gpu_table_script_smoke_run(tmp_path):
    # the phases of the 4-GPU table with the shrunk Wan: one process, then two (gloo), compared with the first
    env = {**os.environ, "OUT": str(tmp_path), "SMOKE": "1"}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "multi_gpu_table.sh")], capture_output=True, text=True,
                            timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = {r["mode"]: r for r in json.loads((tmp_path / "two-a.json").read_text())["rows"]}
    assert rows["dense"]["gpus"] == 2 and rows["dense"]["check_max_abs"] == 0.0
    assert rows["paro d=0.2 int8+fp8"]["check_max_abs"] == 0.0
    assert "| paro d=0.2 int8+fp8 balanced |" in result.stdout


@pytest.mark.slow
def test_work_tree_hash_names_the_commit_whose_files_ran(tmp_path, monkeypatch):
    """The environment of a results file on a machine whose git metadata lags the synced files: the tree hash of
    the files on disk is the tree of the commit that holds them, and changes with any file, untracked ones too."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attention

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "kernel.py").write_text("a = 1\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    monkeypatch.setattr(attention, "REPO", tmp_path)
    assert attention.work_tree_hash() == git("rev-parse", "HEAD^{tree}")
    (tmp_path / "kernel.py").write_text("a = 2\n")
    (tmp_path / "new.py").write_text("b = 1\n")
    changed = attention.work_tree_hash()
    assert changed != git("rev-parse", "HEAD^{tree}")
    git("add", "-A")
    git("commit", "-qm", "two")
    assert changed == git("rev-parse", "HEAD^{tree}")


@pytest.mark.slow
def test_multi_gpu_table_script_fails_when_a_run_fails(tmp_path):
    # its runs go to the background and to a log: a failed one must still fail the script, and say where to look
    env = {**os.environ, "OUT": str(tmp_path), "SMOKE": "1", "MODELS": "no-such-model"}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "multi_gpu_table.sh")], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 1
    assert "one-0.json failed: see" in result.stderr and "two-a.json failed: see" in result.stderr
