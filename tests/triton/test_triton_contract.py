"""The Triton backend is a separate backend of the same ops, and the contract says so.

A trainer running Triton kernels and an engine running the torch ops compute different bits,
so their contracts must differ (the handshake then refuses the weight sync) and the diff must
name the site and the backend. Needs triton importable, launches no kernel.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("triton")

from isoexec.contract.contract import DeviceIdentity
from isoexec.contract.diff import diff
from isoexec.contract.model_contract import contract_for
from isoexec.contract.sites import model_sites
from isoexec.ops import (
    BACKENDS,
    REGISTRY,
    TORCH_ONLY,
    backend_ops,
    get_backend_impl,
)
from isoexec.ops.triton import TRITON_REGISTRY, get_triton_impl
from isoexec.tools.tiny_models import PRESETS

ARCH = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
# Fixed, so the two contracts differ only where the sites differ.
DEVICE = DeviceIdentity(torch="2.13.0", device_kind="cuda", arch="sm90", triton="3.9.0")
FAMILIES = ("tiny-dense", "tiny-moe", "tiny-gdn")


def _config(preset: str) -> dict[str, Any]:
    cfg = dict(PRESETS[preset])
    cfg["architectures"] = [ARCH[cfg["model_type"]]]
    return cfg


def _contract(cfg: dict[str, Any], backend_of: Any) -> Any:
    sites = {s.name: get_backend_impl(s.op, backend_of(s.name)) for s in model_sites(cfg)}
    return contract_for(cfg, "bfloat16", sites, device=DEVICE)


def test_every_op_has_a_triton_impl() -> None:
    assert set(TRITON_REGISTRY) == set(REGISTRY) - TORCH_ONLY and TORCH_ONLY <= set(REGISTRY)
    assert BACKENDS == ("torch", "triton")
    for op, info in TRITON_REGISTRY.items():
        torch_info = REGISTRY[op]
        assert info.op == torch_info.op
        assert info.backend == "triton" and torch_info.backend == "torch"
        assert info.impl_id != torch_info.impl_id and ".triton_" in info.impl_id
        assert len(info.source_fingerprint) == 32 and not info.is_native
        assert get_backend_impl(op, "triton") == info == get_triton_impl(op)
        assert get_backend_impl(op) == torch_info
    t, x = backend_ops("torch"), backend_ops("triton")
    for fn in ("linear", "rms_norm", "apply_rope", "silu_mul", "attention_varlen"):
        assert getattr(t, fn) is not getattr(x, fn)
    with pytest.raises(KeyError):
        backend_ops("cuda-graphs")


def test_params_are_recorded_and_overrides_change_the_impl() -> None:
    lin = TRITON_REGISTRY["linear"].param_dict()
    assert (lin["block_m"], lin["block_n"], lin["block_k"], lin["split_k"]) == (
        "64",
        "64",
        "32",
        "1",
    )
    assert TRITON_REGISTRY["attention"].param_dict()["kv_tile"] == "16"
    assert get_triton_impl("linear", block_k=64) != TRITON_REGISTRY["linear"]
    with pytest.raises(KeyError):
        get_triton_impl("linear", block_rows=32)
    with pytest.raises(KeyError):
        get_triton_impl("nope")


@pytest.mark.parametrize("preset", FAMILIES)
def test_triton_trainer_and_torch_engine_get_different_contracts(preset: str) -> None:
    cfg = _config(preset)
    engine = _contract(cfg, lambda _name: "torch")
    trainer = _contract(cfg, lambda _name: "triton")
    same = _contract(cfg, lambda _name: "triton")
    assert trainer.hash == same.hash
    assert trainer.hash != engine.hash
    d = diff(trainer, engine)
    assert not d.equal
    # only sites differ (the backend identity, model and dtypes are the same)
    assert all(x.section == "site" for x in d.differences)
    assert set(d.differing_sites) == {s.name for s in model_sites(cfg)}
    assert any(
        x.field == "kernel backend" and (x.left, x.right) == ("triton", "torch")
        for x in d.differences
    )
    assert "kernel backend triton → torch" in str(d)


def test_one_site_on_another_backend_is_named() -> None:
    cfg = _config("tiny-dense")
    engine = _contract(cfg, lambda _name: "torch")
    trainer = _contract(cfg, lambda name: "triton" if name == "lm_head" else "torch")
    d = diff(trainer, engine)
    assert trainer.hash != engine.hash
    assert d.differing_sites == ("lm_head",)
    line = next(line for line in d.lines if line.startswith("lm_head"))
    assert "kernel backend triton → torch" in line and "linear" in line


def test_triton_linear_tp_shard_takes_the_torch_ops_call() -> None:
    """The sites (Megatron's `_leaf_linear`, the engine's compiled op) call either backend's
    `linear_tp_shard` the same way: the torch signature, less the torch tiles' `block_rows`."""
    import inspect

    def params(backend: str) -> list[tuple[str, object, object]]:
        sig = inspect.signature(backend_ops(backend).linear_tp_shard)
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    torch_params = [p for p in params("torch") if p[0] != "block_rows"]
    assert params("triton") == torch_params


def test_both_backends_linear_tp_are_tp_invariant_at_row_parallel_sites() -> None:
    """A row-parallel site running either backend's K-leaves records tp "invariant" (a Triton
    trainer at TP=2 and at TP=1 have one contract); the plain linear does not."""
    from isoexec.contract.model_contract import tp_invariant_sites

    site = "layers.0.self_attn.o_proj"
    for impl in (REGISTRY["linear_tp"], TRITON_REGISTRY["linear_tp"]):
        assert tp_invariant_sites({site: impl}) == {site}, impl.impl_id
        assert tp_invariant_sites({site: get_backend_impl("linear_tp", impl.backend, leaves=8)})
    for impl in (REGISTRY["linear"], TRITON_REGISTRY["linear"]):
        assert tp_invariant_sites({site: impl}) == set(), impl.impl_id


def test_vocab_parallel_logprobs_are_refused_under_autograd() -> None:
    """The Triton vocab-leaf stats have no backward: under autograd the log-normaliser would
    get no gradient while the token term does (a silently wrong gradient), so it is refused
    before any kernel runs; without autograd the refusal does not apply."""
    import torch

    from isoexec.ops.triton import logprobs as triton_lp

    shard = torch.randn(3, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="forward only"):
        triton_lp.token_logprobs_vocab_parallel([shard], torch.tensor([1, 2, 3]), leaves=8)
    with torch.no_grad(), pytest.raises(Exception) as info:  # no kernel on a CPU tensor here
        triton_lp.vocab_leaf_stats(shard, leaves=8)
    assert "forward only" not in str(info.value)
