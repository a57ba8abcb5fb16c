"""StalenessQueue driven with fake versions and trajectories: no Ray, no model."""

import pytest
import torch

from rayflow.data.prompts import PromptGroup
from rayflow.driver.queue import StalenessQueue
from rayflow.types import SamplingParams, Trajectory

G = 2  # group size
B = 4  # batch size: two groups


def group(gid: int) -> PromptGroup:
    return PromptGroup(group_id=gid, prompt_id=gid, prompt=f"p{gid}", seeds=tuple(range(10 * gid, 10 * gid + G)))


def trajectory(g: PromptGroup, seed: int, versions: list[int], reward: float = 0.5) -> Trajectory:
    T = len(versions)
    return Trajectory(
        prompt=g.prompt, prompt_id=g.prompt_id, group_id=g.group_id, seed=seed, params=SamplingParams(num_steps=T),
        latents=torch.zeros(1, 1, 1), latent_indices=[T], timesteps=torch.zeros(T), sigmas=torch.zeros(T + 1),
        log_probs=torch.zeros(T), sde_mask=torch.zeros(T, dtype=torch.bool), versions=torch.tensor(versions), means=torch.zeros(0, 1, 1),
        conds={}, reward=reward,
    )


def finish_group(q: StalenessQueue, g: PromptGroup, versions: list[int]) -> None:
    # Seeds come back out of order: the batch must still be ordered by seed.
    for seed in reversed(g.seeds):
        q.finished(trajectory(g, seed, versions))


def test_sync_mode_admits_exactly_one_batch_per_version():
    q = StalenessQueue(batch_size=B, group_size=G, max_staleness=0)
    admitted = []
    gid = 0
    while q.can_admit(version=0):
        q.submitted(group(gid))
        admitted.append(gid)
        gid += 1
    assert admitted == [0, 1]  # (0 + 0 + 1) * 4 samples = two groups of two
    assert q.capacity(0) == 0
    finish_group(q, group(0), [0, 0, 0])
    finish_group(q, group(1), [0, 0, 0])
    assert not q.can_admit(version=0)  # finished samples still count until trained on and the version moves
    batch, resubmit = q.take_batch(version=0)
    assert resubmit == []
    assert [(t.group_id, t.seed) for t in batch] == [(0, 0), (0, 1), (1, 10), (1, 11)]
    assert q.can_admit(version=1) and q.capacity(1) == B


def test_admission_bound_grows_with_staleness():
    # accepted + running <= (max_staleness + v + 1) * B
    q = StalenessQueue(batch_size=B, group_size=G, max_staleness=2)
    assert q.capacity(0) == 3 * B
    for gid in range(6):
        q.submitted(group(gid))
    assert not q.can_admit(0) and q.capacity(1) == B


def test_stale_group_is_regenerated_never_trained():
    q = StalenessQueue(batch_size=B, group_size=G, max_staleness=1)
    for gid in range(2):
        q.submitted(group(gid))
    finish_group(q, group(0), [0, 0, 1])  # oldest step at version 0
    finish_group(q, group(1), [2, 2, 2])
    batch, resubmit = q.take_batch(version=2)  # group 0 staleness 2 > 1
    assert batch is None
    assert resubmit == [group(0)]
    assert q.stats.regenerated == 1 and q.running == G and q.accepted == G
    finish_group(q, group(0), [2, 2, 2])
    batch, resubmit = q.take_batch(version=2)
    assert resubmit == [] and {t.group_id for t in batch} == {0, 1}
    assert q.stats.staleness_max == 0


def test_stale_group_is_dropped_and_counted():
    q = StalenessQueue(batch_size=B, group_size=G, max_staleness=0, over_stale="drop")
    for gid in range(2):
        q.submitted(group(gid))
    finish_group(q, group(0), [0, 0, 0])
    finish_group(q, group(1), [1, 1, 1])
    batch, resubmit = q.take_batch(version=1)
    assert batch is None and resubmit == [] and q.stats.dropped == 1
    assert q.accepted == G  # the dropped group's samples no longer hold capacity
    assert q.capacity(1) == 2 * B - G


def test_staleness_and_partial_figures_of_a_batch():
    q = StalenessQueue(batch_size=B, group_size=G, max_staleness=2)
    for gid in range(2):
        q.submitted(group(gid))
    finish_group(q, group(0), [1, 2, 3])  # partial: spans versions 1..3
    finish_group(q, group(1), [3, 3, 3])
    batch, _ = q.take_batch(version=3)
    assert len(batch) == B
    assert q.stats.staleness_mean == pytest.approx((2 + 2 + 0 + 0) / 4)
    assert q.stats.staleness_max == 2
    assert q.stats.partial_ratio == pytest.approx(0.5)
    assert q.stats.max_partial_span == 2


def test_incomplete_or_unscored_groups_wait():
    q = StalenessQueue(batch_size=B, group_size=G, max_staleness=0)
    for gid in range(2):
        q.submitted(group(gid))
    finish_group(q, group(0), [0])
    g1 = group(1)
    q.finished(trajectory(g1, g1.seeds[0], [0]))
    assert q.take_batch(0) == (None, [])
    unscored = trajectory(g1, g1.seeds[1], [0], reward=None)
    q.finished(unscored)
    assert q.take_batch(0) == (None, [])
    unscored.reward = 0.1
    batch, _ = q.take_batch(0)
    assert batch is not None and q.depth == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="multiple of the group size"):
        StalenessQueue(batch_size=5, group_size=2, max_staleness=0)
