"""Structured, validated configuration.

A run's config is a recipe YAML plus CLI dotlist overrides (`trainer.total_steps=3`), merged by
omegaconf and then converted into the dataclasses below. Unknown keys, wrong types and
impossible values fail at load time with one message naming the key, the value given, and
what is allowed. Each component receives its own section, never the root.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rayflow.errors import ConfigError
from rayflow.types import SamplingParams

DTYPES = ("float32", "bfloat16", "float16")
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


def _need(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


@dataclass
class ModelConfig:
    path: str | None = None
    """A diffusers pipeline directory; null builds (once, then cached) the tiny offline Qwen-Image."""
    tiny_size: str = "tiny"
    """Size of the tiny offline model when path is null: "tiny" or "small"."""
    tiny_seed: int = 0
    """Weight seed of the tiny offline model."""
    cache_dir: str = "~/.cache/rayflow"
    """Where the tiny offline model is cached."""
    dtype: str = "float32"
    """Weights and activations dtype: float32, bfloat16 or float16."""

    def validate(self, prefix: str = "model") -> None:
        from rayflow.models.tiny import SPECS

        _need(self.dtype in DTYPES, f"{prefix}.dtype", self.dtype, f"one of {list(DTYPES)}")
        _need(self.tiny_size in SPECS, f"{prefix}.tiny_size", self.tiny_size, f"one of {sorted(SPECS)}")


@dataclass
class CFGConfig:
    policy: str = "true_cfg"
    """"true_cfg" (Qwen-Image's norm-rescaled CFG), "standard", "none" or "dual_negative"."""
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

    def make_policy(self):
        from rayflow.cfg.policy import DualNegativeCFG, make_policy

        extra = {}
        if self.policy == DualNegativeCFG.name:
            extra = {"avoid_prompt": self.avoid_prompt, "avoid_scale": self.avoid_scale}
        return make_policy(self.policy, parallel_arithmetic=self.parallel_arithmetic, **extra)


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
    """Times a replica that died is replaced by a new one (per replica); then the run goes on without it."""
    batch_branches: bool = False
    """A rank with several CFG branches runs them in one batched forward: faster, but not bit-exact
    with the single-process sampler (which runs one forward per branch)."""

    def validate(self, prefix: str = "rollout") -> None:
        _need(self.num_replicas >= 1, f"{prefix}.num_replicas", self.num_replicas, "an integer >= 1")
        _need(self.cfg_parallel_size >= 1, f"{prefix}.cfg_parallel_size", self.cfg_parallel_size, "an integer >= 1")
        _need(self.micro_batch_size >= 1, f"{prefix}.micro_batch_size", self.micro_batch_size, "an integer >= 1")
        _need(self.max_restarts >= 0, f"{prefix}.max_restarts", self.max_restarts, "an integer >= 0")
        _validate_resources(self, prefix)


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
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: float = 8.0
    """LoRA alpha (the adapter is scaled by alpha / r)."""
    lora_targets: list[str] | None = None
    """Module names to adapt; null: the model's attention projections (incl. to_out.0 and the text stream)."""
    lora_init: str = "gaussian"
    """peft init_lora_weights: "gaussian" or "default" (B = 0 either way, so the adapter starts as identity)."""
    mixed_precision: str = "none"
    """"none" or "bf16" (FSDP2 MixedPrecisionPolicy: bf16 params, fp32 reduce)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in the backward pass (memory for compute)."""
    shard: str = "auto"
    """FSDP2 sharding: "auto" shards when there is more than one rank (or bf16 mixed precision, which
    FSDP2 applies); one full-precision rank trains the plain model, as the reference trainer does.
    "always" shards even a single rank."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after the forward (False keeps them until the backward)."""
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

    @property
    def sharded(self) -> bool:
        """Whether the learner applies FSDP2 (see `shard`)."""
        return self.shard == "always" or self.world_size > 1 or self.mixed_precision != "none"

    def validate(self, prefix: str = "learner") -> None:
        _need(self.world_size >= 1, f"{prefix}.world_size", self.world_size, "an integer >= 1")
        _need(self.lr > 0, f"{prefix}.lr", self.lr, "a float > 0")
        _need(self.weight_decay >= 0, f"{prefix}.weight_decay", self.weight_decay, "a float >= 0")
        _need(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"{prefix}.betas", self.betas, "two floats in [0, 1)",
        )
        _need(self.max_grad_norm > 0, f"{prefix}.max_grad_norm", self.max_grad_norm, "a float > 0")
        _need(self.micro_batch_size >= 1, f"{prefix}.micro_batch_size", self.micro_batch_size, "an integer >= 1")
        _need(self.lora_rank >= 1, f"{prefix}.lora_rank", self.lora_rank, "an integer >= 1")
        _need(self.lora_alpha > 0, f"{prefix}.lora_alpha", self.lora_alpha, "a float > 0")
        _need(
            self.lora_targets is None or len(self.lora_targets) > 0,
            f"{prefix}.lora_targets", self.lora_targets, "null or a non-empty list of module names",
        )
        _need(self.lora_init in ("gaussian", "default"), f"{prefix}.lora_init", self.lora_init, "'gaussian' or 'default'")
        _need(self.mixed_precision in ("none", "bf16"), f"{prefix}.mixed_precision", self.mixed_precision, "'none' or 'bf16'")
        _need(self.shard in ("auto", "always"), f"{prefix}.shard", self.shard, "'auto' or 'always'")
        _validate_resources(self, prefix)


ALGORITHMS = ("flow_grpo", "diffusion_nft")


@dataclass
class AlgorithmConfig:
    name: str = "flow_grpo"
    """"flow_grpo" or "diffusion_nft"."""
    group_size: int = 8
    """G: samples per prompt; advantages are normalised within a group."""
    prompts_per_step: int = 2
    """Prompts (groups) per optimizer step; batch size = prompts_per_step x group_size."""
    global_std: bool = False
    """Normalise advantages by the std over the whole batch instead of per group."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to +-adv_clip_max."""
    clip_range: float = 1e-4
    """FlowGRPO: PPO ratio clip epsilon."""
    kl_beta: float = 0.0
    """Weight of the KL to the base model (adapters disabled); 0 turns it off."""
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

    @property
    def batch_size(self) -> int:
        return self.group_size * self.prompts_per_step

    @property
    def needs_ema_rollout(self) -> bool:
        return self.name == "diffusion_nft"

    def validate(self, prefix: str = "algorithm") -> None:
        _need(self.name in ALGORITHMS, f"{prefix}.name", self.name, f"one of {list(ALGORITHMS)}")
        _need(self.group_size >= 2, f"{prefix}.group_size", self.group_size, "an integer >= 2 (advantages compare group members)")
        _need(self.prompts_per_step >= 1, f"{prefix}.prompts_per_step", self.prompts_per_step, "an integer >= 1")
        _need(self.adv_clip_max > 0, f"{prefix}.adv_clip_max", self.adv_clip_max, "a float > 0")
        _need(self.clip_range > 0, f"{prefix}.clip_range", self.clip_range, "a float > 0")
        _need(self.kl_beta >= 0, f"{prefix}.kl_beta", self.kl_beta, "a float >= 0")
        _need(self.nft_beta > 0, f"{prefix}.nft_beta", self.nft_beta, "a float > 0")
        _need(
            self.nft_timesteps is None or self.nft_timesteps >= 1,
            f"{prefix}.nft_timesteps", self.nft_timesteps, "null or an integer >= 1",
        )
        _need(self.ema_flat >= 0, f"{prefix}.ema_flat", self.ema_flat, "an integer >= 0")
        _need(self.ema_uprate >= 0, f"{prefix}.ema_uprate", self.ema_uprate, "a float >= 0")
        _need(0 <= self.ema_uphold < 1, f"{prefix}.ema_uphold", self.ema_uphold, "a float in [0, 1)")


@dataclass
class RewardFnConfig:
    name: str = "color"
    """A registered reward (see rayflow.rewards)."""
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the reward (e.g. url for "http")."""


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
    """Times Ray restarts a reward worker whose process died (its calls meanwhile are retried elsewhere)."""

    def validate(self, prefix: str = "reward") -> None:
        from rayflow.rewards import registered_rewards

        _need(len(self.functions) >= 1, f"{prefix}.functions", self.functions, "at least one reward function")
        for i, fn in enumerate(self.functions):
            names = registered_rewards()
            _need(fn.name in names, f"{prefix}.functions[{i}].name", fn.name, f"one of {names}")
        _need(self.num_workers >= 1, f"{prefix}.num_workers", self.num_workers, "an integer >= 1")
        _need(self.batch_size >= 1, f"{prefix}.batch_size", self.batch_size, "an integer >= 1")
        _need(self.max_retries >= 0, f"{prefix}.max_retries", self.max_retries, "an integer >= 0")
        _need(self.max_restarts >= 0, f"{prefix}.max_restarts", self.max_restarts, "an integer >= 0")


@dataclass
class AsyncConfig:
    max_staleness: int = 0
    """0: synchronous and on-policy (bit-identical to the reference trainer); k: trajectories may be
    up to k policy versions behind the learner."""
    partial_rollout: bool = True
    """A trajectory in flight when weights change continues under the new weights (per-step versions)."""
    over_stale: str = "regenerate"
    """A group staler than max_staleness is "regenerate"d or "drop"ped (and counted)."""

    def validate(self, prefix: str = "async") -> None:
        _need(self.max_staleness >= 0, f"{prefix}.max_staleness", self.max_staleness, "an integer >= 0")
        _need(self.over_stale in ("regenerate", "drop"), f"{prefix}.over_stale", self.over_stale, "'regenerate' or 'drop'")


@dataclass
class SyncConfig:
    mode: str = "lora"
    """"lora" ships the rollout adapter; "merged" folds it into the transformer weights and ships those."""
    bucket_mb: float = 64.0
    """Broadcast bucket size."""
    apply_at: str = "step"
    """Rollout ranks apply new weights at the next denoising "step" boundary or between "request"s."""
    verify_checksum: bool = False
    """Also compare a checksum per tensor between the source and every rank."""
    cpus: float = 1.0
    """CPUs of the weight-sync actor."""
    gpus: float | None = None
    """GPUs of the weight-sync actor (the broadcast source: nccl needs it on a GPU of its own);
    null: 1 when the cluster has GPUs, else 0."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per weight-sync actor (e.g. {"gpu_node": 1} to keep them on one node type)."""

    def validate(self, prefix: str = "sync") -> None:
        _need(self.mode in ("lora", "merged"), f"{prefix}.mode", self.mode, "'lora' or 'merged'")
        _need(self.bucket_mb > 0, f"{prefix}.bucket_mb", self.bucket_mb, "a float > 0")
        _need(self.apply_at in ("step", "request"), f"{prefix}.apply_at", self.apply_at, "'step' or 'request'")
        _need(self.cpus >= 0, f"{prefix}.cpus", self.cpus, "a float >= 0")
        _need(self.gpus is None or self.gpus >= 0, f"{prefix}.gpus", self.gpus, "null or a float >= 0")


@dataclass
class DataConfig:
    prompts: str = "recipes/prompts/colors.txt"
    """Training prompts: a .txt (one per line) or .jsonl ({"prompt": ...} per line)."""
    eval_prompts: str | None = None
    """Evaluation prompts; null: the first 4 training prompts."""
    shuffle: bool = True
    """Shuffle the prompts every epoch (with trainer.seed)."""


@dataclass
class TrainerConfig:
    total_steps: int = 100
    """Optimizer steps."""
    seed: int = 0
    """The run seed: prompt order, sample seeds, LoRA init."""
    output_dir: str = "outputs/run"
    """Checkpoints go under <output_dir>/checkpoints; give an absolute path under `ray job submit`."""
    logdir: str = "${trainer.output_dir}/tensorboard"
    """TensorBoard event files."""
    save_every: int = 10
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    eval_every: int = 10
    """Evaluate (ODE, fixed prompts and seeds, an image grid) every this many steps (0: never)."""
    resume: str = "auto"
    """"auto" continues from the newest checkpoint in output_dir, "never" starts over, or a checkpoint path."""

    def validate(self, prefix: str = "trainer") -> None:
        _need(self.total_steps >= 1, f"{prefix}.total_steps", self.total_steps, "an integer >= 1")
        _need(self.save_every >= 0, f"{prefix}.save_every", self.save_every, "an integer >= 0")
        _need(self.keep_checkpoints >= 1, f"{prefix}.keep_checkpoints", self.keep_checkpoints, "an integer >= 1")
        _need(self.eval_every >= 0, f"{prefix}.eval_every", self.eval_every, "an integer >= 0")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """Write TensorBoard scalars and image grids under trainer.logdir."""
    ray_metrics: bool = True
    """Export key figures as ray.util.metrics so the Ray dashboard shows them."""
    progress_bar: bool = True
    """A progress bar on the driver (off: one log line per step)."""
    log_every: int = 1
    """Write TensorBoard scalars every this many steps."""

    def validate(self, prefix: str = "logging") -> None:
        _need(self.log_every >= 1, f"{prefix}.log_every", self.log_every, "an integer >= 1")


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
        per_rank = self.algorithm.batch_size / self.learner.world_size
        _need(
            per_rank == int(per_rank) and int(per_rank) % self.learner.micro_batch_size == 0,
            "learner.micro_batch_size", self.learner.micro_batch_size,
            f"a divisor of the per-rank batch (algorithm.group_size x prompts_per_step / learner.world_size "
            f"= {self.algorithm.batch_size} / {self.learner.world_size})",
        )

    def _validate_size(self) -> None:
        from rayflow.models.base import model_class, pipeline_class_of

        # The model directory may exist only on the workers of a cluster; then its loader checks again.
        if self.model.path is not None and not os.path.isfile(os.path.join(self.model.path, "model_index.json")):
            return
        pipeline = "QwenImagePipeline" if self.model.path is None else pipeline_class_of(self.model.path)
        multiple = model_class(pipeline).size_multiple()
        for key in ("height", "width"):
            value = getattr(self.sampling, key)
            _need(value % multiple == 0, f"sampling.{key}", value, f"a positive multiple of {multiple} (VAE scale x patch size of {pipeline})")

    def _validate_algorithm(self) -> None:
        s = self.sampling
        if self.algorithm.name == "flow_grpo":
            _need(s.sde_type != "ode", "sampling.sde_type", s.sde_type, "'sde' or 'cps' for algorithm.name=flow_grpo (it trains on stochastic steps)")
            trained = s.resolved_sde_steps()
            _need(bool(trained), "sampling.sde_step_indices", s.sde_step_indices, "at least one stochastic step for flow_grpo")
            needed = sorted({i for t in trained for i in (t, t + 1)} - set(s.resolved_return_steps()))
            _need(not needed, "sampling.return_step_indices", s.return_step_indices, f"null or a list that includes x_i and x_(i+1) of every stochastic step (missing {needed})")
        else:
            _need(s.sde_type == "ode", "sampling.sde_type", s.sde_type, "'ode' for algorithm.name=diffusion_nft (it rolls out deterministically)")
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


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {_key(f.name): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
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


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RayflowConfig:
    """Read a recipe YAML (optional), apply dotlist overrides, convert and validate."""
    try:
        base = OmegaConf.load(path) if path else OmegaConf.create({})
    except FileNotFoundError:
        raise ConfigError("--config", path, "an existing YAML file") from None
    except (OmegaConfBaseException, OSError, yaml.YAMLError) as e:
        # Malformed YAML, or a top-level scalar.
        raise ConfigError("--config", path, f"a YAML mapping of sections ({' '.join(str(e).split())})") from None
    if not isinstance(base, DictConfig):
        raise ConfigError("--config", path, "a YAML mapping of sections, not a list")
    try:
        data = OmegaConf.to_container(OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides or []))), resolve=False)
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError("overrides", str(e).splitlines()[0], "key=value overrides") from None
    # Unknown keys and wrong types are reported as given, before the defaults are merged in.
    _build(RayflowConfig, _strip_interpolations(data), "")
    try:
        # Interpolations such as ${trainer.output_dir} resolve against the defaults too.
        full = OmegaConf.merge(OmegaConf.create(to_dict(RayflowConfig())), OmegaConf.create(data))
        resolved = OmegaConf.to_container(full, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(path or "overrides", str(e).splitlines()[0], "interpolations of existing keys") from None
    return from_dict(resolved)


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
