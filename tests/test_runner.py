"""`paroattn.runner.PlanRunner` (one plan run on a model's calls, for every integration), the op's `kernel_for`
query, `paroattn.reset()`, `handle.stats()` on the CPU, and forwards from two threads on one patched transformer."""

from __future__ import annotations

import threading

import pytest
import torch

import paroattn
from paroattn import Plan, PlanError, TokenLayout, paro_attention
from paroattn.attention import Launch, decide, kernel_for
from paroattn.kernels import runtime
from paroattn.runner import MaskStore, PlanRunner

LAYOUT = TokenLayout(0, 2, 4, 8)
STATS_KEYS = {"mode", "resident", "host_bytes", "gpu_bytes", "prefetch_hits", "prefetch_misses", "copies"}


def small_plan(**kwargs) -> Plan:
    arguments = dict(layout=LAYOUT, num_layers=2, num_heads=2, density=0.5, orders="random", num_buckets=2,
                     block_size=16, profiles=True)
    return Plan.synthetic(**(arguments | kwargs))


def qkv(layout: TokenLayout, heads: int = 2, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, layout.seq_len, dim, generator=g) for _ in range(3)]


# -- the op's query ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float16, 128),
                                            (torch.bfloat16, 48)])
def test_kernel_for_answers_what_the_call_decides(backend, dtype, head_dim):
    """`kernel_for` asks without a tensor what `decide` answers for a q of that device, dtype and head dim."""
    q = torch.empty(1, 1, 4, head_dim, dtype=dtype)
    decision = decide(q, 64, 64, "int8", "bf16", backend) if backend != "torch" else None
    expected = decision.kernel if isinstance(decision, Launch) and decision.backend != "torch" else None
    assert kernel_for("cpu", dtype, head_dim, 64, "int8", "bf16", backend) == expected


def test_kernel_for_names_a_kernel_where_one_runs(monkeypatch):
    """Where the dispatcher decides a kernel, the query names it (a CPU has none: the decision is forced here)."""
    forced = Launch("triton")
    monkeypatch.setattr(runtime.Runtime, "decide", lambda self, *args: forced)
    assert kernel_for("cpu", torch.bfloat16, 64, (64, 32), "int8", "fp8", "auto") == "triton"
    assert kernel_for("cpu", torch.bfloat16, 64, 64, "int8", "fp8", "torch") is None  # the reference, asked for
    monkeypatch.setattr(runtime.Runtime, "decide", lambda self, *args: Launch("torch-reference"))
    assert kernel_for("cpu", torch.bfloat16, 64, 64, "int8", "fp8", "auto") is None


def test_runner_takes_lists_exactly_where_a_kernel_runs(monkeypatch):
    runner = PlanRunner(small_plan())
    assert not runner.uses_block_lists(torch.device("cpu"), torch.float32, 16)
    assert not runner.store(LAYOUT, torch.device("cpu"), torch.float32, 16).lists
    monkeypatch.setattr(runtime.Runtime, "decide", lambda self, *args: Launch("triton"))
    assert runner.uses_block_lists(torch.device("cpu"), torch.float32, 16)
    assert runner.store(LAYOUT, torch.device("cpu"), torch.float32, 16).lists  # another store: lists


# -- the runner ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("resident", "limit", "traceable"), [(False, None, False), ("auto", 0, False),
                                                                  ("auto", None, True), (True, 0, True)])
def test_traceable_is_false_exactly_where_the_masks_would_stream(monkeypatch, resident, limit, traceable):
    """Masks a graph traced by torch.compile can read: all but the active-block lists a CUDA runner streams
    (resident=False, or "auto" over the resident limit); a bool-mask runner (the reference) never streams."""
    import paroattn.runner.runner as runner_module

    if limit is not None:
        monkeypatch.setattr(runner_module, "RESIDENT_LIMIT_BYTES", limit)
    runner = PlanRunner(small_plan(), resident=resident)
    cuda = torch.device("cuda")
    monkeypatch.setattr(PlanRunner, "uses_block_lists", lambda self, device, *_: torch.device(device).type == "cuda")
    assert runner.traceable(LAYOUT, cuda, torch.float16, 64) is traceable
    assert runner.traceable(LAYOUT, torch.device("cpu"), torch.float16, 64)
    monkeypatch.setattr(PlanRunner, "uses_block_lists", lambda *_: False)
    assert runner.traceable(LAYOUT, cuda, torch.float16, 64)


def test_attention_is_the_op_on_the_layers_orders_and_mask():
    plan = small_plan()
    runner = PlanRunner(plan, backend="torch")
    store = runner.store(LAYOUT, torch.device("cpu"), torch.float32, 16)
    q, k, v = qkv(LAYOUT)
    for bucket in range(plan.num_buckets):
        for layer in range(plan.num_layers):
            got = runner.attention(store, bucket, layer, LAYOUT, sm_scale=0.2)(q, k, v)
            want = paro_attention(q, k, v, layout=LAYOUT, orders=plan.orders[layer].long(),
                                  block_mask=plan.block_mask[bucket, layer], block_size=plan.block_size, backend="torch",
                                  sm_scale=0.2)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a range of heads: those heads of the layer's orders and mask
    got = runner.attention(store, 1, 0, LAYOUT)(q[:, 1:], k[:, 1:], v[:, 1:], heads=(1, 2))
    want = paro_attention(q[:, 1:], k[:, 1:], v[:, 1:], layout=LAYOUT, orders=plan.orders[0, 1:].long(),
                          block_mask=plan.block_mask[1, 0, 1:], block_size=plan.block_size, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_attention_quantizes_as_the_plan_says():
    """The plan's modes reach the op: integer QK with K's scales per key block or per key (`Plan.k_scale`)."""
    q, k, v = qkv(LAYOUT, dim=64)
    k = k * torch.exp(1.5 * torch.randn(*k.shape[:-1], 1, generator=torch.Generator().manual_seed(1)))
    outs = {}
    for k_scale in ("block", "token"):
        plan = small_plan(qk="int8", k_scale=k_scale)
        runner = PlanRunner(plan, backend="torch")
        got = runner.attention(runner.store(LAYOUT, torch.device("cpu"), torch.float32, 64), 1, 0, LAYOUT)(q, k, v)
        want = paro_attention(q, k, v, layout=LAYOUT, orders=plan.orders[0].long(), block_mask=plan.block_mask[1, 0],
                              block_size=plan.block_size, qk="int8", k_scale=k_scale, backend="torch")
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        outs[k_scale] = got
    assert not torch.equal(outs["block"], outs["token"])


def test_sizes_keep_their_masks_or_one_at_a_time():
    other = TokenLayout(0, 2, 8, 8)
    cpu = torch.device("cpu")
    for keep_one in (False, True):
        runner = PlanRunner(small_plan(), keep_one_size=keep_one)
        first = runner.store_key(LAYOUT, cpu, torch.float32, 16)
        second = runner.store_key(other, cpu, torch.float32, 16)
        assert runner.stores[second].plan.layout == other
        assert runner.derived_from(other) is not None and runner.derived_from(LAYOUT) is None
        assert set(runner.stores) == ({second} if keep_one else {first, second})
        assert runner.latest == second
        traced = runner.store_key(LAYOUT, cpu, torch.float32, 16, traced=True)
        runner.store_key(other, cpu, torch.float32, 16)
        assert traced in runner.stores  # a traced graph reads it: kept whatever the policy
        assert set(runner.stats()["traced_bytes"]) == {"cpu"}


def test_size_problem_and_head_slice():
    plan = small_plan(profiles=False)
    runner = PlanRunner(plan)
    assert runner.size_problem(LAYOUT) is None
    assert "no axis profiles" in runner.size_problem(TokenLayout(0, 2, 8, 8))
    with pytest.raises(PlanError, match="no axis profiles"):
        runner.plan_at(TokenLayout(0, 2, 8, 8))
    runner.store(LAYOUT, torch.device("cpu"), torch.float32, 16)
    runner.set_heads((1, 2))
    assert not runner.stores  # masks of all heads dropped
    store = runner.store(LAYOUT, torch.device("cpu"), torch.float32, 16)
    assert torch.equal(store.get(0, 1), plan.block_mask[0, 1, 1:2])


def test_runner_refuses_bad_settings():
    with pytest.raises(TypeError, match="Plan.load"):
        PlanRunner("plan.safetensors")
    with pytest.raises(ValueError, match="backend='cuda-sm90a'"):
        PlanRunner(small_plan(), backend="cuda-sm90a")
    with pytest.raises(ValueError, match="resident must be True, False or 'auto'"):
        PlanRunner(small_plan(), resident="yes")
    with pytest.raises(ValueError, match="at least 2 slots"):
        PlanRunner(small_plan(), prefetch_slots=1)


def test_stats_have_their_keys_before_any_call():
    runner = PlanRunner(small_plan())
    assert runner.stats() == MaskStore.empty_stats() and set(runner.stats()) == STATS_KEYS
    runner.store(LAYOUT, torch.device("cpu"), torch.float32, 16)
    stats = runner.stats()
    assert set(stats) == STATS_KEYS and stats["mode"] == "bool masks" and stats["gpu_bytes"] == 0


# -- the demo transformer: stats, reset, threads -------------------------------------------------
DEMO_TIMESTEPS = (950.0, 300.0)  # buckets 0 and 5 of the demo plans


@pytest.fixture(scope="module")
def demo():
    """The demo model's transformer (float32, CPU), its shipped plan at density 0.5, and the inputs of a forward
    of the plan's size at each of DEMO_TIMESTEPS."""
    from diffusers import WanTransformer3DModel

    from paroattn.demo_model.model import ASSETS

    transformer = WanTransformer3DModel.from_pretrained(ASSETS / "transformer", torch_dtype=torch.float32).eval()
    plan = Plan.load(ASSETS / "plans" / "d0.50.safetensors")
    layout = plan.layout
    g = torch.Generator().manual_seed(0)
    config = transformer.config
    latents = torch.randn(1, config.in_channels, layout.frames, 2 * layout.height, 2 * layout.width, generator=g)
    text = torch.randn(1, 8, config.text_dim, generator=g)
    inputs = [dict(hidden_states=latents, timestep=torch.tensor([t]), encoder_hidden_states=text, return_dict=False)
              for t in DEMO_TIMESTEPS]
    assert len({plan.bucket_of(t) for t in DEMO_TIMESTEPS}) == 2
    return transformer, plan, inputs


def resized(inputs: dict, width: int) -> dict:
    """`inputs` with latents `width` pixels wide (another token grid: the plan derives its masks)."""
    g = torch.Generator().manual_seed(1)
    latents = inputs["hidden_states"]
    return inputs | {"hidden_states": torch.randn(*latents.shape[:-1], width, generator=g)}


def forward(transformer, inputs) -> torch.Tensor:
    with torch.no_grad():
        return transformer(**inputs)[0]


def test_stats_report_their_keys_on_the_cpu(demo):
    transformer, plan, inputs = demo
    with paroattn.apply(transformer, plan, backend="torch") as handle:
        assert set(handle.stats()) == STATS_KEYS and handle.stats()["mode"] is None  # no forward yet
        forward(transformer, inputs[0])
        stats = handle.stats()
    assert set(stats) == STATS_KEYS
    expected = {"mode": "bool masks", "resident": True, "host_bytes": 0, "gpu_bytes": 0, "prefetch_hits": 0,
                "prefetch_misses": 0, "copies": 0}
    assert stats == expected


@pytest.mark.parametrize("sizes", ["one size", "two sizes"])
def test_two_threads_on_one_transformer_each_run_their_own_forward(demo, sizes):
    """Two threads run forwards at different timesteps (different buckets), of one size or two, on one patched
    transformer, each pre-hook run before either thread's first attention call: each output equals the
    single-threaded one."""
    transformer, plan, inputs = demo
    if sizes == "two sizes":
        inputs = [inputs[0], resized(inputs[1], 2 * plan.layout.width - 8)]
    with paroattn.apply(transformer, plan, backend="torch"):
        alone = [forward(transformer, x) for x in inputs]
        if sizes == "one size":  # a forward that read the other's bucket would show
            assert (alone[0] - alone[1]).abs().max() > 1e-2
        barrier = threading.Barrier(len(inputs), timeout=120)

        def wait(module, args) -> None:  # both forwards past the transformer's pre-hook before the first block runs
            barrier.wait()

        hook = transformer.blocks[0].register_forward_pre_hook(wait)
        results: dict[int, torch.Tensor] = {}
        errors: list[BaseException] = []

        def run(index: int) -> None:
            try:
                results[index] = forward(transformer, inputs[index])
            except BaseException as error:  # reported below, with the thread's traceback
                errors.append(error)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            hook.remove()
    assert not errors, errors
    for index, want in enumerate(alone):
        torch.testing.assert_close(results[index], want, rtol=1e-5, atol=1e-5)


def test_reset_undoes_apply_and_drops_every_cache(demo):
    transformer, plan, inputs = demo
    originals = dict(transformer.attn_processors)
    handle = paroattn.apply(transformer, plan, backend="torch")
    forward(transformer, inputs[0])
    runner = handle.processor.runner
    comfy_like = PlanRunner(small_plan())
    comfy_like.store(LAYOUT, torch.device("cpu"), torch.float32, 16)
    assert runner.stores and comfy_like.stores and runtime.runtime_of(torch.device("cpu")).decisions
    paroattn.reset()
    assert not handle.active
    assert all(transformer.attn_processors[key] is processor for key, processor in originals.items())
    assert not runner.stores and not comfy_like.stores
    assert not runtime.runtime_of(torch.device("cpu")).decisions
    handle.remove()  # nothing left to do
    assert "reset" in paroattn.__all__


def test_a_layer_called_outside_a_forward_of_its_thread_says_so(demo):
    """A thread that runs no forward of the transformer has no timestep or layout for its calls: refused, not
    served with another thread's."""
    transformer, plan, inputs = demo
    errors = []

    def call_a_layer() -> None:
        try:
            with torch.no_grad():
                transformer.blocks[0].attn1(torch.randn(1, plan.layout.seq_len, transformer.config.num_attention_heads
                                                        * transformer.config.attention_head_dim))
        except RuntimeError as error:
            errors.append(str(error))

    with paroattn.apply(transformer, plan, backend="torch"):
        forward(transformer, inputs[0])  # this thread's forward
        thread = threading.Thread(target=call_a_layer)
        thread.start()
        thread.join()
    assert len(errors) == 1 and "outside a forward of the transformer on this thread" in errors[0]


def test_a_store_of_active_block_lists_unpacks_a_loaded_plan_one_layer_at_a_time():
    """A plan loaded from a file keeps its masks packed; the kernels' stores (resident or streamed) build their lists
    from one (bucket, layer) at a time, so a real model's plan never exists in memory as full-size bools."""
    from paroattn.app.demo import shipped_plan_path
    from paroattn.kernels.block_lists import ActiveBlocks

    plan = Plan.load(shipped_plan_path(0.3))
    assert plan.masks.form != "full"
    store = MaskStore(plan, "cpu", lists=True)
    assert plan.masks.form != "full", "the store unpacked the whole plan"
    for b in range(plan.num_buckets):
        for layer in range(plan.num_layers):
            expected = ActiveBlocks.from_mask(plan.layer_mask(b, layer))
            counts, indices = store.counts[b, layer], store.indices[b, layer]
            assert torch.equal(counts, expected.counts)
            assert torch.equal(indices[..., : expected.indices.shape[-1]], expected.indices)
    assert store.indices.shape[-1] == plan.most_active_blocks_per_row()
