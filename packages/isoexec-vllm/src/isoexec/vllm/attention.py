"""The CPU attention backend with the canonical paged attention.

Registered over vLLM's `CPU_ATTN` with `register_backend`. The KV cache keeps vLLM's tensor
shape `[num_blocks, kv_heads, block_size, 2 * head_dim]` but this backend owns what is inside:
row (block, head, slot) holds `K[tok] | V[tok]` verbatim. Both the write
(`do_kv_cache_update`) and the read are ours, so the layout cannot drift with the CPU ISA
vLLM would pick (its `vec`/`amx` layouts differ), the dtype or the vLLM version.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch

from isoexec.contract.impl import ImplInfo
from isoexec.ops import cpu_kernels
from isoexec.ops.attention import DEFAULT_LANES
from isoexec.ops.binding import bind
from isoexec.ops.call_verify import note_call, verify_calls_enabled
from isoexec.ops.capture_guard import capture_guard_enabled
from isoexec.vllm.engine_binding import engine_binding
from isoexec.vllm.layers import UnsupportedSiteError
from isoexec.vllm.paged_attention import paged_forward
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


def write_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value `[T, kv_heads, head_dim]` at `slot = block * block_size + offset`
    (a slot of -1: a padded token, not stored). A byte copy (`cpu_kernels/kvcache.cpp`) where
    the dtypes agree and every row is contiguous; else the torch write, which converts."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    t = slot_mapping.shape[0]
    k, v = key[:t], value[:t]
    if (
        key.dtype == value.dtype == kv_cache.dtype
        and k.dim() == 3 and k.shape[0] == v.shape[0] == t  # the copy reads t rows of each
        and k.stride(-1) == v.stride(-1) == kv_cache.stride(-1) == 1
        and tuple(k.shape[1:]) == tuple(v.shape[1:]) == (h, d)
    ):  # fmt: skip
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        slots = slots.contiguous()
        rc = _kv_write()(
            t, h, d, key.element_size(), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), slots.data_ptr(), kv_cache.data_ptr(),
            nb, bs, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"KV cache write refused (code {rc}): a slot past the cache?")
        return
    kv = kv_cache.view(nb, h, bs, 2, d)
    slots = slot_mapping.long()
    valid = slots >= 0  # padded tokens carry slot -1
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[:t][valid], value[:t][valid]
    blk, off = slots // bs, slots % bs
    kv[blk, :, off, 0] = key[: slots.shape[0]].to(kv.dtype)
    kv[blk, :, off, 1] = value[: slots.shape[0]].to(kv.dtype)


@cache
def _kv_write() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = cpu_kernels.library("kvcache").isx_kv_write
    fn.restype = ctypes.c_int
    fn.argtypes = [cpu_kernels.I64] * 4 + [cpu_kernels.PTR, cpu_kernels.I64, cpu_kernels.I64,
                   cpu_kernels.PTR, cpu_kernels.I64, cpu_kernels.I64, cpu_kernels.PTR,
                   cpu_kernels.PTR] + [cpu_kernels.I64] * 5  # fmt: skip
    return fn


class IsoCPUAttentionImpl(CPUAttentionBackendImpl):
    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._binding = engine_binding("attention")
        bind(self, self._binding)
        # Query positions once per step where the bound backend offers them (the torch ops';
        # the Triton twin, run here under its interpreter, computes its own per call).
        self.per_step = hasattr(self.ops, "paged_queries")
        # the torch backend on a CPU engine runs the step as one C++ operator (the provider
        # says: `CompiledOps.native_cpu`)
        self.native = bool(getattr(self._binding.provider, "native_cpu", False))
        problems = []
        if self.attn_type != AttentionType.DECODER:
            problems.append(f"attention type {self.attn_type}")
        if self.alibi_slopes is not None:
            problems.append("ALiBi")
        if self.sliding_window != -1:
            problems.append("sliding window")
        if self.logits_soft_cap:
            problems.append("logits soft cap")
        if self.sinks is not None:
            problems.append("attention sinks")
        if self.is_fp8_kv_cache:
            problems.append("fp8 KV cache")
        if problems:
            raise UnsupportedSiteError(
                "canonical attention does not support: " + ", ".join(problems)
            )

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_cache(kv_cache, key, value, slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedSiteError("fused output quantization is not canonical")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        if not attn_metadata.causal or attn_metadata.dynamic_causal is not None:
            raise UnsupportedSiteError("canonical attention is causal decoder attention only")
        if self.native and query.dtype == output.dtype and not capture_guard_enabled():
            # the same step in C++ (`ops.cpu_torch_ops`: the same positions and kernel)
            md = attn_metadata
            if verify_calls_enabled():  # it stands in for the binding's `attention_paged`
                note_call(self._binding, "attention_paged")
            torch.ops.isoexec_cpu.paged_attention(
                query, kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                md.num_actual_tokens, self.scale, DEFAULT_LANES, output,
            )  # fmt: skip
            return output
        return paged_forward(
            self.ops, query, kv_cache, attn_metadata, output, self.scale, per_step=self.per_step
        )


class IsoCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[IsoCPUAttentionImpl]:
        return IsoCPUAttentionImpl


def register_attention() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.{IsoCPUAttentionBackend.__name__}")
