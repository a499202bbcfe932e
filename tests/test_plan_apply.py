"""`apply` checks again what the processor will read of a plan: a plan changed after loading (masks emptied,
orders or bucket edges out of range) is refused with a PlanError instead of giving another video."""

import math

import pytest
import torch

from paroattn import PlanError
from paroattn.plan import BlockMasks, Plan


@pytest.fixture(scope="module")
def demo_pipe():
    from paroattn.demo_model.model import load_demo_pipeline

    return load_demo_pipeline()


def _shipped() -> Plan:
    from paroattn.app.demo import SHIPPED_DENSITIES, shipped_plan_path

    return Plan.load(shipped_plan_path(SHIPPED_DENSITIES[0]))


def _sparse_pair(plan: Plan) -> tuple[int, int]:
    bucket, layer = (int(i) for i in (~plan.dense).nonzero()[0])
    return bucket, layer


def _empty_a_row(plan):
    bucket, layer = _sparse_pair(plan)
    plan.block_mask[bucket, layer, 1, 2] = False


def _all_false(plan):
    plan.block_mask = torch.zeros_like(plan.block_mask)


def _order_out_of_range(plan):
    plan.orders[0, 1] = 6


def _nan_edge(plan):
    plan.bucket_edges[1] = math.nan


def _edges_out_of_order(plan):
    plan.bucket_edges[1], plan.bucket_edges[2] = plan.bucket_edges[2], plan.bucket_edges[1]


def _masks_of_another_shape(plan):
    plan.block_mask = plan.masks.head_slice(0, 1)


CHANGES = {
    "emptied row": (_empty_a_row, r"empty row \(bucket \d+, layer \d+, head 1, query block 2\)"),
    "all-False masks": (_all_false, "empty row"),
    "order out of range": (_order_out_of_range, r"orders must hold values in 0\.\.5 .* changed after loading"),
    "NaN bucket edge": (_nan_edge, "bucket_edges must be finite numbers"),
    "edges out of order": (_edges_out_of_order, "strictly descending"),
    "masks of another shape": (_masks_of_another_shape, "plan masks must be .* changed after loading"),
}


def test_apply_takes_the_plan_as_loaded(demo_pipe):
    from paroattn.pipelines import apply

    with apply(demo_pipe, _shipped(), backend="torch"):
        pass


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_apply_refuses_a_plan_changed_after_loading(demo_pipe, change):
    from paroattn.pipelines import apply

    plan = _shipped()
    edit, message = CHANGES[change]
    edit(plan)
    with pytest.raises(PlanError, match=message):
        apply(demo_pipe, plan, backend="torch")


def test_an_emptied_row_of_a_layer_the_plan_runs_dense_is_not_read_and_not_refused():
    plan = _shipped()
    plan.dense[0, 0] = True
    plan.block_mask[0, 0, 0, 0] = False
    plan.validate_for_apply()
    plan.dense[0, 0] = False
    with pytest.raises(PlanError, match=r"empty row \(bucket 0, layer 0, head 0, query block 0\)"):
        plan.validate_for_apply()


def test_the_check_at_apply_does_not_scan_masks_scanned_at_load_again(monkeypatch):
    plan = _shipped()
    assert plan.masks.form == "chunks" and plan.masks.counts is not None

    def no_scan(*args, **kwargs):
        raise AssertionError("scanned again")
    monkeypatch.setattr(BlockMasks, "scan", no_scan)
    plan.validate_for_apply()  # packed masks cannot change: the load's scan stands
    plan.block_mask  # unpacked: the tensor can be edited in place from now on, so it is scanned
    with pytest.raises(AssertionError, match="scanned again"):
        plan.validate_for_apply()
