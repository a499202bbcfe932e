"""The kernels' entry: `run` prepares a checked call's arguments for the launches (device int32 orders,
active-block lists with their schedule, the softmax scale) and launches them eagerly, or, while
torch.compile traces, through `block_sparse_attention`, a `torch.library` custom op that is one opaque,
CUDA-graph-friendly node of the graph.

Host work per call is small and sync-free: device `orders` pass through (host ones are copied once per
value), prebuilt `ActiveBlocks` (which processors pass) are used as they are, and a bool `block_mask` is
converted on the device without a sync and kept per mask (`runtime.Runtime.lists_of`).
"""

from __future__ import annotations

import math

import torch

from ..errors import PAROInputError
from ..layout import TokenLayout
from .block_lists import ActiveBlocks
from .dispatch import Launch
from .runtime import PROCESS, runtime_of
from .triton_backend import launch


@torch.library.custom_op("paroattn::block_sparse_attention", mutates_args=())
def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    orders: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor, schedule: torch.Tensor,
    prefix: int, frames: int, height: int, width: int, bq: int, bk: int, qk: str, pv: str, sm_scale: float,
    launch_code: str, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PARO op on prepared arguments (device int32 orders, active-block lists, schedule, optional
    float32 RoPE tables, optional bool key mask [B, suffix] of the suffix tokens) with the kernel decided while
    the graph was traced (`dispatch.Launch.encode`). One opaque node for torch.compile; its output has q's
    shape, dtype and strides. Its buffers are allocated per call: with mode="reduce-overhead", the CUDA-graph
    trees run the op's warm-up calls in their graphs' memory pool and reuse that memory, where a kept buffer
    set would live."""
    return launch(runtime_of(q.device), PROCESS.launch_of(launch_code), q, k, v, orders, counts, indices, schedule,
                  prefix, frames, height, width, bq, bk, qk, pv, sm_scale, cos, sin, key_mask, reuse_buffers=False)


@block_sparse_attention.register_fake
def _block_sparse_attention_fake(q, k, v, orders, counts, indices, schedule, prefix, frames, height, width,
                                 bq, bk, qk, pv, sm_scale, launch_code, cos=None, sin=None, key_mask=None):
    return torch.empty_like(q)


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: TokenLayout,
    orders: torch.Tensor,
    block_mask: torch.Tensor | ActiveBlocks,
    bq: int,
    bk: int,
    qk: str,
    pv: str,
    sm_scale: float | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    suffix_mask: torch.Tensor | None,
    decision: Launch,
) -> torch.Tensor:
    """See `paroattn.paro_attention`: a call checked against the op contract, run by the kernels of
    `decision` (eagerly, or through the custom op while torch.compile traces)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise PAROInputError(
            "the triton backend is inference-only (no backward): q, k or v requires grad. Run under "
            "torch.no_grad() / torch.inference_mode() (diffusers pipelines do), or use backend='torch' to train"
        )
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    rotary = rotary if rotary is not None else (None, None)
    geometry = (layout.prefix, layout.frames, layout.height, layout.width, bq, bk, qk, pv, float(sm_scale))
    if torch.compiler.is_compiling():  # one opaque node in the graph; traced code reads no runtime cache
        blocks = block_mask if isinstance(block_mask, ActiveBlocks) else ActiveBlocks.from_mask(
            block_mask.to(q.device), sync=False)
        orders = orders.to(device=q.device, dtype=torch.int32).contiguous()
        return block_sparse_attention(q, k, v, orders, blocks.counts, blocks.indices, blocks.schedule, *geometry,
                                      decision.encode(), *rotary, suffix_mask)
    runtime = runtime_of(q.device)
    orders, blocks = runtime.kernel_inputs(orders, block_mask)
    # eager: the custom op's function without its dispatch
    return launch(runtime, decision, q, k, v, orders, blocks.counts, blocks.indices, blocks.schedule, *geometry,
                  *rotary, suffix_mask)
