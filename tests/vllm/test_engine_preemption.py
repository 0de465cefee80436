"""Preemption and recompute do not change a request's bits (IsoExec on, real vLLM, CPU).

The engine gets a KV cache of three 128-token blocks. Four requests whose prompts fit one
block each start together and decode past their block boundary, so the scheduler runs out
of blocks mid-decode and preempts: the victim's blocks are freed and, when it is resumed, its
prompt *and the tokens it had already generated* are recomputed as a prefill before decoding
continues. Prefix caching is off on this engine, so a resumed request cannot reuse blocks
left in the cache: every preempted token is recomputed. Each request's greedy tokens and
logprobs must equal those of the same request run alone (no preemption: it fits).

Preemption is observed, not assumed: the worker counts the request ids vLLM's scheduler
reports as preempted in each step (`SchedulerOutput.preempted_req_ids`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _invariance import preemptions, prompt, watch_preemptions

from isoexec.vllm.engine_process import SamplingSpec

pytestmark = pytest.mark.engine

BLOCK = 128  # vLLM-CPU's KV block size for this model
KV_BLOCKS = 3
MAX_MODEL_LEN = 2 * BLOCK  # vLLM requires the KV cache to hold one request of this length
PROMPT_LENS = (115, 118, 121, 124)  # one block each; each decode crosses into a second block
GREEDY = SamplingSpec(max_tokens=16, temperature=0.0)


def _kv_bytes_per_block(model: str, dtype_bytes: int = 4) -> int:
    hf = json.loads((Path(model) / "config.json").read_text())
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * hf["head_dim"]
    return per_token * dtype_bytes * BLOCK


def test_preempted_and_recomputed_requests_keep_their_bits(
    engine_pool: Callable[..., Any], tiny_dense_dir: str
) -> None:
    prompts = [prompt(60 + i, n, 512) for i, n in enumerate(PROMPT_LENS)]
    assert all(n + GREEDY.max_tokens > BLOCK for n in PROMPT_LENS)
    assert len(prompts) * 2 > KV_BLOCKS  # together they need more blocks than there are
    eng = engine_pool(
        model=tiny_dense_dir,
        isoexec=True,
        enable_prefix_caching=False,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=KV_BLOCKS * _kv_bytes_per_block(tiny_dense_dir),
    )
    eng.call("collective_rpc", watch_preemptions)

    (before,) = eng.call("collective_rpc", preemptions)
    alone = [eng.generate([p], GREEDY)[0] for p in prompts]
    (after_alone,) = eng.call("collective_rpc", preemptions)
    assert after_alone == before, "a request alone should fit without preemption"

    together = eng.generate(prompts, GREEDY)
    (after_together,) = eng.call("collective_rpc", preemptions)
    preempted = after_together - after_alone
    print(f"preemption events while decoding {len(prompts)} requests together: {preempted}")
    assert preempted > 0, "the scheduler never preempted: the test would prove nothing"

    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        assert len(t.token_ids) == GREEDY.max_tokens
        assert torch.equal(torch.tensor(t.token_ids), torch.tensor(a.token_ids)), i
        lp_t = torch.tensor(t.logprobs, dtype=torch.float64)
        assert torch.equal(lp_t, torch.tensor(a.logprobs, dtype=torch.float64)), i
