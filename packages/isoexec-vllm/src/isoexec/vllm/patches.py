"""Every place IsoExec writes into vLLM where vLLM 0.32 offers no extension point. One module,
each patch with its reason, pinned to the vLLM version they were written against (everything
else enters through vLLM's own extension points: `CustomOp` / `PluggableLayer.register_oot`,
`ModelRegistry.register_model`, the attention-backend registry, the worker extension).

- `rebind_sampler`: the model runner constructs its sampler through the module-global name
  `vllm.v1.worker.gpu_model_runner.Sampler` (the CPU runner inherits it); the sampler is not a
  `CustomOp`, so the name is rebound to IsoExec's.
- `rebind_qwen3_next_attention`: `Qwen3NextAttention` is a plain `nn.Module` whose output gate
  is inline; Qwen3-Next's decoder layer constructs it through the module-global name, which is
  rebound.
- `text_only_config_hook`: vLLM picks a per-architecture config hook from
  `vllm.model_executor.models.config.MODELS_CONFIG_MAP`; the table has no registration
  function. Served text only, a Qwen3.5 vision-language architecture needs the hook of its
  causal-LM sibling, which drops the M-RoPE fields so the runner passes 1-D positions.
- `select_punica_wrapper`: vLLM's LoRA layers get their punica wrapper (the adapter maths)
  from `current_platform.get_punica_wrapper()`, a per-platform constant with no registration;
  the running platform's method is made to name IsoExec's (`lora.IsoPunicaWrapper`).
- `gate_adapter_loads`: every adapter a worker loads (a request's `LoRARequest`, `add_lora`,
  `/v1/load_lora_adapter`) is read by `WorkerLoRAManager._load_adapter`, which has no hook;
  it is wrapped so the adapter gate (`adapter_gate.check_adapter_load`) runs first.
- `admit_lora_requests`: the frontend validates a request's `LoRARequest` in
  `InputProcessor._validate_lora` and adds adapters through `LLMEngine.add_lora` /
  `AsyncLLM.add_lora` / `remove_lora`, none with a hook; each is wrapped so a request may
  name only an adapter that was added (and so passed the gate) first.
- IsoExec's linear layers override `CustomOp.dispatch_forward` (`layers.py`) to bind the
  engine's backend when vLLM constructs the layer: a method vLLM calls, not a public hook.
"""

from __future__ import annotations

from typing import Any

WRITTEN_FOR_VLLM = "0.32"

# Vision-language name -> the causal-LM name whose config hook a text-only engine uses.
_TEXT_ONLY_HOOK_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


class VllmVersionError(RuntimeError):
    """vLLM's internals differ from those a patch here was written for."""


def _rebind(module: object, name: str, new: type) -> None:
    if not hasattr(module, name):
        raise VllmVersionError(
            f"{getattr(module, '__name__', module)}.{name} is gone (written for vLLM "
            f"{WRITTEN_FOR_VLLM}): IsoExec cannot install {new.__name__}"
        )
    setattr(module, name, new)


def rebind_sampler(sampler_cls: type) -> None:
    """Make vLLM's (V1) model runner build `sampler_cls` (in the worker, before the runner)."""
    import vllm.v1.worker.gpu_model_runner as runner

    _rebind(runner, "Sampler", sampler_cls)


def rebind_qwen3_next_attention(attention_cls: type) -> None:
    """Make Qwen3-Next decoder layers build `attention_cls` (before any model is built)."""
    import vllm.model_executor.models.qwen3_next as qwen3_next

    _rebind(qwen3_next, "Qwen3NextAttention", attention_cls)


def select_punica_wrapper(qualname: str) -> None:
    """Make vLLM's LoRA layers build the punica wrapper `qualname` (before the LoRA manager)."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if not hasattr(platform, "get_punica_wrapper"):
        raise VllmVersionError(
            f"{platform.__name__}.get_punica_wrapper is gone (written for vLLM "
            f"{WRITTEN_FOR_VLLM}): IsoExec cannot install its LoRA op"
        )
    platform.get_punica_wrapper = classmethod(lambda cls: qualname)  # type: ignore[method-assign]


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
    if getattr(original, "isoexec_gated", False):
        return

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        return original(self, check(self, lora_request))

    _load_adapter.isoexec_gated = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign]


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
    if getattr(InputProcessor._validate_lora, "isoexec_gated", False):
        return
    validate = InputProcessor._validate_lora

    @functools.wraps(validate)
    def _validate_lora(self: Any, lora_request: Any) -> None:
        validate(self, lora_request)
        check(lora_request)

    _validate_lora.isoexec_gated = True  # type: ignore[attr-defined]
    InputProcessor._validate_lora = _validate_lora  # type: ignore[method-assign]

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

            cls.add_lora, cls.remove_lora = add_async, remove_async  # type: ignore[method-assign]
        else:

            def add_sync(self: Any, req: Any, _add: Any = add) -> Any:
                out = _add(self, req)
                on_added(req, out)
                return out

            def remove_sync(self: Any, lora_id: int, _remove: Any = remove) -> Any:
                on_removed(lora_id)
                return _remove(self, lora_id)

            cls.add_lora, cls.remove_lora = add_sync, remove_sync  # type: ignore[method-assign]


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
    table[arch] = table[sibling]


__all__ = [
    "WRITTEN_FOR_VLLM",
    "VllmVersionError",
    "admit_lora_requests",
    "gate_adapter_loads",
    "rebind_qwen3_next_attention",
    "rebind_sampler",
    "select_punica_wrapper",
    "text_only_config_hook",
]
