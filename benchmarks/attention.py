"""The full attention kernel benchmark, of which `paro bench` is the short form: SDPA (default and flash),
flex_attention with the same block mask, sageattn (if importable), FlashAttention-3 bf16 and FP8 (`--fa3`, the
optional `fa3-fwd` wheel), SageAttention2's sm90 kernel and whole call (`--sage2 CHECKOUT`, built from its source by
benchmarks/sage2_anchor.py), Sol-Attn, the calibration-free block-sparse attention of comfy-kitchen and ComfyUI, at
each density (`--sol`, benchmarks/sol_anchor.py), SpargeAttn's sm90 block-sparse call over paro's mask of each
density and over a mask of its own blocks (`--sparge CHECKOUT`, built from its source by benchmarks/sparge_anchor.py),
and paro_attention for densities x modes (`--sm90`: also the sm_90a CUDA kernel family
on the same lists, and the op as `backend="auto"` runs it), at the attention shapes of CogVideoX-5B, Wan2.1-1.3B,
Wan2.1-14B 720p and FLUX.1-dev (and a short 1024-token sequence); tile sweeps that pin the fastest config
(`--sweep`), the host time of a call (`--host`) and the markdown tables of BENCHMARKS.md (`--table ... --summary`).

    python benchmarks/attention.py [--shapes cogvideox-5b,flux.1-dev] [--sweep] [--rope] [--graph] [--fa3] [--sm90]
    python benchmarks/attention.py --table RESULTS.json [...]             # every method's table (no GPU)
    python benchmarks/attention.py --table RESULTS.json [...] --summary   # bf16 and int8+fp8 per model (no GPU)
    python benchmarks/attention.py --table RESULTS.json --anchors         # int8+fp8 beside FA3 and SageAttention2
    python benchmarks/attention.py --table RESULTS.json --leaders         # the fastest peer per model and density
    python benchmarks/attention.py --host                                 # host time per call vs CUDA-graph replay

The JSON goes to `--out`, by default benchmarks/results/.

Every method gets the same contiguous [B, H, N, D] bf16 inputs; each timing is the median of
`triton.testing.do_bench` (CUDA events, L2 flushed between repetitions) while the call rotates over
several input sets (`--graph`: the replay of a CUDA graph of such calls, for every method: GPU time
without the host's launch work, which bounds sub-millisecond shapes in eager mode). The paro time is
the whole public op call (`paroattn.paro_attention`, prologue included) with a prebuilt
`ActiveBlocks` (what a processor passes) and a per-head order mix.
flex_attention gets the same block mask (all blocks "full", in the same coordinates) on the same
tensors: the reordering paro does inside its kernel is free for flex here.
Effective TFLOP/s is the DENSE attention work 4*B*H*N^2*D over the time, so it compares methods;
the speedup is SDPA default time / time. FA3 rows time the kernel alone on inputs already laid out
[B, N, H, D] (and already e4m3 with per-(batch, head) descales of 1 for FP8), dense: the peer a dense
call would use. "paro-sm90-..." rows are the whole op call on the sm_90a CUDA kernels
(`backend="cuda"`: the same prologue, then the hand-scheduled kernel), with their
relative L2 distance to the Triton kernel's output on the first input set. `--rope` also times each paro
mode with RoPE tables handed to the op (`rotary=`, rows "paro-...-rope"): what the op's RoPE pass costs (what it
saves, the model's own RoPE code, is in benchmarks/e2e.py). `--k-scale block,token` times every integer-QK mode
with K's scales per key block and per key (rows "paro-...-ktoken", prologue rows with "k_scale"): what the
finer scales cost. The JSON records the GPU, driver, torch, triton, date
and, when run from a git checkout, the commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paroattn import paro_attention  # noqa: E402
from paroattn.app import bench  # noqa: E402
from paroattn.app.bench import LABELS, SHAPES, environment_line, input_sets, kernel_of, median_ms, read_results  # noqa: E402,E501
from paroattn.attention import decide  # noqa: E402
from paroattn.kernels import dispatch, launch, runtime  # noqa: E402
from paroattn.kernels.block_lists import ActiveBlocks  # noqa: E402
from paroattn.kernels.dispatch import Launch  # noqa: E402
from paroattn.masks import synthetic_block_mask  # noqa: E402

MODES = [("bf16", "bf16"), ("int8", "bf16"), ("int8", "fp8"), ("int8", "int8"), ("int4", "fp8")]
DENSITIES = [1.0, 0.5, 0.3, 0.2]
BLOCK = 64  # default query and key block (`--block-q`, `--block-k`: 64 or 128)
# flex's default 128-row tiles refuse a 64 x 64 BlockMask ("Q and KV block size must be divisible by
# BLOCK_M and BLOCK_N"): run() gives it tiles of the mask's blocks
# kernel configs `--sweep` tries per query block; 8 warps on 64-row tiles are left out: they lost at
# every shape they were timed on (docs/notes/kernels-and-tiles.md)
_KC = dispatch.KernelConfig


def _describe(decision) -> str:
    """What ran a row: the kernel and its launch, or why none could."""
    return decision.describe() if isinstance(decision, Launch) else f"refused: {decision.reason}"

SWEEP_CONFIGS = {
    64: [_KC(4, 2, tma=True), _KC(4, 3, tma=True), _KC(4, 4, tma=True), _KC(4, 3, overlap_qk=True),
         _KC(4, 3, tma=True, overlap_qk=True)],
    128: [_KC(4, 2, tma=True, q_tma=True), _KC(4, 3, tma=True, q_tma=True), _KC(8, 2, tma=True),
          _KC(8, 3, overlap_qk=True), _KC(4, 3), _KC(4, 4, tma=True, q_tma=True, warp_specialized=True),
          _KC(4, 3, tma=True, q_tma=True, warp_specialized=True)],
}
SWEEP_SHAPES = {64: "cogvideox-5b", 128: "wan2.1-1.3b"}  # the shape whose d=0.5 sweep pins each head dim
ROPE_ON_TEXT = {"flux.1-dev"}  # Flux rotates its text tokens too; CogVideoX only the grid after them
# what `--table ... --summary` shows: one row per model and mode, these densities
SUMMARY_SHAPES = ["cogvideox-5b", "wan2.1-1.3b", "wan2.1-14b-720p", "flux.1-dev"]
SUMMARY_MODES = [("bf16", "bf16"), ("int8", "fp8")]
SUMMARY_DENSITIES = [1.0, 0.5, 0.2]
MODE_LABELS = {("bf16", "bf16"): "bf16", ("int8", "bf16"): "int8 QK", ("int8", "fp8"): "int8 QK + fp8 PV",
               ("int8", "int8"): "int8 QK + int8 PV", ("int4", "fp8"): "int4 QK + fp8 PV"}


def _git(*args: str, env: dict | None = None, folder: Path | None = None) -> str | None:
    """git's output in `folder` (this checkout by default), or None where git fails."""
    try:
        out = subprocess.run(["git", "-C", str(folder or REPO), *args], capture_output=True, text=True, timeout=10, check=True,
                             env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def work_tree_hash() -> str | None:
    """The git tree hash of the files as they are on disk (tracked and untracked, ignored ones left out), through a
    scratch index: a copy of the code synced onto a machine whose git metadata lags says "HEAD+changes", and this
    names the commit that ran instead, as the one whose tree it is (`git log --format='%h %T'`)."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        if _git("add", "-A", "--", ".", env=env) is None:
            return None
        return _git("write-tree", env=env)


def environment() -> dict:
    """GPU, driver, torch, triton, date and the commit of the code that runs, best effort. The commit is recorded
    only when this checkout is the top level of a git work tree: a copy of the code inside another checkout (an
    exported tree on a GPU machine) would otherwise record that checkout's HEAD, which is not the code that ran."""
    env = bench.environment()
    top = _git("rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == REPO and (commit := _git("rev-parse", "--short", "HEAD")):
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        env["commit"] = commit + ("+changes" if dirty else "")
        if dirty and (tree := work_tree_hash()):
            env["tree"] = tree
    return env


def _graph_ms(fn, sets, warmup=25, rep=100) -> float:
    """Median time per call of a CUDA graph that holds two rounds of calls over the input sets, replayed
    `rep`-ish ms: what the GPU takes, without the host's launch work (`--graph`). The sets rotate as in
    `median_ms`; L2 is not flushed between calls, but the rotation spans >= 768 MB (2 sets of the
    larger shapes), which no L2 holds."""
    for args in sets:  # compiles and allocates outside the capture
        fn(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(2):
            for args in sets:
                fn(*args)
    calls = 2 * len(sets)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    stop.record()
    torch.cuda.synchronize()
    replays = max(5, min(200, int(rep / max(start.elapsed_time(stop), 1e-3))))
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    del graph
    return statistics.median(times)


def _flex(mask: torch.Tensor, N: int, block_q: int = BLOCK, block_k: int = BLOCK):
    """A compiled flex_attention and the BlockMask of `mask` (all active blocks full), or an error."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    H, nq, nk = mask.shape
    m = mask.cuda()
    counts = m.sum(-1, dtype=torch.int32)[None]
    indices = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)[None]
    block_mask = BlockMask.from_kv_blocks(
        torch.zeros_like(counts), indices, counts, indices, BLOCK_SIZE=(block_q, block_k), seq_lengths=(N, N)
    )
    compiled = torch.compile(flex_attention, dynamic=False)
    return compiled, block_mask


def _try(fn):
    try:
        return fn(), None
    except Exception as exc:  # a method that fails on a shape is reported, not fatal
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _host_overhead(call, sets, calls=200) -> dict:
    """Wall time per call with the GPU work queued behind (host-bound when the kernel is short),
    and the replay time per call of a CUDA graph of 20 calls."""
    q, k, v = sets[0]
    for _ in range(10):
        call(q, k, v)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call(q, k, v)
    torch.cuda.synchronize()
    host_us = (time.perf_counter() - start) / calls * 1e6
    graph_us = _graph_ms(call, [sets[0]] * 10) * 1e3  # a graph of 20 calls on these inputs
    return {"host_us_per_call": host_us, "cuda_graph_us_per_call": graph_us}


SM90_KERNEL = "sm90-cuda"  # the "kernel" of rows the sm_90a CUDA family ran (paroattn.kernels.sm90)
FA3_KERNEL = "flash-attention-3"
SAGE2_KERNEL_SOURCE = Path("csrc/qattn/qk_int_sv_f8_cuda_sm90.cu")  # what --sage2 builds
SPARGE_KERNEL_SOURCE = Path("csrc/qattn/qk_int_sv_f8_cuda_sm90.cuh")  # what --sparge builds (SpargeAttn's kernel)


def _fa3_methods(sets):
    """{method: (callable, its input sets)} of FlashAttention-3's forward (`fa3-fwd`: bf16 and FP8 e4m3 with
    unit descales), or {} and why not."""
    try:
        from fa3_fwd_interface import flash_attn_func
    except Exception as exc:  # optional benchmark-only dependency
        return {}, f"fa3-fwd not importable ({type(exc).__name__}); pip install fa3-fwd einops"
    bf16_sets = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in sets[:2]]
    fp8_sets = [tuple(t.to(torch.float8_e4m3fn) for t in s) for s in bf16_sets]
    B, N, H, _ = bf16_sets[0][0].shape
    ones = torch.ones(B, H, device="cuda", dtype=torch.float32)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def bf16(q, k, v):
        return first(flash_attn_func(q, k, v))

    def fp8(q, k, v):
        return first(flash_attn_func(q, k, v, q_descale=ones, k_descale=ones, v_descale=ones))

    return {"fa3-bf16": (bf16, bf16_sets), "fa3-fp8": (fp8, fp8_sets)}, None


def run(shapes=None, densities=None, modes=None, flex=True, sweep=False, out_dir=None, warmup=25, rep=100,
        block_q=BLOCK, block_k=BLOCK, tma=False, rope=False, graph=False, fa3=False, sm90=False, sage2=None,
        sol=False, sparge=None, k_scales=("block",)) -> dict:

    timer = _graph_ms if graph else median_ms

    shapes = shapes or list(SHAPES)
    densities = densities or DENSITIES
    modes = modes or MODES
    results = {
        **environment(),
        "block": [block_q, block_k],
        "tma": tma,
        "timing": "cuda-graph replay" if graph else "do_bench (eager calls, L2 flushed)",
        "fa3": fa3,
        "sm90": sm90,
        "sage2": None,
        "sol": None,
        "sparge": None,
        "k_scales": list(k_scales),
        "rows": [],
        "sweep": [],
        "prologue": [],
        "host": {},
    }
    anchor = None
    if sage2:  # its build imports the checkout's sageattention package, in place of an installed one
        import sage2_anchor

        anchor = sage2_anchor.build(sage2)
        results["sage2"] = {"checkout": str(sage2), "commit": _git_commit_of(sage2),
                            "whole_call": anchor.package is not None}
        have_sage = False
    else:
        try:
            from sageattention import sageattn  # noqa: F401

            have_sage = True
        except Exception:
            have_sage = False
    results["sageattn"] = "importable" if have_sage else "not importable"
    sparge_call = None
    if sparge:  # its build imports the checkout's spas_sage_attn package
        import sparge_anchor

        sparge_call = sparge_anchor.build(sparge)
        results["sparge"] = {"checkout": str(sparge), "commit": _git_commit_of(sparge),
                             "block": [sparge_anchor.BLOCK_Q, sparge_anchor.BLOCK_K]}
    sol_missing = None
    if sol:
        import sol_anchor

        sol_missing = sol_anchor.available()
        results["sol"] = {"comfy_kitchen": _version_of("comfy-kitchen"), "unavailable": sol_missing}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in shapes:
        B, H, layout, D = SHAPES[name]
        N = layout.seq_len
        flops = 4.0 * B * H * N * N * D
        sets = input_sets(B, H, N, D, g)
        orders_cpu = torch.randint(0, 6, (H,), generator=torch.Generator().manual_seed(1))
        nq, nk = -(-N // block_q), -(-N // block_k)
        flex_tiles = {"BLOCK_M": block_q, "BLOCK_N": block_k}
        rotated = N if name in ROPE_ON_TEXT else layout.grid_tokens
        angles = torch.rand(rotated, D // 2, device="cuda", generator=g).repeat_interleave(2, dim=-1) * 6.28
        rotary = (angles.cos(), angles.sin())

        def record(method, density, ms, error=None, **extra):
            row = {"shape": name, "B": B, "H": H, "N": N, "D": D, "method": method, "density": density,
                   "ms": ms, "error": error, **extra}
            if ms:
                row["tflops_effective"] = flops / (ms * 1e-3) / 1e12
            results["rows"].append(row)
            print(f"{name:16s} {method:22s} d={density:<4} "
                  + (f"{ms:8.3f} ms" if ms else f"failed: {error}"), flush=True)
            return row

        ms, err = _try(lambda: timer(F.scaled_dot_product_attention, sets, warmup, rep))
        record("sdpa-default", 1.0, ms, err)
        sdpa_ms = ms

        def flash(q, k, v):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        ms, err = _try(lambda: timer(flash, sets, warmup, rep))
        record("sdpa-flash", 1.0, ms, err)
        if fa3:
            methods, why = _fa3_methods(sets)
            if why:
                record("fa3", 1.0, None, why)
            for method, (fn, fa3_sets) in methods.items():
                def fa3_error(fn=fn, fa3_sets=fa3_sets):
                    out = fn(*fa3_sets[0]).float().transpose(1, 2)
                    ref = F.scaled_dot_product_attention(*sets[0]).float()
                    return float((out - ref).norm() / ref.norm())

                ms, err = _try(lambda: timer(fn, fa3_sets, warmup, rep))
                row = record(method, 1.0, ms, err, kernel=FA3_KERNEL)
                error, _ = _try(fa3_error)
                row["rel_err_vs_sdpa"] = error
                if sdpa_ms and ms:
                    row["speedup_vs_sdpa"] = sdpa_ms / ms
            methods = None
            torch.cuda.empty_cache()
        if anchor is not None:
            _time_sage2(record, timer, anchor, sets, sdpa_ms, warmup, rep)
        if have_sage:
            from sageattention import sageattn

            ms, err = _try(lambda: timer(lambda q, k, v: sageattn(q, k, v, tensor_layout="HND"), sets, warmup, rep))
            record("sageattn", 1.0, ms, err)

        if sweep and SWEEP_SHAPES.get(D) == name:
            _sweep_and_pin(results, name, layout, H, D, (block_q, block_k), orders_cpu, sets, modes, warmup, rep)
        for density in densities:
            mask = synthetic_block_mask(H, nq, nk, density, generator=torch.Generator().manual_seed(2))
            blocks = ActiveBlocks.from_mask(mask).to("cuda")
            actual = float(mask.float().mean())
            if sol and density < 1.0:
                _time_sol(record, timer, sets, density, sdpa_ms, sol_missing, warmup, rep)
            if sparge_call is not None:
                _time_sparge(record, timer, sparge_call, sets, layout, orders_cpu, mask, (block_q, block_k), density,
                             sdpa_ms, warmup, rep)
            if flex and D == 64:
                # flex_attention gave wrong results at D=64 and, at density <= 0.3, an illegal
                # memory access that kills the process: not run there
                record("flex", density, None, "skipped at D=64 (flex_attention gave wrong results / an illegal address there)")
            elif flex:
                def flex_time():
                    fa, block_mask = _flex(mask, N, block_q, block_k)
                    q, k, v = sets[0]
                    reference = paro_attention(q, k, v, layout=layout, orders=torch.zeros(H, dtype=torch.long),
                                               block_mask=blocks, block_size=(block_q, block_k), backend="triton")
                    out = fa(q, k, v, block_mask=block_mask, kernel_options=flex_tiles)
                    err = float((out.float() - reference.float()).norm() / reference.float().norm())
                    return timer(lambda q, k, v: fa(q, k, v, block_mask=block_mask, kernel_options=flex_tiles),
                                      sets, warmup, rep), err

                timed, err = _try(flex_time)
                if timed is None:
                    record("flex", density, None, err, mask_density=actual)
                else:
                    record("flex", density, timed[0], None, mask_density=actual, rel_err_vs_paro_bf16=timed[1])
            for qk, pv in modes:
                if tma:
                    config = runtime.kernel_config(D, block_q, block_k, qk, pv)
                    runtime.set_kernel_config(D, block_q, block_k, qk, pv, dataclasses.replace(config, tma=True))

                variants = [("", None)] + ([("-rope", rotary)] if rope else [])
                for k_scale in mode_k_scales(qk, k_scales):
                    for suffix, tables in variants:
                        def paro(q, k, v, qk=qk, pv=pv, tables=tables, k_scale=k_scale):
                            return paro_attention(q, k, v, layout=layout, orders=orders_cpu, block_mask=blocks, qk=qk,
                                                  pv=pv, block_size=(block_q, block_k), backend="triton",
                                                  rotary=tables, k_scale=k_scale)

                        ms, err = _try(lambda: timer(paro, sets, warmup, rep))
                        decision = decide(sets[0][0], block_q, block_k, qk, pv, "triton", rotary=tables is not None,
                                          k_scale=k_scale)
                        row = record(f"paro-{qk}-{pv}{k_scale_suffix(k_scale)}{suffix}", density, ms, err,
                                     mask_density=actual, kernel=getattr(decision, "kernel", None),
                                     launch=_describe(decision), k_scale=k_scale,
                                     config=vars(runtime.kernel_config(D, block_q, block_k, qk, pv)))
                        if sdpa_ms and ms:
                            row["speedup_vs_sdpa"] = sdpa_ms / ms
                    if sm90:
                        _time_sm90(record, timer, sets, layout, orders_cpu, blocks, (block_q, block_k), qk, pv,
                                   density, actual, sdpa_ms, warmup, rep, k_scale)
                        _time_auto(record, timer, sets, layout, orders_cpu, blocks, (block_q, block_k), qk, pv,
                                   density, actual, sdpa_ms, warmup, rep, k_scale)
        # the prologue alone (statistics + K/V prologue kernel), per quantized mode
        orders_dev = orders_cpu.to("cuda", torch.int32)
        for (qk, pv), k_scale in ((mode, k_scale) for mode in modes for k_scale in mode_k_scales(mode[0], k_scales)):
            q0 = sets[0][0]  # the op's output is laid out like q
            decision = decide(q0, block_q, block_k, qk, pv, "triton", k_scale=k_scale)
            with_q = isinstance(decision, Launch) and decision.q_tma

            def prologue(q, k, v, qk=qk, pv=pv, with_q=with_q, k_scale=k_scale):
                buffers = runtime.allocate(*k.shape, k.dtype, k.device, block_q, block_k, qk, pv, with_q,
                                           k_scale=k_scale)
                return launch.prepare_kv(k, v, orders_dev, layout.prefix, layout.frames, layout.height, layout.width,
                                         block_k, qk, pv, buffers, q if with_q else None, block_q, k_scale=k_scale)

            ms, err = _try(lambda: timer(prologue, sets, warmup, rep))
            results["prologue"].append({"shape": name, "qk": qk, "pv": pv, "k_scale": k_scale, "ms": ms, "error": err})
            print(f"{name:16s} prologue {qk}/{pv} k_scale={k_scale}: {ms} {err or ''}", flush=True)
        if name == "short":
            mask = synthetic_block_mask(H, nq, nk, 0.5, generator=torch.Generator().manual_seed(2))
            blocks = ActiveBlocks.from_mask(mask).to("cuda")

            def paro_short(q, k, v, qk="int8", pv="fp8"):
                return paro_attention(q, k, v, layout=layout, orders=orders_cpu, block_mask=blocks, qk=qk,
                                      pv=pv, block_size=(block_q, block_k), backend="triton")

            host, err = _try(lambda: _host_overhead(paro_short, sets))
            results["host"] = host or {"error": err}
            # bf16 too: at 128 x 64 blocks on Hopper it is the warp-specialized Gluon kernel, another launcher
            host, err = _try(lambda: _host_overhead(functools.partial(paro_short, qk="bf16", pv="bf16"), sets))
            results["host_bf16"] = host or {"error": err}
            sdpa_host, err = _try(lambda: _host_overhead(F.scaled_dot_product_attention, sets))
            results["host_sdpa"] = sdpa_host or {"error": err}
            print(f"host overhead (short, d=0.5): int8/fp8 {results['host']}; bf16 {results['host_bf16']}; "
                  f"sdpa: {results['host_sdpa']}")
        sets = None  # free this shape's inputs before the next (closures above still name it)
        torch.cuda.empty_cache()
        _write(results, out_dir)  # after every shape, so a run cut short still leaves its numbers

    print()
    print(format_table(results))
    path = _write(results, out_dir)
    if path:
        print(f"wrote {path}")
    return results


def mode_k_scales(qk: str, k_scales) -> tuple[str, ...]:
    """The K scale granularities timed for a mode: those asked for with integer QK (none differ without it)."""
    return tuple(k_scales) if qk != "bf16" else ("block",)


def k_scale_suffix(k_scale: str) -> str:
    """What a row's method adds for its K scales: nothing per key block (the rows as before), "-ktoken" per key."""
    return "" if k_scale == "block" else f"-k{k_scale}"


def _time_sm90(record, timer, sets, layout, orders, blocks, block, qk, pv, density, actual, sdpa_ms, warmup, rep,
               k_scale="block"):
    """One "paro-sm90-{qk}-{pv}" row: the whole op call on the sm_90a CUDA kernels, or the reason they could
    not be built; none for modes the family refuses."""
    from paroattn.kernels import sm90

    method = f"paro-sm90-{qk}-{pv}{k_scale_suffix(k_scale)}"
    q0 = sets[0][0]
    B, H, N, D = q0.shape
    refused = sm90.refusal(q0.shape, q0.dtype, D, *block, qk, pv, False, torch.cuda.get_device_capability())
    if refused:  # a mode or tiling the family does not take: no row
        print(f"{method}: {refused}")
        return
    reason = runtime.runtime_of(q0.device).build_cuda_kernel(D, q0.dtype, k_scale)
    if reason:
        record(method, density, None, reason, mask_density=actual, k_scale=k_scale)
        return

    def paro(q, k, v):
        return paro_attention(q, k, v, layout=layout, orders=orders, block_mask=blocks, qk=qk, pv=pv,
                              block_size=block, backend="cuda", k_scale=k_scale)

    def error_vs_triton():
        q, k, v = sets[0]
        triton_out = paro_attention(q, k, v, layout=layout, orders=orders, block_mask=blocks, qk=qk, pv=pv,
                                    block_size=block, backend="triton", k_scale=k_scale).float()
        return float((paro(q, k, v).float() - triton_out).norm() / triton_out.norm())

    ms, err = _try(lambda: timer(paro, sets, warmup, rep))
    row = record(method, density, ms, err, mask_density=actual, kernel=SM90_KERNEL, k_scale=k_scale)
    row["rel_err_vs_triton"], _ = _try(error_vs_triton)
    if sdpa_ms and ms:
        row["speedup_vs_sdpa"] = sdpa_ms / ms


def _time_auto(record, timer, sets, layout, orders, blocks, block, qk, pv, density, actual, sdpa_ms, warmup, rep,
               k_scale="block"):
    """One "paro-auto-{qk}-{pv}" row: the op call as a user makes it (`backend="auto"`), the kernel the runtime
    decides for it, and which explicit backend's output it reproduces bit for bit (what actually ran)."""
    method = f"paro-auto-{qk}-{pv}{k_scale_suffix(k_scale)}"

    def paro(q, k, v, backend="auto"):
        return paro_attention(q, k, v, layout=layout, orders=orders, block_mask=blocks, qk=qk, pv=pv,
                              block_size=block, backend=backend, k_scale=k_scale)

    def ran():
        q, k, v = sets[0]
        auto = paro(q, k, v)
        for backend in ("cuda", "triton"):
            explicit, _ = _try(lambda backend=backend: paro(q, k, v, backend))
            if explicit is not None and torch.equal(auto, explicit):
                return backend
        return "neither"

    decision = decide(sets[0][0], *block, qk, pv, "auto", k_scale=k_scale)
    ms, err = _try(lambda: timer(paro, sets, warmup, rep))
    row = record(method, density, ms, err, mask_density=actual, kernel=getattr(decision, "kernel", None),
                 launch=_describe(decision), k_scale=k_scale)
    row["same_output_as"], _ = _try(ran)
    if sdpa_ms and ms:
        row["speedup_vs_sdpa"] = sdpa_ms / ms


def _time_sol(record, timer, sets, density, sdpa_ms, missing, warmup, rep):
    """Two rows at top-k `density`: "sol-attn" (with its pooled tail, as ComfyUI's node runs it) and
    "sol-attn-notail", each timed on inputs already laid out (B, T, H, D) as its kernels take them (as FA3's rows),
    with the fraction of blocks it computed exactly on the first input set and its distance to SDPA's output."""
    import sol_anchor

    D = sets[0][0].shape[-1]
    if missing:
        record("sol-attn", density, None, missing)
        return
    if D != 128:
        for method in ("sol-attn", "sol-attn-notail"):
            record(method, density, None, f"Sol-Attn's kernels take head dim 128 only, not {D}", unsupported=True)
        return
    sol_sets = [tuple(t.transpose(1, 2).contiguous() for t in s) for s in sets[:2]]
    reference = F.scaled_dot_product_attention(*sets[0]).float()
    exact = sol_anchor.exact_block_density(sol_sets[0][0], sol_sets[0][1], density)
    for method, tail in (("sol-attn", True), ("sol-attn-notail", False)):
        fn = sol_anchor.call(density, tail)
        ms, err = _try(lambda fn=fn: timer(fn, sol_sets, warmup, rep))
        row = record(method, density, ms, err, kernel="comfy-kitchen-sol-attn", exact_block_density=exact)
        row["rel_err_vs_sdpa"], _ = _try(
            lambda fn=fn: float((fn(*sol_sets[0]).float().transpose(1, 2) - reference).norm() / reference.norm()))
        if sdpa_ms and ms:
            row["speedup_vs_sdpa"] = sdpa_ms / ms
    sol_sets = None
    torch.cuda.empty_cache()


def _time_sparge(record, timer, anchor, sets, layout, orders, mask, block, density, sdpa_ms, warmup, rep):
    """SpargeAttn's whole call (`sparge_anchor.Sparge.whole_call`: its quantization, its lists from the mask, its
    kernel), two rows per density:
    - "sparge-sm90": over paro's mask of the row as its 64 x 128 blocks (`sparge_anchor.from_paro_mask`: every block
      holding an active pair of paro's, so it computes at least what paro computes; `mask_density` is the fraction of
      its blocks), on the inputs as they are: the per-head reordering paro does in its kernel is free for it here;
    - "sparge-sm90-own" (d < 1): over a mask drawn at its own blocks with the row's density, as paro's is drawn at
      paro's: the same number of query-key pairs as paro's row.
    Each with its distance to the same block-sparse attention in bf16 (paro's Triton kernel at 64 x 128 blocks over
    the same mask, on the same reordered tokens), so a mask it read in other coordinates shows."""
    import sparge_anchor

    B, H, N, _ = sets[0][0].shape
    variants = [("sparge-sm90", sparge_anchor.from_paro_mask(mask, block, N, B), orders)]
    if density < 1.0:
        own = synthetic_block_mask(H, -(-N // sparge_anchor.BLOCK_Q), -(-N // sparge_anchor.BLOCK_K), density,
                                   generator=torch.Generator().manual_seed(2))
        variants.append(("sparge-sm90-own", own.expand(B, -1, -1, -1).contiguous(), torch.zeros(H, dtype=torch.long)))
    for method, block_map, head_orders in variants:
        block_map = block_map.cuda()

        def call(q, k, v, block_map=block_map):
            return anchor.whole_call(q, k, v, block_map)

        def distance(block_map=block_map, head_orders=head_orders):
            q, k, v = sets[0]
            reference = paro_attention(q, k, v, layout=layout, orders=head_orders, block_mask=block_map[0],
                                       block_size=(sparge_anchor.BLOCK_Q, sparge_anchor.BLOCK_K),
                                       backend="triton").float()
            out = sparge_anchor.on_reordered_tokens(anchor.whole_call, q, k, v, layout, head_orders, block_map)
            return float((out.float() - reference).norm() / reference.norm())

        ms, err = _try(lambda call=call: timer(call, sets, warmup, rep))
        row = record(method, density, ms, err, kernel="spargeattn-sm90", mask_density=float(block_map.float().mean()))
        row["rel_err_vs_reference"], _ = _try(distance)
        if sdpa_ms and ms:
            row["speedup_vs_sdpa"] = sdpa_ms / ms
    torch.cuda.empty_cache()


def _version_of(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _time_sage2(record, timer, anchor, sets, sdpa_ms, warmup, rep):
    """SageAttention2's sm90 path, dense: "sage2-sm90-kernel" (its kernel alone on inputs quantized outside the
    timing) and "sage2-sm90" (its whole call, quantization included), each with its distance to SDPA's output."""
    reference = F.scaled_dot_product_attention(*sets[0]).float()

    def distance(out):
        return float((out.float() - reference).norm() / reference.norm())

    calls = [anchor.kernel_call(*args) for args in sets]
    fn, kernel_sets = calls[0][0], [args for _, args in calls]
    ms, err = _try(lambda: timer(fn, kernel_sets, warmup, rep))
    row = record("sage2-sm90-kernel", 1.0, ms, err, kernel="sageattention2-sm90")
    row["rel_err_vs_sdpa"], _ = _try(lambda: distance(fn(*kernel_sets[0])))
    if sdpa_ms and ms:
        row["speedup_vs_sdpa"] = sdpa_ms / ms
    calls = kernel_sets = None
    torch.cuda.empty_cache()
    if anchor.package is None:
        return
    ms, err = _try(lambda: timer(anchor.whole_call, sets, warmup, rep))
    row = record("sage2-sm90", 1.0, ms, err, kernel="sageattention2-sm90")
    row["rel_err_vs_sdpa"], _ = _try(lambda: distance(anchor.whole_call(*sets[0])))
    if sdpa_ms and ms:
        row["speedup_vs_sdpa"] = sdpa_ms / ms


def _git_commit_of(folder) -> str | None:
    """The commit of a checkout that is its own git work tree; None for an exported copy (inside another work tree
    git would name that tree's commit)."""
    top = _git("rev-parse", "--show-toplevel", folder=folder)
    if top is None or Path(top).resolve() != Path(folder).resolve():
        return None
    return _git("rev-parse", "HEAD", folder=folder)


def _write(results: dict, out_dir) -> Path | None:
    if out_dir is None:
        return None
    slug = re.sub(r"[^a-z0-9]+", "-", results["gpu"].lower()).strip("-")
    block_q, block_k = results["block"] if isinstance(results["block"], list) else (results["block"],) * 2
    suffix = "" if block_q == block_k == BLOCK else f"-bq{block_q}-bk{block_k}"
    suffix += "-tma" if results.get("tma") else ""
    suffix += "-graph" if results.get("timing", "").startswith("cuda-graph") else ""
    suffix += "-sm90-cuda" if results.get("sm90") else ""
    suffix += "-fa3" if results.get("fa3") else ""
    suffix += "-sage2" if results.get("sage2") else ""
    suffix += "-sol" if results.get("sol") else ""
    suffix += "-sparge" if results.get("sparge") else ""
    path = Path(out_dir) / f"attention-{slug}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    return path


def _sweep_and_pin(results, name, layout, H, D, block_size, orders_cpu, sets, modes, warmup, rep) -> None:
    """Time each mode at d=0.5 under every SWEEP_CONFIGS entry and pin the fastest for this head dim
    (for every shape of the run); the pinned configs are recorded with each row."""
    bq, bk = block_size
    n = layout.seq_len
    mask = synthetic_block_mask(H, -(-n // bq), -(-n // bk), 0.5, generator=torch.Generator().manual_seed(2))
    blocks = ActiveBlocks.from_mask(mask).to("cuda")
    for qk, pv in modes:
        def paro(q, k, v, qk=qk, pv=pv):
            return paro_attention(q, k, v, layout=layout, orders=orders_cpu, block_mask=blocks, qk=qk, pv=pv,
                                  block_size=block_size, backend="triton")

        best = None
        for config in SWEEP_CONFIGS[bq]:
            if dispatch.config_problem(config, bq, bk, qk, pv):
                continue
            runtime.set_kernel_config(D, bq, bk, qk, pv, config)
            ms, err = _try(lambda: median_ms(paro, sets, warmup, rep))
            results["sweep"].append({"shape": name, "D": D, "qk": qk, "pv": pv, **vars(config), "ms": ms, "error": err})
            print(f"  sweep {name} {qk}/{pv} {config}: {ms} {err or ''}", flush=True)
            if ms and (best is None or ms < best[0]):
                best = (ms, config)
        runtime.set_kernel_config(D, bq, bk, qk, pv, best[1] if best else None)


HOST_CASES = {"short": (0.5, 1000), "flux.1-dev": (0.2, 300)}  # shape: (density, calls per timing)
HOST_WAYS = ("lists", "lists + RoPE", "bool mask on the GPU", "bool mask on the host")


def wall_us(call, calls: int) -> float:
    """Wall time per call of `calls` calls back to back, the GPU work queued behind them: the host's
    launch work where it is longer than the GPU's (best of 3)."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def host_us(call, calls: int = 100) -> float:
    """Host time per call alone: `calls` calls issued once the GPU is idle and timed without waiting for
    it. Their launches (1-4 per call) fit in CUDA's launch queue, so the host never waits for the GPU and
    the time is the host's whatever the GPU's (best of 5)."""
    for _ in range(20):
        call()
    best = math.inf
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def host_inputs(name: str, density: float, generator: torch.Generator):
    """The inputs of the host-time measurements at shape `name`: its layout, bf16 q, k, v on the GPU (drawn
    from `generator`), a synthetic bool mask of 128 x 64 blocks at `density` (on the host), random orders per
    head and RoPE tables (drawn from `generator`)."""
    B, H, layout, D = SHAPES[name]
    N = layout.seq_len
    qkv = tuple(torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3))
    mask = synthetic_block_mask(H, -(-N // 128), -(-N // 64), density, generator=torch.Generator().manual_seed(2))
    orders = torch.randint(0, 6, (H,), generator=torch.Generator().manual_seed(1)).to(torch.int32).cuda()
    angles = torch.rand(layout.grid_tokens, D // 2, device="cuda", generator=generator).repeat_interleave(2, dim=-1)
    return layout, qkv, mask, orders, (angles.cos(), angles.sin())


def host_times(out_dir=None) -> dict:
    """Eager wall time per call back to back vs the replay of a CUDA graph of the same calls (GPU time
    alone), for paro bf16 and int8 QK + fp8 PV at 128 x 64 blocks given active-block lists (with and
    without RoPE tables) or a bool mask (on the GPU or on the host), and for SDPA: the short shape
    (d=0.5, host-bound) and FLUX.1-dev (d=0.2)."""

    results = {**environment(), "block": [128, 64], "host_rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (density, calls) in HOST_CASES.items():
        layout, (q, k, v), mask, orders, rotary = host_inputs(name, density, g)
        blocks, mask_gpu = ActiveBlocks.from_mask(mask).to("cuda"), mask.cuda()
        for qk, pv in (("bf16", "bf16"), ("int8", "fp8")):
            kw = dict(layout=layout, orders=orders, block_size=(128, 64), qk=qk, pv=pv)
            ways = {"lists": dict(block_mask=blocks), "lists + RoPE": dict(block_mask=blocks, rotary=rotary),
                    "bool mask on the GPU": dict(block_mask=mask_gpu), "bool mask on the host": dict(block_mask=mask)}
            row = {"shape": name, "density": density, "qk": qk, "pv": pv}
            for way, extra in ways.items():
                row[way] = wall_us(lambda extra=extra: paro_attention(q, k, v, **kw, **extra), calls)
            row["host only"] = host_us(lambda: paro_attention(q, k, v, block_mask=blocks, **kw))
            row["cuda graph"] = _graph_ms(lambda q, k, v: paro_attention(q, k, v, block_mask=blocks, **kw),
                                          [(q, k, v)]) * 1e3
            results["host_rows"].append(row)
            print(row, flush=True)
        results["host_rows"].append({"shape": name, "density": density, "qk": "sdpa", "pv": "",
                                     "lists": wall_us(lambda: F.scaled_dot_product_attention(q, k, v), calls),
                                     "host only": host_us(lambda: F.scaled_dot_product_attention(q, k, v)),
                                     "cuda graph": _graph_ms(F.scaled_dot_product_attention, [(q, k, v)]) * 1e3})
    if out_dir is not None:
        slug = re.sub(r"[^a-z0-9]+", "-", results["gpu"].lower()).strip("-")
        path = Path(out_dir) / f"host-{slug}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
        print(f"wrote {path}")
    print(host_table(results))
    return results


def host_table(results: dict) -> str:
    """The host-time rows of a `--host` results file, us per call."""
    lines = [environment_line({**results, "timing": "wall time per call back to back vs CUDA-graph replay; "
                                                     "host alone (lists)"}), "",
             "| shape, d | mode | " + " | ".join(HOST_WAYS) + " | CUDA graph replay | host alone, lists |",
             "|---" * 8 + "|"]
    for r in results["host_rows"]:
        mode = "SDPA" if r["qk"] == "sdpa" else MODE_LABELS.get((r["qk"], r["pv"]), f"{r['qk']}+{r['pv']}")
        cells = [f"{r[way]:.0f} us" if way in r else "" for way in HOST_WAYS]
        host = f"{r['host only']:.0f} us" if "host only" in r else "not measured"
        lines.append(f"| {LABELS.get(r['shape'], r['shape'])}, {r['density']} | {mode} | " + " | ".join(cells)
                     + f" | {r['cuda graph']:.0f} us | {host} |")
    return "\n".join(lines)


def format_table(results: dict) -> str:
    lines = [f"GPU: {results['gpu']}  torch {results['torch']}  triton {results['triton']}  {results['date']}",
             "| shape | method | density | ms | eff. TFLOP/s | speedup vs SDPA default |",
             "|---|---|---|---|---|---|"]
    sdpa = {r["shape"]: r["ms"] for r in results["rows"] if r["method"] == "sdpa-default" and r["ms"]}
    for r in results["rows"]:
        if r["ms"]:
            speed = f"{sdpa[r['shape']] / r['ms']:.2f}x" if r["shape"] in sdpa else "-"
            lines.append(f"| {r['shape']} | {r['method']} | {r['density']} | {r['ms']:.3f} | "
                         f"{r.get('tflops_effective', 0):.0f} | {speed} |")
        else:
            lines.append(f"| {r['shape']} | {r['method']} | {r['density']} | failed: {r['error']} | | |")
    for p in results["prologue"]:
        if p["ms"]:
            lines.append(f"prologue {p['shape']} {p['qk']}/{p['pv']}{k_scale_suffix(p.get('k_scale', 'block'))}: "
                         f"{p['ms']:.3f} ms")
    if results.get("host"):
        lines.append(f"host overhead (short shape): paro int8+fp8 {results['host']}, bf16 {results.get('host_bf16')}, "
                     f"sdpa {results.get('host_sdpa')}")
    return "\n".join(lines)


def markdown_tables(results: dict) -> str:
    """Per shape: one row per method, ms and speedup over SDPA default for each density."""
    out = []
    densities = sorted({r["density"] for r in results["rows"] if r["method"].startswith("paro")}, reverse=True)
    for shape in dict.fromkeys(r["shape"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["shape"] == shape]
        first = rows[0]
        sdpa = next((r["ms"] for r in rows if r["method"] == "sdpa-default"), None)
        out.append(f"**{shape}** (B, H, N, D) = ({first['B']}, {first['H']}, {first['N']}, {first['D']}); "
                   "ms (speedup vs SDPA default)\n")
        out.append("| method | " + " | ".join(f"d={d}" for d in densities) + " |")
        out.append("|---" * (len(densities) + 1) + "|")
        for method in dict.fromkeys(r["method"] for r in rows):
            cells = []
            for d in densities:
                r = next((x for x in rows if x["method"] == method and x["density"] == d), None)
                if r is None and method.startswith("sdpa") and d == 1.0:
                    r = next((x for x in rows if x["method"] == method), None)
                if r is None:
                    cells.append("")
                elif r["ms"]:
                    cells.append(f"{r['ms']:.3f} ({sdpa / r['ms']:.2f}x)" if sdpa else f"{r['ms']:.3f}")
                else:
                    cells.append("n/a")
            out.append(f"| {method} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def summary_table(results: dict, shapes=None, modes=None, densities=None) -> str:
    """One row per (shape, mode): the op's time and its speedup over SDPA default at each density, and
    the prologue's share of it; then the host time per call where the file measured it."""
    shapes = [s for s in (shapes or SUMMARY_SHAPES) if any(r["shape"] == s for r in results["rows"])]
    modes, densities = modes or SUMMARY_MODES, densities or SUMMARY_DENSITIES
    lines = [environment_line(results), "",
             "| model (B, H, N, D) | SDPA default | paro mode | kernel | " + " | ".join(f"d={d}" for d in densities)
             + " | of which prologue |",
             "|---" * (len(densities) + 5) + "|"]
    for shape in shapes:
        rows = [r for r in results["rows"] if r["shape"] == shape]
        sdpa = next((r["ms"] for r in rows if r["method"] == "sdpa-default" and r["ms"]), None)
        first = rows[0]
        head = [f"{LABELS.get(shape, shape)} ({first['B']}, {first['H']}, {first['N']}, {first['D']})",
                f"{_ms(sdpa)} ms" if sdpa else "n/a"]
        methods = [(f"paro-{qk}-{pv}", MODE_LABELS.get((qk, pv), f"{qk}+{pv}"), (qk, pv)) for qk, pv in modes]
        methods += [(f"paro-sm90-{qk}-{pv}", MODE_LABELS.get((qk, pv), f"{qk}+{pv}"), None)
                    for qk, pv in modes if any(r["method"] == f"paro-sm90-{qk}-{pv}" for r in rows)]
        methods += [(m, label, None) for m, label in (("fa3-bf16", "bf16 (dense)"), ("fa3-fp8", "FP8 (dense)"))
                    if any(r["method"] == m for r in rows)]
        for method, label, mode in methods:
            cells = []
            kernels = sorted({kernel_of(r) for r in rows if r["method"] == method})
            for d in densities:
                r = next((x for x in rows if x["method"] == method and x["density"] == d), None)
                if r is None:
                    cells.append("")
                elif not r["ms"]:
                    cells.append("failed")
                else:
                    cells.append(f"{_ms(r['ms'])} ms, {sdpa / r['ms']:.2f}x" if sdpa else f"{_ms(r['ms'])} ms")
            prologue = next((p["ms"] for p in results.get("prologue", [])
                             if p["shape"] == shape and (p["qk"], p["pv"]) == mode and p["ms"]), None)
            lines.append(f"| {' | '.join(head)} | {label} | {', '.join(kernels)} | " + " | ".join(cells)
                         + f" | {f'{prologue:.3f} ms' if prologue else ''} |")
            head = ["", ""]
    host, host_bf16, host_sdpa = (results.get(k) or {} for k in ("host", "host_bf16", "host_sdpa"))
    if "host_us_per_call" in host and "host_us_per_call" in host_sdpa:
        def us(entry, key):
            return f"{entry[key]:.0f}" if key in entry else "-"

        lines += ["", "Host time per call, short shape, d=0.5 (paro bf16 / int8 QK + fp8 PV / SDPA): eager "
                  f"{us(host_bf16, 'host_us_per_call')} / {us(host, 'host_us_per_call')} / "
                  f"{us(host_sdpa, 'host_us_per_call')} us; replayed from a CUDA graph "
                  f"{us(host_bf16, 'cuda_graph_us_per_call')} / {us(host, 'cuda_graph_us_per_call')} / "
                  f"{us(host_sdpa, 'cuda_graph_us_per_call')} us."]
    return "\n".join(lines)


def anchor_table(results: dict, shapes=None, mode=("int8", "fp8")) -> str:
    """Per model, speedups over SDPA default (cuDNN) of the dense anchors (FA3 bf16 and FP8, SageAttention2's
    kernel alone and its whole call; those the file has), of Sol-Attn at top-k = each density below 1 and of
    SpargeAttn over paro's mask (each density) and over its own (each density below 1) where the file has them ("n/a"
    where one does not take the shape), and of paro's `mode` on the Triton kernel, on the sm_90a CUDA kernel and as
    `backend="auto"` runs it (with the kernel it ran), at each density of the file: the op table beside its peers."""
    shapes = [s for s in (shapes or SUMMARY_SHAPES) if any(r["shape"] == s for r in results["rows"])]
    qk, pv = mode
    paro_methods = [(f"paro-{qk}-{pv}", "paro Triton"), (f"paro-sm90-{qk}-{pv}", "paro CUDA"),
                    (f"paro-auto-{qk}-{pv}", "paro auto")]
    densities = sorted({r["density"] for r in results["rows"] if r["method"] == paro_methods[0][0]}, reverse=True)
    timed = {r["method"] for r in results["rows"]}
    # a peer's columns where the file timed any of its methods ("not run" for the others)
    peers = [[("fa3-bf16", "FA3 bf16"), ("fa3-fp8", "FA3 FP8")],
             [("sage2-sm90-kernel", "SageAttention2 kernel"), ("sage2-sm90", "SageAttention2 call")]]
    anchors = [column for peer in peers if timed & {method for method, _ in peer} for column in peer]
    at = " / ".join(f"d={d:g}" for d in densities)
    # a sparse peer's columns at the densities it runs (SpargeAttn over paro's mask at d = 1 too: all blocks)
    sparse = [(method, label, [d for d in densities if d < 1.0 or method == "sparge-sm90"])
              for method, label in (("sol-attn", "Sol-Attn"), ("sol-attn-notail", "Sol-Attn, no tail"),
                                    ("sparge-sm90", "SpargeAttn, paro's mask"), ("sparge-sm90-own", "SpargeAttn, own mask"))
              if method in timed]
    columns = (["model", "SDPA default"] + [label for _, label in anchors]
               + [f"{label}: " + " / ".join(f"d={d:g}" for d in ds) for _, label, ds in sparse]
               + [f"{label}: {at}" for _, label in paro_methods] + ["auto ran"])
    lines = [environment_line(results), "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for shape in shapes:
        rows = [r for r in results["rows"] if r["shape"] == shape]
        sdpa = next((r["ms"] for r in rows if r["method"] == "sdpa-default" and r["ms"]), None)

        def speedup(method, density=1.0, rows=rows, sdpa=sdpa):
            r = next((x for x in rows if x["method"] == method and x["density"] == density), None)
            if r is None:
                return "not run"
            if r.get("unsupported"):
                return "n/a"
            return f"{sdpa / r['ms']:.2f}x" if r["ms"] and sdpa else "failed"

        cells = [LABELS.get(shape, shape), f"{_ms(sdpa)} ms" if sdpa else "n/a"]
        cells += [speedup(method) for method, _ in anchors]
        cells += [" / ".join(speedup(method, d) for d in ds) for method, _, ds in sparse]
        cells += [" / ".join(speedup(method, d) for d in densities) for method, _ in paro_methods]
        auto = [r for r in rows if r["method"] == paro_methods[2][0]]
        ran = sorted({f"{kernel_of(r)}, output equal to backend='{r['same_output_as']}'"
                      if r.get("same_output_as") in ("cuda", "triton") else kernel_of(r) for r in auto})
        cells.append(", ".join(ran) if ran else "not run")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The peers of the leaders table: (name, dense, its rows as (method, variant)). A peer's cell is its fastest row at the
# density; a dense peer's d = 1 rows stand at every density (dense attention computes any sparse one).
LEADER_PEERS = [
    ("cuDNN", True, [("sdpa-default", "")]),
    ("FA3", True, [("fa3-bf16", "bf16"), ("fa3-fp8", "FP8")]),
    ("SageAttention2", True, [("sage2-sm90", "")]),
    ("Sol-Attn", False, [("sol-attn", "tail"), ("sol-attn-notail", "no tail")]),
    ("SpargeAttn", False, [("sparge-sm90", "paro's mask"), ("sparge-sm90-own", "own mask")]),
    ("PARO", False, [("paro-auto-{qk}-{pv}", "")]),
]


def leader_table(results: dict, shapes=None, mode=("int8", "fp8")) -> str:
    """Per model and density of paro's `backend="auto"` rows in `mode`: each peer's time (its fastest row there, named
    by variant where it has several; SpargeAttn over paro's mask with the fraction of its blocks that covers) and the
    peer that leads, by how much over the next. Whole calls, but for FA3: its kernel alone on inputs already laid out
    (its rows). "n/a": the peer does not take the shape; "-": the peer has rows at other densities only; "not run": none
    in the file; "failed": it ran and failed."""
    qk, pv = mode
    shapes = [s for s in (shapes or SUMMARY_SHAPES) if any(r["shape"] == s for r in results["rows"])]
    densities = sorted({r["density"] for r in results["rows"] if r["method"] == f"paro-auto-{qk}-{pv}"}, reverse=True)
    lines = [environment_line(results), "", "| model | d | " + " | ".join(name for name, _, _ in LEADER_PEERS)
             + " | leads |", "|---" * (len(LEADER_PEERS) + 3) + "|"]
    for shape in shapes:
        rows = [r for r in results["rows"] if r["shape"] == shape]
        for d in densities:
            cells, timed = [], []
            for name, dense, variants in LEADER_PEERS:
                methods = {method.format(qk=qk, pv=pv): variant for method, variant in variants}
                found = [r for r in rows if r["method"] in methods]
                here = [r for r in found if r["density"] == (1.0 if dense else d)]
                ran = [r for r in here if r["ms"]]
                if ran:
                    best = min(ran, key=lambda r: r["ms"])
                    label = name + (f" ({methods[best['method']]})" if len(variants) > 1 else "")
                    cover = (f", {best['mask_density']:.2f} of its blocks"
                             if best["method"] == "sparge-sm90" and d < 1.0 and "mask_density" in best else "")
                    cells.append(f"{_ms(best['ms'])} ms" + (f" ({methods[best['method']]}{cover})"
                                                             if len(variants) > 1 else ""))
                    timed.append((best["ms"], label))
                elif any(r.get("unsupported") for r in found):
                    cells.append("n/a")
                else:
                    cells.append("failed" if here else "-" if found else "not run")
            timed.sort(key=lambda t: t[0])
            lead = (f"{timed[0][1]}, {timed[1][0] / timed[0][0]:.2f}x ahead of {timed[1][1]}" if len(timed) > 1
                    else timed[0][1] if timed else "none timed")
            lines.append(f"| {LABELS.get(shape, shape)} | {d:g} | " + " | ".join(cells) + f" | {lead} |")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (`error: <prog>: ...`) with exit code 2."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message}\n")


def _comma_list(text: str | None, parse, option: str, example: str) -> list | None:
    if not text:
        return None
    try:
        return [parse(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{option} {text!r}: {exc}; e.g. {option} {example}") from None


def _shape(name: str) -> str:
    if name not in SHAPES:
        raise ValueError(f"{name!r} is not one of {', '.join(SHAPES)}")
    return name


def _density(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{value} is not a density in (0, 1]")
    return value


def _mode(text: str) -> tuple[str, str]:
    from paroattn.modes import PV_MODES, QK_MODES, modes_problem

    parts = tuple(text.split("+"))
    if len(parts) != 2 or modes_problem(*parts):
        raise ValueError(f"{text!r} is not a qk+pv pair such as int8+fp8 (qk: {', '.join(QK_MODES)}; pv: "
                         f"{', '.join(PV_MODES)})")
    return parts


def _k_scale(text: str) -> str:
    from paroattn.modes import K_SCALES, k_scale_problem

    if k_scale_problem(text):
        raise ValueError(f"{text!r} is not one of {', '.join(K_SCALES)}")
    return text


def parse_arguments(argv=None) -> argparse.Namespace:
    """The benchmark's options, every one checked (names, ranges, files) before any GPU work; a bad one
    exits with one line and code 2."""
    parser = _Parser(prog="benchmarks/attention.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shapes", default=None, help=f"comma list of {list(SHAPES)} (default: all; "
                        f"with --summary: {','.join(SUMMARY_SHAPES)})")
    parser.add_argument("--densities", default=None, help=f"comma list (default: {','.join(map(str, DENSITIES))}; "
                        f"with --summary: {','.join(map(str, SUMMARY_DENSITIES))})")
    parser.add_argument("--modes", default=None, help="qk+pv pairs, comma list (default: all five; with --summary: "
                        "bf16+bf16,int8+fp8)")
    parser.add_argument("--k-scale", default="block",
                        help="K scale granularities of the integer-QK modes, comma list of block, token (default: "
                        "block; block,token times both: rows of token are named paro-...-ktoken)")
    parser.add_argument("--no-flex", action="store_true", help="skip flex_attention (it compiles per shape)")
    parser.add_argument("--sweep", action="store_true", help="also time warps x stages configs at d=0.5")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"),
                        help="folder for the JSON (default: benchmarks/results)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    parser.add_argument("--block-q", type=int, default=BLOCK, choices=(64, 128),
                        help="query block (tile rows)")
    parser.add_argument("--block-k", type=int, default=BLOCK, choices=(64, 128), help="key block")
    parser.add_argument("--tma", action="store_true",
                        help="read K/V tiles through tensor descriptors (KernelConfig.tma) in every paro config")
    parser.add_argument("--rope", action="store_true", help="also time every paro mode with RoPE in the op (rotary=)")
    parser.add_argument("--graph", action="store_true",
                        help="time every method as the replay of a CUDA graph of calls (no host launch work)")
    parser.add_argument("--fa3", action="store_true",
                        help="also time FlashAttention-3 bf16 and FP8 (dense; needs the optional fa3-fwd wheel)")
    parser.add_argument("--sm90", action="store_true",
                        help="also time the sm_90a CUDA kernels (128 x 64 blocks, int8/int4 QK + fp8 PV)")
    parser.add_argument("--sage2", metavar="CHECKOUT", type=Path,
                        help="also time SageAttention2's sm90 kernel alone and its whole call (dense), built from a "
                        "checkout of its source (benchmarks/sage2_anchor.py; nvcc and ninja on the machine)")
    parser.add_argument("--sol", action="store_true",
                        help="also time Sol-Attn (comfy-kitchen's calibration-free block-sparse attention) at top-k "
                        "= each density below 1, with and without its pooled tail (benchmarks/sol_anchor.py)")
    parser.add_argument("--sparge", metavar="CHECKOUT", type=Path,
                        help="also time SpargeAttn's sm90 block-sparse call over paro's mask of each density and over a "
                        "mask of its own blocks, built from a checkout of its source (benchmarks/sparge_anchor.py; nvcc "
                        "and ninja on the machine)")
    parser.add_argument("--table", metavar="JSON", nargs="+",
                        help="print markdown tables of results files and exit (reads JSON only: no GPU)")
    parser.add_argument("--summary", action="store_true",
                        help="with --table: per model, bf16 and int8+fp8 at d = 1 / 0.5 / 0.2 vs SDPA, and the host time")
    parser.add_argument("--anchors", action="store_true",
                        help="with --table: int8+fp8 per model beside cuDNN, FA3 and SageAttention2, and the kernel "
                        "backend='auto' ran")
    parser.add_argument("--leaders", action="store_true",
                        help="with --table: per model and density, each peer's time beside paro auto (int8+fp8) and "
                        "which one leads")
    parser.add_argument("--host", action="store_true",
                        help="host time per eager call (lists, RoPE, bool masks) vs CUDA-graph replay, and exit")
    args = parser.parse_args(argv)
    try:
        args.shapes = _comma_list(args.shapes, _shape, "--shapes", "cogvideox-5b,flux.1-dev")
        args.densities = _comma_list(args.densities, _density, "--densities", "1.0,0.5")
        args.modes = _comma_list(args.modes, _mode, "--modes", "bf16+bf16,int8+fp8")
        args.k_scale = _comma_list(args.k_scale, _k_scale, "--k-scale", "block,token")
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.rep <= 0:
        parser.error(f"--rep {args.rep}: pass a repetition time in ms > 0")
    args.table_results = []
    for path in args.table or []:
        if not Path(path).is_file():
            parser.error(f"--table {path}: no such file; pass a results JSON written by this benchmark")
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            parser.error(f"--table {path} is not a readable JSON file ({exc}): pass a results JSON written by this "
                         "benchmark")
        try:  # a host-time file (--host), or timings that read_results checks
            args.table_results.append(data if isinstance(data, dict) and "host_rows" in data else read_results(path))
        except ValueError as exc:
            parser.error(f"--table {path} {exc}: pass a results JSON written by this benchmark")
    if args.summary and not args.table:
        parser.error("--summary goes with --table RESULTS.json")
    if args.anchors and not args.table:
        parser.error("--anchors goes with --table RESULTS.json")
    if args.leaders and not args.table:
        parser.error("--leaders goes with --table RESULTS.json")
    if args.sage2 and not (args.sage2 / SAGE2_KERNEL_SOURCE).is_file():
        parser.error(f"--sage2 {args.sage2}: no {SAGE2_KERNEL_SOURCE} there; pass a checkout of "
                     "github.com/thu-ml/SageAttention")
    if args.sparge and not (args.sparge / SPARGE_KERNEL_SOURCE).is_file():
        parser.error(f"--sparge {args.sparge}: no {SPARGE_KERNEL_SOURCE} there; pass a checkout of "
                     "github.com/thu-ml/SpargeAttn")
    if not args.table:
        from paroattn.app.options import folder_problem

        if problem := folder_problem(args.out, "--out", keep=False):
            parser.error(problem)
        if not torch.cuda.is_available():
            parser.error("the benchmark times kernels on a CUDA GPU and this machine has none: run it on a GPU "
                         "machine, or pass --table RESULTS.json to print saved results")
    return args


def main(argv=None) -> dict:
    return run_arguments(parse_arguments(argv))


def run_arguments(args: argparse.Namespace) -> dict:
    """Run what `parse_arguments` returned."""
    if args.host and not args.table:
        return host_times(args.out)
    shapes, densities, modes = args.shapes, args.densities, args.modes
    if args.table:
        files = args.table_results
        for path, results in zip(args.table, files):
            if "host_rows" in results:
                print(f"`{Path(path).name}`: " + host_table(results) + "\n")
            elif args.leaders:
                print(f"`{Path(path).name}`: " + leader_table(results, shapes) + "\n")
            elif args.anchors:
                print(f"`{Path(path).name}`: " + anchor_table(results, shapes) + "\n")
            elif args.summary:
                print(f"`{Path(path).name}`: " + summary_table(results, shapes, modes, densities) + "\n")
            else:
                print(f"`{Path(path).name}`: {environment_line(results)}\n\n{markdown_tables(results)}")
        return files[0] if len(files) == 1 else {"files": files}
    return run(
        shapes=shapes,
        densities=densities,
        modes=modes,
        flex=not args.no_flex,
        sweep=args.sweep,
        out_dir=args.out,
        rep=args.rep,
        block_q=args.block_q,
        block_k=args.block_k,
        tma=args.tma,
        rope=args.rope,
        graph=args.graph,
        fa3=args.fa3,
        sm90=args.sm90,
        sage2=args.sage2,
        sol=args.sol,
        sparge=args.sparge,
        k_scales=args.k_scale or ("block",),
    )


if __name__ == "__main__":
    main()
