"""The contract's `speculation` entry: one rule for both sides, strict on reading, named in the
diff. (That a live IsoExec engine speculating records "invariant" and a stock one its method
is tested on real engines in integration/test_speculative.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from _contract_testlib import DEVICE, make_contract

from isoexec.contract.contract import Contract, ContractError, canonical_json
from isoexec.contract.diff import diff
from isoexec.contract.impl import ImplInfo
from isoexec.contract.model_contract import contract_for
from isoexec.contract.sites import model_sites
from isoexec.contract.speculation import (
    INVARIANT,
    NONE,
    SpeculationError,
    check_speculation,
    declared_speculation,
)
from isoexec.ops import get_backend_impl
from isoexec.tools.tiny_models import PRESETS


def test_the_rule_for_each_side() -> None:
    # a trainer never speculates: canonical -> invariant, stock -> none
    assert declared_speculation(canonical=True) == INVARIANT
    assert declared_speculation(canonical=False) == NONE
    # an IsoExec engine speculating through IsoExec's verifier
    assert declared_speculation(canonical=True, method="ngram", num_tokens=3) == INVARIANT
    # ... through vLLM's own verifier, or with native sites: the setting is named
    assert (
        declared_speculation(canonical=True, method="ngram", num_tokens=3, canonical_verifier=False)
        == "ngram/3"
    )
    assert declared_speculation(canonical=False, method="ngram", num_tokens=5) == "ngram/5"
    assert declared_speculation(canonical=False, method="EAGLE3", num_tokens=2) == "eagle3/2"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"canonical": False, "num_tokens": 3}, "without a speculative method"),
        ({"canonical": False, "method": "ngram", "num_tokens": 0}, "num_tokens >= 1"),
        ({"canonical": False, "method": "ngram"}, "num_tokens >= 1"),
        ({"canonical": False, "method": "n gram", "num_tokens": 2}, "must be 'invariant'"),
    ],
)
def test_the_rule_refuses_what_it_cannot_record(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpeculationError, match=message):
        declared_speculation(**kwargs)


@pytest.mark.parametrize("value", [INVARIANT, NONE, "ngram/3", "draft_model/12"])
def test_entries_round_trip(value: str) -> None:
    c = make_contract(1, speculation=value)
    back = Contract.from_bytes(c.to_bytes(), require_canonical=True)
    assert back.speculation == value and back.hash == c.hash


@pytest.mark.parametrize("value", ["", "Invariant", "ngram", "ngram/0", "ngram/03", "/3", 3, None])
def test_malformed_entries_are_refused_on_reading_and_building(value: object) -> None:
    d = make_contract(1).to_dict()
    d["speculation"] = value
    with pytest.raises(ContractError, match="speculation: must be"):
        Contract.from_bytes(canonical_json(d))
    with pytest.raises(ContractError, match="speculation: must be"):
        make_contract(1, speculation=value)


def test_a_contract_without_the_entry_is_refused() -> None:
    d = make_contract(1).to_dict()
    del d["speculation"]
    with pytest.raises(ContractError, match="missing field"):
        Contract.from_dict(d)


def _contract(
    speculative: tuple[str, int] | None, *, verifier: bool = True, native: str = ""
) -> Any:
    cfg = dict(PRESETS["tiny-dense"], architectures=["Qwen3ForCausalLM"])
    sites = {s.name: get_backend_impl(s.op, "torch") for s in model_sites(cfg)}
    if native:
        sites[native] = ImplInfo.native(sites[native].op, "Stock")
    return contract_for(
        cfg, "float32", sites, device=DEVICE, speculative=speculative, canonical_verifier=verifier
    )


def test_a_canonical_engine_speculating_matches_its_trainer_not_behind_a_stock_verifier() -> None:
    trainer = _contract(None)
    engine = _contract(("ngram", 3))
    assert trainer.speculation == engine.speculation == INVARIANT
    assert engine.hash == trainer.hash
    # negative control: the same canonical sites behind vLLM's own rejection sampler
    stock_verifier = _contract(("ngram", 3), verifier=False)
    assert stock_verifier.speculation == "ngram/3" and stock_verifier.hash != trainer.hash
    d = diff(trainer, stock_verifier)
    assert d.lines[0] == "speculation.verification: invariant → ngram/3"


def test_a_side_with_a_native_site_names_its_speculation() -> None:
    stock = _contract(("ngram", 3), native="layers.0.input_norm")
    not_speculating = _contract(None, native="layers.0.input_norm")
    assert stock.speculation == "ngram/3" and not_speculating.speculation == NONE
    assert "speculation.verification: none → ngram/3" in diff(not_speculating, stock).lines


def test_check_speculation_returns_the_entry() -> None:
    assert check_speculation("ngram/3") == "ngram/3"
