"""Trainer side of Qwen3.5 as released (`tiny-qwen35-moe`: `Qwen3_5MoeForConditionalGeneration`,
nested text/vision configs, text weights under `model.language_model.*`, a vision tower, MTP
tensors, two shards + index; 3 GDN layers per gated-attention layer, MoE with a shared expert).

What a user loading a released checkpoint relies on: the four Qwen3.5 architectures parse (and
what the canonical layers cannot express is refused); the vision and MTP tensors are skipped
and said in one line, any other unknown tensor refused; logprobs agree with transformers' own
model (a tolerance: its chunked delta rule is another algorithm); export writes the
checkpoint's own names bit-exactly, and a full checkpoint keeps the untouched vision and MTP
tensors in the source's shards; the causal-LM layout of the same weights scores bitwise alike.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from isoexec import ops
from isoexec.contract.architectures import UnsupportedModelError, text_config
from isoexec.contract.sites import mlp_kinds, model_sites
from isoexec.megatron.hf_checkpoint import INDEX_FILE, CheckpointMismatchError
from isoexec.megatron.hf_config import UnsupportedConfigError, load_hf_config
from isoexec.megatron.model_builder import build_model
from isoexec.megatron.readback import trainer_contract
from isoexec.megatron.scoring import score
from isoexec.megatron.weights import (
    export_hf_weights,
    load_hf_weights,
    read_hf_state_dict,
    save_hf_checkpoint,
)

pytestmark = pytest.mark.trainer

PRESET = "tiny-qwen35-moe"
VOCAB = 512
TEXT = "model.language_model."


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from isoexec.tools.tiny_models import make_tiny_model

    return make_tiny_model(PRESET, tmp_path_factory.mktemp("q35moe_32"), seed=3)


@pytest.fixture(scope="module")
def seqs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (2, 13, 37, 5)]


def _model(ckpt: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = build_model(ckpt, isoexec=True, dtype=dtype)
    load_hf_weights(model, ckpt)
    return model


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def test_release_layout_is_what_the_preset_promises(release_dir: Path) -> None:
    cfg = _config(release_dir)
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_5_moe" and "vision_config" in cfg
    text = cfg["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text"
    assert text["layer_types"].count("linear_attention") == 3 * text["layer_types"].count(
        "full_attention"
    )
    assert text["linear_num_value_heads"] == 2 * text["linear_num_key_heads"]
    assert text["head_dim"] == 256 and text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert (
        text["num_experts_per_tok"] < text["num_experts"]
        and text["shared_expert_intermediate_size"]
    )
    index = json.loads((release_dir / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == 2
    names = set(index["weight_map"])
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("mtp.") for n in names)
    assert f"{TEXT}embed_tokens.weight" in names and "lm_head.weight" in names


def test_four_architectures_parse_and_refusals(release_dir: Path) -> None:
    cfg = _config(release_dir)
    release = load_hf_config(cfg)
    assert release.text_prefix == TEXT and release.unused_prefixes == ("model.visual.", "mtp.")
    assert release.moe is not None and release.moe.norm_topk_prob  # always renormalised
    assert release.gdn is not None and release.gdn.layout == "flat"
    assert mlp_kinds(cfg) == ["moe_shared"] * 4
    # The causal-LM names hold the same text model under "model.".
    flat = {**text_config(cfg), "architectures": ["Qwen3_5MoeForCausalLM"]}
    causal = load_hf_config(flat)
    assert causal.text_prefix == "model." and causal.moe == release.moe
    assert causal.layer_kinds == release.layer_kinds and causal.gdn == release.gdn
    # Dense Qwen3.5 in both names.
    dense_text = {k: v for k, v in text_config(cfg).items() if "expert" not in k}
    dense_text.update(model_type="qwen3_5_text", intermediate_size=64)
    dense_vl = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                "text_config": dense_text}  # fmt: skip
    assert load_hf_config(dense_vl).moe is None
    assert load_hf_config({**dense_text, "architectures": ["Qwen3_5ForCausalLM"]}).moe is None

    with pytest.raises(UnsupportedConfigError, match="norm_topk_prob=False"):
        load_hf_config({**cfg, "text_config": {**cfg["text_config"], "norm_topk_prob": False}})
    with pytest.raises(UnsupportedConfigError, match="without a shared expert"):
        load_hf_config(
            {**cfg, "text_config": {**cfg["text_config"], "shared_expert_intermediate_size": 0}}
        )
    with pytest.raises(UnsupportedModelError, match="model_type 'qwen3_next'"):
        text_config({**cfg, "model_type": "qwen3_next"})
    with pytest.raises(UnsupportedModelError, match="tie_word_embeddings"):
        text_config({**cfg, "tie_word_embeddings": True})
    with pytest.raises(UnsupportedModelError, match="lacks its text_config"):
        text_config({k: v for k, v in cfg.items() if k != "text_config"})


def test_vision_and_mtp_skipped_in_one_line_unknown_refused(
    parallel, release_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = build_model(release_dir, isoexec=True)
    with caplog.at_level(logging.WARNING, logger="isoexec.megatron.weights"):
        skipped = load_hf_weights(model, release_dir)
    assert skipped == {"model.visual.": 21, "mtp.": 7}
    lines = [r.getMessage() for r in caplog.records if "not used by the text model" in r.message]
    assert lines == [
        "isoexec: 21 tensors under model.visual.*, 7 under mtp.* not used by the text model"
    ]
    hf = read_hf_state_dict(release_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for stray in ("model.language_model.layers.0.mlp.extra.weight", "visual.blocks.0.weight"):
        with pytest.raises(CheckpointMismatchError, match="unexpected"):
            load_hf_weights(model, {**hf, stray: torch.zeros(2)})
    # A text tensor missing is refused too, and nothing was written by the refused loads.
    missing = dict(hf)
    missing.pop(f"{TEXT}layers.3.mlp.shared_expert_gate.weight")
    with pytest.raises(CheckpointMismatchError, match="missing"):
        load_hf_weights(model, missing)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_close_to_hf_transformers_fp32(parallel, release_dir: Path, seqs) -> None:
    """Against transformers' own `Qwen3_5MoeForConditionalGeneration` (text input only): not
    bitwise (its chunked delta rule, its MoE loop), so a tolerance; measured ≈ 2e-6, a mapping
    error (a swapped projection, an unscaled shared expert) moves logprobs by O(0.1)."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(release_dir), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3_5MoeForConditionalGeneration"
    ours = score(_model(release_dir), seqs)
    worst = 0.0
    for seq, lp in zip(seqs, ours, strict=True):
        with torch.no_grad():
            logits = hf.eval()(input_ids=seq[None]).logits[0].float()
        want = torch.log_softmax(logits[:-1], -1).gather(-1, seq[1:, None])[:, 0]
        worst = max(worst, float((lp - want).abs().max()))
    print(f"{PRESET} fp32: isoexec trainer vs HF transformers max |dlogprob| = {worst:.2e}")
    assert 0 < worst < 2e-5


def test_export_names_round_trip_and_full_checkpoint(
    parallel, release_dir: Path, tmp_path: Path, seqs
) -> None:
    hf = read_hf_state_dict(release_dir)
    text = {k: v for k, v in hf.items() if not k.startswith(("model.visual.", "mtp."))}
    model = _model(release_dir)
    out = dict(export_hf_weights(model))
    assert out.keys() == text.keys()  # the checkpoint's own names, nothing else
    assert all(torch.equal(out[k], v) for k, v in text.items())

    # A full checkpoint in the source's layout: same shards, index, config; vision and MTP
    # tensors untouched; after a change only the changed tensor differs.
    target = f"{TEXT}layers.1.linear_attn.out_proj.weight"
    with torch.no_grad():
        model.decoder.layers[1].self_attention.out_proj.weight.mul_(2)
    save_hf_checkpoint(model, tmp_path / "full", release_dir)
    assert sorted(p.name for p in (tmp_path / "full").glob("*.safetensors")) == sorted(
        p.name for p in release_dir.glob("*.safetensors")
    )
    assert (tmp_path / "full" / INDEX_FILE).read_text() == (release_dir / INDEX_FILE).read_text()
    assert _config(tmp_path / "full") == _config(release_dir)
    written = read_hf_state_dict(tmp_path / "full")
    assert written.keys() == hf.keys()
    changed = [k for k in hf if not torch.equal(written[k], hf[k])]
    assert changed == [target]
    with pytest.raises(ValueError, match="overwrite the source"):
        save_hf_checkpoint(model, release_dir, release_dir)

    # The saved checkpoint loads back and scores as the model it came from.
    again = _model(tmp_path / "full")
    for a, b in zip(score(model, seqs), score(again, seqs), strict=True):
        assert torch.equal(a, b)


def test_causal_lm_layout_scores_bitwise_alike(
    parallel, release_dir: Path, tmp_path: Path, seqs
) -> None:
    """`Qwen3_5MoeForCausalLM` (flat text config, weights under `model.`) of the same weights."""
    cfg = _config(release_dir)
    causal = tmp_path / "causal"
    causal.mkdir()
    flat = {**text_config(cfg), "architectures": ["Qwen3_5MoeForCausalLM"]}
    (causal / "config.json").write_text(json.dumps(flat))
    hf = read_hf_state_dict(release_dir)
    renamed = {
        ("model." + k.removeprefix(TEXT) if k.startswith(TEXT) else k): v
        for k, v in hf.items()
        if not k.startswith("model.visual.")
    }
    save_file(renamed, str(causal / "model.safetensors"))
    a, b = _model(release_dir), _model(causal)
    assert load_hf_weights(b, causal) == {"mtp.": 7}
    for x, y in zip(score(a, seqs), score(b, seqs), strict=True):
        assert torch.equal(x, y)
    assert set(dict(export_hf_weights(b))) == {k for k in renamed if not k.startswith("mtp.")}
    assert load_file(str(causal / "model.safetensors")).keys() == renamed.keys()


def test_contract_every_site_canonical(parallel, release_dir: Path) -> None:
    cfg = _config(release_dir)
    expected = model_sites(cfg)
    c = trainer_contract(build_model(release_dir, isoexec=True), release_dir, torch.float32)
    assert c.model.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert c.model.layer_kinds == ("linear_attention",) * 3 + ("attention",)
    assert c.site_names == tuple(s.name for s in expected)
    assert c.native_sites == ()
    for s in expected:
        assert c.site(s.name).impl == ops.get_impl(s.op), s.name
    assert {"layers.0.mlp.router", "layers.3.mlp.experts"} <= set(c.site_names)


def test_dense_vision_language_checkpoint_close_to_hf(parallel, tmp_path: Path, seqs) -> None:
    """`Qwen3_5ForConditionalGeneration` (dense Qwen3.5 as released), saved by transformers
    itself: the trainer reads its text model (skipping the vision tower) and agrees with it."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from isoexec.tools.tiny_models import PRESETS

    text = {k: v for k, v in PRESETS["tiny-qwen35"].items() if k != "model_type"}
    vision = {**PRESETS[PRESET]["vision_config"], "out_hidden_size": text["hidden_size"]}
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    hf = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    assert _config(tmp_path)["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    model = build_model(tmp_path, isoexec=True)
    assert load_hf_weights(model, tmp_path) == {"model.visual.": 21}
    worst = 0.0
    for seq, lp in zip(seqs, score(model, seqs), strict=True):
        with torch.no_grad():
            logits = hf(input_ids=seq[None]).logits[0].float()
        want = torch.log_softmax(logits[:-1], -1).gather(-1, seq[1:, None])[:, 0]
        worst = max(worst, float((lp - want).abs().max()))
    assert 0 < worst < 2e-5, worst
