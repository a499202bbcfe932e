"""The plan: everything a PARO run needs, chosen offline by `paro calibrate`.

On disk: one safetensors file. Tensors: `orders` int8 [L, H], `block_mask_bits` uint8 (the bool
masks [buckets, L, H, nq, nk] bit-packed, 8x smaller), `density` float32 [buckets, L, H],
`dense` uint8 [buckets, L] (1 = run that layer with the model's own attention in that bucket).
Everything else is JSON in the safetensors metadata under the key "paroattn_plan". No pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import PlanError
from .layout import ORDERS, TokenLayout
from .masks import block_sizes, mask_shape, synthetic_block_mask
from .modes import modes_problem

FORMAT_VERSION = 1
METADATA_KEY = "paroattn_plan"
# config entries that describe where a model came from, not what it computes
_CONFIG_KEYS_IGNORED = ("_name_or_path", "_diffusers_version", "_class_name", "_use_default_values")


def model_fingerprint(config) -> str:
    """Short stable hash of a model config (a diffusers FrozenDict or a dict)."""
    items = {k: v for k, v in dict(config).items() if k not in _CONFIG_KEYS_IGNORED}
    text = json.dumps(items, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if isinstance(self.block_size, int):
            self.block_size = (self.block_size, self.block_size)
        self.block_size = tuple(int(b) for b in self.block_size)
        self.orders = torch.as_tensor(self.orders).to(torch.int8).cpu()
        self.block_mask = torch.as_tensor(self.block_mask).to(torch.bool).cpu()
        self.bucket_edges = [float(e) for e in self.bucket_edges]
        if self.density is None and self.block_mask.dim() == 5:
            self.density = self.block_mask.float().mean(dim=(-1, -2))
        if self.density is not None:
            self.density = torch.as_tensor(self.density, dtype=torch.float32).cpu()
        if self.dense is None and self.block_mask.dim() == 5:
            self.dense = torch.zeros(self.block_mask.shape[:2], dtype=torch.bool)
        if self.dense is not None:
            self.dense = torch.as_tensor(self.dense).to(torch.bool).cpu()
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

    def achieved_density(self) -> float:
        """Mean fraction of active blocks over the layers and buckets PARO runs."""
        sparse = ~self.dense
        if not bool(sparse.any()):
            return 1.0
        return float(self.density[sparse].mean())

    def bucket_of(self, timestep: float) -> int:
        """Bucket index of a timestep on the 0..1000 scale."""
        return bucket_index(self.bucket_edges, timestep)

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
        if self.orders.dim() != 2:
            raise PlanError(f"plan orders must be [layers, heads], got shape {tuple(self.orders.shape)}")
        L, H = self.orders.shape
        if self.orders.numel() and (int(self.orders.min()) < 0 or int(self.orders.max()) >= len(ORDERS)):
            raise PlanError(
                f"plan orders must be in 0..{len(ORDERS) - 1} (indices into {ORDERS}); found "
                f"{int(self.orders.min())}..{int(self.orders.max())}: the file is corrupt, recalibrate"
            )
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
        actual = self.block_mask.float().mean(dim=(-1, -2))
        if not torch.allclose(self.density, actual, atol=1e-4):
            worst = float((self.density - actual).abs().max())
            raise PlanError(
                f"plan density disagrees with its masks by up to {worst:.4f}: density must be each mask's "
                "fraction of active blocks; the plan is corrupt, recalibrate"
            )

    # -- IO ----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        meta = {
            "format_version": self.format_version,
            "model_class": self.model_class,
            "model_fingerprint": self.model_fingerprint,
            "layout": [self.layout.prefix, self.layout.frames, self.layout.height, self.layout.width],
            "block_size": list(self.block_size),
            "block_mask_shape": list(self.block_mask.shape),
            "bucket_edges": self.bucket_edges,
            "qk": self.qk,
            "pv": self.pv,
            "target_density": self.target_density,
            "prompts": self.prompts,
            "info": self.info,
        }
        tensors = {
            "orders": self.orders.contiguous(),
            "block_mask_bits": pack_bits(self.block_mask),
            "density": self.density.contiguous(),
            "dense": self.dense.to(torch.uint8).contiguous(),
        }
        save_file(tensors, os.fspath(path), metadata={METADATA_KEY: json.dumps(meta)})

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        from safetensors import safe_open

        path = Path(path)
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
            missing = {"orders", "block_mask_bits", "density", "dense"} - tensors.keys()
            if missing:
                raise PlanError(f"{path} lacks the tensors {sorted(missing)}: the plan is corrupt, recalibrate")
            shape = tuple(int(s) for s in meta["block_mask_shape"])
            if tensors["block_mask_bits"].numel() != -(-math.prod(shape) // 8):
                raise PlanError(
                    f"{path}: packed block mask holds {tensors['block_mask_bits'].numel()} bytes, expected "
                    f"{-(-math.prod(shape) // 8)} for shape {list(shape)}: the plan is corrupt, recalibrate"
                )
            return cls(
                model_class=str(meta["model_class"]),
                model_fingerprint=str(meta["model_fingerprint"]),
                layout=TokenLayout(*(int(x) for x in meta["layout"])),
                block_size=tuple(meta["block_size"]),
                orders=tensors["orders"],
                block_mask=unpack_bits(tensors["block_mask_bits"], shape),
                bucket_edges=meta["bucket_edges"],
                qk=meta["qk"],
                pv=meta["pv"],
                target_density=float(meta["target_density"]),
                density=tensors["density"],
                dense=tensors["dense"].bool(),
                prompts=list(meta.get("prompts", [])),
                info=dict(meta.get("info", {})),
                format_version=version,
            )
        except PlanError as exc:
            if str(path) in str(exc):
                raise
            raise PlanError(f"{path}: {exc}") from None
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise PlanError(f"{path}: plan metadata is malformed ({exc!r}): the plan is corrupt, recalibrate") from None

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
    ) -> Plan:
        """A plan of the right shapes without calibration: identity ("FHW"), named, random
        ("random") or given orders, and masks of a band around the diagonal plus random blocks at
        `density`. For tests, benchmarks and the dense-equivalence check (density=1.0)."""
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
        )
