"""Qwen3-Next / Qwen3.5 attention on CUDA in bf16/fp16: vLLM turns on its fused q/k-norm +
RoPE + gate kernel there (`use_fused_qk_norm_rope_gate`), which is not canonical. IsoExec's
attention class switches it off and takes vLLM's unfused path, whose q/k norms and RoPE are the
layers IsoExec registered. Checked on the class, on CPU, with the flag set as CUDA would set it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import vllm.model_executor.models.qwen3_next as qwen3_next

from isoexec.vllm.gdn import IsoQwen3NextAttention

HEADS, KV_HEADS, HEAD_DIM = 2, 1, 4


def _attention(fused_flag: bool) -> Any:
    """A bare IsoQwen3NextAttention with the attributes `_project_qkv_gate` reads."""
    attn = IsoQwen3NextAttention.__new__(IsoQwen3NextAttention)
    torch.nn.Module.__init__(attn)
    attn.use_fused_qk_norm_rope_gate = fused_flag  # what vLLM sets on CUDA/XPU in bf16/fp16
    attn.attn_output_gate = True
    attn.num_heads, attn.num_kv_heads, attn.head_dim = HEADS, KV_HEADS, HEAD_DIM
    attn.q_size, attn.kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    attn.q_norm, attn.k_norm = _Norm(), _Norm()
    attn.rotary_emb = _Rope()
    return attn


class _Norm(torch.nn.Module):
    """Stands for the registered (canonical) q/k norm: identity, with the fields vLLM reads."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HEAD_DIM))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Rope:
    """Stands for the registered (canonical) RoPE: adds 1, so the test sees that it ran."""

    cos_sin_cache = torch.zeros(8, HEAD_DIM)
    rotary_dim = HEAD_DIM

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Any:
        return q + 1, k + 1


def _fused_kernel(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the fused qk-norm/rope/gate kernel ran")


def _qkv() -> torch.Tensor:
    return torch.randn(3, 2 * HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM)


def test_the_fused_kernel_is_switched_off_and_the_unfused_path_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(qwen3_next, "fused_qk_rmsnorm_rope_gate", _fused_kernel)
    attn = _attention(fused_flag=True)
    attn._take_unfused_path()
    assert attn.use_fused_qk_norm_rope_gate is False
    qkv = _qkv()
    q, _, _, gate = attn._project_qkv_gate(qkv, torch.arange(3))
    q_gate = qkv[:, : 2 * HEADS * HEAD_DIM].view(3, HEADS, 2 * HEAD_DIM)
    assert torch.equal(q, q_gate[..., :HEAD_DIM].reshape(3, -1) + 1)  # normed (identity), roped
    assert torch.equal(gate, q_gate[..., HEAD_DIM:].reshape(3, -1))


def test_negative_control_with_the_flag_left_on_the_fused_kernel_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(qwen3_next, "fused_qk_rmsnorm_rope_gate", _fused_kernel)
    attn = _attention(fused_flag=True)
    with pytest.raises(AssertionError, match="fused qk-norm/rope/gate kernel ran"):
        attn._project_qkv_gate(_qkv(), torch.arange(3))


def test_adopt_makes_only_vllms_own_attention_canonical() -> None:
    """IsoExec's Qwen3-Next model class adopts each gated attention vLLM built: same module,
    IsoExec's class, the canonical gate bound (record and function from one binding); anything
    but vLLM's own class is refused."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextAttention

    from isoexec.ops import ATTN_OUTPUT_GATE_IMPL

    stock = Qwen3NextAttention.__new__(Qwen3NextAttention)
    torch.nn.Module.__init__(stock)
    stock.use_fused_qk_norm_rope_gate = True
    same = IsoQwen3NextAttention.adopt(stock)
    assert same is stock and type(same) is IsoQwen3NextAttention
    assert same.use_fused_qk_norm_rope_gate is False
    assert same.isoexec_impl == ATTN_OUTPUT_GATE_IMPL
    assert callable(same.isoexec_ops.attn_output_gate)
    with pytest.raises(TypeError, match="cannot adopt a IsoQwen3NextAttention"):
        IsoQwen3NextAttention.adopt(same)
