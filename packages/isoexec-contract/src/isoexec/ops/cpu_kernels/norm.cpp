// Canonical RMSNorm (isoexec.rms_norm v2): one row at a time, all of it in one pass.
//
// Why compiled: the op is a chain of about ten small torch ops (add, cast, square, mean, pad,
// rsqrt, two multiplies, cast), about 15 us a call at a decode step against about 8 us for
// the fused native op (#37's profile); here it is one loop per row. The bits are this file's:
//   r_i   = round_T(x_i + res_i)                  (with a residual: written out, then used)
//   ss    = sum of r_i^2 in fp32: lane l (of 16) adds the i = l mod 16 terms in increasing i,
//           then the 16 lanes by simd.h's fixed pairwise tree
//   inv   = 1 / sqrt(ss / D + eps)                (IEEE sqrt and division, correctly rounded;
//                                                  torch's own CPU fp32 sqrt is not)
//   y_i   = round_T((r_i * inv) * w_i)            (w_i = weight in fp32, + 1 if zero-centred)
// A row's bits depend on that row and the weight only: not on the row count, the threads or
// the SIMD width the compiler picks (-ffp-contract=off, no fast-math).
#include <cmath>

#include "simd.h"

using namespace isx;

namespace {

constexpr int L = 16;  // the lane count of the sum of squares: part of the bits

// Row i of an input lies at (i / inner) * outer + (i % inner) * stride elements (a [T, H, D]
// view of a wider tensor, e.g. vLLM's q heads, needs both); its elements are contiguous.
struct Rows {
  const void* p; int64_t inner, outer, stride;
  int64_t at(int64_t i) const { return (i / inner) * outer + (i % inner) * stride; }
};

struct Args {
  int64_t rows, dim;
  Rows x, res;     // res.p null: no residual (same dtype as x)
  const void* w;   // [dim], contiguous
  void* y;         // [rows, dim] contiguous, x's dtype
  void* r_out;     // [rows, dim] contiguous, x + residual in x's dtype (with a residual)
  float eps;
  int zero_centered;
};

template <class T, class W> static void row(const Args& a, int64_t i, float* buf) {
  const T* x = static_cast<const T*>(a.x.p) + a.x.at(i);
  const int64_t d = a.dim;
  if (a.res.p) {
    const T* res = static_cast<const T*>(a.res.p) + a.res.at(i);
    T* ro = static_cast<T*>(a.r_out) + i * d;
    for (int64_t j = 0; j < d; ++j) {
      put(ro + j, to_f32(x[j]) + to_f32(res[j]));
      buf[j] = to_f32(ro[j]);
    }
  } else {
    for (int64_t j = 0; j < d; ++j) buf[j] = to_f32(x[j]);
  }
  vf<L> acc = {};
  int64_t j = 0;
  for (; j + L <= d; j += L) {
    const vf<L> v = load<L>(buf + j);
    acc = acc + v * v;
  }
  if (j < d) {  // the tail's lanes past the row add +0 (a square is never -0)
    float t[L] = {};
    std::memcpy(t, buf + j, sizeof(float) * size_t(d - j));
    const vf<L> v = load<L>(t);
    acc = acc + v * v;
  }
  const float inv = 1.0f / std::sqrt(tree_sum<L>(acc) / float(d) + a.eps);
  const W* w = static_cast<const W*>(a.w);
  T* y = static_cast<T*>(a.y) + i * d;
  for (int64_t k = 0; k < d; ++k) {
    float wk = to_f32(w[k]);
    if (a.zero_centered) wk = wk + 1.0f;
    put(y + k, (buf[k] * inv) * wk);
  }
}

template <class T, class W> static void run(const Args& a, int threads) {
  // about 64K elements per chunk of rows: a decode step's few rows stay on one thread
  const int64_t chunk = a.dim >= 65536 ? 1 : 65536 / a.dim;
  std::vector<std::vector<float>> bufs(size_t(threads > 1 ? threads : 1),
                                       std::vector<float>(size_t(a.dim)));
  parallel_items(a.rows, threads, chunk,
                 [&](int64_t i, int worker) { row<T, W>(a, i, bufs[size_t(worker)].data()); });
}

template <class T> static int dispatch_w(const Args& a, int w_dtype, int threads) {
  switch (w_dtype) {
    case F32: run<T, float>(a, threads); return 0;
    case BF16: run<T, uint16_t>(a, threads); return 0;
    case F16: run<T, _Float16>(a, threads); return 0;
  }
  return 1;
}

}  // namespace

extern "C" int isx_rms_norm_fwd(int64_t rows, int64_t dim, const void* x, int64_t x_inner,
                                int64_t x_outer, int64_t x_stride, const void* res,
                                int64_t r_inner, int64_t r_outer, int64_t r_stride,
                                const void* w, int w_dtype, void* y, void* r_out, int dtype,
                                float eps, int zero_centered, int threads) {
  if (rows < 0 || dim < 1 || x_inner < 1 || (res && r_inner < 1)) return 2;
  const Args a{rows, dim, {x, x_inner, x_outer, x_stride}, {res, r_inner, r_outer, r_stride},
               w, y, r_out, eps, zero_centered};
  switch (dtype) {
    case F32: return dispatch_w<float>(a, w_dtype, threads);
    case BF16: return dispatch_w<uint16_t>(a, w_dtype, threads);
    case F16: return dispatch_w<_Float16>(a, w_dtype, threads);
  }
  return 1;
}
