"""paroattn: PAROAttention for diffusers video and image transformers.

    import paroattn
    handle = paroattn.apply(pipe, paroattn.Plan.load("plan.safetensors"))
    video = pipe(prompt).frames[0]
    handle.remove()  # back to the model's own attention
    paroattn.apply(pipe, paroattn.load_plans("plan.safetensors"))  # Wan 2.2 A14B: a plan per expert
"""

from .attention import paro_attention
from .errors import PAROInputError, PlanError
from .layout import ORDERS, TokenLayout
from .plan import Plan, load_plans

__version__ = "0.1.0"

__all__ = ["ORDERS", "PAROInputError", "PAROProcessor", "Plan", "PlanError", "TokenLayout", "apply", "load_plans",
           "paro_attention"]


def __getattr__(name):
    # diffusers is heavy to import; load the integration only when it is asked for
    if name in ("PAROProcessor", "apply"):
        from . import pipelines

        return getattr(pipelines, name)
    raise AttributeError(f"module 'paroattn' has no attribute {name!r}")
