"""Apply PARO together with what ComfyUI graphs put around a model, on the tiny Wan model on the CPU: a LoRA
(before or after the node), step-distilled sampling (4 steps, cfg 1), ComfyUI's cache nodes (EasyCache,
LazyCache), its TorchCompileModel node, and the attention function ComfyUI selected (`--use-sage-attention` and
the like), which every call PARO leaves must run."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from model_chain import apply_paro, run_chained
from test_graphs import BLOCK, WAN_LAYOUT, compare_with_diffusers, latent_of, records, save_plan, synthetic_plan

import paroattn
from paroattn import Plan
from paroattn.runner import PlanRunner

RANK = 4


def diffusers_wan(model):
    def run(x, timestep, context, *_):
        return model(hidden_states=x, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]
    return run


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / float(b.abs().max())


@pytest.fixture
def buckets_used(monkeypatch) -> list:
    """(bucket, layer) of every PARO layer call, in order (PlanRunner.attention, which every hook calls)."""
    used = []
    attention = PlanRunner.attention

    def spy(self, store, bucket, layer, *args, **kwargs):
        used.append((int(bucket), int(layer)))
        return attention(self, store, bucket, layer, *args, **kwargs)

    monkeypatch.setattr(PlanRunner, "attention", spy)
    return used


# -- LoRA -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora(wan):
    """A LoRA on the self- and cross-attention projections of the tiny Wan (models/loras/tiny-wan-lora), and the
    model with it merged into its weights (tiny-wan-merged), as ComfyUI merges it: W + strength * alpha / rank *
    up @ down."""
    import folder_paths
    from safetensors.torch import load_file, safe_open, save_file

    models = Path(folder_paths.get_folder_paths("diffusion_models")[0])
    weights = load_file(models / "tiny-wan.safetensors")
    with safe_open(models / "tiny-wan.safetensors", "pt") as f:
        metadata = f.metadata()
    g = torch.Generator().manual_seed(11)
    adapter, alpha = {}, 2.0
    for block in range(2):
        for name in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q"):
            key = f"blocks.{block}.{name}"
            out_features, in_features = weights[key + ".weight"].shape
            up = torch.randn(out_features, RANK, generator=g) * 0.3
            down = torch.randn(RANK, in_features, generator=g) * 0.3
            adapter[f"diffusion_model.{key}.lora_up.weight"] = up
            adapter[f"diffusion_model.{key}.lora_down.weight"] = down
            adapter[f"diffusion_model.{key}.alpha"] = torch.tensor(alpha)
            weights[key + ".weight"] = weights[key + ".weight"] + alpha / RANK * (up @ down)
    folder = Path(folder_paths.get_folder_paths("loras")[0])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(adapter, str(folder / "tiny-wan-lora.safetensors"))
    save_file(weights, str(models / "tiny-wan-merged.safetensors"), metadata=metadata)
    return "tiny-wan-lora.safetensors"


def test_lora_before_or_after_apply_paro_runs_the_plan_on_the_patched_weights(lora):
    with_lora = ("LoraLoaderModelOnly", {"lora_name": lora, "strength_model": 1.0})
    full = save_plan(synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 1.0), "lora-d1.safetensors")
    sparse = save_plan(synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5, seed=12), "lora-d05.safetensors")
    runs = {
        "lora": [with_lora],
        "lora-d1": [with_lora, apply_paro(full)],
        "lora-paro": [with_lora, apply_paro(sparse)],
        "paro-lora": [apply_paro(sparse), with_lora],
        "paro": [apply_paro(sparse)],
    }
    for key, nodes in runs.items():
        assert run_chained(nodes, keep=key)[:2] == (True, ""), key
    prompt_merged = [apply_paro(sparse)]
    import comfy_env
    from model_chain import chained

    prompt, outputs = chained(prompt_merged, keep="merged-paro")
    prompt["model"]["inputs"]["unet_name"] = "tiny-wan-merged.safetensors"
    ok, messages = comfy_env.run(prompt, outputs)
    assert (ok, comfy_env.error_message(messages)) == (True, "")
    lora_only, paro = latent_of("lora"), latent_of("lora-paro")
    print(f"LoRA + d=1 plan vs LoRA alone: {relative(latent_of('lora-d1'), lora_only):.2e}; LoRA then PARO vs "
          f"merged weights with PARO: {relative(paro, latent_of('merged-paro')):.2e}; vs PARO without the LoRA: "
          f"{relative(paro, latent_of('paro')):.2e}")
    assert relative(latent_of("lora-d1"), lora_only) < 1e-4
    assert torch.equal(latent_of("paro-lora"), paro)  # the order of the two nodes does not matter
    assert relative(paro, latent_of("merged-paro")) < 1e-5
    assert relative(paro, latent_of("paro")) > 1e-3  # the LoRA changed what PARO ran on


# -- step-distilled sampling ----------------------------------------------------------------------------------
DISTILLED = {"steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple"}
SHIFT = ("ModelSamplingSD3", {"shift": 5.0})  # timesteps 1000, 938, 833, 625


def test_four_step_sampling_runs_each_step_in_the_bucket_of_its_timestep(wan, buckets_used):
    """A plan with the default six timestep buckets serves a 4-step, cfg-1 sampler (what step-distilled Wan
    LoRAs run): each step's calls take the bucket of the step's timestep, whatever the step's index."""
    plan = Plan.synthetic(layout=WAN_LAYOUT, num_layers=2, num_heads=2, density=0.5, orders="random", num_buckets=6,
                          block_size=BLOCK, model_class="WanTransformer3DModel", seed=13)
    name = save_plan(plan, "distilled-d05.safetensors")
    assert run_chained([SHIFT, apply_paro(name)], record="distilled", keep="distilled-latent", **DISTILLED)[:2] == (True, "")
    calls = records()["distilled"]
    assert len(calls) == 4  # cfg 1: no unconditional call
    timesteps = [float(call["args"][1].max()) for call in calls]
    expected = [(plan.bucket_of(t), layer) for t in timesteps for layer in range(2)]
    print(f"4 steps at timesteps {[round(t) for t in timesteps]}: buckets {[b for b, _ in expected[::2]]}")
    assert buckets_used == expected
    assert [b for b, _ in expected[::2]] == [0, 0, 1, 3]  # not the step index
    with paroattn.apply(wan, plan, backend="torch"):
        assert compare_with_diffusers(calls, diffusers_wan(wan), "Wan, 4 steps, d=0.5 plan") < 1e-5


def test_plan_auto_learnt_from_four_steps_counts_each_step_in_its_bucket(wan, monkeypatch, tmp_path):
    monkeypatch.setenv("PAROATTN_CACHE", str(tmp_path))
    nodes = [SHIFT, apply_paro(density=0.5, block_size=BLOCK)]
    assert run_chained(nodes, record="distilled-auto", keep="distilled-auto-latent", **DISTILLED)[:2] == (True, "")
    plan = paroattn.Plan.load(next(tmp_path.glob("*.safetensors")))
    steps = [0] * plan.num_buckets
    for call in records()["distilled-auto"]:
        steps[plan.bucket_of(float(call["args"][1].max()))] += 1
    assert plan.info["steps_per_bucket"] == steps  # every step seen as one, in its own bucket


# -- ComfyUI's cache nodes ------------------------------------------------------------------------------------
CACHE_STEPS = 8


@pytest.mark.parametrize("node", ["EasyCache", "LazyCache"])
def test_cache_nodes_skip_steps_and_the_steps_that_run_run_the_plan(wan, node):
    """The cache node skips model calls; those that run take PARO with the bucket of their timestep. With a
    full-density plan the cache decides as without PARO and the latent is the cache node's alone."""
    cache = (node, {"reuse_threshold": 1.0, "start_percent": 0.1, "end_percent": 0.95, "verbose": False})
    sampling = {"steps": CACHE_STEPS}
    full = save_plan(synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 1.0), "cache-d1.safetensors")
    plan = synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5, seed=14)
    sparse = save_plan(plan, "cache-d05.safetensors")
    for key, nodes in {"alone": [cache], "d1": [apply_paro(full), cache], "after": [apply_paro(sparse), cache],
                       "before": [cache, apply_paro(sparse)]}.items():
        record = f"{node}-{key}-calls"
        assert run_chained(nodes, record=record, keep=f"{node}-{key}", **sampling)[:2] == (True, ""), key
    calls = records()[f"{node}-after-calls"]
    print(f"{node}: {len(calls)} of {CACHE_STEPS} model calls ran")
    assert 0 < len(calls) < CACHE_STEPS  # it skipped some
    assert relative(latent_of(f"{node}-d1"), latent_of(f"{node}-alone")) < 1e-4
    assert torch.equal(latent_of(f"{node}-after"), latent_of(f"{node}-before"))
    with paroattn.apply(wan, plan, backend="torch"):
        assert compare_with_diffusers(calls, diffusers_wan(wan), f"Wan under {node}, d=0.5 plan") < 1e-5


# -- the attention function ComfyUI selected ------------------------------------------------------------------
def test_calls_paro_leaves_run_the_attention_function_comfyui_selected(wan, monkeypatch, tmp_path):
    """ComfyUI binds the attention function it selected at start (`--use-sage-attention`: attention_sage, ...)
    as the models' `optimized_attention`, which hands it to PARO's override as `func`: cross-attention, the
    layers a plan keeps dense and the dense calls of a learning run must run it."""
    import comfy.ldm.wan.model
    from comfy.ldm.modules.attention import wrap_attn

    selected = comfy.ldm.wan.model.optimized_attention.__wrapped__
    seen = []

    def spy(q, k, v, heads, *args, **kwargs):
        seen.append("self" if k.shape[1] == q.shape[1] else "cross")
        return selected(q, k, v, heads, *args, **kwargs)

    assert run_chained([], keep="unspied")[:2] == (True, "")
    monkeypatch.setattr(comfy.ldm.wan.model, "optimized_attention", wrap_attn(spy))
    assert run_chained([], keep="spied")[:2] == (True, "")
    assert torch.equal(latent_of("spied"), latent_of("unspied"))
    model_calls = 2 * 3  # cond and uncond batched in one call per step: 3 steps, 2 blocks
    assert seen.count("self") == model_calls and seen.count("cross") == model_calls

    plan = synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5, seed=15)
    plan.dense[:, 1] = True  # layer 1 dense in every bucket: the model's own attention there
    name = save_plan(plan, "spy-dense-layer.safetensors")
    seen.clear()
    assert run_chained([apply_paro(name)], keep="spied-paro")[:2] == (True, "")
    assert seen.count("self") == 3 and seen.count("cross") == model_calls

    monkeypatch.setenv("PAROATTN_CACHE", str(tmp_path))
    seen.clear()
    assert run_chained([apply_paro(density=0.5, block_size=BLOCK)], keep="spied-learning")[:2] == (True, "")
    assert seen.count("self") == model_calls and seen.count("cross") == model_calls
    assert torch.equal(latent_of("spied-learning"), latent_of("unspied"))


# -- TorchCompileModel ----------------------------------------------------------------------------------------
COMPILE = ("TorchCompileModel", {"backend": "inductor"})


def disabled_only(breaks: list[str]) -> bool:
    """Whether every break is at a call of a `torch.compiler.disable`d function (none inside it), and there is one."""
    return bool(breaks) and all(b.endswith("`torch.compiler.disable()`d function") for b in breaks)


@pytest.fixture
def sdpa(wan, monkeypatch):
    """The tiny Wan with PyTorch's SDPA as ComfyUI's attention function, ComfyUI's choice on NVIDIA GPUs: the model
    compiles into one graph. (On the CPU ComfyUI picks its sub-quadratic attention, which breaks every graph it is
    traced in, with or without PARO: 'Failed to trace builtin operator'.)"""
    import comfy.ldm.wan.model
    from comfy.ldm.modules.attention import attention_pytorch

    monkeypatch.setattr(comfy.ldm.wan.model, "optimized_attention", attention_pytorch)


class Compiled:
    """What dynamo did while graphs ran under TorchCompileModel: `breaks`, the reasons of its graph breaks (one per
    break traced); `recompiled`, "function in file: the first failed guard" per recompile; `graphs`, the graphs
    it compiled."""

    def __init__(self):
        self.breaks: list[str] = []
        self.recompiled: list[str] = []
        self.graphs = 0


@contextlib.contextmanager
def dynamo_record():
    """A `Compiled` filled by the graphs run inside, from a fresh dynamo cache (reset again after)."""
    import logging

    import torch._dynamo
    from torch._dynamo.utils import counters

    compiled = Compiled()

    class Recompiles(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Recompiling function"):
                function, where = message.split("\n")[0].removeprefix("Recompiling function ").split(" in ")
                guard = message.split("\n")[2].strip().split("  #")[0]
                compiled.recompiled.append(f"{function} in {where.split(':')[0].rsplit('/', 1)[-1]}: {guard}")

    handler = Recompiles()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    torch._dynamo.reset()
    counters.clear()
    try:
        yield compiled
        compiled.breaks = [reason.split("\n")[0] for reason, count in counters["graph_break"].items()
                           for _ in range(count)]
        compiled.graphs = counters["stats"]["unique_graphs"]
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()


def compiled_run(nodes, keep: str) -> Compiled:
    """Run the graph with the model compiled by TorchCompileModel, from a fresh dynamo cache."""
    with dynamo_record() as compiled:
        assert run_chained([*nodes, COMPILE], keep=keep)[:2] == (True, "")
    return compiled


def bucket_dependent_plan(seed: int) -> Plan:
    """A d=0.5 plan whose 3 buckets the 3 steps cross, layer 1 dense in the first bucket only (its flag depends on
    the bucket: a traced call computes both and keeps the bucket's)."""
    plan = synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5, seed=seed)
    plan.dense[0, 1] = True
    return plan


def test_torch_compile_model_traces_paro_into_the_models_one_graph(sdpa):
    """Under TorchCompileModel the model with Apply PARO is one graph, as without it: no graph break, no
    recompile across steps and buckets (the bucket is a tensor in the graph), and the compiled latent equals the
    eager one. Masks the runner would stream (a large plan on a GPU) run eagerly instead, a break at each call."""
    name = save_plan(bucket_dependent_plan(16), "compile-d05.safetensors")
    plain = compiled_run([], "compiled-plain")
    paro = compiled_run([apply_paro(name)], "compiled-paro")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PlanRunner, "traceable", lambda *_: False)
        streamed = compiled_run([apply_paro(name)], "compiled-streamed")
    assert run_chained([apply_paro(name)], keep="eager-paro")[:2] == (True, "")
    eager = latent_of("eager-paro")
    print(f"compiled vs eager PARO: {relative(latent_of('compiled-paro'), eager):.2e}; vs compiled without PARO: "
          f"{relative(latent_of('compiled-paro'), latent_of('compiled-plain')):.2e}; streamed masks: "
          f"{relative(latent_of('compiled-streamed'), eager):.2e}")
    for key, run in (("without PARO", plain), ("with PARO", paro), ("streamed", streamed)):
        print(f"{key}: {run.graphs} graphs, {len(run.breaks)} graph breaks {sorted(set(run.breaks))}, recompiled "
              f"{run.recompiled}")
    assert (plain.graphs, plain.breaks, plain.recompiled) == (1, [], [])
    assert (paro.graphs, paro.breaks, paro.recompiled) == (1, [], [])
    assert relative(latent_of("compiled-paro"), eager) < 1e-5
    assert relative(latent_of("compiled-paro"), latent_of("compiled-plain")) > 1e-4
    assert disabled_only(streamed.breaks) and relative(latent_of("compiled-streamed"), eager) < 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "sub-quadratic"])
def test_torch_compile_model_recompiles_once_for_each_apply_paro(wan, attention, request):
    """ComfyUI's compile node drops every guard on transformer_options, and one dynamo cache serves every
    TorchCompileModel of a process: a new Apply PARO (another plan, or none) must not run a graph traced for
    another. Each run below gets its own plan's latent, at the cost of one recompile of the model's forward; also
    with ComfyUI's CPU attention function, which breaks the graphs (dynamo resumes in frames of their own)."""
    if attention == "sdpa":
        request.getfixturevalue("sdpa")
    plans = {"a": save_plan(bucket_dependent_plan(16), "compile-a.safetensors"),
             "b": save_plan(synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5, seed=17),
                            "compile-b.safetensors")}
    nodes = {"a": [apply_paro(plans["a"])], "b": [apply_paro(plans["b"])], "plain": []}
    for key, chain in nodes.items():
        assert run_chained(chain, keep=f"eager-{key}")[:2] == (True, "")
    order = ["a", "b", "plain", "a"]
    with dynamo_record() as compiled:
        for i, key in enumerate(order):
            assert run_chained([*nodes[key], COMPILE], keep=f"compiled-{i}")[:2] == (True, "")
    print("\n".join(f"{key}: {relative(latent_of(f'compiled-{i}'), latent_of(f'eager-{key}')):.2e} from eager"
                    for i, key in enumerate(order)))
    print(f"{compiled.graphs} graphs, {len(compiled.breaks)} breaks {sorted(set(compiled.breaks))}; recompiled:\n"
          + "\n".join(compiled.recompiled))
    for i, key in enumerate(order):
        assert relative(latent_of(f"compiled-{i}"), latent_of(f"eager-{key}")) < 1e-5, (i, key)
    if attention == "sdpa":
        assert compiled.breaks == [] and compiled.graphs == len(order)
        assert [r.split(":")[0] for r in compiled.recompiled] == ["forward in model.py"] * (len(order) - 1)
    else:  # every break is ComfyUI's attention function's
        assert set(compiled.breaks) == {"Failed to trace builtin operator"}


def test_torch_compile_model_learns_plan_auto_eagerly_then_runs_it_in_the_graph(sdpa, monkeypatch, tmp_path):
    """Plan 'auto' under TorchCompileModel: the learning run records each self-attention call eagerly (a graph
    break at each, once), the next run traces the learnt plan into the graph and equals its eager run."""
    monkeypatch.setenv("PAROATTN_CACHE", str(tmp_path))
    auto = [apply_paro(density=0.5, block_size=BLOCK)]
    import comfy_env
    from model_chain import chained

    runner = comfy_env.executor()  # one ComfyUI executor: the second run reuses the hook that learnt
    with dynamo_record() as learning:
        assert run_chained([*auto, COMPILE], runner, keep="compiled-learning")[:2] == (True, "")
    with dynamo_record() as learnt:  # another seed, so that the sampler runs again
        assert run_chained([*auto, COMPILE], runner, keep="compiled-learnt", seed=8)[:2] == (True, "")
    prompt, outputs = chained(auto, keep="eager-learnt", seed=8)
    ok, messages = comfy_env.run(prompt, outputs)
    assert (ok, comfy_env.error_message(messages)) == (True, "")
    print(f"learning: {len(learning.breaks)} breaks {sorted(set(learning.breaks))}; learnt: {learnt.graphs} graphs, "
          f"{len(learnt.breaks)} breaks, recompiled {learnt.recompiled}; compiled vs eager: "
          f"{relative(latent_of('compiled-learnt'), latent_of('eager-learnt')):.2e}")
    assert disabled_only(learning.breaks)
    assert (learnt.graphs, learnt.breaks) == (1, [])
    assert relative(latent_of("compiled-learnt"), latent_of("eager-learnt")) < 1e-5
