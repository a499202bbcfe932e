"""The ComfyUI models the PARO nodes know: how each one's self-attention calls reach ComfyUI's attention hook,
and what its diffusers counterpart is (plans are calibrated for, and named after, diffusers models).

ComfyUI calls `transformer_options["optimized_attention_override"](func, q, k, v, heads, ...)` for every attention
of a model; the family says which of those calls are self-attention, which plan layer each one is and what its
token layout is. Every family below gets RoPE applied by ComfyUI before the call, and its tokens in diffusers' order:

- Wan 2.1 / 2.2 (`comfy.ldm.wan.model.WanModel`: T2V, I2V, the A14B experts, TI2V-5B) and SkyReels-V2 (Wan's
  architecture and weights' names: ComfyUI loads it as Wan 2.1, so a Wan family model takes a plan calibrated on
  either diffusers class): q, k, v `[B, N, H*D]`, the block in `transformer_options["block_index"]`, the patch grid
  in `["grid_sizes"]`. Each block's first call is its self-attention (video tokens only); the cross-attention calls
  that follow go to ComfyUI's own function. Blocks and tokens are diffusers' (layer i = block i, row-major
  F x H x W).
- Wan VACE (`VaceWanModel`): ComfyUI runs VACE block j right after the main block it feeds, under that block's
  index, once per VACE input: the block's calls are [self, cross] of the main block, then [self, cross] of the VACE
  block per input. Plan layers are diffusers': the main blocks, then the VACE blocks; the control tokens have the
  video's grid.
- FLUX.1 (`comfy.ldm.flux.model.Flux`, dev and schnell) and FLUX.2 (the same class, dev and Klein): q, k, v
  `[B, H, N, D]` (`skip_reshape`), every call a joint self-attention over [text ; image]. Double block i is layer i,
  single block i layer (double blocks) + i, as in diffusers; the timestep arrives in 0..1 (diffusers' t / 1000).
  ComfyUI's FLUX.1 T5 pads to 256 tokens where diffusers pads to 512, so a diffusers plan serves it through the
  plan's derived sizes; FLUX.2's text is 512 tokens on both sides.
- Qwen-Image (`comfy.ldm.qwen_image.model.QwenImageTransformer2DModel`): q, k, v `[B, H, N, D]`, every block one
  joint self-attention over [text ; image] (the prompt's own token count, as diffusers'), block i layer i.

Two families whose tokens ComfyUI orders otherwise; RoPE is applied before the call (the conditioning tokens at
position 0, the identity), so attention does not depend on the order: the call moves the conditioning tokens after
the video, runs diffusers' sequence and moves the output back, exactly.
- HunyuanVideo 1.0 (`comfy.ldm.hunyuan_video.model.HunyuanVideo` as `HunyuanVideo`, `HunyuanVideoI2V`,
  `HunyuanVideoSkyreelsI2V`) joins [text ; video] in its double and single blocks, diffusers [video ; text]. Double
  block i is layer i, single block i layer (double blocks) + i.
- HunyuanVideo 1.5 (the same class as `HunyuanVideo15`) joins [image ; ByT5 ; text ; video] where diffusers joins
  [video ; image ; ByT5 ; text]. Double block i is layer i.

LTX-Video (`comfy.ldm.lightricks.model.LTXVModel` as `LTXV`) and LTX-2 (`LTXAVModel` as `LTXAV`) pass no block
index to their attention calls: `LTXVideoFamily.patch` gives each block its index through ComfyUI's block-replace
patch. LTX-2's blocks also run the audio stream: only the video's self-attention is PARO's.

Refused, with the reason: LTX-2.3 (gated attention, modulated cross-attention: not matched to diffusers yet),
CogVideoX (`REFUSED`: its attention calls carry no block index and its blocks take no block-replace patch, so a
call cannot be matched to a plan layer), and every other model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paroattn import TokenLayout

# config entries of the diffusers counterpart that are checked against a plan that records its model's config
_CHECKED = {
    "wan": ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
            "ffn_dim", "image_dim"),
    "wan_vace": ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                 "ffn_dim", "vace_layers", "vace_in_channels"),
    "flux": ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim", "in_channels",
             "joint_attention_dim", "pooled_projection_dim", "guidance_embeds"),
    "flux2": ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim", "in_channels",
              "joint_attention_dim", "guidance_embeds"),
    "ltx": ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels", "cross_attention_dim",
            "caption_channels"),
    "hunyuan_video": ("num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim", "in_channels",
                      "out_channels", "patch_size", "patch_size_t", "text_embed_dim", "pooled_projection_dim",
                      "guidance_embeds"),
    "ltx2": ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels", "cross_attention_dim",
             "audio_num_attention_heads", "audio_attention_head_dim", "audio_cross_attention_dim", "caption_channels"),
    "qwen_image": ("num_layers", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                   "joint_attention_dim", "zero_cond_t", "use_additional_t_cond"),
}

REFUSED = {
    "CogVideoX": "ComfyUI's CogVideoX passes no block index to its attention calls and its blocks take no "
                 "block-replace patch, so a call cannot be matched to a plan layer: the PARO nodes do not run it; use "
                 "paroattn on the diffusers pipeline",
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
    moved: int = 0  # leading tokens of ComfyUI's sequence that q, k, v carry at the end (diffusers' order)

    @classmethod
    def text_after(cls, q, k, v, text: int, **kwargs) -> SelfAttention:
        """The call of ComfyUI's q, k, v [B, H, text + video, D] with the text moved after the video: attention
        does not depend on the order of the tokens (RoPE is already applied), so PARO runs diffusers' order and
        `output` moves the text back."""
        return cls(*(torch.roll(t, -text, dims=2) for t in (q, k, v)), moved=text, **kwargs)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        if self.moved:
            out = torch.roll(out, self.moved, dims=2)
        return out.transpose(1, 2).flatten(2) if self.heads_last else out


@dataclass
class CallGeometry:
    """What one model call (one sampler evaluation) means for PARO, from the latent, the sigma and the conditioning:
    the timestep on the 0..1000 scale of plans, the latent grid where the attention calls do not carry it (Flux,
    HunyuanVideo 1.5), and the text tokens of the call (Flux, HunyuanVideo 1.5)."""

    timestep: float
    grid: tuple[int, int, int] | None = None
    text_tokens: int | None = None
    problem: str | None = None  # why no call of this model call has a PARO token layout (extra conditioning tokens)
    block: tuple[str, int] | None = None  # the last (block type, index) an attention call came from
    calls: int = 0  # the attention calls of that block so far, less one
    inert_mask: bool = False  # the attention mask the model passes its blocks masks nothing (HunyuanVideo's)

    def count(self, key: tuple[str, int]) -> int:
        """The position of this attention call among the calls of block `key` (0: its first)."""
        if self.block == key:
            self.calls += 1
        else:
            self.block, self.calls = key, 0
        return self.calls


class Family:
    name = ""
    models = ""
    diffusers_class = ""
    also_calibrated_on: tuple[str, ...] = ()  # other diffusers classes of this architecture whose plans fit

    @property
    def diffusers_classes(self) -> tuple[str, ...]:
        return (self.diffusers_class, *self.also_calibrated_on)
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

    def patch(self, model_patcher) -> None:
        """Patches the model needs besides the attention hook (`model_patcher`: a clone the caller owns)."""

    # -- per model call ------------------------------------------------------------------------------
    def geometry(self, x: torch.Tensor, timestep: float, c_crossattn, conds: dict) -> CallGeometry:
        """`conds`: the model's other inputs of this call (ComfyUI's extra conds, by name)."""
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
    also_calibrated_on = ("SkyReelsV2Transformer3DModel",)

    def num_layers(self) -> int:
        return len(self.model.blocks)

    def num_heads(self) -> int:
        return int(self.model.num_heads)

    def head_dim(self) -> int:
        return int(self.model.dim) // int(self.model.num_heads)

    def diffusers_kwargs(self) -> dict:
        m = self.model
        i2v = getattr(m, "img_emb", None) is not None
        flf = getattr(getattr(m, "img_emb", None), "emb_pos", None)
        return dict(
            patch_size=tuple(int(p) for p in m.patch_size), num_attention_heads=self.num_heads(),
            attention_head_dim=self.head_dim(), in_channels=int(m.in_dim), out_channels=int(m.out_dim),
            text_dim=int(m.text_dim), freq_dim=int(m.freq_dim), ffn_dim=int(m.ffn_dim), num_layers=len(m.blocks),
            cross_attn_norm=bool(m.cross_attn_norm), qk_norm="rms_norm_across_heads" if m.qk_norm else None,
            eps=float(m.eps), image_dim=int(m.img_emb.proj[0].normalized_shape[0]) if i2v else None,
            added_kv_proj_dim=int(m.dim) if i2v else None,
            pos_embed_seq_len=int(flf.shape[1]) if flf is not None else None,
        )

    def diffusers_config(self) -> dict:
        from diffusers import WanTransformer3DModel

        with torch.device("meta"):
            return dict(WanTransformer3DModel(**self.diffusers_kwargs()).config)

    def layer_of(self, block: int, call: int) -> int | None:
        """The plan layer of the `call`-th attention call (from 0) of block `block`, None for a cross-attention."""
        return block if call == 0 else None

    def self_attention(self, geometry, q, k, v, heads, mask, options, kwargs):
        block = options.get("block_index")
        grid = options.get("grid_sizes")
        if block is None or grid is None or q.dim() != 3:
            return None, None, None
        layer = self.layer_of(int(block), geometry.count((options.get("block_type", ""), int(block))))
        if layer is None:
            return None, None, None
        frames, height, width = (int(s) for s in grid)
        layout = TokenLayout(0, frames, height, width)
        B, N, HD = q.shape
        call = SelfAttention(*(t.view(B, t.shape[1], heads, HD // heads).transpose(1, 2) for t in (q, k, v)),
                             layer=layer, heads_last=True)
        if N != layout.seq_len or k.shape[1] != N or v.shape[1] != N:
            return call, None, (f"block {block}'s self-attention has {N} tokens where the {frames}x{height}x{width} "
                                f"latent grid has {layout.seq_len}: tokens beside the video (reference or context "
                                "latents) are not a PARO token layout")
        if mask is not None:
            return call, None, "the self-attention call carries an attention mask, which a block-sparse plan cannot honour"
        return call, layout, None


class WanVACEFamily(WanFamily):
    name = "wan_vace"
    models = "Wan VACE"
    diffusers_class = "WanVACETransformer3DModel"
    also_calibrated_on = ()

    def __init__(self, diffusion_model):
        super().__init__(diffusion_model)
        from comfy.ldm.wan.model import WanI2VCrossAttention

        # a block's calls: its self-attention, then one cross-attention per context (text; image and text)
        self.calls_per_block = 1 + (2 if isinstance(diffusion_model.blocks[0].cross_attn, WanI2VCrossAttention) else 1)

    def num_layers(self) -> int:
        return len(self.model.blocks) + len(self.model.vace_blocks)

    def diffusers_config(self) -> dict:
        from diffusers import WanVACETransformer3DModel

        m = self.model
        mapping = sorted(m.vace_layers_mapping.items(), key=lambda item: item[1])
        kwargs = self.diffusers_kwargs()
        kwargs.update(vace_layers=[block for block, _ in mapping], vace_in_channels=int(m.vace_in_dim))
        with torch.device("meta"):
            return dict(WanVACETransformer3DModel(**kwargs).config)

    def layer_of(self, block: int, call: int) -> int | None:
        run, position = divmod(call, self.calls_per_block)
        if position != 0:
            return None
        if run == 0:
            return block
        # the VACE block that runs after main block `block`, once per VACE input (same weights, same plan layer)
        return len(self.model.blocks) + self.model.vace_layers_mapping[block]


class DoubleAndSingleBlocks:
    """Layers of a model of double blocks then single blocks (ComfyUI's `double_blocks`, `single_blocks`, `num_heads`,
    `hidden_size`): double block i is layer i, single block i layer (double blocks) + i, as in diffusers."""

    def num_layers(self) -> int:
        return len(self.model.double_blocks) + len(self.model.single_blocks)

    def num_heads(self) -> int:
        return int(self.model.num_heads)

    def head_dim(self) -> int:
        return int(self.model.hidden_size) // int(self.model.num_heads)

    def layer_of(self, kind: str, block: int) -> int:
        return block + (len(self.model.double_blocks) if kind == "single" else 0)


class JointFamily(Family):
    """Models whose every attention call of a transformer block is one self-attention over [text ; image], q, k, v
    [B, H, N, D] (`skip_reshape`); the timestep arrives in 0..1 (diffusers' t / 1000)."""

    timestep_scale = 1000.0
    block_types: tuple[str, ...] = ("double", "single")

    def patch_size(self) -> int:
        return int(self.model.patch_size)

    def layer_of(self, kind: str, block: int) -> int:
        raise NotImplementedError

    def geometry(self, x, timestep, c_crossattn, conds):
        patch = self.patch_size()
        height, width = (int(s) for s in x.shape[-2:])
        frames = int(x.shape[2]) if x.dim() == 5 else 1
        grid = (frames, (height + patch // 2) // patch, (width + patch // 2) // patch)
        text = int(c_crossattn.shape[1]) if c_crossattn is not None else None
        return CallGeometry(timestep * self.timestep_scale, grid, text)

    def self_attention(self, geometry, q, k, v, heads, mask, options, kwargs):
        block, kind = options.get("block_index"), options.get("block_type")
        if block is None or kind not in self.block_types or q.dim() != 4 or not kwargs.get("skip_reshape"):
            return None, None, None
        call = SelfAttention(q, k, v, layer=self.layer_of(kind, int(block)),
                             heads_last=not kwargs.get("skip_output_reshape", False))
        N = q.shape[2]
        frames, height, width = geometry.grid
        text = geometry.text_tokens
        if frames != 1:
            return call, None, (f"the latent has {frames} images (layered generation), whose tokens follow each other "
                                "in a layout a PARO plan does not describe")
        if text is None or N != text + height * width:
            return call, None, (f"the joint attention has {N} tokens where {text} text tokens and the {height}x{width} "
                                "image grid make " + (f"{text + height * width}" if text is not None else "another count")
                                + ": reference images (FLUX.1 Kontext, edit models) add tokens after the image, which "
                                "is not a PARO token layout")
        if mask is not None:
            return call, None, "the attention call carries an attention mask, which a block-sparse plan cannot honour"
        return call, TokenLayout(text, 1, height, width), None


class FluxFamily(DoubleAndSingleBlocks, JointFamily):
    name = "flux"
    models = "FLUX.1"
    diffusers_class = "FluxTransformer2DModel"

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


class Flux2Family(FluxFamily):
    name = "flux2"
    models = "FLUX.2"
    diffusers_class = "Flux2Transformer2DModel"

    def diffusers_config(self) -> dict:
        from diffusers import Flux2Transformer2DModel

        m, p = self.model, self.model.params
        kwargs = dict(
            patch_size=int(m.patch_size), in_channels=int(p.in_channels) * int(m.patch_size) ** 2,
            num_layers=len(m.double_blocks), num_single_layers=len(m.single_blocks),
            attention_head_dim=self.head_dim(), num_attention_heads=self.num_heads(),
            joint_attention_dim=int(p.context_in_dim), mlp_ratio=float(p.mlp_ratio),
            axes_dims_rope=tuple(int(a) for a in p.axes_dim), rope_theta=int(p.theta),
            guidance_embeds=bool(p.guidance_embed),
        )
        with torch.device("meta"):
            return dict(Flux2Transformer2DModel(**kwargs).config)


class QwenImageFamily(JointFamily):
    name = "qwen_image"
    models = "Qwen-Image"
    diffusers_class = "QwenImageTransformer2DModel"
    block_types = ("double",)

    def num_layers(self) -> int:
        return len(self.model.transformer_blocks)

    def num_heads(self) -> int:
        return int(self.model.transformer_blocks[0].attn.heads)

    def head_dim(self) -> int:
        return int(self.model.inner_dim) // self.num_heads()

    def layer_of(self, kind, block):
        return block

    def diffusers_config(self) -> dict:
        from diffusers import QwenImageTransformer2DModel

        m = self.model
        kwargs = dict(
            patch_size=self.patch_size(), in_channels=int(m.in_channels), out_channels=int(m.out_channels),
            num_layers=self.num_layers(), attention_head_dim=self.head_dim(), num_attention_heads=self.num_heads(),
            joint_attention_dim=int(m.txt_in.in_features),
            zero_cond_t=m.default_ref_method == "index_timestep_zero",
            use_additional_t_cond=bool(getattr(m.time_text_embed, "use_additional_t_cond", False)),
        )
        with torch.device("meta"):
            return dict(QwenImageTransformer2DModel(**kwargs).config)


class HunyuanVideoFamily(DoubleAndSingleBlocks, Family):
    """HunyuanVideo 1.0 (`comfy.ldm.hunyuan_video.model.HunyuanVideo` as `HunyuanVideo`, `HunyuanVideoI2V`,
    `HunyuanVideoSkyreelsI2V`): each double block one joint self-attention, q, k, v [B, H, N, D]
    (`skip_reshape`), over [text ; video], then each single block one over the same joined sequence; diffusers joins
    [video ; text] in both: the call moves the text after the video. Double block i is layer i, single block i layer
    (double blocks) + i, as in diffusers. ComfyUI passes the prompt's own text tokens (diffusers' pipeline pads them
    to 256), so a diffusers plan serves it through its derived sizes. The timestep arrives on 0..1000."""

    name = "hunyuan_video"
    models = "HunyuanVideo"
    diffusers_class = "HunyuanVideoTransformer3DModel"

    def diffusers_config(self) -> dict:
        """`image_condition_type`: latent_concat for the 33-channel I2V input (latent, image latent, mask), else
        None: the token-replace I2V model has T2V's weights, so the weights do not tell it apart."""
        from diffusers import HunyuanVideoTransformer3DModel

        m, p = self.model, self.model.params
        patch_t, patch, _ = (int(s) for s in p.patch_size)
        concat = int(p.in_channels) == 2 * int(p.out_channels) + 1
        kwargs = dict(
            in_channels=int(p.in_channels), out_channels=int(p.out_channels), num_attention_heads=self.num_heads(),
            attention_head_dim=self.head_dim(), num_layers=len(m.double_blocks), num_single_layers=len(m.single_blocks),
            num_refiner_layers=len(m.txt_in.individual_token_refiner.blocks), mlp_ratio=float(p.mlp_ratio),
            patch_size=patch, patch_size_t=patch_t, text_embed_dim=int(p.context_in_dim),
            pooled_projection_dim=int(p.vec_in_dim), guidance_embeds=bool(p.guidance_embed),
            rope_theta=float(p.theta), rope_axes_dim=tuple(int(a) for a in p.axes_dim),
            image_condition_type="latent_concat" if concat else None,
        )
        with torch.device("meta"):
            return dict(HunyuanVideoTransformer3DModel(**kwargs).config)

    def grid(self, x) -> tuple[int, int, int]:
        return tuple((int(n) + int(p) // 2) // int(p) for n, p in zip(x.shape[2:], self.model.patch_size))

    def geometry(self, x, timestep, c_crossattn, conds):
        text = int(c_crossattn.shape[1])
        problem = None
        if conds.get("ref_latent") is not None:
            problem = "a reference latent adds its tokens before the video, which is not a PARO token layout"
        mask = conds.get("attention_mask")
        # the model turns the text mask into an additive mask over the joined sequence, which it passes to every
        # block: one that masks nothing (every text token valid) leaves the attention as it is
        if mask is not None and bool((mask != 0).any() if torch.is_floating_point(mask) else (mask == 0).any()):
            problem = ("the text attention mask has padded tokens (prompts of different lengths in one batch), which a "
                       "block-sparse plan does not mask as the model does")
        return CallGeometry(timestep * self.timestep_scale, self.grid(x), text, problem=problem,
                            inert_mask=mask is not None)

    def self_attention(self, geometry, q, k, v, heads, mask, options, kwargs):
        block, kind = options.get("block_index"), options.get("block_type")
        if block is None or kind not in ("double", "single") or q.dim() != 4 or not kwargs.get("skip_reshape"):
            return None, None, None  # the token refiner's text self-attention runs before the blocks
        layer = self.layer_of(kind, int(block))
        text = geometry.text_tokens
        frames, height, width = geometry.grid
        N = q.shape[2]
        heads_last = not kwargs.get("skip_output_reshape", False)
        call = SelfAttention(q, k, v, layer=layer, heads_last=heads_last)
        if geometry.problem is not None:
            return call, None, geometry.problem
        if N != text + frames * height * width:
            return call, None, (f"the joint attention has {N} tokens where {text} conditioning tokens and the "
                                f"{frames}x{height}x{width} latent grid make {text + frames * height * width}, "
                                "which is not a PARO token layout")
        if mask is not None and not geometry.inert_mask:
            return call, None, ("the attention call carries an attention mask (padded text), which a block-sparse "
                                "plan cannot honour")
        call = SelfAttention.text_after(q, k, v, text, layer=layer, heads_last=heads_last)
        return call, TokenLayout(0, frames, height, width, suffix=text), None


class HunyuanVideo15Family(HunyuanVideoFamily):
    """HunyuanVideo 1.5 (`comfy.ldm.hunyuan_video.model.HunyuanVideo` as `HunyuanVideo15`): double blocks only,
    over [image ; ByT5 ; text ; video] where diffusers has [video ; image ; ByT5 ; text]: the call moves the
    conditioning after the video. ComfyUI passes only the streams a prompt has (no image tokens in text-to-video,
    ByT5 tokens for quoted text only) and no padding; a diffusers plan, calibrated with the pipeline's padded 1985
    conditioning tokens, serves that length through its derived sizes. ComfyUI passes a text mask only where it
    masks tokens."""

    name = "hunyuan_video15"
    models = "HunyuanVideo 1.5"
    diffusers_class = "HunyuanVideo15Transformer3DModel"

    def num_layers(self) -> int:
        return len(self.model.double_blocks)

    def diffusers_config(self) -> dict:
        """target_size and task_type, which only the diffusers pipeline reads, are diffusers' defaults: the weights
        do not say them."""
        from diffusers import HunyuanVideo15Transformer3DModel

        m, p = self.model, self.model.params
        patch_t, patch, _ = (int(s) for s in p.patch_size)
        kwargs = dict(
            in_channels=int(p.in_channels), out_channels=int(p.out_channels), num_attention_heads=self.num_heads(),
            attention_head_dim=self.head_dim(), num_layers=self.num_layers(),
            num_refiner_layers=len(m.txt_in.individual_token_refiner.blocks), mlp_ratio=float(p.mlp_ratio),
            patch_size=patch, patch_size_t=patch_t, text_embed_dim=int(p.context_in_dim),
            text_embed_2_dim=int(m.byt5_in.layernorm.normalized_shape[0]), image_embed_dim=int(p.vision_in_dim),
            rope_theta=float(p.theta), rope_axes_dim=tuple(int(a) for a in p.axes_dim), use_meanflow=bool(p.meanflow),
        )
        with torch.device("meta"):
            return dict(HunyuanVideo15Transformer3DModel(**kwargs).config)

    def geometry(self, x, timestep, c_crossattn, conds):
        # the conditioning tokens the model puts before the video: SigLIP image features, ByT5 glyph text, text
        streams = (conds.get("clip_fea"), conds.get("txt_byt5") if self.model.byt5_in is not None else None,
                   c_crossattn)
        text = sum(int(t.shape[1]) for t in streams if t is not None)
        problem = None
        if conds.get("ref_latent") is not None:
            problem = "a reference latent adds its tokens before the video, which is not a PARO token layout"
        return CallGeometry(timestep * self.timestep_scale, self.grid(x), text, problem=problem)


class BlockIndex:
    """ComfyUI's block-replace patch (`patches_replace["dit"][("double_block", i)]`) that runs block i with
    `block_index` i in the transformer_options its attention calls get, through the patch installed before it,
    if any."""

    def __init__(self, index: int, previous=None):
        self.index, self.previous = index, previous

    def __call__(self, args: dict, extra: dict):
        options = dict(args["transformer_options"])
        options["block_index"] = self.index
        args = {**args, "transformer_options": options}
        return self.previous(args, extra) if self.previous is not None else extra["original_block"](args)


class LTXVideoFamily(Family):
    """LTX-Video 0.9.x (`comfy.ldm.lightricks.model.LTXVModel` as `LTXV`): its attention calls carry no block
    index, so `patch` installs a `BlockIndex` on every block; a block's first call is its self-attention `attn1`
    (video tokens only, q, k, v [B, N, H*D], RoPE applied), the next its cross-attention. Block i is layer i, the
    tokens diffusers' (row-major F x H x W, patch size 1); the timestep arrives in 0..1 (diffusers' t / 1000)."""

    name = "ltx"
    models = "LTX-Video"
    diffusers_class = "LTXVideoTransformer3DModel"
    timestep_scale = 1000.0

    def num_layers(self) -> int:
        return len(self.model.transformer_blocks)

    def num_heads(self) -> int:
        return int(self.model.num_attention_heads)

    def head_dim(self) -> int:
        return int(self.model.attention_head_dim)

    def diffusers_config(self) -> dict:
        from diffusers import LTXVideoTransformer3DModel

        m = self.model
        kwargs = dict(
            in_channels=int(m.in_channels), out_channels=int(m.out_channels), num_attention_heads=self.num_heads(),
            attention_head_dim=self.head_dim(), cross_attention_dim=int(m.cross_attention_dim),
            num_layers=self.num_layers(), caption_channels=int(m.caption_channels),
        )
        with torch.device("meta"):
            return dict(LTXVideoTransformer3DModel(**kwargs).config)

    def patch(self, model_patcher) -> None:
        replaced = model_patcher.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
        for i in range(self.num_layers()):
            model_patcher.set_model_patch_replace(BlockIndex(i, replaced.get(("double_block", i))), "dit",
                                                  "double_block", i)

    def geometry(self, x, timestep, c_crossattn, conds):
        problem = None
        if conds.get("keyframe_idxs") is not None:
            problem = ("guide frames (keyframes) join the video's tokens with positions of their own, which is not a "
                       "PARO token layout")
        return CallGeometry(timestep * self.timestep_scale, tuple(int(s) for s in x.shape[2:]), problem=problem)

    def self_attention(self, geometry, q, k, v, heads, mask, options, kwargs):
        block = options.get("block_index")
        if block is None or q.dim() != 3 or geometry.count(("", int(block))) != 0:
            return None, None, None  # a cross-attention (the block's second call), or not a block's call
        B, N, HD = q.shape
        call = SelfAttention(*(t.view(B, t.shape[1], heads, HD // heads).transpose(1, 2) for t in (q, k, v)),
                             layer=int(block), heads_last=True)
        frames, height, width = geometry.grid
        if geometry.problem is not None:
            return call, None, geometry.problem
        if N != frames * height * width or k.shape[1] != N:
            return call, None, (f"block {block}'s self-attention has {N} tokens where the {frames}x{height}x{width} "
                                f"latent grid has {frames * height * width}, which is not a PARO token layout")
        if mask is not None:
            return call, None, ("the self-attention call carries an attention mask (guide attenuation), which a "
                                "block-sparse plan cannot honour")
        return call, TokenLayout(0, frames, height, width), None


class LTX2Family(LTXVideoFamily):
    """LTX-2 (`comfy.ldm.lightricks.av_model.LTXAVModel` as `LTXAV`): one model for video and audio, whose latents
    ComfyUI packs into one; each block runs the video's self-attention `attn1` (video tokens only, as LTX-Video's)
    and text cross-attention, then the audio's self- and cross-attention and the two cross-modal attentions. Only
    the video self-attention is PARO's (diffusers' paroattn leaves the audio stream dense too): a block's first call
    where the block runs its video. The text connectors run outside the model calls (in ComfyUI when the conditioning
    is prepared for sampling, in diffusers' pipeline), so they do not change the calls."""

    name = "ltx2"
    models = "LTX-2"
    diffusers_class = "LTX2VideoTransformer3DModel"

    def diffusers_config(self) -> dict:
        from diffusers import LTX2VideoTransformer3DModel

        m = self.model
        kwargs = dict(
            in_channels=int(m.in_channels), out_channels=int(m.out_channels), num_attention_heads=self.num_heads(),
            attention_head_dim=self.head_dim(), cross_attention_dim=int(m.cross_attention_dim),
            audio_in_channels=int(m.audio_in_channels), audio_out_channels=int(m.audio_out_channels),
            audio_num_attention_heads=int(m.audio_num_attention_heads),
            audio_attention_head_dim=int(m.audio_attention_head_dim),
            audio_cross_attention_dim=int(m.audio_cross_attention_dim), num_layers=self.num_layers(),
            caption_channels=int(m.caption_channels), rope_type=str(m.split_positional_embedding.value),
        )
        with torch.device("meta"):
            return dict(LTX2VideoTransformer3DModel(**kwargs).config)

    def geometry(self, x, timestep, c_crossattn, conds):
        # ComfyUI hands the model call a packed latent; the video's own shape is the first of `latent_shapes`
        shapes = conds.get("latent_shapes")
        video = tuple(shapes[0]) if shapes else tuple(x.shape)
        problem = None
        if conds.get("keyframe_idxs") is not None:
            problem = ("guide frames (keyframes) join the video's tokens with positions of their own, which is not a "
                       "PARO token layout")
        return CallGeometry(timestep * self.timestep_scale, tuple(int(s) for s in video[2:]), problem=problem)

    def self_attention(self, geometry, q, k, v, heads, mask, options, kwargs):
        if not options.get("run_vx", True):
            return None, None, None  # the blocks run the audio alone: no call is the video's self-attention
        return super().self_attention(geometry, q, k, v, heads, mask, options, kwargs)


def family_of(model_patcher) -> Family:
    """The family of a ComfyUI MODEL, or UnsupportedModel saying why there is none."""
    base = model_patcher.model
    diffusion_model = base.diffusion_model
    base_name, module_name = type(base).__name__, type(diffusion_model).__name__
    from comfy.ldm.hunyuan_video.model import HunyuanVideo
    from comfy.ldm.lightricks.model import LTXVModel

    if type(diffusion_model) is HunyuanVideo and base_name == "HunyuanVideo15":
        return HunyuanVideo15Family(diffusion_model)
    if type(diffusion_model) is HunyuanVideo and base_name in ("HunyuanVideo", "HunyuanVideoI2V",
                                                                "HunyuanVideoSkyreelsI2V"):
        return HunyuanVideoFamily(diffusion_model)
    if type(diffusion_model) is LTXVModel and base_name == "LTXV":
        if diffusion_model.cross_attention_adaln or diffusion_model.caption_proj_before_connector:
            raise UnsupportedModel("LTXV: this LTX model modulates its cross-attention or projects its captions "
                                   "before a connector (LTX-2's blocks), which diffusers' LTX-Video has no class for")
        return LTXVideoFamily(diffusion_model)
    from comfy.ldm.lightricks.av_model import LTXAVModel

    if type(diffusion_model) is LTXAVModel and base_name == "LTXAV":
        m = diffusion_model
        if m.cross_attention_adaln or m.caption_proj_before_connector or m.apply_gated_attention:
            raise UnsupportedModel("LTXAV: this LTX-2 model gates its attention, modulates its cross-attention or "
                                   "projects its captions before the connectors (LTX-2.3), which the PARO nodes have "
                                   "not been matched to diffusers' LTX2VideoTransformer3DModel for")
        return LTX2Family(diffusion_model)
    for name, reason in REFUSED.items():
        if base_name.startswith(name) or module_name.startswith(name):
            raise UnsupportedModel(f"{base_name}: {reason}")
    from comfy.ldm.flux.model import Flux
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
    from comfy.ldm.wan.model import VaceWanModel, WanModel

    if type(diffusion_model) is WanModel and base_name in ("WAN21", "WAN22"):
        return WanFamily(diffusion_model)
    if type(diffusion_model) is VaceWanModel and base_name == "WAN21_Vace":
        return WanVACEFamily(diffusion_model)
    if type(diffusion_model) is Flux and base_name == "Flux" and diffusion_model.params.vec_in_dim:
        return FluxFamily(diffusion_model)
    if type(diffusion_model) is Flux and base_name == "Flux2":
        return Flux2Family(diffusion_model)
    if type(diffusion_model) is QwenImageTransformer2DModel and base_name == "QwenImage":
        return QwenImageFamily(diffusion_model)
    raise UnsupportedModel(
        f"the PARO nodes run Wan 2.1 / 2.2 (T2V, I2V, A14B experts, TI2V-5B), SkyReels-V2, Wan VACE, FLUX.1, FLUX.2, "
        f"Qwen-Image, HunyuanVideo 1.0 and 1.5 and LTX-Video models; this MODEL is {base_name} ({module_name}), which they "
        "do not support"
    )
