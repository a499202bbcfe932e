"""Find the transformer (or the expert transformers) of a pipeline and the adapter of its family."""

from __future__ import annotations

import torch

from .base import FamilyAdapter
from .cogvideox import CogVideoXAdapter
from .flux import FluxAdapter
from .flux2 import Flux2Adapter
from .hunyuan_video import HunyuanVideoAdapter
from .hunyuan_video15 import HunyuanVideo15Adapter
from .ltx import LTXVideoAdapter
from .ltx2 import LTX2Adapter
from .qwen_image import QwenImageAdapter
from .skyreels_v2 import SkyReelsV2Adapter
from .wan import WanAdapter
from .wan_vace import WanVACEAdapter

FAMILIES: tuple[type[FamilyAdapter], ...] = (
    CogVideoXAdapter, WanAdapter, FluxAdapter, HunyuanVideoAdapter, SkyReelsV2Adapter, WanVACEAdapter,
    QwenImageAdapter, Flux2Adapter, HunyuanVideo15Adapter, LTXVideoAdapter, LTX2Adapter,
)
SUPPORTED = ", ".join(name for family in FAMILIES for name in family.transformer_classes)
# the same families as users name them, for help texts: "CogVideoX, Wan 2.1 / 2.2, FLUX.1, HunyuanVideo"
SUPPORTED_MODELS = ", ".join(family.models or " / ".join(family.transformer_classes) for family in FAMILIES)


# pipeline components that hold a denoising transformer, in the order a pipeline runs them: Wan 2.2 A14B runs
# `transformer` on the high-noise steps (t >= boundary_ratio * 1000) and `transformer_2` on the others
EXPERTS = ("transformer", "transformer_2")


def pipeline_experts(pipe_or_transformer) -> list[tuple[str, torch.nn.Module]]:
    """(component name, transformer) of every denoising transformer of a pipeline, in `EXPERTS` order (one for
    most pipelines, two for an expert pair); `[("", module)]` for a bare transformer module."""
    experts = [(name, getattr(pipe_or_transformer, name, None)) for name in EXPERTS]
    experts = [(name, module) for name, module in experts if isinstance(module, torch.nn.Module)]
    if experts and not isinstance(pipe_or_transformer, torch.nn.Module):
        return experts
    if isinstance(pipe_or_transformer, torch.nn.Module):
        return [("", pipe_or_transformer)]
    raise TypeError(
        f"expected a diffusers pipeline with a `.transformer` or a transformer module; got "
        f"{type(pipe_or_transformer).__name__}"
    )


def expert_role(pipe, expert: str) -> str:
    """What an expert of `pipe` denoises, for messages: "high-noise steps, t >= 700" and the like."""
    ratio = getattr(getattr(pipe, "config", None), "boundary_ratio", None)
    if ratio is None or expert not in EXPERTS:
        return "every step"
    boundary = float(ratio) * float(getattr(getattr(pipe, "scheduler", None), "config", {}).get(
        "num_train_timesteps", 1000))
    return f"high-noise steps, t >= {boundary:g}" if expert == "transformer" else f"low-noise steps, t < {boundary:g}"


def resolve_transformer(pipe_or_transformer) -> torch.nn.Module:
    """The (first) transformer of a diffusers pipeline, or the module itself."""
    return pipeline_experts(pipe_or_transformer)[0][1]


def family_of(transformer) -> FamilyAdapter | None:
    """A fresh adapter for this transformer's family (adapters cache per-transformer state), or None."""
    for family in FAMILIES:
        adapter = family()
        if adapter.matches(transformer):
            return adapter
    return None


def require_family(transformer) -> FamilyAdapter:
    adapter = family_of(transformer)
    if adapter is None:
        raise TypeError(
            f"paroattn supports {SUPPORTED}; got {type(transformer).__name__}: pass the pipeline or "
            "transformer of a supported model"
        )
    return adapter
