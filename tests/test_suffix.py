"""Tokens after the grid (HunyuanVideo's text, `TokenLayout.suffix`) and their key padding mask
(`suffix_mask`), against attention built from first principles: each grid token's (f, h, w) sorted by
the head's order, prefix and suffix kept in place, the block mask expanded through that permutation and
the padded suffix keys removed for every query.

Suffix lengths that are not multiples of the block size put grid and text tokens in one block; query
blocks whose active key blocks hold padding only output zeros. The Triton kernels (interpreter on CPU)
take a suffix (`test_kernels.py`) and its suffix_mask (`test_key_mask.py`).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from paroattn import PAROInputError, TokenLayout, paro_attention
from paroattn.kernels import reference
from paroattn.layout import ORDERS, inverse_index, reorder_index

ATOL = RTOL = 1e-5
BLOCK = 16


def grid_permutation(layout: TokenLayout, order: str) -> list[int]:
    """Original position of each reordered position, written out independently of paroattn.layout."""
    coords = list(itertools.product(range(layout.frames), range(layout.height), range(layout.width)))
    axis = {"F": 0, "H": 1, "W": 2}
    ranked = sorted(range(len(coords)), key=lambda i: tuple(coords[i][axis[a]] for a in order))
    grid_end = layout.prefix + len(coords)
    return (list(range(layout.prefix)) + [layout.prefix + i for i in ranked]
            + list(range(grid_end, grid_end + layout.suffix)))


def first_principles(q, k, v, layout, orders, block_mask, bq, bk, suffix_mask=None):
    B, H, N, D = q.shape
    out = torch.zeros_like(q)
    valid = torch.ones(B, N, dtype=torch.bool)
    if suffix_mask is not None:
        valid[:, N - layout.suffix:] = suffix_mask
    for h in range(H):
        permutation = grid_permutation(layout, ORDERS[int(orders[h])])
        position = torch.empty(N, dtype=torch.long)
        position[torch.tensor(permutation)] = torch.arange(N)
        allowed = block_mask[h][position[:, None] // bq, position[None, :] // bk]  # [N, N], original order
        for b in range(B):
            keep = allowed & valid[b][None, :]
            scores = (q[b, h] @ k[b, h].T) / math.sqrt(D)
            p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
            out[b, h] = torch.where(keep.any(-1, keepdim=True), torch.nan_to_num(p) @ v[b, h], 0.0)
    return out


@pytest.fixture(params=["fused", "loop"])
def reference_path(request, monkeypatch):
    if request.param == "loop":
        monkeypatch.setattr(reference, "_SDPA_MASK_ELEMENTS", 0)
    return request.param


def random_mask(H, n_q, n_k, g, density=0.45):
    eye = torch.zeros(n_q, n_k, dtype=torch.bool)
    eye[torch.arange(n_q), (torch.arange(n_q) * n_k) // n_q] = True
    return (torch.rand(H, n_q, n_k, generator=g) < density) | eye


# suffix lengths 5, 19, 37 with 16-token blocks: grid and text share blocks; with and without a prefix
SUFFIX_LAYOUTS = [TokenLayout(0, 2, 3, 5, suffix=5), TokenLayout(0, 3, 4, 3, suffix=19),
                  TokenLayout(7, 2, 3, 4, suffix=37)]


def test_layout_with_a_suffix():
    layout = TokenLayout(3, 2, 3, 4, suffix=6)
    assert layout.seq_len == 3 + 24 + 6 and str(layout) == "3 + 2x3x4 + 6"
    assert TokenLayout(*layout.fields) == layout
    for order in range(len(ORDERS)):
        index = reorder_index(layout, order)
        assert index.tolist() == grid_permutation(layout, ORDERS[order])
        assert torch.equal(index[inverse_index(index)], torch.arange(layout.seq_len))
    with pytest.raises(ValueError, match="suffix"):
        TokenLayout(0, 1, 2, 2, suffix=-1)


@pytest.mark.parametrize("layout", SUFFIX_LAYOUTS, ids=str)
@pytest.mark.parametrize("padded", [False, True])
def test_reference_with_a_suffix_equals_first_principles(layout, padded, reference_path):
    g = torch.Generator().manual_seed(layout.suffix)
    H, N = len(ORDERS), layout.seq_len
    n = -(-N // BLOCK)
    mask = random_mask(H, n, n, g)
    orders = torch.arange(H)
    q, k, v = (torch.randn(2, H, N, 16, generator=g) for _ in range(3))
    suffix_mask = None
    if padded:  # item 0 keeps its first 3 suffix tokens, item 1 every other one
        suffix_mask = torch.zeros(2, layout.suffix, dtype=torch.bool)
        suffix_mask[0, :3] = True
        suffix_mask[1, ::2] = True
    expected = first_principles(q, k, v, layout, orders, mask, BLOCK, BLOCK, suffix_mask)
    out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=mask, block_size=BLOCK, backend="torch",
                         suffix_mask=suffix_mask)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    if padded:  # the padding is seen: without the mask the result moves
        unmasked = first_principles(q, k, v, layout, orders, mask, BLOCK, BLOCK)
        assert (unmasked - expected).abs().max() > 1e-3
        # padded keys and values do not matter at all
        pad = ~torch.cat([torch.ones(2, N - layout.suffix, dtype=torch.bool), suffix_mask], dim=1)
        k2, v2 = k.clone(), v.clone()
        k2[pad[:, None, :, None].expand_as(k2)] = 1e3
        v2[pad[:, None, :, None].expand_as(v2)] = -7.0
        again = paro_attention(q, k2, v2, layout=layout, orders=orders, block_mask=mask, block_size=BLOCK,
                               backend="torch", suffix_mask=suffix_mask)
        torch.testing.assert_close(again, out, atol=ATOL, rtol=RTOL)


def test_query_blocks_that_see_only_padding_output_zeros(reference_path):
    """A query block whose only active key block is the last one, all padding: zeros, never NaN; the
    other rows as first principles say. Also a batch item whose whole suffix is padding."""
    layout = TokenLayout(0, 2, 2, 4, suffix=16)  # 16 grid tokens, then one block of 16 text tokens
    H, N = 2, layout.seq_len
    g = torch.Generator().manual_seed(0)
    mask = torch.eye(2, dtype=torch.bool).repeat(H, 1, 1)
    mask[0, 0, 1] = True  # head 0: grid queries also attend the text block
    suffix_mask = torch.tensor([[False] * 16, [True] * 5 + [False] * 11])
    q, k, v = (torch.randn(2, H, N, 16, generator=g) for _ in range(3))
    for qk, pv in (("bf16", "bf16"), ("int8", "fp8")):
        out = paro_attention(q, k, v, layout=layout, orders=torch.tensor([0, 3]), block_mask=mask, block_size=BLOCK,
                             backend="torch", qk=qk, pv=pv, suffix_mask=suffix_mask)
        assert torch.isfinite(out).all()
        assert torch.equal(out[0, :, 16:], torch.zeros_like(out[0, :, 16:]))  # item 0: text rows see padding only
        assert out[1, :, 16:].abs().amin(dim=-1).gt(0).any()  # item 1: 5 real text keys
    expected = first_principles(q, k, v, layout, torch.tensor([0, 3]), mask, BLOCK, BLOCK, suffix_mask)
    out = paro_attention(q, k, v, layout=layout, orders=torch.tensor([0, 3]), block_mask=mask, block_size=BLOCK,
                         backend="torch", suffix_mask=suffix_mask)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_suffix_mask_is_checked():
    layout = TokenLayout(0, 1, 2, 8, suffix=5)
    q = torch.randn(2, 1, layout.seq_len, 16)
    kwargs = dict(layout=layout, orders=torch.tensor([0]), block_mask=torch.ones(1, 2, 2, dtype=torch.bool),
                  block_size=BLOCK, backend="torch")
    with pytest.raises(PAROInputError, match=r"bool \[B, layout.suffix\] = \[2, 5\].*got torch.int64 \(2, 5\)"):
        paro_attention(q, q, q, suffix_mask=torch.ones(2, 5, dtype=torch.long), **kwargs)
    with pytest.raises(PAROInputError, match=r"\[2, 5\].*got torch.bool \(2, 4\)"):
        paro_attention(q, q, q, suffix_mask=torch.ones(2, 4, dtype=torch.bool), **kwargs)
    no_suffix = TokenLayout(0, 1, 3, 7)
    with pytest.raises(PAROInputError, match="has no suffix"):
        paro_attention(q, q, q, **{**kwargs, "layout": no_suffix}, suffix_mask=torch.ones(2, 5, dtype=torch.bool))


def test_calibrated_masks_keep_every_block_that_holds_suffix_text():
    from paroattn.plan.selection import build_masks, forced_blocks

    layout = TokenLayout(0, 2, 3, 4, suffix=21)  # 45 tokens: text from token 24, in blocks 1 and 2
    n = -(-layout.seq_len // BLOCK)
    forced = forced_blocks(n, 0, BLOCK, suffix=layout.suffix, seq_len=layout.seq_len)
    expected = torch.eye(n, dtype=torch.bool)
    expected[1:, :] = expected[:, 1:] = True
    assert torch.equal(forced, expected)
    masks = build_masks(torch.rand(1, 2, n, n), 0.1, 0, BLOCK, suffix=layout.suffix, seq_len=layout.seq_len)
    assert masks[:, :, 1:, :].all() and masks[:, :, :, 1:].all()


def test_a_plan_with_a_suffix_round_trips(tmp_path):
    from paroattn import Plan

    layout = TokenLayout(0, 2, 3, 4, suffix=21)
    plan = Plan.synthetic(layout=layout, num_layers=2, num_heads=2, density=0.5, block_size=BLOCK)
    plan.save(tmp_path / "p.safetensors")
    assert Plan.load(tmp_path / "p.safetensors").layout == layout
    assert plan.mask_blocks == (3, 3)


def test_inspect_summary_names_the_suffix_and_the_expert():
    from paroattn import Plan
    from paroattn.plan.summary import describe_plan

    plan = Plan.synthetic(layout=TokenLayout(0, 2, 3, 4, suffix=21), num_layers=1, num_heads=2, density=0.5,
                          block_size=BLOCK)
    plan.expert = "transformer_2"
    text = describe_plan(plan)
    assert "2x3x4 + 21  (45 tokens, prefix 0, suffix 21)" in text and "expert transformer_2" in text
