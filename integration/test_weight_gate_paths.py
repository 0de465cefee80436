"""With ISOEXEC=1 every path that writes an engine worker's weights needs the worker's MATCH,
and records the fingerprint of what the worker holds afterwards.

Paths: vLLM's `collective_rpc("reload_weights")`, `model.load_weights` from a framework's own
worker code, IsoExec's `isoexec_load_weights`, and vLLM's weight-transfer engines (IPC, NCCL,
M2N write through the model's `load_weights`; sparse NCCL, sharded RDT and modelexpress,
which write elsewhere, are refused). Before the handshake each path is refused;
after MATCH each goes through and the fingerprint recorded equals the trainer's export. Stock
engines (ISOEXEC=0) keep vLLM's own model classes.
"""

from __future__ import annotations

import inspect
import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _worker_paths import framework_load_weights, model_is_gated, transfer_backends

from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.megatron import export_hf_weights, trainer_contract
from isoexec.tools.pair import handshake
from isoexec.vllm.engine_process import EngineError

pytestmark = [pytest.mark.engine, pytest.mark.trainer]


def test_every_weight_path_needs_a_match_and_records_the_fingerprint(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    from isoexec.handshake.server import HandshakeServer

    model = model_factory("tiny-dense", "float32")
    hf = json.loads((Path(model) / "config.json").read_text())
    engine = engine_pool(model=model, dtype="float32", isoexec=True, seed=11, enforce_eager=True)
    assert engine.call("collective_rpc", model_is_gated) == [True]
    for path, call in (
        ("reload_weights", lambda: engine.call("collective_rpc", "reload_weights")),
        ("load_weights", lambda: engine.call("collective_rpc", framework_load_weights)),
    ):
        with pytest.raises(EngineError, match=f"{path}.*refused.*no MATCH|refused.*no MATCH"):
            call()
    (status,) = engine.call("collective_rpc", "isoexec_gate_status")
    assert status == {"rank": 0, "cleared": False, "last_verdict": None, "gated_loads": 0,
                      "last_fingerprint": None, "adapters": {}}  # fmt: skip

    trainer = trainer_factory(model, "float32")
    token = "t" * 32
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as server:
        tv, ev = handshake(trainer_contract(trainer, hf, "float32"), engine, "gate",
                           server=server, token=token)  # fmt: skip
        assert tv.matched and ev["outcome"] == "MATCH"
        engine.call("collective_rpc", "reload_weights")
        assert engine.call("collective_rpc", framework_load_weights) == ["loaded"]
        (status,) = engine.call("collective_rpc", "isoexec_gate_status")
    held = WeightFingerprint.of(export_hf_weights(trainer)).digest
    assert status == {"rank": 0, "cleared": True, "last_verdict": "MATCH", "gated_loads": 2,
                      "last_fingerprint": held, "adapters": {}}  # fmt: skip
    # The service is gone: the MATCH can no longer be confirmed, so the gate refuses again.
    with pytest.raises(EngineError, match="refused"):
        engine.call("collective_rpc", framework_load_weights)


def test_weight_transfer_backends_are_gated_or_refused(
    model_factory: Callable[[str, str], str], engine_pool: Callable[..., Any]
) -> None:
    """vLLM's weight-transfer backends (behind `update_weights`): those that write through the
    model's `load_weights` (IPC, NCCL, M2N: checked in their source; running them needs a GPU
    transport) pass the gate; an IsoExec engine configured with any other (sparse NCCL's
    weight patches, the sharded RDT fast path, the external modelexpress, one vLLM adds later)
    refuses to start, naming the setting. vLLM's own backend registry is left as it is."""
    import importlib

    from vllm.config import CompilationConfig, WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from isoexec.vllm.admission import refused_engine_settings
    from isoexec.vllm.weight_gate import GATED_TRANSFER_BACKENDS

    for name in ("ipc_engine", "nccl_engine", "m2n_engine"):
        src = inspect.getsource(importlib.import_module(f"vllm.distributed.weight_transfer.{name}"))
        assert ".load_weights(" in src and "param.data" not in src, name
    registered = set(WeightTransferEngineFactory._registry)
    assert set(GATED_TRANSFER_BACKENDS) < registered  # the others exist, and are refused
    engine = engine_pool(model=model_factory("tiny-dense", "float32"), dtype="float32",
                         isoexec=True, seed=11, enforce_eager=True)  # fmt: skip
    (backends,) = engine.call("collective_rpc", transfer_backends)
    assert set(backends) == registered  # an IsoExec worker does not rewrite vLLM's registry
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(quantization=None, logits_processors=[],
                                           hf_overrides=None),
        cache_config=types.SimpleNamespace(cache_dtype="auto"),
        speculative_config=None, lora_config=None, watermark_config=None,
        compilation_config=CompilationConfig(),
    )  # fmt: skip
    for name in sorted(registered | {"a-future-backend"}):
        cfg.weight_transfer_config = WeightTransferConfig(backend=name)
        refused = refused_engine_settings(cfg)
        if name in GATED_TRANSFER_BACKENDS:
            assert refused == [], (name, refused)
        else:
            assert any(f"backend {name!r}" in r for r in refused), (name, refused)


def test_stock_engine_keeps_vllms_model_class(
    model_factory: Callable[[str, str], str], engine_pool: Callable[..., Any]
) -> None:
    engine = engine_pool(model=model_factory("tiny-dense", "float32"), dtype="float32")
    assert engine.call("collective_rpc", model_is_gated) == [False]
