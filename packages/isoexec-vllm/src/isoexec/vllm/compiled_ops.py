"""The canonical ops the engine calls inside vLLM's compiled model, as torch custom ops.

Why: vLLM's default mode compiles the model's forward with torch.compile. Dynamo would trace
into the canonical ops' Python (and stop at their Python scalars), and Inductor would
regenerate their arithmetic with its own reductions, vectorisation and fusions: other bits
than the trainer's eager ops. Registered as custom ops (`torch.ops.isoexec.*`) with fake
implementations that only give shapes, they are opaque to both, the way vLLM registers its
own kernels: the compiled graph calls the very eager code the trainer runs, so compiled and
eager engines compute the same bits (tests/vllm/test_compiled_engine.py). What Inductor still
generates around them is data movement (views, splits, concatenation, gathers), which is exact.

`CompiledOps(backend)` is what engine sites hold as `self.ops`: the backend's ops module with
the calls made inside the compiled region routed through the custom ops; everything else
(the sampler's log-softmax, the GDN recurrence inside its own opaque core) passes through.
The `backend` argument of each op selects `isoexec.ops` or its Triton twin.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from isoexec import ops
from isoexec.ops import cpu_kernels, cpu_torch_ops, moe
from isoexec.ops.capture_guard import capture_guard_enabled, run_guarded
from isoexec.ops.rope import rope_cos_sin_table
from isoexec.vllm.opaque_op import opaque_op
from vllm.platforms import current_platform


def _mod(backend: str) -> ModuleType:
    return ops.backend_ops(backend)


def _call(backend: str, name: str, *args: Any, **kwargs: Any) -> Any:
    """The backend's op `name`, run under the capture guard when it is on: every op here but
    the LoRA ones is one vLLM may capture in a CUDA graph (`graph_safety.SPLITTING_OPS`)."""
    return run_guarded(getattr(_mod(backend), name), *args, **kwargs)


def _own(out: Tensor, *inputs: Tensor | None) -> Tensor:
    """A custom op's output must not alias its inputs: copy in the (rare) case it would."""
    ptr = out.untyped_storage().data_ptr()
    if any(t is not None and t.untyped_storage().data_ptr() == ptr for t in inputs):
        return out.clone()
    return out


# ---- norms -----------------------------------------------------------------------------------
@opaque_op("rms_norm")
def _rms_norm(backend: str, x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
    out = _call(backend, "rms_norm", x, weight, eps, zero_centered=zero_centered)
    return _own(out, x, weight)


@_rms_norm.register_fake
def _(backend: str, x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
    return torch.empty_like(x)


@opaque_op("rms_norm_residual")
def _rms_norm_residual(
    backend: str, x: Tensor, weight: Tensor, eps: float, zero_centered: bool, residual: Tensor
) -> tuple[Tensor, Tensor]:
    y, r = _call(
        backend, "rms_norm", x, weight, eps, zero_centered=zero_centered, residual=residual
    )
    return _own(y, x, weight, residual), _own(r, x, weight, residual)


@_rms_norm_residual.register_fake
def _(
    backend: str, x: Tensor, weight: Tensor, eps: float, zero_centered: bool, residual: Tensor
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@opaque_op("gated_rms_norm")
def _gated_rms_norm(backend: str, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _own(_call(backend, "gated_rms_norm", x, z, weight, eps), x, z, weight)


@_gated_rms_norm.register_fake
def _(backend: str, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


# ---- linears ---------------------------------------------------------------------------------
def _linear_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@opaque_op("linear")
def _linear(backend: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _own(_call(backend, "linear", x, weight, bias), x, weight, bias)


@_linear.register_fake
def _(backend: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _linear_fake(x, weight)


@opaque_op("linear_tp_invariant")
def _linear_tp_invariant(backend: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _own(_call(backend, "linear_tp_invariant", x, weight, bias), x, weight, bias)


@_linear_tp_invariant.register_fake
def _(backend: str, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _linear_fake(x, weight)


@opaque_op("linear_tp_shard")
def _linear_tp_shard(
    backend: str, x: Tensor, weight: Tensor, bias: Tensor | None, tp: int
) -> Tensor:
    """Row-parallel TP-invariant linear at TP>1: the leaves are gathered over vLLM's TP group
    inside the op (an exact all-gather), so the collective is part of the opaque call."""
    from isoexec.vllm.collectives import gather_leaves

    out = _call(backend, "linear_tp_shard", x, weight, bias, tp=tp, all_gather=gather_leaves)
    return _own(out, x, weight, bias)


@_linear_tp_shard.register_fake
def _(backend: str, x: Tensor, weight: Tensor, bias: Tensor | None, tp: int) -> Tensor:
    return _linear_fake(x, weight)


# ---- activation, rope, gate ------------------------------------------------------------------
@opaque_op("silu_mul")
def _silu_mul(backend: str, x: Tensor) -> Tensor:
    return _own(_call(backend, "silu_mul", x), x)


@_silu_mul.register_fake
def _(backend: str, x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@opaque_op("rope")
def _rope(
    backend: str, positions: Tensor, x: Tensor, head_size: int, rotary_dim: int, base: float
) -> Tensor:
    """RoPE on x [T, heads * head_size] (or any shape with T rows) at `positions` [T]."""
    # on CPU by table lookup inside the kernel (`ops.apply_rope_at`: the same bits; the table
    # is the torch canonical `rope_cos_sin`); on CUDA, and under the capture guard, computed in
    # place (the lookup's size check reads the positions on the host, which a CUDA graph
    # cannot hold)
    pos = positions.reshape(-1)
    heads = x.reshape(pos.shape[0], -1, head_size)
    if positions.device.type != "cpu" or capture_guard_enabled():
        cos, sin = _call(backend, "rope_cos_sin", pos, rotary_dim, base)
        out = _call(backend, "apply_rope", heads, cos, sin, rotary_dim)
    elif backend == ops.BACKEND:
        out = _call(backend, "apply_rope_at", heads, pos, rotary_dim, base)
    else:  # Triton on CPU tensors (its interpreter): the lookup, then its own apply
        cos, sin = rope_cos_sin_table(pos, rotary_dim, base)
        out = _call(backend, "apply_rope", heads, cos, sin, rotary_dim)
    return _own(out.reshape(x.shape), x)


@_rope.register_fake
def _(
    backend: str, positions: Tensor, x: Tensor, head_size: int, rotary_dim: int, base: float
) -> Tensor:
    return torch.empty_like(x)


@opaque_op("attn_output_gate")
def _attn_output_gate(backend: str, out: Tensor, gate: Tensor) -> Tensor:
    return _own(_call(backend, "attn_output_gate", out, gate), out, gate)


@_attn_output_gate.register_fake
def _(backend: str, out: Tensor, gate: Tensor) -> Tensor:
    return torch.empty_like(out)


# ---- MoE -------------------------------------------------------------------------------------
@opaque_op("moe_router")
def _moe_router(
    backend: str, logits: Tensor, top_k: int, renormalize: bool
) -> tuple[Tensor, Tensor]:
    w, ids = _call(backend, "moe_router", logits, top_k, renormalize=renormalize)
    return _own(w, logits), _own(ids, logits)


@_moe_router.register_fake
def _(backend: str, logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    rows = logits.shape[:-1]
    return (
        logits.new_empty((*rows, top_k), dtype=torch.float32),
        logits.new_empty((*rows, top_k), dtype=torch.int64),
    )


@opaque_op("moe_combine")
def _moe_combine(
    backend: str,
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    shared_w13: Tensor | None,
    shared_w2: Tensor | None,
    shared_gate_w: Tensor | None,
) -> Tensor:
    out = _call(
        backend, "moe_combine", x, topk_weights, topk_ids, w13, w2,
        shared_w13=shared_w13, shared_w2=shared_w2, shared_gate_w=shared_gate_w,
    )  # fmt: skip
    return _own(out, x)


@_moe_combine.register_fake
def _(
    backend: str,
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    shared_w13: Tensor | None,
    shared_w2: Tensor | None,
    shared_gate_w: Tensor | None,
) -> Tensor:
    return torch.empty_like(x)


@opaque_op("lora_apply_by_slot")
def _lora_apply_by_slot(
    base: Tensor,
    x: Tensor,
    slot_of_row: Tensor,
    a_stacked: list[Tensor],
    b_stacked: list[Tensor],
    widths: list[int],
) -> Tensor:
    """Rows grouped by adapter slot (data-dependent shapes): opaque, like vLLM's punica ops.
    The torch backend's op on every backend: LoRA has no Triton twin (`isoexec.vllm.lora`)."""
    out = ops.lora_apply_by_slot(base, x, slot_of_row, a_stacked, b_stacked, widths)
    return _own(out, base, x)


@_lora_apply_by_slot.register_fake
def _(
    base: Tensor,
    x: Tensor,
    slot_of_row: Tensor,
    a_stacked: list[Tensor],
    b_stacked: list[Tensor],
    widths: list[int],
) -> Tensor:
    return torch.empty_like(base)


@opaque_op("lora_expand_by_slot")
def _lora_expand_by_slot(base: Tensor, h: Tensor, slot_of_row: Tensor, b_stacked: Tensor) -> Tensor:
    return _own(ops.lora_expand_by_slot(base, h, slot_of_row, b_stacked), base, h)


@_lora_expand_by_slot.register_fake
def _(base: Tensor, h: Tensor, slot_of_row: Tensor, b_stacked: Tensor) -> Tensor:
    return torch.empty_like(base)


# ---- the namespace sites hold ----------------------------------------------------------------
class CompiledOps:
    """A backend's canonical ops for engine sites: the calls made inside vLLM's compiled model
    go through the opaque custom ops above; any other name is the backend module's own."""

    def __init__(self, backend: str = "torch") -> None:
        self.backend = backend
        self._mod = _mod(backend)  # refuses an unknown backend here, at site construction
        # On a CPU engine the torch backend's norms, linears, SiLU-and-mul, RoPE and MoE are
        # C++ operators (`ops.cpu_torch_ops`: the same kernels without Python in the call); built
        # here, at site construction, not inside a compiled graph's trace.
        self._native = backend == ops.BACKEND and current_platform.is_cpu()
        # the dtypes whose MoE experts the C++ operator runs, with their expert GEMM (AMX
        # experts stay in Python); asked here, not while the graph is traced
        self._moe_native: dict[torch.dtype, str] = {}
        if self._native:
            cpu_torch_ops.load()
            kinds = {dt: moe.expert_gemm(dt) for dt in cpu_kernels.DTYPE_CODES}
            self._moe_native = {dt: k for dt, k in kinds.items() if k in cpu_torch_ops.MOE_KINDS}

    @property
    def native_cpu(self) -> bool:
        """Whether this backend's CPU calls go to `torch.ops.isoexec_cpu` (the attention
        backend asks, for its step)."""
        return self._native

    def _native_for(self, x: Tensor) -> bool:
        """Whether this call goes to `torch.ops.isoexec_cpu` (a CPU tensor, no capture guard:
        the guard checks the Python ops' bodies)."""
        return self._native and x.device.type == "cpu" and not capture_guard_enabled()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mod, name)

    def rms_norm(
        self,
        x: Tensor,
        weight: Tensor,
        eps: float,
        *,
        zero_centered: bool = False,
        residual: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if self._native_for(x) and x.dtype in cpu_kernels.DTYPE_CODES:
            if residual is None:
                return torch.ops.isoexec_cpu.rms_norm(x, weight, eps, zero_centered)
            return torch.ops.isoexec_cpu.rms_norm_residual(x, weight, eps, zero_centered, residual)
        if residual is None:
            return torch.ops.isoexec.rms_norm(self.backend, x, weight, eps, zero_centered)
        return torch.ops.isoexec.rms_norm_residual(
            self.backend, x, weight, eps, zero_centered, residual
        )

    def gated_rms_norm(self, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
        return torch.ops.isoexec.gated_rms_norm(self.backend, x, z, weight, eps)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if self._native_for(x) and cpu_torch_ops.runs_linear(x, weight):
            return torch.ops.isoexec_cpu.linear(x, weight, bias)
        return torch.ops.isoexec.linear(self.backend, x, weight, bias)

    def linear_tp_invariant(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return torch.ops.isoexec.linear_tp_invariant(self.backend, x, weight, bias)

    def linear_tp_shard(self, x: Tensor, weight: Tensor, bias: Tensor | None, *, tp: int) -> Tensor:
        return torch.ops.isoexec.linear_tp_shard(self.backend, x, weight, bias, tp)

    def silu_mul(self, x: Tensor) -> Tensor:
        if self._native_for(x):
            return torch.ops.isoexec_cpu.silu_mul(x)
        return torch.ops.isoexec.silu_mul(self.backend, x)

    def rope(
        self, positions: Tensor, x: Tensor, head_size: int, rotary_dim: int, base: float
    ) -> Tensor:
        if self._native_for(x) and x.dtype in cpu_kernels.DTYPE_CODES:
            return torch.ops.isoexec_cpu.rope(positions, x, head_size, rotary_dim, base)
        return torch.ops.isoexec.rope(self.backend, positions, x, head_size, rotary_dim, base)

    def attn_output_gate(self, out: Tensor, gate: Tensor) -> Tensor:
        return torch.ops.isoexec.attn_output_gate(self.backend, out, gate)

    def moe_router(self, logits: Tensor, top_k: int, *, renormalize: bool) -> tuple[Tensor, Tensor]:
        return torch.ops.isoexec.moe_router(self.backend, logits, top_k, renormalize)

    def moe_combine(
        self,
        x: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        w13: Tensor,
        w2: Tensor,
        *,
        shared_w13: Tensor | None = None,
        shared_w2: Tensor | None = None,
        shared_gate_w: Tensor | None = None,
    ) -> Tensor:
        kind = self._moe_native.get(x.dtype) if self._native_for(x) and x.dim() == 2 else None
        if kind is not None:
            return torch.ops.isoexec_cpu.moe_combine(
                x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2, shared_gate_w,
                kind, moe.DEFAULT_LANES,
            )  # fmt: skip
        return torch.ops.isoexec.moe_combine(
            self.backend, x, topk_weights, topk_ids, w13, w2, shared_w13, shared_w2, shared_gate_w
        )

    def lora_apply_by_slot(
        self,
        base: Tensor,
        x: Tensor,
        slot_of_row: Tensor,
        a_stacked: list[Tensor],
        b_stacked: list[Tensor],
        widths: list[int],
    ) -> Tensor:
        return torch.ops.isoexec.lora_apply_by_slot(
            base, x, slot_of_row, a_stacked, b_stacked, widths
        )

    def lora_expand_by_slot(
        self, base: Tensor, h: Tensor, slot_of_row: Tensor, b_stacked: Tensor
    ) -> Tensor:
        return torch.ops.isoexec.lora_expand_by_slot(base, h, slot_of_row, b_stacked)


__all__ = ["CompiledOps"]
