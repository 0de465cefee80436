"""Every place IsoExec writes into Megatron-core for a reason other than the CPU (those are in
`cpu_shims`). One module, each patch with its reason, pinned to the megatron-core version it
was written against; the model itself is composed through Megatron's own extension point,
`ModuleSpec` (`layer_specs.py`).

- `rope_calls_wrapped`: tracing a native (stock) model only. Its RoPE has no module, so a
  forward hook cannot see it: Megatron's attention calls the module-global
  `megatron.core.transformer.attention.apply_rotary_pos_emb`, which is rebound to a wrapper
  for the length of a trace and restored on exit (also on error). IsoExec's RoPE is a module
  (`attention.IsoRotaryEmbedding`), traced with a hook like every other site.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from isoexec.contract.patch_table import DECLARED
from isoexec.contract.patching import PatchError, PatchRegistry

WRITTEN_FOR_MEGATRON_CORE = "0.16"
# Every write into Megatron-core (these and the CPU shims) goes through this registry.
REGISTRY = PatchRegistry("trainer", DECLARED)

RopeFn = Callable[..., Any]


class MegatronVersionError(PatchError):
    """Megatron-core's internals differ from those a patch here was written for."""


@contextlib.contextmanager
def rope_calls_wrapped(wrap: Callable[[RopeFn], RopeFn]) -> Iterator[None]:
    """Within the block, every RoPE application of a native Megatron attention runs
    `wrap(original)`."""
    import megatron.core.transformer.attention as mattn

    if not hasattr(mattn, "apply_rotary_pos_emb"):
        raise MegatronVersionError(
            "megatron.core.transformer.attention.apply_rotary_pos_emb is gone (written for "
            f"megatron-core {WRITTEN_FOR_MEGATRON_CORE}): the trainer's RoPE cannot be traced"
        )

    def write() -> None:
        REGISTRY.set_attr(mattn, "apply_rotary_pos_emb", wrap(mattn.apply_rotary_pos_emb))

    # A nested trace: apply would be a no-op and its exit would undo the outer trace's wrapper.
    if REGISTRY.is_applied("rope_calls_traced"):
        raise PatchError("RoPE calls are already wrapped: one trainer trace at a time")
    REGISTRY.apply("rope_calls_traced", write)
    try:
        yield
    finally:
        REGISTRY.undo("rope_calls_traced")
