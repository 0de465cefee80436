"""The patch registry: every write into a framework is a declared patch, applied and undone by
one mechanism, listed in the contract and in docs/architecture.md's generated table."""

from __future__ import annotations

import os
import types
from dataclasses import replace
from pathlib import Path

import pytest
from _contract_testlib import make_contract

from isoexec.contract.diff import diff
from isoexec.contract.patch_table import DECLARED, DOC_BEGIN, DOC_END, contract_patch_list, markdown
from isoexec.contract.patching import PatchEntry, PatchError, PatchRegistry

ROOT = Path(__file__).resolve().parents[2]
TABLE = (PatchEntry("engine", "p", "mod.f", "why", "x 1"),
         PatchEntry("engine", "q", "mod.g", "why", "x 1"))  # fmt: skip


def _target() -> types.SimpleNamespace:
    return types.SimpleNamespace(f="upstream", table={"a": 1})


def test_apply_then_undo_puts_everything_back() -> None:
    reg, mod = PatchRegistry("engine", TABLE), _target()
    env = "ISOEXEC_TEST_PATCH_ENV"
    os.environ.pop(env, None)

    def write() -> None:
        reg.set_attr(mod, "f", "patched")
        reg.set_attr(mod, "new_name", 1, must_exist=False)
        reg.set_item(mod.table, "a", 2)
        reg.set_item(mod.table, "b", 3)
        reg.set_env(env, "1")

    reg.apply("p", write)
    assert (mod.f, mod.new_name, mod.table, os.environ[env]) == (
        "patched",
        1,
        {"a": 2, "b": 3},
        "1",
    )
    assert reg.applied() == ["p"]
    reg.apply("p", lambda: reg.set_attr(mod, "f", "again"))  # idempotent: not run again
    assert mod.f == "patched"
    reg.undo("p")
    assert mod.f == "upstream" and not hasattr(mod, "new_name") and mod.table == {"a": 1}
    assert env not in os.environ and reg.applied() == []


def test_user_env_value_is_kept() -> None:
    reg, env = PatchRegistry("engine", TABLE), "ISOEXEC_TEST_PATCH_ENV2"
    os.environ[env] = "user"
    try:
        reg.apply("p", lambda: reg.set_env(env, "1"))
        assert os.environ[env] == "user"
        reg.undo_all()
        assert os.environ[env] == "user"
    finally:
        del os.environ[env]


def test_refusals_undeclared_gone_outside_and_half_applied() -> None:
    reg, mod = PatchRegistry("engine", TABLE), _target()
    with pytest.raises(PatchError, match="not declared"):
        reg.apply("nobody_declared", lambda: None)
    with pytest.raises(PatchError, match="is not declared"):
        PatchRegistry("trainer", TABLE).apply("p", lambda: None)  # another side's patch
    with pytest.raises(PatchError, match="is gone"):
        reg.apply("p", lambda: reg.set_attr(mod, "missing", 1))
    with pytest.raises(PatchError, match="outside"):
        reg.set_attr(mod, "f", "stray")

    def half() -> None:
        reg.set_attr(mod, "f", "half")
        raise RuntimeError("second write failed")

    with pytest.raises(RuntimeError, match="second write"):
        reg.apply("q", half)
    assert mod.f == "upstream" and reg.applied() == []  # nothing left behind


def test_the_contract_lists_the_declared_patches_and_the_diff_names_one() -> None:
    listed = contract_patch_list()
    assert len(listed) == len(DECLARED) > 15
    assert {e.side for e in DECLARED} == {"engine", "trainer"}
    assert "engine:sampler@vllm 0.32.0" in listed
    a = make_contract(1)
    a = replace(a, device=replace(a.device, patches=listed))
    b = replace(a, device=replace(a.device, patches=(*listed[1:], "engine:extra@vllm 0.33.0")))
    assert a.hash != b.hash
    report = str(diff(a, b))
    assert listed[0] in report and "engine:extra@vllm 0.33.0" in report


def test_docs_carry_the_generated_patch_table() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert DOC_BEGIN in doc and DOC_END in doc
    block = doc[doc.index(DOC_BEGIN) : doc.index(DOC_END) + len(DOC_END)]
    assert block == markdown(), "regenerate with `python scripts/gen_docs.py`"
