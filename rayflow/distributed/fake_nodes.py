"""The node provider of `cluster/fake_multinode.yaml`: Ray's `fake_multinode` provider (a worker node it launches is
one more raylet on this machine), except that each node unpacks runtime environments into a directory of its own,
as a real node does on its own disk.

Ray's fake nodes share the head's session directory, and so its `runtime_resources/`. A node's runtime-env agent
unpacks a job's `--working-dir` the first time one of its workers needs it by deleting the directory and unzipping
it again. With the learner and the rollout actors starting at once on two fake nodes, the second node's unpacking
deleted the directory under the first node's worker, its current directory: torch._dynamo, imported by diffusers,
calls `os.getcwd()` as it loads, and the rollout actor died with `FileNotFoundError` (earlier, files replaced
mid-import gave "partially initialized module 'torch'"). Nodes of a real cluster never share that directory.

Run with `RAY_FAKE_CLUSTER=1` (Ray's provider requires it), rayflow importable by the head's Python.
"""

from __future__ import annotations

import ray._private.ray_constants as ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

_SHARED_DIR_NAME = ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME


def node_runtime_env_dir_name(node_number: int) -> str:
    """The runtime-env directory (under the session directory) of the `node_number`-th worker node launched."""
    return f"{_SHARED_DIR_NAME}_node{node_number}"


class FakeNodesWithOwnDirs(FakeMultiNodeProvider):
    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        # Ray's provider builds the node's RayParams inside this call, and RayParams takes the directory's name from
        # the module constant when none is given: set for this one node, under the provider's (reentrant) lock.
        with self.lock:
            ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME = node_runtime_env_dir_name(self._next_node_id + 1)
            try:
                super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
            finally:
                ray_constants.DEFAULT_RUNTIME_ENV_DIR_NAME = _SHARED_DIR_NAME
