"""Structured, validated configuration.

A run's config is a recipe YAML plus CLI dotlist overrides (`trainer.total_steps=3`), merged by
omegaconf and then converted into the dataclasses below. Unknown keys, wrong types and
impossible values fail at load time with one message naming the key, the value given, and
what is allowed. Each component receives its own section, never the root.
"""

from __future__ import annotations

import dataclasses
import os
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rayflow.algorithms.advantages import STAT_TRACKING
from rayflow.algorithms.diffusion_nft import ADV_MODES
from rayflow.errors import ConfigError
from rayflow.paths import recipe
from rayflow.sampling.window import window_bounds
from rayflow.types import SamplingParams

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
    """Family of the tiny offline model when path is null: "qwen_image", "sd3" or "flux"."""
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
    """Samples per rollout request; a prompt's group is split into requests of this size."""
    gpus_per_rank: float | None = None
    """GPUs per rollout rank; null: 1 when the cluster has GPUs, else 0."""
    cpus_per_rank: float = 1.0
    """CPUs reserved per rollout rank."""
    threads_per_rank: int = 1
    """torch intra-op threads per rank on CPU."""
    placement_strategy: str = "PACK"
    """Placement-group strategy of a replica's ranks."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per rollout rank (e.g. {"gpu_node": 1} to keep them on one node type)."""
    collective_timeout_s: float = 300.0
    """A collective that takes longer fails with the rank and node named, instead of hanging."""
    max_restarts: int = 3
    """Times a replica that died is replaced by a new one (per replica, within restart_window_s); then the run goes on without it."""
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
        _need(self.max_restarts >= 0, f"{prefix}.max_restarts", self.max_restarts, "an integer >= 0")
        _need(self.stall_timeout_s > 0, f"{prefix}.stall_timeout_s", self.stall_timeout_s, "seconds > 0")
        _need(self.stall_factor >= 1, f"{prefix}.stall_factor", self.stall_factor, "a number >= 1")
        _need(self.restart_window_s >= 0, f"{prefix}.restart_window_s", self.restart_window_s, "seconds >= 0 (0: the whole run)")
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
    """GPUs per learner rank; null: 1 when the cluster has GPUs, else 0."""
    cpus_per_rank: float = 1.0
    """CPUs reserved per learner rank."""
    threads_per_rank: int = 1
    """torch intra-op threads per learner rank."""
    placement_strategy: str = "PACK"
    """Placement-group strategy of the learner ranks."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per learner rank (e.g. {"gpu_node": 1} to keep them on one node type)."""
    stall_timeout_s: float = 1800.0
    """Watchdog floor for a train step: one not done after max(this, rollout.stall_factor x the longest measured
    step) stops the run loudly, naming the late ranks (continue from the last checkpoint with trainer.resume=auto)."""
    max_restarts: int = 3
    """Times the learner group is started again in its bundles after a rank died (within restart_window_s), the run
    rewound to the newest checkpoint; then the run stops, naming the rank."""
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
        _need(self.stall_timeout_s > 0, f"{prefix}.stall_timeout_s", self.stall_timeout_s, "seconds > 0")
        _need(self.max_restarts >= 0, f"{prefix}.max_restarts", self.max_restarts, "an integer >= 0")
        _need(self.restart_window_s >= 0, f"{prefix}.restart_window_s", self.restart_window_s, "seconds >= 0 (0: the whole run)")
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
    """DiffusionNFT: rollout timesteps trained per sample; null: all of them."""
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
        _need(
            self.adv_mode == "all" or self.name == "diffusion_nft", f"{prefix}.adv_mode", self.adv_mode,
            "'all' for algorithm.name=flow_grpo (adv_mode is DiffusionNFT's)",
        )
        _need(self.clip_range > 0, f"{prefix}.clip_range", self.clip_range, "a float > 0")
        _need(self.kl_beta >= 0, f"{prefix}.kl_beta", self.kl_beta, "a float >= 0")
        _need(self.kl_type in ("flow_grpo", "transition"), f"{prefix}.kl_type", self.kl_type, "'flow_grpo' or 'transition'")
        _need(not self.ratio_norm or self.name == "flow_grpo", f"{prefix}.ratio_norm", self.ratio_norm,
              "false for algorithm.name=diffusion_nft (GRPO-Guard normalises FlowGRPO's importance ratio; NFT has none)")
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
    """CPUs reserved per reward worker."""
    gpus_per_worker: float = 0.0
    """GPUs per reward worker (for model-based rewards)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per reward worker (e.g. {"gpu_node": 1} to keep them on one node type)."""
    max_retries: int = 1
    """A reward call that raises is retried this many times, then the run stops (never silent zeros)."""
    max_restarts: int = 3
    """Times a reward worker that died or stalled is replaced (per worker, within restart_window_s); its calls are
    re-issued without spending a retry. Then the run goes on without it."""
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
        _need(self.num_workers >= 1, f"{prefix}.num_workers", self.num_workers, "an integer >= 1")
        _need(self.batch_size >= 1, f"{prefix}.batch_size", self.batch_size, "an integer >= 1")
        _need(self.max_retries >= 0, f"{prefix}.max_retries", self.max_retries, "an integer >= 0")
        _need(self.max_restarts >= 0, f"{prefix}.max_restarts", self.max_restarts, "an integer >= 0")
        _need(self.restart_window_s >= 0, f"{prefix}.restart_window_s", self.restart_window_s, "seconds >= 0 (0: the whole run)")
        _need(self.stall_timeout_s > 0, f"{prefix}.stall_timeout_s", self.stall_timeout_s, "seconds > 0")
        _need(self.stall_factor >= 1, f"{prefix}.stall_factor", self.stall_factor, "a number >= 1")
        _need(self.max_outage_s >= 0, f"{prefix}.max_outage_s", self.max_outage_s, "a number of seconds >= 0")


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
    """A group staler than max_staleness is "regenerate"d or "drop"ped (and counted)."""

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
    """GPUs of the weight-sync actor (the broadcast source: nccl needs it on a GPU of its own);
    null: 1 when the cluster has GPUs, else 0."""
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
        _need(self.max_restarts >= 0, f"{prefix}.max_restarts", self.max_restarts, "an integer >= 0")
        _need(self.restart_window_s >= 0, f"{prefix}.restart_window_s", self.restart_window_s, "seconds >= 0 (0: the whole run)")


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
    """Colocated: GPUs per device's actor; null: 1 when the cluster has GPUs, else 0."""
    resources: dict[str, float] = field(default_factory=dict)
    """Colocated: custom Ray resources per device's actor."""

    def validate(self, prefix: str = "placement") -> None:
        _need(self.mode in PLACEMENT_MODES, f"{prefix}.mode", self.mode, f"one of {list(PLACEMENT_MODES)}")
        _need(self.cpus_per_device >= 0, f"{prefix}.cpus_per_device", self.cpus_per_device, "a float >= 0")
        _need(self.gpus_per_device is None or self.gpus_per_device >= 0, f"{prefix}.gpus_per_device",
              self.gpus_per_device, "null or a float >= 0")

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


@dataclass
class TrainerConfig:
    total_steps: int = 100
    """Optimizer steps."""
    seed: int = 0
    """The run seed: prompt order, sample seeds, LoRA init."""
    output_dir: str = "outputs"
    """Runs go under <output_dir>/<run_name>; give an absolute path under `ray job submit`."""
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
    """Evaluate (ODE, fixed prompts and seeds, an image grid) every this many steps (0: never)."""
    eval_at_start: bool = False
    """Also evaluate the untrained policy, as step 0 of a new run: the baseline the eval curve starts from."""
    time_limit_s: float | None = None
    """Stop after the step during which this run's training time (perf/train_s: its steps' wall time, evaluations
    excluded, counted from this start or resume) passes this many seconds, evaluating and checkpointing there as
    at total_steps; null: no limit (total_steps only)."""
    resume: str = "auto"
    """"auto" continues the run named run_name from its newest checkpoint, if it has one; "never" starts over
    (and refuses a run directory that holds checkpoints); or the path of a checkpoint (or of a run's checkpoints)."""
    ema_decay: float = 0.0
    """flow_grpo's train.ema: an EMA of the trained adapter ("ema"), updated after optimizer steps with decay
    min((1 + n)/(10 + n), ema_decay) at step n, evaluated and exportable (--adapter ema); 0: none (flow_grpo: 0.9)."""
    ema_every: int = 1
    """Update the EMA after every this many optimizer steps (flow_grpo's update_step_interval: 8)."""
    memory_check: bool = True
    """On GPU clusters, refuse at start a config whose memory plan (tools/plan.py) exceeds one GPU."""
    gpu_memory_gib: float | None = None
    """GPU memory the plan is checked against; null: the total memory of the cluster's first GPU."""

    @property
    def run_dir(self) -> str:
        """<output_dir>/<run_name>: everything this run writes."""
        return os.path.join(self.output_dir, self.run_name) if self.run_name else self.output_dir

    def validate(self, prefix: str = "trainer") -> None:
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
        _need(self.time_limit_s is None or self.time_limit_s > 0, f"{prefix}.time_limit_s", self.time_limit_s,
              "null (no limit) or seconds > 0")
        _need(0 <= self.ema_decay < 1, f"{prefix}.ema_decay", self.ema_decay, "a float in [0, 1) (0: no EMA)")
        _need(self.ema_every >= 1, f"{prefix}.ema_every", self.ema_every, "an integer >= 1")
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
    """Write TensorBoard (and W&B) scalars every this many steps."""
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


@dataclass
class RayflowConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cfg: CFGConfig = field(default_factory=CFGConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate(prefix=_key(f.name))
        self._validate_size()
        self._validate_algorithm()
        self._validate_placement()
        _need(
            self.learner.train_mode == "lora" or self.sync.mode == "merged" or self.placement.colocated,
            "sync.mode", self.sync.mode,
            "'merged' with learner.train_mode=full (the rollout ranks receive the plain transformer weights; "
            "'lora' ships an adapter, which full fine-tuning has not)",
        )
        minibatch = self.algorithm.batch_size // self.algorithm.num_minibatches
        if self.algorithm.num_minibatches > 1:
            _need(
                minibatch % self.learner.world_size == 0, "algorithm.num_minibatches", self.algorithm.num_minibatches,
                f"a divisor of the batch whose mini-batches split evenly over the learner ranks "
                f"({self.algorithm.batch_size} / num_minibatches a multiple of learner.world_size = {self.learner.world_size})",
            )
        _need(
            minibatch % self.learner.world_size == 0, "learner.world_size", self.learner.world_size,
            f"a divisor of the batch (algorithm.group_size x prompts_per_step = {self.algorithm.batch_size})",
        )
        per_rank = minibatch // self.learner.world_size
        _need(
            per_rank % self.learner.micro_batch_size == 0,
            "learner.micro_batch_size", self.learner.micro_batch_size,
            f"a divisor of the per-rank mini-batch (algorithm.group_size x prompts_per_step / num_minibatches / learner.world_size "
            f"= {self.algorithm.batch_size} / {self.algorithm.num_minibatches} / {self.learner.world_size})",
        )

    def _validate_placement(self) -> None:
        if not self.placement.colocated:
            _need(not self.learner.offload_optimizer_during_rollout, "learner.offload_optimizer_during_rollout", True,
                  "false unless placement.mode=colocated (disaggregated learners never sample)")
            return
        devices = self.rollout.num_replicas * self.rollout.cfg_parallel_size
        where = "in placement.mode=colocated"
        _need(self.learner.world_size == devices, "learner.world_size", self.learner.world_size,
              f"rollout.num_replicas x rollout.cfg_parallel_size = {devices} {where} (each device holds one learner "
              f"rank and one rollout rank)")
        _need(self.async_.max_staleness == 0, "async.max_staleness", self.async_.max_staleness,
              f"0 {where} (a device samples or trains, never both at once: there is nothing to overlap; "
              f"placement.mode=disaggregated overlaps rollout and training)")
        _need(self.sync.mode == "lora", "sync.mode", self.sync.mode,
              f"'lora' {where} (rollouts sample under the learner's own adapter: nothing is merged or sent)")

    def _validate_size(self) -> None:
        from rayflow.models.base import model_class, pipeline_class_of

        # The model directory may exist only on the workers of a cluster; then its loader checks again.
        if self.model.path is not None and not os.path.isfile(os.path.join(self.model.path, "model_index.json")):
            return
        from rayflow.models.tiny import TINY_PIPELINES

        pipeline = TINY_PIPELINES[self.model.tiny_arch] if self.model.path is None else pipeline_class_of(self.model.path)
        multiple = model_class(pipeline).size_multiple()
        for key in ("height", "width"):
            value = getattr(self.sampling, key)
            _need(value % multiple == 0, f"sampling.{key}", value, f"a positive multiple of {multiple} (VAE scale x patch size of {pipeline})")

    def _validate_algorithm(self) -> None:
        s = self.sampling
        if self.algorithm.name == "flow_grpo":
            _need(s.sde_type != "ode", "sampling.sde_type", s.sde_type, "'sde' or 'cps' for algorithm.name=flow_grpo (it trains on stochastic steps)")
            if s.sde_window_size is None:
                trained = s.resolved_sde_steps()
            else:  # every step some window position may cover
                lo, hi = window_bounds(s)
                trained = list(range(lo, hi))
            _need(bool(trained), "sampling.sde_step_indices", s.sde_step_indices, "at least one stochastic step for flow_grpo")
            last = int(s.num_steps * self.algorithm.timestep_fraction)
            _need(
                s.sde_window_size is None and any(j < last for j in trained) or s.sde_window_size is not None and hi - s.sde_window_size < last,
                "algorithm.timestep_fraction", self.algorithm.timestep_fraction,
                f"a fraction keeping at least one stochastic step (steps j < int(num_steps x fraction) are trained; "
                f"every window position or the first stochastic step must lie below it; num_steps={s.num_steps})",
            )
            _need(not self.algorithm.ratio_norm or s.sde_type == "sde", "algorithm.ratio_norm", self.algorithm.ratio_norm,
                  "false unless sampling.sde_type=sde (GRPO-Guard normalises the Gaussian log-ratio of Flow-GRPO's SDE step)")
            needed = sorted({i for t in trained for i in (t, t + 1)} - set(s.resolved_return_steps()))
            _need(not needed, "sampling.return_step_indices", s.return_step_indices, f"null or a list that includes x_i and x_(i+1) of every stochastic step (missing {needed})")
        else:
            _need(s.sde_type == "ode", "sampling.sde_type", s.sde_type, "'ode' for algorithm.name=diffusion_nft (it rolls out deterministically)")
            # FLUX's embedded guidance is an input of the one conditional forward the learner trains too: not CFG.
            _need(
                s.guidance_scale == 1.0 or self.cfg.policy == "embedded", "sampling.guidance_scale", s.guidance_scale,
                "1.0 for algorithm.name=diffusion_nft (it trains the conditional velocity without CFG, so CFG "
                "rollouts would come from another policy than the one trained; DiffusionNFT samples CFG-free)",
            )
            _need(s.num_steps in s.resolved_return_steps(), "sampling.return_step_indices", s.return_step_indices, f"null or a list that includes the final latent {s.num_steps}")


def _validate_resources(section: Any, prefix: str) -> None:
    _need(section.gpus_per_rank is None or section.gpus_per_rank >= 0, f"{prefix}.gpus_per_rank", section.gpus_per_rank, "null or a float >= 0")
    _need(section.cpus_per_rank >= 0, f"{prefix}.cpus_per_rank", section.cpus_per_rank, "a float >= 0")
    _need(section.threads_per_rank >= 1, f"{prefix}.threads_per_rank", section.threads_per_rank, "an integer >= 1")
    _need(
        section.placement_strategy in PLACEMENT_STRATEGIES,
        f"{prefix}.placement_strategy", section.placement_strategy, f"one of {list(PLACEMENT_STRATEGIES)}",
    )


# ---------------------------------------------------------------------------------------------
# Loading: YAML + dotlist -> plain data (omegaconf) -> dataclasses, checked field by field.

def _key(field_name: str) -> str:
    """YAML key of a dataclass field ("async" is a Python keyword, so its field is async_)."""
    return field_name[:-1] if field_name.endswith("_") else field_name


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {[_key(f.name) for f in dataclasses.fields(tp)]}"
    return {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError:
                pass
        raise ConfigError(key, value, _describe(tp))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, value, _describe(tp))
        return _build(tp, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, value, _describe(tp))
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is Any:
        if tp is not Any and not isinstance(value, dict):
            raise ConfigError(key, value, _describe(tp))
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise ConfigError(key, value, _describe(tp))


REMOVED_KEYS = {
    "sync.apply_at": "nothing, the key is gone: set async.partial_rollout instead (true = the old apply_at=step, new "
                     "weights reach a trajectory at its next denoising-step boundary; false = the old apply_at=request, "
                     "new weights between requests only)",
}
"""Keys a config no longer has, with what to write instead."""


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {_key(f.name): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if key in REMOVED_KEYS:
            raise ConfigError(key, value, REMOVED_KEYS[key])
        if name not in fields:
            raise ConfigError(key, value, f"a known key; {prefix or 'the config'} has {sorted(fields)}")
        f = fields[name]
        kwargs[f.name] = _convert(hints[f.name], value, key)
    return cls(**kwargs)


def from_dict(data: dict) -> RayflowConfig:
    """A validated RayflowConfig from plain data (as read from YAML)."""
    cfg = _build(RayflowConfig, data, "")
    cfg.validate()
    return cfg


BASE_KEY = "base"
"""A recipe's top-level `base: other.yaml` (relative to the recipe): that recipe's keys, then this one's on top."""


def _read_recipe(path: str, key: str = "--config", including: tuple[str, ...] = ()) -> DictConfig:
    """A recipe YAML with its relative paths resolved against its own directory, merged over its `base` (if any)."""
    try:
        data = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(key, path, "an existing YAML file") from None
    except (OmegaConfBaseException, OSError, yaml.YAMLError) as e:
        # Malformed YAML, or a top-level scalar.
        raise ConfigError(key, path, f"a YAML mapping of sections ({' '.join(str(e).split())})") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(key, path, "a YAML mapping of sections, not a list")
    here = os.path.dirname(os.path.abspath(path))
    data = OmegaConf.to_container(data, resolve=False)
    base = data.pop(BASE_KEY, None)
    data = OmegaConf.create(_relative_to(data, here))
    if base is None:
        return data
    base_key = f"{path}: {BASE_KEY}"
    if not isinstance(base, str):
        raise ConfigError(base_key, base, "the path of another recipe YAML, relative to this one")
    base_path = os.path.normpath(os.path.join(here, base))
    if base_path in including + (os.path.abspath(path),):
        raise ConfigError(base_key, base, "a recipe that does not include itself through its bases")
    return OmegaConf.merge(_read_recipe(base_path, base_key, including + (os.path.abspath(path),)), data)


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RayflowConfig:
    """Read a recipe YAML (optional; its `base`s first), apply dotlist overrides, convert and validate."""
    base = _read_recipe(path) if path else OmegaConf.create({})
    try:
        data = OmegaConf.to_container(OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides or []))), resolve=False)
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError("overrides", str(e).splitlines()[0], "key=value overrides") from None
    # Unknown keys and wrong types are reported as given, before the defaults are merged in.
    _build(RayflowConfig, _strip_interpolations(data), "")
    if isinstance(data.get("trainer"), dict) and data["trainer"].get("run_name") is None:
        data["trainer"].pop("run_name", None)
    data.setdefault("trainer", {}).setdefault("run_name", default_run_name(path))
    try:
        # Interpolations such as ${trainer.output_dir} resolve against the defaults too.
        full = OmegaConf.merge(OmegaConf.create(to_dict(RayflowConfig())), OmegaConf.create(data))
        resolved = OmegaConf.to_container(full, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(path or "overrides", str(e).splitlines()[0], "interpolations of existing keys") from None
    return from_dict(resolved)


PATH_KEYS = (("model", "path"), ("data", "prompts"), ("data", "eval_prompts"), ("trainer", "output_dir"), ("trainer", "resume"))
"""Keys that hold paths; a relative one in a recipe YAML is relative to the YAML's directory."""


def _relative_to(data: dict, base_dir: str) -> dict:
    """`data` (a recipe YAML) with its relative paths made absolute against `base_dir`: PATH_KEYS, and the
    `path` kwarg of every reward function. Values that are not paths ("auto", interpolations) stay."""

    def fix(section: dict, key: str) -> None:
        value = section.get(key)
        if isinstance(value, str) and value and "${" not in value and value not in ("auto", "never") \
                and not os.path.isabs(os.path.expanduser(value)):
            section[key] = os.path.normpath(os.path.join(base_dir, value))

    for section, key in PATH_KEYS:
        if isinstance(data.get(section), dict):
            fix(data[section], key)
    functions = data.get("reward", {}).get("functions") if isinstance(data.get("reward"), dict) else None
    for fn in functions if isinstance(functions, list) else []:
        if isinstance(fn, dict) and isinstance(fn.get("kwargs"), dict):
            fix(fn["kwargs"], "path")
    return data


def default_run_name(config_path: str | None) -> str:
    """<recipe>-<YYYYmmdd>-<HHMMSS>: a new directory per run, so a run never resumes another by accident."""
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _strip_interpolations(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _strip_interpolations(v) for k, v in data.items() if not (isinstance(v, str) and "${" in v)}
    return data


def to_dict(cfg: Any) -> dict:
    """Plain data of a config, with YAML keys (async, not async_)."""
    if dataclasses.is_dataclass(cfg):
        return {_key(f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def to_yaml(cfg: RayflowConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))
