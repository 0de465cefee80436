#!/usr/bin/env python3
"""One-shot GPU check for the machine this project is lent: no vLLM, no Megatron installed.

Why a second script beside `run_checks.py`: the lent device (15 minutes for a whole session,
every try counted) has its own python3 (3.12), torch and triton, no vLLM and no Megatron-core,
and nothing can be downloaded there. So this runs from a copy of the working tree with the
device's own torch and triton; Megatron-core is carried as its cp312 wheel in the git-ignored
`integration/gpu/wheels/` (`fetch_wheels.sh` fills it here) and unpacked next to the output,
and the packages' sources go on `sys.path`: nothing is installed, torch is never replaced.

Sections, in order; each row is printed and appended to `OUT/rows.jsonl` the moment it
exists, and `OUT/table.txt` is rewritten, so a timeout still returns what ran:
  env      python, torch, triton, device, Megatron-core: what the rows were measured on.
  kernel   (a) each Triton kernel's invariance and accuracy (`selfcheck`), bf16 and fp32.
  trainer  (b) per tiny family, the IsoExec Megatron trainer on the device, Triton backend:
           logprobs bitwise equal scored alone, packed, packed in another order, and in
           smaller padded packs; every site records the Triton backend. And the TP-invariant
           leaves: `linear_tp_invariant` equal to the sum of its shards at TP=2 and 4.
  speed    (d) Triton kernel time / the native op at Qwen3-8B and 30B-A3B layer shapes, and
           the IsoExec trainer's scoring time / native Megatron under its own
           `batch_invariant_mode` (the upstream arm this device can run: no vLLM here).
  engine-style (c) per family and dtype, the same model driven as an engine drives its model
           (`isoexec.megatron.engine_style`: paged KV cache, prefill then one token per step,
           GDN states updated in place, MoE on the step's rows): bitwise the trainer's scoring.
           vLLM's own code on CUDA is the H100 pipeline's (`ci/gpu-pipeline.yml`).
Sections left when `--budget-s` is spent are SKIP rows.

Exit status: 1 an invariance failed, 2 a check errored or was inaccurate, 0 otherwise.
`--device cpu` under TRITON_INTERPRET=1 with `--dry-run` (tiny sizes) is how CI tests it;
`--check-import-path` only resolves the carried layout (any Python, no torch needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = Path(__file__).resolve().parent / "wheels"
SOURCES = [ROOT / "packages" / p / "src" for p in ("isoexec-contract", "isoexec-megatron")]
FAMILIES = ("tiny-dense", "tiny-moe", "tiny-gdn")
PASS, FAIL_INV, FAIL_OTHER, SKIP = "PASS", "FAIL", "ERROR", "SKIP"


# ---- the carried layout ----------------------------------------------------------------------
def carried_path(site_dir: Path) -> list[Path]:
    """Unpack every wheel of `WHEELS` into `site_dir` (once) and put it and the packages'
    sources first on `sys.path`; the entries added, in order."""
    site_dir.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(WHEELS.glob("*.whl")):
        marker = site_dir / f".{wheel.name}.unpacked"
        if not marker.exists():
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(site_dir)
            marker.touch()
    added = [*SOURCES, site_dir]
    for p in reversed(added):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    return added


def check_import_path(site_dir: Path) -> dict[str, str]:
    """Where `isoexec.*` and `megatron.core` resolve from in the carried layout, without
    importing torch (so any Python, e.g. the 3.12 under pyenv here, can check it)."""
    import importlib.util

    carried_path(site_dir)
    found = {}
    for name in ("isoexec", "megatron"):
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            raise RuntimeError(f"{name} does not resolve from the carried layout")
        found[name] = locations
    mcore = [d for d in found["megatron"] if (Path(d) / "core" / "__init__.py").exists()]
    if not mcore:
        raise RuntimeError(
            f"megatron.core is not in the carried layout ({found['megatron']}): run "
            "integration/gpu/fetch_wheels.sh first"
        )
    return {"isoexec": ", ".join(found["isoexec"]), "megatron.core": str(Path(mcore[0]) / "core")}


# ---- rows --------------------------------------------------------------------------------------
@dataclass
class Row:
    section: str
    name: str
    result: str  # PASS, FAIL (invariance), ERROR (error / inaccurate), SKIP, info, or a ratio
    detail: str

    @property
    def status(self) -> int:
        return {FAIL_INV: 1, FAIL_OTHER: 2}.get(self.result, 0)


class Sink:
    """Rows as they come: printed, appended to `rows.jsonl`, the table rewritten."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.rows = out, []
        (out / "rows.jsonl").write_text("")

    def add(self, rows: list[Row]) -> None:
        for r in rows:
            self.rows.append(r)
            print(f"[{r.section}] {r.name}: {r.result}  {r.detail}", flush=True)
            with (self.out / "rows.jsonl").open("a") as f:
                f.write(json.dumps(asdict(r)) + "\n")
        (self.out / "table.txt").write_text(format_table(self.rows) + "\n")


def format_table(rows: list[Row]) -> str:
    w = max([len(f"{r.section} {r.name}") for r in rows] + [5])
    lines = [f"{'check':<{w}}  {'result':<7} detail", "-" * (w + 40)]
    lines += [f"{f'{r.section} {r.name}':<{w}}  {r.result:<7} {r.detail}" for r in rows]
    return "\n".join(lines)


def guarded(section: str, name: str, fn: Callable[[], list[Row]]) -> list[Row]:
    """`fn`'s rows, or one ERROR row: one failing check never hides the others."""
    try:
        return fn()
    except Exception as e:  # reported in the table, not fatal
        return [Row(section, name, FAIL_OTHER, f"{type(e).__name__}: {e}"[:240])]


# ---- sections ----------------------------------------------------------------------------------
def env_rows(device: str, import_path: dict[str, str]) -> list[Row]:
    import platform

    import megatron.core
    import torch
    import triton

    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    detail = (
        f"python {platform.python_version()}, torch {torch.__version__} (CUDA "
        f"{torch.version.cuda}), triton {triton.__version__}, megatron-core "
        f"{megatron.core.__version__} from {import_path['megatron.core']}"
    )
    return [Row("env", where, "info", detail)]


def kernel_section(device: str, scale: int, only: list[str] | None) -> list[Row]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run_checks import kernel_rows

    return [Row(r.section, r.name, r.result, r.detail) for r in kernel_rows(device, scale, only)]


def tp_leaves_rows(device: str, dry: bool) -> list[Row]:
    """`linear_tp_invariant` (the whole GEMM in fixed leaves) equal to its shards' sum."""
    import torch

    from isoexec.ops import triton as xops

    m, k, n = (7, 128, 48) if dry else (513, 4096, 1024)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(m, k, generator=g).to(dtype).to(device)
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(device)
        whole = xops.linear_tp_invariant(x, w)
        same = {
            tp: torch.equal(whole, xops.tp_linear_from_shards(list(x.chunk(tp, -1)),
                                                              list(w.chunk(tp, -1))))
            for tp in (2, 4)
        }  # fmt: skip
        ok = all(same.values())
        rows.append(Row("trainer", f"tp_leaves {str(dtype)[6:]}", PASS if ok else FAIL_INV,
                        f"{m}x{k}x{n}: shards==whole {same}"))  # fmt: skip
    return rows


def truncation_rows(device: str, dry: bool) -> list[Row]:
    """The canonical truncation on the device: each row's kept set alone equals its set in a
    batch (and in a shuffled batch), and equals the CPU's for the same logits. Integer masses
    make the sums device-free; the exp and the division are the device's own."""
    import torch

    from isoexec.ops.truncation import RowTruncation, truncation_mask

    v, b = (512, 6) if dry else (151936, 16)
    g = torch.Generator().manual_seed(5)
    x = (torch.round(torch.randn(b, v, generator=g) * 6) / 2).to(device)  # ties
    temps = torch.linspace(0.5, 1.5, b).to(device)
    ks = torch.tensor([20, 0, 50, 0, 1, 0] * (b // 6 + 1))[:b].to(device)
    ps = torch.tensor([0.95, 0.9, 1.0, 1.0, 1.0, 0.5] * (b // 6 + 1))[:b].to(device)
    ms = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.05] * (b // 6 + 1))[:b].to(device)
    cut = RowTruncation(ks, ps, ms)
    batch = truncation_mask(x, temps, cut)
    alone = torch.cat([truncation_mask(x[i : i + 1], temps[i : i + 1],
                                       RowTruncation(ks[i : i + 1], ps[i : i + 1], ms[i : i + 1]))
                       for i in range(b)])  # fmt: skip
    perm = torch.randperm(b, generator=g).to(device)
    shuffled = truncation_mask(x[perm], temps[perm], RowTruncation(ks[perm], ps[perm], ms[perm]))
    cpu = truncation_mask(x.cpu(), temps.cpu(), RowTruncation(ks.cpu(), ps.cpu(), ms.cpu()))
    invariant = torch.equal(batch, alone) and torch.equal(shuffled, batch[perm])
    same_as_cpu = torch.equal(batch.cpu(), cpu)
    detail = f"{b}x{v}: row-invariant {invariant}, equal to the CPU's {same_as_cpu}"
    return [Row("kernel", "truncation", PASS if invariant else FAIL_INV, detail)]


def _sequences(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def trainer_rows(family: str, dtype_name: str, device: str, work: Path, dry: bool) -> list[Row]:
    """The IsoExec trainer of `family` on `device`, Triton backend: logprobs bitwise equal
    however the sequences are batched, and a contract all on Triton."""
    import torch

    from isoexec.contract.options import IsoExecOptions
    from isoexec.megatron import build_model, megatron_parallel, trainer_contract
    from isoexec.megatron.engine_style import EngineStyleDecode
    from isoexec.megatron.scoring import score
    from isoexec.megatron.weights import load_hf_weights
    from isoexec.tools.tiny_models import make_tiny_model

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    model_dir = make_tiny_model(family, work / f"{family}-{dtype_name}", dtype=dtype_name)
    lengths = (4, 11) if dry else (5, 17, 33, 64, 130)
    with megatron_parallel(device=device):
        model = build_model(str(model_dir), isoexec=True, dtype=dtype,
                            options=IsoExecOptions(backend="triton"))  # fmt: skip
        load_hf_weights(model, str(model_dir))
        backends = {s.impl.backend for s in trainer_contract(model, str(model_dir), dtype).sites}
        seqs = _sequences(int(model.vocab_size), lengths, seed=1)
        alone = [score(model, [s])[0] for s in seqs]
        with EngineStyleDecode(model) as drive:  # (c): as an engine runs it, no vLLM
            decoded = [drive.logprobs(s, prefill=max(1, len(s) // 3)) for s in seqs]
        ways = {
            "packed": score(model, seqs),
            "reversed": score(model, seqs[::-1])[::-1],
            "small packs, padded": score(model, seqs, max_tokens=max(lengths) + 1,
                                         pad_to_multiple=16),
        }  # fmt: skip
    same = {
        way: all(torch.equal(a, b) for a, b in zip(alone, lps, strict=True))
        for way, lps in ways.items()
    }
    ok = all(same.values()) and backends == {"triton"}
    detail = f"{len(seqs)} seqs, alone == {same}; site backends {sorted(backends)}"
    dec = [torch.equal(a, b) for a, b in zip(alone, decoded, strict=True)]
    dec_detail = (
        f"paged KV cache, prefill len//3 then 1 token/step, GDN state in place: "
        f"{sum(dec)}/{len(dec)} seqs bitwise the trainer's scoring"
    )
    return [
        Row("trainer", f"{family} {dtype_name}", PASS if ok else FAIL_INV, detail),
        Row("engine-style", f"{family} {dtype_name}", PASS if all(dec) else FAIL_INV, dec_detail),
    ]


def _time_s(fn: Callable[[], object], device: str, reps: int) -> float:
    import statistics

    import torch

    fn()  # compile / warm up
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


UPSTREAM_BI_CPU = (
    "refused on CPU: Megatron-core's batch_invariant_mode kernels are CUDA-only (they assert "
    "`input.is_cuda`), and vLLM's VLLM_BATCH_INVARIANT needs a CUDA vLLM"
)


def upstream_bi_rows(family: str, device: str, work: Path, dry: bool) -> list[Row]:
    """IsoExec's trainer scoring time / native Megatron's under `batch_invariant_mode` (bf16,
    one sequence per forward on both, the native path's only mode), and whether the native
    trainer's logprobs keep their bits across the mode's on and off."""
    if device != "cuda":
        return [Row("speed", f"trainer {family} / upstream-bi", SKIP, UPSTREAM_BI_CPU)]
    import torch

    from isoexec.contract.options import IsoExecOptions
    from isoexec.megatron import build_model, megatron_parallel
    from isoexec.megatron.scoring import score
    from isoexec.megatron.upstream_bi import (
        megatron_batch_invariant_mode,
        transformer_engine_patched,
    )
    from isoexec.megatron.weights import load_hf_weights
    from isoexec.tools.tiny_models import make_tiny_model

    model_dir = str(make_tiny_model(family, work / f"{family}-bi", dtype="bfloat16"))
    with megatron_parallel(device=device):
        iso = build_model(model_dir, isoexec=True, dtype=torch.bfloat16,
                          options=IsoExecOptions(backend="triton"))  # fmt: skip
        native = build_model(model_dir, isoexec=False, dtype=torch.bfloat16)
        for m in (iso, native):
            load_hf_weights(m, model_dir)
        seqs = _sequences(int(iso.vocab_size), (9, 33) if dry else (64, 256, 1024), seed=2)
        reps = 1 if dry else 5
        t_iso = _time_s(lambda: score(iso, seqs, max_tokens=1), device, reps)
        off = score(native, seqs)
        with megatron_batch_invariant_mode():
            t_bi = _time_s(lambda: score(native, seqs), device, reps)
            on = score(native, seqs)
    changed = sum(not torch.equal(a, b) for a, b in zip(off, on, strict=True))
    detail = (
        f"{t_iso * 1e3:.1f} ms IsoExec vs {t_bi * 1e3:.1f} ms native+batch_invariant_mode "
        f"(lengths {[len(s) for s in seqs]}); the mode changed {changed}/{len(seqs)} native "
        "sequences' logprobs"
    )
    if not transformer_engine_patched():
        detail += "; no Transformer Engine here: the mode's aten kernels only (TE steps skipped)"
    return [Row("speed", f"trainer {family} / upstream-bi", f"{t_iso / t_bi:.2f}x", detail)]


def layer_speed_rows() -> list[Row]:
    """Triton / native at Qwen3-8B and Qwen3-30B-A3B layer shapes (bf16, CUDA)."""
    import torch
    import torch.nn.functional as F

    from isoexec.ops import triton as x

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*s, device=dev, generator=g) * scale).to(bf)

    t = 2048
    xs, xd = r(t, 4096), r(t, 12288)
    gate_up, down = r(2 * 12288, 4096, scale=0.02), r(4096, 12288, scale=0.02)  # 8B MLP
    h, e, k, inter = 2048, 128, 8, 768  # 30B-A3B MoE
    xm = r(t, h)
    w13, w2 = r(e, 2 * inter, h, scale=0.02), r(e, h, inter, scale=0.02)
    logits = torch.randn(t, e, device=dev, generator=g)

    def native_moe() -> torch.Tensor:
        w, ids = torch.topk(torch.softmax(logits, -1), k)
        out = torch.zeros(t, h, device=dev, dtype=torch.float32)
        for ex in range(e):
            rows, slot = (ids == ex).nonzero(as_tuple=True)
            if rows.numel():
                a, b = F.linear(xm[rows], w13[ex]).chunk(2, -1)
                y = F.linear(F.silu(a) * b, w2[ex]).float()
                out.index_add_(0, rows, y * w[rows, slot, None])
        return out.to(bf)

    def iso_moe() -> torch.Tensor:
        w, ids = x.moe_router(logits, k, renormalize=False)
        return x.moe_combine(xm, w, ids, w13, w2)

    cases = [
        ("linear 8B gate_up", lambda: x.linear(xs, gate_up), lambda: F.linear(xs, gate_up)),
        ("linear 8B down", lambda: x.linear(xd, down), lambda: F.linear(xd, down)),
        ("moe 30B-A3B", iso_moe, native_moe),
    ]
    rows = []
    for name, tri, native in cases:
        with torch.no_grad():
            t_tri, t_nat = _time_s(tri, dev, 10), _time_s(native, dev, 10)
        rows.append(Row("speed", name, f"{t_tri / t_nat:.2f}x",
                        f"{t_tri * 1e3:.3f} vs {t_nat * 1e3:.3f} ms (T={t})"))  # fmt: skip
    return rows


# ---- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "device-check-out")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--scale", type=int, default=4, help="batch-size scale of the kernel checks")
    p.add_argument("--kernels", default="", help="comma list of kernel checks (default: all)")
    p.add_argument("--budget-s", type=float, default=330.0, help="no new section after this")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes (the CPU rehearsal)")
    p.add_argument(
        "--check-import-path",
        action="store_true",
        help="only resolve the carried layout and print it (no torch needed)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    site = out / "site-packages"
    if args.check_import_path:
        print(json.dumps(check_import_path(site)), flush=True)
        return 0
    start = time.monotonic()
    import_path = check_import_path(site)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: no CUDA device; nothing to check (exit 0)", flush=True)
        return 0
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs the Triton kernels under TRITON_INTERPRET=1: set it")
    sink = Sink(out)
    work = out / "models"
    fams = [f for f in args.families.split(",") if f]
    dtypes = [d for d in args.dtypes.split(",") if d]
    only = [k for k in args.kernels.split(",") if k] or None

    def spent() -> bool:
        return time.monotonic() - start > args.budget_s

    sections: list[tuple[str, str, Callable[[], list[Row]]]] = [
        ("env", "environment", lambda: env_rows(args.device, import_path)),
        ("kernel", "selfcheck", lambda: kernel_section(args.device, args.scale, only)),
        ("trainer", "tp_leaves", lambda: tp_leaves_rows(args.device, args.dry_run)),
        ("kernel", "truncation", lambda: truncation_rows(args.device, args.dry_run)),
    ]
    for fam in fams:
        for dt in dtypes:
            sections.append(("trainer", f"{fam} {dt}", lambda f=fam, d=dt: trainer_rows(
                f, d, args.device, work, args.dry_run)))  # fmt: skip
    if args.device == "cuda":
        sections.append(("speed", "layer shapes", layer_speed_rows))
    sections.append(
        (
            "speed",
            "trainer tiny-dense / upstream-bi",
            lambda: upstream_bi_rows("tiny-dense", args.device, work, args.dry_run),
        )
    )
    for section, name, fn in sections:
        if spent():
            sink.add([Row(section, name, SKIP, f"time budget ({args.budget_s:.0f} s) spent")])
            continue
        sink.add(guarded(section, name, fn))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    total = time.monotonic() - start
    print(f"\n{format_table(sink.rows)}\n(total {total:.0f} s)", flush=True)
    statuses = [r.status for r in sink.rows]
    return 1 if 1 in statuses else (2 if 2 in statuses else 0)


if __name__ == "__main__":
    sys.exit(main())
