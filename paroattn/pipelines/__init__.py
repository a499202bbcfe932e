"""diffusers integration: one adapter per model family, the PARO processor, and the calls around it.

    handle = paroattn.apply(pipe, plan)          # every self-attention layer runs PARO
    ...
    handle.remove()                              # the original processors, bit-exact

    handle = paroattn.apply(pipe, load_plans(path))   # an expert pair (Wan 2.2 A14B): each expert its own plan

    pipe.transformer.set_attn_processor(PAROProcessor(plan))   # also works: the instance finds its layers

For calibration:
    self_attention_layers(transformer) -> processor keys in plan layer order
    capture_attention(pipe, callback)  -> context manager; callback(layer, q, k, layout, timestep, suffix_mask)
    layout_for(transformer, height=, width=, frames=) -> the TokenLayout of a generation size
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Sequence
from contextlib import contextmanager

from ..errors import PlanError
from ..layout import TokenLayout
from ..plan import Plan
from ..runner import MaskStore
from .base import CallInputs, FamilyAdapter, pixel_scale_of
from .binding import Binding
from .capture import CaptureProcessor
from .processor import PAROProcessor
from .registry import expert_role, family_of, pipeline_experts, require_family, resolve_transformer

__all__ = [
    "CallInputs",
    "CaptureProcessor",
    "FamilyAdapter",
    "PAROHandle",
    "PAROProcessor",
    "apply",
    "capture_attention",
    "check_apply_options",
    "expert_plans",
    "family_of",
    "layout_for",
    "pipeline_experts",
    "resolve_transformer",
    "self_attention_layers",
]


def self_attention_layers(pipe_or_transformer) -> list[str]:
    """Processor keys of the self-attention layers, in plan layer order (layer l = position l).
    CogVideoX: `transformer_blocks.{i}.attn1`; Wan: `blocks.{i}.attn1` (attn2 is cross-attention);
    Flux: the dual-stream `transformer_blocks.{i}.attn`, then the single-stream ones."""
    transformer = resolve_transformer(pipe_or_transformer)
    return require_family(transformer).self_attention_layers(transformer)


def layout_for(pipe_or_transformer, *, height: int, width: int, frames: int | None = None,
               text_tokens: int | None = None) -> TokenLayout:
    """TokenLayout of a generation of `height` x `width` pixels (and `frames` frames for video).
    `text_tokens` defaults to the model's text length (CogVideoX config, 512 for Flux, none for Wan).
    A pipeline's own VAE factors are used; a bare transformer gets the released VAEs' (8, and 4 in time)."""
    transformer = resolve_transformer(pipe_or_transformer)
    family = require_family(transformer)
    return family.layout_for(
        transformer, height=height, width=width, frames=frames, text_tokens=text_tokens,
        scale=pixel_scale_of(pipe_or_transformer, family),
    )


def _install(transformer, processor, keys: list[str], binding: Binding) -> dict:
    """Put `processor` on `keys`, keep every other processor; return the processors it replaced. The attention
    backend and parallel config come from the processor serving the first key now."""
    current = dict(transformer.attn_processors)
    missing = [key for key in keys if key not in current]
    if missing:
        raise RuntimeError(f"the transformer has no attention processors named {missing[:3]}; diffusers changed its layout")
    first = current[keys[0]]
    for name in ("_attention_backend", "_parallel_config"):  # (CogVideoX's processor has neither: keep the processor's)
        setattr(processor, name, getattr(first, name, getattr(processor, name, None)))
    for delegate in binding.delegates.values():
        binding.sync_delegate(delegate)
    replacement = dict(current)
    for key in keys:
        replacement[key] = processor
    transformer.set_attn_processor(replacement)  # diffusers empties the dict it is given
    return current


# what `apply` changed on each transformer it patched (`_Patch`): the processors to restore, whichever of its
# handles is removed
_PATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Patch:
    """What `apply` changed on one transformer: the processors it had before the first apply, and the PARO
    processor serving it now. A later apply on the same transformer replaces the processor and keeps the
    originals; every handle of those applies shares this record, so any of them restores the originals."""

    def __init__(self, transformer, originals: dict):
        self.transformer_ref = weakref.ref(transformer)
        self.originals = originals
        self.processor: PAROProcessor | None = None
        self.binding: Binding | None = None

    @property
    def live(self) -> bool:
        """Whether this record's processor still serves its transformer (not restored, not replaced by hand)."""
        return (self.binding is not None and self.binding.installed()
                and _PATCHES.get(self.transformer_ref()) is self)

    def serve(self, processor: PAROProcessor, binding: Binding) -> None:
        """Make `processor` (installed by the caller) the one this record restores from; unbind the one before."""
        old = (self.processor, self.binding)
        self.processor, self.binding = processor, binding
        if old[0] is not None:
            old[0].unbind(old[1])

    def restore(self) -> None:
        """Put the original processors back and unbind PARO's; nothing when already done."""
        transformer = self.transformer_ref()
        if self.processor is None:
            return
        if transformer is not None and self.live:
            transformer.set_attn_processor(dict(self.originals))
        self.processor.unbind(self.binding)
        self.processor, self.binding = None, None
        if transformer is not None and _PATCHES.get(transformer) is self:
            del _PATCHES[transformer]


def _patch_of(transformer) -> _Patch | None:
    """The record of an `apply` whose processor still serves `transformer`, or None. A record whose processors
    were replaced by hand since (set_attn_processor) is dropped: the transformer counts as unpatched."""
    patch = _PATCHES.get(transformer)
    if patch is not None and not patch.live:
        patch.restore()  # unbinds only: its processors no longer serve the transformer
        patch = None
    return patch


class PAROHandle:
    """What `apply` returns: `remove()` puts back the processors the transformer had before PARO was first
    applied to it (and, after linear="fp8", the original linear weights); `stats()` reports masks; `linears` the
    fp8 linear layers (`paroattn.linear.FP8Linears`) or None. For an expert pair, `experts` holds each expert's
    own handle (this one is the first expert's).

    Applying again to a transformer PARO already runs replaces the plan: the new handle's plan runs, and the
    `remove()` of either handle restores the original processors (the other's `remove()` then does nothing).
    `active` is True while this handle's plan is the one that runs."""

    def __init__(self, transformer, processor: PAROProcessor | None, binding: Binding | None,
                 patch: _Patch | None, expert: str = ""):
        self.transformer = transformer
        self.processor = processor
        self.binding = binding
        self.expert = expert
        self._patch = patch
        self.experts: dict[str, PAROHandle] = {}
        self.linears = None

    @property
    def active(self) -> bool:
        own = self._patch is not None and self._patch.live and self._patch.processor is self.processor
        return own or self.linears is not None or any(h.active for h in self.experts.values() if h is not self)

    def stats(self) -> dict:
        """Mask memory and prefetch counters of the masks the latest eager forward read, on any device (before a
        forward, or where the model's own attention runs: mode None and zeros): mode ("lists" for the kernels,
        "bool masks" for the reference), resident, host_bytes, gpu_bytes, prefetch_hits, prefetch_misses, copies;
        `traced_bytes`: per device, the masks that forwards traced by torch.compile read (summed over the sizes
        met). An expert pair reports each expert's under its name."""
        if len(self.experts) > 1:
            return {name: handle._own_stats() for name, handle in self.experts.items()}
        return self._own_stats()

    def _own_stats(self) -> dict:
        return self.processor.runner.stats() if self.processor is not None else MaskStore.empty_stats()

    def remove(self) -> None:
        """Restore the processors the transformer (each expert) had before PARO was first applied to it; a
        second call, or one after another handle of the same transformer restored them, does nothing."""
        for handle in self.experts.values():
            if handle is not self:
                handle.remove()
        if self.linears is not None:
            self.linears.remove()
            self.linears = None
        if self._patch is not None:
            self._patch.restore()
            self._patch = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def expert_plans(pipe_or_transformer, plans: Plan | Sequence[Plan]) -> tuple[list[tuple[str, object, Plan | None]],
                                                                              list[str]]:
    """Pair each denoising transformer of a pipeline with its plan: ([(expert, transformer, plan or None)],
    problems). A plan names its expert (`Plan.expert`; "" counts as "transformer", the only one of most
    pipelines); a bare transformer takes one plan whatever it names, since a module does not know its
    name in a pipeline. Problems: two plans for one expert, a plan for an expert the pipeline lacks, an
    expert without a plan; each names what the plans were calibrated for and what the pipeline has."""
    if isinstance(plans, (str, os.PathLike)):  # a path, not a list of plans
        raise TypeError(f"apply needs a paroattn.Plan, not the path {str(plans)!r}: load it with Plan.load(path), an "
                        "expert pair with load_plans(path)")
    if not isinstance(plans, Plan) and not isinstance(plans, Sequence):
        raise TypeError(f"apply needs a paroattn.Plan or a list of them (one per expert); got "
                        f"{type(plans).__name__}: load one with Plan.load(path), an expert pair with load_plans(path)")
    plans = [plans] if isinstance(plans, Plan) else list(plans)
    if not plans or not all(isinstance(p, Plan) for p in plans):
        found = ", ".join(type(p).__name__ for p in plans) or "nothing"
        raise TypeError(f"apply needs a paroattn.Plan or a list of them (one per expert); got {found}: "
                        "load one with Plan.load(path), an expert pair with load_plans(path)")
    for p in plans:
        p.validate_for_apply()  # what the processor reads, again: a plan may have changed since it was loaded
    experts = pipeline_experts(pipe_or_transformer)
    if experts[0][0] == "":  # a bare transformer
        if len(plans) > 1:
            raise PlanError(
                f"{len(plans)} plans ({', '.join(p.expert or '?' for p in plans)}) for one bare transformer: pass "
                "the pipeline to bind each expert to its plan, or the one plan of this transformer"
            )
        return [("", experts[0][1], plans[0])], []
    names = [name for name, _ in experts]
    by_expert: dict[str, Plan] = {}
    problems = []
    for plan in plans:
        expert = plan.expert or "transformer"
        if expert in by_expert:
            problems.append(f"two plans were given for expert {expert}; pass one plan per expert")
        elif expert not in names:
            problems.append(
                f"plan was calibrated for expert {expert} of a pipeline with an expert pair; this pipeline "
                f"({type(pipe_or_transformer).__name__}) has {' and '.join(names)}: pass the plan calibrated "
                f"for {' and '.join(names)}"
            )
        else:
            by_expert[expert] = plan
    for name in names:
        if name not in by_expert:
            given = ", ".join(p.expert or "transformer" for p in plans)
            problems.append(
                f"no plan for expert {name} ({expert_role(pipe_or_transformer, name)}); the plans given were "
                f"calibrated for {given}: pass every expert's plan (`load_plans(path)` reads the pair "
                "`paro calibrate` writes)"
            )
    return [(name, module, by_expert.get(name)) for name, module in experts], problems


def apply(pipe_or_transformer, plan: Plan | Sequence[Plan] | None, backend: str = "auto", on_mismatch: str = "error",
          *, resident: bool | str = "auto", prefetch_slots: int = 3, fuse_rope: bool = True, balance_ranks: int = 1,
          exchange_groups: int = 1, linear: str | None = None) -> PAROHandle:
    """Run every self-attention layer of the pipeline's transformer with `plan` (a `Plan`); for a pipeline with
    an expert pair (Wan 2.2 A14B), `plan` is the list of both experts' plans and each expert runs its own.
    Returns a handle (also a context manager) whose `remove()` restores the original processors bit-exactly.

    The plan serves every generation size: its calibrated sizes with their own masks, any other size with masks
    derived once from the closest calibrated one (a plan without axis profiles, format version 1, serves its
    calibrated size only and raises PlanError at another when the call runs, or runs dense with a warning).

    Applying to a transformer PARO already runs replaces its plan; the `remove()` of any handle of that
    transformer then restores the processors it had before the first apply.

    `backend`: "auto" (the Triton kernels on CUDA where they fit the call, else the torch reference), "triton"
    and "cuda" (the sm_90a kernels; both need a CUDA GPU: refused here on a machine without one) or "torch".
    Raises PlanError when a plan was made for another model class, config, head or layer count, or expert
    (with on_mismatch="dense": warns and runs that transformer's own attention). `resident`, `prefetch_slots`,
    `fuse_rope`, `balance_ranks` (the masks balanced over that many GPUs under Ulysses), `exchange_groups` (the
    groups of heads the Ulysses exchange is pipelined over): see PAROProcessor.

    `linear="fp8"`: the linear layers of every transformer's blocks also run in fp8 (torchao; which layers and
    why: `paroattn.linear`), with `plan=None` beside the model's own attention. It is refused, before anything
    changes, without torchao (`pip install paroattn[fp8]`), on the CPU, on a GPU below sm_89 and for weights
    that are not bfloat16."""
    if isinstance(plan, str) and plan == "auto":
        raise TypeError("plan='auto' learns the plan during the first generation, which calibration does: call "
                        "paroattn.apply(pipe, 'auto', density=...) (paroattn.calibrate.auto)")
    check_apply_options(backend, on_mismatch)
    if plan is None and linear is not None:  # the model's own attention, fp8 linear layers
        pairs, problems = [(name, module, None) for name, module in pipeline_experts(pipe_or_transformer)], []
    else:
        pairs, problems = expert_plans(pipe_or_transformer, plan)
    if linear is not None:
        from ..linear import transformer_problem

        for expert, transformer, _ in pairs:
            if problem := transformer_problem(transformer, linear):
                raise ValueError(problem + (f" (expert {expert})" if expert and len(pairs) > 1 else ""))
    if problems:
        message = "; ".join(problems)
        if on_mismatch == "error":
            raise PlanError(message + " (or pass on_mismatch='dense' to run the model's own attention)")
        warnings.warn(message + "; running the model's own attention there (on_mismatch='dense')", stacklevel=2)
    # every plan is bound (checked against its transformer) before any processor is swapped
    bound = []
    try:
        for expert, transformer, expert_plan in pairs:
            processor = binding = None
            if expert_plan is not None:
                family = require_family(transformer)
                processor = PAROProcessor(expert_plan, backend=backend, on_mismatch=on_mismatch, resident=resident,
                                          prefetch_slots=prefetch_slots,
                                          pixel_scale=pixel_scale_of(pipe_or_transformer, family), fuse_rope=fuse_rope,
                                          balance_ranks=balance_ranks, exchange_groups=exchange_groups)
                binding = processor.bind(transformer)
                if binding.static_problem:  # on_mismatch="dense" and a plan that does not fit: its own attention
                    processor.unbind(binding)
                    processor = binding = None
            bound.append((expert, transformer, processor, binding))
    except Exception:
        for _, _, processor, binding in bound:
            if processor is not None:
                processor.unbind(binding)
        raise
    handles = {}
    try:
        for expert, transformer, processor, binding in bound:
            patch = _patch_of(transformer)
            if processor is None:  # this apply runs the model's own attention there
                if patch is not None:
                    patch.restore()
                handles[expert] = PAROHandle(transformer, None, None, None, expert)
                continue
            try:  # refuses a context-parallel config that cannot hold PARO (enable_parallelism before apply)
                originals = _install(transformer, processor, binding.keys, binding)
            except Exception:
                processor.unbind(binding)
                raise
            if patch is None:
                patch = _PATCHES[transformer] = _Patch(transformer, originals)
            patch.serve(processor, binding)
            handles[expert] = PAROHandle(transformer, processor, binding, patch, expert)
        if linear is not None:
            from ..linear import quantize_linears

            for expert, transformer, _ in pairs:
                handles[expert].linears = quantize_linears(transformer, linear)
    except Exception:
        for handle in handles.values():
            handle.remove()
        for _, transformer, processor, binding in bound[len(handles):]:
            if processor is not None and binding in processor._bindings:
                processor.unbind(binding)
        raise
    first = next(iter(handles.values()))
    if len(handles) > 1:
        first.experts = handles
    return first


def check_apply_options(backend: str, on_mismatch: str) -> None:
    """Refuse, before anything changes, a backend or on_mismatch `apply` does not know, or a backend this machine
    cannot run."""
    from ..attention import BACKENDS
    from .plan_fit import ON_MISMATCH

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch={on_mismatch!r}; expected one of {ON_MISMATCH}")
    if problem := _backend_problem(backend):
        raise ValueError(problem)


def _backend_problem(backend: str) -> str | None:
    """Why `backend` cannot run on this machine, or None: the Triton and CUDA kernels need a CUDA GPU (or, for
    Triton, its interpreter: TRITON_INTERPRET=1, which tests use). On a machine with a GPU a pipeline still on
    the CPU may move there after apply, so only the machine is checked."""
    import torch

    if torch.cuda.is_available() or backend not in ("triton", "cuda"):
        return None
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    kernels = "the Triton kernels" if backend == "triton" else "the sm_90a CUDA kernels"
    return (f"backend={backend!r} runs {kernels}, which need a CUDA GPU, and this machine has none: pass "
            "backend='auto' (or 'torch'), which runs the torch reference op on the CPU")


def reset() -> None:
    """Put back the processors of every transformer `apply` patched (as each handle's `remove()` would)."""
    for patch in list(_PATCHES.values()):
        patch.restore()


@contextmanager
def capture_attention(pipe_or_transformer, callback, *, context_parallel: bool = False):
    """Dense attention identical to the model's own, calling `callback(layer, q, k, layout, timestep, suffix_mask)`
    for every self-attention call: q, k [B, H, N, D] after norms and RoPE, `layout` the call's
    TokenLayout, `timestep` on the 0..1000 scale (Wan calls twice per step: cond, then uncond),
    `suffix_mask` the op's [B, suffix] bool mask of real text keys, None when no key is padding.
    `context_parallel`: under diffusers' Ulysses context parallelism each process's callback gets its slice of
    the heads over the whole sequence (`CaptureProcessor`); False: a transformer under it is refused.
    The original processors come back on exit. Yields the list of self-attention processor keys."""
    transformer = resolve_transformer(pipe_or_transformer)
    processor = CaptureProcessor(callback, context_parallel=context_parallel)
    binding = processor.bind(transformer)
    keys = binding.keys
    try:
        originals = _install(transformer, processor, keys, binding)
    except Exception:
        processor.unbind(binding)
        raise
    try:
        yield keys
    finally:
        transformer.set_attn_processor(dict(originals))
        processor.unbind(binding)
