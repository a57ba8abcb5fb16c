"""Packing named tensors into flat buckets for a broadcast, and back. Pure tensor code.

A `Manifest` (names, shapes, dtypes, in a fixed order) travels with every push; sender and
receivers derive the same bucket plan from it, so only raw bucket bytes cross the group.
"""

from __future__ import annotations

import sys
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Manifest:
    """What one push carries: its version, the tensors in broadcast order, optional checksums."""

    version: int
    specs: tuple[TensorSpec, ...]
    checksums: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {s.name: s.shape for s in self.specs}


def checksum(tensor: torch.Tensor) -> int:
    """CRC32 of the tensor's bytes (bit-exact comparison across processes). Flattened first: a 0-dim tensor (a scalar
    parameter) cannot be viewed as bytes of another element size."""
    data = tensor.detach().reshape(-1).contiguous().cpu()
    return zlib.crc32(data.view(torch.uint8).numpy().tobytes()) if data.numel() else 0


def make_manifest(version: int, tensors: dict[str, torch.Tensor], with_checksums: bool = False) -> Manifest:
    names = sorted(tensors)
    specs = tuple(TensorSpec(n, tuple(tensors[n].shape), tensors[n].dtype) for n in names)
    sums = tuple(checksum(tensors[n]) for n in names) if with_checksums else None
    return Manifest(version, specs, sums)


def plan_buckets(manifest: Manifest, bucket_bytes: int) -> list[list[int]]:
    """Spec indices grouped into buckets of one dtype and at most `bucket_bytes` (a larger tensor gets
    a bucket of its own), in manifest order."""
    buckets: list[list[int]] = []
    size = 0
    for i, spec in enumerate(manifest.specs):
        current = buckets[-1] if buckets else None
        fits = current is not None and size + spec.nbytes <= bucket_bytes
        same_dtype = current is not None and manifest.specs[current[0]].dtype == spec.dtype
        if fits and same_dtype:
            current.append(i)
            size += spec.nbytes
        else:
            buckets.append([i])
            size = spec.nbytes
    return buckets


def pack(manifest: Manifest, bucket: list[int], tensors: dict[str, torch.Tensor], device: torch.device | str
         ) -> torch.Tensor:
    """One bucket's tensors copied into a new flat buffer on `device`."""
    return torch.cat([tensors[manifest.specs[i].name].detach().reshape(-1).to(device) for i in bucket])


@dataclass(frozen=True)
class Packed:
    """A push laid out for broadcast: the manifest, its bucket plan and one flat buffer per bucket."""

    manifest: Manifest
    buckets: list[list[int]]
    buffers: list[torch.Tensor]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors, as views of the buffers."""
        out: dict[str, torch.Tensor] = {}
        for bucket, buffer in zip(self.buckets, self.buffers):
            out.update(unpack(self.manifest, bucket, buffer))
        return out


def pack_all(manifest: Manifest, tensors: dict[str, torch.Tensor], bucket_bytes: int, device: torch.device | str
             ) -> Packed:
    """Copy `tensors` once, straight into their bucket buffers."""
    buckets = plan_buckets(manifest, bucket_bytes)
    return Packed(manifest, buckets, [pack(manifest, b, tensors, device) for b in buckets])


def unpack(manifest: Manifest, bucket: list[int], buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of the flat buffer as the bucket's named tensors (clone if the buffer is reused)."""
    out, offset = {}, 0
    for i in bucket:
        spec = manifest.specs[i]
        out[spec.name] = buffer[offset : offset + spec.numel].view(spec.shape)
        offset += spec.numel
    return out


def _run_slices(manifest: Manifest) -> list[tuple[int, int, int]]:
    """Per spec: (run, start, end) element offsets within its dtype run (plan_buckets without a size bound)."""
    out = []
    for run, bucket in enumerate(plan_buckets(manifest, sys.maxsize)):
        offset = 0
        for i in bucket:
            out.append((run, offset, offset + manifest.specs[i].numel))
            offset += manifest.specs[i].numel
    return out


@dataclass(frozen=True)
class WirePush:
    """A push as it crosses Ray's object store: the manifest, and each dtype run of the tensors as one
    uint8 numpy array. Ray moves numpy buffers with one memcpy and hands them to the receiver without
    another (torch tensors it pickles, several times slower), and bytes keep bf16 exact."""

    manifest: Manifest
    runs: list[np.ndarray]


def to_wire(version: int, tensors: dict[str, torch.Tensor]) -> WirePush:
    """Lay `tensors` out for the object store: one copy, into one flat buffer per dtype run."""
    manifest = make_manifest(version, tensors)
    runs = pack_all(manifest, tensors, sys.maxsize, "cpu").buffers
    return WirePush(manifest, [r.view(torch.uint8).numpy() for r in runs])


def from_wire(wire: WirePush, bucket_bytes: int, device: torch.device | str, with_checksums: bool) -> Packed:
    """The push as broadcast buckets. On the CPU the buckets are views of the object-store buffers (which
    they keep alive): no copy. The manifest gets checksums of these bytes when asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # only read
        runs = [torch.from_numpy(r) for r in wire.runs]
    specs = wire.manifest.specs
    runs = [r.view(specs[bucket[0]].dtype).to(device) for r, bucket in zip(runs, plan_buckets(wire.manifest, sys.maxsize))]
    slices = _run_slices(wire.manifest)
    tensors = {s.name: runs[run][a:b].view(s.shape) for s, (run, a, b) in zip(specs, slices)}
    manifest = make_manifest(wire.manifest.version, tensors, with_checksums) if with_checksums else wire.manifest
    buckets = plan_buckets(manifest, bucket_bytes)
    # A bounded bucket is a run of consecutive specs inside one dtype run: a slice of that run's buffer.
    buffers = [runs[slices[b[0]][0]][slices[b[0]][1] : slices[b[-1]][2]] for b in buckets]
    return Packed(manifest, buckets, buffers)
