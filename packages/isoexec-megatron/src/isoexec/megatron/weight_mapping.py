"""One Megatron parameter ⇄ its checkpoint tensors: the mapping record and the identity
transforms (`weights` and `weights_gdn` build the lists)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter ⇄ its HF tensors, with the (pure reshuffle) layout transforms."""

    megatron_name: str
    hf_names: tuple[str, ...]
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def identity_in(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def identity_out(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]
