"""The object categories of the generated world: COCO names and ids, synonyms, appearance.

Each :class:`Category` uses the **exact COCO name and COCO category id** (``person=1``,
``bicycle=2``, ..., ``tv=72``, ``laptop=73``...) so that COCO tools, POPE and CHAIR work unchanged.
It also carries:

* ``nouns``: ``(singular, plural)`` forms used in captions. Every form is a word or phrase that
  the CHAIR synonym list maps back to the category (e.g. "puppy" -> dog, "sofa" -> couch,
  "television" -> tv), so CHAIR scores captions of this world the way it scores COCO captions.
* the procedural appearance: a drawing routine, the allowed colour names, the aspect ratio
  (width / height) and size (long side as a fraction of the image side) ranges, the maximum
  rotation, where it is placed (``ground`` / ``high`` / ``air`` / ``any``) and a drawing layer
  (``0`` = big furniture and vehicles drawn first, so that smaller things stand in front).

Label-map values are ``1 + index`` into :data:`CATEGORIES`; ``0`` is the background.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from . import draw_indoor as di
from . import draw_kitchen as dk
from . import draw_living as dl
from . import draw_outdoor as do
from .draw_base import RGB, Pen

Drawer = Callable[[Pen, random.Random, RGB, str], None]


@dataclass(frozen=True)
class Category:
    """One object category of the world (see the module docstring for the fields)."""

    id: int
    name: str
    supercategory: str
    drawer: Drawer
    colors: tuple[str, ...]
    aspect: tuple[float, float]
    size: tuple[float, float]
    nouns: tuple[tuple[str, str], ...]
    plural: str
    placement: str = "any"
    rotation: float = 6.0
    layer: int = 1
    flip: bool = True
    has_color: bool = True
    variants: tuple[tuple[str, float], ...] = ()
    repeat: float = 0.4

    @property
    def label(self) -> int:
        """Value of this category in label maps (``1 + index`` in :data:`CATEGORIES`)."""
        return CATEGORY_INDEX[self.name] + 1


def _c(
    cid: int,
    name: str,
    sup: str,
    drawer: Drawer,
    colors: str,
    aspect: tuple[float, float],
    size: tuple[float, float],
    nouns: str,
    **kw: object,
) -> Category:
    """Compact constructor: ``colors`` is space separated, ``nouns`` is ``"sg/pl, sg/pl"``."""
    pairs = tuple(tuple(n.strip().split("/")) for n in nouns.split(","))
    plural = str(kw.pop("plural", pairs[0][1]))
    return Category(
        cid,
        name,
        sup,
        drawer,
        tuple(colors.split()),
        aspect,
        size,
        pairs,  # type: ignore[arg-type]
        plural,
        **kw,
    )  # type: ignore[arg-type]


_BIG = {"layer": 0, "repeat": 0.05, "rotation": 2.0, "placement": "ground"}

#: All categories, in COCO id order.
CATEGORIES: tuple[Category, ...] = (
    _c(
        1,
        "person",
        "person",
        dl.draw_person,
        "red blue green yellow white black gray pink purple",
        (0.36, 0.46),
        (0.3, 0.6),
        "person/people",
        placement="ground",
        rotation=3,
        repeat=1.0,
        variants=(("man", 0.4), ("woman", 0.4), ("child", 0.2)),
    ),
    _c(
        2,
        "bicycle",
        "vehicle",
        do.draw_bicycle,
        "red blue black white green yellow",
        (1.5, 1.75),
        (0.25, 0.42),
        "bicycle/bicycles, bike/bikes",
        placement="ground",
        rotation=3,
    ),
    _c(
        3,
        "car",
        "vehicle",
        do.draw_car,
        "red blue white black gray yellow green",
        (1.8, 2.3),
        (0.3, 0.5),
        "car/cars, automobile/automobiles, sedan/sedans",
        placement="ground",
        rotation=2,
        repeat=0.8,
    ),
    _c(
        4,
        "motorcycle",
        "vehicle",
        do.draw_motorcycle,
        "red black blue gray",
        (1.4, 1.65),
        (0.25, 0.4),
        "motorcycle/motorcycles, motorbike/motorbikes",
        placement="ground",
        rotation=3,
    ),
    _c(
        6,
        "bus",
        "vehicle",
        do.draw_bus,
        "yellow red blue white green",
        (2.2, 2.8),
        (0.5, 0.78),
        "bus/buses, city bus/city buses",
        **{**_BIG, "repeat": 0.15},
    ),
    _c(
        8,
        "truck",
        "vehicle",
        do.draw_truck,
        "white red blue gray green",
        (1.8, 2.3),
        (0.42, 0.65),
        "truck/trucks, delivery truck/delivery trucks",
        **{**_BIG, "repeat": 0.2},
    ),
    _c(
        10,
        "traffic light",
        "outdoor",
        do.draw_traffic_light,
        "black yellow gray",
        (0.34, 0.44),
        (0.18, 0.34),
        "traffic light/traffic lights, traffic signal/traffic signals, stoplight/stoplights",
        placement="high",
        rotation=2,
        flip=False,
        has_color=False,
        repeat=0.5,
    ),
    _c(
        11,
        "fire hydrant",
        "outdoor",
        do.draw_fire_hydrant,
        "red yellow green",
        (0.62, 0.75),
        (0.12, 0.22),
        "fire hydrant/fire hydrants, hydrant/hydrants",
        placement="ground",
        rotation=2,
        flip=False,
    ),
    _c(
        13,
        "stop sign",
        "outdoor",
        do.draw_stop_sign,
        "red",
        (0.5, 0.58),
        (0.18, 0.32),
        "stop sign/stop signs",
        placement="ground",
        rotation=3,
        flip=False,
        has_color=False,
        repeat=0.1,
    ),
    _c(
        15,
        "bench",
        "outdoor",
        do.draw_bench,
        "brown green gray black",
        (2.0, 2.8),
        (0.3, 0.5),
        "bench/benches, park bench/park benches",
        placement="ground",
        rotation=2,
    ),
    _c(
        16,
        "bird",
        "animal",
        dl.draw_bird,
        "brown blue black gray white red yellow",
        (1.1, 1.35),
        (0.09, 0.17),
        "bird/birds, pigeon/pigeons, sparrow/sparrows",
        placement="air",
        rotation=10,
        repeat=0.7,
    ),
    _c(
        17,
        "cat",
        "animal",
        dl.draw_cat,
        "gray black white brown",
        (1.25, 1.55),
        (0.18, 0.32),
        "cat/cats, kitten/kittens",
        placement="ground",
        rotation=5,
    ),
    _c(
        18,
        "dog",
        "animal",
        dl.draw_dog,
        "brown black white gray yellow",
        (1.25, 1.55),
        (0.2, 0.38),
        "dog/dogs, puppy/puppies, doggy/doggies",
        placement="ground",
        rotation=5,
    ),
    _c(
        19,
        "horse",
        "animal",
        dl.draw_horse,
        "brown black white gray",
        (1.05, 1.3),
        (0.32, 0.52),
        "horse/horses, pony/ponies",
        placement="ground",
        rotation=2,
    ),
    _c(
        27,
        "backpack",
        "accessory",
        do.draw_backpack,
        "red blue black green purple pink yellow",
        (0.7, 0.85),
        (0.12, 0.22),
        "backpack/backpacks, knapsack/knapsacks",
        placement="ground",
        rotation=8,
    ),
    _c(
        28,
        "umbrella",
        "accessory",
        do.draw_umbrella,
        "red blue black purple green yellow pink",
        (1.05, 1.35),
        (0.2, 0.36),
        "umbrella/umbrellas",
        placement="high",
        rotation=12,
    ),
    _c(
        34,
        "frisbee",
        "sports",
        do.draw_frisbee,
        "red blue yellow white green pink",
        (1.8, 2.4),
        (0.09, 0.15),
        "frisbee/frisbees",
        placement="air",
        rotation=20,
    ),
    _c(
        37,
        "sports ball",
        "sports",
        do.draw_sports_ball,
        "white yellow brown",
        (0.97, 1.03),
        (0.07, 0.13),
        "ball/balls",
        plural="sports balls",
        placement="ground",
        rotation=30,
        variants=(("soccer", 0.4), ("basketball", 0.25), ("tennis", 0.2), ("baseball", 0.15)),
    ),
    _c(
        38,
        "kite",
        "sports",
        do.draw_kite,
        "red blue yellow green purple pink",
        (0.7, 0.9),
        (0.15, 0.26),
        "kite/kites",
        placement="air",
        rotation=25,
    ),
    _c(
        41,
        "skateboard",
        "sports",
        do.draw_skateboard,
        "red blue black green yellow pink",
        (3.0, 3.8),
        (0.15, 0.25),
        "skateboard/skateboards",
        placement="ground",
        rotation=5,
    ),
    _c(
        44,
        "bottle",
        "kitchen",
        dk.draw_bottle,
        "green brown blue white",
        (0.3, 0.4),
        (0.14, 0.27),
        "bottle/bottles",
        rotation=8,
        flip=False,
        repeat=0.6,
    ),
    _c(
        46,
        "wine glass",
        "kitchen",
        dk.draw_wine_glass,
        "white",
        (0.45, 0.6),
        (0.12, 0.22),
        "wine glass/wine glasses",
        rotation=5,
        flip=False,
        has_color=False,
        repeat=0.6,
    ),
    _c(
        47,
        "cup",
        "kitchen",
        dk.draw_cup,
        "white red blue yellow green black pink",
        (0.95, 1.2),
        (0.09, 0.18),
        "cup/cups, coffee cup/coffee cups",
        rotation=6,
        repeat=0.6,
    ),
    _c(
        48,
        "fork",
        "kitchen",
        dk.draw_fork,
        "gray white black",
        (0.13, 0.18),
        (0.12, 0.2),
        "fork/forks",
        rotation=40,
        flip=False,
        has_color=False,
    ),
    _c(
        49,
        "knife",
        "kitchen",
        dk.draw_knife,
        "black brown red white",
        (0.12, 0.16),
        (0.13, 0.22),
        "knife/knives",
        rotation=40,
        has_color=False,
    ),
    _c(
        50,
        "spoon",
        "kitchen",
        dk.draw_spoon,
        "gray white black",
        (0.17, 0.22),
        (0.12, 0.19),
        "spoon/spoons",
        rotation=40,
        flip=False,
        has_color=False,
    ),
    _c(
        51,
        "bowl",
        "kitchen",
        dk.draw_bowl,
        "white blue red green yellow brown black",
        (1.6, 2.1),
        (0.14, 0.27),
        "bowl/bowls",
        rotation=4,
        flip=False,
        repeat=0.6,
    ),
    _c(
        52,
        "banana",
        "food",
        dk.draw_banana,
        "yellow green",
        (1.6, 2.1),
        (0.12, 0.2),
        "banana/bananas",
        rotation=30,
        repeat=0.6,
    ),
    _c(
        53,
        "apple",
        "food",
        dk.draw_apple,
        "red green yellow",
        (0.92, 1.05),
        (0.08, 0.14),
        "apple/apples",
        rotation=20,
        repeat=0.7,
    ),
    _c(
        55,
        "orange",
        "food",
        dk.draw_orange,
        "yellow",
        (0.97, 1.03),
        (0.08, 0.14),
        "orange/oranges",
        rotation=30,
        has_color=False,
        repeat=0.7,
    ),
    _c(
        59,
        "pizza",
        "food",
        dk.draw_pizza,
        "yellow",
        (1.15, 1.6),
        (0.2, 0.36),
        "pizza/pizzas",
        rotation=10,
        has_color=False,
    ),
    _c(
        60,
        "donut",
        "food",
        dk.draw_donut,
        "pink brown white yellow",
        (1.1, 1.35),
        (0.09, 0.16),
        "donut/donuts, doughnut/doughnuts",
        rotation=15,
        repeat=0.7,
    ),
    _c(
        62,
        "chair",
        "furniture",
        di.draw_chair,
        "brown black white red blue green",
        (0.62, 0.8),
        (0.2, 0.38),
        "chair/chairs",
        placement="ground",
        rotation=3,
        repeat=0.9,
    ),
    _c(
        63,
        "couch",
        "furniture",
        di.draw_couch,
        "brown gray blue red green black",
        (1.8, 2.3),
        (0.45, 0.7),
        "couch/couches, sofa/sofas",
        **_BIG,
    ),
    _c(
        64,
        "potted plant",
        "furniture",
        dl.draw_potted_plant,
        "brown white blue red",
        (0.6, 0.85),
        (0.15, 0.3),
        "potted plant/potted plants, houseplant/houseplants",
        placement="ground",
        rotation=3,
        has_color=False,
    ),
    _c(
        65,
        "bed",
        "furniture",
        di.draw_bed,
        "white blue red pink purple green yellow gray",
        (1.3, 1.7),
        (0.5, 0.75),
        "bed/beds",
        has_color=False,
        **_BIG,
    ),
    _c(
        67,
        "dining table",
        "furniture",
        di.draw_dining_table,
        "brown white black",
        (1.5, 2.1),
        (0.45, 0.7),
        "dining table/dining tables, table/tables",
        **_BIG,
    ),
    _c(
        72,
        "tv",
        "electronic",
        di.draw_tv,
        "black gray white",
        (1.4, 1.75),
        (0.22, 0.4),
        "tv/tvs, television/televisions, monitor/monitors",
        placement="high",
        rotation=2,
        flip=False,
    ),
    _c(
        73,
        "laptop",
        "electronic",
        di.draw_laptop,
        "gray black white",
        (1.2, 1.45),
        (0.2, 0.34),
        "laptop/laptops, laptop computer/laptop computers",
        rotation=5,
    ),
    _c(
        74,
        "mouse",
        "electronic",
        di.draw_mouse,
        "black white gray",
        (0.62, 0.75),
        (0.07, 0.11),
        "mouse/mice",
        rotation=25,
        flip=False,
    ),
    _c(
        75,
        "remote",
        "electronic",
        di.draw_remote,
        "black gray white",
        (0.24, 0.3),
        (0.11, 0.18),
        "remote/remotes, remote control/remote controls",
        rotation=35,
        flip=False,
    ),
    _c(
        76,
        "keyboard",
        "electronic",
        di.draw_keyboard,
        "black white gray",
        (2.8, 3.6),
        (0.25, 0.4),
        "keyboard/keyboards",
        rotation=6,
        flip=False,
    ),
    _c(
        77,
        "cell phone",
        "electronic",
        di.draw_cell_phone,
        "black white gray blue pink red",
        (0.46, 0.56),
        (0.09, 0.16),
        "cell phone/cell phones, cellphone/cellphones, phone/phones",
        rotation=30,
        flip=False,
    ),
    _c(
        78,
        "microwave",
        "appliance",
        dk.draw_microwave,
        "white black gray",
        (1.5, 1.8),
        (0.2, 0.32),
        "microwave/microwaves",
        placement="high",
        rotation=2,
    ),
    _c(
        81,
        "sink",
        "appliance",
        dk.draw_sink,
        "white gray",
        (1.4, 1.9),
        (0.25, 0.4),
        "sink/sinks",
        placement="ground",
        rotation=2,
        has_color=False,
        repeat=0.1,
    ),
    _c(
        82,
        "refrigerator",
        "appliance",
        dk.draw_refrigerator,
        "white gray black",
        (0.45, 0.6),
        (0.5, 0.75),
        "refrigerator/refrigerators, fridge/fridges",
        **_BIG,
    ),
    _c(
        84,
        "book",
        "indoor",
        di.draw_book,
        "red blue green yellow black brown purple white",
        (0.68, 0.8),
        (0.12, 0.22),
        "book/books",
        rotation=20,
        repeat=0.8,
        variants=(("cover", 0.7), ("stack", 0.3)),
    ),
    _c(
        85,
        "clock",
        "indoor",
        dk.draw_clock,
        "black brown red blue white gray",
        (0.97, 1.03),
        (0.1, 0.2),
        "clock/clocks, wall clock/wall clocks",
        placement="high",
        rotation=3,
        flip=False,
        repeat=0.15,
    ),
    _c(
        86,
        "vase",
        "indoor",
        dk.draw_vase,
        "blue white red green purple yellow pink",
        (0.5, 0.65),
        (0.12, 0.26),
        "vase/vases",
        rotation=4,
        flip=False,
    ),
    _c(
        88,
        "teddy bear",
        "indoor",
        dl.draw_teddy_bear,
        "brown yellow white pink gray",
        (0.78, 0.92),
        (0.14, 0.26),
        "teddy bear/teddy bears",
        placement="ground",
        rotation=10,
    ),
)

#: Aspect-ratio overrides for variants that change the silhouette.
VARIANT_ASPECT: dict[tuple[str, str], tuple[float, float]] = {("book", "stack"): (1.1, 1.5)}

#: Colour forced by a variant (e.g. a soccer ball is white).
VARIANT_COLOR: dict[tuple[str, str], str] = {
    ("sports ball", "soccer"): "white",
    ("sports ball", "basketball"): "brown",
    ("sports ball", "tennis"): "yellow",
    ("sports ball", "baseball"): "white",
}

CATEGORY_INDEX: dict[str, int] = {c.name: i for i, c in enumerate(CATEGORIES)}
CATEGORY_BY_NAME: dict[str, Category] = {c.name: c for c in CATEGORIES}
CATEGORY_BY_ID: dict[int, Category] = {c.id: c for c in CATEGORIES}
#: Names in label order: ``LABEL_NAMES[k]`` is the name of label value ``k`` (``0`` = background).
LABEL_NAMES: tuple[str, ...] = ("background",) + tuple(c.name for c in CATEGORIES)
NUM_LABELS: int = len(LABEL_NAMES)


def category(key: str | int) -> Category:
    """Look a category up by COCO name or COCO id.

    Raises:
        KeyError: if the world has no such category.
    """
    if isinstance(key, int):
        return CATEGORY_BY_ID[key]
    return CATEGORY_BY_NAME[key]


def coco_categories() -> list[dict[str, object]]:
    """The ``categories`` list of a COCO instances file."""
    return [{"id": c.id, "name": c.name, "supercategory": c.supercategory} for c in CATEGORIES]
