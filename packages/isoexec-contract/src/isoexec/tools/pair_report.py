"""What `isoexec pair` reports: per-arm token statistics, the run's identity, a table, a JSON
file and a plot — the numbers and the picture a user attaches to a bug report.

Statistics per arm (and per sampling temperature), over every sampled token, with `lp_t` the
trainer's and `lp_e` the engine's logprob and `r = exp(lp_t - lp_e)` the importance ratio:
bitwise-equal count and fraction, max and mean |lp_t - lp_e|, min and max r, and the k3
estimate of KL(engine ‖ trainer), mean(r - 1 - log r) (Schulman's low-variance estimator for
samples drawn from the engine: non-negative, exactly 0 when every token is bitwise equal).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from isoexec.contract import strict_json

RESULTS_FILE = "results.json"
PLOT_FILE = "pair.png"


@dataclass(frozen=True)
class TokenStats:
    tokens: int
    bitwise_equal: int
    equal_fraction: float
    max_abs_diff: float
    mean_abs_diff: float
    ratio_min: float
    ratio_max: float
    kl_k3: float

    @staticmethod
    def of(train: Any, eng: Any) -> TokenStats:
        """Statistics of aligned fp32 logprob tensors (float64 arithmetic for the ratios)."""
        n = int(train.numel())
        if n == 0:
            nan = float("nan")
            return TokenStats(0, 0, 0.0, nan, nan, nan, nan, nan)
        diff = train.double() - eng.double()
        ratio = diff.exp()
        equal = int((train == eng).sum())
        return TokenStats(
            tokens=n,
            bitwise_equal=equal,
            equal_fraction=equal / n,
            max_abs_diff=float(diff.abs().max()),
            mean_abs_diff=float(diff.abs().mean()),
            ratio_min=float(ratio.min()),
            ratio_max=float(ratio.max()),
            kl_k3=float((ratio - 1 - diff).mean()),
        )


@dataclass(frozen=True)
class FullVocabStats:
    """Whole processed rows of every sampled position, trainer against engine: how many rows
    are bitwise equal, and the max |Δ| over every entry (entries -inf on both sides, outside
    the kept set, are equal; -inf on one side only is an infinite difference)."""

    rows: int
    rows_bitwise: int
    max_abs_diff: float

    @staticmethod
    def of(train_rows: Any, engine_rows: Any) -> FullVocabStats:
        import torch

        if train_rows.shape != engine_rows.shape:
            raise ValueError(f"rows {tuple(train_rows.shape)} vs {tuple(engine_rows.shape)}")
        same = train_rows == engine_rows
        diff = torch.where(same, 0.0, (train_rows.double() - engine_rows.double()).abs())
        worst = float(diff.max()) if diff.numel() else float("nan")
        return FullVocabStats(int(train_rows.shape[0]), int(same.all(-1).sum()), worst)

    @property
    def equal_fraction(self) -> float:
        return self.rows_bitwise / self.rows if self.rows else 0.0


@dataclass(frozen=True)
class ArmResult:
    arm: str  # "isoexec" or "stock"
    handshake: str  # "MATCH <hash>" or "n/a (stock arm)"
    tokens: int
    bitwise_equal: int
    max_abs_diff: float
    max_ratio_dev: float  # max |r - 1|
    stats: TokenStats | None = None
    by_temperature: dict[str, TokenStats] = field(default_factory=dict)
    # The run's identity: both sides' contract hashes, the handshake verdict, the weight
    # fingerprints (None where a side could not say, e.g. a sharded engine).
    contract_hashes: dict[str, str | None] = field(default_factory=dict)
    verdict: str | None = None
    weight_fingerprints: dict[str, str | None] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)  # engine_start, sampling, scoring
    locate: str | None = None  # the `isoexec locate` report, when --locate traced this arm
    error: str | None = None  # the stock arm could not run (e.g. a kernel stock vLLM lacks)
    full_vocab: FullVocabStats | None = None  # with --full-vocab: whole rows compared
    # Per-token |Δ logprob| and ratio, for the plot (not written to the JSON).
    abs_diffs: tuple[float, ...] = field(default=(), repr=False)
    ratios: tuple[float, ...] = field(default=(), repr=False)

    @property
    def equal_fraction(self) -> float:
        return self.bitwise_equal / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["abs_diffs"], out["ratios"]
        return out


def token_temperatures(completions: Sequence[Any], temps: Sequence[float]) -> list[float]:
    """Each sampled token's temperature, in `pair.align`'s order (grouped by temperature)."""
    out: list[float] = []
    for temp in sorted(set(temps)):
        for c, t in zip(completions, temps, strict=True):
            if t == temp:
                out += [temp] * len(c.token_ids)
    return out


def arm_result(
    arm: str,
    handshake: str,
    train: Any,
    eng: Any,
    token_temps: Sequence[float],
    **identity: Any,
) -> ArmResult:
    """The arm's result from aligned (trainer, engine) logprobs; `identity`: contract_hashes,
    verdict, weight_fingerprints, timings_s, locate."""
    import torch

    stats = TokenStats.of(train, eng)
    temps = torch.tensor(list(token_temps), dtype=torch.float64)
    if temps.numel() != train.numel():
        raise ValueError(f"{temps.numel()} token temperatures for {train.numel()} tokens")
    by_t = {
        f"{t:g}": TokenStats.of(train[temps == t], eng[temps == t])
        for t in sorted(set(token_temps))
    }
    diff = train.double() - eng.double()
    return ArmResult(
        arm=arm,
        handshake=handshake,
        tokens=stats.tokens,
        bitwise_equal=stats.bitwise_equal,
        max_abs_diff=stats.max_abs_diff,
        max_ratio_dev=float((diff.exp() - 1).abs().max()) if stats.tokens else float("nan"),
        stats=stats,
        by_temperature=by_t,
        abs_diffs=tuple(diff.abs().tolist()),
        ratios=tuple(diff.exp().tolist()),
        **identity,
    )


def format_table(
    model: str, dtype: str, results: Sequence[ArmResult], sampling: Mapping[str, Any] | None = None
) -> str:
    """The table; `sampling`: the run's truncation settings, shown in the heading."""
    head = f"isoexec pair — model {model}, dtype {dtype}"
    if sampling:
        head += ", sampling " + " ".join(f"{k}={v}" for k, v in sampling.items())
    rows = [
        f"{'arm':<8} {'T':>4} {'handshake':<20} {'tokens':>6} {'bitwise equal':>14} "
        f"{'max |Δ lp|':>10} {'mean |Δ lp|':>11} {'ratio min':>10} {'ratio max':>10} "
        f"{'KL k3':>9}"
    ]
    for r in results:
        if r.error is not None:
            rows.append(f"{r.arm:<8} failed: {r.error}")
            continue
        lines = [("all", r.stats), *r.by_temperature.items()]
        for label, s in lines:
            if s is None:
                continue
            hs = r.handshake if label == "all" else ""
            rows.append(
                f"{r.arm if label == 'all' else '':<8} {label:>4} {hs:<20} {s.tokens:>6} "
                f"{f'{s.bitwise_equal} ({100 * s.equal_fraction:.1f}%)':>14} "
                f"{s.max_abs_diff:>10.3e} {s.mean_abs_diff:>11.3e} {s.ratio_min:>10.6f} "
                f"{s.ratio_max:>10.6f} {s.kl_k3:>9.2e}"
            )
    identity = []
    for r in results:
        if r.error is None and (r.contract_hashes or r.weight_fingerprints):
            ch = {k: (v or "-")[:12] for k, v in r.contract_hashes.items()}
            fp = {k: (v or "-")[:12] for k, v in r.weight_fingerprints.items()}
            tm = ", ".join(f"{k} {v:.1f}s" for k, v in r.timings_s.items())
            identity.append(f"{r.arm}: contracts {ch} verdict {r.verdict or '-'}; "
                            f"weights {fp}; {tm}")  # fmt: skip
    for r in results:
        if r.error is None and r.full_vocab is not None:
            fv = r.full_vocab
            rows.append(f"{r.arm:<8} full vocab: {fv.rows_bitwise}/{fv.rows} rows bitwise "
                        f"({100 * fv.equal_fraction:.1f}%), max |Δ| over all entries "
                        f"{fv.max_abs_diff:.3e}")  # fmt: skip
    return "\n".join([head, *rows, *identity])


def progress(arm: str, what: str) -> None:
    print(f"isoexec pair [{arm}]: {what}", flush=True)


def write_results(
    out: Path,
    model: str,
    dtype: str,
    results: Sequence[ArmResult],
    sampling: Mapping[str, Any] | None = None,
) -> Path:
    path = out / RESULTS_FILE
    doc = {"model": model, "dtype": dtype, "sampling": dict(sampling or {}),
           "arms": [r.to_json() for r in results]}  # fmt: skip
    path.write_text(strict_json.dumps(doc))
    return path


def write_plot(out: Path, model: str, dtype: str, results: Sequence[ArmResult]) -> Path | None:
    """`pair.png`: the |Δ logprob| and importance-ratio distributions of each arm (IsoExec
    against stock). None (and the reason said by the caller) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [r for r in results if r.error is None and r.tokens]
    fig, (ax_d, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"isoexec": "tab:green", "stock": "tab:red"}
    floor = 1e-12  # |Δ| = 0 (bitwise equal) is drawn at this floor, labelled as such
    for r in arms:
        label = f"{r.arm}: {r.bitwise_equal}/{r.tokens} bitwise"
        ax_d.hist([max(d, floor) for d in r.abs_diffs], bins=_log_bins(floor), alpha=0.6,
                  color=colors.get(r.arm), label=label)  # fmt: skip
        ax_r.hist([x - 1 for x in r.ratios], bins=_symlog_bins(floor), alpha=0.6,
                  color=colors.get(r.arm),
                  label=f"{r.arm}: [{r.stats.ratio_min:.6f}, {r.stats.ratio_max:.6f}]"
                  if r.stats else r.arm)  # fmt: skip
    ax_d.set_xscale("log")
    ax_r.set_xscale("symlog", linthresh=floor)
    ax_r.set_xticks([-1, -1e-4, -1e-8, 0, 1e-8, 1e-4, 1])
    ax_d.set_xlabel("|Δ logprob| per token (trainer − engine); 0 drawn at 1e-12")
    ax_d.set_ylabel("tokens")
    ax_r.set_xlabel("importance ratio − 1 per token (symmetric log; exactly 1 at the centre)")
    for ax in (ax_d, ax_r):
        ax.legend(fontsize=8)
    fig.suptitle(f"isoexec pair — {model}, {dtype}")
    fig.tight_layout()
    path = out / PLOT_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _log_bins(floor: float) -> list[float]:
    return [floor * 10 ** (k / 2) for k in range(0, 25)]


def _symlog_bins(floor: float) -> list[float]:
    """Bin edges from -1 to 1 with a bin [-floor, floor] holding the exact ratio 1."""
    pos = _log_bins(floor)
    return [-x for x in reversed(pos)] + pos


__all__ = [
    "PLOT_FILE",
    "RESULTS_FILE",
    "ArmResult",
    "TokenStats",
    "arm_result",
    "format_table",
    "token_temperatures",
    "write_plot",
    "write_results",
]
