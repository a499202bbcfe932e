"""LTX-2 (audio and video): `LTX2AudioVideoAttnProcessor` of the video self-attention `attn1` of its 48 blocks split
around its attention.

Sequence of `attn1`: the F x H x W video tokens only, packed row-major (patch size 1), as LTX-Video's. q/k RMSNorm
over heads*dim, RoPE over heads*dim as well (each head its own frequencies, on interleaved pairs or, with
`rope_type="split"`, on the two halves of each head), so the adapter applies the model's own RoPE before the op;
with `gated_attn` each head's output is scaled by the model's gate. The timestep is per video token ([B, N] in
image-to-video, 0 at the conditioning frame): the largest is bucketed.

Left alone (their own processors): the audio self-attention `audio_attn1` (a 1-D sequence of audio frames, not a
video grid that per-head 3-D orders describe), the text cross-attention of each stream (`attn2`, `audio_attn2`) and
the cross-modal `audio_to_video_attn` / `video_to_audio_attn` (queries of one stream, keys of the other: no square
self-attention map for a block mask). The audio stream therefore runs dense.

Refused: a video self-attention mask (`video_self_attention_mask`), and video tokens that are not the grid named by
`num_frames`, `height` and `width` (keyframe tokens appended after the video): PlanError, or the model's own
attention with on_mismatch="dense". Models with `perturbed_attn` (LTX-2.3's spatio-temporal guidance hands the
self-attention a perturbation mask through arguments a PARO processor does not take) are refused when the plan is
applied. Under diffusers' context parallelism (its plan splits the video tokens and their RoPE at the entry, as
LTX-Video's) PARO runs with Ulysses.
"""

from __future__ import annotations

import torch

from .base import CallInputs, PixelScale, SelfAttentionCall, dispatch_dense
from .ltx import LTXVideoAdapter


def _apply_rotary(attn, x: torch.Tensor, emb) -> torch.Tensor:
    from diffusers.models.transformers import transformer_ltx2

    if attn.rope_type == "split":
        return transformer_ltx2.apply_split_rotary_emb(x, emb)
    return transformer_ltx2.apply_interleaved_rotary_emb(x, emb)


class LTX2Adapter(LTXVideoAdapter):
    name = "ltx2"
    models = "LTX-2"
    transformer_classes = ("LTX2VideoTransformer3DModel",)
    attention_classes = ("LTX2Attention",)
    self_attention_paths = (("transformer_blocks", "attn1"),)
    default_frames = 121

    def default_scale(self, transformer) -> PixelScale:
        temporal, spatial, _ = (int(f) for f in transformer.config.vae_scale_factors)
        return PixelScale(temporal=temporal, spatial=spatial)

    def self_attention_layers(self, transformer) -> list[str]:
        if getattr(transformer.config, "perturbed_attn", False):
            from ..errors import PlanError

            raise PlanError(
                f"{type(transformer).__name__} with perturbed_attn=True (LTX-2.3) hands its video self-attention a "
                "spatio-temporal guidance perturbation through arguments a PARO processor does not take, so PARO "
                "would drop it: not supported; run this model without paroattn"
            )
        return super().self_attention_layers(transformer)

    # -- per forward -------------------------------------------------------------------------
    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        if arguments.get("video_self_attention_mask") is not None:
            return CallInputs(arguments["timestep"], None, (
                "the call masks the video self-attention (video_self_attention_mask), which a PARO plan's block masks "
                "cannot add to; run such calls with the model's own attention (on_mismatch='dense')"))
        return super().call_inputs(transformer, arguments)

    # -- per self-attention call -------------------------------------------------------------
    def qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb) -> SelfAttentionCall:
        # `image_rotary_emb` is the query_rotary_emb the module passes fifth; self-attention has no key_rotary_emb
        gates = None if attn.to_gate_logits is None else 2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(hidden_states))
        value = attn.to_v(hidden_states)
        if image_rotary_emb is not None:  # per-head frequencies: applied here, as the model does (module docstring)
            query = _apply_rotary(attn, query, image_rotary_emb)
            key = _apply_rotary(attn, key, image_rotary_emb)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        return SelfAttentionCall(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0,
                                 {"dtype": query.dtype, "gates": gates})

    def dense(self, attn, call, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        if attention_mask is not None:  # the model's processor: the additive mask per head
            batch, sequence = call.q.shape[0], call.q.shape[2]
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        return dispatch_dense(call, attention_mask, backend, parallel_config)

    def finish(self, attn, out, call):
        out = out.transpose(1, 2).to(call.extra["dtype"])  # [B, S, H, D]
        if call.extra["gates"] is not None:
            out = out * call.extra["gates"].unsqueeze(-1)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))
