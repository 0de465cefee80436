"""LoRA on the trainer: a PEFT adapter on a canonical Megatron model, through the canonical LoRA
op (`isoexec.ops.lora`), the same op the engine's punica wrapper runs.

`attach_lora(model, adapter_dir, rank=R)` loads the adapter as trainable parameters (the
base's are frozen) and hooks each targeted Megatron linear: its output, seen in vLLM's slice
layout ([q | k | v] for the fused QKV, whose columns Megatron interleaves per query group;
[gate | up] for fc1), gets `lora_apply` with A and B zero-padded to the engine's
`max_lora_rank` R and the scaling folded into B — the engine's form, hence its bits. The
backward is the canonical linear's. `TrainerLora.save` writes the trained adapter back in
PEFT's layout, for vLLM to load after a step.

Scope: dense Qwen3 (`Qwen3ForCausalLM`) at trainer TP=1, the models the engine serves with
LoRA (it refuses LoRA on MoE models); adapters on q/k/v/o and gate/up/down. Other models,
other targets (embeddings, the lm head, experts) and TP>1 are refused when the adapter is
attached.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from isoexec.contract.adapter import (
    PEFT_PREFIX,
    AdapterConfig,
    LoraAdapterError,
    adapter_fingerprint,
    served_weights_fingerprint,
)
from isoexec.contract.fingerprint import WeightFingerprint
from isoexec.contract.impl import ImplInfo
from isoexec.megatron.canonical_base import CanonicalSiteError, _tp_size, site_binding
from isoexec.ops import fold_scaling, lora_apply, pad_rank

# PEFT module -> (Megatron module under decoder.layers.{i}, slice index within its output)
_TARGETS = {
    "q_proj": ("self_attention.linear_qkv", 0),
    "k_proj": ("self_attention.linear_qkv", 1),
    "v_proj": ("self_attention.linear_qkv", 2),
    "o_proj": ("self_attention.linear_proj", 0),
    "gate_proj": ("mlp.linear_fc1", 0),
    "up_proj": ("mlp.linear_fc1", 1),
    "down_proj": ("mlp.linear_fc2", 0),
}
_PARENT = {t: ("self_attn" if path.startswith("self_attention") else "mlp")
           for t, (path, _) in _TARGETS.items()}  # fmt: skip


LORA_ARCHITECTURE = "Qwen3ForCausalLM"  # what both sides run adapters on
# Megatron linear -> the framework-neutral site whose adapter path the contract declares
_CONTRACT_SITE = {
    "self_attention.linear_qkv": "self_attn.qkv_proj",
    "self_attention.linear_proj": "self_attn.o_proj",
    "mlp.linear_fc1": "mlp.gate_up_proj",
    "mlp.linear_fc2": "mlp.down_proj",
}


def _slice_widths(module: torch.nn.Module, path: str) -> list[int]:
    """The module's output slices in vLLM's layout."""
    c = module.config
    if path.endswith("linear_qkv"):
        kv = c.num_query_groups * c.kv_channels
        return [c.num_attention_heads * c.kv_channels, kv, kv]
    rows = int(module.weight.shape[0])  # this rank's output width (TP=1: all of it)
    if path.endswith("linear_fc1"):
        return [rows // 2, rows // 2]
    return [rows]


class _Site:
    """One hooked Megatron linear: its slices' (A, B) parameters and the output hook."""

    def __init__(self, module: torch.nn.Module, path: str, lora: TrainerLora) -> None:
        self.module, self.path, self.lora = module, path, lora
        self.widths = _slice_widths(module, path)
        self.params: list[tuple[torch.nn.Parameter, torch.nn.Parameter] | None] = [None] * len(
            self.widths
        )
        # QKV: Megatron interleaves q/k/v per query group; vLLM's layout is `_hf_rows` of it
        self.to_hf: torch.Tensor | None = getattr(module, "_hf_rows", None)
        self.handle = module.register_forward_hook(self._hook)

    def _slices(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for ab in self.params:
            if ab is None:
                out.append(None)
                continue
            a, b = ab
            out.append(pad_rank(a, fold_scaling(b, self.lora.config.scaling), self.lora.rank))
        return out

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        out, bias = output
        x = args[0]
        hf = out if self.to_hf is None else out.index_select(-1, self.to_hf)
        new = lora_apply(hf, x, self._slices(), self.widths)
        if new is hf:
            return output
        if self.to_hf is not None:
            new = new.index_select(-1, module._megatron_cols)
        return new, bias


class TrainerLora:
    """A PEFT adapter attached to a Megatron model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: AdapterConfig, rank: int, name: str) -> None:
        if config.rank > rank:
            raise LoraAdapterError(f"adapter rank {config.rank} > the padded rank {rank}")
        self.model, self.config, self.rank, self.name = model, config, rank, name
        self.sites: dict[str, _Site] = {}
        self.names: dict[str, torch.nn.Parameter] = {}  # PEFT tensor name -> parameter

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The adapter's trainable parameters (A and B of every targeted module)."""
        return iter(self.names.values())

    def impl(self, device: str, dtype: torch.dtype) -> ImplInfo:
        """What the LoRA sites run (the contract's `lora` record)."""
        from isoexec.ops import get_impl

        return get_impl("lora", device=device, dtype=dtype, rank=self.rank)

    def detach(self) -> None:
        """Remove the hooks: the model computes its base outputs again."""
        for site in self.sites.values():
            site.handle.remove()
        self.sites.clear()
        if getattr(self.model, "isoexec_lora", None) is self:
            del self.model.isoexec_lora

    def contract_sites(self) -> dict[str, ImplInfo]:
        """The contract's LoRA sites: `layers.{i}.<linear>.lora` for every linear this trainer
        can put an adapter on (the engine declares every linear vLLM wrapped), all running
        the canonical op at the padded rank."""
        out: dict[str, ImplInfo] = {}
        for name, module in self.model.named_modules():
            parts = name.split(".")
            if parts[:2] != ["decoder", "layers"] or len(parts) != 5:
                continue
            site = _CONTRACT_SITE.get(".".join(parts[3:]))
            if site is not None and hasattr(module, "isoexec_impl"):
                impl = site_binding(module.config, "lora", rank=self.rank).impl
                out[f"layers.{parts[2]}.{site}.lora"] = impl
        return out

    def fingerprint(self) -> str:
        """The adapter's fingerprint (its config and its tensors under PEFT's names, in the
        model's dtype): what the engine's adapter gate compares the adapter it loads against
        (`isoexec.contract.adapter`, `isoexec.vllm.adapter_gate`)."""
        return adapter_fingerprint(self.state_dict(), self.config)

    def weight_fingerprint(self) -> str:
        """The fingerprint of the weights this model scores under: its base weights' (HF
        names) combined with the adapter's (`served_weights_fingerprint`); equal to the
        engine's `isoexec_weight_fingerprint(adapter)` when both hold the same bits."""
        from isoexec.megatron.weights import export_hf_weights

        base = WeightFingerprint.of(export_hf_weights(self.model)).digest
        return served_weights_fingerprint(base, self.fingerprint())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors under PEFT's names (detached copies)."""
        return {k: p.detach().clone().contiguous() for k, p in self.names.items()}

    def save(self, out_dir: str | Path) -> Path:
        """Write the adapter in PEFT's layout (what vLLM's `LoRARequest` loads)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.state_dict(), str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(self.peft_config(), indent=2) + "\n")
        return out

    def peft_config(self) -> dict[str, Any]:
        """The adapter's `adapter_config.json` as PEFT writes it (what vLLM reads)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.config.rank,
            "lora_alpha": self.config.alpha,
            "target_modules": list(self.config.targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": self.config.use_rslora,
            "lora_dropout": 0.0,
            "modules_to_save": None,
        }


def attach_lora(
    model: torch.nn.Module,
    adapter_dir: str | Path,
    *,
    rank: int,
    name: str | None = None,
    freeze_base: bool = True,
) -> TrainerLora:
    """Load the PEFT adapter in `adapter_dir` onto `model` (an IsoExec Megatron model) as
    trainable parameters in the model's dtype, padded to `rank` (the engine's
    `max_lora_rank`). `name`: the engine's name for it (a served completion's record names
    its adapter; default: the directory's name). With `freeze_base`, the model's own
    parameters stop requiring grad."""
    from safetensors.torch import load_file

    from isoexec.megatron.scoring import is_isoexec

    if not is_isoexec(model):
        raise LoraAdapterError("attach_lora: the model has no canonical sites (IsoExec off)")
    if getattr(model, "isoexec_lora", None) is not None:
        raise LoraAdapterError("attach_lora: an adapter is attached already (detach it first)")
    arch = getattr(model, "isoexec_arch", None)
    if getattr(arch, "architecture", None) != LORA_ARCHITECTURE or getattr(arch, "moe", None):
        raise LoraAdapterError(
            f"attach_lora: {getattr(arch, 'architecture', type(model).__name__)} — canonical "
            f"LoRA runs on dense {LORA_ARCHITECTURE} (the engine refuses LoRA on MoE models)"
        )
    config = AdapterConfig.read(adapter_dir)
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    dtype = next(model.parameters()).dtype
    if freeze_base:
        for p in model.parameters():
            p.requires_grad_(False)
    lora = TrainerLora(model, config, rank, name or Path(adapter_dir).resolve().name)
    layers = sorted({int(k.split(".")[4]) for k in tensors if k.startswith(PEFT_PREFIX + ".")})
    expected = set()
    for layer in layers:
        for target in config.targets:
            path, index = _TARGETS[target]
            mpath = f"decoder.layers.{layer}.{path}"
            if mpath not in modules:
                raise LoraAdapterError(f"adapter targets {target} of layer {layer}: no {mpath}")
            module = modules[mpath]
            if _tp_size(module) != 1:
                raise CanonicalSiteError(f"LoRA on {mpath} at TP={_tp_size(module)}: TP=1 only")
            site = lora.sites.get(mpath) or lora.sites.setdefault(mpath, _Site(module, path, lora))
            name = f"{PEFT_PREFIX}.{layer}.{_PARENT[target]}.{target}"
            a_key, b_key = f"{name}.lora_A.weight", f"{name}.lora_B.weight"
            expected |= {a_key, b_key}
            if a_key not in tensors or b_key not in tensors:
                raise LoraAdapterError(f"adapter lacks {a_key} / {b_key}")
            a = torch.nn.Parameter(tensors[a_key].to(dtype).clone())
            b = torch.nn.Parameter(tensors[b_key].to(dtype).clone())
            if a.shape[0] != config.rank or b.shape[1] != config.rank:
                raise LoraAdapterError(f"{name}: rank {a.shape[0]} != r={config.rank}")
            site.params[index] = (a, b)
            lora.names[a_key], lora.names[b_key] = a, b
    extra = sorted(set(tensors) - expected)
    if extra:
        lora.detach()
        raise LoraAdapterError(f"adapter tensors the trainer would not apply: {extra[:4]}")
    if not lora.sites:
        raise LoraAdapterError(f"{adapter_dir}: the adapter has no tensors for this model")
    model.isoexec_lora = lora  # what `trainer_contract` declares
    return lora


__all__ = ["AdapterConfig", "LoraAdapterError", "TrainerLora", "attach_lora"]
