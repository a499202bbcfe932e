"""Attention processors: `PAROProcessor` (plan-driven sparse attention) and `CaptureProcessor` (dense,
hands q and k to a callback for calibration). One processor instance serves every layer of a
transformer: it binds to the transformer once, maps each attention module to its plan layer, and
installs a forward pre-hook that tells it the timestep and token layout of the current call.

Binding happens in `paroattn.apply` / `capture_attention`, or lazily on the first call when a lone
instance was installed with `transformer.set_attn_processor(PAROProcessor(plan))`: diffusers passes
the attention module as the first argument, and the processor finds the transformer whose forward
is running by walking up the Python frames (once). That first forward's timestep and layout are
read from the transformer's frame; later forwards go through the pre-hook.

Under `torch.compile(transformer, fullgraph=True)` the processor is traced into the transformer's graph
and the pre-hook into a frame of its own that records the call's inputs and does no tensor work (which
would make a second graph); nothing either does reads a tensor on the host:
- the bucket is a 0-dim device tensor computed in the graph from the timestep tensor (`Plan.bucket_tensor`),
  not a Python int: one graph serves every step and bucket (eager forwards read the timestep on the host
  once per forward);
- each layer's orders and mask are indexed out of `StackedMasks` (every bucket and layer resident on the
  device) with that tensor and the layer's static index; the store is built eagerly while the graph is
  traced (`_prepare_stacked`, which dynamo calls as a constant function), before anything reads it;
- a layer whose plan `dense` flag is the same in every bucket branches on the host (static); one whose flag
  depends on the bucket computes both the model's attention and PARO and keeps one with `torch.where`
  (twice the attention work for such layers, and only when traced; calibration never makes such plans);
- the side-stream mask streaming of eager runs is not traced: a plan too large to keep resident is refused
  with a message (pass resident=True, or run eagerly).
A lone processor must be bound before it is traced (`paroattn.apply`, `processor.bind(transformer)`, or
one eager forward): the frame walk cannot be traced. Flux's image grid is taken from the plan when the
token count matches (`FluxAdapter._traced_grid`): reading img_ids would be a host read.
"""

from __future__ import annotations

import itertools
import sys
import weakref

import torch

from ..attention import BACKENDS, paro_attention, warn
from ..errors import PlanError
from ..layout import TokenLayout
from ..plan import Plan, model_fingerprint
from .base import CallInputs, FamilyAdapter, PixelScale, SelfAttentionCall
from .context_parallel import UlyssesShard, context_parallel_config, model_problem, ulysses_problem
from .prefetch import RESIDENT_LIMIT_BYTES, MaskStore, StackedMasks
from .registry import family_of, require_family
from .timesteps import ForwardTracker

ON_MISMATCH = ("error", "dense")

# bindings by token, for `_prepare_stacked`, which a traced forward calls with constants only
_BINDINGS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TOKENS = itertools.count()


@torch._dynamo.assume_constant_result
def _prepare_stacked(token: int, device: str, head_dim: int, dtype: torch.dtype) -> bool:
    """Build binding `token`'s `StackedMasks` for `device` unless it exists, and settle the Triton kernel
    choice for q's head dim and dtype. Called from a forward traced by torch.compile: dynamo runs it eagerly
    while tracing (its result is a constant), so the store's tensors exist before the graph reads them and
    enter it as inputs (not as ops that would rebuild them every call), and the kernel dispatcher's memo is
    filled before the traced dispatch reads it (filling it while tracing would recompile the next call)."""
    binding = _BINDINGS[token]
    binding.processor.prepare_traced(binding, torch.device(device), head_dim, dtype)
    return True


@torch._dynamo.assume_constant_result
def _traced_layout_problem(token: int, shape: tuple[int, ...] | None, problem: str | None) -> str | None:
    """`PAROProcessor.layout_problem` of a traced forward whose layout is `TokenLayout(*shape)`, formatted
    eagerly while the graph is traced; a mismatch under on_mismatch="error" raises its PlanError here."""
    binding = _BINDINGS[token]
    inputs = CallInputs(0.0, None if shape is None else TokenLayout(*shape), problem)
    message = binding.processor.layout_problem(binding, inputs)
    if message is not None and binding.processor.on_mismatch == "error":
        raise PlanError(message + " (or pass on_mismatch='dense' to run the model's own attention)")
    return message


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
        self.bucket: int | None = 0  # host bucket of the current forward (None when it is `bucket_index`)
        self.bucket_index: torch.Tensor | None = None  # traced forwards: the bucket as a 0-dim device tensor
        self.call_problem: str | None = None
        self.masks: MaskStore | None = None
        self.orders_device: torch.Tensor | None = None
        self.stacked_masks: dict[str, StackedMasks] = {}  # by device, for traced forwards
        self.token = next(_TOKENS)
        _BINDINGS[self.token] = self
        self.warned: set[str] = set()
        self.delegates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.tracker = ForwardTracker(transformer, family, on_call=self._on_call)

    @property
    def transformer(self):
        return self.transformer_ref()

    def installed(self) -> bool:
        """Whether the processor still serves this transformer's first self-attention layer."""
        return len(self.modules) > 0 and self.modules[0].processor is self.processor

    def _on_call(self, inputs: CallInputs) -> None:
        self.inputs = inputs
        if self.installed():
            self.processor.begin_forward(self, inputs)

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

    def drop_masks(self) -> None:
        """Forget the masks and orders built for devices (the processor's plan of heads changed)."""
        if self.masks is not None:
            self.masks.close()
            self.masks = None
        self.orders_device = None
        self.stacked_masks = {}

    def close(self) -> None:
        self.tracker.remove()
        self.drop_masks()


class _BoundProcessor:
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
        # the other attention modules (Wan's attn2) are known up front too, so a traced forward of a lone
        # processor finds every module it is called for without writing to `_entries` (a recompile)
        for module in transformer.modules():
            if hasattr(module, "processor") and module not in self._entries:
                self._entries[module] = (binding, None)
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
        inputs = binding.inputs
        if inputs.layout is None:
            raise PlanError(f"cannot capture attention of this call: {inputs.problem}")
        call = binding.family.rotate(call)
        suffix_mask = None
        if attention_mask is not None:  # padded text keys (HunyuanVideo): absent from the statistics as from the op
            _, suffix_mask = binding.family.suffix_mask(attention_mask, inputs.layout)
        self.callback(layer, call.q, call.k, inputs.layout, inputs.timestep_1000(), suffix_mask)
        return self.dense(binding, attn, call, attention_mask)


class PAROProcessor(_BoundProcessor):
    """Runs each self-attention layer with the plan's per-head orders and per-bucket block masks.

    `backend`: "auto" (the Triton kernels on CUDA where they fit the call: head dim 64 or 128, fp16 or
    bf16; otherwise the torch reference, with a warning), "triton" or "torch".
    `on_mismatch`: "error" raises PlanError when the plan does not fit the model or the call;
    "dense" warns once and runs the model's own attention instead.
    `resident`: keep all masks on the GPU (True), stream them per layer (False), or decide by size.
    `pixel_scale`: the pipeline's VAE factors, for the sizes that mismatch messages name (`apply` passes
    the pipeline's; by default those of the VAE released with the bound transformer's config).
    `fuse_rope`: hand the model's RoPE tables to the op, which rotates q and k in one Triton pass (True),
    or apply the RoPE first with the model's own code, as the default processor does (False: slower, the
    models' code is a chain of float32 kernels; for A/B).
    """

    def __init__(self, plan: Plan, *, backend: str = "auto", on_mismatch: str = "error",
                 resident: bool | str = "auto", prefetch_slots: int = 3, pixel_scale: PixelScale | None = None,
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
        self._ulysses: UlyssesShard | None = None  # this process's heads under Ulysses context parallelism
        self.parallel_problem: str | None = None  # why the parallel config cannot hold PARO (on_mismatch="dense")

    # -- checks ------------------------------------------------------------------------------
    def scale(self, binding: Binding) -> PixelScale:
        """The VAE factors that size the messages about `binding`'s transformer."""
        return self.pixel_scale if self.pixel_scale is not None else binding.family.default_scale(binding.transformer)

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
        binding.family.planned_layout = self.plan.layout
        problems = self.plan_problems(binding)
        if not problems:
            if context_parallel_config(self._parallel_config) is not None:
                problem = model_problem(binding.transformer, binding.family.name)
                if problem is not None and self.on_mismatch == "error":
                    self.unbind(binding)
                self._parallel_refused(problem)
            return
        command = binding.family.calibrate_command(binding.transformer, self.plan.layout, self.scale(binding))
        message = f"plan does not fit this model: {'; '.join(problems)}. Recalibrate for this model: `{command}`"
        if self.on_mismatch == "error":
            self.unbind(binding)
            raise PlanError(message + " (or pass on_mismatch='dense' to run the model's own attention)")
        binding.static_problem = message
        binding.warn_once("static", message + "; running the model's own attention (on_mismatch='dense')")

    # -- context parallelism -----------------------------------------------------------------
    @property
    def head_plan(self) -> Plan:
        """The plan of the heads this process runs: the whole plan, or this GPU's slice of it under Ulysses."""
        return self.plan if self._ulysses is None else self._ulysses.plan

    def on_parallel_config(self, config) -> None:
        """Slice the plan to this GPU's heads (Ulysses), or refuse what cannot hold PARO (see `context_parallel`)."""
        self._ulysses, self.parallel_problem = None, None
        for binding in self._bindings:
            binding.drop_masks()
        cp_config = context_parallel_config(config)
        if cp_config is None:
            return
        problem = ulysses_problem(self.plan.num_heads, int(cp_config.ulysses_degree or 1), int(cp_config.ring_degree or 1))
        for binding in self._bindings:
            problem = problem or model_problem(binding.transformer, binding.family.name)
        if not self._parallel_refused(problem):
            self._ulysses = UlyssesShard(cp_config, self.plan)

    def _parallel_refused(self, problem: str | None) -> bool:
        """Raise `problem` (on_mismatch="error") or keep it for the calls to warn about; False when None."""
        if problem is None:
            return False
        if self.on_mismatch == "error":
            raise PlanError(problem + " (or pass on_mismatch='dense' to run the model's own attention)")
        self._ulysses, self.parallel_problem = None, problem
        return True

    def layout_problem(self, binding: Binding, inputs: CallInputs) -> str | None:
        plan_layout = self.plan.layout
        family, transformer, scale = binding.family, binding.transformer, self.scale(binding)
        if inputs.layout is None:
            return f"this call has no PARO token layout: {inputs.problem}"
        if inputs.layout == plan_layout:
            return None
        if (inputs.layout.frames, inputs.layout.height, inputs.layout.width) == (plan_layout.frames, plan_layout.height,
                                                                                 plan_layout.width):
            planned, found = plan_layout.prefix + plan_layout.suffix, inputs.layout.prefix + inputs.layout.suffix
            return (
                f"plan was calibrated with {planned} text tokens; this call has {found}: "
                f"pass max_sequence_length={planned} to the pipeline, or run "
                f"`{family.calibrate_command(transformer, inputs.layout, scale)}` with the pipeline's text length"
            )
        return (
            f"plan was calibrated for {plan_layout} tokens ({family.describe_size(transformer, plan_layout, scale)}); "
            f"this call has {inputs.layout} ({family.describe_size(transformer, inputs.layout, scale)}): run "
            f"`{family.calibrate_command(transformer, inputs.layout, scale)}` for this size"
        )

    def begin_forward(self, binding: Binding, inputs: CallInputs) -> None:
        traced = torch.compiler.is_compiling()
        # traced forwards pick the bucket of a tensor timestep on the device, in the forward's own graph
        # (`_traced_bucket`); eager ones read it here, once per forward
        binding.bucket_index = None
        if traced and isinstance(inputs.timestep, torch.Tensor):
            binding.bucket = None
        else:
            binding.bucket = self.plan.bucket_of(inputs.timestep_1000())
        if binding.static_problem:
            binding.call_problem = None
        elif traced:  # the messages are formatted eagerly (dynamo cannot trace formatting the layouts)
            layout = inputs.layout
            shape = None if layout is None else layout.fields
            binding.call_problem = _traced_layout_problem(binding.token, shape, inputs.problem)
        else:
            binding.call_problem = self.layout_problem(binding, inputs)
        if binding.call_problem is not None:
            if self.on_mismatch == "error":
                raise PlanError(binding.call_problem + " (or pass on_mismatch='dense' to run the model's own attention)")
            binding.warn_once(
                "layout " + binding.call_problem,
                binding.call_problem + "; running the model's own attention (on_mismatch='dense')",
            )
        if not traced and binding.masks is not None:
            binding.masks.begin(binding.bucket)

    # -- the call ----------------------------------------------------------------------------
    def uses_block_lists(self, device: torch.device) -> bool:
        # active-block lists feed the Triton kernels ("auto" picks them on CUDA when the call fits them;
        # the torch backend takes lists too, expanding them)
        return self.backend == "triton" or (self.backend == "auto" and device.type == "cuda")

    def _masks(self, binding: Binding, device: torch.device) -> MaskStore:
        if binding.masks is None or binding.masks.device != device:
            binding.masks = MaskStore(
                self.head_plan, device, lists=self.uses_block_lists(device),
                resident=self.resident, slots=self.prefetch_slots,
            )
            binding.masks.begin(binding.bucket)
        return binding.masks

    def prepare(self, binding: Binding, device) -> MaskStore:
        """Build the masks of every (bucket, layer) for `device` now instead of on the first call."""
        return self._masks(binding, torch.device(device))

    def prepare_traced(self, binding: Binding, device, head_dim: int | None = None,
                       dtype: torch.dtype | None = None) -> StackedMasks:
        """Build what forwards traced by torch.compile read on `device` now (otherwise done while the first
        one is traced, see `_prepare_stacked`): the stacked masks, and with q's head dim and dtype the Triton
        kernel choice. Active-block lists are kept resident only when `resident` allows it."""
        device = torch.device(device)
        if head_dim is not None and dtype is not None and (
                self.backend == "triton" or (self.backend == "auto" and device.type == "cuda")):
            from ..kernels.dispatch import unsupported_reason

            unsupported_reason(torch.empty(1, 1, 1, head_dim, dtype=dtype, device=device), *self.plan.block_size,
                               self.plan.qk, self.plan.pv)
        key = str(device)
        store = binding.stacked_masks.get(key)
        if store is not None:
            return store
        lists = self.uses_block_lists(device)
        if lists:
            size = StackedMasks.list_bytes(self.head_plan)
            if self.resident is False or (self.resident == "auto" and size > RESIDENT_LIMIT_BYTES):
                why = ("resident=False asks for it" if self.resident is False else
                       f"the plan's active-block lists take {size / 2**20:.1f} MiB stacked, over the "
                       f"{RESIDENT_LIMIT_BYTES >> 20} MiB that resident='auto' keeps on the GPU")
                raise RuntimeError(
                    f"PARO streams this plan's masks per layer on a side CUDA stream ({why}), which torch.compile "
                    "cannot trace: pass resident=True to paroattn.apply / PAROProcessor to keep every mask on the "
                    f"GPU ({size / 2**20:.1f} MiB) under torch.compile, or run the transformer without torch.compile"
                )
        store = binding.stacked_masks[key] = StackedMasks(self.head_plan, device, lists=lists)
        return store

    def _traced_bucket(self, binding: Binding) -> torch.Tensor | int:
        """The bucket of the forward being traced: a 0-dim device tensor computed from the timestep tensor by
        the first layer that asks (the pre-hook is a frame of its own, whose tensors would be a graph of its
        own), or the host bucket of a Python-number timestep."""
        inputs = binding.inputs
        if not isinstance(inputs.timestep, torch.Tensor):
            return binding.bucket
        if binding.bucket_index is None:
            binding.bucket_index = self.plan.bucket_tensor(inputs.timestep, inputs.timestep_scale)
        return binding.bucket_index

    def attend(self, binding, attn, layer, call, attention_mask):
        if binding.static_problem or binding.call_problem:
            return self.dense(binding, attn, call, attention_mask)
        if self.parallel_problem is not None:
            binding.warn_once("parallel", self.parallel_problem + "; running the model's own attention (on_mismatch='dense')")
            return self.dense(binding, attn, call, attention_mask)
        plan, layout, shard = self.head_plan, binding.inputs.layout, self._ulysses
        traced = torch.compiler.is_compiling()
        store = None
        if traced:
            _prepare_stacked(binding.token, str(call.q.device), call.q.shape[-1], call.q.dtype)
            store = binding.stacked_masks[str(call.q.device)]
            bucket = self._traced_bucket(binding)
            # static: a Python bool (dense in every bucket, in none, or in this host bucket), or None when
            # the flag depends on a bucket known only on the device
            dense = store.layer_dense[layer] if isinstance(bucket, torch.Tensor) else store.dense_flags[bucket][layer]
        else:
            bucket = binding.bucket
            dense = bool(plan.dense[bucket, layer])
        if dense is True:
            return self.dense(binding, attn, call, attention_mask)
        suffix_mask = None
        if attention_mask is not None:
            # a mask of padded text keys after the grid (HunyuanVideo) becomes the op's suffix_mask; others
            # cannot be honoured by a block-sparse plan
            handled, suffix_mask = binding.family.suffix_mask(attention_mask, layout)
            if not handled:
                binding.warn_once("mask", "PAROProcessor got an attention mask, which a block-sparse plan cannot "
                                  "honour; running the model's own attention for such calls")
                return self.dense(binding, attn, call, attention_mask)
        tokens = call.q.shape[2]
        if shard is not None:
            if problem := shard.local_problem(layout, tokens, call.text_tokens):
                raise PlanError(f"layer {layer}: {problem}")
        elif tokens != layout.seq_len or (call.text_tokens is not None and call.text_tokens != layout.prefix):
            raise PlanError(
                f"layer {layer} got {tokens} tokens ({call.text_tokens} text) but this forward's layout is {layout} "
                f"({layout.seq_len} tokens, {layout.prefix} text): the call does not follow the "
                f"{binding.family.name} token layout"
            )
        device = call.q.device
        if store is not None:
            orders, block_mask = store.orders[layer], store.get(bucket, layer)
        else:
            masks = self._masks(binding, device)
            if binding.orders_device is None or binding.orders_device.device != device:
                binding.orders_device = plan.orders.to(device=device, dtype=torch.int32)
            orders, block_mask = binding.orders_device[layer], masks.get(bucket, layer)
        if not self.fuse_rope:
            call = binding.family.rotate(call)
        q, k, v, rotary = call.q, call.k, call.v, call.rotary
        if shard is not None:  # this GPU's chunk of the sequence -> its heads over the whole sequence
            q, k, v = (shard.gather_heads(x, layout.prefix) for x in (q, k, v))
            if rotary is not None:
                rotary = shard.gather_rotary(rotary, layout.prefix)
        out = paro_attention(
            q, k, v,
            layout=layout,
            orders=orders,
            block_mask=block_mask,
            block_size=plan.block_size,
            qk=plan.qk,
            pv=plan.pv,
            backend=self.backend,
            rotary=rotary,
            suffix_mask=suffix_mask,
        )
        if shard is not None:
            out = shard.scatter_heads(out, layout.prefix)
        if dense is None:
            # traced, and dense in some buckets only: both results, the bucket's kept (after PARO, whose fused
            # RoPE reads q and k before the model's own RoPE may rotate them in place)
            out = torch.where(store.is_dense(bucket, layer), self.dense(binding, attn, call, attention_mask), out)
        return out
