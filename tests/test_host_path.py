"""The Triton backend's host path: reused buffer sets, launches that skip Triton's argument binding, and
bool masks converted on the device without a sync. Each must leave results exactly as a fresh call
gives them. CPU tests run the kernels in the Triton interpreter (which takes the full launch path);
the GPU tests (`-m gpu`) check the direct launches."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import kernel_calls  # noqa: E402

from paroattn import TokenLayout, paro_attention  # noqa: E402
from paroattn.attention import decide  # noqa: E402
from paroattn.kernels import launch, runtime  # noqa: E402
from paroattn.kernels import launcher as launcher_module  # noqa: E402
from paroattn.kernels.block_lists import ActiveBlocks, heaviest_first  # noqa: E402
from paroattn.kernels.runtime import PROCESS, runtime_of  # noqa: E402
from paroattn.masks import synthetic_block_mask  # noqa: E402


def workspaces():
    """The buffer sets kept for calls on the tests' device."""
    return runtime_of(torch.device(DEVICE)).workspaces

INTERPRETED = not torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"
BLOCK = 16 if INTERPRETED else 32
DTYPE = torch.float16  # the interpreter's bf16 dot is wrong
LAYOUT = TokenLayout(3, 2, 4, 5)  # 43 tokens: a ragged last block
GRID = (LAYOUT.prefix, LAYOUT.frames, LAYOUT.height, LAYOUT.width)  # the launchers' layout arguments


def make_inputs(B, H, N, D, seed, seq_major=True):
    g = torch.Generator().manual_seed(seed)
    shape = (B, N, H, D) if seq_major else (B, H, N, D)
    out = [torch.randn(*shape, generator=g).to(DTYPE).to(DEVICE) for _ in range(3)]
    return [t.transpose(1, 2) if seq_major else t for t in out]


def random_mask(H, nq, nk, seed):
    """Random density per row, with an empty row and a full row in every head."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(H, nq, nk, generator=g) < torch.rand(H, nq, 1, generator=g)
    mask[:, 0] = False
    mask[:, -1] = True
    return mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unsynced_lists_equal_synced_ones(seed):
    H, nq, nk = 3, 7, 9
    mask = random_mask(H, nq, nk, seed)
    synced = ActiveBlocks.from_mask(mask)
    unsynced = ActiveBlocks.from_mask(mask, sync=False)
    assert unsynced.indices.shape == (H, nq, nk)  # every key block's width, nothing read back
    assert unsynced.indices.dtype == unsynced.counts.dtype == unsynced.schedule.dtype == torch.int32
    assert torch.equal(unsynced.counts, synced.counts)
    assert torch.equal(unsynced.schedule, synced.schedule)
    assert torch.equal(unsynced.schedule, heaviest_first(unsynced.counts))
    width = synced.indices.shape[-1]
    valid = torch.arange(width) < synced.counts[..., None]
    assert torch.equal(unsynced.indices[..., :width][valid], synced.indices[valid])
    # padding: the inactive blocks, ascending (never read by the kernels)
    inactive = torch.sort((~mask).to(torch.int8), dim=-1, descending=True, stable=True).indices
    for h in range(H):
        for row in range(nq):
            count = int(synced.counts[h, row])
            assert torch.equal(unsynced.indices[h, row, count:], inactive[h, row, :nk - count].to(torch.int32))
    assert torch.equal(unsynced.to_mask(), mask)
    unsynced.validate()


def test_lists_of_a_bool_mask_are_reused_until_the_mask_changes():
    runtime_of(torch.device(DEVICE)).mask_lists.clear()
    H, D = 2, 64
    q, k, v = make_inputs(1, H, LAYOUT.seq_len, D, seed=10)
    n = -(-LAYOUT.seq_len // BLOCK)
    masks = torch.stack([random_mask(H, n, n, seed) for seed in (11, 12)])  # as a plan's [layer, H, nq, nk]
    kwargs = dict(layout=LAYOUT, orders=torch.tensor([0, 3]), block_size=BLOCK, qk="int8", pv="bf16")

    def check(mask):
        out = paro_attention(q, k, v, block_mask=mask, backend="triton", **kwargs)
        ref = paro_attention(q, k, v, block_mask=mask, backend="torch", **kwargs)
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) <= 2e-3

    device = torch.device(DEVICE)
    first = runtime_of(device).lists_of(masks[0])
    assert runtime_of(device).lists_of(masks[0]) is first  # a new view of the same memory: reused
    assert runtime_of(device).lists_of(masks[1]) is not first
    check(masks[0])
    masks[0, 1, n - 1] = ~masks[0, 1, n - 1]  # in place, through another view of the same storage
    masks[0, 0, 1, :] = True
    changed = runtime_of(device).lists_of(masks[0])
    assert changed is not first and torch.equal(changed.to_mask().cpu(), masks[0])
    check(masks[0])
    with torch.inference_mode():
        inference_mask = random_mask(H, n, n, 13)
    assert runtime_of(device).lists_of(inference_mask) is not runtime_of(device).lists_of(inference_mask)
    assert len(runtime_of(device).mask_lists) <= runtime.MASK_LISTS


@pytest.mark.slow
def test_bool_mask_call_equals_prebuilt_lists_on_random_masks():
    H, D = 2, 64
    q, k, v = make_inputs(1, H, LAYOUT.seq_len, D, seed=3)
    n = -(-LAYOUT.seq_len // BLOCK)
    orders = torch.tensor([2, 5], dtype=torch.int32, device=DEVICE)
    for seed in (4, 5):
        mask = random_mask(H, n, n, seed)
        kwargs = dict(layout=LAYOUT, orders=orders, block_size=BLOCK, qk="int8", pv="bf16", backend="triton")
        from_bool = paro_attention(q, k, v, block_mask=mask, **kwargs)
        from_lists = paro_attention(q, k, v, block_mask=ActiveBlocks.from_mask(mask).to(DEVICE), **kwargs)
        assert torch.equal(from_bool, from_lists)
        ref = paro_attention(q, k, v, block_mask=mask, **{**kwargs, "backend": "torch"})
        assert float((from_bool.float() - ref.float()).norm() / ref.float().norm()) <= 2e-3


# int8 PV here: the interpreter's fp8 cast is wrong (tests/test_kernels.py replaces it)
@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "int8")])
@pytest.mark.slow
def test_reused_buffers_leave_every_call_as_a_fresh_one(qk, pv):
    """Calls of one shape share a buffer set: a call's result does not change when later calls reuse
    its buffers, and equals the result of a call with buffers of its own."""
    workspaces().clear()
    H, D = 2, 64
    n = -(-LAYOUT.seq_len // BLOCK)
    mask = ActiveBlocks.from_mask(random_mask(H, n, n, 6)).to(DEVICE)
    orders = torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)
    args = (orders, mask.counts, mask.indices, mask.schedule, *GRID, BLOCK, BLOCK, qk, pv,
            1 / math.sqrt(D))
    first, second = make_inputs(1, H, LAYOUT.seq_len, D, seed=7), make_inputs(1, H, LAYOUT.seq_len, D, seed=8)
    out_first = kernel_calls.launch(*first, *args)
    assert len(workspaces()) == 1
    buffers = next(iter(workspaces().values()))
    out_second = kernel_calls.launch(*second, *args)
    assert next(iter(workspaces().values())) is buffers  # reused, not reallocated
    again = kernel_calls.launch(*first, *args)
    assert torch.equal(again, out_first)
    assert not torch.equal(out_second, out_first)
    # the reused set holds what a fresh set (as while a CUDA graph is captured) gets from this call
    B, _, N, _ = first[0].shape
    fresh = runtime.allocate(B, H, N, D, DTYPE, first[0].device, BLOCK, BLOCK, qk, pv, write_q=False)
    launch.prepare_kv(*first[1:], orders, *GRID, BLOCK, qk, pv, fresh)
    for name in ("kq", "k_scale", "vq"):
        assert torch.equal(getattr(fresh, name), getattr(buffers, name)), name
    reference = paro_attention(*first, layout=LAYOUT, orders=orders, block_mask=mask, block_size=BLOCK, qk=qk,
                               pv=pv, backend="torch")
    bound = 2e-3 if pv == "bf16" else 1e-2
    assert float((out_first.float() - reference.float()).norm() / reference.float().norm()) <= bound


def test_buffer_sets_are_bounded_and_per_shape():
    workspaces().clear()
    H, D = 1, 64
    orders = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    for width in range(2, 3 + runtime.WORKSPACES):
        layout = TokenLayout(0, 1, 4, width)
        n = -(-layout.seq_len // BLOCK)
        blocks = ActiveBlocks.from_mask(torch.ones(H, n, n, dtype=torch.bool)).to(DEVICE)
        q, k, v = make_inputs(1, H, layout.seq_len, D, seed=width)
        out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=blocks, block_size=BLOCK,
                             backend="triton")
        ref = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=blocks, block_size=BLOCK,
                             backend="torch")
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) <= 2e-3
    assert len(workspaces()) == runtime.WORKSPACES
    workspaces().clear()
    assert not workspaces()


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="needs a CUDA GPU")
@pytest.mark.parametrize("qk,pv,D,bq", [("bf16", "bf16", 128, 128), ("int8", "fp8", 128, 128), ("int8", "fp8", 64, 64)])
def test_direct_launches_equal_full_launches(qk, pv, D, bq):
    """After a key's first launch the kernels run without Triton's binding; the results are the full
    launch's bit for bit, also when an input's address is no longer 16-byte aligned (a new key) and
    with the RoPE pass (a third kernel)."""
    layout = TokenLayout(7, 2, 10, 12)
    H, N = 3, layout.seq_len
    n_q, n_k = -(-N // bq), -(-N // 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    storage = torch.randn(3, 1, N, H, D + 8, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (storage[i, ..., :D].transpose(1, 2) for i in range(3))
    blocks = ActiveBlocks.from_mask(random_mask(H, n_q, n_k, 9)).to("cuda")
    orders = torch.tensor([0, 4, 5], dtype=torch.int32, device="cuda")
    angles = torch.rand(N - 7, D, device="cuda", generator=g)
    kwargs = dict(layout=layout, orders=orders, block_mask=blocks, block_size=(bq, 64), qk=qk, pv=pv,
                  backend="triton")
    def full(*inputs, **extra):
        PROCESS.launches.clear()
        return paro_attention(*inputs, **kwargs, **extra)

    for rope in (None, (angles.cos(), angles.sin())):
        extra = {"rotary": rope} if rope is not None else {}
        expected = full(q, k, v, **extra)
        before = launch_counts()
        assert torch.equal(paro_attention(q, k, v, **kwargs, **extra), expected)
        after = launch_counts()
        assert after[0] > before[0]
        if RAW_LAUNCHES:  # every direct launch went through the C function
            assert after[1] - before[1] == after[0] - before[0]
        if qk == "bf16":
            continue  # the Gluon kernel's 16-byte loads of q need q 16-byte aligned
        # one element further into the storage: q's address is 2 bytes off 16, a new key
        shifted = storage.flatten()[1:1 + storage[0].numel()].view_as(storage[0])[..., :D].transpose(1, 2)
        expected = full(shifted, k, v, **extra)
        paro_attention(q, k, v, **kwargs, **extra)  # the aligned key again, then the shifted one
        assert torch.equal(paro_attention(shifted, k, v, **kwargs, **extra), expected)


def launch_counts() -> tuple[int, int]:
    """Direct launches and, of those, launches through the C function, summed over the process's launchers."""
    launchers = PROCESS.launches.launchers()
    return sum(each.direct_launches for each in launchers), sum(each.raw_launches for each in launchers)


# the triton whose C launch function the launcher calls itself (`launcher._raw_launch`)
RAW_LAUNCHES = getattr(launcher_module.nvidia_driver, "_BASE_ARGS_FORMAT", None) == launcher_module.RAW_LAUNCH_FORMAT


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="needs a CUDA GPU")
@pytest.mark.parametrize("qk,pv,D", [("int8", "fp8", 128), ("bf16", "bf16", 128), ("int8", "bf16", 64)])
def test_direct_launches_read_each_buffer_sets_own_descriptors(qk, pv, D):
    """Descriptors are encoded once and the encoding kept: three buffer sets at three addresses (each call
    after the runtime's workspaces are cleared makes a new one; the old ones are held, so their memory is not reused),
    then calls alternating between them with other inputs must each read their own set's K and V (an
    encoding kept for another set's descriptor would read that set's). Each equals a full launch."""
    layout = TokenLayout(5, 2, 8, 12)
    H, N = 2, layout.seq_len
    g = torch.Generator(device="cuda").manual_seed(3)
    inputs = [tuple(torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
              for _ in range(4)]
    blocks = ActiveBlocks.from_mask(random_mask(H, -(-N // 128), -(-N // 64), 4)).to("cuda")
    kwargs = dict(layout=layout, orders=torch.tensor([3, 1], dtype=torch.int32, device="cuda"), block_mask=blocks,
                  block_size=(128, 64), qk=qk, pv=pv, backend="triton")
    expected = []
    for q, k, v in inputs:
        PROCESS.launches.clear()
        expected.append(paro_attention(q, k, v, **kwargs))
    sets = []
    for i in range(3):
        workspaces().clear()
        assert torch.equal(paro_attention(*inputs[i], **kwargs), expected[i])
        sets.append(dict(workspaces()))
    assert len({id(buffers.kq) for workspace in sets for buffers in workspace.values()}) == 3
    before = launch_counts()
    for which, i in ((0, 3), (2, 1), (1, 0), (0, 2), (2, 3)):
        workspaces().clear()
        workspaces().update(sets[which])
        assert torch.equal(paro_attention(*inputs[i], **kwargs), expected[i])
    after = launch_counts()
    assert after[0] - before[0] >= 5 * 2
    if RAW_LAUNCHES:
        assert after[1] - before[1] == after[0] - before[0]
    workspaces().clear()


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not RAW_LAUNCHES, reason="needs a CUDA GPU and a triton whose C launcher is known")
@pytest.mark.parametrize("qk,pv,D", [("int8", "fp8", 128), ("bf16", "bf16", 128), ("int8", "int8", 64)])
def test_replayed_calls_equal_full_launches(qk, pv, D):
    """Eager calls into a kept buffer set replay the launches of an earlier call with the same key
    (`launcher.LaunchSequence`). Calls that differ in what the key must separate (strides, RoPE, a key
    mask, the softmax scale), in their tensors only (other q, k, v, orders, lists, tables, masks), or
    whose recording call passed one tensor as q, k and v, each equal a full launch of the same call,
    replayed (second pass) as recorded (first pass)."""
    from paroattn.kernels import launcher

    layout = TokenLayout(5, 2, 8, 12, suffix=9)
    H, N = 3, layout.seq_len
    nq, nk = -(-N // 128), -(-N // 64)
    g = torch.Generator(device="cuda").manual_seed(5)

    def qkv(seq_major):
        shape = (1, N, H, D) if seq_major else (1, H, N, D)
        out = [torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
        return [t.transpose(1, 2) if seq_major else t for t in out]

    def lists(seed):
        return ActiveBlocks.from_mask(random_mask(H, nq, nk, seed)).to("cuda")

    def orders(values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    angles = [torch.rand(N - 5 - 9, D, device="cuda", generator=g) for _ in range(2)]
    tables = [(a.cos(), a.sin()) for a in angles]
    masks = [torch.tensor([[True] * 9], device="cuda"), torch.tensor([[True] * 4 + [False] * 5], device="cuda")]
    shared = qkv(False)[0]
    calls = [  # (q, k, v), keyword arguments
        (qkv(False), dict(orders=orders([0, 4, 5]), block_mask=lists(1))),
        (qkv(False), dict(orders=orders([3, 1, 2]), block_mask=lists(2))),  # same key, other tensors
        (qkv(True), dict(orders=orders([0, 4, 5]), block_mask=lists(1))),  # other strides
        (qkv(False), dict(orders=orders([5, 5, 0]), block_mask=lists(3), rotary=tables[0])),
        (qkv(False), dict(orders=orders([5, 5, 0]), block_mask=lists(3), rotary=tables[1])),
        (qkv(False), dict(orders=orders([2, 0, 1]), block_mask=lists(4), suffix_mask=masks[0])),
        (qkv(False), dict(orders=orders([2, 0, 1]), block_mask=lists(4), suffix_mask=masks[1])),
        (qkv(False), dict(orders=orders([1, 1, 1]), block_mask=lists(5), sm_scale=0.05)),
        # the first call of its key (its own scale) passes one tensor as q, k and v: its launches must not be
        # replayed for the next call, whose three tensors differ (which slot a launch read is ambiguous)
        ((shared, shared, shared), dict(orders=orders([4, 2, 0]), block_mask=lists(6), sm_scale=0.07)),
        (qkv(False), dict(orders=orders([4, 2, 0]), block_mask=lists(6), sm_scale=0.07)),
    ]
    common = dict(layout=layout, block_size=(128, 64), qk=qk, pv=pv, backend="triton")
    expected = []
    for inputs, kwargs in calls:
        PROCESS.launches.clear()
        workspaces().clear()
        expected.append(paro_attention(*inputs, **common, **kwargs))
    replays = []
    for _ in range(3):
        before = launcher.LaunchSequence.replayed_calls
        for (inputs, kwargs), result in zip(calls, expected):
            assert torch.equal(paro_attention(*inputs, **common, **kwargs), result)
        replays.append(launcher.LaunchSequence.replayed_calls - before)
    # a key's first call of the first pass records (where its kernels were compiled for it already: a full
    # launch is not recorded, the next call records); its later calls replay, and by the last pass all do
    assert 0 < replays[0] < len(calls) and replays[-1] == len(calls), replays
    workspaces().clear()


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="needs a CUDA GPU")
def test_bool_mask_call_does_not_sync_and_graph_capture_allocates_its_own_buffers():
    layout = TokenLayout(0, 2, 16, 16)
    H, D, N = 2, 128, layout.seq_len
    n_q, n_k = -(-N // 128), -(-N // 64)
    q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = synthetic_block_mask(H, n_q, n_k, 0.5, generator=torch.Generator().manual_seed(1))
    kwargs = dict(layout=layout, orders=torch.tensor([1, 2], dtype=torch.int32, device="cuda"),
                  block_size=(128, 64), qk="int8", pv="fp8", backend="triton")
    expected = paro_attention(q, k, v, block_mask=ActiveBlocks.from_mask(mask).to("cuda"), **kwargs)
    for where in (mask, mask.cuda()):
        paro_attention(q, k, v, block_mask=where, **kwargs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync inside the call raises
        try:
            out = paro_attention(q, k, v, block_mask=where, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(out, expected)
    blocks = ActiveBlocks.from_mask(mask).to("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        paro_attention(q, k, v, block_mask=blocks, **kwargs)  # warm-up on the capture stream: its own set
        sets = dict(workspaces())
        with torch.cuda.graph(graph, stream=stream):
            captured = paro_attention(q, k, v, block_mask=blocks, **kwargs)
        # the capture allocated from the graph's pool: no set was added or replaced
        assert workspaces().keys() == sets.keys()
        assert all(workspaces()[key] is buffers for key, buffers in sets.items())
        q2, k2, v2 = (torch.randn_like(q) for _ in range(3))
        other = paro_attention(q2, k2, v2, block_mask=blocks, **kwargs)  # eager on the same stream
        graph.replay()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)
    assert not torch.equal(other, expected)


def test_the_custom_op_shares_the_streams_buffer_set_with_eager_calls():
    """Under torch.compile the op runs through its custom op, which on the default stream (off CUDA: always) takes
    the stream's kept buffer set, the one an eager call of the same plan takes; same result as the eager launch.
    (Elsewhere it allocates per call: CUDA-graph trees warm up on a stream of their own, in their graphs' memory
    pool; test_compile.py's GPU tests.)"""
    workspaces().clear()
    H, D = 2, 64
    n = -(-LAYOUT.seq_len // BLOCK)
    blocks = ActiveBlocks.from_mask(random_mask(H, n, n, 14)).to(DEVICE)
    q, k, v = make_inputs(1, H, LAYOUT.seq_len, D, seed=15)
    args = (q, k, v, torch.tensor([2, 4], dtype=torch.int32, device=DEVICE), blocks.counts, blocks.indices,
            blocks.schedule, *GRID, BLOCK, BLOCK, "int8", "bf16", 1 / math.sqrt(D))
    through_op = launch.block_sparse_attention(*args, decide(q, BLOCK, BLOCK, "int8", "bf16", "triton").encode())
    assert len(workspaces()) == 1
    assert torch.equal(through_op, kernel_calls.launch(*args))
    assert len(workspaces()) == 1


def test_argument_checks_kept_per_combination_still_refuse_what_differs():
    """`check_inputs` checks the arguments that are not tensors once per combination: a combination that
    passed must not let another through, not even one equal to it in Python (True == 1) or unhashable."""
    from paroattn.errors import PAROInputError

    q = torch.randn(1, 1, 16, 64)
    kwargs = dict(layout=TokenLayout(0, 1, 2, 8), orders=torch.zeros(1, dtype=torch.int32),
                  block_mask=torch.ones(1, 1, 1, dtype=torch.bool), backend="torch")
    for _ in range(2):  # the second call finds its combination checked
        paro_attention(q, q, q, block_size=16, qk="int8", **kwargs)
    paro_attention(q, q, q, block_size=1, qk="int8", **{**kwargs, "block_mask": torch.ones(1, 16, 16, dtype=torch.bool)})
    for bad in (dict(block_size=True), dict(block_size=(16, True)), dict(block_size=16, qk="int9"),
                dict(block_size=16, qk=["int8"]), dict(block_size=16, pv="fp9")):
        with pytest.raises(PAROInputError):
            paro_attention(q, q, q, **{**kwargs, **bad})
