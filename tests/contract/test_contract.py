"""The contract's canonical bytes, hash and strict loading."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _contract_testlib import DEVICE, DTYPES, FP, MODEL, make_contract, site_impls

from isoexec.contract.contract import (
    Contract,
    ContractBuilder,
    ContractError,
    SchemaVersionError,
    SiteRecord,
    build_contract,
    canonical_json,
    config_digest,
)
from isoexec.contract.impl import ImplInfo
from isoexec.contract.sites import Site as ModelSite

GOLDEN_BYTES = (
    b'{"device":{"arch":"x86_64:avx2,fma:AVX2","cuda":null,"device_kind":"cpu","patches":[],'
    b'"threads":null,"torch":"2.13.0+cpu","triton":null},"dtypes":{"activations":"float32","kv_cache":"float32",'
    b'"logprobs":"float32","params":"float32","recurrent_state":null,"residual":"float32"},'
    b'"model":{"architecture":"Qwen3ForCausalLM","config_digest":'
    b'"af79be01a61a7fe320a804f51e0d74cb62ac3ba73829a1b4fc1f924e06c50db3","layer_kinds":'
    b'["attention"]},"parallel":{"dp":"1","ep":"1","pp":"1","tp":"1"},"schema_version":5,'
    b'"sites":{"embed_tokens":{"backend":"native","impl_id":'
    b'"native:Embedding","op":"embedding","params":{},"source_fingerprint":"","tp":"1",'
    b'"version":0},"layers.0.input_layernorm":{"backend":"torch-cpu","impl_id":"isoexec.rms_norm",'
    b'"op":"rms_norm","params":{"eps":"0x1.0c6f7a0b5ed8dp-20"},"source_fingerprint":'
    b'"0123456789abcdef0123456789abcdef","tp":"1","version":1},"layers.0.mlp.act":{"backend":'
    b'"torch-cpu","impl_id":"isoexec.silu_mul","op":"silu_mul","params":{"pad":"64"},'
    b'"source_fingerprint":"0123456789abcdef0123456789abcdef","tp":"1","version":1},'
    b'"layers.0.mlp.fc1":{"backend":"torch-cpu","impl_id":"isoexec.linear.row_block","op":'
    b'"linear","params":{"block_rows":"32"},"source_fingerprint":'
    b'"0123456789abcdef0123456789abcdef","tp":"1","version":3},"layers.0.mlp.fc2":{"backend":'
    b'"torch-cpu","impl_id":"isoexec.linear.row_block","op":"linear","params":{"block_rows":"32"},'
    b'"source_fingerprint":"0123456789abcdef0123456789abcdef","tp":"1","version":3},'
    b'"layers.0.self_attn.core":{"backend":"torch-cpu","impl_id":"isoexec.attention.tiled","op":'
    b'"attention","params":{"tile":"16"},"source_fingerprint":"0123456789abcdef0123456789abcdef",'
    b'"tp":"1","version":2},"layers.0.self_attn.o_proj":{"backend":"torch-cpu","impl_id":'
    b'"isoexec.linear.row_block","op":"linear","params":{"block_rows":"32"},"source_fingerprint":'
    b'"0123456789abcdef0123456789abcdef","tp":"1","version":3},"layers.0.self_attn.qkv_proj":'
    b'{"backend":"torch-cpu","impl_id":"isoexec.linear.row_block","op":"linear","params":'
    b'{"block_rows":"32"},"source_fingerprint":"0123456789abcdef0123456789abcdef","tp":"1",'
    b'"version":3},"lm_head":{"backend":"torch-cpu","impl_id":"isoexec.linear.row_block","op":'
    b'"linear","params":{"block_rows":"32"},"source_fingerprint":'
    b'"0123456789abcdef0123456789abcdef","tp":"1","version":3},"logprobs":{"backend":"torch-cpu",'
    b'"impl_id":"isoexec.logprobs","op":"logprobs","params":{},"source_fingerprint":'
    b'"0123456789abcdef0123456789abcdef","tp":"1","version":1},"norm":{"backend":"torch-cpu",'
    b'"impl_id":"isoexec.rms_norm","op":"rms_norm","params":{"eps":"0x1.0c6f7a0b5ed8dp-20"},'
    b'"source_fingerprint":"0123456789abcdef0123456789abcdef","tp":"1","version":1}},'
    b'"speculation":"none"}'
)
GOLDEN_HASH = "8821105d4e6290f1ba9115ecac75c7ec71fe1feaa494d365021d04e4a3044681"


def test_golden_bytes_and_hash() -> None:
    c = make_contract(1)
    assert c.to_bytes() == GOLDEN_BYTES
    assert c.hash == GOLDEN_HASH == hashlib.sha256(GOLDEN_BYTES).hexdigest()


def test_hash_stable_across_processes_and_hash_seeds() -> None:
    """Same contract → same bytes in a fresh interpreter with another dict/str hash seed."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from _contract_testlib import make_contract; print(make_contract(3).hash)"
    )
    here = str(Path(__file__).parent)
    hashes = {
        subprocess.run(
            [sys.executable, "-c", code, here],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("0", "12345")
    }
    assert hashes == {make_contract(3).hash}


def test_site_enumeration_order_does_not_change_bytes_but_is_kept_in_object() -> None:
    sites = site_impls(3)
    forward = make_contract(3, sites=sites)
    backward = make_contract(3, sites=dict(reversed(list(sites.items()))))
    assert forward.to_bytes() == backward.to_bytes()
    assert forward == backward and forward.hash == backward.hash
    assert forward.site_names == tuple(sites)  # model order as given
    assert backward.site_names == tuple(reversed(list(sites)))


def test_round_trip_and_numeric_aware_order_after_load() -> None:
    c = make_contract(12)
    back = Contract.from_bytes(c.to_bytes(), require_canonical=True)
    assert back == c and back.to_bytes() == c.to_bytes()
    names = [n for n in back.site_names if n.startswith("layers.") and n.endswith("mlp.fc1")]
    assert names == [f"layers.{i}.mlp.fc1" for i in range(12)]  # layers.2 before layers.10


def test_save_load_file_hash_equals_sha256_of_file(tmp_path: Path) -> None:
    c = make_contract(2)
    p = c.save(tmp_path / "c.json")
    assert hashlib.sha256(p.read_bytes()).hexdigest() == c.hash
    assert Contract.load(p, require_canonical=True) == c
    # A pretty-printed file is the same contract (same hash) unless canonical bytes are required.
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(c.to_dict(), indent=2))
    assert Contract.load(pretty).hash == c.hash
    with pytest.raises(ContractError, match="not canonical"):
        Contract.load(pretty, require_canonical=True)


def test_no_floats_anywhere() -> None:
    with pytest.raises(ContractError, match="floats are not allowed"):
        canonical_json({"a": [1, 0.5]})
    d = make_contract(1).to_dict()
    d["sites"]["lm_head"]["version"] = 3.0
    with pytest.raises(ContractError, match=r"float 3\.0 in contract"):
        Contract.from_bytes(json.dumps(d).encode())
    d["sites"]["lm_head"]["version"] = float("nan")
    with pytest.raises(ContractError, match="NaN in contract"):
        Contract.from_bytes(json.dumps(d).encode())
    # ImplInfo params and config digests carry floats as exact hex strings.
    assert dict(ImplInfo.make("x", "y", 1, "b", {"eps": 1e-6}).params)["eps"] == (1e-6).hex()
    assert config_digest({"eps": 1e-6}) != config_digest({"eps": 1e-5})
    assert config_digest({"eps": 1e-6, "h": 8}) == config_digest({"h": 8, "eps": 1e-6})


def test_unknown_field_refused() -> None:
    d = make_contract(1).to_dict()
    d["model"]["hidden_size_guess"] = 64
    with pytest.raises(ContractError, match=r"model: unknown field\(s\) hidden_size_guess"):
        Contract.from_dict(d)
    d = make_contract(1).to_dict()
    d["sites"]["lm_head"]["fast_path"] = True
    with pytest.raises(ContractError, match=r"sites\['lm_head'\]: unknown field\(s\) fast_path"):
        Contract.from_dict(d)
    d = make_contract(1).to_dict()
    d["extra"] = {}
    with pytest.raises(ContractError, match=r"contract: unknown field\(s\) extra"):
        Contract.from_dict(d)


def test_missing_field_refused() -> None:
    d = make_contract(1).to_dict()
    del d["dtypes"]["recurrent_state"]
    with pytest.raises(ContractError, match=r"dtypes: missing field\(s\) recurrent_state"):
        Contract.from_dict(d)


def test_unknown_schema_version_refused() -> None:
    d = make_contract(1).to_dict()
    d["schema_version"] = 6
    with pytest.raises(SchemaVersionError, match=r"unknown contract schema_version 6 \(known: 5\)"):
        Contract.from_bytes(canonical_json(d))
    # Schema 1 (no `parallel` section) is refused, not read with a guessed layout.
    del d["parallel"]
    d["schema_version"] = 1
    with pytest.raises(SchemaVersionError, match=r"schema_version 1 \(known: 5\)"):
        Contract.from_bytes(canonical_json(d))
    d["schema_version"] = "1"
    with pytest.raises(ContractError, match="schema_version: missing or not an integer"):
        Contract.from_dict(d)


def test_duplicate_keys_bad_utf8_and_wrong_types_refused() -> None:
    b = make_contract(1).to_bytes()
    with pytest.raises(ContractError, match="duplicate key 'schema_version'"):
        Contract.from_bytes(b[:-1] + b',"schema_version":3}')
    with pytest.raises(ContractError, match="not UTF-8"):
        Contract.from_bytes(b"\xff" + b)
    with pytest.raises(ContractError, match="not valid JSON"):
        Contract.from_bytes(b[:-5])
    d = make_contract(1).to_dict()
    d["sites"]["lm_head"]["version"] = True  # a bool is not a version
    with pytest.raises(ContractError, match=r"sites\['lm_head'\]\.version: expected an integer"):
        Contract.from_dict(d)


def test_native_sites_recorded_and_missing_sites_refused() -> None:
    c = make_contract(1)
    assert c.site("embed_tokens").impl.impl_id == "native:Embedding"
    assert c.native_sites == ("embed_tokens",)
    b = ContractBuilder(MODEL, DTYPES, DEVICE)
    b.add_site("lm_head", ImplInfo.native("linear", "ParallelLMHead"))
    with pytest.raises(ContractError, match=r"1 site\(s\) not recorded .*: logprobs"):
        b.build(expected_sites=["lm_head", "logprobs"])
    with pytest.raises(ContractError, match="site 'lm_head' runs op 'logprobs' but its record"):
        b.build(expected_sites=[ModelSite("lm_head", "logprobs")])
    assert b.build(expected_sites=[ModelSite("lm_head", "linear")]).site_names == ("lm_head",)
    with pytest.raises(ContractError, match="added twice"):
        b.add_site("lm_head", ImplInfo.native("linear", "ParallelLMHead"))


def test_canonical_impl_without_source_fingerprint_refused() -> None:
    with pytest.raises(ContractError, match="has no source fingerprint"):
        make_contract(1, sites={"lm_head": ImplInfo.make("linear", "isoexec.linear", 1, "cpu")})


def test_edited_kernel_source_changes_hash() -> None:
    a = make_contract(1)
    sites = site_impls(1)
    sites["lm_head"] = ImplInfo.make(
        "linear", "isoexec.linear.row_block", 3, "torch-cpu", {"block_rows": 32}, "f" * 32
    )
    assert make_contract(1, sites=sites).hash != a.hash


def test_tp_invariance_claims() -> None:
    sites = site_impls(1)
    all_inv_tp4 = make_contract(1, sites=sites, tp_size=4, tp_invariant=True)
    all_inv_tp1 = make_contract(1, sites=sites, tp_size=1, tp_invariant=True)
    assert all_inv_tp4.hash == all_inv_tp1.hash  # invariance claimed: degree is irrelevant
    some = make_contract(1, sites=sites, tp_size=4, tp_invariant={"lm_head"})
    assert some.site("lm_head").tp == "invariant" and some.site("logprobs").tp == "4"
    assert make_contract(1, sites=sites, tp_size=2).hash != make_contract(1, sites=sites).hash
    with pytest.raises(ContractError, match="tp_invariant names unknown sites: nope"):
        make_contract(1, sites=sites, tp_invariant={"nope"})


def test_builder_detects_backend_when_not_given() -> None:
    c = build_contract(
        model=MODEL,
        dtypes=DTYPES,
        sites={"lm_head": ImplInfo.make("linear", "isoexec.linear", 1, "torch-cpu", {}, FP)},
    )
    assert c.device.device_kind in ("cpu", "cuda") and c.device.torch
    assert c.device.triton is None  # no triton site


def test_contract_is_frozen_and_validates_sites() -> None:
    c = make_contract(1)
    with pytest.raises(AttributeError):
        c.model = MODEL  # type: ignore[misc]
    with pytest.raises(ContractError, match="invalid site name 'has space'"):
        Contract(MODEL, DTYPES, DEVICE, (SiteRecord("has space", ImplInfo.native("x", "Y")),))
    with pytest.raises(ContractError, match="at least one site"):
        Contract(MODEL, DTYPES, DEVICE, ())


def test_parallel_layout_is_hashed_checked_and_diffed() -> None:
    """The `parallel` section: part of the bytes (a layout change changes the hash), strictly
    parsed, named in the diff; `declared_layout` is the one rule both sides follow."""
    from dataclasses import replace

    from isoexec.contract.diff import diff
    from isoexec.contract.parallel_layout import ParallelLayout, declared_layout

    c = make_contract(1)
    other = replace(c, parallel=ParallelLayout(tp="2"))
    assert other.hash != c.hash
    assert "parallel.tp: 1 → 2" in str(diff(c, other))
    assert Contract.from_bytes(other.to_bytes()) == other
    for bad in ({"tp": "0", "pp": "1", "ep": "1", "dp": "1"}, {"tp": "1", "pp": "1", "ep": "1"}):
        d = c.to_dict()
        d["parallel"] = bad
        with pytest.raises(ContractError, match="parallel"):
            Contract.from_dict(d)
    # A canonical side declares the same layout at any degree; a native one its degrees.
    canonical = dict(all_sites_tp_invariant=True, canonical=True, moe=True)
    assert declared_layout(**canonical, tp=2, pp=2, ep=2, dp=4) == declared_layout(**canonical)
    native = declared_layout(all_sites_tp_invariant=False, canonical=False, moe=True, tp=2, ep=2,
                             dp=4, pp=2)  # fmt: skip
    assert native == ParallelLayout(tp="2", pp="invariant", ep="2", dp="4")
    dense = declared_layout(all_sites_tp_invariant=False, canonical=False, moe=False, ep=2)
    assert dense.ep == "invariant"  # no experts: EP changes nothing
