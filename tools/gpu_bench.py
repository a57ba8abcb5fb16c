"""`python tools/bench.py gpu`: rayflow on real compute against the bare diffusers/torch equivalents.

On one GPU, the published Qwen-Image architecture with random weights (rayflow.models.published;
the compute of the real model) at 512x512, 10 steps, true CFG 4.0, in bf16:

  rollout   images/s of a W = 1 RolloutReplica (Ray actor, SDE steps with log-probs) against diffusers'
            own QwenImagePipeline.__call__ at the same batch, steps, CFG and dtype (goal >= 0.95x); between
            them, the same RolloutRank in this process (no Ray), which splits the gap into the sampling loop
            with its synced weights (run with --sync-mode lora and merged) and the actor around it;
  learner   one FlowGRPO LearnerBackend.train_step against a bare loop of the same forwards (every CFG
            branch, every trained step), backwards and AdamW step on the same LoRA (goal <= 1.1x);
  logprob   |Δ log p| per step between the rollout's log-probs and the learner's replay of the same
            transitions at the same weights, mean and max, with CFG and without (verl-omni#280 reports
            2.2e-5 without and 4.7e-4 with CFG 4.5);
  memory    peak torch.cuda.max_memory_allocated of the in-process pipeline and of the learner step
            against the planner's estimate of a rollout rank and of a learner rank (rayflow.planning).

Phases run one after another and free the GPU between them (one 80 GB GPU holds one 20B model).
`--device cpu --tiny` runs every phase on the tiny offline model on CPU: a smoke test of the harness.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

ROLLOUT_GOAL, LEARNER_GOAL = 0.95, 1.1
PROMPTS = ("a red apple on a wooden table, studio light", "a cat",
           "two blue squares to the left of a small green triangle on a white background, flat colours",
           "a lighthouse at dusk, waves breaking on the rocks below")
"""Call k of a phase samples prompt k mod 4: their token counts differ, as a run's prompts do, so a compiled model
that recompiled for each new length would show in the timed calls (the first two are the warm-up)."""
PHASES = ("pipeline", "rank", "replica", "learner", "log_probs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="the tiny offline model (smoke test of the harness)")
    parser.add_argument("--depth", type=int, default=None, help="layer count override of the published model")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    parser.add_argument("--size", type=int, default=None, help="image side; default 512 (64 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps; default 10 (2 with --tiny)")
    parser.add_argument("--batch", type=int, default=4, help="images per rollout request and per pipeline call")
    parser.add_argument("--learner-batch", type=int, default=2, help="samples per learner step (one micro-batch, one group: >= 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-mode", default="lora", choices=["lora", "merged"],
                        help="the rollout's synced weights: a rank-64 LoRA slot (lora) or the folded linears, no LoRA (merged)")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES,
                        help="the phases to run (default: all); the rollout ratios need pipeline and replica or rank")
    parser.add_argument("--overrides", nargs="+", default=[], metavar="KEY=VALUE",
                        help="dotlist overrides of rayflow's run config in the rank, replica, learner and log-prob phases "
                             "(the pipeline phase is diffusers' own), e.g. model.compile=true model.attention_backend=cudnn")


def _config(args, path: str, guidance: float, batch: int):
    """The bench's run config: `batch` samples per rollout request and per learner micro-batch (one group,
    at least 2 samples: advantages compare group members)."""
    from rayflow.config import load_config

    group = max(batch, 2)
    return load_config(None, [
        f"model.path={path}", f"model.dtype={args.dtype}", f"sampling.height={args.size}", f"sampling.width={args.size}",
        f"sampling.num_steps={args.steps}", f"sampling.guidance_scale={guidance}", "sampling.negative_prompt=' '",
        "algorithm.name=flow_grpo", f"algorithm.group_size={group}", "algorithm.prompts_per_step=1",
        f"learner.micro_batch_size={group}", f"rollout.micro_batch_size={batch}",
        "learner.activation_checkpointing=true", "learner.lora_rank=64", "learner.lora_alpha=128", f"sync.mode={args.sync_mode}",
        f"learner.mixed_precision={'autocast' if args.dtype == 'bfloat16' else 'none'}", *args.overrides,
    ])


def _request(cfg, batch: int, first_seed: int):
    """Request k (first_seed = k·batch) of a phase: `batch` samples of PROMPTS[k mod 4]."""
    from rayflow.types import RolloutRequest

    prompt = PROMPTS[first_seed // batch % len(PROMPTS)]
    return RolloutRequest(f"gpu-bench-{first_seed}", [prompt] * batch, [0] * batch, [0] * batch,
                          list(range(first_seed, first_seed + batch)), cfg.sampling)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def _timed(fn, repeats: int, device: str) -> tuple[float, float]:
    """(median seconds of `repeats` calls, seconds of the two warm-up calls before them). The warm-up is where kernels
    are chosen, the allocator grows and, with model.compile, the blocks compile (for a first prompt length, then for
    any: two calls): what a run pays once."""
    _sync(device)
    start = time.perf_counter()
    fn()
    fn()
    _sync(device)
    warmup = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), warmup


def bench_pipeline(args, path: str) -> dict:
    """diffusers' own QwenImagePipeline.__call__ (through rayflow's loader, which only builds the weights)."""
    from rayflow.models import load_model

    cfg = _config(args, path, 4.0, args.batch)
    pipe = load_model(path, device=args.device, dtype=getattr(torch, args.dtype)).pipe

    prompts = itertools.cycle(PROMPTS)

    def call():
        pipe([next(prompts)] * args.batch, negative_prompt=[" "] * args.batch, true_cfg_scale=4.0, height=args.size,
             width=args.size, num_inference_steps=args.steps, generator=torch.Generator("cpu").manual_seed(0),
             output_type="pt")

    seconds, warmup = _timed(call, args.repeats, args.device)
    peak = _peak(args.device)
    return {"images_per_s": args.batch / seconds, "seconds_per_call": seconds, "warmup_s": warmup, "peak_bytes": peak,
            "planned_bytes": _planned(cfg, "rollout rank")}


class _OneRank:
    """The group of a replica of one rank, in this process: RolloutRank's TimedGroup gathers a group of one itself,
    so only the rank and size are read."""

    rank, size = 0, 1


def bench_rank(args, path: str) -> dict:
    """The replica's RolloutRank (its model, synced-weight slot and loop) in this process: the replica without Ray."""
    from rayflow.rollout.rank import RolloutRank
    from rayflow.rollout.spec import RolloutRankSpec

    cfg = _config(args, path, 4.0, args.batch)
    rank = RolloutRank(RolloutRankSpec.from_config(cfg), 0, 1)
    rank.join(_OneRank())
    seeds = iter(range(0, 10**6, args.batch))
    seconds, warmup = _timed(lambda: rank.generate(_request(cfg, args.batch, next(seeds))), args.repeats, args.device)
    del rank
    return {"images_per_s": args.batch / seconds, "seconds_per_request": seconds, "warmup_s": warmup}


def bench_replica(args, path: str) -> dict:
    """The same generation through a W = 1 RolloutReplica on a local Ray (SDE steps, log-probs, decode), started as a
    run starts its own: on a small CPU-only machine its worker is forked from a zygote holding the model code."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    from rayflow.config import RolloutConfig
    from rayflow.distributed.worker_imports import init_local_ray, stop_worker_zygote
    from rayflow.models.base import pipeline_class_of
    from rayflow.rollout import RolloutReplica, RolloutRankSpec

    cfg = _config(args, path, 4.0, args.batch)
    gpus = 1 if args.device == "cuda" else 0
    init_local_ray(pipeline_class_of(path), num_cpus=4, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    try:
        spec = RolloutRankSpec.from_config(cfg)
        replica = RolloutReplica(spec, RolloutConfig(cfg_parallel_size=1, gpus_per_rank=gpus), name="gpu-bench").wait_ready()
        seeds = iter(range(0, 10**6, args.batch))
        seconds, warmup = _timed(lambda: replica.generate(_request(cfg, args.batch, next(seeds))), args.repeats, "cpu")
        replica.shutdown()
    finally:
        ray.shutdown()
        stop_worker_zygote()
    return {"images_per_s": args.batch / seconds, "seconds_per_request": seconds, "warmup_s": warmup}


def _learner(cfg, device: str):
    import torch.distributed as dist

    from rayflow.distributed.process_group import Rendezvous, init_default_group
    from rayflow.learner.backend import LearnerBackend
    from rayflow.learner.spec import LearnerSpec
    from rayflow.distributed.parallelize import build_mesh

    if not dist.is_initialized():
        init_default_group(Rendezvous.on_this_node(), 0, 1, device)
    return LearnerBackend(LearnerSpec.from_config(cfg), build_mesh(torch.device(device), 1), torch.device(device))


def _rollouts(args, path: str, config):
    """Trajectories of one micro-batch with advantages (their values do not matter here), sampled by the
    single-process sampler on a model that is freed before the learner loads (one 20B model at a time)."""
    from rayflow.cfg.policy import guidance_policy
    from rayflow.models import load_model
    from rayflow.sampling.denoise import generate

    model = load_model(path, device=args.device, dtype=getattr(torch, args.dtype))
    with torch.no_grad():
        trajs = generate(model, _request(config, args.learner_batch, 0), guidance_policy(config.cfg))
    del model
    _free(args.device)
    return [dataclasses.replace(t, advantage=float(i % 2) - 0.5) for i, t in enumerate(trajs)]


def bench_learner(args, path: str) -> dict:
    """LearnerBackend.train_step against the bare forwards/backwards/AdamW of the same micro-batch."""
    from rayflow.models.lora import adapter_parameters
    from rayflow.learner.objective import _conds, _guided_velocity, _stack_latent

    cfg = _config(args, path, 4.0, args.learner_batch)
    trajs = _rollouts(args, path, cfg)
    backend = _learner(cfg, args.device)
    step_s, warmup = _timed(lambda: backend.train_step(trajs), args.repeats, args.device)
    peak = _peak(args.device)
    model, policy, params = backend.model, backend.policy, trajs[0].params
    optimizer = torch.optim.AdamW(list(adapter_parameters(model.transformer, "default").values()), lr=1e-6)

    def bare():
        conds = _conds(trajs, model.device)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=cfg.learner.mixed_precision == "autocast"):
            for j in params.resolved_sde_steps():
                x = _stack_latent(trajs, j, model.device)
                v = _guided_velocity(model, policy, x, trajs[0].timesteps[j], conds, params)
                (v.float().square().mean() / len(params.resolved_sde_steps())).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    bare_s, _ = _timed(bare, args.repeats, args.device)
    result = {"train_step_s": step_s, "warmup_s": warmup, "bare_forward_backward_s": bare_s, "ratio": step_s / bare_s,
              "goal": LEARNER_GOAL, "goal_met": step_s / bare_s <= LEARNER_GOAL, "peak_bytes": peak,
              "planned_bytes": _planned(cfg, "learner rank")}
    return result


def bench_log_probs(args, path: str) -> dict:
    """|Δ log p| between the rollout's log-probs and the learner's replay, per trained step, with and without CFG."""
    from rayflow.learner.objective import _conds, _guided_velocity, _stack_latent
    from rayflow.sampling.flow_sde import flow_step

    out = {}
    for label, guidance in (("cfg_4.0", 4.0), ("no_cfg", 1.0)):
        cfg = _config(args, path, guidance, args.learner_batch)
        trajs = _rollouts(args, path, cfg)
        backend = _learner(cfg, args.device)
        model, policy, params = backend.model, backend.policy, trajs[0].params
        conds = _conds(trajs, model.device)
        per_step = {}
        with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16,
                                             enabled=cfg.learner.mixed_precision == "autocast"):
            for j in params.resolved_sde_steps():
                x, x_next = _stack_latent(trajs, j, model.device), _stack_latent(trajs, j + 1, model.device)
                v = _guided_velocity(model, policy, x, trajs[0].timesteps[j], conds, params)
                _, log_prob, _, _ = flow_step(v, x, trajs[0].sigmas[j], trajs[0].sigmas[j + 1], sde_type=params.sde_type,
                                              noise_level=params.noise_level, prev_sample=x_next, sigma_max=trajs[0].sigmas[1])
                old = torch.stack([t.log_probs[j] for t in trajs]).to(log_prob.device)
                delta = (log_prob.float() - old.float()).abs()
                per_step[j] = {"mean": delta.mean().item(), "max": delta.max().item()}
        out[label] = {"per_step": per_step, "mean": statistics.mean(s["mean"] for s in per_step.values()),
                      "max": max(s["max"] for s in per_step.values())}
        del backend, model, conds  # the next guidance's learner loads after this one is freed
        _free(args.device)
    out["reference_verl_omni_280"] = {"no_cfg": 2.2e-5, "cfg_4.5": 4.7e-4}
    return out


def _planned(cfg, role: str) -> int:
    """The planner's bytes for one process of `role`, without the CUDA-context allowance (which
    max_memory_allocated does not see)."""
    from rayflow.planning.memory import plan_config

    plan, _ = plan_config(cfg)
    memory = next(r for r in plan if r.role == role)
    return sum(memory.resident.values()) + memory.peak_phase[1]


def _reported(phase: str, result: dict) -> dict:
    """Print a phase's figures as it ends: a run stopped at its time limit still leaves the phases it finished."""
    print(f"gpu bench {phase}: {json.dumps(result, default=str)}", flush=True)
    return result


def run(args: argparse.Namespace) -> dict:
    from rayflow.models.random_init import write_random_init_dir
    from rayflow.models.tiny import resolve_model_path

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here; use --device cpu --tiny for the smoke test")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.size = args.size or (64 if args.tiny else 512)
    args.steps = args.steps or (2 if args.tiny else 10)
    from rayflow.errors import ConfigError

    try:  # a bad --overrides entry stops here, named, before any model is built
        _config(args, "unused", 4.0, args.batch)
    except ConfigError as e:
        sys.exit(f"--overrides: {e}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            path, model = resolve_model_path(None, "~/.cache/rayflow"), "tiny offline Qwen-Image"
        else:
            path = write_random_init_dir("qwen_image", os.path.join(tmp, "qwen_image"), depth=args.depth)
            model = f"Qwen-Image published architecture, random weights, depth {args.depth or 'published (60)'}"
        benches = {"pipeline": bench_pipeline, "rank": bench_rank, "replica": bench_replica, "learner": bench_learner,
                   "log_probs": bench_log_probs}
        results = {}
        for phase in PHASES:  # each phase's models are freed when it returns: one 20B model on the GPU at a time
            if phase in args.phases:
                _free(args.device)
                results[phase] = _reported(phase, benches[phase](args, path))
    pipeline, rank, replica, learner = (results.get(p) for p in PHASES[:4])
    rollout = {"pipeline": pipeline, "rank": rank, "replica": replica}
    if pipeline and replica:
        ratio = replica["images_per_s"] / pipeline["images_per_s"]
        rollout.update(ratio=ratio, goal=ROLLOUT_GOAL, goal_met=ratio >= ROLLOUT_GOAL)
    if pipeline and rank:
        rollout["rank_ratio"] = rank["images_per_s"] / pipeline["images_per_s"]
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    return {
        "benchmark": "gpu",
        "command": " ".join(["python", *sys.argv]),
        "setup": {"model": model, "device": device, "dtype": args.dtype, "height": args.size, "width": args.size,
                  "steps": args.steps, "true_cfg_scale": 4.0, "rollout_batch": args.batch,
                  "learner_batch": args.learner_batch, "repeats": args.repeats, "sync_mode": args.sync_mode,
                  "overrides": args.overrides,
                  "phases": [p for p in PHASES if p in args.phases],
                  "torch": torch.__version__,
                  "cuda": torch.version.cuda, "python": platform.python_version()},
        "rollout": rollout,
        "learner": learner,
        "log_prob_mismatch": results.get("log_probs"),
        # What tools/simulate.py needs of this GPU (a cost file's measured part; README, Simulator).
        "simulator_costs": {
            "basis": {"batch_size": args.learner_batch, "micro_batch_size": args.batch, "learner_ranks": 1,
                      "gpus_per_replica": 1},
            "rollout_request_s": replica["seconds_per_request"], "train_batch_s": learner["train_step_s"],
        } if replica and learner else None,
        "note": "medians after two warm-up calls (their seconds: warmup_s); "
                "peak_bytes is torch.cuda.max_memory_allocated (null on CPU); "
                "planned_bytes is the planner's estimate of the same process without the CUDA-context allowance",
    }
