"""fp8 linear layers (`paroattn.linear`, `apply(..., linear="fp8")`, `paro generate --linear fp8`).

CPU, always:
- the refusals, one line each and before anything changes: an unknown mode, the CPU, a GPU below sm_89 (the
  capability patched in), torchao missing or too old (the import patched), weights that are not bfloat16 or
  already quantized; `paro generate --linear fp8` refuses before the model loads;
- which linear layers the tiny Wan, FLUX, CogVideoX, HunyuanVideo and Qwen-Image transformers quantize, and why
  each other one stays in bf16 (outside the blocks, a norm's modulation, a LoRA adapter, features not multiples
  of 16);
- the handle with a stand-in for torchao's `quantize_` (a weight replaced by a rounded tensor subclass, as
  torchao replaces it by its Float8Tensor): with and without a plan, an expert pair, a failure part-way;
  `remove()` puts the same parameter objects back, bit-exact.
CPU, where torchao is installed (`pip install paroattn[fp8]`): torchao's real quantization, whose float8 path runs
on the CPU once its hardware check (an sm_89 GPU) is patched out: outputs within fp8 rounding of bf16, and
`remove()` restores them bit-exactly.
GPU (-m gpu, torchao installed, sm_89 or newer): a small Wan of Wan2.1-1.3B's real widths with fp8 linear layers,
alone and beside PARO, under torch.compile fullgraph and CUDA graphs: one graph, no CUDA graph skipped, the
compiled output that of the eager fp8 run to within bf16 rounding and that of the bf16 model within REL_L2_BOUND.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from tiny_models import TINY_BLOCK, tiny_forward_inputs, tiny_transformer
from torch import nn
from typer.testing import CliRunner

from paroattn import Plan
from paroattn import linear as fp8
from paroattn.pipelines import apply, family_of, self_attention_layers
from paroattn.plan import model_fingerprint

# relative L2 distance of the output of a 2-layer Wan with Wan2.1-1.3B's widths and random N(0, 0.02) weights
# (`real_width_wan`), fp8 linear layers vs bf16: 0.0486 on the CPU (torchao's float8 path; cosine 0.9988). The
# bound is about twice that, for the GPU's fast fp8 accumulation and PARO's int8 + fp8 attention beside it
REL_L2_BOUND = 0.1


def bf16_inputs(inputs: dict) -> dict:
    """The tiny forward inputs with their floating tensors in bfloat16 (the timestep stays as the model takes it)."""
    return {key: value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and value.is_floating_point()
            and key != "timestep" else value for key, value in inputs.items()}


def tiny_bf16(family: str):
    transformer = tiny_transformer(family, dtype=torch.bfloat16).eval()
    return transformer, bf16_inputs(tiny_forward_inputs(transformer))


def forward(transformer, inputs) -> torch.Tensor:
    with torch.no_grad():
        return transformer(**inputs)[0]


# -- refusals --------------------------------------------------------------------------------------------


def fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H100 80GB HBM3"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def fake_torchao(monkeypatch, version="0.18.0", quantize=None):
    """A stand-in `torchao` package: `quantize_` replaces the weight of the layer `filter_fn` picks by a tensor
    subclass holding its values rounded to e4m3 (torchao replaces it by a Float8Tensor)."""

    def quantize_(model, config, filter_fn=None):
        for name, module in model.named_modules():
            if filter_fn(module, name):
                rounded = module.weight.detach().to(torch.float8_e4m3fn).to(module.weight.dtype)
                module.weight = nn.Parameter(rounded.as_subclass(Rounded), requires_grad=False)

    package = types.ModuleType("torchao")
    package.__version__ = version
    quantization = types.ModuleType("torchao.quantization")
    quantization.quantize_ = quantize or quantize_
    quantization.Float8DynamicActivationFloat8WeightConfig = lambda **kwargs: kwargs
    quantization.PerRow = lambda: "per-row"
    package.quantization = quantization
    monkeypatch.setitem(sys.modules, "torchao", package)
    monkeypatch.setitem(sys.modules, "torchao.quantization", quantization)


class Rounded(torch.Tensor):
    """The stand-in quantized weight: a tensor subclass, as torchao's Float8Tensor is."""


def test_linear_problem_names_each_refusal_in_one_line(monkeypatch):
    problems = {}
    problems["mode"] = fp8.linear_problem("int8")
    problems["cpu"] = fp8.linear_problem("fp8", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    problems["no gpu"] = fp8.linear_problem("fp8")
    fake_gpu(monkeypatch, capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
    problems["ampere"] = fp8.linear_problem("fp8", "cuda")
    fake_gpu(monkeypatch, capability=(9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError
    problems["no torchao"] = fp8.linear_problem("fp8")
    fake_torchao(monkeypatch, version="0.17.1")
    problems["old torchao"] = fp8.linear_problem("fp8", "cuda:0")
    assert "'int8' is not one of fp8" in problems["mode"]
    assert "this run is on the CPU" in problems["cpu"] and "sm_89" in problems["cpu"]
    assert "this run is on the CPU" in problems["no gpu"]
    assert "NVIDIA A100-SXM4-80GB (sm_80) lacks" in problems["ampere"] and "sm_89 or newer" in problems["ampere"]
    assert "torchao, which is not installed: pip install paroattn[fp8]" in problems["no torchao"]
    assert "torchao >= 0.18" in problems["old torchao"] and "0.17.1 is installed" in problems["old torchao"]
    assert all(problem and "\n" not in problem for problem in problems.values()), problems
    fake_torchao(monkeypatch)
    assert fp8.linear_problem("fp8") is None and fp8.linear_problem(None, "cpu") is None
    fake_gpu(monkeypatch, capability=(8, 9), name="NVIDIA L4")
    assert fp8.linear_problem("fp8") is None


@pytest.mark.slow
def test_apply_refuses_before_anything_changes(monkeypatch):
    """On the CPU, in float32, stored in fp8 by layerwise casting, or without torchao: ValueError with what to
    do, and the transformer keeps its processors and weights (the plan is checked and refused as a whole)."""
    transformer, _ = tiny_bf16("wan")
    plan = synthetic_plan(transformer)
    processors = dict(transformer.attn_processors)
    weights = {name: (p, p.detach().clone()) for name, p in transformer.named_parameters()}

    def unchanged():
        assert all(transformer.attn_processors[k] is v for k, v in processors.items())
        assert all(p is transformer.get_parameter(n) and torch.equal(p, v) for n, (p, v) in weights.items())

    with pytest.raises(ValueError, match=r"weights of WanTransformer3DModel are on cpu: move the pipeline"):
        apply(transformer, plan, backend="torch", linear="fp8")
    unchanged()
    with pytest.raises(ValueError, match="'int4' is not one of fp8"):
        apply(transformer, None, linear="int4")
    unchanged()
    fake_gpu(monkeypatch)
    monkeypatch.setattr(fp8, "_placement_problem", lambda what, device: None)  # the CPU stands in for the GPU
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ValueError, match=r"not installed: pip install paroattn\[fp8\]"):
        apply(transformer, plan, backend="torch", linear="fp8")
    unchanged()
    fake_torchao(monkeypatch)
    float32 = tiny_transformer("wan")
    with pytest.raises(ValueError, match="quantizes bfloat16 weights .* hold float32: load the model with"):
        apply(float32, None, linear="fp8")
    stored = tiny_transformer("wan")
    stored.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hold float8_e4m3fn .layerwise casting stores them so: disable it"):
        apply(stored, None, linear="fp8")


def test_generate_refuses_linear_before_the_model_loads(tmp_path):
    """`paro generate --linear`: one line, exit 2, before the (missing) model folder is even looked at."""
    from test_cli_errors import assert_clean_failure

    from paroattn.app.cli import app

    def invoke(*args):
        return CliRunner().invoke(app, ["generate", str(tmp_path / "no-model"), "--prompt", "a cat", *args])

    assert_clean_failure(invoke("--linear", "fp8", "--device", "cpu"), "--linear fp8 runs FP8", "on the CPU")
    assert_clean_failure(invoke("--linear", "int4"), "--linear 'int4' is not one of fp8")
    assert_clean_failure(invoke("--linear", "fp8", "--dtype", "float16"), "--dtype is float16", "--dtype bfloat16")
    # --compare without a plan measures fp8 linear layers against bf16: the linear check answers, not --plan's
    assert_clean_failure(invoke("--compare", "--linear", "fp8", "--device", "cpu"), "--linear fp8")
    assert not (tmp_path / "no-model").exists() and not list(tmp_path.iterdir())


# -- which layers ----------------------------------------------------------------------------------------

OUT, MOD, LORA = fp8.OUTSIDE_BLOCKS, fp8.MODULATION, fp8.LORA
WAN_BLOCK = {**{f"{a}.{p}": "fp8" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")},
             "ffn.net.0.proj": "fp8", "ffn.net.2": "fp8"}
FLUX_DUAL = {**{f"attn.{p}": "fp8" for p in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                             "add_v_proj", "to_add_out")},
             **{f"{f}.net.{i}": "fp8" for f in ("ff", "ff_context") for i in ("0.proj", "2")},
             "norm1.linear": MOD, "norm1_context.linear": MOD}
FLUX_SINGLE = {"attn.to_q": "fp8", "attn.to_k": "fp8", "attn.to_v": "fp8", "proj_mlp": "fp8", "proj_out": "fp8",
               "norm.linear": MOD}
EXPECTED_BLOCKS = {
    "wan": {"blocks": (2, WAN_BLOCK)},
    "cogvideox": {"transformer_blocks": (2, {**{f"attn1.{p}": "fp8" for p in ("to_q", "to_k", "to_v", "to_out.0")},
                                             "ff.net.0.proj": "fp8", "ff.net.2": "fp8",
                                             "norm1.linear": MOD, "norm2.linear": MOD})},
    "flux": {"transformer_blocks": (1, FLUX_DUAL), "single_transformer_blocks": (2, FLUX_SINGLE)},
    "hunyuan_video": {"transformer_blocks": (1, FLUX_DUAL), "single_transformer_blocks": (2, FLUX_SINGLE)},
    "qwen_image": {"transformer_blocks": (2, {
        **{key: "fp8" for key in FLUX_DUAL if key.startswith("attn.")},
        **{f"{f}.net.{i}": "fp8" for f in ("img_mlp", "txt_mlp") for i in ("0.proj", "2")},
        "img_mod.1": MOD, "txt_mod.1": MOD})},
}


@pytest.mark.parametrize("family", list(EXPECTED_BLOCKS))
def test_layer_choice_quantizes_the_blocks_and_keeps_embedders_final_layers_and_modulation(family):
    transformer = tiny_transformer(family)
    choice = fp8.layer_choice(transformer)
    expected = {}
    for blocks, (count, layers) in EXPECTED_BLOCKS[family].items():
        assert len(getattr(transformer, blocks)) == count
        expected.update({f"{blocks}.{i}.{name}": why for i in range(count) for name, why in layers.items()})
    linears = [name for name, m in transformer.named_modules() if isinstance(m, nn.Linear)]
    outside = {name: OUT for name in linears if name.split(".")[0] not in EXPECTED_BLOCKS[family]}
    assert "proj_out" in outside and len(outside) >= 4  # embedders and the final projection
    assert choice == {**expected, **outside}
    assert fp8.fp8_layers(transformer) == [name for name in linears if choice[name] == "fp8"]


def test_layer_choice_keeps_lora_adapters_and_widths_fp8_cannot_take():
    """peft wraps a layer as `base_layer` beside `lora_A` / `lora_B` dicts of rank-r layers; a layer of 40
    outputs cannot go through torch._scaled_mm (multiples of 16)."""
    transformer = tiny_transformer("wan")
    attn = transformer.blocks[0].attn1
    wrapped = nn.Module()
    wrapped.base_layer = attn.to_q
    wrapped.lora_A = nn.ModuleDict({"default": nn.Linear(32, 16, bias=False)})
    wrapped.lora_B = nn.ModuleDict({"default": nn.Linear(16, 32, bias=False)})
    attn.to_q = wrapped
    attn.to_k = nn.Linear(32, 40)
    choice = fp8.layer_choice(transformer)
    assert choice["blocks.0.attn1.to_q.base_layer"] == "fp8"
    assert choice["blocks.0.attn1.to_q.lora_A.default"] == choice["blocks.0.attn1.to_q.lora_B.default"] == LORA
    assert choice["blocks.0.attn1.to_k"] == "32 -> 40 features, not multiples of 16 (torch._scaled_mm needs them)"
    assert choice["blocks.1.attn1.to_k"] == "fp8"


# -- the handle, with a stand-in for torchao --------------------------------------------------------------


def synthetic_plan(transformer) -> Plan:
    layout = family_of(transformer).call_inputs(transformer, tiny_forward_inputs(transformer)).layout
    return Plan.synthetic(layout=layout, num_layers=len(self_attention_layers(transformer)),
                          num_heads=transformer.config.num_attention_heads, density=0.5, orders="random",
                          block_size=TINY_BLOCK, model_class=type(transformer).__name__,
                          model_fingerprint=model_fingerprint(transformer.config))


@pytest.fixture
def stand_in(monkeypatch):
    """A GPU and torchao, patched in: the CPU stands in for the GPU, `fake_torchao` for torchao."""
    fake_gpu(monkeypatch)
    monkeypatch.setattr(fp8, "_placement_problem", lambda what, device: None)
    fake_torchao(monkeypatch)
    return monkeypatch


def snapshot(transformer) -> dict:
    return {name: (p, p.detach().clone()) for name, p in transformer.named_parameters()}


def assert_restored(transformer, before: dict) -> None:
    now = dict(transformer.named_parameters())
    assert now.keys() == before.keys()
    for name, (parameter, values) in before.items():
        assert now[name] is parameter and type(parameter) is nn.Parameter, name
        assert torch.equal(parameter, values) and parameter.dtype == values.dtype, name
        assert "extra_repr" not in transformer.get_submodule(name.rpartition(".")[0]).__dict__


@pytest.mark.parametrize("with_plan", [False, True])
def test_apply_quantizes_the_chosen_layers_and_remove_restores_them(stand_in, with_plan):
    transformer, inputs = tiny_bf16("wan")
    before, processors, reference = snapshot(transformer), dict(transformer.attn_processors), forward(
        transformer, inputs)
    handle = apply(transformer, synthetic_plan(transformer) if with_plan else None, backend="torch", linear="fp8")
    assert handle.active and handle.linears.layers == fp8.fp8_layers(transformer)
    assert handle.linears.kept == {k: v for k, v in fp8.layer_choice(transformer).items() if v != "fp8"}
    for name, decision in fp8.layer_choice(transformer).items():
        weight = transformer.get_submodule(name).weight
        assert (type(weight) is Rounded) == (decision == "fp8"), name
    assert (transformer.attn_processors["blocks.0.attn1.processor"] is processors["blocks.0.attn1.processor"]) != \
        with_plan
    quantized = forward(transformer, inputs)
    assert not torch.equal(quantized, reference)
    with pytest.raises(ValueError, match="already quantized .* remove that quantization first"):
        apply(transformer, None, linear="fp8")
    handle.remove()
    assert not handle.active and handle.linears is None
    assert_restored(transformer, before)
    assert all(transformer.attn_processors[k] is v for k, v in processors.items())
    assert torch.equal(forward(transformer, inputs), reference)
    handle.remove()  # twice is harmless


def test_a_failure_part_way_restores_every_layer_and_processor(stand_in):
    transformer, _ = tiny_bf16("wan")
    before, processors = snapshot(transformer), dict(transformer.attn_processors)
    calls = []
    good = sys.modules["torchao.quantization"].quantize_

    def third_fails(model, config, filter_fn=None):
        calls.append(model)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        good(model, config, filter_fn)

    sys.modules["torchao.quantization"].quantize_ = third_fails
    with pytest.raises(RuntimeError, match="out of memory"):
        apply(transformer, synthetic_plan(transformer), backend="torch", linear="fp8")
    assert len(calls) == 3
    assert_restored(transformer, before)
    assert all(transformer.attn_processors[k] is v for k, v in processors.items())


def test_a_layer_torchao_leaves_alone_is_an_error_not_a_silent_bf16_layer(stand_in):
    """torchao returns a layer it cannot take unchanged, without saying so: apply says so and undoes the rest."""
    transformer, _ = tiny_bf16("wan")
    before = snapshot(transformer)
    good = sys.modules["torchao.quantization"].quantize_

    def skips_ffn(model, config, filter_fn=None):
        if model is not transformer.blocks[0].ffn.net[2]:
            good(model, config, filter_fn)

    sys.modules["torchao.quantization"].quantize_ = skips_ffn
    with pytest.raises(RuntimeError, match=r"torchao left blocks.0.ffn.net.2 \(32 -> 32\) unquantized"):
        apply(transformer, None, linear="fp8")
    assert_restored(transformer, before)


def test_an_expert_pair_quantizes_both_experts(stand_in):
    from tiny_models import tiny_pipeline

    pipe = tiny_pipeline("wan2.2")
    pipe.transformer.to(torch.bfloat16)
    pipe.transformer_2.to(torch.bfloat16)
    before = {name: snapshot(getattr(pipe, name)) for name in ("transformer", "transformer_2")}
    handle = apply(pipe, None, linear="fp8")
    assert set(handle.experts) == {"transformer", "transformer_2"}
    for name, expert in handle.experts.items():
        assert expert.transformer is getattr(pipe, name)
        assert expert.linears.layers == fp8.fp8_layers(expert.transformer)
        assert all(type(expert.transformer.get_submodule(layer).weight) is Rounded for layer in expert.linears.layers)
    handle.remove()
    for name, parameters in before.items():
        assert_restored(getattr(pipe, name), parameters)


# -- torchao itself, on the CPU ----------------------------------------------------------------------------


@pytest.fixture
def torchao_on_cpu(monkeypatch):
    """torchao's float8 quantization on the CPU: its check for an sm_89 GPU, and ours, patched out. Needs a torch
    whose CPU `_scaled_mm` takes per-row scales (2.13 does; 2.11 takes per-tensor scales only)."""
    pytest.importorskip("torchao", minversion="0.18")
    e4m3 = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(e4m3, e4m3.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as error:
        pytest.skip(f"this torch's CPU _scaled_mm takes no per-row scales: {str(error)[:80]}")
    import torchao.quantization.quant_api as quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    monkeypatch.setattr(fp8, "_placement_problem", lambda what, device: None)


@pytest.mark.parametrize("family", ["wan", "flux", "cogvideox", "hunyuan_video"])
def test_torchao_fp8_layers_stay_near_bf16_and_remove_is_exact(torchao_on_cpu, family):
    from torchao.quantization import Float8Tensor

    transformer, inputs = tiny_bf16(family)
    before, reference = snapshot(transformer), forward(transformer, inputs)
    handle = apply(transformer, None, linear="fp8")
    assert all(type(transformer.get_submodule(name).weight) is Float8Tensor for name in handle.linears.layers)
    out = forward(transformer, inputs)
    relative = float((out.float() - reference.float()).norm() / reference.float().norm())
    # e4m3 keeps 3 mantissa bits: per-element rounding of ~3%, averaged down in each dot product and diluted
    # by the bf16 layers and residuals (measured 0.9-1.2% on these tiny models)
    assert 1e-4 < relative < 0.03, relative
    handle.remove()
    assert_restored(transformer, before)
    assert torch.equal(forward(transformer, inputs), reference)


# -- GPU --------------------------------------------------------------------------------------------------


def real_width_wan(device="cuda"):
    """A 2-layer Wan of Wan2.1-1.3B's widths (12 heads x 128, FFN 8960, text 4096) with random N(0, 0.02)
    weights as benchmarks/e2e.py builds them, and one forward's inputs: 3 latent frames of 30 x 52 (1170
    tokens) and 512 text tokens."""
    import diffusers

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    with torch.no_grad():
        for parameter in transformer.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.02)
    transformer = transformer.to(device, torch.bfloat16).eval()
    g = torch.Generator(device=device).manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 16, 3, 30, 52, generator=g, device=device, dtype=torch.bfloat16),
              "encoder_hidden_states": torch.randn(1, 512, 4096, generator=g, device=device, dtype=torch.bfloat16),
              "timestep": torch.tensor([900.0], device=device), "return_dict": False}
    return transformer, inputs


def relative_l2(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
def test_refusals_on_the_gpu_name_it():
    """On the GPU itself: a GPU below sm_89 is refused naming its capability; weights still on the CPU are refused."""
    transformer, _ = tiny_bf16("wan")
    problem = fp8.linear_problem("fp8", "cuda")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < fp8.MIN_CAPABILITY:
        assert f"(sm_{major}{minor}) lacks" in problem
    else:
        assert problem is None or "torchao" in problem
    with pytest.raises(ValueError, match="are on cpu: move the pipeline"):
        apply(transformer, None, linear="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("with_plan", [False, True])
@pytest.mark.parametrize("mode", ["fullgraph", "reduce-overhead"])
def test_fp8_linears_under_compile_and_cuda_graphs_stay_near_bf16(mode, with_plan):
    pytest.importorskip("torchao", minversion="0.18")
    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        pytest.skip("fp8 matrix multiplies need sm_89 or newer")
    from torch._dynamo.utils import counters
    from torchao.quantization import Float8Tensor

    torch._dynamo.reset()
    transformer, inputs = real_width_wan()
    bf16 = forward(transformer, inputs).clone()
    plan = None
    if with_plan:
        layout = family_of(transformer).call_inputs(transformer, inputs).layout
        plan = Plan.synthetic(layout=layout, num_layers=2, num_heads=12, density=0.5, orders="random",
                              block_size=64, qk="int8", pv="fp8", model_class=type(transformer).__name__,
                              model_fingerprint=model_fingerprint(transformer.config))
        with apply(transformer, plan, backend="triton"):
            paro_bf16 = forward(transformer, inputs).clone()
    before = snapshot(transformer)
    handle = apply(transformer, plan, backend="triton", linear="fp8")
    try:
        assert all(type(transformer.get_submodule(n).weight) is Float8Tensor for n in handle.linears.layers)
        eager = forward(transformer, inputs).clone()
        counters.clear()
        compiled = torch.compile(transformer, fullgraph=True, mode=None if mode == "fullgraph" else mode)
        outputs = [forward(compiled, inputs).clone() for _ in range(3)]  # reduce-overhead: records, then replays
        assert counters["stats"]["unique_graphs"] == 1
        assert not counters["inductor"]["cudagraph_skips"]
    finally:
        handle.remove()
        torch._dynamo.reset()
    reference = paro_bf16 if with_plan else bf16
    scale = float(eager.float().abs().max())
    compile_error = max(float((o.float() - eager.float()).abs().max()) for o in outputs) / scale
    fp8_error = max(relative_l2(o, reference) for o in outputs)
    print(f"{mode} plan={with_plan}: compiled vs eager fp8 max {compile_error:.1e}, fp8 vs bf16 rel L2 "
          f"{relative_l2(eager, reference):.4f} eager, {fp8_error:.4f} compiled")
    # inductor fuses the activations' quantization and the ops around it: an amax reduced in another order can
    # round a few activations to the neighbouring e4m3 value (an error that stays O(1) if compiling broke it)
    assert compile_error < 5e-2
    assert 1e-3 < fp8_error < REL_L2_BOUND
    assert_restored(transformer, before)
    assert torch.equal(forward(transformer, inputs), bf16)


# -- the step benchmark's table and profile split (benchmarks/e2e.py; no GPU) -------------------------------


def load_e2e():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e.py"
    spec = importlib.util.spec_from_file_location("e2e_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_classes_and_compiled_variants():
    e2e = load_e2e()
    names = {
        "attention": ["pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>",
                      "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "_attention_kernel",
                      "_kv_prologue_kernel", "_rotate_kernel", "paro_attention_int8_fp8", "fmha_cutlassF_bf16_aligned"],
        "matmul": ["nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n",
                   "void cutlass::device_kernel<f8f8bf16_rowwise>", "triton_tem_fused_mm_0"],
        "other": ["triton_per_fused__to_copy_abs_amax_clamp_div_0", "triton_poi_fused_add_mul_rms_norm_3",
                  "void at::native::vectorized_elementwise_kernel<4>",
                  # inductor's fused kernels name the op their output feeds: the activations' quantization, a norm
                  "triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_gelu_t_unsqueeze_view_8",
                  "triton_red_fused__fused_rms_norm__to_copy_add_block_sparse_attention_clone_expand_index_select"],
    }
    for kind, kernels in names.items():
        assert [e2e.kernel_class(k) for k in kernels] == [kind] * len(kernels), kind
    # a row stored under an earlier classifier is read with the current one: its top kernels move, the rest stay
    row = {"attention_s": 0.5, "matmul_s": 0.3, "other_s": 0.1, "idle_s": 0.01,
           "top_kernels": [["nvjet_sm90_qqtst_128x128", 0.2, "matmul"],
                           ["triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_7", 0.08, "matmul"],
                           ["triton_red_fused__fused_rms_norm__block_sparse_attention_4", 0.02, "attention"]]}
    assert e2e.split_of(row) == pytest.approx({"attention": 0.48, "matmul": 0.22, "other": 0.2, "idle": 0.01})
    args = types.SimpleNamespace(compile_densities=[0.2], linear="fp8", modes=None)
    assert [v[0] for v in e2e.compiled_variants(args)] == list(e2e.LINEAR_COLUMNS)
    assert [v[2] for v in e2e.compiled_variants(args)] == [False, True, False, True]
    args.modes = ["paro d=0.2 int8+fp8 + fp8 linear"]
    assert e2e.compiled_variants(args) == [("paro d=0.2 int8+fp8 + fp8 linear", 0.2, True)]
    args.modes = ["dense + fp8"]
    with pytest.raises(SystemExit, match="--modes dense \\+ fp8: a compiled run has dense, dense \\+ fp8 linear"):
        e2e.compiled_variants(args)


def test_linear_table_merges_runs_and_splits_each_row(tmp_path, capsys):
    """Two runs of one machine (split by --modes), merged: one line per model and setting with each mode's step
    and speedup over dense bf16, and the profiled split of each row."""
    e2e = load_e2e()
    info = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "torchao": "0.18.0", "date": "2026-11-28"}

    def row(mode, step, attention=None):
        r = {"model": "Wan2.1-14B 720p", "mode": mode, "compile": "fullgraph", "step_s": step, "tokens": 75600,
             "linear": "fp8" if mode.endswith(e2e.LINEAR) else "bf16"}
        if attention is not None:
            r.update({"profiled_wall_s": step, "attention_s": attention, "matmul_s": step / 2,
                      "other_s": step / 2 - attention - 0.1, "idle_s": 0.1})
        return r

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"info": info, "rows": [row("dense", 10.0, 3.0), row("dense + fp8 linear", 8.0)]}))
    second.write_text(json.dumps({"info": info, "rows": [row("paro d=0.2 int8+fp8", 5.0, 1.0),
                                                         row("paro d=0.2 int8+fp8 + fp8 linear", 4.0, 1.0)]}))
    e2e.main(["--table", str(first), str(second), "--merge"])
    table = capsys.readouterr().out
    assert ("| Wan2.1-14B 720p (75600) | fullgraph | 10000 ms, 1.00x | 8000 ms, 1.25x | 5000 ms, 2.00x | "
            "4000 ms, 2.50x |") in table
    assert "| Wan2.1-14B 720p | dense | fullgraph | 10000 ms | 3000 ms (30%) | 5000 ms (50%) |" in table
    assert "| Wan2.1-14B 720p | dense + fp8 linear |" not in table  # not profiled
    assert "torchao 0.18.0" in table and "a.json + b.json" in table
    e2e.main(["--table", str(second)])  # without the dense row: steps, no ratio
    assert "| not run | not run | 5000 ms | 4000 ms |" in capsys.readouterr().out
    other = tmp_path / "c.json"
    other.write_text(json.dumps({"info": {**info, "device": "NVIDIA H200"}, "rows": [row("dense", 9.0)]}))
    with pytest.raises(SystemExit, match="measured on different GPUs"):
        e2e.main(["--table", str(first), str(other), "--merge"])
