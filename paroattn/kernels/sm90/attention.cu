// Block-sparse PARO attention for sm_90a: INT8 QK and FP8 (e4m3) PV on wgmma, compiled at run time.
//
// A CTA is one warpgroup. It computes 64 query rows (one half of a 128-row block of the lists) of one
// (batch, head) against the block's active 64-key blocks, reading the K/V (and Q) prologue's outputs
// (`launch.prepare_kv`) through TMA tensor maps built on the host:
//   QQ  int8 [B*H, NQ*128, D]   reordered queries, per query block scale QScale [B*H, NQ]
//   KQ  int8 [B*H, N_PAD, D]    reordered keys minus K smoothing's mean, per key block scale KScale [B*H, NK]
//                               (PARO_K_PER_KEY: per key, KScale [B*H, N_PAD])
//   VQ  e4m3 [B*H, D, N_PAD]    reordered values, transposed, divided by their per-channel scale
//                               VAmax / 448; inside every 16 keys in the order the PV operand reads (below)
// A key step takes two blocks of the list (a list of odd length ends with a step of one):
//   copies      one thread issues the TMA copies: the two K blocks into the halves of one 128-row K tile,
//               their V^T blocks into two tiles, each tile set completing on its mbarrier (expect_tx). The
//               next step's K is issued as soon as this step's Q K^T has completed, its V as soon as this
//               step's P V has: one buffer each, and no CTA barrier in the loop. With per-key K scales the
//               blocks' scales come with K (bulk copies on K's mbarrier) into one of two buffers by step
//               parity: the softmax still reads this step's while the next step's land
//   S = Q K^T   wgmma m64n128k32 s32.s8.s8, one product over both blocks, Q and K from shared memory
//   softmax     online, in base 2, one running max per step: sm_scale * log2(e) and the Q/K scales are one
//               multiplier per block, applied inside exp2's argument (per-key K scales: each score is taken
//               times its key's scale first, one FMA, and the multiplier is Q's); P carries the fp8 multiplier 448
//   T = P V     wgmma m64nDk32 f32.e4m3.e4m3 with P in registers and V^T from shared memory, into a zeroed
//               accumulator added to O in fp32 (Hopper's fp8 product accumulates with ~22 bits, O would lose
//               low bits over a long row)
// Within a CTA the loop is serial (copy, product, wait, softmax, product, wait): tensor-core and softmax
// work overlap across the CTAs of an SM, 3 at head dim 128 and 4 at 64, which the register ceilings of
// __launch_bounds__ allow. Query tiles run heaviest first within a head (the lists' schedule).
// The epilogue divides by the row sum, applies V's per-channel scale and writes each row at its ORIGINAL
// token position; a row with no active block writes zeros. The torch reference (reference.py) is the
// definition of every value.
//
// Compile-time configuration (defines passed to the compiler): PARO_HEAD_DIM (64 or 128), PARO_OUT_BF16
// (1: bf16 output, 0: fp16), PARO_K_PER_KEY (1: one K scale per key, 0: per key block). No headers: NVRTC
// compiles this file as is.

#ifndef PARO_HEAD_DIM
#define PARO_HEAD_DIM 128
#endif
#ifndef PARO_OUT_BF16
#define PARO_OUT_BF16 1
#endif
#ifndef PARO_K_PER_KEY
#define PARO_K_PER_KEY 0
#endif

namespace paro {

constexpr int kHeadDim = PARO_HEAD_DIM;
constexpr int kBlockM = 128;  // query rows per block of the lists
constexpr int kTileM = 64;    // query rows per CTA
constexpr int kBlockN = 64;   // keys per block
constexpr int kThreads = 128;
constexpr int kCtasPerSm = kHeadDim == 128 ? 3 : 4;  // register ceilings 168 and 128
constexpr int kQBytes = kTileM * kHeadDim;
constexpr int kKBlockBytes = kBlockN * kHeadDim;
constexpr int kVBlockBytes = kHeadDim * kBlockN;
constexpr bool kPerKey = PARO_K_PER_KEY;
constexpr int kKeyScaleBytes = kBlockN * 4;  // one K block's scales per key (float)
// Q, two K blocks, two V^T blocks, and with per-key K scales two buffers (by step parity) of two blocks' scales
constexpr int kTileBytes = kQBytes + 2 * kKBlockBytes + 2 * kVBlockBytes + (kPerKey ? 4 * kKeyScaleBytes : 0);
constexpr int kBarrierBytes = 48;  // three mbarriers, then CtaInfo
constexpr float kPLog2Scale = 8.807354922057604f;  // log2(448): P is stored as P * 448 in e4m3
constexpr float kScoreOffset = 12582912.0f;         // 1.5 * 2^23 (see score_with_offset)
constexpr float kQuantEps = 1e-8f;                  // reference.QUANT_EPS

static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim 64 or 128");

// A CUtensorMap (the driver's 128-byte opaque type), passed by value as a __grid_constant__ parameter
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// What the epilogue and the masked steps need of the CTA, kept in shared memory rather than in registers
// across the loop (at the register ceiling they would spill)
struct CtaInfo {
  int qb, b, h;
};

template <int v>
struct Int {
  static constexpr int value = v;
};

// Shared memory tiles are in the layouts wgmma's descriptors name and TMA's swizzle modes write: rows of
// `row_bytes` (64 or 128) 8-bit elements along the reduction (K-major), 16-byte chunks XOR-swizzled by the
// row within each group of 8 rows (the 64B and 128B swizzle modes). A tile starts on a 1024-byte boundary.
// A wgmma shared-memory matrix descriptor: the low word holds the start address / 16 (bits 0-13) and the
// leading byte offset / 16 (bits 16-29; unused for swizzled K-major tiles, 1 by convention), the high word
// the stride byte offset / 16 (8 rows) and the swizzle mode. `low_word(address)` once per kernel; a tile or a
// 32-byte slice of one is then that word plus its offset / 16 (no carry: shared addresses are below 2^18).
__device__ __forceinline__ unsigned low_word(unsigned smem_address) { return ((smem_address & 0x3FFFFu) >> 4) | (1u << 16); }
template <int row_bytes>
__device__ __forceinline__ unsigned long long smem_descriptor(unsigned low) {
  constexpr unsigned high = ((8 * row_bytes) >> 4) | ((row_bytes == 128 ? 1u : 2u) << 30);
  return ((unsigned long long)high << 32) | low;
}

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// this thread's arrival on `bar`, which then also waits for `bytes` of copies to land
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
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

// TMA: the box of `map` at element coordinates (x: innermost, y) into shared memory at dst, completing on bar
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap* map, unsigned bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(bar), "r"(x), "r"(y)
      : "memory");
}
// A bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory at src into shared
// memory at dst, completing on bar
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
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

// wgmma operand lists
#define PARO_REGS_32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PARO_REGS_64 PARO_REGS_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define PARO_INT(x) "+r"(x)
#define PARO_FLOAT(x) "+f"(x)
#define PARO_8(m, d, i) m(d[i]), m(d[i + 1]), m(d[i + 2]), m(d[i + 3]), m(d[i + 4]), m(d[i + 5]), m(d[i + 6]), m(d[i + 7])
#define PARO_32(m, d) PARO_8(m, d, 0), PARO_8(m, d, 8), PARO_8(m, d, 16), PARO_8(m, d, 24)
#define PARO_64(m, d) PARO_32(m, d), PARO_8(m, d, 32), PARO_8(m, d, 40), PARO_8(m, d, 48), PARO_8(m, d, 56)

// S[64 x 64 kB] (s32) (+)= Q[64 x 32] K[64 kB x 32]^T, int8, both K-major in shared memory. s[b] holds key block b:
// its accumulator layout is that of an m64n64 product. kAccumulate 0 overwrites S (an immediate: ptxas then knows
// S's old values are not read).
template <int kAccumulate>
__device__ __forceinline__ void wgmma_qk(int (&s)[1][32], unsigned long long desc_q, unsigned long long desc_k) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {" PARO_REGS_32 "}, %32, %33, %34;\n"
               : PARO_32(PARO_INT, s[0])
               : "l"(desc_q), "l"(desc_k), "n"(kAccumulate));
}
template <int kAccumulate>
__device__ __forceinline__ void wgmma_qk(int (&s)[2][32], unsigned long long desc_q, unsigned long long desc_k) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {" PARO_REGS_64 "}, %64, %65, %66;\n"
               : PARO_32(PARO_INT, s[0]), PARO_32(PARO_INT, s[1])
               : "l"(desc_q), "l"(desc_k), "n"(kAccumulate));
}

// T[64 x D] (f32) (+)= P[64 x 32] V^T[D x 32]^T, e4m3, P in registers, V^T K-major in shared memory
template <int kAccumulate>
__device__ __forceinline__ void wgmma_pv(float (&d)[32], const unsigned (&p)[4], unsigned long long desc_v) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {" PARO_REGS_32
               "}, {%32, %33, %34, %35}, %36, %37, 1, 1;\n"
               : PARO_32(PARO_FLOAT, d)
               : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(desc_v), "n"(kAccumulate));
}
template <int kAccumulate>
__device__ __forceinline__ void wgmma_pv(float (&d)[64], const unsigned (&p)[4], unsigned long long desc_v) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" PARO_REGS_64
               "}, {%64, %65, %66, %67}, %68, %69, 1, 1;\n"
               : PARO_64(PARO_FLOAT, d)
               : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(desc_v), "n"(kAccumulate));
}

// S = Q K^T of kB key blocks (K tile: kB * 64 rows): D / 32 products over 32 channels each, issued and
// committed. `q`, `k`: the tiles' descriptor low words.
template <int kB>
__device__ __forceinline__ void qk_product(int (&s)[kB][32], unsigned q, unsigned k) {
  wgmma_fence();
  wgmma_qk<0>(s, smem_descriptor<kHeadDim>(q), smem_descriptor<kHeadDim>(k));
#pragma unroll
  for (int c = 1; c < kHeadDim / 32; ++c)
    wgmma_qk<1>(s, smem_descriptor<kHeadDim>(q + 2 * c), smem_descriptor<kHeadDim>(k + 2 * c));
  wgmma_commit();
}

// T = P V of kB key blocks (V^T tiles of D rows x 64 keys, 64B-swizzled, one after the other; `v`: the first's
// descriptor low word), into a zeroed accumulator: two 32-key slices per block; issued and committed
template <int kB>
__device__ __forceinline__ void pv_product(float (&t)[kHeadDim / 2], const unsigned (&p)[kB][2][4], unsigned v) {
  wgmma_fence();
  wgmma_pv<0>(t, p[0][0], smem_descriptor<kBlockN>(v));
  wgmma_pv<1>(t, p[0][1], smem_descriptor<kBlockN>(v + 2));
#pragma unroll
  for (int b = 1; b < kB; ++b) {
#pragma unroll
    for (int k = 0; k < 2; ++k) wgmma_pv<1>(t, p[b][k], smem_descriptor<kBlockN>(v + (b * kVBlockBytes + k * 32) / 16));
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

// The per-key K scales of a thread's two adjacent columns 2t, 2t + 1 of one 8 (one 8-byte shared load)
struct alignas(8) KeyScales {
  float even, odd;
};

// The online softmax of the warpgroup's 64 rows; a thread holds rows g and g + 8 of its warp's 16 (index
// r = 0, 1) and of each 64-key block the columns 8j + 2t + {0, 1}, j < 8.
struct Softmax {
  float m[2] = {-__int_as_float(0x7f800000), -__int_as_float(0x7f800000)};  // running max, log2 units
  float l[2] = {0.f, 0.f};  // this thread's part of the row sums (of P * 448)
  float score_scale;        // sm_scale * log2(e) * Q's block scale

  // kB key blocks in one step: their integer scores s[b] (K scale block_scale[b], or with kPerKey the scale of
  // key 8j + 2t + e at key_scale[b * 64 + 8j + e], key_scale in shared memory and offset by 2t already; keys
  // kept[b]: keys_kept) -> their P as e4m3 A operands p[b] (P * 448), with one running max and one factor alpha
  // that rescales what came before. A step whose keys are all excluded (padding) leaves everything as it was.
  template <int kB, bool kMasked>
  __device__ __forceinline__ void step(int (&s)[kB][32], const unsigned (&kept)[kB], const float (&block_scale)[kB],
                                       const float* key_scale, unsigned (&p)[kB][2][4], float (&alpha)[2]) {
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
      // the multiplier that takes f to log2 units. Per key, f is the score times its key's scale already (and
      // without the offset, which no longer folds into one term per row): Q's scale and the softmax's are left
      scale[b] = kPerKey ? score_scale : score_scale * block_scale[b];
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        // f[b][4 * (j / 4) + e]: column 8 * (j / 4) + 2t + (e & 1), row g + 8 * (e >> 1)
        f[b][j] = score_with_offset(s[b][j]);
        if (kPerKey) {
          // (1.5 * 2^23 + x) c - 1.5 * 2^23 c, the product exact in the FMA: x c within an ulp of 1.5 * 2^23 c
          // (below one integer unit of x, as the per-block offset term's rounding), then rounded once
          const KeyScales c = reinterpret_cast<const KeyScales*>(key_scale + b * kBlockN + 8 * (j / 4))[0];
          const float cj = (j & 1) ? c.odd : c.even;
          f[b][j] = fmaf(f[b][j], cj, -kScoreOffset * cj);
        }
        // excluded after the scaling: a NaN scale of an excluded key (padding) reaches no row
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
        mx = fmaxf(mx, (kPerKey ? mb : mb - kScoreOffset) * scale[b]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = any ? fmaxf(m[r], mx) : m[r];
      alpha[r] = any ? exp2_approx(m[r] - m_new) : 1.f;
      // P's multiplier 448 rides in the exponent: p = 448 * exp2(x * scale - m_new)
#pragma unroll
      for (int b = 0; b < kB; ++b) shift[b][r] = m_new - kPLog2Scale + (kPerKey ? 0.f : kScoreOffset * scale[b]);
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

// The query block's active key blocks and their K scales (`k_scale_bh`: this head's; per key they come with the K
// blocks instead), into shared memory
__device__ __forceinline__ void stage_list(const int* active, const float* k_scale_bh, int count, int* list_kb,
                                           float* list_scale) {
  for (int j = threadIdx.x; j < count; j += kThreads) {
    const int kb = active[j];
    list_kb[j] = kb;
    if (!kPerKey) list_scale[j] = k_scale_bh[kb];
  }
}

// The epilogue of one warp's 16 rows (this thread's: g and g + 8), the first at reordered position first_row:
// row sums, normalization, V's per-channel scale, each row written at its original position. O is packed to
// the output dtype first, so its fp32 registers are free before the address arithmetic.
__device__ __forceinline__ void store_rows(const float (&o)[kHeadDim / 2], const float (&l)[2], int first_row, int N,
                                           int order, int prefix, int frames, int height, int width,
                                           unsigned short* out_bh, long long stride_on, long long stride_od,
                                           const float* v_amax_bh, int g, int t) {
  float sum[2], inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sum[r] = l[r];
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
    sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    // a row with no active block has sum 0 and writes zeros; a NaN sum (a NaN scale) stays NaN
    inv[r] = sum[r] == 0.f ? 0.f : 1.f / sum[r];
  }
  unsigned packed[2][kHeadDim / 8];
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
    const int c = 8 * j + 2 * t;
    // a NaN in channel c of V makes its scale NaN: channel c of every row that read anything is NaN
    const float v0 = max_nan(v_amax_bh[c], kQuantEps) / 448.f;
    const float v1 = max_nan(v_amax_bh[c + 1], kQuantEps) / 448.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float x0 = o[4 * j + 2 * r] * inv[r] * v0, x1 = o[4 * j + 2 * r + 1] * inv[r] * v1;
      if (sum[r] == 0.f) x0 = x1 = 0.f;
      packed[r][j] = pack_out(x0, x1);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int pos = first_row + g + 8 * r;
    if (pos >= N) continue;
    const long long orig = reordered_to_original(pos, order, prefix, frames, height, width);
    unsigned short* dst = out_bh + orig * stride_on + 2 * t * stride_od;
    if (stride_od == 1) {
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) *reinterpret_cast<unsigned*>(dst + 8 * j) = packed[r][j];
    } else {
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        dst[8 * j * stride_od] = (unsigned short)(packed[r][j] & 0xFFFFu);
        dst[(8 * j + 1) * stride_od] = (unsigned short)(packed[r][j] >> 16);
      }
    }
  }
}

// A CTA's pass over its query block's list: the copies and the key steps. (A struct rather than lambdas in
// the kernel: NVRTC compiles no generic lambda in device code.)
struct Pass {
  const TensorMap* k_map;
  const TensorMap* v_map;
  unsigned k_bar, v_bar;   // mbarriers of the K and V tiles
  unsigned k_tile, v_tile;  // shared addresses of the two-block K and V^T tiles
  unsigned q_desc;          // the Q tile's descriptor low word (the others: plus their offset / 16)
  int k_row, v_row;         // this head's first row in k_map and in v_map
  const int* list_kb;       // the active list and the blocks' K scales, in shared memory
  const float* list_scale;
  const float* k_scale_bh;  // kPerKey: this head's K scales per key [N_PAD] in global memory
  const float* key_scales;  // kPerKey: their two buffers in shared memory (two blocks each, one buffer per step parity)
  int count;
  bool copier;              // the thread that issues the copies
  // excluded keys (keys_kept)
  int first_masked, N, mask_start, t;
  const unsigned char* key_mask;
  long long stride_mb, stride_ms;
  const volatile CtaInfo* info;

  // the K and V^T blocks of list entries e .. e + nb - 1 (nb 1 or 2) into their tiles, by the calling thread; per
  // key, K's scales into the buffer of the step's parity (steps start at even e: step e / 2)
  __device__ __forceinline__ void copy_k(int e, int nb) const {
    mbar_expect_tx(k_bar, nb * (kKBlockBytes + (kPerKey ? kKeyScaleBytes : 0)));
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      if (x < nb) {
        tma_load(k_tile + x * kKBlockBytes, k_map, k_bar, 0, k_row + list_kb[e + x] * kBlockN);
        if (kPerKey)
          bulk_load(v_tile + 2 * kVBlockBytes + (((e >> 1) & 1) * 2 + x) * kKeyScaleBytes,
                    k_scale_bh + list_kb[e + x] * kBlockN, kKeyScaleBytes, k_bar);
      }
    }
  }
  __device__ __forceinline__ void copy_v(int e, int nb) const {
    mbar_expect_tx(v_bar, nb * kVBlockBytes);
#pragma unroll
    for (int x = 0; x < 2; ++x)
      if (x < nb) tma_load(v_tile + x * kVBlockBytes, v_map, v_bar, list_kb[e + x] * kBlockN, v_row);
  }

  // one key step: list entries e .. e + kB - 1, whose tiles land with phase `phase` of the barriers
  template <int kB, bool kMasked>
  __device__ __forceinline__ void step(int e, unsigned phase, Softmax& sm, float (&o)[kHeadDim / 2]) const {
    mbar_wait(k_bar, phase);
    int s[kB][32];
    qk_product(s, q_desc, q_desc + kQBytes / 16);
    wgmma_wait_all();
#pragma unroll
    for (int x = 0; x < kB; ++x) fence_registers(s[x]);
    // the warpgroup's Q K^T has completed, so the K tile is free: the next step's blocks
    const int next = e + kB;
    if (copier && next < count) copy_k(next, next + 1 < count ? 2 : 1);
    unsigned kept[kB];
    float scale[kB];
#pragma unroll
    for (int x = 0; x < kB; ++x) {
      scale[x] = kPerKey ? 1.f : list_scale[e + x];
      kept[x] = kMasked ? keys_kept(list_kb[e + x], first_masked, t, N, mask_start, key_mask + info->b * stride_mb,
                                    stride_ms)
                        : 0xFFFFu;
    }
    unsigned p[kB][2][4];
    float alpha[2];
    // per key: this step's buffer (the next step's copies fill the other), at this thread's columns 2t, 2t + 1
    sm.step<kB, kMasked>(s, kept, scale, key_scales + ((e >> 1) & 1) * 2 * kBlockN + 2 * t, p, alpha);
    mbar_wait(v_bar, phase);
    float pv[kHeadDim / 2];
    pv_product(pv, p, q_desc + (kQBytes + 2 * kKBlockBytes) / 16);
    wgmma_wait_all();
    fence_registers(pv);
    // the P V product has completed, so the V tiles are free
    if (copier && next < count) copy_v(next, next + 1 < count ? 2 : 1);
    // O = alpha O + T in fp32
#pragma unroll
    for (int j = 0; j < kHeadDim / 2; ++j) o[j] = fmaf(o[j], alpha[(j >> 1) & 1], pv[j]);
  }
};

}  // namespace paro

using namespace paro;

// Grid: (2 * NQ, B * H), 128 threads. Tensor maps (2-D, uint8 elements, boxes as below):
//   q_map  [B*H*NQ*128 rows, D]   box 64 x D, swizzled by D bytes (128B or 64B)
//   k_map  [B*H*N_PAD rows, D]    box 64 x D, the same swizzle
//   v_map  [B*H*D rows, N_PAD]    box D x 64, 64B swizzle
// Dynamic shared memory: the tiles (kTileBytes, per-key K scales included), three mbarriers, then the active list
// (max_active block indices and as many K scales).
extern "C" __global__ void __launch_bounds__(kThreads, kCtasPerSm) paro_attention_int8_fp8(
    const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
    const __grid_constant__ TensorMap v_map, const float* __restrict__ q_scale, const float* __restrict__ k_scale,
    const float* __restrict__ v_amax, unsigned short* __restrict__ out, const int* __restrict__ orders,
    const int* __restrict__ counts, const int* __restrict__ indices, const int* __restrict__ schedule,
    const unsigned char* __restrict__ key_mask, long long stride_ob, long long stride_oh, long long stride_on,
    long long stride_od, long long stride_mb, long long stride_ms, int N, int n_pad, int H, int NQ, int NK,
    int max_active, int prefix, int frames, int height, int width, int suffix_start, float qk_scale,
    int has_key_mask) {
  // the kernel has no static shared memory, so the dynamic block starts where the CTA's shared memory does, on
  // a 1024-byte boundary (the swizzle modes' alignment; checked: a misplaced tile would read garbage silently)
  extern __shared__ __align__(1024) unsigned char shared_raw[];
  const unsigned q_tile = smem_address(shared_raw);
  if (q_tile % 1024u != 0) asm volatile("trap;");
  const unsigned k_tile = q_tile + kQBytes;           // two 64-row K blocks: one 128-row operand
  const unsigned v_tile = k_tile + 2 * kKBlockBytes;  // two V^T blocks of D rows x 64 keys
  const unsigned q_bar = q_tile + kTileBytes;         // mbarriers: the Q, K and V tiles have landed
  const unsigned k_bar = q_bar + 8, v_bar = q_bar + 16;
  volatile CtaInfo* info = reinterpret_cast<volatile CtaInfo*>(shared_raw + kTileBytes + 24);
  // the query block's active key blocks and their K scales, staged in shared memory: read from global memory
  // inside the loop they would put two dependent load latencies on every step
  int* list_kb = reinterpret_cast<int*>(shared_raw + kTileBytes + kBarrierBytes);
  float* list_scale = reinterpret_cast<float*>(list_kb + max_active);

  const unsigned tid = threadIdx.x;
  const int warp = tid / 32;  // rows warp * 16 .. of the CTA's 64
  const int g = (tid % 32) / 4, t = tid % 4;  // accumulator fragment: rows g and g + 8, columns 2t, 2t+1 of each 8
  const int rank = blockIdx.x / 2, half = blockIdx.x % 2;  // two CTAs take the two halves of a query block
  const int bh = blockIdx.y;
  const int b = bh / H, h = bh % H;
  const int qb = schedule[h * NQ + rank];
  const int row = h * NQ + qb;
  const int count = counts[row];

  stage_list(indices + (long long)row * max_active, k_scale + (long long)bh * NK, count, list_kb, list_scale);
  if (tid == 0) {
    info->qb = qb;
    info->b = b;
    info->h = h;
    mbar_init(q_bar, 1);
    mbar_init(k_bar, 1);
    mbar_init(v_bar, 1);
    mbar_init_fence();
  }
  __syncthreads();

  const Pass pass{&k_map, &v_map, k_bar, v_bar, k_tile, v_tile, low_word(q_tile), bh * n_pad, bh * kHeadDim,
                  list_kb, list_scale, k_scale + (long long)bh * n_pad,
                  reinterpret_cast<const float*>(shared_raw + kQBytes + 2 * kKBlockBytes + 2 * kVBlockBytes), count,
                  tid == 0,
                  // key blocks from this one on may hold keys a query must not attend: positions >= N (the partial
                  // last block) or padded keys of the suffix. Lists are ascending: they are a list's last entries.
                  has_key_mask ? suffix_start / kBlockN : (N % kBlockN ? NK - 1 : NK), N,
                  has_key_mask ? suffix_start : N, t, key_mask, stride_mb, stride_ms, info};
  if (tid == 0 && count > 0) {
    mbar_expect_tx(q_bar, kQBytes);
    tma_load(q_tile, &q_map, q_bar, 0, (bh * NQ + qb) * kBlockM + half * kTileM);
    pass.copy_k(0, count > 1 ? 2 : 1);
    pass.copy_v(0, count > 1 ? 2 : 1);
  }

  Softmax sm;
  sm.score_scale = count > 0 ? qk_scale * q_scale[(long long)bh * NQ + qb] : 0.f;
  float o[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;

  if (count > 0) mbar_wait(q_bar, 0);
  int e = 0;
  unsigned phase = 0;
  // steps of two blocks without excluded keys, then those with (the list's last), then the odd block
  for (; e + 1 < count && list_kb[e + 1] < pass.first_masked; e += 2, phase ^= 1u) pass.step<2, false>(e, phase, sm, o);
  for (; e + 1 < count; e += 2, phase ^= 1u) pass.step<2, true>(e, phase, sm, o);
  if (e < count) pass.step<1, true>(e, phase, sm, o);

  const int first_row = info->qb * kBlockM + half * kTileM + warp * 16;
  store_rows(o, sm.l, first_row, N, orders[info->h], prefix, frames, height, width,
             out + info->b * stride_ob + info->h * stride_oh, stride_on, stride_od, v_amax + (long long)bh * kHeadDim, g, t);
}
