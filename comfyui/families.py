"""The ComfyUI models the PARO nodes know: how each one's self-attention calls reach ComfyUI's attention hook,
and what its diffusers counterpart is (plans are calibrated for, and named after, diffusers models).

ComfyUI calls `transformer_options["optimized_attention_override"](func, q, k, v, heads, ...)` for every attention
of a model; the family says which of those calls are self-attention, which plan layer each one is and what its
token layout is:

- Wan 2.1 / 2.2 (`comfy.ldm.wan.model.WanModel`: T2V, I2V, the A14B experts, TI2V-5B): q, k, v `[B, N, H*D]`
  with RoPE applied, the block in `transformer_options["block_index"]`, the patch grid in `["grid_sizes"]`. Each
  block's first call is its self-attention (video tokens only); the cross-attention calls that follow go to
  ComfyUI's own function. Blocks and tokens are diffusers' (layer i = block i, row-major F x H x W).
- FLUX.1 (`comfy.ldm.flux.model.Flux`, dev and schnell): q, k, v `[B, H, N, D]` (`skip_reshape`), every call a
  joint self-attention over [text ; image]. Double block i is layer i, single block i layer (double blocks) + i,
  as in diffusers; the timestep arrives in 0..1 (diffusers' t / 1000). ComfyUI's T5 pads to 256 tokens where
  diffusers pads to 512, so a diffusers plan serves it through the plan's derived sizes.

Refused, with the reason: HunyuanVideo (ComfyUI puts the text before the video, diffusers after it, with padded
text keys the hook does not see), CogVideoX (its attention calls carry no block index, so a call cannot be
matched to a plan layer) and every other model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paroattn import TokenLayout

# config entries of the diffusers counterpart that are checked against a plan that records its model's config
_CHECKED = {
    "wan": ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
            "ffn_dim", "image_dim"),
    "flux": ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim", "in_channels",
             "joint_attention_dim", "pooled_projection_dim", "guidance_embeds"),
}

REFUSED = {
    "HunyuanVideo": "ComfyUI's HunyuanVideo puts the text tokens before the video and masks padded text inside its "
                    "own attention, while plans (calibrated on diffusers' HunyuanVideo) have the text after the "
                    "video: the PARO nodes do not run it yet; use paroattn on the diffusers pipeline",
    "CogVideoX": "ComfyUI's CogVideoX passes no block index to its attention calls, so a call cannot be matched to "
                 "a plan layer: the PARO nodes do not run it; use paroattn on the diffusers pipeline",
}


class UnsupportedModel(ValueError):
    """A model the PARO nodes cannot run, with the reason."""


@dataclass
class SelfAttention:
    """One self-attention call as PARO takes it: q, k, v [B, H, N, D] (views of ComfyUI's tensors), its layer, and
    how to give the output back in the shape ComfyUI expects."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: int
    heads_last: bool  # ComfyUI wants [B, N, H*D] (True) or [B, H, N, D] (False)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2).flatten(2) if self.heads_last else out


@dataclass
class CallGeometry:
    """What one model call (one sampler evaluation) means for PARO, from the latent and the sigma: the timestep on
    the 0..1000 scale of plans, the image grid where the attention calls do not carry it (Flux), and the text
    tokens of the call (Flux)."""

    timestep: float
    grid: tuple[int, int, int] | None = None
    text_tokens: int | None = None
    block: tuple[str, int] | None = None  # the last (block type, index) an attention call came from


class Family:
    name = ""
    models = ""
    diffusers_class = ""
    timestep_scale = 1.0  # brings the diffusion model's timestep onto 0..1000

    def __init__(self, diffusion_model):
        self.model = diffusion_model

    # -- structure ---------------------------------------------------------------------------------
    def num_layers(self) -> int:
        raise NotImplementedError

    def num_heads(self) -> int:
        raise NotImplementedError

    def head_dim(self) -> int:
        raise NotImplementedError

    def diffusers_config(self) -> dict:
        """The config of the diffusers model with these weights (what a plan calibrated here records)."""
        raise NotImplementedError

    def checked_config(self) -> dict:
        config = self.diffusers_config()
        return {key: config.get(key) for key in _CHECKED[self.name]}

    # -- per model call ------------------------------------------------------------------------------
    def geometry(self, x: torch.Tensor, timestep: float, c_crossattn) -> CallGeometry:
        return CallGeometry(timestep * self.timestep_scale)

    # -- per attention call --------------------------------------------------------------------------
    def self_attention(self, geometry: CallGeometry, q, k, v, heads: int, mask, options: dict, kwargs: dict
                       ) -> tuple[SelfAttention | None, TokenLayout | None, str | None]:
        """(the call as PARO takes it, its layout, why it cannot run) for a self-attention call; (None, None, None)
        for a call PARO leaves to ComfyUI (cross-attention, calls of other models' parts)."""
        raise NotImplementedError


class WanFamily(Family):
    name = "wan"
    models = "Wan 2.1 / 2.2"
    diffusers_class = "WanTransformer3DModel"

    def num_layers(self) -> int:
        return len(self.model.blocks)

    def num_heads(self) -> int:
        return int(self.model.num_heads)

    def head_dim(self) -> int:
        return int(self.model.dim) // int(self.model.num_heads)

    def diffusers_config(self) -> dict:
        from diffusers import WanTransformer3DModel

        m = self.model
        i2v = getattr(m, "img_emb", None) is not None
        flf = getattr(getattr(m, "img_emb", None), "emb_pos", None)
        kwargs = dict(
            patch_size=tuple(int(p) for p in m.patch_size), num_attention_heads=self.num_heads(),
            attention_head_dim=self.head_dim(), in_channels=int(m.in_dim), out_channels=int(m.out_dim),
            text_dim=int(m.text_dim), freq_dim=int(m.freq_dim), ffn_dim=int(m.ffn_dim), num_layers=self.num_layers(),
            cross_attn_norm=bool(m.cross_attn_norm), qk_norm="rms_norm_across_heads" if m.qk_norm else None,
            eps=float(m.eps), image_dim=int(m.img_emb.proj[0].normalized_shape[0]) if i2v else None,
            added_kv_proj_dim=int(m.dim) if i2v else None,
            pos_embed_seq_len=int(flf.shape[1]) if flf is not None else None,
        )
        with torch.device("meta"):
            return dict(WanTransformer3DModel(**kwargs).config)

    def self_attention(self, geometry, q, k, v, heads, mask, options, kwargs):
        block = options.get("block_index")
        grid = options.get("grid_sizes")
        if block is None or grid is None or q.dim() != 3:
            return None, None, None
        key = (options.get("block_type", ""), int(block))
        if geometry.block == key:  # the block's later calls: its cross-attention
            return None, None, None
        geometry.block = key
        frames, height, width = (int(s) for s in grid)
        layout = TokenLayout(0, frames, height, width)
        B, N, HD = q.shape
        call = SelfAttention(*(t.view(B, t.shape[1], heads, HD // heads).transpose(1, 2) for t in (q, k, v)),
                             layer=int(block), heads_last=True)
        if N != layout.seq_len or k.shape[1] != N or v.shape[1] != N:
            return call, None, (f"block {block}'s self-attention has {N} tokens where the {frames}x{height}x{width} "
                                f"latent grid has {layout.seq_len}: tokens beside the video (reference or context "
                                "latents) are not a PARO token layout")
        if mask is not None:
            return call, None, "the self-attention call carries an attention mask, which a block-sparse plan cannot honour"
        return call, layout, None


class FluxFamily(Family):
    name = "flux"
    models = "FLUX.1"
    diffusers_class = "FluxTransformer2DModel"
    timestep_scale = 1000.0

    def num_layers(self) -> int:
        return len(self.model.double_blocks) + len(self.model.single_blocks)

    def num_heads(self) -> int:
        return int(self.model.num_heads)

    def head_dim(self) -> int:
        return int(self.model.hidden_size) // int(self.model.num_heads)

    def diffusers_config(self) -> dict:
        from diffusers import FluxTransformer2DModel

        m, p = self.model, self.model.params
        patch = int(m.patch_size)
        kwargs = dict(
            patch_size=1, in_channels=int(p.in_channels) * patch * patch, num_layers=len(m.double_blocks),
            num_single_layers=len(m.single_blocks), attention_head_dim=self.head_dim(),
            num_attention_heads=self.num_heads(), joint_attention_dim=int(p.context_in_dim),
            pooled_projection_dim=int(p.vec_in_dim), guidance_embeds=bool(p.guidance_embed),
            axes_dims_rope=tuple(int(a) for a in p.axes_dim),
        )
        with torch.device("meta"):
            return dict(FluxTransformer2DModel(**kwargs).config)

    def geometry(self, x, timestep, c_crossattn):
        patch = int(self.model.patch_size)
        height, width = (int(s) for s in x.shape[-2:])
        grid = (1, (height + patch // 2) // patch, (width + patch // 2) // patch)
        text = int(c_crossattn.shape[1]) if c_crossattn is not None else None
        return CallGeometry(timestep * self.timestep_scale, grid, text)

    def self_attention(self, geometry, q, k, v, heads, mask, options, kwargs):
        block, kind = options.get("block_index"), options.get("block_type")
        if block is None or kind not in ("double", "single") or q.dim() != 4 or not kwargs.get("skip_reshape"):
            return None, None, None
        layer = int(block) + (len(self.model.double_blocks) if kind == "single" else 0)
        call = SelfAttention(q, k, v, layer=layer, heads_last=not kwargs.get("skip_output_reshape", False))
        N = q.shape[2]
        _, height, width = geometry.grid
        text = geometry.text_tokens
        if text is None or N != text + height * width:
            return call, None, (f"the joint attention has {N} tokens where {text} text tokens and the {height}x{width} "
                                "image grid make " + (f"{text + height * width}" if text is not None else "another count")
                                + ": conditioning images (Kontext, Fill) add tokens after the image, which is not a "
                                "PARO token layout")
        if mask is not None:
            return call, None, "the attention call carries an attention mask, which a block-sparse plan cannot honour"
        return call, TokenLayout(text, 1, height, width), None


def family_of(model_patcher) -> Family:
    """The family of a ComfyUI MODEL, or UnsupportedModel saying why there is none."""
    base = model_patcher.model
    diffusion_model = base.diffusion_model
    base_name, module_name = type(base).__name__, type(diffusion_model).__name__
    for name, reason in REFUSED.items():
        if base_name.startswith(name) or module_name.startswith(name):
            raise UnsupportedModel(f"{base_name}: {reason}")
    from comfy.ldm.flux.model import Flux
    from comfy.ldm.wan.model import WanModel

    if type(diffusion_model) is WanModel and base_name in ("WAN21", "WAN22"):
        return WanFamily(diffusion_model)
    if type(diffusion_model) is Flux and base_name == "Flux" and diffusion_model.params.vec_in_dim:
        return FluxFamily(diffusion_model)
    raise UnsupportedModel(
        f"the PARO nodes run Wan 2.1 / 2.2 (T2V, I2V, A14B experts, TI2V-5B) and FLUX.1 models; this MODEL is "
        f"{base_name} ({module_name}), which they do not support"
    )
