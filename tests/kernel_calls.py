"""Calling the kernels' launch directly, as the op does after deciding (tests that check the launch layer: buffer
reuse, direct launches, the custom op), and the op on the sm90 CUDA kernel, checked to have run there."""

from __future__ import annotations

from paroattn import paro_attention
from paroattn.attention import decide
from paroattn.kernels import dispatch
from paroattn.kernels import launch as launches
from paroattn.kernels.block_lists import ActiveBlocks
from paroattn.kernels.runtime import runtime_of


def launch(q, k, v, orders, counts, indices, schedule, prefix, frames, height, width, bq, bk, qk, pv, sm_scale,
           cos=None, sin=None, key_mask=None, out=None, reuse_buffers=True, backend="triton", k_scale="block"):
    """`kernels.launch.launch` of the kernel that `backend` decides for this call on q's device, on the lists
    `counts`, `indices`, `schedule`."""
    decision = decide(q, bq, bk, qk, pv, backend, key_mask=key_mask is not None, rotary=cos is not None,
                      k_scale=k_scale)
    blocks = ActiveBlocks(counts, indices, -(-q.shape[2] // bk), schedule)
    return launches.launch(decision, q, k, v, orders, blocks, prefix, frames, height, width, bq, bk, qk, pv, sm_scale,
                           cos, sin, key_mask, out=out, reuse_buffers=reuse_buffers, k_scale=k_scale)


def sm90_attention(q, k, v, *, layout, orders, block_mask, qk="int8", pv="fp8", sm_scale=None, suffix_mask=None,
                   k_scale="block"):
    """The op on the sm90 CUDA kernel (backend="cuda", 128 x 64 blocks): its result, or AssertionError where the
    call ran another kernel (a refusal or a failed build falls back to Triton with a warning)."""
    out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=block_mask, block_size=(128, 64), qk=qk,
                         pv=pv, sm_scale=sm_scale, suffix_mask=suffix_mask, backend="cuda", k_scale=k_scale)
    ran = runtime_of(q.device).last_launch
    assert ran is not None and ran.launch.kernel == dispatch.CUDA, f"ran {ran and ran.launch.describe()}, not CUDA"
    assert ran.k_scale == (k_scale if qk != "bf16" else "block")
    return out
