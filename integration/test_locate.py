"""`isoexec locate` on real traces: a real vLLM engine (own process) and the real Megatron
trainer, each recording every site's output per token for the same sequences.

- IsoExec on both sides: every compared site is bitwise equal (otherwise locate is useless);
- a one-ulp change at one site of one layer on the trainer: `locate` names that site, layer
  and position, with a one-ulp size;
- a changed kernel in one layer (8 accumulator lanes in layer 1's attention, the handshake's
  negative control): `locate` names exactly `layers.1.self_attn.core`;
- the native arm (IsoExec off on both sides): a real first divergence, with equal sites
  before it.
Traced sequences run one at a time (prompt-only scoring on the engine), see `isoexec.vllm.trace`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _faults import narrow_attention_lanes

from isoexec import ops
from isoexec.contract.trace import Trace
from isoexec.megatron.trace import trace_trainer
from isoexec.tools.locate import format_result, locate
from isoexec.tools.pair import locate_pair, make_prompts

pytestmark = [pytest.mark.engine, pytest.mark.trainer]

CHUNK = 64  # the engine configs of test_trainer_engine.py: the pool shares them


def _hf(model: str) -> dict[str, Any]:
    return json.loads((Path(model) / "config.json").read_text())


def _sequences(model_dir: str) -> list[list[int]]:
    """A long one (prefilled in several chunks of CHUNK) and a short one."""
    prompts = make_prompts(2, int(_hf(model_dir)["vocab_size"]), seed=11)
    assert len(prompts[0]) > 2 * CHUNK and len(prompts[1]) < CHUNK
    return prompts


@pytest.fixture(scope="module")
def dense(model_factory: Callable[[str, str], str]) -> str:
    return model_factory("tiny-dense", "float32")


@pytest.fixture(scope="module")
def iso_engine_trace(
    dense: str, engine_pool: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> Trace:
    engine = engine_pool(
        model=dense, dtype="float32", isoexec=True, max_num_batched_tokens=CHUNK, enforce_eager=True
    )  # tracing needs eager (module hooks)
    path = tmp_path_factory.mktemp("traces") / "engine.trace.json"
    summary = engine.call("trace", _sequences(dense), str(path), True)
    assert summary["sequences"] == 2
    return Trace.read(path)


@pytest.fixture()
def fresh_trainer(dense: str, trainer_factory: Callable[..., Any]) -> Iterator[Any]:
    yield trainer_factory(dense, "float32", fresh=True)


def test_isoexec_traces_are_bitwise_equal_at_every_site(
    dense: str, iso_engine_trace: Trace, trainer_factory: Callable[..., Any]
) -> None:
    trainer = trainer_factory(dense, "float32")
    t = trace_trainer(trainer, dense, _sequences(dense))
    r = locate(t, iso_engine_trace)
    print(format_result(r))
    assert not r.diverged, format_result(r)
    assert not r.one_sided, r.one_sided  # dense: every site is compared, rope and lm head too
    assert r.sites_compared == len(t.sites)
    total = sum(map(len, _sequences(dense)))
    # every compared site has a row per position; logprobs one fewer per sequence
    assert r.rows_compared == (r.sites_compared - 1) * total + (total - 2)
    # tracing left nothing behind: the model has no hooks and rope is the canonical function
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in trainer.modules())
    assert ops.apply_rope.__module__ == "isoexec.ops.rope"


class _OneUlpDownProj:
    """A forward hook adding one ulp to one element of one token's down_proj output."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def __call__(self, module: Any, args: Any, out: Any) -> Any:
        y, bias = out
        y = y.clone()
        row = y.reshape(y.shape[0], -1)[self.pos]  # [s, b=1, H] -> token row
        row[5] = torch.nextafter(row[5], torch.tensor(float("inf")))
        return y, bias


def test_one_ulp_at_one_site_is_located_exactly(
    dense: str, iso_engine_trace: Trace, fresh_trainer: Any, tmp_path: Path
) -> None:
    handle = fresh_trainer.decoder.layers[0].mlp.linear_fc2.register_forward_hook(
        _OneUlpDownProj(pos=37)
    )
    try:
        t = trace_trainer(fresh_trainer, dense, _sequences(dense)[:1])
    finally:
        handle.remove()
    r = locate(t, iso_engine_trace)
    print(format_result(r))
    assert r.first is not None
    d = r.first
    assert (d.site, d.layer, d.pos, d.seq) == ("layers.0.mlp.down_proj", 0, 37, 0)
    assert d.differing == 1 and d.rows_differing == 1
    ulp = float(torch.finfo(torch.float32).eps) * max(d.a.max_abs, 1.0)
    assert d.max_abs_diff is not None and 0 < d.max_abs_diff <= ulp


def test_changed_lanes_in_one_layer_is_located_there(
    dense: str,
    engine_pool: Callable[..., Any],
    iso_engine_trace: Trace,
    fresh_trainer: Any,
    tmp_path: Path,
) -> None:
    """Through `locate_pair` (what `isoexec pair --locate` runs) and the `isoexec locate` CLI."""
    from isoexec.tools.cli import main

    core = fresh_trainer.decoder.layers[1].self_attention.core_attention
    narrow_attention_lanes(core)
    engine = engine_pool(
        model=dense, dtype="float32", isoexec=True, max_num_batched_tokens=CHUNK, enforce_eager=True
    )  # tracing needs eager (module hooks)
    r = locate_pair(engine, fresh_trainer, _hf(dense), _sequences(dense), tmp_path)
    print(format_result(r))
    assert r.first is not None
    assert (r.first.site, r.first.layer) == ("layers.1.self_attn.core", 1)
    assert r.first.max_abs_diff is not None and 0 < r.first.max_abs_diff < 1e-4
    # layer 0 entirely and layer 1 up to its rope are equal
    names = [s for s, _ in iso_engine_trace.sites]
    assert r.sites_equal_before == names.index("layers.1.self_attn.core")
    rc = main(["locate", str(tmp_path / "trainer.trace.json"), str(tmp_path / "engine.trace.json")])
    assert rc == 1


def test_native_arm_has_a_real_first_divergence(
    dense: str,
    engine_pool: Callable[..., Any],
    trainer_factory: Callable[..., Any],
    tmp_path: Path,
) -> None:
    engine = engine_pool(
        model=dense,
        dtype="float32",
        isoexec=False,
        max_num_batched_tokens=CHUNK,
        enforce_eager=True,
    )  # tracing needs eager (module hooks)
    trainer = trainer_factory(dense, "float32", isoexec=False)
    r = locate_pair(engine, trainer, _hf(dense), _sequences(dense), tmp_path)
    report = format_result(r)
    print(report)
    assert r.first is not None, report
    # A real divergence: recorded on both sides, every compared site before it equal, and the
    # traces on disk say the same through the CLI.
    t = Trace.read(tmp_path / "trainer.trace.json")
    e = Trace.read(tmp_path / "engine.trace.json")
    d = r.first
    assert (d.seq, d.site, d.pos) in t.rows and (d.seq, d.site, d.pos) in e.rows
    assert t.rows[(d.seq, d.site, d.pos)].digest != e.rows[(d.seq, d.site, d.pos)].digest
    names = [s for s, _ in t.sites]
    for site in names[: names.index(d.site)]:
        keys = [k for k in t.rows if k[1] == site and k in e.rows]
        assert all(t.rows[k].digest == e.rows[k].digest for k in keys), site
    assert d.layer == 0  # stock kernels already differ in the first layer (e.g. C++ rope)
    assert d.max_abs_diff is not None and 0 < d.max_abs_diff < 1e-3  # same model, other kernels
