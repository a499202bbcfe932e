"""Compile every variant of the PARO kernels for sm_90 WITHOUT a GPU, and count SASS instructions.

    python benchmarks/kernel_compile_check.py            # all modes x head dims x flags: compile errors
    python benchmarks/kernel_compile_check.py --sass     # + matrix/copy/spill instruction counts
    python benchmarks/kernel_compile_check.py --block 128 --block-k 64 --match q_tma=True   # 128 x 64 tiles, Q by TMA
    python benchmarks/kernel_compile_check.py --gluon [--sass]   # the warp-specialized Gluon kernel (hopper_attention)
    python benchmarks/kernel_compile_check.py --sm90     # the sm_90a CUDA kernel (kernels/sm90) with nvcc

Catches front-end and lowering errors before device time is spent (the interpreter does not: it runs
the Python, not the compiler), and shows whether the products use wgmma (HGMMA / IGMMA / QGMMA),
whether loads are pipelined (LDGSTS) and whether registers spill (STL / LDL). Pointer and stride
arguments are specialized the way a real launch specializes them (16-byte divisibility, unit
innermost strides); without that, Triton neither vectorizes nor pipelines the loads.
`--sm90` compiles every variant of the CUDA kernel with the nvcc on PATH (`-Xptxas -v`) and checks no register
spills, the register ceiling of its CTAs per SM, and the instructions per thread per 64 keys of its unmasked
key loop (SASS through cuobjdump, which Triton ships).
Needs the `ptxas` that Triton ships (or one on PATH). The GPU results in benchmarks/results/ were
taken with triton 3.6: install that version (`pip install --target DIR triton==3.6.0`,
PYTHONPATH=DIR) to check what ran there; newer releases accept some code 3.6 rejects.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from paroattn.kernels import block_sparse_attention as kernels  # noqa: E402
from paroattn.kernels.dispatch import KernelConfig, config_problem  # noqa: E402

MODES = [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (0, 1)]  # (QK_MODE, PV_MODE)
SASS_OPS = ["HGMMA", "USETMAXREG", "SYNCS", "IGMMA", "QGMMA", "HMMA", "LDGSTS", "LDG", "STL", "LDL", "MUFU.EX2", "I2F", "F2I", "F2FP", "PRMT", "SHFL"]


def _buffers(qk_mode, pv_mode):
    kq = "*i8" if qk_mode else "*bf16"
    vq = "*fp8e4nv" if pv_mode == 1 else "*i8" if pv_mode == 2 else "*bf16"
    return kq, vq


def _compile(fn, pointers, constants, divisible, options):
    names = fn.arg_names
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n in names}
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def _sass_counts(kernel) -> dict:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path("/tmp/paro_kernel_check.cubin")
    path.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True).stdout
    return {op: len(re.findall(r"\b" + re.escape(op) + r"\b", sass)) for op in SASS_OPS}


def _check_gluon_kernel(sass: bool) -> int:
    """Compile hopper_attention's kernel for sm_90 (D = 64 / 128, 2-4 stages); returns the failure count."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from paroattn.kernels import hopper_attention

    fn = hopper_attention._warp_specialized_kernel
    pointers = dict(Q="*bf16", Out="*bf16", Orders="*i32", Counts="*i32", Indices="*i32", Schedule="*i32")
    failures = 0
    for head_dim, stages in itertools.product((64, 128), (2, 3, 4)):
        kv = torch.empty(2, 256, head_dim, dtype=torch.bfloat16)  # CPU tensors: only the types matter
        descs = dict(zip(("k_desc", "v_desc"), hopper_attention.descriptors(kv, kv)))
        constants = dict(STAGES=stages, CONSUMER_REGS=240)
        signature = {name: mangle_type(descs[name]) if name in descs else pointers.get(name) or
                     ("constexpr" if name in constants else "fp32" if name == "qk_scale" else "i32")
                     for name in fn.arg_names}
        # pointers and the outer strides are multiples of 16, as a launch specializes them
        strides = [f"stride_{t}{a}" for t in "qo" for a in "bhn"]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in list(pointers) + strides}
        label = f"gluon bf16 D={head_dim} stages={stages}"
        try:
            kernel = triton.compile(GluonASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in
                                                                   constants.items()}, attrs),
                                    target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=168))
            print(f"{label}: shared {kernel.metadata.shared} B" + (f", {_sass_counts(kernel)}" if sass else ""))
        except Exception as exc:
            failures += 1
            print(f"FAILED {label}: {str(exc)[-1200:]}")
    return failures


# per thread per 64 keys in the unmasked key loop, by K scale granularity: a scale per key costs an FMA per score
# (the score times its key's scale before the row max), a multiply per column and the scales' shared loads
SM90_MAX_LOOP_INSTRUCTIONS = {"block": 300, "token": 372}


def cuobjdump() -> str | None:
    """cuobjdump on PATH, else the one Triton ships, else None."""
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return shutil.which("cuobjdump") or (str(bundled) if bundled.is_file() else None)


def key_loop_instructions(sass: str) -> tuple[int, int]:
    """(instructions, keys per iteration) of the sm90 kernel's unmasked key loop in `cuobjdump -sass` text: the
    loop (a backward branch and its target) that issues Q K^T over two key blocks (IGMMA.64x128) and reads
    nothing from global memory (the masked loop reads the key mask)."""
    instructions = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for address, text in instructions:
        branch = re.search(r"\bBRA(?:\.\S+)*\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            body = [t for a, t in instructions if int(branch.group(1), 16) <= a <= address]
            if any("IGMMA.64x128" in t for t in body) and not any(re.search(r"\bLDG\b", t) for t in body):
                loops.append(len(body))
    if not loops:
        raise ValueError("no unmasked key loop (IGMMA.64x128x32 without LDG inside a backward branch) in the SASS")
    return min(loops), 128


def sm90_compile(head_dim: int, out_bf16: bool, workdir: Path, k_scale: str = "block") -> dict:
    """nvcc's report on one variant of kernels/sm90/attention.cu (K scales per key block, or per key with
    k_scale="token"): registers, spill bytes, and SASS instructions per thread per 64 keys of the unmasked key loop."""
    source = Path(__file__).resolve().parents[1] / "paroattn" / "kernels" / "sm90" / "attention.cu"
    cubin = workdir / f"sm90-d{head_dim}-{int(out_bf16)}-{k_scale}.cubin"
    result = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-std=c++17",
                             "--use_fast_math", "-Xptxas", "-v", f"-DPARO_HEAD_DIM={head_dim}",
                             f"-DPARO_OUT_BF16={int(out_bf16)}", f"-DPARO_K_PER_KEY={int(k_scale == 'token')}",
                             "-o", str(cubin), str(source)],
                            capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"sm_90a compile failed (D={head_dim}):\n{log[-4000:]}")
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("no cuobjdump (on PATH or in Triton's wheel) to read the SASS with")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, timeout=300).stdout
    loop, keys = key_loop_instructions(sass)
    return {"registers": max(registers), "spill_bytes": sum(spills), "serialized_wgmma": "serializ" in log.lower(),
            "loop_instructions_per_64_keys": loop * 64 / keys, "log": log}


def _check_sm90() -> int:
    import tempfile

    from paroattn.kernels import sm90

    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for (head_dim, dtype), k_scale in itertools.product(sm90.VARIANTS, sm90.K_SCALES):
            report = sm90_compile(head_dim, dtype == torch.bfloat16, Path(tmp), k_scale)
            ceiling = sm90.REGISTER_CEILING[head_dim]
            budget = SM90_MAX_LOOP_INSTRUCTIONS[k_scale]
            problems = [text for bad, text in (
                (report["spill_bytes"], f"{report['spill_bytes']} bytes of spills"),
                (report["registers"] > ceiling, f"{report['registers']} registers, over {ceiling}"),
                (report["serialized_wgmma"], "ptxas serialized the wgmma pipeline"),
                (report["loop_instructions_per_64_keys"] > budget, f"over {budget} instructions per 64 keys")) if bad]
            failures += bool(problems)
            print(f"sm90 D={head_dim} {dtype} k_scale={k_scale}: {report['registers']} registers, "
                  f"{report['spill_bytes']} spill bytes, "
                  f"{report['loop_instructions_per_64_keys']:.1f} SASS instructions per thread per 64 keys"
                  + (f"  FAILED: {'; '.join(problems)}" if problems else ""))
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true", help="print instruction counts of each attention variant")
    parser.add_argument("--block", type=int, default=64, help="query block (and key block unless --block-k)")
    parser.add_argument("--block-k", type=int, default=None)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--match", default="", help="only variants whose label holds all these words, e.g. 'q_tma=True D=128'")
    parser.add_argument("--gluon", action="store_true", help="check the warp-specialized Gluon kernel instead")
    parser.add_argument("--sm90", action="store_true", help="check the sm_90a CUDA kernel (nvcc) instead")
    args = parser.parse_args()
    if args.sm90:
        failures = _check_sm90()
        print(f"sm90 CUDA kernel: {failures} variants failed")
        return 1 if failures else 0
    if args.gluon:
        failures = _check_gluon_kernel(args.sass)
        print(f"triton {triton.__version__}: gluon kernel, {failures} failed")
        return 1 if failures else 0
    bk = args.block_k or args.block
    unit = ["stride_qd", "stride_od"]
    divisible = ["stride_qb", "stride_qh", "stride_qn", "stride_kb", "stride_kh", "stride_kn", "stride_vb",
                 "stride_vh", "stride_vn", "stride_ob", "stride_oh", "stride_on", "N", "N_PAD", "H"]
    failures = compiled = 0
    variants = itertools.product(MODES, (64, 128), (True, False), (False, True), (False, True), (False, True),
                                 (False, True))
    for (qk_mode, pv_mode), head_dim, even, tma, overlap, q_tma, per_token in variants:
        if config_problem(KernelConfig(args.warps, args.stages, tma, overlap, q_tma), args.block, bk):
            continue  # a config the backend refuses
        if per_token and not qk_mode:
            continue  # K scales per key exist with integer QK only
        kq, vq = _buffers(qk_mode, pv_mode)
        label = (f"qk={qk_mode} pv={pv_mode} D={head_dim} even={even} tma={tma} overlap={overlap} q_tma={q_tma} "
                 f"k_per_token={per_token}")
        if not all(word in label.split() for word in args.match.split()):
            continue
        pointers = dict(Q="*bf16", Out="*bf16", KQ=kq, KScale="*fp32", VQ=vq,
                        VAmax="*fp32", Orders="*i32", Counts="*i32", Indices="*i32", Schedule="*i32",
                        QScale="*fp32", KeyMask="*i8")
        pointers["QDesc"] = f"tensordesc<{'i8' if qk_mode else 'bf16'}[{args.block}, {head_dim}]>" if q_tma else kq
        if tma:
            pointers["KDesc"] = f"tensordesc<{kq[1:]}[{bk}, {head_dim}]>"
            v_block = f"[{head_dim}, {bk}]" if pv_mode else f"[{bk}, {head_dim}]"
            pointers["VDesc"] = f"tensordesc<{vq[1:]}{v_block}>"
        else:
            pointers.update(KDesc=kq, VDesc=vq)
        constants = dict(HEAD_DIM=head_dim, BLOCK_M=args.block, BLOCK_N=bk, QK_MODE=qk_mode,
                         PV_MODE=pv_mode, EVEN_N=even, USE_TMA=tma, OVERLAP_QK=overlap,
                         Q_TMA=q_tma, K_PER_TOKEN=per_token, HAS_KEY_MASK=False,
                         P_LOG2_SCALE=kernels.P_LOG2_SCALES[pv_mode], **{n: 1 for n in unit})
        try:
            kernel = _compile(kernels._attention_kernel, pointers, constants,
                              divisible + [n for n in pointers if not n.endswith("Desc")],
                              dict(num_warps=args.warps, num_stages=args.stages))
            if args.sass and even:
                print(f"attention {label}: warps {kernel.metadata.num_warps}, shared {kernel.metadata.shared} B, "
                      f"{_sass_counts(kernel)}")
            prologue_pointers = dict(K="*bf16", V="*bf16", KMean="*fp32", VAmax="*fp32", KQ=kq, KScale="*fp32",
                                     VQ=vq, Orders="*i32", Q="*bf16", QQ="*i8" if qk_mode else "*bf16",
                                     QScale="*fp32", KeyMask="*i8")
            prologue_constants = dict(HEAD_DIM=head_dim, BLOCK_N=bk, QK_MODE=qk_mode, PV_MODE=pv_mode,
                                      WRITE_Q=q_tma, BLOCK_Q=args.block, K_PER_TOKEN=per_token, HAS_KEY_MASK=False,
                                      stride_kd=1,
                                      stride_vd=1, stride_qd=1)
            _compile(kernels._kv_prologue_kernel, prologue_pointers, prologue_constants,
                     divisible + list(prologue_pointers), dict(num_warps=4))
            compiled += 1
        except Exception as exc:  # report every failing variant, then exit non-zero
            failures += 1
            print(f"FAILED {label}: {str(exc)[-1200:]}")
    print(f"triton {triton.__version__}: {compiled} variants compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
