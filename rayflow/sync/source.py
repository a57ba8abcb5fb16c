"""WeightSource: the broadcast source of the weight-sync group, as a plain class (the Ray actor,
rayflow.sync.actor.WeightSyncActor, owns its device and group and forwards calls to it).

Ordering rules and version protocol:
1. Version v = optimizer steps applied. Learner rank 0 calls `push(wire)` after step v with the full
   tensors of `backend.rollout_adapter_name` ("old" for DiffusionNFT, else "default"), laid out by
   rayflow.sync.buckets.to_wire, and goes back to training without waiting; the call returns as soon as
   the source holds its own copy. This actor is threaded, so Ray runs its calls side by side and out of order:
   the learner sends a push only once the one before it returned (rayflow.learner.worker.LearnerWorker.push_weights).
2. Pushes are broadcast one at a time, in push order, by one thread. A push is broadcast in buckets
   (sync.bucket_mb) to every receiver (ranks 1..n of the group: every rank of every rollout replica);
   each verifies names, shapes (and checksums) and stages the version (rayflow.sync.receiver); a
   replica applies a staged version at its next denoising-step boundary (or between requests) once ALL
   its ranks hold it, and tags later steps with it.
3. Versions only grow: a push older than or equal to the last one is refused. Any failure (a refused
   push, a receiver that does not bind what was sent) stops the sync: `wait`, `watch`,
   `lost_versions` and every later push raise it as WeightSyncError, naming the version and the cause.
   The learner does not wait for its push; the driver keeps one `watch` call in flight, so in
   asynchronous mode (which does not wait for each version) a failed push or broadcast reaches it
   within a pass of its loop.
4. `wait(v)` returns v's SyncReport once v is staged on every receiver.
5. A replica that joins later (restarted or added) is brought into a new group generation (`join`)
   with everyone else, and receives the current version before it serves a request.
6. A receiver that dies, or does not answer within the collective timeout (stalled), does not stop
   the sync: the broadcast that met it, and every one queued until the next group generation, raises
   ReceiversLost in `wait`. The driver forms a new generation without the lost ranks, and the newest
   version is broadcast again to it (ranks that already hold it skip re-staging).

The collaborators are injected, so the protocol runs without Ray: the collective group (rank 0's
`broadcast`, `destroy`), and the receivers (`receive` starts their side of one broadcast and returns
its calls in flight, which tell a receiver's error from a lost receiver: rayflow.sync.actor adapts
Ray actor handles). In "merged" mode `fold` turns each pushed adapter into the weights of the adapted
linears (W + ΔW, peft's merge), which are broadcast instead.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from rayflow.distributed.process_group import answer_grace_s
from rayflow.errors import one_line
from rayflow.sync.broadcast import send
from rayflow.sync.buckets import Manifest, Packed, WirePush, from_wire, make_manifest, pack_all



class WeightSyncError(RuntimeError):
    """The weight sync stopped: a push was refused, or a broadcast failed other than by losing receivers."""


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
        return 2 * self.timeout_s + self.grace_s

    @property
    def grace_s(self) -> float:
        """After a failed broadcast, receivers get the timeout plus this to fail their own side (they are in the same
        collective), and one still silent then is stalled; a waiter gets this past the actor's deadline, so that the
        actor's verdict arrives first (rayflow.distributed.process_group.answer_grace_s)."""
        return answer_grace_s(self.timeout_s)

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


@dataclass
class SyncReport:
    version: int
    bytes: int
    seconds: float
    """Wall time of this version's sync in the source: copy_s + broadcast_s."""
    copy_s: float
    """Laying the push out as broadcast buckets (merged mode: folding, and a copy into new buckets)."""
    broadcast_s: float
    """Notifying the receivers, the bucket broadcasts, and their verification and staging."""


class SourceGroup(Protocol):
    """The weight-sync collective group, seen from its rank 0 (rayflow.distributed.process_group.CollectiveGroup)."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...

    def destroy(self) -> None: ...


class ReceiveCalls(Protocol):
    """The receivers' side of one broadcast, in flight: one call per group rank 1..n."""

    def wait(self, timeout_s: float) -> None:
        """Until every receiver verified and staged the version; raises the first receiver's own error, or
        TimeoutError when one has not answered within `timeout_s`."""

    def lost(self, wait_s: float) -> list[int]:
        """Group ranks whose receiver died, or has not answered within `wait_s` more seconds (stalled)."""


class Receivers(Protocol):
    """The receivers of one group generation (ranks 1..n)."""

    def __len__(self) -> int: ...

    def receive(self, manifest: Manifest, bucket_bytes: int) -> ReceiveCalls:
        """Start every receiver's side of the broadcast of `manifest`: they join it, verify and stage."""


class WeightSource:
    """The version protocol of the module docstring over an injected group and receivers."""

    def __init__(self, spec: SyncSpec, device: torch.device,
                 fold: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None):
        """`fold`: merged mode's adapter → folded linears (rayflow.sync.fold.AdapterFolder); None broadcasts pushes as
        they are (LoRA adapters, or with learner.train_mode=full every transformer weight)."""
        self.spec, self.device, self.fold = spec, device, fold
        self.group: SourceGroup | None = None
        self.receivers: Receivers | None = None
        self.latest: tuple[int, Packed] | None = None
        self.reports: dict[int, SyncReport] = {}
        self.lost: dict[int, ReceiversLost] = {}
        """Versions whose broadcast met a dead receiver (until a later generation delivers them)."""
        self.error: WeightSyncError | None = None
        """Why the sync stopped (the version and the cause), once it has."""
        self._pending: queue.Queue = queue.Queue()
        self._done = threading.Condition()
        self._lock = threading.Lock()
        """Held by a broadcast, and by `join`: a new generation waits for the broadcast in flight."""
        self._joined = threading.Condition(self._lock)
        self._held = False
        """Set by `settle`, cleared by `join`: the next broadcast waits for the new generation."""
        self._fold_lock = threading.Lock()
        """One fold at a time: a push and an evaluation's `slot_tensors` share the folder's LoRA slot."""
        self._thread = threading.Thread(target=self._broadcast_loop, daemon=True, name="weight-sync")
        self._thread.start()

    # -- membership ----------------------------------------------------------------------------
    def join(self, open_group: Callable[[], SourceGroup], receivers: Receivers) -> None:
        """A new group generation: `open_group()` (called once the previous generation's group is destroyed, after
        the broadcast in flight) returns the group whose ranks 1..n are `receivers`. A version lost with the previous
        generation's receivers is broadcast again to this one."""
        with self._lock:
            if self.group is not None:
                self.group.destroy()
                self.group = None
            self.group = open_group()
            self.receivers = receivers
            self.lost = {}
            self._held = False
            self._joined.notify_all()
            if self.latest is not None and self.latest[0] not in self.reports:
                self._pending.put((self.latest[1], 0.0))

    def settle(self) -> None:
        """Return once no broadcast is in flight (spec.broadcast_deadline_s at most): receivers asked to join a new
        generation then find its store listening, instead of timing out while the source finishes an old broadcast.
        The next broadcast then waits for `join` (spec.broadcast_deadline_s at most): a push landing between the two
        went to the old group, whose ranks were leaving it for the new one, and the join waited behind it until the
        ranks' own join timed out, which failed the sync."""
        with self._lock:
            self._held = True

    def current(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest (version, tensors) pushed, as broadcast (merged in merged mode), on the CPU: for late joiners,
        through the driver (WeightSync.attach). A tensor crosses Ray on its device (rayflow.distributed.tensor_pickle):
        the buckets' CUDA views failed in a driver without CUDA, and a driver on a GPU node put them on its first GPU."""
        if self.latest is None:
            return None
        version, packed = self.latest
        return version, {name: t.cpu() for name, t in packed.tensors().items()}

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
            # lora: the buckets are views of the wire's buffers, which this source now keeps alive. merged: fold,
            # into new buckets.
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
        """Block until `version` is staged on every receiver; raises ReceiversLost if its broadcast met a lost
        receiver, or the sync's failure."""
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
        """Return only by raising: the sync's failure (WeightSyncError), once it stopped."""
        with self._done:
            while self.error is None:
                self._done.wait()
            raise self.error

    def close(self) -> None:
        """Destroy the group and end the broadcast thread (after the broadcasts queued)."""
        self._pending.put(None)
        with self._lock:
            if self.group is not None:
                self.group.destroy()
                self.group = None

    # -- the broadcast thread ------------------------------------------------------------------
    def _broadcast_loop(self) -> None:
        while (item := self._pending.get()) is not None:
            packed, copy_s = item
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
            self._joined.wait_for(lambda: not self._held, timeout=self.spec.broadcast_deadline_s)
            if manifest.version in self.reports:  # queued twice around a new generation: delivered already
                return self.reports[manifest.version]
            if self.lost:  # this generation lost a receiver: wait for the next one
                raise ReceiversLost(f"version {manifest.version} waits for a new weight-sync group: {next(iter(self.lost.values()))}")
            if self.group is None:
                raise RuntimeError(f"version {manifest.version}: no weight-sync group joined yet")
            calls = self.receivers.receive(manifest, self.spec.bucket_bytes)
            try:
                send(self.group, packed)
                # A stopped receiver neither answers nor dies: without a deadline this would wait forever,
                # holding the lock a new group generation needs.
                calls.wait(self.spec.timeout_s)
            except Exception as e:
                # Survivors may wait for buckets this source will not send any more: closing the group fails their
                # side now instead of after their collective timeout (300 s by default), and a new generation opens
                # a new group anyway.
                self.group.destroy()
                self.group = None
                # After a timeout every receiver has had its time; else the survivors get theirs now.
                timed_out = isinstance(e, TimeoutError)
                lost = calls.lost(0.0 if timed_out else self.spec.timeout_s + self.spec.grace_s)
                if not lost:
                    raise
                raise ReceiversLost(
                    f"receivers {lost} of the weight-sync group (ranks 1..{len(self.receivers)}) died or stalled "
                    f"during the broadcast of version {manifest.version}"
                ) from e
        broadcast_s = time.perf_counter() - start
        return SyncReport(manifest.version, manifest.nbytes, copy_s + broadcast_s, copy_s, broadcast_s)
