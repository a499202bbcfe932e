"""Block masks on their way to the attention kernel: one store per plan and device, read the same way by
eager forwards and by forwards traced by torch.compile.

`MaskStore` holds a plan's orders, dense flags and masks of every (bucket, layer) for one device:
- bool masks [buckets, L, H, nq, nk] (`lists=False`: the torch reference takes them), or
- active-block lists (`lists=True`: the kernels), resident on the device stacked with one list width for the
  whole plan (counts and schedule int32 [buckets, L, H, nq], indices int32 [buckets, L, H, nq, W], W the
  longest list of the plan, so a kernel's list width is the same for every layer and bucket; padding
  entries are 0 and never read; each list is `ActiveBlocks.from_mask`'s), or, for plans too large to keep
  (`resident`), streamed per layer.

`orders[layer]`, `dense_flag(bucket, layer)` and `get(bucket, layer)` are the whole interface. The bucket is
a Python int in eager forwards (views built once per (bucket, layer), no tensor work per call) or a 0-dim
device tensor in traced ones (indexing only, nothing read on the host, one graph for every step). On CUDA the
resident tensors are marked static addresses, so CUDA graphs (`mode="reduce-overhead"`) read them in place.

Streaming is an eager strategy of the same store: the lists stay in pinned host memory, and a side CUDA
stream copies the next sparse layer's into one of a few fixed GPU slots while the current layer computes.
Events order the two streams both ways:
- `ready[slot]`, recorded on the side stream after a copy: the compute stream waits on it before the
  kernel that reads the slot;
- `released[slot]`, recorded on the compute stream at the next `get` (after the kernel that read the slot
  was enqueued): the side stream waits on it before overwriting the slot.
GPU memory for masks is then `slots` x the largest layer, whatever the number of layers, buckets or steps.
It keys slots and events on a bucket known on the host, so it cannot be traced.
"""

from __future__ import annotations

import torch

from ..kernels.block_lists import ActiveBlocks
from ..plan import Plan

# below this many bytes of stacked active-block lists, `resident="auto"` keeps the whole plan on the GPU
RESIDENT_LIMIT_BYTES = 64 << 20


def list_bytes(plan: Plan) -> int:
    """Bytes of `plan`'s stacked active-block lists (counts, schedule, indices)."""
    buckets, layers, heads, nq, _ = plan.masks.shape
    return buckets * layers * heads * nq * (_list_width(plan) + 2) * 4


def _list_width(plan: Plan) -> int:
    return plan.most_active_blocks_per_row()


def common_flag(flags) -> bool | None:
    """The flag every entry of `flags` holds, or None where they differ."""
    return flags[0] if len(set(flags)) == 1 else None


def layers_alike(dense_flags) -> bool:
    """Whether every layer of a plan's dense flags [buckets][layers] has the same flag in each bucket."""
    return len(set(zip(*dense_flags))) <= 1


class MaskStore:
    def __init__(
        self,
        plan: Plan,
        device: torch.device | str,
        *,
        lists: bool,
        resident: bool | str = "auto",
        slots: int = 3,
        resident_limit_bytes: int = RESIDENT_LIMIT_BYTES,
    ):
        if resident not in (True, False, "auto"):
            raise ValueError(f"resident must be True, False or 'auto', got {resident!r}")
        if slots < 2:
            raise ValueError(f"prefetch needs at least 2 slots (one in use, one filling), got {slots}")
        self.plan = plan
        self.device = torch.device(device)
        self.lists = lists
        self.orders = plan.orders.to(device=self.device, dtype=torch.int32)  # [L, H]
        self.dense = plan.dense.to(self.device)
        self.dense_flags = tuple(tuple(bool(x) for x in row) for row in plan.dense.tolist())
        # per layer: True when dense in every bucket, False in none, None when it depends on the bucket
        self.layer_dense = tuple(common_flag(flags) for flags in zip(*self.dense_flags))
        self.num_key_blocks = plan.masks.shape[-1]
        self.hits = self.misses = self.copies = 0
        self.traced = False  # a graph traced by torch.compile reads this store's tensors (it must stay)
        self._views: dict[tuple[int, int], torch.Tensor | ActiveBlocks] = {}
        self._sparse_layers = [
            [layer for layer in range(plan.num_layers) if not self.dense_flags[b][layer]] for b in range(plan.num_buckets)
        ]
        self.host: dict[tuple[int, int], ActiveBlocks] = {}
        on_cuda = self.device.type == "cuda"
        self.streaming = lists and on_cuda and (
            resident is False or (resident == "auto" and list_bytes(plan) > resident_limit_bytes))
        tensors = [self.orders, self.dense]
        if not lists:  # the torch reference's bool masks, unpacked whole (it indexes them by a traced bucket)
            self.mask = plan.block_mask if self.device.type == "cpu" else plan.block_mask.to(self.device)
            tensors.append(self.mask)
        elif self.streaming:
            self._build_host_lists()
            self._init_slots(slots)
        else:
            self.counts, self.indices, self.schedule = self._stack_lists(plan)
            tensors += [self.counts, self.indices, self.schedule]
        if on_cuda:
            for t in tensors:
                torch._dynamo.mark_static_address(t)

    @property
    def resident(self) -> bool:
        return not self.streaming

    # -- building ----------------------------------------------------------------------------
    def _stack_lists(self, plan: Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buckets, layers, heads, nq, _ = plan.masks.shape
        counts = torch.zeros(buckets, layers, heads, nq, dtype=torch.int32, device=self.device)
        schedule = torch.zeros_like(counts)
        indices = torch.zeros(buckets, layers, heads, nq, _list_width(plan), dtype=torch.int32, device=self.device)
        for b in range(buckets):
            for layer in range(layers):
                blocks = ActiveBlocks.from_mask(plan.layer_mask(b, layer).to(self.device))
                counts[b, layer] = blocks.counts
                schedule[b, layer] = blocks.schedule
                indices[b, layer, ..., : blocks.indices.shape[-1]] = blocks.indices
        return counts, indices, schedule

    def _build_host_lists(self) -> None:
        pin = self.device.type == "cuda"
        build_on = self.device if pin else torch.device("cpu")
        for b, layers in enumerate(self._sparse_layers):
            for layer in layers:
                blocks = ActiveBlocks.from_mask(self.plan.layer_mask(b, layer).to(build_on)).to("cpu")
                self.host[(b, layer)] = blocks.pin_memory() if pin else blocks

    def _init_slots(self, slots: int) -> None:
        most_counts = max(blocks.counts.numel() for blocks in self.host.values())
        most_indices = max(blocks.indices.numel() for blocks in self.host.values())
        self._counts = [torch.empty(most_counts, dtype=torch.int32, device=self.device) for _ in range(slots)]
        self._indices = [torch.empty(most_indices, dtype=torch.int32, device=self.device) for _ in range(slots)]
        self._schedule = [torch.empty(most_counts, dtype=torch.int32, device=self.device) for _ in range(slots)]
        self._ready = [torch.cuda.Event() for _ in range(slots)]
        self._released = [torch.cuda.Event() for _ in range(slots)]
        self._slot_key: list[tuple[int, int] | None] = [None] * slots
        self._last_used = [0] * slots
        self._clock = 0
        self._in_use: int | None = None
        self._side = torch.cuda.Stream(device=self.device)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Bytes of lists kept in pinned host memory (streaming stores)."""
        return sum(blocks.nbytes for blocks in self.host.values())

    @property
    def nbytes(self) -> int:
        """Bytes of mask data on the store's device: the masks or lists (the slots, for a streaming store)."""
        if not self.lists:
            tensors = [self.mask]
        elif self.streaming:
            tensors = self._counts + self._indices + self._schedule
        else:
            tensors = [self.counts, self.indices, self.schedule]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def gpu_bytes(self) -> int:
        """Bytes of mask data held on the GPU by this store."""
        return self.nbytes if self.device.type == "cuda" else 0

    @staticmethod
    def empty_stats() -> dict:
        """`stats`' keys where no store was built yet: no mode, nothing held, nothing copied."""
        return {"mode": None, "resident": True, "host_bytes": 0, "gpu_bytes": 0, "prefetch_hits": 0,
                "prefetch_misses": 0, "copies": 0}

    def stats(self) -> dict:
        """mode ("lists" or "bool masks"), resident, host_bytes and gpu_bytes of the masks, and the streaming
        counters (prefetch_hits, prefetch_misses, copies; 0 for a resident store)."""
        return {
            "mode": "lists" if self.lists else "bool masks",
            "resident": self.resident,
            "host_bytes": self.host_bytes,
            "gpu_bytes": self.gpu_bytes,
            "prefetch_hits": self.hits,
            "prefetch_misses": self.misses,
            "copies": self.copies,
        }

    # -- use ---------------------------------------------------------------------------------
    def dense_flag(self, bucket: torch.Tensor | int, layer: torch.Tensor | int) -> bool | None:
        """Whether the plan runs the model's own attention for (bucket, layer), known on the host: for a
        bucket on the device, None when the flag depends on it (then `is_dense` picks on the device). A layer on
        the device (regional compilation) needs every layer's flag alike (`uniform_layers`)."""
        if isinstance(layer, torch.Tensor):
            if not self.uniform_layers:
                raise RuntimeError("a layer index on the device needs a plan whose layers' dense flags are alike")
            layer = 0
        return self.layer_dense[layer] if isinstance(bucket, torch.Tensor) else self.dense_flags[bucket][layer]

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer has the same dense flag in each bucket (then nothing per layer is needed on the
        host)."""
        return layers_alike(self.dense_flags)

    def layer_orders(self, layer: torch.Tensor | int) -> torch.Tensor:
        """int32 [H]: the orders of `layer` (an int, or a 0-dim device tensor)."""
        return self.orders[layer] if isinstance(layer, int) else self.orders.index_select(0, layer.reshape(1))[0]

    def is_dense(self, bucket: torch.Tensor | int, layer: int) -> torch.Tensor:
        """0-dim bool tensor: whether the plan runs the model's own attention for (bucket, layer)."""
        return self._pick(self.dense, bucket, layer)

    def begin(self, bucket: int) -> None:
        """An eager forward starts in `bucket`: a streaming store starts copying its first sparse layer."""
        if self.streaming and self._sparse_layers[bucket]:
            key = (bucket, self._sparse_layers[bucket][0])
            if self._slot_of(key) is None:
                self._issue(key)

    def get(self, bucket: torch.Tensor | int, layer: int):
        """The mask of (bucket, layer) on the device, ready for use on the current stream: a bool [H, nq, nk]
        tensor, or ActiveBlocks."""
        if self.streaming:
            return self._get_streamed(bucket, layer)
        if isinstance(bucket, torch.Tensor) or isinstance(layer, torch.Tensor):
            return self._select(bucket, layer)
        view = self._views.get((bucket, layer))
        if view is None:
            view = self._views[(bucket, layer)] = self._select(bucket, layer)
        return view

    def _select(self, bucket: torch.Tensor | int, layer: int):
        if not self.lists:
            return self._pick(self.mask, bucket, layer)
        return ActiveBlocks(self._pick(self.counts, bucket, layer), self._pick(self.indices, bucket, layer),
                            self.num_key_blocks, self._pick(self.schedule, bucket, layer))

    @staticmethod
    def _pick(t: torch.Tensor, bucket: torch.Tensor | int, layer: torch.Tensor | int) -> torch.Tensor:
        """t[bucket, layer] of a [buckets, layers, ...] tensor, either index an int or a 0-dim device tensor (one
        entry gathered, not a bucket's or a layer's worth)."""
        if isinstance(bucket, int) and isinstance(layer, int):
            return t[bucket, layer]
        if isinstance(layer, int):
            return t[:, layer].index_select(0, bucket.reshape(1)).squeeze(0)
        if isinstance(bucket, int):
            return t[bucket].index_select(0, layer.reshape(1)).squeeze(0)
        return t.flatten(0, 1).index_select(0, (bucket * t.shape[1] + layer).reshape(1)).squeeze(0)

    def next_layer(self, bucket: int, layer: int) -> int | None:
        layers = self._sparse_layers[bucket]
        if not layers:
            return None
        for candidate in layers:
            if candidate > layer:
                return candidate
        return layers[0]  # the next forward most likely stays in this bucket

    def _slot_of(self, key) -> int | None:
        for slot, held in enumerate(self._slot_key):
            if held == key:
                return slot
        return None

    def _issue(self, key: tuple[int, int]) -> int:
        """Start copying `key` into the least recently used slot that is not in use."""
        candidates = [s for s in range(len(self._slot_key)) if s != self._in_use]
        slot = min(candidates, key=lambda s: self._last_used[s])
        blocks = self.host[key]
        self._slot_key[slot] = key
        self._clock += 1
        self._last_used[slot] = self._clock
        self._side.wait_event(self._released[slot])
        with torch.cuda.stream(self._side):
            self._counts[slot][: blocks.counts.numel()].copy_(blocks.counts.view(-1), non_blocking=True)
            self._indices[slot][: blocks.indices.numel()].copy_(blocks.indices.view(-1), non_blocking=True)
            self._schedule[slot][: blocks.schedule.numel()].copy_(blocks.schedule.view(-1), non_blocking=True)
            self._ready[slot].record(self._side)
        self.copies += 1
        return slot

    def _get_streamed(self, bucket: int, layer: int) -> ActiveBlocks:
        compute = torch.cuda.current_stream(self.device)
        if self._in_use is not None:
            # everything that reads the previous slot is enqueued by now
            self._released[self._in_use].record(compute)
        key = (bucket, layer)
        slot = self._slot_of(key)
        if slot is None:
            self.misses += 1
            self._in_use = None
            slot = self._issue(key)
        else:
            self.hits += 1
        self._in_use = slot
        self._clock += 1
        self._last_used[slot] = self._clock
        compute.wait_event(self._ready[slot])
        following = self.next_layer(bucket, layer)
        if following is not None and following != layer and self._slot_of((bucket, following)) is None:
            self._issue((bucket, following))
        host = self.host[key]
        H, nq = host.counts.shape
        width = host.indices.shape[-1]
        return ActiveBlocks(
            self._counts[slot][: H * nq].view(H, nq),
            self._indices[slot][: H * nq * width].view(H, nq, width),
            host.num_key_blocks,
            self._schedule[slot][: H * nq].view(H, nq),
        )

    def close(self) -> None:
        """Drop device copies (the host lists stay for a later run)."""
        self._views.clear()
        if self.streaming:
            self._side.synchronize()
            self._counts = self._indices = self._schedule = []
