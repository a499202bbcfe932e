"""Every piece of state the op keeps between calls, in one place: one `Runtime` per device, and `PROCESS`
for what does not depend on the device. `clear()` empties them all. No other module keeps a mutable cache.

Per device (`runtime_of(device)`):
- decisions: `dispatch.resolve` per call key (`decide`, the one place that builds a `dispatch.Call`), so an
  eager call decides its kernel with one dict lookup; where a call may run the sm90 CUDA kernel, deciding it
  builds (or loads) that kernel first, as an explicit step whose outcome is a fact of the `Call`;
- workspaces: the buffer sets the kernels write and read back (`Buffers`, built by `allocate` and nowhere else),
  reused per stream and `LaunchPlan` (`workspace`): allocating them and building their descriptors would cost
  more host time than the rest of a call. Each set keeps the launch sequences recorded into it
  (`launcher.LaunchSequences`), keyed by the call's `LaunchPlan`;
- mask lists: active-block lists built from bool masks, reused while a mask is unchanged (`lists_of`);
- orders: device copies of host `orders` tensors;
- the sm90 CUDA kernels built and loaded on the device (`cuda_kernel`), or why they could not be.

Per process (`PROCESS`): the combinations of the op's non-tensor arguments checked already, the pinned
Triton configs (`set_kernel_config`), and the launchers of the Triton kernels and what they share
(`launcher.LaunchState`). What the integrations keep (bound processors, patched transformers, masks) lives
with them; `paroattn.reset()` clears theirs and this module's at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from . import dispatch
from .block_lists import ActiveBlocks
from .launcher import LaunchSequences, LaunchState
from .statistics import Statistics

WORKSPACES = 4  # buffer sets kept per device; the oldest goes beyond, its memory back to torch's allocator
MASK_LISTS = 64  # bool masks whose lists are kept per device
SEQUENCES = 16  # recorded launch sequences per buffer set (one per distinct call into it, e.g. strides)


@dataclass
class Buffers:
    """What a call writes and then reads back: the statistics of the quantized modes, the prologue's
    reordered (quantized) K, V and Q with their scales, the RoPE pass's rotated q and k, and the
    descriptors the attention kernels read them by. `placeholder` (1 element) where the modes do not use a
    part, and for pointer arguments a mode does not read: one per set, as the set's memory is (a placeholder
    kept across calls, made in a CUDA-graph pool, would outlive what the graph trees account for)."""

    kq: torch.Tensor
    k_scale: torch.Tensor
    vq: torch.Tensor
    qq: torch.Tensor
    q_scale: torch.Tensor
    placeholder: torch.Tensor
    rotated: tuple[torch.Tensor, torch.Tensor] | None = None
    statistics: Statistics | None = None
    descriptors: dict = field(default_factory=dict)  # built once per buffer set, by the launch that reads them
    # the launches of earlier calls into this set (`launcher.LaunchSequences`); None: a set of one call (a graph
    # capture, the custom op), which records nothing
    sequences: LaunchSequences | None = None
    addresses: set[int] = field(init=False)  # where this set's buffers (its placeholder included) live

    def __post_init__(self):
        tensors = [self.kq, self.k_scale, self.vq, self.qq, self.q_scale, self.placeholder, *(self.rotated or ())]
        if self.statistics is not None:
            stats = self.statistics
            tensors += [stats.k_mean, stats.v_amax, stats.k_partial, stats.v_partial, stats.arrivals]
        self.addresses = {t.data_ptr() for t in tensors}


def allocate(B: int, H: int, N: int, D: int, dtype: torch.dtype, device, bq: int, bk: int, qk: str, pv: str,
             write_q: bool, rotary: bool = False, k_scale: str = "block") -> Buffers:
    nk, nq = -(-N // bk), -(-N // bq)
    n_pad = nk * bk
    placeholder = torch.zeros(1, dtype=torch.float32, device=device)
    k_scales = qq = q_scale = placeholder
    if qk != "bf16":
        kq = torch.empty(B * H, n_pad, D, dtype=torch.int8, device=device)  # int8 or int4 values
        # a scale per key block, or per key (k_scale="token")
        k_scales = torch.empty(B * H, n_pad if k_scale == "token" else nk, dtype=torch.float32, device=device)
    else:
        kq = torch.empty(B * H, n_pad, D, dtype=dtype, device=device)
    if pv != "bf16":
        vq = torch.empty(B * H, D, n_pad, dtype=torch.float8_e4m3fn if pv == "fp8" else torch.int8, device=device)
    else:
        vq = torch.empty(B * H, n_pad, D, dtype=dtype, device=device)
    if write_q:
        qq = torch.empty(B * H, nq * bq, D, dtype=dtype if qk == "bf16" else torch.int8, device=device)
        if qk != "bf16":
            q_scale = torch.empty(B * H, nq, dtype=torch.float32, device=device)
    rotated = None
    if rotary:
        q_rot = torch.empty(B, H, N, D, dtype=dtype, device=device)
        rotated = (q_rot, torch.empty_like(q_rot))
    stats = Statistics(B, H, N, D, device) if qk != "bf16" or pv != "bf16" else None
    return Buffers(kq, k_scales, vq, qq, q_scale, placeholder, rotated, stats)


def stream_of(device: torch.device) -> int | None:
    """The current stream's handle on a CUDA device (None: capturing a graph, no reuse); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    if torch.cuda.is_current_stream_capturing():
        return None
    from triton.runtime import driver

    return driver.active.get_current_stream(device.index)


class Process:
    """The state of the op that does not depend on a device."""

    def __init__(self):
        # combinations of the op's arguments that are not tensors (modes, backend, block size) checked already
        self.checked_arguments: set[tuple] = set()
        self.pins: dict[tuple, dispatch.KernelConfig] = {}  # (head_dim, bq, bk, qk, pv) -> pinned config
        self.launches = LaunchState()
        self._decoded: dict[str, dispatch.Launch] = {}

    def launch_of(self, code: str) -> dispatch.Launch:
        """`dispatch.Launch.decode(code)`, decoded once per process (the custom op gets the code on every call)."""
        launch = self._decoded.get(code)
        if launch is None:
            launch = self._decoded[code] = dispatch.Launch.decode(code)
        return launch

    def launcher(self, kernel):
        """The process's `launcher.CachedLauncher` of a Triton or Gluon kernel."""
        return self.launches.launcher(kernel)


PROCESS = Process()


class Runtime:
    def __init__(self, device: torch.device):
        self.device = device
        self._gpu: dispatch.GPU | None = None
        self.decisions: dict[tuple, dispatch.Launch | dispatch.Refusal] = {}
        self.workspaces: OrderedDict = OrderedDict()
        self.mask_lists: OrderedDict[tuple, tuple[torch.Tensor, int, ActiveBlocks]] = OrderedDict()
        self.orders: dict[tuple, torch.Tensor] = {}
        self.last_launch: dispatch.LaunchPlan | None = None  # what the latest kernel call here ran (tests read it)
        # the sm90 CUDA kernel of each (head dim, dtype, K scale granularity) built and loaded here, and why others
        # could not be
        self.cuda_kernels: dict[tuple[int, torch.dtype, str], object] = {}
        self.cuda_failures: dict[tuple[int, torch.dtype, str], str] = {}

    @property
    def gpu(self) -> dispatch.GPU:
        if self._gpu is None:  # torch's capability query costs more host time than a whole decision
            self._gpu = dispatch.gpu_of(self.device)
        return self._gpu

    def decide(self, head_dim: int, dtype: torch.dtype, bq: int, bk: int, qk: str, pv: str, key_mask: bool,
               unit_stride: bool, backend: str, k_scale: str = "block") -> dispatch.Launch | dispatch.Refusal:
        """`dispatch.resolve` of this call on this device, decided once per key. The one place that builds a
        `dispatch.Call`: with the pinned config of its key, and, where the call may run the sm90 CUDA kernel,
        with how building that kernel went (built here first: NVRTC, or the disk cache, then loaded; the variant of
        `k_scale`, which picks no kernel but is compiled into the CUDA one)."""
        key = (head_dim, dtype, bq, bk, qk, pv, key_mask, unit_stride, backend, k_scale)
        decision = self.decisions.get(key)
        if decision is None:
            call = dispatch.Call(self.gpu, head_dim, dtype, bq, bk, qk, pv, key_mask, unit_stride,
                                 pinned=PROCESS.pins.get((head_dim, bq, bk, qk, pv)))
            if dispatch.asks_for_cuda_build(call, backend):
                call = replace(call, cuda_build_problem=self.build_cuda_kernel(head_dim, dtype, k_scale))
            decision = self.decisions[key] = dispatch.resolve(call, backend)
        return decision

    def build_cuda_kernel(self, head_dim: int, dtype: torch.dtype, k_scale: str = "block") -> str | None:
        """Build (or read from the disk cache) and load the sm90 CUDA kernel of a head dim, dtype and K scale
        granularity on this device, once; None when it is ready, else why it is not."""
        from . import sm90

        key = (head_dim, dtype, k_scale)
        if key not in self.cuda_kernels and key not in self.cuda_failures:
            try:
                self.cuda_kernels[key] = sm90.build(head_dim, dtype, self.device, k_scale)
            except sm90.KernelLoadError as error:
                self.cuda_failures[key] = f"the sm90 CUDA kernel could not be built: {error}"
        return self.cuda_failures.get(key)

    def cuda_kernel(self, head_dim: int, dtype: torch.dtype, k_scale: str = "block"):
        """The loaded sm90 CUDA kernel of a head dim, dtype and K scale granularity (built first if no decision
        asked for it yet); raises KernelLoadError with why it could not be built."""
        if (problem := self.build_cuda_kernel(head_dim, dtype, k_scale)) is not None:
            from .sm90 import KernelLoadError

            raise KernelLoadError(problem)
        return self.cuda_kernels[(head_dim, dtype, k_scale)]

    def workspace(self, plan: dispatch.LaunchPlan, stream: int | None) -> Buffers:
        """The reused buffer set of `stream` (`stream_of`) for calls of `plan`'s kernel and shape, with the launch
        sequences recorded into it; a fresh set, which records nothing, while a graph is captured (stream None).
        Calls on one stream run in order, so a call's prologue writes the buffers only after the previous call's
        kernels read them; a call on another stream gets its own set. While a CUDA graph is captured, each call
        allocates (from the graph's pool)."""
        B, H, N, D = plan.shape
        rotary = plan.rotary is not None
        key = (stream, plan.launch, plan.shape, plan.dtype, plan.bq, plan.bk, plan.qk, plan.pv, plan.k_scale, rotary)
        kept = self.workspaces
        buffers = kept.get(key) if stream is not None else None
        if buffers is None:
            buffers = allocate(B, H, N, D, plan.dtype, self.device, plan.bq, plan.bk, plan.qk, plan.pv,
                               plan.launch.q_tma, rotary, plan.k_scale)
            if stream is not None:
                buffers.sequences = LaunchSequences(PROCESS.launches, buffers.addresses, SEQUENCES)
                kept[key] = buffers
                while len(kept) > WORKSPACES:
                    kept.popitem(last=False)
        elif len(kept) > 1:
            kept.move_to_end(key)
        return buffers

    def kernel_inputs(self, orders: torch.Tensor, block_mask: torch.Tensor | ActiveBlocks
                      ) -> tuple[torch.Tensor, ActiveBlocks]:
        """A checked call's `orders` and mask as the kernels take them on this device: contiguous int32 orders
        (`device_orders`) and active-block lists (prebuilt ones moved here if they are elsewhere, or the kept
        lists of a bool mask: `lists_of`)."""
        blocks = block_mask if isinstance(block_mask, ActiveBlocks) else self.lists_of(block_mask)
        if blocks.counts.device != self.device:
            blocks = blocks.to(self.device)
        return self.device_orders(orders), blocks

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
        self.last_launch = None
        self.cuda_kernels.clear()
        self.cuda_failures.clear()
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


def decide_launch(device: torch.device, head_dim: int, dtype: torch.dtype, bq: int, bk: int, qk: str, pv: str,
           key_mask: bool, rotary: bool, stride: int, backend: str, k_scale: str = "block"
           ) -> dispatch.Launch | dispatch.Refusal:
    """The decision for a call on `device` of q with this head dim, dtype and stride along D: the device
    runtime's (`Runtime.decide`), eagerly; while torch.compile traces the call, the same made eagerly and kept
    in the graph as a constant (`_decided_while_traced`). q and out have unit stride along D where the RoPE
    pass writes contiguous copies or q has it (a new out is strided like q)."""
    if torch.compiler.is_compiling():
        code = _decided_while_traced(str(device), _plain(head_dim, _TRACED_SIZES), dtype, _plain(bq, _TRACED_SIZES),
                                     _plain(bk, _TRACED_SIZES), qk, pv, key_mask, rotary or _plain(stride, (1,)) == 1,
                                     backend, k_scale)
        return dispatch.Refusal(code[1:]) if code.startswith("!") else dispatch.Launch.decode(code)
    return runtime_of(device).decide(head_dim, dtype, bq, bk, qk, pv, key_mask, rotary or stride == 1, backend,
                                     k_scale)


@torch._dynamo.assume_constant_result
def _decided_while_traced(device: str, head_dim: int, dtype: torch.dtype, bq: int, bk: int, qk: str, pv: str,
                          key_mask: bool, unit_stride: bool, backend: str, k_scale: str) -> str:
    """`Runtime.decide` of a call being traced, made eagerly while it is traced (dynamo cannot trace the
    dispatcher, and a memo filled while tracing would recompile the next call), as a string dynamo keeps as a
    constant: the decided launch (`Launch.encode`) where a kernel runs it, else "!" and the reason it does not
    (if any)."""
    decision = runtime_of(torch.device(device)).decide(head_dim, dtype, bq, bk, qk, pv, key_mask, unit_stride,
                                                       backend, k_scale)
    if isinstance(decision, dispatch.Refusal):
        return "!" + decision.reason
    return decision.encode() if decision.backend != "torch" else "!" + (decision.fallback_reason or "")


# head dims and block sizes a traced call's decision sees as themselves; others as -1, which every kernel refuses
_TRACED_SIZES = (16, 32, 48, 64, 80, 96, 128, 256)


def _plain(size, known: tuple[int, ...]) -> int:
    """`size` as a Python int while torch.compile traces, where a size that changed between compiles is
    symbolic and cannot enter a constant function: compared with the values in `known` (each comparison a
    guard, so a new value recompiles), -1 where it is none of them."""
    for value in known:  # (no isinstance(size, int) shortcut: dynamo answers True for a symbolic int too)
        if size == value:
            return value
    return -1


def set_kernel_config(head_dim: int, bq: int, bk: int, qk: str, pv: str,
                      config: dispatch.KernelConfig | None) -> None:
    """Pin (or with None, forget) the Triton config of one key on every GPU; sweeps and tests use this. Calls
    decide again; what was kept for the old config stays with it (its buffer sets and recorded launches are
    keyed by the `LaunchPlan`, which holds the config)."""
    key = (head_dim, bq, bk, qk, pv)
    if config is not None and (problem := dispatch.config_problem(config, bq, bk, qk, pv)):
        raise ValueError(problem)
    if config is None:
        PROCESS.pins.pop(key, None)
    else:
        PROCESS.pins[key] = config
    for runtime in _RUNTIMES.values():
        runtime.decisions.clear()


def kernel_config(head_dim: int, bq: int, bk: int, qk: str, pv: str) -> dispatch.KernelConfig:
    """The Triton config of one key: pinned, or the table's (before a GPU turns off what it lacks)."""
    key = (head_dim, bq, bk, qk, pv)
    return PROCESS.pins.get(key) or dispatch.TABLE.get(key, dispatch.DEFAULT_CONFIG)


def clear() -> None:
    """Empty every device's runtime and the process's caches (pins stay: they are settings, not caches)."""
    for runtime in _RUNTIMES.values():
        runtime.clear()
    PROCESS.checked_arguments.clear()
    PROCESS.launches.clear()
