"""The two ends of one weight broadcast over a CollectiveGroup: send (source, rank 0) and receive.

Both derive the same bucket plan from the push's Manifest, so only bucket bytes cross the group.
The receiver then checks the result against the source's checksums when the manifest carries
them; names and shapes are checked against what it binds when it stages the version.
"""

from __future__ import annotations

import torch

from rayflow.sync.buckets import Manifest, Packed, bucket_buffer, checksum, plan_buckets, unpack

SOURCE_RANK = 0


def send(group, packed: Packed) -> None:
    """Broadcast a packed push from this rank, bucket by bucket."""
    for buffer in packed.buffers:
        group.broadcast(buffer, src=SOURCE_RANK)


def receive(group, manifest: Manifest, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """Join the source's broadcast of `manifest`; the received tensors (own memory, on group.device)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in plan_buckets(manifest, bucket_bytes):
        buffer = bucket_buffer(manifest, bucket, group.device)
        group.broadcast(buffer, src=SOURCE_RANK)
        out.update(unpack(manifest, bucket, buffer))
    return out


class SyncMismatch(ValueError):
    """The bytes a receiver got differ from the source's."""


def verify_checksums(manifest: Manifest, received: dict[str, torch.Tensor], where: str) -> None:
    """When the push carries checksums (sync.verify_checksum), every received tensor must match its source's."""
    if manifest.checksums is None:
        return
    bad = [s.name for s, c in zip(manifest.specs, manifest.checksums) if checksum(received[s.name]) != c]
    if bad:
        raise SyncMismatch(f"{where}: checksum mismatch after the broadcast of version {manifest.version} for {bad[:5]} ({len(bad)} tensors)")
