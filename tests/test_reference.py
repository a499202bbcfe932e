"""The torch reference op: the definition every kernel is tested against."""

import math

import pytest
import torch
import torch.nn.functional as F

from paroattn import PAROInputError, TokenLayout, paro_attention
from paroattn.kernels import reference
from paroattn.kernels.block_lists import ActiveBlocks
from paroattn.layout import reorder_index
from paroattn.masks import dense_mask_from_blocks, synthetic_block_mask

LAYOUTS = [TokenLayout(0, 2, 4, 5), TokenLayout(7, 3, 5, 6), TokenLayout(13, 1, 6, 7)]


def _qkv(layout, B=2, H=4, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (B, H, layout.seq_len, D)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]


def _dense_mask_in_original_order(layout, orders, block_mask, bq, bk):
    """Token-level [H, N, N] mask in original coordinates, built independently of the op."""
    n = layout.seq_len
    masks = []
    for h, order in enumerate(orders.tolist()):
        reordered = dense_mask_from_blocks(block_mask[h], bq, bk, n)
        index = reorder_index(layout, order)  # reordered position -> original position
        original = torch.zeros(n, n, dtype=torch.bool)
        original[index[:, None], index[None, :]] = reordered
        masks.append(original)
    return torch.stack(masks)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("D", [64, 128])
def test_all_true_mask_equals_sdpa_for_any_orders(layout, D, reference_path):
    q, k, v = _qkv(layout, D=D)
    orders = torch.tensor([0, 3, 5, 2])
    bs = 16
    nq = -(-layout.seq_len // bs)
    out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=torch.ones(4, nq, nq, dtype=torch.bool),
                         block_size=bs, backend="torch")
    expected = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.fixture(params=["fused", "loop"])
def reference_path(request, monkeypatch):
    """float32 unquantized calls take one masked SDPA call when the mask is small, the chunked
    loop (what every other mode uses) otherwise: test both."""
    if request.param == "loop":
        monkeypatch.setattr(reference, "_SDPA_MASK_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [16, (16, 32), (32, 16)])
def test_random_block_mask_equals_sdpa_with_dense_mask(layout, block_size, reference_path):
    q, k, v = _qkv(layout, B=2, H=3, D=64, seed=1)
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    n = layout.seq_len
    nq, nk = -(-n // bq), -(-n // bk)
    g = torch.Generator().manual_seed(2)
    block_mask = torch.rand(3, nq, nk, generator=g) < 0.4
    block_mask[:, torch.arange(nq), (torch.arange(nq) * nk) // nq] = True
    orders = torch.tensor([1, 4, 3])
    out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=block_mask, block_size=block_size)
    dense = _dense_mask_in_original_order(layout, orders, block_mask, bq, bk)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[None])
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    # prebuilt active-block lists define the same op
    lists = ActiveBlocks.from_mask(block_mask)
    out_lists = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=lists, block_size=block_size)
    assert torch.equal(out_lists, out)


def test_rows_without_active_blocks_output_zeros(reference_path):
    layout = TokenLayout(5, 2, 4, 4)
    q, k, v = _qkv(layout, B=1, H=2)
    nq = -(-layout.seq_len // 16)
    block_mask = torch.ones(2, nq, nq, dtype=torch.bool)
    block_mask[1, 1] = False  # head 1, query block 1 attends to nothing
    for qk, pv in [("bf16", "bf16"), ("int8", "fp8"), ("int4", "int8")]:
        out = paro_attention(q, k, v, layout=layout, orders=torch.tensor([0, 3]), block_mask=block_mask,
                             block_size=16, qk=qk, pv=pv)
        assert torch.isfinite(out).all()
        empty_rows = reorder_index(layout, 3)[16:32]
        assert torch.equal(out[0, 1, empty_rows], torch.zeros_like(out[0, 1, empty_rows]))
        assert out[0, 0].abs().sum() > 0


# Relative L2 error vs the unquantized op on N(0, 1) inputs (measured ~0.011, 0.016, 0.035, 0.19).
ERROR_BOUNDS = {
    ("int8", "bf16"): 0.02,
    ("bf16", "int8"): 0.02,
    ("int8", "int8"): 0.025,
    ("int8", "fp8"): 0.05,
    ("int4", "bf16"): 0.25,
    ("int4", "fp8"): 0.26,
}


@pytest.mark.parametrize(("qk", "pv"), list(ERROR_BOUNDS))
@pytest.mark.parametrize("D", [64, 128])
def test_quantized_error_is_bounded(qk, pv, D):
    layout = TokenLayout(7, 3, 5, 6)
    q, k, v = _qkv(layout, D=D, seed=3)
    orders = torch.tensor([0, 1, 4, 5])
    n = -(-layout.seq_len // 16)
    block_mask = synthetic_block_mask(4, n, n, 0.5, generator=torch.Generator().manual_seed(4))
    args = dict(layout=layout, orders=orders, block_mask=block_mask, block_size=16)
    exact = paro_attention(q, k, v, **args)
    quantized = paro_attention(q, k, v, qk=qk, pv=pv, **args)
    error = float((quantized - exact).norm() / exact.norm())
    assert 0 < error < ERROR_BOUNDS[(qk, pv)]


def _dequantized_qk(q, k, layout, orders, bq, qmax):
    """Q and K as integer QK with per-key K scales computes with them, written from the definition: Q rounded to
    qmax steps of its block's max |x| (blocks of bq reordered queries), K less its mean over the sampled tokens
    rounded to qmax steps of each key's own max |x|."""
    stride = reference.key_mean_stride(layout.seq_len, layout.height, layout.width)
    keys = k - k[:, :, ::stride].mean(dim=2, keepdim=True)
    k_step = keys.abs().amax(dim=-1, keepdim=True) / qmax
    k_hat = torch.round(keys / k_step).clamp(-qmax, qmax) * k_step
    q_hat = torch.empty_like(q)
    for h, order in enumerate(orders.tolist()):
        index = reorder_index(layout, order)
        for start in range(0, layout.seq_len, bq):
            rows = index[start:start + bq]
            block = q[:, h, rows]
            step = block.abs().amax(dim=(1, 2), keepdim=True) / qmax
            q_hat[:, h, rows] = torch.round(block / step).clamp(-qmax, qmax) * step
    return q_hat, k_hat


@pytest.mark.parametrize("qk", ["int8", "int4"])
@pytest.mark.parametrize("D", [64, 128])
def test_per_key_k_scales_are_the_dequantized_product(qk, D):
    """k_scale="token" is attention over the dequantized Q (per query block) and K (per key), with the block mask,
    in float32; keys of norms two decades apart, where one scale per key block would be far off."""
    layout = TokenLayout(7, 3, 5, 6)
    q, k, v = _qkv(layout, B=2, H=3, D=D, seed=7)
    k = k * torch.exp(1.5 * torch.randn(*k.shape[:-1], 1, generator=torch.Generator().manual_seed(8)))
    orders = torch.tensor([1, 4, 3])
    nq, nk = -(-layout.seq_len // 32), -(-layout.seq_len // 16)
    block_mask = synthetic_block_mask(3, nq, nk, 0.5, generator=torch.Generator().manual_seed(9))
    args = dict(layout=layout, orders=orders, block_mask=block_mask, block_size=(32, 16), qk=qk)
    out = paro_attention(q, k, v, k_scale="token", **args)
    q_hat, k_hat = _dequantized_qk(q, k, layout, orders, 32, reference.QK_QMAX[qk])
    dense = _dense_mask_in_original_order(layout, orders, block_mask, 32, 16)
    expected = F.scaled_dot_product_attention(q_hat, k_hat, v, attn_mask=dense[None])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    per_block = paro_attention(q, k, v, k_scale="block", **args)
    assert float((per_block - expected).norm() / expected.norm()) > 1e-2


def test_per_key_k_scales_are_closer_to_the_unquantized_op():
    """What they are for: with keys of unequal norms, one scale per key block puts the quiet keys of a block on
    its loudest key's coarse grid; one per key does not (measured 0.69 of the error here; with qk="bf16" nothing
    is quantized either way)."""
    layout = TokenLayout(7, 3, 8, 8)
    q, k, v = _qkv(layout, D=64, seed=10)
    k = k * torch.exp(1.5 * torch.randn(*k.shape[:-1], 1, generator=torch.Generator().manual_seed(11)))
    nq, nk = -(-layout.seq_len // 32), -(-layout.seq_len // 64)
    args = dict(layout=layout, orders=torch.tensor([0, 2, 4, 5]),
                block_mask=synthetic_block_mask(4, nq, nk, 0.5, generator=torch.Generator().manual_seed(12)),
                block_size=(32, 64))
    exact = paro_attention(q, k, v, **args)
    error = {ks: float((paro_attention(q, k, v, qk="int8", k_scale=ks, **args) - exact).norm() / exact.norm())
             for ks in ("block", "token")}
    assert error["token"] < 0.8 * error["block"], error
    assert torch.equal(paro_attention(q, k, v, k_scale="token", **args), exact)


def test_k_smoothing_makes_int8_insensitive_to_a_key_offset():
    # softmax ignores a constant added to every key; with smoothing, quantization must too
    layout = TokenLayout(0, 2, 4, 8)
    q, k, v = _qkv(layout, B=1, H=2, seed=5)
    args = dict(layout=layout, orders=torch.tensor([0, 2]), block_mask=torch.ones(2, 4, 4, dtype=torch.bool),
                block_size=16, qk="int8")
    out = paro_attention(q, k, v, **args)
    offset = 20.0 * torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(6))
    shifted = paro_attention(q, k + offset, v, **args)
    # float32 rounding of k + offset - mean may move a value across a rounding boundary of the int8
    # grid: one step of one key is ~1e-3 here; without smoothing the error is ~0.1
    torch.testing.assert_close(shifted, out, atol=5e-3, rtol=0)


@pytest.mark.parametrize("prefix,frames,height,width", [
    (226, 13, 30, 45), (0, 21, 30, 52), (0, 21, 45, 80), (512, 1, 64, 64), (0, 16, 64, 64), (0, 8, 16, 16)])
def test_key_mean_sample_visits_every_row_and_column(prefix, frames, height, width):
    """K smoothing's sampled mean: >= 2048 tokens (all of short sequences), and the stride shares no
    factor with the frame, so the sample holds tokens of every column and every row (a stride of 16
    on a 64-wide frame would sample 4 columns)."""
    layout = TokenLayout(prefix, frames, height, width)
    n = layout.seq_len
    stride = reference.key_mean_stride(n, height, width)
    assert 1 <= stride <= reference.MAX_K_MEAN_STRIDE and math.gcd(stride, height * width) == 1
    positions = torch.arange(0, n, stride)
    assert len(positions) >= min(n, reference.MIN_K_MEAN_SAMPLES)
    grid = positions[positions >= prefix] - prefix
    assert set((grid % width).tolist()) == set(range(width))
    assert set(((grid // width) % height).tolist()) == set(range(height))


def test_half_precision_inputs_keep_dtype_and_match_float32():
    layout = TokenLayout(3, 2, 4, 4)
    q, k, v = _qkv(layout, B=1, H=2)
    args = dict(layout=layout, orders=torch.tensor([0, 5]), block_mask=torch.ones(2, 3, 3, dtype=torch.bool),
                block_size=16)
    out32 = paro_attention(q, k, v, **args)
    for dtype in (torch.float16, torch.bfloat16):
        out = paro_attention(q.to(dtype), k.to(dtype), v.to(dtype), **args)
        assert out.dtype == dtype
        assert float((out.float() - out32).norm() / out32.norm()) < 2e-2


def test_any_strides_are_accepted():
    layout = TokenLayout(3, 2, 4, 4)
    B, H, N, D = 2, 3, layout.seq_len, 64
    q, k, v = (torch.randn(B, N, H, D) for _ in range(3))  # [B, N, H, D] storage, as Wan/Flux hold it
    args = dict(layout=layout, orders=torch.tensor([0, 3, 4]), block_mask=torch.ones(H, 3, 3, dtype=torch.bool),
                block_size=16)
    out = paro_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **args)
    expected = paro_attention(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), **args)
    assert torch.equal(out, expected)


def test_bad_inputs_raise_clear_errors():
    layout = TokenLayout(3, 2, 4, 4)
    q, k, v = _qkv(layout, B=1, H=2)
    mask = torch.ones(2, 3, 3, dtype=torch.bool)
    orders = torch.tensor([0, 1])
    ok = dict(layout=layout, orders=orders, block_mask=mask, block_size=16)
    with pytest.raises(PAROInputError, match="does not match the layout"):
        paro_attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], **ok)
    with pytest.raises(PAROInputError, match=r"\[2, 3, 3\]"):
        paro_attention(q, k, v, **{**ok, "block_mask": torch.ones(2, 4, 4, dtype=torch.bool)})
    with pytest.raises(PAROInputError, match="ORDERS"):
        paro_attention(q, k, v, **{**ok, "orders": torch.tensor([0, 6])})
    with pytest.raises(PAROInputError, match="qk="):
        paro_attention(q, k, v, qk="int2", **ok)
    with pytest.raises(PAROInputError, match="pv="):
        paro_attention(q, k, v, pv="fp4", **ok)
    with pytest.raises(PAROInputError, match="bool"):
        paro_attention(q, k, v, **{**ok, "block_mask": mask.float()})
    with pytest.raises(PAROInputError, match="one shape"):
        paro_attention(q, k[:, :1], v, **ok)


@pytest.mark.parametrize("change, fragments", [
    ({"orders": torch.tensor([0.0, 1.0])}, ["integer tensor", "torch.float32", "orders.long()"]),
    ({"orders": torch.tensor([True, False])}, ["integer tensor", "torch.bool"]),
    ({"orders": [0, 1]}, ["integer tensor [H]", "got list", "torch.tensor(orders)"]),
    ({"orders": torch.tensor([[0, 1]])}, ["shape [H] = [2]"]),
    ({"sm_scale": "0.1"}, ["sm_scale must be a positive Python number", "str", "sm_scale=0.125"]),
    ({"sm_scale": True}, ["sm_scale must be a positive Python number", "bool"]),
    ({"sm_scale": torch.tensor(0.1)}, ["sm_scale must be a positive Python number", "Tensor"]),
    ({"sm_scale": 0.0}, ["finite and > 0"]),
    ({"sm_scale": -0.1}, ["finite and > 0"]),
    ({"sm_scale": float("nan")}, ["finite and > 0"]),
    ({"sm_scale": float("inf")}, ["finite and > 0"]),
    ({"block_mask": [[[True] * 3] * 3] * 2}, ["bool tensor [H, nq, nk] or ActiveBlocks", "got list"]),
    ({"q": "q"}, ["q must be a tensor [B, H, N, D]", "str"]),
    ({"v": None}, ["v must be a tensor [B, H, N, D]", "NoneType"]),
    ({"layout": (3, 2, 4, 4)}, ["paroattn.TokenLayout", "tuple"]),
    ({"block_size": 0}, ["positive int"]),
    ({"block_size": (64,)}, ["pair (bq, bk)"]),
    ({"backend": "gpu"}, ["backend='gpu'", "auto"]),
    ({"k_scale": "channel"}, ["k_scale='channel'", "'block', 'token'"]),
    ({"k_scale": None}, ["k_scale=None", "'block', 'token'"]),
    ({"backend": "cuda"}, ["Use backend='torch'"]),  # the CUDA kernels on CPU float32 tensors: refused, not run
])
def test_bad_argument_types_raise_what_to_pass(change, fragments):
    """Arguments of the wrong type or range raise PAROInputError saying what to pass (never torch's TypeError or
    an AttributeError from deep inside), on the torch backend that runs anywhere."""
    layout = TokenLayout(3, 2, 4, 4)
    q, k, v = _qkv(layout, B=1, H=2)
    args = dict(q=q, k=k, v=v, layout=layout, orders=torch.tensor([0, 1]),
                block_mask=torch.ones(2, 3, 3, dtype=torch.bool), block_size=16, backend="torch")
    args.update(change)
    with pytest.raises(PAROInputError) as info:
        paro_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_valid_sm_scale_and_orders_types_are_accepted():
    """What the checks let through computes: an int sm_scale is a scale, int32 orders are orders."""
    layout = TokenLayout(0, 2, 4, 4)
    q, k, v = _qkv(layout, B=1, H=2)
    mask = torch.ones(2, 2, 2, dtype=torch.bool)
    base = paro_attention(q, k, v, layout=layout, orders=torch.tensor([0, 3]), block_mask=mask, block_size=16,
                          sm_scale=1.0, backend="torch")
    same = paro_attention(q, k, v, layout=layout, orders=torch.tensor([0, 3], dtype=torch.int32), block_mask=mask,
                          block_size=16, sm_scale=1, backend="torch")
    assert torch.equal(base, same)
    expected = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    torch.testing.assert_close(base, expected, rtol=1e-5, atol=1e-5)


def test_active_blocks_reject_lists_a_kernel_would_misread():
    mask = torch.rand(2, 4, 6, generator=torch.Generator().manual_seed(9)) < 0.5
    mask[..., 0] = mask[..., 5] = True
    lists = ActiveBlocks.from_mask(mask)
    descending = lists.indices.clone()
    descending[0, 0, : int(lists.counts[0, 0])] = descending[0, 0, : int(lists.counts[0, 0])].flip(0)
    with pytest.raises(PAROInputError, match="strictly ascending"):
        ActiveBlocks(lists.counts, descending, 6)
    out_of_range = lists.indices.clone()
    out_of_range[1, 2, 0] = 6
    with pytest.raises(PAROInputError, match=r"key blocks in 0\.\.5"):
        ActiveBlocks(lists.counts, out_of_range, 6)


def test_apply_rotary_is_the_models_rope_bit_for_bit():
    """`apply_rotary` (the op's convention) equals diffusers' apply_rotary_emb (CogVideoX, Flux) and, with
    the adapter's tables, Wan's rotation, on random (not pair-repeated) tables, bf16 and float32."""
    from diffusers.models.embeddings import apply_rotary_emb

    from paroattn.kernels.reference import apply_rotary
    from paroattn.pipelines.base import paired_tables, rotate_pairs

    g = torch.Generator().manual_seed(0)
    B, H, N, D, S = 2, 3, 40, 64, 33
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(B, H, N, D, generator=g).to(dtype)
        cos, sin = torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)
        expected = x.clone()
        expected[:, :, N - S:] = apply_rotary_emb(x[:, :, N - S:], (cos, sin))  # CogVideoX: after the text
        assert torch.equal(apply_rotary(x, cos, sin), expected)
        wan_cos, wan_sin = torch.randn(1, N, 1, D, generator=g), torch.randn(1, N, 1, D, generator=g)
        wan = rotate_pairs(x.transpose(1, 2), wan_cos, wan_sin).transpose(1, 2)  # Wan holds [B, S, H, D]
        assert torch.equal(apply_rotary(x, *paired_tables(wan_cos, wan_sin)), wan)


def test_bad_rotary_tables_raise_clear_errors():
    layout = TokenLayout(3, 2, 4, 4)
    q, k, v = _qkv(layout, B=1, H=2)
    ok = dict(layout=layout, orders=torch.tensor([0, 1]), block_mask=torch.ones(2, 3, 3, dtype=torch.bool), block_size=16)
    N, D = q.shape[2], q.shape[3]
    table = torch.ones(N, D)
    with pytest.raises(PAROInputError, match="S <= N"):
        paro_attention(q, k, v, rotary=(torch.ones(N + 1, D), torch.ones(N + 1, D)), **ok)
    with pytest.raises(PAROInputError, match=f"D={D}"):
        paro_attention(q, k, v, rotary=(torch.ones(N, D // 2), torch.ones(N, D // 2)), **ok)
    with pytest.raises(PAROInputError, match="float32"):
        paro_attention(q, k, v, rotary=(table.half(), table.half()), **ok)
    with pytest.raises(PAROInputError, match="pair of tensors"):
        paro_attention(q, k, v, rotary=table, **ok)
