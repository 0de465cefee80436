"""The engine refuses, at model construction, the parallel layouts IsoExec has not made
canonical (it never declares them canonical): pipeline, data, expert and context parallelism.
Tensor parallelism alone passes (per-site records and `linear_tp`, tested on real engines in
`integration/test_engine_tp.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import vllm.config
from vllm.config import ParallelConfig

from isoexec.vllm.layers import UnsupportedSiteError, check_engine_layout


def _with(monkeypatch: pytest.MonkeyPatch, **fields: object) -> None:
    cfg = SimpleNamespace(parallel_config=ParallelConfig(**fields))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: cfg)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"data_parallel_size": 2}, "data_parallel_size=2"),
        ({"enable_expert_parallel": True}, "enable_expert_parallel"),
        ({"decode_context_parallel_size": 2, "tensor_parallel_size": 2},
         "decode_context_parallel_size=2"),
    ],
)  # fmt: skip
def test_unsupported_layouts_are_refused(
    monkeypatch: pytest.MonkeyPatch, fields: dict[str, object], named: str
) -> None:
    _with(monkeypatch, **fields)
    with pytest.raises(UnsupportedSiteError, match=named):
        check_engine_layout()


def test_tensor_parallelism_alone_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    _with(monkeypatch, tensor_parallel_size=2)
    check_engine_layout()
