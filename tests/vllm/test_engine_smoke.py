"""Real vLLM (CPU) runs: a tiny random Qwen3 generates with logprobs and prompt logprobs."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import pytest

from isoexec.contract.contract import Contract
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
    from isoexec.vllm import engine_process

    live_before = set(engine_process._LIVE_GROUPS)  # the session's pooled engines
    with pytest.raises(Exception, match=r"config|No such|not a valid|does not appear"):
        EngineProcess(EngineConfig(model=str(tmp_path / "missing")), start_timeout_s=600)
    # No orphan: the atexit registry is empty again
    assert engine_process._LIVE_GROUPS == live_before


def test_start_engines_failure_leaves_nothing(tmp_path) -> None:
    """`start_engines` (several engines starting at once, `isoexec bench`): one failing start
    closes every engine it started, still starting or not, and raises the error."""
    from isoexec.vllm import engine_process

    live_before = set(engine_process._LIVE_GROUPS)
    configs = [EngineConfig(model=str(tmp_path / name)) for name in ("missing-a", "missing-b")]
    with pytest.raises(Exception, match=r"config|No such|not a valid|does not appear"):
        engine_process.start_engines(configs, start_timeout_s=600)
    assert engine_process._LIVE_GROUPS == live_before


def test_logprobs_mode_drift_is_refused_at_startup(tiny_dense_dir: str) -> None:
    """An IsoExec engine whose vLLM logprobs mode (raw) is not the one its IsoExec options name
    (processed, which the trainer takes) refuses to start, and leaves no process behind."""
    from isoexec.vllm import engine_process

    live_before = set(engine_process._LIVE_GROUPS)
    cfg = EngineConfig(model=tiny_dense_dir, isoexec=True, logprobs_mode="raw_logprobs",
                       enforce_eager=True)  # fmt: skip
    with pytest.raises(Exception, match="logprobs_mode='raw_logprobs' but its IsoExec options"):
        EngineProcess(cfg, start_timeout_s=600)
    assert engine_process._LIVE_GROUPS == live_before


@pytest.mark.matrix  # 90 s; multiprocess engines MATCH and score bitwise in the served tests
def test_isoexec_multiprocess_engine_matches_in_process(
    tiny_dense_dir: str, engine_pool: Callable[..., EngineProcess]
) -> None:
    """The plugin installs in vLLM's EngineCore process too: same sites, same bits."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    spec = SamplingSpec(max_tokens=1, prompt_logprobs=True)
    inproc = engine_pool(model=tiny_dense_dir, isoexec=True)
    # eager (no compile: one minute less here); compiled == eager is tests/test_compiled_engine
    mp_cfg = EngineConfig(model=tiny_dense_dir, isoexec=True, multiprocessing=True,
                          enforce_eager=True)  # fmt: skip
    with EngineProcess(mp_cfg) as mp:
        contract = Contract.from_bytes(mp.call("contract"))
        got = [o.prompt_logprobs for o in mp.generate(prompts, spec)]
    assert contract.to_bytes() == inproc.call("contract")
    assert not contract.native_sites
    assert got == [o.prompt_logprobs for o in inproc.generate(prompts, spec)]


def test_isoexec_off_leaves_vllm_untouched(
    tiny_dense_dir: str, engine_pool: Callable[..., EngineProcess]
) -> None:
    """ISOEXEC unset: every site reads back as vLLM's own class."""
    sites = dict(engine_pool(model=tiny_dense_dir, isoexec=False).call("sites"))
    assert all(impl[1].startswith("native:") for impl in sites.values()), sites
    assert sites["layers.0.self_attn.core"][1] == "native:CPUAttentionBackendImpl"
    assert sites["logprobs"][1] == "native:Sampler"
