"""`isoexec.megatron.patches`: the RoPE wrapper used while tracing is scoped and version-pinned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def test_rope_calls_are_wrapped_only_inside_the_block() -> None:
    import megatron.core.transformer.attention as mattn

    from isoexec import ops
    from isoexec.megatron.patches import rope_calls_wrapped

    originals = (ops.apply_rope, mattn.apply_rotary_pos_emb)
    seen: list[Callable[..., Any]] = []

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        seen.append(fn)
        return lambda *a, **k: fn(*a, **k)

    with pytest.raises(RuntimeError, match="boom"), rope_calls_wrapped(wrap):
        assert ops.apply_rope is not originals[0]
        assert mattn.apply_rotary_pos_emb is not originals[1]
        raise RuntimeError("boom")
    assert seen == list(originals)
    assert (ops.apply_rope, mattn.apply_rotary_pos_emb) == originals  # restored on error


def test_a_moved_megatron_function_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core.transformer.attention as mattn

    from isoexec.megatron.patches import MegatronVersionError, rope_calls_wrapped

    monkeypatch.delattr(mattn, "apply_rotary_pos_emb")
    with pytest.raises(MegatronVersionError, match="apply_rotary_pos_emb is gone"):
        with rope_calls_wrapped(lambda fn: fn):
            pass
