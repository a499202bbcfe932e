"""The README's first example, `apply(pipe, "auto", density=0.3)`, runs as written on the demo pipeline folder
(`paro demo-pipeline DIR`) on a CPU: the first generation learns and caches the plan, the second runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paroattn import Plan

ROOT = Path(__file__).resolve().parents[1]

# the README's first example, word for word
SNIPPET = textwrap.dedent("""
    import paroattn
    from paroattn.demo_model.model import DemoVideoPipeline

    pipe = DemoVideoPipeline.from_pretrained("demo")   # `paro demo-pipeline demo` writes it, or any supported pipeline
    paroattn.apply(pipe, "auto", density=0.3)          # every self-attention layer runs PARO at 30% of the blocks
    prompt = "red circle moving left quickly, cloudy background"
    video = pipe(prompt, num_inference_steps=2).frames[0]   # first run: dense, learns the plan and caches it
    video = pipe(prompt, num_inference_steps=2).frames[0]   # every later run (and process): sparse
""")


@pytest.mark.slow
def test_the_readme_example_runs_on_the_demo_pipeline_folder(tmp_path):
    from paroattn.demo_model.pipeline import write_demo_pipeline

    write_demo_pipeline(tmp_path / "demo")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PAROATTN_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", SNIPPET], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no cached plan" in run.stderr and "cached it at" in run.stderr
    [entry] = (tmp_path / "cache").glob("*.safetensors")
    assert Plan.load(entry).info["learnt_by"] == "plan='auto'"
    again = subprocess.run([sys.executable, "-c", SNIPPET.replace("pipe(prompt", "0 and pipe(prompt")], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and f"cached plan {entry}" in again.stderr, again.stderr[-3000:]
