"""Launching a Triton or Gluon kernel with less host work than `kernel[grid](...)`.

Each `kernel[grid](*args)` binds the arguments to the signature, computes the specialization of every
argument (dtype and 16-byte alignment of each pointer, divisibility of each integer), hashes it to find
the compiled kernel, then calls the compiled kernel's launcher: about 40 us of host time for the
attention kernel's 43 arguments on an H100 host, of which the launcher itself is about 14 us. A
`CachedLauncher` does the full launch the first time it sees a key and keeps the compiled kernel it
returns; later launches with that key call the compiled kernel's launcher directly.

The key is the caller's promise: two launches with one key have one specialization. Callers key on
what their arguments can vary in: shapes, strides, integer arguments, dtypes and the 16-byte alignment
of each tensor's address (`aligned`); floats and the addresses themselves are not specialized on. The
constexprs, the launch options and the current device are added to the key here.
"""

from __future__ import annotations

import torch
from triton.runtime import driver

from . import interpreting

try:
    from triton import knobs
except ImportError:  # pragma: no cover - triton releases before knobs: full launches only
    knobs = None


def aligned(*tensors: torch.Tensor) -> int:
    """A bit per tensor: its address is a multiple of 16 bytes (what Triton specializes pointers on)."""
    bits = 0
    for t in tensors:
        bits = (bits << 1) | (t.data_ptr() % 16 == 0)
    return bits


class CachedLauncher:
    """`launcher(key, grid, args, constexprs, **options)` runs `kernel[grid](*args, **constexprs, **options)`;
    `constexprs` in the kernel's parameter order after `args`. Only the first launch of a key binds and
    specializes; `key=None` always takes the full path, as does the Triton interpreter."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}
        self.direct_launches = 0  # launches that skipped the binding (tests check the cache is used)
        self._direct = True  # cleared if this triton's launcher does not take the call (the full path always works)

    def __call__(self, key, grid: tuple[int, ...], args: tuple, constexprs: dict, **options) -> None:
        if key is not None and self._direct and knobs is not None and not interpreting():
            device = driver.active.get_current_device()
            key = (device, key, *constexprs.values(), *options.values())
            compiled = self._compiled.get(key)
            if compiled is not None:
                stream = driver.active.get_current_stream(device)
                all_args = (*args, *constexprs.values())
                # profilers' hooks (proton) run as in a full launch; an empty hook chain (releases whose hooks
                # are `HookChain`s) calls nothing, so none is passed and no launch metadata is built for it
                enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
                if enter is not None and not getattr(enter, "calls", True):
                    enter = None
                if leave is not None and not getattr(leave, "calls", True):
                    leave = None
                metadata = compiled.launch_metadata(grid, stream, *all_args) if enter is not None else None
                try:
                    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                                 compiled.function, compiled.packed_metadata, metadata, enter, leave, *all_args)
                    self.direct_launches += 1
                    return
                except TypeError:  # the launcher parses its arguments before it launches anything
                    self._direct = False
                    self._compiled.clear()
                    self.kernel[grid](*args, **constexprs, **options)
                    return
            compiled = self.kernel[grid](*args, **constexprs, **options)
            names = getattr(self.kernel, "arg_names", None)
            # the direct call passes every parameter by position: only where the constexprs came in the
            # signature's order, after the positional ones, and where a compiled kernel came back
            if (compiled is not None and hasattr(compiled, "packed_metadata")
                    and names is not None and list(names) == [*names[:len(args)], *constexprs]):
                self._compiled[key] = compiled
            return
        self.kernel[grid](*args, **constexprs, **options)

    def clear(self) -> None:
        self._compiled.clear()
