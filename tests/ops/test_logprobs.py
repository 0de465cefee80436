"""logprobs: row invariance, temperature, vocab-parallel TP invariance, accuracy, grad."""

from __future__ import annotations

import pytest
import torch
from _ops_testlib import assert_grads_match_float64, assert_row_invariant, assert_row_variant

from isoexec.ops import log_softmax, token_logprobs, token_logprobs_vocab_parallel

V = 1000


def _gen(dtype):
    def gen(m, g):
        return (torch.randn(m, V, generator=g) * 4).to(dtype), torch.randint(
            0, V, (m,), generator=g
        )

    return gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_row_invariant(dtype, temperature):
    assert_row_invariant(lambda x, i: token_logprobs(x, i, temperature=temperature), _gen(dtype))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_parallel_row_and_tp_invariant(temperature):
    def fn(tp):
        return lambda x, i: token_logprobs_vocab_parallel(
            list(x.chunk(tp, -1)), i, leaves=8, temperature=temperature
        )

    assert_row_invariant(fn(2), _gen(torch.float32), sizes=(1, 7, 64))
    x, ids = _gen(torch.float32)(33, torch.Generator().manual_seed(1))
    ref = fn(1)(x, ids)
    for tp in (2, 4, 8):
        assert torch.equal(fn(tp)(x, ids), ref), tp
    assert (
        ref.double() - token_logprobs(x, ids, temperature=temperature).double()
    ).abs().max() < 1e-5


def test_vocab_parallel_negative_control_naive_shard_lse_differs():
    """Combining per-shard logsumexps the obvious way (a logsumexp of the shards' lse)
    depends on TP."""
    x, ids = _gen(torch.float32)(64, torch.Generator().manual_seed(2))

    def naive(tp):
        lse = torch.logsumexp(
            torch.stack([torch.logsumexp(s, -1) for s in x.chunk(tp, -1)], -1), -1
        )
        return x.gather(-1, ids[:, None])[:, 0] - lse

    assert not (torch.equal(naive(1), naive(2)) and torch.equal(naive(1), naive(4)))


def test_log_softmax_row_invariant():
    assert_row_invariant(lambda x, i: log_softmax(x, temperature=0.9), _gen(torch.float32))


def test_log_softmax_negative_control_gemm_lse_differs():
    """log_softmax over the contiguous last dim is row-invariant natively on this CPU; the
    control sums the exps with a GEMM (a batch-variant reduction), which differs."""
    ones = torch.ones(256, V)

    def naive(x, i):
        m = x.amax(-1, keepdim=True)
        return x - m - torch.log(torch.nn.functional.linear(torch.exp(x - m), ones)[:, :1])

    assert_row_variant(naive, _gen(torch.float32))


def test_temperature_is_an_fp32_division():
    x = torch.randn(5, V, generator=torch.Generator().manual_seed(3)) * 4
    t = 0.7
    want = torch.log_softmax(x / torch.full_like(x, t), -1)
    assert torch.equal(log_softmax(x, temperature=t), want)
    ref = torch.log_softmax(x.double() / t, -1)
    assert (log_softmax(x, temperature=t).double() - ref).abs().max() < 1e-5


def test_backward_matches_float64():
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([1, 7, 49, 0])
    assert_grads_match_float64(
        lambda x: token_logprobs(x, ids, temperature=0.7),
        lambda x: torch.log_softmax(x / 0.7, -1).gather(-1, ids[:, None])[:, 0],
        (x,),
    )
    assert_grads_match_float64(
        lambda x: token_logprobs_vocab_parallel(list(x.chunk(2, -1)), ids, leaves=2),
        lambda x: torch.log_softmax(x, -1).gather(-1, ids[:, None])[:, 0],
        (x,),
    )
