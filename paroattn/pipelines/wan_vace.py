"""Wan VACE (video editing, control and reference-to-video on Wan 2.1): the Wan adapter over both stacks of
`WanVACETransformer3DModel`, its 40 (14B) or 30 (1.3B) Wan blocks and its 8 (15) VACE blocks.

Every VACE block runs self-attention (`attn1`) over the control tokens, which the model pads to the video's token
count: the same F x H x W layout and RoPE as the main blocks, so PARO takes both. Plan layer order: the main
blocks, then the VACE blocks. `attn2` of each is cross-attention to the text and keeps its processor.

Reference images enter as whole latent frames before the video's (the pipeline adds one per image), so the grid
is (latent frames + reference images) x H x W in the usual row-major order: another number of reference images is
another frame count, whose masks a plan derives as for any other size.

Several GPUs: diffusers 0.42.1 has no context-parallel plan for Wan VACE; `context_parallel_plan` gives Wan's with
the control tokens split like the video at the first VACE block (both stacks then run on each GPU's chunk, and the
VACE blocks' hints add to the main blocks' chunk of the same tokens).
"""

from __future__ import annotations

from .wan import WanAdapter, wan_context_parallel_plan


class WanVACEAdapter(WanAdapter):
    name = "wan_vace"
    models = "Wan VACE"
    transformer_classes = ("WanVACETransformer3DModel",)
    attention_classes = ("WanAttention",)
    self_attention_paths = (("blocks", "attn1"), ("vace_blocks", "attn1"))

    def context_parallel_plan(self, transformer) -> dict:
        # the VACE blocks run first: the first one takes the video tokens (added to its projected control tokens)
        return wan_context_parallel_plan({"vace_blocks.0": ("hidden_states", "control_hidden_states"),
                                          "blocks.0": ("hidden_states",)})
