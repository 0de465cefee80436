"""Builders for the contract tests: a small, fully fixed contract (no detection), so bytes are
the same on every machine."""

from __future__ import annotations

from isoexec.contract.contract import (
    Contract,
    DeviceIdentity,
    Dtypes,
    ModelIdentity,
    build_contract,
    config_digest,
)
from isoexec.contract.impl import ImplInfo

TOKEN = "test-token-0123456789abcdef"
FP = "0123456789abcdef0123456789abcdef"

MODEL = ModelIdentity(
    architecture="Qwen3ForCausalLM",
    config_digest=config_digest({"hidden_size": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e6}),
    layer_kinds=("attention", "attention"),
)
DTYPES = Dtypes(
    params="float32",
    activations="float32",
    residual="float32",
    kv_cache="float32",
    recurrent_state=None,
    logprobs="float32",
)
DEVICE = DeviceIdentity(torch="2.13.0+cpu", device_kind="cpu", arch="x86_64:avx2,fma:AVX2")


def linear(version: int = 3, block_rows: int = 32, fp: str = FP) -> ImplInfo:
    return ImplInfo.make(
        "linear", "isoexec.linear.row_block", version, "torch-cpu", {"block_rows": block_rows}, fp
    )


def site_impls(n_layers: int = 2, *, fc1_version: dict[int, int] | None = None) -> dict:
    """Sites in model order; `fc1_version` overrides the fc1 version of chosen layers."""
    fc1_version = fc1_version or {}
    sites: dict[str, ImplInfo] = {"embed_tokens": ImplInfo.native("embedding", "Embedding")}
    for i in range(n_layers):
        p = f"layers.{i}"
        sites[f"{p}.input_layernorm"] = ImplInfo.make(
            "rms_norm", "isoexec.rms_norm", 1, "torch-cpu", {"eps": 1e-6}, FP
        )
        sites[f"{p}.self_attn.qkv_proj"] = linear()
        sites[f"{p}.self_attn.core"] = ImplInfo.make(
            "attention", "isoexec.attention.tiled", 2, "torch-cpu", {"tile": 16}, FP
        )
        sites[f"{p}.self_attn.o_proj"] = linear()
        sites[f"{p}.mlp.fc1"] = linear(fc1_version.get(i, 3))
        sites[f"{p}.mlp.act"] = ImplInfo.make(
            "silu_mul", "isoexec.silu_mul", 1, "torch-cpu", {"pad": 64}, FP
        )
        sites[f"{p}.mlp.fc2"] = linear()
    sites["norm"] = ImplInfo.make("rms_norm", "isoexec.rms_norm", 1, "torch-cpu", {"eps": 1e-6}, FP)
    sites["lm_head"] = linear()
    sites["logprobs"] = ImplInfo.make("logprobs", "isoexec.logprobs", 1, "torch-cpu", {}, FP)
    return sites


def make_contract(n_layers: int = 2, **kw: object) -> Contract:
    fc1 = kw.pop("fc1_version", None)
    model = kw.pop(
        "model", ModelIdentity(MODEL.architecture, MODEL.config_digest, ("attention",) * n_layers)
    )
    return build_contract(
        model=model,  # type: ignore[arg-type]
        dtypes=kw.pop("dtypes", DTYPES),  # type: ignore[arg-type]
        device=kw.pop("device", DEVICE),  # type: ignore[arg-type]
        sites=kw.pop("sites", None) or site_impls(n_layers, fc1_version=fc1),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
