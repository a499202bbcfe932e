"""Reading a plan's safetensors file within the file's own size, and its content checksum.

A plan file comes from anyone, so it is read here rather than by `safetensors.safe_open`: the header is
checked (dtypes, shapes, offsets inside the file, no two tensors sharing bytes) before anything is allocated,
and each tensor is then read into a buffer of exactly its declared size; what gets allocated is at most the
file's size. The checksum is a sha256 over the plan's metadata text and every tensor (name, dtype, shape,
bytes), written by `Plan.save` beside the metadata.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct

import torch

from ..errors import PlanError

# safetensors dtype names a plan file may use, and their torch dtypes
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
          "F64": torch.float64}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 64 << 20


class StoredTensor:
    """One tensor's entry in a safetensors header."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int):
        self.name, self.dtype_name, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]


def _unreadable(detail: str) -> PlanError:
    return PlanError(f"not a readable safetensors file ({detail}); it may be truncated or corrupt: copy it again "
                     "or recalibrate")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(f, file_size: int) -> tuple[dict[str, str], dict[str, StoredTensor], int]:
    """(metadata, tensors by name, offset of the data) of the safetensors file open as `f` (binary, at 0)."""
    if file_size < 8:
        raise _unreadable(f"{file_size} bytes, shorter than a header")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(file_size - 8, MAX_HEADER_BYTES):
        raise _unreadable(f"header of {length} bytes in a file of {file_size}")
    try:
        header = json.loads(f.read(length).decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise _unreadable(f"header is not JSON: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise _unreadable("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _unreadable("header metadata must map names to strings")
    data_start, data_size = 8 + length, file_size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _unreadable(f"tensor {name!r} has a malformed entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise _unreadable(f"tensor {name!r} has dtype {str(dtype)[:40]!r}; a plan's tensors are one of "
                              f"{sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape) or len(shape) > 8:
            raise _unreadable(f"tensor {name!r} has shape {str(shape)[:80]}, not a list of sizes >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(x) for x in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise _unreadable(f"tensor {name!r} has data offsets {str(offsets)[:80]} outside the file's {data_size} "
                              "bytes of data")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise _unreadable(f"tensor {name!r} of {dtype} {shape} needs {nbytes} bytes, its offsets span "
                              f"{offsets[1] - offsets[0]}")
        tensors[name] = StoredTensor(name, dtype, tuple(shape), offsets[0], offsets[1])
    spans = sorted((t.begin, t.end) for t in tensors.values() if t.end > t.begin)
    if any(b < a_end for (_, a_end), (b, _) in zip(spans, spans[1:])):
        raise _unreadable("two tensors share bytes")
    return metadata, tensors, data_start


def read_tensors(f, entries: list[StoredTensor], data_start: int) -> dict[str, torch.Tensor]:
    """Each tensor of `entries` read into a buffer of its size (the header checked that they fit the file)."""
    tensors = {}
    for entry in sorted(entries, key=lambda e: e.begin):
        size = entry.end - entry.begin
        if size == 0:
            tensors[entry.name] = torch.zeros(entry.shape, dtype=entry.dtype)
            continue
        buffer = bytearray(size)
        f.seek(data_start + entry.begin)
        if f.readinto(buffer) != size:
            raise _unreadable(f"tensor {entry.name!r} is cut short")
        tensors[entry.name] = torch.frombuffer(buffer, dtype=entry.dtype).view(entry.shape)
    return tensors


def checksum(metadata_text: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 hex digest of the plan's metadata text and its tensors (name, dtype, shape and bytes of each, in
    name order), as `Plan.save` writes and `Plan.load` checks it."""
    digest = hashlib.sha256()
    digest.update(b"paroattn plan\0")
    digest.update(metadata_text.encode("utf-8"))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(b"\0" + json.dumps([name, DTYPE_NAMES.get(t.dtype, str(t.dtype)), list(t.shape)]).encode())
        if t.numel():
            digest.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def file_size(f) -> int:
    return os.fstat(f.fileno()).st_size
