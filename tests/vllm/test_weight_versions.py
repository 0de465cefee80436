"""`WeightVersions` against a scripted engine (the order of its calls, timing and refusals):
the rules a real engine cannot be pushed into on demand. The real-engine tests are
`integration/test_weight_push_in_flight.py` and `integration/test_served_engine.py`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from isoexec.vllm.weight_versions import (
    PrefixCacheResetError,
    WeightPushBusyError,
    WeightPushFailedError,
    WeightVersions,
)


class ScriptedEngine:
    """Records the order of calls; `generate` yields `steps` outputs, one per tick."""

    def __init__(self, refuse: str | None = None, reset_ok: bool = True, steps: int = 3) -> None:
        self.calls: list[str] = []
        self.refuse, self.reset_ok, self.steps = refuse, reset_ok, steps
        self.weights = "old"

    async def generate(self, prompt: Any, params: Any, rid: str) -> AsyncIterator[str]:
        self.calls.append(f"start {rid}")
        for _ in range(self.steps):
            await asyncio.sleep(0.01)
            yield self.weights
        self.calls.append(f"end {rid}")

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        assert mode == "wait" and clear_cache
        self.calls.append("pause")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[str]:
        assert method == "isoexec_load_weights"
        if self.refuse:
            raise RuntimeError(f"Traceback ...\nWeightSyncRefusedError: {self.refuse}")
        self.calls.append("load")
        self.weights = "new"
        return ["fp-" + args[1]]

    async def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        self.calls.append("reset")
        return self.reset_ok


async def _collect(versions: WeightVersions, engine: ScriptedEngine, rid: str) -> list[Any]:
    return [(o.output, o.weights_version, o.fingerprint)
            async for o in versions.generate(engine, None, None, rid)]  # fmt: skip


def test_admitted_requests_drain_before_the_load_and_later_ones_wait() -> None:
    async def run() -> tuple[Any, ...]:
        engine, versions = ScriptedEngine(), WeightVersions()
        first = asyncio.create_task(_collect(versions, engine, "a"))
        await asyncio.sleep(0.005)  # "a" is generating
        push = asyncio.create_task(versions.push(engine, "/w", "abc"))
        await asyncio.sleep(0)
        assert not versions.admitting
        late = asyncio.create_task(_collect(versions, engine, "b"))
        return await first, await late, await push, engine.calls, versions

    first, late, pushed, calls, versions = asyncio.run(run())
    assert first == [("old", 0, None)] * 3  # wholly under version 0
    assert late == [("new", 1, "fp-abc")] * 3  # waited, then wholly under version 1
    assert pushed == ["fp-abc"] and versions.version == 1 and versions.admitting
    assert calls == ["start a", "end a", "pause", "load", "reset", "resume", "start b", "end b"]


def test_a_stuck_request_refuses_the_push_and_loads_nothing() -> None:
    async def run() -> list[str]:
        engine, versions = ScriptedEngine(steps=50), WeightVersions()
        stuck = asyncio.create_task(_collect(versions, engine, "a"))
        await asyncio.sleep(0.005)
        with pytest.raises(WeightPushBusyError, match=r"1 request\(s\) admitted"):
            await versions.push(engine, "/w", "abc", drain_timeout_s=0.05)
        assert versions.admitting and versions.version == 0  # reopened, nothing loaded
        await stuck
        return engine.calls

    calls = asyncio.run(run())
    assert "load" not in calls and "pause" not in calls


def test_a_refused_load_keeps_the_version_and_resumes() -> None:
    async def run() -> tuple[Any, ...]:
        engine, versions = ScriptedEngine(refuse="1 tensor(s) missing"), WeightVersions()
        with pytest.raises(WeightPushFailedError, match=r"^WeightSyncRefusedError: 1 tensor"):
            await versions.push(engine, "/w", "abc")
        return engine.calls, versions

    calls, versions = asyncio.run(run())
    assert calls == ["pause", "resume"] and versions.version == 0 and versions.admitting


def test_stated_versions_must_be_newer_and_are_adopted() -> None:
    async def run() -> WeightVersions:
        engine, versions = ScriptedEngine(), WeightVersions()
        await versions.push(engine, "/w", "abc", version=5)
        assert versions.version == 5
        with pytest.raises(WeightPushFailedError, match="stale weights: version 5"):
            await versions.push(engine, "/w", "def", version=5)
        await versions.push(engine, "/w", "def")
        return versions

    versions = asyncio.run(run())
    assert versions.version == 6 and versions.fingerprint == "fp-def"


def test_a_failed_prefix_reset_still_counts_the_new_weights() -> None:
    async def run() -> tuple[Any, ...]:
        engine, versions = ScriptedEngine(reset_ok=False), WeightVersions()
        with pytest.raises(PrefixCacheResetError, match="prefix cache could not be reset"):
            await versions.push(engine, "/w", "abc")
        return engine.calls, versions

    calls, versions = asyncio.run(run())
    assert calls[-1] == "resume" and versions.version == 1  # the weights did change


def test_two_pushes_run_one_after_the_other() -> None:
    async def run() -> list[str]:
        engine, versions = ScriptedEngine(), WeightVersions()
        await asyncio.gather(versions.push(engine, "/w", "a"), versions.push(engine, "/w", "b"))
        assert versions.version == 2
        return engine.calls

    assert asyncio.run(run()) == ["pause", "load", "reset", "resume"] * 2
