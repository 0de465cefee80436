"""`megatron_parallel(device=)`: the CPU path as before, the CUDA path's plan (NCCL, the current
device, Megatron's CUDA seeding, no CPU shim) with CUDA faked, refusals that leave nothing
behind, and `build_model` building on the layout's device. Nothing here touches a GPU: NCCL is
never initialised (the fake records the call and stands a 1-rank gloo world in for it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from isoexec.megatron import cpu_shims, parallel
from isoexec.megatron.cpu_shims import DEPENDENCY_SHIMS, apply_process_cpu_shims
from isoexec.megatron.cpu_shims.transformer import model_parallel_cpu_manual_seed
from isoexec.megatron.parallel import current_layout, device_plan, megatron_parallel

pytestmark = pytest.mark.trainer

DEPENDENCY = {"shim_moe_utils_without_te", "shim_torch_norm_zero_centered_gamma",
              "shim_gated_delta_net_without_fla"}  # fmt: skip


def _nothing_left() -> None:
    from megatron.core import parallel_state as ps

    assert not dist.is_initialized()
    assert not ps.model_parallel_is_initialized()
    assert current_layout() is None


def test_device_plan_is_the_decision() -> None:
    cpu, cuda = device_plan("cpu"), device_plan("cuda")
    assert (cpu.backend, cpu.apply_shims, cpu.manual_seed) == (
        "gloo", apply_process_cpu_shims, model_parallel_cpu_manual_seed
    )  # fmt: skip
    assert (cuda.backend, cuda.apply_shims) == ("nccl", cpu_shims.apply_dependency_shims)
    assert cuda.manual_seed is parallel._cuda_manual_seed
    with pytest.raises(ValueError, match="known devices"):
        device_plan("tpu")


def test_dependency_shims_are_the_non_cpu_ones() -> None:
    """Three shims stand in for TE / fla features Megatron's local modules lack on any device;
    every other one is about the CPU and is never applied on CUDA."""
    assert {shim.__name__ for shim, _, _ in DEPENDENCY_SHIMS} == DEPENDENCY
    assert all(why for _, _, why in DEPENDENCY_SHIMS)
    cpu_only = {s.__name__ for s in cpu_shims._SHIMS} - DEPENDENCY
    assert len(cpu_only) == 9 and not cpu_only & DEPENDENCY


def test_cpu_layout_is_unchanged(qwen3_dir: Path) -> None:
    from isoexec.megatron import build_model

    with megatron_parallel() as info:
        assert (info.device, info.backend, dist.get_backend()) == ("cpu", "gloo", "gloo")
        assert current_layout() is info
        model = build_model(qwen3_dir, isoexec=True)
        assert model.config.use_cpu_initialization
        assert {p.device.type for p in model.parameters()} == {"cpu"}
    _nothing_left()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_and_leaves_nothing() -> None:
    with (
        pytest.raises(RuntimeError, match="CUDA is not available"),
        megatron_parallel(device="cuda"),
    ):
        pass
    _nothing_left()


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """CUDA faked: 2 devices, set_device and NCCL init recorded (a 1-rank gloo world stands in
    for the NCCL one), Megatron's CUDA seeding recorded, no CPU shim in force yet."""
    from megatron.core.tensor_parallel import random as mrandom

    calls: dict[str, Any] = {"set_device": [], "init": [], "seed": []}
    real_init = dist.init_process_group

    def init_process_group(backend: str, **kwargs: Any) -> None:
        calls["init"].append((backend, kwargs))
        real_init("gloo", store=dist.HashStore(), rank=0, world_size=1)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls["set_device"].append)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(mrandom, "model_parallel_cuda_manual_seed", calls["seed"].append)
    monkeypatch.setattr(cpu_shims, "_applied", lambda: [])  # a fresh process: no shim applied yet
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    yield calls


def test_cuda_layout_asks_for_nccl_and_applies_no_cpu_shim(fake_cuda: dict[str, Any]) -> None:
    with megatron_parallel(seed=7, device="cuda") as info:
        assert (info.device, info.backend) == ("cuda", "nccl")
        assert current_layout() is info
        assert set(info.shims) <= DEPENDENCY
        assert cpu_shims.applied_cpu_only_shims() == []
    assert [b for b, _ in fake_cuda["init"]] == ["nccl"]
    assert fake_cuda["set_device"] == [1]  # LOCAL_RANK
    assert fake_cuda["seed"] == [7]  # Megatron's own model_parallel_cuda_manual_seed
    _nothing_left()


@pytest.mark.parametrize(
    ("local_rank", "applied", "match"),
    [("2", [], "LOCAL_RANK=2 but 2 CUDA"),
     ("0", ["shim_global_memory_buffer_on_cpu"], "CPU shims are in force")],
)  # fmt: skip
def test_cuda_refusals_leave_nothing(
    fake_cuda: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    local_rank: str,
    applied: list[str],
    match: str,
) -> None:
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(cpu_shims, "_applied", lambda: list(applied))
    with pytest.raises(RuntimeError, match=match), megatron_parallel(device="cuda"):
        pass
    assert fake_cuda["init"] == [] and fake_cuda["set_device"] == []
    _nothing_left()


def test_transformer_config_device() -> None:
    from isoexec.megatron.hf_config import load_hf_config
    from isoexec.megatron.model_builder import transformer_config

    arch = load_hf_config(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 128,
         "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "rope_theta": 1e6}
    )  # fmt: skip
    assert transformer_config(arch).use_cpu_initialization is True
    assert transformer_config(arch, device="cuda").use_cpu_initialization is False
    with pytest.raises(ValueError, match="device 'tpu'"):
        transformer_config(arch, device="tpu")


class _Stop(Exception):
    pass


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_build_model_builds_on_the_layouts_device(
    monkeypatch: pytest.MonkeyPatch, qwen3_dir: Path, device: str
) -> None:
    """Under a CUDA layout build_model asks Megatron to build on the device
    (use_cpu_initialization=False); the build itself is stopped before anything is allocated."""
    from isoexec.megatron import model_builder

    real = model_builder.transformer_config
    seen: list[Any] = []

    def capture(*args: Any, **kwargs: Any) -> Any:
        seen.append(real(*args, **kwargs))
        raise _Stop

    monkeypatch.setattr(model_builder, "transformer_config", capture)
    with megatron_parallel() as info:
        monkeypatch.setattr(parallel, "_CURRENT", [dataclasses.replace(info, device=device)])
        with pytest.raises(_Stop):
            model_builder.build_model(qwen3_dir, isoexec=True)
    assert seen[0].use_cpu_initialization is (device == "cpu")


def test_off_device_names_what_is_elsewhere() -> None:
    from isoexec.megatron.model_builder import _default_device, off_device

    m = torch.nn.Linear(2, 2)
    m.register_buffer("idx", torch.arange(2))
    assert off_device(m, "cpu") == []
    assert off_device(m, "cuda") == ["weight", "bias", "idx"]
    with _default_device("cpu"):
        assert torch.empty(1).device.type == "cpu"


def test_isoexec_model_reaches_no_dependency_shim(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Why a CUDA IsoExec trainer needs none of the dependency shims: a GDN + MoE isoexec model
    builds and scores with Megatron's GatedDeltaNet, its local norm (WrappedTorchNorm) and its
    router gating all made to raise."""
    from isoexec.megatron import build_model, load_hf_weights, score
    from isoexec.tools.tiny_models import make_tiny_model

    model_dir = make_tiny_model("tiny-gdn", tmp_path / "gdn")
    with megatron_parallel():  # CPU shims applied first: the patches below go over them
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet
        from megatron.core.transformer.moe.router import Router
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("an isoexec model reached a dependency-shimmed path")

        monkeypatch.setattr(GatedDeltaNet, "__init__", refuse)
        monkeypatch.setattr(WrappedTorchNorm, "__new__", refuse)
        monkeypatch.setattr(Router, "gating", refuse)
        model = build_model(model_dir, isoexec=True)
        assert model.isoexec_arch.gdn is not None and model.isoexec_arch.is_moe
        load_hf_weights(model, model_dir)
        (lp,) = score(model, [list(range(1, 12))])
        assert lp.numel() == 10 and torch.isfinite(lp).all()
