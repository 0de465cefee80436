// `torch.ops.isoexec_cpu.moe_combine`: moe.py `moe_combine` on CPU without gradient, in C++.
//
// Why: the Python op is some thirty small torch calls (sort, count, gather, two grouped GEMMs,
// SiLU, scatter, the weighted sum), 470 us a call at a small decode step where native's fused
// MoE takes a fraction of that (#37's profile). This is the same sequence of aten calls on the
// same operands and the same kernels (`isx_moe_grouped_gemm` for fp32, the linear's GEMM per
// expert for the other dtypes), so the same bits (tests/ops/test_torch_ops_moe.py compares it
// with the Python op). AMX experts stay in Python: the engine routes only the two kinds here.

#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/index_put.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "torch_ops.h"

extern "C" int isx_moe_grouped_gemm(int64_t G, int64_t N, int64_t K, const int64_t* offsets,
                                    const int64_t* wsel, const void* x, int64_t x_st,
                                    const void* w, int64_t w_se, int64_t w_sn, int dtype,
                                    float* out, int64_t o_st, int lanes, int threads);

namespace isoexec_cpu {
namespace {

// moe.py `expert_gemm` kinds this operator runs.
const std::string kGrouped = "cxx-vector-ext-fma";
const std::string kBlocks = "linear-blocks";

// moe.py `_forward`: rows offsets[g]:offsets[g+1] of x times w[wsel[g]]^T, rounded once to
// x's dtype; `grouped`: the grouped kernel (`_grouped_gemm`), else the linear's GEMM per group
// (`_block_groups`).
at::Tensor experts_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets,
                        const at::Tensor& wsel, bool grouped, int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "moe: lanes=", lanes, " unsupported; the kernel has (8, 16)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "moe: the expert GEMMs run on CPU");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2), "moe: x ", x.sizes(),
              " and w ", w.sizes(), " do not multiply");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && dtype_code(x.scalar_type()) >= 0, "moe: x ",
              x.scalar_type(), " and w ", w.scalar_type(), " must be one of fp32/bf16/fp16");
  const int64_t s = x.size(0), k = x.size(1), n = w.size(1);
  if (grouped) {
    const at::Tensor xs = x.stride(-1) == 1 ? x : x.contiguous();
    const at::Tensor ws = w.stride(-1) == 1 ? w : w.contiguous();
    at::Tensor out = at::empty({s, n}, x.options().dtype(at::kFloat));
    if (s == 0 || n == 0) return out.to(x.scalar_type());
    const int rc = isx_moe_grouped_gemm(
        wsel.numel(), n, k, offsets.data_ptr<int64_t>(), wsel.data_ptr<int64_t>(), xs.data_ptr(),
        xs.stride(0), ws.data_ptr(), ws.stride(0), ws.stride(1), dtype_code(x.scalar_type()),
        out.data_ptr<float>(), out.stride(0), static_cast<int>(lanes), at::get_num_threads());
    TORCH_CHECK(rc == 0, "moe grouped GEMM kernel refused its arguments (code ", rc, ")");
    return out.to(x.scalar_type());
  }
  const int64_t* cut = offsets.data_ptr<int64_t>();
  const int64_t* sel = wsel.data_ptr<int64_t>();
  std::vector<at::Tensor> outs;
  for (int64_t g = 0; g < wsel.numel(); ++g) {
    if (cut[g + 1] > cut[g]) outs.push_back(gemm_rows(x.narrow(0, cut[g], cut[g + 1] - cut[g]), w.select(0, sel[g])));
  }
  if (outs.empty()) return at::empty({0, n}, x.options());
  return outs.size() == 1 ? outs[0] : at::cat(outs);
}

at::Tensor long_vector(const std::vector<int64_t>& values) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(values.begin(), values.end(), t.data_ptr<int64_t>());
  return t;
}

// moe.py `moe_experts` with a [T, H] x: [T, k, H] in x's dtype, a slot routed to no local
// expert -0.0.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& w13,
                       const at::Tensor& w2, bool grouped, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && topk_ids.dim() == 2, "moe: x ", x.sizes(), " and topk_ids ",
              topk_ids.sizes(), " (this operator takes one row per token)");
  const int64_t t = topk_ids.size(0), k = topk_ids.size(1);
  at::Tensor out = at::full({t, k, w2.size(1)}, -0.0, x.options());
  at::Tensor local = topk_ids.reshape({-1}).to(at::kLong);
  const int64_t n_local = w13.size(0);
  if (local.numel() == 0) return out;
  at::Tensor sel;
  if (local.max().item<int64_t>() >= n_local) {  // slots routed past this rank's experts
    local = local.sub(0);  // moe.py: local - first_expert (0 here)
    sel = at::nonzero(local.ge(0).logical_and(local.lt(n_local))).squeeze(-1);
    if (sel.numel() == 0) return out;
    sel = sel.index_select(0, at::argsort(local.index_select(0, sel), true, -1, false));
  } else {
    sel = at::argsort(local, true, -1, false);
  }
  const at::Tensor counts = at::bincount(local.index_select(0, sel), {}, n_local);
  at::Tensor offsets = at::zeros({n_local + 1}, at::TensorOptions().dtype(at::kLong));
  at::Tensor tail = offsets.narrow(0, 1, n_local);
  at::cumsum_out(tail, counts, 0);
  const at::Tensor wsel = at::arange(n_local, at::TensorOptions().dtype(at::kLong));
  const at::Tensor rows = x.index_select(0, sel.div(k, "floor"));
  const at::Tensor h = silu_mul(experts_gemm(rows, w13, offsets, wsel, grouped, lanes));
  const at::Tensor y = experts_gemm(h, w2, offsets, wsel, grouped, lanes);
  c10::List<c10::optional<at::Tensor>> index;
  index.push_back(sel);
  return at::index_put(out.reshape({t * k, -1}), index, y).view(out.sizes());
}

// moe.py `_whole`: x times one weight [N, K]^T as the experts' GEMM (one group).
at::Tensor whole(const at::Tensor& x, const at::Tensor& w, bool grouped, int64_t lanes) {
  return experts_gemm(x, w.unsqueeze(0), long_vector({0, x.size(0)}), long_vector({0}), grouped,
                      lanes);
}

// moe.py `moe_weighted_sum`: sum_j w_j * y_j over a token's experts in ascending expert id, in
// fp32, then + sigmoid(shared_gate) * shared_out, rounded once.
at::Tensor weighted_sum(const at::Tensor& expert_out, const at::Tensor& topk_weights,
                        const at::Tensor& topk_ids, const at::Tensor& shared_out,
                        const at::Tensor& shared_gate, at::ScalarType out_dtype) {
  const at::Tensor order = at::argsort(topk_ids, true, -1, false);
  const at::Tensor w = topk_weights.to(at::kFloat).gather(-1, order);
  const int64_t t = order.size(0), k = order.size(1);
  const at::Tensor rows = at::arange(t, order.options()).unsqueeze(1).mul(k).add(order);
  const at::Tensor flat = expert_out.reshape({t * k, -1});
  auto term = [&](int64_t j) {
    return at::mul(w.select(1, j).unsqueeze(1),
                   flat.index_select(0, rows.select(1, j)).to(at::kFloat));
  };
  at::Tensor acc = term(0);
  for (int64_t j = 1; j < k; ++j) acc = at::add(acc, term(j));
  if (shared_out.defined()) {
    at::Tensor sh = shared_out.to(at::kFloat);
    if (shared_gate.defined()) {
      sh = at::mul(pointwise([](const at::Tensor& a) { return at::sigmoid(a); },
                             shared_gate.to(at::kFloat)),
                   sh);
    }
    acc = at::add(acc, sh);
  }
  return acc.to(out_dtype);
}

at::Tensor moe_combine(const at::Tensor& x, const at::Tensor& topk_weights,
                       const at::Tensor& topk_ids, const at::Tensor& w13, const at::Tensor& w2,
                       const c10::optional<at::Tensor>& shared_w13,
                       const c10::optional<at::Tensor>& shared_w2,
                       const c10::optional<at::Tensor>& shared_gate_w, c10::string_view kind,
                       int64_t lanes) {
  const bool grouped = kind == kGrouped;
  TORCH_CHECK(grouped || kind == kBlocks, "moe_combine: expert GEMM '", kind,
              "' does not run here (", kGrouped, " or ", kBlocks, ")");
  const at::Tensor y = moe_experts(x, topk_ids, w13, w2, grouped, lanes);
  at::Tensor shared_out, shared_gate;
  if (shared_w13.has_value() && shared_w2.has_value()) {
    shared_out = whole(silu_mul(whole(x, *shared_w13, grouped, lanes)), *shared_w2, grouped, lanes);
    if (shared_gate_w.has_value()) shared_gate = whole(x, *shared_gate_w, grouped, lanes);
  }
  return weighted_sum(y, topk_weights, topk_ids, shared_out, shared_gate, x.scalar_type());
}

}  // namespace
}  // namespace isoexec_cpu

TORCH_LIBRARY_FRAGMENT(isoexec_cpu, m) {
  m.def(
      "moe_combine(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor w2, "
      "Tensor? shared_w13, Tensor? shared_w2, Tensor? shared_gate_w, str kind, int lanes) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(isoexec_cpu, CPU, m) { m.impl("moe_combine", TORCH_FN(isoexec_cpu::moe_combine)); }
