"""The Triton kernels' key padding mask (`suffix_mask`: padded text after the grid, HunyuanVideo) against the
torch reference, in the interpreter on CPU (fp16 inputs: its bf16 dot is wrong; 16-token blocks).

Key blocks that overlap the suffix run with a column mask after the unmasked main loop. The checks compare the
kernel with the reference on the rows the mask changes (the rows where the reference with and without the mask
differ), per batch element, so a kernel that ignores the mask, reads another batch element's mask or masks from
a shifted offset fails; and they cover suffixes shorter and longer than a block and not multiples of it, a
prefix and a suffix together, head dims 64 and 128, every PV mode, mixed orders per head, a block of padding
only before one with real keys, and rows whose attended keys are all padding (exact zeros, never NaN).
"""

from __future__ import annotations

import math

import kernel_calls
import pytest
import torch
from test_kernels import (
    BOUND,
    DEVICE,
    SMALL_BLOCK,
    _rtne_fp8_cast_in_interpreter,  # noqa: F401  (the interpreter's fp8 cast, fixed)
    make_inputs,
    rel_err,
)

from paroattn import TokenLayout, paro_attention
from paroattn.attention import decide
from paroattn.kernels.block_lists import ActiveBlocks
from paroattn.kernels.block_sparse_attention import _attention_kernel
from paroattn.kernels.runtime import PROCESS

MODES = [("bf16", "bf16"), ("int8", "fp8"), ("int8", "int8")]


def suffix_masks(B: int, suffix: int) -> torch.Tensor:
    """A different padding per batch element: a prompt of a few tokens, then every third token, then the
    first block's worth of padding followed by real tokens (a block of padding only before a kept one)."""
    patterns = [
        torch.arange(suffix) < min(3, suffix),
        torch.arange(suffix) % 3 == 1,
        torch.arange(suffix) >= min(SMALL_BLOCK, suffix - 1),
    ]
    return torch.stack([patterns[b % len(patterns)] for b in range(B)]).to(DEVICE)


def random_block_mask(H, n, seed, density=0.5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(H, n, n, generator=g) < density
    mask[:, torch.arange(n), torch.arange(n)] = True  # no empty row: every row attends something
    return mask


def check_against_reference(layout, B, H, D, qk, pv, suffix_mask, block_mask, orders, seed=0):
    """Kernel vs reference, on all rows and on the rows the padding changes, per batch element."""
    q, k, v = make_inputs(B, H, layout.seq_len, D, seed=seed)
    kwargs = dict(layout=layout, orders=orders, block_mask=block_mask, block_size=SMALL_BLOCK, qk=qk, pv=pv)
    out = paro_attention(q, k, v, backend="triton", suffix_mask=suffix_mask, **kwargs)
    ref = paro_attention(q, k, v, backend="torch", suffix_mask=suffix_mask, **kwargs)
    unmasked = paro_attention(q, k, v, backend="torch", **kwargs)
    assert torch.isfinite(out).all()
    bound = BOUND[pv]
    for b in range(B):
        assert rel_err(out[b], ref[b]) <= bound, (b, rel_err(out[b], ref[b]))
        # the rows the padding moves (reference with vs without the mask), where a wrong mask shows
        moved = (ref[b].float() - unmasked[b].float()).norm(dim=-1) > 0.1 * ref[b].float().norm(dim=-1)
        assert moved.sum() >= 4, "the test's padding must matter"
        err = rel_err(out[b][moved], ref[b][moved])
        assert err <= bound, (b, err, "on the rows the padding changes")
    return out, ref


# (layout, head dim): suffix 5 (shorter than a block, sharing one with the grid), 21 and 37 (longer than a
# block, not multiples of it; 37 after a 7-token prefix too), at head dims 64 and 128
CASES = [(TokenLayout(0, 2, 3, 5, suffix=5), 64), (TokenLayout(0, 3, 4, 3, suffix=21), 64),
         (TokenLayout(7, 2, 3, 4, suffix=37), 64), (TokenLayout(3, 1, 5, 7, suffix=21), 128)]


@pytest.mark.parametrize("qk,pv", MODES, ids=lambda m: m)
@pytest.mark.parametrize("layout,D", CASES, ids=[f"{layout}-D{D}" for layout, D in CASES])
@pytest.mark.slow
def test_padded_suffix_matches_reference(layout, D, qk, pv):
    B, H = 3, 3
    n = -(-layout.seq_len // SMALL_BLOCK)
    check_against_reference(layout, B, H, D, qk, pv, suffix_masks(B, layout.suffix),
                            random_block_mask(H, n, layout.suffix + D), torch.tensor([0, 3, 5]), seed=D)


@pytest.mark.parametrize("qk,pv", MODES, ids=lambda m: m)
@pytest.mark.slow
def test_rows_that_attend_only_padding_are_zero(qk, pv):
    """One block of grid tokens, then 1.5 blocks of text in key blocks 1 and 2. Item 0: all text padding, so
    its text query blocks, which attend the text blocks only, see padding only; item 1: text block 1 is
    padding and block 2 real, so its rows see a block of padding before a kept one. Zeros, exactly, where
    the reference has them; the other rows as the reference."""
    S = SMALL_BLOCK
    layout = TokenLayout(0, 2, 2, S // 4, suffix=S + S // 2)
    B, H, D = 2, 2, 64
    mask = torch.zeros(H, 3, 3, dtype=torch.bool)
    mask[:, 0, 0] = True
    mask[:, 1:, 1:] = True  # text queries attend the text keys only
    mask[0, 0, 1] = True  # head 0: grid queries attend text block 1 too
    suffix_mask = torch.zeros(B, layout.suffix, dtype=torch.bool, device=DEVICE)
    suffix_mask[1, S:] = True
    q, k, v = make_inputs(B, H, layout.seq_len, D, seed=11)
    kwargs = dict(layout=layout, orders=torch.tensor([0, 4]), block_mask=mask, block_size=SMALL_BLOCK, qk=qk, pv=pv,
                  suffix_mask=suffix_mask)
    out = paro_attention(q, k, v, backend="triton", **kwargs)
    ref = paro_attention(q, k, v, backend="torch", **kwargs)
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, :, S:], torch.zeros_like(out[0, :, S:]))
    assert torch.equal(ref[0, :, S:], torch.zeros_like(ref[0, :, S:]))
    assert out[1, :, S:].abs().amax(dim=-1).gt(0).all()  # item 1's text rows see its real text tokens
    for b in range(B):
        assert rel_err(out[b], ref[b]) <= BOUND[pv], (b, rel_err(out[b], ref[b]))


@pytest.mark.slow
def test_padded_keys_and_values_do_not_matter():
    """bf16 QK and PV: whatever a padded key and value hold (large keys, NaN values) the output is the same,
    bit for bit; the kernel stores padded V rows as zeros, so no 0 * NaN reaches the P V product."""
    layout = TokenLayout(0, 3, 4, 3, suffix=21)
    B, H, D = 2, 3, 64
    n = -(-layout.seq_len // SMALL_BLOCK)
    suffix_mask = suffix_masks(B, layout.suffix)
    q, k, v = make_inputs(B, H, layout.seq_len, D, seed=4)
    kwargs = dict(layout=layout, orders=torch.tensor([1, 2, 5]), block_mask=random_block_mask(H, n, 4, 0.6),
                  block_size=SMALL_BLOCK, suffix_mask=suffix_mask, backend="triton")
    out = paro_attention(q, k, v, **kwargs)
    padded = torch.cat([torch.zeros(B, layout.seq_len - layout.suffix, dtype=torch.bool, device=DEVICE),
                        ~suffix_mask], dim=1)[:, None, :, None]
    k2 = torch.where(padded, torch.full_like(k, 300.0), k)
    v2 = torch.where(padded, torch.full_like(v, float("nan")), v)
    again = paro_attention(q, k2, v2, **kwargs)
    assert torch.equal(again, out)


@pytest.mark.slow
def test_one_launch_keys_masks_of_other_strides_apart():
    """The launch cache (`CachedLauncher`) keys on the mask's strides and alignment: each launch of a key
    after its first skips Triton's specialization, so the most specialized mask goes first (contiguous,
    16-byte aligned), then one with another suffix stride, then a strided, misaligned view of a [B, 1, 1, N]
    model mask (what the HunyuanVideo adapter passes), then no mask, each twice, in one process. A key that
    left out the stride or the alignment would run the first mask's kernel on the others."""
    layout = TokenLayout(0, 2, 3, 5, suffix=11)
    B, H, D = 2, 2, 64
    N = layout.seq_len
    n = -(-N // SMALL_BLOCK)
    blocks = ActiveBlocks.from_mask(random_block_mask(H, n, 9, 0.7)).to(DEVICE)
    orders = torch.tensor([2, 3], dtype=torch.int32, device=DEVICE)
    q, k, v = make_inputs(B, H, N, D, seed=9)
    model_mask = torch.ones(B, 1, 1, N, dtype=torch.bool, device=DEVICE)
    model_mask[0, ..., N - 7:] = False
    model_mask[1, ..., N - 11:N - 5] = False
    view = model_mask[:, 0, 0, N - layout.suffix:]
    args = (q, k, v, orders, blocks.counts, blocks.indices, blocks.schedule, *layout.fields[:4], SMALL_BLOCK,
            SMALL_BLOCK, "bf16", "bf16", 1 / math.sqrt(D))
    reference = [paro_attention(q, k, v, layout=layout, orders=orders, block_mask=blocks, block_size=SMALL_BLOCK,
                                backend="torch", suffix_mask=m) for m in (view, None)]
    suffix_strided = view.t().contiguous().t()  # the same values, strides (1, B)
    direct = PROCESS.launcher(_attention_kernel).direct_launches
    for mask, want in ((view.contiguous(), reference[0]), (suffix_strided, reference[0]), (view, reference[0]),
                       (None, reference[1])):
        for _ in range(2):
            got = kernel_calls.launch(*args, key_mask=mask)
            assert rel_err(got, want) <= BOUND["bf16"]
    if DEVICE == "cuda":  # the interpreter always launches in full
        assert PROCESS.launcher(_attention_kernel).direct_launches - direct >= 4
    # the custom op that torch.compile records takes the mask too
    launch_code = decide(q, SMALL_BLOCK, SMALL_BLOCK, "bf16", "bf16", "triton", key_mask=True).encode()
    through_op = torch.ops.paroattn.block_sparse_attention(*args, launch_code, None, None, view)
    assert rel_err(through_op, reference[0]) <= BOUND["bf16"]



# -- on the GPU: the compiled kernels (Triton, and the Gluon kernel's selection) ------------------------------

# a short HunyuanVideo-like call: 5 x 30 x 52 video tokens, then 256 text tokens with 90 and 200 real ones
GPU_LAYOUT = TokenLayout(0, 5, 30, 52, suffix=256)
GPU_MODES = [("bf16", "bf16"), ("int8", "fp8"), ("int8", "int8"), ("int8", "bf16"), ("int4", "fp8")]
GPU_BOUND = {"bf16": 5e-3, "int8": 6e-2, "fp8": 4e-2}  # tests/test_kernels_gpu.py's


def gpu_inputs(B, H, N, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # [B, N, H, D] storage seen as [B, H, N, D], as the model passes them
    return [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
            for _ in range(3)]


def gpu_suffix_mask():
    real = torch.tensor([90, 200], device="cuda")
    return torch.arange(GPU_LAYOUT.suffix, device="cuda")[None, :] < real[:, None]


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(64, 64), (128, 64)], ids=str)
def test_padded_text_on_the_gpu_matches_reference(block):
    """Every mode at both tile shapes, per batch element and on the rows the padding moves; head 0's last query
    block attends the last key block only, which is padding in both items: exact zeros."""
    from paroattn.masks import synthetic_block_mask

    B, H, D, N = 2, 4, 128, GPU_LAYOUT.seq_len
    bq, bk = block
    mask = synthetic_block_mask(H, -(-N // bq), -(-N // bk), 0.4, generator=torch.Generator().manual_seed(3))
    mask[0, -1] = False
    mask[0, -1, -1] = True
    orders = torch.tensor([0, 2, 3, 5])
    suffix_mask = gpu_suffix_mask()
    q, k, v = gpu_inputs(B, H, N, D, seed=3)
    for qk, pv in GPU_MODES:
        kwargs = dict(layout=GPU_LAYOUT, orders=orders, block_mask=mask, block_size=block, qk=qk, pv=pv)
        out = paro_attention(q, k, v, backend="triton", suffix_mask=suffix_mask, **kwargs)
        ref = paro_attention(q, k, v, backend="torch", suffix_mask=suffix_mask, **kwargs)
        unmasked = paro_attention(q, k, v, backend="torch", **kwargs)
        assert not torch.isnan(out).any()
        last_rows = torch.arange(N, device="cuda") >= (N - 1) // bq * bq  # the suffix: reordered = original
        assert torch.equal(out[:, 0, last_rows], torch.zeros_like(out[:, 0, last_rows]))
        bound = GPU_BOUND[pv]
        for b in range(B):
            moved = (ref[b].float() - unmasked[b].float()).norm(dim=-1) > 0.1 * ref[b].float().norm(dim=-1)
            err, err_moved = rel_err(out[b], ref[b]), rel_err(out[b][moved], ref[b][moved])
            print(f"{block} {qk}/{pv} item {b}: rel err {err:.2e}, on the {int(moved.sum())} rows the padding "
                  f"moves {err_moved:.2e}")
            assert moved.sum() >= 100 and err <= bound and err_moved <= bound


@pytest.mark.gpu
def test_padded_calls_leave_the_gluon_kernel_for_the_triton_kernel(monkeypatch):
    """bf16 at D=128 and 128 x 64 blocks runs the Gluon kernel on sm_90 unless the call has a key mask: then
    the Triton kernel, which masks it. backend="auto" takes the kernels for padded calls, with no warning."""
    import warnings

    from paroattn.attention import decide
    from paroattn.kernels import dispatch, hopper_attention

    choice = decide(torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="cuda"), 128, 64, "bf16", "bf16", "triton")
    masked = decide(torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="cuda"), 128, 64, "bf16", "bf16", "triton",
                    key_mask=True)
    assert masked.kernel == dispatch.TRITON
    calls = []
    original = hopper_attention.launch
    monkeypatch.setattr(hopper_attention, "launch", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    B, H, D, N = 2, 4, 128, GPU_LAYOUT.seq_len
    q, k, v = gpu_inputs(B, H, N, D, seed=4)
    mask = torch.rand(H, -(-N // 128), -(-N // 64), generator=torch.Generator().manual_seed(4)) < 0.5
    kwargs = dict(layout=GPU_LAYOUT, orders=torch.tensor([1, 2, 4, 5]), block_mask=mask, block_size=(128, 64))
    suffix_mask = gpu_suffix_mask()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = paro_attention(q, k, v, backend="auto", suffix_mask=suffix_mask, **kwargs)
    assert not calls
    assert torch.equal(out, paro_attention(q, k, v, backend="triton", suffix_mask=suffix_mask, **kwargs))
    ref = paro_attention(q, k, v, backend="torch", suffix_mask=suffix_mask, **kwargs)
    assert rel_err(out, ref) <= GPU_BOUND["bf16"]
    paro_attention(q, k, v, backend="triton", **kwargs)
    # without a mask: Gluon where it runs
    assert len(calls) == int(choice.kernel == dispatch.GLUON), choice.passed_over


@pytest.mark.gpu
@pytest.mark.parametrize("qk,pv", [("int8", "fp8"), ("bf16", "bf16")])
def test_padded_text_under_torch_compile(qk, pv):
    """torch.compile(fullgraph=True) of a layer that slices the model's [B, 1, 1, N] mask: the custom op takes
    the strided mask; the same result as the eager call."""
    B, H, D, N = 2, 4, 128, GPU_LAYOUT.seq_len
    q, k, v = gpu_inputs(B, H, N, D, seed=5)
    blocks = ActiveBlocks.from_mask(torch.rand(H, -(-N // 64), -(-N // 64),
                                               generator=torch.Generator().manual_seed(5)) < 0.4).to("cuda")
    orders = torch.tensor([0, 1, 3, 4], device="cuda")
    model_mask = torch.ones(B, 1, 1, N, dtype=torch.bool, device="cuda")
    model_mask[..., N - GPU_LAYOUT.suffix:] = gpu_suffix_mask()[:, None, None, :]

    def layer(q, k, v, model_mask):
        return paro_attention(q, k, v, layout=GPU_LAYOUT, orders=orders, block_mask=blocks, block_size=64, qk=qk,
                              pv=pv, backend="triton", suffix_mask=model_mask[:, 0, 0, N - GPU_LAYOUT.suffix:])

    eager = layer(q, k, v, model_mask)
    compiled = torch.compile(layer, fullgraph=True)
    assert rel_err(compiled(q, k, v, model_mask), eager) <= 1e-6
    unmasked = torch.ones_like(model_mask)
    assert rel_err(compiled(q, k, v, unmasked), eager) > 1e-2  # the mask is an input of the graph, not a constant
