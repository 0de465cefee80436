"""The CUDA attention backend with the canonical paged attention.

Why: on CUDA vLLM picks FLASH_ATTN, FLASHINFER or TRITON_ATTN, whose kernels are not the
trainer's; the attention site would read back `native:` and the handshake would refuse the
engine. `IsoTritonAttentionBackend` is vLLM's Triton backend (its metadata builder, its KV
cache shape and spec) with IsoExec's impl: the impl writes the step's keys and values into the
cache and calls the engine backend's canonical `attention_paged`, recording that op's
`ImplInfo` (`…triton_kvtile` on the Triton backend), so a Triton trainer MATCHes.

Registration (`register_cuda_attention`, with the other overrides when `ISOEXEC=1`): the class
is `AttentionBackendEnum.CUSTOM` (so `attention_config.backend="CUSTOM"` selects it), and it
also overrides every backend vLLM's CUDA platform picks for decoder attention on its own or by
name (`CUDA_AUTO_BACKENDS`). An IsoExec engine on CUDA therefore never runs FLASH_ATTN's or
TRITON_ATTN's own kernel: whatever vLLM selects resolves to this class, and a configuration it
refuses (sliding window, sinks, fp8 KV cache, ...) fails vLLM's selection at model
construction ("not valid for this configuration") instead of falling back. The CPU platform
ignores these names (it always resolves `CPU_ATTN`, replaced in `attention.py`).

The cache keeps vLLM's Triton layout: logical `[num_blocks, kv_heads, block_size, 2 * D]`, row
(block, head, slot) = `K | V`, with whatever physical strides vLLM's KV-cache layout gives it.
Both the write (a copy kernel here, `write_cache`) and the read (`attention_paged`) go through
the same strided views `[num_blocks, block_size, kv_heads, D]` (`cache_views`), so nothing is
copied per layer call and the read sees exactly what was written.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from isoexec.contract.impl import ImplInfo
from isoexec.ops.binding import bind
from isoexec.ops.triton._runtime import check_device, pow2
from isoexec.vllm.engine_binding import engine_binding
from isoexec.vllm.layers import UnsupportedSiteError
from isoexec.vllm.paged_attention import cache_views, paged_forward
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

# The backends vLLM 0.32's CUDA platform may pick for (non-MLA) decoder attention
# (`vllm.platforms.cuda._get_backend_priorities`); each is overridden with this class.
CUDA_AUTO_BACKENDS = (
    "FLASH_ATTN",
    "FLASHINFER",
    "TRITON_ATTN",
    "FLEX_ATTENTION",
    "TURBOQUANT",
    "TRITON_FLASH_ATTN",
    "TRITON_FLASHINFER",
)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    KEY_T,
    KEY_H,
    VAL_T,
    VAL_H,
    KC_BLOCK,
    KC_SLOT,
    KC_HEAD,
    VC_BLOCK,
    VC_SLOT,
    VC_HEAD,
    D,
    DV,
    PAGE,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program per (token, kv head): copy its key and value row to the token's slot;
    padded tokens (slot < 0) write nothing."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // PAGE
        off = slot % PAGE
        d = tl.arange(0, BLOCK_D)
        k = tl.load(key_ptr + t * KEY_T + h * KEY_H + d, mask=d < D)
        tl.store(k_cache_ptr + blk * KC_BLOCK + off * KC_SLOT + h * KC_HEAD + d, k, mask=d < D)
        dv = tl.arange(0, BLOCK_DV)
        v = tl.load(value_ptr + t * VAL_T + h * VAL_H + dv, mask=dv < DV)
        tl.store(v_cache_ptr + blk * VC_BLOCK + off * VC_SLOT + h * VC_HEAD + dv, v, mask=dv < DV)


def write_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value `[T, kv_heads, D]` at `slot = block * block_size + offset` of the views
    `[num_blocks, block_size, kv_heads, D]`, in place. A plain copy (the cache holds the
    step's keys bit for bit); no host sync, so it may be captured in a CUDA graph."""
    check_device(key)
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise UnsupportedSiteError(
            f"KV cache dtype {k_cache.dtype} differs from the keys' {key.dtype}: a converting "
            "cache write is not canonical"
        )
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the head dim must be contiguous"
    t, hkv = slot_mapping.shape[0], key.shape[1]
    if t == 0:
        return
    d, dv = key.shape[2], value.shape[2]
    _write_kv_kernel[(t, hkv)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        d,
        dv,
        k_cache.shape[1],
        BLOCK_D=pow2(d),
        BLOCK_DV=pow2(dv),
    )


class IsoTritonAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    """vLLM's Triton metadata, without full CUDA graphs: `attention_paged` derives each
    token's request and position from `query_start_loc` for exactly the step's tokens, which
    a graph captured at a padded batch would replay wrongly. vLLM then runs attention eagerly
    between piecewise graphs (the cache write, sync-free, may stay captured)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER


class IsoTritonAttentionImpl(TritonAttentionImpl):
    """Writes the cache and runs the canonical paged attention; refuses, at construction,
    every feature the canonical op does not express (never a silent fallback)."""

    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        bind(self, engine_binding("attention"))
        problems = []
        if self.attn_type != AttentionType.DECODER:
            problems.append(f"attention type {self.attn_type}")
        if self.alibi_slopes is not None or self.use_alibi_sqrt:
            problems.append("ALiBi")
        if tuple(self.sliding_window) != (-1, -1):
            problems.append("sliding window")
        if self.logits_soft_cap:
            problems.append("logits soft cap")
        if self.sinks is not None:
            problems.append("attention sinks")
        if is_quantized_kv_cache(self.kv_cache_dtype) or self._is_per_token_head_quant:
            problems.append(f"quantized KV cache ({self.kv_cache_dtype})")
        if self.chunk_lookback != -1:
            problems.append("chunked attention with lookback")
        if problems:
            raise UnsupportedSiteError(
                "canonical attention does not support: " + ", ".join(problems)
            )

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        return False  # the canonical output is unquantized; vLLM must not fuse a quant in

    def fused_rope_kvcache_supported(self) -> bool:
        return False  # RoPE is its own canonical site; the cache write is ours

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        k_cache, v_cache = cache_views(kv_cache)
        write_cache(k_cache, v_cache, key, value, slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedSiteError("fused output quantization is not canonical")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        if attn_metadata.causal is not True:  # False, or a per-request tensor
            raise UnsupportedSiteError("canonical attention is causal decoder attention only")
        if attn_metadata.mm_prefix_range_tensor is not None:
            raise UnsupportedSiteError("multimodal prefix (bidirectional) ranges are not canonical")
        if attn_metadata.rswa_prefix_lens is not None:
            raise UnsupportedSiteError("R-SWA is not canonical")
        return paged_forward(self.ops, query, kv_cache, attn_metadata, output, self.scale)


class IsoTritonAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton backend (metadata, cache shape) narrowed to what the canonical op
    expresses, so vLLM's own selection refuses the rest with its reason."""

    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM maps the name back to the enum member (`Attention.backend`)

    @staticmethod
    def get_impl_cls() -> type[IsoTritonAttentionImpl]:
        return IsoTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[IsoTritonAttentionMetadataBuilder]:
        return IsoTritonAttentionMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        return spec  # no per-token-head quantized packing (refused)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False


BACKEND_PATH = f"{__name__}.{IsoTritonAttentionBackend.__name__}"


def register_cuda_attention() -> None:
    """Make `CUSTOM` and every CUDA decoder backend vLLM may pick resolve to this class."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    for name in CUDA_AUTO_BACKENDS:
        register_backend(AttentionBackendEnum[name], BACKEND_PATH)


__all__ = [
    "BACKEND_PATH",
    "CUDA_AUTO_BACKENDS",
    "IsoTritonAttentionBackend",
    "IsoTritonAttentionImpl",
    "IsoTritonAttentionMetadataBuilder",
    "register_cuda_attention",
    "write_cache",
]
