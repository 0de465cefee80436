"""Shared engine-invariance checks: one prompt's logprobs observed in several engine situations.

Used by the per-family engine tests. A situation is a way vLLM may schedule the same tokens
(alone, co-batched, chunked prefill, prefix-cache hit, decode vs prefill); with IsoExec every
situation must give the same bits as the prompt alone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from isoexec.contract.impl import NATIVE_PREFIX
from isoexec.vllm.engine_process import EngineProcess, SamplingSpec

PROMPT_LEN = 150  # > one 128-token KV block, several 32-token prefill chunks
CHUNK_BUDGET = 32
OTHER_LENS = (37, 5, 211)


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def prompt_logprobs(eng: EngineProcess, prompts: list[list[int]], index: int) -> list[float]:
    outs = eng.generate(prompts, SamplingSpec(max_tokens=1, prompt_logprobs=True))
    lps = outs[index].prompt_logprobs
    assert lps is not None
    return lps


def observations(
    engine_pool: Callable[..., EngineProcess],
    model: str,
    dtype: str,
    vocab: int,
    *,
    isoexec: bool = True,
    prefix_caching: bool = True,
    chunked_prefill: bool = True,
    extra: dict[str, Any] | None = None,
) -> dict[str, list[float]]:
    """The same prompt's logprobs in every situation.

    `prefix_caching=False` runs the engines without it (and skips the cache-hit situation);
    `chunked_prefill=False` skips the second (chunked) engine, which costs one engine start.
    `extra`: more `EngineConfig` fields (e.g. a seed that keeps a faulted engine apart).
    """
    common: dict[str, Any] = {"model": model, "dtype": dtype, "isoexec": isoexec, **(extra or {})}
    if not prefix_caching:
        common["enable_prefix_caching"] = False
    whole = engine_pool(**common)
    p = prompt(1, PROMPT_LEN, vocab)
    others = [prompt(2 + i, n, vocab) for i, n in enumerate(OTHER_LENS)]
    obs = {"alone": prompt_logprobs(whole, [p], 0)}
    obs["co_batched"] = prompt_logprobs(whole, [others[0], p, others[1], others[2]], 1)
    if chunked_prefill:
        chunked = engine_pool(**common, max_num_batched_tokens=CHUNK_BUDGET)
        obs["chunked_prefill"] = prompt_logprobs(chunked, [p], 0)
    # decode == prefill: greedy-decode 6 tokens, then score prompt+tokens as a prompt
    greedy = SamplingSpec(max_tokens=6, temperature=0.0)
    if prefix_caching:
        whole.call("reset_prefix_cache")
    (gen,) = whole.generate([p], greedy)
    obs["decode"] = obs["alone"] + gen.logprobs
    obs["prefill_of_decoded"] = prompt_logprobs(whole, [p + gen.token_ids], 0)
    if prefix_caching:
        # vLLM never *reads* the prefix cache for a request that asks for prompt logprobs
        # (`skip_reading_prefix_cache`), so the cache hit is observed on a decode: the same
        # greedy request again, now reusing the prompt's first full block (and, for GDN,
        # the recurrent state stored at that block boundary).
        (hit,) = whole.generate([p], greedy)
        assert hit.num_cached_tokens >= 128, "the repeated request did not hit the prefix cache"
        obs["decode_prefix_cache_hit"] = obs["alone"] + hit.logprobs
    # decode co-batched with other requests' prefills and decodes
    gens = whole.generate([p, *others], greedy)
    obs["decode_co_batched"] = obs["alone"] + gens[0].logprobs
    if chunked_prefill:
        # mixed steps: p's decodes share steps with chunks of a longer prompt's prefill
        gens = chunked.generate([p, others[2]], greedy)
        obs["decode_chunked_mixed"] = obs["alone"] + gens[0].logprobs
    return obs


def differences(obs: dict[str, list[float]]) -> dict[str, int]:
    """Per situation: how many logprobs differ (bitwise) from the reference."""
    ref, dec = obs["alone"], obs["decode"]
    diffs = {
        name: sum(a != b for a, b in zip(ref, obs[name], strict=True))
        for name in ("co_batched", "chunked_prefill")
        if name in obs
    }
    diffs["decode_vs_prefill"] = sum(
        a != b for a, b in zip(dec, obs["prefill_of_decoded"], strict=True)
    )
    for name in ("decode_prefix_cache_hit", "decode_co_batched", "decode_chunked_mixed"):
        if name in obs:
            diffs[name] = sum(a != b for a, b in zip(dec, obs[name], strict=True))
    return diffs


def assert_finite(obs: dict[str, list[float]]) -> None:
    for name, vals in obs.items():
        assert all(math.isfinite(v) and v <= 0.0 for v in vals), name


def non_canonical_sites(eng: EngineProcess) -> list[str]:
    """Sites whose read-back impl is native (empty when everything is canonical)."""
    return [name for name, impl in eng.call("sites") if impl[1].startswith(NATIVE_PREFIX)]


# ---- preemption, observed where the worker sees it -------------------------------------------
# Run through `EngineProcess.call("collective_rpc", fn)`: `fn(worker)` runs in the engine's
# worker. vLLM's scheduler lists every request it preempted (its KV blocks freed, to be
# recomputed from scratch when resumed) in the next step's `SchedulerOutput.preempted_req_ids`.


def watch_preemptions(worker: Any) -> None:
    """Start counting preemption events on this worker (idempotent)."""
    inner = getattr(worker, "worker", worker)  # vLLM's WorkerWrapperBase holds the worker
    if hasattr(inner, "_isoexec_test_preempted"):
        return
    events: list[str] = []
    execute_model = inner.execute_model

    def counting_execute_model(scheduler_output: Any) -> Any:
        events.extend(sorted(scheduler_output.preempted_req_ids or ()))
        return execute_model(scheduler_output)

    inner._isoexec_test_preempted = events
    inner.execute_model = counting_execute_model


def preemptions(worker: Any) -> int:
    """Preemption events seen since `watch_preemptions`."""
    return len(getattr(worker, "worker", worker)._isoexec_test_preempted)


# ---- a built-in batch dependence, to show the checks can fail on any CPU ---------------------
FAULT_MIN_ROWS = 200  # more rows than the prompt alone (150), fewer than it co-batched (403)


def inject_batch_dependent_final_norm(worker: Any) -> None:
    """Make the final norm's output one ulp larger in every step of more than `FAULT_MIN_ROWS`
    tokens: a site whose bits depend on the batch, whatever the CPU and its BLAS."""
    import torch

    inner = getattr(worker, "worker", worker)
    norm = inner.model_runner.model.model.norm

    def one_ulp_when_batched(module: Any, args: Any, out: Any) -> Any:
        first = out[0] if isinstance(out, tuple) else out
        if first.shape[0] <= FAULT_MIN_ROWS:
            return out
        bumped = torch.nextafter(first, torch.full_like(first, float("inf")))
        return (bumped, *out[1:]) if isinstance(out, tuple) else bumped

    norm.register_forward_hook(one_ulp_when_batched)
