"""Weight versions on a generating engine: every sequence is sampled under one version, and
knows which.

An RL run that keeps the engine generating while the trainer steps (asynchronous RL, agent
loops) pushes new weights while requests are in flight. Loaded between two decode steps, the
new weights would finish sequences the old ones began: logprobs no trainer scoring can match,
with nothing to say why. `WeightVersions` is the one implementation of the push that cannot do
that, shared by the OpenAI server's weight route (`served_routes`) and by a framework that
drives vLLM's `AsyncLLM` itself:

1. admission closes: a request that has not been admitted waits (`generate`) or is refused by
   the caller (the server answers 503 while its sampling gate is shut);
2. the requests already admitted drain: each finishes under the version it was admitted under.
   Counting admissions, not only what the engine holds, matters: a request admitted just
   before the push may still be in transit (detokenising, queued) when vLLM pauses, and would
   be scheduled after the load while its record named the old version;
3. vLLM's own `pause_generation(mode="wait")` holds everything else (the canary's requests),
   the workers load the pushed file through `isoexec_load_weights` (MATCH, tensor set,
   fingerprint: refused loads nothing), the prefix cache is reset (its KV came from the old
   weights), the version counter goes up, and generation resumes.

Drain, not abort-and-requeue: an aborted sequence would be sampled again from its prompt under
the new weights, so the rollout the trainer scores is not the one the engine began, and the
tokens spent on it are lost; draining costs the push the length of the longest sequence in
flight, bounded by `drain_timeout_s` (past it the push is refused and nothing is loaded).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

DRAIN_TIMEOUT_S = 600.0  # a rollout of a few thousand tokens on a slow engine


class WeightPushBusyError(RuntimeError):
    """Requests admitted before the push did not finish in time: nothing was loaded."""


class WeightPushFailedError(RuntimeError):
    """The workers refused the pushed weights (or failed): nothing was loaded."""


class PrefixCacheResetError(WeightPushFailedError):
    """The weights were loaded (the version went up) but the prefix cache kept old KV."""


@dataclass(frozen=True)
class VersionedOutput:
    """One output of a request, with the weights it was sampled under: `weights_version`
    (0 = the checkpoint the engine started from, +1 per push) and `fingerprint` (of the
    weights the workers hold at that version; None for the starting checkpoint)."""

    output: Any  # vllm.RequestOutput
    weights_version: int
    fingerprint: str | None


class WeightVersions:
    """The weights version of one engine and the admission count that makes pushes safe."""

    def __init__(self) -> None:
        self.version = 0
        self.fingerprint: str | None = None
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self._open: asyncio.Event | None = None
        self._one_push: asyncio.Lock | None = None

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        # Created on first use, inside the running loop (the server's module-level instance is
        # built at import, before any loop exists).
        if self._idle is None or self._open is None:
            self._idle, self._open = asyncio.Event(), asyncio.Event()
            self._one_push = asyncio.Lock()
            self._idle.set()
            self._open.set()
        return self._idle, self._open

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def admitting(self) -> bool:
        return self._open is None or self._open.is_set()

    def admit(self) -> int:
        """Count one request in; the version it will be sampled under. Call `release` when its
        last output is out. Only while `admitting` (the caller checks; `generate` waits)."""
        idle, _ = self._events()
        if not self.admitting:
            raise RuntimeError("a weight push is in progress: not admitting")
        self._in_flight += 1
        idle.clear()
        return self.version

    def release(self) -> None:
        idle, _ = self._events()
        self._in_flight -= 1
        if self._in_flight == 0:
            idle.set()

    def check_newer(self, version: int | None) -> None:
        """Refuse a stated version that is not newer than the held one (a trainer restarted
        from an old checkpoint); None (the next version) always is."""
        if version is not None and version <= self.version:
            raise WeightPushFailedError(
                f"stale weights: version {version}, the engine holds version {self.version} "
                "(a push must be newer); nothing loaded"
            )

    def bump(self) -> int:
        """A new version without a base-weight load (a pushed LoRA adapter): what is served
        changed, so what was cleared before is not cleared for it."""
        self.version += 1
        return self.version

    async def generate(
        self, engine: Any, prompt: Any, params: Any, request_id: str, **kwargs: Any
    ) -> AsyncIterator[VersionedOutput]:
        """`engine.generate(...)` (an `AsyncLLM`) whose outputs carry the weights version they
        were sampled under; waits while a push is in progress."""
        _, open_ = self._events()
        await open_.wait()
        version = self.admit()
        fingerprint = self.fingerprint
        try:
            async for out in engine.generate(prompt, params, request_id, **kwargs):
                yield VersionedOutput(out, version, fingerprint)
        finally:
            self.release()

    async def push(
        self,
        engine: Any,
        path: str,
        fingerprint: str,
        *,
        version: int | None = None,
        allow_nonfinite: bool = False,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> list[str]:
        """Load the safetensors file `path` (HF-named weights hashing to `fingerprint`) on
        every worker of `engine`, with no sequence straddling the load (module docstring), as
        weights version `version` (the trainer's numbering; it must be newer than the held
        one) or, if None, the next. Returns each worker's fingerprint of what it then holds.
        One push at a time: a second waits for the first."""
        idle, open_ = self._events()
        assert self._one_push is not None
        async with self._one_push:
            self.check_newer(version)
            return await self._push(engine, path, fingerprint, version, allow_nonfinite,
                                    drain_timeout_s, idle, open_)  # fmt: skip

    async def _push(
        self,
        engine: Any,
        path: str,
        fingerprint: str,
        version: int | None,
        allow_nonfinite: bool,
        drain_timeout_s: float,
        idle: asyncio.Event,
        open_: asyncio.Event,
    ) -> list[str]:
        open_.clear()
        try:
            try:
                await asyncio.wait_for(idle.wait(), drain_timeout_s)
            except TimeoutError:
                raise WeightPushBusyError(
                    f"{self._in_flight} request(s) admitted before the push were still "
                    f"generating after {drain_timeout_s:.0f} s; nothing loaded"
                ) from None
            await engine.pause_generation(mode="wait", clear_cache=True)
            try:
                try:
                    got = await engine.collective_rpc(
                        "isoexec_load_weights", args=(path, fingerprint, allow_nonfinite)
                    )
                except Exception as e:  # a worker refused (gate, tensor set, fingerprint)
                    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
                    raise WeightPushFailedError(lines[-1] if lines else type(e).__name__) from e
                # Cached KV was computed with the old weights: a prefix hit would mix them in.
                reset = await engine.reset_prefix_cache(reset_running_requests=True)
                self.version = self.version + 1 if version is None else version
                self.fingerprint = str(got[0])
                if not reset:
                    raise PrefixCacheResetError(
                        "weights loaded, but the prefix cache could not be reset: samples may "
                        "reuse KV of the old weights (retry when the engine is idle)"
                    )
            finally:
                await engine.resume_generation()
        finally:
            open_.set()
        return [str(g) for g in got]


__all__ = [
    "DRAIN_TIMEOUT_S",
    "PrefixCacheResetError",
    "VersionedOutput",
    "WeightPushBusyError",
    "WeightPushFailedError",
    "WeightVersions",
]
