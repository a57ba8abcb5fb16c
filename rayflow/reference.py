"""The single-process reference trainer: FlowGRPO or DiffusionNFT on one DiffusionModel with LoRA.

No Ray, no process groups: the oracle the distributed system is checked against (same config
and seeds → same rewards, losses and LoRA). One step reads top to bottom:

    groups → rollout (under the rollout adapter) → rewards → advantages → loss/backward → optimizer step

    python -m rayflow.reference --config recipes/flowgrpo_qwen_image.yaml trainer.total_steps=20
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from rayflow.algorithms.advantages import assign_advantages
from rayflow.config import RayflowConfig, load_config
from rayflow.data.prompts import GroupSampler, load_prompts
from rayflow.learner.lora import add_lora, rollout_adapter_name, using_adapter
from rayflow.learner.objective import diffusion_nft_backward, flow_grpo_backward
from rayflow.learner.optim import build_optimizer, optimizer_step
from rayflow.models import DiffusionModel, load_model
from rayflow.models.tiny import resolve_model_path
from rayflow.rewards.weighted import WeightedReward
from rayflow.sampling.denoise import generate
from rayflow.types import Trajectory


@dataclass
class StepLog:
    step: int
    reward_mean: float
    reward_std: float
    loss: float
    grad_norm: float
    skipped: bool
    zero_signal_groups: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


def load_policy_model(cfg: RayflowConfig, device: str | torch.device | None = None) -> DiffusionModel:
    """The model with its LoRA adapters ("default", and "old" when the algorithm rolls out under an EMA)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir, cfg.model.tiny_size, cfg.model.tiny_seed)
    model = load_model(path, device=device, dtype=getattr(torch, cfg.model.dtype))
    # Same weights on every process for the same seed (the LoRA A matrices are random).
    torch.manual_seed(cfg.trainer.seed)
    add_lora(
        model.transformer,
        rank=cfg.learner.lora_rank,
        alpha=cfg.learner.lora_alpha,
        targets=cfg.learner.lora_targets or model.lora_target_modules,
        init=cfg.learner.lora_init,
        with_ema=cfg.algorithm.needs_ema_rollout,
    )
    return model


def backward(cfg: RayflowConfig, model: DiffusionModel, policy, shard: list[Trajectory], version: int) -> dict[str, float]:
    """Accumulate the algorithm's gradients over a shard of scored trajectories."""
    if cfg.algorithm.name == "flow_grpo":
        return flow_grpo_backward(model, policy, shard, cfg.algorithm, cfg.learner.micro_batch_size)
    return diffusion_nft_backward(
        model, shard, cfg.algorithm, cfg.learner.micro_batch_size, cfg.trainer.seed, version
    )


def train(cfg: RayflowConfig, log=print) -> tuple[DiffusionModel, list[StepLog]]:
    model = load_policy_model(cfg)
    optimizer = build_optimizer(model.transformer, cfg.learner)
    policy = cfg.cfg.make_policy()
    reward = WeightedReward(cfg.reward.functions)
    sampler = GroupSampler(load_prompts(cfg.data.prompts), cfg.algorithm.group_size, cfg.trainer.seed, cfg.data.shuffle)
    rollout_adapter = rollout_adapter_name(cfg.algorithm.needs_ema_rollout)
    history = []
    for step in range(cfg.trainer.total_steps):
        start = time.perf_counter()
        groups = [sampler.next_group() for _ in range(cfg.algorithm.prompts_per_step)]
        requests = [r for g in groups for r in g.requests(cfg.sampling, cfg.rollout.micro_batch_size)]
        with using_adapter(model.transformer, rollout_adapter):
            trajectories = [t for r in requests for t in generate(model, r, policy, version=step)]
        reward.score(trajectories)
        adv = assign_advantages(trajectories, global_std=cfg.algorithm.global_std, clip_max=cfg.algorithm.adv_clip_max)
        metrics = backward(cfg, model, policy, trajectories, version=step)
        result = optimizer_step(model.transformer, optimizer, cfg.learner, cfg.algorithm, step)
        rewards = torch.tensor([t.reward for t in trajectories])
        entry = StepLog(
            step=step,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std(unbiased=False)),
            loss=metrics["loss/policy"] + cfg.algorithm.kl_beta * metrics["loss/kl"],
            grad_norm=result.grad_norm,
            skipped=result.skipped,
            zero_signal_groups=adv.zero_signal_groups,
            seconds=time.perf_counter() - start,
            metrics=metrics,
        )
        history.append(entry)
        log(
            f"step {step:4d}  reward {entry.reward_mean:.4f} ± {entry.reward_std:.4f}  loss {entry.loss:+.5f}  "
            f"grad_norm {entry.grad_norm:.4f}{'  (skipped)' if entry.skipped else ''}  {entry.seconds:.2f}s"
        )
    return model, history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="a recipe YAML")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.total_steps=3")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(max(1, cfg.learner.threads_per_rank))
    train(cfg)


if __name__ == "__main__":
    main()
