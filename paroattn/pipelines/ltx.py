"""LTX-Video (0.9.x): `LTXVideoAttnProcessor` of the self-attention `attn1` of its 28 blocks split around its attention.

Sequence of `attn1`: the F x H x W video tokens only (the pipeline packs the latents row-major, patch size 1), no
text; `attn2` is cross-attention to the text and keeps its processor. q/k RMSNorm over heads*dim before the head
split. LTX's RoPE also spans heads*dim: cos/sin [B, S, heads*dim] give each head its own slice of frequencies,
which the op's tables (one [S, D] for every head) cannot hold, so the adapter applies the model's own RoPE before
the op (`qkv` returns q and k rotated; fuse_rope has nothing to fuse). The image-to-video and condition pipelines
pass a per-token timestep [B, N] (0 at conditioning frames): the largest is bucketed.

The VAE compresses space by 32 and time by 8. Refused: calls whose tokens are not the F x H x W grid that the
transformer's `num_frames`, `height` and `width` arguments name (conditioning tokens appended after the video, as
LTXConditionPipeline adds for keyframes). Under diffusers' context parallelism (its plan splits the video tokens
and the RoPE alike at the transformer's entry, as Wan's) PARO runs with Ulysses.
"""

from __future__ import annotations

import torch

from ..layout import TokenLayout
from .base import CallInputs, FamilyAdapter, PixelScale, SelfAttentionCall, dispatch_dense


def _apply_rotary(x: torch.Tensor, emb) -> torch.Tensor:
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

    return apply_rotary_emb(x, emb)


class LTXVideoAdapter(FamilyAdapter):
    name = "ltx"
    models = "LTX-Video"
    transformer_classes = ("LTXVideoTransformer3DModel",)
    attention_classes = ("LTXAttention",)
    self_attention_paths = (("transformer_blocks", "attn1"),)
    default_frames = 161

    def default_scale(self, transformer) -> PixelScale:
        return PixelScale(temporal=8, spatial=32)

    def is_self_attention(self, attn, encoder_hidden_states) -> bool:
        return encoder_hidden_states is None

    # -- per forward -------------------------------------------------------------------------
    def _inputs(self, tokens: int, frames, height, width, timestep) -> CallInputs:
        if frames is None or height is None or width is None:
            return CallInputs(timestep, None, "the call does not name num_frames, height and width (the pipeline does)")
        layout = TokenLayout(0, int(frames), int(height), int(width))
        if layout.seq_len != tokens:
            return CallInputs(timestep, None, (
                f"the call has {tokens} video tokens, not the {layout.frames}x{layout.height}x{layout.width} grid its "
                "num_frames, height and width name (conditioning tokens after the video?): a layout a PARO plan "
                "cannot express; run such calls with the model's own attention (on_mismatch='dense')"))
        return CallInputs(timestep, layout)

    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        return self._inputs(arguments["hidden_states"].shape[1], arguments.get("num_frames"), arguments.get("height"),
                            arguments.get("width"), arguments["timestep"])

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        return self._inputs(f_locals["hidden_states"].shape[1], f_locals.get("num_frames"), f_locals.get("height"),
                            f_locals.get("width"), f_locals["timestep"])

    # -- per self-attention call -------------------------------------------------------------
    def qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb) -> SelfAttentionCall:
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(hidden_states))
        value = attn.to_v(hidden_states)
        if image_rotary_emb is not None:  # per-head frequencies: applied here, as the model does (module docstring)
            query = _apply_rotary(query, image_rotary_emb)
            key = _apply_rotary(key, image_rotary_emb)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        # [B, S, H, D] -> [B, H, S, D] views; `dense` transposes back to the very same tensors
        return SelfAttentionCall(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0,
                                 {"dtype": query.dtype})

    def rotate(self, call: SelfAttentionCall) -> SelfAttentionCall:
        return call  # `qkv` applied the RoPE

    def dense(self, attn, call, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        return dispatch_dense(call, attention_mask, backend, parallel_config)

    def finish(self, attn, out, call):
        out = out.transpose(1, 2).flatten(2, 3).to(call.extra["dtype"])
        return attn.to_out[1](attn.to_out[0](out))
