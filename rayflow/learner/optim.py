"""The optimizer step shared by the reference trainer and the FSDP2 learner:
clip grad norm → step (skipped when the norm is not finite) → EMA of "old" → version + 1."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rayflow.algorithms.diffusion_nft import ema_decay, ema_update
from rayflow.config import AlgorithmConfig, LearnerConfig
from rayflow.learner.lora import EMA_ADAPTER, TRAINED_ADAPTER, adapter_parameters


def build_optimizer(transformer: nn.Module, cfg: LearnerConfig) -> torch.optim.Optimizer:
    params = [p for p in transformer.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: add the LoRA adapter before building the optimizer")
    # foreach=False: the same kernels whether the params are plain tensors or FSDP2 DTensor shards.
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False
    )


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over all gradients, a plain scalar tensor. For FSDP2 DTensor shards the per-rank
    partial norms are reduced first (torchtitan's order), so every rank clips by, and decides to
    skip on, the same global norm."""
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    ema_decay: float


def optimizer_step(
    transformer: nn.Module,
    optimizer: torch.optim.Optimizer,
    learner: LearnerConfig,
    algo: AlgorithmConfig,
    step: int,
) -> StepResult:
    """Apply the accumulated gradients of optimizer step `step` (0-based) and update the EMA adapter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = global_grad_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, learner.max_grad_norm, grad_norm, foreach=False)
    norm = float(grad_norm)
    skipped = not math.isfinite(norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    eta = 0.0
    if algo.needs_ema_rollout:
        eta = ema_decay(step, algo.ema_flat, algo.ema_uprate, algo.ema_uphold)
        current = adapter_parameters(transformer, TRAINED_ADAPTER)
        old = adapter_parameters(transformer, EMA_ADAPTER)
        ema_update([old[n] for n in sorted(old)], [current[n] for n in sorted(old)], eta)
    return StepResult(grad_norm=norm, skipped=skipped, ema_decay=eta)
