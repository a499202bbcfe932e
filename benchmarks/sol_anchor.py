"""Sol-Attn as a benchmark anchor (benchmark only, never a dependency of paroattn): the calibration-free block-sparse
attention that ships in comfy-kitchen (`comfy_kitchen.sol_attn`, arXiv 2607.24027) and in ComfyUI's core "Block
Sparse Attention" node. Per call it routes each 64-query block to the key blocks whose pooled score ranks in the top
`topk_ratio` of the row, always keeps the diagonal +-1, and (with `tail=True`) adds every other key block as one pooled
term. `benchmarks/attention.py --sol` times it beside PARO at each density of the run; `SolAttnProcessor` runs a
diffusers transformer's self-attention through its eager reference, for the quality study
(`scripts/demo_model_quality.py`).

comfy-kitchen is on the package index (`pip install comfy-kitchen`); its CUDA kernels take bf16 / fp16 inputs of head
dim 128 laid out (B, T, H, D) on sm_80 or newer.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from paroattn.pipelines.binding import BoundProcessor

BLOCK = 64  # Sol-Attn's query and key block


def available() -> str | None:
    """None when Sol-Attn's CUDA kernels can run here, else why not."""
    try:
        import comfy_kitchen
    except Exception as exc:  # optional, benchmark-only
        return f"comfy-kitchen not importable ({type(exc).__name__}: {exc}); pip install comfy-kitchen"
    if not comfy_kitchen.sol_attn_is_available(torch.device("cuda")):
        return "comfy-kitchen is installed but its Sol-Attn CUDA kernels cannot run on this GPU"
    return None


def topk_count(blocks: int, ratio: float) -> int:
    """Key blocks a query block routes under top-k (as Sol-Attn counts them: ratio x blocks, within [1, blocks - 1])."""
    return max(0, min(blocks - 1, max(1, round(ratio * blocks))))


def exact_block_density(q: torch.Tensor, k: torch.Tensor, ratio: float) -> float:
    """The fraction of (query block, key block) pairs Sol-Attn computes exactly at top-k `ratio` for (B, T, H, D)
    inputs: its routing score of a pair is the query block's mean query against the key block's mean key (the mean
    of the per-query scores, by linearity); the top `topk_count` per row plus the diagonal +-1. Ties at the
    threshold are kept, as Sol-Attn keeps them."""
    B, T, H, D = q.shape
    n = -(-T // BLOCK)
    pad = n * BLOCK - T

    def pooled(x):
        x = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad))
        sums = x.reshape(B, n, BLOCK, H, D).sum(2)
        lengths = torch.full((n,), float(BLOCK), device=x.device)
        lengths[-1] = BLOCK - pad
        return (sums / lengths.view(1, n, 1, 1)).permute(0, 2, 1, 3)  # (B, H, n, D)

    scores = pooled(q) @ pooled(k).transpose(-1, -2)  # (B, H, n, n); centring K shifts rows alike
    kept = topk_count(n, ratio)
    exact = scores >= scores.topk(kept, dim=-1).values[..., -1:]
    index = torch.arange(n, device=q.device)
    exact |= (index.view(1, -1) - index.view(-1, 1)).abs() <= 1
    return float(exact.float().mean())


def call(ratio: float, tail: bool):
    """Sol-Attn at top-k `ratio` on (B, T, H, 128) inputs."""
    import comfy_kitchen

    def sol(q, k, v):
        return comfy_kitchen.sol_attn(q, k, v, topk_ratio=ratio, tail=tail)

    return sol


def eager_reference():
    """Sol-Attn's eager reference (comfy-kitchen's `backends/eager/sol_attn.py`): its routing and softmax in float32
    on any device and head dim, where the CUDA kernels compute in INT8 (the algorithm's quality, not the kernel's)."""
    try:
        from comfy_kitchen.backends.eager.sol_attn import sol_attn
    except Exception as exc:  # optional, benchmark-only
        raise RuntimeError(f"Sol-Attn's eager reference is not importable ({type(exc).__name__}: {exc}): "
                           "pip install comfy-kitchen") from exc
    return sol_attn


class SolAttnProcessor(BoundProcessor):
    """Self-attention through Sol-Attn's eager reference at top-k `ratio`, with or without its pooled tail (`tail`),
    on the layers paroattn binds (tested on Wan's: no text in the sequence, no mask); the other attention modules keep
    their processors. `densities` collects each call's exact-block density (`exact_block_density`: the ratio plus the
    forced diagonal +-1)."""

    def __init__(self, ratio: float, tail: bool):
        super().__init__()
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"Sol-Attn's top-k ratio must be in (0, 1], got {ratio}")
        self.ratio, self.tail = ratio, tail
        self.densities: list[float] = []
        self._sol = eager_reference()

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[B, H, N, D] q, k (after RoPE), v -> [B, H, N, D]: one reference call per batch entry (the reference
        holds a float32 [B, H, N, N] score tensor; its routing and tail are per entry)."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # the reference's (B, T, H, D)
        self.densities.append(exact_block_density(q, k, self.ratio))
        out = torch.cat([self._sol(q[b:b + 1], k[b:b + 1], v[b:b + 1], topk_ratio=self.ratio, tail=self.tail)
                         for b in range(q.shape[0])])
        return out.transpose(1, 2)

    def attend(self, binding, attn, layer, call, attention_mask):
        if attention_mask is not None:
            raise ValueError(f"SolAttnProcessor got an attention mask on {binding.family.models} self-attention: "
                             "Sol-Attn's key-only bias is not wired here; run this family dense")
        call = binding.family.rotate(call)
        return self.attention(call.q, call.k, call.v)


@contextmanager
def installed(pipe_or_transformer, processor: BoundProcessor):
    """`processor` on the transformer's self-attention layers for the block (as `paroattn.apply` installs PARO's),
    then the processors it had before."""
    transformer = getattr(pipe_or_transformer, "transformer", pipe_or_transformer)
    originals = dict(transformer.attn_processors)
    binding = processor.bind(transformer)
    transformer.set_attn_processor({key: processor if key in binding.keys else p for key, p in originals.items()})
    try:
        yield processor
    finally:
        transformer.set_attn_processor(dict(originals))  # diffusers empties the dict it is given
        processor.unbind(binding)
