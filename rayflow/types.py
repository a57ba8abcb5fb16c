"""The data contract: what crosses between the driver, rollout replicas, reward workers and learners.

Shapes use B = samples, T = denoising steps, K = captured latents, N = latent tokens,
C = latent channels per token, L = prompt tokens, D = text embedding width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from rayflow.errors import ConfigError

SDE_TYPES = ("sde", "cps", "ode")
SOLVERS = ("euler", "dpm2")
WINDOW_SCHEDULES = ("fixed", "random", "sliding")


@dataclass
class SamplingParams:
    """How one rollout samples. Also the `sampling` section of the config."""

    height: int = 64
    """Image height in pixels; a multiple of the model's VAE scale x patch size (16 for Qwen-Image)."""
    width: int = 64
    """Image width in pixels; same rule as height."""
    num_steps: int = 8
    """Denoising steps T."""
    guidance_scale: float = 4.0
    """Classifier-free guidance scale; 1.0 disables CFG (one branch)."""
    negative_prompt: str = " "
    """The unconditional branch's prompt (Qwen-Image's true CFG needs one; " " is its convention)."""
    sde_type: str = "sde"
    """"sde" (Flow-GRPO), "cps" (coefficients-preserving) or "ode" (deterministic Euler)."""
    solver: str = "euler"
    """Deterministic steps: "euler", or "dpm2" (DPM-Solver++(2M), second order; DiffusionNFT's rollouts) for sde_type=ode."""
    noise_level: float = 0.7
    """The SDE noise level a: > 0 for sde_type=sde, in (0, 1] for sde_type=cps."""
    sde_step_indices: list[int] | None = None
    """Steps that sample stochastically (others run ODE, log-prob 0). None: every step but the last; []: none."""
    sde_window_size: int | None = None
    """FlowGRPO-Fast: stochastic steps per window, placed per policy version (replaces sde_step_indices); None: no window."""
    sde_window_range: list[int] | None = None
    """[lo, hi]: the window [s, s + size) lies within steps lo..hi − 1; None: [0, num_steps]. Only with sde_window_size."""
    sde_window_schedule: str = "random"
    """Window start s: "fixed" (lo), "random" (uniform, drawn from run seed and version) or "sliding" (MixGRPO: +1 per version, wrapping)."""
    return_step_indices: list[int] | None = None
    """Latents x_i to capture, i in 0..T (T is the final latent). None: all."""
    shift: float | None = None
    """Sigma-schedule shift; None keeps the model scheduler's own (resolution-dependent for Qwen-Image)."""
    decode_batch_size: int = 0
    """Images per VAE decode: 0 decodes a request's whole batch at once; n > 0 decodes it n at a time, and CFG-parallel
    ranks share those decodes round robin instead of rank 0 decoding alone. The images depend on n (a decode of fewer
    images may round differently), never on the number of ranks."""
    same_initial_noise: bool = False
    """Every sample of a prompt group starts from one initial noise (its first seed's), so the group's samples differ only
    by their stochastic steps' noise (DanceGRPO's and UniRL's init_same_noise). Needs a stochastic step."""

    def validate(self, prefix: str = "sampling") -> None:
        def need(ok: bool, key: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"{prefix}.{key}", getattr(self, key), allowed)

        need(self.num_steps >= 1, "num_steps", "an integer >= 1")
        need(self.height >= 1, "height", "a positive multiple of the model's VAE scale x patch size")
        need(self.width >= 1, "width", "a positive multiple of the model's VAE scale x patch size")
        # Finite: an infinite scale passed every check here and ended the first rollout in a FloatingPointError.
        need(math.isfinite(self.guidance_scale) and self.guidance_scale >= 1.0, "guidance_scale",
             "a finite float >= 1.0 (1.0 disables CFG)")
        need(self.sde_type in SDE_TYPES, "sde_type", f"one of {list(SDE_TYPES)}")
        need(self.solver in SOLVERS, "solver", f"one of {list(SOLVERS)}")
        # A multistep solver needs every step deterministic: an SDE step between would break its history.
        need(self.solver == "euler" or self.sde_type == "ode", "solver", "'euler' unless sde_type=ode (dpm2 takes every step deterministically)")
        need(self.noise_level >= 0.0, "noise_level", "a float >= 0")
        if self.sde_type == "sde":
            # Its log-prob divides by the noise std, which is 0 at noise level 0.
            need(self.noise_level > 0.0, "noise_level", "a float > 0 for sde_type=sde")
        if self.sde_type == "cps":
            # At 0 every CPS step is deterministic (std σ_next·sin(0) = 0): nothing to explore, and the KL divides by it.
            need(0.0 < self.noise_level <= 1.0, "noise_level", "a float in (0, 1] for sde_type=cps")
        need(self.shift is None or self.shift > 0, "shift", "null or a float > 0")
        need(self.decode_batch_size >= 0, "decode_batch_size", "an integer >= 0 (0: the whole batch in one decode)")
        T = self.num_steps
        if self.sde_step_indices is not None:
            need(
                all(0 <= i < T for i in self.sde_step_indices) and _unique(self.sde_step_indices),
                "sde_step_indices",
                f"null or distinct step indices in [0, {T - 1}] (num_steps={T})",
            )
        if self.sde_window_size is not None:
            need(self.sde_step_indices is None, "sde_step_indices", "null when sde_window_size is set (the window places the stochastic steps)")
            need(1 <= self.sde_window_size <= T, "sde_window_size", f"null or an integer in [1, num_steps={T}]")
            allowed = f"null or [lo, hi] with 0 <= lo, hi <= num_steps={T} and hi - lo >= sde_window_size={self.sde_window_size}"
            need(self.sde_window_range is None or len(self.sde_window_range) == 2, "sde_window_range", allowed)  # before unpacking
            lo, hi = self.sde_window_range if self.sde_window_range is not None else (0, T)
            need(0 <= lo and hi <= T and hi - lo >= self.sde_window_size, "sde_window_range", allowed)
        else:  # a range alone would be ignored: the run would train every step, not the window its author meant
            need(self.sde_window_range is None, "sde_window_range",
                 "null unless sde_window_size is set (the range bounds where that window lies)")
        need(self.sde_window_schedule in WINDOW_SCHEDULES, "sde_window_schedule", f"one of {list(WINDOW_SCHEDULES)}")
        if self.same_initial_noise:
            # With no stochastic step every sample of a group would be the same image: no advantage left.
            need(self.sde_type != "ode" and (self.sde_window_size is not None or len(self._listed_sde_steps()) > 0),
                 "same_initial_noise", "false unless some step samples stochastically (sde_type sde or cps, and "
                 "sde_step_indices not [], or an SDE window)")
        if self.return_step_indices is not None:
            need(
                all(0 <= i <= T for i in self.return_step_indices) and _unique(self.return_step_indices),
                "return_step_indices",
                f"null or distinct latent indices in [0, {T}] ({T} is the final latent)",
            )

    def resolved_sde_steps(self) -> list[int]:
        """The stochastic step indices: sde_step_indices, or every step but the last; none for "ode"."""
        if self.sde_type == "ode":
            return []
        if self.sde_window_size is not None:
            raise ValueError("sampling parameters with an SDE window: resolve it first (rayflow.sampling.window.window_params)")
        return self._listed_sde_steps()

    def _listed_sde_steps(self) -> list[int]:
        """sde_step_indices sorted, or every step but the last when it is None (the window and sde_type aside)."""
        if self.sde_step_indices is None:
            return list(range(self.num_steps - 1))
        return sorted(self.sde_step_indices)

    def resolved_return_steps(self) -> list[int]:
        """The captured latent indices in 0..T, sorted."""
        if self.return_step_indices is None:
            return list(range(self.num_steps + 1))
        return sorted(self.return_step_indices)


def _unique(xs: list[int]) -> bool:
    return len(set(xs)) == len(xs)


@dataclass
class RolloutRequest:
    """A batch of samples to generate with one SamplingParams; list fields hold one entry per sample.

    The G samples of one prompt carry G distinct seeds: identical trajectories in a group make
    its advantages vanish.
    """

    request_id: str
    prompts: list[str]
    prompt_ids: list[int]
    group_ids: list[int]
    seeds: list[int]
    params: SamplingParams
    min_version: int | None = None
    """The oldest policy version the request may start under: a rollout rank holding only older weights waits for
    this one to be staged (the driver submits requests under its newest version while that version is still being
    broadcast). None: whatever the rank holds."""
    noise_seeds: list[int] | None = None
    """The seed of each sample's initial noise (sampling.same_initial_noise: its group's first seed); None: its own
    seed. The stochastic steps' noise always continues the sample's own seed's stream."""

    def validate(self) -> None:
        n = len(self.prompts)
        for key in ("prompt_ids", "group_ids", "seeds") + (("noise_seeds",) if self.noise_seeds is not None else ()):
            got = len(getattr(self, key))
            if got != n:
                raise ConfigError(f"request.{key}", f"{got} entries", f"one per prompt ({n})")
        if n == 0:
            raise ConfigError("request.prompts", "[]", "at least one prompt")
        by_group: dict[int, set[int]] = {}
        for g, s in zip(self.group_ids, self.seeds):
            if s in by_group.setdefault(g, set()):
                raise ConfigError("request.seeds", f"seed {s} twice in group {g}", "distinct seeds within a group")
            by_group[g].add(s)
        self.params.validate(prefix="request.params")


@dataclass
class Trajectory:
    """One sample's rollout: what the learner needs to replay its forward passes, and its reward."""

    prompt: str
    prompt_id: int
    group_id: int
    seed: int
    params: SamplingParams
    latents: torch.Tensor
    """[K, N, C] latents x_i at the captured indices (float32)."""
    latent_indices: list[int]
    """The K indices i in 0..T of the rows of `latents`; T is the final latent."""
    timesteps: torch.Tensor
    """[T] model timesteps of the steps."""
    sigmas: torch.Tensor
    """[T+1] sigmas, the last one 0."""
    log_probs: torch.Tensor
    """[T] log-prob of each step's transition (0 on ODE steps)."""
    sde_mask: torch.Tensor
    """[T] bool, True where the step was stochastic."""
    versions: torch.Tensor
    """[T] int64 policy version that produced each step."""
    means: torch.Tensor
    """[S, N, C] float32 transition mean μ of each stochastic step, in step order (the S True entries of
    sde_mask): the rollout policy's, which GRPO-Guard's ratio normalisation compares with (algorithm.ratio_norm)."""
    conds: dict[str, torch.Tensor]
    """The prompt conditionings the CFG branches used, by name ("positive", "negative", ...):
    [L_name, D] each, padding removed. Enough to replay the guided forward."""
    image: torch.Tensor | None = None
    """[H, W, 3] uint8 decoded image."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward components by name."""
    reward: float | None = None
    """The weighted total reward."""
    advantage: float | None = None

    def step_mean(self, step: int) -> torch.Tensor:
        """μ of stochastic step `step` under the rollout policy, [N, C]."""
        if not bool(self.sde_mask[step]):
            raise KeyError(f"step {step} was not stochastic (stochastic: {self.sde_mask.nonzero().flatten().tolist()})")
        return self.means[int(self.sde_mask[:step].sum())]

    def latent(self, index: int) -> torch.Tensor:
        """x_index, [N, C]; a clear error if that index was not captured."""
        try:
            row = self.latent_indices.index(index)
        except ValueError:
            raise KeyError(
                f"latent x_{index} was not captured (captured: {self.latent_indices}); "
                f"add it to sampling.return_step_indices"
            ) from None
        return self.latents[row]

    @property
    def oldest_version(self) -> int:
        return int(self.versions.min())

    @property
    def newest_version(self) -> int:
        return int(self.versions.max())


@dataclass
class TrajectoryRef:
    """What the driver keeps of a trajectory: where it lives (an ObjectRef to the list[Trajectory] its
    rollout request returned, and its index there) and the few numbers admission, staleness and
    advantages need. Its tensors never pass through the driver."""

    ref: Any
    index: int
    prompt: str
    prompt_id: int
    group_id: int
    seed: int
    versions: list[int]
    reward: float | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    advantage: float | None = None

    @property
    def oldest_version(self) -> int:
        return min(self.versions)

    @property
    def newest_version(self) -> int:
        return max(self.versions)
