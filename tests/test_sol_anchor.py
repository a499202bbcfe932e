"""The Sol-Attn anchor of the attention benchmark: the exact-block density it reports follows Sol-Attn's routing
(top-k of the pooled query-block score plus the diagonal +-1), and the anchors table shows its columns. The quality
study's Sol-Attn processor runs a model's self-attention through Sol-Attn's eager reference (comfy-kitchen, which CI
does not install: those tests are skipped there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_forward_inputs, tiny_transformer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import attention  # noqa: E402
import sol_anchor  # noqa: E402


def routed_by_brute_force(q, k, ratio):
    """Sol-Attn's routing written out: each query's score against every key, averaged over the query block and over
    the key block (live rows only), the top-k key blocks per query block (ties kept) and the diagonal +-1."""
    B, T, H, D = q.shape
    n = -(-T // sol_anchor.BLOCK)
    scores = torch.einsum("bthd,bshd->bhts", q.double(), k.double())
    block = torch.arange(T) // sol_anchor.BLOCK
    pooled = torch.zeros(B, H, n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            pooled[:, :, i, j] = scores[:, :, block == i][:, :, :, block == j].mean(dim=(-1, -2))
    kept = sol_anchor.topk_count(n, ratio)
    exact = pooled >= pooled.topk(kept, dim=-1).values[..., -1:]
    index = torch.arange(n)
    exact |= (index.view(1, -1) - index.view(-1, 1)).abs() <= 1
    return exact


@pytest.mark.parametrize("T,ratio", [(64 * 9, 0.2), (64 * 7 + 13, 0.5), (64 * 12 + 1, 0.3)])
def test_exact_block_density_follows_the_routing(T, ratio):
    g = torch.Generator().manual_seed(T)
    q, k = (torch.randn(2, T, 3, 16, generator=g) for _ in range(2))
    expected = float(routed_by_brute_force(q, k, ratio).double().mean())
    assert sol_anchor.exact_block_density(q, k, ratio) == pytest.approx(expected, abs=1e-6)  # one block is >= 1/144
    # more than the top-k alone: the diagonal band is forced
    n = -(-T // sol_anchor.BLOCK)
    assert expected > sol_anchor.topk_count(n, ratio) / n


def test_topk_count_stays_within_one_and_all_but_one():
    assert sol_anchor.topk_count(10, 0.2) == 2
    assert sol_anchor.topk_count(10, 0.01) == 1
    assert sol_anchor.topk_count(10, 1.0) == 9
    assert sol_anchor.topk_count(1, 0.5) == 0


def test_anchor_table_shows_sol_attn_at_each_sparse_density():
    def row(method, density, ms, **extra):
        return {"shape": "wan2.1-1.3b", "B": 1, "H": 12, "N": 32760, "D": 128, "method": method, "density": density,
                "ms": ms, **extra}

    rows = [row("sdpa-default", 1.0, 10.0)]
    rows += [row("paro-int8-fp8", d, 10.0 / s) for d, s in ((1.0, 1.3), (0.5, 2.5), (0.2, 6.0))]
    rows += [row("sol-attn", 0.5, 10.0), row("sol-attn", 0.2, 5.0), row("sol-attn-notail", 0.2, 4.0)]
    table = attention.anchor_table({"gpu": "NVIDIA H200", "rows": rows})
    header = next(line for line in table.splitlines() if line.startswith("| model"))
    assert "Sol-Attn: d=0.5 / d=0.2 |" in header and "Sol-Attn, no tail: d=0.5 / d=0.2 |" in header
    line = next(line for line in table.splitlines() if line.startswith("| Wan2.1-1.3B"))
    assert "| 1.00x / 2.00x | not run / 2.50x |" in line
    assert "1.30x / 2.50x / 6.00x" in line


@pytest.mark.parametrize("ratio,tail", [(1.0, True), (0.2, False)])
def test_sol_attn_processor_on_two_blocks_is_the_models_own_attention(ratio, tail):
    """Two 64-token blocks are the diagonal +-1 that Sol-Attn always computes exactly: whatever the ratio and tail, the
    transformer's output is the dense model's (RoPE applied, heads and tokens where the reference reads them), and the
    processors it replaced are back afterwards."""
    pytest.importorskip("comfy_kitchen")
    transformer = tiny_transformer("wan")
    inputs = tiny_forward_inputs(transformer, frames=8, height=8, width=8)  # 8 x 4 x 4 = 128 tokens
    with torch.no_grad():
        dense = transformer(**inputs)[0]
        processor = sol_anchor.SolAttnProcessor(ratio, tail)
        with sol_anchor.installed(transformer, processor):
            sol = transformer(**inputs)[0]
        after = transformer(**inputs)[0]
    torch.testing.assert_close(sol, dense, rtol=1e-4, atol=1e-5)
    assert processor.densities == [1.0, 1.0]  # one call per layer, every block exact
    assert torch.equal(after, dense)


def test_sol_attn_processor_runs_the_reference_at_its_ratio_and_tail():
    """Past the diagonal band: the processor's [B, H, N, D] attention is the reference's (B, T, H, D) call at its
    ratio and tail, one batch entry at a time; it records the exact-block density of each call, and it is not dense."""
    pytest.importorskip("comfy_kitchen")
    from comfy_kitchen.backends.eager.sol_attn import sol_attn

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 64 * 8 + 5, 16, generator=g) for _ in range(3))  # [B, H, N, D]: 9 blocks
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    outputs = {}
    for tail in (True, False):
        processor = sol_anchor.SolAttnProcessor(0.25, tail)
        outputs[tail] = processor.attention(q, k, v)
        expected = sol_attn(*(t.transpose(1, 2) for t in (q, k, v)), topk_ratio=0.25, tail=tail).transpose(1, 2)
        torch.testing.assert_close(outputs[tail], expected)
        density = sol_anchor.exact_block_density(q.transpose(1, 2), k.transpose(1, 2), 0.25)
        assert processor.densities == [pytest.approx(density)] and 0.25 < density < 1.0
        assert float((outputs[tail] - dense).abs().max()) > 1e-2
    assert float((outputs[True] - outputs[False]).abs().max()) > 1e-2


def test_sol_attn_processor_refuses_a_ratio_outside_zero_to_one():
    pytest.importorskip("comfy_kitchen")
    for ratio in (0.0, 1.5):
        with pytest.raises(ValueError, match="top-k ratio must be in"):
            sol_anchor.SolAttnProcessor(ratio, tail=True)
