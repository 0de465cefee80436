"""Qwen3-MoE on real vLLM (CPU) with IsoExec: canonical router/experts at every MoE site and
bitwise-invariant logprobs across batching, chunking, prefix caching and decode/prefill.

bf16 runs every situation; fp32 skips chunked prefill (one engine start less: the suite has
a time budget and the chunking path is dtype-independent code).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _invariance import (
    OTHER_LENS,
    PROMPT_LEN,
    assert_finite,
    differences,
    non_canonical_sites,
    observations,
    prompt,
    prompt_logprobs,
)

pytestmark = pytest.mark.engine

VOCAB = 512  # tiny-moe


@pytest.mark.parametrize(("dtype", "chunked"), [("bfloat16", True), ("float32", False)])
def test_moe_engine_is_canonical_and_bitwise_invariant(
    engine_pool: Callable[..., Any],
    model_factory: Callable[[str, str], str],
    dtype: str,
    chunked: bool,
) -> None:
    model = model_factory("tiny-moe", dtype)
    obs = observations(engine_pool, model, dtype, VOCAB, chunked_prefill=chunked)
    assert_finite(obs)
    eng = engine_pool(model=model, dtype=dtype, isoexec=True)
    sites = dict(eng.call("sites"))
    assert sites["layers.0.mlp.router"][1] == "isoexec.moe_router.softmax_topk"
    assert sites["layers.1.mlp.experts"][1] == "isoexec.moe_combine.ascending"
    assert non_canonical_sites(eng) == []
    diffs = differences(obs)
    print(f"tiny-moe {dtype} mismatches per situation:", diffs)
    assert diffs == dict.fromkeys(diffs, 0)


# Wide enough for stock vLLM-CPU to change bits with batch composition (measured, bf16:
# hidden 1024 differs, hidden 128 does not — as for the dense negative control).
WIDE_MOE = {
    "vocab_size": 1024,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
}


@pytest.fixture(scope="module")
def wide_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from isoexec.contract.tiny_models import make_tiny_model

    out = tmp_path_factory.mktemp("models") / "wide-moe-bfloat16"
    return str(make_tiny_model("tiny-moe", out, dtype="bfloat16", overrides=WIDE_MOE))


def _co_batching_mismatches(eng: Any) -> int:
    """How many of one prompt's logprobs change when it is co-batched with other lengths."""
    p = prompt(1, PROMPT_LEN, WIDE_MOE["vocab_size"])
    others = [prompt(2 + i, n, WIDE_MOE["vocab_size"]) for i, n in enumerate(OTHER_LENS)]
    alone = prompt_logprobs(eng, [p], 0)
    co_batched = prompt_logprobs(eng, [others[0], p, others[1], others[2]], 1)
    return sum(a != b for a, b in zip(alone, co_batched, strict=True))


def test_negative_control_stock_moe_engine_differs(
    engine_pool: Callable[..., Any], wide_moe_dir: str
) -> None:
    """Stock vLLM on a wide MoE model (bf16): co-batching changes a prompt's logprobs; with
    IsoExec on the same model it changes none.

    Measured on this machine: 117 of 149 prompt logprobs differ under co-batching (and the
    stock decode differs from the prefill of the same tokens). Not from the experts kernel
    itself: stock vLLM's CPU fused-experts kernel (`cpu_fused_moe`, vec and amx) alone gives
    every token the same bits whatever the batch, for fixed routing (measured at these
    sizes). The differences arise around it (the hidden-1024 projections and attention, as in
    the dense control; possibly the router's logits GEMM that feeds the top-k), and the
    experts then see different inputs.
    """
    stock = _co_batching_mismatches(engine_pool(model=wide_moe_dir, dtype="bfloat16"))
    print("stock MoE engine: co-batched logprobs that differ from alone:", stock)
    assert stock > 0
    iso_engine = engine_pool(model=wide_moe_dir, dtype="bfloat16", isoexec=True)
    iso = _co_batching_mismatches(iso_engine)
    print("isoexec MoE engine: co-batched logprobs that differ from alone:", iso)
    assert iso == 0
    assert non_canonical_sites(iso_engine) == []
