"""Triton kernels of the PARO op, each beside its torch reference (`reference.py`)."""

import os


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (tests on machines without CUDA)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
