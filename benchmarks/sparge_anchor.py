"""SpargeAttn's sm90 block-sparse kernel as a benchmark anchor: `block_sparse_sage2_attn_cuda` of thu-ml/SpargeAttn
(INT8 QK with per-block scales, FP8 PV with fp32 accumulation, over any per-head block mask), built on the GPU machine
from a checkout of its public source; timed, never shipped or vendored.

On sm90 its kernel tiles 64 queries x 128 keys (CTA_Q, CTA_K of its `qk_int_sv_f8_cuda_sm90.cu`; the 128 x 64 of
its README is the tiling of the other GPUs) and reads the mask as [B, H, ceil(N / 64), ceil(N / 128)]: its call builds
the active-block lists from that mask (one Triton launch), quantizes Q per 64 queries and K (less its mean) per 128
keys in Triton, pads, transposes and quantizes V with its `_fused` extension, then runs the kernel.

paro's masks are per head, in each head's reordered token order, at paro's blocks (128 x 64 in the benchmark):
`from_paro_mask` gives the blocks of its grid that hold any active query-key pair of such a mask (so it computes at
least what paro computes, exactly that where active key blocks come in aligned pairs), and `on_reordered_tokens` runs
an attention function on each head's reordered tokens and puts the output back in the original order: SpargeAttn's
output for a paro call. `reference` is what its kernel computes, unquantized: the oracle of the conversion's tests.

`build(checkout)` compiles with torch.utils.cpp_extension (nvcc, ninja) only what the sm90 block-sparse path needs:
its kernel template (from `csrc/qattn/qk_int_sv_f8_cuda_sm90.cuh`) instantiated for head dims 64 and 128 with bf16
output, behind a binding generated here under the name and signature its Python code calls, and its `_fused`
extension; then imports the checkout's `spas_sage_attn` package wired to them. A second call in the same machine's
life loads what the first built.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from paroattn.layout import TokenLayout, reorder_table
from paroattn.masks import dense_mask_from_blocks, synthetic_block_mask

BLOCK_Q, BLOCK_K = 64, 128  # its sm90 kernel's query and key tile
KERNEL_HEADER = Path("csrc/qattn/qk_int_sv_f8_cuda_sm90.cuh")
FUSED_SOURCES = ["csrc/fused/pybind.cpp", "csrc/fused/fused.cu"]
HEAD_DIMS = (64, 128)
FLAGS = ["-O3", "-std=c++17", "--use_fast_math", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
         "-DENABLE_BF16", "-diag-suppress=174,177", "-gencode", "arch=compute_90a,code=sm_90a"]
KERNEL_EXTENSION, FUSED_EXTENSION = "_sparge_qattn_sm90", "_sparge_fused"
# the kernel entry its call uses on sm90 (spas_sage_attn/core.py), served by the binding below
ENTRY = "qk_int8_sv_f8_accum_f32_block_sparse_attn_inst_buf_fuse_v_scale_with_pv_threshold_sm90"
# `check`'s bound on the relative L2 distance to the reference: its INT8/FP8 error is a few percent, a mask read in
# other coordinates (another block shape, head or token order) about 1 on random inputs
CHECK_TOLERANCE = 0.2

# One head dim of its kernel as its call runs it on bf16 inputs: 64 x 128 tiles of 128 threads, one Q and K scale per
# tile (granularity 1), the PV threshold per block (mode 1), V's scale fused, not causal, no PV counts.
_INSTANCE = """\
#include <cstdint>
#include "qk_int_sv_f8_cuda_sm90.cuh"

void sparge_sm90_hd{hd}(int8_t* q, int8_t* k, void* v, void* o, int32_t* lut, int32_t* valid_blocks,
                        float* pv_threshold, float* q_scale, float* k_scale, float* v_scale, uint32_t batch,
                        uint32_t qo_len, uint32_t kv_len, uint32_t padded_kv_len, uint32_t heads_q,
                        uint32_t heads_kv, const uint32_t* s, float sm_scale)
{{
  SpargeAttentionSM90Dispatched<64, 128, 128, {hd}, 1, 1, nv_bfloat16, false, true, false>(
      q, k, static_cast<__nv_fp8_e4m3*>(v), static_cast<nv_bfloat16*>(o), nullptr, lut, valid_blocks, pv_threshold,
      q_scale, k_scale, v_scale, batch, qo_len, kv_len, padded_kv_len, heads_q, heads_kv,
      s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], sm_scale);
}}
"""

# The Python-facing entry: the signature its call uses, the cases above only, each refusal saying what it got.
_BINDING = """\
#include <torch/extension.h>

#define SPARGE_DECLARE(HD) \\
  void sparge_sm90_hd##HD(int8_t*, int8_t*, void*, void*, int32_t*, int32_t*, float*, float*, float*, float*, \\
                          uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, const uint32_t*, float);
SPARGE_DECLARE(64)
SPARGE_DECLARE(128)

static void expect(const torch::Tensor& t, const char* name, at::ScalarType dtype, int64_t dims, bool contiguous)
{
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dims, got ", t.dim());
  TORCH_CHECK(contiguous ? t.is_contiguous() : t.stride(-1) == 1, name,
              contiguous ? " must be contiguous" : " must be contiguous in its last dim");
}

static void expect_shape(const torch::Tensor& t, const char* name, std::vector<int64_t> shape)
{
  TORCH_CHECK(t.sizes().equals(shape), name, " must be ", c10::IntArrayRef(shape), ", got ", t.sizes());
}

torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor o, torch::Tensor lut,
                        torch::Tensor valid_blocks, torch::Tensor pv_threshold, torch::Tensor q_scale,
                        torch::Tensor k_scale, torch::Tensor v_scale, int64_t tensor_layout, int64_t is_causal,
                        int64_t qk_quant_gran, double sm_scale, int64_t return_pv_count)
{
  TORCH_CHECK(tensor_layout == 1 && is_causal == 0 && qk_quant_gran == 1 && return_pv_count == 0,
              "this build of SpargeAttn's sm90 kernel takes [B, H, N, D] inputs (tensor_layout 1), not causal, one "
              "scale per block (qk_quant_gran 1), no PV counts; got tensor_layout ", tensor_layout, ", is_causal ",
              is_causal, ", qk_quant_gran ", qk_quant_gran, ", return_pv_count ", return_pv_count);
  expect(q, "q", at::kChar, 4, false);
  expect(k, "k", at::kChar, 4, false);
  expect(v, "v", at::kFloat8_e4m3fn, 4, false);
  expect(o, "output", at::kBFloat16, 4, false);
  expect(lut, "lut", at::kInt, 4, true);
  expect(valid_blocks, "valid_block_num", at::kInt, 3, true);
  expect(pv_threshold, "pv_threshold", at::kFloat, 1, true);
  expect(q_scale, "q_scale", at::kFloat, 3, true);
  expect(k_scale, "k_scale", at::kFloat, 3, true);
  expect(v_scale, "v_scale", at::kFloat, 3, true);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Hkv = k.size(1), Nk = k.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head dim must be 64 or 128, got ", D);
  TORCH_CHECK(H % Hkv == 0, "query heads (", H, ") must be a multiple of key heads (", Hkv, ")");
  const int64_t nq = (N + 63) / 64, nk = (Nk + 127) / 128;
  expect_shape(k, "k", {B, Hkv, Nk, D});
  expect_shape(o, "output", {B, H, N, D});
  TORCH_CHECK(v.size(0) == B && v.size(1) == Hkv && v.size(2) == D && v.size(3) >= nk * 128,
              "v must be [B, H_kv, D, >= ", nk * 128, "] (transposed, padded to 128 keys), got ", v.sizes());
  expect_shape(lut, "lut", {B, H, nq, nk});
  expect_shape(valid_blocks, "valid_block_num", {B, H, nq});
  expect_shape(pv_threshold, "pv_threshold", {H});
  expect_shape(q_scale, "q_scale", {B, H, nq});
  expect_shape(k_scale, "k_scale", {B, Hkv, nk});
  expect_shape(v_scale, "v_scale", {B, Hkv, D});
  const uint32_t strides[12] = {
      (uint32_t)q.stride(0), (uint32_t)q.stride(2), (uint32_t)q.stride(1),
      (uint32_t)k.stride(0), (uint32_t)k.stride(2), (uint32_t)k.stride(1),
      (uint32_t)v.stride(0), (uint32_t)v.stride(1), (uint32_t)v.stride(2),
      (uint32_t)o.stride(0), (uint32_t)o.stride(2), (uint32_t)o.stride(1)};
  (D == 64 ? sparge_sm90_hd64 : sparge_sm90_hd128)(
      q.data_ptr<int8_t>(), k.data_ptr<int8_t>(), v.data_ptr(), o.data_ptr(), lut.data_ptr<int32_t>(),
      valid_blocks.data_ptr<int32_t>(), pv_threshold.data_ptr<float>(), q_scale.data_ptr<float>(),
      k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), B, N, Nk, v.size(3), H, Hkv, strides, (float)sm_scale);
  return torch::empty({0});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
  m.def("ENTRY", &attention);
}
""".replace("ENTRY", ENTRY)


def _regroup(mask: torch.Tensor, dim: int, block: int, new_block: int, n: int) -> torch.Tensor:
    """Blocks of `block` tokens along `dim` (of a sequence of n) as blocks of `new_block` tokens: a new block is
    active where any old block it overlaps is (through a grid of gcd(block, new_block) that both cut exactly)."""
    step = math.gcd(block, new_block)
    fine = mask.repeat_interleave(block // step, dim=dim).narrow(dim, 0, -(-n // step))
    groups, per = -(-n // new_block), new_block // step
    missing = groups * per - fine.shape[dim]
    if missing:
        shape = list(fine.shape)
        shape[dim] = missing
        fine = torch.cat([fine, fine.new_zeros(shape)], dim=dim)
    return fine.unflatten(dim, (groups, per)).any(dim=dim + 1)


def from_paro_mask(mask: torch.Tensor, block_size: tuple[int, int], n: int, batch: int) -> torch.Tensor:
    """SpargeAttn's sm90 block map for paro's `mask` (bool [H, ceil(n / bq), ceil(n / bk)], blocks of bq queries x
    bk keys on each head's reordered tokens): bool [batch, H, ceil(n / 64), ceil(n / 128)], contiguous, on the same
    tokens; a block is active where it holds a query-key pair of an active block of `mask`."""
    bq, bk = block_size
    if mask.dtype != torch.bool or mask.dim() != 3:
        raise ValueError(f"paro's mask must be bool [H, nq, nk], got {mask.dtype} of shape {tuple(mask.shape)}")
    expected = (-(-n // bq), -(-n // bk))
    if tuple(mask.shape[1:]) != expected:
        raise ValueError(f"a mask of {bq} x {bk} blocks over {n} tokens has {expected[0]} x {expected[1]} blocks per "
                         f"head, got {tuple(mask.shape[1:])}: pass the mask and block size of the same paro call")
    rows = _regroup(mask, 1, bq, BLOCK_Q, n)
    return _regroup(rows, 2, bk, BLOCK_K, n).unsqueeze(0).expand(batch, -1, -1, -1).contiguous()


def _reorder_index(layout: TokenLayout, orders: torch.Tensor, device) -> torch.Tensor:
    """[H, N]: row h lists the original positions of head h's reordered tokens."""
    return reorder_table(layout, device).index_select(0, torch.as_tensor(orders, device=device).long())


def _gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    B, _, _, D = x.shape
    return x.gather(2, index[None, :, :, None].expand(B, -1, -1, D))


def reorder(x: torch.Tensor, layout: TokenLayout, orders: torch.Tensor) -> torch.Tensor:
    """[B, H, N, D] with each head's tokens in its order `ORDERS[orders[h]]` (as paro's kernels read them)."""
    return _gather_tokens(x, _reorder_index(layout, orders, x.device))


def restore(x: torch.Tensor, layout: TokenLayout, orders: torch.Tensor) -> torch.Tensor:
    """The inverse of `reorder`: each head's tokens back in the original order."""
    index = _reorder_index(layout, orders, x.device)
    inverse = torch.empty_like(index).scatter_(1, index, torch.arange(index.shape[1], device=x.device).expand_as(index))
    return _gather_tokens(x, inverse)


def on_reordered_tokens(attention, q, k, v, layout: TokenLayout, orders: torch.Tensor, block_map: torch.Tensor):
    """`attention(q, k, v, block_map)` on each head's reordered tokens, its output back in the original order: with
    `block_map = from_paro_mask(...)`, the attention of the paro call with that mask (at least its active pairs)."""
    out = attention(reorder(q, layout, orders), reorder(k, layout, orders), reorder(v, layout, orders), block_map)
    return restore(out, layout, orders)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor,
              sm_scale: float | None = None) -> torch.Tensor:
    """What its sm90 kernel computes, in float32 without quantization: query i of [B, H, N, D] attends exactly to the
    keys (< N) of the 128-key blocks active in `block_map[b, h, i // 64]`, softmax over those keys. A row with no
    active block is zeros here (the kernel leaves it unwritten)."""
    B, H, N, D = q.shape
    if tuple(block_map.shape) != (B, H, -(-N // BLOCK_Q), -(-N // BLOCK_K)):
        raise ValueError(f"its block map over [B, H, N] = [{B}, {H}, {N}] is [{B}, {H}, {-(-N // BLOCK_Q)}, "
                         f"{-(-N // BLOCK_K)}], got {list(block_map.shape)}")
    allowed = dense_mask_from_blocks(block_map.bool(), BLOCK_Q, BLOCK_K, N)
    scores = (q.float() @ k.float().transpose(-1, -2)) * (sm_scale or D ** -0.5)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return weights @ v.float()


@dataclass
class Sparge:
    package: object  # the checkout's `spas_sage_attn` package, wired to the extensions built here

    def whole_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_map: torch.Tensor) -> torch.Tensor:
        """Its public call on bf16 [B, H, N, D] inputs over `block_map` ([B, H, ceil(N/64), ceil(N/128)], as
        `from_paro_mask` gives): what a user of its block-sparse API times, its quantization included."""
        return self.package.block_sparse_sage2_attn_cuda(q, k, v, mask_id=block_map, tensor_layout="HND")


def _write_if_changed(path: Path, text: str) -> None:
    """Generated sources are rewritten only when they change: ninja rebuilds what is newer than its build."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def build_extension(checkout: Path, name: str):
    """Its kernel (`KERNEL_EXTENSION`) or its `_fused` extension (`FUSED_EXTENSION`) compiled from `checkout`, or
    loaded where built before; two processes may build the two at once."""
    from sage2_anchor import build_root
    from torch.utils import cpp_extension

    checkout = Path(checkout).resolve()
    if not (checkout / KERNEL_HEADER).is_file():
        raise FileNotFoundError(f"no {KERNEL_HEADER} in {checkout}: pass a checkout of github.com/thu-ml/SpargeAttn")
    root = build_root("sparge-sm90-build")
    build_dir = root / name
    build_dir.mkdir(exist_ok=True)
    common = dict(extra_cuda_cflags=FLAGS, extra_cflags=["-O3", "-std=c++17"], extra_ldflags=[f"-L{root}", "-lcuda"],
                  build_directory=str(build_dir), verbose=False)
    if name == FUSED_EXTENSION:
        return cpp_extension.load(name=name, sources=[str(checkout / s) for s in FUSED_SOURCES], **common)
    if name != KERNEL_EXTENSION:
        raise ValueError(f"no SpargeAttn extension {name!r}: {KERNEL_EXTENSION} or {FUSED_EXTENSION}")
    sources = []
    for hd in HEAD_DIMS:
        sources.append(build_dir / f"sparge_sm90_hd{hd}.cu")
        _write_if_changed(sources[-1], _INSTANCE.format(hd=hd))
    sources.append(build_dir / "sparge_sm90_binding.cpp")
    _write_if_changed(sources[-1], _BINDING)
    return cpp_extension.load(name=name, sources=[str(s) for s in sources], **common,
                              extra_include_paths=[str(checkout / KERNEL_HEADER.parent)])


def build(checkout: Path) -> Sparge:
    """Both extensions from `checkout`, and its `spas_sage_attn` package imported with them."""
    checkout = Path(checkout).resolve()
    kernels = build_extension(checkout, KERNEL_EXTENSION)
    fused = build_extension(checkout, FUSED_EXTENSION)
    from sage2_anchor import import_checkout

    return Sparge(import_checkout(checkout, "spas_sage_attn", {"_qattn": kernels, "_fused": fused}))


def check(checkout: Path) -> float:
    """Its whole call on a small random call of each head dim (a text prefix, partial last blocks, two heads in two
    orders) over paro's 128 x 64 mask, on reordered tokens, against `reference` over the same map: the largest relative
    L2 distance, each printed."""
    sparge = build(checkout)
    layout = TokenLayout(16, 3, 12, 20)
    n, orders = layout.seq_len, torch.tensor([3, 5])
    generator = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for hd in HEAD_DIMS:
        q, k, v = (torch.randn(1, 2, n, hd, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(3))
        mask = synthetic_block_mask(2, -(-n // 128), -(-n // 64), 0.4, generator=torch.Generator().manual_seed(hd))
        block_map = from_paro_mask(mask, (128, 64), n, batch=1).cuda()
        out = on_reordered_tokens(sparge.whole_call, q, k, v, layout, orders, block_map).float()
        expected = on_reordered_tokens(reference, q, k, v, layout, orders, block_map)
        distance = float((out - expected).norm() / expected.norm())
        print(f"SpargeAttn sm90, head dim {hd}: relative L2 distance to the reference over paro's mask {distance:.4f}")
        worst = max(worst, distance)
    return worst


if __name__ == "__main__":
    # python benchmarks/sparge_anchor.py CHECKOUT NAME: build one extension ahead of a run;
    # python benchmarks/sparge_anchor.py CHECKOUT check: its call against the reference (exit 1 beyond the tolerance)
    if sys.argv[2] == "check":
        sys.exit(0 if check(Path(sys.argv[1])) < CHECK_TOLERANCE else 1)
    build_extension(Path(sys.argv[1]), sys.argv[2])
