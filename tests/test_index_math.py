"""The jitted index arithmetic (what kernels run) agrees with the tensor form of the orders."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from paroattn import layout as layout_math  # noqa: E402
from paroattn.kernels import index_math  # noqa: E402
from paroattn.layout import TokenLayout, inverse_index, reorder_index  # noqa: E402

# the kernels only map reordered positions back; the inverse is jitted here to check both directions
original_to_reordered = index_math.jit_mirror(
    layout_math.original_to_reordered, order_axis_sizes_and_strides=index_math.order_axis_sizes_and_strides
)


@triton.jit
def _index_maps_kernel(to_original, to_reordered, orders, prefix, frames, height, width, n, BLOCK: tl.constexpr):
    head = tl.program_id(0)
    order = tl.load(orders + head)
    position = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = position < n
    tl.store(to_original + head * n + position,
             index_math.reordered_to_original(position, order, prefix, frames, height, width), mask=inside)
    tl.store(to_reordered + head * n + position,
             original_to_reordered(position, order, prefix, frames, height, width), mask=inside)


@pytest.mark.parametrize("layout", [TokenLayout(0, 2, 3, 4), TokenLayout(7, 3, 5, 2), TokenLayout(11, 1, 5, 7),
                                    TokenLayout(3, 5, 1, 1), TokenLayout(0, 2, 3, 4, suffix=9),
                                    TokenLayout(5, 3, 2, 3, suffix=13)])
def test_kernel_index_maps_equal_tensor_form(layout):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    orders = torch.arange(6, dtype=torch.int32, device=device)
    n = layout.seq_len
    to_original = torch.full((6, n), -1, dtype=torch.int32, device=device)
    to_reordered = torch.full_like(to_original, -1)
    block = 32
    _index_maps_kernel[(6, -(-n // block))](to_original, to_reordered, orders, layout.prefix, layout.frames,
                                            layout.height, layout.width, n, BLOCK=block)
    for order in range(6):
        index = reorder_index(layout, order)
        assert torch.equal(to_original[order].cpu().long(), index)
        assert torch.equal(to_reordered[order].cpu().long(), inverse_index(index))
