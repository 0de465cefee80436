"""Which IsoExec engine ops vLLM may capture in CUDA graphs, and which it must run between them.

Why: on CUDA vLLM compiles the model's forward into pieces split at its "splitting ops" and
captures the pieces in CUDA graphs (piecewise mode). A captured op replays the kernels it
launched at capture time, so it must neither read device data on the host nor read the step's
metadata in Python. IsoExec's engine ops fall into two kinds:

- **Captured** (every op in `compiled_ops` but the LoRA ones): graph-safe by construction.
  They take tensors and static sizes only, and never sync with the host: MoE routing stays on
  the device (`isoexec.ops.triton.moe_grouped`), RoPE is computed on the device. The capture
  guard (`ISOEXEC_CAPTURE_GUARD=1`, `isoexec.ops.capture_guard`) makes a sync in any of them
  raise, which the CPU tests use.
- **Split** (`SPLITTING_OPS`): the GDN core reads the step's metadata (which requests, how many
  tokens each, which state slot) and groups requests in Python; the LoRA ops group rows by
  adapter slot with data-dependent shapes. vLLM runs them eagerly between the graph pieces, as
  it runs its own `vllm::qwen_gdn_attention_core`. They are made splitting ops rather than
  graph-safe because a graph-safe GDN core would be a second recurrence launch structure to
  keep bitwise equal to the trainer's, for a decode-only saving.

Attention runs inside vLLM's `unified_attention_with_output`, already a splitting op, and the
IsoExec attention backend declares no full-graph support (`AttentionCGSupport.NEVER`), so vLLM
downgrades full graphs to piecewise: no IsoExec op is ever inside a full-model graph.

The splitting ops are set by IsoExec itself: vLLM's default list is a class attribute with no
registration function, so `add_splitting_ops` extends it through the patch registry (patch
`splitting_ops`); an engine whose explicit `splitting_ops` leaves one out, with CUDA graphs on,
is refused at start-up (`refused_graph_settings`).
"""

from __future__ import annotations

from typing import Any

SPLITTING_OPS = (
    "isoexec::gdn_core",
    "isoexec::lora_apply_by_slot",
    "isoexec::lora_expand_by_slot",
)


def add_splitting_ops() -> None:
    """Put `SPLITTING_OPS` in vLLM's default splitting ops (this process; before the config)."""
    from isoexec.vllm.patches import REGISTRY, VllmVersionError
    from vllm.config.compilation import CompilationConfig

    default = getattr(CompilationConfig, "_attention_ops", None)
    if not isinstance(default, list):
        raise VllmVersionError(
            "vllm.config.CompilationConfig._attention_ops is gone: IsoExec cannot make its "
            "metadata-reading ops splitting ops (written for vLLM 0.32)"
        )
    extended = [*default, *(op for op in SPLITTING_OPS if op not in default)]
    REGISTRY.apply(
        "splitting_ops", lambda: REGISTRY.set_attr(CompilationConfig, "_attention_ops", extended)
    )


def missing_splitting_ops(compilation_config: Any) -> list[str]:
    """The `SPLITTING_OPS` an engine with this compilation config would capture in a graph:
    none when it captures no piecewise graphs."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    if compilation_config.mode != CompilationMode.VLLM_COMPILE or mode in (
        None,
        CUDAGraphMode.NONE,
    ):
        return []
    split = set(compilation_config.splitting_ops or ())
    return [op for op in SPLITTING_OPS if op not in split]


def refused_graph_settings(vllm_config: Any) -> list[str]:
    """Why this engine's CUDA-graph settings would capture an op that must run between graphs."""
    missing = missing_splitting_ops(vllm_config.compilation_config)
    if not missing:
        return []
    return [
        f"compilation_config.splitting_ops leaves out {missing}: with CUDA graphs on, vLLM would "
        "capture these ops, which read the step's metadata or have data-dependent shapes (keep "
        "vLLM's default splitting ops, or add them)"
    ]


__all__ = ["SPLITTING_OPS", "add_splitting_ops", "missing_splitting_ops", "refused_graph_settings"]
