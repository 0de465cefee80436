"""`ISOEXEC_VERIFY_CALLS=1` in a real vLLM engine: every site call is checked against the
site's record while the engine serves, and a site whose forward is swapped for a native kernel
after start-up is refused on the next step (`isoexec.ops.call_verify`).

One eager engine of its own (a verify-mode engine refuses compiled mode: tests/vllm
test_admission), shut down whatever happens."""

from __future__ import annotations

from typing import Any

import pytest

from isoexec.ops.call_verify import VERIFY_CALLS_ENV
from isoexec.vllm.engine_process import EngineConfig, EngineError, EngineProcess, SamplingSpec

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def native_final_norm(worker: Any) -> None:
    """Runs in the worker: the final norm keeps its canonical record, but its forward becomes
    torch's own RMSNorm (a native kernel where the contract says canonical)."""
    import torch

    inner = getattr(worker, "worker", worker)
    norm = inner.model_runner.model.model.norm

    def native(x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is not None:
            x = x + residual
            residual = x
        y = torch.nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
        return y if residual is None else (y, residual)

    norm.forward = native


def test_engine_checks_every_site_call_and_refuses_a_native_kernel(tiny_dense_dir: str) -> None:
    cfg = EngineConfig(
        model=tiny_dense_dir,
        isoexec=True,
        enforce_eager=True,
        seed=3,
        extra_env=((VERIFY_CALLS_ENV, "1"),),
    )
    with EngineProcess(cfg, start_timeout_s=600) as eng:
        outs = eng.generate(PROMPTS, SamplingSpec(max_tokens=4, prompt_logprobs=True))
        assert [len(o.token_ids) for o in outs] == [4, 4]
        (report,) = eng.call("collective_rpc", "isoexec_verified_calls")
        assert report["enabled"] is True
        checked = {key.split(":")[0] for key in report["calls"]}
        want = {"linear", "rms_norm", "rope", "attention", "silu_mul", "logprobs"}
        assert want <= checked, sorted(checked)

        eng.call("collective_rpc", native_final_norm)
        with pytest.raises(EngineError, match=r"records rms_norm .* but no call of it ran"):
            eng.generate(PROMPTS, SamplingSpec(max_tokens=2))


def test_without_the_mode_the_native_kernel_runs_unnoticed(tiny_dense_dir: str) -> None:
    """Negative control: the same swap in an engine without verify mode serves on."""
    cfg = EngineConfig(model=tiny_dense_dir, isoexec=True, enforce_eager=True, seed=3)
    with EngineProcess(cfg, start_timeout_s=600) as eng:
        (report,) = eng.call("collective_rpc", "isoexec_verified_calls")
        assert report == {"enabled": False, "calls": {}}
        eng.call("collective_rpc", native_final_norm)
        outs = eng.generate(PROMPTS, SamplingSpec(max_tokens=2))
        assert [len(o.token_ids) for o in outs] == [2, 2]
