"""The learner's Ray side: LearnerWorker (a thin actor per rank around a LearnerBackend) and the
driver-side LearnerGroup that places the ranks, slices batches and collects results.

    group = LearnerGroup(LearnerSpec.from_config(cfg))   # learner.world_size ranks in one placement group
    group.prefetch([request_ref], version)         # a rollout request finished: every rank fetches it now
                                                   # (or, of several ranks, pulls it onto its node)
    metrics = group.get(group.train_step(batch))[0]
    group.get(group.push_weights(sync_actor))      # rank 0 hands the rollout weights to rayflow.sync's actor
    save_checkpoint(root, group.checkpoint(step, sampler.state_dict()), keep)
    group.restore(load_checkpoint(path, group.identity))
    group.restart(error)                           # a rank died: new ranks in the same bundles (learner.max_restarts)
    group.shutdown()

Remote calls return ObjectRefs in rank order; `get` waits for all of them and, when a rank died,
raises LearnerError naming the rank and its node instead of leaving its peers hanging in a collective.

The model and checkpoint code (backend.py: FSDP2, DCP, diffusers, peft) is imported when a rank is built, not with
this module: the driver imports it for LearnerGroup, and Ray imports an actor's class module in every process that
receives one of its handles.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import TYPE_CHECKING

import ray
import torch

from rayflow.checkpoint import Checkpoint, CheckpointWriteError, check_identity, sharded_staging_dir
from rayflow.distributed.placement import PlacedGroup, Reservation, resolve_gpus, uses_cuda
from rayflow.distributed.placement import reserve as reserve_placement
from rayflow.distributed.restart_budget import RestartBudget
from rayflow.distributed.process_group import GroupHost, Rendezvous, init_default_group
from rayflow.distributed.tensor_pickle import install as install_tensor_pickling
from rayflow.driver.timing import Phases, process_age_s
from rayflow.errors import ConfigError
from rayflow.learner.prefetch import TrajectoryCache
from rayflow.distributed.parallelize import build_mesh
from rayflow.learner.spec import LEARNER_COLLECTIVE_TIMEOUT_S, LearnerSpec
from rayflow.rng import get_rng_state
from rayflow.types import Trajectory, TrajectoryRef

if TYPE_CHECKING:
    from rayflow.learner.backend import LearnerBackend


class LearnerError(RuntimeError):
    """A learner rank died or failed; the message names the rank and its node."""


class LearnerStalled(LearnerError):
    """A train step missed the watchdog's deadline, or another call of the driver's (a checkpoint save or restore, a
    weight push) the same deadline: a rank neither finished nor died."""


PEER_DEATH_GRACE_S = 10.0
"""After a rank fails other than by dying, how long the other ranks' calls get to show whether one of them died: a
rank's collective fails as soon as a peer's process is gone, often before Ray reports that peer's death."""

LEARNER_CONCURRENCY_GROUPS = {"trajectories": 1}
"""A learner rank's calls run one at a time on one thread, except `prefetch`, which runs beside them."""


class LearnerWorker(GroupHost):
    """One learner rank: owns its device, the default process group, a LearnerBackend and the trajectories
    fetched ahead of their train step."""

    def __init__(self, spec: LearnerSpec, rank: int, whole_pipeline: bool = False):
        """`whole_pipeline`: load the text encoder and VAE too (colocated placement samples with this model)."""
        torch.set_num_threads(spec.learner.threads_per_rank)
        install_tensor_pickling()
        self.spec, self.rank, self.whole_pipeline = spec, rank, whole_pipeline
        self.backend: LearnerBackend | None = None
        # One rank trains every request it is handed; one of several only its shard, unknown until the batch forms.
        self.trajectories = TrajectoryCache(spec.max_staleness, hold=spec.learner.world_size == 1)
        self.last_push: ray.ObjectRef | None = None
        """The newest push_weights call to a weight-sync actor; the next push waits for it to be taken."""
        self.last_push_version = 0
        """The version `last_push` carries (named when the actor does not take it)."""

    def setup(self, rendezvous: Rendezvous) -> dict:
        """Join the group, build the sharded model; returns the policy identity. Every rank at once."""
        # Where this rank's start-up went (setup_seconds; the launcher logs rank 0's); no process age off Linux.
        age = process_age_s()
        self.setup_s: dict[str, float] = {} if age is None else {"process age": age}
        phase = Phases(self.setup_s)
        with phase("device"):
            # Ray exposes the bundle's GPU as the only visible one.
            device = torch.device("cuda", 0) if uses_cuda() else torch.device("cpu")
            if device.type == "cuda":
                torch.cuda.set_device(device)
        world_size = self.spec.learner.world_size
        with phase("process group"):
            init_default_group(rendezvous, self.rank, world_size, device, timeout_s=LEARNER_COLLECTIVE_TIMEOUT_S)
        with phase("model"):
            from rayflow.learner.backend import LearnerBackend

            self.backend = LearnerBackend(self.spec, build_mesh(device, world_size), device,
                                          transformer_only=not self.whole_pipeline)
        return self.backend.identity

    def setup_seconds(self) -> dict[str, float]:
        return self.setup_s

    def sees(self, path: str) -> bool:
        """Whether `path` exists on this rank's node (LearnerGroup.check_shared_checkpoints)."""
        return os.path.exists(path)

    @ray.method(concurrency_group="trajectories")
    def prefetch(self, refs: list[ray.ObjectRef], version: int) -> None:
        """Fetch finished rollout requests' trajectories (at driver version `version`), or, one rank of several, pull
        them onto this node, while this rank trains or waits: the train step that needs them finds them here or on
        the node (rayflow.learner.prefetch)."""
        self.trajectories.prefetch(refs, version)

    def train_step(self, batch: list[Trajectory] | list[tuple[ray.ObjectRef, int, float]], push_to=None) -> dict[str, float]:
        """Train the whole batch; only the entries this rank's mini-batch slices need are fetched (or taken from
        the prefetched ones). Then, with `push_to` (a weight-sync actor), push the new version to it at once
        (push_weights' timings are in the metrics as sync/gather_s, sync/push_s): the broadcast starts without a
        round trip through the driver."""
        needed = sorted({i for step in self.backend.rank_steps(len(batch)) for i in step})
        shard, fetch = self.trajectories.fetch([batch[i] for i in needed])
        fetched = dict(zip(needed, shard))
        metrics = self.backend.train_step([fetched.get(i) for i in range(len(batch))])
        self.trajectories.forget([item[0] for item in batch if isinstance(item, tuple)])
        self.trajectories.forget_before(self.backend.version)
        metrics.update({"perf/fetch_s": fetch.wait_s, "perf/prefetched": fetch.prefetched / max(fetch.requests, 1)})
        if push_to is not None:
            push = self.push_weights(push_to)
            metrics.update({"sync/gather_s": push["gather_s"], "sync/push_s": push["push_s"]})
            if "stalled_version" in push:
                metrics["sync/stalled_version"] = push["stalled_version"]
        return metrics

    def adapter_weights(self, adapter: str) -> dict[str, torch.Tensor] | None:
        return self.backend.adapter_weights(adapter)

    def rollout_adapter_name(self) -> str:
        return self.backend.rollout_adapter_name

    def push_weights(self, sync_actor) -> dict[str, float]:
        """Hand the rollout adapter to the weight-sync actor, then go back to training.

        Every rank takes part in gathering the adapter, which rank 0 copies once into one flat buffer
        (gather_s); Ray moves that buffer into its object store with one memcpy (push_s: how long rank 0
        is blocked handing it over). The broadcast goes on without the learner; `WeightSync.wait`
        reports how it ended.

        A previous push the actor has not taken within spec.push_timeout_s (stuck in it, or stopped) is reported as
        "stalled_version" (its version), and this one is not sent: the driver replaces the actor and pushes again
        (rank 0 waited for it with no deadline, blocked in its train step until the learners' watchdog blamed them)."""
        start = time.perf_counter()
        wire = self.backend.rollout_wire()
        gathered = time.perf_counter()
        stalled: dict[str, int] = {}
        if wire is not None:
            # The weight-sync actor is threaded (max_concurrency > 1), so Ray runs its calls side by side and out of
            # order: a push sent before the last one is taken could be refused as older, and stop the sync. The last
            # one was almost always taken during the train step between them. Its outcome is the sync's to report.
            taken = self.last_push is None or ray.wait([self.last_push], timeout=self.spec.push_timeout_s,
                                                       fetch_local=False)[0]
            if taken:
                self.last_push, self.last_push_version = sync_actor.push.remote(wire), wire.manifest.version
            else:
                stalled["stalled_version"] = self.last_push_version
        return {"version": self.backend.version, "gather_s": gathered - start, "push_s": time.perf_counter() - gathered,
                **stalled}

    def state_dict(self, directory: str | None) -> dict:
        return self.backend.state_dict(directory)

    def load_state_dict(self, state: dict, rng: dict[str, torch.Tensor] | None) -> None:
        self.backend.load_state_dict({**state, "rng": rng})
        self.trajectories.clear()  # rewound: the requests in flight were dropped


def light_batch(batch: list[Trajectory] | list[TrajectoryRef], world_size: int) -> list:
    """The batch as every rank receives it: Trajectories without their decoded images (learners never
    read them), TrajectoryRefs as (ref, index, advantage) for each rank to fetch the entries it trains on."""
    if len(batch) % world_size:
        raise ValueError(f"a batch of {len(batch)} trajectories does not split into {world_size} equal learner shards")
    return [
        (t.ref, t.index, t.advantage) if isinstance(t, TrajectoryRef) else dataclasses.replace(t, image=None)
        for t in batch
    ]


class LearnerGroup:
    """learner.world_size LearnerWorker ranks in one placement group (GPU bundles when the cluster has GPUs)."""

    def __init__(self, spec: LearnerSpec, name: str = "rayflow-learner", reservation: Reservation | None = None,
                 wait: bool = True):
        """`reservation`: the group's placement asked for already (`LearnerGroup.reserve`). `wait=False`: the ranks
        are started and not waited for (`wait_ready` does), so that other roles' actors start while they build."""
        lc = spec.learner
        self.spec, self.name = spec, name
        self.world_size = lc.world_size
        self.placed = (reservation or self.reserve(spec, name)).wait()
        self.budget = RestartBudget(lc.max_restarts, lc.restart_window_s)
        self.restarts = 0
        """Times the group was started again after a rank died."""
        self._spawn()
        if wait:
            self.wait_ready()

    @staticmethod
    def reserve(spec: LearnerSpec, name: str = "rayflow-learner") -> Reservation:
        """The group's placement, asked for without waiting."""
        lc = spec.learner
        return reserve_placement(lc.world_size, lc.cpus_per_rank, resolve_gpus(lc.gpus_per_rank), lc.resources,
                                 lc.placement_strategy, name=name)

    @classmethod
    def over(cls, spec: LearnerSpec, placed: PlacedGroup, workers: list[ray.actor.ActorHandle],
             name: str = "rayflow-learner") -> "LearnerGroup":
        """A learner group of ranks someone else started (`workers` serve LearnerWorker's calls; rank r in `placed`'s
        rank r): colocated devices, which cannot be restarted apart from their rollout ranks."""
        group = cls.__new__(cls)
        group.spec, group.name, group.world_size = spec, name, len(workers)
        group.placed, group.workers, group.budget, group.restarts = placed, workers, None, 0
        group._setup()
        return group

    def wait_ready(self) -> "LearnerGroup":
        """Wait until the ranks started by the constructor joined their group and built the sharded model (version
        0); on failure the ranks are killed and the placement group removed."""
        self._setup()
        return self

    def _start(self, keep_placement: bool = False) -> None:
        """Spawn the ranks in the placement group's bundles and build the sharded model on each (version 0).
        `keep_placement` (a restart): a failure leaves the ranks and the placement group to the caller (the next
        restart kills the ranks, the owner's `shutdown` releases both); at the first start it releases both."""
        self._spawn()
        self._setup(keep_placement)

    def _spawn(self) -> None:
        """Create the ranks' actors in the placement group's bundles, without waiting for them."""
        actor = ray.remote(concurrency_groups=LEARNER_CONCURRENCY_GROUPS)(LearnerWorker)
        self.workers = [
            self.placed.spawn(r, actor, self.spec, r, name=f"{self.name}-{r}-{self.placed.pg.id.hex()[:8]}-{self.restarts}")
            for r in range(self.world_size)
        ]

    def _setup(self, keep_placement: bool = False) -> None:
        """Join the ranks' group and build the sharded model on each (version 0). On failure the ranks are killed and
        the placement group removed, unless `keep_placement`."""
        try:
            (rendezvous,) = self.get([self.workers[0].rendezvous.remote()])
            self.identity: dict = self.get([w.setup.remote(rendezvous) for w in self.workers])[0]
            self.rollout_adapter_name: str = self.get([self.workers[0].rollout_adapter_name.remote()])[0]
            self.check_shared_checkpoints()
        except BaseException:
            if not keep_placement:
                self.shutdown()
            raise

    def check_shared_checkpoints(self) -> None:
        """learner.train_mode=full: each rank writes its checkpoint shards into the run's checkpoints itself, so the
        driver's node and every rank's must see the same storage there. A file the driver writes there must be seen by
        every rank, or ConfigError naming trainer.output_dir, before any step (it was the first save's error)."""
        if self.spec.learner.train_mode != "full":
            return
        root = self.spec.checkpoint_dir
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".shared-probe-", dir=root)
        os.close(fd)
        try:
            seen = self.get([w.sees.remote(probe) for w in self.workers])
        finally:
            os.remove(probe)
        blind = [self.placed.describe(rank) for rank, ok in enumerate(seen) if not ok]
        if blind:
            raise ConfigError("trainer.output_dir", os.path.dirname(os.path.dirname(root)),
                              f"storage the driver's node and every learner node share (NFS, a mounted bucket) with "
                              f"learner.train_mode=full, whose ranks write their checkpoint shards there themselves: "
                              f"learner rank {', '.join(blind)} does not see {probe}")

    def restart(self, died: LearnerError) -> None:
        """After a rank died: kill every rank (its peers are stuck in a collective) and start the group again in the
        same bundles, at version 0 (the caller restores a checkpoint). A rank of the new group that dies while it
        builds its model is a death like the first: the group is started again, each time counted (it stopped the
        run with restarts left, its placement group removed). Raises LearnerError once learner.max_restarts per
        learner.restart_window_s are used up, or when a new rank fails other than by dying (it would fail again)."""
        lc = self.spec.learner
        if self.budget is None:
            raise LearnerError(f"{died}; in placement.mode=colocated the device's rollout rank went with it, so the run "
                               f"stops (continue from the newest checkpoint with trainer.resume=auto)") from died
        while True:
            if not self.budget.take():
                raise LearnerError(f"{died}; the learner group's restarts are used up (learner.max_restarts={lc.max_restarts} "
                                   f"per learner.restart_window_s={lc.restart_window_s}); stopping the run") from died
            for w in self.workers:
                ray.kill(w)
            self.restarts += 1
            try:
                self._start(keep_placement=True)
                return
            except LearnerError as again:
                if not isinstance(again.__cause__, ray.exceptions.RayActorError):
                    raise
                died = again

    def train_step(self, batch: list[Trajectory] | list[TrajectoryRef], push_to=None) -> list[ray.ObjectRef]:
        """Train one batch: algorithm.steps_per_batch optimizer steps, each rank on its slice of every
        mini-batch (TrajectoryRefs are fetched by the ranks, never by the driver); then push the new version to
        the weight-sync actor `push_to` (None: no push); refs to each rank's (equal) metrics."""
        light = light_batch(batch, self.world_size)
        if self.world_size > 1:  # stored once for every rank; one rank takes it inline, without a store round trip
            light = ray.put(light)
        return [w.train_step.remote(light, push_to) for w in self.workers]

    def prefetch(self, refs: list[ray.ObjectRef], version: int) -> None:
        """Every rank starts fetching these finished rollout requests' trajectories (driver version `version`), or,
        of several ranks, pulling them onto its node (rayflow.learner.prefetch); nothing to wait for: a rank that
        died is found by the next train step."""
        for w in self.workers:
            w.prefetch.remote(refs, version)

    def push_weights(self, sync_actor) -> list[ray.ObjectRef]:
        """Refs to each rank's push timings; rank 0 hands the rollout adapter to `sync_actor`
        (rayflow.sync.actor.WeightSyncActor), which then broadcasts it to every rollout rank."""
        return [w.push_weights.remote(sync_actor) for w in self.workers]

    def adapter_weights(self, adapter: str) -> list[ray.ObjectRef]:
        """Refs to each rank's full tensors of `adapter` (rank 0's; the others None)."""
        return [w.adapter_weights.remote(adapter) for w in self.workers]

    def checkpoint(self, step: int, data: dict, timeout_s: float | None = None) -> Checkpoint:
        """The learners' full state as a Checkpoint (rank 0's adapters and optimizer, or with learner.train_mode=full
        every rank's shards, written to a staging directory under the run's checkpoints; every rank's RNG states as
        "learner<r>", the driver's as "driver"), with the driver's step and data position. `timeout_s`: as `get`'s."""
        directory = None
        if self.spec.learner.train_mode == "full":
            directory = sharded_staging_dir(self.spec.checkpoint_dir, step)
        states = self.get([w.state_dict.remote(directory) for w in self.workers], timeout_s, f"the save of step {step}")
        if directory is not None:
            from rayflow.learner.sharded import missing_files  # DCP, imported with the backend's code (module docstring)

            if missing := missing_files(directory):
                raise CheckpointWriteError(
                    f"the learner ranks' checkpoint shards are not all in {directory} here (missing {missing}): ranks "
                    f"on other nodes wrote them to their own disks. With a learner rank on another node than the "
                    f"driver's, trainer.output_dir must be storage the driver and every learner node share (NFS, a "
                    f"mounted bucket)"
                )
        sharded = states[0]["sharded"]
        if sharded is not None:
            sharded = dataclasses.replace(sharded, finite=all(s["sharded"].finite for s in states))
        return Checkpoint(
            step=step,
            version=states[0]["version"],
            identity=self.identity,
            adapters=states[0]["adapters"],
            optimizer=states[0]["optimizer"],
            rng={"driver": get_rng_state(), **{f"learner{r}": s["rng"] for r, s in enumerate(states)}},
            data=data,
            counters={"skipped_steps": states[0]["skipped_steps"]},
            sharded=sharded,
        )

    def restore(self, ckpt: Checkpoint, timeout_s: float | None = None) -> None:
        """Load a checkpoint (of this group, another world size or the reference trainer) into every rank.
        A rank without saved RNG states keeps its own. The driver restores the data position; its "driver" RNG state
        is for the reference trainer, which restores it: the Ray driver draws only from keyed generators. `timeout_s`:
        as `get`'s."""
        check_identity(ckpt.identity, self.identity, f"at step {ckpt.step}")
        shared = ray.put({"adapters": ckpt.adapters, "optimizer": ckpt.optimizer, "sharded": ckpt.sharded,
                          "version": ckpt.version, "skipped_steps": ckpt.counters.get("skipped_steps", 0)})
        self.get([w.load_state_dict.remote(shared, ckpt.rng.get(f"learner{r}")) for r, w in enumerate(self.workers)],
                 timeout_s, f"the restore of step {ckpt.step}")

    def setup_seconds(self) -> dict[str, float]:
        """Rank 0's start-up by part: its process's age when setup began (worker start, imports, constructor),
        then the device, the process group and the model (colocated: and the rollout rank on it)."""
        return self.get([self.workers[0].setup_seconds.remote()])[0]

    def get(self, refs: list[ray.ObjectRef], timeout_s: float | None = None, what: str = "the learners' call") -> list:
        """Wait for per-rank refs (in rank order); the first failure raises LearnerError with its rank and node. A rank
        that died is the failure reported, when one did: its peers' collectives fail too, often first. With
        `timeout_s`, LearnerStalled names the ranks of `what` not done by then (stopped: they neither finish nor die,
        and the driver waited for them for ever)."""
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, rest = ray.wait(pending, num_returns=1, timeout=left_s)
            if not ready:
                late = ", ".join(f"learner rank {self.placed.describe(refs.index(ref))}" for ref in rest)
                raise LearnerStalled(f"{what} not done after {timeout_s:.0f}s (the learners' deadline, "
                                     f"learner.stall_timeout_s as its floor): {late} neither finished nor died; "
                                     f"stopping. Continue from the last checkpoint with trainer.resume=auto")
            (done,), pending = ready, rest
            try:
                ray.get(done)
            except ray.exceptions.RayError as e:
                failed = (refs.index(done), e)
                if not isinstance(e, ray.exceptions.RayActorError):
                    failed = _dead_rank(refs, pending) or failed
                rank, error = failed
                raise LearnerError(
                    f"learner rank {self.placed.describe(rank)} failed: "
                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                ) from error
        return ray.get(refs)

    def check_alive(self, timeout_s: float) -> None:
        """Raise LearnerError (as `get`) naming a rank that died; a rank that does not answer within `timeout_s` (busy
        in a step, or stopped) is not judged here."""
        refs = [w.__ray_ready__.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        self.get([ref if ref in ready else ray.put(None) for ref in refs])  # in rank order: `get` names the rank

    def settled(self, refs: list[ray.ObjectRef]) -> bool:
        """Whether per-rank `refs` are all done, or one failed (a rank that died leaves its peers waiting in a
        collective: `get` then raises at once instead of after their timeout)."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if len(ready) == len(refs):
            return True
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                return True
        return False

    def late_ranks(self, refs: list[ray.ObjectRef]) -> list[str]:
        """The ranks whose per-rank `refs` are not done yet, with their nodes."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return [f"learner rank {self.placed.describe(rank)}"
                for rank, ref in enumerate(refs) if ref not in ready]

    def shutdown(self) -> None:
        """End the actors and release the placement group. Killing (not asking) the ranks: a rank whose
        peer died is stuck in a collective and would answer nothing."""
        for w in self.workers:
            ray.kill(w)
        self.placed.remove()


def _dead_rank(refs: list[ray.ObjectRef], pending: list[ray.ObjectRef]) -> tuple[int, ray.exceptions.RayActorError] | None:
    """(rank, its death) of the first of `pending` (per-rank `refs`) that fails by its actor dying within
    PEER_DEATH_GRACE_S; None if none does."""
    deadline = time.monotonic() + PEER_DEATH_GRACE_S
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as death:
            return refs.index(ready[0]), death
        except ray.exceptions.RayError:
            pass
    return None
