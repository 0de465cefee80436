// Canonical CPU GEMM (isoexec.linear v2): y = x @ w^T with every output a sequential chain.
//
// Why our own: a BLAS or oneDNN picks its kernel, blocking and K order from the shapes and
// the thread count, so a row's bits change with the batch; IsoExec used to pin them by
// running fixed 32-row blocks through oneDNN, which cost a padded GEMM and torch's entry
// point (about 2x vLLM's own oneDNN call at a decode step, #37's profile). Here the bits are
// defined by this file, and by nothing about the call:
//   y[m, n] = round_T( fma(x[m, K-1], w[n, K-1], ... fma(x[m, 1], w[n, 1],
//                      fma(x[m, 0], w[n, 0], +0)) ... ) )
// in fp32 (bf16/fp16 operands widened exactly), k ascending, one IEEE fused multiply-add per
// k, one rounding to T at the end. No output depends on another row or column, the row
// count, the thread count, the tiling or the SIMD width: vector lanes hold different output
// columns, never parts of one sum. The fused multiply-add is IEEE-defined, so its x86
// instruction and the correctly rounded `__builtin_fmaf` give the same bits (simd.h `fmadd`).
//
// Speed comes from the layout, not the order: the weight is packed once (by the caller,
// cached) into panels of 32 columns, [N/32][K][32], and a register tile of up to 8 rows x 32
// columns walks k with two weight loads and 16 multiply-adds per step. In bf16 the 32 columns
// of one k are interleaved (column j and j + 16 share a 32-bit word), so one load and a shift
// and a mask widen them (bf16 -> fp32 is exact: the bits moved up by 16).
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
  const void* wp;  // packed [ceil(N/32)][K][32], T, zero past N (bf16: pairs interleaved)
  void* y;         // [M, N] contiguous, T
};

// The 32 weights of one k in fp32: columns 0..15 in w0, 16..31 in w1.
static inline void widen(const float* p, vf<L>& w0, vf<L>& w1) {
  w0 = load<L>(p);
  w1 = load<L>(p + L);
}
static inline void widen(const _Float16* p, vf<L>& w0, vf<L>& w1) {
  w0 = load<L>(p);
  w1 = load<L>(p + L);
}
static inline void widen(const uint16_t* p, vf<L>& w0, vf<L>& w1) {  // interleaved pairs
  typedef uint32_t u32v __attribute__((vector_size(4 * L)));
  u32v u;
  std::memcpy(&u, p, sizeof(u));
  const u32v lo = u << 16, hi = u & 0xFFFF0000u;
  std::memcpy(&w0, &lo, sizeof(w0));
  std::memcpy(&w1, &hi, sizeof(w1));
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
  // x in fp32 (bf16/fp16 widen exactly): read 32 times per row tile, converted once.
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
  T* y = static_cast<T*>(a.y);
  // One item = one (panel, row tile); a thread takes a whole panel's tiles at a time, so the
  // panel stays in its cache while x's rows stream past.
  parallel_items(panels * tiles, threads, tiles, [&](int64_t item, int) {
    const int64_t p = item / tiles, t = item % tiles;
    const int rows = int(std::min<int64_t>(MR, a.M - t * MR));
    float out[MR * NB];
    any_tile<T>(rows, xf + t * MR * ldx, ldx, wp + p * a.K * NB, a.K, out);
    const int64_t n0 = p * NB, cols = std::min<int64_t>(NB, a.N - n0);
    for (int r = 0; r < rows; ++r) {
      T* yr = y + (t * MR + r) * a.N + n0;
      for (int64_t j = 0; j < cols; ++j) put(yr + j, out[r * NB + j]);
    }
  });
}

}  // namespace

extern "C" int isx_gemm(const void* x, int64_t M, int64_t K, int64_t N, int64_t ldx,
                        const void* wp, void* y, int dtype, int threads) {
  if (M < 0 || K < 0 || N < 0 || ldx < K) return 2;
  const Args a{x, M, K, N, ldx, wp, y};
  switch (dtype) {
    case F32: run<float>(a, threads); return 0;
    case BF16: run<uint16_t>(a, threads); return 0;
    case F16: run<_Float16>(a, threads); return 0;
    default: return 1;
  }
}
