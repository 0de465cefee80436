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

// ---------------------------------------------------------------------------------------
// bf16 expert GEMM on AMX tiles (moe_combine v5, CPUs with AMX-BF16).
//
// One output element y[m, n] is, whatever the batch, the group sizes, the tiling or the
// thread count:
//   acc = +0.0 (fp32); for chunk c = 0, 1, .. (32 k's each, ascending):
//       acc = TDPBF16PS(acc, x[m, 32c .. 32c + 31], w[n, 32c .. 32c + 31])
//   rounded by the caller.
// TDPBF16PS is one AMX instruction: the 16 bf16 pairs of a chunk, in the order and with the
// rounding the hardware defines (fp32 accumulation, round to nearest even, denormals flushed;
// not a plain chain of fused multiply-adds: measured different here), defined by the ISA,
// and in no way dependent on the other rows of the tile. K is zero-padded to whole
// chunks and groups to whole 16-row tiles (padded products are 0 * 0); the 64-column tile
// quads handed to threads only decide where an element is computed. So a row's bits depend on
// that row and its expert's weights alone. The bits are the ISA's (AMX), not the source's as
// the vector kernels' are: the contract records the kernel, and the backend identity the CPU.
//
// Why: a decode step's expert GEMM is memory-bound (a few rows per expert); the vector FMA
// kernels are compute-bound on bf16 (every weight widened to fp32), oneDNN's prepacked blocks
// pay a call and a 32-row padded block per expert. The tiles stream each packed weight once.
// The tile shapes: the kernel's, and the packed weight layout's (built on every CPU).
namespace amx_layout {
constexpr int TR = 16;               // rows per tile (x rows, and k pairs of a weight tile)
constexpr int TK = 32;               // bf16 k per chunk (one 64-byte tile row)
constexpr int TN = 16;               // fp32 output columns per accumulator tile
constexpr int NT = 4;                // accumulator tiles per item (64 columns)
constexpr int64_t BT = TR * TN * 2;  // bf16 per packed weight tile (16 k pairs x 16 cols x 2)
}  // namespace amx_layout

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define ISX_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
namespace {
namespace amx {
using namespace isx;
using namespace amx_layout;

// Tile registers: 0-3 accumulators, 4 the x chunk, 5-7 weight chunks. All 16 x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static void configure() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = TR;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

struct Args {
  int64_t G, N, K;
  const int64_t* offsets;  // [G + 1]: group g owns rows offsets[g] .. offsets[g + 1]
  const int64_t* wsel;     // [G]: the expert of group g
  const uint16_t* x; int64_t x_st;  // [S, K] bf16, row stride
  const uint16_t* w;                // packed (isx_moe_amx_pack) [E, Q, Kc, NT, TR, TN, 2]
  float* out; int64_t o_st;         // [S, N] fp32, row stride
};

static void run(const Args& a, int threads) {
  const int64_t Kc = (a.K + TK - 1) / TK, Kp = Kc * TK;
  const int64_t Q = (a.N + NT * TN - 1) / (NT * TN);
  const int64_t w_se = Q * Kc * NT * BT;
  std::vector<int64_t> gs;  // non-empty groups
  for (int64_t g = 0; g < a.G; ++g)
    if (a.offsets[g + 1] > a.offsets[g]) gs.push_back(g);
  const int64_t ng = int64_t(gs.size());
  // Every group's rows once, zero-padded to whole tiles (rows) and chunks (k).
  std::vector<int64_t> at(size_t(ng) + 1, 0);
  for (int64_t i = 0; i < ng; ++i) {
    const int64_t g = gs[size_t(i)], m = a.offsets[g + 1] - a.offsets[g];
    at[size_t(i) + 1] = at[size_t(i)] + (m + TR - 1) / TR * TR;
  }
  std::vector<uint16_t> xp(size_t(at[size_t(ng)] * Kp), 0);
  for (int64_t i = 0; i < ng; ++i) {
    const int64_t g = gs[size_t(i)];
    for (int64_t r = a.offsets[g]; r < a.offsets[g + 1]; ++r)
      std::memcpy(xp.data() + (at[size_t(i)] + r - a.offsets[g]) * Kp, a.x + r * a.x_st,
                  size_t(a.K) * 2);
  }
  // Items: (group, 64-column quad), a group's quads in order (its weights stream in order).
  parallel_items(ng * Q, threads, 1, [&](int64_t item, int) {
    configure();  // per item: other code on this thread (oneDNN) may configure the tiles
    const int64_t i = item / Q, q = item % Q, g = gs[size_t(i)];
    const uint16_t* wq = a.w + a.wsel[g] * w_se + q * Kc * NT * BT;
    const int64_t c0 = q * NT * TN, cols = std::min<int64_t>(NT * TN, a.N - c0);
    alignas(64) float cb[TR * NT * TN];
    for (int64_t r = a.offsets[g]; r < a.offsets[g + 1]; r += TR) {
      const int64_t m = std::min<int64_t>(TR, a.offsets[g + 1] - r);
      const uint16_t* xt = xp.data() + (at[size_t(i)] + r - a.offsets[g]) * Kp;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kc = 0; kc < Kc; ++kc) {
        const uint16_t* b = wq + kc * NT * BT;
        _tile_loadd(4, xt + kc * TK, Kp * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + BT, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 2 * BT, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 3 * BT, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, cb, NT * TN * 4);
      _tile_stored(1, cb + TN, NT * TN * 4);
      _tile_stored(2, cb + 2 * TN, NT * TN * 4);
      _tile_stored(3, cb + 3 * TN, NT * TN * 4);
      for (int64_t k = 0; k < m; ++k)
        std::memcpy(a.out + (r + k) * a.o_st + c0, cb + k * NT * TN, size_t(cols) * 4);
    }
    _tile_release();
  });
}
}  // namespace amx
}  // namespace
#endif

// 1 when this build has the AMX kernel and Linux grants this process the AMX tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; idempotent), else 0.
extern "C" int isx_moe_amx_ready() {
#ifdef ISX_HAVE_AMX
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
  return 0;
#endif
}

// bf16 elements of one expert's packed weight [N, K]: whole 64-column quads and 32-k chunks.
extern "C" int64_t isx_moe_amx_packed_elems(int64_t N, int64_t K) {
  using namespace amx_layout;
  return (N + NT * TN - 1) / (NT * TN) * ((K + TK - 1) / TK) * NT * BT;
}

// Pack w [E, N, K] (bf16, strides w_se, w_sn; k contiguous) into out [E, Q, Kc, 4, 16, 16, 2]:
// per 64-column quad and 32-k chunk, four weight tiles in AMX's pair layout (tile row j holds
// for each column n the pair w[n, 32c + 2j], w[n, 32c + 2j + 1]); zeros past N and K. A tile
// is a 16 x 16 transpose of 32-bit pairs (data movement only).
extern "C" int isx_moe_amx_pack(int64_t E, int64_t N, int64_t K, const uint16_t* w,
                                int64_t w_se, int64_t w_sn, uint16_t* out) {
  using namespace isx;
  using namespace amx_layout;
  static_assert(TR == 16 && TN == 16 && TK == 2 * TR, "a weight tile is a 16 x 16 transpose");
  if (E < 0 || N < 0 || K < 0) return 1;
  const int64_t Kc = (K + TK - 1) / TK, Q = (N + NT * TN - 1) / (NT * TN);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t q = 0; q < Q; ++q)
      for (int64_t kc = 0; kc < Kc; ++kc)
        for (int t = 0; t < NT; ++t, out += BT) {
          vf<16> r[16];  // row n: column n's 32 k's of this chunk, as 16 pairs
          for (int n = 0; n < TN; ++n) {
            const int64_t col = (q * NT + t) * TN + n, k0 = kc * TK;
            uint16_t pairs[TK] = {};
            if (col < N)
              std::memcpy(pairs, w + e * w_se + col * w_sn + k0,
                          size_t(std::min<int64_t>(TK, K - k0)) * 2);
            std::memcpy(&r[n], pairs, sizeof(pairs));
          }
          transpose16(r);  // row j: pair j of every column
          std::memcpy(out, r, sizeof(r));
        }
  return 0;
}

// out[offsets[g]:offsets[g+1], :N] = x[offsets[g]:offsets[g+1], :] @ w[wsel[g]]^T (fp32), x
// bf16 [S, K] and w packed by isx_moe_amx_pack. Returns 0, 1 (bad sizes) or 4 (no AMX build).
extern "C" int isx_moe_amx_gemm(int64_t G, int64_t N, int64_t K, const int64_t* offsets,
                                const int64_t* wsel, const uint16_t* x, int64_t x_st,
                                const uint16_t* w, float* out, int64_t o_st, int threads) {
  if (G < 0 || N < 0 || K < 0) return 1;
#ifdef ISX_HAVE_AMX
  amx::run(amx::Args{G, N, K, offsets, wsel, x, x_st, w, out, o_st}, threads);
  return 0;
#else
  (void)offsets, (void)wsel, (void)x, (void)x_st, (void)w, (void)out, (void)o_st, (void)threads;
  return 4;
#endif
}
