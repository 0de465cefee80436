// Canonical grouped GEMM for MoE experts: rows sorted by expert, y = x_g @ W_g^T per group.
//
// One output element y[m, n] is, whatever the batch, the group sizes, the tiling or the
// thread count:
//   lane l (of `L`) = over k = l, l + L, l + 2L, .. < K (ascending, from +0.0):
//                     acc = fma(x[m, k], w[n, k], acc), one fused multiply-add in fp32 (bf16
//                     and fp16 inputs widened to fp32 exactly first)
//   y[m, n] = tree_sum over the L lanes (simd.h: fixed pairwise tree), rounded by the caller
// (v2 added fp32 products with a rounded multiply then a rounded add; bf16/fp16 products are
// exact in fp32, so their bits are v2's.) Register blocking (MR rows x NR weight rows, one
// vector accumulator each) and the tiles handed to threads only decide which elements are
// computed together, never an element's order of operations, so they never change a bit. A
// block at the edge of a group runs a smaller MR x NR instance of the same loop. Weights are
// read in their own dtype (bf16 widened in registers: half the memory traffic of fp32). See
// simd.h for the floating-point rules.
#include "simd.h"

#include <algorithm>
#include <type_traits>
#include <utility>

namespace {

using namespace isx;

constexpr int MR = 4;          // x rows per register block
constexpr int NR = 4;          // weight rows (output columns) per register block
// A group of at most MR_FEW rows (an expert at decode) runs as one block of all its rows and
// few_cols(rows) weight rows (at most 24 accumulators), so each weight row is loaded (and
// widened) once, not once per 4 rows.
constexpr int MR_FEW = 16;
constexpr int few_cols(int rows) { return rows <= MR ? NR : rows <= 12 ? 2 : 1; }
constexpr int64_t TILE_R = 32;  // rows per work item
// Output columns per work item: narrow tiles when there are few rows (decode: enough items
// for every thread), wide ones for many rows (prefill: a weight tile stays in L2 across the
// row tiles of its group). Measured on Sapphire Rapids, one thread, K = N = 768.
constexpr int64_t TILE_C_FEW = 64, TILE_C_MANY = 256, MANY_ROWS = 512;

struct Args {
  int64_t G, N, K;
  const int64_t* offsets;  // [G + 1]: group g owns rows offsets[g] .. offsets[g + 1]
  const int64_t* wsel;     // [G]: the weight matrix (expert) of group g
  const void* x; int64_t x_st;             // [S, K], row stride (last dim contiguous)
  const void* w; int64_t w_se, w_sn;       // [E, N, K], expert and row strides
  float* out; int64_t o_st;                // [S, N] fp32, row stride
};

// y[i][j] for i < M x rows (fp32) and j < NN weight rows (dtype W), row strides xst, wst.
template <int L, class W, int M, int NN>
static void block(const float* x, int64_t xst, const W* w, int64_t wst, int64_t K, float* o,
                  int64_t ost) {
  vf<L> acc[M * NN];
#pragma GCC unroll 24
  for (int i = 0; i < M * NN; ++i) acc[i] = splat<L>(0.0f);
  const int64_t Kf = K / L * L;
  for (int64_t k = 0; k < Kf; k += L) {
    vf<L> xv[M], wv[NN];
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) xv[i] = load<L>(x + i * xst + k);
#pragma GCC unroll 16
    for (int j = 0; j < NN; ++j) {
      wv[j] = load<L>(w + j * wst + k);
      __builtin_prefetch(w + (NN + j) * wst + k);  // the next panel (decode is memory-bound)
    }
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < NN; ++j) acc[i * NN + j] = fmadd<L>(xv[i], wv[j], acc[i * NN + j]);
  }
  if (Kf < K) {
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < NN; ++j) {
        float t[L];
        std::memcpy(t, &acc[i * NN + j], sizeof(t));
        for (int64_t k = Kf; k < K; ++k)
          t[k - Kf] = __builtin_fmaf(x[i * xst + k], to_f32(w[j * wst + k]), t[k - Kf]);
        std::memcpy(&acc[i * NN + j], t, sizeof(t));
      }
  }
  float y[M * NN];
  tree_sum_many<L, M * NN>(acc, y);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < NN; ++j) o[i * ost + j] = y[i * NN + j];
}

template <int L, class W>
using BlockFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, int64_t);

template <int L, class W, int M, int... NNs>
static constexpr void fill_row(BlockFn<L, W> (&t)[MR_FEW][NR], std::integer_sequence<int, NNs...>) {
  ((t[M - 1][NNs] = &block<L, W, M, NNs + 1>), ...);
}
template <int L, class W, int... Ms>
static constexpr void fill(BlockFn<L, W> (&t)[MR_FEW][NR], std::integer_sequence<int, Ms...>) {
  ((fill_row<L, W, Ms + 1>(t, std::make_integer_sequence<int, few_cols(Ms + 1)>{})), ...);
}

// Every M x NN instance, indexed [M - 1][NN - 1]: M <= MR with NN <= NR (the tiling for
// many rows), MR < M <= MR_FEW with NN <= few_cols(M) (a group of a few rows in one block).
template <int L, class W>
struct Blocks {
  BlockFn<L, W> fn[MR_FEW][NR] = {};
  constexpr Blocks() { fill<L, W>(fn, std::make_integer_sequence<int, MR_FEW>{}); }
};

// Widen an item's bf16/fp16 x rows to fp32 (exact) once: every weight row of the item reads
// them (weights are widened in registers as they stream, see `load`).
template <class T>
static void widen(const T* src, int64_t st, int64_t rows, int64_t K, std::vector<float>& dst) {
  constexpr int V = 16;
  dst.resize(size_t(rows * K));
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * st;
    float* d = dst.data() + r * K;
    int64_t k = 0;
    for (; k + V <= K; k += V) store<V>(d + k, load<V>(s + k));
    for (; k < K; ++k) d[k] = to_f32(s[k]);
  }
}

struct Scratch {
  std::vector<float> x;
};

// One work item: rows r0..r1 of group g (all in one group) x output columns c0..c1.
template <int L, class T>
static void tile(const Args& a, int64_t g, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                 Scratch& s) {
  static constexpr Blocks<L, T> blocks{};
  const int64_t K = a.K;
  const T* xg = static_cast<const T*>(a.x) + r0 * a.x_st;
  const T* wg = static_cast<const T*>(a.w) + a.wsel[g] * a.w_se;
  const float* xs;
  int64_t xst;
  if constexpr (std::is_same_v<T, float>) {
    xs = xg;
    xst = a.x_st;
  } else {  // the item's rows, widened once
    widen(xg, a.x_st, r1 - r0, K, s.x);
    xs = s.x.data();
    xst = K;
  }
  const int64_t rows = r1 - r0;
  const int64_t mr = rows > MR && rows <= MR_FEW ? rows : MR;
  const int64_t nr = few_cols(int(mr));
  for (int64_t c = c0; c < c1; c += nr) {
    const int nn = int(std::min<int64_t>(nr, c1 - c));
    for (int64_t r = r0; r < r1; r += mr) {
      const int m = int(std::min<int64_t>(mr, r1 - r));
      blocks.fn[m - 1][nn - 1](xs + (r - r0) * xst, xst, wg + c * a.w_sn, a.w_sn, K,
                               a.out + r * a.o_st + c, a.o_st);
    }
  }
}

template <int L, class T>
static void run(const Args& a, int threads) {
  // Row tiles of every group in order, then items = row tiles x column tiles.
  std::vector<int64_t> tg, tr;  // group and first row of each row tile
  for (int64_t g = 0; g < a.G; ++g)
    for (int64_t r = a.offsets[g]; r < a.offsets[g + 1]; r += TILE_R) {
      tg.push_back(g);
      tr.push_back(r);
    }
  const int64_t tc = a.offsets[a.G] - a.offsets[0] >= MANY_ROWS ? TILE_C_MANY : TILE_C_FEW;
  const int64_t nc = (a.N + tc - 1) / tc;
  const int64_t nr = int64_t(tg.size());
  std::vector<Scratch> scratch(size_t(std::max(threads, 1)));
  // Column tile outer, row tile inner: consecutive items of a thread reuse the weight tile.
  parallel_items(nr * nc, threads, 1, [&](int64_t item, int worker) {
    const int64_t ct = item / nr, rt = item % nr;
    const int64_t g = tg[size_t(rt)], r0 = tr[size_t(rt)];
    const int64_t r1 = std::min(r0 + TILE_R, a.offsets[g + 1]);
    const int64_t c0 = ct * tc, c1 = std::min(c0 + tc, a.N);
    tile<L, T>(a, g, r0, r1, c0, c1, scratch[size_t(worker)]);
  });
}

template <int L>
static int dispatch(const Args& a, int dtype, int threads) {
  switch (dtype) {
    case F32: run<L, float>(a, threads); return 0;
    case BF16: run<L, uint16_t>(a, threads); return 0;
    case F16: run<L, _Float16>(a, threads); return 0;
  }
  return 2;
}

}  // namespace

// out[offsets[g]:offsets[g+1], :] = x[offsets[g]:offsets[g+1], :] @ w[wsel[g]]^T (fp32), for
// x and w in one dtype (0 fp32, 1 bf16, 2 fp16). Returns 0, or a nonzero refusal code.
extern "C" int isx_moe_grouped_gemm(int64_t G, int64_t N, int64_t K, const int64_t* offsets,
                                    const int64_t* wsel, const void* x, int64_t x_st,
                                    const void* w, int64_t w_se, int64_t w_sn, int dtype,
                                    float* out, int64_t o_st, int lanes, int threads) {
  if (G < 0 || N < 0 || K < 0) return 1;
  Args a{G, N, K, offsets, wsel, x, x_st, w, w_se, w_sn, out, o_st};
  if (lanes == 16) return dispatch<16>(a, dtype, threads);
  if (lanes == 8) return dispatch<8>(a, dtype, threads);
  return 3;
}
