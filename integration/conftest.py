"""Integration fixtures: per test file, one Megatron parallel context and one trainer model per
(preset, dtype).

Engines come from the root `engine_pool` (separate processes); the trainer runs in the pytest
process; they talk over the real gRPC handshake on loopback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def megatron_context() -> Iterator[None]:
    """One test file's Megatron parallel state. Per module, not per session: Megatron's state is
    process-global and `megatron_parallel()` refuses to nest, so a context left open after its
    file would break any later test (or example) that opens its own in the same process — with
    xdist workers, whichever file comes next."""
    from isoexec.megatron import megatron_parallel

    with megatron_parallel():
        yield


@pytest.fixture(scope="module")
def trainer_factory(megatron_context: None) -> Callable[..., Any]:
    """(model_dir, dtype, isoexec, options) -> a Megatron model with the checkpoint's weights,
    cached."""
    from isoexec.contract.options import IsoExecOptions
    from isoexec.megatron import build_model, load_hf_weights

    models: dict[tuple[str, str, bool, IsoExecOptions | None], Any] = {}

    def get(
        model_dir: str,
        dtype: str,
        isoexec: bool = True,
        fresh: bool = False,
        options: IsoExecOptions | None = None,
    ) -> Any:
        key = (model_dir, dtype, isoexec, options)
        if fresh or key not in models:
            model = build_model(model_dir, isoexec=isoexec, dtype=DTYPES[dtype], options=options)
            load_hf_weights(model, model_dir)
            if fresh:
                return model
            models[key] = model
        return models[key]

    return get
