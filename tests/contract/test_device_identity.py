"""Backend detection and weight fingerprints."""

from __future__ import annotations

import pytest
import torch

from isoexec.contract.device import cpu_isa, detect_device
from isoexec.contract.fingerprint import WeightFingerprint, WeightFingerprinter, tensor_digest

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse4_2 avx avx2 fma avx512f avx512_bf16 amx_tile md_clear ibrs
processor\t: 1
flags\t\t: fpu vme sse4_2 avx avx2 fma
"""
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve sve2 bf16 i8mm cpuid\n"


def test_cpu_isa_keeps_only_kernel_relevant_flags() -> None:
    assert (
        cpu_isa(X86, machine="x86_64")
        == "x86_64:GenuineIntel:amx_tile,avx,avx2,avx512_bf16,avx512f,fma,sse4_2"
    )
    amd = X86.replace("GenuineIntel", "AuthenticAMD")
    assert cpu_isa(amd, machine="x86_64").startswith("x86_64:AuthenticAMD:amx_tile,")
    assert cpu_isa(ARM, machine="aarch64") == "aarch64:asimd,bf16,i8mm,sve,sve2"
    assert cpu_isa("", machine="riscv64") == "riscv64:baseline"


def test_detect_device_on_this_machine() -> None:
    b = detect_device("cpu", record_threads=True)
    assert b.torch == torch.__version__ and b.device_kind == "cpu" and b.cuda is None
    assert b.arch.endswith(":" + torch.backends.cpu.get_cpu_capability())
    assert b.threads == torch.get_num_threads()
    assert detect_device("cpu").threads is None
    assert detect_device("cpu", uses_triton=True).triton  # a version, or "missing"


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 6, generator=g).bfloat16(),
        "lm_head.weight": torch.randn(8, 4, generator=g),
        "model.norm.weight": torch.ones(4),
    }


def test_fingerprint_is_order_independent_and_streams() -> None:
    w = _weights()
    a = WeightFingerprint.of(w)
    b = WeightFingerprint.of(reversed(list(w.items())))  # an iterator of pairs
    assert a == b and a.digest == b.digest and a.count == 4
    assert a.differing(b) == []


def test_fingerprint_sees_one_bit_dtype_shape_and_name() -> None:
    w = _weights()
    base = WeightFingerprint.of(w)
    flipped = dict(w)
    t = w["lm_head.weight"].clone()
    t.view(torch.int32)[0, 0] ^= 1  # one ulp
    flipped["lm_head.weight"] = t
    assert WeightFingerprint.of(flipped).differing(base) == ["lm_head.weight"]
    retyped = {**w, "model.norm.weight": w["model.norm.weight"].double()}
    assert WeightFingerprint.of(retyped).digest != base.digest
    reshaped = {**w, "lm_head.weight": w["lm_head.weight"].reshape(4, 8)}  # same bytes
    assert WeightFingerprint.of(reshaped).differing(base) == ["lm_head.weight"]
    renamed = {("x." + k if k == "lm_head.weight" else k): v for k, v in w.items()}
    assert WeightFingerprint.of(renamed).differing(base) == ["lm_head.weight", "x.lm_head.weight"]


def test_fingerprint_layout_independent_but_value_exact() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    nc = t.t().contiguous().t()  # same values, column-major storage
    assert not nc.is_contiguous()
    assert tensor_digest("w", nc) == tensor_digest("w", t)
    assert tensor_digest("w", torch.tensor(0.0)) != tensor_digest("w", torch.tensor(-0.0))


def test_fingerprint_refuses_duplicates_and_non_tensors() -> None:
    fp = WeightFingerprinter()
    fp.add("a", torch.zeros(2))
    with pytest.raises(ValueError, match="weight 'a' given twice"):
        fp.add("a", torch.zeros(2))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        fp.add("b", [1.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only dense, materialised tensors"):
        fp.add("c", torch.empty(2, device="meta"))
