"""vLLM layer classes whose numerics are the canonical ops.

Installed through vLLM's own out-of-tree registration (`CustomOp.register_oot`,
`PluggableLayer.register_oot`): vLLM instantiates these classes wherever a model asks for the
stock one. Each instance carries `isoexec_impl`, the `ImplInfo` of what it runs; the contract
is read back from those attributes, never from intentions.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import torch

from isoexec.contract.impl import ImplInfo
from isoexec.contract.ops.gemm import clear_packed_weight_cache
from isoexec.vllm.backend import engine_impl, engine_ops, engine_options
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


class UnsupportedSiteError(RuntimeError):
    """A layer asked for something the canonical ops cannot express: refuse, never fall back."""


# ---- norms, rope, activation -----------------------------------------------------------------
class _BoundSite:
    """Binds the engine's backend when vLLM constructs the layer (`dispatch_forward` runs in
    `CustomOp.__init__`, while vLLM's config is current): `self.ops` and `isoexec_impl`."""

    isoexec_op: ClassVar[str]
    isoexec_impl: ImplInfo
    ops: ModuleType

    def _bind(self) -> None:
        self.ops = engine_ops()
        self.isoexec_impl = engine_impl(self.isoexec_op)


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
        o = self.ops
        cos, sin = o.rope_cos_sin(positions.reshape(-1), self.rotary_dim, float(self.base))
        t = cos.shape[0]
        q = o.apply_rope(query.view(t, -1, self.head_size), cos, sin, self.rotary_dim)
        q = q.reshape(query.shape)
        k = None
        if key is not None:
            k = o.apply_rope(key.view(t, -1, self.head_size), cos, sin, self.rotary_dim)
            k = k.reshape(key.shape)
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
        self.ops = engine_ops()
        self.isoexec_impl = engine_impl(self.isoexec_op)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        clear_packed_weight_cache()  # vLLM wrote the weight through `.data`

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.ops.linear(x, layer.weight, bias)


class CanonicalTPInvariantLinearMethod(CanonicalLinearMethod):
    """Row-parallel linear as the TP-invariant `linear_tp` (options.tp_invariant): K in fixed
    leaves, fixed tree, one rounding — the bits a Megatron trainer at any TP | leaves gets."""

    isoexec_op: ClassVar[str] = "linear_tp"

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.ops.linear_tp_invariant(x, layer.weight, bias)


class CanonicalLMHeadMethod(UnquantizedEmbeddingMethod):
    """Embedding lookup stays exact; the logits GEMM (`apply`) is the canonical linear."""

    isoexec_impl: ImplInfo

    def __init__(self) -> None:
        super().__init__()
        self.ops = engine_ops()
        self.isoexec_impl = engine_impl("linear")

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
        tp_invariant = engine_options().tp_invariant and isinstance(self, RowParallelLinear)
        self.quant_method = (
            CanonicalTPInvariantLinearMethod() if tp_invariant else CanonicalLinearMethod()
        )

    return type(f"Iso{base.__name__}", (base,), {"__init__": __init__})


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
