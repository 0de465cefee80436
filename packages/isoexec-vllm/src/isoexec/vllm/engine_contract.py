"""One engine worker's contract, read back from its live model and sampler.

Used by the worker extension (`isoexec_contract`, on request) and by the served handshake
(`served_handshake`, offered as soon as the worker has loaded its checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from isoexec.contract.contract import Contract
from isoexec.contract.model_contract import contract_for
from isoexec.vllm.readback import read_sites


def checkpoint_config(vllm_config: Any) -> dict[str, Any]:
    """The checkpoint's own config.json (nested as released: the contract names its layout)."""
    return json.loads((Path(vllm_config.model_config.model) / "config.json").read_text())


def worker_contract(model: torch.nn.Module, sampler: Any, vllm_config: Any) -> Contract:
    """The contract of the model and sampler this worker runs, at its parallel degrees."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    hf = checkpoint_config(vllm_config)
    sites = read_sites(model, sampler, hf)
    dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    # The TP degree this worker runs at: a site that does not claim TP invariance (a
    # row-parallel site reduced by vLLM's all-reduce) records it, so it never MATCHes a peer
    # at another degree.
    tp = get_tensor_model_parallel_world_size()
    par = vllm_config.parallel_config  # PP/DP/EP > 1 are refused at construction
    ep = tp * par.data_parallel_size if par.enable_expert_parallel else 1
    return contract_for(
        hf, dtype, sites, tp_size=tp, pp_size=par.pipeline_parallel_size, ep_size=ep,
        dp_size=par.data_parallel_size,
    )  # fmt: skip


__all__ = ["checkpoint_config", "worker_contract"]
