// Block-sparse PARO attention for sm_90a: INT8 QK and FP8 (e4m3) PV on wgmma, compiled at run time.
//
// A CTA computes 64 rows (one warpgroup) or all 128 rows (two warpgroups sharing the K/V tiles) of a query
// block (the block lists' bq) of one (batch, head) against its active 64-key blocks (bk), reading the
// K/V (and Q) prologue's outputs (`triton_backend.prepare_kv`):
//   QQ  int8 [B*H, NQ*128, D]   reordered queries, per query block scale QScale [B*H, NQ]
//   KQ  int8 [B*H, N_PAD, D]    reordered keys minus K smoothing's mean, per key block scale KScale [B*H, NK]
//   VQ  e4m3 [B*H, D, N_PAD]    reordered values, transposed, divided by their per-channel scale
//                               VAmax / 448; inside every 16 keys in the order the PV operand reads (below)
// All threads copy the K/V tiles into shared memory with cp.async, several blocks ahead. Per key block and
// warpgroup:
//   S = Q K^T        wgmma m64n64k32 s32.s8.s8, Q and K from shared memory (both K-major)
//   online softmax   in base 2: sm_scale * log2(e) and the Q/K scales are one multiplier per block, applied
//                    inside exp2's argument; P carries the fp8 multiplier 448 (2^P_LOG2_SCALE)
//   T = P V          wgmma m64nDk32 f32.e4m3.e4m3 with P in registers, V^T from shared memory;
//                    T starts from zero each block and is added to O in fp32 (Hopper's fp8 product
//                    accumulates with ~22 bits, O would lose low bits over a long row)
// The epilogue divides by the row sum, applies V's per-channel scale and writes each row at its ORIGINAL
// token position; a row with no active block writes zeros. The torch reference (reference.py) is the
// definition of every value.
//
// Compile-time configuration (defines passed to the compiler): PARO_HEAD_DIM (64 or 128), PARO_OUT_BF16
// (1: bf16 output, 0: fp16), PARO_WARPGROUPS (1 or 2 per CTA), PARO_QK_AHEAD (the schedule, 1 or 2, below)
// and PARO_STAGES (K/V stages, at least 3 + PARO_QK_AHEAD). PARO_PRODUCER=1 compiles the warp-specialized
// kernel at the end of this file instead (a producer warpgroup, PARO_WARPGROUPS=2 consumers; PARO_PINGPONG,
// PARO_STEP_BLOCKS, PARO_PV_INTO_O, PARO_PRODUCER_REGS there). No headers: NVRTC compiles this file as is.

#ifndef PARO_HEAD_DIM
#define PARO_HEAD_DIM 128
#endif
#ifndef PARO_OUT_BF16
#define PARO_OUT_BF16 1
#endif
#ifndef PARO_WARPGROUPS
#define PARO_WARPGROUPS 2
#endif
#ifndef PARO_QK_AHEAD
#define PARO_QK_AHEAD 1
#endif
#ifndef PARO_STAGES
#define PARO_STAGES 4
#endif
#ifndef PARO_PRODUCER
#define PARO_PRODUCER 0
#endif
// the warp-specialized kernel's options
#ifndef PARO_STEP_BLOCKS
#define PARO_STEP_BLOCKS 1  // key blocks per softmax step
#endif
#ifndef PARO_PV_INTO_O
#define PARO_PV_INTO_O 0  // 1: P V accumulates into O on the tensor cores (no fp32 addition, fewer registers)
#endif
#ifndef PARO_PINGPONG
#define PARO_PINGPONG 0  // 1: the two consumers take turns at issuing their products
#endif
#ifndef PARO_PRODUCER_REGS
#define PARO_PRODUCER_REGS 24  // the producer's registers after setmaxnreg (24 or 40)
#endif

namespace paro {

constexpr int kHeadDim = PARO_HEAD_DIM;
constexpr int kBlockM = 128;  // query rows per block of the lists
constexpr int kWarpgroups = PARO_WARPGROUPS;  // consumer warpgroups per CTA, 64 query rows each
constexpr int kCtaRows = 64 * kWarpgroups;
constexpr int kBlockN = 64;   // keys per block
constexpr int kThreads = 128 * (kWarpgroups + PARO_PRODUCER);
// threads that copy K/V tiles: a producer warpgroup, or every thread of the CTA
constexpr int kLoaderThreads = PARO_PRODUCER ? 128 : kThreads;
constexpr int kStages = PARO_STAGES;
constexpr float kPLog2Scale = 8.807354922057604f;  // log2(448): P is stored as P * 448 in e4m3
constexpr float kScoreOffset = 12582912.0f;         // 1.5 * 2^23 (see score_with_offset)
constexpr float kQuantEps = 1e-8f;                  // reference.QUANT_EPS

static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim 64 or 128");
static_assert(kStages >= 3 + PARO_QK_AHEAD, "a stage per block in flight");

// Shared memory tiles are in the layouts wgmma's descriptors name: rows of `row_bytes` (64 or 128) 8-bit
// elements along the reduction (K-major), 16-byte chunks XOR-swizzled by the row within each group of 8
// rows (the 64B and 128B swizzle modes). A tile starts on a 1024-byte boundary.
template <int row_bytes>
__device__ __forceinline__ unsigned swizzled(unsigned offset) {
  constexpr unsigned mask = row_bytes == 128 ? 7u : 3u;
  return offset ^ (((offset >> 7) & mask) << 4);
}

// wgmma shared-memory matrix descriptor of a K-major swizzled tile: start address, leading byte offset
// (unused for swizzled K-major tiles, 16 by convention), stride byte offset (8 rows), swizzle mode
template <int row_bytes>
__device__ __forceinline__ unsigned long long smem_descriptor(unsigned smem_address) {
  unsigned long long desc = (smem_address & 0x3FFFFu) >> 4;
  desc |= (unsigned long long)(16 >> 4) << 16;
  desc |= (unsigned long long)((8 * row_bytes) >> 4) << 32;
  desc |= (unsigned long long)(row_bytes == 128 ? 1 : 2) << 62;
  return desc;
}

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int n>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory"); }
// writes by the generic proxy (cp.async, st.shared) made visible to wgmma's async proxy
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int n>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(n) : "memory"); }

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// an arrival on `bar` once every cp.async this thread has issued so far has landed
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!done);
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int n>
__device__ __forceinline__ void fence_registers(int (&r)[n]) {
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int n>
__device__ __forceinline__ void fence_registers(float (&r)[n]) {
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// the integer score x as the float 1.5 * 2^23 + x, exactly (|x| < 2^22), by one integer add instead of
// I2F (which Hopper issues at a quarter rate); the offset is folded into the softmax's per-row term
__device__ __forceinline__ float score_with_offset(int x) { return __int_as_float(x + 0x4B400000); }

// two floats to two e4m3 bytes: lo in bits 0-7, hi in bits 8-15 (round to nearest, saturating)
__device__ __forceinline__ unsigned pack_e4m3(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ unsigned pack_out(float lo, float hi) {
  unsigned r;
#if PARO_OUT_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

__device__ __forceinline__ float max_nan(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }

// layout.reordered_to_original: the original position of reordered position p (prefix and suffix map to
// themselves); one order of the six (axes F, H, W nested outermost first)
__device__ __forceinline__ int reordered_to_original(int p, int order, int prefix, int frames, int height, int width) {
  const int outer = order / 2;
  const int low = outer == 0 ? 1 : 0;
  const int high = outer == 2 ? 1 : 2;
  const int odd = order % 2;
  const int middle = odd ? high : low;
  const int inner = odd ? low : high;
  auto size = [&](int axis) { return axis == 0 ? frames : axis == 1 ? height : width; };
  auto stride = [&](int axis) { return axis == 0 ? height * width : axis == 1 ? width : 1; };
  const int n1 = size(middle), n2 = size(inner);
  const int s0 = stride(outer), s1 = stride(middle), s2 = stride(inner);
  const int grid = frames * height * width;
  if (p < prefix || p >= prefix + grid) return p;
  const int g = p - prefix;
  const int a2 = g % n2;
  const int a1 = (g / n2) % n1;
  const int a0 = g / (n2 * n1);
  return prefix + a0 * s0 + a1 * s1 + a2 * s2;
}

// D[64 x 64] (s32) (+)= A[64 x 32] * B[64 x 32]^T, int8, both operands K-major in shared memory; kAccumulate 0
// overwrites D (an immediate: ptxas then knows D's old values are not read)
template <int kAccumulate>
__device__ __forceinline__ void wgmma_m64n64k32_s8_ss(int (&d)[32], unsigned long long desc_a,
                                                    unsigned long long desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, %34;\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
        "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
        "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "l"(desc_a), "l"(desc_b), "n"(kAccumulate));
}

// D[64 x 64] (f32) (+)= A[64 x 32] * B[64 x 32]^T, e4m3, A in registers, B K-major in shared memory
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_rs(float (&d)[32], const unsigned (&a)[4],
                                                      unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// D[64 x 128] (f32) (+)= A[64 x 32] * B[128 x 32]^T, e4m3, A in registers, B K-major in shared memory
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const unsigned (&a)[4],
                                                      unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

template <int n>
__device__ __forceinline__ void wgmma_pv(float (&d)[n], const unsigned (&a)[4], unsigned long long desc_b,
                                         int accumulate) {
  if constexpr (n == 64) {
    wgmma_m64n128k32_e4m3_rs(d, a, desc_b, accumulate);
  } else {
    wgmma_m64n64k32_e4m3_rs(d, a, desc_b, accumulate);
  }
}

}  // namespace paro

using namespace paro;

// Shared memory: Q [128 x D] (two 64-row warpgroup tiles), kStages x (K [64 x D], V^T [D x 64]), then the
// active list (max_active block indices and as many K scales).
constexpr int kQBytes = kCtaRows * kHeadDim;
constexpr int kKBytes = kBlockN * kHeadDim;
constexpr int kVBytes = kHeadDim * kBlockN;
constexpr int kStageBytes = kKBytes + kVBytes;


// cp.async of key block kb's K [64 x D] and V^T [D x 64] tiles into one stage, 16 bytes per copy. Thread tid
// copies chunks tid + k * kLoaderThreads: kLoaderThreads chunks span a whole number of 8-row swizzle periods in both
// tiles, so each thread's swizzled destinations and source offsets are fixed once, and a block adds a base.
struct KVLoader {
  static constexpr int kKCopies = kKBytes / 16 / kLoaderThreads, kVCopies = kVBytes / 16 / kLoaderThreads;
  static_assert(kKCopies * kLoaderThreads * 16 == kKBytes && kVCopies * kLoaderThreads * 16 == kVBytes, "whole copies");
  static_assert((kLoaderThreads * 16) % (8 * kHeadDim) == 0 && (kLoaderThreads / (kBlockN / 16)) % 8 == 0, "swizzle periods");
  const signed char* k_src;    // this thread's first chunk of K block 0
  const unsigned char* v_src;  // this thread's first chunk of V^T block 0
  long long v_step;            // source distance between a thread's V chunks (rows kLoaderThreads / 4 apart)
  unsigned k_dst, v_dst;       // offsets in a stage

  __device__ __forceinline__ KVLoader(const signed char* kq_bh, const unsigned char* vq_bh, int n_pad, int tid) {
    k_src = kq_bh + tid * 16;  // K tiles are contiguous: chunk c at byte 16c
    k_dst = swizzled<kHeadDim>(tid * 16);
    const int r = tid / (kBlockN / 16), col = tid % (kBlockN / 16);
    v_src = vq_bh + (long long)r * n_pad + col * 16;
    v_step = (long long)(kLoaderThreads / (kBlockN / 16)) * n_pad;
    v_dst = kKBytes + swizzled<kBlockN>(r * kBlockN + col * 16);
  }

  __device__ __forceinline__ void load(unsigned stage, int kb) const {
    const signed char* k = k_src + kb * kKBytes;
#pragma unroll
    for (int i = 0; i < kKCopies; ++i) cp_async_16(stage + k_dst + i * kLoaderThreads * 16, k + i * kLoaderThreads * 16);
    const unsigned char* v = v_src + kb * kBlockN;
#pragma unroll
    for (int i = 0; i < kVCopies; ++i) cp_async_16(stage + v_dst + i * kLoaderThreads * 16, v + i * v_step);
  }
};

// S = Q K^T for one warpgroup (its 64-row Q tile q_tile): D / 32 products over 32 channels each, issued and
// committed (not waited)
__device__ __forceinline__ void qk_product(int (&s)[32], unsigned q_tile, unsigned k_tile) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kHeadDim / 32; ++k) {
    if (k == 0) {
      wgmma_m64n64k32_s8_ss<0>(s, smem_descriptor<kHeadDim>(q_tile), smem_descriptor<kHeadDim>(k_tile));
    } else {
      wgmma_m64n64k32_s8_ss<1>(s, smem_descriptor<kHeadDim>(q_tile + k * 32),
                               smem_descriptor<kHeadDim>(k_tile + k * 32));
    }
  }
  wgmma_commit();
}

// Bit 2j + e: whether column 8j + 2t + e of key block kb may be attended (a position < N, and outside the
// padded keys of the suffix). Only blocks from first_masked on can hold others; the rest keep all 16.
__device__ __forceinline__ unsigned keys_kept(int kb, int first_masked, int t, int N, int suffix_start,
                                              const unsigned char* key_mask, long long stride_ms) {
  if (kb < first_masked) return 0xFFFFu;
  unsigned kept = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int pos = kb * kBlockN + 8 * j + 2 * t + e;
      bool keep = pos < N;
      if (keep && pos >= suffix_start) keep = key_mask[(long long)(pos - suffix_start) * stride_ms] != 0;
      kept |= (keep ? 1u : 0u) << (2 * j + e);
    }
  }
  return kept;
}

// The online softmax of one warpgroup's 64 rows; a thread holds rows g and g + 8 of its warp's 16
// (index r = 0, 1) and of the 64 keys the columns 8j + 2t + {0, 1}, j < 8.
struct Softmax {
  float m[2] = {-__int_as_float(0x7f800000), -__int_as_float(0x7f800000)};  // running max, log2 units
  float l[2] = {0.f, 0.f};  // this thread's part of the row sums (of P * 448)
  float score_scale;        // sm_scale * log2(e) * Q's block scale

  // a key block's integer scores s (K scale block_scale, `kept`: keys_kept) -> P (as e4m3 A operands, P * 448)
  // and the factor alpha that rescales what came before: `steps` for one block
  template <bool kMasked>
  __device__ __forceinline__ void step(int (&s)[32], unsigned kept, float block_scale, unsigned (&p)[2][4],
                                       float (&alpha)[2]) {
    const unsigned kept1[1] = {kept};
    const float scale1[1] = {block_scale};
    steps<1, kMasked>(reinterpret_cast<int(&)[1][32]>(s), kept1, scale1, reinterpret_cast<unsigned(&)[1][2][4]>(p),
                      alpha);
  }

  // kB key blocks in one step: their integer scores s[b] (K scale block_scale[b], keys kept[b]: keys_kept; 0
  // for a block past the list) -> their P as e4m3 A operands p[b] (P * 448), with one running max and one factor
  // alpha that rescales what came before. A step whose keys are all excluded (padding) leaves everything as it
  // was.
  template <int kB, bool kMasked>
  __device__ __forceinline__ void steps(int (&s)[kB][32], const unsigned (&kept)[kB], const float (&block_scale)[kB],
                                        unsigned (&p)[kB][2][4], float (&alpha)[2]) {
    // the mask is one row for all queries: the same decision in every thread of the CTA
    unsigned any = 0;
#pragma unroll
    for (int b = 0; b < kB; ++b) any |= kept[b];
    if (kMasked) {
      any |= __shfl_xor_sync(0xffffffffu, any, 1);
      any |= __shfl_xor_sync(0xffffffffu, any, 2);
    }
    float scale[kB];
    float f[kB][32];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      scale[b] = score_scale * block_scale[b];
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        // f[b][4 * (j / 4) + e]: column 8 * (j / 4) + 2t + (e & 1), row g + 8 * (e >> 1)
        f[b][j] = score_with_offset(s[b][j]);
        if (kMasked && !((kept[b] >> (2 * (j / 4) + (j & 1))) & 1u)) f[b][j] = -__int_as_float(0x7f800000);
      }
    }
    float shift[kB][2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -__int_as_float(0x7f800000);
#pragma unroll
      for (int b = 0; b < kB; ++b) {
        float mb = -__int_as_float(0x7f800000);
#pragma unroll
        for (int j = 0; j < 8; ++j) mb = fmaxf(mb, fmaxf(f[b][4 * j + 2 * r], f[b][4 * j + 2 * r + 1]));
        // scale > 0: the max commutes with it (each block has its own K scale)
        mx = fmaxf(mx, (mb - kScoreOffset) * scale[b]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = any ? fmaxf(m[r], mx) : m[r];
      alpha[r] = any ? exp2_approx(m[r] - m_new) : 1.f;
      // P's multiplier 448 rides in the exponent: p = 448 * exp2(x * scale - m_new)
#pragma unroll
      for (int b = 0; b < kB; ++b) shift[b][r] = m_new - kPLog2Scale + kScoreOffset * scale[b];
      m[r] = m_new;
    }
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int b = 0; b < kB; ++b) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int r = (j >> 1) & 1;
        // excluded keys: exp2(-inf) = 0; a step with no key to attend adds nothing (its shift may be -inf)
        f[b][j] = any ? exp2_approx(fmaf(f[b][j], scale[b], -shift[b][r])) : 0.f;
        rowsum[r] += f[b][j];
      }
    }
    l[0] = fmaf(l[0], alpha[0], rowsum[0]);
    l[1] = fmaf(l[1], alpha[1], rowsum[1]);

    // P as the e4m3 A operand: register q of 32-key slice k holds keys 4t..4t+3 of its 16 (the row g + 8 for
    // odd q, the second 16 for q >= 2). V's keys are stored in the order that makes those positions the
    // accumulator's columns {2t, 2t+1, 2t+8, 2t+9} of the same 16: P needs no shuffle.
#pragma unroll
    for (int b = 0; b < kB; ++b)
#pragma unroll
      for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int base = 8 * (2 * k + q / 2) + 2 * (q % 2);  // f index of column 2t of this 16, row g (+8)
          p[b][k][q] = pack_e4m3(f[b][base], f[b][base + 1]) | (pack_e4m3(f[b][base + 4], f[b][base + 5]) << 16);
        }
  }
};

// The query block's active key blocks and their K scales (`k_scale_bh`: this head's), into shared memory
__device__ __forceinline__ void stage_list(const int* active, const float* k_scale_bh, int count, int* list_kb,
                                           float* list_scale) {
  for (int j = threadIdx.x; j < count; j += kThreads) {
    const int kb = active[j];
    list_kb[j] = kb;
    list_scale[j] = k_scale_bh[kb];
  }
}

// The epilogue of one warp's 16 rows (this thread's: g and g + 8), the first at reordered position first_row:
// row sums, normalization, V's per-channel scale, each row written at its original position
__device__ __forceinline__ void store_rows(const float (&o)[kHeadDim / 2], const float (&l)[2], int first_row, int N,
                                           int order, int prefix, int frames, int height, int width,
                                           unsigned short* out_bh, long long stride_on, long long stride_od,
                                           const float* v_amax_bh, int g, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int pos = first_row + g + 8 * r;
    if (pos >= N) continue;
    // a row with no active block has sum 0 and writes zeros; a NaN sum (a NaN scale) stays NaN
    const float inv = sum == 0.f ? 0.f : 1.f / sum;
    const long long orig = reordered_to_original(pos, order, prefix, frames, height, width);
    unsigned short* dst = out_bh + orig * stride_on;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const int c = 8 * j + 2 * t;
      // a NaN in channel c of V makes its scale NaN: channel c of every row that read anything is NaN
      const float v0 = max_nan(v_amax_bh[c], kQuantEps) / 448.f;
      const float v1 = max_nan(v_amax_bh[c + 1], kQuantEps) / 448.f;
      float x0 = o[4 * j + 2 * r] * inv * v0, x1 = o[4 * j + 2 * r + 1] * inv * v1;
      if (sum == 0.f) x0 = x1 = 0.f;
      const unsigned packed = pack_out(x0, x1);
      if (stride_od == 1) {
        *reinterpret_cast<unsigned*>(dst + c) = packed;
      } else {
        dst[c * stride_od] = (unsigned short)(packed & 0xFFFFu);
        dst[(c + 1) * stride_od] = (unsigned short)(packed >> 16);
      }
    }
  }
}

#if !PARO_PRODUCER
extern "C" __global__ void __launch_bounds__(kThreads, 3 - kWarpgroups) paro_attention_int8_fp8(
    const signed char* __restrict__ qq, const float* __restrict__ q_scale, const signed char* __restrict__ kq,
    const float* __restrict__ k_scale, const unsigned char* __restrict__ vq, const float* __restrict__ v_amax,
    unsigned short* __restrict__ out, const int* __restrict__ orders, const int* __restrict__ counts,
    const int* __restrict__ indices, const int* __restrict__ schedule, const unsigned char* __restrict__ key_mask,
    long long stride_ob, long long stride_oh, long long stride_on, long long stride_od,
    long long stride_mb, long long stride_ms,
    int N, int n_pad, int H, int NQ, int NK, int max_active, int prefix, int frames, int height, int width,
    int suffix_start, float qk_scale, int has_key_mask) {
  extern __shared__ unsigned char shared_raw[];
  const unsigned shared_base = (smem_address(shared_raw) + 1023u) & ~1023u;
  const unsigned q_tile = shared_base;
  const unsigned kv_tiles = shared_base + kQBytes;
  // the query block's active key blocks and their K scales, staged in shared memory: read from global memory
  // inside the loop they would put two dependent load latencies on every block's critical path
  int* list_kb = reinterpret_cast<int*>(shared_raw + (kv_tiles + kStages * kStageBytes - smem_address(shared_raw)));
  float* list_scale = reinterpret_cast<float*>(list_kb + max_active);

  const int tid = threadIdx.x;
  const int wg = tid / 128;             // warpgroup: query rows wg * 64 ..
  const int warp = (tid % 128) / 32;    // rows warp * 16 .. of the warpgroup's 64
  const int lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // accumulator fragment: rows g and g + 8, columns 2t, 2t+1 of each 8

  // with one warpgroup per CTA, two CTAs take the two halves of a query block
  const int rank = blockIdx.x / (2 / kWarpgroups);
  const int half = kWarpgroups == 1 ? blockIdx.x % 2 : 0;
  const int bh = blockIdx.y;
  const int b = bh / H, h = bh % H;
  const int qb = schedule[h * NQ + rank];
  const int row = h * NQ + qb;
  const int count = counts[row];
  const int* active = indices + (long long)row * max_active;

  stage_list(active, k_scale + (long long)bh * NK, count, list_kb, list_scale);
  __syncthreads();

  const signed char* kq_bh = kq + (long long)bh * n_pad * kHeadDim;
  const unsigned char* vq_bh = vq + (long long)bh * kHeadDim * n_pad;
  const KVLoader loader(kq_bh, vq_bh, n_pad, tid);

  // Q tile and the first kStages - 1 key blocks, each its own cp.async group (empty groups past the list)
  if (count > 0) {
    const signed char* q_src = qq + (((long long)bh * NQ + qb) * kBlockM + half * 64) * kHeadDim;
#pragma unroll
    for (int i = 0; i < kQBytes / 16 / kThreads; ++i) {
      // contiguous rows; each warpgroup's 64 rows are a tile of their own, 1024-byte aligned
      const int c = tid + i * kThreads;
      cp_async_16(q_tile + swizzled<kHeadDim>(c * 16), q_src + c * 16);
    }
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count) loader.load(kv_tiles + s * kStageBytes, list_kb[s]);
    cp_async_commit();
  }

  Softmax sm;
  sm.score_scale = count > 0 ? qk_scale * q_scale[(long long)bh * NQ + qb] : 0.f;
  // key blocks from this one on may hold keys a query must not attend: positions >= N (the partial last
  // block) or padded keys of the suffix. Lists are ascending, so they are a list's last entries.
  const int first_masked = has_key_mask ? suffix_start / kBlockN : (N % kBlockN ? NK - 1 : NK);
  const int mask_start = has_key_mask ? suffix_start : N;
  const unsigned char* mask_b = key_mask + b * stride_mb;
  // the softmax of block j of the list, in its masked form only where the block can hold excluded keys
#define PARO_STEP(j, p, alpha)                                                                    \
  if (list_kb[j] >= first_masked)                                                                 \
    sm.step<true>(s, keys_kept(list_kb[j], first_masked, t, N, mask_start, mask_b, stride_ms), list_scale[j], \
                  p, alpha);                                                                      \
  else                                                                                            \
    sm.step<false>(s, 0xFFFFu, list_scale[j], p, alpha);

  float o[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;

  const unsigned q_desc_base = q_tile + wg * 64 * kHeadDim;
#if PARO_QK_AHEAD == 2
  // Software pipeline, per warpgroup, all products of an iteration waited within it: block i's P V runs
  // under block i+1's softmax (whose scores are ready), and block i+2's Q K^T under the update of O and the
  // next copies. Block b's tiles are cp.async group b (the Q tile rides with block 0).
  unsigned p[2][4];
  float alpha[2];
  int s[32];
  if (count > 0) {
    cp_async_wait<kStages - 2>();  // Q and block 0
    fence_proxy_async();
    __syncthreads();
    qk_product(s, q_desc_base, kv_tiles);
    wgmma_wait<0>();
    fence_registers(s);
    PARO_STEP(0, p, alpha);
    if (count > 1) {
      cp_async_wait<kStages - 3>();
      fence_proxy_async();
    }
    __syncthreads();
    // (a list of one block issues one product it does not use, as the last blocks do below: the same wgmma
    // groups on every path)
    qk_product(s, q_desc_base, kv_tiles + (count > 1 ? kStageBytes : 0));
    wgmma_wait<0>();
    fence_registers(s);
  }
  for (int i = 0; i < count; ++i) {
    const unsigned stage = kv_tiles + (i % kStages) * kStageBytes;
    // T = P V, into a zeroed accumulator
    float pv[kHeadDim / 2];
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 2; ++k) wgmma_pv(pv, p[k], smem_descriptor<kBlockN>(stage + kKBytes + k * 32), k > 0);
    wgmma_commit();
    unsigned p_next[2][4];
    float alpha_next[2];
    if (i + 1 < count) {
      PARO_STEP(i + 1, p_next, alpha_next);
    }
    // groups 0 .. i + kStages - 2 are committed: block i+2's has completed when at most kStages - 4 are pending
    if (i + 2 < count) {
      cp_async_wait<kStages - 4>();
      fence_proxy_async();
    }
    // after this barrier every thread has also completed block i-1's P V: its stage may be refilled
    __syncthreads();
    qk_product(s, q_desc_base, i + 2 < count ? kv_tiles + ((i + 2) % kStages) * kStageBytes : stage);
    wgmma_wait<1>();  // block i's P V (groups complete in order)
    fence_registers(pv);
    // O = alpha O + T in fp32
#pragma unroll
    for (int j = 0; j < kHeadDim / 2; ++j) o[j] = fmaf(o[j], alpha[(j >> 1) & 1], pv[j]);
    {
      const int refill = i + kStages - 1;  // into block i-1's stage
      if (refill < count) loader.load(kv_tiles + (refill % kStages) * kStageBytes, list_kb[refill]);
      cp_async_commit();
    }
    wgmma_wait<0>();  // block i+2's scores
    fence_registers(s);
    if (i + 1 < count) {
#pragma unroll
      for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int q = 0; q < 4; ++q) p[k][q] = p_next[k][q];
      alpha[0] = alpha_next[0];
      alpha[1] = alpha_next[1];
    }
  }
#else
  // Software pipeline by one key block, per warpgroup: while the tensor cores run block i's P V, the
  // warpgroup computes block i+1's softmax (its Q K^T was issued before). Block i's stage is read until its
  // P V completes; the stage of block i-1 is refilled (with block i + kStages - 1) after the barrier that
  // follows block i-1's P V in every thread.
  unsigned p[2][4];
  float alpha[2];
  if (count > 0) {
    cp_async_wait<kStages - 2>();  // Q and block 0
    fence_proxy_async();
    __syncthreads();
    int s[32];
    qk_product(s, q_desc_base, kv_tiles);
    wgmma_wait<0>();
    fence_registers(s);
    PARO_STEP(0, p, alpha);
  }
  for (int i = 0; i < count; ++i) {
    const bool has_next = i + 1 < count;
    const unsigned stage = kv_tiles + (i % kStages) * kStageBytes;
    const unsigned next_stage = kv_tiles + ((i + 1) % kStages) * kStageBytes;
    if (has_next) {
      // blocks 0 .. i + kStages - 2 are committed: block i+1 has landed when at most kStages - 3 are pending
      cp_async_wait<kStages - 3>();
      fence_proxy_async();
    }
    __syncthreads();
    // (the last block issues one product it does not use, on its own stage: the wgmma groups stay the same
    // on every path, which keeps ptxas from serializing them)
    int s[32];
    qk_product(s, q_desc_base, has_next ? next_stage : stage);
    // T = P V, into a zeroed accumulator
    float pv[kHeadDim / 2];
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 2; ++k) wgmma_pv(pv, p[k], smem_descriptor<kBlockN>(stage + kKBytes + k * 32), k > 0);
    wgmma_commit();
    unsigned p_next[2][4];
    float alpha_next[2];
    wgmma_wait<1>();  // groups complete in order: block i+1's scores are ready, P V may still run
    fence_registers(s);
    if (has_next) {
      PARO_STEP(i + 1, p_next, alpha_next);
    }
    wgmma_wait<0>();
    fence_registers(pv);
    // O = alpha O + T in fp32
#pragma unroll
    for (int j = 0; j < kHeadDim / 2; ++j) o[j] = fmaf(o[j], alpha[(j >> 1) & 1], pv[j]);
    // the stage of block i-1 is free since the barrier above: fetch block i + kStages - 1 into it (here, where
    // few registers are live)
    {
      const int refill = i + kStages - 1;
      if (refill < count) loader.load(kv_tiles + (refill % kStages) * kStageBytes, list_kb[refill]);
      cp_async_commit();
    }
    if (has_next) {
#pragma unroll
      for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int q = 0; q < 4; ++q) p[k][q] = p_next[k][q];
      alpha[0] = alpha_next[0];
      alpha[1] = alpha_next[1];
    }
  }
#endif
#undef PARO_STEP
  cp_async_wait<0>();

  store_rows(o, sm.l, qb * kBlockM + (half + wg) * 64 + warp * 16, N, orders[h], prefix, frames, height, width,
             out + b * stride_ob + h * stride_oh, stride_on, stride_od, v_amax + (long long)bh * kHeadDim, g, t);
}
#else
// Warp-specialized: warpgroup 0 copies Q and the K/V tiles (cp.async, each stage handed over by mbarriers:
// `full` when its tiles landed, `empty` when every consumer warp finished reading it), warpgroups 1 ..
// kWarpgroups compute 64 query rows each, sharing every K/V stage. setmaxnreg moves the producer's registers
// to the consumers. With PARO_PINGPONG the consumers take turns at issuing their products (named barriers
// 1 and 2), so one's softmax runs under the other's tensor-core work.
constexpr int kConsumerRegs = PARO_PRODUCER_REGS == 24 ? 240 : 232;
constexpr int kBarrierBytes = 256;
static_assert(16 * kStages + 8 <= kBarrierBytes, "barriers");

extern "C" __global__ void __launch_bounds__(kThreads, 1) paro_attention_int8_fp8(
    const signed char* __restrict__ qq, const float* __restrict__ q_scale, const signed char* __restrict__ kq,
    const float* __restrict__ k_scale, const unsigned char* __restrict__ vq, const float* __restrict__ v_amax,
    unsigned short* __restrict__ out, const int* __restrict__ orders, const int* __restrict__ counts,
    const int* __restrict__ indices, const int* __restrict__ schedule, const unsigned char* __restrict__ key_mask,
    long long stride_ob, long long stride_oh, long long stride_on, long long stride_od,
    long long stride_mb, long long stride_ms,
    int N, int n_pad, int H, int NQ, int NK, int max_active, int prefix, int frames, int height, int width,
    int suffix_start, float qk_scale, int has_key_mask) {
  extern __shared__ unsigned char shared_raw[];
  const unsigned shared_base = (smem_address(shared_raw) + 1023u) & ~1023u;
  const unsigned q_tile = shared_base;
  const unsigned kv_tiles = shared_base + kQBytes;
  const unsigned full_bar = kv_tiles + kStages * kStageBytes;  // kStages barriers, then kStages `empty`, Q's
  const unsigned empty_bar = full_bar + 8 * kStages;
  const unsigned q_bar = empty_bar + 8 * kStages;
  int* list_kb = reinterpret_cast<int*>(shared_raw + (full_bar + kBarrierBytes - smem_address(shared_raw)));
  float* list_scale = reinterpret_cast<float*>(list_kb + max_active);

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int bh = blockIdx.y;
  const int b = bh / H, h = bh % H;
  const int qb = schedule[h * NQ + blockIdx.x];
  const int row = h * NQ + qb;
  const int count = counts[row];
  const int* active = indices + (long long)row * max_active;
  stage_list(active, k_scale + (long long)bh * NK, count, list_kb, list_scale);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_bar + 8 * s, 128);
      mbar_init(empty_bar + 8 * s, 4 * kWarpgroups);
    }
    mbar_init(q_bar, 128);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PARO_PRODUCER_REGS));
    if (count > 0) {
      const signed char* q_src = qq + ((long long)bh * NQ + qb) * kBlockM * kHeadDim;
#pragma unroll
      for (int i = 0; i < kQBytes / 16 / 128; ++i) {
        const int c = tid + i * 128;
        cp_async_16(q_tile + swizzled<kHeadDim>(c * 16), q_src + c * 16);
      }
      mbar_arrive_cp_async(q_bar);
      const KVLoader loader(kq + (long long)bh * n_pad * kHeadDim, vq + (long long)bh * kHeadDim * n_pad, n_pad,
                            tid);
      for (int i = 0; i < count; ++i) {
        const int s = i % kStages;
        if (i >= kStages) mbar_wait(empty_bar + 8 * s, ((i / kStages) + 1) & 1);
        loader.load(kv_tiles + s * kStageBytes, list_kb[i]);
        mbar_arrive_cp_async(full_bar + 8 * s);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));

  const int c = wg - 1;                // consumer: query rows c * 64 ..
  const int warp = (tid % 128) / 32;   // rows warp * 16 .. of the consumer's 64
  const int lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  Softmax sm;
  sm.score_scale = count > 0 ? qk_scale * q_scale[(long long)bh * NQ + qb] : 0.f;
  const int first_masked = has_key_mask ? suffix_start / kBlockN : (N % kBlockN ? NK - 1 : NK);
  const int mask_start = has_key_mask ? suffix_start : N;
  const unsigned char* mask_b = key_mask + b * stride_mb;
  constexpr int kStep = PARO_STEP_BLOCKS;
  // block x of step j is entry kStep * j + x of the list; an entry past the list attends nothing and reads
  // the step's first stage (finite values, P = 0)
  auto stage_of = [&](int e) { return kv_tiles + (unsigned)(e % kStages) * kStageBytes; };
  auto wait_step = [&](int j) {
#pragma unroll
    for (int x = 0; x < kStep; ++x) {
      const int e = kStep * j + x;
      if (e < count) mbar_wait(full_bar + 8 * (e % kStages), (e / kStages) & 1);
    }
    fence_proxy_async();
  };
  auto softmax_step = [&](int j, int (&s)[kStep][32], unsigned (&pj)[kStep][2][4], float (&aj)[2]) {
    bool masked = false;
    float scale[kStep];
#pragma unroll
    for (int x = 0; x < kStep; ++x) {
      const int e = kStep * j + x;
      scale[x] = e < count ? list_scale[e] : 1.f;
      masked |= e >= count || list_kb[e] >= first_masked;
    }
    if (masked) {
      unsigned kept[kStep];
#pragma unroll
      for (int x = 0; x < kStep; ++x) {
        const int e = kStep * j + x;
        kept[x] = e < count ? keys_kept(list_kb[e], first_masked, t, N, mask_start, mask_b, stride_ms) : 0u;
      }
      sm.steps<kStep, true>(s, kept, scale, pj, aj);
    } else {
      unsigned kept[kStep];
#pragma unroll
      for (int x = 0; x < kStep; ++x) kept[x] = 0xFFFFu;
      sm.steps<kStep, false>(s, kept, scale, pj, aj);
    }
  };

  float o[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
  const unsigned q_op = q_tile + c * 64 * kHeadDim;
  const int steps = (count + kStep - 1) / kStep;
  unsigned p[kStep][2][4];
  float alpha[2];
#if PARO_PINGPONG
  if (c == 1 && count > 0) named_arrive(1, 256);  // consumer 0 issues first
#endif
  if (count > 0) {
    mbar_wait(q_bar, 0);
    wait_step(0);
    int s[kStep][32];
#pragma unroll
    for (int x = 0; x < kStep; ++x) qk_product(s[x], q_op, stage_of(x < count ? x : 0));
    wgmma_wait<0>();
#pragma unroll
    for (int x = 0; x < kStep; ++x) fence_registers(s[x]);
    softmax_step(0, s, p, alpha);
  }
  for (int j = 0; j < steps; ++j) {
    const bool has_next = j + 1 < steps;
    const int first = kStep * j;
    if (has_next) wait_step(j + 1);
#if PARO_PINGPONG
    named_sync(1 + c, 256);
#endif
    int s[kStep][32];
#pragma unroll
    for (int x = 0; x < kStep; ++x) {
      const int e = first + kStep + x;
      qk_product(s[x], q_op, stage_of(has_next && e < count ? e : first));
    }
#if PARO_PV_INTO_O
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
    float (&pv)[kHeadDim / 2] = o;
#else
    float pv[kHeadDim / 2];
#endif
    wgmma_fence();
#pragma unroll
    for (int x = 0; x < kStep; ++x) {
      const unsigned v_tile = stage_of(first + x < count ? first + x : first) + kKBytes;
#pragma unroll
      for (int k = 0; k < 2; ++k)
        wgmma_pv(pv, p[x][k], smem_descriptor<kBlockN>(v_tile + k * 32), PARO_PV_INTO_O || (x | k) > 0);
    }
    wgmma_commit();
#if PARO_PINGPONG
    named_arrive(2 - c, 256);
#endif
    unsigned p_next[kStep][2][4];
    float alpha_next[2];
    wgmma_wait<1>();
#pragma unroll
    for (int x = 0; x < kStep; ++x) fence_registers(s[x]);
    if (has_next) softmax_step(j + 1, s, p_next, alpha_next);
    wgmma_wait<0>();
    fence_registers(pv);
    if (lane == 0) {
#pragma unroll
      for (int x = 0; x < kStep; ++x)
        if (first + x < count) mbar_arrive(empty_bar + 8 * ((first + x) % kStages));
    }
#if !PARO_PV_INTO_O
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o[i] = fmaf(o[i], alpha[(i >> 1) & 1], pv[i]);
#endif
    if (has_next) {
#pragma unroll
      for (int x = 0; x < kStep; ++x)
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
          for (int q = 0; q < 4; ++q) p[x][k][q] = p_next[x][k][q];
      alpha[0] = alpha_next[0];
      alpha[1] = alpha_next[1];
    }
  }
#if PARO_PINGPONG
  if (c == 0 && count > 0) named_sync(1, 256);  // consumer 1's last turn signal
#endif

  store_rows(o, sm.l, qb * kBlockM + c * 64 + warp * 16, N, orders[h], prefix, frames, height, width,
             out + b * stride_ob + h * stride_oh, stride_on, stride_od, v_amax + (long long)bh * kHeadDim, g, t);
}
#endif
