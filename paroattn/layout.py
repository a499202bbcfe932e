"""Token geometry: where each token of a [prefix ; F x H x W ; suffix] sequence goes under each of the 6 orders.

A head's order names the nesting of the three grid axes, outermost first: "HWF" enumerates the
grid tokens with H outermost and F innermost, so tokens that are neighbours in time become
neighbours in the sequence. "FHW" is the row-major layout every supported model already uses.

The index arithmetic lives in plain functions built from `+ - * // %` and comparisons only, so the
same source runs on Python ints, torch tensors, and (wrapped with `triton.jit`) inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ORDERS = ("FHW", "FWH", "HFW", "HWF", "WFH", "WHF")
_AXIS_INDEX = {"F": 0, "H": 1, "W": 2}


@dataclass(frozen=True)
class TokenLayout:
    """A sequence of `prefix` unreordered tokens (CogVideoX's and Flux's text), a row-major F x H x W grid,
    then `suffix` unreordered tokens (HunyuanVideo's text, which follows the video tokens)."""

    prefix: int
    frames: int
    height: int
    width: int
    suffix: int = 0

    def __post_init__(self):
        for name in ("prefix", "frames", "height", "width", "suffix"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"TokenLayout.{name} must be an int, got {type(value).__name__}")
        if self.prefix < 0 or self.suffix < 0:
            raise ValueError(f"TokenLayout.prefix and suffix must be >= 0, got {self.prefix} and {self.suffix}")
        if min(self.frames, self.height, self.width) < 1:
            raise ValueError(
                f"TokenLayout grid must be at least 1x1x1, got {self.frames}x{self.height}x{self.width}"
            )

    @property
    def grid_tokens(self) -> int:
        return self.frames * self.height * self.width

    @property
    def seq_len(self) -> int:
        return self.prefix + self.grid_tokens + self.suffix

    @property
    def fields(self) -> tuple[int, int, int, int, int]:
        """(prefix, frames, height, width, suffix): `TokenLayout(*layout.fields) == layout`."""
        return self.prefix, self.frames, self.height, self.width, self.suffix

    @property
    def is_image(self) -> bool:
        return self.frames == 1

    def distinct_orders(self) -> tuple[int, ...]:
        """Indices of orders that give different sequences (duplicates arise from axes of size 1)."""
        seen: dict[tuple, int] = {}
        for index in range(len(ORDERS)):
            key = tuple(a for a in ORDERS[index] if self._axis_size(a) > 1)
            seen.setdefault(key, index)
        return tuple(sorted(seen.values()))

    def _axis_size(self, axis: str) -> int:
        return (self.frames, self.height, self.width)[_AXIS_INDEX[axis]]

    def __str__(self) -> str:
        text = f"{self.prefix} + " if self.prefix else ""
        return text + f"{self.frames}x{self.height}x{self.width}" + (f" + {self.suffix}" if self.suffix else "")


def order_index(order: str | int) -> int:
    """Accept an order by name ("HWF") or index (3) and return its index into ORDERS."""
    if isinstance(order, str):
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}; expected one of {ORDERS}")
        return ORDERS.index(order)
    if not 0 <= int(order) < len(ORDERS):
        raise ValueError(f"order index {order} out of range 0..{len(ORDERS) - 1}")
    return int(order)


# ---------------------------------------------------------------------------------------------
# Index arithmetic. Keep these to `+ - * // %` and comparisons (no `if`, no calls) on purpose:
# kernels wrap them with `triton.jit`, and tests check them against the tensor form below.
# Axis ids: 0 = F, 1 = H, 2 = W. ORDERS[o] has outer axis o // 2; the two remaining axes follow
# in increasing id when o is even and decreasing id when o is odd.


def order_axis_sizes_and_strides(order, frames, height, width):
    """For order index `order`: (n0, n1, n2) axis sizes, outermost first, and (s0, s1, s2) the
    strides of those axes in the original row-major F x H x W grid."""
    outer = order // 2
    low = (outer == 0) * 1
    high = 2 - (outer == 2) * 1
    odd = order % 2
    middle = low + odd * (high - low)
    inner = high - odd * (high - low)
    n0 = (outer == 0) * frames + (outer == 1) * height + (outer == 2) * width
    n1 = (middle == 0) * frames + (middle == 1) * height + (middle == 2) * width
    n2 = (inner == 0) * frames + (inner == 1) * height + (inner == 2) * width
    s0 = (outer == 0) * (height * width) + (outer == 1) * width + (outer == 2) * 1
    s1 = (middle == 0) * (height * width) + (middle == 1) * width + (middle == 2) * 1
    s2 = (inner == 0) * (height * width) + (inner == 1) * width + (inner == 2) * 1
    return n0, n1, n2, s0, s1, s2


def reordered_to_original(position, order, prefix, frames, height, width):
    """Original sequence position of the token at `position` of the sequence reordered by `order`. Positions
    before the grid (prefix) and after it (suffix) map to themselves."""
    n0, n1, n2, s0, s1, s2 = order_axis_sizes_and_strides(order, frames, height, width)
    in_grid = ((position >= prefix) * 1) * ((position < prefix + frames * height * width) * 1)
    g = (position - prefix) * in_grid
    a2 = g % n2
    a1 = (g // n2) % n1
    a0 = g // (n2 * n1)
    original = prefix + a0 * s0 + a1 * s1 + a2 * s2
    return position + in_grid * (original - position)


def original_to_reordered(position, order, prefix, frames, height, width):
    """Position in the sequence reordered by `order` of the token at original `position` (prefix and suffix
    positions map to themselves)."""
    n0, n1, n2, s0, s1, s2 = order_axis_sizes_and_strides(order, frames, height, width)
    in_grid = ((position >= prefix) * 1) * ((position < prefix + frames * height * width) * 1)
    g = (position - prefix) * in_grid
    # coordinate along an axis of stride s and size n in the row-major grid: (g // s) % n
    c0 = (g // s0) % n0
    c1 = (g // s1) % n1
    c2 = (g // s2) % n2
    reordered = prefix + (c0 * n1 + c1) * n2 + c2
    return position + in_grid * (reordered - position)


# ---------------------------------------------------------------------------------------------
# Tensor form: the definition the arithmetic must agree with.


def reorder_index(layout: TokenLayout, order: str | int, device=None) -> torch.Tensor:
    """LongTensor `idx` of length N with `reordered = x[idx]`: idx[p] is the original position of
    reordered position p. Built by permuting an arange grid, i.e. the definition of an order."""
    name = ORDERS[order_index(order)]
    grid = torch.arange(layout.grid_tokens, device=device).reshape(layout.frames, layout.height, layout.width)
    permuted = grid.permute(*[_AXIS_INDEX[a] for a in name]).reshape(-1) + layout.prefix
    suffix = torch.arange(layout.prefix + layout.grid_tokens, layout.seq_len, device=device)
    return torch.cat([torch.arange(layout.prefix, device=device), permuted, suffix])


def inverse_index(index: torch.Tensor) -> torch.Tensor:
    """Inverse permutation: `inverse_index(idx)[idx] == arange(N)`."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return inverse


def reorder_table(layout: TokenLayout, device=None) -> torch.Tensor:
    """[len(ORDERS), N] LongTensor: row o is `reorder_index(layout, o)`. Indexed with a tensor of orders
    (`table.index_select(0, orders)`), it gives every head's reordering without reading the orders on the
    host, which a forward traced by torch.compile cannot do."""
    return torch.stack([reorder_index(layout, order, device) for order in range(len(ORDERS))])
