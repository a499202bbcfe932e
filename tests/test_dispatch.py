"""The one decision point: what `dispatch.resolve` runs for a call on each GPU, what it refuses and why,
that `backend="auto"` says that reason when it falls back to the reference, and that the runtime keeps a
decision per call key until a config is pinned."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

pytest.importorskip("triton")

from paroattn import PAROInputError, TokenLayout, paro_attention  # noqa: E402
from paroattn.kernels import dispatch, hopper_attention, runtime  # noqa: E402
from paroattn.kernels.dispatch import GLUON, TORCH, TRITON, Call, Launch, Refusal, resolve  # noqa: E402

HOPPER = dispatch.GPU("sm90", cuda=True, triton=True, tma=True, wgmma=True)
AMPERE = dispatch.GPU("sm80", cuda=True, triton=True, tma=False, wgmma=False)
BLACKWELL = dispatch.GPU("sm100", cuda=True, triton=True, tma=True, wgmma=False)


def call(gpu=HOPPER, D=128, bq=128, bk=64, qk="bf16", pv="bf16", **facts) -> Call:
    return Call(gpu, D, facts.pop("dtype", torch.bfloat16), bq, bk, qk, pv, **facts)


@pytest.fixture
def tested_triton(monkeypatch):
    import triton

    monkeypatch.setattr(triton, "__version__", hopper_attention.TESTED_TRITON[0] + ".0")


def test_every_table_entry_is_a_config_the_kernels_accept():
    for (D, bq, bk, qk, pv), config in dispatch.TABLE.items():
        assert D in dispatch.HEAD_DIMS
        assert dispatch.config_problem(config, bq, bk, qk, pv) is None, (D, bq, bk, qk, pv, config)


def test_hopper_runs_the_table_entry(tested_triton):
    gluon = resolve(call())
    assert gluon.kernel == (GLUON if hopper_attention.gluon is not None else TRITON)
    assert gluon.config == dispatch.TABLE[(128, 128, 64, "bf16", "bf16")]
    triton_q = resolve(call(D=64, qk="int8", pv="fp8"), "triton")  # ("auto" prefers the CUDA kernels there)
    assert (triton_q.kernel, triton_q.kv_tma, triton_q.q_tma, triton_q.passed_over) == (TRITON, True, True, ())
    assert resolve(call(D=64, bq=32, bk=32)).config == dispatch.DEFAULT_CONFIG


def test_other_gpus_turn_off_what_they_lack_and_keep_the_rest(tested_triton):
    ampere = resolve(call(AMPERE))
    entry = dispatch.TABLE[(128, 128, 64, "bf16", "bf16")]
    assert ampere.kernel == TRITON and ampere.config == entry  # same warps and stages
    assert not (ampere.kv_tma or ampere.q_tma)
    assert any("sm_90" in r and "sm80" in r for r in ampere.passed_over)  # the Gluon kernel's reason
    assert any("TMA" in r and "sm80" in r for r in ampere.passed_over)
    blackwell = resolve(call(BLACKWELL))
    assert blackwell.kernel == TRITON and blackwell.kv_tma and blackwell.q_tma


@pytest.mark.parametrize("facts,reason", [
    (dict(key_mask=True), "key mask"),
    (dict(unit_stride=False), "unit stride"),
])
def test_calls_the_gluon_kernel_cannot_take_run_the_triton_kernel(tested_triton, facts, reason):
    launch = resolve(call(**facts))
    assert launch.kernel == TRITON and launch.q_tma  # the Triton kernel with the entry's other fields
    assert any(reason in r for r in launch.passed_over), launch.passed_over


def test_an_untested_triton_runs_the_triton_kernel(monkeypatch):
    import triton

    monkeypatch.setattr(triton, "__version__", "9.9.0")
    launch = resolve(call())
    assert launch.kernel == TRITON and launch.q_tma
    assert any("9.9.0" in r for r in launch.passed_over)


@pytest.mark.parametrize("facts,match", [
    (dict(D=96), "head dims"), (dict(D=64, bq=48), "block sizes"), (dict(bk=256), "block sizes"),
    (dict(dtype=torch.float32), "float16 or bfloat16"), (dict(gpu=dispatch.HOST), "needs CUDA tensors"),
])
def test_unsupported_calls_are_refused_with_the_reason(facts, match):
    refusal = resolve(call(**facts), "triton")
    assert isinstance(refusal, Refusal) and match in refusal.reason
    fallback = resolve(call(**facts), "auto")
    assert fallback.kernel == TORCH
    # off CUDA "auto" means the reference: nothing to warn about; on CUDA, the Triton family's reason
    assert fallback.fallback_reason == (None if facts.get("gpu") is dispatch.HOST else refusal.reason)


def test_torch_backend_is_the_reference_everywhere():
    for gpu in (HOPPER, AMPERE, dispatch.HOST, dispatch.INTERPRETER):
        assert resolve(call(gpu, D=96), "torch") == Launch(TORCH)


def test_interpreter_runs_triton_when_asked_and_the_reference_for_auto():
    assert resolve(call(dispatch.INTERPRETER, bq=16, bk=16), "triton").kernel == TRITON
    assert resolve(call(dispatch.INTERPRETER, bq=16, bk=16), "auto") == Launch(TORCH)


def test_pins_replace_the_entry_are_validated_and_drop_kept_decisions():
    key = (64, 64, 64, "int8", "fp8")
    kept = runtime.Runtime(torch.device("cpu"))
    kept._gpu = HOPPER
    runtime._RUNTIMES[torch.device("cpu", 99)] = kept  # a device's runtime, to see the pin reach it
    try:
        before = kept.decide(*key[:1], torch.bfloat16, *key[1:], False, True, "triton")
        assert before.config == dispatch.TABLE[key] and kept.decisions
        pinned = dispatch.KernelConfig(8, 2)
        runtime.set_kernel_config(*key, pinned)
        try:
            assert not kept.decisions  # decided again after a pin
            assert kept.decide(*key[:1], torch.bfloat16, *key[1:], False, True, "triton").config == pinned
            assert runtime.kernel_config(*key) == pinned
        finally:
            runtime.set_kernel_config(*key, None)
        assert resolve(call(D=64, bq=64, bk=64, qk="int8", pv="fp8")).config == dispatch.TABLE[key]
    finally:
        del runtime._RUNTIMES[torch.device("cpu", 99)]
    with pytest.raises(ValueError, match="warp_specialized"):
        runtime.set_kernel_config(128, 128, 64, "int8", "fp8", dispatch.KernelConfig(4, 3, warp_specialized=True))


def test_launch_describes_what_ran():
    launch = dataclasses.replace(resolve(call(AMPERE, D=64, qk="int8", pv="fp8")))
    text = launch.describe()
    assert text.startswith("triton, 4 warps x 3 stages") and "TMA loads need sm_90" in text


def test_auto_warns_with_the_reason_and_runs_the_reference(monkeypatch):
    # a CUDA-looking call the kernels cannot take (head dim 96): auto says why, then runs the reference
    layout = TokenLayout(0, 1, 4, 8)
    q = torch.randn(1, 2, layout.seq_len, 96, dtype=torch.float16)
    monkeypatch.setattr(dispatch, "gpu_of", lambda device: HOPPER)
    runtime.clear()
    mask = torch.ones(2, 1, 1, dtype=torch.bool)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = paro_attention(q, q, q, layout=layout, orders=torch.tensor([0, 1]), block_mask=mask, block_size=32,
                                 qk="bf16", pv="bf16", backend="auto")
        reasons = [str(w.message) for w in caught]
        assert any("head dims (64, 128); got D=96" in r and "torch reference" in r for r in reasons), reasons
        with pytest.raises(PAROInputError, match="head dims"):
            paro_attention(q, q, q, layout=layout, orders=torch.tensor([0, 1]), block_mask=mask,
                           block_size=32, backend="triton")
    finally:
        monkeypatch.undo()
        runtime.clear()
    expected = paro_attention(q, q, q, layout=layout, orders=torch.tensor([0, 1]), block_mask=mask, block_size=32,
                              backend="torch")
    assert torch.equal(out, expected)


def test_runtime_keeps_one_decision_per_key_and_clear_empties_every_cache():
    kept = runtime.runtime_of(torch.device("cpu"))
    kept.clear()
    first = kept.decide(64, torch.float16, 64, 64, "bf16", "bf16", False, True, "auto")
    assert kept.decide(64, torch.float16, 64, 64, "bf16", "bf16", False, True, "auto") is first
    assert first == Launch(TORCH)  # a CPU runtime: the reference for "auto"
    kept.workspaces["a set"] = kept.mask_lists["a mask"] = kept.orders[(0, 1)] = object()
    runtime.clear()
    assert not (kept.decisions or kept.orders or kept.workspaces or kept.mask_lists)


H100 = dispatch.GPU("sm90", cuda=True, triton=True, tma=True, wgmma=True, index=0, capability=(9, 0))


def test_cuda_backend_runs_the_sm90_kernels_where_they_take_the_call():
    launch = resolve(call(H100, qk="int8", pv="fp8"), "cuda")
    assert launch.kernel == dispatch.CUDA and launch.q_tma and launch.backend == "cuda" and launch.warning is None
    key_masked = resolve(call(H100, D=64, qk="int4", pv="fp8", key_mask=True), "cuda")
    assert key_masked.kernel == dispatch.CUDA  # the key padding mask is the CUDA kernels' too


@pytest.mark.parametrize("gpu,facts,match", [
    (H100, dict(), "qk='int8'/'int4' with pv='fp8'"),  # bf16 modes: not this family's
    (H100, dict(qk="int8", pv="fp8", bq=64), "128 x 64 blocks"),
    (AMPERE, dict(qk="int8", pv="fp8"), "sm_90 GPU"),
])
def test_cuda_backend_falls_back_to_triton_with_the_reason(tested_triton, gpu, facts, match):
    launch = resolve(call(gpu, **facts), "cuda")
    assert launch.kernel in (TRITON, GLUON) and match in launch.warning, launch


def test_a_failed_build_falls_back_to_triton_with_its_reason():
    failure = "the sm90 CUDA kernel could not be built: nvrtcCompileProgram failed (made up)"
    launch = resolve(call(H100, qk="int8", pv="fp8", cuda_build_problem=failure), "cuda")
    assert launch.kernel == TRITON and "nvrtcCompileProgram failed" in launch.warning
    assert isinstance(resolve(call(dispatch.HOST, qk="int8", pv="fp8"), "cuda"), Refusal)  # no GPU at all


def test_auto_prefers_the_cuda_kernels_only_where_measured_faster(monkeypatch):
    key = (128, 128, 64, "int8", "fp8")
    monkeypatch.setattr(dispatch, "CUDA_PREFERRED", set())
    assert resolve(call(H100, qk="int8", pv="fp8")).kernel == TRITON  # a key not measured faster
    monkeypatch.setattr(dispatch, "CUDA_PREFERRED", {key})
    assert resolve(call(H100, qk="int8", pv="fp8")).kernel == dispatch.CUDA
    failure = "the sm90 CUDA kernel could not be built: no libnvrtc (made up)"
    fallback = resolve(call(H100, qk="int8", pv="fp8", cuda_build_problem=failure))
    assert fallback.kernel == TRITON and "no libnvrtc" in fallback.warning


INT8_FP8 = (128, 128, 64, "int8", "fp8")


@pytest.mark.parametrize("backend,key,preferred,builds", [
    ("cuda", INT8_FP8, False, True),  # asked for
    ("auto", INT8_FP8, True, True),  # measured faster there
    ("auto", INT8_FP8, False, False),  # not measured faster: never built
    ("triton", INT8_FP8, True, False),
    ("cuda", (128, 128, 64, "bf16", "bf16"), False, False),  # a call the family does not take: nothing to build
])
def test_the_runtime_builds_the_cuda_kernel_only_where_it_may_run(monkeypatch, backend, key, preferred, builds):
    """Deciding a call builds the sm90 kernel as an explicit step of the runtime, once, only where the decision
    may pick it; `resolve` itself only reads the outcome from the call."""
    from paroattn.kernels import sm90

    built = []
    monkeypatch.setattr(sm90, "build", lambda head_dim, dtype, device, k_scale: built.append((head_dim, dtype, k_scale))
                        or "kernel")
    monkeypatch.setattr(dispatch, "CUDA_PREFERRED", {INT8_FP8} if preferred else set())
    device_runtime = runtime.Runtime(torch.device("cuda", 0))
    device_runtime._gpu = H100
    D, bq, bk, qk, pv = key
    decision = device_runtime.decide(D, torch.bfloat16, bq, bk, qk, pv, False, True, backend)
    device_runtime.decide(D, torch.bfloat16, bq, bk, qk, pv, True, True, backend)  # another key, same kernel
    assert built == ([(D, torch.bfloat16, "block")] if builds else [])
    assert decision.kernel == (dispatch.CUDA if builds else TRITON)
    if builds:
        assert device_runtime.cuda_kernel(D, torch.bfloat16) == "kernel"


def test_the_runtime_builds_one_cuda_kernel_per_k_scale(monkeypatch):
    """K's scales per key block and per key are two builds of the sm90 kernel: each call runs its own."""
    from paroattn.kernels import sm90

    built = []
    monkeypatch.setattr(sm90, "build", lambda head_dim, dtype, device, k_scale: built.append(k_scale)
                        or f"kernel {k_scale}")
    device_runtime = runtime.Runtime(torch.device("cuda", 0))
    device_runtime._gpu = H100
    for k_scale in ("block", "token", "token"):
        decision = device_runtime.decide(128, torch.bfloat16, 128, 64, "int8", "fp8", False, True, "cuda", k_scale)
        assert decision.kernel == dispatch.CUDA
    assert built == ["block", "token"]
    assert device_runtime.cuda_kernel(128, torch.bfloat16, "token") == "kernel token"
    assert device_runtime.cuda_kernel(128, torch.bfloat16) == "kernel block"
