"""What the op keeps between calls on one device: one `Runtime` per device owns every cache, and
`clear()` empties them all.

- decisions: `dispatch.resolve` per call key, so an eager call decides its kernel with one dict lookup;
- workspaces: the buffer sets the kernels write and read back, reused per (stream, shape, modes)
  (`triton_backend.workspace`): allocating them and building their descriptors would cost more host time
  than the rest of a call;
- mask lists: active-block lists built from bool masks, reused while a mask is unchanged (`lists_of`);
- orders: device copies of host `orders` tensors;
and, for the whole process, the combinations of the op's non-tensor arguments checked already.

The kernels' launchers keep their compiled launch records themselves (`launcher.CachedLauncher`), as the
sm_90a CUDA family keeps its loaded modules; `clear()` drops those too, and `forget_decisions()` (a pinned config) makes recorded launches stale.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch

from . import dispatch
from .block_lists import ActiveBlocks

# combinations of the op's arguments that are not tensors (modes, backend, block size) checked already: the
# same few repeat on every call (process-wide: they do not depend on the device)
CHECKED_ARGUMENTS: set[tuple] = set()

WORKSPACES = 4  # buffer sets kept per device; the oldest goes beyond, its memory back to torch's allocator
MASK_LISTS = 64  # bool masks whose lists are kept per device


class Runtime:
    def __init__(self, device: torch.device):
        self.device = device
        self._gpu: dispatch.GPU | None = None
        self.decisions: dict[tuple, dispatch.Launch | dispatch.Refusal] = {}
        self.workspaces: OrderedDict = OrderedDict()
        self.mask_lists: OrderedDict[tuple, tuple[torch.Tensor, int, ActiveBlocks]] = OrderedDict()
        self.orders: dict[tuple, torch.Tensor] = {}

    @property
    def gpu(self) -> dispatch.GPU:
        if self._gpu is None:  # torch's capability query costs more host time than a whole decision
            self._gpu = dispatch.gpu_of(self.device)
        return self._gpu

    def decide(self, head_dim: int, dtype: torch.dtype, bq: int, bk: int, qk: str, pv: str, key_mask: bool,
               unit_stride: bool, backend: str) -> dispatch.Launch | dispatch.Refusal:
        """`dispatch.resolve` of this call on this device, decided once per key."""
        key = (head_dim, dtype, bq, bk, qk, pv, key_mask, unit_stride, backend)
        decision = self.decisions.get(key)
        if decision is None:
            call = dispatch.Call(self.gpu, head_dim, dtype, bq, bk, qk, pv, key_mask, unit_stride)
            decision = self.decisions[key] = dispatch.resolve(call, backend)
        return decision

    def lists_of(self, mask: torch.Tensor) -> ActiveBlocks:
        """`ActiveBlocks` of a bool block mask on this device, built there without a host sync, or the kept
        ones of this mask. Kept by the mask's memory and view; the entry holds the mask, so no other tensor
        can take that memory while it is kept, and an in-place write through torch (on any view of the mask)
        bumps the version counter the entry is checked against. Inference tensors have no version counter:
        theirs are built on every call, as while compiling."""
        if torch.compiler.is_compiling() or mask.is_inference():
            return ActiveBlocks.from_mask(self._on_device(mask), sync=False)
        key = (mask.data_ptr(), mask.shape, mask.stride(), mask.device)
        entry = self.mask_lists.get(key)
        if entry is not None and entry[1] == mask._version:
            return entry[2]
        blocks = ActiveBlocks.from_mask(self._on_device(mask), sync=False)
        self.mask_lists[key] = (mask, mask._version, blocks)
        self.mask_lists.move_to_end(key)
        while len(self.mask_lists) > MASK_LISTS:
            self.mask_lists.popitem(last=False)
        return blocks

    def _on_device(self, mask: torch.Tensor) -> torch.Tensor:
        """`mask` on this device without waiting for the GPU: a copy from pageable host memory would wait
        for the work queued on the stream, one from pinned memory is queued behind it."""
        if mask.device == self.device:
            return mask
        if mask.device.type == "cpu" and self.device.type == "cuda":
            return mask.pin_memory().to(self.device, non_blocking=True)
        return mask.to(self.device)

    def device_orders(self, orders: torch.Tensor) -> torch.Tensor:
        """`orders` as contiguous int32 on this device; host orders are copied once per value."""
        if orders.device == self.device:
            if orders.dtype == torch.int32 and orders.is_contiguous():
                return orders
            return orders.to(torch.int32).contiguous()
        if orders.device.type == "cpu":
            key = tuple(int(x) for x in orders.tolist())
            cached = self.orders.get(key)
            if cached is None:
                cached = self.orders[key] = torch.tensor(key, dtype=torch.int32, device=self.device)
            return cached
        return orders.to(device=self.device, dtype=torch.int32)

    def clear(self) -> None:
        self._gpu = None
        self.decisions.clear()
        self.workspaces.clear()
        self.mask_lists.clear()
        self.orders.clear()


_RUNTIMES: dict[torch.device, Runtime] = {}


def runtime_of(device: torch.device) -> Runtime:
    """The runtime of `device` ("cuda" without an index: the current CUDA device's)."""
    runtime = _RUNTIMES.get(device)
    if runtime is None:
        if device.type == "cuda" and device.index is None:
            return runtime_of(torch.device("cuda", torch.cuda.current_device()))
        runtime = _RUNTIMES[device] = Runtime(device)
    return runtime


def forget_decisions() -> None:
    """Decide every call again (a kernel config was pinned); launches recorded under the old ones go stale."""
    from .launcher import invalidate_sequences

    for runtime in _RUNTIMES.values():
        runtime.decisions.clear()
    invalidate_sequences()


def clear() -> None:
    """Empty every device's runtime and the kernels' launch records."""
    for runtime in _RUNTIMES.values():
        runtime.clear()
    CHECKED_ARGUMENTS.clear()
    from .launcher import clear_launchers

    clear_launchers()
    if (sm90 := sys.modules.get(f"{__package__}.sm90")) is not None:  # its loaded modules and build failures
        sm90.forget()
