"""`isoexec.megatron.engine_style`: a trainer IsoExec model driven as an engine drives its model
(paged KV cache through a shuffled block table, prefill then one token per step, GDN states
carried in place) gives the trainer's own logprobs, bitwise, for every family and dtype; the
GPU device check runs the same on the device without vLLM. Negative control: the same drive
with another attention kernel (a plain softmax over the gathered cache) differs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isoexec.megatron import build_model, load_hf_weights, megatron_parallel, score
from isoexec.megatron.attention import IsoCoreAttention
from isoexec.megatron.engine_style import EngineStyleDecode
from isoexec.tools.tiny_models import make_tiny_model

FAMILIES = ["tiny-dense", "tiny-moe", "tiny-gdn", "tiny-qwen35"]


def _model(family: str, dtype: str, tmp: Path) -> torch.nn.Module:
    d = str(make_tiny_model(family, tmp / f"{family}-{dtype}", dtype=dtype))
    m = build_model(d, isoexec=True, dtype=getattr(torch, dtype))
    load_hf_weights(m, d)
    return m


def _seq(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_style_decode_equals_the_trainers_scoring(
    family: str, dtype: str, tmp_path: Path
) -> None:
    seq = _seq(37, seed=1)
    with megatron_parallel():
        model = _model(family, dtype, tmp_path)
        ref = score(model, [seq])[0]
        with EngineStyleDecode(model) as drive:
            for prefill in (1, 5, 17, 37):  # 17: a prefill that ends inside a cache block
                assert torch.equal(drive.logprobs(seq, prefill=prefill), ref), prefill
            assert torch.equal(drive.logprobs(seq, prefill=5, temperature=0.7),
                               score(model, [seq], temperature=0.7)[0])  # fmt: skip
        # The overrides are per instance and gone on exit.
        assert not any("_attend" in m.__dict__ for m in model.modules())


def _plain_paged_attention(q, k_cache, v_cache, block_table, seq_lens, qsl, *, scale):
    """Another engine's attention: gather the prefix, one fp32 matmul-softmax-matmul."""
    n, bs = int(seq_lens[0]), k_cache.shape[1]
    pos = torch.arange(n, device=q.device)
    slots = block_table[0, pos // bs] * bs + pos % bs
    k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].float()
    v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].float()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = q.shape[0]
    s = torch.einsum("thd,nhd->htn", q.float(), k) * scale
    causal = pos[None, :] <= (n - t + torch.arange(t, device=q.device))[:, None]
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
    return torch.einsum("htn,nhd->thd", p, v).to(q.dtype)


def test_negative_control_another_attention_kernel_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seq = _seq(37, seed=2)
    with megatron_parallel():
        model = _model("tiny-dense", "float32", tmp_path)
        ref = score(model, [seq])[0]
        with EngineStyleDecode(model) as drive:
            assert torch.equal(drive.logprobs(seq, prefill=5), ref)
            for m in model.modules():
                if isinstance(m, IsoCoreAttention):
                    ops = type("Ops", (), {})()
                    ops.__dict__.update({k: getattr(m.ops, k) for k in dir(m.ops)
                                         if not k.startswith("__")})  # fmt: skip
                    ops.attention_paged = _plain_paged_attention
                    monkeypatch.setattr(m, "ops", ops)
            other = drive.logprobs(seq, prefill=5)
    diff = (other - ref).abs().max().item()
    print(f"another attention kernel: max |d logprob| {diff:.3g}")
    assert diff > 0
    assert torch.allclose(other, ref, atol=1e-4)  # the same math, other bits
