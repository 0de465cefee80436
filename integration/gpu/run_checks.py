#!/usr/bin/env python3
"""GPU checks of IsoExec in one run (< 8 minutes on one H100/H200): prints one table.

Why one script: CPU CI proves the Triton kernels' *structure* under the interpreter, but
only a GPU gives GPU bits. On a CUDA device this runs
  1. every Triton kernel's bitwise invariance (row alone == row in batches of other sizes,
     decode == prefill, TP shards) and its accuracy against the torch canonical op
     (`isoexec.ops.triton.selfcheck`, the checks the CPU suite runs);
  2. an lm head past 2**31 output elements (64-bit offsets on the device), then overhead
     ratios: Triton kernel time / the framework's native op (median of CUDA-event timings),
     at realistic shapes;
  3. trainer vs engine, bitwise, for the three tiny families (`isoexec.tools.pair.run_arm`
     with the Triton backend on both sides and the trainer on the device; each family in its
     own try, so one failure does not hide the others; families left when the time budget is
     spent are reported as skipped).
Exit status: 0 all passed; 1 an invariance failed (a kernel not bitwise invariant, or
trainer != engine); 2 no invariance failed but a check errored or was inaccurate. Without a
CUDA device it prints "no CUDA device" and exits 0, so it is safe to call anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FAMILIES = ("tiny-dense", "tiny-moe", "tiny-gdn")
PASS, FAIL_INV, FAIL_OTHER = "PASS", "FAIL", "ERROR"


@dataclass
class Row:
    section: str
    name: str
    result: str  # PASS, FAIL (invariance), ERROR (error / inaccurate), SKIP, or a number
    detail: str

    @property
    def status(self) -> int:
        return {FAIL_INV: 1, FAIL_OTHER: 2}.get(self.result, 0)


def kernel_rows(device: str, scale: int, only: list[str] | None = None) -> list[Row]:
    """One row per kernel, both dtypes."""
    from isoexec.ops.triton.selfcheck import run_all

    by_name: dict[str, list] = {}
    for r in run_all(device, scale=scale, only=only):
        by_name.setdefault(r.name, []).append(r)
    rows = []
    for name, rs in by_name.items():
        parts = []
        for r in rs:
            dt = r.dtype.replace("torch.", "")
            inv = "inv" if r.invariant else "NOT-INV"
            parts.append(
                f"{dt}: {inv}, err {r.max_err:.2g}×tol" + (f" ({r.detail})" if r.detail else "")
            )
        if not all(r.invariant for r in rs):
            result = FAIL_INV
        elif not all(r.accurate for r in rs):
            result = FAIL_OTHER
        else:
            result = PASS
        rows.append(Row("kernel", name, result, "; ".join(parts)))
    return rows


def _median_ms(fn: Callable[[], object], reps: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def overhead_rows() -> list[Row]:
    """Triton kernel time / native op time at realistic shapes (bf16)."""
    import torch
    import torch.nn.functional as F

    from isoexec.ops import triton as x

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s: int, dtype: torch.dtype = bf) -> torch.Tensor:
        return torch.randn(*s, device=dev, generator=g).to(dtype)

    xs, w = r(4096, 4096), r(4096, 4096) * 0.02
    nx, nw = r(8192, 4096), r(4096)
    q, k, v = r(2048, 16, 128), r(2048, 4, 128), r(2048, 4, 128)
    cu = torch.tensor([0, 2048], device=dev)
    logits, ids = r(1024, 151936), torch.randint(0, 151936, (1024,), device=dev)
    gq, gk, gv = r(2, 128, 4, 128), r(2, 128, 4, 128), r(2, 128, 8, 128)
    ga, gb, al, dtb = (
        r(2, 128, 8),
        r(2, 128, 8),
        r(8, dtype=torch.float32),
        r(8, dtype=torch.float32),
    )

    def torch_gdn_loop() -> torch.Tensor:
        """A plain torch token loop of the gated delta rule on the device (the torch
        backend's canonical recurrence is a compiled CPU kernel)."""
        b_, t_, hk, dk = gq.shape
        hv, dv = gv.shape[2], gv.shape[3]
        rep = hv // hk
        qf = F.normalize(gq.float(), dim=-1).repeat_interleave(rep, 2) * dk**-0.5
        kf = F.normalize(gk.float(), dim=-1).repeat_interleave(rep, 2)
        decay = torch.exp(-al.exp() * F.softplus(ga.float() + dtb))
        beta = torch.sigmoid(gb.float())
        st = torch.zeros(b_, hv, dk, dv, device=dev)
        outs = []
        for i in range(t_):
            st = st * decay[:, i, :, None, None]
            kv = (st * kf[:, i, :, :, None]).sum(-2)
            delta = (gv[:, i].float() - kv) * beta[:, i, :, None]
            st = st + kf[:, i, :, :, None] * delta[:, :, None, :]
            outs.append((st * qf[:, i, :, :, None]).sum(-2))
        return torch.stack(outs, 1)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )

    cases: list[tuple[str, str, Callable[[], object], Callable[[], object]]] = [
        ("linear", "4096²×4096 vs F.linear", lambda: x.linear(xs, w), lambda: F.linear(xs, w)),
        (
            "rms_norm",
            "8192×4096 vs F.rms_norm",
            lambda: x.rms_norm(nx, nw, 1e-6),
            lambda: F.rms_norm(nx, (4096,), nw, 1e-6),
        ),
        (
            "attention",
            "T=2048 H=16/4 D=128 vs SDPA",
            lambda: x.attention_varlen(q, k, v, cu, scale=128**-0.5),
            sdpa,
        ),
        (
            "logprobs",
            "1024×151936 vs log_softmax+gather",
            lambda: x.token_logprobs(logits, ids),
            lambda: torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None]),
        ),
        (
            "gdn_recurrence",
            "B=2 T=128 HV=8 128² vs a plain torch token loop",
            lambda: x.gdn_recurrence(gq, gk, gv, ga, gb, al, dtb),
            torch_gdn_loop,
        ),
    ]
    rows = []
    for name, what, tri, native in cases:
        try:
            with torch.no_grad():
                t_ms, n_ms = _median_ms(tri), _median_ms(native)
            rows.append(
                Row("overhead", name, f"{t_ms / n_ms:.2f}x", f"{t_ms:.3f} vs {n_ms:.3f} ms, {what}")
            )
        except Exception as e:  # a timing failure is reported, not fatal
            rows.append(Row("overhead", name, FAIL_OTHER, f"{type(e).__name__}: {e}"[:160]))
    return rows


def large_index_rows() -> list[Row]:
    """An lm head past 2**31 output elements (Qwen's 151,936 vocab x 16,384 rows, bf16): the
    Triton linear's last rows must equal the same rows computed alone (bitwise) and the torch
    GEMM (to bf16 tolerance). With 32-bit offsets the rows past ~14,134 would be read or
    written at wrapped addresses; the CPU suite proves the 64-bit arithmetic in the IR
    (tests/triton/test_index_width.py), this shows it on the device."""
    import torch

    from isoexec.ops import triton as x

    m, n, k = 16384, 151936, 1024
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        xs = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
        with torch.no_grad():
            tail = x.linear(xs, w)[-8:].clone()  # the whole [m, n] output, then its last rows
            alone = x.linear(xs[-8:], w)
            ref = (xs[-8:].float() @ w.float().t()).to(torch.bfloat16)
        torch.cuda.synchronize()
        bitwise = torch.equal(tail, alone)
        err = float((tail.float() - ref.float()).abs().max())
        detail = f"{m}x{n} bf16 (> 2**31 elements): last rows alone {bitwise}, max |d| {err:.3g}"
        result = PASS if bitwise and err < 0.1 else (FAIL_INV if not bitwise else FAIL_OTHER)
        return [Row("kernel", "linear_64bit_offsets", result, detail)]
    except Exception as e:  # reported, not fatal
        return [Row("kernel", "linear_64bit_offsets", FAIL_OTHER, f"{type(e).__name__}: {e}"[:160])]
    finally:
        torch.cuda.empty_cache()


def pair_rows(
    families: list[str], dtype: str, deadline: float, stock: bool, device: str = "cuda"
) -> list[Row]:
    """Trainer vs engine on each tiny family, each in its own try: the isoexec arm on the
    Triton backend, both sides, the trainer on `device` (`isoexec pair --backend triton
    --device cuda`)."""
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="isoexec-gpu-checks-"))
    for fam in families:
        if time.monotonic() > deadline:
            rows.append(Row("pair", f"{fam} {dtype}", "SKIP", "time budget spent"))
            continue
        try:
            from isoexec.tools.pair import PairRun, run_arm
            from isoexec.tools.pair_setup import free_device_memory
            from isoexec.tools.tiny_models import make_tiny_model

            model_dir = str(make_tiny_model(fam, tmp / f"{fam}-{dtype}", dtype=dtype))
            run = PairRun(
                model_dir=model_dir, dtype=dtype, num_prompts=6, max_tokens=8, seed=0,
                backend="triton", device=device, out=tmp / f"{fam}-{dtype}-run",
            )  # fmt: skip
            arms = [True, False] if stock else [True]
            for iso in arms:
                try:
                    res = run_arm(run, isoexec=iso)
                finally:  # the next family's engine must find the GPU's memory free
                    free_device_memory(device)
                eq = res.bitwise_equal == res.tokens and res.tokens > 0
                detail = (
                    f"{res.bitwise_equal}/{res.tokens} bitwise, max|Δ| {res.max_abs_diff:.2e}, "
                    f"{res.handshake}"
                )
                if iso:
                    rows.append(Row("pair", f"{fam} {dtype}", PASS if eq else FAIL_INV, detail))
                else:  # the stock arm is a negative control: it should differ
                    rows.append(Row("pair", f"{fam} {dtype} stock", "info", detail))
        except Exception as e:  # one failing family must not kill the table
            rows.append(Row("pair", f"{fam} {dtype}", FAIL_OTHER, f"{type(e).__name__}: {e}"[:200]))
    return rows


def format_table(rows: list[Row]) -> str:
    w = max(len(f"{r.section} {r.name}") for r in rows)
    lines = [f"{'check':<{w}}  {'result':<7} detail", "-" * (w + 40)]
    lines += [f"{f'{r.section} {r.name}':<{w}}  {r.result:<7} {r.detail}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES), help="comma list; '' skips pairs")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--stock", action="store_true", help="also run the stock arm (slower)")
    p.add_argument("--scale", type=int, default=4, help="batch-size scale of kernel checks")
    p.add_argument("--budget-s", type=float, default=420.0, help="no new pair after this")
    p.add_argument("--no-overhead", action="store_true")
    p.add_argument("--kernels", default="", help="comma list of kernel checks (default: all)")
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: kernel checks under TRITON_INTERPRET=1 (tests this script), no overheads",
    )
    args = p.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("run_checks: no CUDA device; nothing to check (exit 0)", flush=True)
        return 0
    start = time.monotonic()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    print(f"run_checks on {where}", flush=True)
    only = [k for k in args.kernels.split(",") if k] or None
    rows = kernel_rows(args.device, args.scale, only)
    print(f"kernels checked ({time.monotonic() - start:.0f} s)", flush=True)
    if args.device == "cuda":
        rows += large_index_rows()
    if not args.no_overhead and args.device == "cuda":
        rows += overhead_rows()
        print(f"overheads timed ({time.monotonic() - start:.0f} s)", flush=True)
    fams = [f for f in args.families.split(",") if f]
    rows += pair_rows(fams, args.dtype, start + args.budget_s, args.stock, args.device)
    print(f"\n{format_table(rows)}\n(total {time.monotonic() - start:.0f} s)", flush=True)
    statuses = [r.status for r in rows]
    return 1 if 1 in statuses else (2 if 2 in statuses else 0)


if __name__ == "__main__":
    sys.exit(main())
