"""Trainer-side foundation: CPU shims, parallel state, HF-exact models, weights, scoring."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from isoexec.megatron.cpu_shims import applied_cpu_shims, apply_cpu_shims
from isoexec.megatron.hf_config import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedConfigError,
    load_hf_config,
)
from isoexec.megatron.model_builder import build_model
from isoexec.megatron.scoring import score, token_logprobs, train_step
from isoexec.megatron.weights import (
    CheckpointMismatchError,
    export_hf_weights,
    hf_weight_names,
    load_hf_weights,
    read_hf_state_dict,
    save_hf_safetensors,
)

pytestmark = pytest.mark.trainer

EXPECTED_SHIMS = {
    "shim_disable_jit_fuser",
    "shim_rotary_embedding_stays_on_cpu",
    "shim_global_memory_buffer_on_cpu",
    "shim_causal_masks_on_cpu",
    "shim_router_gating_on_cpu",
    "shim_moe_utils_without_te",
    "shim_cpu_rng_tracker",
    "shim_tp_mappings_on_cpu",
    "shim_torch_norm_zero_centered_gamma",
    "shim_gated_delta_net_without_fla",
    "shim_gated_delta_net_on_cpu",
    "shim_pipeline_on_cpu",
}


def _hf_logprobs(ckpt: Path, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return [token_logprobs(hf(s.unsqueeze(0)).logits[0], s) for s in seqs]


def _megatron_logprobs(ckpt: Path | dict, seqs: list[torch.Tensor], config_dir: Path):
    model = build_model(config_dir)
    load_hf_weights(model, ckpt)
    return score(model, seqs)


# ------------------------------------------------------------------------------------------
# shims and parallel state
# ------------------------------------------------------------------------------------------


def test_cpu_shims_idempotent_and_reported() -> None:
    first = apply_cpu_shims()
    assert set(first) == EXPECTED_SHIMS
    assert apply_cpu_shims() == first == applied_cpu_shims()
    # Megatron's jit_fuser helpers run eagerly (nothing torch.compile'd is left).
    from megatron.core.transformer import torch_norm

    assert not hasattr(torch_norm.L2Norm._norm, "_torchdynamo_orig_callable")


def test_parallel_context_sets_up_and_tears_down() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from isoexec.megatron.parallel import megatron_parallel

    with megatron_parallel() as info:
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert ps.model_parallel_is_initialized()
        assert (info.world_size, info.rank, info.tp) == (1, 0, 1)
        assert set(info.shims) == EXPECTED_SHIMS
        with pytest.raises(RuntimeError, match="cannot nest"), megatron_parallel():
            pass
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()
    with pytest.raises(ValueError, match="divide the world size"), megatron_parallel(tp=2):
        pass
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()


# ------------------------------------------------------------------------------------------
# smoke: tiny model, forward + backward + logprobs
# ------------------------------------------------------------------------------------------


def test_smoke_forward_backward_logprobs(parallel, qwen3_dir: Path, sequences) -> None:
    model = build_model(qwen3_dir)  # Megatron's own random init, no HF weights
    lps = score(model, sequences)
    assert [lp.shape[0] for lp in lps] == [len(s) - 1 for s in sequences]
    assert all(lp.dtype == torch.float32 and bool((lp <= 0).all()) for lp in lps)
    assert all(torch.isfinite(lp).all() for lp in lps)

    ids = sequences[1]
    logits = model(ids[None], torch.arange(len(ids))[None], attention_mask=None)
    (-token_logprobs(logits[0], ids).mean()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"


# ------------------------------------------------------------------------------------------
# HF equivalence (architecture mapping + weight loading)
# ------------------------------------------------------------------------------------------

CKPTS = ["qwen3_dir", "qwen3_tied_dir", "qwen3_moe_dir", "qwen3_moe_nonorm_dir"]


@pytest.mark.parametrize("ckpt_fixture", CKPTS)
def test_logprobs_match_transformers(parallel, request, ckpt_fixture: str, sequences) -> None:
    ckpt: Path = request.getfixturevalue(ckpt_fixture)
    ours = _megatron_logprobs(ckpt, sequences, ckpt)
    ref = _hf_logprobs(ckpt, sequences)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # The distributions are far from uniform, so the comparison has power.
    assert float(torch.cat(ref).std()) > 0.5


def test_wrong_mapping_is_detected(parallel, qwen3_dir: Path, sequences) -> None:
    """Negative control: swapping gate/up in one layer moves logprobs far beyond the tolerance."""
    sd = read_hf_state_dict(qwen3_dir)
    k_gate, k_up = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    sd[k_gate], sd[k_up] = sd[k_up], sd[k_gate]
    ours = _megatron_logprobs(sd, sequences, qwen3_dir)
    ref = _hf_logprobs(qwen3_dir, sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, ref, strict=True)) > 1e-3


def test_moe_layers_follow_hf_rules(qwen3_moe_dir: Path, qwen3_moe_nonorm_dir: Path) -> None:
    assert load_hf_config(qwen3_moe_dir).moe_layers == (True, False, True)
    assert load_hf_config(qwen3_moe_nonorm_dir).moe_layers == (False, True, False, True)


# ------------------------------------------------------------------------------------------
# weights: bit-exact round trip
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ckpt_fixture", ["qwen3_dir", "qwen3_tied_dir", "qwen3_moe_dir"])
def test_hf_megatron_hf_round_trip_bit_exact(
    parallel, request, ckpt_fixture: str, tmp_path: Path
) -> None:
    ckpt: Path = request.getfixturevalue(ckpt_fixture)
    original = read_hf_state_dict(ckpt)
    model = build_model(ckpt)
    load_hf_weights(model, ckpt)
    exported = dict(export_hf_weights(model))
    assert list(exported) == hf_weight_names(model)
    assert set(exported) == set(original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name

    # ... and back through a file into a fresh model: identical parameters.
    save_hf_safetensors(model, tmp_path / "model.safetensors")
    model2 = build_model(ckpt)
    load_hf_weights(model2, tmp_path)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_export_does_not_alias_parameters(parallel, qwen3_dir: Path) -> None:
    model = build_model(qwen3_dir)
    load_hf_weights(model, qwen3_dir)
    before = dict(export_hf_weights(model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in read_hf_state_dict(qwen3_dir).items())


# ------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------


def test_train_step_changes_weights_and_lowers_loss(parallel, qwen3_moe_dir: Path, sequences):
    model = build_model(qwen3_moe_dir)
    load_hf_weights(model, qwen3_moe_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = [train_step(model, opt, sequences) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in changed
    assert any(".mlp.experts.local_experts." in n for n in changed)
    assert any(n.endswith("mlp.router.weight") for n in changed)
    # The loss returned is the token-mean negative logprob of score() before the step.
    lps = score(model, sequences)
    nll = -torch.cat(lps).mean().item()
    assert nll < losses[0]


# ------------------------------------------------------------------------------------------
# refusals
# ------------------------------------------------------------------------------------------


def _config(src: Path) -> dict:
    return json.loads((src / "config.json").read_text())


def test_unknown_architecture_refused(qwen3_dir: Path) -> None:
    cfg = _config(qwen3_dir) | {"architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ValueError, match="LlamaForCausalLM") as e:
        load_hf_config(cfg)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)


def test_every_architecture_in_the_table_has_a_trainer_parser() -> None:
    """The contract's architecture table is the one list; the trainer parses each entry."""
    from isoexec.contract.architectures import ARCHITECTURES

    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHITECTURES)


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ],
)
def test_unsupported_features_refused(qwen3_dir: Path, patch: dict, match: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=match):
        load_hf_config(_config(qwen3_dir) | patch)


def test_isoexec_build_is_tp1_only(parallel, qwen3_dir: Path) -> None:
    # The canonical path itself is tested in test_isoexec_trainer.py; TP>1 is refused there.
    assert type(build_model(qwen3_dir, isoexec=True)).__name__ == "IsoGPTModel"


def test_build_model_reads_the_isoexec_switch(
    parallel, qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`isoexec=None` (the default) follows `ISOEXEC`, as the engine does; an explicit value
    overrides it; an unrecognised value is refused, never read as 'off'."""
    monkeypatch.setenv("ISOEXEC", "1")
    assert type(build_model(qwen3_dir)).__name__ == "IsoGPTModel"
    assert type(build_model(qwen3_dir, isoexec=False)).__name__ == "GPTModel"
    monkeypatch.setenv("ISOEXEC", "0")
    assert type(build_model(qwen3_dir)).__name__ == "GPTModel"
    monkeypatch.delenv("ISOEXEC")
    assert type(build_model(qwen3_dir)).__name__ == "GPTModel"
    monkeypatch.setenv("ISOEXEC", "maybe")
    with pytest.raises(ValueError, match="ISOEXEC='maybe'"):
        build_model(qwen3_dir)


def test_build_without_parallel_state_refused(qwen3_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="megatron_parallel"):
        build_model(qwen3_dir)


def test_tp_mismatch_refused(parallel, qwen3_dir: Path) -> None:
    with pytest.raises(ValueError, match="tp=2"):
        build_model(qwen3_dir, tp=2)


def test_bad_checkpoints_refused(parallel, qwen3_dir: Path, tmp_path: Path) -> None:
    model = build_model(qwen3_dir)
    good = read_hf_state_dict(qwen3_dir)
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}

    missing = dict(good)
    del missing["model.layers.0.self_attn.k_norm.weight"]
    with pytest.raises(
        CheckpointMismatchError, match=r"missing \['model.layers.0.self_attn.k_norm"
    ):
        load_hf_weights(model, missing)

    extra = good | {"model.layers.9.mlp.gate_proj.weight": torch.zeros(3)}
    with pytest.raises(CheckpointMismatchError, match=r"unexpected \['model.layers.9"):
        load_hf_weights(model, extra)

    wrong = good | {"model.layers.1.self_attn.o_proj.weight": torch.zeros(64, 64)}
    with pytest.raises(CheckpointMismatchError, match=r"o_proj.weight: checkpoint \(64, 64\)"):
        load_hf_weights(model, wrong)

    # A refused load leaves the model untouched.
    assert all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters())

    # A dir without safetensors.
    with pytest.raises(FileNotFoundError):
        load_hf_weights(model, tmp_path)
    shutil.copy(qwen3_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_weights(model, tmp_path)


def test_tied_checkpoint_with_different_lm_head_refused(parallel, qwen3_tied_dir: Path) -> None:
    model = build_model(qwen3_tied_dir)
    sd = read_hf_state_dict(qwen3_tied_dir)
    assert "lm_head.weight" not in sd  # HF omits the tied head
    load_hf_weights(model, sd | {"lm_head.weight": sd["model.embed_tokens.weight"].clone()})
    with pytest.raises(CheckpointMismatchError, match="tie_word_embeddings"):
        load_hf_weights(
            model, sd | {"lm_head.weight": torch.zeros_like(sd["model.embed_tokens.weight"])}
        )


def test_bf16_model_is_all_bf16_and_close_to_transformers(parallel, qwen3_moe_dir: Path, sequences):
    """bf16 build: every parameter (norms too) in bf16, exported in bf16, logprobs near HF bf16.

    Not bitwise (different kernels, ~1e-2): that is what IsoExec's canonical ops are for.
    """
    from transformers import AutoModelForCausalLM

    model = build_model(qwen3_moe_dir, dtype=torch.bfloat16)
    load_hf_weights(model, qwen3_moe_dir)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {t.dtype for _, t in export_hf_weights(model)} == {torch.bfloat16}
    hf = AutoModelForCausalLM.from_pretrained(
        str(qwen3_moe_dir), dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = [token_logprobs(hf(s.unsqueeze(0)).logits[0], s) for s in sequences]
    diff = max(
        float((a - b).abs().max()) for a, b in zip(score(model, sequences), ref, strict=True)
    )
    assert diff < 0.15, diff
