"""Calibration: choose each head's token order and the static block masks from a few prompts.

    from paroattn.calibrate import CaptureConfig, SelectionConfig, StatsRecorder, calibrate, plan_from_stats
    plan, result = calibrate(pipe, ["a prompt", "another"], CaptureConfig(steps=50), SelectionConfig(density=0.3))
    # the cheap capture (paro calibrate's): a few steps per bucket, sampled query rows, orders narrowed after one bucket
    plan, result = calibrate(pipe, prompts, CaptureConfig(steps=50, **CHEAP), SelectionConfig(density=0.3))
    plan.save("plan.safetensors")
    # a host that runs the model itself (a node graph, a custom sampler) hands over each self-attention call
    recorder = StatsRecorder(num_layers, CaptureConfig(), model_class="WanTransformer3DModel", model_config=config)
    recorder.record(layer, q, k, layout, timestep); recorder.step_done(); recorder.prompt_done()
    plan, result = plan_from_stats(recorder.stats(prompts), SelectionConfig(density=0.3))
    # a pipeline with an expert pair (Wan 2.2 A14B): one plan per expert from the same runs
    pairs = calibrate_experts(pipe, prompts, CaptureConfig(), SelectionConfig(density=0.3))

Options, one record per stage, each checked when made (`config.py`). Stages (one module each): capture
(`driver.py`, through `paroattn.pipelines.capture_attention`, into `recorder.py`'s `StatsRecorder`, which other
hosts feed directly),
block statistics of softmax(QK^T) for every candidate order (`block_stats.py`, Triton, with the
torch reference in `block_stats_reference.py`), averaging over prompts and steps per timestep bucket
(`accumulate.py`), order metrics and masks under one global budget (`paroattn/plan/selection.py`, shared with the plans derived for
other sizes), figures
(`figures.py`). `synthetic.py` plants locality in q, k for tests and the metric study.
"""

from ..plan.selection import METRICS, build_masks, order_scores
from .accumulate import CalibrationResult, StatsAccumulator
from .block_stats import block_stats
from .config import CHEAP, CaptureConfig, ConfigError, SelectionConfig
from .recorder import CapturedStats, StatsRecorder

__all__ = [
    "CHEAP",
    "METRICS",
    "CalibrationResult",
    "CaptureConfig",
    "CapturedStats",
    "ConfigError",
    "SelectionConfig",
    "StatsAccumulator",
    "StatsRecorder",
    "block_stats",
    "build_masks",
    "calibrate",
    "calibrate_experts",
    "order_scores",
    "plan_from_stats",
]


def __getattr__(name):
    # the driver imports diffusers through paroattn.pipelines; load it only when asked for
    if name in ("calibrate", "calibrate_experts", "plan_from_stats", "save_calibration"):
        from . import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'paroattn.calibrate' has no attribute {name!r}")
