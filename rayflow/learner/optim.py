"""The optimizer step shared by the reference trainer and the FSDP2 learner (clip grad norm → step,
skipped when the norm is not finite), DiffusionNFT's EMA of "old", once per trained batch, and
flow_grpo's train.ema "ema", after optimizer steps."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from rayflow.algorithms.diffusion_nft import ema_decay, ema_update
from rayflow.algorithms.flow_grpo import train_ema_decay
from rayflow.config import AlgorithmConfig, LearnerConfig
from rayflow.models.lora import EMA_ADAPTER, EVAL_EMA_ADAPTER, TRAINED_ADAPTER
from rayflow.models.weight_sets import named_weights


def build_optimizer(transformer: nn.Module, cfg: LearnerConfig) -> torch.optim.Optimizer:
    params = [p for p in transformer.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: add the LoRA adapter (or full.add_weight_copies) before building the optimizer")
    # foreach=False: the same kernels whether the params are plain tensors or FSDP2 DTensor shards.
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False
    )


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over all gradients, a plain scalar tensor. For FSDP2 DTensor shards the per-rank
    partial norms are reduced first (torchtitan's order), so every rank clips by, and decides to
    skip on, the same global norm."""
    from torch.distributed.tensor import DTensor  # here: the driver never needs it (parallelize.py's docstring)

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


def optimizer_step(
    transformer: nn.Module,
    optimizer: torch.optim.Optimizer,
    learner: LearnerConfig,
) -> StepResult:
    """Apply the accumulated gradients: clip to learner.max_grad_norm, step (skipped when the norm is not finite)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = global_grad_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, learner.max_grad_norm, grad_norm, foreach=False)
    norm = float(grad_norm)
    skipped = not math.isfinite(norm)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(grad_norm=norm, skipped=skipped)


def update_rollout_ema(transformer: nn.Module, algo: AlgorithmConfig, optimizer_steps: int) -> float:
    """DiffusionNFT's "old" ← η·old + (1 − η)·default with η = ema_decay(optimizer_steps), called once
    per trained batch with diffusion_nft.ema_step (as scripts/train_nft_sd3.py, once per epoch). Returns η."""
    eta = ema_decay(optimizer_steps, algo.ema_flat, algo.ema_uprate, algo.ema_uphold)
    _blend_into(transformer, EMA_ADAPTER, eta)
    return eta


def update_eval_ema(transformer: nn.Module, decay: float, every: int, optimizer_steps: int, blends: int = 1) -> None:
    """flow_grpo's `ema.step(params, global_step)` after optimizer step number `optimizer_steps` (1-based, skipped
    steps included): "ema" ← d·ema + (1 − d)·default with d = train_ema_decay(n, decay) (trainer.ema_decay), when
    (n + 1) is a multiple of `every` (trainer.ema_every: its update_step_interval rule), `blends` times
    (trainer.ema_blends: flow_grpo calls it once per micro-batch, with the same global_step and weights until the
    next optimizer step)."""
    if (optimizer_steps + 1) % every == 0:
        step_decay = train_ema_decay(optimizer_steps, decay)
        for _ in range(blends):
            _blend_into(transformer, EVAL_EMA_ADAPTER, step_decay)


def _blend_into(transformer: nn.Module, shadow: str, decay: float) -> None:
    """shadow ← decay·shadow + (1 − decay)·"default", tensor by tensor (FSDP2 shards in place)."""
    current = named_weights(transformer, TRAINED_ADAPTER)
    target = named_weights(transformer, shadow)
    ema_update([target[n] for n in sorted(target)], [current[n] for n in sorted(target)], decay)


class TooManySkippedSteps(RuntimeError):
    """trainer.max_skipped_steps optimizer steps in a row had a non-finite gradient norm."""


@dataclass(frozen=True)
class SkipRuns:
    """Where a trained batch's skipped optimizer steps lie: a run of skips may go on across batches, or lie inside
    one batch of several mini-batches, so a count per batch does not say how many were skipped in a row."""

    leading: int
    """Steps skipped before the batch's first applied step (every step of the batch when none was applied)."""
    longest: int
    """The longest run of skipped steps within the batch."""
    trailing: int
    """Steps skipped after the batch's last applied step (every step of the batch when none was applied)."""

    METRICS = ("train/skipped_leading", "train/skipped_longest", "train/skipped_trailing")
    """Their names among a train step's metrics (the learners' report to the driver)."""

    @classmethod
    def of(cls, skipped: list[bool]) -> "SkipRuns":
        """The runs of a batch's steps, `skipped` per optimizer step in order."""
        runs = [len(list(run)) for is_skipped, run in itertools.groupby(skipped) if is_skipped]
        leading = next((i for i, s in enumerate(skipped) if not s), len(skipped))
        trailing = next((i for i, s in enumerate(reversed(skipped)) if not s), len(skipped))
        return cls(leading, max(runs, default=0), trailing)

    def metrics(self) -> dict[str, float]:
        return dict(zip(self.METRICS, (float(self.leading), float(self.longest), float(self.trailing))))

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> "SkipRuns":
        return cls(*(int(metrics[name]) for name in cls.METRICS))


class SkippedSteps:
    """Counts skipped optimizer steps (all, and in a row) and stops the run when `max_in_a_row` are
    skipped consecutively (0: never): a run whose every step is skipped trains nothing and must not
    go on writing checkpoints as if it did."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.total = 0
        self.in_a_row = 0
        """Optimizer steps skipped in a row up to the last one observed (0 when it was applied)."""

    def observe(self, skipped: int, step: int, steps: int = 1, runs: SkipRuns | None = None) -> None:
        """Record trained batch `step` of `steps` optimizer steps, `skipped` of them skipped, lying as `runs` says
        (None: every step or none, as in a batch of one step); raise TooManySkippedSteps once max_in_a_row optimizer
        steps in a row are skipped, across batches or within one (a count per batch would let a run whose last 3 of
        every 4 mini-batches are skipped go on forever, its checkpoints called healthy)."""
        skipped = int(skipped)
        if runs is None:
            runs = SkipRuns(steps, steps, steps) if skipped == steps else SkipRuns(0, 0, 0)
        self.total += skipped
        before = self.in_a_row
        if runs.leading == steps:  # the whole batch skipped: the run goes on through it
            self.in_a_row = longest = before + steps
            batches = -(-longest // steps)  # the skips span whole batches of `steps` optimizer steps each
        else:
            self.in_a_row = runs.trailing
            joined = before + runs.leading  # the run that ended in this batch, begun in the batches before it
            longest, batches = (joined, 1 + -(-before // steps)) if joined >= runs.longest else (runs.longest, 1)
        if self.max_in_a_row and longest >= self.max_in_a_row:
            raise TooManySkippedSteps(
                f"batches {step - batches + 1}..{step}: {longest} optimizer steps in a row skipped for a "
                f"non-finite gradient norm (trainer.max_skipped_steps={self.max_in_a_row}); the loss or rewards are NaN/Inf. "
                f"The last healthy checkpoint is kept; check the reward functions and the learning rate"
            )

    def counters(self) -> dict[str, int]:
        """For the checkpoint: the total, and the run of skips that ends at the checkpoint."""
        return {"skipped_steps": self.total, "consecutive_skipped": self.in_a_row}

    def load(self, counters: dict[str, int]) -> None:
        self.total = counters.get("skipped_steps", 0)
        self.in_a_row = counters.get("consecutive_skipped", 0)


def offload_optimizer_state(optimizer: torch.optim.Optimizer) -> list[tuple[dict, str, torch.device]]:
    """Move every accelerator tensor of the optimizer's state (AdamW's moments) to the CPU, in place; returns where
    each moved tensor was, for `reload_optimizer_state`. CPU tensors stay (AdamW's `step` must stay on the CPU), so
    on a CPU-only run nothing moves. learner.offload_optimizer_during_rollout: memory a colocated device samples with."""
    moved = []
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                moved.append((state, key, value.device))
                state[key] = value.to("cpu")
    return moved


def reload_optimizer_state(moved: list[tuple[dict, str, torch.device]]) -> None:
    """Undo `offload_optimizer_state`: each moved tensor back to its device."""
    for state, key, device in moved:
        state[key] = state[key].to(device)
