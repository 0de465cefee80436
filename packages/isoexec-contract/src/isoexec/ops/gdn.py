"""Canonical Gated DeltaNet pieces: causal depthwise conv (+SiLU) and the gated delta rule.

Why: the chunked GDN form never matches the recurrent one bitwise, and a decode step must
equal the same token inside a prefill. The conv is an explicit shifted sum in a fixed order
(a decode step is the same sum over its conv state). The recurrence is token-serial with an
fp32 state for prefill *and* decode, run by one compiled CPU kernel (`cpu_kernels/gdn.cpp`):
one (sequence, value head) per thread, tokens in order, every Σ_k in k order per state column,
the l2-norm sums over `LANES` fixed lanes with a fixed tree, its own exp/log. So the bits do not
depend on the batch, the thread count, where a call starts (prefill, decode step) or the CPU.

v2 replaces v1's torch-op token loop (~10 ops per token; same invariance, other bits). Under
autograd the kernel's forward saves the state every `GRAD_SEGMENT` tokens, and the backward is
the kernel's adjoint recurrence, recomputing each segment from its checkpoint (gradients are
correct, not bitwise). The op is CPU-only (asking for it on another device is an error); the
v1 torch loop lives on in `gdn_reference` (`gdn_recurrence_grad_reference`), what the Triton
backend's backward differentiates on any device (its gradients, not this op's bits).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from . import _pointwise as pw
from . import cpu_kernels
from ._autograd import grad_wanted

# The compiled libraries whose sources define this module's bits (in the op fingerprint).
KERNEL_LIBRARIES = ("gdn",)
L2_EPS = 1e-6
# fp32 lanes of the l2-norm sums of q and k (dim i in lane i % LANES, then a fixed tree): the
# only reduction across lanes; the state's Σ_k run in k order. Fixed in the kernel's source.
LANES = 16
# Tokens per checkpoint segment under autograd (memory only, no bits, no gradient bits).
GRAD_SEGMENT = 64
# State columns per block in the kernel (speed only: a column never reads another).
_V_BLOCK = 32
_V_BLOCKS = (16, 32, 64)
_DTYPES = cpu_kernels.DTYPE_CODES
_I64 = cpu_kernels.I64
_PTR = cpu_kernels.PTR
_COMMON_ARGS = [
    *([_I64] * 6),
    _PTR, _PTR, _PTR, ctypes.c_int, *([_I64] * 9),
    _PTR, _PTR, _PTR, _PTR, ctypes.c_float,
]  # fmt: skip


def gdn_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU. x [..., T, C], weight [C, W], state [..., W-1, C] (the
    last W-1 raw pre-conv inputs; zeros if None). Returns (y [..., T, C] in x's dtype,
    new_state [..., W-1, C] in x's dtype).

    y[t] = silu(sum_{j=0..W-1} xp[t+j] * w[:, j] (+ bias)) with xp = cat(state, x), summed
    in fp32 in the fixed order j = 0..W-1.
    """
    w = weight.shape[-1]
    if state is None:
        state = x.new_zeros(*x.shape[:-2], w - 1, x.shape[-1])
    xp = torch.cat([state.to(x.dtype), x], dim=-2)
    xf = xp.float()
    wf = weight.float()
    t = x.shape[-2]
    acc = xf[..., 0:t, :] * wf[:, 0]
    for j in range(1, w):
        acc = acc + xf[..., j : j + t, :] * wf[:, j]
    if bias is not None:
        acc = acc + bias.float()
    y = pw.silu(acc).to(x.dtype)
    return y, xp[..., xp.shape[-2] - (w - 1) :, :]


def _fwd_kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = cpu_kernels.library("gdn").isx_gdn_fwd
    fn.restype = ctypes.c_int
    fn.argtypes = [
        *_COMMON_ARGS, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, *([_I64] * 4), ctypes.c_int, ctypes.c_int
    ]  # fmt: skip
    return fn


def _bwd_kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = cpu_kernels.library("gdn").isx_gdn_bwd
    fn.restype = ctypes.c_int
    fn.argtypes = [
        *_COMMON_ARGS, _PTR, _I64, _PTR, _PTR, *([_PTR] * 6), ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    return fn


def _kernel_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[list[object], list[torch.Tensor]]:
    """The leading arguments both kernels take (shapes, q/k/v read in place with their strides,
    fp32 gates), and the tensors they point into (kept alive by the caller)."""
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != q.shape[:2] or hk <= 0 or hv % hk:
        raise ValueError(
            f"gdn_recurrence: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if a.shape != (bsz, t, hv) or b.shape != (bsz, t, hv):
        raise ValueError(
            f"gdn_recurrence: a {tuple(a.shape)}, b {tuple(b.shape)}; want {(bsz, t, hv)}"
        )
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(
            f"gdn_recurrence: A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _DTYPES):
        # bf16/fp16 embed exactly in fp32: the same values as the kernel's own upcast
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    fa, fb, fal, fdt = (x.detach().float().contiguous() for x in (a, b, A_log, dt_bias))
    args: list[object] = [
        bsz, t, hk, hv, dk, dv,
        cpu_kernels.ptr(q), cpu_kernels.ptr(k), cpu_kernels.ptr(v), _DTYPES[q.dtype],
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        cpu_kernels.ptr(fa), cpu_kernels.ptr(fb), cpu_kernels.ptr(fal), cpu_kernels.ptr(fdt),
        L2_EPS,
    ]  # fmt: skip
    return args, [q, k, v, fa, fb, fal, fdt]


def _check_cpu(*ts: torch.Tensor | None) -> None:
    for x in ts:
        if x is not None and x.device.type != "cpu":
            raise ValueError(
                f"gdn_recurrence: the compiled kernel runs on CPU, got {x.device} "
                "(on CUDA run the Triton backend's)"
            )


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor | None,
    *,
    ckpt_every: int | None = None,
    v_block: int = _V_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel on batched inputs: (o [B, T, HV, V] fp32, state [B, HV, K, V] fp32, and with
    `ckpt_every` the states before tokens 0, N, 2N, .. [B, HV, ceil(T / N), K, V])."""
    if v_block not in _V_BLOCKS:
        raise ValueError(f"gdn_recurrence: v_block={v_block} unsupported ({_V_BLOCKS})")
    _check_cpu(q, k, v, a, b, A_log, dt_bias, state)
    args, keep = _kernel_inputs(q, k, v, a, b, A_log, dt_bias)
    bsz, t, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    s0 = None if state is None else state.detach().float().contiguous()
    if s0 is not None and s0.shape != (bsz, hv, dk, dv):
        raise ValueError(f"gdn_recurrence: state {tuple(s0.shape)}; want {(bsz, hv, dk, dv)}")
    o = torch.empty(bsz, t, hv, dv, dtype=torch.float32)
    new_state = torch.empty(bsz, hv, dk, dv, dtype=torch.float32)
    n = ckpt_every or max(t, 1)
    ckpt = None if ckpt_every is None else torch.empty(bsz, hv, -(-t // n), dk, dv)
    if t == 0:
        new_state = s0.clone() if s0 is not None else new_state.zero_()
        return o, new_state, ckpt
    rc = _fwd_kernel()(
        *args, cpu_kernels.ptr(s0), cpu_kernels.ptr(o), cpu_kernels.ptr(new_state),
        cpu_kernels.ptr(ckpt), n, None, 0, 0, 0, 0, v_block, torch.get_num_threads(),
    )  # fmt: skip
    del keep
    if rc != 0:
        raise RuntimeError(f"gdn kernel refused its arguments (code {rc})")
    return o, new_state, ckpt


def _gates_and_norms(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    rep: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qn, kn repeated to the value heads, decay, beta) as torch ops: what the kernel computes
    before its token loop, differentiated by autograd in the backward (not the kernel's bits;
    gradients only)."""

    def norm(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2_EPS)

    qn = (norm(q) / (q.shape[-1] ** 0.5)).repeat_interleave(rep, dim=2)
    kn = norm(k).repeat_interleave(rep, dim=2)
    g = -torch.exp(A_log.float()) * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return qn, kn, torch.exp(g), torch.sigmoid(b.float())


class _Recurrence(torch.autograd.Function):
    """Forward: the kernel, saving the state every `GRAD_SEGMENT` tokens. Backward: the
    kernel's adjoint recurrence (segment by segment from those states), then autograd through
    the cheap elementwise parts (l2 norm, gates, GQA repeat, dtype casts)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seg = GRAD_SEGMENT
        o, new_state, ckpt = _forward(q, k, v, a, b, A_log, dt_bias, state, ckpt_every=seg)
        ctx.save_for_backward(q, k, v, a, b, A_log, dt_bias, ckpt)
        ctx.seg = seg
        ctx.state_dtype = None if state is None else state.dtype
        return o, new_state

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, d_o: torch.Tensor | None, d_state: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, a, b, A_log, dt_bias, ckpt = ctx.saved_tensors
        bsz, t, hk, dk = q.shape
        hv, dv = v.shape[2], v.shape[3]
        args, keep = _kernel_inputs(q, k, v, a, b, A_log, dt_bias)
        f32 = torch.float32
        dout = torch.zeros(bsz, t, hv, dv) if d_o is None else d_o.to(f32).contiguous()
        dst = None if d_state is None else d_state.to(f32).contiguous()
        dqn, dkn = torch.zeros(bsz, t, hv, dk), torch.zeros(bsz, t, hv, dk)
        dvf = torch.empty(bsz, t, hv, dv)
        dd, dbeta = torch.zeros(bsz, t, hv), torch.zeros(bsz, t, hv)
        want_s0 = ctx.needs_input_grad[7]
        ds0 = torch.empty(bsz, hv, dk, dv) if want_s0 else None
        if t > 0:
            rc = _bwd_kernel()(
                *args, cpu_kernels.ptr(ckpt), ctx.seg, cpu_kernels.ptr(dout),
                cpu_kernels.ptr(dst), cpu_kernels.ptr(dqn), cpu_kernels.ptr(dkn),
                cpu_kernels.ptr(dvf), cpu_kernels.ptr(dd), cpu_kernels.ptr(dbeta),
                cpu_kernels.ptr(ds0), _V_BLOCK, torch.get_num_threads(),
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"gdn backward kernel refused its arguments (code {rc})")
        elif ds0 is not None:
            ds0 = torch.zeros_like(ds0) if dst is None else dst.clone()
        del keep
        ins = [
            x.detach().requires_grad_(need)
            for x, need in zip(
                (q, k, v, a, b, A_log, dt_bias), ctx.needs_input_grad[:7], strict=True
            )
        ]
        grads: list[torch.Tensor | None] = [None] * 7
        wanted = [x for x in ins if x.requires_grad]
        if wanted:
            with torch.enable_grad():
                qn, kn, decay, beta = _gates_and_norms(*ins[:2], *ins[3:], hv // hk)
                outs = [qn, kn, ins[2].float(), decay, beta]
            pairs = [
                (o, g)
                for o, g in zip(outs, (dqn, dkn, dvf, dd, dbeta), strict=True)
                if o.requires_grad
            ]
            got = iter(
                torch.autograd.grad(
                    [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
                )
            )
            grads = [next(got) if x.requires_grad else None for x in ins]
            grads = [
                torch.zeros_like(x) if g is None and x.requires_grad else g
                for x, g in zip(ins, grads, strict=True)
            ]
        d_s0 = None if ds0 is None else ds0.to(ctx.state_dtype)
        return (*grads, d_s0)


def gdn_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, token-serial. q, k [B?, T, HK, K]; v [B?, T, HV, V]; a, b
    [B?, T, HV]; A_log, dt_bias [HV]; state [B?, HV, K, V] fp32 (zeros if None).
    Returns (o [B?, T, HV, V] in v's dtype, new_state [B?, HV, K, V] fp32).

    q, k l2-normalised (eps 1e-6), q divided by sqrt(K) (as HF), k-heads repeated to v-heads,
    g = -exp(A_log)·softplus(a + dt_bias), β = sigmoid(b); per token:
    S ← S·e^g; δ = (v − Σ_k S·k)·β; S ← S + k⊗δ; o = Σ_k S·q.
    Differentiable in every input (the state included).
    """
    return _batched(_canonical, q, k, v, a, b, A_log, dt_bias, state)


def gdn_recurrence_in_place(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: None = None,
    *,
    cache: torch.Tensor,
    slots: torch.Tensor,
    has_state: bool,
) -> tuple[torch.Tensor, None]:
    """`gdn_recurrence` of a batch whose states live in an engine's state cache: request b's
    fp32 state is `cache[slots[b]]` ([slots, HV, K, V], any strides: an engine's own layout
    as a view), read (zeros if not `has_state`) and overwritten in place with the new state.
    The same kernel and bits as `gdn_recurrence` with the gathered states; it only saves the
    gather, the transposing copies and the scatter an engine step would otherwise pay (three
    moves of every running request's state per layer per step). No autograd. Returns (o in
    v's dtype, None), the shape `gdn_sequence` expects of a recurrence (whose `state`
    argument must then be None: the states are the cache's)."""
    if state is not None:
        raise ValueError("gdn_recurrence_in_place: the states are the cache's, pass state=None")
    if grad_wanted(q, k, v, a, b):
        raise ValueError("gdn_recurrence_in_place: no autograd (an engine step)")
    _check_cpu(q, k, v, a, b, A_log, dt_bias, cache)
    bsz, t, _hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    idx = slots.to(torch.int64).contiguous()
    if cache.dtype != torch.float32 or cache.dim() != 4 or cache.shape[1:] != (hv, dk, dv):
        raise ValueError(f"gdn_recurrence_in_place: cache {tuple(cache.shape)} {cache.dtype}")
    if idx.shape != (bsz,) or int(idx.unique().numel()) != bsz:
        raise ValueError("gdn_recurrence_in_place: one distinct slot per batch entry")
    if bsz and not (0 <= int(idx.min()) and int(idx.max()) < cache.shape[0]):
        raise ValueError("gdn_recurrence_in_place: slot out of range")
    args, keep = _kernel_inputs(q, k, v, a, b, A_log, dt_bias)
    o = torch.empty(bsz, t, hv, dv, dtype=torch.float32)
    if t == 0 or bsz == 0:
        return o.to(v.dtype), None
    rc = _fwd_kernel()(
        *args, cpu_kernels.ptr(cache if has_state else None), cpu_kernels.ptr(o),
        cpu_kernels.ptr(cache), None, max(t, 1), cpu_kernels.ptr(idx), *cache.stride(),
        _V_BLOCK, torch.get_num_threads(),
    )  # fmt: skip
    del keep
    if rc != 0:
        raise RuntimeError(f"gdn kernel refused its arguments (code {rc})")
    return o.to(v.dtype), None


def _batched(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn` on inputs with a leading batch dim (added and removed for an unbatched call); the
    output in v's dtype."""
    batched = q.dim() == 4
    if not batched:
        q, k, v, a, b = (x.unsqueeze(0) for x in (q, k, v, a, b))
        if state is not None:
            state = state.unsqueeze(0)
    o, new_state = fn(q, k, v, a, b, A_log, dt_bias, state)
    o = o.to(v.dtype)
    if not batched:
        o, new_state = o[0], new_state[0]
    return o, new_state


def _canonical(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled kernel (fp32 outputs), through its autograd Function when a gradient is
    wanted."""
    _check_cpu(q, k, v, a, b, A_log, dt_bias, state)
    if grad_wanted(q, k, v, a, b, A_log, dt_bias, state):
        return _Recurrence.apply(q, k, v, a, b, A_log, dt_bias, state)
    o, new_state, _ = _forward(q, k, v, a, b, A_log, dt_bias, state)
    return o, new_state


def gdn_sequence(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    heads: tuple[int, int, int, int],
    conv_state: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    conv: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gdn_conv,
    recurrence: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gdn_recurrence,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence through a GDN core, as both sides run it: `conv` over [q | k | v] channels,
    split into heads (`heads` = (HK, HV, K, V)), `recurrence`. mixed_qkv [B?, T, C], a, b
    [B?, T, HV]; with a leading batch dim B, sequences of equal length (an engine's decode
    step) run at once, each with the bits it gets alone (every op is per sequence and row).

    Returns (o [B?, T, HV, V], new conv state, new recurrent state). `conv` / `recurrence` are
    the backend's kernels (the torch ones by default); the composition itself is pure
    reshuffles.
    """
    hk, hv, kd, vd = heads
    lead, n = mixed_qkv.shape[:-2], mixed_qkv.shape[-2]
    y, new_conv = conv(mixed_qkv, conv_weight, conv_state)
    q, k, v = y.split([hk * kd, hk * kd, hv * vd], dim=-1)
    o, new_state = recurrence(
        q.reshape(*lead, n, hk, kd),
        k.reshape(*lead, n, hk, kd),
        v.reshape(*lead, n, hv, vd),
        a.reshape(*lead, n, hv),
        b.reshape(*lead, n, hv),
        A_log,
        dt_bias,
        state,
    )
    return o, new_conv, new_state
