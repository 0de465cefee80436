"""What a weight transfer must be before a worker loads any of it: the model's own tensor set.

The fingerprint says the transfer is what the trainer sent; it cannot say the trainer sent
something this engine can hold. A tensor with a name the model lacks, one missing, one of
another shape or dtype, or one holding NaN or Inf would load partly, fail half-way or poison
every later sample. Each is refused here, before the first write, naming the tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from isoexec.vllm.weight_gate import WeightSyncRefusedError


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype)


def expected_specs(weights: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec.of(t) for name, t in weights.items()}


def nbytes(expected: Mapping[str, TensorSpec]) -> int:
    """The bytes of the whole set."""
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in expected.values())


def check_transfer(
    received: Mapping[str, torch.Tensor],
    expected: Mapping[str, TensorSpec],
    *,
    allow_nonfinite: bool = False,
) -> None:
    """`WeightSyncRefusedError` naming every problem (up to a few names each), or None."""
    problems: list[str] = []
    unknown = sorted(set(received) - set(expected))
    missing = sorted(set(expected) - set(received))
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) the model does not have: {unknown[:3]}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {missing[:3]}")
    wrong = [
        f"{n} {tuple(received[n].shape)} {received[n].dtype} (the model's: "
        f"{expected[n].shape} {expected[n].dtype})"
        for n in sorted(set(received) & set(expected))
        if TensorSpec.of(received[n]) != expected[n]
    ]
    if wrong:
        problems.append(f"{len(wrong)} of another shape or dtype: {wrong[:3]}")
    if not allow_nonfinite:
        bad = sorted(n for n, t in received.items()
                     if t.is_floating_point() and not bool(torch.isfinite(t).all()))  # fmt: skip
        if bad:
            problems.append(f"{len(bad)} holding NaN or Inf: {bad[:3]}")
    if problems:
        raise WeightSyncRefusedError(
            "weight sync refused: " + "; ".join(problems) + "; nothing loaded"
        )


__all__ = ["TensorSpec", "check_transfer", "expected_specs", "nbytes"]
