"""Per-site traces: a digest of every site's output, per token, on one side (trainer or engine).

Why: when trainer and engine are not bitwise equal, the logprobs only say *that* they differ;
a trace of both sides, aligned by (sequence, site, absolute position), says *where* they first
part ways (`isoexec.tools.locate`). Both sides write the same format, keyed by the
framework-neutral site names of `isoexec.contract.sites`.

Recording is a session, never a mode: the side tracers (`isoexec.vllm.trace`,
`isoexec.megatron.trace`) install forward hooks only while a trace runs and remove them after,
so a side that is not tracing runs exactly as without this module.

A row is one token's output at one site, flattened to `[features]` in the layout both sides
share. Its digest is the first 8 bytes of BLAKE2b over the row as little-endian float32 (float
dtypes up to 32 bits are upcast first, which is exact and injective: equal digests ⇔ equal
bits for two rows of the same dtype). Magnitude statistics (max |x|, RMS) and, optionally, the
float32 values themselves come along so `locate` can say how large a difference is.

File: JSON (gzip when the name ends in `.gz`), see `Trace.to_dict`.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from isoexec.contract.architectures import text_config
from isoexec.contract.sites import model_sites

FORMAT = "isoexec-trace"
VERSION = 1
DIGEST_BYTES = 8
_HEX = re.compile(r"^[0-9a-f]{16}$")
_LAYER = re.compile(r"^layers\.(\d+)\.")


class TraceFormatError(ValueError):
    """A trace file that cannot be read or does not follow the format (bad input)."""


def site_layer(site: str) -> int | None:
    """Layer index of a `layers.N.…` site; None for model-level sites (final_norm, lm_head…)."""
    m = _LAYER.match(site)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Row:
    """One token's output at one site."""

    digest: str  # 16 hex digits
    dtype: str  # the dtype the side computed in, e.g. "bfloat16"
    width: int  # features in the row
    max_abs: float
    rms: float
    values: bytes | None = None  # float32 little-endian, `width` of them, when stored

    def floats(self) -> torch.Tensor | None:
        if self.values is None:
            return None
        return torch.frombuffer(bytearray(self.values), dtype=torch.float32)


def _hashable(rows: torch.Tensor) -> torch.Tensor:
    rows = rows.detach().to("cpu")
    if rows.is_floating_point() and rows.element_size() <= 4:
        rows = rows.float()
    return rows.contiguous()


def digest_rows(rows: torch.Tensor) -> list[str]:
    """Digest of every row of a 2-D tensor (see the module doc)."""
    flat = _hashable(rows)
    raw = flat.view(torch.uint8).reshape(flat.shape[0], -1).numpy()
    return [hashlib.blake2b(r.tobytes(), digest_size=DIGEST_BYTES).hexdigest() for r in raw]


def make_rows(rows: torch.Tensor, *, store_values: bool) -> list[Row]:
    """`Row`s of a `[N, features]` tensor: digests, statistics and optionally the values."""
    if rows.dim() != 2:
        raise ValueError(f"rows must be [N, features], got shape {tuple(rows.shape)}")
    dtype = str(rows.dtype).removeprefix("torch.")
    digests = digest_rows(rows)
    f64 = rows.detach().to("cpu", torch.float64)
    max_abs = f64.abs().amax(dim=1).tolist() if rows.shape[1] else [0.0] * rows.shape[0]
    rms = f64.square().mean(dim=1).sqrt().tolist() if rows.shape[1] else [0.0] * rows.shape[0]
    values: list[bytes | None] = [None] * rows.shape[0]
    if store_values and rows.is_floating_point():
        f32 = rows.detach().to("cpu", torch.float32).contiguous()
        raw = f32.view(torch.uint8).reshape(rows.shape[0], -1).numpy()
        values = [r.tobytes() for r in raw]
    return [
        Row(d, dtype, int(rows.shape[1]), float(m), float(s), v)
        for d, m, s, v in zip(digests, max_abs, rms, values, strict=True)
    ]


Key = tuple[int, str, int]  # (sequence id, site, absolute position)


@dataclass
class Trace:
    """One side's trace: sites in execution order, the traced sequences, and rows by key.

    `untraced` names the sites this side does not record, with the reason, so `locate` can
    say what it could not compare instead of silently skipping it.
    """

    side: str
    sites: list[tuple[str, str]]  # (site, op) in execution order (`sites.model_sites`)
    model: dict[str, Any] = field(default_factory=dict)
    sequences: dict[int, list[int]] = field(default_factory=dict)
    rows: dict[Key, Row] = field(default_factory=dict)
    untraced: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_model(cls, side: str, hf_config: Mapping[str, Any], dtype: str) -> Trace:
        sites = [(s.name, s.op) for s in model_sites(hf_config)]
        model = {
            "architecture": (hf_config.get("architectures") or ["?"])[0],
            "num_layers": int(text_config(hf_config)["num_hidden_layers"]),
            "dtype": dtype,
        }
        return cls(side=side, sites=sites, model=model)

    # ---- recording --------------------------------------------------------------------------
    def begin_sequence(self, seq: int, tokens: Sequence[int]) -> None:
        if seq in self.sequences:
            raise ValueError(f"sequence {seq} is already in the trace")
        self.sequences[seq] = [int(t) for t in tokens]

    def record(
        self,
        seq: int,
        site: str,
        positions: Sequence[int],
        rows: torch.Tensor,
        *,
        store_values: bool = True,
    ) -> None:
        """Record `rows` [len(positions), features] of `site` at those absolute positions."""
        if rows.shape[0] != len(positions):
            raise ValueError(f"{site}: {rows.shape[0]} rows for {len(positions)} positions")
        for pos, row in zip(positions, make_rows(rows, store_values=store_values), strict=True):
            self.rows[(seq, site, int(pos))] = row

    def site_names(self) -> list[str]:
        return [s for s, _ in self.sites]

    # ---- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        order = {s: i for i, (s, _) in enumerate(self.sites)}
        rows = []
        for (seq, site, pos), r in sorted(
            self.rows.items(), key=lambda kv: (order.get(kv[0][1], -1), kv[0][2], kv[0][0])
        ):
            d: dict[str, Any] = {
                "seq": seq,
                "site": site,
                "pos": pos,
                "digest": r.digest,
                "dtype": r.dtype,
                "width": r.width,
                "max_abs": r.max_abs,
                "rms": r.rms,
            }
            if r.values is not None:
                d["values"] = base64.b64encode(r.values).decode("ascii")
            rows.append(d)
        return {
            "format": FORMAT,
            "version": VERSION,
            "side": self.side,
            "model": self.model,
            "sites": [[s, op] for s, op in self.sites],
            "untraced": dict(self.untraced),
            "sequences": [{"id": i, "tokens": t} for i, t in sorted(self.sequences.items())],
            "rows": rows,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        """Validate and load; every problem is a `TraceFormatError` naming the field."""
        return _parse(data)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if path.name.endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
        return path

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise TraceFormatError(f"{path}: cannot read: {e.strerror or e}") from None
        try:
            if raw[:2] == b"\x1f\x8b":
                raw = gzip.decompress(raw)
            data = json.loads(raw)
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TraceFormatError(f"{path}: not a trace file (not JSON: {e})") from None
        try:
            return _parse(data)
        except TraceFormatError as e:
            raise TraceFormatError(f"{path}: {e}") from None


# ---- validation ------------------------------------------------------------------------------
def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise TraceFormatError(msg)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _parse(data: Any) -> Trace:
    _need(isinstance(data, dict), "not a trace (top level is not an object)")
    _need(
        data.get("format") == FORMAT,
        f"not a trace (format is {data.get('format')!r}, expected {FORMAT!r})",
    )
    _need(
        data.get("version") == VERSION,
        f"trace version {data.get('version')!r} is not supported (this reader: {VERSION})",
    )
    for key in ("side", "model", "sites", "sequences", "rows"):
        _need(key in data, f"missing field {key!r}")
    side = data["side"]
    _need(isinstance(side, str) and bool(side), "side must be a non-empty string")
    _need(isinstance(data["model"], dict), "model must be an object")
    sites = data["sites"]
    _need(isinstance(sites, list) and bool(sites), "sites must be a non-empty list")
    parsed_sites: list[tuple[str, str]] = []
    for i, s in enumerate(sites):
        ok = isinstance(s, list) and len(s) == 2 and all(isinstance(x, str) for x in s)
        _need(ok, f"sites[{i}] must be [site, op]")
        parsed_sites.append((s[0], s[1]))
    names = {s for s, _ in parsed_sites}
    _need(len(names) == len(parsed_sites), "sites lists a site twice")
    untraced = data.get("untraced", {})
    _need(
        isinstance(untraced, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in untraced.items()),
        "untraced must map site names to reasons",
    )
    seqs: dict[int, list[int]] = {}
    _need(isinstance(data["sequences"], list), "sequences must be a list")
    for i, s in enumerate(data["sequences"]):
        _need(isinstance(s, dict), f"sequences[{i}] must be an object")
        sid, toks = s.get("id"), s.get("tokens")
        _need(_is_int(sid), f"sequences[{i}].id must be an integer")
        _need(sid not in seqs, f"sequences[{i}]: id {sid} appears twice")
        _need(
            isinstance(toks, list) and bool(toks) and all(_is_int(t) for t in toks),
            f"sequences[{i}].tokens must be a non-empty list of token ids",
        )
        seqs[sid] = toks
    rows: dict[Key, Row] = {}
    _need(isinstance(data["rows"], list), "rows must be a list")
    for i, r in enumerate(data["rows"]):
        where = f"rows[{i}]"
        _need(isinstance(r, dict), f"{where} must be an object")
        for key in ("seq", "site", "pos", "digest", "dtype", "width", "max_abs", "rms"):
            _need(key in r, f"{where}: missing field {key!r}")
        seq, site, pos = r["seq"], r["site"], r["pos"]
        _need(_is_int(seq) and seq in seqs, f"{where}: seq {seq!r} is not a traced sequence")
        _need(site in names, f"{where}: site {site!r} is not a site of this model")
        _need(
            _is_int(pos) and 0 <= pos < len(seqs[seq]),
            f"{where}: pos {pos!r} outside sequence {seq} ({len(seqs[seq])} tokens)",
        )
        _need(
            isinstance(r["digest"], str) and bool(_HEX.match(r["digest"])),
            f"{where}: digest must be 16 lowercase hex digits",
        )
        _need(isinstance(r["dtype"], str), f"{where}: dtype must be a string")
        width = r["width"]
        _need(_is_int(width) and width >= 0, f"{where}: width must be a non-negative integer")
        for key in ("max_abs", "rms"):
            _need(_is_num(r[key]), f"{where}: {key} must be a number")
        values = None
        if r.get("values") is not None:
            try:
                values = base64.b64decode(r["values"], validate=True)
            except (ValueError, TypeError):
                raise TraceFormatError(f"{where}: values is not base64") from None
            _need(
                len(values) == 4 * width,
                f"{where}: values hold {len(values) // 4} floats, width is {width}",
            )
        key3 = (seq, site, pos)
        _need(key3 not in rows, f"{where}: ({seq}, {site}, {pos}) recorded twice")
        rows[key3] = Row(
            r["digest"], r["dtype"], width, float(r["max_abs"]), float(r["rms"]), values
        )
    return Trace(side, parsed_sites, dict(data["model"]), seqs, rows, dict(untraced))


def rows_2d(t: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
    """A site output with tokens leading (`[T, …]`, `[s, b=1, …]`, or token-major rows such as
    `[T*heads, d]`) as `[T, features]`; None when it is not laid out per token (skipped)."""
    if num_tokens <= 0 or t.dim() == 0 or t.shape[0] % num_tokens or t.numel() % num_tokens:
        return None
    return t.reshape(num_tokens, -1)


__all__ = [
    "FORMAT",
    "VERSION",
    "Key",
    "Row",
    "Trace",
    "TraceFormatError",
    "digest_rows",
    "make_rows",
    "rows_2d",
    "site_layer",
]


# Sites whose op runs inside a bigger module on both sides, so no module output is theirs alone.
UNTRACED_SITES: dict[str, str] = {
    "mlp.router": "routed inside the experts runner; its effect is recorded at mlp.experts",
    "linear_attn.conv": "runs inside the GDN block, no module output of its own",
    "linear_attn.recurrence": "runs inside the GDN block, no module output of its own",
}


def first_tensor(out: Any) -> Any:
    """The tensor a site's module produced (the first of a tuple, e.g. a norm's (y, residual))."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None
