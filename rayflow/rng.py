"""Random-number-generator states of a process as tensors (torch CPU and CUDA, numpy, python),
so checkpoints hold them in safetensors rather than pickles; and generators keyed by the run's
coordinates, the same in every process."""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch


def get_rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states by name: "torch", "cuda.<i>" (a process that computes on CUDA), "numpy.*",
    "python.*"."""
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy.keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy.pos_has_gauss": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy.cached_gaussian": torch.tensor([cached], dtype=torch.float64),
        "python.state": torch.tensor([version, *mt], dtype=torch.int64),
        # None (no cached gaussian) as NaN.
        "python.gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
    }
    # Only a process that computes on CUDA has CUDA states to keep: asking is_available() instead made the driver, and
    # a CPU role on a GPU node (which sees every GPU of it), create a context on every GPU of the node at each save.
    if torch.cuda.is_initialized():
        state.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore `get_rng_state` output (CUDA states only in a process that computes on CUDA, for the devices both runs
    have)."""
    torch.set_rng_state(state["torch"])
    pos, has_gauss = state["numpy.pos_has_gauss"].tolist()
    keys = state["numpy.keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, pos, has_gauss, float(state["numpy.cached_gaussian"][0])))
    version, *mt = state["python.state"].tolist()
    gauss = float(state["python.gauss"][0])
    random.setstate((version, tuple(mt), None if gauss != gauss else gauss))
    if torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            if f"cuda.{i}" in state:
                torch.cuda.set_rng_state(state[f"cuda.{i}"], i)


def keyed_generator(*key: int | str) -> torch.Generator:
    """A CPU generator seeded by `key` (run seed, version, ...), the same in every process and run.

    Python salts the hash of a str per process (PYTHONHASHSEED), so a string enters as its CRC-32;
    integers, and tuples of them, hash the same everywhere, and enter as themselves (an all-integer
    key seeds as `hash(key)` always has)."""
    ints = tuple(zlib.crc32(part.encode()) if isinstance(part, str) else part for part in key)
    return torch.Generator().manual_seed(hash(ints) & (2**63 - 1))
