"""Every write IsoExec makes into vLLM or Megatron-core, declared as data (both sides').

Each side applies its entries through its `PatchRegistry` (`isoexec.contract.patching`), which
refuses a name not declared here; the contract lists this table (`contract_patch_list`), so a
peer whose IsoExec patches differently is named in the diff; docs/architecture.md's patch
table is generated from it (`markdown`) and checked. Everything else enters through the
frameworks' extension points: vLLM's `CustomOp` / `PluggableLayer.register_oot`,
`ModelRegistry.register_model`, the attention-backend registry, the worker extension;
Megatron's `ModuleSpec`.
"""

from __future__ import annotations

from isoexec.contract.patching import PatchEntry

VLLM = "vllm 0.32.0"
MEGATRON = "megatron-core 0.16.1"

_ENGINE = (
    ("sampler", "vllm.v1.worker.gpu_model_runner.Sampler",
     "the model runner builds its sampler through this module-global name (the CPU runner "
     "inherits it); the sampler is not a CustomOp"),
    ("rejection_sampler", "vllm.v1.worker.gpu_model_runner.RejectionSampler",
     "under speculative decoding the model runner builds its rejection sampler through this "
     "module-global name, as it does the sampler; it has no extension point"),
    ("speculative_logitsprocs", "vllm.v1.worker.gpu_model_runner.build_logitsprocs",
     "under speculation vLLM refuses every custom logits processor (it cannot apply them to "
     "draft rows); IsoExec's admission check changes no logits and must still run"),
    ("v1_model_runner", "env VLLM_USE_V2_MODEL_RUNNER=0 (unless the user set it)",
     "on CUDA vLLM defaults to Model Runner V2, which builds its own sampler; V1 runs IsoExec's"),
    ("text_only_config_hook", "vllm.model_executor.models.config.MODELS_CONFIG_MAP[<VL arch>]",
     "the per-architecture config hooks have no registration function; a Qwen3.5 "
     "vision-language checkpoint served text only needs its causal-LM sibling's hook"),
    ("punica_wrapper", "<current platform>.get_punica_wrapper",
     "LoRA layers get their adapter maths from this per-platform constant, no registration"),
    ("adapter_loads", "vllm.lora.worker_manager.WorkerLoRAManager._load_adapter",
     "every adapter a worker loads passes here, with no hook: the adapter gate runs first"),
    ("lora_admission", "InputProcessor._validate_lora, LLMEngine/AsyncLLM.add_lora/remove_lora",
     "the frontend validates and adds adapters with no hook: a request may name only an "
     "adapter that passed the gate"),
    ("splitting_ops", "vllm.config.compilation.CompilationConfig._attention_ops",
     "vLLM's default splitting ops are this class list, with no registration; IsoExec's GDN "
     "core and LoRA ops read step metadata and must run between CUDA graph pieces"),
)  # fmt: skip

_TRAINER = (
    ("jit_fuser", "megatron.core.jit.jit_fuser and every jit_fuser-compiled helper",
     "jit_fuser is torch.compile: Inductor compiling C++ on CPU, numerics unlike eager"),
    ("rotary_embedding_cpu", "RotaryEmbedding.get_emb",
     "upstream moves inv_freq to torch.cuda.current_device(), which raises on a CPU torch"),
    ("global_memory_buffer_cpu", "GlobalMemoryBuffer.get_tensor",
     "DotProductAttention's baddbmm buffer is allocated on the CUDA device"),
    ("causal_masks_cpu", "transformer.utils / fused_softmax get_default_causal_mask, "
     "get_sliding_window_causal_mask", "the masks are built with device='cuda'"),
    ("router_gating_cpu", "Router.gating",
     "upstream moves the router weight to the CUDA device at the first forward"),
    ("moe_utils_without_te", "moe_utils.te_general_gemm",
     "without Transformer Engine the router's `te_general_gemm is not None` test raises "
     "NameError (native MoE, any device)"),
    ("cpu_rng_tracker", "tensor_parallel.random.model_parallel_cuda_manual_seed (+ re-export)",
     "seeding goes through the CUDA RNG tracker, which raises on CPU"),
    ("tp_mappings_cpu", "tensor_parallel.mappings.torch",
     "TP/EP collectives allocate their outputs on torch.cuda.current_device()"),
    ("pipeline_cpu", "pipeline_parallel p2p_communication / schedules .torch",
     "p2p receive buffers and token counts are allocated on the CUDA device"),
    ("torch_norm_zero_centered_gamma", "WrappedTorchNorm.__new__",
     "the no-TE norm refuses layernorm_zero_centered_gamma, which GDN hybrids need (any device)"),
    ("gated_delta_net_without_fla", "gated_delta_net.l2norm, chunk_gated_delta_rule, HAVE_FLA",
     "without flash-linear-attention GatedDeltaNet refuses to construct (native GDN, any "
     "device): Megatron's own torch chunked rule and HF's l2norm stand in"),
    ("gated_delta_net_cpu", "gated_delta_net.torch",
     "GatedDeltaNet allocates conv1d, dt_bias and A_log on the CUDA device"),
    ("rope_calls_traced", "megatron.core.transformer.attention.apply_rotary_pos_emb",
     "tracing a native model only (`isoexec locate`): its RoPE has no module, so a hook cannot "
     "see it; rebound for the length of a trace (IsoExec's RoPE is a module)"),
    ("batch_invariant_without_te", "batch_invariant_kernels._te_patch_for_batch_invariant, "
     "_te_unpatch_for_batch_invariant", "the upstream-bi arm only, for its length: Megatron's "
     "batch_invariant_mode imports Transformer Engine unconditionally; a TE-less native model "
     "has no TE layer to patch"),
)  # fmt: skip

DECLARED: tuple[PatchEntry, ...] = tuple(
    PatchEntry(side, name, target, reason, version)
    for side, version, rows in (("engine", VLLM, _ENGINE), ("trainer", MEGATRON, _TRAINER))
    for name, target, reason in rows
)


def contract_patch_list() -> tuple[str, ...]:
    """Every declared patch as `side:name@version`, sorted: what a contract records."""
    return tuple(sorted(e.key for e in DECLARED))


DOC_BEGIN = "<!-- generated from isoexec.contract.patch_table (markdown()): do not edit -->"
DOC_END = "<!-- end of generated patch table -->"


def markdown() -> str:
    """The patch table of docs/architecture.md."""
    rows = [DOC_BEGIN, "", "| side | patch | writes | why no extension point serves | checked "
            "against |", "|---|---|---|---|---|"]  # fmt: skip
    rows += [f"| {e.side} | `{e.name}` | `{e.target}` | {e.reason} | {e.checked_against} |"
             for e in DECLARED]  # fmt: skip
    return "\n".join([*rows, "", DOC_END])


__all__ = ["DECLARED", "DOC_BEGIN", "DOC_END", "contract_patch_list", "markdown"]
