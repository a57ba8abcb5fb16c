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


def resumed(max_staleness: int, over_stale: str, version: int, pending: list[int]) -> StalenessQueue:
    """The queue Trainer._restore builds from a checkpoint at `version` (a resume, or a learner rewind to it): admission
    counts the batches trained so far, and the checkpoint's pending groups are submitted again first."""
    q = StalenessQueue(batch_size=B, group_size=G, max_staleness=max_staleness, over_stale=over_stale)
    q.accepted = version * B
    for gid in pending:
        q.submitted(group(gid))
    return q


def test_a_synchronous_run_resumed_or_rewound_from_its_own_checkpoint_has_no_stale_group():
    """A synchronous run saves after admitting the next batch (Trainer._finish), so its checkpoint's pending groups are
    one batch, drawn again under the checkpoint's version: the whole of the next batch, nothing left to go stale."""
    q = StalenessQueue(batch_size=B, group_size=G, max_staleness=0)
    for gid in (0, 1):
        q.submitted(group(gid))
        finish_group(q, group(gid), [0, 0, 0])
    assert q.take_batch(version=0)[0] is not None
    for gid in (2, 3):  # step 1 ends: the next batch is submitted, then the checkpoint saved
        q.submitted(group(gid))
    assert not q.can_admit(version=1)
    pending = sorted(q.groups)
    assert pending == [2, 3]
    q = resumed(0, "regenerate", version=1, pending=pending)
    assert not q.can_admit(version=1)
    for gid in pending:
        finish_group(q, group(gid), [1, 1, 1])
    batch, resubmit = q.take_batch(version=1)
    assert batch is not None and resubmit == [] and q.groups == {}


@pytest.mark.parametrize("over_stale", ["regenerate", "drop"])
def test_a_synchronous_run_resumed_from_an_asynchronous_checkpoint_regenerates_or_drops_its_stale_groups(over_stale):
    """async.* changes on a resume (not in rayflow.runs.BREAKING). An asynchronous run at max_staleness=2 saves with up to
    two batches pending; resumed (or rewound to that checkpoint) with max_staleness=0, the first batch trains at the
    checkpoint's version and the second, sampled under it too, is one version stale at the next: async.over_stale is
    read by a synchronous run (config.root.READ_ONLY_WHEN leaves it free)."""
    q = StalenessQueue(batch_size=B, group_size=G, max_staleness=2)
    while q.can_admit(version=0):
        gid = len(q.groups)
        q.submitted(group(gid))
        finish_group(q, group(gid), [0, 0, 0])
    assert q.take_batch(version=0)[0] is not None
    pending = sorted(q.groups)  # step 1 ends and saves (Trainer._save), before the loop admits again
    assert pending == [2, 3, 4, 5]
    q = resumed(0, over_stale, version=1, pending=pending)
    for gid in pending:  # all submitted at once under version 1 (min_version)
        finish_group(q, group(gid), [1, 1, 1])
    batch, resubmit = q.take_batch(version=1)
    assert {t.group_id for t in batch} == {2, 3} and resubmit == []
    batch, resubmit = q.take_batch(version=2)  # groups 4 and 5: staleness 1 > 0
    assert batch is None
    if over_stale == "regenerate":
        assert resubmit == [group(4), group(5)] and q.stats.regenerated == 2 and q.running == B
    else:
        assert resubmit == [] and q.stats.dropped == 2 and q.capacity(2) == B  # the next batch is admitted in their place


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
