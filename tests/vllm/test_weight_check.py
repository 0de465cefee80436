"""`weight_check`: a transfer must be the model's own tensor set, finite unless allowed."""

from __future__ import annotations

import pytest
import torch

from isoexec.vllm.weight_check import check_transfer, expected_specs
from isoexec.vllm.weight_gate import WeightSyncRefusedError

MODEL = {"a.weight": torch.zeros(4, 3), "b.bias": torch.zeros(3, dtype=torch.bfloat16)}


def test_the_models_own_set_passes() -> None:
    check_transfer({k: v + 1 for k, v in MODEL.items()}, expected_specs(MODEL))


@pytest.mark.parametrize(
    ("received", "why"),
    [
        ({"a.weight": torch.zeros(4, 3)}, r"1 tensor\(s\) missing: \['b.bias'\]"),
        ({**MODEL, "c": torch.zeros(1)}, r"the model does not have: \['c'\]"),
        ({**MODEL, "a.weight": torch.zeros(3, 4)}, r"a.weight \(3, 4\) torch.float32"),
        ({**MODEL, "b.bias": torch.zeros(3)}, r"b.bias \(3,\) torch.float32 \(the model's"),
        ({**MODEL, "a.weight": torch.full((4, 3), float("inf"))}, r"NaN or Inf: \['a.weight'\]"),
    ],
)
def test_each_departure_is_refused_by_name(received: dict, why: str) -> None:
    with pytest.raises(WeightSyncRefusedError, match=why + ".*nothing loaded"):
        check_transfer(received, expected_specs(MODEL))


def test_nonfinite_values_pass_only_when_allowed() -> None:
    nan = {**MODEL, "a.weight": torch.full((4, 3), float("nan"))}
    check_transfer(nan, expected_specs(MODEL), allow_nonfinite=True)
    ints = {**MODEL, "i": torch.zeros(2, dtype=torch.int64)}
    check_transfer(ints, expected_specs(ints))  # integer tensors have no NaN to check
