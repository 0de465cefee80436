"""TP=2 on CPU: a real 2-process gloo world (`torchrun --nproc-per-node 2`) builds, loads,
scores and trains Qwen3 dense and MoE, and its logprobs are bitwise those of TP=1.

The claim holds in the TP-invariant mode (`IsoExecOptions(tp_invariant=True)`): column-parallel
sites are `ops.linear` on each rank's rows (column-invariant), row-parallel sites the
`linear_tp` leaves (fixed K leaves, exact gather, fixed tree), the output layer gathers the
vocab exactly. Negative control: stock Megatron at TP=2 vs TP=1 differs (its row-parallel
all-reduce sums per-rank rounded partials).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

# fp32 models whose row-parallel K is one BLAS block. Stock TP=2 sums two rounded partials
# and TP=1 runs one GEMM; when the BLAS itself blocks K at the TP split and sums its two blocks'
# partials, the stock arms agree by accident. The BLAS chooses its K blocks by size, and the
# vendor decides: on AMD EPYC, MKL's path cut the presets' K=256 (and K=198, 200, 250) into two
# equal halves, not K=72..144. Here K is 128 (o_proj: 2 heads x 64; down_proj: 128), each
# rank's half 64: no BLAS splits so short a K, so TP=1 is one pass over K and the stock control
# differs on any CPU. (bf16 differs anyway: each rank rounds its partial before the sum.)
NARROW_K = {"num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128}

SEQS = [[3, 17, 250, 9, 44, 101, 7], [5, 5, 480, 2], [11, 300, 77, 61, 499, 23, 8, 90, 151, 4, 0]]


@pytest.fixture(scope="module")
def tp_results(
    model_factory: Callable[[str, str], str],
    run_tp_jobs: Callable[..., list[dict[str, Any]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    from isoexec.tools.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tp-models")
    dense32 = str(make_tiny_model("tiny-dense", root / "dense32", overrides=NARROW_K))
    dense16 = model_factory("tiny-dense", "bfloat16")
    moe32 = str(make_tiny_model("tiny-moe", root / "moe32", overrides=NARROW_K))
    named: dict[str, dict[str, Any]] = {}
    for key, model, dtype in (("dense32", dense32, "float32"), ("dense16", dense16, "bfloat16"),
                              ("moe32", moe32, "float32")):  # fmt: skip
        for tp in (1, 2):
            named[f"{key}-iso-tp{tp}"] = dict(
                model=model, dtype=dtype, tp=tp, isoexec=True, options={"tp_invariant": True},
                round_trip=tp == 2, train=tp == 2 and key != "dense16", contract=key == "dense32",
            )  # fmt: skip
            named[f"{key}-native-tp{tp}"] = dict(model=model, dtype=dtype, tp=tp, isoexec=False)
    named["dense32-iso-default-tp1"] = dict(
        model=dense32, dtype="float32", tp=1, isoexec=True, contract=True
    )
    named["dense32-iso-default-tp2"] = dict(
        model=dense32, dtype="float32", tp=2, isoexec=True, expect_error=True
    )
    results = run_tp_jobs(list(named.values()), SEQS)
    return dict(zip(named, results, strict=True))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _mismatches(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int((x != y).sum()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("family", ["dense32", "dense16", "moe32"])
def test_tp2_logprobs_bitwise_equal_tp1(tp_results: dict, family: str) -> None:
    tp1, tp2 = tp_results[f"{family}-iso-tp1"], tp_results[f"{family}-iso-tp2"]
    assert [lp.numel() for lp in tp2["logprobs"]] == [len(s) - 1 for s in SEQS]
    assert all(torch.isfinite(lp).all() for lp in tp2["logprobs"])
    assert _equal(tp1["logprobs"], tp2["logprobs"])


@pytest.mark.parametrize("family", ["dense32", "dense16", "moe32"])
def test_negative_control_stock_megatron_tp2_differs(tp_results: dict, family: str) -> None:
    """Stock Megatron: TP=2 sums the two ranks' rounded o_proj/fc2 partials; bits move."""
    tp1, tp2 = tp_results[f"{family}-native-tp1"], tp_results[f"{family}-native-tp2"]
    mism = _mismatches(tp1["logprobs"], tp2["logprobs"])
    pairs = zip(tp1["logprobs"], tp2["logprobs"], strict=True)
    close = all(torch.allclose(a, b, atol=5e-2) for a, b in pairs)
    assert close, "native TP=2 is not even close to TP=1: the model is wrong, not the numerics"
    assert mism > 0, f"stock TP=2 == TP=1 bitwise for {family}: the control shows nothing"


def test_tp2_round_trip_and_training(tp_results: dict) -> None:
    for family in ("dense32", "dense16", "moe32"):
        assert tp_results[f"{family}-iso-tp2"]["round_trip_exact"], family
    for family in ("dense32", "moe32"):
        tp2 = tp_results[f"{family}-iso-tp2"]
        # The step's loss is the token-mean NLL of the (bitwise TP=1) logprobs; then it learns.
        nll = -torch.cat(tp2["logprobs"]).double().mean().item()
        assert abs(tp2["loss"] - nll) < 1e-5, (tp2["loss"], nll)
        after = -torch.cat(tp2["logprobs_after_step"]).double().mean().item()
        assert after < nll, (nll, after)


def test_tp_invariant_is_its_own_contract(tp_results: dict) -> None:
    """The leaves linear at o_proj/down_proj is another impl of `linear`: the contract says so
    (an engine running the plain linear there is refused at the handshake)."""
    from isoexec.contract.contract import Contract
    from isoexec.contract.diff import diff

    inv = Contract.from_bytes(tp_results["dense32-iso-tp2"]["contract"])
    plain = Contract.from_bytes(tp_results["dense32-iso-default-tp1"]["contract"])
    # Every site is TP-invariant in this mode: TP=1 and TP=2 trainers have one contract.
    assert {s.tp for s in inv.sites} == {"invariant"}
    assert tp_results["dense32-iso-tp1"]["contract"] == tp_results["dense32-iso-tp2"]["contract"]
    d = diff(plain, inv)
    assert not d.equal
    sites = d.differing_sites
    assert sites and all(s.endswith((".o_proj", ".down_proj")) for s in sites), sites
    assert {x.field for x in d.differences} >= {"impl", "tp"}, d.differences
    assert not _equal(
        tp_results["dense32-iso-default-tp1"]["logprobs"], tp_results["dense32-iso-tp1"]["logprobs"]
    )


def test_tp2_without_tp_invariant_is_refused(tp_results: dict) -> None:
    err = tp_results["dense32-iso-default-tp2"]["error"]
    assert "IsoExecOptions(tp_invariant=True)" in err and "tp=2" in err


# ---- the Triton backend's leaves ----------------------------------------------------------------
TRITON_INV = {"tp_invariant": True, "backend": "triton"}
ROW_PARALLEL = ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight")


def test_triton_backend_row_parallel_site_runs_the_triton_leaves(
    parallel: object, qwen3_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=1, in-process. A Triton trainer with tp_invariant was refused ("tp_invariant with the
    Triton backend is not wired"); it now builds, its row-parallel sites record the Triton
    `linear_tp` impl and call the Triton module's `linear_tp_shard` (spied here and answered by
    the torch op: this process is not under the interpreter, so no kernel can launch)."""
    pytest.importorskip("triton")
    from isoexec import ops
    from isoexec.contract.options import IsoExecOptions
    from isoexec.megatron.model_builder import build_model
    from isoexec.megatron.readback import trainer_contract
    from isoexec.ops.triton import get_triton_impl

    model = build_model(qwen3_dir, isoexec=True, options=IsoExecOptions(**TRITON_INV))
    want = get_triton_impl("linear_tp", leaves=8)
    assert (want.op, want.impl_id, want.backend) == (
        "linear", "isoexec.linear.triton_tp_leaves", "triton"
    )  # fmt: skip
    contract = trainer_contract(model, qwen3_dir)
    row = [s for s in contract.sites if s.name.endswith((".o_proj", ".down_proj"))]
    assert len(row) == 4 and all(s.impl == want for s in row), row
    assert {s.impl.backend for s in contract.sites} == {"triton"}

    xmod = ops.backend_ops("triton")
    calls: list[dict[str, Any]] = []

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        return ops.linear_tp_shard(*args, **kwargs)

    fc2 = model.decoder.layers[0].mlp.linear_fc2
    (binding,) = fc2.ops.bindings  # the site's one binding: Triton's linear_tp
    assert binding.backend == "triton" and binding.impl == want
    assert fc2.ops.linear_tp_shard is xmod.linear_tp_shard
    monkeypatch.setattr(fc2.ops, "linear_tp_shard", spy)
    x = torch.randn(3, 1, fc2.input_size_per_partition, requires_grad=True)
    out, _ = fc2(x)
    assert len(calls) == 1 and calls[0]["tp"] == 1 and calls[0]["leaves"] == 8
    out.sum().backward()
    assert x.grad is not None and fc2.weight.grad is not None


@pytest.fixture(scope="module")
def triton_tp_results(
    run_tp_jobs: Callable[..., list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """A Triton trainer (TRITON_INTERPRET=1 in the ranks) at TP=1 and TP=2, and a torch one,
    each scoring, taking one SGD step and exporting the trained weights."""
    pytest.importorskip("triton")
    from isoexec.tools.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tp-triton")
    model = str(make_tiny_model("tiny-dense", root / "dense32", overrides=NARROW_K))
    named = {
        f"triton-tp{tp}": dict(model=model, dtype="float32", tp=tp, isoexec=True,
                               options=TRITON_INV, train=True, export_after_step=True,
                               contract=True)
        for tp in (1, 2)
    }  # fmt: skip
    named["torch-tp1"] = dict(
        model=model, dtype="float32", tp=1, isoexec=True, options={"tp_invariant": True},
        train=True, export_after_step=True,
    )  # fmt: skip
    results = run_tp_jobs(list(named.values()), SEQS, env={"TRITON_INTERPRET": "1"})
    out = dict(zip(named, results, strict=True))
    out["model"] = {"path": model}
    return out


def test_triton_tp2_bitwise_tp1_and_trains_like_the_torch_ops(triton_tp_results: dict) -> None:
    """Triton leaves at TP=2 (Megatron's gather region collecting them) give TP=1's logprobs bit
    for bit and one contract; the step's gradients reach the row-parallel weights and equal
    the torch canonical ops' (correct, not bitwise: the weights after the step are close)."""
    from isoexec.contract.contract import Contract
    from isoexec.megatron.weights import read_hf_state_dict

    t1, t2, ref = (triton_tp_results[k] for k in ("triton-tp1", "triton-tp2", "torch-tp1"))
    assert _equal(t1["logprobs"], t2["logprobs"])
    assert t1["contract"] == t2["contract"]
    contract = Contract.from_bytes(t2["contract"])
    assert {s.impl.backend for s in contract.sites} == {"triton"}
    assert {s.tp for s in contract.sites} == {"invariant"}
    before = read_hf_state_dict(triton_tp_results["model"]["path"])
    for name in ROW_PARALLEL:
        w0 = before[name].float()
        assert not torch.equal(t2["weights_after_step"][name], w0), f"{name} did not move"
        for got in (t1, t2):
            torch.testing.assert_close(
                got["weights_after_step"][name], ref["weights_after_step"][name],
                rtol=1e-4, atol=1e-5,
            )  # fmt: skip
    for got in (t1, t2):
        nll = -torch.cat(got["logprobs"]).double().mean().item()
        assert abs(got["loss"] - nll) < 1e-5
        assert -torch.cat(got["logprobs_after_step"]).double().mean().item() < nll
