"""What every canonical trainer module shares: the refusal error, the config that carries the
IsoExec choices (RoPE base, TP leaves, backend, logprobs mode) into the modules Megatron builds,
and how a module binds its site: one `SiteBinding` gives both the functions it calls and the
`ImplInfo` it records (`isoexec.ops.binding`; `canonical_modules` has the why)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isoexec import ops
from isoexec.contract.protocol import LM_HEAD_ROW_PADDING, SiteRefusedError
from isoexec.ops.binding import Placement, SiteBinding, bind
from megatron.core.transformer.transformer_config import TransformerConfig


class CanonicalSiteError(SiteRefusedError):
    """A slot was asked for something its canonical op cannot express: refused, no fallback."""


@dataclass
class IsoTransformerConfig(TransformerConfig):
    """`TransformerConfig` plus the RoPE base the canonical core attention applies.

    Why a field: `SelfAttention` constructs its core attention with a fixed set of arguments,
    and the isoexec model has no Megatron rotary embedding (RoPE is canonical, in the core
    attention), so the base travels with the config.
    """

    isoexec_rope_theta: float | None = None
    # Rotated dims per head (partial RoPE, Qwen3-Next); None: the whole head.
    isoexec_rotary_dim: int | None = None
    # Row-parallel sites (o_proj, down_proj): None = `ops.linear` (TP=1 only); G = the
    # TP-invariant `linear_tp` with K in G fixed leaves, bitwise the same for every TP | G.
    isoexec_tp_leaves: int | None = None
    # Which backend's kernels every site runs (`ops.BACKENDS`): "torch" or "triton".
    isoexec_backend: str = "torch"
    # vLLM's name of the logprobs the trainer scores (`IsoExecOptions.logprobs_mode`).
    isoexec_logprobs_mode: str = "processed_logprobs"


def site_backend(config: TransformerConfig) -> str:
    """The backend this model's sites run (IsoTransformerConfig.isoexec_backend)."""
    backend = getattr(config, "isoexec_backend", ops.BACKEND)
    if backend not in ops.BACKENDS:
        raise CanonicalSiteError(f"unknown backend {backend!r}; known: {list(ops.BACKENDS)}")
    return str(backend)


def site_placement(config: TransformerConfig) -> Placement:
    """Where Megatron builds this config's parameters, hence where its GEMMs run: the CPU
    under `use_cpu_initialization` (as `build_model` does), else the current CUDA device; in
    the config's `params_dtype`. A model moved after it was built is refused when its
    contract is read back."""
    device = "cpu" if config.use_cpu_initialization else "cuda"
    return Placement(device, config.params_dtype)


def site_binding(config: TransformerConfig, op: str, **params: object) -> SiteBinding:
    """The binding of a site of this config running `op` (`isoexec.ops.binding`): the
    config's backend and placement, the record and the functions from the same fields."""
    return SiteBinding(op, backend=site_backend(config), placement=site_placement(config), **params)


def _tp_size(module: torch.nn.Module) -> int:
    """The module's own TP degree: its group's size (a whole shared expert's linears sit in a
    size-1 group inside a TP=2 model), else the config's."""
    group = getattr(module, "tp_group", None)
    if group is not None:
        return int(group.size())
    return int(module.config.tensor_model_parallel_size)  # type: ignore[union-attr]


__all__ = [
    "LM_HEAD_ROW_PADDING",
    "CanonicalSiteError",
    "IsoTransformerConfig",
    "bind",
    "site_backend",
    "site_binding",
    "site_placement",
]
