"""Adapter weights on a rollout rank: staged by version, verified, and loaded at a step boundary.

Ordering rules (DESIGN §8, §9):
- Weights arrive for increasing versions, on every rank of a replica in the same order (one
  broadcast source), possibly from another thread than the one sampling: `StagedWeights` is
  the lock-protected hand-over between them.
- A replica applies a version only once it is staged on ALL its ranks (the ranks agree on the
  minimum of their newest staged versions), so every rank samples under the same weights.
- Applying version v drops every staged version older than v; staging keeps the two newest.
"""

from __future__ import annotations

import threading

import torch

from rayflow.named_tensors import check_layout, layout


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


KEEP_STAGED = 2
"""Versions a rank keeps staged (see StagedWeights.put); rayflow.sync.broadcast.ReceiveBuffers needs one slot more."""


class StagedWeights:
    """Versions received but not applied yet: {version: canonical name -> tensor}; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_version: dict[int, dict[str, torch.Tensor]] = {}

    def put(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Stage `version`, keeping only it and the newest one before it: the ranks of a replica stage from
        one broadcast source in lockstep, so the version they agree on is never older than that (and an
        idle replica does not pile up every version it receives)."""
        with self._lock:
            self._by_version[version] = tensors
            for old in sorted(self._by_version)[:-KEEP_STAGED]:
                del self._by_version[old]

    def newest(self, default: int) -> int:
        """The newest staged version, or `default` (the applied one) when nothing is staged."""
        with self._lock:
            return max(self._by_version, default=default)

    def drop_after(self, version: int) -> None:
        """Forget every staged version newer than `version` (voided by a rewind of the learners)."""
        with self._lock:
            self._by_version = {v: t for v, t in self._by_version.items() if v <= version}

    def take(self, version: int) -> dict[str, torch.Tensor]:
        """Remove and return `version`, dropping every older one."""
        with self._lock:
            if version not in self._by_version:
                raise KeyError(
                    f"version {version} was agreed by the replica but is not staged on this rank "
                    f"(staged: {sorted(self._by_version)}); versions must reach every rank in the same order"
                )
            tensors = self._by_version.pop(version)
            self._by_version = {v: t for v, t in self._by_version.items() if v > version}
            return tensors
