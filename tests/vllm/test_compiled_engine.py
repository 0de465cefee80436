"""vLLM's default (compiled) mode computes IsoExec's bits: the same as eager, bit for bit.

The engine harness runs vLLM's default mode (torch.compile of the model); the per-family engine
invariance matrices and `integration/test_trainer_engine.py` (trainer == engine, every family
and dtype) therefore run compiled. This file shows that the compilation mode is not part of
what decides the bits, which is why the contract does not record it: the canonical ops are
opaque custom ops to torch.compile (`isoexec.vllm.compiled_ops`), so a compiled and an eager
engine return identical prompt and sampled logprobs on a mixed batch (chunked prefill,
co-batching, decode). Negative control: stock vLLM, compiled vs eager, differs (Inductor
regenerates its norms and activations; searched over a bounded list of families and dtypes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from isoexec.tools.pair import make_prompts
from isoexec.vllm.engine_process import SamplingSpec

pytestmark = pytest.mark.engine

CHUNK = 32


def _batch(engine: Any, vocab: int) -> list[tuple[Any, ...]]:
    prompts = make_prompts(5, vocab, seed=21)
    outs = engine.generate(prompts, [SamplingSpec(max_tokens=6, temperature=t, prompt_logprobs=True)
                                     for t in (1.0, 0.7, 1.0, 0.7, 1.0)])  # fmt: skip
    return [(o.prompt_logprobs, o.token_ids, o.logprobs) for o in outs]


def _run(engine_pool: Callable[..., Any], model: str, dtype: str, iso: bool, eager: bool) -> list:
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    engine = engine_pool(model=model, dtype=dtype, isoexec=iso, enforce_eager=eager,
                         max_num_batched_tokens=CHUNK)  # fmt: skip
    return _batch(engine, vocab)


@pytest.mark.parametrize(
    ("preset", "dtype"),
    # MoE and IsoExec's own Qwen3.5 class compiled: the trainer matrix (trainer == compiled
    # engine, integration/test_trainer_engine.py, which checks the engine really compiled).
    [("tiny-dense", "bfloat16"), ("tiny-gdn", "float32")],
)
def test_compiled_engine_equals_eager_engine_bitwise(
    preset: str,
    dtype: str,
    model_factory: Callable[[str, str], str],
    engine_pool: Callable[..., Any],
) -> None:
    model = model_factory(preset, dtype)
    compiled = _run(engine_pool, model, dtype, iso=True, eager=False)
    eager = _run(engine_pool, model, dtype, iso=True, eager=True)
    assert sum(len(p) + len(s) for p, _, s in compiled) > 200
    assert compiled == eager


def test_negative_control_stock_compiled_differs_from_stock_eager(
    model_factory: Callable[[str, str], str], engine_pool: Callable[..., Any]
) -> None:
    found = {}
    for preset, dtype in (("tiny-dense", "bfloat16"), ("tiny-dense", "float32"),
                          ("tiny-moe", "float32")):  # fmt: skip
        model = model_factory(preset, dtype)
        compiled = _run(engine_pool, model, dtype, iso=False, eager=False)
        eager = _run(engine_pool, model, dtype, iso=False, eager=True)
        differ = sum(a != b for (pc, _, _), (pe, _, _) in zip(compiled, eager, strict=True)
                     for a, b in zip(pc, pe, strict=True))  # fmt: skip
        found[preset, dtype] = differ
        if differ:
            break
    print("stock vLLM compiled vs eager, prompt logprobs that differ:", found)
    assert any(found.values()), found


def test_per_site_tracing_refuses_a_compiled_engine(
    model_factory: Callable[[str, str], str], engine_pool: Callable[..., Any], tmp_path: Path
) -> None:
    """Module hooks do not run inside a compiled graph: tracing says so instead of returning an
    empty trace (`isoexec pair --locate` starts its engine eager)."""
    from isoexec.vllm.engine_process import EngineError

    model = model_factory("tiny-dense", "bfloat16")
    engine = engine_pool(model=model, dtype="bfloat16", isoexec=True, enforce_eager=False,
                         max_num_batched_tokens=CHUNK)  # fmt: skip
    with pytest.raises(EngineError, match="per-site tracing needs an eager engine"):
        engine.call("trace", [[1, 2, 3]], str(tmp_path / "trace"))
