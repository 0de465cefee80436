"""IsoExec across nodes on Ray: a two-node cluster on this machine (`ray.cluster_utils.Cluster`,
one raylet per node on the machine's address), the trainer on one node, the engine on the
other, the handshake service as an actor over mutual TLS.

MATCH, then sampled logprobs bitwise equal to the trainer's scoring; a train step, a weight
sync through the object store and bitwise again; an engine actor killed is restarted by Ray and
refused weights until it offers again and MATCHes; a chunk missing from the object store is
refused with nothing loaded; a node lost mid-sync loads nothing, and its engine, restarted on a
new node, must MATCH again; `examples/grpo_ray.py --address` runs on the cluster. Refusals: a
trainer whose contract differs (every engine stays uncleared), a cluster without the resources
asked, a node with another runtime. Negative control: the same run with IsoExec off gives
logprobs that differ.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "_support"))
from pki import make_pki

from isoexec.contract.options import IsoExecOptions
from isoexec.ops.penalties import Penalties
from isoexec.ops.truncation import Truncation
from isoexec.ray.actors import ModelSource, SideSpec
from isoexec.ray.cluster import ClusterResourcesError, local_cluster
from isoexec.ray.identity import ActorRuntimeMismatchError, RuntimeIdentity
from isoexec.ray.run import EngineLostError, RayRun, RaySpec, RunRefusedError
from isoexec.ray.tls import TLSMaterial
from isoexec.ray.weights import WeightTransferError, free
from isoexec.vllm.engine_types import SamplingSpec

pytestmark = [pytest.mark.engine, pytest.mark.trainer, pytest.mark.slow]

PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(6 + i)] for i in range(4)]
SAMPLING = SamplingSpec(max_tokens=6, temperature=1.0)
TRAINER_RES, ENGINE_RES = {"trainer_node": 2}, {"engine_node": 2}
TRAINER_NODE = {"CPU": 1, "trainer_node": 1}
ENGINE_NODE = {"CPU": 1, "engine_node": 1}


@dataclass(frozen=True)
class ClusterUnderTest:
    nodes: Any  # ray.cluster_utils.Cluster: tests add and remove nodes
    tls: TLSMaterial  # mutual TLS whose certificates name the nodes' address
    tls_dir: Path  # the same as files: ca.pem, server.pem/.key, client.pem/.key


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterUnderTest]:
    """Two raylets (trainer node, engine node), 2 CPUs each (two runs at once: the module's
    and one more) and the driver connected. Everything is shut down after the file."""
    import ray

    with local_cluster([TRAINER_RES, ENGINE_RES], cpus_per_node=2) as c:
        pki = make_pki(tmp_path_factory.mktemp("pki"), hosts=(ray.util.get_node_ip_address(),))
        tls = TLSMaterial.from_files(pki["ca"], pki["server"], pki["server_key"],
                                     pki["client"], pki["client_key"])  # fmt: skip
        yield ClusterUnderTest(c, tls, Path(pki["ca"]).parent)


def _spec(tls: TLSMaterial | None, isoexec: bool = True, eager: bool = False, **kw: Any) -> RaySpec:
    """Eager engines where a test only needs them to start (CI time); the module's run is
    compiled, as vLLM runs by default."""
    side = SideSpec(ModelSource(preset="tiny-dense", seed=3), isoexec=isoexec,
                    enforce_eager=eager)  # fmt: skip
    return RaySpec(side=side, trainer_bundle=TRAINER_NODE, engine_bundle=ENGINE_NODE, tls=tls,
                   **kw)  # fmt: skip


@pytest.fixture(scope="module")
def run(cluster: ClusterUnderTest) -> Iterator[RayRun]:
    with RayRun(_spec(cluster.tls)) as r:
        yield r


def _bitwise(run: RayRun) -> tuple[bool, list[Any]]:
    comps = run.generate(PROMPTS, SAMPLING)
    trainer = run.score(comps)
    equal = all(
        torch.equal(torch.tensor(t, dtype=torch.float32), torch.tensor(c.logprobs))
        for t, c in zip(trainer, comps, strict=True)
    )
    return equal, comps


def _live_groups() -> set[str]:
    """The cluster's placement groups not removed (a refused start must leave none)."""
    import ray

    return {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}


def test_match_across_nodes_then_bitwise(run: RayRun) -> None:
    import ray

    nodes = ray.get([run.trainers[0].node.remote(), run.engines[0].node.remote()])
    assert nodes[0] != nodes[1], "trainer and engine must sit on different nodes"
    verdicts = run.handshake()
    assert {v["outcome"] for v in verdicts["trainer"] + verdicts["engine"]} == {"MATCH"}
    assert run.trainer_fingerprint() in set(ray.get(run.engines[0].weight_fingerprint.remote()))
    equal, comps = _bitwise(run)
    assert equal and sum(len(c.token_ids) for c in comps) == 4 * SAMPLING.max_tokens
    # Truncation and penalties travel with the sequences: scored with them, bitwise; without
    # them (negative control), not.
    cut, pen = Truncation(top_k=20), Penalties.of(repetition_penalty=1.3, logit_bias={5: 2.0})
    spec = replace(SAMPLING, temperature=0.8, top_k=20, penalties=pen)
    comps = run.generate(PROMPTS, spec)
    engine = [torch.tensor(c.logprobs) for c in comps]
    for scored, want in (
        (run.score(comps, 0.8, cut, pen), True),
        (run.score(comps, 0.8, cut), False),
    ):
        got = [torch.tensor(t, dtype=torch.float32) for t in scored]
        assert all(torch.equal(a, b) for a, b in zip(got, engine, strict=True)) is want


def test_train_step_sync_then_bitwise_again(run: RayRun) -> None:
    import ray

    before = run.trainer_fingerprint()
    comps = run.generate(PROMPTS, SAMPLING)
    assert {c.weights_version for c in comps} == {run.version}
    stats = run.train_step(comps, advantages=[1.0, -1.0, 0.5, -0.5])
    assert stats["ratio_dev_max"] == 0.0  # the engine's logprobs are the trainer's, exactly
    assert stats["staleness"] == 0.0
    with pytest.raises(RunRefusedError, match=r"trainer holds version \d+ \+ a train step"):
        run.score(comps)  # the trainer's weights are no longer the ones that sampled them
    fp = run.sync_weights()
    with pytest.raises(RunRefusedError, match=r"sampled under weights version\(s\) \[\d+\]"):
        run.score(comps)  # sampled under the previous version
    assert fp != before and fp == run.trainer_fingerprint()
    assert ray.get(run.engines[0].gate_status.remote())[0]["gated_loads"] >= 1
    equal, _ = _bitwise(run)
    assert equal


def test_missing_chunk_is_refused_and_nothing_loaded(run: RayRun) -> None:
    import ray
    from ray._private.internal_api import free

    held = ray.get(run.engines[0].weight_fingerprint.remote())
    run.train_step(run.generate(PROMPTS, SAMPLING), advantages=[1.0, 0.0, -1.0, 0.0])
    manifest = ray.get(run.trainers[0].publish_weights.remote(4096))  # many small chunks
    assert len(manifest.chunks) > 3
    free([manifest.chunks[2]])  # gone from the object store before the engine fetches it
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(run.engines[0].sync.remote(manifest))
    assert isinstance(e.value.cause, WeightTransferError), e.value
    assert "chunk 3/" in str(e.value.cause) and "nothing was loaded" in str(e.value.cause)
    assert ray.get(run.engines[0].weight_fingerprint.remote()) == held
    run.sync_weights()  # a whole transfer afterwards goes through
    assert _bitwise(run)[0]


def test_killed_engine_restarts_and_is_refused_until_it_matches(run: RayRun) -> None:
    import ray

    pid = ray.get(run.engines[0].pid.remote())
    os.kill(pid, signal.SIGKILL)  # the engine's actor process dies (its engine goes with it)
    run.wait_for_engine(0, dead_pid=pid)  # Ray restarted it: a fresh engine, no MATCH
    with pytest.raises(RunRefusedError, match="engine 0 has no canary MATCH"):
        run.generate(PROMPTS, SAMPLING)  # it holds its starting checkpoint: no samples
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        run.sync_weights()
    assert "no MATCH" in str(e.value), e.value
    status = ray.get(run.engines[0].gate_status.remote())
    assert [s["cleared"] for s in status] == [False]
    run.handshake(engines=[0])  # the restarted engine offers again: MATCH against the trainer
    with pytest.raises(RunRefusedError, match="no canary MATCH"):
        run.generate(PROMPTS, SAMPLING)  # still the starting weights until the next sync
    run.sync_weights()  # then the canary of the new version: MATCH
    assert _bitwise(run)[0]


def test_an_engine_given_stale_weights_fails_the_canary_and_samples_nothing(run: RayRun) -> None:
    """A transfer that passes the gate (its fingerprint is its own) but carries weights the
    trainer no longer holds: the canary of the new version MISMATCHes, naming the first
    differing probe position, and the engine is refused samples until a sync MATCHes."""
    import ray

    stale = ray.get(run.trainers[0].publish_weights.remote(run.spec.chunk_bytes))
    run.train_step(run.generate(PROMPTS, SAMPLING), advantages=[0.5, -0.5, 1.0, -1.0])
    with pytest.raises(RunRefusedError, match="canary MISMATCH at weights version"):
        run.deliver(stale)  # loaded through the gate; the canary sees the difference
    free(stale)
    with pytest.raises(RunRefusedError, match="engine 0 has no canary MATCH"):
        run.generate(PROMPTS, SAMPLING)
    run.sync_weights()
    assert _bitwise(run)[0]


def test_trainer_contract_change_makes_every_actor_refuse(cluster: ClusterUnderTest) -> None:
    import ray

    spec = _spec(cluster.tls, eager=True, run_id="ray-mismatch")
    changed = replace(spec, trainer_side=replace(spec.side, options=IsoExecOptions(
        tp_invariant=True)))  # fmt: skip
    with RayRun(changed) as r:
        with pytest.raises(RunRefusedError, match="MISMATCH") as e:
            r.handshake()
        assert "linear" in str(e.value)  # the site diff names the changed row-parallel sites
        assert [s["cleared"] for s in ray.get(r.engines[0].gate_status.remote())] == [False]
        with pytest.raises(ray.exceptions.RayTaskError, match="refused"):
            r.sync_weights()


def test_isoexec_off_differs(cluster: ClusterUnderTest) -> None:
    """Negative control: stock Megatron scoring stock vLLM's samples, same cluster."""
    with RayRun(_spec(None, isoexec=False, eager=True)) as r:
        equal, comps = _bitwise(r)
        assert not equal and all(c.token_ids for c in comps)


def test_a_cluster_without_the_resources_is_refused_at_once(cluster: ClusterUnderTest) -> None:

    before = _live_groups()
    with pytest.raises(ClusterResourcesError, match="gpu_node: asks 1, cluster has 0"):
        RayRun(replace(_spec(cluster.tls), engine_bundle={"CPU": 1, "gpu_node": 1})).start()
    with pytest.raises(ClusterResourcesError, match="engine_node: asks 3, cluster has 2"):
        RayRun(replace(_spec(cluster.tls), engines=3)).start()
    taken = replace(
        _spec(cluster.tls), engines=2, placement_timeout_s=5
    )  # the module's run holds one
    with pytest.raises(ClusterResourcesError, match="not placed within 5 s"):
        RayRun(taken).start()
    assert _live_groups() == before  # no placement group of the refused runs is left


def test_a_plaintext_handshake_across_the_network_is_refused(cluster: ClusterUnderTest) -> None:
    before = _live_groups()
    with pytest.raises(RunRefusedError, match=r"give RaySpec\(tls=TLSMaterial"):
        RayRun(_spec(None)).start()
    assert _live_groups() == before


def test_a_node_with_another_runtime_is_refused(cluster: ClusterUnderTest) -> None:

    here = RuntimeIdentity.here()
    other = replace(here, isoexec="0.0.1")  # the driver's as if another IsoExec were installed
    before = _live_groups()
    with pytest.raises(ActorRuntimeMismatchError, match=r"isoexec: driver 0\.0\.1, actor"):
        RayRun(_spec(cluster.tls), identity=other).start()
    assert _live_groups() == before  # its placement groups are gone, no actor was started


def test_a_node_lost_mid_sync_loads_nothing_and_its_engine_must_match_again(
    cluster: ClusterUnderTest,
) -> None:
    """The engine's node is removed while the engine holds part of a weight sync staged (a
    later chunk is held back so the loss falls mid-sync): the sync fails naming the engine;
    Ray places the engine's bundle on a new node and restarts it there, on its starting
    checkpoint (nothing staged was loaded), refused weights until it offers and MATCHes."""
    import ray

    lost = cluster.nodes.add_node(num_cpus=1, resources={"spare_node": 1})
    spec = replace(_spec(cluster.tls, eager=True, run_id="ray-node-lost"),
                   engine_bundle={"CPU": 1, "spare_node": 1})  # fmt: skip
    with RayRun(spec) as r:
        r.handshake()
        start = ray.get(r.engines[0].weight_fingerprint.remote())
        node, pid = ray.get([r.engines[0].node.remote(), r.engines[0].pid.remote()])
        r.train_step(r.generate(PROMPTS, SAMPLING), advantages=[1.0, -1.0, 0.0, 0.5])
        manifest = ray.get(r.trainers[0].publish_weights.remote(4096))
        n, k = len(manifest.chunks), 3

        def after(seconds: float, value: Any) -> Any:  # nested: Ray ships it by value
            time.sleep(seconds)
            return value

        # held back on the trainer's node (the node that goes is the engine's alone)
        held = ray.remote(after).options(num_cpus=0, resources={"trainer_node": 0.01})
        held_back = held.remote(60.0, manifest.chunks[k])
        stalled = replace(manifest, chunks=(*manifest.chunks[:k], held_back,
                                            *manifest.chunks[k + 1 :]))  # fmt: skip
        failure: list[BaseException] = []

        def deliver() -> None:
            try:
                r.deliver(stalled)
            except BaseException as e:
                failure.append(e)

        t = threading.Thread(target=deliver)
        t.start()
        deadline = time.monotonic() + 60
        while ray.get(r.engines[0].sync_progress.remote()) != (k, n):
            assert time.monotonic() < deadline, "the sync never reached the held-back chunk"
            time.sleep(0.1)
        cluster.nodes.remove_node(lost)  # k chunks staged, the rest not yet fetched
        t.join(120)
        assert not t.is_alive() and len(failure) == 1, failure
        assert isinstance(failure[0], EngineLostError) and failure[0].engines == (0,)
        assert "during a weight sync" in str(failure[0])
        ray.cancel(held_back, force=True)
        free(manifest)

        cluster.nodes.add_node(num_cpus=1, resources={"spare_node": 1})  # somewhere to go
        r.wait_for_engine(0, dead_pid=pid)
        assert ray.get(r.engines[0].node.remote()) != node  # restarted on the new node
        assert ray.get(r.engines[0].weight_fingerprint.remote()) == start  # nothing loaded
        with pytest.raises(ray.exceptions.RayTaskError, match="no MATCH"):
            r.sync_weights()
        r.handshake(engines=[0])
        r.sync_weights()
        assert _bitwise(r)[0]


def test_the_grpo_ray_example_on_this_cluster(cluster: ClusterUnderTest, tmp_path: Path) -> None:
    """`examples/grpo_ray.py --address` as a user runs it against a cluster (its own driver
    process, mutual TLS from --tls-dir, the bundles pinning trainer and engine to their nodes):
    the logged diff and the ratio's deviation are exactly 0 at every step."""
    import ray

    out = tmp_path / "steps.json"
    cmd = [sys.executable, str(Path(__file__).parents[1] / "examples" / "grpo_ray.py"),
           "--address", cluster.nodes.address, "--steps", "3", "--tls-dir", str(cluster.tls_dir),
           "--trainer-bundle", json.dumps(TRAINER_NODE), "--engine-bundle", json.dumps(ENGINE_NODE),
           "--out", str(out)]  # fmt: skip
    assert ray.util.get_node_ip_address() in cluster.nodes.address
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = json.loads(out.read_text())
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert s["policy/rollout_train_logprobs_abs_diff_max"] == 0.0, s
        assert s["ratio_dev_max"] == 0.0, s


@pytest.mark.matrix  # CI time (two TP=2 groups on 2 cores); run with -m matrix (README)
def test_tp2_trainer_ranks_and_a_tp2_engine_on_two_more_nodes(cluster: ClusterUnderTest) -> None:
    """Two trainer ranks (one torch.distributed world across actors, Megatron TP=2) on one
    node, an engine with vLLM TP=2 inside its actor on another; both sides `tp_invariant`:
    MATCH, bitwise, a train step, a sync gathered from both ranks' shards, bitwise again."""
    import ray

    nodes = [cluster.nodes.add_node(num_cpus=2, resources={name: 1})
             for name in ("tp_trainer_node", "tp_engine_node")]  # fmt: skip
    side = SideSpec(ModelSource(preset="tiny-dense", seed=3), enforce_eager=True,
                    options=IsoExecOptions(tp_invariant=True))  # fmt: skip
    spec = RaySpec(side=side, trainer_ranks=2, tp=2, engine_tp=2, tls=cluster.tls,
                   trainer_bundle={"CPU": 1, "tp_trainer_node": 0.5},
                   engine_bundle={"CPU": 2, "tp_engine_node": 1}, run_id="ray-tp2")  # fmt: skip
    try:
        with RayRun(spec) as r:
            verdicts = r.handshake()
            assert len(verdicts["trainer"]) == 2 and len(verdicts["engine"]) == 2
            assert _bitwise(r)[0]
            before = r.trainer_fingerprint()
            r.train_step(r.generate(PROMPTS, SAMPLING), advantages=[1.0, -1.0, 0.5, -0.5])
            fp = r.sync_weights()
            assert fp != before and set(ray.get(r.engines[0].weight_fingerprint.remote())) == {fp}
            assert _bitwise(r)[0]
    finally:
        for n in nodes:
            cluster.nodes.remove_node(n)


@pytest.mark.matrix  # CI time (two runs, two trainer ranks on 2 cores); -m matrix (README)
def test_dp2_trainer_ranks_split_the_step_and_equal_dp1_bitwise(cluster: ClusterUnderTest) -> None:
    """Two trainer ranks at TP=1 are two DP replicas: each computes half the step's packs
    (`pack_tokens` 24: 4 packs, 2 per rank) and the step's weights are bitwise those of one
    rank computing all 4 (the same completions: the engines sample with the same seed); then
    a sync and the engine is bitwise the trainer again."""
    node = cluster.nodes.add_node(num_cpus=2, resources={"dp_trainer_node": 1})
    fingerprints, units = [], []
    try:
        for ranks in (1, 2):
            spec = replace(_spec(cluster.tls, eager=True, run_id=f"ray-dp{ranks}"),
                           trainer_ranks=ranks, pack_tokens=24,
                           trainer_bundle={"CPU": 1, "dp_trainer_node": 0.5})  # fmt: skip
            with RayRun(spec) as r:
                r.handshake()
                stats = r.train_step(r.generate(PROMPTS, SAMPLING), [1.0, -1.0, 0.5, -0.5])
                units.append(stats["units"])
                fingerprints.append(r.trainer_fingerprint())
                r.sync_weights()
                assert _bitwise(r)[0]
    finally:
        cluster.nodes.remove_node(node)
    assert units == [4.0, 2.0]  # rank 0's share: all 4 packs alone, 2 of 4 beside a second rank
    assert fingerprints[0] == fingerprints[1]


@pytest.mark.matrix  # CI time (two runs, two trainer ranks on 2 cores); -m matrix (README)
@pytest.mark.parametrize(("layout", "preset"), [("pp", "tiny-dense"), ("ep", "tiny-moe")])
def test_a_split_trainer_steps_and_syncs_the_whole_model(
    cluster: ClusterUnderTest, layout: str, preset: str
) -> None:
    """Two trainer ranks holding part of the model each, as two pipeline stages (PP=2) or two
    expert-parallel ranks (EP=2, which are also two DP ranks): MATCH, a policy step (at PP=2
    through Megatron's schedule; at EP=2 each rank its packs), and a sync whose parts (each
    rank's stage, or its experts) merge into the whole model. The step's weights are bitwise
    one rank's at PP=1, EP=1, and the engine is bitwise the trainer again. (Before, a Ray
    trainer at PP>1 could not step, and a sync sent rank 0's stage or experts only.)"""
    import ray

    node = cluster.nodes.add_node(num_cpus=2, resources={"split_trainer_node": 1})
    fingerprints, units = [], []
    try:
        for ranks in (1, 2):
            side = SideSpec(ModelSource(preset=preset, seed=3), enforce_eager=True)
            spec = RaySpec(side=side, trainer_ranks=ranks, **{layout: ranks}, pack_tokens=24,
                           trainer_bundle={"CPU": 1, "split_trainer_node": 0.5},
                           engine_bundle=ENGINE_NODE, tls=cluster.tls,
                           run_id=f"ray-{layout}{ranks}")  # fmt: skip
            with RayRun(spec) as r:
                r.handshake()
                stats = r.train_step(r.generate(PROMPTS, SAMPLING), [1.0, -1.0, 0.5, -0.5])
                assert stats["ratio_dev_max"] == 0.0, stats
                units.append(stats["units"])
                fingerprints.append(r.trainer_fingerprint())
                fp = r.sync_weights()
                assert fp == fingerprints[-1]
                assert set(ray.get(r.engines[0].weight_fingerprint.remote())) == {fp}
                assert _bitwise(r)[0]
    finally:
        cluster.nodes.remove_node(node)
    assert fingerprints[0] == fingerprints[1]
    # rank 0's packs: all 4 alone; beside a second stage all 4, beside a second EP rank 2
    assert units == [4.0, 4.0 if layout == "pp" else 2.0]


@pytest.mark.matrix  # CI time (two more engines on 2 cores); run with -m matrix (README)
def test_two_engines_on_two_more_nodes_take_disjoint_ranks(cluster: ClusterUnderTest) -> None:
    """Two engine actors, one per node (SPREAD): their workers offer as engine/0 and engine/1,
    each passes the canary, the prompts are split across them and every completion is bitwise
    the trainer's, before and after a sync to both."""
    import ray

    nodes = [cluster.nodes.add_node(num_cpus=1, resources={"two_engines": 1}) for _ in range(2)]
    spec = replace(_spec(cluster.tls, eager=True, run_id="ray-two-engines"), engines=2,
                   engine_bundle={"CPU": 1, "two_engines": 1})  # fmt: skip
    try:
        with RayRun(spec) as r:
            where = ray.get([e.node.remote() for e in r.engines])
            assert where[0] != where[1]
            verdicts = r.handshake()
            assert len(verdicts["engine"]) == 2
            assert _bitwise(r)[0]
            r.train_step(r.generate(PROMPTS, SAMPLING), advantages=[1.0, -1.0, 0.5, -0.5])
            fp = r.sync_weights()
            held = ray.get([e.weight_fingerprint.remote() for e in r.engines])
            assert held == [[fp], [fp]]
            assert _bitwise(r)[0]
    finally:
        for n in nodes:
            cluster.nodes.remove_node(n)
