"""The options of a calibration, one record per stage, each checked once when it is made.

- `CaptureConfig`: what the dense runs are and which statistics they keep (generation size, steps,
  timestep buckets, block size, ...). Changing any of them means running the pipeline again.
- `SelectionConfig`: how orders and masks are chosen from captured statistics (density, quantization
  the plan asks for, order metric, budget options). `plan_from_stats(stats, selection)` applies one to
  a capture in about a second, so one capture serves any number of selections.

Both are frozen dataclasses validated in `__post_init__` (so `dataclasses.replace` re-checks the
result); a bad value raises `ConfigError`, a ValueError that names the option, the value and what was
expected, which `paro calibrate` turns into a message about its flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..modes import modes_problem
from ..plan import bucket_edges_problem, default_bucket_edges
from ..plan.selection import METRICS


class ConfigError(ValueError):
    """A calibration option out of range: `option` (the field name), `value`, and `reason`, which says what was
    expected and reads after "<option> <value>: "."""

    def __init__(self, option: str, value, reason: str):
        self.option, self.value, self.reason = option, value, reason
        super().__init__(f"{option} {value}: {reason}")


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


# The cheap capture (docs/notes/calibration-capture.md), `paro calibrate`'s and plan="auto"'s: at most 2 steps per
# timestep bucket of each prompt, every 8th query row, every order in the first bucket and each head's best 2 after
# it: `CaptureConfig(**CHEAP)`. On the demo model its plans are within 0.5 dB of the full capture's or above, from 2
# prompts or 1 (QUALITY.md); `CaptureConfig()`'s own defaults are the full capture
CHEAP = {"steps_per_bucket": 2, "stat_every": 1, "calls": "all", "query_stride": 8, "keep_orders": 2}


@dataclass(frozen=True)
class CaptureConfig:
    """The dense calibration runs and the statistics they keep."""

    block_size: int = 64  # statistics come in square blocks of this many tokens
    # query block of the masks, a power-of-two multiple of block_size (None: block_size); 128 with 64-token key
    # blocks runs the kernels' fastest head-dim-128 tiles (BENCHMARKS.md), with coarser masks (QUALITY.md)
    query_block: int | None = None
    steps: int = 50  # denoising steps of each calibration run
    height: int | None = None  # generation size; None: the pipeline's default
    width: int | None = None
    frames: int | None = None
    num_buckets: int = 6  # default edges: timesteps above 500 in num_buckets-1 buckets, one for the rest
    bucket_edges: tuple[float, ...] | None = None  # descending timesteps on 0..1000; overrides num_buckets
    # capture statistics at every k-th step (the pipeline still runs every step); what each setting costs and
    # how many steps per bucket it leaves: BENCHMARKS.md, Calibration
    stat_every: int = 2
    # at most this many captured steps per timestep bucket of each prompt, every `stat_every`-th step counted from
    # the bucket's first step (None: every stat_every-th step of the prompt, counted from its first step)
    steps_per_bucket: int | None = None
    # "first": only the first call of each layer in a step, the conditional one in pipelines that call the
    # transformer once per guidance branch, cond first (diffusers' Wan pipelines, the demo model); "all": every call
    calls: str = "all"
    # estimate each block's mass from every query_stride-th query row of it (the rows rotate over calls): about
    # 2/query_stride of the cost of one order per order; 1: every row, the exact statistics
    query_stride: int = 1
    # choose each head's order from the mass statistics of all orders at the first `order_steps` steps the model
    # runs (of the first prompt), then capture only the chosen order's maps: 6x less memory and compute for the
    # masks. None: every order at every captured step, the order chosen when the plan is built
    order_steps: int | None = None
    # after the first timestep bucket the capture records, keep each head's `keep_orders` best orders (by the mass
    # their best `order_density` blocks keep in that bucket) and capture only those from then on: the plan chooses
    # among them from every bucket's maps. Fewer statistics to compute and hold than every order to the end, without
    # deciding from the first steps alone as `order_steps` does. None: every order to the end
    keep_orders: int | None = None
    # capture only the first `capture_buckets` timestep buckets each prompt reaches; the masks of the later buckets
    # are then those buckets' mean (as any bucket without captured steps borrows): what a generation learns that
    # would run sparse from its next bucket on. None: every bucket
    capture_buckets: int | None = None
    # the density whose kept mass chooses the orders with `order_steps` or `keep_orders`; None: the selection's
    # density where the calibration knows it (`calibrate`, plan="auto"), else 0.3
    order_density: float | None = None
    # also keep per-block maxima and counts below `eps` (the paper metric and the incoherence term need them)
    extras: bool = False
    eps: float = 1e-3  # "small" threshold of P for the block-sparse score
    # grid queries per captured layer call whose attention gives the axis profiles that let the plan derive
    # masks for other sizes (`shapes.py`); 0: none (the plan then serves only the calibrated size)
    profile_queries: int = 1024
    seed: int = 0
    backend: str = "auto"  # statistics backend: "auto", "triton", "torch"
    # where per-bucket sums live: "auto" (with order_steps: host memory; else the GPU when they take under a quarter
    # of its free memory), "cpu", "cuda"
    store_device: str = "auto"
    # one pipeline call with every prompt as a batch (the demo model's quality study) instead of one call per prompt
    batch_prompts: bool = False
    # device of the seeded generator; None: the pipeline's (a pipeline drawing its noise on the CPU whatever its
    # device, as the demo model does, needs "cpu")
    generator_device: str | None = None
    pipeline_kwargs: dict = field(default_factory=dict)  # extra keyword arguments for every pipeline call

    def __post_init__(self):
        if not _power_of_two(self.block_size) or self.block_size < 16:
            raise ConfigError("block_size", self.block_size, "expected a power of two >= 16")
        if self.query_block is not None and (self.query_block < self.block_size or self.query_block % self.block_size
                                             or not _power_of_two(self.query_block)):
            raise ConfigError("query_block", self.query_block,
                              f"expected a power-of-two multiple of the block size {self.block_size}")
        if self.profile_queries < 0:
            raise ConfigError("profile_queries", self.profile_queries, "expected a number of queries >= 0 (0: none)")
        for name in ("steps", "stat_every", "num_buckets"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "expected an integer >= 1")
        for name in ("height", "width", "frames"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(name, value, "expected a positive size, or None for the pipeline's default")
        if self.bucket_edges is not None:
            object.__setattr__(self, "bucket_edges", tuple(float(e) for e in self.bucket_edges))
            if problem := bucket_edges_problem(list(self.bucket_edges)):
                raise ConfigError("bucket_edges", list(self.bucket_edges), problem.removeprefix("bucket_edges "))
        if not 0.0 < self.eps < 1.0:
            raise ConfigError("eps", self.eps, "expected a probability in (0, 1)")
        if self.backend not in ("auto", "triton", "torch"):
            raise ConfigError("backend", self.backend, "expected 'auto', 'triton' or 'torch'")
        if self.store_device not in ("auto", "cpu", "cuda"):
            raise ConfigError("store_device", self.store_device, "expected 'auto', 'cpu' or 'cuda'")
        if self.steps_per_bucket is not None and self.steps_per_bucket < 1:
            raise ConfigError("steps_per_bucket", self.steps_per_bucket,
                              "expected an integer >= 1, or None for every stat_every-th step")
        if self.calls not in ("all", "first"):
            raise ConfigError("calls", self.calls, "expected 'all' or 'first' (the first call of each layer per step)")
        if not _power_of_two(self.query_stride) or self.query_stride > self.block_size:
            raise ConfigError("query_stride", self.query_stride,
                              f"expected a power of two from 1 to the block size {self.block_size}")
        if self.query_stride > 1 and self.extras:
            raise ConfigError("query_stride", self.query_stride,
                              "sampled query rows estimate the block mass only, and extras=True asks for the "
                              "per-block maxima too: use query_stride=1 with extras")
        if self.order_steps is not None and self.order_steps < 1:
            raise ConfigError("order_steps", self.order_steps,
                              "expected an integer >= 1, or None to keep every order's statistics to the end")
        if self.order_steps is not None and self.extras:
            raise ConfigError("order_steps", self.order_steps,
                              "orders chosen during the capture use the mass metric alone, and extras=True asks "
                              "for the statistics of the paper metric: use order_steps=None with extras")
        if self.keep_orders is not None:
            if not 1 <= self.keep_orders <= 6:
                raise ConfigError("keep_orders", self.keep_orders,
                                  "expected a number of orders from 1 to 6, or None to keep every order")
            if self.order_steps is not None:
                raise ConfigError("keep_orders", self.keep_orders,
                                  f"order_steps={self.order_steps} already keeps one order per head from its first "
                                  "steps: set one of the two")
            if self.extras:
                raise ConfigError("keep_orders", self.keep_orders,
                                  "the orders it drops lose the statistics of the paper metric that extras=True "
                                  "asks for: use keep_orders=None with extras")
        if self.capture_buckets is not None and not 1 <= self.capture_buckets <= len(self.edges()) - 1:
            raise ConfigError("capture_buckets", self.capture_buckets,
                              f"expected a number of timestep buckets from 1 to {len(self.edges()) - 1}, or None for "
                              "every bucket")
        if self.order_density is not None and not 0.0 < self.order_density <= 1.0:
            raise ConfigError("order_density", self.order_density,
                              "expected a share of the attention blocks in (0, 1], or None")

    def edges(self) -> list[float]:
        return list(self.bucket_edges) if self.bucket_edges is not None else default_bucket_edges(self.num_buckets)


@dataclass(frozen=True)
class SelectionConfig:
    """How each head's order and the block masks are chosen from captured statistics."""

    density: float = 0.3  # target mean block density of the masks over denoising steps
    qk: str = "bf16"  # quantization the plan asks for
    pv: str = "bf16"
    metric: str = "mass"  # order metric (`selection.METRICS`)
    # weight of the incoherence term in the "mass" metric; 0 by default (BENCHMARKS.md, Calibration)
    quant_weight: float = 0.0
    alpha: float = 0.5  # the paper metric's weight of the sparse term
    # candidate orders: "all", or the name of an order set given to `capture(order_sets=...)`
    order_set: str = "all"
    # mask budget options (`selection.build_masks`): layers run densely, paid for out of the same budget
    # (negative indices count from the end); the share of `density` every other layer gets before the global
    # competition; growth of the chosen blocks by this many blocks
    dense_layers: tuple[int, ...] = ()
    layer_floor: float = 0.0
    dilation: int = 0
    # budget between timestep buckets: the fewest leading (noisiest) buckets holding this share of the steps
    # keep every block, paid for by the other buckets; and one budget over all buckets instead of one per bucket
    dense_steps: float = 0.0
    shared_budget: bool = False
    # the number of GPUs the plan will run on under Ulysses: each layer's blocks spread evenly over their slices of
    # the heads (`selection.balance_masks`; 1: as the budget chose them)
    ulysses: int = 1
    figure_layers: tuple[int, ...] | None = None  # layers whose block maps go to the stats file; None: first, middle, last

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", tuple(int(x) for x in self.dense_layers))
        if self.figure_layers is not None:
            object.__setattr__(self, "figure_layers", tuple(int(x) for x in self.figure_layers))
        if not 0.0 < self.density <= 1.0:
            raise ConfigError("density", self.density, "expected a share of the attention blocks in (0, 1]")
        if problem := modes_problem(self.qk, self.pv):
            raise ConfigError("qk/pv", f"{self.qk}/{self.pv}", problem)
        if self.metric not in METRICS:
            raise ConfigError("metric", self.metric, f"expected one of {', '.join(METRICS)}")
        if self.quant_weight < 0:
            raise ConfigError("quant_weight", self.quant_weight, "expected a weight >= 0 (0 turns the term off)")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError("alpha", self.alpha, "expected a weight in [0, 1]")
        if not 0.0 <= self.layer_floor <= 1.0:
            raise ConfigError("layer_floor", self.layer_floor,
                              "expected a share of the density in [0, 1] (0, the default, turns it off)")
        if self.dilation < 0:
            raise ConfigError("dilation", self.dilation, "expected a number of blocks >= 0 (0, the default, turns it off)")
        if not 0.0 <= self.dense_steps < 1.0:
            raise ConfigError("dense_steps", self.dense_steps,
                              "expected a share of the denoising steps in [0, 1) (0, the default, turns it off)")
        if self.ulysses < 1:
            raise ConfigError("ulysses", self.ulysses,
                              "expected a number of GPUs >= 1 (1, the default, leaves the masks as the budget chose them)")
        if self.dense_steps >= self.density and self.density < 1.0:
            raise ConfigError("dense_steps", self.dense_steps,
                              f"spends all of the density {self.density} (the mean density over steps) on the dense "
                              "steps: lower the dense steps or raise the density")

    @property
    def needs_extras(self) -> bool:
        """Whether the capture must keep the per-block maxima and counts below eps."""
        return self.metric == "paper" or self.quant_weight > 0
