"""Qwen3-Next (GDN hybrid + gated attention + MoE with shared expert) on real vLLM (CPU) with
IsoExec: every site canonical, and bitwise-invariant logprobs across batching, chunked prefill
(continuing from stored GDN state), prefix caching and decode vs prefill.

Stock vLLM CPU cannot run this model at all (its GDN kernel is bf16-only and rejects head
dim 32); the canonical path runs it in fp32 and bf16. bf16 runs every situation; fp32 skips
chunked prefill (one engine start less).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _invariance import assert_finite, differences, non_canonical_sites, observations

from isoexec.vllm.gdn import worker_output_gates

pytestmark = pytest.mark.engine

VOCAB = 512  # tiny-gdn


@pytest.mark.parametrize(("dtype", "chunked"), [("bfloat16", True), ("float32", False)])
def test_gdn_engine_is_canonical_and_bitwise_invariant(
    engine_pool: Callable[..., Any],
    model_factory: Callable[[str, str], str],
    dtype: str,
    chunked: bool,
) -> None:
    model = model_factory("tiny-gdn", dtype)
    obs = observations(engine_pool, model, dtype, VOCAB, chunked_prefill=chunked)
    assert_finite(obs)
    eng = engine_pool(model=model, dtype=dtype, isoexec=True)
    sites = dict(eng.call("sites"))
    assert sites["layers.0.linear_attn.conv"][1] == "isoexec.gdn_conv.shifted_sum"
    assert sites["layers.2.linear_attn.recurrence"][1] == "isoexec.gdn_recurrence.token_serial"
    assert sites["layers.1.linear_attn.norm"][1] == "isoexec.gated_rms_norm.fp32"
    assert non_canonical_sites(eng) == []
    # not a contract site yet: read from the module directly
    (gates,) = eng.call("collective_rpc", worker_output_gates)
    assert gates == {"layers.3.self_attn": "isoexec.attn_output_gate.sigmoid_mul"}
    diffs = differences(obs)
    print(f"tiny-gdn {dtype} mismatches per situation:", diffs)
    assert diffs == dict.fromkeys(diffs, 0)
