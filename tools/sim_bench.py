"""bench.py costs and bench.py simulator: the costs the simulator (rayflow/planning/simulator.py) is fed
with, measured on this machine, and the simulator checked against real runs.

costs: the tiny recipe's (flowgrpo_tiny.yaml) pieces timed in one process with one thread, as one actor of a run has:
one rollout request (rollout.micro_batch_size samples), scoring it, and one batch's optimizer steps
(the reference trainer's own functions). Medians after warm-up.

simulator: the costs above, then real runs (the distributed Trainer) at rollout.num_replicas x
async.max_staleness in (1, 0), (1, 1), (2, 0), (2, 1), (3, 1). The single-replica runs calibrate what
the reference cannot measure: the weight push and broadcast (perf/push_s and perf/sync_s of the
synchronous run), the orchestration's overhead per batch on the learner's path (the learner-bound
asynchronous run) and per request (the synchronous run). The three other shapes are predicted with
nothing fitted to them, and compared with their medians.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable

import torch

from rayflow.config import RayflowConfig, load_config
from rayflow.planning.simulator import Costs, Shape, simulate

SIMULATOR_ERROR_GOAL = 0.15
SHAPES = ((1, 0), (1, 1), (2, 0), (2, 1), (3, 1))
"""(rollout.num_replicas, async.max_staleness) of the validation runs; the first two calibrate."""


def run_overrides(args) -> list[str]:
    return [f"trainer.total_steps={args.steps}", "trainer.eval_every=0", "trainer.save_every=0",
            "logging.progress_bar=false", "logging.tensorboard=false", "trainer.resume=never", *args.overrides]


def shape_of(cfg: RayflowConfig, cores: float | None) -> Shape:
    return Shape(
        batch_size=cfg.algorithm.batch_size, group_size=cfg.algorithm.group_size,
        micro_batch_size=cfg.rollout.micro_batch_size, replicas=cfg.rollout.num_replicas,
        reward_workers=cfg.reward.num_workers, max_staleness=cfg.async_.max_staleness, cores=cores,
    )


def measure_costs(cfg: RayflowConfig, steps: int, warmup: int) -> dict[str, float]:
    """Seconds per rollout request, per scored request and per trained batch, on one thread."""
    from rayflow import reference

    if cfg.rollout.cfg_parallel_size != 1:
        raise ValueError(f"rollout.cfg_parallel_size: got {cfg.rollout.cfg_parallel_size}; costs are measured at 1")
    torch.set_num_threads(1)
    run = reference.build_run(cfg)
    rollout_s, reward_s, train_s = [], [], []
    for step in range(steps):
        trajectories = []
        for request in reference.next_requests(run):
            share = len(request.seeds) / cfg.rollout.micro_batch_size
            start = time.perf_counter()
            sampled = reference.sample(run, request)
            sampled_at = time.perf_counter()
            run.reward.score(sampled)
            if step >= warmup:
                rollout_s.append((sampled_at - start) / share)
                reward_s.append((time.perf_counter() - sampled_at) / share)
            trajectories += sampled
        reference.assign(run, trajectories)
        start = time.perf_counter()
        reference.learn(run, trajectories)
        if step >= warmup:
            train_s.append(time.perf_counter() - start)
    return {"rollout_request_s": statistics.median(rollout_s), "reward_request_s": statistics.median(reward_s),
            "train_batch_s": statistics.median(train_s)}


def bench_costs(args) -> dict:
    cfg = load_config(args.recipe, [*run_overrides(args), "trainer.output_dir=/tmp/rayflow-bench/costs"], key="--recipe")
    measured = measure_costs(cfg, args.steps, args.warmup)
    return {"benchmark": "costs", **measured,
            "setup": {"recipe": args.recipe, "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
                      "cpus": os.cpu_count(), "torch": torch.__version__},
            "note": "one thread, one process (the reference trainer's functions); push, broadcast and the driver's "
                    "per-request overhead are not measured here (bench.py simulator calibrates them on a real run)"}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """An overhead fitted to a real run's step time, and whether the model could be made to equal it."""

    field: str
    value: float
    real_step_s: float
    model_step_s: float
    """The model's step time with `value`: equal to `real_step_s` when `matched`."""
    matched: bool

    def warning(self) -> str | None:
        if self.matched:
            return None
        why = ("with no overhead the model's step is already longer than the real one"
               if self.value == 0.0 else "even an overhead as long as the real step leaves the model's step shorter")
        return (f"warning: {self.field} could not be calibrated: {why} (model {self.model_step_s:.4f} s, real "
                f"{self.real_step_s:.4f} s); it is left at {self.value:.4f} s, and the predictions carry the difference")


CALIBRATION_TOLERANCE = 1e-3
"""Relative difference between the model's and the real step time within which a calibration matched."""


def _calibrate(costs: Costs, shape: Shape, real_step_s: float, field: str) -> Calibration:
    """The value of the overhead `field` in [0, real_step_s] that makes the model's step time equal `real_step_s`
    (bisection: the step time grows with it). Not matched when even 0 makes the model slower than the real step (the
    other costs already exceed it: the value is 0), or `real_step_s` leaves it faster: the bisection ended at a bound,
    and the figure must not pass for a fitted one."""
    def step_s(value: float) -> float:
        return simulate(dataclasses.replace(costs, **{field: value}), shape).step_s

    low, high = 0.0, real_step_s
    if step_s(low) > real_step_s * (1 + CALIBRATION_TOLERANCE):
        return Calibration(field, 0.0, real_step_s, step_s(0.0), matched=False)
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if step_s(mid) < real_step_s else (low, mid)
    value = (low + high) / 2
    model_step_s = step_s(value)
    return Calibration(field, value, real_step_s, model_step_s,
                       matched=abs(model_step_s / real_step_s - 1) <= CALIBRATION_TOLERANCE)


def bench_simulator(args, start_local_ray: Callable) -> dict:
    """Measured costs, a calibration run, then predicted against measured step time for the other shapes."""
    load_before = os.getloadavg()[0]
    base = run_overrides(args)
    measured = measure_costs(load_config(args.recipe, [*base, "trainer.output_dir=/tmp/rayflow-bench/costs"], key="--recipe"),
                             args.steps, args.warmup)
    configs = {
        (r, s): load_config(args.recipe, [*base, f"rollout.num_replicas={r}", f"async.max_staleness={s}",
                                          f"trainer.output_dir=/tmp/rayflow-bench/sim-r{r}-s{s}"], key="--recipe")
        for r, s in SHAPES
    }
    from rayflow.distributed.resources import required_cpus

    cores = float(os.cpu_count() or 1)
    ray = start_local_ray(num_cpus=max(int(cores), *(int(required_cpus(c) + 0.999) for c in configs.values())))
    from rayflow.driver.trainer import Trainer  # imports ray: after its environment is set

    real = {}
    try:
        for key, cfg in configs.items():
            shutil.rmtree(cfg.trainer.output_dir, ignore_errors=True)
            trainer = Trainer(cfg)
            try:
                history = trainer.run()[args.warmup:]
            finally:
                trainer.shutdown()
            real[key] = {tag: statistics.median(h[tag] for h in history)
                         for tag in ("perf/step_s", "perf/push_s", "perf/sync_s", "perf/rollout_idle", "perf/learner_idle")}
    finally:
        ray.shutdown()

    sync, overlapped = real[SHAPES[0]], real[SHAPES[1]]
    costs = Costs(**measured, push_s=sync["perf/push_s"], broadcast_s=max(0.0, sync["perf/sync_s"] - sync["perf/push_s"]))
    # The learner-bound asynchronous run fixes the overhead on the learner's path (its step is that path alone);
    # then the synchronous run, where every piece is in series, fixes the per-request overhead.
    calibrations = []
    for key, real_step_s, field in ((SHAPES[1], overlapped["perf/step_s"], "overhead_batch_s"),
                                    (SHAPES[0], sync["perf/step_s"], "overhead_request_s")):
        calibration = _calibrate(costs, shape_of(configs[key], cores), real_step_s, field)
        if calibration.warning():
            print(calibration.warning(), file=sys.stderr, flush=True)
        calibrations.append(calibration)
        costs = dataclasses.replace(costs, **{field: calibration.value})
    rows = []
    for key, cfg in configs.items():
        predicted = simulate(costs, shape_of(cfg, cores))
        rows.append({
            "replicas": key[0], "max_staleness": key[1], "calibration": key in SHAPES[:2],
            "real_step_s": real[key]["perf/step_s"], "predicted_step_s": predicted.step_s,
            "error": predicted.step_s / real[key]["perf/step_s"] - 1,
            "real_idle": {"rollout": real[key]["perf/rollout_idle"], "learner": real[key]["perf/learner_idle"]},
            "predicted_idle": {"rollout": predicted.rollout_idle, "learner": predicted.learner_idle},
        })
    worst = max(abs(r["error"]) for r in rows if not r["calibration"])
    return {
        "benchmark": "simulator",
        "setup": {"recipe": args.recipe, "overrides": base, "steps": args.steps, "warmup_steps_dropped": args.warmup,
                  "cores": cores, "load_average_before": load_before, "torch": torch.__version__, "ray": ray.__version__},
        "costs": dataclasses.asdict(costs),
        # A calibration not matched (the model slower than the real step with no overhead at all) is named here and on
        # stderr: its overhead is 0, not a fitted figure, and its shape's row shows the difference.
        "calibrations": [dataclasses.asdict(c) for c in calibrations],
        "calibrated": all(c.matched for c in calibrations),
        "shapes": rows,
        "worst_error_uncalibrated": worst,
        "goals": {"error_at_most": SIMULATOR_ERROR_GOAL, "met": worst <= SIMULATOR_ERROR_GOAL},
    }
