"""What the engine harness (`engine_process`) is given and gives back: its build settings, a
request's sampling settings, an adapter, and a completion. Plain data, no vLLM import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from isoexec.contract.options import IsoExecOptions
from isoexec.handshake.served import ServedHandshake
from isoexec.ops.penalties import Penalties


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how the engine is built; one object instead of many flags."""

    model: str
    dtype: str = "float32"
    isoexec: bool = False
    max_model_len: int = 512
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    multiprocessing: bool = False
    # KV cache reserved up front. vLLM-CPU's own knob is whole GiB per engine, which a test
    # suite running several engines cannot afford; tiny models need a few MiB.
    kv_cache_bytes: int = 128 * 2**20
    # CUDA: the share of the GPU's memory vLLM requires free at start (its default, 0.9,
    # refuses to start beside a trainer on the same GPU); None: vLLM's default. Unused on CPU.
    gpu_memory_utilization: float | None = None
    seed: int = 0
    # vLLM's logprobs mode; None: the options' (`processed_logprobs` unless they say raw), the
    # logprobs of the distribution actually sampled from (after temperature), what PPO needs.
    logprobs_mode: str | None = None
    extra_env: tuple[tuple[str, str], ...] = ()  # hashable: configs key the engine pool
    # Where the engine's own output goes (stdout and stderr of the engine process and of every
    # process it starts: vLLM's logs, warnings, progress bars); None: this process's. Errors
    # reach the caller either way, as the EngineError's traceback.
    log_file: str | None = None
    # Which canonical variants run (isoexec only); reaches the workers as additional_config.
    options: IsoExecOptions = field(default_factory=IsoExecOptions)
    # Where each worker offers its contract as soon as it has loaded the checkpoint (isoexec
    # only; as `isoexec engine serve --handshake-*`); None: offer on request (`handshake`).
    handshake: ServedHandshake | None = None
    # vLLM's own tensor parallelism: its multiprocess executor, one worker per rank (gloo on
    # CPU), each bound to its share of this process's CPUs (`cpu_binding`).
    tensor_parallel_size: int = 1
    # vLLM's default mode, compiled (torch.compile of the model; CUDA graphs on GPU), as users
    # run it; the canonical ops are opaque to the compiler (`compiled_ops`). True: eager.
    enforce_eager: bool = False
    # LoRA (vLLM's `enable_lora`): None off, else (max_lora_rank, max_loras). The rank is the
    # padded rank of the canonical LoRA op, which the contract records.
    lora: tuple[int, int] | None = None
    # vLLM's speculative_config as (key, value) pairs (hashable), e.g. (("method", "ngram"),
    # ("num_speculative_tokens", 3)); empty: no speculation.
    speculative: tuple[tuple[str, Any], ...] = ()
    # vLLM's max_logprobs (its default: 20); -1: whole rows may be asked for (`full_vocab`).
    max_logprobs: int | None = None
    # vLLM's worker_extension_cls by qualname; None: IsoExec's. An IsoExec engine takes only a
    # class that includes IsoExec's (`worker_extension.compose(FrameworkExtension)`).
    worker_extension: str | None = None


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter a request runs under: vLLM's `LoRARequest(name, int_id, path)`."""

    name: str
    int_id: int
    path: str


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int = 8
    temperature: float = 1.0
    prompt_logprobs: bool = False
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # Penalties, logit bias and allowed tokens (canonical: `isoexec.ops.penalties`).
    penalties: Penalties | None = None
    # Further `SamplingParams` fields, as (name, value) pairs (hashable), e.g. a logit bias:
    # how a test asks for a setting the admission check must refuse.
    extra: tuple[tuple[str, Any], ...] = ()
    lora: LoraAdapter | None = None
    # Return each sampled position's whole processed logprob row (vLLM's logprobs=-1; the
    # engine needs max_logprobs=-1).
    full_vocab: bool = False


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token (fp32 values, exact as Python floats)
    prompt_logprobs: list[float] | None  # for prompt tokens 1..n-1, when asked
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With `full_vocab`: per sampled token, the whole processed row (-inf: not kept).
    full_logprobs: list[list[float]] | None = None
    # The weights version it was sampled under: 0 as loaded at start, +1 per gated load
    # (`EngineProcess` counts them; `isoexec.ray` sets the run's own); None where nobody does.
    weights_version: int | None = None
    # The fingerprint of those weights (the trainer's export of them); None for the checkpoint
    # the engine started from.
    weights_fingerprint: str | None = None


__all__ = ["Completion", "EngineConfig", "LoraAdapter", "SamplingSpec"]
