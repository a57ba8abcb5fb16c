"""The `shapes` reward: GenEval's check of a shapes-world prompt (rayflow.worlds.shapes) on a decoded image.

Shapes are found by colour segmentation (each pixel to the nearest palette colour or the background,
within a distance) and 4-connected components (one larger than a shape is shapes run together: MERGED; one less than
half as long one way as the other is a line or a sliver: THIN); a component's kind comes from how it fills its
bounding box (a triangle about half, narrowing to the top; a circle and a square most of it) and whether it fills the
box's corners (a square does, a circle does not). The requirements of a prompt (`score: requirements` is the
fraction met; the default score is flow_grpo's, `flow_grpo_score`):

    per object   its shape is there; in its colour (when named); as many as the number word says
    position     the objects of the first kind sit in that third of the image (left, right, top, bottom)
    relation     the objects of the first kind are above / below / left of / right of those of the second
    nothing else as many shapes in all as the prompt asks for ("a" is one): a scene of the world holds
                 the prompt's objects only, and without this a policy learns to tile the image with
                 shapes of every kind and colour, which meets every "a ..." and every position at once

`shapes_accuracy` (1 when every requirement is met, GenEval's per-prompt "correct") is reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rayflow.errors import ConfigError
from rayflow.rewards.registry import RewardOutput, register_reward
from rayflow.worlds.shapes import BACKGROUND, COLOURS, IMAGE_SIZE, SHAPE_RADIUS, ObjectSpec, Requirements, parse_prompt

_PALETTE = np.array([BACKGROUND, *COLOURS.values()], dtype=np.float32)  # [1 + K, 3]
_NAMES = [None, *COLOURS]
MAX_COLOUR_DISTANCE = 90.0
"""A pixel farther than this (RGB, 0..255) from every palette colour and the background belongs to nothing."""
MIN_AREA_FRACTION = 0.25
"""A component smaller than this fraction of a drawn square's area is noise, not a shape."""


@dataclass(frozen=True)
class Detection:
    """A shape found in an image: kind, colour name, centroid (x, y) as fractions of the width and height."""

    shape: str
    colour: str
    x: float
    y: float


def label_components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean mask [H, W], each as a boolean mask [H, W]."""
    h, w = mask.shape
    off = h * w  # larger than every pixel's own label
    labels = np.where(mask, np.arange(h * w).reshape(h, w), off)
    while True:  # each pass gives every pixel the smallest label among itself and its 4 neighbours
        padded = np.pad(labels, 1, constant_values=off)
        smallest = np.minimum.reduce([labels, padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2], padded[1:-1, 2:]])
        smallest = np.where(mask, smallest, off)
        if (smallest == labels).all():
            return [labels == label for label in np.unique(labels[mask])]
        labels = smallest


TRIANGLE_FILL = 0.68
"""A component filling less of its bounding box than this may be a triangle (half its box); a circle fills π/4."""
TRIANGLE_TAPER = 0.75
"""... if its box's top half is filled less than this times its bottom half (an upward triangle: 0.29-0.50 drawn at
16-136 px; a circle 1.0 where its fill drops below TRIANGLE_FILL, at 24 and 48 px)."""


def classify(component: np.ndarray) -> str:
    """The kind of one component [H, W] bool: by its fill of the bounding box, its taper and the box's corners."""
    ys, xs = np.nonzero(component)
    box = component[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    half = box.shape[0] // 2
    tapered = box[:half].mean() < TRIANGLE_TAPER * box[box.shape[0] - half :].mean() if half else True
    if box.mean() < TRIANGLE_FILL and tapered:
        return "triangle"
    k = max(1, min(box.shape) // 4)
    corners = np.concatenate([box[:k, :k].ravel(), box[:k, -k:].ravel(), box[-k:, :k].ravel(), box[-k:, -k:].ravel()])
    return "square" if corners.mean() > 0.5 else "circle"


MERGED_SIDE = 1.5
"""A component whose bounding box is longer than this times a drawn shape's side (2·SHAPE_RADIUS at IMAGE_SIZE) is
several shapes of one colour run together, not one shape: two touching red circles make one component. Its kind is
MERGED, which no prompt asks for (the components of the shipped base's 640 evaluation images are at most 16 px across,
a drawn shape 15, two touching ones 30)."""
MERGED = "merged"
THIN_RATIO = 0.5
"""A component whose bounding box is less than this times as long one way as the other (in drawn shapes' sides, as
MERGED_SIDE) is a line or a sliver, not a circle, square or triangle (each drawn in a box about as tall as wide): its
kind is THIN, which no prompt asks for. A 1-px line, or a 3 x 20 px bar, filled its box, corners included, and was a
square (the components of the shipped base's evaluation images are at least 0.53 times as long one way as the
other)."""
THIN = "thin"


def detect(image: np.ndarray) -> list[Detection]:
    """The shapes in one image [H, W, 3] uint8, in no particular order."""
    h, w, _ = image.shape
    distance = np.linalg.norm(image[:, :, None, :].astype(np.float32) - _PALETTE, axis=-1)  # [H, W, 1 + K]
    nearest = np.where(distance.min(axis=-1) <= MAX_COLOUR_DISTANCE, distance.argmin(axis=-1), 0)  # [H, W]
    min_area = MIN_AREA_FRACTION * (2 * SHAPE_RADIUS * h / IMAGE_SIZE) ** 2
    side_h, side_w = 2 * SHAPE_RADIUS * h / IMAGE_SIZE, 2 * SHAPE_RADIUS * w / IMAGE_SIZE
    found = []
    for index in range(1, len(_NAMES)):
        for component in label_components(nearest == index):
            if component.sum() >= min_area:
                ys, xs = np.nonzero(component)
                across = ((np.ptp(ys) + 1) / side_h, (np.ptp(xs) + 1) / side_w)  # in drawn shapes' sides
                kind = (MERGED if max(across) > MERGED_SIDE else THIN if min(across) < THIN_RATIO * max(across)
                        else classify(component))
                found.append(Detection(kind, _NAMES[index], (xs.mean() + 0.5) / w, (ys.mean() + 0.5) / h))
    return found


def _matches(spec: ObjectSpec, found: list[Detection]) -> list[Detection]:
    return [d for d in found if d.shape == spec.shape and spec.colour in (None, d.colour)]


_SIDE = {"on the left": lambda d: d.x < 1 / 3, "on the right": lambda d: d.x > 2 / 3,
         "at the top": lambda d: d.y < 1 / 3, "at the bottom": lambda d: d.y > 2 / 3}
_MARGIN = 0.1
"""Centroids closer than this (fraction of the image) along the relation's axis are not above / left of each other."""
_RELATION = {"above": lambda a, b: b.y - a.y > _MARGIN, "below": lambda a, b: a.y - b.y > _MARGIN,
             "to the left of": lambda a, b: b.x - a.x > _MARGIN, "to the right of": lambda a, b: a.x - b.x > _MARGIN}


def requirements_met(req: Requirements, found: list[Detection]) -> list[bool]:
    """One bool per requirement of `req` (see the module doc) for the detected shapes."""
    met = []
    for spec in req.objects:
        met.append(any(d.shape == spec.shape for d in found))
        matches = _matches(spec, found)
        if spec.colour is not None:
            met.append(bool(matches))
        if spec.exact:
            met.append(len(matches) == spec.count)
    # Every match must hold it, as in flow_grpo's score (and GenEval's): one extra shape on the wrong side fails it.
    first = _matches(req.objects[0], found)
    if req.position is not None:
        met.append(bool(first) and all(_SIDE[req.position](d) for d in first))
    if req.relation is not None:
        second = _matches(req.objects[1], found)
        met.append(bool(first and second) and all(_RELATION[req.relation](a, b) for a in first for b in second))
    met.append(len(found) == sum(spec.count for spec in req.objects))
    return met


def flow_grpo_score(req: Requirements, found: list[Detection]) -> float:
    """flow_grpo's GenEval training score (its reward server's `evaluate_reward`) on the detected shapes: the mean of
    per-object terms, taken in GenEval's order (a relation's reference object first). Per object of n wanted of its
    shape (summed over the prompt's objects of that shape) and c of its own colour:

        count       1 - |n - found of that shape| / n                       (can go below 0: too many)
        colour      1 - |c - found of that shape and colour| / c             (when named, and the count is right)
        place       1 when its position / relation holds, else 0           (when asked, and count and colour are right)

    and a 0 in place of the colour and place terms when the count is wrong. A relation whose reference object was not
    matched scores 0."""
    terms: list[float] = []
    matched: dict[int, list[Detection]] = {}
    order = [1, 0] if req.relation is not None else list(range(len(req.objects)))
    for index in order:
        spec = req.objects[index]
        placed = index == 0 and (req.position is not None or req.relation is not None)
        wanted = sum(o.count for o in req.objects if o.shape == spec.shape)
        of_shape = [d for d in found if d.shape == spec.shape]
        terms.append(1 - abs(wanted - len(of_shape)) / wanted)
        if len(of_shape) != wanted:
            if spec.colour is not None or placed:
                terms.append(0.0)
            continue
        ours = _matches(spec, of_shape)
        if spec.colour is not None:
            terms.append(1 - abs(spec.count - len(ours)) / spec.count)
            if len(ours) != spec.count:
                continue
        if placed:
            if req.position is not None:
                held = all(_SIDE[req.position](d) for d in ours)
            else:
                held = 1 in matched and all(_RELATION[req.relation](a, b) for a in ours for b in matched[1])
            terms.append(float(held))
            if not held:
                continue
        matched[index] = ours
    return sum(terms) / len(terms)


SCORES = ("flow_grpo", "strict", "requirements")
"""What the `shapes` reward returns (kwargs `score`): flow_grpo's GenEval training score (flow_grpo_score), GenEval's
per-prompt "correct" (every requirement met: 1 or 0), or the fraction of requirements met."""


@register_reward("shapes")
class ShapesReward:
    """The score named by `score` (SCORES); metric shapes_accuracy: the strict one, whichever is trained on."""

    def __init__(self, score: str = "flow_grpo"):
        self.check_kwargs({"score": score})
        self.score = score

    @staticmethod
    def check_kwargs(kwargs: dict, key: str = "reward.functions[shapes].kwargs") -> None:
        if kwargs.get("score", "flow_grpo") not in SCORES:
            raise ConfigError(f"{key}.score", kwargs.get("score"), f"one of {list(SCORES)}")

    @staticmethod
    def check_prompt(prompt: str) -> None:
        parse_prompt(prompt)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        requirements = [parse_prompt(p) for p in prompts]
        found = [detect(image.numpy()) for image in images]
        met = [requirements_met(req, f) for req, f in zip(requirements, found)]
        correct = torch.tensor([float(all(m)) for m in met], dtype=torch.float32)  # [B]
        if self.score == "strict":
            scores = correct
        elif self.score == "requirements":
            scores = torch.tensor([sum(m) / len(m) for m in met], dtype=torch.float32)
        else:
            scores = torch.tensor([flow_grpo_score(req, f) for req, f in zip(requirements, found)], dtype=torch.float32)
        return RewardOutput(scores, {"shapes_accuracy": correct})
