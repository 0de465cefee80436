"""The engine's live weights, in HF names, hash exactly like the checkpoint it loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from isoexec.contract.fingerprint import WeightFingerprint

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-gdn"])
def test_engine_fingerprint_equals_checkpoint(
    preset: str, model_factory: Callable[[str, str], str], engine_pool: Callable[..., Any]
) -> None:
    model = model_factory(preset, "float32")
    expected = WeightFingerprint.of(load_file(str(Path(model) / "model.safetensors")))
    eng = engine_pool(model=model, isoexec=True)
    assert eng.call("weight_fingerprint") == [expected.digest]
