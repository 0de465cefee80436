"""Every family's IsoExec engine runs its captured ops without a host sync (Triton backend).

On CUDA, vLLM captures IsoExec's ops in CUDA graphs, where a host sync fails capture. CPU vLLM
captures nothing, so here each family's engine runs with the Triton backend under the
interpreter and `ISOEXEC_CAPTURE_GUARD=1`: every captured op's body raises on a host read
(`isoexec.ops.capture_guard`), so an engine that prefills (one prompt in chunks) and decodes
has no sync in any of them. The dense family's guarded engine is also the one
`test_backend_switch.py` pairs bitwise with a Triton trainer. Control: the setting reaches the
engine process (a malformed one refuses the engine at start-up); that the guard raises inside
a registered op is `tests/vllm/test_graph_safety.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from isoexec.contract.options import IsoExecOptions
from isoexec.ops.capture_guard import CAPTURE_GUARD_ENV
from isoexec.vllm.engine_process import EngineError, SamplingSpec

pytestmark = [pytest.mark.engine]

TRITON = IsoExecOptions(backend="triton")
GUARDED = (("TRITON_INTERPRET", "1"), (CAPTURE_GUARD_ENV, "1"))
# vLLM's warm-up forward has max_num_batched_tokens rows: keep it small, interpreted.
SMALL = dict(max_model_len=128, max_num_batched_tokens=32, kv_cache_bytes=8 * 2**20)


# MoE's cell (74 s) is `matrix` for CI time; GDN's, the one read to break under graphs, runs.
@pytest.mark.parametrize("family", [pytest.param("tiny-moe", marks=pytest.mark.matrix), "tiny-gdn"])
def test_engine_runs_under_the_capture_guard(
    family: str, model_factory: Callable[[str, str], str], engine_pool: Callable[..., Any]
) -> None:
    model = model_factory(family, "float32")
    engine = engine_pool(
        model=model, dtype="float32", isoexec=True, options=TRITON, extra_env=GUARDED, **SMALL
    )
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (40, 6)]
    out = engine.generate(prompts, [SamplingSpec(max_tokens=3, temperature=1.0)] * 2)
    assert [len(o.token_ids) for o in out] == [3, 3]


def test_a_malformed_guard_setting_refuses_the_engine(
    model_factory: Callable[[str, str], str],
) -> None:
    from isoexec.vllm.engine_process import EngineConfig, EngineProcess

    cfg = EngineConfig(
        model=model_factory("tiny-dense", "float32"), dtype="float32", isoexec=True,
        extra_env=((CAPTURE_GUARD_ENV, "yes"),), **SMALL,
    )  # fmt: skip
    with pytest.raises(EngineError, match=CAPTURE_GUARD_ENV):
        EngineProcess(cfg, start_timeout_s=300).close()
