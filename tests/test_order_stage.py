"""tools/order_stage.py: its target (the base's velocity plus half the difference between a relation prompt's stable
target field and its swap's) against the formula written out, its first steps on the shipped pretrained base
(deterministic, the anchor rows free while the policy is the base), that the shipped base's manifest is the rebuild
command's config, and its bad input."""

import json
import os
import shlex
import sys
from dataclasses import asdict, replace

import pytest
import torch

from rayflow.models.shapes import MANIFEST, PRETRAINED_MODEL_DIR, REBUILD_COMMAND, SHAPES_MODEL_DIR
from rayflow.paths import REPO_ROOT
from rayflow.worlds.shapes import parse_prompt, prompt_of

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from order_stage import (  # noqa: E402
    OrderStageConfig, StageScenes, held_out_arrangements, main, order_prompts, order_stage, order_target, parse_args,
    stage_scenes, swapped, target_field,
)


def test_swapped_exchanges_the_two_objects_and_keeps_the_relation():
    req = parse_prompt("a red triangle above a blue circle")
    assert prompt_of(swapped(req)) == "a blue circle above a red triangle"
    assert prompt_of(swapped(swapped(req))) == "a red triangle above a blue circle"


def test_a_held_out_relation_is_held_out_in_its_scenes_not_only_its_wording():
    """The same scene worded the other way round, and the exchanged order (an order row's contrast), are held out too;
    the same two objects on the other axis are other scenes."""
    assert set(held_out_arrangements(parse_prompt("a red triangle above a blue circle"))) == {
        "a red triangle above a blue circle", "a blue circle below a red triangle",  # the scene asked for
        "a blue circle above a red triangle", "a red triangle below a blue circle",  # its swap
    }
    assert set(held_out_arrangements(parse_prompt("a blue triangle to the right of a green square"))) == {
        "a blue triangle to the right of a green square", "a green square to the left of a blue triangle",
        "a green square to the right of a blue triangle", "a blue triangle to the left of a green square",
    }


def test_target_field_weighs_each_scene_by_how_likely_it_makes_x_t():
    g = torch.Generator().manual_seed(0)
    scenes = torch.randn(3, 4, 5, 2, generator=g)  # [B, S, N, C]
    xt = torch.randn(3, 5, 2, generator=g)
    sigma = torch.tensor([0.7, 0.9, 1.0])
    expected = torch.zeros(3, 5, 2)
    for b in range(3):
        s = float(sigma[b])
        logits = [-((xt[b] - (1 - s) * scenes[b, j]) ** 2).sum() / (2 * s * s) for j in range(4)]
        w = torch.softmax(torch.stack(logits), dim=0)
        expected[b] = sum(w[j] * scenes[b, j] for j in range(4))
    assert torch.allclose(target_field(xt, sigma, scenes), expected, atol=1e-6)
    # At σ = 1, x_t carries nothing of x₀: every scene weighs the same, and the field is their mean.
    assert torch.allclose(target_field(xt, torch.ones(3), scenes), scenes.mean(dim=1), atol=1e-6)


def test_order_target_is_the_base_velocity_plus_half_the_two_orders_difference():
    g = torch.Generator().manual_seed(1)
    own, other = torch.randn(2, 1, 5, 2, generator=g), torch.randn(2, 1, 5, 2, generator=g)  # one scene each
    v_base, xt = torch.randn(2, 5, 2, generator=g), torch.randn(2, 5, 2, generator=g)
    sigma = torch.tensor([0.75, 1.0])
    # One scene per prompt: each field is that scene, so v* = v_base + (x₀_swap − x₀_own) / 2σ; written as velocities,
    # v_base + ((x_t − x₀_own)/σ − (x_t − x₀_swap)/σ) / 2.
    v_own, v_other = (xt - own[:, 0]) / sigma[:, None, None], (xt - other[:, 0]) / sigma[:, None, None]
    assert torch.allclose(order_target(v_base, xt, sigma, own, other), v_base + (v_own - v_other) / 2, atol=1e-6)
    # A prompt whose swap draws the same scenes has nothing to tell apart: the target is the base's velocity.
    assert torch.equal(order_target(v_base, xt, sigma, own, own), v_base)


WORLD_RELATION_PROMPTS = [p for p, _ in order_prompts(OrderStageConfig(base=PRETRAINED_MODEL_DIR, scenes=1))]
SMALL = OrderStageConfig(base=PRETRAINED_MODEL_DIR, steps=2, order_rows=2, anchor_rows=2, scenes=2, anchor_pool=8,
                         exclude=tuple(WORLD_RELATION_PROMPTS[4:]))
"""Four relation prompts taught: their scenes encode in a fraction of a second, where the world's 528 took 12 s."""


def base_pipe():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(PRETRAINED_MODEL_DIR, torch_dtype=torch.float32)


def stage(cfg: OrderStageConfig, scenes: StageScenes) -> tuple[list[float], dict[str, torch.Tensor]]:
    """cfg's stage on a fresh copy of the pretrained base; its losses and the trained transformer's weights."""
    pipe = base_pipe()
    losses = order_stage(pipe, cfg, scenes, log=lambda _: None)
    return losses, {k: v.clone() for k, v in pipe.transformer.state_dict().items()}


def test_the_first_steps_are_deterministic_and_the_anchor_is_free_while_the_policy_is_the_base():
    torch.set_num_threads(1)
    scenes, scenes_again = stage_scenes(base_pipe(), SMALL), stage_scenes(base_pipe(), SMALL)
    assert scenes.prompts == scenes_again.prompts and scenes.pool_prompts == scenes_again.pool_prompts
    assert all(torch.equal(getattr(scenes, name), getattr(scenes_again, name)) for name in ("own", "other", "pool"))
    losses, weights = stage(SMALL, scenes)
    again, weights_again = stage(SMALL, scenes_again)
    assert losses == again and all(torch.equal(weights[k], weights_again[k]) for k in weights)
    # Step 0 trains the base itself: the anchor rows' target is the policy's own velocity, their loss exactly 0, and
    # the step's loss the order rows' alone (drawn before the anchor rows, so the same rows without them). The scenes
    # do not depend on the row counts.
    unanchored, _ = stage(replace(SMALL, anchor_rows=0), scenes)
    assert losses[0] == unanchored[0] > 0
    assert losses[1] != unanchored[1]  # from step 1 the policy has moved and the anchor costs something


def test_the_shipped_base_is_the_rebuild_commands_stage_of_the_shipped_pretrained_base(monkeypatch):
    """The shipped base's manifest holds exactly the config that REBUILD_COMMAND makes (the pretrained base's manifest
    digest, the held-out relation prompts excluded, the default steps and seed), on the threads it was built with (its
    pinned kernels: test_shapes_base.py checks both shipped manifests' cpu_kernels)."""
    monkeypatch.chdir(REPO_ROOT)  # the command's paths are the repository's
    argv = shlex.split(REBUILD_COMMAND)
    assert argv[:2] == ["python", "tools/order_stage.py"]
    cfg, args = parse_args(argv[2:])
    assert os.path.abspath(args.out) == SHAPES_MODEL_DIR
    with open(os.path.join(SHAPES_MODEL_DIR, MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["config"] == json.loads(json.dumps(asdict(cfg)))  # tuples as the manifest's lists
    # The held-out file's four relation prompts, each with its two objects on its axis in either order and wording.
    assert len(cfg.exclude) == 4 * 4 and all(parse_prompt(p).relation for p in cfg.exclude)
    assert args.threads == 2


def test_bad_input_is_named(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="sigma_min=1.0"):
        OrderStageConfig(base="x", sigma_min=1.0)
    with pytest.raises(ValueError, match="order_rows=0"):
        OrderStageConfig(base="x", order_rows=0)
    with pytest.raises(SystemExit, match=MANIFEST):
        main(["--base", str(tmp_path), "--out", str(tmp_path / "out")])
    gone = tmp_path / "pretrained"  # the shipped pretrained base, missing: named with the command that rebuilds it
    monkeypatch.setattr("rayflow.models.shapes.PRETRAINED_MODEL_DIR", str(gone))
    with pytest.raises(FileNotFoundError, match=r"rebuild it with `python tools/pretrain_shapes.py --out "
                                                r"models/shapes-qwen-image-pretrained`"):
        main(["--base", str(gone), "--out", str(tmp_path / "out")])


def test_exclude_holds_out_a_prompt_however_it_is_written(tmp_path):
    """An --exclude line is held out by what it asks: a capital, a full stop or a double space (which the prompt files,
    the parser and the reward all accept) must not let the held-out prompt into the order rows."""
    held_out = "a red triangle above a blue circle"
    exclude = tmp_path / "eval.txt"
    exclude.write_text("A red triangle above a blue circle.\na blue  triangle to the right of a green square\n")
    cfg, _ = parse_args(["--base", PRETRAINED_MODEL_DIR, "--out", str(tmp_path / "out"), "--exclude", str(exclude)])
    taught = [p for p, _ in order_prompts(replace(cfg, scenes=1))]
    assert len(taught) == 528 - 2 * 4  # each held-out prompt's arrangement in either order and wording
    assert held_out not in taught and "a blue triangle to the right of a green square" not in taught
    assert "a blue circle below a red triangle" not in taught  # the held-out scene, worded the other way round
    assert "a blue circle above a red triangle" not in taught  # its swap, whose order row would contrast with it
    assert "a red triangle to the left of a blue circle" in taught  # the same two objects on the other axis
    # The shipped held-out file's four relation prompts are written as the world writes them: nothing changes for it.
    assert len(order_prompts(replace(SMALL, exclude=(held_out,), scenes=1))) == 528 - 1


def test_an_exclude_prompt_the_world_cannot_read_is_named_with_its_line(tmp_path):
    exclude = tmp_path / "eval.txt"
    exclude.write_text("a red circle\na red hexagon above a blue circle\n")
    with pytest.raises(ValueError, match=rf"{exclude}:2: shapes prompt 'a red hexagon above a blue circle': unknown shape"):
        parse_args(["--base", PRETRAINED_MODEL_DIR, "--out", str(tmp_path / "out"), "--exclude", str(exclude)])
