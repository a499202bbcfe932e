"""End-to-end benchmark: one denoising step of full-size transformers, dense SDPA vs PARO.

CogVideoX-5B, Wan2.1-1.3B and FLUX.1-dev transformers are built from their configs (typed below from
the released models' configs; no downloads) with random bf16 weights on the GPU: timing does not
depend on weight values. One "step" is one transformer forward at the model's default size:
- CogVideoX-5B: 49 frames 480x720, B=2 (CFG batched), 226 + 13x30x45 = 17776 tokens;
- Wan2.1-1.3B: 81 frames 480x832, B=1 (one CFG branch; a CFG step is two such calls), 21x30x52 = 32760;
- FLUX.1-dev: 1024x1024, B=1 (guidance-distilled, no CFG), 512 + 64x64 = 4608 tokens;
- Wan 2.2 A14B, one expert (both have this config): 81 frames 720x1280, B=1, 21x45x80 = 75600 tokens;
- Wan2.1-14B (the same blocks as an A14B expert): 81 frames 720x1280, B=1, 75600 tokens;
- Wan 2.2 TI2V-5B: 121 frames 704x1280 (VAE 16x), B=1, per-token timesteps, 31x22x40 = 27280 tokens;
- SkyReels-V2-14B (720P): 121 frames 720x1280, B=1, 31x45x80 = 111600 tokens;
- Wan2.1-VACE-14B: the pipeline's 81 frames 480x832, B=1, 21x30x52 = 32760 tokens in 40 main + 8 VACE blocks;
- Qwen-Image: 1024x1024 (2048x2048), B=1 (one CFG branch), 128 text (a prompt's own length) + 64x64 (128x128);
- FLUX.2-dev: 1024x1024 (2048x2048), B=1 (guidance-distilled), 512 text + 64x64 (128x128);
- HunyuanVideo-1.5 (8.3B): 121 frames 720x1280 (VAE 16x), B=1, 31x45x80 + 1985 text (128 + 16 real) = 113585;
- LTX-Video 0.9 (2B): the pipeline's 161 frames 512x704 (VAE 32x, 8x in time), B=1, 21x16x22 = 7392 tokens;
- LTX-2 (19B): the pipeline's 121 frames 512x768, B=1, 16x16x24 = 6144 video tokens beside 126 audio frames;
- HunyuanVideo: 129 frames 720x1280, B=1 (guidance-distilled), 33x45x80 + 256 text = 119056 tokens, the
  text padded as a prompt pads it: --text-tokens real ones (96 by default; 256: a prompt that fills it).
  Dense runs the model's masked SDPA, PARO the kernels with the op's suffix_mask.
The dense row also gives the step's attention share: one SDPA call of the step's shape timed alone, times
the self-attention layers, over the step. Modes: dense (the model's own processors, SDPA), PARO at density 0.5 and 0.2 with bf16 or int8 QK +
fp8 PV, synthetic plans (random orders, banded + scattered masks). The prefetch overhead is the step
time with masks streamed per layer (side stream, 3 slots) minus the time with all masks resident; the
"model-rope" rows apply the model's own RoPE code before the op (fuse_rope=False) instead of the op's pass.

    python benchmarks/e2e.py [--models cogvideox,wan,flux] [--iters 3] [--query-block 128] [--json results.json]
        [--modes "dense,paro d=0.2 int8+fp8"] [--resident-only]     # (models also: wan2.2-a14b, wan2.2-ti2v, hunyuan)
        [--text-tokens 96]                                          # hunyuan: real tokens of the 256
        # also: skyreels-v2-720p, wan-vace-14b, qwen-image, qwen-image-2048, flux2, flux2-2048,
        #       hunyuanvideo-1.5-720p, ltx-video, ltx-2                 [--no-model-rope]
    python benchmarks/e2e.py --compile fullgraph,reduce-overhead [--models ...]   # compiled rows (below)
    python benchmarks/e2e.py --smoke      # a shrunk Wan on CPU, torch backend: checks the script runs
    python benchmarks/e2e.py --table RESULTS.json [...]   # markdown tables of results files (no GPU)

With --compile, each model runs instead dense and PARO (d=0.2 int8 QK + fp8 PV; --compile-densities for
more) eagerly and under `torch.compile(transformer, ...)` for each named setting ("default": no options,
"fullgraph": fullgraph=True, "reduce-overhead": fullgraph=True with whole-transformer CUDA graphs,
"regional": each repeated block compiled on its own with fullgraph=True, diffusers' `compile_repeated_blocks`,
a fraction of the compile time), in one
run: the first call (compile included) is reported apart from the median step after it (with CUDA graphs,
after the second call too, which records them), and each compiled output, dense and PARO, is compared
with the eager output of the same model and inputs (max |difference| over max |eager output|).

    python benchmarks/e2e.py --compile fullgraph --linear fp8 --profile --no-eager --query-block 128 \
        --models wan-14b-720p [--modes "dense,dense + fp8 linear"]
    python benchmarks/e2e.py --table A.json B.json --merge          # one table of runs split by --modes

--linear fp8 runs each compiled mode again with the transformer blocks' linear layers in fp8 (paroattn.linear:
torchao's float8 dynamic activations and weights, per-row scales; `apply(transformer, plan or None,
linear="fp8")`): dense bf16 | dense + fp8 linear | PARO d=0.2 int8+fp8 | PARO + fp8 linear. --profile adds one
profiled step per row (torch.profiler, CUDA kernels), split by kernel name into attention (SDPA's kernels, or
PARO's prologue, RoPE pass and attention kernels; Wan's cross-attention counts here in both), matrix multiplies
(cuBLAS, CUTLASS, torch._scaled_mm), other kernels (norms, modulation, RoPE, casts, the activations' fp8
quantization) and GPU idle time; each row keeps its 25 longest kernels with their class. --no-eager skips the
eager runs (a 14B step takes seconds each). --modes names a subset (speedups then need the dense row of another
run: --table ... --merge).

The JSON records the GPU, torch, triton, date, the plans' block sizes and, where available, the
driver and the commit.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling scripts, also when loaded from elsewhere

# the run's GPU, driver and commit, as benchmarks/attention.py records them
from attention import environment  # noqa: E402

from paroattn import Plan, TokenLayout  # noqa: E402
from paroattn.app.generate import compiled  # noqa: E402
from paroattn.masks import synthetic_block_mask  # noqa: E402
from paroattn.pipelines import apply, family_of, self_attention_layers  # noqa: E402
from paroattn.plan import model_fingerprint  # noqa: E402

# full-size configs (diffusers argument names), from the released model configs
CONFIGS = {
    "cogvideox": ("CogVideoXTransformer3DModel", dict(
        num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=512,
        text_embed_dim=4096, num_layers=42, sample_width=90, sample_height=60, sample_frames=49, patch_size=2,
        max_text_seq_length=226, use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False,
    )),
    "wan": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    )),
    "flux": ("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )),
    "wan2.2-a14b": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    )),
    "wan2.2-ti2v": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
        text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    )),
    "hunyuan": ("HunyuanVideoTransformer3DModel", dict(
        in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
        num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
        guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
        rope_axes_dim=(16, 56, 56),
    )),
}
# Wan 2.1 14B's blocks, which SkyReels-V2-T2V-14B-720P and Wan2.1-VACE-14B share
_WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
CONFIGS.update({
    "wan-14b-720p": ("WanTransformer3DModel", dict(_WAN_14B)),
    "skyreels-v2-720p": ("SkyReelsV2Transformer3DModel", dict(_WAN_14B)),
    "wan-vace-14b": ("WanVACETransformer3DModel", dict(
        _WAN_14B, vace_layers=[0, 5, 10, 15, 20, 25, 30, 35], vace_in_channels=96)),
    # diffusers' defaults are the released Qwen-Image and FLUX.2-dev configs
    "qwen-image": ("QwenImageTransformer2DModel", {}),
    "qwen-image-2048": ("QwenImageTransformer2DModel", {}),
    "flux2": ("Flux2Transformer2DModel", {}),
    "flux2-2048": ("Flux2Transformer2DModel", {}),
    # diffusers' defaults are HunyuanVideo-1.5 (8.3B), LTX-Video 0.9 (2B) and LTX-2 (19B, audio and video)
    "hunyuanvideo-1.5-720p": ("HunyuanVideo15Transformer3DModel", {}),
    "ltx-video": ("LTXVideoTransformer3DModel", {}),
    "ltx-2": ("LTX2VideoTransformer3DModel", {}),
})
LABELS = {"cogvideox": "CogVideoX-5B", "wan": "Wan2.1-1.3B", "flux": "FLUX.1-dev", "wan-14b-720p": "Wan2.1-14B 720p",
          "wan2.2-a14b": "Wan2.2-A14B expert 720p", "wan2.2-ti2v": "Wan2.2-TI2V-5B", "hunyuan": "HunyuanVideo 720p",
          "skyreels-v2-720p": "SkyReels-V2-14B 720p", "wan-vace-14b": "Wan2.1-VACE-14B",
          "qwen-image": "Qwen-Image 1024", "qwen-image-2048": "Qwen-Image 2048",
          "flux2": "FLUX.2-dev 1024", "flux2-2048": "FLUX.2-dev 2048",
          "hunyuanvideo-1.5-720p": "HunyuanVideo-1.5 720p", "ltx-video": "LTX-Video 2B", "ltx-2": "LTX-2 19B"}
# --smoke: Wan2.1-1.3B's blocks shrunk to a CPU check of the script: 2 layers of 2 heads of 64, 8 text tokens and
# 3 x 16 x 16 latents (3 x 8 x 8 = 192 tokens, 12 blocks of 16)
SMOKE_CONFIG = dict(CONFIGS["wan"][1], num_attention_heads=2, attention_head_dim=64, text_dim=32, freq_dim=32,
                    ffn_dim=64, num_layers=2)
SMOKE_LATENT, SMOKE_TEXT = (16, 3, 16, 16), 8
# Qwen-Image's text is the prompt's own length (not padded): a prompt of a few sentences
QWEN_IMAGE_TEXT = 128
MODES = [("dense", None, None, None), ("paro d=0.5 bf16", 0.5, "bf16", "bf16"), ("paro d=0.2 bf16", 0.2, "bf16", "bf16"),
         ("paro d=0.5 int8+fp8", 0.5, "int8", "fp8"), ("paro d=0.2 int8+fp8", 0.2, "int8", "fp8")]
# real tokens of HunyuanVideo's 256 text tokens (the rest is padding): a prompt of a few sentences
HUNYUAN_REAL_TEXT = 96
# distinct synthetic masks per plan, cycled over layers (timing does not depend on which mask a layer has)
DISTINCT_MASKS = 6


def build_transformer(name: str, device, dtype, smoke: bool):
    """The transformer of `name` with random weights (`smoke`: the shrunk Wan of SMOKE_CONFIG, whatever `name`)."""
    import diffusers

    cls_name, config = ("WanTransformer3DModel", SMOKE_CONFIG) if smoke else CONFIGS[name]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(diffusers, cls_name)(**config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # keep activations finite through 40+ random layers
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def step_inputs(name: str, transformer, device, dtype, smoke: bool, text_tokens: int = HUNYUAN_REAL_TEXT) -> dict:
    """The keyword arguments of one step of `name` (`smoke`: of the shrunk Wan)."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    if name == "cogvideox":
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        cos, sin = get_3d_rotary_pos_embed(embed_dim=64, crops_coords=((0, 0), (30, 45)), grid_size=(30, 45),
                                           temporal_size=13, device=device)
        return {"hidden_states": rand(2, 13, 16, 60, 90), "encoder_hidden_states": rand(2, 226, 4096),
                "timestep": torch.full((2,), 900, device=device, dtype=torch.long),
                "image_rotary_emb": (cos.to(dtype), sin.to(dtype)), "return_dict": False}
    if smoke or name == "wan":
        latent, text = (SMOKE_LATENT, SMOKE_TEXT) if smoke else ((16, 21, 60, 104), 512)
        return {"hidden_states": rand(1, *latent), "encoder_hidden_states": rand(1, text, transformer.config.text_dim),
                "timestep": torch.full((1,), 900.0, device=device), "return_dict": False}
    if name in ("wan2.2-a14b", "wan-14b-720p"):  # 81 frames of 720 x 1280: 21 x 45 x 80 tokens
        return {"hidden_states": rand(1, 16, 21, 90, 160), "encoder_hidden_states": rand(1, 512, 4096),
                "timestep": torch.full((1,), 900.0, device=device), "return_dict": False}
    if name == "wan2.2-ti2v":  # the pipeline's expand_timesteps: one timestep per token
        return {"hidden_states": rand(1, 48, 31, 44, 80), "encoder_hidden_states": rand(1, 512, 4096),
                "timestep": torch.full((1, 31 * 22 * 40), 900.0, device=device), "return_dict": False}
    if name == "hunyuan":
        return {"hidden_states": rand(1, 16, 33, 90, 160), "encoder_hidden_states": rand(1, 256, 4096),
                "encoder_attention_mask": (torch.arange(256, device=device) < text_tokens).long()[None],
                "pooled_projections": rand(1, 768), "timestep": torch.full((1,), 900.0, device=device, dtype=dtype),
                "guidance": torch.full((1,), 6000.0, device=device, dtype=dtype), "return_dict": False}
    if name == "skyreels-v2-720p":  # 121 frames of 720 x 1280: 31 x 45 x 80 tokens
        return {"hidden_states": rand(1, 16, 31, 90, 160), "encoder_hidden_states": rand(1, 512, 4096),
                "timestep": torch.full((1,), 900.0, device=device), "return_dict": False}
    if name == "wan-vace-14b":  # the pipeline's default, 81 frames of 480 x 832: 21 x 30 x 52 tokens
        return {"hidden_states": rand(1, 16, 21, 60, 104), "control_hidden_states": rand(1, 96, 21, 60, 104),
                "encoder_hidden_states": rand(1, 512, 4096), "timestep": torch.full((1,), 900.0, device=device),
                "return_dict": False}
    if name == "hunyuanvideo-1.5-720p":
        # 121 frames of 720 x 1280 (VAE 16 in space, 4 in time): 31 x 45 x 80 tokens, then 1000 MLLM + 256 ByT5 +
        # 729 vision tokens, of which a prompt fills QWEN_IMAGE_TEXT and 16 (text-to-video: no vision tokens)
        mask = (torch.arange(1000, device=device) < QWEN_IMAGE_TEXT).long()[None]
        mask_2 = (torch.arange(256, device=device) < 16).long()[None]
        # its time embedding does not cast the timestep: it comes in the weights' dtype, as the pipeline passes it
        return {"hidden_states": rand(1, 65, 31, 45, 80), "timestep": torch.full((1,), 900.0, device=device,
                                                                                 dtype=dtype),
                "encoder_hidden_states": rand(1, 1000, 3584), "encoder_attention_mask": mask,
                "encoder_hidden_states_2": rand(1, 256, 1472), "encoder_attention_mask_2": mask_2,
                "image_embeds": torch.zeros(1, 729, 1152, device=device, dtype=dtype), "return_dict": False}
    if name == "ltx-video":  # the pipeline's 161 frames of 512 x 704 (VAE 8 in time, 32 in space): 21 x 16 x 22
        return {"hidden_states": rand(1, 21 * 16 * 22, 128), "encoder_hidden_states": rand(1, 128, 4096),
                "encoder_attention_mask": torch.ones(1, 128, device=device), "timestep": torch.full(
                    (1,), 900.0, device=device), "num_frames": 21, "height": 16, "width": 22,
                "rope_interpolation_scale": (8 / 25, 32, 32), "return_dict": False}
    if name == "ltx-2":  # the pipeline's 121 frames of 512 x 768: 16 x 16 x 24 video tokens, 126 audio frames
        return {"hidden_states": rand(1, 16 * 16 * 24, 128), "audio_hidden_states": rand(1, 126, 128),
                "encoder_hidden_states": rand(1, 1024, 3840), "audio_encoder_hidden_states": rand(1, 1024, 3840),
                "encoder_attention_mask": torch.ones(1, 1024, device=device),
                "audio_encoder_attention_mask": torch.ones(1, 1024, device=device),
                "timestep": torch.full((1,), 900.0, device=device), "num_frames": 16, "height": 16, "width": 24,
                "audio_num_frames": 126, "return_dict": False}
    if name.startswith("qwen-image"):  # 1024 (2048) pixels: 64 x 64 (128 x 128) tokens of 2 x 2 latents
        side = 128 if name.endswith("2048") else 64
        return {"hidden_states": rand(1, side * side, 64), "encoder_hidden_states": rand(1, QWEN_IMAGE_TEXT, 3584),
                "timestep": torch.full((1,), 0.9, device=device), "img_shapes": [[(1, side, side)]],
                "return_dict": False}
    if name.startswith("flux2"):
        side = 128 if name.endswith("2048") else 64
        img_ids = torch.cartesian_prod(*(torch.arange(n, device=device) for n in (1, side, side, 1)))
        txt_ids = torch.cartesian_prod(*(torch.arange(n, device=device) for n in (1, 1, 1, 512)))
        return {"hidden_states": rand(1, side * side, 128), "encoder_hidden_states": rand(1, 512, 15360),
                "timestep": torch.full((1,), 0.9, device=device), "guidance": torch.full((1,), 4.0, device=device),
                "img_ids": img_ids[None], "txt_ids": txt_ids[None], "return_dict": False}
    if name != "flux":
        raise ValueError(f"no step inputs for model {name!r}: expected one of {', '.join(CONFIGS)}")
    img_ids = torch.zeros(64, 64, 3, device=device)
    img_ids[..., 1] = torch.arange(64, device=device)[:, None]
    img_ids[..., 2] = torch.arange(64, device=device)[None, :]
    return {"hidden_states": rand(1, 4096, 64), "encoder_hidden_states": rand(1, 512, 4096),
            "pooled_projections": rand(1, 768), "timestep": torch.full((1,), 0.9, device=device),
            "guidance": torch.full((1,), 3.5, device=device), "img_ids": img_ids.reshape(-1, 3),
            "txt_ids": torch.zeros(512, 3, device=device), "return_dict": False}


def synthetic_plan(transformer, layout: TokenLayout, density: float, qk: str, pv: str, block: int, seed=0,
                   query_block: int | None = None) -> Plan:
    layers = len(self_attention_layers(transformer))
    heads = transformer.config.num_attention_heads
    query_block = query_block or block
    nq, nk = -(-layout.seq_len // query_block), -(-layout.seq_len // block)
    g = torch.Generator().manual_seed(seed)
    distinct = [synthetic_block_mask(heads, nq, nk, density, generator=g) for _ in range(min(DISTINCT_MASKS, layers))]
    masks = torch.stack([distinct[layer % len(distinct)] for layer in range(layers)])[None]
    return Plan(
        model_class=type(transformer).__name__, model_fingerprint=model_fingerprint(transformer.config), layout=layout,
        block_size=(query_block, block), orders=torch.randint(0, 6, (layers, heads), generator=g), block_mask=masks,
        bucket_edges=[1000.0, 0.0], qk=qk, pv=pv, target_density=density,
    )


def inputs_dtype(inputs: dict) -> torch.dtype:
    return inputs["hidden_states"].dtype


def _timed(run, iters: int, device) -> list[float]:
    """Seconds of each of `iters` calls of `run()` after one warm-up call (compiles and autotunes)."""
    times = []
    with torch.no_grad():
        for i in range(iters + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - start)
    return times


def time_step(transformer, inputs, iters: int, device) -> tuple[float, list[float]]:
    """Median seconds of one forward after one warm-up forward (compiles and autotunes)."""
    times = _timed(lambda: transformer(**inputs), iters, device)
    return statistics.median(times), times


def attention_seconds(transformer, layout: TokenLayout, batch: int, device, dtype, iters: int = 5) -> float:
    """Seconds of the dense self-attention of one step: one SDPA call on q, k, v [B, H, N, D] of the layout's
    length, times the self-attention layers (projections, norms and cross-attention not included)."""
    import torch.nn.functional as F

    heads = transformer.config.num_attention_heads
    q, k, v = (torch.randn(batch, heads, layout.seq_len, transformer.config.attention_head_dim, device=device,
                           dtype=dtype) for _ in range(3))
    times = _timed(lambda: F.scaled_dot_product_attention(q, k, v), iters, device)
    return statistics.median(times) * len(self_attention_layers(transformer))


def bench_model(name: str, args, device, dtype) -> list[dict]:
    rows = []
    t0 = time.perf_counter()
    transformer = build_transformer(name, device, dtype, args.smoke)
    inputs = step_inputs(name, transformer, device, dtype, args.smoke, args.text_tokens)
    layout = family_of(transformer).call_inputs(transformer, inputs).layout
    block = 16 if args.smoke else 64
    print(f"[{LABELS[name]}] built in {time.perf_counter() - t0:.1f} s, layout {layout} ({layout.seq_len} tokens)", flush=True)
    backend = "torch" if device.type == "cpu" else "auto"
    dense_s = None
    plans_by_density: dict[float, Plan] = {}
    named = args.modes or []

    def position(mode):  # dense first (the speedups are over it), then as --modes names them: a cut run has those
        return -1 if mode[0] == "dense" else named.index(mode[0]) if mode[0] in named else len(MODES)

    for label, density, qk, pv in sorted(MODES, key=position):
        if args.modes and label not in args.modes:
            continue
        runs = [("resident", True, True)]
        if density == 0.2 and args.no_model_rope:
            runs = [("resident", True, True), ("streamed", False, True)]
        elif density == 0.2 and not args.resident_only:
            # prefetch overhead: the same plan with masks streamed per layer; what the op's RoPE pass
            # buys: the same plan with the model's own RoPE code applied first (fuse_rope=False)
            runs = [("resident", True, True), ("streamed", False, True), ("model-rope", True, False)]
        for how, resident, fuse_rope in runs:
          try:
            handle = None
            if density is not None:
                if density not in plans_by_density:  # one plan per density (building and checking it is slow at
                    # full size): the modes differ only in qk and pv, which the copy sets (valid MODES entries)
                    plans_by_density[density] = synthetic_plan(transformer, layout, density, "bf16", "bf16", block,
                                                               query_block=args.query_block)
                plan = copy.copy(plans_by_density[density])
                plan.qk, plan.pv = qk, pv
                handle = apply(transformer, plan, backend=backend, resident=resident, fuse_rope=fuse_rope)
                handle.processor.prepare(handle.binding, device)
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            seconds, times = time_step(transformer, inputs, args.iters, device)
            row = {"model": LABELS[name], "mode": label, "masks": how if density else "-", "step_s": seconds,
                   "times_s": times, "tokens": layout.seq_len, "batch": int(next(iter(inputs.values())).shape[0])}
            if device.type == "cuda":
                row["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if handle is not None:
                stats = handle.stats()
                row.update({"mask_gpu_mib": stats.get("gpu_bytes", 0) / 2**20,
                            "mask_host_mib": stats.get("host_bytes", 0) / 2**20,
                            "prefetch_hits": stats.get("prefetch_hits"), "prefetch_misses": stats.get("prefetch_misses"),
                            "density": plan.achieved_density()})
                handle.remove()
            if density is None:
                dense_s = seconds
                row["attention_s"] = attention_seconds(transformer, layout, row["batch"], device, inputs_dtype(inputs))
                row["attention_share"] = row["attention_s"] / seconds
            row["speedup"] = dense_s / seconds if dense_s is not None else float("nan")  # dense not run
            rows.append(row)
            if args.json:  # each row as it comes: a run cut short keeps what it measured
                args.json.write_text(json.dumps({"info": args.info, "rows": args.rows_before + rows}, indent=1))
            print(f"  {label:22s} {row['masks']:9s} {seconds * 1000:9.1f} ms  x{row['speedup']:.2f}"
                  + (f"  attention {row['attention_share'] * 100:.0f}% of the step" if "attention_share" in row else "")
                  + (f"  peak {row['peak_gpu_gib']:.1f} GiB" if "peak_gpu_gib" in row else "")
                  + (f"  masks on GPU {row['mask_gpu_mib']:.1f} MiB" if "mask_gpu_mib" in row else ""), flush=True)
          except Exception as exc:  # a kernel mode that fails must not hide the others
            print(f"  {label:22s} {how:9s} FAILED: {str(exc).splitlines()[0][:200]}", flush=True)
            rows.append({"model": LABELS[name], "mode": label, "masks": how, "step_s": float("nan"),
                         "speedup": float("nan"), "error": str(exc)[:2000]})
            if handle is not None:
                handle.remove()
    for label in ("paro d=0.2 bf16", "paro d=0.2 int8+fp8"):
        pair = {r["masks"]: r for r in rows if r["mode"] == label and r["step_s"] == r["step_s"]}
        if "streamed" in pair and "resident" in pair:
            overhead = (pair["streamed"]["step_s"] - pair["resident"]["step_s"]) / pair["resident"]["step_s"]
            pair["streamed"]["prefetch_overhead"] = overhead
            print(f"  prefetch overhead ({label}, streamed vs resident): {overhead * 100:+.2f}% of a step", flush=True)
        if "model-rope" in pair and "resident" in pair:
            saved = pair["model-rope"]["step_s"] - pair["resident"]["step_s"]
            pair["resident"]["fused_rope_saves_s"] = saved
            print(f"  the op's RoPE pass ({label}) saves {saved * 1000:.1f} ms per step over the model's own", flush=True)
    del transformer, inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


COMPILE_SETTINGS = {"default": {}, "fullgraph": {"fullgraph": True},
                    "reduce-overhead": {"fullgraph": True, "mode": "reduce-overhead"},
                    "regional": {"fullgraph": True}}  # each repeated block on its own (`paroattn.app.generate.compiled`)


def time_first_and_steps(fn, inputs, iters: int, device, untimed: int = 0) -> tuple[float, float, list[float],
                                                                                      torch.Tensor]:
    """Seconds of the first call (compiles where fn is compiled), median seconds of the `iters` calls that
    follow it after `untimed` more, their times, and the last call's output (a copy: CUDA-graph outputs are
    overwritten by the next replay). With mode="reduce-overhead" the second call records the CUDA graphs:
    `untimed=1` keeps it out of the median."""
    times = []
    with torch.no_grad():
        for _ in range(1 + untimed + iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(**inputs)[0]
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            out = out.clone()
    steps = times[1 + untimed:]
    return times[0], statistics.median(steps), steps, out


LINEAR = " + fp8 linear"  # the label suffix of a mode whose transformer blocks' linear layers run in fp8
# kernel names of one profiled step: attention (dense: SDPA's flash, cuDNN or memory-efficient kernels; PARO: the
# op's prologue, RoPE pass and attention kernels; Wan's cross-attention is SDPA in both), then matrix multiplies
# (cuBLAS, CUTLASS, torch._scaled_mm, inductor's matmul templates), then everything else (norms, modulation, RoPE,
# casts, the activations' fp8 quantization)
ATTENTION_KERNELS = re.compile(r"attention|attn|flash|fmha|sdpa|_kv_prologue|_rotate_kernel|_warp_specialized",
                               re.IGNORECASE)
MATMUL_KERNELS = re.compile(r"gemm|nvjet|xmma|cutlass|scaled_mm|matmul|wgmma|splitk|triton_tem_|addmm|bmm",
                            re.IGNORECASE)
# inductor's fused pointwise and reduction kernels: their names list every op of the fused group, also the matmul
# or attention their output feeds (the activations' fp8 quantization is `triton_red_fused__scaled_mm_..._amax_...`,
# a norm before PARO's op `..._block_sparse_attention_...`), so the name's ops say nothing of the kernel's class
INDUCTOR_FUSED = re.compile(r"^triton_(poi|red|per)_fused")


def kernel_class(name: str) -> str:
    """"attention", "matmul" or "other" for a GPU kernel's name."""
    if INDUCTOR_FUSED.match(name):
        return "other"
    if ATTENTION_KERNELS.search(name):
        return "attention"
    return "matmul" if MATMUL_KERNELS.search(name) else "other"


def kernel_seconds(fn, inputs) -> tuple[float, dict[str, float]]:
    """One profiled call `fn(**inputs)` under no_grad (CUDA activity only): its wall seconds, and the GPU seconds
    of each kernel that ran, by name."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(**inputs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        seconds = getattr(event, "self_device_time_total", 0.0) / 1e6
        if seconds > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + seconds
    return wall, kernels


def profiled_split(fn, inputs, top: int = 25) -> dict:
    """One profiled step of `fn` (`kernel_seconds`): its wall time, the GPU time of attention, matrix-multiply
    and other kernels (`kernel_class`), and the `top` kernels by GPU time with their class, so the split can be
    checked by name."""
    wall, kernels = kernel_seconds(fn, inputs)
    split = {"profiled_wall_s": wall, "attention_s": 0.0, "matmul_s": 0.0, "other_s": 0.0}
    for kernel, seconds in kernels.items():
        split[kernel_class(kernel) + "_s"] += seconds
    split["idle_s"] = wall - split["attention_s"] - split["matmul_s"] - split["other_s"]
    split["top_kernels"] = [(kernel[:160], seconds, kernel_class(kernel))
                            for kernel, seconds in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]]
    return split


def split_of(row: dict) -> dict[str, float]:
    """A profiled row's GPU seconds per class (attention, matmul, other, idle), its top kernels classed by the current
    `kernel_class`: rows stored under an earlier classifier are read the same way (kernels past the top few keep
    their stored class; each is shorter than the last of the top)."""
    split = {key: row[key + "_s"] for key in ("attention", "matmul", "other", "idle")}
    for name, seconds, stored in row.get("top_kernels", []):
        now = kernel_class(name)
        if now != stored:
            split[stored] -= seconds
            split[now] += seconds
    return split


def compiled_variants(args) -> list[tuple[str, float | None, bool]]:
    """(label, PARO density or None, fp8 linear layers) of a compiled run, dense first; with --linear each
    mode is followed by itself with fp8 linear layers; --modes keeps the named ones."""
    variants = [("dense", None, False)] + [(f"paro d={d:g} int8+fp8", d, False) for d in args.compile_densities]
    if args.linear:
        variants = [v for label, density, _ in variants for v in ((label, density, False),
                                                                  (label + LINEAR, density, True))]
    if args.modes:
        unknown = [m for m in args.modes if m not in [v[0] for v in variants]]
        if unknown:
            raise SystemExit(f"--modes {','.join(unknown)}: a compiled run has {', '.join(v[0] for v in variants)}")
        variants = [v for v in variants if v[0] in args.modes]
    return variants


def bench_compiled(name: str, args, device, dtype) -> list[dict]:
    """Dense and PARO (and, with --linear, each again with fp8 linear layers), eager (unless --no-eager) and
    compiled with each of args.compile, one model, one run; --profile adds one profiled step per row."""
    variants = compiled_variants(args)
    transformer = build_transformer(name, device, dtype, args.smoke)
    inputs = step_inputs(name, transformer, device, dtype, args.smoke, args.text_tokens)
    layout = family_of(transformer).call_inputs(transformer, inputs).layout
    block = 16 if args.smoke else 64
    backend = "torch" if device.type == "cpu" else "auto"
    settings = [s.strip() for s in args.compile.split(",")]
    batch = int(next(iter(inputs.values())).shape[0])
    rows, dense = [], {}
    nan = float("nan")

    def run(label, density, linear, compile_setting, fn, reference=None):
        first, seconds, times, out = time_first_and_steps(fn, inputs, args.iters, device,
                                                          untimed=int(compile_setting == "reduce-overhead"))
        row = {"model": LABELS[name], "mode": label, "masks": "resident" if density else "-",
               "linear": args.linear if linear else "bf16", "compile": compile_setting, "first_call_s": first,
               "step_s": seconds, "times_s": times, "tokens": layout.seq_len, "batch": batch}
        if label == "dense":
            dense[compile_setting] = seconds
        row["speedup"] = dense.get(compile_setting, nan) / seconds  # over dense bf16 in this run, if it ran
        row["speedup_vs_eager_dense"] = dense.get("eager", nan) / seconds
        if reference is not None:
            row["max_error_vs_eager"] = float((out.float() - reference.float()).abs().max()
                                              / reference.float().abs().max())
        if args.profile and device.type == "cuda":
            row.update(profiled_split(fn, inputs))
        rows.append(row)
        if args.json:  # each row as it comes: a run cut short keeps what it measured
            args.json.write_text(json.dumps({"info": args.info, "rows": args.rows_before + rows}, indent=1))
        print(f"  {label:36s} {compile_setting:15s} first {first:7.1f} s  step {seconds * 1000:9.1f} ms  "
              f"x{row['speedup']:.2f} (vs eager dense x{row['speedup_vs_eager_dense']:.2f})"
              + (f"  max error vs eager {row['max_error_vs_eager']:.1e}" if reference is not None else "")
              + (f"  attention {row['attention_s'] * 1000:.0f} ms, matmuls {row['matmul_s'] * 1000:.0f} ms, other "
                 f"{row['other_s'] * 1000:.0f} ms" if "attention_s" in row else ""), flush=True)
        return out

    def compiled_rows(label, density, linear, reference=None):
        for setting in settings:
            torch._dynamo.reset()
            try:
                if setting == "regional":  # as `paro generate --compile blocks` does it, undone after
                    with compiled(transformer, "blocks"):
                        run(label, density, linear, setting, transformer, reference)
                else:
                    run(label, density, linear, setting, torch.compile(transformer, **COMPILE_SETTINGS[setting]),
                        reference)
            except Exception as exc:  # one setting that fails must not hide the others
                print(f"  {label:36s} {setting:15s} FAILED: {str(exc).splitlines()[0][:200]}", flush=True)
                rows.append({"model": LABELS[name], "mode": label, "compile": setting, "step_s": nan,
                             "speedup": nan, "error": str(exc)[:2000]})
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    print(f"[{LABELS[name]}] layout {layout} ({layout.seq_len} tokens), compiled: {settings}, modes: "
          f"{[v[0] for v in variants]}", flush=True)
    plans = {}
    for label, density, linear in variants:
        handle = None
        try:
            if density is not None and density not in plans:
                plans[density] = synthetic_plan(transformer, layout, density, "int8", "fp8", block,
                                                query_block=args.query_block)
            if density is not None or linear:
                handle = apply(transformer, plans.get(density), backend=backend, resident=True,
                               linear=args.linear if linear else None)
                if handle.processor is not None:
                    handle.processor.prepare(handle.binding, device)
            # compiled against eager of the same mode: at full size, random weights, compiled dense differs from
            # eager dense as much as PARO's compiled run from its eager one (the model amplifies inductor's
            # rounding of its fused ops)
            eager = None if args.no_eager else run(label, density, linear, "eager", transformer)
            compiled_rows(label, density, linear, reference=eager)
        except Exception as exc:  # a mode that cannot be set up must not hide the others
            print(f"  {label:36s} FAILED: {str(exc).splitlines()[0][:200]}", flush=True)
            rows.append({"model": LABELS[name], "mode": label, "compile": "-", "step_s": nan, "speedup": nan,
                         "error": str(exc)[:2000]})
        finally:
            if handle is not None:
                handle.remove()
    return rows  # the model and its inputs are freed with this frame and its closures


LINEAR_COLUMNS = ("dense", "dense" + LINEAR, "paro d=0.2 int8+fp8", "paro d=0.2 int8+fp8" + LINEAR)


def linear_table(results: dict) -> str:
    """The fp8-linear step table: per model and compile setting, the step of dense bf16, dense + fp8 linear,
    PARO d=0.2 int8+fp8 and PARO + fp8 linear, each with its speedup over dense bf16 (same setting); then each
    row's profiled split of the step into attention, matrix multiplies, other kernels and idle GPU time."""
    info, rows = results["info"], [r for r in results["rows"] if r.get("step_s") == r.get("step_s")]
    out = [", ".join([info["device"]] + [f"{k} {info[k]}" for k in ("driver", "torch", "triton", "torchao", "commit")
                                         if info.get(k)] + [info["date"]]), "",
           "| model (tokens) | how | " + " | ".join(c.replace("paro ", "PARO ") for c in LINEAR_COLUMNS) + " |",
           "|---|---|" + "---|" * len(LINEAR_COLUMNS)]
    split = ["", "| model | mode | how | step | attention | matrix multiplies | other kernels | GPU idle |",
             "|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for how in dict.fromkeys(r["compile"] for r in rows if r["model"] == model):
            found = {c: next((r for r in rows if r["model"] == model and r["mode"] == c and r["compile"] == how),
                             None) for c in LINEAR_COLUMNS}
            if not any(found.values()):
                continue
            base = found["dense"]
            tokens = next(r["tokens"] for r in found.values() if r)

            def cell(r):
                if r is None:
                    return "not run"
                ratio = f", {base['step_s'] / r['step_s']:.2f}x" if base is not None else ""
                return f"{r['step_s'] * 1000:.0f} ms{ratio}"

            out.append(f"| {model} ({tokens}) | {how} | " + " | ".join(cell(found[c]) for c in LINEAR_COLUMNS) + " |")
            for mode, r in found.items():
                if r is not None and "attention_s" in r:
                    wall, seconds = r["profiled_wall_s"], split_of(r)
                    split.append(f"| {model} | {mode} | {how} | {wall * 1000:.0f} ms | " + " | ".join(
                        f"{seconds[key] * 1000:.0f} ms ({seconds[key] / wall:.0%})"
                        for key in ("attention", "matmul", "other", "idle")) + " |")
    return "\n".join(out + (split if len(split) > 3 else []))


def compiled_table(results: dict) -> str:
    """Step times eager and compiled, dense and PARO, with the compile (first call) times."""
    info, rows = results["info"], [r for r in results["rows"] if r.get("step_s") == r.get("step_s")]
    settings = list(dict.fromkeys(r["compile"] for r in rows if r.get("compile") not in (None, "eager")))
    out = [", ".join([info["device"]] + [f"{k} {info[k]}" for k in ("driver", "torch", "triton", "commit")
                                         if info.get(k)] + [info["date"]]), "",
           "| model (tokens, batch) | PARO mode | how | dense step | PARO step | PARO vs dense (same how) | "
           "PARO vs eager dense | first call dense / PARO | max error vs eager, dense / PARO |",
           "|---|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows if r["model"] == model and r["mode"] != "dense"):
            for how in ["eager", *settings]:
                d = next((r for r in rows if r["model"] == model and r["mode"] == "dense" and r["compile"] == how), None)
                p = next((r for r in rows if r["model"] == model and r["mode"] == mode and r["compile"] == how), None)
                if d is None or p is None:
                    continue
                first = "" if how == "eager" else f"{d['first_call_s']:.0f} s / {p['first_call_s']:.0f} s"
                error = " / ".join(f"{r['max_error_vs_eager']:.1e}" if "max_error_vs_eager" in r else "-" for r in (d, p))
                error = "" if how == "eager" else error
                out.append(f"| {model} ({d['tokens']}, {d['batch']}) | {mode.replace('paro ', '')} | {how} | "
                           f"{d['step_s'] * 1000:.1f} ms | {p['step_s'] * 1000:.1f} ms | {p['speedup']:.2f}x | "
                           f"{p['speedup_vs_eager_dense']:.2f}x | {first} | {error} |")
    return "\n".join(out)


TABLE_MODES = ["paro d=0.5 bf16", "paro d=0.2 bf16", "paro d=0.5 int8+fp8", "paro d=0.2 int8+fp8"]


def markdown_tables(results: dict) -> str:
    """The step table (dense, each PARO mode with its masks resident, and d=0.2 int8+fp8 with the
    model's own RoPE) and the masks table (GPU memory resident vs streamed, prefetch overhead)."""
    info, rows = results["info"], [r for r in results["rows"] if r.get("step_s") == r.get("step_s")]
    env = [info["device"]] + ([f"driver {info['driver']}"] if info.get("driver") else [])
    env += [f"torch {info['torch']}"] + ([f"triton {info['triton']}"] if info.get("triton") else [])
    env += ([f"commit {info['commit']}"] if info.get("commit") else []) + [info["date"]]
    if info.get("block"):
        env.append(f"plans of {info['block'][0]} x {info['block'][1]} blocks")
    models = list(dict.fromkeys(r["model"] for r in rows))

    def find(model, mode, masks):
        return next((r for r in rows if r["model"] == model and r["mode"] == mode and r["masks"] == masks), None)

    def cell(r):
        return f"{r['step_s'] * 1000:.1f} ms, {r['speedup']:.2f}x" if r else ""

    # the PARO columns some model of the file has (a run of a few --modes gets a narrower table)
    columns = [(mode.replace("paro ", ""), mode, "resident") for mode in TABLE_MODES]
    columns.append(("d=0.2 int8+fp8, model's RoPE", "paro d=0.2 int8+fp8", "model-rope"))
    columns = [c for c in columns if any(find(model, c[1], c[2]) for model in models)]
    out = [", ".join(env), "", "| model (tokens, batch) | dense | " + " | ".join(c[0] for c in columns) + " |",
           "|---" * (len(columns) + 2) + "|"]
    for model in models:
        dense = find(model, "dense", "-")
        if dense is None:
            continue
        cells = [cell(find(model, mode, masks)) for _, mode, masks in columns]
        out.append(f"| {model} ({dense['tokens']}, {dense['batch']}) | {dense['step_s'] * 1000:.1f} ms | "
                   + " | ".join(cells) + " |")
    masks_rows = []
    for model in models:
        resident, streamed = (find(model, "paro d=0.2 int8+fp8", how) for how in ("resident", "streamed"))
        streamed_bf16, dense = find(model, "paro d=0.2 bf16", "streamed"), find(model, "dense", "-")
        if not (resident and streamed and dense):
            continue

        def overhead(r):
            return f"{r['prefetch_overhead'] * 100:+.2f}%" if r and "prefetch_overhead" in r else ""

        masks_rows.append(
            f"| {model} | {resident['mask_gpu_mib']:.1f} MiB | {streamed['mask_gpu_mib']:.1f} MiB | "
            f"{overhead(streamed_bf16)} | {overhead(streamed)} | "
            f"{dense.get('peak_gpu_gib', float('nan')):.1f} / {resident.get('peak_gpu_gib', float('nan')):.1f} GiB |")
    if masks_rows:  # runs with streamed masks (not --resident-only)
        out += ["", "| model, d=0.2 | masks on the GPU, resident | streamed (3 slots) | step, streamed vs resident: "
                "bf16 | int8+fp8 | peak GPU memory, dense / d=0.2 int8+fp8 |", "|---|---|---|---|---|---|", *masks_rows]
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cogvideox,wan,flux")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="a shrunk Wan on CPU (torch backend), whatever --models: checks the script")
    parser.add_argument("--query-block", type=int, default=None,
                        help="query block of the synthetic plans (key blocks stay 64; 128: the fast D=128 tiles)")
    parser.add_argument("--modes", type=lambda text: [m.strip() for m in text.split(",")], default=None,
                        help=f"comma-separated subset of the modes, run in this order (dense first): "
                             f"{', '.join(m[0] for m in MODES)}")
    parser.add_argument("--text-tokens", type=int, default=HUNYUAN_REAL_TEXT,
                        help="hunyuan: real text tokens of the 256, the rest padding (256: none padded)")
    parser.add_argument("--resident-only", action="store_true",
                        help="skip the d=0.2 runs with streamed masks and with the model's own RoPE")
    parser.add_argument("--no-model-rope", action="store_true",
                        help="skip the d=0.2 run with the model's own RoPE (keep resident and streamed masks)")
    parser.add_argument("--compile", default=None, metavar="SETTINGS",
                        help=f"compiled rows instead: comma-separated of {', '.join(COMPILE_SETTINGS)}")
    parser.add_argument("--compile-densities", default="0.2", type=lambda s: [float(d) for d in s.split(",")],
                        help="PARO densities of the compiled rows (int8 QK + fp8 PV)")
    parser.add_argument("--linear", choices=["fp8"], default=None,
                        help="compiled rows: each mode also with the blocks' linear layers in fp8 (torchao)")
    parser.add_argument("--no-eager", action="store_true",
                        help="compiled rows: skip the eager run of each mode (no compiled-vs-eager error then)")
    parser.add_argument("--profile", action="store_true",
                        help="compiled rows: one profiled step per row, split into attention, matrix multiplies, "
                             "other kernels and idle GPU time")
    parser.add_argument("--table", metavar="JSON", nargs="+", type=Path,
                        help="print markdown tables of results files and exit (reads JSON only: no GPU)")
    parser.add_argument("--merge", action="store_true",
                        help="with --table: one table of the rows of every file (runs of one machine split by mode)")
    args = parser.parse_args(argv)
    if args.table:
        loaded = [(path, json.loads(path.read_text())) for path in args.table]
        if args.merge:
            devices = {results["info"]["device"] for _, results in loaded}
            if len(devices) > 1:
                raise SystemExit(f"--merge: the files were measured on different GPUs ({', '.join(sorted(devices))}); "
                                 "merge only runs of one machine")
            merged = {"info": loaded[0][1]["info"], "rows": [r for _, results in loaded for r in results["rows"]]}
            loaded = [(Path(" + ".join(path.name for path, _ in loaded)), merged)]
        for path, results in loaded:
            if any(r.get("linear") for r in results["rows"]):
                table = linear_table
            else:
                table = compiled_table if any(r.get("compile") for r in results["rows"]) else markdown_tables
            print(f"`{path.name}`: " + table(results) + "\n")
        return None
    if args.linear and not args.compile:
        raise SystemExit("--linear adds compiled rows: pass --compile SETTINGS too (e.g. --compile fullgraph)")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("the end-to-end benchmark needs a CUDA GPU (or --smoke for a CPU check of the script)")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.models = "wan"  # the shrunk Wan is the one model a smoke run builds
        LABELS["wan"] = "shrunk Wan (smoke)"
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}
    key_block = 16 if args.smoke else 64  # bench_model's block
    info["block"] = [args.query_block or key_block, key_block]
    if device.type == "cuda":
        info.update(environment())
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if args.linear:
        from paroattn.linear import linear_problem

        if problem := linear_problem(args.linear, device):
            raise SystemExit(problem)
        import torchao

        info["torchao"] = torchao.__version__
    if "hunyuan" in args.models and not args.smoke:
        info["hunyuan_text_tokens"] = f"{args.text_tokens} of 256 real"
        LABELS["hunyuan"] = f"HunyuanVideo 720p, text {args.text_tokens}/256"
    print(info, flush=True)
    rows = []
    for name in args.models.split(","):
        try:
            args.info, args.rows_before = info, rows
            rows += (bench_compiled if args.compile else bench_model)(name.strip(), args, device, dtype)
        except Exception as exc:  # keep the other models' numbers; say what broke
            import traceback

            traceback.print_exc()
            rows.append({"model": LABELS.get(name, name), "mode": "error", "masks": "-", "step_s": float("nan"),
                         "speedup": float("nan"), "error": repr(exc)})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    if args.compile:
        print("\n" + (linear_table if args.linear else compiled_table)({"info": info, "rows": rows}))
        return rows
    print("\nmodel          mode                    masks      step ms   speedup  peak GiB  masks GPU MiB")
    for r in rows:
        print(f"{r['model']:14s} {r['mode']:22s}  {r['masks']:9s} {r['step_s'] * 1000:8.1f}  {r['speedup']:7.2f}x"
              f"  {r.get('peak_gpu_gib', float('nan')):8.1f}  {r.get('mask_gpu_mib', float('nan')):8.1f}")
    return rows


if __name__ == "__main__":
    main()
