"""SkyReels-V2 (T2V, I2V and the diffusion-forcing pipelines): Wan's blocks under other names, so the Wan
adapter with `SkyReelsV2AttnProcessor`'s module.

Sequence of `attn1`: the F x H x W video tokens only, RoPE on interleaved pairs (Wan's), q/k RMSNorm over
heads*dim, `dispatch_attention_fn` on [B, S, H, D]. `attn2` is cross-attention to the text (+ image for I2V) and
keeps its processor. The diffusion-forcing pipelines pass a per-frame timestep [B, F]: the largest is bucketed
(the noisiest frame's), as for Wan 2.2's per-token timesteps.

Refused: causal (autoregressive) attention, `num_frame_per_block > 1` (`causal_block_size` of the
diffusion-forcing pipelines), which hands every self-attention a block-causal mask over frames. A plan's
per-head orders and block masks have no room for a second, token-level mask: the call gets a PlanError (or the
model's own attention with on_mismatch="dense").

Several GPUs: diffusers 0.42.1 has no context-parallel plan for SkyReels-V2; `context_parallel_plan` gives Wan's
(the video split at the first block, the RoPE with it, the output gathered after the final projection), with the
per-frame timesteps of diffusion forcing split with their frames: a GPU's chunk of the video is then whole frames
only when the GPUs divide the latent frame count, which such calls need. The cross-attention runs on each GPU's
own queries against the whole text (`after_enable_parallelism`).
"""

from __future__ import annotations

import torch

from .base import CallInputs
from .wan import WanAdapter, wan_context_parallel_plan


class SkyReelsV2Adapter(WanAdapter):
    name = "skyreels_v2"
    models = "SkyReels-V2"
    transformer_classes = ("SkyReelsV2Transformer3DModel",)
    attention_classes = ("SkyReelsV2Attention",)
    self_attention_paths = (("blocks", "attn1"),)

    @staticmethod
    def _causal_problem(transformer) -> str | None:
        block = int(getattr(transformer.config, "num_frame_per_block", 1) or 1)
        if block <= 1:
            return None
        return (
            f"this SkyReels-V2 transformer attends causally over blocks of {block} frames (num_frame_per_block={block}, "
            "the diffusion-forcing pipeline's causal_block_size): a PARO plan cannot add that mask to its block-sparse "
            "one; run without causal_block_size (full attention over the frames)"
        )

    def _checked(self, transformer, inputs: CallInputs) -> CallInputs:
        problem = self._causal_problem(transformer)
        return inputs if problem is None else CallInputs(inputs.timestep, None, problem)

    def call_inputs(self, transformer, arguments: dict) -> CallInputs:
        return self._checked(transformer, super().call_inputs(transformer, arguments))

    def call_inputs_from_locals(self, transformer, f_locals: dict) -> CallInputs:
        return self._checked(transformer, super().call_inputs_from_locals(transformer, f_locals))

    # -- several GPUs ------------------------------------------------------------------------
    def context_parallel_plan(self, transformer) -> dict:
        from diffusers.models._modeling_parallel import ContextParallelInput

        plan = wan_context_parallel_plan()
        # diffusion forcing's timesteps [B, F] (one per latent frame) split with the frames; [B] ones are left whole
        plan[""] = {"timestep": ContextParallelInput(split_dim=1, expected_dims=2)}
        return plan

    def after_enable_parallelism(self, transformer) -> None:
        # diffusers' SkyReels-V2 processor hands its parallel config to the cross-attention too (Wan's hands it None
        # there), so every GPU's copy of the whole text would be gathered as keys: N copies of each text token, the
        # same result up to rounding for N times the work and an exchange per layer. Each GPU attends its own
        # queries to the text instead, as under Wan.
        for block in transformer.blocks:
            if hasattr(block.attn2.processor, "_parallel_config"):
                block.attn2.processor._parallel_config = None

    def ulysses_call_problem(self, transformer, inputs: CallInputs, degree: int) -> str | None:
        timestep, layout = inputs.timestep, inputs.layout
        if not isinstance(timestep, torch.Tensor) or timestep.dim() != 2 or layout is None or layout.frames % degree == 0:
            return None
        return (
            f"this call has a timestep per latent frame (diffusion forcing), which Ulysses splits with the frames: "
            f"its {layout.frames} latent frames must be divisible by ulysses_degree={degree}; pick a frame count "
            f"whose latent frames {degree} divides, or another ulysses_degree"
        )
