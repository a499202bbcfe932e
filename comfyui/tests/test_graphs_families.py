"""The PARO nodes on the families beyond Wan 2.1 / 2.2 and FLUX.1, in ComfyUI graphs on the CPU (backend "torch"):
SkyReels-V2 (loaded by ComfyUI as Wan 2.1), Wan VACE, FLUX.2, Qwen-Image, HunyuanVideo 1.0 and 1.5 and LTX-Video.

Each family's graph is test_graphs' (UNETLoader of a tiny random model converted from diffusers -> Load PARO plan
-> Apply PARO -> empty latent -> KSampler, 3 steps). Checked: a full-density plan gives the unpatched model's
latent; a sparse plan (random per-head orders, random masks per layer and timestep bucket) gives, at every model
call of the sampler, what `paroattn.apply` gives on the diffusers model with the same weights and inputs, which a
call matched to the wrong layer, tokens in another order, or a self-attention left to ComfyUI, would not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import pytest
import torch
from test_graphs import (
    BLOCK,
    CALIBRATE,
    EDGES,
    FLUX2_LAYOUT,
    HUNYUAN15_LAYOUT,
    HUNYUAN_LAYOUT,
    LTX2_LAYOUT,
    LTX_LAYOUT,
    QWEN_LAYOUT,
    STEPS,
    WAN_LAYOUT,
    compare_with_diffusers,
    graph,
    latent_of,
    plan_folder,
    records,
    run_graph,
    save_plan,
)

import paroattn
from paroattn import Plan


@dataclass(frozen=True)
class Case:
    layout: paroattn.TokenLayout
    layers: int
    heads: int
    model_class: str
    timestep_scale: float  # brings the timestep ComfyUI passes the model onto the plan's 0..1000


CASES = {
    "skyreels-v2": Case(WAN_LAYOUT, 2, 2, "SkyReelsV2Transformer3DModel", 1.0),
    "wan-vace": Case(WAN_LAYOUT, 3, 2, "WanVACETransformer3DModel", 1.0),  # 2 Wan blocks, then 1 VACE block
    "flux2": Case(FLUX2_LAYOUT, 2, 2, "Flux2Transformer2DModel", 1000.0),
    "qwen-image": Case(QWEN_LAYOUT, 1, 24, "QwenImageTransformer2DModel", 1000.0),
    "hunyuan-video": Case(HUNYUAN_LAYOUT, 2, 2, "HunyuanVideoTransformer3DModel", 1.0),  # 1 double, 1 single block
    "hunyuan-video15": Case(HUNYUAN15_LAYOUT, 2, 2, "HunyuanVideo15Transformer3DModel", 1.0),
    "ltx-video": Case(LTX_LAYOUT, 2, 2, "LTXVideoTransformer3DModel", 1000.0),
    "ltx2": Case(LTX2_LAYOUT, 2, 2, "LTX2VideoTransformer3DModel", 1000.0),
}


def case_plan(family: str, density: float, seed: int = 0) -> Plan:
    case = CASES[family]
    plan = Plan.synthetic(layout=case.layout, num_layers=case.layers, num_heads=case.heads, density=density,
                          orders="random", num_buckets=len(EDGES) - 1, block_size=BLOCK,
                          model_class=case.model_class, seed=seed)
    return replace(plan, bucket_edges=EDGES)


def save_model(name: str, model, save) -> None:
    import tiny_models

    tiny_models.save_diffusion_model(model, save, f"tiny-{name}.safetensors")


def make_model(family: str):
    import tiny_models

    if family == "skyreels-v2":
        model = tiny_models.tiny_wan(seed=11, variant="skyreels_v2")
        save_model(family, model, tiny_models.save_wan)
    elif family == "wan-vace":
        model = tiny_models.tiny_wan(seed=12, variant="vace")
        save_model(family, model, tiny_models.save_wan)
    elif family == "flux2":
        model = tiny_models.tiny_flux2(seed=13)
        save_model(family, model, tiny_models.save_flux2)
    elif family == "hunyuan-video":
        model = tiny_models.tiny_hunyuan_video(seed=17)
        save_model(family, model, tiny_models.save_hunyuan_video)
    elif family == "hunyuan-video15":
        model = tiny_models.tiny_hunyuan_video15(seed=15)
        save_model(family, model, tiny_models.save_hunyuan_video15)
    elif family == "ltx-video":
        model = tiny_models.tiny_ltx_video(seed=16)
        save_model(family, model, tiny_models.save_ltx_video)
    elif family == "ltx2":
        model = tiny_models.tiny_ltx2(seed=18)
        save_model(family, model, tiny_models.save_ltx2)
    else:
        model = tiny_models.tiny_qwen_image(seed=14)
        save_model(family, model, tiny_models.save_flux)
    return model


@pytest.fixture(scope="module")
def models(comfy):
    """The diffusers model of each family, made and saved for ComfyUI at first use."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = make_model(family)
        return made[family]
    return get


# -- the diffusers side of one recorded model call ---------------------------------------------------------
def vace_control(x: torch.Tensor) -> torch.Tensor:
    """What ComfyUI's Wan VACE takes without a VACE input node: zero frames (inactive and reactive halves, each
    brought into the model's latent space) and a mask of ones."""
    import comfy.latent_formats

    zeros = comfy.latent_formats.Wan21().process_in(torch.zeros_like(x))
    B, _, F, H, W = x.shape
    return torch.cat([zeros, zeros, torch.ones(B, 64, F, H, W)], dim=1)


def diffusers_runner(family: str, model):
    if family == "skyreels-v2":
        def run(x, timestep, context, *_):
            return model(hidden_states=x, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]
    elif family == "wan-vace":
        def run(x, timestep, context, *_):
            return model(hidden_states=x, timestep=timestep, encoder_hidden_states=context,
                         control_hidden_states=vace_control(x), return_dict=False)[0]
    elif family == "flux2":
        def run(x, timestep, context, y, guidance, *_):
            B, C, H, W = x.shape
            img_ids = torch.zeros(H, W, 4)
            img_ids[..., 1] = torch.arange(H)[:, None]
            img_ids[..., 2] = torch.arange(W)[None, :]
            txt_ids = torch.zeros(context.shape[1], 4)
            txt_ids[:, 3] = torch.arange(context.shape[1])
            out = model(hidden_states=x.flatten(2).transpose(1, 2), encoder_hidden_states=context, timestep=timestep,
                        img_ids=img_ids.view(H * W, 4), txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]
            return out.transpose(1, 2).reshape(B, C, H, W)
    elif family == "hunyuan-video":
        def run(x, timestep, context, y, txt_byt5, clip_fea, guidance, *_):
            # ComfyUI embeds the guidance scale g as g * 1000 (diffusers' pipeline passes it so scaled)
            return model(hidden_states=x, timestep=timestep, encoder_hidden_states=context,
                         encoder_attention_mask=torch.ones(context.shape[:2], dtype=torch.long), pooled_projections=y,
                         guidance=1000 * guidance, return_dict=False)[0]
    elif family == "hunyuan-video15":
        def run(x, timestep, context, y, txt_byt5, clip_fea, *_):
            # every token valid: the streams joined as [image ; ByT5 ; text], ComfyUI's order, after the video
            def valid(t):
                return torch.ones(t.shape[:2], dtype=torch.long)
            return model(hidden_states=x, timestep=timestep, encoder_hidden_states=context,
                         encoder_attention_mask=valid(context), encoder_hidden_states_2=txt_byt5,
                         encoder_attention_mask_2=valid(txt_byt5), image_embeds=clip_fea, return_dict=False)[0]
    elif family == "ltx-video":
        def run(x, timestep, context, *_):
            # ComfyUI's default frame rate (25) and VAE scales (8 in time, 32 in space), as LTXPipeline passes them
            B, C, F, H, W = x.shape
            out = model(hidden_states=x.flatten(2).transpose(1, 2), encoder_hidden_states=context,
                        timestep=1000 * timestep, encoder_attention_mask=torch.ones(context.shape[:2]), num_frames=F,
                        height=H, width=W, rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False)[0]
            return out.transpose(1, 2).reshape(B, C, F, H, W)
    elif family == "ltx2":
        import tiny_models

        def run(x, timestep, context, attention_mask, frame_rate, *_):
            # the video's output, which with the cross-modal attention off (isolate_modalities; ComfyUI's graph
            # switches it off too) does not depend on the audio
            video, audio = x
            B, C, F, H, W = video.shape
            text = tiny_models.LTX_TEXT_DIM
            mask = torch.ones(context.shape[:2])
            out = model(hidden_states=video.flatten(2).transpose(1, 2),
                        audio_hidden_states=audio.transpose(1, 2).flatten(2), encoder_hidden_states=context[..., :text],
                        audio_encoder_hidden_states=context[..., text:], timestep=1000 * timestep,
                        encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=F, height=H,
                        width=W, fps=frame_rate, audio_num_frames=audio.shape[2], isolate_modalities=True,
                        return_dict=False)[0]
            return out.transpose(1, 2).reshape(B, C, F, H, W)
    else:
        def run(x, timestep, context, *_):
            B, C, _, H, W = x.shape
            h, w = H // 2, W // 2
            packed = x[:, :, 0].reshape(B, C, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, C * 4)
            out = model(hidden_states=packed, encoder_hidden_states=context, timestep=timestep,
                        img_shapes=[[(1, h, w)]] * B, return_dict=False)[0]
            return out.view(B, h, w, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, 1, H, W)
    return run


# -- tests --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(CASES))
def test_full_density_plan_gives_the_unpatched_latent(family, models):
    models(family)
    name = save_plan(case_plan(family, 1.0), f"{family}-d1.safetensors")
    assert run_graph(family, keep=f"{family}-dense") == (True, "")
    assert run_graph(family, plan=name, keep=f"{family}-d1") == (True, "")
    dense, paro = latent_of(f"{family}-dense"), latent_of(f"{family}-d1")
    difference = float((dense - paro).abs().max())
    print(f"{family}, d=1 plan vs unpatched, final latent after {STEPS} steps: max |difference| {difference:.2e}")
    assert difference < 1e-4 * float(dense.abs().max())


@pytest.mark.parametrize("family", list(CASES))
def test_sparse_plan_equals_paroattn_apply_on_the_diffusers_model(family, models):
    model = models(family)
    plan = case_plan(family, 0.5, seed=3)
    name = save_plan(plan, f"{family}-d05.safetensors")
    assert run_graph(family, plan=name, record=f"{family}-sparse", keep=f"{family}-sparse-latent") == (True, "")
    calls = records()[f"{family}-sparse"]
    scale = CASES[family].timestep_scale
    buckets = {plan.bucket_of(scale * float(call["args"][1].max())) for call in calls}
    assert len(buckets) > 1, f"the sampler's timesteps all fell in bucket {buckets}: the test would not see buckets"
    run = diffusers_runner(family, model)
    with paroattn.apply(model, Plan.load(plan_folder() / name), backend="torch"):
        worst = compare_with_diffusers(calls, run, f"{family}, d=0.5 plan")
    assert worst < 1e-5
    # and the plan changed the model: without it, the outputs differ by far more
    assert compare_with_diffusers(calls, run, f"{family}, same calls, diffusers without PARO") > 100 * worst


def test_hunyuan_video15_plan_of_another_text_length_derives_its_masks_as_diffusers_does(models):
    """The diffusers pipeline pads the conditioning to 1985 tokens (729 image, 256 ByT5, 1000 text) where ComfyUI
    passes the prompt's own: a plan calibrated with more conditioning tokens than the call has serves it through
    masks derived from its axis profiles, the ones diffusers derives for a call of the same tokens."""
    model = models("hunyuan-video15")
    layout = replace(HUNYUAN15_LAYOUT, suffix=2 * HUNYUAN15_LAYOUT.suffix)
    plan = Plan.synthetic(layout=layout, num_layers=2, num_heads=2, density=0.5, orders="random", num_buckets=1,
                          block_size=BLOCK, model_class="HunyuanVideo15Transformer3DModel", seed=8, profiles=True)
    name = save_plan(plan, "hunyuan-video15-longer-text.safetensors")
    assert run_graph("hunyuan-video15", plan=name, record="hunyuan-derived", keep="hunyuan-derived-latent") == (True, "")
    calls, run = records()["hunyuan-derived"], diffusers_runner("hunyuan-video15", model)
    with paroattn.apply(model, Plan.load(plan_folder() / name), backend="torch"):
        worst = compare_with_diffusers(calls, run, f"hunyuan-video15, plan for {layout.suffix} conditioning tokens")
    assert worst < 1e-5
    assert compare_with_diffusers(calls, run, "hunyuan-video15, same calls, without PARO") > 100 * worst


def test_hunyuan_video_text_mask_runs_the_plan_where_it_masks_nothing_and_is_refused_where_it_pads(models):
    """ComfyUI's HunyuanVideo (1.0) turns the conditioning's text mask into an additive mask over the joined
    sequence, which every block's attention call gets: one with every text token valid masks nothing, and the plan
    runs (equal to diffusers' with that mask); one with padded tokens is refused, saying so."""
    import comfy_env

    model = models("hunyuan-video")
    plan = case_plan("hunyuan-video", 0.5, seed=4)
    name = save_plan(plan, "hunyuan-video-mask.safetensors")
    prompt, outputs = graph("hunyuan-video", plan=name, record="hunyuan-mask", keep="hunyuan-mask-latent")
    # on the prompt alone: ComfyUI's HunyuanVideo builds a mask of batch 1, so masks of a batched prompt and
    # negative prompt fail in its own forward
    prompt["positive"]["inputs"]["text_mask"] = True
    ok, messages = comfy_env.run(prompt, outputs)
    assert (ok, comfy_env.error_message(messages)) == (True, "")
    calls = records()["hunyuan-mask"]
    assert sum(call["args"][7] is not None for call in calls) == len(calls) // 2  # the prompt's calls got the mask
    run = diffusers_runner("hunyuan-video", model)
    with paroattn.apply(model, Plan.load(plan_folder() / name), backend="torch"):
        worst = compare_with_diffusers(calls, run, "hunyuan-video, d=0.5 plan, text mask of ones")
    assert worst < 1e-5
    prompt["positive"]["inputs"]["padded_tokens"] = 2
    ok, messages = comfy_env.run(prompt, outputs)
    assert not ok and "text attention mask has padded tokens" in comfy_env.error_message(messages)


@pytest.mark.parametrize("family", ["hunyuan-video", "hunyuan-video15", "ltx-video", "ltx2"])
def test_calibrate_node_writes_the_plan_of_the_diffusers_model(family, models):
    """PARO calibrate records the calls as the diffusers model makes them (HunyuanVideo: [video ; conditioning],
    single blocks after the double ones; LTX-Video and LTX-2: block i as layer i, LTX-2's audio left out): the plan has that layout, the diffusers class and its config,
    which the diffusers model with these weights accepts."""
    model, case = models(family), CASES[family]
    ok, message = run_graph(family, calibrate={**CALIBRATE, "filename": f"calibrated-{family}"})
    assert (ok, message) == (True, "")
    plan = paroattn.load_plans(plan_folder() / f"calibrated-{family}.safetensors")[0]
    assert plan.layout == case.layout and (plan.num_layers, plan.num_heads) == (case.layers, case.heads)
    assert plan.model_class == case.model_class
    with paroattn.apply(model, plan, backend="torch", on_mismatch="error"):
        pass


def test_ltx_block_index_patch_names_the_block_and_keeps_a_patch_installed_before_it(comfy):
    """Apply PARO gives LTX's blocks their index through ComfyUI's block-replace patch; a patch another node put
    on the block still runs (with the index in the options it gets)."""
    import comfy_env

    families = comfy_env.pack_module("families")
    seen = []

    def original_block(args):
        seen.append(("block", args["transformer_options"]["block_index"], args["transformer_options"]["other"]))
        return {"img": args["img"]}

    def previous(args, extra):
        seen.append(("previous", args["transformer_options"]["block_index"]))
        return extra["original_block"](args)

    args = {"img": torch.zeros(1), "transformer_options": {"other": 1}}
    families.BlockIndex(3)(args, {"original_block": original_block})
    families.BlockIndex(5, previous)(args, {"original_block": original_block})
    assert seen == [("block", 3, 1), ("previous", 5), ("block", 5, 1)]
    assert args["transformer_options"] == {"other": 1}  # the model's own options are left as they were


def test_ltx2_with_the_audio_attending_to_the_video_runs_the_plan_on_the_video_self_attention_only(models):
    """With the cross-modal attention on (as LTX-2 runs), a block's calls are the video's self- and cross-attention,
    the audio's, and the two cross-modal ones: the plan takes only the first (any other would not fit its layout and
    stop the graph, on_mismatch being 'error') and changes the latent."""
    import comfy_env

    models("ltx2")
    name = save_plan(case_plan("ltx2", 0.5, seed=5), "ltx2-av.safetensors")
    results = {}
    for key, plan in (("dense", None), ("paro", name)):
        prompt, outputs = graph("ltx2", plan=plan, keep=f"ltx2-av-{key}")
        prompt["sample"]["inputs"]["model"] = ["paro", 0] if plan else ["model", 0]  # without IsolateModalities
        del prompt["isolate"]
        if plan:
            prompt["paro"]["inputs"]["model"] = ["model", 0]
        ok, messages = comfy_env.run(prompt, outputs)
        assert (ok, comfy_env.error_message(messages)) == (True, "")
        results[key] = latent_of(f"ltx2-av-{key}")
    difference = float((results["dense"] - results["paro"]).abs().max())
    print(f"ltx2 with audio-video attention, d=0.5 plan vs dense: max |difference| {difference:.2e}")
    assert difference > 1e-3 * float(results["dense"].abs().max())


def test_ltx2_blocks_running_the_audio_alone_have_no_paro_call(comfy):
    import comfy_env

    families = comfy_env.pack_module("families")
    geometry = families.CallGeometry(500.0, (3, 5, 6))
    q = torch.zeros(1, 90, 256)
    options = {"block_index": 0, "run_vx": False}
    assert families.LTX2Family(None).self_attention(geometry, q, q, q, 2, None, options, {}) == (None, None, None)


def test_ltx_guide_frames_are_not_a_paro_layout(comfy):
    import comfy_env

    families = comfy_env.pack_module("families")
    geometry = families.LTXVideoFamily(None).geometry(torch.zeros(1, 128, 4, 5, 6), 0.5, None,
                                                      {"keyframe_idxs": torch.zeros(1, 3, 30, 2)})
    assert geometry.timestep == 500.0 and geometry.grid == (4, 5, 6)
    assert "guide frames" in geometry.problem


@pytest.mark.parametrize("base, reason", [
    ("CogVideoX", "passes no block index to its attention calls and its blocks take no block-replace patch"),
])
def test_models_the_nodes_do_not_match_to_diffusers_are_refused_with_the_reason(comfy, base, reason):
    import comfy_env

    families = comfy_env.pack_module("families")
    patcher = type("Patcher", (), {"model": type(base, (), {"diffusion_model": object()})()})()
    with pytest.raises(families.UnsupportedModel, match=re.escape(reason)):
        families.family_of(patcher)


def test_ltx23_is_refused_with_the_reason(comfy):
    """LTX-2.3's gated attention and modulated cross-attention have not been matched to diffusers' class."""
    import comfy_env
    from comfy.ldm.lightricks.av_model import LTXAVModel

    families = comfy_env.pack_module("families")
    model = LTXAVModel.__new__(LTXAVModel)  # the flags family_of reads, without building the model
    model.__dict__.update(cross_attention_adaln=True, caption_proj_before_connector=True, apply_gated_attention=True)
    patcher = type("Patcher", (), {"model": type("LTXAV", (), {"diffusion_model": model})()})()
    with pytest.raises(families.UnsupportedModel, match="LTX-2.3"):
        families.family_of(patcher)
