"""Placement groups: the one place rayflow asks Ray for resources and starts its actors.

Every role (rollout ranks, learner ranks, colocated devices, reward workers, the weight-sync actor) is

    reservation = reserve(count, cpus, gpus, resources, strategy, name)  # one bundle per rank, not waited for
    placed = reservation.wait()                                         # once every bundle is placed
    actor = placed.spawn(rank, ActorClass, *args)                       # in rank's bundle, with its CPUs and GPUs
    f"learner rank {placed.describe(rank)}"                              # how every message names a rank

never by pinning node IPs, so Ray's autoscaler sees the demand and adds the nodes that satisfy it. A run asks for
every role's group first and waits after, so that an autoscaler sees all the demand at once and starts every node
the run needs together, not one node type after the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def gpus_withheld() -> bool:
    """Whether this process is a Ray worker that Ray gave no GPU. Ray (2.60; ray-project/ray#54868) leaves
    CUDA_VISIBLE_DEVICES as it is for such a worker, so torch sees every GPU of its node there: its cuda:0 is the GPU of
    another actor (a rollout rank's, a learner's). Asks Ray only, so no CUDA call is made (nor a later fork spoiled)."""
    if not ray.is_initialized():
        return False
    return ray.get_runtime_context().worker.mode == ray.WORKER_MODE and not ray.get_gpu_ids()


def uses_cuda() -> bool:
    """Whether this process computes on CUDA: a GPU is visible, and in a Ray worker Ray gave it one (every role asks
    this: a rank, reward worker or weight-sync actor given 0 GPUs on a GPU node took the node's cuda:0, another
    role's, instead of the CPU)."""
    import torch

    return not gpus_withheld() and torch.cuda.is_available()


def resolve_gpus(gpus_per_rank: float | None) -> float:
    """A config's gpus_per_rank, with null meaning 1 when the cluster has GPUs and 0 otherwise."""
    if gpus_per_rank is not None:
        return gpus_per_rank
    return 1.0 if cluster_has_gpus() else 0.0


def make_bundles(count: int, cpus: float, gpus: float, extra: dict[str, float] | None = None) -> list[dict[str, float]]:
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {}), **(extra or {})}
    return [dict(bundle) for _ in range(count)]


def describe_rank(rank: int, size: int, address: str, node_id: str) -> str:
    """How every message names a rank (after its role's words): "1 of 2 on node 10.0.0.5 (node id 3f2a...)"."""
    return f"{rank} of {size} on node {address} (node id {node_id[:12]})"


@dataclass
class PlacedGroup:
    """A ready placement group and its bundles in rank order (by node, then bundle index)."""

    pg: PlacementGroup
    rank_bundles: list[int]
    bundle_nodes: dict[int, str]
    bundles: list[dict[str, float]]
    """The resources of each bundle, by bundle index."""
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

    def rank_nodes(self) -> list[tuple[str, str]]:
        """(node address, node id) of each rank, from one look at the cluster's nodes."""
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return [(addresses.get(node, "unknown address"), node) for node in map(self.node_of_rank, range(len(self.rank_bundles)))]

    def describe(self, rank: int) -> str:
        """`rank` for messages: "1 of 2 on node ADDRESS (node id ID)" (describe_rank)."""
        return describe_rank(rank, len(self.rank_bundles), *self.rank_nodes()[rank])

    def spawn(self, rank: int, actor_class, *args, **options) -> ray.actor.ActorHandle:
        """Start `actor_class(*args)` (a ray.remote class) in `rank`'s bundle, holding that bundle's CPUs and GPUs;
        `options`: further actor options (name, max_restarts, concurrency_groups, ...)."""
        bundle = self.bundles[self.rank_bundles[rank]]
        return actor_class.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=self.strategy_for_rank(rank), **options
        ).remote(*args)

    def view(self, ranks: list[int]) -> "PlacedGroup":
        """Ranks `ranks` of this group as ranks 0.. of a group that does not own the placement (colocated roles)."""
        return PlacedGroup(self.pg, [self.rank_bundles[r] for r in ranks], self.bundle_nodes, self.bundles, owned=False)

    def remove(self) -> None:
        if self.owned:
            remove_placement_group(self.pg)


@dataclass
class Reservation:
    """A placement group asked for and not waited for yet: its demand is already visible to an autoscaler."""

    pg: PlacementGroup
    bundles: list[dict[str, float]]
    strategy: str
    name: str
    settled: bool = False
    """Waited for (the caller owns the placed group) or removed."""
    _ready: ray.ObjectRef | None = field(default=None, repr=False)

    def ready_ref(self) -> ray.ObjectRef:
        """The group's ready() probe, asked for once: each pg.ready() starts a probe task of its own, never done at
        once, so a poll that asked anew each time would never see the group placed."""
        if self._ready is None:
            self._ready = self.pg.ready()
        return self._ready

    def placed(self) -> bool:
        """Whether Ray has placed every bundle, without waiting."""
        return bool(ray.wait([self.ready_ref()], timeout=0)[0])

    def wait(self, timeout_s: float = 600.0) -> PlacedGroup:
        """The placed group, once Ray placed every bundle (an autoscaler may add nodes meanwhile).

        Raises TimeoutError naming the group and the bundles when the cluster cannot satisfy them in
        time; the placement group is removed so nothing stays reserved."""
        self.settled = True
        pg, bundles = self.pg, self.bundles
        ready, _ = ray.wait([self.ready_ref()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise TimeoutError(
                f"placement group {self.name or pg.id.hex()} ({self.strategy}, bundles {bundles}) was not placed within "
                f"{timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
            )
        nodes = {int(i): node for i, node in placement_group_table(pg)["bundles_to_node_id"].items()}
        # Deterministic rank order: group bundles by node (in the order nodes first appear), then by index.
        node_order: dict[str, int] = {}
        for i in sorted(nodes):
            node_order.setdefault(nodes[i], len(node_order))
        rank_bundles = sorted(nodes, key=lambda i: (node_order[nodes[i]], i))
        return PlacedGroup(pg=pg, rank_bundles=rank_bundles, bundle_nodes=nodes, bundles=bundles)

    def shutdown(self) -> None:
        """Remove the placement group unless it was waited for (then its owner removes it): a run that stops before
        a role took its reservation leaves nothing reserved."""
        if not self.settled:
            self.settled = True
            remove_placement_group(self.pg)


def reserve(count: int, cpus: float, gpus: float, resources: dict[str, float] | None = None, strategy: str = "PACK",
            name: str = "") -> Reservation:
    """Ask for `count` bundles of `cpus` CPUs, `gpus` GPUs and custom `resources` each (one per rank), without
    waiting for them."""
    bundles = make_bundles(count, cpus, gpus, resources)
    return Reservation(placement_group(bundles, strategy=strategy, name=name), bundles, strategy, name)

