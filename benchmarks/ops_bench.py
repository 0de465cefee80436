"""Time each canonical op against its native torch counterpart (not a test).

Canonical and native repetitions alternate within one run and the median of each is
taken, so background load hits both alike. Prints one table of ratios (canonical/native).
Usage: python benchmarks/ops_bench.py [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from isoexec import ops

HID, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 2816, 16, 4, 64, 32000


def median_pair(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    a()
    b()
    ta, tb = [], []
    for _ in range(reps):
        for f, acc in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def cases(ms: list[int]) -> list[tuple[str, int, str, Callable[[], object], Callable[[], object]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        dn = "fp32" if dtype == torch.float32 else "bf16"
        w = torch.randn(HID, HID, generator=g).to(dtype)
        wn = torch.randn(HID, generator=g).to(dtype)
        for m in ms:
            x = torch.randn(m, HID, generator=g).to(dtype)
            x2 = torch.randn(m, 2 * INTER, generator=g).to(dtype)
            out += [
                (
                    "linear",
                    m,
                    dn,
                    lambda x=x, w=w: ops.linear(x, w),
                    lambda x=x, w=w: F.linear(x, w),
                ),
                (
                    "rms_norm",
                    m,
                    dn,
                    lambda x=x, wn=wn: ops.rms_norm(x, wn, 1e-6),
                    lambda x=x, wn=wn: F.rms_norm(x, (HID,), wn, 1e-6),
                ),
                (
                    "silu_mul",
                    m,
                    dn,
                    lambda x2=x2: ops.silu_mul(x2),
                    lambda x2=x2: F.silu(x2[:, :INTER]) * x2[:, INTER:],
                ),
            ]
            pos = torch.arange(m)
            q = torch.randn(m, HEADS, HEAD_DIM, generator=g).to(dtype)
            cos, sin = ops.rope_cos_sin(pos, HEAD_DIM, 1e6)

            def nat_rope(q=q, cos=cos, sin=sin):
                c = torch.cat([cos, cos], -1)[:, None].to(q.dtype)
                s = torch.cat([sin, sin], -1)[:, None].to(q.dtype)
                q1, q2 = q[..., : HEAD_DIM // 2], q[..., HEAD_DIM // 2 :]
                return q * c + torch.cat([-q2, q1], -1) * s

            out.append(
                ("rope", m, dn, lambda q=q, cos=cos, sin=sin: ops.apply_rope(q, cos, sin), nat_rope)
            )
            if m <= 512:
                lg = torch.randn(m, VOCAB, generator=g).to(dtype)
                ids = torch.randint(0, VOCAB, (m,), generator=g)
                out.append(
                    (
                        "logprobs",
                        m,
                        dn,
                        lambda lg=lg, ids=ids: ops.token_logprobs(lg, ids),
                        lambda lg=lg, ids=ids: torch.log_softmax(lg.float(), -1).gather(
                            -1, ids[:, None]
                        ),
                    )
                )
            # attention: prefill of m tokens (one sequence), or a decode against 512 cached
            t = m if m > 1 else 512
            k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
            v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
            if m <= 512:
                qa = torch.randn(m, HEADS, HEAD_DIM, generator=g).to(dtype)
                kc = k.reshape(-1, 16, KV_HEADS, HEAD_DIM) if t % 16 == 0 else None
                if kc is not None:
                    vc = v.reshape(-1, 16, KV_HEADS, HEAD_DIM)
                    bt = torch.arange(kc.shape[0])[None]

                    def can_att(qa=qa, kc=kc, vc=vc, bt=bt, t=t, m=m):
                        return ops.attention_paged(
                            qa,
                            kc,
                            vc,
                            bt,
                            torch.tensor([t]),
                            torch.tensor([0, m]),
                            scale=HEAD_DIM**-0.5,
                        )

                    def nat_att(qa=qa, k=k, v=v, m=m):
                        kk = k.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
                        vv = v.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
                        return F.scaled_dot_product_attention(
                            qa.transpose(0, 1), kk, vv, is_causal=m > 1
                        )

                    out.append(("attention", m, dn, can_att, nat_att))
        # GDN: one small layer (HK=4, HV=8, K=V=64), recurrent vs HF chunked (prefill) shape
        for m in [mm for mm in ms if mm <= 64]:
            qg = torch.randn(m, 4, 64, generator=g).to(dtype)
            kg = torch.randn(m, 4, 64, generator=g).to(dtype)
            vg = torch.randn(m, 8, 64, generator=g).to(dtype)
            ag = torch.randn(m, 8, generator=g).to(dtype)
            A_log, dtb = torch.randn(8), torch.randn(8)
            from transformers.models.qwen3_next.modeling_qwen3_next import (
                torch_chunk_gated_delta_rule,
            )

            def nat_gdn(qg=qg, kg=kg, vg=vg, ag=ag, A_log=A_log, dtb=dtb):
                gg = -A_log.exp() * F.softplus(ag.float() + dtb)
                return torch_chunk_gated_delta_rule(
                    qg.repeat_interleave(2, 1)[None],
                    kg.repeat_interleave(2, 1)[None],
                    vg[None],
                    gg[None],
                    ag.float().sigmoid()[None],
                    use_qk_l2norm_in_kernel=True,
                )

            out.append(
                (
                    "gdn_recurrence",
                    m,
                    dn,
                    lambda qg=qg, kg=kg, vg=vg, ag=ag, A_log=A_log, dtb=dtb: ops.gdn_recurrence(
                        qg, kg, vg, ag, ag, A_log, dtb
                    ),
                    nat_gdn,
                )
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M in {1, 16, 512} only")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    ms = [1, 16, 512] if args.quick else [1, 16, 512, 4096]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, hidden {HID}")
    print(f"{'op':<16}{'M':>6}  {'dtype':<5}{'canonical ms':>14}{'native ms':>12}{'ratio':>8}")
    for name, m, dn, can, nat in cases(ms):
        with torch.no_grad():
            tc, tn = median_pair(can, nat, args.reps)
        print(f"{name:<16}{m:>6}  {dn:<5}{tc * 1e3:>14.3f}{tn * 1e3:>12.3f}{tc / tn:>8.2f}")


if __name__ == "__main__":
    main()
