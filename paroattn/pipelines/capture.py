"""`CaptureProcessor`: the model's own attention, which first hands each self-attention layer's q and k
to a callback (calibration's capture).

Under diffusers' Ulysses context parallelism (`context_parallel=True`) each GPU holds a chunk of the sequence
for every head; the capture exchanges q, k and v as Ulysses does (`UlyssesShard`), so each GPU hands the callback
its own slice of the heads over the whole sequence, and runs the model's attention on them before the exchange
back: the exchange the model's own attention would make, not an extra one."""

from __future__ import annotations

import dataclasses

from ..errors import PlanError
from .base import TEXT_WHOLE
from .binding import BoundProcessor
from .context_parallel import UlyssesShard, context_parallel_config, model_problem, ulysses_problem

ONE_GPU = (
    "calibration captures each head's attention over the whole sequence on one GPU; this transformer runs "
    "under diffusers' context parallelism (enable_parallelism), which gives each GPU a chunk of it: "
    "calibrate on one GPU without enable_parallelism (the plan then serves any ulysses_degree)"
)


class CaptureProcessor(BoundProcessor):
    """Dense attention, identical to the model's own, that first calls
    `callback(layer, q, k, layout, timestep, suffix_mask)` with q, k [B, H, N, D] after norms and RoPE and
    the op's `suffix_mask` of the call ([B, suffix] bool, False at padded text keys; None: none padded).

    `context_parallel`: under Ulysses over N GPUs, q and k are this GPU's slice of the H heads (rank r: heads
    r*H/N to (r+1)*H/N - 1) over the whole sequence; False: context parallelism is refused."""

    def __init__(self, callback, context_parallel: bool = False):
        super().__init__()
        self.callback = callback
        self.context_parallel = context_parallel
        self._ulysses: UlyssesShard | None = None

    def on_bind(self, binding) -> None:
        # CogVideoX's processors take no config: what enable_parallelism recorded on the model
        config = getattr(binding.transformer, "_parallel_config", None)
        self._parallel = config if context_parallel_config(config) is not None else self._parallel
        try:
            self.on_parallel_config(self._parallel)
        except Exception:
            self.unbind(binding)
            raise

    def on_parallel_config(self, config) -> None:
        self._ulysses = None
        cp_config = context_parallel_config(config)
        if cp_config is None or not self._bindings:  # bound later: `on_bind` sets it up
            return
        if not self.context_parallel:
            raise PlanError(ONE_GPU)
        binding = self._bindings[0]
        heads = binding.family.num_heads(binding.transformer)
        degree, ring = int(cp_config.ulysses_degree or 1), int(cp_config.ring_degree or 1)
        if problem := ulysses_problem(heads, degree, ring) or model_problem(binding.transformer, binding.family):
            raise PlanError(problem)
        self._ulysses = UlyssesShard(cp_config, heads, binding.family.ulysses_text)

    def begin_forward(self, binding, forward) -> None:
        if self._ulysses is not None and (problem := binding.family.ulysses_call_problem(
                binding.transformer, forward.inputs, self._ulysses.degree)):
            raise PlanError(problem)  # diffusers cannot split this call: the model's own attention would fail too

    def attend(self, binding, attn, layer, call, attention_mask):
        inputs = binding.forward.inputs
        if inputs.layout is None:
            raise PlanError(f"cannot capture attention of this call: {inputs.problem}")
        call = binding.family.rotate(call)
        suffix_mask = None
        if attention_mask is not None:  # padded text keys (HunyuanVideo): absent from the statistics as from the op
            _, suffix_mask = binding.family.suffix_mask(attention_mask, inputs.layout)
        timestep, layout, shard = inputs.timestep_1000(), inputs.layout, self._ulysses
        if shard is None:
            self.callback(layer, call.q, call.k, layout, timestep, suffix_mask)
            return self.dense(binding, attn, call, attention_mask)
        split = shard.split(layout)
        if problem := shard.local_problem(layout, call.q.shape[2], call.text_tokens):
            raise PlanError(f"layer {layer}: {problem}")
        if attention_mask is not None and binding.family.ulysses_text != TEXT_WHOLE:
            # no family makes one with a token layout (Qwen-Image's padded text has none): refused, not guessed
            raise PlanError(f"layer {layer}: under Ulysses the capture attends each GPU's heads over the whole "
                            "sequence, and this call's attention mask covers this GPU's chunk of a split text: "
                            "calibrate on one GPU")

        def attention(q, k, v, heads):
            self.callback(layer, q, k, layout, timestep, suffix_mask)
            return binding.family.dense(attn, dataclasses.replace(call, q=q, k=k, v=v), attention_mask,
                                        self._attention_backend, None)

        return shard.attend((call.q, call.k, call.v), split, attention)
