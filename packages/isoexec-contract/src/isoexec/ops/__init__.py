"""Canonical ops: the one implementation of every numerical op both sides call.

Every output row is computed by a reduction order that depends only on that row's own
inputs and its absolute position (see docs/ops.md). Each op describes itself with an
`ImplInfo` (id, version, backend, parameters, source fingerprint) for the contract:
`get_impl(op)` gives the canonical one, `get_impl(op, lanes=8)` a variant with other
parameters (a different contract), and `REGISTRY` maps op name -> canonical `ImplInfo`.
A GEMM op also records the library its GEMMs run (`gemm.gemm_library`) on the device and in
the dtype a site runs: `get_impl(op, device=..., dtype=...)`.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from types import MappingProxyType, ModuleType

import torch

from isoexec.contract.impl import ImplInfo, code_closure, source_fingerprint
from isoexec.contract.options import BACKENDS as OPTION_BACKENDS

from . import (
    _pointwise,
    activation,
    attention,
    cpu_kernels,
    gdn,
    gemm,
    logprobs,
    lora,
    moe,
    norm,
    penalties,
    rope,
    truncation,
)
from .activation import attn_output_gate, silu_mul
from .attention import attention_paged, attention_varlen, gather_paged_kv, paged_queries
from .gdn import gdn_conv, gdn_recurrence, gdn_recurrence_in_place, gdn_sequence
from .gemm import (
    linear,
    linear_tp_invariant,
    linear_tp_shard,
    tp_leaf_partials,
    tp_linear_from_shards,
    tp_tree_sum,
)
from .logprobs import (
    combine_leaf_stats,
    log_softmax,
    token_logprobs,
    token_logprobs_vocab_parallel,
    vocab_leaf_stats,
)
from .lora import (
    fold_scaling,
    lora_apply,
    lora_apply_by_slot,
    lora_delta,
    lora_expand_by_slot,
    pad_rank,
)
from .moe import moe_combine, moe_experts, moe_router, moe_weighted_sum
from .norm import gated_rms_norm, rms_norm
from .penalties import adjust_logits
from .rope import apply_rope, apply_rope_at, rope_cos_sin, rope_inv_freq
from .truncation import truncation_mask

BACKEND = "torch"

# op -> (impl_id, version, default params, functions whose source defines the bits)
_SPECS: dict[str, tuple[str, int, dict[str, object], tuple[Callable[..., object], ...]]] = {
    "linear": (
        "isoexec.linear.rowblock",
        2,
        {
            "block_rows": gemm.DEFAULT_BLOCK_ROWS,
            "accum": "fp32",
            "bias": "after-rounding",
        },
        (gemm.linear, gemm._block_gemm, gemm._packed_weight, gemm._BlockLinear),
    ),
    "linear_tp": (
        "isoexec.linear.tp_leaves",
        2,
        {"leaves": gemm.DEFAULT_TP_LEAVES, "block_rows": gemm.DEFAULT_BLOCK_ROWS},
        (
            gemm.tp_linear_from_shards,
            gemm.linear_tp_shard,
            gemm._tree_sum_round,
            gemm.tp_leaf_partials,
            gemm.tp_tree_sum,
            gemm._block_gemm,
        ),
    ),
    "lora": (
        "isoexec.lora.padded_rowblock",
        2,
        {
            "rank": 16,
            "block_rows": gemm.DEFAULT_BLOCK_ROWS,
            "scaling": "folded-into-b",
            "zero_b": "skipped",
            "add": "base-plus-delta",
        },
        (
            lora.lora_apply_by_slot,
            lora.lora_expand_by_slot,
            lora.lora_apply,
            lora.lora_delta,
            lora.fold_scaling,
            lora.pad_rank,
            gemm._block_gemm,
        ),
    ),
    "rms_norm": (
        "isoexec.rms_norm.fp32",
        2,
        {"accum": "fp32", "kernel": "cxx-vector-ext-nofma", "lanes": 16},
        (norm._normalize, norm.rms_norm),
    ),
    "gated_rms_norm": (
        "isoexec.gated_rms_norm.fp32",
        1,
        {"accum": "fp32"},
        (norm._normalize, norm.gated_rms_norm),
    ),
    "rope": (
        "isoexec.rope.neox_fp32",
        1,
        {"style": "neox", "table": "fp32"},
        (
            rope.rope_inv_freq,
            rope.rope_cos_sin,
            rope.rope_cos_sin_table,
            rope.apply_rope,
            rope.apply_rope_at,
        ),
    ),
    "silu_mul": ("isoexec.silu_mul.fp32", 1, {"accum": "fp32"}, (activation.silu_mul,)),
    "attention": (
        "isoexec.attention.rowserial",
        4,
        {
            "lanes": attention.DEFAULT_LANES,
            "kernel": "cxx-vector-ext-nofma",
            "softmax": "fp32-exact-rowmax",
            "exp": "cephes-deg6",
            "cache": "bs-hkv-d",
        },
        (
            attention.attention_varlen,
            attention.attention_paged,
            attention.gather_paged_kv,
            attention.paged_queries,
        ),
    ),
    "logprobs": (
        "isoexec.logprobs.fp32",
        1,
        {
            "temperature": "fp32-true-div",
            "mode": "processed_logprobs",
            "truncation": truncation.RULE,
            "adjust": penalties.RULE,
        },
        (
            logprobs._tempered,
            logprobs.log_softmax,
            logprobs.token_logprobs,
            truncation_mask,
            adjust_logits,
        ),
    ),
    "logprobs_vocab_parallel": (
        "isoexec.logprobs.vocab_leaves",
        1,
        {
            "leaves": logprobs.DEFAULT_VOCAB_LEAVES,
            "temperature": "fp32-true-div",
            "mode": "processed_logprobs",
        },
        (
            logprobs._tempered,
            logprobs.vocab_leaf_stats,
            logprobs.combine_leaf_stats,
            logprobs.token_logprobs_vocab_parallel,
        ),
    ),
    "moe_router": (
        "isoexec.moe_router.softmax_topk",
        2,
        {"softmax": "fp32", "ties": "lower-index"},
        (moe.moe_router,),
    ),
    "moe_combine": (
        "isoexec.moe_combine.ascending",
        6,
        {
            "order": "ascending-expert",
            "accum": "fp32",
            "lanes": moe.DEFAULT_LANES,
            "kernel": moe.GROUPED,
        },
        (moe.moe_weighted_sum, moe.moe_experts, moe.moe_combine),
    ),
    "gdn_conv": ("isoexec.gdn_conv.shifted_sum", 1, {"accum": "fp32"}, (gdn.gdn_conv,)),
    "gdn_recurrence": (
        "isoexec.gdn_recurrence.token_serial",
        2,
        {
            "state": "fp32",
            "l2_eps": gdn.L2_EPS,
            "lanes": gdn.LANES,
            "kernel": "cxx-vector-ext-nofma",
            "state_sum": "k-ordered",
            "exp": "cephes-deg6",
            "log": "cephes",
        },
        (gdn.gdn_recurrence,),
    ),
}

_COMMON = (_pointwise.padded_length, _pointwise.pointwise)

# Ops whose GEMMs are `gemm._block_gemm`, and the dtype those GEMMs run in (None: the site's
# dtype; the TP leaves are fp32 whatever the model's). Their "gemm" parameter is the library.
# The router's logits are `linear` in the model dtype on both sides, part of the router site.
GEMM_DTYPES: MappingProxyType[str, torch.dtype | None] = MappingProxyType(
    {"linear": None, "linear_tp": torch.float32, "moe_router": None}
)
# Ops whose algorithm depends on the site's device and dtype, and the parameters that say
# which runs there: `moe_combine`'s experts run the grouped kernel in fp32, AMX tiles in bf16
# on a CPU with AMX-BF16, else the linear's blocks (with its library) (`moe.impl_params`).
PLACEMENT_PARAMS: MappingProxyType[str, Callable[[torch.device | str, torch.dtype], dict]] = (
    MappingProxyType({"moe_combine": moe.impl_params})
)


def depends_on_placement(op: str) -> bool:
    """Whether `op`'s ImplInfo depends on where and in what dtype its site runs (a site must
    then pass its device and dtype to `get_impl`)."""
    return op in GEMM_DTYPES or op in PLACEMENT_PARAMS


# Ops that have no Triton twin: a site of the Triton backend running them is refused
# (`isoexec.vllm.lora.refused_lora_settings`), never recorded with the torch op's ImplInfo.
TORCH_ONLY = frozenset({"lora"})

# Registry entries that compute another entry's op by a different algorithm: the contract
# records the site's op ("linear") and tells the algorithms apart by impl_id, so a TP-invariant
# o_proj on one side and a plain one on the other is an impl mismatch at that site.
OP_OF_VARIANT: MappingProxyType[str, str] = MappingProxyType(
    {"linear_tp": "linear", "logprobs_vocab_parallel": "logprobs"}
)


def get_impl(
    op: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **params: object,
) -> ImplInfo:
    """ImplInfo of the canonical `op`; keyword overrides (e.g. lanes=8) describe a
    variant whose kernels were called with those parameters.

    `device`/`dtype`: where and in what the site runs. A GEMM op (`GEMM_DTYPES`) records
    `gemm.gemm_library` for them, so a side on another library never MATCHes; an op in
    `PLACEMENT_PARAMS` records which algorithm runs there; the other ops ignore them. The
    defaults (CPU, fp32) are what `REGISTRY` describes: a site passes its own.
    """
    if op not in _SPECS:
        raise KeyError(f"unknown op {op!r}; known: {sorted(_SPECS)}")
    impl_id, version, defaults, fns = _SPECS[op]
    unknown = set(params) - set(defaults)
    if unknown:
        raise KeyError(f"{op}: unknown parameters {sorted(unknown)}")
    merged = {**defaults, **params}
    if op in GEMM_DTYPES:
        merged["gemm"] = gemm.gemm_library(device, GEMM_DTYPES[op] or dtype)
    if op in PLACEMENT_PARAMS:
        merged.update(PLACEMENT_PARAMS[op](device, dtype))
    fp = _fingerprint(*fns)
    return ImplInfo.make(OP_OF_VARIANT.get(op, op), impl_id, version, BACKEND, merged, fp)


def _fingerprint(*entry_points: Callable[..., object]) -> str:
    """Source fingerprint of every ops module the entry points can execute (their modules and
    the ops modules those use, `code_closure`) and of the C++ sources of the compiled kernels
    those modules load (`KERNEL_LIBRARIES`): any edited helper changes it."""
    modules = code_closure(*entry_points, *_COMMON, package=__name__)
    fp = source_fingerprint(*modules)
    libs = sorted({lib for m in modules for lib in getattr(m, "KERNEL_LIBRARIES", ())})
    if not libs:
        return fp
    h = hashlib.sha256(fp.encode())
    for lib in libs:
        h.update(b"\0" + cpu_kernels.source_text(lib).encode())
    return h.hexdigest()[:32]


REGISTRY: MappingProxyType[str, ImplInfo] = MappingProxyType({op: get_impl(op) for op in _SPECS})

# Qwen3-Next's attention output gate. Not in `REGISTRY` (not every backend has it yet), and no
# site of its own: recorded by the attention modules of both sides beside their core site.
ATTN_OUTPUT_GATE_IMPL = ImplInfo.make(
    "attn_output_gate",
    "isoexec.attn_output_gate.sigmoid_mul",
    1,
    BACKEND,
    {"sigmoid": "pointwise-padded", "mul": "model-dtype"},
    _fingerprint(attn_output_gate),
)

# Backends of the same ops: same function names and signatures, different bits, so a site
# records which one it runs (`get_backend_impl`) and the contract tells them apart.
BACKENDS = OPTION_BACKENDS  # the options object validates against the same names


def backend_ops(backend: str = BACKEND) -> ModuleType:
    """The module whose functions (`linear`, `rms_norm`, ...) implement the ops on `backend`.

    "triton" imports `isoexec.ops.triton` lazily (it needs the triton package)."""
    if backend == BACKEND:
        return sys.modules[__name__]
    if backend == "triton":
        from . import triton as triton_ops

        return triton_ops
    raise KeyError(f"unknown backend {backend!r}; known: {list(BACKENDS)}")


def get_backend_impl(
    op: str,
    backend: str = BACKEND,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    **params: object,
) -> ImplInfo:
    """ImplInfo of `op` on `backend` (what a site running that backend's kernel records) on
    `device` in `dtype` (`get_impl`; Triton's GEMMs are its own kernels, under no library)."""
    if backend == BACKEND:
        return get_impl(op, device=device, dtype=dtype, **params)
    if backend == "triton":
        from .triton import get_triton_impl

        return get_triton_impl(op, **params)
    raise KeyError(f"unknown backend {backend!r}; known: {list(BACKENDS)}")


__all__ = [
    "ATTN_OUTPUT_GATE_IMPL",
    "BACKEND",
    "BACKENDS",
    "GEMM_DTYPES",
    "OP_OF_VARIANT",
    "PLACEMENT_PARAMS",
    "REGISTRY",
    "TORCH_ONLY",
    "adjust_logits",
    "apply_rope",
    "apply_rope_at",
    "attention_paged",
    "attention_varlen",
    "attn_output_gate",
    "backend_ops",
    "combine_leaf_stats",
    "depends_on_placement",
    "fold_scaling",
    "gated_rms_norm",
    "gather_paged_kv",
    "gdn_conv",
    "gdn_recurrence",
    "gdn_recurrence_in_place",
    "gdn_sequence",
    "get_backend_impl",
    "get_impl",
    "linear",
    "linear_tp_invariant",
    "linear_tp_shard",
    "log_softmax",
    "lora_apply",
    "lora_apply_by_slot",
    "lora_delta",
    "lora_expand_by_slot",
    "moe_combine",
    "moe_experts",
    "moe_router",
    "moe_weighted_sum",
    "pad_rank",
    "paged_queries",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "silu_mul",
    "token_logprobs",
    "token_logprobs_vocab_parallel",
    "tp_leaf_partials",
    "tp_linear_from_shards",
    "tp_tree_sum",
    "truncation_mask",
    "vocab_leaf_stats",
]
