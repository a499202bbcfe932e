"""Which timestep and token layout the current transformer forward has: a forward pre-hook.

Pipelines pass the timestep as a keyword (CogVideoX int 0..999, Wan float 0..1000 once per CFG
branch, Flux t/1000); the adapter maps the call's arguments to `CallInputs` (the timestep as passed, with
the factor to the 0..1000 scale, and the token layout from the arguments' shapes).
It hands each call's `CallInputs` to the processor's binding (`on_call`) instead of guessing.
Under `torch.compile(transformer)` the hook runs as a frame of its own, compiled too: it only records, so
that the tensor work of choosing the bucket happens in the transformer's graph.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .base import CallInputs, FamilyAdapter


class ForwardTracker:
    def __init__(self, transformer, family: FamilyAdapter, on_call: Callable[[CallInputs], None] | None = None):
        self.family = family
        self.on_call = on_call
        self._signature = inspect.signature(transformer.forward)
        self._handle = transformer.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def _pre_hook(self, module, args, kwargs):
        arguments = self._signature.bind_partial(*args, **kwargs).arguments
        self.set(self.family.call_inputs(module, arguments))
        return None

    def set(self, inputs: CallInputs) -> None:
        if self.on_call is not None:
            self.on_call(inputs)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        # on_call is most often its binding's method, and the binding holds this tracker: a cycle that would keep the
        # binding, its processor and what that holds (a capture's statistics, a plan's masks) until the garbage
        # collector next runs
        self.on_call = None
