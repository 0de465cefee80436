"""The registry: every op has an ImplInfo; parameters are recorded and overridable."""

from __future__ import annotations

import pytest

from isoexec.contract.impl import ImplInfo
from isoexec.contract.ops import REGISTRY, get_impl

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
        assert isinstance(info, ImplInfo) and info.op == op and not info.is_native
        assert info.backend == "torch" and info.version >= 1
        assert len(info.source_fingerprint) == 32
        assert get_impl(op) == info


def test_params_are_recorded_and_overrides_change_the_impl():
    assert REGISTRY["linear"].param_dict()["block_rows"] == "32"
    assert REGISTRY["attention"].param_dict()["kv_tile"] == "16"
    assert REGISTRY["linear_tp"].param_dict()["leaves"] == "8"
    assert get_impl("attention", kv_tile=32) != REGISTRY["attention"]
    with pytest.raises(KeyError):
        get_impl("attention", tile=32)
    with pytest.raises(KeyError):
        get_impl("nope")
