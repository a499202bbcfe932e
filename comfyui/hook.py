"""The attention hook the PARO nodes install on a cloned MODEL.

Three pieces, in the clone's `model_options["transformer_options"]`:
- an `apply_model` wrapper, which runs once per model call (one sampler evaluation), eagerly: it reads the
  timestep from the sigma (through the model's own `model_sampling`) and the latent's size, and hands them, with
  the plan's timestep bucket, to the diffusion model as a keyword argument (a `ModelCall`);
- a `diffusion_model` wrapper, which moves that `ModelCall` into the model's `transformer_options` (a per-call
  copy, so concurrent calls do not mix), where its attention calls find it;
- `optimized_attention_override` (an `AttentionOverride`), which ComfyUI calls instead of its attention function:
  self-attention calls run `paroattn.paro_attention` with the plan's orders and the mask of the call's timestep
  bucket and layer; every other call (cross-attention, other models' parts, calls PARO cannot take) goes to
  ComfyUI's own function, or to an override installed before this one.

`PARORunner` runs a plan through `paroattn.runner.PlanRunner` (the plan of each size, the masks, the op call);
`StatsCapture` records the dense calls' statistics for calibration; `auto.AutoPlan` (plan 'auto') does the one,
then the other.

Under ComfyUI's TorchCompileModel (the diffusion model compiled whole) the hook is traced into the model's graph:
- the compile node drops every guard on `transformer_options`, so a graph would keep whatever it read there at
  trace time. The hook reads nothing there but the `ModelCall`, which entered the model as a keyword argument
  first: dynamo guards what the graph reads of it (the hook's token, the plan's modes and dense flags, the masks'
  shapes) and fetches its tensors at every call. A new hook (Apply PARO run again) recompiles the forward once;
- the bucket enters the graph as a 0-dim device tensor (`ModelCall.bucket_index`), which indexes the stacked
  masks in the graph: one graph serves every step and bucket. A layer whose dense flag differs between buckets
  computes both the model's attention and PARO and keeps one (`torch.where`);
- the masks of a call's size are built eagerly while the graph is traced (`_prepare`, which dynamo calls as a
  constant function), and kept: the graph reads them as inputs;
- masks the runner streams per layer on a side CUDA stream (a plan's active-block lists over the resident
  limit) cannot be traced: such calls run eagerly (`_streamed_attention`, a graph break each);
- plan 'auto' learning and calibration run eagerly (`AttentionHook.record`), once.
- frames dynamo starts inside the model after a graph break elsewhere (an attention function of ComfyUI's that
  it cannot trace) read the `ModelCall` from `transformer_options`, unguarded. What pins the hook there is a
  module global, `_ACTIVE`, the state of the one hook whose model calls are in flight, which every traced call
  reads (a guard); while model calls of several hooks overlap (threads) it is None, and the calls run eagerly.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import Counter
from dataclasses import dataclass

import torch

from paroattn import PlanError, TokenLayout
from paroattn.runner import PlanRunner

from .families import CallGeometry, Family, SelfAttention

CALL_KEY = "paroattn_call"
WRAPPER_KEY = "paroattn"
OR_DENSE = " (or set on_mismatch to 'dense' to run the model's own attention)"

# the hooks by token, for the functions a traced call runs as constants (`_prepare`); tokens are strings, which
# dynamo never turns into symbolic values
_HOOKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TOKENS = itertools.count()

# the `AttentionHook.state` of the one hook whose model calls are in flight (None while none or several hooks' are):
# traced calls read it, so that every graph holding the hook is guarded on it, also in frames that read the hook
# from transformer_options
_ACTIVE: str | None = None
_IN_FLIGHT: Counter = Counter()
_IN_FLIGHT_LOCK = threading.Lock()


def _set_in_flight(state: str, change: int) -> None:
    global _ACTIVE
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[state] += change
        if _IN_FLIGHT[state] <= 0:
            del _IN_FLIGHT[state]
        _ACTIVE = next(iter(_IN_FLIGHT)) if len(_IN_FLIGHT) == 1 else None


@dataclass
class ModelCall:
    """One model call as PARO's attention calls read it: the hook that made it and the override it installed,
    the call's geometry, and the plan's timestep bucket (None without a plan: learning), as a Python int for eager
    calls and as a 0-dim int64 tensor on the latent's device for traced ones."""

    hook: AttentionHook
    override: AttentionOverride
    geometry: CallGeometry
    bucket: int | None = None
    bucket_index: torch.Tensor | None = None


def hand_call_to_attention(executor, *args, **kwargs):
    """The `diffusion_model` wrapper: moves the `ModelCall` from the model's keyword arguments into the
    `transformer_options` its attention calls get. It holds nothing, so a traced graph keeps nothing of it."""
    call = kwargs.pop(CALL_KEY, None)
    if call is not None:
        options = kwargs.get("transformer_options")
        if options is None:  # passed by position: the dict that holds the attention override
            options = next((a for a in args if isinstance(a, dict) and "optimized_attention_override" in a), None)
        if options is None:
            raise PlanError(f"{type(executor.class_obj).__name__} passes no transformer_options to its blocks, "
                            "so PARO cannot reach its attention calls")
        options[CALL_KEY] = call  # the model's own per-call copy (BaseModel._apply_model makes it)
    return executor(*args, **kwargs)


class AttentionOverride:
    """ComfyUI's `optimized_attention_override` of one hook: hands the calls of the hook's model calls to the
    hook, through their `ModelCall`, and the others to the override installed before it (`previous`), or to
    ComfyUI's function. It holds no reference to the hook: dynamo tracks an object under the first path a graph
    reaches it by, and the hook must be reached through the guarded `ModelCall`, not through this object, which
    lives in `transformer_options`."""

    def __init__(self, previous=None):
        self.previous = previous

    def __call__(self, func, *args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        call: ModelCall | None = options.get(CALL_KEY)
        if call is None or call.override is not self:  # outside a model call, or another PARO hook's
            return self.other(func, args, kwargs)
        return call.hook.attend(call, func, args, kwargs)

    def other(self, func, args, kwargs):
        if self.previous is not None:
            return self.previous(func, *args, **kwargs)
        return func(*args, **kwargs)


class AttentionHook:
    """What every hook shares: the family, the wrappers and the split of calls."""

    def __init__(self, family: Family):
        self.family = family
        self.override: AttentionOverride | None = None  # set by `install`
        self.token = f"paroattn-hook-{next(_TOKENS)}"
        _HOOKS[self.token] = self
        self.bucket_tensors: dict[tuple[str, int], torch.Tensor] = {}

    def install(self, model_patcher) -> None:
        """Install on `model_patcher` (a clone the caller owns)."""
        import comfy.patcher_extension

        self.family.patch(model_patcher)
        options = model_patcher.model_options.setdefault("transformer_options", {})
        self.override = AttentionOverride(options.get("optimized_attention_override"))
        options["optimized_attention_override"] = self.override
        model_patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY,
                                           self.wrap_apply_model)
        model_patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY,
                                           hand_call_to_attention)

    def wrap_apply_model(self, executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None,
                         **kwargs):
        timestep = executor.class_obj.model_sampling.timestep(t)
        geometry = self.family.geometry(x, float(timestep.detach().max()), c_crossattn, kwargs)
        bucket = self.bucket_of(geometry.timestep)
        call = ModelCall(self, self.override, geometry, bucket,
                         None if bucket is None else self.bucket_tensor(bucket, x.device))
        state = self.state
        _set_in_flight(state, 1)
        try:  # a keyword argument of the compiled diffusion model, unlike transformer_options, is guarded
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **{**kwargs, CALL_KEY: call})
        finally:
            _set_in_flight(state, -1)

    @property
    def state(self) -> str:
        """What a traced graph of this hook's calls depends on beyond the `ModelCall`: the hook."""
        return self.token

    def bucket_of(self, timestep: float) -> int | None:
        """The plan's bucket of a timestep on the 0..1000 scale (None: no plan runs)."""
        return None

    def bucket_tensor(self, bucket: int, device: torch.device) -> torch.Tensor:
        """`bucket` as a 0-dim int64 tensor on `device`, made once."""
        key = (str(device), bucket)
        if key not in self.bucket_tensors:
            self.bucket_tensors[key] = torch.tensor(bucket, dtype=torch.int64, device=device)
        return self.bucket_tensors[key]

    def other(self, func, args, kwargs):
        """ComfyUI's own attention for a call PARO leaves (through the override installed before this hook's)."""
        return self.override.other(func, args, kwargs)

    def attend(self, call: ModelCall, func, args, kwargs):
        """An attention call of one of this hook's model calls."""
        if _ACTIVE != self.state:  # model calls of several hooks in flight (threads): each call eagerly
            return _attend_eagerly(self, call, func, args, kwargs)
        return self.attend_call(call, func, args, kwargs)

    def attend_call(self, call: ModelCall, func, args, kwargs):
        options = kwargs["transformer_options"]
        # ComfyUI's attention functions take (q, k, v, heads, mask=None, ...); models pass heads by position or name
        heads = args[3] if len(args) > 3 else kwargs.get("heads")
        if len(args) < 3 or heads is None:
            return self.other(func, args, kwargs)
        q, k, v = args[:3]
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        attention, layout, problem = self.family.self_attention(call.geometry, q, k, v, int(heads), mask, options,
                                                                kwargs)
        if attention is None:
            return self.other(func, args, kwargs)
        return self.self_attention(attention, layout, problem, call, func, args, kwargs)

    def self_attention(self, attention: SelfAttention, layout: TokenLayout | None, problem: str | None,
                       call: ModelCall, func, args, kwargs) -> torch.Tensor:
        """The output of a self-attention call (`other(func, args, kwargs)` for ComfyUI's own)."""
        raise NotImplementedError

    @torch.compiler.disable(reason="PARO records the statistics of a dense run eagerly (calibration, plan 'auto' "
                            "learning: one sampling run)")
    def record(self, attention: SelfAttention, layout: TokenLayout | None, problem: str | None, call: ModelCall,
               func, args, kwargs) -> torch.Tensor:
        """Record the statistics of a self-attention call (`recorded`), then run ComfyUI's own attention."""
        self.recorded(attention, layout, problem, call.geometry)
        return self.other(func, args, kwargs)

    def recorded(self, attention: SelfAttention, layout: TokenLayout | None, problem: str | None,
                 geometry: CallGeometry) -> None:
        raise NotImplementedError


@torch.compiler.disable(reason="PARO's attention hook runs eagerly while model calls of several hooks are in flight")
def _attend_eagerly(hook: AttentionHook, call: ModelCall, func, args, kwargs):
    return hook.attend_call(call, func, args, kwargs)


@torch._dynamo.assume_constant_result
def _prepare(token: str, fields: tuple[int, ...] | None, problem: str | None, device: str, dtype: str, head_dim: int,
             traced: bool) -> tuple[str | None, str | None, bool]:
    """`PARORunner.prepare` of hook `token`, for a call of `TokenLayout(*fields)` (None: `problem` says why the call
    has no PARO layout). A traced call runs it as a constant function: dynamo runs it eagerly while it traces
    (building the masks then, once per size), and the graph keeps its result."""
    layout = None if fields is None else TokenLayout(*fields)
    return _HOOKS[token].prepare(layout, problem, torch.device(device), getattr(torch, dtype.split(".")[-1]),
                                 head_dim, traced)


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

    def bucket_of(self, timestep: float) -> int:
        return self.runner.bucket_of(timestep)

    def prepare(self, layout: TokenLayout | None, problem: str | None, device: torch.device, dtype: torch.dtype,
                head_dim: int, traced: bool) -> tuple[str | None, str | None, bool]:
        """(the key of the masks of `layout` in the runner's `stores`, built unless they exist; why the plan cannot
        serve the call instead (logged once under on_mismatch 'dense'); whether a graph can read those masks
        (`traced`: for a graph torch.compile traces; False where the runner streams them))."""
        if problem is None and (problem := self.runner.size_problem(layout)) is not None:
            problem = (f"the plan was calibrated for {self.plan.layout} tokens and cannot serve this call's "
                       f"{layout}: {problem}")
        if problem is not None:
            if self.on_mismatch == "dense" and problem not in self.warned:
                self.warned.add(problem)
                logging.warning("PARO: %s; running the model's own attention there (on_mismatch='dense')", problem)
            return None, problem, True
        if layout not in self.runner.shapes.calibrated and str(layout) not in self.warned:
            self.warned.add(str(layout))
            logging.info("PARO: the plan was calibrated for %s tokens; masks for this call's %s are derived from it "
                         "once (a size used often is better calibrated into the plan)", self.plan.layout, layout)
        if traced and not self.runner.traceable(layout, device, dtype, head_dim):
            return None, None, False
        return self.runner.store_key(layout, device, dtype, head_dim, traced=traced), None, True

    def self_attention(self, attention, layout, problem, call, func, args, kwargs):
        q = attention.q
        traced = torch.compiler.is_compiling()
        key, problem, traceable = _prepare(self.token, None if layout is None else layout.fields, problem,
                                           str(q.device), str(q.dtype), q.shape[-1], traced)
        # the calls PARO leaves go where the installed hook sends them (plan 'auto' runs its plan through a runner
        # of its own, never installed)
        other = call.override.other
        if problem is not None:
            if self.on_mismatch == "error":
                raise PlanError(problem + OR_DENSE)
            return other(func, args, kwargs)
        if not traceable:
            return _streamed_attention(self, attention.q, attention.k, attention.v, attention.layer,
                                       attention.heads_last, attention.moved, layout.fields, call, func, args, kwargs)
        store = self.runner.stores[key]
        bucket = call.bucket_index if traced else call.bucket
        dense = store.dense_flag(bucket, attention.layer)  # None: traced, and it depends on the bucket
        if dense is True:
            return other(func, args, kwargs)
        run = self.runner.attention(store, bucket, attention.layer, layout, sm_scale=kwargs.get("scale"))
        out = attention.output(run(attention.q, attention.k, attention.v))
        if dense is None:
            out = torch.where(store.is_dense(bucket, attention.layer), other(func, args, kwargs), out)
        return out


@torch.compiler.disable(reason="PARO streams this plan's masks per layer on a side CUDA stream, which torch.compile "
                        "cannot trace")
def _streamed_attention(hook: PARORunner, q, k, v, layer, heads_last, moved, fields, call, func, args, kwargs):
    """A self-attention call whose masks the runner streams, run eagerly inside a traced model."""
    attention = SelfAttention(q, k, v, layer=layer, heads_last=heads_last, moved=moved)
    return hook.self_attention(attention, TokenLayout(*fields), None, call, func, args, kwargs)


class StatsCapture(AttentionHook):
    """Hands the q, k of every self-attention call of the dense model to a `paroattn.calibrate.StatsRecorder`
    and runs the model's own attention."""

    def __init__(self, family: Family, recorder):
        super().__init__(family)
        self.recorder = recorder

    def self_attention(self, attention, layout, problem, call, func, args, kwargs):
        return self.record(attention, layout, problem, call, func, args, kwargs)

    def recorded(self, attention, layout, problem, geometry):
        if problem is not None:
            raise PlanError(f"cannot calibrate this model call: {problem}")
        self.recorder.record(attention.layer, attention.q, attention.k, layout, geometry.timestep)
