"""The registry: every op has an ImplInfo; parameters are recorded and overridable."""

from __future__ import annotations

import pytest

from isoexec.contract.impl import ImplInfo
from isoexec.contract.ops import OP_OF_VARIANT, REGISTRY, get_impl

OPS = {
    "linear",
    "linear_tp",
    "rms_norm",
    "gated_rms_norm",
    "rope",
    "silu_mul",
    "attention",
    "logprobs",
    "logprobs_vocab_parallel",
    "moe_router",
    "moe_combine",
    "gdn_conv",
    "gdn_recurrence",
}


def test_every_op_is_registered():
    assert set(REGISTRY) == OPS
    for op, info in REGISTRY.items():
        assert isinstance(info, ImplInfo) and info.op == OP_OF_VARIANT.get(op, op)
        assert not info.is_native
        assert info.backend == "torch" and info.version >= 1
        assert len(info.source_fingerprint) == 32
        assert get_impl(op) == info


def test_params_are_recorded_and_overrides_change_the_impl():
    assert REGISTRY["linear"].param_dict()["block_rows"] == "32"
    assert REGISTRY["attention"].param_dict()["kv_tile"] == "128"
    assert REGISTRY["attention"].param_dict()["block_rows"] == "32"
    assert REGISTRY["linear_tp"].param_dict()["leaves"] == "8"
    assert get_impl("attention", kv_tile=32) != REGISTRY["attention"]
    with pytest.raises(KeyError):
        get_impl("attention", tile=32)
    with pytest.raises(KeyError):
        get_impl("nope")


def test_variants_record_the_site_op_and_differ_by_impl_id():
    """A TP-invariant o_proj is still the site's `linear`: same op, another impl_id."""
    assert REGISTRY["linear_tp"].op == "linear"
    assert REGISTRY["linear_tp"].impl_id != REGISTRY["linear"].impl_id
    assert REGISTRY["logprobs_vocab_parallel"].op == "logprobs"
    assert REGISTRY["logprobs_vocab_parallel"] != REGISTRY["logprobs"]
