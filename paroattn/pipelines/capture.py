"""`CaptureProcessor`: the model's own attention, which first hands each self-attention layer's q and k
to a callback (calibration's capture)."""

from __future__ import annotations

from ..errors import PlanError
from .binding import BoundProcessor
from .context_parallel import context_parallel_config


class CaptureProcessor(BoundProcessor):
    """Dense attention, identical to the model's own, that first calls
    `callback(layer, q, k, layout, timestep, suffix_mask)` with q, k [B, H, N, D] after norms and RoPE and
    the op's `suffix_mask` of the call ([B, suffix] bool, False at padded text keys; None: none padded)."""

    def __init__(self, callback):
        super().__init__()
        self.callback = callback

    def on_parallel_config(self, config) -> None:
        if context_parallel_config(config) is not None:
            raise PlanError(
                "calibration captures each head's attention over the whole sequence on one GPU; this transformer runs "
                "under diffusers' context parallelism (enable_parallelism), which gives each GPU a chunk of it: "
                "calibrate on one GPU without enable_parallelism (the plan then serves any ulysses_degree)"
            )

    def attend(self, binding, attn, layer, call, attention_mask):
        inputs = binding.forward.inputs
        if inputs.layout is None:
            raise PlanError(f"cannot capture attention of this call: {inputs.problem}")
        call = binding.family.rotate(call)
        suffix_mask = None
        if attention_mask is not None:  # padded text keys (HunyuanVideo): absent from the statistics as from the op
            _, suffix_mask = binding.family.suffix_mask(attention_mask, inputs.layout)
        self.callback(layer, call.q, call.k, inputs.layout, inputs.timestep_1000(), suffix_mask)
        return self.dense(binding, attn, call, attention_mask)
