"""Dense engine invariance, bitwise, on real vLLM (CPU), with IsoExec on and off.

One prompt's logprobs must not depend on: co-batched requests of other lengths, chunked
prefill, prefix-cache hits, or whether a token was produced by decode or scored by prefill
(see `_invariance`). With IsoExec off, at least one of these changes bits on a model wide
enough for the stock kernels to switch paths (the negative control).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from _invariance import PROMPT_LEN, assert_finite, differences, non_canonical_sites, observations

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_isoexec_engine_is_bitwise_invariant(
    engine_pool: Callable[..., Any], model_factory: Callable[[str, str], str], dtype: str
) -> None:
    model = model_factory("tiny-dense", dtype)
    obs = observations(engine_pool, model, dtype, 512)
    assert len(obs["alone"]) == PROMPT_LEN - 1
    assert_finite(obs)
    assert not non_canonical_sites(engine_pool(model=model, dtype=dtype, isoexec=True))
    diffs = differences(obs)
    assert diffs == dict.fromkeys(diffs, 0)


def test_negative_control_stock_engine_differs(
    engine_pool: Callable[..., Any], model_factory: Callable[[str, str], str]
) -> None:
    """Stock vLLM, same checks, wide bf16 model: some situation changes bits; IsoExec none."""
    model = model_factory("wide-dense", "bfloat16")
    stock = differences(observations(engine_pool, model, "bfloat16", 1024, isoexec=False))
    print("stock engine mismatches per situation:", stock)
    assert sum(stock.values()) > 0, stock
    iso = differences(observations(engine_pool, model, "bfloat16", 1024, isoexec=True))
    print("isoexec engine mismatches per situation:", iso)
    assert sum(iso.values()) == 0, iso
