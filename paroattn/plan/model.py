"""The plan: everything a PARO run needs, chosen offline by `paro calibrate`.

On disk: one safetensors file. Tensors: `orders` int8 [L, H], the bool masks [buckets, L, H, nq, nk],
`density` float32 [buckets, L, H], `dense` uint8 [buckets, L] (1 = run that layer with the model's own
attention in that bucket). Everything else is JSON in the safetensors metadata under the key "paroattn_plan",
and a sha256 of the metadata text and the tensors under "paroattn_plan_sha256" (`storage.checksum`; files
written before it existed load with a warning). No pickle. Format version 3 stores the masks as one encoded
chunk per (bucket, layer), deflated and, from the second bucket on, relative to the previous bucket
(`block_mask_chunks` uint8 and `block_mask_index` int64 [buckets * L, 2], `paroattn/plan/masks.py`); versions
1 and 2 as one flat bit-packed tensor (`block_mask_bits` uint8, 8x smaller than bools). In memory the masks
stay in the form they were read in (`Plan.masks`); `Plan.layer_mask` unpacks one (bucket, layer).

Format version 2 adds what lets one plan serve other generation sizes (`paroattn/plan/shapes.py`): the axis
profiles `profile_f`, `profile_h`, `profile_w` float32 [buckets, L, H, 2n-1] (attention mass by offset along
each grid axis), and the plans of further calibrated sizes (`extra_shapes`), each stored as the tensors
above prefixed `shape<i>.` with its layout and mask shape in the metadata. Version 1 files still load; they
serve their calibrated size only.

A pipeline with two transformers (Wan 2.2 A14B: `transformer` for the high-noise steps, `transformer_2`
for the low-noise ones) gets one plan per expert, each in its own file and naming its expert
(`Plan.expert`); `paro calibrate --out plan.safetensors` writes `plan.safetensors` and
`plan.transformer_2.safetensors`, each listing both files (`info["experts"]`), and `load_plans` reads
either back as the pair.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import PlanError, PlanWarning
from ..layout import ORDERS, TokenLayout
from ..masks import block_sizes, mask_shape, synthetic_block_mask
from ..modes import k_scale_problem, modes_problem
from .masks import BlockMasks
from .storage import checksum, file_size, read_header, read_tensors

FORMAT_VERSION = 3
CHUNKED_MASKS_VERSION = 3  # the first format version storing masks as encoded chunks
PROFILE_TENSORS = ("profile_f", "profile_h", "profile_w")
METADATA_KEY = "paroattn_plan"
CHECKSUM_KEY = "paroattn_plan_sha256"
MAX_EXTRA_SHAPES = 64
MAX_BUCKETS = 1000
# a bound on every size a file declares (layout fields, block sizes): far above any model's, far below overflow
MAX_SIZE = 1 << 31
# config entries that describe where a model came from, not what it computes
_CONFIG_KEYS_IGNORED = ("_name_or_path", "_diffusers_version", "_class_name", "_use_default_values")


def model_config_record(config) -> dict:
    """The entries of a model config (a diffusers FrozenDict or a dict) that say what the model computes: what
    its fingerprint hashes, and what a calibrated plan records (`info["model_config"]`)."""
    return {k: v for k, v in dict(config).items() if k not in _CONFIG_KEYS_IGNORED}


def model_fingerprint(config) -> str:
    """Short stable hash of a model config (a diffusers FrozenDict or a dict)."""
    items = model_config_record(config)
    text = json.dumps(items, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """`safetensors.torch.save_file`, with the file's permissions those of any file this process creates
    (0644 under the usual umask 022), not the 0600 that safetensors gives it."""
    from safetensors.torch import save_file

    save_file(tensors, os.fspath(path), metadata=metadata)
    umask = os.umask(0o022)  # reading the umask means setting it: set it straight back
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


# the tensors of a plan file: the dtype each has on disk and the values it may hold (the masks in code
# are bool, `dense` bool, `orders` int8 and `density` float32)
STORED_TENSORS = {
    "orders": (torch.int8, f"values in 0..{len(ORDERS) - 1} (indices into {ORDERS})"),
    "block_mask_bits": (torch.uint8, "bit-packed masks"),
    "block_mask_chunks": (torch.uint8, "encoded mask chunks"),
    "block_mask_index": (torch.int64, "chunk offsets and lengths"),
    "density": (torch.float32, "finite values in [0, 1] (each mask's fraction of active blocks)"),
    "dense": (torch.uint8, "values 0 or 1"),
} | {name: (torch.float32, "finite masses >= 0") for name in PROFILE_TENSORS}
# the tensors of one calibrated size in a file of each format version (profiles optional)
MASK_TENSORS = {1: ("block_mask_bits",), 2: ("block_mask_bits",), 3: ("block_mask_chunks", "block_mask_index")}
REQUIRED_TENSORS = ("orders", "density", "dense")
_VALUES = {name: values for name, (_, values) in STORED_TENSORS.items()} | {"block_mask": "values 0 or 1"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _values_found(t: torch.Tensor) -> str:
    """The values of a tensor, summarized for an error message."""
    if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
        return f"non-finite values ({', '.join(sorted({str(x) for x in t[~torch.isfinite(t)].tolist()}))})"
    distinct = t.unique()
    if len(distinct) <= 4:
        return f"values {', '.join(f'{x:g}' for x in distinct.tolist())}"
    return f"values {float(t.min()):g}..{float(t.max()):g}"


def _values_problem(name: str, t: torch.Tensor) -> str | None:
    """What plan tensor `name` holds when it is out of the range `_VALUES[name]`, or None. Bool tensors
    and packed mask bytes are in range."""
    if not t.numel() or t.dtype == torch.bool:
        return None
    if name == "orders":
        ok = (t >= 0) & (t < len(ORDERS))
    elif name == "density":
        ok = torch.isfinite(t) & (t >= 0) & (t <= 1)
    elif name in ("dense", "block_mask"):
        ok = (t == 0) | (t == 1)
    else:  # block_mask_bits: any byte
        return None
    return None if bool(ok.all()) else _values_found(t)


def stored_tensor_problem(name: str, t: torch.Tensor) -> str | None:
    """Why `t`, read from a plan file as tensor `name`, lacks that tensor's dtype or values, or None."""
    dtype, values = STORED_TENSORS[name]
    expected = f"plan tensor {name!r} must be {_dtype_name(dtype)} with {values}"
    if t.dtype != dtype:
        return f"{expected}; found {_dtype_name(t.dtype)}"
    if name in ("block_mask_bits", "block_mask_chunks") and t.dim() != 1:
        return f"{expected}, one-dimensional; found shape {tuple(t.shape)}"
    if found := _values_problem(name, t):
        return f"{expected}; found {found}"
    return None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _narrowed(name: str, value, dtype: torch.dtype) -> torch.Tensor:
    """Plan tensor `name` built in code (a tensor or a list) as a CPU tensor of `dtype`, after checking
    that its values survive the cast: integer (or bool, for bool tensors) values in the tensor's range
    for integer and bool dtypes, real ones for float32. A float order 2.7 is not cut to 2, an int64
    order 262 does not wrap to 6, a dense flag 7 does not become True."""
    t = torch.as_tensor(value)
    floating = t.dtype.is_floating_point or t.dtype.is_complex
    if dtype == torch.float32:
        allowed, kind = not t.dtype.is_complex and t.dtype != torch.bool, "a real"
    elif dtype == torch.bool:
        allowed, kind = not floating, "a bool or integer"
    else:
        allowed, kind = not floating and t.dtype != torch.bool, "an integer"
    if not allowed:
        raise PlanError(
            f"plan {name} must be {kind} tensor ({_dtype_name(dtype)} in the plan) with {_VALUES[name]}; found "
            f"{_dtype_name(t.dtype)}: the plan is corrupt, recalibrate"
        )
    if dtype != torch.float32 and (found := _values_problem(name, t)):  # float32 keeps every value: validate checks them
        raise PlanError(f"plan {name} must hold {_VALUES[name]}; found {found}: the plan is corrupt, recalibrate")
    return t.to(dtype).cpu()


def default_bucket_edges(num_buckets: int = 6, shared_fraction: float = 0.5) -> list[float]:
    """Descending timestep edges on the 0..1000 scale: timesteps above 500 (the upper half of the
    range) split into `num_buckets - 1` equal buckets, the rest shared by one, after the paper's
    "first half of the steps". With a flow-shifted schedule (Wan, Flux) more than half of the steps
    lie above t=500, so the early buckets cover more steps there; the split is in timesteps, so
    calibration and inference agree whatever the scheduler."""
    if num_buckets < 1:
        raise ValueError("num_buckets must be >= 1")
    if num_buckets == 1:
        return [1000.0, 0.0]
    split = 1000.0 * shared_fraction
    early = [1000.0 - i * (1000.0 - split) / (num_buckets - 1) for i in range(num_buckets)]
    return early + [0.0]


def bucket_edges_problem(edges: list[float]) -> str | None:
    """Why `edges` cannot bucket timesteps, or None: they must run from 1000 down to 0, strictly
    descending, on the 0..1000 scale every family's timestep is brought to."""
    if not all(isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e) for e in edges):
        return f"bucket_edges must be finite numbers, got {str(list(edges))[:200]}"
    if len(edges) < 2 or any(a <= b for a, b in zip(edges, edges[1:])):
        return f"bucket_edges must be at least two strictly descending timesteps, got {list(edges)}"
    if edges[0] != 1000.0 or edges[-1] != 0.0:
        return (
            f"bucket_edges {list(edges)} must run from 1000 down to 0 on the 0..1000 timestep scale "
            "(Flux's t/1000 is multiplied by 1000 before bucketing), e.g. [1000, 800, 500, 0]"
        )
    return None


def bucket_index(edges: list[float], timestep: float) -> int:
    """Bucket of a timestep on the 0..1000 scale under descending `edges`: bucket b holds
    `edges[b] >= t > edges[b+1]`, the last bucket also t = edges[-1]."""
    for b in range(len(edges) - 2):
        if timestep > edges[b + 1]:
            return b
    return len(edges) - 2


def bucket_tensor(edges: list[float], timestep: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`bucket_index` of a timestep tensor computed on its device, read by nobody on the host: a 0-dim int64
    tensor, so that a forward traced by torch.compile (or captured in a CUDA graph) picks the bucket of every
    call without a sync and without a graph per bucket. The timestep is the largest entry of `timestep` times
    `scale` (Flux passes t / 1000: scale 1000), in float64 as `bucket_index` computes on a Python float, so
    both give the same bucket (float32 on MPS, which has no float64). Bucket b is the number of inner edges
    the timestep does not exceed: `bucket_index`'s first b with t > edges[b + 1], NaN included (last bucket)."""
    dtype = torch.float32 if timestep.device.type == "mps" else torch.float64
    t = timestep.detach().max().to(dtype) * scale
    bucket = torch.zeros((), dtype=torch.int64, device=timestep.device)
    for edge in edges[1:-1]:  # Python numbers: no tensor of edges to copy to the device
        bucket = bucket + (~(t > edge)).to(torch.int64)
    return bucket


class _BlockMaskField:
    """`Plan.block_mask`: set, a bool tensor [buckets, L, H, nq, nk] (or anything `_narrowed` takes) or a
    `BlockMasks`; read, the whole bool tensor, unpacked at full size (8x the packed bits: 6.7 GB for six
    buckets of Wan2.1-14B at 720p) and kept, so that in-place edits change the plan. Code that reads one
    (bucket, layer) at a time uses `Plan.layer_mask` instead, which unpacks only that. The `BlockMasks` lives
    in the instance dict under this name, so that `Plan(**plan.__dict__)` copies it as it is."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, plan, owner=None):
        if plan is None:  # no class-level default: dataclass then treats the field as required
            raise AttributeError(self.name)
        return plan.__dict__[self.name].full_tensor()

    def __set__(self, plan, value):
        masks = value if isinstance(value, BlockMasks) else BlockMasks.of(_narrowed("block_mask", value, torch.bool))
        plan.__dict__[self.name] = masks


@dataclass
class Plan:
    """Per (layer, head) order and per (bucket, layer, head) block mask, plus what they were made for.

    Timesteps are on the 0..1000 scale. Bucket b holds t with `bucket_edges[b] >= t > bucket_edges[b+1]`
    (the last bucket also holds t = bucket_edges[-1]); edges descend, so bucket 0 is the first steps.

    The masks stay packed as loaded (`masks`); `layer_mask(bucket, layer)` unpacks one (bucket, layer), while
    reading `block_mask` unpacks all of them at full size (see `_BlockMaskField`).
    """

    model_class: str
    model_fingerprint: str
    layout: TokenLayout
    block_size: tuple[int, int]
    orders: torch.Tensor  # int [L, H]
    block_mask: torch.Tensor = _BlockMaskField()  # bool [buckets, L, H, nq, nk], held as a BlockMasks (no default)
    bucket_edges: list[float]
    qk: str = "bf16"
    pv: str = "bf16"
    # with integer QK, K's scales per key block or per key ("token"); files written before it existed: "block"
    k_scale: str = "block"
    target_density: float = 1.0
    density: torch.Tensor | None = None  # float [buckets, L, H]; computed from the masks if None
    dense: torch.Tensor | None = None  # bool [buckets, L]; all False if None
    prompts: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # free-form: calibration settings, versions, timings
    # the pipeline component the plan was calibrated for ("transformer", "transformer_2" of an expert pair);
    # "" when unknown (calibrated on a bare transformer)
    expert: str = ""
    format_version: int = FORMAT_VERSION
    # attention mass by offset along the F, H, W axes, float32 [buckets, L, H, 2n-1] each (n: that axis's size);
    # None in plans written before they existed (format version 1): those serve their calibrated size only
    profiles: list[torch.Tensor] | None = None
    # plans of the same model calibrated at other sizes, with their own orders, masks and profiles
    extra_shapes: list[Plan] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.block_size, int):
            self.block_size = (self.block_size, self.block_size)
        if not isinstance(self.block_size, (tuple, list)) or not all(_is_int(b) for b in self.block_size):
            raise PlanError(f"plan block_size must be two integers, got {str(self.block_size)[:100]}")
        self.block_size = tuple(self.block_size)
        # tensors built in code may come as lists or in wider dtypes (int64 orders, 0/1 integer masks):
        # their values are checked before they are narrowed (a float order 2.7 is not cut to 2, an int64
        # order 262 does not wrap to 6, a dense flag 7 does not become True)
        self.orders = _narrowed("orders", self.orders, torch.int8)
        if problem := bucket_edges_problem(self.bucket_edges):
            raise PlanError(f"plan {problem}")
        self.bucket_edges = [float(e) for e in self.bucket_edges]
        self.expert = str(self.expert or "")
        shape = self.masks.shape
        if self.density is None and len(shape) == 5:
            self.density = self._mask_counts()[0].float() / max(1, shape[3] * shape[4])
        if self.density is not None:
            self.density = _narrowed("density", self.density, torch.float32)
        if self.dense is None and len(shape) == 5:
            self.dense = torch.zeros(shape[:2], dtype=torch.bool)
        if self.dense is not None:
            self.dense = _narrowed("dense", self.dense, torch.bool)
        if self.profiles is not None:
            self.profiles = [torch.as_tensor(p).float().cpu() for p in self.profiles]
        self.extra_shapes = list(self.extra_shapes)
        self.validate()

    def __repr__(self) -> str:  # the dataclass's would unpack every mask (it reads `block_mask`)
        sizes = ", ".join(str(p.layout) for p in self.calibrated_plans())
        return (f"Plan(model_class={self.model_class!r}, expert={self.expert!r}, sizes=[{sizes}], "
                f"layers={self.num_layers}, heads={self.num_heads}, buckets={self.num_buckets}, "
                f"block_size={self.block_size}, qk={self.qk!r}, pv={self.pv!r}, k_scale={self.k_scale!r}, "
                f"target_density={self.target_density}, masks held as {self.masks.form})")

    # -- masks -------------------------------------------------------------------------------
    @property
    def masks(self) -> BlockMasks:
        """The masks as held: packed as loaded, or the bool tensor of a plan built in code."""
        return self.__dict__["block_mask"]

    def layer_mask(self, bucket: int, layer: int) -> torch.Tensor:
        """bool [heads, nq, nk]: the masks of one (bucket, layer), unpacked from the packed form alone (a view
        when the plan holds the bool tensor). What code reading a layer at a time should use: `block_mask`
        unpacks every bucket and layer at full size."""
        return self.masks.layer(bucket, layer)

    def _mask_counts(self, *, dense: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """(active blocks per (bucket, layer, head) int64, the most active blocks of any query block), from one
        scan of the masks that also refuses an empty row or, for square masks, a missing diagonal block
        (skipping dense (bucket, layer) pairs when `dense` is given: their counts are left 0)."""
        masks = self.masks
        b, layers, h = masks.shape[:3]
        counts = torch.zeros(b, layers, h, dtype=torch.int64)
        most = 0
        for bucket, layer, start, rows, missing in masks.scan(dense=dense):
            counts[bucket, layer, start:start + len(rows)] = rows.sum(dim=-1)
            if rows.numel():
                most = max(most, int(rows.max()))
            empty = rows == 0
            if bool(empty.any()):
                head, row = (int(i) for i in empty.nonzero()[0])
                raise PlanError(
                    f"plan block_mask has an empty row (bucket {bucket}, layer {layer}, head {start + head}, query "
                    f"block {row}): every query block must attend to at least its diagonal block; the plan is "
                    "corrupt, recalibrate")
            if missing is not None and bool(missing.any()):
                head, row = (int(i) for i in missing.nonzero()[0])
                raise PlanError(
                    f"plan block_mask lacks the diagonal block of bucket {bucket}, layer {layer}, head {start + head}, "
                    f"query block {row}: plans always keep the diagonal; the plan is corrupt, recalibrate")
        return counts, most

    def most_active_blocks_per_row(self) -> int:
        """The most active key blocks of any query block over every bucket, layer and head (at least 1): the
        width of active-block lists. From the load's scan when the masks are packed, else one scan now."""
        masks = self.masks
        most = masks.most_per_row if masks.form != "full" and masks.counts is not None else self._mask_counts()[1]
        return max(most, 1)

    # -- shape -------------------------------------------------------------------------------
    @property
    def num_buckets(self) -> int:
        return self.masks.shape[0]

    @property
    def num_layers(self) -> int:
        return self.orders.shape[0]

    @property
    def num_heads(self) -> int:
        return self.orders.shape[1]

    @property
    def mask_blocks(self) -> tuple[int, int]:
        return mask_shape(self.layout.seq_len, self.block_size)

    def calibrated_plans(self) -> list[Plan]:
        """This plan and those of its other calibrated sizes."""
        return [self, *self.extra_shapes]

    def achieved_density(self) -> float:
        """Mean fraction of active blocks over the layers and buckets PARO runs."""
        sparse = ~self.dense
        if not bool(sparse.any()):
            return 1.0
        return float(self.density[sparse].mean())

    def head_slice(self, start: int, stop: int) -> Plan:
        """The plan of heads `start..stop-1` of every layer (orders, masks and densities of those heads; the
        dense flags, buckets and layout unchanged): what one GPU runs when the heads are split across GPUs.
        Its tensors are views of this plan's."""
        if not 0 <= start < stop <= self.num_heads:
            raise PlanError(f"head slice {start}:{stop} is not within the plan's {self.num_heads} heads")
        return replace(
            self,
            orders=self.orders[:, start:stop],
            block_mask=self.masks.head_slice(start, stop),
            density=self.density[:, :, start:stop],
            info={**self.info, "head_slice": [start, stop]},
            profiles=None if self.profiles is None else [p[:, :, start:stop] for p in self.profiles],
            extra_shapes=[other.head_slice(start, stop) for other in self.extra_shapes],
        )

    def bucket_of(self, timestep: float) -> int:
        """Bucket index of a timestep on the 0..1000 scale."""
        return bucket_index(self.bucket_edges, timestep)

    def bucket_tensor(self, timestep: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Bucket index of a timestep tensor (scaled by `scale` onto 0..1000) as a 0-dim int64 tensor on its
        device, without a host read (`paroattn.plan.bucket_tensor`)."""
        return bucket_tensor(self.bucket_edges, timestep, scale)

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise PlanError on anything inconsistent; called on construction and on load. Scans every mask
        (a slice of heads at a time) unless the plan holds them packed and they were scanned before."""
        if not _is_int(self.format_version) or not 1 <= self.format_version:
            raise PlanError(f"plan format_version must be an integer >= 1, got {self.format_version!r}")
        if self.format_version > FORMAT_VERSION:
            raise PlanError(
                f"plan format version {self.format_version} is newer than this paroattn reads "
                f"(up to {FORMAT_VERSION}): upgrade paroattn, or recalibrate with this version"
            )
        if problem := modes_problem(self.qk, self.pv) or k_scale_problem(self.k_scale):
            raise PlanError(f"plan modes are unusable: {problem}; the plan is corrupt, recalibrate")
        if (len(self.block_size) != 2 or not all(_is_int(b) for b in self.block_size)
                or not all(16 <= b <= MAX_SIZE for b in self.block_size)):
            raise PlanError(f"plan block_size {self.block_size} must be two sizes of at least 16 (and at most "
                            f"{MAX_SIZE})")
        if (not isinstance(self.target_density, (int, float)) or isinstance(self.target_density, bool)
                or not 0 <= self.target_density <= 1):  # NaN fails the comparison too
            raise PlanError(f"plan target_density must be a number in [0, 1], got {self.target_density!r}: the plan "
                            "is corrupt, recalibrate")
        if not isinstance(self.prompts, list) or not all(isinstance(p, str) for p in self.prompts):
            raise PlanError(f"plan prompts must be a list of strings, got {str(self.prompts)[:100]}: the plan is "
                            "corrupt, recalibrate")
        if not isinstance(self.info, dict):
            raise PlanError(f"plan info must be a dict, got {type(self.info).__name__}")
        if not isinstance(self.layout, TokenLayout) or self.layout.seq_len > MAX_SIZE:
            raise PlanError(f"plan layout must be a TokenLayout of at most {MAX_SIZE} tokens, got {self.layout}")
        for name, dtype in (("orders", torch.int8), ("density", torch.float32), ("dense", torch.bool)):
            t = getattr(self, name)
            if isinstance(t, torch.Tensor) and t.dtype != dtype:
                raise PlanError(
                    f"plan {name} must be a tensor of {_dtype_name(dtype)}; found {_dtype_name(t.dtype)}: the plan is "
                    "corrupt, recalibrate"
                )
        if self.orders.dim() != 2:
            raise PlanError(f"plan orders must be [layers, heads], got shape {tuple(self.orders.shape)}")
        L, H = self.orders.shape
        for name in ("orders", "density"):
            t = getattr(self, name)
            if isinstance(t, torch.Tensor) and (found := _values_problem(name, t)):
                raise PlanError(f"plan {name} must hold {_VALUES[name]}; found {found}: the plan is corrupt, recalibrate")
        problem = bucket_edges_problem(self.bucket_edges)
        if problem:
            raise PlanError(f"plan {problem}")
        nq, nk = self.mask_blocks
        buckets = len(self.bucket_edges) - 1
        expected = (buckets, L, H, nq, nk)
        if tuple(self.masks.shape) != expected:
            raise PlanError(
                f"plan block_mask has shape {tuple(self.masks.shape)}; expected "
                f"[buckets, layers, heads, nq, nk] = {list(expected)} from {buckets} buckets, orders "
                f"{L}x{H}, and {self.layout.seq_len} tokens in blocks of {self.block_size}"
            )
        if self.density is None or tuple(self.density.shape) != (buckets, L, H):
            found = None if self.density is None else tuple(self.density.shape)
            raise PlanError(f"plan density must be [buckets, layers, heads] = {[buckets, L, H]}, got {found}")
        if self.dense is None or tuple(self.dense.shape) != (buckets, L):
            found = None if self.dense is None else tuple(self.dense.shape)
            raise PlanError(f"plan dense must be [buckets, layers] = {[buckets, L]}, got {found}")
        if self.profiles is not None:
            sizes = (self.layout.frames, self.layout.height, self.layout.width)
            if len(self.profiles) != 3:
                raise PlanError(f"plan profiles must be three tensors (F, H, W axes), got {len(self.profiles)}")
            for name, p, n in zip(PROFILE_TENSORS, self.profiles, sizes):
                if tuple(p.shape) != (buckets, L, H, 2 * n - 1):
                    raise PlanError(f"plan {name} must be [buckets, layers, heads, 2n-1] = {[buckets, L, H, 2 * n - 1]} "
                                    f"for the layout {self.layout}; found {list(p.shape)}: the plan is corrupt, recalibrate")
                if not bool((torch.isfinite(p) & (p >= 0)).all()):
                    raise PlanError(f"plan {name} must hold finite masses >= 0: the plan is corrupt, recalibrate")
        for other in self.extra_shapes:
            mismatch = [name for name in ("model_class", "model_fingerprint", "bucket_edges", "qk", "pv", "k_scale",
                                          "block_size", "expert") if getattr(other, name) != getattr(self, name)]
            if mismatch or other.num_layers != L or other.num_heads != H or not torch.equal(other.dense, self.dense):
                raise PlanError(f"the plan calibrated for {other.layout} differs from the one for {self.layout} in "
                                f"{mismatch or 'its layers, heads or dense flags'}: one plan holds sizes of one model "
                                "calibrated with one setting")
        layouts = [p.layout for p in self.calibrated_plans()]
        if len(set(layouts)) != len(layouts):
            raise PlanError(f"plan lists a calibrated size twice: {[str(x) for x in layouts]}")
        masks = self.masks
        if masks.form != "full" and masks.counts is not None:
            counts, most = masks.counts, masks.most_per_row
        else:
            counts, most = self._mask_counts()
        actual = counts.double() / max(1, nq * nk)
        if not torch.allclose(self.density.double(), actual, atol=1e-4):
            worst = float((self.density.double() - actual).abs().max())
            raise PlanError(
                f"plan density disagrees with its masks by up to {worst:.4f}: density must be each mask's "
                "fraction of active blocks; the plan is corrupt, recalibrate"
            )
        if masks.form != "full":  # packed forms do not change: later checks can trust this scan
            masks.counts, masks.most_per_row = counts, most

    def validate_for_apply(self) -> None:
        """Check, cheaply, what the processor will read, for a plan that may have changed since it was built or
        loaded (`paroattn.apply` calls it): orders in range, bucket edges finite and ordered, shapes, and
        masks without an empty row in the (bucket, layer) pairs the plan runs sparse. Masks held packed and
        scanned before are not scanned again. Raises PlanError; covers the plan's other calibrated sizes."""
        for plan in self.calibrated_plans():
            if not isinstance(plan.orders, torch.Tensor) or plan.orders.dtype != torch.int8 or plan.orders.dim() != 2:
                raise PlanError("plan orders must be an int8 tensor [layers, heads]; it was changed after loading")
            if found := _values_problem("orders", plan.orders):
                raise PlanError(f"plan orders must hold {_VALUES['orders']}; found {found}: it was changed after "
                                "loading; reload or recalibrate it")
            if problem := bucket_edges_problem(plan.bucket_edges):
                raise PlanError(f"plan {problem}: it was changed after loading; reload or recalibrate it")
            L, H = plan.orders.shape
            expected = (len(plan.bucket_edges) - 1, L, H, *plan.mask_blocks)
            if (tuple(plan.masks.shape) != expected or not isinstance(plan.dense, torch.Tensor)
                    or plan.dense.dtype != torch.bool or tuple(plan.dense.shape) != expected[:2]):
                raise PlanError(f"plan masks must be {list(expected)} and dense flags {list(expected[:2])} (bool); "
                                f"found {list(plan.masks.shape)} and {getattr(plan.dense, 'shape', None)}: the plan was "
                                "changed after loading; reload or recalibrate it")
            if plan.masks.form == "full" or plan.masks.counts is None:
                plan._mask_counts(dense=plan.dense)

    # -- IO ----------------------------------------------------------------------------------
    def _stored(self, version: int, prefix: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
        """(metadata, tensors) of this plan's own size in a file of format `version`, tensor names prefixed
        with `prefix`."""
        meta = {
            "format_version": version,
            "model_class": self.model_class,
            "model_fingerprint": self.model_fingerprint,
            # [prefix, frames, height, width] (+ suffix when there is one: files without it read as before)
            "layout": list(self.layout.fields if self.layout.suffix else self.layout.fields[:4]),
            "block_size": list(self.block_size),
            "block_mask_shape": list(self.masks.shape),
            "bucket_edges": self.bucket_edges,
            "qk": self.qk,
            "pv": self.pv,
            "k_scale": self.k_scale,
            "target_density": self.target_density,
            "prompts": self.prompts,
            "info": self.info,
            "expert": self.expert,
        }
        tensors = {
            "orders": self.orders.contiguous(),
            "density": self.density.contiguous(),
            "dense": self.dense.to(torch.uint8).contiguous(),
        }
        if version >= CHUNKED_MASKS_VERSION:
            tensors["block_mask_chunks"], tensors["block_mask_index"] = self.masks.encode()
        else:
            tensors["block_mask_bits"] = self.masks.flat_bits()
        if self.profiles is not None:
            tensors.update(zip(PROFILE_TENSORS, (p.contiguous() for p in self.profiles)))
        return meta, {prefix + name: t for name, t in tensors.items()}

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan in its `format_version` (new plans: the current one), with its checksum."""
        version = self.format_version
        meta, tensors = self._stored(version)
        if self.extra_shapes:
            meta["extra_shapes"] = []
            for i, other in enumerate(self.extra_shapes):
                other_meta, other_tensors = other._stored(version, f"shape{i}.")
                meta["extra_shapes"].append({key: other_meta[key] for key in (
                    "layout", "block_mask_shape", "target_density", "prompts", "info")})
                tensors.update(other_tensors)
        text = json.dumps(meta)
        write_safetensors(tensors, path, {METADATA_KEY: text, CHECKSUM_KEY: checksum(text, tensors)})

    @classmethod
    def _from_stored(cls, meta: dict, shape_meta: dict, tensors: dict[str, torch.Tensor], prefix: str) -> Plan:
        """The plan of one stored size: `meta` the file's checked metadata, `shape_meta` that size's own entries."""
        own = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)
               and (prefix or "." not in name)}
        version = meta["format_version"]
        for name in own:
            if problem := stored_tensor_problem(name, own[name]):
                raise PlanError(f"{problem}: the plan is corrupt, recalibrate")
        shape = tuple(shape_meta["block_mask_shape"])
        if version >= CHUNKED_MASKS_VERSION:
            masks = BlockMasks.from_chunks(own["block_mask_chunks"], own["block_mask_index"], shape)
        else:
            masks = BlockMasks.from_bits(own["block_mask_bits"], shape)
        profiles = [own[name] for name in PROFILE_TENSORS] if PROFILE_TENSORS[0] in own else None
        return cls(
            model_class=meta["model_class"],
            model_fingerprint=meta["model_fingerprint"],
            layout=shape_meta["layout"],
            block_size=tuple(meta["block_size"]),
            orders=own["orders"],
            block_mask=masks,
            bucket_edges=meta["bucket_edges"],
            qk=meta["qk"],
            pv=meta["pv"],
            k_scale=meta["k_scale"],
            target_density=shape_meta["target_density"],
            density=own["density"],
            dense=own["dense"].bool(),
            prompts=shape_meta["prompts"],
            info=shape_meta["info"],
            expert=meta["expert"],
            format_version=version,
            profiles=profiles,
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan file. Every problem with the file, whatever its cause, is a PlanError naming the path
        and the field. Holds about the file's size (the masks stay packed, `masks`), and while it checks them
        two decoded (bucket, layer) masks beside it at most; a file whose checksum disagrees with its contents is
        refused, one without a checksum (written before checksums existed) loads with a `PlanWarning`."""
        if not isinstance(path, (str, os.PathLike)):
            raise PlanError(f"Plan.load takes the path of a plan file, got {type(path).__name__}")
        path = Path(path)
        if path.is_dir():
            raise PlanError(f"{path} is a folder: pass a plan file (the .safetensors that `paro calibrate --out` wrote)")
        if not path.is_file():
            raise PlanError(f"no plan file at {path}: create one with `paro calibrate MODEL_DIR --out {path}`")
        try:
            with open(path, "rb") as f:
                metadata, entries, data_start = read_header(f, file_size(f))
                if METADATA_KEY not in metadata:
                    raise PlanError(
                        f"a safetensors file but not a paroattn plan (no {METADATA_KEY!r} metadata): "
                        "pass the file written by `paro calibrate`"
                    )
                text = metadata[METADATA_KEY]
                meta = _checked_metadata(text)
                _check_tensor_entries(entries, meta)
                tensors = read_tensors(f, list(entries.values()), data_start)
            stored = metadata.get(CHECKSUM_KEY)
            if stored is None:
                warnings.warn(f"{path} has no checksum (written by a paroattn before checksums): its contents cannot "
                              "be verified; re-save it with Plan.load(path).save(path) to add one", PlanWarning,
                              stacklevel=2)
            elif checksum(text, tensors) != stored:
                raise PlanError("contents do not match the checksum saved with them: the file was changed or "
                                "damaged after it was written; copy it again or recalibrate")
            plan = cls._from_stored(meta, meta, tensors, "")
            extra = [cls._from_stored(meta, shape_meta, tensors, f"shape{i}.")
                     for i, shape_meta in enumerate(meta["extra_shapes"])]
            if extra:
                plan.extra_shapes = extra
                plan.validate()
            return plan
        except PlanError as exc:
            if str(path) in str(exc):
                raise
            raise PlanError(f"{path}: {exc}") from None
        except OSError as exc:
            raise PlanError(f"{path} cannot be read ({exc}): check the file and its permissions") from None
        except RecursionError:
            raise PlanError(f"{path}: plan metadata is nested too deeply: the plan is corrupt, recalibrate") from None

    def describe_expert(self) -> str:
        """"the transformer_2 plan" or "a plan" (no expert recorded), for messages."""
        return f"the {self.expert} plan" if self.expert else "a plan"

    # -- construction helpers ----------------------------------------------------------------
    @classmethod
    def synthetic(
        cls,
        *,
        layout: TokenLayout,
        num_layers: int,
        num_heads: int,
        density: float = 1.0,
        orders: torch.Tensor | str | None = None,
        num_buckets: int = 1,
        block_size: int | tuple[int, int] = 64,
        qk: str = "bf16",
        pv: str = "bf16",
        k_scale: str = "block",
        model_class: str = "",
        model_fingerprint: str = "",
        seed: int = 0,
        profiles: bool = False,
    ) -> Plan:
        """A plan of the right shapes without calibration: identity ("FHW"), named, random
        ("random") or given orders, and masks of a band around the diagonal plus random blocks at
        `density`. For tests, benchmarks and the dense-equivalence check (density=1.0). `profiles`: random axis
        profiles too, so that the plan derives masks for other sizes."""
        g = torch.Generator().manual_seed(seed)
        if orders is None or orders == "FHW":
            orders = torch.zeros(num_layers, num_heads, dtype=torch.int8)
        elif orders == "random":
            orders = torch.randint(0, len(ORDERS), (num_layers, num_heads), generator=g, dtype=torch.int8)
        elif isinstance(orders, str):
            orders = torch.full((num_layers, num_heads), ORDERS.index(orders), dtype=torch.int8)
        bq, bk = block_sizes(block_size)
        nq, nk = mask_shape(layout.seq_len, block_size)
        masks = torch.stack([
            synthetic_block_mask(num_layers * num_heads, nq, nk, density, generator=g).view(num_layers, num_heads, nq, nk)
            for _ in range(num_buckets)
        ])
        if profiles:
            sizes = (layout.frames, layout.height, layout.width)
            profiles = [torch.rand(num_buckets, num_layers, num_heads, 2 * n - 1, generator=g) for n in sizes]
        return cls(
            model_class=model_class,
            model_fingerprint=model_fingerprint,
            layout=layout,
            block_size=(bq, bk),
            orders=orders,
            block_mask=masks,
            bucket_edges=default_bucket_edges(num_buckets),
            qk=qk,
            pv=pv,
            k_scale=k_scale,
            target_density=density,
            profiles=profiles or None,
        )


def _short(value) -> str:
    """A metadata value as JSON, cut for a message."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _bad_entry(key: str, expected: str, value) -> PlanError:
    return PlanError(f"plan metadata {key!r} must be {expected}; found {_short(value)}: the plan is corrupt, recalibrate")


def _entry(meta: dict, key: str, where: str = "", default=...):
    if key not in meta:
        if default is not ...:
            return default
        raise PlanError(f"plan metadata lacks {where + key!r}: the plan is corrupt, recalibrate")
    return meta[key]


def _int_entry(meta: dict, key: str, low: int, high: int, where: str = "") -> int:
    value = _entry(meta, key, where)
    if not _is_int(value) or not low <= value <= high:
        raise _bad_entry(where + key, f"an integer in {low}..{high}", value)
    return value


def _ints_entry(meta: dict, key: str, lengths: tuple[int, ...], low: int, high: int, where: str = "") -> list[int]:
    value = _entry(meta, key, where)
    if (not isinstance(value, list) or len(value) not in lengths
            or not all(_is_int(x) and low <= x <= high for x in value)):
        raise _bad_entry(where + key, f"a list of {' or '.join(map(str, lengths))} integers in {low}..{high}", value)
    return value


def _number_entry(meta: dict, key: str, low: float, high: float, where: str = "", default=...) -> float:
    value = _entry(meta, key, where, default)
    # comparisons, not float(): a huge integer does not overflow, NaN fails them
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise _bad_entry(where + key, f"a finite number in [{low:g}, {high:g}]", value)
    return float(value)


def _str_entry(meta: dict, key: str, where: str = "", default=...) -> str:
    value = _entry(meta, key, where, default)
    if not isinstance(value, str):
        raise _bad_entry(where + key, "a string", value)
    return value


def _size_entries(meta: dict, where: str) -> dict:
    """The entries of one calibrated size: its layout, mask shape, target density, prompts and info."""
    fields = _ints_entry(meta, "layout", (4, 5), 0, MAX_SIZE, where)
    try:
        layout = TokenLayout(*fields)
    except (TypeError, ValueError) as exc:
        raise _bad_entry(where + "layout", f"[prefix, frames, height, width(, suffix)] ({exc})", fields) from None
    prompts = _entry(meta, "prompts", where, [])
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise _bad_entry(where + "prompts", "a list of strings", prompts)
    info = _entry(meta, "info", where, {})
    if not isinstance(info, dict):
        raise _bad_entry(where + "info", "a JSON object", info)
    return {
        "layout": layout,
        "block_mask_shape": _ints_entry(meta, "block_mask_shape", (5,), 0, MAX_SIZE, where),
        "target_density": _number_entry(meta, "target_density", 0.0, 1.0, where),
        "prompts": prompts,
        "info": info,
    }


def _checked_metadata(text: str) -> dict:
    """A plan file's metadata JSON, every entry checked for its type and range (PlanError naming the entry)."""
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise PlanError(f"plan metadata is malformed ({type(exc).__name__}: {str(exc)[:100]}): the plan is corrupt, "
                        "recalibrate") from None
    if not isinstance(meta, dict):
        raise _bad_entry("paroattn_plan", "a JSON object", meta)
    version = _int_entry(meta, "format_version", 1, 1 << 62)
    if version > FORMAT_VERSION:
        raise PlanError(f"plan format version {version}, newer than this paroattn reads (up to {FORMAT_VERSION}): "
                        "upgrade paroattn")
    edges = _entry(meta, "bucket_edges")
    if (not isinstance(edges, list) or not 2 <= len(edges) <= MAX_BUCKETS + 1
            or not all(isinstance(e, (int, float)) and not isinstance(e, bool) and 0 <= e <= 1000 for e in edges)):
        raise _bad_entry("bucket_edges", f"a list of 2..{MAX_BUCKETS + 1} finite timesteps in [0, 1000]", edges)
    extra = _entry(meta, "extra_shapes", "", [])
    if not isinstance(extra, list) or len(extra) > MAX_EXTRA_SHAPES or not all(isinstance(e, dict) for e in extra):
        raise _bad_entry("extra_shapes", f"a list of at most {MAX_EXTRA_SHAPES} JSON objects", extra)
    return {
        "format_version": version,
        "model_class": _str_entry(meta, "model_class"),
        "model_fingerprint": _str_entry(meta, "model_fingerprint"),
        "block_size": _ints_entry(meta, "block_size", (2,), 16, MAX_SIZE),
        "bucket_edges": [float(e) for e in edges],
        "qk": _str_entry(meta, "qk"),
        "pv": _str_entry(meta, "pv"),
        "k_scale": _str_entry(meta, "k_scale", "", "block"),
        "expert": _str_entry(meta, "expert", "", ""),
        **_size_entries(meta, ""),
        "extra_shapes": [_size_entries(e, f"extra_shapes[{i}].") for i, e in enumerate(extra)],
    }


def _check_tensor_entries(entries: dict, meta: dict) -> None:
    """The file holds exactly the tensors of its format version for each calibrated size, each of the dtype
    `Plan.save` writes: checked from the header, before any tensor is read."""
    version = meta["format_version"]
    names = REQUIRED_TENSORS + MASK_TENSORS[version]
    allowed = set()
    for prefix in [""] + [f"shape{i}." for i in range(len(meta["extra_shapes"]))]:
        missing = [prefix + n for n in names if prefix + n not in entries]
        if missing:
            raise PlanError(f"lacks the tensors {missing}: the plan is corrupt, recalibrate")
        profiles = [prefix + n for n in PROFILE_TENSORS if prefix + n in entries]
        if profiles and len(profiles) != len(PROFILE_TENSORS):
            raise PlanError(f"holds some of the tensors {[prefix + n for n in PROFILE_TENSORS]} but not all: the plan "
                            "is corrupt, recalibrate")
        allowed.update(prefix + n for n in names + PROFILE_TENSORS)
    unknown = sorted(set(entries) - allowed)
    if unknown:
        raise PlanError(f"holds tensors {[n[:60] for n in unknown[:4]]} that a plan of format version {version} does "
                        "not have: the plan is corrupt, recalibrate")
    for name, entry in entries.items():
        base = name.rsplit(".", 1)[-1] if name.startswith("shape") else name
        dtype, values = STORED_TENSORS[base]
        if entry.dtype != dtype:
            raise PlanError(f"plan tensor {base!r} must be {_dtype_name(dtype)} with {values}; found "
                            f"{_dtype_name(entry.dtype)}: the plan is corrupt, recalibrate")


def expert_plan_path(path: str | os.PathLike, expert: str) -> Path:
    """Where `paro calibrate --out path` writes the plan of `expert`: `path` itself for the first expert
    ("transformer"), `<stem>.<expert>.safetensors` beside it for the others."""
    path = Path(path)
    if expert in ("", "transformer"):
        return path
    stem = path.name[: -len(".safetensors")] if path.name.endswith(".safetensors") else path.stem
    return path.with_name(f"{stem}.{expert}.safetensors")


MAX_EXPERTS = 8
MAX_FILE_NAME_BYTES = 255  # the longest file name most file systems take


def _expert_file_problem(expert, name) -> str | None:
    """Why an entry of a plan's `info["experts"]` cannot name an expert and a file beside the plan, or None."""
    if not isinstance(expert, str) or not expert or len(expert) > 100:
        return f"expert name {_short(expert)} is not a name of 1 to 100 characters"
    if not isinstance(name, str):
        return f"the file of expert {_short(expert)} is {_short(name)}, not a string"
    if (name in ("", ".", "..") or any(c in name for c in "/\\\0") or len(name.encode("utf-8", "replace"))
            > MAX_FILE_NAME_BYTES):
        return (f"the file of expert {_short(expert)} is {_short(name)}, not a plain file name (no folder, at most "
                f"{MAX_FILE_NAME_BYTES} bytes)")
    return None


def load_plans(path: str | os.PathLike) -> list[Plan]:
    """The plan at `path`, or, when it is one plan of an expert pair (`info["experts"]`: expert -> file name
    in the same folder), every plan of the pair in the order listed. Raises PlanError when a listed file is
    missing or holds another expert's plan."""
    path = Path(path)
    plan = Plan.load(path)
    files = plan.info.get("experts")
    if not isinstance(files, dict) or not files:
        return [plan]
    if len(files) > MAX_EXPERTS:
        raise PlanError(f"{path}: plan info 'experts' lists {len(files)} experts, more than a pipeline has "
                        f"(at most {MAX_EXPERTS}): the plan is corrupt, recalibrate")
    for expert, name in files.items():
        if problem := _expert_file_problem(expert, name):
            raise PlanError(f"{path}: plan info 'experts' must map expert names to file names in the plan's folder; "
                            f"{problem}: the plan is corrupt, recalibrate")
    plans = []
    for expert, name in files.items():
        other_path = path.with_name(name)
        if other_path.name == path.name:
            other = plan
        elif not other_path.is_file():
            raise PlanError(
                f"{path} is {plan.describe_expert()} of an expert pair; the {expert} plan {other_path} is missing: "
                f"copy it beside {path.name}, or recalibrate with `paro calibrate MODEL_DIR --out {path}`"
            )
        else:
            other = Plan.load(other_path)
        if other.expert != expert:
            raise PlanError(
                f"{other_path} should hold the {expert} plan of the pair listed in {path.name}; it holds "
                f"{other.describe_expert()}: recalibrate with `paro calibrate MODEL_DIR --out {path}`"
            )
        plans.append(other)
    return plans
