"""Attention processors: `PAROProcessor` (plan-driven sparse attention) and `CaptureProcessor` (dense,
hands q and k to a callback for calibration). One processor instance serves every layer of a
transformer: it binds to the transformer once, maps each attention module to its plan layer, and
installs a forward pre-hook that tells it the timestep and token layout of the current call.

Binding happens in `paroattn.apply` / `capture_attention`, or lazily on the first call when a lone
instance was installed with `transformer.set_attn_processor(PAROProcessor(plan))`: diffusers passes
the attention module as the first argument, and the processor finds the transformer whose forward
is running by walking up the Python frames (once). That first forward's timestep and layout are
read from the transformer's frame; later forwards go through the pre-hook.
"""

from __future__ import annotations

import sys
import warnings
import weakref

import torch

from ..attention import BACKENDS, paro_attention
from ..errors import PlanError
from ..plan import Plan, model_fingerprint
from .base import STANDARD_VAE, CallInputs, FamilyAdapter, PixelScale, SelfAttentionCall
from .prefetch import MaskStore
from .registry import family_of, require_family
from .timesteps import ForwardTracker

ON_MISMATCH = ("error", "dense")


class Binding:
    """One processor bound to one transformer: its layers, the current call, and (PARO) its masks."""

    def __init__(self, processor: _BoundProcessor, transformer, family: FamilyAdapter):
        self.processor = processor
        self.family = family
        self.transformer_ref = weakref.ref(transformer)
        self.keys = family.self_attention_layers(transformer)
        self.modules = [transformer.get_submodule(key[: -len(".processor")]) for key in self.keys]
        self.transformer_class = type(transformer).__name__
        self.static_problem: str | None = None
        self.inputs: CallInputs | None = None
        self.bucket = 0
        self.call_problem: str | None = None
        self.masks: MaskStore | None = None
        self.orders_device: torch.Tensor | None = None
        self.warned: set[str] = set()
        self.delegates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.tracker = ForwardTracker(transformer, family, on_call=self._on_call)

    @property
    def transformer(self):
        return self.transformer_ref()

    def installed(self) -> bool:
        """Whether the processor still serves this transformer's first self-attention layer."""
        return bool(self.modules) and self.modules[0].processor is self.processor

    def _on_call(self, inputs: CallInputs) -> None:
        self.inputs = inputs
        if self.installed():
            self.processor.begin_forward(self, inputs)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, stacklevel=3)

    def delegate(self, attn):
        """The module's default processor, for attention a PAROProcessor does not handle (Wan attn2)."""
        processor = self.delegates.get(attn)
        if processor is None:
            processor = self.family.default_processor(attn)
            for name in ("_attention_backend", "_parallel_config"):
                if hasattr(processor, name):
                    setattr(processor, name, getattr(self.processor, name, None))
            self.delegates[attn] = processor
        return processor

    def close(self) -> None:
        self.tracker.remove()
        if self.masks is not None:
            self.masks.close()
            self.masks = None
        self.orders_device = None


class _BoundProcessor:
    """Shared machinery: find the layer of each call, bind to its transformer, split the processor."""

    # read by diffusers' set_attention_backend / context parallel, and passed to the dense path
    _attention_backend = None
    _parallel_config = None

    def __init__(self):
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attn -> (binding, layer | None)
        self._bindings: list[Binding] = []

    # -- binding -----------------------------------------------------------------------------
    def bind(self, transformer) -> Binding:
        for binding in self._bindings:
            if binding.transformer is transformer:
                return binding
        binding = Binding(self, transformer, require_family(transformer))
        for layer, module in enumerate(binding.modules):
            self._entries[module] = (binding, layer)
        self._bindings.append(binding)
        self.on_bind(binding)
        return binding

    def unbind(self, binding: Binding) -> None:
        binding.close()
        if binding in self._bindings:
            self._bindings.remove(binding)
        for module in list(self._entries.keys()):
            if self._entries[module][0] is binding:
                del self._entries[module]

    def on_bind(self, binding: Binding) -> None:
        pass

    def begin_forward(self, binding: Binding, inputs: CallInputs) -> None:
        pass

    def _entry(self, attn):
        entry = self._entries.get(attn)
        if entry is not None:
            return entry
        for binding in self._bindings:  # an attention module we do not handle (Wan attn2)?
            transformer = binding.transformer
            if transformer is not None and any(m is attn for m in transformer.modules()):
                self._entries[attn] = (binding, None)
                return self._entries[attn]
        return self._bind_from_frames(attn)

    def _bind_from_frames(self, attn):
        frame = sys._getframe(3)
        while frame is not None:
            owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
            family = family_of(owner) if isinstance(owner, torch.nn.Module) else None
            if family is not None and any(m is attn for m in owner.modules()):
                binding = self.bind(owner)
                binding.tracker.set(binding.family.call_inputs_from_locals(owner, frame.f_locals))
                entry = self._entries.get(attn)
                if entry is None:
                    entry = self._entries[attn] = (binding, None)
                return entry
            frame = frame.f_back
        raise RuntimeError(
            f"{type(self).__name__} was called for a {type(attn).__name__} outside the forward of a supported "
            "transformer, so it cannot tell which layer this is: install it on a whole transformer "
            "(`transformer.set_attn_processor(processor)` or `paroattn.apply(pipe, plan)`)"
        )

    # -- the call ----------------------------------------------------------------------------
    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb=None,
    ):
        binding, layer = self._entry(attn)
        if layer is None or not binding.family.is_self_attention(attn, encoder_hidden_states):
            return binding.delegate(attn)(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        call = binding.family.qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        out = self.attend(binding, attn, layer, call, attention_mask)
        return binding.family.finish(attn, out, call)

    def dense(self, binding: Binding, attn, call: SelfAttentionCall, attention_mask) -> torch.Tensor:
        call = binding.family.rotate(call)
        return binding.family.dense(attn, call, attention_mask, self._attention_backend, self._parallel_config)

    def attend(self, binding: Binding, attn, layer: int, call: SelfAttentionCall, attention_mask) -> torch.Tensor:
        raise NotImplementedError


class CaptureProcessor(_BoundProcessor):
    """Dense attention, identical to the model's own, that first calls
    `callback(layer, q, k, layout, timestep)` with q, k [B, H, N, D] after norms and RoPE."""

    def __init__(self, callback):
        super().__init__()
        self.callback = callback

    def attend(self, binding, attn, layer, call, attention_mask):
        inputs = binding.inputs
        if inputs.layout is None:
            raise PlanError(f"cannot capture attention of this call: {inputs.problem}")
        call = binding.family.rotate(call)
        self.callback(layer, call.q, call.k, inputs.layout, inputs.timestep)
        return self.dense(binding, attn, call, attention_mask)


class PAROProcessor(_BoundProcessor):
    """Runs each self-attention layer with the plan's per-head orders and per-bucket block masks.

    `backend`: "auto" (the Triton kernels on CUDA where they fit the call: head dim 64 or 128, fp16 or
    bf16; otherwise the torch reference, with a warning), "triton" or "torch".
    `on_mismatch`: "error" raises PlanError when the plan does not fit the model or the call;
    "dense" warns once and runs the model's own attention instead.
    `resident`: keep all masks on the GPU (True), stream them per layer (False), or decide by size.
    `pixel_scale`: the pipeline's VAE factors, for the sizes that mismatch messages name (`apply` passes
    the pipeline's; the released VAEs' by default).
    `fuse_rope`: hand the model's RoPE tables to the op, which rotates q and k in one Triton pass (True),
    or apply the RoPE first with the model's own code, as the default processor does (False: slower, the
    models' code is a chain of float32 kernels; for A/B).
    """

    def __init__(self, plan: Plan, *, backend: str = "auto", on_mismatch: str = "error",
                 resident: bool | str = "auto", prefetch_slots: int = 3, pixel_scale: PixelScale = STANDARD_VAE,
                 fuse_rope: bool = True):
        super().__init__()
        if not isinstance(plan, Plan):
            raise TypeError(f"PAROProcessor needs a paroattn.Plan, got {type(plan).__name__}: load one with Plan.load(path)")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch={on_mismatch!r}; expected one of {ON_MISMATCH}")
        self.plan = plan
        self.backend = backend
        self.on_mismatch = on_mismatch
        self.resident = resident
        self.prefetch_slots = prefetch_slots
        self.pixel_scale = pixel_scale
        self.fuse_rope = fuse_rope

    # -- checks ------------------------------------------------------------------------------
    def plan_problems(self, binding: Binding) -> list[str]:
        """Ways the plan does not fit the bound transformer (empty when it fits)."""
        plan, transformer = self.plan, binding.transformer
        problems = []
        if plan.model_class and plan.model_class != binding.transformer_class:
            problems.append(f"plan was calibrated for {plan.model_class}; this model is {binding.transformer_class}")
        heads = {int(m.heads) for m in binding.modules}
        if heads != {plan.num_heads}:
            problems.append(f"plan has {plan.num_heads} heads per layer; this model has {sorted(heads)}")
        if plan.num_layers != len(binding.modules):
            problems.append(
                f"plan has {plan.num_layers} self-attention layers; this model has {len(binding.modules)}"
                + (" (a layer is missing from the plan)" if plan.num_layers < len(binding.modules) else "")
            )
        actual = model_fingerprint(transformer.config)
        if plan.model_fingerprint and plan.model_fingerprint != actual:
            problems.append(
                f"plan was calibrated for a model config with fingerprint {plan.model_fingerprint}; this model's "
                f"config has {actual} (another checkpoint or size)"
            )
        return problems

    def on_bind(self, binding: Binding) -> None:
        problems = self.plan_problems(binding)
        if not problems:
            return
        command = binding.family.calibrate_command(binding.transformer, self.plan.layout, self.pixel_scale)
        message = f"plan does not fit this model: {'; '.join(problems)}. Recalibrate for this model: `{command}`"
        if self.on_mismatch == "error":
            self.unbind(binding)
            raise PlanError(message + " (or pass on_mismatch='dense' to run the model's own attention)")
        binding.static_problem = message
        binding.warn_once("static", message + "; running the model's own attention (on_mismatch='dense')")

    def layout_problem(self, binding: Binding, inputs: CallInputs) -> str | None:
        plan_layout = self.plan.layout
        family, transformer, scale = binding.family, binding.transformer, self.pixel_scale
        if inputs.layout is None:
            return f"this call has no PARO token layout: {inputs.problem}"
        if inputs.layout == plan_layout:
            return None
        if inputs.layout.grid_tokens == plan_layout.grid_tokens and (inputs.layout.frames, inputs.layout.height,
                                                                    inputs.layout.width) == (plan_layout.frames,
                                                                                             plan_layout.height,
                                                                                             plan_layout.width):
            return (
                f"plan was calibrated with {plan_layout.prefix} text tokens; this call has {inputs.layout.prefix}: "
                f"pass max_sequence_length={plan_layout.prefix} to the pipeline, or run "
                f"`{family.calibrate_command(transformer, inputs.layout, scale)}` with the pipeline's text length"
            )
        return (
            f"plan was calibrated for {plan_layout} tokens ({family.describe_size(transformer, plan_layout, scale)}); "
            f"this call has {inputs.layout} ({family.describe_size(transformer, inputs.layout, scale)}): run "
            f"`{family.calibrate_command(transformer, inputs.layout, scale)}` for this size"
        )

    def begin_forward(self, binding: Binding, inputs: CallInputs) -> None:
        binding.bucket = self.plan.bucket_of(inputs.timestep)
        binding.call_problem = None if binding.static_problem else self.layout_problem(binding, inputs)
        if binding.call_problem is not None:
            if self.on_mismatch == "error":
                raise PlanError(binding.call_problem + " (or pass on_mismatch='dense' to run the model's own attention)")
            binding.warn_once(
                f"layout {inputs.layout}", binding.call_problem + "; running the model's own attention (on_mismatch='dense')"
            )
        if binding.masks is not None:
            binding.masks.begin(binding.bucket)

    # -- the call ----------------------------------------------------------------------------
    def uses_block_lists(self, device: torch.device) -> bool:
        # active-block lists feed the Triton kernels ("auto" picks them on CUDA when the call fits them;
        # the torch backend takes lists too, expanding them)
        return self.backend == "triton" or (self.backend == "auto" and device.type == "cuda")

    def _masks(self, binding: Binding, device: torch.device) -> MaskStore:
        if binding.masks is None or binding.masks.device != device:
            binding.masks = MaskStore(
                self.plan, device, lists=self.uses_block_lists(device),
                resident=self.resident, slots=self.prefetch_slots,
            )
            binding.masks.begin(binding.bucket)
        return binding.masks

    def prepare(self, binding: Binding, device) -> MaskStore:
        """Build the masks of every (bucket, layer) for `device` now instead of on the first call."""
        return self._masks(binding, torch.device(device))

    def attend(self, binding, attn, layer, call, attention_mask):
        if binding.static_problem or binding.call_problem:
            return self.dense(binding, attn, call, attention_mask)
        if self._parallel_config is not None:
            # diffusers' context/tensor parallelism hands each GPU a shard of the sequence or heads:
            # per-head orders and block masks of the whole sequence would silently apply to the wrong tokens
            message = (
                "PARO does not run under diffusers' parallel attention (enable_parallelism): each GPU sees only a "
                "shard of the sequence or heads. Run one pipeline per GPU instead"
            )
            if self.on_mismatch == "error":
                raise NotImplementedError(message + " (or pass on_mismatch='dense' to run the model's own attention)")
            binding.warn_once("parallel", message + "; running the model's own attention (on_mismatch='dense')")
            return self.dense(binding, attn, call, attention_mask)
        plan, layout = self.plan, binding.inputs.layout
        if bool(plan.dense[binding.bucket, layer]):
            return self.dense(binding, attn, call, attention_mask)
        if attention_mask is not None:
            binding.warn_once("mask", "PAROProcessor got an attention mask, which a block-sparse plan cannot honour; "
                              "running the model's own attention for such calls")
            return self.dense(binding, attn, call, attention_mask)
        tokens = call.q.shape[2]
        if tokens != layout.seq_len or (call.text_tokens is not None and call.text_tokens != layout.prefix):
            raise PlanError(
                f"layer {layer} got {tokens} tokens ({call.text_tokens} text) but this forward's layout is {layout} "
                f"({layout.seq_len} tokens, {layout.prefix} text): the call does not follow the "
                f"{binding.family.name} token layout"
            )
        device = call.q.device
        masks = self._masks(binding, device)
        if binding.orders_device is None or binding.orders_device.device != device:
            binding.orders_device = plan.orders.to(device=device, dtype=torch.int32)
        if not self.fuse_rope:
            call = binding.family.rotate(call)
        return paro_attention(
            call.q, call.k, call.v,
            layout=layout,
            orders=binding.orders_device[layer],
            block_mask=masks.get(binding.bucket, layer),
            block_size=plan.block_size,
            qk=plan.qk,
            pv=plan.pv,
            backend=self.backend,
            rotary=call.rotary,
        )
