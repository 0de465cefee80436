"""CPU shims for Megatron's GatedDeltaNet and zero-centred norms (torch stand-ins for the
TE / fla kernels; `isoexec.megatron.cpu_shims` has the rules they follow)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from isoexec.megatron.cpu_shims.transformer import _TorchWithCpuCurrentDevice
from isoexec.megatron.patches import REGISTRY

# --------------------------------------------------------------------------------------------
# 9. Zero-centred RMSNorm (`layernorm_zero_centered_gamma`) without Transformer Engine
# --------------------------------------------------------------------------------------------


class ZeroCenteredTorchRMSNorm(torch.nn.RMSNorm):
    """RMSNorm with a zero-centred gain: `rms_norm(x) * (1 + weight)`, computed in fp32 and
    rounded once to the input dtype; `weight` starts at zero.

    This is Transformer Engine's `RMSNorm(zero_centered_gamma=True)` (what `TENorm` builds for
    `layernorm_zero_centered_gamma` on a GPU), in torch, for the CPU. It is also HF's
    `Qwen3NextRMSNorm` / `Qwen3_5RMSNorm` definition.
    """

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = self.weight.float() + 1.0
        return torch.nn.functional.rms_norm(x.float(), self.normalized_shape, gain, self.eps).to(
            x.dtype
        )


_WRAPPED_TORCH_NORM_NEW: list[Callable[..., Any]] = []  # upstream __new__, saved once


def shim_torch_norm_zero_centered_gamma() -> None:
    """Let Megatron's local norm (`WrappedTorchNorm`) build a zero-centred RMSNorm.

    Why: in megatron-core 0.16.1 only Transformer Engine's `TENorm` (and apex's LayerNorm)
    implement `layernorm_zero_centered_gamma`; `WrappedTorchNorm`, the no-TE norm, asserts the
    flag off. The GDN hybrids (Qwen3-Next, Qwen3.5) use zero-centred norms everywhere, so a
    stock Megatron model of them on a CPU needs this. With the flag on (RMSNorm only), the
    norm is `ZeroCenteredTorchRMSNorm` (TE's definition, in torch); everything else,
    including every upstream assertion, is upstream's. Upstream's `zero_centered_gamma`
    argument, unused in 0.16.1, is honoured when given (None: the config's flag): Megatron's
    `GatedDeltaNet` builds its output norm from the same config, but HF's gated output norm
    has a plain gain, and the native GDN spec says so explicitly.
    """
    from megatron.core.transformer import torch_norm

    if not _WRAPPED_TORCH_NORM_NEW:
        _WRAPPED_TORCH_NORM_NEW.append(torch_norm.WrappedTorchNorm.__new__)
    upstream_new = _WRAPPED_TORCH_NORM_NEW[0]

    def __new__(
        cls: type,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool | None = None,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        zero_centered = (
            config.layernorm_zero_centered_gamma
            if zero_centered_gamma is None
            else zero_centered_gamma
        )
        if not config.layernorm_zero_centered_gamma and not zero_centered:
            return upstream_new(cls, config, hidden_size, eps)
        if config.normalization != "RMSNorm":
            raise NotImplementedError(
                f"zero-centred {config.normalization} has no torch implementation here"
            )
        assert not config.persist_layer_norm, "persist_layer_norm not supported by torch norms"
        assert not config.sequence_parallel, "sequence parallel not supported by torch norms"
        assert not config.memory_efficient_layer_norm, "memory_efficient_layer_norm unsupported"
        norm_cls = ZeroCenteredTorchRMSNorm if zero_centered else torch.nn.RMSNorm
        return norm_cls(normalized_shape=hidden_size, eps=eps)

    __new__.__doc__ = upstream_new.__doc__
    REGISTRY.set_attr(torch_norm.WrappedTorchNorm, "__new__", __new__)


# --------------------------------------------------------------------------------------------
# 10. GatedDeltaNet: the flash-linear-attention kernels, on the CPU
# --------------------------------------------------------------------------------------------


def shim_gated_delta_net_without_fla() -> None:
    """Give Megatron's `GatedDeltaNet` torch versions of the two fla functions it calls.

    Why: `GatedDeltaNet.__init__` refuses to construct without flash-linear-attention (fla,
    CUDA/Triton kernels that cannot run on a CPU), and its forward calls fla's `l2norm` (on
    q and k) and `chunk_gated_delta_rule`. Bound instead, in `megatron.core.ssm.gated_delta_net`:
    `chunk_gated_delta_rule` = Megatron's own `torch_chunk_gated_delta_rule` from the same
    module (the torch chunked delta rule it runs in `deterministic_mode`), and `l2norm` =
    Hugging Face transformers' torch `l2norm` (`models.qwen3_next.modeling_qwen3_next`,
    written to match fla's, `x * rsqrt(sum(x²) + 1e-6)`; imported, not copied). `HAVE_FLA` is
    then True. Without transformers the module is left as it is (GatedDeltaNet keeps
    refusing); the causal conv already falls back to `nn.Conv1d` (no `causal_conv1d`).
    """
    from megatron.core.ssm import gated_delta_net as gdn

    hf_l2norm = _hf_l2norm()
    if gdn.HAVE_FLA and getattr(gdn, "l2norm", None) is not hf_l2norm:
        raise RuntimeError("flash-linear-attention is installed: this shim is for an fla-less CPU")
    if hf_l2norm is None:
        return
    REGISTRY.set_attr(gdn, "l2norm", hf_l2norm, must_exist=False)
    REGISTRY.set_attr(gdn, "chunk_gated_delta_rule", gdn.torch_chunk_gated_delta_rule,
                      must_exist=False)  # fmt: skip
    REGISTRY.set_attr(gdn, "HAVE_FLA", True)


def _hf_l2norm() -> Callable[..., torch.Tensor] | None:
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import l2norm
    except ImportError:
        return None
    return l2norm  # type: ignore[no-any-return]


def shim_gated_delta_net_on_cpu() -> None:
    """Let `GatedDeltaNet` allocate its conv1d, `dt_bias` and `A_log` on the CPU.

    Why: its constructor and `reset_parameters` create them with
    `device=torch.cuda.current_device()`, which raises on a CPU-only torch. Only the `torch`
    global of `megatron.core.ssm.gated_delta_net` is replaced, by a view of torch whose
    `cuda.current_device()` is "cpu"; every other attribute is torch's own, so shapes, dtypes
    and initialisation are upstream's.
    """
    from megatron.core.ssm import gated_delta_net as gdn

    if not isinstance(gdn.torch, _TorchWithCpuCurrentDevice):
        REGISTRY.set_attr(gdn, "torch", _TorchWithCpuCurrentDevice())
