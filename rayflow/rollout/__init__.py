"""Rollout on Ray: CFG-parallel RolloutWorker ranks (worker.py) grouped into replicas (replica.py),
replicas into a pool (pool.py). The per-rank logic is the plain RolloutRank (rank.py); a rank's weights
(receive, verify, stage, agree, load) are its rayflow.sync.receiver.WeightReceiver's."""

from rayflow.rollout.pool import RolloutPool
from rayflow.rollout.rank import RolloutRank, RolloutRankSpec
from rayflow.rollout.replica import ReplicaError, RolloutFuture, RolloutReplica

__all__ = ["ReplicaError", "RolloutFuture", "RolloutPool", "RolloutRank", "RolloutReplica", "RolloutRankSpec"]
