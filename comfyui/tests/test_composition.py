"""Apply PARO together with what ComfyUI graphs put around a model, on the tiny Wan model on the CPU: a LoRA
(before or after the node), step-distilled sampling (4 steps, cfg 1), ComfyUI's cache nodes (EasyCache,
LazyCache), its TorchCompileModel node, and the attention function ComfyUI selected (`--use-sage-attention` and
the like), which every call PARO leaves must run."""

from __future__ import annotations

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


def compiled_run(nodes, keep: str) -> tuple[list[str], list[str]]:
    """Run the graph with the model compiled by TorchCompileModel from a fresh dynamo cache; (the reasons of its
    graph breaks, one per break, the functions it recompiled)."""
    import logging

    import torch._dynamo
    from torch._dynamo.utils import counters

    recompiled = []

    class Recompiles(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Recompiling function"):
                recompiled.append(message.split(" in ")[0].removeprefix("Recompiling function ") + " in "
                                  + message.split(" in ")[1].split(":")[0].rsplit("/", 2)[-1] + ": "
                                  + message.split("\n")[2].strip())

    handler = Recompiles()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    torch._dynamo.reset()
    counters.clear()
    try:
        assert run_chained([*nodes, COMPILE], keep=keep)[:2] == (True, "")
        breaks = [reason.split("\n")[0] for reason, count in counters["graph_break"].items() for _ in range(count)]
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()  # the graphs of this run only
    return breaks, recompiled


def test_torch_compile_model_runs_the_plan_of_every_call(wan):
    """The PARO hook runs eagerly inside the compiled model (a graph break at each attention call): the compiled
    run equals the eager one, every layer and step with its own plan entry, and PARO adds no recompile."""
    plan = synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5, seed=16)
    name = save_plan(plan, "compile-d05.safetensors")
    plain_breaks, plain_recompiled = compiled_run([], "compiled-plain")
    breaks, recompiled = compiled_run([apply_paro(name)], "compiled-paro")
    assert run_chained([apply_paro(name)], keep="eager-paro")[:2] == (True, "")
    paro, eager, plain = latent_of("compiled-paro"), latent_of("eager-paro"), latent_of("compiled-plain")
    print(f"compiled vs eager PARO: {relative(paro, eager):.2e}; vs compiled without PARO: {relative(paro, plain):.2e}"
          f"\ngraph breaks without PARO: {len(plain_breaks)} ({sorted(set(plain_breaks))}); with PARO: {len(breaks)} "
          f"({sorted(set(breaks))})\nrecompiled without PARO: {plain_recompiled}\nwith PARO: {recompiled}")
    assert relative(paro, eager) < 1e-5 and relative(paro, plain) > 1e-4
    assert set(breaks) == {"Skip inlining `torch.compiler.disable()`d function"}  # the hook's, nothing inside it
    assert not [r for r in recompiled if "hook.py" in r or "paroattn" in r]
