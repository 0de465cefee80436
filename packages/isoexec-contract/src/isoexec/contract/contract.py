"""The execution contract: what each side actually installed, as canonical, hashable bytes.

The trainer and the engine each build a `Contract` from their live model after installation
and exchange it (see `isoexec.handshake`). Equal SHA-256 of the canonical bytes means
both sides run the same op implementations under the same numerics-relevant facts.

Canonical form (schema version 2)
---------------------------------
JSON, UTF-8, keys sorted at every level, no whitespace (`separators=(",", ":")`), non-ASCII
kept as UTF-8 (not `\\u` escapes), **no floats anywhere** (floats are encoded as exact strings,
e.g. `float.hex()`); integers, strings, booleans, null, arrays and objects only::

    {"device":    {"arch":..., "cuda":..., "device_kind":..., "patches":[...], "threads":...,
                   "torch":..., "triton":...},
     "dtypes":    {"activations":..., "kv_cache":..., "logprobs":..., "params":...,
                   "recurrent_state":..., "residual":...},
     "model":     {"architecture":..., "config_digest":..., "layer_kinds":[...]},
     "parallel":  {"dp":..., "ep":..., "pp":..., "tp":...},
     "schema_version": 5,
     "sites":     {"<site name>": {"backend":..., "impl_id":..., "op":..., "params":{...},
                                   "source_fingerprint":..., "tp":..., "version":...}, ...},
     "speculation": "invariant" | "none" | "<method>/<k>"}

Sites are a JSON object keyed by site name, so the bytes do not depend on the order in which
a side happens to enumerate its modules (Megatron and vLLM walk their models differently).
The in-memory `Contract.sites` keeps the order it was built in (model order); a contract read
back from bytes is in `site_sort_key` order (numeric-aware, so `layers.2` precedes `layers.10`).

Parallel layout: each site's `tp` is `"invariant"` when the site claims its result does not
depend on the tensor-parallel degree, else the TP degree as a decimal string. A TP=4 trainer
and a TP=1 engine whose every site claims invariance therefore hash equal, while a site without
the claim pins the degree it ran at. The `parallel` section declares the whole layout, one
entry per dimension (`isoexec.contract.parallel_layout`): "invariant" or the degree. Schema 1
had no `parallel` section and is refused (rebuild the contract).

Speculation: `speculation` says what speculative decoding means for the side's bits
(`isoexec.contract.speculation`): "invariant" on a canonical side, else the method and k it
speculates with, or "none". Schema 4 had no such entry and is refused (rebuild the contract).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from isoexec.contract.contract_errors import ContractError, SchemaVersionError
from isoexec.contract.contract_json import (
    _exact_keys,
    _exactify,
    _no_duplicate_keys,
    _obj,
    _opt_str,
    _refuse_constant,
    _refuse_float,
    _str,
    _str_list,
    canonical_json,
)
from isoexec.contract.contract_types import (  # re-exported: callers import them from here
    KNOWN_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    TP_INVARIANT,
    DeviceIdentity,
    Dtypes,
    ModelIdentity,
    SiteRecord,
    site_sort_key,
)
from isoexec.contract.contract_validate import validate
from isoexec.contract.device import detect_device
from isoexec.contract.impl import ImplInfo
from isoexec.contract.parallel_layout import SERIAL_LAYOUT, ParallelLayout, ParallelLayoutError
from isoexec.contract.speculation import NONE, SpeculationError, check_speculation


class HasNameOp(Protocol):
    """What `expected_sites` accepts besides names: `isoexec.contract.sites.Site`."""

    @property
    def name(self) -> str: ...
    @property
    def op(self) -> str: ...


@dataclass(frozen=True, eq=False)
class Contract:
    """A frozen execution contract. Equality and `hash` are those of the canonical bytes."""

    model: ModelIdentity
    dtypes: Dtypes
    device: DeviceIdentity
    sites: tuple[SiteRecord, ...]
    parallel: ParallelLayout = SERIAL_LAYOUT
    speculation: str = NONE
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        validate(self)

    # -- canonical form ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready structure (sites keyed by name; order is irrelevant to the bytes)."""
        return {
            "schema_version": self.schema_version,
            "model": {
                "architecture": self.model.architecture,
                "config_digest": self.model.config_digest,
                "layer_kinds": list(self.model.layer_kinds),
            },
            "dtypes": {
                "params": self.dtypes.params,
                "activations": self.dtypes.activations,
                "residual": self.dtypes.residual,
                "kv_cache": self.dtypes.kv_cache,
                "recurrent_state": self.dtypes.recurrent_state,
                "logprobs": self.dtypes.logprobs,
            },
            "device": {
                "torch": self.device.torch,
                "triton": self.device.triton,
                "cuda": self.device.cuda,
                "device_kind": self.device.device_kind,
                "arch": self.device.arch,
                "threads": self.device.threads,
                "patches": list(self.device.patches),
            },
            "parallel": self.parallel.to_dict(),
            "speculation": self.speculation,
            "sites": {
                s.name: {
                    "op": s.impl.op,
                    "impl_id": s.impl.impl_id,
                    "version": s.impl.version,
                    "backend": s.impl.backend,
                    "params": dict(s.impl.params),
                    "source_fingerprint": s.impl.source_fingerprint,
                    "tp": s.tp,
                }
                for s in self.sites
            },
        }

    @cached_property
    def _bytes(self) -> bytes:
        return canonical_json(self.to_dict())

    def to_bytes(self) -> bytes:
        """Canonical bytes: identical for an identical contract on every machine."""
        return self._bytes

    @cached_property
    def hash(self) -> str:
        """Lower-case hex SHA-256 of the canonical bytes: the contract's identity."""
        return hashlib.sha256(self._bytes).hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Contract):
            return NotImplemented
        return self._bytes == other._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    # -- reading -----------------------------------------------------------------------------

    @staticmethod
    def from_bytes(data: bytes, *, require_canonical: bool = False) -> Contract:
        """Parse strictly: unknown fields, unknown schema versions, floats, NaN, duplicate keys
        and wrong types are refused. With `require_canonical`, bytes that are not exactly the
        canonical encoding are refused too (the handshake needs hash(bytes) == contract hash).
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ContractError(f"contract must be bytes, got {type(data).__name__}")
        data = bytes(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ContractError(f"contract is not UTF-8: {e}") from None
        try:
            obj = json.loads(
                text,
                parse_float=_refuse_float,
                parse_constant=_refuse_constant,
                object_pairs_hook=_no_duplicate_keys,
            )
        except ContractError:
            raise
        except (json.JSONDecodeError, RecursionError) as e:
            raise ContractError(f"contract is not valid JSON: {e}") from None
        contract = Contract.from_dict(obj)
        if require_canonical and contract.to_bytes() != data:
            raise ContractError(
                "contract bytes are not canonical (sorted keys, no whitespace, UTF-8, no floats)"
            )
        return contract

    @staticmethod
    def from_dict(obj: object) -> Contract:
        """Build from a parsed JSON structure, refusing anything not in the schema version."""
        top = _obj(obj, "contract")
        version = top.get("schema_version")
        if type(version) is not int:
            raise ContractError("contract.schema_version: missing or not an integer")
        if version not in KNOWN_SCHEMA_VERSIONS:
            raise SchemaVersionError(
                f"unknown contract schema_version {version} "
                f"(known: {', '.join(map(str, sorted(KNOWN_SCHEMA_VERSIONS)))})"
            )
        _exact_keys(
            top,
            {"schema_version", "model", "dtypes", "device", "parallel", "speculation", "sites"},
            "contract",
        )
        try:
            parallel = ParallelLayout.from_dict(_obj(top["parallel"], "parallel"))
            speculation = check_speculation(top["speculation"])
        except (ParallelLayoutError, SpeculationError) as e:
            raise ContractError(str(e)) from None
        m = _obj(top["model"], "model")
        _exact_keys(m, {"architecture", "config_digest", "layer_kinds"}, "model")
        kinds = m["layer_kinds"]
        if not isinstance(kinds, list):
            raise ContractError("model.layer_kinds: expected a list of strings")
        model = ModelIdentity(
            _str(m["architecture"], "model.architecture"),
            _str(m["config_digest"], "model.config_digest"),
            tuple(_str(k, "model.layer_kinds[]") for k in kinds),
        )
        d = _obj(top["dtypes"], "dtypes")
        _exact_keys(d, {f.name for f in fields(Dtypes)}, "dtypes")
        dtypes = Dtypes(
            params=_str(d["params"], "dtypes.params"),
            activations=_str(d["activations"], "dtypes.activations"),
            residual=_str(d["residual"], "dtypes.residual"),
            kv_cache=_opt_str(d["kv_cache"], "dtypes.kv_cache"),
            recurrent_state=_opt_str(d["recurrent_state"], "dtypes.recurrent_state"),
            logprobs=_str(d["logprobs"], "dtypes.logprobs"),
        )
        b = _obj(top["device"], "device")
        _exact_keys(b, {f.name for f in fields(DeviceIdentity)}, "device")
        threads = b["threads"]
        if threads is not None and type(threads) is not int:
            raise ContractError("device.threads: expected an integer or null")
        device = DeviceIdentity(
            torch=_str(b["torch"], "device.torch"),
            device_kind=_str(b["device_kind"], "device.device_kind"),
            arch=_str(b["arch"], "device.arch"),
            triton=_opt_str(b["triton"], "device.triton"),
            cuda=_opt_str(b["cuda"], "device.cuda"),
            threads=threads,
            patches=_str_list(b["patches"], "device.patches"),
        )
        raw_sites = _obj(top["sites"], "sites")
        sites: list[SiteRecord] = []
        for name in sorted(raw_sites, key=site_sort_key):
            where = f"sites[{name!r}]"
            s = _obj(raw_sites[name], where)
            _exact_keys(
                s,
                {"op", "impl_id", "version", "backend", "params", "source_fingerprint", "tp"},
                where,
            )
            if type(s["version"]) is not int:
                raise ContractError(f"{where}.version: expected an integer")
            params = _obj(s["params"], f"{where}.params")
            impl = ImplInfo(
                op=_str(s["op"], f"{where}.op"),
                impl_id=_str(s["impl_id"], f"{where}.impl_id"),
                version=s["version"],
                backend=_str(s["backend"], f"{where}.backend"),
                params=tuple(
                    sorted((k, _str(v, f"{where}.params[{k!r}]")) for k, v in params.items())
                ),
                source_fingerprint=_str(s["source_fingerprint"], f"{where}.source_fingerprint"),
            )
            sites.append(SiteRecord(name, impl, _str(s["tp"], f"{where}.tp")))
        return Contract(model, dtypes, device, tuple(sites), parallel, speculation, version)

    # -- files -------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the canonical bytes exactly (no trailing newline: `sha256sum` == `hash`)."""
        p = Path(path)
        p.write_bytes(self.to_bytes())
        return p

    @staticmethod
    def load(path: str | Path, *, require_canonical: bool = False) -> Contract:
        """Read a contract file (strict; pretty-printed JSON is accepted unless required)."""
        return Contract.from_bytes(Path(path).read_bytes(), require_canonical=require_canonical)

    # -- conveniences ------------------------------------------------------------------------

    def site(self, name: str) -> SiteRecord:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def site_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sites)

    @property
    def native_sites(self) -> tuple[str, ...]:
        """Sites left to the framework's kernel: where bitwise equality is not engineered."""
        return tuple(s.name for s in self.sites if s.impl.is_native)


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


class ContractBuilder:
    """Collect sites in model order, then `build()` a frozen `Contract`.

    `device=None` detects the running device identity at `build()` (Triton's version is included
    when any site's kernels are Triton's). `tp_size` is the degree this side runs
    at; sites added with `tp_invariant=True` record `"invariant"` instead.
    """

    def __init__(
        self,
        model: ModelIdentity,
        dtypes: Dtypes,
        device: DeviceIdentity | None = None,
        *,
        tp_size: int = 1,
        parallel: ParallelLayout | None = None,
        speculation: str = NONE,
    ) -> None:
        if type(tp_size) is not int or tp_size < 1:
            raise ContractError(f"tp_size must be a positive integer, got {tp_size!r}")
        self.parallel = parallel
        self.speculation = speculation
        self.model = model
        self.dtypes = dtypes
        self.device = device
        self.tp_size = tp_size
        self._sites: dict[str, SiteRecord] = {}

    def add_site(self, name: str, impl: ImplInfo, *, tp_invariant: bool = False) -> None:
        if name in self._sites:
            raise ContractError(f"site {name!r} added twice")
        tp = TP_INVARIANT if tp_invariant else str(self.tp_size)
        self._sites[name] = SiteRecord(name, impl, tp)

    def build(self, *, expected_sites: Iterable[str | HasNameOp] | None = None) -> Contract:
        """Freeze. With `expected_sites` (names, or `isoexec.contract.sites.Site` objects from
        `model_sites(config)`), a site nobody recorded (not even as native) is an error — a side
        must never omit a site it left stock — and so is a record whose op is not the site's."""
        if expected_sites is not None:
            expected = list(expected_sites)
            names = [e if isinstance(e, str) else e.name for e in expected]
            missing = [n for n in names if n not in self._sites]
            if missing:
                shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
                raise ContractError(
                    f"{len(missing)} site(s) not recorded (record native ones with "
                    f"ImplInfo.native): {shown}"
                )
            for e in expected:
                if not isinstance(e, str) and self._sites[e.name].impl.op != e.op:
                    raise ContractError(
                        f"site {e.name!r} runs op {e.op!r} but its record says "
                        f"{self._sites[e.name].impl.op!r}"
                    )
        device = self.device
        if device is None:
            uses_triton = any(s.impl.backend.startswith("triton") for s in self._sites.values())
            device = detect_device(uses_triton=uses_triton)
        parallel = self.parallel
        if parallel is None:  # TP only: what the sites say; the other dimensions at degree 1
            invariant = all(s.tp_invariant for s in self._sites.values())
            parallel = ParallelLayout(tp=TP_INVARIANT if invariant else str(self.tp_size))
        sites = tuple(self._sites.values())
        return Contract(self.model, self.dtypes, device, sites, parallel, self.speculation)


def build_contract(
    *,
    model: ModelIdentity,
    dtypes: Dtypes,
    sites: Mapping[str, ImplInfo] | Iterable[tuple[str, ImplInfo]],
    device: DeviceIdentity | None = None,
    tp_size: int = 1,
    tp_invariant: bool | Collection[str] = False,
    expected_sites: Iterable[str | HasNameOp] | None = None,
    parallel: ParallelLayout | None = None,
    speculation: str = NONE,
) -> Contract:
    """One-call form of `ContractBuilder`: `sites` in model order; `tp_invariant` is True (every
    site claims TP invariance), False, or the names of the sites that claim it."""
    b = ContractBuilder(
        model, dtypes, device, tp_size=tp_size, parallel=parallel, speculation=speculation
    )
    pairs = list(sites.items() if isinstance(sites, Mapping) else sites)
    names = {n for n, _ in pairs}
    if not isinstance(tp_invariant, bool):
        unknown = sorted(set(tp_invariant) - names, key=site_sort_key)
        if unknown:
            raise ContractError(f"tp_invariant names unknown sites: {', '.join(unknown)}")
    for name, impl in pairs:
        inv = tp_invariant if isinstance(tp_invariant, bool) else name in tp_invariant
        b.add_site(name, impl, tp_invariant=inv)
    return b.build(expected_sites=expected_sites)


def config_digest(fields: Mapping[str, object]) -> str:
    """SHA-256 (hex) of the numerics-relevant config fields, canonically encoded.

    Floats become `float.hex()` strings (exact), so `1e-6` on both sides digests the same and
    `1e-6` vs `1e-5` differs; nested mappings/lists are allowed.
    """
    return hashlib.sha256(canonical_json(_exactify(dict(fields)))).hexdigest()


__all__ = [
    "KNOWN_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "TP_INVARIANT",
    "Contract",
    "ContractBuilder",
    "ContractError",
    "DeviceIdentity",
    "Dtypes",
    "ModelIdentity",
    "SchemaVersionError",
    "SiteRecord",
    "build_contract",
    "canonical_json",
    "config_digest",
    "site_sort_key",
]
