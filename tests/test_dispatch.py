"""The kernel table: what each GPU runs for a key, what it refuses and why, and that `backend="auto"`
says that reason when it falls back to the reference."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton")

from paroattn import PAROInputError, TokenLayout, paro_attention  # noqa: E402
from paroattn.kernels import dispatch, hopper_attention  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_choices():
    dispatch._CHOICES.clear()
    yield
    dispatch._CHOICES.clear()


def test_every_table_entry_is_a_config_the_kernels_accept():
    for (arch, D, bq, bk, qk, pv), config in dispatch.TABLE.items():
        assert arch == dispatch.TUNED_ARCH and D in dispatch.HEAD_DIMS
        assert dispatch.config_problem(config, bq, bk, qk, pv) is None, (D, bq, bk, qk, pv, config)


def test_hopper_runs_the_table_entry(monkeypatch):
    monkeypatch.setattr(dispatch.triton, "__version__", hopper_attention.TESTED_TRITON[0] + ".0")
    gluon = dispatch.kernel_choice("sm90", 128, 128, 64, "bf16", "bf16")
    assert gluon.config == dispatch.TABLE[("sm90", 128, 128, 64, "bf16", "bf16")]
    assert gluon.warp_specialized == (hopper_attention.gluon is not None)
    triton_q = dispatch.kernel_choice("sm90", 64, 128, 64, "int8", "fp8")
    assert (triton_q.warp_specialized, triton_q.kv_tma, triton_q.q_tma, triton_q.refused) == (False, True, True, ())
    assert dispatch.kernel_choice("sm90", 64, 32, 32, "bf16", "bf16").config == dispatch.DEFAULT_CONFIG


def test_other_gpus_refuse_what_they_lack_and_keep_the_rest():
    ampere = dispatch.kernel_choice("sm80", 128, 128, 64, "bf16", "bf16")
    entry = dispatch.TABLE[("sm90", 128, 128, 64, "bf16", "bf16")]
    assert ampere.config == entry  # same warps and stages
    assert not (ampere.warp_specialized or ampere.kv_tma or ampere.q_tma)
    assert any("TMA" in r and "sm80" in r for r in ampere.refused)
    assert any("sm_90" in r for r in ampere.refused)
    blackwell = dispatch.kernel_choice("sm100", 128, 128, 64, "bf16", "bf16")
    assert blackwell.kv_tma and blackwell.q_tma and not blackwell.warp_specialized


def test_an_untested_triton_runs_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(dispatch.triton, "__version__", "9.9.0")
    choice = dispatch.kernel_choice("sm90", 128, 128, 64, "bf16", "bf16")
    assert not choice.warp_specialized and choice.q_tma
    assert any("9.9.0" in r for r in choice.refused)


@pytest.mark.parametrize("D,bq,bk,match", [(96, 64, 64, "head dims"), (64, 48, 64, "block sizes"),
                                           (128, 64, 256, "block sizes")])
def test_unsupported_keys_say_why(D, bq, bk, match):
    with pytest.raises(dispatch.KernelUnavailable, match=match):
        dispatch.kernel_choice("sm90", D, bq, bk, "bf16", "bf16")


def test_pins_replace_the_entry_and_are_validated():
    key = (64, 64, 64, "int8", "fp8")
    pinned = dispatch.KernelConfig(8, 2)
    dispatch.set_kernel_config(*key, pinned)
    try:
        assert dispatch.kernel_choice("sm90", *key).config == pinned
        assert dispatch.kernel_config(*key) == pinned
    finally:
        dispatch.set_kernel_config(*key, None)
    assert dispatch.kernel_choice("sm90", *key).config == dispatch.TABLE[("sm90", *key)]
    with pytest.raises(ValueError, match="warp_specialized"):
        dispatch.set_kernel_config(128, 128, 64, "int8", "fp8", dispatch.KernelConfig(4, 3, warp_specialized=True))


def test_auto_warns_with_the_tables_reason_and_runs_the_reference(monkeypatch):
    # a CUDA-looking call the kernels cannot take (head dim 96): auto says why, then runs the reference
    layout = TokenLayout(0, 1, 4, 8)
    q = torch.randn(1, 2, layout.seq_len, 96, dtype=torch.float16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(dispatch, "interpreting", lambda: True)
    mask = torch.ones(2, 1, 1, dtype=torch.bool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = paro_attention(q, q, q, layout=layout, orders=torch.tensor([0, 1]), block_mask=mask, block_size=32,
                             qk="bf16", pv="bf16", backend="auto")
    monkeypatch.undo()
    reasons = [str(w.message) for w in caught]
    assert any("head dims (64, 128); got D=96" in r and "torch reference" in r for r in reasons), reasons
    expected = paro_attention(q, q, q, layout=layout, orders=torch.tensor([0, 1]), block_mask=mask, block_size=32,
                              backend="torch")
    assert torch.equal(out, expected)
    q = q.to("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter takes CPU tensors
    with pytest.raises(PAROInputError, match="head dims"):
        paro_attention(q, q, q, layout=layout, orders=torch.tensor([0, 1]), block_mask=mask,
                       block_size=32, backend="triton")
