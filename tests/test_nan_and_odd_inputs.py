"""NaN inputs and odd arguments of `paro_attention`.

NaN: the rule of the op's docstring ("NaN" paragraph), computed here independently of the op
(`expected_nan`), is what every backend gives, in every dtype and mode; outputs no NaN reaches are those
of the same call without the NaN. One call per mode holds four NaN placements, one per (batch, head),
the op's statistics being per (batch, head):
- (0, 0): q at one token;
- (0, 1): k at token 0, which K smoothing's mean samples (integer QK: the whole head);
- (1, 0): k at a token the mean's sample skips (integer QK: the rows attending its key block);
- (1, 1): v at one (token, channel), and q at a token of a query block with no active key block.
Head 1 has a query block with no active key block: its rows stay zero whatever reaches the head.
With K's scales per key (k_scale="token") a NaN key reaches the rows attending it rather than its block: the same
rows here, where no key is padding (tests/test_sm90_kernel.py has the padded key that tells them apart).
"""

from __future__ import annotations

import pytest
import torch

from paroattn import PAROInputError, TokenLayout, paro_attention
from paroattn.kernels import reference
from paroattn.layout import reorder_index
from paroattn.masks import dense_mask_from_blocks, synthetic_block_mask

MODES = [(qk, pv) for qk in ("bf16", "int8", "int4") for pv in ("bf16", "fp8", "int8")]
PER_KEY_MODES = [("int8", "fp8", "token"), ("int4", "bf16", "token")]  # (qk, pv, k_scale)
LAYOUT = TokenLayout(2, 2, 4, 4)  # 34 tokens: the last blocks are partial
B, H, D = 2, 2, 64
ORDERS = torch.tensor([0, 3])
STRIDE = 3  # K smoothing's mean over tokens 0, 3, 6, ... (fixture below)
EMPTY_BLOCK = 1  # head 1's query block with no active key block
UNSAMPLED_KEY = 4  # a token the mean's sample skips (4 % STRIDE != 0)


@pytest.fixture(autouse=True)
def _strided_key_mean(monkeypatch):
    """The mean's sample takes >= 8 tokens, so 34 tokens take stride 3 and both kinds of key exist (the
    stride is cached per length and frame: cleared on both sides)."""
    monkeypatch.setattr(reference, "MIN_K_MEAN_SAMPLES", 8)
    reference.key_mean_stride.cache_clear()
    assert reference.key_mean_stride(LAYOUT.seq_len, LAYOUT.height, LAYOUT.width) == STRIDE
    yield
    reference.key_mean_stride.cache_clear()


def _mask(block: int) -> torch.Tensor:
    n = -(-LAYOUT.seq_len // block)
    mask = synthetic_block_mask(H, n, n, 0.5, generator=torch.Generator().manual_seed(1))
    mask[1, EMPTY_BLOCK] = False
    assert not mask.all(dim=-1).all()  # some rows skip some key blocks
    return mask


def _inputs(dtype, block, device="cpu"):
    """(clean q, k, v; the same with the NaN placements of the module docstring)."""
    g = torch.Generator().manual_seed(0)
    clean = [torch.randn(B, H, LAYOUT.seq_len, D, generator=g).to(dtype).to(device) for _ in range(3)]
    q, k, v = (t.clone() for t in clean)
    nan = float("nan")
    q[0, 0, 20, 7] = nan
    k[0, 1, 0, 5] = nan
    k[1, 0, UNSAMPLED_KEY, 9] = nan
    v[1, 1, 11, 13] = nan
    q[1, 1, int(reorder_index(LAYOUT, int(ORDERS[1]))[EMPTY_BLOCK * block]), 2] = nan
    return clean, (q, k, v)


def expected_nan(q, k, v, mask, bq, bk, qk, pv, k_scale="block") -> torch.Tensor:
    """bool [B, H, N, D]: the outputs the docstring's NaN rule makes NaN."""
    n = LAYOUT.seq_len
    q_nan, k_nan, v_nan = (torch.isnan(t.cpu()) for t in (q, k, v))
    out = torch.zeros(B, H, n, D, dtype=torch.bool)
    for h in range(H):
        index = reorder_index(LAYOUT, int(ORDERS[h]))  # reordered position -> original token
        allowed = dense_mask_from_blocks(mask[h], bq, bk, n)  # [n, n], reordered
        q_row = q_nan[:, h, index].any(-1)  # [B, n]
        k_row = k_nan[:, h, index].any(-1)
        v_h = v_nan[:, h, index]  # [B, n, D]
        if qk == "bf16":
            reached_q, reached_k = q_row, k_row
        else:  # per-block scales (K's per key with k_scale="token"); a NaN in the mean's sample reaches every key
            q_blocks = torch.arange(n) // bq
            reached_q = torch.stack([q_row[:, q_blocks == q_blocks[r]].any(-1) for r in range(n)], dim=1)
            k_blocks = torch.arange(n) // bk if k_scale == "block" else torch.arange(n)
            reached_k = torch.stack([k_row[:, k_blocks == k_blocks[r]].any(-1) for r in range(n)], dim=1)
            reached_k |= k_nan[:, h, ::STRIDE].any(dim=(-1, -2))[:, None]
        row = reached_q | (allowed[None] & reached_k[:, None, :]).any(-1)  # [B, n]
        if pv == "bf16":
            channel = (allowed[None, :, :, None] & v_h[:, None, :, :]).any(2)  # [B, n, D]
        else:  # per-channel scales of V over every token
            channel = v_h.any(1, keepdim=True).expand(B, n, D)
        nonempty = allowed.any(-1)[None, :, None]
        out[:, h, index] = (row[..., None] | channel) & nonempty
    return out


def _check(out, clean_out, expected):
    nan = torch.isnan(out).cpu()
    assert torch.equal(nan, expected), (
        f"NaN at {int((nan & ~expected).sum())} outputs the rule keeps finite, "
        f"finite at {int((expected & ~nan).sum())} it makes NaN"
    )
    torch.testing.assert_close(out.cpu()[~expected], clean_out.cpu()[~expected], atol=1e-6, rtol=1e-5)


def test_the_placements_cover_each_case():
    """The four placements reach what the module docstring says they do, so the tests below see each case."""
    clean, (q, k, v) = _inputs(torch.float32, 16)
    mask = _mask(16)
    bf16, integer = expected_nan(q, k, v, mask, 16, 16, "bf16", "bf16"), expected_nan(q, k, v, mask, 16, 16, "int8", "int8")
    assert bf16[1, 1].any(-1).sum() < integer[1, 1].any(-1).sum()  # v: its key's rows, or the channel everywhere
    empty_rows = reorder_index(LAYOUT, int(ORDERS[1]))[EMPTY_BLOCK * 16:(EMPTY_BLOCK + 1) * 16]
    assert not integer[:, 1, empty_rows].any()
    nonempty = torch.ones(LAYOUT.seq_len, dtype=torch.bool)
    nonempty[empty_rows] = False
    assert integer[0, 1, nonempty].all() and not bf16[0, 1].all(-1).all()  # the sampled key
    # the unsampled key: the rows attending its block, not the whole head (the same rows in both modes)
    assert torch.equal(integer[1, 0].all(-1), bf16[1, 0].all(-1)) and 0 < bf16[1, 0].all(-1).sum() < LAYOUT.seq_len
    assert bf16[0, 0].all(-1).sum() == 1 < integer[0, 0].all(-1).sum()  # q: its row, or its block's rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("qk", "pv", "k_scale"), [(qk, pv, "block") for qk, pv in MODES] + PER_KEY_MODES)
def test_torch_backend_propagates_nan_by_the_rule(dtype, qk, pv, k_scale):
    mask = _mask(16)
    clean, nan_inputs = _inputs(dtype, 16)
    args = dict(layout=LAYOUT, orders=ORDERS, block_mask=mask, block_size=16, qk=qk, pv=pv, backend="torch",
                k_scale=k_scale)
    out = paro_attention(*nan_inputs, **args)
    _check(out, paro_attention(*clean, **args), expected_nan(*nan_inputs, mask, 16, 16, qk, pv, k_scale))


@pytest.mark.parametrize("fused", [True, False])
def test_float32_unquantized_paths_agree_on_nan(fused, monkeypatch):
    """float32 without quantization takes one masked SDPA call for small masks: NaN in q stays in it, NaN
    in k or v goes through the loop (SDPA's additive mask would carry it to every row)."""
    if not fused:
        monkeypatch.setattr(reference, "_SDPA_MASK_ELEMENTS", 0)
    mask = _mask(16)
    clean, (q, k, v) = _inputs(torch.float32, 16)
    args = dict(layout=LAYOUT, orders=ORDERS, block_mask=mask, block_size=16, backend="torch")
    for inputs in ((q, *clean[1:]), (clean[0], k, clean[2]), (*clean[:2], v)):
        _check(paro_attention(*inputs, **args), paro_attention(*clean, **args),
               expected_nan(*inputs, mask, 16, 16, "bf16", "bf16"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, on NaN in the interpreter
@pytest.mark.parametrize(("qk", "pv", "k_scale"), [(qk, pv, "block") for qk, pv in MODES] + PER_KEY_MODES)
@pytest.mark.slow
def test_triton_backend_propagates_nan_like_the_reference(qk, pv, k_scale):
    """fp16 in the interpreter (block 16) or on a GPU (block 32): the reference's NaN positions exactly."""
    pytest.importorskip("triton")
    from paroattn.kernels.dispatch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block = 32 if torch.cuda.is_available() else 16
    mask = _mask(block)
    clean, nan_inputs = _inputs(torch.float16, block, device)
    args = dict(layout=LAYOUT, orders=ORDERS, block_mask=mask, block_size=block, qk=qk, pv=pv, k_scale=k_scale)
    out = paro_attention(*nan_inputs, backend="triton", **args)
    expected = expected_nan(*nan_inputs, mask, block, block, qk, pv, k_scale)
    _check(out, paro_attention(*clean, backend="triton", **args), expected)
    assert torch.equal(torch.isnan(paro_attention(*nan_inputs, backend="torch", **args)).cpu(), expected)


# -- odd arguments --------------------------------------------------------------------------------------


def _ok_args():
    layout = TokenLayout(3, 2, 4, 4)
    q, k, v = (torch.randn(1, 2, layout.seq_len, 64) for _ in range(3))
    return (q, k, v), dict(layout=layout, orders=torch.tensor([0, 1]),
                           block_mask=torch.ones(2, 3, 3, dtype=torch.bool), block_size=16)


@pytest.mark.parametrize("block_size", [0, -16, 16.0, "16", True, (16,), (16, 16, 16), (16, 0), (16, 8.5), [16], None])
def test_bad_block_size_raises_input_error(block_size):
    qkv, args = _ok_args()
    with pytest.raises(PAROInputError, match=r"block_size must be a positive int or a pair \(bq, bk\)") as info:
        paro_attention(*qkv, **{**args, "block_size": block_size})
    assert repr(block_size) in str(info.value)


def test_good_block_sizes_are_accepted():
    qkv, args = _ok_args()
    expected = paro_attention(*qkv, **args)
    for block_size in ((16, 16), [16, 16]):
        assert torch.equal(paro_attention(*qkv, **{**args, "block_size": block_size}), expected)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool, torch.float64])
def test_non_float_inputs_raise_input_error(dtype):
    (q, k, v), args = _ok_args()
    with pytest.raises(PAROInputError, match=rf"q, k, v must be float16, bfloat16 or float32; got {dtype}$"):
        paro_attention(q.to(dtype), k.to(dtype), v.to(dtype), **args)
