"""diffusers integration on tiny models of every family: PARO equals the model's own attention where
the plan keeps everything, differs (finitely) where it is sparse, comes off bit-exact, and refuses
plans that do not fit."""

from __future__ import annotations

import warnings

import pytest
import torch

from paroattn import Plan, PlanError, TokenLayout
from paroattn.pipelines import (
    PAROProcessor,
    apply,
    capture_attention,
    family_of,
    layout_for,
    self_attention_layers,
)
from paroattn.plan import model_fingerprint
from paroattn.testing import TINY_BLOCK, tiny_forward_inputs, tiny_transformer

FAMILIES = ["cogvideox", "cogvideox1.5", "wan", "wan-i2v", "flux"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    """(family name, transformer, forward kwargs, reference output of the default processors)."""
    transformer = tiny_transformer(request.param)
    inputs = tiny_forward_inputs(transformer, timestep=700.0)
    with torch.no_grad():
        reference = transformer(**inputs)[0]
    return request.param, transformer, inputs, reference


def call_layout(transformer, inputs) -> TokenLayout:
    return family_of(transformer).call_inputs(transformer, inputs).layout


def make_plan(transformer, inputs, *, density=1.0, orders="FHW", num_buckets=3, **overrides) -> Plan:
    plan = Plan.synthetic(
        layout=call_layout(transformer, inputs),
        num_layers=len(self_attention_layers(transformer)),
        num_heads=transformer.config.num_attention_heads,
        density=density,
        orders=orders,
        num_buckets=num_buckets,
        block_size=TINY_BLOCK,
        model_class=type(transformer).__name__,
        model_fingerprint=model_fingerprint(transformer.config),
        **overrides,
    )
    return plan


def run(transformer, inputs):
    with torch.no_grad():
        return transformer(**inputs)[0]


# -- layers and capture -----------------------------------------------------------------------


def test_self_attention_layers_in_plan_order():
    assert self_attention_layers(tiny_transformer("cogvideox")) == [
        "transformer_blocks.0.attn1.processor", "transformer_blocks.1.attn1.processor"]
    assert self_attention_layers(tiny_transformer("wan-i2v")) == ["blocks.0.attn1.processor", "blocks.1.attn1.processor"]
    assert self_attention_layers(tiny_transformer("flux")) == [
        "transformer_blocks.0.attn.processor",
        "single_transformer_blocks.0.attn.processor",
        "single_transformer_blocks.1.attn.processor",
    ]


def test_capture_is_exact_and_reports_every_call(model):
    name, transformer, inputs, reference = model
    seen = []

    def callback(layer, q, k, layout, timestep):
        seen.append((layer, q.shape, k.shape, layout, timestep))

    before = dict(transformer.attn_processors)
    with capture_attention(transformer, callback) as keys:
        out = run(transformer, inputs)
    assert torch.equal(out, reference)
    assert [s[0] for s in seen] == list(range(len(keys)))
    layout = call_layout(transformer, inputs)
    B, H = inputs["hidden_states"].shape[0], transformer.config.num_attention_heads
    for _, q_shape, k_shape, seen_layout, timestep in seen:
        assert seen_layout == layout
        assert q_shape == k_shape == (B, H, layout.seq_len, transformer.config.attention_head_dim)
        assert timestep == pytest.approx(700.0)
    after = transformer.attn_processors
    assert all(after[key] is before[key] for key in before)


# -- equivalence --------------------------------------------------------------------------------


@pytest.mark.parametrize("orders", ["FHW", "random"])
def test_all_true_mask_equals_default(model, orders):
    name, transformer, inputs, reference = model
    handle = apply(transformer, make_plan(transformer, inputs, orders=orders), backend="torch")
    try:
        out = run(transformer, inputs)
    finally:
        handle.remove()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_sparse_plan_differs_finitely_and_remove_is_bit_exact(model):
    name, transformer, inputs, reference = model
    plan = make_plan(transformer, inputs, density=0.4, orders="random")
    assert plan.achieved_density() < 0.9
    handle = apply(transformer, plan, backend="torch")
    out = run(transformer, inputs)
    handle.remove()
    assert torch.isfinite(out).all()
    assert (out - reference).abs().max() > 1e-3
    assert torch.equal(run(transformer, inputs), reference)
