"""Weight sync across nodes, on a ray.cluster_utils.Cluster of its own.

tests/test_cluster.py runs this in a subprocess: a Cluster starts its own head, which cannot share a
process with the test session's Ray. The cluster is a CPU-less head (the driver), two rollout nodes
and one learner node, told apart by custom resources the config's `<component>.resources` ask for:

    head            rollout node A       rollout node B       learner node
    driver          replica 0 (W=1)      replica 1 (W=1)      learner ranks 0 and 1, WeightSyncActor

The learner (two ranks) trains one FlowGRPO step on a group replica 0 sampled and pushes its rollout adapter to the
WeightSyncActor, which broadcasts it to both replicas over gloo (all nodes are on 127.0.0.1 here, with distinct node
ids). Then replica 0 samples a request and both learner ranks prefetch it (learner.prefetch), and the learners train
on it.
Prints one JSON line for the test to check: where every actor ran (from the GCS actor table), whether every
rank holds the learner's adapter bit for bit, and where the prefetched request's trajectories ended up.

Every object goes through the nodes' object stores (`max_direct_call_object_size`), as a real model's
trajectories of megabytes do: the tiny model's would otherwise travel inline with the task's reply.

    python tests/cluster_weight_sync.py MODEL_DIR OUT_DIR TEMP_DIR GCS_PORT
"""

import json
import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray starts (RAY-LOCAL.md)

import ray
import torch
from ray.cluster_utils import Cluster
from ray.experimental import get_object_locations

from rayflow.learner.worker import LearnerGroup
from rayflow.learner.spec import LearnerSpec
from rayflow.rollout.pool import RolloutPool
from rayflow.rollout.spec import RolloutRankSpec
from rayflow.sync.weight_sync import WeightSync
from rayflow.types import RolloutRequest, SamplingParams, TrajectoryRef
from tiny_run import GRPO, small_cfg

ACTOR_CLASSES = ("RolloutWorker", "LearnerWorker", "WeightSyncActor")


def actor_nodes() -> dict[str, list[str]]:
    """Node id of every live rayflow actor, by class, from the GCS actor table."""
    nodes: dict[str, list[str]] = {name: [] for name in ACTOR_CLASSES}
    for actor in ray._private.state.actors().values():
        name = actor["ActorClassName"].rsplit(".", 1)[-1]
        if actor["State"] == "ALIVE" and name in nodes:
            nodes[name].append(actor["Address"]["NodeID"])
    return nodes


def sampled(replica, params: SamplingParams, name: str, first_seed: int, version: int):
    """A group of 4 sampled on `replica`'s node under weight `version`: (its future, the batch of its trajectories
    with fixed advantages)."""
    seeds = list(range(first_seed, first_seed + 4))
    future = replica.submit(RolloutRequest(name, ["a red apple"] * 4, [0] * 4, [0] * 4, seeds, params))
    future.wait()
    batch = [TrajectoryRef(future.ref, i, "a red apple", 0, 0, seed, [version], advantage=a)
             for i, (seed, a) in enumerate(zip(seeds, [1.0, -1.0, 0.5, -0.5]))]
    return future, batch


def prefetch_across_nodes(replica, learners: LearnerGroup, params: SamplingParams) -> dict:
    """A request sampled on `replica`'s node, prefetched by every learner rank (as the driver does when it
    finishes), then trained on: where its trajectories are, and what each rank kept of them."""
    future, batch = sampled(replica, params, "prefetched", 11, version=1)
    ray.get([w.prefetch.remote([future.ref], 1) for w in learners.workers])  # the driver does not wait; we do
    nodes = get_object_locations([future.ref])[future.ref]["node_ids"]
    # In a list: a top-level ObjectRef argument would arrive as its value.
    held = ray.get([w.__ray_call__.remote(lambda self, refs: self.trajectories._entries[refs[0]][1].result() is not None,
                                          [future.ref]) for w in learners.workers])
    metrics = learners.get(learners.train_step(batch))[0]
    return {"nodes": nodes, "held": held, "prefetched": metrics["perf/prefetched"], "version": metrics["train/version"]}


def run(model_dir: str, out_dir: str) -> dict:
    cfg = small_cfg(
        GRPO, model_dir, out_dir, "rollout.num_replicas=2", "learner.world_size=2",
        "rollout.resources={rollout_node: 1}", "learner.resources={learner_node: 1}",
        "sync.resources={learner_node: 1}", "sync.verify_checksum=true",
    )
    spec = RolloutRankSpec.from_config(cfg)
    pool = RolloutPool.create(spec, cfg.rollout, name="xnode-rollout")
    sync = learners = None
    try:
        sync = WeightSync(cfg.sync, spec, pool.replicas, timeout_s=120.0, name="xnode-sync")
        learners = LearnerGroup(LearnerSpec.from_config(cfg), name="xnode-learner")
        before = [replica.adapter_weights() for replica in pool.replicas]

        params = SamplingParams(height=32, width=32, num_steps=2, guidance_scale=4.0, sde_type="sde")
        _, batch = sampled(pool.replicas[0], params, "first-step", 1, version=0)
        learners.get(learners.train_step(batch))
        pushed = learners.get(learners.push_weights(sync.actor))[0]
        report = sync.wait(pushed["version"], timeout_s=120.0)
        version = pushed["version"]
        adapter = learners.get(learners.adapter_weights(learners.rollout_adapter_name))[0]

        replicas = []
        for i, replica in enumerate(pool.replicas):
            (trajectory,) = replica.generate(RolloutRequest(f"after-sync-{i}", ["a red apple"], [0], [0], [5], params))
            ranks = replica.adapter_weights()
            replicas.append({
                "name": replica.name,
                "versions": trajectory.versions.tolist(),
                "same_names": all(w.keys() == adapter.keys() for w in ranks),
                "bit_equal": all(torch.equal(w[n], t) for w in ranks for n, t in adapter.items() if n in w),
                "changed": any(not torch.equal(b[n], w[n]) for b, w in zip(before[i], ranks) for n in w),
            })
        prefetch = prefetch_across_nodes(pool.replicas[0], learners, params)
        return {
            "prefetch": prefetch,
            "version": version,
            "report_version": report.version,
            "report_bytes": report.bytes,
            "adapter_bytes": sum(t.numel() * t.element_size() for t in adapter.values()),
            "replicas": replicas,
            "actors": actor_nodes(),
            "placed": {
                "rollout": [r.placed.node_of_rank(0) for r in pool.replicas],
                "learner": sorted({learners.placed.node_of_rank(r) for r in range(2)}),
                "sync": [sync.placed.node_of_rank(0)],
            },
            "node_resources": {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]},
            "head": next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"]),
        }
    finally:
        if learners is not None:
            learners.shutdown()
        if sync is not None:
            sync.shutdown()
        pool.shutdown()


def main(model_dir: str, out_dir: str, temp_dir: str) -> None:
    # No GCS port given: the GCS binds port 0 and publishes what it got. A port picked here beforehand could be taken
    # by another process before the GCS bound it (a CI run failed on "Address already in use").
    head = {"dashboard_agent_listen_port": None, "num_cpus": 0,
            "include_dashboard": False, "temp_dir": temp_dir, "_system_config": {"max_direct_call_object_size": 1024}}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"rollout_node": 1})
        cluster.add_node(num_cpus=2, resources={"learner_node": 3})
        ray.init(address=cluster.address, log_to_driver=False)
        result = run(model_dir, out_dir)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
