import os
import sys

# Keep every Ray process on loopback (RAY-LOCAL.md); must be set before Ray starts.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray runs its workers at niceness 15, under everything else. Two test workers share the cores, and each runs
# computations in its own process (the reference trainer, the learning test) at niceness 0: the other's actors
# then starved (an actor created beside two busy processes took 492 s to start; a CI run spent 389 s in one test,
# another failed a 5 s collective timeout). Every Ray the suite starts, in this process or in the subprocesses
# that inherit its environment, runs its workers at niceness 0, level with the test processes.
os.environ.setdefault("RAY_worker_niceness", "0")
# The fault tests stop actors with SIGSTOP (a process that neither answers nor dies). Ray kills such a worker only
# after its kill_worker_timeout_milliseconds (5000 by default: the time a worker gets to exit on its own), and its
# bundle, which the replacement takes, is free only then: every replacement of a stopped actor waited 5 s (a stopped
# weight-sync actor's replacement answered its first call after 6.1 s; 1.9 s at 1000). Runs keep Ray's default.
os.environ.setdefault("RAY_kill_worker_timeout_milliseconds", "1000")
# Ray's log monitor (which forwards the actors' output to the test's driver) globs its session's log directory ten
# times a second while it holds fewer than this many files, and every 0.5 s after: the suite's Rays start some 400
# workers, two log files each, and their two monitors took 71 CPU-seconds of a 905-s run. At 0 they glob every 0.5 s
# from the start: 1.5 CPU-seconds a minute instead of 3.4 under actor churn (2026-12-02). Runs keep Ray's default.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# `pytest /path/to/rayflow` works from any directory: tests that spawn tools and recipes name their
# working directory themselves; the rest run from the repository root, whatever the caller's is.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(REPO_ROOT)
sys.path.insert(0, REPO_ROOT)  # `tools` imports as it does under `python -m pytest` at the root

import pytest
import torch

from rayflow.models.tiny import save_tiny_model


pytest_plugins = ["crash_reports", "slow_test_stacks"]  # tests/: a crashed worker's last words; a slow test's stacks

LONGEST_FILES_FIRST = ("test_faults.py", "test_trainer.py", "test_cluster.py", "test_learning.py", "test_runs.py",
                       "test_learner.py", "test_planning.py", "test_recipes.py", "test_bench_gpu.py", "test_sync.py",
                       "test_colocated.py", "test_shapes_base.py", "test_rollout.py", "test_speed_options.py",
                       "test_zygote.py", "test_watchdog.py", "test_evaluate.py", "test_export.py")
"""The files that take longest (most Ray actors started, long in-process training, clusters of their own), longest
first: under `-n 2 --dist loadfile` a worker takes the next file when it is free, so starting them first leaves short
files to even out the end (longest-processing-time-first). Seconds per file in a working-tree run on 2 cores at a
slow hour (2026-12-02, twenty-seventh session): faults 298, trainer 204, cluster 183 (and job_submit 84, merged into
it since), learning 151, runs 137, learner 108, planning 83, recipes 76, bench_gpu 66, sync 64, colocated 49,
shapes_base 42, rollout 41, speed_options 39, zygote 36, watchdog 34, evaluate 34, export 34; every other file < 28."""


def pytest_configure(config):
    # pytest-xdist (3.8.0 here) hands files out by their number of tests, most first, unless told not to: that put many
    # quick parametrised files first and a 33 s file last (the two workers ended 428 and 492 s into a run).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file is kept
    # A gpu test without CUDA is skipped with the reason, never run (and so never counted as passing).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device here (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny offline Qwen-Image (seed 0), built once per test session."""
    return save_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen-image"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_twin(tmp_path_factory):
    """arch ("qwen_image", "sd3", "flux") -> the tiny offline twin of that family (seed 0), built once per session."""
    root = tmp_path_factory.mktemp("twins")
    return lambda arch: save_tiny_model(str(root / arch), arch=arch)


@pytest.fixture(autouse=True)
def _one_thread():
    # Results must not depend on the machine's core count; tests compare bit for bit.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_model_dir):
    """diffusers' own QwenImagePipeline over the tiny model: the oracle. Shared; do not modify it."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """The tiny model loaded through rayflow's registry. Shared; do not load adapters into it."""
    from rayflow.models import load_model

    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray per test session, on loopback, with explicit logical resources.

    Tests that need actors take this fixture; they must remove what they create (actors,
    placement groups) so the next test finds the resources free.
    """
    import ray

    from rayflow.distributed.worker_imports import init_local_ray, stop_worker_zygote

    # As a local run's: workers forked from a zygote that holds torch and the tiny model's classes imported.
    init_local_ray("QwenImagePipeline", num_cpus=8, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()
    stop_worker_zygote()
