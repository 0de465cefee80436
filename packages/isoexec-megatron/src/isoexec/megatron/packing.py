"""Packing sequences into one Megatron forward: which sequences share a forward (`packs`), and
the packed inputs with the rows that predict each next token (`pack_sequences`).

Why its own module: `scoring` (forward only) and `train_step` (micro-batches of a global
batch) pack the same way, and the bits of a sequence's logprobs must not depend on it; every
canonical op is row-invariant, so they do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def split_into_packs(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """Greedy split of sequence indices (in order) into packs of <= max_tokens tokens."""
    if max_tokens is None:
        return [list(range(len(lengths)))]
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    packs: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and used + n > max_tokens:
            packs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        packs.append(cur)
    return packs


@dataclass(frozen=True)
class Pack:
    """One packed forward's inputs, and which logit rows predict which next token."""

    inputs: dict[str, Any]
    length: int
    rows: torch.Tensor
    nxt: torch.Tensor
    lens: list[int]


def pack_sequences(
    model: torch.nn.Module, seqs: list[torch.Tensor], pad_to_multiple: int | None
) -> Pack:
    """Pack `seqs` into one [1, T] batch (padding, if asked, is one extra dummy sequence of
    token 0 at the end, so it is its own attention segment)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    device = next(model.parameters()).device
    lens = [int(s.numel()) for s in seqs]
    total = sum(lens)
    pad = 0
    if pad_to_multiple is not None:
        if pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
        pad = -total % pad_to_multiple
    parts = list(seqs) + ([torch.zeros(pad, dtype=torch.int64)] if pad else [])
    bounds = lens + ([pad] if pad else [])
    cu = torch.tensor([0, *torch.tensor(bounds).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.cat(parts).to(device)
    positions = torch.cat([torch.arange(n) for n in bounds]).to(device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu.to(device),
        cu_seqlens_kv=cu.to(device),
        max_seqlen_q=max(bounds),
        max_seqlen_kv=max(bounds),
    )
    # Rows predicting a next token of the same sequence, and that token.
    rows = torch.cat([torch.arange(s, s + n - 1) for s, n in zip(cu.tolist(), lens, strict=False)])
    nxt = torch.cat([torch.arange(s + 1, s + n) for s, n in zip(cu.tolist(), lens, strict=False)])
    inputs = {
        "input_ids": ids.unsqueeze(0),
        "position_ids": positions.unsqueeze(0),
        "attention_mask": None,
        "packed_seq_params": params,
    }
    return Pack(inputs, int(ids.numel()), rows.to(device), ids[nxt.to(device)], lens)


__all__ = ["Pack", "pack_sequences", "split_into_packs"]
