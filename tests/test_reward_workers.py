"""RewardPool on the session's local Ray: scoring like the in-process WeightedReward, round robin,
retries of a failing reward (a local reward server that fails on demand), a killed worker (replaced
while its restart budget lasts) and a stopped one (reported within its deadline, its calls re-issued)."""

import contextlib
import copy
import io
import logging
import os
import re
import signal
import time

import numpy as np
import pytest
import ray
import torch
from PIL import Image

from rayflow.config import RewardConfig, RewardFnConfig
from rayflow.rewards import make_reward
from rayflow.rewards.weighted import WeightedReward
from rayflow.rewards.worker import RewardError, RewardPool
from rayflow.types import RolloutRequest, SamplingParams, Trajectory
from reward_server import RewardServer, score_mean_red
from tiny_run import lost_ref, wait_until_dead

PROMPTS = ["a red apple", "a blue car", "a green tree", "a white cat", "a yellow duck"]


def trajectory(i: int) -> Trajectory:
    image = torch.randint(0, 256, (16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
    return Trajectory(
        prompt=PROMPTS[i % len(PROMPTS)], prompt_id=i % len(PROMPTS), group_id=i // 2, seed=1000 + i,
        params=SamplingParams(num_steps=1), latents=torch.zeros(1, 1, 1), latent_indices=[1],
        timesteps=torch.zeros(1), sigmas=torch.zeros(2), log_probs=torch.zeros(1),
        sde_mask=torch.zeros(1, dtype=torch.bool), versions=torch.tensor([0]), means=torch.zeros(0, 1, 1), conds={}, image=image,
    )


def collect_all(pool: RewardPool, timeout_s: float = 60.0) -> list[Trajectory]:
    scored, deadline = [], time.monotonic() + timeout_s
    while pool.pending:
        assert time.monotonic() < deadline, "reward calls did not finish"
        scored += pool.collect(timeout_s=5.0)
    return scored


@pytest.fixture
def make_pool(ray_session):
    """RewardPool(cfg) with 2 workers; removed (actors and placement group) after the test."""
    pools = []

    def make(functions: list[RewardFnConfig], batch_size: int = 2, max_retries: int = 1, max_restarts: int = 0,
             stall_timeout_s: float = 600.0, cpus_per_worker: float = 1.0) -> RewardPool:
        cfg = RewardConfig(functions=functions, num_workers=2, batch_size=batch_size, cpus_per_worker=cpus_per_worker,
                           max_retries=max_retries, max_restarts=max_restarts, stall_timeout_s=stall_timeout_s)
        pools.append(RewardPool(cfg, name=f"test-rewards-{len(pools)}"))
        return pools[-1]

    yield make
    for pool in pools:
        pool.shutdown()


COLOR_AND_JPEG = [RewardFnConfig("color", 0.5), RewardFnConfig("jpeg_compressibility", 2.0)]


def test_pool_scores_like_the_weighted_reward_in_process(make_pool):
    pool = make_pool(COLOR_AND_JPEG, batch_size=2, cpus_per_worker=2.0)
    # A worker computes on the CPUs its bundle reserves (it ran one torch thread whatever reward.cpus_per_worker said).
    assert ray.get(pool.workers[0].__ray_call__.remote(lambda worker: torch.get_num_threads())) == 2
    trajectories = [trajectory(i) for i in range(5)]
    local = copy.deepcopy(trajectories)
    pool.submit(trajectories)
    # Batches of reward.batch_size, round robin over the two workers.
    assert [len(c.payload) for c in pool.calls] == [2, 2, 1]
    assert [c.worker for c in pool.calls] == [0, 1, 0]
    scored = collect_all(pool)
    assert sorted(map(id, scored)) == sorted(map(id, trajectories))  # the caller's objects, filled in

    WeightedReward(COLOR_AND_JPEG).score(local)
    images = torch.stack([t.image for t in local])
    color = make_reward("color")(images, PROMPTS)
    jpeg = make_reward("jpeg_compressibility")(images, PROMPTS)
    for i, t in enumerate(trajectories):
        assert t.rewards == local[i].rewards and t.reward == local[i].reward
        assert t.rewards == {"color": pytest.approx(float(color[i])),
                             "jpeg_compressibility": pytest.approx(float(jpeg[i]))}
        assert t.reward == pytest.approx(0.5 * float(color[i]) + 2.0 * float(jpeg[i]), rel=1e-6)


def jpeg_mean_red(image: torch.Tensor) -> float:
    """What the test server computes, here from the JPEG that the http reward sends (quality 95)."""
    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image)).save(buffer, format="JPEG", quality=95)
    return np.asarray(Image.open(buffer).convert("RGB"))[..., 0].mean() / 255


def test_a_reward_that_fails_once_is_retried_on_the_other_worker(make_pool, caplog):
    def fail_first(i, body):
        return (500, {"error": "reward model warming up"}) if i == 0 else score_mean_red(i, body)

    with RewardServer(fail_first) as server:
        pool = make_pool([RewardFnConfig("http", 1.0, {"url": server.url, "timeout_s": 20})], batch_size=4)
        trajectories = [trajectory(i) for i in range(3)]
        with caplog.at_level(logging.WARNING, logger="rayflow.rewards"):
            pool.submit(trajectories)
            assert [c.worker for c in pool.calls] == [0]
            assert pool.collect(timeout_s=30) == []  # the first call failed...
            assert [(c.worker, c.attempt) for c in pool.calls] == [(1, 1)]  # ...and went to the other worker
            scored = collect_all(pool)
    assert scored == trajectories and len(server.requests) == 2
    for t in trajectories:
        assert t.rewards == {"http": pytest.approx(jpeg_mean_red(t.image))}
        assert t.reward == t.rewards["http"]
    (record,) = [r for r in caplog.records if r.name == "rayflow.rewards"]
    assert record.levelno == logging.WARNING
    assert "attempt 1 of 2" in record.getMessage() and "a batch of 3 images" in record.getMessage()
    assert f"http reward {server.url}: HTTP 500: reward model warming up" in record.getMessage()


def test_a_reward_that_keeps_failing_stops_the_run_with_the_batch_and_last_error(make_pool):
    def always_fail(i, body):
        return 500, {"error": f"reward model crashed (call {i})"}

    with RewardServer(always_fail) as server:
        pool = make_pool([RewardFnConfig("http", 1.0, {"url": server.url, "timeout_s": 20})], batch_size=4)
        trajectories = [trajectory(i) for i in range(3)]
        pool.submit(trajectories)
        with pytest.raises(RewardError) as info:
            collect_all(pool)
    message = str(info.value)
    assert "reward failed 2 times on a batch of 3 images (prompts ['a blue car', 'a green tree', 'a red apple'])" \
        in message
    assert "stopping the run" in message
    assert re.search(re.escape(f"http reward {server.url}: HTTP 500: reward model crashed (call 1)"), message)
    assert len(server.requests) == 2  # max_retries=1: one try and one retry
    assert all(t.reward is None and t.rewards == {} for t in trajectories)  # never silent zeros


def test_a_reward_that_cannot_be_built_stops_the_run_at_once_with_its_error(make_pool, tmp_path):
    """A CLIP directory that passes the config's check (config.json, processor files) but holds no weights: the
    workers' constructors raise. Each restart would fail alike; the pool used to spend them all, then stop with "all
    reward workers are lost" and without the cause."""
    clip = tmp_path / "clip"
    clip.mkdir()
    (clip / "config.json").write_text('{"model_type": "clip"}')
    for name in ("preprocessor_config.json", "tokenizer.json"):
        (clip / name).write_text("{}")
    pool = make_pool([RewardFnConfig("clip_score", 1.0, kwargs={"path": str(clip)})], max_restarts=3)
    pool.submit([trajectory(i) for i in range(2)])
    with pytest.raises(RewardError, match=r"^reward worker 0 .* could not build the run's rewards; stopping the run\. "
                                          r"The actor died because of an error raised in its creation task(.|\n)*OSError"):
        collect_all(pool)
    assert pool.restarts == [0, 0]


def test_a_killed_worker_is_skipped_and_its_batch_retried_on_the_other(make_pool, caplog):
    pool = make_pool([RewardFnConfig("color", 1.0)], batch_size=2)
    ray.kill(pool.workers[0])
    wait_until_dead(pool.workers[0])
    trajectories = [trajectory(i) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="rayflow.rewards"):
        pool.submit(trajectories)
        assert [c.worker for c in pool.calls] == [0, 1]  # the pool does not know yet
        scored = collect_all(pool)
    assert sorted(map(id, scored)) == sorted(map(id, trajectories))
    assert pool.dead == {0}
    assert len([r for r in caplog.records if r.name == "rayflow.rewards"]) == 1  # the dead worker's batch

    expected = make_reward("color")(torch.stack([t.image for t in trajectories]), [t.prompt for t in trajectories])
    assert [t.reward for t in trajectories] == pytest.approx(expected.tolist())

    # Later batches go to the live worker only.
    more = [trajectory(i) for i in range(4, 8)]
    pool.submit(more)
    assert [c.worker for c in pool.calls] == [1, 1]
    assert sorted(map(id, collect_all(pool))) == sorted(map(id, more))
    assert all(t.reward is not None for t in more)


def test_a_worker_whose_process_dies_is_replaced_while_its_restart_budget_lasts(make_pool, caplog):
    pool = make_pool([RewardFnConfig("color", 1.0)], batch_size=2, max_restarts=1)
    pid = ray.get(pool.workers[0].__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(pool.workers[0], no_restart=False)  # as if the process crashed
    wait_until_dead(pool.workers[0])  # ray.kill is asynchronous: a call sent at once could still be served
    trajectories = [trajectory(i) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="rayflow.rewards"):
        pool.submit(trajectories)
        scored = collect_all(pool)
    assert sorted(map(id, scored)) == sorted(map(id, trajectories)) and pool.dead == set() and pool.restarts == [1, 0]
    # Reported once, naming the worker, its node and its batch; the batch was issued again without spending a
    # retry of the reward (max_retries=1 would otherwise be half used).
    (record,) = [r.getMessage() for r in caplog.records if r.name == "rayflow.rewards"]
    assert re.search(r"reward worker 0 of \d+ on node 127\.0\.0\.1 \(node id \w+\) died while scoring a batch of 2 images", record)
    assert record.endswith("replacing it (restart 1)")
    expected = make_reward("color")(torch.stack([t.image for t in trajectories]), [t.prompt for t in trajectories])
    assert [t.reward for t in trajectories] == pytest.approx(expected.tolist())
    # A new process in the same bundle serves in the rotation.
    assert ray.get(pool.workers[0].__ray_call__.remote(lambda self: os.getpid()), timeout=60) != pid
    pool.submit([trajectory(i) for i in range(4, 8)])
    assert sorted(c.worker for c in pool.calls) == [0, 1]
    collect_all(pool)

    # A second death within reward.restart_window_s: the budget is used up and the worker leaves the rotation.
    ray.kill(pool.workers[0])
    wait_until_dead(pool.workers[0])
    more = [trajectory(i) for i in range(8, 12)]
    pool.submit(more)
    assert sorted(map(id, collect_all(pool))) == sorted(map(id, more)) and pool.dead == {0}
    assert "its restarts are used up (reward.max_restarts=1 per reward.restart_window_s=3600.0)" in caplog.text


def test_a_stopped_worker_is_reported_within_the_deadline_and_its_calls_reissued(make_pool, caplog):
    floor_s = 3.0
    pool = make_pool([RewardFnConfig("color", 1.0)], batch_size=2, max_restarts=1, stall_timeout_s=floor_s)
    pid = ray.get(pool.workers[0].__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)  # neither answers nor dies: Ray reports nothing
    try:
        trajectories = [trajectory(i) for i in range(4)]
        with caplog.at_level(logging.WARNING, logger="rayflow.rewards"):
            start = time.monotonic()
            pool.score(trajectories)  # blocking, as an evaluation's
            elapsed = time.monotonic() - start
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed as stalled, unless the test failed before
            os.kill(pid, signal.SIGCONT)
    (record,) = [r.getMessage() for r in caplog.records if r.name == "rayflow.rewards"]
    assert re.search(r"reward worker 0 of \d+ on node 127\.0\.0\.1 \(node id \w+\) stalled: finished nothing for \d+s "
                     r"\(deadline 3s, reward.stall_timeout_s=3.0\) while scoring a batch of 2 images", record)
    assert record.endswith("replacing it (restart 1)") and pool.restarts == [1, 0]
    # Told within the deadline (the floor: a color call takes milliseconds) plus the poll; then re-issued.
    assert elapsed < floor_s + 10.0
    expected = make_reward("color")(torch.stack([t.image for t in trajectories]), [t.prompt for t in trajectories])
    assert [t.reward for t in trajectories] == pytest.approx(expected.tolist())


def started(pool: RewardPool) -> RewardPool:
    """`pool` once every worker has loaded its rewards (its watchdog clocks run from then on, as in a run)."""
    ray.get(list(pool.starting.values()), timeout=60)
    pool.collect(timeout_s=0)
    assert not pool.starting
    return pool


def test_a_worker_whose_call_raised_is_not_taken_for_stalled_while_idle(make_pool, caplog):
    """The first call fails on worker 0 and is retried on worker 1. Worker 0 answered (with an error) and holds no
    call: its watchdog clock must stop. It ran on from the failed call, and once the run had sent worker 0 nothing for
    the deadline (a long train step, a save, a learner restart) the idle worker was killed as stalled, spending a
    restart (here with none left: left out of the rotation for good)."""
    floor_s = 2.0

    def fail_first(i, body):
        return (500, {"error": "reward model warming up"}) if i == 0 else score_mean_red(i, body)

    with RewardServer(fail_first) as server:
        pool = started(make_pool([RewardFnConfig("http", 1.0, {"url": server.url, "timeout_s": 20})], batch_size=4,
                                 stall_timeout_s=floor_s))
        trajectories = [trajectory(i) for i in range(3)]
        with caplog.at_level(logging.WARNING, logger="rayflow.rewards"):
            pool.submit(trajectories)
            assert collect_all(pool) == trajectories and len(server.requests) == 2
            time.sleep(floor_s + 1.0)  # the driver trains, saves, ...: no reward call meanwhile
            assert pool.collect(timeout_s=0) == []
    assert pool.dead == set() and pool.restarts == [0, 0]
    assert "stalled" not in caplog.text


def test_a_drain_drops_the_calls_in_flight_without_retrying_them_and_a_failing_one_does_not_stop_the_run(make_pool,
                                                                                                           caplog):
    """A learner rewind drains the reward calls in flight: their results are thrown away. One that fails is dropped,
    not retried (the retry's result would be thrown away too), and a reward failing there does not stop the run
    with a RewardError about a batch that will never be trained; the steps trained again score their batches anew."""
    restarting = [True]

    def fail_while_restarting(i, body):
        return (500, {"error": f"reward server restarting (call {i})"}) if restarting[0] else score_mean_red(i, body)

    with RewardServer(fail_while_restarting) as server:
        pool = started(make_pool([RewardFnConfig("http", 1.0, {"url": server.url, "timeout_s": 20})], batch_size=4))
        pool.submit([trajectory(i) for i in range(3)])
        with caplog.at_level(logging.WARNING, logger="rayflow.rewards"):
            pool.drain()
        assert pool.calls == [] and pool.pending == 0
        assert len(server.requests) == 1  # not retried
        assert "dropped" in caplog.text and "reward server restarting (call 0)" in caplog.text
        restarting[0] = False  # the pool serves on
        more = [trajectory(i) for i in range(3, 7)]
        pool.submit(more)
        assert sorted(map(id, collect_all(pool))) == sorted(map(id, more))
    assert all(t.reward is not None for t in more)


def test_a_request_whose_trajectories_are_lost_is_handed_back_spending_no_retry(make_pool, caplog):
    """A rollout request's trajectories live in the object store of the node that sampled them. Lost with that node
    before they were scored, the reward call fails with an ObjectLostError: it was retried (reward.max_retries) and
    then stopped the run with "reward failed 2 times", blaming the reward. It is handed back to be sampled again."""
    pool = make_pool([RewardFnConfig("color")], max_retries=1)
    request = RolloutRequest("g7-s0", ["a red apple"] * 2, [0, 0], [7, 7], [11, 12], SamplingParams(num_steps=1))
    with caplog.at_level(logging.WARNING, logger="rayflow.rewards"):
        pool.submit_rollout(lost_ref(), request)
        deadline = time.monotonic() + 60
        while pool.calls:
            assert time.monotonic() < deadline, "the call on the lost trajectories did not finish"
            assert pool.collect(timeout_s=5.0) == []
    assert pool.take_lost() == [request] and pool.take_lost() == []
    assert pool.pending == 0 and pool.restarts == [0, 0] and pool.dead == set()
    assert "retrying" not in caplog.text and "g7-s0" in caplog.text and "lost before they were scored" in caplog.text
    scored = [trajectory(i) for i in range(2)]  # the pool serves on
    pool.submit(scored)
    assert collect_all(pool) == scored and all(t.reward is not None for t in scored)


@ray.remote(num_cpus=0, num_gpus=0, max_calls=1)  # max_calls: the worker exits after it, its torch patched
def _devices_where_torch_sees_the_nodes_gpus(device: str | None) -> tuple[str, bool]:
    """A CLIP-family reward's device, and whether a role computes on CUDA (placement.uses_cuda: rollout ranks, learner
    ranks, the weight-sync actor), in a Ray worker without GPUs on a GPU node: there Ray (2.60) leaves
    CUDA_VISIBLE_DEVICES alone, so torch sees every GPU of the node (a rollout rank's, a learner's)."""
    torch.cuda.is_available = lambda: True
    from rayflow.distributed.placement import uses_cuda
    from rayflow.rewards.clip import _device

    return str(_device(device)), uses_cuda()


def test_a_worker_without_a_gpu_does_not_take_another_roles_gpu(ray_session):
    """reward.gpus_per_worker=0 (the default): CLIP loaded onto the node's cuda:0, which Ray gave another actor; so did
    a rank or weight-sync actor given 0 GPUs."""
    assert ray.get(_devices_where_torch_sees_the_nodes_gpus.remote(None)) == ("cpu", False)
    assert ray.get(_devices_where_torch_sees_the_nodes_gpus.remote("cuda"))[0] == "cuda"  # kwargs.device, as asked
