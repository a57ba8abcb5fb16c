"""Weight sync across nodes, on a ray.cluster_utils.Cluster of its own.

tests/test_cluster.py runs this in a subprocess: a Cluster starts its own head, which cannot share a
process with the test session's Ray. The cluster is a CPU-less head (the driver), two rollout nodes
and one learner node, told apart by custom resources the config's `<component>.resources` ask for:

    head            rollout node A       rollout node B       learner node
    driver          replica 0 (W=1)      replica 1 (W=1)      learner rank 0, WeightSyncActor

The learner trains one FlowGRPO step and pushes its rollout adapter to the WeightSyncActor, which
broadcasts it to both replicas over gloo (all nodes are on 127.0.0.1 here, with distinct node ids).
Prints one JSON line for the test to check: where every actor ran (from the GCS actor table) and
whether every rank holds the learner's adapter bit for bit.

    python tests/cluster_weight_sync.py MODEL_DIR OUT_DIR TEMP_DIR GCS_PORT
"""

import json
import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray starts (RAY-LOCAL.md)

import ray
import torch
from ray.cluster_utils import Cluster

from rayflow import reference
from rayflow.learner.worker import LearnerGroup
from rayflow.learner.spec import LearnerSpec
from rayflow.rollout.pool import RolloutPool
from rayflow.rollout.rank import RolloutRankSpec
from rayflow.sync.weight_sync import WeightSync
from rayflow.types import RolloutRequest, SamplingParams
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


def run(model_dir: str, out_dir: str) -> dict:
    cfg = small_cfg(
        GRPO, model_dir, out_dir, "rollout.num_replicas=2",
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

        run_state = reference.build_run(cfg)  # the driver samples the batch in-process
        batch, _ = reference.rollout(run_state)
        learners.get(learners.train_step(batch))
        pushed = learners.get(learners.push_weights(sync.actor))[0]
        report = sync.wait(pushed["version"], timeout_s=120.0)
        version = pushed["version"]
        adapter = learners.get(learners.adapter_weights(learners.rollout_adapter_name))[0]

        params = SamplingParams(height=32, width=32, num_steps=2, guidance_scale=4.0, sde_type="sde")
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
        return {
            "version": version,
            "report_version": report.version,
            "report_bytes": report.bytes,
            "adapter_bytes": sum(t.numel() * t.element_size() for t in adapter.values()),
            "replicas": replicas,
            "actors": actor_nodes(),
            "placed": {
                "rollout": [r.placed.node_of_rank(0) for r in pool.replicas],
                "learner": [learners.placed.node_of_rank(0)],
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


def main(model_dir: str, out_dir: str, temp_dir: str, port: str) -> None:
    # Ports of its own (6379 and 52365 may be taken by another Ray on this machine).
    head = {"gcs_server_port": int(port), "dashboard_agent_listen_port": None, "num_cpus": 0,
            "include_dashboard": False, "temp_dir": temp_dir}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources={"rollout_node": 1})
        cluster.add_node(num_cpus=2, resources={"learner_node": 2})
        ray.init(address=cluster.address, log_to_driver=False)
        result = run(model_dir, out_dir)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
