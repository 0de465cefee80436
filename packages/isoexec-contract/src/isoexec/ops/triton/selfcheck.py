"""Self-checks of the Triton kernels: bitwise invariance and accuracy vs the torch ops.

Why one module: the CPU test suite (under Triton's interpreter) and the GPU check script
(`integration/gpu/run_checks.py`, on CUDA) run the very same checks, so a structure proven
on CPU is re-proven with real GPU bits. Each check returns a `CheckResult`: `invariant` is
bitwise (`torch.equal`) — a row computed alone, inside batches of other sizes and
neighbours, split into decode steps or TP shards; `max_err` is the largest error against the
torch canonical op in units of the tolerance (<= 1 passes). Shapes are tiny by default (the
interpreter is slow); `scale` grows the batch sizes on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import activation as t_act
from .. import attention as t_attn
from .. import gdn as t_gdn
from .. import gemm as t_gemm
from .. import logprobs as t_lp
from .. import moe as t_moe
from .. import norm as t_norm
from .. import rope as t_rope
from . import attention as x_attn
from . import elementwise as x_elt
from . import gdn as x_gdn
from . import gemm as x_gemm
from . import logprobs as x_lp
from . import moe as x_moe
from . import norm as x_norm
from .selfcheck_harness import linear_tp_shard_ranks, row_mismatches

# (rtol, atol) against the torch canonical op: two fp32 reduction trees differ by a few ulp
# of the largest partial; two bf16 roundings of nearly equal fp32 values differ by <= 1 ulp.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2.0**-7, 1e-3),
}


@dataclass(frozen=True)
class CheckResult:
    name: str
    dtype: str
    invariant: bool
    max_err: float  # max |triton - torch| / (atol + rtol |torch|); <= 1 passes
    detail: str = ""

    @property
    def accurate(self) -> bool:
        return self.max_err <= 1.0

    @property
    def ok(self) -> bool:
        return self.invariant and self.accurate


def _err(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    rtol, atol = TOLERANCE[dtype]
    a64, b64 = a.double().cpu(), b.double().cpu()
    if a64.shape != b64.shape:
        return float("inf")
    if not a64.numel():
        return 0.0
    return float(((a64 - b64).abs() / (atol + rtol * b64.abs())).max())


def _on_cpu(fn: Callable[..., object]) -> Callable[..., object]:
    """`fn` (a torch canonical op) run on CPU copies of its tensor arguments: the accuracy
    reference on any device (attention, MoE experts and the GDN recurrence are compiled CPU
    kernels; `_err` compares on the CPU)."""

    def run(*args: object, **kw: object) -> object:
        def mv(t: object) -> object:
            return t.cpu() if isinstance(t, torch.Tensor) else t

        return fn(*map(mv, args), **{k: mv(v) for k, v in kw.items()})

    return run


def _rand(g: torch.Generator, *shape: int, dtype: torch.dtype, device: str, s: float = 1.0):
    return (torch.randn(*shape, generator=g) * s).to(dtype).to(device)


def _sizes(scale: int) -> tuple[int, ...]:
    return (1, 2, 7, 33, 70) if scale == 1 else (1, 2, 7, 33, 70, 64 * scale + 3)


def check_linear(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    k, n = 80, 48
    g = torch.Generator().manual_seed(1)
    w = _rand(g, n, k, dtype=dtype, device=device, s=0.2)
    bias = _rand(g, n, dtype=dtype, device=device)

    def gen(m: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (_rand(g, m, k, dtype=dtype, device=device),)

    bad = row_mismatches(lambda x: x_gemm.linear(x, w, bias), gen, _sizes(scale))
    x = gen(70, g)[0]
    err = _err(x_gemm.linear(x, w, bias), t_gemm.linear(x, w, bias), dtype)
    return CheckResult("linear", str(dtype), not bad, err, f"differs at {bad}" if bad else "")


def check_linear_tp(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    k, n, leaves = 128, 40, 8
    g = torch.Generator().manual_seed(2)
    x = _rand(g, 9, k, dtype=dtype, device=device)
    w = _rand(g, n, k, dtype=dtype, device=device, s=0.2)
    bias = _rand(g, n, dtype=dtype, device=device)
    outs = {
        tp: x_gemm.tp_linear_from_shards(
            list(x.chunk(tp, -1)), list(w.chunk(tp, -1)), leaves=leaves
        )
        for tp in (1, 2, 4)
    }
    bad: list[object] = [tp for tp, y in outs.items() if not torch.equal(y, outs[1])]
    bad += [m for m in (1, 4) if not torch.equal(x_gemm.linear_tp_invariant(x[:m], w), outs[1][:m])]
    # One rank's share in a live group (the form the sites call): every rank, every TP.
    whole = x_gemm.linear_tp_invariant(x, w, bias, leaves=leaves)
    for tp in (1, 2, 4):
        ranks = linear_tp_shard_ranks(
            x_gemm.linear_tp_shard, x_gemm.tp_leaf_partials, x, w, bias, tp=tp, leaves=leaves
        )
        bad += [f"shard TP={tp} rank {r}" for r, y in enumerate(ranks) if not torch.equal(y, whole)]
    err = _err(outs[1], t_gemm.linear_tp_invariant(x, w, leaves=leaves), dtype)
    return CheckResult("linear_tp", str(dtype), not bad, err, f"TP/M {bad}" if bad else "")


def check_rms_norm(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    d, eps = 48, 1e-6
    g = torch.Generator().manual_seed(3)
    w = _rand(g, d, dtype=dtype, device=device, s=0.1)

    def gen(m: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (
            _rand(g, m, d, dtype=dtype, device=device),
            _rand(g, m, d, dtype=dtype, device=device),
        )

    def fused(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y, nr = x_norm.rms_norm(x, w, eps, zero_centered=True, residual=r)
        return torch.cat([y, nr], -1)

    bad = row_mismatches(lambda x, r: x_norm.rms_norm(x, w, eps), gen, _sizes(scale))
    bad += row_mismatches(fused, gen, _sizes(scale))
    x, r = gen(33, g)
    err = max(
        _err(x_norm.rms_norm(x, w, eps), t_norm.rms_norm(x, w, eps), dtype),
        _err(
            fused(x, r),
            torch.cat(t_norm.rms_norm(x, w, eps, zero_centered=True, residual=r), -1),
            dtype,
        ),
    )
    return CheckResult("rms_norm", str(dtype), not bad, err, f"differs at {bad}" if bad else "")


def check_gated_rms_norm(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    d, eps = 40, 1e-6
    g = torch.Generator().manual_seed(4)
    w = _rand(g, d, dtype=dtype, device=device)

    def gen(m: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (
            _rand(g, m, d, dtype=dtype, device=device),
            _rand(g, m, d, dtype=dtype, device=device),
        )

    bad = row_mismatches(lambda x, z: x_norm.gated_rms_norm(x, z, w, eps), gen, _sizes(scale))
    x, z = gen(33, g)
    err = _err(x_norm.gated_rms_norm(x, z, w, eps), t_norm.gated_rms_norm(x, z, w, eps), dtype)
    return CheckResult("gated_rms_norm", str(dtype), not bad, err, f"at {bad}" if bad else "")


def check_rope(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    h, d, rot = 3, 32, 24
    g = torch.Generator().manual_seed(5)

    def gen(m: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        pos = torch.randint(0, 4096, (m,), generator=g).to(device)
        return (_rand(g, m, h, d, dtype=dtype, device=device), pos)

    def fn(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c, s = t_rope.rope_cos_sin(pos, rot, 10000.0)
        return x_elt.apply_rope(x, c, s, rot)

    bad = row_mismatches(fn, gen, _sizes(scale))
    x, pos = gen(33, g)
    c, s = t_rope.rope_cos_sin(pos, rot, 10000.0)
    err = _err(fn(x, pos), t_rope.apply_rope(x, c, s, rot), dtype)
    return CheckResult("rope", str(dtype), not bad, err, f"differs at {bad}" if bad else "")


def check_silu_mul(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    g = torch.Generator().manual_seed(6)

    def gen(m: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (_rand(g, m, 2 * 72, dtype=dtype, device=device, s=3.0),)

    bad = row_mismatches(lambda x: x_elt.silu_mul(x, block=64), gen, _sizes(scale))
    (x,) = gen(33, g)
    err = _err(x_elt.silu_mul(x), t_act.silu_mul(x), dtype)
    return CheckResult("silu_mul", str(dtype), not bad, err, f"differs at {bad}" if bad else "")


def _paged(
    k: torch.Tensor, v: torch.Tensor, bs: int, blocks: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A paged cache holding one sequence's k/v in the given (shuffled) blocks."""
    nb = max(blocks) + 2
    kc = k.new_zeros(nb, bs, *k.shape[1:])
    vc = v.new_zeros(nb, bs, *v.shape[1:])
    for p in range(k.shape[0]):
        kc[blocks[p // bs], p % bs] = k[p]
        vc[blocks[p // bs], p % bs] = v[p]
    return kc, vc, torch.tensor([blocks], device=k.device)


def check_attention(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    h, hkv, d = 4, 2, 16
    sc = d**-0.5
    g = torch.Generator().manual_seed(7)
    lens = [21, 5, 9 * scale]
    tot = sum(lens)
    q = _rand(g, tot, h, d, dtype=dtype, device=device)
    k = _rand(g, tot, hkv, d, dtype=dtype, device=device)
    v = _rand(g, tot, hkv, d, dtype=dtype, device=device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    packed = x_attn.attention_varlen(q, k, v, cu, scale=sc)
    n0 = lens[0]
    alone = x_attn.attention_varlen(
        q[:n0], k[:n0], v[:n0], torch.tensor([0, n0], device=device), scale=sc
    )
    bad = [] if torch.equal(alone, packed[:n0]) else ["varlen co-batch"]
    # paged: shuffled blocks of 8; decode of the last token, and a chunk continuing a prefix
    kc, vc, bt = _paged(k[:n0], v[:n0], 8, [5, 1, 3])
    lens_t = torch.tensor([n0], device=device)
    dec = x_attn.attention_paged(
        q[n0 - 1 : n0], kc, vc, bt, lens_t, torch.tensor([0, 1], device=device), scale=sc
    )
    if not torch.equal(dec, packed[n0 - 1 : n0]):
        bad.append("decode != prefill")
    chunk = x_attn.attention_paged(
        q[9:n0], kc, vc, bt, lens_t, torch.tensor([0, n0 - 9], device=device), scale=sc
    )
    if not torch.equal(chunk, packed[9:n0]):
        bad.append("chunk != prefill")
    err = _err(packed, _on_cpu(t_attn.attention_varlen)(q, k, v, cu, scale=sc), dtype)
    err = max(
        err,
        _err(
            chunk,
            _on_cpu(t_attn.attention_paged)(
                q[9:n0], kc, vc, bt, lens_t, torch.tensor([0, n0 - 9], device=device), scale=sc
            ),
            dtype,
        ),
    )
    return CheckResult("attention", str(dtype), not bad, err, ", ".join(map(str, bad)))


def check_logprobs(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    vocab, tile = 600, 128
    g = torch.Generator().manual_seed(8)

    def gen(m: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = _rand(g, m, vocab, dtype=dtype, device=device, s=4.0)
        return (x, torch.randint(0, vocab, (m,), generator=g).to(device))

    bad: list[object] = []
    for temp in (1.0, 0.7):
        bad += row_mismatches(
            lambda x, i, t=temp: x_lp.token_logprobs(x, i, temperature=t, vocab_tile=tile)[:, None],
            gen,
            _sizes(scale)[:4],
        )
    x, ids = gen(7, g)
    full = x_lp.token_logprobs_vocab_parallel([x], ids, leaves=8, temperature=0.7)
    for tp in (2, 4):
        sh = x_lp.token_logprobs_vocab_parallel(
            list(x.chunk(tp, -1)), ids, leaves=8, temperature=0.7
        )
        if not torch.equal(sh, full):
            bad.append(f"TP={tp}")
    ls = x_lp.log_softmax(x, temperature=0.7)
    if not torch.equal(
        ls.gather(-1, ids[:, None])[:, 0], x_lp.token_logprobs(x, ids, temperature=0.7)
    ):
        bad.append("log_softmax != token_logprobs")
    # logprobs are fp32 whatever the logits dtype: compare at fp32 tolerance
    err = max(
        _err(
            x_lp.token_logprobs(x, ids, temperature=0.7),
            t_lp.token_logprobs(x, ids, temperature=0.7),
            torch.float32,
        ),
        _err(ls, t_lp.log_softmax(x, temperature=0.7), torch.float32),
        _err(full, t_lp.token_logprobs_vocab_parallel([x], ids, temperature=0.7), torch.float32),
    )
    return CheckResult("logprobs", str(dtype), not bad, err, ", ".join(map(str, bad)))


def check_moe_router(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    e, topk = 10, 3
    g = torch.Generator().manual_seed(9)

    def gen(m: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (_rand(g, m, e, dtype=dtype, device=device, s=2.0),)

    def fn(x: torch.Tensor) -> torch.Tensor:
        w, ids = x_moe.moe_router(x, topk, renormalize=True)
        return torch.cat([w, ids.float()], -1)

    bad: list[object] = list(row_mismatches(fn, gen, _sizes(scale)))
    tie = torch.zeros(1, e, dtype=dtype, device=device)
    tie[0, 7] = tie[0, 2] = tie[0, 5] = 3.0
    _, ids = x_moe.moe_router(tie, topk, renormalize=False)
    if ids[0].tolist() != [2, 5, 7]:
        bad.append(f"ties picked {ids[0].tolist()}")
    (x,) = gen(33, g)
    w, ids = x_moe.moe_router(x, topk, renormalize=True)
    tw, tids = t_moe.moe_router(x, topk, renormalize=True)
    err = _err(w, tw, torch.float32) if torch.equal(ids, tids) else float("inf")
    return CheckResult("moe_router", str(dtype), not bad, err, ", ".join(map(str, bad)))


def check_moe_combine(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    hdim, inter, e, topk = 32, 16, 6, 2
    g = torch.Generator().manual_seed(10)
    w13 = _rand(g, e, 2 * inter, hdim, dtype=dtype, device=device, s=0.25)
    w2 = _rand(g, e, hdim, inter, dtype=dtype, device=device, s=0.25)
    sw13 = _rand(g, 2 * inter, hdim, dtype=dtype, device=device, s=0.25)
    sw2 = _rand(g, hdim, inter, dtype=dtype, device=device, s=0.25)
    sg = _rand(g, 1, hdim, dtype=dtype, device=device, s=0.25)
    kw = {"shared_w13": sw13, "shared_w2": sw2, "shared_gate_w": sg}

    def gen(m: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = _rand(g, m, hdim, dtype=dtype, device=device)
        w, ids = t_moe.moe_router(
            _rand(g, m, e, dtype=torch.float32, device=device), topk, renormalize=True
        )
        return x, w, ids

    def fn(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x_moe.moe_combine(x, w, ids, w13, w2, **kw)

    bad: list[object] = list(row_mismatches(fn, gen, _sizes(scale)[:4]))
    x, w, ids = gen(9, g)
    y = fn(x, w, ids)
    if not torch.equal(fn(x, w.flip(-1), ids.flip(-1)), y):
        bad.append("slot order changes bits")
    err = _err(y, _on_cpu(t_moe.moe_combine)(x, w, ids, w13, w2, **kw), dtype)
    return CheckResult("moe_combine", str(dtype), not bad, err, ", ".join(map(str, bad)))


def check_gdn_conv(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    c, width, t = 24, 4, 9
    g = torch.Generator().manual_seed(11)
    wt = _rand(g, c, width, dtype=dtype, device=device, s=0.5)
    bias = _rand(g, c, dtype=dtype, device=device)
    x = _rand(g, 3, t, c, dtype=dtype, device=device)
    y, st = x_gdn.gdn_conv(x, wt, None, bias)
    bad = []
    y1, _ = x_gdn.gdn_conv(x[1], wt, None, bias)
    if not torch.equal(y1, y[1]):
        bad.append("batch")
    parts, s = [], None
    for a, b in ((0, 5), (5, 6), (6, 9)):
        yi, s = x_gdn.gdn_conv(x[:, a:b], wt, s, bias)
        parts.append(yi)
    if not (torch.equal(torch.cat(parts, 1), y) and s is not None and torch.equal(s, st)):
        bad.append("split/decode")
    ty, tst = t_gdn.gdn_conv(x, wt, None, bias)
    err = _err(y, ty, dtype) if torch.equal(st, tst) else float("inf")
    return CheckResult("gdn_conv", str(dtype), not bad, err, ", ".join(bad))


def check_gdn_recurrence(device: str, dtype: torch.dtype, scale: int = 1) -> CheckResult:
    b, t, hk, hv, dk, dv = 3, 6, 2, 4, 16, 24
    g = torch.Generator().manual_seed(12)
    q = _rand(g, b, t, hk, dk, dtype=dtype, device=device)
    k = _rand(g, b, t, hk, dk, dtype=dtype, device=device)
    v = _rand(g, b, t, hv, dv, dtype=dtype, device=device)
    a = _rand(g, b, t, hv, dtype=dtype, device=device)
    bb = _rand(g, b, t, hv, dtype=dtype, device=device)
    alog = _rand(g, hv, dtype=torch.float32, device=device, s=0.5)
    dtb = _rand(g, hv, dtype=torch.float32, device=device, s=0.5)
    o, st = x_gdn.gdn_recurrence(q, k, v, a, bb, alog, dtb)
    bad = []
    o1, s1 = x_gdn.gdn_recurrence(q[2], k[2], v[2], a[2], bb[2], alog, dtb)
    if not (torch.equal(o1, o[2]) and torch.equal(s1, st[2])):
        bad.append("batch")
    s, outs = None, []
    for i in range(t):
        sl = slice(i, i + 1)
        oi, s = x_gdn.gdn_recurrence(
            q[:, sl], k[:, sl], v[:, sl], a[:, sl], bb[:, sl], alog, dtb, s
        )
        outs.append(oi)
    if not (torch.equal(torch.cat(outs, 1), o) and s is not None and torch.equal(s, st)):
        bad.append("decode != prefill")
    to, tst = _on_cpu(t_gdn.gdn_recurrence)(q, k, v, a, bb, alog, dtb)
    err = max(_err(o, to, dtype), _err(st, tst, torch.float32))
    return CheckResult("gdn_recurrence", str(dtype), not bad, err, ", ".join(bad))


CHECKS: dict[str, Callable[[str, torch.dtype, int], CheckResult]] = {
    "linear": check_linear,
    "linear_tp": check_linear_tp,
    "rms_norm": check_rms_norm,
    "gated_rms_norm": check_gated_rms_norm,
    "rope": check_rope,
    "silu_mul": check_silu_mul,
    "attention": check_attention,
    "logprobs": check_logprobs,
    "moe_router": check_moe_router,
    "moe_combine": check_moe_combine,
    "gdn_conv": check_gdn_conv,
    "gdn_recurrence": check_gdn_recurrence,
}

DTYPES = (torch.float32, torch.bfloat16)


def run_all(
    device: str,
    *,
    scale: int = 1,
    dtypes: Sequence[torch.dtype] = DTYPES,
    only: Sequence[str] | None = None,
) -> list[CheckResult]:
    """Every check (or those in `only`) at every dtype; an exception becomes a failed
    result, not a crash."""
    unknown = set(only or ()) - set(CHECKS)
    if unknown:
        raise KeyError(f"unknown checks {sorted(unknown)}; known: {list(CHECKS)}")
    out = []
    for name, fn in CHECKS.items():
        if only is not None and name not in only:
            continue
        for dt in dtypes:
            try:
                out.append(fn(device, dt, scale))
            except Exception as e:  # one broken kernel must not hide the others' results
                out.append(CheckResult(name, str(dt), False, float("inf"), f"error: {e!r}"[:200]))
    return out
