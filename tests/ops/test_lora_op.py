"""Canonical LoRA op: a row's bits depend on itself and its own adapter only; padding, scaling
and the zero-B rule are what the engine's stacked buffers and the trainer's parameters give."""

from __future__ import annotations

import pytest
import torch

from isoexec.ops import (
    fold_scaling,
    get_impl,
    lora_apply,
    lora_apply_by_slot,
    lora_expand_by_slot,
    pad_rank,
)

K, R = 96, 16
WIDTHS = [64, 32, 32]  # q, k, v


def _adapter(seed: int, rank: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in WIDTHS:
        a = torch.randn(rank, K, generator=g).to(dtype)
        b = fold_scaling(torch.randn(n, rank, generator=g).to(dtype), 2.0)
        out.append(pad_rank(a, b, R))
    return out


def _stack(adapters: list[list[tuple[torch.Tensor, torch.Tensor]]]):
    """vLLM's stacked buffers: per slice [slots, 1, R, K] and [slots, 1, N, R]."""
    a = [torch.stack([ad[i][0] for ad in adapters]).unsqueeze(1) for i in range(len(WIDTHS))]
    b = [torch.stack([ad[i][1] for ad in adapters]).unsqueeze(1) for i in range(len(WIDTHS))]
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_co_batched_rows_equal_each_adapter_alone(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    m = 45  # more than one row block
    x = torch.randn(m, K, generator=g).to(dtype)
    base = torch.randn(m, sum(WIDTHS), generator=g).to(dtype)
    ads = [_adapter(1, 8, dtype), _adapter(2, 4, dtype)]
    slots = torch.randint(-1, 2, (m,), generator=g)
    a, b = _stack(ads)
    mixed = lora_apply_by_slot(base, x, slots, a, b, WIDTHS)
    for s in (-1, 0, 1):
        rows = (slots == s).nonzero().flatten()
        alone = base[rows] if s == -1 else lora_apply(base[rows], x[rows], ads[s], WIDTHS)
        assert torch.equal(mixed[rows], alone)
        for r in rows[:3]:  # and one row by itself
            one = base[r : r + 1] if s == -1 else lora_apply(base[r : r + 1], x[r : r + 1],
                                                              ads[s], WIDTHS)  # fmt: skip
            assert torch.equal(mixed[r : r + 1], one)
    assert not torch.equal(mixed[slots == 0], base[slots == 0])  # the adapter did something


def test_an_unpadded_stock_formula_differs() -> None:
    """Negative control: PEFT's own formula (scaling after the product, fp32 F.linear) does
    not give the canonical bits for every row."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, K, generator=g)
    a = torch.randn(8, K, generator=g)
    b = torch.randn(WIDTHS[0], 8, generator=g)
    base = torch.zeros(200, WIDTHS[0])
    canonical = lora_apply(base, x, [pad_rank(a, fold_scaling(b, 0.37), R)], WIDTHS[:1])
    peft = torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * 0.37
    assert not torch.equal(canonical, peft)
    torch.testing.assert_close(canonical, peft, rtol=1e-4, atol=1e-4)


def test_zero_b_adds_nothing_and_pad_rank_checks() -> None:
    x = torch.randn(5, K)
    base = torch.randn(5, sum(WIDTHS)) * 0  # -0.0 and +0.0 stay as they are
    base[0, 0] = -0.0
    zero = [(torch.randn(R, K), torch.zeros(n, R)) for n in WIDTHS]
    out = lora_apply(base, x, zero, WIDTHS)
    assert out is base
    with pytest.raises(ValueError, match="exceeds the padded rank"):
        pad_rank(torch.zeros(R + 1, K), torch.zeros(4, R + 1), R)
    with pytest.raises(ValueError, match="do not tile"):
        lora_apply(base, x, zero, [1, 2, 3])


def test_embedding_expand_by_slot_is_per_row() -> None:
    g = torch.Generator().manual_seed(4)
    h = torch.randn(20, R, generator=g)
    base = torch.randn(20, 48, generator=g)
    b = torch.randn(2, 1, 48, R, generator=g)
    b[1] = 0  # an adapter that does not target the embedding
    slots = torch.tensor([0, 1, -1, 0] * 5)
    out = lora_expand_by_slot(base, h, slots, b)
    assert torch.equal(out[slots != 0], base[slots != 0])
    rows = (slots == 0).nonzero().flatten()
    assert torch.equal(out[rows[:1]], lora_expand_by_slot(base[rows[:1]], h[rows[:1]],
                                                           torch.tensor([0]), b))  # fmt: skip


def test_the_contract_records_the_padded_rank() -> None:
    assert get_impl("lora", rank=16) != get_impl("lora", rank=8)
    assert get_impl("lora").param_dict()["scaling"] == "folded-into-b"


def test_adapter_fingerprint_covers_the_config_and_the_tensors() -> None:
    """The same tensors under another alpha are another adapter (vLLM folds alpha / r into B)."""
    from isoexec.contract.adapter import SUPPORTED_TARGETS, AdapterConfig, adapter_fingerprint
    from isoexec.tools.tiny_lora import LORA_TARGETS

    assert set(LORA_TARGETS) == set(SUPPORTED_TARGETS)
    t = {"a": torch.ones(2, 3)}
    base = AdapterConfig(rank=8, alpha=16.0, targets=("q_proj",))
    fp = adapter_fingerprint(t, base)
    assert fp == adapter_fingerprint({"a": torch.ones(2, 3)}, base)
    assert fp != adapter_fingerprint(t, AdapterConfig(rank=8, alpha=32.0, targets=("q_proj",)))
    assert fp != adapter_fingerprint({"a": torch.full((2, 3), 2.0)}, base)
    assert AdapterConfig(8, 16.0, ("q_proj",), use_rslora=True).scaling == 16.0 / 8**0.5


def test_served_weights_fingerprint_folds_the_adapter_into_the_weights() -> None:
    """Base alone: the base's fingerprint unchanged; base + adapter: another digest for each
    adapter (and for each base); a digest that is not one is refused."""
    from isoexec.contract.adapter import served_weights_fingerprint

    base, other_base, a, b = ("0" * 64), ("1" * 64), ("a" * 64), ("b" * 64)
    assert served_weights_fingerprint(base, None) == base
    served = {served_weights_fingerprint(w, x) for w in (base, other_base) for x in (a, b)}
    assert len(served) == 4 and base not in served
    with pytest.raises(ValueError, match="adapter fingerprint"):
        served_weights_fingerprint(base, "not-a-digest")
