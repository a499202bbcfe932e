"""Block masks and their geometry: block sizes, mask shapes, and helpers shared by plans, tests and
benchmarks."""

from __future__ import annotations

import torch


def block_sizes(block_size: int | tuple[int, int]) -> tuple[int, int]:
    """(bq, bk) from one size for both or a pair."""
    if isinstance(block_size, int):
        return block_size, block_size
    bq, bk = block_size
    return int(bq), int(bk)


def mask_shape(n: int, block_size: int | tuple[int, int]) -> tuple[int, int]:
    """(nq, nk): the number of query and key blocks of a sequence of n tokens."""
    bq, bk = block_sizes(block_size)
    return -(-n // bq), -(-n // bk)


def synthetic_block_mask(
    heads: int, nq: int, nk: int, density: float, *, band: float = 0.5, generator: torch.Generator | None = None
) -> torch.Tensor:
    """bool [heads, nq, nk] with realistic structure: the diagonal, a band around it holding about
    `band` of the active blocks, the rest scattered, with density varying per row and per head.
    Mean density is `density` to within one block per row; density >= 1 gives all True."""
    if density >= 1.0:
        return torch.ones(heads, nq, nk, dtype=torch.bool)
    rows = torch.arange(nq).view(nq, 1)
    cols = torch.arange(nk).view(1, nk)
    # key block position of each query block's diagonal (nq may differ from nk)
    diag = (rows * nk) // max(nq, 1)
    distance = (cols - diag).abs().float()
    noise = torch.rand(heads, nq, nk, generator=generator)
    # score: close to the diagonal ranks first for a `band` share, random elsewhere
    score = band * torch.exp(-distance / max(1.0, density * nk / 2)) + (1 - band) * noise
    # per-row and per-head density variation of +-50% around the target, renormalized
    row_scale = 0.5 + torch.rand(heads, nq, 1, generator=generator)
    row_scale = row_scale / row_scale.mean()
    keep = (density * nk * row_scale).round().clamp(1, nk).long()
    ranks = score.argsort(dim=-1, descending=True).argsort(dim=-1)
    mask = ranks < keep
    mask[:, rows.view(-1), diag.view(-1)] = True
    return mask


def dense_mask_from_blocks(block_mask: torch.Tensor, bq: int, bk: int, n: int) -> torch.Tensor:
    """bool [..., nq, nk] -> token-level [..., n, n]; for tests and small shapes only."""
    return block_mask.repeat_interleave(bq, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :n]
