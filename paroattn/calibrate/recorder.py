"""Recording attention statistics from any code that runs a model: the public capture API.

`paro calibrate` drives a diffusers pipeline itself (`driver.capture_experts`); other hosts (a node graph, a
training loop, a custom sampler) run the model their own way and only need to hand over what each
self-attention call sees. A `StatsRecorder` takes those calls and gives the `CapturedStats` that
`plan_from_stats` turns into a plan, with the same statistics, accumulation and selection as `paro calibrate`:

    recorder = StatsRecorder(num_layers, CaptureConfig(steps=30), model_class="WanTransformer3DModel",
                             model_config=config)
    for prompt in prompts:                                   # the host's own loop
        for step in range(30):
            ...  # at each self-attention call of the dense model:
            recorder.record(layer, q, k, layout, timestep)   # q, k [B, H, N, D] after norms and RoPE; t on 0..1000
            ...
            recorder.step_done()                             # after each denoising step
        recorder.prompt_done()
    plan, result = plan_from_stats(recorder.stats(prompts), SelectionConfig(density=0.3))

`record` computes the block statistics of the call at once (never the attention map) and keeps nothing of q and
k. Statistics are kept at every `config.stat_every`-th step of each prompt, counted from its first step; with
`config.steps_per_bucket`, at most that many steps per timestep bucket of each prompt, every stat_every-th
counted from the bucket's first step. With `config.order_steps` the first steps the model runs choose each head's
order (all orders' mass, reduced at once to the share the best `order_density` of blocks keeps) and the later
steps capture that order alone. With `config.keep_orders` every order is captured in the first timestep bucket
the recorder sees, each head then keeps its `keep_orders` best there (by the same share), and the later buckets
capture those alone; the plan chooses among them from every bucket. `config.calls="first"` keeps the first call of
each layer in a step (the conditional one where the pipeline calls the model once per guidance branch, cond
first) and skips the others.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..layout import ORDERS, TokenLayout
from ..plan import bucket_index, model_config_record, model_fingerprint
from ..plan.selection import kept_mass_fraction, pool_query_blocks
from ..plan.shapes import ProfileAccumulator, offset_mass
from .accumulate import StatsAccumulator
from .block_stats import block_stats
from .config import CaptureConfig


def store_device(config: CaptureConfig, stats_device: torch.device, estimated_bytes: int) -> torch.device:
    """Where the accumulated statistics live: `config.store_device`, or with "auto" the GPU computing them when
    they take under a quarter of its free memory, else host memory."""
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
    # the model's config (`model_config_record`), recorded in the plan so that hosts other than diffusers can check
    # the plan against their model (head dim, channels); None: not known
    model_config: dict | None = None


class StatsRecorder:
    """The statistics of one transformer's self-attention calls while a host runs it: the accumulators (made at
    the first recorded call, when the token layout is known), the timestep bucket of the current step and
    whether the transformer ran in it (a step it skipped, as an expert of a pair does, is not counted for it).

    `num_layers`: self-attention layers, numbered 0..num_layers-1 in plan layer order. `model_class` and
    `model_config` name the model the plan is for (diffusers' class name and config: the plan's fingerprint
    is the config's). `order_sets`: name -> indices into ORDERS, extra candidate sets fed from the same
    statistics (see `capture`)."""

    def __init__(self, num_layers: int, config: CaptureConfig | None = None, *, model_class: str = "",
                 model_config: dict | None = None, expert: str = "", order_sets: dict[str, list[int]] | None = None):
        config = config if config is not None else CaptureConfig()
        if not isinstance(config, CaptureConfig):
            raise TypeError(f"StatsRecorder takes a CaptureConfig, got {type(config).__name__}")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int (the model's self-attention layers), got {num_layers!r}")
        self.layers, self.config, self.expert = num_layers, config, str(expert or "")
        self.model_class = str(model_class or "")
        self.model_config = None if model_config is None else model_config_record(model_config)
        self.edges = config.edges()
        self.order_sets = {name: [int(o) for o in orders] for name, orders in (order_sets or {}).items()}
        for name, orders in self.order_sets.items():
            if name == "all" or not orders or any(not 0 <= o < len(ORDERS) for o in orders):
                raise ValueError(f"order set {name!r}: {orders}; expected a name other than 'all' and indices into "
                                 f"ORDERS (0..{len(ORDERS) - 1})")
        if self.order_sets and config.order_steps is not None:
            raise ValueError(f"order sets ({', '.join(self.order_sets)}) need every order's statistics to the end; "
                             f"order_steps={config.order_steps} keeps only the chosen order's: capture with "
                             "order_steps=None")
        self.layout: TokenLayout | None = None
        self.acc: StatsAccumulator | None = None
        self.profiles: ProfileAccumulator | None = None
        self.generator = torch.Generator().manual_seed(config.seed)  # which queries the profiles sample
        self.subsets: dict[str, tuple[StatsAccumulator, torch.Tensor]] = {}
        self.step = 0  # denoising step of the current prompt
        self.bucket = 0
        self.ran = False  # recorded a call in the current step
        self.called = False  # ran in the current step, recorded or not
        self.bucket_steps = [0] * (len(self.edges) - 1)  # denoising steps it ran in each bucket
        self._stats_s = 0.0
        self._timers: list[_Timer] = []  # each captured call's statistics, read when asked (CUDA events)
        self.captures = 0
        self.mode: str | None = None  # what the current step captures: "order", "map" or None (decided at its first call)
        self.seen: set[int] = set()  # layers called in the current step
        self.layer_calls = [0] * num_layers  # captured calls per layer: the phase of the sampled query rows
        self.bucket_start: dict[int, int] = {}  # the first step of each bucket in the current prompt that may capture
        self.bucket_taken: dict[int, int] = {}  # captured steps of each bucket in the current prompt
        self.order_steps_done = 0  # steps of the order phase the model ran in
        self.order_kept: dict[int, torch.Tensor] = {}  # layer -> [H, O] sums of the kept mass share of each order
        self.order_calls = [0] * num_layers
        self.first_bucket: int | None = None  # the bucket whose maps narrow the orders (keep_orders)
        self.profiled: set[tuple[int, int]] = set()  # (bucket, layer) whose axis profiles this prompt sampled
        self.buckets_reached: list[int] = []  # the timestep buckets of the current prompt, in the order it reached them

    def _start_accumulators(self, layout: TokenLayout, q: torch.Tensor) -> None:
        config, L, buckets = self.config, self.layers, len(self.edges) - 1
        orders = list(layout.distinct_orders())
        nk = math.ceil(layout.seq_len / config.block_size)
        nq = math.ceil(layout.seq_len / (config.query_block or config.block_size))
        stored_orders = 1 if config.order_steps is not None else config.keep_orders or len(orders)
        estimate = buckets * L * q.shape[1] * stored_orders * nq * nk * 4
        store, staging = store_device(config, q.device, estimate), None
        if (config.order_steps is not None or config.keep_orders is not None) and config.store_device == "auto":
            # the kept orders' sums (1-2 GB at 480p-720p) stay in host memory, staged there too, so the GPU holds what
            # the dense generation holds; a captured call sends its maps over once (a few MB), in the background
            store = staging = torch.device("cpu")
        self.acc = StatsAccumulator(L, buckets, orders, layout.seq_len, config.block_size,
                                    store_device=store, query_block=config.query_block, staging_device=staging)
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

    def record(self, layer: int, q: torch.Tensor, k: torch.Tensor, layout: TokenLayout, timestep: float,
               suffix_mask: torch.Tensor | None = None) -> None:
        """One self-attention call of the dense model: q, k [B, H, N, D] after norms and RoPE (as the model
        attends), `layout` its TokenLayout, `timestep` on the 0..1000 scale, `suffix_mask` [B, suffix] (False at
        padded text keys after the grid) or None."""
        config = self.config
        if not 0 <= int(layer) < self.layers:
            raise ValueError(f"layer {layer} is outside the recorder's {self.layers} self-attention layers")
        if q.dim() != 4 or k.shape != q.shape or q.shape[2] != layout.seq_len:
            raise ValueError(f"q and k must be [B, H, N, D] with N = {layout.seq_len} tokens of the layout {layout}; "
                             f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise RuntimeError(
                f"calibration saw two token layouts ({self.layout} and {layout}); calibrate one "
                "generation size at a time"
            )
        self.bucket = bucket_index(self.edges, float(timestep))
        self.called = True
        if self.mode is None:
            self.mode = self._step_mode()
        first = layer not in self.seen
        self.seen.add(layer)
        if self.mode == "skip" or (config.calls == "first" and not first):
            return
        if self.acc is None:
            self._start_accumulators(layout, q)
        if self.mode == "map" and config.keep_orders is not None and self.acc.kept_slots is None:
            if self.first_bucket is None:
                self.first_bucket = self.bucket
            elif self.bucket != self.first_bucket:
                self._keep_orders(q.device)
        self.ran = True
        timer = _Timer(q.device)
        phase = self.layer_calls[layer] % config.query_stride
        self.layer_calls[layer] += 1
        sampled = {"query_stride": config.query_stride, "phase": phase, "backend": config.backend,
                   "suffix_mask": suffix_mask}
        with torch.no_grad():
            if self.mode == "order":
                mass, _, _ = block_stats(q, k, layout, self.acc.candidate_orders, config.block_size, config.eps,
                                         extras=False, **sampled)
                pooled = pool_query_blocks(mass, self.acc.mask_block[0] // config.block_size)
                density = config.order_density if config.order_density is not None else 0.3
                kept = kept_mass_fraction(pooled, density).float().cpu()
                self.order_kept[layer] = self.order_kept[layer] + kept if layer in self.order_kept else kept
                self.order_calls[layer] += 1
            else:
                if self.acc.kept_slots is not None:  # each head's kept orders, one pass per kept order
                    kept = [block_stats(q, k, layout, None, config.block_size, config.eps, extras=config.extras,
                                        head_orders=[self.acc.candidate_orders[int(s)] for s in slots], **sampled)
                            for slots in self.acc.kept_slots[layer].T]
                    mass, pmax, below = (None if kept[0][i] is None else torch.cat([stats[i] for stats in kept], 1)
                                         for i in range(3))
                else:
                    mass, pmax, below = block_stats(q, k, layout, self.acc.candidate_orders, config.block_size,
                                                    config.eps, extras=config.extras, **sampled)
                self.acc.add(layer, self.bucket, mass, pmax, below, batch=q.shape[0])
                if self.profiles is not None and (self.bucket, layer) not in self.profiled:
                    # once per bucket, layer and prompt: an axis profile is a mean over its sampled queries, and the
                    # steps of one bucket of one generation add little to it
                    self.profiled.add((self.bucket, layer))
                    self.profiles.add(layer, self.bucket, *offset_mass(
                        q, k, layout, config.profile_queries, self.generator, suffix_mask))
                for subset, slots in self.subsets.values():
                    pick = slots.to(mass.device)
                    subset.add(layer, self.bucket, mass[:, pick], None if pmax is None else pmax[:, pick],
                               None if below is None else below[:, pick], batch=q.shape[0])
        timer.stop()
        self._timers.append(timer)
        self.captures += 1

    @property
    def stats_s(self) -> float:
        """Seconds spent on the statistics: on a GPU, its time from each captured call's start to its end (waits for
        the last one)."""
        self._stats_s += sum(timer.seconds() for timer in self._timers)
        self._timers = []
        return self._stats_s

    def _step_mode(self) -> str:
        """What the current step captures: "order" (all orders' scores, before the orders are chosen), "map" (block
        maps for the masks) or "skip"."""
        config = self.config
        if config.order_steps is not None and (self.acc is None or self.acc.kept_slots is None):
            return "order"
        if self.bucket not in self.buckets_reached:
            self.buckets_reached.append(self.bucket)
        if config.capture_buckets is not None and self.buckets_reached.index(self.bucket) >= config.capture_buckets:
            return "skip"
        if config.steps_per_bucket is None:
            return "skip" if self.step % config.stat_every else "map"
        start = self.bucket_start.setdefault(self.bucket, self.step)
        if (self.step - start) % config.stat_every or self.bucket_taken.get(self.bucket, 0) >= config.steps_per_bucket:
            return "skip"
        return "map"

    def _choose_orders(self) -> None:
        """Each head's order from the order phase's scores: the most mass kept by the best `order_density` blocks."""
        missing = [layer for layer in range(self.layers) if layer not in self.order_kept]
        if missing:
            raise RuntimeError(f"no self-attention call of layers {missing} came in the {self.config.order_steps} "
                               "steps that choose the orders: every layer must run at every step")
        kept = torch.stack([self.order_kept[layer] / self.order_calls[layer] for layer in range(self.layers)])
        scores = 1.0 - kept  # [L, H, O], the mass metric
        self.acc.fix_orders(scores.argmin(dim=-1), scores)

    def _keep_orders(self, device: torch.device) -> None:
        """Narrow each head's candidates to its `keep_orders` best in the first bucket: the most mass kept by the best
        `order_density` blocks of the bucket's mean map (computed on `device`, the GPU during a generation)."""
        acc = self.acc
        missing = [layer for layer in range(self.layers) if acc.weight[self.first_bucket, layer] == 0]
        if missing:
            raise RuntimeError(f"no self-attention call of layers {missing} came in the first timestep bucket, whose "
                               "statistics narrow the orders (keep_orders): every layer must run at every step")
        density = self.config.order_density if self.config.order_density is not None else 0.3
        keep = min(self.config.keep_orders, len(acc.candidate_orders))
        slots = [kept_mass_fraction(acc.mean_map(self.first_bucket, layer, device), density).topk(keep, dim=-1)
                 .indices.cpu() for layer in range(self.layers)]
        acc.keep_orders(torch.stack(slots))

    def step_done(self) -> None:
        """The end of one denoising step (of every expert of a pipeline: one that did not run in it is not counted)."""
        if self.called:
            self.bucket_steps[self.bucket] += 1
        self.called = False
        if self.ran and self.mode == "order":
            self.order_steps_done += 1
            if self.order_steps_done >= self.config.order_steps:
                self._choose_orders()
        elif self.ran:
            for accumulator in [self.acc, *(a for a, _ in self.subsets.values())]:
                accumulator.step_done(self.bucket)
            self.bucket_taken[self.bucket] = self.bucket_taken.get(self.bucket, 0) + 1
        self.ran = False
        self.mode = None
        self.seen = set()
        self.step += 1

    def prompt_done(self) -> None:
        """The end of one generation: the next one counts its steps from 0 again. An order phase still running
        (a generation shorter than `order_steps`) ends here and chooses the orders from the steps it saw."""
        if self.order_kept and self.acc is not None and self.acc.kept_slots is None:
            self._choose_orders()
        self.step = 0
        self.bucket_start, self.bucket_taken = {}, {}
        self.profiled, self.buckets_reached = set(), []

    @property
    def recorded(self) -> bool:
        """Whether any call was recorded (statistics exist)."""
        return self.acc is not None

    def stats(self, prompts: list[str], timings: dict | None = None) -> CapturedStats:
        """What was recorded, for `plan_from_stats`. `prompts`: what the plan records it was calibrated on."""
        if self.acc is None:
            raise RuntimeError("no self-attention call was recorded: call record() at each self-attention call of the "
                               f"dense model at a step that is a multiple of stat_every={self.config.stat_every}")
        if self.order_kept and self.acc.kept_slots is None:
            self._choose_orders()
        if self.config.order_steps is not None and not self.acc.weight.any():
            raise RuntimeError(f"the orders were chosen in the first {self.config.order_steps} steps, and no later step "
                               "captured their maps: run more steps than order_steps")
        timings = dict(timings or {}, stats_s=self.stats_s, captured_layer_calls=self.captures)
        accumulators = {"all": self.acc, **{name: acc for name, (acc, _) in self.subsets.items()}}
        config = self.model_config
        return CapturedStats(
            config=self.config, layout=self.layout, prompts=list(prompts), model_class=self.model_class,
            model_fingerprint=model_fingerprint(config) if config is not None else "", accumulators=accumulators,
            timings=timings, expert=self.expert, bucket_steps=list(self.bucket_steps), profiles=self.profiles,
            model_config=config,
        )


class _Timer:
    """The time of one captured call's statistics, read without waiting for them: CUDA events on a GPU (read at the
    end), the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start = time.perf_counter()
        self.cpu_s = 0.0

    def stop(self) -> None:
        if self.events is None:
            self.cpu_s = time.perf_counter() - self.start
        else:
            self.events[1].record()

    def seconds(self) -> float:
        if self.events is None:
            return self.cpu_s
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1000
