"""Tiny random diffusers models whose weights ComfyUI loads as its own Wan 2.1 (and SkyReels-V2, Wan VACE),
FLUX.1, FLUX.2, Qwen-Image, HunyuanVideo 1.0 and 1.5 and LTX-Video models.

ComfyUI infers a model's shape from its weights with a few fixed settings: Wan's head dim 128 and 256 time
frequencies, FLUX.1's RoPE axes (16, 56, 56) and FLUX.2's (32, 32, 32, 32), so head dim 128, FLUX.2's 128 latent
channels, all of Qwen-Image's widths (24 heads of 128, text width 3584), HunyuanVideo's head dim 128 (and 1.0's
CLIP vector width, 1.5's ByT5 and SigLIP widths). The models below keep those and are small everywhere else (2
heads, 1 or 2 layers; Qwen-Image one block of its full width). Wan, FLUX.2, HunyuanVideo and LTX-Video are saved
under ComfyUI's (the original releases') key names, which `wan_comfy_state_dict` and `comfy_state_dict` derive from
diffusers'; FLUX.1 and Qwen-Image under diffusers' own, which ComfyUI reads as they are (FLUX.1 converted by
ComfyUI itself).
"""

from __future__ import annotations

import json
import re

import torch

HEAD_DIM = 128
HEADS = 2
WAN_TEXT_DIM = 32
WAN_IMAGE_DIM = 1280  # ComfyUI's Wan I2V takes CLIP vision features of this width
FLUX_TEXT_DIM = 32
FLUX_POOLED_DIM = 16
FLUX2_CHANNELS = 128  # FLUX.2's latent: 32 VAE channels in 2 x 2 patches
QWEN_HEADS = 24
QWEN_TEXT_DIM = 3584
HUNYUAN_CHANNELS = 16  # HunyuanVideo 1.0's latent
HUNYUAN_TEXT_DIM = 32
HUNYUAN_POOLED_DIM = 768  # ComfyUI's HunyuanVideo takes a CLIP vector of this width
HUNYUAN15_CHANNELS = 32  # HunyuanVideo 1.5's latent
HUNYUAN15_TEXT_DIM = 32
HUNYUAN15_BYT5_DIM = 1472  # ComfyUI's ByT5 projection takes this width
HUNYUAN15_IMAGE_DIM = 1152  # and its SigLIP projection this one
LTX_CHANNELS = 128  # LTX-Video's latent
LTX_TEXT_DIM = 32
LTX2_AUDIO_CHANNELS = 128  # LTX-2's audio latent: 8 channels x 16 frequency bins per frame
VACE_IN_CHANNELS = 96  # ComfyUI's VACE input: 16 + 16 latent channels (inactive, reactive) and a 64-channel mask


def tiny_wan(seed: int = 0, i2v: bool = False, variant: str = "wan"):
    """Wan 2.1 T2V, or I2V (36 input channels: the latent, a 4-channel mask and the 16-channel image latent;
    CLIP image features of ComfyUI's fixed width 1280 as extra cross-attention keys). `variant` "skyreels_v2":
    SkyReels-V2's class (Wan's blocks and weight names); "vace": Wan VACE with one VACE block, after block 0."""
    from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel, WanVACETransformer3DModel

    torch.manual_seed(seed)
    kwargs = dict(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=36 if i2v else 16,
        out_channels=16, text_dim=WAN_TEXT_DIM, freq_dim=256, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024, image_dim=WAN_IMAGE_DIM if i2v else None,
        added_kv_proj_dim=HEADS * HEAD_DIM if i2v else None,
    )
    if variant == "vace":
        model = WanVACETransformer3DModel(**kwargs, vace_layers=[0], vace_in_channels=VACE_IN_CHANNELS)
    else:
        model = {"wan": WanTransformer3DModel, "skyreels_v2": SkyReelsV2Transformer3DModel}[variant](**kwargs)
    return randomized(model, seed)


def tiny_flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=FLUX_TEXT_DIM, pooled_projection_dim=FLUX_POOLED_DIM,
        guidance_embeds=True, axes_dims_rope=(16, 56, 56),
    )
    return randomized(model, seed)


def tiny_flux2(seed: int = 0):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=FLUX2_CHANNELS, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=FLUX_TEXT_DIM, guidance_embeds=True,
    )
    return randomized(model, seed)


def tiny_qwen_image(seed: int = 0):
    """One block at Qwen-Image's own widths (ComfyUI reads only the block count and input channels from the
    weights): about 0.4 G parameters."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=HEAD_DIM,
        num_attention_heads=QWEN_HEADS, joint_attention_dim=QWEN_TEXT_DIM,
    )
    return randomized(model, seed)


def tiny_hunyuan_video(seed: int = 0):
    """HunyuanVideo 1.0: one double and one single block, ComfyUI's fixed CLIP vector width."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3DModel(
        in_channels=HUNYUAN_CHANNELS, out_channels=HUNYUAN_CHANNELS, num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM, num_layers=1, num_single_layers=1, text_embed_dim=HUNYUAN_TEXT_DIM,
        pooled_projection_dim=HUNYUAN_POOLED_DIM,
    )
    return randomized(model, seed)


def tiny_hunyuan_video15(seed: int = 0):
    """HunyuanVideo 1.5 (65 input channels: the latent, the image latent and a mask) with its fixed widths: ByT5
    features of 1472 channels through a 2048-wide projection, SigLIP features of 1152 (which ComfyUI needs to tell
    the model from HunyuanVideo 1.0)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=2 * HUNYUAN15_CHANNELS + 1, out_channels=HUNYUAN15_CHANNELS, num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM, num_layers=2, text_embed_dim=HUNYUAN15_TEXT_DIM,
        text_embed_2_dim=HUNYUAN15_BYT5_DIM, image_embed_dim=HUNYUAN15_IMAGE_DIM,
    )
    return randomized(model, seed)


def tiny_ltx_video(seed: int = 0):
    """LTX-Video with 128 latent channels (ComfyUI's LTX-Video latent); ComfyUI reads its heads and text width
    from the file's metadata (`save_ltx_video`)."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    model = LTXVideoTransformer3DModel(
        in_channels=LTX_CHANNELS, out_channels=LTX_CHANNELS, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
        cross_attention_dim=HEADS * HEAD_DIM, num_layers=2, caption_channels=LTX_TEXT_DIM,
    )
    return randomized(model, seed)


def tiny_ltx2(seed: int = 0):
    """LTX-2 with ComfyUI's latent widths (128 video channels, 8 x 16 audio), 2 video heads of 128 and 2 audio heads
    of 64, two blocks; ComfyUI reads its widths from the file's metadata (`save_ltx2`). Its attention layers
    normalize q and k with ComfyUI's eps, 1e-5 (diffusers' LTX-2 takes 1e-6, a difference of 2e-5 of the output
    here that is not PARO's)."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.models.transformers.transformer_ltx2 import LTX2Attention

    torch.manual_seed(seed)
    model = LTX2VideoTransformer3DModel(
        in_channels=LTX_CHANNELS, out_channels=LTX_CHANNELS, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
        cross_attention_dim=HEADS * HEAD_DIM, audio_in_channels=LTX2_AUDIO_CHANNELS,
        audio_out_channels=LTX2_AUDIO_CHANNELS, audio_num_attention_heads=HEADS, audio_attention_head_dim=64,
        audio_cross_attention_dim=HEADS * 64, num_layers=2, caption_channels=LTX_TEXT_DIM,
    )
    for module in model.modules():
        if isinstance(module, LTX2Attention):
            module.norm_q.eps = module.norm_k.eps = 1e-5
    return randomized(model, seed)


def randomized(model, seed: int):
    """Every weight random (diffusers zero-initializes some output layers, which would hide attention)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / max(1, p.shape[-1]) ** 0.5 if p.dim() > 1 else 0.05))
    return model.eval()


# diffusers name -> ComfyUI (original Wan release) name; a block is one of `blocks` or (VACE) `vace_blocks`
_WAN_KEYS = [
    (r"vace_blocks\.(\d+)\.proj_in\.", r"vace_blocks.\1.before_proj."),
    (r"vace_blocks\.(\d+)\.proj_out\.", r"vace_blocks.\1.after_proj."),
    (r"vace_patch_embedding\.", "vace_patch_embedding."),
    (r"condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"condition_embedder\.time_proj\.", "time_projection.1."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn1\.to_q\.", r"\1.\2.self_attn.q."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn1\.to_k\.", r"\1.\2.self_attn.k."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn1\.to_v\.", r"\1.\2.self_attn.v."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn1\.to_out\.0\.", r"\1.\2.self_attn.o."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn1\.norm_q\.", r"\1.\2.self_attn.norm_q."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn1\.norm_k\.", r"\1.\2.self_attn.norm_k."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn2\.to_q\.", r"\1.\2.cross_attn.q."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn2\.to_k\.", r"\1.\2.cross_attn.k."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn2\.to_v\.", r"\1.\2.cross_attn.v."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn2\.to_out\.0\.", r"\1.\2.cross_attn.o."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn2\.norm_q\.", r"\1.\2.cross_attn.norm_q."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn2\.norm_k\.", r"\1.\2.cross_attn.norm_k."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn2\.add_k_proj\.", r"\1.\2.cross_attn.k_img."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn2\.add_v_proj\.", r"\1.\2.cross_attn.v_img."),
    (r"((?:vace_)?blocks)\.(\d+)\.attn2\.norm_added_k\.", r"\1.\2.cross_attn.norm_k_img."),
    (r"condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"((?:vace_)?blocks)\.(\d+)\.norm2\.", r"\1.\2.norm3."),  # the affine norm before cross-attention
    (r"((?:vace_)?blocks)\.(\d+)\.ffn\.net\.0\.proj\.", r"\1.\2.ffn.0."),
    (r"((?:vace_)?blocks)\.(\d+)\.ffn\.net\.2\.", r"\1.\2.ffn.2."),
    (r"((?:vace_)?blocks)\.(\d+)\.scale_shift_table$", r"\1.\2.modulation"),
    (r"proj_out\.", "head.head."),
    (r"scale_shift_table$", "head.modulation"),
    (r"patch_embedding\.", "patch_embedding."),
]


def wan_comfy_state_dict(model) -> dict[str, torch.Tensor]:
    """The diffusers Wan model's weights (T2V or I2V) under ComfyUI's key names."""
    out = {}
    for name, tensor in model.state_dict().items():
        for pattern, replacement in _WAN_KEYS:
            if re.match(pattern, name):
                out[re.sub(pattern, replacement, name, count=1)] = tensor.contiguous()
                break
        else:
            raise KeyError(f"no ComfyUI name for the diffusers Wan weight {name}")
    return out


# diffusers name -> ComfyUI (original FLUX.2 release) name, for weights that keep their shape
_FLUX2_KEYS = [
    (r"x_embedder\.", "img_in."),
    (r"context_embedder\.", "txt_in."),
    (r"time_guidance_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"time_guidance_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"time_guidance_embed\.guidance_embedder\.linear_1\.", "guidance_in.in_layer."),
    (r"time_guidance_embed\.guidance_embedder\.linear_2\.", "guidance_in.out_layer."),
    (r"(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.linear\.", r"\1.lin."),
    (r"transformer_blocks\.(\d+)\.attn\.norm_q\.", r"double_blocks.\1.img_attn.norm.query_norm."),
    (r"transformer_blocks\.(\d+)\.attn\.norm_k\.", r"double_blocks.\1.img_attn.norm.key_norm."),
    (r"transformer_blocks\.(\d+)\.attn\.norm_added_q\.", r"double_blocks.\1.txt_attn.norm.query_norm."),
    (r"transformer_blocks\.(\d+)\.attn\.norm_added_k\.", r"double_blocks.\1.txt_attn.norm.key_norm."),
    (r"transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
    (r"transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
    (r"transformer_blocks\.(\d+)\.ff\.linear_in\.", r"double_blocks.\1.img_mlp.0."),
    (r"transformer_blocks\.(\d+)\.ff\.linear_out\.", r"double_blocks.\1.img_mlp.2."),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_in\.", r"double_blocks.\1.txt_mlp.0."),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_out\.", r"double_blocks.\1.txt_mlp.2."),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj\.", r"single_blocks.\1.linear1."),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_out\.", r"single_blocks.\1.linear2."),
    (r"single_transformer_blocks\.(\d+)\.attn\.norm_q\.", r"single_blocks.\1.norm.query_norm."),
    (r"single_transformer_blocks\.(\d+)\.attn\.norm_k\.", r"single_blocks.\1.norm.key_norm."),
    (r"proj_out\.", "final_layer.linear."),
]
# q, k, v projections that ComfyUI fuses into one
_FLUX2_FUSED = [
    (r"transformer_blocks\.(\d+)\.attn\.to_([qkv])\.", r"double_blocks.\1.img_attn.qkv."),
    (r"transformer_blocks\.(\d+)\.attn\.add_([qkv])_proj\.", r"double_blocks.\1.txt_attn.qkv."),
]


def flux2_comfy_state_dict(model) -> dict[str, torch.Tensor]:
    """The diffusers FLUX.2 model's weights under ComfyUI's key names: q, k, v fused, the final norm's
    (scale, shift) as ComfyUI's (shift, scale)."""
    return comfy_state_dict(model, "FLUX.2", _FLUX2_KEYS, _FLUX2_FUSED, "norm_out.linear.",
                            "final_layer.adaLN_modulation.1.")


# diffusers name -> ComfyUI (original HunyuanVideo 1.0 and 1.5 releases) name, for weights that keep their shape;
# the token refiner and the double blocks are alike in both
_REFINER = r"context_embedder\.token_refiner\.refiner_blocks\.(\d+)\."
_REFINED = r"txt_in.individual_token_refiner.blocks.\1."
_HUNYUAN_COMMON_KEYS = [
    (r"x_embedder\.proj\.", "img_in.proj."),
    (r"context_embedder\.time_text_embed\.timestep_embedder\.linear_1\.", "txt_in.t_embedder.in_layer."),
    (r"context_embedder\.time_text_embed\.timestep_embedder\.linear_2\.", "txt_in.t_embedder.out_layer."),
    (r"context_embedder\.time_text_embed\.text_embedder\.linear_1\.", "txt_in.c_embedder.in_layer."),
    (r"context_embedder\.time_text_embed\.text_embedder\.linear_2\.", "txt_in.c_embedder.out_layer."),
    (r"context_embedder\.proj_in\.", "txt_in.input_embedder."),
    (_REFINER + r"norm([12])\.", _REFINED + r"norm\2."),
    (_REFINER + r"attn\.to_out\.0\.", _REFINED + "self_attn.proj."),
    (_REFINER + r"ff\.net\.0\.proj\.", _REFINED + "mlp.0."),
    (_REFINER + r"ff\.net\.2\.", _REFINED + "mlp.2."),
    (_REFINER + r"norm_out\.linear\.", _REFINED + "adaLN_modulation.1."),
    (r"transformer_blocks\.(\d+)\.norm1\.linear\.", r"double_blocks.\1.img_mod.lin."),
    (r"transformer_blocks\.(\d+)\.norm1_context\.linear\.", r"double_blocks.\1.txt_mod.lin."),
    (r"transformer_blocks\.(\d+)\.attn\.norm_q\.", r"double_blocks.\1.img_attn.norm.query_norm."),
    (r"transformer_blocks\.(\d+)\.attn\.norm_k\.", r"double_blocks.\1.img_attn.norm.key_norm."),
    (r"transformer_blocks\.(\d+)\.attn\.norm_added_q\.", r"double_blocks.\1.txt_attn.norm.query_norm."),
    (r"transformer_blocks\.(\d+)\.attn\.norm_added_k\.", r"double_blocks.\1.txt_attn.norm.key_norm."),
    (r"transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
    (r"transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
    (r"transformer_blocks\.(\d+)\.ff\.net\.0\.proj\.", r"double_blocks.\1.img_mlp.0."),
    (r"transformer_blocks\.(\d+)\.ff\.net\.2\.", r"double_blocks.\1.img_mlp.2."),
    (r"transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj\.", r"double_blocks.\1.txt_mlp.0."),
    (r"transformer_blocks\.(\d+)\.ff_context\.net\.2\.", r"double_blocks.\1.txt_mlp.2."),
    (r"proj_out\.", "final_layer.linear."),
]
_HUNYUAN_FUSED = [
    (_REFINER + r"attn\.to_([qkv])\.", _REFINED + "self_attn.qkv."),
    (r"transformer_blocks\.(\d+)\.attn\.to_([qkv])\.", r"double_blocks.\1.img_attn.qkv."),
    (r"transformer_blocks\.(\d+)\.attn\.add_([qkv])_proj\.", r"double_blocks.\1.txt_attn.qkv."),
]
# HunyuanVideo 1.0's own: the CLIP vector and guidance embedders, the single blocks (q, k, v and the MLP's input
# projection fused into one `linear1`)
_HUNYUAN_KEYS = [
    (r"time_text_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"time_text_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"time_text_embed\.text_embedder\.linear_1\.", "vector_in.in_layer."),
    (r"time_text_embed\.text_embedder\.linear_2\.", "vector_in.out_layer."),
    (r"time_text_embed\.guidance_embedder\.linear_1\.", "guidance_in.in_layer."),
    (r"time_text_embed\.guidance_embedder\.linear_2\.", "guidance_in.out_layer."),
    (r"single_transformer_blocks\.(\d+)\.attn\.norm_q\.", r"single_blocks.\1.norm.query_norm."),
    (r"single_transformer_blocks\.(\d+)\.attn\.norm_k\.", r"single_blocks.\1.norm.key_norm."),
    (r"single_transformer_blocks\.(\d+)\.norm\.linear\.", r"single_blocks.\1.modulation.lin."),
    (r"single_transformer_blocks\.(\d+)\.proj_out\.", r"single_blocks.\1.linear2."),
    *_HUNYUAN_COMMON_KEYS,
]
_HUNYUAN_SINGLE_FUSED = [
    (r"single_transformer_blocks\.(\d+)\.attn\.to_([qkv])\.", r"single_blocks.\1.linear1."),
    (r"single_transformer_blocks\.(\d+)\.proj_(mlp)\.", r"single_blocks.\1.linear1."),
]


def hunyuan_video_comfy_state_dict(model) -> dict[str, torch.Tensor]:
    """The diffusers HunyuanVideo (1.0) model's weights under ComfyUI's key names: q, k, v fused (with the MLP's
    input in single blocks), the final norm's (scale, shift) as ComfyUI's (shift, scale)."""
    return comfy_state_dict(model, "HunyuanVideo", _HUNYUAN_KEYS, _HUNYUAN_SINGLE_FUSED + _HUNYUAN_FUSED,
                            "norm_out.linear.", "final_layer.adaLN_modulation.1.")


# HunyuanVideo 1.5's own: the SigLIP image and ByT5 projections, the timestep and condition-type embeddings
_HUNYUAN15_KEYS = [
    (r"image_embedder\.norm_in\.", "vision_in.proj.0."),
    (r"image_embedder\.linear_1\.", "vision_in.proj.1."),
    (r"image_embedder\.linear_2\.", "vision_in.proj.3."),
    (r"image_embedder\.norm_out\.", "vision_in.proj.4."),
    (r"context_embedder_2\.norm\.", "byt5_in.layernorm."),
    (r"context_embedder_2\.linear_([123])\.", r"byt5_in.fc\1."),
    (r"time_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"time_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"cond_type_embed\.", "cond_type_embedding."),
    *_HUNYUAN_COMMON_KEYS,
]


def hunyuan_video15_comfy_state_dict(model) -> dict[str, torch.Tensor]:
    """The diffusers HunyuanVideo 1.5 model's weights under ComfyUI's key names: q, k, v fused, the final norm's
    (scale, shift) as ComfyUI's (shift, scale)."""
    return comfy_state_dict(model, "HunyuanVideo 1.5", _HUNYUAN15_KEYS, _HUNYUAN_FUSED, "norm_out.linear.",
                            "final_layer.adaLN_modulation.1.")


def comfy_state_dict(model, name: str, keys, fused_keys=(), swapped: str | None = None, swapped_to: str = ""
                     ) -> dict[str, torch.Tensor]:
    """`model`'s weights renamed by `keys`; the q, k, v projections that `fused_keys` name (the letter in their
    last group) concatenated into one; `swapped` (a (scale, shift) projection) as (shift, scale) under
    `swapped_to`; a part named "mlp" (HunyuanVideo's single blocks) joins after q, k, v."""
    out, fused = {}, {}
    for key, tensor in model.state_dict().items():
        if swapped is not None and key.startswith(swapped):
            scale, shift = tensor.chunk(2, dim=0)
            out[key.replace(swapped, swapped_to)] = torch.cat([shift, scale])
            continue
        for pattern, replacement in fused_keys:
            match = re.match(pattern, key)
            if match:
                target = re.sub(pattern, replacement, key, count=1)
                fused.setdefault(target, {})[match.group(match.re.groups)] = tensor
                break
        else:
            for pattern, replacement in keys:
                if re.match(pattern, key):
                    out[re.sub(pattern, replacement, key, count=1)] = tensor.contiguous()
                    break
            else:
                raise KeyError(f"no ComfyUI name for the diffusers {name} weight {key}")
    for target, parts in fused.items():
        out[target] = torch.cat([parts[name] for name in ("q", "k", "v", "mlp") if name in parts])
    return out


# diffusers name -> ComfyUI (original LTX-Video release) name; every other weight keeps its name
_LTX_KEYS = [
    (r"proj_in\.", "patchify_proj."),
    (r"time_embed\.", "adaln_single."),
    (r"(transformer_blocks\.\d+\.attn[12])\.norm_q\.", r"\1.q_norm."),
    (r"(transformer_blocks\.\d+\.attn[12])\.norm_k\.", r"\1.k_norm."),
    (r"(caption_projection|transformer_blocks|scale_shift_table|proj_out)", r"\1"),
]


def save_ltx_video(model, path) -> None:
    """Under ComfyUI's key names; ComfyUI's LTX-Video takes 32 heads and a text width of 4096 unless the file's
    metadata says otherwise."""
    from safetensors.torch import save_file

    config = model.config
    transformer = {"num_attention_heads": config.num_attention_heads, "attention_head_dim": config.attention_head_dim,
                   "caption_channels": config.caption_channels, "in_channels": config.in_channels}
    save_file(comfy_state_dict(model, "LTX-Video", _LTX_KEYS), str(path),
              metadata={"config": json.dumps({"transformer": transformer})})


# diffusers name -> ComfyUI (original LTX-2 release) name; every other weight keeps its name
_LTX2_KEYS = [
    (r"proj_in\.", "patchify_proj."),
    (r"audio_proj_in\.", "audio_patchify_proj."),
    (r"time_embed\.", "adaln_single."),
    (r"audio_time_embed\.", "audio_adaln_single."),
    (r"av_cross_attn_video_scale_shift\.", "av_ca_video_scale_shift_adaln_single."),
    (r"av_cross_attn_audio_scale_shift\.", "av_ca_audio_scale_shift_adaln_single."),
    (r"av_cross_attn_video_a2v_gate\.", "av_ca_a2v_gate_adaln_single."),
    (r"av_cross_attn_audio_v2a_gate\.", "av_ca_v2a_gate_adaln_single."),
    (r"(transformer_blocks\.\d+)\.video_a2v_cross_attn_scale_shift_table", r"\1.scale_shift_table_a2v_ca_video"),
    (r"(transformer_blocks\.\d+)\.audio_a2v_cross_attn_scale_shift_table", r"\1.scale_shift_table_a2v_ca_audio"),
    (r"(transformer_blocks\.\d+\.\w+)\.norm_q\.", r"\1.q_norm."),
    (r"(transformer_blocks\.\d+\.\w+)\.norm_k\.", r"\1.k_norm."),
    (r"(caption_projection|audio_caption_projection|transformer_blocks|scale_shift_table|audio_scale_shift_table|"
     r"proj_out|audio_proj_out)", r"\1"),
]


def save_ltx2(model, path) -> None:
    """Under ComfyUI's key names, with the widths ComfyUI does not infer in the file's metadata. The text
    connectors, which ComfyUI keeps in the model and diffusers in its pipeline, are left out: the tests pass text
    already through them. RoPE as diffusers' (double precision, at the middle of each patch)."""
    from safetensors.torch import save_file

    c = model.config
    transformer = {
        "num_attention_heads": c.num_attention_heads, "attention_head_dim": c.attention_head_dim,
        "audio_num_attention_heads": c.audio_num_attention_heads, "audio_attention_head_dim": c.audio_attention_head_dim,
        "audio_cross_attention_dim": c.audio_cross_attention_dim, "caption_channels": c.caption_channels,
        "in_channels": c.in_channels, "audio_in_channels": c.audio_in_channels, "rope_type": c.rope_type,
        "frequencies_precision": "float64", "use_middle_indices_grid": True, "causal_temporal_positioning": True,
        "connector_num_attention_heads": 2, "connector_attention_head_dim": c.caption_channels // 2,
    }
    save_file(comfy_state_dict(model, "LTX-2", _LTX2_KEYS), str(path),
              metadata={"config": json.dumps({"transformer": transformer})})


def save_wan(model, path) -> None:
    """ComfyUI reads the text width from the file's metadata where it is not the released 4096."""
    from safetensors.torch import save_file

    config = {"transformer": {"text_dim": int(model.config.text_dim)}}
    save_file(wan_comfy_state_dict(model), str(path), metadata={"config": json.dumps(config)})


def save_flux(model, path) -> None:
    """FLUX.1 and Qwen-Image under diffusers' names."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def save_flux2(model, path) -> None:
    from safetensors.torch import save_file

    save_file(flux2_comfy_state_dict(model), str(path))


def save_hunyuan_video(model, path) -> None:
    from safetensors.torch import save_file

    save_file(hunyuan_video_comfy_state_dict(model), str(path))


def save_hunyuan_video15(model, path) -> None:
    from safetensors.torch import save_file

    save_file(hunyuan_video15_comfy_state_dict(model), str(path))


def save_diffusion_model(model, save, name: str) -> None:
    """`save(model, path)` into ComfyUI's first diffusion_models folder as `name` (a file name), where its UNETLoader
    and the graphs' loaders find it."""
    from pathlib import Path

    import folder_paths

    folder = Path(folder_paths.get_folder_paths("diffusion_models")[0])
    folder.mkdir(parents=True, exist_ok=True)
    save(model, folder / name)
