"""Where the error of quantized PARO attention comes from: QK or PV, which factor, and what finer
quantization granularity would buy. A CPU study in float32 on the torch reference's quantization grid.

    python benchmarks/quant_error.py --step --out benchmarks/results/quant-error-cpu.json  # ~6 CPU minutes
    python benchmarks/quant_error.py --table benchmarks/results/quant-error-cpu.json       # markdown from the JSON
    python benchmarks/quant_error.py --smoke                                               # seconds: the checks

`emulate` is the reference op (`paroattn.kernels.reference.paro_attention_reference`) with every
quantization step a parameter (`Variant`): QK exact / int8 / int4 with Q and K scales per block (the
kernels' grid), per group of rows or keys, per token, or per "thread group" of keys (the 4 strided
groups of a key block that one thread of an MMA accumulator holds); K smoothing on or off; P exact,
e4m3 of P * 448 (the kernels' fp8 P), e4m3 of P itself, or int8 of P * 127; V exact, per channel
(the kernels' grid) or per token, optionally with its per-channel mean subtracted before and added
back after (V smoothing); the softmax denominator from the exact P (the kernels') or the quantized P.
Each variant's output is compared with the same function without any quantization (float32, same
mask and orders): relative L2 error over the whole output. The variants named "current" must equal
`paro_attention_reference` bit for bit (`check_against_reference`, run before every measurement and by
tests/test_quant_error_bench.py), so the study follows the reference if its quantization changes.

Inputs: Gaussian q, k, v (unit variance), with and without a per-channel offset in K (and in K and V),
at head dim 64 and 128, dense masks; and the q, k, v of three self-attention layers of the bundled
demo model (`paroattn.demo_model`) at one mid-trajectory step (sigma 0.5), with the shipped plan's
orders and block masks (density 0.5). With `--step`, the same model's velocity at that step with every
self-attention layer running a variant, against all layers exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paroattn import TokenLayout  # noqa: E402
from paroattn.kernels.block_lists import ActiveBlocks  # noqa: E402
from paroattn.kernels.reference import (  # noqa: E402
    _QUERY_CHUNK,
    QK_QMAX,
    apply_rotary,
    expand_block_mask,
    head_indices,
    key_mean_stride,
    key_smoothing_mean,
    paro_attention_reference,
    quant_scale,
)
from paroattn.masks import block_sizes  # noqa: E402

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of quantizing the op. Groups: "block" (the mask's block: bq queries, bk keys), an int
    (that many consecutive tokens of the reordered sequence), "token", or "thread" (keys only: the 4
    groups {j : j mod 8 in {2t, 2t + 1}} of each key block)."""

    inputs: str = "float32"  # "float32" or "bf16": q, k, v rounded to bf16 first (the op's usual input dtype)
    qk: str = "exact"  # "exact", "int8", "int4"
    q_group: str | int = "block"
    k_group: str | int = "block"
    smooth_k: bool = True  # subtract K's sampled mean before quantizing (the kernels do)
    # "exact", "bf16", "fp8" (e4m3 of P * 448, the kernels'), "fp8-raw" (e4m3 of P in [0, 1]), "int8" (P * 127)
    p: str = "exact"
    v: str = "exact"  # "exact", "fp8", "int8"
    v_group: str = "channel"  # "channel" (one scale per channel over all tokens, the kernels') or "token"
    smooth_v: bool = False  # subtract V's per-channel mean before quantizing, add it to the output after
    denom: str = "exact"  # softmax denominator from the "exact" P (the kernels') or the "quantized" one


# the reference's (qk, pv) modes as variants: `check_against_reference` asserts they are the same op
CURRENT = {
    ("int8", "bf16"): Variant(qk="int8"),
    ("int4", "bf16"): Variant(qk="int4"),
    ("bf16", "fp8"): Variant(p="fp8", v="fp8"),
    ("bf16", "int8"): Variant(p="int8", v="int8"),
    ("int8", "fp8"): Variant(qk="int8", p="fp8", v="fp8"),
    ("int8", "int8"): Variant(qk="int8", p="int8", v="int8"),
    ("int4", "fp8"): Variant(qk="int4", p="fp8", v="fp8"),
    ("int4", "int8"): Variant(qk="int4", p="int8", v="int8"),
}

I8, I4 = Variant(qk="int8"), Variant(qk="int4")
FP8 = Variant(p="fp8", v="fp8")
# (section, label, variant); the labels are the table's rows
VARIANTS = [
    ("QK only", "int8 QK, per block (current)", I8),
    ("QK only", "int8 QK, K not smoothed", dataclasses.replace(I8, smooth_k=False)),
    ("QK only", "int8 QK, Q per 32 rows", dataclasses.replace(I8, q_group=32)),
    ("QK only", "int8 QK, Q per 16 rows", dataclasses.replace(I8, q_group=16)),
    ("QK only", "int8 QK, Q per token", dataclasses.replace(I8, q_group="token")),
    ("QK only", "int8 QK, K per 16 keys", dataclasses.replace(I8, k_group=16)),
    ("QK only", "int8 QK, K per thread group", dataclasses.replace(I8, k_group="thread")),
    ("QK only", "int8 QK, K per token", dataclasses.replace(I8, k_group="token")),
    ("QK only", "int8 QK, Q and K per token", dataclasses.replace(I8, q_group="token", k_group="token")),
    ("QK only", "int4 QK, per block (current)", I4),
    ("QK only", "int4 QK, K not smoothed", dataclasses.replace(I4, smooth_k=False)),
    ("QK only", "int4 QK, Q per token", dataclasses.replace(I4, q_group="token")),
    ("QK only", "int4 QK, K per thread group", dataclasses.replace(I4, k_group="thread")),
    ("QK only", "int4 QK, K per token", dataclasses.replace(I4, k_group="token")),
    ("QK only", "int4 QK, Q and K per token", dataclasses.replace(I4, q_group="token", k_group="token")),
    ("PV only", "fp8 P and V (current)", FP8),
    ("PV only", "fp8 P only (P * 448)", Variant(p="fp8")),
    ("PV only", "fp8 P only, raw P in [0, 1]", Variant(p="fp8-raw")),
    ("PV only", "fp8 V only, per channel", Variant(v="fp8")),
    ("PV only", "fp8 V only, per token", Variant(v="fp8", v_group="token")),
    ("PV only", "fp8 V only, per channel, smoothed", Variant(v="fp8", smooth_v=True)),
    ("PV only", "fp8 P and V, V smoothed", dataclasses.replace(FP8, smooth_v=True)),
    ("PV only", "fp8 P and V, denominator from quantized P", dataclasses.replace(FP8, denom="quantized")),
    ("PV only", "fp8 P and V, V smoothed, quantized denominator",
     dataclasses.replace(FP8, smooth_v=True, denom="quantized")),
    ("PV only", "int8 P only (P * 127)", Variant(p="int8")),
    ("PV only", "int8 V only, per channel", Variant(v="int8")),
    ("PV only", "int8 P and V (current)", Variant(p="int8", v="int8")),
    ("both", "bf16 op (q, k, v and P rounded to bf16)", Variant(inputs="bf16", p="bf16")),
    ("both", "int8 QK + bf16 PV (q, k, v and P rounded to bf16)", Variant(inputs="bf16", qk="int8", p="bf16")),
    ("both", "int8 QK + fp8 PV (current)", CURRENT[("int8", "fp8")]),
    ("both", "int8 QK + fp8 PV, Q per token", dataclasses.replace(CURRENT[("int8", "fp8")], q_group="token")),
    ("both", "int8 QK + fp8 PV, V smoothed, quantized denominator",
     dataclasses.replace(CURRENT[("int8", "fp8")], smooth_v=True, denom="quantized")),
    ("both", "int4 QK + fp8 PV (current)", CURRENT[("int4", "fp8")]),
    ("both", "int4 QK + fp8 PV, Q per token, K per thread group",
     dataclasses.replace(CURRENT[("int4", "fp8")], q_group="token", k_group="thread")),
]
# the denoising step (--step): the op's modes and the variants that change the picture
STEP_VARIANTS = [
    "bf16 op (q, k, v and P rounded to bf16)",
    "int8 QK, per block (current)", "fp8 P and V (current)", "fp8 P and V, V smoothed, quantized denominator",
    "int8 QK + fp8 PV (current)", "int8 QK + fp8 PV, V smoothed, quantized denominator", "int4 QK + fp8 PV (current)",
]
EXACT = Variant()


# -- the quantization steps ----------------------------------------------------------------------------

def group_ids(n: int, group: str | int, block: int) -> tuple[torch.Tensor, int]:
    """(group index of each of n reordered tokens, number of groups) for a `Variant` group."""
    i = torch.arange(n)
    if group == "block":
        ids = i // block
    elif group == "token":
        ids = i
    elif group == "thread":
        if block % 8:
            raise ValueError(f"thread groups need a key block that is a multiple of 8, got {block}")
        ids = (i // block) * 4 + (i % 8) // 2
    elif isinstance(group, int) and group > 0:
        ids = i // group
    else:
        raise ValueError(f"group {group!r}: expected 'block', 'token', 'thread' or a positive int")
    return ids, int(ids.max()) + 1


def quantize_groups(x: torch.Tensor, group: str | int, block: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of x [B, N, D] with one scale per group of tokens: (integer values as
    float32 [B, N, D], each token's scale [B, N]). Per block, the same values and scales as
    `reference.quantize_per_block` (max |x| over the group, then `quant_scale` and a reciprocal)."""
    B, N, _ = x.shape
    ids, count = group_ids(N, group, block)
    amax = torch.zeros(B, count, dtype=x.dtype).scatter_reduce(
        1, ids.expand(B, N), x.abs().amax(dim=2), "amax", include_self=False)
    scale = quant_scale(amax, qmax)[:, ids]
    return torch.round(x * torch.reciprocal(scale)[:, :, None]).clamp_(-qmax, qmax), scale


def quantize_p(p: torch.Tensor, mode: str) -> torch.Tensor:
    """P (after the row-max shift, in [0, 1]) as the PV product sees it, dequantized."""
    if mode == "exact":
        return p
    if mode == "bf16":
        return p.to(torch.bfloat16).float()
    if mode == "fp8":
        return (p * E4M3_MAX).to(E4M3).float() / E4M3_MAX
    if mode == "fp8-raw":
        return p.to(E4M3).float()
    if mode == "int8":
        return torch.round(p * 127.0) / 127.0
    raise ValueError(f"P mode {mode!r}")


def quantize_v(v: torch.Tensor, mode: str, group: str) -> torch.Tensor:
    """V [B, N, D] quantized and dequantized: one scale per channel (over the tokens) or per token."""
    if mode == "exact":
        return v
    qmax = {"fp8": E4M3_MAX, "int8": 127.0}[mode]
    scale = quant_scale(v.abs().amax(dim=1 if group == "channel" else 2, keepdim=True), qmax)
    scaled = v * torch.reciprocal(scale)
    if mode == "int8":
        return torch.round(scaled).clamp_(-qmax, qmax) * scale
    return scaled.to(E4M3).float() * scale


def emulate(q, k, v, layout: TokenLayout, orders, block_mask, bq: int, bk: int, variant: Variant,
            sm_scale: float | None = None, rotary=None) -> torch.Tensor:
    """The reference op's loop with `variant`'s quantization; q, k, v [B, H, N, D], block_mask bool
    [H, ceil(N/bq), ceil(N/bk)] (reordered coordinates). Returns float32 [B, H, N, D]. NaN inputs are
    not handled (the reference's NaN paths are no part of this study)."""
    B, H, N, D = q.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if variant.inputs == "bf16":
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    quantized_qk = variant.qk != "exact"
    out = torch.empty(B, H, N, D, dtype=torch.float32)
    indices = head_indices(layout, orders, q.device)
    stride = key_mean_stride(N, layout.height, layout.width)
    for h in range(H):
        index = indices[h]
        qh = q[:, h].index_select(1, index).float()
        kh = k[:, h].index_select(1, index).float()
        vh = v[:, h].index_select(1, index).float()
        v_mean = vh.mean(dim=1, keepdim=True) if variant.smooth_v else None
        vh = quantize_v(vh if v_mean is None else vh - v_mean, variant.v, variant.v_group)
        if quantized_qk:
            if variant.smooth_k:
                kh = kh - key_smoothing_mean(k[:, h], stride)
            qh, q_scale = quantize_groups(qh, variant.q_group, bq, QK_QMAX[variant.qk])
            kh, k_scale = quantize_groups(kh, variant.k_group, bk, QK_QMAX[variant.qk])
        out_h = torch.empty(B, N, D, dtype=torch.float32)
        # the reference's chunks, so that the matrix products (and the comparison) are bit for bit its own
        for start in range(0, N, _QUERY_CHUNK):
            stop = min(start + _QUERY_CHUNK, N)
            rows = block_mask[h, torch.arange(start, stop) // bq]
            allowed = expand_block_mask(rows, bk, N)
            scores = qh[:, start:stop] @ kh.transpose(1, 2)
            if quantized_qk:
                scores = scores * q_scale[:, start:stop, None] * k_scale[:, None, :]
            scores = scores * sm_scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            row_max = scores.amax(dim=-1, keepdim=True)
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            p = torch.exp(scores - row_max)
            denom = p.sum(dim=-1, keepdim=True)
            p = quantize_p(p, variant.p)
            if variant.denom == "quantized":
                denom = p.sum(dim=-1, keepdim=True)
            numer = p @ vh
            empty = denom == 0
            o = torch.where(empty, torch.zeros_like(numer), numer / torch.where(empty, torch.ones_like(denom), denom))
            if v_mean is not None:  # the epilogue adds the mean back to every row that attends a key
                o = torch.where(empty, o, o + v_mean)
            out_h[:, start:stop] = o
        out[:, h, index] = out_h
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


# -- checks against the library's reference -----------------------------------------------------------

def check_against_reference(problem: dict, pairs=None) -> None:
    """Assert that the `CURRENT` variants of `pairs` (default: all) are `paro_attention_reference` bit for bit
    on `problem` (float32 inputs), and that the exact variant matches its float32 path to rounding."""
    args = {key: problem[key] for key in ("layout", "orders", "block_mask", "bq", "bk")}
    rotary = problem.get("rotary")
    q, k, v = problem["q"], problem["k"], problem["v"]
    for (qk, pv) in pairs or CURRENT:
        ours = emulate(q, k, v, variant=CURRENT[(qk, pv)], rotary=rotary, **args)
        theirs = paro_attention_reference(q, k, v, problem["layout"], problem["orders"], problem["block_mask"],
                                          problem["bq"], problem["bk"], qk, pv, rotary=rotary)
        if not torch.equal(ours, theirs):
            raise AssertionError(
                f"the study's ({qk}, {pv}) variant differs from paro_attention_reference (max |diff| "
                f"{float((ours - theirs).abs().max()):.3g}): the reference's quantization changed; update emulate")
    exact = emulate(q, k, v, variant=EXACT, rotary=rotary, **args)
    theirs = paro_attention_reference(q, k, v, problem["layout"], problem["orders"], problem["block_mask"],
                                      problem["bq"], problem["bk"], "bf16", "bf16", rotary=rotary)
    if relative_error(exact, theirs) > 1e-5:
        raise AssertionError(f"the exact variant is {relative_error(exact, theirs):.3g} from the float32 reference")


# -- inputs -------------------------------------------------------------------------------------------

def gaussian_problem(head_dim: int, layout: TokenLayout, heads: int, *, k_offset: float = 0.0,
                     v_offset: float = 0.0, seed: int = 0, sparse: bool = False, bq: int = 64, bk: int = 64) -> dict:
    """Unit Gaussian q, k, v [1, heads, N, D]; K (V) plus a per-channel offset drawn from N(0, offset^2) per
    head, as the channel outliers of real models' keys. Dense mask and the identity order, or with
    `sparse` a random block mask (diagonal kept) and random orders."""
    g = torch.Generator().manual_seed(seed)
    n = layout.seq_len
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=g) for _ in range(3))
    k += k_offset * torch.randn(1, heads, 1, head_dim, generator=g)
    v += v_offset * torch.randn(1, heads, 1, head_dim, generator=g)
    nq, nk = -(-n // bq), -(-n // bk)
    if sparse:
        mask = torch.rand(heads, nq, nk, generator=g) < 0.4
        mask[:, torch.arange(nq), torch.arange(nq) * bq // bk] = True
        orders = torch.randint(0, 6, (heads,), generator=g)
    else:
        mask = torch.ones(heads, nq, nk, dtype=torch.bool)
        orders = torch.zeros(heads, dtype=torch.long)
    return dict(q=q, k=k, v=v, layout=layout, orders=orders, block_mask=mask, bq=bq, bk=bk)


@contextmanager
def attention_replaced(fn):
    """Every self-attention call of a PARO-applied pipeline goes to fn(q, k, v, **paro_attention's keywords)."""
    from paroattn.pipelines import processor

    original = processor.paro_attention
    processor.paro_attention = fn
    try:
        yield
    finally:
        processor.paro_attention = original


def demo_model_step(density: float = 0.5, sigma: float = 0.5, seed: int = 0):
    """(pipe, plan, forward): the bundled demo pipeline, its shipped plan of `density`, and forward()
    -> the transformer's velocity at noise level `sigma` on a rendered training video (B = 1, its caption)."""
    from paroattn.app.demo import shipped_plan_path
    from paroattn.demo_model.data import make_batch
    from paroattn.demo_model.model import load_demo_pipeline
    from paroattn.plan import Plan

    pipe = load_demo_pipeline()
    plan = Plan.load(shipped_plan_path(density))
    videos, captions = make_batch(seed, 0, 1)
    noise = torch.randn(videos.shape, generator=torch.Generator().manual_seed(seed))
    latents = (1.0 - sigma) * videos + sigma * noise
    with torch.no_grad():
        cond = pipe.encode_prompt(captions)
    timestep = torch.full((1,), sigma * 1000.0)

    def forward():
        with torch.no_grad():
            return pipe.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=cond,
                                    return_dict=False)[0].float()

    return pipe, plan, forward


def _problem_from_call(q, k, v, layout, orders, block_mask, block_size, rotary) -> dict:
    if isinstance(block_mask, ActiveBlocks):
        block_mask = block_mask.to_mask()
    bq, bk = block_sizes(block_size)
    return dict(q=q, k=k, v=v, layout=layout, orders=orders.to(torch.long), block_mask=block_mask, bq=bq, bk=bk,
                rotary=rotary)


def model_problems(layers=(0, 3, 7), density: float = 0.5, sigma: float = 0.5, step_variants=()) -> tuple[list, dict]:
    """([(layer, problem)] of the demo model's self-attention calls at `layers`, {label: velocity
    error}) for the `step_variants` labels (every layer running that variant vs every layer exact)."""
    from paroattn.pipelines import apply

    pipe, plan, forward = demo_model_step(density, sigma)
    captured, step_errors = [], {}

    def op(variant, record):
        calls = iter(range(10**6))

        def attention(q, k, v, *, layout, orders, block_mask, block_size, rotary=None, suffix_mask=None, **_):
            if suffix_mask is not None:
                raise NotImplementedError("the study's op has no suffix_mask (the demo model has no suffix)")
            problem = _problem_from_call(q, k, v, layout, orders, block_mask, block_size, rotary)
            layer = next(calls)
            if record and layer in layers:
                captured.append((layer, problem))
            args = {key: problem[key] for key in ("layout", "orders", "block_mask", "bq", "bk")}
            return emulate(q, k, v, variant=variant, rotary=rotary, **args).to(q.dtype)
        return attention

    labels = dict((label, variant) for _, label, variant in VARIANTS)
    with apply(pipe, plan, backend="torch"):
        with attention_replaced(op(EXACT, True)):
            exact = forward()
        for label in step_variants:
            with attention_replaced(op(labels[label], False)):
                step_errors[label] = relative_error(forward(), exact)
    return captured, step_errors


# -- the study ----------------------------------------------------------------------------------------

def measure(problem: dict, variants=VARIANTS) -> dict:
    """{label: relative L2 error of the output vs the exact op} for one problem."""
    args = {key: problem[key] for key in ("layout", "orders", "block_mask", "bq", "bk")}
    q, k, v, rotary = problem["q"], problem["k"], problem["v"], problem.get("rotary")
    exact = emulate(q, k, v, variant=EXACT, rotary=rotary, **args)
    return {label: relative_error(emulate(q, k, v, variant=variant, rotary=rotary, **args), exact)
            for _, label, variant in variants}


def concat_problems(problems: list[dict]) -> dict:
    """Problems of the same layout and block sizes as one, heads side by side (for one error over several layers)."""
    first = problems[0]
    cat = {key: torch.cat([p[key] for p in problems], dim=1) for key in ("q", "k", "v")}
    cat.update(orders=torch.cat([p["orders"] for p in problems]),
               block_mask=torch.cat([p["block_mask"] for p in problems]))
    return {**first, **cat}


def run_study(args) -> dict:
    torch.manual_seed(0)
    results = {"cases": [], "step": None}
    # 1. the study's current variants are the reference, on a small problem with sparse masks and orders
    check_against_reference(gaussian_problem(64, TokenLayout(0, 4, 8, 10), 2, k_offset=2.0, sparse=True))
    layout = TokenLayout(0, args.frames, args.height, args.width)
    gaussian_cases = [
        ("Gaussian", dict()),
        ("Gaussian, K channel offset", dict(k_offset=args.offset)),
        ("Gaussian, K and V channel offsets", dict(k_offset=args.offset, v_offset=args.offset)),
    ]
    for head_dim in args.head_dims:
        for name, kwargs in gaussian_cases:
            t0 = time.perf_counter()
            problem = gaussian_problem(head_dim, layout, args.heads, seed=head_dim, **kwargs)
            check_against_reference(problem, pairs=[("int8", "fp8")])
            errors = measure(problem)
            results["cases"].append(dict(case=name, head_dim=head_dim, tokens=layout.seq_len, heads=args.heads,
                                         mask="dense", errors=errors, seconds=round(time.perf_counter() - t0, 1)))
            print(f"{name}, D={head_dim}: int8+fp8 {errors['int8 QK + fp8 PV (current)']:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.model:
        t0 = time.perf_counter()
        captured, step_errors = model_problems(tuple(args.layers), args.density, args.sigma,
                                               STEP_VARIANTS if args.step else ())
        problem = concat_problems([p for _, p in captured])
        check_against_reference(problem, pairs=[("int8", "fp8")])
        errors = measure(problem)
        q = problem["q"]
        results["cases"].append(dict(
            case=f"demo model, layers {','.join(str(layer) for layer, _ in captured)}", head_dim=q.shape[-1],
            tokens=q.shape[2], heads=q.shape[1], mask=f"shipped plan d={args.density}, sigma={args.sigma}",
            errors=errors, seconds=round(time.perf_counter() - t0, 1)))
        print(f"demo model: int8+fp8 {errors['int8 QK + fp8 PV (current)']:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if args.step:
            results["step"] = dict(what="relative L2 error of the demo model's velocity, every self-attention "
                                        "layer quantized vs every layer exact", sigma=args.sigma,
                                   density=args.density, errors=step_errors)
    return results


def table(results: dict) -> str:
    cases = results["cases"]
    head = ["variant"] + [f"{c['case']}, D={c['head_dim']}" for c in cases]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    section = None
    for sec, label, _ in VARIANTS:
        if any(label in c["errors"] for c in cases):
            if sec != section:
                lines.append(f"| **{sec}** |" + " |" * len(cases))
                section = sec
            lines.append(f"| {label} | " + " | ".join(
                f"{c['errors'][label]:.2e}" if label in c["errors"] else "" for c in cases) + " |")
    if results.get("step"):
        lines += ["", "| variant, every layer | velocity error |", "|---|---|"]
        lines += [f"| {label} | {err:.2e} |" for label, err in results["step"]["errors"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--table", type=Path, help="print the markdown table of this results JSON and exit")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: the checks and one table, in seconds")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--height", type=int, default=16)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--offset", type=float, default=3.0, help="std of the per-channel offsets, in units of "
                                                                 "the values' std")
    parser.add_argument("--no-model", dest="model", action="store_false", help="Gaussian inputs only")
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 3, 7])
    parser.add_argument("--density", type=float, default=0.5, help="the shipped plan of the demo model")
    parser.add_argument("--sigma", type=float, default=0.5, help="noise level of the captured step")
    parser.add_argument("--step", action="store_true", help="also the demo model's velocity error")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.smoke:
        args.head_dims, args.heads, args.frames, args.height, args.width = [64], 1, 2, 8, 8
        args.model = False
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    start = time.perf_counter()
    results = run_study(args)
    results["meta"] = dict(
        device=f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads",
        torch=torch.__version__, date=datetime.date.today().isoformat(), dtype="float32",
        metric="relative L2 error of the whole output vs the same op without quantization (float32)",
        args={key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        seconds=round(time.perf_counter() - start, 1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
