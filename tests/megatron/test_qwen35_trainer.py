"""Trainer side of Qwen3.5 text (tiny-qwen35: GDN, gated attention, GDN, gated attention; a dense
SwiGLU MLP in every layer; split GDN projections in the checkpoint), isoexec mode.

The reference is the engine's composition of canonical ops (`isoexec.vllm.qwen3_5`: Qwen3-Next
blocks with the non-interleaved GDN layout): the GDN projections GEMM'd fused as vLLM holds them,
`[in_proj_qkv; in_proj_z]` and `[in_proj_b; in_proj_a]`, then split flat; zero-centred norms
with the fused residual add; conv + token-serial recurrence from zero state; gated output norm;
partial RoPE (the checkpoint's M-RoPE sections are moot for text); `out * sigmoid(gate)`;
`silu_mul` MLP. Megatron keeps its own layouts (gated QKV interleaved per group), adds residuals
itself and packs sequences, so bitwise equality here is what makes trainer == engine
(integration/test_trainer_engine.py checks it against the real engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isoexec import ops
from isoexec.contract.sites import model_sites
from isoexec.megatron.hf_config import UnsupportedConfigError, _read_source, load_hf_config
from isoexec.megatron.model_builder import build_model
from isoexec.megatron.readback import trainer_contract
from isoexec.megatron.scoring import score
from isoexec.megatron.weights import export_hf_weights, load_hf_weights, read_hf_state_dict

pytestmark = pytest.mark.trainer

VOCAB = 512
PRESET = "tiny-qwen35"


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from isoexec.tools.tiny_models import make_tiny_model

    return make_tiny_model(PRESET, tmp_path_factory.mktemp("q35_32"), seed=5)


@pytest.fixture(scope="module")
def q35_bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from isoexec.tools.tiny_models import make_tiny_model

    return make_tiny_model(PRESET, tmp_path_factory.mktemp("q35_16"), dtype="bfloat16", seed=6)


@pytest.fixture(scope="module")
def seqs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (2, 13, 37, 5)]


def _model(ckpt: Path, dtype: torch.dtype = torch.float32):
    model = build_model(ckpt, isoexec=True, dtype=dtype)
    load_hf_weights(model, ckpt)
    return model


# ------------------------------------------------------------------------------------------
# the reference: canonical ops, composed as the engine composes them
# ------------------------------------------------------------------------------------------


def _gdn_reference(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The engine's non-interleaved GDN layer for one request from empty state."""
    n = x.shape[0]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    qkvz = ops.linear(x, torch.cat([w[p + "in_proj_qkv.weight"], w[p + "in_proj_z.weight"]]))
    mixed, z = qkvz.split([2 * hk * kd + hv * vd, hv * vd], dim=-1)
    b, a = ops.linear(x, torch.cat([w[p + "in_proj_b.weight"], w[p + "in_proj_a.weight"]])).chunk(
        2, dim=-1
    )
    conv_w = w[p + "conv1d.weight"]
    y, _ = ops.gdn_conv(mixed, conv_w.view(conv_w.shape[0], -1), None)
    q, k, v = y.split([hk * kd, hk * kd, hv * vd], dim=-1)
    o, _ = ops.gdn_recurrence(
        q.reshape(n, hk, kd),
        k.reshape(n, hk, kd),
        v.reshape(n, hv, vd),
        a,
        b,
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
    rot = int(d * cfg["rope_parameters"]["partial_rotary_factor"])
    cos, sin = ops.rope_cos_sin(torch.arange(n), rot, cfg["rope_parameters"]["rope_theta"])
    cu = torch.tensor([0, n], dtype=torch.int32)

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
            o = ops.attn_output_gate(o.reshape(n, h * d), gate.reshape(n, h * d))
            x = ops.linear(o, w[a + "o_proj.weight"])
        x, residual = norm(x, p + "post_attention_layernorm.weight", residual)
        m = p + "mlp."
        gate_up = ops.linear(x, torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]))
        x = ops.linear(ops.silu_mul(gate_up), w[m + "down_proj.weight"])
    x, _ = norm(x, "model.norm.weight", residual)
    logits = ops.linear(x, w["lm_head.weight"])
    return ops.token_logprobs(logits[:-1], seq[1:], temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qwen35_logprobs_equal_reference_composition(
    parallel, q35_dir: Path, dtype: torch.dtype, seqs
) -> None:
    """bf16 from an fp32 checkpoint also checks A_log is not rounded (the engine keeps fp32)."""
    model = _model(q35_dir, dtype)
    assert model.decoder.layers[0].self_attention.A_log.dtype == torch.float32
    for temp in (1.0, 0.7):
        got = score(model, seqs, temperature=temp)  # all sequences in one packed forward
        for seq, lp in zip(seqs, got, strict=True):
            want = reference_logprobs(q35_dir, seq, dtype, temp)
            assert lp.shape == (seq.numel() - 1,)
            assert torch.equal(lp, want), (dtype, temp, seq.numel(), (lp - want).abs().max())


def test_qwen35_bf16_checkpoint_packing_and_reference(parallel, q35_bf16_dir: Path, seqs) -> None:
    model = _model(q35_bf16_dir, torch.bfloat16)
    base = score(model, seqs)
    for seq, lp in zip(seqs[1:3], base[1:3], strict=True):
        assert torch.equal(lp, reference_logprobs(q35_bf16_dir, seq, torch.bfloat16, 1.0))
    for arm in (score(model, seqs, max_tokens=1), score(model, seqs, pad_to_multiple=64)):
        for a, b in zip(base, arm, strict=True):
            assert torch.equal(a, b)


def test_qwen35_close_to_hf_transformers_fp32(parallel, q35_dir: Path, seqs) -> None:
    """The architecture mapping against transformers' own `Qwen3_5ForCausalLM` (its chunked
    delta rule, real M-RoPE with equal T/H/W positions, its own roundings): not bitwise, so a
    tolerance. Measured max |Δ logprob| ≈ 1e-6 here; 2e-5 is 10× the fp32 noise of this model
    and far below what a mapping error gives (a swapped projection or gate moves logprobs by
    O(0.1))."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(q35_dir), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    ours = score(_model(q35_dir), seqs)
    worst = 0.0
    for seq, lp in zip(seqs, ours, strict=True):
        with torch.no_grad():
            logits = hf(seq[None]).logits[0].float()
        want = torch.log_softmax(logits[:-1], -1).gather(-1, seq[1:, None])[:, 0]
        worst = max(worst, float((lp - want).abs().max()))
    print(f"{PRESET} fp32: isoexec trainer vs HF transformers max |dlogprob| = {worst:.2e}")
    assert 0 < worst < 2e-5


def test_qwen35_weight_round_trip_and_fused_layout(
    parallel, q35_dir: Path, q35_bf16_dir: Path
) -> None:
    for ckpt, dtype in ((q35_dir, torch.float32), (q35_bf16_dir, torch.bfloat16)):
        hf = read_hf_state_dict(ckpt)
        model = _model(ckpt, dtype)
        out = dict(export_hf_weights(model))
        assert out.keys() == hf.keys()
        for name, t in hf.items():
            if name.endswith("A_log"):  # held (and exported) in fp32, as the engine holds it
                assert out[name].dtype == torch.float32
                assert torch.equal(out[name], t.float()), name
            else:
                assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    # The trainer GEMMs exactly the fused weights the engine holds: [qkv; z] and [b; a].
    gdn = model.decoder.layers[2].self_attention
    la = "model.layers.2.linear_attn."
    assert gdn.qkvz_layout == "flat"
    qkvz = torch.cat([hf[la + "in_proj_qkv.weight"], hf[la + "in_proj_z.weight"]])
    assert torch.equal(gdn.in_proj_qkvz.weight, qkvz)
    ba = torch.cat([hf[la + "in_proj_b.weight"], hf[la + "in_proj_a.weight"]])
    assert torch.equal(gdn.in_proj_ba.weight, ba)


def test_qwen35_contract_every_site_canonical(parallel, q35_dir: Path) -> None:
    cfg = _read_source(q35_dir)
    expected = model_sites(cfg)
    model = build_model(q35_dir, isoexec=True)
    c = trainer_contract(model, q35_dir, torch.float32)
    assert c.model.architecture == "Qwen3_5ForCausalLM"
    assert c.model.layer_kinds == ("linear_attention", "attention") * 2
    assert c.site_names == tuple(s.name for s in expected)
    assert c.native_sites == ()
    for s in expected:  # exactly what the engine's canonical classes declare
        assert c.site(s.name).impl == ops.get_impl(s.op), s.name
    rests = {s.name.split(".", 2)[-1] for s in expected if s.name.startswith("layers.")}
    assert {"linear_attn.in_proj_qkvz", "linear_attn.recurrence", "mlp.act"} <= rests
    assert not any("router" in r or "experts" in r for r in rests)  # dense MLP everywhere
    assert c.dtypes.recurrent_state == "float32"


def test_qwen35_refusals(parallel, q35_dir: Path, seqs) -> None:
    # The native arm builds (stock GatedDeltaNet, tests/megatron/test_gdn_native.py) but, like
    # every native model, cannot pack sequences.
    with pytest.raises(ValueError, match="isoexec models only"):
        score(build_model(q35_dir), seqs, max_tokens=40)
    cfg = _read_source(q35_dir)
    rope = cfg["rope_parameters"]
    for patch, match in (
        ({"num_experts": 8}, "dense MLP"),
        ({"layer_scale": True}, "layer_scale"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "sliding_attention"),
        ({"rope_parameters": rope | {"rope_type": "yarn"}}, "rope_type"),
        ({"rope_parameters": rope | {"mrope_extra": 1}}, "mrope_extra"),
    ):
        with pytest.raises(UnsupportedConfigError, match=match):
            load_hf_config(cfg | patch)
    # M-RoPE sections are accepted only where text makes them 1-D RoPE (not for Qwen3-Next).
    moe = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8}
    nxt = cfg | moe | {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
    with pytest.raises(UnsupportedConfigError, match="mrope"):
        load_hf_config(nxt | {"shared_expert_intermediate_size": 8})
