"""PARO under diffusers' context parallelism with Ulysses: each GPU runs its own heads over the whole sequence.

`transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))` (diffusers 0.36+) splits the
sequence into N equal contiguous chunks at the model's entry (per diffusers' `_cp_plan`), gathers the output at
its exit, and sets `_parallel_config` on every attention processor. The model's own processors hand it to
`dispatch_attention_fn`, whose templated Ulysses attention exchanges q, k, v all-to-all from [B, S/N, H, D] to
[B, S, H/N, D] (GPU r keeps heads r*H/N .. (r+1)*H/N - 1), runs the backend, and exchanges the output back.

PARO does the same exchange around `paro_attention` itself (`UlyssesShard.gather_heads` / `scatter_heads`)
rather than through the dispatcher, because:
- the dispatcher's backends are a closed enum, and its op callback sees neither the layer, the bucket, nor the
  token layout that pick the orders and masks;
- the exchange concatenates the chunks rank by rank. For Wan (video tokens only, split at the first block) that
  is the model's own order; Flux splits its text and image tokens separately, so GPU r holds
  [text_r ; image_r] and the concatenation is [text_0 ; image_0 ; text_1 ; image_1 ; ...]. Dense attention does
  not care (queries and keys are permuted alike); PARO's per-head orders and block masks are defined on
  [text ; image grid], so `gather_heads` puts the tokens back in that order (and `scatter_heads` the output
  back in the GPUs' order) in the copy the exchange makes anyway;
- the op's rotary tables are split with the sequence as well: they are gathered once per forward.
Each GPU runs `plan.head_slice` of its heads, made once when the config arrives, so the masks on each GPU
take at most 1/N of the plan's memory. Checked eagerly: tiny Wan, FLUX.1, FLUX.2, Qwen-Image, LTX-Video, LTX-2 and a Wan
2.2 expert pair on CPU with gloo
(tests/test_context_parallel.py), Wan2.1-14B and 1.3B on two GPUs with NCCL (benchmarks/multi_gpu.py --check);
under `torch.compile(fullgraph=True)` on CPU (after an eager forward, with dynamo skipping diffusers' hook logging:
README), not on GPUs.

Ring attention (`ring_degree > 1`) splits every head's sequence across GPUs, so no GPU sees the whole grid a
head's reordering and block mask are defined on: refused. So are head counts that N does not divide and
models without a context-parallel plan in diffusers (CogVideoX, whose attention calls SDPA directly).

How each supported family's sequence is split, read from diffusers 0.42.1's `_cp_plan`s: Wan splits the video
tokens at `blocks.0` and LTX-Video and LTX-2 theirs at the entry (no text in video self-attention; their RoPE,
applied before the exchange, is split alike); FLUX.1 and FLUX.2 split `hidden_states` (image) and
`encoder_hidden_states` (text) separately at the transformer's entry, Qwen-Image at `transformer_blocks.0`
(with its RoPE frequencies of each stream split alike at `pos_embed`), and each concatenates [text ; image] per
GPU. All are "the text prefix and the grid, each in N equal chunks" (Wan's prefix is empty). SkyReels-V2, Wan
VACE and HunyuanVideo (1 and 1.5) have no plan in diffusers and are refused.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..layout import TokenLayout
from ..plan import Plan

# families whose sequence diffusers splits as described above (the transformer must also have a `_cp_plan`)
SPLIT_FAMILIES = ("wan", "flux", "flux2", "qwen_image", "ltx", "ltx2")


def context_parallel_config(parallel_config):
    """The `ContextParallelConfig` inside what diffusers sets as a processor's `_parallel_config`, or None."""
    return getattr(parallel_config, "context_parallel_config", None)


def ulysses_problem(heads: int, degree: int, ring: int = 1) -> str | None:
    """Why PARO cannot run a plan of `heads` heads per layer under context parallelism of `degree` Ulysses and
    `ring` ring GPUs, or None."""
    if ring > 1:
        return (
            f"PARO runs under diffusers' Ulysses context parallelism only; this config has ring_degree={ring}, which "
            "splits each head's sequence across GPUs, so no GPU sees the whole token grid the plan's per-head orders "
            f"and block masks are defined on: use ContextParallelConfig(ulysses_degree={ring * degree}) instead"
        )
    if heads % degree:
        divisors = [n for n in range(2, heads + 1) if heads % n == 0]
        return (
            f"Ulysses splits the heads evenly across GPUs: the plan's {heads} heads per layer are not divisible by "
            f"ulysses_degree={degree}: use a ulysses_degree that divides {heads} ({', '.join(map(str, divisors))})"
        )
    return None


def model_problem(transformer, family_name: str) -> str | None:
    """Why diffusers' context parallelism cannot hold PARO on this transformer, or None."""
    name = type(transformer).__name__
    if family_name not in SPLIT_FAMILIES or getattr(type(transformer), "_cp_plan", None) is None:
        return (
            f"{name} has no context-parallel plan in diffusers (its attention does not go through "
            "dispatch_attention_fn), so PARO cannot run with enable_parallelism on it: run one pipeline per GPU "
            "(context parallelism with PARO supports Wan, FLUX.1, FLUX.2, Qwen-Image, LTX-Video and LTX-2)"
        )
    return None


def sequence_problem(layout: TokenLayout, degree: int) -> str | None:
    """Why the sequence of `layout` cannot be split in `degree` equal chunks of text and of grid, or None. The
    same on every GPU (it reads only the layout), so every GPU raises it before any exchange."""
    if layout.prefix % degree or layout.grid_tokens % degree:
        return (
            f"Ulysses splits the {layout.prefix} text tokens and the {layout.grid_tokens} grid tokens of {layout} each "
            f"in {degree} equal chunks; they are not divisible by ulysses_degree={degree}: pick a size (or text "
            f"length) whose token counts {degree} divides, or another ulysses_degree"
        )
    return None


class UlyssesShard:
    """One GPU's share of the heads under Ulysses: its rank and group, its slice of the plan, and the all-to-all
    exchanges between the GPUs' sequence chunks and its heads over the whole sequence."""

    def __init__(self, cp_config, plan: Plan):
        mesh = cp_config._ulysses_mesh
        if mesh is None:
            raise RuntimeError(
                "this ContextParallelConfig has not been set up: pass it to transformer.enable_parallelism(config=...) "
                "instead of setting a processor's _parallel_config by hand"
            )
        self.degree = int(cp_config.ulysses_degree)
        self.rank = int(cp_config._ulysses_local_rank)
        self.group = mesh.get_group()
        heads = plan.num_heads // self.degree
        self.heads = (self.rank * heads, (self.rank + 1) * heads)
        self.plan = plan.head_slice(*self.heads)
        self._rotary_source: tuple | None = None  # the local tables last gathered (held: `is` cannot match a new one)
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None

    def local_problem(self, layout: TokenLayout, tokens: int, text_tokens: int | None) -> str | None:
        """Why a call's local chunk is not this GPU's 1/degree of `layout`, or None."""
        if problem := sequence_problem(layout, self.degree):
            return problem
        if tokens * self.degree != layout.seq_len or (
                text_tokens is not None and text_tokens * self.degree != layout.prefix):
            return (
                f"under Ulysses {self.degree} each GPU should hold {layout.seq_len // self.degree} of the "
                f"{layout.seq_len} tokens of {layout} ({layout.prefix // self.degree} text); this call has {tokens} "
                f"({text_tokens} text): the model's sequence is not split the way diffusers' context-parallel plan "
                "for this family splits it (a custom cp_plan?)"
            )
        return None

    # -- the exchanges ------------------------------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor) -> torch.Tensor:
        """All-to-all over dim 0 of `send` [degree, ...]: chunk i goes to GPU i; chunk j of the result came from j."""
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        return received

    def gather_heads(self, x: torch.Tensor, text_tokens: int) -> torch.Tensor:
        """[B, H, S/N, D] of this GPU's sequence chunk -> [B, H/N, S, D] of its heads over the whole sequence in
        [text ; grid] order. `text_tokens`: the whole sequence's text prefix."""
        batch, heads, local, dim = x.shape
        n = self.degree
        send = x.unflatten(1, (n, heads // n)).transpose(0, 1).contiguous()  # [N, B, H/N, S/N, D]
        received = self._exchange(send)  # [N (the GPU whose chunk it is), B, H/N, S/N, D]
        out = x.new_empty(batch, heads // n, local * n, dim)
        text = text_tokens // n
        for start, stop in ((0, text), (text, local)):  # each GPU's text chunk, then each one's grid chunk
            if stop > start:
                out[:, :, start * n:stop * n].unflatten(2, (n, stop - start)).copy_(
                    received[:, :, :, start:stop].permute(1, 2, 0, 3, 4))
        return out

    def scatter_heads(self, out: torch.Tensor, text_tokens: int) -> torch.Tensor:
        """The inverse of `gather_heads`: [B, H/N, S, D] of this GPU's heads -> [B, H, S/N, D] of its sequence
        chunk (a view of a [B, S/N, H, D] tensor, the layout the processors' output projections read)."""
        batch, local_heads, seq, dim = out.shape
        n = self.degree
        local = seq // n
        text = text_tokens // n
        send = out.new_empty(n, batch, local_heads, local, dim)
        for start, stop in ((0, text), (text, local)):
            if stop > start:
                send[:, :, :, start:stop].copy_(
                    out[:, :, start * n:stop * n].unflatten(2, (n, stop - start)).permute(2, 0, 1, 3, 4))
        received = self._exchange(send)  # [N (the GPU whose heads they are), B, H/N, S/N, D]
        result = out.new_empty(batch, local, n, local_heads, dim)
        result.copy_(received.permute(1, 3, 0, 2, 4))
        return result.view(batch, local, n * local_heads, dim).transpose(1, 2)

    def gather_rotary(self, tables: tuple[torch.Tensor, torch.Tensor], text_tokens: int):
        """The op's rotary tables [S/N, D] of this GPU's chunk -> [S, D] of the whole sequence in [text ; grid]
        order; gathered once per forward (every layer gets the same tables)."""
        if not torch.compiler.is_compiling() and self._rotary_source is not None and all(
                a is b for a, b in zip(tables, self._rotary_source)):
            return self._rotary
        gathered = []
        for table in tables:
            local, dim = table.shape
            parts = torch.empty(self.degree * local, dim, dtype=table.dtype, device=table.device)
            dist.all_gather_into_tensor(parts, table.contiguous(), group=self.group)
            # [N, S/N, D] -> [text of each GPU ; grid of each GPU], as gather_heads orders the tokens
            gathered.append(self._canonical(parts.view(self.degree, local, dim), text_tokens // self.degree))
        self._rotary_source, self._rotary = tables, tuple(gathered)
        return self._rotary

    @staticmethod
    def _canonical(chunks: torch.Tensor, text: int) -> torch.Tensor:
        """[N, S/N, ...] chunks of [text_r ; grid_r] -> [S, ...] in [text_0 .. text_N-1 ; grid_0 .. grid_N-1]."""
        return torch.cat([chunks[:, :text].flatten(0, 1), chunks[:, text:].flatten(0, 1)])


# -- one process per GPU (`paro generate --ulysses N` under torchrun) ------------------------------------------------


def join_process_group(degree: int, device: str | None = None) -> tuple[int, str]:
    """Join the process group of the `degree` processes torchrun started (one per GPU; gloo on CPU) unless this
    process is in one already. Returns (rank, this process's device: cuda:LOCAL_RANK, or cpu)."""
    if dist.is_initialized():
        world = dist.get_world_size()
        found = f"in a process group of {world}"
    else:
        world = int(os.environ.get("WORLD_SIZE", "0")) if "RANK" in os.environ else 0
        found = f"one of WORLD_SIZE={world} started by torchrun" if world else "not started by torchrun (no RANK)"
    if world != degree:
        raise ValueError(
            f"--ulysses {degree} runs one process per GPU, {degree} in all; this process is {found}: launch "
            f"`torchrun --nproc-per-node {degree} --no-python paro generate ... --ulysses {degree}`"
        )
    if torch.accelerator.device_count() == 0:  # diffusers places each process on accelerator rank % count
        raise ValueError(f"--ulysses {degree} needs one GPU per process; this machine has none: leave --ulysses out")
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else os.environ["RANK"]))
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), f"cuda:{local_rank}" if cuda else "cpu"


def enable_ulysses(transformer, degree: int) -> None:
    """`transformer.enable_parallelism` with `ContextParallelConfig(ulysses_degree=degree)` over every process of the
    group, on a mesh of the transformer's device type (diffusers would build a CUDA one)."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(transformer.device.type, (1, degree), mesh_dim_names=("ring", "ulysses"))
    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, mesh=mesh))
