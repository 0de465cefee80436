"""Install IsoExec into this vLLM process (called by the plugin entry point when ISOEXEC=1)."""

from __future__ import annotations

from isoexec.vllm.install_state import is_installed, mark_installed


def install_plugin() -> None:
    """Register every canonical override with vLLM, once per process.

    Runs before any model is built (vLLM loads general plugins first in the main, EngineCore
    and worker processes), which is when `register_oot` must happen.
    """
    if is_installed():
        return
    # This process owns every weight write (vLLM's loaders, IsoExec's weight sync), and both
    # paths clear the cache after writing: see `ops.gemm.enable_packed_weight_cache`.
    from isoexec.ops.capture_guard import capture_guard_enabled
    from isoexec.ops.gemm import enable_packed_weight_cache
    from isoexec.vllm.adapter_gate import (
        check_adapter_load,
        check_request_adapter,
        record_added,
        record_removed,
    )
    from isoexec.vllm.attention import register_attention
    from isoexec.vllm.cuda_attention import register_cuda_attention
    from isoexec.vllm.gdn import register_gdn
    from isoexec.vllm.graph_safety import add_splitting_ops
    from isoexec.vllm.layers import register_layers
    from isoexec.vllm.logprobs import install_sampler
    from isoexec.vllm.lora import PUNICA_WRAPPER
    from isoexec.vllm.moe import register_moe
    from isoexec.vllm.patches import (
        admit_lora_requests,
        gate_adapter_loads,
        select_punica_wrapper,
    )
    from isoexec.vllm.qwen3_5 import register_qwen3_5
    from isoexec.vllm.served_handshake import offer_when_loaded
    from isoexec.vllm.spec_decode import install_rejection_sampler
    from isoexec.vllm.weight_gate import (
        on_first_load,
        register_gated_models,
    )

    capture_guard_enabled()  # a malformed ISOEXEC_CAPTURE_GUARD refuses before any model is built
    enable_packed_weight_cache()
    register_layers()
    register_moe()
    register_gdn()
    add_splitting_ops()  # CUDA graphs: ops that read step metadata run between the pieces
    register_attention()
    register_cuda_attention()  # CUDA: every decoder backend vLLM may pick, and CUSTOM
    register_qwen3_5(isoexec=True)  # IsoExec's own text-only Qwen3.5 classes (stock: torchvision)
    install_sampler()
    install_rejection_sampler()  # speculative decoding verifies on canonical rows
    select_punica_wrapper(PUNICA_WRAPPER)  # LoRA adapters run the canonical LoRA op
    gate_adapter_loads(check_adapter_load)  # every adapter load needs MATCH and its fingerprint
    admit_lora_requests(check_request_adapter, record_added, record_removed)  # frontend
    register_gated_models()  # every weight write after the first load needs this worker's MATCH
    on_first_load(offer_when_loaded)  # a served engine offers its contract once loaded
    mark_installed()


__all__ = ["install_plugin", "is_installed"]
