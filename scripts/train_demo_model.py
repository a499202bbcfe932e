"""Train the demo model of `paro demo`: a small WanTransformer3DModel, text-conditioned,
flow matching in pixel space on procedural videos (`paroattn.demo_model.data`).

Runs in resumable chunks: each call trains for at most `--chunk-seconds` (<= 600), then writes a
checkpoint (safetensors shards + JSON, no pickle) to `--ckpt-dir` and the EMA weights, in the
assets' folder format, to `--out`. Call it again with the same `--ckpt-dir` to go on. Batch `i`
is a pure function of (`--seed`, i), so a resumed run sees exactly the data an uninterrupted one
would have.

    python scripts/train_demo_model.py --out paroattn/demo_model/assets --ckpt-dir /tmp/ref-ckpt --chunk-seconds 540 --compile --local-init
    python scripts/train_demo_model.py --smoke --out /tmp/ref --ckpt-dir /tmp/ref-ckpt   # seconds, CPU

`--local-init` starts every self-attention head local (`local_attention_init`): a constant added to
the query and key projections in a few RoPE dimensions makes q.k fall with the distance along
some of the axes (frames, rows, columns), as the ConViT paper starts its heads local. Training
keeps, moves or drops that locality as the data rewards it; what it kept is measured by
`scripts/attention_concentration.py`.

Flow matching as in Wan / SD3: x_t = (1 - s) x0 + s noise with s = shift(u), u ~ U(0, 1), the
model predicts noise - x0 at timestep 1000 s; prompts are dropped to the null prompt 10% of the
time for classifier-free guidance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paroattn.demo_model.data import make_batch
from paroattn.demo_model.model import (
    SCHEDULER_SHIFT,
    TEXT_ENCODER_CONFIG,
    TRANSFORMER_CONFIG,
    VIDEO_SHAPE,
    DemoVideoPipeline,
    new_demo_modules,
    save_demo_model,
)

MAX_CHUNK_SECONDS = 600
SHARD_BYTES = 15 * 2**20
# a configuration small enough to train a few steps on a CPU in seconds (tests, smoke runs)
SMOKE_TRANSFORMER = dict(TRANSFORMER_CONFIG, num_attention_heads=2, num_layers=2, ffn_dim=128)
SMOKE_TEXT_ENCODER = dict(TEXT_ENCODER_CONFIG, num_layers=1)
SMOKE_VIDEO = {"num_frames": 4, "height": 16, "width": 16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the EMA weights go (assets folder format)")
    p.add_argument("--ckpt-dir", type=Path, required=True, help="checkpoint folder; resumed from if it holds one")
    p.add_argument("--chunk-seconds", type=float, default=540, help=f"train this long, then checkpoint (<= {MAX_CHUNK_SECONDS})")
    p.add_argument("--total-steps", default="auto",
                   help="length of the run (learning-rate schedule); 'auto' fits it to --budget-seconds from the speed of the first steps")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="with --total-steps auto: the whole run's training time (default: --chunk-seconds)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--cfg-drop", type=float, default=0.1, help="probability of training on the null prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-seconds", type=float, default=120, help="also write the EMA weights this often")
    p.add_argument("--samples", type=Path, default=None, help="at the end, write a PNG of samples here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer blocks (one compiled block, reused; CUDA)")
    p.add_argument("--frames", type=int, default=None, help=f"video frames (default {VIDEO_SHAPE['num_frames']})")
    p.add_argument("--height", type=int, default=None, help=f"video height in pixels (default {VIDEO_SHAPE['height']})")
    p.add_argument("--width", type=int, default=None, help=f"video width in pixels (default {VIDEO_SHAPE['width']})")
    p.add_argument("--init", type=Path, default=None,
                   help="start from these weights (an assets folder, e.g. the shipped model) instead of a fresh model")
    p.add_argument("--local-init", action="store_true",
                   help="start each self-attention head local along some axes (local_attention_init); fresh models only")
    p.add_argument("--smoke", action="store_true", help="tiny model and videos: checks the script end to end on a CPU")
    p.add_argument("--max-steps-this-chunk", type=int, default=None, help="stop this chunk after this many steps (tests)")
    args = p.parse_args(argv)
    if args.local_init and args.init is not None:
        p.error("--local-init sets up a fresh model; --init starts from trained weights: pass one of them")
    if not 0 < args.chunk_seconds <= MAX_CHUNK_SECONDS:
        p.error(f"--chunk-seconds must be in (0, {MAX_CHUNK_SECONDS}], got {args.chunk_seconds}")
    return args


# -- checkpoint: safetensors shards + JSON ---------------------------------------------------------

def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entry in state["state"].items():
        for name, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"optimizer.{index}.{name}"] = value
            else:
                scalars[f"{index}.{name}"] = float(value)
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for key, value in meta["scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = torch.tensor(value)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Shards of at most SHARD_BYTES, written beside the old checkpoint, then switched in by
    renaming `checkpoint.json` last, so an interrupted save leaves the previous one readable."""
    directory.mkdir(parents=True, exist_ok=True)
    tag = f"step{meta['step']:07d}"
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if current and size + t.numel() * t.element_size() > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.numel() * t.element_size()
    shards.append(current)
    files = []
    for i, shard in enumerate(shards):
        path = directory / f"{tag}-{i:02d}.safetensors"
        save_file(shard, str(path))
        files.append(path.name)
    meta = dict(meta, files=files)
    tmp = directory / "checkpoint.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    previous = json.loads((directory / "checkpoint.json").read_text())["files"] if (directory / "checkpoint.json").exists() else []
    os.replace(tmp, directory / "checkpoint.json")
    for name in previous:
        if name not in files:
            (directory / name).unlink(missing_ok=True)


def load_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    index = directory / "checkpoint.json"
    if not index.exists():
        return None
    meta = json.loads(index.read_text())
    tensors = {}
    for name in meta["files"]:
        tensors.update(load_file(str(directory / name)))
    return tensors, meta


# -- local start of the attention heads ------------------------------------------------------------

# The axes along which a head starts local; each head of each layer draws one. Together they give
# the patterns of real video DiTs: a neighbourhood in space and time, the same place across frames
# (stripes in frame-major order), whole neighbouring frames (blocks), rows or columns.
LOCAL_PATTERNS = (("f", "h", "w"), ("h", "w"), ("f",), ("f", "h"), ("f", "w"), ("h",), ("w",))
# squared size of the added constant per axis, against about 85 for the projection of a unit-RMS
# input at PyTorch's default Linear init (256 outputs of variance 1/3): the constant dominates q
# and k at the start
LOCAL_ENERGY_PER_AXIS = 60.0
# start value of the q and k RMSNorm weights (PyTorch: 1): scores can reach gain^2 times the
# default init's range (about 8 at head dim 64), the sharpness a head needs to stay local among
# 2048 tokens
LOCAL_NORM_GAIN = 2.0


def rope_pairs(transformer, axis_lengths: dict[str, int]) -> dict[str, list[int]]:
    """Per axis, the head dimensions (first of each rotary pair) of the two fastest RoPE frequencies
    that do not wrap around over the axis: omega * (length - 1) <= 2 pi, so cos(omega * distance)
    falls from the query outwards instead of rising again at a far token."""
    rope = transformer.rope
    sections = {"f": (0, rope.t_dim), "h": (rope.t_dim, rope.h_dim), "w": (rope.t_dim + rope.h_dim, rope.w_dim)}
    pairs = {}
    for axis, (start, dim) in sections.items():
        omegas = [10000.0 ** (-2 * i / dim) for i in range(dim // 2)]  # WanRotaryPosEmbed's theta
        fitting = [i for i, w in enumerate(omegas) if w * (axis_lengths[axis] - 1) <= 2 * math.pi]
        pairs[axis] = [start + 2 * i for i in fitting[:2]]
    return pairs


@torch.no_grad()
def local_attention_init(transformer, video_shape: dict, seed: int) -> list[list[tuple[str, ...]]]:
    """Make every self-attention head of a fresh Wan transformer start local: in the chosen rotary
    pairs, the same constant `a` on the first element of q's and k's bias, so after RoPE the score
    holds a^2 * cos(omega * distance) (largest at distance 0). Returns each layer's head patterns."""
    p_t, p_h, p_w = transformer.config.patch_size
    lengths = {"f": video_shape["num_frames"] // p_t, "h": video_shape["height"] // p_h, "w": video_shape["width"] // p_w}
    pairs = rope_pairs(transformer, lengths)
    heads, head_dim = transformer.config.num_attention_heads, transformer.config.attention_head_dim
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for block in transformer.blocks:
        attn = block.attn1
        attn.norm_q.weight.fill_(LOCAL_NORM_GAIN)
        attn.norm_k.weight.fill_(LOCAL_NORM_GAIN)
        layer = []
        for head in range(heads):
            pattern = LOCAL_PATTERNS[int(torch.randint(len(LOCAL_PATTERNS), (1,), generator=g))]
            for axis in pattern:
                value = math.sqrt(LOCAL_ENERGY_PER_AXIS / len(pairs[axis]))
                for dim in pairs[axis]:
                    attn.to_q.bias[head * head_dim + dim] = value
                    attn.to_k.bias[head * head_dim + dim] = value
                    attn.to_q.bias[head * head_dim + dim + 1] = 0.0
                    attn.to_k.bias[head * head_dim + dim + 1] = 0.0
            layer.append(pattern)
        chosen.append(layer)
    return chosen


# -- training ----------------------------------------------------------------------------------

def shifted_sigma(u: torch.Tensor, shift: float = SCHEDULER_SHIFT) -> torch.Tensor:
    """The timestep shift of FlowMatchEulerDiscreteScheduler, so training sees the noise levels
    that sampling visits."""
    return shift * u / (1 + (shift - 1) * u)


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def training_step(step, args, video_shape, transformer, text_encoder, device, autocast_dtype):
    """Loss of batch `step`; every random draw comes from generators seeded by (seed, step)."""
    videos, captions = make_batch(args.seed, step, args.batch, video_shape["num_frames"], video_shape["height"],
                                  video_shape["width"], device=device)
    g = torch.Generator().manual_seed(args.seed * 7919 + step + 1)
    drop = torch.rand(args.batch, generator=g) < args.cfg_drop
    captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
    sigma = shifted_sigma(torch.rand(args.batch, generator=g)).to(device)
    noise = torch.randn(videos.shape, generator=g).to(device)
    s = sigma.view(-1, 1, 1, 1, 1)
    noisy = (1 - s) * videos + s * noise
    ids = text_encoder.tokenize(captions).to(device)
    with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        states = text_encoder(ids)
        prediction = transformer(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=states,
                                 return_dict=False)[0]
    return F.mse_loss(prediction.float(), noise - videos)


def sample_grid(path: Path, transformer, text_encoder, scheduler, video_shape, device) -> None:
    """A PNG: one row per prompt, the frames left to right."""
    import numpy as np
    from PIL import Image

    prompts = [
        "red circle moving right quickly, cloudy background",
        "blue square rotating slowly and yellow triangle moving up slowly, pan left, plain background",
        "green ring moving down slowly, zoom in, dotted background",
        "white triangle moving left quickly and magenta circle moving right slowly, dotted background",
    ]
    pipe = DemoVideoPipeline(transformer.eval(), text_encoder.eval(), scheduler)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(prompts, generator=torch.Generator().manual_seed(0), **video_shape).frames.cpu()
    transformer.train(), text_encoder.train()
    rows = [torch.cat(list(video), dim=1) for video in frames]  # [H, F*W, 3]
    grid = (torch.cat(rows, dim=0) * 255).round().byte().numpy()
    image = Image.fromarray(np.ascontiguousarray(grid))
    image.resize((image.width * 4, image.height * 4), Image.NEAREST).save(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    transformer_config = SMOKE_TRANSFORMER if args.smoke else TRANSFORMER_CONFIG
    text_config = SMOKE_TEXT_ENCODER if args.smoke else TEXT_ENCODER_CONFIG
    video_shape = dict(SMOKE_VIDEO if args.smoke else VIDEO_SHAPE)
    for key, value in (("num_frames", args.frames), ("height", args.height), ("width", args.width)):
        if value is not None:
            video_shape[key] = value

    transformer, text_encoder, scheduler = new_demo_modules(transformer_config, text_config)
    if args.init is not None:
        from paroattn.demo_model.model import load_demo_pipeline

        start = load_demo_pipeline(args.init)
        transformer.load_state_dict({k: v.float() for k, v in start.transformer.state_dict().items()})
        text_encoder.load_state_dict(start.text_encoder.state_dict())
        print(f"initialized from {args.init}", flush=True)
    if args.local_init:
        patterns = local_attention_init(transformer, video_shape, args.seed)
        print("local heads (axes per head, per layer):", ["/".join("".join(p) for p in layer) for layer in patterns],
              flush=True)
    transformer.to(device).train()
    text_encoder.to(device).train()
    if args.compile:
        # regional compilation: the blocks are identical, so one graph serves all of them
        transformer.compile_repeated_blocks(fullgraph=True)
    named = {f"transformer.{k}": p for k, p in transformer.named_parameters()}
    named.update({f"text_encoder.{k}": p for k, p in text_encoder.named_parameters()})
    params = list(named.values())
    ema = {k: p.detach().clone().float() for k, p in named.items()}
    decay_params = [p for p in params if p.dim() >= 2]
    other_params = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay_params, "weight_decay": 0.01},
                                   {"params": other_params, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.99), fused=device.type == "cuda")

    step, total_steps, log = 0, None, []
    loaded = load_checkpoint(args.ckpt_dir)
    if loaded is not None:
        tensors, meta = loaded
        for k, p in named.items():
            p.data.copy_(tensors[f"model.{k}"])
            ema[k].copy_(tensors[f"ema.{k}"])
        load_optimizer(optimizer, {k: v.to(device) for k, v in tensors.items()}, meta["optimizer"])
        step, total_steps, log = meta["step"], meta["total_steps"], meta["log"]
        if meta["args"]["seed"] != args.seed or meta["args"]["batch"] != args.batch or meta["smoke"] != args.smoke:
            raise SystemExit(f"checkpoint in {args.ckpt_dir} was made with seed/batch/smoke "
                             f"{meta['args']['seed']}/{meta['args']['batch']}/{meta['smoke']}; pass the same")
        print(f"resumed at step {step} of {total_steps} from {args.ckpt_dir}", flush=True)
    elif args.total_steps != "auto":
        total_steps = int(args.total_steps)

    def export():
        with torch.no_grad():
            backup = {k: p.detach().clone() for k, p in named.items()}
            for k, p in named.items():
                p.copy_(ema[k])
            save_demo_model(args.out, transformer, text_encoder, scheduler)
            for k, p in named.items():
                p.copy_(backup[k])

    def checkpoint():
        tensors = {f"model.{k}": p for k, p in named.items()}
        tensors.update({f"ema.{k}": v for k, v in ema.items()})
        opt_tensors, opt_meta = optimizer_tensors(optimizer)
        tensors.update(opt_tensors)
        save_checkpoint(args.ckpt_dir, tensors, {
            "step": step, "total_steps": total_steps, "log": log, "optimizer": opt_meta, "smoke": args.smoke,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "transformer_config": transformer_config, "text_encoder_config": text_config, "video_shape": video_shape,
        })

    chunk_start_step, last_export, window, timing_start = step, time.monotonic(), [], None
    budget = args.budget_seconds or args.chunk_seconds
    while total_steps is None or step < total_steps:
        if time.monotonic() - started > args.chunk_seconds:
            break
        if args.max_steps_this_chunk is not None and step - chunk_start_step >= args.max_steps_this_chunk:
            break
        lr = learning_rate(step, total_steps or 10**9, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = training_step(step, args, video_shape, transformer, text_encoder, device, autocast_dtype)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.values()), [p.detach().float() for p in params], 1 - args.ema)
        step += 1
        window.append(loss.detach())
        if step == chunk_start_step + 5:
            if device.type == "cuda":
                torch.cuda.synchronize()
            timing_start = time.monotonic()
        if total_steps is None and step == chunk_start_step + 30:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.monotonic() - timing_start) / 25
            remaining = budget - (time.monotonic() - started)
            total_steps = step + max(1, int(remaining / per_step))
            print(f"{per_step * 1000:.1f} ms/step -> total_steps = {total_steps}", flush=True)
        if step % 100 == 0 or (total_steps is not None and step == total_steps):
            mean = float(torch.stack(window).mean())
            window = []
            log.append({"step": step, "loss": round(mean, 5), "lr": lr, "grad_norm": round(float(grad_norm), 4),
                        "seconds": round(time.monotonic() - started, 1)})
            print(json.dumps(log[-1]), flush=True)
        if time.monotonic() - last_export > args.export_seconds:
            export()
            last_export = time.monotonic()
    if total_steps is None:
        total_steps = step
    checkpoint()
    export()
    (args.out / "train_log.json").write_text(json.dumps({"total_steps": total_steps, "step": step, "log": log}, indent=1))
    print(f"step {step}/{total_steps}: checkpoint in {args.ckpt_dir}, EMA weights in {args.out}", flush=True)
    if args.samples is not None and step >= total_steps:
        with torch.no_grad():
            for k, p in named.items():
                p.copy_(ema[k])
        sample_grid(args.samples, transformer, text_encoder, scheduler, video_shape, device)
        print(f"samples in {args.samples}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
