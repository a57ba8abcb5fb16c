"""GPU memory per role and per device for a config, before anything starts.

Parameter counts come from the model's own classes built with meta parameters (no weights read,
no memory); transformer activations are measured on the meta device (rayflow.planning.activations);
the text encoder and VAE decode use the formulas written below. Each role's memory is what stays
resident plus the largest of the phases that do not overlap (a rollout rank encodes, then denoises,
then decodes), plus a fixed allowance per process for the CUDA context and NCCL.

Where an estimate is measured and where it is a formula, and the error measured on CPU, are in the
README (Memory planner).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field

import torch

from rayflow.cfg.policy import guidance_policy
from rayflow.config import RayflowConfig
from rayflow.planning.sizes import ModelSizes, measure_model, model_directory
from rayflow.sampling.denoise import decode_chunks

GiB = 2**30
PROCESS_OVERHEAD = int(1.0 * GiB)
"""CUDA context, cuBLAS workspace and NCCL buffers of one process (~0.5 GiB context on H100, plus NCCL)."""
VAE_LIVE_MAPS = 4
"""VAE decode: full-resolution feature maps alive at once (input, output, norm, causal-conv cache); a
formula, not measured — treat the decode figure as ±2x."""
ADAM_STATES = 2
BACKWARD_BLOCK_SHARE = 0.5
"""Backward holds, beyond the saved tensors, gradients and temporaries of about half one block's saved
set (fitted on CPU measurements of the tiny and small models, README: Memory planner)."""


def dtype_bytes(name: str) -> int:
    return torch.empty((), dtype=getattr(torch, name)).element_size()


@dataclass
class RoleMemory:
    """Memory of one process of a role on its device, in bytes."""

    role: str
    count: int
    """Processes of this role in the run."""
    gpus: float
    """GPU share each process asks Ray for."""
    resident: dict[str, int] = field(default_factory=dict)
    """Held for the whole run."""
    phases: dict[str, int] = field(default_factory=dict)
    """Held during one phase; phases do not overlap, so only the largest counts."""
    knobs: dict[str, str] = field(default_factory=dict)
    """Item -> the config key that shrinks it."""

    @property
    def peak_phase(self) -> tuple[str, int]:
        return max(self.phases.items(), key=lambda kv: kv[1], default=("", 0))

    @property
    def total(self) -> int:
        """Bytes on its GPU (a process without a GPU share has none planned)."""
        if self.gpus == 0:
            return 0
        return sum(self.resident.values()) + self.peak_phase[1] + PROCESS_OVERHEAD


def branches(config: RayflowConfig, scale: float | None = None) -> int:
    """CFG branches per denoising step: conditionings the policy builds at `scale` (null: sampling.guidance_scale,
    what rollouts and the learner's forwards use)."""
    policy = guidance_policy(config.cfg)
    scale = config.sampling.guidance_scale if scale is None else scale
    return len(policy.conditioning_prompts(["x"], config.sampling.negative_prompt, scale))


def rollout_requests(config: RayflowConfig) -> dict[str, tuple[int, int]]:
    """The config key that sizes each kind of request a rollout rank samples -> (samples, CFG branches). A request is
    sampled whole (one forward per branch, or per rank's branches with rollout.batch_branches): training requests,
    rollout.micro_batch_size samples at sampling.guidance_scale, at most algorithm.group_size (PromptGroup.requests
    splits one group: a larger micro-batch never runs); and when the run evaluates (trainer.eval_every,
    eval_at_start), evaluation requests, data.eval_seeds samples of one prompt at trainer.eval_guidance_scale
    (driver/evaluation.py: one request per prompt, whatever rollout.micro_batch_size)."""
    training_request = min(config.rollout.micro_batch_size, config.algorithm.group_size)
    kinds = {"rollout.micro_batch_size": (training_request, branches(config))}
    if config.trainer.eval_every or config.trainer.eval_at_start:
        kinds["data.eval_seeds"] = (config.data.eval_seeds, branches(config, config.trainer.eval_guidance_scale))
    return kinds


def rollout_forward_batch(config: RayflowConfig) -> tuple[int, str]:
    """The largest batch of one transformer forward on a rollout rank, over the requests it samples, and the key that
    sizes that request (the training request's on a tie)."""
    r = config.rollout

    def forward_batch(samples: int, n_branches: int) -> int:
        per_rank = math.ceil(n_branches / r.cfg_parallel_size)
        return samples * (per_rank if r.batch_branches else 1)

    batches = {key: forward_batch(*request) for key, request in rollout_requests(config).items()}
    key = max(batches, key=batches.get)  # the first of equals: rollout.micro_batch_size
    return batches[key], key


def _gpus(value: float | None) -> float:
    return 1.0 if value is None else value  # null: one GPU each on a GPU cluster


def rollout_rank(cfg: RayflowConfig, sizes: ModelSizes) -> RoleMemory:
    r, s = cfg.rollout, cfg.sampling
    wb = dtype_bytes(cfg.model.dtype)
    forward_batch, forward_key = rollout_forward_batch(cfg)
    requests = rollout_requests(cfg)
    samples_key = max(requests, key=lambda key: requests[key][0])
    samples = requests[samples_key][0]
    payload = _sync_payload(cfg, sizes)
    role = RoleMemory("rollout rank", r.num_replicas * r.cfg_parallel_size, _gpus(r.gpus_per_rank))
    role.resident = {
        "transformer weights": sizes.parameters["transformer"] * wb,
        "text encoder weights": sum(n for name, n in sizes.parameters.items() if name.startswith("text_encoder")) * wb,
        "VAE weights": sizes.parameters.get("vae", 0) * wb,
        "LoRA slot": sizes.lora_parameters * wb if cfg.sync.mode == "lora" else 0,
        "weight-sync receive ring (3 versions)": 3 * payload,
    }
    # Without gradients a block's tensors are freed as it goes: one block's working set bounds the live set.
    # The sampler keeps x, x' and the noise of each sample in fp32.
    denoise = sizes.forward[(forward_batch, False)].block + 3 * samples * sizes.latent_elements * 4
    # The encoders run one after another, on one text at a time (sampling.denoise.encode_texts encodes each distinct
    # prompt alone, whatever the request's size or branches): the largest one's working set for one text is the phase's.
    encode = max((t.tokens * (t.hidden * (t.layers + 1) + t.vocab + 2 * t.intermediate) * wb
                  for t in sizes.text.values()), default=0)
    decoded_at_once = decode_chunks(samples, s.decode_batch_size)[0].stop  # the first chunk is the largest
    decode = VAE_LIVE_MAPS * decoded_at_once * s.height * s.width * sizes.vae_full_res_channels * wb
    role.phases = {"prompt encoding (text encoder forward)": encode, "denoising (transformer forward)": denoise,
                   "VAE decode": decode}
    role.knobs = {"transformer weights": "model.dtype", "text encoder weights": "model.dtype",
                  "weight-sync receive ring (3 versions)": "placement.mode (colocated ranks receive no versions; or "
                                                           "learner.train_mode=lora, whose versions are the adapter)",
                  "denoising (transformer forward)": forward_key,
                  "VAE decode": f"sampling.decode_batch_size (or {samples_key})"}
    return role


def _trained_bytes(cfg: RayflowConfig) -> int:
    """Bytes per trained parameter on the learner (LoRA, or every weight with learner.train_mode=full): fp32 under
    autocast (master weights), else model.dtype."""
    return 4 if cfg.learner.mixed_precision == "autocast" else dtype_bytes(cfg.model.dtype)


def _sync_payload(cfg: RayflowConfig, sizes: ModelSizes) -> int:
    """Bytes one weight-sync version carries: the learner's adapter (lora), the folded linears (merged) or, with
    learner.train_mode=full, every transformer weight."""
    if cfg.learner.train_mode == "full":
        return sizes.parameters["transformer"] * _trained_bytes(cfg)
    if cfg.sync.mode == "lora":
        return sizes.lora_parameters * _trained_bytes(cfg)
    return sizes.adapted_parameters * dtype_bytes(cfg.model.dtype)


def learner_rank(cfg: RayflowConfig, sizes: ModelSizes) -> RoleMemory:
    lr = cfg.learner
    wb = dtype_bytes(cfg.model.dtype)
    # What FSDP2 gathers a block in: bf16 under its policy, else the sharded weights' own dtype (full fine-tuning's fp32
    # masters under autocast, which no FSDP2 policy casts).
    compute_bytes = 2 if lr.mixed_precision == "bf16" else (_trained_bytes(cfg) if lr.train_mode == "full" else wb)
    shards = lr.world_size if lr.sharded else 1
    weights = sizes.parameters["transformer"] * (_trained_bytes(cfg) if lr.train_mode == "full" else wb)
    emas = cfg.algorithm.needs_ema_rollout + (cfg.trainer.ema_decay > 0)  # "old", "ema"
    grad_forwards = branches(cfg) if cfg.algorithm.name == "flow_grpo" else 1
    cost = sizes.forward[(lr.micro_batch_size, lr.activation_checkpointing)]
    role = RoleMemory("learner rank", lr.world_size, _gpus(lr.gpus_per_rank))
    if lr.train_mode == "full":  # the trained weights are the shard itself; copies, gradients and moments are its size
        role.resident = {
            "transformer weights (shard)": weights // shards,
            'whole-weight copies ("old", "ema", KL "base")': (emas + (cfg.algorithm.kl_beta > 0)) * (weights // shards),
            "gradients + AdamW states": (1 + ADAM_STATES) * (weights // shards),
        }
    else:
        lora = sizes.lora_parameters * _trained_bytes(cfg) // shards
        role.resident = {
            "transformer weights (shard)": weights // shards,
            "LoRA adapters": (1 + emas) * lora,
            "LoRA gradients + AdamW states": (1 + ADAM_STATES) * lora,
        }
    if lr.sharded:
        # FSDP2 gathers one block and prefetches the next.
        role.resident["FSDP2 gathered blocks (2)"] = 2 * sizes.block_parameters * compute_bytes
    train = int(grad_forwards * cost.saved + BACKWARD_BLOCK_SHARE * cost.block)
    role.phases = {"training step (activations)": train,
                   # as loaded (model.dtype): fp32 masters are cast block by block as they are sharded
                   "start-up: full transformer before sharding": max(0, sizes.parameters["transformer"] * wb - weights // shards)}
    role.knobs = {"training step (activations)": "learner.micro_batch_size (or learner.activation_checkpointing=true)",
                  "transformer weights (shard)": "learner.world_size",
                  "start-up: full transformer before sharding": "model.dtype"}
    return role


def sync_actor(cfg: RayflowConfig, sizes: ModelSizes) -> RoleMemory:
    role = RoleMemory("weight-sync actor", 1, _gpus(cfg.sync.gpus))
    role.resident = {"packed buckets of one version": _sync_payload(cfg, sizes)}
    role.knobs = {"packed buckets of one version": "sync.mode"}
    return role


def reward_worker(cfg: RayflowConfig) -> RoleMemory:
    # Reward models are user code: only the process itself is planned.
    return RoleMemory("reward worker", cfg.reward.num_workers, cfg.reward.gpus_per_worker)


def colocated_device(cfg: RayflowConfig, sizes: ModelSizes) -> RoleMemory:
    """placement.mode=colocated: one process per device holds the learner rank's state and the pipeline once; it
    samples (the rollout's phases, with a sharded transformer gathered whole) or trains, never both."""
    rollout, learner = rollout_rank(cfg, sizes), learner_rank(cfg, sizes)
    lr = cfg.learner
    role = RoleMemory("device (learner rank + rollout rank)", lr.world_size, _gpus(cfg.placement.gpus_per_device))
    role.resident = {k: v for k, v in learner.resident.items() if not k.startswith("FSDP2 gathered")}
    role.resident["text encoder weights"] = rollout.resident["text encoder weights"]
    role.resident["VAE weights"] = rollout.resident["VAE weights"]
    optimizer_key = "LoRA gradients + AdamW states" if lr.train_mode == "lora" else "gradients + AdamW states"
    optimizer = role.resident.pop(optimizer_key) if lr.offload_optimizer_during_rollout else 0
    train = learner.phases["training step (activations)"] + learner.resident.get("FSDP2 gathered blocks (2)", 0)
    role.phases = {"training step (activations)": train + optimizer}
    # Sampling under sharded weights gathers the whole transformer once per step (in the compute dtype).
    held_bytes = _trained_bytes(cfg) if lr.train_mode == "full" else dtype_bytes(cfg.model.dtype)
    gathered = sizes.parameters["transformer"] * (2 if lr.mixed_precision == "bf16" else held_bytes) if lr.sharded else 0
    for phase in ("prompt encoding (text encoder forward)", "denoising (transformer forward)", "VAE decode"):
        role.phases[phase] = gathered + rollout.phases[phase]
    role.phases["start-up: full transformer before sharding"] = learner.phases["start-up: full transformer before sharding"]
    role.knobs = {**rollout.knobs, **learner.knobs,
                  "denoising (transformer forward)": f"{rollout.knobs['denoising (transformer forward)']} (sharded "
                                                     "learners gather the whole transformer to sample: "
                                                     "learner.mixed_precision=autocast keeps one copy)",
                  optimizer_key: "learner.offload_optimizer_during_rollout"}
    return role


def roles(cfg: RayflowConfig, sizes: ModelSizes) -> list[RoleMemory]:
    if cfg.placement.colocated:
        return [colocated_device(cfg, sizes), reward_worker(cfg)]
    return [rollout_rank(cfg, sizes), learner_rank(cfg, sizes), sync_actor(cfg, sizes), reward_worker(cfg)]


def required_forwards(cfg: RayflowConfig) -> set[tuple[int, bool]]:
    """The (batch, checkpointing) forwards the plan measures."""
    return {(rollout_forward_batch(cfg)[0], False), (cfg.learner.micro_batch_size, cfg.learner.activation_checkpointing)}


@dataclass
class Device:
    roles: list[RoleMemory] = field(default_factory=list)

    @property
    def share(self) -> float:
        return sum(r.gpus for r in self.roles)

    @property
    def total(self) -> int:
        return sum(r.total for r in self.roles)


def place(plan: list[RoleMemory]) -> list[Device]:
    """Processes onto GPUs as Ray packs fractional requests: first fit, largest share first. A process
    asking for one GPU or more has its (first) device to itself."""
    devices: list[Device] = []
    processes = sorted(((r.gpus, i, r) for i, r in enumerate(plan) if r.gpus > 0 for _ in range(r.count)),
                       key=lambda x: (-x[0], x[1]))
    for gpus, _, role in processes:
        device = next((d for d in devices if gpus < 1 and d.share + gpus <= 1.0 + 1e-9), None)
        if device is None:
            device = Device()
            devices.append(device)
        device.roles.append(role)
    return devices


def plan_config(cfg: RayflowConfig, arch: str | None = None, math_attention: bool = False
                ) -> tuple[list[RoleMemory], str]:
    """(per-role memory, where the model's configs came from). `arch`: the published configs planned when
    model.path is not on this machine (None: model.tiny_arch; sizes.NoPublishedConfigs when rayflow has none)."""
    with tempfile.TemporaryDirectory() as workdir:
        path, source = model_directory(cfg, arch, workdir)
        sizes = measure_model(cfg, path, required_forwards(cfg), math_attention=math_attention)
    return roles(cfg, sizes), source


def check_fits(cfg: RayflowConfig, plan: list[RoleMemory], device_bytes: int) -> None:
    """ConfigError naming the config key to change when a device's planned total exceeds `device_bytes`:
    the peak phase's knob when shrinking that phase can make it fit (a batch size), else the knob of
    the largest resident item."""
    from rayflow.config import to_dict
    from rayflow.errors import ConfigError

    for device in place(plan):
        over = device.total - device_bytes
        if over <= 0:
            continue
        worst = max(device.roles, key=lambda r: r.total)
        phase, size = worst.peak_phase
        if phase not in worst.knobs or size < over:
            phase, size = max(((k, v) for k, v in worst.resident.items() if k in worst.knobs),
                              key=lambda kv: kv[1], default=(phase, size))
        knob = worst.knobs.get(phase, "rollout.gpus_per_rank")
        key = knob.split(" ")[0]
        value = to_dict(cfg)
        for part in key.split("."):
            value = value[part]
        sharing = " + ".join(r.role for r in device.roles)
        raise ConfigError(
            key, value,
            f"a value that fits one GPU: {sharing} need an estimated {device.total / GiB:.1f} GiB of "
            f"{device_bytes / GiB:.1f} GiB; the {worst.role}'s {phase} alone is {size / GiB:.1f} GiB — change {knob} "
            f"(every figure: python tools/plan.py with this config)",
        )


def format_plan(plan: list[RoleMemory], device_bytes: int, source: str) -> str:
    lines = [f"model configs: {source}", f"device memory: {device_bytes / GiB:.1f} GiB", ""]
    for role in plan:
        lines.append(f"{role.role} (x{role.count}, {role.gpus:g} GPU each): {role.total / GiB:.2f} GiB")
        for name, value in role.resident.items():
            lines.append(f"    {name:<48} {value / GiB:8.2f} GiB")
        peak = role.peak_phase[0]
        for name, value in role.phases.items():
            mark = "  <- peak phase" if name == peak else ""
            lines.append(f"    {name:<48} {value / GiB:8.2f} GiB{mark}")
        if role.gpus > 0:
            lines.append(f"    {'CUDA context + NCCL (allowance)':<48} {PROCESS_OVERHEAD / GiB:8.2f} GiB")
        else:
            lines.append("    no GPU share: not on a GPU")
    lines.append("")
    for i, device in enumerate(place(plan)):
        verdict = "fits" if device.total <= device_bytes else "DOES NOT FIT"
        names = " + ".join(r.role for r in device.roles)
        lines.append(f"GPU {i}: {names}: {device.total / GiB:.1f} / {device_bytes / GiB:.1f} GiB  {verdict}")
    return "\n".join(lines)
