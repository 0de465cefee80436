"""The Triton ops the engine lets vLLM capture in CUDA graphs never sync with the host.

On CPU (interpreter) the capture guard stands in for capture: every captured op runs under
`HostSyncGuard`, which raises on any host read. The MoE experts, which used to loop over the
routed experts on the host, now run one grouped launch with the routing on the device; its
rows are bitwise those of the per-expert loop (the trainer's reference, kept as
`moe_experts_by_expert`). Negative controls: that loop, and a sync injected into an op, are
caught. On CUDA, `test_cuda_graph.py` captures the MoE block in a real CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _triton_testlib import DEVICE, kernel_marks

pytestmark = kernel_marks()

from isoexec import ops  # noqa: E402
from isoexec.ops import triton as xops  # noqa: E402
from isoexec.ops.capture_guard import HostSyncError, HostSyncGuard  # noqa: E402
from isoexec.ops.triton.moe import moe_experts_by_expert  # noqa: E402
from isoexec.ops.triton.moe_grouped import expert_layout  # noqa: E402


def _x(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _routing(t: int, k: int, e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(e, generator=g)[:k] for _ in range(t)]
    return (torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)).to(DEVICE)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise, -0.0 against +0.0 included (the slots of other ranks' experts are -0.0)."""
    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


# (tokens, top_k, experts routed over, this rank's first expert, this rank's experts)
CASES = [(1, 2, 4, 0, 4), (7, 2, 8, 0, 8), (70, 4, 8, 2, 4), (0, 2, 4, 0, 4), (130, 1, 3, 0, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k", "e", "first", "n_local"), CASES)
def test_grouped_experts_have_the_per_expert_loops_bits(
    dtype: torch.dtype, t: int, k: int, e: int, first: int, n_local: int
) -> None:
    hidden, inter = 64, 48
    x = _x(t, hidden, seed=1, dtype=dtype)
    ids = _routing(t, k, e, seed=2)
    w13 = _x(n_local, 2 * inter, hidden, seed=3, dtype=dtype, scale=0.1)
    w2 = _x(n_local, hidden, inter, seed=4, dtype=dtype, scale=0.1)
    grouped = xops.moe_experts(x, ids, w13, w2, first_expert=first)
    loop = moe_experts_by_expert(x, ids, w13, w2, first_expert=first)
    assert _same_bits(grouped, loop)


def test_expert_layout_places_every_routed_pair_once() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 5]], device=DEVICE)  # expert 5: another rank's
    rows, block_expert = expert_layout(ids, first_expert=0, n_local=4, block_m=4)
    flat = ids.reshape(-1)
    placed = rows[rows >= 0]
    assert sorted(placed.tolist()) == [0, 1, 2, 3, 4]  # pair 5 (expert 5) is left out
    for b, ex in enumerate(block_expert.tolist()):
        block = rows[b * 4 : (b + 1) * 4]
        if ex < 0:
            assert (block < 0).all()
        else:
            assert (flat[block[block >= 0]] == ex).all()
    assert block_expert[block_expert >= 0].tolist() == [0, 1, 3]  # ascending, expert 2 absent


def _captured_ops(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """One call of every Triton op `isoexec.vllm.compiled_ops` lets vLLM capture."""
    t, h, heads, d = 5, 64, 2, 32
    x, res, z = (_x(t, h, seed=s, dtype=dtype) for s in (10, 11, 12))
    w = _x(h, seed=13, dtype=dtype)
    wl = _x(96, h, seed=14, dtype=dtype, scale=0.1)
    positions = torch.tensor([0, 3, 4, 9, 2], device=DEVICE)
    logits = _x(t, 8, seed=15)
    ids = _routing(t, 2, 8, seed=16)
    weights = torch.softmax(_x(t, 2, seed=17), -1)
    w13 = _x(8, 96, h, seed=18, dtype=dtype, scale=0.1)
    w2 = _x(8, h, 48, seed=19, dtype=dtype, scale=0.1)
    sh13, sh2 = _x(96, h, seed=20, dtype=dtype, scale=0.1), _x(h, 48, seed=21, dtype=dtype)
    gate_w = _x(1, h, seed=22, dtype=dtype, scale=0.1)

    def rope() -> object:
        cos, sin = xops.rope_cos_sin(positions, d, 10000.0)
        return xops.apply_rope(x.reshape(t, heads, d), cos, sin, d)

    return {
        "rms_norm": lambda: xops.rms_norm(x, w, 1e-6),
        "rms_norm_residual": lambda: xops.rms_norm(x, w, 1e-6, residual=res),
        "gated_rms_norm": lambda: xops.gated_rms_norm(x, z, w, 1e-6),
        "linear": lambda: xops.linear(x, wl),
        "linear_tp_invariant": lambda: xops.linear_tp_invariant(x, wl),
        "silu_mul": lambda: xops.silu_mul(x),
        "rope": rope,
        # The gate is elementwise and runs the torch implementation on every backend.
        "attn_output_gate": lambda: ops.attn_output_gate(x, z),
        "moe_router": lambda: xops.moe_router(logits, 2, renormalize=True),
        "moe_combine": lambda: xops.moe_combine(
            x, weights, ids, w13, w2, shared_w13=sh13, shared_w2=sh2, shared_gate_w=gate_w
        ),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_captured_op_runs_without_a_host_sync(dtype: torch.dtype) -> None:
    for name, call in _captured_ops(dtype).items():
        with HostSyncGuard():
            try:
                call()
            except HostSyncError as err:  # pragma: no cover - the failure being tested for
                pytest.fail(f"{name}: {err}")


def test_the_per_expert_loop_is_caught() -> None:
    """Negative control: the old MoE experts read the routing on the host."""
    x, ids = _x(5, 64, seed=1), _routing(5, 2, 4, seed=2)
    w13, w2 = _x(4, 96, 64, seed=3, scale=0.1), _x(4, 64, 48, seed=4, scale=0.1)
    with HostSyncGuard(), pytest.raises(HostSyncError, match="_unique2"):
        moe_experts_by_expert(x, ids, w13, w2)


@pytest.mark.parametrize(
    ("what", "sync"),
    [
        ("Tensor.item", lambda t: t.sum().item()),
        ("Tensor.tolist", lambda t: t.tolist()),
        ("Tensor.__bool__", lambda t: bool(t.sum() > 0)),
        ("aten.nonzero", lambda t: t.nonzero()),
        ("boolean mask", lambda t: t[t > 0]),
        ("Tensor.cpu", lambda t: t.cpu()),
    ],
)
def test_a_sync_injected_into_an_op_is_caught(what: str, sync: Callable[[torch.Tensor], object]):
    """Negative control: the same linear with one host read added raises under the guard."""
    x, w = _x(5, 64, seed=1), _x(96, 64, seed=2)

    def linear_with_sync(a: torch.Tensor) -> torch.Tensor:
        y = xops.linear(a, w)
        sync(y)
        return y

    linear_with_sync(x)  # fine outside the guard
    with HostSyncGuard(), pytest.raises(HostSyncError, match=what.replace(".", r"\.")):
        linear_with_sync(x)
