"""Rollout on Ray: CFG-parallel RolloutWorker ranks (worker.py) grouped into replicas (replica.py),
replicas into a pool (pool.py). The per-rank logic is the plain RolloutRank (rank.py); a rank's weights
(receive, verify, stage, agree, load) are its rayflow.sync.receiver.WeightReceiver's.

The names below are imported on first use: importing the package (as Ray does in a process that receives a
RolloutWorker handle, to load worker.py) must not import the model code.
"""

import importlib

_HOME = {"RolloutPool": "pool", "RolloutRank": "rank", "RolloutRankSpec": "spec", "ReplicaError": "replica",
         "RolloutFuture": "replica", "RolloutReplica": "replica"}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
