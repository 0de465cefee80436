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
from _invariance import (
    PROMPT_LEN,
    assert_finite,
    differences,
    inject_batch_dependent_final_norm,
    non_canonical_sites,
    observations,
)

from isoexec.contract.device import cpu_isa

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
    """Stock vLLM, same checks, wide model: some situation changes bits; IsoExec none (its
    chunked-prefill situation on this model is left out, one engine start less: chunked
    prefill is checked on every family by the tests above and in their own files).

    Which dtype shows it depends on the CPU's kernels: bf16 where oneDNN has bf16 (AVX512-BF16,
    AMX), fp32 elsewhere (measured on an AVX2-only AMD EPYC: stock bf16 gave the same bits in
    every situation, stock fp32 did not); the control tries first the dtype the CPU's flags
    point to, then the other (one wide engine start less where the guess is right)."""
    bf16 = {"avx512_bf16", "amx_bf16"} & set(cpu_isa().split(":")[-1].split(","))
    stock: dict[str, dict[str, int]] = {}
    for dtype in ("bfloat16", "float32") if bf16 else ("float32", "bfloat16"):
        model = model_factory("wide-dense", dtype)
        stock[dtype] = differences(observations(engine_pool, model, dtype, 1024, isoexec=False,
                                                chunked_prefill=dtype == "bfloat16"))  # fmt: skip
        print(f"stock engine ({dtype}) mismatches per situation:", stock[dtype])
        if sum(stock[dtype].values()):
            break
    assert any(sum(d.values()) > 0 for d in stock.values()), stock
    model = model_factory("wide-dense", "bfloat16")
    iso = differences(observations(engine_pool, model, "bfloat16", 1024, isoexec=True,
                                   chunked_prefill=False))  # fmt: skip
    print("isoexec engine mismatches per situation:", iso)
    assert sum(iso.values()) == 0, iso


def test_checks_detect_an_injected_batch_dependent_site(
    engine_pool: Callable[..., Any], model_factory: Callable[[str, str], str]
) -> None:
    """The difference built in, so the checks are shown to fail on any CPU (the stock control
    above depends on which BLAS paths the CPU takes): an IsoExec engine whose final norm is one
    ulp off in steps of more than 200 tokens changes the co-batched prompt's logprobs.

    A separate engine (seed 1) carries the fault, so no other test shares it. It is eager: the
    fault replaces a module's forward after startup, which a compiled graph would not see.
    """
    model = model_factory("tiny-dense", "float32")
    faulty = {"seed": 1, "enforce_eager": True}
    eng = engine_pool(model=model, isoexec=True, **faulty)
    eng.call("collective_rpc", inject_batch_dependent_final_norm)
    diffs = differences(observations(engine_pool, model, "float32", 512, chunked_prefill=False,
                                     extra=faulty))  # fmt: skip
    print("faulty isoexec engine mismatches per situation:", diffs)
    assert diffs["co_batched"] > 0, diffs
    assert diffs["decode_vs_prefill"] == 0, diffs  # steps of <= 200 tokens are untouched
