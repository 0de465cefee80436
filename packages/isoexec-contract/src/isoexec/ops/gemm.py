"""Canonical linear: every output row computed by a fixed order that ignores the batch.

Why: a GEMM's row result depends on M (a BLAS picks kernels by shape), so `F.linear` gives a
token different bits alone and in a batch.

On CPU (fp32, bf16, fp16) the GEMM is IsoExec's own kernel (`cpu_gemm`,
`cpu_kernels/gemm.cpp`): each output is one fp32 fused multiply-add chain over k ascending
(bf16: k in pairs, the odd one first, FTZ/DAZ, the order of x86's VDPBF16PS), rounded once
to the input dtype, so no row depends on another, on the thread count, or on which BLAS or
oneDNN torch was built with. (Until v2 the CPU ran fixed 32-row blocks through oneDNN's
prepacked primitive; torch's entry point to it cost about twice vLLM's own at a decode
step, #37.)
Elsewhere (CUDA, fp64) rows are cut into fixed blocks of R (the last one zero-padded) and
each block runs the same fixed-shape `torch.mm`: repeatable whatever the other rows hold.

The TP-invariant variant cuts K into G fixed leaves (each leaf an fp32 GEMM of the same
shape) and sums them with a fixed binary tree, so TP=1, 2, 4 ranks holding G/TP leaves each
produce the same bits after an all-gather of leaves (never a NCCL/gloo all-reduce).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from . import cpu_gemm
from ._autograd import grad_wanted

DEFAULT_BLOCK_ROWS = 32
DEFAULT_TP_LEAVES = 8

# (id(parameter), storage offset, shape, packing) -> (weakref to the parameter, stamp, packed)
_PACK_CACHE: dict[tuple, tuple[weakref.ref, tuple[int, int], torch.Tensor]] = {}
# Off unless the owner of the weights turns it on (see `enable_packed_weight_cache`).
_PACK_CACHE_ENABLED = False
# The C++ linear's own cache (`cpu_torch_ops`), once its library is loaded: (set, clear).
_NATIVE_PACK_CACHE: tuple[Callable[[bool], None], Callable[[], None]] | None = None


def enable_packed_weight_cache(enabled: bool = True) -> None:
    """Let the CPU GEMMs reuse packed weights across calls (decode speed): the linear's
    panels and the MoE experts' (`cached_pack`).

    Only a process that controls every weight update may turn this on: a write through
    `param.data` (vLLM's weight loaders, some optimizers) does not bump `_version`, so the
    cache cannot see it. The owner must call `clear_packed_weight_cache()` after such writes.
    The engine side does (after each weight load); the trainer side leaves it off.
    """
    global _PACK_CACHE_ENABLED
    _PACK_CACHE_ENABLED = enabled
    if not enabled:
        _PACK_CACHE.clear()
    if _NATIVE_PACK_CACHE is not None:
        _NATIVE_PACK_CACHE[0](enabled)


def clear_packed_weight_cache() -> None:
    """Forget every prepacked weight (call after writing weights through `.data`)."""
    _PACK_CACHE.clear()
    if _NATIVE_PACK_CACHE is not None:
        _NATIVE_PACK_CACHE[1]()


def attach_native_pack_cache(
    set_enabled: Callable[[bool], None], clear: Callable[[], None]
) -> None:
    """Let the two functions above also rule the C++ linear's cache (`cpu_torch_ops.load`),
    which starts in this cache's state: one protocol for both."""
    global _NATIVE_PACK_CACHE
    _NATIVE_PACK_CACHE = (set_enabled, clear)
    set_enabled(_PACK_CACHE_ENABLED)


# What a CPU site records as its GEMM library: the kernel, whose bits no build setting changes.
CPU_GEMM = "isoexec-cxx-fma-kseq"


def gemm_library(device: torch.device | str, dtype: torch.dtype) -> str:
    """The library `_block_gemm` runs for (device, dtype), with the settings that change its
    bits: what a GEMM site records, so two sides MATCH only if the same GEMM runs.

    CPU: `CPU_GEMM`, IsoExec's own kernel, for fp32, bf16 and fp16 alike (its bits depend on
    no BLAS, oneDNN math mode or thread count). CUDA: the cuBLAS flavour `torch.mm` prefers
    plus the flag that lets it reduce precision for this dtype (TF32 for fp32,
    reduced-precision reductions for bf16/fp16). Any other device or dtype is refused
    (ValueError): a guess would be recorded as fact.
    """
    kind = _device_kind(device)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"gemm_library: no canonical GEMM in {dtype} (float32, bf16, fp16)")
    if kind == "cuda":
        return _cuda_gemm(dtype)
    return CPU_GEMM


def _device_kind(device: torch.device | str) -> str:
    """The device's kind, cpu or cuda (ROCm included); anything else is refused, not guessed."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"gemm_library: cannot identify device {device!r}: {e}") from None
    if kind not in ("cpu", "cuda"):
        raise ValueError(
            f"gemm_library: device {device!r}: which GEMM library runs there is unknown "
            "(cpu or cuda only)"
        )
    return kind


def _cuda_gemm(dtype: torch.dtype) -> str:
    """cuBLAS (hipBLAS on ROCm) flavour `torch.mm` prefers, and the reduced-precision flag
    that applies to `dtype` (each changes bits)."""
    m = torch.backends.cuda.matmul
    prefix = "hip" if torch.version.hip else "cu"
    preferred = getattr(torch.backends.cuda, "preferred_blas_library", None)
    name = preferred().name.lower() if preferred is not None else "cublas"
    libs = {"cublas": f"{prefix}blas", "cublaslt": f"{prefix}blaslt", "ck": "ck"}
    lib = libs.get(name, f"{prefix}blas-{name}")  # "default": torch's heuristic picks
    if dtype == torch.float32:
        if hasattr(m, "fp32_precision"):  # torch >= 2.9; allow_tf32 refuses mixed APIs
            tf32 = str(m.fp32_precision) == "tf32"
        else:
            tf32 = bool(m.allow_tf32)
        flags = {"tf32": tf32}
    else:
        half = "bf16" if dtype == torch.bfloat16 else "fp16"
        flags = {
            "reduced_precision_reduction": getattr(m, f"allow_{half}_reduced_precision_reduction"),
            "split_k": getattr(m, f"allow_{half}_reduced_precision_reduction_split_k", True),
        }
        if dtype == torch.float16:
            flags["fp16_accumulation"] = getattr(m, "allow_fp16_accumulation", False)
    return ";".join([lib, *(f"{k}={str(bool(v)).lower()}" for k, v in flags.items())])


def _owning_parameter(weight: torch.Tensor) -> torch.nn.Parameter | None:
    """The parameter `weight` is, or a view of (one expert's slice `w13[e]` of the stacked
    expert weights): only parameters live across calls."""
    if isinstance(weight, torch.nn.Parameter):
        return weight
    base = weight._base
    return base if isinstance(base, torch.nn.Parameter) else None


def cached_pack(
    weight: torch.Tensor, tag: object, pack: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`pack(weight)`, a kernel's own layout of a weight; cached per (parameter, slice,
    version, storage, tag) when the cache is enabled.

    Packing costs about one weight copy; the cache makes decode steps not pay it (for MoE, per
    expert slice or per stacked expert weight). An in-place update bumps `_version` (shared by
    a parameter and its views) and a new `.data` changes `data_ptr`: both repack; a write
    through `.data` is invisible, hence the explicit enable/clear protocol.
    """
    param = _owning_parameter(weight) if _PACK_CACHE_ENABLED else None
    if param is None:
        # A temporary (a K-leaf slice, an upcast copy) is packed fresh — and under inference
        # mode it has no `_version` to stamp.
        return pack(weight.detach())
    key = (id(param), weight.storage_offset(), tuple(weight.shape), tag)
    stamp = (param._version, param.data_ptr())
    hit = _PACK_CACHE.get(key)
    if hit is not None and hit[0]() is param and hit[1] == stamp:
        return hit[2]
    packed = pack(weight.detach())
    ref = weakref.ref(param, lambda _r, key=key: _PACK_CACHE.pop(key, None))
    _PACK_CACHE[key] = (ref, stamp, packed)
    return packed


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the CPU kernel's panels (`cpu_gemm.pack_panels`, `cached_pack`)."""
    return cached_pack(weight, "panels", cpu_gemm.pack_panels)


def _block_gemm(x: torch.Tensor, weight: torch.Tensor, block_rows: int) -> torch.Tensor:
    """y = x @ weight.T (x 2-D, same dtype): the canonical GEMM of the module docstring.

    On CPU the kernel (`block_rows` plays no part: no row's bits depend on the others);
    elsewhere every block of `block_rows` rows is the same-shape `torch.mm`, the last block
    zero-padded.
    """
    if x.device.type == "cpu" and x.dtype in cpu_gemm.DTYPES:
        return cpu_gemm.panel_gemm(x, _packed_weight(weight), weight.shape[0])
    m = x.shape[0]
    n = weight.shape[0]
    r = block_rows
    mp = -(-m // r) * r if m else 0
    xp = x.contiguous() if mp == m else torch.nn.functional.pad(x, (0, 0, 0, mp - m))
    out = torch.empty(mp, n, dtype=x.dtype, device=x.device)
    wt = weight.t()
    for i in range(0, mp, r):
        torch.mm(xp[i : i + r], wt, out=out[i : i + r])
    return out[:m]


class _BlockLinear(torch.autograd.Function):
    """Forward: canonical block GEMM. Backward: plain matmuls (correct, not bitwise)."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, block_rows: int) -> torch.Tensor:
        ctx.save_for_backward(x2, weight)
        return _block_gemm(x2, weight, block_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2, weight = ctx.saved_tensors
        gx = grad.to(weight.dtype) @ weight if ctx.needs_input_grad[0] else None
        gw = grad.t().to(x2.dtype) @ x2 if ctx.needs_input_grad[1] else None
        return gx, gw, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """Row-invariant `x @ weight.T (+ bias)` for x [..., K], weight [N, K].

    Bias (if any) is added after the GEMM's single rounding, in x's dtype, as a separate
    elementwise add (so bf16 with bias rounds twice, identically on both sides).
    """
    if weight.dtype != x.dtype:
        raise TypeError(f"linear: x {x.dtype} and weight {weight.dtype} differ")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if grad_wanted(x, weight):
        y = _BlockLinear.apply(x2, weight, block_rows)
    else:  # no gradient wanted (an engine step): the same GEMM without autograd's bookkeeping
        y = _block_gemm(x2, weight, block_rows)
    y = y.reshape(*lead, weight.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def tp_leaf_partials(
    x_shard: torch.Tensor,
    weight_shard: torch.Tensor,
    *,
    leaves: int,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """fp32 partial products of `leaves` equal K-leaves of one K-shard: [leaves, M, N].

    A TP rank holding x[..., K/tp] and weight[N, K/tp] calls this with leaves = G // tp and
    all-gathers the result along dim 0 (rank order); `tp_tree_sum` then gives TP-free bits.
    """
    x2 = x_shard.reshape(-1, x_shard.shape[-1]).float()
    w = weight_shard.float()
    k = x2.shape[1]
    if k % leaves:
        raise ValueError(f"K-shard {k} not divisible by {leaves} leaves")
    kl = k // leaves
    parts = [
        _BlockLinear.apply(x2[:, i * kl : (i + 1) * kl], w[:, i * kl : (i + 1) * kl], block_rows)
        for i in range(leaves)
    ]
    return torch.stack(parts)


def tp_tree_sum(partials: torch.Tensor) -> torch.Tensor:
    """Sum [G, ...] leaves with a fixed binary tree: adjacent pairs, level by level."""
    level = list(partials.unbind(0))
    while len(level) > 1:
        nxt = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def linear_tp_invariant(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    leaves: int = DEFAULT_TP_LEAVES,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """TP-invariant linear: K in `leaves` fixed fp32 leaves + fixed tree, one rounding.

    Equals, bit for bit, `tp_linear_from_shards` for any TP degree dividing `leaves`.
    """
    return tp_linear_from_shards(
        list(x.chunk(1, dim=-1)), [weight], bias, leaves=leaves, block_rows=block_rows
    )


def tp_linear_from_shards(
    x_shards: list[torch.Tensor],
    weight_shards: list[torch.Tensor],
    bias: torch.Tensor | None = None,
    *,
    leaves: int = DEFAULT_TP_LEAVES,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """Row-parallel linear from TP K-shards (rank order): gather leaves, tree-sum, round."""
    tp = len(x_shards)
    if leaves % tp:
        raise ValueError(f"leaves={leaves} not divisible by TP={tp}")
    parts = torch.cat(
        [
            tp_leaf_partials(xs, ws, leaves=leaves // tp, block_rows=block_rows)
            for xs, ws in zip(x_shards, weight_shards, strict=True)
        ]
    )
    return _tree_sum_round(parts, bias, x_shards[0], weight_shards[0].shape[0])


def linear_tp_shard(
    x_shard: torch.Tensor,
    weight_shard: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tp: int,
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    leaves: int = DEFAULT_TP_LEAVES,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> torch.Tensor:
    """One TP rank's share of `linear_tp`, in a live TP group: the full output on every rank.

    The rank computes the fp32 partials of its G/TP leaves; `all_gather` is the framework's
    exact all-gather of that [G/tp, M, N] tensor along dim 0 in rank order (Megatron's or
    vLLM's, the only part that differs between the sides); then the fixed tree and one rounding.
    Equals `linear_tp_invariant` on the whole K, bit for bit, at every TP dividing G.
    """
    if tp < 1 or leaves % tp:
        raise ValueError(f"leaves={leaves} not divisible by TP={tp}")
    parts = tp_leaf_partials(x_shard, weight_shard, leaves=leaves // tp, block_rows=block_rows)
    if tp > 1:
        if all_gather is None:
            raise ValueError(f"linear_tp_shard at TP={tp} needs the group's all_gather")
        parts = all_gather(parts)
        if parts.shape[0] != leaves:
            raise ValueError(f"all_gather returned {parts.shape[0]} leaves, expected {leaves}")
    return _tree_sum_round(parts, bias, x_shard, weight_shard.shape[0])


def _tree_sum_round(
    parts: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, n: int
) -> torch.Tensor:
    """All G leaves, in order -> fixed tree, bias in fp32, one rounding to the input dtype."""
    y = tp_tree_sum(parts)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
