"""IsoExec's CUDA attention backend (`isoexec.vllm.cuda_attention`), without a GPU or engine.

In-process (no kernel launched): registration makes `CUSTOM` and every decoder backend vLLM's
CUDA platform may pick resolve to the IsoExec class (before it: vLLM's own, or unregistered);
the class narrows vLLM's validation to what the canonical op expresses; the impl records the
engine backend's canonical attention (Triton: the Triton trainer's), which the contract
read-back finds, while vLLM's own Triton impl reads back `native:`; the impl refuses at
construction what it cannot express; full CUDA graphs are declined.

Isolated, in a subprocess with TRITON_INTERPRET=1 (`test_isolated_under_interpreter`; triton
and vLLM read the variable at import, so it cannot be set here): the impl's cache write and
forward on hand-built metadata over CPU tensors (prefill, decode, a chunk, a shuffled block
table, padded tokens, two physical cache layouts) give the hand-built cache and exactly the
canonical Triton `attention_paged`; and vLLM's CUDA platform selector (imported with its
compiled-op library stubbed, a capability faked) resolves the IsoExec class, or refuses.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import vllm.config
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends import registry
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadata

from isoexec.ops import get_backend_impl
from isoexec.vllm import cuda_attention as ca
from isoexec.vllm.layers import UnsupportedSiteError
from isoexec.vllm.readback import _impl_of
from tests._support.interpreter import pytest_under_interpreter

HERE = Path(__file__).resolve()
CUDA = torch.cuda.is_available()
H, HKV, D, BS = 4, 2, 32, 16
SCALE = D**-0.5
# (seq_len, q_len): prefill, decode, chunk continuing a prefix, decode on a block edge
REQUESTS = [(13, 13), (21, 1), (40, 12), (32, 1)]
PAD = 2  # padded tokens after the step's tokens (slot -1: written nowhere, not attended)


def _interpreting() -> bool:
    from isoexec.ops.triton._runtime import interpreting

    return interpreting()


def isolated(fn: Any) -> Any:
    """Runs where Triton kernels run: on CUDA (marked `gpu`, so the GPU pipeline's `-m gpu`
    selects it) or in the interpreter subprocess; skipped in a plain CPU process."""
    fn = pytest.mark.skipif(
        not (CUDA or _interpreting()),
        reason="needs TRITON_INTERPRET=1 set before import (test_isolated_under_interpreter)",
    )(fn)
    return pytest.mark.gpu(fn) if CUDA else fn


@pytest.fixture
def overrides(monkeypatch: pytest.MonkeyPatch) -> dict[Any, str]:
    """vLLM's process-global backend overrides, restored after the test."""
    fresh = dict(registry._ATTN_OVERRIDES)
    for name in (*ca.CUDA_AUTO_BACKENDS, "CUSTOM"):
        fresh.pop(AttentionBackendEnum[name], None)
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", fresh)
    return fresh


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A stand-in for the vLLM config an engine builds its layers under (options only)."""

    def use(backend: str) -> None:
        cfg = SimpleNamespace(
            additional_config={"isoexec": {"backend": backend}},
            parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        )
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: cfg)

    use("triton")
    return use


def _impl(cls: type = ca.IsoTritonAttentionImpl, **kw: Any) -> Any:
    args: dict[str, Any] = {"sliding_window": None, "kv_cache_dtype": "auto", **kw}
    window, kv_dtype = args.pop("sliding_window"), args.pop("kv_cache_dtype")
    return cls(H, D, SCALE, HKV, None, window, kv_dtype, **args)


def _validate(**kw: Any) -> list[str]:
    from vllm.platforms.interface import DeviceCapability

    args: dict[str, Any] = {
        "head_size": 128, "dtype": torch.bfloat16, "kv_cache_dtype": "auto", "block_size": None,
        "use_mla": False, "has_sink": False, "use_sparse": False, "use_mm_prefix": False,
        "use_per_head_quant_scales": False, "device_capability": DeviceCapability(9, 0),
        "attn_type": AttentionType.DECODER,
    }  # fmt: skip
    return ca.IsoTritonAttentionBackend.validate_configuration(**{**args, **kw})


# ---- registration and selection (in-process) -------------------------------------------------
def test_registration_resolves_cuda_picks_and_custom_to_isoexec(overrides: dict[Any, str]) -> None:
    # negative control: before registration vLLM resolves its own classes, CUSTOM is unset
    assert AttentionBackendEnum.TRITON_ATTN.get_path() == AttentionBackendEnum.TRITON_ATTN.value
    assert AttentionBackendEnum.FLASH_ATTN.get_path() == AttentionBackendEnum.FLASH_ATTN.value
    with pytest.raises(ValueError, match="must be registered"):
        AttentionBackendEnum.CUSTOM.get_path()
    cpu_before = AttentionBackendEnum.CPU_ATTN.get_path()

    ca.register_cuda_attention()
    for name in ("CUSTOM", *ca.CUDA_AUTO_BACKENDS):
        assert AttentionBackendEnum[name].get_class() is ca.IsoTritonAttentionBackend, name
    assert AttentionBackendEnum.CPU_ATTN.get_path() == cpu_before  # attention.py's business
    # vLLM maps the backend's name back to its enum member (`Attention.backend`)
    assert AttentionBackendEnum[ca.IsoTritonAttentionBackend.get_name()].get_class() is (
        ca.IsoTritonAttentionBackend
    )


def test_every_backend_the_cuda_platform_may_pick_is_overridden() -> None:
    """Drift guard: the non-MLA names in vLLM's CUDA priority lists (read from the source:
    `vllm.platforms.cuda` does not import without vLLM's CUDA library)."""
    import vllm.platforms

    src = (Path(vllm.platforms.__file__).parent / "cuda.py").read_text()
    fn = next(
        n
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.FunctionDef) and n.name == "_get_backend_priorities"
    )
    named = {
        n.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "AttentionBackendEnum"
    }
    decoder = {name for name in named if "MLA" not in name}
    assert decoder, "no decoder backends found: vLLM's CUDA selection changed shape"
    assert decoder <= set(ca.CUDA_AUTO_BACKENDS), decoder - set(ca.CUDA_AUTO_BACKENDS)


def test_validation_admits_plain_decoder_attention_and_names_the_rest() -> None:
    assert _validate() == []
    assert _validate(dtype=torch.float32, kv_cache_dtype="bfloat16") == []
    refused = {
        "sliding window": {"has_sliding_window": True},
        "sinks": {"has_sink": True},
        "kv_cache_dtype": {"kv_cache_dtype": "fp8"},
        "encoder": {"attn_type": AttentionType.ENCODER_ONLY},
        "non-causal": {"use_non_causal": True},
        "multimodal": {"use_mm_prefix": True},
        "R-SWA": {"use_rswa": True},
        "MLA": {"use_mla": True},
    }
    for why, kw in refused.items():
        assert _validate(**kw), f"{why} admitted"


def test_builder_declines_full_cuda_graphs() -> None:
    builder = ca.IsoTritonAttentionBackend.get_builder_cls()
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER  # type: ignore[arg-type]


# ---- the impl: what it records, what it refuses (in-process) ---------------------------------
def test_impl_records_the_canonical_attention_the_readback_finds(engine: Any) -> None:
    triton_impl = get_backend_impl("attention", "triton")
    impl = _impl()
    assert impl.isoexec_impl == triton_impl  # what a Triton-backend trainer records
    assert [b.backend for b in impl.ops.bindings] == ["triton"]
    assert _impl_of(SimpleNamespace(impl=impl), "attention") == triton_impl
    # negative control: vLLM's own Triton impl at the same site reads back native
    native = _impl_of(SimpleNamespace(impl=_impl(TritonAttentionImpl)), "attention")
    assert native.impl_id == "native:TritonAttentionImpl"
    # the torch backend records (and runs) the torch op: a different contract
    engine("torch")
    assert _impl().isoexec_impl == get_backend_impl("attention", "torch") != triton_impl


@pytest.mark.parametrize(
    "kw",
    [
        {"sliding_window": 8},
        {"sinks": torch.zeros(H)},
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype": "int8_per_token_head"},
        {"logits_soft_cap": 30.0},
        {"attn_type": AttentionType.ENCODER_ONLY},
        {"chunk_lookback": 4},
        {"use_alibi_sqrt": True},
    ],
    ids=lambda kw: next(iter(kw)) + ("=" + kw["kv_cache_dtype"] if "kv_cache_dtype" in kw else ""),
)
def test_impl_refuses_at_construction(engine: Any, kw: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedSiteError, match="canonical attention does not support"):
        _impl(**kw)


def test_impl_refuses_non_causal_steps_and_output_quant(engine: Any) -> None:
    impl, out = _impl(), torch.zeros(1, H, D)
    meta = _metadata(*_tables(torch.zeros(1, 2, dtype=torch.int32), [(1, 1)]), causal=False)
    with pytest.raises(UnsupportedSiteError, match="causal"):
        impl.forward(None, out, out, out, torch.zeros(2, HKV, BS, 2 * D), meta, out)
    with pytest.raises(UnsupportedSiteError, match="quantization"):
        impl.forward(None, out, out, out, out, None, out, output_scale=torch.ones(1))


# ---- hand-built steps ------------------------------------------------------------------------
def _tables(block_table: torch.Tensor, requests: list[tuple[int, int]]) -> tuple[Any, ...]:
    qlens = [q for _, q in requests]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for n, _ in requests], dtype=torch.int32)
    return block_table, qsl, seq_lens


def _metadata(
    block_table: torch.Tensor,
    qsl: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor | None = None,
    causal: bool = True,
) -> TritonAttentionMetadata:
    """What vLLM's Triton builder hands the impl (its scratch unused by the canonical op)."""
    scratch = torch.empty(0)
    qlens = (qsl[1:] - qsl[:-1]).tolist()
    return TritonAttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(qlens),
        query_start_loc=qsl.to(block_table.device),
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens.to(block_table.device),
        block_table=block_table,
        slot_mapping=slot_mapping if slot_mapping is not None else torch.empty(0),
        seq_threshold_3D=1,
        num_par_softmax_segments=16,
        softmax_segm_output=scratch,
        softmax_segm_max=scratch,
        softmax_segm_expsum=scratch,
        causal=causal,
    )


def _step(dtype: torch.dtype, layout: str, device: str, seed: int = 0) -> dict[str, Any]:
    """A garbage-filled cache in vLLM's Triton logical shape `[nb, Hkv, bs, 2D]` with the given
    physical layout (HND: as is; NHD: slots outer to heads), a shuffled block table padded with
    a stray block id, and one step: its queries, keys, values and slot mapping (padded)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n, _ in REQUESTS]
    nb = sum(need) + 3
    if layout == "HND":
        kv_cache = torch.randn(nb, HKV, BS, 2 * D, generator=g).to(dtype)
    else:
        kv_cache = torch.randn(nb, BS, HKV, 2 * D, generator=g).to(dtype).transpose(1, 2)
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(need) + 1
    table = torch.tensor(perm[-1:] * width, dtype=torch.int32).repeat(len(REQUESTS), 1)
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    slots = []
    for r, (n, q) in enumerate(REQUESTS):
        for p in range(n - q, n):
            slots.append(int(table[r, p // BS]) * BS + p % BS)
    t = len(slots) + PAD
    # key/value as vLLM passes them: strided views into one fused projection output
    qkv = torch.randn(t, (H + 2 * HKV) * D, generator=g).to(dtype)
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    c = {
        "kv_cache": kv_cache,
        "query": q.reshape(t, H, D),
        "key": k.view(t, HKV, D),
        "value": v.view(t, HKV, D),
        "slot_mapping": torch.tensor([*slots, *[-1] * PAD], dtype=torch.int64),
        "block_table": table,
    }
    return {name: x.to(device) for name, x in c.items()}


def _expected_cache(c: dict[str, Any]) -> torch.Tensor:
    """The cache after the step's write, by hand: row (block, head, slot) = K | V."""
    exp = c["kv_cache"].clone()
    for t, slot in enumerate(c["slot_mapping"].tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, BS)
        exp[blk, :, off, :D] = c["key"][t]
        exp[blk, :, off, D:] = c["value"][t]
    return exp


# ---- isolated: under TRITON_INTERPRET=1 (or on CUDA) ----------------------------------------
@isolated
@pytest.mark.parametrize(
    ("dtype", "layout"), [(torch.float32, "HND"), (torch.bfloat16, "NHD")], ids=["fp32", "bf16"]
)
def test_kernel_forward_writes_the_cache_and_equals_the_canonical_op(
    engine: Any, dtype: torch.dtype, layout: str
) -> None:
    from isoexec.ops.triton import attention as x_attn

    device = "cuda" if CUDA else "cpu"
    c = _step(dtype, layout, device)
    expected_cache = _expected_cache(c)
    meta = _metadata(*_tables(c["block_table"], REQUESTS), slot_mapping=c["slot_mapping"])
    n = meta.num_actual_tokens
    assert c["query"].shape[0] == n + PAD and not c["key"].is_contiguous()

    impl = _impl()
    storage = c["kv_cache"].untyped_storage().data_ptr()
    impl.do_kv_cache_update(None, c["key"], c["value"], c["kv_cache"], c["slot_mapping"])
    assert c["kv_cache"].untyped_storage().data_ptr() == storage  # written in place
    assert torch.equal(c["kv_cache"], expected_cache), "cache differs from the hand-built one"

    output = torch.full((n + PAD, H, D), 7.0, dtype=dtype, device=device)
    got = impl.forward(None, c["query"], c["key"], c["value"], c["kv_cache"], meta, output)
    assert got is output and bool((output[n:] == 7.0).all()), "padded rows were written"

    # the canonical op on contiguous K/V `[nb, bs, Hkv, D]` taken from the hand-built cache
    k_ref = expected_cache[..., :D].transpose(1, 2).contiguous()
    v_ref = expected_cache[..., D:].transpose(1, 2).contiguous()
    ref = x_attn.attention_paged(
        c["query"][:n], k_ref, v_ref, c["block_table"], meta.seq_lens, meta.query_start_loc,
        scale=SCALE,
    )  # fmt: skip
    assert torch.equal(output[:n], ref), "forward differs from the canonical attention_paged"
    # the pure prefill (request 0): the trainer's packed path over the step's own keys
    q0 = REQUESTS[0][1]
    cu = torch.tensor([0, q0], device=device)
    packed = x_attn.attention_varlen(
        c["query"][:q0], c["key"][:q0], c["value"][:q0], cu, scale=SCALE
    )
    assert torch.equal(output[:q0], packed), "prefill differs from packed varlen attention"


@isolated
def test_kernel_write_refuses_a_converting_cache(engine: Any) -> None:
    c = _step(torch.float32, "HND", "cuda" if CUDA else "cpu")
    with pytest.raises(UnsupportedSiteError, match="converting"):
        _impl().do_kv_cache_update(
            None, c["key"], c["value"], c["kv_cache"].to(torch.bfloat16), c["slot_mapping"]
        )


@pytest.fixture
def cuda_platform(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's CUDA platform class; on a CPU build its compiled-op library is stubbed (only
    the selection logic runs). The module stays imported in this (isolated) process."""
    try:
        import vllm.platforms.cuda as cuda
    except ImportError:
        monkeypatch.setitem(
            sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch")
        )
        import vllm.platforms.cuda as cuda
    return cuda.CudaPlatform


@isolated
@pytest.mark.parametrize("major", [9, 10])
def test_isolated_cuda_platform_selects_isoexec(
    cuda_platform: Any, overrides: dict[Any, str], monkeypatch: pytest.MonkeyPatch, major: int
) -> None:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    cap = DeviceCapability(major, 0)
    monkeypatch.setattr(cuda_platform, "get_device_capability", classmethod(lambda c, i=0: cap))
    qwen3 = AttentionSelectorConfig(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None
    )

    def select(selected: Any, cfg: AttentionSelectorConfig = qwen3) -> str:
        return cuda_platform.get_attn_backend_cls(selected, attn_selector_config=cfg)

    # negative control: without IsoExec, vLLM's CUDA selection picks one of its own kernels
    assert select(None) != ca.BACKEND_PATH
    ca.register_cuda_attention()
    for selected in (None, *(AttentionBackendEnum[n] for n in ("CUSTOM", *ca.CUDA_AUTO_BACKENDS))):
        assert select(selected) == ca.BACKEND_PATH, selected
    # what the canonical op cannot express is refused, never served by a native kernel
    for cfg in (qwen3._replace(has_sliding_window=True), qwen3._replace(kv_cache_dtype="fp8")):
        with pytest.raises(ValueError, match=r"not valid|No valid attention backend"):
            select(None, cfg)
        with pytest.raises(ValueError, match="not valid"):
            select(AttentionBackendEnum.CUSTOM, cfg)


@pytest.mark.skipif(CUDA, reason="a CUDA machine runs the isolated tests in-process")
@pytest.mark.skipif(_interpreting(), reason="already under the interpreter")
def test_isolated_under_interpreter() -> None:
    pytest_under_interpreter(str(HERE), "-k", "kernel or isolated_cuda")
