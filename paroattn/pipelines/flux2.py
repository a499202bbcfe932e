"""FLUX.2 (dev and Klein): `Flux2AttnProcessor` of the 8 dual-stream blocks and `Flux2ParallelSelfAttnProcessor`
of the 48 single-stream blocks split around their attention.

Sequence of every block: [text (512 for dev, padded to that length) ; H x W packed image tokens], as FLUX.1's.
The dual-stream blocks project and normalize text and image separately and concatenate text first; the
single-stream blocks receive the concatenation and compute q, k, v together with their MLP input in one fused
projection (`to_qkv_mlp_proj`), and one output projection takes the attention and MLP outputs side by side.
Their attention module passes (hidden_states, attention_mask, image_rotary_emb) positionally, which `arguments`
puts back in the common order. RMSNorm(head_dim) on q/k, RoPE over the whole sequence on interleaved pairs
(4 axes: time, rows, columns, text position), `dispatch_attention_fn` on [B, S, H, D]. The pipeline passes
`timestep = t / 1000`. Every attention module is self-attention over the joint sequence: PARO takes all of them.

Refused (PlanError, or the model's own attention with on_mismatch="dense"): image-conditioned calls, whose
reference images' tokens follow the target's grid (time coordinates 10, 20, ... in img_ids), and the reference
KV cache (`kv_cache_mode`, `num_ref_tokens`), which attends to keys outside the call's sequence. Under diffusers'
context parallelism (its plan splits text and image tokens separately, as FLUX.1's) PARO runs with Ulysses.
"""

from __future__ import annotations

import torch

from .base import CallInputs, SelfAttentionCall
from .flux import FluxAdapter


def _single_stream(attn) -> bool:
    return hasattr(attn, "to_qkv_mlp_proj")


class Flux2Adapter(FluxAdapter):
    name = "flux2"
    models = "FLUX.2"
    transformer_classes = ("Flux2Transformer2DModel",)
    attention_classes = ("Flux2Attention", "Flux2ParallelSelfAttention")

    # -- per forward -------------------------------------------------------------------------
    def _image_grid(self, img_ids: torch.Tensor):
        if self._grid_cache is not None and self._grid_cache[0] is img_ids:
            return self._grid_cache[1], self._grid_cache[2]
        ids = img_ids[0] if img_ids.dim() == 3 else img_ids
        times = ids[:, 0].unique().tolist()
        if len(times) > 1:
            problem = (
                f"the image tokens hold {len(times) - 1} reference image(s) after the target (time coordinates "
                f"{times[1:]} in img_ids): a layout a PARO plan cannot express; run image-conditioned calls with the "
                "model's own attention (on_mismatch='dense')"
            )
            self._grid_cache = (img_ids, None, problem)
            return None, problem
        return super()._image_grid(img_ids)

    @staticmethod
    def _cache_problem(values: dict) -> str | None:
        if values.get("kv_cache_mode") is None and not values.get("num_ref_tokens"):
            return None
        return (
            "this call uses FLUX.2's reference KV cache (kv_cache_mode / num_ref_tokens): its attention reaches keys "
            "outside the call's [text ; image] sequence, which a PARO plan does not cover; run it with the model's "
            "own attention (on_mismatch='dense')"
        )

    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        if problem := self._cache_problem(arguments):
            return CallInputs(arguments["timestep"], None, problem, timestep_scale=1000.0)
        return super().call_inputs(transformer, arguments)

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        if problem := self._cache_problem(f_locals):
            return CallInputs(f_locals["timestep"], None, problem)
        return super().call_inputs_from_locals(transformer, f_locals)

    # -- per self-attention call -------------------------------------------------------------
    def arguments(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                  encoder_hidden_states_mask=None):
        if _single_stream(attn):  # called as processor(attn, hidden_states, attention_mask, image_rotary_emb)
            return hidden_states, None, encoder_hidden_states, attention_mask
        return hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb

    def qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb) -> SelfAttentionCall:
        if not _single_stream(attn):
            return super().qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        local_qkv = projected.shape[-1] * qkv_dim // (qkv_dim + attn.mlp_hidden_dim * attn.mlp_mult_factor)
        qkv, mlp = torch.split(projected, [local_qkv, projected.shape[-1] - local_qkv], dim=-1)
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in qkv.chunk(3, dim=-1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        return SelfAttentionCall(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, {"mlp": mlp},
            rotary_emb=image_rotary_emb, rotary=None if image_rotary_emb is None else self._tables(image_rotary_emb),
        )

    def finish(self, attn, out, call):
        if not _single_stream(attn):
            return super().finish(attn, out, call)
        out = out.transpose(1, 2).flatten(2, 3).to(call.q.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(call.extra["mlp"])], dim=-1))
