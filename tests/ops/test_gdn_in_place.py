"""The GDN recurrence on states where an engine's cache holds them (`gdn_recurrence_in_place`):
the same bits as on gathered states, in both of the cache layouts it meets, alone and through
`gdn_sequence` as the engine calls it."""

from __future__ import annotations

import pytest
import torch
from _ops_testlib import gdn_batch as _batch

from isoexec.ops import gdn_recurrence


def _layout(store: torch.Tensor, vk: bool) -> torch.Tensor:
    """The kernel's [slot, HV, K, V] view of a cache stored [slot, HV, V, K] (vk) or as is."""
    return store.transpose(-1, -2) if vk else store


# (V, cache stored [V, K]): vLLM's [V, K] layout (16 x 16 transposing copies), a [K, V] layout
# (vector copies), and V = 16 below the kernel's 32-column block (the element-wise copy).
@pytest.mark.parametrize("vd,vk", [(32, True), (64, False), (16, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_cache_equals_gathered_states(dtype, vd, vk):
    """An engine's states read and written in its own cache layout (vLLM's [slot, HV, V, K],
    seen as [slot, HV, K, V] through a transposed view; or [slot, HV, K, V] itself), at
    scattered slots: the same output and new states, bit for bit, as the gathered-state call;
    fresh requests (no state) too; the other slots untouched; bad slots refused."""
    from isoexec.ops import gdn_recurrence_in_place

    x, s0 = _batch(3, 5, 1, 2, 32, vd, dtype=dtype, seed=61)
    slots = torch.tensor([4, 0, 2])
    for has_state in (True, False):
        store = torch.randn(6, 2, vd, 32) if vk else torch.randn(6, 2, 32, vd)
        _layout(store, vk)[slots] = s0
        before = store.clone()
        want_o, want_s = gdn_recurrence(*x, s0 if has_state else None)
        got_o, none = gdn_recurrence_in_place(
            *x, cache=_layout(store, vk), slots=slots, has_state=has_state
        )
        assert none is None and torch.equal(got_o, want_o)
        assert torch.equal(_layout(store, vk)[slots], want_s)
        others = torch.tensor([1, 3, 5])
        assert torch.equal(store[others], before[others])
    if vd != 16:
        return
    # through gdn_sequence, as the engine calls it (the recurrence's state argument None)
    import functools

    from isoexec.ops import gdn_conv, gdn_sequence

    hk, hv, kd, vd = 1, 2, 32, 16
    mixed = torch.randn(3, 4, 2 * hk * kd + hv * vd).to(dtype)
    conv_w = torch.randn(mixed.shape[-1], 4).to(dtype)
    ab = [torch.randn(3, 4, hv).to(dtype) for _ in range(2)]
    want_o, _, want_s = gdn_sequence(
        mixed, conv_w, *ab, x[5], x[6], heads=(hk, hv, kd, vd), state=s0, conv=gdn_conv
    )
    store[slots] = s0.transpose(-1, -2)
    rec = functools.partial(
        gdn_recurrence_in_place, cache=store.transpose(-1, -2), slots=slots, has_state=True
    )
    got_o, _, none = gdn_sequence(
        mixed, conv_w, *ab, x[5], x[6], heads=(hk, hv, kd, vd), recurrence=rec
    )
    assert none is None and torch.equal(got_o, want_o)
    assert torch.equal(store[slots].transpose(-1, -2), want_s)
    with pytest.raises(ValueError, match="distinct slot"):
        gdn_recurrence_in_place(
            *x, cache=store.transpose(-1, -2), slots=torch.tensor([1, 1, 2]), has_state=True
        )
    with pytest.raises(ValueError, match="out of range"):
        gdn_recurrence_in_place(
            *x, cache=store.transpose(-1, -2), slots=torch.tensor([1, 9, 2]), has_state=True
        )
