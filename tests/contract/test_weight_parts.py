"""A model fingerprinted or published in parts (trainer ranks that each hold part of it: PP
stages, EP experts) gives the same fingerprint as the whole in one place; a weight in two
parts, a part without its digests and malformed digests are refused."""

from __future__ import annotations

import pytest
import torch

from isoexec.contract.fingerprint import WeightFingerprint, tensor_digest
from isoexec.ray.weights import WeightManifest, WeightTransferError, merge

WEIGHTS = {
    "model.embed_tokens.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(2, 2, dtype=torch.bfloat16),
    "model.layers.1.self_attn.q_proj.weight": torch.full((2, 3), -0.5),
    "lm_head.weight": torch.eye(3),
}


def _part(names: list[str], tag: str) -> WeightManifest:
    digests = {n: tensor_digest(n, WEIGHTS[n]) for n in names}
    nbytes = sum(WEIGHTS[n].numel() * WEIGHTS[n].element_size() for n in names)
    fp = WeightFingerprint.from_digests(digests).digest
    return WeightManifest(fp, (f"ref-{tag}",), (tuple(names),), nbytes, digests)


def test_digests_computed_apart_give_the_whole_fingerprint() -> None:
    whole = WeightFingerprint.of(WEIGHTS)
    apart = WeightFingerprint.from_digests({n: tensor_digest(n, t) for n, t in WEIGHTS.items()})
    assert apart.digest == whole.digest and apart.tensors == whole.tensors


def test_merged_parts_carry_the_whole_models_fingerprint() -> None:
    names = list(WEIGHTS)
    parts = [_part(names[:1], "a"), _part(names[1:3], "b"), _part(names[3:], "c")]
    merged = merge(parts)
    assert merged.fingerprint == WeightFingerprint.of(WEIGHTS).digest
    assert merged.chunks == ("ref-a", "ref-b", "ref-c") and merged.count == 4
    assert merged.nbytes == sum(p.nbytes for p in parts)
    # negative control: one part alone (what rank 0 alone published before) is another model
    assert parts[0].fingerprint != merged.fingerprint
    empty = WeightManifest(WeightFingerprint.from_digests({}).digest, (), (), 0, {})
    assert merge([*parts, empty]).fingerprint == merged.fingerprint  # a rank owning nothing


def test_a_weight_in_two_parts_or_a_part_without_digests_is_refused() -> None:
    names = list(WEIGHTS)
    with pytest.raises(WeightTransferError, match="published by two trainer ranks"):
        merge([_part(names[:2], "a"), _part(names[1:], "b")])
    bare = WeightManifest("0" * 64, ("ref",), (tuple(names[:1]),), 48)
    with pytest.raises(WeightTransferError, match="without its per-tensor digests"):
        merge([bare])


@pytest.mark.parametrize("digest", ["", "abc", 7, "0" * 63])
def test_malformed_digests_are_refused(digest: object) -> None:
    with pytest.raises(ValueError, match="64 hex digits"):
        WeightFingerprint.from_digests({"w": digest})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="non-empty string"):
        WeightFingerprint.from_digests({"": "0" * 64})
