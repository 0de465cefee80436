"""Suite-wide fixtures: tiny local checkpoints (never downloaded) and clean shutdown."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from isoexec.contract.tiny_models import make_tiny_model


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Turn SIGTERM (CI timeout, Ctrl-C of a parent) into SystemExit so every `finally`, fixture
    # teardown and atexit hook runs: that is what shuts engines down.
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, _exit_on_sigterm)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def model_factory(models_dir: Path) -> Callable[[str, str], str]:
    """(preset, dtype) -> checkpoint dir, each made once per session."""
    made: dict[tuple[str, str], str] = {}

    def get(preset: str, dtype: str = "float32") -> str:
        key = (preset, dtype)
        if key not in made:
            made[key] = str(make_tiny_model(preset, models_dir / f"{preset}-{dtype}", dtype=dtype))
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_dense_dir(model_factory: Callable[[str, str], str]) -> str:
    return model_factory("tiny-dense", "float32")


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[Callable[..., Any]]:
    """Engines shared by the whole session, one per distinct `EngineConfig`.

    Starting an engine costs 10-30 s, so tests share them; all are shut down at the end of the
    session (and by the engine module's atexit hook if the session dies).
    """
    from isoexec.vllm.engine_process import EngineConfig, EngineProcess

    engines: dict[EngineConfig, EngineProcess] = {}

    def get(**kwargs: Any) -> EngineProcess:
        cfg = EngineConfig(**kwargs)
        if cfg not in engines:
            engines[cfg] = EngineProcess(cfg)
        return engines[cfg]

    try:
        yield get
    finally:
        for eng in engines.values():
            eng.close()
