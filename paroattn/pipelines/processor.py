"""`PAROProcessor`: the diffusers adapter of `paroattn.runner.PlanRunner`, which runs each self-attention layer
with the plan's per-head orders and per-bucket block masks through `paroattn.paro_attention`. Binding to the
transformer is `binding.py`'s, whether the plan fits the model and the call is `plan_fit.py`'s, the masks of each
size and the op call are the runner's; this module hands each call to the runner, or to the model's own
attention where the plan says so or cannot serve it. What a forward is (its inputs, bucket, whether it fits)
is the record of the thread that runs it (`binding.Forward`): threads may run forwards on one transformer at once.

Under `torch.compile(transformer, fullgraph=True)` the processor is traced into the transformer's graph
and the pre-hook into a frame of its own that records the call's inputs and does no tensor work (which
would make a second graph); nothing either does reads a tensor on the host:
- the bucket is a 0-dim device tensor computed in the graph from the timestep tensor (`Plan.bucket_tensor`),
  not a Python int: one graph serves every step and bucket (eager forwards read the timestep on the host
  once per forward);
- each layer's orders and mask are indexed out of the forward's `MaskStore` (the runner's; every bucket and
  layer resident on the device) with that tensor and the layer's static index, the same lookup as eager
  forwards with a host bucket; the store is built eagerly while the graph is traced (`_prepare_masks`, which dynamo calls
  as a constant function), before anything reads it;
- a layer whose plan `dense` flag is the same in every bucket branches on the host (static); one whose flag
  depends on the bucket computes both the model's attention and PARO and keeps one with `torch.where`
  (twice the attention work for such layers, and only when traced; calibration never makes such plans);
- the side-stream mask streaming of eager runs (a strategy of the same store) is not traced: a plan too
  large to keep resident is refused with a message (pass resident=True, or run eagerly);
- where only the blocks are compiled (diffusers' `compile_repeated_blocks`), the pre-hook runs eagerly and hands
  the graphs the bucket as a constant device tensor, and each call reads its layer from its module's buffer
  (`BoundProcessor._traced_entry`), so that one graph serves every block; a plan whose layers' dense flags
  differ reads them per layer on the host, a graph per block.
A lone processor must be bound before it is traced (`paroattn.apply`, `processor.bind(transformer)`, or
one eager forward): the frame walk cannot be traced. Flux's image grid is taken from the plan when the
token count matches (`FluxAdapter._traced_grid`): reading img_ids would be a host read.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from ..attention import BACKENDS, warn
from ..errors import PlanError
from ..plan import Plan
from ..plan.balance import balance_plan, balance_problem
from ..plan.selection import BALANCED_RANKS, ranks_problem
from ..runner import MaskStore, PlanRunner
from . import plan_fit
from .base import TEXT_WHOLE, CallInputs, PixelScale
from .binding import BINDINGS, Binding, BoundProcessor, Forward
from .context_parallel import UlyssesShard, context_parallel_config, model_problem, ulysses_problem


@torch._dynamo.assume_constant_result
def _prepare_masks(token: int, device: str) -> str:
    """Build the masks of binding `token`'s forward for `device` unless they exist, and return their key in its
    runner's `stores`. Called from a forward traced by torch.compile: dynamo runs it eagerly while tracing (its
    result is a constant), so the store's tensors exist before the graph reads them and enter it as inputs (not
    as ops that would rebuild them every call)."""
    binding = BINDINGS[token]
    return binding.processor.masks_key(binding, torch.device(device), traced=True)


class PAROProcessor(BoundProcessor):
    """Runs each self-attention layer with the plan's per-head orders and per-bucket block masks.

    `backend`: "auto" (the Triton kernels on CUDA where they fit the call: head dim 64 or 128, fp16 or
    bf16; otherwise the torch reference, with a warning on a GPU), "triton", "cuda" (the hand-scheduled sm_90a
    kernels, H100/H200; the Triton kernels with a warning where they cannot run) or "torch".
    `on_mismatch`: "error" raises PlanError when the plan does not fit the model or the call;
    "dense" warns once and runs the model's own attention instead.
    `resident`: keep all masks on the GPU (True), stream them per layer (False), or decide by size.
    `pixel_scale`: the pipeline's VAE factors, for the sizes that mismatch messages name (`apply` passes
    the pipeline's; by default those of the VAE released with the bound transformer's config).
    `fuse_rope`: hand the model's RoPE tables to the op, which rotates q and k in one Triton pass (True),
    or apply the RoPE first with the model's own code, as the default processor does (False: slower, the
    models' code is a chain of float32 kernels; for A/B).
    `balance_ranks`: the number of GPUs the transformer runs on under Ulysses; each layer's blocks are spread evenly
    over their slices of the heads when the processor binds (`paroattn.plan.balance`; on the model's device, from the
    plan's axis profiles; the budget unchanged). A plan calibrated balanced for that number is kept as it is.
    `exchange_groups`: under Ulysses, the groups of heads each GPU's all-to-all exchange is pipelined over, so that
    one group's attention runs while the others' exchanges are in flight (1, the default: all heads in one exchange).
    Each group's exchange waits for every GPU, so a step then pays the slowest GPU once per group: pipeline plans
    balanced per group (`balance_ranks` = GPUs x groups), and measure; docs/notes/multi-gpu.md has what it gained.
    """

    def __init__(self, plan: Plan, *, backend: str = "auto", on_mismatch: str = "error",
                 resident: bool | str = "auto", prefetch_slots: int = 3, pixel_scale: PixelScale | None = None,
                 fuse_rope: bool = True, balance_ranks: int = 1, exchange_groups: int = 1):
        super().__init__()
        if not isinstance(plan, Plan):
            raise TypeError(f"PAROProcessor needs a paroattn.Plan, got {type(plan).__name__}: load one with Plan.load(path)")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
        if on_mismatch not in plan_fit.ON_MISMATCH:
            raise ValueError(f"on_mismatch={on_mismatch!r}; expected one of {plan_fit.ON_MISMATCH}")
        if not isinstance(balance_ranks, int) or (problem := ranks_problem(plan.num_heads, balance_ranks)):
            raise PlanError(f"balance_ranks={balance_ranks!r}: "
                            + (problem if isinstance(balance_ranks, int) else "expected a number of GPUs (an int)"))
        if type(exchange_groups) is not int or exchange_groups < 1:
            raise ValueError(f"exchange_groups={exchange_groups!r}: expected a number of groups of heads >= 1")
        self.balance_ranks = balance_ranks
        self.exchange_groups = exchange_groups
        # eager forwards keep the masks of one size at a time
        self.runner = PlanRunner(plan, backend=backend, resident=resident, prefetch_slots=prefetch_slots,
                                 keep_one_size=True)
        self.on_mismatch = on_mismatch
        self.pixel_scale = pixel_scale
        self.fuse_rope = fuse_rope
        self._ulysses: UlyssesShard | None = None  # this process's heads under Ulysses context parallelism
        self.parallel_problem: str | None = None  # why the parallel config cannot hold PARO (on_mismatch="dense")

    @property
    def plan(self) -> Plan:
        return self.runner.plan

    @property
    def shapes(self):
        """The plan of each call's size: calibrated, or derived once and cached (`paroattn.plan.shapes`)."""
        return self.runner.shapes

    @property
    def backend(self) -> str:
        return self.runner.backend

    @property
    def resident(self) -> bool | str:
        return self.runner.resident

    # -- checks ------------------------------------------------------------------------------
    def scale(self, binding: Binding) -> PixelScale:
        """The VAE factors that size the messages about `binding`'s transformer."""
        return self.pixel_scale if self.pixel_scale is not None else binding.family.default_scale(binding.transformer)

    def plan_problems(self, binding: Binding) -> list[str]:
        """Ways the plan does not fit the bound transformer (empty when it fits)."""
        return plan_fit.plan_problems(self.plan, binding)

    def on_bind(self, binding: Binding) -> None:
        binding.family.planned_layout = self.plan.layout
        problems = self.plan_problems(binding)
        if not problems:
            self._balance(binding)
            config = self._parallel_config
            if context_parallel_config(config) is None:  # what enable_parallelism recorded on the model (CogVideoX's
                config = getattr(binding.transformer, "_parallel_config", None)  # processors take no config)
            if context_parallel_config(config) is not None:  # enable_parallelism came first
                binding.family.after_enable_parallelism(binding.transformer)
                problem = model_problem(binding.transformer, binding.family)
                if problem is not None and (self.on_mismatch == "error" or binding.family.ulysses_text == TEXT_WHOLE):
                    self.unbind(binding)
                if not self._parallel_refused(problem, binding.family):
                    self._parallel = config
                    self.on_parallel_config(config)  # this family's exchange, of the balanced plan
            return
        command = binding.family.calibrate_command(binding.transformer, self.plan.layout, self.scale(binding))
        message = f"plan does not fit this model: {'; '.join(problems)}. Recalibrate for this model: `{command}`"
        if self.on_mismatch == "error":
            self.unbind(binding)
            raise PlanError(message + plan_fit.OR_DENSE)
        binding.static_problem = message
        binding.warn_once("static", message + "; running the model's own attention (on_mismatch='dense')")

    # -- context parallelism -----------------------------------------------------------------
    def _balance(self, binding: Binding) -> None:
        """Balance the plan over `balance_ranks` GPUs on the bound transformer's device, once (`paroattn.plan.balance`)."""
        if self.balance_ranks <= 1 or int(self.plan.info.get(BALANCED_RANKS) or 1) == self.balance_ranks:
            return
        transformer = binding.transformer
        device = next(transformer.parameters()).device if transformer is not None else None
        old = self.runner
        old.drop()
        self.runner = PlanRunner(balance_plan(old.plan, self.balance_ranks, device), backend=old.backend,
                                 resident=old.resident, prefetch_slots=old.prefetch_slots, keep_one_size=True)

    @property
    def head_plan(self) -> Plan:
        """The plan of the heads this process runs: the whole plan, or this GPU's slice of it under Ulysses."""
        return self.runner.head_plan

    def on_parallel_config(self, config) -> None:
        """Slice the plan to this GPU's heads (Ulysses), or refuse what cannot hold PARO (see `context_parallel`)."""
        self._ulysses, self.parallel_problem = None, None
        self.runner.set_heads(None)
        cp_config = context_parallel_config(config)
        if cp_config is None:
            return
        degree = int(cp_config.ulysses_degree or 1)
        problem = ulysses_problem(self.plan.num_heads, degree, int(cp_config.ring_degree or 1))
        family = None
        for binding in self._bindings:
            family = binding.family
            problem = problem or model_problem(binding.transformer, family)
        if not self._parallel_refused(problem, family):
            self._ulysses = UlyssesShard(cp_config, self.plan.num_heads,
                                         family.ulysses_text if family is not None else "split", self.exchange_groups)
            self.runner.set_heads(self._ulysses.heads, self.plan.head_slice(*self._ulysses.heads))
            if unbalanced := balance_problem(self.plan, degree):
                warn(unbalanced, stacklevel=3)

    def _parallel_refused(self, problem: str | None, family=None) -> bool:
        """Raise `problem` (on_mismatch="error") or keep it for the calls to warn about; False when None. Families
        whose text every GPU holds whole cannot fall back to their own attention, which the exchange needs too."""
        if problem is None:
            return False
        if family is not None and family.ulysses_text == TEXT_WHOLE:
            raise PlanError(problem + f" (the model's own {family.models} attention cannot run under this config either)")
        if self.on_mismatch == "error":
            raise PlanError(problem + plan_fit.OR_DENSE)
        self._ulysses, self.parallel_problem = None, problem
        return True

    def layout_problem(self, binding: Binding, inputs: CallInputs) -> str | None:
        """Why the plan does not fit this call's tokens (None when it does), in eager and traced forwards alike
        (while traced, the message is formatted eagerly: dynamo cannot trace formatting the layouts)."""
        if torch.compiler.is_compiling():
            # operator.index makes dynamo specialize sizes it traced as symbolic (torch.compile without dynamic=False,
            # at a second size): each size gets its own graph, its orders and masks fixed for it
            shape = None if inputs.layout is None else tuple(operator.index(n) for n in inputs.layout.fields)
            return plan_fit.traced_layout_problem(binding.token, shape, inputs.problem)
        return plan_fit.layout_problem(self.plan, binding, inputs, self.scale(binding), self.shapes)

    def begin_forward(self, binding: Binding, forward: Forward) -> None:
        traced = torch.compiler.is_compiling()
        inputs = forward.inputs
        # traced forwards pick the bucket of a tensor timestep on the device, in the forward's own graph
        # (`_layer_masks`); eager ones read it here, once per forward
        if traced and isinstance(inputs.timestep, torch.Tensor):
            forward.bucket = None
        else:
            forward.bucket = self.runner.bucket_of(inputs.timestep_1000())
            if isinstance(inputs.timestep, torch.Tensor):  # for blocks compiled on their own (`_layer_masks`)
                forward.bucket_index = binding.bucket_constant(forward.bucket, inputs.timestep.device)
        forward.bucket_dense = None if forward.bucket is None else self.runner.bucket_dense[forward.bucket]
        if self._ulysses is not None and (problem := binding.family.ulysses_call_problem(
                binding.transformer, inputs, self._ulysses.degree)):
            raise PlanError(problem)  # diffusers cannot split this call: the model's own attention would fail too
        forward.problem = None if binding.static_problem else self.layout_problem(binding, inputs)
        if forward.problem is not None:
            if self.on_mismatch == "error":
                raise PlanError(forward.problem + plan_fit.OR_DENSE)
            binding.warn_once(
                "layout " + forward.problem,
                forward.problem + "; running the model's own attention (on_mismatch='dense')",
            )
        if not traced:
            self.runner.begin(forward.bucket)

    # -- the masks ---------------------------------------------------------------------------
    def masks_key(self, binding: Binding, device: torch.device, traced: bool = False) -> str:
        """The key in the runner's `stores` of the masks the forward's calls read on `device`, built unless they
        exist: those of the forward's size (the plan's, another calibrated size's, or derived for it; said once per
        grid size where derived). Eager forwards keep one size at a time (unless a traced graph reads it); a traced
        forward needs every mask resident and refuses a plan too large for that."""
        forward = binding.forward
        layout = forward.inputs.layout if forward is not None else None
        transformer = binding.transformer
        dtype = transformer.dtype if transformer is not None else torch.bfloat16
        key = self.runner.store_key(layout, device, dtype, binding.head_dim, traced=traced,
                                    bucket=None if traced or forward is None else forward.bucket)
        if (derived := self.runner.derived_from(layout)) is not None:
            source = derived.info["derived_from"]
            binding.warn_once(f"derived {layout}", (
                f"paroattn: the plan was not calibrated for a {layout} token grid; its orders and masks there were "
                f"derived from the {type(layout)(*source)} grid it was calibrated at "
                f"({derived.info.get('derive_s', 0.0):.1f} s, once per size). A size used often is better calibrated "
                "into the plan (paro calibrate --sizes)"))
        return key

    def prepare(self, binding: Binding, device, traced: bool = False) -> MaskStore:
        """Build the masks of every (bucket, layer) for `device` now instead of on the first call (`traced`:
        for forwards traced by torch.compile, which need them resident)."""
        return self.runner.stores[self.masks_key(binding, torch.device(device), traced)]

    def layer_tensors(self) -> bool:
        return self.runner.uniform_layers

    def _layer_masks(self, binding: Binding, forward: Forward, device: torch.device
                     ) -> tuple[MaskStore, torch.Tensor | int]:
        """The store the forward's calls read on `device`, and the forward's bucket: a Python int in eager
        forwards; while traced, a 0-dim device tensor computed from the timestep tensor by the first layer that
        asks (the pre-hook is a frame of its own, whose tensors would be a graph of its own), or the host bucket
        of a Python-number timestep. Where only the blocks are compiled, the eager pre-hook has set it already,
        to the host bucket's constant tensor."""
        if not torch.compiler.is_compiling():  # looked up once per forward and device
            if forward.masks is None or forward.masks.device != device:
                forward.masks = self.runner.stores[self.masks_key(binding, device)]
            return forward.masks, forward.bucket
        store = self.runner.stores[_prepare_masks(binding.token, str(device))]
        inputs = forward.inputs
        if not isinstance(inputs.timestep, torch.Tensor):
            return store, forward.bucket
        if forward.bucket_index is None:
            forward.bucket_index = self.plan.bucket_tensor(inputs.timestep, inputs.timestep_scale)
        return store, forward.bucket_index

    # -- the call ----------------------------------------------------------------------------
    def dense(self, binding: Binding, attn, call, attention_mask) -> torch.Tensor:
        """The model's own attention. Under Ulysses, for families whose text every GPU holds whole, through PARO's
        exchange: the model's attention call on this GPU's heads over the gathered sequence, then the scatter."""
        shard = self._ulysses
        if shard is None or binding.family.ulysses_text != TEXT_WHOLE:
            return super().dense(binding, attn, call, attention_mask)
        forward = binding.forward
        layout = forward.inputs.layout if forward is not None else None
        if layout is None:
            raise PlanError(f"under Ulysses the model's own attention needs the call's token layout to exchange its "
                            f"heads: {forward.inputs.problem if forward is not None else 'no forward seen'}")
        split = shard.split(layout)
        if problem := shard.local_problem(layout, call.q.shape[2], call.text_tokens):
            raise PlanError(problem)
        call = binding.family.rotate(call)

        def attention(q, k, v, heads):
            return binding.family.dense(attn, dataclasses.replace(call, q=q, k=k, v=v), attention_mask,
                                        self._attention_backend, None)

        return shard.attend((call.q, call.k, call.v), split, attention)

    def _runs_dense(self, binding: Binding, forward: Forward) -> bool:
        """Whether the forward runs the model's own attention: the plan does not fit the model, the forward's
        tokens or the parallel config (on_mismatch="dense")."""
        if forward is None:
            raise RuntimeError(f"PAROProcessor was called for a layer of a {binding.transformer_class} outside a "
                               "forward of the transformer on this thread: call the transformer, not its attention "
                               "modules alone (the forward tells PARO the timestep and token layout)")
        if binding.static_problem or forward.problem:
            return True
        if self.parallel_problem is not None:
            binding.warn_once("parallel", self.parallel_problem + "; running the model's own attention "
                              "(on_mismatch='dense')")
        return self.parallel_problem is not None

    def _check_tokens(self, binding: Binding, layout, layer, call) -> None:
        """Raise PlanError where the call's tokens are not the forward's layout (this GPU's chunk under Ulysses)."""
        tokens = call.q.shape[2]
        if self._ulysses is not None:
            if problem := self._ulysses.local_problem(layout, tokens, call.text_tokens):
                raise PlanError(f"layer {layer}: {problem}")
        elif tokens != layout.seq_len or (call.text_tokens is not None and call.text_tokens != layout.prefix):
            raise PlanError(
                f"layer {layer} got {tokens} tokens ({call.text_tokens} text) but this forward's layout is {layout} "
                f"({layout.seq_len} tokens, {layout.prefix} text): the call does not follow the "
                f"{binding.family.name} token layout"
            )

    def _paro(self, call, layout, store: MaskStore, bucket, layer, suffix_mask) -> torch.Tensor:
        """The runner's op call of the layer on the call's q, k, v: under Ulysses, this GPU's chunk of the sequence
        -> its heads over the whole sequence, group by group."""
        shard, rotary = self._ulysses, call.rotary
        split = None if shard is None else shard.split(layout)
        if split is not None and rotary is not None:
            rotary = shard.gather_rotary(rotary, split)
        attention = self.runner.attention(store, bucket, layer, layout, rotary=rotary, suffix_mask=suffix_mask)
        qkv = (call.q, call.k, call.v)
        return attention(*qkv) if shard is None else shard.attend(qkv, split, attention)

    def attend(self, binding, attn, layer, call, attention_mask):
        forward = binding.forward
        if self._runs_dense(binding, forward):
            return self.dense(binding, attn, call, attention_mask)
        # block size, modes and dense flags are the same at every size of a plan; orders and masks come from
        # the store of the forward's size. The layer may be a 0-dim device tensor while traced (`_traced_entry`)
        store, bucket = self._layer_masks(binding, forward, call.q.device)
        # a Python bool; None only when traced and the flag depends on a bucket known on the device alone (blocks
        # compiled on their own know it from the eager pre-hook: `bucket_dense`)
        dense = store.dense_flag(bucket, layer)
        dense = forward.bucket_dense if dense is None and forward.bucket_dense is not None else dense
        # a mask of padded text keys after the grid (HunyuanVideo) becomes the op's suffix_mask; others cannot be
        # honoured by a block-sparse plan
        layout = forward.inputs.layout
        handled, suffix_mask = (True, None) if attention_mask is None or dense is True else \
            binding.family.suffix_mask(attention_mask, layout)
        if not handled:
            binding.warn_once("mask", "PAROProcessor got an attention mask, which a block-sparse plan cannot "
                              "honour; running the model's own attention for such calls")
        if dense is True or not handled:
            return self.dense(binding, attn, call, attention_mask)
        self._check_tokens(binding, layout, layer, call)
        if not self.fuse_rope:
            call = binding.family.rotate(call)
        out = self._paro(call, layout, store, bucket, layer, suffix_mask)
        if dense is None:
            # traced, and dense in some buckets only: both results, the bucket's kept (after PARO, whose fused
            # RoPE reads q and k before the model's own RoPE may rotate them in place)
            out = torch.where(store.is_dense(bucket, layer), self.dense(binding, attn, call, attention_mask), out)
        return out

    def unbind(self, binding: Binding) -> None:
        super().unbind(binding)
        self.runner.drop()
