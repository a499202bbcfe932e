"""PARO under diffusers' context parallelism with Ulysses: each GPU runs its own heads over the whole sequence.

`transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N), cp_plan=...)` (diffusers 0.36+)
splits the sequence into N contiguous chunks where a context-parallel plan says (`_cp_plan`: a model's own, or the
one `context_parallel_plan` gives), gathers the output at the model's exit, and sets `_parallel_config` on every
attention processor. The model's own processors hand it to `dispatch_attention_fn`, whose templated Ulysses attention
exchanges q, k, v all-to-all from [B, S/N, H, D] to [B, S, H/N, D] (GPU r keeps heads r*H/N .. (r+1)*H/N - 1), runs
the backend, and exchanges the output back.

PARO does the same exchange around `paro_attention` itself (`UlyssesShard.attend`) rather than through the
dispatcher, because:
- the dispatcher's backends are a closed enum, and its op callback sees neither the layer, the bucket, nor the
  token layout that pick the orders and masks;
- the exchange concatenates the chunks rank by rank. For Wan (video tokens only, split at the first block) that
  is the model's own order; Flux splits its text and image tokens separately, so GPU r holds
  [text_r ; image_r] and the concatenation is [text_0 ; image_0 ; text_1 ; image_1 ; ...]. Dense attention does
  not care (queries and keys are permuted alike); PARO's per-head orders and block masks are defined on
  [text ; image grid], so the exchange puts the tokens back in that order (and the output back in the GPUs'
  order) in the copy it makes anyway;
- it overlaps the exchange with attention: a GPU's heads go in groups, and group g's attention runs while the
  other groups' all-to-alls are in flight (q, k and v of a group in one all-to-all);
- the op's rotary tables are split with the sequence as well: they are gathered once per forward.
Each GPU runs `plan.head_slice` of its heads, made once when the config arrives, so the masks on each GPU
take at most 1/N of the plan's memory. The capture of `plan="auto"` makes the same exchange, so each GPU records
its own heads (`CaptureProcessor`).

Families diffusers 0.42.1 has no plan for get one from their adapter (`FamilyAdapter.context_parallel_plan`), in
diffusers' own plan format, passed to `enable_parallelism(cp_plan=...)`:
- SkyReels-V2 and Wan VACE: Wan's plan (video split at the first block, RoPE split with it), VACE's control tokens
  split alike at the first VACE block (they are padded to the video's token count and laid out on its grid);
  SkyReels-V2's per-frame timesteps of diffusion forcing split with their frames;
- CogVideoX (text before the video) and HunyuanVideo 1 and 1.5 (text after it, padded, with a mask): the video
  split at the first block, the text not split: every GPU holds the whole text and runs its projections and
  feed-forward (a few hundred tokens beside tens of thousands of video tokens). Their text lengths (226; 1985)
  would not split evenly, and the text masks stay whole. CogVideoX's processor calls SDPA directly and
  HunyuanVideo's dispatcher exchange would duplicate the text, so for these families PARO does the exchange for
  the model's own attention too (dense layers, `on_mismatch="dense"`): the model's attention call on the gathered
  heads, then the same scatter. The text output of each GPU's heads goes to every GPU in the scatter's all-to-all.
diffusers splits a run evenly (N must divide its token count) or, with `ContextParallelConfig(ulysses_anything=
True)`, in `torch.tensor_split`'s chunks (the first ones a token longer); PARO's exchange follows either.

Checked eagerly: tiny Wan, FLUX.1, FLUX.2, Qwen-Image, LTX-Video, LTX-2, CogVideoX, HunyuanVideo 1 and 1.5, SkyReels-V2,
Wan VACE and a Wan 2.2 expert pair on CPU with gloo (tests/test_context_parallel.py), Wan2.1-14B and 1.3B on two GPUs
with NCCL (benchmarks/multi_gpu.py --check); under `torch.compile(fullgraph=True)` on CPU (after an eager forward,
with dynamo skipping diffusers' hook logging: README), not on GPUs.

Ring attention (`ring_degree > 1`) splits every head's sequence across GPUs, so no GPU sees the whole grid a
head's reordering and block mask are defined on: refused. So are head counts that N does not divide and
transformers for which no plan is known, or whose plan does not hold (`FamilyAdapter.ulysses_problem`).

How the families with diffusers' plans split, read from diffusers 0.42.1's `_cp_plan`s: Wan splits the video tokens
at `blocks.0` and LTX-Video and LTX-2 theirs at the entry (no text in video self-attention; their RoPE, applied
before the exchange, is split alike); FLUX.1 and FLUX.2 split `hidden_states` (image) and `encoder_hidden_states`
(text) separately at the transformer's entry, Qwen-Image at `transformer_blocks.0` (with its RoPE frequencies of each
stream split alike at `pos_embed`), and each concatenates [text ; image] per GPU. All are "the text prefix and the
grid, each in N chunks" (Wan's prefix is empty).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..layout import TokenLayout
from .base import TEXT_SPLIT, TEXT_WHOLE


def context_parallel_config(parallel_config):
    """The `ContextParallelConfig` inside what diffusers sets as a processor's `_parallel_config`, or None."""
    return getattr(parallel_config, "context_parallel_config", None)


def context_parallel_plan(pipe_or_transformer) -> dict | None:
    """The context-parallel plan (diffusers' `ContextParallelModelPlan` format) under which PARO runs the
    transformer (the pipeline's first one) on several GPUs: the model's own `_cp_plan`, or the plan its adapter
    gives where diffusers has none (CogVideoX, HunyuanVideo 1 and 1.5, SkyReels-V2, Wan VACE). Pass it to
    `transformer.enable_parallelism(config=..., cp_plan=context_parallel_plan(transformer))`. None: no plan."""
    from .registry import require_family, resolve_transformer

    transformer = resolve_transformer(pipe_or_transformer)
    return require_family(transformer).context_parallel_plan(transformer)


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


def model_problem(transformer, family) -> str | None:
    """Why diffusers' context parallelism cannot hold PARO on this transformer of adapter `family`, or None."""
    if family.context_parallel_plan(transformer) is None:
        return (
            f"{type(transformer).__name__} has no context-parallel plan, in diffusers or in paroattn, so PARO cannot "
            "run with enable_parallelism on it: run one pipeline per GPU"
        )
    return family.ulysses_problem(transformer)


def chunk_sizes(tokens: int, degree: int) -> tuple[int, ...]:
    """Tokens of `tokens` that each GPU holds when diffusers splits them in `degree` contiguous chunks: equal ones,
    or, under `ulysses_anything`, `torch.tensor_split`'s (the first `tokens % degree` chunks one token longer)."""
    return tuple(tokens // degree + (rank < tokens % degree) for rank in range(degree))


@dataclass(frozen=True)
class SequenceSplit:
    """How the sequence of a layout lies across the GPUs under Ulysses. The whole sequence is [prefix ; grid ;
    suffix]; a GPU's chunk holds its piece of each of `runs` in turn, each run being (where the run starts in the
    whole sequence, tokens each GPU holds of it), and, where the family's plan does not split its text, the whole
    text (`whole`: its start and length), first in every chunk when it is a prefix, last when a suffix."""

    runs: tuple[tuple[int, tuple[int, ...]], ...]
    seq_len: int
    prefix: int
    whole: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, layout: TokenLayout, degree: int, text: str = TEXT_SPLIT) -> SequenceSplit:
        grid = (layout.prefix, chunk_sizes(layout.grid_tokens, degree))
        if text == TEXT_WHOLE:
            whole = (0, layout.prefix) if layout.prefix else (layout.prefix + layout.grid_tokens, layout.suffix)
            return cls((grid,), layout.seq_len, layout.prefix, whole)
        runs = [grid]
        if layout.prefix:
            runs.insert(0, (0, chunk_sizes(layout.prefix, degree)))
        if layout.suffix:
            runs.append((layout.prefix + layout.grid_tokens, chunk_sizes(layout.suffix, degree)))
        return cls(tuple(runs), layout.seq_len, layout.prefix)

    @property
    def degree(self) -> int:
        return len(self.runs[0][1])

    @property
    def whole_first(self) -> bool:
        return self.whole[0] == 0

    @property
    def equal(self) -> bool:
        """Whether every GPU holds as many tokens of each run (then one strided copy serves every GPU)."""
        return all(len(set(sizes)) == 1 for _, sizes in self.runs)

    def exchanged(self, rank: int) -> int:
        """Tokens of GPU `rank`'s chunk that the all-to-all exchanges (all but the whole text)."""
        return sum(sizes[rank] for _, sizes in self.runs)

    def local(self, rank: int) -> int:
        """Tokens of GPU `rank`'s chunk."""
        return self.exchanged(rank) + self.whole[1]

    def text_before_grid(self, rank: int) -> int:
        """Text tokens before the grid in GPU `rank`'s chunk."""
        if self.whole[1]:
            return self.whole[1] if self.whole_first else 0
        return self.runs[0][1][rank] if self.prefix else 0

    def pieces(self, rank: int) -> list[tuple[int, int]]:
        """(start in the whole sequence, length) of GPU `rank`'s piece of each run, in its chunk's order."""
        return [(start + sum(sizes[:rank]), sizes[rank]) for start, sizes in self.runs]

    def problem(self, layout: TokenLayout, uneven: bool) -> str | None:
        """Why diffusers cannot split `layout` this way (evenly unless `uneven`), or None. The same on every GPU
        (it reads only the layout), so every GPU raises it before any exchange."""
        n = self.degree
        if uneven:
            return None if layout.grid_tokens >= n else (
                f"the {layout.grid_tokens} grid tokens of {layout} are fewer than ulysses_degree={n}: use fewer GPUs")
        if all(sum(sizes) % n == 0 for _, sizes in self.runs):
            return None
        what = " and ".join(f"the {sum(sizes)} {'grid' if start == self.prefix else 'text'} tokens"
                            for start, sizes in self.runs)
        return (
            f"Ulysses splits {what} of {layout} in {n} equal chunks; they are not divisible by ulysses_degree={n}: "
            f"pick a size (or text length) whose token counts {n} divides, another ulysses_degree, or "
            "ContextParallelConfig(ulysses_anything=True) for chunks of unequal length"
        )


def sequence_problem(layout: TokenLayout, degree: int, text: str = TEXT_SPLIT, uneven: bool = False) -> str | None:
    """Why the sequence of `layout` cannot be split for `degree` GPUs (text `text`: split or whole), or None."""
    return SequenceSplit.of(layout, degree, text).problem(layout, uneven)


def exchange_groups_problem(heads_per_gpu: int, groups) -> str | None:
    """Why `groups` cannot split a GPU's `heads_per_gpu` heads into equal groups, or None."""
    if isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1 and heads_per_gpu % groups == 0:
        return None
    divisors = [g for g in range(1, heads_per_gpu + 1) if heads_per_gpu % g == 0]
    return (f"exchange_groups={groups!r}: each GPU runs {heads_per_gpu} heads, which go in equal groups; use one of "
            f"{', '.join(map(str, divisors))}")


class UlyssesShard:
    """One GPU's share of the `num_heads` heads of each layer under Ulysses: its rank and group, its heads
    (`heads`: a (start, stop) range), and the all-to-all exchanges between the GPUs' sequence chunks and its heads
    over the whole sequence. `text`: how the family's context-parallel plan spreads its text (`TEXT_SPLIT` or
    `TEXT_WHOLE`); `groups`: the groups of heads the exchange is pipelined over (`attend`)."""

    def __init__(self, cp_config, num_heads: int, text: str = TEXT_SPLIT, groups: int = 1):
        mesh = cp_config._ulysses_mesh
        if mesh is None:
            raise RuntimeError(
                "this ContextParallelConfig has not been set up: pass it to transformer.enable_parallelism(config=...) "
                "instead of setting a processor's _parallel_config by hand"
            )
        self.degree = int(cp_config.ulysses_degree)
        self.rank = int(cp_config._ulysses_local_rank)
        self.uneven = bool(getattr(cp_config, "ulysses_anything", False))
        self.text = text
        self.group = mesh.get_group()
        heads = int(num_heads) // self.degree
        self.heads = (self.rank * heads, (self.rank + 1) * heads)
        if problem := exchange_groups_problem(heads, groups):
            raise ValueError(problem)
        self.groups = groups
        self._splits: dict[TokenLayout, SequenceSplit] = {}
        self._rotary_source: tuple | None = None  # the local tables last gathered (held: `is` cannot match a new one)
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None

    def split(self, layout: TokenLayout) -> SequenceSplit:
        """How `layout`'s sequence lies across the GPUs (made once per layout)."""
        split = self._splits.get(layout)
        if split is None:
            split = self._splits[layout] = SequenceSplit.of(layout, self.degree, self.text)
        return split

    def local_problem(self, layout: TokenLayout, tokens: int, text_tokens: int | None) -> str | None:
        """Why a call's local chunk is not this GPU's chunk of `layout`, or None."""
        split = self.split(layout)
        if problem := split.problem(layout, self.uneven):
            return problem
        local, text = split.local(self.rank), split.text_before_grid(self.rank)
        if tokens != local or (text_tokens is not None and text_tokens != text):
            return (
                f"under Ulysses {self.degree} GPU {self.rank} should hold {local} of the {layout.seq_len} tokens of "
                f"{layout} ({text} text before the grid); this call has {tokens} ({text_tokens} text): the model's "
                "sequence is not split the way the context-parallel plan for this family splits it (another cp_plan?)"
            )
        return None

    # -- the exchanges ------------------------------------------------------------------------------------------
    def attend(self, tensors: tuple[torch.Tensor, ...], split: SequenceSplit, attention, groups: int | None = None):
        """`attention` on this GPU's heads over the whole sequence, from and back to this GPU's chunk.

        `tensors` (q, k, v) [B, H, S_r, D] of this GPU's chunk; `attention(q, k, v, heads)` gets [B, h, S, D] of the
        heads `heads` (a (start, stop) range of this GPU's slice) in [prefix ; grid ; suffix] order and returns their
        output [B, h, S, D]. The slice goes in `groups` groups of heads (default `self.groups`), and every group's
        all-to-all is issued before the first is waited for: group g's attention runs while the inputs of the groups
        after it and the output of the one before are in flight, so only the first group's inputs and the last
        one's output wait on the network. Returns [B, H, S_r, D], a view of a [B, S_r, H, D] tensor (the layout the
        processors' output projections read)."""
        groups = groups or self.groups
        per_gpu = tensors[0].shape[1] // self.degree
        if per_gpu % groups:
            raise ValueError(f"{groups} exchange groups do not divide the {per_gpu} heads of each GPU")
        size = per_gpu // groups
        ranges = [(g * size, (g + 1) * size) for g in range(groups)]
        inbound = [self._send_inputs(tensors, split, heads) for heads in ranges]
        outbound = [self._send_output(attention(*self._place_inputs(received, tensors, split, heads), heads), split)
                    for heads, received in zip(ranges, inbound)]
        batch, _, local, dim = tensors[0].shape
        result = outbound[0].new_empty(batch, local, self.degree, per_gpu, dim)  # of the attention's dtype
        for heads, received in zip(ranges, outbound):
            self._place_output(received, result, heads)
        return result.view(batch, local, self.degree * per_gpu, dim).transpose(1, 2)

    def _exchange(self, send: torch.Tensor, send_counts: list[int] | None = None,
                  receive_counts: list[int] | None = None) -> torch.Tensor:
        """All-to-all over dim 0 of `send` [degree, ...] (chunk i to GPU i; chunk j of the result came from GPU j), or
        of flat `send` by counts of elements. Issued, not waited for: torch's functional collective waits at the
        result's first use, so the work queued in between overlaps the transfer (and it traces under compile)."""
        return funcol.all_to_all_single(send, receive_counts, send_counts, self.group)

    def _send_inputs(self, tensors, split: SequenceSplit, heads: tuple[int, int]) -> torch.Tensor:
        """Issue the exchange of `tensors`' exchanged tokens, to each GPU j its heads `heads` of GPU j's slice: in
        flight, [N (the GPU whose chunk it is), T, B, h, ex, D], or flat for chunks of unequal length."""
        n, h0, h1 = self.degree, *heads
        batch, all_heads, _, dim = tensors[0].shape
        first = split.whole[1] if split.whole_first else 0  # where the exchanged tokens start in the chunk
        ex = split.exchanged(self.rank)
        send = torch.stack([x[:, :, first:first + ex].unflatten(1, (n, all_heads // n))[:, :, h0:h1].transpose(0, 1)
                            for x in tensors], dim=1)  # one copy per tensor, one all-to-all for all of them
        if split.equal:
            return self._exchange(send)
        counts = [len(tensors) * batch * (h1 - h0) * split.exchanged(j) * dim for j in range(n)]
        return self._exchange(send.view(-1), [send[0].numel()] * n, counts)

    def _place_inputs(self, received: torch.Tensor, tensors, split: SequenceSplit, heads: tuple[int, int]):
        """`_send_inputs`' received chunks -> each tensor's heads `heads` over the whole sequence [B, h, S, D] in
        [prefix ; grid ; suffix] order, with the text every GPU holds whole taken from this GPU's own chunk."""
        n, rank, (whole_start, whole), (h0, h1) = self.degree, self.rank, split.whole, heads
        count, (batch, all_heads, local, dim) = len(tensors), tensors[0].shape
        out = tensors[0].new_empty(count, batch, h1 - h0, split.seq_len, dim)
        if split.equal:
            offset = 0
            for start, sizes in split.runs:  # each GPU's piece of the run, in rank order, is the run
                size = sizes[0]
                if size:
                    out[..., start:start + n * size, :].unflatten(3, (n, size)).copy_(
                        received[..., offset:offset + size, :].permute(1, 2, 3, 0, 4, 5))
                offset += size
        else:
            counts = [count * batch * (h1 - h0) * split.exchanged(j) * dim for j in range(n)]
            for j, piece in enumerate(received.split(counts)):
                piece, offset = piece.view(count, batch, h1 - h0, -1, dim), 0
                for start, size in split.pieces(j):
                    out[..., start:start + size, :].copy_(piece[..., offset:offset + size, :])
                    offset += size
        if whole:  # every GPU holds the whole text: its own heads of it
            begin = 0 if split.whole_first else local - whole
            mine = rank * (all_heads // n)
            for t, x in enumerate(tensors):
                out[t, :, :, whole_start:whole_start + whole].copy_(x[:, mine + h0:mine + h1, begin:begin + whole])
        return out.unbind(0)

    def _send_output(self, out: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
        """Issue the exchange of a group's output [B, h, S, D] back to the GPUs whose chunks its tokens are (the whole
        text's output of these heads to every GPU): in flight, [N (the GPU whose heads they are), B, h, S_r, D], or
        flat for chunks of unequal length."""
        batch, heads, _, dim = out.shape
        n, rank, (whole_start, whole) = self.degree, self.rank, split.whole
        first = whole if split.whole_first else 0

        def fill(piece: torch.Tensor, local: int, pieces) -> None:
            """piece [..., B, h, local, D]: the chunk of the GPU(s) whose `pieces` these are, in chunk order."""
            offset = first
            for start, size in pieces:
                piece[..., offset:offset + size, :].copy_(out[:, :, start:start + size])
                offset += size
            if whole:
                begin = 0 if split.whole_first else local - whole
                piece[..., begin:begin + whole, :].copy_(out[:, :, whole_start:whole_start + whole])

        local = split.local(rank)
        if split.equal:
            send = out.new_empty(n, batch, heads, local, dim)
            offset = first
            for start, sizes in split.runs:
                size = sizes[0]
                if size:
                    send[:, :, :, offset:offset + size].copy_(
                        out[:, :, start:start + n * size].unflatten(2, (n, size)).permute(2, 0, 1, 3, 4))
                offset += size
            if whole:
                begin = 0 if split.whole_first else local - whole
                send[:, :, :, begin:begin + whole].copy_(
                    out[:, :, whole_start:whole_start + whole].expand(n, -1, -1, -1, -1))
            return self._exchange(send)
        counts = [batch * heads * split.local(j) * dim for j in range(n)]
        send = out.new_empty(sum(counts))
        for j, piece in enumerate(send.split(counts)):
            fill(piece.view(batch, heads, split.local(j), dim), split.local(j), split.pieces(j))
        return self._exchange(send, counts, [batch * heads * local * dim] * n)

    def _place_output(self, received: torch.Tensor, result: torch.Tensor, heads: tuple[int, int]) -> None:
        """`_send_output`'s received chunks -> heads `heads` of every GPU's slice in `result` [B, S_r, N, H/N, D]."""
        (batch, local, n, _, dim), (h0, h1) = result.shape, heads
        result[:, :, :, h0:h1].copy_(received.view(n, batch, h1 - h0, local, dim).permute(1, 3, 0, 2, 4))

    def gather_rotary(self, tables: tuple[torch.Tensor, torch.Tensor], split: SequenceSplit):
        """The op's rotary tables of this GPU's chunk -> those of the whole sequence in [prefix ; grid ; suffix]
        order; gathered once per forward (every layer gets the same tables). The tables rotate the last rows of a
        sequence: the whole chunk, or (CogVideoX) all of it but the whole text before the grid."""
        if not torch.compiler.is_compiling() and self._rotary_source is not None and all(
                a is b for a, b in zip(tables, self._rotary_source)):
            return self._rotary
        n, rank, (whole_start, whole) = self.degree, self.rank, split.whole
        local = split.local(rank)
        skipped = local - tables[0].shape[0]  # leading chunk rows the tables leave alone
        if skipped not in (0, whole if split.whole_first else 0) or (skipped and not whole):
            raise RuntimeError(f"rotary tables of {tables[0].shape[0]} rows for a chunk of {local} tokens: they must "
                               "cover the whole chunk or all of it after the text held whole")
        gathered = []
        for table in tables:
            table = table.contiguous()
            rows = [split.local(j) - skipped for j in range(n)]
            longest = max(rows)  # chunks of unequal length are padded to the longest (gloo gathers equal ones only)
            if table.shape[0] < longest:
                table = torch.cat([table, table.new_zeros(longest - table.shape[0], table.shape[1])])
            parts = torch.empty(n * longest, table.shape[1], dtype=table.dtype, device=table.device)
            dist.all_gather_into_tensor(parts, table, group=self.group)
            parts = parts.view(n, longest, -1)
            full = table.new_empty(split.seq_len, table.shape[1])
            first = whole if split.whole_first else 0
            for j, part in enumerate(parts):  # [chunk rows of GPU j] -> their places in the whole sequence
                offset = first - skipped
                for start, size in split.pieces(j):
                    full[start:start + size].copy_(part[offset:offset + size])
                    offset += size
            if whole and not skipped:
                begin = 0 if split.whole_first else local - whole
                full[whole_start:whole_start + whole].copy_(parts[rank, begin:begin + whole])
            gathered.append(full[skipped:] if skipped else full)
        self._rotary_source, self._rotary = tables, tuple(gathered)
        return self._rotary


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


def enable_ulysses(transformer, degree: int, uneven: bool = False) -> None:
    """`transformer.enable_parallelism` with `ContextParallelConfig(ulysses_degree=degree)` over every process of the
    group and the family's context-parallel plan (`context_parallel_plan`), on a mesh of the transformer's device
    type (diffusers would build a CUDA one). `uneven`: `ulysses_anything`, chunks of unequal length where the degree
    does not divide a token count. Then what the family's adapter sets after `enable_parallelism`
    (`FamilyAdapter.after_enable_parallelism`: SkyReels-V2's cross-attention kept on each GPU)."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(transformer.device.type, (1, degree), mesh_dim_names=("ring", "ulysses"))
    config = ContextParallelConfig(ulysses_degree=degree, mesh=mesh, ulysses_anything=uneven)
    transformer.enable_parallelism(config=config, cp_plan=context_parallel_plan(transformer))
    from .registry import require_family

    require_family(transformer).after_enable_parallelism(transformer)
