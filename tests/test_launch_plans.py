"""Calls of one shape that ask for different kernels or configs, one after another in every order: each runs
the kernel it asked for (the runtime's `last_launch`) and gives what a fresh process gives for that kernel.
The launch caches (buffer sets, compiled launcher entries, recorded launch sequences) are keyed by the call's
`LaunchPlan`, which holds the decided kernel and config, so what one call left behind is never used for a call
of another kernel. CPU: two pinned Triton configs under the interpreter, and "triton" against "auto" (the
reference there) compiled. GPU (`-m gpu`): "triton", "cuda" and "auto", eager and compiled, and two pinned
Triton configs."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from paroattn import TokenLayout, paro_attention  # noqa: E402
from paroattn.kernels import dispatch, runtime  # noqa: E402
from paroattn.kernels.block_lists import ActiveBlocks  # noqa: E402
from paroattn.kernels.runtime import runtime_of  # noqa: E402

ON_GPU = torch.cuda.is_available()


def random_mask(H, nq, nk, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(H, nq, nk, generator=g) < 0.5
    mask[:, torch.arange(nq), torch.arange(nq) * nk // nq] = True  # a diagonal: no empty rows
    return mask


def fresh(call):
    """`call()` in a process that has kept nothing: every cache of the op empty, every launch a full one."""
    runtime.clear()
    try:
        return call()
    finally:
        runtime.clear()


def ran(device) -> dispatch.LaunchPlan | None:
    return runtime_of(torch.device(device)).last_launch


# -- CPU: the interpreter --------------------------------------------------------------------------------------

LAYOUT = TokenLayout(3, 2, 4, 5)  # 43 tokens: a ragged last block
BLOCK = 16
KEY = (64, BLOCK, BLOCK, "int8", "int8")  # the interpreter's fp8 cast is wrong (tests/test_kernels.py)
PINS = {"pointer loads": dispatch.KernelConfig(4, 2), "descriptor loads": dispatch.KernelConfig(4, 3, tma=True)}


@pytest.fixture
def cpu_call():
    g = torch.Generator().manual_seed(0)
    H, N, D = 2, LAYOUT.seq_len, 64
    q, k, v = (torch.randn(1, N, H, D, generator=g).half().transpose(1, 2) for _ in range(3))
    n = -(-N // BLOCK)
    kwargs = dict(layout=LAYOUT, orders=torch.tensor([1, 4]), block_mask=random_mask(H, n, n, 1), block_size=BLOCK,
                  qk="int8", pv="int8")
    return q, k, v, kwargs


@pytest.mark.skipif(ON_GPU, reason="the interpreter's test; the GPU's is below")
@pytest.mark.parametrize("order", list(itertools.permutations(PINS)))
@pytest.mark.slow
def test_pinned_configs_in_turn_each_run_their_own_launch(cpu_call, order):
    q, k, v, kwargs = cpu_call

    def pinned(name):
        runtime.set_kernel_config(*KEY, PINS[name])
        return paro_attention(q, k, v, **kwargs, backend="triton")

    try:
        expected = {name: fresh(lambda: pinned(name)) for name in PINS}
        for name in (*order, *order):
            out = pinned(name)
            assert ran("cpu").launch.config == PINS[name], name
            assert torch.equal(out, expected[name]), name
    finally:
        runtime.set_kernel_config(*KEY, None)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's test; the GPU's is below")
@pytest.mark.slow
def test_compiled_calls_of_two_backends_each_run_their_own(cpu_call):
    """Under torch.compile the custom op takes the launch decided while tracing: the graph traced for
    backend="triton" runs the Triton kernel, the one for "auto" (the reference on a CPU) does not."""
    q, k, v, kwargs = cpu_call
    compiled = torch.compile(lambda q, k, v, backend: paro_attention(q, k, v, **kwargs, backend=backend),
                             fullgraph=True, dynamic=False)
    expected = {backend: paro_attention(q, k, v, **kwargs, backend=backend) for backend in ("triton", "auto")}
    runtime_of(torch.device("cpu")).last_launch = None
    for backend in ("triton", "auto", "triton", "auto"):
        out = compiled(q, k, v, backend)
        if backend == "triton":
            assert ran("cpu") is not None and ran("cpu").launch.kernel == dispatch.TRITON
        else:
            assert ran("cpu") is None  # the reference: no kernel launched
        assert torch.allclose(out.float(), expected[backend].float(), atol=2e-3), backend
        runtime_of(torch.device("cpu")).last_launch = None


def test_launch_codes_round_trip():
    """The custom op takes the decided launch as a string: every kernel, config and flag survives it."""
    configs = [None, *dispatch.TABLE.values(), dispatch.KernelConfig(8, 2, overlap_qk=True)]
    for kernel, config, kv_tma, q_tma in itertools.product((dispatch.TRITON, dispatch.GLUON, dispatch.CUDA), configs,
                                                           (False, True), (False, True)):
        launch = dispatch.Launch(kernel, config, kv_tma=kv_tma, q_tma=q_tma)
        assert dispatch.Launch.decode(launch.encode()) == launch


# -- GPU -------------------------------------------------------------------------------------------------------

GPU_LAYOUT = TokenLayout(0, 3, 16, 24)  # 1152 tokens
BACKEND_ORDERS = [("triton", "cuda", "auto"), ("cuda", "triton", "auto"), ("auto", "cuda", "triton")]


def gpu_call(D=128, qk="int8", pv="fp8"):
    g = torch.Generator(device="cuda").manual_seed(0)
    H, N = 2, GPU_LAYOUT.seq_len
    q, k, v = (torch.randn(1, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    blocks = ActiveBlocks.from_mask(random_mask(H, -(-N // 128), -(-N // 64), 2)).to("cuda")
    kwargs = dict(layout=GPU_LAYOUT, orders=torch.tensor([2, 5], device="cuda"), block_mask=blocks,
                  block_size=(128, 64), qk=qk, pv=pv)
    return q, k, v, kwargs


def kernel_of(backend: str) -> str:
    """The kernel `backend` decides for the GPU calls here."""
    decision = runtime_of(torch.device("cuda", torch.cuda.current_device())).decide(
        128, torch.bfloat16, 128, 64, "int8", "fp8", False, True, backend)
    return decision.kernel


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("order", BACKEND_ORDERS)
@pytest.mark.parametrize("compiled", [False, True])
def test_backends_in_turn_each_run_their_own_kernel(order, compiled):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 CUDA kernel needs an H100/H200")
    q, k, v, kwargs = gpu_call()

    def eager(backend):
        return paro_attention(q, k, v, **kwargs, backend=backend)

    expected = {backend: fresh(lambda: eager(backend)) for backend in order}
    assert kernel_of("cuda") == dispatch.CUDA and kernel_of("triton") != dispatch.CUDA
    assert not torch.equal(expected["cuda"], expected["triton"])  # the check below can tell them apart
    run = torch.compile(eager, fullgraph=True, dynamic=False) if compiled else eager
    for backend in (*order, *order, *order):
        out = run(backend)
        assert ran(q.device).launch.kernel == kernel_of(backend), backend
        assert torch.equal(out, expected[backend]), backend


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_pinned_configs_in_turn_on_the_gpu():
    q, k, v, kwargs = gpu_call()
    key = (128, 128, 64, "int8", "fp8")
    pins = [dispatch.KernelConfig(4, 3, tma=True, q_tma=True), dispatch.KernelConfig(4, 2, tma=True, overlap_qk=True)]

    def pinned(config):
        runtime.set_kernel_config(*key, config)
        return paro_attention(q, k, v, **kwargs, backend="triton")

    try:
        expected = [fresh(lambda: pinned(config)) for config in pins]
        for i in (0, 1, 1, 0, 0, 1, 0):
            assert torch.equal(pinned(pins[i]), expected[i]), pins[i]
            assert ran(q.device).launch.config == pins[i]
    finally:
        runtime.set_kernel_config(*key, None)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's test")
@pytest.mark.slow
def test_each_kernel_is_keyed_by_the_plan_and_the_alignment_of_what_it_reads(cpu_call, monkeypatch):
    """The key `launch` gives each Triton kernel's `CachedLauncher` holds the call's plan and the 16-byte alignment
    of the tensors that kernel reads: a call whose v is not 16-byte aligned gets other keys for the kernels that
    read v (the statistics and the K/V prologue) and the same keys for those that do not (the RoPE pass, and the
    attention kernel, which reads the prologue's copy of V)."""
    from paroattn.kernels import launcher

    q, k, v, kwargs = cpu_call
    B, H, N, D = v.shape
    storage = torch.empty(v.numel() + 1, dtype=v.dtype)
    shifted = storage[1:].view(B, N, H, D).transpose(1, 2)  # v's strides, 2 bytes past an aligned address
    shifted.copy_(v)
    assert v.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 2
    angles = torch.rand(N - LAYOUT.prefix, D, generator=torch.Generator().manual_seed(3))
    kwargs = dict(kwargs, rotary=(angles.cos(), angles.sin()))
    keys, spied = {}, launcher.CachedLauncher.__call__

    def spy(self, key, *args, **options):
        keys[self.kernel.__name__] = key
        return spied(self, key, *args, **options)

    monkeypatch.setattr(launcher.CachedLauncher, "__call__", spy)

    def call(values):
        keys.clear()
        out = paro_attention(q, k, values, **kwargs, backend="triton")
        return out, ran("cpu"), dict(keys)

    out, plan, aligned_v = fresh(lambda: call(v))
    out_shifted, plan_shifted, shifted_v = fresh(lambda: call(shifted))
    assert torch.equal(out, out_shifted) and plan == plan_shifted
    assert set(aligned_v) == {"_rotate_kernel", "_statistics_kernel", "_kv_prologue_kernel", "_attention_kernel"}
    assert all(aligned_v[kernel][0] == plan.kernel_key for kernel in ("_rotate_kernel", "_kv_prologue_kernel",
                                                                      "_attention_kernel"))
    for kernel, reads_v in (("_rotate_kernel", False), ("_statistics_kernel", True), ("_kv_prologue_kernel", True),
                            ("_attention_kernel", False)):
        assert (aligned_v[kernel] != shifted_v[kernel]) == reads_v, kernel


def test_every_launch_cache_is_keyed_by_the_decided_launch():
    """A buffer set kept for one kernel is not handed to a call of another: the runtime keys sets by plan."""
    device_runtime = runtime.Runtime(torch.device("cpu"))
    shape = torch.Size((1, 2, 43, 64))
    plans = [dispatch.LaunchPlan(dispatch.Launch(kernel, config), shape, torch.float16, (3, 2, 4, 5), 16, 16, "int8",
                                 "int8", "block", (), None, None, (), 0.125)
             for kernel, config in ((dispatch.TRITON, PINS["pointer loads"]), (dispatch.TRITON, PINS["descriptor loads"]),
                                    (dispatch.CUDA, None))]
    sets = [device_runtime.workspace(plan, stream=0) for plan in plans]
    assert len({id(s) for s in sets}) == len(plans)
    assert all(device_runtime.workspace(plan, stream=0) is kept for plan, kept in zip(plans, sets))
