// `torch.ops.isoexec_cpu.paged_attention`: the CPU engine's attention step in C++, i.e.
// isoexec.vllm `paged_forward` (per step, output in the query's dtype) = `cache_views`, then
// attention.py `paged_queries` and `attention_paged` into vLLM's output rows.
//
// Why: at a small decode step the kernel takes about 25 us and the Python around it (views,
// the step's query positions, checks, ctypes) as much again and more in an engine (#37's
// profile: 100 us a layer against native's 35). The query positions are integers computed the
// Python op's way, the kernel is the same entry point with the same arguments, so the bits are
// the same (tests/ops/test_torch_ops_attention.py).

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "torch_ops.h"

extern "C" int isx_attention_fwd(int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t Dv,
                                 const void* q, int q_dtype, int64_t q_st, int64_t q_sh,
                                 const void* k, const void* v, int kv_dtype, int64_t k_sb,
                                 int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss,
                                 int64_t v_sh, int64_t block_size, const int32_t* block_table,
                                 int64_t bt_stride, const int64_t* key_start, const int64_t* q_req,
                                 const int64_t* q_pos, float scale, float* out, int lanes,
                                 int threads);

namespace isoexec_cpu {
namespace {

void check_operand(const char* name, const at::Tensor& t, int64_t ndim) {
  check_cpu_kernel_dtype("attention", name, t);
  TORCH_CHECK(t.dim() == ndim && t.stride(-1) == 1, "attention: ", name, " must be ", ndim,
              "-d with a contiguous last dim");
}

void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, int64_t num_tokens, double scale,
                     int64_t lanes, at::Tensor& output) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "attention: lanes=", lanes, " unsupported; the kernel has (8, 16)");
  TORCH_CHECK(kv_cache.dim() == 4, "attention: kv_cache ", kv_cache.sizes(),
              " is not [blocks, kv_heads, block_size, 2 * head_dim]");
  // paged_attention.py `cache_views`: K and V [blocks, block_size, kv_heads, head_dim]
  const int64_t half = kv_cache.size(-1) / 2;
  const at::Tensor kv = kv_cache.transpose(1, 2);
  const at::Tensor k = kv.narrow(-1, 0, half), v = kv.narrow(-1, half, kv.size(-1) - half);
  const int64_t n = num_tokens, h = query.size(1), dv = v.size(-1);
  const at::Tensor q = query.narrow(0, 0, n);
  at::Tensor out = output.narrow(0, 0, n).view({n, h, dv});
  // attention.py `paged_queries`: request r owns queries qsl[r]:qsl[r+1] at positions
  // seq_len - q_len + i
  const at::Tensor qsl = query_start_loc.to(at::kLong).contiguous();
  const int64_t nreq = qsl.numel() - 1;
  const int64_t* cut = qsl.data_ptr<int64_t>();
  const int64_t nq = nreq > 0 ? cut[nreq] : 0;
  if (nq < n) out.narrow(0, nq, n - nq).zero_();
  if (nq == 0) return;
  const at::Tensor lens = seq_lens.narrow(0, 0, nreq).to(at::kLong).contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  at::Tensor q_req = at::empty({nq}, qsl.options()), q_pos = at::empty({nq}, qsl.options());
  int64_t* req = q_req.data_ptr<int64_t>();
  int64_t* pos = q_pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < nreq; ++r) {
    TORCH_CHECK(cut[r] <= cut[r + 1] && cut[r + 1] <= nq, "attention: query_start_loc is not ascending");
    for (int64_t i = cut[r]; i < cut[r + 1]; ++i) {
      req[i] = r;
      pos[i] = len[r] - (cut[r + 1] - cut[r]) + (i - cut[r]);
    }
  }
  const at::Tensor bt = block_table.narrow(0, 0, nreq).to(at::kInt).contiguous();
  // attention.py `attention_paged` -> `_run`: fp32 rows straight into a contiguous fp32 out
  const at::Tensor qs = q.narrow(0, 0, nq);
  check_operand("q", qs, 3);
  check_operand("k", k, 4);
  check_operand("v", v, 4);
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "attention: k is ", k.scalar_type(), ", v is ",
              v.scalar_type());
  const int64_t d = qs.size(2), hkv = k.size(2);
  TORCH_CHECK(h % hkv == 0 && k.size(3) == d && v.sizes().slice(0, 3) == k.sizes().slice(0, 3),
              "attention: q ", qs.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  const bool direct = qs.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                      out.is_contiguous();
  at::Tensor rows = direct ? out.narrow(0, 0, nq)
                           : at::empty({nq, h, dv}, qs.options().dtype(at::kFloat));
  const int rc = isx_attention_fwd(
      nq, h, hkv, d, dv, qs.data_ptr(), dtype_code(qs.scalar_type()), qs.stride(0), qs.stride(1),
      k.data_ptr(), v.data_ptr(), dtype_code(k.scalar_type()), k.stride(0), k.stride(1),
      k.stride(2), v.stride(0), v.stride(1), v.stride(2), k.size(1), bt.data_ptr<int32_t>(),
      bt.stride(0), nullptr, req, pos, static_cast<float>(scale), rows.data_ptr<float>(),
      static_cast<int>(lanes), at::get_num_threads());
  TORCH_CHECK(rc == 0, "attention kernel refused its arguments (code ", rc, ")");
  if (!direct) out.narrow(0, 0, nq).copy_(rows.to(qs.scalar_type()));
}

}  // namespace
}  // namespace isoexec_cpu

TORCH_LIBRARY_FRAGMENT(isoexec_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, int num_tokens, float scale, int lanes, Tensor(a!) output) -> ()");
}

TORCH_LIBRARY_IMPL(isoexec_cpu, CPU, m) {
  m.impl("paged_attention", TORCH_FN(isoexec_cpu::paged_attention));
}
