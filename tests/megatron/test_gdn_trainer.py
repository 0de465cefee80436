"""Trainer side of Qwen3-Next (tiny-gdn: 3 GDN layers + 1 gated full-attention layer, MoE with a
gated shared expert in every layer), isoexec mode.

The reference below is the engine's composition of canonical ops, written from
`isoexec.vllm.gdn` / `moe` / `layers`: HF weights in vLLM's layouts (fused qkvz/ba GEMMs on HF's
per-group layout, qkv = [q_proj; k_proj; v_proj] with q_proj per head [q_h; gate_h]), zero-centred
norms with the fused residual add, GDN conv + token-serial recurrence from zero state, gated
output norm, partial RoPE, attention gate `out * sigmoid(gate)` in the model dtype, MoE with
the shared expert inside `moe_combine`. Megatron keeps its own layouts (gated QKV interleaved
per group), adds residuals itself and packs sequences, so bitwise equality here is what makes
trainer == engine (integration/test_trainer_engine.py checks it against the real engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isoexec import ops
from isoexec.contract.impl import ImplInfo
from isoexec.contract.sites import model_sites
from isoexec.megatron.canonical_modules import CanonicalSiteError, qkv_hf_row_order
from isoexec.megatron.gdn import ATTN_OUTPUT_GATE_IMPL
from isoexec.megatron.hf_config import UnsupportedConfigError, _read_source, load_hf_config
from isoexec.megatron.model_builder import build_model
from isoexec.megatron.readback import (
    SiteNotInstalledError,
    read_sites,
    trainer_contract,
    verify_installed,
)
from isoexec.megatron.scoring import score, train_step
from isoexec.megatron.weights import export_hf_weights, load_hf_weights, read_hf_state_dict
from isoexec.ops import _pointwise as pw

pytestmark = pytest.mark.trainer

VOCAB = 512


@pytest.fixture(scope="module")
def gdn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from isoexec.tools.tiny_models import make_tiny_model

    return make_tiny_model("tiny-gdn", tmp_path_factory.mktemp("gdn32"), seed=3)


@pytest.fixture(scope="module")
def gdn_bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from isoexec.tools.tiny_models import make_tiny_model

    return make_tiny_model("tiny-gdn", tmp_path_factory.mktemp("gdn16"), dtype="bfloat16", seed=4)


@pytest.fixture(scope="module")
def seqs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (2, 13, 37, 5)]


def _model(ckpt: Path, dtype: torch.dtype = torch.float32):
    model = build_model(ckpt, isoexec=True, dtype=dtype)
    load_hf_weights(model, ckpt)
    return model


# ------------------------------------------------------------------------------------------
# the reference: canonical ops, composed as the engine composes them
# ------------------------------------------------------------------------------------------


def _gdn_reference(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """`IsoQwenGatedDeltaNetAttention._canonical_forward` for one request from empty state."""
    n = x.shape[0]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r = hv // hk
    qkvz = ops.linear(x, w[p + "in_proj_qkvz.weight"]).view(n, hk, 2 * kd + 2 * r * vd)
    q, k, v, z = torch.split(qkvz, [kd, kd, r * vd, r * vd], dim=2)
    b, a = torch.split(ops.linear(x, w[p + "in_proj_ba.weight"]).view(n, hk, 2 * r), [r, r], 2)
    mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], -1)
    conv_w = w[p + "conv1d.weight"]
    y, _ = ops.gdn_conv(mixed, conv_w.view(conv_w.shape[0], -1), None)
    q, k, v = y.split([hk * kd, hk * kd, hv * vd], dim=-1)
    o, _ = ops.gdn_recurrence(
        q.reshape(n, hk, kd),
        k.reshape(n, hk, kd),
        v.reshape(n, hv, vd),
        a.reshape(n, hv),
        b.reshape(n, hv),
        w[p + "A_log"],
        w[p + "dt_bias"],
        None,
    )
    core = ops.gated_rms_norm(
        o.to(x.dtype), z.reshape(n, hv, vd), w[p + "norm.weight"], cfg["rms_norm_eps"]
    )
    return ops.linear(core.reshape(n, hv * vd), w[p + "out_proj.weight"])


def reference_logprobs(
    ckpt: Path, seq: torch.Tensor, dtype: torch.dtype, temperature: float
) -> torch.Tensor:
    cfg = _read_source(ckpt)
    arch = load_hf_config(cfg)
    raw = read_hf_state_dict(ckpt)
    # vLLM holds A_log in fp32 whatever the model dtype; everything else in the model dtype.
    w = {k: v.float() if k.endswith("A_log") else v.to(dtype) for k, v in raw.items()}
    n, h, hkv, d, eps = (
        seq.numel(),
        arch.num_attention_heads,
        arch.num_kv_heads,
        arch.head_dim,
        arch.rms_norm_eps,
    )
    rot = int(d * cfg["partial_rotary_factor"])
    cos, sin = ops.rope_cos_sin(torch.arange(n), rot, arch.rope_theta)
    cu = torch.tensor([0, n], dtype=torch.int32)
    assert arch.moe is not None

    def norm(x: torch.Tensor, key: str, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, w[key], eps, zero_centered=True, residual=residual)

    x = w["model.embed_tokens.weight"][seq]
    residual = None
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        if residual is None:
            residual, x = x, norm(x, p + "input_layernorm.weight")
        else:
            x, residual = norm(x, p + "input_layernorm.weight", residual)
        if kind == "linear_attention":
            x = _gdn_reference(w, p + "linear_attn.", x, cfg)
        else:
            a = p + "self_attn."
            qkv_w = torch.cat([w[a + f"{t}_proj.weight"] for t in "qkv"])
            q_gate, k, v = ops.linear(x, qkv_w).split([2 * h * d, hkv * d, hkv * d], dim=-1)
            q, gate = torch.chunk(q_gate.view(n, h, 2 * d), 2, dim=-1)
            q = ops.rms_norm(q.reshape(n, h, d), w[a + "q_norm.weight"], eps, zero_centered=True)
            k = ops.rms_norm(k.reshape(n, hkv, d), w[a + "k_norm.weight"], eps, zero_centered=True)
            q, k = ops.apply_rope(q, cos, sin, rot), ops.apply_rope(k, cos, sin, rot)
            o = ops.attention_varlen(q, k, v.reshape(n, hkv, d), cu, scale=d**-0.5)
            o = o.reshape(n, h * d) * pw.sigmoid(gate.reshape(n, h * d))
            x = ops.linear(o, w[a + "o_proj.weight"])
        x, residual = norm(x, p + "post_attention_layernorm.weight", residual)
        m = p + "mlp."
        logits = ops.linear(x, w[m + "gate.weight"])
        tw, ti = ops.moe_router(logits, arch.moe.top_k, renormalize=arch.moe.norm_topk_prob)
        e = range(arch.moe.num_experts)
        glu = [torch.cat([w[f"{m}experts.{j}.{t}_proj.weight"] for t in ("gate", "up")]) for j in e]
        x = ops.moe_combine(
            x,
            tw,
            ti,
            torch.stack(glu),
            torch.stack([w[f"{m}experts.{j}.down_proj.weight"] for j in e]),
            shared_w13=torch.cat(
                [w[m + "shared_expert.gate_proj.weight"], w[m + "shared_expert.up_proj.weight"]]
            ),
            shared_w2=w[m + "shared_expert.down_proj.weight"],
            shared_gate_w=w[m + "shared_expert_gate.weight"],
        )
    x, _ = norm(x, "model.norm.weight", residual)
    logits = ops.linear(x, w["lm_head.weight"])
    return ops.token_logprobs(logits[:-1], seq[1:], temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gdn_logprobs_equal_reference_composition(
    parallel, gdn_dir: Path, dtype: torch.dtype, seqs
) -> None:
    """bf16 from an fp32 checkpoint also checks A_log is not rounded (the engine keeps fp32)."""
    model = _model(gdn_dir, dtype)
    assert model.decoder.layers[0].self_attention.A_log.dtype == torch.float32
    for temp in (1.0, 0.7):
        got = score(model, seqs, temperature=temp)  # all sequences in one packed forward
        for seq, lp in zip(seqs, got, strict=True):
            want = reference_logprobs(gdn_dir, seq, dtype, temp)
            assert lp.shape == (seq.numel() - 1,)
            assert torch.equal(lp, want), (dtype, temp, seq.numel(), (lp - want).abs().max())


def test_gdn_bf16_checkpoint_equals_reference(parallel, gdn_bf16_dir: Path, seqs) -> None:
    model = _model(gdn_bf16_dir, torch.bfloat16)
    got = score(model, seqs[1:3])
    for seq, lp in zip(seqs[1:3], got, strict=True):
        assert torch.equal(lp, reference_logprobs(gdn_bf16_dir, seq, torch.bfloat16, 1.0))


# ------------------------------------------------------------------------------------------
# packing: GDN state starts from zero at every sequence boundary
# ------------------------------------------------------------------------------------------


def test_gdn_packing_padding_microbatch_invariance(parallel, gdn_bf16_dir: Path) -> None:
    g = torch.Generator().manual_seed(11)
    batch = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 17, 40, 1, 8)]
    model = _model(gdn_bf16_dir, torch.bfloat16)
    base = score(model, batch)
    order = [4, 2, 0, 3, 1]
    shuffled = score(model, [batch[i] for i in order])
    arms = {
        "one per pack": score(model, batch, max_tokens=1),
        "micro-batches of <=45": score(model, batch, max_tokens=45),
        "padded to 64": score(model, batch, pad_to_multiple=64),
        "reordered": [shuffled[order.index(i)] for i in range(len(batch))],
    }
    for name, got in arms.items():
        for i, (a, b) in enumerate(zip(base, got, strict=True)):
            assert torch.equal(a, b), (name, i)
    # Control: the same tokens as ONE sequence carry GDN state (and attention) across the
    # former boundary, so the second part's logprobs change; packing must not do that.
    joined = score(model, [torch.cat([batch[1], batch[4]])])[0]
    assert not torch.equal(joined[batch[1].numel() :], base[4])
    assert torch.equal(joined[: batch[1].numel() - 1], base[1])


# ------------------------------------------------------------------------------------------
# the architecture mapping against HF transformers' own Qwen3-Next
# ------------------------------------------------------------------------------------------


def test_gdn_close_to_hf_transformers_fp32(parallel, gdn_dir: Path, seqs) -> None:
    """Different kernels (HF: chunked delta rule, its own rope/norm roundings), same maths."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gdn_dir), dtype=torch.float32).eval()
    model = _model(gdn_dir)
    ours = score(model, seqs)
    worst = 0.0
    for seq, lp in zip(seqs, ours, strict=True):
        with torch.no_grad():
            logits = hf(seq[None]).logits[0].float()
        want = torch.log_softmax(logits[:-1], -1).gather(-1, seq[1:, None])[:, 0]
        worst = max(worst, float((lp - want).abs().max()))
    print(f"tiny-gdn fp32: isoexec trainer vs HF transformers max |dlogprob| = {worst:.2e}")
    assert 0 < worst < 2e-5


# ------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------


def test_gdn_weight_round_trip(parallel, gdn_dir: Path, gdn_bf16_dir: Path) -> None:
    for ckpt, dtype in ((gdn_dir, torch.float32), (gdn_bf16_dir, torch.bfloat16)):
        hf = read_hf_state_dict(ckpt)
        out = dict(export_hf_weights(_model(ckpt, dtype)))
        assert out.keys() == hf.keys()
        for name, t in hf.items():
            if name.endswith("A_log"):  # held (and exported) in fp32, as the engine holds it
                assert out[name].dtype == torch.float32
                assert torch.equal(out[name], t.float()), name
            else:
                assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_gated_qkv_layout(parallel, gdn_dir: Path) -> None:
    """Megatron's gated QKV rows (per group [q | gate | k | v]) are HF's [q_proj; k; v] rows
    permuted by `qkv_hf_row_order(output_gate=True)`: the GEMM runs on vLLM's exact weight."""
    assert qkv_hf_row_order(2, 1, 1, output_gate=True).tolist() == [0, 2, 1, 3, 4, 5]
    model = _model(gdn_dir)
    hf = read_hf_state_dict(gdn_dir)
    a = "model.layers.3.self_attn."
    fused = torch.cat([hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]])
    qkv = model.decoder.layers[3].self_attention.linear_qkv
    assert torch.equal(qkv.weight[qkv._hf_rows], fused)
    assert model.decoder.layers[3].self_attention.isoexec_impl == ATTN_OUTPUT_GATE_IMPL


# ------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------


def test_gdn_train_step(parallel, gdn_dir: Path, seqs) -> None:
    model = _model(gdn_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    train_step(model, opt, seqs)
    gdn = model.decoder.layers[0].self_attention
    for name in ("A_log", "dt_bias", "conv1d_weight", "in_proj_qkvz.weight", "norm.weight"):
        grad = dict(gdn.named_parameters())[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert no_grad == [], no_grad
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = [train_step(model, opt, seqs, max_tokens=40) for _ in range(3)]
    assert losses[-1] < losses[0], losses


# ------------------------------------------------------------------------------------------
# contract, refusals
# ------------------------------------------------------------------------------------------


def test_gdn_contract_every_site_canonical(parallel, gdn_dir: Path) -> None:
    cfg = _read_source(gdn_dir)
    expected = model_sites(cfg)
    model = build_model(gdn_dir, isoexec=True)
    c = trainer_contract(model, gdn_dir, torch.float32)
    assert c.site_names == tuple(s.name for s in expected)
    assert c.native_sites == ()
    assert {s.name.split(".", 2)[-1] for s in expected} >= {
        "linear_attn.conv",
        "linear_attn.recurrence",
        "linear_attn.norm",
        "self_attn.core",
        "mlp.experts",
    }
    for s in expected:  # exactly what the engine's canonical classes declare
        assert c.site(s.name).impl == ops.get_impl(s.op), s.name
    assert c.dtypes.recurrent_state == "float32"
    bf16 = trainer_contract(build_model(gdn_dir, isoexec=True, dtype=torch.bfloat16), cfg)
    assert bf16.dtypes.params == "bfloat16" and bf16.hash != c.hash


def test_gdn_native_site_is_reported(parallel, gdn_dir: Path) -> None:
    model = build_model(gdn_dir, isoexec=True)
    model.decoder.layers[1].self_attention.norm = torch.nn.RMSNorm(32)
    assert read_sites(model, gdn_dir)["layers.1.linear_attn.norm"] == ImplInfo.native(
        "gated_rms_norm", "RMSNorm"
    )
    with pytest.raises(SiteNotInstalledError, match=r"layers\.1\.linear_attn\.norm"):
        verify_installed(model)


def test_gdn_refusals(parallel, gdn_dir: Path, seqs) -> None:
    # The native arm builds (stock GatedDeltaNet, tests/megatron/test_gdn_native.py) but, like
    # every native model, cannot pack sequences.
    with pytest.raises(ValueError, match="isoexec models only"):
        score(build_model(gdn_dir), seqs, max_tokens=40)
    cfg = _read_source(gdn_dir)
    for patch, match in (
        ({"layer_scale": True}, "layer_scale"),
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"shared_expert_intermediate_size": 0}, "shared expert"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "sliding_attention"),
        ({"layer_types": ["linear_attention"]}, "layer_types"),
        ({"partial_rotary_factor": 0.5}, "disagrees"),
    ):
        with pytest.raises(UnsupportedConfigError, match=match):
            load_hf_config(cfg | patch)
    model = _model(gdn_dir)
    seq = seqs[1]
    with pytest.raises(CanonicalSiteError, match="attention_mask"):
        model.decoder.layers[0].self_attention(
            torch.zeros(seq.numel(), 1, 128), attention_mask=torch.ones(1, dtype=torch.bool)
        )
