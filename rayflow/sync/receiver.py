"""The rollout side of weight sync: one rollout rank's WeightReceiver (the rank, rayflow.rollout.rank.RolloutRank,
keeps the model and the sampling loop and calls into it).

Ordering rules and version protocol (DESIGN §8, §9; the source's side: rayflow.sync.source):
- Versions arrive growing, on every rank of a replica in the same order (one broadcast source), from
  another thread than the one sampling: `StagedWeights` is the lock-protected hand-over between them.
- `receive` joins the source's broadcast of one version, verifies checksums (when the push carries
  them), then checks names and shapes against the synced tensors and stages it. A version not newer
  than the applied one is refused when staged directly, and skipped when received again (a new group
  generation re-sends the newest version to every rank).
- Staging keeps the two newest versions (KEEP_STAGED): the ranks of a replica stage in lockstep, so the
  version they agree on is never older than that.
- At each step boundary every rank announces its newest staged version in the CFG all_gather header
  (`newest`); the replica applies the minimum over its ranks (`agree`), i.e. only a version ALL ranks
  hold, so every rank samples under the same weights. Applying v drops every staged version older than v.
- `rewind(v)`: the learners restarted from a checkpoint of v; staged versions after v are dropped, and a
  rank that applied a later one holds no valid version (VOID_VERSION) until v is received again.
- `abandon_waits()`: the learners died, and the versions the requests in flight wait for may never come (voided by
  the rewind, or their push lost with the learners or the weight-sync actor): from then until the `rewind`, a request
  that would wait for a version fails at once with VersionAbandoned (the driver drops those requests), on every rank
  of the replica alike after the request's first collective (`check_held`), so their collectives keep pairing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Callable

import torch

from rayflow.named_tensors import check_layout, layout
from rayflow.sync.broadcast import ReceiveBuffers, receive, verify_checksums
from rayflow.sync.buckets import Manifest

KEEP_STAGED = 2
"""Versions a rank keeps staged (see StagedWeights.put); ReceiveBuffers has one slot more, for the version being
applied (a reception waits while all three are in use: an apply is a copy, shorter than a broadcast)."""

VOID_VERSION = -1
"""A rank's version after a rewind past the weights it holds: older than any version the learners push."""


class VersionAbandoned(RuntimeError):
    """A request waited for a version the learners' restart abandoned (WeightReceiver.abandon_waits)."""


def check_adapter(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Names and shapes of `got` must equal those of `expected`; the error names the modules that differ.

    A sync that binds fewer modules than it sends (or the other way round) is an error, never a
    silently partial update."""
    check_layout(layout(expected), layout(got), "weights do not match the rollout rank's")


@torch.no_grad()
def load_weights(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` into the same-named `params` (adapter parameters by canonical name, or the
    merged base weights), after checking names and shapes."""
    check_adapter(params, tensors)
    for name, p in params.items():
        p.copy_(tensors[name])


class StagedWeights:
    """Versions received but not applied yet: {version: canonical name -> tensor}; thread-safe."""

    def __init__(self) -> None:
        self._staging = threading.Condition()
        """Guards the versions; notified when one is staged, dropped or applied."""
        self._by_version: dict[int, dict[str, torch.Tensor]] = {}
        self._applying: int | None = None
        """The version taken and being loaded into the synced tensors: its tensors are still read."""
        self._abandoned = False
        """Set by `abandon(True)`: every wait not met at once returns unmet."""

    def in_use_below(self, limit: int) -> set[int]:
        """The versions whose tensors are still read (staged, or being applied), once there are fewer than `limit`."""
        def in_use() -> set[int]:
            return set(self._by_version) | ({self._applying} if self._applying is not None else set())

        with self._staging:
            self._staging.wait_for(lambda: len(in_use()) < limit)
            return in_use()

    def put(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Stage `version`, keeping only it and the newest one before it (an idle replica does not pile up every
        version it receives)."""
        with self._staging:
            self._by_version[version] = tensors
            for old in sorted(self._by_version)[:-KEEP_STAGED]:
                del self._by_version[old]
            self._staging.notify_all()

    def newest(self, default: int) -> int:
        """The newest staged version, or `default` (the applied one) when nothing is staged."""
        with self._staging:
            return max(self._by_version, default=default)

    def wait_newest(self, at_least: int, default: int) -> None:
        """Block until newest(default) >= at_least (another thread stages it), or the wait is abandoned."""
        with self._staging:
            self._staging.wait_for(lambda: max(self._by_version, default=default) >= at_least or self._abandoned)

    def abandon(self, abandoned: bool) -> None:
        """`abandoned`: release every wait, and return the later ones at once, unmet; False: they wait again."""
        with self._staging:
            self._abandoned = abandoned
            self._staging.notify_all()

    def drop_after(self, version: int) -> None:
        """Forget every staged version newer than `version` (voided by a rewind of the learners)."""
        with self._staging:
            self._by_version = {v: t for v, t in self._by_version.items() if v <= version}
            self._staging.notify_all()

    def take(self, version: int) -> dict[str, torch.Tensor]:
        """Remove and return `version`, dropping every older one; it is being applied until `applied()`."""
        with self._staging:
            if version not in self._by_version:
                raise KeyError(
                    f"version {version} was agreed by the replica but is not staged on this rank "
                    f"(staged: {sorted(self._by_version)}); versions must reach every rank in the same order"
                )
            tensors = self._by_version.pop(version)
            self._by_version = {v: t for v, t in self._by_version.items() if v > version}
            self._applying = version
            self._staging.notify_all()
            return tensors

    def applied(self) -> None:
        """The version `take` returned is in the synced tensors: its tensors are no longer read."""
        with self._staging:
            self._applying = None
            self._staging.notify_all()


class WeightReceiver:
    """One rollout rank's versions: the applied one, the staged ones, and the buffers broadcasts land in."""

    def __init__(self, synced: Callable[[], dict[str, torch.Tensor]], where: str):
        """`synced()`: the tensors weight sync replaces, by canonical name (looked up at each use: a shared, FSDP2-
        sharded model swaps its parameters); `where` names the rank in errors."""
        self.synced, self.where = synced, where
        self.version = 0
        """The applied version: the one the synced tensors hold."""
        self.staged = StagedWeights()
        self.buffers = ReceiveBuffers(slots=KEEP_STAGED + 1)

    def receive(self, group, manifest: Manifest, bucket_bytes: int) -> None:
        """Join the source's broadcast of one version over `group`, verify it, and stage it (unless applied).

        The whole broadcast is received before anything is checked: a rank that left early would leave the
        source and every other rank waiting in the collective."""
        slot = self.buffers.claim(self.staged.in_use_below(self.buffers.slots))
        tensors = receive(group, manifest, bucket_bytes, self.buffers, slot)
        verify_checksums(manifest, tensors, where=self.where)
        if manifest.version <= self.version:
            return  # sent again to a new group generation (after a receiver died); applied here already
        self.stage(manifest.version, tensors)
        self.buffers.hold(manifest.version, slot)

    def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `tensors` to apply once every rank of the replica has them. Checked now (names and shapes), so a bad
        sync fails at once, not mid-request."""
        if version <= self.version:
            raise ValueError(f"{self.where}: staged version {version} is not newer than the applied version {self.version}")
        check_adapter(self.synced(), tensors)
        self.staged.put(version, tensors)

    def rewind(self, version: int) -> None:
        """Versions after `version` are void: staged ones are dropped; if the applied one is later, VOID_VERSION until
        `version` is received again, which is then staged and agreed on like any newer version."""
        self.staged.drop_after(version)
        if self.version > version:
            self.version = VOID_VERSION
        self.staged.abandon(False)  # the requests from now on are the new timeline's: they wait for its versions

    def abandon_waits(self) -> None:
        """The learners died: a request waiting for a version, or starting to wait for one, fails with VersionAbandoned
        until `rewind`. The version may never come: a rewind voids it (the new timeline reaches it only after training
        on requests that would queue behind this one), and its push may have died with the learners or the weight-sync
        actor. Waiting, the request held its replica, and the new timeline's requests behind it, until the rollout
        watchdog replaced the replica (rollout.stall_timeout_s). The driver drops every request in flight anyway."""
        self.staged.abandon(True)

    def newest(self) -> int:
        """What this rank announces in the step header: its newest staged version, or the applied one."""
        return max(self.version, self.staged.newest(self.version))

    def wait_for(self, version: int) -> None:
        """Block until this rank holds `version` or a newer one (applied or staged by the receiving thread), so the
        replica agrees on it at the request's start (RolloutRequest.min_version). A version that never comes
        leaves the request in flight without progress: the rollout watchdog's to report (and replace the replica),
        unless the learners died (`abandon_waits`): then it returns at once, unmet. Nothing is raised or returned
        here: a peer may hold the version already and be in the request's first collective; the ranks decide together
        on the gathered headers (`check_held`)."""
        if self.version < version:
            self.staged.wait_newest(version, default=self.version)

    def check_held(self, newest_per_rank: list[int], version: int) -> None:
        """Raise VersionAbandoned, on every rank of the replica alike (all decide on the same gathered headers), when
        one of them does not hold `version`: its wait was abandoned (a wait that ends otherwise holds it)."""
        if min(newest_per_rank) < version:
            raise VersionAbandoned(f"{self.where}: a request waited for version {version} (the replica's ranks hold "
                                   f"{newest_per_rank}), abandoned as the learners restarted; the driver dropped it")

    def agree(self, newest_per_rank: list[int], apply: bool) -> int:
        """The replica's version: the minimum of its ranks' `newest` (a version every rank holds); loaded into the
        synced tensors if `apply` and newer than the applied one. Returns the applied version."""
        agreed = min(newest_per_rank)
        if apply and agreed > self.version:
            tensors = self.staged.take(agreed)
            try:
                load_weights(self.synced(), tensors)
            finally:
                self.staged.applied()
            self.version = agreed
        return self.version

    def adopt(self, version: int) -> None:
        """The synced tensors hold `version` already: a model shared with its trainer (colocated placement)."""
        self.version = version

    @contextlib.contextmanager
    def sampling_under(self, weights: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """`weights` in the synced tensors for the block (None: the applied version's), the applied version's
        restored after it."""
        if weights is None:
            yield
            return
        applied = {name: p.detach().to("cpu", copy=True) for name, p in self.synced().items()}  # off the GPU
        load_weights(self.synced(), weights)
        try:
            yield
        finally:
            load_weights(self.synced(), applied)
