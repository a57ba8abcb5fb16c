"""The shapes world: 64x64 images of one to three flat shapes on a dark background, and prompts about
them in GenEval's categories, deterministic from a seed.

    single object   "a circle"
    colour          "a red circle"
    counting        "two blue squares"                        (a number word: that count exactly)
    two objects     "a red circle and a blue square"
    position        "a red circle on the left"                (left / right column, top / bottom row)
    relation        "a green triangle above a yellow circle"  (above, below, left of, right of)

Shapes sit in the cells of a 3x3 grid. `parse_prompt` turns a prompt into its Requirements (what the
`shapes` reward checks); a prompt outside this grammar is a ValueError naming the word it cannot read.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

IMAGE_SIZE = 64
GRID = 3
"""Shapes sit in the cells of a GRID x GRID grid."""
SHAPE_RADIUS = 7.5
"""Half the side of a shape's bounding box, in pixels at IMAGE_SIZE."""
SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 230),
    "yellow": (235, 215, 50),
}
"""RGB of the colours a prompt may name: far apart from each other and from the background."""
BACKGROUND = (20, 20, 20)
NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
POSITIONS = ("on the left", "on the right", "at the top", "at the bottom")
RELATIONS = ("above", "below", "to the left of", "to the right of")
CATEGORIES = ("single", "colour", "counting", "two_objects", "position", "relation")


@dataclass(frozen=True)
class Placed:
    """One drawn shape: its kind, colour name and grid cell (row 0 at the top, column 0 on the left)."""

    shape: str
    colour: str
    row: int
    col: int


@dataclass(frozen=True)
class ObjectSpec:
    """An object phrase: "two blue squares" is ObjectSpec("square", "blue", 2, exact=True)."""

    shape: str
    colour: str | None
    count: int
    exact: bool
    """True when the prompt gives a number word: the count must match, not only be reached."""


@dataclass(frozen=True)
class Requirements:
    """What a prompt asks for: one or two objects, and optionally where the first one is."""

    objects: tuple[ObjectSpec, ...]
    position: str | None = None
    """One of POSITIONS, for the first object."""
    relation: str | None = None
    """One of RELATIONS, of the first object to the second."""


def render(scene: list[Placed], size: int = IMAGE_SIZE) -> np.ndarray:
    """The scene drawn at size x size -> [size, size, 3] uint8."""
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    cell = size / GRID
    radius = SHAPE_RADIUS * size / IMAGE_SIZE
    ys, xs = np.mgrid[0:size, 0:size] + 0.5  # pixel centres
    for p in scene:
        dx, dy = xs - (p.col + 0.5) * cell, ys - (p.row + 0.5) * cell  # [size, size]
        if p.shape == "circle":
            mask = dx**2 + dy**2 <= radius**2
        elif p.shape == "square":
            mask = (np.abs(dx) <= radius * 0.9) & (np.abs(dy) <= radius * 0.9)
        else:  # an upward triangle: apex at the top centre, base along the bottom
            mask = (np.abs(dy) <= radius) & (np.abs(dx) <= (dy + radius) / 2)
        image[mask] = COLOURS[p.colour]
    return image


def object_phrase(spec: ObjectSpec) -> str:
    number = "a" if spec.count == 1 and not spec.exact else {1: "one", 2: "two", 3: "three"}[spec.count]
    words = [number] + ([spec.colour] if spec.colour else []) + [spec.shape + ("s" if spec.count > 1 else "")]
    return " ".join(words)


def prompt_of(req: Requirements) -> str:
    """The prompt whose parse is `req`."""
    first = object_phrase(req.objects[0])
    if req.relation is not None:
        return f"{first} {req.relation} {object_phrase(req.objects[1])}"
    if req.position is not None:
        return f"{first} {req.position}"
    if len(req.objects) == 2:
        return f"{first} and {object_phrase(req.objects[1])}"
    return first


_OBJECT = re.compile(
    r"(?P<number>\w+) (?:(?P<colour>\w+) )?(?P<shape>\w+?)(?P<plural>s?)$"
)


def _parse_object(phrase: str, prompt: str) -> ObjectSpec:
    match = _OBJECT.match(phrase.strip())
    words = phrase.split()
    if match is None or len(words) not in (2, 3):
        raise ValueError(f"shapes prompt {prompt!r}: cannot read object phrase {phrase!r}; expected "
                         f"'<number> [colour] <shape>', e.g. 'two blue squares'")
    number, colour, shape = match["number"], match["colour"], match["shape"]
    if number not in NUMBERS:
        raise ValueError(f"shapes prompt {prompt!r}: unknown number word {number!r}; allowed: {sorted(NUMBERS)}")
    if colour is not None and colour not in COLOURS:
        raise ValueError(f"shapes prompt {prompt!r}: unknown colour {colour!r}; allowed: {sorted(COLOURS)}")
    if shape not in SHAPES:
        raise ValueError(f"shapes prompt {prompt!r}: unknown shape {words[-1]!r}; allowed: {list(SHAPES)} (plural with s)")
    count = NUMBERS[number]
    if (count > 1) != bool(match["plural"]):
        raise ValueError(f"shapes prompt {prompt!r}: {phrase!r} mixes a count of {count} with "
                         f"{'a plural' if match['plural'] else 'a singular'} shape")
    return ObjectSpec(shape, colour, count, exact=number not in ("a", "an"))


def parse_prompt(prompt: str) -> Requirements:
    """The requirements of a shapes prompt (see the module doc for the grammar); ValueError otherwise."""
    return _checked(_parse(" ".join(prompt.lower().strip().rstrip(".").split()), prompt), prompt)


def _parse(text: str, prompt: str) -> Requirements:
    for relation in RELATIONS:
        first, sep, second = text.partition(f" {relation} ")
        if sep:
            return Requirements((_parse_object(first, prompt), _parse_object(second, prompt)), relation=relation)
    for position in POSITIONS:
        if text.endswith(" " + position):
            return Requirements((_parse_object(text[: -len(position)], prompt),), position=position)
    first, sep, second = text.partition(" and ")
    if sep:
        return Requirements((_parse_object(first, prompt), _parse_object(second, prompt)))
    return Requirements((_parse_object(text, prompt),))


def _checked(req: Requirements, prompt: str) -> Requirements:
    """`req`, if the world can draw it and the reward tell its objects apart: a position or relation is of one shape
    (which of two circles would be "on the left"?), and two objects of one shape differ in their named colours."""
    counted = [o for o in req.objects if o.count > 1]
    if (req.position or req.relation) and counted:
        raise ValueError(f"shapes prompt {prompt!r}: {object_phrase(counted[0])!r} is {req.position or req.relation} "
                         f"as a group; allowed: a position or relation of one object ('a' or 'one')")
    if len(req.objects) == 2:
        first, second = req.objects
        if first.shape == second.shape and (None in (first.colour, second.colour) or first.colour == second.colour):
            raise ValueError(f"shapes prompt {prompt!r}: its two objects are both {first.shape}s that no colour tells "
                             f"apart; allowed: two shapes, or one shape in two named colours ('a red circle and a blue "
                             f"circle')")
    return req


def category_of(req: Requirements) -> str:
    """The one of CATEGORIES a prompt belongs to, as sample_requirements draws them ("one red square" is counting)."""
    if req.relation is not None:
        return "relation"
    if req.position is not None:
        return "position"
    if len(req.objects) == 2:
        return "two_objects"
    (spec,) = req.objects
    if spec.exact:
        return "counting"
    return "colour" if spec.colour is not None else "single"


def sample_requirements(rng: random.Random, category: str) -> Requirements:
    """A random prompt of one of CATEGORIES, as its requirements."""
    def spec(count: int = 1, exact: bool = False, colour: bool = True) -> ObjectSpec:
        return ObjectSpec(rng.choice(SHAPES), rng.choice(list(COLOURS)) if colour else None, count, exact)

    if category == "single":
        return Requirements((spec(colour=False),))
    if category == "colour":
        return Requirements((spec(),))
    if category == "counting":
        return Requirements((spec(count=rng.choice((1, 2, 3)), exact=True),))
    first, second = spec(), spec()
    while (second.shape, second.colour) == (first.shape, first.colour):
        second = spec()
    if category == "two_objects":
        return Requirements((first, second))
    if category == "position":
        return Requirements((first,), position=rng.choice(POSITIONS))
    if category == "relation":
        return Requirements((first, second), relation=rng.choice(RELATIONS))
    raise ValueError(f"category: got {category!r}; allowed: one of {CATEGORIES}")


def _cells_for(req: Requirements, rng: random.Random) -> list[tuple[int, int]]:
    """Grid cells for the shapes of a scene that satisfies `req`, first object's first."""
    cells = [(r, c) for r in range(GRID) for c in range(GRID)]
    n = sum(o.count for o in req.objects)
    while True:
        chosen = rng.sample(cells, n)
        (r0, c0), (r1, c1) = chosen[0], chosen[-1]
        ok = {
            None: True,
            "on the left": c0 == 0, "on the right": c0 == GRID - 1, "at the top": r0 == 0, "at the bottom": r0 == GRID - 1,
            "above": r0 < r1, "below": r0 > r1, "to the left of": c0 < c1, "to the right of": c0 > c1,
        }[req.relation or req.position]
        if ok:
            return chosen


def sample_scene(seed: int, categories: tuple[str, ...] = CATEGORIES) -> tuple[str, list[Placed]]:
    """A prompt and a scene it describes truly, a pure function of `seed` (pretraining data); its category drawn
    uniformly from `categories` (list one more than once to draw it more often)."""
    rng = random.Random(seed)
    req = sample_requirements(rng, rng.choice(categories))
    return prompt_of(req), scene_for(req, rng)


def scene_for(req: Requirements, rng: random.Random) -> list[Placed]:
    """A scene that `req` describes truly: its cells, and any colour the prompt leaves open, drawn from `rng`."""
    cells = iter(_cells_for(req, rng))
    scene = []
    for obj in req.objects:
        colour = obj.colour or rng.choice(list(COLOURS))
        scene += [Placed(obj.shape, colour, *next(cells)) for _ in range(obj.count)]
    return scene
