"""Evaluation: data.eval_seeds samples of each evaluation prompt with the same seeds every time, sampled as an ODE
with the rollouts' settings or trainer.eval_num_steps / eval_guidance_scale / eval_solver (flow_grpo's and
DiffusionNFT's sample.eval_* keys), on the rollout replicas exactly as the single-process sampler does."""

import dataclasses
import re

import pytest
import torch

from rayflow import reference
from rayflow.config import RayflowConfig, load_config
from rayflow.driver.evaluation import EVAL_GROUP_ID, Evaluator, evaluation_params
from rayflow.driver.trainer import Trainer
from rayflow.errors import ConfigError
from rayflow.paths import recipe
from tiny_run import NFT, small_cfg


def test_each_eval_prompt_gets_eval_seeds_distinct_fixed_seeds():
    cfg = RayflowConfig()
    cfg.data.eval_prompts = recipe("prompts/shapes_eval.txt")
    cfg.data.eval_seeds = 3
    requests = Evaluator(cfg.data, evaluation_params(cfg.sampling, cfg.trainer), [], generate=None, rewards=None).requests
    assert len(requests) == 20
    assert requests[1].prompts == ["a green circle"] * 3 and requests[1].seeds == [3, 4, 5]
    assert {g for r in requests for g in r.group_ids} == {EVAL_GROUP_ID}
    assert sorted(s for r in requests for s in r.seeds) == list(range(60))
    assert all(r.params.sde_type == "ode" for r in requests)


def test_an_evaluation_under_the_rollout_weights_waits_for_its_steps_version():
    """Asynchronous runs evaluate before the step's broadcast has landed: the requests carry min_version = step, so a
    rank samples them under that version, not the one before. Under the EMA's weights they need none."""
    cfg = RayflowConfig()
    sent = []

    def generate(requests, weights):
        sent.append(([r.min_version for r in requests], weights))
        raise StopIteration  # what was asked is all this test needs

    evaluator = Evaluator(cfg.data, evaluation_params(cfg.sampling, cfg.trainer), ["a red apple", "a blue car"],
                          generate=generate, rewards=None)
    for weights in (None, "ema"):
        with pytest.raises(StopIteration):
            evaluator.run(7, monitor=None, weights=weights)
    assert sent == [([7, 7], None), ([None, None], "ema")]


def test_evaluation_params_take_the_rollouts_settings_unless_the_eval_keys_are_set():
    cfg = load_config(recipe("flowgrpo_tiny.yaml"), ["sampling.sde_window_size=2", "sampling.sde_window_range=[0,4]",
                                                      "sampling.same_initial_noise=true"])
    s = cfg.sampling
    same = evaluation_params(s, cfg.trainer)
    assert (same.num_steps, same.guidance_scale, same.solver) == (s.num_steps, s.guidance_scale, s.solver)
    assert same.sde_type == "ode" and same.resolved_sde_steps() == [] and same.return_step_indices == [s.num_steps]
    assert not same.same_initial_noise  # each fixed seed its own start (an ODE group would be one image)
    same.validate()
    cfg.trainer.eval_num_steps, cfg.trainer.eval_guidance_scale, cfg.trainer.eval_solver = 1, 1.0, "dpm2"
    other = evaluation_params(s, cfg.trainer)
    assert (other.num_steps, other.guidance_scale, other.solver) == (1, 1.0, "dpm2")
    assert other.return_step_indices == [1] and other.sde_window_size is None and other.sde_window_range is None
    other.validate()  # the rollouts' 2-step window, wider than the evaluation's 1 step, does not carry over
    assert (s.num_steps, s.sde_type, s.sde_window_size) == (6, "sde", 2)  # the rollouts' own are untouched


@pytest.mark.parametrize("key, value, allowed", [("eval_num_steps", 0, "an integer >= 1"),
                                                 ("eval_guidance_scale", 0.5, "a float >= 1.0"),
                                                 ("eval_solver", "heun", "one of ['euler', 'dpm2']")])
def test_a_bad_eval_key_is_named_with_what_it_allows(key, value, allowed):
    with pytest.raises(ConfigError, match=rf"trainer\.{key}: got '?{value}'?; allowed: .*{re.escape(allowed)}"):
        load_config(recipe("flowgrpo_tiny.yaml"), [f"trainer.{key}={value}"])


def test_replicas_evaluate_with_the_eval_keys_as_the_single_process_sampler(ray_session, tiny_model_dir, tmp_path):
    """The tiny DiffusionNFT recipe rolls out CFG-free with dpm2; evaluated with 3 Euler steps under CFG 2, the rollout
    replicas' evaluation samples are the single-process sampler's with those settings written out, bit for bit."""
    eval_keys = ("trainer.eval_num_steps=3", "trainer.eval_guidance_scale=2.0", "trainer.eval_solver=euler",
                 "data.eval_seeds=2", "logging.progress_bar=false")
    cfg = small_cfg(NFT, tiny_model_dir, tmp_path / "run", *eval_keys)
    assert (cfg.sampling.num_steps, cfg.sampling.guidance_scale, cfg.sampling.solver) == (4, 1.0, "dpm2")
    trainer = Trainer(cfg)
    try:
        requests = trainer.evaluator.requests
        sampled = trainer._generate(requests)
    finally:
        trainer.shutdown()
    run = reference.build_run(cfg)
    written_out = dataclasses.replace(cfg.sampling, num_steps=3, guidance_scale=2.0, solver="euler", return_step_indices=[3])
    expected = [t for r in requests for t in reference.sample(run, dataclasses.replace(r, params=written_out))]
    assert len(sampled) == len(expected) == 2 * len(requests) > 2
    assert all(torch.equal(a.latents, b.latents) and torch.equal(a.image, b.image) for a, b in zip(sampled, expected))
    as_rolled_out = reference.sample(run, dataclasses.replace(requests[0], params=dataclasses.replace(
        cfg.sampling, return_step_indices=[4])))
    assert not torch.equal(as_rolled_out[0].image, expected[0].image)
