"""The sm_90a CUDA kernel family (`paroattn.kernels.sm90`): compile check on CPU (nvcc/ptxas, when
present), refusals, and on a GPU (`-m gpu`) the kernel against the torch reference, the NaN contract,
the fallback when NVRTC fails, and compute-sanitizer memcheck/racecheck."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import kernel_calls
import pytest
import torch

from paroattn import TokenLayout
from paroattn.kernels import sm90
from paroattn.kernels.reference import paro_attention_reference
from paroattn.kernels.runtime import runtime_of

ROOT = Path(__file__).resolve().parents[1]

# relative L2 vs the reference in the same modes: fp8 P is rounded after the running max in the kernel and
# after the final max in the reference (tests/test_kernels_gpu.py's bound)
BOUND = 4e-2


# ---------------------------------------------------------------------------------------------
# CPU: the source compiles for sm_90a in every variant the family runs: no register spills, under the register
# ceiling that gives its CTAs per SM, and the unmasked key loop within its instruction budget
# (benchmarks/kernel_compile_check.py --sm90 prints the same).


def _compile_check():
    spec = importlib.util.spec_from_file_location("kernel_compile_check", ROOT / "benchmarks" / "kernel_compile_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("k_scale", sm90.K_SCALES)
@pytest.mark.parametrize("head_dim,dtype", sm90.VARIANTS)
def test_every_variant_compiles_for_sm90a_within_its_register_and_instruction_budgets(head_dim, dtype, k_scale,
                                                                                      tmp_path):
    check = _compile_check()
    if shutil.which("nvcc") is None or check.cuobjdump() is None:
        pytest.skip("nvcc or cuobjdump not found")
    report = check.sm90_compile(head_dim, dtype == torch.bfloat16, tmp_path, k_scale)
    print(f"D={head_dim} {dtype} k_scale={k_scale}: {report['registers']} registers, {report['spill_bytes']} spill "
          f"bytes, {report['loop_instructions_per_64_keys']} instructions per 64 keys")
    assert report["spill_bytes"] == 0, report["log"][-2000:]
    assert report["registers"] <= sm90.REGISTER_CEILING[head_dim], report["log"][-2000:]
    assert not report["serialized_wgmma"], report["log"][-2000:]
    assert report["loop_instructions_per_64_keys"] <= check.SM90_MAX_LOOP_INSTRUCTIONS[k_scale]


def test_key_loop_counter_finds_the_unmasked_loop():
    """The SASS counter takes the backward branch around IGMMA.64x128 with no global load, and refuses SASS
    without one (a renamed instruction must fail the check, not pass it)."""
    check = _compile_check()

    def line(address, text):
        return f"        /*{address:04x}*/                   {text} ;"

    masked = [line(0x100, "LDG.E R2, desc[UR4][R2.64]"), line(0x110, "IGMMA.64x128x32.S8.S8 R24, gdesc[UR8], RZ"),
              line(0x120, "BRA 0x100")]
    unmasked = [line(0x200, "IGMMA.64x128x32.S8.S8 R24, gdesc[UR8], RZ"), line(0x210, "FFMA R1, R2, R3, R4"),
                line(0x220, "@!P0 BRA 0x200")]
    assert check.key_loop_instructions("\n".join(masked + unmasked)) == (3, 128)
    with pytest.raises(ValueError, match="no unmasked key loop"):
        check.key_loop_instructions("\n".join(masked))


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


def test_tensor_maps_refuse_buffers_tma_cannot_read():
    """Checked before any driver call: contiguous 8-bit buffers at 16-byte aligned addresses."""
    kq = torch.zeros(2, 128, 64, dtype=torch.int8)
    for bad in (kq.transpose(1, 2), kq.to(torch.bfloat16), kq.flatten()[1:].view(1, 1, -1)):
        with pytest.raises(ValueError, match="contiguous 8-bit"):
            sm90.tensor_maps(kq, bad, kq)


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


def run_both(q, k, v, layout, orders, mask, qk="int8", suffix_mask=None, k_scale="block"):
    out = kernel_calls.sm90_attention(q, k, v, layout=layout, orders=orders, block_mask=mask, qk=qk,
                                      suffix_mask=suffix_mask, k_scale=k_scale)
    ref = paro_attention_reference(q, k, v, layout, orders.cpu(), mask.cuda(), 128, 64, qk, "fp8",
                                   suffix_mask=suffix_mask, k_scale=k_scale)
    return out, ref


def mixed_key_norms(k, seed, spread=1.0):
    """k with its keys' norms spread (a factor exp(spread * N(0, 1)) per key), in place: per-key K scales then
    differ from per-block ones, so a kernel that mixed up which scale goes with which key fails."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return k.mul_(torch.exp(spread * torch.randn(*k.shape[:-1], 1, device="cuda", generator=g)).to(k.dtype))


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
@pytest.mark.parametrize("k_scale", ["block", "token"])
@pytest.mark.parametrize("density", [1.0, 0.5, 0.2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, density, k_scale):
    B, H, layout, D, dtype, seq_major = CASES[case]
    N = layout.seq_len
    q, k, v = make_inputs(B, H, N, D, dtype, seq_major, seed=case)
    if k_scale == "token":
        mixed_key_norms(k, seed=case)
    orders = torch.tensor([0, 3, 5, 2][:H], dtype=torch.int32)  # mixed orders per head
    mask = random_mask(H, N, density, seed=case + int(10 * density))
    out, ref = run_both(q, k, v, layout, orders, mask, k_scale=k_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    print(f"case {case} N={N} D={D} d={density} k_scale={k_scale}: rel err {err:.3e}")
    assert err < BOUND
    assert_empty_rows_zero(out, ref, mask, layout, orders)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("k_scale", ["block", "token"])
@pytest.mark.parametrize("head_dim", sm90.HEAD_DIMS)
@pytest.mark.parametrize("active", [1, 2, 3, 4, 5, 8, 9])
def test_every_list_length_and_step_split(head_dim, active, k_scale):
    """Lists of 1 to 9 blocks: steps of two blocks, the odd block's step, the partial last block (masked) at the
    end of a pair or alone; the blocks are spread (TMA coordinates of distant blocks) and differ per query
    block and head. Per key, the scales of consecutive steps alternate between two shared buffers."""
    layout = TokenLayout(0, 2, 10, 29)  # N = 580: 10 key blocks, the last partial; 5 query blocks
    B, H, N = 2, 2, layout.seq_len
    nq, nk = -(-N // 128), -(-N // 64)
    g = torch.Generator().manual_seed(active)
    mask = torch.zeros(H, nq, nk, dtype=torch.bool)
    for h in range(H):
        for qb in range(nq):
            mask[h, qb, torch.randperm(nk, generator=g)[:active]] = True
    q, k, v = make_inputs(B, H, N, head_dim, torch.bfloat16, False, seed=40 + active)
    if k_scale == "token":
        mixed_key_norms(k, seed=40 + active)
    orders = torch.tensor([1, 4], dtype=torch.int32)
    out, ref = run_both(q, k, v, layout, orders, mask, k_scale=k_scale)
    err = rel_err(out, ref)
    print(f"{active} active blocks, D={head_dim}, k_scale={k_scale}: rel err {err:.3e}")
    assert torch.isfinite(out).all() and err < BOUND


def assert_empty_rows_zero(out, ref, mask, layout, orders):
    """Rows of query blocks with no active key block are exactly zero."""
    from paroattn.layout import reorder_index

    for h in range(mask.shape[0]):
        for qb in (~mask[h].any(-1)).nonzero().flatten().tolist():
            rows = reorder_index(layout, int(orders[h]), device="cuda")[qb * 128:(qb + 1) * 128]
            assert (out[:, h, rows] == 0).all() and (ref[:, h, rows] == 0).all()


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", sm90.HEAD_DIMS)
def test_per_key_scales_go_with_their_keys(head_dim):
    """k_scale="token" on keys whose norms span decades: the kernel lands far closer to the reference per key than
    to the one per key block (a scale applied to the wrong column, or one per block, would not)."""
    layout = TokenLayout(0, 3, 17, 23)
    q, k, v = make_inputs(1, 4, layout.seq_len, head_dim, torch.bfloat16, False, seed=50)
    mixed_key_norms(k, seed=51, spread=2.0)
    orders = torch.tensor([0, 3, 5, 2], dtype=torch.int32)
    mask = random_mask(4, layout.seq_len, 0.5, seed=52)
    out, ref = run_both(q, k, v, layout, orders, mask, k_scale="token")
    per_block = paro_attention_reference(q, k, v, layout, orders, mask.cuda(), 128, 64, "int8", "fp8")
    err, other = rel_err(out, ref), rel_err(out, per_block)
    print(f"D={head_dim}: rel err {err:.3e} to the reference per key, {other:.3e} to the one per block")
    assert err < BOUND and 2 * err < other


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("k_scale", ["block", "token"])
def test_matches_triton_kernel_on_the_same_prologue(k_scale):
    """Same prologue buffers, same formulas: the two kernels differ by summation order, the fp32 addition of each
    step's P V, and the running max P is rounded to e4m3 after (the Triton kernel's per 64-key block, this one's
    per step of two blocks; 1.04e-2 apart here on an H100). A misplaced tile would be off by far more."""
    from paroattn import paro_attention

    layout = TokenLayout(0, 3, 20, 30)
    B, H, D = 1, 4, 128
    q, k, v = make_inputs(B, H, layout.seq_len, D, torch.bfloat16, True, seed=9)
    orders = torch.tensor([1, 4, 0, 5])
    mask = random_mask(H, layout.seq_len, 0.4, seed=9)
    out = kernel_calls.sm90_attention(q, k, v, layout=layout, orders=orders, block_mask=mask, k_scale=k_scale)
    triton_out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=mask, block_size=(128, 64),
                                qk="int8", pv="fp8", backend="triton", k_scale=k_scale)
    err = rel_err(out, triton_out)
    print(f"sm90 vs triton, k_scale={k_scale}: rel err {err:.3e}")
    assert err < 2e-2


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("k_scale", ["block", "token"])
def test_key_padding_mask_matches_reference(k_scale):
    layout = TokenLayout(0, 2, 6, 10, suffix=150)  # suffix longer than two key blocks, not a multiple of one
    B, H, D = 3, 2, 64
    q, k, v = make_inputs(B, H, layout.seq_len, D, torch.bfloat16, False, seed=3)
    if k_scale == "token":
        mixed_key_norms(k, seed=3)
    suffix = torch.zeros(B, layout.suffix, dtype=torch.bool, device="cuda")
    suffix[0, :5] = True  # a short prompt
    suffix[1, ::3] = True
    suffix[2, 64:] = True  # a key block of padding only before kept keys
    orders = torch.tensor([2, 5], dtype=torch.int32)
    mask = random_mask(H, layout.seq_len, 0.6, seed=3, empty_rows=False)
    out, ref = run_both(q, k, v, layout, orders, mask, suffix_mask=suffix, k_scale=k_scale)
    unmasked = paro_attention_reference(q, k, v, layout, orders, mask.cuda(), 128, 64, "int8", "fp8", k_scale=k_scale)
    err, moved = rel_err(out, ref), rel_err(unmasked, ref)
    print(f"key mask: rel err {err:.3e} (the mask moves the result by {moved:.3e})")
    assert torch.isfinite(out).all() and err < BOUND < moved


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("k_scale", ["block", "token"])
def test_int4_values_match_reference(k_scale):
    layout = TokenLayout(13, 2, 7, 11)
    q, k, v = make_inputs(2, 2, layout.seq_len, 64, torch.bfloat16, False, seed=4)
    orders = torch.tensor([3, 1], dtype=torch.int32)
    out, ref = run_both(q, k, v, layout, orders, random_mask(2, layout.seq_len, 0.5, seed=4), qk="int4",
                        k_scale=k_scale)
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
@pytest.mark.parametrize("k_scale", ["block", "token"])
def test_nan_in_k_reaches_the_rows_of_its_scale(k_scale):
    """A NaN in k makes NaN the rows that attend its key block (one scale per block) or its key (one per key); a
    NaN in a padded suffix key reaches no row per key, and the rows attending its block per block. The NaN keys
    are off K smoothing's sample (every other token here), which would take them to every row of the head."""
    from paroattn.kernels.reference import key_mean_stride

    layout = TokenLayout(0, 8, 17, 31, suffix=70)  # 4286 tokens: the mean samples every 2nd (odd H x W)
    B, H, D = 1, 2, 64
    assert key_mean_stride(layout.seq_len, layout.height, layout.width) == 2
    q, k, v = make_inputs(B, H, layout.seq_len, D, torch.bfloat16, False, seed=6)
    grid_end = layout.seq_len - layout.suffix
    nan_key, padded_key = 333, grid_end + 31  # odd: off the sample; head 0's order 0 keeps positions
    k[0, 0, nan_key, 5] = float("nan")
    k[0, 1, padded_key, 7] = float("nan")
    suffix = torch.ones(B, layout.suffix, dtype=torch.bool, device="cuda")
    suffix[0, padded_key - grid_end] = False
    orders = torch.tensor([0, 2], dtype=torch.int32)
    mask = random_mask(H, layout.seq_len, 0.5, seed=6)
    out, ref = run_both(q, k, v, layout, orders, mask, suffix_mask=suffix, k_scale=k_scale)
    assert torch.equal(out.isnan(), ref.isnan())
    assert ref[0, 0].isnan().any() and not ref[0, 0].isnan().all()
    assert bool(ref[0, 1].isnan().any()) == (k_scale == "block")
    finite = ~ref.isnan()
    assert rel_err(out[finite], ref[finite]) < BOUND


@requires_sm90
@pytest.mark.gpu
def test_nvrtc_failure_gives_a_reason_and_no_result(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise sm90.KernelLoadError("NVRTC could not compile paro_attention_int8_fp8: injected failure")

    monkeypatch.setenv("PAROATTN_CACHE", str(tmp_path))  # an empty cache: the compile must run
    monkeypatch.setattr(sm90, "_nvrtc_compile", broken)
    device = torch.device("cuda", torch.cuda.current_device())
    device_runtime = runtime_of(device)
    device_runtime.clear()
    try:
        reason = device_runtime.build_cuda_kernel(64, torch.float16)
        assert reason is not None and "injected failure" in reason and "could not be built" in reason
        with pytest.raises(sm90.KernelLoadError, match="injected failure"):
            device_runtime.cuda_kernel(64, torch.float16)
    finally:
        device_runtime.clear()


@requires_sm90
@pytest.mark.gpu
def test_disk_cache_serves_a_second_process(tmp_path):
    """A cubin compiled once is read back by a later process (no NVRTC call there)."""
    script = textwrap.dedent("""
        import torch
        from paroattn.kernels import sm90
        calls = []
        original = sm90._nvrtc_compile
        sm90._nvrtc_compile = lambda *a: calls.append(1) or original(*a)
        sm90.build(64, torch.bfloat16, torch.device("cuda", 0))
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
        from paroattn import TokenLayout, paro_attention
        from paroattn.kernels import dispatch
        from paroattn.kernels.runtime import runtime_of
        for layout, D in ((TokenLayout(7, 2, 5, 9), 64), (TokenLayout(0, 2, 6, 10, suffix=37), 128)):
            H = 2
            q, k, v = (torch.randn(2, H, layout.seq_len, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            nq, nk = -(-layout.seq_len // 128), -(-layout.seq_len // 64)
            mask = torch.rand(H, nq, nk) < 0.6
            mask[0, 0] = False
            suffix = None
            if layout.suffix:
                suffix = torch.rand(2, layout.suffix, device="cuda") < 0.5
            paro_attention(q, k, v, layout=layout, orders=torch.tensor([1, 4]), block_mask=mask, block_size=(128, 64),
                           qk="int8", pv="fp8", suffix_mask=suffix, backend="cuda")
            assert runtime_of(q.device).last_launch.launch.kernel == dispatch.CUDA
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
        direct = kernel_calls.sm90_attention(q, k, v, layout=layout, orders=orders, block_mask=mask)
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
def test_op_with_cuda_backend_replays_in_a_cuda_graph():
    """Captured once (the graph's own buffers, their tensor maps in the captured launch), replayed on new inputs
    copied into the static ones: the eager call's result."""
    from paroattn import paro_attention
    from paroattn.kernels.block_lists import ActiveBlocks

    B, H, layout, D = 1, 4, TokenLayout(0, 3, 20, 30), 128
    N = layout.seq_len
    blocks = ActiveBlocks.from_mask(random_mask(H, N, 0.4, 12)).to("cuda")
    orders = torch.tensor([1, 4, 0, 5]).cuda()

    def layer(q, k, v):
        return paro_attention(q, k, v, layout=layout, orders=orders, block_mask=blocks, block_size=(128, 64),
                              qk="int8", pv="fp8", backend="cuda")

    static = [t.clone() for t in make_inputs(B, H, N, D, torch.bfloat16, True, 24)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = layer(*static)
    fresh = make_inputs(B, H, N, D, torch.bfloat16, True, 25)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = layer(*fresh)
    assert torch.isfinite(graph_out).all() and rel_err(graph_out, eager) <= 1e-6


@requires_sm90
@pytest.mark.gpu
def test_op_falls_back_to_triton_with_one_warning_when_the_build_fails(monkeypatch, tmp_path):
    import warnings

    from paroattn import paro_attention
    from paroattn.kernels import runtime as op_runtime

    def broken(*args, **kwargs):
        raise sm90.KernelLoadError("NVRTC could not compile paro_attention_int8_fp8: injected failure")

    monkeypatch.setenv("PAROATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(sm90, "_nvrtc_compile", broken)
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
