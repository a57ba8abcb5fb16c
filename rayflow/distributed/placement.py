"""Placement groups: the one place rayflow asks Ray for resources.

Everything rayflow runs (rollout ranks, learner ranks, reward workers, the weight-sync actor) is
placed through a placement group built here, never by pinning node IPs, so Ray's autoscaler
sees the demand and adds the nodes that satisfy it.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def resolve_gpus(gpus_per_rank: float | None) -> float:
    """A config's gpus_per_rank, with null meaning 1 when the cluster has GPUs and 0 otherwise."""
    if gpus_per_rank is not None:
        return gpus_per_rank
    return 1.0 if cluster_has_gpus() else 0.0


def make_bundles(count: int, cpus: float, gpus: float, extra: dict[str, float] | None = None) -> list[dict[str, float]]:
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {}), **(extra or {})}
    return [dict(bundle) for _ in range(count)]


@dataclass
class PlacedGroup:
    """A ready placement group and its bundles in rank order (by node, then bundle index)."""

    pg: PlacementGroup
    rank_bundles: list[int]
    bundle_nodes: dict[int, str]
    owned: bool = True
    """False for a `view`: removing it leaves the placement group to its owner."""

    def strategy_for_rank(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=self.rank_bundles[rank],
            placement_group_capture_child_tasks=True,
        )

    def node_of_rank(self, rank: int) -> str:
        return self.bundle_nodes[self.rank_bundles[rank]]

    def node_label(self, rank: int) -> str:
        """Where `rank` runs, for messages: its node's address and id."""
        node_id = self.node_of_rank(rank)
        address = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "unknown address")
        return f"{address} (node id {node_id[:12]})"

    def view(self, ranks: list[int]) -> "PlacedGroup":
        """Ranks `ranks` of this group as ranks 0.. of a group that does not own the placement (colocated roles)."""
        return PlacedGroup(self.pg, [self.rank_bundles[r] for r in ranks], self.bundle_nodes, owned=False)

    def remove(self) -> None:
        if self.owned:
            remove_placement_group(self.pg)


def place(bundles: list[dict[str, float]], strategy: str = "PACK", name: str = "", timeout_s: float = 600.0) -> PlacedGroup:
    """Reserve `bundles` and wait until they are placed (an autoscaler may add nodes meanwhile).

    Raises TimeoutError naming the group and the bundles when the cluster cannot satisfy them in
    time; the placement group is removed so nothing stays reserved."""
    pg = placement_group(bundles, strategy=strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(
            f"placement group {name or pg.id.hex()} ({strategy}, bundles {bundles}) was not placed within "
            f"{timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
        )
    nodes = {int(i): node for i, node in placement_group_table(pg)["bundles_to_node_id"].items()}
    # Deterministic rank order: group bundles by node (in the order nodes first appear), then by index.
    node_order: dict[str, int] = {}
    for i in sorted(nodes):
        node_order.setdefault(nodes[i], len(node_order))
    rank_bundles = sorted(nodes, key=lambda i: (node_order[nodes[i]], i))
    return PlacedGroup(pg=pg, rank_bundles=rank_bundles, bundle_nodes=nodes)
