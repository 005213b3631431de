"""Scene types and the co-occurrence statistics of the world.

Every image belongs to one :class:`SceneSpec` (kitchen, street, office, ...). A scene has a
*typical* object set with weights; each object slot of an image is filled from that set with
probability ``in_scene_prob`` (0.8 by default) and from all categories uniformly otherwise.
On top of that, :data:`COMPANIONS` adds strongly paired objects (keyboard -> mouse, fork -> knife,
dining table -> chair...); overall about 83-85% of the objects are typical of their scene.
The result is a language prior that is *useful but wrong at times*: a model that has learned
"kitchens have forks" will be tempted to say "fork" in a kitchen that has none, which is
exactly what POPE's popular / adversarial splits and CHAIR measure.

The scene is visible from the background (wall / floor colours and textures, drawn by
:mod:`mmfast.world.backgrounds`), so a model can infer the scene type and use the prior.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .categories import CATEGORIES, CATEGORY_BY_NAME


@dataclass(frozen=True)
class SceneSpec:
    """One scene type.

    Attributes:
        name: Scene name used in the text ("living room").
        article: Indefinite article for the name ("a" / "an").
        places: Prepositional phrases for captions ("in a kitchen").
        typical: ``(category name, weight)`` pairs of the typical object set.
        background: One sentence describing the background, used in detailed descriptions.
        horizon: Range of the wall / floor split (fraction of the image height from the top).
    """

    name: str
    article: str
    places: tuple[str, ...]
    typical: tuple[tuple[str, float], ...]
    background: str
    horizon: tuple[float, float]

    @property
    def typical_names(self) -> tuple[str, ...]:
        """Names of the typical objects, most typical first."""
        return tuple(n for n, _ in sorted(self.typical, key=lambda t: (-t[1], t[0])))

    @property
    def with_article(self) -> str:
        """``"a kitchen"``, ``"an office"``."""
        return f"{self.article} {self.name}"


SCENES: tuple[SceneSpec, ...] = (
    SceneSpec(
        "kitchen",
        "a",
        ("in a kitchen", "in a small kitchen", "in a home kitchen"),
        (
            ("cup", 3.0),
            ("bowl", 3.0),
            ("bottle", 2.5),
            ("knife", 2.0),
            ("fork", 1.6),
            ("spoon", 2.0),
            ("microwave", 2.0),
            ("sink", 2.0),
            ("refrigerator", 1.6),
            ("banana", 1.5),
            ("apple", 1.5),
            ("orange", 1.2),
            ("wine glass", 1.0),
            ("donut", 1.0),
            ("person", 1.2),
            ("vase", 0.6),
            ("clock", 0.8),
            ("potted plant", 0.6),
        ),
        "The walls are covered with light tiles above a wooden counter.",
        (0.42, 0.55),
    ),
    SceneSpec(
        "street",
        "a",
        ("on a city street", "on a busy street", "on the road"),
        (
            ("car", 4.0),
            ("person", 4.0),
            ("traffic light", 3.0),
            ("bus", 1.8),
            ("truck", 1.8),
            ("bicycle", 2.0),
            ("motorcycle", 1.5),
            ("fire hydrant", 1.5),
            ("stop sign", 1.3),
            ("umbrella", 1.2),
            ("backpack", 1.0),
            ("bench", 0.8),
            ("bird", 0.8),
            ("dog", 0.8),
        ),
        "There are buildings under a blue sky and a gray road below.",
        (0.4, 0.55),
    ),
    SceneSpec(
        "office",
        "an",
        ("in an office", "in a small office", "in a quiet office"),
        (
            ("laptop", 3.0),
            ("keyboard", 3.0),
            ("mouse", 3.0),
            ("tv", 2.5),
            ("cell phone", 2.2),
            ("book", 2.5),
            ("cup", 2.0),
            ("chair", 2.5),
            ("person", 2.0),
            ("bottle", 1.0),
            ("clock", 1.2),
            ("potted plant", 1.2),
            ("backpack", 0.8),
            ("remote", 0.4),
        ),
        "The room has plain gray walls and a blue carpet.",
        (0.45, 0.6),
    ),
    SceneSpec(
        "living room",
        "a",
        ("in a living room", "in a cozy living room", "in a family room"),
        (
            ("couch", 3.0),
            ("tv", 3.0),
            ("remote", 2.2),
            ("chair", 2.0),
            ("potted plant", 2.0),
            ("book", 2.0),
            ("clock", 1.5),
            ("vase", 1.5),
            ("cat", 2.0),
            ("dog", 1.5),
            ("person", 2.0),
            ("cup", 1.0),
            ("laptop", 0.8),
            ("teddy bear", 0.8),
        ),
        "The walls have striped wallpaper and the floor is made of wood.",
        (0.45, 0.6),
    ),
    SceneSpec(
        "park",
        "a",
        ("in a park", "on the grass in a park", "in a grassy park"),
        (
            ("person", 3.5),
            ("dog", 3.0),
            ("bench", 3.0),
            ("bird", 2.5),
            ("kite", 2.5),
            ("frisbee", 2.0),
            ("sports ball", 2.0),
            ("bicycle", 1.5),
            ("umbrella", 1.0),
            ("skateboard", 1.5),
            ("backpack", 1.0),
            ("horse", 1.0),
        ),
        "There are green trees and grass under a blue sky.",
        (0.35, 0.5),
    ),
    SceneSpec(
        "bedroom",
        "a",
        ("in a bedroom", "in a small bedroom", "in a tidy bedroom"),
        (
            ("bed", 4.0),
            ("teddy bear", 2.0),
            ("book", 2.0),
            ("clock", 2.0),
            ("cell phone", 1.5),
            ("laptop", 1.5),
            ("tv", 1.5),
            ("cat", 1.5),
            ("chair", 1.0),
            ("potted plant", 1.0),
            ("vase", 0.8),
            ("person", 1.5),
            ("remote", 0.8),
            ("backpack", 0.8),
        ),
        "The room has pastel walls and a soft beige carpet.",
        (0.4, 0.55),
    ),
    SceneSpec(
        "dining room",
        "a",
        ("in a dining room", "at a restaurant", "in a dining area"),
        (
            ("dining table", 4.0),
            ("chair", 3.0),
            ("wine glass", 2.5),
            ("pizza", 2.0),
            ("bowl", 2.0),
            ("cup", 1.5),
            ("fork", 2.2),
            ("knife", 2.0),
            ("spoon", 1.5),
            ("bottle", 2.0),
            ("person", 2.0),
            ("vase", 1.0),
            ("donut", 0.8),
            ("clock", 0.6),
        ),
        "The room has warm colored walls and a dark wooden floor.",
        (0.4, 0.55),
    ),
)

SCENE_BY_NAME: dict[str, SceneSpec] = {s.name: s for s in SCENES}

#: ``name -> (companion, probability)``: when ``name`` is sampled, the companion is added with
#: that probability (if there is a free slot). These pairs drive POPE-adversarial negatives.
COMPANIONS: dict[str, tuple[str, float]] = {
    "keyboard": ("mouse", 0.6),
    "laptop": ("mouse", 0.3),
    "fork": ("knife", 0.6),
    "knife": ("fork", 0.4),
    "dining table": ("chair", 0.6),
    "tv": ("remote", 0.35),
    "couch": ("potted plant", 0.3),
    "bed": ("teddy bear", 0.3),
    "dog": ("frisbee", 0.3),
    "kite": ("person", 0.5),
    "bus": ("car", 0.5),
    "traffic light": ("car", 0.5),
    "sink": ("bottle", 0.3),
    "pizza": ("wine glass", 0.4),
    "bicycle": ("person", 0.4),
    "wine glass": ("bottle", 0.4),
    "skateboard": ("person", 0.5),
}

#: Default number-of-objects distribution: ``{n: weight}``; many images have four or more objects.
COUNT_WEIGHTS: dict[int, float] = {1: 4.0, 2: 6.0, 3: 10.0, 4: 16.0, 5: 20.0, 6: 18.0, 7: 16.0, 8: 14.0}


def sample_scene(rng: random.Random) -> SceneSpec:
    """Pick a scene type uniformly."""
    return SCENES[rng.randrange(len(SCENES))]


def sample_count(rng: random.Random, min_objects: int = 2, max_objects: int = 8) -> int:
    """Draw the number of objects of an image from :data:`COUNT_WEIGHTS` (extended flat beyond 8)."""
    ns = list(range(min_objects, max_objects + 1))
    ws = [COUNT_WEIGHTS.get(n, 10.0) for n in ns]
    return rng.choices(ns, weights=ws, k=1)[0]


def sample_objects(
    scene: SceneSpec, n: int, rng: random.Random, in_scene_prob: float = 0.8, min_distinct: int = 3
) -> list[str]:
    """Sample ``n`` category names for an image of ``scene`` (repeats allowed).

    A category that is already present is re-drawn with its weight times ``Category.repeat``, so
    people, chairs and books repeat often and refrigerators almost never. The last slots are
    forced to new categories when needed to reach ``min(min_distinct, n)`` distinct ones.

    Args:
        scene: The scene type.
        n: Number of objects.
        rng: Random source.
        in_scene_prob: Probability that a slot is filled from the scene's typical set.
        min_distinct: Minimum number of distinct categories.

    Returns:
        Category names in sampling order.
    """
    names: list[str] = []
    typ_names = [t[0] for t in scene.typical]
    typ_w = [t[1] for t in scene.typical]
    all_names = [c.name for c in CATEGORIES]
    while len(names) < n:
        force_new = min(min_distinct, n) - len(set(names)) >= n - len(names)

        def weight(nm: str) -> float:
            if nm not in names:
                return 1.0
            return 0.0 if force_new else CATEGORY_BY_NAME[nm].repeat

        if rng.random() < in_scene_prob and any(nm not in names for nm in typ_names):
            name = rng.choices(typ_names, weights=[w * weight(nm) for nm, w in zip(typ_names, typ_w)], k=1)[0]
        else:
            name = rng.choices(all_names, weights=[weight(nm) for nm in all_names], k=1)[0]
        names.append(name)
        comp = COMPANIONS.get(name)
        if comp and len(names) < n and comp[0] not in names and rng.random() < comp[1]:
            names.append(comp[0])
    return names


def scene_definitions() -> dict[str, object]:
    """JSON-able description of the scene model (recorded in ``world.json``)."""
    return {
        "scenes": [
            {"name": s.name, "typical": [{"name": n, "weight": w} for n, w in s.typical], "background": s.background}
            for s in SCENES
        ],
        "companions": {k: {"name": v[0], "prob": v[1]} for k, v in COMPANIONS.items()},
        "count_weights": {str(k): v for k, v in COUNT_WEIGHTS.items()},
    }
