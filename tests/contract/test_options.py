"""IsoExecOptions parsing, and the one rule deciding which sites are TP-invariant."""

from __future__ import annotations

import pytest

from isoexec.contract.impl import ImplInfo
from isoexec.contract.model_contract import tp_invariant_sites
from isoexec.contract.options import IsoExecOptions
from isoexec.ops import get_impl


def test_options_round_trip_and_refusals() -> None:
    opts = IsoExecOptions(tp_invariant=True)
    assert IsoExecOptions.from_mapping(opts.to_dict()) == opts
    assert IsoExecOptions.from_mapping(None) == IsoExecOptions()
    with pytest.raises(ValueError, match="unknown IsoExec option"):
        IsoExecOptions.from_mapping({"tp_invariant": True, "fast": True})
    with pytest.raises(TypeError, match="must be a bool"):
        IsoExecOptions.from_mapping({"tp_invariant": "yes"})
    with pytest.raises(ValueError, match="backend"):
        IsoExecOptions.from_mapping({"backend": "cuda"})
    assert IsoExecOptions.from_mapping({"backend": "triton"}).backend == "triton"
    with pytest.raises(TypeError, match="mapping"):
        IsoExecOptions.from_mapping(["tp_invariant"])  # type: ignore[arg-type]
    raw = IsoExecOptions.from_mapping({"logprobs_mode": "raw_logprobs"})
    assert IsoExecOptions.from_mapping(raw.to_dict()) == raw
    with pytest.raises(ValueError, match="'logprobs_mode' 'raw_logits'"):  # not logprobs
        IsoExecOptions(logprobs_mode="raw_logits")


def test_tp_invariant_sites_rule() -> None:
    linear, leaves = get_impl("linear"), get_impl("linear_tp")
    sites = {
        "layers.0.self_attn.qkv_proj": linear,  # column-parallel: invariant as it is
        "layers.0.self_attn.o_proj": linear,  # row-parallel, plain: depends on TP
        "layers.0.mlp.down_proj": leaves,  # row-parallel, K leaves: invariant
        "layers.0.linear_attn.out_proj": linear,
        "layers.0.input_norm": get_impl("rms_norm"),
        "lm_head": linear,
        "layers.0.self_attn.core": ImplInfo.native("attention", "DotProductAttention"),
    }
    assert tp_invariant_sites(sites) == {
        "layers.0.self_attn.qkv_proj",
        "layers.0.mlp.down_proj",
        "layers.0.input_norm",
        "lm_head",
    }
