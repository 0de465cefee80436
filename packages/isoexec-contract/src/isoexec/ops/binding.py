"""Site bindings: one object gives a site both what it calls and what it records.

Why: a contract is only worth what its records say about the calls that actually run. When a
site chose its functions in one place and its `ImplInfo` in another, the two could drift
apart (a record naming the canonical kernel over a call to another one) and nothing would
notice. A `SiteBinding(op, backend, placement)` derives both from the same three fields: its
`impl` is the record, and `SiteOps` (what a site holds as `self.ops`) exposes only the
functions of the ops it was bound to, so a site cannot call a function its record does not
name. Both sides build their sites this way (`isoexec.megatron.canonical_base.site_binding`,
`isoexec.vllm.engine_binding.engine_binding`).

What remains possible is tampering after construction (a record replaced on the instance, a
`forward` swapped for a native kernel, a call past the binding to `isoexec.ops` directly). The
debug mode `ISOEXEC_VERIFY_CALLS=1` catches those at run time (`call_verify`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from isoexec.contract.impl import ImplInfo
from isoexec.contract.protocol import SiteRefusedError

from . import BACKEND, backend_ops, depends_on_placement, get_backend_impl
from .call_verify import note_call, verify_calls_enabled


class SiteBindingError(SiteRefusedError):
    """A site asked for an op, backend or placement its binding cannot give it: refused."""


class UnboundCallError(AttributeError):
    """A site called a function that none of its bindings' ops has: its record would not name
    it. (An AttributeError, so `getattr(..., default)` and copying still behave.)"""


# The public functions a site bound to each op (or op variant) may call. A function outside
# its op's list is not reachable through the site's `SiteOps`.
ENTRY_POINTS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "linear": frozenset({"linear"}),
        "linear_tp": frozenset(
            {
                "linear_tp_shard",
                "linear_tp_invariant",
                "tp_linear_from_shards",
                "tp_leaf_partials",
                "tp_tree_sum",
            }
        ),
        "lora": frozenset(
            {
                "lora_apply_by_slot",
                "lora_expand_by_slot",
                "lora_apply",
                "lora_delta",
                "fold_scaling",
                "pad_rank",
            }
        ),
        "rms_norm": frozenset({"rms_norm"}),
        "gated_rms_norm": frozenset({"gated_rms_norm"}),
        "rope": frozenset(
            {"apply_rope", "rope", "rope_cos_sin", "rope_cos_sin_table", "rope_inv_freq"}
        ),
        "silu_mul": frozenset({"silu_mul"}),
        "attention": frozenset(
            {"attention_varlen", "attention_paged", "gather_paged_kv", "paged_queries"}
        ),
        "attn_output_gate": frozenset({"attn_output_gate"}),
        "logprobs": frozenset(
            {"adjust_logits", "log_softmax", "token_logprobs", "truncation_mask"}
        ),
        "logprobs_vocab_parallel": frozenset(
            {"vocab_leaf_stats", "combine_leaf_stats", "token_logprobs_vocab_parallel"}
        ),
        # The router's logits are a GEMM of the router site (its record names the library).
        "moe_router": frozenset({"moe_router", "linear"}),
        "moe_combine": frozenset({"moe_combine", "moe_experts", "moe_weighted_sum"}),
        "gdn_conv": frozenset({"gdn_conv"}),
        # (`gdn_sequence` is glue that both sides call with their bound conv and recurrence)
        "gdn_recurrence": frozenset({"gdn_recurrence", "gdn_recurrence_in_place"}),
    }
)


@dataclass(frozen=True)
class Placement:
    """Where a site's parameters live and in what dtype: its GEMM library and, for some ops,
    its algorithm depend on them (`isoexec.ops.depends_on_placement`)."""

    device: str
    dtype: torch.dtype


class SiteBinding:
    """One op of one site: `impl` (the record) and the functions (`functions`) that implement
    it on `backend`, taken from `provider` (default: the backend's ops module; the engine
    passes its compiled-op wrappers, which call the same functions)."""

    def __init__(
        self,
        op: str,
        *,
        backend: str = BACKEND,
        placement: Placement | None = None,
        provider: object | None = None,
        impl: ImplInfo | None = None,
        **params: object,
    ) -> None:
        if op not in ENTRY_POINTS:
            raise SiteBindingError(f"no binding for op {op!r}; known: {sorted(ENTRY_POINTS)}")
        if impl is None:
            if placement is None and depends_on_placement(op):
                raise SiteBindingError(
                    f"a {op} site needs its placement (device and dtype): its GEMM library or "
                    "algorithm depends on them and would otherwise be a guess"
                )
            where = {}
            if placement is not None:
                where = {"device": placement.device, "dtype": placement.dtype}
            try:
                impl = get_backend_impl(op, backend, **where, **params)
            except KeyError as e:
                raise SiteBindingError(f"{op} on backend {backend!r}: {e.args[0]}") from None
        self.op = op
        self.backend = backend
        self.placement = placement
        self.impl = impl
        source = backend_ops(backend) if provider is None else provider
        self.provider = source  # where the functions come from
        self.functions: dict[str, Callable[..., Any]] = {
            name: fn
            for name in sorted(ENTRY_POINTS[op])
            if (fn := getattr(source, name, None)) is not None
        }
        self.owner: object | None = None  # the object whose record this is (`bind`)

    def __repr__(self) -> str:
        return f"SiteBinding({self.op!r}, backend={self.backend!r}, impl={self.impl.impl_id})"


class SiteOps:
    """What a site holds as `self.ops`: the functions of its bindings' ops and nothing else.

    With `ISOEXEC_VERIFY_CALLS=1` at construction, every call is noted for `call_verify`."""

    def __init__(self, bindings: Iterable[SiteBinding]) -> None:
        self.bindings = tuple(bindings)
        verify = verify_calls_enabled()
        for b in self.bindings:
            for name, fn in b.functions.items():
                if name in self.__dict__:
                    raise SiteBindingError(f"two bindings of one site both provide {name!r}")
                setattr(self, name, _noted(b, name, fn) if verify else fn)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        ops = ", ".join(b.op for b in self.__dict__.get("bindings", ()))
        raise UnboundCallError(
            f"a site bound to [{ops}] called {name!r}, which none of its ops has: its record "
            "would not name what ran"
        )


def _noted(binding: SiteBinding, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        note_call(binding, name)
        return fn(*args, **kwargs)

    call.__name__ = name
    return call


def bind(holder: object, *bindings: SiteBinding, ops_attr: str = "ops") -> SiteOps:
    """Give `holder` its records and its functions from the same bindings: `isoexec_impl` (one
    binding) or `isoexec_impls` ({op: impl}, several), and `SiteOps` as `holder.<ops_attr>`."""
    if not bindings:
        raise SiteBindingError("a site needs at least one binding")
    site_ops = SiteOps(bindings)
    for b in bindings:
        b.owner = holder
    if len(bindings) == 1:
        holder.isoexec_impl = bindings[0].impl  # type: ignore[attr-defined]
    else:
        impls = {b.impl.op: b.impl for b in bindings}
        if len(impls) != len(bindings):
            raise SiteBindingError("two bindings of one site record the same op")
        holder.isoexec_impls = impls  # type: ignore[attr-defined]
    setattr(holder, ops_attr, site_ops)
    return site_ops


def site_ops_of(model: Any) -> list[SiteOps]:
    """Every `SiteOps` held by the modules of `model` (as any attribute), each once."""
    found: dict[int, SiteOps] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, SiteOps):
                found.setdefault(id(value), value)
    return list(found.values())


@contextmanager
def wrapped_calls(
    model: Any, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """Within the block, every function the sites of `model` call through their bindings is
    `wrap(name, fn)` (a profiler's timer, say); restored after, whatever happens."""
    saved = [(so, dict(vars(so))) for so in site_ops_of(model)]
    try:
        for so, attrs in saved:
            for name, fn in attrs.items():
                if name != "bindings":
                    setattr(so, name, wrap(name, fn))
        yield
    finally:
        for so, attrs in saved:
            vars(so).update(attrs)


__all__ = [
    "ENTRY_POINTS",
    "Placement",
    "SiteBinding",
    "SiteBindingError",
    "SiteOps",
    "UnboundCallError",
    "bind",
    "site_ops_of",
    "wrapped_calls",
]
