"""HF safetensors ⇄ Megatron `GPTModel` parameters: names and layouts, both ways, bit-exact.

HF (canonical) names are the weight-sync currency: the engine loads them, and the weight
fingerprint is computed over them. Every Megatron parameter maps to one or more HF tensors by a
pure reshuffle (view/cat/split, no arithmetic), so HF → Megatron → HF is bit-exact:

- `linear_qkv.weight` = per query group g: [q heads of g; k_g; v_g] (rows),
- `linear_fc1.weight` = cat(gate_proj, up_proj) (rows), for the dense MLP and every expert,
- experts: `mlp.experts.local_experts.{e}.linear_fc{1,2}` (SequentialMLP) ⇄
  `mlp.experts.{e}.{gate,up,down}_proj`; router `mlp.router.weight` ⇄ `mlp.gate.weight`,
- q/k norm, input/pre-MLP/final norm, embeddings, output layer (absent when tied).

Qwen3-Next adds:
- gated attention: `linear_qkv.weight` per group [q heads of g; gate heads of g; k_g; v_g] ⇄
  `q_proj` (per head [q_h; gate_h]), `k_proj`, `v_proj`;
- GDN layers (`self_attention` = `IsoGatedDeltaNet`): `in_proj_qkvz`, `in_proj_ba`, `dt_bias`,
  `A_log`, `norm.weight`, `out_proj` by identity (HF's fused per-group layouts are kept, the
  engine GEMMs them as is), `conv1d_weight` ⇄ `linear_attn.conv1d.weight` [C, 1, W];
  `A_log` is held (and exported) in fp32 whatever the model dtype, as the engine holds it;
- shared expert: `mlp.shared_experts.linear_fc1` = cat(gate_proj, up_proj), `linear_fc2` ⇄
  `down_proj`, `mlp.shared_experts.gate_weight` ⇄ `mlp.shared_expert_gate.weight`.

Qwen3.5 text is Qwen3-Next's attention and GDN mapping with a dense MLP in every layer, except
that its checkpoint splits the GDN projections: `in_proj_qkvz` = cat(`in_proj_qkv`,
`in_proj_z`) and `in_proj_ba` = cat(`in_proj_b`, `in_proj_a`) (rows; the "flat" layout, what
vLLM's non-interleaved GDN layer holds).

A native model (`build_model(isoexec=False)`) has Megatron's own `GatedDeltaNet` in its GDN
layers (`param_mappings(arch, native=True)`; everything else maps as above):
- `in_proj.weight` = rows [q | k | v | z | b | a], each block head-major over all heads. From
  Qwen3.5 that is cat(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); from Qwen3-Next's
  per-key-head-group `in_proj_qkvz` ([q_g | k_g | v_g×r | z_g×r]) and `in_proj_ba`
  ([b_g×r | a_g×r]) it is the same rows regrouped block by block (value heads stay in HF's
  order, g·r + j, which is the order Megatron's `repeat_interleave` of q/k pairs them with);
- `conv1d.weight`, `dt_bias`, `A_log`, `out_norm.weight` (⇄ `norm.weight`), `out_proj.weight`
  by identity; `A_log` in the model dtype, as Megatron allocates it.

At TP>1 the mappings still describe the full layout; `tp_layout` slices it per rank on load
and gathers it back on export (a collective: every TP rank must export together). At PP>1 a
stage maps only its own parameters (`local_mappings`): its layers renumbered from 0, the
embedding on the first stage, the final norm and output layer on the last; at EP>1 a rank maps
its own routed experts. A load still checks the checkpoint against the whole model; an export
yields the rank's own tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping

import torch
from safetensors.torch import save_file

from isoexec.contract.architectures import describe_unused
from isoexec.megatron.hf_checkpoint import CheckpointMismatchError, read_hf_state_dict
from isoexec.megatron.hf_config import ModelArch
from isoexec.megatron.pipeline import PipelineStage, model_stage
from isoexec.megatron.tp_layout import ShardSpec, gather_full, local_shard, shard_spec
from isoexec.megatron.weight_mapping import ParamMapping, identity_in, identity_out
from isoexec.megatron.weights_gdn import (
    gdn_projection_mappings,
    native_gdn_mappings,
)

_log = logging.getLogger(__name__)


def _glu_in(ts: list[torch.Tensor]) -> torch.Tensor:
    gate, up = ts
    return torch.cat([gate, up], dim=0)


def _glu_out(t: torch.Tensor) -> list[torch.Tensor]:
    if t.shape[0] % 2:
        raise CheckpointMismatchError(f"fc1 weight with odd row count {tuple(t.shape)}")
    gate, up = t.chunk(2, dim=0)
    return [gate, up]


def _qkv_fns(
    arch: ModelArch,
) -> tuple[
    Callable[[list[torch.Tensor]], torch.Tensor], Callable[[torch.Tensor], list[torch.Tensor]]
]:
    g, d, hidden = arch.num_kv_heads, arch.head_dim, arch.hidden_size
    h = arch.num_attention_heads
    qpg = h // g  # query heads per group
    gated = arch.attn_output_gate
    gates = qpg if gated else 0  # gate heads per group (Megatron: right after the q heads)

    def to_megatron(ts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = ts
        if gated:  # HF q_proj: per head [q_h; gate_h]
            qg = q.reshape(h, 2, d, hidden)
            parts = [qg[:, 0].reshape(g, qpg * d, hidden), qg[:, 1].reshape(g, qpg * d, hidden)]
        else:
            parts = [q.reshape(g, qpg * d, hidden)]
        per_group = [*parts, k.reshape(g, d, hidden), v.reshape(g, d, hidden)]
        return torch.cat(per_group, dim=1).reshape(g * (qpg + gates + 2) * d, hidden)

    def to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        grouped = t.reshape(g, (qpg + gates + 2) * d, hidden)
        q, gate, k, v = grouped.split([qpg * d, gates * d, d, d], dim=1)
        if gated:
            q = torch.stack([q.reshape(h, d, hidden), gate.reshape(h, d, hidden)], dim=1)
        return [q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]

    return to_megatron, to_hf


MAPPED_ARCHITECTURES = (
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def param_mappings(arch: ModelArch, *, native: bool = False) -> list[ParamMapping]:
    """Every Megatron parameter of a model built from `arch`, mapped to HF names (Qwen3 family,
    Qwen3-Next, Qwen3.5 text). `native`: the model has Megatron's own modules
    (`build_model(isoexec=False)`), which differ from the canonical ones in GDN layers only."""
    if arch.architecture not in MAPPED_ARCHITECTURES:
        raise ValueError(f"no weight mapping for architecture {arch.architecture!r}")
    qkv_in, qkv_out = _qkv_fns(arch)

    def same(meg: str, hf: str) -> ParamMapping:
        return ParamMapping(meg, (hf,), identity_in, identity_out)

    def swiglu(meg: str, hf: str) -> list[ParamMapping]:
        """A SwiGLU MLP: fc1 = cat(gate_proj, up_proj), fc2 = down_proj."""
        fc1 = (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight")
        return [
            ParamMapping(f"{meg}.linear_fc1.weight", fc1, _glu_in, _glu_out),
            same(f"{meg}.linear_fc2.weight", f"{hf}.down_proj.weight"),
        ]

    text = arch.text_prefix  # "model." or, in a vision-language checkpoint, "model.language_model."
    maps = [same("embedding.word_embeddings.weight", f"{text}embed_tokens.weight")]
    for i in range(arch.num_layers):
        m, h = f"decoder.layers.{i}", f"{text}layers.{i}"
        maps.append(same(f"{m}.input_layernorm.weight", f"{h}.input_layernorm.weight"))
        if arch.kinds[i] == "linear_attention" and native:
            maps += native_gdn_mappings(arch, f"{m}.self_attention", f"{h}.linear_attn")
        elif arch.kinds[i] == "linear_attention":
            sa, la = f"{m}.self_attention", f"{h}.linear_attn"
            maps += gdn_projection_mappings(arch, sa, la)
            maps += [
                same(f"{sa}.{p}", f"{la}.{p}")
                for p in (
                    "dt_bias",
                    "A_log",
                    "norm.weight",
                    "out_proj.weight",
                )
            ]
            maps.append(same(f"{sa}.conv1d_weight", f"{la}.conv1d.weight"))
        else:
            maps += [
                ParamMapping(
                    f"{m}.self_attention.linear_qkv.weight",
                    tuple(f"{h}.self_attn.{p}_proj.weight" for p in "qkv"),
                    qkv_in,
                    qkv_out,
                ),
                same(f"{m}.self_attention.q_layernorm.weight", f"{h}.self_attn.q_norm.weight"),
                same(f"{m}.self_attention.k_layernorm.weight", f"{h}.self_attn.k_norm.weight"),
                same(f"{m}.self_attention.linear_proj.weight", f"{h}.self_attn.o_proj.weight"),
            ]
        maps.append(same(f"{m}.pre_mlp_layernorm.weight", f"{h}.post_attention_layernorm.weight"))
        if arch.moe_layers[i]:
            assert arch.moe is not None
            maps.append(same(f"{m}.mlp.router.weight", f"{h}.mlp.gate.weight"))
            if arch.moe.shared_expert_intermediate_size:
                ms, hs = f"{m}.mlp.shared_experts", f"{h}.mlp.shared_expert"
                maps += swiglu(ms, hs)
                maps.append(same(f"{ms}.gate_weight", f"{h}.mlp.shared_expert_gate.weight"))
            for e in range(arch.moe.num_experts):
                maps += swiglu(f"{m}.mlp.experts.local_experts.{e}", f"{h}.mlp.experts.{e}")
        else:
            maps += swiglu(f"{m}.mlp", f"{h}.mlp")
    maps.append(same("decoder.final_layernorm.weight", f"{text}norm.weight"))
    if not arch.tie_word_embeddings:
        maps.append(same("output_layer.weight", "lm_head.weight"))
    return maps


def local_mappings(
    maps: list[ParamMapping], stage: PipelineStage, experts: range | None = None
) -> list[ParamMapping]:
    """The mappings of the parameters this rank holds (all of `maps` at PP=1, EP=1).

    Pipeline: layer `i` of the model is `decoder.layers.{i - first_layer}` on its stage, the
    embedding lives on the first stage, the final norm and output layer on the last. Expert
    parallelism: a rank holds the routed experts `experts` (global ids), as
    `local_experts.{e - experts.start}`.
    """
    out: list[ParamMapping] = []
    for m in maps:
        name = m.megatron_name
        if name.startswith("decoder.layers."):
            _, _, idx, rest = name.split(".", 3)
            if int(idx) not in stage.layers:
                continue
            head, sep, tail = rest.partition("mlp.experts.local_experts.")
            if sep and experts is not None:
                e, dot, param = tail.partition(".")
                if int(e) not in experts:
                    continue
                rest = f"{head}{sep}{int(e) - experts.start}{dot}{param}"
            local = f"decoder.layers.{int(idx) - stage.first_layer}.{rest}"
            out.append(ParamMapping(local, m.hf_names, m.to_megatron, m.to_hf))
        elif name.startswith("embedding."):
            if stage.pre_process:
                out.append(m)
        elif stage.post_process:
            out.append(m)
    return out


def _local_experts(arch: ModelArch) -> range | None:
    """The routed experts this rank holds under Megatron's expert-parallel split (None: all)."""
    from megatron.core import parallel_state as ps

    if arch.moe is None or not ps.model_parallel_is_initialized():
        return None
    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return None
    n = arch.moe.num_experts // ep
    first = ps.get_expert_model_parallel_rank() * n
    return range(first, first + n)


def _model_arch(model: torch.nn.Module) -> ModelArch:
    arch = getattr(model, "isoexec_arch", None)
    if not isinstance(arch, ModelArch):
        raise TypeError("model was not built by isoexec.megatron.build_model (no isoexec_arch)")
    return arch


def _full_shape(param: torch.Tensor, spec: ShardSpec | None) -> tuple[int, ...]:
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] *= spec.size
    return tuple(shape)


def _checked_mappings(
    model: torch.nn.Module,
) -> tuple[list[ParamMapping], dict[str, torch.nn.Parameter]]:
    """The mappings, verified to cover the model's parameters exactly (no more, no less)."""
    arch = _model_arch(model)
    full = param_mappings(arch, native=not getattr(model, "isoexec_mode", False))
    maps = local_mappings(full, model_stage(model), _local_experts(arch))
    params = dict(model.named_parameters())
    mapped = {m.megatron_name for m in maps}
    if mapped != set(params):
        raise RuntimeError(
            "weight mapping out of sync with the model: unmapped Megatron params "
            f"{sorted(set(params) - mapped)}, mapped but absent {sorted(mapped - set(params))}"
        )
    return maps, params


# ------------------------------------------------------------------------------------------
# HF → Megatron
# ------------------------------------------------------------------------------------------


def _drop_unused(hf: dict[str, torch.Tensor], arch: ModelArch) -> dict[str, int]:
    """Remove the checkpoint's vision / MTP tensors from `hf`; {prefix: count} of them, said
    in one line. Only the architecture's declared prefixes: any other stray tensor stays and is
    refused by the exact-match check."""
    skipped: dict[str, int] = {}
    for name in list(hf):
        hit = next((p for p in arch.unused_prefixes if name.startswith(p)), None)
        if hit is not None:
            del hf[name]
            skipped[hit] = skipped.get(hit, 0) + 1
    if skipped:
        _log.warning("isoexec: %s", describe_unused(skipped))
    return skipped


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module, source: str | os.PathLike[str] | Mapping[str, torch.Tensor]
) -> dict[str, int]:
    """Copy an HF checkpoint (dir written by `save_pretrained`, single file or sharded with an
    index, or a state dict) into `model`; returns {prefix: count} of the tensors not used by
    the text model (a vision-language checkpoint's `model.visual.*`, any `mtp.*`).

    Refuses (CheckpointMismatchError, listing them) missing keys, unexpected keys and shape
    mismatches before touching any parameter. Tensors are cast to the parameter dtype (exact
    when the checkpoint dtype is the model's, or narrower). For tied embeddings a stored
    `lm_head.weight` is accepted only if it equals the embedding.
    """
    maps, params = _checked_mappings(model)
    arch = _model_arch(model)
    hf = dict(source) if isinstance(source, Mapping) else read_hf_state_dict(source)
    skipped = _drop_unused(hf, arch)
    # The checkpoint is checked against the whole model, whatever part of it this stage holds.
    every = param_mappings(arch, native=not getattr(model, "isoexec_mode", False))

    embed_name = f"{arch.text_prefix}embed_tokens.weight"
    if arch.tie_word_embeddings and "lm_head.weight" in hf:
        lm_head = hf.pop("lm_head.weight")
        embed = hf.get(embed_name)
        if embed is None or not torch.equal(lm_head, embed):
            raise CheckpointMismatchError(
                f"tie_word_embeddings=True but lm_head.weight differs from {embed_name}"
            )

    expected = {name for m in every for name in m.hf_names}
    missing, unexpected = sorted(expected - set(hf)), sorted(set(hf) - expected)
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"HF checkpoint does not match {arch.architecture}: "
            f"missing {missing[:20]}{'...' if len(missing) > 20 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:20]}{'...' if len(unexpected) > 20 else ''} "
            f"({len(unexpected)})"
        )

    # Shapes first, for every tensor: the expected HF shapes are the model's own export shapes.
    specs = {m.megatron_name: shard_spec(m.megatron_name, params[m.megatron_name]) for m in maps}
    bad = []
    for m in maps:
        p = params[m.megatron_name]
        full = torch.empty(_full_shape(p, specs[m.megatron_name]), dtype=p.dtype, device="meta")
        for name, ref in zip(m.hf_names, m.to_hf(full), strict=True):
            if tuple(hf[name].shape) != tuple(ref.shape):
                bad.append(f"{name}: checkpoint {tuple(hf[name].shape)}, model {tuple(ref.shape)}")
    if bad:
        raise CheckpointMismatchError("shape mismatches: " + "; ".join(bad))

    for m in maps:
        p = params[m.megatron_name]
        value = local_shard(m.to_megatron([hf[n] for n in m.hf_names]), specs[m.megatron_name])
        if value.shape != p.shape:  # guarded above; a wrong transform must not pass silently
            raise RuntimeError(f"{m.megatron_name}: converted {tuple(value.shape)} != {p.shape}")
        p.copy_(value.to(dtype=p.dtype))
    return skipped


# ------------------------------------------------------------------------------------------
# Megatron → HF
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def export_hf_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every weight, in HF names and layouts (for weight sync).

    Tensors are fresh contiguous copies (they do not alias the parameters, so an optimizer step
    cannot change what was already handed out). A tied output layer is not yielded, as HF's
    `save_pretrained` omits it.
    """
    maps, params = _checked_mappings(model)
    for m in maps:
        p = params[m.megatron_name].detach()
        full = gather_full(p, shard_spec(m.megatron_name, params[m.megatron_name]))
        for name, t in zip(m.hf_names, m.to_hf(full), strict=True):
            yield name, t.contiguous().clone()


def save_hf_safetensors(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """Write the exported weights to one safetensors file (e.g. `<dir>/model.safetensors`)."""
    save_file(dict(export_hf_weights(model)), str(path), metadata={"format": "pt"})


def save_hf_checkpoint(
    model: torch.nn.Module, out_dir: str | os.PathLike[str], source_dir: str | os.PathLike[str]
) -> None:
    """Write the model's weights as a full checkpoint in `source_dir`'s layout: its shards,
    index and config files, with the tensors the text model does not run (vision tower, MTP)
    copied unchanged. Every TP rank must call it (the export gathers); rank 0 writes. PP and
    EP ranks hold part of the model only, so a full checkpoint is refused there."""
    import torch.distributed as dist

    from isoexec.megatron.hf_checkpoint import write_like

    stage = model_stage(model)
    if not (stage.pre_process and stage.post_process) or _local_experts(_model_arch(model)):
        raise ValueError("save_hf_checkpoint needs the whole model on this rank (PP=1, EP=1)")
    tensors = dict(export_hf_weights(model))
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_like(tensors, out_dir, source_dir, keep_prefixes=_model_arch(model).unused_prefixes)


def hf_weight_names(model: torch.nn.Module) -> list[str]:
    """The HF names `export_hf_weights` yields, in order, without copying any tensor."""
    maps, _ = _checked_mappings(model)
    return [n for m in maps for n in m.hf_names]


__all__: list[str] = [
    "CheckpointMismatchError",  # re-exported from hf_checkpoint
    "ParamMapping",
    "export_hf_weights",
    "hf_weight_names",
    "load_hf_weights",
    "local_mappings",
    "param_mappings",
    "read_hf_state_dict",
    "save_hf_checkpoint",
    "save_hf_safetensors",
]
