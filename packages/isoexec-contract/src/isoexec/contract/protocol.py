"""What trainer and engine must agree on that is neither an op nor a contract field: defined
once here, imported by both sides (never two copies "kept in sync").

- `SAMPLING_EPS`: vLLM's `_SAMPLING_EPS`. A request with a temperature below it is greedy; the
  engine reports its logprobs at T=1, so the trainer scores it at T=1.
- `LM_HEAD_ROW_PADDING`: vLLM's `DEFAULT_VOCAB_PADDING_SIZE`. The engine's lm-head weight has
  its vocab rows padded to a multiple of this; the trainer's canonical lm-head GEMM pads the
  same way, so both run the same GEMM shape.
- `SiteRefusedError`: a site (or a model feature) that cannot be installed canonically. Each
  side raises its subclass (`CanonicalSiteError` on the trainer, `UnsupportedSiteError` on the
  engine); a caller can catch either side's refusal as this one type.
"""

from __future__ import annotations

SAMPLING_EPS = 1e-5
LM_HEAD_ROW_PADDING = 64


class SiteRefusedError(RuntimeError):
    """A site IsoExec cannot install canonically: refused, never left native silently."""


__all__ = ["LM_HEAD_ROW_PADDING", "SAMPLING_EPS", "SiteRefusedError"]
