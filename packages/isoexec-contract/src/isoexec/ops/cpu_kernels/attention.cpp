// Canonical causal attention (GQA) over a paged or packed KV cache, read in place.
//
// One output row = one (query, head) pair, computed whole by one thread, keys 0..pos in
// position order:
//   s_j = (sum over the `L` lanes of q.k_j, lane l holding dims l, l+L, ..; fixed tree) * scale
//   m   = max_j s_j (exact)
//   p_j = exp_nonpos(s_j - m)
//   l   = tree over L lanes of the p_j (key j in lane j % L, keys in order within a lane)
//   o   = (sum_j p_j * v_j, keys in order, per output dim) / l
// Nothing depends on the other rows, the batch, where a prefill was cut, the cache block
// size or the thread count: decode, prefill, chunked prefill and paged or packed keys give
// the same bits. See simd.h for the floating-point rules.
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

using namespace isx;

struct Args {
  int64_t T, H, Hkv, D, Dv;
  const void* q; int64_t q_st, q_sh;
  const void* k; int64_t k_sb, k_ss, k_sh;
  const void* v; int64_t v_sb, v_ss, v_sh;
  int64_t block_size;
  const int32_t* block_table; int64_t bt_stride;  // null: packed keys
  const int64_t* key_start;                       // packed: key j of request r is row key_start[r] + j (row stride: the block stride)
  const int64_t* q_req;
  const int64_t* q_pos;
  float scale;
  float* out;  // [T, H, Dv] contiguous fp32
};

template <class KT>
static inline const KT* row_ptr(const Args& a, const KT* base, int64_t sb, int64_t ss, int64_t sh,
                                int64_t r, int64_t j, int64_t hk) {
  if (a.block_table == nullptr) return base + (a.key_start[r] + j) * sb + hk * sh;
  const int64_t blk = a.block_table[r * a.bt_stride + j / a.block_size];
  return base + blk * sb + (j % a.block_size) * ss + hk * sh;
}

template <int L, class QT, class KT>
static void attend_row(const Args& a, int64_t item, std::vector<float>& scratch) {
  const int64_t t = item / a.H, h = item % a.H;
  const int64_t hk = h / (a.H / a.Hkv);
  const int64_t r = a.q_req[t], n = a.q_pos[t] + 1;
  const int64_t D = a.D, Dv = a.Dv;
  const int64_t Dp = (D + L - 1) / L * L;
  scratch.resize(size_t(Dp + n + L));
  float* qf = scratch.data();
  float* s = qf + Dp;
  const QT* qrow = static_cast<const QT*>(a.q) + t * a.q_st + h * a.q_sh;
  for (int64_t i = 0; i < D; ++i) qf[i] = to_f32(qrow[i]);
  for (int64_t i = D; i < Dp; ++i) qf[i] = 0.0f;
  const KT* kb = static_cast<const KT*>(a.k);
  const KT* vb = static_cast<const KT*>(a.v);
  const int64_t Dfull = D / L * L;
  // scores
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const KT* kr = row_ptr(a, kb, a.k_sb, a.k_ss, a.k_sh, r, j, hk);
    vf<L> acc = splat<L>(0.0f);
    for (int64_t i = 0; i < Dfull; i += L) acc = acc + load<L>(qf + i) * load<L>(kr + i);
    if (Dfull < D) {
      float tail[L];
      std::memcpy(tail, &acc, sizeof(tail));
      for (int64_t i = Dfull; i < D; ++i) tail[i - Dfull] = tail[i - Dfull] + qf[i] * to_f32(kr[i]);
      std::memcpy(&acc, tail, sizeof(tail));
    }
    const float sj = tree_sum<L>(acc) * a.scale;
    s[j] = sj;
    m = sj > m ? sj : m;
  }
  // probabilities and their sum; keys past n are -inf (p = 0, an exact zero added)
  for (int64_t j = n; j < (n + L - 1) / L * L; ++j) s[j] = -std::numeric_limits<float>::infinity();
  const vf<L> mv = splat<L>(m);
  vf<L> lsum = splat<L>(0.0f);
  for (int64_t j = 0; j < n; j += L) {
    vf<L> p = exp_nonpos<L>(load<L>(s + j) - mv);
    store<L>(s + j, p);
    lsum = lsum + p;
  }
  const float l = tree_sum<L>(lsum);
  // p . v, keys in order, 16 output dims per vector (lane count does not matter here: no
  // lane is ever added to another)
  float* o = a.out + (t * a.H + h) * Dv;
  constexpr int V = 16;
  const int64_t Dvfull = Dv / V * V;
  for (int64_t c = 0; c < Dvfull; c += 4 * V) {
    const int64_t w = std::min<int64_t>(4, (Dvfull - c) / V);
    vf<V> acc[4] = {splat<V>(0.0f), splat<V>(0.0f), splat<V>(0.0f), splat<V>(0.0f)};
    for (int64_t j = 0; j < n; ++j) {
      const KT* vr = row_ptr(a, vb, a.v_sb, a.v_ss, a.v_sh, r, j, hk) + c;
      const vf<V> pj = splat<V>(s[j]);
      for (int64_t u = 0; u < w; ++u) acc[u] = acc[u] + pj * load<V>(vr + u * V);
    }
    const vf<V> lv = splat<V>(l);
    for (int64_t u = 0; u < w; ++u) store<V>(o + c + u * V, acc[u] / lv);
  }
  for (int64_t c = Dvfull; c < Dv; ++c) {
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j)
      acc = acc + s[j] * to_f32(row_ptr(a, vb, a.v_sb, a.v_ss, a.v_sh, r, j, hk)[c]);
    o[c] = acc / l;
  }
}

template <int L, class QT, class KT>
static void run(const Args& a, int threads) {
  std::vector<std::vector<float>> scratch(size_t(std::max(threads, 1)));
  parallel_items(a.T * a.H, threads, 4, [&](int64_t item, int worker) {
    attend_row<L, QT, KT>(a, item, scratch[size_t(worker)]);
  });
}

template <int L, class QT>
static int dispatch_kv(const Args& a, int kv_dtype, int threads) {
  switch (kv_dtype) {
    case F32: run<L, QT, float>(a, threads); return 0;
    case BF16: run<L, QT, uint16_t>(a, threads); return 0;
    case F16: run<L, QT, _Float16>(a, threads); return 0;
  }
  return 2;
}

template <int L>
static int dispatch_q(const Args& a, int q_dtype, int kv_dtype, int threads) {
  switch (q_dtype) {
    case F32: return dispatch_kv<L, float>(a, kv_dtype, threads);
    case BF16: return dispatch_kv<L, uint16_t>(a, kv_dtype, threads);
    case F16: return dispatch_kv<L, _Float16>(a, kv_dtype, threads);
  }
  return 2;
}

}  // namespace

extern "C" int isx_attention_fwd(int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t Dv,
                                 const void* q, int q_dtype, int64_t q_st, int64_t q_sh,
                                 const void* k, const void* v, int kv_dtype, int64_t k_sb,
                                 int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss,
                                 int64_t v_sh, int64_t block_size, const int32_t* block_table,
                                 int64_t bt_stride, const int64_t* key_start, const int64_t* q_req,
                                 const int64_t* q_pos, float scale, float* out, int lanes,
                                 int threads) {
  if (H % Hkv != 0) return 1;
  Args a{T, H, Hkv, D, Dv, q, q_st, q_sh, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh,
         block_size, block_table, bt_stride, key_start, q_req, q_pos, scale, out};
  if (lanes == 16) return dispatch_q<16>(a, q_dtype, kv_dtype, threads);
  if (lanes == 8) return dispatch_q<8>(a, q_dtype, kv_dtype, threads);
  return 3;
}
