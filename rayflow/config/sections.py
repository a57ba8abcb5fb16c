"""The config sections: one typed dataclass per component, each validating its own keys.

`validate(prefix)` raises ConfigError naming the key, the value given and what is allowed; rules that span
sections live with the root (rayflow.config.root).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from rayflow.algorithms.advantages import STAT_TRACKING
from rayflow.algorithms.diffusion_nft import ADV_MODES
from rayflow.errors import ConfigError
from rayflow.paths import recipe
from rayflow.types import SOLVERS

DTYPES = ("float32", "bfloat16", "float16")
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


def _need(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


@dataclass
class ModelConfig:
    path: str | None = None
    """A diffusers pipeline directory; null builds (once, then cached) the tiny offline twin of tiny_arch."""
    tiny_size: str = "tiny"
    """Size of the tiny offline model when path is null: "tiny" or "small"."""
    tiny_seed: int = 0
    """Weight seed of the tiny offline model."""
    tiny_arch: str = "qwen_image"
    """Family of the tiny offline model when path is null: "qwen_image", "sd3" or "flux"; with a path not on the
    driver's machine, the family the memory planner sizes (from its published configs)."""
    cache_dir: str = "~/.cache/rayflow"
    """Where the tiny offline model is cached."""
    dtype: str = "float32"
    """Weights and activations dtype: float32, bfloat16 or float16."""
    compile: bool = False
    """torch.compile each transformer block (regional: one compiled block, reused by every block) in
    rollout ranks and learners; needs Triton on GPU, a C++ compiler on CPU."""
    attention_backend: str = "auto"
    """Attention kernel of the transformer: "auto" (torch SDPA chooses), "flash", "efficient", "cudnn"
    (CUDA only) or "math" (SDPA kernels through diffusers' attention dispatcher)."""

    def validate(self, prefix: str = "model") -> None:
        from rayflow.models.tiny import ARCHS, tiny_sizes

        _need(self.dtype in DTYPES, f"{prefix}.dtype", self.dtype, f"one of {list(DTYPES)}")
        _need(self.tiny_arch in ARCHS, f"{prefix}.tiny_arch", self.tiny_arch, f"one of {list(ARCHS)}")
        sizes = tiny_sizes(self.tiny_arch)
        _need(self.tiny_size in sizes, f"{prefix}.tiny_size", self.tiny_size, f"one of {sizes} for tiny_arch={self.tiny_arch}")
        _need(self.attention_backend in ATTENTION_BACKENDS, f"{prefix}.attention_backend", self.attention_backend,
              f"one of {list(ATTENTION_BACKENDS)}")


@dataclass
class CFGConfig:
    policy: str = "true_cfg"
    """"true_cfg" (Qwen-Image's norm-rescaled CFG), "standard", "none", "embedded" (FLUX.1-dev's guidance embedding) or "dual_negative"."""
    parallel_arithmetic: bool = False
    """Combine as s·p + (1 − s)·n instead of n + s·(p − n) (equal to rounding)."""
    avoid_prompt: str = "blurry, low quality"
    """dual_negative only: the prompt to guide away from."""
    avoid_scale: float = 1.0
    """dual_negative only: how strongly to guide away from avoid_prompt."""

    def validate(self, prefix: str = "cfg") -> None:
        from rayflow.cfg.policy import POLICIES

        _need(self.policy in POLICIES, f"{prefix}.policy", self.policy, f"one of {sorted(POLICIES)}")
        _need(self.avoid_scale >= 0, f"{prefix}.avoid_scale", self.avoid_scale, "a float >= 0")


@dataclass
class RolloutConfig:
    num_replicas: int = 1
    """Rollout replicas serving requests concurrently."""
    cfg_parallel_size: int = 1
    """W: CFG-parallel ranks per replica (branch i runs on rank i % W)."""
    micro_batch_size: int = 4
    """Samples per rollout request; a prompt's group is split into requests of this size (at most algorithm.group_size:
    a larger one makes one request of the group, as the memory plan counts it)."""
    gpus_per_rank: float | None = None
    """GPUs per rollout rank; null: 1 when the cluster has GPUs or its autoscaler reports it can add them, else 0
    (decided when the run starts; 0 with a warning naming the key where a v1 autoscaler, the shipped configs', may add
    GPUs it does not report)."""
    cpus_per_rank: float = 1.0
    """CPUs reserved per rollout rank."""
    threads_per_rank: int = 1
    """torch intra-op threads per rank on CPU."""
    placement_strategy: str = "PACK"
    """Placement-group strategy of a replica's ranks."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per rollout rank (e.g. {"gpu_node": 1} to keep them on one node type)."""
    collective_timeout_s: float = 300.0
    """A collective that takes longer fails with the rank and node named, instead of hanging. Its other members get a
    grace past it to answer (fail their side, report) before they are taken for stalled: 10 s, or the timeout itself
    when shorter."""
    max_restarts: int = 3
    """Times a replica that died or stalled is replaced by a new one (per replica, within restart_window_s); a replacement
    that fails to start, or is not placed within 600 s, counts as another death. Then the run goes on without it, and
    stops (ReplicaError) when no replica is left."""
    restart_window_s: float = 3600.0
    """max_restarts counts a replica's restarts within any this many seconds (0: over the whole run)."""
    stall_timeout_s: float = 600.0
    """Watchdog floor: a replica with work that finishes nothing for max(this, stall_factor x its measured
    service time) is reported as stalled and replaced like a dead one (its requests re-issued)."""
    stall_factor: float = 10.0
    """Watchdog: the deadline in multiples of the longest recently measured request service time."""
    batch_branches: bool = False
    """A rank with several CFG branches runs them in one batched forward: faster, but not bit-exact
    with the single-process sampler (which runs one forward per branch)."""

    def validate(self, prefix: str = "rollout") -> None:
        _need(self.num_replicas >= 1, f"{prefix}.num_replicas", self.num_replicas, "an integer >= 1")
        _need(self.cfg_parallel_size >= 1, f"{prefix}.cfg_parallel_size", self.cfg_parallel_size, "an integer >= 1")
        _need(self.micro_batch_size >= 1, f"{prefix}.micro_batch_size", self.micro_batch_size, "an integer >= 1")
        _need(self.stall_timeout_s > 0, f"{prefix}.stall_timeout_s", self.stall_timeout_s, "seconds > 0")
        _need(self.stall_factor >= 1, f"{prefix}.stall_factor", self.stall_factor, "a number >= 1")
        _need(self.collective_timeout_s > 0, f"{prefix}.collective_timeout_s", self.collective_timeout_s, "seconds > 0")
        _validate_restarts(self, prefix)
        _validate_resources(self, prefix)


TRAIN_MODES = ("lora", "full")
MIXED_PRECISION = ("none", "bf16", "autocast")
LORA_INITS = ("gaussian", "default")
LORA_OPTIONS = ("lora_rank", "lora_alpha", "lora_targets", "lora_init")
"""LearnerConfig keys that only LoRA training reads."""


@dataclass
class LearnerConfig:
    world_size: int = 1
    """FSDP2 ranks."""
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip; a step whose norm is not finite is skipped and counted."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank (gradient accumulation over the rank's shard)."""
    train_mode: str = "lora"
    """"lora" trains LoRA adapters (lora_* keys); "full" trains every transformer parameter, FSDP2-sharded, with
    whole-weight EMA copies, sharded checkpoints and sync.mode=merged (README: Full fine-tuning)."""
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: float = 8.0
    """LoRA alpha (the adapter is scaled by alpha / r)."""
    lora_targets: list[str] | None = None
    """Module names to adapt; null: the model's attention projections (incl. to_out.0 and the text stream)."""
    lora_init: str = "gaussian"
    """peft init_lora_weights: "gaussian" or "default" (B = 0 either way, so the adapter starts as identity)."""
    mixed_precision: str = "none"
    """"none"; "bf16" (FSDP2 MixedPrecisionPolicy: bf16 params, fp32 reduce); or "autocast" (torch.autocast
    to bf16 around the forward: weights as model.dtype, LoRA adapters and their optimizer in fp32; with
    train_mode=full every weight and its optimizer state in fp32, cast block by block as it is sharded)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in the backward pass (memory for compute)."""
    shard: str = "auto"
    """FSDP2 sharding: "auto" shards when there is more than one rank (or bf16 mixed precision, which
    FSDP2 applies); one full-precision rank trains the plain model, as the reference trainer does.
    "always" shards even a single rank."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after the forward (False keeps them until the backward)."""
    offload_optimizer_during_rollout: bool = False
    """placement.mode=colocated: the optimizer state waits on the CPU while the device samples (memory for the
    gathered weights and activations; costs a copy each way per step)."""
    gpus_per_rank: float | None = None
    """GPUs per learner rank; null: 1 when the cluster has GPUs or its autoscaler reports it can add them, else 0
    (decided when the run starts; 0 with a warning naming the key where a v1 autoscaler, the shipped configs', may add
    GPUs it does not report)."""
    cpus_per_rank: float = 1.0
    """CPUs reserved per learner rank."""
    threads_per_rank: int = 1
    """torch intra-op threads per learner rank."""
    prefetch: bool = True
    """Learners take a rollout request's trajectories as soon as it finishes, while the rest of the batch rolls out
    (false: when the train step starts; the same trajectories either way). One rank deserializes and holds them;
    of several ranks, each pulls the request onto its node (once per node) and deserializes only its shard at the
    train step."""
    placement_strategy: str = "PACK"
    """Placement-group strategy of the learner ranks."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per learner rank (e.g. {"gpu_node": 1} to keep them on one node type)."""
    stall_timeout_s: float = 1800.0
    """Watchdog floor for a train step: one not done after max(this, rollout.stall_factor x the longest measured
    step) stops the run loudly, naming the late ranks (continue from the last checkpoint with trainer.resume=auto). The
    same deadline holds for the driver's other calls to the learners (checkpoint save and restore, weight push)."""
    max_restarts: int = 3
    """Times the learner group is started again in its bundles after a rank died (within restart_window_s), the run
    rewound to the newest checkpoint of its own timeline; then the run stops, naming the rank."""
    restart_window_s: float = 3600.0
    """max_restarts counts restarts within any this many seconds (0: over the whole run)."""

    @property
    def sharded(self) -> bool:
        """Whether the learner applies FSDP2 (see `shard`)."""
        return self.shard == "always" or self.world_size > 1 or self.mixed_precision == "bf16"

    def validate(self, prefix: str = "learner") -> None:
        _need(self.world_size >= 1, f"{prefix}.world_size", self.world_size, "an integer >= 1")
        _need(self.lr > 0, f"{prefix}.lr", self.lr, "a float > 0")
        _need(self.weight_decay >= 0, f"{prefix}.weight_decay", self.weight_decay, "a float >= 0")
        # eps = 0 turns a parameter with a zero gradient (LoRA's A at the start) into NaN on the first step.
        _need(self.eps > 0, f"{prefix}.eps", self.eps, "a float > 0")
        _need(self.stall_timeout_s > 0, f"{prefix}.stall_timeout_s", self.stall_timeout_s, "seconds > 0")
        _validate_restarts(self, prefix)
        _need(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"{prefix}.betas", self.betas, "two floats in [0, 1)",
        )
        _need(self.max_grad_norm > 0, f"{prefix}.max_grad_norm", self.max_grad_norm, "a float > 0")
        _need(self.micro_batch_size >= 1, f"{prefix}.micro_batch_size", self.micro_batch_size, "an integer >= 1")
        _need(self.train_mode in TRAIN_MODES, f"{prefix}.train_mode", self.train_mode, f"one of {list(TRAIN_MODES)}")
        if self.train_mode == "full":
            self._validate_no_lora_options(prefix)
        _need(self.lora_rank >= 1, f"{prefix}.lora_rank", self.lora_rank, "an integer >= 1")
        _need(self.lora_alpha > 0, f"{prefix}.lora_alpha", self.lora_alpha, "a float > 0")
        _need(
            self.lora_targets is None or len(self.lora_targets) > 0,
            f"{prefix}.lora_targets", self.lora_targets, "null or a non-empty list of module names",
        )
        _need(self.lora_init in LORA_INITS, f"{prefix}.lora_init", self.lora_init, f"one of {list(LORA_INITS)}")
        _need(self.mixed_precision in MIXED_PRECISION, f"{prefix}.mixed_precision", self.mixed_precision,
              f"one of {list(MIXED_PRECISION)}")
        _need(self.shard in ("auto", "always"), f"{prefix}.shard", self.shard, "'auto' or 'always'")
        _validate_resources(self, prefix)

    def _validate_no_lora_options(self, prefix: str) -> None:
        """Full fine-tuning has no adapter: a LoRA option set to anything but its default is a mistake, not a no-op.
        One message names every such key."""
        defaults = LearnerConfig()
        changed = [key for key in LORA_OPTIONS if getattr(self, key) != getattr(defaults, key)]
        if not changed:
            return
        if len(changed) == 1:
            value, allowed = getattr(self, changed[0]), f"its default {getattr(defaults, changed[0])!r}"
        else:
            value = {key: getattr(self, key) for key in changed}
            allowed = "their defaults " + ", ".join(f"{key}={getattr(defaults, key)!r}" for key in changed)
        raise ConfigError(
            ", ".join(f"{prefix}.{key}" for key in changed), value,
            f"{allowed} with {prefix}.train_mode=full (LoRA options; full fine-tuning trains every transformer "
            f"parameter), or {prefix}.train_mode=lora",
        )


ALGORITHMS = ("flow_grpo", "diffusion_nft")


@dataclass
class AlgorithmConfig:
    name: str = "flow_grpo"
    """"flow_grpo" or "diffusion_nft"."""
    group_size: int = 8
    """G: samples per prompt; advantages are normalised within a group."""
    prompts_per_step: int = 2
    """Prompts (groups) per optimizer step; batch size = prompts_per_step x group_size."""
    stat_tracking: str = "prompt"
    """Advantage groups: "prompt" (prompt text across the batch, flow_grpo's/DiffusionNFT's), "group" (rollout group) or "batch"."""
    global_std: bool = True
    """Normalise advantages by the std over the whole batch instead of per group (true in flow_grpo and DiffusionNFT)."""
    adv_mode: str = "all"
    """DiffusionNFT: advantages used, as its train.adv_mode: all, positive_only, negative_only, one_only or binary."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to +-adv_clip_max."""
    clip_range: float = 1e-4
    """FlowGRPO: PPO ratio clip epsilon."""
    kl_beta: float = 0.0
    """Weight of the KL to the base model (LoRA: adapters disabled; full: a frozen copy of the base weights); 0 turns it off."""
    kl_type: str = "flow_grpo"
    """FlowGRPO KL: "flow_grpo" (/ 2·std_dev_t², flow_grpo's) or "transition" (/ 2·(step std)², = flow_grpo's / (σ − σ'))."""
    ratio_norm: bool = False
    """FlowGRPO with sde_type=sde: GRPO-Guard's ratio normalisation and per-step gradient reweighting (arXiv 2510.22319)."""
    nft_beta: float = 1.0
    """DiffusionNFT: mixing coefficient between the old and current velocity."""
    nft_timesteps: int | None = None
    """DiffusionNFT: rollout timesteps trained per sample, at most sampling.num_steps; null: all of them."""
    ema_flat: int = 0
    """DiffusionNFT EMA of the "old" adapter: steps before it starts to lag (eta = 0)."""
    ema_uprate: float = 0.001
    """DiffusionNFT EMA: eta grows by this per step after ema_flat ..."""
    ema_uphold: float = 0.5
    """... up to this."""
    timestep_fraction: float = 1.0
    """FlowGRPO: trains the stochastic steps j < int(num_steps x timestep_fraction) (flow_grpo's train.timestep_fraction)."""
    num_inner_epochs: int = 1
    """Passes over each trained batch, each reshuffled (flow_grpo train.num_inner_epochs)."""
    num_minibatches: int = 1
    """Mini-batches per pass, one optimizer step each (flow_grpo: samples per epoch / train.batch_size x grad accumulation)."""

    @property
    def batch_size(self) -> int:
        return self.group_size * self.prompts_per_step

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps per trained batch (one version)."""
        return self.num_inner_epochs * self.num_minibatches

    @property
    def needs_ema_rollout(self) -> bool:
        return self.name == "diffusion_nft"

    def validate(self, prefix: str = "algorithm") -> None:
        _need(self.name in ALGORITHMS, f"{prefix}.name", self.name, f"one of {list(ALGORITHMS)}")
        _need(self.group_size >= 2, f"{prefix}.group_size", self.group_size, "an integer >= 2 (advantages compare group members)")
        _need(self.prompts_per_step >= 1, f"{prefix}.prompts_per_step", self.prompts_per_step, "an integer >= 1")
        _need(self.adv_clip_max > 0, f"{prefix}.adv_clip_max", self.adv_clip_max, "a float > 0")
        _need(self.stat_tracking in STAT_TRACKING, f"{prefix}.stat_tracking", self.stat_tracking, f"one of {list(STAT_TRACKING)}")
        _need(self.adv_mode in ADV_MODES, f"{prefix}.adv_mode", self.adv_mode, f"one of {list(ADV_MODES)}")
        _need(self.clip_range > 0, f"{prefix}.clip_range", self.clip_range, "a float > 0")
        _need(self.kl_beta >= 0, f"{prefix}.kl_beta", self.kl_beta, "a float >= 0")
        _need(self.kl_type in ("flow_grpo", "transition"), f"{prefix}.kl_type", self.kl_type, "'flow_grpo' or 'transition'")
        _need(self.nft_beta > 0, f"{prefix}.nft_beta", self.nft_beta, "a float > 0")
        _need(
            self.nft_timesteps is None or self.nft_timesteps >= 1,
            f"{prefix}.nft_timesteps", self.nft_timesteps, "null or an integer >= 1",
        )
        _need(self.ema_flat >= 0, f"{prefix}.ema_flat", self.ema_flat, "an integer >= 0")
        _need(self.ema_uprate >= 0, f"{prefix}.ema_uprate", self.ema_uprate, "a float >= 0")
        _need(0 <= self.ema_uphold < 1, f"{prefix}.ema_uphold", self.ema_uphold, "a float in [0, 1)")
        _need(0 < self.timestep_fraction <= 1, f"{prefix}.timestep_fraction", self.timestep_fraction, "a float in (0, 1]")
        _need(self.num_inner_epochs >= 1, f"{prefix}.num_inner_epochs", self.num_inner_epochs, "an integer >= 1")
        _need(
            self.num_minibatches >= 1 and self.batch_size % self.num_minibatches == 0,
            f"{prefix}.num_minibatches", self.num_minibatches,
            f"a divisor of the batch (group_size x prompts_per_step = {self.batch_size})",
        )


@dataclass
class RewardFnConfig:
    name: str = "color"
    """A registered reward (see rayflow.rewards)."""
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the reward (e.g. url for "http")."""
    normalize: str = "none"
    """Before the weighted sum: "none", "group" (standardised within each prompt's group) or "batch"."""


@dataclass
class RewardConfig:
    functions: list[RewardFnConfig] = field(default_factory=lambda: [RewardFnConfig()])
    """The total reward is the weighted sum of these; each component is logged."""
    num_workers: int = 1
    """RewardWorker actors."""
    batch_size: int = 16
    """Images per reward call."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per reward worker (its torch threads: this, rounded down, at least 1)."""
    gpus_per_worker: float = 0.0
    """GPUs per reward worker (for model-based rewards)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per reward worker (e.g. {"gpu_node": 1} to keep them on one node type)."""
    max_retries: int = 1
    """A reward call that raises is retried this many times, then the run stops (never silent zeros)."""
    max_restarts: int = 3
    """Times a reward worker that died or stalled is replaced (per worker, within restart_window_s); its calls are
    re-issued without spending a retry. Then the run goes on without it, and stops (RewardError) when no worker is
    left."""
    restart_window_s: float = 3600.0
    """max_restarts counts a worker's restarts within any this many seconds (0: over the whole run)."""
    stall_timeout_s: float = 600.0
    """Watchdog floor: a worker with calls that finishes none for max(this, stall_factor x the longest measured
    call) is reported as stalled and replaced like a dead one (its calls re-issued)."""
    stall_factor: float = 10.0
    """Watchdog: the deadline in multiples of the longest recently measured reward call."""
    max_outage_s: float = 0.0
    """Rewards that call a server (http, vlm_judge) retry with backoff this long before a call fails."""

    def validate(self, prefix: str = "reward") -> None:
        from rayflow.rewards import registered_rewards
        from rayflow.rewards.normalize import NORMALIZE_MODES
        from rayflow.rewards.validation import check_reward_kwargs

        _need(len(self.functions) >= 1, f"{prefix}.functions", self.functions, "at least one reward function")
        for i, fn in enumerate(self.functions):
            names = registered_rewards()
            _need(fn.name in names, f"{prefix}.functions[{i}].name", fn.name, f"one of {names}")
            check_reward_kwargs(fn.name, fn.kwargs, f"{prefix}.functions[{i}].kwargs")
            _need(fn.normalize in NORMALIZE_MODES, f"{prefix}.functions[{i}].normalize", fn.normalize,
                  f"one of {list(NORMALIZE_MODES)}")
        # A zero-weight component is logged but not trained on; with every weight 0 no sample has an advantage.
        _need(any(fn.weight != 0 for fn in self.functions), f"{prefix}.functions[*].weight",
              [fn.weight for fn in self.functions], "at least one weight not 0 (the trained reward is the weighted sum)")
        _need(self.num_workers >= 1, f"{prefix}.num_workers", self.num_workers, "an integer >= 1")
        _need(self.cpus_per_worker >= 0, f"{prefix}.cpus_per_worker", self.cpus_per_worker, "a float >= 0")
        _need(self.gpus_per_worker >= 0, f"{prefix}.gpus_per_worker", self.gpus_per_worker, "a float >= 0")
        _need(self.batch_size >= 1, f"{prefix}.batch_size", self.batch_size, "an integer >= 1")
        _need(self.max_retries >= 0, f"{prefix}.max_retries", self.max_retries, "an integer >= 0")
        _validate_restarts(self, prefix)
        _need(self.stall_timeout_s > 0, f"{prefix}.stall_timeout_s", self.stall_timeout_s, "seconds > 0")
        _need(self.stall_factor >= 1, f"{prefix}.stall_factor", self.stall_factor, "a number >= 1")
        _need(self.max_outage_s >= 0, f"{prefix}.max_outage_s", self.max_outage_s, "a number of seconds >= 0")
        _validate_custom_resources(self.resources, f"{prefix}.resources")


OVER_STALE = ("regenerate", "drop")


@dataclass
class AsyncConfig:
    max_staleness: int = 0
    """0: synchronous and on-policy (bit-identical to the reference trainer); k: trajectories may be
    up to k policy versions behind the learner."""
    partial_rollout: bool = True
    """true: new weights reach a trajectory in flight at its next denoising-step boundary (each step records its
    version); false: rollout ranks apply new weights only between requests, so a trajectory keeps one version."""
    over_stale: str = "regenerate"
    """A group staler than max_staleness is "regenerate"d or "drop"ped (and counted). Read with max_staleness=0 too: a
    synchronous run resumed from an asynchronous run's checkpoint may hold more pending groups than a batch."""

    def validate(self, prefix: str = "async") -> None:
        _need(self.max_staleness >= 0, f"{prefix}.max_staleness", self.max_staleness, "an integer >= 0")
        _need(self.over_stale in OVER_STALE, f"{prefix}.over_stale", self.over_stale, f"one of {list(OVER_STALE)}")


SYNC_MODES = ("lora", "merged")


@dataclass
class SyncConfig:
    mode: str = "lora"
    """"lora" ships the rollout adapter; "merged" folds it into the transformer weights and ships those (with
    learner.train_mode=full, the only mode: every transformer weight, as trained)."""
    bucket_mb: float = 64.0
    """Broadcast bucket size."""
    verify_checksum: bool = False
    """Also compare a checksum per tensor between the source and every rank."""
    cpus: float = 1.0
    """CPUs of the weight-sync actor."""
    gpus: float | None = None
    """GPUs of the weight-sync actor (the broadcast source: nccl needs it on a GPU of its own; 0 with GPU rollout ranks,
    and > 0 with CPU ones, is refused when the run starts); null: 0 with rollout.gpus_per_rank=0, else 1 when the
    cluster has GPUs or its autoscaler reports it can add them, else 0 (decided when the run starts; 0 with a warning
    naming the key where a v1 autoscaler, the shipped configs', may add GPUs it does not report)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per weight-sync actor (e.g. {"gpu_node": 1} to keep them on one node type)."""
    max_restarts: int = 3
    """Times a weight-sync actor that died is replaced (within restart_window_s): the group is re-formed with the
    rollout ranks and the learners push the current version again. Then the run stops, naming the actor's death."""
    restart_window_s: float = 3600.0
    """max_restarts counts restarts within any this many seconds (0: over the whole run)."""

    def validate(self, prefix: str = "sync") -> None:
        _need(self.mode in SYNC_MODES, f"{prefix}.mode", self.mode, f"one of {list(SYNC_MODES)}")
        _need(self.bucket_mb > 0, f"{prefix}.bucket_mb", self.bucket_mb, "a float > 0")
        _need(self.cpus >= 0, f"{prefix}.cpus", self.cpus, "a float >= 0")
        _need(self.gpus is None or self.gpus >= 0, f"{prefix}.gpus", self.gpus, "null or a float >= 0")
        _validate_custom_resources(self.resources, f"{prefix}.resources")
        _validate_restarts(self, prefix)


PLACEMENT_MODES = ("disaggregated", "colocated")


@dataclass
class PlacementConfig:
    mode: str = "disaggregated"
    """"disaggregated": rollout ranks, learner ranks and the weight-sync actor on devices of their own, weights
    broadcast after each step; "colocated": one actor per device holds the pipeline once, samples under the adapter
    it trains, then trains (no broadcast; learner.world_size = rollout.num_replicas x rollout.cfg_parallel_size)."""
    cpus_per_device: float = 1.0
    """Colocated: CPUs reserved per device's actor (rollout.* and learner.cpus_per_rank / gpus_per_rank apply to
    disaggregated placement only)."""
    gpus_per_device: float | None = None
    """Colocated: GPUs per device's actor; null: 1 when the cluster has GPUs or its autoscaler reports it can add them,
    else 0 (decided when the run starts; 0 with a warning naming the key where a v1 autoscaler, the shipped configs',
    may add GPUs it does not report)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Colocated: custom Ray resources per device's actor."""

    def validate(self, prefix: str = "placement") -> None:
        _need(self.mode in PLACEMENT_MODES, f"{prefix}.mode", self.mode, f"one of {list(PLACEMENT_MODES)}")
        _need(self.cpus_per_device >= 0, f"{prefix}.cpus_per_device", self.cpus_per_device, "a float >= 0")
        _need(self.gpus_per_device is None or self.gpus_per_device >= 0, f"{prefix}.gpus_per_device",
              self.gpus_per_device, "null or a float >= 0")
        _validate_custom_resources(self.resources, f"{prefix}.resources")

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"


@dataclass
class DataConfig:
    prompts: str = recipe("prompts/colors.txt")
    """Training prompts: a .txt (one per line) or .jsonl ({"prompt": ...} per line). A relative path in a recipe
    YAML is relative to the YAML's directory; on the command line, to the working directory."""
    eval_prompts: str | None = None
    """Evaluation prompts; null: the first 4 training prompts."""
    eval_seeds: int = 1
    """Samples of each evaluation prompt (fixed seeds), so an accuracy is measured on more than one image each."""
    shuffle: bool = True
    """Shuffle the prompts every epoch (with trainer.seed)."""
    max_prompt_chars: int = 4096
    """A longer prompt line is an error naming file and line (a prompt beyond the text encoder's context only costs time)."""

    def validate(self, prefix: str = "data") -> None:
        _need(self.max_prompt_chars >= 1, f"{prefix}.max_prompt_chars", self.max_prompt_chars, "an integer >= 1")
        _need(self.eval_seeds >= 1, f"{prefix}.eval_seeds", self.eval_seeds, "an integer >= 1")


SEED_LIMIT = 2**32
"""trainer.seed is below this (see TrainerConfig.validate)."""


@dataclass
class TrainerConfig:
    total_steps: int = 100
    """Batches trained (policy versions); each is algorithm.num_inner_epochs x num_minibatches optimizer steps."""
    seed: int = 0
    """The run seed: prompt order, sample seeds, LoRA init."""
    output_dir: str = "outputs"
    """Runs go under <output_dir>/<run_name>; give an absolute path under `ray job submit` (a path inside the job's
    temporary working dir is refused)."""
    run_name: str | None = None
    """The run's directory under output_dir (checkpoints, TensorBoard, config.yaml); null: <recipe>-<date>-<time>,
    a new run each time. Give the same run_name again to continue a run (trainer.resume=auto)."""
    logdir: str = "${trainer.output_dir}/${trainer.run_name}/tensorboard"
    """TensorBoard event files."""
    save_every: int = 10
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (and always the newest healthy one)."""
    max_skipped_steps: int = 3
    """Stop the run after this many optimizer steps in a row skipped for a non-finite gradient norm (0: never)."""
    eval_every: int = 10
    """Evaluate (ODE, fixed prompts and seeds, an image grid) every this many steps and after the last (0: never)."""
    eval_at_start: bool = False
    """Also evaluate the untrained policy, as step 0 of a new run: the baseline the eval curve starts from."""
    eval_num_steps: int | None = None
    """Denoising steps of the evaluation samples; null: sampling.num_steps (flow_grpo's and DiffusionNFT's
    sample.eval_num_steps: 40 in their SD3 recipes, which roll out with 10)."""
    eval_guidance_scale: float | None = None
    """CFG scale of the evaluation samples; null: sampling.guidance_scale (flow_grpo's sample.eval_guidance_scale)."""
    eval_solver: str | None = None
    """Deterministic solver of the evaluation samples, "euler" or "dpm2"; null: sampling.solver (DiffusionNFT rolls
    out with dpm2 and evaluates with Euler)."""
    time_limit_s: float | None = None
    """Stop after the step during which this run's training time (perf/train_s: its steps' wall time, evaluations
    excluded, checkpoint saves included, counted from this start or resume) passes this many seconds, evaluating and
    checkpointing there as at total_steps (asynchronously, a step already handed to the learners behind it is trained
    first, and the run stops after that one; synchronously, likewise the batch submitted in time before the step's
    weight broadcast, when the limit passed during that broadcast: it rolled out for nothing, and the final evaluation
    waited behind it; a learner death after the limit passed rewinds, and the steps the rewind dropped are trained
    again up to the one the run was stopping at and no further, a batch committed (also when the death is found
    before it is formed) or a step queued included); null: no limit (total_steps only)."""
    resume: str = "auto"
    """"auto" continues the run named run_name from its newest checkpoint, if it has one; "never" starts over
    (and refuses a run directory that holds checkpoints); or the path of a checkpoint (or of a run's checkpoints)."""
    ema_decay: float = 0.0
    """flow_grpo's and DiffusionNFT's train.ema: an EMA of the trained adapter ("ema"), updated after optimizer steps
    with decay min((1 + n)/(10 + n), ema_decay) at step n, evaluated and exported by default; 0: none (both: 0.9)."""
    ema_every: int = 1
    """Update the EMA after every this many optimizer steps (update_step_interval: flow_grpo's 8, DiffusionNFT's 1)."""
    ema_blends: int = 1
    """Times each EMA update blends (a decay of d^blends): flow_grpo calls its train.ema once per micro-batch, so
    train.gradient_accumulation_steps times per optimizer step (2 in its geneval_sd3 recipe); DiffusionNFT's 1."""
    memory_check: bool = True
    """On GPU clusters, refuse at start a config whose memory plan (tools/plan.py) exceeds one GPU."""
    gpu_memory_gib: float | None = None
    """GPU memory the plan is checked against; null: the total memory of the cluster's first GPU."""

    @property
    def run_dir(self) -> str:
        """<output_dir>/<run_name>: everything this run writes."""
        return os.path.join(self.output_dir, self.run_name) if self.run_name else self.output_dir

    def validate(self, prefix: str = "trainer") -> None:
        # An empty output_dir puts the run in the working directory but its TensorBoard under / (the logdir template).
        _need(self.output_dir.strip() != "", f"{prefix}.output_dir", self.output_dir, "a directory path (not empty)")
        _need(self.logdir.strip() != "", f"{prefix}.logdir", self.logdir, "a directory path (not empty)")
        # Below 2**32, seed x 1_000_003 + the sample counter stays under 2**63 however many samples a run draws.
        _need(0 <= self.seed < SEED_LIMIT, f"{prefix}.seed", self.seed,
              "an integer in [0, 2**32) (sample seeds are trainer.seed x 1_000_003 + a sample counter, and torch "
              "seeds must fit in 64 bits)")
        _need(
            self.run_name is None or (self.run_name not in ("", ".", "..") and "/" not in self.run_name),
            f"{prefix}.run_name", self.run_name, "null or a directory name (no '/')",
        )
        _need(
            self.resume in ("auto", "never") or os.path.exists(self.resume),
            f"{prefix}.resume", self.resume, "'auto', 'never', or an existing checkpoint directory",
        )
        _need(self.total_steps >= 1, f"{prefix}.total_steps", self.total_steps, "an integer >= 1")
        _need(self.save_every >= 0, f"{prefix}.save_every", self.save_every, "an integer >= 0")
        _need(self.keep_checkpoints >= 1, f"{prefix}.keep_checkpoints", self.keep_checkpoints, "an integer >= 1")
        _need(self.max_skipped_steps >= 0, f"{prefix}.max_skipped_steps", self.max_skipped_steps, "an integer >= 0 (0: never stop)")
        _need(self.eval_every >= 0, f"{prefix}.eval_every", self.eval_every, "an integer >= 0")
        _need(self.eval_num_steps is None or self.eval_num_steps >= 1, f"{prefix}.eval_num_steps", self.eval_num_steps,
              "null (sampling.num_steps) or an integer >= 1")
        _need(self.eval_guidance_scale is None or self.eval_guidance_scale >= 1.0, f"{prefix}.eval_guidance_scale",
              self.eval_guidance_scale, "null (sampling.guidance_scale) or a float >= 1.0 (1.0 disables CFG)")
        _need(self.eval_solver is None or self.eval_solver in SOLVERS, f"{prefix}.eval_solver", self.eval_solver,
              f"null (sampling.solver) or one of {list(SOLVERS)}")
        _need(self.time_limit_s is None or self.time_limit_s > 0, f"{prefix}.time_limit_s", self.time_limit_s,
              "null (no limit) or seconds > 0")
        _need(0 <= self.ema_decay < 1, f"{prefix}.ema_decay", self.ema_decay, "a float in [0, 1) (0: no EMA)")
        _need(self.ema_every >= 1, f"{prefix}.ema_every", self.ema_every, "an integer >= 1")
        _need(self.ema_blends >= 1, f"{prefix}.ema_blends", self.ema_blends, "an integer >= 1")
        _need(self.gpu_memory_gib is None or self.gpu_memory_gib > 0, f"{prefix}.gpu_memory_gib", self.gpu_memory_gib,
              "null or a float > 0")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard scalars and image grids under trainer.logdir."""
    ray_metrics: bool = True
    """Export key figures as ray.util.metrics so the Ray dashboard shows them."""
    progress_bar: bool = True
    """A progress bar on the driver (off: one log line per step)."""
    log_every: int = 1
    """Write TensorBoard (and W&B) scalars every this many steps; evaluations' are always written."""
    wandb: bool = False
    """Also log to Weights & Biases (pip install wandb; WANDB_MODE=offline writes under the run dir without an account)."""
    wandb_project: str = "rayflow"
    """W&B project; the run's name (trainer.run_name) is its W&B id, so a resumed run continues it."""
    wandb_entity: str | None = None
    """W&B entity (team or user); null: the account's default."""

    def validate(self, prefix: str = "logging") -> None:
        import importlib.util

        _need(self.log_every >= 1, f"{prefix}.log_every", self.log_every, "an integer >= 1")
        _need(not self.wandb or importlib.util.find_spec("wandb") is not None, f"{prefix}.wandb", self.wandb,
              "false, unless the wandb package is installed (pip install wandb)")


def _validate_restarts(section: Any, prefix: str) -> None:
    """The restart budget of a section whose actors are replaced when they die (max_restarts per restart_window_s)."""
    _need(section.max_restarts >= 0, f"{prefix}.max_restarts", section.max_restarts, "an integer >= 0")
    _need(section.restart_window_s >= 0, f"{prefix}.restart_window_s", section.restart_window_s, "seconds >= 0 (0: the whole run)")


def _validate_custom_resources(resources: dict[str, float], key: str) -> None:
    """A role's custom Ray resources: finite amounts >= 0 per bundle (Ray would fail the bundle, or wait forever)."""
    for name, amount in resources.items():
        _need(isinstance(amount, (int, float)) and not isinstance(amount, bool) and math.isfinite(amount) and amount >= 0,
              f"{key}.{name}", amount, "a finite number >= 0 (the amount of that custom Ray resource per bundle)")


def _validate_resources(section: Any, prefix: str) -> None:
    _validate_custom_resources(section.resources, f"{prefix}.resources")
    _need(section.gpus_per_rank is None or section.gpus_per_rank >= 0, f"{prefix}.gpus_per_rank", section.gpus_per_rank, "null or a float >= 0")
    _need(section.cpus_per_rank >= 0, f"{prefix}.cpus_per_rank", section.cpus_per_rank, "a float >= 0")
    _need(section.threads_per_rank >= 1, f"{prefix}.threads_per_rank", section.threads_per_rank, "an integer >= 1")
    _need(
        section.placement_strategy in PLACEMENT_STRATEGIES,
        f"{prefix}.placement_strategy", section.placement_strategy, f"one of {list(PLACEMENT_STRATEGIES)}",
    )
