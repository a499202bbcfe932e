"""Active-block lists: the form of a block mask that kernels consume.

For each (head, query block) the count and the ascending indices of its active key blocks, so a
kernel loops only over active blocks and never tests every block. Built once per plan, bucket and
layer (not per call); small enough to keep in pinned CPU memory and copy ahead of use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def heaviest_first(counts: torch.Tensor) -> torch.Tensor:
    """int32 [H, nq]: each head's query blocks ordered by decreasing active count (ties: ascending
    block). Kernels launch a head's blocks in this order so long rows do not straggle at the end."""
    return torch.sort(counts, dim=-1, descending=True, stable=True).indices.to(torch.int32).contiguous()


@dataclass
class ActiveBlocks:
    counts: torch.Tensor  # int32 [H, nq]: active key blocks per query block
    indices: torch.Tensor  # int32 [H, nq, max_active]: active key block indices, ascending, padded with 0
    num_key_blocks: int
    schedule: torch.Tensor | None = None  # int32 [H, nq]: query blocks of each head, heaviest first (derived if None)

    def __post_init__(self):
        if self.schedule is None:
            self.schedule = heaviest_first(self.counts)
        # kernels rely on each list being ascending (only a list's last entry can be the sequence's
        # partial last key block); checked where it costs no device sync, i.e. for lists on the host,
        # which is where `from_mask` results and plans' lists are built, and not while torch.compile
        # traces (lists built there are views of checked ones, and reading values would break the graph)
        if self.indices.device.type == "cpu" and not torch.compiler.is_compiling():
            self.validate()

    def validate(self) -> None:
        """Raise PAROInputError unless every list holds distinct key blocks in ascending order."""
        from ..errors import PAROInputError

        H, nq, max_active = self.indices.shape
        nk = self.num_key_blocks
        if tuple(self.counts.shape) != (H, nq):
            raise PAROInputError(f"ActiveBlocks counts must be [H, nq] = [{H}, {nq}], got {tuple(self.counts.shape)}")
        if self.counts.numel() and (int(self.counts.min()) < 0 or int(self.counts.max()) > min(nk, max_active)):
            raise PAROInputError(f"ActiveBlocks counts must be in 0..{min(nk, max_active)}; build lists with from_mask")
        valid = torch.arange(max_active, device=self.indices.device) < self.counts[..., None]
        index = self.indices.long()
        if bool(((index < 0) | (index >= nk))[valid].any()):
            raise PAROInputError(f"ActiveBlocks indices must be key blocks in 0..{nk - 1}; build lists with from_mask")
        if max_active > 1 and bool((index[..., 1:] <= index[..., :-1])[valid[..., 1:]].any()):
            raise PAROInputError(
                "ActiveBlocks lists must be strictly ascending (the kernel masks the partial last key block and the "
                "padded suffix's key blocks only as a list's last entries); build lists with ActiveBlocks.from_mask"
            )

    @classmethod
    def from_mask(cls, block_mask: torch.Tensor, *, sync: bool = True) -> ActiveBlocks:
        """bool [H, nq, nk] -> lists, as wide as the longest one, padded with index 0 (never read: count
        bounds the loop).

        The width is read on the host: on a GPU that waits for the work queued before it. `sync=False`
        builds lists nk wide on the mask's device with nothing read back (what `paro_attention` does with
        a bool mask): the same counts, schedule and active entries, with the inactive blocks (ascending)
        as padding."""
        if block_mask.dtype != torch.bool or block_mask.dim() != 3:
            raise ValueError(f"block_mask must be bool [H, nq, nk], got {block_mask.dtype} {tuple(block_mask.shape)}")
        nk = block_mask.shape[-1]
        counts = block_mask.sum(dim=-1, dtype=torch.int32)
        if not sync:
            # a stable sort puts the active blocks first, each group in ascending key order
            order = torch.sort(block_mask.view(torch.int8), dim=-1, descending=True, stable=True).indices
            return cls(counts, order.to(torch.int32), nk)
        max_active = max(int(counts.max()) if counts.numel() else 0, 1)
        order = torch.sort((~block_mask).to(torch.int8), dim=-1, stable=True).indices[..., :max_active]
        valid = torch.arange(max_active, device=block_mask.device) < counts[..., None]
        indices = torch.where(valid, order, torch.zeros_like(order)).to(torch.int32)
        return cls(counts.contiguous(), indices.contiguous(), nk)

    def to_mask(self) -> torch.Tensor:
        H, nq, max_active = self.indices.shape
        mask = torch.zeros(H, nq, self.num_key_blocks, dtype=torch.bool, device=self.indices.device)
        valid = torch.arange(max_active, device=self.indices.device) < self.counts[..., None]
        mask.scatter_(-1, self.indices.long(), valid)
        # padding entries scatter False onto index 0; re-assert blocks that really are active there
        mask[..., 0] |= ((self.indices == 0) & valid).any(dim=-1)
        return mask

    @property
    def shape(self) -> tuple[int, int, int]:
        H, nq = self.counts.shape
        return H, nq, self.num_key_blocks

    @property
    def nbytes(self) -> int:
        return (self.counts.numel() + self.indices.numel() + self.schedule.numel()) * 4

    def to(self, device, non_blocking: bool = False) -> ActiveBlocks:
        return ActiveBlocks(
            self.counts.to(device, non_blocking=non_blocking),
            self.indices.to(device, non_blocking=non_blocking),
            self.num_key_blocks,
            self.schedule.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> ActiveBlocks:
        return ActiveBlocks(self.counts.pin_memory(), self.indices.pin_memory(), self.num_key_blocks,
                            self.schedule.pin_memory())


def head_range(mask, start: int, stop: int):
    """Heads `start`..`stop - 1` of a bool block mask [H, nq, nk] or of `ActiveBlocks`, as views (the mask itself when
    that is all of its heads)."""
    if start == 0 and stop == mask.shape[0]:
        return mask
    if isinstance(mask, ActiveBlocks):
        return ActiveBlocks(mask.counts[start:stop], mask.indices[start:stop], mask.num_key_blocks,
                            mask.schedule[start:stop])
    return mask[start:stop]
