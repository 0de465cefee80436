"""The GRPO example runs in CI (a short version): ratio exactly 1 with IsoExec, not without."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_toy.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_toy", EXAMPLE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_grpo_isoexec_ratio_is_exactly_one_every_step(tmp_path: Path) -> None:
    ex = _example()
    logs = ex.run(ex.GRPORun(arm="isoexec", steps=3, out=tmp_path))
    assert [log.step for log in logs] == [0, 1, 2]
    assert all(log.ratio_exactly_one and log.ratio_max_dev == 0.0 for log in logs), logs
    assert all(log.staleness == 0 and log.behaviour_max_diff == 0.0 for log in logs), logs
    assert all(log.tokens > 0 for log in logs)


def test_grpo_async_scores_each_batch_under_its_behaviour_weights_exactly(tmp_path: Path) -> None:
    """`--async 1`: batch k+1 is sampled while the trainer steps on batch k, one version behind.
    The engine's logprobs equal the trainer's scoring under the behaviour version bitwise; the
    ratio π_θ/π_behaviour is then off 1 by the real policy change, not by kernels."""
    ex = _example()
    logs = ex.run(ex.GRPORun(arm="isoexec", steps=3, out=tmp_path, asynchronous=1))
    assert [(log.staleness, log.behaviour_version) for log in logs] == [(0, 0), (1, 0), (1, 1)]
    assert all(log.behaviour_max_diff == 0.0 for log in logs), logs
    assert logs[0].ratio_exactly_one
    assert all(log.ratio_max_dev > 0.0 for log in logs[1:]), logs  # stale: a real ratio


def test_grpo_stock_arm_ratio_spreads(tmp_path: Path) -> None:
    ex = _example()
    (log,) = ex.run(ex.GRPORun(arm="stock", steps=1, out=tmp_path))
    print("stock arm ratio spread:", log.ratio_max_dev)
    assert not log.ratio_exactly_one and 0.0 < log.ratio_max_dev < 1e-2
    assert log.behaviour_max_diff > 0.0  # the engine's logprobs are not the trainer's
