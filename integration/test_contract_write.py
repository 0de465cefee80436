"""`isoexec contract write`: the contract each side offers for a model, as a file, without
Python — then `isoexec contract diff` on the two. A real engine is started (and stopped) for
the engine side; the trainer side builds the Megatron model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from isoexec.contract.contract import Contract
from isoexec.tools.cli import main

pytestmark = [pytest.mark.engine, pytest.mark.trainer]


def test_both_sides_write_the_contract_they_offer_and_the_files_diff_equal(
    tmp_path: Path, model_factory: Callable[[str, str], str], capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_factory("tiny-dense", "float32")
    trainer, engine, bf16 = tmp_path / "t.json", tmp_path / "e.json", tmp_path / "t16.json"
    assert main(["contract", "write", "--model", model, "--side", "trainer", str(trainer)]) == 0
    assert main(["contract", "write", "--model", model, "--side", "engine", str(engine)]) == 0
    out = capsys.readouterr().out
    assert f"trainer contract {Contract.load(trainer).hash} written" in out
    assert main(["contract", "diff", str(trainer), str(engine)]) == 0  # what a MATCH compares
    # Negative control: another dtype on one side is another contract, named in the diff.
    assert main(["contract", "write", "--model", model, "--side", "trainer", "--dtype",
                 "bfloat16", str(bf16)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["contract", "diff", str(bf16), str(engine)]) == 1
    assert "dtypes.params" in capsys.readouterr().out


def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "no-such-model")
    assert main(["contract", "write", "--model", missing, "--side", "trainer", "x.json"]) == 2
    assert "isoexec contract: error:" in capsys.readouterr().err
