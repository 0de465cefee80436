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
// columns walks k with two weight loads and 16 multiply-adds per step.
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
  const void* wp;  // packed [ceil(N/32)][K][32], T, zero past N
  void* y;         // [M, N] contiguous, T
};

// acc[r][.] = the chains of rows x[0..R) against one panel, all K steps.
template <class W, int R>
static inline void tile(const float* x, int64_t ldx, const W* wp, int64_t K, vf<L> (&acc)[MR][2]) {
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vf<L>{};
  for (int64_t k = 0; k < K; ++k) {
    const vf<L> w0 = load<L>(wp + k * NB), w1 = load<L>(wp + k * NB + L);
    for (int r = 0; r < R; ++r) {
      const vf<L> xs = splat<L>(x[r * ldx + k]);
      acc[r][0] = fmadd<L>(xs, w0, acc[r][0]);
      acc[r][1] = fmadd<L>(xs, w1, acc[r][1]);
    }
  }
}

template <class W>
static void any_tile(int rows, const float* x, int64_t ldx, const W* wp, int64_t K,
                     vf<L> (&acc)[MR][2]) {
  switch (rows) {
    case 8: tile<W, 8>(x, ldx, wp, K, acc); break;
    case 7: tile<W, 7>(x, ldx, wp, K, acc); break;
    case 6: tile<W, 6>(x, ldx, wp, K, acc); break;
    case 5: tile<W, 5>(x, ldx, wp, K, acc); break;
    case 4: tile<W, 4>(x, ldx, wp, K, acc); break;
    case 3: tile<W, 3>(x, ldx, wp, K, acc); break;
    case 2: tile<W, 2>(x, ldx, wp, K, acc); break;
    default: tile<W, 1>(x, ldx, wp, K, acc); break;
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
    vf<L> acc[MR][2];
    any_tile<T>(rows, xf + t * MR * ldx, ldx, wp + p * a.K * NB, a.K, acc);
    const int64_t n0 = p * NB, cols = std::min<int64_t>(NB, a.N - n0);
    for (int r = 0; r < rows; ++r) {
      float out[NB];
      store<L>(out, acc[r][0]);
      store<L>(out + L, acc[r][1]);
      T* yr = y + (t * MR + r) * a.N + n0;
      for (int64_t j = 0; j < cols; ++j) put(yr + j, out[j]);
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
