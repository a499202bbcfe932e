"""`StatsRecorder`: the public capture API for hosts that run the model themselves (a node graph, a custom sampler)."""

from __future__ import annotations

import pytest
import torch

from paroattn import ORDERS, Plan, TokenLayout
from paroattn.calibrate import CaptureConfig, SelectionConfig, StatsRecorder, plan_from_stats
from paroattn.calibrate.synthetic import planted_qk
from paroattn.plan import model_fingerprint

LAYOUT = TokenLayout(0, 6, 8, 8)
# [layer][head] -> the axis the head is local along, with some locality along the next one; the order that keeps a
# query's keys nearest puts the third axis outermost and the local axis innermost
PLANTED = [[0, 1, 2, 2], [2, 0, 1, 0]]
PLANTED_ORDER = {0: "WHF", 1: "FWH", 2: "HFW"}
CONFIG = {"num_attention_heads": 4, "attention_head_dim": 32, "num_layers": 2, "_name_or_path": "somewhere"}


def _record(recorder: StatsRecorder, steps: int, timesteps) -> None:
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        for layer, axes in enumerate(PLANTED):
            q, k = planted_qk(LAYOUT, axes, secondary=[0.8] * len(axes), generator=g)
            recorder.record(layer, q, k, LAYOUT, timesteps[step])
        recorder.step_done()
    recorder.prompt_done()


@pytest.mark.slow
def test_a_host_fed_recorder_gives_a_plan_with_the_planted_orders_and_the_model_config(tmp_path):
    capture = CaptureConfig(block_size=16, num_buckets=2, stat_every=1, profile_queries=64, backend="torch")
    recorder = StatsRecorder(2, capture, model_class="Planted", model_config=CONFIG, expert="transformer_2")
    _record(recorder, 4, [1000.0, 900.0, 400.0, 100.0])
    stats = recorder.stats(["a prompt"])
    assert stats.bucket_steps == [2, 2]
    plan, result = plan_from_stats(stats, SelectionConfig(density=0.3), compute_device="cpu")
    assert [[ORDERS[int(o)] for o in layer] for layer in plan.orders] == [[PLANTED_ORDER[a] for a in axes]
                                                                            for axes in PLANTED]
    assert plan.model_class == "Planted" and plan.expert == "transformer_2"
    # the config is recorded without where it came from, and the fingerprint is the config's
    assert plan.info["model_config"] == {k: v for k, v in CONFIG.items() if k != "_name_or_path"}
    assert plan.model_fingerprint == model_fingerprint(CONFIG)
    assert plan.profiles is not None and plan.info["steps_per_bucket"] == [2, 2]
    plan.save(tmp_path / "plan.safetensors")
    assert Plan.load(tmp_path / "plan.safetensors").info["model_config"]["attention_head_dim"] == 32


@pytest.mark.slow
def test_statistics_are_kept_every_stat_every_steps_of_each_prompt():
    capture = CaptureConfig(block_size=16, num_buckets=1, stat_every=2, profile_queries=0, backend="torch")
    recorder = StatsRecorder(2, capture)
    for _ in range(2):  # two prompts of 3 steps: steps 0 and 2 of each are kept
        _record(recorder, 3, [900.0, 800.0, 700.0])
    assert recorder.captures == 2 * 2 * 2  # prompts x kept steps x layers
    assert recorder.bucket_steps == [6]  # every step the model ran counts for the bucket weights


@pytest.mark.parametrize("order_steps", [None, 1])
def test_statistics_of_head_slices_joined_in_order_are_those_of_every_head(order_steps):
    """Under Ulysses each process records its slice of the heads; joined along the heads in rank order
    (`calibrate.parallel`), the slices' statistics are one recorder's of every head, and give its plan."""
    from paroattn.calibrate.parallel import join_heads

    layout = TokenLayout(0, 4, 4, 8)
    capture = CaptureConfig(block_size=16, num_buckets=2, stat_every=1, profile_queries=32, backend="torch",
                            extras=order_steps is None, order_steps=order_steps)
    whole, *slices = (StatsRecorder(2, capture, model_class="Planted", model_config=CONFIG) for _ in range(3))
    g = torch.Generator().manual_seed(0)
    for timestep in (900.0, 700.0, 200.0):
        for layer, axes in enumerate(PLANTED):
            q, k = planted_qk(layout, axes, secondary=[0.8] * len(axes), generator=g)
            whole.record(layer, q, k, layout, timestep)
            for part, recorder in enumerate(slices):
                recorder.record(layer, q[:, 2 * part:2 * part + 2], k[:, 2 * part:2 * part + 2], layout, timestep)
        for recorder in (whole, *slices):
            recorder.step_done()
    stats = [recorder.stats(["a prompt"]) for recorder in (whole, *slices)]
    second = []  # the second slice's statistics, in the order the join asks for them
    join_heads(stats[2], lambda tensor, dim: second.append(tensor) or tensor)
    join_heads(stats[1], lambda tensor, dim: torch.cat([tensor, second.pop(0)], dim))
    assert second == []
    # the paper metric reads the joined maxima and counts too; orders chosen while capturing need the mass metric
    selection = SelectionConfig(density=0.4, metric="paper" if order_steps is None else "mass")
    expected, _ = plan_from_stats(stats[0], selection, compute_device="cpu")
    joined, _ = plan_from_stats(stats[1], selection, compute_device="cpu")
    assert joined.num_heads == 4 and len(set(expected.orders.flatten().tolist())) > 1  # heads that differ, in order
    assert torch.equal(joined.orders, expected.orders) and torch.equal(joined.block_mask, expected.block_mask)
    for ours, theirs in zip(joined.profiles, expected.profiles, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_recorder_refuses_calls_it_cannot_use():
    recorder = StatsRecorder(2, CaptureConfig(block_size=16, stat_every=1, backend="torch"))
    q, k = planted_qk(LAYOUT, [0, 1])
    with pytest.raises(ValueError, match="layer 2 is outside the recorder's 2"):
        recorder.record(2, q, k, LAYOUT, 500.0)
    with pytest.raises(ValueError, match=r"N = 384 tokens"):
        recorder.record(0, q[:, :, :100], k[:, :, :100], LAYOUT, 500.0)
    with pytest.raises(RuntimeError, match="no self-attention call was recorded"):
        recorder.stats(["a prompt"])
    recorder.record(0, q, k, LAYOUT, 500.0)
    other = TokenLayout(0, 6, 8, 4)
    q2, k2 = planted_qk(other, [0, 1])
    with pytest.raises(RuntimeError, match="two token layouts"):
        recorder.record(1, q2, k2, other, 500.0)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        StatsRecorder(0)


def _one_call(batch: int = 1):
    """Layer 0's planted q, k of one video, repeated `batch` times."""
    q, k = planted_qk(LAYOUT, PLANTED[0], secondary=[0.8] * 4, generator=torch.Generator().manual_seed(0))
    return q[:1].expand(batch, -1, -1, -1), k[:1].expand(batch, -1, -1, -1)


def test_sampled_query_rows_move_to_the_next_phase_at_each_call_of_a_layer():
    """With query_stride s the calls of a layer sample rows r = phase (mod s) in turn: s calls of the same q, k
    average to the exact block mass (a fixed phase would sample the same rows every time)."""
    q, k = _one_call()
    means = []
    for stride in (1, 4):
        recorder = StatsRecorder(1, CaptureConfig(block_size=16, num_buckets=1, stat_every=1, query_stride=stride,
                                                  profile_queries=0, backend="torch"))
        for _ in range(stride):
            recorder.record(0, q, k, LAYOUT, 900.0)
            recorder.step_done()
        means.append(recorder.acc.mean_map(0, 0, "cpu"))
    torch.testing.assert_close(means[1], means[0], rtol=1e-4, atol=1e-5)


def test_maps_are_weighted_by_the_batch_items_they_sum():
    """A call of batch B adds B items: the same video once at B = 1 and again at B = 3 (CFG batched, say) keeps its
    map, not a mean that counts the second call once."""
    q1, k1 = _one_call(batch=1)
    q3, k3 = _one_call(batch=3)
    recorder = StatsRecorder(1, CaptureConfig(block_size=16, num_buckets=1, stat_every=1, profile_queries=0,
                                              backend="torch"))
    recorder.record(0, q1, k1, LAYOUT, 900.0)
    recorder.step_done()
    single = recorder.acc.mean_map(0, 0, "cpu").clone()
    recorder.record(0, q3, k3, LAYOUT, 900.0)
    recorder.step_done()
    torch.testing.assert_close(recorder.acc.mean_map(0, 0, "cpu"), single, rtol=1e-4, atol=1e-5)


def test_a_step_in_which_the_model_did_not_run_is_not_counted_for_its_bucket():
    """Of an expert pair, the expert that did not run in a step counts no step for the bucket weights."""
    q, k = _one_call()
    recorder = StatsRecorder(1, CaptureConfig(block_size=16, num_buckets=2, stat_every=1, profile_queries=0,
                                              backend="torch"))
    recorder.record(0, q, k, LAYOUT, 900.0)
    recorder.step_done()
    recorder.step_done()  # the other expert's step
    assert recorder.bucket_steps == [1, 0]


def test_axis_profiles_are_taken_once_per_bucket_and_layer_of_each_prompt():
    q, k = _one_call()
    recorder = StatsRecorder(1, CaptureConfig(block_size=16, num_buckets=1, stat_every=1, profile_queries=64,
                                              backend="torch"))
    counts = []
    for _ in range(2):  # two prompts of two steps in one bucket
        for _ in range(2):
            recorder.record(0, q, k, LAYOUT, 900.0)
            recorder.step_done()
        recorder.prompt_done()
        counts.append(sum(float(count.sum()) for count in recorder.profiles.count))
    assert counts[0] > 0 and counts[1] == 2 * counts[0]
