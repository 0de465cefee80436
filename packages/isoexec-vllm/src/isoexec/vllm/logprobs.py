"""The sampler whose returned logprobs are the canonical `logprobs` op.

By default IsoExec returns the logprobs of the distribution actually sampled from (vLLM's
`processed_logprobs`: logits / temperature, fp32 log-softmax over the full vocab), which is
what a PPO ratio needs; the trainer scores with the same op and the same temperature. vLLM's
`raw_logprobs` (T=1 whatever the temperature) is the other mode it supports; the logprobs
site records which one the engine was started with (`mode`), as the trainer's records the one
it scores, so the handshake refuses a mix. vLLM's `*_logits` modes are not logprobs: refused.
Top-k / top-p would mask the distribution in a way the trainer does not reproduce: refused.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from isoexec import ops
from isoexec.contract.impl import ImplInfo
from isoexec.contract.options import LOGPROBS_MODES
from isoexec.contract.protocol import SAMPLING_EPS
from isoexec.ops.binding import bind
from isoexec.vllm.engine_binding import engine_binding, engine_options
from isoexec.vllm.layers import UnsupportedSiteError
from isoexec.vllm.patches import V2_RUNNER_ENV, rebind_sampler
from vllm.v1.sample.sampler import Sampler

LOGPROBS_MODE = "processed_logprobs"  # vLLM's default for IsoExec engines (harness, serve)
# A logprobs mode for which vLLM's `Sampler.sample` and top-k/top-p sampler compute nothing
# (they compute for the processed_* modes only).
_NO_LOGPROBS = "raw_logprobs"


def canonical_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor | None, backend_ops: ModuleType = ops
) -> torch.Tensor:
    """Full fp32 log-softmax rows, each at its request's temperature (greedy rows: T=1)."""
    if temperature is None:
        return backend_ops.log_softmax(logits)
    temps = torch.where(temperature < SAMPLING_EPS, 1.0, temperature).float().cpu()
    groups = torch.unique(temps).tolist()
    if len(groups) == 1:  # every row at one temperature: one call, no row copies
        return backend_ops.log_softmax(logits, temperature=groups[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for t in groups:
        rows = (temps == t).nonzero().reshape(-1).to(logits.device)
        out[rows] = backend_ops.log_softmax(logits[rows], temperature=t)
    return out


_BUILT: IsoSampler | None = None


def built_sampler() -> IsoSampler:
    """The sampler this worker's model runner built (the contract's logprobs site)."""
    if _BUILT is None:
        raise UnsupportedSiteError(
            "no IsoExec sampler was built in this worker process (vLLM's Model Runner V2, "
            "its default on CUDA, builds its own sampler; IsoExec's is the V1 runner's: leave "
            f"{V2_RUNNER_ENV} unset or 0, and no watermark / HiSparse config, which force V2)"
        )
    return _BUILT


class IsoSampler(Sampler):
    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise UnsupportedSiteError(
                f"IsoExec returns logprobs ({', '.join(LOGPROBS_MODES)}); the engine was "
                f"started with logprobs_mode={self.logprobs_mode!r}"
            )
        wanted = engine_options().logprobs_mode
        if self.logprobs_mode != wanted:
            raise UnsupportedSiteError(
                f"the engine was started with logprobs_mode={self.logprobs_mode!r} but its "
                f"IsoExec options say {wanted!r}: set both (the trainer takes the options)"
            )
        bind(self, engine_binding("logprobs", mode=self.logprobs_mode))
        # vLLM's own processed logprobs would be computed and thrown away (`sample` returns
        # the canonical ones): its top-k/top-p sampler is told not to compute them. Set on the
        # built sampler, not by building one for another mode: its constructor picks the
        # sampling kernel by mode (on CUDA, FlashInfer only outside the processed modes).
        self.topk_topp_sampler.logprobs_mode = _NO_LOGPROBS
        global _BUILT
        _BUILT = self  # the runner builds one per worker process, before the model loads

    def compute_logprobs(self, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Raw (T=1) logprobs, used by vLLM for prompt logprobs (through `self.sampler`)."""
        return self.ops.log_softmax(logits)

    def sample(
        self,
        logits: torch.Tensor,
        sampling_metadata: Any,
        logprobs_mode_override: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if logprobs_mode_override not in (None, self.logprobs_mode):
            raise UnsupportedSiteError(f"logprobs mode override {logprobs_mode_override!r}")
        wanted = sampling_metadata.max_num_logprobs is not None or bool(
            sampling_metadata.logprob_token_ids
        )
        # Logprobs of a top-k/top-p truncated distribution are not what the trainer scores:
        # refused when asked for. Without logprobs (e.g. vLLM's compile warm-up, which samples
        # with top-k and top-p) there is nothing to compare, and sampling is vLLM's own.
        if wanted and (sampling_metadata.top_k is not None or sampling_metadata.top_p is not None):
            raise UnsupportedSiteError(
                "top-k / top-p sampling with logprobs is not supported under IsoExec"
            )
        # Before vLLM's sampling, which divides the logits by the temperature in place.
        raw = self.logprobs_mode == "raw_logprobs"
        temps = None if raw else sampling_metadata.temperature
        processed = canonical_logprobs(logits, temps, self.ops) if wanted else None
        # (the override keeps vLLM's greedy branch from computing logprobs of its own)
        sampled, _ = super().sample(logits, sampling_metadata, _NO_LOGPROBS)
        return sampled, processed


def install_sampler() -> None:
    """Make vLLM's model runner build `IsoSampler`.

    vLLM has no extension point for the sampler, so this rebinds the one name the model
    runner constructs it through (`vllm.v1.worker.gpu_model_runner.Sampler`, also the base
    of the CPU runner). It runs in the worker process before the runner exists.
    """
    rebind_sampler(IsoSampler)  # and the V1 runner on CUDA (V2 builds its own sampler)
