"""Colocated placement: every device holds the pipeline once and alternates sampling and training.

    devices = ColocatedDevices(learner_spec, rollout_spec, cfg.placement, cfg.rollout)
    devices.learners                                # LearnerGroup over the devices (learner.world_size ranks)
    devices.rollout                                 # RolloutPool: replica i = devices i·W .. i·W+W−1 (W = cfg_parallel_size)
    devices.weights                                 # SharedWeights: the hand-off, which sends nothing
    devices.shutdown()

A DeviceWorker is a learner rank and a rollout rank over one model. The rollout samples under the learner's
rollout adapter ("default"; DiffusionNFT's EMA "old"): the very parameters the optimizer just stepped, so no
weight is copied or broadcast, and the loop is the reference trainer's, spread over the devices. Sharded
learners (FSDP2) gather their parameters once after every call that changes or reads them (train step,
restore, checkpoint) and keep them gathered while the device samples — its forwards need no collective, so
the replicas serve different requests — then free them before the next train step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray
import torch

from rayflow.config import PlacementConfig, RolloutConfig
from rayflow.distributed.placement import PlacedGroup, Reservation, resolve_gpus
from rayflow.distributed.placement import reserve as reserve_placement
from rayflow.distributed.watchdog import Watchdog
from rayflow.driver.timing import Phases
from rayflow.errors import ConfigError
from rayflow.learner.optim import offload_optimizer_state, reload_optimizer_state
from rayflow.distributed.parallelize import autocast, gather_for_sampling, release_gathered
from rayflow.models.lora import TRAINED_ADAPTER
from rayflow.models.weight_sets import using_weights
from rayflow.learner.spec import LearnerSpec
from rayflow.learner.worker import LEARNER_CONCURRENCY_GROUPS, LearnerGroup, LearnerWorker
from rayflow.rollout.pool import RolloutPool
from rayflow.rollout.spec import RolloutRankSpec
from rayflow.rollout.replica import RolloutReplica
from rayflow.rollout.worker import CONCURRENCY_GROUPS, RolloutRankHost
from rayflow.sync.source import SyncReport
from rayflow.types import RolloutRequest, Trajectory

if TYPE_CHECKING:
    from rayflow.cfg.policy import CFGPolicy


@ray.remote(concurrency_groups={**CONCURRENCY_GROUPS, **LEARNER_CONCURRENCY_GROUPS})
class DeviceWorker(RolloutRankHost):
    """Learner rank `rank` and rank `replica_rank` of a CFG-parallel rollout replica of `replica_size`, on one device.

    Learner calls come to every device at once and in the same order (they are collectives over the learner
    mesh); requests run on the same thread, between them, so sampling and training never overlap."""

    def __init__(self, learner_spec: LearnerSpec, rank: int, spec: RolloutRankSpec, replica_rank: int, replica_size: int):
        self.learner_config = learner_spec.learner
        self.learner = LearnerWorker(learner_spec, rank, whole_pipeline=True)
        self._rollout_rank = (spec, replica_rank, replica_size)
        self._offloaded: list = []
        self._sampling = contextlib.ExitStack()
        """Holds the rollout weights in the forward's place while the device samples."""

    # -- the learner's calls: training state changes or is read, then the device samples again ---------
    def setup(self, rendezvous) -> dict:
        # The model code here, not at the module's top: the driver imports this module for ColocatedDevices.
        from rayflow.rollout.rank import RolloutRank, SharedModel

        identity = self.learner.setup(rendezvous)
        backend = self.learner.backend
        with Phases(self.learner.setup_s)("rollout rank"):
            # LoRA samples with the rollout adapter; full fine-tuning swaps the rollout weights into the parameters.
            slot = backend.rollout_adapter_name if self.learner_config.train_mode == "lora" else TRAINED_ADAPTER
            self.rank = RolloutRank(*self._rollout_rank, shared=SharedModel(backend.model, slot))
            self._to_sampling()
        return identity

    def setup_seconds(self) -> dict[str, float]:
        return self.learner.setup_s

    @ray.method(num_returns=2)
    def generate(self, request: RolloutRequest, policy: CFGPolicy | None = None,
                 weights: dict[str, torch.Tensor] | None = None) -> tuple[int, list[Trajectory] | None]:
        """RolloutRankHost.generate, under the learner's autocast when it trains every weight: full fine-tuning with
        learner.mixed_precision=autocast holds fp32 master weights over a model.dtype pipeline (a bfloat16 one's
        latents and prompt embeddings met fp32 weights: "mat1 and mat2 must have the same dtype"), so the device samples
        with the bf16 matmuls its learner trains with. LoRA's adapters cast their own inputs (unchanged)."""
        full = self.learner_config.train_mode == "full"
        with autocast(self.learner_config.mixed_precision if full else "none", self.learner.backend.model.device):
            return super().generate(request, policy, weights)

    def sees(self, path: str) -> bool:
        return self.learner.sees(path)

    @ray.method(concurrency_group="trajectories")
    def prefetch(self, refs: list, version: int) -> None:
        self.learner.prefetch(refs, version)

    def train_step(self, batch: list, push_to: None = None) -> dict[str, float]:
        """`push_to`: always None (nothing to push: see push_weights)."""
        return self._training(self.learner.train_step, batch)

    def adapter_weights(self, adapter: str) -> dict[str, torch.Tensor] | None:
        return self._training(self.learner.adapter_weights, adapter)

    def rollout_adapter_name(self) -> str:
        return self.learner.rollout_adapter_name()

    def push_weights(self, sync_actor: None) -> dict[str, float]:
        """Nothing to hand over: the rollout samples under the adapter the train step updated."""
        return {"version": self.learner.backend.version, "gather_s": 0.0, "push_s": 0.0}

    def state_dict(self, directory: str | None) -> dict:
        return self._training(self.learner.state_dict, directory)

    def load_state_dict(self, state: dict, rng: dict[str, torch.Tensor] | None) -> None:
        self._training(self.learner.load_state_dict, state, rng)

    def _training(self, call, *args):
        """`call` with the trained weights in place and the parameters as the optimizer owns them (sharded), then
        the device is made ready to sample again."""
        backend = self.learner.backend
        release_gathered(backend.transformer, self.learner_config.reshard_after_forward)
        self._sampling.close()
        reload_optimizer_state(self._offloaded)
        self._offloaded = []
        try:
            return call(*args)
        finally:
            self._to_sampling()

    def _to_sampling(self) -> None:
        """The rollout weights in the forward's place (NFT's "old"), then (FSDP2) gathered whole until the next
        learner call; the optimizer state parked on the CPU if learner.offload_optimizer_during_rollout."""
        backend = self.learner.backend
        if self.learner_config.offload_optimizer_during_rollout:
            self._offloaded = offload_optimizer_state(backend.optimizer)
        self._sampling.enter_context(using_weights(backend.transformer, backend.rollout_adapter_name))
        gather_for_sampling(backend.transformer)
        self.rank.receiver.adopt(backend.version)


class SharedWeights:
    """Weight sync in colocated placement, in WeightSync's terms (the driver's loop is the same in both modes):
    every version is on the rollout ranks the moment the train step that made it returns."""

    actor = None
    """Learners push to no actor (DeviceWorker.push_weights)."""
    watching = None
    """No sync runs that could fail."""
    deadline_s = 0.0

    def failure(self, timeout_s: float = 0.0) -> BaseException | None:
        return None

    def wait(self, version: int, timeout_s: float | None = None, check: Callable[[], None] | None = None,
             check_every_s: float = 1.0) -> SyncReport:
        """At once: nothing to wait for (WeightSync.wait's `check` has nothing to look at meanwhile)."""
        return SyncReport(version=version, bytes=0, seconds=0.0, copy_s=0.0, broadcast_s=0.0)

    def lost_versions(self) -> list[int]:
        return []

    def connect(self, replicas: list[RolloutReplica]) -> None:
        """A device left: its peers need no new group to receive from."""

    def rewind(self, version: int, replicas: list[RolloutReplica]) -> None:
        """Devices are never restarted apart from their learner ranks (LearnerGroup.restart refuses)."""

    def slot_tensors(self, adapter: dict[str, torch.Tensor]) -> ray.ObjectRef:
        """`adapter` as the rollout adapter's tensors to sample one request under (its names are the slot's)."""
        return ray.put(adapter)

    def shutdown(self) -> None:
        pass


def replica_ranks(placed: PlacedGroup, devices: int, replica_size: int,
                  node_capacity: dict[str, int] | None = None) -> list[list[int]]:
    """Device ranks of each rollout replica: consecutive runs of `replica_size`, which must lie on one node (a
    replica's all_gather runs every denoising step). Raises ConfigError naming the devices placed per node otherwise,
    and, given `node_capacity` (node id -> the devices it holds in all), the nodes where other placement groups or
    actors held some of them: Ray's PACK strategy then split the group across nodes whose own device counts
    rollout.cfg_parallel_size divides."""
    replicas = [list(range(i, i + replica_size)) for i in range(0, devices, replica_size)]
    for ranks in replicas:
        nodes = {placed.node_of_rank(r) for r in ranks}
        if len(nodes) > 1:
            placed_on = collections.Counter(placed.node_of_rank(r) for r in range(devices))
            per_node = {node[:12]: count for node, count in placed_on.items()}
            short = {node[:12]: f"{count} of its {node_capacity[node]}" for node, count in placed_on.items()
                     if node_capacity and node_capacity.get(node, 0) > count}
            cause = (f"; nodes {short} (devices placed of those the node holds) had the others held by other placement "
                     f"groups or actors: free them, or give learner.world_size a count the free devices hold in whole "
                     f"replicas" if short else " (the nodes' own device counts" +
                     ("" if node_capacity else ", or other placement groups or actors holding some of them") + ")")
            raise ConfigError(
                "rollout.cfg_parallel_size", replica_size,
                f"a divisor of the devices placed on every node in placement.mode=colocated (a replica's ranks must "
                f"share a node; devices placed per node: {per_node}{cause})",
            )
    return replicas


def node_device_capacity(gpus_per_device: float) -> dict[str, int] | None:
    """Node id -> the devices of `gpus_per_device` GPUs each its GPUs hold, over the live nodes; None without GPUs."""
    if gpus_per_device <= 0:
        return None
    return {n["NodeID"]: int(n["Resources"].get("GPU", 0) // gpus_per_device) for n in ray.nodes() if n["Alive"]}


class ColocatedDevices:
    """learner.world_size DeviceWorkers in one placement group, seen as a LearnerGroup and a RolloutPool."""

    def __init__(self, learner_spec: LearnerSpec, spec: RolloutRankSpec, placement: PlacementConfig, rollout: RolloutConfig,
                 name: str = "rayflow-devices", reservation: Reservation | None = None):
        """`rollout`: its cfg_parallel_size (the devices of one replica) and the watchdog's stall_*; its resources are
        disaggregated placement's. `reservation`: the devices' placement asked for already (`reserve`)."""
        devices, W = learner_spec.learner.world_size, rollout.cfg_parallel_size
        self.placed = (reservation or self.reserve(placement, devices, name)).wait()
        self.workers: list = []
        self.replicas: list[RolloutReplica] = []
        try:
            groups = replica_ranks(self.placed, devices, W, node_device_capacity(self.placed.bundles[0].get("GPU", 0)))
            spec = dataclasses.replace(spec, threads=learner_spec.learner.threads_per_rank)
            self.workers = [
                self.placed.spawn(d, DeviceWorker, learner_spec, d, spec, d % W, W) for d in range(devices)
            ]
            self.learners = LearnerGroup.over(learner_spec, self.placed.view(list(range(devices))), self.workers, name=f"{name}-learner")
            self.replicas = [
                RolloutReplica.over(f"rollout-{i}", self.placed.view(ranks), [self.workers[r] for r in ranks],
                                    spec.collective_timeout_s)
                for i, ranks in enumerate(groups)
            ]
            for replica in self.replicas:
                replica.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        # No replacements: a device's learner rank holds optimizer state that a new rollout rank alone cannot bring back.
        self.rollout = RolloutPool(self.replicas, watchdog=Watchdog(rollout.stall_timeout_s, rollout.stall_factor))
        self.weights = SharedWeights()

    @staticmethod
    def reserve(placement: PlacementConfig, devices: int, name: str = "rayflow-devices") -> Reservation:
        """One bundle per device, asked for without waiting."""
        return reserve_placement(devices, placement.cpus_per_device, resolve_gpus(placement.gpus_per_device),
                                 placement.resources, name=name)

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()  # closes its group, kills its ranks
        for worker in self.workers:
            ray.kill(worker)
        self.placed.remove()
