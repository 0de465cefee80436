"""The engine's live weights under canonical (HF) names, for the weight fingerprint.

vLLM fuses some checkpoint tensors (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, and for
Qwen3.5 the split GDN projections in_proj_qkv/z into `in_proj_qkvz`, in_proj_b/a into
`in_proj_ba`); this splits them back, so the fingerprint of what the engine *holds* can be
compared with the trainer's export. Which GDN layout a layer holds is read from the live layer
(`gqa_interleaved_layout`): Qwen3-Next's interleaved fused tensors are checkpoint tensors as
they are. Names are the checkpoint's: a vision-language checkpoint's text weights carry its
`model.language_model.` prefix (`architectures.Architecture.text_prefix`).

At TP>1 every worker gathers each sharded weight over the TP group first (a collective: all
workers fingerprint together, as `collective_rpc` and the gated load do), by the layer's own
sharding: column-parallel rows per part (q/k/v, gate/up), row-parallel columns, vocab rows,
expert halves, and a GDN layer's heads (`_whole_gdn`). KV heads replicated across ranks and
any parameter whose sharding is not known here are refused: never a fingerprint of shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from isoexec.contract.architectures import architecture_of, text_config

# model_type values whose full-attention q_proj carries the output gate.
GATED_Q_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


class UnsupportedWeightLayoutError(RuntimeError):
    pass


def hf_named_weights(
    model: torch.nn.Module, hf_config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, live tensor) for every weight the engine holds."""
    prefix = architecture_of(hf_config).text_prefix
    for name, t in _text_named_weights(model, text_config(hf_config)):
        yield (prefix + name.removeprefix("model.") if name.startswith("model.") else name), t


def _text_named_weights(
    model: torch.nn.Module, hf_config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config["num_key_value_heads"])
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    # Qwen3-Next's and Qwen3.5's q_proj hold [q_h | gate_h] per head: twice the query width.
    gated = hf_config.get("model_type") in GATED_Q_MODEL_TYPES and hf_config.get(
        "attn_output_gate", True
    )
    q_size, kv_size = heads * head_dim * (2 if gated else 1), kv_heads * head_dim
    flat_gdn = _flat_gdn_layers(model)
    for name, t in _whole_named_parameters(model):
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            q, k, v = t.split([q_size, kv_size, kv_size], dim=0)
            yield base + "q_proj.weight", q
            yield base + "k_proj.weight", k
            yield base + "v_proj.weight", v
        elif name.endswith("gate_up_proj.weight"):  # mlp and shared_expert
            base = name[: -len("gate_up_proj.weight")]
            gate, up = t.chunk(2, dim=0)
            yield base + "gate_proj.weight", gate
            yield base + "up_proj.weight", up
        elif (parts := _split_gdn_projection(name, t, flat_gdn)) is not None:
            yield from parts
        elif name.endswith("w13_weight"):
            base = _experts_base(name, "w13_weight")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                yield f"{base}{e}.gate_proj.weight", gate
                yield f"{base}{e}.up_proj.weight", up
        elif name.endswith("w2_weight"):
            base = _experts_base(name, "w2_weight")
            for e, w in enumerate(t):
                yield f"{base}{e}.down_proj.weight", w
        else:
            yield name, t


def _whole_named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every parameter: as held at TP=1, gathered at TP>1."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    tp = get_tensor_model_parallel_world_size()
    if tp == 1:
        for name, param in model.named_parameters():
            # a LoRA-wrapped layer holds the model's weight as `<layer>.base_layer.weight`
            # (its adapter buffers are not parameters): the checkpoint's name is the layer's
            yield name.replace(".base_layer.", "."), param.detach()
        return
    gdn = {p: m for p, m in model.named_modules() if hasattr(m, "gqa_interleaved_layout")}
    seen: set[int] = set()
    for path, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied / shared parameters: once, as named_parameters does
                continue
            seen.add(id(param))
            name = f"{path}.{pname}" if path else pname
            if path in gdn or path.rsplit(".", 1)[0] in gdn:
                yield name, _whole_gdn(gdn, path, module, pname, param.detach(), tp)
            else:
                yield name, _whole(module, pname, param.detach(), tp)


def _whole_gdn(
    gdn: dict[str, torch.nn.Module],
    path: str,
    module: torch.nn.Module,
    pname: str,
    t: torch.Tensor,
    tp: int,
) -> torch.Tensor:
    """A GDN layer's parameter, whole. vLLM shards a GDN layer by heads: the per-value-head
    `A_log` / `dt_bias` in contiguous blocks, the causal conv's channels per part
    ([q | k | v], each part's rows split over the ranks), the fused input projections by
    their output parts (Qwen3.5's four / two parts; Qwen3-Next's interleaved tensor is one
    part whose rows are whole key-head groups per rank), out_proj by its input columns."""
    from vllm.distributed import tensor_model_parallel_all_gather as all_gather

    if path in gdn:  # the GDN layer's own parameters
        if pname in ("A_log", "dt_bias"):
            return all_gather(t.contiguous(), 0)
        raise UnsupportedWeightLayoutError(f"{path}.{pname}: a GDN parameter not known here")
    layer = gdn[path.rsplit(".", 1)[0]]
    if path.endswith(".conv1d") and pname == "weight":  # [C/tp, 1, W] per part
        key_dim, value_dim = int(layer.key_dim), int(layer.value_dim)  # type: ignore[arg-type]
        sizes = [key_dim // tp, key_dim // tp, value_dim // tp]
        return torch.cat([all_gather(x.contiguous(), 0) for x in t.split(sizes, dim=0)], 0)
    if path.endswith(".conv1d"):
        raise UnsupportedWeightLayoutError(f"{path}.{pname}: a GDN conv bias at TP={tp}")
    return _whole(module, pname, t, tp)  # projections (column / row parallel), the norm


def _whole(module: torch.nn.Module, pname: str, t: torch.Tensor, tp: int) -> torch.Tensor:
    """`t` as one tensor, gathered over the TP group by `module`'s sharding."""
    from vllm.distributed import tensor_model_parallel_all_gather as all_gather
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(module, ReplicatedLinear):
        return t
    if isinstance(module, ColumnParallelLinear):
        if getattr(module, "num_kv_head_replicas", 1) != 1:
            raise UnsupportedWeightLayoutError(
                f"{pname} of {type(module).__name__}: KV heads replicated across {tp} ranks"
            )
        sizes = [s // tp for s in getattr(module, "output_sizes", [t.shape[0] * tp])]
        parts = t.split(sizes, dim=0)  # this rank's rows of each part (q, k, v / gate, up)
        return torch.cat([all_gather(p.contiguous(), 0) for p in parts], dim=0)
    if isinstance(module, RowParallelLinear):
        return all_gather(t.contiguous(), t.dim() - 1) if pname == "weight" else t
    if isinstance(module, VocabParallelEmbedding):
        return all_gather(t.contiguous(), 0)[: module.org_vocab_size]
    if isinstance(module, RoutedExperts):  # FusedMoE's experts: [E, 2I/tp, H], [E, H, I/tp]
        if pname.startswith("w13"):
            gate, up = t.chunk(2, dim=-2)
            return torch.cat(
                [all_gather(gate.contiguous(), -2), all_gather(up.contiguous(), -2)], -2
            )
        if pname.startswith("w2"):
            return all_gather(t.contiguous(), -1)
        raise UnsupportedWeightLayoutError(f"{pname} of the routed experts at TP={tp}")
    if t.dim() <= 1 and "norm" in type(module).__name__.lower():
        return t  # norms are replicated on every rank
    raise UnsupportedWeightLayoutError(
        f"{pname} of {type(module).__name__}: its sharding at TP={tp} is not known here"
    )


def _flat_gdn_layers(model: torch.nn.Module) -> dict[str, list[int]]:
    """GDN layers holding the non-interleaved (Qwen3.5) fused projections: module path ->
    [rows of in_proj_qkv, rows of in_proj_z] of its `in_proj_qkvz` (`[qkv; z]`)."""
    out = {}
    for path, m in model.named_modules():
        if getattr(m, "gqa_interleaved_layout", None) is False:
            out[path] = [2 * int(m.key_dim) + int(m.value_dim), int(m.value_dim)]
    return out


def _split_gdn_projection(
    name: str, t: torch.Tensor, flat_gdn: dict[str, list[int]]
) -> list[tuple[str, torch.Tensor]] | None:
    """A flat-layout layer's fused `in_proj_qkvz` / `in_proj_ba` as HF's split tensors (row
    views); None for any other parameter."""
    for fused, parts in (
        ("in_proj_qkvz", ("in_proj_qkv", "in_proj_z")),
        ("in_proj_ba", ("in_proj_b", "in_proj_a")),
    ):
        layer = name.removesuffix(f".{fused}.weight")
        if layer == name or layer not in flat_gdn:
            continue
        sizes = flat_gdn[layer] if fused == "in_proj_qkvz" else [t.shape[0] // 2] * 2
        return [(f"{layer}.{p}.weight", x) for p, x in zip(parts, t.split(sizes), strict=True)]
    return None


def _experts_base(name: str, suffix: str) -> str:
    """`…mlp.experts[.routed_experts].w13_weight` -> `…mlp.experts.` (HF per-expert names)."""
    base = name[: -len(suffix)]
    base = base.removesuffix("routed_experts.")
    if not base.endswith("mlp.experts."):
        raise UnsupportedWeightLayoutError(f"{name}: unknown expert weight layout")
    return base
