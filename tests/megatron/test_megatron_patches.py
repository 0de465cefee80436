"""`isoexec.megatron.patches`: the RoPE wrapper used while tracing is scoped and version-pinned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def test_rope_calls_are_wrapped_only_inside_the_block() -> None:
    """A native model's RoPE function is wrapped for a trace and restored after (also on
    error); IsoExec's own RoPE is a module and is never rebound."""
    import megatron.core.transformer.attention as mattn

    from isoexec import ops
    from isoexec.megatron.patches import rope_calls_wrapped

    original, canonical = mattn.apply_rotary_pos_emb, ops.apply_rope
    seen: list[Callable[..., Any]] = []

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        seen.append(fn)
        return lambda *a, **k: fn(*a, **k)

    with pytest.raises(RuntimeError, match="boom"), rope_calls_wrapped(wrap):
        assert mattn.apply_rotary_pos_emb is not original
        assert ops.apply_rope is canonical
        raise RuntimeError("boom")
    assert seen == [original]
    assert mattn.apply_rotary_pos_emb is original  # restored on error
    with rope_calls_wrapped(wrap):  # a second trace inside the first is refused, the first kept
        wrapped = mattn.apply_rotary_pos_emb
        with pytest.raises(RuntimeError, match="already wrapped"), rope_calls_wrapped(wrap):
            pass
        assert mattn.apply_rotary_pos_emb is wrapped
    assert mattn.apply_rotary_pos_emb is original


def test_a_moved_megatron_function_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core.transformer.attention as mattn

    from isoexec.megatron.patches import MegatronVersionError, rope_calls_wrapped

    monkeypatch.delattr(mattn, "apply_rotary_pos_emb")
    with pytest.raises(MegatronVersionError, match="apply_rotary_pos_emb is gone"):
        with rope_calls_wrapped(lambda fn: fn):
            pass


SHIM_AND_UNDO = """
import json
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.moe import router
from megatron.core.tensor_parallel import mappings
from isoexec.megatron import cpu_shims
from isoexec.megatron.patches import REGISTRY
objs = lambda: (RotaryEmbedding.get_emb, router.Router.gating, mappings.torch)
before = objs()
names = cpu_shims.apply_cpu_shims()
after = objs()
applied = REGISTRY.applied()
cpu_shims.undo_cpu_shims()
undone = objs()
again = cpu_shims.apply_cpu_shims()
print(json.dumps({"names": names, "applied": applied, "again": again,
                  "changed": [a is not b for a, b in zip(after, before)],
                  "restored": [a is b for a, b in zip(undone, before)],
                  "left": REGISTRY.applied() == applied}))
"""


def test_cpu_shims_are_declared_patches_and_undo_restores_megatron() -> None:
    """In a fresh process: every CPU shim is a declared trainer patch applied through the
    registry; undoing them gives Megatron back its own functions and modules; they apply
    again after an undo."""
    import json
    import subprocess
    import sys

    from isoexec.contract.patch_table import DECLARED
    from isoexec.megatron.cpu_shims import PATCH_OF

    out = subprocess.run([sys.executable, "-c", SHIM_AND_UNDO], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    declared = {e.name for e in DECLARED if e.side == "trainer"}
    assert set(PATCH_OF.values()) <= declared
    assert set(got["applied"]) <= declared and len(got["applied"]) == len(got["names"]) >= 10
    assert got["changed"] == [True, True, True]  # the shims wrote (else this proves nothing)
    assert got["restored"] == [True, True, True]
    assert got["again"] == got["names"] and got["left"]
