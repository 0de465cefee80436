"""`isoexec pair` reports a stock arm that cannot run (stock vLLM-CPU's own GDN kernel asserts
bf16: measured with tiny-qwen35-moe in fp32) in its table and JSON instead of crashing; an
isoexec arm that fails still raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from isoexec.tools import pair
from isoexec.tools.pair_report import format_table
from isoexec.vllm.engine_process import EngineError

UPSTREAM = (
    "Traceback ...\n  File gdn_attention.py\nAssertionError: CPU GDN attention requires BF16.\n"
)


def _run(out: Path) -> pair.PairRun:
    return pair.PairRun("/m", "float32", num_prompts=2, max_tokens=2, out=out)


def test_failed_stock_arm_is_reported_and_isoexec_failure_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise EngineError(UPSTREAM)

    monkeypatch.setattr(pair, "run_arm", failing)
    stock = pair._run_named_arm(_run(tmp_path), "stock")
    assert stock.error == "AssertionError: CPU GDN attention requires BF16."
    assert stock.tokens == 0
    assert "stock    failed: AssertionError: CPU GDN attention requires BF16." in format_table(
        "m", "float32", [stock]
    )
    with pytest.raises(EngineError, match="requires BF16"):
        pair._run_named_arm(_run(tmp_path), "isoexec")
