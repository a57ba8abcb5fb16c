"""RL that visibly learns, in CI: the default DiffusionNFT recipe's settings on three counting prompts of the shipped
shapes base raise their strict accuracy beyond the noise of measuring it.

Run with the single-process reference trainer (the distributed synchronous run equals it bit for bit:
test_trainer.py) on one thread. Accuracy is measured before and after on fixed seeds that training never
samples (its seeds count up from trainer.seed x 1_000_003; these start at 10^6 + 10^5), 32 images per prompt,
ODE as the evaluation samples.

The threshold, from measurements on this 2-core machine (README, Learning on the shapes world):
- the noise: the base's accuracy on these prompts over 5 disjoint seed sets of 96 images is 45.8-57.3%
  (49.0% on the test's seeds; standard deviation 4.8 points, as a binomial's at p ~ 0.5 over 96 images, 5.1);
- the signal: 20 steps gained 17.7, 20.8, 21.8, 22.9 and 23.9 points for run seeds trainer.seed 0-4 (another
  run seed changes the training as another machine's rounding does);
- so the test asks for 12.5 points, 2.5 binomial standard deviations, with at least 5 points of margin.
The prompts were chosen as the counting prompts whose gains held across run seeds ("two red circles" rose in
some and collapsed in others).
"""

import dataclasses
import os

import torch

from rayflow import reference
from rayflow.config import load_config
from rayflow.paths import recipe
from rayflow.types import RolloutRequest

PROMPTS = os.path.join(os.path.dirname(__file__), "data", "shapes_counting.txt")
STEPS = 20
IMAGES_PER_PROMPT = 32
EVAL_SEED = 10**6 + 10**5
REQUIRED_GAIN = 0.125
"""2.5 binomial standard deviations of an accuracy near 0.5 over 96 images (sqrt(0.25 / 96) = 0.051)."""


def accuracy(run: reference.Run, prompts: list[str]) -> float:
    """Share of IMAGES_PER_PROMPT fixed-seed ODE samples per prompt whose every requirement is met."""
    cfg = run.cfg
    params = dataclasses.replace(cfg.sampling, sde_type="ode", sde_step_indices=None, return_step_indices=[cfg.sampling.num_steps])
    n, correct = IMAGES_PER_PROMPT, 0.0
    for i, prompt in enumerate(prompts):
        seeds = list(range(EVAL_SEED + i * n, EVAL_SEED + (i + 1) * n))
        trajectories = reference.sample(run, RolloutRequest(f"eval-{i}", [prompt] * n, [i] * n, [-1] * n, seeds, params))
        run.reward.score(trajectories)
        correct += sum(t.rewards["shapes_accuracy"] for t in trajectories)
    return correct / (n * len(prompts))


def test_diffusion_nft_raises_counting_accuracy_on_the_shapes_base_beyond_measurement_noise(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the measurements' setting: another thread count rounds the training differently
    try:
        cfg = load_config(recipe("diffusion_nft_qwen_image.yaml"), [
            f"data.prompts={PROMPTS}", "algorithm.prompts_per_step=3", f"trainer.total_steps={STEPS}",
            "trainer.save_every=0", "trainer.resume=never", f"trainer.output_dir={tmp_path}", "trainer.run_name=learn",
        ])
        run = reference.build_run(cfg)
        prompts = run.sampler.prompts
        before = accuracy(run, prompts)
        while run.step < STEPS:
            trajectories, _ = reference.rollout(run)
            reference.learn(run, trajectories)
        after = accuracy(run, prompts)
    finally:
        torch.set_num_threads(threads)
    print(f"counting accuracy {before:.3f} -> {after:.3f} in {STEPS} steps")
    assert after - before >= REQUIRED_GAIN, (
        f"accuracy {before:.3f} -> {after:.3f} after {STEPS} steps: less than the {REQUIRED_GAIN} the base's measurement "
        f"noise allows (module docstring)")
