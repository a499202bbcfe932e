"""A plan's block masks, bool [buckets, layers, heads, nq, nk], held small.

A real model's masks are large unpacked (Wan2.1-14B at 720p: 40 layers x 40 heads x 591 x 1182 blocks, 1.1 GB
of bools per timestep bucket), so `BlockMasks` keeps them as they came:
- `full`: the bool tensor, for plans built in code (and after any whole-mask access, which unpacks);
- `bits`: one flat bit-packed uint8 tensor, as files of format versions 1 and 2 store them;
- `chunks`: one encoded chunk per (bucket, layer), as format version 3 stores them (`encode`).
`layer(bucket, layer)` unpacks one (bucket, layer) at a time, whatever the form; `full_tensor()` unpacks all.

A chunk is one method byte then its payload, the bit-packed [heads, nq, nk] mask of that (bucket, layer):
0 the packed bytes as they are, 1 deflated (zlib), 2 deflated after an exclusive-or with the same layer's
packed mask in the previous bucket (consecutive buckets of a calibrated plan share most blocks). Chunks with
the same bytes are stored once (the index points several (bucket, layer) at them).
"""

from __future__ import annotations

import hashlib
import math
import os
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..errors import PlanError

RAW, DEFLATED, DEFLATED_XOR_PREVIOUS = 0, 1, 2
CHUNK_METHODS = (RAW, DEFLATED, DEFLATED_XOR_PREVIOUS)
# level 1: a calibrated plan's masks deflate 3.5x faster than at the default level 6, to chunks 4% larger (a plan
# is written at the end of the generation that learnt it, while the user waits)
DEFLATE_LEVEL = 1
# chunks deflated at once, each in a thread (zlib lets go of the GIL); packed masks queued at most twice as many
ENCODE_THREADS = min(8, os.cpu_count() or 1)
# deflate cannot expand a stream more than about 1032 times: a chunk claiming more is not a deflate stream
DEFLATE_MAX_RATIO = 1032
DEFLATE_SLACK = 64  # zlib header and the last partial block
INFLATE_PIECE = 1 << 16  # bytes of a chunk inflated at once (and of its stream fed at once)
# bits of mask unpacked at once while computing statistics: bounds the transient memory of a scan
SCAN_BITS = 1 << 20
# bounds on what a file may declare, far above real models (Wan2.1-14B at 720p: 698,562 blocks per head, 3.5 MB
# per (bucket, layer) packed): a scan unpacks a head at least, and inflates a (bucket, layer) whole
MAX_BLOCKS_PER_HEAD = 1 << 26
MAX_CHUNK_BYTES = 1 << 28



def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool tensor -> uint8 [ceil(numel/8)], little-endian bit order within a byte."""
    return torch.from_numpy(np.packbits(mask.reshape(-1).to(torch.bool).cpu().numpy(), bitorder="little"))


def _unpacked(packed: np.ndarray, start: int, count: int) -> np.ndarray:
    """bool [count] (numpy): bits `start..start+count-1` of bit-packed `packed` (little-endian within a byte)."""
    first, last = start // 8, -(-(start + count) // 8)
    offset = start - 8 * first
    return np.unpackbits(packed[first:last], bitorder="little")[offset:offset + count].view(np.bool_)


def unpack_bit_range(packed: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """bool [count]: bits `start..start+count-1` of bit-packed `packed` (uint8, little-endian within a byte)."""
    return torch.from_numpy(_unpacked(packed.numpy(), start, count))


def unpack_bits(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The inverse of `pack_bits`: bool tensor of `shape`."""
    return unpack_bit_range(packed.reshape(-1), 0, math.prod(shape)).reshape(shape)


def _packed_bytes(mask: torch.Tensor) -> bytes:
    return pack_bits(mask).numpy().tobytes()


def _xor(a: bytes, b: bytes) -> bytes:
    return np.bitwise_xor(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)).tobytes()


def encode_chunk(packed: bytes, previous: bytes | None) -> bytes:
    """The smallest of the chunk encodings of one (bucket, layer)'s packed mask; `previous` is the same
    layer's packed mask in the previous bucket (None in bucket 0)."""
    best = bytes([RAW]) + packed
    candidates = [(DEFLATED, packed)]
    if previous is not None:
        candidates.append((DEFLATED_XOR_PREVIOUS, _xor(packed, previous)))
    for method, payload in candidates:
        encoded = bytes([method]) + zlib.compress(payload, DEFLATE_LEVEL)
        if len(encoded) < len(best):
            best = encoded
    return best


class BlockMasks:
    """bool [buckets, layers, heads, nq, nk] held as a tensor, flat packed bits or encoded chunks (module doc).
    Build with `BlockMasks.of(tensor)`, `from_bits`, `from_chunks` or `from_layers`."""

    def __init__(self, shape, *, full=None, bits=None, chunks=None, index=None, heads=None):
        self._shape = tuple(int(s) for s in shape)  # as stored: all heads
        self._full, self._bits, self._chunks, self._index = full, bits, chunks, index
        self._heads = heads  # (start, stop): a head slice of the stored masks, or None for all
        self._last = None  # (bucket, layer, packed array) of the last chunk decoded: decoding walks buckets
        # active blocks per (bucket, layer, head) and the most of any query block, set by the plan's validation
        # of a packed form (which does not change afterwards): later checks trust them instead of scanning again
        self.counts: torch.Tensor | None = None
        self.most_per_row = 0

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def of(cls, mask: torch.Tensor) -> BlockMasks:
        return cls(mask.shape, full=mask)

    @classmethod
    def from_bits(cls, bits: torch.Tensor, shape) -> BlockMasks:
        """Flat packed bits of the whole [buckets, layers, heads, nq, nk] mask (format versions 1 and 2)."""
        _check_declared(shape)
        expected = -(-math.prod(shape) // 8)
        if bits.dim() != 1 or bits.numel() != expected:
            raise PlanError(f"packed block mask holds {bits.numel()} bytes, expected {expected} for shape "
                            f"{list(shape)}: the plan is corrupt, recalibrate")
        return cls(shape, bits=bits)

    @classmethod
    def from_chunks(cls, chunks: torch.Tensor, index: torch.Tensor, shape) -> BlockMasks:
        """Encoded chunks (uint8, one dimension) and their index (int64 [buckets * layers, 2]: offset and
        length of each (bucket, layer)'s chunk, bucket-major). Checks, before anything is decoded, that
        each chunk lies within `chunks`, has a known method and can hold the mask it stands for."""
        _check_declared(shape)
        buckets, layers = shape[0], shape[1]
        if tuple(index.shape) != (buckets * layers, 2):
            raise PlanError(f"plan tensor 'block_mask_index' must be [buckets * layers, 2] = "
                            f"{[buckets * layers, 2]}; found {list(index.shape)}: the plan is corrupt, recalibrate")
        size = chunks.numel()
        packed = -(-math.prod(shape[2:]) // 8)
        offsets, lengths = index[:, 0], index[:, 1]
        if bool(((offsets < 0) | (lengths < 1) | (offsets > size - lengths)).any()):
            raise PlanError(f"plan tensor 'block_mask_index' points outside the {size} bytes of 'block_mask_chunks': "
                            "the plan is corrupt, recalibrate")
        methods = chunks[offsets].long() if len(offsets) else offsets
        if bool((methods >= len(CHUNK_METHODS)).any()):
            raise PlanError(f"plan tensor 'block_mask_chunks' holds a chunk of unknown method (known: "
                            f"{list(CHUNK_METHODS)}): the plan is corrupt, or newer than this paroattn reads")
        if buckets and bool((methods[:layers] == DEFLATED_XOR_PREVIOUS).any()):
            raise PlanError("plan tensor 'block_mask_chunks' holds a bucket-0 chunk relative to a previous bucket: "
                            "the plan is corrupt, recalibrate")
        payload = lengths - 1
        raw_wrong = (methods == RAW) & (payload != packed)
        too_small = (methods != RAW) & (payload * DEFLATE_MAX_RATIO + DEFLATE_SLACK < packed)
        if bool((raw_wrong | too_small).any()):
            raise PlanError(
                f"plan block mask chunks are too small for the declared mask shape {list(shape)} ({packed} packed "
                "bytes per (bucket, layer)): the plan's sizes disagree with its file; the plan is corrupt, recalibrate")
        return cls(shape, chunks=chunks, index=index)

    @classmethod
    def from_layers(cls, shape, layer_mask) -> BlockMasks:
        """Masks encoded one (bucket, layer) at a time: `layer_mask(bucket, layer)` -> bool [heads, nq, nk].
        For plans too large to hold unpacked (benchmarks of real model sizes)."""
        def checked(b, layer):
            mask = layer_mask(b, layer)
            if tuple(mask.shape) != tuple(shape[2:]) or mask.dtype != torch.bool:
                raise PlanError(f"mask of bucket {b}, layer {layer} must be bool {list(shape[2:])}; found "
                                f"{mask.dtype} {list(mask.shape)}")
            return mask

        chunks, index = _encode_layers(shape[0], shape[1], checked)
        return cls(shape, chunks=chunks, index=index)

    # -- reading ---------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        if self._full is not None:
            return tuple(self._full.shape)
        b, layers, h, nq, nk = self._shape
        if self._heads is not None:
            h = self._heads[1] - self._heads[0]
        return b, layers, h, nq, nk

    @property
    def form(self) -> str:
        """"full", "bits" or "chunks"."""
        return "full" if self._full is not None else "bits" if self._bits is not None else "chunks"

    def _chunk(self, bucket: int, layer: int) -> memoryview:
        """The encoded chunk of (bucket, layer): method byte, then payload (a view, no copy)."""
        offset, length = (int(x) for x in self._index[bucket * self._shape[1] + layer])
        return memoryview(self._chunks.numpy())[offset:offset + length]

    def _decoded(self, bucket: int, layer: int, previous: np.ndarray | None) -> np.ndarray:
        """Packed bytes of (bucket, layer)'s stored mask, all heads, as a read-only array: a view of a raw chunk,
        else inflated into an array of its own; `previous` is the same layer's packed mask in the previous
        bucket, read for a chunk relative to it."""
        _, _, h, nq, nk = self._shape
        chunk = self._chunk(bucket, layer)
        if chunk[0] == RAW:
            packed = np.frombuffer(chunk[1:], dtype=np.uint8)
        else:
            packed = np.empty(-(-h * nq * nk // 8), dtype=np.uint8)
            try:
                whole = _inflate_into(packed, chunk[1:])
            except zlib.error as exc:
                raise PlanError(f"plan block mask chunk of bucket {bucket}, layer {layer} does not inflate ({exc}): "
                                "the plan is corrupt, recalibrate") from None
            if not whole:
                raise PlanError(f"plan block mask chunk of bucket {bucket}, layer {layer} does not inflate to "
                                f"{len(packed)} bytes: the plan is corrupt, recalibrate")
            if chunk[0] == DEFLATED_XOR_PREVIOUS:
                np.bitwise_xor(packed, previous, out=packed)
        packed.flags.writeable = False  # shared by readers of the cache, and a view of the file's chunks when raw
        return packed

    def _packed(self, bucket: int, layer: int) -> np.ndarray:
        """Packed bytes of (bucket, layer)'s stored mask, all heads (read-only). A chunk relative to the previous
        bucket is decoded forward from the nearest one that is not (or from the last decoded, when that is the
        previous bucket of the layer), holding two decoded chunks at a time."""
        last = self._last  # one read: another thread may replace it
        if last is not None and last[:2] == (bucket, layer):
            return last[2]
        first = bucket  # walk back to where decoding can start
        while self._chunk(first, layer)[0] == DEFLATED_XOR_PREVIOUS:
            if last is not None and last[:2] == (first - 1, layer):
                break
            first -= 1  # from_chunks made sure bucket 0 stands alone
        packed = last[2] if self._chunk(first, layer)[0] == DEFLATED_XOR_PREVIOUS else None
        # the cache lets go before anything is decoded (the walk holds what it starts from): a decoded (bucket,
        # layer) of Wan2.1-14B at 720p is 3.5 MB, and a walk holds two
        last = self._last = None
        for b in range(first, bucket + 1):
            packed = self._decoded(b, layer, packed)
        self._last = (bucket, layer, packed)
        return packed

    def heads(self, bucket: int, layer: int, start: int, stop: int) -> torch.Tensor:
        """bool [stop - start, nq, nk]: heads start..stop-1 (of this view) of one (bucket, layer); unpacked
        from packed forms, a view of the tensor of the full form."""
        if self._full is not None:
            return self._full[bucket, layer, start:stop]
        return torch.from_numpy(self._heads_array(bucket, layer, start, stop))

    def _heads_array(self, bucket: int, layer: int, start: int, stop: int) -> np.ndarray:
        """`heads` as a numpy array (a view of the tensor of the full form)."""
        if self._full is not None:
            return self._full[bucket, layer, start:stop].numpy()
        _, layers, h, nq, nk = self._shape
        first = start + (self._heads[0] if self._heads is not None else 0)
        per_head = nq * nk
        count = (stop - start) * per_head
        if self._bits is not None:
            at = ((bucket * layers + layer) * h + first) * per_head
            bits = _unpacked(self._bits.numpy(), at, count)
        else:
            bits = _unpacked(self._packed(bucket, layer), first * per_head, count)
        return bits.reshape(stop - start, nq, nk)

    def layer(self, bucket: int, layer: int) -> torch.Tensor:
        """bool [heads, nq, nk] of one (bucket, layer) (a view of the tensor when the form is full: do not
        modify it unless you mean to change the plan)."""
        return self.heads(bucket, layer, 0, self.shape[2])

    def full_tensor(self) -> torch.Tensor:
        """The whole bool [buckets, layers, heads, nq, nk] tensor, full size (8x the packed bits). The store
        keeps it and drops its packed form: in-place edits of the tensor are edits of the masks."""
        if self._full is None:
            b, layers = self.shape[:2]
            full = torch.empty(self.shape, dtype=torch.bool)
            for bucket in range(b):
                for layer in range(layers):
                    full[bucket, layer] = self.layer(bucket, layer)
            self._full, self._bits, self._chunks, self._index, self._heads, self._last = full, None, None, None, None, None
            self.counts = None  # the caller may now edit the tensor
        return self._full

    def head_slice(self, start: int, stop: int) -> BlockMasks:
        if self._full is not None:
            return BlockMasks.of(self._full[:, :, start:stop])
        offset = self._heads[0] if self._heads is not None else 0
        part = BlockMasks(self._shape, bits=self._bits, chunks=self._chunks, index=self._index,
                          heads=(offset + start, offset + stop))
        if self.counts is not None:
            part.counts = self.counts[:, :, start:stop]
            part.most_per_row = self.most_per_row  # a bound for the slice: enough for sizing lists
        return part

    def scan(self, *, dense: torch.Tensor | None = None):
        """Per (bucket, layer) statistics, computed a slice of heads at a time (at most `SCAN_BITS` bits
        unpacked at once): yields (bucket, layer, first head, active blocks per query block [heads, nq] int64,
        diagonal block missing [heads, nq] bool, None unless nq == nk) for each slice. (bucket, layer) pairs
        with `dense[bucket, layer]` True are skipped."""
        b, layers, h, nq, nk = self.shape
        step = max(1, SCAN_BITS // max(1, nq * nk))
        for layer in range(layers):  # layer-major: a chunk relative to the previous bucket finds it decoded
            for bucket in range(b):
                if dense is not None and bool(dense[bucket, layer]):
                    continue
                for start in range(0, h, step):
                    yield bucket, layer, start, *self._slice_statistics(bucket, layer, start, min(h, start + step))
        self._last = None  # a scan reads every chunk once: keeping its last would only hold memory

    def _slice_statistics(self, bucket: int, layer: int, start: int, stop: int):
        """`scan`'s statistics of heads start..stop-1 of one (bucket, layer); their unpacked masks are freed on
        return, before the next slice is unpacked."""
        mask = self._heads_array(bucket, layer, start, stop)
        rows = np.count_nonzero(mask, axis=-1)  # active blocks per query block
        nq, nk = mask.shape[1:]
        diagonal = np.arange(nq)
        missing = torch.from_numpy(~mask[:, diagonal, diagonal]) if nq == nk else None
        return torch.from_numpy(rows), missing

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunks uint8 [n], index int64 [buckets * layers, 2]): the format version 3 storage."""
        if self._chunks is not None and self._heads is None:
            return self._chunks, self._index
        return _encode_layers(self.shape[0], self.shape[1], self.layer)

    def flat_bits(self) -> torch.Tensor:
        """The whole mask bit-packed in one flat tensor (format versions 1 and 2)."""
        if self._bits is not None and self._heads is None:
            return self._bits
        b, layers = self.shape[:2]
        if (math.prod(self.shape[2:])) % 8 == 0:  # byte-aligned layers: packed one at a time
            return torch.cat([pack_bits(self.layer(bucket, layer)) for bucket in range(b) for layer in range(layers)]
                             or [torch.zeros(0, dtype=torch.uint8)])
        return pack_bits(torch.stack([self.layer(bucket, layer) for bucket in range(b) for layer in range(layers)]))

    def stored_bytes(self) -> int:
        """Bytes this store holds in memory."""
        if self._full is not None:
            return self._full.numel()
        if self._bits is not None:
            return self._bits.numel()
        return self._chunks.numel() + self._index.numel() * 8


def _inflate_into(out: np.ndarray, stream: memoryview) -> bool:
    """Inflate the zlib `stream` into `out` (uint8), a piece at a time: whether it inflated to exactly `out`'s
    size and ended with the stream. Pieces, in and out, bound what zlib allocates beside `out` (whole, it would
    copy the output once more, and the unconsumed input on every call); a stream inflating beyond `out` is cut
    one byte past it."""
    inflater = zlib.decompressobj()
    filled, read = 0, 0
    pending = stream[:0]
    while not inflater.eof:
        if not pending and read < len(stream):
            pending = stream[read:read + INFLATE_PIECE]
            read += len(pending)
        piece = inflater.decompress(pending, min(INFLATE_PIECE, len(out) - filled + 1))
        if filled + len(piece) > len(out):
            return False
        out[filled:filled + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        filled += len(piece)
        tail = inflater.unconsumed_tail
        if not piece and len(tail) == len(pending):  # no progress: the input ended before the stream did
            return False
        pending = tail
    return filled == len(out) and read == len(stream) and not pending and not inflater.unused_data


def _check_declared(shape) -> None:
    """Refuse a declared mask shape beyond the bounds a scan's memory is sized for."""
    if len(shape) != 5:
        raise PlanError(f"plan block_mask_shape must be [buckets, layers, heads, nq, nk]; found {list(shape)}")
    per_head = shape[3] * shape[4]
    if per_head > MAX_BLOCKS_PER_HEAD or -(-shape[2] * per_head // 8) > MAX_CHUNK_BYTES:
        raise PlanError(f"plan block_mask_shape {list(shape)} declares masks of {per_head} blocks per head and "
                        f"{-(-shape[2] * per_head // 8)} packed bytes per (bucket, layer), beyond what paroattn reads "
                        f"({MAX_BLOCKS_PER_HEAD} and {MAX_CHUNK_BYTES}): the plan is corrupt, recalibrate")


def _encode_layers(buckets: int, layers: int, layer_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunks, index) of the masks `layer_mask(bucket, layer)`, bucket-major. A (bucket, layer) whose mask and
    previous-bucket mask were seen together before reuses that encoding (deflate is the slow part)."""
    previous: list[tuple[bytes, bytes] | None] = [None] * layers  # (packed, digest) of each layer's last bucket
    seen: dict[tuple[bytes, bytes | None], Future] = {}  # -> its encoding, deflated in a thread
    keys, pending = [], deque()
    with ThreadPoolExecutor(ENCODE_THREADS) as pool:
        for bucket in range(buckets):
            for layer in range(layers):
                packed = _packed_bytes(layer_mask(bucket, layer))
                digest = hashlib.sha256(packed).digest()
                before = previous[layer]
                key = (digest, None if before is None else before[1])
                if key not in seen:
                    while len(pending) >= 2 * ENCODE_THREADS:  # bounds the packed masks held at once
                        pending.popleft().result()
                    seen[key] = pool.submit(encode_chunk, packed, None if before is None else before[0])
                    pending.append(seen[key])
                keys.append(key)
                previous[layer] = (packed, digest)
        encoded = [seen[key].result() for key in keys]
    return _concatenate(encoded)


def _concatenate(encoded: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor of the distinct chunks, and each chunk's (offset, length) in it."""
    at: dict[bytes, int] = {}
    parts, index, size = [], [], 0
    for chunk in encoded:
        if chunk not in at:
            at[chunk] = size
            parts.append(chunk)
            size += len(chunk)
        index.append((at[chunk], len(chunk)))
    data = b"".join(parts)
    chunks = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    return chunks, torch.tensor(index, dtype=torch.int64).view(-1, 2)
