"""The Sol-Attn anchor of the attention benchmark: the exact-block density it reports follows Sol-Attn's routing
(top-k of the pooled query-block score plus the diagonal +-1), and the anchors table shows its columns."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

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
