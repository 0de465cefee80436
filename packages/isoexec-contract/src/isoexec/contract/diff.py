"""Explain why two contracts differ: first cause first, consequences collapsed.

A wrong torch version or dtype makes every site suspect, so global fields (schema, model,
dtypes, device) come first. Site differences follow in model order; a change repeated over
many sites (one kernel bumped everywhere) collapses into one line, so a user reads one cause,
not forty consequences::

    layers.3.mlp.fc1 (linear): impl version 3 → 4
    impl version 3 → 4; source fingerprint 1a2b3c4d5e6f… → 0f9e8d7c6b5a… at 28 sites (linear):
        layers.0.mlp.fc1, layers.1.mlp.fc1, layers.2.mlp.fc1 … layers.27.mlp.fc1
"""

from __future__ import annotations

from dataclasses import dataclass

from isoexec.contract.contract import Contract, SiteRecord, site_sort_key

# Site fields in the order a reader wants them: what runs, then how it is tuned.
_SITE_FIELDS: tuple[tuple[str, str], ...] = (
    ("op", "op"),
    ("impl_id", "impl"),
    ("version", "impl version"),
    ("backend", "kernel backend"),
    ("source_fingerprint", "source fingerprint"),
)
ABSENT = "(absent)"


@dataclass(frozen=True)
class Difference:
    """One differing field: `section` is schema/model/dtypes/device/site."""

    section: str
    site: str | None
    field: str
    left: str
    right: str


@dataclass(frozen=True)
class ContractDiff:
    """The differences between two contracts and their readable, grouped rendering."""

    left_hash: str
    right_hash: str
    differences: tuple[Difference, ...]
    lines: tuple[str, ...]

    @property
    def equal(self) -> bool:
        return self.left_hash == self.right_hash

    @property
    def differing_sites(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for d in self.differences:
            if d.site is not None:
                seen.setdefault(d.site, None)
        return tuple(seen)

    def summary(self) -> str:
        if self.equal:
            return f"contracts are equal ({self.left_hash})"
        n_sites = len(self.differing_sites)
        return (
            f"contracts differ: {len(self.differences)} field(s), {n_sites} site(s); "
            f"left {self.left_hash[:12]}…, right {self.right_hash[:12]}…"
        )

    def __str__(self) -> str:
        return "\n".join(self.lines)


def diff(a: Contract, b: Contract, *, max_listed: int = 3) -> ContractDiff:
    """Compare `a` (left) with `b` (right). `max_listed` site names are shown per collapsed
    group (plus the last one)."""
    if a.hash == b.hash:
        return ContractDiff(a.hash, b.hash, (), ())
    diffs: list[Difference] = []
    lines: list[str] = []

    def glob(section: str, name: str, left: object, right: object) -> None:
        if left != right:
            d = Difference(section, None, name, _fmt(left), _fmt(right))
            diffs.append(d)
            lines.append(f"{section}.{name}: {d.left} → {d.right}")

    glob("schema", "version", a.schema_version, b.schema_version)
    glob("model", "architecture", a.model.architecture, b.model.architecture)
    glob("model", "config_digest", a.model.config_digest, b.model.config_digest)
    _layer_kinds(a.model.layer_kinds, b.model.layer_kinds, diffs, lines)
    for f in ("params", "activations", "residual", "kv_cache", "recurrent_state", "logprobs"):
        glob("dtypes", f, getattr(a.dtypes, f), getattr(b.dtypes, f))
    for f in ("torch", "triton", "cuda", "device_kind", "arch", "threads"):
        glob("device", f, getattr(a.device, f), getattr(b.device, f))
    for p in sorted(set(a.device.patches) ^ set(b.device.patches)):  # each patch by name
        glob("device", f"patches[{p}]", p in a.device.patches, p in b.device.patches)
    for f in ("tp", "pp", "ep", "dp"):
        glob("parallel", f, getattr(a.parallel, f), getattr(b.parallel, f))
    glob("speculation", "verification", a.speculation, b.speculation)

    # Sites: model order of the left side, right-only sites merged in by the right's order.
    left = {s.name: s for s in a.sites}
    right = {s.name: s for s in b.sites}
    order = _merged_order([s.name for s in a.sites], [s.name for s in b.sites])
    groups: dict[tuple[tuple[str, str, str], ...], list[str]] = {}
    group_op: dict[tuple[tuple[str, str, str], ...], set[str]] = {}
    for name in order:
        changes = _site_changes(left.get(name), right.get(name))
        if not changes:
            continue
        for label, lv, rv in changes:
            diffs.append(Difference("site", name, label, lv, rv))
        key = tuple(changes)
        groups.setdefault(key, []).append(name)
        s = left.get(name) or right[name]
        group_op.setdefault(key, set()).add(s.impl.op)
    for key, names in groups.items():
        ops = group_op[key]
        op = f" ({next(iter(ops))})" if len(ops) == 1 else ""
        text = "; ".join(_change_text(c) for c in key)
        if len(names) == 1:
            lines.append(f"{names[0]}{op}: {text}")
        else:
            shown = ", ".join(names[:max_listed])
            if len(names) > max_listed + 1:
                shown += f" … {names[-1]}"
            elif len(names) == max_listed + 1:
                shown += f", {names[-1]}"
            lines.append(f"{text} at {len(names)} sites{op}: {shown}")
    return ContractDiff(a.hash, b.hash, tuple(diffs), tuple(lines))


def _change_text(change: tuple[str, str, str]) -> str:
    label, lv, rv = change
    if label == "site":
        return f"site {lv} → {rv}"
    return f"{label} {lv} → {rv}"


def _site_changes(ls: SiteRecord | None, rs: SiteRecord | None) -> list[tuple[str, str, str]]:
    if ls is None or rs is None:
        return [("site", _describe(ls), _describe(rs))]
    out: list[tuple[str, str, str]] = []
    for attr, label in _SITE_FIELDS:
        lv, rv = getattr(ls.impl, attr), getattr(rs.impl, attr)
        if lv != rv:
            out.append((label, _fmt(lv), _fmt(rv)))
    lp, rp = ls.impl.param_dict(), rs.impl.param_dict()
    for k in sorted(set(lp) | set(rp)):
        if lp.get(k) != rp.get(k):
            out.append((f"param {k}", _fmt(lp.get(k, ABSENT)), _fmt(rp.get(k, ABSENT))))
    if ls.tp != rs.tp:
        out.append(("tp", ls.tp, rs.tp))
    return out


def _describe(s: SiteRecord | None) -> str:
    if s is None:
        return ABSENT
    return f"{s.impl.op} {s.impl.impl_id} v{s.impl.version}"


def _layer_kinds(
    lk: tuple[str, ...], rk: tuple[str, ...], diffs: list[Difference], lines: list[str]
) -> None:
    if lk == rk:
        return
    if len(lk) != len(rk):
        d = Difference("model", None, "layer_kinds", f"{len(lk)} layers", f"{len(rk)} layers")
        diffs.append(d)
        lines.append(f"model.layer_kinds: {d.left} → {d.right}")
    idx = [i for i in range(min(len(lk), len(rk))) if lk[i] != rk[i]]
    if idx:
        i = idx[0]
        more = f" ({len(idx)} layers differ)" if len(idx) > 1 else ""
        diffs.append(Difference("model", None, f"layer_kinds[{i}]", lk[i], rk[i]))
        lines.append(f"model.layer_kinds[{i}]: {lk[i]} → {rk[i]}{more}")


def _merged_order(left: list[str], right: list[str]) -> list[str]:
    """Left order, with each right-only name placed after its right-side predecessor."""
    out = list(left)
    present = set(left)
    for i, name in enumerate(right):
        if name in present:
            continue
        pos = len(out)
        for prev in reversed(right[:i]):
            if prev in present:
                pos = out.index(prev) + 1
                break
        else:
            # No predecessor: place by numeric-aware name among left names.
            pos = next(
                (j for j, n in enumerate(out) if site_sort_key(n) > site_sort_key(name)),
                len(out),
            )
        out.insert(pos, name)
        present.add(name)
    return out


def _fmt(v: object) -> str:
    if v is None:
        return "none"
    if isinstance(v, str):
        if v == "":
            return '""'
        if len(v) > 16 and all(c in "0123456789abcdef" for c in v):
            return v[:12] + "…"  # a hash: the prefix is enough to tell two apart
        return v
    return str(v)
