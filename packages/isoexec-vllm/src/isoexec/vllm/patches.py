"""Every write IsoExec makes into vLLM where vLLM 0.32 offers no extension point, each one a
patch declared in `isoexec.contract.patch_table` (target, reason, checked-against version) and
applied through this side's `PatchRegistry` (`REGISTRY`), which records what it replaced so
that `REGISTRY.undo(name)` puts vLLM back. Everything else enters through vLLM's own extension
points: `CustomOp` / `PluggableLayer.register_oot`, `ModelRegistry.register_model`, the
attention-backend registry, the worker extension.

IsoExec's norm, RoPE and activation layers also override `CustomOp.dispatch_forward`
(`layers.py`, `gdn.py`) in their own subclasses: a method vLLM calls, not a write into vLLM, so
not a patch. It is kept over implementing `forward_native` / `forward_cpu` / `forward_cuda`
because it fails closed: whatever vLLM's dispatch would pick (a platform hook added later, a
disabled op's separately compiled `forward_native`), the layer runs its canonical binding.
"""

from __future__ import annotations

from typing import Any

from isoexec.contract.patch_table import DECLARED
from isoexec.contract.patching import PatchError, PatchRegistry

WRITTEN_FOR_VLLM = "0.32"
REGISTRY = PatchRegistry("engine", DECLARED)

# Vision-language name -> the causal-LM name whose config hook a text-only engine uses.
_TEXT_ONLY_HOOK_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


class VllmVersionError(PatchError):
    """vLLM's internals differ from those a patch here was written for."""


def _rebind(patch: str, module: object, name: str, new: type) -> None:
    if not hasattr(module, name):
        raise VllmVersionError(
            f"{getattr(module, '__name__', module)}.{name} is gone (written for vLLM "
            f"{WRITTEN_FOR_VLLM}): IsoExec cannot install {new.__name__}"
        )
    REGISTRY.apply(patch, lambda: REGISTRY.set_attr(module, name, new))


def rebind_sampler(sampler_cls: type) -> None:
    """Make vLLM's (V1) model runner build `sampler_cls` (in the worker, before the runner),
    and select the V1 runner on CUDA (vLLM 0.32 defaults to V2 there, which builds its own
    sampler; a user who asks for V2 explicitly keeps it, and its logprobs site then reads back
    native, so the handshake refuses)."""
    import vllm.v1.worker.gpu_model_runner as runner

    _rebind("sampler", runner, "Sampler", sampler_cls)
    REGISTRY.apply("v1_model_runner", lambda: REGISTRY.set_env(V2_RUNNER_ENV, "0"))


def rebind_rejection_sampler(sampler_cls: type, build_logitsprocs: Any) -> None:
    """Make vLLM's (V1) model runner build `sampler_cls` as its speculative-decoding
    rejection sampler, and its logits processors with `build_logitsprocs` (in the worker,
    before the runner)."""
    import vllm.v1.worker.gpu_model_runner as runner

    _rebind("rejection_sampler", runner, "RejectionSampler", sampler_cls)
    if not hasattr(runner, "build_logitsprocs"):
        raise VllmVersionError(
            f"vllm.v1.worker.gpu_model_runner.build_logitsprocs is gone (written for vLLM "
            f"{WRITTEN_FOR_VLLM}): IsoExec cannot build its processors under speculation"
        )
    REGISTRY.apply(
        "speculative_logitsprocs",
        lambda: REGISTRY.set_attr(runner, "build_logitsprocs", build_logitsprocs),
    )


# vLLM's switch between its model runners (V2 builds its own sampler).
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def select_punica_wrapper(qualname: str) -> None:
    """Make vLLM's LoRA layers build the punica wrapper `qualname` (before the LoRA manager)."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if not hasattr(platform, "get_punica_wrapper"):
        raise VllmVersionError(
            f"{platform.__name__}.get_punica_wrapper is gone (written for vLLM "
            f"{WRITTEN_FOR_VLLM}): IsoExec cannot install its LoRA op"
        )
    wrapper = classmethod(lambda cls: qualname)
    REGISTRY.apply(
        "punica_wrapper", lambda: REGISTRY.set_attr(platform, "get_punica_wrapper", wrapper)
    )


def gate_adapter_loads(check: Any) -> None:
    """Run `check(manager, lora_request)` before every adapter load of this worker process; the
    request it returns (the adapter's verified copy) is what vLLM loads."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = getattr(WorkerLoRAManager, "_load_adapter", None)
    if original is None:
        raise VllmVersionError(
            f"WorkerLoRAManager._load_adapter is gone (written for vLLM {WRITTEN_FOR_VLLM}): "
            "IsoExec cannot gate adapter loads"
        )

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        return original(self, check(self, lora_request))

    REGISTRY.apply(
        "adapter_loads",
        lambda: REGISTRY.set_attr(WorkerLoRAManager, "_load_adapter", _load_adapter),
    )


def admit_lora_requests(check: Any, on_added: Any, on_removed: Any) -> None:
    """Run `check(lora_request)` when the frontend validates a request's adapter, and tell
    `on_added(lora_request, result)` / `on_removed(lora_id)` about every add and removal."""
    import functools

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine

    for cls, name in ((InputProcessor, "_validate_lora"), (LLMEngine, "add_lora"),
                      (LLMEngine, "remove_lora"), (AsyncLLM, "add_lora"),
                      (AsyncLLM, "remove_lora")):  # fmt: skip
        if not hasattr(cls, name):
            raise VllmVersionError(
                f"{cls.__name__}.{name} is gone (written for vLLM {WRITTEN_FOR_VLLM}): IsoExec "
                "cannot admit LoRA requests"
            )
    if REGISTRY.is_applied("lora_admission"):
        return
    validate = InputProcessor._validate_lora

    @functools.wraps(validate)
    def _validate_lora(self: Any, lora_request: Any) -> None:
        validate(self, lora_request)
        check(lora_request)

    def write() -> None:
        REGISTRY.set_attr(InputProcessor, "_validate_lora", _validate_lora)
        for cls in (LLMEngine, AsyncLLM):
            add, remove = cls.add_lora, cls.remove_lora
            if cls is AsyncLLM:

                async def add_async(self: Any, req: Any, _add: Any = add) -> Any:
                    out = await _add(self, req)
                    on_added(req, out)
                    return out

                async def remove_async(self: Any, lora_id: int, _remove: Any = remove) -> Any:
                    on_removed(lora_id)
                    return await _remove(self, lora_id)

                REGISTRY.set_attr(cls, "add_lora", add_async)
                REGISTRY.set_attr(cls, "remove_lora", remove_async)
            else:

                def add_sync(self: Any, req: Any, _add: Any = add) -> Any:
                    out = _add(self, req)
                    on_added(req, out)
                    return out

                def remove_sync(self: Any, lora_id: int, _remove: Any = remove) -> Any:
                    on_removed(lora_id)
                    return _remove(self, lora_id)

                REGISTRY.set_attr(cls, "add_lora", add_sync)
                REGISTRY.set_attr(cls, "remove_lora", remove_sync)

    REGISTRY.apply("lora_admission", write)


def text_only_config_hook(arch: str) -> None:
    """Give `arch` its causal-LM sibling's config hook (a no-op for a causal-LM name)."""
    sibling = _TEXT_ONLY_HOOK_OF.get(arch)
    if sibling is None:
        return
    from vllm.model_executor.models import config as model_configs

    table = model_configs.MODELS_CONFIG_MAP
    if sibling not in table:
        raise VllmVersionError(
            f"vLLM has no config hook for {sibling} (written for vLLM {WRITTEN_FOR_VLLM})"
        )
    REGISTRY.apply(
        "text_only_config_hook", lambda: REGISTRY.set_item(table, arch, table[sibling]), rerun=True
    )


__all__ = [
    "REGISTRY",
    "V2_RUNNER_ENV",
    "WRITTEN_FOR_VLLM",
    "VllmVersionError",
    "admit_lora_requests",
    "gate_adapter_loads",
    "rebind_sampler",
    "select_punica_wrapper",
    "text_only_config_hook",
]
