"""`benchmarks/comfyui_step.py --smoke`: every graph of the GPU benchmark (dense, Apply PARO with a plan, comfy-kitchen's
Sol-Attn, plan 'auto' learning and the run after it) on both of its models, 2-layer, on the CPU, in a process of
its own (ComfyUI starts once per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "comfyui_step.py"
STEPS = 3  # --smoke's
MODELS = {"wan2.1-1.3b": ("WanTransformer3DModel", 2), "hunyuan-video1.5": ("HunyuanVideo15Transformer3DModel", 2)}


@pytest.mark.slow
def test_the_step_benchmark_runs_every_graph_of_both_models_and_says_what_ran(comfy, tmp_path):
    import comfy_kitchen

    # ComfyUI 0.30.0 pins comfy-kitchen 0.2.26, which has no sol_attn: there the sol graphs are left out
    sol = hasattr(comfy_kitchen, "sol_attn")
    runs = "dense,paro,sol,auto" if sol else "dense,paro,auto"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--runs", runs, "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [path] = tmp_path.glob("*.json")
    assert path.name == ("comfyui-step-wan2.1-1.3b-hunyuan-video1.5-d0.2-bf16bf16-torch" + ("-sol0.2" if sol else "")
                         + "-auto-cpu-smoke.json")
    results = json.loads(path.read_text())
    assert results["comfyui"] == "0.30.0"
    for name, (diffusers_class, layers) in MODELS.items():
        model = results["models"][name]
        graphs = model["runs"]
        assert list(graphs) == ["warmup", "dense", "paro", *(["sol"] if sol else []), "auto_learn", "auto_next"]
        for run, record in graphs.items():
            assert "error" not in record, (name, run, record["error"])
            assert len(record["step_s"]) == (1 if run == "warmup" else STEPS)
            assert record["batch"] == [2] * len(record["step_s"])  # cond and uncond in one call per step
        summary = model["summary"]
        assert all(summary["finite_latent"].values())
        # the learning run is the dense model's, call for call; the runs with a plan are not
        assert summary["max_abs_vs_dense"]["auto_learn"] == 0.0
        assert summary["max_abs_vs_dense"]["paro"] > 1e-3 and summary["max_abs_vs_dense"]["auto_next"] > 1e-3
        assert graphs["paro"]["apply_paro"].startswith(f"PARO on: {diffusers_class}: {layers} layers")
        assert graphs["auto_learn"]["apply_paro"].startswith("PARO learns: no cached plan")
        assert graphs["auto_next"]["apply_paro"].startswith("PARO on: cached plan")
        # each model learns into a plan cache of its own, empty before
        [entry] = graphs["auto_learn"]["cache_entries"]
        assert entry.startswith(f"{diffusers_class}_") and graphs["auto_learn"]["learnt_plan"]["layout"] == model["tokens"]
        if sol:
            # one Sol-Attn call per self-attention call (each layer, each step); cross-attention stays ComfyUI's
            assert graphs["sol"]["sol_calls"] == STEPS * layers
    table = subprocess.run([sys.executable, str(SCRIPT), "--table", str(path)], capture_output=True, text=True,
                           check=True).stdout
    assert "| hunyuan-video1.5 | auto_next | 3 |" in table and "| wan2.1-1.3b | dense | 3 |" in table
