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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..layout import ORDERS, TokenLayout
from ..modes import modes_problem
from ..plan import Plan, bucket_edges_problem, bucket_index, default_bucket_edges, expert_plan_path, model_fingerprint
from .accumulate import CalibrationResult, StatsAccumulator
from .block_stats import block_stats
from .selection import METRICS

STATS_SUFFIX = ".stats.safetensors"


@dataclass
class CalibrationConfig:
    density: float = 0.3  # target mean block density of the masks
    qk: str = "bf16"  # quantization the plan asks for (recorded; also turns on the incoherence term)
    pv: str = "bf16"
    block_size: int = 64
    # query block of the masks, a multiple of block_size (None: block_size). 128 with 64-key blocks
    # runs the kernels' fastest D=128 tiles (BENCHMARKS.md); coarser masks, 1.0-2.4 dB
    # at the same density on the small demo model (QUALITY.md), not measured on a real checkpoint
    query_block: int | None = None
    steps: int = 50  # denoising steps of each calibration run
    height: int | None = None  # generation size; None: the pipeline's default
    width: int | None = None
    frames: int | None = None
    num_buckets: int = 6  # default edges: timesteps above 500 in num_buckets-1 buckets, one for the rest
    bucket_edges: list[float] | None = None  # descending timesteps on 0..1000; overrides num_buckets
    # capture statistics at every k-th step (the pipeline still runs every step). 2 keeps a full-size
    # CogVideoX-5B or Wan2.1-1.3B calibration (2 prompts x 50 steps) under 10 minutes on one H200
    # (BENCHMARKS.md, Calibration); each bucket still sees 2-3 steps of every prompt
    stat_every: int = 2
    metric: str = "mass"
    # weight of the incoherence term in the "mass" metric. 0 by default: on planted heads it made
    # unquantized picks worse and quantized ones no better (BENCHMARKS.md, Calibration)
    quant_weight: float = 0.0
    alpha: float = 0.5  # the paper metric's weight of the sparse term
    # mask budget options (selection.build_masks): layers run densely, paid for out of the same
    # budget (negative indices count from the end); the share of `density` every other layer gets
    # before the global competition; growth of the chosen blocks by this many blocks
    dense_layers: list[int] = field(default_factory=list)
    layer_floor: float = 0.0
    dilation: int = 0
    # budget between timestep buckets (`density` is the mean over denoising steps, each bucket counted by
    # its steps): the fewest leading (noisiest) buckets holding this share of the steps keep every block and
    # run densely, paid for by the other buckets; and one budget over all buckets instead of one per bucket
    dense_steps: float = 0.0
    shared_budget: bool = False
    eps: float = 1e-3  # "small" threshold of P for the block-sparse score
    seed: int = 0
    backend: str = "auto"  # statistics backend: "auto", "triton", "torch"
    store_device: str = "auto"  # where per-bucket sums live: "auto", "cpu", "cuda"
    figure_layers: list[int] | None = None  # layers whose block maps go to the stats file; None: first, middle, last
    # one pipeline call with every prompt as a batch (the demo model's quality study) instead of
    # one call per prompt
    batch_prompts: bool = False
    # device of the seeded generator; None: the pipeline's (a pipeline drawing its noise on the CPU
    # whatever its device, as the demo model does, needs "cpu")
    generator_device: str | None = None
    pipeline_kwargs: dict = field(default_factory=dict)  # extra keyword arguments for every pipeline call

    def validate(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if problem := modes_problem(self.qk, self.pv):
            raise ValueError(problem)
        if self.metric not in METRICS:
            raise ValueError(f"metric={self.metric!r}; expected one of {METRICS}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.query_block is not None and (self.query_block < self.block_size or self.query_block % self.block_size
                                             or self.query_block & (self.query_block - 1)):
            raise ValueError(f"query_block must be a power-of-two multiple of block_size {self.block_size}, "
                             f"got {self.query_block}")
        if not 0.0 <= self.layer_floor <= 1.0 or self.dilation < 0:
            raise ValueError(f"layer_floor must be in [0, 1] and dilation >= 0, got {self.layer_floor} and "
                             f"{self.dilation}")
        if not 0.0 <= self.dense_steps < 1.0:
            raise ValueError(f"dense_steps must be a share of the denoising steps in [0, 1), got {self.dense_steps}")
        if self.dense_steps >= self.density and self.density < 1.0:
            raise ValueError(f"dense_steps {self.dense_steps} spends all of density {self.density} (the mean density "
                             "over steps) on the dense steps: lower dense_steps or raise the density")
        if self.steps < 1 or self.stat_every < 1:
            raise ValueError(f"steps and stat_every must be >= 1, got {self.steps} and {self.stat_every}")
        problem = bucket_edges_problem([float(e) for e in self.edges()])
        if problem:
            raise ValueError(problem)

    def edges(self) -> list[float]:
        return list(self.bucket_edges) if self.bucket_edges is not None else default_bucket_edges(self.num_buckets)


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


def _call_kwargs(pipe, config: CalibrationConfig, prompt: str | list[str], on_step_end) -> dict:
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


def _store_device(config: CalibrationConfig, stats_device: torch.device, estimated_bytes: int) -> torch.device:
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

    config: CalibrationConfig
    layout: TokenLayout
    prompts: list[str]
    model_class: str
    model_fingerprint: str
    accumulators: dict[str, StatsAccumulator]
    extras: bool  # max and below-eps statistics captured too (paper metric, incoherence term)
    timings: dict
    expert: str = ""
    # denoising steps in each bucket (every step the expert ran, captured or not), summed over pipeline calls;
    # None: unknown (the plan then weighs buckets by their captured steps)
    bucket_steps: list[int] | None = None


class _ExpertCapture:
    """The statistics of one transformer of the pipeline while it runs: its accumulators (made at its first
    captured call), the bucket of its current step and whether it ran in that step."""

    def __init__(self, expert: str, transformer, layers: int, config: CalibrationConfig, edges: list[float],
                 order_sets: dict[str, list[int]], extras: bool):
        self.expert, self.transformer, self.layers = expert, transformer, layers
        self.config, self.edges, self.order_sets, self.extras = config, edges, order_sets, extras
        self.layout: TokenLayout | None = None
        self.acc: StatsAccumulator | None = None
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


def capture_experts(pipe, prompts: list[str], config: CalibrationConfig | None = None, *,
                    order_sets: dict[str, list[int]] | None = None, extras: bool | None = None,
                    progress: bool = False) -> list[CapturedStats]:
    """`capture` of every denoising transformer of the pipeline in the same runs: one `CapturedStats` per
    expert (`pipeline_experts` order), each with the statistics of the steps its expert ran (Wan 2.2 A14B:
    `transformer` at t >= boundary_ratio * 1000, `transformer_2` below). Buckets are the config's on both
    sides of the switch; a bucket an expert never runs gets the mean of its captured steps."""
    from ..pipelines import capture_attention, pipeline_experts, self_attention_layers
    from ..pipelines.registry import expert_role

    config = replace(config) if config is not None else CalibrationConfig()  # a copy: the stats keep its settings
    config.validate()
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    order_sets = {name: [int(o) for o in orders] for name, orders in (order_sets or {}).items()}
    for name, orders in order_sets.items():
        if name == "all" or not orders or any(not 0 <= o < len(ORDERS) for o in orders):
            raise ValueError(f"order set {name!r}: {orders}; expected a name other than 'all' and indices into "
                             f"ORDERS (0..{len(ORDERS) - 1})")
    if extras is None:
        extras = config.metric == "paper" or config.quant_weight > 0
    edges = config.edges()
    experts = [_ExpertCapture(name, transformer, len(self_attention_layers(transformer)), config, edges, order_sets,
                              extras)
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
            model_fingerprint=model_fingerprint(expert.transformer.config), accumulators=accumulators, extras=extras,
            timings=expert_timings, expert=expert.expert, bucket_steps=list(expert.bucket_steps),
        ))
    return results


def capture(pipe, prompts: list[str], config: CalibrationConfig | None = None, *,
            order_sets: dict[str, list[int]] | None = None, extras: bool | None = None, progress: bool = False
            ) -> CapturedStats:
    """Run `pipe` densely on `prompts` (one call per prompt, or one batched call with
    `config.batch_prompts`) and accumulate the block statistics of softmax(QK^T) of every
    self-attention layer at every `config.stat_every`-th step, for every candidate order and,
    separately, for each of `order_sets` (name -> indices into ORDERS).

    `extras` (default: what `config.metric` and `config.quant_weight` need) also accumulates the
    per-block maxima and counts below eps, so `plan_from_stats` can then use the paper metric or the
    incoherence term. A pipeline with an expert pair needs `capture_experts`."""
    from ..pipelines import pipeline_experts

    experts = [name for name, _ in pipeline_experts(pipe)]
    if len(experts) > 1:
        raise ValueError(f"{type(pipe).__name__} runs {len(experts)} transformers ({', '.join(experts)}): "
                         "capture them in one run with capture_experts (or calibrate_experts)")
    return capture_experts(pipe, prompts, config, order_sets=order_sets, extras=extras, progress=progress)[0]


def plan_from_stats(stats: CapturedStats, density: float | None = None, *, qk: str | None = None,
                    pv: str | None = None, metric: str | None = None, quant_weight: float | None = None,
                    alpha: float | None = None, orders: str = "all", compute_device: str | torch.device | None = None,
                    dense_layers: list[int] | None = None, layer_floor: float | None = None,
                    dilation: int | None = None, dense_steps: float | None = None, shared_budget: bool | None = None,
                    log=None) -> tuple[Plan, CalibrationResult]:
    """(Plan, CalibrationResult) from captured statistics, without running the pipeline again: each
    head's order chosen among the candidates of the accumulator `orders` ("all", or a name given to
    `capture(order_sets=...)`), masks at `density`. Arguments left None take the capture config's.
    `dense_layers` are flagged dense in every bucket, their masks full (density 1), and the other layers
    share what is left of the budget (`Plan.achieved_density` is the mean over the sparse layers alone).
    `density` is the mean over denoising steps (`stats.bucket_steps` weigh the buckets); `dense_steps`: the
    leading buckets holding that share of the steps are flagged dense in every layer, their masks full, the
    other buckets sparser; `shared_budget`: one budget over all buckets. The plan records the buckets kept
    dense and each bucket's density (`info["dense_buckets"]`, `info["bucket_density"]`)."""
    config = stats.config
    density = config.density if density is None else density
    qk, pv = config.qk if qk is None else qk, config.pv if pv is None else pv
    metric = config.metric if metric is None else metric
    quant_weight = config.quant_weight if quant_weight is None else quant_weight
    alpha = config.alpha if alpha is None else alpha
    dense_layers = list(config.dense_layers if dense_layers is None else dense_layers)
    layer_floor = config.layer_floor if layer_floor is None else layer_floor
    dilation = config.dilation if dilation is None else dilation
    dense_steps = config.dense_steps if dense_steps is None else dense_steps
    shared_budget = config.shared_budget if shared_budget is None else shared_budget
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if not 0.0 <= dense_steps < 1.0:
        raise ValueError(f"dense_steps must be a share of the denoising steps in [0, 1), got {dense_steps}")
    if problem := modes_problem(qk, pv):
        raise ValueError(problem)
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}; expected one of {METRICS}")
    if (metric == "paper" or quant_weight > 0) and not stats.extras:
        raise ValueError(f"metric={metric!r} with quant_weight={quant_weight} needs the max and below-eps "
                         "statistics: capture with extras=True")
    if orders not in stats.accumulators:
        raise ValueError(f"no statistics for the order set {orders!r}; captured: {sorted(stats.accumulators)}")
    acc, layout = stats.accumulators[orders], stats.layout
    L = acc.num_layers
    start = time.perf_counter()
    figure_layers = config.figure_layers if config.figure_layers is not None else sorted({0, L // 2, L - 1})
    # selection runs on the GPU even when the sums live in host memory (as timed in BENCHMARKS.md)
    if compute_device is None:
        compute_device = "cuda" if torch.cuda.is_available() else "cpu"
    result = acc.finalize(
        density, layout.prefix, metric=metric, quant_weight=quant_weight, alpha=alpha,
        compute_device=compute_device, figure_layers=figure_layers, suffix=layout.suffix, layer_floor=layer_floor,
        dilation=dilation, dense_layers=dense_layers, bucket_steps=stats.bucket_steps, dense_steps=dense_steps,
        shared_budget=shared_budget,
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
    settings.update(density=density, qk=qk, pv=pv, metric=metric, quant_weight=quant_weight, alpha=alpha,
                    dense_layers=result.dense_layers, layer_floor=layer_floor, dilation=dilation,
                    dense_steps=dense_steps, shared_budget=shared_budget)
    if orders != "all":
        settings["order_set"] = orders
    plan = Plan(
        model_class=stats.model_class,
        model_fingerprint=stats.model_fingerprint,
        layout=layout,
        block_size=acc.mask_block,
        orders=result.orders,
        block_mask=result.block_mask,
        bucket_edges=config.edges(),
        qk=qk,
        pv=pv,
        target_density=density,
        density=result.density,
        dense=dense,
        prompts=list(stats.prompts),
        expert=stats.expert,
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


def calibrate(pipe, prompts: list[str], config: CalibrationConfig | None = None, *, progress: bool = False,
              log=None) -> tuple[Plan, CalibrationResult]:
    """Run `pipe` densely on `prompts`, capture attention statistics, and return the plan with the
    calibration result (per-head scores, kept attention mass, figure maps): `capture` then
    `plan_from_stats` with the config's settings."""
    stats = capture(pipe, prompts, config, progress=progress)
    return plan_from_stats(stats, log=log)


def calibrate_experts(pipe, prompts: list[str], config: CalibrationConfig | None = None, *, progress: bool = False,
                      log=None) -> list[tuple[Plan, CalibrationResult]]:
    """`calibrate` of every denoising transformer of the pipeline in the same runs (`capture_experts`): one
    (plan, result) per expert, each plan naming its expert (`Plan.expert`)."""
    return [plan_from_stats(stats, log=log) for stats in capture_experts(pipe, prompts, config, progress=progress)]


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
    from safetensors.torch import save_file

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
    save_file(tensors, str(stats), metadata={"paroattn_stats": "1"})
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
