"""`benchmarks/multi_gpu.py --check` compares each mode on N GPUs with the same plan on one GPU: the balanced mode's
plan balanced over N on both sides, the pipelined mode's over N x G (on one GPU without an exchange). Checked on the
CPU with two gloo processes and the shrunk Wan with 4 heads (2 per process, so the pipelined mode has 2 groups)."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BALANCED, PIPELINED = "paro d=0.2 int8+fp8 balanced", "paro d=0.2 int8+fp8 pipelined"


def multi_gpu():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import multi_gpu

    return multi_gpu


def test_each_mode_is_balanced_the_same_on_one_gpu_and_on_n():
    mode_balance = multi_gpu().mode_balance
    assert mode_balance(False, False, 40, 4) == (1, 1)
    assert mode_balance(True, False, 40, 4) == (4, 1)
    assert mode_balance(True, True, 40, 4) == (8, 2)  # 10 heads per GPU: 2 groups of 5
    assert mode_balance(True, True, 40, 2, given=4) == (8, 4)


def test_the_one_gpu_runs_of_the_balanced_and_pipelined_modes_are_different_plans():
    """What the check once compared the pipelined mode with (the balanced mode's one-GPU output) is another plan's
    output: the two differ, so only a one-GPU run of the pipelined plan itself can confirm its exchange."""
    mg = multi_gpu()
    torch.manual_seed(0)
    transformer, inputs = mg.build("wan-1.3b", torch.device("cpu"), torch.float32, smoke=True, smoke_heads=4)
    layout = mg.family_of(transformer).call_inputs(transformer, inputs).layout
    args = Namespace(modes={"dense", BALANCED, PIPELINED}, pipeline_groups=None, iters=1, check=True, outputs=None,
                     head_spread=0.35, query_block=16)
    rows = mg.run_modes(transformer, inputs, layout, args, torch.device("cpu"), (16, 16), "torch", 1, None, {}, 2)
    assert rows[BALANCED][0]["balanced_for"] == 2 and rows[PIPELINED][0]["balanced_for"] == 4
    assert (rows[BALANCED][1] - rows[PIPELINED][1]).abs().max() > 1e-4


@pytest.mark.slow
def test_check_on_two_processes_compares_every_mode_with_the_same_plan_on_one(tmp_path):
    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             str(ROOT / "benchmarks" / "multi_gpu.py"), "--smoke", "--smoke-heads", "4", "--iters", "1",
                             "--check", "--modes", f"{BALANCED},{PIPELINED}", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[PIPELINED]["exchange_groups"] == 2 and rows[PIPELINED]["balanced_for"] == 4
    assert rows[BALANCED]["balanced_for"] == 2
    for mode in ("dense", BALANCED, PIPELINED):
        assert rows[mode]["check_max_abs"] < 1e-5, (mode, rows[mode])
