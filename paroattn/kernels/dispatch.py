"""Which kernel runs a call: the one decision point of the op.

    decision = resolve(call, backend)      # a Launch (what runs, with which tiles) or a Refusal (why nothing can)

`paro_attention` asks once per eager call (memoized per device by `runtime.Runtime.decide`, the one place
that builds a `Call`) and once per trace; the launch code only executes what it returns (`LaunchPlan`), and
`paro bench` reports it. Nothing here keeps state or compiles anything: a pinned config and the outcome of
building the CUDA kernel are facts of the `Call` that the runtime fills in.

A `Call` holds the static facts of one op call that decide its kernel: the device (`GPU`, one record of
what it can do), q's head dim and dtype, the mask's blocks, the precision modes, whether padded suffix keys
are masked and whether q and out have unit stride along D. Each kernel family declares what it needs as
named predicates, each returning the reason it refuses a call (None: fine); `resolve` tries the families of
a backend in order of preference and returns the first that accepts, with the reasons of those before it.

    backend="torch"   the reference (any device)
    backend="triton"  Gluon warp-specialized, then Triton; none: Refusal
    backend="cuda"    the sm_90a CUDA kernels (`kernels/sm90/`), else as "triton" with a warning naming why
    backend="auto"    the CUDA kernels where measured fastest, then as "triton", then the reference (whose
                      Launch carries the reason, for a warning)

Within the Triton family the tiles come from one table keyed by (head dim, bq, bk, qk, pv), measured on
sm_90 with `benchmarks/attention.py --sweep` (docs/notes/kernels-and-tiles.md); other GPUs run the sm_90 entry's
warps and stages with the variants they lack (TMA loads) turned off, and the Launch says so. Pins
(`runtime.set_kernel_config`) replace an entry for sweeps and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import interpreting

HEAD_DIMS = (64, 128)
BACKENDS = ("auto", "triton", "cuda", "torch")

TRITON = "triton"
GLUON = "gluon-warp-specialized"
CUDA = "cuda-sm90a"
TORCH = "torch-reference"


# ---------------------------------------------------------------------------------------------
# What decides a kernel.


@dataclass(frozen=True)
class GPU:
    """What the kernels need to know of a device, asked once per device (`gpu_of`)."""

    name: str  # "sm90", "sm80", ...; "interpreter" under TRITON_INTERPRET=1; "cpu"
    cuda: bool  # a CUDA GPU: where backend="auto" runs kernels (elsewhere the reference, as expected)
    triton: bool  # Triton kernels run here (a CUDA GPU, or the CPU interpreter)
    tma: bool  # tensor-memory-accelerator descriptor loads (sm_90 and newer; the interpreter emulates them)
    wgmma: bool  # Hopper's warpgroup MMA (sm_90 exactly)
    index: int | None = None  # the CUDA device's index (where a kernel compiled at run time is loaded)
    capability: tuple[int, int] | None = None  # the CUDA compute capability


INTERPRETER = GPU("interpreter", cuda=False, triton=True, tma=True, wgmma=False)
HOST = GPU("cpu", cuda=False, triton=False, tma=False, wgmma=False)


def gpu_of(device: torch.device) -> GPU:
    if interpreting():
        return INTERPRETER
    if device.type != "cuda":
        return HOST
    major, minor = torch.cuda.get_device_capability(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return GPU(f"sm{major}{minor}", cuda=True, triton=True, tma=major >= 9, wgmma=(major, minor) == (9, 0),
               index=index, capability=(major, minor))


@dataclass(frozen=True)
class Call:
    """The static facts of one op call that decide its kernel."""

    gpu: GPU
    head_dim: int
    dtype: torch.dtype
    bq: int
    bk: int
    qk: str
    pv: str
    key_mask: bool = False  # padded suffix keys are masked (HunyuanVideo's text)
    unit_stride: bool = True  # q as the kernel reads it (RoPE writes contiguous copies) and out: stride 1 along D
    pinned: KernelConfig | None = None  # the Triton config pinned for this key (`runtime.set_kernel_config`)
    # why the sm90 CUDA kernel of this head dim and dtype could not be built or loaded on this GPU; None where
    # it was, or where nothing asked (the runtime builds it, as an explicit step, before it decides a call
    # that may run it: `Runtime.decide`)
    cuda_build_problem: str | None = None

    @property
    def key(self) -> tuple:
        """The Triton tile table's key of this call."""
        return (self.head_dim, self.bq, self.bk, self.qk, self.pv)


@dataclass(frozen=True)
class KernelConfig:
    num_warps: int
    num_stages: int
    # read the prologue's K/V tiles with the tensor-memory accelerator (descriptor loads) instead of
    # per-thread pointer loads
    tma: bool = False
    # issue the QK product of the next key block before this block's softmax (software pipelining
    # by one block, so the asynchronous wgmma overlaps the exp2 work)
    overlap_qk: bool = False
    # the prologue also writes the reordered Q (int8/int4 values and per-block scales for integer QK)
    # and the kernel reads each query tile by one descriptor load instead of gathering and quantizing
    # it in registers; needs tma and bq >= bk (the prologue's key-block grid covers the query blocks)
    q_tma: bool = False
    # prefer `hopper_attention`'s warp-specialized Gluon kernel (a loader warp, two consumer warpgroups)
    # where it runs the call; elsewhere the Triton kernel runs with the other fields
    warp_specialized: bool = False


@dataclass(frozen=True)
class Launch:
    """What runs one call."""

    kernel: str  # CUDA, GLUON, TRITON or TORCH
    config: KernelConfig | None = None  # warps, stages and flags of the Triton and Gluon kernels
    kv_tma: bool = False  # Triton kernel: K/V tiles by descriptor loads
    q_tma: bool = False  # Triton kernel: the prologue writes the reordered Q, read by descriptor loads
    passed_over: tuple[str, ...] = ()  # why faster kernels or variants do not run this call
    warning: str | None = None  # a kernel asked for (backend="cuda") or preferred could not run it: why

    @property
    def backend(self) -> str:
        return {TORCH: "torch", CUDA: "cuda"}.get(self.kernel, "triton")

    @property
    def fallback_reason(self) -> str | None:
        """Why the reference runs a call that asked for "auto" (None when a kernel runs it)."""
        return self.passed_over[-1] if self.kernel == TORCH and self.passed_over else None

    def encode(self) -> str:
        """The kernel and tiles as one string (what runs, not why): the custom op takes the decided launch as
        an argument, and a torch.library op takes strings, not objects. `decode` reverses it."""
        if self.config is None:
            return f"{self.kernel}|{int(self.kv_tma)}{int(self.q_tma)}"
        c = self.config
        flags = "".join(str(int(x)) for x in (c.tma, c.overlap_qk, c.q_tma, c.warp_specialized, self.kv_tma, self.q_tma))
        return f"{self.kernel}|{c.num_warps}|{c.num_stages}|{flags}"

    @staticmethod
    def decode(text: str) -> Launch:
        kernel, *fields = text.split("|")
        if len(fields) == 1:
            return Launch(kernel, None, kv_tma=fields[0][0] == "1", q_tma=fields[0][1] == "1")
        warps, stages, flags = fields
        tma, overlap_qk, q_tma, warp_specialized, kv_tma, launch_q_tma = (flag == "1" for flag in flags)
        return Launch(kernel, KernelConfig(int(warps), int(stages), tma, overlap_qk, q_tma, warp_specialized),
                      kv_tma=kv_tma, q_tma=launch_q_tma)

    def describe(self) -> str:
        """One line for benchmarks and logs: the kernel, its config, and what it passed over."""
        parts = [self.kernel]
        if self.config is not None:
            flags = [name for name, on in (("kv_tma", self.kv_tma), ("q_tma", self.q_tma),
                                           ("overlap_qk", self.config.overlap_qk)) if on]
            parts.append(f"{self.config.num_warps} warps x {self.config.num_stages} stages" +
                         (f" ({', '.join(flags)})" if flags else ""))
        if self.passed_over:
            parts.append("passed over: " + "; ".join(self.passed_over))
        return ", ".join(parts)


class LaunchPlan(NamedTuple):
    """Everything one call's launches depend on besides the addresses of its tensors: the decided kernel
    (`launch`, with its config), the geometry, modes (K's scale granularity included) and dtype, the strides of q, k, v and out, the RoPE tables'
    and the key mask's shapes and strides, and the active-block lists' width and dtypes. Built once per eager
    call (`launch.launch`) and once per call of the compiled graph's custom op; every cache of the
    launches derives its key from it (the buffer set, each launcher's compiled kernel, the recorded launch
    sequence), so what was kept for one kernel or config is never used for another. A tuple: it is hashed on
    every eager call."""

    launch: Launch
    shape: torch.Size  # q's [B, H, N, D]
    dtype: torch.dtype
    grid: tuple[int, int, int, int]  # the layout's (prefix, frames, height, width)
    bq: int
    bk: int
    qk: str
    pv: str
    k_scale: str  # K's scale granularity with integer QK, "block" or "token" ("block" without integer QK)
    strides: tuple  # q's, k's, v's and out's
    rotary: tuple | None  # (cos shape, cos strides, sin strides)
    key_mask: tuple | None  # its strides
    lists: tuple  # (entries per list, counts, indices, schedule and orders dtypes)
    sm_scale: float  # last: `kernel_key` leaves it out

    @property
    def kernel_key(self) -> tuple:
        """What the kernels' compiled entries depend on (`launcher.CachedLauncher`): the plan less the softmax
        scale, a float the kernels take as a value, not a specialization (a recorded sequence holds it, so
        sequences are keyed by the whole plan)."""
        return self[:-1]


@dataclass(frozen=True)
class Refusal:
    """No kernel of the asked backend runs the call; `reason` says why and what to do."""

    reason: str


# ---------------------------------------------------------------------------------------------
# The Triton kernels' tile table.

_T, _O, _TQ = dict(tma=True), dict(overlap_qk=True), dict(tma=True, q_tma=True)
TABLE: dict[tuple, KernelConfig] = {
    # (head_dim, bq, bk, qk, pv) -> config. Each entry is the fastest of a sweep on the CogVideoX-5B
    # (D=64), Wan2.1-1.3B and FLUX.1-dev (D=128) shapes at d = 1.0 and 0.2 (0.5 for the 128 x 64 ones);
    # where the D=128 shapes disagreed, Wan's choice (the longer sequence) is kept. int4 values run the
    # int8 kernel: int4 entries repeat the int8 + fp8 ones. Evidence: docs/notes/kernels-and-tiles.md.
    # 64 x 64 blocks: {4 warps x 2/3/4 stages} x {pointer loads, TMA} x {overlap_qk or not}
    (64, 64, 64, "bf16", "bf16"): KernelConfig(4, 4, **_T),
    (64, 64, 64, "int8", "bf16"): KernelConfig(4, 4),
    (64, 64, 64, "int8", "fp8"): KernelConfig(4, 3, **_O),
    (64, 64, 64, "int8", "int8"): KernelConfig(4, 3),
    (64, 64, 64, "int4", "fp8"): KernelConfig(4, 3, **_O),
    (128, 64, 64, "bf16", "bf16"): KernelConfig(4, 2, **_T, **_O),
    (128, 64, 64, "int8", "bf16"): KernelConfig(4, 4),
    (128, 64, 64, "int8", "fp8"): KernelConfig(4, 3, **_T, **_O),
    (128, 64, 64, "int8", "int8"): KernelConfig(4, 3, **_O),
    (128, 64, 64, "int4", "fp8"): KernelConfig(4, 3, **_T, **_O),
    # 128-row query tiles, 64-key blocks: one warpgroup issuing two m64 products; Q by descriptor
    # (q_tma) where it was faster (D=64 bf16 and int8 PV stay without)
    (64, 128, 64, "bf16", "bf16"): KernelConfig(8, 3),
    (64, 128, 64, "int8", "bf16"): KernelConfig(4, 3),
    (64, 128, 64, "int8", "fp8"): KernelConfig(4, 3, **_TQ),
    (64, 128, 64, "int8", "int8"): KernelConfig(4, 3),
    (64, 128, 64, "int4", "fp8"): KernelConfig(4, 3, **_TQ),
    # D=128 bf16: the warp-specialized Gluon kernel with 3 K/V stages
    # (benchmarks/results/hopper-warp-specialized-variants-h100.json); the other fields are the Triton
    # kernel's where the Gluon one cannot run
    (128, 128, 64, "bf16", "bf16"): KernelConfig(4, 3, **_TQ, warp_specialized=True),
    (128, 128, 64, "int8", "bf16"): KernelConfig(4, 3, **_TQ),
    (128, 128, 64, "int8", "fp8"): KernelConfig(4, 3, **_TQ),
    (128, 128, 64, "int8", "int8"): KernelConfig(8, 3),
    (128, 128, 64, "int4", "fp8"): KernelConfig(4, 3, **_TQ),
    # 128 x 128 blocks (plans with block_size=128)
    (64, 128, 128, "bf16", "bf16"): KernelConfig(4, 2, **_TQ),
    (64, 128, 128, "int8", "fp8"): KernelConfig(4, 2, **_TQ),
    (128, 128, 128, "bf16", "bf16"): KernelConfig(8, 2, **_T),
    (128, 128, 128, "int8", "fp8"): KernelConfig(8, 3, **_O),
}
del _T, _O, _TQ

# keys not in the table (e.g. 32-token blocks): the warps and stages most entries share
DEFAULT_CONFIG = KernelConfig(4, 3)
TUNED_ON = "sm90"  # the GPU the table was measured on

def kernel_config(call: Call) -> KernelConfig:
    """The pinned or tabled config of a call (before its GPU turns off what it lacks)."""
    return call.pinned or TABLE.get(call.key, DEFAULT_CONFIG)


def config_problem(config: KernelConfig, bq: int, bk: int, qk: str = "bf16", pv: str = "bf16") -> str | None:
    """What makes `config` unusable for blocks (bq, bk) and modes (qk, pv) on any GPU (None: nothing)."""
    from . import hopper_attention

    if config.warp_specialized and ((bq, bk) != (hopper_attention.BLOCK_M, hopper_attention.BLOCK_N)
                                    or (qk, pv) not in hopper_attention.MODES):
        return (f"KernelConfig(warp_specialized=True) runs (qk, pv) in {hopper_attention.MODES} at blocks "
                f"({hopper_attention.BLOCK_M}, {hopper_attention.BLOCK_N}); got {config} for blocks ({bq}, {bk}), "
                f"modes ({qk}, {pv})")
    if config.q_tma and (not config.tma or bq < bk):
        return (f"KernelConfig(q_tma=True) needs tma=True and query blocks at least as large as key blocks; "
                f"got {config} for blocks ({bq}, {bk})")
    return None


# ---------------------------------------------------------------------------------------------
# The kernel families: what each needs, as named predicates.


def _on_triton_device(call: Call) -> str | None:
    if not call.gpu.triton:
        return f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for tests); got {call.gpu.name}"
    return None


def _head_dim_64_or_128(call: Call) -> str | None:
    if call.head_dim not in HEAD_DIMS:
        return f"the triton backend supports head dims {HEAD_DIMS}; got D={call.head_dim}"
    return None


def _tiled_blocks(call: Call) -> str | None:
    blocks = (16, 32, 64, 128) if call.gpu is INTERPRETER else (32, 64, 128)
    if call.bq not in blocks or call.bk not in blocks:
        return f"the triton backend supports block sizes {blocks}; got (bq, bk) = ({call.bq}, {call.bk})"
    return None


def _half_precision(call: Call) -> str | None:
    if call.dtype not in (torch.float16, torch.bfloat16):
        return f"the triton backend takes float16 or bfloat16 q, k, v; got {call.dtype} (cast them)"
    return None


def _table_prefers_warp_specialized(call: Call) -> bool:
    return kernel_config(call).warp_specialized


def _gluon_tested(call: Call) -> str | None:
    import triton

    from . import hopper_attention

    if hopper_attention.gluon is None:
        return "this triton has no Gluon"
    if not triton.__version__.startswith(hopper_attention.TESTED_TRITON):
        return f"triton {triton.__version__} is not one the Gluon kernel was tested with {hopper_attention.TESTED_TRITON}"
    return None


def _has_wgmma(call: Call) -> str | None:
    if not call.gpu.wgmma:
        return f"the Gluon kernel needs sm_90 (wgmma); this is {call.gpu.name}"
    return None


def _no_key_mask(call: Call) -> str | None:
    # the padded model (HunyuanVideo) runs integer QK, the Triton kernel's anyway; the Gluon kernel's
    # pipelined consumers could not be checked with a mask in the interpreter
    return "the Gluon kernel takes no key mask" if call.key_mask else None


def _unit_stride(call: Call) -> str | None:
    # a stride passed to a Gluon worker partition is a runtime value: 1 must be built in for 16-byte accesses
    return None if call.unit_stride else "the Gluon kernel reads q and writes out with unit stride along D"


def _sm90_kernel_takes(call: Call) -> str | None:
    from . import sm90

    return sm90.refusal((1, 1, 0, call.head_dim), call.dtype, call.head_dim, call.bq, call.bk, call.qk, call.pv,
                        call.key_mask, call.gpu.capability)


def _sm90_kernel_built(call: Call) -> str | None:
    return call.cuda_build_problem


# keys where the CUDA kernels are measured faster than the Triton kernel on sm_90, which "auto" then prefers:
# int8 QK + fp8 PV at both head dims, whole op calls at CogVideoX-5B, Wan2.1-1.3B, Wan2.1-14B 720p and FLUX.1-dev,
# d = 1 and 0.2, H100 (benchmarks/results/attention-int8fp8-sm90-cuda-vs-triton-fa3-nvidia-h100-bq128-bk64.json
# and ...-wan2.1-14b-720p-d0.2-nvidia-h100.json). int4 QK is not measured.
CUDA_PREFERRED: set[tuple] = {(64, 128, 64, "int8", "fp8"), (128, 128, 64, "int8", "fp8")}


def _cuda_preferred(call: Call) -> bool:
    return call.key in CUDA_PREFERRED


@dataclass(frozen=True)
class KernelFamily:
    kernel: str
    needs: tuple[Callable[[Call], str | None], ...]  # each: the reason it refuses a call, or None
    tiles: Callable[[Call], Launch]
    preferred: Callable[[Call], bool] = lambda call: True  # where it is not, it is skipped without a reason
    asked_by: str | None = None  # the backend that names this family: it is then tried whatever `preferred` says
    # a refusal after it was asked for or preferred is worth a warning (it can fail for reasons a user can fix)
    warns: bool = False

    def refusal(self, call: Call) -> str | None:
        for need in self.needs:
            if (reason := need(call)) is not None:
                return reason
        return None


def _triton_tiles(call: Call) -> Launch:
    config = kernel_config(call)
    passed_over = ()
    tma, q_tma = config.tma, config.q_tma
    if (tma or q_tma) and not call.gpu.tma:
        passed_over = (f"TMA loads need sm_90 or newer; this is {call.gpu.name}",)
        tma = q_tma = False
    return Launch(TRITON, config, kv_tma=tma, q_tma=q_tma, passed_over=passed_over)


_TRITON_NEEDS = (_on_triton_device, _head_dim_64_or_128, _tiled_blocks, _half_precision)
TRITON_FAMILY = KernelFamily(TRITON, _TRITON_NEEDS, _triton_tiles)
GLUON_FAMILY = KernelFamily(
    GLUON, (*_TRITON_NEEDS, _gluon_tested, _has_wgmma, _no_key_mask, _unit_stride),
    lambda call: Launch(GLUON, kernel_config(call)),
    preferred=_table_prefers_warp_specialized,
)
CUDA_FAMILY = KernelFamily(
    CUDA, (_on_triton_device, _sm90_kernel_takes, _sm90_kernel_built),
    lambda call: Launch(CUDA, q_tma=True),  # reads the reordered int8 Q with per-block scales the prologue writes
    preferred=_cuda_preferred, asked_by="cuda", warns=True,
)
TORCH_FAMILY = KernelFamily(TORCH, (), lambda call: Launch(TORCH))

# per backend, its families in order of preference; the last kernel family's refusal is the one a caller
# is told (the others are faster variants of it)
FAMILIES: dict[str, tuple[KernelFamily, ...]] = {
    "torch": (TORCH_FAMILY,),
    "triton": (GLUON_FAMILY, TRITON_FAMILY),
    "cuda": (CUDA_FAMILY, GLUON_FAMILY, TRITON_FAMILY),
    "auto": (CUDA_FAMILY, GLUON_FAMILY, TRITON_FAMILY, TORCH_FAMILY),
}


def asks_for_cuda_build(call: Call, backend: str) -> bool:
    """Whether deciding `call` for `backend` may run the sm90 CUDA kernel, so the runtime builds (or loads)
    it first and passes how that went as `Call.cuda_build_problem`: where the backend names the CUDA family,
    or "auto" prefers it, and the call is one it takes."""
    if CUDA_FAMILY not in FAMILIES[backend] or (backend == "auto" and not call.gpu.cuda):
        return False
    if backend != CUDA_FAMILY.asked_by and not CUDA_FAMILY.preferred(call):
        return False
    return _on_triton_device(call) is None and _sm90_kernel_takes(call) is None


def resolve(call: Call, backend: str = "auto") -> Launch | Refusal:
    """The first family of `backend` that runs `call`, with the reasons of the preferred ones that do not
    (for "auto" falling back to the reference, its last reason is why: `Launch.fallback_reason`)."""
    if backend == "auto" and not call.gpu.cuda:
        return Launch(TORCH)  # off CUDA, the reference is what "auto" means: nothing to warn about
    reasons: list[str] = []
    warning = None
    for family in FAMILIES[backend]:
        if backend != family.asked_by and not family.preferred(call):
            continue
        reason = family.refusal(call)
        if reason is None:
            launch = family.tiles(call)
            return Launch(launch.kernel, launch.config, launch.kv_tma, launch.q_tma, (*reasons, *launch.passed_over),
                          warning)
        reasons.append(reason)
        if family.warns and warning is None:
            warning = f"{reason}: the Triton kernels run this call instead"
    return Refusal(reasons[-1])


# ---------------------------------------------------------------------------------------------
# Calibration's block statistics (`calibrate.block_stats`): a Triton kernel or its torch reference.


def block_stats_backend(device: torch.device, backend: str = "auto") -> str:
    """"triton" or "torch" for the block statistics of tensors on `device`; "auto" takes the Triton kernel on
    CUDA. Raises ValueError naming what to pass where `backend` cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    gpu = HOST if device.type != "cuda" and not interpreting() else gpu_of(device)
    if backend == "auto":
        return "triton" if gpu.cuda and _triton_installed() else "torch"
    if backend == "triton" and not (gpu.triton and _triton_installed()):
        raise ValueError("backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1) and triton installed; "
                         "use backend='torch'")
    return backend


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
