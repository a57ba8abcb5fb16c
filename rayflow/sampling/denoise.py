"""The denoising loop: step gating (SDE or ODE per step), trajectory capture, log-probs, versions.

The loop is split so that the single-process sampler (`generate`) and a CFG-parallel rollout
rank run the same code and differ only in where the guided velocity comes from:

    state = start_rollout(model, request, policy)
    while not state.done:
        v = <guided velocity of state.latents at state.step>   # local_guided_velocity, or CFG-parallel
        advance(state, v, version)
    trajectories = finish_rollout(model, state)

A step's policy version is the one passed to `advance`, so weights swapped between steps are
recorded per step (partial rollout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rayflow.cfg.policy import CFGBranch, CFGPolicy
from rayflow.models.base import DiffusionModel, PromptEmbeds, Schedule
from rayflow.sampling.dpm_solver import dpm2_step
from rayflow.sampling.flow_sde import flow_step
from rayflow.types import RolloutRequest, SamplingParams, Trajectory


@dataclass
class RolloutState:
    """One request in flight. Every CFG rank of a replica holds an identical copy."""

    request: RolloutRequest
    schedule: Schedule
    branches: list[CFGBranch]
    conds: dict[str, list[torch.Tensor]]
    """Per conditioning name, one [L, D] tensor per sample (padding removed)."""
    latents: torch.Tensor
    """[B, N, C] x_step."""
    generators: list[torch.Generator]
    """One per sample, continuing after its initial noise; they draw the SDE noise."""
    sde_steps: frozenset[int]
    return_steps: frozenset[int]
    step: int = 0
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    means: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per stochastic step, its transition mean μ [B, N, C] float32."""
    log_probs: list[torch.Tensor] = field(default_factory=list)
    """Per finished step, [B] float32."""
    versions: list[int] = field(default_factory=list)
    x0: torch.Tensor | None = None
    """[B, N, C] float32 data prediction of the last step: the history of sampling.solver=dpm2."""

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_steps(self) -> int:
        return self.params.num_steps

    @property
    def done(self) -> bool:
        return self.step >= self.num_steps

    @property
    def timestep(self) -> torch.Tensor:
        return self.schedule.timesteps[self.step]


def encode_texts(model: DiffusionModel, texts: list[str]) -> list[torch.Tensor]:
    """One [L, D] embedding per text. Each distinct text is encoded alone, so a prompt's embedding does
    not depend on which other prompts share the request (and equals the pipeline's for one prompt)."""
    cache: dict[str, torch.Tensor] = {}
    for text in texts:
        if text not in cache:
            cache[text] = model.encode_prompt([text]).unpadded()[0]
    return [cache[t] for t in texts]


def build_branches(policy: CFGPolicy, conds: dict[str, list[torch.Tensor]], scale: float) -> list[CFGBranch]:
    """The policy's branches over batched conditionings (padded, masked where lengths differ)."""
    return policy.build({name: PromptEmbeds.pad(embeds) for name, embeds in conds.items()}, scale)


def start_rollout(model: DiffusionModel, request: RolloutRequest, policy: CFGPolicy) -> RolloutState:
    """Encode prompts, build branches, draw the initial noise: everything before the first step."""
    request.validate()
    params = request.params
    model.check_size(params.height, params.width)
    texts = policy.conditioning_prompts(request.prompts, params.negative_prompt, params.guidance_scale)
    conds = {name: encode_texts(model, t) for name, t in texts.items()}
    latents, generators = model.prepare_latents(request.seeds, params.height, params.width)
    if request.noise_seeds is not None:  # sampling.same_initial_noise: the group's start; the SDE streams stay per sample
        latents, _ = model.prepare_latents(request.noise_seeds, params.height, params.width)
    return RolloutState(
        request=request,
        schedule=model.schedule(params.num_steps, params.height, params.width, params.shift),
        branches=build_branches(policy, conds, params.guidance_scale),
        conds=conds,
        latents=latents,
        generators=generators,
        sde_steps=frozenset(params.resolved_sde_steps()),
        return_steps=frozenset(params.resolved_return_steps()),
    )


def branch_velocity(model: DiffusionModel, state: RolloutState, branch: CFGBranch) -> torch.Tensor:
    """One branch's transformer forward at the current step, [B, N, C]."""
    p = state.params
    return model.predict_velocity(state.latents, state.timestep, height=p.height, width=p.width, **branch.kwargs)


@torch.no_grad()
def local_guided_velocity(model: DiffusionModel, state: RolloutState, policy: CFGPolicy) -> torch.Tensor:
    """Every branch in this process, one forward each, combined in branch order."""
    preds = [branch_velocity(model, state, b) for b in state.branches]
    return policy.combine(preds, state.params.guidance_scale)


def advance(state: RolloutState, velocity: torch.Tensor, version: int) -> None:
    """Take step `state.step` with the guided velocity [B, N, C]; record capture, log-prob and version."""
    i = state.step
    if i in state.return_steps:
        state.captured[i] = state.latents.to(torch.float32, copy=True)
    sigmas = state.schedule.sigmas
    if state.params.solver == "dpm2":  # every step deterministic (SamplingParams.validate)
        state.latents, state.x0 = dpm2_step(velocity, state.latents, sigmas[i], sigmas[i + 1],
                                            sigma_prev=sigmas[i - 1] if i else None, x0_prev=state.x0)
        log_prob = torch.zeros(state.latents.shape[0], dtype=torch.float32, device=state.latents.device)
    else:
        stochastic = i in state.sde_steps
        state.latents, log_prob, mean, _ = flow_step(
            velocity,
            state.latents,
            sigmas[i],
            sigmas[i + 1],
            sde_type=state.params.sde_type if stochastic else "ode",
            noise_level=state.params.noise_level,
            generator=state.generators,
            sigma_max=sigmas[1],
        )
        if stochastic:
            state.means[i] = mean
    state.log_probs.append(log_prob)
    state.versions.append(version)
    state.step += 1
    if state.done and state.num_steps in state.return_steps:
        state.captured[state.num_steps] = state.latents.to(torch.float32, copy=True)


def decode_chunks(batch: int, size: int) -> list[slice]:
    """The rows of each VAE decode of `batch` final latents (sampling.decode_batch_size): all at once for size 0,
    else `size` at a time (the last chunk may be shorter)."""
    if size == 0:
        return [slice(0, batch)]
    return [slice(start, min(start + size, batch)) for start in range(0, batch, size)]


@torch.no_grad()
def decode(model: DiffusionModel, latents: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """Final latents [B, N, C] -> images [B, H, W, 3] uint8, decoded in sampling.decode_batch_size chunks."""
    chunks = [model.decode(latents[rows], params.height, params.width)
              for rows in decode_chunks(latents.shape[0], params.decode_batch_size)]
    return None if chunks[0] is None else torch.cat(chunks)


@torch.no_grad()
def finish_rollout(model: DiffusionModel, state: RolloutState) -> list[Trajectory]:
    """Decode the final latents and split the batch into one Trajectory per sample."""
    if not state.done:
        raise RuntimeError(f"finish_rollout at step {state.step} of {state.num_steps}")
    return split_trajectories(state, decode(model, state.latents, state.params))


def split_trajectories(state: RolloutState, images: torch.Tensor | None) -> list[Trajectory]:
    """The finished batch as one Trajectory per sample, with its decoded `images` [B, H, W, 3] (or None). A sample
    whose latents or log-probabilities are not finite is an error: decoded and scored, it got a finite reward (an
    evaluation logged it as one), and trained on, a skipped step."""
    req, p = state.request, state.params
    log_probs = torch.stack(state.log_probs, dim=1).cpu()  # [B, T]
    finite = torch.isfinite(state.latents.flatten(1)).all(1).cpu() & torch.isfinite(log_probs).all(1)
    if not bool(finite.all()):
        bad = [b for b in range(len(finite)) if not finite[b]]
        raise FloatingPointError(f"rollout {req.request_id}: samples {bad} (seeds {[req.seeds[b] for b in bad]}) ended "
                                 f"with non-finite latents or log-probabilities under policy version "
                                 f"{sorted(set(state.versions))}: the weights or the sampling settings are broken")
    indices = sorted(state.captured)
    rows = [state.captured[i] for i in indices]
    B, N, C = state.latents.shape
    latents = (torch.stack(rows, dim=1) if rows else torch.zeros(B, 0, N, C)).cpu()  # [B, K, N, C]
    means = [state.means[i] for i in sorted(state.means)]
    means = (torch.stack(means, dim=1) if means else torch.zeros(B, 0, N, C)).cpu()  # [B, S, N, C]
    sde_mask = torch.tensor([i in state.sde_steps for i in range(state.num_steps)])
    versions = torch.tensor(state.versions, dtype=torch.int64)
    timesteps, sigmas = state.schedule.timesteps.cpu(), state.schedule.sigmas.cpu()  # one copy, shared by the samples
    # Each sample's tensors get storage of their own (clone): a row of a batch tensor pickles the whole batch's
    # storage, so every trajectory would carry the batch's bytes across actors (B times the request's data).
    return [
        Trajectory(
            prompt=req.prompts[b],
            prompt_id=req.prompt_ids[b],
            group_id=req.group_ids[b],
            seed=req.seeds[b],
            params=p,
            latents=latents[b].clone(),
            latent_indices=indices,
            timesteps=timesteps,
            sigmas=sigmas,
            log_probs=log_probs[b].clone(),
            sde_mask=sde_mask,
            versions=versions,
            means=means[b].clone(),
            conds={name: embeds[b].cpu() for name, embeds in state.conds.items()},
            image=None if images is None else images[b].clone(),
        )
        for b in range(len(req.prompts))
    ]


@torch.no_grad()
def generate(model: DiffusionModel, request: RolloutRequest, policy: CFGPolicy, version: int = 0) -> list[Trajectory]:
    """The single-process sampler: the oracle every distributed rollout is compared with."""
    state = start_rollout(model, request, policy)
    while not state.done:
        advance(state, local_guided_velocity(model, state, policy), version)
    return finish_rollout(model, state)
