"""The registry: every op has an ImplInfo; parameters are recorded and overridable."""

from __future__ import annotations

import pytest
import torch

from isoexec.contract.impl import ImplInfo
from isoexec.ops import (
    GEMM_DTYPES,
    OP_OF_VARIANT,
    REGISTRY,
    gemm,
    get_backend_impl,
    get_impl,
)
from isoexec.ops.gemm import gemm_library

OPS = {
    "linear",
    "linear_tp",
    "lora",
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
    assert REGISTRY["attention"].param_dict()["lanes"] == "16"
    assert REGISTRY["linear_tp"].param_dict()["leaves"] == "8"
    assert get_impl("attention", lanes=8) != REGISTRY["attention"]
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


def test_gemm_ops_record_the_library_for_the_sites_device_and_dtype(monkeypatch):
    """The "gemm" parameter is `gemm_library` for where and in what the site runs, so a side
    on another library records another impl (and the contract says which)."""
    for op, gemm_dtype in GEMM_DTYPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            got = get_impl(op, device="cpu", dtype=dtype).param_dict()["gemm"]
            assert got == gemm_library("cpu", gemm_dtype or dtype), (op, dtype)
        assert get_backend_impl(op, "torch", dtype=torch.bfloat16) == get_impl(
            op, dtype=torch.bfloat16
        )
        assert get_impl(op, device="cuda") != REGISTRY[op]
    assert REGISTRY["linear"].param_dict()["gemm"] == gemm_library("cpu", torch.float32)
    assert "cpu_fp32_gemm" not in REGISTRY["linear"].param_dict()
    # linear_tp's leaves are fp32 GEMMs whatever the model dtype; linear's are the model's.
    assert get_impl("linear_tp", dtype=torch.bfloat16) == REGISTRY["linear_tp"]
    if gemm_library("cpu", torch.bfloat16) != gemm_library("cpu", torch.float32):
        assert get_impl("linear", dtype=torch.bfloat16) != REGISTRY["linear"]
    # Ops without a canonical block GEMM ignore where they run; the library is not a knob.
    assert get_impl("rms_norm", device="cuda", dtype=torch.bfloat16) == REGISTRY["rms_norm"]
    with pytest.raises(KeyError, match="gemm"):
        get_impl("linear", gemm="onednn-prepacked")
    with pytest.raises(ValueError, match="unknown"):
        get_impl("linear", device="mps")
    # Negative control: a side whose CPU GEMM were another kernel records another linear.
    monkeypatch.setattr(gemm, "CPU_GEMM", "another-kernel")
    assert get_impl("linear") != REGISTRY["linear"]
    assert get_impl("linear").param_dict()["gemm"] == gemm_library("cpu", torch.float32)
