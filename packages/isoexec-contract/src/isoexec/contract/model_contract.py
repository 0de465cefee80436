"""The contract of a model, built the same way on both sides.

Trainer and engine each read back their live model's sites; everything else in the contract
(model identity, dtypes, backend) comes from here, so the two sides can only differ where
they really differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from isoexec.contract.architectures import text_config
from isoexec.contract.contract import (
    Contract,
    DeviceIdentity,
    Dtypes,
    ModelIdentity,
    build_contract,
    config_digest,
)
from isoexec.contract.impl import ImplInfo
from isoexec.contract.parallel_layout import declared_layout
from isoexec.contract.sites import architecture, layer_kinds, model_sites, num_experts
from isoexec.contract.speculation import declared_speculation

# HF config fields that change the bits of a forward pass (names, paths and ids do not).
NUMERIC_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "partial_rotary_factor",
    "attention_bias",
    "tie_word_embeddings",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "layer_types",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)

LOGPROBS_DTYPE = "float32"
RECURRENT_STATE_DTYPE = "float32"


def model_identity(hf_config: Mapping[str, Any]) -> ModelIdentity:
    """Architecture, digest of the text model's numeric fields, layer kinds. A vision-language
    checkpoint is identified by its text model (`architectures.text_config`): IsoExec runs
    nothing else of it."""
    text = text_config(hf_config)
    fields = {k: text[k] for k in NUMERIC_CONFIG_FIELDS if text.get(k) is not None}
    return ModelIdentity(
        architecture=architecture(hf_config),
        config_digest=config_digest(fields),
        layer_kinds=tuple(layer_kinds(hf_config)),
    )


def model_dtypes(hf_config: Mapping[str, Any], dtype: str) -> Dtypes:
    kinds = set(layer_kinds(hf_config))
    return Dtypes(
        params=dtype,
        activations=dtype,
        residual=dtype,
        kv_cache=dtype if "attention" in kinds else None,
        recurrent_state=RECURRENT_STATE_DTYPE if "linear_attention" in kinds else None,
        logprobs=LOGPROBS_DTYPE,
    )


# Sites both frameworks run row-parallel (input split along K across TP ranks).
ROW_PARALLEL_SITE_SUFFIXES = (".o_proj", ".down_proj", ".out_proj")
# The impls of `linear` whose bits do not depend on how K is split across ranks: the K-leaves
# `linear_tp` of each backend (torch's and Triton's; `ops._SPECS`, `ops.triton._SPECS`).
_TP_INVARIANT_LINEARS = frozenset({"isoexec.linear.tp_leaves", "isoexec.linear.triton_tp_leaves"})


def tp_invariant_sites(sites: Mapping[str, ImplInfo]) -> set[str]:
    """The sites whose bits do not depend on the TP degree — the same rule on both sides.

    A canonical site is TP-invariant when TP only changes which rows or heads a rank holds
    (norms, rope, attention per head, column-parallel linears, whose output columns are
    computed from their own weight rows, the gathered lm head and full-row logprobs, whole
    experts); a row-parallel site only with the K-leaves linear. A native site never is.
    """
    out = set()
    for name, impl in sites.items():
        if impl.is_native:
            continue
        if name.endswith(ROW_PARALLEL_SITE_SUFFIXES) and impl.impl_id not in _TP_INVARIANT_LINEARS:
            continue
        out.add(name)
    return out


def contract_for(
    hf_config: Mapping[str, Any],
    dtype: str,
    sites: Mapping[str, ImplInfo],
    *,
    device: DeviceIdentity | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    ep_size: int = 1,
    dp_size: int = 1,
    speculative: tuple[str, int] | None = None,
    canonical_verifier: bool = True,
) -> Contract:
    """The contract of `hf_config` at `dtype` with what each site actually runs, on a side
    running at these parallel degrees.

    TP-invariant sites (`tp_invariant_sites`) record "invariant", the others `tp_size`: a
    trainer at TP=2 and an engine at TP=1 agree exactly when every site that differs in TP
    is TP-invariant. The `parallel` section follows `parallel_layout.declared_layout`, the
    same rule on both sides. `speculative`: the engine's (method, k) when it speculates, and
    `canonical_verifier` whether its rejection sampler is IsoExec's; the `speculation` entry
    follows `speculation.declared_speculation`. Refuses (ContractError) if `sites` misses a site
    of the model or records the wrong op.
    """
    invariant = tp_invariant_sites(sites)
    canonical = not any(i.is_native for i in sites.values())
    method, k = speculative if speculative is not None else (None, None)
    parallel = declared_layout(
        all_sites_tp_invariant=invariant == set(sites),
        canonical=canonical,
        moe=num_experts(hf_config) > 0,
        tp=tp_size, pp=pp_size, ep=ep_size, dp=dp_size,
    )  # fmt: skip
    return build_contract(
        model=model_identity(hf_config),
        dtypes=model_dtypes(hf_config, dtype),
        sites=sites,
        device=device,  # None: detected at build, with Triton's version if a site runs it
        tp_size=tp_size,
        tp_invariant=invariant,
        expected_sites=model_sites(hf_config),
        parallel=parallel,
        speculation=declared_speculation(
            canonical=canonical, method=method, num_tokens=k, canonical_verifier=canonical_verifier
        ),
    )
