"""Nodes for paroattn's demo model, so that a whole PARO workflow (load, calibrate, apply, generate) runs in ComfyUI
on a CPU in minutes, without downloading weights.

The demo model ships inside paroattn (`paroattn/demo_model/assets/`): a small diffusers `WanTransformer3DModel`
(8 layers, 4 heads of 64) trained on procedural 8-frame 32 x 32 videos, with a word-embedding text encoder. It has
no VAE: it denoises RGB pixels in [-1, 1] directly (3 channels, patch 1 x 2 x 2: 2048 tokens a video). ComfyUI
runs it as its own Wan 2.1 model (`comfy.ldm.wan.model.WanModel`), so the PARO nodes treat it exactly as they treat
Wan 2.1; what ComfyUI cannot infer from the weights (4 heads of 64, 64 time frequencies, 64-wide text states) is
given to its loader, and the latent is the pixels themselves.
"""

from __future__ import annotations

import json
import re

import torch

CATEGORY = "paroattn/demo"
DEFAULT_PROMPT = "red circle moving left quickly, cloudy background"

# diffusers name -> ComfyUI (original Wan release) name of the demo transformer's weights; \1 is a block index
_COMFY_NAMES = [
    (r"condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"condition_embedder\.time_proj\.", "time_projection.1."),
    (r"blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.o."),
    (r"blocks\.(\d+)\.attn1\.(to_)?([qkv]|norm_q|norm_k)\.", r"blocks.\1.self_attn.\3."),
    (r"blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.o."),
    (r"blocks\.(\d+)\.attn2\.(to_)?([qkv]|norm_q|norm_k)\.", r"blocks.\1.cross_attn.\3."),
    (r"blocks\.(\d+)\.norm2\.", r"blocks.\1.norm3."),  # the affine norm before cross-attention
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.0."),
    (r"blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.2."),
    (r"blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"proj_out\.", "head.head."),
    (r"scale_shift_table$", "head.modulation"),
    (r"patch_embedding\.", "patch_embedding."),
]


def comfy_state_dict(diffusers_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The demo transformer's weights under ComfyUI's Wan key names."""
    out = {}
    for name, tensor in diffusers_state.items():
        for pattern, replacement in _COMFY_NAMES:
            if re.match(pattern, name):
                out[re.sub(pattern, replacement, name, count=1)] = tensor
                break
        else:
            raise KeyError(f"the demo transformer has a weight {name!r} with no ComfyUI Wan name: it is not the "
                           "text-to-video Wan 2.1 architecture this loader converts")
    return out


def pixel_latent_format():
    """The latent format of a model that denoises pixels: 3 channels in [-1, 1], no scaling, previews that show
    the pixels themselves."""
    import comfy.latent_formats

    class DemoPixels(comfy.latent_formats.LatentFormat):
        latent_channels = 3
        latent_dimensions = 3
        spacial_downscale_ratio = 1
        temporal_downscale_ratio = 1
        latent_rgb_factors = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
        latent_rgb_factors_bias = [0.0, 0.0, 0.0]

        def __init__(self):
            self.scale_factor = 1.0

    return DemoPixels()


def load_demo_model():
    """(ComfyUI MODEL, text encoder) of the demo model shipped with paroattn."""
    import comfy.sd
    from safetensors.torch import load_file

    from paroattn.demo_model.model import ASSETS, SCHEDULER_SHIFT, WordTextEncoder

    folder = ASSETS / "transformer"
    config = json.loads((folder / "config.json").read_text())
    state = comfy_state_dict(load_file(str(folder / "diffusion_pytorch_model.safetensors")))
    # what ComfyUI's Wan detection cannot read from the weights (it assumes heads of 128, 256 time frequencies
    # and 4096-wide text states); the rest (width, depth, channels, patch) it reads from them
    given = {"num_heads": config["num_attention_heads"], "freq_dim": config["freq_dim"], "text_dim": config["text_dim"]}
    model = comfy.sd.load_diffusion_model_state_dict(state, metadata={"config": json.dumps({"transformer": given})})
    if model is None:
        raise RuntimeError(f"ComfyUI did not recognize the demo transformer in {folder} as a Wan 2.1 model")
    model.model.latent_format = pixel_latent_format()
    # the demo's flow-matching schedule (diffusers' FlowMatchEulerDiscreteScheduler, shift 2) instead of Wan's 8
    model.model.model_sampling.set_parameters(shift=SCHEDULER_SHIFT, multiplier=1000)
    encoder = WordTextEncoder.from_pretrained(ASSETS / "text_encoder", torch_dtype=torch.float32).eval()
    return model, encoder


class LoadPARODemoModel:
    DESCRIPTION = ("paroattn's demo model: a small Wan 2.1-architecture text-to-video model trained on procedural "
                   "8-frame 32 x 32 videos (shapes moving over backgrounds), shipped with paroattn. It runs on a CPU; "
                   "its latent is the video's pixels (decode with PARO demo frames).")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("MODEL", "PARO_DEMO_TEXT_ENCODER")
    RETURN_NAMES = ("model", "text_encoder")
    FUNCTION = "load"
    CATEGORY = CATEGORY

    def load(self):
        return load_demo_model()


class PARODemoTextEncode:
    DESCRIPTION = ("A prompt for the demo model, in its vocabulary: colours, shapes (circle, square, triangle, ring), "
                   "'moving left/right/up/down' or 'rotating', 'slowly'/'quickly', 'pan'/'zoom' camera moves and a "
                   "plain, cloudy or dotted background. An empty prompt is the null prompt (the negative).")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "text_encoder": ("PARO_DEMO_TEXT_ENCODER",),
            "text": ("STRING", {"multiline": True, "default": DEFAULT_PROMPT}),
        }}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY

    def encode(self, text_encoder, text):
        ids = text_encoder.tokenize([text])  # a prompt outside the vocabulary: ValueError naming the words
        with torch.no_grad():
            states = text_encoder(ids)
        return ([[states, {}]],)


class EmptyPARODemoVideo:
    DESCRIPTION = "The demo model's empty latent: 8 frames of 32 x 32 pixels (the size it was trained at)."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"batch_size": ("INT", {"default": 1, "min": 1, "max": 64})}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "make"
    CATEGORY = CATEGORY

    def make(self, batch_size):
        from paroattn.demo_model.model import VIDEO_SHAPE

        shape = (batch_size, 3, VIDEO_SHAPE["num_frames"], VIDEO_SHAPE["height"], VIDEO_SHAPE["width"])
        return ({"samples": torch.zeros(shape)},)


class PARODemoFrames:
    DESCRIPTION = ("The demo model's video as images: its latent is the pixels, in [-1, 1]; each frame is enlarged "
                   "`scale` times (nearest neighbour) so that 32 x 32 frames can be seen.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "scale": ("INT", {"default": 8, "min": 1, "max": 32})}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "frames"
    CATEGORY = CATEGORY

    def frames(self, samples, scale):
        video = samples["samples"]
        if video.dim() != 5 or video.shape[1] != 3:
            raise ValueError(f"expected the demo model's latent [batch, 3, frames, height, width], got "
                             f"{list(video.shape)}: decode other models' latents with their VAE")
        pixels = ((video.float().clamp(-1, 1) + 1) / 2).permute(0, 2, 1, 3, 4).flatten(0, 1)  # [B*F, 3, H, W]
        if scale > 1:
            pixels = torch.nn.functional.interpolate(pixels, scale_factor=scale, mode="nearest")
        return (pixels.permute(0, 2, 3, 1).contiguous(),)


NODE_CLASS_MAPPINGS = {
    "LoadPARODemoModel": LoadPARODemoModel,
    "PARODemoTextEncode": PARODemoTextEncode,
    "EmptyPARODemoVideo": EmptyPARODemoVideo,
    "PARODemoFrames": PARODemoFrames,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "LoadPARODemoModel": "Load PARO demo model",
    "PARODemoTextEncode": "PARO demo text encode",
    "EmptyPARODemoVideo": "Empty PARO demo video",
    "PARODemoFrames": "PARO demo frames",
}
