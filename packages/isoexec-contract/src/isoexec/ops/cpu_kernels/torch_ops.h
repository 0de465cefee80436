// Shared by the C++-registered operators' sources (`torch_ops.cpp`, `torch_ops_moe.cpp`): the
// kernels' dtype codes, `_pointwise`'s padding, and the pieces the MoE operator reuses.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>

#include <algorithm>
#include <cstdint>

namespace isoexec_cpu {

constexpr int64_t kPanel = 32;  // columns per packed panel (gemm.cpp's NB, cpu_gemm.PANEL)

// simd.h's DType codes (cpu_kernels.DTYPE_CODES); -1: a dtype no kernel takes.
inline int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

inline void check_cpu_kernel_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && dtype_code(t.scalar_type()) >= 0, op, ": ", name, " is ",
              t.scalar_type(), " on ", t.device(), " (CPU: fp32/bf16/fp16)");
}


// _pointwise.py `padded_length`: the smallest length >= n whose ATen thread chunks are all
// multiples of 64 elements, so every element takes ATen's vectorised path.
inline int64_t padded_length(int64_t n, int64_t threads) {
  constexpr int64_t kPad = 64, kGrain = 32768;  // PAD_MULTIPLE, at::internal::GRAIN_SIZE
  int64_t p = std::max(kPad, (n + kPad - 1) / kPad * kPad);
  for (;;) {
    const int64_t t = p < kGrain ? 1 : std::max<int64_t>(1, std::min(threads, (p + kGrain - 1) / kGrain));
    const int64_t q = (p + kPad * t - 1) / (kPad * t) * (kPad * t);
    if (q == p) return p;
    p = q;
  }
}

// _pointwise.py `pointwise(fn, t)`: fn on t flattened and zero-padded to `padded_length`.
template <class F> at::Tensor pointwise(F fn, const at::Tensor& t) {
  const int64_t n = t.numel();
  at::Tensor flat = t.reshape({-1});
  const int64_t p = padded_length(n, at::get_num_threads());
  flat = p != n ? at::constant_pad_nd(flat, {0, p - n}, 0) : flat.contiguous();
  return fn(flat).narrow(0, 0, n).reshape(t.sizes());
}


at::Tensor silu_mul(const at::Tensor& x);
at::Tensor gemm_rows(const at::Tensor& x_rows, const at::Tensor& weight);

}  // namespace isoexec_cpu
