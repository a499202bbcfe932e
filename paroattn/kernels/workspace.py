"""The buffers one call of the kernels writes and reads back (`Buffers`); their reuse across eager calls is
the device runtime's (`runtime.Runtime.workspace`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .statistics import Statistics


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
    # the launches of earlier calls into this set, by what they depend on (`launch`); None: a set of one
    # call (a graph capture, the custom op), which records nothing
    sequences: dict | None = None

    def addresses(self) -> set[int]:
        """Where this set's buffers (its placeholder included) live."""
        tensors = [self.kq, self.k_scale, self.vq, self.qq, self.q_scale, self.placeholder, *(self.rotated or ())]
        if self.statistics is not None:
            stats = self.statistics
            tensors += [stats.k_mean, stats.v_amax, stats.k_partial, stats.v_partial, stats.arrivals]
        return {t.data_ptr() for t in tensors}


def allocate(B: int, H: int, N: int, D: int, dtype: torch.dtype, device, bq: int, bk: int, qk: str, pv: str,
             write_q: bool, rotary: bool = False) -> Buffers:
    nk, nq = -(-N // bk), -(-N // bq)
    n_pad = nk * bk
    placeholder = torch.zeros(1, dtype=torch.float32, device=device)
    k_scale = qq = q_scale = placeholder
    if qk != "bf16":
        kq = torch.empty(B * H, n_pad, D, dtype=torch.int8, device=device)  # int8 or int4 values
        k_scale = torch.empty(B * H, nk, dtype=torch.float32, device=device)
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
    return Buffers(kq, k_scale, vq, qq, q_scale, placeholder, rotated, stats)


def stream_of(device: torch.device) -> int | None:
    """The current stream's handle on a CUDA device (None: capturing a graph, no reuse); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    if torch.cuda.is_current_stream_capturing():
        return None
    from triton.runtime import driver

    return driver.active.get_current_stream(device.index)
