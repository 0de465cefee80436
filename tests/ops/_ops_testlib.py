"""Shared helpers for the canonical-op property tests.

`row_results` computes one row inside batches of several sizes, at several positions,
surrounded by fresh random rows, under 1 and 2 torch threads; a canonical op must give the
row's bits every time, a negative control must not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tests._support.threads import num_threads

BATCH_SIZES = (1, 2, 7, 16, 64, 333)
THREADS = (1, 2)


def row_results(
    fn: Callable[..., torch.Tensor],
    gen: Callable[[int, torch.Generator], tuple[torch.Tensor, ...]],
    *,
    sizes: Sequence[int] = BATCH_SIZES,
    threads: Sequence[int] = THREADS,
    seed: int = 0,
) -> tuple[torch.Tensor, list[tuple[int, int, torch.Tensor]]]:
    """(row computed alone, [(M, threads, same row computed in a batch of M)]).

    `gen(M, g)` makes M random rows per input; row 0 of `gen(1, seed)` is the row under test,
    copied into each batch at the middle and at the last position.
    """
    g = torch.Generator().manual_seed(seed)
    row = gen(1, g)
    alone = fn(*row)[0]
    out = []
    for nt in threads:
        with num_threads(nt):
            for m in sizes:
                for pos in sorted({m // 2, m - 1}):
                    batch = gen(m, g)
                    for b, r in zip(batch, row, strict=True):
                        b[pos] = r[0]
                    out.append((m, nt, fn(*batch)[pos]))
    return alone, out


def mismatches(alone: torch.Tensor, results: list[tuple[int, int, torch.Tensor]]) -> list:
    return [(m, nt) for m, nt, r in results if not torch.equal(alone, r)]


def assert_row_invariant(fn, gen, **kw) -> None:
    alone, res = row_results(fn, gen, **kw)
    bad = mismatches(alone, res)
    assert not bad, f"row differs at (M, threads) = {bad}"


def assert_row_variant(fn, gen, **kw) -> None:
    """Negative control: the naive op must differ somewhere, else the test proves nothing."""
    alone, res = row_results(fn, gen, **kw)
    assert mismatches(alone, res), "negative control did not differ: the property test is blind"


def ulp_bound(y64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half an ulp of `dtype` at each element of the float64 reference (one rounding)."""
    eps = torch.finfo(dtype).eps
    mag = y64.abs().clamp_min(torch.finfo(dtype).tiny)
    return 2.0 ** torch.floor(torch.log2(mag)) * eps / 2


def _grads(fn, inputs, seed=0):
    """Autograd grads of sum(fn(*inputs) * u) for a fixed random u."""
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*ins)
    u = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    u = u.to(y.dtype)
    (y * u).sum().backward()
    return [t.grad for t in ins]


def assert_grads_match_float64(fn, ref64, inputs, rtol=1e-4, atol=1e-5):
    got = _grads(fn, [t.float() for t in inputs])
    want = _grads(ref64, [t.double() for t in inputs])
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a.double(), b, rtol=rtol, atol=atol)


def gdn_batch(bsz, t, hk, hv, kd, vd, dtype=torch.float32, seed=0, state=True):
    """Batched inputs [B, T, ...] with a random fp32 initial state (or None)."""
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g).to(dtype)

    x = [r(bsz, t, hk, kd), r(bsz, t, hk, kd), r(bsz, t, hv, vd), r(bsz, t, hv), r(bsz, t, hv)]
    x += [torch.randn(hv, generator=g) * 0.5, torch.randn(hv, generator=g) * 0.5]
    s0 = torch.randn(bsz, hv, kd, vd, generator=g) * 0.1 if state else None
    return x, s0
