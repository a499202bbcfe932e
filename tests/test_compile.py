"""PARO under `torch.compile(transformer, fullgraph=True)`: one graph, no break, no recompile per step.

Tiny CogVideoX, Wan (2.1, and 2.2 TI2V with per-token timesteps), FLUX and HunyuanVideo (padded text: the
suffix mask traced as a tensor) models in float32 with the torch backend, plans with random orders, density
< 1 and 3 buckets ([1000, 750, 500, 0]), forward calls whose tensor timesteps (as pipelines pass them)
fall through every bucket:
- the compiled transformer equals the eager PARO run, which `test_layer_oracle.py` checks against the plan;
- dynamo compiles it once (a compile-counting backend) and `torch._dynamo.explain` finds one graph and no
  break: the bucket is a device tensor picked in the graph, not a Python value the graph specializes on;
- every self-attention layer of a compiled run equals the reference op with the plan entry of its layer and
  of its timestep's bucket (the per-layer oracle, hooks inside the compiled graph);
- plan `dense` flags that are static per layer branch on the host, flags that depend on the bucket select
  between both results in the graph;
- the torch reference traced alone keeps the NaN rules of `paro_attention`'s docstring;
- the Triton backend (in its interpreter here) runs the resident stacked active-block lists under compile, and
  the streamed masks are refused with what to do.
Most tests compile with the "aot_eager" backend (dynamo and AOT autograd, no codegen: seconds on 2 cores);
one runs the default inductor backend.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from test_layer_oracle import (
    attention_modules,
    bucket_at,
    call_layout,
    call_timestep,
    check_every_layer,
    discriminating_plan,
    forward_arguments,
)
from tiny_models import TINY_BLOCK, tiny_forward_inputs, tiny_transformer
from torch._dynamo.testing import CompileCounterWithBackend

from paroattn import Plan, TokenLayout, paro_attention
from paroattn.kernels import reference, runtime
from paroattn.kernels.block_lists import ActiveBlocks
from paroattn.pipelines import PAROProcessor, apply, family_of, self_attention_layers
from paroattn.plan import bucket_index, bucket_tensor, default_bucket_edges, model_fingerprint
from paroattn.runner import MaskStore

FAMILIES = ["cogvideox", "wan", "flux", "wan2.2-ti2v", "hunyuan_video"]
EDGES = [1000.0, 750.0, 500.0, 0.0]
# falling timesteps, two per bucket of EDGES: the first calls in bucket 0, later ones in 1, then 2
TIMESTEPS = [980.0, 900.0, 700.0, 600.0, 400.0, 150.0]
RTOL = ATOL = 1e-5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled code is cached per code object (the diffusers forwards every test shares), with a limit on
    entries: each test starts from an empty cache, so its compile counts are its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def sparse_plan(transformer, block_size: int = TINY_BLOCK) -> Plan:
    inputs = tiny_forward_inputs(transformer)
    plan = Plan.synthetic(
        layout=family_of(transformer).call_inputs(transformer, inputs).layout,
        num_layers=len(self_attention_layers(transformer)),
        num_heads=transformer.config.num_attention_heads,
        density=0.5, orders="random", num_buckets=3, block_size=block_size,
        model_class=type(transformer).__name__, model_fingerprint=model_fingerprint(transformer.config),
    )
    assert plan.bucket_edges == EDGES and plan.achieved_density() < 0.9
    assert not torch.equal(plan.block_mask[0], plan.block_mask[1])  # a bucket mix-up would show
    return plan


def forward_calls(transformer, timesteps=TIMESTEPS) -> list[dict]:
    """One forward's arguments per timestep (tensor timesteps, as pipelines pass them), new latents each."""
    calls = [tiny_forward_inputs(transformer, timestep=t, seed=i) for i, t in enumerate(timesteps)]
    assert all(isinstance(c["timestep"], torch.Tensor) for c in calls)
    return calls


def assert_crosses_buckets(timesteps=TIMESTEPS) -> None:
    buckets = [bucket_index(EDGES, t) for t in timesteps]
    assert buckets == sorted(buckets) and len(set(buckets)) == 3, buckets


def run_compiled_and_eager(transformer, calls, backend="aot_eager"):
    """(compile counter, [(compiled output, eager output)] per call), outputs [0] of each forward."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(transformer, fullgraph=True, backend=counter)
    outputs = []
    with torch.no_grad():
        for inputs in calls:
            outputs.append((compiled(**inputs)[0], transformer(**inputs)[0]))
    return counter, outputs


# -- whole transformers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_compiled_transformer_matches_eager_across_buckets_and_compiles_once(family):
    """6 forwards through all 3 buckets: each compiled output equals the eager PARO output (float32, 1e-5), and
    dynamo compiled one graph for all of them (no recompile per step, per bucket or per layer)."""
    assert_crosses_buckets()
    transformer = tiny_transformer(family)
    plan = sparse_plan(transformer)
    calls = forward_calls(transformer)
    with torch.no_grad():
        dense = [transformer(**inputs)[0] for inputs in calls]
    with apply(transformer, plan, backend="torch") as handle:
        counter, outputs = run_compiled_and_eager(transformer, calls)
        assert set(handle.stats()["traced_bytes"]) == {"cpu"}
    for (got, want), reference_out, t in zip(outputs, dense, TIMESTEPS, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, t=t: f"t={t}: {m}")
        assert (got - reference_out).abs().max() > 1e-3  # PARO ran (the plan is sparse in every bucket)
    assert counter.frame_count == 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_explain_finds_one_graph_without_breaks(family):
    """The forward pre-hook that records the timestep does no tensor work (a graph of its own would count as a
    break): the bucket is computed inside the transformer's graph."""
    transformer = tiny_transformer(family)
    with apply(transformer, sparse_plan(transformer), backend="torch"), torch.no_grad():
        explained = torch._dynamo.explain(transformer)(**tiny_forward_inputs(transformer, timestep=700.0))
    assert explained.graph_count == 1
    assert explained.graph_break_count == 0 and not explained.break_reasons


@pytest.mark.slow
def test_inductor_compiles_once_and_matches_eager():
    """The default backend (inductor, C++ on the CPU) on CogVideoX: one compile for 4 calls over 3 buckets."""
    timesteps = [980.0, 700.0, 600.0, 150.0]
    assert_crosses_buckets(timesteps)
    transformer = tiny_transformer("cogvideox")
    with apply(transformer, sparse_plan(transformer), backend="torch"):
        counter, outputs = run_compiled_and_eager(transformer, forward_calls(transformer, timesteps), "inductor")
    for got, want in outputs:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert counter.frame_count == 1


# -- the per-layer oracle inside the compiled graph ---------------------------------------------------------


class CompiledLayerRecorder:
    """Forward hooks on the self-attention modules, traced into the compiled graph: each call's inputs and
    output, in the format of `test_layer_oracle.LayerRecorder` (its `check_every_layer` reads them). Hooks
    append to a list that is new and empty at every forward, so the graph's guards see the same list each
    time; the forward's timestep, bucket and layout come from the test's own arguments, outside the graph."""

    def __init__(self, transformer, plan: Plan):
        self.transformer, self.plan = transformer, plan
        self.modules = attention_modules(transformer)
        self.forwards: list[tuple[float, int, TokenLayout]] = []
        self.calls: list[dict] = []
        self.current: list[dict] = []
        self.handles = [module.register_forward_hook(self._hook(layer), with_kwargs=True)
                        for layer, module in enumerate(self.modules)]

    def _hook(self, layer):
        def hook(module, args, kwargs, output):
            arguments = dict(zip(("hidden_states", "encoder_hidden_states", "attention_mask", "rotary"), args))
            arguments.update(kwargs)
            self.current.append({
                "layer": layer,
                "module": module,
                "hidden_states": arguments["hidden_states"].clone(),
                "encoder_hidden_states": arguments.get("encoder_hidden_states"),
                "rotary": arguments.get("image_rotary_emb", arguments.get("rotary")),
                "output": output,
            })
        return hook

    def run(self, compiled, inputs) -> None:
        self.current = []
        compiled(**inputs)
        arguments = forward_arguments(self.transformer, (), inputs)
        t = call_timestep(self.transformer, arguments)
        self.forwards.append((t, bucket_at(self.plan.bucket_edges, t), call_layout(self.transformer, arguments)))
        self.calls += [{**call, "forward": len(self.forwards) - 1} for call in self.current]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("family", ["cogvideox", "flux"])
@pytest.mark.slow
def test_every_layer_of_a_compiled_run_follows_the_plan(family):
    """A plan whose every (bucket, layer, head) mask and every head's order differ (`discriminating_plan`):
    each layer of each compiled forward equals the reference op with its own orders and its timestep's
    bucket's mask, and the hooks recording them did not make dynamo compile more than once."""
    transformer = tiny_transformer(family)
    calls = forward_calls(transformer, [980.0, 700.0, 150.0])
    layout = call_layout(transformer, forward_arguments(transformer, (), calls[0]))
    plan = discriminating_plan(transformer, layout, EDGES, seed=4)
    counter = CompileCounterWithBackend("aot_eager")
    with apply(transformer, plan, backend="torch"):
        recorder = CompiledLayerRecorder(transformer, plan)
        compiled = torch.compile(transformer, fullgraph=True, backend=counter)
        try:
            with torch.no_grad():
                for inputs in calls:
                    recorder.run(compiled, inputs)
        finally:
            recorder.remove()
    assert check_every_layer(transformer, plan, recorder) == {0, 1, 2}
    assert counter.frame_count == 1


# -- dense flags -----------------------------------------------------------------------------------------


def deep_wan(layers: int = 6):
    """A tiny Wan with `layers` blocks: deep enough that a graph per block would show."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=layers,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


@pytest.mark.parametrize(("dense", "graphs"), [(None, 1), ("layer", 6), ("bucket", 2)])
@pytest.mark.slow
def test_blocks_compiled_one_by_one_share_one_graph_and_match_eager(dense, graphs):
    """Regional compilation (diffusers' `compile_repeated_blocks`, each block compiled on its own): every block reads
    its layer from a buffer, a graph input, so one graph serves all 6 blocks through every bucket (a lookup keyed by
    the module compiled one per block), equal to the eager PARO run. A plan with one layer dense everywhere (its
    flag read on the host per layer) compiles a graph per block and stays equal; one with a bucket dense in every
    layer (`--dense-steps`) two, the bucket's flag known from the eager pre-hook. Removing PARO leaves the blocks
    as they were: no buffer, nothing in the state dict."""
    assert_crosses_buckets()
    transformer = deep_wan()
    state = set(transformer.state_dict())
    plan = sparse_plan(transformer)
    if dense == "layer":
        plan.dense[:, 2] = True
    elif dense == "bucket":
        plan.dense[1, :] = True
    calls = forward_calls(transformer)
    counter = CompileCounterWithBackend("aot_eager")
    with apply(transformer, plan, backend="torch"), torch.no_grad():
        assert set(transformer.state_dict()) == state
        eager = [transformer(**inputs)[0] for inputs in calls]
        transformer.compile_repeated_blocks(fullgraph=True, backend=counter)
        compiled = [transformer(**inputs)[0] for inputs in calls]
    for got, want, t in zip(compiled, eager, TIMESTEPS, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, t=t: f"t={t}: {m}")
    assert counter.frame_count == graphs
    assert not any("paro" in name for name, _ in transformer.named_buffers())
    assert not any(hasattr(m, "paro_other_attention") for m in transformer.modules())


@pytest.mark.slow
def test_dense_flags_static_per_layer_and_by_bucket():
    """Wan, 2 layers: layer 0 dense in every bucket (a host branch in the graph), layer 1 dense in bucket 0
    only (both results computed, the bucket's kept by `torch.where`): equal to eager, one compile."""
    transformer = tiny_transformer("wan")
    plan = sparse_plan(transformer)
    plan.dense[:, 0] = True
    plan.dense[0, 1] = True
    calls = forward_calls(transformer)
    with apply(transformer, plan, backend="torch"):
        counter, outputs = run_compiled_and_eager(transformer, calls)
    plan.dense[:] = True
    with apply(transformer, plan, backend="torch"), torch.no_grad():
        all_dense = [transformer(**inputs)[0] for inputs in calls]
    for (got, want), dense, t in zip(outputs, all_dense, TIMESTEPS, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        if bucket_index(EDGES, t) == 0:  # both layers dense there: the model's own attention
            torch.testing.assert_close(got, dense, rtol=RTOL, atol=ATOL)
        else:
            assert (got - dense).abs().max() > 1e-3
    assert counter.frame_count == 1


# -- lone processors --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lone_processor_compiles_once_bound_and_refuses_unbound():
    """`set_attn_processor(PAROProcessor(plan))` (one instance, Wan's cross-attention included): bound by one
    eager forward, the compiled model equals eager in one compile; never bound, fullgraph tracing refuses
    with what to do instead of walking frames it cannot trace."""
    transformer = tiny_transformer("wan")
    plan = sparse_plan(transformer)
    calls = forward_calls(transformer, [980.0, 700.0, 150.0])
    originals = dict(transformer.attn_processors)
    try:
        transformer.set_attn_processor(PAROProcessor(plan, backend="torch"))
        with torch.no_grad():
            transformer(**calls[0])  # binds
        counter, outputs = run_compiled_and_eager(transformer, calls)
        for got, want in outputs:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        assert counter.frame_count == 1

        torch._dynamo.reset()
        transformer.set_attn_processor(PAROProcessor(plan, backend="torch"))
        with torch.no_grad(), pytest.raises(Exception, match="bind it before compiling"):
            torch.compile(transformer, fullgraph=True, backend="aot_eager")(**calls[0])
    finally:
        transformer.set_attn_processor(originals)


@pytest.mark.slow
def test_mismatch_under_compile_raises_or_warns_and_runs_dense():
    """A call at another size: on_mismatch="error" raises the PlanError with the command that fixes it;
    on_mismatch="dense" gives the warning (which dynamo cannot trace) while the graph is traced and runs the
    model's own attention, in one graph."""
    transformer = tiny_transformer("wan")
    plan = sparse_plan(transformer)
    other = tiny_forward_inputs(transformer, height=12)
    with torch.no_grad():
        expected = transformer(**other)[0]
    with apply(transformer, plan, backend="torch"), torch.no_grad():
        with pytest.raises(Exception, match="plan was calibrated for 3x4x4 tokens.*paro calibrate MODEL_DIR"):
            torch.compile(transformer, fullgraph=True, backend="aot_eager")(**other)
    torch._dynamo.reset()
    with apply(transformer, plan, backend="torch", on_mismatch="dense"), torch.no_grad():
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(transformer, fullgraph=True, backend=counter)
        with pytest.warns(UserWarning, match="running the model's own attention"):
            got = compiled(**other)[0]
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert counter.frame_count == 1


# -- the reference op traced alone ------------------------------------------------------------------------

OP_LAYOUT = TokenLayout(3, 2, 4, 5)  # 43 tokens, partial last block


@pytest.mark.parametrize("path", ["fused", "loop"])
@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "fp8")])
def test_traced_reference_keeps_values_and_nan_rules(path, qk, pv, monkeypatch):
    """`paro_attention(backend="torch")` compiled with fullgraph (orders a tensor, never read on the host)
    equals eager: on clean inputs and with NaN in q, k and v, where the eager reference tests for NaN first and
    the traced one cannot (same NaN positions, other values within float32 rounding)."""
    if path == "loop":
        monkeypatch.setattr(reference, "_SDPA_MASK_ELEMENTS", 0)
    g = torch.Generator().manual_seed(5)
    H, N, D = 3, OP_LAYOUT.seq_len, 16
    n = -(-N // TINY_BLOCK)
    mask = (torch.rand(H, n, n, generator=g) < 0.5) | torch.eye(n, dtype=torch.bool)
    mask[2, 1] = False  # a query block with no active key block: zeros whatever reaches the head
    orders = torch.tensor([1, 3, 5])
    q, k, v = (torch.randn(2, H, N, D, generator=g) for _ in range(3))

    def op(q, k, v, orders, mask):
        return paro_attention(q, k, v, layout=OP_LAYOUT, orders=orders, block_mask=mask, block_size=TINY_BLOCK,
                              qk=qk, pv=pv, backend="torch")

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(op, fullgraph=True, backend=counter)
    torch.testing.assert_close(compiled(q, k, v, orders, mask), op(q, k, v, orders, mask), rtol=RTOL, atol=ATOL)
    nan = float("nan")
    q[0, 0, 20, 3] = nan
    k[1, 1, 7, 0] = nan
    v[0, 2, 30, 5] = nan
    want = op(q, k, v, orders, mask)
    got = compiled(q, k, v, orders, mask)
    assert want.isnan().any() and not want.isnan().all()
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=RTOL, atol=ATOL)
    assert counter.frame_count == 1


def test_bucket_tensor_is_bucket_index_on_the_device():
    """The traced bucket (a 0-dim int64 tensor, float64 math) is the host bucket for every family's timestep
    form: CogVideoX ints, Wan floats, Flux t / 1000 scaled by 1000; edge values and NaN included."""
    g = torch.Generator().manual_seed(6)
    for buckets in (1, 2, 3, 6):
        edges = default_bucket_edges(buckets)
        values = torch.cat([torch.tensor(edges + [750.5, 999.0, -3.0, 1200.0]), 1000 * torch.rand(300, generator=g)])
        for t in values.tolist() + [float("nan")]:
            for timestep, scale in ((torch.tensor([t, t - 1]), 1.0), (torch.tensor([int(t) if t == t else 0]), 1.0),
                                    (torch.tensor([t / 1000.0]), 1000.0), (torch.tensor(t, dtype=torch.bfloat16), 1.0)):
                got = bucket_tensor(edges, timestep, scale)
                assert got.dtype == torch.int64 and got.dim() == 0
                assert int(got) == bucket_index(edges, scale * float(timestep.max())), (edges, t, timestep, scale)


# -- active-block lists: the Triton backend's masks ----------------------------------------------------------


def test_stacked_lists_are_the_plans_masks():
    """`MaskStore(lists=True)`, resident: one list width for the whole plan, and every (bucket, layer) picked
    with an int or a device tensor is `ActiveBlocks.from_mask`'s lists of the plan's mask (padding aside)."""
    layout = TokenLayout(5, 3, 6, 7)
    plan = Plan.synthetic(layout=layout, num_layers=3, num_heads=2, density=0.3, orders="random", num_buckets=3,
                          block_size=TINY_BLOCK)
    plan.dense[1, 2] = True
    store = MaskStore(plan, "cpu", lists=True)
    assert store.indices.shape[-1] == int(plan.block_mask.sum(dim=-1).max())
    assert store.layer_dense == (False, False, None)
    for b in range(plan.num_buckets):
        for layer in range(plan.num_layers):
            built = ActiveBlocks.from_mask(plan.block_mask[b, layer])
            for bucket in (b, torch.tensor(b)):
                blocks = store.get(bucket, layer)
                assert torch.equal(blocks.to_mask(), plan.block_mask[b, layer])
                assert torch.equal(blocks.counts, built.counts) and torch.equal(blocks.schedule, built.schedule)
                assert torch.equal(blocks.indices[..., : built.indices.shape[-1]], built.indices)
                assert bool(store.is_dense(bucket, layer)) == bool(plan.dense[b, layer])


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton's interpreter


def on_device(inputs: dict, device: str = DEVICE) -> dict:
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if "image_rotary_emb" in moved:  # CogVideoX's RoPE tables come with the call
        moved["image_rotary_emb"] = tuple(t.to(device) for t in moved["image_rotary_emb"])
    return moved


def triton_model():
    transformer = tiny_transformer("cogvideox", dtype=torch.float16, head_dim=64).to(DEVICE)  # the kernels' head dims
    # compiled Triton takes blocks of >= 32; the interpreter the tiny ones
    return transformer, sparse_plan(transformer, block_size=TINY_BLOCK if DEVICE == "cpu" else 32)


@pytest.mark.slow
def test_triton_backend_compiles_once_with_resident_lists():
    """backend="triton": the custom op reads active-block lists indexed out of the stacked store by the device
    bucket; equal to the eager Triton run, one compile over 3 buckets."""
    transformer, plan = triton_model()
    calls = [on_device(c) for c in forward_calls(transformer, [980.0, 700.0, 150.0])]
    with apply(transformer, plan, backend="triton", resident=True) as handle:
        counter, outputs = run_compiled_and_eager(transformer, calls)
        runner = handle.processor.runner
        store = next(store for key, store in runner.stores.items() if key.startswith(str(calls[0]["hidden_states"].device)))
        assert store.lists and store.traced
    for got, want in outputs:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counter.frame_count == 1


@pytest.mark.slow
def test_compiled_calls_keep_one_buffer_set_and_replay_its_launches():
    """The custom op of a compiled graph takes the stream's kept buffer set, as eager calls do: after compiled calls
    alone, the device's runtime holds the set, its launches recorded by the first call and replayed by the others,
    and the outputs equal a fresh eager run's (the default stream; CUDA-graph trees warm up on a stream of their
    own, test_triton_fullgraph_and_cuda_graphs_on_the_gpu)."""
    transformer, plan = triton_model()
    calls = [on_device(c) for c in forward_calls(transformer, [980.0, 700.0])]
    with apply(transformer, plan, backend="triton", resident=True), torch.no_grad():
        runtime.clear()
        compiled = torch.compile(transformer, fullgraph=True, backend="aot_eager")
        got = [compiled(**inputs)[0] for inputs in calls + calls]
        kept = runtime.runtime_of(torch.device(DEVICE)).workspaces
        assert len(kept) == 1, list(kept)
        (buffers,) = kept.values()
        assert buffers.sequences is not None and len(buffers.sequences) >= 1
        runtime.clear()
        want = [transformer(**inputs)[0] for inputs in calls + calls]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_streamed_masks_are_refused_under_compile():
    """resident=False asks for masks streamed per layer on a side stream, which cannot be traced: the error
    says to pass resident=True or to run without torch.compile."""
    transformer, plan = triton_model()
    with apply(transformer, plan, backend="triton", resident=False), torch.no_grad():
        compiled = torch.compile(transformer, fullgraph=True, backend="aot_eager")
        with pytest.raises(Exception, match="pass resident=True"):
            compiled(**on_device(tiny_forward_inputs(transformer)))


@pytest.mark.gpu
@pytest.mark.parametrize("qk,pv", [("bf16", "bf16"), ("int8", "fp8")])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("family", ["wan", "flux"])
def test_triton_fullgraph_and_cuda_graphs_on_the_gpu(family, mode, qk, pv):
    """The Triton kernels (bf16 or int8 QK + fp8 PV with its statistics launch, head dim 128, 64 x 64 blocks)
    in a transformer compiled with inductor, and
    captured in CUDA graphs (mode="reduce-overhead"): compiled once, no CUDA graph skipped, the outputs of
    calls through all 3 buckets those of the eager run to within bf16 rounding (inductor fuses the ops around
    the kernel), and each call's bucket picks its masks: the same compiled model with a plan whose every
    bucket holds bucket 0's masks gives the same outputs for the calls in bucket 0 and other ones later."""
    from torch._dynamo.utils import counters

    transformer = tiny_transformer(family, dtype=torch.bfloat16, head_dim=128).cuda()
    size = {"height": 32, "width": 32} if family == "flux" else {"frames": 4, "height": 32, "width": 32}
    timesteps = [980.0, 900.0, 700.0, 400.0, 150.0]
    calls = [on_device(tiny_forward_inputs(transformer, timestep=t, seed=i, **size), "cuda")
             for i, t in enumerate(timesteps)]
    plan = Plan.synthetic(
        layout=family_of(transformer).call_inputs(transformer, calls[0]).layout,
        num_layers=len(self_attention_layers(transformer)), num_heads=transformer.config.num_attention_heads,
        density=0.4, orders="random", num_buckets=3, block_size=64, qk=qk, pv=pv,
        model_class=type(transformer).__name__, model_fingerprint=model_fingerprint(transformer.config),
    )
    one_bucket = Plan(**{**plan.__dict__, "block_mask": plan.block_mask[[0, 0, 0]], "density": None, "dense": None})

    def compiled_run(plan):
        with apply(transformer, plan, backend="triton"), torch.no_grad():
            compiled = torch.compile(transformer, fullgraph=True, mode=None if mode == "default" else mode)
            return ([compiled(**inputs)[0].clone() for inputs in calls],
                    [transformer(**inputs)[0] for inputs in calls])

    counters.clear()
    got, want = compiled_run(plan)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["inductor"]["cudagraph_skips"]
    # buffer sets are kept for the default stream only: none from the CUDA-graph trees' warm-up stream
    kept = runtime.runtime_of(torch.device("cuda")).workspaces
    assert kept and {key[0] for key in kept} == {torch.cuda.default_stream().cuda_stream}, list(kept)
    scale = max(float(w.float().abs().max()) for w in want)
    error = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want, strict=True)) / scale
    assert error < 2e-2  # bf16: inductor rounds the ops fused around the kernel differently
    torch._dynamo.reset()
    got_0, _ = compiled_run(one_bucket)
    for g, g0, t in zip(got, got_0, timesteps, strict=True):
        difference = float((g.float() - g0.float()).abs().mean()) / scale
        print(f"{family} {mode} {qk}+{pv} t={t:.0f}: compiled vs eager up to {error:.1e}, vs bucket 0's masks {difference:.1e}")
        if bucket_index(EDGES, t) == 0:
            assert difference < 1e-4
        else:
            assert difference > 1e-3


@pytest.mark.gpu
def test_compiled_calls_on_a_side_stream_allocate_per_call():
    """Off the default stream the compiled op keeps no buffer set (it cannot tell a user's side stream from the
    CUDA-graph trees' warm-up stream, whose memory the trees hand out again); on it, one set is kept. Both give the
    eager outputs."""
    transformer = tiny_transformer("wan", dtype=torch.bfloat16, head_dim=128).cuda()
    inputs = on_device(tiny_forward_inputs(transformer, frames=4, height=32, width=32), "cuda")
    plan = Plan.synthetic(
        layout=family_of(transformer).call_inputs(transformer, inputs).layout,
        num_layers=len(self_attention_layers(transformer)), num_heads=transformer.config.num_attention_heads,
        density=0.4, orders="random", num_buckets=1, block_size=64, qk="int8", pv="fp8",
        model_class=type(transformer).__name__, model_fingerprint=model_fingerprint(transformer.config))
    with apply(transformer, plan, backend="triton"), torch.no_grad():
        runtime.clear()
        want = transformer(**inputs)[0]
        runtime.clear()
        compiled = torch.compile(transformer, fullgraph=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = compiled(**inputs)[0]
        torch.cuda.current_stream().wait_stream(side)
        kept = runtime.runtime_of(torch.device("cuda")).workspaces
        assert not kept, list(kept)
        on_default = compiled(**inputs)[0]
        assert len(kept) == 1
    scale = float(want.float().abs().max())
    for got in (on_side, on_default):
        assert float((got.float() - want.float()).abs().max()) / scale < 2e-2


@pytest.mark.gpu
def test_auto_backend_falls_back_to_the_reference_under_compile_on_the_gpu():
    """backend="auto" on CUDA with a call the kernels do not take (float32, head dim 16): the fallback's
    warning is given while tracing, and the torch reference runs on the GPU in the one graph."""
    transformer = tiny_transformer("wan").cuda()
    plan = sparse_plan(transformer)
    calls = [on_device(c, "cuda") for c in forward_calls(transformer)]
    with apply(transformer, plan, backend="auto"):
        with pytest.warns(UserWarning, match="backend='auto' runs the torch reference"):
            counter, outputs = run_compiled_and_eager(transformer, calls)
    for got, want in outputs:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert counter.frame_count == 1


def test_a_second_plan_on_the_same_model_compiles_again_without_dynamic():
    """Apply, compile, remove, then another plan (a new binding) compiled again by the default torch.compile (no
    dynamic=False): dynamo marks what differs between the two compiles of the shared code dynamic, and the binding's
    token must stay a constant there (an int token turned symbolic and broke the graph)."""
    transformer = tiny_transformer("wan")
    inputs = forward_calls(transformer)[0]
    for seed in (0, 1):
        plan = sparse_plan(transformer)
        plan = dataclasses.replace(plan, orders=torch.randint(0, 6, plan.orders.shape,
                                                              generator=torch.Generator().manual_seed(seed)))
        with apply(transformer, plan, backend="torch"), torch.no_grad():
            eager = transformer(**inputs)[0]
            compiled = torch.compile(transformer, fullgraph=True, backend="aot_eager")(**inputs)[0]
        torch.testing.assert_close(compiled, eager, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_a_second_size_under_the_default_compile_specializes_and_matches_eager():
    """torch.compile without dynamic=False makes the sizes of a second size symbolic; the token grid must enter
    the layout check as constants (a symbolic tuple failed to trace with an error about constant conversion), so each
    size compiles to its own graph, its masks derived from the plan's axis profiles, equal to eager; a plan that cannot
    serve the size says so under compile as in eager."""
    transformer = tiny_transformer("wan")
    first = tiny_forward_inputs(transformer)
    second = tiny_forward_inputs(transformer, frames=5, height=12, width=8)
    layout = family_of(transformer).call_inputs(transformer, first).layout
    for profiles in (True, False):
        plan = Plan.synthetic(layout=layout, num_layers=len(self_attention_layers(transformer)),
                              num_heads=transformer.config.num_attention_heads, density=0.5, orders="random",
                              num_buckets=3, block_size=TINY_BLOCK, model_class=type(transformer).__name__,
                              model_fingerprint=model_fingerprint(transformer.config), profiles=profiles)
        torch._dynamo.reset()
        with apply(transformer, plan, backend="torch"), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the derived size's note
            compiled = torch.compile(transformer, fullgraph=True, backend="aot_eager")
            torch.testing.assert_close(compiled(**first)[0], transformer(**first)[0], rtol=RTOL, atol=ATOL)
            if not profiles:
                with pytest.raises(Exception, match="plan was calibrated for 3x4x4 tokens"):
                    compiled(**second)
                continue
            for inputs in (second, first, second):
                torch.testing.assert_close(compiled(**inputs)[0], transformer(**inputs)[0], rtol=RTOL, atol=ATOL)
