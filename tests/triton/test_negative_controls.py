"""Negative controls: the invariance checks can fail. A kernel whose structure depends on M
(an autotuner picking BLOCK_K by batch size), a split-K GEMM, another KV tile, another vocab
tile or a slot-order MoE sum gives different bits, so the bitwise checks are not blind.

Elementwise kernels (rope, silu_mul) have no reduction order to get wrong: no control.
"""

from __future__ import annotations

import torch
from _triton_testlib import DEVICE, kernel_marks

pytestmark = kernel_marks()

from isoexec.ops import triton as xops  # noqa: E402
from isoexec.ops.triton import gemm as xgemm  # noqa: E402
from isoexec.ops.triton import moe as xmoe  # noqa: E402
from isoexec.ops.triton.selfcheck_harness import row_mismatches  # noqa: E402


def _x(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def test_m_dependent_tiles_break_row_invariance() -> None:
    w = _x(48, 200, seed=1)

    def autotuned(x: torch.Tensor) -> torch.Tensor:  # the config an autotuner keys on M
        return xgemm.linear(x, w, block_k=16 if x.shape[0] < 8 else 64)

    def gen(m: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (torch.randn(m, 200, generator=g).to(DEVICE),)

    assert row_mismatches(autotuned, gen, (1, 2, 7, 33)), "control did not differ"
    assert not row_mismatches(lambda x: xgemm.linear(x, w), gen, (1, 2, 7, 33))


def test_split_k_gives_different_bits() -> None:
    x, w = _x(16, 256, seed=2), _x(32, 256, seed=3)
    one_pass = xgemm.gemm(x, w)
    halves = xgemm.gemm(x[:, :128], w[:, :128]) + xgemm.gemm(x[:, 128:], w[:, 128:])
    assert not torch.equal(one_pass, halves)
    torch.testing.assert_close(one_pass, halves)


def test_kv_tile_is_part_of_the_bits() -> None:
    # fp32: a bf16 output's rounding can absorb the last-bit difference
    q, k, v = _x(40, 2, 16, seed=4), _x(40, 1, 16, seed=5), _x(40, 1, 16, seed=6)
    cu = torch.tensor([0, 40], device=DEVICE)
    a = xops.attention_varlen(q, k, v, cu, scale=0.25, kv_tile=16)
    b = xops.attention_varlen(q, k, v, cu, scale=0.25, kv_tile=8)
    assert not torch.equal(a, b)


def test_vocab_tile_is_part_of_the_bits() -> None:
    x = _x(8, 3000, seed=7) * 4
    ids = torch.arange(8, device=DEVICE)
    a = xops.token_logprobs(x, ids, vocab_tile=1024)
    b = xops.token_logprobs(x, ids, vocab_tile=128)
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b)


def test_slot_order_sum_depends_on_slot_order() -> None:
    t, k, h = 64, 4, 32
    y = _x(t, k, h, seed=8)
    w = torch.softmax(_x(t, k, seed=9), -1)
    ids = torch.stack(
        [torch.randperm(16, generator=torch.Generator().manual_seed(i))[:k] for i in range(t)]
    ).to(DEVICE)
    perm = torch.tensor([2, 0, 3, 1], device=DEVICE)
    naive = (w[..., None] * y).sum(1)
    naive_p = (w[:, perm, None] * y[:, perm]).sum(1)
    assert not torch.equal(naive, naive_p), "control did not differ"
    fixed = xmoe.moe_weighted_sum(y, w, ids)
    assert torch.equal(fixed, xmoe.moe_weighted_sum(y[:, perm], w[:, perm], ids[:, perm]))
