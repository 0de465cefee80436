"""The architectures IsoExec serves and trains, and how their checkpoints are laid out.

One table both sides read, so trainer, engine and contract agree on what a checkpoint is
without talking: which text model an architecture holds, its MLP kind, where the text weights
live in the checkpoint and which tensors belong to parts IsoExec does not run.

The released Qwen3.5 models are vision-language checkpoints
(`Qwen3_5MoeForConditionalGeneration`, `Qwen3_5ForConditionalGeneration`): a nested
`text_config`, the text weights under `model.language_model.*` (lm head at `lm_head.*`), a
vision tower under `model.visual.*` and multi-token-prediction weights under `mtp.*`. IsoExec
runs their text model; the vision and MTP tensors are listed as unused, never mixed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class UnsupportedModelError(ValueError):
    """The model (architecture or a config feature) has no canonical installation."""


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]  # accepted top-level `model_type` values
    hybrid: bool  # GDN / full-attention layers per `layer_types`
    mlp: str  # "dense", "moe" or "moe_shared" (MoE plus a sigmoid-gated shared expert)
    # Where the text model's weights live ("model." for a causal LM); lm_head is top level.
    text_prefix: str = "model."
    # Checkpoint tensors of parts IsoExec does not run (vision tower, MTP draft head).
    unused_prefixes: tuple[str, ...] = ()
    # Qwen3.5's GDN input projections are stored split (in_proj_qkv/z/b/a): "flat".
    gdn_layout: str = "interleaved"


_QWEN35_VL_PREFIXES = ("model.visual.", "mtp.")

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("Qwen3ForCausalLM", ("qwen3",), hybrid=False, mlp="dense"),
        Architecture("Qwen3MoeForCausalLM", ("qwen3_moe",), hybrid=False, mlp="moe"),
        Architecture(
            "Qwen3NextForCausalLM",
            ("qwen3_next",),
            hybrid=True,
            mlp="moe_shared",
            unused_prefixes=("mtp.",),
        ),
        Architecture(
            "Qwen3_5ForCausalLM",
            ("qwen3_5_text", "qwen3_5"),
            hybrid=True,
            mlp="dense",
            unused_prefixes=("mtp.",),
            gdn_layout="flat",
        ),
        Architecture(
            "Qwen3_5MoeForCausalLM",
            ("qwen3_5_moe_text", "qwen3_5_moe"),
            hybrid=True,
            mlp="moe_shared",
            unused_prefixes=("mtp.",),
            gdn_layout="flat",
        ),
        Architecture(
            "Qwen3_5ForConditionalGeneration",
            ("qwen3_5",),
            hybrid=True,
            mlp="dense",
            text_prefix="model.language_model.",
            unused_prefixes=_QWEN35_VL_PREFIXES,
            gdn_layout="flat",
        ),
        Architecture(
            "Qwen3_5MoeForConditionalGeneration",
            ("qwen3_5_moe",),
            hybrid=True,
            mlp="moe_shared",
            text_prefix="model.language_model.",
            unused_prefixes=_QWEN35_VL_PREFIXES,
            gdn_layout="flat",
        ),
    )
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


def architecture_name(hf_config: Mapping[str, Any]) -> str:
    """The one architecture the config names, refused loudly if unknown or ambiguous."""
    archs = hf_config.get("architectures") or []
    if len(archs) != 1:
        raise UnsupportedModelError(f"config names architectures {archs!r}; expected exactly one")
    arch = str(archs[0])
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def architecture_of(hf_config: Mapping[str, Any]) -> Architecture:
    return ARCHITECTURES[architecture_name(hf_config)]


def text_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config as one flat mapping, whatever the checkpoint's nesting.

    A vision-language config's `text_config` is returned with the top-level `architectures`;
    a flat config as it is. A `tie_word_embeddings` set on both levels must agree (HF ties the
    lm head by the top-level value, vLLM by the text one)."""
    arch = architecture_of(hf_config)
    model_type = hf_config.get("model_type")
    if model_type is not None and model_type not in arch.model_types:
        raise UnsupportedModelError(
            f"architecture {arch.name} with model_type {model_type!r}; expected one of "
            f"{arch.model_types}"
        )
    nested = hf_config.get("text_config")
    if nested is None:
        if arch.text_prefix != "model.":
            raise UnsupportedModelError(f"{arch.name} config lacks its text_config")
        return dict(hf_config)
    if not isinstance(nested, Mapping):
        raise UnsupportedModelError(f"text_config is a {type(nested).__name__}, not a mapping")
    out = dict(nested)
    top_tie, text_tie = hf_config.get("tie_word_embeddings"), nested.get("tie_word_embeddings")
    if top_tie is not None and text_tie is not None and bool(top_tie) != bool(text_tie):
        raise UnsupportedModelError(
            f"tie_word_embeddings is {top_tie} at the top level but {text_tie} in text_config"
        )
    if top_tie is not None:
        out["tie_word_embeddings"] = top_tie
    out["architectures"] = [arch.name]
    return out


def split_unused(
    names: list[str] | set[str], hf_config: Mapping[str, Any]
) -> tuple[list[str], dict[str, int]]:
    """(tensor names the text model uses or must refuse, {unused prefix: count}).

    The unused ones are the architecture's vision / MTP tensors; everything else stays, so an
    unknown tensor still reaches the caller's exact-match check and is refused there."""
    prefixes = architecture_of(hf_config).unused_prefixes
    kept: list[str] = []
    skipped: dict[str, int] = {}
    for name in sorted(names):
        hit = next((p for p in prefixes if name.startswith(p)), None)
        if hit is None:
            kept.append(name)
        else:
            skipped[hit] = skipped.get(hit, 0) + 1
    return kept, skipped


def describe_unused(skipped: Mapping[str, int]) -> str:
    """One line, e.g. "412 tensors under model.visual.*, 19 under mtp.* not used by the text
    model" ("" when nothing was skipped)."""
    if not skipped:
        return ""
    parts = [
        f"{n} {'tensors ' if i == 0 else ''}under {p}*"
        for i, (p, n) in enumerate(sorted(skipped.items()))
    ]
    return ", ".join(parts) + " not used by the text model"


__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "Architecture",
    "UnsupportedModelError",
    "architecture_name",
    "architecture_of",
    "describe_unused",
    "split_unused",
    "text_config",
]
