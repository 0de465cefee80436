"""Megatron-core's own batch-invariant mode, for the arm IsoExec is measured against.

Megatron-core ships `batch_invariant_mode` (Thinking Machines' batch-invariant kernels behind
aten's mm, addmm, log_softmax and mean, plus Transformer Engine's GEMM and RMSNorm). It makes
one trainer's logprobs independent of the batch; it does not make them equal to an engine's,
and it has no GDN kernels (docs/architecture.md, "Upstream batch-invariant modes"). IsoExec's
`isoexec pair --arms upstream-bi` and the GPU device check run native Megatron under it.

Why a wrapper: 0.16.1's mode imports Transformer Engine unconditionally when it is switched on
and off, so it cannot run on a TE-less trainer (the GPU machine this project is lent has
none). A TE-less model has no TE layer to patch: there, the mode's TE steps are skipped for the
duration (trainer patch `batch_invariant_without_te`, undone on exit), and
`transformer_engine_patched()` says which happened. Its kernels are CUDA-only.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager


def transformer_engine_patched() -> bool:
    """Whether the mode also patches Transformer Engine here (TE is installed)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _no_te() -> None:
    """The mode's TE patch / unpatch step where Transformer Engine is absent."""


@contextmanager
def megatron_batch_invariant_mode() -> Iterator[None]:
    """Megatron-core's `set_batch_invariant_mode(True)` for the duration (CUDA only)."""
    from isoexec.megatron.patches import REGISTRY
    from megatron.core.transformer.custom_layers import batch_invariant_kernels as bik

    def skip_te_steps() -> None:
        for step in ("_te_patch_for_batch_invariant", "_te_unpatch_for_batch_invariant"):
            REGISTRY.set_attr(bik, step, _no_te)

    if not transformer_engine_patched():
        REGISTRY.apply("batch_invariant_without_te", skip_te_steps)
    try:
        with bik.set_batch_invariant_mode(True):
            yield
    finally:
        REGISTRY.undo("batch_invariant_without_te")


__all__ = ["megatron_batch_invariant_mode", "transformer_engine_patched"]
