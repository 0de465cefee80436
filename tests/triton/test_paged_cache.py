"""Triton paged attention reads the engine's KV cache in place, with the bits of a copy.

The engine keeps one cache `[num_blocks, Hkv, block_size, 2 * D]` (row = block, head, slot;
`K | V` along the last dim) and passes strided K/V views `[num_blocks, block_size, Hkv, D]`
of it (`isoexec.vllm.paged_attention.cache_views`, rebuilt here the same way). The kernel gets the
views' block, slot and head strides, so it must (1) give bitwise what it gives on contiguous
copies of the views (the old path copied them), on the packed path over the gathered keys,
and agree with the torch canonical op; (2) copy nothing: the key/value tensors it is handed
are the views themselves (same storage, same address), and no op of the call allocates a
tensor the size of a view. Negative controls show both no-copy checks see a copy.

Runs under the interpreter (see _triton_testlib) or on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from _triton_testlib import DEVICE, kernel_marks
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = kernel_marks()

from isoexec.ops import attention as t_attn  # noqa: E402
from isoexec.ops.triton import attention as x_attn  # noqa: E402
from isoexec.ops.triton.selfcheck import TOLERANCE, _err  # noqa: E402

H, HKV, D = 4, 2, 16
SCALE = D**-0.5
# (seq_len, q_len): prefill, decode, chunk continuing a prefix, a 1-token sequence, decode
# ending exactly on a block edge
REQUESTS = [(13, 13), (5, 1), (29, 12), (1, 1), (32, 1)]


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's (K, V) views (isoexec.vllm.paged_attention.cache_views; no vLLM import)."""
    nb, h, bs, two_d = kv_cache.shape
    kv = kv_cache.view(nb, h, bs, 2, two_d // 2)
    return kv[:, :, :, 0].permute(0, 2, 1, 3), kv[:, :, :, 1].permute(0, 2, 1, 3)


def _case(dtype: torch.dtype, bs: int, seed: int = 0) -> dict[str, Any]:
    """A random engine-layout cache (unused slots and blocks hold garbage, not zeros), a
    shuffled block table padded with stray block ids, and the step's queries."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n, _ in REQUESTS]
    nb = sum(need) + 3
    kv_cache = torch.randn(nb, HKV, bs, 2 * D, generator=g).to(dtype).to(DEVICE)
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(need) + 1
    table = torch.tensor(perm[-1:] * width, dtype=torch.int32).repeat(len(REQUESTS), 1)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    qlens = [q for _, q in REQUESTS]
    q = torch.randn(sum(qlens), H, D, generator=g).to(dtype).to(DEVICE)
    return {
        "kv_cache": kv_cache,
        "q": q,
        "block_table": table.to(DEVICE),
        "seq_lens": torch.tensor([n for n, _ in REQUESTS], dtype=torch.int32, device=DEVICE),
        "query_start_loc": torch.tensor(
            [0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
        ),
    }


def _paged(
    c: dict[str, Any], k: torch.Tensor, v: torch.Tensor, fn: Callable[..., torch.Tensor]
) -> torch.Tensor:
    return fn(c["q"], k, v, c["block_table"], c["seq_lens"], c["query_start_loc"], scale=SCALE)


def _per_request_varlen(c: dict[str, Any], k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each request's queries as the last rows of a packed prefill over its gathered keys."""
    g = torch.Generator().manual_seed(99)
    outs = []
    qsl = c["query_start_loc"].tolist()
    for r, (n, ql) in enumerate(REQUESTS):
        kr = t_attn.gather_paged_kv(k, c["block_table"][r], n)
        vr = t_attn.gather_paged_kv(v, c["block_table"][r], n)
        q_full = torch.randn(n, H, D, generator=g).to(c["q"].dtype).to(DEVICE)
        q_full[n - ql :] = c["q"][qsl[r] : qsl[r + 1]]
        cu = torch.tensor([0, n], device=DEVICE)
        outs.append(x_attn.attention_varlen(q_full, kr, vr, cu, scale=SCALE)[n - ql :])
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("dtype", "bs"),
    [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 5)],
    ids=["fp32-block16", "bf16-block16", "fp32-block5"],
)
def test_in_place_read_has_the_bits_of_a_copy(dtype: torch.dtype, bs: int) -> None:
    c = _case(dtype, bs)
    k, v = cache_views(c["kv_cache"])
    assert not k.is_contiguous() and v.storage_offset() == D  # the engine's strided views
    got = _paged(c, k, v, x_attn.attention_paged)
    copies = _paged(c, k.contiguous(), v.contiguous(), x_attn.attention_paged)
    assert torch.equal(got, copies), "in-place read differs from the kernel on copies"
    assert torch.equal(got, _per_request_varlen(c, k, v)), "paged differs from packed prefill"
    err = _err(got, _paged(c, k, v, t_attn.attention_paged), dtype)
    assert err <= 1.0, f"error {err:.3g} x tolerance {TOLERANCE[dtype]} against the torch op"


class _KernelSpy:
    """Stands in for `_attn_kernel`: records each launch's key/value tensors, then launches
    the real kernel (or not, with `launch=False`)."""

    def __init__(self, real: Any, launch: bool = True) -> None:
        self.real, self.launch = real, launch
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            self.kv.append((args[1], args[2]))
            if self.launch:
                self.real[grid](*args, **kwargs)

        return run


def _reads_in_place(t: torch.Tensor, view: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    same_storage = t.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    return same_storage and t.data_ptr() == view.data_ptr() and t.stride() == view.stride()


def test_kernel_is_handed_the_cache_views(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _case(torch.float32, 16)
    k, v = cache_views(c["kv_cache"])
    spy = _KernelSpy(x_attn._attn_kernel)
    monkeypatch.setattr(x_attn, "_attn_kernel", spy)
    out = _paged(c, k, v, x_attn.attention_paged)
    (kk, vv), *rest = spy.kv
    assert not rest
    assert _reads_in_place(kk, k, c["kv_cache"]), "the key cache was copied"
    assert _reads_in_place(vv, v, c["kv_cache"]), "the value cache was copied"
    # control: the reference call on copies is seen as not in place
    ref = _paged(c, k.contiguous(), v.contiguous(), x_attn.attention_paged)
    kc, vc = spy.kv[1]
    assert not _reads_in_place(kc, k, c["kv_cache"])
    assert not _reads_in_place(vc, v, c["kv_cache"])
    assert torch.equal(out, ref)


class _BigAllocations(TorchDispatchMode):
    """Records every aten op whose output has at least `numel` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.seen.append(str(func))
        return out


@contextmanager
def _big_allocations(numel: int) -> Iterator[_BigAllocations]:
    with _BigAllocations(numel) as mode:
        yield mode


def test_no_op_of_the_call_copies_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything the call does outside the kernel (the kernel itself is not launched here: the
    interpreter's own bookkeeping would show up too) makes only small tensors."""
    c = _case(torch.float32, 16)
    k, v = cache_views(c["kv_cache"])
    monkeypatch.setattr(x_attn, "_attn_kernel", _KernelSpy(x_attn._attn_kernel, launch=False))
    with _big_allocations(k.numel()) as seen:
        _paged(c, k, v, x_attn.attention_paged)
    assert not seen.seen, f"ops that made cache-sized tensors: {seen.seen}"
    # control: a copy of a view, as the old `_rows()` made, is seen
    with _big_allocations(k.numel()) as seen:
        k.reshape(-1, HKV, D).contiguous()
    assert seen.seen
