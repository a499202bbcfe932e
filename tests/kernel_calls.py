"""Calling the kernels' launch directly, as the op does after deciding: tests that check the launch layer
(buffer reuse, direct launches, the custom op) use this instead of going through `paro_attention`."""

from __future__ import annotations

from paroattn.attention import decide
from paroattn.kernels import triton_backend
from paroattn.kernels.runtime import runtime_of


def launch(q, k, v, orders, counts, indices, schedule, prefix, frames, height, width, bq, bk, qk, pv, sm_scale,
           cos=None, sin=None, key_mask=None, out=None, reuse_buffers=True, backend="triton"):
    """`triton_backend.launch` of the kernel that `backend` decides for this call on q's device."""
    decision = decide(q, bq, bk, qk, pv, backend, key_mask=key_mask is not None, rotary=cos is not None)
    return triton_backend.launch(runtime_of(q.device), decision, q, k, v, orders, counts, indices, schedule, prefix,
                                 frames, height, width, bq, bk, qk, pv, sm_scale, cos, sin, key_mask, out=out,
                                 reuse_buffers=reuse_buffers)
