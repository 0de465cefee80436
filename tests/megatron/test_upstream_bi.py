"""`isoexec.megatron.upstream_bi`: Megatron-core's own batch-invariant mode for the upstream-bi
arm, on a trainer without Transformer Engine (as on the GPU machine this project is lent).

Only the switching is tested here: the mode's kernels are CUDA-only (the GPU device check
times them). Negative control: Megatron's mode alone cannot even be switched on without TE.
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("megatron.core")

from megatron.core.transformer.custom_layers import batch_invariant_kernels as bik

from isoexec.megatron.patches import REGISTRY
from isoexec.megatron.upstream_bi import (
    megatron_batch_invariant_mode,
    transformer_engine_patched,
)

NO_TE = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="Transformer Engine is installed: the mode patches it and needs no skip",
)


@NO_TE
def test_megatrons_mode_alone_needs_transformer_engine() -> None:
    """And a failed switch-on leaves Megatron's mode half on (aten overrides registered):
    switched off here with the TE steps skipped, as the wrapper does."""
    try:
        with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
            with bik.set_batch_invariant_mode(True):
                pass
        assert bik.is_batch_invariant_mode_enabled()  # upstream's leftover
    finally:
        REGISTRY.apply("batch_invariant_without_te", lambda: [
            REGISTRY.set_attr(bik, s, lambda: None)
            for s in ("_te_patch_for_batch_invariant", "_te_unpatch_for_batch_invariant")
        ])  # fmt: skip
        bik.disable_batch_invariant_mode()
        REGISTRY.undo("batch_invariant_without_te")
    assert not bik.is_batch_invariant_mode_enabled()


@NO_TE
def test_the_mode_runs_for_the_block_and_everything_is_put_back() -> None:
    te_steps = (bik._te_patch_for_batch_invariant, bik._te_unpatch_for_batch_invariant)
    assert not transformer_engine_patched()
    with megatron_batch_invariant_mode():
        assert bik.is_batch_invariant_mode_enabled()
        assert REGISTRY.is_applied("batch_invariant_without_te")
    assert not bik.is_batch_invariant_mode_enabled()
    assert (bik._te_patch_for_batch_invariant, bik._te_unpatch_for_batch_invariant) == te_steps
    assert not REGISTRY.is_applied("batch_invariant_without_te")
    with pytest.raises(RuntimeError, match="inside"), megatron_batch_invariant_mode():
        raise RuntimeError("inside")
    assert not bik.is_batch_invariant_mode_enabled()
    assert not REGISTRY.is_applied("batch_invariant_without_te")
