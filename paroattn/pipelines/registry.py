"""Find the transformer of a pipeline and the adapter of its family."""

from __future__ import annotations

import torch

from .base import FamilyAdapter
from .cogvideox import CogVideoXAdapter
from .flux import FluxAdapter
from .wan import WanAdapter

FAMILIES: tuple[type[FamilyAdapter], ...] = (CogVideoXAdapter, WanAdapter, FluxAdapter)
SUPPORTED = ", ".join(name for family in FAMILIES for name in family.transformer_classes)


def resolve_transformer(pipe_or_transformer) -> torch.nn.Module:
    """The transformer of a diffusers pipeline, or the module itself."""
    transformer = getattr(pipe_or_transformer, "transformer", None)
    if isinstance(transformer, torch.nn.Module):
        return transformer
    if isinstance(pipe_or_transformer, torch.nn.Module):
        return pipe_or_transformer
    raise TypeError(
        f"expected a diffusers pipeline with a `.transformer` or a transformer module; got "
        f"{type(pipe_or_transformer).__name__}"
    )


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
