"""Real vLLM (CPU) runs: a tiny random Qwen3 generates with logprobs and prompt logprobs."""

from __future__ import annotations

import math
import os

import pytest
from isoexec.vllm.engine_process import EngineConfig, EngineProcess, SamplingSpec

pytestmark = pytest.mark.engine


def test_stock_vllm_generates_with_logprobs(tiny_dense_dir: str) -> None:
    cfg = EngineConfig(model=tiny_dense_dir, isoexec=False)
    with EngineProcess(cfg) as eng:
        outs = eng.generate(
            [[1, 2, 3, 4, 5], [7, 8, 9]], SamplingSpec(max_tokens=6, prompt_logprobs=True)
        )
        pid = eng.pid
    assert [len(o.token_ids) for o in outs] == [6, 6]
    for o in outs:
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in o.logprobs)
        assert o.prompt_logprobs is not None
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids) - 1
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole engine process group is gone


def test_engine_start_failure_leaves_nothing(tmp_path) -> None:
    with pytest.raises(Exception, match=r"config|No such|not a valid|does not appear"):
        EngineProcess(EngineConfig(model=str(tmp_path / "missing")), start_timeout_s=120)
    # No orphan: the atexit registry is empty again
    from isoexec.vllm import engine_process

    assert not engine_process._LIVE_GROUPS
