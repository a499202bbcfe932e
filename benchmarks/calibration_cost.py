"""What `paro calibrate` costs on full-size Wan2.1-1.3B and CogVideoX-5B transformers (one GPU): the full capture
(every order, every query row, every call) and a cheap one with an order phase (`--cheap-capture`, default
`ORDER_PHASE`), one run. The default cheap capture (`CHEAP`) is timed through the pipelines by first_generation.py.

    python benchmarks/calibration_cost.py --models wan2.1-1.3b cogvideox-5b --end-to-end wan2.1-1.3b \
        --out benchmarks/results/calibration_cost_cheap_h200.json
    python benchmarks/calibration_cost.py --tiny          # CPU check of this script with tiny models

What is measured, and what is extrapolated (say so wherever the numbers are quoted):
- The transformer alone with random weights (bf16), random latents and random text embeddings: the
  VAE and text encoder run once per prompt and are not what calibration adds. CogVideoX-5B:
  480x720x49 -> latents 13x60x90, B=2 (CFG batched), 226 text tokens, 3-D RoPE as its pipeline
  builds it; one transformer call per step. Wan2.1-1.3B: 81 frames 480x832 -> 21x60x104, B=1,
  512 text tokens; two calls per step (cond, uncond). Timesteps: Wan's flow-matching schedule (shift 3),
  CogVideoX's evenly spaced 999..0, which decide the timestep buckets.
- Full capture, timed on the device: a dense forward; a forward with capture + block statistics of all 6 orders
  for every layer (what every captured call of the full capture costs); the statistics of one layer alone;
  moving a bucket's staged sums to host memory; order selection and masks over 6 buckets of full-size sums.
  Extrapolated: prompts x steps x calls per step / stat_every captured forwards + the other forwards dense
  + one flush per bucket per prompt + selection.
- Cheap capture: a forward at an order step (all orders, sampled rows) and at a map step (each head's order);
  extrapolated as the number of such calls (from the schedule) times their extra cost over a dense forward,
  plus dense forwards. With `--end-to-end MODEL`, run for real through `StatsRecorder` as a pipeline feeds it:
  a dense generation of one prompt (steps x calls per step forwards), then the calibration of `--prompts`
  prompts (the first of which is the first `plan="auto"` generation) and `plan_from_stats`, with the peak GPU
  memory of each and the peak host RSS and stored accumulator bytes of the capture.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paroattn.calibrate import CaptureConfig, SelectionConfig, StatsRecorder  # noqa: E402
from paroattn.calibrate.accumulate import StatsAccumulator  # noqa: E402
from paroattn.calibrate.block_stats import block_stats  # noqa: E402

# the cheap capture this script models: an order phase (all orders' scores at the first steps), then one order per
# head. Its extrapolation counts order and map calls, so it measures order-phase captures only; the default capture
# (`CHEAP`, orders narrowed after the first bucket) is measured end to end by benchmarks/first_generation.py
ORDER_PHASE = {"order_steps": 2, "steps_per_bucket": 2, "stat_every": 2, "calls": "first", "query_stride": 4}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeat=1):
    _sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync()
    return (time.perf_counter() - start) / repeat


def _host_gb(field: str = "VmRSS") -> float | None:
    """This process's resident host memory (VmRSS) or its peak since the last `_reset_host_peak` (VmHWM), in GB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def _reset_host_peak() -> bool:
    """Start VmHWM again from the current RSS (Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _gpu_peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def _reset_gpu_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def schedule(name: str, steps: int) -> list[float]:
    """The timesteps (0..1000) of the model's sampler: Wan's flow matching with shift 3 (480p), CogVideoX's evenly
    spaced 999..0; they decide the timestep buckets."""
    if "wan" in name:
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        scheduler.set_timesteps(steps)
        return [float(t) for t in scheduler.timesteps]
    return [float(t) for t in torch.linspace(999, 0, steps)]


def parse_capture_options(spec: str) -> dict:
    """"name=value,..." -> CaptureConfig options (int, float, None or string values), checked by CaptureConfig."""
    options = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in CaptureConfig.__dataclass_fields__ or not value:
            raise SystemExit(f"--cheap-capture {item!r}: expected name=value with a CaptureConfig option name")
        try:
            options[name] = int(value)
        except ValueError:
            try:
                options[name] = float(value)
            except ValueError:
                options[name] = None if value == "None" else value
    CaptureConfig(**options)
    return options


def generation(model, inputs, calls_per_step: int, timesteps, recorder: StatsRecorder | None = None) -> None:
    """One generation as a pipeline runs it: every step calls the transformer `calls_per_step` times (cond first)."""
    for t in timesteps:
        for _ in range(calls_per_step):
            model(**inputs(t))
        if recorder is not None:
            recorder.step_done()
    if recorder is not None:
        recorder.prompt_done()


def captured_calls(config: CaptureConfig, timesteps, calls_per_step: int, prompts: int) -> dict:
    """How many calls of a calibration the capture rule makes order calls (all orders) and map calls (one order),
    from a one-layer recorder fed tiny q, k on the CPU through the same rule."""
    from paroattn import TokenLayout

    layout = TokenLayout(0, 1, 8, 8)
    config = replace(config, backend="torch", profile_queries=0, block_size=64, query_block=None)
    recorder = StatsRecorder(1, config)
    q = torch.randn(1, 1, layout.seq_len, 16)
    counts = {"order": 0, "map": 0}
    for _ in range(prompts):
        for t in timesteps:
            before = recorder.captures
            for _ in range(calls_per_step):
                recorder.record(0, q, q, layout, t)
            if recorder.mode in counts:
                counts[recorder.mode] += recorder.captures - before
            recorder.step_done()
        recorder.prompt_done()
    return counts


def measure_cheap(name, model, inputs, calls_per_step, dense_forward_s, config, prompts, steps, end_to_end):
    """The cheap capture: a forward at an order step and at a map step, the calls of each kind in a calibration,
    the calibration extrapolated from them and, with `end_to_end`, run: a dense generation, then the calibration."""
    from paroattn.calibrate.driver import plan_from_stats
    from paroattn.pipelines import capture_attention, self_attention_layers

    L = len(self_attention_layers(model))
    timesteps = schedule(name, steps)
    out = {"options": {k: getattr(config, k) for k in ("steps_per_bucket", "stat_every", "calls", "query_stride",
                                                        "order_steps", "order_density", "block_size")}}

    def recorder(cfg):
        return StatsRecorder(L, cfg, model_class=type(model).__name__, model_config=model.config)

    # one order step, then one map step (orders chosen after one step); the first pass compiles the kernels
    one = replace(config, order_steps=1, steps_per_bucket=None, stat_every=1)
    for attempt in range(2):
        rec = recorder(one)
        with capture_attention(model, rec.record):
            order_s = _timed(lambda: model(**inputs(timesteps[0])))
            rec.step_done()
            map_s = _timed(lambda: model(**inputs(timesteps[1])))
            skipped_s = _timed(lambda: model(**inputs(timesteps[1])))  # a second call in the step: not captured
            rec.step_done()
    out.update(order_forward_s=order_s, map_forward_s=map_s, uncaptured_forward_s=skipped_s)
    counts = captured_calls(config, timesteps, calls_per_step, prompts)
    calls = prompts * steps * calls_per_step
    out["calls"] = {"transformer_calls": calls, **counts}
    t0 = time.perf_counter()
    plan_from_stats(rec.stats(["p"]), SelectionConfig(density=0.3))
    _sync()
    select_s = time.perf_counter() - t0
    first = captured_calls(config, timesteps, calls_per_step, 1)  # the first generation (a plan="auto" run)
    out["extrapolated"] = {
        "calibration_s": calls * dense_forward_s + counts["order"] * (order_s - dense_forward_s)
        + counts["map"] * (map_s - dense_forward_s) + select_s,
        "dense_s": calls * dense_forward_s,
        "first_generation_over_dense": 1 + (first["order"] * (order_s - dense_forward_s)
                                            + first["map"] * (map_s - dense_forward_s))
        / (steps * calls_per_step * dense_forward_s),
        "select_s": select_s,
    }
    out["extrapolated"]["calibration_min"] = out["extrapolated"]["calibration_s"] / 60
    if not end_to_end:
        return out
    e2e = {}
    _reset_gpu_peak()
    e2e["dense_generation_s"] = _timed(lambda: generation(model, inputs, calls_per_step, timesteps))
    e2e["dense_generation_peak_gpu_gb"] = _gpu_peak_gb()
    e2e["host_rss_before_gb"] = _host_gb()
    e2e["host_peak_reset"] = _reset_host_peak()
    _reset_gpu_peak()
    rec = recorder(config)
    prompt_s = []
    with capture_attention(model, rec.record):
        for _ in range(prompts):
            prompt_s.append(_timed(lambda: generation(model, inputs, calls_per_step, timesteps, rec)))
    e2e["capture_peak_gpu_gb"] = _gpu_peak_gb()  # the generations; the selection after them is reported apart
    _reset_gpu_peak()
    t0 = time.perf_counter()
    plan, result = plan_from_stats(rec.stats([f"prompt {i}" for i in range(prompts)]), SelectionConfig(density=0.3))
    _sync()
    e2e.update(
        prompt_s=prompt_s, select_s=time.perf_counter() - t0, calibration_s=sum(prompt_s) + time.perf_counter() - t0,
        first_generation_over_dense=prompt_s[0] / e2e["dense_generation_s"],
        select_peak_gpu_gb=_gpu_peak_gb(), host_peak_gb=_host_gb("VmHWM"),
        stored_means_gb=rec.acc.stored_bytes() / 1e9, stats_s=rec.stats_s, captured_layer_calls=rec.captures,
        steps_per_bucket=rec.acc.steps_per_bucket, achieved_density=float(result.density.mean()),
    )
    if e2e["dense_generation_peak_gpu_gb"]:
        e2e["gpu_over_dense"] = e2e["capture_peak_gpu_gb"] / e2e["dense_generation_peak_gpu_gb"]
    e2e["calibration_min"] = e2e["calibration_s"] / 60
    out["end_to_end"] = e2e
    return out


def build_cogvideox_5b(device, dtype, tiny: bool = False):
    """CogVideoX-5B's transformer and its inputs at 480x720x49; `tiny`: its blocks shrunk to 2 layers of 2 heads
    and 3 x 16 x 16 latents, a CPU check of this script."""
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    heads, layers, text_dim, text, (frames, height, width) = (
        (2, 2, 32, 8, (3, 16, 16)) if tiny else (48, 42, 4096, 226, (13, 60, 90)))
    with torch.device(device):
        model = CogVideoXTransformer3DModel(
            num_attention_heads=heads, attention_head_dim=64, in_channels=16, out_channels=16, num_layers=layers,
            text_embed_dim=text_dim, time_embed_dim=512, sample_width=width, sample_height=height,
            sample_frames=4 * (frames - 1) + 1, patch_size=2, max_text_seq_length=text,
            use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False,
            timestep_activation_fn="silu", flip_sin_to_cos=True, freq_shift=0, norm_eps=1e-5,
            spatial_interpolation_scale=1.875,
        ).to(dtype).eval()
    gh, gw = height // 2, width // 2
    crops = get_resize_crop_region_for_grid((gh, gw), gw, gh)
    rope = get_3d_rotary_pos_embed(embed_dim=64, crops_coords=crops, grid_size=(gh, gw), temporal_size=frames,
                                   device=device)
    g = torch.Generator(device=device).manual_seed(0)

    def inputs(t):
        return {
            "hidden_states": torch.randn(2, frames, 16, height, width, generator=g, device=device, dtype=dtype),
            "encoder_hidden_states": torch.randn(2, text, text_dim, generator=g, device=device, dtype=dtype),
            "timestep": torch.full((2,), int(t), device=device, dtype=torch.long),
            "image_rotary_emb": rope,
            "return_dict": False,
        }

    return model, inputs, 1


def build_wan_1_3b(device, dtype, tiny: bool = False):
    """Wan2.1-1.3B's transformer and its inputs at 81 frames of 480x832; `tiny`: its blocks shrunk to 2 layers
    of 2 heads and 3 x 16 x 16 latents, a CPU check of this script."""
    from diffusers import WanTransformer3DModel

    heads, layers, text_dim, ffn, text, latent = (
        (2, 2, 32, 64, 8, (3, 16, 16)) if tiny else (12, 30, 4096, 8960, 512, (21, 60, 104)))
    with torch.device(device):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128, in_channels=16,
            out_channels=16, text_dim=text_dim, freq_dim=256, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        ).to(dtype).eval()
    g = torch.Generator(device=device).manual_seed(0)

    def inputs(t):
        return {
            "hidden_states": torch.randn(1, 16, *latent, generator=g, device=device, dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text, text_dim, generator=g, device=device, dtype=dtype),
            "timestep": torch.full((1,), float(t), device=device, dtype=torch.float32),
            "return_dict": False,
        }

    return model, inputs, 2


# (key blocks per iteration, with max and count) measured for one layer; on an H200 at CogVideoX-5B
# size group 1 was fastest (0.167 s mass only vs 0.188 s for 4 and 8), so only 1 and 2 are kept here
VARIANTS = ((1, True), (1, False), (2, False))

MODELS = {"cogvideox-5b": build_cogvideox_5b, "wan2.1-1.3b": build_wan_1_3b,
          "tiny-cogvideox": functools.partial(build_cogvideox_5b, tiny=True),
          "tiny-wan": functools.partial(build_wan_1_3b, tiny=True)}


def check_kernel(device, backend):
    """The Triton statistics against the torch form on this device (bf16 inputs)."""
    from paroattn import TokenLayout

    layout = TokenLayout(70, 3, 12, 18)
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(2, 3, layout.seq_len, 64, generator=g, device=device).to(torch.bfloat16)
    k = torch.randn(2, 3, layout.seq_len, 64, generator=g, device=device).to(torch.bfloat16)
    got = block_stats(q, k, layout, list(range(6)), 64, backend=backend)
    want = block_stats(q.float(), k.float(), layout, list(range(6)), 64, backend="torch")
    return {name: float((a - b).abs().max()) for name, a, b in zip(("mass", "pmax", "below"), got, want)}


def measure(name, device, dtype, backend, prompts, steps, buckets, timed_calls, cheap=None, end_to_end=False,
            stat_every=2):
    """The model's dense forward, then the cheap capture (`cheap`: a CaptureConfig, None: skipped; run end to end
    with `end_to_end`), then the full capture (every order and row at every captured step: the old default)."""
    from paroattn.pipelines import capture_attention, self_attention_layers

    record = {"model": name}
    start = time.perf_counter()
    model, inputs, calls_per_step = MODELS[name](device, dtype)
    _sync()
    record["build_s"] = time.perf_counter() - start
    L = len(self_attention_layers(model))
    record["layers"] = L
    record["calls_per_step"] = calls_per_step
    with torch.no_grad():
        model(**inputs(900))  # warm-up
        record["dense_forward_s"] = _timed(lambda: model(**inputs(900)), repeat=timed_calls)
        if cheap is not None:
            record["cheap"] = measure_cheap(name, model, inputs, calls_per_step, record["dense_forward_s"], cheap,
                                            prompts, steps, end_to_end)
            print(json.dumps({"model": name, "cheap": record["cheap"]}), flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        state = {"acc": None, "stats_s": 0.0, "layer0": None, "variant": None}

        def keep_layer0(layer, q, k, layout, timestep, suffix_mask):
            if layer == 0 and state["layer0"] is None:
                state["layer0"] = (q.clone(), k.clone(), layout)

        with capture_attention(model, keep_layer0):
            model(**inputs(900))
        q, k, layout = state["layer0"]
        record["layout"] = str(layout)
        record["shape"] = [int(s) for s in q.shape]
        orders = list(layout.distinct_orders())
        # one layer's statistics (all orders): kernel variants; the fastest mass-only one runs the forward
        variants = {}
        for group, extras in VARIANTS:
            if backend != "triton" and group != 1:
                continue
            run = lambda: block_stats(q, k, layout, orders, 64, backend=backend, extras=extras, group=group)  # noqa: E731
            run()  # compile
            variants[f"group{group}_{'extras' if extras else 'mass'}"] = _timed(run, repeat=2)
        record["stats_one_layer_s"] = variants
        best = min((v, name) for name, v in variants.items() if name.endswith("_mass"))[1]
        best_group = int(best[len("group"):].split("_")[0])
        record["forward_variant"] = best
        nb = math.ceil(layout.seq_len / 64)
        state["acc"] = StatsAccumulator(L, buckets, orders, layout.seq_len, 64, store_device="cpu")

        def on_capture(layer, q, k, layout, timestep, suffix_mask):
            _sync()
            t0 = time.perf_counter()
            mass, pmax, below = block_stats(q, k, layout, orders, 64, backend=backend, extras=False, group=best_group,
                                             suffix_mask=suffix_mask)
            state["acc"].add(layer, 0, mass, pmax, below, batch=q.shape[0])
            _sync()
            state["stats_s"] += time.perf_counter() - t0

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        with capture_attention(model, on_capture):
            record["captured_forward_s"] = _timed(lambda: model(**inputs(900)), repeat=timed_calls)
        record["stats_in_captured_forward_s"] = state["stats_s"] / timed_calls
        if torch.cuda.is_available():
            record["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        record["blocks_per_side"] = nb
        acc = state["acc"]
        record["flush_bucket_s"] = _timed(acc.flush)
        # selection over `buckets` buckets of full-size sums: the one captured bucket stands in for all
        for b in range(1, buckets):
            for layer in range(L):
                acc.mass[(b, layer)] = acc.mass[(0, layer)]
            acc.weight[b] = acc.weight[0]
        for b in range(buckets):
            acc.steps_per_bucket[b] = 1
        record["accumulator_host_gb"] = buckets * sum(t.numel() * t.element_size() for (b, _), t in acc.mass.items() if b == 0) / 1e9
        compute = "cuda" if torch.cuda.is_available() else "cpu"
        t0 = time.perf_counter()
        result = acc.finalize(0.3, layout.prefix, compute_device=compute, figure_layers=[0, L // 2, L - 1])
        _sync()
        record["select_and_masks_s"] = time.perf_counter() - t0
        record["achieved_density"] = float(result.density.mean())
    calls = prompts * steps * calls_per_step
    captured = prompts * math.ceil(steps / stat_every) * calls_per_step  # every stat_every-th step, every call
    record["extrapolated"] = {
        "prompts": prompts,
        "steps": steps,
        "transformer_calls": calls,
        "captured_calls": captured,
        "dense_only_s": calls * record["dense_forward_s"],
        "calibration_s": captured * record["captured_forward_s"] + (calls - captured) * record["dense_forward_s"]
        + prompts * buckets * record["flush_bucket_s"] + record["select_and_masks_s"],
        "first_generation_over_dense": (captured * record["captured_forward_s"]
                                        + (calls - captured) * record["dense_forward_s"]) / calls
        / record["dense_forward_s"],
    }
    record["extrapolated"]["calibration_min"] = record["extrapolated"]["calibration_s"] / 60
    model = state = acc = result = None  # free GPU memory before the next model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cogvideox-5b", "wan2.1-1.3b"], choices=sorted(MODELS))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--buckets", type=int, default=6)
    parser.add_argument("--timed-calls", type=int, default=1)
    parser.add_argument("--stat-every", type=int, default=2, help="the full capture's step interval (its default)")
    parser.add_argument("--cheap-capture", default=",".join(f"{k}={v}" for k, v in ORDER_PHASE.items()), help="CaptureConfig options of the order-phase capture, "
                        "comma-separated name=value; 'none' skips it")
    parser.add_argument("--end-to-end", nargs="*", default=[], choices=sorted(MODELS),
                        help="models whose cheap calibration runs end to end (a dense generation, then every prompt)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny models and the torch backend")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = "triton" if cuda else "torch"
    models = args.models
    if args.tiny:  # the tiny models named in --models, else both
        models = [m for m in args.models if m.startswith("tiny")] or ["tiny-cogvideox", "tiny-wan"]
    end_to_end = set(args.end_to_end)
    cheap = None
    if args.cheap_capture.lower() != "none":
        cheap = CaptureConfig(steps=args.steps, num_buckets=args.buckets, backend=backend,
                              order_density=0.3, **parse_capture_options(args.cheap_capture))
    report = {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "kernel_check_max_abs_diff": check_kernel(device, backend) if cuda else None,
        "results": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "results"}), flush=True)
    for name in models:
        record = measure(name, device, dtype, backend, args.prompts, args.steps, args.buckets, args.timed_calls,
                         cheap=cheap, end_to_end=name in end_to_end, stat_every=args.stat_every)
        report["results"].append(record)
        print(json.dumps(record), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
