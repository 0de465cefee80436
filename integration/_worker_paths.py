"""Functions run inside an engine worker (`EngineProcess.call("collective_rpc", fn)`): the
weight paths an RL framework's own worker code would take."""

from __future__ import annotations

from typing import Any

import torch


def framework_load_weights(worker: Any) -> str:
    """What a framework's worker extension does: `model.load_weights` with one HF tensor (the
    final norm, unchanged values)."""
    model = worker.model_runner.model
    weight = dict(model.named_parameters())["model.norm.weight"].detach().clone()
    with torch.no_grad():
        model.load_weights([("model.norm.weight", weight)])
    return "loaded"


def model_is_gated(worker: Any) -> bool:
    from isoexec.vllm.weight_gate import GatedLoadWeights

    return isinstance(worker.model_runner.model, GatedLoadWeights)


def transfer_backends(worker: Any) -> dict[str, str]:
    """Each registered weight-transfer backend: "ok" if vLLM would create it, else the error."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    out = {}
    for name, loader in WeightTransferEngineFactory._registry.items():
        try:
            loader()
            out[name] = "ok"
        except Exception as e:  # an uninstalled optional backend raises ImportError
            out[name] = f"{type(e).__name__}: {e}"
    return out
