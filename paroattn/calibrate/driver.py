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
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..layout import ORDERS
from ..plan import Plan, expert_plan_path
from ..plan.selection import BALANCED_RANKS, ranks_problem
from .accumulate import CalibrationResult
from .config import CaptureConfig, SelectionConfig
from .recorder import CapturedStats, StatsRecorder

STATS_SUFFIX = ".stats.safetensors"


# seconds between two progress lines when stderr is not a terminal (a log), where rich's bars would show only at the end
LOG_PERIOD_S = 30.0


class _Progress:
    """Three progress bars (prompts, steps, layers): rich's on a terminal; elsewhere (a log file, a pipe) a line
    every `LOG_PERIOD_S` seconds and one at the end; or nothing."""

    def __init__(self, enabled: bool, num_prompts: int, steps: int, layers: int, stream=None):
        import sys

        self.bar = None
        self.lines = None
        if not enabled:
            return
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        if not (isatty and isatty()):
            self.totals = {"prompts": num_prompts, "steps": steps, "layers": layers}
            self.lines = dict.fromkeys(self.totals, 0)
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
        self.start = self.printed = time.monotonic()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        if self.lines is not None and exc[0] is None:
            self._print_line()

    def update(self, task: str, **kwargs) -> None:
        if self.bar is not None:
            self.bar.update(getattr(self, task), **kwargs)
        elif self.lines is not None and "completed" in kwargs:
            self.lines[task] = kwargs["completed"]
            if time.monotonic() - self.printed >= LOG_PERIOD_S:
                self._print_line()

    def _print_line(self) -> None:
        self.printed = time.monotonic()
        done = ", ".join(f"{task} {self.lines[task]}/{total}" for task, total in self.totals.items())
        print(f"calibration: {done}, {self.printed - self.start:.0f} s", file=self.stream, flush=True)


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
    experts = [(name, transformer, StatsRecorder(len(self_attention_layers(transformer)), config,
                                                 model_class=type(transformer).__name__,
                                                 model_config=transformer.config, expert=name, order_sets=order_sets))
               for name, transformer in pipeline_experts(pipe)]
    timings = {"pipeline_s": 0.0}

    def callback(recorder: StatsRecorder):
        def on_capture(layer, q, k, layout, timestep, suffix_mask):
            recorder.record(layer, q, k, layout, timestep, suffix_mask)
            bar.update("layers", completed=layer + 1)
        return on_capture

    def on_step_end(pipeline, step, timestep, callback_kwargs):
        for _, _, recorder in experts:
            recorder.step_done()
        bar.update("steps", completed=step + 1)
        return {}

    calls = [list(prompts)] if config.batch_prompts else list(prompts)
    bar = _Progress(progress, len(prompts), config.steps, max(r.layers for _, _, r in experts))
    with bar, torch.no_grad(), ExitStack() as stack:
        for _, transformer, recorder in experts:
            stack.enter_context(capture_attention(transformer, callback(recorder)))
        for i, prompt in enumerate(calls):
            bar.update("steps", completed=0)
            start = time.perf_counter()
            pipe(**_call_kwargs(pipe, config, prompt, on_step_end))
            timings["pipeline_s"] += time.perf_counter() - start
            for _, _, recorder in experts:
                recorder.prompt_done()
            bar.update("prompts", completed=len(prompts) if config.batch_prompts else i + 1)
    results = []
    for name, _, recorder in experts:
        if not recorder.recorded:
            if len(experts) == 1:
                raise RuntimeError("the pipeline ran but no self-attention call was captured; is this a supported model?")
            raise RuntimeError(
                f"expert {name} ({expert_role(pipe, name)}) ran in no captured step of "
                f"{config.steps} steps with statistics every {config.stat_every}: raise the steps or lower stat_every"
            )
        results.append(recorder.stats(prompts, timings))
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
    other buckets sparser; `shared_budget`: one budget over all buckets; `ulysses` > 1: each layer's blocks spread
    evenly over that many GPUs' slices of the heads (`paroattn.plan.balance`). The plan records the buckets kept
    dense and each bucket's density (`info["dense_buckets"]`, `info["bucket_density"]`), and the GPUs it is
    balanced for (`info["balanced_ranks"]`)."""
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
        shared_budget=s.shared_budget, ranks=s.ulysses,
    )
    dense = torch.zeros(result.block_mask.shape[:2], dtype=torch.bool)
    dense[:, result.dense_layers] = True
    dense[result.dense_buckets, :] = True
    timings = dict(stats.timings, select_s=time.perf_counter() - start)
    empty = [b for b, n in enumerate(result.steps_per_bucket) if n == 0]
    if empty and log is not None:
        who = f"{stats.expert}: " if stats.expert else ""
        log(f"{who}warning: no captured step fell in buckets {empty}; they use the mean over all captured steps. "
            + empty_buckets_advice(empty, config, stats.bucket_steps))
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
            **({BALANCED_RANKS: s.ulysses} if s.ulysses > 1 else {}),
        },
    )
    if stats.model_config is not None:
        plan.info["model_config"] = stats.model_config
    return plan, result


def empty_buckets_advice(empty: list[int], config: CaptureConfig, bucket_steps: list[int] | None) -> str:
    """What fills the timestep buckets `empty` that no captured step fell in: capturing every step where the
    pipeline ran steps in them (`--stat-every 1`), more steps where it ran none, or fewer or wider buckets."""
    edges = config.edges()
    ran = [b for b in empty if bucket_steps is not None and bucket_steps[b] > 0]
    never = [b for b in empty if b not in ran]
    advice = []
    if ran:
        advice.append(f"the pipeline ran steps in buckets {ran} but statistics were captured every "
                      f"{config.stat_every} steps: pass --stat-every 1 to capture every step")
    if never:
        spans = ", ".join(f"({edges[b + 1]:g}, {edges[b]:g}]" for b in never)
        narrowest = min(edges[b] - edges[b + 1] for b in never)
        fewer = max(1, len(edges) - 1 - len(never))
        advice.append(f"none of the {config.steps} denoising steps fell in buckets {never} (timesteps {spans}): "
                      f"raise --steps (a bucket {narrowest:g} timesteps wide takes about {-(-1000 // narrowest):g} "
                      f"evenly spaced steps or more; shifted schedules need more) or pass --buckets {fewer} "
                      "(or wider --bucket-edges)")
    return "To fill every bucket: " + "; ".join(advice) + "."


def capture_for(capture_config: CaptureConfig | None, selection: SelectionConfig) -> CaptureConfig:
    """The capture config, with the extra statistics turned on when the selection needs them (and with them every
    order's exact statistics, which they are kept for), and the orders chosen during the capture at the selection's
    density."""
    capture_config = capture_config if capture_config is not None else CaptureConfig()
    if selection.needs_extras and not capture_config.extras:
        capture_config = replace(capture_config, extras=True, order_steps=None, keep_orders=None, query_stride=1)
    chooses = capture_config.order_steps is not None or capture_config.keep_orders is not None
    if chooses and capture_config.order_density is None:
        capture_config = replace(capture_config, order_density=selection.density)
    return capture_config


def _check_ulysses(pipe, selection: SelectionConfig) -> None:
    """Refuse, before anything is captured, a number of GPUs to balance the masks over that does not divide the heads."""
    if selection.ulysses == 1:
        return
    from ..pipelines import pipeline_experts
    from ..pipelines.registry import require_family

    for _, transformer in pipeline_experts(pipe):
        if problem := ranks_problem(require_family(transformer).num_heads(transformer), selection.ulysses):
            raise ValueError(f"ulysses={selection.ulysses}: {problem}")


def calibrate(pipe, prompts: list[str], capture_config: CaptureConfig | None = None,
              selection: SelectionConfig | None = None, *, progress: bool = False,
              log=None) -> tuple[Plan, CalibrationResult]:
    """Run `pipe` densely on `prompts`, capture attention statistics, and return the plan with the
    calibration result (per-head scores, kept attention mass, figure maps): `capture` then
    `plan_from_stats(stats, selection)`."""
    selection = selection if selection is not None else SelectionConfig()
    _check_ulysses(pipe, selection)
    stats = capture(pipe, prompts, capture_for(capture_config, selection), progress=progress)
    return plan_from_stats(stats, selection, log=log)


def calibrate_experts(pipe, prompts: list[str], capture_config: CaptureConfig | None = None,
                      selection: SelectionConfig | None = None, *, progress: bool = False,
                      log=None) -> list[tuple[Plan, CalibrationResult]]:
    """`calibrate` of every denoising transformer of the pipeline in the same runs (`capture_experts`): one
    (plan, result) per expert, each plan naming its expert (`Plan.expert`)."""
    selection = selection if selection is not None else SelectionConfig()
    _check_ulysses(pipe, selection)
    captured = capture_experts(pipe, prompts, capture_for(capture_config, selection), progress=progress)
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


def calibration_outputs(path: str | Path, experts: list[str] | tuple[str, ...] = ("transformer",)) -> list[Path]:
    """Every file `save_expert_calibrations` writes for `experts` at `path`: each expert's plan and its stats file."""
    plans = [expert_plan_path(path, expert) for expert in experts]
    return [file for plan in plans for file in (plan, stats_path_for(plan))]


def save_expert_calibrations(calibrations: list[tuple[Plan, CalibrationResult]], path: str | Path
                             ) -> list[tuple[Path, Path]]:
    """`save_calibration` of each expert's plan: the first expert's at `path`, the others beside it
    (`expert_plan_path`); with more than one, every plan lists every file (`info["experts"]`) so that
    `load_plans` reads the pair from either. Every file is written under a temporary name and renamed once all
    are written (`written_together`): an interrupted save leaves the earlier files as they were."""
    from ..files import written_together

    paths = [expert_plan_path(path, plan.expert) for plan, _ in calibrations]
    if len(calibrations) > 1:
        for plan, _ in calibrations:
            plan.info["experts"] = {p.expert: target.name for (p, _), target in zip(calibrations, paths)}
    pairs = [(target, stats_path_for(target)) for target in paths]
    with written_together(*[file for pair in pairs for file in pair]) as partial:
        for i, ((plan, result), (target, stats)) in enumerate(zip(calibrations, pairs)):
            _write_calibration(plan, result, stats, partial[2 * i], partial[2 * i + 1])
    return pairs


def save_calibration(plan: Plan, result: CalibrationResult, path: str | Path) -> tuple[Path, Path]:
    """Write the plan and, beside it, the statistics that `paro inspect --png` draws: block-mass
    maps (averaged over steps and prompts) in the original and the chosen order for the figure
    layers, kept attention mass per (bucket, layer, head) and the order scores. The plan records
    its stats file's name (`info["stats_file"]`; readers look for that name beside the plan) and, for
    information, its absolute path. Both are written under temporary names and renamed together."""
    from ..files import written_together

    path = Path(path)
    stats = stats_path_for(path)
    with written_together(path, stats) as (plan_partial, stats_partial):
        _write_calibration(plan, result, stats, plan_partial, stats_partial)
    return path, stats


def _write_calibration(plan: Plan, result: CalibrationResult, stats: Path, plan_file: Path, stats_file: Path) -> None:
    """The plan into `plan_file` and its statistics into `stats_file`, the plan naming `stats` (the stats file's
    final path) as its stats file."""
    from ..plan import write_safetensors

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
    write_safetensors(tensors, stats_file, {"paroattn_stats": "1"})
    plan.save(plan_file)


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
