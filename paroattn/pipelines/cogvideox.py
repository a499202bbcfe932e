"""CogVideoX (2b, 5b, 1.5 with temporal patching): `CogVideoXAttnProcessor2_0` split around its attention.

Sequence of a self-attention call: [text ; F x H x W video], text first (226 tokens at full size),
q/k LayerNorm over head_dim on all tokens, RoPE on the video part only, SDPA on [B, H, S, D].
The legacy `Attention.forward` passes `image_rotary_emb` as a keyword filtered by the processor's
signature, so processors declare it explicitly.

Several GPUs: diffusers 0.42.1 has no context-parallel plan for CogVideoX; `context_parallel_plan` gives one that
splits the video tokens at the first block (and the RoPE tables with them) and leaves the text whole on every GPU.
The processor calls SDPA directly, so PARO's processor does the Ulysses exchange for the dense path too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout import TokenLayout
from .base import (
    STANDARD_VAE,
    TEXT_WHOLE,
    CallInputs,
    FamilyAdapter,
    PixelScale,
    RotaryTables,
    SelfAttentionCall,
    float32_tables,
    without_rotary,
)


def _apply_rotary_emb(x, emb):
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, emb)


class CogVideoXAdapter(FamilyAdapter):
    name = "cogvideox"
    models = "CogVideoX"
    transformer_classes = ("CogVideoXTransformer3DModel",)
    attention_classes = ("Attention",)
    self_attention_paths = (("transformer_blocks", "attn1"),)
    text_position = "prefix"
    ulysses_text = TEXT_WHOLE

    def __init__(self):
        self._tables = RotaryTables(float32_tables)  # [S_video, D]: the video tokens after the text

    # -- per forward -------------------------------------------------------------------------
    def _layout(self, transformer, text_tokens: int, latent_frames: int, latent_height: int, latent_width: int):
        p = int(transformer.config.patch_size)
        pt = transformer.config.patch_size_t
        if pt and latent_frames % pt:
            return None, (
                f"{latent_frames} latent frames are not a multiple of patch_size_t={pt} "
                "(the CogVideoX pipeline pads them; pass latents as the pipeline does)"
            )
        frames = latent_frames // pt if pt else latent_frames
        return TokenLayout(int(text_tokens), int(frames), int(latent_height) // p, int(latent_width) // p), None

    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        latents = arguments["hidden_states"]  # [B, F, C, H, W]
        text = arguments["encoder_hidden_states"]  # [B, T, D]
        _, frames, _, height, width = latents.shape
        layout, problem = self._layout(transformer, text.shape[1], frames, height, width)
        return CallInputs(arguments["timestep"], layout, problem)

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        # CogVideoXTransformer3DModel.forward unpacks the latent shape into these names first thing
        text_tokens = f_locals.get("text_seq_length", f_locals["encoder_hidden_states"].shape[1])
        layout, problem = self._layout(
            transformer, text_tokens, f_locals["num_frames"], f_locals["height"], f_locals["width"]
        )
        return CallInputs(f_locals["timestep"], layout, problem)

    def context_parallel_plan(self, transformer) -> dict:
        """The video tokens split at the first block, the RoPE tables (the video's, [S, D]) at the entry, the
        output gathered after the final projection; the text stays whole on every GPU."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        rope = ContextParallelInput(split_dim=0, expected_dims=2)
        return {
            "": {"image_rotary_emb": [rope, rope]},
            "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    # -- geometry ----------------------------------------------------------------------------
    def layout_for(self, transformer, *, height, width, frames=None, text_tokens=None,
                   scale: PixelScale = STANDARD_VAE) -> TokenLayout:
        config = transformer.config
        if frames is None:
            frames = int(config.sample_frames)
        latent_frames = (int(frames) - 1) // scale.temporal + 1
        pt = config.patch_size_t
        if pt:
            latent_frames = -(-latent_frames // pt) * pt  # the pipeline pads to a multiple of patch_size_t
        text = int(config.max_text_seq_length) if text_tokens is None else int(text_tokens)
        layout, problem = self._layout(transformer, text, latent_frames, height // scale.spatial, width // scale.spatial)
        if layout is None:
            raise ValueError(problem)
        return layout

    def pixel_size(self, transformer, layout: TokenLayout, scale: PixelScale = STANDARD_VAE) -> dict[str, int]:
        p = int(transformer.config.patch_size)
        pt = transformer.config.patch_size_t or 1
        # smallest frame count whose padded latent frames give layout.frames patches
        frames = (layout.frames - 1) * pt * scale.temporal + 1
        return {"frames": frames, "height": layout.height * p * scale.spatial, "width": layout.width * p * scale.spatial}

    # -- per self-attention call -------------------------------------------------------------
    def qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb) -> SelfAttentionCall:
        text_tokens = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch, _, _ = hidden_states.shape
        if getattr(attn, "fused_projections", False) and hasattr(attn, "to_qkv"):
            qkv = attn.to_qkv(hidden_states)
            query, key, value = torch.split(qkv, qkv.shape[-1] // 3, dim=-1)
        else:
            query = attn.to_q(hidden_states)
            key = attn.to_k(hidden_states)
            value = attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None and attn.is_cross_attention:
            # the default processor rotates q alone here (not a self-attention call PARO would run)
            query[:, :, text_tokens:] = _apply_rotary_emb(query[:, :, text_tokens:], image_rotary_emb)
            image_rotary_emb = None
        return SelfAttentionCall(
            query, key, value, text_tokens, {"batch": batch, "head_dim": head_dim}, rotary_emb=image_rotary_emb,
            rotary=None if image_rotary_emb is None else self._tables(image_rotary_emb),
        )

    def rotate(self, call: SelfAttentionCall) -> SelfAttentionCall:
        if call.rotary_emb is None:
            return call
        text_tokens, query, key = call.text_tokens, call.q, call.k
        query[:, :, text_tokens:] = _apply_rotary_emb(query[:, :, text_tokens:], call.rotary_emb)
        key[:, :, text_tokens:] = _apply_rotary_emb(key[:, :, text_tokens:], call.rotary_emb)
        return without_rotary(call, query, key)

    def dense(self, attn, call, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        if attention_mask is not None:
            batch, sequence = call.q.shape[0], call.q.shape[2]
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        return F.scaled_dot_product_attention(
            call.q, call.k, call.v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )

    def finish(self, attn, out, call):
        batch, head_dim = call.extra["batch"], call.extra["head_dim"]
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)
        out = attn.to_out[0](out)
        out = attn.to_out[1](out)
        text, video = out.split([call.text_tokens, out.size(1) - call.text_tokens], dim=1)
        return video, text
