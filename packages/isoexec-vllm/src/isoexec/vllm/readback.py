"""Read back what a live vLLM model actually runs at every op site.

The contract is built from this, not from what the plugin meant to install: an object carries
`isoexec_impl` only if it is one of IsoExec's classes; anything else is recorded as
`native:<class>`. A site with no object at all is an error.
"""

from __future__ import annotations

from typing import Any

import torch

from isoexec.contract.impl import ImplInfo, installed_impl
from isoexec.contract.sites import model_sites


class SiteNotFoundError(RuntimeError):
    pass


# site suffix (after "layers.{i}.") -> vLLM module path suffix, and how to reach the op object
_LAYER_PATHS: dict[str, str] = {
    "input_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "self_attn.qkv_proj": "self_attn.qkv_proj",
    "self_attn.q_norm": "self_attn.q_norm",
    "self_attn.k_norm": "self_attn.k_norm",
    "self_attn.rope": "self_attn.rotary_emb",
    "self_attn.core": "self_attn.attn",
    "self_attn.o_proj": "self_attn.o_proj",
    "linear_attn.in_proj_qkvz": "linear_attn.in_proj_qkvz",
    "linear_attn.in_proj_ba": "linear_attn.in_proj_ba",
    "linear_attn.conv": "linear_attn",
    "linear_attn.recurrence": "linear_attn",
    "linear_attn.norm": "linear_attn.norm",
    "linear_attn.out_proj": "linear_attn.out_proj",
    "mlp.gate_up_proj": "mlp.gate_up_proj",
    "mlp.act": "mlp.act_fn",
    "mlp.down_proj": "mlp.down_proj",
    "mlp.router": "mlp.experts",  # the runner routes (logits via its canonical gate)
    "mlp.experts": "mlp.experts",
}
_TOP_PATHS = {"final_norm": "model.norm", "lm_head": "lm_head"}


def _module_path(site: str) -> str:
    if site in _TOP_PATHS:
        return _TOP_PATHS[site]
    _, idx, rest = site.split(".", 2)
    return f"model.layers.{idx}.{_LAYER_PATHS[rest]}"


def _impl_of(obj: Any, op: str) -> ImplInfo:
    """The ImplInfo an object declares for `op`, looking where vLLM keeps the maths (a LoRA
    layer runs its base layer's; the adapter path is its own site, `lora_sites`)."""
    obj = getattr(obj, "base_layer", obj) if _is_lora_layer(obj) else obj
    quant, impl = getattr(obj, "quant_method", None), getattr(obj, "impl", None)
    inner = impl or quant or obj
    return installed_impl(op, obj, quant, impl, native_class=type(inner).__name__)


def _is_lora_layer(obj: Any) -> bool:
    from vllm.lora.layers import BaseLayerWithLoRA

    return isinstance(obj, BaseLayerWithLoRA)


# LoRA-wrapped vLLM modules whose adapter path a contract declares (the embedding and the lm
# head are wrapped too, but no trainer adapter reaches them: adapters targeting them are refused)
_LORA_SITE_OF = {
    "self_attn.qkv_proj": "self_attn.qkv_proj",
    "self_attn.o_proj": "self_attn.o_proj",
    "mlp.gate_up_proj": "mlp.gate_up_proj",
    "mlp.down_proj": "mlp.down_proj",
}
LORA_SITE_SUFFIX = ".lora"


def lora_sites(model: torch.nn.Module, impl: ImplInfo) -> dict[str, ImplInfo]:
    """`layers.{i}.<linear>.lora` -> `impl` for every linear vLLM wrapped with LoRA layers."""
    from isoexec.vllm.lora import check_lora_layers

    out: dict[str, ImplInfo] = {}
    for name in check_lora_layers(model):
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 5:
            continue
        rest = ".".join(parts[3:])
        if rest in _LORA_SITE_OF:
            out[f"layers.{parts[2]}.{_LORA_SITE_OF[rest]}{LORA_SITE_SUFFIX}"] = impl
    return out


def read_sites(
    model: torch.nn.Module, sampler: Any, hf_config: dict[str, Any]
) -> dict[str, ImplInfo]:
    """site name -> ImplInfo actually running there, in model order."""
    modules = dict(model.named_modules(remove_duplicate=False))  # rope is shared
    out: dict[str, ImplInfo] = {}
    for site in model_sites(hf_config):
        if site.name == "logprobs":
            out[site.name] = _impl_of(sampler, site.op)
            continue
        path = _module_path(site.name)
        if path not in modules:
            raise SiteNotFoundError(f"site {site.name}: vLLM module {path!r} not found")
        out[site.name] = _impl_of(modules[path], site.op)
    return out
