"""The hottest canonical CPU ops as C++-registered torch operators: `torch.ops.isoexec_cpu`.

Why: an engine's decode step at a small size is some 46 op calls, and through Python each
costs a custom-op dispatch, the op's Python and ctypes, 10-20 us on these CPUs against about
1 us for an operator registered in C++ (#37's profile). `cpu_kernels/torch_ops.cpp` wraps the
very kernels the Python ops call, with the same arguments, so the bits are the same
(tests/ops/test_torch_ops.py); it adds data movement only, so it is not part of any op's
fingerprint.

- `rms_norm(x, weight, eps, zero_centered)` and `rms_norm_residual(..., residual)`: `norm.
  rms_norm` on CPU.
- `silu_mul(x)`: `activation.silu_mul`, the same aten calls in C++ (its silu is ATen's,
  padded as `_pointwise` pads it).
- `rope(positions, x, head_size, rotary_dim, base)`: `rope.apply_rope_at` on CPU: the kernel
  reads each token's row of a cos/sin table by its position. The table is built in C++ by
  `rope_cos_sin`'s aten calls, with `_table`'s sizes and growth (rows depend only on their
  position, so any table gives the same bits).
- `moe_combine(x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2, shared_gate_w, kind,
  lanes)`: `moe.moe_combine` without gradient for a [T, H] x, the same aten calls and kernels
  in C++ (`cpu_kernels/torch_ops_moe.cpp`), for the expert GEMMs in `MOE_KINDS`.
- `paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, num_tokens, scale,
  lanes, output)`: the CPU engine's attention step (isoexec.vllm `paged_forward` with the
  output in the query's dtype) into `output` (`cpu_kernels/torch_ops_attention.cpp`).
- `linear(x, weight, bias)`: `gemm.linear` on CPU for fp32/bf16/fp16 without gradient. Its
  packed weights live in a C++ cache with the Python cache's rules, enabled and cleared by
  `gemm.enable_packed_weight_cache` and `gemm.clear_packed_weight_cache` (one protocol).

The library is built from source on first use, against the running torch (a few seconds),
and cached per machine, as the other CPU kernels are. The engine calls these ops inside
vLLM's compiled graph (`isoexec.vllm.compiled_ops`); the fake implementations below give
torch.compile their shapes.
"""

from __future__ import annotations

from functools import cache

import torch

from . import cpu_kernels, gemm, moe

NAMESPACE = "isoexec_cpu"
# The expert GEMMs `moe_combine` runs (`moe.expert_gemm`); AMX experts stay in Python.
MOE_KINDS = (moe.GROUPED, moe.LINEAR_BLOCKS)


@cache
def load() -> None:
    """Build (once per machine) and load the operators; register their shapes for tracing."""
    cpu_kernels.torch_op_library()

    @torch.library.register_fake(f"{NAMESPACE}::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(f"{NAMESPACE}::rms_norm_residual")
    def _(
        x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, r: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake(f"{NAMESPACE}::linear")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake(f"{NAMESPACE}::silu_mul")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.register_fake(f"{NAMESPACE}::rope")
    def _(p: torch.Tensor, x: torch.Tensor, head: int, rot: int, base: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(f"{NAMESPACE}::moe_combine")
    def _(x: torch.Tensor, *rest: object) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(f"{NAMESPACE}::paged_attention")
    def _(*args: object) -> None:
        return None

    native = torch.ops.isoexec_cpu
    gemm.attach_native_pack_cache(native.set_pack_cache, native.clear_pack_cache)


def runs_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes these operands (else the Python op, which refuses or serves
    them): CPU, one kernel dtype for both."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in cpu_kernels.DTYPE_CODES
    )


def pack_cache_size() -> int:
    """Entries in the C++ linear's packed-weight cache (tests: the protocol reaches it)."""
    return int(torch.ops.isoexec_cpu.pack_cache_size())


__all__ = ["MOE_KINDS", "NAMESPACE", "load", "pack_cache_size", "runs_linear"]
