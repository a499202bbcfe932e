"""Wan 2.1 and 2.2 (T2V, I2V, the A14B expert pairs and TI2V-5B): `WanAttnProcessor` of the self-attention
`attn1` split around its attention.

Wan 2.2 A14B pipelines hold two transformers of this class (`transformer`, `transformer_2`), each bound to its
own plan by `paroattn.apply`. TI2V-5B's VAE compresses space by 16 (a 2x2 patchify before the 8x VAE); every
size follows from the pipeline's `vae_scale_factor_spatial` and the transformer's `patch_size`. Its pipeline
passes a per-token timestep [B, N] (`expand_timesteps`), all equal in text-to-video; the largest is bucketed.

Sequence of `attn1`: the F x H x W video tokens only (no text). q/k RMSNorm over heads*dim before
the head split, RoPE on all tokens (passed positionally as the 5th argument; `_rotate` reproduces
diffusers' function), `dispatch_attention_fn` on [B, S, H, D]. `attn2` is cross-attention to the text (+ image for I2V) and keeps its processor.
"""

from __future__ import annotations

import torch

from ..layout import TokenLayout
from .base import (
    STANDARD_VAE,
    CallInputs,
    FamilyAdapter,
    PixelScale,
    RotaryTables,
    SelfAttentionCall,
    dispatch_dense,
    without_rotary,
)

WAN22_VAE_CHANNELS = 48


def _rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs, [B, S, H, D] with cos/sin broadcast over heads."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def _op_tables(freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_rotate`'s rotation as `paro_attention`'s tables: pair i turns by cos[2i] and sin[2i + 1], so
    both columns of the pair get those. [1, S, 1, D] -> float32 [S, D]. `_rotate` multiplies in the
    tables' dtype (bf16 once the model is cast): the op's float32 products round once, not twice."""
    cos = freqs_cos.flatten(0, -2)[:, 0::2].float().repeat_interleave(2, dim=-1)
    sin = freqs_sin.flatten(0, -2)[:, 1::2].float().repeat_interleave(2, dim=-1)
    return cos, sin


class WanAdapter(FamilyAdapter):
    name = "wan"
    models = "Wan 2.1 / 2.2"
    transformer_classes = ("WanTransformer3DModel",)
    attention_classes = ("WanAttention",)

    def __init__(self):
        self._tables = RotaryTables(_op_tables)

    def default_scale(self, transformer) -> PixelScale:
        # a bare transformer with 48 latent channels is Wan 2.2 TI2V-5B, whose VAE (z_dim 48) compresses
        # space by 16; the others are released with the Wan 2.1 VAE (8)
        if int(transformer.config.out_channels or 0) == WAN22_VAE_CHANNELS:
            return PixelScale(temporal=4, spatial=16)
        return STANDARD_VAE

    def self_attention_layers(self, transformer) -> list[str]:
        return [f"blocks.{i}.attn1.processor" for i in range(len(transformer.blocks))]

    def is_self_attention(self, attn, encoder_hidden_states) -> bool:
        return encoder_hidden_states is None and not getattr(attn, "is_cross_attention", False)

    # -- per forward -------------------------------------------------------------------------
    def _layout(self, transformer, latent_frames, latent_height, latent_width):
        p_t, p_h, p_w = (int(p) for p in transformer.config.patch_size)
        return TokenLayout(0, int(latent_frames) // p_t, int(latent_height) // p_h, int(latent_width) // p_w)

    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        _, _, frames, height, width = arguments["hidden_states"].shape  # [B, C, F, H, W]
        return CallInputs(arguments["timestep"], self._layout(transformer, frames, height, width))

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        # WanTransformer3DModel.forward unpacks the latent shape into these names first thing
        layout = self._layout(transformer, f_locals["num_frames"], f_locals["height"], f_locals["width"])
        return CallInputs(f_locals["timestep"], layout)

    # -- geometry ----------------------------------------------------------------------------
    def layout_for(self, transformer, *, height, width, frames=None, text_tokens=None,
                   scale: PixelScale = STANDARD_VAE) -> TokenLayout:
        if frames is None:
            frames = 81
        latent_frames = (int(frames) - 1) // scale.temporal + 1
        return self._layout(transformer, latent_frames, height // scale.spatial, width // scale.spatial)

    def pixel_size(self, transformer, layout: TokenLayout, scale: PixelScale = STANDARD_VAE) -> dict[str, int]:
        p_t, p_h, p_w = (int(p) for p in transformer.config.patch_size)
        return {
            "frames": (layout.frames * p_t - 1) * scale.temporal + 1,
            "height": layout.height * p_h * scale.spatial,
            "width": layout.width * p_w * scale.spatial,
        }

    # -- per self-attention call -------------------------------------------------------------
    def qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb) -> SelfAttentionCall:
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query = attn.to_q(hidden_states)
            key = attn.to_k(hidden_states)
            value = attn.to_v(hidden_states)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        # [B, S, H, D] -> [B, H, S, D] views; `dense` transposes back to the very same tensors
        return SelfAttentionCall(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0, {"dtype": query.dtype},
            rotary_emb=image_rotary_emb,
            rotary=None if image_rotary_emb is None else self._tables(image_rotary_emb),
        )

    def rotate(self, call: SelfAttentionCall) -> SelfAttentionCall:
        if call.rotary_emb is None:
            return call
        query = _rotate(call.q.transpose(1, 2), *call.rotary_emb)
        key = _rotate(call.k.transpose(1, 2), *call.rotary_emb)
        return without_rotary(call, query.transpose(1, 2), key.transpose(1, 2))

    def dense(self, attn, call, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        return dispatch_dense(call, attention_mask, backend, parallel_config)

    def finish(self, attn, out, call):
        out = out.transpose(1, 2).flatten(2, 3).type_as(call.q)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)
