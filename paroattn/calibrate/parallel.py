"""Learning a plan under diffusers' Ulysses context parallelism: the processes of one Ulysses group, and what
they exchange besides the attention.

Each process records the statistics of its own slice of the heads over the whole sequence
(`capture_attention(..., context_parallel=True)`: the exchange Ulysses makes for the attention anyway), so
the capture costs each GPU its share of the heads, as on one GPU it costs all of them. `gather_heads` joins
the slices, in rank order, on the group's first process, one statistic at a time (each is moved to the
group's device for the collective: NCCL gathers GPU tensors only), which then holds what one process
recording every head would hold. The others decide nothing alone: `broadcast` and `first_failed` make every
process of the group take the same branch, since a process that took another would wait forever in the
next collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import PlanError
from ..pipelines.context_parallel import context_parallel_config, model_problem, ulysses_problem
from ..pipelines.registry import require_family
from .recorder import CapturedStats


@dataclass(frozen=True)
class UlyssesGroup:
    """The Ulysses group of one process: `group` (its process group), `rank` in it, `size`, and `device`, where
    the collectives' tensors live (the transformer's)."""

    group: object
    rank: int
    size: int
    device: torch.device

    @classmethod
    def of(cls, transformer) -> UlyssesGroup | None:
        """The group the transformer runs its Ulysses attention over (`enable_parallelism`); None: not under
        context parallelism. A config PARO cannot run under (ring attention, a head count the degree does not
        divide, a model without a context-parallel plan) raises PlanError, on every process alike."""
        cp_config = context_parallel_config(getattr(transformer, "_parallel_config", None))
        if cp_config is None:
            return None
        family = require_family(transformer)
        degree, ring = int(cp_config.ulysses_degree or 1), int(cp_config.ring_degree or 1)
        if problem := ulysses_problem(family.num_heads(transformer), degree, ring) or model_problem(transformer, family):
            raise PlanError(f"plan='auto' under context parallelism: {problem}")
        mesh = cp_config._ulysses_mesh
        if mesh is None:
            raise RuntimeError("this transformer's ContextParallelConfig has not been set up: pass it to "
                               "transformer.enable_parallelism(config=...)")
        device = next(transformer.parameters()).device
        return cls(mesh.get_group(), int(cp_config._ulysses_local_rank), int(cp_config.ulysses_degree), device)

    @property
    def first(self) -> bool:
        """Whether this is the group's first process (the one that builds and writes the plan)."""
        return self.rank == 0

    def broadcast(self, value: int) -> int:
        """The first process's `value`, on every process."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(tensor.item())

    def first_failed(self, flag: bool) -> int | None:
        """The lowest rank whose `flag` is False, or None where it holds on every process."""
        tensor = torch.tensor([self.size if flag else self.rank], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return None if int(tensor.item()) == self.size else int(tensor.item())

    def gather_heads(self, stats: CapturedStats) -> CapturedStats | None:
        """Every process's `stats` of its slice of the heads -> on the first process, the statistics of every
        head (its own `stats`, joined in place); None on the others. Every process must call it."""
        dst = dist.get_global_rank(self.group, 0)

        def join(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            local = tensor.to(self.device).contiguous()
            parts = [torch.empty_like(local) for _ in range(self.size)] if self.first else None
            dist.gather(local, parts, dst=dst, group=self.group)
            return torch.cat(parts, dim).to(tensor.device) if self.first else tensor

        # the sums of different processes are joined only if each counted the same calls in the same buckets
        counts = [join(acc.weight[None], 0) for acc in stats.accumulators.values()]
        join_heads(stats, join)
        if not self.first:
            return None
        for weights in counts:
            if not all(torch.equal(weights[0], other) for other in weights[1:]):
                raise RuntimeError("the processes of the Ulysses group captured different calls per bucket (statistics "
                                   f"counts {weights.tolist()}): every process must run the same pipeline call")
        return stats


def join_heads(stats: CapturedStats, join) -> None:
    """Replace each per-head statistic t of `stats` by `join(t, dim)`, dim its head dimension, in an order that is
    the same on every process (`StatsAccumulator.join_heads`)."""
    for accumulator in stats.accumulators.values():
        accumulator.join_heads(join)
    if stats.profiles is not None:
        stats.profiles.join_heads(join)
