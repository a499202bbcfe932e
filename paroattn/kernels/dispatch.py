"""Which kernel runs a call, and with which tiles: one table keyed by (GPU arch, head dim, block sizes,
qk, pv), and the reason wherever a call or a variant is refused.

    choice = kernel_choice(arch_of(q.device), D, bq, bk, qk, pv)   # raises KernelUnavailable(reason)

The tiles are the mask's blocks (BLOCK_M = bq, BLOCK_N = bk). What a table entry chooses is the rest:
warps, pipeline depth, how K/V (and Q) tiles are loaded, and whether the warp-specialized Gluon kernel
(`hopper_attention`) runs instead of the Triton one (`block_sparse_attention`). That decides what the
prologue writes: reordered K and V always (quantized in the integer/8-bit modes), and the reordered Q
when the Triton kernel reads Q tiles by descriptor (`KernelConfig.q_tma`).

The entries were measured on an H200 / H100 (sm_90) with `benchmarks/attention.py --sweep`. Other GPUs
run the sm_90 entry's warps and stages with the variants they lack refused, by rule:
- TMA descriptor loads (`tma`, `q_tma`) need sm_90 or newer (and the Triton interpreter emulates them);
- the Gluon kernel needs sm_90 exactly (wgmma) and a triton release it was tested with.
Pins (`set_kernel_config`) replace an entry for sweeps and tests; looked up once per key and cached,
never re-tuned per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import hopper_attention, interpreting
from .launcher import invalidate_sequences

HEAD_DIMS = (64, 128)
TUNED_ARCH = "sm90"
INTERPRETER = "interpreter"


class KernelUnavailable(ValueError):
    """No kernel runs this call; the message says why and what to do."""


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
    # run `hopper_attention`'s warp-specialized Gluon kernel (a loader warp, two consumer warpgroups):
    # bf16/fp16 at 128 x 64 blocks on sm_90; elsewhere the Triton kernel runs with the other fields
    warp_specialized: bool = False


@dataclass(frozen=True)
class KernelChoice:
    """What one launch runs on one GPU."""

    config: KernelConfig
    warp_specialized: bool  # hopper_attention's kernel (when q and out have unit stride along D)
    kv_tma: bool  # Triton kernel: K/V tiles by descriptor loads
    q_tma: bool  # Triton kernel: the prologue writes the reordered Q, read by descriptor loads
    refused: tuple[str, ...] = ()  # variants of the entry this GPU does not run, and why

    def runs_warp_specialized(self, q: torch.Tensor, out: torch.Tensor) -> bool:
        return self.warp_specialized and hopper_attention.takes_strides(q, out)

    def prologue_writes_q(self, q: torch.Tensor, out: torch.Tensor) -> bool:
        # the Gluon kernel's consumers gather their own query rows
        return self.q_tma and not self.runs_warp_specialized(q, out)


# (arch, head_dim, bq, bk, qk, pv) -> config. Each entry is the fastest of a sweep on the CogVideoX-5B
# (D=64), Wan2.1-1.3B and FLUX.1-dev (D=128) shapes at d = 1.0 and 0.2 (0.5 for the 128 x 64 ones);
# where the D=128 shapes disagreed, Wan's choice (the longer sequence) is kept (Flux loses <= 10%).
# int4 values run the int8 kernel: int4 entries repeat the int8 + fp8 ones. Numbers:
# docs/notes/kernels-and-tiles.md and the results files it cites.
_T, _O, _TQ = dict(tma=True), dict(overlap_qk=True), dict(tma=True, q_tma=True)
TABLE: dict[tuple, KernelConfig] = {
    # 64 x 64 blocks: {4 warps x 2/3/4 stages} x {pointer loads, TMA} x {overlap_qk or not}; int8 QK +
    # bf16 PV from an earlier 4-warp sweep
    ("sm90", 64, 64, 64, "bf16", "bf16"): KernelConfig(4, 4, **_T),
    ("sm90", 64, 64, 64, "int8", "bf16"): KernelConfig(4, 4),
    ("sm90", 64, 64, 64, "int8", "fp8"): KernelConfig(4, 3, **_O),
    ("sm90", 64, 64, 64, "int8", "int8"): KernelConfig(4, 3),
    ("sm90", 64, 64, 64, "int4", "fp8"): KernelConfig(4, 3, **_O),
    ("sm90", 128, 64, 64, "bf16", "bf16"): KernelConfig(4, 2, **_T, **_O),
    ("sm90", 128, 64, 64, "int8", "bf16"): KernelConfig(4, 4),
    ("sm90", 128, 64, 64, "int8", "fp8"): KernelConfig(4, 3, **_T, **_O),
    ("sm90", 128, 64, 64, "int8", "int8"): KernelConfig(4, 3, **_O),
    ("sm90", 128, 64, 64, "int4", "fp8"): KernelConfig(4, 3, **_T, **_O),
    # 128-row query tiles, 64-key blocks: one warpgroup issuing two m64 products; Q by descriptor
    # (q_tma) where it was faster at d = 1.0 / 0.5 / 0.2 (D=64 bf16 and int8 PV stay without)
    ("sm90", 64, 128, 64, "bf16", "bf16"): KernelConfig(8, 3),
    ("sm90", 64, 128, 64, "int8", "bf16"): KernelConfig(4, 3),
    ("sm90", 64, 128, 64, "int8", "fp8"): KernelConfig(4, 3, **_TQ),
    ("sm90", 64, 128, 64, "int8", "int8"): KernelConfig(4, 3),
    ("sm90", 64, 128, 64, "int4", "fp8"): KernelConfig(4, 3, **_TQ),
    # D=128 bf16: the warp-specialized Gluon kernel with 3 K/V stages (5-14% faster than the Triton
    # kernel on Wan2.1-1.3B, Wan2.1-14B and FLUX.1-dev on an H100, hopper-warp-specialized-variants-h100.json);
    # the other fields are the Triton kernel's where the Gluon one cannot run
    ("sm90", 128, 128, 64, "bf16", "bf16"): KernelConfig(4, 3, **_TQ, warp_specialized=True),
    ("sm90", 128, 128, 64, "int8", "bf16"): KernelConfig(4, 3, **_TQ),
    ("sm90", 128, 128, 64, "int8", "fp8"): KernelConfig(4, 3, **_TQ),
    ("sm90", 128, 128, 64, "int8", "int8"): KernelConfig(8, 3),
    ("sm90", 128, 128, 64, "int4", "fp8"): KernelConfig(4, 3, **_TQ),
    # 128 x 128 blocks (plans with block_size=128): 4 warps was 2x slower than 8 at D=128; at D=64,
    # 4 warps with Q by descriptor won
    ("sm90", 64, 128, 128, "bf16", "bf16"): KernelConfig(4, 2, **_TQ),
    ("sm90", 64, 128, 128, "int8", "fp8"): KernelConfig(4, 2, **_TQ),
    ("sm90", 128, 128, 128, "bf16", "bf16"): KernelConfig(8, 2, **_T),
    ("sm90", 128, 128, 128, "int8", "fp8"): KernelConfig(8, 3, **_O),
}
del _T, _O, _TQ

# keys not in the table (e.g. 32-token blocks): the warps and stages most entries share
DEFAULT_CONFIG = KernelConfig(4, 3)

_PINNED: dict[tuple, KernelConfig] = {}
_CHOICES: dict[tuple, KernelChoice] = {}


def arch_of(device: torch.device) -> str:
    """"sm90", "sm80", ... for a CUDA device; "interpreter" under TRITON_INTERPRET=1."""
    if interpreting():
        return INTERPRETER
    # asked on every call of the op: torch's query costs more host time than the rest of the choice
    # (a plain dict, which torch.compile traces, where functools.cache would only be warned about)
    arch = _ARCHS.get(device)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(device)
        arch = _ARCHS[device] = f"sm{major}{minor}"
    return arch


_ARCHS: dict[torch.device, str] = {}


def _has_tma(arch: str) -> bool:
    return arch == INTERPRETER or int(arch[2:]) >= 90


def config_problem(config: KernelConfig, bq: int, bk: int, qk: str = "bf16", pv: str = "bf16") -> str | None:
    """What makes `config` unusable for blocks (bq, bk) and modes (qk, pv) on any GPU (None: nothing)."""
    if config.warp_specialized and ((bq, bk) != (hopper_attention.BLOCK_M, hopper_attention.BLOCK_N)
                                    or (qk, pv) not in hopper_attention.MODES):
        return (f"KernelConfig(warp_specialized=True) runs (qk, pv) in {hopper_attention.MODES} at blocks "
                f"({hopper_attention.BLOCK_M}, {hopper_attention.BLOCK_N}); got {config} for blocks ({bq}, {bk}), "
                f"modes ({qk}, {pv})")
    if config.q_tma and (not config.tma or bq < bk):
        return (f"KernelConfig(q_tma=True) needs tma=True and query blocks at least as large as key blocks; "
                f"got {config} for blocks ({bq}, {bk})")
    return None


def _gluon_refusal(arch: str) -> str | None:
    if hopper_attention.gluon is None:
        return "this triton has no Gluon"
    if not triton.__version__.startswith(hopper_attention.TESTED_TRITON):
        return f"triton {triton.__version__} is not one the Gluon kernel was tested with {hopper_attention.TESTED_TRITON}"
    if arch != TUNED_ARCH:
        return f"the Gluon kernel needs sm_90 (wgmma); this is {arch}"
    return None


def kernel_choice(arch: str, head_dim: int, bq: int, bk: int, qk: str, pv: str) -> KernelChoice:
    """The kernel, config and loads of one key on one arch; raises KernelUnavailable when none runs it."""
    key = (arch, head_dim, bq, bk, qk, pv)
    choice = _CHOICES.get(key)
    if choice is not None:
        return choice
    if head_dim not in HEAD_DIMS:
        raise KernelUnavailable(f"the triton backend supports head dims {HEAD_DIMS}; got D={head_dim}")
    blocks = (16, 32, 64, 128) if arch == INTERPRETER else (32, 64, 128)
    if bq not in blocks or bk not in blocks:
        raise KernelUnavailable(f"the triton backend supports block sizes {blocks}; got (bq, bk) = ({bq}, {bk})")
    entry = key[1:]
    config = _PINNED.get(entry) or TABLE.get((TUNED_ARCH, *entry), DEFAULT_CONFIG)
    refused = []
    tma, q_tma = config.tma, config.q_tma
    if (tma or q_tma) and not _has_tma(arch):
        refused.append(f"TMA loads need sm_90 or newer; this is {arch}")
        tma = q_tma = False
    warp_specialized = config.warp_specialized
    if warp_specialized and (reason := _gluon_refusal(arch)):
        refused.append(reason)
        warp_specialized = False
    choice = _CHOICES[key] = KernelChoice(config, warp_specialized, tma, q_tma, tuple(refused))
    return choice


def set_kernel_config(head_dim: int, bq: int, bk: int, qk: str, pv: str, config: KernelConfig | None) -> None:
    """Pin (or with None, forget) the config of one key on every arch; sweeps and tests use this."""
    key = (head_dim, bq, bk, qk, pv)
    if config is not None and (problem := config_problem(config, bq, bk, qk, pv)):
        raise ValueError(problem)
    if config is None:
        _PINNED.pop(key, None)
    else:
        _PINNED[key] = config
    _CHOICES.clear()
    invalidate_sequences()  # recorded launches of the old choice


def kernel_config(head_dim: int, bq: int, bk: int, qk: str, pv: str) -> KernelConfig:
    """The pinned or tabled config of one key (before any variant is refused on a GPU)."""
    key = (head_dim, bq, bk, qk, pv)
    return _PINNED.get(key) or TABLE.get((TUNED_ARCH, *key), DEFAULT_CONFIG)


def unsupported_reason(q: torch.Tensor, bq: int, bk: int, qk: str = "bf16", pv: str = "bf16") -> str | None:
    """Why no Triton kernel runs this call (None when one does): device, dtype, head dim, block sizes."""
    if not (q.is_cuda or interpreting()):
        return f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for tests); got {q.device}"
    try:
        kernel_choice(arch_of(q.device), q.shape[-1], bq, bk, qk, pv)
    except KernelUnavailable as exc:
        return str(exc)
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the triton backend takes float16 or bfloat16 q, k, v; got {q.dtype} (cast them)"
    return None
