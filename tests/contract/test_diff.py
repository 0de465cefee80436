"""diff(a, b): first cause first, repeated consequences collapsed."""

from __future__ import annotations

from dataclasses import replace

from _contract_testlib import DEVICE, DTYPES, make_contract, site_impls

from isoexec.contract.diff import diff
from isoexec.contract.impl import ImplInfo


def test_equal_contracts_have_no_lines() -> None:
    d = diff(make_contract(2), make_contract(2))
    assert d.equal and d.lines == () and d.differences == ()
    assert d.summary().startswith("contracts are equal")


def test_one_site_version_change_first_line_names_site_and_value() -> None:
    d = diff(make_contract(28), make_contract(28, fc1_version={3: 4}))
    assert not d.equal
    assert d.lines[0] == "layers.3.mlp.fc1 (linear): impl version 3 → 4"
    assert len(d.lines) == 1
    assert d.differing_sites == ("layers.3.mlp.fc1",)
    (only,) = d.differences
    assert (only.site, only.field, only.left, only.right) == (
        "layers.3.mlp.fc1",
        "impl version",
        "3",
        "4",
    )


def test_same_change_over_many_sites_collapses_into_one_line() -> None:
    d = diff(make_contract(28), make_contract(28, fc1_version={i: 4 for i in range(28)}))
    assert d.lines == (
        "impl version 3 → 4 at 28 sites (linear): layers.0.mlp.fc1, layers.1.mlp.fc1, "
        "layers.2.mlp.fc1 … layers.27.mlp.fc1",
    )
    assert len(d.differences) == 28  # the structured form keeps every site


def test_global_fields_come_before_sites() -> None:
    a = make_contract(4)
    b = make_contract(
        4,
        device=replace(DEVICE, torch="2.14.0+cpu"),
        dtypes=replace(DTYPES, kv_cache="bfloat16"),
        fc1_version={0: 9},
    )
    assert diff(a, b).lines == (
        "dtypes.kv_cache: float32 → bfloat16",
        "device.torch: 2.13.0+cpu → 2.14.0+cpu",
        "layers.0.mlp.fc1 (linear): impl version 3 → 9",
    )


def test_native_vs_canonical_and_missing_site_and_params() -> None:
    sites = site_impls(2)
    other = dict(sites)
    other["layers.1.self_attn.core"] = ImplInfo.native("attention", "CPUAttentionBackendImpl")
    del other["logprobs"]
    other["lm_head"] = ImplInfo.make(
        "linear",
        "isoexec.linear.row_block",
        3,
        "torch-cpu",
        {"block_rows": 16},
        sites["lm_head"].source_fingerprint,
    )
    lines = diff(make_contract(2, sites=sites), make_contract(2, sites=other)).lines
    assert lines[0] == (
        "layers.1.self_attn.core (attention): impl isoexec.attention.tiled → "
        "native:CPUAttentionBackendImpl; impl version 2 → 0; kernel backend torch-cpu → native; "
        'source fingerprint 0123456789ab… → ""; param tile 16 → (absent)'
    )
    assert lines[1] == "lm_head (linear): param block_rows 32 → 16"
    assert lines[2] == "logprobs (logprobs): site logprobs isoexec.logprobs v1 → (absent)"


def test_layer_kinds_difference_reports_first_index() -> None:
    from isoexec.contract.contract import ModelIdentity

    a = make_contract(4)
    m = ModelIdentity(
        a.model.architecture,
        a.model.config_digest,
        ("attention", "linear_attention", "attention", "linear_attention"),
    )
    assert diff(a, make_contract(4, model=m)).lines[0] == (
        "model.layer_kinds[1]: attention → linear_attention (2 layers differ)"
    )


def test_gemm_library_difference_names_the_sites_and_the_parameter() -> None:
    """Two sides whose linears run different GEMM libraries (here: IsoExec's CPU kernel and
    cuBLAS) get different contracts, and the diff says where and which library."""
    import torch

    from isoexec.ops import get_impl

    def sides_linear(impl: ImplInfo) -> dict:
        sites = site_impls(1)
        for name, site in sites.items():
            if site.op == "linear":
                sites[name] = impl
        return sites

    ours = get_impl("linear", device="cpu", dtype=torch.float32)
    theirs = get_impl("linear", device="cuda", dtype=torch.float32)
    a, b = make_contract(1, sites=sides_linear(ours)), make_contract(1, sites=sides_linear(theirs))
    assert a.hash != b.hash
    left, right = ours.param_dict()["gemm"], theirs.param_dict()["gemm"]
    assert left != right
    assert diff(a, b).lines == (
        f"param gemm {left} → {right} at 5 sites (linear): layers.0.self_attn.qkv_proj, "
        "layers.0.self_attn.o_proj, layers.0.mlp.fc1 … lm_head",
    )
    assert {d.field for d in diff(a, b).differences} == {"param gemm"}
