"""Tiny random diffusers models whose weights ComfyUI loads as its own Wan 2.1 and FLUX.1 models.

ComfyUI infers a model's shape from its weights with a few fixed settings: Wan's head dim 128 and 256 time
frequencies, FLUX.1's RoPE axes (16, 56, 56) and so head dim 128. The models below keep those and are small
everywhere else (2 heads, 2 layers). Wan is saved under ComfyUI's (the original release's) key names, which
`wan_comfy_state_dict` derives from diffusers'; FLUX.1 under diffusers' own, which ComfyUI converts itself.
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


def tiny_wan(seed: int = 0, i2v: bool = False):
    """Wan 2.1 T2V, or I2V (36 input channels: the latent, a 4-channel mask and the 16-channel image latent;
    CLIP image features of ComfyUI's fixed width 1280 as extra cross-attention keys)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=36 if i2v else 16,
        out_channels=16, text_dim=WAN_TEXT_DIM, freq_dim=256, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024, image_dim=WAN_IMAGE_DIM if i2v else None,
        added_kv_proj_dim=HEADS * HEAD_DIM if i2v else None,
    )
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


# diffusers name -> ComfyUI (original Wan release) name; {i} is a block index
_WAN_KEYS = [
    (r"condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"condition_embedder\.time_proj\.", "time_projection.1."),
    (r"blocks\.(\d+)\.attn1\.to_q\.", r"blocks.\1.self_attn.q."),
    (r"blocks\.(\d+)\.attn1\.to_k\.", r"blocks.\1.self_attn.k."),
    (r"blocks\.(\d+)\.attn1\.to_v\.", r"blocks.\1.self_attn.v."),
    (r"blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.o."),
    (r"blocks\.(\d+)\.attn1\.norm_q\.", r"blocks.\1.self_attn.norm_q."),
    (r"blocks\.(\d+)\.attn1\.norm_k\.", r"blocks.\1.self_attn.norm_k."),
    (r"blocks\.(\d+)\.attn2\.to_q\.", r"blocks.\1.cross_attn.q."),
    (r"blocks\.(\d+)\.attn2\.to_k\.", r"blocks.\1.cross_attn.k."),
    (r"blocks\.(\d+)\.attn2\.to_v\.", r"blocks.\1.cross_attn.v."),
    (r"blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.o."),
    (r"blocks\.(\d+)\.attn2\.norm_q\.", r"blocks.\1.cross_attn.norm_q."),
    (r"blocks\.(\d+)\.attn2\.norm_k\.", r"blocks.\1.cross_attn.norm_k."),
    (r"blocks\.(\d+)\.attn2\.add_k_proj\.", r"blocks.\1.cross_attn.k_img."),
    (r"blocks\.(\d+)\.attn2\.add_v_proj\.", r"blocks.\1.cross_attn.v_img."),
    (r"blocks\.(\d+)\.attn2\.norm_added_k\.", r"blocks.\1.cross_attn.norm_k_img."),
    (r"condition_embedder\.image_embedder\.norm1\.", "img_emb.proj.0."),
    (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "img_emb.proj.1."),
    (r"condition_embedder\.image_embedder\.ff\.net\.2\.", "img_emb.proj.3."),
    (r"condition_embedder\.image_embedder\.norm2\.", "img_emb.proj.4."),
    (r"blocks\.(\d+)\.norm2\.", r"blocks.\1.norm3."),  # the affine norm before cross-attention
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.0."),
    (r"blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.2."),
    (r"blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
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


def save_wan(model, path) -> None:
    """ComfyUI reads the text width from the file's metadata where it is not the released 4096."""
    from safetensors.torch import save_file

    config = {"transformer": {"text_dim": int(model.config.text_dim)}}
    save_file(wan_comfy_state_dict(model), str(path), metadata={"config": json.dumps(config)})


def save_flux(model, path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
