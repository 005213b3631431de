"""CHAIR with the data shipped in the package gives the same results as with NLTK's full data.

Needs an NLTK data folder with ``taggers/averaged_perceptron_tagger_eng`` and ``corpora/wordnet``,
named by ``MMFAST_REFERENCE_NLTK_DATA`` (``.ci/run`` sets it when ``../shared/nltk_data`` exists).
The tests load that folder explicitly; the product never looks for it. "Same" means every field:
the lemmas, the per-caption ``words``, mentions, mention indices, token counts, ground truth and
metrics; the shipped lemmatiser is also compared with NLTK's ``WordNetLemmatizer`` directly, on
every WordNet lemma name, exception form and one-rule inflection, in the four POS CHAIR uses.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
from mmfast.eval.chair_morphy import POS
from mmfast.eval.chair_vocab import PHRASE_MAP, SYNONYM_TO_NODE, relevant_words

REF = os.environ.get("MMFAST_REFERENCE_NLTK_DATA", "")
pytestmark = pytest.mark.skipif(
    not REF,
    reason="MMFAST_REFERENCE_NLTK_DATA is not set: no NLTK data (tagger + WordNet) to compare the "
    "shipped CHAIR data with (.ci/run sets it to ../shared/nltk_data when that exists)",
)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chair"
RELEVANT = relevant_words()


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
    assert shipped.words == full.words, caption
    assert shipped.mentions == full.mentions, caption
    assert shipped.mention_idxs == full.mention_idxs, caption
    assert shipped == full, caption


def compare_captions(parsers: tuple[CaptionParser, CaptionParser], captions: list[str]) -> int:
    """Assert CHAIR identity on every caption (words, mentions, indices); return how many had any
    mention."""
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
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_chair_data.py"), "--nltk-data", REF, "--check"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _lemmatizer_probe_forms(wn: object) -> tuple[set[str], dict[str, set[str]]]:
    """Every WordNet lemma name (any POS), exception form and exception base (all POS), and per POS
    every one-rule inflection of every lemma name: each string whose lemma uses the shipped data."""
    rules = wn.MORPHOLOGICAL_SUBSTITUTIONS  # type: ignore[attr-defined]
    names = set(wn.all_lemma_names())  # type: ignore[attr-defined]
    exc = wn._exception_map  # type: ignore[attr-defined]
    common = names | {form for pos in POS for form in exc[pos]}
    common |= {base for pos in POS for bases in exc[pos].values() for base in bases}
    common |= {"", "s", "men", "ies", "xyzzies", "Dogs", "MICE", "is_", "a b"}  # odd strings too
    inflections = {
        pos: {name[: len(name) - len(new)] + old for name in names for old, new in rules[pos] if name.endswith(new)}
        for pos in POS
    }
    return common, inflections


def test_lemmatizer_is_nltks_on_all_of_wordnet(routes: tuple[ChairResources, ChairResources]) -> None:
    """The shipped lemmatiser equals NLTK's own ``WordNetLemmatizer().lemmatize`` (NLTK's code, on
    the reference WordNet) for every string in ``_lemmatizer_probe_forms``, in all four POS."""
    import nltk.corpus
    from nltk.stem import WordNetLemmatizer

    shipped, full = routes
    wn = full.wordnet
    reference = WordNetLemmatizer()
    common, inflections = _lemmatizer_probe_forms(wn)
    assert len(common) > 150_000
    checked = differs = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nltk.corpus, "wordnet", wn)  # WordNetLemmatizer reads nltk.corpus.wordnet: the reference's
        for pos in POS:
            for form in common | inflections[pos]:
                want = reference.lemmatize(form, pos)
                assert shipped.lemmatize(form, pos) == want, (form, pos)
                assert full.lemmatize(form, pos) == want, (form, pos)
                checked += 1
                differs += want != form
    assert checked > 1_000_000 and differs > 100_000  # not vacuous: many forms have another lemma
    assert shipped.lemmatize("is", "v") == "be" and shipped.lemmatize("women", "n") == "woman"


# --- captions ------------------------------------------------------------------------------------------


def test_fixture_results_identical(
    routes: tuple[ChairResources, ChairResources], parsers: tuple[CaptionParser, CaptionParser]
) -> None:
    instances = [FIXTURES / "instances_a.json", FIXTURES / "instances_b.json"]
    captions = FIXTURES / "captions.json"
    shipped = ChairEvaluator.from_coco(instances, captions, nltk_data=None)
    full = ChairEvaluator.from_coco(instances, captions, nltk_data=REF)
    assert shipped.parser.resources.route == "shipped" and full.parser.resources.route == "nltk"
    assert shipped.ground_truth == full.ground_truth
    a, b = (ev.evaluate_file(FIXTURES / "generated.jsonl") for ev in (shipped, full))
    assert a.as_dict() == b.as_dict()
    assert a == b  # every field of every caption, words included
    assert a.to_reference_dict() == b.to_reference_dict()
    texts = [c["caption"] for c in json.loads(captions.read_text())["annotations"]]
    texts += [json.loads(line)["caption"] for line in (FIXTURES / "generated.jsonl").read_text().splitlines()]
    compare_captions(parsers, texts)


def _sample_texts() -> list[str]:
    texts: set[str] = set()
    paths = sorted([*(REPO / "benchmarks").rglob("samples.jsonl"), *(REPO / "benchmarks").rglob("samples.jsonl.gz")])
    for path in paths:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        for line in raw.decode("utf-8").splitlines():
            rec = json.loads(line)
            texts.update(r for resps in rec.get("resps", []) for r in resps if isinstance(r, str))
            if isinstance(rec.get("prompt"), str):
                texts.add(rec["prompt"])
    return sorted(texts)


def test_committed_samples_identical(parsers: tuple[CaptionParser, CaptionParser]) -> None:
    texts = _sample_texts()
    if not texts:
        pytest.skip("no benchmarks/**/samples.jsonl(.gz) in this checkout")
    with_mentions = compare_captions(parsers, texts)
    assert with_mentions > 1000  # not vacuous: the model's captions mention objects


def _forms_into(relevant: set[str], exceptions: dict[str, list[str]], rules: list[tuple[str, str]]) -> set[str]:
    """Every form whose lemma (one POS) can be in ``relevant``: the words, the exception forms with
    a base among them, and their one-rule inflections (morphy applies one rule, no recursion)."""
    forms = set(relevant)
    forms.update(form for form, bases in exceptions.items() if relevant.intersection(bases))
    forms.update(r[: len(r) - len(new)] + old for r in relevant for old, new in rules if r.endswith(new))
    return forms


def _sweep_sentences(wn: object, n_random: int = 3000) -> list[str]:
    """Sentences that put every word CHAIR compares, every form that can lemmatize to one (one-rule
    inflections, WordNet exception forms), every exception form of any POS (forms whose lemma is
    another word: "is", "went", "mice"), every phrase (with inflected second words) and random
    WordNet words into varied syntactic frames, so the tagger gives them different parts of speech."""
    rng = random.Random(0)
    exc = {pos: wn._exception_map[pos] for pos in POS}  # type: ignore[attr-defined]
    rules = wn.MORPHOLOGICAL_SUBSTITUTIONS  # type: ignore[attr-defined]
    targets = set(RELEVANT)
    for pos in POS:
        targets |= _forms_into(set(RELEVANT), exc[pos], rules[pos])
    targets = {t for t in targets if t and t.strip() == t and " " not in t}
    others = {f for pos in POS for f in exc[pos] if " " not in f} - targets  # once each, not three times
    phrases = sorted(PHRASE_MAP) + sorted(w for w in SYNONYM_TO_NODE if " " in w.strip())
    names = sorted(n for n in wn.all_lemma_names() if "_" not in n)  # type: ignore[attr-defined]
    fillers = rng.sample(names, n_random)
    frames = [
        "a {w} next to the {x}.",
        "the {w} is {x} near a {y}.",
        "two {w} and a {x} on the {y}.",
        "they {w} the {x} while the {y} {z}.",
        "there are {w} {x} in the {y}.",
        "it {w} {x} quickly.",
        "is that a {w}? yes, the {x} is {y}!",
        "a very {w} {x} with {y} {z}.",
        "{w} {x} {y}.",
        "The {W} and the {X}, {y} and {z}.",
        "a man {w} a {x} beside the {y}; the {z} {w}.",
        "this is the {w}er {x} of the {y}.",
        "we saw {w} {x}s, {y}es and {z}ing {w}.",
        "{W}. {X}!",
        "the {w} {x} {y} {z} on the {w} of the {x}.",
    ]
    pool = sorted(targets) + fillers
    sentences = []
    for word in sorted(targets) + sorted(others):
        for frame in rng.sample(frames, 3 if word in targets else 1):
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


def test_generated_sweep_identical(
    routes: tuple[ChairResources, ChairResources], parsers: tuple[CaptionParser, CaptionParser]
) -> None:
    shipped, full = routes
    sentences = _sweep_sentences(full.wordnet)
    assert len(sentences) > 18_000
    with_mentions = compare_captions(parsers, sentences)
    assert with_mentions > 5_000
