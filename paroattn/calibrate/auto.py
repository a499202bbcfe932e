"""`plan="auto"`: a plan without a calibration step, learnt during the first generation and cached.

    handle = paroattn.apply(pipe, "auto", density=0.3)
    pipe(prompt)      # no cached plan: runs dense while capturing statistics; the plan is cached when it ends
    pipe(prompt)      # sparse, as every later process's generations with the same model and options

The cache (`paroattn.runner.cache`) keys an entry by the model's config fingerprint, the density, the quantization
modes and the block sizes. At `apply` a cached entry is loaded and applied as `apply(pipe, plan)` does. Without
one, the pipeline's calls are wrapped: the first call that can take the entry's lock runs dense with the capture
processors (the model's own attention, statistics recorded as `paro calibrate` records them, with the cheap capture
options), and when it returns the plan is built (`plan_from_stats`), written into the cache under a temporary name
and renamed, and applied: the next call is sparse. A call that raises (KeyboardInterrupt included) writes nothing.
A call that finds the lock taken (another process learning the same entry) runs dense without capturing, and a
later call loads the entry once it exists.

Steps are told apart by the timestep of the transformer's calls (a new timestep: a new denoising step), so no
pipeline callback is needed; pipelines that call the transformer twice per step (cond, then uncond) record the
first call (`calls="first"`).

Under diffusers' Ulysses context parallelism (`enable_parallelism`, one process per GPU) the group's first process
decides each call (the cached plan; learning it, under the entry's lock; or dense while another process learns it)
and every process follows, until all of them run the plan. A learning call exchanges q, k and v as Ulysses does,
so each process records its own slice of the heads over the whole sequence, at its share of the capture's cost
(`capture_attention(..., context_parallel=True)`); when the call returns, the statistics are gathered along the
heads on the first process (`parallel.UlyssesGroup.gather_heads`), which builds the plan one process recording
every head would build and writes the entry; then every process loads that file. A call that raises on any
process raises on all of them and writes nothing; an interruption (KeyboardInterrupt) that leaves another process
inside the generation's collectives leaves it there (as any collective does), and writes nothing either.
`paro calibrate` and `paro generate --plan auto` run on one GPU.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref

from ..errors import PlanError
from ..plan import Plan, model_fingerprint
from ..runner.cache import EntryLock, entry_name, entry_path, load_entry, write_entry
from .config import CHEAP, CaptureConfig, SelectionConfig
from .parallel import UlyssesGroup

AUTO = "auto"
# what the first process of a Ulysses group decides for a generation, and every process does
LOAD, LEARN, DENSE = 0, 1, 2

# the cheap capture of a learning generation (`config.CHEAP`): one prompt's generation fills each timestep bucket by
# itself (every step eligible; `steps_per_bucket` bounds what is captured there)
CHEAP_CAPTURE = {**CHEAP, "stat_every": 1}

# the pipeline each learning handle serves (its class is swapped for one whose __call__ goes through the handle)
_HANDLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CLASSES: dict[type, type] = {}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def buckets_without_steps(plan: Plan, path, run: str = "generation") -> str:
    """What the learning message adds when timestep buckets saw no step of the learning `run` (a short one): their
    masks borrow the other buckets' statistics until the entry at `path` is learnt again. '' when none."""
    steps = list(plan.info.get("steps_per_bucket") or [])
    empty = sum(1 for count in steps if not count)
    if not empty:
        return ""
    return (f" {empty} of its {len(steps)} timestep buckets had no step in this {run} ({sum(steps)} steps) and "
            f"borrow the other buckets' statistics: remove {path} and learn it again from a {run} with more steps.")


def cheap_capture(block_size: int = 64, query_block: int | None = None, density: float | None = None) -> CaptureConfig:
    """The capture config of a learning generation at these block sizes, its orders narrowed at the plan's `density`
    (None: `CaptureConfig.order_density`'s default)."""
    options = {**CHEAP_CAPTURE, "query_stride": min(CHEAP_CAPTURE["query_stride"], block_size)}
    return CaptureConfig(block_size=block_size, query_block=query_block, order_density=density, **options)


class AutoHandle:
    """What `apply(pipe, "auto")` returns: `plan` (None until one is loaded or learnt), `path` (the cache entry),
    `learnt` (whether this handle wrote it), `captured` (self-attention calls recorded), `handle` (the
    `PAROHandle` running the plan). `remove()` (or leaving the `with` block) puts back the pipeline's class and
    the transformer's processors."""

    def __init__(self, pipe, transformer, expert: str, path, selection: SelectionConfig, capture: CaptureConfig,
                 apply_kwargs: dict, log):
        self.pipe, self.transformer, self.expert = pipe, transformer, expert
        self.path, self.selection, self.capture, self.apply_kwargs, self.log = path, selection, capture, apply_kwargs, log
        self.fingerprint = model_fingerprint(transformer.config)
        self.plan: Plan | None = None
        self.handle = None
        self.learnt = False
        self.captured = 0
        self.waited = False  # said once that another process holds the lock
        self.agreed = False  # under Ulysses: every process of the group runs the plan
        self._class = None  # the pipeline's own class while it is swapped
        # where a learning generation's time went, seconds: the pipeline call (the statistics' GPU time inside it),
        # building the plan, writing the entry, applying it
        self.timings: dict[str, float] = {}

    # -- the plan ---------------------------------------------------------------------------
    def load(self) -> bool:
        """Apply the cached entry if there is one (an unusable entry is removed); whether the plan runs now."""
        if self.handle is not None:
            return True
        plan = load_entry(self.path, self.fingerprint, self.log)
        if plan is None:
            return False
        self._use(plan)
        return True

    def _use(self, plan: Plan) -> None:
        from ..pipelines import apply

        self.handle = apply(self.pipe, plan, **self.apply_kwargs)
        self.plan = plan

    def _drop(self) -> None:
        """Stop running the plan (its entry is gone where the group's first process looked)."""
        if self.handle is not None:
            self.handle.remove()
        self.handle, self.plan = None, None

    # -- a pipeline call ------------------------------------------------------------------------
    def generation(self, call, args, kwargs):
        """One pipeline call: sparse with the plan, else learning it (the entry's lock taken), else dense."""
        if not self.agreed and (group := UlyssesGroup.of(self.transformer)) is not None:
            return self._parallel_generation(group, call, args, kwargs)
        if self.load():
            return call(*args, **kwargs)
        lock = EntryLock(self.path)
        if not lock.acquire():
            if not self.waited:
                self.log(f"paroattn: another process is learning the plan {self.path} (lock {lock.path}); this "
                         "generation runs dense, and a later one loads the plan once it is written")
                self.waited = True
            return call(*args, **kwargs)
        try:
            if self.load():  # written by another process between the check and the lock
                return call(*args, **kwargs)
            output, plan = self._learn(call, args, kwargs)
            start = time.perf_counter()
            write_entry(plan, self.path)
            self.timings["write_s"] = time.perf_counter() - start
        finally:
            lock.release()
        self.learnt = True
        start = time.perf_counter()
        self._use(plan)
        self.timings["apply_s"] = time.perf_counter() - start
        self.log(f"paroattn: learnt a plan at density {self.selection.density:g} and cached it at {self.path}; the "
                 "next generation runs sparse." + buckets_without_steps(plan, self.path))
        return output

    def _learn(self, call, args, kwargs):
        """Run the call dense with the capture processors; (its output, the plan built from what it recorded)."""
        start = time.perf_counter()
        output, stats = self._capture(call, args, kwargs)
        built = time.perf_counter()
        plan = self._plan(stats)
        self.timings = {"generation_s": built - start, "stats_s": stats.timings["stats_s"],
                        "plan_s": time.perf_counter() - built}
        return output, plan

    def _plan(self, stats):
        from .driver import plan_from_stats

        plan, _ = plan_from_stats(stats, self.selection)
        plan.info["learnt_by"] = "plan='auto'"
        return plan

    def _capture(self, call, args, kwargs, context_parallel: bool = False):
        """Run the call dense with the capture processors; (its output, the `CapturedStats` it recorded: of this
        process's heads under Ulysses with `context_parallel`)."""
        from ..pipelines import capture_attention, self_attention_layers
        from .recorder import StatsRecorder

        recorder = StatsRecorder(len(self_attention_layers(self.transformer)), self.capture,
                                 model_class=type(self.transformer).__name__, model_config=self.transformer.config,
                                 expert=self.expert)
        last = [None]  # the timestep of the latest call: a new one starts a new denoising step

        def on_call(layer, q, k, layout, timestep, suffix_mask):
            if last[0] is not None and timestep != last[0]:
                recorder.step_done()
            last[0] = timestep
            recorder.record(layer, q, k, layout, timestep, suffix_mask)
            self.captured = recorder.captures

        with capture_attention(self.transformer, on_call, context_parallel=context_parallel):
            output = call(*args, **kwargs)
        if last[0] is not None:
            recorder.step_done()
        recorder.prompt_done()
        if not recorder.recorded:
            raise RuntimeError("plan='auto': the pipeline ran but no self-attention call was captured; is this a "
                               "supported model?")
        prompt = kwargs.get("prompt", args[0] if args else None)
        prompts = [prompt] if isinstance(prompt, str) else [p for p in prompt or [] if isinstance(p, str)]
        return output, recorder.stats(prompts)

    # -- under Ulysses context parallelism ------------------------------------------------------
    def _parallel_generation(self, group: UlyssesGroup, call, args, kwargs):
        """One pipeline call under Ulysses: the group's first process decides (the cached plan; learning it; dense
        while another process learns it) and every process follows, so that every process runs the same plan."""
        lock = EntryLock(self.path) if group.first else None
        decision = DENSE
        try:
            if group.first:
                if self.load():
                    decision = LOAD
                elif lock.acquire():
                    decision = LEARN
                    if self.load():  # written by another process before the lock
                        decision = LOAD
                        lock.release()
            decision = group.broadcast(decision)
            if decision == LEARN:
                self._drop()  # a process that still ran a plan the first one no longer finds
                output = self._learn_parallel(group, call, args, kwargs)
        finally:
            if lock is not None:
                lock.release()
        if decision == LOAD:
            self._load_everywhere(group)
            return call(*args, **kwargs)
        if decision == DENSE:
            self._drop()
            if group.first and not self.waited:
                self.log(f"paroattn: another process is learning the plan {self.path} (lock {lock.path}); this "
                         "generation runs dense, and a later one loads the plan once it is written")
                self.waited = True
            return self._own_attention(call, args, kwargs)
        if group.first:
            self.log(f"paroattn: learnt a plan at density {self.selection.density:g} over {group.size} processes "
                     f"(each recorded its heads) and cached it at {self.path}; the next generation runs sparse."
                     + buckets_without_steps(self.plan, self.path))
        return output

    def _learn_parallel(self, group: UlyssesGroup, call, args, kwargs):
        """The call with every process capturing its heads; the first process builds the plan from every head's
        statistics and writes the entry, then every process loads it. Nothing is written unless every process
        captured, and a failure on one process raises on all of them."""
        failure = None
        try:
            output, stats = self._capture(call, args, kwargs, context_parallel=True)
        except Exception as exc:  # told to every process before any of them moves on
            failure = exc
        if (failed := group.first_failed(failure is None)) is not None:
            if failure is not None:
                raise failure
            raise RuntimeError(f"plan='auto': process {failed} of the Ulysses group failed while learning the plan "
                               f"{self.path}; nothing was written")
        try:
            stats = group.gather_heads(stats)
            if group.first:
                write_entry(self._plan(stats), self.path)
        except Exception as exc:
            failure = exc
        if group.first_failed(failure is None) is not None:
            if failure is not None:
                raise failure
            raise RuntimeError(f"plan='auto': the first process of the Ulysses group failed to build or write the "
                               f"plan {self.path}; nothing was written")
        self._load_everywhere(group)
        self.learnt = group.first
        return output

    def _own_attention(self, call, args, kwargs):
        """The call with the model's own attention under Ulysses: through the capture's exchange, recording nothing,
        for the families whose own processors cannot run under it (CogVideoX, HunyuanVideo: the text whole on
        every GPU)."""
        from ..pipelines import capture_attention
        from ..pipelines.base import TEXT_WHOLE
        from ..pipelines.registry import require_family

        if require_family(self.transformer).ulysses_text != TEXT_WHOLE:
            return call(*args, **kwargs)
        with capture_attention(self.transformer, lambda *recorded: None, context_parallel=True):
            return call(*args, **kwargs)

    def _load_everywhere(self, group: UlyssesGroup) -> None:
        """Every process loads the entry the first process found or wrote."""
        if (failed := group.first_failed(self.load())) is not None:
            raise PlanError(f"plan='auto': process {failed} of the Ulysses group found no usable plan at {self.path}, "
                            "which its first process loaded: every process must read the same cache folder (set "
                            "PAROATTN_CACHE to a folder they share)")
        self.agreed = True

    # -- the pipeline's class -----------------------------------------------------------------------
    def _wrap(self) -> None:
        own = type(self.pipe)
        if own in _CLASSES.values():  # already wrapped by an earlier auto apply: this handle replaces it
            earlier = _HANDLES.get(self.pipe)
            self._class = earlier._class if earlier is not None else own.__mro__[1]
            if earlier is not None:
                earlier._class = None
        else:
            self._class = own
            self.pipe.__class__ = _learning_class(own)
        _HANDLES[self.pipe] = self

    def stats(self) -> dict:
        """The masks of the plan's latest call (`PAROHandle.stats`); empty while no plan runs."""
        from ..runner import MaskStore

        return self.handle.stats() if self.handle is not None else MaskStore.empty_stats()

    def remove(self) -> None:
        """Put back the pipeline's class and the transformer's processors (no-op when done already)."""
        if self._class is not None and _HANDLES.get(self.pipe) is self:
            self.pipe.__class__ = self._class
            del _HANDLES[self.pipe]
        self._class = None
        if self.handle is not None:
            self.handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def _learning_class(cls: type) -> type:
    """A subclass of the pipeline class `cls`, with its name and signature, whose calls go through the pipeline's
    learning handle (a class, since Python looks `__call__` up on the type)."""
    if cls not in _CLASSES:
        @functools.wraps(cls.__call__)
        def __call__(self, *args, **kwargs):
            handle = _HANDLES.get(self)
            if handle is None:
                return cls.__call__(self, *args, **kwargs)
            return handle.generation(functools.partial(cls.__call__, self), args, kwargs)

        _CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                     "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def apply_auto(pipe, *, density: float = 0.3, qk: str = "bf16", pv: str = "bf16", block_size: int = 64,
               query_block: int | None = None, capture: CaptureConfig | None = None, cache=None, log=None,
               **apply_kwargs) -> AutoHandle:
    """`apply(pipe, "auto", ...)`: the cached plan of the pipeline's transformer at `density`, `qk`, `pv` and
    `block_size` x `query_block` (query blocks: `block_size` when None), or, without one, learnt during the next
    generation (`capture`: its CaptureConfig; default `cheap_capture`). `cache`: the cache folder (default
    `paroattn.runner.cache.cache_folder()`). `log`: where the one line saying which happened goes (default
    stderr). `apply_kwargs`: what `paroattn.pipelines.apply` takes besides the plan."""
    from ..pipelines import check_apply_options, pipeline_experts
    from .driver import capture_for

    log = log if log is not None else _stderr
    selection = SelectionConfig(density=density, qk=qk, pv=pv)
    capture = capture if capture is not None else cheap_capture(block_size, query_block)
    if not isinstance(capture, CaptureConfig):
        raise TypeError(f"capture takes a CaptureConfig, got {type(capture).__name__}")
    if (capture.block_size, capture.query_block) != (block_size, query_block):
        raise ValueError(f"capture has blocks {capture.block_size} x {capture.query_block} and apply asks for "
                         f"{block_size} x {query_block}: pass the same block_size and query_block to both")
    capture = capture_for(capture, selection)  # orders narrowed at the plan's density
    check_apply_options(apply_kwargs.get("backend", "auto"), apply_kwargs.get("on_mismatch", "error"))
    experts = pipeline_experts(pipe)
    if experts[0][0] == "":
        raise TypeError(f"plan='auto' needs the pipeline, got the bare {type(pipe).__name__}: it learns the plan "
                        "during a pipeline call and runs it from the next one; pass the pipeline, or apply a plan "
                        "file made by `paro calibrate`")
    if len(experts) > 1:
        names = " and ".join(name for name, _ in experts)
        raise ValueError(f"plan='auto' learns the plan of one transformer, and {type(pipe).__name__} runs an expert "
                         f"pair ({names}): calibrate both with `paro calibrate` and apply "
                         "paroattn.load_plans(path)")
    expert, transformer = experts[0]
    name = entry_name(type(transformer).__name__, transformer.config, density=density, qk=qk, pv=pv,
                      block_size=block_size, query_block=query_block)
    handle = AutoHandle(pipe, transformer, expert, entry_path(name, cache), selection, capture, apply_kwargs, log)
    if handle.load():
        log(f"paroattn: cached plan {handle.path}")
        if UlyssesGroup.of(transformer) is not None:
            handle._wrap()  # the first call checks that every process of the group loaded it too
        return handle
    log(f"paroattn: no cached plan for {type(transformer).__name__} at density {density:g}, qk={qk}, pv={pv}; this "
        f"generation runs dense and learns one (cached at {handle.path})")
    handle._wrap()
    return handle


def apply(pipe_or_transformer, plan, backend: str = "auto", on_mismatch: str = "error", *,
          density: float | None = None, qk: str = "bf16", pv: str = "bf16", block_size: int = 64,
          query_block: int | None = None, capture: CaptureConfig | None = None, cache=None, log=None, **kwargs):
    from ..pipelines import apply as apply_plan

    if isinstance(plan, str) and plan == AUTO:
        return apply_auto(pipe_or_transformer, density=0.3 if density is None else density, qk=qk, pv=pv,
                          block_size=block_size, query_block=query_block, capture=capture, cache=cache, log=log,
                          backend=backend, on_mismatch=on_mismatch, **kwargs)
    learning = {"density": density, "capture": capture, "cache": cache}
    given = [k for k, v in learning.items() if v is not None]
    given += [k for k, v, default in (("qk", qk, "bf16"), ("pv", pv, "bf16"), ("block_size", block_size, 64),
                                      ("query_block", query_block, None)) if v != default]
    if given:
        raise TypeError(f"{', '.join(given)} choose the plan plan='auto' learns; a Plan has its own: leave "
                        f"{'it' if len(given) == 1 else 'them'} out, or pass plan='auto'")
    return apply_plan(pipe_or_transformer, plan, backend, on_mismatch, **kwargs)


def _apply_doc() -> str:
    from ..pipelines import apply as apply_plan

    return (
        "`apply(pipe, \"auto\", density=0.3, qk=\"bf16\", pv=\"bf16\", block_size=64)`: a plan without a calibration "
        "step. The cached plan of this model at these options (`paroattn.runner.cache`: $PAROATTN_CACHE, else "
        "~/.cache/paroattn; `paroattn.clear_cache()` empties it) runs at once; without one, the next generation "
        "runs dense while it learns the plan, which is cached when it ends, and the generations after it run "
        "sparse. Returns an `AutoHandle` (see `paroattn.calibrate.auto`).\n\n" + (apply_plan.__doc__ or "")
    )


apply.__doc__ = _apply_doc()
