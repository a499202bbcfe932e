"""The multi-GPU benchmark script runs end to end on CPU (`--smoke`: tiny Wan, CogVideoX and HunyuanVideo, torch backend,
one process) and its table reads back what it wrote, so a change to the library or the script that breaks it shows
here and not first on a machine with several GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str) -> subprocess.CompletedProcess:
    # a process of its own: the smoke run patches torch.accelerator's device count for diffusers
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def test_multi_gpu_smoke_run_writes_rows_its_table_reads(tmp_path):
    out = tmp_path / "multi.json"
    result = run_script("--smoke", "--modes", "paro d=0.2 int8+fp8 balanced", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # the smoke models: Wan (no text), CogVideoX (text before the video) and HunyuanVideo (text after it, padded)
    models = ["Wan2.1-1.3B 480p (smoke)", "CogVideoX-5B (smoke)", "HunyuanVideo 720p (smoke)"]
    assert [(r["model"], r["mode"]) for r in rows] == [(m, mode) for m in models
                                                       for mode in ("dense", "paro d=0.2 int8+fp8 balanced")]
    assert all(r["gpus"] == 1 and r["scaling"] == 1.0 for r in rows)
    assert rows[0]["speedup_vs_dense"] == 1.0
    table = run_script("--table", str(out)).stdout
    assert "| paro d=0.2 int8+fp8 balanced |" in table and "multi.json" in table and "head densities spread" in table


def test_multi_gpu_refuses_an_unknown_mode():
    result = run_script("--smoke", "--modes", "d=0.3")
    assert result.returncode != 0 and "--modes d=0.3: expected some of dense" in result.stderr
