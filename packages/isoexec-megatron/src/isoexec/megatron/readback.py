"""Read back what a live Megatron `GPTModel` runs at every op site, and its contract.

Built from the modules actually in the model, not from the spec that was asked for: a module
declares its canonical op with `isoexec_impl` / `isoexec_impls` (see `canonical_modules`);
anything else is recorded as `native:<class>`. A site with no module is an error, and so is
a model that would apply RoPE twice. Site names are `isoexec.contract.sites.model_sites`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from isoexec.contract.contract import Contract, DeviceIdentity
from isoexec.contract.impl import ImplInfo, declared_impl, installed_impl
from isoexec.contract.model_contract import contract_for
from isoexec.contract.sites import model_sites
from isoexec.megatron.canonical_base import site_placement
from isoexec.megatron.hf_config import HFConfigSource, ModelArch, _read_source, load_hf_config
from isoexec.megatron.pipeline import gather_over_pipeline, model_stage, stage_owns_site


class SiteNotFoundError(RuntimeError):
    """The model has no module for a site of its config (wrong model or unknown layout)."""


class SiteNotInstalledError(RuntimeError):
    """isoexec mode, but a site still runs a native kernel: refused, never silently kept."""


# site suffix after "layers.{i}." -> Megatron module path after "decoder.layers.{i}."
_LAYER_PATHS: dict[str, str] = {
    "input_norm": "input_layernorm",
    "self_attn.qkv_proj": "self_attention.linear_qkv",
    "self_attn.q_norm": "self_attention.q_layernorm",
    "self_attn.k_norm": "self_attention.k_layernorm",
    "self_attn.core": "self_attention.core_attention",
    "self_attn.o_proj": "self_attention.linear_proj",
    "post_attention_norm": "pre_mlp_layernorm",
    "mlp.gate_up_proj": "mlp.linear_fc1",
    "mlp.down_proj": "mlp.linear_fc2",
    "mlp.router": "mlp.router",
    "mlp.experts": "mlp.experts",
    # Qwen3-Next GDN layers: `IsoGatedDeltaNet` sits in the self_attention slot and runs the
    # conv and the recurrence itself.
    "linear_attn.in_proj_qkvz": "self_attention.in_proj_qkvz",
    "linear_attn.in_proj_ba": "self_attention.in_proj_ba",
    "linear_attn.conv": "self_attention",
    "linear_attn.recurrence": "self_attention",
    "linear_attn.norm": "self_attention.norm",
    "linear_attn.out_proj": "self_attention.out_proj",
}
# A native GDN layer (Megatron's own `GatedDeltaNet`, which runs the conv and the recurrence
# itself too) names its modules differently: one fused `in_proj` for both projections, and
# `out_norm` (the norm; the layer applies the silu gate).
_NATIVE_GDN_PATHS: dict[str, str] = {
    "linear_attn.in_proj_qkvz": "self_attention.in_proj",
    "linear_attn.in_proj_ba": "self_attention.in_proj",
    "linear_attn.norm": "self_attention.out_norm",
}
_TOP_PATHS = {"final_norm": "decoder.final_layernorm", "lm_head": "output_layer"}


def hf_config_dict(arch: ModelArch) -> dict[str, Any]:
    """The HF config fields `model_sites` reads, rebuilt from a `ModelArch` (for checks made
    at build time, where only the parsed architecture is at hand)."""
    cfg: dict[str, Any] = {
        "architectures": [arch.architecture],
        "num_hidden_layers": arch.num_layers,
    }
    if arch.moe is not None:
        cfg["num_experts"] = arch.moe.num_experts
        cfg["mlp_only_layers"] = [i for i, m in enumerate(arch.moe_layers) if not m]
    if arch.layer_kinds:
        cfg["layer_types"] = [
            "full_attention" if k == "attention" else "linear_attention" for k in arch.layer_kinds
        ]
    if arch.text_prefix != "model.":  # a vision-language checkpoint nests its text model
        return {"architectures": cfg.pop("architectures"), "text_config": cfg}
    return cfg


def _impl_of(obj: Any, op: str) -> ImplInfo:
    return installed_impl(op, obj, native_class=type(obj).__name__)


def _lookup(modules: Mapping[str, Any], path: str, site: str) -> Any:
    if path not in modules:
        raise SiteNotFoundError(f"site {site}: Megatron module {path!r} not found")
    return modules[path]


def _read(model: torch.nn.Module, hf_config: Mapping[str, Any]) -> dict[str, ImplInfo]:
    modules = dict(model.named_modules())
    rotary = getattr(model, "rotary_pos_emb", None)
    stage = model_stage(model)
    out: dict[str, ImplInfo] = {}
    for site in model_sites(hf_config):
        name, op = site.name, site.op
        if not stage_owns_site(stage, name):
            continue  # another pipeline stage's site
        if name == "logprobs":
            out[name] = _impl_of(model, op)
            continue
        if name in _TOP_PATHS:
            out[name] = _impl_of(_lookup(modules, _TOP_PATHS[name], name), op)
            continue
        _, idx, rest = name.split(".", 2)
        prefix = f"decoder.layers.{int(idx) - stage.first_layer}"  # the stage's own numbering
        if rest == "self_attn.rope":
            # IsoExec's RoPE is the core attention's `rotary` module; a native model's is the
            # model's `rotary_pos_emb` (one table for every layer)
            core = _lookup(modules, f"{prefix}.self_attention.core_attention", name)
            own = getattr(core, "rotary", None)
            declared = None if own is None else declared_impl(own, op)
            if declared is not None and rotary is not None:
                raise SiteNotFoundError(
                    f"site {name}: both the core attention's {type(own).__name__} and the "
                    f"model's {type(rotary).__name__} apply RoPE"
                )
            if declared is None and rotary is None:
                raise SiteNotFoundError(f"site {name}: no module applies RoPE")
            out[name] = declared or ImplInfo.native(op, type(rotary).__name__)
        elif rest == "mlp.act":
            mlp = _lookup(modules, f"{prefix}.mlp", name)
            act = getattr(mlp, "activation_func", None)
            out[name] = _impl_of(act if isinstance(act, torch.nn.Module) else mlp, op)
        elif rest in _LAYER_PATHS:
            path = f"{prefix}.{_LAYER_PATHS[rest]}"
            if path not in modules and rest in _NATIVE_GDN_PATHS:
                path = f"{prefix}.{_NATIVE_GDN_PATHS[rest]}"
            out[name] = _impl_of(_lookup(modules, path, name), op)
        else:
            raise SiteNotFoundError(f"site {name}: no Megatron mapping (architecture not wired)")
    return out


def _check_model(model: torch.nn.Module, hf_config: Mapping[str, Any]) -> None:
    arch = getattr(model, "isoexec_arch", None)
    if not isinstance(arch, ModelArch):
        raise TypeError("expected a model from isoexec.megatron.build_model (no .isoexec_arch)")
    given = load_hf_config(hf_config)
    if given != arch:
        raise ValueError(
            f"HF config ({given.architecture}, {given.num_layers} layers) is not the config the "
            f"model was built from ({arch.architecture}, {arch.num_layers} layers)"
        )


def read_sites(model: torch.nn.Module, hf_config: HFConfigSource) -> dict[str, ImplInfo]:
    """Site name → ImplInfo actually running there, in model order.

    A pipeline stage (PP>1) reads the sites of its own modules and gathers the other stages'
    readings over the pipeline group, so every stage returns the whole model's sites (a
    collective: every stage must call it).
    """
    cfg = _read_source(hf_config)
    _check_model(model, cfg)
    out: dict[str, ImplInfo] = {}
    for part in gather_over_pipeline(_read(model, cfg)):
        out.update(part)
    return out


def verify_installed(model: torch.nn.Module) -> None:
    """Raise `SiteNotInstalledError` naming every site of an isoexec model left native."""
    arch = getattr(model, "isoexec_arch", None)
    if not isinstance(arch, ModelArch):
        raise TypeError("expected a model from isoexec.megatron.build_model (no .isoexec_arch)")
    native = [n for n, i in _read(model, hf_config_dict(arch)).items() if i.is_native]
    if native:
        shown = ", ".join(native[:6]) + (" …" if len(native) > 6 else "")
        raise SiteNotInstalledError(
            f"isoexec model has {len(native)} site(s) not running a canonical op: {shown}"
        )


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def trainer_contract(
    model: torch.nn.Module,
    hf_config: HFConfigSource,
    dtype: torch.dtype | str | None = None,
    *,
    device: DeviceIdentity | None = None,
) -> Contract:
    """The trainer's execution contract, read back from the live model.

    `dtype` (torch dtype or its name) defaults to the model's parameter dtype; a different one
    is refused. Identity, dtypes and device come from `isoexec.contract.model_contract`, the
    rules the engine uses.
    """
    cfg = _read_source(hf_config)
    sites = read_sites(model, cfg)
    lora = getattr(model, "isoexec_lora", None)  # an attached adapter (`isoexec.megatron.lora`)
    if lora is not None:
        sites.update(lora.contract_sites())
    # Parameters the engine also holds in fp32 whatever the model dtype (GDN's A_log) do not
    # decide the model dtype.
    param_dtypes = {
        p.dtype for p in model.parameters() if not getattr(p, "isoexec_keep_fp32", False)
    }
    if len(param_dtypes) != 1:
        raise ValueError(f"model parameters have mixed dtypes {sorted(map(str, param_dtypes))}")
    model_dtype = _dtype_name(next(iter(param_dtypes)))
    if dtype is not None and _dtype_name(dtype) != model_dtype:
        raise ValueError(f"dtype {_dtype_name(dtype)} but the model's parameters are {model_dtype}")
    _check_gemm_placement(model, sites, model_dtype)
    tp = getattr(getattr(model, "config", None), "tensor_model_parallel_size", 1)
    pp, ep, dp = _parallel_degrees()
    return contract_for(
        cfg, model_dtype, sites, tp_size=tp, pp_size=pp, ep_size=ep, dp_size=dp, device=device
    )


def _check_gemm_placement(
    model: torch.nn.Module, sites: Mapping[str, ImplInfo], model_dtype: str
) -> None:
    """Canonical sites whose implementation depends on placement (`ops.depends_on_placement`:
    a GEMM site's library, the MoE site's expert GEMM) recorded it for the device and dtype
    the config builds on (`site_placement`); a model moved or cast since would carry wrong records:
    refused."""
    from isoexec.ops import depends_on_placement

    config = getattr(model, "config", None)
    placed = (i for i in sites.values() if not i.is_native and depends_on_placement(i.op))
    if config is None or not any(placed):
        return
    built = (site_placement(config).device, _dtype_name(config.params_dtype))
    devices = sorted({p.device.type for p in model.parameters()})
    if devices not in ([], [built[0]]) or model_dtype != built[1]:
        raise ValueError(
            f"GEMM sites record their library for {built[0]}/{built[1]} (and MoE sites their "
            f"expert kernel), where the model was built, but it now runs on "
            f"{'/'.join(devices)}/{model_dtype}: build it there"
        )


def _parallel_degrees() -> tuple[int, int, int]:
    """(PP, EP, DP) of Megatron's parallel state (1s outside one)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 1, 1
    return (
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    )


__all__ = [
    "SiteNotFoundError",
    "SiteNotInstalledError",
    "hf_config_dict",
    "read_sites",
    "trainer_contract",
    "verify_installed",
]
