"""The vLLM engine arguments an IsoExec engine needs, defined once.

The engine harness (`EngineProcess`) passes them to `LLM(...)`, `isoexec engine serve` turns
them into the OpenAI server's flags, and a framework that builds vLLM itself (SkyRL's, veRL's
`engine_init_kwargs`) merges them into its own, with `ISOEXEC=1` in the engine's environment:
one list, so the three cannot drift apart.
"""

from __future__ import annotations

import json
from typing import Any

from isoexec.contract.options import VLLM_ADDITIONAL_CONFIG_KEY, IsoExecOptions
from isoexec.handshake.served import HANDSHAKE_CONFIG_KEY

# Strings, so that neither the launcher nor a framework's driver imports vLLM to name them.
WORKER_EXTENSION = "isoexec.vllm.worker_extension.IsoWorkerExtension"
ADMISSION = "isoexec.vllm.admission:IsoAdmission"  # the allow-list, checked at admission
MIDDLEWARE = "isoexec.vllm.served_routes.isoexec_routes"  # the OpenAI server's routes
# The canonical GDN state is fp32; vLLM-CPU picks fp32 itself only on CPUs with AVX512-BF16
# (elsewhere a bf16 model's state would be bf16, which the GDN site refuses).
GDN_STATE_DTYPE = "float32"


def isoexec_engine_kwargs(
    options: IsoExecOptions | None = None,
    *,
    handshake: dict[str, Any] | None = None,
    worker_extension: str | None = None,
) -> dict[str, Any]:
    """vLLM `EngineArgs` fields: the worker extension (IsoExec's, or one `compose`d with it),
    the logprobs mode the options record, the options in `additional_config` (and the
    handshake to offer at load, if given), the admission check, the GDN state dtype."""
    options = options or IsoExecOptions()
    extra: dict[str, Any] = {VLLM_ADDITIONAL_CONFIG_KEY: options.to_dict()}
    if handshake is not None:
        extra[HANDSHAKE_CONFIG_KEY] = handshake
    return {
        "worker_extension_cls": worker_extension or WORKER_EXTENSION,
        "logprobs_mode": options.logprobs_mode,
        "additional_config": extra,
        "logits_processors": [ADMISSION],
        "mamba_ssm_cache_dtype": GDN_STATE_DTYPE,
    }


def as_server_flags(kwargs: dict[str, Any]) -> list[str]:
    """The same as the OpenAI server's command-line flags, plus IsoExec's routes
    (`--middleware`), which only the server has."""
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif isinstance(value, list):
            for v in value:
                flags += [flag, str(v)]
        else:
            flags += [flag, str(value)]
    return [*flags, "--middleware", MIDDLEWARE]


__all__ = [
    "ADMISSION",
    "GDN_STATE_DTYPE",
    "MIDDLEWARE",
    "WORKER_EXTENSION",
    "as_server_flags",
    "isoexec_engine_kwargs",
]
