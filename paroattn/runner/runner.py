"""`PlanRunner`: one plan run on the self-attention calls of a model, whatever framework makes the calls.

An integration (`paroattn.pipelines.PAROProcessor` for diffusers, the ComfyUI pack's hook) finds a call's layer,
token layout and timestep in its framework's way; the runner does the rest, the same for both:
1. the plan of the call's size (`plan_at`): the calibrated plan of that size, or one derived once from the
   closest calibrated size (`paroattn.plan.shapes.ShapePlans`); this process's slice of its heads where the
   integration runs a slice (Ulysses context parallelism: `set_heads`);
2. whether a kernel runs the calls (`uses_block_lists`, the op's own answer: `paroattn.attention.kernel_for`),
   which decides the form of the masks: active-block lists for a kernel, bool masks for the reference;
3. the masks of that size, form and device (`store`: a `MaskStore`, built once, resident or streamed on a side
   CUDA stream), and the timestep's bucket (`bucket_of`);
4. the op call of one layer (`attention`): its orders and mask out of the store, into `paro_attention`.

State: the runner keeps what does not change from call to call, under a lock (the plans derived per size, the
stores, the messages given). What one forward or call is (its layout, bucket, layer) is never kept on the
runner: it travels with the call, as arguments. Threads may therefore run forwards through one runner at once:
each call reads its own bucket and layout. The integrations keep theirs per call too: ComfyUI in the per-call
`transformer_options`, the diffusers processor in a record per thread (`pipelines.binding.Forward`, set by the
transformer's pre-hook on the thread that runs the forward). A streaming store (CUDA, a plan over the resident
limit) serves one forward at a time: its slots are shared.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from ..attention import BACKENDS, kernel_for, paro_attention
from ..kernels.block_lists import head_range
from ..layout import TokenLayout
from ..plan import Plan
from ..plan.shapes import ShapePlans
from .store import RESIDENT_LIMIT_BYTES, MaskStore, common_flag, layers_alike, list_bytes

# every runner of the process, so that `reset` finds their masks
_RUNNERS: weakref.WeakSet = weakref.WeakSet()


class PlanRunner:
    """Runs `plan` with `backend` (see `paroattn.paro_attention`). `resident`: keep all masks on the GPU (True),
    stream them per layer (False), or decide by size ("auto"); `prefetch_slots`: the GPU slots of a streaming
    store. `keep_one_size`: keep the masks of one size at a time for eager calls (a call of another size drops
    them, unless a traced graph reads them); otherwise every size met keeps its masks."""

    def __init__(self, plan: Plan, *, backend: str = "auto", resident: bool | str = "auto", prefetch_slots: int = 3,
                 keep_one_size: bool = False):
        if not isinstance(plan, Plan):
            raise TypeError(f"PlanRunner needs a paroattn.Plan, got {type(plan).__name__}: load one with "
                            "Plan.load(path)")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
        if resident not in (True, False, "auto"):
            raise ValueError(f"resident must be True, False or 'auto', got {resident!r}")
        if type(prefetch_slots) is not int or prefetch_slots < 2:
            raise ValueError(f"prefetch_slots={prefetch_slots!r}: streaming needs at least 2 slots (one in use, one "
                             "filling)")
        self.plan = plan
        self.backend = backend
        self.resident = resident
        self.prefetch_slots = prefetch_slots
        self.keep_one_size = keep_one_size
        self.shapes = ShapePlans(plan)  # the plan of each call's size: calibrated, or derived once and cached
        self.heads: tuple[int, int] | None = None  # the heads this process runs (None: all)
        self.head_plan = plan  # the plan of those heads at the calibrated size
        flags = plan.dense.tolist()
        # every layer with the same dense flags (then nothing per layer is needed on the host), and each bucket's
        # flag where it is every layer's (the dense flags are the same at every size and head slice)
        self.uniform_layers = layers_alike(flags)
        self.bucket_dense = tuple(common_flag(row) for row in flags)
        self.stores: dict[str, MaskStore] = {}
        self.latest: str | None = None  # the store the latest eager call read (`stats`)
        self._lock = threading.RLock()
        _RUNNERS.add(self)

    # -- sizes and heads ---------------------------------------------------------------------
    def set_heads(self, heads: tuple[int, int] | None, plan: Plan | None = None) -> None:
        """Run heads `heads[0]..heads[1]-1` of every layer (None: all), `plan` being the plan's slice of them
        (made here when not given); the masks built so far are dropped."""
        self.drop()
        self.heads = heads
        self.head_plan = self.plan if heads is None else (plan if plan is not None else self.plan.head_slice(*heads))

    def size_problem(self, layout: TokenLayout) -> str | None:
        """Why the plan cannot serve calls of `layout` (None: calibrated for it, or derives masks for it)."""
        return None if layout == self.plan.layout else self.shapes.problem(layout)

    def plan_at(self, layout: TokenLayout | None, device=None) -> Plan:
        """The plan of the heads this process runs for calls of `layout`: calibrated, or derived for it on
        `device` the first time (raises PlanError where `size_problem` says why it cannot)."""
        if layout is None or layout == self.plan.layout:
            return self.head_plan
        with self._lock:
            return self.shapes.at(layout, self.heads, device)

    def derived_from(self, layout: TokenLayout) -> Plan | None:
        """The plan derived for `layout` when its grid is one the plan was not calibrated at (`info` says from
        what and how long it took); None for a calibrated grid (a text length of its own included)."""
        derived = self.shapes.derived.get(layout)
        if derived is None:
            return None
        source = TokenLayout(*derived.info["derived_from"])
        same_grid = (source.frames, source.height, source.width) == (layout.frames, layout.height, layout.width)
        return None if same_grid else derived

    # -- masks -------------------------------------------------------------------------------
    def uses_block_lists(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether a kernel runs calls of q with `dtype` and `head_dim` on `device` (then masks go to the op as
        active-block lists, built once; the reference takes bool masks)."""
        plan = self.plan
        return kernel_for(device, dtype, head_dim, plan.block_size, plan.qk, plan.pv, self.backend,
                          k_scale=plan.k_scale) is not None

    def store_key(self, layout: TokenLayout | None, device: torch.device, dtype: torch.dtype, head_dim: int, *,
                  traced: bool = False, bucket: int | None = None) -> str:
        """The key in `stores` of the masks that calls of `layout` with q of `dtype` and `head_dim` read on
        `device`, built unless they exist (an eager call's streaming store starts copying `bucket`'s first
        layer). Masks a traced graph reads (`traced`) must be resident: a plan `resident` would stream is
        refused with what to do."""
        with self._lock:
            plan = self.plan_at(layout, device)
            lists = self.uses_block_lists(device, dtype, head_dim)
            key = f"{device} {plan.layout} {'lists' if lists else 'masks'}"
            store = self.stores.get(key)
            if store is None:
                if traced and lists:
                    self._check_resident(plan)
                store = self.stores[key] = MaskStore(plan, device, lists=lists, resident=True if traced else
                                                     self.resident, slots=self.prefetch_slots)
                if not traced and bucket is not None:
                    store.begin(bucket)
            elif traced and store.streaming:
                self._check_resident(plan)  # raises: built by an eager call that streams
            store.traced = store.traced or traced
            if not traced:
                stale = self.stores.get(self.latest) if self.keep_one_size and self.latest != key else None
                if stale is not None and not stale.traced:
                    stale.close()
                    del self.stores[self.latest]
                self.latest = key
        return key

    def store(self, layout: TokenLayout | None, device: torch.device, dtype: torch.dtype, head_dim: int, *,
              traced: bool = False, bucket: int | None = None) -> MaskStore:
        """The masks of `store_key`."""
        return self.stores[self.store_key(layout, device, dtype, head_dim, traced=traced, bucket=bucket)]

    def traceable(self, layout: TokenLayout | None, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether a graph traced by torch.compile can read the masks of calls of `layout` (as `store_key` takes
        them): False where they are active-block lists that `resident` streams on a side CUDA stream."""
        with self._lock:
            plan = self.plan_at(layout, device)
            return not (torch.device(device).type == "cuda" and self.uses_block_lists(device, dtype, head_dim)
                        and self._streams(plan))

    def _streams(self, plan: Plan) -> bool:
        return self.resident is False or (self.resident == "auto" and list_bytes(plan) > RESIDENT_LIMIT_BYTES)

    def _check_resident(self, plan: Plan) -> None:
        """Refuse, with what to do, a plan whose masks `resident` would stream: streaming cannot be traced."""
        size = list_bytes(plan)
        if self._streams(plan):
            why = ("resident=False asks for it" if self.resident is False else
                   f"the plan's active-block lists take {size / 2**20:.1f} MiB stacked, over the "
                   f"{RESIDENT_LIMIT_BYTES >> 20} MiB that resident='auto' keeps on the GPU")
            raise RuntimeError(
                f"PARO streams this plan's masks per layer on a side CUDA stream ({why}), which torch.compile "
                "cannot trace: pass resident=True to paroattn.apply / PAROProcessor to keep every mask on the "
                f"GPU ({size / 2**20:.1f} MiB) under torch.compile, or run the transformer without torch.compile"
            )

    def begin(self, bucket: int) -> None:
        """An eager forward starts in `bucket`: the latest store, if it streams, starts copying its first layer."""
        store = self.stores.get(self.latest)
        if store is not None:
            store.begin(bucket)

    def drop(self) -> None:
        """Forget every store (the plan of heads changed, or the integration is removed)."""
        with self._lock:
            for store in self.stores.values():
                store.close()
            self.stores = {}
            self.latest = None

    # -- the call ----------------------------------------------------------------------------
    def bucket_of(self, timestep: float) -> int:
        """The plan's timestep bucket of a timestep on the 0..1000 scale."""
        return self.plan.bucket_of(timestep)

    def attention(self, store: MaskStore, bucket: torch.Tensor | int, layer: torch.Tensor | int, layout: TokenLayout,
                  *, rotary=None, suffix_mask: torch.Tensor | None = None, sm_scale: float | None = None
                  ) -> Callable[..., torch.Tensor]:
        """The op call of `layer` in `bucket` (ints, or 0-dim device tensors while traced) for tokens of
        `layout`: a function (q, k, v, heads=None) -> out of PARO on q, k, v [B, h, N, D], whose h heads are
        heads `heads` (a (start, stop) range; None: all) of the heads this process runs. The layer's orders and
        mask are read out of `store` once, here: call it once per layer."""
        plan, orders, block_mask = store.plan, store.layer_orders(layer), store.get(bucket, layer)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int] | None = None):
            some = (orders, block_mask) if heads is None else (orders[heads[0]:heads[1]], head_range(block_mask, *heads))
            return paro_attention(q, k, v, layout=layout, orders=some[0], block_mask=some[1], block_size=plan.block_size,
                                  qk=plan.qk, pv=plan.pv, sm_scale=sm_scale, backend=self.backend, rotary=rotary,
                                  suffix_mask=suffix_mask, k_scale=plan.k_scale)

        return attend

    # -- reports -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """The masks of the latest eager call (`MaskStore.stats`: mode, resident, host_bytes, gpu_bytes and the
        prefetch counters; an empty store's before any call); `traced_bytes`: per device, the masks that graphs
        traced by torch.compile read, summed over the sizes met."""
        with self._lock:
            latest = self.stores.get(self.latest)
            stats = latest.stats() if latest is not None else MaskStore.empty_stats()
            traced = [(key.split()[0], store.nbytes) for key, store in self.stores.items() if store.traced]
        if traced:
            stats["traced_bytes"] = {}
            for device, size in traced:
                stats["traced_bytes"][device] = stats["traced_bytes"].get(device, 0) + size
        return stats


def reset() -> None:
    """Drop the masks of every runner of the process (they are built again on the next call)."""
    for runner in list(_RUNNERS):
        runner.drop()
