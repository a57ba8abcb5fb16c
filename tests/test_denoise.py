"""The denoising loop on the tiny Qwen-Image: gating, capture, log-probs, versions, batch independence."""

import pytest
import torch

from rayflow.cfg.policy import TrueCFG
from rayflow.data.prompts import PromptGroup
from rayflow.errors import ConfigError
from rayflow.models.base import PromptEmbeds
from rayflow.sampling.denoise import advance, finish_rollout, generate, local_guided_velocity, start_rollout
from rayflow.sampling.flow_sde import flow_step
from rayflow.types import RolloutRequest, SamplingParams

PROMPT = "a red apple"
T = 8
POLICY = TrueCFG()


def request(seeds, prompts=None, group_ids=None, **params) -> RolloutRequest:
    prompts = prompts or [PROMPT] * len(seeds)
    group_ids = group_ids or [0] * len(seeds)
    return RolloutRequest("r", prompts, list(range(len(seeds))), group_ids, seeds, SamplingParams(num_steps=T, **params))


def run(model, seeds, **kwargs):
    return generate(model, request(seeds, **kwargs), POLICY)


@pytest.mark.parametrize("seed", [0, 7])
def test_ode_matches_diffusers_pipeline_bit_for_bit(tiny_model, tiny_pipeline, seed):
    (traj,) = run(tiny_model, [seed], sde_type="ode", negative_prompt="blurry")
    expected = tiny_pipeline(
        PROMPT, negative_prompt="blurry", true_cfg_scale=4.0, height=64, width=64, num_inference_steps=T,
        generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
    ).images
    assert torch.equal(traj.latent(T), expected[0])


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_default_gating_is_every_step_but_the_last(tiny_model, sde_type):
    (traj,) = run(tiny_model, [1], sde_type=sde_type)
    stochastic = torch.tensor([True] * (T - 1) + [False])
    assert torch.equal(traj.sde_mask, stochastic)
    assert torch.equal(traj.log_probs != 0, stochastic)
    if sde_type == "cps":
        assert (traj.log_probs <= 0).all()  # −(x' − μ)², constants dropped


def test_no_sde_steps_is_the_ode_sampler(tiny_model):
    (ode,) = run(tiny_model, [2], sde_type="ode")
    (gated,) = run(tiny_model, [2], sde_type="sde", sde_step_indices=[])
    assert torch.equal(gated.latents, ode.latents)
    assert not gated.sde_mask.any() and torch.equal(gated.log_probs, torch.zeros(T))


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_custom_sde_steps_gate_exactly_those(tiny_model, sde_type):
    (ode,) = run(tiny_model, [3], sde_type="ode")
    (traj,) = run(tiny_model, [3], sde_type=sde_type, sde_step_indices=[3, 1])
    assert traj.sde_mask.nonzero().flatten().tolist() == [1, 3]
    assert (traj.log_probs != 0).nonzero().flatten().tolist() == [1, 3]
    assert torch.equal(traj.latents[:2], ode.latents[:2])  # x_0, x_1: step 0 is ODE
    assert not torch.equal(traj.latent(2), ode.latent(2))  # step 1 added noise


def test_capture_all_and_subset(tiny_model):
    (full,) = run(tiny_model, [4])
    noise, _ = tiny_model.prepare_latents([4], 64, 64)
    assert full.latent_indices == list(range(T + 1)) and full.latents.shape == (T + 1, 16, 16)
    assert torch.equal(full.latent(0), noise[0])
    (subset,) = run(tiny_model, [4], return_step_indices=[T, 0, 3])
    assert subset.latent_indices == [0, 3, T] and subset.latents.shape == (3, 16, 16)
    for i in (0, 3, T):
        assert torch.equal(subset.latent(i), full.latent(i))  # capture does not change sampling
    with pytest.raises(KeyError, match=r"x_2 was not captured \(captured: \[0, 3, 8\]\).*return_step_indices"):
        subset.latent(2)
    (none,) = run(tiny_model, [4], sde_type="ode", return_step_indices=[])
    assert none.latent_indices == [] and none.latents.shape == (0, 16, 16)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_learner_reevaluates_recorded_log_probs(tiny_model, sde_type):
    (traj,) = run(tiny_model, [5], sde_type=sde_type)
    conds = {name: PromptEmbeds(c.unsqueeze(0), None) for name, c in traj.conds.items()}
    sigmas = traj.sigmas
    for i in range(T):
        x = traj.latent(i).unsqueeze(0)
        preds = [tiny_model.predict_velocity(x, traj.timesteps[i], conds[n], 64, 64) for n in ("positive", "negative")]
        v = POLICY.combine(preds, 4.0)
        if traj.sde_mask[i]:
            x_next = traj.latent(i + 1).unsqueeze(0)
            _, log_prob, _, _ = flow_step(
                v, x, sigmas[i], sigmas[i + 1], sde_type=sde_type, noise_level=0.7, prev_sample=x_next, sigma_max=sigmas[1]
            )
            torch.testing.assert_close(log_prob[0], traj.log_probs[i], rtol=0, atol=1e-6)
        else:
            x_next, _, _, _ = flow_step(v, x, sigmas[i], sigmas[i + 1], sde_type="ode", noise_level=0.7)
            assert torch.equal(x_next[0], traj.latent(i + 1))


def test_group_seeds_give_distinct_trajectories(tiny_model):
    trajs = run(tiny_model, [0, 1, 2])
    for a in range(3):
        for b in range(a + 1, 3):
            assert not torch.equal(trajs[a].latent(T), trajs[b].latent(T))
            assert not torch.equal(trajs[a].log_probs, trajs[b].log_probs)
    request([1, 1], group_ids=[0, 1]).validate()  # one seed in two groups is fine
    with pytest.raises(ConfigError, match="seed 1 twice in group 0"):
        run(tiny_model, [1, 2, 1])


def test_same_initial_noise_starts_a_group_from_its_first_seeds_noise_and_keeps_each_samples_sde_noise(tiny_model):
    group = PromptGroup(group_id=3, prompt_id=0, prompt=PROMPT, seeds=(10, 11, 12))
    params = SamplingParams(num_steps=T, same_initial_noise=True)
    requests = group.requests(params, micro_batch_size=2)  # the group split over two requests
    assert [r.noise_seeds for r in requests] == [[10, 10], [10]]
    shared = [t for r in requests for t in generate(tiny_model, r, POLICY)]
    start, _ = tiny_model.prepare_latents([10], 64, 64)
    assert all(torch.equal(t.latent(0), start[0]) for t in shared)
    assert [t.seed for t in shared] == [10, 11, 12]
    assert not torch.equal(shared[1].latent(T), shared[0].latent(T)) and not torch.equal(shared[2].latent(T), shared[0].latent(T))
    # Seed 10 starts from its own noise: its sample is the one it would be unshared, bit for bit.
    own = generate(tiny_model, request([10, 11]), POLICY)
    assert torch.equal(shared[0].latents, own[0].latents) and torch.equal(shared[0].log_probs, own[0].log_probs)
    # Seed 11's stochastic steps draw seed 11's noise, as unshared: x_1 − μ_0 is the same std·ε.
    torch.testing.assert_close(shared[1].latent(1) - shared[1].step_mean(0), own[1].latent(1) - own[1].step_mean(0),
                               rtol=0, atol=1e-5)
    assert not torch.equal(shared[1].latent(0), own[1].latent(0))
    assert group.requests(SamplingParams(num_steps=T), micro_batch_size=2)[0].noise_seeds is None  # off by default


@pytest.mark.parametrize("params", [dict(sde_type="ode"), dict(sde_step_indices=[]), dict(num_steps=1)])
def test_same_initial_noise_without_a_stochastic_step_is_refused(params):
    with pytest.raises(ConfigError, match=r"sampling\.same_initial_noise.*some step samples stochastically"):
        SamplingParams(**{"num_steps": T, **params, "same_initial_noise": True}).validate()
    SamplingParams(num_steps=T, sde_type="ode", sde_step_indices=[], same_initial_noise=False).validate()
    SamplingParams(num_steps=T, sde_window_size=2, same_initial_noise=True).validate()  # a window is stochastic


@pytest.mark.parametrize("sde_type", ["sde", "cps", "ode"])
def test_sample_does_not_depend_on_its_batch(tiny_model, sde_type):
    (alone,) = run(tiny_model, [5], sde_type=sde_type)
    prompts = ["a blue car on a green tree next to a house", PROMPT, "cat"]  # different lengths: padded, masked
    batch = run(tiny_model, [3, 5, 7], prompts=prompts, group_ids=[1, 0, 2], sde_type=sde_type)
    assert [(t.prompt, t.group_id, t.seed) for t in batch] == list(zip(prompts, [1, 0, 2], [3, 5, 7]))
    for name in ("positive", "negative"):
        assert torch.equal(batch[1].conds[name], alone.conds[name])
    # Batched matmuls round differently: equal to ~1e-6 relative, not bit for bit.
    torch.testing.assert_close(batch[1].latents, alone.latents, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(batch[1].log_probs, alone.log_probs, rtol=1e-6, atol=1e-6)


def test_versions_follow_advance_and_manual_loop_equals_generate(tiny_model):
    req = request([6, 8])
    state = start_rollout(tiny_model, req, POLICY)
    versions = [0, 0, 0, 1, 1, 2, 2, 2]
    for version in versions:
        advance(state, local_guided_velocity(tiny_model, state, POLICY), version)
    trajs = finish_rollout(tiny_model, state)
    reference = generate(tiny_model, req, POLICY, version=0)
    for traj, ref in zip(trajs, reference):
        assert torch.equal(traj.versions, torch.tensor(versions)) and traj.oldest_version == 0
        assert torch.equal(traj.latents, ref.latents) and torch.equal(traj.log_probs, ref.log_probs)
        assert traj.image.shape == (64, 64, 3) and traj.image.dtype == torch.uint8


def test_finish_before_done_and_bad_size_raise(tiny_model):
    state = start_rollout(tiny_model, request([0]), POLICY)
    with pytest.raises(RuntimeError, match="step 0 of 8"):
        finish_rollout(tiny_model, state)
    with pytest.raises(ValueError, match="sampling.height: got 72"):
        start_rollout(tiny_model, request([0], height=72), POLICY)


def test_a_sample_that_ends_non_finite_is_an_error_naming_it(tiny_model, monkeypatch):
    """Decoded and scored, a NaN sample got a finite reward (an evaluation logged it as one); it is refused instead."""
    velocity = tiny_model.predict_velocity

    def nan_for_the_second_sample(latents, *args, **kwargs):
        v = velocity(latents, *args, **kwargs).clone()
        v[1::2] = float("nan")  # the second sample of each CFG half
        return v

    monkeypatch.setattr(tiny_model, "predict_velocity", nan_for_the_second_sample)
    with pytest.raises(FloatingPointError, match=r"^rollout r: samples \[1\] \(seeds \[8\]\) ended with non-finite "
                                                 r"latents or log-probabilities under policy version \[0\]"):
        run(tiny_model, [7, 8])


def test_a_trajectory_pickles_its_own_sample_not_its_whole_batch(tiny_model):
    """Trajectories cross actors one request at a time: a sample of an 8-sample request pickles to what a sample of
    a 1-sample request does (a row of a batch tensor would carry the whole batch's storage with it)."""
    import pickle

    (alone,) = run(tiny_model, [5])
    batch = run(tiny_model, list(range(8)))
    size = len(pickle.dumps(alone))
    assert all(abs(len(pickle.dumps(t)) - size) <= 64 for t in batch), (size, [len(pickle.dumps(t)) for t in batch])
