"""Classifier-free guidance as data: the branches to run and how their predictions combine.

A CFGPolicy turns prompt conditionings into an ordered list of CFGBranch (one transformer
forward each) and combines the branch predictions, in branch order, into one velocity. The
CFG-parallel runtime (cfg/parallel.py) and the learner both use it, so rollout and training
guide identically. Pure tensor math: no process groups here.

Two arithmetic orders: "serial" n + s·(p − n), as the diffusers pipelines write it, and
"parallel" s·p + (1 − s)·n, a weighted sum whose terms can be computed on different ranks.
They agree to rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from rayflow.models.base import PromptEmbeds

if TYPE_CHECKING:
    from rayflow.config import CFGConfig


@dataclass(frozen=True)
class CFGBranch:
    """One forward pass: `kwargs` go to DiffusionModel.predict_velocity (the conditioning as `cond`)."""

    name: str
    is_conditional: bool
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CFGPolicy:
    """Standard two-branch CFG: conditional then unconditional; one branch when scale <= 1.

    A policy names the conditionings it needs ("positive", "negative", ...) and the text of each;
    `build` receives them encoded, by the same names.
    """

    name: ClassVar[str] = "standard"

    parallel_arithmetic: bool = False

    def uses_guidance(self, scale: float) -> bool:
        return scale > 1.0

    def conditioning_prompts(self, prompts: list[str], negative_prompt: str, scale: float) -> dict[str, list[str]]:
        """The text of each conditioning, one per sample."""
        texts = {"positive": list(prompts)}
        if self.uses_guidance(scale):
            texts["negative"] = [negative_prompt] * len(prompts)
        return texts

    def conditional_kwargs(self, scale: float) -> dict[str, Any]:
        """predict_velocity arguments of the conditional branch besides its conditioning (none here);
        DiffusionNFT, which trains the conditional velocity alone, passes them too."""
        return {}

    def build(self, conds: dict[str, PromptEmbeds], scale: float) -> list[CFGBranch]:
        branches = [CFGBranch("conditional", True, {"cond": conds["positive"]})]
        if self.uses_guidance(scale):
            branches.append(CFGBranch("unconditional", False, {"cond": conds["negative"]}))
        return branches

    def combine(self, preds: list[torch.Tensor], scale: float) -> torch.Tensor:
        """Predictions in branch order -> the guided velocity."""
        if len(preds) == 1:
            return preds[0]
        p, n = preds
        if self.parallel_arithmetic:
            return scale * p + (1 - scale) * n
        return n + scale * (p - n)


@dataclass(frozen=True)
class NoCFG(CFGPolicy):
    """A single conditional branch whatever the scale (guidance-distilled models, or CFG off)."""

    name: ClassVar[str] = "none"

    def uses_guidance(self, scale: float) -> bool:
        return False


@dataclass(frozen=True)
class EmbeddedGuidance(CFGPolicy):
    """One branch that hands the scale to the transformer's guidance embedding (guidance-distilled
    FLUX.1-dev: FluxPipeline's `guidance_scale`). One branch, so CFG parallelism has nothing to split."""

    name: ClassVar[str] = "embedded"

    def uses_guidance(self, scale: float) -> bool:
        return False

    def conditional_kwargs(self, scale: float) -> dict[str, Any]:
        return {"guidance": scale}

    def build(self, conds: dict[str, PromptEmbeds], scale: float) -> list[CFGBranch]:
        return [CFGBranch("conditional", True, {"cond": conds["positive"], **self.conditional_kwargs(scale)})]


@dataclass(frozen=True)
class TrueCFG(CFGPolicy):
    """Qwen-Image's true CFG: standard CFG rescaled so each token keeps the conditional prediction's norm,
    combined · ‖p‖ / ‖combined‖ along the channel dim (QwenImagePipeline.__call__)."""

    name: ClassVar[str] = "true_cfg"

    def combine(self, preds: list[torch.Tensor], scale: float) -> torch.Tensor:
        combined = super().combine(preds, scale)
        if len(preds) == 1:
            return combined
        cond_norm = torch.norm(preds[0], dim=-1, keepdim=True)
        combined_norm = torch.norm(combined, dim=-1, keepdim=True)
        return combined * (cond_norm / combined_norm)


@dataclass(frozen=True)
class DualNegativeCFG(CFGPolicy):
    """Three branches: guide towards the prompt p and away from `avoid_prompt` q, both relative to the
    unconditional prediction u (the negative prompt): v = u + s·(p − u) − s_avoid·(q − u).
    """

    name: ClassVar[str] = "dual_negative"

    avoid_prompt: str = "blurry, low quality"
    avoid_scale: float = 1.0

    def uses_guidance(self, scale: float) -> bool:
        return True

    def conditioning_prompts(self, prompts: list[str], negative_prompt: str, scale: float) -> dict[str, list[str]]:
        texts = super().conditioning_prompts(prompts, negative_prompt, scale)
        texts["avoid"] = [self.avoid_prompt] * len(prompts)
        return texts

    def build(self, conds: dict[str, PromptEmbeds], scale: float) -> list[CFGBranch]:
        return [
            CFGBranch("conditional", True, {"cond": conds["positive"]}),
            CFGBranch("unconditional", False, {"cond": conds["negative"]}),
            CFGBranch("avoid", False, {"cond": conds["avoid"]}),
        ]

    def combine(self, preds: list[torch.Tensor], scale: float) -> torch.Tensor:
        p, u, q = preds
        if self.parallel_arithmetic:
            return scale * p + (1 - scale + self.avoid_scale) * u - self.avoid_scale * q
        return u + scale * (p - u) - self.avoid_scale * (q - u)


POLICIES: dict[str, type[CFGPolicy]] = {cls.name: cls for cls in (CFGPolicy, NoCFG, EmbeddedGuidance, TrueCFG, DualNegativeCFG)}


def make_policy(name: str, parallel_arithmetic: bool = False, **kwargs: Any) -> CFGPolicy:
    """The policy registered as `name` (one of POLICIES; a config's cfg.policy is checked by CFGConfig.validate)."""
    return POLICIES[name](parallel_arithmetic=parallel_arithmetic, **kwargs)


def guidance_policy(guidance: CFGConfig) -> CFGPolicy:
    """The policy a run's `cfg:` section describes: what rollouts sample under and FlowGRPO's learner replays."""
    extra = {}
    if guidance.policy == DualNegativeCFG.name:
        extra = {"avoid_prompt": guidance.avoid_prompt, "avoid_scale": guidance.avoid_scale}
    return make_policy(guidance.policy, parallel_arithmetic=guidance.parallel_arithmetic, **extra)
