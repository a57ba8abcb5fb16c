"""rayflow benchmarks: ratios measured side by side in one run, written as JSON.

    python tools/bench.py rollout --json bench_rollout.json [--arch qwen_image|sd3 --size small --height 192 --width 192 --steps 20 --batch 4]
    python tools/bench.py sync --json bench_sync.json [--lora-rank 128 --bucket-mb 64 --repeats 10]
    python tools/bench.py pipeline --json bench_pipeline.json [--recipe recipes/flowgrpo_tiny.yaml --steps 20 --rounds 3] [--placement colocated --colocated-devices 1 2]
    python tools/bench.py gpu --json bench_gpu.json [--depth N] | gpu --device cpu --tiny (smoke test); see tools/gpu_bench.py
    python tools/bench.py startup --json bench_startup.json [--repeats 3]      command to first step, by phase; and the end
    python tools/bench.py costs --json costs.json [--recipe ... --steps 8]      the simulator's costs; see tools/sim_bench.py
    python tools/bench.py simulator --json bench_sim.json [--steps 16]         the simulator against real runs
    python tools/bench.py learning --json bench_learning.json [--budget-s 180]  algorithms on the shapes world; see tools/learning_bench.py
    python tools/bench.py trajectories --json bench_traj.json [--shape qwen-image-1024]  a request's trajectories pickled; see tools/trajectory_bench.py
    python tools/bench.py gradients --json bench_gradients.json [--batches 16] [--recipe FILE]  gradient noise scale; see tools/gradient_bench.py

sync: a learner's rollout adapter (the "small" tiny model, LoRA rank 128) pushed through the
WeightSyncActor to two W = 1 rollout replicas, in lora and in merged mode, against one raw
torch.distributed broadcast of the same bytes on the same group; bytes per mode; how long learner
rank 0 is blocked per push against one copy of the tensors.

pipeline: steady-state step time of the tiny recipe (flowgrpo_tiny.yaml) with async.max_staleness 0 against 1, and
the synchronous run against the single-process reference trainer (rayflow.reference), and synchronous with
learner.prefetch=false (the learners fetching a batch's trajectories when its train step starts); with --placement colocated,
also placement.mode=colocated on the same number of devices (rollout ranks + learner ranks of the disaggregated run).
--rounds N runs every configuration N times, the order reversed each round (step_s_by_round shows the spread).
idle_penalty: one rollout step's transformer forwards timed right after this process slept 0, 10 and 100 ms (what a
role that waits for the other pays on this machine, and the single-process reference never does), and right after it
busy-waited 100 ms instead (whether keeping the core busy while waiting, as OpenMP's spin-wait does, would avoid it).
phases: the reference's step split into its rollout (sampling, scoring, advantages) and its learning, beside each
configuration's seconds a step with the rollout and the learners busy (the driver's view: a request or a train step
in flight) and, synchronous, with neither (the hops between them).
critical_path: each synchronous configuration's step as one chain read off Ray's task events (tools/critical_path.py):
the learners' train step, its end to the next rollout's start, the rollout, its end to the last request's scoring, the
scoring, its end to the next train step; and when the new weights were staged on the rollout ranks.
cpu: each configuration's CPU seconds per step by process role (tools/process_cpu.py: the learner and rollout actors,
the driver, raylet, GCS, ...), their sum over the cores (least_step_s: the shortest step the cores allow at that CPU)
and the share of the cores' time that was busy.

rollout: CFG-parallel rollout on a local Ray, two CFG branches (Qwen-Image true CFG), one torch
thread per rank, requests of rollout.micro_batch_size (4) samples. The model is the "small" tiny
Qwen-Image at 192x192: enough tokens per forward (4 x 144 image tokens) that the transformer is
compute-bound (a batch of 2B costs ~2x a batch of B; at 128x128 with 1 sample it costs ~1.3x and
CFG parallelism has little to win) and the transformer dominates the step time.
  (a) latency: seconds per image of a W = 2 replica (one branch per rank) against a W = 1 replica
      that batches both branches in one forward -- the CPU analogue of two devices against one;
  (b) throughput at equal resources: images/s of one W = 2 replica against two W = 1 replicas
      serving concurrently, both on the machine's cores;
  (c) the share of the W = 2 ranks' step time spent in the per-step all_gather (waiting for the
      peer included);
  (d) latency_cpu: the CPU seconds per image of the latency requests at W = 1 and W = 2 by process role, the
      shortest time per image the cores allow at that CPU, and the share of the cores' time that was busy.
Configurations take turns, repeated, and the medians are reported; the other replicas idle meanwhile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import time

import torch

from rayflow.cfg.policy import make_policy
from rayflow.config import ModelConfig, RolloutConfig, split_overrides
from rayflow.errors import ConfigError
from rayflow.models import model_class, pipeline_class_of
from rayflow.models.tiny import ARCHS, resolve_model_path
from rayflow.paths import check_output_dirs, recipe
from rayflow.types import RolloutRequest, SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling gpu_bench.py, however bench.py is run
import critical_path  # noqa: E402
import gpu_bench  # noqa: E402
import gradient_bench  # noqa: E402
import learning_bench  # noqa: E402
import process_cpu  # noqa: E402
import sim_bench  # noqa: E402
import trajectory_bench  # noqa: E402

# Issue 20's goals (the earlier ones were 1.6x latency, 1.5x overlap and 25% overhead).
LATENCY_GOAL, LATENCY_LIMIT, THROUGHPUT_GOAL = 1.85, 2.0, 0.9
SYNC_OVER_RAW_GOAL = 1.5
PIPELINE_OVERLAP_GOAL, PIPELINE_OVERHEAD_GOAL = 1.8, 0.10
PIPELINE_IDLE_GOALS = {"rollout": 0.10, "learner": 0.05}
"""Largest idle shares (perf/*_idle) with async.max_staleness=1."""


def start_local_ray(num_cpus: int):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only; must precede importing ray
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return ray


class Requests:
    """Distinct requests (fresh seeds each) of `batch` samples of one prompt."""

    def __init__(self, args: argparse.Namespace):
        self.params = SamplingParams(height=args.height, width=args.width, num_steps=args.steps, guidance_scale=4.0,
                                     decode_batch_size=args.decode_batch_size)
        self.batch, self.count = args.batch, 0

    def next(self) -> RolloutRequest:
        self.count += 1
        seeds = [self.count * 1000 + i for i in range(self.batch)]
        return RolloutRequest(f"bench-{self.count}", ["a red apple on a table"] * self.batch, [0] * self.batch,
                              [0] * self.batch, seeds, self.params)


def timed(fn, cpu_windows: list | None = None) -> float:
    """Wall seconds of fn(); `cpu_windows` gets the process CPU snapshots around it (tools/process_cpu.py)."""
    before = process_cpu.snapshot() if cpu_windows is not None else None
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    if cpu_windows is not None:
        cpu_windows.append((before, process_cpu.snapshot()))
    return seconds


def gather_share(before: list[dict], after: list[dict]) -> list[float]:
    """Per rank: seconds in the step all_gather / seconds in steps, over the interval."""
    return [
        (a["step_all_gather_s"] - b["step_all_gather_s"]) / (a["step_s"] - b["step_s"]) for b, a in zip(before, after)
    ]


def measure_round(one_a, one_b, two, requests: Requests, args: argparse.Namespace,
                  cpu_windows: dict[str, list]) -> dict[str, float]:
    """One turn of every configuration, back to back, so their ratios see the same machine state; the latency
    requests' process CPU goes to cpu_windows["w1"] and ["w2"]."""
    w1 = timed(lambda: one_a.generate(requests.next()), cpu_windows["w1"]) / args.batch
    w2 = timed(lambda: two.generate(requests.next()), cpu_windows["w2"]) / args.batch
    n = args.throughput_requests
    batch = [requests.next() for _ in range(n)]
    pair = timed(lambda: [f.result() for f in [(one_a, one_b)[i % 2].submit(r) for i, r in enumerate(batch)]])
    batch = [requests.next() for _ in range(n)]
    single = timed(lambda: [f.result() for f in [two.submit(r) for r in batch]])
    pair_ips, w2_ips = n * args.batch / pair, n * args.batch / single
    return {
        "w1_batched_cfg_s_per_image": w1, "w2_s_per_image": w2, "latency_speedup": w1 / w2,
        "two_w1_replicas_images_per_s": pair_ips, "one_w2_replica_images_per_s": w2_ips,
        "throughput_ratio": w2_ips / pair_ips,
    }


def bench_rollout(args: argparse.Namespace) -> dict:
    size = args.size or ("tiny" if args.arch == "flux" else "small")
    path = resolve_model_path(args.model, args.cache_dir, size=size, arch=args.arch)
    pipeline = pipeline_class_of(path)
    policy = make_policy(model_class(pipeline).default_cfg_policy)
    if len(policy.conditioning_prompts(["x"], " ", 4.0)) < 2:
        raise SystemExit(f"--arch {args.arch}: {pipeline}'s CFG policy {policy.name!r} has one branch; "
                         "CFG parallelism has nothing to split (use replicas)")
    load_before = os.getloadavg()[0]  # other processes on the machine skew every figure: record them
    ray = start_local_ray(num_cpus=4)  # logical: two W = 1 replicas and one W = 2 replica exist at once
    from rayflow.rollout import RolloutReplica, RolloutRankSpec  # imports ray: after its environment is set

    spec = RolloutRankSpec(model=ModelConfig(path=path), policy=policy, threads=1)
    batched = dataclasses.replace(spec, batch_branches=True)
    one_a = RolloutReplica(batched, RolloutConfig(cfg_parallel_size=1), name="bench-w1-a")
    one_b = RolloutReplica(batched, RolloutConfig(cfg_parallel_size=1), name="bench-w1-b")
    two = RolloutReplica(spec, RolloutConfig(cfg_parallel_size=2), name="bench-w2")
    replicas = (one_a, one_b, two)
    try:
        for replica in replicas:
            replica.wait_ready()
        requests = Requests(args)
        for replica in replicas:  # warm-up: first-call allocations, lazy imports
            replica.generate(requests.next())
        before, cpu_windows = two.timings(), {"w1": [], "w2": []}
        rounds = [measure_round(one_a, one_b, two, requests, args, cpu_windows) for _ in range(args.repeats)]
        shares = gather_share(before, two.timings())
    finally:
        for replica in replicas:
            replica.shutdown()
        ray.shutdown()

    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return {
        "benchmark": "rollout",
        "command": " ".join(["python", *sys.argv]),
        "setup": {
            "model": args.model or f"tiny {args.arch} '{size}'", "pipeline": pipeline, "height": args.height,
            "width": args.width, "steps": args.steps, "samples_per_request": args.batch, "cfg_branches": 2,
            "decode_batch_size": args.decode_batch_size,
            "cfg_policy": policy.name,
            "sde_type": "sde", "threads_per_rank": 1, "repeats": args.repeats,
            "throughput_requests_per_round": args.throughput_requests, "cpus": os.cpu_count(),
            "load_average_before": load_before, "torch": torch.__version__, "ray": ray.__version__,
            "python": platform.python_version(),
        },
        "latency": {
            "w1_batched_cfg_s_per_image": median["w1_batched_cfg_s_per_image"],
            "w2_s_per_image": median["w2_s_per_image"],
            "speedup": median["latency_speedup"],
            "goal": LATENCY_GOAL, "limit": LATENCY_LIMIT, "goal_met": median["latency_speedup"] >= LATENCY_GOAL,
        },
        "throughput": {
            "two_w1_replicas_images_per_s": median["two_w1_replicas_images_per_s"],
            "one_w2_replica_images_per_s": median["one_w2_replica_images_per_s"],
            "ratio": median["throughput_ratio"],
            "goal": THROUGHPUT_GOAL, "goal_met": median["throughput_ratio"] >= THROUGHPUT_GOAL,
        },
        "all_gather": {"share_of_step_time": statistics.mean(shares), "per_rank": shares},
        "latency_cpu": {name: cpu_use(windows, args.repeats * args.batch, "image") for name, windows in cpu_windows.items()},
        "rounds": rounds,
        "note": "speedup and ratio are medians of per-round ratios (each round runs every configuration back to back)",
    }


def bench_sync(args: argparse.Namespace) -> dict:
    """Weight sync of a learner's rollout adapter to every rank of two W = 1 rollout replicas."""
    path = resolve_model_path(args.model, args.cache_dir, size=args.size or "small")
    load_before = os.getloadavg()[0]
    ray = start_local_ray(num_cpus=6)
    from rayflow import reference  # imports ray: after its environment is set
    from rayflow.config import load_config
    from rayflow.learner.spec import LearnerSpec
    from rayflow.learner.worker import LearnerGroup
    from rayflow.rollout import RolloutReplica, RolloutRankSpec
    from rayflow.sync.weight_sync import WeightSync

    cfg = load_config(recipe("flowgrpo_tiny.yaml"), [
        f"model.path={path}", f"learner.lora_rank={args.lora_rank}", f"learner.lora_alpha={args.lora_rank}",
        "algorithm.prompts_per_step=1", "algorithm.group_size=2", "learner.micro_batch_size=2",
        "rollout.micro_batch_size=2", "sampling.num_steps=2", f"sync.bucket_mb={args.bucket_mb}", "trainer.output_dir=/tmp/rayflow-bench",
    ])
    batch, _ = reference.rollout(reference.build_run(cfg))  # one small batch to train on between pushes
    learners = LearnerGroup(LearnerSpec.from_config(cfg), name="bench-learner")
    results = {}
    try:
        for mode in ("lora", "merged"):
            mcfg = dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, mode=mode))
            spec = RolloutRankSpec.from_config(mcfg)
            replicas = [RolloutReplica(spec, RolloutConfig(), name=f"bench-sync-{mode}-{i}") for i in range(2)]
            for replica in replicas:
                replica.wait_ready()
            sync = WeightSync(mcfg.sync, spec, replicas, name=f"bench-sync-{mode}")
            try:
                results[mode] = measure_sync(ray, learners, sync, replicas, batch, args.repeats)
            finally:
                sync.shutdown()
                for replica in replicas:
                    replica.shutdown()
    finally:
        learners.shutdown()
        ray.shutdown()
    lora, merged = results["lora"], results["merged"]
    return {
        "benchmark": "sync",
        "command": " ".join(["python", *sys.argv]),
        "setup": {
            "model": "tiny Qwen-Image '" + (args.size or 'small') + "'", "lora_rank": args.lora_rank, "bucket_mb": args.bucket_mb,
            "receivers": "2 rollout ranks (two W = 1 replicas) + the sync actor, gloo on loopback",
            "repeats": args.repeats, "cpus": os.cpu_count(), "load_average_before": load_before,
            "torch": torch.__version__, "ray": ray.__version__,
        },
        "lora": lora,
        "merged": merged,
        "merged_over_lora_bytes": merged["bytes"] / lora["bytes"],
        "goals": {
            "sync_over_raw_broadcast_at_most": SYNC_OVER_RAW_GOAL,
            "lora_met": lora["sync_over_raw_broadcast"] <= SYNC_OVER_RAW_GOAL,
            # Merged mode also folds the adapter into the weights (compute a raw broadcast does not do).
            "merged_transfer_met": merged["broadcast_over_raw_broadcast"] <= SYNC_OVER_RAW_GOAL,
            "learner_blocked": "push_s against copy_s, one copy of the tensors on the learner",
        },
        "note": "one warm-up round dropped; ratios of the best of the repeats (medians beside); sync_s = sync_copy_s (the actor's copy of a push, straight into its buckets; "
                "merged mode: folding too) + sync_broadcast_s (notifying receivers, the bucket broadcasts, receivers "
                "verifying and staging); raw_broadcast_s is one torch.distributed broadcast of the same bytes on the same "
                "group, the receivers already waiting in it",
    }


def measure_sync(ray, learners, sync, replicas, batch, repeats: int) -> dict:
    """Train a step, push, wait for the broadcast; then a raw broadcast of the same bytes on the same group."""
    import torch.distributed  # noqa: F401

    rows = []
    for _ in range(repeats + 1):  # the first round warms up (first-touch allocations, lazy imports)
        learners.get(learners.train_step(batch))
        timing = learners.get(learners.push_weights(sync.actor))[0]
        report = sync.wait(timing["version"], timeout_s=300)
        n = report.bytes // 4
        workers = [w for r in replicas for w in r.workers]
        receives = [w.__ray_call__.remote(_receive_raw, n) for w in workers]

        def raw(actor, n=n, receives=receives):
            buffer = torch.zeros(n)
            start = time.perf_counter()
            actor.group.broadcast(buffer, src=0)
            ray.get(receives)
            return time.perf_counter() - start

        raw_s = ray.get(sync.actor.__ray_call__.remote(raw))
        copy_s = ray.get(learners.workers[0].__ray_call__.remote(_time_one_copy))
        rows.append({"bytes": report.bytes, "sync_s": report.seconds, "sync_copy_s": report.copy_s,
                     "sync_broadcast_s": report.broadcast_s, "raw_broadcast_s": raw_s,
                     "learner_push_s": timing["push_s"], "learner_gather_s": timing["gather_s"], "copy_s": copy_s})
    rows = rows[1:]
    # Gloo broadcasts on this 2-core machine are bimodal (the same bytes take ~15 or ~65 ms depending on
    # how the three processes get scheduled), raw and sync alike. Delays only ever add time, so the
    # minimum over repeats estimates each cost; the medians are reported beside it.
    best = {k: min(r[k] for r in rows) for k in rows[0]}
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "bytes": int(best["bytes"]),
        "best": best,
        "median": median,
        "sync_over_raw_broadcast": best["sync_s"] / best["raw_broadcast_s"],
        "broadcast_over_raw_broadcast": best["sync_broadcast_s"] / best["raw_broadcast_s"],
        "median_sync_over_raw_broadcast": median["sync_s"] / median["raw_broadcast_s"],
        "learner_push_over_one_copy": median["learner_push_s"] / median["copy_s"],
        "rounds": rows,
    }


def _receive_raw(worker, numel: int) -> None:
    """On a rollout rank: join one raw broadcast of `numel` float32 values on the weight-sync group."""
    worker.sync_group.broadcast(torch.empty(numel), src=0)


def _time_one_copy(worker) -> float:
    """On a learner rank: the time one copy of the rollout adapter takes (the push's reference cost)."""
    tensors = worker.backend.adapter_weights(worker.backend.rollout_adapter_name)
    start = time.perf_counter()
    [t.clone() for t in tensors.values()]
    return time.perf_counter() - start


IDLE_GAPS_S = (0.0, 0.01, 0.1)
BUSY_WAIT_S = 0.1


def idle_penalty(cfg, repeats: int = 15) -> dict:
    """What idling costs this machine's next compute, which the synchronous distributed run pays and the reference
    does not: there rollout and learner each sleep while the other works, while the reference's one process never
    sleeps. Times one rollout step's worth of the recipe's transformer forwards (CFG branches x denoising steps, one
    thread, in this process) right after sleeping each of IDLE_GAPS_S, and right after busy-waiting BUSY_WAIT_S (the
    core kept busy, never idle); medians of `repeats`."""
    from rayflow import reference

    model, s = reference.build_run(cfg).model, cfg.sampling
    batch = cfg.rollout.micro_batch_size
    latents, _ = model.prepare_latents(list(range(batch)), s.height, s.width)
    cond = model.encode_prompt(["a photo"] * batch)
    timestep = model.schedule(s.num_steps, s.height, s.width).timesteps[0]
    forwards = s.num_steps * (2 if s.guidance_scale > 1 else 1)

    def burst() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(forwards):
                model.predict_velocity(latents, timestep, cond, s.height, s.width)
        return time.perf_counter() - start

    def busy_wait(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def median_burst(wait) -> float:
        rounds = []
        for _ in range(repeats):
            wait()
            rounds.append(burst())
        return statistics.median(rounds)

    burst()  # warm-up
    seconds = {str(gap): median_burst(lambda gap=gap: time.sleep(gap)) for gap in IDLE_GAPS_S}
    after_busy_wait = median_burst(lambda: busy_wait(BUSY_WAIT_S))
    return {"forwards_per_burst": forwards, "batch": batch, "burst_s_after_idle_s": seconds,
            "slowdown_after_longest_idle": seconds[str(IDLE_GAPS_S[-1])] / seconds[str(IDLE_GAPS_S[0])],
            "burst_s_after_busy_wait_s": {str(BUSY_WAIT_S): after_busy_wait},
            "slowdown_after_busy_wait": after_busy_wait / seconds[str(IDLE_GAPS_S[0])]}


def cpu_use(windows: list[tuple[process_cpu.Snapshot, process_cpu.Snapshot]], units: int, unit: str) -> dict:
    """CPU seconds per `unit` (a step, an image) by process role over `windows` that did `units` of them, and the
    shortest time per unit this machine's cores allow at that CPU."""
    roles: dict[str, float] = {}
    for before, after in windows:
        for role, seconds in process_cpu.cpu_by_role(before, after).items():
            roles[role] = roles.get(role, 0.0) + seconds / units
    total, cores = sum(roles.values()), os.cpu_count() or 1
    busy = statistics.mean(process_cpu.busy_fraction(before, after) for before, after in windows)
    return {f"per_{unit}_s": dict(sorted(roles.items(), key=lambda item: -item[1])), f"total_per_{unit}_s": total,
            "cores": cores, f"least_{unit}_s": total / cores, "cores_busy": busy}


def bench_pipeline(args: argparse.Namespace) -> dict:
    """Steady-state step time of the tiny recipe's shape: max_staleness 0 against 1, and synchronous
    mode against the single-process reference trainer."""
    load_before = os.getloadavg()[0]
    from rayflow.config import load_config
    from rayflow.distributed.resources import required_cpus

    # No evaluation at start either (the shapes recipes have one): it runs inside trainer.run(), so inside the window
    # of each configuration's `cpu` (CPU per step), though outside its step times.
    overrides = [f"trainer.total_steps={args.steps}", "trainer.eval_every=0", "trainer.eval_at_start=false",
                 "trainer.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false", *args.overrides]
    cfg = load_config(args.recipe, [*overrides, "trainer.output_dir=/tmp/rayflow-bench/reference", "trainer.resume=never"],
                      key="--recipe")
    torch.set_num_threads(1)  # as one rank of the distributed run
    from rayflow import reference

    variants = {f"max_staleness_{k}": [f"async.max_staleness={k}"] for k in (0, 1)}
    # Side by side: the learners fetching a batch's trajectories when its train step starts, as before prefetching.
    variants["max_staleness_0_no_prefetch"] = ["async.max_staleness=0", "learner.prefetch=false"]
    disaggregated_devices = cfg.rollout.num_replicas * cfg.rollout.cfg_parallel_size + cfg.learner.world_size
    if args.placement == "colocated":  # each device a rollout and a learner rank, with the CPUs of one rank
        for devices in args.colocated_devices or [disaggregated_devices]:
            variants[f"colocated_{devices}"] = [
                "placement.mode=colocated", "async.max_staleness=0", f"learner.world_size={devices}",
                f"rollout.num_replicas={devices // cfg.rollout.cfg_parallel_size}",
                f"placement.cpus_per_device={cfg.learner.cpus_per_rank}"]
    run_cfgs = {name: load_config(args.recipe, [*overrides, *variant, f"trainer.output_dir=/tmp/rayflow-bench/{name}",
                                                "trainer.resume=never"], key="--recipe")
                for name, variant in variants.items()}
    cpus = max(required_cpus(c) for c in run_cfgs.values())
    ray = start_local_ray(num_cpus=max(os.cpu_count() or 1, int(cpus + 0.999)))
    from rayflow.driver.trainer import Trainer  # imports ray: after its environment is set

    # Every round runs each configuration once (the reference trainer in this process), in the reverse order of
    # the round before: a machine that speeds up or slows down during the benchmark favours no configuration.
    runs, ref_steps, order = {name: [] for name in run_cfgs}, [], ["reference", *run_cfgs]
    cpu_windows: dict[str, list[tuple[process_cpu.Snapshot, process_cpu.Snapshot]]] = {name: [] for name in order}
    run_windows: dict[str, list[tuple[float, float]]] = {name: [] for name in run_cfgs}  # wall clock, for Ray's events
    try:
        for round_ in range(args.rounds):
            for name in (order if round_ % 2 == 0 else order[::-1]):
                run_cfg = cfg if name == "reference" else run_cfgs[name]
                shutil.rmtree(run_cfg.trainer.output_dir, ignore_errors=True)
                if name == "reference":
                    before = process_cpu.snapshot()
                    ref_steps += reference.train(cfg, log=lambda *_: None)[1][args.warmup:]
                    cpu_windows[name].append((before, process_cpu.snapshot()))
                    continue
                trainer = Trainer(run_cfg)
                try:
                    before, started = process_cpu.snapshot(), time.time()  # the steps only, not the actors' start-up
                    runs[name] += trainer.run()[args.warmup:]
                    cpu_windows[name].append((before, process_cpu.snapshot()))
                    run_windows[name].append((started, time.time()))
                finally:
                    trainer.shutdown()
        events = ray.timeline()  # every actor call's execution, for the synchronous steps' critical path
    finally:
        ray.shutdown()

    idle = idle_penalty(cfg)

    def median(history: list[dict], key: str) -> float:
        return statistics.median(h[key] for h in history)

    def by_round(steps: list) -> list[list]:  # every round contributes the same number of steps, in round order
        n = len(steps) // args.rounds
        return [steps[i * n:(i + 1) * n] for i in range(args.rounds)]

    def busy_s(history: list[dict], role: str) -> float:  # a step's seconds with the role busy (driver's view)
        return statistics.median(h["perf/step_s"] * (1 - h[f"perf/{role}_idle"]) for h in history)

    sync_s, async_s, ref_s = (median(runs["max_staleness_0"], "perf/step_s"), median(runs["max_staleness_1"], "perf/step_s"),
                              statistics.median(h.seconds for h in ref_steps))
    phases = {"reference": {"rollout_s": statistics.median(h.rollout_seconds for h in ref_steps),
                            "learn_s": statistics.median(h.seconds - h.rollout_seconds for h in ref_steps)}}
    for name, history in runs.items():
        phases[name] = {"rollout_busy_s": busy_s(history, "rollout"), "learner_busy_s": busy_s(history, "learner")}
        if not name.startswith("max_staleness_1"):  # the roles take turns: the rest of the step is neither's
            phases[name]["neither_busy_s"] = statistics.median(
                h["perf/step_s"] * (h["perf/rollout_idle"] + h["perf/learner_idle"] - 1) for h in history)
    # Entry i of synchronous_steps is train step i + 2: the warm-up's steps are left out as from the step times.
    after_warmup = slice(max(args.warmup - 1, 0), None)
    chains = {name: [s for start, end in windows
                     for s in critical_path.synchronous_steps(critical_path.task_spans(events, start, end))[after_warmup]]
              for name, windows in run_windows.items() if name.startswith("max_staleness_0")}
    colocated = {}
    for name in [n for n in runs if n.startswith("colocated_")]:
        colocated_s = median(runs[name], "perf/step_s")
        colocated[name] = {"step_s": colocated_s, "speedup_over_max_staleness_0": sync_s / colocated_s,
                           "speedup_over_max_staleness_1": async_s / colocated_s}
    return {
        "benchmark": "pipeline",
        "command": " ".join(["python", *sys.argv]),
        "setup": {"recipe": args.recipe, "overrides": overrides, "steps": args.steps, "warmup_steps_dropped": args.warmup,
                  "rounds": args.rounds,
                  "batch": cfg.algorithm.batch_size, "cpus": os.cpu_count(), "load_average_before": load_before,
                  "torch": torch.__version__, "ray": ray.__version__},
        "step_s": {"max_staleness_0": sync_s, "max_staleness_1": async_s, "reference": ref_s},
        "overlap_speedup": sync_s / async_s,
        "orchestration_overhead": sync_s / ref_s - 1,
        "prefetch": {"step_s_without": median(runs["max_staleness_0_no_prefetch"], "perf/step_s"),
                     "overhead_without": median(runs["max_staleness_0_no_prefetch"], "perf/step_s") / ref_s - 1,
                     "fetch_s": {name: median(v, "perf/fetch_s") for name, v in runs.items()},
                     "prefetched": {name: median(v, "perf/prefetched") for name, v in runs.items()}},
        "phases": phases,
        "critical_path": {name: critical_path.summarize(steps) for name, steps in chains.items()},
        "step_s_by_round": {"reference": [statistics.median(h.seconds for h in steps) for steps in by_round(ref_steps)],
                            **{name: [median(steps, "perf/step_s") for steps in by_round(v)] for name, v in runs.items()}},
        "idle": {name: {"rollout": median(v, "perf/rollout_idle"), "learner": median(v, "perf/learner_idle")}
                 for name, v in runs.items() if not name.startswith("colocated")},
        "disaggregated_devices": disaggregated_devices,
        "staleness_mean_at_1": statistics.mean(h["staleness/mean"] for h in runs["max_staleness_1"]),
        "colocated": colocated,
        "idle_penalty": idle,
        "cpu": {name: cpu_use(windows, args.rounds * args.steps, "step") for name, windows in cpu_windows.items()},
        "goals": {"overlap_speedup_at_least": PIPELINE_OVERLAP_GOAL, "overlap_met": sync_s / async_s >= PIPELINE_OVERLAP_GOAL,
                  "overhead_at_most": PIPELINE_OVERHEAD_GOAL, "overhead_met": sync_s / ref_s - 1 <= PIPELINE_OVERHEAD_GOAL,
                  "idle_at_1_at_most": PIPELINE_IDLE_GOALS,
                  "idle_at_1_met": all(median(runs["max_staleness_1"], f"perf/{role}_idle") <= limit
                                       for role, limit in PIPELINE_IDLE_GOALS.items())},
        "note": "medians of per-step wall time after warm-up; the reference runs in this process with one thread",
    }


STARTUP_GOAL_S = 15.0


def bench_startup(args: argparse.Namespace) -> dict:
    """Seconds from the command to the end of its first step, the recipe run as a user runs it (a fresh
    process, a local Ray, the tiny model already cached by a first run), with the launcher's per-phase
    breakdown (its "startup:" line); and seconds from its last line ("done:") to its exit, what a user waits for
    after the run has ended."""
    import collections
    import re
    import subprocess
    import tempfile

    def seconds_by_name(text: str) -> dict[str, float]:  # "ray 5.1s, checks 0.0s" -> {"ray": 5.1, "checks": 0.0}
        return {name.strip(): float(s) for name, s in re.findall(r"([a-z ]+) ([0-9.]+)s", text)}

    load_before = os.getloadavg()[0]  # before the runs, which load the machine themselves
    command = [sys.executable, recipe(args.recipe_script), "--config", args.config, "trainer.total_steps=1", "trainer.eval_every=0",
               "trainer.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false", *args.overrides]
    runs = []
    for attempt in range(args.repeats + 1):  # the first run builds and caches the tiny model
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            proc = subprocess.Popen([*command, f"trainer.output_dir={out}"], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            phases, learner_rank_0, first_step_s, done_at = None, None, None, None
            tail = collections.deque(maxlen=20)  # the run's last lines, to say why it failed
            for line in proc.stdout:
                tail.append(line)
                if "startup: " in line:
                    phases = seconds_by_name(line.split("startup: ")[1])
                elif "startup of learner rank 0: " in line:
                    learner_rank_0 = seconds_by_name(line.split("startup of learner rank 0: ")[1])
                elif first_step_s is None and re.search(r"rayflow INFO step 1 ", line):
                    first_step_s = time.perf_counter() - start
                elif done_at is None and re.search(r"rayflow INFO done: ", line):
                    done_at = time.perf_counter()
            if proc.wait() != 0 or first_step_s is None or done_at is None:
                raise RuntimeError(f"{' '.join(command)} failed (exit {proc.returncode}); its last lines:\n"
                                   + "".join(tail))
            end_s = time.perf_counter() - done_at
        # Each run as it ends (as bench.py gpu prints each phase): a bench stopped part-way keeps what it measured.
        print(f"startup run {attempt}{' (builds the model cache, not counted)' if not attempt else ''}: "
              f"first step {first_step_s:.1f}s, phases {phases}, learner rank 0 {learner_rank_0}, end {end_s:.2f}s",
              file=sys.stderr, flush=True)
        if attempt:
            runs.append({"first_step_s": first_step_s, "phases": phases, "learner_rank_0": learner_rank_0,
                         "end_s": end_s})
    best = min(runs, key=lambda r: r["first_step_s"])
    median = statistics.median(r["first_step_s"] for r in runs)
    return {
        "benchmark": "startup", "command": " ".join(command), "cpus": os.cpu_count(),
        "load_average_before": load_before, "first_step_s": {"median": median, "min": best["first_step_s"]},
        "end_s": {"median": statistics.median(r["end_s"] for r in runs)},
        "phases_of_the_fastest": best["phases"], "runs": runs,
        "goals": {"first_step_at_most_s": STARTUP_GOAL_S, "met": median <= STARTUP_GOAL_S},
        "note": "phases from the launcher's startup line (learner_rank_0: its next line, rank 0's setup by part); "
                "the rest of first_step_s is the interpreter, imports, "
                "config checks and the first step itself; end_s: from the run's `done:` line to its process's exit "
                "(the actors', Ray's and the worker zygote's shutdown, then the interpreter's)",
    }


def _subcommand(sub, name: str, help: str, model: bool) -> argparse.ArgumentParser:
    """A benchmark's parser with the shared options: --json, and the model ones if it builds replicas."""
    parser = sub.add_parser(name, help=help)
    parser.add_argument("--json", default=None, help="write the results here (also printed)")
    if model:
        parser.add_argument("--model", default=None, help="a pipeline directory; default: the tiny offline model of --size")
        parser.add_argument("--size", default=None, help="tiny model size when --model is not given (default: small)")
        parser.add_argument("--cache-dir", default="~/.cache/rayflow")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    rollout = _subcommand(sub, "rollout", "CFG-parallel rollout: latency, throughput, all_gather share", model=True)
    rollout.add_argument("--arch", default="qwen_image", choices=ARCHS,
                         help="family of the tiny model when --model is not given (its own CFG policy is used)")
    rollout.add_argument("--height", type=int, default=192)
    rollout.add_argument("--width", type=int, default=192)
    rollout.add_argument("--steps", type=int, default=20)
    rollout.add_argument("--batch", type=int, default=4, help="samples per request")
    rollout.add_argument("--repeats", type=int, default=3)
    rollout.add_argument("--throughput-requests", type=int, default=4, help="requests per throughput round")
    rollout.add_argument("--decode-batch-size", type=int, default=0,
                         help="sampling.decode_batch_size at both W (0: rank 0 decodes each request's batch at once)")
    sync = _subcommand(sub, "sync", "weight sync: against a raw broadcast, lora vs merged bytes, learner blocking", model=True)
    sync.add_argument("--lora-rank", type=int, default=128)
    sync.add_argument("--bucket-mb", type=float, default=64.0)
    sync.add_argument("--repeats", type=int, default=5)
    pipeline = _subcommand(sub, "pipeline", "step time: max_staleness 0 vs 1, and against the reference trainer", model=False)
    pipeline.add_argument("--recipe", default=recipe("flowgrpo_tiny.yaml"), help="a recipe YAML (default: FlowGRPO on the tiny model)")
    pipeline.add_argument("--steps", type=int, default=20)
    pipeline.add_argument("--warmup", type=int, default=4, help="first steps left out of the medians")
    pipeline.add_argument("--rounds", type=int, default=1,
                          help="run every configuration this many times, alternating the order; medians over all rounds' steps")
    pipeline.add_argument("--placement", default="disaggregated", choices=("disaggregated", "colocated"),
                          help="colocated: also run placement.mode=colocated (synchronous) on --colocated-devices devices")
    pipeline.add_argument("--colocated-devices", type=int, nargs="*", default=None,
                          help="device counts of the colocated runs (default: the disaggregated run's rollout + learner ranks)")
    pipeline.add_argument("overrides", nargs="*", help="extra dotlist overrides for the recipe")
    for name, help, steps in (("costs", "the simulator's costs on this machine (reference pieces, one thread)", 8),
                              ("simulator", "tools/simulate.py's model against real runs at 1-2 replicas x staleness 0-1", 16)):
        costs = _subcommand(sub, name, help, model=False)
        costs.add_argument("--recipe", default=recipe("flowgrpo_tiny.yaml"))
        costs.add_argument("--steps", type=int, default=steps)
        costs.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
        costs.add_argument("overrides", nargs="*", help="extra dotlist overrides for the recipe")
    startup = _subcommand(sub, "startup", "seconds from the command to the end of its first step, by phase, and from "
                                          "the run's end to its exit", model=False)
    startup.add_argument("--recipe-script", default="flowgrpo_qwen_image.py", help="a recipe launcher in recipes/")
    startup.add_argument("--config", default=recipe("flowgrpo_tiny.yaml"), help="the recipe YAML it runs (default: the tiny model's)")
    startup.add_argument("--repeats", type=int, default=3)
    startup.add_argument("overrides", nargs="*", help="extra dotlist overrides for the recipe")
    learning_bench.add_arguments(_subcommand(sub, "learning", "FlowGRPO, its 2-step window, DiffusionNFT x staleness 0, 1 on the shapes world",
                                             model=False))
    gradient_bench.add_arguments(_subcommand(sub, "gradients", "gradient noise scale of FlowGRPO, its variants and DiffusionNFT on the shapes world",
                                             model=False))
    trajectory_bench.add_arguments(_subcommand(sub, "trajectories", "one request's trajectories through Ray's pickling: bytes, seconds",
                                               model=False))
    gpu_bench.add_arguments(_subcommand(sub, "gpu", "one GPU: rollout vs diffusers, learner vs bare, bf16 log-prob drift, memory vs plan",
                              model=False))
    argv = sys.argv[1:] if argv is None else list(argv)
    rest, overrides = split_overrides(argv)  # after `--recipe A B` or `--staleness 0 1` too, which argparse gives them to
    if rest[:1] == ["gpu"]:  # its KEY=VALUE pairs are --overrides' values: it takes no positional overrides
        args = parser.parse_args(argv)
    else:
        args = parser.parse_args(rest)
        if overrides:
            if not hasattr(args, "overrides"):
                parser.error(f"bench.py {args.benchmark} takes no overrides; got {' '.join(overrides)}")
            args.overrides = [*args.overrides, *overrides]
    # Named before any work: the figures are printed, but the file is what is kept.
    check_output_dirs(parser, {"--json": getattr(args, "json", None)})
    return args


BENCHMARKS = {"rollout": bench_rollout, "sync": bench_sync, "pipeline": bench_pipeline, "gpu": gpu_bench.run,
              "startup": bench_startup, "costs": sim_bench.bench_costs, "simulator": lambda args: sim_bench.bench_simulator(args, start_local_ray),
              "learning": lambda args: learning_bench.bench_learning(args, start_local_ray), "trajectories": trajectory_bench.run,
              "gradients": gradient_bench.run}


COUNT_MINIMUMS = {"repeats": 1, "rounds": 1, "steps": 1, "batch": 1, "learner_batch": 2, "throughput_requests": 2,
                  "warmup": 0, "decode_batch_size": 0, "lora_rank": 1, "threads": 1, "eval_every": 1, "batches": 3,
                  "height": 1, "width": 1, "bucket_mb": 1e-3, "depth": 1, "size": 1, "colocated_devices": 1}
"""The least each count option may be, in whichever benchmark has it (learner_batch: one group, advantages need two;
batches: the gradient noise scale's jackknife needs three; throughput_requests: one for each W = 1 replica)."""


def check_counts(args: argparse.Namespace) -> None:
    """Name a count below what its benchmark can run, before any work (a default of None is the benchmark's own)."""
    for name, minimum in COUNT_MINIMUMS.items():
        value = getattr(args, name, None)
        values = value if isinstance(value, list) else [value]  # --colocated-devices 1 2
        if any(isinstance(v, (int, float)) and v < minimum for v in values):
            allowed = "numbers > 0" if isinstance(minimum, float) else f"integers >= {minimum}"
            raise SystemExit(f"error: --{name.replace('_', '-')}: got {value}; allowed: {allowed}")
    steps, warmup = getattr(args, "steps", None), getattr(args, "warmup", None)
    if steps is not None and warmup is not None and warmup >= steps:  # the medians would be of no step
        raise SystemExit(f"error: --warmup: got {warmup}; allowed: fewer than --steps ({steps}), the steps measured")
    requests = getattr(args, "throughput_requests", None)
    if requests is not None and requests % 2:
        # The two W = 1 replicas take turns: with an odd count one serves a request more, the pair's time is the
        # busier one's, and the W = 2 replica's throughput ratio reads higher than it is (1.33x at 3 for equal ones).
        raise SystemExit(f"error: --throughput-requests: got {requests}; allowed: an even integer >= 2 "
                         "(split evenly over the two W = 1 replicas)")


RECIPE_FLAGS = {"recipe": "--recipe", "config": "--config"}
"""Options naming one recipe YAML (gradients' --recipe takes several and checks them itself)."""


def check_recipes(args: argparse.Namespace) -> None:
    """Name a recipe option whose file does not exist, before any work (a Ray start, a subprocess)."""
    for name, flag in RECIPE_FLAGS.items():
        path = getattr(args, name, None)
        if isinstance(path, str) and not os.path.isfile(path):
            raise SystemExit(f"error: {flag}: got {path!r}; allowed: an existing recipe YAML file")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_counts(args)
    check_recipes(args)
    try:
        result = BENCHMARKS[args.benchmark](args)
    except ConfigError as e:  # a recipe key or override to fix: one line, as the recipes' launchers print it
        sys.exit(f"error: {e}")
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
