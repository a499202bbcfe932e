"""`PAROProcessor`: runs each self-attention layer with the plan's per-head orders and per-bucket block
masks through `paroattn.paro_attention`. Binding to the transformer is `binding.py`'s, whether the plan
fits the model and the call is `plan_fit.py`'s; this module is the call itself and the masks it reads.

Under `torch.compile(transformer, fullgraph=True)` the processor is traced into the transformer's graph
and the pre-hook into a frame of its own that records the call's inputs and does no tensor work (which
would make a second graph); nothing either does reads a tensor on the host:
- the bucket is a 0-dim device tensor computed in the graph from the timestep tensor (`Plan.bucket_tensor`),
  not a Python int: one graph serves every step and bucket (eager forwards read the timestep on the host
  once per forward);
- each layer's orders and mask are indexed out of the forward's `MaskStore` (every bucket and layer resident
  on the device) with that tensor and the layer's static index, the same lookup as eager forwards with a
  host bucket; the store is built eagerly while the graph is traced (`_prepare_masks`, which dynamo calls
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

import torch

from ..attention import BACKENDS, Launch, decide, paro_attention, warn
from ..errors import PlanError
from ..kernels.block_lists import head_range
from ..kernels.runtime import PROCESS
from ..layout import TokenLayout
from ..plan import Plan
from ..plan.balance import balance_plan, balance_problem
from ..plan.selection import BALANCED_RANKS, ranks_problem
from ..plan.shapes import ShapePlans
from . import plan_fit
from .base import TEXT_WHOLE, CallInputs, PixelScale
from .binding import Binding, BoundProcessor
from .context_parallel import UlyssesShard, context_parallel_config, model_problem, ulysses_problem
from .prefetch import RESIDENT_LIMIT_BYTES, MaskStore, common_flag, layers_alike, list_bytes


@torch._dynamo.assume_constant_result
def _prepare_masks(token: int, device: str) -> str:
    """Build binding `token`'s `MaskStore` for `device` and the forward's size unless it exists, and return its
    key in `binding.masks`. Called from a forward traced by torch.compile: dynamo runs it eagerly while
    tracing (its result is a constant), so the store's tensors exist before the graph reads them and enter it
    as inputs (not as ops that would rebuild them every call)."""
    binding = PROCESS.bindings[token]
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
        self.plan = plan
        # every layer with the same dense flags: traced calls then take their layer as a tensor (`_traced_entry`);
        # each bucket's flag where it is every layer's (the dense flags are the same at every size and head slice)
        flags = plan.dense.tolist()
        self._uniform_layers = layers_alike(flags)
        self._bucket_dense = tuple(common_flag(row) for row in flags)
        self.shapes = ShapePlans(plan)  # the plan of each call's size: calibrated, or derived once and cached
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
        self.plan = balance_plan(self.plan, self.balance_ranks, device)
        self.shapes = ShapePlans(self.plan)
        for bound in self._bindings:
            bound.drop_masks()

    @property
    def head_plan(self) -> Plan:
        """The plan of the heads this process runs: the whole plan, or this GPU's slice of it under Ulysses."""
        return self.plan if self._ulysses is None else self._ulysses.plan

    def head_plan_at(self, layout: TokenLayout | None, device=None) -> Plan:
        """`head_plan` for a call of `layout`: the calibrated plan of that size, or one derived for it on `device`."""
        if layout is None or layout == self.plan.layout:
            return self.head_plan
        return self.shapes.at(layout, None if self._ulysses is None else self._ulysses.heads, device)

    def on_parallel_config(self, config) -> None:
        """Slice the plan to this GPU's heads (Ulysses), or refuse what cannot hold PARO (see `context_parallel`)."""
        self._ulysses, self.parallel_problem = None, None
        for binding in self._bindings:
            binding.drop_masks()
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
            self._ulysses = UlyssesShard(cp_config, self.plan, family.ulysses_text if family is not None else "split",
                                         self.exchange_groups)
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
            shape = None if inputs.layout is None else inputs.layout.fields
            return plan_fit.traced_layout_problem(binding.token, shape, inputs.problem)
        return plan_fit.layout_problem(self.plan, binding, inputs, self.scale(binding), self.shapes)

    def begin_forward(self, binding: Binding, inputs: CallInputs) -> None:
        traced = torch.compiler.is_compiling()
        # traced forwards pick the bucket of a tensor timestep on the device, in the forward's own graph
        # (`_traced_bucket`); eager ones read it here, once per forward
        binding.bucket_index = None
        if traced and isinstance(inputs.timestep, torch.Tensor):
            binding.bucket = None
        else:
            binding.bucket = self.plan.bucket_of(inputs.timestep_1000())
            if isinstance(inputs.timestep, torch.Tensor):  # for blocks compiled on their own (`_traced_bucket`)
                binding.bucket_index = binding.bucket_constant(binding.bucket, inputs.timestep.device)
        binding.bucket_dense = None if binding.bucket is None else self._bucket_dense[binding.bucket]
        if self._ulysses is not None and (problem := binding.family.ulysses_call_problem(
                binding.transformer, inputs, self._ulysses.degree)):
            raise PlanError(problem)  # diffusers cannot split this call: the model's own attention would fail too
        binding.call_problem = None if binding.static_problem else self.layout_problem(binding, inputs)
        if binding.call_problem is not None:
            if self.on_mismatch == "error":
                raise PlanError(binding.call_problem + plan_fit.OR_DENSE)
            binding.warn_once(
                "layout " + binding.call_problem,
                binding.call_problem + "; running the model's own attention (on_mismatch='dense')",
            )
        if not traced and (store := binding.masks.get(binding.eager_masks)) is not None:
            store.begin(binding.bucket)

    # -- the call ----------------------------------------------------------------------------
    def uses_block_lists(self, binding: Binding, device: torch.device) -> bool:
        """Whether the op runs a kernel for this transformer's calls on `device` (then masks are passed as
        active-block lists, built once; the reference takes bool masks)."""
        transformer = binding.transformer
        probe = torch.empty(1, 1, 1, binding.head_dim, dtype=transformer.dtype if transformer is not None else
                            torch.bfloat16, device="meta")
        decision = decide(probe, *self.plan.block_size, self.plan.qk, self.plan.pv, self.backend, device=device)
        return isinstance(decision, Launch) and decision.backend != "torch"

    def _plan_of_call(self, binding: Binding, device: torch.device) -> Plan:
        """The plan of the forward's size (`head_plan_at`); says once per grid size when it had to be derived."""
        layout = binding.inputs.layout if binding.inputs is not None else None
        plan = self.head_plan_at(layout, device)
        derived = self.shapes.derived.get(layout)
        source = TokenLayout(*derived.info["derived_from"]) if derived is not None else None
        # (a text length of its own, e.g. Qwen-Image's unpadded prompts, is derived silently: same grid)
        if source is not None and (source.frames, source.height, source.width) != (layout.frames, layout.height,
                                                                                    layout.width):
            binding.warn_once(f"derived {layout}", (
                f"paroattn: the plan was not calibrated for a {layout} token grid; its orders and masks there were "
                f"derived from the {source} grid it was calibrated at ({derived.info.get('derive_s', 0.0):.1f} s, "
                "once per size). A size used often is better calibrated into the plan (paro calibrate --sizes)"))
        return plan

    def masks_key(self, binding: Binding, device: torch.device, traced: bool = False) -> str:
        """The key in `binding.masks` of the store the forward's calls read on `device`, built unless it exists:
        the masks of the forward's size (the plan's, another calibrated size's, or derived for it). Eager
        forwards keep one store at a time (a size change drops the previous one unless a traced graph reads
        it); a traced forward needs every mask resident and refuses a plan too large for that."""
        plan = self._plan_of_call(binding, device)
        key = str(device) if plan.layout == self.plan.layout else f"{device} {plan.layout}"
        store = binding.masks.get(key)
        if store is None:
            lists = self.uses_block_lists(binding, device)
            if traced and lists:
                self._check_resident(plan)
            store = binding.masks[key] = MaskStore(plan, device, lists=lists, resident=True if traced else self.resident,
                                                   slots=self.prefetch_slots)
            store.traced = traced
            if not traced:
                store.begin(binding.bucket)
        elif traced and store.streaming:
            self._check_resident(plan)  # raises: built by an eager forward that streams
        store.traced = store.traced or traced
        if not traced and binding.eager_masks != key:
            stale = binding.masks.get(binding.eager_masks)
            if stale is not None and not stale.traced:
                stale.close()
                del binding.masks[binding.eager_masks]
            binding.eager_masks = key
        return key

    def _check_resident(self, plan: Plan) -> None:
        """Refuse, with what to do, a plan whose masks `resident` would stream: streaming cannot be traced."""
        size = list_bytes(plan)
        if self.resident is False or (self.resident == "auto" and size > RESIDENT_LIMIT_BYTES):
            why = ("resident=False asks for it" if self.resident is False else
                   f"the plan's active-block lists take {size / 2**20:.1f} MiB stacked, over the "
                   f"{RESIDENT_LIMIT_BYTES >> 20} MiB that resident='auto' keeps on the GPU")
            raise RuntimeError(
                f"PARO streams this plan's masks per layer on a side CUDA stream ({why}), which torch.compile "
                "cannot trace: pass resident=True to paroattn.apply / PAROProcessor to keep every mask on the "
                f"GPU ({size / 2**20:.1f} MiB) under torch.compile, or run the transformer without torch.compile"
            )

    def prepare(self, binding: Binding, device, traced: bool = False) -> MaskStore:
        """Build the masks of every (bucket, layer) for `device` now instead of on the first call (`traced`:
        for forwards traced by torch.compile, which need them resident)."""
        device = torch.device(device)
        return binding.masks[self.masks_key(binding, device, traced)]

    def layer_tensors(self) -> bool:
        return self._uniform_layers

    def _traced_bucket(self, binding: Binding) -> torch.Tensor | int:
        """The bucket of the forward being traced: a 0-dim device tensor computed from the timestep tensor by
        the first layer that asks (the pre-hook is a frame of its own, whose tensors would be a graph of its
        own), or the host bucket of a Python-number timestep. Where only the blocks are compiled, the eager
        pre-hook has set it already, to the host bucket's constant tensor."""
        inputs = binding.inputs
        if not isinstance(inputs.timestep, torch.Tensor):
            return binding.bucket
        if binding.bucket_index is None:
            binding.bucket_index = self.plan.bucket_tensor(inputs.timestep, inputs.timestep_scale)
        return binding.bucket_index

    def dense(self, binding: Binding, attn, call, attention_mask) -> torch.Tensor:
        """The model's own attention. Under Ulysses, for families whose text every GPU holds whole, through PARO's
        exchange: the model's attention call on this GPU's heads over the gathered sequence, then the scatter."""
        shard = self._ulysses
        if shard is None or binding.family.ulysses_text != TEXT_WHOLE:
            return super().dense(binding, attn, call, attention_mask)
        layout = binding.inputs.layout if binding.inputs is not None else None
        if layout is None:
            raise PlanError(f"under Ulysses the model's own attention needs the call's token layout to exchange its "
                            f"heads: {binding.inputs.problem if binding.inputs is not None else 'no forward seen'}")
        split = shard.split(layout)
        if problem := shard.local_problem(layout, call.q.shape[2], call.text_tokens):
            raise PlanError(problem)
        call = binding.family.rotate(call)

        def attention(q, k, v, heads):
            return binding.family.dense(attn, dataclasses.replace(call, q=q, k=k, v=v), attention_mask,
                                        self._attention_backend, None)

        return shard.attend((call.q, call.k, call.v), split, attention)

    def attend(self, binding, attn, layer, call, attention_mask):
        if binding.static_problem or binding.call_problem:
            return self.dense(binding, attn, call, attention_mask)
        if self.parallel_problem is not None:
            binding.warn_once("parallel", self.parallel_problem + "; running the model's own attention (on_mismatch='dense')")
            return self.dense(binding, attn, call, attention_mask)
        # block size, modes and dense flags are the same at every size of a plan; orders and masks come from
        # the store of the forward's size
        plan, layout, shard = self.head_plan, binding.inputs.layout, self._ulysses
        if torch.compiler.is_compiling():  # the layer may be a 0-dim device tensor (`_traced_entry`)
            masks = binding.masks[_prepare_masks(binding.token, str(call.q.device))]
            bucket = self._traced_bucket(binding)
        else:
            masks, bucket = binding.masks[self.masks_key(binding, call.q.device)], binding.bucket
        # a Python bool; None only when traced and the flag depends on a bucket known on the device alone (blocks
        # compiled on their own know it from the eager pre-hook: `bucket_dense`)
        dense = masks.dense_flag(bucket, layer)
        if dense is None and binding.bucket_dense is not None:
            dense = binding.bucket_dense
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
        orders, block_mask = masks.layer_orders(layer), masks.get(bucket, layer)
        if not self.fuse_rope:
            call = binding.family.rotate(call)
        rotary = call.rotary
        if shard is not None:
            split = shard.split(layout)
            if rotary is not None:
                rotary = shard.gather_rotary(rotary, split)

        def attention(q, k, v, heads=(0, len(orders))):
            """PARO on heads `heads` of this process's slice (all of them without Ulysses)."""
            return paro_attention(
                q, k, v,
                layout=layout,
                orders=orders[heads[0]:heads[1]],
                block_mask=head_range(block_mask, *heads),
                block_size=plan.block_size,
                qk=plan.qk,
                pv=plan.pv,
                backend=self.backend,
                rotary=rotary,
                suffix_mask=suffix_mask,
            )

        # under Ulysses: this GPU's chunk of the sequence -> its heads over the whole sequence, group by group
        out = attention(call.q, call.k, call.v) if shard is None else shard.attend((call.q, call.k, call.v), split,
                                                                                   attention)
        if dense is None:
            # traced, and dense in some buckets only: both results, the bucket's kept (after PARO, whose fused
            # RoPE reads q and k before the model's own RoPE may rotate them in place)
            out = torch.where(masks.is_dense(bucket, layer), self.dense(binding, attn, call, attention_mask), out)
        return out
