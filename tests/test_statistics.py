"""The statistics launch of the quantized modes (`kernels/statistics.py`) against its torch definitions:
K smoothing's mean over every s-th token (`reference.key_smoothing_mean`) and V's per-channel max |V|,
on odd lengths, strided inputs, several programs per (batch, head) with ragged tiles, and NaN. On CPU the
kernel runs in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paroattn.kernels import reference, statistics  # noqa: E402

INTERPRETED = not torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"


def inputs(B, H, N, D, dtype, seed, seq_major):
    g = torch.Generator().manual_seed(seed)
    shape = (B, N, H, D) if seq_major else (B, H, N, D)
    k, v = (torch.randn(*shape, generator=g) * 3.0 + 2.0 for _ in range(2))  # keys with a common offset
    k, v = (t.to(dtype).to(DEVICE) for t in (k, v))
    return (k.transpose(1, 2), v.transpose(1, 2)) if seq_major else (k, v)


def expected(k, v, mean_stride):
    B, H, N, D = k.shape
    mean = reference.key_smoothing_mean(k.flatten(0, 1), mean_stride).view(B, H, D)
    amax = v.float().abs().amax(dim=2)
    return mean, amax


# (B, H, N, D, mean stride, split, block, dtype, [B, N, H, D] storage): odd lengths, strides that do and do
# not divide N, several programs per (batch, head) with a ragged last tile, programs with no sample left
CASES = [
    (1, 2, 149, 64, 7, 3, 16, torch.float16, True),
    (2, 3, 1001, 64, 16, 5, 32, torch.float16, True),
    (1, 1, 37, 128, 1, 2, 16, torch.bfloat16, False),
    (2, 1, 250, 64, 3, 4, 16, torch.bfloat16, True),
    (1, 2, 64, 64, 13, 4, 16, torch.float16, False),  # 5 samples over 4 programs (2, 2, 1, 0): the last sums none
    (1, 2, 300, 64, 2, None, None, torch.float16, True),  # the split and tile a launch picks
]


@pytest.mark.parametrize("B,H,N,D,mean_stride,split,block,dtype,seq_major", CASES)
@pytest.mark.slow
def test_statistics_equal_the_torch_formulas(B, H, N, D, mean_stride, split, block, dtype, seq_major):
    k, v = inputs(B, H, N, D, dtype, seed=N, seq_major=seq_major)
    out = statistics.Statistics(B, H, N, D, k.device, split=split, block=block)
    if split is not None:
        assert out.split == split  # the case holds the programs it names
    statistics.compute(k, v, out, mean_stride, k_mean=True, v_amax=True)
    mean, amax = expected(k, v, mean_stride)
    # the sum runs in another order than torch's: float32 rounding apart
    torch.testing.assert_close(out.k_mean, mean, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.v_amax, amax)  # a max is exact
    assert not out.arrivals.any()  # back to zero for the next launch
    # a second launch on the same buffers, other values: the counters work again
    k2, v2 = inputs(B, H, N, D, dtype, seed=N + 1, seq_major=seq_major)
    statistics.compute(k2, v2, out, mean_stride, k_mean=True, v_amax=True)
    mean2, amax2 = expected(k2, v2, mean_stride)
    torch.testing.assert_close(out.k_mean, mean2, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.v_amax, amax2)


@pytest.mark.parametrize("k_mean,v_amax", [(True, False), (False, True)])
def test_only_the_statistics_a_mode_needs_are_written(k_mean, v_amax):
    B, H, N, D = 1, 2, 90, 64
    k, v = inputs(B, H, N, D, torch.float16, seed=4, seq_major=True)
    out = statistics.Statistics(B, H, N, D, k.device, split=3, block=16)
    out.k_mean.fill_(-1.0)
    out.v_amax.fill_(-1.0)
    statistics.compute(k, v, out, 5, k_mean=k_mean, v_amax=v_amax)
    mean, amax = expected(k, v, 5)
    if k_mean:
        torch.testing.assert_close(out.k_mean, mean, rtol=1e-5, atol=1e-6)
        assert torch.all(out.v_amax == -1.0)
    else:
        assert torch.equal(out.v_amax, amax)
        assert torch.all(out.k_mean == -1.0)
    assert not out.arrivals.any()


def test_nan_reaches_its_channel_only():
    """A NaN in V's channel c makes that channel's max NaN (and so its scale, as the reference's); a NaN in a
    sampled key makes that channel's mean NaN. The other channels keep their values."""
    B, H, N, D = 1, 2, 120, 64
    k, v = inputs(B, H, N, D, torch.float16, seed=5, seq_major=False)
    k, v = k.clone(), v.clone()
    v[0, 1, 77, 9] = float("nan")  # in the second of three programs' tokens (48 each)
    k[0, 0, 3 * 20, 30] = float("nan")  # sample 20 at stride 3
    k[0, 1, 3 * 20 + 1, 31] = float("nan")  # not a sampled token: no effect
    out = statistics.Statistics(B, H, N, D, k.device, split=3, block=16)
    statistics.compute(k, v, out, 3, k_mean=True, v_amax=True)
    mean, amax = expected(k, v, 3)
    assert torch.isnan(out.v_amax[0, 1, 9]) and torch.isnan(amax[0, 1, 9])
    assert torch.isnan(out.k_mean[0, 0, 30]) and not torch.isnan(out.k_mean[0, 1]).any()
    torch.testing.assert_close(out.k_mean, mean, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.equal(out.v_amax.nan_to_num(-1.0), amax.nan_to_num(-1.0))


@pytest.mark.slow
def test_a_heads_mean_does_not_depend_on_the_other_heads_in_the_call():
    """Ulysses runs a slice of the heads per process: each head's statistics (and so the quantized op's
    output) must be bit-identical to the whole call's, so the split may not depend on the head count."""
    B, H, N, D = 1, 6, 4000, 64
    k, v = inputs(B, H, N, D, torch.float16, seed=3, seq_major=True)
    whole = statistics.Statistics(B, H, N, D, k.device)
    statistics.compute(k, v, whole, 1, k_mean=True, v_amax=True)
    for heads in (slice(0, 3), slice(4, 6)):
        part = statistics.Statistics(B, heads.stop - heads.start, N, D, k.device)
        assert part.split == whole.split
        statistics.compute(k[:, heads], v[:, heads], part, 1, k_mean=True, v_amax=True)
        assert torch.equal(part.k_mean, whole.k_mean[:, heads])
        assert torch.equal(part.v_amax, whole.v_amax[:, heads])
