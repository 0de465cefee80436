"""Build a Megatron-core `GPTModel` whose forward pass is the HF architecture's, exactly.

Two pieces of data decide the model:
- `transformer_config(arch, ...)` → a `TransformerConfig` (sizes, GQA, norms, RoPE, routing);
- `block_spec(arch, submodules)` → a `TransformerBlockSubmodules` (one `ModuleSpec` per layer:
  dense layers get `MLP`, sparse layers get `MoELayer` with `SequentialMLP` experts).

`Submodules` is the extension point for IsoExec: it names the class that fills every slot of a
layer (linears, norms, core attention, activation, MoE layer, router, experts) and the model
class. `native_submodules()` is Megatron's own local (no-TE) implementation;
`isoexec_submodules()` the canonical one (`canonical_modules`), selected by
`build_model(..., isoexec=True)`. A new architecture adds a `LayerSpecBuilder` to
`layer_specs._LAYER_SPEC_BUILDERS`.

The GDN hybrids, Qwen3-Next and Qwen3.5 text: their linear-attention layers put a GDN layer
in the `self_attention` slot, their full-attention layers Megatron's `SelfAttention` with
`attention_output_gate`; Qwen3-Next's MoE layers get a gated shared expert, Qwen3.5's layers a
dense MLP; norms are zero-centred (`layernorm_zero_centered_gamma`). isoexec mode:
`gdn.IsoGatedDeltaNet` and `IsoGatedSelfAttention`. Native mode: Megatron's own
`GatedDeltaNet` (fused `in_proj` [q | k | v | z | b | a], `conv1d`, `out_norm` with HF's plain
gain, `out_proj`) and `SelfAttention`, stock; on a CPU it runs through three shims in
`cpu_shims` (zero-centred torch RMSNorm for TE's, torch stand-ins for fla's `l2norm` and
chunked delta rule, CPU allocation). Megatron's `GatedDeltaNet` refuses packed (THD)
sequences, which native scoring never sends (one sequence per forward, see `scoring`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from isoexec.contract.options import IsoExecOptions
from isoexec.contract.switch import isoexec_enabled
from isoexec.megatron.hf_config import (
    HFConfigSource,
    ModelArch,
    load_hf_config,
)
from isoexec.megatron.layer_specs import (
    Submodules,
    block_spec,
    isoexec_submodules,
    native_submodules,
    qwen3_layer_spec,
    qwen3_next_layer_spec,
)

# ------------------------------------------------------------------------------------------
# TransformerConfig
# ------------------------------------------------------------------------------------------


def transformer_config(
    arch: ModelArch,
    *,
    tp: int = 1,
    dtype: torch.dtype = torch.float32,
    sub: Submodules | None = None,
    tp_leaves: int | None = None,
    backend: str = "torch",
    pp: int = 1,
    ep: int = 1,
    initialize: bool = True,
    logprobs_mode: str = "processed_logprobs",
    device: str = "cpu",
) -> Any:
    """The `TransformerConfig` reproducing `arch` (Qwen3 family), with every fusion off.

    `device` is where Megatron builds the parameters: "cpu" (`use_cpu_initialization`) or
    "cuda" (the current CUDA device); the GEMM sites record their library for it
    (`canonical_base.site_placement`).

    Fusions are off because they need CUDA/TE/apex and because IsoExec must know which kernel
    runs at each site. Dropout follows the HF config (0 for Qwen3), so scoring is deterministic.
    With canonical submodules (`sub.rope_in_core_attention`) it is an `IsoTransformerConfig`
    carrying the RoPE base, and the activation is built from the MLP spec
    (`use_te_activation_func`, Megatron's switch for "activation module from the spec").
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} not supported (float32, bfloat16, float16)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} not supported (cpu, cuda)")
    _check_tp(arch, tp)
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=arch.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=arch.attention_dropout,
        tensor_model_parallel_size=tp,
        sequence_parallel=False,
        # PP>1: stages exchange hidden states in the model dtype, one p2p op at a time (gloo
        # has no batched isend/irecv).
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        batch_p2p_comm=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # CPU: built there; CUDA: built on the current device (a model is never moved after it
        # was built: its GEMM sites record the device they were built for).
        use_cpu_initialization=device == "cpu",
        perform_initialization=initialize,
        # No fused kernels: they need CUDA/TE/apex and would hide which kernel runs.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        # HF softmaxes attention in fp32 and keeps the residual in the model dtype.
        attention_softmax_in_fp32=True,
        fp32_residual_connection=False,
    )
    if arch.is_moe:
        assert arch.moe is not None
        kwargs.update(
            num_moe_experts=arch.moe.num_experts,
            moe_router_topk=arch.moe.top_k,
            moe_ffn_hidden_size=arch.moe.intermediate_size,
            moe_layer_freq=[1 if m else 0 for m in arch.moe_layers],
            moe_router_score_function="softmax",
            # norm_topk_prob: topk over logits then softmax over the k == renormalised top-k
            # probabilities; without it: softmax over all experts, then topk.
            moe_router_pre_softmax=not arch.moe.norm_topk_prob,
            moe_router_topk_scaling_factor=None,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_z_loss_coeff=None,
            moe_router_enable_expert_bias=False,
            moe_router_dtype=None,  # like HF: router logits in the model dtype
            moe_grouped_gemm=False,
            # allgather: the alltoall dispatcher creates a torch.cuda.Stream at construction.
            moe_token_dispatcher_type="allgather",
            moe_shared_expert_intermediate_size=None,
            moe_permute_fusion=False,
            moe_router_fusion=False,
            expert_tensor_parallel_size=1,  # as megatron_parallel() sets it
            expert_model_parallel_size=ep,
        )
        if arch.moe.shared_expert_intermediate_size:
            kwargs.update(
                moe_shared_expert_intermediate_size=arch.moe.shared_expert_intermediate_size,
                moe_shared_expert_gate=True,
                moe_shared_expert_overlap=False,
            )
    if arch.zero_centered_norms:
        kwargs["layernorm_zero_centered_gamma"] = True
    if arch.attn_output_gate:
        kwargs["attention_output_gate"] = True
    if arch.gdn is not None:
        kwargs.update(
            linear_conv_kernel_dim=arch.gdn.conv_kernel,
            linear_key_head_dim=arch.gdn.key_head_dim,
            linear_value_head_dim=arch.gdn.value_head_dim,
            linear_num_key_heads=arch.gdn.num_key_heads,
            linear_num_value_heads=arch.gdn.num_value_heads,
        )
    if sub is not None and sub.activation is not None:
        kwargs["use_te_activation_func"] = True
    if sub is not None and sub.rope_in_core_attention:
        from isoexec.megatron.canonical_modules import IsoTransformerConfig

        return IsoTransformerConfig(
            **kwargs,
            isoexec_rope_theta=arch.rope_theta,
            isoexec_rotary_dim=arch.rotary_dim,
            isoexec_tp_leaves=tp_leaves,
            isoexec_backend=backend,
            isoexec_logprobs_mode=logprobs_mode,
        )
    if tp_leaves is not None or backend != "torch":
        raise ValueError(
            "tp_leaves / a kernel backend choose canonical ops: canonical modules only"
        )
    return TransformerConfig(**kwargs)


def _check_tp(arch: ModelArch, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    for what, n in (
        ("num_attention_heads", arch.num_attention_heads),
        ("num_key_value_heads", arch.num_kv_heads),
        ("vocab_size", arch.vocab_size),
        ("intermediate_size", arch.intermediate_size),
    ):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {what}={n}")
    if arch.moe is not None and arch.moe.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide moe_intermediate_size")
    if arch.gdn is not None and arch.gdn.num_key_heads % tp:
        # A rank holds whole key-head groups with their value heads (gdn).
        raise ValueError(
            f"tp={tp} does not divide linear_num_key_heads={arch.gdn.num_key_heads} "
            "(GDN layers shard by key-head group)"
        )


# ------------------------------------------------------------------------------------------


def _norms_to_model_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give the norm weights the model dtype, as HF has them.

    Why: `WrappedTorchNorm` builds `torch.nn.RMSNorm` without `params_dtype`, so in a bf16 model
    its weights stay fp32 and promote the normalised activations to fp32, a different
    computation from HF's (and a different export dtype). Any other parameter off `dtype` is a
    bug in the spec and is refused, except a parameter marked `isoexec_keep_fp32` (GDN's
    `A_log`, fp32 on the engine too).
    """
    for name, p in model.named_parameters():
        if p.dtype == dtype or getattr(p, "isoexec_keep_fp32", False):
            continue
        if name.endswith("norm.weight") and p.dtype == torch.float32:
            p.data = p.data.to(dtype)
        else:
            raise RuntimeError(f"parameter {name} is {p.dtype}, model dtype is {dtype}")


def _layout_device() -> str:
    """The device of the `megatron_parallel()` layout in force; "cpu" outside one (a parallel
    state set up by other means builds on the CPU, as before devices existed)."""
    from isoexec.megatron.parallel import current_layout

    layout = current_layout()
    return layout.device if layout is not None else "cpu"


def _default_device(device: str) -> Any:
    """CUDA: the current CUDA device as torch's default device while the model is built, so
    parameters and buffers that modules create without a device (IsoExec's norms, GDN
    parameters, index buffers) land where Megatron puts its own. CPU: nothing changes."""
    import contextlib

    if device == "cpu":
        return contextlib.nullcontext()
    return torch.device(device, torch.cuda.current_device())


def off_device(model: torch.nn.Module, device: str) -> list[str]:
    """Names of the parameters and buffers of `model` that are not on `device` (a type)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, t in tensors if t.device.type != device]


def build_model(
    hf_config: HFConfigSource | ModelArch,
    *,
    isoexec: bool | None = None,
    tp: int = 1,
    dtype: torch.dtype = torch.float32,
    options: IsoExecOptions | None = None,
    initialize: bool = True,
) -> Any:
    """A Megatron-core `GPTModel` with the HF model's architecture (weights: see `weights`).

    `initialize=False` skips the random initialisation (Megatron's `perform_initialization`):
    for a model whose weights are loaded next (`load_hf_weights` refuses a checkpoint that does
    not cover every parameter), which at 35B widths saves most of the build time on a CPU.

    Must be called inside an initialised parallel state (`megatron_parallel()`), whose TP size
    must equal `tp`; the model is built on that layout's device (`megatron_parallel(device=)`:
    the CPU, or the current CUDA device, where it must then stay). `isoexec=None` (the
    default) reads the one switch, `ISOEXEC` (as the engine does), so a trainer image that sets
    `ISOEXEC=1` builds canonical models; an explicit `True`/`False` overrides it.
    `isoexec=True` installs the canonical submodules in every slot and then reads every op site
    back: a site left native is an error (`SiteNotInstalledError`), never a silent fallback.

    `options` (`IsoExecOptions`, the object the engine takes too) chooses canonical variants:
    `tp_invariant=True` runs the row-parallel sites (o_proj, down_proj) as the TP-invariant
    `linear_tp` (K in `DEFAULT_TP_LEAVES` fixed leaves, fixed tree): logprobs are then bitwise
    the same at TP=1, 2, 4, 8 — but they are a different contract from the default
    `linear` (an engine must run `linear_tp` at those sites too). isoexec with TP>1 needs it.
    GDN hybrids at TP>1: isoexec only (their GDN layers shard by key-head group, the shared
    expert stays whole on every rank); native GDN layers are TP=1 only.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if isoexec is None:
        isoexec = isoexec_enabled()  # an unrecognised value raises, never a silent 'off'
    arch = hf_config if isinstance(hf_config, ModelArch) else load_hf_config(hf_config)
    if isoexec:
        sub = isoexec_submodules()
    else:
        sub = native_submodules()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("build_model needs Megatron parallel_state: use megatron_parallel()")
    if ps.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(
            f"tp={tp} but parallel_state has TP={ps.get_tensor_model_parallel_world_size()}"
        )
    options = options or IsoExecOptions()
    tp_invariant = options.tp_invariant
    if options != IsoExecOptions() and not isoexec:
        raise ValueError("IsoExec options choose canonical variants: they need isoexec=True")
    if isoexec and tp != 1 and not tp_invariant:
        raise ValueError(
            f"build_model(isoexec=True, tp={tp}): a K-split row-parallel linear is not "
            "TP-invariant; pass options=IsoExecOptions(tp_invariant=True) (bitwise equal to "
            "tp=1 with the same options)"
        )
    if tp != 1 and arch.gdn is not None and not isoexec:
        raise NotImplementedError(
            f"build_model(isoexec=False, tp={tp}) for {arch.architecture}: native (stock "
            "Megatron GatedDeltaNet) GDN layers are TP=1 only (the per-rank layout of its fused "
            "in_proj/conv1d is not mapped for weight load/export); isoexec=True with "
            "IsoExecOptions(tp_invariant=True) runs GDN hybrids at TP>1"
        )
    if ps.get_pipeline_model_parallel_world_size() > 1 and arch.tie_word_embeddings:
        raise NotImplementedError(
            f"build_model: {arch.architecture} ties its embeddings; at PP>1 the first and last "
            "stage would each hold a copy whose gradients must be summed per unit in a fixed "
            "order, which is not wired: run tied models at PP=1"
        )
    device = _layout_device()
    if device == "cuda":
        from isoexec.megatron.cpu_shims import apply_dependency_shims

        apply_dependency_shims()  # idempotent; what megatron_parallel(device="cuda") applied
    elif not torch.cuda.is_available():
        from isoexec.megatron.cpu_shims import apply_cpu_shims

        # idempotent; re-covers Megatron modules imported since. A native model needs the
        # shims of Megatron's own modules too; an IsoExec model only the process's.
        apply_cpu_shims(native_models=not isoexec)

    spec = block_spec(arch, sub)  # first: refuses what these modules cannot build
    from isoexec.megatron.pipeline import current_stage
    from isoexec.ops.gemm import DEFAULT_TP_LEAVES

    leaves = DEFAULT_TP_LEAVES if tp_invariant else None
    pp = ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    config = transformer_config(
        arch, tp=tp, dtype=dtype, sub=sub, tp_leaves=leaves, backend=options.backend, pp=pp,
        ep=ep if arch.is_moe else 1, initialize=initialize, logprobs_mode=options.logprobs_mode,
        device=device,
    )  # fmt: skip
    stage = current_stage(config)
    spec.layer_specs = spec.layer_specs[stage.first_layer : stage.first_layer + stage.num_layers]
    model_cls = sub.model or GPTModel
    with _default_device(device):
        model = model_cls(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=stage.pre_process,
            post_process=stage.post_process,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="none" if sub.rope_in_core_attention else "rope",
            rotary_percent=arch.partial_rotary_factor,  # unused with RoPE in the core attention
            rotary_base=arch.rope_theta,
        )
    if device != "cpu":
        off = off_device(model, device)
        if off:
            raise RuntimeError(
                f"build_model on {device}: {', '.join(off[:5])} were built elsewhere; every "
                "parameter and buffer must be created on the layout's device"
            )
    _norms_to_model_dtype(model, dtype)
    model.isoexec_arch = arch  # the facts it was built from, for weights/scoring/contract
    model.isoexec_mode = isoexec
    model.isoexec_stage = stage  # the layers it holds (all of them at PP=1)
    if isoexec:
        from isoexec.megatron.readback import verify_installed

        verify_installed(model)
    return model


__all__ = [
    "Submodules",
    "block_spec",
    "build_model",
    "isoexec_submodules",
    "native_submodules",
    "qwen3_layer_spec",
    "qwen3_next_layer_spec",
    "transformer_config",
]
