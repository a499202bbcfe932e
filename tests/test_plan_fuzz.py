"""Plan files from strangers: every file either loads as the plan that was saved or raises a PlanError that
names what is wrong. A seeded fuzz over a small plan's file (byte flips, truncation, metadata mutations,
tensor dtype relabels, header edits), and the cases it found kept by name."""

import json
import math
import random
import struct
import tracemalloc
import warnings
import zlib

import pytest
import torch

from paroattn import Plan, PlanError, TokenLayout
from paroattn.errors import PlanWarning
from paroattn.masks import synthetic_block_mask
from paroattn.plan import METADATA_KEY, BlockMasks, default_bucket_edges, load_plans, pack_bits
from paroattn.plan import masks as masks_module
from paroattn.plan.masks import DEFLATED, DEFLATED_XOR_PREVIOUS, INFLATE_PIECE, SCAN_BITS
from paroattn.plan.model import CHECKSUM_KEY
from paroattn.plan.storage import checksum
from paroattn.plan.summary import describe_plan


def _small_plan(**overrides) -> Plan:
    args = dict(layout=TokenLayout(2, 2, 4, 4), num_layers=2, num_heads=2, density=0.5, orders="random",
                num_buckets=3, block_size=16, model_class="TinyModel", model_fingerprint="f00d", profiles=True)
    plan = Plan.synthetic(**{**args, **overrides})
    plan.prompts = ["red circle", "blue square"]
    plan.info = {"steps": 4, "experts": {"transformer": "plan.safetensors"}}
    plan.expert = "transformer"
    return plan


# -- the file as parts --------------------------------------------------------------------------------------------
def _split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


_TORCH_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "F32": torch.float32,
                 "F64": torch.float64, "BOOL": torch.bool, "I16": torch.int16, "F16": torch.float16,
                 "BF16": torch.bfloat16}


def _resum(header: dict, body: bytes) -> dict:
    """The header with the checksum its metadata and tensors would have (a crafted file comes with a correct
    checksum: the checks behind it must hold on their own)."""
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = _TORCH_DTYPES[entry["dtype"]]
        raw = bytearray(body[begin:end])
        t = torch.frombuffer(raw, dtype=dtype) if raw else torch.zeros(0, dtype=dtype)
        tensors[name] = t.view(entry["shape"])
    meta = header["__metadata__"]
    return {**header, "__metadata__": {**meta, CHECKSUM_KEY: checksum(meta[METADATA_KEY], tensors)}}


def _with_meta(data: bytes, change, resum: bool = True) -> bytes:
    """The file with its plan metadata changed by `change(meta)` (in place), checksum recomputed."""
    header, body = _split(data)
    meta = json.loads(header["__metadata__"][METADATA_KEY])
    change(meta)
    header["__metadata__"][METADATA_KEY] = json.dumps(meta)
    return _join(_resum(header, body) if resum else header, body)


def _with_raw_meta(data: bytes, text: str) -> bytes:
    header, body = _split(data)
    header["__metadata__"][METADATA_KEY] = text
    return _join(_resum(header, body), body)


def _with_entry(data: bytes, name: str, **changes) -> bytes:
    """The file with tensor `name`'s header entry changed (dtype, shape), checksum recomputed where it can be."""
    header, body = _split(data)
    header[name] = {**header[name], **changes}
    try:
        header = _resum(header, body)
    except (RuntimeError, ValueError, TypeError, KeyError):
        pass  # a header torch cannot read as tensors: the file keeps its old checksum
    return _join(header, body)


def _load(tmp_path, data: bytes, name="plan.safetensors"):
    path = tmp_path / name
    path.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        return Plan.load(path)


def _same(a: Plan, b: Plan) -> bool:
    scalars = ("model_class", "model_fingerprint", "layout", "block_size", "bucket_edges", "qk", "pv",
               "target_density", "prompts", "info", "expert", "format_version")
    if any(getattr(a, n) != getattr(b, n) for n in scalars):
        return False
    if not all(torch.equal(x, y) for x, y in ((a.orders, b.orders), (a.density, b.density), (a.dense, b.dense))):
        return False
    if (a.profiles is None) != (b.profiles is None) or a.masks.shape != b.masks.shape:
        return False
    if a.profiles is not None and not all(torch.equal(x, y) for x, y in zip(a.profiles, b.profiles)):
        return False
    buckets, layers = a.masks.shape[:2]
    return all(torch.equal(a.layer_mask(k, n), b.layer_mask(k, n)) for k in range(buckets) for n in range(layers))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    plan = _small_plan()
    path = tmp_path_factory.mktemp("plan") / "plan.safetensors"
    plan.save(path)
    return plan, path.read_bytes()


# -- the fuzz -------------------------------------------------------------------------------------------------------
_ODD_VALUES = [float("nan"), float("inf"), -float("inf"), 10 ** 400, -(10 ** 30), -5, -1, 0, 1, 7, True, False, None,
               "", "x" * 300, "/", [], {}, [1], [-1, -2], [10 ** 20] * 5, {"a": 1}, 1e308, 0.5, "transformer"]
_META_KEYS = ["format_version", "model_class", "model_fingerprint", "layout", "block_size", "block_mask_shape",
              "bucket_edges", "qk", "pv", "target_density", "prompts", "info", "expert", "extra_shapes"]


def _mutate_meta(rng: random.Random, meta: dict) -> None:
    key = rng.choice(_META_KEYS)
    kind = rng.randrange(4)
    if kind == 0:
        meta[key] = rng.choice(_ODD_VALUES)
    elif kind == 1 and isinstance(meta.get(key), list) and meta[key]:
        meta[key][rng.randrange(len(meta[key]))] = rng.choice(_ODD_VALUES)
    elif kind == 2:
        meta.pop(key, None)
    else:
        meta[key] = json.loads("[" * 50 + "]" * 50) if rng.random() < 0.5 else {"x": rng.choice(_ODD_VALUES)}


def _mutations(data: bytes, count: int, seed: int = 0):
    """(kind, mutated file, whether its checksum was recomputed to match), `count` of them."""
    rng = random.Random(seed)
    header, body = _split(data)
    names = [n for n in header if n != "__metadata__"]
    for i in range(count):
        kind = i % 6
        if kind == 0:  # byte flips anywhere
            b = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= rng.randint(1, 255)
            yield "flip", bytes(b), False
        elif kind == 1:  # truncation
            yield "truncate", data[:rng.randrange(len(data))], False
        elif kind == 2:  # metadata JSON
            resum = rng.random() < 0.8
            yield "meta", _with_meta(data, lambda m: _mutate_meta(rng, m), resum=resum), resum
        elif kind == 3:  # dtype relabel of a tensor, to one of the same width
            name = rng.choice(names)
            width = {"U8": ["I8", "BOOL"], "I8": ["U8", "BOOL"], "F32": ["I32"], "I64": ["F64"]}
            choices = width.get(header[name]["dtype"], ["U8"])
            yield "dtype", _with_entry(data, name, dtype=rng.choice(choices)), True
        elif kind == 4:  # a shape with the same number of elements, or another one
            name = rng.choice(names)
            shape = header[name]["shape"]
            n = math.prod(shape)
            options = [[n], [1, n], [-1, -n], [n, 0], [n + 1], [2 ** 40, 2 ** 40]]
            yield "shape", _with_entry(data, name, shape=rng.choice(options)), True
        else:  # bytes of one tensor flipped, checksum recomputed (what a careful stranger would send)
            name = rng.choice(names)
            begin, end = header[name]["data_offsets"]
            b = bytearray(body)
            if end > begin:
                b[rng.randrange(begin, end)] ^= rng.randint(1, 255)
            yield "tensor", _join(_resum(header, bytes(b)), bytes(b)), True


def test_mutated_files_load_as_saved_or_raise_plan_error(saved, tmp_path):
    """A damaged file (its checksum no longer matching) loads as saved or raises a PlanError; a crafted one
    (checksum recomputed) may be another plan, but then a valid one: it passes the checks `apply` makes and
    `paro inspect` describes it."""
    plan, data = saved
    outcomes = {}
    for kind, mutated, resummed in _mutations(data, 600):
        try:
            loaded = _load(tmp_path, mutated)
        except PlanError:
            outcome = "PlanError"
        else:
            describe_plan(loaded)
            loaded.validate_for_apply()
            outcome = "equal" if _same(loaded, plan) else "valid, changed" if resummed else "CHANGED"
        outcomes.setdefault((kind, outcome), 0)
        outcomes[(kind, outcome)] += 1
    changed = {k: v for k, v in outcomes.items() if k[1] == "CHANGED"}
    assert not changed, outcomes
    assert outcomes.get(("flip", "PlanError"), 0) > 30 and outcomes.get(("meta", "PlanError"), 0) > 30, outcomes


# -- the cases it found, by name ------------------------------------------------------------------------------------
def _set(key, value):
    def change(meta):
        meta[key] = value
    return change


def _set_item(key, i, value):
    def change(meta):
        meta[key][i] = value
    return change


BAD_METADATA = {
    "nested info": (_set("info", "NESTED"), "nested too deeply|malformed"),  # "NESTED": spliced in as text
    "layout Infinity": (_set_item("layout", 1, float("inf")), "'layout' must be"),
    "layout huge int": (_set_item("layout", 3, 10 ** 400), "'layout' must be"),
    "layout negative": (_set_item("layout", 0, -3), "'layout' must be"),
    "block size Infinity": (_set_item("block_size", 0, float("inf")), "'block_size' must be"),
    "block size huge": (_set_item("block_size", 1, 10 ** 30), "'block_size' must be"),
    "mask shape Infinity": (_set_item("block_mask_shape", 4, float("inf")), "'block_mask_shape' must be"),
    "mask shape huge": (_set_item("block_mask_shape", 3, 10 ** 400), "'block_mask_shape' must be"),
    "mask shape negative, same product": (lambda m: m.update(block_mask_shape=[-s if i < 2 else s for i, s in
                                                                                enumerate(m["block_mask_shape"])]),
                                          "'block_mask_shape' must be"),
    "format version Infinity": (_set("format_version", float("inf")), "'format_version' must be"),
    "format version huge": (_set("format_version", 10 ** 400), "'format_version' must be"),
    "format version 0": (_set("format_version", 0), "'format_version' must be"),
    "format version -5": (_set("format_version", -5), "'format_version' must be"),
    "format version true": (_set("format_version", True), "'format_version' must be"),
    "target density NaN": (_set("target_density", float("nan")), "'target_density' must be"),
    "target density inf": (_set("target_density", float("inf")), "'target_density' must be"),
    "target density -3": (_set("target_density", -3), "'target_density' must be"),
    "target density 7": (_set("target_density", 7), "'target_density' must be"),
    "target density huge": (_set("target_density", 10 ** 400), "'target_density' must be"),
    "bucket edge NaN": (_set_item("bucket_edges", 1, float("nan")), "'bucket_edges' must be"),
    "bucket edge Infinity": (_set_item("bucket_edges", 0, float("inf")), "'bucket_edges' must be"),
    "bucket edge huge": (_set_item("bucket_edges", 0, 10 ** 400), "'bucket_edges' must be"),
    "prompts not strings": (_set("prompts", [1, None, ["x"]]), "'prompts' must be a list of strings"),
    "prompts not a list": (_set("prompts", "a red circle"), "'prompts' must be a list of strings"),
    "info not an object": (_set("info", [1, 2]), "'info' must be a JSON object"),
    "model class not a string": (_set("model_class", 5), "'model_class' must be a string"),
    "expert not a string": (_set("expert", ["transformer"]), "'expert' must be a string"),
    "qk not a string": (_set("qk", 8), "'qk' must be a string"),
    "extra shapes not objects": (_set("extra_shapes", [1]), "'extra_shapes' must be"),
    "extra shape layout huge": (_set("extra_shapes", [{"layout": [0, 10 ** 400, 1, 1], "block_mask_shape": [1] * 5,
                                                       "target_density": 0.5}]), r"'extra_shapes\[0\].layout'"),
}


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_bad_metadata_is_a_plan_error_naming_the_field(saved, tmp_path, case):
    _, data = saved
    change, message = BAD_METADATA[case]
    mutated = _with_meta(data, change)
    if case == "nested info":  # deeper than json.dumps could write: spliced in as text
        header, _ = _split(mutated)
        text = header["__metadata__"][METADATA_KEY].replace('"NESTED"', "[" * 100_000 + "]" * 100_000)
        mutated = _with_raw_meta(data, text)
    with pytest.raises(PlanError, match=message) as error:
        _load(tmp_path, mutated)
    assert "plan.safetensors" in str(error.value)


def test_a_deeply_nested_safetensors_header_is_a_plan_error(tmp_path):
    text = ('{"x":' + "[" * 100_000 + "]" * 100_000 + "}").encode()
    with pytest.raises(PlanError, match="header is not JSON: RecursionError"):
        _load(tmp_path, struct.pack("<Q", len(text)) + text)


@pytest.mark.parametrize(("name", "dtype"), [("profile_f", "I32"), ("density", "I32"), ("dense", "I8"),
                                             ("orders", "U8"), ("orders", "BOOL"), ("block_mask_index", "F64"),
                                             ("block_mask_chunks", "I8")])
def test_relabelled_tensor_dtypes_are_refused(saved, tmp_path, name, dtype):
    _, data = saved
    with pytest.raises(PlanError, match=rf"plan tensor '{name}' must be .*; found"):
        _load(tmp_path, _with_entry(data, name, dtype=dtype))


def test_negative_tensor_shapes_whose_product_matches_are_refused(saved, tmp_path):
    _, data = saved
    header, _ = _split(data)
    shape = header["orders"]["shape"]
    with pytest.raises(PlanError, match="'orders' has shape .* not a list of sizes >= 0"):
        _load(tmp_path, _with_entry(data, "orders", shape=[-s for s in shape]))


@pytest.mark.parametrize(("files", "message"), [
    ({"transformer": "plan.safetensors", "transformer_2": "sub/other.safetensors"}, "not a plain file name"),
    ({"transformer": "plan.safetensors", "transformer_2": ""}, "not a plain file name"),
    ({"transformer": "plan.safetensors", "transformer_2": "."}, "not a plain file name"),
    ({"transformer": "plan.safetensors", "transformer_2": ".."}, "not a plain file name"),
    ({"transformer": "plan.safetensors", "transformer_2": "x" * 300}, "not a plain file name"),
    ({"transformer": "plan.safetensors", "transformer_2": 5}, "not a string"),
    ({"transformer": "plan.safetensors", "": "plan.safetensors"}, "is not a name"),
])
def test_bad_expert_file_names_are_plan_errors(saved, tmp_path, files, message):
    _, data = saved

    def change(meta):
        meta["info"]["experts"] = files
    (tmp_path / "plan.safetensors").write_bytes(_with_meta(data, change))
    with pytest.raises(PlanError, match=message):
        load_plans(tmp_path / "plan.safetensors")


# -- checksum -----------------------------------------------------------------------------------------------------
def test_checksum_is_written_and_checked(saved, tmp_path):
    plan, data = saved
    header, body = _split(data)
    assert len(header["__metadata__"][CHECKSUM_KEY]) == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file with its checksum loads without a note
        assert _same(_load(tmp_path, data), plan)
    # one flipped bit of the masks, file otherwise intact: refused
    begin, end = header["block_mask_chunks"]["data_offsets"]
    b = bytearray(body)
    b[begin + 1] ^= 1
    with pytest.raises(PlanError, match="do not match the checksum saved with them"):
        _load(tmp_path, _join(header, bytes(b)))
    # the metadata changed, checksum not: refused
    with pytest.raises(PlanError, match="do not match the checksum"):
        _load(tmp_path, _with_meta(data, _set("prompts", ["another prompt"]), resum=False))


def test_files_without_a_checksum_load_with_a_note_and_gain_one_when_saved(saved, tmp_path):
    plan, data = saved
    header, body = _split(data)
    del header["__metadata__"][CHECKSUM_KEY]
    path = tmp_path / "old.safetensors"
    path.write_bytes(_join(header, body))
    with pytest.warns(PlanWarning, match="has no checksum"):
        loaded = Plan.load(path)
    assert _same(loaded, plan)
    loaded.save(path)
    assert CHECKSUM_KEY in _split(path.read_bytes())[0]["__metadata__"]


# -- bounded load -------------------------------------------------------------------------------------------------
def test_a_file_declaring_a_huge_layout_is_refused_before_allocating(saved, tmp_path):
    """The 1 x 1 x 320000 layout of a small file: its masks would be 5000 x 5000 blocks per head; the chunks are
    far too small to inflate to that, so the file is refused from its header and index alone."""
    _, data = saved

    def change(meta):
        meta["layout"] = [0, 1, 1, 320_000]
        meta["block_size"] = [64, 64]
        meta["block_mask_shape"] = meta["block_mask_shape"][:3] + [5000, 5000]
    with pytest.raises(PlanError, match="too small for the declared mask shape"):
        _load(tmp_path, _with_meta(data, change))


def test_mask_shapes_beyond_what_a_scan_is_sized_for_are_refused(saved, tmp_path):
    """A deflated chunk of 1 MB may inflate to 1 GB: the declared sizes are bounded before anything inflates."""
    _, data = saved

    def change(meta):
        meta["layout"] = [0, 1, 1, 2 ** 20]
        meta["block_size"] = [16, 16]
        meta["block_mask_shape"] = meta["block_mask_shape"][:3] + [2 ** 16, 2 ** 16]
    with pytest.raises(PlanError, match="beyond what paroattn reads"):
        _load(tmp_path, _with_meta(data, change))


def test_tensors_declared_beyond_the_file_are_refused(saved, tmp_path):
    _, data = saved
    header, body = _split(data)
    big = {**header["block_mask_chunks"], "shape": [2 ** 40], "data_offsets": [0, 2 ** 40]}
    with pytest.raises(PlanError, match="outside the file"):
        _load(tmp_path, _join({**header, "block_mask_chunks": big}, body))
    shared = {**header["dense"], "data_offsets": header["density"]["data_offsets"][:1] * 2}
    shared["data_offsets"][1] += math.prod(shared["shape"])
    with pytest.raises(PlanError, match="share bytes"):
        _load(tmp_path, _join({**header, "dense": shared}, body))


def test_loaded_masks_stay_packed_and_unpack_one_layer_at_a_time(tmp_path):
    plan = _small_plan(layout=TokenLayout(0, 4, 16, 16), num_layers=3, num_heads=4)
    plan.save(tmp_path / "plan.safetensors")
    loaded = Plan.load(tmp_path / "plan.safetensors")
    assert loaded.masks.form == "chunks" and loaded.masks.stored_bytes() < plan.masks.stored_bytes()
    assert torch.equal(loaded.layer_mask(2, 1), plan.block_mask[2, 1])
    widest = int(plan.block_mask.sum(dim=-1).max())
    assert loaded.most_active_blocks_per_row() == plan.most_active_blocks_per_row() == widest
    assert "masks held as chunks" in repr(loaded)
    assert loaded.masks.form == "chunks"  # none of these unpacked the rest
    assert torch.equal(loaded.block_mask, plan.block_mask) and loaded.masks.form == "full"  # whole-mask access does


def test_chunks_relative_to_the_previous_bucket_decode_in_any_order():
    g = torch.Generator().manual_seed(0)
    masks = (torch.rand(1, 3, 2, 9, 11, generator=g) < 0.5).expand(5, 3, 2, 9, 11).clone()
    masks[2:] ^= torch.rand(3, 3, 2, 9, 11, generator=g) < 0.05  # buckets 2..4 differ a little from their previous
    chunks, index = BlockMasks.of(masks).encode()
    assert {int(chunks[offset]) for offset, _ in index.tolist()} >= {DEFLATED_XOR_PREVIOUS}
    stored = BlockMasks.from_chunks(chunks, index, masks.shape)
    pairs = [(b, layer) for b in range(5) for layer in range(3)]
    random.Random(0).shuffle(pairs)
    for b, layer in pairs + pairs[::-1]:
        assert torch.equal(stored.layer(b, layer), masks[b, layer]), (b, layer)


def test_chunks_inflate_a_piece_at_a_time_whatever_the_piece_size(monkeypatch):
    """Pieces of 7 bytes split every chunk's stream and its packed mask (144 bytes) many times, at places
    that are no boundary of the stream's own: each (bucket, layer) still decodes as it was stored."""
    monkeypatch.setattr(masks_module, "INFLATE_PIECE", 7)
    g = torch.Generator().manual_seed(1)
    masks = torch.stack([synthetic_block_mask(2, 24, 24, 0.2, generator=g) for _ in range(3)])
    masks = masks.expand(4, 3, 2, 24, 24).clone()
    masks[2:] ^= torch.rand(2, 3, 2, 24, 24, generator=g) < 0.02
    chunks, index = BlockMasks.of(masks).encode()
    methods = {int(chunks[offset]) for offset, _ in index.tolist()}
    assert {DEFLATED, DEFLATED_XOR_PREVIOUS} <= methods
    stored = BlockMasks.from_chunks(chunks, index, masks.shape)
    for b in range(4):
        for layer in range(3):
            assert torch.equal(stored.layer(b, layer), masks[b, layer]), (b, layer)


_ONE_LAYER = torch.rand(1, 1, 2, 9, 11, generator=torch.Generator().manual_seed(2)) < 0.5
_PACKED = pack_bits(_ONE_LAYER).numpy().tobytes()  # 25 bytes


# pieces: smaller than the stream, as long as it (trailing bytes start a piece), longer
@pytest.mark.parametrize("piece", [7, len(zlib.compress(_PACKED)), INFLATE_PIECE])
@pytest.mark.parametrize("payload, message", [
    (zlib.compress(_PACKED + b"\0"), "does not inflate to 25 bytes"),
    (zlib.compress(_PACKED[:-1]), "does not inflate to 25 bytes"),
    (zlib.compress(_PACKED) + b"more", "does not inflate to 25 bytes"),
    (zlib.compress(_PACKED)[:-3], "does not inflate to 25 bytes"),
    (b"\x78\x9c" + bytes(range(40)), "does not inflate \\("),
    (zlib.compress(_PACKED), None),
], ids=["one-byte-long", "one-byte-short", "trailing-bytes", "cut-short", "not-deflate", "exact"])
def test_a_deflated_chunk_must_inflate_to_exactly_its_mask(monkeypatch, piece, payload, message):
    monkeypatch.setattr(masks_module, "INFLATE_PIECE", piece)
    chunks = torch.frombuffer(bytearray(bytes([DEFLATED]) + payload), dtype=torch.uint8)
    stored = BlockMasks.from_chunks(chunks, torch.tensor([[0, len(chunks)]]), _ONE_LAYER.shape)
    if message is None:
        assert torch.equal(stored.layer(0, 0), _ONE_LAYER[0, 0])
    else:
        with pytest.raises(PlanError, match=message):
            stored.layer(0, 0)


def test_loading_allocates_the_file_and_at_most_two_decoded_masks_beside_it(tmp_path):
    """What `Plan.load` allocates beside the file's bytes (traced: Python and numpy buffers), at its peak: the
    larger of the packed masks of two (bucket, layer) pairs with the inflate's pieces (a chunk relative to the
    previous bucket is decoded beside that bucket's) and one packed mask with the slice of heads the validating
    scan unpacks from it. Three buckets of the same masks, as `benchmarks/e2e.py` builds them: every chunk past
    the first bucket is relative to the one before."""
    layout, layers, heads, buckets = TokenLayout(0, 4, 64, 64), 2, 8, 3
    nq = nk = layout.seq_len // 16
    g = torch.Generator().manual_seed(0)
    layer_masks = [(torch.rand(heads, nq, nk, generator=g) < 0.3) | torch.eye(nq, dtype=torch.bool)
                   for _ in range(layers)]
    store = BlockMasks.from_layers((buckets, layers, heads, nq, nk), lambda b, layer: layer_masks[layer])
    plan = Plan(model_class="TinyModel", model_fingerprint="f00d", layout=layout, block_size=(16, 16),
                orders=torch.zeros(layers, heads, dtype=torch.int8), block_mask=store,
                bucket_edges=default_bucket_edges(buckets), target_density=0.3)
    path = tmp_path / "plan.safetensors"
    plan.save(path)
    packed = heads * nq * nk // 8  # 1 MB per (bucket, layer)
    scan_slice = max(SCAN_BITS // (nq * nk), 1) * nq * nk  # a byte per block
    small = 256 << 10  # metadata, small tensors, numpy's reduction buffers
    tracemalloc.start()
    try:
        loaded = Plan.load(path)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    file_bytes = path.stat().st_size
    assert held <= file_bytes + small, (held, file_bytes)  # the chunks; nothing decoded is kept
    assert peak <= file_bytes + max(2 * packed + 3 * INFLATE_PIECE, packed + scan_slice) + small, (peak, file_bytes)
    # read bucket-major, as the runner does (each walk decodes from bucket 0), one head a time: the walks hold
    # two decoded masks at most, whatever was decoded before
    tracemalloc.start()
    try:
        assert all(torch.equal(loaded.masks.heads(b, layer, head, head + 1), layer_masks[layer][head:head + 1])
                   for b in range(buckets) for layer in range(layers) for head in (0, heads - 1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= max(2 * packed + 3 * INFLATE_PIECE, packed + nq * nk) + small, peak
