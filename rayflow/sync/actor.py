"""WeightSyncActor: the Ray shell around the weight-sync source (rayflow.sync.source.WeightSource, whose
docstring states the ordering rules and the version protocol). It owns the device, the collective group
of each generation and the folding model of merged mode, and forwards every call to the source.

Receivers are rollout rank actors (rayflow.rollout.worker.RolloutRankHost's `receive_weights`):
`RayReceivers` starts their receive calls and tells a receiver's own error from a dead or stalled one.
"""

from __future__ import annotations

import ray
import torch

from rayflow.distributed.placement import uses_cuda
from rayflow.distributed.process_group import CollectiveGroup, GroupHost, Rendezvous
from rayflow.distributed.tensor_pickle import install as install_tensor_pickling
from rayflow.models.synced import SyncedModelSpec
from rayflow.sync.buckets import Manifest, WirePush
from rayflow.sync.fold import AdapterFolder
from rayflow.sync.source import SyncReport, SyncSpec, WeightSource


class RayReceiveCalls:
    """One broadcast's `receive_weights` calls, one per group rank 1..n (rayflow.sync.source.ReceiveCalls)."""

    def __init__(self, refs: list[ray.ObjectRef]):
        self.refs = refs

    def wait(self, timeout_s: float) -> None:
        try:
            ray.get(self.refs, timeout=timeout_s)  # GetTimeoutError is a TimeoutError
        except ray.exceptions.RayTaskError as e:
            # The receiver's own exception (e.g. the ValueError naming modules it does not bind), not Ray's wrapper.
            if e.cause is None:
                raise
            raise e.cause from e

    def lost(self, wait_s: float) -> list[int]:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=wait_s)
        lost = []
        for rank, ref in enumerate(self.refs, start=1):
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


class RayReceivers:
    """Rollout rank actors as the receivers of one group generation (rayflow.sync.source.Receivers)."""

    def __init__(self, handles: list[ray.actor.ActorHandle]):
        self.handles = handles

    def __len__(self) -> int:
        return len(self.handles)

    def receive(self, manifest: Manifest, bucket_bytes: int) -> RayReceiveCalls:
        # Receivers join the broadcast from their "weights" thread, then verify and stage.
        return RayReceiveCalls([h.receive_weights.remote(manifest, bucket_bytes) for h in self.handles])


@ray.remote(max_concurrency=8)
class WeightSyncActor(GroupHost):
    def __init__(self, spec: SyncSpec, synced: SyncedModelSpec):
        """`synced` says what the receivers hold (model and LoRA shape); merged mode folds with it."""
        install_tensor_pickling()
        self.spec = spec
        # Full fine-tuning pushes the plain weights themselves: nothing to fold.
        fold = AdapterFolder(synced) if spec.mode == "merged" and synced.train_mode == "lora" else None
        device = torch.device("cuda" if uses_cuda() else "cpu")
        self.source = WeightSource(spec, device, fold)

    def join(self, rendezvous: Rendezvous, name: str, receivers: list[ray.actor.ActorHandle]) -> None:
        """Rank 0 of a new group generation `name` whose ranks 1..n are `receivers` (rollout rank actors, which join
        concurrently). Replaces the previous generation."""
        size = len(receivers) + 1
        self.source.join(lambda: CollectiveGroup(name, rendezvous, 0, size, self.source.device, self.spec.timeout_s),
                         RayReceivers(receivers))

    def settle(self) -> None:
        self.source.settle()

    def current(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        return self.source.current()

    def push(self, wire: WirePush) -> int:
        return self.source.push(wire)

    def slot_tensors(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.source.slot_tensors(adapter)

    def wait(self, version: int, timeout_s: float | None = None) -> SyncReport:
        return self.source.wait(version, timeout_s)

    def lost_versions(self) -> list[int]:
        return self.source.lost_versions()

    def watch(self) -> None:
        """Return only by raising: the driver keeps one call in flight and looks at it on every pass of its loop."""
        self.source.watch()

    def close(self) -> None:
        self.source.close()
