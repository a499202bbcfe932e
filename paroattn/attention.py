"""`paro_attention`: the one functional op that processors, calibration checks and benchmarks call.
Its contract is the function's docstring; `kernels/reference.py` is its definition in torch, and every
kernel must agree with it. Which kernel runs a call is decided in one place, `kernels.dispatch.resolve`
(`decide` below asks it, eager or traced, through the device's runtime); `kernels.launch.run` executes the
decision.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from .errors import PAROInputError
from .kernels.block_lists import ActiveBlocks
from .kernels.dispatch import BACKENDS, Launch, Refusal
from .kernels.reference import paro_attention_reference
from .kernels.runtime import PROCESS, decide_launch
from .layout import ORDERS, TokenLayout
from .masks import block_sizes, mask_shape
from .modes import k_scale_problem, modes_problem


@torch._dynamo.assume_constant_result
def _warn_while_traced(message: str) -> bool:
    warnings.warn(message, stacklevel=1)
    return True


def warn(message: str, stacklevel: int = 2) -> None:
    """`warnings.warn`, also from code that torch.compile traces, which cannot trace it (a graph break, an
    error with fullgraph=True): there the warning is given once, while the graph is traced."""
    if torch.compiler.is_compiling():
        _warn_while_traced(message)
    else:
        warnings.warn(message, stacklevel=stacklevel + 1)


def check_rotary(rotary, q: torch.Tensor) -> None:
    if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2 and all(isinstance(t, torch.Tensor) for t in rotary)):
        raise PAROInputError(f"rotary must be a pair of tensors (cos, sin), got {type(rotary).__name__}")
    cos, sin = rotary
    B, H, N, D = q.shape
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D or not 0 < cos.shape[0] <= N:
        raise PAROInputError(
            f"rotary tables must both be [S, D] with D={D} and 0 < S <= N={N} (they rotate the last S tokens); "
            f"got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise PAROInputError(f"rotary tables must be float32; got {cos.dtype}, {sin.dtype} (pass cos.float())")
    if cos.device != q.device or sin.device != q.device:
        raise PAROInputError(f"rotary tables must be on q's device {q.device}; got {cos.device}, {sin.device}")
    if D % 2:
        raise PAROInputError(f"RoPE rotates pairs of channels; head dim {D} is odd")


def check_suffix_mask(suffix_mask, q: torch.Tensor, layout: TokenLayout) -> None:
    B = q.shape[0]
    if not isinstance(suffix_mask, torch.Tensor):
        raise PAROInputError(f"suffix_mask must be a bool tensor [B, layout.suffix], got {type(suffix_mask).__name__}")
    if not layout.suffix:
        raise PAROInputError(
            f"suffix_mask marks padded suffix tokens, but the layout {layout} has no suffix: pass a layout with "
            "suffix=S for S tokens after the grid, or no suffix_mask"
        )
    if suffix_mask.dtype != torch.bool or tuple(suffix_mask.shape) != (B, layout.suffix):
        raise PAROInputError(
            f"suffix_mask must be bool [B, layout.suffix] = [{B}, {layout.suffix}] (True: a token, False: padding); "
            f"got {suffix_mask.dtype} {tuple(suffix_mask.shape)}"
        )
    if suffix_mask.device != q.device:
        raise PAROInputError(f"suffix_mask must be on q's device {q.device}; got {suffix_mask.device}")


def decide(q: torch.Tensor, bq: int, bk: int, qk: str, pv: str, backend: str, *, key_mask: bool = False,
           rotary: bool = False, device: torch.device | None = None, k_scale: str = "block") -> Launch | Refusal:
    """Which kernel runs a call of `paro_attention` with q on `device` (by default q's), eager or traced by
    torch.compile (`kernels.runtime.decide_launch`): the op and benchmarks ask this, never the kernels' modules
    (`kernel_for` asks the same without a tensor)."""
    return decide_launch(q.device if device is None else torch.device(device), q.shape[-1], q.dtype, bq, bk, qk, pv,
                       key_mask, rotary, q.stride(-1), backend, k_scale)


def kernel_for(device: torch.device | str, dtype: torch.dtype, head_dim: int, block_size: int | tuple[int, int],
               qk: str, pv: str, backend: str, *, key_mask: bool = False, rotary: bool = False,
               k_scale: str = "block") -> str | None:
    """Which kernel would run a `paro_attention` call of q with `dtype` and `head_dim` on `device`, these block
    sizes, modes and backend (q with unit stride along D, as models pass it): the kernel's name
    (`kernels.dispatch`: "cuda-sm90a", "gluon-warp-specialized", "triton"), or None where the torch reference
    runs it or no kernel of `backend` can (the call itself then raises). The same decision as the call's (`decide`), asked without a
    tensor: integrations choose the form of their masks by it (active-block lists for a kernel)."""
    if backend == "torch":
        return None
    bq, bk = block_sizes(block_size)
    decision = decide_launch(torch.device(device), head_dim, dtype, bq, bk, qk, pv, key_mask, rotary, 1, backend,
                             k_scale)
    return decision.kernel if isinstance(decision, Launch) and decision.backend != "torch" else None


def _check_arguments(qk, pv, backend, block_size, k_scale="block") -> None:
    if problem := modes_problem(qk, pv) or k_scale_problem(k_scale):
        raise PAROInputError(problem)
    if backend not in BACKENDS:
        raise PAROInputError(f"backend={backend!r}; expected one of {BACKENDS}")
    pair = isinstance(block_size, (tuple, list))
    sizes = tuple(block_size) if pair else (block_size,)
    if (pair and len(sizes) != 2) or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes):
        raise PAROInputError(
            "block_size must be a positive int or a pair (bq, bk) of positive ints, e.g. 64 or (128, 64); "
            f"got {block_size!r}"
        )


def check_sm_scale(sm_scale) -> None:
    if sm_scale is None:
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise PAROInputError(
            f"sm_scale must be a positive Python number (or None for 1 / sqrt(D)), got {type(sm_scale).__name__} "
            f"{sm_scale!r}: pass e.g. sm_scale=0.125"
        )
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise PAROInputError(f"sm_scale must be finite and > 0 (or None for 1 / sqrt(D)), got {sm_scale}")


def check_orders(orders, H: int) -> None:
    if not isinstance(orders, torch.Tensor):
        raise PAROInputError(
            f"orders must be an integer tensor [H] of indices into ORDERS, got {type(orders).__name__}: pass "
            "torch.tensor(orders)"
        )
    if orders.dtype == torch.bool or orders.dtype.is_floating_point or orders.dtype.is_complex:
        raise PAROInputError(
            f"orders must be an integer tensor (indices into ORDERS), got {orders.dtype}: pass orders.long()"
        )
    if orders.shape != (H,):
        raise PAROInputError(f"orders must have shape [H] = [{H}], got {tuple(orders.shape)}")


def check_inputs(q, k, v, layout, orders, block_mask, block_size, qk, pv, backend, rotary=None,
                 suffix_mask=None, sm_scale=None, k_scale="block") -> None:
    """Raise PAROInputError naming what was expected, what was found and what to do."""
    # the arguments that are not tensors repeat from call to call: checked once per combination (strings,
    # and an exact int or pair of ints as block_size, so that True never passes for 1 and nothing
    # unhashable is looked up). Not while traced: the set would change between the trace and the next
    # call, which would recompile it
    exact = (type(qk) is str and type(pv) is str and type(backend) is str and type(k_scale) is str
             and (type(block_size) is int or (type(block_size) is tuple and len(block_size) == 2
                                              and type(block_size[0]) is int and type(block_size[1]) is int)))
    static = (qk, pv, backend, block_size, k_scale) if exact and not torch.compiler.is_compiling() else None
    checked = PROCESS.checked_arguments
    if static is None or static not in checked:
        _check_arguments(qk, pv, backend, block_size, k_scale)
        if static is not None and len(checked) < 256:
            checked.add(static)
    if not isinstance(layout, TokenLayout):
        raise PAROInputError(f"layout must be a paroattn.TokenLayout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise PAROInputError(f"{name} must be a tensor [B, H, N, D], got {type(t).__name__}")
    check_sm_scale(sm_scale)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise PAROInputError(f"{name} must be [B, H, N, D], got shape {tuple(t.shape)}")
    if not (q.shape == k.shape == v.shape):
        raise PAROInputError(
            f"q, k, v must have one shape [B, H, N, D] (self-attention); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise PAROInputError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise PAROInputError(f"q, k, v must be float16, bfloat16 or float32; got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise PAROInputError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    B, H, N, D = q.shape
    if D < 1:
        raise PAROInputError(f"q, k, v must have a head dim D >= 1 in [B, H, N, D]; got shape {tuple(q.shape)}")
    if rotary is not None:
        check_rotary(rotary, q)
    if suffix_mask is not None:
        check_suffix_mask(suffix_mask, q, layout)
    if N != layout.seq_len:
        raise PAROInputError(
            f"sequence length {N} does not match the layout {layout} ({layout.seq_len} tokens): "
            "the layout must describe the tokens of this call"
        )
    check_orders(orders, H)
    # reading the values of a device tensor would sync every call (and cannot be traced or captured):
    # orders on the device are trusted, as processors pass them from plans, which validate them when
    # built or loaded; orders on the host are checked here
    checkable = orders.device.type == "cpu" and not torch.compiler.is_compiling()
    if orders.numel() and checkable and (int(orders.min()) < 0 or int(orders.max()) >= len(ORDERS)):
        raise PAROInputError(f"orders must index ORDERS (0..{len(ORDERS) - 1}), got values {orders.tolist()}")
    nq, nk = mask_shape(N, block_size)
    if isinstance(block_mask, ActiveBlocks):
        if block_mask.shape != (H, nq, nk):
            raise PAROInputError(
                f"active block lists are for [H, nq, nk] = {list(block_mask.shape)}; this call needs "
                f"{[H, nq, nk]} (N={N}, block_size={block_size})"
            )
        return
    if not isinstance(block_mask, torch.Tensor):
        raise PAROInputError(
            f"block_mask must be a bool tensor [H, nq, nk] or ActiveBlocks, got {type(block_mask).__name__}: pass "
            "torch.tensor(block_mask, dtype=torch.bool)"
        )
    if block_mask.dtype != torch.bool:
        raise PAROInputError(f"block_mask must be a bool tensor, got {block_mask.dtype}")
    if tuple(block_mask.shape) != (H, nq, nk):
        raise PAROInputError(
            f"block_mask must be [H, ceil(N/bq), ceil(N/bk)] = [{H}, {nq}, {nk}] for N={N} and "
            f"block_size={block_size}; got {tuple(block_mask.shape)} (slice the bucket and layer first)"
        )


def paro_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: TokenLayout,
    orders: torch.Tensor,
    block_mask: torch.Tensor | ActiveBlocks,
    block_size: int | tuple[int, int] = 64,
    qk: str = "bf16",
    pv: str = "bf16",
    sm_scale: float | None = None,
    backend: str = "auto",
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    suffix_mask: torch.Tensor | None = None,
    k_scale: str = "block",
) -> torch.Tensor:
    """Block-sparse attention over per-head reordered tokens, with optional INT8/INT4 QK and FP8/INT8 PV.

    Each head h sees its tokens in the order `ORDERS[orders[h]]`: the `layout.prefix` tokens first and
    unchanged (CogVideoX's and Flux's text), then the `frames x height x width` grid tokens enumerated by
    nested loops over that order's axes, outermost first ("FHW" is the identity), then the `layout.suffix`
    tokens unchanged (HunyuanVideo's text). The reordered sequence is cut into blocks of `bq` queries and
    `bk` keys; a query attends exactly to the keys of its active key blocks (softmax over those keys only),
    less the suffix keys `suffix_mask` marks as padding. The output comes back in q's shape, dtype and
    original token order; a query with no attended key (its row of blocks empty, or holding padding only)
    outputs zeros, never NaN.

    NaN propagates, as in torch's SDPA, on every backend, dtype and mode: the outputs a NaN input reaches
    are NaN and the others do not depend on it, except that a row with no active block is zeros whatever
    the inputs (it reads no key). For query i of one (batch, head), j being any key i
    attends (any key of its active key blocks):
    - qk="bf16": a NaN in q[i] or in k[j] makes row i NaN (every channel).
    - qk="int8"/"int4" (per-block scales): a NaN in q makes every row of its query block (bq reordered
      queries) NaN; a NaN in k makes every row that attends its key block NaN (with k_scale="token": every
      row that attends its key), and every row of the head when the token is in the sample of K smoothing's
      mean (every s-th token, `kernels.reference.key_mean_stride`: all tokens of short sequences).
    - pv="bf16": a NaN in v[j, c] makes channel c of row i NaN.
    - pv="fp8"/"int8" (per-channel scales of V): a NaN in v[:, c] makes channel c of every row of the
      head NaN.
    Inf inputs are outside this contract.

    Parameters
    ----------
    q, k, v : Tensor [B, H, N, D]
        Queries, keys and values of one self-attention call, any strides (views of a [B, N, H, D] tensor
        are fine), float16 or bfloat16 (float32 with backend="torch"); other dtypes raise. N must be
        `layout.seq_len`.
    layout : TokenLayout
        `TokenLayout(prefix, frames, height, width)` of the call's tokens.
    orders : int Tensor [H]
        Per-head index into `ORDERS = ("FHW", "FWH", "HFW", "HWF", "WFH", "WHF")`. Device tensors are
        trusted (a check would sync); host tensors are checked.
    block_mask : bool Tensor [H, ceil(N / bq), ceil(N / bk)] or ActiveBlocks
        Active blocks in reordered coordinates (a plan's `block_mask[bucket, layer]`), or the same as
        prebuilt active-block lists (`ActiveBlocks.from_mask`), which processors pass. The Triton backend
        converts a bool mask on the GPU without a host sync and keeps the lists for the next call with
        the same mask, rebuilt after any in-place change made through torch; a mask changed without
        torch seeing it (through `.data`, NumPy or DLPack) must be passed as a new tensor.
    block_size : int or (bq, bk)
        Query and key block sizes of the mask, positive ints. The Triton kernels take 32, 64 or 128 (16 in the interpreter).
    qk : {"bf16", "int8", "int4"}
        QK product precision. "int8"/"int4": Q symmetric per query block, K minus its per-head mean then
        symmetric per key block, or per key with k_scale="token" (softmax is invariant to the shift). int4
        values run on int8 units.
    pv : {"bf16", "fp8", "int8"}
        PV product precision: P (in [0, 1] after the running max) with a fixed scale, V per channel.
        "bf16" means the inputs' own 16-bit type in both.
    sm_scale : float, optional
        Softmax scale; 1 / sqrt(D) by default.
    backend : {"auto", "triton", "cuda", "torch"}
        "torch" is the reference (any device, slow, the definition of the result). "triton" runs the
        Triton (and Gluon) kernels and raises `PAROInputError` where they cannot (head dim other than
        64 / 128, float32, CPU tensors, unsupported block sizes). "cuda" runs the hand-scheduled sm_90a
        kernels (int8/int4 QK + fp8 PV at 128 x 64 blocks on an H100/H200, compiled at first use with
        NVRTC) and, where they cannot run or be built, warns with the reason and runs "triton". "auto"
        picks the fastest kernel measured for the call on CUDA (`kernels.dispatch`) and otherwise warns
        with the reason and runs "torch".
    rotary : (cos, sin), optional
        float32 tables [S, D] of the model's rotary embedding for the last S tokens (S <= N), applied to q
        and k before anything else (`kernels.reference.apply_rotary`); the Triton backend fuses it into
        one pass over q and k.
    k_scale : {"block", "token"}
        With integer QK, K's scales: one per key block (bk keys), or one per key, which keeps a key of large
        norm from coarsening the grid of the others in its block (closer to unquantized QK; a multiply per score
        more in the kernels). No effect with qk="bf16".
    suffix_mask : bool Tensor [B, layout.suffix], optional
        False where a suffix token is padding (a padded text prompt): no query attends that key. Padded
        queries are computed like the others. Padded keys still enter the statistics of the quantized
        modes, as in the reference: K smoothing's mean (any vector may be subtracted), the per-block
        scales of K (qk int8/int4; with k_scale="token" a padded key's scale is its own) and the per-channel scales of V (pv fp8/int8), so a NaN there reaches
        the outputs those scales reach (the NaN paragraph). The Triton kernels take it (one key-mask
        load per key block that overlaps the suffix); without padding, pass None, which skips the mask.

    Returns
    -------
    Tensor [B, H, N, D] like q.

    Raises
    ------
    PAROInputError
        When an argument breaks this contract; the message says what was expected and what was found.
    """
    check_inputs(q, k, v, layout, orders, block_mask, block_size, qk, pv, backend, rotary, suffix_mask, sm_scale,
                 k_scale)
    bq, bk = block_sizes(block_size)
    if backend != "torch":
        decision = decide(q, bq, bk, qk, pv, backend, key_mask=suffix_mask is not None, rotary=rotary is not None,
                          k_scale=k_scale)
        if isinstance(decision, Launch) and decision.backend != "torch":
            if decision.warning:  # a kernel asked for could not run (once per call site)
                warn(decision.warning, stacklevel=2)
            from .kernels import launch  # defining the kernels takes seconds: imported on first use

            return launch.run(q, k, v, layout=layout, orders=orders, block_mask=block_mask, bq=bq, bk=bk, qk=qk, pv=pv,
                          sm_scale=sm_scale, rotary=rotary, suffix_mask=suffix_mask, decision=decision, k_scale=k_scale)
        reason = decision.reason if isinstance(decision, Refusal) else decision.fallback_reason
        if backend in ("triton", "cuda"):
            raise PAROInputError(f"{reason}. Use backend='torch' (the reference, slow) or backend='auto'.")
        if reason:  # "auto": correct but slow, say so (once per call site)
            warn(f"{reason}: backend='auto' runs the torch reference instead, which is much slower", stacklevel=2)
    if isinstance(block_mask, ActiveBlocks):
        block_mask = block_mask.to_mask()
    return paro_attention_reference(q, k, v, layout, orders, block_mask, bq, bk, qk, pv, sm_scale, rotary, suffix_mask,
                                    k_scale)
