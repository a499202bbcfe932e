"""FP8 linear layers beside PARO: the matrix multiplies of the transformer blocks in float8, through torchao.

    handle = paroattn.apply(pipe, plan, linear="fp8")   # PARO attention and fp8 linear layers
    handle = paroattn.apply(pipe, None, linear="fp8")   # the model's own attention and fp8 linear layers
    handle.remove()                                     # both undone: the original bf16 weights, bit-exact

A sparse step is mostly linear layers: once attention is cheap, the projections and feed-forward layers of
the blocks are most of what is left. Each chosen `nn.Linear` is quantized with torchao's
`Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`: the weight once, to e4m3 with one scale
per output channel; the activation at every call, to e4m3 with one scale per token; the product in
`torch._scaled_mm` with a bf16 output. Needs `pip install paroattn[fp8]` (torchao >= 0.18) and a CUDA GPU
with FP8 matrix multiplies (sm_89 or newer: Ada, Hopper, Blackwell); it composes with torch.compile
(fullgraph, CUDA graphs), which fuses the activations' quantization into the ops around it.

Which layers run in fp8 (`layer_choice` lists every linear layer with its decision):
- every `nn.Linear` inside the transformer's repeated blocks (its top-level `nn.ModuleList`s: `blocks`,
  `transformer_blocks`, `single_transformer_blocks`, `vace_blocks`, ...): attention projections (self and
  cross), feed-forward layers, single-stream blocks' fused projections. These hold nearly all the FLOPs.
Which stay in bf16, and why:
- layers outside those blocks: patch, time, text, image and guidance embedders (HunyuanVideo's token
  refiner included), the final norm's modulation and the final projection (`proj_out`). They run once per
  step, on few rows or on the text alone, so fp8 saves nothing measurable, and their error would reach
  every token of every block (the embedders) or every output value unsmoothed (the final projection).
- the norms' modulation inside blocks (`AdaLayerNormZero.linear`, `CogVideoXLayerNormZero.linear`,
  Qwen-Image's `img_mod` / `txt_mod`): one row per sample, a matrix-vector product whose time is reading
  the weight, while its error scales, shifts and gates every token of the block.
- LoRA adapters (peft's `lora_A` / `lora_B`): rank-r products, too small to gain; the base layer they wrap
  is quantized.
- layers whose input or output features are not multiples of 16, which `torch._scaled_mm` cannot take.

torchao's `quantize_` replaces a layer's weight by a new fp8 parameter. The original bf16 parameter is kept,
moved to host memory (the GPU then holds the fp8 copy only: half the weight bytes), and `remove()` moves it
back and puts that same parameter object in its layer again. torchao's recommended inductor settings
(`set_inductor_config`) are left alone: they are process-wide and would change every later compile, fp8 or not.
"""

from __future__ import annotations

import re

import torch
from torch import nn

LINEAR_MODES = ("fp8",)
MIN_TORCHAO = (0, 18)
# FP8 matrix multiplies (`torch._scaled_mm`) need Ada (sm_89) or newer
MIN_CAPABILITY = (8, 9)
FP8_MULTIPLE = 16
INSTALL = "pip install paroattn[fp8]"

FP8 = "fp8"
OUTSIDE_BLOCKS = "outside the transformer blocks (embedder, final norm or final projection)"
MODULATION = "a norm's modulation (one row per sample; scales, shifts and gates every token)"
LORA = "a LoRA adapter (its base layer is quantized)"
# a path component naming a modulation layer outside a norm class: Qwen-Image's img_mod / txt_mod
_MODULATION_NAME = re.compile(r"(^|_)mod(ulation)?$", re.IGNORECASE)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def torchao_problem() -> str | None:
    """Why torchao cannot serve fp8 linear layers here (missing, or older than 0.18), or None."""
    try:
        import torchao
    except ImportError:
        return f"linear='fp8' quantizes the linear layers with torchao, which is not installed: {INSTALL}"
    version = getattr(torchao, "__version__", "0")
    if _version_tuple(version) < MIN_TORCHAO:
        return (f"linear='fp8' needs torchao >= {'.'.join(map(str, MIN_TORCHAO))} (its Float8Tensor with per-row "
                f"scales); torchao {version} is installed: {INSTALL} --upgrade")
    return None


def device_problem(device: torch.device | str | None) -> str | None:
    """Why fp8 matrix multiplies cannot run on `device` (None: CUDA when present), or None."""
    device = torch.device(device) if device is not None else None
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda")
    if device is None or device.type != "cuda":
        where = "the CPU" if device is None or device.type == "cpu" else f"device {device}"
        return (f"linear='fp8' runs FP8 matrix multiplies on a CUDA GPU of sm_89 or newer (Ada, Hopper, Blackwell); "
                f"this run is on {where}: run it on such a GPU, or leave linear out")
    if not torch.cuda.is_available():
        return (f"linear='fp8' needs a CUDA GPU of sm_89 or newer and torch sees no CUDA GPU here ({device}): run it "
                "on such a GPU, or leave linear out")
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"linear='fp8' needs FP8 matrix multiplies, which {name} (sm_{capability[0]}{capability[1]}) lacks: "
                f"they need sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]} or newer (L4, L40S, RTX 4090, H100, H200, "
                "B200); leave linear out on this GPU")
    return None


def linear_problem(linear: str | None, device: torch.device | str | None = None) -> str | None:
    """Why `linear` cannot run on `device` (None: CUDA when present), or None: an unknown mode, the CPU or a GPU
    without FP8 matrix multiplies (below sm_89), torchao missing. Needs no model: callers check it before one
    loads."""
    if linear is None:
        return None
    if linear not in LINEAR_MODES:
        return f"linear={linear!r} is not one of {', '.join(LINEAR_MODES)}: pass linear='fp8', or leave it out"
    return device_problem(device) or torchao_problem()


def _is_lora(path: list[str]) -> bool:
    return any(part.startswith("lora_") for part in path)


def _block_lists(transformer: nn.Module) -> set[str]:
    """Names of the top-level module lists: the repeated transformer blocks."""
    return {name for name, child in transformer.named_children() if isinstance(child, nn.ModuleList)}


def layer_choice(transformer: nn.Module) -> dict[str, str]:
    """Every `nn.Linear` of `transformer` -> "fp8", or why it stays in bf16 (see the module's docstring)."""
    blocks = _block_lists(transformer)
    choice = {}
    for name, module in transformer.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        path = name.split(".")
        parent = transformer.get_submodule(".".join(path[:-1])) if len(path) > 1 else transformer
        if _is_lora(path):
            choice[name] = LORA
        elif path[0] not in blocks:
            choice[name] = OUTSIDE_BLOCKS
        elif "norm" in type(parent).__name__.lower() or any(_MODULATION_NAME.search(part) for part in path[2:]):
            choice[name] = MODULATION
        elif module.in_features % FP8_MULTIPLE or module.out_features % FP8_MULTIPLE:
            choice[name] = (f"{module.in_features} -> {module.out_features} features, not multiples of "
                            f"{FP8_MULTIPLE} (torch._scaled_mm needs them)")
        else:
            choice[name] = FP8
    return choice


def fp8_layers(transformer: nn.Module) -> list[str]:
    """Names of the linear layers `linear='fp8'` quantizes."""
    return [name for name, decision in layer_choice(transformer).items() if decision == FP8]


def transformer_problem(transformer: nn.Module, linear: str = "fp8") -> str | None:
    """Why `transformer`'s linear layers cannot be quantized as `linear` asks, or None: the mode, whether any
    layer qualifies or is already quantized, the chosen layers' dtype (bfloat16 only) and device (one CUDA GPU of
    sm_89 or newer), torchao."""
    if linear not in LINEAR_MODES:
        return linear_problem(linear)
    what = type(transformer).__name__
    names = fp8_layers(transformer)
    if not names:
        return (f"{what} has no linear layer that linear='fp8' quantizes (inside its blocks, not a modulation, "
                "features multiples of 16): leave linear out")
    weights = {name: transformer.get_submodule(name).weight for name in names}
    if quantized := [name for name, weight in weights.items() if _is_quantized(weight)]:
        return (f"the linear layers of {what} are already quantized ({quantized[0]} holds a "
                f"{type(weights[quantized[0]]).__name__}): remove that quantization first (the handle of the "
                "earlier apply(linear=...))")
    dtypes = {weight.dtype for weight in weights.values()}
    if dtypes != {torch.bfloat16}:
        found = ", ".join(str(d).replace("torch.", "") for d in sorted(dtypes, key=str))
        stored = (" (layerwise casting stores them so: disable it; fp8 linear layers store fp8 weights themselves)"
                  if any(d.is_floating_point and d.itemsize == 1 for d in dtypes) else "")
        return (f"linear='fp8' quantizes bfloat16 weights (torchao's per-row scales take no other dtype); the linear "
                f"layers of {what} hold {found}{stored}: load the model with torch_dtype=torch.bfloat16")
    devices = sorted({weight.device for weight in weights.values()}, key=str)
    if len(devices) > 1:
        return (f"the linear layers of {what} are spread over {', '.join(map(str, devices))}: move the transformer "
                "to one GPU before apply(linear='fp8')")
    return _placement_problem(what, devices[0]) or torchao_problem()


def _placement_problem(what: str, device: torch.device) -> str | None:
    """Why weights on `device` cannot run fp8 matrix multiplies, or None."""
    if device.type != "cuda":
        return (f"linear='fp8' runs FP8 matrix multiplies on a CUDA GPU of sm_89 or newer and the weights of {what} "
                f"are on {device}: move the pipeline to such a GPU first (pipe.to('cuda'); model CPU offload is not "
                "supported with fp8 linear layers), or leave linear out")
    return device_problem(device)


def _is_quantized(weight: torch.Tensor) -> bool:
    """A weight some quantization replaced by a tensor subclass (torchao's Float8Tensor, ...)."""
    return type(weight) not in (nn.Parameter, torch.Tensor)


def fp8_config():
    """torchao's config for fp8 linear layers: float8 dynamic activations and float8 weights, per-row scales."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)


class FP8Linears:
    """The linear layers `quantize_linears` quantized: `layers` their names, `kept` every other linear layer
    with why it stays in bf16; `remove()` puts the original bf16 parameters back where they were."""

    def __init__(self, transformer: nn.Module, kept: dict[str, str]):
        self.transformer = transformer
        self.kept = kept
        # name -> (layer, its original weight parameter, the device that parameter came from)
        self._originals: dict[str, tuple[nn.Linear, nn.Parameter, torch.device]] = {}

    @property
    def layers(self) -> list[str]:
        return list(self._originals)

    @property
    def active(self) -> bool:
        return bool(self._originals)

    def remove(self) -> None:
        """The original bf16 parameters, bit-exact, in their layers again (same objects, same devices)."""
        while self._originals:
            name, (module, weight, device) = self._originals.popitem()
            weight.data = weight.data.to(device)
            module.weight = weight
            module.__dict__.pop("extra_repr", None)  # torchao's per-instance repr

    def __repr__(self) -> str:
        return f"FP8Linears({len(self._originals)} layers in fp8, {len(self.kept)} kept in bf16)"


def quantize_linears(transformer: nn.Module, linear: str = "fp8") -> FP8Linears:
    """Quantize the linear layers of `transformer`'s blocks to fp8 (see the module's docstring); raises
    ValueError naming what to do when it cannot (torchao missing, CPU, a GPU below sm_89, not bfloat16)
    before any layer changes. On an error part-way, the layers quantized so far are restored."""
    if problem := transformer_problem(transformer, linear):
        raise ValueError(problem)
    from torchao.quantization import quantize_

    config = fp8_config()
    choice = layer_choice(transformer)
    handle = FP8Linears(transformer, {name: why for name, why in choice.items() if why != FP8})
    try:
        for name in (name for name, why in choice.items() if why == FP8):
            module = transformer.get_submodule(name)
            weight = module.weight
            quantize_(module, config, filter_fn=lambda m, fqn, target=module: m is target)
            if module.weight is weight:  # torchao skips what it cannot take, without saying so
                raise RuntimeError(f"torchao left {name} ({module.in_features} -> {module.out_features}) unquantized")
            handle._originals[name] = (module, weight, weight.device)
            weight.data = weight.data.to("cpu")  # the GPU keeps the fp8 copy only
    except Exception:
        handle.remove()
        raise
    return handle
