"""Wan 2.1 and 2.2 (T2V, I2V, the A14B expert pairs and TI2V-5B): `WanAttnProcessor` of the self-attention
`attn1` split around its attention.

Wan 2.2 A14B pipelines hold two transformers of this class (`transformer`, `transformer_2`), each bound to its
own plan by `paroattn.apply`. TI2V-5B's VAE compresses space by 16 (a 2x2 patchify before the 8x VAE); every
size follows from the pipeline's `vae_scale_factor_spatial` and the transformer's `patch_size`. Its pipeline
passes a per-token timestep [B, N] (`expand_timesteps`), all equal in text-to-video; the largest is bucketed.

Sequence of `attn1`: the F x H x W video tokens only (no text). q/k RMSNorm over heads*dim before
the head split, RoPE on all tokens (passed positionally as the 5th argument; `rotate_pairs` reproduces
diffusers' function), `dispatch_attention_fn` on [B, S, H, D]. `attn2` is cross-attention to the text (+ image for I2V) and keeps its processor.
"""

from __future__ import annotations

import torch

from .base import (
    STANDARD_VAE,
    CallInputs,
    FamilyAdapter,
    PixelScale,
    RotaryTables,
    SelfAttentionCall,
    dispatch_dense,
    paired_tables,
    rotate_pairs,
    without_rotary,
)

WAN22_VAE_CHANNELS = 48


def wan_context_parallel_plan(splits: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Wan's context-parallel plan (diffusers' `_cp_plan` for Wan), for the transformers built on its blocks that
    diffusers has none for: the RoPE tables ([1, S, 1, D]) split where they are made, the token inputs `splits`
    names (module -> argument names; default the video tokens at `blocks.0`) split along the sequence, the output
    gathered after the final projection."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    rope = ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)
    tokens = ContextParallelInput(split_dim=1, expected_dims=3)
    plan = {"rope": {0: rope, 1: rope}}
    for module, names in (splits or {"blocks.0": ("hidden_states",)}).items():
        plan[module] = {name: tokens for name in names}
    plan["proj_out"] = ContextParallelOutput(gather_dim=1, expected_dims=3)
    return plan


class WanAdapter(FamilyAdapter):
    name = "wan"
    models = "Wan 2.1 / 2.2"
    transformer_classes = ("WanTransformer3DModel",)
    attention_classes = ("WanAttention",)
    self_attention_paths = (("blocks", "attn1"),)

    def __init__(self):
        self._tables = RotaryTables(paired_tables)

    def default_scale(self, transformer) -> PixelScale:
        # a bare transformer with 48 latent channels is Wan 2.2 TI2V-5B, whose VAE (z_dim 48) compresses
        # space by 16; the others are released with the Wan 2.1 VAE (8)
        if int(transformer.config.out_channels or 0) == WAN22_VAE_CHANNELS:
            return PixelScale(temporal=4, spatial=16)
        return STANDARD_VAE

    def is_self_attention(self, attn, encoder_hidden_states) -> bool:
        return encoder_hidden_states is None and not getattr(attn, "is_cross_attention", False)

    # -- per forward -------------------------------------------------------------------------
    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        _, _, frames, height, width = arguments["hidden_states"].shape  # [B, C, F, H, W]
        return CallInputs(arguments["timestep"], self.grid_layout(transformer, frames, height, width))

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        # the transformer's forward unpacks the latent shape into these names first thing
        layout = self.grid_layout(transformer, f_locals["num_frames"], f_locals["height"], f_locals["width"])
        return CallInputs(f_locals["timestep"], layout)

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
        query = rotate_pairs(call.q.transpose(1, 2), *call.rotary_emb)
        key = rotate_pairs(call.k.transpose(1, 2), *call.rotary_emb)
        return without_rotary(call, query.transpose(1, 2), key.transpose(1, 2))

    def dense(self, attn, call, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        return dispatch_dense(call, attention_mask, backend, parallel_config)

    def finish(self, attn, out, call):
        out = out.transpose(1, 2).flatten(2, 3).type_as(call.q)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)
