"""The demo model of `paro demo`: a small `WanTransformer3DModel` trained on procedural videos.

It is the real diffusers Wan class (3-D RoPE, RMSNorm across heads, `WanAttnProcessor`), so
`paroattn.apply` meets it exactly as it meets Wan 2.1. It denoises RGB pixels directly (patch
1x2x2, no VAE): 8 frames of 32x32 pixels are 8x16x16 = 2048 tokens. Prompts are embedded by
`WordTextEncoder`, a word-embedding transformer built here, whose output plays the part of Wan's
T5 states. Trained by `scripts/train_demo_model.py`; its weights ship in the package
(`paroattn/demo_model/assets/`).

    pipe = load_demo_pipeline()                       # the shipped weights, CPU, float32
    frames = pipe("red circle moving left quickly, cloudy background").frames  # [B, F, H, W, 3]
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput
from torch import nn

from .data import MAX_WORDS, PAD, VOCABULARY

# weights, configs and plans, installed with the package (package data in pyproject.toml)
ASSETS = Path(__file__).resolve().parent / "assets"

# the shipped model; scripts/train_demo_model.py trains this configuration by default
TRANSFORMER_CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 64,
    "in_channels": 3,
    "out_channels": 3,
    "text_dim": 64,
    "freq_dim": 64,
    "ffn_dim": 768,
    "num_layers": 8,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 64,
}
TEXT_ENCODER_CONFIG = {"dim": 64, "num_layers": 2, "num_heads": 4, "max_words": MAX_WORDS}
VIDEO_SHAPE = {"num_frames": 8, "height": 32, "width": 32}
SCHEDULER_SHIFT = 2.0
DEFAULT_GUIDANCE = 4.0
DEFAULT_STEPS = 20


class WordTextEncoder(ModelMixin, ConfigMixin):
    """Word ids -> [B, max_words, dim] states: learned word and position embeddings and a small
    pre-norm transformer. The vocabulary is part of the config, so a saved encoder tokenizes itself."""

    @register_to_config
    def __init__(self, vocabulary: list[str] | tuple[str, ...] = VOCABULARY, dim: int = 64, num_layers: int = 2,
                 num_heads: int = 4, max_words: int = MAX_WORDS):
        super().__init__()
        vocabulary = list(vocabulary)
        if not vocabulary or vocabulary[0] != PAD:
            raise ValueError(f"vocabulary must start with the padding word {PAD!r}")
        self.words = nn.Embedding(len(vocabulary), dim)
        self.positions = nn.Parameter(torch.zeros(max_words, dim))
        layer = nn.TransformerEncoderLayer(dim, num_heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.words.weight, std=0.5)
        nn.init.normal_(self.positions, std=0.1)
        self._index = {w: i for i, w in enumerate(vocabulary)}

    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        """Word ids [B, max_words] (0 = padding); an empty prompt is all padding (the null prompt)."""
        max_words = self.config.max_words
        ids = torch.zeros(len(prompts), max_words, dtype=torch.long)
        for b, prompt in enumerate(prompts):
            if problem := prompt_problem(prompt, self.config.vocabulary, max_words):
                raise ValueError(problem)
            words = prompt_words(prompt)
            ids[b, : len(words)] = torch.tensor([self._index[w] for w in words], dtype=torch.long)
        return ids

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.words(ids) + self.positions[: ids.shape[1]]
        return self.norm(self.layers(x))


def prompt_words(prompt: str) -> list[str]:
    """The words the text encoder reads from a prompt: lower case, commas as spaces."""
    return prompt.replace(",", " ").lower().split()


def prompt_problem(prompt: str, vocabulary, max_words: int) -> str | None:
    """Why the text encoder cannot read `prompt`, or None: words outside its vocabulary, or too many words."""
    words = prompt_words(prompt)
    known = set(vocabulary) - {PAD}
    if unknown := [w for w in words if w not in known]:
        return (f"prompt {prompt!r} has words the demo model does not know: {unknown}; its vocabulary is "
                f"{[w for w in vocabulary if w != PAD]}")
    if len(words) > max_words:
        return f"prompt {prompt!r} has {len(words)} words; the demo model reads at most {max_words}"
    return None


@dataclass
class DemoPipelineOutput(BaseOutput):
    """frames: [B, F, H, W, 3] in [0, 1] (a tensor for output_type "pt", numpy for "np"); for
    output_type "latent" the denoised tensor [B, 3, F, H, W] in [-1, 1]."""

    frames: torch.Tensor


class DemoVideoPipeline(DiffusionPipeline):
    """Text-to-video sampling of the demo model, the way `WanPipeline` samples Wan 2.1:
    flow matching with `FlowMatchEulerDiscreteScheduler`, the transformer called once for the
    prompt and once for the null prompt at each step (classifier-free guidance), timesteps on the
    0..1000 scale. No VAE: the denoised tensor is the video."""

    model_cpu_offload_seq = "text_encoder->transformer"
    # no VAE: a latent position is a pixel and a latent frame a frame (what paroattn's size messages use)
    vae_scale_factor_spatial = 1
    vae_scale_factor_temporal = 1

    def __init__(self, transformer: WanTransformer3DModel, text_encoder: WordTextEncoder,
                 scheduler: FlowMatchEulerDiscreteScheduler):
        super().__init__()
        self.register_modules(transformer=transformer, text_encoder=text_encoder, scheduler=scheduler)

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> torch.Tensor:
        ids = self.text_encoder.tokenize(prompts).to(self.text_encoder.device)
        return self.text_encoder(ids).to(self.transformer.dtype)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        num_inference_steps: int = DEFAULT_STEPS,
        guidance_scale: float = DEFAULT_GUIDANCE,
        num_frames: int = VIDEO_SHAPE["num_frames"],
        height: int = VIDEO_SHAPE["height"],
        width: int = VIDEO_SHAPE["width"],
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "pt",
        return_dict: bool = True,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ("latents",),
    ):
        if any(k != "latents" for k in callback_on_step_end_tensor_inputs):
            raise ValueError(f"callback_on_step_end_tensor_inputs can only name 'latents', got {callback_on_step_end_tensor_inputs}")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negatives = negative_prompt if negative_prompt is not None else ""
        negatives = [negatives] * len(prompts) if isinstance(negatives, str) else list(negatives)
        if len(negatives) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(negatives)} negative prompts")
        device, dtype = self.transformer.device, self.transformer.dtype
        cond = self.encode_prompt(prompts)
        uncond = self.encode_prompt(negatives) if guidance_scale > 1.0 else None
        shape = (len(prompts), self.transformer.config.in_channels, num_frames, height, width)
        if latents is None:
            # drawn on the generator's device, the CPU without one: a CPU generator gives the same video on every
            # device (a CUDA generator, as calibration makes on a GPU, draws there)
            where = generator.device if generator is not None else torch.device("cpu")
            latents = torch.randn(shape, generator=generator, dtype=torch.float32, device=where)
        latents = latents.to(device=device, dtype=torch.float32)
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        for i, t in enumerate(self.progress_bar(self.scheduler.timesteps)):
            timestep = t.expand(latents.shape[0])
            model_input = latents.to(dtype)
            velocity = self.transformer(hidden_states=model_input, timestep=timestep,
                                        encoder_hidden_states=cond, return_dict=False)[0].float()
            if uncond is not None:
                velocity_uncond = self.transformer(hidden_states=model_input, timestep=timestep,
                                                   encoder_hidden_states=uncond, return_dict=False)[0].float()
                velocity = velocity_uncond + guidance_scale * (velocity - velocity_uncond)
            latents = self.scheduler.step(velocity, t, latents, return_dict=False)[0]
            if callback_on_step_end is not None:
                tensors = {"latents": latents}
                outputs = callback_on_step_end(self, i, t, {k: tensors[k] for k in callback_on_step_end_tensor_inputs})
                latents = outputs.pop("latents", latents)
        if output_type == "latent":
            self.maybe_free_model_hooks()
            return DemoPipelineOutput(frames=latents) if return_dict else (latents,)
        frames = ((latents.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).contiguous()  # [B, F, H, W, 3]
        if output_type == "np":
            frames = frames.cpu().numpy()
        elif output_type != "pt":
            raise ValueError(f"output_type={output_type!r}; expected 'pt', 'np' or 'latent'")
        self.maybe_free_model_hooks()
        if not return_dict:
            return (frames,)
        return DemoPipelineOutput(frames=frames)


def new_demo_modules(transformer_config: dict | None = None, text_encoder_config: dict | None = None):
    """Freshly initialized (transformer, text_encoder, scheduler) of the demo model's configuration."""
    transformer = WanTransformer3DModel(**(transformer_config or TRANSFORMER_CONFIG))
    text_encoder = WordTextEncoder(**(text_encoder_config or TEXT_ENCODER_CONFIG))
    if text_encoder.config.dim != transformer.config.text_dim:
        raise ValueError(
            f"text encoder dim {text_encoder.config.dim} != transformer text_dim {transformer.config.text_dim}"
        )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT)
    return transformer, text_encoder, scheduler


def save_demo_model(directory: str | Path, transformer, text_encoder, scheduler, dtype=torch.float16) -> None:
    """Write the three components in diffusers' folder format: config.json and safetensors weights,
    in `dtype` except the modules the model class keeps in float32 (norms, time embedding, RoPE)
    and the small text encoder, which stay float32."""
    from safetensors.torch import save_file

    directory = Path(directory)
    keep = tuple(getattr(transformer, "_keep_in_fp32_modules", None) or ())
    for name, module, cast in (("transformer", transformer, True), ("text_encoder", text_encoder, False)):
        folder = directory / name
        folder.mkdir(parents=True, exist_ok=True)
        module.save_config(folder)
        state = {}
        for key, value in module.state_dict().items():
            fp32 = not cast or any(part in keep for part in key.split("."))
            state[key] = value.detach().to(torch.float32 if fp32 else dtype).cpu().contiguous()
        save_file(state, str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    scheduler.save_pretrained(directory / "scheduler")


def load_demo_pipeline(directory: str | Path | None = None, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> DemoVideoPipeline:
    """The trained demo pipeline from `directory` (default: the shipped `ASSETS`)."""
    directory = Path(directory) if directory is not None else ASSETS
    if not (directory / "transformer" / "config.json").is_file():
        raise FileNotFoundError(
            f"no demo model in {directory}: expected transformer/, text_encoder/ and scheduler/ "
            "folders as written by scripts/train_demo_model.py"
        )
    transformer = WanTransformer3DModel.from_pretrained(directory / "transformer", torch_dtype=dtype)
    text_encoder = WordTextEncoder.from_pretrained(directory / "text_encoder", torch_dtype=torch.float32)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(directory / "scheduler")
    pipe = DemoVideoPipeline(transformer=transformer.eval(), text_encoder=text_encoder.eval(), scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)
