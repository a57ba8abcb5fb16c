"""What a run asks of the cluster, checked before any placement group is created.

A placement group that can never be placed waits forever (or until `place`'s timeout) with an
internal dump of bundles; this check says instead, in one message, what each role needs, what the
cluster has now and what its autoscaler can add, and which keys to change.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from rayflow.config import RayflowConfig
from rayflow.errors import ConfigError

log = logging.getLogger("rayflow")


@dataclass(frozen=True)
class RoleBundles:
    """What one role's placement group asks for: `count` bundles of `cpus` CPUs, `gpus` GPUs and `resources` each."""

    role: str
    count: int
    cpus_key: str
    cpus: float
    gpus_key: str
    gpus: float | None
    """None (a null setting): 1 when the cluster has GPUs, else 0."""
    resources: dict[str, float]

    def resolved_gpus(self, cluster_has_gpus: bool) -> float:
        return self.gpus if self.gpus is not None else float(cluster_has_gpus)


def role_bundles(cfg: RayflowConfig) -> list[RoleBundles]:
    """The run's placement groups, one per role (a rollout rank and a learner rank per device when colocated; no
    weight-sync actor then)."""
    r, lr, rw, s, p = cfg.rollout, cfg.learner, cfg.reward, cfg.sync, cfg.placement
    reward = RoleBundles("reward", rw.num_workers, "reward.cpus_per_worker", rw.cpus_per_worker, "reward.gpus_per_worker",
                         rw.gpus_per_worker, rw.resources)
    if p.colocated:
        return [RoleBundles("devices", lr.world_size, "placement.cpus_per_device", p.cpus_per_device,
                            "placement.gpus_per_device", p.gpus_per_device, p.resources), reward]
    return [
        RoleBundles("rollout", r.num_replicas * r.cfg_parallel_size, "rollout.cpus_per_rank", r.cpus_per_rank,
                    "rollout.gpus_per_rank", r.gpus_per_rank, r.resources),
        RoleBundles("learner", lr.world_size, "learner.cpus_per_rank", lr.cpus_per_rank, "learner.gpus_per_rank",
                    lr.gpus_per_rank, lr.resources),
        reward,
        RoleBundles("sync", 1, "sync.cpus", s.cpus, "sync.gpus", s.gpus, s.resources),
    ]


def pin_null_gpus(cfg: RayflowConfig, gpus_now: bool, autoscaler_max: dict[str, float] | None) -> None:
    """Set each null GPU count of `cfg` (in place) to 1 on a cluster with GPUs or whose autoscaler reports it can add
    them, else 0, once for the whole run: every role and every replacement then asks the same. Read from the cluster
    of the moment instead, null was 0 on an autoscaling cluster whose GPU-less head is all there is at the start, and
    the ranks ran on the GPU nodes without a GPU. Where that cannot be told (no GPU yet, an autoscaler that does not
    report what it can add: the v1 autoscaler of the shipped cluster configs) null is 0, with a warning naming the
    keys to set. A null sync.gpus is 0 beside rollout ranks given 0 GPUs: the broadcast source computes where the ranks
    it sends to do."""
    nulls = [b for b in role_bundles(cfg) if b.gpus is None]
    if not nulls:
        return
    if not gpus_now and autoscaler_max is None:
        log.warning("%s: null means 0 GPUs here: the cluster has no GPU yet and its autoscaler does not report the node "
                    "types it can add; set them (1 for a GPU per rank) for ranks on GPU nodes it would add",
                    ", ".join(b.gpus_key for b in nulls))
    gpus = 1.0 if gpus_now or (autoscaler_max or {}).get("GPU", 0) > 0 else 0.0
    for b in nulls:
        section, key = b.gpus_key.split(".")
        setattr(getattr(cfg, section), key, gpus)
    if any(b.gpus_key == "sync.gpus" for b in nulls) and cfg.rollout.gpus_per_rank == 0:
        cfg.sync.gpus = 0.0  # the broadcast source on the device of the ranks it sends to (check_sync_source_device)


def check_bundles_reserve_something(cfg: RayflowConfig, cluster_has_gpus: bool | None) -> None:
    """ConfigError naming the CPU key of a role whose bundle would be empty (Ray refuses to place one): no CPUs,
    no GPUs, no custom resources. A null GPU count is 0 on a cluster without GPUs; with `cluster_has_gpus` None
    (not known yet, before Ray starts) it passes."""
    for b in role_bundles(cfg):
        if b.gpus is None and cluster_has_gpus is None:
            continue
        gpus = b.resolved_gpus(bool(cluster_has_gpus))
        why = f"{b.gpus_key}=null on a cluster without GPUs" if b.gpus is None else f"{b.gpus_key}={b.gpus:g}"
        if not (b.cpus > 0 or gpus > 0 or any(v > 0 for v in b.resources.values())):
            raise ConfigError(b.cpus_key, b.cpus, f"a float > 0 with {why} and no custom resources (Ray cannot place an "
                                                  f"empty bundle: every {b.role} bundle must reserve something)")


def role_demand(cfg: RayflowConfig, cluster_has_gpus: bool) -> dict[str, dict[str, float]]:
    """Role → {resource: total amount} the run's placement groups reserve (gpus null → 1 on a GPU cluster)."""
    out = {}
    for b in role_bundles(cfg):
        need = {"CPU": b.count * b.cpus, "GPU": b.count * b.resolved_gpus(cluster_has_gpus),
                **{k: b.count * v for k, v in b.resources.items()}}
        out[b.role] = {k: v for k, v in need.items() if v > 0}
    return out


def required_cpus(cfg: RayflowConfig) -> float:
    """Logical CPUs the run's placement groups reserve."""
    return sum(d.get("CPU", 0.0) for d in role_demand(cfg, cluster_has_gpus=False).values())


KNOBS = {
    "CPU": "rollout.cpus_per_rank, learner.cpus_per_rank, reward.cpus_per_worker, sync.cpus, placement.cpus_per_device (fractions are fine: a rank runs learner.threads_per_rank / rollout.threads_per_rank torch threads)",
    "GPU": "rollout.num_replicas, rollout.cfg_parallel_size, learner.world_size, *.gpus_per_rank, reward.gpus_per_worker, sync.gpus, placement.gpus_per_device",
}


def check_fits(cfg: RayflowConfig, available: dict[str, float], autoscaler_max: dict[str, float] | None) -> None:
    """Raise ConfigError when the run needs more of a resource than the cluster has and its autoscaler can
    reach. `autoscaler_max`: the most the autoscaler can grow the cluster to ({} when there is no
    autoscaler; None when one runs without reporting its limits: then only empty bundles are refused here)."""
    has_gpus = available.get("GPU", 0) > 0 or bool((autoscaler_max or {}).get("GPU"))
    check_bundles_reserve_something(cfg, has_gpus)
    if autoscaler_max is None:
        return  # an autoscaler of unknown capacity: the placement group's own timeout is the limit
    demand = role_demand(cfg, cluster_has_gpus=has_gpus)
    total: dict[str, float] = {}
    for need in demand.values():
        for k, v in need.items():
            total[k] = total.get(k, 0.0) + v
    for resource, needed in sorted(total.items()):
        have = available.get(resource, 0.0)
        reach = max(have, autoscaler_max.get(resource, 0.0))
        if needed > reach + 1e-9:
            per_role = ", ".join(f"{role} {need[resource]:g}" for role, need in demand.items() if resource in need)
            scaling = f"its autoscaler can grow it to {reach:g}" if autoscaler_max else "no autoscaler can add more"
            raise ConfigError(
                f"resources.{resource}", f"{needed:g} needed ({per_role})",
                f"at most what the cluster has ({have:g} now; {scaling}); change "
                + KNOBS.get(resource, f"the roles' `resources` entries asking for {resource!r}"),
            )


AUTOSCALER_REPORT_WAIT_S = 15.0
"""How long a run that joined a cluster waits for the head's first autoscaler report (every ~5 s, Ray's default)."""


def check_cluster_fits(cfg: RayflowConfig, joined: bool = False) -> None:
    """check_fits against the connected Ray cluster (call after ray.init, before any placement group), after null GPU
    counts are pinned to what they mean there (pin_null_gpus). `joined`: the cluster was there before the run (not a
    local Ray it started), so its autoscaler's first report is waited for."""
    import ray
    from ray._private.state import state

    # Autoscalers that report their node groups (KubeRay, autoscaler v2) give their limits.
    autoscaler_max = state.get_max_resources_from_cluster_config()
    if autoscaler_max is None:
        runs = classic_autoscaler_runs(AUTOSCALER_REPORT_WAIT_S if joined else 0.0)
        autoscaler_max = None if runs else {}
    available = ray.cluster_resources()
    pin_null_gpus(cfg, available.get("GPU", 0) > 0, autoscaler_max)
    check_sync_source_device(cfg)
    check_fits(cfg, available, autoscaler_max)
    if autoscaler_max == {}:  # the nodes there are now are all there will be
        check_placeable(cfg, [node["Resources"] for node in ray.nodes() if node["Alive"]])


def check_sync_source_device(cfg: RayflowConfig) -> None:
    """ConfigError naming sync.gpus when the weight-sync actor and the rollout ranks it broadcasts to would not both
    have a GPU or both be without one (disaggregated placement, GPU counts pinned): the group's backend follows each
    member's device, so a CPU source (gloo) never meets GPU ranks' NCCL, nor a GPU source (NCCL) CPU ranks' gloo: the
    ranks waited out the group's forming timeout at the first weight sync. Before each role asked Ray whether it had a
    GPU (placement.uses_cuda), both took their node's cuda:0, another role's GPU."""
    if cfg.placement.colocated or cfg.rollout.gpus_per_rank is None or cfg.sync.gpus is None:
        return
    ranks, source = cfg.rollout.gpus_per_rank > 0, cfg.sync.gpus > 0
    if ranks and not source:
        raise ConfigError("sync.gpus", cfg.sync.gpus, f"a float > 0 (null: 1 on a GPU cluster) with "
                                                      f"rollout.gpus_per_rank={cfg.rollout.gpus_per_rank:g}: the "
                                                      f"broadcast to GPU rollout ranks is NCCL, whose source needs a GPU")
    if source and not ranks:
        raise ConfigError("sync.gpus", cfg.sync.gpus, "0 or null with rollout.gpus_per_rank=0: the rollout ranks "
                                                      "compute on the CPU and join the broadcast with gloo, which a "
                                                      "source on a GPU (NCCL) never meets")


def check_placeable(cfg: RayflowConfig, nodes: list[dict[str, float]]) -> None:
    """ConfigError naming the keys when a placement group can never be placed on these nodes (each node's resources),
    though the cluster's totals suffice: a bundle no single node holds; STRICT_SPREAD with more ranks than nodes able
    to hold one; STRICT_PACK with more than any node holds. The group would wait out its timeout instead (a replica's
    group is its CFG ranks; the learners' group is every rank)."""
    has_gpus = any(node.get("GPU", 0) > 0 for node in nodes)

    def demand(bundle: RoleBundles, count: int = 1) -> dict[str, float]:
        need = {"CPU": bundle.cpus, "GPU": bundle.resolved_gpus(has_gpus), **bundle.resources}
        return {k: count * v for k, v in need.items() if v > 0}

    def holds(node: dict[str, float], need: dict[str, float]) -> bool:
        return all(node.get(k, 0.0) + 1e-9 >= v for k, v in need.items())

    def shown(need: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:g}" for k, v in need.items())

    bundles = role_bundles(cfg)
    for b in bundles:
        if not any(holds(node, demand(b)) for node in nodes):
            raise ConfigError(f"{b.cpus_key}, {b.gpus_key}", shown(demand(b)),
                              f"a {b.role} bundle one node holds (the largest has {shown(max(nodes, key=len))}); "
                              f"or {b.role}'s `resources` entries")
    if cfg.placement.colocated:
        return
    rollout, learner = bundles[:2]
    groups = (("rollout.placement_strategy", cfg.rollout.placement_strategy, rollout, cfg.rollout.cfg_parallel_size),
              ("learner.placement_strategy", cfg.learner.placement_strategy, learner, cfg.learner.world_size))
    for key, strategy, bundle, size in groups:
        able = sum(holds(node, demand(bundle)) for node in nodes)
        if strategy == "STRICT_SPREAD" and size > able:
            raise ConfigError(key, strategy, f"PACK, SPREAD or STRICT_PACK for {size} {bundle.role} bundles on a "
                                             f"cluster of {able} node(s) able to hold one (STRICT_SPREAD puts each on "
                                             f"a node of its own)")
        if strategy == "STRICT_PACK" and not any(holds(node, demand(bundle, size)) for node in nodes):
            raise ConfigError(key, strategy, f"PACK or SPREAD: STRICT_PACK puts the {size} {bundle.role} bundles "
                                             f"({shown(demand(bundle, size))}) on one node, and no node of the cluster "
                                             f"holds them")


def classic_autoscaler_runs(wait_s: float = 0.0) -> bool:
    """Whether the head's autoscaler (v1) has an autoscaling config. Every head runs its monitor, but a
    head without one reports each node under a "readonly" type named after the node's id; node types of
    a cluster config (ray.head.default, gpu_worker, ...) mean nodes can be added. The first report comes a few
    seconds after the head starts: `wait_s` waits for it (a run submitted at once was told no autoscaler could add
    anything); without one by then, as without an autoscaler."""
    import ray
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray.autoscaler._private.util import format_readonly_node_type
    from ray.experimental.internal_kv import _internal_kv_get

    deadline = time.monotonic() + wait_s
    while not (status := _internal_kv_get(DEBUG_AUTOSCALING_STATUS)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not status:
        return False
    active = (json.loads(status).get("autoscaler_report") or {}).get("active_nodes") or {}
    readonly = {format_readonly_node_type(node["NodeID"]) for node in ray.nodes()}
    return bool(set(active) - readonly)
