"""CHAIR vocabulary: the 80 MSCOCO classes, their synonyms and the phrase rules (data only).

Source: ``synonyms_txt`` and the hard-coded rules of ``chair.py`` in shikiw/OPERA (Maxlinn's
Python 3 port of LisaAnne/Hallucination ``utils/chair.py``; the synonym lines are identical to
LisaAnne/Hallucination ``data/synonyms.txt``, and RITUAL's ``eval_bench/chair.py`` differs from
OPERA's only in blank-line whitespace). These tables *define* the metric, so they are reproduced
entry for entry, in the reference order, including its quirks. ``tests/test_chair.py`` checks the
derived maps against invariants; the maps were also checked equal to the ``inverse_synonym_dict``
and ``double_word_dict`` pickled inside the reference evaluators shipped by RITUAL and DAMRO
(``chair.pkl``), except for the one ``'' -> ''`` entry noted below.

Quirks of the reference table, and what we do:

* ``" motor bike"`` and ``" cheesecake"`` carry a leading space (the reference splits lines on
  ``", "`` and two lines have a double space), so they never match a token. Reproduced (kept
  verbatim; inert). Consequence: "cheesecake" is not a cake mention, and "motor bike" is merged by
  the phrase rule into a token that is not in the vocabulary, so it is no mention at all.
* ``"iPhone"`` has a capital letter but captions are lower-cased first: never matches. Reproduced.
* ``"stove top oven"`` has three words; the phrase rule only joins pairs: never matches ("stove",
  "top", "oven" give two oven mentions). Reproduced.
* ``"home plate"`` and ``"train track"`` are merged phrases that are not in the vocabulary, so
  "train tracks" hides the "train" mention. ``"baby animal"``/``"baby cub"`` (and ``adult``) merge
  to non-vocabulary words, hiding the "baby"/"adult" person mention. Reproduced.
* ``"wine glas" -> "wine glass"`` was for pattern's singularize; harmless with WordNet. Kept.
* Duplicated synonyms within a line ("bike", "scooter", "jetliner", "person", ...) and duplicated
  phrases ("hot dog", "teddy bear") are harmless. Kept verbatim.
* ``"bow tie"`` is in the phrase list (mapping to itself) and then overridden to ``"tie"``.
  Reproduced through the same override order.
* The reference text starts with an empty line, which adds the synonym ``''`` (node ``''``).
  Not reproduced: tokens are never empty, so it cannot change any result.
* ``"dining table"`` is not in the phrase list: "dining table" gives "dining" + "table", and
  "table" maps to dining table, so the result is the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from types import MappingProxyType

#: One entry per MSCOCO class, in the reference order: the node word (the COCO category name) first,
#: then every synonym exactly as the reference parses it (duplicates and inert entries included).
COCO_SYNONYMS: tuple[tuple[str, ...], ...] = (
    (
        "person",
        "girl",
        "boy",
        "man",
        "woman",
        "kid",
        "child",
        "chef",
        "baker",
        "people",
        "adult",
        "rider",
        "children",
        "baby",
        "worker",
        "passenger",
        "sister",
        "biker",
        "policeman",
        "cop",
        "officer",
        "lady",
        "cowboy",
        "bride",
        "groom",
        "male",
        "female",
        "guy",
        "traveler",
        "mother",
        "father",
        "gentleman",
        "pitcher",
        "player",
        "skier",
        "snowboarder",
        "skater",
        "skateboarder",
        "person",
        "woman",
        "guy",
        "foreigner",
        "child",
        "gentleman",
        "caller",
        "offender",
        "coworker",
        "trespasser",
        "patient",
        "politician",
        "soldier",
        "grandchild",
        "serviceman",
        "walker",
        "drinker",
        "doctor",
        "bicyclist",
        "thief",
        "buyer",
        "teenager",
        "student",
        "camper",
        "driver",
        "solider",
        "hunter",
        "shopper",
        "villager",
    ),
    ("bicycle", "bike", "bicycle", "bike", "unicycle", "minibike", "trike"),
    (
        "car",
        "automobile",
        "van",
        "minivan",
        "sedan",
        "suv",
        "hatchback",
        "cab",
        "jeep",
        "coupe",
        "taxicab",
        "limo",
        "taxi",
    ),
    ("motorcycle", "scooter", " motor bike", "motor cycle", "motorbike", "scooter", "moped"),
    (
        "airplane",
        "jetliner",
        "plane",
        "air plane",
        "monoplane",
        "aircraft",
        "jet",
        "jetliner",
        "airbus",
        "biplane",
        "seaplane",
    ),
    ("bus", "minibus", "trolley"),
    ("train", "locomotive", "tramway", "caboose"),
    ("truck", "pickup", "lorry", "hauler", "firetruck"),
    (
        "boat",
        "ship",
        "liner",
        "sailboat",
        "motorboat",
        "dinghy",
        "powerboat",
        "speedboat",
        "canoe",
        "skiff",
        "yacht",
        "kayak",
        "catamaran",
        "pontoon",
        "houseboat",
        "vessel",
        "rowboat",
        "trawler",
        "ferryboat",
        "watercraft",
        "tugboat",
        "schooner",
        "barge",
        "ferry",
        "sailboard",
        "paddleboat",
        "lifeboat",
        "freighter",
        "steamboat",
        "riverboat",
        "battleship",
        "steamship",
    ),
    ("traffic light", "street light", "traffic signal", "stop light", "streetlight", "stoplight"),
    ("fire hydrant", "hydrant"),
    ("stop sign",),
    ("parking meter",),
    ("bench", "pew"),
    (
        "bird",
        "ostrich",
        "owl",
        "seagull",
        "goose",
        "duck",
        "parakeet",
        "falcon",
        "robin",
        "pelican",
        "waterfowl",
        "heron",
        "hummingbird",
        "mallard",
        "finch",
        "pigeon",
        "sparrow",
        "seabird",
        "osprey",
        "blackbird",
        "fowl",
        "shorebird",
        "woodpecker",
        "egret",
        "chickadee",
        "quail",
        "bluebird",
        "kingfisher",
        "buzzard",
        "willet",
        "gull",
        "swan",
        "bluejay",
        "flamingo",
        "cormorant",
        "parrot",
        "loon",
        "gosling",
        "waterbird",
        "pheasant",
        "rooster",
        "sandpiper",
        "crow",
        "raven",
        "turkey",
        "oriole",
        "cowbird",
        "warbler",
        "magpie",
        "peacock",
        "cockatiel",
        "lorikeet",
        "puffin",
        "vulture",
        "condor",
        "macaw",
        "peafowl",
        "cockatoo",
        "songbird",
    ),
    ("cat", "kitten", "feline", "tabby"),
    (
        "dog",
        "puppy",
        "beagle",
        "pup",
        "chihuahua",
        "schnauzer",
        "dachshund",
        "rottweiler",
        "canine",
        "pitbull",
        "collie",
        "pug",
        "terrier",
        "poodle",
        "labrador",
        "doggie",
        "doberman",
        "mutt",
        "doggy",
        "spaniel",
        "bulldog",
        "sheepdog",
        "weimaraner",
        "corgi",
        "cocker",
        "greyhound",
        "retriever",
        "brindle",
        "hound",
        "whippet",
        "husky",
    ),
    (
        "horse",
        "colt",
        "pony",
        "racehorse",
        "stallion",
        "equine",
        "mare",
        "foal",
        "palomino",
        "mustang",
        "clydesdale",
        "bronc",
        "bronco",
    ),
    ("sheep", "lamb", "ram", "lamb", "goat", "ewe"),
    ("cow", "cattle", "oxen", "ox", "calf", "cattle", "holstein", "heifer", "buffalo", "bull", "zebu", "bison"),
    ("elephant",),
    ("bear", "panda"),
    ("zebra",),
    ("giraffe",),
    ("backpack", "knapsack"),
    ("umbrella",),
    ("handbag", "wallet", "purse", "briefcase"),
    ("tie", "bow", "bow tie"),
    ("suitcase", "suit case", "luggage"),
    ("frisbee",),
    ("skis", "ski"),
    ("snowboard",),
    ("sports ball", "ball"),
    ("kite",),
    ("baseball bat",),
    ("baseball glove",),
    ("skateboard",),
    ("surfboard", "longboard", "skimboard", "shortboard", "wakeboard"),
    ("tennis racket", "racket"),
    ("bottle",),
    ("wine glass",),
    ("cup",),
    ("fork",),
    ("knife", "pocketknife", "knive"),
    ("spoon",),
    ("bowl", "container"),
    ("banana",),
    ("apple",),
    ("sandwich", "burger", "sub", "cheeseburger", "hamburger"),
    ("orange",),
    ("broccoli",),
    ("carrot",),
    ("hot dog",),
    ("pizza",),
    ("donut", "doughnut", "bagel"),
    ("cake", " cheesecake", "cupcake", "shortcake", "coffeecake", "pancake"),
    ("chair", "seat", "stool"),
    ("couch", "sofa", "recliner", "futon", "loveseat", "settee", "chesterfield"),
    ("potted plant", "houseplant"),
    ("bed",),
    ("dining table", "table", "desk"),
    ("toilet", "urinal", "commode", "toilet", "lavatory", "potty"),
    ("tv", "monitor", "televison", "television"),
    ("laptop", "computer", "notebook", "netbook", "lenovo", "macbook", "laptop computer"),
    ("mouse",),
    ("remote",),
    ("keyboard",),
    ("cell phone", "mobile phone", "phone", "cellphone", "telephone", "phon", "smartphone", "iPhone"),
    ("microwave",),
    ("oven", "stovetop", "stove", "stove top oven"),
    ("toaster",),
    ("sink",),
    ("refrigerator", "fridge", "fridge", "freezer"),
    ("book",),
    ("clock",),
    ("vase",),
    ("scissors",),
    ("teddy bear", "teddybear"),
    ("hair drier", "hairdryer"),
    ("toothbrush",),
)

#: The 80 COCO category names (node words), in the reference order.
COCO_CLASSES: tuple[str, ...] = tuple(entry[0] for entry in COCO_SYNONYMS)

#: Reference ``coco_double_words``: pairs of lemmas merged into one token (verbatim, with the
#: duplicates and the inert three-word entry).
TWO_WORD_PHRASES: tuple[str, ...] = (
    "motor bike",
    "motor cycle",
    "air plane",
    "traffic light",
    "street light",
    "traffic signal",
    "stop light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "suit case",
    "sports ball",
    "baseball bat",
    "baseball glove",
    "tennis racket",
    "wine glass",
    "hot dog",
    "cell phone",
    "mobile phone",
    "teddy bear",
    "hair drier",
    "potted plant",
    "bow tie",
    "laptop computer",
    "stove top oven",
    "hot dog",
    "teddy bear",
    "home plate",
    "train track",
)

#: Reference ``animal_words``: "baby X" and "adult X" become X (so "baby" does not fire "person").
QUALIFIED_ANIMAL_WORDS: tuple[str, ...] = (
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "animal",
    "cub",
)

#: Reference ``vehicle_words``: "passenger X" becomes X (so "passenger" does not fire "person").
PASSENGER_VEHICLE_WORDS: tuple[str, ...] = ("jet", "train")

#: Reference overrides, applied last and in this order.
PHRASE_OVERRIDES: tuple[tuple[str, str], ...] = (
    ("bow tie", "tie"),
    ("toilet seat", "toilet"),
    ("wine glas", "wine glass"),
)

#: The rule "seat is no chair mention when toilet occurs" (reference ``caption_to_words``): the first
#: word's presence among a caption's merged tokens drops every mention of the second.
SEAT_RULE: tuple[str, str] = ("toilet", "seat")

#: Abbreviations of NLTK's trained English Punkt model (``abbrev_types`` of ``english.pickle`` /
#: ``punkt_tab/english``), as printed by an NLTK maintainer in nltk/nltk#2500. Used only to split
#: sentences the way Punkt does when the Punkt data is not installed; see ``chair.split_sentences``.
#: The odd ``". . "`` entry is part of the printed set (it can never equal a token).
PUNKT_ENGLISH_ABBREVIATIONS: frozenset[str] = frozenset(
    {
        ". . ",
        "a.a",
        "a.c",
        "a.d",
        "a.g",
        "a.h",
        "a.m",
        "a.m.e",
        "a.s",
        "a.t",
        "adm",
        "ala",
        "ariz",
        "aug",
        "ave",
        "b.f",
        "b.v",
        "bros",
        "c",
        "c.i.t",
        "c.o.m.b",
        "c.v",
        "calif",
        "chg",
        "cie",
        "co",
        "col",
        "colo",
        "conn",
        "corp",
        "cos",
        "ct",
        "d",
        "d.c",
        "d.h",
        "d.w",
        "dec",
        "dr",
        "e",
        "e.f",
        "e.h",
        "e.l",
        "e.m",
        "f",
        "f.g",
        "f.j",
        "feb",
        "fla",
        "fri",
        "ft",
        "g",
        "g.d",
        "g.f",
        "g.k",
        "ga",
        "gen",
        "h",
        "h.c",
        "h.f",
        "h.m",
        "i.m.s",
        "ill",
        "inc",
        "j.b",
        "j.c",
        "j.j",
        "j.k",
        "j.p",
        "j.r",
        "jan",
        "jr",
        "k",
        "kan",
        "ky",
        "l",
        "l.a",
        "l.f",
        "l.p",
        "lt",
        "ltd",
        "m",
        "m.b.a",
        "m.d.c",
        "m.j",
        "maj",
        "messrs",
        "mg",
        "mich",
        "minn",
        "mr",
        "mrs",
        "ms",
        "n",
        "n.c",
        "n.d",
        "n.h",
        "n.j",
        "n.m",
        "n.v",
        "n.y",
        "nev",
        "nov",
        "oct",
        "ok",
        "okla",
        "ore",
        "p",
        "p.a.m",
        "p.m",
        "pa",
        "ph.d",
        "prof",
        "r",
        "r.a",
        "r.h",
        "r.i",
        "r.j",
        "r.k",
        "r.t",
        "rep",
        "reps",
        "s",
        "s.a",
        "s.a.y",
        "s.c",
        "s.g",
        "s.p.a",
        "s.s",
        "sen",
        "sep",
        "sept",
        "sr",
        "st",
        "sw",
        "t",
        "t.j",
        "tenn",
        "tues",
        "u.k",
        "u.n",
        "u.s",
        "u.s.a",
        "u.s.s.r",
        "v",
        "va",
        "vs",
        "vt",
        "w",
        "w.c",
        "w.r",
        "w.va",
        "w.w",
        "wash",
        "wed",
        "wis",
        "yr",
    }
)


def build_synonym_map() -> dict[str, str]:
    """Synonym -> node word, built like the reference ``inverse_synonym_dict`` (later lines win;
    no synonym appears in two lines, so order does not matter in practice)."""
    mapping: dict[str, str] = {}
    for entry in COCO_SYNONYMS:
        for word in entry:
            mapping[word] = entry[0]
    return mapping


def build_phrase_map() -> dict[str, str]:
    """Two-word phrase -> merged token, built in the reference order (``double_word_dict``)."""
    mapping = {phrase: phrase for phrase in TWO_WORD_PHRASES}
    for animal in QUALIFIED_ANIMAL_WORDS:
        mapping[f"baby {animal}"] = animal
        mapping[f"adult {animal}"] = animal
    for vehicle in PASSENGER_VEHICLE_WORDS:
        mapping[f"passenger {vehicle}"] = vehicle
    for phrase, target in PHRASE_OVERRIDES:
        mapping[phrase] = target
    return mapping


#: Read-only views used by the evaluator.
SYNONYM_TO_NODE: Mapping[str, str] = MappingProxyType(build_synonym_map())
PHRASE_MAP: Mapping[str, str] = MappingProxyType(build_phrase_map())


def relevant_words(
    synonyms: Mapping[str, str] | None = None, phrases: Mapping[str, str] | None = None
) -> frozenset[str]:
    """Every string the caption parser compares a single lemma with (the default tables if None).

    That is each synonym without whitespace (a lemma never holds whitespace, so multi-word synonyms
    are only reached through a merged phrase), each word of each phrase key (a pair of lemmas is
    merged only when both are those words) and the ``SEAT_RULE`` words. A lemma outside this set
    can change no CHAIR output but ``words``; tests/test_chair_identity.py aims its sentence sweep
    at the forms that lemmatise into it.
    """
    synonyms = SYNONYM_TO_NODE if synonyms is None else synonyms
    phrases = PHRASE_MAP if phrases is None else phrases
    words = {w for w in synonyms if w and not any(c.isspace() for c in w)}
    words.update(part for key in phrases for part in key.split(" ") if part)
    words.update(SEAT_RULE)
    return frozenset(words)


def vocabulary_digest() -> str:
    """sha256 of the tables above; part of the CHAIR ground-truth cache key."""
    payload = json.dumps(
        {"synonyms": COCO_SYNONYMS, "phrases": sorted(PHRASE_MAP.items())},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()
