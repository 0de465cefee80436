"""The parallel layout a side declares in its contract (`Contract.parallel`).

For each of tensor (tp), pipeline (pp), expert (ep) and data (dp) parallelism a side records
either "invariant" — its results are the canonical ones whatever its degree in that dimension —
or the degree it runs at, when its results are that degree's only. So a canonical trainer at
TP=2 x PP=2 and a canonical engine at TP=1 declare the same layout and can MATCH, while a side
whose bits depend on its layout (stock vLLM's all-reduce at TP=2, Megatron's dispatcher at
EP=2, a DDP all-reduce at DP=4) names its degree, and the diff shows `parallel.<dim>`.

One rule for both sides (`declared_layout`):
- tp: "invariant" when every site is TP-invariant (`model_contract.tp_invariant_sites`), else
  the degree (the sites that are not record it too);
- pp: always "invariant": a pipeline stage runs whole layers and hands the next stage the
  hidden state itself, so a stage boundary changes no bit (stock Megatron included);
- ep: "invariant" for a dense model (no experts) or a canonical one (the expert exchange is
  exact, `isoexec.megatron.expert_parallel`), else the degree;
- dp: "invariant" for a canonical side (forward bits are per sequence; the trainer's gradients
  are summed in one fixed tree over DP, `isoexec.megatron.grad_tree`), else the degree.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

INVARIANT = "invariant"
DIMENSIONS = ("tp", "pp", "ep", "dp")


class ParallelLayoutError(ValueError):
    """A layout entry that is neither "invariant" nor a degree >= 1."""


def _check(value: object, where: str) -> str:
    if not isinstance(value, str) or not (
        value == INVARIANT or (value.isdigit() and value[0] != "0")
    ):
        raise ParallelLayoutError(f"{where}: must be 'invariant' or a degree >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class ParallelLayout:
    """What each parallel dimension means for this side's bits (see the module doc)."""

    tp: str = "1"
    pp: str = "1"
    ep: str = "1"
    dp: str = "1"

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(getattr(self, f.name), f"parallel.{f.name}")

    def to_dict(self) -> dict[str, str]:
        return {d: getattr(self, d) for d in DIMENSIONS}

    @staticmethod
    def from_dict(obj: dict[str, Any]) -> ParallelLayout:
        if set(obj) != set(DIMENSIONS):
            raise ParallelLayoutError(
                f"parallel: expected exactly the keys {list(DIMENSIONS)}, got {sorted(obj)}"
            )
        return ParallelLayout(**{d: _check(obj[d], f"parallel.{d}") for d in DIMENSIONS})


SERIAL_LAYOUT = ParallelLayout()  # degree 1 everywhere, no invariance claimed


def declared_layout(
    *,
    all_sites_tp_invariant: bool,
    canonical: bool,
    moe: bool,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dp: int = 1,
) -> ParallelLayout:
    """The layout a side running at these degrees declares (the rule of the module doc).
    `canonical`: no site of the side is native."""
    for name, degree in (("tp", tp), ("pp", pp), ("ep", ep), ("dp", dp)):
        if type(degree) is not int or degree < 1:
            raise ParallelLayoutError(f"{name} degree must be a positive integer, got {degree!r}")
    return ParallelLayout(
        tp=INVARIANT if all_sites_tp_invariant else str(tp),
        pp=INVARIANT,
        ep=INVARIANT if canonical or not moe else str(ep),
        dp=INVARIANT if canonical else str(dp),
    )


__all__ = [
    "DIMENSIONS",
    "INVARIANT",
    "SERIAL_LAYOUT",
    "ParallelLayout",
    "ParallelLayoutError",
    "declared_layout",
]
