"""Triton kernels (interpreter on CPU, compiled on a GPU) against the torch reference, the oracle.

Stated error bounds, relative L2 of kernel vs reference computed with the SAME quantization modes:
- pv="bf16" (P rounded to the input dtype like the reference): <= 2e-3 (fp16 rounding of the output)
- pv="int8": <= 1e-2, pv="fp8": <= 2e-2. The kernel quantizes P after subtracting a RUNNING row
  max, the reference after the final one, so P lands on slightly different grids (module docstring
  of reference.py). Q/K quantization is the same arithmetic in both, bit for bit
  (test_prologue_buffers_equal_the_reference_quantization), but the scores then sum in another
  order; qk="int4" keeps 1e-2 (seen: 2.8e-3 with fp16 on an H200, 8e-5 in the interpreter).
And against the unquantized reference: int8 QK + bf16 PV <= 2e-2, int8 QK + fp8 PV <= 5e-2 on
Gaussian inputs.

The interpreter's float32 -> fp8e4m3 cast is wrong in Triton 3.9 (round-half-up without carry into
the exponent: 124.02 becomes 64.0). The GPU uses the hardware's round-to-nearest-even cast, so the
tests replace the interpreter's cast by torch's (the same RTNE cast the reference uses).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
import kernel_calls  # noqa: E402
import triton.language as tl  # noqa: E402

from paroattn import PAROInputError, TokenLayout, paro_attention  # noqa: E402
from paroattn.attention import decide  # noqa: E402
from paroattn.kernels import dispatch, launch, runtime  # noqa: E402
from paroattn.kernels.block_lists import ActiveBlocks, heaviest_first  # noqa: E402
from paroattn.masks import synthetic_block_mask  # noqa: E402

INTERPRETED = not torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"
# the interpreter runs small tiles fast; compiled Triton needs >= 32 for 8-bit dots
SMALL_BLOCK = 16 if INTERPRETED else 32
BOUND = {"bf16": 2e-3, "int8": 1e-2, "fp8": 2e-2}


@pytest.fixture(autouse=True, scope="module")
def _rtne_fp8_cast_in_interpreter():
    if not INTERPRETED:
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16):
            view = np.ascontiguousarray(values).view(np.float32 if input_dtype == tl.float32 else np.float16)
            as_fp8 = torch.from_numpy(view.astype(np.float32)).to(torch.float8_e4m3fn)
            return as_fp8.view(torch.uint8).numpy().reshape(values.shape)
        return original(values, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    yield
    interpreter._convert_float = original


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))


def make_inputs(B, H, N, D, dtype=torch.float16, seq_major=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for _ in range(3):
        if seq_major:  # [B, N, H, D] storage, seen as [B, H, N, D] (Wan, Flux)
            t = torch.randn(B, N, H, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        else:
            t = torch.randn(B, H, N, D, generator=g).to(dtype).to(DEVICE)
        tensors.append(t)
    return tensors


def both(q, k, v, layout, orders, mask, block, qk, pv):
    kwargs = dict(layout=layout, orders=orders, block_mask=mask, block_size=block, qk=qk, pv=pv)
    out = paro_attention(q, k, v, backend="triton", **kwargs)
    ref = paro_attention(q, k, v, backend="torch", **kwargs)
    return out, ref


# prefix tokens, odd length (35: last blocks partial), three different orders in one launch
LAYOUT = TokenLayout(5, 2, 3, 5)


@pytest.mark.parametrize("qk", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("pv", ["bf16", "fp8", "int8"])
@pytest.mark.slow
def test_every_mode_matches_reference(qk, pv):
    B, H, D = 2, 3, 64
    q, k, v = make_inputs(B, H, LAYOUT.seq_len, D, seed=3 * ["bf16", "int8", "int4"].index(qk) + ["bf16", "fp8", "int8"].index(pv))
    orders = torch.tensor([0, 3, 5])
    n_blocks = -(-LAYOUT.seq_len // SMALL_BLOCK)
    mask = synthetic_block_mask(H, n_blocks, n_blocks, 0.5, generator=torch.Generator().manual_seed(1))
    out, ref = both(q, k, v, LAYOUT, orders, mask, SMALL_BLOCK, qk, pv)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    bound = max(BOUND[pv], 1e-2) if qk == "int4" else BOUND[pv]
    assert rel_err(out, ref) <= bound, (qk, pv, rel_err(out, ref))


@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "fp8")])
@pytest.mark.slow
def test_suffix_tokens_stay_in_place(qk, pv):
    """Tokens after the grid (HunyuanVideo's text) are never reordered: the kernels' index maps leave them
    in place, with text and grid tokens sharing a block (44 tokens: 3 + 2x3x5 + 11)."""
    layout = TokenLayout(3, 2, 3, 5, suffix=11)
    H, D = 3, 64
    q, k, v = make_inputs(2, H, layout.seq_len, D, seed=5)
    n_blocks = -(-layout.seq_len // SMALL_BLOCK)
    mask = synthetic_block_mask(H, n_blocks, n_blocks, 0.5, generator=torch.Generator().manual_seed(5))
    out, ref = both(q, k, v, layout, torch.tensor([2, 3, 5]), mask, SMALL_BLOCK, qk, pv)
    assert rel_err(out, ref) <= BOUND[pv], rel_err(out, ref)


@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "fp8"), ("int4", "int8")])
def test_head_dim_128_seq_major_inputs(qk, pv):
    """[B, N, H, D] storage seen as [B, H, N, D]: read in place, output keeps q's strides."""
    layout = TokenLayout(3, 1, 5, 7)  # an image: 38 tokens
    B, H, D = 1, 2, 128
    q, k, v = make_inputs(B, H, layout.seq_len, D, seq_major=True, seed=7)
    orders = torch.tensor([1, 4])
    n_blocks = -(-layout.seq_len // SMALL_BLOCK)
    mask = synthetic_block_mask(H, n_blocks, n_blocks, 0.6, generator=torch.Generator().manual_seed(2))
    out, ref = both(q, k, v, layout, orders, mask, SMALL_BLOCK, qk, pv)
    assert out.stride() == q.stride()
    assert rel_err(out, ref) <= BOUND[pv]


@pytest.mark.slow
def test_block_64_longer_sequence_bf16_dtype_contract():
    """Plan-sized blocks (64), 3 query blocks with the last one partial, every order."""
    layout = TokenLayout(3, 2, 7, 9)  # 129 tokens
    H, D = 6, 64
    q, k, v = make_inputs(1, H, layout.seq_len, D, seed=3)
    orders = torch.arange(6)
    mask = synthetic_block_mask(H, 3, 3, 0.5, generator=torch.Generator().manual_seed(3))
    for qk, pv in (("bf16", "bf16"), ("int8", "int8")):
        out, ref = both(q, k, v, layout, orders, mask, 64, qk, pv)
        assert rel_err(out, ref) <= BOUND[pv]


@pytest.mark.parametrize("block", [(2 * SMALL_BLOCK, SMALL_BLOCK), (SMALL_BLOCK, 2 * SMALL_BLOCK)])
@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "fp8"), ("int4", "bf16")])
@pytest.mark.slow
def test_unequal_query_and_key_blocks(block, qk, pv):
    """bq != bk: taller query tiles (two warpgroups per program at bq=128) or wider key tiles."""
    layout = TokenLayout(6, 3, 4, 7)  # 90 tokens: partial last blocks on both sides
    H, D = 3, 64
    q, k, v = make_inputs(2, H, layout.seq_len, D, seed=11)
    nq, nk = -(-layout.seq_len // block[0]), -(-layout.seq_len // block[1])
    mask = synthetic_block_mask(H, nq, nk, 0.5, generator=torch.Generator().manual_seed(11))
    out, ref = both(q, k, v, layout, torch.tensor([1, 3, 4]), mask, block, qk, pv)
    bound = max(BOUND[pv], 1e-2) if qk == "int4" else BOUND[pv]
    assert torch.isfinite(out).all() and rel_err(out, ref) <= bound, rel_err(out, ref)


def test_dense_fp16_equals_sdpa():
    """All blocks on, no quantization: plain attention, whatever the orders."""
    layout = TokenLayout(4, 3, 2, 5)
    q, k, v = make_inputs(2, 2, layout.seq_len, 64, seed=4)
    n_blocks = -(-layout.seq_len // SMALL_BLOCK)
    mask = torch.ones(2, n_blocks, n_blocks, dtype=torch.bool)
    out = paro_attention(q, k, v, layout=layout, orders=torch.tensor([2, 5]), block_mask=mask,
                         block_size=SMALL_BLOCK, backend="triton")
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert rel_err(out, expected) <= 2e-3


def test_quantization_error_vs_unquantized_reference():
    q, k, v = make_inputs(1, 2, LAYOUT.seq_len, 64, seed=5)
    n_blocks = -(-LAYOUT.seq_len // SMALL_BLOCK)
    mask = synthetic_block_mask(2, n_blocks, n_blocks, 0.7, generator=torch.Generator().manual_seed(5))
    kwargs = dict(layout=LAYOUT, orders=torch.tensor([0, 2]), block_mask=mask, block_size=SMALL_BLOCK)
    exact = paro_attention(q, k, v, backend="torch", **kwargs)
    int8 = paro_attention(q, k, v, backend="triton", qk="int8", **kwargs)
    int8_fp8 = paro_attention(q, k, v, backend="triton", qk="int8", pv="fp8", **kwargs)
    int4 = paro_attention(q, k, v, backend="triton", qk="int4", **kwargs)
    assert 1e-4 < rel_err(int8, exact) <= 2e-2  # quantization really happened, and stayed small
    assert rel_err(int8_fp8, exact) <= 5e-2
    assert rel_err(int8, exact) < rel_err(int4, exact) <= 0.25


def _pv_key_at(j: torch.Tensor) -> torch.Tensor:
    # block_sparse_attention._pv_key_at: the key that 8-bit V holds at position j
    return (j & ~14) | ((j >> 1) & 6) | ((j & 2) << 2)


@pytest.fixture
def small_key_mean_sample(monkeypatch):
    """K smoothing's mean sampled from >= 16 tokens, so short test sequences take strides > 1 (the
    strides are cached per length and frame: cleared on both sides)."""
    from paroattn.kernels import reference

    monkeypatch.setattr(reference, "MIN_K_MEAN_SAMPLES", 16)
    reference.key_mean_stride.cache_clear()
    yield
    reference.key_mean_stride.cache_clear()


@pytest.mark.parametrize("qk,pv,D,k_scale", [("int8", "fp8", 64, "block"), ("int4", "int8", 128, "block"),
                                             ("int8", "fp8", 128, "block"), ("int8", "fp8", 64, "token"),
                                             ("int4", "int8", 128, "token")])
@pytest.mark.slow
def test_prologue_buffers_equal_the_reference_quantization(qk, pv, D, k_scale, small_key_mean_sample):
    """The prologue's quantized Q, K and V are the reference's values bit for bit (same grid, same
    IEEE reciprocal, round half to even), from the statistics the backend computes; K smoothing's mean
    is the reference's sampled mean (at least 16 tokens here, so the stride is > 1: 7, 22 tokens). B=2, mixed
    orders, [B, N, H, D] storage, a ragged last block, query blocks twice the key blocks. K per key block, or per
    key (k_scale="token": a scale per key of the padded length, eps / qmax past the sequence)."""
    from paroattn.kernels import reference, statistics
    from paroattn.layout import reorder_index

    layout = TokenLayout(5, 3, 8, 6)  # 149 tokens
    N, H, bk = layout.seq_len, 3, SMALL_BLOCK
    bq = 2 * bk
    q, k, v = make_inputs(2, H, N, D, dtype=torch.bfloat16, seq_major=True, seed=21)
    k = k * 3.0 + 2.0  # keys with a large common offset, as DiT keys have
    orders = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    buffers = runtime.allocate(2, H, N, D, q.dtype, q.device, bq, bk, qk, pv, write_q=True, k_scale=k_scale)
    kq, k_scales, vq, v_amax, qq, q_scale = launch.prepare_kv(
        k, v, orders, layout.prefix, layout.frames, layout.height, layout.width, bk, qk, pv, buffers, q, bq,
        k_scale=k_scale)
    stride = reference.key_mean_stride(N, layout.height, layout.width)
    assert stride == 7  # the largest stride coprime with 8 x 6 that keeps >= 16 of 149 tokens
    stats = statistics.Statistics(2, H, N, D, k.device)
    statistics.compute(k, v, stats, stride, k_mean=True, v_amax=False)
    k_mean = stats.k_mean
    torch.testing.assert_close(k_mean, reference.key_smoothing_mean(k.flatten(0, 1), stride).view(2, H, D),
                               rtol=1e-6, atol=1e-6)
    qmax = reference.QK_QMAX[qk]
    # int4 values are stored times 16, their scales over 16
    store = 16.0 if qk == "int4" else 1.0
    nk = -(-N // bk)
    j = torch.arange(nk * bk)
    assert k_scales.shape == (2 * H, nk * bk if k_scale == "token" else nk)
    for b in range(2):
        for h in range(H):
            bh = b * H + h
            index = reorder_index(layout, int(orders[h])).to(DEVICE)
            keys = k[b, h, index].float() - k_mean[b, h]
            if k_scale == "token":
                values, scales = reference.quantize_symmetric(keys, dim=-1, qmax=qmax)
                assert torch.equal(kq[bh, :N].float(), values * store)
                assert torch.equal(k_scales[bh, :N], scales[:, 0] / store)
                assert (k_scales[bh, N:] == reference.quant_scale(torch.zeros(1, device=DEVICE), qmax) / store).all()
            else:
                values, scales = reference.quantize_per_block(keys[None], bk, qmax)
                assert torch.equal(kq[bh, :N].float(), values[0] * store)
                assert torch.equal(k_scales[bh], scales[0] / store)
            values, scales = reference.quantize_per_block(q[b, h, index].float()[None], bq, qmax)
            assert torch.equal(qq[bh, :N].float(), values[0] * store)
            assert torch.equal(q_scale[bh], scales[0] / store)
            # V: per channel, transposed [D, N_PAD], keys of every 16 in the PV product's order
            scaled = v[b, h, index].float() * torch.reciprocal(reference.quant_scale(v_amax[b, h], reference.PV_QMAX[pv]))
            expected = scaled.to(torch.float8_e4m3fn).float() if pv == "fp8" else torch.round(scaled).clamp(-127, 127)
            held = _pv_key_at(j)
            real = held < N
            assert torch.equal(vq[bh][:, j[real]].float().T, expected[held[real]])


def mixed_key_norms(k: torch.Tensor, seed: int) -> torch.Tensor:
    """k with its keys' norms spread over two decades, in place (its strides kept): where one scale per key block
    coarsens the grid of the block's quiet keys and one scale per key does not, so the two granularities give
    results far apart (the tests below check they do: a kernel that ignored k_scale fails them)."""
    g = torch.Generator().manual_seed(seed)
    return k.mul_(torch.exp(1.5 * torch.randn(*k.shape[:-1], 1, generator=g)).to(k.dtype).to(k.device))


LAYOUT_SUFFIX = TokenLayout(3, 2, 3, 5, suffix=11)  # 44 tokens: text and grid tokens share a block


@pytest.mark.parametrize("qk,pv,D,layout,block,flags,seq_major", [
    ("int8", "bf16", 64, LAYOUT, SMALL_BLOCK, None, False),  # prefix, ragged last block, B=2, three orders
    ("int8", "fp8", 128, TokenLayout(3, 1, 5, 7), (2 * SMALL_BLOCK, SMALL_BLOCK), dict(tma=True, overlap_qk=True), True),
    ("int4", "int8", 64, LAYOUT, (2 * SMALL_BLOCK, SMALL_BLOCK), dict(tma=True, q_tma=True), False),
    ("int8", "fp8", 64, LAYOUT_SUFFIX, SMALL_BLOCK, None, True),  # padded suffix keys (the masked tail blocks)
])
@pytest.mark.slow
def test_per_key_k_scales_match_reference(qk, pv, D, layout, block, flags, seq_major):
    """k_scale="token": K quantized with one scale per key (the prologue) and each score scaled by its key's
    scale (the kernel), against the reference of the same granularity, which it is far closer to than to the
    reference per key block. Both head dims, int8 and int4, odd lengths, B=2, mixed orders per head, [B, N, H, D]
    storage, 128 x 64-like tiles with K/V and Q by descriptor and the pipelined loop, padded suffix keys."""
    bq, bk = (block, block) if isinstance(block, int) else block
    B, H = 2, 3
    q, k, v = make_inputs(B, H, layout.seq_len, D, seq_major=seq_major, seed=31)
    mixed_key_norms(k, seed=32)
    nq, nk = -(-layout.seq_len // bq), -(-layout.seq_len // bk)
    mask = synthetic_block_mask(H, nq, nk, 0.6, generator=torch.Generator().manual_seed(33))
    mask[0, 0] = False  # an empty row
    mask[1, -1] = False
    mask[1, -1, -1] = True  # a row whose only block is the ragged tail
    suffix_mask = None
    if layout.suffix:
        suffix_mask = torch.ones(B, layout.suffix, dtype=torch.bool, device=DEVICE)
        suffix_mask[0, 4:] = False
        suffix_mask[1, ::2] = False
    kwargs = dict(layout=layout, orders=torch.tensor([3, 0, 5]), block_mask=mask, block_size=(bq, bk), qk=qk, pv=pv,
                  suffix_mask=suffix_mask)
    key = (D, bq, bk, qk, pv)
    if flags:
        runtime.set_kernel_config(*key, dispatch.KernelConfig(4, 2, **flags))
    try:
        out = paro_attention(q, k, v, backend="triton", k_scale="token", **kwargs)
    finally:
        runtime.set_kernel_config(*key, None)
    assert runtime.runtime_of(q.device).last_launch.k_scale == "token"
    ref = paro_attention(q, k, v, backend="torch", k_scale="token", **kwargs)
    per_block = paro_attention(q, k, v, backend="torch", k_scale="block", **kwargs)
    bound = max(BOUND[pv], 1e-2) if qk == "int4" else BOUND[pv]
    print(f"{qk}/{pv} D={D}: kernel vs reference {rel_err(out, ref):.2e}, per block vs per key "
          f"{rel_err(per_block, ref):.2e}")
    assert torch.isfinite(out).all() and out.stride() == q.stride()
    assert rel_err(out, ref) <= bound
    assert 5 * rel_err(out, ref) < rel_err(per_block, ref)  # far closer to per key than per block


def test_zero_active_rows_write_zeros_and_every_element_is_written():
    layout = TokenLayout(2, 2, 3, 10)  # 62 tokens: >= 2 query blocks at both block sizes
    H, D = 2, 64
    q, k, v = make_inputs(1, H, layout.seq_len, D, seed=6)
    n_blocks = -(-layout.seq_len // SMALL_BLOCK)
    mask = torch.rand(H, n_blocks, n_blocks, generator=torch.Generator().manual_seed(6)) < 0.6
    mask[0, 1] = False  # a query block with no key block at all
    mask[1, 0] = False
    blocks = ActiveBlocks.from_mask(mask).to(DEVICE)
    orders = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    for qk, pv in (("bf16", "bf16"), ("int4", "fp8")):
        out = torch.full_like(q, float("nan"))  # poisoned
        kernel_calls.launch(q, k, v, orders, blocks.counts, blocks.indices, blocks.schedule, layout.prefix,
                              layout.frames, layout.height, layout.width, SMALL_BLOCK, SMALL_BLOCK, qk, pv,
                              1 / math.sqrt(D), out=out)
        ref = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=mask, block_size=SMALL_BLOCK,
                             qk=qk, pv=pv, backend="torch")
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) <= BOUND[pv]
        # the rows of the empty query blocks (reordered coordinates) are exactly zero at their original places
        from paroattn.layout import reorder_index

        for head, block in ((0, 1), (1, 0)):
            rows = reorder_index(layout, int(orders[head]))[block * SMALL_BLOCK:(block + 1) * SMALL_BLOCK]
            assert (out[0, head, rows.to(DEVICE)] == 0).all()


def test_active_blocks_input_equals_bool_mask_and_schedule_is_heaviest_first():
    q, k, v = make_inputs(1, 2, LAYOUT.seq_len, 64, seed=8)
    n_blocks = -(-LAYOUT.seq_len // SMALL_BLOCK)
    mask = synthetic_block_mask(2, n_blocks, n_blocks, 0.4, generator=torch.Generator().manual_seed(8))
    kwargs = dict(layout=LAYOUT, orders=torch.tensor([4, 0]), block_size=SMALL_BLOCK, qk="int8", backend="triton")
    from_bool = paro_attention(q, k, v, block_mask=mask, **kwargs)
    blocks = ActiveBlocks.from_mask(mask)
    from_lists = paro_attention(q, k, v, block_mask=blocks, **kwargs)
    assert torch.equal(from_bool, from_lists)
    counts = blocks.counts.gather(1, blocks.schedule.long())
    assert (counts[:, :-1] >= counts[:, 1:]).all()
    assert torch.equal(heaviest_first(blocks.counts), blocks.schedule)
    assert torch.equal(blocks.to_mask(), mask)


def test_clear_errors():
    layout = TokenLayout(0, 1, 4, 4)
    mask = torch.ones(1, 1, 1, dtype=torch.bool)
    for D, dtype in ((96, torch.float16), (64, torch.float32)):
        q = torch.randn(1, 1, 16, D, dtype=dtype, device=DEVICE)
        with pytest.raises(PAROInputError, match="triton backend"):
            paro_attention(q, q, q, layout=layout, orders=torch.tensor([0]), block_mask=mask, block_size=16,
                           backend="triton")


@pytest.mark.slow
def test_custom_op_schema_and_fake_tensor():
    layout = LAYOUT
    q, k, v = make_inputs(1, 2, layout.seq_len, 64, seed=9, seq_major=True)
    n_blocks = -(-layout.seq_len // SMALL_BLOCK)
    blocks = ActiveBlocks.from_mask(torch.ones(2, n_blocks, n_blocks, dtype=torch.bool)).to(DEVICE)
    orders = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    args = (q, k, v, orders, blocks.counts, blocks.indices, blocks.schedule, layout.prefix, layout.frames,
            layout.height, layout.width, SMALL_BLOCK, SMALL_BLOCK, "int8", "fp8", 0.125,
            decide(q, SMALL_BLOCK, SMALL_BLOCK, "int8", "fp8", "triton").encode())
    torch.library.opcheck(launch.block_sparse_attention, args, test_utils=("test_schema", "test_faketensor"))
    rotary = rope_tables(layout.grid_tokens, 64, seed=9)  # the optional RoPE tables
    torch.library.opcheck(launch.block_sparse_attention, args + rotary,
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(launch.block_sparse_attention, args + (None, None, None, "token"),  # K scales per key
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
@pytest.mark.parametrize("k_scale", ["block", "token"])
def test_compile_fullgraph_has_no_graph_break(k_scale):
    """torch.compile(fullgraph=True) of a function calling the op: the op is one opaque node (with the call's K
    scale granularity: keys of mixed norms, where the two differ)."""
    layout = LAYOUT
    q, k, v = make_inputs(1, 2, layout.seq_len, 64, seed=10)
    mixed_key_norms(k, seed=10)
    n_blocks = -(-layout.seq_len // SMALL_BLOCK)
    blocks = ActiveBlocks.from_mask(torch.ones(2, n_blocks, n_blocks, dtype=torch.bool)).to(DEVICE)
    orders = torch.tensor([3, 5], device=DEVICE)

    rotary = rope_tables(layout.seq_len, 64, seed=10)

    def layer(q, k, v, orders, k_scale=k_scale):
        out = paro_attention(q * 1.0, k, v, layout=layout, orders=orders, block_mask=blocks,
                             block_size=SMALL_BLOCK, qk="int8", pv="fp8", backend="triton", rotary=rotary,
                             k_scale=k_scale)
        return out + 1

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager" if INTERPRETED else "inductor")
    out = compiled(q, k, v, orders)
    other = layer(q, k, v, orders, k_scale="token" if k_scale == "block" else "block")
    assert rel_err(out, layer(q, k, v, orders)) <= 1e-3 < rel_err(out, other)


@pytest.mark.parametrize("flags", [dict(tma=True), dict(overlap_qk=True), dict(tma=True, overlap_qk=True)])
@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "fp8"), ("int8", "int8"), ("int4", "fp8")])
@pytest.mark.slow
def test_kernel_config_variants_match_reference(qk, pv, flags):
    """KernelConfig(tma=True): K/V tiles read through tensor descriptors (TMA on Hopper), including the
    transposed 8-bit V buffer and int4 K values. overlap_qk=True: the loop computes the next key
    block's scores one iteration ahead. B > 1, a ragged last block, rows with 0 and 1 active blocks."""
    q, k, v = make_inputs(2, 3, LAYOUT.seq_len, 64, seed=13)
    n_blocks = -(-LAYOUT.seq_len // SMALL_BLOCK)
    mask = synthetic_block_mask(3, n_blocks, n_blocks, 0.5, generator=torch.Generator().manual_seed(13))
    mask[0, 0] = False  # an empty row
    mask[1, -1] = False
    mask[1, -1, -1] = True  # a row whose only block is the ragged tail
    mask[2, 0] = False
    mask[2, 0, 0] = True  # a row with one unmasked block
    key = (64, SMALL_BLOCK, SMALL_BLOCK, qk, pv)
    runtime.set_kernel_config(*key, dispatch.KernelConfig(4, 2, **flags))
    try:
        out, ref = both(q, k, v, LAYOUT, torch.tensor([3, 0, 4]), mask, SMALL_BLOCK, qk, pv)
    finally:
        runtime.set_kernel_config(*key, None)
    assert rel_err(out, ref) <= (max(BOUND[pv], 1e-2) if qk == "int4" else BOUND[pv])


RAGGED = TokenLayout(prefix=5, frames=3, height=8, width=12)  # 293 tokens: ragged last block of 128
WHOLE = TokenLayout(prefix=0, frames=2, height=8, width=16)  # 256 tokens: whole blocks (no tail code)


@pytest.mark.parametrize("qk,pv,D,bq,bk,layout", [
    ("bf16", "bf16", 64, 128, 128, RAGGED), ("int8", "fp8", 128, 128, 128, RAGGED), ("int4", "int8", 64, 128, 64, RAGGED),
    ("int8", "bf16", 64, 128, 64, RAGGED), ("bf16", "bf16", 128, 128, 64, RAGGED), ("int8", "fp8", 64, 32, 16, RAGGED),
    ("bf16", "bf16", 128, 128, 64, WHOLE), ("int8", "fp8", 64, 128, 64, WHOLE)])
@pytest.mark.slow
def test_query_tiles_by_descriptor_match_reference(qk, pv, D, bq, bk, layout):
    """KernelConfig(q_tma=True): the prologue also writes the reordered Q (quantized per query block for
    integer QK, also when its grid runs over smaller key blocks) and the kernel reads each query tile
    by one descriptor load. B=2, mixed orders, [B, N, H, D] storage, an empty row, a row whose only
    block is the last (ragged or whole)."""
    if not INTERPRETED and bk < 32:
        pytest.skip("blocks of 16 run in the interpreter only")
    q, k, v = make_inputs(2, 3, layout.seq_len, D, seed=14, seq_major=True)
    nq, nk = -(-layout.seq_len // bq), -(-layout.seq_len // bk)
    mask = synthetic_block_mask(3, nq, nk, 0.6, generator=torch.Generator().manual_seed(14))
    mask[0, 1] = False
    mask[2, 0] = False
    mask[2, 0, -1] = True
    key = (D, bq, bk, qk, pv)
    runtime.set_kernel_config(*key, dispatch.KernelConfig(4, 2, tma=True, q_tma=True))
    try:
        out, ref = both(q, k, v, layout, torch.tensor([4, 0, 2]), mask, (bq, bk), qk, pv)
    finally:
        runtime.set_kernel_config(*key, None)
    assert rel_err(out, ref) <= (max(BOUND[pv], 1e-2) if qk == "int4" else BOUND[pv])


def test_query_tiles_by_descriptor_are_refused_where_the_prologue_cannot_write_them():
    """q_tma needs the prologue's descriptor buffers (tma=True) and bq >= bk."""
    for bq, bk, config in [(64, 128, dispatch.KernelConfig(4, 2, tma=True, q_tma=True)),
                           (128, 128, dispatch.KernelConfig(4, 2, q_tma=True))]:
        with pytest.raises(ValueError, match="q_tma=True"):
            runtime.set_kernel_config(64, bq, bk, "bf16", "bf16", config)


@pytest.mark.parametrize("qk,pv,D,layout,stages,dtype", [
    ("bf16", "bf16", 128, RAGGED, 2, torch.float16), ("bf16", "bf16", 64, RAGGED, 3, torch.float16),
    ("bf16", "bf16", 128, WHOLE, 2, torch.bfloat16), ("bf16", "bf16", 64, WHOLE, 2, torch.float16),
    ("bf16", "bf16", 128, RAGGED, 4, torch.bfloat16)])
def test_warp_specialized_kernel_matches_reference(qk, pv, D, layout, stages, dtype):
    """KernelConfig(warp_specialized=True): on an sm_90 GPU the Gluon kernel of hopper_attention (a
    loader warp, two consumer warpgroups); elsewhere, the interpreter included, the Triton kernel runs
    with the same tiles. B=2, mixed orders, [B, N, H, D] storage, an empty row, a row whose only block
    is the last (ragged or whole), a row with one block, rows with many."""
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        dtype = torch.float16  # bf16 products are wrong in the interpreter (README)
    q, k, v = make_inputs(2, 3, layout.seq_len, D, dtype=dtype, seed=15, seq_major=True)
    nq, nk = -(-layout.seq_len // 128), -(-layout.seq_len // 64)
    mask = synthetic_block_mask(3, nq, nk, 0.7, generator=torch.Generator().manual_seed(15))
    mask[0, 1] = False
    mask[2, 0] = False
    mask[2, 0, -1] = True
    mask[1, 1] = False
    mask[1, 1, 2] = True
    key = (D, 128, 64, qk, pv)
    runtime.set_kernel_config(*key, dispatch.KernelConfig(4, stages, tma=True, q_tma=True,
                                                                       warp_specialized=True))
    try:
        out, ref = both(q, k, v, layout, torch.tensor([3, 0, 5]), mask, (128, 64), qk, pv)
    finally:
        runtime.set_kernel_config(*key, None)
    assert rel_err(out, ref) <= (max(BOUND[pv], 1e-2) if qk == "int4" else BOUND[pv])


def test_warp_specialized_kernel_is_refused_outside_its_tiles_and_modes():
    ws = dispatch.KernelConfig(4, 2, tma=True, q_tma=True, warp_specialized=True)
    for bq, bk, qk, pv in [(64, 64, "bf16", "bf16"), (128, 128, "bf16", "bf16"), (128, 64, "int8", "bf16"),
                           (128, 64, "int8", "int8"), (128, 64, "bf16", "fp8"), (128, 64, "int8", "fp8"),
                           (128, 64, "int4", "fp8"), (64, 64, "int8", "fp8")]:
        with pytest.raises(ValueError, match="warp_specialized=True"):
            runtime.set_kernel_config(128, bq, bk, qk, pv, ws)


def test_warp_specialized_launch_binds_every_kernel_argument(monkeypatch):
    """The Gluon kernel runs only on an sm_90 GPU; its host side (descriptors, argument list, constexprs)
    runs here, against a stand-in that binds the arguments to the kernel's signature."""
    hopper_attention = pytest.importorskip("paroattn.kernels.hopper_attention")
    if hopper_attention.gluon is None:
        pytest.skip("this triton has no Gluon")
    import inspect

    kernel = hopper_attention._warp_specialized_kernel
    grids = []

    class BindingStandIn:
        def __getitem__(self, grid):
            def run(*args, num_warps, maxnreg, **constexprs):
                inspect.signature(kernel.fn).bind(*args, **constexprs)
                grids.append((grid, constexprs["STAGES"]))
            return run

    monkeypatch.setattr(hopper_attention, "_warp_specialized_kernel", BindingStandIn())
    B, H, N, D, nq, nk = 2, 3, 300, 128, 3, 5
    q = torch.zeros(B, N, H, D, dtype=torch.bfloat16).transpose(1, 2)
    kq = vq = torch.zeros(B * H, nk * 64, D, dtype=torch.bfloat16)
    ints = torch.zeros(4, dtype=torch.int32)
    hopper_attention.launch(q, kq, vq, torch.empty_like(q), ints, ints, ints, ints, N, nk * 64, H, nq, nk, 0, 1, 10,
                            30, 1.0, stages=4)
    assert grids == [((nq, B * H), 4)]


def test_inputs_that_require_grad_are_refused_not_silently_detached():
    q, k, v = make_inputs(1, 2, LAYOUT.seq_len, 64, seed=12)
    n_blocks = -(-LAYOUT.seq_len // SMALL_BLOCK)
    kwargs = dict(layout=LAYOUT, orders=torch.tensor([0, 1]), block_size=SMALL_BLOCK, backend="triton",
                  block_mask=torch.ones(2, n_blocks, n_blocks, dtype=torch.bool))
    with pytest.raises(PAROInputError, match="inference-only"):
        paro_attention(q.requires_grad_(), k, v, **kwargs)
    with torch.no_grad():
        assert torch.isfinite(paro_attention(q, k, v, **kwargs)).all()


def rope_tables(S, D, seed, interleaved=False):
    """Random-angle RoPE tables [S, D] float32 (not repeat-interleaved unless asked, so each column's
    own cos/sin is what the convention must read)."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(S, D // 2 if interleaved else D, generator=g) * 2 * math.pi
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "fp8"), ("int8", "bf16"), ("int4", "int8")])
@pytest.mark.parametrize("tail", [True, False])
def test_fused_rope_matches_reference(qk, pv, D, tail):
    """rotary=(cos, sin): the op with the Triton RoPE pass equals the reference, which rotates with torch
    (K smoothing then sees the rotated keys in both). tail=True rotates only the grid tokens after the
    5-token prefix (CogVideoX), False all tokens (Flux, Wan); B=2, mixed orders, [B, N, H, D] storage."""
    B, H = 2, 3
    q, k, v = make_inputs(B, H, LAYOUT.seq_len, D, seq_major=True, seed=21 + D)
    S = LAYOUT.grid_tokens if tail else LAYOUT.seq_len
    rotary = rope_tables(S, D, seed=D + tail)
    n_blocks = -(-LAYOUT.seq_len // SMALL_BLOCK)
    mask = synthetic_block_mask(H, n_blocks, n_blocks, 0.6, generator=torch.Generator().manual_seed(D))
    kwargs = dict(layout=LAYOUT, orders=torch.tensor([2, 0, 5]), block_mask=mask, block_size=SMALL_BLOCK, qk=qk, pv=pv)
    out = paro_attention(q, k, v, backend="triton", rotary=rotary, **kwargs)
    ref = paro_attention(q, k, v, backend="torch", rotary=rotary, **kwargs)
    unrotated = paro_attention(q, k, v, backend="torch", **kwargs)
    bound = max(BOUND[pv], 1e-2) if qk == "int4" else BOUND[pv]
    assert rel_err(out, ref) <= bound, rel_err(out, ref)
    assert rel_err(unrotated, ref) > 10 * bound  # the rotation matters, so the test can fail



@pytest.mark.parametrize("B,H,N,D,S", [(2, 3, 70, 64, 61), (1, 4, 200, 128, 200), (2, 8, 40, 64, 33)])
@pytest.mark.parametrize("target_programs", [1, 4, 10**6])
def test_rotate_pass_equals_apply_rotary(B, H, N, D, S, target_programs, monkeypatch):
    """The RoPE pass with all heads in one program, groups of heads, or one head per program, a text
    prefix that is copied (S < N) or none, [B, N, H, D] storage, B > 1: equal to `apply_rotary` to
    float32 rounding (contracted multiply-adds may differ in the last bit before the cast)."""
    from paroattn.kernels import rotary
    from paroattn.kernels.reference import apply_rotary
    from paroattn.kernels.rotary import heads_per_program, rotate_qk

    monkeypatch.setattr(rotary, "_TARGET_PROGRAMS", target_programs)
    assert heads_per_program(1024, 1, 8) == (8 if target_programs <= 1024 else 1)
    assert heads_per_program(1, 1, 3) == (3 if target_programs == 1 else 1)

    q, k, _ = make_inputs(B, H, N, D, seq_major=True, seed=N)
    cos, sin = rope_tables(S, D, seed=S)
    q_rot, k_rot = rotate_qk(q, k, cos, sin)
    assert q_rot.is_contiguous() and q_rot.shape == q.shape
    for x, rotated in ((q, q_rot), (k, k_rot)):
        expected = apply_rotary(x, cos, sin)
        torch.testing.assert_close(rotated, expected, rtol=1e-3, atol=1e-3)
        assert torch.equal(rotated[:, :, : N - S], x[:, :, : N - S])  # the prefix is copied exactly
