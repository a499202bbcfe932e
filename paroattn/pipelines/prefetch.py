"""Block masks on their way to the attention kernel: built once, kept on the host, copied ahead of use.

`MaskStore` turns a plan's masks into `ActiveBlocks` (per head and query block, the list of key
blocks to visit) once per (bucket, layer) and keeps them in pinned CPU memory. On a CUDA device it
either copies everything to the GPU once (`resident`, when it is small) or streams: a side CUDA
stream copies the lists of the next sparse layer into one of a few fixed GPU slots while the
current layer computes. Events order the two streams both ways:
- `ready[slot]`, recorded on the side stream after a copy: the compute stream waits on it before
  the kernel that reads the slot;
- `released[slot]`, recorded on the compute stream at the next `get` (after the kernel that read
  the slot was enqueued): the side stream waits on it before overwriting the slot.
GPU memory for masks is `slots` x the largest layer, whatever the number of layers, buckets or steps.

For `backend="torch"` (CPU, tests) the op takes the bool masks; they are sliced from the plan as is.

Both give a layer's device `orders[layer]`, `dense_flag(bucket, layer)` and `get(bucket, layer)`, so a
call of the processor has one path whichever store serves it.

`StackedMasks` is what a forward traced by torch.compile reads instead: every (bucket, layer) resident on
the device in one stacked tensor per kind, so that the bucket, a device tensor computed from the timestep,
selects a layer's mask by indexing (no host read, no branch per bucket, one graph for every step). Streaming
cannot be traced (it keys slots and events on a bucket known on the host), so plans too large to keep
resident are refused there.
"""

from __future__ import annotations

import torch

from ..kernels.block_lists import ActiveBlocks
from ..plan import Plan

# below this many bytes of active-block lists for the whole plan, `resident="auto"` keeps all on the GPU
RESIDENT_LIMIT_BYTES = 64 << 20


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
        self._dense_flags = tuple(tuple(bool(x) for x in row) for row in plan.dense.tolist())
        self.hits = 0
        self.misses = 0
        self.copies = 0
        self._sparse_layers = [
            [layer for layer in range(plan.num_layers) if not bool(plan.dense[b, layer])] for b in range(plan.num_buckets)
        ]
        self._device_masks: dict[tuple[int, int], torch.Tensor] = {}
        self.host: dict[tuple[int, int], ActiveBlocks] = {}
        self.resident = True
        self.streaming = False
        if not lists:
            return
        self._build_host_lists()
        on_cuda = self.device.type == "cuda"
        total = self.host_bytes
        self.resident = (not on_cuda) or resident is True or (resident == "auto" and total <= resident_limit_bytes)
        if self.resident:
            self._gpu = {key: blocks.to(self.device) for key, blocks in self.host.items()}
        else:
            self.streaming = True
            self._init_slots(slots)

    # -- building ----------------------------------------------------------------------------
    def _build_host_lists(self) -> None:
        pin = self.device.type == "cuda"
        build_on = self.device if pin else torch.device("cpu")
        for b, layers in enumerate(self._sparse_layers):
            for layer in layers:
                blocks = ActiveBlocks.from_mask(self.plan.block_mask[b, layer].to(build_on)).to("cpu")
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
        return sum(blocks.nbytes for blocks in self.host.values())

    @property
    def gpu_bytes(self) -> int:
        """Bytes of mask data held on the device by this store."""
        if not self.lists:
            return sum(m.numel() for m in self._device_masks.values()) if self.device.type == "cuda" else 0
        if self.device.type != "cuda":
            return 0
        if self.resident:
            return sum(blocks.nbytes for blocks in self._gpu.values())
        return sum(t.numel() * 4 for t in self._counts + self._indices + self._schedule)

    def stats(self) -> dict:
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
    def next_layer(self, bucket: int, layer: int) -> int | None:
        layers = self._sparse_layers[bucket]
        if not layers:
            return None
        for candidate in layers:
            if candidate > layer:
                return candidate
        return layers[0]  # the next forward most likely stays in this bucket

    def dense_flag(self, bucket: int, layer: int) -> bool:
        """Whether the plan runs the model's own attention for (bucket, layer)."""
        return self._dense_flags[bucket][layer]

    def begin(self, bucket: int) -> None:
        """A forward starts in `bucket`: start copying its first sparse layer."""
        if self.streaming and self._sparse_layers[bucket]:
            key = (bucket, self._sparse_layers[bucket][0])
            if self._slot_of(key) is None:
                self._issue(key)

    def get(self, bucket: int, layer: int):
        """The mask of (bucket, layer) on the device, ready for use on the current stream."""
        if not self.lists:
            key = (bucket, layer)
            if key not in self._device_masks:
                mask = self.plan.block_mask[bucket, layer]
                self._device_masks[key] = mask if self.device.type == "cpu" else mask.to(self.device)
            return self._device_masks[key]
        if self.resident:
            return self._gpu[(bucket, layer)]
        return self._get_streamed(bucket, layer)

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
        self._device_masks.clear()
        if self.lists and self.resident:
            self._gpu = {}
        if self.streaming:
            self._side.synchronize()
            self._counts = self._indices = self._schedule = []


class StackedMasks:
    """A plan's orders, dense flags and masks of every (bucket, layer) resident on one device, stacked:
    - `orders` int32 [L, H];
    - `dense` bool [buckets, L] (the plan's `dense`), with `dense_flags` (its values as Python bools) and
      `layer_dense` (per layer: True when dense in every bucket, False in none, None when it depends on
      the bucket), read when the graph is traced;
    - bool masks [buckets, L, H, nq, nk] (`lists=False`, the torch backend; on the CPU the plan's own
      tensor), or active-block lists (`lists=True`, the Triton kernels): counts and schedule
      int32 [buckets, L, H, nq], indices int32 [buckets, L, H, nq, W] with one width W, the longest list
      of the plan, so the kernel's list width (`indices.shape[-1]`) is the same for every layer and
      bucket. Padding entries are 0 and never read; each list is `ActiveBlocks.from_mask`'s.
    `get(bucket, layer)` indexes them with a bucket that is a device tensor or an int: views and
    index_select only, nothing read on the host. On CUDA the tensors are marked static addresses, so CUDA
    graphs (`mode="reduce-overhead"`) read them in place instead of copying them at every replay."""

    def __init__(self, plan: Plan, device: torch.device | str, *, lists: bool):
        self.device = torch.device(device)
        self.lists = lists
        self.orders = plan.orders.to(device=self.device, dtype=torch.int32)
        dense = plan.dense.clone()
        self.dense = dense.to(self.device)
        self.dense_flags = tuple(tuple(bool(x) for x in row) for row in dense.tolist())
        self.layer_dense = tuple(
            flags[0] if len(set(flags)) == 1 else None for flags in zip(*self.dense_flags)
        )
        self.num_key_blocks = plan.block_mask.shape[-1]
        if lists:
            self.counts, self.indices, self.schedule = self._stack_lists(plan)
            tensors = [self.orders, self.dense, self.counts, self.indices, self.schedule]
        else:
            self.mask = plan.block_mask if self.device.type == "cpu" else plan.block_mask.to(self.device)
            tensors = [self.orders, self.dense, self.mask]
        if self.device.type == "cuda":
            for t in tensors:
                torch._dynamo.mark_static_address(t)

    def _stack_lists(self, plan: Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buckets, layers, heads, nq, _ = plan.block_mask.shape
        width = max(int(plan.block_mask.sum(dim=-1).max()) if plan.block_mask.numel() else 0, 1)
        counts = torch.zeros(buckets, layers, heads, nq, dtype=torch.int32, device=self.device)
        schedule = torch.zeros_like(counts)
        indices = torch.zeros(buckets, layers, heads, nq, width, dtype=torch.int32, device=self.device)
        for b in range(buckets):
            for layer in range(layers):
                blocks = ActiveBlocks.from_mask(plan.block_mask[b, layer].to(self.device))
                counts[b, layer] = blocks.counts
                schedule[b, layer] = blocks.schedule
                indices[b, layer, ..., : blocks.indices.shape[-1]] = blocks.indices
        return counts, indices, schedule

    @staticmethod
    def list_bytes(plan: Plan) -> int:
        """Bytes of the stacked active-block lists of `plan` (counts, schedule, indices)."""
        buckets, layers, heads, nq, _ = plan.block_mask.shape
        width = max(int(plan.block_mask.sum(dim=-1).max()) if plan.block_mask.numel() else 0, 1)
        return buckets * layers * heads * nq * (width + 2) * 4

    @property
    def nbytes(self) -> int:
        tensors = [self.orders, self.dense] + (
            [self.counts, self.indices, self.schedule] if self.lists else [self.mask])
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def _pick(t: torch.Tensor, bucket: torch.Tensor | int, layer: int) -> torch.Tensor:
        if isinstance(bucket, int):
            return t[bucket, layer]
        return t[:, layer].index_select(0, bucket.reshape(1)).squeeze(0)

    def get(self, bucket: torch.Tensor | int, layer: int):
        """The mask of (bucket, layer): a bool [H, nq, nk] tensor, or ActiveBlocks."""
        if not self.lists:
            return self._pick(self.mask, bucket, layer)
        return ActiveBlocks(
            self._pick(self.counts, bucket, layer),
            self._pick(self.indices, bucket, layer),
            self.num_key_blocks,
            self._pick(self.schedule, bucket, layer),
        )

    def begin(self, bucket) -> None:
        """Nothing to prefetch: every mask is resident."""

    def dense_flag(self, bucket: torch.Tensor | int, layer: int) -> bool | None:
        """Whether the plan runs the model's own attention for (bucket, layer), known on the host: for a
        bucket on the device, None when the flag depends on it (then `is_dense` picks on the device)."""
        return self.layer_dense[layer] if isinstance(bucket, torch.Tensor) else self.dense_flags[bucket][layer]

    def is_dense(self, bucket: torch.Tensor | int, layer: int) -> torch.Tensor:
        """0-dim bool tensor: whether the plan runs the model's own attention for (bucket, layer)."""
        return self._pick(self.dense, bucket, layer)
