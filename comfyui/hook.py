"""The attention hook the PARO nodes install on a cloned MODEL.

Two pieces, both in the clone's `model_options["transformer_options"]`:
- an `apply_model` wrapper, which runs once per model call (one sampler evaluation): it reads the timestep from
  the sigma (through the model's own `model_sampling`) and the latent's size, and hands them to the attention
  calls of that forward in `transformer_options` (a per-call copy, so concurrent calls do not mix);
- `optimized_attention_override`, which ComfyUI calls instead of its attention function: self-attention calls
  run `paroattn.paro_attention` with the plan's orders and the mask of the call's timestep bucket and layer;
  every other call (cross-attention, other models' parts, calls PARO cannot take) goes to ComfyUI's own
  function, or to an override installed before this one.

`PARORunner` runs a plan through `paroattn.runner.PlanRunner` (the plan of each size, the masks, the op call);
`StatsCapture` records the dense calls' statistics for calibration; `auto.AutoPlan` (plan 'auto') does the one,
then the other. Inside a model compiled by ComfyUI's TorchCompileModel the override runs eagerly (see `__call__`).
"""

from __future__ import annotations

import logging

import torch

from paroattn import PlanError
from paroattn.runner import PlanRunner

from .families import CallGeometry, Family

GEOMETRY_KEY = "paroattn_geometry"
WRAPPER_KEY = "paroattn"
OR_DENSE = " (or set on_mismatch to 'dense' to run the model's own attention)"


class AttentionHook:
    """What both hooks share: the family, the apply-model wrapper and the split of calls."""

    def __init__(self, family: Family):
        self.family = family
        self.previous = None  # an override installed before this one, which the calls PARO leaves go to

    def install(self, model_patcher) -> None:
        """Install on `model_patcher` (a clone the caller owns)."""
        import comfy.patcher_extension

        self.family.patch(model_patcher)
        options = model_patcher.model_options.setdefault("transformer_options", {})
        self.previous = options.get("optimized_attention_override")
        options["optimized_attention_override"] = self
        model_patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY,
                                           self.wrap_apply_model)

    def wrap_apply_model(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                         **kwargs):
        timestep = executor.class_obj.model_sampling.timestep(t)
        geometry = self.family.geometry(x, float(timestep.detach().max()), c_crossattn, kwargs)
        transformer_options = dict(transformer_options or {})
        transformer_options[GEOMETRY_KEY] = geometry
        return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)

    def other(self, func, args, kwargs):
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)

    # ComfyUI's TorchCompileModel drops every guard on transformer_options: a graph traced through this hook would
    # keep the block index, timestep bucket and plan of the call it was traced at for every later call that reuses
    # it. The hook runs eagerly instead (a graph break at each attention call), reading the options of each call.
    @torch.compiler.disable(reason="PARO's attention hook reads each call's transformer_options, which ComfyUI's "
                            "TorchCompileModel does not guard on")
    def __call__(self, func, *args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        geometry: CallGeometry | None = options.get(GEOMETRY_KEY)
        # ComfyUI's attention functions take (q, k, v, heads, mask=None, ...); models pass heads by position or name
        heads = args[3] if len(args) > 3 else kwargs.get("heads")
        if geometry is None or len(args) < 3 or heads is None:
            return self.other(func, args, kwargs)
        q, k, v = args[:3]
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        call, layout, problem = self.family.self_attention(geometry, q, k, v, int(heads), mask, options, kwargs)
        if call is None:
            return self.other(func, args, kwargs)
        out = self.self_attention(call, layout, problem, geometry, kwargs)
        return self.other(func, args, kwargs) if out is None else out

    def self_attention(self, call, layout, problem, geometry, kwargs):
        """The output of a self-attention call, or None to run ComfyUI's own."""
        raise NotImplementedError


class PARORunner(AttentionHook):
    """Runs `plan` on the self-attention calls of one model. `on_mismatch`: "error" raises PlanError when a call
    does not fit the plan (its message is what ComfyUI shows); "dense" logs it once and runs the model's own
    attention for such calls."""

    def __init__(self, family: Family, plan, backend: str = "auto", on_mismatch: str = "error"):
        super().__init__(family)
        self.plan, self.backend, self.on_mismatch = plan, backend, on_mismatch
        # every size met keeps its masks (per device and form); ComfyUI may run model calls from several threads,
        # which the runner serves at once
        self.runner = PlanRunner(plan, backend=backend)
        self.warned: set[str] = set()

    def refuse(self, message: str) -> None:
        if self.on_mismatch == "error":
            raise PlanError(message + OR_DENSE)
        if message not in self.warned:
            self.warned.add(message)
            logging.warning("PARO: %s; running the model's own attention there (on_mismatch='dense')", message)

    def self_attention(self, call, layout, problem, geometry, kwargs):
        if problem is None and (problem := self.runner.size_problem(layout)) is not None:
            problem = (f"the plan was calibrated for {self.plan.layout} tokens and cannot serve this call's "
                       f"{layout}: {problem}")
        if problem is not None:
            self.refuse(problem)
            return None
        if layout not in self.runner.shapes.calibrated and str(layout) not in self.warned:
            self.warned.add(str(layout))
            logging.info("PARO: the plan was calibrated for %s tokens; masks for this call's %s are derived from it "
                         "once (a size used often is better calibrated into the plan)", self.plan.layout, layout)
        q = call.q
        store = self.runner.store(layout, q.device, q.dtype, q.shape[-1])  # calibrated, or derived once for the size
        bucket = self.runner.bucket_of(geometry.timestep)
        if store.dense_flag(bucket, call.layer):
            return None
        attention = self.runner.attention(store, bucket, call.layer, layout, sm_scale=kwargs.get("scale"))
        return call.output(attention(call.q, call.k, call.v))


class StatsCapture(AttentionHook):
    """Hands the q, k of every self-attention call of the dense model to a `paroattn.calibrate.StatsRecorder`
    and runs the model's own attention."""

    def __init__(self, family: Family, recorder):
        super().__init__(family)
        self.recorder = recorder

    def self_attention(self, call, layout, problem, geometry, kwargs):
        if problem is not None:
            raise PlanError(f"cannot calibrate this model call: {problem}")
        self.recorder.record(call.layer, call.q, call.k, layout, geometry.timestep)
        return None
