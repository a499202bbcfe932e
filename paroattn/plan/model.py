"""The plan: everything a PARO run needs, chosen offline by `paro calibrate`.

On disk: one safetensors file. Tensors: `orders` int8 [L, H], `block_mask_bits` uint8 (the bool
masks [buckets, L, H, nq, nk] bit-packed, 8x smaller), `density` float32 [buckets, L, H],
`dense` uint8 [buckets, L] (1 = run that layer with the model's own attention in that bucket).
Everything else is JSON in the safetensors metadata under the key "paroattn_plan". No pickle.

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
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import PlanError
from ..layout import ORDERS, TokenLayout
from ..masks import block_sizes, mask_shape, synthetic_block_mask
from ..modes import modes_problem

FORMAT_VERSION = 2
PROFILE_TENSORS = ("profile_f", "profile_h", "profile_w")
METADATA_KEY = "paroattn_plan"
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


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool tensor -> uint8 [ceil(numel/8)], little-endian bit order within a byte."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    count = math.prod(shape)
    bits = (packed.reshape(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(-1)[:count].to(torch.bool).reshape(shape)


# the tensors of a plan file: the dtype each has on disk and the values it may hold (the masks in code
# are bool, `dense` bool, `orders` int8 and `density` float32)
STORED_TENSORS = {
    "orders": (torch.int8, f"values in 0..{len(ORDERS) - 1} (indices into {ORDERS})"),
    "block_mask_bits": (torch.uint8, "bit-packed masks"),
    "density": (torch.float32, "finite values in [0, 1] (each mask's fraction of active blocks)"),
    "dense": (torch.uint8, "values 0 or 1"),
}
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
    if name == "block_mask_bits" and t.dim() != 1:
        return f"{expected}, one-dimensional; found shape {tuple(t.shape)}"
    if found := _values_problem(name, t):
        return f"{expected}; found {found}"
    return None


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


@dataclass
class Plan:
    """Per (layer, head) order and per (bucket, layer, head) block mask, plus what they were made for.

    Timesteps are on the 0..1000 scale. Bucket b holds t with `bucket_edges[b] >= t > bucket_edges[b+1]`
    (the last bucket also holds t = bucket_edges[-1]); edges descend, so bucket 0 is the first steps.
    """

    model_class: str
    model_fingerprint: str
    layout: TokenLayout
    block_size: tuple[int, int]
    orders: torch.Tensor  # int [L, H]
    block_mask: torch.Tensor  # bool [buckets, L, H, nq, nk]
    bucket_edges: list[float]
    qk: str = "bf16"
    pv: str = "bf16"
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
        self.block_size = tuple(int(b) for b in self.block_size)
        # tensors built in code may come as lists or in wider dtypes (int64 orders, 0/1 integer masks):
        # their values are checked before they are narrowed (a float order 2.7 is not cut to 2, an int64
        # order 262 does not wrap to 6, a dense flag 7 does not become True)
        self.orders = _narrowed("orders", self.orders, torch.int8)
        self.block_mask = _narrowed("block_mask", self.block_mask, torch.bool)
        self.bucket_edges = [float(e) for e in self.bucket_edges]
        self.expert = str(self.expert or "")
        if self.density is None and self.block_mask.dim() == 5:
            self.density = self.block_mask.float().mean(dim=(-1, -2))
        if self.density is not None:
            self.density = _narrowed("density", self.density, torch.float32)
        if self.dense is None and self.block_mask.dim() == 5:
            self.dense = torch.zeros(self.block_mask.shape[:2], dtype=torch.bool)
        if self.dense is not None:
            self.dense = _narrowed("dense", self.dense, torch.bool)
        if self.profiles is not None:
            self.profiles = [torch.as_tensor(p).float().cpu() for p in self.profiles]
        self.extra_shapes = list(self.extra_shapes)
        self.validate()

    # -- shape -------------------------------------------------------------------------------
    @property
    def num_buckets(self) -> int:
        return self.block_mask.shape[0]

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
            block_mask=self.block_mask[:, :, start:stop],
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
        """Raise PlanError on anything inconsistent; called on construction and on load."""
        if self.format_version > FORMAT_VERSION:
            raise PlanError(
                f"plan format version {self.format_version} is newer than this paroattn reads "
                f"(up to {FORMAT_VERSION}): upgrade paroattn, or recalibrate with this version"
            )
        if problem := modes_problem(self.qk, self.pv):
            raise PlanError(f"plan modes are unusable: {problem}; the plan is corrupt, recalibrate")
        if len(self.block_size) != 2 or min(self.block_size) < 16:
            raise PlanError(f"plan block_size {self.block_size} must be two sizes >= 16")
        for name, dtype in (("orders", torch.int8), ("block_mask", torch.bool), ("density", torch.float32),
                            ("dense", torch.bool)):
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
        nq, nk = self.mask_blocks
        buckets = len(self.bucket_edges) - 1
        expected = (buckets, L, H, nq, nk)
        if tuple(self.block_mask.shape) != expected:
            raise PlanError(
                f"plan block_mask has shape {tuple(self.block_mask.shape)}; expected "
                f"[buckets, layers, heads, nq, nk] = {list(expected)} from {buckets} buckets, orders "
                f"{L}x{H}, and {self.layout.seq_len} tokens in blocks of {self.block_size}"
            )
        problem = bucket_edges_problem(self.bucket_edges)
        if problem:
            raise PlanError(f"plan {problem}")
        if self.density is None or tuple(self.density.shape) != (buckets, L, H):
            found = None if self.density is None else tuple(self.density.shape)
            raise PlanError(f"plan density must be [buckets, layers, heads] = {[buckets, L, H]}, got {found}")
        if self.dense is None or tuple(self.dense.shape) != (buckets, L):
            found = None if self.dense is None else tuple(self.dense.shape)
            raise PlanError(f"plan dense must be [buckets, layers] = {[buckets, L]}, got {found}")
        empty = ~self.block_mask.any(dim=-1)
        if bool(empty.any()):
            b, layer, h, row = (int(i) for i in empty.nonzero()[0])
            raise PlanError(
                f"plan block_mask has an empty row (bucket {b}, layer {layer}, head {h}, query block {row}): "
                "every query block must attend to at least its diagonal block; the plan is corrupt, recalibrate"
            )
        if nq == nk:
            off_diagonal = ~self.block_mask.diagonal(dim1=-2, dim2=-1)
            if bool(off_diagonal.any()):
                b, layer, h, row = (int(i) for i in off_diagonal.nonzero()[0])
                raise PlanError(
                    f"plan block_mask lacks the diagonal block of bucket {b}, layer {layer}, head {h}, query block "
                    f"{row}: plans always keep the diagonal; the plan is corrupt, recalibrate"
                )
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
            mismatch = [name for name in ("model_class", "model_fingerprint", "bucket_edges", "qk", "pv", "block_size",
                                          "expert") if getattr(other, name) != getattr(self, name)]
            if mismatch or other.num_layers != L or other.num_heads != H or not torch.equal(other.dense, self.dense):
                raise PlanError(f"the plan calibrated for {other.layout} differs from the one for {self.layout} in "
                                f"{mismatch or 'its layers, heads or dense flags'}: one plan holds sizes of one model "
                                "calibrated with one setting")
        layouts = [p.layout for p in self.calibrated_plans()]
        if len(set(layouts)) != len(layouts):
            raise PlanError(f"plan lists a calibrated size twice: {[str(x) for x in layouts]}")
        actual = self.block_mask.float().mean(dim=(-1, -2))
        if not torch.allclose(self.density, actual, atol=1e-4):
            worst = float((self.density - actual).abs().max())
            raise PlanError(
                f"plan density disagrees with its masks by up to {worst:.4f}: density must be each mask's "
                "fraction of active blocks; the plan is corrupt, recalibrate"
            )

    # -- IO ----------------------------------------------------------------------------------
    def _stored(self, prefix: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
        """(metadata, tensors) of this plan's own size, tensor names prefixed with `prefix`."""
        meta = {
            "format_version": self.format_version,
            "model_class": self.model_class,
            "model_fingerprint": self.model_fingerprint,
            # [prefix, frames, height, width] (+ suffix when there is one: files without it read as before)
            "layout": list(self.layout.fields if self.layout.suffix else self.layout.fields[:4]),
            "block_size": list(self.block_size),
            "block_mask_shape": list(self.block_mask.shape),
            "bucket_edges": self.bucket_edges,
            "qk": self.qk,
            "pv": self.pv,
            "target_density": self.target_density,
            "prompts": self.prompts,
            "info": self.info,
            "expert": self.expert,
        }
        tensors = {
            "orders": self.orders.contiguous(),
            "block_mask_bits": pack_bits(self.block_mask),
            "density": self.density.contiguous(),
            "dense": self.dense.to(torch.uint8).contiguous(),
        }
        if self.profiles is not None:
            tensors.update(zip(PROFILE_TENSORS, (p.contiguous() for p in self.profiles)))
        return meta, {prefix + name: t for name, t in tensors.items()}

    def save(self, path: str | os.PathLike) -> None:
        meta, tensors = self._stored()
        if self.extra_shapes:
            meta["extra_shapes"] = []
            for i, other in enumerate(self.extra_shapes):
                other_meta, other_tensors = other._stored(f"shape{i}.")
                meta["extra_shapes"].append({key: other_meta[key] for key in (
                    "layout", "block_mask_shape", "target_density", "prompts", "info")})
                tensors.update(other_tensors)
        write_safetensors(tensors, path, {METADATA_KEY: json.dumps(meta)})

    @classmethod
    def _from_stored(cls, meta: dict, shape_meta: dict, tensors: dict[str, torch.Tensor], prefix: str,
                     version: int, path: Path) -> Plan:
        """The plan of one stored size: `meta` the file's metadata, `shape_meta` that size's own entries."""
        own = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)
               and (prefix or "." not in name)}
        missing = STORED_TENSORS.keys() - own.keys()
        if missing:
            raise PlanError(f"{path} lacks the tensors {sorted(prefix + m for m in missing)}: the plan is corrupt, "
                            "recalibrate")
        for name in STORED_TENSORS:
            if problem := stored_tensor_problem(name, own[name]):
                raise PlanError(f"{path}: {problem}: the plan is corrupt, recalibrate")
        shape = tuple(int(s) for s in shape_meta["block_mask_shape"])
        if own["block_mask_bits"].numel() != -(-math.prod(shape) // 8):
            raise PlanError(
                f"{path}: packed block mask holds {own['block_mask_bits'].numel()} bytes, expected "
                f"{-(-math.prod(shape) // 8)} for shape {list(shape)}: the plan is corrupt, recalibrate"
            )
        profiles = None
        if any(name in own for name in PROFILE_TENSORS):
            if not all(name in own for name in PROFILE_TENSORS):
                raise PlanError(f"{path} holds some of the tensors {list(PROFILE_TENSORS)} but not all: the plan is "
                                "corrupt, recalibrate")
            profiles = [own[name] for name in PROFILE_TENSORS]
        return cls(
            model_class=str(meta["model_class"]),
            model_fingerprint=str(meta["model_fingerprint"]),
            layout=TokenLayout(*(int(x) for x in shape_meta["layout"])),
            block_size=tuple(meta["block_size"]),
            orders=own["orders"],
            block_mask=unpack_bits(own["block_mask_bits"], shape),
            bucket_edges=meta["bucket_edges"],
            qk=meta["qk"],
            pv=meta["pv"],
            target_density=float(shape_meta["target_density"]),
            density=own["density"],
            dense=own["dense"].bool(),
            prompts=list(shape_meta.get("prompts", [])),
            info=dict(shape_meta.get("info", {})),
            expert=str(meta.get("expert", "")),
            format_version=version,
            profiles=profiles,
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        from safetensors import safe_open

        if not isinstance(path, (str, os.PathLike)):
            raise PlanError(f"Plan.load takes the path of a plan file, got {type(path).__name__}")
        path = Path(path)
        if path.is_dir():
            raise PlanError(f"{path} is a folder: pass a plan file (the .safetensors that `paro calibrate --out` wrote)")
        if not path.is_file():
            raise PlanError(f"no plan file at {path}: create one with `paro calibrate MODEL_DIR --out {path}`")
        try:
            with safe_open(os.fspath(path), framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # safetensors raises several types for bad headers and short files
            raise PlanError(
                f"{path} is not a readable safetensors file ({exc}); it may be truncated or corrupt: "
                "copy it again or recalibrate"
            ) from None
        if METADATA_KEY not in metadata:
            raise PlanError(
                f"{path} is a safetensors file but not a paroattn plan (no {METADATA_KEY!r} metadata): "
                "pass the file written by `paro calibrate`"
            )
        try:
            meta = json.loads(metadata[METADATA_KEY])
            version = int(meta["format_version"])
            if version > FORMAT_VERSION:
                raise PlanError(
                    f"{path} has plan format version {version}, newer than this paroattn reads "
                    f"(up to {FORMAT_VERSION}): upgrade paroattn"
                )
            plan = cls._from_stored(meta, meta, tensors, "", version, path)
            extra = [cls._from_stored(meta, shape_meta, tensors, f"shape{i}.", version, path)
                     for i, shape_meta in enumerate(meta.get("extra_shapes", []))]
            if extra:
                plan.extra_shapes = extra
                plan.validate()
            return plan
        except PlanError as exc:
            if str(path) in str(exc):
                raise
            raise PlanError(f"{path}: {exc}") from None
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise PlanError(f"{path}: plan metadata is malformed ({exc!r}): the plan is corrupt, recalibrate") from None

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
            target_density=density,
            profiles=profiles or None,
        )


def expert_plan_path(path: str | os.PathLike, expert: str) -> Path:
    """Where `paro calibrate --out path` writes the plan of `expert`: `path` itself for the first expert
    ("transformer"), `<stem>.<expert>.safetensors` beside it for the others."""
    path = Path(path)
    if expert in ("", "transformer"):
        return path
    stem = path.name[: -len(".safetensors")] if path.name.endswith(".safetensors") else path.stem
    return path.with_name(f"{stem}.{expert}.safetensors")


def load_plans(path: str | os.PathLike) -> list[Plan]:
    """The plan at `path`, or, when it is one plan of an expert pair (`info["experts"]`: expert -> file name
    in the same folder), every plan of the pair in the order listed. Raises PlanError when a listed file is
    missing or holds another expert's plan."""
    path = Path(path)
    plan = Plan.load(path)
    files = plan.info.get("experts")
    if not isinstance(files, dict) or not files:
        return [plan]
    plans = []
    for expert, name in files.items():
        other_path = path.with_name(str(name))
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
