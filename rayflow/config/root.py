"""RayflowConfig: the root of a run's config (one field a section) and the rules that span sections."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayflow.config.sections import (
    AlgorithmConfig, AsyncConfig, CFGConfig, DataConfig, LearnerConfig, LoggingConfig, ModelConfig, PlacementConfig,
    RewardConfig, RolloutConfig, SyncConfig, TrainerConfig, _need,
)
from rayflow.sampling.window import window_bounds
from rayflow.types import SamplingParams


def yaml_key(field_name: str) -> str:
    """YAML key of a dataclass field ("async" is a Python keyword, so its field is async_)."""
    return field_name[:-1] if field_name.endswith("_") else field_name


READ_ONLY_WHEN: tuple[tuple[tuple[str, ...], str, Callable[[Any], bool], str], ...] = (
    (("sampling.noise_level", "sampling.sde_step_indices", "sampling.sde_window_size"), "sampling.sde_type",
     lambda sde_type: sde_type != "ode", "'sde' or 'cps' (an ODE rollout has no stochastic step)"),
    (("sampling.sde_window_schedule",), "sampling.sde_window_size", lambda size: size is not None,
     "set (the schedule places that window)"),
    (("cfg.avoid_prompt", "cfg.avoid_scale"), "cfg.policy", lambda policy: policy == "dual_negative",
     "'dual_negative' (the only policy with an avoid branch)"),
    (("trainer.ema_every", "trainer.ema_blends"), "trainer.ema_decay", lambda decay: decay > 0,
     "> 0 (0: no EMA to update)"),
    (("algorithm.clip_range", "algorithm.kl_type", "algorithm.ratio_norm"), "algorithm.name",
     lambda name: name == "flow_grpo", "'flow_grpo' (only FlowGRPO reads it)"),
    (("algorithm.nft_beta", "algorithm.adv_mode", "algorithm.ema_flat", "algorithm.ema_uprate", "algorithm.ema_uphold"),
     "algorithm.name", lambda name: name == "diffusion_nft", "'diffusion_nft' (only DiffusionNFT reads it)"),
    # model.tiny_arch stays free: with a path it names the family the memory planner sizes when the path is elsewhere.
    (("model.tiny_size", "model.tiny_seed", "model.cache_dir"), "model.path", lambda path: path is None,
     "null (they build the tiny offline model, which a path replaces)"),
    # Synchronous: a trajectory that newer weights reach mid-request is one its batch finds stale, never trained.
    # async.over_stale stays free: a synchronous run resumed from (or rewound to) the checkpoint of an asynchronous one
    # at max_staleness >= 2 draws more than a batch of pending groups again, and those left over go stale
    # (tests/test_queue.py -k asynchronous_checkpoint).
    (("async.partial_rollout",), "async.max_staleness", lambda staleness: staleness > 0,
     "> 0 (a synchronous run trains no trajectory that newer weights reached mid-request)"),
    (("trainer.gpu_memory_gib",), "trainer.memory_check", lambda check: check is True,
     "true (only the start-up memory check reads it, and tools/plan.py without --gpu-memory-gib)"),
)
"""(keys, the key that decides whether they are read, whether they are at its value, the condition in words): keys
nothing reads unless a condition holds (the algorithm keys with checks of their own, nft_timesteps and
timestep_fraction, are checked in _validate_algorithm). Set away from its default otherwise, a key would be a setting
that silently does nothing."""


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
                section.validate(prefix=yaml_key(f.name))
        self._validate_size()
        self._validate_algorithm()
        self._validate_read()
        self._validate_guidance()
        # float16 trained in place: AdamW's eps (1e-8) is 0 in float16, and the first step of a LoRA (its B at 0, so A's
        # gradient 0) divides 0 by 0 into every adapter weight. autocast keeps the trained weights and AdamW in fp32.
        _need(self.model.dtype != "float16" or self.learner.mixed_precision == "autocast", "learner.mixed_precision",
              self.learner.mixed_precision, "'autocast' with model.dtype=float16 (fp32 trained weights and AdamW state: "
              "in float16 AdamW's eps of 1e-8 is 0, and its first step turns the adapters into NaN)")
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

    def _get(self, key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(self, section + ("_" if section == "async" else "")), name)

    def _validate_read(self) -> None:
        """Keys of READ_ONLY_WHEN keep their defaults unless what reads them is on."""
        defaults = RayflowConfig()
        for keys, decider, reads, condition in READ_ONLY_WHEN:
            if reads(self._get(decider)):
                continue
            for key in keys:
                value, default = self._get(key), defaults._get(key)
                _need(value == default, key, value, f"its default {default!r} unless {decider} is {condition}; "
                                                    f"here {decider}={self._get(decider)!r}, so nothing reads it")

    def _validate_guidance(self) -> None:
        """A guidance scale the policy ignores, and CFG-parallel ranks beyond the branches the policy builds."""
        from rayflow.cfg.policy import NoCFG, guidance_policy

        s, t = self.sampling, self.trainer
        if self.cfg.policy == NoCFG.name:
            scales = {"sampling.guidance_scale": s.guidance_scale, "trainer.eval_guidance_scale": t.eval_guidance_scale}
            for key, scale in scales.items():
                _need(scale is None or scale == 1.0, key, scale,
                      f"1.0 with cfg.policy={NoCFG.name} (it runs the conditional branch alone whatever the scale), "
                      f"or a cfg.policy that guides")
        policy = guidance_policy(self.cfg)
        scales = sorted({s.guidance_scale, t.eval_guidance_scale or s.guidance_scale})  # rollouts' and evaluation's
        branches = max(len(policy.conditioning_prompts(["x"], s.negative_prompt, scale)) for scale in scales)
        # A rank beyond the branches runs none (cfg/parallel.py) but holds a device all run long.
        _need(self.rollout.cfg_parallel_size <= branches, "rollout.cfg_parallel_size", self.rollout.cfg_parallel_size,
              f"at most {branches}, the CFG branches cfg.policy={self.cfg.policy} builds at guidance scale "
              f"{' and '.join(f'{x:g}' for x in scales)} (sampling.guidance_scale, trainer.eval_guidance_scale); "
              f"more rollout ranks: rollout.num_replicas")

    def _validate_placement(self) -> None:
        from rayflow.distributed.resources import check_bundles_reserve_something

        check_bundles_reserve_something(self, cluster_has_gpus=None)  # again once Ray has started, for null GPU counts
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
              f"'lora' {where} (its default, unread there: rollouts sample the learner's own weights, its adapter or, "
              f"with learner.train_mode=full, its parameters, so nothing is merged or sent; 'merged' is for disaggregated "
              f"placement)")

    def _validate_size(self) -> None:
        from rayflow.models.base import model_class, pipeline_class_of

        # The model directory may exist only on the workers of a cluster; then its loader checks again.
        if self.model.path is not None and not os.path.isfile(os.path.join(self.model.path, "model_index.json")):
            return
        from rayflow.models.tiny import TINY_PIPELINES

        pipeline = TINY_PIPELINES[self.model.tiny_arch] if self.model.path is None else pipeline_class_of(self.model.path)
        model_class(pipeline).check_shift(self.sampling.shift)
        multiple = model_class(pipeline).size_multiple()
        for key in ("height", "width"):
            value = getattr(self.sampling, key)
            _need(value % multiple == 0, f"sampling.{key}", value, f"a positive multiple of {multiple} (VAE scale x patch size of {pipeline})")
        model_class(pipeline).check_cfg_policy(self.cfg.policy)
        model_class(pipeline).check_attention_backend(self.model.attention_backend)

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
            window = s.sde_window_size is not None
            _need(not window or self.algorithm.timestep_fraction == 1.0, "algorithm.timestep_fraction",
                  self.algorithm.timestep_fraction,
                  "1.0 with an SDE window (FlowGRPO-Fast trains every step of its window: the window is the thinning)")
            # CPS's std at the last step is σ_next·sin(aπ/2) = 0: a deterministic transition, and an infinite KL.
            _need(s.sde_type != "cps" or s.num_steps - 1 not in trained,
                  "sampling.sde_window_range" if window else "sampling.sde_step_indices",
                  s.sde_window_range if window else s.sde_step_indices,
                  f"no stochastic last step (index {s.num_steps - 1}) for sde_type=cps, whose std there is 0"
                  + (f"; e.g. sde_window_range=[0, {s.num_steps - 1}]" if window else ""))
            last = int(s.num_steps * self.algorithm.timestep_fraction)
            _need(
                window or any(j < last for j in trained),
                "algorithm.timestep_fraction", self.algorithm.timestep_fraction,
                f"a fraction keeping at least one stochastic step (steps j < int(num_steps x fraction) are trained; "
                f"the first stochastic step must lie below it; num_steps={s.num_steps})",
            )
            _need(not self.algorithm.ratio_norm or s.sde_type == "sde", "algorithm.ratio_norm", self.algorithm.ratio_norm,
                  "false unless sampling.sde_type=sde (GRPO-Guard normalises the Gaussian log-ratio of Flow-GRPO's SDE step)")
            _need(self.algorithm.nft_timesteps is None, "algorithm.nft_timesteps", self.algorithm.nft_timesteps,
                  "null for algorithm.name=flow_grpo (DiffusionNFT's; FlowGRPO trains its stochastic steps, "
                  "thinned by algorithm.timestep_fraction or an SDE window)")
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
            _need(self.algorithm.timestep_fraction == 1.0, "algorithm.timestep_fraction", self.algorithm.timestep_fraction,
                  "1.0 for algorithm.name=diffusion_nft (FlowGRPO's option; DiffusionNFT's timesteps per sample are "
                  "algorithm.nft_timesteps, int(num_steps x fraction) in DiffusionNFT's own config)")
            _need(self.cfg.policy != "dual_negative", "cfg.policy", self.cfg.policy,
                  "a policy other than 'dual_negative' for algorithm.name=diffusion_nft (it guides away from its avoid "
                  "prompt even at guidance 1, so rollouts would come from another policy than the one trained)")
            _need(self.algorithm.nft_timesteps is None or self.algorithm.nft_timesteps <= s.num_steps,
                  "algorithm.nft_timesteps", self.algorithm.nft_timesteps,
                  f"null (all) or an integer in [1, sampling.num_steps={s.num_steps}]: the timesteps trained are drawn from the rollout's")
            _need(s.num_steps in s.resolved_return_steps(), "sampling.return_step_indices", s.return_step_indices, f"null or a list that includes the final latent {s.num_steps}")
