"""TP=2 on CPU for the GDN hybrids (tiny-gdn: Qwen3-Next with MoE + gated shared expert,
interleaved GDN projections; tiny-qwen35: Qwen3.5 text, dense MLP, flat projections), isoexec
with `IsoExecOptions(tp_invariant=True)`, on one 2-process gloo world (`run_tp_jobs`).

What the invariance rests on: GDN heads never mix before out_proj (depthwise conv, per-head
recurrence and gated norm, column-invariant `ops.linear` for the projections), so a rank holding
whole key-head groups computes the TP=1 bits of its heads; out_proj (row-parallel) is the
`linear_tp` leaves. Negative control: the same TP=2 model with only the GDN out_proj run as a
stock K-split (plain `ops.linear` per rank, rounded partials all-reduced) differs from TP=1.
No stock Megatron control exists here: native GDN layers are refused at TP>1.

Gradients are checked against a TP=1 step run in this process: weights after one SGD step,
exported in HF layout, agree to rounding (a partial gradient, e.g. of a norm weight shared by
heads that live on different ranks, would be off by a large fraction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from isoexec.contract.options import IsoExecOptions

pytestmark = pytest.mark.trainer

SEQS = [[3, 17, 250, 9, 44, 101, 7], [5, 5, 480, 2], [11, 300, 77, 61, 499, 23, 8, 90, 151, 4, 0]]
INV = {"tp_invariant": True}
FAMILIES = ("gdn32", "q35-32", "gdn16")


@pytest.fixture(scope="module")
def ckpts(model_factory: Callable[[str, str], str]) -> dict[str, str]:
    return {
        "gdn32": model_factory("tiny-gdn", "float32"),
        "gdn16": model_factory("tiny-gdn", "bfloat16"),
        "q35-32": model_factory("tiny-qwen35", "float32"),
    }


@pytest.fixture(scope="module")
def results(
    ckpts: dict[str, str], run_tp_jobs: Callable[..., list[dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    named: dict[str, dict[str, Any]] = {}
    for fam in FAMILIES:
        dtype = "bfloat16" if fam.endswith("16") else "float32"
        full = fam != "gdn16"
        for tp in (1, 2):
            named[f"{fam}-tp{tp}"] = dict(
                model=ckpts[fam], dtype=dtype, tp=tp, isoexec=True, options=INV,
                round_trip=tp == 2, contract=full,
                train=tp == 2 and full, export_after_step=tp == 2 and full,
            )  # fmt: skip
    for tp in (1, 2):
        named[f"plain-out-proj-tp{tp}"] = dict(
            model=ckpts["gdn32"], dtype="float32", tp=tp, isoexec=True, options=INV,
            plain_gdn_out_proj=True,
        )  # fmt: skip
    named["native-tp2"] = dict(
        model=ckpts["gdn32"], dtype="float32", tp=2, isoexec=False, expect_error=True
    )
    named["iso-default-tp2"] = dict(
        model=ckpts["q35-32"], dtype="float32", tp=2, isoexec=True, expect_error=True
    )
    out = run_tp_jobs(list(named.values()), SEQS)
    return dict(zip(named, out, strict=True))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_gdn_tp2_logprobs_bitwise_equal_tp1(results: dict, family: str) -> None:
    tp1, tp2 = results[f"{family}-tp1"], results[f"{family}-tp2"]
    assert [lp.numel() for lp in tp2["logprobs"]] == [len(s) - 1 for s in SEQS]
    assert all(torch.isfinite(lp).all() for lp in tp2["logprobs"])
    assert _equal(tp1["logprobs"], tp2["logprobs"])
    assert tp2["round_trip_exact"], "HF -> TP=2 shards -> HF is not bit-exact"


def test_negative_control_plain_out_proj_tp2_differs(results: dict) -> None:
    """The K-split plain linear at the GDN out_proj alone breaks TP=2 == TP=1."""
    tp1, tp2 = results["plain-out-proj-tp1"]["logprobs"], results["plain-out-proj-tp2"]["logprobs"]
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(tp1, tp2, strict=True))
    assert not _equal(tp1, tp2), "plain K-split out_proj at TP=2 == TP=1: the control shows nothing"


def test_gdn_tp2_contract_equals_tp1(results: dict) -> None:
    from isoexec.contract.contract import Contract

    for fam in ("gdn32", "q35-32"):
        assert results[f"{fam}-tp1"]["contract"] == results[f"{fam}-tp2"]["contract"], fam
        c = Contract.from_bytes(results[f"{fam}-tp2"]["contract"])
        assert {s.tp for s in c.sites} == {"invariant"}, fam
        out_proj = [s for s in c.sites if s.name.endswith("linear_attn.out_proj")]
        assert out_proj and {s.impl.impl_id for s in out_proj} == {"isoexec.linear.tp_leaves"}


@pytest.fixture(scope="module")
def tp1_step(ckpts: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    """The reference: one TP=1 SGD step (lr 0.5, as the worker) in this process, exported."""
    from isoexec.megatron.model_builder import build_model
    from isoexec.megatron.parallel import megatron_parallel
    from isoexec.megatron.scoring import train_step
    from isoexec.megatron.weights import export_hf_weights, load_hf_weights

    out = {}
    for fam in ("gdn32", "q35-32"):
        with megatron_parallel(1):
            model = build_model(ckpts[fam], isoexec=True, options=IsoExecOptions(**INV))
            load_hf_weights(model, ckpts[fam])
            train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), SEQS)
            out[fam] = dict(export_hf_weights(model))
    return out


@pytest.mark.parametrize("family", ["gdn32", "q35-32"])
def test_gdn_tp2_training_step_matches_tp1(
    results: dict, ckpts: dict[str, str], tp1_step: dict, family: str
) -> None:
    from isoexec.megatron.weights import read_hf_state_dict

    tp2 = results[f"{family}-tp2"]
    nll = -torch.cat(tp2["logprobs"]).double().mean().item()
    assert abs(tp2["loss"] - nll) < 1e-5, (tp2["loss"], nll)
    after = -torch.cat(tp2["logprobs_after_step"]).double().mean().item()
    assert after < nll, (nll, after)
    before, ref = read_hf_state_dict(ckpts[family]), tp1_step[family]
    got = tp2["weights_after_step"]
    assert set(got) == set(ref)
    bad, unchanged = [], []
    for name, w0 in before.items():
        d1, d2 = ref[name].double() - w0.double(), got[name].double() - w0.double()
        if not d2.abs().max() > 0:
            unchanged.append(name)
        if (d1 - d2).abs().max() > 1e-3 * d1.abs().max() + 1e-9:
            bad.append(name)
    assert not unchanged, f"weights not trained at TP=2: {unchanged}"
    # Includes the GDN norm, q/k norms (weights shared by heads on both ranks) and the whole
    # shared expert (tiny-gdn).
    assert not bad, f"TP=2 step differs from the TP=1 step beyond rounding: {bad}"


def test_gdn_tp_refusals(results: dict, ckpts: dict[str, str]) -> None:
    err = results["native-tp2"]["error"]
    assert "native" in err and "TP=1 only" in err and "tp_invariant=True" in err, err
    err = results["iso-default-tp2"]["error"]
    assert "IsoExecOptions(tp_invariant=True)" in err and "tp=2" in err, err

    from isoexec.megatron.hf_config import _read_source, load_hf_config
    from isoexec.megatron.model_builder import transformer_config

    cfg = _read_source(ckpts["gdn32"]) | {"linear_num_key_heads": 1, "linear_num_value_heads": 2}
    with pytest.raises(ValueError, match="does not divide linear_num_key_heads=1"):
        transformer_config(load_hf_config(cfg), tp=2)
