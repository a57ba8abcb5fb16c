"""Stored reward/loss curves of short tiny-model runs of both algorithms: silent numeric drift in the
sampler, the losses or the optimizer changes them. (The distributed trainer equals this reference bit
for bit in synchronous mode: tests/test_trainer.py.)

Regenerate after an intended change with:  python tests/test_curves.py --write
"""

import json
import os
import sys

import pytest
import torch

from rayflow import reference
from tiny_run import GRPO, NFT, small_cfg

CURVES = os.path.join(os.path.dirname(__file__), "data", "tiny_curves.json")
STEPS = 5


def curve(recipe: str, model_dir: str, out_dir) -> dict[str, list[float]]:
    cfg = small_cfg(recipe, model_dir, out_dir, f"trainer.total_steps={STEPS}", "trainer.save_every=0")
    _, history = reference.train(cfg, log=lambda *_: None)
    return {"reward_mean": [h.reward_mean for h in history], "loss": [h.loss for h in history],
            "grad_norm": [h.grad_norm for h in history]}


def loss_noise(cfg) -> float:
    """The rounding noise of a loss that is a mean of terms of size <= adv_clip_max: float32 epsilon times that
    scale times the number of terms (samples x denoising steps). FlowGRPO's synchronous loss with one
    mini-batch is exactly such noise: ratio == 1 and each group's advantages sum to zero."""
    terms = cfg.algorithm.batch_size * cfg.sampling.num_steps
    return torch.finfo(torch.float32).eps * cfg.algorithm.adv_clip_max * terms


@pytest.mark.parametrize("recipe", [GRPO, NFT])
def test_tiny_run_follows_its_stored_curve(tiny_model_dir, tmp_path, recipe):
    with open(CURVES) as f:
        stored = json.load(f)[os.path.basename(recipe)]
    got = curve(recipe, tiny_model_dir, tmp_path)
    noise = loss_noise(small_cfg(recipe, tiny_model_dir, tmp_path))
    for key, values in stored.items():
        # Tight, not exact: another CPU's kernels may round differently. Rewards and gradient norms carry
        # signal at their own scale (relative 1e-4); a loss is also allowed its rounding noise in absolute terms.
        assert got[key] == pytest.approx(values, rel=1e-4, abs=noise if key == "loss" else 0), key


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    from rayflow.models.tiny import save_tiny_model

    torch.set_num_threads(1)  # as the tests run (tests/conftest.py)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(os.path.join(tmp, "tiny-qwen-image"), size="tiny", seed=0)
        curves = {os.path.basename(r): curve(r, model_dir, os.path.join(tmp, "out", os.path.basename(r))) for r in (GRPO, NFT)}
    os.makedirs(os.path.dirname(CURVES), exist_ok=True)
    with open(CURVES, "w") as f:
        json.dump(curves, f, indent=2)
    print(f"wrote {CURVES}")
