"""Qwen3-MoE on real vLLM (CPU) with IsoExec: canonical router/experts at every MoE site and
bitwise-invariant logprobs across batching, chunking, prefix caching and decode/prefill.

bf16 runs every situation; fp32 skips chunked prefill (one engine start less: the suite has
a time budget and the chunking path is dtype-independent code).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _invariance import assert_finite, differences, non_canonical_sites, observations

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
