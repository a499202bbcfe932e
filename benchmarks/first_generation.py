"""What a user's first video costs with `plan="auto"`, and what `paro calibrate` costs, through diffusers' own
pipeline classes (WanPipeline, CogVideoXPipeline) on full-size transformers, one GPU, one process:

    python benchmarks/first_generation.py --models wan2.1-1.3b --calibrate \
        --out benchmarks/results/first-generation-auto-wan2.1-1.3b-nvidia-h200.json
    python benchmarks/first_generation.py --tiny          # CPU check of this script with tiny models

For each model, in this order: a dense generation (the pipeline as shipped); `paroattn.apply(pipe, "auto", ...)`
on an empty cache, then the first generation (dense attention while it records the statistics, the plan built
and cached when it ends), then `--sparse-runs` more generations (sparse, the learnt plan); with `--calibrate`, the
capture `paro calibrate` runs (`driver.capture` of `--prompts` prompts with its default cheap capture,
`config.CHEAP`, then `plan_from_stats`). Each with its wall time, the peak GPU memory it allocated and, for the
learning generation and the calibration, the peak host memory (VmHWM, reset before; the process's own RSS before is
reported beside it) and a timeline of the resident host memory sampled every 50 ms (`host_timeline`: seconds from the
phase's start, GB), which places the peak in the generation, the selection, the write or the apply
(`learning_timings` gives their lengths).

What is not the real model: the transformers have random weights (bf16) and the text encoder is replaced by random
prompt embeddings of the real shape (the pipelines' `encode_prompt`), and the VAE does not run
(`output_type="latent"`): neither is what PARO changes. Everything between them, the scheduler's steps, classifier-
free guidance (Wan: two transformer calls per step; CogVideoX: one call on a batch of two) and the latents, is the
pipeline's own code.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration_cost import (  # noqa: E402
    _gpu_peak_gb,
    _host_gb,
    _reset_gpu_peak,
    _reset_host_peak,
    _sync,
    build_cogvideox_5b,
    build_wan_1_3b,
    parse_capture_options,
)

import paroattn  # noqa: E402
from paroattn.calibrate import CaptureConfig, SelectionConfig  # noqa: E402
from paroattn.calibrate.config import CHEAP  # noqa: E402
from paroattn.calibrate.driver import capture, plan_from_stats  # noqa: E402

CAPTURE_OPTIONS = ("steps_per_bucket", "stat_every", "calls", "query_stride", "order_steps", "keep_orders")
PROMPTS = ["a red fox running through a snowy forest", "waves breaking on a rocky shore at sunset",
           "a city street at night in the rain", "a hot air balloon over green hills"]


def random_embeddings(prompt, shape, device, dtype):
    """Prompt embeddings of the text encoder's shape, fixed per prompt (the null prompt included)."""
    seed = sum(map(ord, prompt or "")) % (2**31)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(1, *shape, generator=g).to(device, dtype)


def pipeline(name: str, transformer, tiny: bool):
    """The diffusers pipeline of `name` around `transformer`, its encode_prompt giving random embeddings."""
    device, dtype = transformer.device, transformer.dtype
    if "wan" in name:
        from diffusers import UniPCMultistepScheduler, WanPipeline

        base = WanPipeline
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
        text = (8, transformer.config.text_dim) if tiny else (512, transformer.config.text_dim)
        size = {"height": 128, "width": 128, "num_frames": 9} if tiny else {"height": 480, "width": 832, "num_frames": 81}
        components = {"tokenizer": None, "text_encoder": None, "vae": None, "transformer": transformer,
                      "scheduler": scheduler}
    else:
        from diffusers import CogVideoXDPMScheduler, CogVideoXPipeline

        base = CogVideoXPipeline
        scheduler = CogVideoXDPMScheduler(beta_schedule="scaled_linear", prediction_type="v_prediction",
                                          rescale_betas_zero_snr=True, timestep_spacing="trailing", snr_shift_scale=1.0)
        text = (transformer.config.max_text_seq_length, transformer.config.text_embed_dim)
        size = {"height": 8 * transformer.config.sample_height, "width": 8 * transformer.config.sample_width,
                "num_frames": transformer.config.sample_frames}
        components = {"tokenizer": None, "text_encoder": None, "vae": None, "transformer": transformer,
                      "scheduler": scheduler}

    class Pipeline(base):
        def encode_prompt(self, prompt, negative_prompt=None, do_classifier_free_guidance=True, *args, **kwargs):
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            cond = torch.cat([random_embeddings(p, text, device, dtype) for p in prompts])
            uncond = random_embeddings(negative_prompt or "", text, device, dtype).expand_as(cond)
            return cond, uncond if do_classifier_free_guidance else None

    Pipeline.__name__ = Pipeline.__qualname__ = base.__name__
    return Pipeline(**components), size


class HostTimeline:
    """Resident host memory sampled in a thread while the block runs: [(seconds from start, GB)], thinned to at most
    `points` entries that keep the maximum of each stretch they replace."""

    def __init__(self, period: float = 0.05, points: int = 400):
        self.period, self.points, self.samples = period, points, []
        self._stop = threading.Event()

    def _run(self):
        start = time.perf_counter()
        while not self._stop.is_set():
            gb = _host_gb()
            if gb is not None:  # None where /proc is not there to read
                self.samples.append((round(time.perf_counter() - start, 2), gb))
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def thinned(self) -> list:
        samples = self.samples
        step = max(1, -(-len(samples) // self.points))
        return [max(samples[i:i + step], key=lambda s: s[1]) for i in range(0, len(samples), step)]

    def peak(self) -> list | None:
        return list(max(self.samples, key=lambda s: s[1])) if self.samples else None


def measure(name, build, args, device, dtype, cache: Path, save) -> dict:
    record = {"model": name}
    transformer, _, calls_per_step = build(device, dtype)
    pipe, size = pipeline(name, transformer, args.tiny)
    record.update(size=size, calls_per_step=calls_per_step, steps=args.steps)
    kwargs = {**size, "num_inference_steps": args.steps, "output_type": "latent"}

    def generate(prompt=PROMPTS[0]):
        return pipe(prompt, generator=torch.Generator(device="cpu").manual_seed(0), **kwargs)

    def timed(fn):
        _sync()
        start = time.perf_counter()
        out = fn()
        _sync()
        return time.perf_counter() - start, out

    with torch.no_grad():
        pipe(PROMPTS[0], **{**kwargs, "num_inference_steps": 2})  # warm-up: cuDNN's plans, allocator
        dense = None
        if not args.learning_only:
            _reset_gpu_peak()
            record["dense_s"], dense = timed(generate)
            record["dense_peak_gpu_gb"] = _gpu_peak_gb()
            dense = dense.frames

        messages = []
        learning = None if args.capture is None else CaptureConfig(query_block=args.query_block, **args.capture)
        handle = paroattn.apply(pipe, "auto", density=args.density, qk=args.qk, pv=args.pv, block_size=64,
                                query_block=args.query_block, cache=cache, log=messages.append, capture=learning)
        record["learning_options"] = {k: getattr(handle.capture, k) for k in CAPTURE_OPTIONS}
        record["host_rss_before_gb"] = _host_gb()
        record["host_peak_reset"] = _reset_host_peak()
        _reset_gpu_peak()
        with HostTimeline() as timeline:
            record["learning_s"], learnt = timed(generate)
        record["host_timeline"], record["host_rss_peak_at"] = timeline.thinned(), timeline.peak()
        record["learning_peak_gpu_gb"] = _gpu_peak_gb()
        record["learning_host_peak_gb"] = _host_gb("VmHWM")
        if dense is not None:
            record["learning_over_dense"] = record["learning_s"] / record["dense_s"]
            record["learning_output_max_abs_diff_vs_dense"] = float((learnt.frames.float() - dense.float()).abs().max())
        if record.get("dense_peak_gpu_gb"):
            record["learning_gpu_over_dense"] = record["learning_peak_gpu_gb"] / record["dense_peak_gpu_gb"]
        record["captured_layer_calls"] = handle.captured
        record["learning_timings"] = handle.timings
        record["learnt"] = handle.learnt
        record["plan"] = {"achieved_density": handle.plan.achieved_density(), "buckets": handle.plan.num_buckets,
                          "file_mb": os.path.getsize(handle.path) / 1e6, "qk": args.qk, "pv": args.pv}
        sparse_s = []
        for _ in range(args.sparse_runs):
            _reset_gpu_peak()
            seconds, _ = timed(generate)
            sparse_s.append(seconds)
        record["sparse_s"] = sparse_s
        if sparse_s:
            record["sparse_peak_gpu_gb"] = _gpu_peak_gb()
            if dense is not None:
                record["dense_over_sparse"] = record["dense_s"] / sparse_s[-1]
        record["log"] = messages
        handle.remove()
        save(record)  # kept should the calibration below not finish

        if args.calibrate is not None and (not args.calibrate or name in args.calibrate):
            config = CaptureConfig(steps=args.steps, query_block=args.query_block, height=size["height"],
                                   width=size["width"], frames=size["num_frames"],
                                   pipeline_kwargs={"output_type": "latent"}, **(args.capture or CHEAP))
            record["calibrate_options"] = {k: getattr(config, k) for k in CAPTURE_OPTIONS}
            rss_before = _host_gb()
            record["calibrate_host_peak_reset"] = _reset_host_peak()
            _reset_gpu_peak()
            start = time.perf_counter()
            with HostTimeline() as timeline:
                stats = capture(pipe, PROMPTS[: args.prompts], config)
                captured = time.perf_counter() - start
                plan, _ = plan_from_stats(stats, SelectionConfig(density=args.density, qk=args.qk, pv=args.pv))
                _sync()
            record["calibrate"] = {
                "prompts": args.prompts, "seconds": time.perf_counter() - start, "capture_s": captured,
                "timings": stats.timings, "peak_gpu_gb": _gpu_peak_gb(), "host_rss_before_gb": rss_before,
                "host_peak_gb": _host_gb("VmHWM"), "host_timeline": timeline.thinned(),
                "host_rss_peak_at": timeline.peak(), "achieved_density": plan.achieved_density(),
            }
    return record


def added(peak, before) -> float:
    """Host memory a phase added: its VmHWM (reset at its start) less the RSS before it."""
    return float("nan") if peak is None or before is None else peak - before


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["wan2.1-1.3b", "cogvideox-5b"],
                        choices=["wan2.1-1.3b", "cogvideox-5b"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--density", type=float, default=0.2)
    parser.add_argument("--qk", default="int8")
    parser.add_argument("--pv", default="fp8")
    parser.add_argument("--query-block", type=int, default=128)
    parser.add_argument("--sparse-runs", type=int, default=2, help="sparse generations after the learning one")
    parser.add_argument("--learning-only", action="store_true",
                        help="the learning generation alone (no dense generation, no sparse ones): its host memory")
    parser.add_argument("--calibrate", nargs="*", default=None, metavar="MODEL",
                        help="also time paro calibrate's capture of --prompts: of the models named (none named: all)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--capture", type=parse_capture_options, default=None,
                        help="CaptureConfig options of both the learning generation and the calibration, "
                             "comma-separated name=value (default: plan='auto''s and paro calibrate's own)")
    parser.add_argument("--tiny", action="store_true", help="CPU check with tiny models, torch op, bf16 modes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.learning_only:
        args.sparse_runs = 0
    if args.tiny:
        args.steps, args.qk, args.pv, args.query_block = min(args.steps, 6), "bf16", "bf16", 64
    builders = {"wan2.1-1.3b": build_wan_1_3b, "cogvideox-5b": build_cogvideox_5b}
    report = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "density": args.density,
              "qk": args.qk, "pv": args.pv, "blocks": [args.query_block, 64], "results": []}

    def save(record):
        if not any(r is record for r in report["results"]):
            report["results"].append(record)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            build = functools.partial(builders[name], tiny=args.tiny)
            record = measure(name, build, args, device, dtype, Path(tmp) / name, save)
            save(record)
            print(json.dumps(record), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    print(f"{'model':14s} {'dense s':>8s} {'learning s':>10s} {'x dense':>7s} {'sparse s':>9s} {'GPU x':>6s} "
          f"{'host +GB':>8s} {'calibrate s':>11s} {'its host +GB':>12s}")
    nan = float("nan")
    for r in report["results"]:
        calibration = r.get("calibrate", {})
        print(f"{r['model']:14s} {r.get('dense_s', nan):8.1f} {r['learning_s']:10.1f} "
              f"{r.get('learning_over_dense', nan):7.2f} {(r['sparse_s'] or [nan])[-1]:9.1f} "
              f"{r.get('learning_gpu_over_dense', nan):6.2f} "
              f"{added(r['learning_host_peak_gb'], r['host_rss_before_gb']):8.2f} "
              f"{calibration.get('seconds', nan):11.1f} "
              f"{added(calibration.get('host_peak_gb'), calibration.get('host_rss_before_gb')):12.2f}")


if __name__ == "__main__":
    main()
