"""`paroattn.apply` on a transformer PARO already runs: the new plan replaces the old one, and the `remove()`
of any handle restores the original processors, whatever the order handles are removed in. Also what `apply`
refuses up front (no plan, kernels this machine cannot run)."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from diffusers import WanTransformer3DModel

from paroattn import Plan, TokenLayout
from paroattn.pipelines import PAROProcessor, apply, self_attention_layers
from paroattn.plan import model_fingerprint

HEIGHT = WIDTH = 8  # latent pixels: a 3 x 4 x 4 grid after the 2 x 2 patches
FRAMES = 3


def tiny_wan(seed: int = 0) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    with torch.no_grad():  # random-init norms are all ones: perturb them so that norms and RoPE matter
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def inputs_for(transformer) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, FRAMES, HEIGHT, WIDTH, generator=g),
        "timestep": torch.tensor([700.0]),
        "encoder_hidden_states": torch.randn(1, 8, 16, generator=g),
        "return_dict": False,
    }


def plan_for(transformer, *, seed: int, density: float = 0.5) -> Plan:
    return Plan.synthetic(
        layout=TokenLayout(0, FRAMES, HEIGHT // 2, WIDTH // 2), num_layers=len(self_attention_layers(transformer)),
        num_heads=2, density=density, orders="random", block_size=16, model_class=type(transformer).__name__,
        model_fingerprint=model_fingerprint(transformer.config), seed=seed,
    )


def run(transformer, inputs):
    with torch.no_grad():
        return transformer(**inputs)[0]


def paro_processors(transformer) -> list:
    return [p for p in transformer.attn_processors.values() if isinstance(p, PAROProcessor)]


@pytest.fixture(scope="module")
def model():
    transformer = tiny_wan()
    inputs = inputs_for(transformer)
    originals = dict(transformer.attn_processors)
    reference = run(transformer, inputs)
    plans = [plan_for(transformer, seed=1), plan_for(transformer, seed=2)]
    outputs = []
    for plan in plans:
        with apply(transformer, plan, backend="torch"):
            outputs.append(run(transformer, inputs))
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], reference)
    return transformer, inputs, originals, reference, plans, outputs


def assert_original(transformer, inputs, originals, reference):
    assert paro_processors(transformer) == []
    assert all(transformer.attn_processors[key] is processor for key, processor in originals.items())
    assert torch.equal(run(transformer, inputs), reference)  # bit for bit
    # no forward pre-hook of an unbound processor is left behind
    assert not transformer._forward_pre_hooks


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_three_applies_removed_in_any_order_restore_the_original(model, order):
    transformer, inputs, originals, reference, plans, outputs = model
    handles = [apply(transformer, plans[i % 2], backend="torch") for i in range(3)]
    # the last apply's plan runs, on one processor: the earlier ones were replaced
    assert len({id(p) for p in paro_processors(transformer)}) == 1
    assert torch.equal(run(transformer, inputs), outputs[0])
    assert [h.active for h in handles] == [False, False, True]
    handles[order[0]].remove()
    assert_original(transformer, inputs, originals, reference)
    assert not any(h.active for h in handles)
    for i in order[1:]:
        handles[i].remove()
        assert_original(transformer, inputs, originals, reference)


@pytest.mark.parametrize("first_removed", [0, 1])
def test_a_second_apply_replaces_the_plan(model, first_removed):
    transformer, inputs, originals, reference, plans, outputs = model
    first = apply(transformer, plans[0], backend="torch")
    assert torch.equal(run(transformer, inputs), outputs[0])
    second = apply(transformer, plans[1], backend="torch")
    assert torch.equal(run(transformer, inputs), outputs[1])
    assert first.stats() == {} or not first.active
    (first, second)[first_removed].remove()
    assert_original(transformer, inputs, originals, reference)
    (first, second)[1 - first_removed].remove()
    assert_original(transformer, inputs, originals, reference)


def test_nested_blocks_and_later_pairs_end_on_the_models_attention(model):
    transformer, inputs, originals, reference, plans, outputs = model
    with apply(transformer, plans[0], backend="torch"):
        with apply(transformer, plans[1], backend="torch"):
            assert torch.equal(run(transformer, inputs), outputs[1])
        assert_original(transformer, inputs, originals, reference)  # the inner block restored the originals
    assert_original(transformer, inputs, originals, reference)
    for plan, expected in zip(plans, outputs):  # later apply/remove pairs in the same process
        handle = apply(transformer, plan, backend="torch")
        assert torch.equal(run(transformer, inputs), expected)
        handle.remove()
        handle.remove()
        assert_original(transformer, inputs, originals, reference)


def test_a_handle_removed_before_a_new_apply_does_not_remove_it(model):
    transformer, inputs, originals, reference, plans, outputs = model
    old = apply(transformer, plans[0], backend="torch")
    old.remove()
    new = apply(transformer, plans[1], backend="torch")
    old.remove()  # its apply is over: the new one stays
    assert new.active and torch.equal(run(transformer, inputs), outputs[1])
    new.remove()
    assert_original(transformer, inputs, originals, reference)


def test_processors_set_by_hand_after_apply_count_as_the_transformers_own(model):
    transformer, inputs, originals, reference, plans, outputs = model
    handle = apply(transformer, plans[0], backend="torch")
    transformer.set_attn_processor(dict(originals))  # the user switched PARO off without the handle
    second = apply(transformer, plans[1], backend="torch")
    assert torch.equal(run(transformer, inputs), outputs[1])
    handle.remove()  # its processors no longer served the transformer: nothing to undo
    assert second.active
    second.remove()
    assert_original(transformer, inputs, originals, reference)


def test_a_plan_that_does_not_fit_under_on_mismatch_dense_replaces_the_one_applied(model):
    transformer, inputs, originals, reference, plans, outputs = model
    handle = apply(transformer, plans[0], backend="torch")
    other = plan_for(transformer, seed=1)
    other.model_class = "CogVideoXTransformer3DModel"
    with pytest.warns(UserWarning, match="CogVideoXTransformer3DModel"):
        dense = apply(transformer, other, backend="torch", on_mismatch="dense")
    assert not dense.active and not handle.active
    assert_original(transformer, inputs, originals, reference)
    handle.remove()
    dense.remove()
    assert_original(transformer, inputs, originals, reference)


@pytest.mark.parametrize("removed", ["first", "second"])
def test_an_expert_pair_applied_twice_comes_off_with_either_handle(removed):
    # what apply reads of a pipeline: its experts and VAE factors
    pipe = types.SimpleNamespace(transformer=tiny_wan(0), transformer_2=tiny_wan(1), vae_scale_factor_spatial=8,
                                 vae_scale_factor_temporal=4)
    inputs = inputs_for(pipe.transformer)
    references = [run(t, inputs) for t in (pipe.transformer, pipe.transformer_2)]
    originals = [dict(t.attn_processors) for t in (pipe.transformer, pipe.transformer_2)]

    def pair(seed):
        plans = [plan_for(pipe.transformer, seed=seed), plan_for(pipe.transformer_2, seed=seed)]
        plans[0].expert, plans[1].expert = "transformer", "transformer_2"
        return plans

    first = apply(pipe, pair(1), backend="torch")
    second = apply(pipe, pair(2), backend="torch")
    assert all(h.active for h in second.experts.values()) and not any(h.active for h in first.experts.values())
    (first if removed == "first" else second).remove()
    for transformer, original, reference in zip((pipe.transformer, pipe.transformer_2), originals, references):
        assert_original(transformer, inputs, original, reference)
    (second if removed == "first" else first).remove()
    for transformer, original, reference in zip((pipe.transformer, pipe.transformer_2), originals, references):
        assert_original(transformer, inputs, original, reference)


# -- what apply refuses before it changes anything ---------------------------------------------------

@pytest.mark.parametrize("plan, fragment", [
    (None, "got NoneType"),
    (3, "got int"),
    ("plan.safetensors", "not the path 'plan.safetensors'"),
    ([], "got nothing"),
])
def test_apply_without_a_plan_says_what_it_needs(model, plan, fragment):
    transformer, inputs, originals, reference, plans, outputs = model
    with pytest.raises(TypeError, match="Plan.load") as info:
        apply(transformer, plan)
    assert fragment in str(info.value)
    assert_original(transformer, inputs, originals, reference)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("backend, interpreter", [("triton", False), ("cuda", False), ("cuda", True)])
def test_apply_refuses_kernels_this_machine_cannot_run(model, monkeypatch, backend, interpreter):
    transformer, inputs, originals, reference, plans, outputs = model
    if interpreter:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=f"backend='{backend}' .* need a CUDA GPU.*backend='auto'"):
        apply(transformer, plans[0], backend=backend)
    assert_original(transformer, inputs, originals, reference)


def test_apply_rejects_unknown_options_before_anything(model):
    transformer, inputs, originals, reference, plans, outputs = model
    with pytest.raises(ValueError, match="backend='gpu'"):
        apply(transformer, plans[0], backend="gpu")
    with pytest.raises(ValueError, match="on_mismatch='skip'"):
        apply(transformer, plans[0], on_mismatch="skip")
    assert_original(transformer, inputs, originals, reference)
