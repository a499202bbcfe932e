"""Tiny models of the supported families, built in code (no downloads), for the tests.

    transformer = tiny_transformer("cogvideox")              # or "cogvideox1.5", "wan", "wan-i2v", "wan2.2-ti2v", "flux"
    kwargs = tiny_forward_inputs(transformer, timestep=500)   # a forward call's keyword arguments
    pipe = tiny_pipeline("wan")                               # a whole diffusers pipeline, random weights
    pipe = tiny_pipeline("wan2.2")                            # Wan 2.2 A14B-like: two experts, switched
    pipe = tiny_pipeline("wan2.2-ti2v")                       # Wan 2.2 TI2V-like: 16x VAE, per-token timesteps

Sizes are chosen so each self-attention sequence spans a few 16-token blocks (plans for these
models use `block_size=16`), and a 2-step pipeline run takes about a second on one CPU core.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

FAMILIES = ("cogvideox", "cogvideox1.5", "wan", "wan-i2v", "wan2.2-ti2v", "flux", "hunyuan_video", "skyreels_v2",
            "wan_vace", "qwen_image", "flux2", "hunyuan_video15", "ltx", "ltx2")
PIPELINES = ("cogvideox", "wan", "wan2.2", "wan2.2-ti2v", "flux", "hunyuan_video", "skyreels_v2", "wan_vace", "ltx",
             "qwen_image", "flux2")

# text lengths of the tiny pipelines (the real models use 226, 512 and 512)
COGVIDEOX_TEXT = 8
WAN_TEXT = 8
FLUX_TEXT = 8
# HunyuanVideo's text follows the video: 21 tokens (the real model: 256), not a multiple of the 16-token blocks;
# tiny forward inputs pad the first item's text after 13 tokens
HUNYUAN_TEXT = 21
HUNYUAN_VALID_TEXT = 13
# Wan's I2V processor hard-codes 512 text tokens before the image tokens in attn2
WAN_I2V_TEXT = 512
WAN_I2V_IMAGE = 4
TINY_BLOCK = 16
# Qwen-Image's text length is the prompt's own (not padded to a fixed length); FLUX.2's is padded (512 for dev)
QWEN_TEXT = 10
FLUX2_TEXT = 8
# HunyuanVideo 1.5's joined text: 7 MLLM + 5 ByT5 + 4 vision tokens (1000 + 256 + 729 at full size); the first
# item's MLLM text is padded after 4 tokens, its ByT5 after 2, and in text-to-video the vision tokens are padding
HUNYUAN15_TEXT = (7, 5, 4)
# audio frames beside the tiny LTX-2 model's video
LTX2_AUDIO = 6
# the tiny VACE model's control channels: the inactive and reactive video latents (2 x 4) and the 8 x 8 mask
# pixels per latent position (64), as its pipeline builds them (full size: 2 x 16 + 64 = 96); VACE blocks at layers 0, 1
VACE_CHANNELS = 72
# the tiny expert pair switches at t = 700 (boundary_ratio 0.7 in its pipeline config), so that a 4-step run
# gives each expert two steps (t = 1000, 858 | 602, 9) and the bucket (500, 900] on both sides of the switch
WAN22_BOUNDARY = 0.7
# the tiny TI2V model: 3 heads and 6 latent channels (TI2V-5B: 24 heads, 48 channels), a VAE that compresses
# space by 16 (a 2x2 patchify before 8x) like Wan 2.2's
WAN22_TI2V_HEADS = 3
WAN22_TI2V_CHANNELS = 6


def tiny_transformer(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, head_dim: int = 16,
                     heads: int = 2):
    """A 2-layer transformer of `family` with `heads` heads of `head_dim` channels (16; the Triton kernels
    need 64 or 128) and random weights."""
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (RoPE splits it in 3 axes), got {head_dim}")
    torch.manual_seed(seed)
    if family in ("cogvideox", "cogvideox1.5"):
        from diffusers import CogVideoXTransformer3DModel

        v15 = family == "cogvideox1.5"
        model = CogVideoXTransformer3DModel(
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            in_channels=4,
            out_channels=4,
            time_embed_dim=8,
            text_embed_dim=16,
            num_layers=2,
            sample_width=8,
            sample_height=8,
            sample_frames=9,
            patch_size=2,
            patch_size_t=2 if v15 else None,
            max_text_seq_length=COGVIDEOX_TEXT,
            use_rotary_positional_embeddings=True,
            patch_bias=not v15,
        )
    elif family in ("wan", "wan-i2v", "wan2.2-ti2v"):
        from diffusers import WanTransformer3DModel

        i2v = family == "wan-i2v"
        ti2v = family == "wan2.2-ti2v"
        channels = WAN22_TI2V_CHANNELS if ti2v else 4
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=WAN22_TI2V_HEADS if ti2v else heads,
            attention_head_dim=head_dim,
            in_channels=2 * channels if i2v else channels,
            out_channels=channels,
            text_dim=16,
            freq_dim=16,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
            image_dim=16 if i2v else None,
            added_kv_proj_dim=heads * head_dim if i2v else None,
        )
    elif family in ("skyreels_v2", "wan_vace"):
        import diffusers

        extra = {"vace_layers": [0, 1], "vace_in_channels": VACE_CHANNELS} if family == "wan_vace" else {}
        cls = diffusers.WanVACETransformer3DModel if family == "wan_vace" else diffusers.SkyReelsV2Transformer3DModel
        model = cls(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra,
        )
    elif family == "hunyuan_video15":
        from diffusers import HunyuanVideo15Transformer3DModel

        model = HunyuanVideo15Transformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=head_dim, num_layers=2,
            num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=16, image_embed_dim=16,
            rope_axes_dim=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
        )
    elif family == "ltx":
        from diffusers import LTXVideoTransformer3DModel

        model = LTXVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=head_dim,
            cross_attention_dim=heads * head_dim, num_layers=2, caption_channels=16,
        )
    elif family == "ltx2":
        from diffusers import LTX2VideoTransformer3DModel

        # gated attention on: the adapter must apply the model's per-head gates
        model = LTX2VideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=head_dim,
            cross_attention_dim=heads * head_dim, audio_in_channels=4, audio_out_channels=4,
            audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=2,
            caption_channels=16, gated_attn=True,
        )
    elif family == "qwen_image":
        from diffusers import QwenImageTransformer2DModel

        model = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=head_dim,
            num_attention_heads=heads, joint_attention_dim=16,
            axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
        )
    elif family == "flux2":
        from diffusers import Flux2Transformer2DModel

        # FLUX.2 [klein]-like: no guidance embedding, text features of 3 encoder layers of 16 channels
        model = Flux2Transformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=head_dim,
            num_attention_heads=heads, joint_attention_dim=48, timestep_guidance_channels=16,
            axes_dims_rope=(head_dim // 4,) * 4, guidance_embeds=False,
        )
    elif family == "flux":
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=head_dim,
            num_attention_heads=heads,
            joint_attention_dim=16,
            pooled_projection_dim=16,
            guidance_embeds=False,
            axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
        )
    elif family == "hunyuan_video":
        from diffusers import HunyuanVideoTransformer3DModel

        model = HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=heads, attention_head_dim=head_dim, num_layers=1,
            num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16,
            pooled_projection_dim=16, rope_axes_dim=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
        )
    else:
        raise ValueError(f"unknown tiny family {family!r}; expected one of {FAMILIES}")
    # random-init norms are all ones: perturb every parameter a little so norms and RoPE matter
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def tiny_forward_inputs(transformer, *, timestep: float = 500.0, batch: int = 2, frames: int | None = None,
                        height: int | None = None, width: int | None = None, seed: int = 1) -> dict:
    """Keyword arguments of one forward of a tiny transformer, with `timestep` on the 0..1000 scale.
    `frames`, `height`, `width` are latent sizes; defaults: 3x8x8 (CogVideoX 1.5: 4x8x8, it patches
    time by 2), Flux 12x12 (6x6 tokens; frames ignored)."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(transformer.parameters()).dtype
    name = type(transformer).__name__
    config = transformer.config

    is_flux = name in ("FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel")
    if frames is None:
        frames = 4 if getattr(config, "patch_size_t", None) else 3
    height = height if height is not None else (12 if is_flux else 8)
    width = width if width is not None else (12 if is_flux else 8)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if name == "CogVideoXTransformer3DModel":
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        p = config.patch_size
        pt = config.patch_size_t or 1
        grid_h, grid_w = height // p, width // p
        cos, sin = get_3d_rotary_pos_embed(
            embed_dim=config.attention_head_dim,
            crops_coords=((0, 0), (grid_h, grid_w)),
            grid_size=(grid_h, grid_w),
            temporal_size=frames // pt,
        )
        return {
            "hidden_states": rand(batch, frames, config.in_channels, height, width),
            "encoder_hidden_states": rand(batch, config.max_text_seq_length, config.text_embed_dim),
            "timestep": torch.full((batch,), int(timestep), dtype=torch.long),
            "image_rotary_emb": (cos.to(dtype), sin.to(dtype)),
            "return_dict": False,
        }
    if name == "WanTransformer3DModel":
        i2v = config.image_dim is not None
        kwargs = {
            "hidden_states": rand(batch, config.in_channels, frames, height, width),
            "timestep": torch.full((batch,), float(timestep)),
            "encoder_hidden_states": rand(batch, WAN_I2V_TEXT if i2v else WAN_TEXT, config.text_dim),
            "return_dict": False,
        }
        if i2v:
            kwargs["encoder_hidden_states_image"] = rand(batch, WAN_I2V_IMAGE, config.image_dim)
        return kwargs
    if name in ("SkyReelsV2Transformer3DModel", "WanVACETransformer3DModel"):
        kwargs = {
            "hidden_states": rand(batch, config.in_channels, frames, height, width),
            "timestep": torch.full((batch,), float(timestep)),
            "encoder_hidden_states": rand(batch, WAN_TEXT, config.text_dim),
            "return_dict": False,
        }
        if name == "WanVACETransformer3DModel":
            kwargs["control_hidden_states"] = rand(batch, config.vace_in_channels, frames, height, width)
        return kwargs
    if name == "LTXVideoTransformer3DModel":  # the pipeline packs the latents row-major (patch size 1)
        text_mask = torch.ones(batch, WAN_TEXT, dtype=torch.long)
        text_mask[0, 5:] = 0
        return {
            "hidden_states": rand(batch, frames * height * width, config.in_channels),
            "encoder_hidden_states": rand(batch, WAN_TEXT, config.caption_channels),
            "timestep": torch.full((batch,), float(timestep)),
            "encoder_attention_mask": text_mask,
            "num_frames": frames, "height": height, "width": width,
            "rope_interpolation_scale": (8 / 25, 32, 32),  # the pipeline's: VAE factors over the frame rate
            "return_dict": False,
        }
    if name == "LTX2VideoTransformer3DModel":  # video packed row-major; LTX2_AUDIO audio frames beside it
        text_mask = torch.ones(batch, WAN_TEXT, dtype=torch.long)
        text_mask[0, 5:] = 0
        return {
            "hidden_states": rand(batch, frames * height * width, config.in_channels),
            "audio_hidden_states": rand(batch, LTX2_AUDIO, config.audio_in_channels),
            "encoder_hidden_states": rand(batch, WAN_TEXT, config.caption_channels),
            "audio_encoder_hidden_states": rand(batch, WAN_TEXT, config.caption_channels),
            "timestep": torch.full((batch,), float(timestep)),
            "encoder_attention_mask": text_mask, "audio_encoder_attention_mask": text_mask,
            "num_frames": frames, "height": height, "width": width, "audio_num_frames": LTX2_AUDIO,
            "return_dict": False,
        }
    if name == "HunyuanVideo15Transformer3DModel":
        mllm, byt5, vision = HUNYUAN15_TEXT
        mask, mask_2 = torch.ones(batch, mllm, dtype=torch.long), torch.ones(batch, byt5, dtype=torch.long)
        mask[0, 4:], mask_2[0, 2:] = 0, 0
        return {
            "hidden_states": rand(batch, config.in_channels, frames, height, width),
            "timestep": torch.full((batch,), float(timestep)),
            "encoder_hidden_states": rand(batch, mllm, config.text_embed_dim),
            "encoder_attention_mask": mask,
            "encoder_hidden_states_2": rand(batch, byt5, config.text_embed_2_dim),
            "encoder_attention_mask_2": mask_2,
            "image_embeds": torch.zeros(batch, vision, config.image_embed_dim, dtype=dtype),  # text-to-video
            "return_dict": False,
        }
    if name == "QwenImageTransformer2DModel":
        rows, cols = height // 2, width // 2  # the pipeline packs 2x2 latent pixels per token
        return {
            "hidden_states": rand(batch, rows * cols, config.in_channels),
            "encoder_hidden_states": rand(batch, QWEN_TEXT, config.joint_attention_dim),
            "timestep": torch.full((batch,), timestep / 1000.0),
            "img_shapes": [[(1, rows, cols)]] * batch,
            "return_dict": False,
        }
    if name == "Flux2Transformer2DModel":
        rows, cols = height // 2, width // 2
        # (time, row, column, text position) per token, as the pipeline builds them
        img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(rows), torch.arange(cols), torch.arange(1))
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(FLUX2_TEXT))
        return {
            "hidden_states": rand(batch, rows * cols, config.in_channels),
            "encoder_hidden_states": rand(batch, FLUX2_TEXT, config.joint_attention_dim),
            "timestep": torch.full((batch,), timestep / 1000.0),
            "img_ids": img_ids.expand(batch, -1, -1),
            "txt_ids": txt_ids.expand(batch, -1, -1),
            "guidance": torch.full((batch,), 4.0) if config.guidance_embeds else None,
            "return_dict": False,
        }
    if name == "FluxTransformer2DModel":
        rows, cols = height // 2, width // 2  # the pipeline packs 2x2 latent pixels per token
        img_ids = torch.zeros(rows, cols, 3)
        img_ids[..., 1] = torch.arange(rows)[:, None]
        img_ids[..., 2] = torch.arange(cols)[None, :]
        return {
            "hidden_states": rand(batch, rows * cols, config.in_channels),
            "encoder_hidden_states": rand(batch, FLUX_TEXT, config.joint_attention_dim),
            "pooled_projections": rand(batch, config.pooled_projection_dim),
            "timestep": torch.full((batch,), timestep / 1000.0),
            "img_ids": img_ids.reshape(-1, 3),
            "txt_ids": torch.zeros(FLUX_TEXT, 3),
            "return_dict": False,
        }
    if name == "HunyuanVideoTransformer3DModel":
        mask = torch.ones(batch, HUNYUAN_TEXT, dtype=torch.long)
        mask[0, HUNYUAN_VALID_TEXT:] = 0  # padded text, as the pipeline pads a short prompt
        return {
            "hidden_states": rand(batch, config.in_channels, frames, height, width),
            "timestep": torch.full((batch,), float(timestep)).to(dtype),
            "encoder_hidden_states": rand(batch, HUNYUAN_TEXT, config.text_embed_dim),
            "encoder_attention_mask": mask,
            "pooled_projections": rand(batch, config.pooled_projection_dim),
            "guidance": torch.full((batch,), 6000.0).to(dtype),
            "return_dict": False,
        }
    raise ValueError(f"no tiny inputs for {name}")


# -- whole pipelines -------------------------------------------------------------------------

_WORDS = ["a", "cat", "dog", "runs", "on", "the", "beach", "at", "sunset", "red", "car", "in", "city", "rain"]


def tiny_t5(hidden: int = 16, seed: int = 0):
    """(T5 tokenizer with a 32-piece vocabulary, 1-layer T5 encoder with `hidden` channels)."""
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(f"\u2581{w}", -1.0 - i) for i, w in enumerate(_WORDS)]
    vocab += [(c, -20.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    tokenizer = T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(vocab), d_model=hidden, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
    )
    return tokenizer, T5EncoderModel(config).eval()


def tiny_clip(hidden: int = 16, seed: int = 0):
    """(CLIP tokenizer with a word-level vocabulary and no merges, 1-layer CLIP text model)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for w in _WORDS:
        vocab[f"{w}</w>"] = len(vocab)
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(f"{c}</w>", len(vocab))
        vocab.setdefault(c, len(vocab))
    import json
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="paro-clip-"))
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(
        vocab_file=str(folder / "vocab.json"), merges_file=str(folder / "merges.txt"), model_max_length=77
    )
    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=hidden,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    return tokenizer, CLIPTextModel(config).eval()


def tiny_qwen2_vl(hidden: int = 16, seed: int = 0):
    """(byte-level Qwen2 tokenizer without merges: one token per byte, 1-layer Qwen2.5-VL with `hidden` channels)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {piece: i for i, piece in enumerate(bytes_to_unicode().values())}
    end = vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<|endoftext|>", eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=end, eos_token_id=end, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                           fullatt_block_indexes=[0]),
    )
    return tokenizer, Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_pipeline(family: str, *, seed: int = 0):
    """A whole diffusers pipeline of `family` ("cogvideox", "wan", "flux") with random tiny weights.
    Generate with `tiny_call_kwargs(family)` for a size that matches `tiny_transformer` plans."""
    torch.manual_seed(seed)
    if family == "cogvideox":
        from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline

        tokenizer, text_encoder = tiny_t5(16, seed)
        vae = AutoencoderKLCogVideoX(
            in_channels=3, out_channels=3,
            down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
            temporal_compression_ratio=4,
        )
        return CogVideoXPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
            transformer=tiny_transformer("cogvideox", seed=seed), scheduler=CogVideoXDDIMScheduler(timestep_spacing="trailing"),
        )
    if family in ("wan", "wan2.2"):
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

        tokenizer, text_encoder = tiny_t5(16, seed)
        vae = AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True],
                               latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
        pair = family == "wan2.2"  # same config, other weights: the high- and low-noise experts
        return WanPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
            transformer=tiny_transformer("wan", seed=seed), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            transformer_2=tiny_transformer("wan", seed=seed + 1) if pair else None,
            boundary_ratio=WAN22_BOUNDARY if pair else None,
        )
    if family in ("skyreels_v2", "wan_vace"):
        import diffusers

        tokenizer, text_encoder = tiny_t5(16, seed)
        vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                         temperal_downsample=[False, True, True],
                                         latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
        cls = diffusers.SkyReelsV2Pipeline if family == "skyreels_v2" else diffusers.WanVACEPipeline
        scheduler = (diffusers.UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction")
                     if family == "skyreels_v2" else diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
        return cls(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                   transformer=tiny_transformer(family, seed=seed))
    if family == "flux2":  # FLUX.2 [klein]: a Qwen3 text encoder, the features of its layers 9, 18 and 27
        import diffusers
        from transformers import Qwen3Config, Qwen3ForCausalLM

        tokenizer, _ = tiny_qwen2_vl(16, seed)
        tokenizer.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=27, num_attention_heads=2,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=1024)).eval()
        vae = diffusers.AutoencoderKLFlux2(block_out_channels=(4, 4, 4, 4), layers_per_block=1, latent_channels=4,
                                           norm_num_groups=1)
        return diffusers.Flux2KleinPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                            text_encoder=text_encoder, tokenizer=tokenizer,
                                            transformer=tiny_transformer("flux2", seed=seed))
    if family == "qwen_image":
        import diffusers

        tokenizer, text_encoder = tiny_qwen2_vl(16, seed)
        vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                               temperal_downsample=[False, True, True],
                                               latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
        return diffusers.QwenImagePipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                           text_encoder=text_encoder, tokenizer=tokenizer,
                                           transformer=tiny_transformer("qwen_image", seed=seed))
    if family == "ltx":
        import diffusers

        tokenizer, text_encoder = tiny_t5(16, seed)
        vae = diffusers.AutoencoderKLLTXVideo(  # 32x in space (a 4x4 patchify, then 3 halvings), 8x in time
            latent_channels=4, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1))
        return diffusers.LTXPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                     text_encoder=text_encoder, tokenizer=tokenizer,
                                     transformer=tiny_transformer("ltx", seed=seed))
    if family == "wan2.2-ti2v":
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

        tokenizer, text_encoder = tiny_t5(16, seed)
        z = WAN22_TI2V_CHANNELS
        vae = AutoencoderKLWan(base_dim=4, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=[0.0] * z, latents_std=[1.0] * z,
                               is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16)
        return WanPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
            transformer=tiny_transformer("wan2.2-ti2v", seed=seed), scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
            expand_timesteps=True,
        )
    if family == "flux":
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

        tokenizer, text_encoder = tiny_clip(16, seed)
        tokenizer_2, text_encoder_2 = tiny_t5(16, seed)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(4, 4, 4, 4), layers_per_block=1, latent_channels=4, norm_num_groups=1,
            use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0, scaling_factor=1.0,
        )
        return FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
            text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=tiny_transformer("flux", seed=seed),
        )
    if family == "hunyuan_video":
        from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
        from transformers import LlamaConfig, LlamaModel

        tokenizer, _ = tiny_t5(16, seed)  # a T5 tokenizer stands in for Llama's: the pipeline only tokenizes
        torch.manual_seed(seed)
        text_encoder = LlamaModel(LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
        )).eval()
        tokenizer_2, text_encoder_2 = tiny_clip(16, seed)
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
            spatial_compression_ratio=8, temporal_compression_ratio=4, mid_block_add_attention=True,
        )
        return HunyuanVideoPipeline(
            text_encoder=text_encoder, tokenizer=tokenizer, transformer=tiny_transformer("hunyuan_video", seed=seed),
            vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),  # 7.0 in the release: 3 steps stay above t=500
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
        )
    raise ValueError(f"unknown tiny pipeline {family!r}; expected one of {PIPELINES}")


def tiny_call_kwargs(family: str) -> dict:
    """Pipeline call arguments (size, text length, steps) for `tiny_pipeline(family)`."""
    if family == "cogvideox":
        # 9 frames of 64x64 -> 3 latent frames of 8x8 -> 3x4x4 grid after 2x2 patches
        return {"height": 64, "width": 64, "num_frames": 9, "max_sequence_length": COGVIDEOX_TEXT,
                "num_inference_steps": 2, "guidance_scale": 6.0, "output_type": "pt", "use_dynamic_cfg": False}
    if family in ("wan", "wan2.2", "skyreels_v2", "wan_vace"):
        # 9 frames of 64x64 -> 3 latent frames of 8x8 -> 3x4x4 tokens; the pair runs one step per expert
        return {"height": 64, "width": 64, "num_frames": 9, "max_sequence_length": WAN_TEXT,
                "num_inference_steps": 2, "guidance_scale": 5.0, "output_type": "pt"}
    if family == "wan2.2-ti2v":
        # 9 frames of 128x128 -> 3 latent frames of 8x8 (VAE 16 in space) -> 3x4x4 tokens
        return {"height": 128, "width": 128, "num_frames": 9, "max_sequence_length": WAN_TEXT,
                "num_inference_steps": 2, "guidance_scale": 5.0, "output_type": "pt"}
    if family == "flux2":
        # 96x96 pixels / 8 (VAE) / 2 (packing) -> 6x6 image tokens after FLUX2_TEXT text tokens (the prompt padded)
        return {"height": 96, "width": 96, "max_sequence_length": FLUX2_TEXT, "num_inference_steps": 2,
                "guidance_scale": 4.0, "output_type": "pt"}
    if family == "qwen_image":
        # 96x96 pixels / 8 (VAE) / 2 (packing) -> 6x6 image tokens after the prompt's own tokens (one per byte here,
        # with the system prompt's tail the pipeline keeps)
        return {"height": 96, "width": 96, "num_inference_steps": 2, "output_type": "pt"}
    if family == "ltx":
        # 17 frames of 128x128 -> 3 latent frames of 4x4 (VAE 8 in time, 32 in space) -> 3x4x4 tokens
        return {"height": 128, "width": 128, "num_frames": 17, "max_sequence_length": WAN_TEXT,
                "num_inference_steps": 2, "guidance_scale": 3.0, "output_type": "pt"}
    if family == "flux":
        # 96x96 pixels / 8 (VAE) / 2 (packing) -> 6x6 image tokens
        return {"height": 96, "width": 96, "max_sequence_length": FLUX_TEXT,
                "num_inference_steps": 2, "guidance_scale": 3.5, "output_type": "pt"}
    if family == "hunyuan_video":
        # 9 frames of 64x64 -> 3 latent frames of 8x8 -> 3x4x4 tokens, then 21 text tokens (the prompt padded);
        # the template without a system prompt, so nothing is cropped
        return {"height": 64, "width": 64, "num_frames": 9, "max_sequence_length": HUNYUAN_TEXT,
                "num_inference_steps": 2, "guidance_scale": 6.0, "output_type": "pt",
                "prompt_template": {"template": "{}", "crop_start": 0}}
    raise ValueError(f"unknown tiny pipeline {family!r}")


@contextmanager
def lone_processor(transformer, processor):
    """`transformer.set_attn_processor(processor)` on every attention module for the block, then the
    processors it had before, restored."""
    originals = dict(transformer.attn_processors)
    transformer.set_attn_processor(processor)
    try:
        yield processor
    finally:
        transformer.set_attn_processor(originals)
