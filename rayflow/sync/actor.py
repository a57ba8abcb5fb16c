"""WeightSyncActor: the broadcast source of the weight-sync group.

Ordering rules and version protocol:
1. Version v = optimizer steps applied. Learner rank 0 calls `push(v, tensors)` after step v with
   the full tensors of `backend.rollout_adapter_name` ("old" for DiffusionNFT, else "default") and
   goes back to training without waiting; the call returns as soon as this actor holds its own copy.
2. Pushes are broadcast one at a time, in push order, by one thread. A push is broadcast in
   buckets (sync.bucket_mb) to every rank of every rollout replica (ranks 1..n of the group); each
   rank verifies names, shapes (and checksums) and stages the version; rollout replicas apply a
   staged version at their next denoising-step boundary (or between requests) once ALL their ranks
   hold it, and tag later steps with it.
3. Versions only grow: a push older than or equal to the last one is refused. Any failure (a
   refused push, a receiver that does not bind what was sent) stops the sync: `wait`, `watch` and
   every later push raise it as WeightSyncError, naming the version and the cause. The learner does
   not wait for its push; the driver keeps one `watch` call in flight, so in asynchronous mode (which
   does not wait for each version) a failed push or broadcast reaches it within a pass of its loop.
4. `wait(v)` returns once version v is staged on every rank (raising the first receiver's error).
5. A replica that joins later (restarted or added) is brought into a new group generation with
   everyone else, and receives the current version before it serves a request.
6. A receiver that dies, or does not answer within the collective timeout (stalled), does not stop
   the sync: the broadcast that met it, and every one queued until the next group generation, raises
   ReceiversLost in `wait`. The driver forms a new generation without the lost ranks, and the newest
   version is broadcast again to it (ranks that already hold it skip re-staging).

In "merged" mode the actor holds the base transformer with one LoRA slot, folds each pushed adapter
into the weights of the adapted linears (W + ΔW, peft's merge) and broadcasts those instead. With
learner.train_mode=full the push is every transformer weight, broadcast as pushed.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import ray
import torch

from rayflow.distributed.process_group import CollectiveGroup, Rendezvous
from rayflow.rollout.rank import RolloutRankSpec
from rayflow.sync.fold import AdapterFolder
from rayflow.sync.broadcast import send
from rayflow.sync.buckets import Packed, WirePush, from_wire, make_manifest, pack_all


RECEIVER_GRACE_S = 10.0
"""After a failed broadcast, receivers get the collective timeout plus this to fail their own side (they
are in the same collective); one still silent then is stalled."""


class WeightSyncError(RuntimeError):
    """The weight sync stopped: a push was refused, or a broadcast failed other than by losing receivers."""


def one_line(error: BaseException) -> str:
    """`error` as type and first line; for a remote task's error, the task's own exception (not Ray's wrapper)."""
    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        error = error.cause
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


class ReceiversLost(RuntimeError):
    """Receivers of the weight-sync group died or stalled; the newest version goes to the next group generation."""


@dataclass(frozen=True)
class SyncSpec:
    mode: str = "lora"
    bucket_mb: float = 64.0
    verify_checksum: bool = False
    timeout_s: float = 300.0

    @property
    def broadcast_deadline_s(self) -> float:
        """The longest a broadcast takes before it is delivered or fails: its collectives' timeout, then as long
        (and a grace) for the receivers to answer."""
        return 2 * self.timeout_s + RECEIVER_GRACE_S

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


@dataclass
class SyncReport:
    version: int
    bytes: int
    seconds: float
    """Wall time of this version's sync in the actor: copy_s + broadcast_s."""
    copy_s: float
    """Laying the push out as broadcast buckets (merged mode: folding, and a copy into new buckets)."""
    broadcast_s: float
    """Notifying the receivers, the bucket broadcasts, and their verification and staging."""


@ray.remote(max_concurrency=8)
class WeightSyncActor:
    def __init__(self, spec: SyncSpec, rollout_spec: RolloutRankSpec):
        """`rollout_spec` says what the receivers hold (model and LoRA shape); merged mode folds with it."""
        self.spec = spec
        # Full fine-tuning pushes the plain weights themselves: nothing to fold.
        self.fold = AdapterFolder(rollout_spec) if spec.mode == "merged" and rollout_spec.train_mode == "lora" else None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.group: CollectiveGroup | None = None
        self.receivers: list = []
        self.latest: tuple[int, Packed] | None = None
        self.reports: dict[int, SyncReport] = {}
        self.lost: dict[int, ReceiversLost] = {}
        """Versions whose broadcast met a dead receiver (until a later generation delivers them)."""
        self.error: WeightSyncError | None = None
        """Why the sync stopped (the version and the cause), once it has."""
        self._pending: queue.Queue = queue.Queue()
        self._done = threading.Condition()
        self._lock = threading.Lock()
        self._fold_lock = threading.Lock()
        """One fold at a time: a push and an evaluation's `slot_tensors` share the folder's LoRA slot."""
        threading.Thread(target=self._broadcast_loop, daemon=True, name="weight-sync").start()

    # -- membership ----------------------------------------------------------------------------
    def rendezvous(self) -> Rendezvous:
        return Rendezvous.on_this_node()

    def join(self, rendezvous: Rendezvous, name: str, receivers: list) -> None:
        """Rank 0 of a new group generation `name` whose ranks 1..n are `receivers` (rollout workers,
        which join concurrently). Replaces the previous generation."""
        with self._lock:
            if self.group is not None:
                self.group.destroy()
            self.group = CollectiveGroup(name, rendezvous, 0, len(receivers) + 1, self.device, self.spec.timeout_s)
            self.receivers = receivers
            self.lost = {}
            if self.latest is not None and self.latest[0] not in self.reports:
                self._pending.put((self.latest[1], 0.0))  # lost with a dead receiver: to the new generation

    def current(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest (version, tensors) pushed, as broadcast (merged in merged mode): for late joiners."""
        if self.latest is None:
            return None
        version, packed = self.latest
        return version, packed.tensors()

    # -- pushes --------------------------------------------------------------------------------
    def push(self, wire: WirePush) -> int:
        """Take `wire` (rayflow.sync.buckets.to_wire of the rollout adapter) as its version and queue its
        broadcast; returns the version at once."""
        version = wire.manifest.version
        if self.error is not None:
            raise self.error
        start = time.perf_counter()
        try:
            if self.latest is not None and version <= self.latest[0]:
                raise ValueError(f"push of version {version}: not newer than version {self.latest[0]}")
            # lora: the buckets are views of the object-store buffers, which this actor now keeps alive
            # (its own copy, made by Ray's one memcpy). merged: fold, into new buckets.
            packed = from_wire(wire, self.spec.bucket_bytes, self.device, self.spec.verify_checksum)
            if self.fold is not None:
                with self._fold_lock:
                    merged = self.fold(packed.tensors())
                manifest = make_manifest(version, merged, with_checksums=self.spec.verify_checksum)
                packed = pack_all(manifest, merged, self.spec.bucket_bytes, self.device)
        except BaseException as e:
            # The pusher does not wait for this call: stop the sync, so that watch() and wait() report it.
            raise self._fail(version, e) from e
        self.latest = (version, packed)
        self._pending.put((packed, time.perf_counter() - start))
        return version

    def slot_tensors(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a rollout rank's synced slot holds for `adapter` (full LoRA tensors): the adapter itself, or
        in merged mode the folded linears (on the CPU). For sampling under an adapter never pushed (evaluation
        of the trainer.ema_decay EMA)."""
        if self.fold is None:
            return adapter
        with self._fold_lock:
            return {name: t.cpu() for name, t in self.fold(adapter).items()}

    def wait(self, version: int, timeout_s: float | None = None) -> SyncReport:
        """Block until `version` is staged on every receiver (or raise the sync's failure)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._done:
            while version not in self.reports and version not in self.lost and self.error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"weight sync of version {version} not done after {timeout_s}s")
                self._done.wait(remaining)
        if version in self.reports:
            return self.reports[version]
        if version in self.lost:
            raise self.lost[version]
        raise self.error

    def lost_versions(self) -> list[int]:
        """Versions whose broadcast met a dead receiver since the last group generation. Raises the sync's
        failure if it stopped: the asynchronous driver, which does not wait for each version, calls this
        once per step, so a failed broadcast stops the run within a step instead of leaving rollouts on
        old weights forever."""
        with self._done:
            if self.error is not None:
                raise self.error
            return sorted(self.lost)

    def watch(self) -> None:
        """Return only by raising: the sync's failure (WeightSyncError), once it stopped. The driver keeps one call
        in flight and looks at it on every pass of its loop."""
        with self._done:
            while self.error is None:
                self._done.wait()
            raise self.error

    def _broadcast_loop(self) -> None:
        while True:
            packed, copy_s = self._pending.get()
            try:
                report = self._broadcast(packed, copy_s)
            except ReceiversLost as e:  # the driver forms a new generation; the newest version goes to it
                with self._done:
                    self.lost[packed.manifest.version] = e
                    self._done.notify_all()
                continue
            except BaseException as e:  # surfaced by watch(), wait() and the next push
                self._fail(packed.manifest.version, e)
                return
            with self._done:
                self.reports[report.version] = report
                self._done.notify_all()

    def _fail(self, version: int, cause: BaseException) -> WeightSyncError:
        """Stop the sync: every waiter, watcher and later push raises the returned error."""
        with self._done:
            if self.error is None:
                self.error = WeightSyncError(f"weight sync stopped at version {version}: {one_line(cause)}")
                self.error.__cause__ = cause
            self._done.notify_all()
            return self.error

    def _broadcast(self, packed: Packed, copy_s: float) -> SyncReport:
        start = time.perf_counter()
        manifest = packed.manifest
        with self._lock:
            if manifest.version in self.reports:  # queued twice around a new generation: delivered already
                return self.reports[manifest.version]
            if self.lost:  # this generation lost a receiver: wait for the next one
                raise ReceiversLost(f"version {manifest.version} waits for a new weight-sync group: {next(iter(self.lost.values()))}")
            # Receivers join the broadcast from their "weights" thread, then verify and stage.
            received = [r.receive_weights.remote(manifest, self.spec.bucket_bytes) for r in self.receivers]
            try:
                send(self.group, packed)
                # A stopped receiver neither answers nor dies: without a deadline this would wait forever,
                # holding the lock a new group generation needs.
                ray.get(received, timeout=self.spec.timeout_s)
            except Exception as e:
                # After a timeout every receiver has had its time; else the survivors get theirs now.
                timed_out = isinstance(e, ray.exceptions.GetTimeoutError)
                lost = self._lost_receivers(received, 0.0 if timed_out else self.spec.timeout_s + RECEIVER_GRACE_S)
                if not lost:
                    raise
                raise ReceiversLost(
                    f"receivers {lost} of the weight-sync group (ranks 1..{len(self.receivers)}) died or stalled "
                    f"during the broadcast of version {manifest.version}"
                ) from e
        broadcast_s = time.perf_counter() - start
        return SyncReport(manifest.version, manifest.nbytes, copy_s + broadcast_s, copy_s, broadcast_s)

    def _lost_receivers(self, received: list[ray.ObjectRef], wait_s: float) -> list[int]:
        """Group ranks whose receive call failed because their actor died, or that did not answer within
        `wait_s` more seconds (stalled)."""
        ready, _ = ray.wait(received, num_returns=len(received), timeout=wait_s)
        lost = []
        for rank, ref in enumerate(received, start=1):
            try:
                if ref in ready:
                    ray.get(ref)
                else:
                    lost.append(rank)
            except ray.exceptions.RayActorError:
                lost.append(rank)
            except Exception:
                pass
        return lost

    def close(self) -> None:
        with self._lock:
            if self.group is not None:
                self.group.destroy()
                self.group = None
