// The hottest canonical CPU ops as torch operators registered in C++ (`torch.ops.isoexec_cpu`).
//
// Why: a decode step at a small size makes some 46 op calls. Through Python each costs a
// custom-op dispatch, the op's Python and ctypes (10-20 us on these CPUs, #37's profile), while
// a C++-registered operator costs about 1 us. These wrappers only move data and call the same
// kernels the Python ops call (`isx_rms_norm_fwd`, `isx_gemm`), with the same arguments, so the
// bits are the kernels' either way (tests/ops/test_torch_ops.py checks them against the Python
// ops). No arithmetic happens here, except the linear's bias add, which is the same aten add the
// Python op makes.
//
// The linear keeps the kernel's packed weights in a cache of its own, with the Python cache's
// rules (`gemm.cached_pack`): an entry is keyed by the weight's storage, offset, shape and
// strides, stamped with its version counter, and dropped when the storage dies. Like the Python
// cache it is off until the owner enables it and is cleared by the owner after writes that
// bypass the version counter (`gemm.enable_packed_weight_cache`, `clear_packed_weight_cache`
// call `set_pack_cache` and `clear_pack_cache` here).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include "torch_ops.h"

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

extern "C" int isx_rms_norm_fwd(int64_t rows, int64_t dim, const void* x, int64_t x_inner,
                                int64_t x_outer, int64_t x_stride, const void* res,
                                int64_t r_inner, int64_t r_outer, int64_t r_stride,
                                const void* w, int w_dtype, void* y, void* r_out, int dtype,
                                float eps, int zero_centered, int threads);
extern "C" int isx_rope_apply(int64_t tokens, int64_t heads, int64_t dim, int64_t rot,
                              const void* x, int64_t x_tok, int64_t x_head, const float* cos,
                              const float* sin, const int64_t* pos, void* out, int dtype,
                              int threads);
extern "C" int isx_gemm(const void* x, int64_t M, int64_t K, int64_t N, int64_t ldx,
                        const void* wp, void* y, int dtype, int out_f32, int threads);

namespace isoexec_cpu {

// ---- rms_norm --------------------------------------------------------------------------------
// norm.py `_rows`: row i of t starts (i / inner) * outer + (i % inner) * stride elements in.
struct Rows {
  at::Tensor t;
  int64_t inner, outer, stride;
};

Rows rows_of(const at::Tensor& t) {
  if (t.stride(-1) == 1) {
    if (t.dim() == 2) return {t, std::max<int64_t>(1, t.size(0)), 0, t.stride(0)};
    if (t.dim() == 3) return {t, std::max<int64_t>(1, t.size(1)), t.stride(0), t.stride(1)};
  }
  at::Tensor c = t.contiguous();
  return {c, std::max<int64_t>(1, c.numel() / c.size(-1)), 0, c.size(-1)};
}

// norm.py `rms_norm` on CPU (its `_check_cpu`, then `_rms_norm_cpu`).
std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps, bool zero_centered,
                                                 const c10::optional<at::Tensor>& residual_in) {
  const char* op = "rms_norm";
  check_cpu_kernel_dtype(op, "x", x);
  check_cpu_kernel_dtype(op, "weight", weight);
  at::Tensor residual;
  if (residual_in.has_value()) {
    check_cpu_kernel_dtype(op, "residual", *residual_in);
    residual = *residual_in;
  }
  const int64_t d = x.dim() ? x.size(-1) : 0;
  TORCH_CHECK(d >= 1 && weight.dim() == 1 && weight.size(0) == d, op, ": weight ",
              weight.sizes(), " for x ", x.sizes());
  if (residual.defined()) {
    TORCH_CHECK(residual.sizes() == x.sizes(), op, ": residual ", residual.sizes(), " for x ",
                x.sizes());
    if (residual.scalar_type() != x.scalar_type()) residual = residual.to(x.scalar_type());
  }
  const int64_t rows = x.numel() / d;
  Rows xs = rows_of(x);
  at::Tensor w = weight.contiguous();
  // the outputs keep empty_like(x)'s layout; the kernel writes rows one after another
  at::Tensor y = at::empty_like(x);
  const bool dense = y.is_contiguous();
  at::Tensor y_rows = dense ? y : at::empty(x.sizes(), x.options());
  Rows rs{at::Tensor(), 1, 0, 0};
  at::Tensor r_out, r_rows;
  if (residual.defined()) {
    rs = rows_of(residual);
    r_out = at::empty_like(x);
    r_rows = dense ? r_out : at::empty(x.sizes(), x.options());
  }
  const int rc = isx_rms_norm_fwd(
      rows, d, xs.t.data_ptr(), xs.inner, xs.outer, xs.stride,
      rs.t.defined() ? rs.t.data_ptr() : nullptr, rs.inner, rs.outer, rs.stride, w.data_ptr(),
      dtype_code(w.scalar_type()), y_rows.data_ptr(), r_rows.defined() ? r_rows.data_ptr() : nullptr,
      dtype_code(x.scalar_type()), static_cast<float>(eps), zero_centered ? 1 : 0,
      at::get_num_threads());
  TORCH_CHECK(rc == 0, "IsoExec's rms_norm CPU kernel refused its arguments (code ", rc, ")");
  if (!dense) {
    y.copy_(y_rows);
    if (r_out.defined()) r_out.copy_(r_rows);
  }
  return {y, r_out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    bool zero_centered) {
  return std::get<0>(rms_norm_impl(x, weight, eps, zero_centered, c10::nullopt));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& x,
                                                     const at::Tensor& weight, double eps,
                                                     bool zero_centered,
                                                     const at::Tensor& residual) {
  return rms_norm_impl(x, weight, eps, zero_centered, residual);
}

// ---- silu_mul -------------------------------------------------------------------------------
// activation.py `silu_mul` with _pointwise.py `silu`: the same aten ops on the same operands
// (flatten, zero-pad, silu, slice; multiply; round), so the same bits.
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu(), "silu_mul: x ", x.sizes(), " on ", x.device());
  const int64_t d = x.size(-1), i = d / 2;
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor gate = pointwise([](const at::Tensor& t) { return at::silu(t); },
                                     xf.narrow(-1, 0, i));
  return at::mul(gate, xf.narrow(-1, i, d - i)).to(x.scalar_type());
}

// ---- rope ------------------------------------------------------------------------------------
// rope.py `rope_inv_freq`: 1 / base^(2i/rot) in fp32 (int64 arange -> fp32, / rot; pow through
// `pointwise`; `1.0 / t` is torch's reciprocal times 1), kept per (rot, base).
at::Tensor inv_freq(int64_t rot, double base) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, double>, at::Tensor> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto hit = cache.find({rot, base});
  if (hit != cache.end()) return hit->second;
  const at::Tensor e = at::arange(0, rot, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat)
                           .div(static_cast<double>(rot));
  const at::Tensor powed = pointwise([base](const at::Tensor& t) { return at::pow(base, t); }, e);
  at::Tensor f = at::mul(at::reciprocal(powed), 1.0);
  cache.emplace(std::make_pair(rot, base), f);
  return f;
}

// rope.py `rope_cos_sin`: fp32 (cos, sin) [T, rot/2] of integer positions [T] (fp32 angles,
// cos and sin through `pointwise`). An entry depends only on its position.
std::pair<at::Tensor, at::Tensor> cos_sin(const at::Tensor& pos, int64_t rot, double base) {
  const at::Tensor freqs = at::mul(pos.reshape({-1}).to(at::kFloat).unsqueeze(1),
                                   inv_freq(rot, base).unsqueeze(0));
  return {pointwise([](const at::Tensor& a) { return at::cos(a); }, freqs).contiguous(),
          pointwise([](const at::Tensor& a) { return at::sin(a); }, freqs).contiguous()};
}

// rope.py `_table`: `cos_sin` of positions 0..n-1 covering `need` positions, kept per (rot,
// base) and rebuilt twice as long when a position reaches past it (at least 4096 rows). Why a
// table and not the step's positions: cos and sin of the tiny angles of the slow dimensions
// pass through subnormals, which cost this CPU microcode assists (a 512-value call measured
// 10 us to 4 ms), once per table instead of every call.
std::pair<at::Tensor, at::Tensor> table(int64_t rot, double base, int64_t need) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, double>, std::pair<at::Tensor, at::Tensor>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto hit = cache.find({rot, base});
  if (hit != cache.end() && hit->second.first.size(0) >= need) return hit->second;
  int64_t n = 1;
  while (n < need) n *= 2;
  n = std::max<int64_t>(4096, n);
  auto built = cos_sin(at::arange(n, at::TensorOptions().dtype(at::kLong)), rot, base);
  cache[{rot, base}] = built;
  return built;
}

// compiled_ops `rope` on CPU: rope.py `apply_rope_at`, the kernel reading each token's row of
// the table by its position (the rows are `rope_cos_sin` of the positions: the same bits as the
// formula); positions no table holds (a negative one) get `cos_sin` of themselves.
at::Tensor rope(const at::Tensor& positions, const at::Tensor& x, int64_t head_size,
                int64_t rotary_dim, double base) {
  check_cpu_kernel_dtype("rope", "x", x);
  TORCH_CHECK(positions.device().is_cpu(), "rope: positions on ", positions.device());
  const at::Tensor pos = positions.reshape({-1}).to(at::kLong).contiguous();
  const int64_t t = pos.size(0);
  TORCH_CHECK(head_size >= 1 && x.numel() % std::max<int64_t>(1, t * head_size) == 0,
              "rope: x ", x.sizes(), " for ", t, " positions of heads of ", head_size);
  at::Tensor heads = x.reshape({t, -1, head_size});
  const int64_t h = heads.size(1), rot = rotary_dim;
  TORCH_CHECK(rot % 2 == 0 && rot >= 2 && rot <= head_size, "apply_rope: rotary_dim ", rot,
              " for head size ", head_size);
  const int64_t* p = pos.data_ptr<int64_t>();
  int64_t lo = 0, hi = -1;
  for (int64_t i = 0; i < t; ++i) {
    lo = i ? std::min(lo, p[i]) : p[i];
    hi = std::max(hi, p[i]);
  }
  const bool lookup = t > 0 && lo >= 0;
  const auto cs = lookup ? table(rot, base, hi + 1) : cos_sin(pos, rot, base);
  if (heads.stride(-1) != 1) heads = heads.contiguous();
  at::Tensor out = at::empty(heads.sizes(), heads.options().memory_format(at::MemoryFormat::Contiguous));
  const int rc = isx_rope_apply(t, h, head_size, rot, heads.data_ptr(), heads.stride(0),
                                heads.stride(1), cs.first.data_ptr<float>(),
                                cs.second.data_ptr<float>(), lookup ? p : nullptr, out.data_ptr(),
                                dtype_code(x.scalar_type()), at::get_num_threads());
  TORCH_CHECK(rc == 0, "IsoExec's RoPE CPU kernel refused its arguments (code ", rc, ")");
  return out.reshape(x.sizes());
}

// ---- packed weights --------------------------------------------------------------------------
// cpu_gemm.py `pack_panels`: [N, K] -> [ceil(N/32), K, 32] (bf16: [.., K/2, 32, 2]), zero past N.
at::Tensor pack_panels(const at::Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const bool pairs = weight.scalar_type() == at::kBFloat16;
  const int64_t kp = k + (pairs ? k % 2 : 0);
  at::Tensor padded = at::zeros({panels * kPanel, kp}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  if (pairs) return padded.view({panels, kPanel, kp / 2, 2}).transpose(1, 2).contiguous();
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

struct PackEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t version;
  at::Tensor packed;
};
using PackKey = std::tuple<const void*, int64_t, int64_t, int64_t, int64_t, int64_t, int>;

std::mutex pack_mutex;
bool pack_cache_enabled = false;
std::map<PackKey, PackEntry> pack_cache;

void drop_dead_entries() {
  for (auto it = pack_cache.begin(); it != pack_cache.end();) {
    it = it->second.storage.expired() ? pack_cache.erase(it) : std::next(it);
  }
}

at::Tensor packed_weight(const at::Tensor& weight) {
  // an inference tensor has no version counter to stamp: a temporary, packed fresh (as the
  // Python cache does)
  if (weight.is_inference()) return pack_panels(weight);
  std::lock_guard<std::mutex> lock(pack_mutex);
  if (!pack_cache_enabled) return pack_panels(weight);
  const c10::Storage& storage = weight.storage();
  const PackKey key{storage.unsafeGetStorageImpl(), weight.storage_offset(), weight.size(0),
                    weight.size(1),  weight.stride(0),         weight.stride(1),
                    static_cast<int>(weight.scalar_type())};
  const int64_t version = weight._version();
  auto hit = pack_cache.find(key);
  if (hit != pack_cache.end()) {
    auto alive = hit->second.storage.lock();
    if (alive && hit->second.version == version) return hit->second.packed;
  }
  drop_dead_entries();
  at::Tensor packed = pack_panels(weight);
  pack_cache.insert_or_assign(key, PackEntry{storage.getWeakStorageImpl(), version, packed});
  return packed;
}

void set_pack_cache(bool enabled) {
  std::lock_guard<std::mutex> lock(pack_mutex);
  pack_cache_enabled = enabled;
  if (!enabled) pack_cache.clear();
}

void clear_pack_cache() {
  std::lock_guard<std::mutex> lock(pack_mutex);
  pack_cache.clear();
}

int64_t pack_cache_size() {
  std::lock_guard<std::mutex> lock(pack_mutex);
  return static_cast<int64_t>(pack_cache.size());
}

// ---- linear ---------------------------------------------------------------------------------
// cpu_gemm.py `panel_gemm` of x2 [M, K] with `weight` [N, K] packed (cached): [M, N] in x's dtype.
at::Tensor gemm_rows(const at::Tensor& x_rows, const at::Tensor& weight) {
  at::Tensor x2 = x_rows;
  const int64_t m = x2.size(0), k = x2.size(1), n = weight.size(0);
  if (x2.stride(-1) != 1 || (m > 1 && x2.stride(0) < k)) x2 = x2.contiguous();
  at::Tensor packed = packed_weight(weight);
  at::Tensor y = at::empty({m, n}, x2.options());
  const int64_t ldx = m > 1 ? x2.stride(0) : k;
  const int rc = isx_gemm(x2.data_ptr(), m, k, n, ldx, packed.data_ptr(), y.data_ptr(),
                          dtype_code(x2.scalar_type()), 0, at::get_num_threads());
  TORCH_CHECK(rc == 0, "IsoExec's CPU GEMM kernel refused its arguments (code ", rc, ")");
  return y;
}

// gemm.py `linear` without gradient, on CPU (`_block_gemm` -> `gemm_rows`).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "linear: x ", x.scalar_type(),
              " and weight ", weight.scalar_type(), " differ");
  check_cpu_kernel_dtype("linear", "x", x);
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "linear: weight ", weight.sizes(),
              " on ", weight.device());
  const int64_t k = x.size(-1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "linear: x ", x.sizes(), " against weight ", weight.sizes());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
  out_shape.push_back(n);
  at::Tensor y = gemm_rows(x.reshape({-1, k}), weight).view(out_shape);
  if (bias.has_value()) y = at::add(y, bias->to(y.scalar_type()));
  return y;
}

}  // namespace isoexec_cpu

using namespace isoexec_cpu;

TORCH_LIBRARY(isoexec_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool zero_centered) -> Tensor");
  m.def(
      "rms_norm_residual(Tensor x, Tensor weight, float eps, bool zero_centered, "
      "Tensor residual) -> (Tensor, Tensor)");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("rope(Tensor positions, Tensor x, int head_size, int rotary_dim, float base) -> Tensor");
  m.def("set_pack_cache(bool enabled) -> ()", &set_pack_cache);
  m.def("clear_pack_cache() -> ()", &clear_pack_cache);
  m.def("pack_cache_size() -> int", &pack_cache_size);
}

TORCH_LIBRARY_IMPL(isoexec_cpu, CPU, m) {
  m.impl("rms_norm", TORCH_FN(rms_norm));
  m.impl("rms_norm_residual", TORCH_FN(rms_norm_residual));
  m.impl("linear", TORCH_FN(linear));
  m.impl("silu_mul", TORCH_FN(silu_mul));
  m.impl("rope", TORCH_FN(rope));
}
