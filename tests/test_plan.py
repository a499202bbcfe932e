import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from paroattn import Plan, PlanError, TokenLayout
from paroattn.plan import METADATA_KEY, BlockMasks, pack_bits, unpack_bits


def _plan(**overrides):
    args = dict(layout=TokenLayout(9, 3, 4, 5), num_layers=3, num_heads=4, density=0.4, orders="random",
                num_buckets=3, block_size=16, qk="int8", pv="fp8", model_class="TinyModel",
                model_fingerprint="abc123")
    args.update(overrides)
    return Plan.synthetic(**args)


def _rewrite(path, tensors=None, meta_update=None, raw_meta=None):
    """Write a copy of a plan file with some tensors or metadata changed."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
    stored = load_file(str(path))
    stored.update(tensors or {})
    meta.update(meta_update or {})
    save_file(stored, str(path), metadata={METADATA_KEY: raw_meta if raw_meta is not None else json.dumps(meta)})


def test_round_trip_is_bit_exact(tmp_path):
    plan = _plan()
    plan.prompts = ["a red circle moving left", "pan right"]
    plan.info = {"steps": [1, 2, 3], "metric": "mass"}
    path = tmp_path / "plan.safetensors"
    plan.save(path)
    loaded = Plan.load(path)
    assert torch.equal(loaded.block_mask, plan.block_mask)
    assert torch.equal(loaded.orders, plan.orders)
    assert torch.equal(loaded.density, plan.density)
    assert torch.equal(loaded.dense, plan.dense)
    for name in ("model_class", "model_fingerprint", "layout", "block_size", "bucket_edges", "qk", "pv", "k_scale",
                 "target_density", "prompts", "info", "format_version"):
        assert getattr(loaded, name) == getattr(plan, name), name


def test_k_scale_round_trips_and_files_without_it_read_as_per_block(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "plan.safetensors"
    _plan(k_scale="token").save(path)
    assert Plan.load(path).k_scale == "token"
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
    del meta["k_scale"]  # a file written before the option existed
    _rewrite(path, raw_meta=json.dumps(meta))
    assert Plan.load(path).k_scale == "block"
    _rewrite(path, meta_update={"k_scale": "channel"})
    with pytest.raises(PlanError, match="k_scale='channel' is not one of"):
        Plan.load(path)
    with pytest.raises(PlanError, match="k_scale='channel' is not one of"):
        _plan(k_scale="channel")


def test_masks_are_stored_packed_and_deflated_on_disk(tmp_path):
    plan = _plan(layout=TokenLayout(0, 8, 16, 16), block_size=64, num_layers=4, num_heads=8)
    path = tmp_path / "plan.safetensors"
    plan.save(path)
    stored = load_file(str(path))
    assert "block_mask_bits" not in stored and stored["block_mask_index"].shape == (3 * 4, 2)
    # one method byte per (bucket, layer) at most above the packed bits
    assert stored["block_mask_chunks"].numel() <= plan.block_mask.numel() / 8 + 3 * 4
    old = tmp_path / "old.safetensors"
    replace(plan, format_version=2).save(old)  # versions 1 and 2: one flat tensor of packed bits
    assert load_file(str(old))["block_mask_bits"].numel() * 8 >= plan.block_mask.numel()
    assert load_file(str(old))["block_mask_bits"].numel() < plan.block_mask.numel() / 7.9
    assert torch.equal(Plan.load(old).block_mask, plan.block_mask) and Plan.load(old).format_version == 2


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 11), (2, 8)])
def test_pack_bits_round_trips(shape):
    mask = torch.rand(shape) < 0.5
    assert torch.equal(unpack_bits(pack_bits(mask), shape), mask)


def test_bucket_of_follows_descending_edges():
    plan = _plan(num_buckets=3)  # edges 1000, 750, 500, 0
    assert plan.bucket_edges == [1000.0, 750.0, 500.0, 0.0]
    assert [plan.bucket_of(t) for t in (1000, 999, 750.5, 750, 501, 500, 10, 0)] == [0, 0, 0, 1, 1, 2, 2, 2]


def test_missing_file(tmp_path):
    with pytest.raises(PlanError, match="no plan file .*paro calibrate"):
        Plan.load(tmp_path / "nope.safetensors")


def test_truncated_file(tmp_path):
    path = tmp_path / "plan.safetensors"
    _plan().save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(PlanError, match="truncated or corrupt"):
        Plan.load(path)
    path.write_bytes(b"\x00" * 5)
    with pytest.raises(PlanError, match="truncated or corrupt"):
        Plan.load(path)


def test_file_that_is_not_a_plan(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"weight": torch.zeros(3)}, str(path))
    with pytest.raises(PlanError, match="not a paroattn plan"):
        Plan.load(path)


def test_newer_format_version(tmp_path):
    path = tmp_path / "plan.safetensors"
    _plan().save(path)
    _rewrite(path, meta_update={"format_version": 99})
    with pytest.raises(PlanError, match="version 99, newer .* upgrade paroattn"):
        Plan.load(path)


def test_inconsistent_shapes(tmp_path):
    path = tmp_path / "plan.safetensors"
    _plan().save(path)
    _rewrite(path, tensors={"orders": torch.zeros(3, 5, dtype=torch.int8)})
    with pytest.raises(PlanError, match=r"block_mask has shape .* expected"):
        Plan.load(path)
    _plan().save(path)
    _rewrite(path, meta_update={"layout": [9, 3, 4, 6]})
    with pytest.raises(PlanError, match=r"block_mask has shape \(3, 3, 4, 5, 5\); expected .* 81 tokens"):
        Plan.load(path)
    _plan().save(path)
    _rewrite(path, tensors={"density": torch.zeros(2, 3, 4)})
    with pytest.raises(PlanError, match="density must be"):
        Plan.load(path)


def test_orders_out_of_range(tmp_path):
    path = tmp_path / "plan.safetensors"
    _plan().save(path)
    _rewrite(path, tensors={"orders": torch.full((3, 4), 6, dtype=torch.int8)})
    with pytest.raises(PlanError, match=r"'orders' must be int8 with values in 0\.\.5 .*; found values 6: the plan is"):
        Plan.load(path)


def test_empty_mask_row(tmp_path):
    plan = _plan()
    plan.block_mask[1, 2, 3, 4] = False
    path = tmp_path / "plan.safetensors"
    with pytest.raises(PlanError, match=r"empty row \(bucket 1, layer 2, head 3, query block 4\)"):
        plan.validate()
    # the same corruption arriving through a file
    good = _plan()
    good.save(path)
    mask = good.block_mask.clone()
    mask[1, 2, 3, 4] = False
    chunks, index = BlockMasks.of(mask).encode()
    _rewrite(path, tensors={"block_mask_chunks": chunks, "block_mask_index": index})
    with pytest.raises(PlanError, match="empty row"):
        Plan.load(path)


def test_malformed_metadata(tmp_path):
    path = tmp_path / "plan.safetensors"
    _plan().save(path)
    _rewrite(path, raw_meta="{not json")
    with pytest.raises(PlanError, match="malformed"):
        Plan.load(path)
    _plan().save(path)
    _rewrite(path, meta_update={"qk": "int3"})
    with pytest.raises(PlanError, match="qk='int3'"):
        Plan.load(path)


def test_synthetic_density_is_close_to_target():
    for density in (0.2, 0.5):
        plan = _plan(layout=TokenLayout(0, 8, 16, 16), block_size=32, density=density)
        assert abs(plan.achieved_density() - density) < 0.05
    assert _plan(density=1.0).block_mask.all()


def test_edges_off_the_timestep_scale_missing_diagonal_and_wrong_density_are_refused():
    plan = _plan()
    with pytest.raises(PlanError, match="from 1000 down to 0 on the 0..1000 timestep scale"):
        Plan(**{**_fields(plan), "bucket_edges": [1.0, 0.75, 0.5, 0.0]})
    mask = plan.block_mask.clone()
    mask[2, 0, 1, 3, 3] = False
    mask[2, 0, 1, 3, 0] = True  # the row stays non-empty: only the diagonal is missing
    with pytest.raises(PlanError, match="lacks the diagonal block of bucket 2, layer 0, head 1, query block 3"):
        Plan(**{**_fields(plan), "block_mask": mask, "density": None})
    with pytest.raises(PlanError, match="density disagrees with its masks"):
        Plan(**{**_fields(plan), "density": plan.density + 0.01})


def _fields(plan):
    from dataclasses import fields

    return {f.name: getattr(plan, f.name) for f in fields(plan)}


CORRUPTIONS = {  # a valid plan's tensor -> the same with one corruption
    "orders_float": lambda t: t.float() + 0.7,  # 2.7 would be cut to 2
    "orders_int64": lambda t: t.long(),  # valid values, but not the file's dtype
    "orders_negative": lambda t: t.clone().fill_(-1),
    "bits_int32": lambda t: t.int(),
    "bits_2d": lambda t: t.view(1, -1),
    "density_float64": lambda t: t.double(),
    "density_7": lambda t: t.clone().fill_(7.0),
    "density_nan": lambda t: t.clone().fill_(float("nan")),
    "dense_7": lambda t: t.clone().fill_(7),
    "dense_bool": lambda t: t.bool(),
}


@pytest.mark.parametrize(("name", "corruption", "message"), [
    ("orders", "orders_float", r"'orders' must be int8 with values in 0\.\.5 .*; found float32"),
    ("orders", "orders_int64", r"'orders' must be int8 .*; found int64"),
    ("orders", "orders_negative", r"'orders' must be int8 with values in 0\.\.5 .*; found values -1"),
    ("block_mask_chunks", "bits_int32", r"'block_mask_chunks' must be uint8 .*; found int32"),
    ("block_mask_chunks", "bits_2d", r"'block_mask_chunks' must be uint8 .* one-dimensional; found shape \(1, "),
    ("block_mask_index", "orders_float", r"'block_mask_index' must be int64 .*; found float32"),
    ("density", "density_float64", r"'density' must be float32 with finite values in \[0, 1\] .*; found float64"),
    ("density", "density_7", r"'density' must be float32 with finite values in \[0, 1\] .*; found values 7"),
    ("density", "density_nan", r"'density' must be float32 .*; found non-finite values \(nan\)"),
    ("dense", "dense_7", r"'dense' must be uint8 with values 0 or 1; found values 7"),
    ("dense", "dense_bool", r"'dense' must be uint8 .*; found bool"),
])
def test_plan_file_tensors_must_have_their_dtype_and_values(tmp_path, name, corruption, message):
    """A file is a plan only if each tensor has the dtype `Plan.save` writes and values in its range:
    a float order is not cut to an integer, a dense flag 7 is not read as True."""
    path = tmp_path / "plan.safetensors"
    _plan().save(path)
    _rewrite(path, tensors={name: CORRUPTIONS[corruption](load_file(str(path))[name])})
    with pytest.raises(PlanError, match=rf"{path}: plan tensor {message}.*: the plan is corrupt, recalibrate"):
        Plan.load(path)


def test_plans_built_in_code_take_lists_and_wider_integer_dtypes():
    plan = _plan()
    fields = _fields(plan)
    for orders in (plan.orders.tolist(), plan.orders.long(), plan.orders.int()):
        assert torch.equal(Plan(**{**fields, "orders": orders}).orders, plan.orders)
    rebuilt = Plan(**{**fields, "block_mask": plan.block_mask.to(torch.uint8), "dense": plan.dense.long().tolist(),
                      "density": plan.density.double()})
    for name in ("block_mask", "dense", "density"):
        assert torch.equal(getattr(rebuilt, name), getattr(plan, name)), name


@pytest.mark.parametrize(("change", "message"), [
    ({"orders": "float"}, r"plan orders must be an integer tensor \(int8 in the plan\) .*; found float32"),
    ({"orders": "bool"}, r"plan orders must be an integer tensor .*; found bool"),
    ({"orders": 262}, r"plan orders must hold values in 0\.\.5 .*; found values 0\.\.262"),  # int8 would wrap to 6
    ({"block_mask": 2}, r"plan block_mask must hold values 0 or 1; found values 0, 1, 2"),
    ({"block_mask": "float"}, r"plan block_mask must be a bool or integer tensor .*; found float32"),
    ({"density": float("nan")}, r"plan density must hold finite values in \[0, 1\] .*; found non-finite values"),
    ({"density": -0.5}, r"plan density must hold finite values in \[0, 1\] .*; found values"),
    ({"dense": 7}, r"plan dense must hold values 0 or 1; found values 0, 7"),
    ({"dense": "float"}, r"plan dense must be a bool or integer tensor .*; found float32"),
])
def test_plans_built_in_code_refuse_values_a_cast_would_change(change, message):
    plan = _plan()
    fields = _fields(plan)
    (name, value), = change.items()
    t = getattr(plan, name)
    if value == "float":
        t = t.float() + 0.5 * (name == "orders")
    elif value == "bool":
        t = t.bool()
    else:
        t = t.to(torch.float32 if name == "density" else torch.int64).clone()
        t.view(-1)[0] = value
    with pytest.raises(PlanError, match=message + ".*: the plan is corrupt, recalibrate"):
        Plan(**{**fields, name: t})


def test_validate_refuses_tensors_changed_after_construction():
    plan = _plan()
    plan.orders = plan.orders.float()
    with pytest.raises(PlanError, match="plan orders must be a tensor of int8; found float32"):
        plan.validate()
    plan = _plan()
    plan.orders[1, 2] = 6
    with pytest.raises(PlanError, match=r"plan orders must hold values in 0\.\.5 .*; found values"):
        plan.validate()
    plan = _plan()
    plan.density = plan.density.clone()
    plan.density[0, 0, 0] = float("inf")
    with pytest.raises(PlanError, match=r"plan density must hold finite values in \[0, 1\].*found non-finite values \(inf\)"):
        plan.validate()


def test_load_and_apply_say_what_to_pass_for_a_folder_or_a_path(tmp_path):
    from paroattn.pipelines import apply

    with pytest.raises(PlanError, match="is a folder: pass a plan file"):
        Plan.load(tmp_path)
    with pytest.raises(PlanError, match="takes the path of a plan file, got int"):
        Plan.load(123)
    with pytest.raises(TypeError, match=r"not the path 'plan.safetensors': load it with Plan.load\(path\)"):
        apply(torch.nn.Linear(1, 1), "plan.safetensors")
