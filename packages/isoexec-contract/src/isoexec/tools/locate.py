"""Align two traces and find the first site where they part ways, in execution order.

Why the *first*: one changed rounding at one site changes every later site and token, so the
40 downstream differences say nothing; the earliest one is the cause (or its closest symptom).
Order: sites in model execution order (layer by layer, then `sites.model_sites` order within a
layer, then final norm, lm head, logprobs), then absolute token position, then sequence.
Only rows recorded on both sides (same sequence, site, position) are compared; sites that one
side does not record are listed, with its reason, never silently passed over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from isoexec.contract.trace import Key, Row, Trace, TraceFormatError, site_layer


@dataclass(frozen=True)
class Divergence:
    site: str
    op: str
    layer: int | None
    pos: int
    seq: int
    a: Row
    b: Row
    max_abs_diff: float | None  # over the row, when both sides stored values
    differing: int | None  # elements that differ, when both sides stored values
    rows_differing: int  # rows of this site that differ (all positions, all sequences)
    rows_compared: int  # rows of this site compared

    @property
    def where(self) -> str:
        layer = f"layer {self.layer}" if self.layer is not None else "after the last layer"
        return f"{layer}, site {self.site} ({self.op}), token position {self.pos}"


@dataclass(frozen=True)
class LocateResult:
    a_side: str
    b_side: str
    first: Divergence | None
    sites_compared: int
    rows_compared: int
    sites_equal_before: int  # compared sites before the first divergent one, all rows equal
    divergent_sites: list[str] = field(default_factory=list)  # every site with a difference
    one_sided: dict[str, str] = field(default_factory=dict)  # site -> why it was not compared
    sequences: int = 0

    @property
    def diverged(self) -> bool:
        return self.first is not None


def _by_site(trace: Trace, seqs: set[int]) -> dict[str, dict[tuple[int, int], Row]]:
    out: dict[str, dict[tuple[int, int], Row]] = {}
    for (seq, site, pos), row in trace.rows.items():
        if seq in seqs:
            out.setdefault(site, {})[(pos, seq)] = row
    return out


def _rows_equal(a: Row, b: Row) -> bool:
    return a.width == b.width and a.digest == b.digest


def _size(a: Row, b: Row) -> tuple[float | None, int | None]:
    fa, fb = a.floats(), b.floats()
    if fa is None or fb is None or fa.numel() != fb.numel():
        return None, None
    diff = (fa.double() - fb.double()).abs()
    ne = fa.view(torch.int32) != fb.view(torch.int32)  # bitwise, so -0.0 vs 0.0 counts
    return float(diff.max()) if diff.numel() else 0.0, int(ne.sum())


def check_comparable(a: Trace, b: Trace) -> list[int]:
    """The sequence ids both traces hold (same tokens); `TraceFormatError` if there are none,
    if a shared id has other tokens, or if the traces are of different models."""
    if a.site_names() != b.site_names():
        sa, sb = set(a.site_names()), set(b.site_names())
        extra = sorted(sa ^ sb)[:3]
        raise TraceFormatError(
            f"the traces are of different models: site lists differ ({len(sa)} vs {len(sb)} "
            f"sites{', e.g. ' + ', '.join(extra) if extra else ', in another order'})"
        )
    common = sorted(set(a.sequences) & set(b.sequences))
    if not common:
        raise TraceFormatError(
            f"no sequence in common ({a.side}: {sorted(a.sequences)}, "
            f"{b.side}: {sorted(b.sequences)})"
        )
    for seq in common:
        if a.sequences[seq] != b.sequences[seq]:
            raise TraceFormatError(
                f"sequence {seq} has different tokens in the two traces: not the same input"
            )
    return common


def locate(a: Trace, b: Trace) -> LocateResult:
    """First divergent (site, position) between two traces; raises `TraceFormatError` when
    they cannot be aligned (different models, no common sequence, other tokens)."""
    seqs = set(check_comparable(a, b))
    ra, rb = _by_site(a, seqs), _by_site(b, seqs)
    first: Divergence | None = None
    divergent: list[str] = []
    one_sided: dict[str, str] = {}
    sites_compared = rows_compared = equal_before = 0
    for site, op in a.sites:
        rows_a, rows_b = ra.get(site, {}), rb.get(site, {})
        keys = sorted(rows_a.keys() & rows_b.keys())
        if not keys:
            one_sided[site] = _why_not_compared(site, a, b, bool(rows_a), bool(rows_b))
            continue
        sites_compared += 1
        rows_compared += len(keys)
        bad = [k for k in keys if not _rows_equal(rows_a[k], rows_b[k])]
        if not bad:
            if first is None:
                equal_before += 1
            continue
        divergent.append(site)
        if first is None:
            pos, seq = bad[0]
            ar, br = rows_a[(pos, seq)], rows_b[(pos, seq)]
            size, count = _size(ar, br)
            first = Divergence(
                site, op, site_layer(site), pos, seq, ar, br, size, count, len(bad), len(keys)
            )
    return LocateResult(
        a.side,
        b.side,
        first,
        sites_compared,
        rows_compared,
        equal_before,
        divergent,
        one_sided,
        len(seqs),
    )


def _why_not_compared(site: str, a: Trace, b: Trace, has_a: bool, has_b: bool) -> str:
    if has_a and not has_b:
        return f"only {a.side} recorded it ({b.side}: {b.untraced.get(site, 'no rows')})"
    if has_b and not has_a:
        return f"only {b.side} recorded it ({a.side}: {a.untraced.get(site, 'no rows')})"
    reason = a.untraced.get(site) or b.untraced.get(site) or "no rows on either side"
    return f"recorded on neither side ({reason})"


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def format_result(r: LocateResult) -> str:
    """The report `isoexec locate` prints."""
    lines: list[str] = []
    head = (
        f"compared {r.rows_compared} rows at {r.sites_compared} sites over "
        f"{r.sequences} sequence(s): {r.a_side} vs {r.b_side}"
    )
    if r.first is None:
        lines.append(f"no divergence: every compared row is bitwise equal ({head})")
    else:
        d = r.first
        lines.append(f"first divergence: {d.where}, sequence {d.seq}")
        lines.append(
            f"  {r.a_side:<8} digest {d.a.digest}  {d.a.dtype}[{d.a.width}]  "
            f"max|x| {_fmt(d.a.max_abs)}  rms {_fmt(d.a.rms)}"
        )
        lines.append(
            f"  {r.b_side:<8} digest {d.b.digest}  {d.b.dtype}[{d.b.width}]  "
            f"max|x| {_fmt(d.b.max_abs)}  rms {_fmt(d.b.rms)}"
        )
        if d.a.width != d.b.width:
            lines.append(f"  size: not comparable, row widths differ ({d.a.width} vs {d.b.width})")
        elif d.max_abs_diff is not None:
            lines.append(
                f"  size: max |Δ| {d.max_abs_diff:.3e}, {d.differing} of {d.a.width} elements "
                "differ in this row"
            )
        else:
            lines.append(
                f"  size: values not stored; |Δ max|x|| {abs(d.a.max_abs - d.b.max_abs):.3e}, "
                f"|Δ rms| {abs(d.a.rms - d.b.rms):.3e}"
            )
        lines.append(
            f"  at this site {d.rows_differing} of {d.rows_compared} rows differ; "
            f"{r.sites_equal_before} compared site(s) before it are bitwise equal"
        )
        later = r.divergent_sites[1:]
        if later:
            shown = ", ".join(later[:4]) + (" …" if len(later) > 4 else "")
            lines.append(f"  {len(later)} later site(s) differ too (consequences): {shown}")
        lines.append(f"  ({head})")
    if r.one_sided:
        lines.append(f"not compared ({len(r.one_sided)} site(s)):")
        lines.extend(f"  {site}: {why}" for site, why in r.one_sided.items())
    return "\n".join(lines)


__all__ = ["Divergence", "Key", "LocateResult", "check_comparable", "format_result", "locate"]
