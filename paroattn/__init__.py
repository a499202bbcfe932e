"""paroattn: PAROAttention for diffusers video and image transformers.

    import paroattn
    plan = paroattn.Plan.load("plan.safetensors")     # written by `paro calibrate`
    with paroattn.apply(pipe, plan):                  # every self-attention layer runs PARO
        video = pipe(prompt).frames[0]                # at any size: other sizes derive their masks
    # back to the model's own processors, bit for bit

    handle = paroattn.apply(pipe, plan)               # or keep the handle
    handle.remove()
    paroattn.apply(pipe, paroattn.load_plans("plan.safetensors"))  # Wan 2.2 A14B: a plan per expert

The public API:
- `apply(pipe_or_transformer, plan, backend="auto", on_mismatch="error")`: swap in PARO processors; returns a
  handle whose `remove()` restores the original ones (a second apply replaces the plan; any handle's
  `remove()` then restores the originals);
- `PAROProcessor(plan)`: the processor itself, for `transformer.set_attn_processor`;
- `Plan`, `load_plans`: a plan file (orders, block masks, buckets, quantization) and an expert pair's files;
- `paro_attention(q, k, v, layout=, orders=, block_mask=, ...)`: the op, with `TokenLayout` and `ORDERS`;
- `PlanError`, `PAROInputError`: a plan that does not fit, and arguments that break the op's contract.
"""

from .attention import paro_attention
from .errors import PAROInputError, PlanError
from .layout import ORDERS, TokenLayout
from .plan import Plan, load_plans

__version__ = "0.1.0"

__all__ = ["ORDERS", "PAROInputError", "PAROProcessor", "Plan", "PlanError", "TokenLayout", "apply", "load_plans",
           "paro_attention"]

# loaded on first use: they import diffusers, which is heavy
_LAZY = ("PAROProcessor", "apply")


def __getattr__(name):
    if name in _LAZY:
        from . import pipelines

        return getattr(pipelines, name)
    raise AttributeError(f"module 'paroattn' has no attribute {name!r}")


def __dir__():
    # so that dir() and help(paroattn) list the lazily loaded names too
    return sorted(set(globals()) | set(_LAZY))
