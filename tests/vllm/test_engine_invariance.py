"""Engine-internal invariance, bitwise, on real vLLM (CPU), with IsoExec on and off.

One prompt's logprobs must not depend on: co-batched requests of other lengths, chunked
prefill, prefix-cache hits, or whether a token was produced by decode or scored by prefill.
With IsoExec off, at least one of these changes bits on a model wide enough for the stock
kernels to switch paths (the negative control).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from isoexec.vllm.engine_process import EngineProcess, SamplingSpec

pytestmark = pytest.mark.engine

PROMPT_LEN = 150  # > one 128-token KV block, several 32-token prefill chunks
CHUNK_BUDGET = 32


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _prompt_lps(eng: EngineProcess, prompts: list[list[int]], index: int) -> list[float]:
    outs = eng.generate(prompts, SamplingSpec(max_tokens=1, prompt_logprobs=True))
    lps = outs[index].prompt_logprobs
    assert lps is not None
    return lps


def _observations(
    engine_pool: Callable[..., EngineProcess], model: str, dtype: str, isoexec: bool, vocab: int
) -> dict[str, list[float]]:
    """The same prompt's logprobs observed in five engine situations."""
    whole = engine_pool(model=model, dtype=dtype, isoexec=isoexec)
    chunked = engine_pool(
        model=model, dtype=dtype, isoexec=isoexec, max_num_batched_tokens=CHUNK_BUDGET
    )
    p = _prompt(1, PROMPT_LEN, vocab)
    others = [_prompt(2, 37, vocab), _prompt(3, 5, vocab), _prompt(4, 211, vocab)]
    whole.call("reset_prefix_cache")
    obs = {"alone": _prompt_lps(whole, [p], 0)}
    obs["prefix_cache_hit"] = _prompt_lps(whole, [p], 0)  # first 128-token block is cached
    obs["co_batched"] = _prompt_lps(whole, [others[0], p, others[1], others[2]], 1)
    chunked.call("reset_prefix_cache")
    obs["chunked_prefill"] = _prompt_lps(chunked, [p], 0)
    # decode == prefill: greedy-decode 6 tokens, then score prompt+tokens as a prompt
    (gen,) = whole.generate([p], SamplingSpec(max_tokens=6, temperature=0.0))
    rescored = _prompt_lps(whole, [p + gen.token_ids], 0)
    obs["decode"] = obs["alone"] + gen.logprobs
    obs["prefill_of_decoded"] = rescored
    return obs


def _differences(obs: dict[str, list[float]]) -> dict[str, int]:
    ref = obs["alone"]
    diffs = {
        name: sum(a != b for a, b in zip(ref, vals[: len(ref)], strict=True))
        for name, vals in obs.items()
        if name not in ("alone", "decode", "prefill_of_decoded")
    }
    dec, pre = obs["decode"], obs["prefill_of_decoded"]
    diffs["decode_vs_prefill"] = sum(a != b for a, b in zip(dec, pre, strict=True))
    return diffs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_isoexec_engine_is_bitwise_invariant(
    engine_pool: Callable[..., Any], model_factory: Callable[[str, str], str], dtype: str
) -> None:
    model = model_factory("tiny-dense", dtype)
    obs = _observations(engine_pool, model, dtype, True, 512)
    assert len(obs["alone"]) == PROMPT_LEN - 1
    assert _differences(obs) == dict.fromkeys(_differences(obs), 0)


def test_negative_control_stock_engine_differs(
    engine_pool: Callable[..., Any], model_factory: Callable[[str, str], str]
) -> None:
    """Stock vLLM, same checks, wide bf16 model: some situation changes bits."""
    model = model_factory("wide-dense", "bfloat16")
    stock = _differences(_observations(engine_pool, model, "bfloat16", False, 1024))
    print("stock engine mismatches per situation:", stock)
    assert sum(stock.values()) > 0, stock
    iso = _differences(_observations(engine_pool, model, "bfloat16", True, 1024))
    print("isoexec engine mismatches per situation:", iso)
    assert sum(iso.values()) == 0, iso
