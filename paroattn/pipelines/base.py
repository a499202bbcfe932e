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
from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout import TokenLayout

# The VAEs of CogVideoX, Wan 2.1 and FLUX.1 compress space by 8 and (video) time by 4; Wan 2.2 TI2V's by 16 and 4.
# A pipeline's own factors are always used; these only size the messages about a bare transformer.
VAE_SPATIAL = 8
VAE_TEMPORAL = 4
# how a family's context-parallel plan spreads the text of its self-attention over the GPUs: split in chunks like the
# grid (diffusers' plans), or held whole by every GPU (`context_parallel.py`)
TEXT_SPLIT, TEXT_WHOLE = "split", "whole"


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
    _timestep_1000: float | None = field(default=None, init=False, repr=False, compare=False)

    def timestep_1000(self) -> float:
        """The timestep on the 0..1000 scale as a Python float (a host read of a tensor timestep, made once per
        forward: each read waits for the GPU, and a capture asks at every layer)."""
        if self._timestep_1000 is None:
            self._timestep_1000 = self.timestep_scale * timestep_value(self.timestep)
        return self._timestep_1000


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


def rotate_pairs(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """The RoPE of Wan and the models built on its blocks (SkyReels-V2, Wan VACE): interleaved pairs,
    [B, S, H, D] with cos/sin [1, S, 1, D] broadcast over heads, pair i turned by cos[2i] and sin[2i + 1]."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def paired_tables(freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotate_pairs`'s rotation as `paro_attention`'s tables: pair i turns by cos[2i] and sin[2i + 1], so
    both columns of the pair get those. [1, S, 1, D] -> float32 [S, D]. `rotate_pairs` multiplies in the
    tables' dtype (bf16 once the model is cast): the op's float32 products round once, not twice."""
    cos = freqs_cos.flatten(0, -2)[:, 0::2].float().repeat_interleave(2, dim=-1)
    sin = freqs_sin.flatten(0, -2)[:, 1::2].float().repeat_interleave(2, dim=-1)
    return cos, sin


def complex_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables for a RoPE given as complex frequencies [S, D / 2] multiplied into interleaved pairs viewed as
    complex numbers (Qwen-Image): pair i turns by freqs[i], so both columns of the pair get its real part
    (cos) and its imaginary part (sin). The model multiplies in float32 (complex64): float32 tables are exact."""
    return (freqs.real.float().repeat_interleave(2, dim=-1).contiguous(),
            freqs.imag.float().repeat_interleave(2, dim=-1).contiguous())


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
    """Base class; see the module docstring. Subclasses set the class attributes; what most families share is
    declared there and implemented here once:

    - `self_attention_paths`: (module list, attention attribute) pairs, in plan layer order; the self-attention
      layers are every block's attention of each list in turn;
    - geometry: the transformer's patch sizes (`patch_sizes`, read from its config), where the text sits in the
      self-attention sequence (`text_position`: "none", "prefix" or "suffix") and how long it is by default
      (`default_text_tokens`) and whether the pipeline pads it to that length (`pads_text`), the default frame
      count of a video family (`default_frames`), and for image families the latent pixels packed per token side
      (`pack`). `layout_for` and `pixel_size` follow from them.
    """

    name: str = ""
    models: str = ""  # the model names users know (help and messages); default: transformer_classes
    transformer_classes: tuple[str, ...] = ()
    attention_classes: tuple[str, ...] = ()
    self_attention_paths: tuple[tuple[str, str], ...] = ()
    is_video: bool = True
    text_position: str = "none"
    default_text_tokens: int = 0
    default_frames: int = 81
    pack: int = 1
    # whether the pipeline pads the text to `max_sequence_length` (so `paro generate` passes the plan's text length
    # there); Qwen-Image's keeps each prompt's own length, which max_sequence_length would only truncate
    pads_text: bool = True
    # the layout of the plan a PAROProcessor runs (set when it binds): what a forward traced by torch.compile
    # takes for a call whose layout the arguments' shapes alone do not settle (Flux's image grid)
    planned_layout: TokenLayout | None = None
    # how the family's context-parallel plan spreads the text of its self-attention: in chunks like the grid
    # (`TEXT_SPLIT`, diffusers' plans) or held whole by every GPU (`TEXT_WHOLE`: then PARO does the Ulysses exchange
    # for the model's own attention too)
    ulysses_text: str = TEXT_SPLIT

    def matches(self, transformer) -> bool:
        return bool(class_names(transformer) & set(self.transformer_classes))

    # -- structure ---------------------------------------------------------------------------
    def self_attention_layers(self, transformer) -> list[str]:
        if not self.self_attention_paths:
            raise NotImplementedError(f"{type(self).__name__} declares no self_attention_paths")
        return [f"{blocks}.{i}.{attention}.processor" for blocks, attention in self.self_attention_paths
                for i in range(len(getattr(transformer, blocks)))]

    def num_heads(self, transformer) -> int:
        return int(transformer.config.num_attention_heads)

    def default_scale(self, transformer) -> PixelScale:
        """VAE factors of a bare transformer's released pipeline (a pipeline's own factors take precedence)."""
        return STANDARD_VAE

    # -- several GPUs (`context_parallel`) ---------------------------------------------------
    def context_parallel_plan(self, transformer) -> dict | None:
        """How diffusers' `enable_parallelism` splits this transformer's sequence across GPUs (diffusers'
        `ContextParallelModelPlan` format): the model's own `_cp_plan` unless the adapter gives one."""
        return getattr(type(transformer), "_cp_plan", None)

    def after_enable_parallelism(self, transformer) -> None:
        """Set what `enable_parallelism` gets wrong for this family and a context-parallel plan cannot say (nothing
        by default); `context_parallel.enable_ulysses` and `paroattn.apply` under context parallelism call it."""

    def ulysses_problem(self, transformer) -> str | None:
        """Why this transformer cannot run under its context-parallel plan (a configuration the plan does not
        split correctly), or None."""
        return None

    def ulysses_call_problem(self, transformer, inputs: CallInputs, degree: int) -> str | None:
        """Why the plan cannot split this call over `degree` GPUs (seen before diffusers splits it), or None."""
        return None

    # -- per forward -------------------------------------------------------------------------
    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        raise NotImplementedError

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        raise NotImplementedError

    # -- geometry ----------------------------------------------------------------------------
    def patch_sizes(self, transformer) -> tuple[int, int, int]:
        """Latent positions per token along (frames, height, width): the config's `patch_size` as a triple
        (Wan), or `patch_size_t` (1 when absent) and a square `patch_size`."""
        config = transformer.config
        p = config.patch_size
        if isinstance(p, (tuple, list)):
            return tuple(int(x) for x in p)
        return int(getattr(config, "patch_size_t", None) or 1), int(p), int(p)

    def grid_layout(self, transformer, latent_frames: int, latent_height: int, latent_width: int,
                    text_tokens: int = 0) -> TokenLayout:
        """The layout of a call on latents of this size with `text_tokens` where the family puts its text."""
        pt, ph, pw = self.patch_sizes(transformer)
        text = int(text_tokens)
        return TokenLayout(text if self.text_position == "prefix" else 0, int(latent_frames) // pt,
                           int(latent_height) // ph, int(latent_width) // pw,
                           suffix=text if self.text_position == "suffix" else 0)

    def _token_side(self, transformer, scale: PixelScale) -> tuple[int, int]:
        _, ph, pw = self.patch_sizes(transformer)
        return scale.spatial * self.pack * ph, scale.spatial * self.pack * pw

    def layout_for(self, transformer, *, height: int, width: int, frames: int | None = None,
                   text_tokens: int | None = None, scale: PixelScale = STANDARD_VAE) -> TokenLayout:
        text = self.default_text_tokens if text_tokens is None else int(text_tokens)
        if not self.is_video:
            side_h, side_w = self._token_side(transformer, scale)
            return TokenLayout(text if self.text_position == "prefix" else 0, 1, height // side_h, width // side_w,
                               suffix=text if self.text_position == "suffix" else 0)
        frames = self.default_frames if frames is None else int(frames)
        latent_frames = (frames - 1) // scale.temporal + 1
        side = scale.spatial * self.pack
        return self.grid_layout(transformer, latent_frames, height // side, width // side, text)

    def pixel_size(self, transformer, layout: TokenLayout, scale: PixelScale = STANDARD_VAE) -> dict[str, int]:
        """Smallest generation size (pixels, frames) whose tokens have this layout."""
        side_h, side_w = self._token_side(transformer, scale)
        size = {"height": layout.height * side_h, "width": layout.width * side_w}
        if self.is_video:
            pt = self.patch_sizes(transformer)[0]
            size = {"frames": (layout.frames * pt - 1) * scale.temporal + 1, **size}
        return size

    # -- per self-attention call -------------------------------------------------------------
    def arguments(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                  encoder_hidden_states_mask=None):
        """(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb) of a call that diffusers made
        in the attention module's own positional order (most modules pass these four in this order), with a
        text mask passed on its own (`encoder_hidden_states_mask`) folded into `attention_mask`."""
        return hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb

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
