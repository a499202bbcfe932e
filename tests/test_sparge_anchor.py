"""The SpargeAttn anchor of the attention benchmark: paro's masks (per head, on reordered tokens, 128 x 64 blocks or
others) become the 64 x 128 block map its sm90 kernel reads, and its attention on each head's reordered tokens, put back
in the original order, is paro's (the torch reference of what its kernel computes stands for the kernel: CI has no
GPU). The leaders table names the fastest peer per model and density."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from paroattn import paro_attention
from paroattn.layout import TokenLayout
from paroattn.masks import dense_mask_from_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import attention  # noqa: E402
import sparge_anchor  # noqa: E402

LAYOUT = TokenLayout(10, 4, 10, 15)  # 610 tokens: a text prefix, partial last blocks at 64 and 128


def random_mask(heads, nq, nk, density, seed):
    """bool [heads, nq, nk] with every row holding at least one block, as paro's masks do."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(heads, nq, nk, generator=g) < density
    mask[:, torch.arange(nq), torch.randint(0, nk, (nq,), generator=g)] = True
    return mask


def blocks_by_brute_force(mask, bq, bk, n):
    """Its 64 x 128 blocks that hold an active query-key pair of `mask`, read off the token-level mask."""
    tokens = dense_mask_from_blocks(mask, bq, bk, n)
    nq, nk = -(-n // 64), -(-n // 128)
    padded = torch.zeros(mask.shape[0], nq * 64, nk * 128, dtype=torch.bool)
    padded[:, :n, :n] = tokens
    return padded.view(-1, nq, 64, nk, 128).any(dim=4).any(dim=2)


@pytest.mark.parametrize("block", [(128, 64), (64, 64), (128, 128), (64, 128), (32, 64)])
@pytest.mark.parametrize("n", [610, 640, 704, 705])
def test_block_map_holds_exactly_the_blocks_with_an_active_pair(block, n):
    bq, bk = block
    mask = random_mask(3, -(-n // bq), -(-n // bk), 0.3, seed=n + bq + bk)
    block_map = sparge_anchor.from_paro_mask(mask, block, n, batch=2)
    assert block_map.dtype == torch.bool and block_map.is_contiguous()
    assert tuple(block_map.shape) == (2, 3, -(-n // 64), -(-n // 128))
    expected = blocks_by_brute_force(mask, bq, bk, n)
    assert torch.equal(block_map[0], expected) and torch.equal(block_map[1], expected)


def qkv_and_orders(B=2, H=3, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, LAYOUT.seq_len, D, generator=g) for _ in range(3))
    return q, k, v, torch.tensor([3, 0, 5])  # three heads in three orders


def test_its_attention_on_reordered_tokens_is_paros_where_key_blocks_pair_up():
    """A mask whose active 64-key blocks come in aligned pairs is exactly a map of its blocks: its attention (the
    reference of its kernel) on each head's reordered tokens, put back in the original order, is paro's call."""
    q, k, v, orders = qkv_and_orders()
    n = LAYOUT.seq_len
    pairs = random_mask(3, -(-n // 128), -(-n // 128), 0.4, seed=1)
    mask = pairs.repeat_interleave(2, dim=2)[:, :, :-(-n // 64)]
    expected = paro_attention(q, k, v, layout=LAYOUT, orders=orders, block_mask=mask, block_size=(128, 64),
                              backend="torch")
    block_map = sparge_anchor.from_paro_mask(mask, (128, 64), n, batch=2)
    out = sparge_anchor.on_reordered_tokens(sparge_anchor.reference, q, k, v, LAYOUT, orders, block_map)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the same map on the tokens in their original order computes something else: the orders matter here
    unordered = sparge_anchor.reference(q, k, v, block_map)
    assert (unordered - expected).abs().max() > 0.1


def test_its_attention_over_a_covering_map_is_paros_at_its_blocks():
    """Where paro's active key blocks do not pair up, the map covers more: its attention is paro's over the map itself
    (64 x 128 blocks), on the same reordered tokens, and holds every pair paro's mask holds."""
    q, k, v, orders = qkv_and_orders(seed=2)
    n = LAYOUT.seq_len
    mask = random_mask(3, -(-n // 128), -(-n // 64), 0.3, seed=3)
    block_map = sparge_anchor.from_paro_mask(mask, (128, 64), n, batch=2)
    assert float(block_map.float().mean()) > float(mask.float().mean())  # random halves: it covers more
    expected = paro_attention(q, k, v, layout=LAYOUT, orders=orders, block_mask=block_map[0], block_size=(64, 128),
                              backend="torch")
    out = sparge_anchor.on_reordered_tokens(sparge_anchor.reference, q, k, v, LAYOUT, orders, block_map)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_restore_undoes_reorder_per_head():
    x = torch.arange(2 * 3 * LAYOUT.seq_len, dtype=torch.float32).view(2, 3, LAYOUT.seq_len, 1)
    orders = torch.tensor([1, 4, 2])
    reordered = sparge_anchor.reorder(x, LAYOUT, orders)
    assert not torch.equal(reordered[:, 0], x[:, 0]) and torch.equal(reordered[:, :, :10], x[:, :, :10])  # prefix
    assert torch.equal(sparge_anchor.restore(reordered, LAYOUT, orders), x)


def test_reference_rows_without_a_block_are_zero_and_maps_of_other_shapes_are_refused():
    q, k, v, _ = qkv_and_orders(B=1, H=1)
    block_map = torch.zeros(1, 1, 10, 5, dtype=torch.bool)
    block_map[0, 0, 1:] = True
    out = sparge_anchor.reference(q, k, v, block_map)
    assert torch.equal(out[0, 0, :64], torch.zeros(64, 16)) and out[0, 0, 64:].abs().sum() > 0
    with pytest.raises(ValueError, match=r"\[1, 1, 10, 5\], got \[1, 1, 5, 10\]"):
        sparge_anchor.reference(q, k, v, block_map.view(1, 1, 5, 10))


def test_block_map_refuses_a_mask_of_other_blocks():
    mask = torch.ones(3, 10, 5, dtype=torch.bool)  # 64 x 128 blocks over 610 tokens, passed as 128 x 64
    with pytest.raises(ValueError, match=r"128 x 64 blocks over 610 tokens has 5 x 10 blocks per head, got \(10, 5\)"):
        sparge_anchor.from_paro_mask(mask, (128, 64), 610, batch=1)
    with pytest.raises(ValueError, match="must be bool"):
        sparge_anchor.from_paro_mask(mask.int(), (64, 128), 610, batch=1)


def test_the_binding_serves_the_entry_its_call_uses():
    """Its call (spas_sage_attn/core.py) runs `_qattn.<ENTRY>` on sm90: the generated binding defines that name, and
    each head dim's source instantiates its kernel at 64 x 128 tiles with bf16 output."""
    assert f'm.def("{sparge_anchor.ENTRY}", &attention);' in sparge_anchor._BINDING
    for hd in sparge_anchor.HEAD_DIMS:
        source = sparge_anchor._INSTANCE.format(hd=hd)
        assert f"void sparge_sm90_hd{hd}(" in source
        assert f"SpargeAttentionSM90Dispatched<64, 128, 128, {hd}, 1, 1, nv_bfloat16, false, true, false>" in source


def row(shape, method, density, ms, **extra):
    return {"shape": shape, "B": 1, "H": 12, "N": 32760, "D": 128, "method": method, "density": density, "ms": ms,
            **extra}


def test_leaders_table_names_the_fastest_peer_per_model_and_density():
    rows = [row("wan2.1-1.3b", m, d, ms, **extra) for m, d, ms, extra in [
        ("sdpa-default", 1.0, 12.0, {}), ("fa3-bf16", 1.0, 9.0, {}), ("fa3-fp8", 1.0, 7.0, {}),
        ("sage2-sm90", 1.0, 8.0, {}), ("sage2-sm90-kernel", 1.0, 6.0, {}),
        ("paro-auto-int8-fp8", 1.0, 7.7, {}), ("paro-auto-int8-fp8", 0.5, 4.0, {}),
        ("paro-auto-int8-fp8", 0.2, 2.0, {}),
        ("sol-attn", 0.5, 5.0, {}), ("sol-attn-notail", 0.5, 4.5, {}), ("sol-attn", 0.2, None, {}),
        ("sparge-sm90", 1.0, 7.8, {"mask_density": 1.0}), ("sparge-sm90", 0.5, 5.5, {"mask_density": 0.71}),
        ("sparge-sm90-own", 0.5, 3.6, {"mask_density": 0.5}), ("sparge-sm90", 0.2, 3.0, {"mask_density": 0.3}),
        ("sparge-sm90-own", 0.2, 2.2, {"mask_density": 0.2})]]
    rows += [row("cogvideox-5b", "sdpa-default", 1.0, 18.0), row("cogvideox-5b", "paro-auto-int8-fp8", 1.0, 14.0),
             row("cogvideox-5b", "sol-attn", 0.5, None, unsupported=True)]
    text = attention.leader_table({"gpu": "NVIDIA H200", "rows": rows})
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert header == ["model", "d", "cuDNN", "FA3", "SageAttention2", "Sol-Attn", "SpargeAttn", "PARO", "leads"]
    table = {(cells[0], cells[1]): dict(zip(header, cells))
             for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in lines[1:])}
    dense = table["Wan2.1-1.3B", "1"]
    assert dense["FA3"] == "7.00 ms (FP8)" and dense["SageAttention2"] == "8.00 ms"  # whole call, not the kernel
    assert dense["Sol-Attn"] == "-" and dense["SpargeAttn"] == "7.80 ms (paro's mask)"
    assert dense["leads"] == "FA3 (FP8), 1.10x ahead of PARO"
    half = table["Wan2.1-1.3B", "0.5"]
    assert half["cuDNN"] == "12.00 ms" and half["Sol-Attn"] == "4.50 ms (no tail)"  # dense peers stand at every d
    assert half["SpargeAttn"] == "3.60 ms (own mask)" and half["leads"] == "SpargeAttn (own mask), 1.11x ahead of PARO"
    fifth = table["Wan2.1-1.3B", "0.2"]
    assert fifth["Sol-Attn"] == "failed" and fifth["leads"] == "PARO, 1.10x ahead of SpargeAttn (own mask)"
    cog = table["CogVideoX-5B", "1"]
    assert cog["Sol-Attn"] == "n/a" and cog["FA3"] == "not run" and cog["leads"] == "PARO, 1.29x ahead of cuDNN"


def test_leaders_table_shows_how_much_of_its_grid_spargeattn_covers_for_paros_mask():
    rows = [row("flux.1-dev", "sdpa-default", 1.0, 0.4), row("flux.1-dev", "paro-auto-int8-fp8", 0.5, 0.3),
            row("flux.1-dev", "sparge-sm90", 0.5, 0.25, mask_density=0.68)]
    text = attention.leader_table({"gpu": "NVIDIA H200", "rows": rows})
    assert "| 0.250 ms (paro's mask, 0.68 of its blocks) |" in text


def test_anchor_table_shows_spargeattn_over_paros_mask_and_its_own():
    rows = [row("wan2.1-1.3b", "sdpa-default", 1.0, 10.0)]
    rows += [row("wan2.1-1.3b", "paro-int8-fp8", d, 10.0 / s) for d, s in ((1.0, 1.3), (0.5, 2.5))]
    rows += [row("wan2.1-1.3b", "sparge-sm90", 1.0, 8.0), row("wan2.1-1.3b", "sparge-sm90", 0.5, 5.0),
             row("wan2.1-1.3b", "sparge-sm90-own", 0.5, 4.0)]
    table = attention.anchor_table({"gpu": "NVIDIA H200", "rows": rows})
    header = next(line for line in table.splitlines() if line.startswith("| model"))
    assert "SpargeAttn, paro's mask: d=1 / d=0.5 |" in header and "SpargeAttn, own mask: d=0.5 |" in header
    line = next(line for line in table.splitlines() if line.startswith("| Wan2.1-1.3B"))
    assert "| 1.25x / 2.00x | 2.50x |" in line


def test_benchmark_refuses_a_sparge_folder_without_its_source_and_leaders_without_a_file(tmp_path, capsys):
    for args, fragment in [(["--sparge", str(tmp_path)], "thu-ml/SpargeAttn"),
                           (["--leaders"], "--leaders goes with --table")]:
        with pytest.raises(SystemExit) as exit_info:
            attention.parse_arguments(args)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and fragment in err, err


@pytest.mark.parametrize("density", [1.0, 0.4])
def test_benchmark_rows_time_its_call_over_paros_mask_and_its_own(monkeypatch, density):
    """The benchmark's SpargeAttn rows on the CPU: the reference stands for its call, paro's torch reference for its
    Triton kernel, the host for the GPU. Over paro's mask the row records the fraction of its blocks that covers, over
    its own the row's density; each distance to the same attention on the same reordered tokens is ~0."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    monkeypatch.setattr(attention, "paro_attention",
                        lambda *args, **kwargs: paro_attention(*args, **{**kwargs, "backend": "torch"}))
    q, k, v, orders = qkv_and_orders(B=1, seed=4)
    n = LAYOUT.seq_len
    mask = attention.synthetic_block_mask(3, -(-n // 128), -(-n // 64), density,
                                          generator=torch.Generator().manual_seed(5))
    rows = []

    def record(method, density, ms, error=None, **extra):
        rows.append({"method": method, "density": density, "ms": ms, "error": error, **extra})
        return rows[-1]

    def timer(fn, sets, warmup, rep):
        fn(*sets[0])
        return 1.0

    anchor = sparge_anchor.Sparge(package=None)
    monkeypatch.setattr(anchor, "whole_call", sparge_anchor.reference)
    attention._time_sparge(record, timer, anchor, [(q, k, v)], LAYOUT, orders, mask, (128, 64), density, 2.0, 1, 1)
    methods = ["sparge-sm90"] + (["sparge-sm90-own"] if density < 1.0 else [])
    assert [r["method"] for r in rows] == methods and all(r["ms"] == 1.0 and not r["error"] for r in rows)
    covered = float(sparge_anchor.from_paro_mask(mask, (128, 64), n, 1).float().mean())
    assert rows[0]["mask_density"] == pytest.approx(covered) and rows[0]["speedup_vs_sdpa"] == 2.0
    if density < 1.0:
        assert covered > density + 0.05 and abs(rows[1]["mask_density"] - density) < 0.1
    assert all(r["rel_err_vs_reference"] < 1e-5 for r in rows), rows
