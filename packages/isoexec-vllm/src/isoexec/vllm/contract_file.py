"""`isoexec contract write --side engine`: the contract an IsoExec engine offers for a model,
read back from a real engine started for it (then stopped), written to a file."""

from __future__ import annotations

from pathlib import Path

from isoexec.contract.contract import Contract
from isoexec.contract.options import IsoExecOptions


def write(model_dir: str, out: str | Path, dtype: str, options: IsoExecOptions) -> Contract:
    from isoexec.vllm.engine_process import EngineConfig, EngineProcess

    config = EngineConfig(model=model_dir, dtype=dtype, isoexec=True, options=options)
    with EngineProcess(config) as engine:
        contract = Contract.from_bytes(engine.call("contract"))
    contract.save(out)
    return contract


__all__ = ["write"]
