"""CHAIR with the data shipped in the package gives the same results as with NLTK's full data.

Needs an NLTK data folder with ``taggers/averaged_perceptron_tagger_eng`` and ``corpora/wordnet``,
named by ``MMFAST_REFERENCE_NLTK_DATA`` (``.ci/run`` sets it when ``../shared/nltk_data`` exists).
The tests load that folder explicitly; the product never looks for it. "Same" means the same
tags, mentions, mention indices, token counts, ground truth and metrics; ``words`` may differ only
where neither lemma is one CHAIR compares (shipped: the token, e.g. "is"; NLTK: "be").
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest

from mmfast.eval.chair import (
    CaptionObjects,
    CaptionParser,
    ChairEvaluator,
    ChairResources,
    load_chair_resources,
    load_nltk_resources,
    load_shipped_resources,
)
from mmfast.eval.chair_vocab import PHRASE_MAP, SYNONYM_TO_NODE, relevant_words

REF = os.environ.get("MMFAST_REFERENCE_NLTK_DATA", "")
pytestmark = pytest.mark.skipif(
    not REF, reason="MMFAST_REFERENCE_NLTK_DATA is not set: no NLTK data (tagger + WordNet) to compare the "
                    "shipped CHAIR data with (.ci/run sets it to ../shared/nltk_data when that exists)")

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chair"
RELEVANT = relevant_words()
COMPARABLE = RELEVANT | set(PHRASE_MAP.values())  # what a merged token is compared with
POS = ("n", "v", "a", "r")


def _build_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_chair_data", REPO / "scripts" / "build_chair_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def routes() -> Iterator[tuple[ChairResources, ChairResources]]:
    """(shipped, full NLTK), with $NLTK_DATA unset and nltk.data.path restored afterwards."""
    import nltk

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NLTK_DATA", raising=False)
        mp.setattr(nltk.data, "path", list(nltk.data.path))  # loading appends REF to it
        assert load_chair_resources().route == "shipped"  # the product does not find REF by itself
        full = load_nltk_resources(REF)
        assert full.route == "nltk" and full.wordnet is not None
        yield load_shipped_resources(), full


@pytest.fixture(scope="module")
def parsers(routes: tuple[ChairResources, ChairResources]) -> tuple[CaptionParser, CaptionParser]:
    shipped, full = routes
    return CaptionParser(shipped), CaptionParser(full)


def assert_same_chair(caption: str, shipped: CaptionObjects, full: CaptionObjects) -> None:
    assert shipped.mentions == full.mentions, caption
    assert shipped.mention_idxs == full.mention_idxs, caption
    assert len(shipped.words) == len(full.words), caption
    for a, b in zip(shipped.words, full.words):
        assert a == b or (a not in COMPARABLE and b not in COMPARABLE), (caption, a, b)


def compare_captions(parsers: tuple[CaptionParser, CaptionParser], captions: list[str]) -> int:
    """Assert CHAIR identity on every caption (tags included); return how many had any mention."""
    shipped, full = parsers
    with_mentions = 0
    for caption in captions:
        s, f = shipped.parse(caption), full.parse(caption)
        assert_same_chair(caption, s, f)
        with_mentions += bool(f.mentions)
    return with_mentions


# --- the data itself -------------------------------------------------------------------------------


def test_shipped_tagger_is_nltks(routes: tuple[ChairResources, ChairResources]) -> None:
    shipped, full = routes
    assert shipped.tagger.model.weights == full.tagger.model.weights
    assert shipped.tagger.tagdict == full.tagger.tagdict
    assert shipped.tagger.classes == full.tagger.classes == shipped.tagger.model.classes
    assert shipped.provenance["tagger_sha256"] == full.provenance["tagger_sha256"]
    assert shipped.provenance["wordnet_version"] == full.provenance["wordnet_version"]
    assert shipped.cache_key()["route"] != full.cache_key()["route"]


def test_committed_data_is_what_the_script_builds() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NLTK_DATA"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "build_chair_data.py"), "--nltk-data", REF,
                           "--check"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_lemmas_agree_on_all_of_wordnet(routes: tuple[ChairResources, ChairResources]) -> None:
    """g(shipped lemma) == g(full lemma) (g: keep the lemma if CHAIR compares it) for every WordNet
    lemma name, every exception-list form and every one-rule inflection of every lemma name, in
    all four POS: a brute-force check of the argument in scripts/build_chair_data.py."""
    shipped, full = routes
    wn = full.wordnet
    rules = wn.MORPHOLOGICAL_SUBSTITUTIONS
    names = {n for n in wn.all_lemma_names()}
    forms = names | {form for pos in POS for form in wn._exception_map[pos]}

    def g(lemma: str) -> str | None:
        return lemma if lemma in RELEVANT else None

    checked = 0
    for form in forms:
        for pos in POS:
            assert g(shipped.lemmatize(form, pos)) == g(full.lemmatize(form, pos)), (form, pos)
            checked += 1
    for pos in POS:
        for name in names:
            for old, new in rules[pos]:
                if name.endswith(new):
                    form = name[:len(name) - len(new)] + old
                    assert g(shipped.lemmatize(form, pos)) == g(full.lemmatize(form, pos)), (form, pos)
                    checked += 1
    assert checked > 1_500_000


# --- captions ------------------------------------------------------------------------------------------


def test_fixture_results_identical(routes: tuple[ChairResources, ChairResources],
                                   parsers: tuple[CaptionParser, CaptionParser]) -> None:
    instances = [FIXTURES / "instances_a.json", FIXTURES / "instances_b.json"]
    captions = FIXTURES / "captions.json"
    shipped = ChairEvaluator.from_coco(instances, captions, nltk_data=None)
    full = ChairEvaluator.from_coco(instances, captions, nltk_data=REF)
    assert shipped.parser.resources.route == "shipped" and full.parser.resources.route == "nltk"
    assert shipped.ground_truth == full.ground_truth
    a, b = (ev.evaluate_file(FIXTURES / "generated.jsonl") for ev in (shipped, full))
    assert a.as_dict() == b.as_dict()
    ref_a, ref_b = a.to_reference_dict(), b.to_reference_dict()
    assert ref_a["overall_metrics"] == ref_b["overall_metrics"]
    for sa, sb in zip(ref_a["sentences"], ref_b["sentences"]):
        assert {k: v for k, v in sa.items() if k != "words"} == {k: v for k, v in sb.items() if k != "words"}
    texts = [c["caption"] for c in json.loads(captions.read_text())["annotations"]]
    texts += [json.loads(line)["caption"] for line in (FIXTURES / "generated.jsonl").read_text().splitlines()]
    compare_captions(parsers, texts)


def _sample_texts() -> list[str]:
    texts: set[str] = set()
    for path in sorted((REPO / "benchmarks").rglob("samples.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            texts.update(r for resps in rec.get("resps", []) for r in resps if isinstance(r, str))
            if isinstance(rec.get("prompt"), str):
                texts.add(rec["prompt"])
    return sorted(texts)


def test_committed_samples_identical(parsers: tuple[CaptionParser, CaptionParser]) -> None:
    texts = _sample_texts()
    if not texts:
        pytest.skip("no benchmarks/**/samples.jsonl in this checkout")
    with_mentions = compare_captions(parsers, texts)
    assert with_mentions > 1000  # not vacuous: the model's captions mention objects


def _sweep_sentences(wn: object, table: dict[str, dict[str, str]], n_random: int = 3000) -> list[str]:
    """Sentences that put every word CHAIR compares, every form that can lemmatize to one (table
    entries, one-rule inflections, WordNet exception forms), every phrase (with inflected second
    words) and random WordNet words into varied syntactic frames, so the tagger gives them
    different parts of speech."""
    rng = random.Random(0)
    script = _build_script()
    exc = {pos: wn._exception_map[pos] for pos in POS}  # type: ignore[attr-defined]
    rules = wn.MORPHOLOGICAL_SUBSTITUTIONS  # type: ignore[attr-defined]
    targets = set(RELEVANT)
    for pos in POS:
        targets |= script.candidate_forms(RELEVANT, exc[pos], rules[pos])
        targets |= set(table[pos])
    exception_forms = {f for pos in POS for f, bases in exc[pos].items() if RELEVANT.intersection(bases)}
    assert exception_forms <= targets
    targets = {t for t in targets if t and t.strip() == t and " " not in t}
    phrases = sorted(PHRASE_MAP) + sorted(w for w in SYNONYM_TO_NODE if " " in w.strip())
    names = sorted(n for n in wn.all_lemma_names() if "_" not in n)  # type: ignore[attr-defined]
    fillers = rng.sample(names, n_random)
    frames = [
        "a {w} next to the {x}.", "the {w} is {x} near a {y}.", "two {w} and a {x} on the {y}.",
        "they {w} the {x} while the {y} {z}.", "there are {w} {x} in the {y}.", "it {w} {x} quickly.",
        "is that a {w}? yes, the {x} is {y}!", "a very {w} {x} with {y} {z}.", "{w} {x} {y}.",
        "The {W} and the {X}, {y} and {z}.", "a man {w} a {x} beside the {y}; the {z} {w}.",
        "this is the {w}er {x} of the {y}.", "we saw {w} {x}s, {y}es and {z}ing {w}.",
        "{W}. {X}!", "the {w} {x} {y} {z} on the {w} of the {x}.",
    ]
    pool = sorted(targets) + fillers
    sentences = []
    for word in sorted(targets):
        for frame in rng.sample(frames, 3):
            fill = {k: rng.choice(pool) for k in "xyz"}
            sentences.append(frame.format(w=word, W=word.capitalize(), X=fill["x"].upper(), **fill))
    for phrase in phrases:
        first, _, second = phrase.strip().partition(" ")
        for variant in {phrase.strip(), f"{first} {second}s", f"{first} {second}es", f"{first}s {second}"}:
            for frame in rng.sample(frames, 2):
                fill = {k: rng.choice(pool) for k in "xyz"}
                sentences.append(frame.format(w=variant, W=variant.title(), X=fill["x"], **fill))
    for _ in range(n_random):
        words = [rng.choice(pool) for _ in range(rng.randint(3, 14))]
        sentences.append(" ".join(words) + rng.choice([".", "!", "?", ""]))
    return sentences


def test_generated_sweep_identical(routes: tuple[ChairResources, ChairResources],
                                   parsers: tuple[CaptionParser, CaptionParser]) -> None:
    shipped, full = routes
    table = json.loads((REPO / "mmfast" / "assets" / "chair" / "chair_lemmas.json").read_text())["lemmas"]
    sentences = _sweep_sentences(full.wordnet, table)
    assert len(sentences) > 10_000
    with_mentions = compare_captions(parsers, sentences)
    assert with_mentions > 5_000
