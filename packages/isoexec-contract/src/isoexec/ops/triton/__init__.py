"""Triton backend of the canonical ops: same invariance structure, GPU kernels.

Every op here has the signature of its torch canonical twin (`isoexec.ops`) and
the same invariance structure — fixed tiles, no split-K, no atomics, fixed reduction
trees, one program per row/tile — but not the same bits: the reduction trees differ. So
it is a separate backend of the same op, with its own impl ids and `backend="triton"`, and
a trainer on Triton and an engine on torch get different contracts (the handshake refuses
them). `get_triton_impl(op)` is the `ImplInfo` a site records when it runs these kernels.

Kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1 set before triton is imported), which proves structure, not GPU bits.
Backward passes go through the torch canonical op (correct, not bitwise), the TP leaves'
included.
"""

from __future__ import annotations

from types import MappingProxyType, ModuleType

from isoexec.contract.impl import ImplInfo, code_closure, source_fingerprint

from .. import _pointwise as _torch_pointwise
from .. import gemm as _torch_gemm
from .. import logprobs as _torch_logprobs
from .. import penalties as _torch_penalties
from .. import rope as _torch_rope
from .. import truncation as _torch_truncation
from . import _runtime, attention, elementwise, gdn, gemm, logprobs, moe, moe_grouped, norm
from .attention import attention_paged, attention_varlen, gather_paged_kv
from .elementwise import apply_rope, rope_cos_sin, rope_inv_freq, silu_mul
from .gdn import gdn_conv, gdn_recurrence
from .gemm import (
    linear,
    linear_tp_invariant,
    linear_tp_shard,
    tp_leaf_partials,
    tp_linear_from_shards,
)
from .logprobs import (
    combine_leaf_stats,
    log_softmax,
    token_logprobs,
    token_logprobs_vocab_parallel,
    vocab_leaf_stats,
)
from .moe import moe_combine, moe_experts, moe_router, moe_weighted_sum
from .norm import gated_rms_norm, rms_norm

# Truncation is a sort and a running sum over the kept prefix: the torch op on every backend.
truncation_mask = _torch_truncation.truncation_mask
adjust_logits = _torch_penalties.adjust_logits

BACKEND = "triton"

_GEMM = {
    "block_m": gemm.BLOCK_M,
    "block_n": gemm.BLOCK_N,
    "block_k": gemm.BLOCK_K,
    "split_k": 1,
    "accum": "fp32",
    "dot": "fp32-upcast",
}

# op -> (impl_id, version, default params, modules whose source defines the bits)
_SPECS: dict[str, tuple[str, int, dict[str, object], tuple[ModuleType, ...]]] = {
    "linear": ("isoexec.linear.triton_tiles", 1, {**_GEMM, "bias": "after-rounding"}, (gemm,)),
    "linear_tp": (
        "isoexec.linear.triton_tp_leaves",
        1,
        {**_GEMM, "leaves": gemm.DEFAULT_TP_LEAVES, "tree": "fixed-binary"},
        (gemm, _torch_gemm),
    ),
    "rms_norm": (
        "isoexec.rms_norm.triton_row",
        1,
        {"accum": "fp32", "rsqrt": "div_rn-sqrt_rn"},
        (norm,),
    ),
    "gated_rms_norm": (
        "isoexec.gated_rms_norm.triton_row",
        1,
        {"accum": "fp32", "rsqrt": "div_rn-sqrt_rn"},
        (norm,),
    ),
    "rope": (
        "isoexec.rope.triton_neox",
        1,
        {"style": "neox", "table": "torch-fp32"},
        (elementwise, _torch_rope, _torch_pointwise),
    ),
    "silu_mul": (
        "isoexec.silu_mul.triton_fp32",
        1,
        {"accum": "fp32", "block": elementwise.SILU_BLOCK},
        (elementwise,),
    ),
    "attention": (
        "isoexec.attention.triton_kvtile",
        1,
        {
            "kv_tile": attention.DEFAULT_KV_TILE,
            "softmax": "fp32-online",
            "program": "query-head",
            "cache": "bs-hkv-d",
        },
        (attention,),
    ),
    "logprobs": (
        "isoexec.logprobs.triton_vocab_tiles",
        1,
        {
            "vocab_tile": logprobs.VOCAB_TILE,
            "temperature": "fp32-div_rn",
            "mode": "processed_logprobs",
            "truncation": _torch_truncation.RULE,
            "adjust": _torch_penalties.RULE,
        },
        (logprobs, _torch_truncation, _torch_penalties, _torch_pointwise),
    ),
    "logprobs_vocab_parallel": (
        "isoexec.logprobs.triton_vocab_leaves",
        1,
        {
            "leaves": logprobs.DEFAULT_VOCAB_LEAVES,
            "vocab_tile": logprobs.VOCAB_TILE,
            "temperature": "fp32-div_rn",
            "mode": "processed_logprobs",
        },
        (logprobs, _torch_logprobs, _torch_pointwise),
    ),
    "moe_router": (
        "isoexec.moe_router.triton_softmax_topk",
        1,
        {"softmax": "fp32", "ties": "lower-index"},
        (moe,),
    ),
    "moe_combine": (
        "isoexec.moe_combine.triton_ascending",
        1,
        {"order": "ascending-expert", "accum": "fp32", "block": moe.COMBINE_BLOCK, **_GEMM},
        (moe, moe_grouped, gemm, elementwise),
    ),
    "gdn_conv": (
        "isoexec.gdn_conv.triton_shifted_sum",
        1,
        {"accum": "fp32", "block": gdn.CONV_BLOCK},
        (gdn,),
    ),
    "gdn_recurrence": (
        "isoexec.gdn_recurrence.triton_token_serial",
        1,
        {"state": "fp32", "l2_eps": gdn.L2_EPS, "block_v": gdn.BLOCK_V},
        (gdn,),
    ),
}


def get_triton_impl(op: str, **params: object) -> ImplInfo:
    """ImplInfo of the Triton `op`; keyword overrides (e.g. block_k=64) describe a variant
    whose kernels were called with those parameters (a different contract)."""
    if op not in _SPECS:
        raise KeyError(f"unknown op {op!r}; known: {sorted(_SPECS)}")
    impl_id, version, defaults, modules = _SPECS[op]
    unknown = set(params) - set(defaults)
    if unknown:
        raise KeyError(f"{op}: unknown parameters {sorted(unknown)}")
    merged = {**defaults, **params}
    # Every ops module these kernels' modules use (the torch helpers some call included).
    fp = source_fingerprint(*code_closure(*modules, _runtime, package="isoexec.ops"))
    from isoexec.ops import OP_OF_VARIANT

    return ImplInfo.make(OP_OF_VARIANT.get(op, op), impl_id, version, BACKEND, merged, fp)


TRITON_REGISTRY: MappingProxyType[str, ImplInfo] = MappingProxyType(
    {op: get_triton_impl(op) for op in _SPECS}
)

__all__ = [
    "BACKEND",
    "TRITON_REGISTRY",
    "adjust_logits",
    "apply_rope",
    "attention_paged",
    "attention_varlen",
    "combine_leaf_stats",
    "gated_rms_norm",
    "gather_paged_kv",
    "gdn_conv",
    "gdn_recurrence",
    "get_triton_impl",
    "linear",
    "linear_tp_invariant",
    "linear_tp_shard",
    "log_softmax",
    "moe_combine",
    "moe_experts",
    "moe_router",
    "moe_weighted_sum",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "silu_mul",
    "token_logprobs",
    "token_logprobs_vocab_parallel",
    "tp_leaf_partials",
    "tp_linear_from_shards",
    "truncation_mask",
    "vocab_leaf_stats",
]
