"""Qwen3.5 and Qwen3.5-MoE for vLLM, text only: one model class for the four architectures
(`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` and the released vision-language checkpoints
`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`).

Why IsoExec has its own class: stock vLLM's `models/qwen3_5.py` imports the Qwen3-VL model
and through it transformers' image processors, which need torchvision, so the text model
cannot even be imported on an engine without it (and an RL rollout runs the text model only).
The maths of Qwen3.5 text is Qwen3-Next's hybrid (GatedDeltaNet layers, gated-q full
attention with partial RoPE, zero-centred norms) with the GDN input projections stored split
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), and either a dense SwiGLU MLP in every
layer (Qwen3.5) or Qwen3-Next's sparse block with a gated shared expert (Qwen3.5-MoE). So this
composition reuses vLLM's Qwen3-Next building blocks, whose numerics IsoExec makes canonical:

- `Qwen3NextDecoderLayer.forward` (pre-norm, fused residual add);
- `QwenGatedDeltaNetAttention` with `gqa_interleaved_layout=False`: its fused `in_proj_qkvz`
  holds `[in_proj_qkv; in_proj_z]` and `in_proj_ba` holds `[in_proj_b; in_proj_a]` (row
  concatenation, loaded shard by shard), run by `isoexec.vllm.gdn`;
- `IsoQwen3NextAttention` (gated output with the position-invariant sigmoid);
- `Qwen2MoeMLP` as the dense MLP (gate_up_proj, SiluAndMul, down_proj), or
  `Qwen3NextSparseMoeBlock` (router, `FusedMoE` experts, sigmoid-gated shared expert).

Checkpoint names: a vision-language checkpoint keeps the text model under
`model.language_model.*` (mapped to `model.*`); its `model.visual.*` and `mtp.*` tensors are
skipped, as stock vLLM skips `mtp.*` (a draft model's).

RoPE: HF's Qwen3.5 rotary embedding is M-RoPE over (T, H, W) positions; for text the three
are equal, so it is exactly 1-D partial RoPE. vLLM's config hook for the causal-LM names
(`Qwen3_5ForCausalLMConfig`) drops the M-RoPE fields so the runner passes 1-D positions; served
text only, the vision-language names get the same hook (`patches.text_only_config_hook`).

Registered through `ModelRegistry.register_model`, from the plugin: with `ISOEXEC=1` always
(canonical ops, gated weight loading); with it off only where stock vLLM cannot import its
own classes (no torchvision), so a stock arm can serve these checkpoints at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

import vllm.model_executor.models.qwen3_next as qwen3_next
from isoexec.vllm.layers import UnsupportedSiteError
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP
from vllm.model_executor.models.qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextSparseMoeBlock,
)
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    extract_layer_index,
    maybe_prefix,
)

ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
MOE_MODEL_TYPE = "qwen3_5_moe_text"

# HF checkpoint name -> (vLLM fused parameter, shard). `in_proj_qkv` fills shards 0..2 of the
# non-interleaved `in_proj_qkvz` ([q | k | v | z] output sizes) in one contiguous span.
HF_TO_VLLM = WeightsMapper(
    orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
        ".mlp.up_proj": (".mlp.gate_up_proj", 1),
        ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
        ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
        ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
        ".in_proj_z": (".in_proj_qkvz", 3),
        ".in_proj_b": (".in_proj_ba", 0),
        ".in_proj_a": (".in_proj_ba", 1),
    },
    # The text model of a vision-language checkpoint; its vision tower is not served, and
    # multi-token-prediction weights belong to a draft model, as in stock vLLM.
    orig_to_new_prefix={"model.language_model.": "model.", "model.visual.": None, "mtp.": None},
)


def _refuse_unsupported(config: Any, vllm_config: VllmConfig) -> None:
    """Refuse what this composition (or the canonical ops) does not express, at build time."""
    problems = []
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias=True")
    if getattr(config, "layer_scale", False):
        problems.append("layer_scale=True")
    if not getattr(config, "attn_output_gate", True):
        problems.append("attn_output_gate=False")
    moe = config.model_type == MOE_MODEL_TYPE
    if getattr(config, "num_experts", 0) and not moe:
        problems.append("MoE fields on dense Qwen3.5 (Qwen3.5-MoE is model_type qwen3_5_moe)")
    if moe and getattr(config, "norm_topk_prob", True) is False:
        problems.append("norm_topk_prob=False")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        problems.append("pipeline parallelism")
    if rope_has_mrope(config):
        problems.append("M-RoPE fields left in the text config (text-only positions expected)")
    if problems:
        arch = vllm_config.model_config.architecture
        raise UnsupportedSiteError(f"{arch}: not supported: " + ", ".join(problems))


def rope_has_mrope(config: Any) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return "mrope_section" in params


def _gated_attention_class() -> type[nn.Module]:
    """The gated full attention this engine builds: IsoExec's with ISOEXEC=1, else vLLM's."""
    from isoexec.contract.switch import isoexec_enabled

    if isoexec_enabled():
        from isoexec.vllm.gdn import IsoQwen3NextAttention

        return IsoQwen3NextAttention
    return qwen3_next.Qwen3NextAttention


class IsoQwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    """One Qwen3.5 text layer: GDN (split-projection layout) or gated attention; a dense MLP
    (Qwen3.5) or the sparse block with a shared expert (Qwen3.5-MoE).

    Only the construction differs from Qwen3-Next's layer (which decides MoE from
    `num_experts` and builds the interleaved GDN layout); `forward` is inherited.
    """

    def __init__(self, vllm_config: VllmConfig, layer_type: str, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        model_config = vllm_config.model_config
        quant_config = vllm_config.quant_config
        self.layer_type = layer_type
        self.layer_idx = extract_layer_index(prefix)
        self.use_attn_reduce_scatter_for_moe = False  # no MoE, no sequence parallelism
        self.layer_scale = False
        if layer_type == "linear_attention":
            # Instantiated through vLLM's name: the OOT registration makes it IsoExec's class.
            self.linear_attn = QwenGatedDeltaNetAttention(
                config,
                vllm_config=vllm_config,
                prefix=f"{prefix}.linear_attn",
                gqa_interleaved_layout=False,
            )
        elif layer_type == "full_attention":
            # With ISOEXEC=1 IsoExec's position-invariant gated attention
            # (`gdn.IsoQwen3NextAttention`), else stock.
            self.self_attn = _gated_attention_class()(
                config,
                model_config=model_config,
                cache_config=vllm_config.cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.self_attn",
            )
        else:
            raise UnsupportedSiteError(f"Qwen3.5: layer type {layer_type!r}")
        self.mlp: nn.Module
        if config.model_type == MOE_MODEL_TYPE:
            self.mlp = Qwen3NextSparseMoeBlock(vllm_config=vllm_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Qwen2MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


# Compiled like vLLM's own models in its default mode (eager with `enforce_eager`); the
# dynamic dimension is the token count. Explicit: this module's annotations are strings.
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class IsoQwen3_5Model(nn.Module):
    """Embedding, the decoder layers and the final (zero-centred) norm; one PP rank."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            IsoQwen3_5DecoderLayer(
                vllm_config, layer_type=config.layer_types[i], prefix=f"{prefix}.layers.{i}"
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if positions.ndim != 1:
            raise UnsupportedSiteError("Qwen3.5 (text only): expects 1-D text positions")
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions=positions, hidden_states=hidden, residual=residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)


class IsoQwen3_5ForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """IsoExec's text-only Qwen3.5 / Qwen3.5-MoE; see the module docstring."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
    }
    hf_to_vllm_mapper = HF_TO_VLLM

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        _refuse_unsupported(config, vllm_config)
        self.config = config
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.model = IsoQwen3_5Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)

    # The GDN state cache is Qwen3-Next's: same config fields, same shapes and dtypes.
    @classmethod
    def get_mamba_state_dtype_from_config(
        cls, vllm_config: VllmConfig
    ) -> tuple[torch.dtype, torch.dtype]:
        return Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> Any:
        return Qwen3NextForCausalLM.get_mamba_state_shape_from_config(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls) -> Any:
        return Qwen3NextForCausalLM.get_mamba_state_copy_func()


def register_qwen3_5(*, isoexec: bool) -> None:
    """Serve the four Qwen3.5 architectures with `IsoQwen3_5ForCausalLM` (vLLM's model
    extension point), and give the vision-language names the text-only config hook.

    `isoexec`: the class is registered with the gated `load_weights` (weight syncs need a
    MATCH). Off, it is registered as it is, stock layers and all.
    """
    from isoexec.vllm.patches import text_only_config_hook
    from isoexec.vllm.weight_gate import gated
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        cls = gated(IsoQwen3_5ForCausalLM) if isoexec else IsoQwen3_5ForCausalLM
        ModelRegistry.register_model(arch, cls)
        text_only_config_hook(arch)


def stock_can_import_qwen3_5() -> bool:
    """Whether stock vLLM's Qwen3.5 classes import here (they need torchvision)."""
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None
