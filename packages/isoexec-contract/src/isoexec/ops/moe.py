"""Canonical MoE: router (fp32 softmax, top-k with ties to the lower expert index) and
experts + combine (fixed-shape or fixed-order expert GEMMs, ascending-expert fp32 sum).

Why: a token's output must not depend on which other tokens share its experts. The routed
slots are sorted by expert (ascending, stable) into one group of rows per expert, and each
group's GEMM gives every row bits that depend only on that row and the expert's weights
(not on how many tokens the expert got, or the thread count). Which GEMM runs depends on the
dtype (`expert_gemm`, recorded in the contract by `impl_params`):

- fp32: one compiled grouped GEMM (`cpu_kernels/moe.cpp`): each output element is a dot
  product over `lanes` fixed fp32 lanes (one fused multiply-add per product, k ascending)
  with a fixed tree, computed whole by one thread: the same bits on every x86 CPU.
- bf16 on a CPU with AMX-BF16 (v5): one compiled GEMM on AMX tiles (`cpu_kernels/moe.cpp`,
  `amx`): per output element, 32-k chunks in ascending order, each one TDPBF16PS instruction
  (the hardware's own pair order and rounding), from +0; K zero-padded to whole chunks, a
  group's rows to whole 16-row tiles. Tile rows are independent, so a row's bits depend on the
  row and the expert alone. The bits are AMX's (the contract records the kernel, the backend
  identity the CPU). The weights are packed once into the tiles' pair layout (cached in the
  engine like the linear's). A decode step streams each expert's weight once: the medium GDN
  model's routed experts took 13.4 ms per decode step, 19.1 on the blocks (one thread,
  Sapphire Rapids; benchmarks/moe_decode_bench.py).
- bf16 elsewhere, and fp16 (v4): the canonical `linear`'s GEMM per group (since v6 linear
  v2's kernel, each group's rows as they are), whose library is recorded as every linear's
  is. The grouped kernel's fp32 vector FMAs ran the medium model's bf16 experts ~1.8x
  slower at decode and ~10x at prefill (one thread, Sapphire Rapids). (The grouped kernel
  still takes bf16/fp16: its tests pin its order there too.)

History: v1 ran the block GEMM in every dtype (fp32 decode paid for 32 rows per expert); v2
the grouped kernel in every dtype; v3 fused its fp32 multiply-add (v2 rounded the fp32 product
first); v4 moved bf16/fp16 back to the blocks; v5 runs bf16 on AMX tiles where the CPU has
them. The shared expert and its gate are one group holding every token. silu·up is the
canonical `silu_mul`; bf16/fp16 round after each projection and after silu·up.

The weighted sum over a token's k experts runs in ascending expert id in fp32 and is
rounded once; the shared expert (sigmoid-gated) is added last. Expert weights are stacked as
vLLM and transformers 5 hold them: w13 [E, 2I, H] = cat(gate, up) and w2 [E, H, I].

Backward (trainer): plain fp32 torch GEMMs per expert, correct, not bitwise (only the
forward must match between engine and trainer). CPU only: asking for it on another device
is an error (engines and trainers on CUDA run the Triton backend's MoE).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from . import _pointwise as pw
from . import cpu_kernels, gemm
from ._autograd import grad_wanted
from .activation import silu_mul

# The compiled libraries whose sources define this module's bits (in the op fingerprint).
KERNEL_LIBRARIES = ("moe",)
# fp32 lanes of each output element's dot product (k = l, l + lanes, .. in lane l), combined
# by a fixed pairwise tree. 16 is one AVX-512 register; the bits do not depend on the ISA.
DEFAULT_LANES = 16
LANES = (8, 16)
_DTYPES = cpu_kernels.DTYPE_CODES
_I64 = cpu_kernels.I64
_PTR = cpu_kernels.PTR


# `expert_gemm` values: the compiled grouped kernel, the AMX tile kernel, or the canonical
# linear's row blocks.
GROUPED = "cxx-vector-ext-fma"
AMX_TILES = "amx-bf16-tiles"
LINEAR_BLOCKS = "linear-blocks"
# k per AMX chunk (one TDPBF16PS): part of the AMX kernel's order, recorded in the contract.
AMX_K_CHUNK = 32


@cache
def amx_available() -> bool:
    """The AMX kernel runs in this process: the build has it (the CPU has AMX-BF16) and Linux
    grants the tile state. A property of the machine: asked once."""
    return bool(cpu_kernels.library("moe").isx_moe_amx_ready())


def expert_gemm(dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """Which GEMM the experts run in `dtype`: GROUPED (fp32), AMX_TILES (bf16 on a CPU with
    AMX-BF16) or LINEAR_BLOCKS (other bf16, fp16)."""
    if dtype == torch.float32:
        return GROUPED
    amx = torch.device(device).type == "cpu" and amx_available()
    return AMX_TILES if dtype == torch.bfloat16 and amx else LINEAR_BLOCKS


def impl_params(device: torch.device | str, dtype: torch.dtype) -> dict[str, object]:
    """The contract parameters that say which expert GEMM a site on (device, dtype) runs:
    the kernel, its k chunk for AMX, and for the blocks their rows and `gemm.gemm_library`
    (as a linear's)."""
    kind = expert_gemm(dtype, device)
    if kind == GROUPED:
        return {"kernel": GROUPED}
    if kind == AMX_TILES:
        return {"kernel": AMX_TILES, "k_chunk": AMX_K_CHUNK}
    lib = gemm.gemm_library(device, dtype)
    return {"kernel": kind, "block_rows": gemm.DEFAULT_BLOCK_ROWS, "gemm": lib}


@cache
def _kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = cpu_kernels.library("moe").isx_moe_grouped_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [
        _I64, _I64, _I64, _PTR, _PTR,
        _PTR, _I64, _PTR, _I64, _I64, ctypes.c_int,
        _PTR, _I64, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    return fn


def _check_operands(x: torch.Tensor, w: torch.Tensor) -> None:
    """x [S, K] and stacked w [E, N, K] on CPU (every expert GEMM here is a CPU kernel)."""
    if x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(
            f"moe: the expert GEMMs run on CPU (x on {x.device}, w {w.device}; on CUDA run the "
            "Triton backend's)"
        )
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"moe: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply")


def _grouped_gemm(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, wsel: torch.Tensor, lanes: int
) -> torch.Tensor:
    """fp32 [S, N]: rows offsets[g]:offsets[g+1] of x [S, K] times w[wsel[g]]^T (w [E, N, K]).

    x and w share one dtype (fp32, bf16, fp16); offsets [G+1] and wsel [G] are int64 on CPU.
    """
    if lanes not in LANES:
        raise ValueError(f"moe: lanes={lanes} unsupported; the kernel has {LANES}")
    _check_operands(x, w)
    if x.dtype != w.dtype or x.dtype not in _DTYPES:
        raise TypeError(f"moe: x {x.dtype} and w {w.dtype} must be one of {list(_DTYPES)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    s, k = x.shape
    n = w.shape[1]
    out = torch.empty(s, n, dtype=torch.float32)
    if s == 0 or n == 0:
        return out
    rc = _kernel()(
        len(wsel), n, k, cpu_kernels.ptr(offsets), cpu_kernels.ptr(wsel),
        cpu_kernels.ptr(x), x.stride(0), cpu_kernels.ptr(w), w.stride(0), w.stride(1),
        _DTYPES[x.dtype], cpu_kernels.ptr(out), out.stride(0), lanes, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"moe grouped GEMM kernel refused its arguments (code {rc})")
    return out


@cache
def _amx_fns() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    lib = cpu_kernels.library("moe")
    elems, pack, run = lib.isx_moe_amx_packed_elems, lib.isx_moe_amx_pack, lib.isx_moe_amx_gemm
    elems.restype, elems.argtypes = _I64, [_I64, _I64]
    pack.restype, pack.argtypes = ctypes.c_int, [_I64, _I64, _I64, _PTR, _I64, _I64, _PTR]
    run.restype = ctypes.c_int
    run.argtypes = [_I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, ctypes.c_int]
    return elems, pack, run


def _amx_pack(w: torch.Tensor) -> torch.Tensor:
    """w [E, N, K] bf16 in the AMX kernel's tile layout (one flat bf16 row per expert)."""
    elems, pack, _ = _amx_fns()
    e, n, k = w.shape
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(e, elems(n, k), dtype=torch.bfloat16)
    if pack(e, n, k, cpu_kernels.ptr(w), w.stride(0), w.stride(1), cpu_kernels.ptr(out)) != 0:
        raise RuntimeError(f"moe: the AMX packing refused w {tuple(w.shape)}")
    return out


def _amx_groups(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, wsel: torch.Tensor
) -> torch.Tensor:
    """fp32 [S, N]: each group's rows times its expert's weight on AMX tiles (x, w bf16;
    w [E, N, K] packed once per parameter version when the packed-weight cache is on)."""
    _check_operands(x, w)
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"moe: the AMX kernel takes bf16 (x {x.dtype}, w {w.dtype})")
    if not amx_available():
        raise RuntimeError("moe: the AMX expert kernel needs a CPU with AMX-BF16 (none here)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    s, k = x.shape
    n = w.shape[1]
    out = torch.empty(s, n, dtype=torch.float32)
    if s == 0 or n == 0:
        return out
    packed = gemm.cached_pack(w, "amx-tiles", _amx_pack)
    rc = _amx_fns()[2](
        len(wsel), n, k, cpu_kernels.ptr(offsets), cpu_kernels.ptr(wsel), cpu_kernels.ptr(x),
        x.stride(0), cpu_kernels.ptr(packed), cpu_kernels.ptr(out), out.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"moe AMX GEMM kernel refused its arguments (code {rc})")
    return out


def _block_groups(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, wsel: torch.Tensor
) -> torch.Tensor:
    """x's dtype [S, N]: each group's rows through the canonical linear's GEMM with its
    expert's weight (a slice of the stacked parameter: the engine's packed-weight cache keeps
    one packed copy per expert), the groups' outputs in order.

    Each group's rows run as they are: the CPU GEMM (linear v2) computes every row alone, so
    nothing is padded (linear v1's 32-row blocks padded each expert's few decode rows to 32)."""
    _check_operands(x, w)
    if x.dtype != w.dtype:
        raise TypeError(f"moe: x {x.dtype} and w {w.dtype} differ")
    cut = offsets.tolist()
    r = gemm.DEFAULT_BLOCK_ROWS
    outs = [
        gemm._block_gemm(x[cut[g] : cut[g + 1]], w[e], r)
        for g, e in enumerate(wsel.tolist())
        if cut[g + 1] > cut[g]
    ]
    if not outs:
        return x.new_empty(0, w.shape[1])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _forward(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, wsel: torch.Tensor, lanes: int
) -> torch.Tensor:
    """Every group's GEMM, rounded once to x's dtype, by `expert_gemm(x.dtype)`."""
    kind = expert_gemm(x.dtype, x.device)
    if kind == GROUPED:
        return _grouped_gemm(x, w, offsets, wsel, lanes).to(x.dtype)
    if lanes not in LANES:  # not used by the blocks; refused alike, whatever the dtype
        raise ValueError(f"moe: lanes={lanes} unsupported; the kernel has {LANES}")
    if kind == AMX_TILES:
        return _amx_groups(x, w, offsets, wsel).to(x.dtype)
    return _block_groups(x, w, offsets, wsel)


class _GroupedLinear(torch.autograd.Function):
    """Forward: the canonical expert GEMMs (`_forward`), rounded once to x's dtype.
    Backward: plain fp32 torch GEMMs per group (correct, not bitwise)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        offsets: torch.Tensor,
        wsel: torch.Tensor,
        lanes: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets, wsel)
        return _forward(x.detach(), w.detach(), offsets, wsel, lanes)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, w, offsets, wsel = ctx.saved_tensors  # type: ignore[attr-defined]
        need_x, need_w = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
        g = grad.float()
        gx = torch.zeros(x.shape, dtype=torch.float32) if need_x else None
        gw = torch.zeros(w.shape, dtype=torch.float32) if need_w else None
        cut = offsets.tolist()
        for grp, e in enumerate(wsel.tolist()):
            a, b = cut[grp], cut[grp + 1]
            if gx is not None:
                gx[a:b] = g[a:b] @ w[e].float()
            if gw is not None:
                gw[e] += g[a:b].t() @ x[a:b].float()
        return (
            None if gx is None else gx.to(x.dtype),
            None if gw is None else gw.to(w.dtype),
            None,
            None,
            None,
        )


def _linear(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, wsel: torch.Tensor, lanes: int
) -> torch.Tensor:
    """The expert GEMMs rounded to x's dtype; through autograd only where a gradient is
    wanted (an engine step skips the Function's bookkeeping: the same kernel and bits)."""
    if grad_wanted(x, w):
        return _GroupedLinear.apply(x, w, offsets, wsel, lanes)
    return _forward(x, w, offsets, wsel, lanes)


def _whole(x: torch.Tensor, w: torch.Tensor, lanes: int) -> torch.Tensor:
    """x [T, K] times one weight w [N, K]^T as the experts' GEMM (one group)."""
    offsets = torch.tensor([0, x.shape[0]], dtype=torch.int64)
    return _linear(x, w[None], offsets, torch.zeros(1, dtype=torch.int64), lanes)


def moe_router(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int64 [T, k]) from router logits [T, E].

    softmax over all E in fp32, then the k largest probabilities (a stable descending sort:
    equal probabilities go to the lower expert index), optionally renormalised to sum 1.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    _, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    ids = order[..., :top_k]
    w = probs.gather(-1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def moe_weighted_sum(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fixed-order combine: sum_j w_j * y_j over a token's experts in ascending expert id,
    in fp32, then `+ sigmoid(shared_gate) * shared_out` (if given), rounded once.

    expert_out [T, k, H] is the output of expert topk_ids[t, j] for token t (slot j);
    shared_gate [T, 1] holds the shared expert's gate logit.
    """
    order = torch.argsort(topk_ids, dim=-1, stable=True)
    w = topk_weights.float().gather(-1, order)
    t, k = order.shape
    # the j-th expert's rows of every token, as row indices into [T * k, H] (a row copy; a
    # gather over [T, k, H] with an expanded index costs ~5x more; the maths is the same)
    rows = torch.arange(t, device=order.device)[:, None] * k + order
    flat = expert_out.reshape(t * k, -1)
    acc = w[:, 0, None] * flat.index_select(0, rows[:, 0]).float()
    for j in range(1, k):
        acc = acc + w[:, j, None] * flat.index_select(0, rows[:, j]).float()
    if shared_out is not None:
        sh = shared_out.float()
        if shared_gate is not None:
            sh = pw.sigmoid(shared_gate.float()) * sh
        acc = acc + sh
    return acc.to(out_dtype or expert_out.dtype)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    lanes: int = DEFAULT_LANES,
    first_expert: int = 0,
) -> torch.Tensor:
    """Expert outputs [T, k, H] (x's dtype): y = w2[e] · silu_mul(w13[e] · x) per (t, slot),
    the slots sorted by expert (ascending, stable) into one group per expert per projection.

    x is [T, H], or [T, k, H] with one input row per (token, slot) (all equal to the token's
    row): the same outputs, and under autograd each slot's input gradient stays its own, so a
    trainer can sum a token's k slot gradients in a fixed order wherever the experts ran.

    Expert parallelism: `w13`/`w2` may hold only experts `first_expert ..` (a rank's local
    experts). A slot routed elsewhere is -0.0, the exact additive identity (x + -0.0 == x for
    every x, signed zeros included), so summing the ranks' outputs in any order reassembles
    every slot bit for bit.
    """
    if x.device.type != "cpu":
        raise ValueError(
            f"moe: the experts are a compiled CPU kernel (x on {x.device}; on CUDA run the "
            "Triton backend's)"
        )
    t, k = topk_ids.shape
    out = x.new_full((t, k, w2.shape[1]), -0.0)
    local = topk_ids.reshape(-1).to(torch.int64)
    n_local = w13.shape[0]
    if local.numel() == 0:
        return out
    if first_expert or int(local.max()) >= n_local:  # expert parallel: this rank's slots
        local = local - first_expert
        sel = ((local >= 0) & (local < n_local)).nonzero().squeeze(-1)
        if sel.numel() == 0:
            return out
        sel = sel[torch.argsort(local[sel], stable=True)]
    else:  # every slot is local (no expert parallelism, or this rank holds them all)
        sel = torch.argsort(local, stable=True)
    # one group per local expert, in expert order (an expert without rows is an empty group)
    counts = torch.bincount(local[sel], minlength=n_local)
    offsets = torch.zeros(n_local + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    wsel = torch.arange(n_local)
    rows = x[sel // k] if x.dim() == 2 else x.reshape(t * k, -1)[sel]
    h = silu_mul(_linear(rows, w13, offsets, wsel, lanes))
    return (
        out.reshape(t * k, -1)
        .index_put((sel,), _linear(h, w2, offsets, wsel, lanes))
        .view(out.shape)
    )


def moe_combine(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_gate_w: torch.Tensor | None = None,
    lanes: int = DEFAULT_LANES,
    expert_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full MoE block after routing: routed experts + fixed-order combine + optional shared
    expert `sigmoid(x · shared_gate_w^T) * w2s · silu_mul(w13s · x)`. x [T, H] -> [T, H].

    `expert_out` [T, k, H]: the routed experts' outputs, already computed (under expert
    parallelism they come from the ranks holding the experts); `w13`/`w2` are then unused."""
    y = moe_experts(x, topk_ids, w13, w2, lanes=lanes) if expert_out is None else expert_out
    shared_out = shared_gate = None
    if shared_w13 is not None and shared_w2 is not None:
        shared_out = _whole(silu_mul(_whole(x, shared_w13, lanes)), shared_w2, lanes)
        if shared_gate_w is not None:
            shared_gate = _whole(x, shared_gate_w, lanes)
    return moe_weighted_sum(
        y,
        topk_weights,
        topk_ids,
        shared_out=shared_out,
        shared_gate=shared_gate,
        out_dtype=x.dtype,
    )
