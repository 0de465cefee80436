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
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _worker_paths import framework_load_weights, model_is_gated, transfer_backends

# The stand-in framework extension: the engine process imports it by qualname.
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "_support"))

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


def test_a_composed_framework_extension_is_gated_and_staging_checks_the_whole_set(
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
) -> None:
    """`compose(FrameworkExtension)`: the framework's own weight update (straight into the
    model's `load_weights`) is refused before MATCH and goes through after it, as IsoExec's
    own; the framework's other methods work. Staged transfers (`isoexec_stage_weights` /
    `isoexec_commit_weights`, what `isoexec.ray` uses) load only the whole set that hashes to the
    trainer's fingerprint: a wrong fingerprint or a name sent twice loads nothing. An IsoExec
    engine given an extension without IsoExec's refuses to start."""
    from isoexec.handshake.server import HandshakeServer

    model = model_factory("tiny-dense", "float32")
    hf = json.loads((Path(model) / "config.json").read_text())
    with pytest.raises(EngineError, match=r"does not include IsoExec's.*compose"):
        engine_pool(model=model, dtype="float32", isoexec=True, enforce_eager=True,
                    worker_extension="foreign_extension.FrameworkExtension")  # fmt: skip
    engine = engine_pool(model=model, dtype="float32", isoexec=True, seed=12, enforce_eager=True,
                         worker_extension="foreign_extension.Extension")  # fmt: skip
    assert engine.call("collective_rpc", "framework_ping") == ["pong"]
    trainer = trainer_factory(model, "float32")
    named = list(export_hf_weights(trainer))
    with pytest.raises(EngineError, match=r"refused.*no MATCH"):
        engine.call("collective_rpc", "update_weights_from_tensors", (named,))
    with pytest.raises(EngineError, match=r"refused.*no MATCH"):
        engine.call("stage_weights", dict(named[:2]))
    held = engine.call("weight_fingerprint")
    token = "t" * 32
    with HandshakeServer({"trainer": 1, "engine": 1}, token) as server:
        tv, ev = handshake(trainer_contract(trainer, hf, "float32"), engine, "compose",
                           server=server, token=token)  # fmt: skip
        assert tv.matched and ev["outcome"] == "MATCH"
        assert engine.call("collective_rpc", "update_weights_from_tensors", (named,)) == [
            len(named)]  # fmt: skip
        changed = {k: v + 1 if i == 0 else v for i, (k, v) in enumerate(named)}
        engine.call("stage_weights", changed)
        with pytest.raises(EngineError, match=r"received weights hash to.*nothing loaded"):
            engine.call("commit_weights", WeightFingerprint.of(named).digest)
        engine.call("stage_weights", dict(named[:1]))
        with pytest.raises(EngineError, match="arrived twice"):
            engine.call("stage_weights", dict(named[:2]))
        with pytest.raises(EngineError, match="no weights were staged"):
            engine.call("commit_weights", WeightFingerprint.of(named).digest)
        assert engine.call("weight_fingerprint") == held  # nothing of the refused sets loaded
        for i in range(0, len(named), 3):
            engine.call("stage_weights", dict(named[i : i + 3]))
        digest = WeightFingerprint.of(named).digest
        assert engine.call("commit_weights", digest) == [digest]
        (status,) = engine.call("collective_rpc", "isoexec_gate_status")
    assert status["gated_loads"] == 2 and status["last_fingerprint"] == digest
