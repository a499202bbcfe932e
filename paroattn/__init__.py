"""paroattn: PAROAttention for diffusers video and image transformers.

    import paroattn
    plan = paroattn.Plan.load("plan.safetensors")     # written by `paro calibrate`
    with paroattn.apply(pipe, plan):                  # every self-attention layer runs PARO
        video = pipe(prompt).frames[0]                # at any size: other sizes derive their masks
    # back to the model's own processors, bit for bit

    handle = paroattn.apply(pipe, plan)               # or keep the handle
    handle.remove()
    paroattn.apply(pipe, paroattn.load_plans("plan.safetensors"))  # Wan 2.2 A14B: a plan per expert

    with paroattn.apply(pipe, "auto", density=0.3):   # no plan file: the first generation runs dense and learns
        video = pipe(prompt).frames[0]                # one, cached for every later generation and process

The public API:
- `apply(pipe_or_transformer, plan, backend="auto", on_mismatch="error")`: swap in PARO processors; returns a
  handle whose `remove()` restores the original ones (a second apply replaces the plan; any handle's
  `remove()` then restores the originals); `plan="auto"` (with `density`, `qk`, `pv`) learns the plan
  during the first generation and caches it;
- `clear_cache()`: remove every plan `plan="auto"` cached;
- `PAROProcessor(plan)`: the processor itself, for `transformer.set_attn_processor`;
- `Plan`, `load_plans`: a plan file (orders, block masks, buckets, quantization) and an expert pair's files;
- `paro_attention(q, k, v, layout=, orders=, block_mask=, ...)`: the op, with `TokenLayout` and `ORDERS`;
- `PlanError`, `PAROInputError`: a plan that does not fit, and arguments that break the op's contract;
- `reset()`: every patched transformer back to its own processors, and every mask and kernel cache dropped.
"""

import sys

from .attention import paro_attention
from .errors import PAROInputError, PlanError
from .layout import ORDERS, TokenLayout
from .plan import Plan, load_plans
from .runner.cache import clear_cache

__version__ = "0.1.0"

__all__ = ["ORDERS", "PAROInputError", "PAROProcessor", "Plan", "PlanError", "TokenLayout", "apply", "clear_cache",
           "load_plans", "paro_attention", "reset"]

# loaded on first use: they import diffusers, which is heavy
_LAZY = ("PAROProcessor", "apply")


def reset() -> None:
    """Bring the process back to where it was before paroattn ran anything: every transformer `apply` patched
    gets its own processors back (as its handle's `remove()` would), every plan runner drops its masks (built
    again on the next call), and the op empties its caches (kernel decisions, buffers, mask lists, built
    kernels). Pinned kernel configs stay: they are settings."""
    pipelines = sys.modules.get(f"{__name__}.pipelines")  # not imported: nothing was applied (it loads diffusers)
    if pipelines is not None:
        pipelines.reset()
    from .kernels import runtime
    from .runner import reset as drop_masks

    drop_masks()
    runtime.clear()


def __getattr__(name):
    if name == "apply":  # plan="auto" is learnt by calibration, above the pipelines
        from .calibrate.auto import apply

        return apply
    if name in _LAZY:
        from . import pipelines

        return getattr(pipelines, name)
    raise AttributeError(f"module 'paroattn' has no attribute {name!r}")


def __dir__():
    # so that dir() and help(paroattn) list the lazily loaded names too
    return sorted(set(globals()) | set(_LAZY))
