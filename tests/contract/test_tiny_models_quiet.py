"""Making a tiny checkpoint prints nothing of transformers' own (the "Writing model shards" bar
was noise in every `isoexec pair` run), and leaves transformers' progress-bar setting as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from isoexec.tools.tiny_models import make_tiny_model


def test_tiny_model_is_written_without_a_progress_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    out = make_tiny_model("tiny-dense", tmp_path / "m")
    captured = capfd.readouterr()
    assert "Writing model shards" not in captured.err + captured.out
    assert (out / "config.json").exists() and list(out.glob("*.safetensors"))
    assert hf_logging.is_progress_bar_enabled()  # restored for the caller
