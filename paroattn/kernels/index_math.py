"""The index arithmetic of `paroattn.layout`, compiled for Triton kernels.

`layout.py` writes each order's index map once, as plain arithmetic, and must not import triton
(the package works without it). `triton.jit` resolves names through a function's globals and wants
`tl` among them, so each function is re-bound to a globals dict that holds `tl` and the jitted
versions of the helpers it calls. Same code object, same source: nothing is written twice.
"""

from __future__ import annotations

import types

import triton
import triton.language as tl

from .. import layout


def jit_mirror(fn, jit=triton.jit, **jitted_helpers):
    """`fn` compiled by `jit` (triton.jit, or gluon.jit for the Hopper kernel), calling `jitted_helpers`."""
    scope = dict(fn.__globals__)
    scope.update(tl=tl, triton=triton, **jitted_helpers)
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__module__ = fn.__module__
    clone.__qualname__ = fn.__qualname__
    clone.__doc__ = fn.__doc__
    return jit(clone)


order_axis_sizes_and_strides = jit_mirror(layout.order_axis_sizes_and_strides)
reordered_to_original = jit_mirror(
    layout.reordered_to_original, order_axis_sizes_and_strides=order_axis_sizes_and_strides
)
