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
RELATIVE_TOLERANCE = {"reward_mean": 1e-4, "loss": 1e-4, "grad_norm": 1e-3}
"""Tight, not exact: another CPU's kernels round differently. The largest relative deviation from the stored curves
over 20 kernel settings on one machine (2026-11-29: ATEN_CPU_CAPABILITY avx512 / avx2 / default, MKL_ENABLE_INSTRUCTIONS
and ONEDNN_MAX_CPU_ISA AVX2 / AVX / SSE4, MKL_CBWR; 1, 2 or 4 threads): reward_mean 7e-6, DiffusionNFT's loss 9e-7,
grad_norm 2e-5 (FlowGRPO) and 1.4e-4 at one thread, 2.3e-4 at two (DiffusionNFT: its tolerance of 1e-4 failed with
ATen's scalar kernels beside MKL's AVX2 ones, and all of AVX2's kernels came to 9.9e-5). A gradient norm drifts most:
AdamW moves every weight by about lr whatever its gradient's size, so a gradient component that is rounding noise moves
its weight a full step in a direction the kernels pick, and the next steps' gradients carry it (DiffusionNFT's first
step's norm deviates by 7e-6, its third by up to 2.3e-4). A gradient 1% off scale fails the first step's norm; a change
that moves a 5-step curve less than the kernels do (AdamW's beta1 0.9 -> 0.891: grad_norm 8e-4) is past what a stored
curve can tell from another CPU's rounding (the distributed trainer is compared with the reference bit for bit)."""


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
        # A loss is also allowed its rounding noise in absolute terms (FlowGRPO's is that noise and nothing else).
        assert got[key] == pytest.approx(values, rel=RELATIVE_TOLERANCE[key], abs=noise if key == "loss" else 0), key


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
