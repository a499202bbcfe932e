"""The capture driver: run the dense pipeline on the calibration prompts and build plans.

`capture` runs the pipeline with the capture processors: at every captured denoising step each
self-attention layer's q, k (after norms and RoPE) go to `block_stats`, whose per-tile results go
into the accumulators and are dropped with q and k; no attention map is ever materialized.
`plan_from_stats` then chooses each head's order and builds the masks of every timestep bucket
(`accumulate.py`) for any density, quantization and order metric, in about a second and without
running the pipeline again; one capture can also feed accumulators of chosen order sets (FHW alone,
say) to compare calibrated orders with them. `calibrate` is the two in a row.

The pipeline runs with `output_type="latent"` where it accepts it: the VAE decode is not needed.
"""

from __future__ import annotations

import inspect
import math
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..layout import ORDERS, TokenLayout
from ..plan import Plan, bucket_index, expert_plan_path, model_fingerprint
from .accumulate import CalibrationResult, StatsAccumulator
from .block_stats import block_stats
from .config import CaptureConfig, SelectionConfig
from .shapes import ProfileAccumulator, offset_mass

STATS_SUFFIX = ".stats.safetensors"


class _Progress:
    """Three rich progress bars (prompts, steps, layers), or nothing."""

    def __init__(self, enabled: bool, num_prompts: int, steps: int, layers: int):
        self.bar = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            transient=False,
        )
        self.prompts = self.bar.add_task("prompts", total=num_prompts)
        self.steps = self.bar.add_task("steps", total=steps)
        self.layers = self.bar.add_task("layers", total=layers)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def update(self, task: str, **kwargs) -> None:
        if self.bar is not None:
            self.bar.update(getattr(self, task), **kwargs)


def _call_kwargs(pipe, config: CaptureConfig, prompt: str | list[str], on_step_end) -> dict:
    """Keyword arguments for `pipe(...)`, keeping only those its __call__ accepts."""
    accepted = inspect.signature(pipe.__call__).parameters
    device = config.generator_device
    if device is None:
        device = getattr(pipe, "_execution_device", None) or getattr(pipe, "device", torch.device("cpu"))
    generator = torch.Generator(device=torch.device(device).type if torch.device(device).type == "cuda" else "cpu")
    wanted = {
        "prompt": prompt,
        "num_inference_steps": config.steps,
        "height": config.height,
        "width": config.width,
        "num_frames": config.frames,
        "generator": generator.manual_seed(config.seed),
        "output_type": "latent",
        "callback_on_step_end": on_step_end,
    }
    wanted.update(config.pipeline_kwargs)
    return {k: v for k, v in wanted.items() if v is not None and k in accepted}


def _store_device(config: CaptureConfig, stats_device: torch.device, estimated_bytes: int) -> torch.device:
    if config.store_device != "auto":
        return torch.device(config.store_device)
    if stats_device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(stats_device)
        if estimated_bytes < 0.25 * free:
            return stats_device
    return torch.device("cpu")


@dataclass
class CapturedStats:
    """Block statistics of one dense capture of one transformer, from which `plan_from_stats` builds plans.

    `accumulators["all"]` holds every candidate order of the layout; any other entry, one of the
    order sets named in `capture(order_sets=...)` (e.g. `{"identity": [0]}`: FHW alone), fed from
    the same statistics. `expert`: the pipeline component the transformer is ("transformer",
    "transformer_2" of an expert pair; "" for a bare transformer)."""

    config: CaptureConfig
    layout: TokenLayout
    prompts: list[str]
    model_class: str
    model_fingerprint: str
    accumulators: dict[str, StatsAccumulator]
    timings: dict
    expert: str = ""
    # denoising steps in each bucket (every step the expert ran, captured or not), summed over pipeline calls;
    # None: unknown (the plan then weighs buckets by their captured steps)
    bucket_steps: list[int] | None = None
    profiles: ProfileAccumulator | None = None  # attention mass by axis offset (None: config.profile_queries 0)


class _ExpertCapture:
    """The statistics of one transformer of the pipeline while it runs: its accumulators (made at its first
    captured call), the bucket of its current step and whether it ran in that step."""

    def __init__(self, expert: str, transformer, layers: int, config: CaptureConfig, edges: list[float],
                 order_sets: dict[str, list[int]], extras: bool):
        self.expert, self.transformer, self.layers = expert, transformer, layers
        self.config, self.edges, self.order_sets, self.extras = config, edges, order_sets, extras
        self.layout: TokenLayout | None = None
        self.acc: StatsAccumulator | None = None
        self.profiles: ProfileAccumulator | None = None
        self.generator = torch.Generator().manual_seed(config.seed)  # which queries the profiles sample
        self.subsets: dict[str, tuple[StatsAccumulator, torch.Tensor]] = {}
        self.bucket = 0
        self.ran = False  # captured a call in the current step
        self.called = False  # ran in the current step, captured or not
        self.bucket_steps = [0] * (len(edges) - 1)  # denoising steps it ran in each bucket
        self.stats_s = 0.0
        self.captures = 0

    def start_accumulators(self, layout: TokenLayout, q: torch.Tensor) -> None:
        config, L, buckets = self.config, self.layers, len(self.edges) - 1
        orders = list(layout.distinct_orders())
        nb = math.ceil(layout.seq_len / config.block_size)
        estimate = buckets * L * q.shape[1] * len(orders) * nb * nb * 4
        store = _store_device(config, q.device, estimate)
        self.acc = StatsAccumulator(L, buckets, orders, layout.seq_len, config.block_size,
                                    store_device=store, query_block=config.query_block)
        if config.profile_queries:
            self.profiles = ProfileAccumulator(L, buckets, layout, q.shape[1])
        for name, subset in self.order_sets.items():
            missing = [ORDERS[o] for o in subset if o not in orders]
            if missing:
                raise ValueError(f"order set {name!r}: {missing} repeat other orders on the layout {layout}; "
                                 f"its distinct orders are {[ORDERS[o] for o in orders]}")
            slots = torch.tensor([orders.index(o) for o in subset])
            accumulator = StatsAccumulator(L, buckets, subset, layout.seq_len, config.block_size,
                                           store_device=store, query_block=config.query_block)
            self.subsets[name] = (accumulator, slots)

    def on_capture(self, step: int, layer: int, q: torch.Tensor, k: torch.Tensor, layout: TokenLayout,
                   timestep: float, suffix_mask: torch.Tensor | None = None) -> None:
        config = self.config
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise RuntimeError(
                f"calibration saw two token layouts ({self.layout} and {layout}); calibrate one "
                "generation size at a time"
            )
        self.bucket = bucket_index(self.edges, float(timestep))
        self.called = True
        if step % config.stat_every:
            return
        if self.acc is None:
            self.start_accumulators(layout, q)
        self.ran = True
        start = time.perf_counter()
        with torch.no_grad():
            mass, pmax, below = block_stats(
                q, k, layout, self.acc.candidate_orders, config.block_size, config.eps, backend=config.backend,
                extras=self.extras, suffix_mask=suffix_mask,
            )
            self.acc.add(layer, self.bucket, mass, pmax, below, batch=q.shape[0])
            if self.profiles is not None:
                self.profiles.add(layer, self.bucket, *offset_mass(
                    q, k, layout, config.profile_queries, self.generator, suffix_mask))
            for subset, slots in self.subsets.values():
                pick = slots.to(mass.device)
                subset.add(layer, self.bucket, mass[:, pick], None if pmax is None else pmax[:, pick],
                           None if below is None else below[:, pick], batch=q.shape[0])
        if q.device.type == "cuda":
            torch.cuda.synchronize(q.device)
        self.stats_s += time.perf_counter() - start
        self.captures += 1

    def step_done(self) -> None:
        if self.called:
            self.bucket_steps[self.bucket] += 1
        self.called = False
        if self.ran:
            for accumulator in [self.acc, *(a for a, _ in self.subsets.values())]:
                accumulator.step_done(self.bucket)
        self.ran = False


def capture_experts(pipe, prompts: list[str], config: CaptureConfig | None = None, *,
                    order_sets: dict[str, list[int]] | None = None, progress: bool = False) -> list[CapturedStats]:
    """`capture` of every denoising transformer of the pipeline in the same runs: one `CapturedStats` per
    expert (`pipeline_experts` order), each with the statistics of the steps its expert ran (Wan 2.2 A14B:
    `transformer` at t >= boundary_ratio * 1000, `transformer_2` below). Buckets are the config's on both
    sides of the switch; a bucket an expert never runs gets the mean of its captured steps."""
    from ..pipelines import capture_attention, pipeline_experts, self_attention_layers
    from ..pipelines.registry import expert_role

    config = config if config is not None else CaptureConfig()
    if not isinstance(config, CaptureConfig):
        raise TypeError(f"capture takes a CaptureConfig, got {type(config).__name__}")
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    order_sets = {name: [int(o) for o in orders] for name, orders in (order_sets or {}).items()}
    for name, orders in order_sets.items():
        if name == "all" or not orders or any(not 0 <= o < len(ORDERS) for o in orders):
            raise ValueError(f"order set {name!r}: {orders}; expected a name other than 'all' and indices into "
                             f"ORDERS (0..{len(ORDERS) - 1})")
    edges = config.edges()
    experts = [_ExpertCapture(name, transformer, len(self_attention_layers(transformer)), config, edges, order_sets,
                              config.extras)
               for name, transformer in pipeline_experts(pipe)]
    state = {"step": 0}
    timings = {"pipeline_s": 0.0}

    def callback(expert: _ExpertCapture):
        def on_capture(layer, q, k, layout, timestep, suffix_mask):
            expert.on_capture(state["step"], layer, q, k, layout, timestep, suffix_mask)
            bar.update("layers", completed=layer + 1)
        return on_capture

    def on_step_end(pipeline, step, timestep, callback_kwargs):
        for expert in experts:
            expert.step_done()
        state["step"] += 1
        bar.update("steps", completed=step + 1)
        return {}

    calls = [list(prompts)] if config.batch_prompts else list(prompts)
    bar = _Progress(progress, len(prompts), config.steps, max(e.layers for e in experts))
    with bar, torch.no_grad(), ExitStack() as stack:
        for expert in experts:
            stack.enter_context(capture_attention(expert.transformer, callback(expert)))
        for i, prompt in enumerate(calls):
            state["step"] = 0
            bar.update("steps", completed=0)
            start = time.perf_counter()
            pipe(**_call_kwargs(pipe, config, prompt, on_step_end))
            timings["pipeline_s"] += time.perf_counter() - start
            bar.update("prompts", completed=len(prompts) if config.batch_prompts else i + 1)
    results = []
    for expert in experts:
        if expert.acc is None:
            if len(experts) == 1:
                raise RuntimeError("the pipeline ran but no self-attention call was captured; is this a supported model?")
            raise RuntimeError(
                f"expert {expert.expert} ({expert_role(pipe, expert.expert)}) ran in no captured step of "
                f"{config.steps} steps with statistics every {config.stat_every}: raise the steps or lower stat_every"
            )
        expert_timings = dict(timings, stats_s=expert.stats_s, captured_layer_calls=expert.captures)
        accumulators = {"all": expert.acc, **{name: acc for name, (acc, _) in expert.subsets.items()}}
        results.append(CapturedStats(
            config=config, layout=expert.layout, prompts=list(prompts), model_class=type(expert.transformer).__name__,
            model_fingerprint=model_fingerprint(expert.transformer.config), accumulators=accumulators,
            timings=expert_timings, expert=expert.expert, bucket_steps=list(expert.bucket_steps),
            profiles=expert.profiles,
        ))
    return results


def capture(pipe, prompts: list[str], config: CaptureConfig | None = None, *,
            order_sets: dict[str, list[int]] | None = None, progress: bool = False) -> CapturedStats:
    """Run `pipe` densely on `prompts` (one call per prompt, or one batched call with
    `config.batch_prompts`) and accumulate the block statistics of softmax(QK^T) of every
    self-attention layer at every `config.stat_every`-th step, for every candidate order and,
    separately, for each of `order_sets` (name -> indices into ORDERS).

    `config.extras` also accumulates the per-block maxima and counts below eps, so `plan_from_stats` can
    then use the paper metric or the incoherence term. A pipeline with an expert pair needs `capture_experts`."""
    from ..pipelines import pipeline_experts

    experts = [name for name, _ in pipeline_experts(pipe)]
    if len(experts) > 1:
        raise ValueError(f"{type(pipe).__name__} runs {len(experts)} transformers ({', '.join(experts)}): "
                         "capture them in one run with capture_experts (or calibrate_experts)")
    return capture_experts(pipe, prompts, config, order_sets=order_sets, progress=progress)[0]


def plan_from_stats(stats: CapturedStats, selection: SelectionConfig | None = None, *,
                    compute_device: str | torch.device | None = None, log=None) -> tuple[Plan, CalibrationResult]:
    """(Plan, CalibrationResult) from captured statistics, without running the pipeline again: each
    head's order chosen among the candidates of the accumulator `selection.order_set` ("all", or a name
    given to `capture(order_sets=...)`), masks at `selection.density` (default: `SelectionConfig()`).
    `dense_layers` are flagged dense in every bucket, their masks full (density 1), and the other layers
    share what is left of the budget (`Plan.achieved_density` is the mean over the sparse layers alone).
    `density` is the mean over denoising steps (`stats.bucket_steps` weigh the buckets); `dense_steps`: the
    leading buckets holding that share of the steps are flagged dense in every layer, their masks full, the
    other buckets sparser; `shared_budget`: one budget over all buckets. The plan records the buckets kept
    dense and each bucket's density (`info["dense_buckets"]`, `info["bucket_density"]`)."""
    selection = selection if selection is not None else SelectionConfig()
    if not isinstance(selection, SelectionConfig):
        raise TypeError(f"plan_from_stats takes a SelectionConfig, got {type(selection).__name__}")
    config = stats.config
    if selection.needs_extras and not config.extras:
        raise ValueError(f"metric={selection.metric!r} with quant_weight={selection.quant_weight} needs the max and "
                         "below-eps statistics: capture with CaptureConfig(extras=True)")
    orders = selection.order_set
    if orders not in stats.accumulators:
        raise ValueError(f"no statistics for the order set {orders!r}; captured: {sorted(stats.accumulators)}")
    acc, layout = stats.accumulators[orders], stats.layout
    L = acc.num_layers
    start = time.perf_counter()
    figure_layers = list(selection.figure_layers) if selection.figure_layers is not None else sorted({0, L // 2, L - 1})
    # selection runs on the GPU even when the sums live in host memory (as timed in BENCHMARKS.md)
    if compute_device is None:
        compute_device = "cuda" if torch.cuda.is_available() else "cpu"
    s = selection
    result = acc.finalize(
        s.density, layout.prefix, metric=s.metric, quant_weight=s.quant_weight, alpha=s.alpha,
        compute_device=compute_device, figure_layers=figure_layers, suffix=layout.suffix, layer_floor=s.layer_floor,
        dilation=s.dilation, dense_layers=s.dense_layers, bucket_steps=stats.bucket_steps, dense_steps=s.dense_steps,
        shared_budget=s.shared_budget,
    )
    dense = torch.zeros(result.block_mask.shape[:2], dtype=torch.bool)
    dense[:, result.dense_layers] = True
    dense[result.dense_buckets, :] = True
    timings = dict(stats.timings, select_s=time.perf_counter() - start)
    empty = [b for b, n in enumerate(result.steps_per_bucket) if n == 0]
    if empty and log is not None:
        who = f"{stats.expert}: " if stats.expert else ""
        log(f"{who}warning: no captured step fell in buckets {empty}; they use the mean over all captured steps")
    settings = {k: v for k, v in asdict(config).items() if k != "pipeline_kwargs"}
    settings.update(asdict(selection), dense_layers=result.dense_layers, figure_layers=figure_layers)
    if orders == "all":
        del settings["order_set"]
    plan = Plan(
        model_class=stats.model_class,
        model_fingerprint=stats.model_fingerprint,
        layout=layout,
        block_size=acc.mask_block,
        orders=result.orders,
        block_mask=result.block_mask,
        bucket_edges=config.edges(),
        qk=s.qk,
        pv=s.pv,
        target_density=s.density,
        density=result.density,
        dense=dense,
        prompts=list(stats.prompts),
        expert=stats.expert,
        profiles=None if stats.profiles is None else stats.profiles.finalize(),
        info={
            "calibration": settings,
            "candidate_orders": [ORDERS[o] for o in result.candidate_orders],
            "steps_per_bucket": result.steps_per_bucket,
            "step_shares": result.step_shares,
            "dense_buckets": result.dense_buckets,
            "bucket_density": result.bucket_density,
            "kept_mass": float(result.kept_mass.mean()),
            "kept_mass_min": float(result.kept_mass.min()),
            "timings": timings,
        },
    )
    return plan, result


def _capture_for(capture_config: CaptureConfig | None, selection: SelectionConfig) -> CaptureConfig:
    """The capture config, with the extra statistics turned on when the selection needs them."""
    capture_config = capture_config if capture_config is not None else CaptureConfig()
    if selection.needs_extras and not capture_config.extras:
        capture_config = replace(capture_config, extras=True)
    return capture_config


def calibrate(pipe, prompts: list[str], capture_config: CaptureConfig | None = None,
              selection: SelectionConfig | None = None, *, progress: bool = False,
              log=None) -> tuple[Plan, CalibrationResult]:
    """Run `pipe` densely on `prompts`, capture attention statistics, and return the plan with the
    calibration result (per-head scores, kept attention mass, figure maps): `capture` then
    `plan_from_stats(stats, selection)`."""
    selection = selection if selection is not None else SelectionConfig()
    stats = capture(pipe, prompts, _capture_for(capture_config, selection), progress=progress)
    return plan_from_stats(stats, selection, log=log)


def calibrate_experts(pipe, prompts: list[str], capture_config: CaptureConfig | None = None,
                      selection: SelectionConfig | None = None, *, progress: bool = False,
                      log=None) -> list[tuple[Plan, CalibrationResult]]:
    """`calibrate` of every denoising transformer of the pipeline in the same runs (`capture_experts`): one
    (plan, result) per expert, each plan naming its expert (`Plan.expert`)."""
    selection = selection if selection is not None else SelectionConfig()
    captured = capture_experts(pipe, prompts, _capture_for(capture_config, selection), progress=progress)
    return [plan_from_stats(stats, selection, log=log) for stats in captured]


def calibrate_sizes(pipe, prompts: list[str], capture_config: CaptureConfig | None = None,
                    selection: SelectionConfig | None = None, sizes: list[dict] | None = None, *,
                    progress: bool = False, log=None) -> list[tuple[Plan, CalibrationResult]]:
    """`calibrate_experts` at each of `sizes` (dicts of height / width / frames overriding the capture config's),
    merged into one plan per expert: the first size's plan, holding the others' as `extra_shapes` (their own
    orders, masks and axis profiles). Other sizes are derived from the closest of them when the plan is applied."""
    capture_config = capture_config if capture_config is not None else CaptureConfig()
    runs = [calibrate_experts(pipe, prompts, replace(capture_config, **size), selection, progress=progress, log=log)
            for size in (sizes or [{}])]
    first = runs[0]
    for expert, (plan, _) in enumerate(first):
        plan.extra_shapes = [run[expert][0] for run in runs[1:]]
        plan.validate()
    return first


def stats_path_for(plan_path: str | Path) -> Path:
    """`plan.safetensors` -> `plan.stats.safetensors` beside it."""
    plan_path = Path(plan_path)
    name = plan_path.name
    stem = name[: -len(".safetensors")] if name.endswith(".safetensors") else plan_path.stem
    return plan_path.with_name(stem + STATS_SUFFIX)


def save_expert_calibrations(calibrations: list[tuple[Plan, CalibrationResult]], path: str | Path
                             ) -> list[tuple[Path, Path]]:
    """`save_calibration` of each expert's plan: the first expert's at `path`, the others beside it
    (`expert_plan_path`); with more than one, every plan lists every file (`info["experts"]`) so that
    `load_plans` reads the pair from either."""
    paths = [expert_plan_path(path, plan.expert) for plan, _ in calibrations]
    if len(calibrations) > 1:
        for plan, _ in calibrations:
            plan.info["experts"] = {p.expert: target.name for (p, _), target in zip(calibrations, paths)}
    return [save_calibration(plan, result, target) for (plan, result), target in zip(calibrations, paths)]


def save_calibration(plan: Plan, result: CalibrationResult, path: str | Path) -> tuple[Path, Path]:
    """Write the plan and, beside it, the statistics that `paro inspect --png` draws: block-mass
    maps (averaged over steps and prompts) in the original and the chosen order for the figure
    layers, kept attention mass per (bucket, layer, head) and the order scores. The plan records
    where the stats file is (`info["stats_file"]`, absolute and by name)."""
    from ..plan import write_safetensors

    path = Path(path)
    stats = stats_path_for(path)
    plan.info["stats_file"] = {"name": stats.name, "path": str(stats.resolve())}
    tensors = {
        "kept_mass": result.kept_mass.float().contiguous(),
        "scores": result.scores.float().contiguous(),
        "candidate_orders": torch.tensor(result.candidate_orders, dtype=torch.int32),
        "figure_layers": torch.tensor(result.figure_layers, dtype=torch.int32),
    }
    if result.figure_original is not None:
        tensors["figure_original"] = result.figure_original.contiguous()
        tensors["figure_reordered"] = result.figure_reordered.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, stats, {"paroattn_stats": "1"})
    plan.save(path)
    return path, stats


# -- used by `paro calibrate` ------------------------------------------------------------------
# installed with the package (package data in pyproject.toml)
PROMPTS_DIR = Path(__file__).resolve().parents[1] / "assets" / "prompts"


def default_prompts_file(is_video: bool) -> Path:
    """`paroattn/assets/prompts/video.txt` or `image.txt`."""
    path = PROMPTS_DIR / ("video.txt" if is_video else "image.txt")
    if not path.is_file():
        raise FileNotFoundError(
            f"default prompt file {path} is missing (package data of paroattn; reinstall it): pass --prompts FILE"
        )
    return path


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Non-empty lines of a text file, `#` comments skipped; the first `limit` of them."""
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"{path} holds no prompts (one per line, '#' starts a comment)")
    return prompts[:limit] if limit else prompts


def describe_result(plan: Plan, result: CalibrationResult) -> str:
    """Lines for the end of `paro calibrate`: what the masks keep and what it cost."""
    t = plan.info.get("timings", {})
    kept = result.kept_mass
    lines = [
        f"attention mass inside the masks: mean {float(kept.mean()):.4f}, worst head {float(kept.min()):.4f}",
        "per bucket (mean over heads): " + ", ".join(
            f"{b}: d={float(plan.density[b].mean()):.3f} kept={float(kept[b].mean()):.4f}" for b in range(plan.num_buckets)
        ),
        f"captured steps per bucket (prompts x steps): {result.steps_per_bucket}",
    ]
    if result.dense_buckets:
        share = sum(result.step_shares[b] for b in result.dense_buckets)
        lines.append(f"dense buckets {result.dense_buckets} ({share:.2f} of the denoising steps, the model's own "
                     "attention), paid for by the others")
    lines += [
        f"time: pipeline {t.get('pipeline_s', 0):.1f} s (statistics inside it {t.get('stats_s', 0):.1f} s), "
        f"order selection and masks {t.get('select_s', 0):.1f} s",
    ]
    return "\n".join(lines)
