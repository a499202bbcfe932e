"""The PARO nodes in ComfyUI graphs, executed by ComfyUI's PromptExecutor on the CPU (backend "torch").

Each graph: UNETLoader of a tiny random model converted from diffusers -> Load PARO plan -> Apply PARO -> empty
latent -> KSampler, 3 steps. Checked: a full-density plan gives the unpatched model's latent; a sparse plan gives,
at every model call of the sampler, what `paroattn.apply` gives on the diffusers model with the same weights and
inputs; a plan for another model is refused with what does not match; PARO calibrate writes a plan that the
diffusers side loads and applies.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import paroattn
from paroattn import Plan, TokenLayout

STEPS = 3
# Wan: 80 x 96 pixels x 9 frames -> latent 3 x 10 x 12 -> 3 x 5 x 6 tokens; Flux: 128 x 96 -> 8 x 6 image tokens
WAN_SIZE = {"width": 96, "height": 80, "length": 9}
WAN_LAYOUT = TokenLayout(0, 3, 5, 6)
FLUX_SIZE = {"width": 96, "height": 128}
FLUX_TEXT = 16
FLUX_LAYOUT = TokenLayout(FLUX_TEXT, 1, 8, 6)
# FLUX.2: 128 x 96 pixels -> 8 x 6 latent positions, one token each; 512 text tokens (ComfyUI's padding)
FLUX2_SIZE = {"width": 96, "height": 128}
FLUX2_LAYOUT = TokenLayout(512, 1, 8, 6)
# Qwen-Image: 128 x 96 pixels -> latent 16 x 12 -> 8 x 6 tokens (2 x 2 patches); the prompt's 16 text tokens
QWEN_SIZE = {"width": 96, "height": 128}
QWEN_TEXT = 16
QWEN_LAYOUT = TokenLayout(QWEN_TEXT, 1, 8, 6)
# HunyuanVideo 1.0: 80 x 96 pixels x 9 frames -> latent 3 x 10 x 12 -> 3 x 5 x 6 tokens (2 x 2 patches), the text
# after them (diffusers' order)
HUNYUAN_SIZE = WAN_SIZE
HUNYUAN_TEXT = 8
HUNYUAN_LAYOUT = TokenLayout(0, 3, 5, 6, suffix=HUNYUAN_TEXT)
# HunyuanVideo 1.5: 80 x 96 pixels x 9 frames -> latent 3 x 5 x 6 (16x spatial compression, patch 1), after it
# (diffusers' order) the SigLIP image, ByT5 glyph and MLLM text tokens
HUNYUAN15_SIZE = WAN_SIZE
HUNYUAN15_STREAMS = {"image_tokens": 4, "byt5_tokens": 6, "tokens": 8}
HUNYUAN15_LAYOUT = TokenLayout(0, 3, 5, 6, suffix=sum(HUNYUAN15_STREAMS.values()))
# LTX-Video: 160 x 192 pixels x 17 frames -> latent 3 x 5 x 6 (32x spatial, 8x temporal compression), patch 1
LTX_SIZE = {"width": 192, "height": 160, "length": 17}
LTX_LAYOUT = TokenLayout(0, 3, 5, 6)
# LTX-2: LTX-Video's latent and grid, 4 frames of audio latent beside it
LTX2_LAYOUT = LTX_LAYOUT
LTX2_AUDIO_FRAMES = 4
BLOCK = 16  # 64-token blocks would leave these grids one or two blocks: nothing to skip
# bucket edges that the 3 steps' timesteps cross (Wan's and Flux's shifted schedules start at 1000)
EDGES = [1000.0, 990.0, 900.0, 0.0]


def records():
    import helper_nodes

    return helper_nodes.RECORDS


@pytest.fixture(scope="module")
def wan_i2v(comfy):
    import tiny_models

    model = tiny_models.tiny_wan(seed=4, i2v=True)
    tiny_models.save_diffusion_model(model, tiny_models.save_wan, "tiny-wan-i2v.safetensors")
    return model


@pytest.fixture(scope="module")
def flux(comfy):
    import tiny_models

    model = tiny_models.tiny_flux()
    tiny_models.save_diffusion_model(model, tiny_models.save_flux, "tiny-flux.safetensors")
    return model


def plan_folder() -> Path:
    import folder_paths

    folder = Path(folder_paths.get_folder_paths("paroattn")[0])
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_plan(plan: Plan, name: str) -> str:
    plan.save(plan_folder() / name)
    return name


def synthetic_plan(layout, layers, model_class, density, seed=0):
    plan = Plan.synthetic(layout=layout, num_layers=layers, num_heads=2, density=density, orders="random",
                          num_buckets=len(EDGES) - 1, block_size=BLOCK, model_class=model_class, seed=seed)
    return replace(plan, bucket_edges=EDGES)


def family_graph(family: str) -> tuple[str, dict, dict]:
    """(the model file, the empty latent node, the RandomConditioning inputs) of a family's test graph."""
    import tiny_models

    if family in ("wan", "wan-i2v", "skyreels-v2", "wan-vace"):
        text = {"tokens": 8, "dim": tiny_models.WAN_TEXT_DIM, "pooled_dim": 0}
        if family == "wan-i2v":  # diffusers' I2V attention takes the keys past the 512th as the image's
            text.update(tokens=512, image_tokens=4, image_dim=tiny_models.WAN_IMAGE_DIM)
        latent = {"class_type": "EmptyHunyuanLatentVideo", "inputs": {**WAN_SIZE, "batch_size": 1}}
        return f"tiny-{family}.safetensors", latent, text
    if family == "flux":
        latent = {"class_type": "EmptySD3LatentImage", "inputs": {**FLUX_SIZE, "batch_size": 1}}
        return "tiny-flux.safetensors", latent, {"tokens": FLUX_TEXT, "dim": tiny_models.FLUX_TEXT_DIM,
                                                 "pooled_dim": tiny_models.FLUX_POOLED_DIM}
    if family == "flux2":  # ComfyUI pads FLUX.2's text to 512 tokens, as diffusers does
        latent = {"class_type": "EmptyFlux2LatentImage", "inputs": {**FLUX2_SIZE, "batch_size": 1}}
        return "tiny-flux2.safetensors", latent, {"tokens": FLUX_TEXT, "dim": tiny_models.FLUX_TEXT_DIM, "pooled_dim": 0}
    if family == "qwen-image":
        latent = {"class_type": "EmptySD3LatentImage", "inputs": {**QWEN_SIZE, "batch_size": 1}}
        return "tiny-qwen-image.safetensors", latent, {"tokens": QWEN_TEXT, "dim": tiny_models.QWEN_TEXT_DIM,
                                                       "pooled_dim": 0}
    if family == "hunyuan-video":
        latent = {"class_type": "EmptyHunyuanLatentVideo", "inputs": {**HUNYUAN_SIZE, "batch_size": 1}}
        return "tiny-hunyuan-video.safetensors", latent, {"tokens": HUNYUAN_TEXT, "dim": tiny_models.HUNYUAN_TEXT_DIM,
                                                          "pooled_dim": tiny_models.HUNYUAN_POOLED_DIM}
    if family == "hunyuan-video15":
        latent = {"class_type": "EmptyHunyuanVideo15Latent", "inputs": {**HUNYUAN15_SIZE, "batch_size": 1}}
        return "tiny-hunyuan-video15.safetensors", latent, {
            **HUNYUAN15_STREAMS, "dim": tiny_models.HUNYUAN15_TEXT_DIM, "pooled_dim": 8,  # read, then unused
            "image_dim": tiny_models.HUNYUAN15_IMAGE_DIM}
    if family == "ltx-video":
        latent = {"class_type": "EmptyLTXVLatentVideo", "inputs": {**LTX_SIZE, "batch_size": 1}}
        return "tiny-ltx-video.safetensors", latent, {"tokens": 8, "dim": tiny_models.LTX_TEXT_DIM, "pooled_dim": 0,
                                                      "text_mask": True}
    if family == "ltx2":  # text as diffusers' pipeline hands it over: video and audio connector outputs side by side
        latent = {"class_type": "AudioVideoLatent", "inputs": {"video": ["video", 0], "audio_frames": LTX2_AUDIO_FRAMES}}
        return "tiny-ltx2.safetensors", latent, {"tokens": 8, "dim": 2 * tiny_models.LTX_TEXT_DIM, "pooled_dim": 0,
                                                 "text_mask": True}
    raise ValueError(f"no test graph for {family}")


def graph(family: str, *, plan: str | None = None, record: str | None = None, keep: str = "latent",
          on_mismatch: str = "error", calibrate: dict | None = None) -> tuple[dict, list[str]]:
    """The API prompt of the test graph and its output nodes."""
    loader, latent, text = family_graph(family)
    prompt = {"model": {"class_type": "UNETLoader", "inputs": {"unet_name": loader, "weight_dtype": "default"}},
              "latent": latent}
    if latent["inputs"].get("video") == ["video", 0]:
        prompt["video"] = {"class_type": "EmptyLTXVLatentVideo", "inputs": {**LTX_SIZE, "batch_size": 1}}
    prompt["positive"] = {"class_type": "RandomConditioning", "inputs": {"seed": 1, **text}}
    prompt["negative"] = {"class_type": "RandomConditioning", "inputs": {"seed": 2, **text}}
    model = ["model", 0]
    if family == "ltx2":  # the video independent of the audio, as diffusers' isolate_modalities makes it
        prompt["isolate"] = {"class_type": "IsolateModalities", "inputs": {"model": model}}
        model = ["isolate", 0]
    sampling = {"seed": 7, "steps": STEPS, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple",
                "positive": ["positive", 0], "negative": ["negative", 0], "latent_image": ["latent", 0]}
    if calibrate is not None:
        prompt["calibrate"] = {"class_type": "PAROCalibrate", "inputs": {"model": model, **sampling, **calibrate}}
        return prompt, ["calibrate"]
    if plan is not None:
        prompt["plan"] = {"class_type": "LoadPAROPlan", "inputs": {"plan_name": plan}}
        prompt["paro"] = {"class_type": "ApplyPARO", "inputs": {"model": model, "plan": ["plan", 0], "backend": "torch",
                                                                 "on_mismatch": on_mismatch, "expert": "auto"}}
        model = ["paro", 0]
    if record is not None:
        prompt["record"] = {"class_type": "RecordModelCalls", "inputs": {"model": model, "key": record}}
        model = ["record", 0]
    prompt["sample"] = {"class_type": "KSampler", "inputs": {"model": model, **sampling, "denoise": 1.0}}
    prompt["keep"] = {"class_type": "KeepLatent", "inputs": {"samples": ["sample", 0], "key": keep}}
    return prompt, ["keep"]


def run_graph(family: str, **kwargs) -> tuple[bool, str]:
    import comfy_env

    prompt, outputs = graph(family, **kwargs)
    ok, messages = comfy_env.run(prompt, outputs)
    return ok, comfy_env.error_message(messages)


def latent_of(key: str) -> torch.Tensor:
    return records()[key][-1]


# -- loading --------------------------------------------------------------------------------------------------
def test_the_pack_loads_as_a_custom_node(comfy):
    for name, title in (("LoadPAROPlan", "Load PARO plan"), ("ApplyPARO", "Apply PARO"),
                        ("PAROCalibrate", "PARO calibrate")):
        node = comfy.NODE_CLASS_MAPPINGS[name]
        assert comfy.NODE_DISPLAY_NAME_MAPPINGS[name] == title
        assert node.RELATIVE_PYTHON_MODULE.startswith("custom_nodes.")  # set by nodes.load_custom_node


def test_the_plan_list_shows_plans_and_expert_pairs_but_not_statistics(comfy):
    folder = plan_folder()
    plan = Plan.synthetic(layout=WAN_LAYOUT, num_layers=2, num_heads=2, block_size=BLOCK)
    first, second = replace(plan, expert="transformer"), replace(plan, expert="transformer_2")
    first.info["experts"] = second.info["experts"] = {"transformer": "pair.safetensors",
                                                      "transformer_2": "pair.transformer_2.safetensors"}
    first.save(folder / "pair.safetensors")
    second.save(folder / "pair.transformer_2.safetensors")
    (folder / "pair.stats.safetensors").write_bytes(b"")
    names = comfy.NODE_CLASS_MAPPINGS["LoadPAROPlan"].INPUT_TYPES()["required"]["plan_name"][0]
    assert "pair.safetensors" in names and "pair.transformer_2.safetensors" in names
    assert "pair.stats.safetensors" not in names
    loaded = comfy.NODE_CLASS_MAPPINGS["LoadPAROPlan"]().load("pair.transformer_2.safetensors")["result"][0]
    assert [p.expert for p in loaded.plans] == ["transformer", "transformer_2"]
    assert loaded.for_expert("transformer_2").expert == "transformer_2"
    with pytest.raises(paroattn.PlanError, match="expert pair"):
        loaded.for_expert("auto")


# -- Wan ------------------------------------------------------------------------------------------------------
def test_wan_full_density_plan_gives_the_unpatched_latent(wan):
    plan = save_plan(synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 1.0), "wan-d1.safetensors")
    assert run_graph("wan", keep="wan-dense") == (True, "")
    assert run_graph("wan", plan=plan, keep="wan-d1") == (True, "")
    dense, paro = latent_of("wan-dense"), latent_of("wan-d1")
    difference = float((dense - paro).abs().max())
    print(f"Wan, d=1 plan vs unpatched, final latent after {STEPS} steps: max |difference| {difference:.2e}")
    assert difference < 1e-4 * float(dense.abs().max())


def compare_with_diffusers(calls, run_diffusers, name):
    """Max |ComfyUI - diffusers| over the sampler's model calls, relative to the output's size."""
    worst = 0.0
    for call in calls:
        with torch.no_grad():
            expected = run_diffusers(*call["args"])
        out = call["out"][0] if isinstance(call["out"], (list, tuple)) else call["out"]  # LTX-2: [video, audio]
        scale = float(expected.abs().max())
        worst = max(worst, float((out - expected).abs().max()) / scale)
    print(f"{name}: {len(calls)} model calls, max |ComfyUI - paroattn.apply on diffusers| / max |output| = {worst:.2e}")
    return worst


def test_wan_sparse_plan_equals_paroattn_apply_on_the_diffusers_model(wan):
    plan = synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5, seed=3)
    name = save_plan(plan, "wan-d05.safetensors")
    assert run_graph("wan", plan=name, record="wan-sparse", keep="wan-sparse-latent") == (True, "")
    calls = records()["wan-sparse"]
    buckets = {plan.bucket_of(float(call["args"][1].max())) for call in calls}
    assert len(buckets) > 1, f"the sampler's timesteps all fell in bucket {buckets}: the test would not see buckets"

    def diffusers_wan(x, timestep, context, *_):
        return wan(hidden_states=x, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]

    with paroattn.apply(wan, Plan.load(plan_folder() / name), backend="torch"):
        worst = compare_with_diffusers(calls, diffusers_wan, "Wan, d=0.5 plan")
    assert worst < 1e-5
    # and the plan changed the model: without it, the outputs differ by far more
    assert compare_with_diffusers(calls, diffusers_wan, "Wan, same calls, diffusers without PARO") > 100 * worst


def test_wan_plan_for_another_model_is_refused_with_what_does_not_match(wan):
    name = save_plan(synthetic_plan(WAN_LAYOUT, 3, "WanTransformer3DModel", 0.5), "wan-3-layers.safetensors")
    ok, message = run_graph("wan", plan=name, keep="refused")
    assert not ok
    assert "plan has 3 self-attention layers; this MODEL has 2" in message and "on_mismatch" in message
    name = save_plan(synthetic_plan(FLUX_LAYOUT, 2, "FluxTransformer2DModel", 0.5), "flux-for-wan.safetensors")
    ok, message = run_graph("wan", plan=name, keep="refused")
    assert not ok and "plan was calibrated for FluxTransformer2DModel; this MODEL is a Wan 2.1 / 2.2 model" in message
    # on_mismatch="dense": the model's own attention, the same latent as without the plan
    assert run_graph("wan", keep="wan-dense") == (True, "")
    assert run_graph("wan", plan=name, on_mismatch="dense", keep="wan-refused-dense") == (True, "")
    assert torch.equal(latent_of("wan-refused-dense"), latent_of("wan-dense"))


def test_wan_call_of_another_size_is_refused_without_axis_profiles(wan):
    other = TokenLayout(0, 3, 4, 6)  # calibrated at 64 x 96 pixels, run at 80 x 96; no profiles to derive from
    name = save_plan(synthetic_plan(other, 2, "WanTransformer3DModel", 0.5), "wan-other-size.safetensors")
    ok, message = run_graph("wan", plan=name, keep="refused")
    assert not ok and "3x4x6" in message and "3x5x6" in message and "axis profiles" in message


def test_wan_i2v_sparse_plan_equals_paroattn_apply_on_the_diffusers_model(wan_i2v):
    """I2V blocks make two cross-attention calls (image, text) after the self-attention: only the first is PARO's."""
    plan = synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5, seed=6)
    name = save_plan(plan, "wan-i2v-d05.safetensors")
    assert run_graph("wan-i2v", plan=name, record="wan-i2v", keep="wan-i2v-latent") == (True, "")
    calls = records()["wan-i2v"]
    assert calls[0]["args"][0].shape[1] == 36 and calls[0]["args"][3] is not None  # mask + image latent, CLIP features

    def diffusers_wan(x, timestep, context, clip_fea, *_):
        return wan_i2v(hidden_states=x, timestep=timestep, encoder_hidden_states=context,
                       encoder_hidden_states_image=clip_fea, return_dict=False)[0]

    with paroattn.apply(wan_i2v, Plan.load(plan_folder() / name), backend="torch"):
        worst = compare_with_diffusers(calls, diffusers_wan, "Wan I2V, d=0.5 plan")
    assert worst < 1e-5
    assert compare_with_diffusers(calls, diffusers_wan, "Wan I2V, same calls, diffusers without PARO") > 100 * worst


def test_wan22_expert_pair_binds_each_expert_to_its_plan(wan, comfy):
    """Two models (high noise, low noise) each with Apply PARO on the same loaded pair, sampled in turn as in
    ComfyUI's Wan 2.2 A14B workflows: each model call equals its diffusers expert under its own plan."""
    import folder_paths
    import tiny_models

    low = tiny_models.tiny_wan(seed=9)
    tiny_models.save_wan(low, Path(folder_paths.get_folder_paths("diffusion_models")[0]) / "tiny-wan-low.safetensors")
    files = {"transformer": "pair22.safetensors", "transformer_2": "pair22.transformer_2.safetensors"}
    for i, (expert, file) in enumerate(files.items()):
        plan = replace(synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5, seed=10 + i), expert=expert)
        plan.info["experts"] = files
        save_plan(plan, file)
    prompt, _ = graph("wan")
    sampling = {k: v for k, v in prompt["sample"]["inputs"].items() if k not in ("model", "seed", "denoise", "latent_image")}
    prompt.update({
        "low": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny-wan-low.safetensors", "weight_dtype": "default"}},
        "plan": {"class_type": "LoadPAROPlan", "inputs": {"plan_name": files["transformer_2"]}},
        "paro_high": {"class_type": "ApplyPARO", "inputs": {"model": ["model", 0], "plan": ["plan", 0], "backend": "torch",
                                                            "on_mismatch": "error", "expert": "transformer"}},
        "paro_low": {"class_type": "ApplyPARO", "inputs": {"model": ["low", 0], "plan": ["plan", 0], "backend": "torch",
                                                           "on_mismatch": "error", "expert": "transformer_2"}},
        "record_high": {"class_type": "RecordModelCalls", "inputs": {"model": ["paro_high", 0], "key": "high"}},
        "record_low": {"class_type": "RecordModelCalls", "inputs": {"model": ["paro_low", 0], "key": "low"}},
        "sample": {"class_type": "KSamplerAdvanced", "inputs": {
            "model": ["record_high", 0], **sampling, "add_noise": "enable", "noise_seed": 7, "latent_image": ["latent", 0],
            "start_at_step": 0, "end_at_step": 2, "return_with_leftover_noise": "enable"}},
        "sample_low": {"class_type": "KSamplerAdvanced", "inputs": {
            "model": ["record_low", 0], **sampling, "add_noise": "disable", "noise_seed": 7, "latent_image": ["sample", 0],
            "start_at_step": 2, "end_at_step": STEPS, "return_with_leftover_noise": "disable"}},
    })
    prompt["keep"]["inputs"]["samples"] = ["sample_low", 0]
    import comfy_env

    ok, messages = comfy_env.run(prompt, ["keep"])
    assert (ok, comfy_env.error_message(messages)) == (True, "")
    assert len(records()["high"]) == 2 and len(records()["low"]) == 1
    for key, model, file in (("high", wan, files["transformer"]), ("low", low, files["transformer_2"])):
        def run(x, timestep, context, *_, model=model):
            return model(hidden_states=x, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]

        with paroattn.apply(model, Plan.load(plan_folder() / file), backend="torch"):
            assert compare_with_diffusers(records()[key], run, f"Wan 2.2 pair, {key}-noise expert") < 1e-5


def test_models_without_a_paro_layout_are_refused_with_the_reason(comfy):
    import comfy_env

    families = comfy_env.pack_module("families")

    class CogVideoX:  # stands for ComfyUI's model_base.CogVideoX
        diffusion_model = object()

    class Patcher:
        model = CogVideoX()

    with pytest.raises(families.UnsupportedModel, match="cannot be matched to a plan layer"):
        families.family_of(Patcher())


# -- Flux -----------------------------------------------------------------------------------------------------
def diffusers_flux(model):
    def run(x, timestep, context, y, guidance, *_):
        B, C, H, W = x.shape
        h, w = H // 2, W // 2
        packed = x.view(B, C, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, C * 4)
        img_ids = torch.zeros(h, w, 3)
        img_ids[..., 1] = torch.arange(h)[:, None]
        img_ids[..., 2] = torch.arange(w)[None, :]
        out = model(hidden_states=packed, timestep=timestep, guidance=guidance, pooled_projections=y,
                    encoder_hidden_states=context, txt_ids=torch.zeros(context.shape[1], 3),
                    img_ids=img_ids.reshape(h * w, 3), return_dict=False)[0]
        return out.view(B, h, w, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)
    return run


def test_flux_full_density_plan_gives_the_unpatched_latent(flux):
    plan = save_plan(synthetic_plan(FLUX_LAYOUT, 2, "FluxTransformer2DModel", 1.0), "flux-d1.safetensors")
    assert run_graph("flux", keep="flux-dense") == (True, "")
    assert run_graph("flux", plan=plan, keep="flux-d1") == (True, "")
    dense, paro = latent_of("flux-dense"), latent_of("flux-d1")
    difference = float((dense - paro).abs().max())
    print(f"Flux, d=1 plan vs unpatched, final latent after {STEPS} steps: max |difference| {difference:.2e}")
    assert difference < 1e-4 * float(dense.abs().max())


def test_flux_sparse_plan_equals_paroattn_apply_on_the_diffusers_model(flux):
    plan = synthetic_plan(FLUX_LAYOUT, 2, "FluxTransformer2DModel", 0.5, seed=5)
    name = save_plan(plan, "flux-d05.safetensors")
    assert run_graph("flux", plan=name, record="flux-sparse", keep="flux-sparse-latent") == (True, "")
    calls = records()["flux-sparse"]
    buckets = {plan.bucket_of(1000 * float(call["args"][1].max())) for call in calls}
    assert len(buckets) > 1, f"the sampler's timesteps all fell in bucket {buckets}: the test would not see buckets"
    with paroattn.apply(flux, Plan.load(plan_folder() / name), backend="torch"):
        worst = compare_with_diffusers(calls, diffusers_flux(flux), "Flux, d=0.5 plan")
    assert worst < 1e-5
    assert compare_with_diffusers(calls, diffusers_flux(flux), "Flux, same calls, diffusers without PARO") > 100 * worst


def test_flux_plan_of_another_text_length_derives_its_masks_as_diffusers_does(flux):
    """ComfyUI pads FLUX's T5 text to 256 tokens, diffusers to 512: a plan calibrated with more text tokens than
    the call has serves it through masks derived from its axis profiles, the same ones diffusers derives."""
    plan = Plan.synthetic(layout=TokenLayout(2 * FLUX_TEXT, 1, 8, 6), num_layers=2, num_heads=2, density=0.5,
                          orders="random", num_buckets=1, block_size=BLOCK, model_class="FluxTransformer2DModel",
                          seed=8, profiles=True)
    name = save_plan(plan, "flux-longer-text.safetensors")
    assert run_graph("flux", plan=name, record="flux-derived", keep="flux-derived-latent") == (True, "")
    with paroattn.apply(flux, Plan.load(plan_folder() / name), backend="torch"):
        worst = compare_with_diffusers(records()["flux-derived"], diffusers_flux(flux), "Flux, plan for 32 text tokens")
    assert worst < 1e-5
    assert compare_with_diffusers(records()["flux-derived"], diffusers_flux(flux), "Flux, same calls, without PARO") \
        > 100 * worst


def test_flux_plan_for_another_model_is_refused(flux):
    name = save_plan(synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5), "wan-for-flux.safetensors")
    ok, message = run_graph("flux", plan=name, keep="refused")
    assert not ok and "plan was calibrated for WanTransformer3DModel; this MODEL is a FLUX.1 model" in message


# -- calibration ----------------------------------------------------------------------------------------------
CALIBRATE = {"density": 0.5, "qk": "bf16", "pv": "bf16", "block_size": BLOCK, "stat_every": 1, "expert": "none", "overwrite": True}


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_calibrate_node_writes_a_plan_the_diffusers_side_loads_and_applies(family, request):
    model = request.getfixturevalue(family)
    ok, message = run_graph(family, calibrate={**CALIBRATE, "filename": f"calibrated-{family}"})
    assert (ok, message) == (True, "")
    path = plan_folder() / f"calibrated-{family}.safetensors"
    plan = paroattn.load_plans(path)[0]
    layout = WAN_LAYOUT if family == "wan" else FLUX_LAYOUT
    assert plan.layout == layout and plan.num_layers == 2 and plan.num_heads == 2
    assert plan.model_class == type(model).__name__
    assert plan.info["model_config"]["attention_head_dim"] == 128
    assert plan.profiles is not None  # the plan derives masks for other sizes
    print(f"{family}: calibrated in the graph, achieved density {plan.achieved_density():.3f}, attention mass kept "
          f"{plan.info['kept_mass']:.3f}")
    assert 0.3 < plan.achieved_density() < 0.7
    # the diffusers model with these weights accepts it (class and config fingerprint match) and runs it
    with paroattn.apply(model, plan, backend="torch", on_mismatch="error"):
        pass
    # and ComfyUI runs it through Apply PARO
    assert run_graph(family, plan=path.name, keep=f"{family}-calibrated") == (True, "")


def test_calibrate_node_writes_wan22_expert_plans_as_one_pair(wan, comfy):
    """Calibrating the high-noise and the low-noise model in turn (expert transformer, then transformer_2) writes
    two files that each load as the pair, in ComfyUI and in diffusers."""
    for expert in ("transformer", "transformer_2"):
        ok, message = run_graph("wan", calibrate={**CALIBRATE, "filename": "calibrated-pair", "expert": expert})
        assert (ok, message) == (True, "")
    for name in ("calibrated-pair.safetensors", "calibrated-pair.transformer_2.safetensors"):
        assert [p.expert for p in paroattn.load_plans(plan_folder() / name)] == ["transformer", "transformer_2"]
        loaded = comfy.NODE_CLASS_MAPPINGS["LoadPAROPlan"]().load(name)["result"][0]
        assert [p.expert for p in loaded.plans] == ["transformer", "transformer_2"]


def test_calibrate_node_refuses_to_overwrite_a_plan(wan):
    save_plan(synthetic_plan(WAN_LAYOUT, 2, "WanTransformer3DModel", 0.5), "taken.safetensors")
    ok, message = run_graph("wan", calibrate={**CALIBRATE, "filename": "taken", "overwrite": False})
    assert not ok and "taken.safetensors exists" in message
