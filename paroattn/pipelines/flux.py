"""FLUX.1: `FluxAttnProcessor` of the 19 dual-stream and 38 single-stream blocks split around its attention.

Sequence of every block: [text (512 for dev) ; H x W packed image tokens]. Dual-stream blocks project
text and image separately (added_q/k/v) and concatenate text first; single-stream blocks receive the
concatenation already. RMSNorm(head_dim) on q/k, RoPE on the whole sequence, `dispatch_attention_fn`
on [B, S, H, D]. The transformer receives `timestep = t / 1000` and scales it by 1000 inside.
"""

from __future__ import annotations

import torch

from ..layout import TokenLayout
from .base import (
    CallInputs,
    FamilyAdapter,
    RotaryTables,
    SelfAttentionCall,
    dispatch_dense,
    float32_tables,
    without_rotary,
)


class FluxAdapter(FamilyAdapter):
    name = "flux"
    models = "FLUX.1"
    transformer_classes = ("FluxTransformer2DModel",)
    attention_classes = ("FluxAttention",)
    self_attention_paths = (("transformer_blocks", "attn"), ("single_transformer_blocks", "attn"))
    is_video = False
    text_position = "prefix"
    default_text_tokens = 512
    pack = 2  # the pipeline packs 2x2 latent pixels into one token before the transformer's own patch embedding

    def __init__(self):
        self._grid_cache: tuple[torch.Tensor, tuple[int, int] | None, str | None] | None = None
        self._tables = RotaryTables(float32_tables)  # [S, D] over the whole text + image sequence

    # -- per forward -------------------------------------------------------------------------
    def _image_grid(self, img_ids: torch.Tensor) -> tuple[tuple[int, int] | None, str | None]:
        """(rows, cols) of the image tokens from their position ids, cached per ids tensor (pipelines
        pass the same one every step; reading it syncs with the GPU)."""
        if self._grid_cache is not None and self._grid_cache[0] is img_ids:
            return self._grid_cache[1], self._grid_cache[2]
        ids = img_ids[0] if img_ids.dim() == 3 else img_ids
        count = ids.shape[0]
        first, last = ids[[0, -1]].tolist()
        rows, cols = int(last[1] - first[1]) + 1, int(last[2] - first[2]) + 1
        grid, problem = (rows, cols), None
        if rows * cols != count:
            grid, problem = None, (
                f"the {count} image tokens do not form one row-major grid (ids span {rows}x{cols}); "
                "conditioning images (Kontext, Fill) are not a supported layout"
            )
        self._grid_cache = (img_ids, grid, problem)
        return grid, problem

    def _traced_grid(self, img_ids: torch.Tensor) -> tuple[tuple[int, int] | None, str | None]:
        """(rows, cols) of the image tokens in a forward traced by torch.compile, which cannot read the ids
        (a host read): the planned grid when the token count is its rows x cols. A grid of the same count
        with other sides (a plan for 768 x 1024 on a 1024 x 768 call) is not told apart here; eager calls
        check the ids."""
        count = img_ids.shape[-2]
        planned = self.planned_layout
        if planned is not None and planned.frames == 1 and planned.height * planned.width == count:
            return (planned.height, planned.width), None
        expected = f"the plan's {planned.height}x{planned.width}" if planned is not None else "a planned grid"
        return None, (
            f"the {count} image tokens are not {expected} (under torch.compile the grid is taken from the plan, "
            "not read from img_ids; run this call without torch.compile to see its size)"
        )

    def _inputs(self, text_tokens: int, img_ids, timestep, scale: float) -> CallInputs:
        grid, problem = self._traced_grid(img_ids) if torch.compiler.is_compiling() else self._image_grid(img_ids)
        layout = TokenLayout(int(text_tokens), 1, grid[0], grid[1]) if grid else None
        return CallInputs(timestep, layout, problem, timestep_scale=scale)

    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        # the pipeline passes t / 1000; the plan's buckets live on the 0..1000 scale
        return self._inputs(arguments["encoder_hidden_states"].shape[1], arguments["img_ids"], arguments["timestep"], 1000.0)

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        # inside FluxTransformer2DModel.forward `timestep` is already multiplied by 1000
        text_tokens = f_locals["txt_ids"].shape[-2]
        return self._inputs(text_tokens, f_locals["img_ids"], f_locals["timestep"], 1.0)

    # -- per self-attention call -------------------------------------------------------------
    def qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb) -> SelfAttentionCall:
        with_text = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
            if with_text:
                text_q, text_k, text_v = attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
            if with_text:
                text_q = attn.add_q_proj(encoder_hidden_states)
                text_k = attn.add_k_proj(encoder_hidden_states)
                text_v = attn.add_v_proj(encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        text_tokens = None
        if with_text:
            text_q = attn.norm_added_q(text_q.unflatten(-1, (-1, attn.head_dim)))
            text_k = attn.norm_added_k(text_k.unflatten(-1, (-1, attn.head_dim)))
            text_v = text_v.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([text_q, query], dim=1)
            key = torch.cat([text_k, key], dim=1)
            value = torch.cat([text_v, value], dim=1)
            text_tokens = encoder_hidden_states.shape[1]
        extra = {"encoder_hidden_states": encoder_hidden_states}
        return SelfAttentionCall(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), text_tokens, extra,
            rotary_emb=image_rotary_emb, rotary=None if image_rotary_emb is None else self._tables(image_rotary_emb),
        )

    def rotate(self, call: SelfAttentionCall) -> SelfAttentionCall:
        from diffusers.models.embeddings import apply_rotary_emb

        if call.rotary_emb is None:
            return call
        query = apply_rotary_emb(call.q.transpose(1, 2), call.rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(call.k.transpose(1, 2), call.rotary_emb, sequence_dim=1)
        return without_rotary(call, query.transpose(1, 2), key.transpose(1, 2))

    def dense(self, attn, call, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        return dispatch_dense(call, attention_mask, backend, parallel_config)

    def finish(self, attn, out, call):
        out = out.transpose(1, 2).flatten(2, 3).to(call.q.dtype)
        encoder_hidden_states = call.extra["encoder_hidden_states"]
        if encoder_hidden_states is None:
            return out
        text_tokens = encoder_hidden_states.shape[1]
        text, image = out.split_with_sizes([text_tokens, out.shape[1] - text_tokens], dim=1)
        image = attn.to_out[0](image.contiguous())
        image = attn.to_out[1](image)
        text = attn.to_add_out(text.contiguous())
        return image, text
