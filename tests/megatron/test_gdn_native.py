"""The native arm of the GDN hybrids (Qwen3-Next `tiny-gdn`, Qwen3.5 text `tiny-qwen35`):
`build_model(isoexec=False)`, stock Megatron-core modules only.

GDN layers are Megatron's own `GatedDeltaNet` (fused `in_proj` [q | k | v | z | b | a],
`conv1d`, `out_norm`, `out_proj`, its chunked delta rule), full-attention layers Megatron's
`SelfAttention` with `attention_output_gate`, zero-centred norms from
`layernorm_zero_centered_gamma`, Qwen3-Next's shared expert Megatron's `SharedExpertMLP` with
its gate. On this CPU they run through `cpu_shims` (no fla, no TE, no CUDA).

Against HF transformers (fp32, its torch fallbacks: chunked delta rule, eager attention) the
native arm is close, not bitwise: measured max |Δ logprob| ≈ 4e-6 (tiny-gdn) and 1.5e-6
(tiny-qwen35) on these sequences; the tolerance 2e-5 is the one the isoexec arm uses against
HF, and a mapping error (swapped q/k in the GDN projection) moves logprobs by > 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isoexec import ops
from isoexec.contract.sites import model_sites
from isoexec.megatron.hf_config import _read_source, load_hf_config
from isoexec.megatron.model_builder import build_model
from isoexec.megatron.readback import read_sites, trainer_contract
from isoexec.megatron.scoring import score, train_step
from isoexec.megatron.weights import (
    export_hf_weights,
    load_hf_weights,
    read_hf_state_dict,
    save_hf_safetensors,
)

pytestmark = pytest.mark.trainer

VOCAB = 512
PRESETS = ("tiny-gdn", "tiny-qwen35")
TOLERANCE = 2e-5  # max |Δ logprob| native Megatron vs HF transformers, fp32


@pytest.fixture(scope="module", params=PRESETS)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from isoexec.tools.tiny_models import make_tiny_model

    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), seed=7)


@pytest.fixture(scope="module")
def seqs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (2, 13, 37, 5)]


@pytest.fixture(scope="module")
def hf_logprobs(ckpt: Path, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF transformers' own model (Qwen3NextForCausalLM / Qwen3_5ForCausalLM), fp32, CPU."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    assert type(hf).__name__ == load_hf_config(ckpt).architecture
    with torch.no_grad():
        return [ops.token_logprobs(hf(s[None]).logits[0, :-1].float(), s[1:]) for s in seqs]


def _native(ckpt: Path, weights: Path | dict[str, torch.Tensor] | None = None, **kw):
    model = build_model(ckpt, isoexec=False, **kw)
    load_hf_weights(model, ckpt if weights is None else weights)
    return model


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------------------------
# native Megatron vs HF transformers
# ------------------------------------------------------------------------------------------


def test_native_close_to_hf_transformers_fp32(parallel, ckpt: Path, seqs, hf_logprobs) -> None:
    model = _native(ckpt)
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    assert type(model.decoder.layers[0].self_attention) is GatedDeltaNet
    worst = _worst(score(model, seqs), hf_logprobs)
    print(f"{ckpt.name} fp32: native Megatron vs HF transformers max |dlogprob| = {worst:.2e}")
    assert worst < TOLERANCE
    # The distributions are far from uniform, so the comparison has power.
    assert float(torch.cat(hf_logprobs).std()) > 0.5


def _swap_gdn_q_k(sd: dict[str, torch.Tensor], arch, layer: int) -> None:
    """Swap the q and k rows of one GDN layer's input projection, in the checkpoint's layout:
    what a q/k mix-up in the native `in_proj` mapping would load."""
    gdn = arch.gdn
    la = f"model.layers.{layer}.linear_attn."
    kd, hk = gdn.key_head_dim, gdn.num_key_heads
    if gdn.layout == "flat":  # in_proj_qkv rows [q | k | v]
        w = sd[la + "in_proj_qkv.weight"].clone()
        q, k = w[: hk * kd].clone(), w[hk * kd : 2 * hk * kd].clone()
        w[: hk * kd], w[hk * kd : 2 * hk * kd] = k, q
        sd[la + "in_proj_qkv.weight"] = w
    else:  # in_proj_qkvz per key-head group [q_g | k_g | v_g | z_g]
        w = sd[la + "in_proj_qkvz.weight"].clone()
        g = w.view(hk, -1, w.shape[-1])
        q, k = g[:, :kd].clone(), g[:, kd : 2 * kd].clone()
        g[:, :kd], g[:, kd : 2 * kd] = k, q
        sd[la + "in_proj_qkvz.weight"] = w


def test_native_wrong_gdn_mapping_is_detected(parallel, ckpt: Path, seqs, hf_logprobs) -> None:
    """Negative control: q and k swapped in one GDN projection fails the comparison."""
    arch = load_hf_config(ckpt)
    sd = read_hf_state_dict(ckpt)
    layer = arch.kinds.index("linear_attention")
    _swap_gdn_q_k(sd, arch, layer)
    worst = _worst(score(_native(ckpt, sd), seqs), hf_logprobs)
    assert worst > 1e-3, worst


# ------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------


def test_native_hf_megatron_hf_round_trip_bit_exact(parallel, ckpt: Path, tmp_path: Path) -> None:
    original = read_hf_state_dict(ckpt)
    model = _native(ckpt)
    exported = dict(export_hf_weights(model))
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    # ... and back through a file into a fresh model: identical parameters.
    save_hf_safetensors(model, tmp_path / "model.safetensors")
    again = _native(ckpt, tmp_path)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_native_gdn_in_proj_layout(parallel, ckpt: Path) -> None:
    """Megatron's fused `in_proj` holds [q | k | v | z | b | a], each head-major: from
    Qwen3.5 the split tensors stacked, from Qwen3-Next the per-group tensors regrouped."""
    arch = load_hf_config(ckpt)
    gdn = arch.gdn
    hk, hv, kd, vd = gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim
    r = hv // hk
    hf = read_hf_state_dict(ckpt)
    i = arch.kinds.index("linear_attention")
    la = f"model.layers.{i}.linear_attn."
    w = _native(ckpt).decoder.layers[i].self_attention.in_proj.weight
    q, k, v, z, b, a = w.split([hk * kd, hk * kd, hv * vd, hv * vd, hv, hv])
    if gdn.layout == "flat":
        assert torch.equal(torch.cat([q, k, v]), hf[la + "in_proj_qkv.weight"])
        for got, name in ((z, "z"), (b, "b"), (a, "a")):
            assert torch.equal(got, hf[la + f"in_proj_{name}.weight"]), name
    else:
        qkvz = hf[la + "in_proj_qkvz.weight"].view(hk, 2 * kd + 2 * r * vd, -1)
        ba = hf[la + "in_proj_ba.weight"].view(hk, 2 * r, -1)
        assert torch.equal(q.view(hk, kd, -1), qkvz[:, :kd])
        assert torch.equal(k.view(hk, kd, -1), qkvz[:, kd : 2 * kd])
        assert torch.equal(v.view(hk, r * vd, -1), qkvz[:, 2 * kd : 2 * kd + r * vd])
        assert torch.equal(z.view(hk, r * vd, -1), qkvz[:, 2 * kd + r * vd :])
        assert torch.equal(b.view(hk, r, -1), ba[:, :r])
        assert torch.equal(a.view(hk, r, -1), ba[:, r:])


# ------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------


def test_native_train_step(parallel, ckpt: Path, seqs) -> None:
    model = _native(ckpt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = [train_step(model, opt, seqs[:3]) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert no_grad == [], no_grad
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    i = load_hf_config(ckpt).kinds.index("linear_attention")
    for p in ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "out_norm.weight"):
        assert f"decoder.layers.{i}.self_attention.{p}" in changed, p
    assert changed == set(before)


# ------------------------------------------------------------------------------------------
# packing: the native arm cannot pack, and its bits depend on the batch
# ------------------------------------------------------------------------------------------


def _batched_logprobs(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Native Megatron on a right-padded [B, L] batch (causal: padding comes after every real
    token, so mathematically nothing changes; only the kernel shapes do)."""
    length = max(s.numel() for s in seqs)
    batch = torch.zeros(len(seqs), length, dtype=torch.int64)
    for row, s in enumerate(seqs):
        batch[row, : s.numel()] = s
    with torch.no_grad():
        logits = model.eval()(batch, torch.arange(length).expand(len(seqs), -1), None)
    return [ops.token_logprobs(logits[r, : s.numel() - 1], s[1:]) for r, s in enumerate(seqs)]


def test_native_packing_negative_control(parallel, tmp_path: Path) -> None:
    """Megatron's `GatedDeltaNet` refuses packed (THD) sequences, which is why native scoring
    runs one sequence per forward. Batching them instead (right-padded [B, L]) is the same
    maths (fp32: equal to ~1e-6) but changes the bits (bf16: by O(0.1) here, through 4
    recurrent layers). The isoexec arm is bitwise independent of packing
    (test_gdn_trainer.py, test_qwen35_trainer.py)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from isoexec.tools.tiny_models import make_tiny_model

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (7, 30, 45)]
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        ckpt = make_tiny_model("tiny-gdn", tmp_path / name, dtype=name, seed=4)
        model = _native(ckpt, dtype=dtype)
        worst[name] = _worst(score(model, seqs), _batched_logprobs(model, seqs))
    print(f"tiny-gdn native: batched vs alone max |dlogprob| = {worst}")
    assert worst["float32"] < 1e-4  # no leak across sequences: a rounding difference only
    assert worst["bfloat16"] > 0, "negative control: stock Megatron changes bits with the batch"

    cu = torch.tensor([0, 7, 37], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=30, max_seqlen_kv=30
    )
    ids = torch.cat(seqs[:2])[None]
    pos = torch.cat([torch.arange(7), torch.arange(30)])[None]
    with pytest.raises(NotImplementedError, match="packed sequence"), torch.no_grad():
        model(ids, pos, attention_mask=None, packed_seq_params=packed)


# ------------------------------------------------------------------------------------------
# contract
# ------------------------------------------------------------------------------------------


def test_native_contract_reports_native_gdn_sites(parallel, ckpt: Path) -> None:
    cfg = _read_source(ckpt)
    native = trainer_contract(build_model(ckpt), ckpt, torch.float32)
    assert native.site_names == tuple(s.name for s in model_sites(cfg))
    assert set(native.native_sites) == set(native.site_names)
    sites = read_sites(build_model(ckpt), ckpt)
    i = load_hf_config(ckpt).kinds.index("linear_attention")
    want = {
        "in_proj_qkvz": "native:ColumnParallelLinear",  # one fused GEMM for both projections
        "in_proj_ba": "native:ColumnParallelLinear",
        "conv": "native:GatedDeltaNet",
        "recurrence": "native:GatedDeltaNet",
        "norm": "native:RMSNorm",  # plain gain, as HF's gated norm
        "out_proj": "native:RowParallelLinear",
    }
    for site, impl in want.items():
        assert sites[f"layers.{i}.linear_attn.{site}"].impl_id == impl, site
    assert sites[f"layers.{i}.input_norm"].impl_id == "native:ZeroCenteredTorchRMSNorm"
    j = load_hf_config(ckpt).kinds.index("attention")
    assert sites[f"layers.{j}.self_attn.core"].impl_id == "native:DotProductAttention"
    assert sites[f"layers.{j}.self_attn.q_norm"].impl_id == "native:ZeroCenteredTorchRMSNorm"
    iso = trainer_contract(build_model(ckpt, isoexec=True), ckpt, torch.float32)
    assert iso.native_sites == () and iso.site_names == native.site_names
    assert iso.hash != native.hash
