// Canonical gated delta rule (Gated DeltaNet's recurrence): forward, and its adjoint for the
// trainer.
//
// One item = one (sequence, value head), computed whole by one thread, tokens in order. Per
// token t, with the fp32 state S[K, V] of the item:
//   qn = q * (1 / sqrt(Σ q² + eps)) * (1 / sqrt(K)),  kn = k * (1 / sqrt(Σ k² + eps))
//        (Σ over `LANES` lanes, dim i in lane i % LANES, then the fixed tree of simd.h)
//   d  = exp(-exp(A_log) * softplus(a + dt_bias)),    beta = sigmoid(b)
//   S1 = S * d
//   m[v] = Σ_k S1[k, v] * kn[k]                       (k = 0..K-1 in order, per column v)
//   δ[v] = (v[v] - m[v]) * beta
//   S  = S1 + kn[k] * δ[v]
//   o[v] = Σ_k S[k, v] * qn[k]                        (k = 0..K-1 in order, per column v)
// A column v of the state never reads another column, so columns are computed in blocks of
// VB at once (16 per vector) and the block width changes no bit. Nothing depends on the other
// items, the batch, the thread count or where a call starts or ends: a decode step from a
// state is the same ops as the same token inside a prefill. The transcendentals are written
// here (no libm): exp, log, log1p, softplus, sigmoid; sqrt and division are IEEE-exact.
//
// The adjoint (isx_gdn_bwd) walks the tokens backwards, one checkpoint segment at a time:
// the forward saved the state at every `ckpt_every`-th token; a segment's states are
// recomputed from its checkpoint by the same ops (so bitwise the forward's), then
// dS, dq, dk, dv, dd (the decay) and dbeta follow the chain rule. Gradients with respect to
// the normalized q, k and to d and beta are returned; the cheap elementwise parts (l2 norm,
// gates, GQA sum) are differentiated by the caller.
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

using namespace isx;

constexpr int LANES = 16;   // lanes of the l2-norm sums (the only reduction across lanes)
constexpr int W = 16;       // fp32 per vector across value columns (never added to each other)
constexpr int TCHUNK = 64;  // tokens prepared at once by the forward (memory only)

static inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// e^x for any x: Cephes range reduction and degree-6 polynomial (the scalar form of
// exp_nonpos), scaled by two exact powers of two so that a subnormal result rounds once.
// x > 88.72 gives +inf, x < -103.97 gives 0, NaN stays NaN.
static inline float exp_f(float x) {
  if (x != x) return x;
  if (x > 88.72283935546875f) return std::numeric_limits<float>::infinity();
  if (x < -103.972084045410f) return 0.0f;
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest even
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int ni = int(n);
  const int n1 = ni / 2, n2 = ni - n1;  // each in [-76, 64]
  return (y * from_bits(uint32_t(n1 + 127) << 23)) * from_bits(uint32_t(n2 + 127) << 23);
}

// Natural log of a positive normal x (callers pass 1 + e^-|x| in [1, 2]): Cephes logf.
static inline float log_f(float x) {
  const uint32_t u = to_bits(x);
  int e = int((u >> 23) & 0xff) - 126;  // x = f * 2^e, f in [0.5, 1)
  float f = from_bits((u & 0x807fffffu) | 0x3f000000u);
  if (f < 0.707106781186547524f) {
    e -= 1;
    f = f + f - 1.0f;
  } else {
    f = f - 1.0f;
  }
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  const float fe = float(e);
  y = y + fe * -2.12194440e-4f;
  y = y - 0.5f * z;
  return (f + y) + fe * 0.693359375f;
}

// log(1 + y) for y >= 0, accurate for tiny y (Goldberg: log(u) * y / (u - 1), u = 1 + y).
static inline float log1p_f(float y) {
  const float u = 1.0f + y;
  if (u == 1.0f) return y;
  return log_f(u) * (y / (u - 1.0f));
}

// log(1 + e^x) = max(x, 0) + log1p(e^-|x|): no overflow for any x (for x > 20 it is x in
// fp32, as torch's threshold gives).
static inline float softplus_f(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float p = x > 0.0f ? x : 0.0f;
  return p + log1p_f(exp_f(-ax));
}

static inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp_f(-x)); }

struct Args {
  int64_t B, T, HK, HV, K, V;
  const void* q; int64_t q_sb, q_st, q_sh;
  const void* k; int64_t k_sb, k_st, k_sh;
  const void* v; int64_t v_sb, v_st, v_sh;
  const float* a;  // [B, T, HV] contiguous
  const float* b;  // [B, T, HV] contiguous
  const float* A_log;
  const float* dt_bias;
  float eps;
  int64_t ckpt_every;  // tokens per checkpoint segment
};

// x[0..n) to fp32 (exact), L at a time.
template <class QT>
static inline void to_f32_row(const QT* __restrict x, int64_t n, float* __restrict out) {
  const int64_t full = n / LANES * LANES;
  for (int64_t i = 0; i < full; i += LANES) store<LANES>(out + i, load<LANES>(x + i));
  for (int64_t i = full; i < n; ++i) out[i] = to_f32(x[i]);
}

// One row x[0..K) to fp32, times 1 / sqrt(Σ x² + eps), then times `post` (elementwise
// products: vector or scalar gives the same bits; only Σ x² has an order, LANES lanes + tree).
template <class QT>
static inline void l2norm_row(const QT* __restrict x, int64_t K, float eps, float post,
                              float* __restrict out) {
  to_f32_row(x, K, out);
  const int64_t Kfull = K / LANES * LANES;
  vf<LANES> acc = splat<LANES>(0.0f);
  for (int64_t i = 0; i < Kfull; i += LANES) {
    const vf<LANES> xv = load<LANES>(out + i);
    acc = acc + xv * xv;
  }
  if (Kfull < K) {
    float tail[LANES];
    std::memcpy(tail, &acc, sizeof(tail));
    for (int64_t i = Kfull; i < K; ++i) tail[i - Kfull] = tail[i - Kfull] + out[i] * out[i];
    std::memcpy(&acc, tail, sizeof(tail));
  }
  const float r = 1.0f / std::sqrt(tree_sum<LANES>(acc) + eps);
  const vf<LANES> rv = splat<LANES>(r), pv = splat<LANES>(post);
  for (int64_t i = 0; i < Kfull; i += LANES) store<LANES>(out + i, (load<LANES>(out + i) * rv) * pv);
  for (int64_t i = Kfull; i < K; ++i) out[i] = (out[i] * r) * post;
}

// Per-token inputs of item (bi, h) for tokens [t0, t1): qn, kn [n, K], v [n, Vp] (zero past
// V), decay and beta [n].
template <class QT>
static void prep(const Args& A, int64_t bi, int64_t h, int64_t t0, int64_t t1, int64_t Vp,
                 float* qn, float* kn, float* vv, float* dec, float* beta) {
  const int64_t hk = h / (A.HV / A.HK);
  const float neg_a = -exp_f(A.A_log[h]);
  const float dtb = A.dt_bias[h];
  const float inv_sqrt_k = 1.0f / std::sqrt(float(A.K));
  const QT* qb = static_cast<const QT*>(A.q) + bi * A.q_sb + hk * A.q_sh;
  const QT* kb = static_cast<const QT*>(A.k) + bi * A.k_sb + hk * A.k_sh;
  const QT* vb = static_cast<const QT*>(A.v) + bi * A.v_sb + h * A.v_sh;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i = t - t0;
    l2norm_row(qb + t * A.q_st, A.K, A.eps, inv_sqrt_k, qn + i * A.K);
    l2norm_row(kb + t * A.k_st, A.K, A.eps, 1.0f, kn + i * A.K);
    float* vr = vv + i * Vp;
    to_f32_row(vb + t * A.v_st, A.V, vr);
    for (int64_t c = A.V; c < Vp; ++c) vr[c] = 0.0f;
    const int64_t g = (bi * A.T + t) * A.HV + h;
    dec[i] = exp_f(neg_a * softplus_f(A.a[g] + dtb));
    beta[i] = sigmoid_f(A.b[g]);
  }
}

template <int NV>
static inline void store_cols(float* dst, const vf<W>* x, int64_t nvalid) {
  if (nvalid == NV * W) {
    for (int u = 0; u < NV; ++u) store<W>(dst + u * W, x[u]);
    return;
  }
  float tmp[NV * W];
  std::memcpy(tmp, x, sizeof(tmp));
  std::memcpy(dst, tmp, size_t(nvalid) * sizeof(float));
}

template <int NV>
static inline void load_cols(vf<W>* x, const float* src, int64_t nvalid) {
  if (src != nullptr && nvalid == NV * W) {
    for (int u = 0; u < NV; ++u) x[u] = load<W>(src + u * W);
    return;
  }
  float tmp[NV * W] = {};
  if (src != nullptr) std::memcpy(tmp, src, size_t(nvalid) * sizeof(float));
  std::memcpy(x, tmp, sizeof(tmp));
}

// dst = src * d, m = Σ_k dst[k] * kn[k] over a block's rows (the first half of a token;
// src may be dst).
template <int NV>
static inline void decay_and_m(const float* src, float* dst, int64_t K, int64_t ld, float d,
                               const float* kn, vf<W>* m) {
  const vf<W> dv = splat<W>(d);
  for (int u = 0; u < NV; ++u) m[u] = splat<W>(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    const vf<W> kx = splat<W>(kn[k]);
    for (int u = 0; u < NV; ++u) {
      const vf<W> r = load<W>(src + k * ld + u * W) * dv;
      m[u] = m[u] + r * kx;
      store<W>(dst + k * ld + u * W, r);
    }
  }
}

// S += kn ⊗ δ, o = Σ_k S[k] * qn[k] (the second half of a token); with NEXT, the first half of
// the next token fused into the same pass (the same ops on each element, the same order).
// Sb: the state block's rows, ld floats apart; cp: where to save S after this token (a
// checkpoint, rows cp_ld apart), or null.
template <int NV, bool NEXT>
static inline void update(float* Sb, int64_t K, int64_t ld, const float* kn, const float* qn,
                          const vf<W>* delta, vf<W>* o, float dnext, const float* kn_next,
                          vf<W>* m, float* cp, int64_t cp_ld, int64_t nvalid) {
  const vf<W> dn = splat<W>(dnext);
  for (int u = 0; u < NV; ++u) {
    o[u] = splat<W>(0.0f);
    if (NEXT) m[u] = splat<W>(0.0f);
  }
  for (int64_t k = 0; k < K; ++k) {
    float* row = Sb + k * ld;
    const vf<W> kk = splat<W>(kn[k]), qq = splat<W>(qn[k]);
    vf<W> r[NV];
    for (int u = 0; u < NV; ++u) r[u] = load<W>(row + u * W) + kk * delta[u];
    for (int u = 0; u < NV; ++u) o[u] = o[u] + r[u] * qq;
    if (cp != nullptr) store_cols<NV>(cp + k * cp_ld, r, nvalid);
    if (NEXT) {
      const vf<W> kx = splat<W>(kn_next[k]);
      for (int u = 0; u < NV; ++u) {
        r[u] = r[u] * dn;
        m[u] = m[u] + r[u] * kx;
      }
    }
    for (int u = 0; u < NV; ++u) store<W>(row + u * W, r[u]);
  }
}

struct FwdOut {
  const float* state0;  // [B, HV, K, V] or null (zeros)
  float* out;           // [B, T, HV, V]
  float* state_out;     // [B, HV, K, V]
  float* ckpt;          // [B, HV, NC, K, V] or null: state before tokens 0, N, 2N, ..
  // Non-null: state0 / state_out are one state cache, read and then overwritten in place:
  // item (b, h)'s state element (k, v) at slots[b] * s_slot + h * s_h + k * s_k + v * s_v
  // (an engine's per-request states, in its own layout: no gather, no transpose).
  const int64_t* slots;
  int64_t s_slot, s_h, s_k, s_v;
};

// A state cache stored k contiguous (an engine's [V, K] per head) is copied to and from the
// kernel's [nb][k][VB] scratch by 16 x 16 transposes (copies only: the element-wise copy's
// bits). (A cache stored v contiguous needs no copy: see `direct` in fwd_item.)
template <int VB>
static inline bool cache_transposable(const FwdOut& F, int64_t K, int64_t V) {
  return F.s_k == 1 && K % 16 == 0 && V % VB == 0;
}
template <int VB, bool LOAD>
static void cache_blocks(float* S, float* c, const FwdOut& F, int64_t K, int64_t V) {
  vf<16> r[16];
  for (int64_t nb = 0; nb < V / VB; ++nb)
    for (int64_t u = 0; u < VB; u += 16)
      for (int64_t k0 = 0; k0 < K; k0 += 16) {
        float* s = S + (nb * K + k0) * VB + u;  // row i: k = k0 + i, columns v = nb*VB+u ..
        float* g = c + k0 + (nb * VB + u) * F.s_v;  // row j: v = nb*VB+u+j, k = k0 ..
        if (LOAD) {
          for (int j = 0; j < 16; ++j) r[j] = load<16>(g + j * F.s_v);
          transpose16(r);
          for (int i = 0; i < 16; ++i) store<16>(s + i * VB, r[i]);
        } else {
          for (int i = 0; i < 16; ++i) r[i] = load<16>(s + i * VB);
          transpose16(r);
          for (int j = 0; j < 16; ++j) store<16>(g + j * F.s_v, r[j]);
        }
      }
}

template <int VB, class QT>
static void fwd_item(const Args& A, const FwdOut& F, int64_t item, std::vector<float>& scratch) {
  constexpr int NV = VB / W;
  const int64_t bi = item / A.HV, h = item % A.HV;
  const int64_t K = A.K, V = A.V, T = A.T, N = A.ckpt_every;
  const int64_t NB = (V + VB - 1) / VB, Vp = NB * VB;
  const int64_t TC = std::min<int64_t>(T, TCHUNK);
  const int64_t NC = (T + N - 1) / N;
  scratch.resize(size_t(NB * K * VB + 2 * TC * K + TC * Vp + 2 * TC));
  float* S = scratch.data();
  float* qn = S + NB * K * VB;
  float* kn = qn + TC * K;
  float* vv = kn + TC * K;
  float* dec = vv + TC * Vp;
  float* beta = dec + TC;
  const float* s0 = F.state0 == nullptr ? nullptr : F.state0 + item * K * V;
  // An engine cache whose rows are the kernel's (v contiguous, whole column blocks): the
  // state is updated where it lies, no copy in or out (the same ops on the same values).
  float* direct = nullptr;
  if (F.slots != nullptr && F.s_v == 1 && V % VB == 0) {
    direct = F.state_out + F.slots[bi] * F.s_slot + h * F.s_h;
    if (F.state0 == nullptr)
      for (int64_t k = 0; k < K; ++k) std::fill(direct + k * F.s_k, direct + k * F.s_k + V, 0.0f);
    s0 = nullptr;
  } else if (F.slots != nullptr) {  // the whole state is read before anything is written back
    const float* c = F.state0 == nullptr ? nullptr : F.state0 + F.slots[bi] * F.s_slot + h * F.s_h;
    if (c != nullptr && cache_transposable<VB>(F, K, V))
      cache_blocks<VB, true>(S, const_cast<float*>(c), F, K, V);
    else
      for (int64_t nb = 0; nb < NB; ++nb)
        for (int64_t k = 0; k < K; ++k)
          for (int64_t j = 0; j < VB; ++j) {
            const int64_t v = nb * VB + j;
            S[(nb * K + k) * VB + j] = c != nullptr && v < V ? c[k * F.s_k + v * F.s_v] : 0.0f;
          }
    s0 = nullptr;
  } else {
    for (int64_t nb = 0; nb < NB; ++nb)
      for (int64_t k = 0; k < K; ++k) {
        vf<W> x[NV];
        const int64_t c0 = nb * VB;
        load_cols<NV>(x, s0 == nullptr ? nullptr : s0 + k * V + c0, std::min<int64_t>(VB, V - c0));
        std::memcpy(S + (nb * K + k) * VB, x, sizeof(x));
      }
  }
  if (F.ckpt != nullptr) {
    float* c = F.ckpt + item * NC * K * V;
    if (s0 == nullptr) std::fill(c, c + K * V, 0.0f);
    else std::memcpy(c, s0, size_t(K * V) * sizeof(float));
  }
  for (int64_t t0 = 0; t0 < T; t0 += TC) {
    const int64_t t1 = std::min(T, t0 + TC), n = t1 - t0;
    prep<QT>(A, bi, h, t0, t1, Vp, qn, kn, vv, dec, beta);
    for (int64_t nb = 0; nb < NB; ++nb) {
      float* Sb = direct != nullptr ? direct + nb * VB : S + nb * K * VB;
      const int64_t ld = direct != nullptr ? F.s_k : VB;  // floats between state rows k
      const int64_t c0 = nb * VB, nvalid = std::min<int64_t>(VB, V - c0);
      vf<W> m[NV], delta[NV], o[NV];
      decay_and_m<NV>(Sb, Sb, K, ld, dec[0], kn, m);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = t0 + i;
        const vf<W> bt = splat<W>(beta[i]);
        for (int u = 0; u < NV; ++u) delta[u] = (load<W>(vv + i * Vp + c0 + u * W) - m[u]) * bt;
        float* cp = nullptr;
        if (F.ckpt != nullptr && (t + 1) % N == 0 && t + 1 < T)
          cp = F.ckpt + ((item * NC + (t + 1) / N) * K) * V + c0;
        if (i + 1 < n)
          update<NV, true>(Sb, K, ld, kn + i * K, qn + i * K, delta, o, dec[i + 1],
                           kn + (i + 1) * K, m, cp, V, nvalid);
        else
          update<NV, false>(Sb, K, ld, kn + i * K, qn + i * K, delta, o, 0.0f, nullptr, m, cp, V,
                            nvalid);
        store_cols<NV>(F.out + ((bi * T + t) * A.HV + h) * V + c0, o, nvalid);
      }
    }
  }
  if (direct != nullptr) return;
  if (F.slots != nullptr) {
    float* c = F.state_out + F.slots[bi] * F.s_slot + h * F.s_h;
    if (cache_transposable<VB>(F, K, V)) {
      cache_blocks<VB, false>(S, c, F, K, V);
      return;
    }
    for (int64_t nb = 0; nb < NB; ++nb)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < VB && nb * VB + j < V; ++j)
          c[k * F.s_k + (nb * VB + j) * F.s_v] = S[(nb * K + k) * VB + j];
    return;
  }
  float* so = F.state_out + item * K * V;
  for (int64_t nb = 0; nb < NB; ++nb) {
    const int64_t c0 = nb * VB, nvalid = std::min<int64_t>(VB, V - c0);
    for (int64_t k = 0; k < K; ++k)
      std::memcpy(so + k * V + c0, S + (nb * K + k) * VB, size_t(nvalid) * sizeof(float));
  }
}

struct BwdIO {
  const float* ckpt;     // [B, HV, NC, K, V]
  const float* dout;     // [B, T, HV, V]
  const float* dstate;   // [B, HV, K, V] or null (zeros)
  float* dqn;            // [B, T, HV, K], zero on entry
  float* dkn;            // [B, T, HV, K], zero on entry
  float* dv;             // [B, T, HV, V]
  float* dd;             // [B, T, HV], zero on entry
  float* dbeta;          // [B, T, HV], zero on entry
  float* dstate0;        // [B, HV, K, V] or null
};

template <int NV>
static inline float hsum(const vf<W>* x) {
  vf<W> s = x[0];
  for (int u = 1; u < NV; ++u) s = s + x[u];
  return tree_sum<W>(s);
}

// out[j] = Σ over the lanes of p[j], j = 0..15 (a transposing pairwise tree: 30 shuffles
// instead of 16 separate lane trees). Gradients only.
static inline vf<16> hsum16(const vf<16>* p) {
  typedef vi<16> M;
  vf<16> a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1],
                             M{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(p[2 * i], p[2 * i + 1],
                             M{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1],
                             M{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1],
                             M{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1],
                             M{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1],
                             M{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  return __builtin_shuffle(c[0], c[1],
                           M{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(c[0], c[1],
                           M{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

// dst[k] += Σ over the lanes of P[k] (P: K vectors of W), 16 rows at a time.
static inline void add_row_sums(float* dst, const float* P, int64_t K) {
  static_assert(W == 16, "hsum16 reduces 16-lane vectors");
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    vf<16> p[16];
    std::memcpy(p, P + k * W, sizeof(p));
    store<16>(dst + k, load<16>(dst + k) + hsum16(p));
  }
  for (; k < K; ++k) dst[k] = dst[k] + tree_sum<W>(load<W>(P + k * W));
}

template <int VB, class QT>
static void bwd_item(const Args& A, const BwdIO& G, int64_t item, std::vector<float>& scratch) {
  constexpr int NV = VB / W;
  const int64_t bi = item / A.HV, h = item % A.HV;
  const int64_t K = A.K, V = A.V, T = A.T, N = A.ckpt_every, HV = A.HV;
  const int64_t NB = (V + VB - 1) / VB, Vp = NB * VB;
  const int64_t SN = std::min(N, T), NC = (T + N - 1) / N;
  scratch.resize(size_t(NB * K * VB + (SN + 1) * K * VB + 2 * SN * K + SN * Vp + 2 * SN +
                        2 * SN * VB + 2 * K * W));
  float* dS = scratch.data();
  float* Sbuf = dS + NB * K * VB;
  float* qn = Sbuf + (SN + 1) * K * VB;
  float* kn = qn + SN * K;
  float* vv = kn + SN * K;
  float* dec = vv + SN * Vp;
  float* beta = dec + SN;
  float* mbuf = beta + SN;
  float* dbuf = mbuf + SN * VB;
  float* pq = dbuf + SN * VB;  // per k: the lanes of Σ_v S·dO (then of dk's terms)
  float* pk = pq + K * W;
  const float* ds_in = G.dstate == nullptr ? nullptr : G.dstate + item * K * V;
  for (int64_t nb = 0; nb < NB; ++nb)
    for (int64_t k = 0; k < K; ++k) {
      vf<W> x[NV];
      const int64_t c0 = nb * VB;
      load_cols<NV>(x, ds_in == nullptr ? nullptr : ds_in + k * V + c0,
                    std::min<int64_t>(VB, V - c0));
      std::memcpy(dS + (nb * K + k) * VB, x, sizeof(x));
    }
  for (int64_t s = NC - 1; s >= 0; --s) {
    const int64_t t0 = s * N, t1 = std::min(T, t0 + N), n = t1 - t0;
    prep<QT>(A, bi, h, t0, t1, Vp, qn, kn, vv, dec, beta);
    const float* cks = G.ckpt + (item * NC + s) * K * V;
    for (int64_t nb = 0; nb < NB; ++nb) {
      const int64_t c0 = nb * VB, nvalid = std::min<int64_t>(VB, V - c0);
      // recompute the segment's states (bitwise the forward's: the same ops per element)
      for (int64_t k = 0; k < K; ++k) {
        vf<W> x[NV];
        load_cols<NV>(x, cks + k * V + c0, nvalid);
        std::memcpy(Sbuf + k * VB, x, sizeof(x));
      }
      // One pass per token: S1 = S_prev * d and S = S1 + kn ⊗ δ stored, m of the next token
      // accumulated from (S * d_next) * kn (the forward's values: S1 is recomputed the same).
      vf<W> m[NV];
      {
        const vf<W> d0 = splat<W>(dec[0]);
        for (int u = 0; u < NV; ++u) m[u] = splat<W>(0.0f);
        for (int64_t k = 0; k < K; ++k) {
          const vf<W> kx = splat<W>(kn[k]);
          for (int u = 0; u < NV; ++u) m[u] = m[u] + (load<W>(Sbuf + k * VB + u * W) * d0) * kx;
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const float* Sp = Sbuf + i * K * VB;
        float* Sc = Sbuf + (i + 1) * K * VB;
        vf<W> delta[NV];
        const vf<W> bt = splat<W>(beta[i]), dn = splat<W>(dec[i]);
        for (int u = 0; u < NV; ++u) delta[u] = (load<W>(vv + i * Vp + c0 + u * W) - m[u]) * bt;
        std::memcpy(mbuf + i * VB, m, sizeof(m));
        std::memcpy(dbuf + i * VB, delta, sizeof(delta));
        const bool next = i + 1 < n;
        const vf<W> dx = splat<W>(next ? dec[i + 1] : 0.0f);
        const float* kxn = kn + (next ? i + 1 : i) * K;
        const float* ki = kn + i * K;
        for (int u = 0; u < NV; ++u) m[u] = splat<W>(0.0f);
        for (int64_t k = 0; k < K; ++k) {
          const vf<W> kk = splat<W>(ki[k]), kx = splat<W>(kxn[k]);
          for (int u = 0; u < NV; ++u) {
            const vf<W> r = (load<W>(Sp + k * VB + u * W) * dn) + kk * delta[u];
            store<W>(Sc + k * VB + u * W, r);
            m[u] = m[u] + (r * dx) * kx;
          }
        }
      }
      // adjoint, tokens backwards
      float* dSb = dS + nb * K * VB;
      for (int64_t i = n - 1; i >= 0; --i) {
        const int64_t t = t0 + i, row = (bi * T + t) * HV + h;
        const float* St = Sbuf + (i + 1) * K * VB;
        const float* Sp = Sbuf + i * K * VB;
        const float* qi = qn + i * K;
        const float* ki = kn + i * K;
        vf<W> dO[NV], delta[NV], m[NV], vt[NV], ddel[NV];
        load_cols<NV>(dO, G.dout + row * V + c0, nvalid);
        std::memcpy(delta, dbuf + i * VB, sizeof(delta));
        std::memcpy(m, mbuf + i * VB, sizeof(m));
        for (int u = 0; u < NV; ++u) {
          vt[u] = load<W>(vv + i * Vp + c0 + u * W);
          ddel[u] = splat<W>(0.0f);
        }
        float* dq = G.dqn + row * K;
        // dS += qn ⊗ dO; dq = S·dO; dδ = dSᵀ kn; dk = dS·δ
        for (int64_t k = 0; k < K; ++k) {
          float* dr = dSb + k * VB;
          const vf<W> qq = splat<W>(qi[k]), kk = splat<W>(ki[k]);
          vf<W> sq = splat<W>(0.0f), sk = splat<W>(0.0f);
          for (int u = 0; u < NV; ++u) {
            const vf<W> ds = load<W>(dr + u * W) + qq * dO[u];
            store<W>(dr + u * W, ds);
            sq = sq + load<W>(St + k * VB + u * W) * dO[u];
            ddel[u] = ddel[u] + ds * kk;
            sk = sk + ds * delta[u];
          }
          store<W>(pq + k * W, sq);
          store<W>(pk + k * W, sk);
        }
        add_row_sums(dq, pq, K);
        const vf<W> bt = splat<W>(beta[i]);
        vf<W> dvv[NV], dm[NV], pb[NV];
        for (int u = 0; u < NV; ++u) {
          dvv[u] = ddel[u] * bt;
          dm[u] = -dvv[u];
          pb[u] = ddel[u] * (vt[u] - m[u]);
        }
        store_cols<NV>(G.dv + row * V + c0, dvv, nvalid);
        G.dbeta[row] = G.dbeta[row] + hsum<NV>(pb);
        // through m = S1ᵀ kn and S1 = S_prev * d
        const vf<W> dn = splat<W>(dec[i]);
        vf<W> dda[NV];
        for (int u = 0; u < NV; ++u) dda[u] = splat<W>(0.0f);
        float* dk = G.dkn + row * K;
        for (int64_t k = 0; k < K; ++k) {
          float* dr = dSb + k * VB;
          const vf<W> kk = splat<W>(ki[k]);
          vf<W> sk = load<W>(pk + k * W);
          for (int u = 0; u < NV; ++u) {
            const vf<W> sp = load<W>(Sp + k * VB + u * W);
            sk = sk + (sp * dn) * dm[u];
            const vf<W> ds = load<W>(dr + u * W) + kk * dm[u];
            dda[u] = dda[u] + ds * sp;
            store<W>(dr + u * W, ds * dn);
          }
          store<W>(pk + k * W, sk);
        }
        add_row_sums(dk, pk, K);
        G.dd[row] = G.dd[row] + hsum<NV>(dda);
      }
    }
  }
  if (G.dstate0 != nullptr) {
    float* d0 = G.dstate0 + item * K * V;
    for (int64_t nb = 0; nb < NB; ++nb) {
      const int64_t c0 = nb * VB, nvalid = std::min<int64_t>(VB, V - c0);
      for (int64_t k = 0; k < K; ++k)
        std::memcpy(d0 + k * V + c0, dS + (nb * K + k) * VB, size_t(nvalid) * sizeof(float));
    }
  }
}

template <int VB, class QT>
static void run_fwd(const Args& A, const FwdOut& F, int threads) {
  std::vector<std::vector<float>> scratch(size_t(std::max(threads, 1)));
  parallel_items(A.B * A.HV, threads, 1, [&](int64_t item, int worker) {
    fwd_item<VB, QT>(A, F, item, scratch[size_t(worker)]);
  });
}

template <int VB, class QT>
static void run_bwd(const Args& A, const BwdIO& G, int threads) {
  std::vector<std::vector<float>> scratch(size_t(std::max(threads, 1)));
  parallel_items(A.B * A.HV, threads, 1, [&](int64_t item, int worker) {
    bwd_item<VB, QT>(A, G, item, scratch[size_t(worker)]);
  });
}

template <int VB>
static int fwd_dtype(const Args& A, const FwdOut& F, int dtype, int threads) {
  switch (dtype) {
    case F32: run_fwd<VB, float>(A, F, threads); return 0;
    case BF16: run_fwd<VB, uint16_t>(A, F, threads); return 0;
    case F16: run_fwd<VB, _Float16>(A, F, threads); return 0;
  }
  return 2;
}

template <int VB>
static int bwd_dtype(const Args& A, const BwdIO& G, int dtype, int threads) {
  switch (dtype) {
    case F32: run_bwd<VB, float>(A, G, threads); return 0;
    case BF16: run_bwd<VB, uint16_t>(A, G, threads); return 0;
    case F16: run_bwd<VB, _Float16>(A, G, threads); return 0;
  }
  return 2;
}

static int check(const Args& A) {
  if (A.HK <= 0 || A.HV % A.HK != 0) return 1;
  if (A.ckpt_every <= 0) return 1;
  return 0;
}

}  // namespace

extern "C" int isx_gdn_fwd(int64_t B, int64_t T, int64_t HK, int64_t HV, int64_t K, int64_t V,
                           const void* q, const void* k, const void* v, int dtype, int64_t q_sb,
                           int64_t q_st, int64_t q_sh, int64_t k_sb, int64_t k_st, int64_t k_sh,
                           int64_t v_sb, int64_t v_st, int64_t v_sh, const float* a,
                           const float* b, const float* A_log, const float* dt_bias, float eps,
                           const float* state0, float* out, float* state_out, float* ckpt,
                           int64_t ckpt_every, const int64_t* slots, int64_t s_slot,
                           int64_t s_h, int64_t s_k, int64_t s_v, int v_block, int threads) {
  Args A{B, T, HK, HV, K, V, q, q_sb, q_st, q_sh, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh,
         a, b, A_log, dt_bias, eps, ckpt_every};
  if (int rc = check(A)) return rc;
  if (slots != nullptr && ckpt != nullptr) return 1;
  FwdOut F{state0, out, state_out, ckpt, slots, s_slot, s_h, s_k, s_v};
  if (v_block == 16) return fwd_dtype<16>(A, F, dtype, threads);
  if (v_block == 32) return fwd_dtype<32>(A, F, dtype, threads);
  if (v_block == 64) return fwd_dtype<64>(A, F, dtype, threads);
  return 3;
}

extern "C" int isx_gdn_bwd(int64_t B, int64_t T, int64_t HK, int64_t HV, int64_t K, int64_t V,
                           const void* q, const void* k, const void* v, int dtype, int64_t q_sb,
                           int64_t q_st, int64_t q_sh, int64_t k_sb, int64_t k_st, int64_t k_sh,
                           int64_t v_sb, int64_t v_st, int64_t v_sh, const float* a,
                           const float* b, const float* A_log, const float* dt_bias, float eps,
                           const float* ckpt, int64_t ckpt_every, const float* dout,
                           const float* dstate, float* dqn, float* dkn, float* dv, float* dd,
                           float* dbeta, float* dstate0, int v_block, int threads) {
  Args A{B, T, HK, HV, K, V, q, q_sb, q_st, q_sh, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh,
         a, b, A_log, dt_bias, eps, ckpt_every};
  if (int rc = check(A)) return rc;
  BwdIO G{ckpt, dout, dstate, dqn, dkn, dv, dd, dbeta, dstate0};
  if (v_block == 16) return bwd_dtype<16>(A, G, dtype, threads);
  if (v_block == 32) return bwd_dtype<32>(A, G, dtype, threads);
  if (v_block == 64) return bwd_dtype<64>(A, G, dtype, threads);
  return 3;
}
