"""The two ends of one weight broadcast over a CollectiveGroup: send (source, rank 0) and receive.

Both derive the same bucket plan from the push's Manifest, so only bucket bytes cross the group.
The receiver then checks the result against the source's checksums when the manifest carries
them; names and shapes are checked against what it binds when it stages the version.
"""

from __future__ import annotations

import torch

from rayflow.sync.buckets import Manifest, Packed, checksum, plan_buckets, unpack

SOURCE_RANK = 0


def send(group, packed: Packed) -> None:
    """Broadcast a packed push from this rank, bucket by bucket."""
    for buffer in packed.buffers:
        group.broadcast(buffer, src=SOURCE_RANK)


def receive(group, manifest: Manifest, bucket_bytes: int, buffers: "ReceiveBuffers", slot: int) -> dict[str, torch.Tensor]:
    """Join the source's broadcast of `manifest`; the received tensors, views of `buffers`' `slot`, on group.device."""
    out: dict[str, torch.Tensor] = {}
    for i, bucket in enumerate(plan_buckets(manifest, bucket_bytes)):
        numel = sum(manifest.specs[k].numel for k in bucket)
        buffer = buffers.get(slot, i, numel, manifest.specs[bucket[0]].dtype, group.device)
        group.broadcast(buffer, src=SOURCE_RANK)
        out.update(unpack(manifest, bucket, buffer))
    return out


class ReceiveBuffers:
    """A ring of `slots` buffers per bucket that versions are received into, so after the first pushes receiving
    allocates nothing (fresh pages for every push cost more than the copy itself on a CPU) and at most `slots`
    versions' memory exists.

    `claim` gives each reception a slot that no version still in use (staged, or being applied) lives in, and `hold`
    records the slot a staged version lives in. Versions need not come one after another (after lost receivers a new
    group generation gets only the newest), so the slot is not `version % slots`: that overwrote a staged version with
    a later one that shared its remainder. A version is held where it was staged, not where it was last received: a
    staged version sent again to a new group generation, whose broadcast then failed, stays in its first slot (recorded
    at the claim, that slot was given to the next version while the staged one still lived in it)."""

    def __init__(self, slots: int = 3):
        self.slots = slots
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._slot_of: dict[int, int] = {}
        """version -> the slot its staged tensors live in (versions in use at the last claim, and those held since)."""

    def claim(self, in_use: set[int]) -> int:
        """A slot that none of the versions `in_use` lives in (fewer than `slots` of them)."""
        self._slot_of = {v: s for v, s in self._slot_of.items() if v in in_use}
        taken = set(self._slot_of.values())
        return next(s for s in range(self.slots) if s not in taken)

    def hold(self, version: int, slot: int) -> None:
        """`version` was staged from `slot`'s buffers: no reception gets that slot while the version is in use."""
        self._slot_of[version] = slot

    def get(self, slot: int, bucket: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (slot, bucket, numel, dtype, str(device))
        if key not in self._buffers:
            self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return self._buffers[key]


class SyncMismatch(ValueError):
    """The bytes a receiver got differ from the source's."""


def verify_checksums(manifest: Manifest, received: dict[str, torch.Tensor], where: str) -> None:
    """When the push carries checksums (sync.verify_checksum), every received tensor must match its source's."""
    if manifest.checksums is None:
        return
    bad = [s.name for s, c in zip(manifest.specs, manifest.checksums) if checksum(received[s.name]) != c]
    if bad:
        raise SyncMismatch(f"{where}: checksum mismatch after the broadcast of version {manifest.version} for {bad[:5]} ({len(bad)} tensors)")
