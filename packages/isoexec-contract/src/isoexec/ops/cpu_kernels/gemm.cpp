// Canonical CPU GEMM (isoexec.linear v2): y = x @ w^T with every output one fixed chain.
//
// Why our own: a BLAS or oneDNN picks its kernel, blocking and K order from the shapes and
// the thread count, so a row's bits change with the batch; IsoExec used to pin them by
// running fixed 32-row blocks through oneDNN, which cost a padded GEMM and torch's entry
// point (about 2x vLLM's own oneDNN call at a decode step, #37's profile). Here the bits are
// defined by this file, and by nothing about the call. In fp32 and fp16:
//   y[m, n] = round_T( fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], +0) ... ) )
// in fp32 (fp16 operands widened exactly), k ascending, one IEEE fused multiply-add per k.
// In bf16, k in pairs, the odd one of each pair first (the order of the x86 VDPBF16PS
// instruction, which does a pair per lane at twice the rate of two FMAs):
//   acc = fma(x[2i+1], w[2i+1], acc); acc = fma(x[2i], w[2i], acc)   for i = 0, 1, ...
// with denormal inputs read as zero and denormal results flushed to zero (that instruction's
// fixed mode; a K odd ends on the single k = K-1). A bf16 product is exact in fp32, so each
// step is one rounding either way: CPUs without the instruction run the two FMAs under
// FTZ/DAZ and get the same bits. One rounding to T at the end.
// No output depends on another row or column, the row count, the thread count, the tiling or
// the SIMD width: vector lanes hold different output columns, never parts of one sum. The
// fused multiply-add is IEEE-defined, so its x86 instruction and the correctly rounded
// `__builtin_fmaf` give the same bits (simd.h `fmadd`).
//
// Speed comes from the layout, not the order: the weight is packed once (by the caller,
// cached) into panels of 32 columns, [N/32][K][32] (bf16: [N/32][K/2][32][2], a k pair per
// 32-bit word), and a register tile of up to 8 rows x 32 columns walks k with two weight
// loads and 16 multiply-adds (or pair dot products) per step.
#include <algorithm>
#include <type_traits>

#include "simd.h"

using namespace isx;

namespace {

constexpr int L = 16;       // lanes of one vector (columns): not part of the bits
constexpr int NB = 2 * L;   // columns of a packed panel
constexpr int MR = 8;       // rows of a register tile

struct Args {
  const void* x;   // [M, K] rows ldx apart, each row contiguous, T
  int64_t M, K, N, ldx;
  const void* wp;  // packed [ceil(N/32)][K][32], T, zero past N (bf16: [..][K/2][32][2])
  void* y;         // [M, N] contiguous, T (fp32 where out_f32: the chains before rounding)
  int out_f32;
};

// Row r of a tile's fp32 results into y (rounded to T, or as they are where out_f32).
template <class T>
static inline void write_rows(const Args& a, const float* out, int rows, int64_t m0, int64_t n0) {
  const int64_t cols = std::min<int64_t>(NB, a.N - n0);
  for (int r = 0; r < rows; ++r) {
    const int64_t at = (m0 + r) * a.N + n0;
    if (a.out_f32) {
      std::memcpy(static_cast<float*>(a.y) + at, out + r * NB, sizeof(float) * size_t(cols));
    } else {
      T* yr = static_cast<T*>(a.y) + at;
      for (int64_t j = 0; j < cols; ++j) put(yr + j, out[r * NB + j]);
    }
  }
}

// The 32 weights of one k in fp32: columns 0..15 in w0, 16..31 in w1.
static inline void widen(const float* p, vf<L>& w0, vf<L>& w1) {
  w0 = load<L>(p);
  w1 = load<L>(p + L);
}
static inline void widen(const _Float16* p, vf<L>& w0, vf<L>& w1) {
  w0 = load<L>(p);
  w1 = load<L>(p + L);
}
// bf16: one step of a k pair for 16 columns: acc + x_odd * w_odd, then + x_even * w_even,
// FTZ/DAZ (x and w hold the pair in a 32-bit word, the even k in the low half).
typedef uint32_t u32v __attribute__((vector_size(4 * L)));
#if !defined(__AVX512BF16__)
static inline vf<L> pair_step(vf<L> acc, u32v x, u32v w) {
  const u32v hi = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                   0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                   0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                   0xFFFF0000u};
  const u32v xo = x & hi, wo = w & hi, xe = x << 16, we = w << 16;
  vf<L> fxo, fwo, fxe, fwe;
  std::memcpy(&fxo, &xo, sizeof(fxo));
  std::memcpy(&fwo, &wo, sizeof(fwo));
  std::memcpy(&fxe, &xe, sizeof(fxe));
  std::memcpy(&fwe, &we, sizeof(fwe));
  return fmadd<L>(fxe, fwe, fmadd<L>(fxo, fwo, acc));  // under FtzDaz (run_bf16)
}
#endif

// The MXCSR mode of the pair steps' FMAs where the CPU has no VDPBF16PS (which ignores it):
// flush-to-zero and denormals-are-zero, round to nearest.
struct FtzDaz {
#if defined(__x86_64__)
  unsigned saved;
  FtzDaz() : saved(_mm_getcsr()) { _mm_setcsr(0x1F80 | 0x8000 | 0x0040); }
  ~FtzDaz() { _mm_setcsr(saved); }
#endif
};

template <int R>
static inline void tile_bf16(const uint32_t* x, int64_t ldx, const uint32_t* wp, int64_t K2,
                             float* out) {
#if defined(__AVX512BF16__)
  // The loops over r fully unrolled: else GCC 12 keeps the accumulators on the stack
  // (a load and a store around every step, 2x slower).
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + k * NB);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + k * NB + L);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(int(x[r * ldx + k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xs, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xs, w1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * NB, acc[r][0]);
    _mm512_storeu_ps(out + r * NB + L, acc[r][1]);
  }
#else
  vf<L> acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf<L>{};
  for (int64_t k = 0; k < K2; ++k) {
    u32v w0, w1;
    std::memcpy(&w0, wp + k * NB, sizeof(w0));
    std::memcpy(&w1, wp + k * NB + L, sizeof(w1));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      u32v xs = {x[r * ldx + k]};
      xs = __builtin_shuffle(xs, vi<L>{});
      acc[r][0] = pair_step(acc[r][0], xs, w0);
      acc[r][1] = pair_step(acc[r][1], xs, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    store<L>(out + r * NB, acc[r][0]);
    store<L>(out + r * NB + L, acc[r][1]);
  }
#endif
}

static void any_tile_bf16(int rows, const uint32_t* x, int64_t ldx, const uint32_t* wp,
                          int64_t K2, float* out) {
  switch (rows) {
    case 8: tile_bf16<8>(x, ldx, wp, K2, out); break;
    case 7: tile_bf16<7>(x, ldx, wp, K2, out); break;
    case 6: tile_bf16<6>(x, ldx, wp, K2, out); break;
    case 5: tile_bf16<5>(x, ldx, wp, K2, out); break;
    case 4: tile_bf16<4>(x, ldx, wp, K2, out); break;
    case 3: tile_bf16<3>(x, ldx, wp, K2, out); break;
    case 2: tile_bf16<2>(x, ldx, wp, K2, out); break;
    default: tile_bf16<1>(x, ldx, wp, K2, out); break;
  }
}

// bf16: x's rows as k pairs (a zero high half past an odd K), then the pair tiles.
static void run_bf16(const Args& a, int threads) {
  const int64_t panels = (a.N + NB - 1) / NB, tiles = (a.M + MR - 1) / MR;
  const int64_t K2 = (a.K + 1) / 2;
  std::vector<uint32_t> xbuf(size_t(a.M * K2));
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  parallel_items(a.M, threads, 16, [&](int64_t i, int) {
    const uint16_t* row = x + i * a.ldx;
    uint32_t* dst = xbuf.data() + i * K2;
    for (int64_t k = 0; k < a.K / 2; ++k)
      dst[k] = uint32_t(row[2 * k]) | (uint32_t(row[2 * k + 1]) << 16);
    if (a.K % 2) dst[K2 - 1] = row[a.K - 1];
  });
  const uint32_t* wp = static_cast<const uint32_t*>(a.wp);
  parallel_items(panels * tiles, threads, tiles, [&](int64_t item, int) {
    FtzDaz mode;
    const int64_t p = item / tiles, t = item % tiles;
    const int rows = int(std::min<int64_t>(MR, a.M - t * MR));
    float out[MR * NB];
    any_tile_bf16(rows, xbuf.data() + t * MR * K2, K2, wp + p * K2 * NB, K2, out);
    write_rows<uint16_t>(a, out, rows, t * MR, p * NB);
  });
}

// out[r * 32 + j] = the chain of row r of x against column j of one panel, all K steps (the
// accumulators stay in registers: a local array, stored once at the end).
template <class W, int R>
static inline void tile(const float* x, int64_t ldx, const W* wp, int64_t K, float* out) {
  vf<L> acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf<L>{};
  for (int64_t k = 0; k < K; ++k) {
    vf<L> w0, w1;
    widen(wp + k * NB, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf<L> xs = splat<L>(x[r * ldx + k]);
      acc[r][0] = fmadd<L>(xs, w0, acc[r][0]);
      acc[r][1] = fmadd<L>(xs, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    store<L>(out + r * NB, acc[r][0]);
    store<L>(out + r * NB + L, acc[r][1]);
  }
}

template <class W>
static void any_tile(int rows, const float* x, int64_t ldx, const W* wp, int64_t K, float* out) {
  switch (rows) {
    case 8: tile<W, 8>(x, ldx, wp, K, out); break;
    case 7: tile<W, 7>(x, ldx, wp, K, out); break;
    case 6: tile<W, 6>(x, ldx, wp, K, out); break;
    case 5: tile<W, 5>(x, ldx, wp, K, out); break;
    case 4: tile<W, 4>(x, ldx, wp, K, out); break;
    case 3: tile<W, 3>(x, ldx, wp, K, out); break;
    case 2: tile<W, 2>(x, ldx, wp, K, out); break;
    default: tile<W, 1>(x, ldx, wp, K, out); break;
  }
}

template <class T>
static void run(const Args& a, int threads) {
  const int64_t panels = (a.N + NB - 1) / NB, tiles = (a.M + MR - 1) / MR;
  // x in fp32 (fp16 widens exactly): read 32 times per row tile, converted once.
  const float* xf;
  int64_t ldx = a.ldx;
  std::vector<float> xbuf;
  if constexpr (std::is_same<T, float>::value) {
    xf = static_cast<const float*>(a.x);
  } else {
    xbuf.resize(size_t(a.M * a.K));
    const T* x = static_cast<const T*>(a.x);
    parallel_items(a.M, threads, 16, [&](int64_t i, int) {
      for (int64_t k = 0; k < a.K; ++k) xbuf[size_t(i * a.K + k)] = to_f32(x[i * a.ldx + k]);
    });
    xf = xbuf.data();
    ldx = a.K;
  }
  const T* wp = static_cast<const T*>(a.wp);
  // One item = one (panel, row tile); a thread takes a whole panel's tiles at a time, so the
  // panel stays in its cache while x's rows stream past.
  parallel_items(panels * tiles, threads, tiles, [&](int64_t item, int) {
    const int64_t p = item / tiles, t = item % tiles;
    const int rows = int(std::min<int64_t>(MR, a.M - t * MR));
    float out[MR * NB];
    any_tile<T>(rows, xf + t * MR * ldx, ldx, wp + p * a.K * NB, a.K, out);
    write_rows<T>(a, out, rows, t * MR, p * NB);
  });
}

}  // namespace

extern "C" int isx_gemm(const void* x, int64_t M, int64_t K, int64_t N, int64_t ldx,
                        const void* wp, void* y, int dtype, int out_f32, int threads) {
  if (M < 0 || K < 0 || N < 0 || ldx < K) return 2;
  const Args a{x, M, K, N, ldx, wp, y, out_f32};
  switch (dtype) {
    case F32: run<float>(a, threads); return 0;
    case BF16: run_bf16(a, threads); return 0;
    case F16: run<_Float16>(a, threads); return 0;
    default: return 1;
  }
}
