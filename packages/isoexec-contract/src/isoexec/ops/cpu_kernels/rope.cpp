// Canonical RoPE apply (isoexec.rope v1), neox rotate-half, partial: the torch formula's bits
// in one pass.
//
// Why compiled: the torch formula (`rope.apply_rope`) is about ten small ops per call (cast,
// slices, four multiplies, a subtract, an add, a concatenation, a cast), and an engine calls it
// twice per layer and step. Every one of its operations is one correctly rounded IEEE
// operation per element, so this loop does the same operations in the same order and gives
// the same bits (-ffp-contract=off: no fused multiply-add):
//   out1 = round_T(x1 * c - x2 * s),  out2 = round_T(x2 * c + x1 * s),  the rest passed on,
// with x1 = x[:half], x2 = x[half:rot] in fp32 and (c, s) the fp32 table row of the token's
// position (or the token's own row of per-token tables).
#include "simd.h"

using namespace isx;

namespace {

struct Args {
  int64_t tokens, heads, dim, rot;
  const void* x; int64_t x_tok, x_head;  // [tokens, heads, dim], unit stride in dim
  const float* cos; const float* sin;    // [rows, rot / 2] fp32, contiguous
  const int64_t* pos;                    // the table row of each token (null: token t, row t)
  void* out;                             // [tokens, heads, dim] contiguous, x's dtype
};

template <class T> static void token(const Args& a, int64_t t) {
  const int64_t half = a.rot / 2;
  const int64_t row = a.pos ? a.pos[t] : t;
  const float* c = a.cos + row * half;
  const float* s = a.sin + row * half;
  for (int64_t h = 0; h < a.heads; ++h) {
    const T* x = static_cast<const T*>(a.x) + t * a.x_tok + h * a.x_head;
    T* o = static_cast<T*>(a.out) + (t * a.heads + h) * a.dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_f32(x[i]), x2 = to_f32(x[half + i]);
      const float a1 = x1 * c[i], b1 = x2 * s[i];
      const float a2 = x2 * c[i], b2 = x1 * s[i];
      put(o + i, a1 - b1);
      put(o + half + i, a2 + b2);
    }
    for (int64_t i = a.rot; i < a.dim; ++i) put(o + i, to_f32(x[i]));  // exact round trip
  }
}

template <class T> static void run(const Args& a, int threads) {
  const int64_t per = a.heads * a.dim;
  const int64_t chunk = per >= 16384 ? 1 : 16384 / per;  // a decode step: one thread
  parallel_items(a.tokens, threads, chunk, [&](int64_t t, int) { token<T>(a, t); });
}

}  // namespace

extern "C" int isx_rope_apply(int64_t tokens, int64_t heads, int64_t dim, int64_t rot,
                              const void* x, int64_t x_tok, int64_t x_head, const float* cos,
                              const float* sin, const int64_t* pos, void* out, int dtype,
                              int threads) {
  if (tokens < 0 || heads < 0 || dim < 1 || rot < 2 || rot > dim || rot % 2) return 2;
  const Args a{tokens, heads, dim, rot, x, x_tok, x_head, cos, sin, pos, out};
  switch (dtype) {
    case F32: run<float>(a, threads); return 0;
    case BF16: run<uint16_t>(a, threads); return 0;
    case F16: run<_Float16>(a, threads); return 0;
  }
  return 1;
}
