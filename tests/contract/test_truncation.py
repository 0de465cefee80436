"""The canonical truncation (`isoexec.ops.truncation`) against a reference written from its
definition in docs/ops.md: an explicit (value, id) sort, fp32 thresholds, the top-p mass in
Python integers. Rows with ties (logits on a coarse grid) make the tie rule matter."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from isoexec import ops
from isoexec.ops import _pointwise as pw
from isoexec.ops.truncation import RowTruncation, Truncation, TruncationError, truncation_mask

V = 97


def _reference_kept(row: torch.Tensor, temp: float, tr: Truncation) -> set[int]:
    """The kept ids of one row, from the definition, one rule at a time."""
    x = row.float()
    order = sorted(range(V), key=lambda i: (-float(x[i]), i))
    s = [x[i : i + 1] / torch.tensor([temp], dtype=torch.float32) for i in order]
    n = V
    if tr.min_p > 0:
        thr = torch.tensor(math.log(float(torch.tensor(tr.min_p, dtype=torch.float32))))
        thr32 = thr.to(torch.float32)
        n = min(n, sum(1 for v in s if bool((v - s[0]) >= thr32)))
    if 0 < tr.top_k < V:
        n = min(n, tr.top_k)
    if tr.top_p < 1.0:  # fixed point: exact integers, Python's own
        q = [math.floor(float(pw.exp(v - s[0])) * 2**40) for v in s[:n]]
        total = sum(q)
        p = Fraction(float(torch.tensor(tr.top_p, dtype=torch.float32)))
        bound = math.ceil(p * total)
        before, count = 0, 0
        for v in q:
            if before < bound:
                count += 1
            before += v
        n = min(n, count)
    return set(order[: max(n, 1)])


def _rows(count: int, seed: int, grid: float = 0.25) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, V, generator=g) * 3
    return torch.round(x / grid) * grid  # ties on a coarse grid


SETTINGS = [
    Truncation(top_k=5),
    Truncation(top_k=1),
    Truncation(top_p=0.9),
    Truncation(top_p=0.3),
    Truncation(min_p=0.1),
    Truncation(min_p=0.5),
    Truncation(top_k=20, top_p=0.8),
    Truncation(top_k=7, top_p=0.95, min_p=0.05),
    Truncation(top_p=0.5, min_p=0.2),
]


@pytest.mark.parametrize("tr", SETTINGS, ids=str)
@pytest.mark.parametrize("temp", [1.0, 0.6, 1.7])
def test_kept_set_is_the_definition(tr: Truncation, temp: float) -> None:
    x = _rows(12, seed=hash((tr, temp)) % 1000)
    keep = truncation_mask(x, torch.full((12,), temp), tr.rows(12, "cpu"))
    for i in range(12):
        got = set(keep[i].nonzero().reshape(-1).tolist())
        assert got == _reference_kept(x[i], temp, tr), (i, tr, temp)


def test_ties_are_broken_by_the_lower_token_id() -> None:
    x = torch.zeros(1, V)
    x[0, [3, 40, 41, 90]] = 2.0  # four tokens tied at the top
    keep = truncation_mask(x, torch.ones(1), Truncation(top_k=2).rows(1, "cpu"))
    assert keep[0].nonzero().reshape(-1).tolist() == [3, 40]
    # The same logits laid out in reverse keep the lower ids of the reversed row: the rule is
    # by id, so a reversed layout keeps other tokens (a tie-break by position would not show it).
    flipped = truncation_mask(x.flip(-1), torch.ones(1), Truncation(top_k=2).rows(1, "cpu"))
    assert flipped[0].flip(-1).nonzero().reshape(-1).tolist() == [41, 90]


def test_each_rows_kept_set_depends_on_that_row_alone() -> None:
    x = _rows(16, seed=7, grid=0.5)
    rng = random.Random(0)
    settings = [rng.choice(SETTINGS) for _ in range(16)]
    temps = torch.tensor([rng.choice([0.6, 1.0, 1.3]) for _ in range(16)])
    rows = RowTruncation(
        torch.tensor([s.top_k for s in settings]),
        torch.tensor([s.top_p for s in settings], dtype=torch.float32),
        torch.tensor([s.min_p for s in settings], dtype=torch.float32),
    )
    batch = truncation_mask(x, temps, rows)
    for i in range(16):
        alone = truncation_mask(x[i : i + 1], temps[i : i + 1], settings[i].rows(1, "cpu"))
        assert torch.equal(batch[i : i + 1], alone), i
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    shuffled = RowTruncation(rows.top_k[perm], rows.top_p[perm], rows.min_p[perm])
    assert torch.equal(truncation_mask(x[perm], temps[perm], shuffled), batch[perm])


def test_rows_without_a_rule_keep_everything_and_the_top_token_is_always_kept() -> None:
    x = _rows(6, seed=3)
    off = [Truncation(), Truncation(top_k=-1), Truncation(top_k=V), Truncation(top_k=10**6)]
    for tr in off:
        assert truncation_mask(x, torch.ones(6), tr.rows(6, "cpu")).all(), tr
    tiny = Truncation(top_p=1e-6, min_p=1.0)
    keep = truncation_mask(x, torch.ones(6), tiny.rows(6, "cpu"))
    assert keep.sum(-1).tolist() == [1] * 6
    assert torch.equal(keep.float().argmax(-1), x.argmax(-1))  # argmax: first max = lower id


def test_top_p_keeps_the_shortest_prefix_that_reaches_p() -> None:
    x = torch.zeros(1, 10)  # uniform: 0.1 each
    # (fp32(0.1) is a little above 0.1: one token of mass 0.1 does not reach it)
    for p, n in [(0.05, 1), (0.0999, 1), (0.1, 2), (0.15, 2), (0.25, 3), (0.95, 10)]:
        keep = truncation_mask(x, torch.ones(1), Truncation(top_p=p).rows(1, "cpu"))
        assert int(keep.sum()) == n, (p, n)


def test_processed_logprobs_are_renormalised_over_the_kept_set() -> None:
    x = _rows(4, seed=11)
    tr = Truncation(top_k=8, top_p=0.9)
    keep = truncation_mask(x, torch.full((4,), 0.7), tr.rows(4, "cpu"))
    lp = ops.log_softmax(x.masked_fill(~keep, -math.inf), temperature=0.7)
    assert torch.isinf(lp[~keep]).all() and torch.isfinite(lp[keep]).all()
    mass = lp.exp().sum(-1)
    assert torch.allclose(mass, torch.ones(4), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_settings_outside_their_domain_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(TruncationError, match=message):
        Truncation(**kwargs)


@pytest.mark.parametrize("seed", range(4))
def test_rows_sort_a_prefix_and_keep_what_the_whole_sort_keeps(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefix path (a top-k selection, ties at the boundary added, re-sorted; top-p rows
    doubling it) against the whole-row sort, on a vocabulary of 5000 with heavy ties (values
    on a grid of 8 levels: k cuts through ties of hundreds of tokens) and rows of all-equal
    logits."""
    from isoexec.ops import truncation

    whole_sort = truncation._sorted_prefix

    v, b = 5000, 8
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 8, (b, v), generator=g).float() / 2
    x[1] = 0.25  # all tied
    x[2, :3] = 9.0  # three tied at the top, then the grid
    temps = torch.tensor([1.0, 0.7, 1.3, 0.5, 1.0, 0.9, 2.0, 1.0])
    rows = RowTruncation(
        torch.tensor([20, 7, 2, 300, 1, 4999, 5000, 0]),
        torch.tensor([1.0, 0.9, 0.5, 0.95, 1.0, 0.3, 0.8, 0.999], dtype=torch.float32),
        torch.tensor([0.0, 0.0, 0.1, 0.05, 0.0, 0.0, 0.2, 0.5], dtype=torch.float32),
    )
    fast = truncation_mask(x, temps, rows)
    monkeypatch.setattr(truncation, "_sorted_prefix", lambda x, width: whole_sort(x, v))
    full = truncation_mask(x, temps, rows)
    assert torch.equal(fast, full)
    assert int(fast[1].sum()) == 7 and fast[1, :7].all()  # all tied: the 7 lowest ids
