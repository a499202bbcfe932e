"""What every model family adapter provides, and the pieces they share.

An adapter knows three things about one diffusers transformer family:
- which attention modules are self-attention, in plan layer order (`self_attention_layers`);
- how one forward call's token layout and timestep follow from the transformer's arguments
  (`call_inputs`, used by the forward pre-hook) or, once, from its running frame (`call_inputs_from_locals`,
  used when a lone `PAROProcessor` binds itself in the middle of a forward);
- how the model's own processor computes a self-attention call, split so that the attention in the
  middle can be swapped: `qkv` (projections, norms, text concat) -> `rotate` (the model's RoPE) ->
  `dense` (the exact call the default processor makes), or `qkv` -> `paro_attention(rotary=...)`,
  which applies the same RoPE in one pass of its own -> `finish` (output projections, text split).
`qkv` returns q, k, v as [B, H, N, D] (views of the model's own layout where it is [B, N, H, D]) with
the RoPE still to apply, so `rotate` + `dense` see the very tensors the default processor would and
give bit-identical outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import TokenLayout

# The VAEs of CogVideoX, Wan 2.1 and FLUX.1 compress space by 8 and (video) time by 4; Wan 2.2 TI2V's by 16 and 4.
# A pipeline's own factors are always used; these only size the messages about a bare transformer.
VAE_SPATIAL = 8
VAE_TEMPORAL = 4


@dataclass(frozen=True)
class PixelScale:
    """Pixels per latent position (`spatial`) and frames per latent frame (`temporal`) of a pipeline:
    its VAE's factors; 1 and 1 for a model that works in pixel space (the demo model)."""

    temporal: int = VAE_TEMPORAL
    spatial: int = VAE_SPATIAL


STANDARD_VAE = PixelScale()
_SCALE_ATTRIBUTES = ("vae_scale_factor_spatial", "vae_scale_factor", "vae_scale_factor_temporal")


def pixel_scale_of(pipe_or_transformer, family: FamilyAdapter | None = None) -> PixelScale:
    """The pipeline's VAE factors (diffusers' `vae_scale_factor_temporal` / `vae_scale_factor_spatial`,
    or `vae_scale_factor` for image pipelines); for a bare transformer, the factors of the VAE its family
    releases with that config (`family.default_scale`), or the common 8 and 4."""
    if not any(hasattr(pipe_or_transformer, name) for name in _SCALE_ATTRIBUTES):
        return family.default_scale(pipe_or_transformer) if family is not None else STANDARD_VAE
    spatial = getattr(pipe_or_transformer, "vae_scale_factor_spatial", None)
    if spatial is None:
        spatial = getattr(pipe_or_transformer, "vae_scale_factor", VAE_SPATIAL)
    temporal = getattr(pipe_or_transformer, "vae_scale_factor_temporal", VAE_TEMPORAL)
    return PixelScale(int(temporal), int(spatial))


@dataclass
class CallInputs:
    """What one transformer forward call means for PARO: its timestep and its token layout. `problem`
    says why the call has no usable layout (then `layout` is None).

    `timestep` is what the pipeline passed, a tensor kept as a tensor (its largest entry counts: all are
    equal except in per-token schedules), so that a forward traced by torch.compile picks its bucket on
    the device (`Plan.bucket_tensor`) instead of reading the value on the host, which would break the
    graph or, as a Python float in a guard, recompile it at every step. `timestep_scale` brings it to the
    0..1000 scale of plans (Flux passes t / 1000: 1000)."""

    timestep: float | torch.Tensor
    layout: TokenLayout | None
    problem: str | None = None
    timestep_scale: float = 1.0

    def timestep_1000(self) -> float:
        """The timestep on the 0..1000 scale as a Python float (a host read of a tensor timestep)."""
        return self.timestep_scale * timestep_value(self.timestep)


@dataclass
class SelfAttentionCall:
    """q, k, v [B, H, N, D] of one self-attention call and what `finish` needs to undo the split."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    text_tokens: int | None  # tokens before the grid that this call itself reveals (None: unknown here)
    extra: dict[str, Any]
    # RoPE that q and k still need (None: none, or applied): the model's own embedding, for the family's
    # `rotate`, and the same rotation as float32 [S, D] tables for `paro_attention(rotary=...)`
    rotary_emb: Any = None
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None


class RotaryTables:
    """`paro_attention`'s rotary tables for a model's RoPE embedding, converted once per embedding: a
    transformer passes the same tensors to every layer of a forward (CogVideoX: of every step)."""

    def __init__(self, convert: Callable[..., tuple[torch.Tensor, torch.Tensor]]):
        self._convert = convert
        self._source: tuple | None = None  # held, so that `is` cannot match a recycled tensor
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, embedding) -> tuple[torch.Tensor, torch.Tensor]:
        source = tuple(embedding)
        if torch.compiler.is_compiling():
            # traced: the conversion joins the graph (a few small ops per layer); caching the tensors of one
            # call here would make the next call's guards see new objects and recompile
            return self._convert(*source)
        if self._source is None or len(source) != len(self._source) or any(
                a is not b for a, b in zip(source, self._source)):
            self._tables = self._convert(*source)
            self._source = source
        return self._tables


def float32_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables for models whose RoPE is diffusers' `apply_rotary_emb` on interleaved pairs ([S, D], the op's
    convention already): it multiplies in float32 whatever the tables' dtype, so float32 copies are exact."""
    return cos.float().contiguous(), sin.float().contiguous()


def without_rotary(call: SelfAttentionCall, q: torch.Tensor, k: torch.Tensor) -> SelfAttentionCall:
    """`call` with q and k replaced by their rotated versions."""
    return dataclasses.replace(call, q=q, k=k, rotary_emb=None, rotary=None)


def timestep_value(timestep) -> float:
    """The largest timestep of a call (all entries are equal except in per-token schedules)."""
    if isinstance(timestep, torch.Tensor):
        return float(timestep.detach().max())
    return float(timestep)


def dispatch_dense(call: SelfAttentionCall, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
    """The dense call of the processors built on diffusers' `dispatch_attention_fn` (Wan, Flux):
    they hold q, k, v as [B, S, H, D], so `call`'s [B, H, S, D] views transpose back to those tensors."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    out = dispatch_attention_fn(
        call.q.transpose(1, 2),
        call.k.transpose(1, 2),
        call.v.transpose(1, 2),
        attn_mask=attention_mask,
        dropout_p=0.0,
        is_causal=False,
        backend=backend,
        parallel_config=parallel_config,
    )
    return out.transpose(1, 2)


def class_names(obj) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


class FamilyAdapter:
    """Base class; see the module docstring. Subclasses set the class attributes."""

    name: str = ""
    models: str = ""  # the model names users know (help and messages); default: transformer_classes
    transformer_classes: tuple[str, ...] = ()
    attention_classes: tuple[str, ...] = ()
    is_video: bool = True
    # the layout of the plan a PAROProcessor runs (set when it binds): what a forward traced by torch.compile
    # takes for a call whose layout the arguments' shapes alone do not settle (Flux's image grid)
    planned_layout: TokenLayout | None = None

    def matches(self, transformer) -> bool:
        return bool(class_names(transformer) & set(self.transformer_classes))

    # -- structure ---------------------------------------------------------------------------
    def self_attention_layers(self, transformer) -> list[str]:
        raise NotImplementedError

    def num_heads(self, transformer) -> int:
        return int(transformer.config.num_attention_heads)

    def default_scale(self, transformer) -> PixelScale:
        """VAE factors of a bare transformer's released pipeline (a pipeline's own factors take precedence)."""
        return STANDARD_VAE

    # -- per forward -------------------------------------------------------------------------
    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        raise NotImplementedError

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        raise NotImplementedError

    # -- geometry ----------------------------------------------------------------------------
    def layout_for(self, transformer, *, height: int, width: int, frames: int | None = None,
                   text_tokens: int | None = None, scale: PixelScale = STANDARD_VAE) -> TokenLayout:
        raise NotImplementedError

    def pixel_size(self, transformer, layout: TokenLayout, scale: PixelScale = STANDARD_VAE) -> dict[str, int]:
        """Smallest generation size (pixels, frames) whose tokens have this layout."""
        raise NotImplementedError

    # -- per self-attention call -------------------------------------------------------------
    def qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb) -> SelfAttentionCall:
        """q, k, v after projections and norms; RoPE left pending in `rotary_emb` / `rotary`."""
        raise NotImplementedError

    def rotate(self, call: SelfAttentionCall) -> SelfAttentionCall:
        """Apply the pending RoPE the way the model's own processor does (no-op when none is pending)."""
        raise NotImplementedError

    def dense(self, attn, call: SelfAttentionCall, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        raise NotImplementedError

    def finish(self, attn, out: torch.Tensor, call: SelfAttentionCall):
        raise NotImplementedError

    def is_self_attention(self, attn, encoder_hidden_states) -> bool:
        return True

    def suffix_mask(self, attention_mask: torch.Tensor, layout: TokenLayout) -> tuple[bool, torch.Tensor | None]:
        """(whether the model's attention mask only marks padded suffix keys, the op's `suffix_mask` [B, suffix]
        or None when nothing is padded). Families whose masks say something else run such calls densely."""
        return False, None

    def default_processor(self, attn):
        """A fresh default processor for `attn` (for modules a lone PAROProcessor must leave alone)."""
        cls = getattr(type(attn), "_default_processor_cls", None)
        if cls is None:
            raise TypeError(f"no default processor known for {type(attn).__name__}")
        return cls()

    def describe_size(self, transformer, layout: TokenLayout, scale: PixelScale = STANDARD_VAE) -> str:
        size = self.pixel_size(transformer, layout, scale)
        if "frames" in size:
            return f"{size['frames']} frames of {size['height']}x{size['width']}"
        return f"{size['height']}x{size['width']}"

    def calibrate_command(self, transformer, layout: TokenLayout | None, scale: PixelScale = STANDARD_VAE) -> str:
        args = ""
        if layout is not None:
            size = self.pixel_size(transformer, layout, scale)
            args = f" --height {size['height']} --width {size['width']}"
            if "frames" in size:
                args += f" --frames {size['frames']}"
        return f"paro calibrate MODEL_DIR{args} --out plan.safetensors"
