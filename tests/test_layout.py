import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paroattn.layout import (
    ORDERS,
    TokenLayout,
    inverse_index,
    original_to_reordered,
    reorder_index,
    reordered_to_original,
)

layouts = st.builds(
    TokenLayout,
    prefix=st.integers(0, 9),
    frames=st.integers(1, 7),
    height=st.integers(1, 7),
    width=st.integers(1, 7),
)
AXIS = {"F": 0, "H": 1, "W": 2}


@pytest.mark.parametrize("order", range(6))
@pytest.mark.parametrize("layout", [TokenLayout(0, 2, 3, 4), TokenLayout(5, 3, 2, 5), TokenLayout(226, 1, 4, 6)])
def test_index_is_the_permuted_grid_flattening(layout, order):
    # reordering a sequence of features must equal permuting the F,H,W grid of those features
    x = torch.randn(layout.seq_len, 3)
    grid = x[layout.prefix:].reshape(layout.frames, layout.height, layout.width, 3)
    expected = torch.cat([x[: layout.prefix], grid.permute(*[AXIS[a] for a in ORDERS[order]], 3).reshape(-1, 3)])
    assert torch.equal(x[reorder_index(layout, order)], expected)


@given(layouts, st.integers(0, 5))
@settings(max_examples=150, deadline=None)
def test_index_is_a_bijection_and_inverse_round_trips(layout, order):
    index = reorder_index(layout, order)
    assert torch.equal(index.sort().values, torch.arange(layout.seq_len))
    inverse = inverse_index(index)
    assert torch.equal(index[inverse], torch.arange(layout.seq_len))
    assert torch.equal(inverse[index], torch.arange(layout.seq_len))
    assert torch.equal(index[: layout.prefix], torch.arange(layout.prefix))


@given(layouts, st.integers(0, 5))
@settings(max_examples=150, deadline=None)
def test_arithmetic_form_equals_tensor_form(layout, order):
    index = reorder_index(layout, order)
    positions = torch.arange(layout.seq_len)
    dims = (layout.prefix, layout.frames, layout.height, layout.width)
    assert torch.equal(reordered_to_original(positions, order, *dims), index)
    assert torch.equal(original_to_reordered(positions, order, *dims), inverse_index(index))
    # and on plain Python ints, the way a scalar caller or a kernel's constexpr path sees it
    p = layout.seq_len - 1
    assert reordered_to_original(p, order, *dims) == int(index[p])


def test_identity_order_and_image_orders():
    layout = TokenLayout(4, 3, 5, 6)
    assert torch.equal(reorder_index(layout, "FHW"), torch.arange(layout.seq_len))
    image = TokenLayout(512, 1, 8, 8)
    assert image.is_image and len(image.distinct_orders()) == 2
    assert len(TokenLayout(0, 2, 3, 4).distinct_orders()) == 6
    # the two distinct image orders really differ, the others repeat them
    distinct = {tuple(reorder_index(image, o).tolist()) for o in range(6)}
    assert len(distinct) == 2


def test_layout_rejects_bad_values():
    with pytest.raises(ValueError, match="prefix"):
        TokenLayout(-1, 1, 1, 1)
    with pytest.raises(ValueError, match="grid"):
        TokenLayout(0, 0, 4, 4)
    with pytest.raises(TypeError):
        TokenLayout(0, 1.5, 4, 4)
