"""Trainer isoexec path: Megatron with canonical modules == canonical ops composed as vLLM does.

The reference below is written from the engine side's structure (`isoexec.vllm.layers`,
`attention`, `moe`, `sampler`): HF weights in vLLM's layouts (qkv = [q; k; v], gate_up =
[gate; up], stacked experts), the fused residual norm `x + residual`, rope on [T, H, D], varlen
attention, fp32 logprobs of `logits / T`. Megatron keeps its own layouts (QKV interleaved per
group), adds residuals itself and runs a packed forward, so bitwise equality here is what
makes trainer == engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from isoexec import ops
from isoexec.contract.impl import ImplInfo
from isoexec.contract.sites import model_sites
from isoexec.megatron.canonical_modules import (
    CanonicalSiteError,
    IsoCoreAttention,
    IsoRMSNorm,
    qkv_hf_row_order,
)
from isoexec.megatron.hf_config import _read_source, load_hf_config
from isoexec.megatron.model_builder import build_model
from isoexec.megatron.readback import (
    SiteNotFoundError,
    SiteNotInstalledError,
    read_sites,
    trainer_contract,
    verify_installed,
)
from isoexec.megatron.scoring import score, train_step
from isoexec.megatron.weights import load_hf_weights, read_hf_state_dict
from tests._support.threads import num_threads

pytestmark = pytest.mark.trainer

TEMPS = (1.0, 0.7)


def _model(ckpt: Path, *, isoexec: bool = True, dtype: torch.dtype = torch.float32):
    model = build_model(ckpt, isoexec=isoexec, dtype=dtype)
    load_hf_weights(model, ckpt)
    return model


# ------------------------------------------------------------------------------------------
# the reference: canonical ops, composed as the engine composes them
# ------------------------------------------------------------------------------------------


def reference_logprobs(
    ckpt: Path, seq: torch.Tensor, dtype: torch.dtype, temperature: float
) -> torch.Tensor:
    cfg = _read_source(ckpt)
    arch = load_hf_config(cfg)
    w = {k: v.to(dtype) for k, v in read_hf_state_dict(ckpt).items()}
    n, h, hkv, d, eps = (
        seq.numel(),
        arch.num_attention_heads,
        arch.num_kv_heads,
        arch.head_dim,
        arch.rms_norm_eps,
    )
    cos, sin = ops.rope_cos_sin(torch.arange(n), d, arch.rope_theta)
    cu = torch.tensor([0, n], dtype=torch.int32)
    x = w["model.embed_tokens.weight"][seq]
    residual = None
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        if residual is None:
            residual, x = x, ops.rms_norm(x, w[p + "input_layernorm.weight"], eps)
        else:
            x, residual = ops.rms_norm(x, w[p + "input_layernorm.weight"], eps, residual=residual)
        a = p + "self_attn."
        qkv_w = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
        q, k, v = ops.linear(x, qkv_w).split([h * d, hkv * d, hkv * d], dim=-1)
        q = ops.rms_norm(q.reshape(n, h, d), w[a + "q_norm.weight"], eps)
        k = ops.rms_norm(k.reshape(n, hkv, d), w[a + "k_norm.weight"], eps)
        q, k = ops.apply_rope(q, cos, sin, d), ops.apply_rope(k, cos, sin, d)
        o = ops.attention_varlen(q, k, v.reshape(n, hkv, d), cu, scale=d**-0.5)
        x = ops.linear(o.reshape(n, h * d), w[a + "o_proj.weight"])
        x, residual = ops.rms_norm(
            x, w[p + "post_attention_layernorm.weight"], eps, residual=residual
        )
        m = p + "mlp."
        if arch.moe_layers[i]:
            assert arch.moe is not None
            logits = ops.linear(x, w[m + "gate.weight"])
            tw, ti = ops.moe_router(logits, arch.moe.top_k, renormalize=arch.moe.norm_topk_prob)
            e = range(arch.moe.num_experts)
            w13 = torch.stack(
                [
                    torch.cat(
                        [w[f"{m}experts.{j}.gate_proj.weight"], w[f"{m}experts.{j}.up_proj.weight"]]
                    )
                    for j in e
                ]
            )
            w2 = torch.stack([w[f"{m}experts.{j}.down_proj.weight"] for j in e])
            x = ops.moe_combine(x, tw, ti, w13, w2)
        else:
            gate_up = torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]])
            x = ops.linear(ops.silu_mul(ops.linear(x, gate_up)), w[m + "down_proj.weight"])
    x, _ = ops.rms_norm(x, w["model.norm.weight"], eps, residual=residual)
    head = w["model.embed_tokens.weight"] if arch.tie_word_embeddings else w["lm_head.weight"]
    logits = ops.linear(x, head)
    return ops.token_logprobs(logits[:-1], seq[1:], temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "ckpt_fixture", ["qwen3_dir", "qwen3_tied_dir", "qwen3_moe_dir", "qwen3_moe_nonorm_dir"]
)
def test_logprobs_equal_reference_composition(
    parallel, request, ckpt_fixture: str, dtype: torch.dtype, sequences
) -> None:
    ckpt = request.getfixturevalue(ckpt_fixture)
    model = _model(ckpt, dtype=dtype)
    for temp in TEMPS:
        got = score(model, sequences, temperature=temp)  # all sequences in one packed forward
        for seq, lp in zip(sequences, got, strict=True):
            want = reference_logprobs(ckpt, seq, dtype, temp)
            assert lp.dtype == torch.float32 and lp.shape == (seq.numel() - 1,)
            assert torch.equal(lp, want), (ckpt_fixture, dtype, temp, (lp - want).abs().max())


def test_temperature_changes_logprobs_and_greedy_is_t1(parallel, qwen3_dir: Path, sequences):
    model = _model(qwen3_dir)
    t1, t07, greedy = (score(model, sequences, temperature=t) for t in (1.0, 0.7, 0.0))
    assert not torch.equal(t1[2], t07[2])
    assert all(torch.equal(a, b) for a, b in zip(t1, greedy, strict=True))


def test_raw_logprobs_mode_scores_at_t1_and_is_in_the_contract(
    parallel, qwen3_dir: Path, sequences
) -> None:
    """`IsoExecOptions(logprobs_mode="raw_logprobs")`: every score at T=1 whatever the
    temperature asked, and the logprobs site says so (another contract than processed)."""
    from isoexec.contract.options import IsoExecOptions

    raw = build_model(qwen3_dir, isoexec=True, options=IsoExecOptions(logprobs_mode="raw_logprobs"))
    load_hf_weights(raw, qwen3_dir)
    processed = _model(qwen3_dir)
    at_t1 = score(processed, sequences, temperature=1.0)
    for got, want in zip(score(raw, sequences, temperature=0.7), at_t1, strict=True):
        assert torch.equal(got, want)
    a = trainer_contract(raw, qwen3_dir, torch.float32)
    b = trainer_contract(processed, qwen3_dir, torch.float32)
    assert dict(a.site("logprobs").impl.params)["mode"] == "raw_logprobs"
    assert dict(b.site("logprobs").impl.params)["mode"] == "processed_logprobs"
    assert a.hash != b.hash
    assert [s for s in a.site_names if a.site(s) != b.site(s)] == ["logprobs"]


def test_qkv_row_order_is_the_hf_layout() -> None:
    # 2 groups of (2 q heads, k, v), head_dim 1: Megatron rows q0 q1 k0 v0 q2 q3 k1 v1.
    assert qkv_hf_row_order(4, 2, 1).tolist() == [0, 1, 4, 5, 2, 6, 3, 7]


# ------------------------------------------------------------------------------------------
# packing / padding / micro-batch invariance, with a native negative control
# ------------------------------------------------------------------------------------------


def _invariance_arms(model, seqs: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    order = list(reversed(range(len(seqs))))
    shuffled = score(model, [seqs[i] for i in order])
    return {
        "one pack": score(model, seqs),
        "one per pack": score(model, seqs, max_tokens=1),
        "micro-batches of <=48 tokens": score(model, seqs, max_tokens=48),
        "padded to 64": score(model, seqs, pad_to_multiple=64),
        "micro-batches + padding": score(model, seqs, max_tokens=40, pad_to_multiple=16),
        "reversed order": [shuffled[order.index(i)] for i in range(len(seqs))],
    }


@pytest.mark.parametrize("ckpt_fixture", ["qwen3_dir", "qwen3_moe_dir"])
def test_packing_padding_microbatch_invariance(parallel, request, ckpt_fixture: str) -> None:
    ckpt = request.getfixturevalue(ckpt_fixture)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (3, 17, 40, 33, 1, 8)]
    model = _model(ckpt, dtype=torch.bfloat16)
    arms = _invariance_arms(model, seqs)
    base = arms.pop("one pack")
    for name, got in arms.items():
        for i, (a, b) in enumerate(zip(base, got, strict=True)):
            assert torch.equal(a, b), (ckpt_fixture, name, i)


@pytest.fixture(scope="module")
def wide_bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hidden 1024, bf16: wide enough that stock GEMMs change bits with the batch shape."""
    from isoexec.tools.tiny_models import make_tiny_model

    return make_tiny_model(
        "wide-dense",
        tmp_path_factory.mktemp("wide"),
        dtype="bfloat16",
        seed=5,
        overrides={"num_hidden_layers": 1},
    )


def _native_padded_batch(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Native Megatron on a right-padded [B, L] batch (causal mask: padding is after every
    real token, so mathematically nothing changes; only the GEMM shapes do)."""
    length = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : s.numel()] = s
    pos = torch.arange(length).expand(len(seqs), -1)
    model.eval()
    with torch.no_grad():
        logits = model(ids, pos, attention_mask=None)
    return [ops.token_logprobs(logits[b, : s.numel() - 1], s[1:]) for b, s in enumerate(seqs)]


# Where stock Megatron's batch variance comes from is the BLAS's choice of kernel by shape, and
# that choice is the vendor's: on Intel Xeon (MKL) bf16 changes bits with the batch; on AMD
# EPYC (MKL's AMD path) bf16 did not at these shapes, fp32 did at 2 threads. So the control
# searches this bounded set, in order, and must find a difference in it.
BATCHING_SEARCH = [(torch.bfloat16, 1), (torch.bfloat16, 2), (torch.float32, 1), (torch.float32, 2)]


def test_negative_control_native_batching_differs_isoexec_does_not(
    parallel, wide_bf16_dir: Path
) -> None:
    """Stock Megatron: a sequence scored alone vs in a right-padded batch changes bits under
    some (dtype, threads) of the search; IsoExec under the same conditions changes none."""
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 1024, (n,), generator=g) for n in (7, 30, 45, 45)]
    tried = {}
    for dtype, threads in BATCHING_SEARCH:
        with num_threads(threads):
            native = _model(wide_bf16_dir, isoexec=False, dtype=dtype)
            alone = score(native, seqs)  # batch size 1 per sequence
            batched = _native_padded_batch(native, seqs)
            worst = max(float((a - b).abs().max()) for a, b in zip(alone, batched, strict=True))
            tried[(str(dtype), threads)] = worst
            del native
            iso = _model(wide_bf16_dir, dtype=dtype)
            base = score(iso, seqs)
            for other in (score(iso, seqs, max_tokens=1), score(iso, seqs, pad_to_multiple=64)):
                assert all(torch.equal(a, b) for a, b in zip(base, other, strict=True))
        if worst > 0:
            break
    print("stock Megatron, max |Δ logprob| alone vs batched:", tried)
    assert worst > 0, f"negative control: stock Megatron never changed bits with the batch {tried}"


# ------------------------------------------------------------------------------------------
# training through canonical ops
# ------------------------------------------------------------------------------------------


def test_isoexec_gradients_match_native_and_loss_goes_down(
    parallel, qwen3_moe_dir: Path, sequences
) -> None:
    """Backward through canonical ops is the same maths as Megatron's (allclose, not bitwise)."""
    iso, native = _model(qwen3_moe_dir), _model(qwen3_moe_dir, isoexec=False)
    lr = 0.0  # first step: compare gradients only
    grads = []
    for m in (iso, native):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        train_step(m, opt, sequences)
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-3, atol=1e-6), name
        assert g.abs().sum() > 0, name
    opt = torch.optim.Adam(iso.parameters(), lr=3e-3)
    losses = [train_step(iso, opt, sequences, max_tokens=40) for _ in range(4)]
    assert losses[-1] < losses[0], losses


# ------------------------------------------------------------------------------------------
# contract read-back
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt_fixture", ["qwen3_dir", "qwen3_moe_dir"])
def test_contract_every_site_canonical_in_isoexec_native_otherwise(
    parallel, request, ckpt_fixture: str
) -> None:
    ckpt = request.getfixturevalue(ckpt_fixture)
    cfg = _read_source(ckpt)
    expected = model_sites(cfg)
    iso = build_model(ckpt, isoexec=True)
    c = trainer_contract(iso, ckpt, torch.float32)
    assert c.site_names == tuple(s.name for s in expected)
    assert c.native_sites == ()
    for s in expected:  # exactly what the engine's canonical classes declare
        assert c.site(s.name).impl == ops.get_impl(s.op), s.name
    assert trainer_contract(build_model(ckpt, isoexec=True), cfg, "float32").hash == c.hash

    native = trainer_contract(build_model(ckpt), ckpt)
    assert set(native.native_sites) == set(native.site_names)
    kinds = {s.name.split(".")[-1]: s.impl.impl_id for s in native.sites}
    assert kinds["core"] == "native:DotProductAttention"
    assert kinds["rope"] == "native:RotaryEmbedding"
    assert kinds["qkv_proj"] == "native:ColumnParallelLinear"
    if "experts" in kinds:
        assert kinds["experts"] == "native:SequentialMLP"
        assert kinds["router"] == "native:TopKRouter"
    assert native.hash != c.hash


def test_a_model_cast_after_it_was_built_is_refused(parallel, qwen3_moe_dir: Path) -> None:
    """test_contract_refusals for a MoE model: its GEMM and MoE sites record their kernels for
    the dtype the model was built in (fp32: the grouped expert kernel; bf16: AMX tiles or the
    linear's blocks). Cast to bf16 after the build, those records would be wrong: the contract
    is refused, naming both placements. Control: the same model uncast gives its contract."""
    model = build_model(qwen3_moe_dir, isoexec=True, dtype=torch.float32)
    trainer_contract(model, qwen3_moe_dir)  # as built: accepted
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"library for cpu/float32 \(and MoE.*now runs on cpu/bf"):
        trainer_contract(model, qwen3_moe_dir)


def test_gemm_sites_record_the_library_that_runs_and_the_engine_records_the_same(
    parallel, qwen3_moe_dir: Path, monkeypatch
) -> None:
    """A bf16 trainer's GEMM sites (linears, TP leaves, the router's logits) record the library
    for CPU bf16 (`gemm_library`), which is what the engine's lookup gives in the same place.
    The bf16 MoE experts record the expert GEMM this CPU runs (moe_combine v5: AMX tiles where
    the CPU has them, else the linear's blocks with the same library as the linears); the
    engine's lookup
    gives the same impl."""
    from types import SimpleNamespace

    from isoexec.contract.options import IsoExecOptions
    from isoexec.ops import moe
    from isoexec.ops.gemm import gemm_library

    c = trainer_contract(
        build_model(qwen3_moe_dir, isoexec=True, dtype=torch.bfloat16), qwen3_moe_dir
    )
    gemm_sites = [s for s in c.sites if s.impl.op in ops.GEMM_DTYPES]
    assert {s.impl.op for s in gemm_sites} == {"linear", "moe_router"}  # router logits: a GEMM
    moe_sites = [s for s in c.sites if s.impl.op == "moe_combine"]
    assert moe_sites
    for s in moe_sites:
        params = s.impl.param_dict()
        assert params["kernel"] == moe.expert_gemm(torch.bfloat16), s.name
        if params["kernel"] == moe.LINEAR_BLOCKS:
            assert params["gemm"] == gemm_library("cpu", torch.bfloat16), s.name
        else:
            assert params["kernel"] == moe.AMX_TILES and "gemm" not in params, s.name
    for s in gemm_sites:
        assert s.impl.param_dict()["gemm"] == gemm_library("cpu", torch.bfloat16), s.name
        assert s.impl == ops.get_impl(s.impl.op, device="cpu", dtype=torch.bfloat16), s.name
    leaves = build_model(
        qwen3_moe_dir, isoexec=True, dtype=torch.bfloat16, options=IsoExecOptions(tp_invariant=True)
    )
    o_proj = trainer_contract(leaves, qwen3_moe_dir).site("layers.0.self_attn.o_proj").impl
    assert o_proj.param_dict()["gemm"] == gemm_library("cpu", torch.float32)  # fp32 leaves

    backend = pytest.importorskip("isoexec.vllm.engine_binding")  # the engine's lookup, no engine
    import vllm.config

    engine = SimpleNamespace(
        additional_config={},
        device_config=SimpleNamespace(device_type="cpu"),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
    )
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: engine)
    for s in gemm_sites + moe_sites:
        assert backend.engine_binding(s.impl.op).impl == s.impl, s.name
    assert backend.engine_binding("linear_tp").impl == o_proj
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: None)
    with pytest.raises(RuntimeError, match="outside a vLLM engine"):
        backend.engine_binding("linear")


def test_contract_refusals(parallel, qwen3_dir: Path, qwen3_moe_dir: Path) -> None:
    iso = build_model(qwen3_dir, isoexec=True)
    with pytest.raises(ValueError, match="not the config the model was built from"):
        read_sites(iso, qwen3_moe_dir)
    with pytest.raises(ValueError, match="dtype bfloat16"):
        trainer_contract(iso, qwen3_dir, torch.bfloat16)
    cast = build_model(qwen3_dir, isoexec=True).to(torch.bfloat16)  # sites bound for fp32
    with pytest.raises(ValueError, match="record their library for cpu/float32"):
        trainer_contract(cast, qwen3_dir)
    native = build_model(qwen3_dir)
    with pytest.raises(SiteNotInstalledError, match="not running a canonical op"):
        verify_installed(native)
    iso.rotary_pos_emb = native.rotary_pos_emb  # RoPE would run twice
    with pytest.raises(SiteNotFoundError, match="apply RoPE"):
        read_sites(iso, qwen3_dir)
    with pytest.raises(TypeError, match="build_model"):
        read_sites(torch.nn.Linear(2, 2), qwen3_dir)


def test_site_native_class_recorded_when_a_slot_is_swapped(parallel, qwen3_dir: Path) -> None:
    """A native module placed in an isoexec model shows up as native:<class>, never hidden."""
    iso = build_model(qwen3_dir, isoexec=True)
    native = build_model(qwen3_dir)
    iso.decoder.layers[1].mlp.linear_fc2 = native.decoder.layers[1].mlp.linear_fc2
    sites = read_sites(iso, qwen3_dir)
    assert sites["layers.1.mlp.down_proj"] == ImplInfo.native("linear", "RowParallelLinear")
    with pytest.raises(SiteNotInstalledError, match=r"layers\.1\.mlp\.down_proj"):
        verify_installed(iso)


# ------------------------------------------------------------------------------------------
# refusals of the canonical modules
# ------------------------------------------------------------------------------------------


def test_canonical_module_refusals(parallel, qwen3_dir: Path, sequences) -> None:
    from megatron.core.transformer.enums import AttnMaskType

    iso = _model(qwen3_dir)
    cfg = iso.config
    with pytest.raises(CanonicalSiteError, match="mask type"):
        IsoCoreAttention(cfg, 1, AttnMaskType.padding, "self")
    with pytest.raises(CanonicalSiteError, match="RoPE base"):
        IsoCoreAttention(build_model(qwen3_dir).config, 1, AttnMaskType.causal, "self")
    with pytest.raises(CanonicalSiteError, match="not RMSNorm"):
        IsoRMSNorm(dataclasses.replace(cfg, normalization="LayerNorm"), 8)
    seq = sequences[1]
    with pytest.raises(CanonicalSiteError, match="attention_mask"):
        iso(
            seq[None],
            torch.arange(seq.numel())[None],
            attention_mask=torch.ones(1, 1, seq.numel(), seq.numel(), dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="isoexec models only"):
        score(build_model(qwen3_dir), sequences, max_tokens=8)
    with pytest.raises(ValueError, match="temperature"):
        score(iso, sequences, temperature=-1.0)
