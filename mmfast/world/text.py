"""Text of the world: captions, detailed descriptions, yes/no and short questions, prompts.

Everything here is a pure function of an :class:`~mmfast.world.render.ImageAnnotation` and a
:class:`random.Random`, so the text is as reproducible as the pixels (use :func:`text_rng`).

* :func:`captions` - COCO-style reference captions (5 per image in the written dataset). They
  mention the salient (largest) objects, not necessarily all, use COCO synonyms ("puppy",
  "sofa", "television", "people"...) and plurals with number words ("two dogs").
* :func:`detailed_description` - the answer to :data:`DETAIL_PROMPT`: 2-5 sentences naming the
  scene type and **every** present category, largest first, with counts, colours and rough
  positions ("in the top right corner"); it always ends with a period.
* :func:`yes_no_questions` - balanced "Is there a {obj} in the image?" -> "Yes" / "No"; half the
  negatives are *hard* (typical of the scene but absent), half random.
* :func:`short_qa` - counts ("Two"), colours ("Red"), place ("A kitchen"), position ("On the left").
* :func:`world_corpus` - every text the world can produce, for tokenizer training.

Sentences are simple English, lowercase except the first letter. The colour word "orange" is never
used (it is also a COCO category), and person plurals are "people" / "children" / "kids" (words
that CHAIR's synonym list maps to "person" without lemmatisation).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .categories import CATEGORIES, CATEGORY_BY_NAME, Category
from .draw_base import COLORS
from .render import ImageAnnotation, Instance, WorldConfig, render_image
from .scenes import SCENE_BY_NAME, SCENES

CAPTION_PROMPTS: tuple[str, ...] = (
    "Describe the image briefly.",
    "Generate a short caption of this image.",
    "Write a short caption for this image.",
    "Give a brief description of the image.",
    "Summarize the image in one sentence.",
    "What does this image show? Answer in one sentence.",
)
#: The exact prompt of the detailed-description task (also used by CHAIR-style evaluation).
DETAIL_PROMPT = "Please describe this image in detail."
DETAIL_PROMPTS: tuple[str, ...] = (
    DETAIL_PROMPT,
    "Describe this image in detail.",
    "Give a detailed description of this image.",
)
#: LLaVA-1.5 style suffix for short-answer questions (POPE prompts use it too).
SHORT_ANSWER_SUFFIX = "Answer the question using a single word or phrase."
OBJECT_QUESTION = "Is there {article} {obj} in the image?"

NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
POSITIONS: dict[tuple[int, int], str] = {
    (0, 0): "in the top left corner",
    (1, 0): "at the top",
    (2, 0): "in the top right corner",
    (0, 1): "on the left",
    (1, 1): "in the center",
    (2, 1): "on the right",
    (0, 2): "in the bottom left corner",
    (1, 2): "at the bottom",
    (2, 2): "in the bottom right corner",
}
_VERBS: dict[str, tuple[str, ...]] = {
    "person": ("standing", "walking"),
    "dog": ("standing", "sitting", "playing"),
    "cat": ("sitting", "resting"),
    "horse": ("standing", "grazing"),
    "bird": ("sitting", "perched"),
    "car": ("parked", "driving"),
    "bus": ("driving", "parked"),
    "truck": ("parked", "driving"),
    "motorcycle": ("parked",),
    "bicycle": ("parked",),
    "kite": ("flying",),
    "frisbee": ("flying",),
}
_STILL = ("sitting", "placed")


@dataclass(frozen=True)
class QAPair:
    """One question with its short answer; ``kind`` is yesno / count / color / place / where."""

    question: str
    answer: str
    kind: str


@dataclass(frozen=True)
class _Group:
    cat: Category
    insts: tuple[Instance, ...]

    @property
    def n(self) -> int:
        return len(self.insts)


def text_rng(seed: int, split: str, image_id: int, purpose: str) -> random.Random:
    """A reproducible random source for the text of one image (``purpose``: "captions", ...)."""
    h = hashlib.sha256(f"mmfast-world-text:{seed}:{split}:{image_id}:{purpose}".encode()).digest()
    return random.Random(int.from_bytes(h[:8], "big"))


def article(word: str) -> str:
    """``"an"`` before a vowel sound (by first letter), else ``"a"``."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def object_question(name: str) -> str:
    """POPE template: ``"Is there a dog in the image?"`` / ``"Is there an apple in the image?"``."""
    return OBJECT_QUESTION.format(article=article(name), obj=name)


def number_word(n: int) -> str:
    """``2 -> "two"`` (digits beyond ten)."""
    return NUMBER_WORDS[n] if 0 <= n < len(NUMBER_WORDS) else str(n)


def sentence(text: str) -> str:
    """Capitalise the first letter and make sure the text ends with a period."""
    text = text.strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "?", "!")) else text + "."


def position_phrase(inst: Instance, size: int) -> str:
    """Rough position of an instance from its box centre, by thirds ("on the left")."""
    cx, cy = inst.center
    col = 0 if cx < size / 3 else 2 if cx > 2 * size / 3 else 1
    row = 0 if cy < size / 3 else 2 if cy > 2 * size / 3 else 1
    return POSITIONS[(col, row)]


def _groups(ann: ImageAnnotation) -> list[_Group]:
    by: dict[str, list[Instance]] = {}
    for inst in ann.instances:
        by.setdefault(inst.name, []).append(inst)
    return [_Group(CATEGORY_BY_NAME[n], tuple(v)) for n, v in by.items()]


def _noun(g: _Group, rng: random.Random, canonical: bool = False) -> str:
    """A (synonym) noun for a group, singular or plural by count."""
    name = g.cat.name
    if name == "person":
        kinds = {i.variant for i in g.insts}
        if g.n == 1:
            opts = {"man": ("man", "person", "guy"), "woman": ("woman", "person", "lady"), "child": ("child", "kid")}[
                g.insts[0].variant
            ]
            return opts[0] if canonical else rng.choice(opts)
        if kinds == {"child"}:
            return "children" if canonical else rng.choice(("children", "kids"))
        return "people"
    if name == "sports ball" and g.n == 1 and g.insts[0].variant in ("soccer", "tennis"):
        return f"{g.insts[0].variant} ball" if canonical or rng.random() < 0.7 else "ball"
    sg, pl = g.cat.nouns[0] if canonical or rng.random() < 0.5 else rng.choice(g.cat.nouns)
    return sg if g.n == 1 else pl


def _np(
    g: _Group,
    rng: random.Random,
    size: int,
    *,
    color_p: float = 0.4,
    pos: bool = False,
    size_word: bool = False,
    canonical: bool = False,
) -> str:
    """Noun phrase: "a red car", "two dogs", "a man dressed in blue on the left"."""
    noun = _noun(g, rng, canonical)
    if g.n == 1:
        inst = g.insts[0]
        words: list[str] = []
        if size_word and g.cat.name != "person":
            if inst.area > 0.12 * size * size:
                words.append("large")
            elif inst.is_small:
                words.append("small")
        color = g.cat.has_color and g.cat.name != "person" and rng.random() < color_p
        if color:
            words.append(inst.color)
        words.append(noun)
        phrase = f"{article(words[0])} {' '.join(words)}"
        if g.cat.name == "person" and rng.random() < color_p:
            phrase += f" dressed in {inst.color}"
        if pos:
            phrase += " " + position_phrase(inst, size)
        return phrase
    count = number_word(g.n) if g.n <= 4 else rng.choice(("several", "some", "a group of"))
    phrase = f"{count} {noun}"
    if pos:
        places = {position_phrase(i, size) for i in g.insts}
        if len(places) == 1:
            phrase += " " + places.pop()
        else:
            sides = {p.split()[-1] for p in places}
            if len(sides) == 1 and sides <= {"left", "right"}:
                phrase += f" on the {sides.pop()}"
    return phrase


def _join(parts: list[str]) -> str:
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _be(g: _Group) -> str:
    return "is" if g.n == 1 else "are"


def _verb(g: _Group, rng: random.Random) -> str:
    return rng.choice(_VERBS.get(g.cat.name, _STILL))


def captions(ann: ImageAnnotation, rng: random.Random, n: int = 5) -> list[str]:
    """``n`` reference captions mentioning the most salient objects with synonyms.

    Args:
        ann: Image annotation.
        rng: Random source (see :func:`text_rng`).
        n: Number of captions.

    Returns:
        Distinct captions when possible, each one sentence ending with a period.
    """
    groups = _groups(ann)
    scene = SCENE_BY_NAME[ann.scene]
    s = ann.width
    if not groups:
        return [sentence(f"an empty {scene.name}")] * n

    def pick(k: int) -> list[_Group]:
        top = groups[: max(k, min(4, len(groups)))]
        chosen = [top[0]] + rng.sample(top[1:], min(k - 1, len(top) - 1))
        return sorted(chosen, key=groups.index)

    def t_verb() -> str:
        g = pick(1)[0]
        return f"{_np(g, rng, s)} {_verb(g, rng)} {rng.choice(scene.places)}"

    def t_pair() -> str:
        a, *b = pick(2)
        return f"{_np(a, rng, s)} and {_np(b[0], rng, s)} {rng.choice(scene.places)}" if b else t_verb()

    def t_with() -> str:
        parts = [_np(g, rng, s) for g in pick(rng.randint(1, 3))]
        return f"{scene.with_article} with {_join(parts)}"

    def t_next() -> str:
        a, *b = pick(2)
        if not b:
            return f"there {_be(a)} {_np(a, rng, s)} {rng.choice(scene.places)}"
        return f"there {_be(a)} {_np(a, rng, s)} {rng.choice(('next to', 'near', 'beside'))} {_np(b[0], rng, s)}"

    def t_view() -> str:
        return f"a view of {scene.with_article} with {_join([_np(g, rng, s) for g in pick(rng.randint(1, 2))])}"

    def t_has() -> str:
        return f"this {scene.name} has {_join([_np(g, rng, s) for g in pick(2)])}"

    def t_list() -> str:
        return f"{_join([_np(g, rng, s) for g in pick(rng.randint(2, 3))])} {rng.choice(scene.places)}"

    templates = [t_verb, t_pair, t_with, t_next, t_view, t_has, t_list]
    rng.shuffle(templates)
    out: list[str] = []
    for i in range(n * 3):
        cap = sentence(templates[i % len(templates)]())
        if cap not in out:
            out.append(cap)
        if len(out) == n:
            break
    while len(out) < n:
        out.append(out[len(out) % max(1, len(out))])
    return out


def detailed_description(ann: ImageAnnotation, rng: random.Random) -> str:
    """Answer to :data:`DETAIL_PROMPT`: scene type, then every category (largest first).

    Returns:
        2-5 sentences; counts, colours and rough positions included; ends with a period.
    """
    scene = SCENE_BY_NAME[ann.scene]
    s = ann.width
    intro = rng.choice(
        (
            f"this is a photo of {scene.with_article}",
            f"the image shows {scene.with_article}",
            f"this picture was taken in {scene.with_article}",
        )
    )
    sents = [sentence(intro)]
    groups = _groups(ann)
    chunks = [groups[i : i + 2] for i in range(0, len(groups), 2)]
    if len(chunks) > 4:  # more than 8 categories: pack tighter
        k = -(-len(groups) // 4)
        chunks = [groups[i : i + k] for i in range(0, len(groups), k)]
    for ci, chunk in enumerate(chunks):
        phrases = [_np(g, rng, s, color_p=0.8, pos=True, size_word=True, canonical=rng.random() < 0.8) for g in chunk]
        x = _join(phrases)
        be = "are" if len(chunk) > 1 or chunk[0].n > 1 else "is"
        if ci == 0:
            t = rng.choice((f"there {_be(chunk[0])} {x}", f"you can see {x}", f"the image contains {x}"))
        else:
            t = rng.choice((f"there {_be(chunk[0])} also {x}", f"you can also see {x}", f"{x} {be} also visible"))
        sents.append(sentence(t))
    if len(sents) < 5 and rng.random() < 0.7:
        sents.append(scene.background)
    return " ".join(sents)


def yes_no_questions(ann: ImageAnnotation, rng: random.Random, n_pos: int | None = None) -> list[QAPair]:
    """Balanced object-presence questions ("Yes" / "No" answers, shuffled).

    Args:
        ann: Image annotation.
        rng: Random source.
        n_pos: Number of positive questions (default: every present category).

    Returns:
        ``2 * n_pos`` pairs; negatives alternate between hard (typical of the scene, absent)
        and random absent categories.
    """
    present = ann.object_names()
    pos = present if n_pos is None or n_pos >= len(present) else rng.sample(present, n_pos)
    absent = [c.name for c in CATEGORIES if c.name not in present]
    hard = [(n, w) for n, w in SCENE_BY_NAME[ann.scene].typical if n not in present]
    negs: list[str] = []
    for i in range(len(pos)):
        pool_h = [(n, w) for n, w in hard if n not in negs]
        if i % 2 == 0 and pool_h:
            negs.append(rng.choices([n for n, _ in pool_h], [w for _, w in pool_h])[0])
        else:
            negs.append(rng.choice([n for n in absent if n not in negs]))
    out = [QAPair(object_question(n), "Yes", "yesno") for n in pos]
    out += [QAPair(object_question(n), "No", "yesno") for n in negs]
    rng.shuffle(out)
    return out


def short_qa(ann: ImageAnnotation, rng: random.Random, k: int = 4) -> list[QAPair]:
    """Up to ``k`` short questions: count, colour, place and position, answers capitalised."""
    scene = SCENE_BY_NAME[ann.scene]
    cands: list[QAPair] = [
        QAPair("What kind of place is this?", sentence(scene.with_article)[:-1], "place"),
        QAPair("Where was this picture taken?", sentence(f"in {scene.with_article}")[:-1], "place"),
    ]
    for g in _groups(ann):
        name = g.cat.name
        cands.append(QAPair(f"How many {g.cat.plural} are in the image?", number_word(g.n).capitalize(), "count"))
        if g.n == 1:
            inst = g.insts[0]
            cands.append(QAPair(f"Where is the {name}?", sentence(position_phrase(inst, ann.width))[:-1], "where"))
            if name == "person":
                cands.append(QAPair("What color is the person wearing?", inst.color.capitalize(), "color"))
            elif g.cat.has_color:
                cands.append(QAPair(f"What color is the {name}?", inst.color.capitalize(), "color"))
    place = cands[rng.randrange(2)]
    rest = rng.sample(cands[2:], min(k - 1, len(cands) - 2))
    out = [place] + rest
    rng.shuffle(out)
    return out


def static_texts() -> list[str]:
    """Prompts, templates, names, synonyms, numbers, colours and scene phrases."""
    out = list(CAPTION_PROMPTS) + list(DETAIL_PROMPTS) + [SHORT_ANSWER_SUFFIX, "Yes", "No"]
    for c in CATEGORIES:
        out.append(object_question(c.name))
        out.append(f"How many {c.plural} are in the image? What color is the {c.name}? Where is the {c.name}?")
        out.append(" ".join(f"{sg} {pl}" for sg, pl in c.nouns))
    out.append(" ".join(w.capitalize() for w in NUMBER_WORDS) + " " + " ".join(NUMBER_WORDS))
    out.append(" ".join(COLORS) + " " + " ".join(w.capitalize() for w in COLORS))
    out.extend(sentence(p)[:-1] for p in POSITIONS.values())
    for sc in SCENES:
        out.extend([sentence(sc.with_article)[:-1], *sc.places, sc.background])
    return out


def image_texts(ann: ImageAnnotation, rng: random.Random) -> list[str]:
    """All generated texts of one image (captions, description, questions and answers)."""
    out = captions(ann, rng) + [detailed_description(ann, rng)]
    for qa in yes_no_questions(ann, rng) + short_qa(ann, rng, k=6):
        out += [qa.question, qa.answer]
    return out


def world_corpus(
    annotations: Iterable[ImageAnnotation] | None = None,
    *,
    seed: int = 0,
    split: str = "train",
    n_images: int = 300,
    config: WorldConfig | None = None,
) -> Iterator[str]:
    """Yield every kind of text of the world, e.g. to train a tokenizer.

    Args:
        annotations: Annotations to verbalise (e.g. from :func:`mmfast.world.load_annotations`);
            if omitted, ``n_images`` images of ``split`` are rendered from ``seed``.
        seed: World seed (for rendering and for the text random sources).
        split: Split name used when rendering.
        n_images: Number of images rendered when ``annotations`` is omitted.
        config: Generator settings used when rendering.

    Yields:
        Static texts first (prompts, names, synonyms...), then per-image texts.
    """
    yield from static_texts()
    if annotations is None:
        annotations = (render_image(seed, split, i, config).annotation for i in range(1, n_images + 1))
    for ann in annotations:
        yield from image_texts(ann, text_rng(seed, ann.split, ann.image_id, "corpus"))
