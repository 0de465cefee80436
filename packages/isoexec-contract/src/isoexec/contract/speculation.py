"""What speculative decoding means for a side's bits (`Contract.speculation`).

A speculating engine verifies k drafted tokens in one forward over k+1 positions and samples
them through a rejection sampler. Stock, both change the bits: the verification chunk runs
batch-variant kernels and the rejection sampler its own sampling arithmetic. So a side whose
bits depend on speculation records its method and k (`"ngram/3"`), and never MATCHes a trainer
(which does not speculate, `"none"`) or an engine speculating otherwise.

A canonical side records `"invariant"`: its ops give a row the same bits in a chunk as in a
decode step, and its verifier (`isoexec.vllm.spec_decode.IsoRejectionSampler`) returns the
logprobs of the canonical processed rows, so whether and how it speculates changes no returned
bit (tested bitwise against the trainer in integration/test_speculative.py). This is the rule
of the parallel layout (`parallel_layout`): a canonical trainer and a canonical engine declare
the same thing, and a side whose bits depend on the setting names the setting.

The rule (`declared_speculation`), one for both sides:
- "invariant": every site is canonical and, when speculating, the verifier is IsoExec's;
- "none": not canonical and not speculating;
- "<method>/<k>": speculating with a verifier or ops whose bits depend on it.

A canonical engine's own method and k are reported beside the contract, in the handshake
offer's settings (`isoexec.handshake.side_settings`), where they are shown but not hashed.
"""

from __future__ import annotations

import re

INVARIANT = "invariant"
NONE = "none"
_SETTING = re.compile(r"^[a-z][a-z0-9_]*/[1-9][0-9]*$")


class SpeculationError(ValueError):
    """A speculation entry that is not "invariant", "none" or "<method>/<k>"."""


def check_speculation(value: object) -> str:
    """The entry itself, or SpeculationError naming what is wrong."""
    if not isinstance(value, str) or not (
        value in (INVARIANT, NONE) or _SETTING.match(value) is not None
    ):
        raise SpeculationError(
            f"speculation: must be 'invariant', 'none' or '<method>/<k>' (e.g. 'ngram/3'), "
            f"got {value!r}"
        )
    return value


def declared_speculation(
    *,
    canonical: bool,
    method: str | None = None,
    num_tokens: int | None = None,
    canonical_verifier: bool = True,
) -> str:
    """The entry a side declares (the rule of the module doc). `method`/`num_tokens`: the
    engine's speculative method and k, None when it does not speculate (a trainer never does);
    `canonical_verifier`: the engine's rejection sampler is IsoExec's."""
    if method is None:
        if num_tokens is not None:
            raise SpeculationError(f"num_tokens={num_tokens!r} without a speculative method")
        return INVARIANT if canonical else NONE
    if canonical and canonical_verifier:
        return INVARIANT
    if type(num_tokens) is not int or num_tokens < 1:
        raise SpeculationError(f"speculating needs num_tokens >= 1, got {num_tokens!r}")
    return check_speculation(f"{method.lower()}/{num_tokens}")


__all__ = ["INVARIANT", "NONE", "SpeculationError", "check_speculation", "declared_speculation"]
