// Shared pieces of IsoExec's compiled CPU kernels.
//
// Why this file exists: a canonical kernel's bits must not depend on the batch, the thread
// count, the CPU vendor or the SIMD width the compiler picks. So every floating-point
// reduction here is written out with an explicit lane count (GCC vector extensions: a
// `vf<16>` is 16 independent fp32 lanes whatever the ISA lowers it to: one AVX-512 op, two
// AVX2 ops, four SSE ops), the lanes are combined by a fixed pairwise tree, and the build uses
// -ffp-contract=off without -ffast-math: no FMA contraction, no reassociation. Transcendentals
// are our own polynomial (no libm, no SVML), so the bits are the source's.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace isx {

template <int L> struct VecT;
template <> struct VecT<8> {
  typedef float type __attribute__((vector_size(32)));
  typedef int32_t itype __attribute__((vector_size(32)));
  typedef uint32_t utype __attribute__((vector_size(32)));
  typedef uint16_t htype __attribute__((vector_size(16)));
  typedef _Float16 ftype16 __attribute__((vector_size(16)));
};
template <> struct VecT<16> {
  typedef float type __attribute__((vector_size(64)));
  typedef int32_t itype __attribute__((vector_size(64)));
  typedef uint32_t utype __attribute__((vector_size(64)));
  typedef uint16_t htype __attribute__((vector_size(32)));
  typedef _Float16 ftype16 __attribute__((vector_size(32)));
};
template <int L> using vf = typename VecT<L>::type;
template <int L> using vi = typename VecT<L>::itype;

enum DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// Exact conversions to fp32 (bf16 and fp16 embed in fp32).
static inline float to_f32(float x) { return x; }
static inline float to_f32(uint16_t bits_bf16) {
  uint32_t w = uint32_t(bits_bf16) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
static inline float to_f32(_Float16 x) { return float(x); }

// fp32 -> a tensor's dtype, round to nearest even, as torch's scalar conversion (bf16: NaN ->
// 0x7FC0). `put(p, v)` stores v at p in p's type.
static inline void put(float* p, float v) { *p = v; }
static inline void put(uint16_t* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if (v != v) {
    *p = 0x7FC0;
    return;
  }
  *p = uint16_t((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}
static inline void put(_Float16* p, float v) { *p = _Float16(v); }

template <int L> static inline vf<L> load(const float* p) {
  vf<L> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <int L> static inline vf<L> load(const uint16_t* p) {
  // bf16 -> fp32 is exact: the bits shifted up by 16. One widening move and one shift where
  // the ISA has them (GCC's generic lowering below splits the widening into four shuffles).
#if defined(__AVX512F__)
  if constexpr (L == 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return (vf<L>)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  }
#endif
#if defined(__AVX2__)
  if constexpr (L == 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return (vf<L>)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  }
#endif
  typedef typename VecT<L>::htype h_t;
  typedef typename VecT<L>::utype w_t;
  h_t h;
  std::memcpy(&h, p, sizeof(h));
  w_t w = __builtin_convertvector(h, w_t) << 16;
  vf<L> v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
template <int L> static inline vf<L> load(const _Float16* p) {
  typedef typename VecT<L>::ftype16 h_t;
  h_t h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vf<L>);
}
template <int L> static inline void store(float* p, vf<L> v) { std::memcpy(p, &v, sizeof(v)); }
// x in every lane (one broadcast instruction; a per-lane loop compiles to L inserts).
template <int L> static inline vf<L> splat(float x) {
  vf<L> v = {x};
  return __builtin_shuffle(v, vi<L>{});
}

// Fixed pairwise tree over the lanes: (l, l + L/2) first, then halves again.
template <int L> static inline float tree_sum(vf<L> v) {
  float a[L];
  std::memcpy(a, &v, sizeof(a));
  for (int w = L / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = a[i] + a[i + w];
  return a[0];
}

// tree_sum of N vectors at once, out[i] = tree_sum(v[i]) bit for bit: the same pairwise
// adds, done for several vectors per instruction. Each fold halves the lanes every vector
// still holds and packs two vectors' halves into one (segment j of the result holds vector
// j's partial sums), so N vectors of L lanes take about N vector adds instead of N * (L - 1)
// scalar ones. Addition is commutative in IEEE arithmetic, so lane placement cannot change
// a bit; only which lanes are added (the tree) does, and that is tree_sum's.
template <int L, int W> struct FoldMasks {  // W: the segment width before this fold
  int32_t lo[L], hi[L];
  constexpr FoldMasks() : lo(), hi() {
    constexpr int segs = L / W;  // segments per input vector
    for (int o = 0; o < L; ++o) {
      const int j = o / (W / 2), t = o % (W / 2);
      const int src = j < segs ? 0 : L;
      lo[o] = src + (j % segs) * W + t;
      hi[o] = lo[o] + W / 2;
    }
  }
};
template <int L, int W> static inline vf<L> fold(vf<L> u, vf<L> w) {
  static constexpr FoldMasks<L, W> m{};
  vi<L> lo, hi;
  std::memcpy(&lo, m.lo, sizeof(lo));
  std::memcpy(&hi, m.hi, sizeof(hi));
  return __builtin_shuffle(u, w, lo) + __builtin_shuffle(u, w, hi);
}
template <int L, int W, int P> static inline void fold_all(vf<L> (&v)[P]) {
  if constexpr (W > 1) {
    for (int i = 0; i < P / 2; ++i) v[i] = fold<L, W>(v[2 * i], v[2 * i + 1]);
    if constexpr (P % 2) v[P / 2] = fold<L, W>(v[P - 1], vf<L>{});
    fold_all<L, W / 2, (P + 1) / 2>(reinterpret_cast<vf<L>(&)[(P + 1) / 2]>(v));
  }
}
template <int L, int N> static inline void tree_sum_many(const vf<L> (&v)[N], float* out) {
  constexpr int P = (N + L - 1) / L;  // vectors left after the folds, L sums each
  vf<L> w[N];
  for (int i = 0; i < N; ++i) w[i] = v[i];
  fold_all<L, L, N>(w);
  float r[P * L];
  std::memcpy(r, w, sizeof(r));
  for (int i = 0; i < N; ++i) out[i] = r[i];
}

// Transpose a 16 x 16 fp32 block held as 16 row vectors (data movement only, no arithmetic):
// four butterfly stages, stage d swapping bit d of the row index with bit d of the column.
static inline void transpose16(vf<16> (&r)[16]) {
  for (int d = 8; d >= 1; d /= 2) {
    vi<16> lo, hi;
    for (int c = 0; c < 16; ++c) {
      lo[c] = (c & d) ? 16 + c - d : c;
      hi[c] = (c & d) ? 16 + c : c + d;
    }
    for (int i = 0; i < 16; ++i)
      if (!(i & d)) {
        const vf<16> a = r[i], b = r[i + d];
        r[i] = __builtin_shuffle(a, b, lo);
        r[i + d] = __builtin_shuffle(a, b, hi);
      }
  }
}

// Canonical exp for x <= 0 (softmax exponents), per lane: Cephes-style range reduction and
// degree-6 polynomial, about 1 ulp. x < -87 gives 0 (below fp32's normal range); -inf gives 0.
template <int L> static inline vf<L> exp_nonpos(vf<L> x) {
  const vf<L> lo = splat<L>(-87.0f);
  vi<L> keep = x >= lo;
  x = x < lo ? lo : x;  // keep the arithmetic finite; masked to 0 below
  vf<L> t = x * splat<L>(1.44269504088896341f);
  vf<L> n = (t + splat<L>(12582912.0f)) - splat<L>(12582912.0f);  // round to nearest even
  vf<L> r = x - n * splat<L>(0.693359375f);
  r = r - n * splat<L>(-2.12194440e-4f);
  vf<L> z = r * r;
  vf<L> y = splat<L>(1.9875691500e-4f);
  y = y * r + splat<L>(1.3981999507e-3f);
  y = y * r + splat<L>(8.3334519073e-3f);
  y = y * r + splat<L>(4.1665795894e-2f);
  y = y * r + splat<L>(1.6666665459e-1f);
  y = y * r + splat<L>(5.0000001201e-1f);
  y = y * z + r + splat<L>(1.0f);
  vi<L> e = (__builtin_convertvector(n, vi<L>) + 127) << 23;
  vf<L> scale;
  std::memcpy(&scale, &e, sizeof(scale));
  vf<L> out = y * scale;
  vi<L> bits;
  std::memcpy(&bits, &out, sizeof(bits));
  bits = bits & keep;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// IEEE default floating-point environment for the duration of a kernel (no flush-to-zero,
// no denormals-are-zero, round to nearest): a caller's thread may have set FTZ, and new
// threads start with the default, so every thread pins it.
struct FpEnv {
#if defined(__x86_64__)
  unsigned saved;
  FpEnv() : saved(_mm_getcsr()) { _mm_setcsr(0x1F80); }
  ~FpEnv() { _mm_setcsr(saved); }
#endif
};

// Run fn(i) for i in [0, n) on up to `threads` threads (the caller's included). Each item is
// computed whole by one thread, so the thread count and the item-to-thread assignment never
// change a bit; items are handed out in chunks from an atomic counter (load balance).
//
// The threads are the OpenMP team torch's own CPU ops run on: the library links libgomp.so.1,
// which resolves to the copy torch already loaded (same soname), so a call wakes threads that
// are spinning after torch's last op instead of starting new ones. Starting std::threads per
// call cost about 0.5 ms per attention call inside a vLLM engine, whose bound OpenMP threads
// spin on every core (#37's profile).
template <class F> static void parallel_items(int64_t n, int threads, int64_t chunk, F fn) {
  if (threads > n / chunk) threads = int(n / chunk);
  if (threads <= 1) {
    FpEnv env;
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    FpEnv env;
    const int worker = omp_get_thread_num();
    for (;;) {
      int64_t s = next.fetch_add(chunk);
      if (s >= n) break;
      int64_t e = s + chunk < n ? s + chunk : n;
      for (int64_t i = s; i < e; ++i) fn(i, worker);
    }
  }
}

// a * b + c per lane with one rounding (IEEE fused multiply-add). The x86 FMA instructions
// where the build has them, else the correctly rounded `__builtin_fmaf` per lane: the same
// bits either way. Where a * b is exact in fp32 (bf16 x bf16, fp16 x fp16 widened products,
// away from fp32's subnormal range) it equals `c + a * b`.
template <int L> static inline vf<L> fmadd(vf<L> a, vf<L> b, vf<L> c) {
#if defined(__AVX512F__)
  if constexpr (L == 16) return (vf<L>)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
#if defined(__FMA__)
  if constexpr (L == 8) return (vf<L>)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
  vf<L> r;
  for (int i = 0; i < L; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
}

}  // namespace isx
