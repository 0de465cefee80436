"""`isoexec contract write --side trainer`: the contract a trainer would offer for a model,
written to a file (for `isoexec handshake offer`, `isoexec contract diff`), without Python."""

from __future__ import annotations

from pathlib import Path

import torch

from isoexec.contract.contract import Contract
from isoexec.contract.options import IsoExecOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write(model_dir: str, out: str | Path, dtype: str, options: IsoExecOptions) -> Contract:
    """Build the IsoExec model for `model_dir` (no weights needed: a contract describes what
    runs, read back from the built modules) and save its contract to `out`."""
    from isoexec.megatron import build_model, megatron_parallel, trainer_contract

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; known: {', '.join(DTYPES)}")
    with megatron_parallel():
        model = build_model(model_dir, isoexec=True, dtype=DTYPES[dtype], options=options,
                            initialize=False)  # fmt: skip
        contract = trainer_contract(model, model_dir, dtype)
    contract.save(out)
    return contract


__all__ = ["write"]
