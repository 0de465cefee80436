"""Site bindings and `ISOEXEC_VERIFY_CALLS=1` on real Megatron models (dense, MoE, GDN).

A binding gives a site its record and its functions from one object (`isoexec.ops.binding`);
verify mode checks, while the model runs, that what ran at each site is what it records. Each
injected wrong call below is refused in verify mode and runs silently without it (the negative
control: only the mode catches it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from isoexec.megatron.canonical_base import site_binding
from isoexec.megatron.model_builder import build_model
from isoexec.megatron.scoring import score
from isoexec.megatron.weights import load_hf_weights
from isoexec.ops import call_verify
from isoexec.ops.binding import SiteOps, UnboundCallError
from isoexec.ops.call_verify import VERIFY_CALLS_ENV, WrongCallError

SEQS = [[1, 5, 9, 2, 7, 3], [4, 4, 8]]


@pytest.fixture
def verify(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Verify mode for one test; the process-wide hooks removed afterwards."""
    monkeypatch.setenv(VERIFY_CALLS_ENV, "1")
    call_verify.reset_verified_calls()
    try:
        yield
    finally:
        call_verify.remove_hooks()


@pytest.fixture(scope="module")
def gdn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from isoexec.tools.tiny_models import make_tiny_model

    return make_tiny_model("tiny-gdn", tmp_path_factory.mktemp("gdn_verify"), seed=3)


def _model(ckpt: Path) -> torch.nn.Module:
    model = build_model(ckpt, isoexec=True)
    load_hf_weights(model, ckpt)
    return model


def _layer(model: torch.nn.Module, i: int = 0) -> torch.nn.Module:
    return model.decoder.layers[i]  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize(
    ("ckpt", "ops"),
    [
        ("qwen3_dir", {"linear", "rms_norm", "rope", "attention", "silu_mul", "logprobs"}),
        ("qwen3_moe_dir", {"linear", "rms_norm", "rope", "attention", "moe_router", "moe_combine"}),
        ("gdn_dir", {"gdn_conv", "gdn_recurrence", "gated_rms_norm", "attn_output_gate"}),
    ],
)
def test_every_site_call_is_verified(parallel, verify, request, ckpt: str, ops: set[str]) -> None:
    """A whole model scores in verify mode without a refusal, and the calls of every op kind
    it runs were checked (counted per op)."""
    model = _model(request.getfixturevalue(ckpt))
    (lp, _) = score(model, SEQS)
    assert torch.isfinite(lp).all()
    checked = {key.split(":")[0] for key in call_verify.verified_calls()}
    assert ops <= checked, sorted(checked)


def _score(model: torch.nn.Module) -> None:
    score(model, SEQS)


def _foreign_binding(model: torch.nn.Module) -> None:
    """o_proj calls through a binding of another variant (other block rows) than it records."""
    o_proj = _layer(model).self_attention.linear_proj
    o_proj.ops = SiteOps([site_binding(o_proj.config, "linear", block_rows=16)])


def _record_replaced(model: torch.nn.Module) -> None:
    """The MLP norm's record is replaced on the instance; its binding is unchanged."""
    from isoexec import ops

    norm = _layer(model).pre_mlp_layernorm
    norm.isoexec_impl = ops.get_impl("rms_norm", accum="fp64")


def _native_forward(model: torch.nn.Module) -> None:
    """The input norm still records the canonical op, but its forward is torch's own."""
    norm = _layer(model).input_layernorm
    norm.forward = lambda x: torch.nn.functional.rms_norm(
        x, norm.weight.shape, norm.weight, norm.eps
    )


def _past_the_binding(model: torch.nn.Module) -> None:
    """The core attention calls `isoexec.ops` directly, with another lane count than the one it
    records (the fault of `integration/_faults.py`, which also replaces the record)."""
    from integration._faults import narrow_attention_lanes

    narrow_attention_lanes(_layer(model).self_attention.core_attention)


@pytest.mark.parametrize(
    ("inject", "refusal"),
    [
        (_foreign_binding, "a call of linear from .*block_rows=16.* ran in it"),
        (_record_replaced, "records .*accum=fp64.* but its binding ran rms_norm"),
        (_native_forward, "records rms_norm .* but no call of it ran"),
        (_past_the_binding, "records attention .* but no call of it ran"),
    ],
)
def test_injected_wrong_call_is_refused_only_in_verify_mode(
    parallel, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch, inject: Callable, refusal: str
) -> None:
    quiet = _model(qwen3_dir)
    inject(quiet)
    _score(quiet)  # negative control: without the mode, the wrong call runs unnoticed

    monkeypatch.setenv(VERIFY_CALLS_ENV, "1")
    try:
        model = _model(qwen3_dir)  # bound in verify mode
        _score(model)  # untouched: no refusal
        inject(model)
        with pytest.raises(WrongCallError, match=refusal):
            _score(model)
    finally:
        call_verify.remove_hooks()


def test_a_site_reaches_only_its_ops(parallel, qwen3_dir: Path) -> None:
    """A site's `ops` has its bound ops' functions and nothing else (no verify mode needed)."""
    norm = _layer(_model(qwen3_dir)).input_layernorm
    assert callable(norm.ops.rms_norm)
    with pytest.raises(UnboundCallError, match=r"bound to \[rms_norm\] called 'linear'"):
        norm.ops.linear  # noqa: B018
    assert getattr(norm.ops, "linear", None) is None  # an AttributeError, as Python expects


def test_switch_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VERIFY_CALLS_ENV, "yes")
    with pytest.raises(ValueError, match=r"use 1 \(on\) or 0 \(off\)"):
        call_verify.verify_calls_enabled()
    monkeypatch.setenv(VERIFY_CALLS_ENV, "0")
    assert call_verify.verify_calls_enabled() is False
