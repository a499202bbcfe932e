"""Triton kernels of the PARO op, each beside its torch reference (`reference.py`)."""

import os

# read once: triton decides between compiling and interpreting when the kernels are defined, which is when
# this package is imported, and the op asks on every call (an os.environ read is not free)
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (tests on machines without CUDA)."""
    return _INTERPRETING
