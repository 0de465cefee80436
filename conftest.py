"""Suite-wide fixtures: tiny local checkpoints (never downloaded) and clean shutdown."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

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
def tiny_dense_dir(models_dir: Path) -> Iterator[str]:
    yield str(make_tiny_model("tiny-dense", models_dir / "tiny-dense"))
