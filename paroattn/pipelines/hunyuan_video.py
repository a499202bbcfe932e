"""HunyuanVideo: `HunyuanVideoAttnProcessor2_0` of the dual-stream and single-stream blocks split around its
attention (the token refiner's attention inside `context_embedder` is text-only and keeps its processor).

Sequence of a joint-attention call: [F x H x W video ; T text], the text after the video (`TokenLayout.suffix`,
256 tokens by default, padded to that length). q/k RMSNorm over head_dim (the dual-stream blocks project and
normalize the text with their own `add_*_proj` / `norm_added_*`), RoPE on the video tokens only, then
`dispatch_attention_fn` on [B, S, H, D] with a [B, 1, 1, N] bool mask that is False at padded text keys.
PARO passes that mask's text part as the op's `suffix_mask` (None when nothing is padded; under torch.compile
always, as a traced tensor), which the Triton kernels and the reference both take, and the RoPE as tables over
the whole sequence whose text rows are the identity (cos 1, sin 0: exact).

Several GPUs: diffusers 0.42.1 has no context-parallel plan for HunyuanVideo; `context_parallel_plan` gives one that
splits the video tokens at the first block (and the RoPE with them) and leaves the text whole on every GPU (the mask
of padded text stays whole too). The dispatcher's own exchange would then repeat the text once per GPU, so PARO's
processor does the Ulysses exchange for the dense path too. The image-to-video variant that replaces the first
frame's tokens (`image_condition_type="token_replace"`) counts those tokens from the start of the sequence, which
only the first GPU holds: refused under Ulysses.
"""

from __future__ import annotations

import torch

from ..layout import TokenLayout
from .base import (
    TEXT_WHOLE,
    CallInputs,
    FamilyAdapter,
    SelfAttentionCall,
    dispatch_dense,
    without_rotary,
)


def _apply_rotary_emb(x, emb):
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, emb, sequence_dim=1)


class _SequenceTables:
    """The op's rotary tables for one forward: the video RoPE (float32 [S, D], diffusers' `apply_rotary_emb`
    convention) followed by identity rows for the text, built once per (embedding, text length): every
    block of a forward passes the same embedding tensors."""

    def __init__(self):
        self._key: tuple | None = None  # the source tensors, held so that `is` cannot match a recycled one
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, embedding, text_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = embedding
        key = (cos, sin, text_tokens)
        if torch.compiler.is_compiling() or self._key is None or any(
                a is not b for a, b in zip(key[:2], self._key[:2])) or self._key[2] != text_tokens:
            cos32, sin32 = cos.float(), sin.float()
            tables = (torch.cat([cos32, cos32.new_ones(text_tokens, cos32.shape[1])]).contiguous(),
                      torch.cat([sin32, sin32.new_zeros(text_tokens, sin32.shape[1])]).contiguous())
            if torch.compiler.is_compiling():
                return tables
            self._key, self._tables = key, tables
        return self._tables


class HunyuanVideoAdapter(FamilyAdapter):
    name = "hunyuan_video"
    models = "HunyuanVideo"
    transformer_classes = ("HunyuanVideoTransformer3DModel",)
    attention_classes = ("Attention",)
    self_attention_paths = (("transformer_blocks", "attn"), ("single_transformer_blocks", "attn"))
    text_position = "suffix"
    default_text_tokens = 256  # HunyuanVideoPipeline's max_sequence_length
    default_frames = 129
    ulysses_text = TEXT_WHOLE

    def __init__(self):
        self._tables = _SequenceTables()
        self._padding: tuple | None = None  # (attention mask, its suffix mask or None), once per forward

    # -- per forward -------------------------------------------------------------------------
    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        _, _, frames, height, width = arguments["hidden_states"].shape  # [B, C, F, H, W]
        text = arguments["encoder_hidden_states"].shape[1]  # the refiner keeps the text length
        return CallInputs(arguments["timestep"], self.grid_layout(transformer, frames, height, width, text))

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        # HunyuanVideoTransformer3DModel.forward unpacks the latent shape into these names first thing
        text = f_locals["encoder_hidden_states"].shape[1]
        layout = self.grid_layout(transformer, f_locals["num_frames"], f_locals["height"], f_locals["width"], text)
        return CallInputs(f_locals["timestep"], layout)

    # -- several GPUs ------------------------------------------------------------------------
    def context_parallel_plan(self, transformer) -> dict:
        """The video tokens split at the first block, the RoPE ([S, D] tables of the video) where it is made, the
        output gathered after the final projection; the text (and its mask) stays whole on every GPU."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        first = next(blocks for blocks, _ in self.self_attention_paths if len(getattr(transformer, blocks)))
        rope = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)
        return {
            "rope": {0: rope, 1: rope},
            f"{first}.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def ulysses_problem(self, transformer) -> str | None:
        if getattr(transformer.config, "image_condition_type", None) == "token_replace":
            return (
                f"this {type(transformer).__name__} replaces the first frame's tokens (image_condition_type="
                "'token_replace'), which its blocks count from the start of the sequence: under Ulysses only the first "
                "GPU holds them: run this model on one GPU per generation"
            )
        return None

    # -- per self-attention call -------------------------------------------------------------
    def qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb) -> SelfAttentionCall:
        text_tokens = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        dual = attn.add_q_proj is not None
        if not dual and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        query, key, value = _heads(attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v), attn.norm_q, attn.norm_k)
        if dual and encoder_hidden_states is not None:
            text_projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            text_q, text_k, text_v = _heads(attn, encoder_hidden_states, text_projections, attn.norm_added_q,
                                            attn.norm_added_k)
            query = torch.cat([query, text_q], dim=1)
            key = torch.cat([key, text_k], dim=1)
            value = torch.cat([value, text_v], dim=1)
        # [B, S, H, D] -> [B, H, S, D] views; `dense` transposes back to the very same tensors
        return SelfAttentionCall(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0,
            {"text_tokens": text_tokens, "dtype": query.dtype},
            rotary_emb=image_rotary_emb,
            rotary=None if image_rotary_emb is None else self._tables(image_rotary_emb, text_tokens),
        )

    def rotate(self, call: SelfAttentionCall) -> SelfAttentionCall:
        if call.rotary_emb is None:
            return call
        text = call.extra["text_tokens"]
        rotated = []
        for x in (call.q.transpose(1, 2), call.k.transpose(1, 2)):  # [B, S, H, D], as the processor holds them
            if text:
                x = torch.cat([_apply_rotary_emb(x[:, :-text], call.rotary_emb), x[:, -text:]], dim=1)
            else:
                x = _apply_rotary_emb(x, call.rotary_emb)
            rotated.append(x.transpose(1, 2))
        return without_rotary(call, *rotated)

    def suffix_mask(self, attention_mask: torch.Tensor, layout: TokenLayout):
        """The model's [B, 1, 1, N] key mask (False at padded text) as the op's `suffix_mask` [B, T], or None
        when no text token is padding (read on the host once per forward; kept as a tensor when traced)."""
        if attention_mask.dim() != 4 or attention_mask.shape[1:3] != (1, 1) or attention_mask.dtype != torch.bool:
            return False, None
        suffix = attention_mask[:, 0, 0, attention_mask.shape[-1] - layout.suffix:]
        if torch.compiler.is_compiling():
            return True, suffix
        if self._padding is None or self._padding[0] is not attention_mask:
            self._padding = (attention_mask, None if bool(suffix.all()) else suffix)
        return True, self._padding[1]

    def default_processor(self, attn):
        """The token refiner's processor (its attention is diffusers' legacy `Attention`, which names no default)."""
        from diffusers.models.attention_processor import AttnProcessor2_0

        return AttnProcessor2_0()

    def dense(self, attn, call, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        return dispatch_dense(call, attention_mask, backend, parallel_config)

    def finish(self, attn, out, call):
        out = out.transpose(1, 2).flatten(2, 3).to(call.extra["dtype"])
        text = call.extra["text_tokens"]
        if not text:
            return out, None
        hidden_states, encoder_hidden_states = out[:, :-text], out[:, -text:]
        if getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if getattr(attn, "to_add_out", None) is not None:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def _heads(attn, states, projections, norm_q, norm_k):
    """q, k, v [B, S, H, D] of one stream (the video's or, in dual-stream blocks, the text's): its own
    projections, then its q/k norms where the block has them."""
    query, key, value = (project(states).unflatten(2, (attn.heads, -1)) for project in projections)
    if norm_q is not None:
        query = norm_q(query)
    if norm_k is not None:
        key = norm_k(key)
    return query, key, value
