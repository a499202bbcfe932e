"""How a processor finds the layer of each call: one processor instance serves every layer of a
transformer. It binds to the transformer once (`Binding`), maps each attention module to its plan layer,
and installs a forward pre-hook (`timesteps.ForwardTracker`) that tells it the timestep and token layout of
the current call.

Binding happens in `paroattn.apply` / `capture_attention`, or lazily on the first call when a lone
instance was installed with `transformer.set_attn_processor(PAROProcessor(plan))`: diffusers passes
the attention module as the first argument, and the processor finds the transformer whose forward
is running by walking up the Python frames (once). That first forward's timestep and layout are
read from the transformer's frame; later forwards go through the pre-hook.

What a forward is (its `CallInputs`, bucket and whether it fits the plan) is a `Forward` record of the thread that
runs it (`Binding.forward`), so that threads running forwards on one transformer each read their own.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from dataclasses import dataclass

import torch

from ..attention import warn
from ..runner import MaskStore
from .base import CallInputs, FamilyAdapter, SelfAttentionCall
from .context_parallel import context_parallel_config
from .registry import family_of, require_family
from .timesteps import ForwardTracker

# bindings by token, for the functions a traced forward calls with constants only (`processor._prepare_masks`).
# Tokens are strings: an int that differs between two compiles of the same code (two bindings) is made dynamic by
# dynamo's automatic dynamic shapes, and a dynamic value cannot be a constant function's argument
BINDINGS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TOKENS = itertools.count()


@dataclass
class Forward:
    """The forward in flight on one thread: its inputs, and what the processor made of them when it began."""

    inputs: CallInputs
    bucket: int | None = 0  # host bucket (None when it is `bucket_index`)
    bucket_index: torch.Tensor | None = None  # traced forwards: the bucket as a 0-dim device tensor
    bucket_dense: bool | None = None  # the host bucket's dense flag where it is every layer's
    problem: str | None = None  # why the plan does not fit this forward's tokens (None: it fits)
    masks: MaskStore | None = None  # eager forwards: the masks their calls read (from the processor's runner)


class Binding:
    """One processor bound to one transformer: its layers, and the forward each thread runs on it."""

    def __init__(self, processor: BoundProcessor, transformer, family: FamilyAdapter):
        self.processor = processor
        self.family = family
        self.transformer_ref = weakref.ref(transformer)
        self.keys = family.self_attention_layers(transformer)
        self.modules = [transformer.get_submodule(key[: -len(".processor")]) for key in self.keys]
        self.others: list = []  # the transformer's other attention modules (Wan's attn2), which PARO delegates
        self.transformer_class = type(transformer).__name__
        self.static_problem: str | None = None
        self._bucket_constants: dict[tuple[str, int], torch.Tensor] = {}
        self._threads = threading.local()  # each thread's `Forward`
        self.token = f"paroattn-binding-{next(_TOKENS)}"
        BINDINGS[self.token] = self
        self.warned: set[str] = set()
        self.delegates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.tracker = ForwardTracker(transformer, family, on_call=self._on_call)

    @property
    def transformer(self):
        return self.transformer_ref()

    @property
    def forward(self) -> Forward | None:
        """The forward this thread runs on the transformer (None before its first)."""
        return getattr(self._threads, "forward", None)

    @property
    def head_dim(self) -> int:
        """The head dim of the self-attention layers."""
        module = self.modules[0]
        return int(module.inner_dim) // int(module.heads) if hasattr(module, "inner_dim") else int(module.head_dim)

    def installed(self) -> bool:
        """Whether the processor still serves this transformer's first self-attention layer."""
        return len(self.modules) > 0 and self.modules[0].processor is self.processor

    def _on_call(self, inputs: CallInputs) -> None:
        self._threads.forward = forward = Forward(inputs)
        if self.installed():
            self.processor.begin_forward(self, forward)

    def bucket_constant(self, bucket: int, device: torch.device) -> torch.Tensor:
        """The 0-dim int64 tensor of `bucket` on `device`, made once (an eager forward hands it to the blocks that
        torch.compile compiled one by one, as a graph input rather than a Python number each graph would
        specialize on)."""
        key = (str(device), bucket)
        constant = self._bucket_constants.get(key)
        if constant is None:
            constant = self._bucket_constants[key] = torch.tensor(bucket, dtype=torch.int64, device=device)
        return constant

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warn(message, stacklevel=3)

    def delegate(self, attn):
        """The module's default processor, for attention a PAROProcessor does not handle (Wan attn2)."""
        processor = self.delegates.get(attn)
        if processor is None:
            processor = self.add_delegate(attn)
        return processor

    def add_delegate(self, attn):
        processor = self.delegates[attn] = self.family.default_processor(attn)
        self.sync_delegate(processor)
        return processor

    def sync_delegate(self, processor) -> None:
        """Give a delegate the attention backend and parallel config the processor has now."""
        for name in ("_attention_backend", "_parallel_config"):
            if hasattr(processor, name):
                setattr(processor, name, getattr(self.processor, name, None))

    def close(self) -> None:
        self.tracker.remove()
        for module in self.modules:
            module._buffers.pop(LAYER_BUFFER, None)
        for module in self.others:
            module.__dict__.pop(OTHER_ATTENTION, None)


# each self-attention module bound to a processor holds its layer index as a non-persistent buffer (it moves with
# the module, is no part of its state dict, and is dropped when the binding closes), and each other attention
# module a mark: traced calls read these, the same in every block, instead of looking the module up, which would
# make every block's graph its own
LAYER_BUFFER = "paro_layer"
OTHER_ATTENTION = "paro_other_attention"


class BoundProcessor:
    """Shared machinery: find the layer of each call, bind to its transformer, split the processor."""

    # read by diffusers' set_attention_backend, and passed to the dense path
    _attention_backend = None
    _parallel = None

    def __init__(self):
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attn -> (binding, layer | None)
        self._bindings: list[Binding] = []

    @property
    def _parallel_config(self):
        """What diffusers' `enable_parallelism` sets on every attention processor (a `ParallelConfig`), passed to
        the dense path; `on_parallel_config` sees each assignment (`paroattn.apply` copies it from the processor
        it replaces)."""
        return self._parallel

    @_parallel_config.setter
    def _parallel_config(self, config) -> None:
        if config is self._parallel:  # enable_parallelism sets it on every module this instance serves
            return
        self._parallel = config
        self.on_parallel_config(config)

    def on_parallel_config(self, config) -> None:
        pass

    # -- binding -----------------------------------------------------------------------------
    def bind(self, transformer) -> Binding:
        for binding in self._bindings:
            if binding.transformer is transformer:
                return binding
        binding = Binding(self, transformer, require_family(transformer))
        for layer, module in enumerate(binding.modules):
            self._entries[module] = (binding, layer)
            if LAYER_BUFFER not in module._buffers:
                device = next(module.parameters(), torch.empty(0)).device
                module.register_buffer(LAYER_BUFFER, torch.tensor(layer, dtype=torch.int64, device=device),
                                       persistent=False)
        # the other attention modules (Wan's attn2) are known up front too, so a traced forward of a lone
        # processor finds every module it is called for without writing to `_entries` (a recompile)
        for module in transformer.modules():
            if hasattr(module, "processor") and module not in self._entries:
                self._entries[module] = (binding, None)
                setattr(module, OTHER_ATTENTION, True)
                binding.others.append(module)
                try:  # and their default processors (made on first use otherwise, which raises what this hides)
                    binding.add_delegate(module)
                except Exception:
                    pass
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

    def begin_forward(self, binding: Binding, forward: Forward) -> None:
        pass

    def layer_tensors(self) -> bool:
        """Whether traced calls may take their layer as a tensor (`_traced_entry`): the processor reads nothing per
        layer that must be known on the host."""
        return False

    def _traced_entry(self, attn):
        """(binding, layer) of a call torch.compile traces. A lookup keyed by the module makes dynamo guard on the
        module's identity, so each block compiled on its own (regional compilation, diffusers'
        `compile_repeated_blocks`) would get a graph per layer, past dynamo's recompile limit for a deep model.
        With one binding and `layer_tensors`, the layer is the module's `paro_layer` buffer instead, a graph input,
        and the binding's other attention modules (Wan's attn2) carry a mark: one graph serves every block.
        Otherwise the lookup."""
        if len(self._bindings) == 1 and self.layer_tensors():
            layer = attn._buffers.get(LAYER_BUFFER)
            if layer is not None:
                return self._bindings[0], layer
            if attn.__dict__.get(OTHER_ATTENTION, False):
                return self._bindings[0], None
        return self._entry(attn)

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

    @torch.compiler.disable(reason=(
        "a PAROProcessor installed with set_attn_processor finds its transformer by walking the Python frames "
        "of its first forward, which torch.compile cannot trace: bind it before compiling, with "
        "paroattn.apply(transformer, plan) or processor.bind(transformer), or run one forward without compile"
    ))
    def _bind_from_frames(self, attn):
        if context_parallel_config(self._parallel_config) is not None:
            # the forward's locals hold this GPU's chunk of the inputs (Flux's position ids), not the call's layout
            raise RuntimeError(
                f"{type(self).__name__} under diffusers' context parallelism must be bound to its transformer before "
                "the first forward: use paroattn.apply(transformer, plan), or call processor.bind(transformer)"
            )
        frame = sys._getframe(1)
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
        encoder_hidden_states_mask: torch.Tensor | None = None,
    ):
        # `encoder_hidden_states_mask` (Qwen-Image's text padding) is named so that the legacy `Attention.forward`
        # passes it: it drops the keywords a processor's signature lacks. A module that passes a sixth argument
        # positionally (LTX-2's key_rotary_emb) finds it there too, and its default processor gets it back.
        binding, layer = self._traced_entry(attn) if torch.compiler.is_compiling() else self._entry(attn)
        if layer is None or not binding.family.is_self_attention(attn, encoder_hidden_states):
            sixth = () if encoder_hidden_states_mask is None else (encoder_hidden_states_mask,)
            return binding.delegate(attn)(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                                          *sixth)
        # in the model's own order (FLUX.2's single-stream blocks pass them in another), a text mask as attention_mask
        hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb = binding.family.arguments(
            attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, encoder_hidden_states_mask)
        call = binding.family.qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        out = self.attend(binding, attn, layer, call, attention_mask)
        return binding.family.finish(attn, out, call)

    def dense(self, binding: Binding, attn, call: SelfAttentionCall, attention_mask) -> torch.Tensor:
        call = binding.family.rotate(call)
        return binding.family.dense(attn, call, attention_mask, self._attention_backend, self._parallel_config)

    def attend(self, binding: Binding, attn, layer: int, call: SelfAttentionCall, attention_mask) -> torch.Tensor:
        raise NotImplementedError
