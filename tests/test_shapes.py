"""The shapes world and the `shapes` reward, on drawn scenes whose answers are known."""

import random

import numpy as np
import pytest
import torch

from rayflow.config import RewardFnConfig
from rayflow.errors import ConfigError
from rayflow.rewards import make_reward
from rayflow.rewards.shapes import detect
from rayflow.rewards.validation import check_prompt_file
from rayflow.rewards.weighted import WeightedReward
from rayflow.worlds.shapes import (
    BACKGROUND, CATEGORIES, COLOURS, ObjectSpec, Placed, Requirements, parse_prompt, prompt_of, render,
    sample_requirements, sample_scene,
)


def score(prompt: str, scene: list[Placed], kind: str = "requirements") -> tuple[float, float]:
    """(reward with kwargs {score: kind}, shapes_accuracy) of one drawn scene."""
    out = make_reward("shapes", score=kind)(torch.from_numpy(render(scene))[None], [prompt])
    return float(out.scores[0]), float(out.metrics["shapes_accuracy"][0])


def test_parse_reads_every_category():
    assert parse_prompt("two blue squares") == Requirements((ObjectSpec("square", "blue", 2, exact=True),))
    assert parse_prompt("a circle") == Requirements((ObjectSpec("circle", None, 1, exact=False),))
    assert parse_prompt("a green triangle above a yellow circle") == Requirements(
        (ObjectSpec("triangle", "green", 1, False), ObjectSpec("circle", "yellow", 1, False)), relation="above")
    assert parse_prompt("A red circle on the left.") == Requirements((ObjectSpec("circle", "red", 1, False),),
                                                                      position="on the left")
    assert parse_prompt("a red circle and a blue square").objects[1] == ObjectSpec("square", "blue", 1, False)
    rng = random.Random(0)
    for category in CATEGORIES:
        req = sample_requirements(rng, category)
        assert parse_prompt(prompt_of(req)) == req


@pytest.mark.parametrize("prompt, word", [
    ("a purple circle", "unknown colour 'purple'"), ("two red hexagons", "unknown shape 'hexagons'"),
    ("two red circle", "mixes a count of 2"), ("many red circles", "unknown number word 'many'"),
    ("a red circle near a blue square", "cannot read object phrase"),
    # objects the world never draws, which the reward could not tell apart or place
    ("a red circle and a red circle", "both circles that no colour tells apart"),
    ("a square and a red square", "both squares that no colour tells apart"),
    ("two red circles on the left", "'two red circles' is on the left as a group"),
    ("a red circle above two blue squares", "'two blue squares' is above as a group"),
])
def test_parse_names_what_it_cannot_read(prompt, word):
    with pytest.raises(ValueError, match=word):
        parse_prompt(prompt)


def test_bad_prompt_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red circle\n# comment\ntwo blue squares\nthree red hexagons\n")
    with pytest.raises(ValueError, match=rf"{path}:4: shapes prompt 'three red hexagons': unknown shape"):
        check_prompt_file(["shapes"], str(path))


def test_scenes_are_deterministic_and_true_to_their_prompts():
    assert sample_scene(7) == sample_scene(7)
    for seed in range(40):
        prompt, scene = sample_scene(seed)
        assert score(prompt, scene) == (1.0, 1.0) and score(prompt, scene, "flow_grpo") == (1.0, 1.0), (prompt, scene)


@pytest.mark.parametrize("size", [24, 32, 48, 96])
def test_true_scenes_score_1_at_other_sizes(size):
    """Drawn at other sizes than 64 px, every scene still scores 1: at 24 and 48 px a circle fills only 2/3 of its
    box, as much as a triangle, and is told from one by not narrowing to the top."""
    for seed in range(30):
        prompt, scene = sample_scene(seed)
        out = make_reward("shapes")(torch.from_numpy(render(scene, size))[None], [prompt])
        assert (float(out.scores[0]), float(out.metrics["shapes_accuracy"][0])) == (1.0, 1.0), (size, prompt, scene)


def test_detect_finds_kind_colour_and_place():
    scene = [Placed("circle", "red", 0, 0), Placed("square", "blue", 1, 2), Placed("triangle", "yellow", 2, 1)]
    found = sorted((d.shape, d.colour, round(d.x * 3 - 0.5), round(d.y * 3 - 0.5)) for d in detect(render(scene)))
    assert found == [("circle", "red", 0, 0), ("square", "blue", 2, 1), ("triangle", "yellow", 1, 2)]


def test_two_touching_shapes_of_one_colour_are_not_one_shape():
    """Two red circles drawn 14 px apart (a drawn circle is 15 px across) run into one 4-connected component. Counted as
    one circle, it made an image of two circles correct for "a red circle", which GenEval's count (as many found as
    asked) fails; it is MERGED now, a kind no prompt asks for."""
    one = render([Placed("circle", "red", 1, 0)])
    image = np.maximum(one, np.roll(one, 14, axis=1))  # the same circle again, 14 px to the right
    assert [(d.shape, d.colour) for d in detect(image)] == [("merged", "red")]
    reward = make_reward("shapes", score="strict")
    for prompt in ("a red circle", "two red circles"):
        assert float(reward(torch.from_numpy(image)[None], [prompt]).scores[0]) == 0.0, prompt
    # 21 px apart, as the grid's neighbouring cells are, they stay two circles.
    apart = np.maximum(one, np.roll(one, 21, axis=1))
    assert float(reward(torch.from_numpy(apart)[None], ["two red circles"]).scores[0]) == 1.0


@pytest.mark.parametrize("size, rows, cols", [
    ((64, 64), slice(30, 33), slice(20, 40)),  # a 3 x 20 px bar (a drawn square is 14 x 14)
    ((64, 64), slice(20, 42), slice(30, 35)),  # 5 x 22 px, upright
    ((64, 256), slice(30, 31), slice(10, 70)),  # a 1-px line of 60 px in a wide image (not MERGED across its width)
])
def test_a_line_or_a_sliver_is_no_circle_square_or_triangle(size, rows, cols):
    """A component much longer one way than the other filled its bounding box, corners included, and was a square."""
    image = np.empty((*size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    image[rows, cols] = COLOURS["red"]
    assert [(d.shape, d.colour) for d in detect(image)] == [("thin", "red")]
    out = make_reward("shapes", score="strict")(torch.from_numpy(image)[None], ["a red square"])
    assert float(out.scores[0]) == 0.0


@pytest.mark.parametrize("prompt, scene, expected", [
    ("a red circle", [Placed("circle", "red", 1, 1)], (1.0, 1.0)),
    # wrong colour: the circle is there, and nothing else (2 of 3 requirements)
    ("a red circle", [Placed("circle", "green", 1, 1)], (2 / 3, 0.0)),
    # wrong count: shape and colour right; the count, and so the number of shapes in all, wrong (2 of 4)
    ("two blue squares", [Placed("square", "blue", 0, 0)], (0.5, 0.0)),
    # something else drawn too: every other requirement met (3 of 4), not correct
    ("a red circle", [Placed("circle", "red", 1, 1), Placed("square", "blue", 0, 0)], (2 / 3, 0.0)),
    # tiling the image with every kind and colour meets "a ..." and the position, but not "nothing else"
    ("a blue triangle on the left", [Placed(k, c, r, 0) for r, (k, c) in enumerate([("triangle", "blue"), ("circle", "red"),
                                                                                     ("square", "green")])], (0.75, 0.0)),
    ("two blue squares", [Placed("square", "blue", 0, 0), Placed("square", "blue", 2, 2)], (1.0, 1.0)),
    # swapped position: both objects right, nothing else (5 of 6), the relation wrong
    ("a green triangle above a yellow circle", [Placed("triangle", "green", 2, 1), Placed("circle", "yellow", 0, 1)],
     (5 / 6, 0.0)),
    ("a green triangle above a yellow circle", [Placed("triangle", "green", 0, 1), Placed("circle", "yellow", 2, 1)],
     (1.0, 1.0)),
    ("a red circle on the left", [Placed("circle", "red", 1, 2)], (0.75, 0.0)),
    # a second red circle on the right: the position must hold for every match (flow_grpo's and GenEval's rule), and
    # there is one shape too many (2 of 4)
    ("a red circle on the left", [Placed("circle", "red", 1, 0), Placed("circle", "red", 1, 2)], (0.5, 0.0)),
    ("a square", [Placed("triangle", "red", 1, 1)], (0.5, 0.0)),  # one shape, as asked, of the wrong kind
])
def test_reward_on_known_answers(prompt, scene, expected):
    assert score(prompt, scene) == pytest.approx(expected)


# flow_grpo's rule (its reward server's evaluate_reward), the terms written out per object:
# count 1 - |n - found|/n; colour 1 - |c - found in colour|/c when the count is right (else one 0 for colour and place);
# place 1 or 0 when count and colour are right. The reward is the mean of the terms.
@pytest.mark.parametrize("prompt, scene, terms", [
    ("a red circle", [Placed("circle", "red", 1, 1)], [1, 1]),
    ("a red circle", [Placed("circle", "green", 1, 1)], [1, 0]),
    ("a circle", [Placed("square", "red", 1, 1)], [0]),
    # a shape of another kind drawn too: not penalised (GenEval's training score has no "nothing else")
    ("a red circle", [Placed("circle", "red", 1, 1), Placed("square", "blue", 0, 0)], [1, 1]),
    # too many of the kind: the count term goes below 0
    ("a red circle", [Placed("circle", "red", r, 0) for r in range(3)], [1 - 2, 0]),
    ("two blue squares", [Placed("square", "blue", 0, 0)], [1 - 1 / 2, 0]),
    ("three red triangles", [Placed("triangle", "red", 0, c) for c in range(3)], [1, 1]),
    ("three red triangles", [Placed("triangle", "red", 0, 0), Placed("triangle", "red", 0, 2), Placed("triangle", "blue", 2, 2)],
     [1, 1 - 1 / 3]),
    ("a red circle on the left", [Placed("circle", "red", 1, 2)], [1, 1, 0]),
    ("a red circle on the left", [Placed("circle", "blue", 1, 0)], [1, 0]),  # wrong colour: no place term
    # two objects of one kind: the kind's count is the two together, each colour its own
    ("a red square and a yellow square", [Placed("square", "red", 0, 0), Placed("square", "yellow", 2, 2)], [1, 1, 1, 1]),
    ("a red square and a yellow square", [Placed("square", "red", 0, 0), Placed("square", "red", 2, 2)],
     [1, 1 - 1, 1, 0]),
    # a relation: its reference object (the second) first, then the first with the relation
    ("a green triangle above a yellow circle", [Placed("triangle", "green", 2, 1), Placed("circle", "yellow", 0, 1)],
     [1, 1, 1, 1, 0]),
    ("a green triangle above a yellow circle", [Placed("triangle", "green", 0, 1), Placed("circle", "yellow", 2, 1)],
     [1, 1, 1, 1, 1]),
    # the reference object in the wrong colour is not matched: the relation scores 0
    ("a green triangle above a yellow circle", [Placed("triangle", "green", 0, 1), Placed("circle", "red", 2, 1)],
     [1, 0, 1, 1, 0]),
    ("a green triangle above a yellow circle", [Placed("circle", "yellow", 2, 1)], [1, 1, 0, 0]),
])
def test_flow_grpo_score_on_known_answers(prompt, scene, terms):
    reward, correct = score(prompt, scene, "flow_grpo")
    assert reward == pytest.approx(sum(terms) / len(terms))
    asked = sum(spec.count for spec in parse_prompt(prompt).objects)
    assert correct == float(all(t == 1 for t in terms) and len(scene) == asked)  # GenEval's "correct", nothing else drawn


def test_accuracy_is_logged_beside_the_reward_not_summed_into_it():
    images = torch.from_numpy(render([Placed("circle", "green", 1, 1)]))[None].repeat(2, 1, 1, 1)
    total, parts = WeightedReward([RewardFnConfig(name="shapes", weight=2.0)])(images, ["a red circle", "a circle"])
    assert total.tolist() == pytest.approx([1.0, 2.0])  # flow_grpo's score by default: (1 + 0) / 2 and 1
    assert parts["shapes"].tolist() == pytest.approx([0.5, 1.0]) and parts["shapes_accuracy"].tolist() == [0.0, 1.0]


def test_reward_refuses_images_that_are_not_uint8():
    """Float images in [0, 1] would score plausibly (colour) or 0 (shapes), without an error."""
    image = torch.from_numpy(render([Placed("circle", "red", 1, 1)]))[None]
    reward = WeightedReward([RewardFnConfig(name="shapes")])
    assert reward(image, ["a red circle"])[0].tolist() == [1.0]
    with pytest.raises(ValueError, match=r"reward images: got torch\.float32 of shape \(1, 64, 64, 3\).*uint8"):
        reward(image.float() / 255, ["a red circle"])


def test_strict_reward_is_the_per_prompt_correct_and_a_bad_kwarg_is_named():
    """kwargs {score: strict}: the score is GenEval's binary 'correct'; the partial credit no longer counts."""
    images = torch.from_numpy(render([Placed("circle", "green", 1, 1)]))[None].repeat(2, 1, 1, 1)
    out = make_reward("shapes", score="strict")(images, ["a red circle", "a circle"])
    assert out.scores.tolist() == [0.0, 1.0] and out.metrics["shapes_accuracy"].tolist() == [0.0, 1.0]
    with pytest.raises(ConfigError, match=r"score: got 'yes'; allowed: one of \['flow_grpo', 'strict', 'requirements'\]"):
        make_reward("shapes", score="yes")
