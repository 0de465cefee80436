"""Tiny random-weight Hugging Face checkpoints, made locally (never downloaded).

Tests, `isoexec pair --preset` and the benchmarks all build their models here, so the three
model families exist in exactly one place. Needs `transformers` (pulled by vLLM on engine
nodes; a dev dependency of the workspace).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3 dense: GQA, qk-norm, untied lm head. head_dim 64: vLLM's CPU attention needs >= 64.
    "tiny-dense": {
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    # Wide enough that stock kernels change bits with batch composition (measured: hidden
    # 1024 bf16 differs under co-batching): the model of the negative controls.
    "wide-dense": {
        "model_type": "qwen3",
        "vocab_size": 1024,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    # Qwen3 MoE: 8 experts, top-2 with renormalisation.
    "tiny-moe": {
        "model_type": "qwen3_moe",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    # Qwen3-Next hybrid: GDN layers + one gated full-attention layer, MoE with shared expert.
    "tiny-gdn": {
        "model_type": "qwen3_next",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": 4,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    # Qwen3.5 text: the same GDN / gated-attention hybrid with a dense SwiGLU MLP in every layer
    # and split GDN input projections (in_proj_qkv/z/b/a). GDN layers both before and after an
    # attention layer. rope_parameters carry an (interleaved) M-RoPE section like the real
    # checkpoints; for text all three position components are equal, i.e. plain partial RoPE.
    "tiny-qwen35": {
        "model_type": "qwen3_5_text",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": [
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    # Qwen3.5-MoE as released (e.g. Qwen3.5-35B-A3B), shrunk: the vision-language checkpoint
    # layout (`Qwen3_5MoeForConditionalGeneration`, nested text/vision configs, text weights
    # under `model.language_model.`, a vision tower, `mtp.*` tensors, two shards + index) and
    # the release's ratios: 3 GDN layers per gated-attention layer, partial rotary 0.25, value
    # heads = 2x key heads, head_dim 256, a shared expert, top-4 of 16 experts.
    "tiny-qwen35-moe": {
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            "vocab_size": 512,
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "layer_types": [
                "linear_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,  # the release's 2 KV heads: a TP=2 trainer splits them
            "head_dim": 256,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            "linear_conv_kernel_dim": 4,
            # The release's GDN head width (vLLM-CPU's stock GDN kernel takes no other).
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 128,
            "patch_size": 4,
            "num_position_embeddings": 16,
        },
    },
}

# The two other Qwen3.5 layouts, derived from the presets above so that they stay the same
# models: dense Qwen3.5 as released (`Qwen3_5ForConditionalGeneration`: tiny-qwen35's text
# model, with the release's GDN head width of 128 that stock vLLM-CPU's GDN kernel takes, in
# the release layout of tiny-qwen35-moe) and Qwen3.5-MoE's text model on its own
# (`Qwen3_5MoeForCausalLM`: a flat config, weights under `model.`).
PRESETS["tiny-qwen35-vl"] = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        **{k: v for k, v in PRESETS["tiny-qwen35"].items() if k != "model_type"},
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    },
    "vision_config": dict(PRESETS["tiny-qwen35-moe"]["vision_config"]),
}
PRESETS["tiny-qwen35-moe-text"] = {
    "model_type": "qwen3_5_moe_text",
    **PRESETS["tiny-qwen35-moe"]["text_config"],
}

# The real Qwen3.5-35B-A3B text widths (`overrides` for tiny-qwen35-moe), with one GDN and one
# attention layer and a small vocab so that both sides fit a CPU test machine.
QWEN35_35B_A3B_TEXT = {
    "vocab_size": 1024,
    "hidden_size": 2048,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}

# Multi-token-prediction tensors of a release checkpoint (names as released; IsoExec's text
# model never reads them): (name, shape in units of hidden size H).
_MTP_TENSORS = (
    ("mtp.fc.weight", ("H", "2H")),
    ("mtp.norm.weight", ("H",)),
    ("mtp.pre_fc_norm_embedding.weight", ("H",)),
    ("mtp.pre_fc_norm_hidden.weight", ("H",)),
    ("mtp.layers.0.input_layernorm.weight", ("H",)),
    ("mtp.layers.0.post_attention_layernorm.weight", ("H",)),
    ("mtp.layers.0.mlp.gate.weight", (8, "H")),
)


def make_tiny_model(
    preset: str,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    release_files: bool = False,
) -> Path:
    """Write a random-weight checkpoint (config.json + model.safetensors) for `preset`.

    `overrides` change config fields (e.g. a wider hidden size for a negative control).
    `release_files`: also what released checkpoints ship beside the weights — a
    `generation_config.json` with Qwen3's sampling defaults and a tokenizer (`write_release_files`).
    Deterministic for a given (preset, dtype, seed, overrides).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PRESETS[preset].items()}
    release = "text_config" in fields  # vision-language release layout: overrides the text
    (fields["text_config"] if release else fields).update(overrides or {})
    if release:  # the vision merger projects into the text model's width
        fields["vision_config"]["out_hidden_size"] = fields["text_config"]["hidden_size"]
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    config.dtype = dtype
    torch.manual_seed(seed)
    if release:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_weights(model, seed)
    model = model.to(torch_dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, out)
    if release:
        del model
        _release_layout(out, int(config.text_config.hidden_size), torch_dtype, seed)
    if release_files:
        text = config.text_config if release else config
        write_release_files(out, int(text.vocab_size))
    return out


# What released Qwen3 / Qwen3.5 checkpoints put in generation_config.json: vLLM applies the
# sampling fields as defaults to requests that name none (`--generation-config auto`).
RELEASE_SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def write_release_files(out: str | Path, vocab_size: int) -> None:
    """A `generation_config.json` with released sampling defaults, and a word-level tokenizer
    over the whole vocabulary (token i is the word `w{i}`; the last id is the end-of-text
    token), so that a tiny model is served as a real one is: with a tokenizer, text prompts
    and the model's own defaults."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    eos = vocab_size - 1
    gen = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos,
           **RELEASE_SAMPLING_DEFAULTS}  # fmt: skip
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    vocab = {f"w{i}": i for i in range(eos)} | {"<|endoftext|>": eos}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="w0")  # fmt: skip
    fast.save_pretrained(str(out))


def _save_quietly(model: Any, out: Path) -> None:
    """`save_pretrained` without transformers' "Writing model shards" bar: a tiny model is
    written in milliseconds, and the bar is noise in `isoexec pair` and CI output."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _release_layout(out: Path, hidden: int, dtype: Any, seed: int) -> None:
    """Rewrite a saved checkpoint as a release does: the MTP tensors added, the weights in two
    shards (text model | lm head, vision tower, MTP) with a `model.safetensors.index.json`."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    tensors: dict[str, Any] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    gen = torch.Generator().manual_seed(seed + 2)
    dims = {"H": hidden, "2H": 2 * hidden}
    for name, shape in _MTP_TENSORS:
        size = tuple(dims[d] if isinstance(d, str) else d for d in shape)
        tensors[name] = (0.05 * torch.randn(size, generator=gen)).to(dtype)
    first = {k: v for k, v in tensors.items() if k.startswith("model.language_model.")}
    second = {k: v for k, v in tensors.items() if k not in first}
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    weight_map = {}
    for fname, part in shards.items():
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _spread_weights(model: Any, seed: int) -> None:
    """Give every parameter non-trivial values.

    HF initialises norms to exactly 1 (or 0 for zero-centred norms) and some GDN parameters to
    constants; a test on such weights could pass by luck, so every tensor gets random noise.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:
                p.add_(0.1 * noise)
            else:
                p.copy_(noise * 0.05)
            del name
