"""diffusers integration: one adapter per model family, the PARO processor, and the calls around it.

    handle = paroattn.apply(pipe, plan)          # every self-attention layer runs PARO
    ...
    handle.remove()                              # the original processors, bit-exact

    pipe.transformer.set_attn_processor(PAROProcessor(plan))   # also works: the instance finds its layers

For calibration:
    self_attention_layers(transformer) -> processor keys in plan layer order
    capture_attention(pipe, callback)  -> context manager; callback(layer, q, k, layout, timestep)
    layout_for(transformer, height=, width=, frames=) -> the TokenLayout of a generation size
"""

from __future__ import annotations

from contextlib import contextmanager

from ..layout import TokenLayout
from ..plan import Plan
from .base import CallInputs, FamilyAdapter, pixel_scale_of
from .processor import Binding, CaptureProcessor, PAROProcessor
from .registry import family_of, require_family, resolve_transformer

__all__ = [
    "CallInputs",
    "CaptureProcessor",
    "FamilyAdapter",
    "PAROHandle",
    "PAROProcessor",
    "apply",
    "capture_attention",
    "family_of",
    "layout_for",
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
    return require_family(transformer).layout_for(
        transformer, height=height, width=width, frames=frames, text_tokens=text_tokens,
        scale=pixel_scale_of(pipe_or_transformer),
    )


def _install(transformer, processor, keys: list[str], binding: Binding) -> dict:
    """Put `processor` on `keys`, keep every other processor; return the originals to restore."""
    originals = dict(transformer.attn_processors)
    missing = [key for key in keys if key not in originals]
    if missing:
        raise RuntimeError(f"the transformer has no attention processors named {missing[:3]}; diffusers changed its layout")
    first = originals[keys[0]]
    for name in ("_attention_backend", "_parallel_config"):
        setattr(processor, name, getattr(first, name, None))
    for delegate in binding.delegates.values():
        binding.sync_delegate(delegate)
    replacement = dict(originals)
    for key in keys:
        replacement[key] = processor
    transformer.set_attn_processor(replacement)  # diffusers empties the dict it is given
    return originals


class PAROHandle:
    """What `apply` returns: `remove()` puts the original processors back; `stats()` reports masks."""

    def __init__(self, transformer, processor: PAROProcessor | None, binding: Binding | None, originals: dict | None):
        self.transformer = transformer
        self.processor = processor
        self.binding = binding
        self._originals = originals

    @property
    def active(self) -> bool:
        return self._originals is not None

    def stats(self) -> dict:
        """Mask memory and prefetch counters (after at least one forward on the device); `traced_bytes`:
        per device, the masks that forwards traced by torch.compile read (`StackedMasks`)."""
        if self.binding is None:
            return {}
        stats = self.binding.masks.stats() if self.binding.masks is not None else {}
        if self.binding.stacked_masks:
            stats["traced_bytes"] = {device: store.nbytes for device, store in self.binding.stacked_masks.items()}
        return stats

    def remove(self) -> None:
        if self._originals is None:
            return
        self.transformer.set_attn_processor(dict(self._originals))
        self.processor.unbind(self.binding)
        self._originals = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def apply(pipe_or_transformer, plan: Plan, backend: str = "auto", on_mismatch: str = "error", *,
          resident: bool | str = "auto", prefetch_slots: int = 3, fuse_rope: bool = True) -> PAROHandle:
    """Run every self-attention layer of the pipeline's transformer with `plan`.

    Raises PlanError when the plan was made for another model class, config, head or layer count
    (with on_mismatch="dense": warns and leaves the model as it is); a call at another resolution or
    frame count raises PlanError when it runs (or runs dense with a warning). `resident`,
    `prefetch_slots`, `fuse_rope`: see PAROProcessor."""
    transformer = resolve_transformer(pipe_or_transformer)
    processor = PAROProcessor(plan, backend=backend, on_mismatch=on_mismatch, resident=resident,
                              prefetch_slots=prefetch_slots, pixel_scale=pixel_scale_of(pipe_or_transformer),
                              fuse_rope=fuse_rope)
    binding = processor.bind(transformer)
    if binding.static_problem:
        processor.unbind(binding)
        return PAROHandle(transformer, None, None, None)
    try:  # refuses a context-parallel config that cannot hold PARO (diffusers' enable_parallelism before apply)
        originals = _install(transformer, processor, binding.keys, binding)
    except Exception:
        processor.unbind(binding)
        raise
    return PAROHandle(transformer, processor, binding, originals)


@contextmanager
def capture_attention(pipe_or_transformer, callback):
    """Dense attention identical to the model's own, calling `callback(layer, q, k, layout, timestep)`
    for every self-attention call: q, k [B, H, N, D] after norms and RoPE, `layout` the call's
    TokenLayout, `timestep` on the 0..1000 scale (Wan calls twice per step: cond, then uncond).
    The original processors come back on exit. Yields the list of self-attention processor keys."""
    transformer = resolve_transformer(pipe_or_transformer)
    processor = CaptureProcessor(callback)
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
