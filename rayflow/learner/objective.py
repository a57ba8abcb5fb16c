"""Forward + backward of the RL objectives over a shard of trajectories, on any DiffusionModel.

The single-process reference trainer and the FSDP2 learner ranks both call these, so the two
compute the same thing by construction. Each function runs micro-batches of the shard, and
backpropagates one denoising step at a time (activations of one step only), with the loss scaled
so the accumulated gradient is that of the mean over the shard's samples x trained steps.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from rayflow.algorithms.diffusion_nft import diffusion_nft_loss, noised, optimality_probability
from rayflow.algorithms.flow_grpo import RatioNorm, flow_grpo_loss
from rayflow.cfg.policy import CFGPolicy
from rayflow.config import AlgorithmConfig
from rayflow.learner.spec import LearnerSpec
from rayflow.models.lora import EMA_ADAPTER
from rayflow.models.weight_sets import using_reference, using_weights
from rayflow.models.base import DiffusionModel, PromptEmbeds
from rayflow.rng import keyed_generator
from rayflow.sampling.flow_sde import flow_step, sde_std_dev
from rayflow.types import Trajectory


def micro_batches(trajectories: list[Trajectory], size: int) -> list[list[Trajectory]]:
    """Consecutive runs of at most `size`, cut where the sampling parameters change (rollouts of
    different versions may have different SDE windows, so different trained steps)."""
    out: list[list[Trajectory]] = []
    for t in trajectories:
        if out and len(out[-1]) < size and out[-1][0].params == t.params:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def _stack_latent(trajs: list[Trajectory], index: int, device: torch.device) -> torch.Tensor:
    return torch.stack([t.latent(index) for t in trajs]).to(device)


def _stack_step_mean(trajs: list[Trajectory], step: int, device: torch.device) -> torch.Tensor:
    return torch.stack([t.step_mean(step) for t in trajs]).to(device)


def _conds(trajs: list[Trajectory], device: torch.device) -> dict[str, PromptEmbeds]:
    names = trajs[0].conds.keys()
    padded = {name: PromptEmbeds.pad([t.conds[name] for t in trajs]) for name in names}
    return {
        name: PromptEmbeds(p.embeds.to(device), None if p.mask is None else p.mask.to(device))
        for name, p in padded.items()
    }


def _advantages(trajs: list[Trajectory], device: torch.device) -> torch.Tensor:
    missing = [t.seed for t in trajs if t.advantage is None]
    if missing:
        raise ValueError(f"trajectories with seeds {missing} have no advantage; compute advantages before training")
    return torch.tensor([t.advantage for t in trajs], dtype=torch.float32, device=device)


def _check_same_params(trajs: list[Trajectory]) -> None:
    params = trajs[0].params
    if any(t.params != params for t in trajs):
        raise ValueError("a micro-batch mixes trajectories sampled with different SamplingParams")


class _Metrics:
    """Running means of named scalars, weighted by the loss scale of each contribution."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, weight: float, **values: torch.Tensor) -> None:
        for name, value in values.items():
            self.sums[name] += weight * float(value)

    def result(self) -> dict[str, float]:
        return dict(self.sums)


def _guided_velocity(model: DiffusionModel, policy: CFGPolicy, x: torch.Tensor, timestep: torch.Tensor,
                     conds: dict[str, PromptEmbeds], params) -> torch.Tensor:
    branches = policy.build(conds, params.guidance_scale)
    preds = [model.predict_velocity(x, timestep, height=params.height, width=params.width, **b.kwargs) for b in branches]
    return policy.combine(preds, params.guidance_scale)


def _kl_std(kl_type: str, params, transition_std: torch.Tensor, sigma: torch.Tensor, sigma_max: torch.Tensor,
            device: torch.device) -> torch.Tensor:
    """The std FlowGRPO's KL divides by. "transition": the step's own std (s·sqrt(−dt) for SDE).
    "flow_grpo": flow_grpo's `std_dev_t`, which for the SDE is s = a·sqrt(σ/(1 − σ̃)) without sqrt(−dt)
    (scripts/train_sd3.py); for CPS, std_dev_t is the step's std s = σ'·sin(aπ/2), so both agree."""
    if kl_type == "transition" or params.sde_type != "sde":
        return transition_std
    return sde_std_dev(torch.as_tensor(sigma, dtype=torch.float32, device=device), params.noise_level, sigma_max)


def trained_steps(params, algo: AlgorithmConfig) -> list[int]:
    """The denoising steps FlowGRPO trains of a rollout sampled with `params`: its stochastic steps
    j < int(num_steps x timestep_fraction) (flow_grpo: range(int(num_steps x fraction)))."""
    last = int(params.num_steps * algo.timestep_fraction)
    return [j for j in params.resolved_sde_steps() if j < last]


def _pad_passes(missing: int, loss: Callable[[], torch.Tensor]) -> None:
    """`missing` more forward/backward passes that add nothing (`loss` computed again, its gradient times 0).

    Under FSDP2 every pass is a sequence of collectives (a gather per block in each forward, a reduce-scatter per
    block in each backward), so every rank must run as many passes in an optimizer step; a rank whose shard needs
    fewer (its micro-batches cut at fewer changes of sampling parameters: an asynchronous batch mixing SDE windows)
    runs the difference this way. With unequal counts the ranks' collectives parted and the step hung."""
    for _ in range(missing):
        (loss() * 0.0).backward()


def flow_grpo_backward(
    model: DiffusionModel,
    policy: CFGPolicy,
    shard: list[Trajectory],
    algo: AlgorithmConfig,
    micro_batch_size: int,
    passes: int | None = None,
) -> dict[str, float]:
    """Accumulate FlowGRPO gradients of the shard; returns loss/policy, loss/kl, clip_frac, approx_kl.
    `passes`: forward/backward passes to run in all (`num_passes` of the rank that needs most; None: the shard's own)."""
    metrics = _Metrics()
    device = model.device
    ran = 0
    for mb in micro_batches(shard, micro_batch_size):
        _check_same_params(mb)
        params = mb[0].params
        trained = trained_steps(params, algo)
        sigmas, timesteps = mb[0].sigmas, mb[0].timesteps
        conds = _conds(mb, device)
        advantages = _advantages(mb, device)
        old_log_probs = torch.stack([t.log_probs for t in mb]).to(device)  # [b, T]
        scale = len(mb) / len(shard) / len(trained)

        def step_loss(j: int):
            x, x_next = _stack_latent(mb, j, device), _stack_latent(mb, j + 1, device)
            step = dict(sde_type=params.sde_type, noise_level=params.noise_level, prev_sample=x_next, sigma_max=sigmas[1])
            ref_mean = None
            if algo.kl_beta > 0:  # before the policy's forward: no graph may hold weights a full-weight swap changes
                with torch.no_grad(), using_reference(model.transformer):
                    v_ref = _guided_velocity(model, policy, x, timesteps[j], conds, params)
                    _, _, ref_mean, _ = flow_step(v_ref, x, sigmas[j], sigmas[j + 1], **step)
            v = _guided_velocity(model, policy, x, timesteps[j], conds, params)
            _, log_prob, mean, std = flow_step(v, x, sigmas[j], sigmas[j + 1], **step)
            ratio_norm = None
            if algo.ratio_norm:
                ratio_norm = RatioNorm(_stack_step_mean(mb, j, device), std, (sigmas[j + 1] - sigmas[j]).to(device))
            return flow_grpo_loss(
                log_prob, old_log_probs[:, j], advantages, algo.clip_range,
                mean=mean, ref_mean=ref_mean, std=_kl_std(algo.kl_type, params, std, sigmas[j], sigmas[1], device),
                kl_beta=algo.kl_beta, ratio_norm=ratio_norm,
            )

        for j in trained:
            out = step_loss(j)
            (out.loss * scale).backward()
            metrics.add(scale, **{"loss/policy": out.policy, "loss/kl": out.kl,
                                  "train/clip_frac": out.clip_frac, "train/approx_kl": out.approx_kl})
            ran += 1
    if passes is not None:
        _pad_passes(passes - ran, lambda: step_loss(trained[-1]).loss)
    return metrics.result()


def nft_trained_count(num_steps: int, num_timesteps: int | None) -> int:
    """How many of a rollout's `num_steps` timesteps DiffusionNFT trains per sample (algorithm.nft_timesteps; None:
    all of them)."""
    return num_steps if num_timesteps is None else min(num_timesteps, num_steps)


def nft_noise_and_steps(trajectory: Trajectory, run_seed: int, version: int, num_timesteps: int | None
                        ) -> tuple[list[int], torch.Tensor]:
    """The timestep indices a sample trains on at this version, and its ε for each ([k, N, C]).

    Drawn from a generator keyed by (run seed, version, sample seed) alone, so every learner rank,
    any micro-batching and the reference trainer draw the same."""
    g = keyed_generator(run_seed, version, trajectory.seed)
    T = trajectory.params.num_steps
    steps = list(range(T)) if num_timesteps is None else sorted(torch.randperm(T, generator=g)[: nft_trained_count(T, num_timesteps)].tolist())
    final = trajectory.latent(T)
    noise = torch.randn((len(steps), *final.shape), generator=g, dtype=torch.float32)
    return steps, noise


def diffusion_nft_backward(
    model: DiffusionModel,
    policy: CFGPolicy,
    shard: list[Trajectory],
    algo: AlgorithmConfig,
    micro_batch_size: int,
    run_seed: int,
    version: int,
    passes: int | None = None,
) -> dict[str, float]:
    """Accumulate DiffusionNFT gradients of the shard (conditional velocity, no CFG: NFT trains the
    policy itself; the policy only adds its conditional branch's arguments, such as an embedded
    guidance); returns loss/policy and loss/kl. `passes`: as flow_grpo_backward's."""
    metrics = _Metrics()
    device = model.device
    ran = 0
    for mb in micro_batches(shard, micro_batch_size):
        _check_same_params(mb)
        params = mb[0].params
        T = params.num_steps
        positive = _conds(mb, device)["positive"]
        x0 = _stack_latent(mb, T, device)
        r = optimality_probability(_advantages(mb, device), algo.adv_clip_max, algo.adv_mode)
        draws = [nft_noise_and_steps(t, run_seed, version, algo.nft_timesteps) for t in mb]
        k = len(draws[0][0])
        scale = len(mb) / len(shard) / k

        def slot_loss(slot: int):
            idx = torch.tensor([steps[slot] for steps, _ in draws])
            sigma = mb[0].sigmas[idx].to(device)
            timestep = mb[0].timesteps[idx].to(device)
            x_t = noised(x0, torch.stack([noise[slot] for _, noise in draws]).to(device), sigma)

            def velocity() -> torch.Tensor:
                return model.predict_velocity(x_t, timestep, positive, height=params.height, width=params.width,
                                              **policy.conditional_kwargs(params.guidance_scale))

            with torch.no_grad(), using_weights(model.transformer, EMA_ADAPTER):
                v_old = velocity()
            v_ref = None
            if algo.kl_beta > 0:
                with torch.no_grad(), using_reference(model.transformer):
                    v_ref = velocity()
            return diffusion_nft_loss(
                velocity(), v_old, x0, x_t, sigma, r,
                beta=algo.nft_beta, adv_clip_max=algo.adv_clip_max, v_ref=v_ref, kl_beta=algo.kl_beta,
            )

        for slot in range(k):
            out = slot_loss(slot)
            (out.loss * scale).backward()
            metrics.add(scale, **{"loss/policy": out.policy, "loss/kl": out.kl})
            ran += 1
    if passes is not None:
        _pad_passes(passes - ran, lambda: slot_loss(k - 1).loss)
    return metrics.result()


def num_passes(spec: LearnerSpec, shard: list[Trajectory]) -> int:
    """The forward/backward passes `backward` runs over `shard`: one per micro-batch and trained step (FlowGRPO) or
    trained timestep (DiffusionNFT)."""
    algo, total = spec.algorithm, 0
    for mb in micro_batches(shard, spec.learner.micro_batch_size):
        params = mb[0].params
        if algo.name == "flow_grpo":
            total += len(trained_steps(params, algo))
        else:
            total += nft_trained_count(params.num_steps, algo.nft_timesteps)
    return total


def backward(spec: LearnerSpec, model: DiffusionModel, policy: CFGPolicy, shard: list[Trajectory], version: int,
             passes: int | None = None) -> dict[str, float]:
    """Accumulate the configured algorithm's gradients over a shard of scored trajectories (the mean
    over the shard's samples x trained steps); `version` is the policy version being trained. `passes`: the
    forward/backward passes to run in all, at least the shard's `num_passes` (FSDP2 ranks: the most any rank's
    shard needs, so their collectives pair up); None: the shard's own."""
    if spec.algorithm.name == "flow_grpo":
        return flow_grpo_backward(model, policy, shard, spec.algorithm, spec.learner.micro_batch_size, passes)
    return diffusion_nft_backward(model, policy, shard, spec.algorithm, spec.learner.micro_batch_size, spec.seed, version,
                                  passes)
