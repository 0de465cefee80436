"""The soak (`integration/soak.py`): a served engine and a trainer through RL steps with
requests in flight and every fault kind injected at a step drawn from a fixed seed. 30 steps
run in the default suite; the 200-step run is `-m soak` (its figures: `docs/reliability.md`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from soak import FAULTS, SoakConfig, run_soak

pytestmark = [pytest.mark.engine, pytest.mark.trainer]


def _check(report: Any, steps: int) -> None:
    print(json.dumps({"faults": report.faults, "load": report.load,
                      "resources": report.resources}, indent=1))  # fmt: skip
    assert report.passed, report.problems
    assert len(report.steps) == steps
    assert all(s["max_abs_diff"] == 0.0 for s in report.steps)
    assert sorted({f["fault"] for f in report.faults}) == sorted(FAULTS)
    assert report.load["other_version_refused"] + report.load["scored_bitwise"] > 0


def test_soak_30_steps(tmp_path: Path) -> None:
    report = run_soak(SoakConfig(steps=30, out=tmp_path))
    _check(report, 30)


@pytest.mark.soak
def test_soak_200_steps(tmp_path: Path) -> None:
    report = run_soak(SoakConfig(steps=200, out=tmp_path, faults_per_kind=3))
    _check(report, 200)
