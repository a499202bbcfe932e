"""benchmarks/quant_error.py: its smoke run works, and its "current" variants are the reference op's
quantization bit for bit (so the study fails loudly if the reference's grid changes without it)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import paroattn.kernels.reference as reference
from paroattn.layout import TokenLayout

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("quant_error", ROOT / "benchmarks" / "quant_error.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _problem(bench, rotary: bool):
    # text prefix, random orders, sparse mask, a partial last block, channel offsets in K
    layout = TokenLayout(5, 3, 4, 6)
    problem = bench.gaussian_problem(64, layout, 3, k_offset=2.0, v_offset=1.0, sparse=True, seed=1)
    if rotary:
        angles = torch.rand(layout.grid_tokens, 32, generator=torch.Generator().manual_seed(2)) * 6.3
        problem["rotary"] = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    return problem


@pytest.mark.parametrize("rotary", [False, True])
def test_current_variants_are_the_reference_bit_for_bit(bench, rotary):
    bench.check_against_reference(_problem(bench, rotary))


_QUANTIZE_PER_BLOCK = reference.quantize_per_block


def _per_half_block(x, block, qmax):
    # scales per half block: a finer grid than the kernels'
    return _QUANTIZE_PER_BLOCK(x, block // 2, qmax)


@pytest.mark.parametrize("target,replacement", [
    ("fake_quantize_p", lambda p, pv: p if pv == "bf16" else (p * 240.0).to(torch.float8_e4m3fn).float() / 240.0),
    ("fake_quantize_v", lambda v, pv: v if pv == "bf16" else v.to(torch.float8_e4m3fn).float()),
    ("quantize_per_block", _per_half_block),
])
def test_a_change_of_the_reference_grid_fails_the_check(bench, monkeypatch, target, replacement):
    monkeypatch.setattr(reference, target, replacement)
    with pytest.raises(AssertionError, match="differs from paro_attention_reference"):
        bench.check_against_reference(_problem(bench, False))


def test_group_quantization_per_block_is_the_references(bench):
    x = torch.randn(2, 150, 64) * torch.rand(1, 150, 1) * 3
    values, scale = bench.quantize_groups(x, "block", 64, 127.0)
    ref_values, ref_scale = reference.quantize_per_block(x, 64, 127.0)
    assert torch.equal(values, ref_values)
    assert torch.equal(scale, ref_scale.repeat_interleave(64, dim=1)[:, :150])
    # finer groups: every group's max lands on the grid's end, and the error shrinks
    token_values, token_scale = bench.quantize_groups(x, "token", 64, 127.0)
    assert torch.equal(token_values.abs().amax(dim=2), torch.full((2, 150), 127.0))
    assert (token_values * token_scale[..., None] - x).norm() < 0.8 * (values * scale[..., None] - x).norm()
    ids, count = bench.group_ids(128, "thread", 64)
    assert count == 8 and ids[:10].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0] and ids[64] == 4


@pytest.mark.slow
def test_smoke_run_writes_json_and_table(bench, tmp_path, capsys):
    out = tmp_path / "quant-error.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    errors = {case["case"]: case["errors"] for case in results["cases"]}
    gaussian = errors["Gaussian"]
    assert set(gaussian) == {label for _, label, _ in bench.VARIANTS}
    # int8 QK + fp8 PV on unit Gaussians is e4m3's precision (a few percent); exact PV and int8 QK is below it
    assert 0.01 < gaussian["int8 QK + fp8 PV (current)"] < 0.1
    assert gaussian["int8 QK, per block (current)"] < gaussian["fp8 P and V (current)"]
    # a K channel offset hurts only without smoothing
    offset = errors["Gaussian, K channel offset"]
    assert offset["int8 QK, K not smoothed"] > 1.5 * offset["int8 QK, per block (current)"]
    capsys.readouterr()
    assert bench.main(["--table", str(out)]) == 0
    assert "| int8 QK + fp8 PV (current) |" in capsys.readouterr().out
