"""RL visibly learns: the default DiffusionNFT recipe, on the shipped shapes base, raises the held-out
eval/shapes_accuracy by more than its noise within a short synchronous run on the session's Ray.

The noise, measured (the base, the recipe's CFG-free ODE evaluation, the 20 held-out prompts x 4 seeds
= 80 images, over 8 disjoint sets of seeds): accuracy 0.103 on average, standard deviation 0.023 from one
set of seeds to another. An evaluation moves by that much with nothing learnt; the test asks for three
times as much, on the same seeds before and after (which only makes the comparison less noisy)."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rayflow.config import load_config
from rayflow.driver.trainer import Trainer
from rayflow.paths import recipe

NOISE_SD = 0.023
"""Standard deviation of the base's eval/shapes_accuracy from one set of 4 seeds per prompt to another."""
THRESHOLD = 3 * NOISE_SD
STEPS = 20


def test_diffusion_nft_raises_held_out_shapes_accuracy_beyond_its_noise(ray_session, tmp_path):
    cfg = load_config(recipe("diffusion_nft_qwen_image.yaml"), [
        f"trainer.total_steps={STEPS}", f"trainer.eval_every={STEPS}", "trainer.eval_at_start=true", "data.eval_seeds=4",
        "trainer.save_every=0", f"trainer.output_dir={tmp_path}", "trainer.run_name=learn", "logging.progress_bar=false",
    ])
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    events = EventAccumulator(cfg.trainer.logdir)
    events.Reload()
    (start, end) = [(e.step, e.value) for e in events.Scalars("eval/shapes_accuracy")]
    assert start[0] == 0 and end[0] == STEPS
    assert end[1] - start[1] > THRESHOLD, f"eval/shapes_accuracy {start[1]:.3f} -> {end[1]:.3f}: not beyond 3 x {NOISE_SD}"
    assert start[1] == pytest.approx(0.1, abs=3 * NOISE_SD)  # the base as measured: partially competent, far from done
