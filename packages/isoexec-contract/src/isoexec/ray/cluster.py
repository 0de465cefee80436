"""Reserving a Ray cluster's resources for trainer ranks and engines, or refusing at once.

Ray queues an actor whose resources no node has and waits forever; a user sees a hung job.
`reserve` checks the cluster's totals first (a request that can never fit is refused with
what was asked and what the cluster has), then waits a bounded time for the placement group
(resources held by other jobs) and removes it on a timeout, so nothing is left pending.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

Bundle = Mapping[str, float]


class ClusterResourcesError(RuntimeError):
    """The cluster cannot (or not now) hold what a group asked for."""


def _sum(bundles: Sequence[Bundle]) -> dict[str, float]:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + float(v)
    return need


def reserve(bundles: Sequence[Bundle], *, strategy: str, what: str, timeout_s: float) -> Any:
    """A ready placement group for `bundles` (one per actor), or `ClusterResourcesError`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if not bundles:
        raise ValueError(f"{what}: no bundles to reserve")
    have = ray.cluster_resources()
    short = {k: (v, have.get(k, 0.0)) for k, v in _sum(bundles).items() if v > have.get(k, 0.0)}
    if short:
        told = ", ".join(f"{k}: asks {v:g}, cluster has {h:g}" for k, (v, h) in sorted(
            short.items()))  # fmt: skip
        raise ClusterResourcesError(f"{what}: the Ray cluster cannot hold it ({told})")
    pg = placement_group([dict(b) for b in bundles], strategy=strategy)
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise ClusterResourcesError(
            f"{what}: {len(bundles)} bundle(s) {list(map(dict, bundles))} with strategy "
            f"{strategy} were not placed within {timeout_s:g} s (available now: "
            f"{ray.available_resources()}); nothing was started"
        )
    return pg


def release(pg: Any) -> None:
    """Remove a placement group (its actors end with it)."""
    from ray.util.placement_group import remove_placement_group

    if pg is not None:
        remove_placement_group(pg)


@contextmanager
def local_cluster(nodes: Sequence[Mapping[str, float]], *, cpus_per_node: int = 1) -> Iterator[Any]:
    """A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: one raylet per
    node on the machine's address, the first one the head), with this process connected as
    its driver; node i carries the custom resources `nodes[i]` (e.g. {"trainer_node": 1}) so
    bundles can pin actors to it. Yields the `Cluster` (tests add and remove nodes); the
    driver is disconnected and every raylet and the GCS are shut down on exit, error or not."""
    import ray
    from ray.cluster_utils import Cluster

    if not nodes:
        raise ValueError("local_cluster: at least one node (the head)")
    head = {"num_cpus": cpus_per_node, "resources": dict(nodes[0]), "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args=head)
    try:
        for res in nodes[1:]:
            c.add_node(num_cpus=cpus_per_node, resources=dict(res))
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


__all__ = ["Bundle", "ClusterResourcesError", "local_cluster", "release", "reserve"]
