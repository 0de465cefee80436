"""One RL run on a Ray cluster: the handshake service, the trainer ranks and the engines as
actors, placed by placement groups; the gate and the weight sync between them.

    with RayRun(RaySpec(side=SideSpec(ModelSource(preset="tiny-dense")), tls=tls)) as run:
        run.handshake()                   # every trainer rank and engine worker offers: MATCH,
                                          # then the numeric canary of the starting weights
        comps = run.generate(prompts, SamplingSpec(max_tokens=8))
        run.score(comps)                  # == each completion's logprobs, bit for bit
        run.train_step(comps, advantages)
        run.sync_weights()                # object store, chunked; each engine through the gate,
                                          # then the canary of the new weights version

Everything the run starts it ends (`close`, also on error or interrupt): actors are killed and
placement groups removed, so a failed start leaves nothing pending on the cluster.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from isoexec.ray.actors import EngineActor, HandshakeActor, SideSpec, TrainerActor
from isoexec.ray.cluster import Bundle, release, reserve
from isoexec.ray.identity import RuntimeIdentity, require_same
from isoexec.ray.tls import TLSMaterial
from isoexec.ray.weights import DEFAULT_CHUNK_BYTES, WeightManifest, free, merge


class RunRefusedError(RuntimeError):
    """A handshake did not MATCH, or weights were refused: the run must not go on."""


class EngineLostError(RunRefusedError):
    """An engine's actor died during a call (its node lost or its process killed): Ray
    restarts it on the checkpoint it starts from, where it holds no MATCH."""

    def __init__(self, engines: Sequence[int], during: str, cause: BaseException) -> None:
        self.engines = tuple(engines)
        super().__init__(
            f"engine(s) {list(self.engines)} lost during {during} ({type(cause).__name__}: its "
            "node or process died); nothing it staged was loaded. Ray restarts it on its "
            "starting checkpoint: wait_for_engine(i), handshake(engines=[i]), then sync again"
        )


@dataclass(frozen=True)
class RaySpec:
    side: SideSpec  # what both sides are built with
    trainer_side: SideSpec | None = None  # the trainer's, where it differs (a refusal test)
    trainer_ranks: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    engines: int = 1
    engine_tp: int = 1
    # What each trainer rank / engine asks of a node (Ray resources); e.g. {"GPU": 1}.
    trainer_bundle: Bundle = field(default_factory=lambda: {"CPU": 1})
    engine_bundle: Bundle = field(default_factory=lambda: {"CPU": 1})
    tls: TLSMaterial | None = None
    # Without `tls` the service refuses to bind a non-loopback address unless this is True
    # (the token would cross the network in the clear): e.g. a test cluster on one machine.
    insecure: bool = False
    run_id: str = "isoexec-ray"
    placement_timeout_s: float = 120.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    lr: float = 2e-2
    # Tokens per training unit: DP ranks split a step's batch by these packs (the step's bits
    # depend on this value, not on the DP degree).
    pack_tokens: int = 256
    seed: int = 0  # the engines' sampling seed
    engine_max_restarts: int = 1  # Ray restarts a dead engine this often (it must re-offer)

    def __post_init__(self) -> None:
        if self.trainer_ranks % (self.tp * self.pp) != 0:
            raise ValueError(f"trainer_ranks={self.trainer_ranks} is not a multiple of tp*pp")
        if self.engines < 1 or self.trainer_ranks < 1:
            raise ValueError("a run needs at least one trainer rank and one engine")


class RayRun:
    """Start with the context manager (or `start`/`close`)."""

    def __init__(self, spec: RaySpec, *, identity: RuntimeIdentity | None = None) -> None:
        self.spec = spec
        self.identity = identity or RuntimeIdentity.here()  # what every actor must run
        self.token = secrets.token_hex(16)
        self.trainers: list[Any] = []
        self.engines: list[Any] = []
        self.handshake_actor: Any = None
        self.address: str | None = None
        self._groups: list[Any] = []
        self.version = 0  # the weights version: 0 as loaded at start, +1 per sync
        self._stepped = False  # the trainer stepped since the last sync: it holds no version
        # engine index -> (version, actor pid) of its last canary MATCH: what `generate` checks
        self._cleared: dict[int, tuple[int, int]] = {}

    # ---- lifetime -----------------------------------------------------------------------
    def __enter__(self) -> RayRun:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        import ray

        s = self.spec
        if s.side.isoexec and s.tls is None and not s.insecure:
            raise RunRefusedError(
                "the handshake service of a Ray run binds its node's network address: give "
                "RaySpec(tls=TLSMaterial...) or, on one machine only, insecure=True"
            )
        t_pg = reserve([s.trainer_bundle] * s.trainer_ranks, strategy="PACK",
                       what="the trainer", timeout_s=s.placement_timeout_s)  # fmt: skip
        self._groups.append(t_pg)
        e_pg = reserve([s.engine_bundle] * s.engines, strategy="SPREAD",
                       what="the engines", timeout_s=s.placement_timeout_s)  # fmt: skip
        self._groups.append(e_pg)
        self._check_runtimes(t_pg, s.trainer_ranks, "trainer rank")
        self._check_runtimes(e_pg, s.engines, "engine")
        if s.side.isoexec:
            workers = s.engines * s.engine_tp
            self.handshake_actor = _remote(HandshakeActor, t_pg, 0).remote(
                {"trainer": s.trainer_ranks, "engine": workers}, self.token, s.tls,
                insecure=s.insecure,
            )  # fmt: skip
            self.address = ray.get(self.handshake_actor.address.remote())
        trainer_side = s.trainer_side or s.side
        self.trainers = [
            _remote(TrainerActor, t_pg, r, claim=s.trainer_bundle).remote(
                trainer_side, r, s.trainer_ranks, s.lr
            )
            for r in range(s.trainer_ranks)
        ]
        self.engines = [
            _remote(EngineActor, e_pg, i, claim=s.engine_bundle,
                    max_restarts=s.engine_max_restarts,
                    groups={"progress": 1}).remote(s.side, s.engine_tp, s.seed, i)
            for i in range(s.engines)
        ]  # fmt: skip
        master = ray.get(self.trainers[0].endpoint.remote())
        ray.get([t.setup.remote(master, s.tp, s.pp, s.ep) for t in self.trainers])

    def _check_runtimes(self, pg: Any, bundles: int, what: str) -> None:
        """Before any actor starts: each bundle's node runs the driver's runtime (a cheap
        task per bundle; an engine takes tens of seconds to start, a refusal should not)."""
        import ray

        probe = ray.remote(RuntimeIdentity.here)
        got = ray.get([_placed(probe, pg, i).remote() for i in range(bundles)])
        for i, ident in enumerate(got):
            require_same(self.identity, ident, f"the node of {what} {i}")

    def close(self) -> None:
        """End every actor and placement group this run started (engines shut down first)."""
        import ray

        for e in self.engines:  # a clean shutdown of the engine's process tree
            try:
                ray.get(e.shutdown.remote(), timeout=60)
            except Exception:  # the kill below ends it regardless
                pass
        if self.handshake_actor is not None:  # waiters get UNAVAILABLE, not a hang
            try:
                ray.get(self.handshake_actor.stop.remote(), timeout=30)
            except Exception:  # the kill below ends it regardless
                pass
        for a in [*self.engines, *self.trainers, self.handshake_actor]:
            if a is not None:
                ray.kill(a, no_restart=True)
        for pg in self._groups:
            release(pg)
        self.engines, self.trainers, self.handshake_actor, self._groups = [], [], None, []

    # ---- the gate ------------------------------------------------------------------------
    def handshake(self, engines: Sequence[int] | None = None) -> dict[str, Any]:
        """Every trainer rank and every worker of the engines offers (all at once), then the
        numeric canary of the weights loaded at start; `RunRefusedError` unless all MATCH.
        `engines`: only these re-offer (a restarted one); they sample again after the next
        sync's canary (they hold the starting checkpoint, the trainer may not)."""
        import ray

        s = self.spec
        if self.address is None:
            raise RunRefusedError("this run has IsoExec off: there is no handshake")
        which = range(len(self.engines)) if engines is None else engines
        t_refs = (
            []
            if engines is not None
            else [t.offer.remote(self.address, self.token, s.run_id, s.tls) for t in self.trainers]
        )
        e_refs = [self.engines[i].offer.remote(self.address, self.token, s.run_id, s.tls)
                  for i in which]  # fmt: skip
        trainer = ray.get(t_refs)
        engine = [v for vs in ray.get(e_refs) for v in vs]
        bad = [v for v in trainer + engine if v["outcome"] != "MATCH"]
        if bad:
            raise RunRefusedError(f"handshake {bad[0]['outcome']}: {bad[0]['summary']}\n"
                                  + "\n".join(bad[0]["diff"][:20]))  # fmt: skip
        if engines is None:
            self.canary()
        return {"trainer": trainer, "engine": engine}

    def canary(self, engines: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Every trainer rank and the engines (all, or `engines`) score the run's probe under
        the weights they hold and offer it for the current weights version; an engine samples
        only after its canary MATCHed (`generate` checks). `RunRefusedError` on a MISMATCH."""
        import ray

        s = self.spec
        which = list(range(len(self.engines)) if engines is None else engines)
        args = (self.address, self.token, s.run_id, self.version, s.tls)
        t_refs = [t.canary.remote(*args) for t in self.trainers]
        e_refs = [self.engines[i].canary.remote(*args) for i in which]
        pids = [self.engines[i].pid.remote() for i in which]
        ray.get(t_refs)
        verdicts = ray.get(e_refs)
        for i, v, pid in zip(which, verdicts, ray.get(pids), strict=True):
            if v["matched"]:
                self._cleared[i] = (self.version, int(pid))
            else:
                self._cleared.pop(i, None)
        bad = [(i, v) for i, v in zip(which, verdicts, strict=True) if not v["matched"]]
        if bad:
            raise RunRefusedError(f"engine {bad[0][0]}: {bad[0][1]['summary']}")
        return verdicts

    def _require_cleared(self, engines: Sequence[int]) -> None:
        """Each engine's last canary MATCHed the current weights version, and it has not
        restarted since (a restarted engine holds its starting checkpoint)."""
        import ray

        pids = ray.get([self.engines[i].pid.remote() for i in engines])
        for i, pid in zip(engines, pids, strict=True):
            if self._cleared.get(i) != (self.version, int(pid)):
                raise RunRefusedError(
                    f"engine {i} has no canary MATCH for weights version {self.version} (it "
                    "restarted, or missed a sync): handshake(engines=[i]) and sync_weights() "
                    "first"
                )

    def wait_for_engine(self, i: int, dead_pid: int | None = None, timeout_s: float = 300.0) -> int:
        """Wait until engine `i` answers from a process other than `dead_pid` (Ray restarted
        it: a fresh engine on the checkpoint it starts from, with no MATCH until
        `handshake(engines=[i])`); its actor's pid."""
        import time

        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid = int(ray.get(self.engines[i].pid.remote(), timeout=timeout_s))
                if pid != dead_pid:
                    return pid
            except (ActorUnavailableError, RayActorError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {i} did not come back within {timeout_s:g} s")
            time.sleep(1.0)

    # ---- rollout, scoring, training --------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: Any) -> list[Any]:
        """Prompts split across the engines in order; completions in prompt order."""
        import ray

        n = len(self.engines)
        if self.address is not None:  # IsoExec on: only engines whose weights passed
            self._require_cleared([i for i in range(n) if prompts[i::n]])
        parts = [prompts[i::n] for i in range(n)]
        pairs = zip(self.engines, parts, strict=True)
        outs = ray.get([e.generate.remote(p, sampling) for e, p in pairs if p])
        merged: list[Any] = [None] * len(prompts)
        for i, out in enumerate(outs):
            merged[i::n] = [replace(c, weights_version=self.version) for c in out]
        return merged

    def _on_trainers(self, call: Callable[[Any], Any]) -> Any:
        """Run `call(actor)` on every rank (they act together); rank 0's result."""
        import ray

        return ray.get([call(t) for t in self.trainers])[0]

    def score(self, completions: list[Any], temperature: float = 1.0, truncation: Any = None,
              penalties: Any = None) -> list[list[float]]:  # fmt: skip
        """The trainer's logprobs of each completion's tokens, under the weights they were
        sampled with: `RunRefusedError` for a completion of another weights version, or when
        the trainer has stepped since the version (its weights are then none the engines had).
        """
        versions = {c.weights_version for c in completions}
        if self.address is not None and (versions != {self.version} or self._stepped):
            held = f"{self.version}{' + a train step' if self._stepped else ''}"
            raise RunRefusedError(
                f"completions sampled under weights version(s) {sorted(versions, key=str)}, the "
                f"trainer holds version {held}: scoring would compare different weights"
            )
        seqs, lens = _sequences(completions)
        return self._on_trainers(
            lambda t: t.score.remote(seqs, lens, temperature, truncation, penalties)
        )

    def train_step(self, completions: list[Any], advantages: list[float],
                   temperature: float = 1.0) -> dict[str, float]:  # fmt: skip
        """One step of the clipped policy loss against the completions' own logprobs (the
        behaviour policy's, exact whatever version sampled them); the stats add the
        staleness: how many versions the oldest completion is behind the trainer's."""
        seqs, lens = _sequences(completions)
        old = [list(c.logprobs) for c in completions]
        stats = self._on_trainers(
            lambda t: t.train_step.remote(
                seqs, lens, old, advantages, temperature, 0.2, self.spec.pack_tokens
            )
        )
        known = [c.weights_version for c in completions if c.weights_version is not None]
        self._stepped = True
        return {**stats, "staleness": float(self.version - min(known)) if known else 0.0}

    # ---- weight sync ---------------------------------------------------------------------
    def sync_weights(self, engines: Sequence[int] | None = None) -> str:
        """The trainer's weights to every engine (or `engines`) through the object store;
        each loads through its gate. Returns the fingerprint every engine now holds."""
        import ray

        # every rank publishes its share (at PP>1 its stage, at EP>1 its experts)
        parts = ray.get([t.publish_weights.remote(self.spec.chunk_bytes) for t in self.trainers])
        try:
            return self.deliver(merge(parts), engines)
        finally:
            for part in parts:
                if part.chunks:
                    free(part)

    def deliver(self, manifest: WeightManifest, engines: Sequence[int] | None = None) -> str:
        """Send a published manifest to every engine (or `engines`), all at once; each stages
        it chunk by chunk and commits through its gate. Every engine is waited for; then an
        engine whose actor died is named in `EngineLostError`, any other refusal re-raised."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        which = list(range(len(self.engines)) if engines is None else engines)
        refs = [self.engines[i].sync.remote(manifest) for i in which]
        held: set[str] = set()
        lost: list[int] = []
        cause: BaseException | None = None
        refused: BaseException | None = None
        for i, ref in zip(which, refs, strict=True):
            try:
                held.update(ray.get(ref))
            except (RayActorError, ActorUnavailableError) as e:
                lost.append(i)
                cause = e
            except Exception as e:  # a gate refusal or a missing chunk: the engine lives on
                refused = refused or e
        if lost and cause is not None:
            raise EngineLostError(lost, "a weight sync", cause) from cause
        if refused is not None:
            raise refused
        if held != {manifest.fingerprint}:
            raise RunRefusedError(f"engines hold {sorted(held)}, the trainer sent "
                                  f"{manifest.fingerprint}")  # fmt: skip
        self.version += 1  # new weights, a new version: the engines sample after its canary
        self.canary(which)
        self._stepped = False  # the trainer's weights are this version's (the canary says so)
        return manifest.fingerprint

    def trainer_fingerprint(self) -> str:
        return self._on_trainers(lambda t: t.weight_fingerprint.remote())


def _sequences(completions: list[Any]) -> tuple[list[list[int]], list[int]]:
    seqs = [list(c.prompt_token_ids) + list(c.token_ids) for c in completions]
    return seqs, [len(c.prompt_token_ids) for c in completions]


def _remote(
    cls: type, pg: Any, bundle: int, claim: Bundle | None = None,
    groups: dict[str, int] | None = None, **options: Any,
) -> Any:  # fmt: skip
    """`cls` as an actor in bundle `bundle` of `pg`, holding `claim` of it (the trainer ranks
    and engines claim their whole bundle: Ray then gives them its GPUs, CUDA_VISIBLE_DEVICES
    included; the handshake service claims nothing and shares trainer rank 0's); `groups`:
    its methods' concurrency groups (a thread each, besides the default one)."""
    import ray

    res = dict(claim or {})
    cpus, gpus = res.pop("CPU", 0), res.pop("GPU", 0)
    actor = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
    return _placed(actor, pg, bundle, num_cpus=cpus, num_gpus=gpus,
                   resources=res, **options)  # fmt: skip


def _placed(remote: Any, pg: Any, bundle: int, **options: Any) -> Any:
    """A remote function or actor class pinned to bundle `bundle` of `pg` (the bundle holds the
    resources; without `options` the task or actor asks for none beyond them)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                placement_group_bundle_index=bundle)  # fmt: skip
    options.setdefault("num_cpus", 0)
    return remote.options(scheduling_strategy=strategy, **options)


__all__ = ["EngineLostError", "RayRun", "RaySpec", "RunRefusedError"]
