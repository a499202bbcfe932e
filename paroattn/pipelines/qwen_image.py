"""Qwen-Image: `QwenDoubleStreamAttnProcessor2_0` of its 60 dual-stream blocks split around its attention.

Sequence of every block: [T text ; H x W image tokens], text first. Each stream has its own projections and q/k
RMSNorm(head_dim) (`add_*_proj`, `norm_added_*` for the text), RoPE on both (complex frequencies multiplied into
interleaved pairs: the image's from `img_shapes`, the text's continuing after the image's largest position),
`dispatch_attention_fn` on [B, S, H, D]. The pipeline packs 2x2 latents into one token (`patch_size` 2) and passes
`timestep = t / 1000`. There is no text-only or cross-attention module: PARO takes every block.

T is the prompt's own token count: the pipeline does not pad a prompt to a fixed length (it only truncates at
`max_sequence_length`), so each prompt length is a layout of its own, whose masks a plan derives from its axis
profiles as it does for another size (`paro generate` leaves max_sequence_length alone: `pads_text`).

Refused (PlanError, or the model's own attention with on_mismatch="dense"): prompts of different lengths in one
batch, whose padding (`encoder_hidden_states_mask`) sits in the text before the image, where the op's key mask
(padding after the grid only) cannot reach; and image-conditioned calls (Qwen-Image-Edit, several images per
sample in `img_shapes`, or layered images), whose extra image tokens follow the target's grid. Under diffusers'
context parallelism (its plan splits text and image tokens separately, as FLUX's) PARO runs with Ulysses.
"""

from __future__ import annotations

import torch

from ..layout import TokenLayout
from .base import (
    CallInputs,
    FamilyAdapter,
    RotaryTables,
    SelfAttentionCall,
    complex_tables,
    dispatch_dense,
    without_rotary,
)


def _joint_tables(image_freqs: torch.Tensor, text_freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's tables over [text ; image] from the model's complex frequencies of each stream."""
    text_cos, text_sin = complex_tables(text_freqs)
    image_cos, image_sin = complex_tables(image_freqs)
    return torch.cat([text_cos, image_cos]).contiguous(), torch.cat([text_sin, image_sin]).contiguous()


def _apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    return apply_rotary_emb_qwen(x, freqs, use_real=False)


class QwenImageAdapter(FamilyAdapter):
    name = "qwen_image"
    models = "Qwen-Image"
    transformer_classes = ("QwenImageTransformer2DModel",)
    attention_classes = ("Attention",)
    self_attention_paths = (("transformer_blocks", "attn"),)
    is_video = False
    text_position = "prefix"
    default_text_tokens = 64  # a layout_for without text_tokens: the pipeline's text length follows the prompt
    pads_text = False

    def __init__(self):
        self._tables = RotaryTables(_joint_tables)
        self._masks: tuple | None = None  # (text mask, its joint attention mask or None when nothing is padded)

    # -- per forward -------------------------------------------------------------------------
    @staticmethod
    def _grid(img_shapes) -> tuple[tuple[int, int] | None, str | None]:
        if img_shapes is None:
            return None, "the call has no img_shapes (the pipeline passes the image's (frames, rows, cols))"
        samples = [img_shapes] if isinstance(img_shapes, tuple) else list(img_shapes)
        shapes = {tuple(tuple(int(n) for n in s) for s in ([sample] if isinstance(sample, tuple) else sample))
                  for sample in samples}
        if len(shapes) != 1:
            return None, f"the batch's images differ in size ({sorted(shapes)}); PARO runs one layout per call"
        shape = shapes.pop()
        if len(shape) != 1 or shape[0][0] != 1:
            return None, (
                f"img_shapes {list(shape)} holds more than one image per sample (Qwen-Image-Edit's reference images, "
                "or layered images): their tokens follow the target's grid, a layout a PARO plan cannot express; "
                "run these calls with the model's own attention (on_mismatch='dense')"
            )
        return (shape[0][1], shape[0][2]), None

    def _padding_problem(self, text_mask) -> str | None:
        if text_mask is None or torch.compiler.is_compiling() or bool(text_mask.all()):
            return None
        return (
            "the batch's prompts have different lengths, so the text is padded before the image "
            "(encoder_hidden_states_mask); PARO's op masks padded keys after the grid only: generate one prompt "
            "per call, or prompts of one token count"
        )

    def _inputs(self, text_tokens: int, img_shapes, text_mask, timestep) -> CallInputs:
        grid, problem = self._grid(img_shapes)
        problem = problem or self._padding_problem(text_mask)
        layout = TokenLayout(int(text_tokens), 1, grid[0], grid[1]) if problem is None else None
        # the pipeline passes t / 1000; the model's timestep projection scales it back by 1000
        return CallInputs(timestep, layout, problem, timestep_scale=1000.0)

    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        return self._inputs(arguments["encoder_hidden_states"].shape[1], arguments.get("img_shapes"),
                            arguments.get("encoder_hidden_states_mask"), arguments["timestep"])

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        return self._inputs(f_locals["encoder_hidden_states"].shape[1], f_locals.get("img_shapes"),
                            f_locals.get("encoder_hidden_states_mask"), f_locals["timestep"])

    # -- per self-attention call -------------------------------------------------------------
    def arguments(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                  encoder_hidden_states_mask=None):
        """The text mask as the joint [B, 1, 1, T + N] key mask the model's processor builds (None when no text
        token is padding; read once per mask tensor)."""
        if encoder_hidden_states_mask is None or attention_mask is not None:
            return hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
        if self._masks is None or self._masks[0] is not encoder_hidden_states_mask:
            mask = encoder_hidden_states_mask.bool()
            joint = None
            if not bool(mask.all()):
                image = mask.new_ones(mask.shape[0], hidden_states.shape[1])
                joint = torch.cat([mask, image], dim=1)[:, None, None, :]
            self._masks = (encoder_hidden_states_mask, joint)
        return hidden_states, encoder_hidden_states, self._masks[1], image_rotary_emb

    def qkv(self, attn, hidden_states, encoder_hidden_states, image_rotary_emb) -> SelfAttentionCall:
        head_dim = attn.inner_dim // attn.heads
        streams = []
        for states, projections, norms in (
                (encoder_hidden_states, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
                 (attn.norm_added_q, attn.norm_added_k)),
                (hidden_states, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))):
            q, k, v = (project(states).unflatten(-1, (-1, head_dim)) for project in projections)
            q = norms[0](q) if norms[0] is not None else q
            k = norms[1](k) if norms[1] is not None else k
            streams.append((q, k, v))
        (text_q, text_k, text_v), (image_q, image_k, image_v) = streams
        query = torch.cat([text_q, image_q], dim=1)
        key = torch.cat([text_k, image_k], dim=1)
        value = torch.cat([text_v, image_v], dim=1)
        text_tokens = encoder_hidden_states.shape[1]
        return SelfAttentionCall(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), text_tokens, {"dtype": query.dtype},
            rotary_emb=image_rotary_emb,
            rotary=None if image_rotary_emb is None else self._tables(image_rotary_emb),
        )

    def rotate(self, call: SelfAttentionCall) -> SelfAttentionCall:
        if call.rotary_emb is None:
            return call
        image_freqs, text_freqs = call.rotary_emb
        text = call.text_tokens
        rotated = []
        for x in (call.q.transpose(1, 2), call.k.transpose(1, 2)):  # [B, S, H, D], as the processor holds them
            x = torch.cat([_apply_rotary(x[:, :text], text_freqs), _apply_rotary(x[:, text:], image_freqs)], dim=1)
            rotated.append(x.transpose(1, 2))
        return without_rotary(call, *rotated)

    def suffix_mask(self, attention_mask: torch.Tensor, layout: TokenLayout):
        # only a padded text makes a mask here, and it pads before the grid: the model's attention runs such calls
        return False, None

    def dense(self, attn, call, attention_mask, backend=None, parallel_config=None) -> torch.Tensor:
        return dispatch_dense(call, attention_mask, backend, parallel_config)

    def finish(self, attn, out, call):
        out = out.transpose(1, 2).flatten(2, 3).to(call.extra["dtype"])
        text = call.text_tokens
        text_out, image_out = out[:, :text], out[:, text:]
        image_out = attn.to_out[0](image_out.contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(text_out.contiguous())
