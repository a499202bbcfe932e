"""The sm_90a CUDA kernel family (`paroattn.kernels.sm90`): compile check on CPU (nvcc/ptxas, when
present), refusals, and on a GPU (`-m gpu`) the kernel against the torch reference, the NaN contract,
the fallback when NVRTC fails, and compute-sanitizer memcheck/racecheck."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from paroattn import TokenLayout
from paroattn.kernels import sm90
from paroattn.kernels.reference import paro_attention_reference

# relative L2 vs the reference in the same modes: fp8 P is rounded after the running max in the kernel and
# after the final max in the reference (tests/test_kernels_gpu.py's bound)
BOUND = 4e-2


# ---------------------------------------------------------------------------------------------
# CPU: the source compiles for sm_90a, without register spills, in every variant the family runs.


def _ptxas_report(head_dim: int, dtype: torch.dtype, warpgroups: int, tmp_path, qk_ahead: int | None = None,
                  options: dict[str, int] | None = None) -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    src = tmp_path / "attention.cu"
    src.write_text(sm90.source())
    variant = sm90.defines(head_dim, dtype, warpgroups)
    if qk_ahead is not None:  # the other schedule (its stages) than the head dim's default
        variant.update(PARO_QK_AHEAD=qk_ahead, PARO_STAGES=3 + qk_ahead)
    variant.update(options or {})
    defines = [f"-D{k}={v}" for k, v in variant.items()]
    result = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-std=c++17", "--use_fast_math", "-Xptxas", "-v",
                             *defines, "-o", str(tmp_path / "attention.cubin"), str(src)],
                            capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"sm_90a compile failed (D={head_dim}, {dtype}):\n{log[-4000:]}"
    return log


@pytest.mark.parametrize("qk_ahead", [None, "other"])
@pytest.mark.parametrize("head_dim,dtype,warpgroups", sm90.VARIANTS)
def test_every_variant_compiles_for_sm90a_without_spills(head_dim, dtype, warpgroups, qk_ahead, tmp_path):
    if qk_ahead == "other":
        if dtype != torch.bfloat16:
            pytest.skip("the output dtype changes only the epilogue: one dtype per schedule")
        qk_ahead = 3 - sm90.QK_AHEAD[head_dim]
    log = _ptxas_report(head_dim, dtype, warpgroups, tmp_path, qk_ahead)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    registers = re.findall(r"Used (\d+) registers", log)
    print(f"D={head_dim} {dtype} warpgroups={warpgroups}: registers {registers}, spills {spills}")
    assert spills and registers, f"no ptxas report in the log:\n{log[-2000:]}"
    assert all(s == ("0", "0") for s in spills), f"register spills (D={head_dim}, {dtype}):\n{log[-2000:]}"
    # ptxas serializes wgmma (and says so) when it cannot keep the accumulators in registers across them
    assert "wgmma" not in log.lower() or "serializ" not in log.lower(), log[-2000:]


# The warp-specialized kernel (not run by the family: docs/notes/sm90-kernel.md has its measurements) in the
# configurations measured there: a producer warpgroup, two consumers taking turns, softmax steps of 2 key blocks
# with the fp32 P V addition, or of 3 with P V accumulated into O.
WARP_SPECIALIZED = [
    {"PARO_PRODUCER": 1, "PARO_WARPGROUPS": 2, "PARO_STAGES": 8, "PARO_PINGPONG": 1, "PARO_STEP_BLOCKS": 2},
    {"PARO_PRODUCER": 1, "PARO_WARPGROUPS": 2, "PARO_STAGES": 10, "PARO_PINGPONG": 1, "PARO_STEP_BLOCKS": 3,
     "PARO_PV_INTO_O": 1},
]


@pytest.mark.parametrize("options", WARP_SPECIALIZED, ids=["two-block-steps", "three-block-steps-pv-into-o"])
@pytest.mark.parametrize("head_dim", sm90.HEAD_DIMS)
def test_warp_specialized_kernel_compiles_without_spills(head_dim, options, tmp_path):
    log = _ptxas_report(head_dim, torch.bfloat16, 2, tmp_path, options=options)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), log[-2000:]
    assert "serializ" not in log.lower(), log[-2000:]


def test_source_needs_no_headers():
    """NVRTC compiles the file as is: no #include (torch's wheel ships NVRTC, not a toolkit's headers)."""
    assert not re.search(r"^\s*#\s*include", sm90.source(), re.MULTILINE)


@pytest.mark.parametrize("change,expected", [
    (dict(arch=(8, 0)), "sm_90 GPU"), (dict(arch=None), "no CUDA device"), (dict(qk="bf16", pv="bf16"), "qk="),
    (dict(pv="int8"), "pv="), (dict(head_dim=96), "head dims"), (dict(bq=64), "blocks"),
    (dict(dtype=torch.float32), "bfloat16 or float16"),
])
def test_refusals_name_the_reason(change, expected):
    call = dict(q_shape=(1, 2, 300, 128), dtype=torch.bfloat16, head_dim=128, bq=128, bk=64, qk="int8", pv="fp8",
                has_key_mask=True, arch=(9, 0))
    assert sm90.refusal(**call) is None
    assert sm90.refusal(**{**call, "qk": "int4"}) is None
    reason = sm90.refusal(**{**call, **change})
    assert reason is not None and expected in reason


# ---------------------------------------------------------------------------------------------
# GPU: the kernel against the reference.

requires_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")


def rel_err(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def random_mask(H, N, density, seed, empty_rows=True):
    nq, nk = -(-N // 128), -(-N // 64)
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(H, nq, nk, generator=g) < density
    mask[:, torch.arange(nq), torch.clamp(2 * torch.arange(nq), max=nk - 1)] = True
    if empty_rows and nq > 1:
        mask[0, 1] = False  # a query block that attends nothing: zeros
        mask[-1, nq - 1] = False
    return mask


def make_inputs(B, H, N, D, dtype, seq_major, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (B, N, H, D) if seq_major else (B, H, N, D)
    qkv = [torch.randn(shape, device="cuda", dtype=dtype, generator=g) for _ in range(3)]
    qkv[1] = qkv[1] + 0.5 * torch.randn(D, device="cuda", generator=g).to(dtype)  # a K mean to smooth away
    return [t.transpose(1, 2) if seq_major else t for t in qkv]


def run_both(q, k, v, layout, orders, mask, qk="int8", suffix_mask=None, warpgroups=None):
    out = sm90.attention(q, k, v, layout=layout, orders=orders, block_mask=mask, qk=qk, suffix_mask=suffix_mask,
                         warpgroups=warpgroups)
    ref = paro_attention_reference(q, k, v, layout, orders.cpu(), mask.cuda(), 128, 64, qk, "fp8",
                                   suffix_mask=suffix_mask)
    return out, ref


# (B, H, layout, D, dtype, inputs stored [B, N, H, D]): odd lengths (partial last key and query blocks),
# prefix and suffix layouts, both head dims, both output dtypes, B > 1
CASES = [
    (2, 3, TokenLayout(7, 2, 5, 9), 64, torch.bfloat16, False),
    (1, 4, TokenLayout(0, 3, 17, 23), 128, torch.bfloat16, True),
    (2, 3, TokenLayout(226, 2, 15, 22), 64, torch.float16, True),
    (1, 2, TokenLayout(0, 4, 16, 16), 128, torch.float16, False),
    (2, 3, TokenLayout(0, 2, 6, 10, suffix=37), 128, torch.bfloat16, False),
]


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("density", [1.0, 0.5, 0.2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, density, warpgroups):
    B, H, layout, D, dtype, seq_major = CASES[case]
    N = layout.seq_len
    q, k, v = make_inputs(B, H, N, D, dtype, seq_major, seed=case)
    orders = torch.tensor([0, 3, 5, 2][:H], dtype=torch.int32)  # mixed orders per head
    mask = random_mask(H, N, density, seed=case + int(10 * density))
    out, ref = run_both(q, k, v, layout, orders, mask, warpgroups=warpgroups)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    print(f"case {case} N={N} D={D} d={density} warpgroups={warpgroups}: rel err {err:.3e}")
    assert err < BOUND
    assert_empty_rows_zero(out, ref, mask, layout, orders)


def assert_empty_rows_zero(out, ref, mask, layout, orders):
    """Rows of query blocks with no active key block are exactly zero."""
    from paroattn.layout import reorder_index

    for h in range(mask.shape[0]):
        for qb in (~mask[h].any(-1)).nonzero().flatten().tolist():
            rows = reorder_index(layout, int(orders[h]), device="cuda")[qb * 128:(qb + 1) * 128]
            assert (out[:, h, rows] == 0).all() and (ref[:, h, rows] == 0).all()


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("options", WARP_SPECIALIZED, ids=["two-block-steps", "three-block-steps-pv-into-o"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_warp_specialized_kernel_matches_reference(case, options, monkeypatch):
    """The warp-specialized kernel (launched through the family with its options) on the reference cases, at a
    density whose lists have odd lengths (a step past the list's end), with a key padding mask in the last."""
    family = sm90.defines
    monkeypatch.setattr(sm90, "defines", lambda d, dtype, w=None: {**family(d, dtype, w), **options})
    B, H, layout, D, dtype, seq_major = CASES[case]
    q, k, v = make_inputs(B, H, layout.seq_len, D, dtype, seq_major, seed=case)
    orders = torch.tensor([4, 1, 3, 0][:H], dtype=torch.int32)
    mask = random_mask(H, layout.seq_len, 0.5, seed=case + 20)
    suffix = None
    if layout.suffix:
        suffix = torch.ones(B, layout.suffix, dtype=torch.bool, device="cuda")
        suffix[0, 9:] = False
    out, ref = run_both(q, k, v, layout, orders, mask, suffix_mask=suffix, warpgroups=2)
    err = rel_err(out, ref)
    print(f"warp-specialized {options}: case {case} D={D}: rel err {err:.3e}")
    assert torch.isfinite(out).all() and err < BOUND
    assert_empty_rows_zero(out, ref, mask, layout, orders)


@requires_sm90
@pytest.mark.gpu
def test_matches_triton_kernel_on_the_same_prologue():
    """Same prologue buffers, same formulas: the two kernels differ only by summation order and the fp32
    addition of each block's P V (tighter than the reference bound, so a misplaced tile would show)."""
    from paroattn import paro_attention

    layout = TokenLayout(0, 3, 20, 30)
    B, H, D = 1, 4, 128
    q, k, v = make_inputs(B, H, layout.seq_len, D, torch.bfloat16, True, seed=9)
    orders = torch.tensor([1, 4, 0, 5])
    mask = random_mask(H, layout.seq_len, 0.4, seed=9)
    out = sm90.attention(q, k, v, layout=layout, orders=orders, block_mask=mask)
    triton_out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=mask, block_size=(128, 64),
                                qk="int8", pv="fp8", backend="triton")
    err = rel_err(out, triton_out)
    print(f"sm90 vs triton: rel err {err:.3e}")
    assert err < 1e-2


@requires_sm90
@pytest.mark.gpu
def test_key_padding_mask_matches_reference():
    layout = TokenLayout(0, 2, 6, 10, suffix=150)  # suffix longer than two key blocks, not a multiple of one
    B, H, D = 3, 2, 64
    q, k, v = make_inputs(B, H, layout.seq_len, D, torch.bfloat16, False, seed=3)
    suffix = torch.zeros(B, layout.suffix, dtype=torch.bool, device="cuda")
    suffix[0, :5] = True  # a short prompt
    suffix[1, ::3] = True
    suffix[2, 64:] = True  # a key block of padding only before kept keys
    orders = torch.tensor([2, 5], dtype=torch.int32)
    mask = random_mask(H, layout.seq_len, 0.6, seed=3, empty_rows=False)
    out, ref = run_both(q, k, v, layout, orders, mask, suffix_mask=suffix)
    unmasked = paro_attention_reference(q, k, v, layout, orders, mask.cuda(), 128, 64, "int8", "fp8")
    err, moved = rel_err(out, ref), rel_err(unmasked, ref)
    print(f"key mask: rel err {err:.3e} (the mask moves the result by {moved:.3e})")
    assert torch.isfinite(out).all() and err < BOUND < moved


@requires_sm90
@pytest.mark.gpu
def test_int4_values_match_reference():
    layout = TokenLayout(13, 2, 7, 11)
    q, k, v = make_inputs(2, 2, layout.seq_len, 64, torch.bfloat16, False, seed=4)
    orders = torch.tensor([3, 1], dtype=torch.int32)
    out, ref = run_both(q, k, v, layout, orders, random_mask(2, layout.seq_len, 0.5, seed=4), qk="int4")
    assert rel_err(out, ref) < BOUND


@requires_sm90
@pytest.mark.gpu
def test_nan_reaches_the_outputs_the_contract_names():
    """A NaN in q makes its query block NaN (int8 QK: per-block scale); a NaN in v[:, c] channel c of every
    row that attends anything; rows of empty query blocks stay zero."""
    layout = TokenLayout(0, 2, 10, 20)
    B, H, D, N = 1, 2, 128, 400
    q, k, v = make_inputs(B, H, N, D, torch.bfloat16, False, seed=5)
    q[0, 0, 5, 3] = float("nan")  # query block of reordered position of token 5 (order 0: identity) -> block 0
    v[0, 1, 17, 9] = float("nan")
    orders = torch.tensor([0, 4], dtype=torch.int32)
    mask = random_mask(H, N, 0.5, seed=5)
    out, ref = run_both(q, k, v, layout, orders, mask)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out[0, 0, :128].isnan().all() and not out[0, 0, 128:].isnan().any()
    assert out[0, 1, :, 9].isnan().sum() > 0 and not out[0, 1, :, [8, 10]].isnan().any()
    finite = ~ref.isnan()
    assert rel_err(out[finite], ref[finite]) < BOUND


@requires_sm90
@pytest.mark.gpu
def test_nvrtc_failure_gives_a_reason_and_no_result(monkeypatch, tmp_path):
    from paroattn.kernels.sm90 import runtime

    def broken(*args, **kwargs):
        raise runtime.KernelLoadError("NVRTC could not compile paro_attention_int8_fp8: injected failure")

    monkeypatch.setenv("PAROATTN_CACHE", str(tmp_path))  # an empty cache: the compile must run
    monkeypatch.setattr(runtime, "_nvrtc_compile", broken)
    monkeypatch.setattr(sm90, "_FAILURES", {})
    monkeypatch.setattr(sm90, "_KERNELS", {})
    device = torch.device("cuda", torch.cuda.current_device())
    reason = sm90.load_failure(64, torch.float16, device)
    assert reason is not None and "injected failure" in reason and "could not be built" in reason
    layout = TokenLayout(0, 1, 8, 16)
    q, k, v = make_inputs(1, 1, layout.seq_len, 64, torch.float16, False, seed=6)
    with pytest.raises(runtime.KernelLoadError, match="injected failure"):
        sm90.attention(q, k, v, layout=layout, orders=torch.tensor([0]), block_mask=random_mask(1, 128, 1.0, 6))


@requires_sm90
@pytest.mark.gpu
def test_disk_cache_serves_a_second_process(tmp_path):
    """A cubin compiled once is read back by a later process (no NVRTC call there)."""
    script = textwrap.dedent("""
        import torch
        from paroattn.kernels import sm90
        from paroattn.kernels.sm90 import runtime
        calls = []
        original = runtime._nvrtc_compile
        runtime._nvrtc_compile = lambda *a: calls.append(1) or original(*a)
        assert sm90.load_failure(64, torch.bfloat16, torch.device("cuda", 0)) is None
        print("nvrtc calls", len(calls))
        """)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), PAROATTN_CACHE=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    second = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "nvrtc calls 1" in first.stdout, first.stdout + first.stderr
    assert "nvrtc calls 0" in second.stdout, second.stdout + second.stderr
    assert list((tmp_path / "cubin").glob("*.cubin"))


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tool):
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        pytest.skip("compute-sanitizer not found")
    script = textwrap.dedent("""
        import torch
        from paroattn import TokenLayout
        from paroattn.kernels import sm90
        for layout, D in ((TokenLayout(7, 2, 5, 9), 64), (TokenLayout(0, 2, 6, 10, suffix=37), 128)):
            H = 2
            q, k, v = (torch.randn(2, H, layout.seq_len, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            nq, nk = -(-layout.seq_len // 128), -(-layout.seq_len // 64)
            mask = torch.rand(H, nq, nk) < 0.6
            mask[0, 0] = False
            suffix = None
            if layout.suffix:
                suffix = torch.rand(2, layout.suffix, device="cuda") < 0.5
            for warpgroups in (1, 2):
                sm90.attention(q, k, v, layout=layout, orders=torch.tensor([1, 4]), block_mask=mask,
                               suffix_mask=suffix, warpgroups=warpgroups)
            torch.cuda.synchronize()
        print("sanitized run done")
        """)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    result = subprocess.run([sanitizer, "--tool", tool, sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=500)
    log = result.stdout + result.stderr
    print(log[-2000:])
    assert "sanitized run done" in log
    assert "ERROR SUMMARY: 0 errors" in log or "RACECHECK SUMMARY: 0 hazards" in log



# ---------------------------------------------------------------------------------------------
# Through the op: paro_attention(backend="cuda") runs this family (dispatch.resolve), also on repeated calls
# into a kept buffer set and under torch.compile; a failed build falls back to the Triton kernels, warning.


@requires_sm90
@pytest.mark.gpu
def test_op_with_cuda_backend_runs_these_kernels_call_after_call():
    from paroattn import paro_attention
    from paroattn.attention import decide
    from paroattn.kernels import dispatch

    B, H, layout, D = 2, 3, TokenLayout(226, 2, 15, 22), 64
    N = layout.seq_len
    mask = random_mask(H, N, 0.5, 11)
    orders = torch.tensor([0, 3, 5])
    kwargs = dict(layout=layout, orders=orders, block_mask=mask, block_size=(128, 64), qk="int8", pv="fp8")
    assert decide(torch.empty(1, 1, 1, D, device="cuda", dtype=torch.bfloat16), 128, 64, "int8", "fp8",
                  "cuda").kernel == dispatch.CUDA
    outs = []
    for seed in (21, 22, 21):  # the third call repeats the first's inputs: replays must launch this kernel too
        q, k, v = make_inputs(B, H, N, D, torch.bfloat16, True, seed)
        out = paro_attention(q, k, v, backend="cuda", **kwargs)
        direct = sm90.attention(q, k, v, layout=layout, orders=orders, block_mask=mask)
        assert torch.equal(out, direct), seed
        outs.append(out.clone())
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])

    from paroattn.kernels.block_lists import ActiveBlocks

    lists = {**kwargs, "block_mask": ActiveBlocks.from_mask(mask).to("cuda")}  # what processors pass

    def layer(q, k, v):
        return paro_attention(q, k, v, backend="cuda", **lists)

    compiled = torch.compile(layer, fullgraph=True)
    q, k, v = make_inputs(B, H, N, D, torch.bfloat16, True, 23)
    assert torch.equal(compiled(q, k, v), layer(q, k, v))


@requires_sm90
@pytest.mark.gpu
def test_op_falls_back_to_triton_with_one_warning_when_the_build_fails(monkeypatch, tmp_path):
    import warnings

    from paroattn import paro_attention
    from paroattn.kernels import runtime as op_runtime
    from paroattn.kernels.sm90 import runtime

    def broken(*args, **kwargs):
        raise runtime.KernelLoadError("NVRTC could not compile paro_attention_int8_fp8: injected failure")

    monkeypatch.setenv("PAROATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(runtime, "_nvrtc_compile", broken)
    monkeypatch.setattr(sm90, "_FAILURES", {})
    monkeypatch.setattr(sm90, "_KERNELS", {})
    op_runtime.clear()
    try:
        B, H, layout, D = 1, 2, TokenLayout(0, 3, 17, 23), 128
        q, k, v = make_inputs(B, H, layout.seq_len, D, torch.bfloat16, False, 31)
        kwargs = dict(layout=layout, orders=torch.tensor([1, 4]), block_mask=random_mask(H, layout.seq_len, 0.5, 31),
                      block_size=(128, 64), qk="int8", pv="fp8")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = paro_attention(q, k, v, backend="cuda", **kwargs)
        messages = [str(w.message) for w in caught]
        assert any("injected failure" in m and "Triton kernels run this call" in m for m in messages), messages
        assert torch.equal(out, paro_attention(q, k, v, backend="triton", **kwargs))
    finally:
        op_runtime.clear()
