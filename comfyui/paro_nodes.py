"""The PARO nodes: Load PARO plan, Apply PARO (with a plan, or plan 'auto': `auto.py`), PARO calibrate.

Plans live in ComfyUI's `models/paroattn/` (or any folder named `paroattn` in extra_model_paths.yaml): the files
`paro calibrate` writes for diffusers, and those PARO calibrate writes here; both sides read both.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import folder_paths

from paroattn import Plan, PlanError, load_plans
from paroattn.attention import BACKENDS
from paroattn.calibrate import CaptureConfig, SelectionConfig, StatsRecorder
from paroattn.calibrate.auto import cheap_capture
from paroattn.calibrate.driver import STATS_SUFFIX, plan_from_stats, save_calibration
from paroattn.modes import PV_MODES, QK_MODES
from paroattn.plan import expert_plan_path

from .auto import AutoPlan, auto_entry
from .families import UnsupportedModel, family_of
from .hook import OR_DENSE, PARORunner, StatsCapture

PLAN_FOLDER = "paroattn"
EXPERTS = ("transformer", "transformer_2")
EXPERT_CHOICES = ("auto", *EXPERTS)
CATEGORY = "paroattn"

if PLAN_FOLDER in folder_paths.folder_names_and_paths:
    folder_paths.folder_names_and_paths[PLAN_FOLDER][1].add(".safetensors")
else:
    folder_paths.folder_names_and_paths[PLAN_FOLDER] = ([os.path.join(folder_paths.models_dir, PLAN_FOLDER)],
                                                       {".safetensors"})


def plan_files() -> list[str]:
    """Plan files in the plan folders (calibration statistics beside them left out)."""
    return [name for name in folder_paths.get_filename_list(PLAN_FOLDER) if not name.endswith(STATS_SUFFIX)]


@dataclass
class PAROPlan:
    """What flows along a PARO_PLAN link: the plans read from one file (two for a Wan 2.2 expert pair)."""

    path: str
    plans: list[Plan] = field(default_factory=list)

    def for_expert(self, expert: str) -> Plan:
        """The plan of `expert` ("auto": the only plan of the file)."""
        if expert == "auto":
            if len(self.plans) > 1:
                names = ", ".join(p.expert for p in self.plans)
                raise PlanError(f"{os.path.basename(self.path)} is an expert pair ({names}): set expert on Apply PARO to "
                                "the expert this MODEL is (transformer: high noise, transformer_2: low noise)")
            return self.plans[0]
        for plan in self.plans:
            if (plan.expert or "transformer") == expert:
                return plan
        found = ", ".join(p.expert or "transformer" for p in self.plans)
        raise PlanError(f"{os.path.basename(self.path)} holds no {expert} plan (it holds {found}): load the pair "
                        "calibrated for this model, or set expert to one it holds")


def describe(plan: Plan) -> str:
    expert = f" ({plan.expert})" if plan.expert else ""
    return (f"{plan.model_class or 'model'}{expert}: {plan.num_layers} layers x {plan.num_heads} heads, calibrated at "
            f"{plan.layout} tokens, density {plan.target_density:g} (achieved {plan.achieved_density():.3f}), "
            f"qk {plan.qk} / pv {plan.pv}")


def plan_problems(plan: Plan, family) -> list[str]:
    """Ways `plan` does not fit the model of `family`: its class, layers, heads, and the config entries the plan
    records (head dim, channels; plans written before they were recorded have their layers and heads checked)."""
    problems = []
    if plan.model_class and plan.model_class not in family.diffusers_classes:
        problems.append(f"plan was calibrated for {plan.model_class}; this MODEL is a {family.models} model "
                        f"({family.diffusers_class} in diffusers)")
    if plan.num_layers != family.num_layers():
        problems.append(f"plan has {plan.num_layers} self-attention layers; this MODEL has {family.num_layers()}")
    if plan.num_heads != family.num_heads():
        problems.append(f"plan has {plan.num_heads} heads per layer; this MODEL has {family.num_heads()}")
    recorded = plan.info.get("model_config")
    if isinstance(recorded, dict) and not problems:
        for key, value in family.checked_config().items():
            if key in recorded and recorded[key] != value:
                problems.append(f"plan's model has {key}={recorded[key]}; this MODEL has {value}")
    return problems


class LoadPAROPlan:
    DESCRIPTION = ("A PARO plan from models/paroattn: per-head token orders and block masks calibrated for one model "
                   "(a Wan 2.2 A14B file loads both experts' plans).")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"plan_name": (plan_files(), {"tooltip": "a plan file in models/paroattn"})}}

    RETURN_TYPES = ("PARO_PLAN",)
    RETURN_NAMES = ("plan",)
    FUNCTION = "load"
    CATEGORY = CATEGORY

    def load(self, plan_name):
        path = folder_paths.get_full_path_or_raise(PLAN_FOLDER, plan_name)
        plans = load_plans(path)
        return {"ui": {"text": [describe(p) for p in plans]}, "result": (PAROPlan(path, plans),)}


class ApplyPARO:
    DESCRIPTION = ("The MODEL with PARO attention: each self-attention call runs with the plan's token orders and "
                   "the block mask of its timestep bucket; cross-attention and other calls keep ComfyUI's attention. "
                   "Without a PARO_PLAN connected the plan is 'auto': the cached plan of this model at the density, "
                   "qk, pv and block size set here, or, without one, learnt by the next sampling run (which runs "
                   "dense) and cached for the runs after it.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "backend": (list(BACKENDS), {"default": "auto", "tooltip": "auto: the Triton kernels on a CUDA GPU, "
                                         "else the torch reference; torch runs anywhere"}),
            "on_mismatch": (["error", "dense"], {"default": "error", "tooltip": "a plan that does not fit the model "
                            "or a call: error stops with what does not match; dense runs the model's own attention"}),
            "expert": (list(EXPERT_CHOICES), {"default": "auto", "tooltip": "for a Wan 2.2 A14B plan pair: which "
                       "expert this MODEL is (transformer: high noise, transformer_2: low noise); with plan 'auto', "
                       "set it on both experts' nodes so that each learns a plan of its own"}),
        }, "optional": {
            "plan": ("PARO_PLAN", {"tooltip": "a plan from Load PARO plan or PARO calibrate; unconnected: plan 'auto'"}),
            "density": ("FLOAT", {"default": 0.3, "min": 0.01, "max": 1.0, "step": 0.01, "tooltip": "plan 'auto' "
                        "only: share of attention blocks kept, averaged over the steps"}),
            "qk": (list(QK_MODES), {"default": "bf16", "tooltip": "plan 'auto' only"}),
            "pv": (list(PV_MODES), {"default": "bf16", "tooltip": "plan 'auto' only"}),
            "block_size": ("INT", {"default": 64, "min": 16, "max": 128, "step": 16, "tooltip": "plan 'auto' only: "
                           "tokens per mask block (the Triton kernels run 64 and 128)"}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"
    CATEGORY = CATEGORY

    def apply(self, model, backend, on_mismatch, expert, plan=None, density=0.3, qk="bf16", pv="bf16", block_size=64):
        try:
            family = family_of(model)
            if plan is None:
                return self.apply_auto(model, family, backend, on_mismatch, expert, density, qk, pv, block_size)
            chosen = plan.for_expert(expert)
            problems = plan_problems(chosen, family)
            if problems:
                raise PlanError(f"{os.path.basename(plan.path)} does not fit this MODEL: {'; '.join(problems)}. "
                                "Load the plan calibrated for this model, or calibrate one with PARO calibrate")
        except (PlanError, UnsupportedModel) as exc:
            if on_mismatch == "error":
                raise PlanError(str(exc) + OR_DENSE) from None
            message = f"{exc}; running the model's own attention (on_mismatch='dense')"
            logging.warning("PARO: %s", message)
            return {"ui": {"text": [message]}, "result": (model,)}
        patched = model.clone()
        PARORunner(family, chosen, backend=backend, on_mismatch=on_mismatch).install(patched)
        return {"ui": {"text": [f"PARO on: {describe(chosen)}; backend {backend}"]}, "result": (patched,)}

    @staticmethod
    def apply_auto(model, family, backend, on_mismatch, expert, density, qk, pv, block_size):
        """Plan 'auto': the cached plan, or the hook that learns it during the next sampling run."""
        expert = "" if expert == "auto" else expert
        path = auto_entry(family, density=density, qk=qk, pv=pv, block_size=block_size, expert=expert)
        hook = AutoPlan(family, path, SelectionConfig(density=density, qk=qk, pv=pv),
                        cheap_capture(block_size, density=density),
                        expert=expert, backend=backend, on_mismatch=on_mismatch)
        if hook.load():
            message = f"PARO on: cached plan {path}: {describe(hook.plan)}; backend {backend}"
        else:
            message = (f"PARO learns: no cached plan at {path}; the next sampling run with this MODEL runs dense, "
                       "learns the plan and caches it there, and the runs after it are sparse")
        logging.info("%s", message)
        patched = model.clone()
        hook.install(patched)
        return {"ui": {"text": [message]}, "result": (patched,)}


class PAROCalibrate:
    DESCRIPTION = ("Samples like KSampler with the model's own attention, records the block statistics of every "
                   "self-attention call, and writes a plan to models/paroattn that Apply PARO and diffusers "
                   "(paroattn.Plan.load) read. Calibrate at the size you generate; one or two prompts suffice.")
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        import comfy.samplers

        return {"required": {
            "model": ("MODEL",),
            "positive": ("CONDITIONING",),
            "negative": ("CONDITIONING",),
            "latent_image": ("LATENT",),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xffffffffffffffff, "control_after_generate": True}),
            "steps": ("INT", {"default": 30, "min": 1, "max": 10000}),
            "cfg": ("FLOAT", {"default": 5.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01}),
            "sampler_name": (comfy.samplers.KSampler.SAMPLERS,),
            "scheduler": (comfy.samplers.KSampler.SCHEDULERS,),
            "density": ("FLOAT", {"default": 0.3, "min": 0.01, "max": 1.0, "step": 0.01,
                                  "tooltip": "share of attention blocks kept, averaged over the steps"}),
            "qk": (list(QK_MODES), {"default": "bf16"}),
            "pv": (list(PV_MODES), {"default": "bf16"}),
            "block_size": ("INT", {"default": 64, "min": 16, "max": 128, "step": 16,
                                   "tooltip": "tokens per mask block (the Triton kernels run 64 and 128)"}),
            "stat_every": ("INT", {"default": 2, "min": 1, "max": 100,
                                   "tooltip": "record statistics at every n-th step"}),
            "filename": ("STRING", {"default": "paro-plan", "tooltip": "written as models/paroattn/<filename>.safetensors"}),
            "expert": (["none", *EXPERTS], {"default": "none", "tooltip": "a Wan 2.2 A14B expert: its plan is "
                       "written beside the other expert's as one pair"}),
            "overwrite": ("BOOLEAN", {"default": False}),
        }}

    RETURN_TYPES = ("PARO_PLAN", "LATENT")
    RETURN_NAMES = ("plan", "latent")
    FUNCTION = "calibrate"
    CATEGORY = CATEGORY

    def calibrate(self, model, positive, negative, latent_image, seed, steps, cfg, sampler_name, scheduler, density,
                  qk, pv, block_size, stat_every, filename, expert, overwrite):
        family = family_of(model)
        expert = "" if expert == "none" else expert
        base = self._base_path(filename)
        path = expert_plan_path(base, expert)
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists: choose another filename, or set overwrite to true")
        selection = SelectionConfig(density=density, qk=qk, pv=pv)
        capture = CaptureConfig(block_size=block_size, steps=steps, stat_every=stat_every)
        recorder = StatsRecorder(family.num_layers(), capture,
                                 model_class=family.diffusers_class, model_config=family.diffusers_config(),
                                 expert=expert)
        capturing = model.clone()
        StatsCapture(family, recorder).install(capturing)
        latent = sample(capturing, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                        on_step=recorder.step_done)
        recorder.prompt_done()
        plan, result = plan_from_stats(recorder.stats([f"ComfyUI conditioning, seed {seed}"]), selection)
        save_calibration(plan, result, path)
        plans = link_experts(base, plan)
        message = f"wrote {path}: {describe(plan)}"
        logging.info("PARO calibrate: %s", message)
        return {"ui": {"text": [message]}, "result": (PAROPlan(str(path), plans), latent)}

    @staticmethod
    def _base_path(filename: str) -> Path:
        """models/paroattn/<filename>.safetensors: the plan's file, or the first expert's of a pair."""
        name = filename.strip()
        if name.endswith(".safetensors"):
            name = name[: -len(".safetensors")]
        if not name or os.sep in name or (os.altsep and os.altsep in name) or name.startswith("."):
            raise ValueError(f"filename {filename!r}: expected a plain file name (no folders), e.g. 'wan-d0.3'")
        return Path(folder_paths.get_folder_paths(PLAN_FOLDER)[0]) / (name + ".safetensors")


def link_experts(base: Path, plan: Plan) -> list[Plan]:
    """After writing one expert's plan of the pair named `base`: when the other expert's plan is beside it, record
    the pair in both files (`info["experts"]`), so that either loads both (`paroattn.load_plans`). Returns the plans
    read."""
    if not plan.expert:
        return [plan]
    files = {expert: expert_plan_path(base, expert) for expert in EXPERTS}
    if not all(p.exists() for p in files.values()):
        return [plan]
    plans = [Plan.load(p) for p in files.values()]
    if [p.expert for p in plans] != list(EXPERTS):
        return [plan]
    for expert_plan, target in zip(plans, files.values()):
        expert_plan.info["experts"] = {expert: p.name for expert, p in files.items()}
        expert_plan.save(target)
    return plans


def sample(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, on_step):
    """KSampler's sampling, calling `on_step()` after every step."""
    import comfy.sample
    import comfy.utils

    samples = comfy.sample.fix_empty_latent_channels(model, latent["samples"])
    noise = comfy.sample.prepare_noise(samples, seed, latent.get("batch_index"))
    bar = comfy.utils.ProgressBar(steps)

    def callback(step, x0, x, total_steps):
        on_step()
        bar.update_absolute(step + 1, total_steps)

    out = comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive, negative, samples,
                              noise_mask=latent.get("noise_mask"), callback=callback,
                              disable_pbar=not comfy.utils.PROGRESS_BAR_ENABLED, seed=seed)
    result = {k: v for k, v in latent.items() if k not in ("downscale_ratio_spacial", "downscale_ratio_temporal")}
    result["samples"] = out
    return result


NODE_CLASS_MAPPINGS = {
    "LoadPAROPlan": LoadPAROPlan,
    "ApplyPARO": ApplyPARO,
    "PAROCalibrate": PAROCalibrate,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "LoadPAROPlan": "Load PARO plan",
    "ApplyPARO": "Apply PARO",
    "PAROCalibrate": "PARO calibrate",
}
