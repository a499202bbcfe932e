"""Apply PARO without a plan: plan "auto", learnt during the first sampling run and cached.

The plan cache is paroattn's (`paroattn.runner.cache`: $PAROATTN_CACHE, else the platform's cache folder), with
the entry names `paroattn.apply(pipe, "auto")` uses: the diffusers counterpart's class and config fingerprint,
density, quantization modes and block sizes (and the expert set on Apply PARO). A plan learnt here serves
diffusers, and the other way round.

`AutoPlan` is the hook Apply PARO installs when no PARO_PLAN is connected. It wraps each sampling run of the
MODEL (ComfyUI's outer-sample wrapper: one KSampler, all its steps):
- a plan in the cache (found when the node runs, or written since): the run is sparse, as with Load PARO plan;
- none, and the entry's lock taken (`EntryLock`): the run is dense and records the statistics of every
  self-attention call with the cheap capture options of `paroattn.calibrate.auto`; when the run returns the
  plan is built, written into the cache (`write_entry`: a temporary file renamed) and used from the next run on.
  A run that raises (ComfyUI's interrupt included) writes nothing, and the next run learns again;
- none, and the lock held by another process learning the same entry: the run is dense, without capturing.

Steps are told apart by the timestep of the model calls (a new timestep: a new step), as `paroattn.apply(pipe,
"auto")` does, so no sampler callback is needed.
"""

from __future__ import annotations

import logging

from paroattn import Plan, PlanError
from paroattn.calibrate import CaptureConfig, SelectionConfig, StatsRecorder
from paroattn.calibrate.auto import buckets_without_steps
from paroattn.calibrate.driver import plan_from_stats
from paroattn.plan import model_fingerprint
from paroattn.runner.cache import EntryLock, entry_name, entry_path, load_entry, write_entry

from .families import Family
from .hook import OR_DENSE, WRAPPER_KEY, AttentionHook, PARORunner


def auto_entry(family: Family, *, density: float, qk: str, pv: str, block_size: int, expert: str = ""):
    """The cache entry's path of the plan "auto" of `family`'s model at these options."""
    return entry_path(entry_name(family.diffusers_class, family.diffusers_config(), density=density, qk=qk, pv=pv,
                                 block_size=block_size, expert=expert))


class AutoPlan(AttentionHook):
    """The plan of `path` (a cache entry) on the self-attention calls of one model: run when it exists, learnt
    by the first sampling run that can take the entry's lock otherwise. `plan`: the plan in use (None while
    there is none); `learnt`: whether this hook wrote it; `captured`: self-attention calls recorded."""

    def __init__(self, family: Family, path, selection: SelectionConfig, capture: CaptureConfig, *, expert: str = "",
                 backend: str = "auto", on_mismatch: str = "error", log=logging.info):
        super().__init__(family)
        self.path, self.selection, self.capture, self.expert = path, selection, capture, expert
        self.backend, self.on_mismatch, self.log = backend, on_mismatch, log
        self.config = family.diffusers_config()
        self.fingerprint = model_fingerprint(self.config)
        self.runner: PARORunner | None = None
        self.recorder: StatsRecorder | None = None  # while a sampling run learns
        self.timestep: float | None = None  # of the latest recorded call: a new one starts a new step
        self.learnt = False
        self.captured = 0
        self.warned: set[str] = set()

    @property
    def plan(self) -> Plan | None:
        return self.runner.plan if self.runner is not None else None

    def load(self) -> bool:
        """Use the cached entry if there is one (an unusable one is removed); whether a plan runs now."""
        if self.runner is None:
            plan = load_entry(self.path, self.fingerprint, lambda message: self.log("PARO: %s", message))
            if plan is not None:
                self.runner = PARORunner(self.family, plan, backend=self.backend, on_mismatch=self.on_mismatch)
        return self.runner is not None

    def install(self, model_patcher) -> None:
        import comfy.patcher_extension

        super().install(model_patcher)
        model_patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY,
                                           self.wrap_outer_sample)

    # -- a sampling run -------------------------------------------------------------------------------
    def wrap_outer_sample(self, executor, *args, **kwargs):
        if self.load():
            return executor(*args, **kwargs)
        lock = EntryLock(self.path)
        if not lock.acquire():
            self._warn_once(f"another process is learning the plan {self.path} (lock {lock.path}); this sampling "
                            "run is dense, and a later one uses the plan once it is written")
            return executor(*args, **kwargs)
        try:
            if self.load():  # written by another process between the check and the lock
                return executor(*args, **kwargs)
            output, plan = self._learn(executor, args, kwargs)
            if plan is not None:
                write_entry(plan, self.path)
        finally:
            lock.release()
        if plan is not None:
            self.learnt = True
            self.runner = PARORunner(self.family, plan, backend=self.backend, on_mismatch=self.on_mismatch)
            self.log("PARO: learnt a plan at density %g (achieved %.3f) from %d self-attention calls and cached it "
                     "at %s; the next sampling run is sparse.%s", self.selection.density, plan.achieved_density(),
                     self.captured, self.path, buckets_without_steps(plan, self.path, "sampling run"))
        return output

    def _learn(self, executor, args, kwargs) -> tuple[object, Plan | None]:
        """The sampling run, dense, recording; (its output, the plan built from the records, None without any)."""
        self.recorder = StatsRecorder(self.family.num_layers(), self.capture, model_class=self.family.diffusers_class,
                                      model_config=self.config, expert=self.expert)
        self.timestep, self.captured = None, 0
        try:
            output = executor(*args, **kwargs)
            recorder = self.recorder
        finally:
            self.recorder = None
        if self.timestep is not None:
            recorder.step_done()
        recorder.prompt_done()
        if not recorder.recorded:  # every call refused under on_mismatch="dense" (and said so)
            self.log("PARO: the sampling run recorded no self-attention call; no plan is learnt from it")
            return output, None
        plan, _ = plan_from_stats(recorder.stats(["ComfyUI conditioning"]), self.selection)
        plan.info["learnt_by"] = "plan='auto' (ComfyUI)"
        return output, plan

    # -- a self-attention call ------------------------------------------------------------------------
    def bucket_of(self, timestep: float) -> int | None:
        return self.runner.bucket_of(timestep) if self.runner is not None else None

    @property
    def state(self) -> str:
        return f"{self.token}-{'plan' if self.runner is not None else 'dense'}"

    def self_attention(self, attention, layout, problem, call, func, args, kwargs):
        if self.runner is not None:
            return self.runner.self_attention(attention, layout, problem, call, func, args, kwargs)
        return self.record(attention, layout, problem, call, func, args, kwargs)

    def recorded(self, attention, layout, problem, geometry):
        if self.recorder is None:  # dense: another process learns the plan
            return
        if problem is not None:
            message = f"plan 'auto' cannot learn from this model call: {problem}"
            if self.on_mismatch == "error":
                raise PlanError(message + OR_DENSE)
            self._warn_once(message + "; running the model's own attention there (on_mismatch='dense')")
            return
        if self.timestep is not None and geometry.timestep != self.timestep:
            self.recorder.step_done()
        self.timestep = geometry.timestep
        self.recorder.record(attention.layer, attention.q, attention.k, layout, geometry.timestep)
        self.captured += 1

    def _warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            logging.warning("PARO: %s", message)
