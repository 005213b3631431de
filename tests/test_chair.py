"""CHAIR: vocabulary tables, offline tokenisation, caption parsing, ground truth, metrics, cache.

The expected tokens, mentions and metrics below were derived by hand (see the comments); the
fixture COCO files are in tests/fixtures/chair/.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmfast.errors import InputError
from mmfast.eval import chair as chair_mod
from mmfast.eval.chair import (
    CaptionParser,
    ChairEvaluator,
    ChairResources,
    NltkDataMissingError,
    ShippedDataError,
    coco_image_id,
    load_captions,
    load_chair_resources,
    load_nltk_resources,
    load_shipped_resources,
    sample_image_ids,
    split_sentences,
    tokenize_caption,
)
from mmfast.eval.chair_vocab import (
    COCO_CLASSES,
    COCO_SYNONYMS,
    PHRASE_MAP,
    PUNKT_ENGLISH_ABBREVIATIONS,
    SYNONYM_TO_NODE,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chair"
INSTANCES = [FIXTURES / "instances_a.json", FIXTURES / "instances_b.json"]
CAPTIONS = FIXTURES / "captions.json"
GENERATED = FIXTURES / "generated.jsonl"


@pytest.fixture(autouse=True, scope="module")
def _no_nltk_data() -> Iterator[None]:
    """These tests use the data shipped with mmfast (the default route), whatever the machine has;
    tests/test_chair_identity.py compares it with NLTK's data."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NLTK_DATA", raising=False)
        yield


@pytest.fixture(scope="module")
def parser() -> CaptionParser:
    return CaptionParser()


# --- vocabulary --------------------------------------------------------------------------------


def test_vocabulary_tables() -> None:
    assert len(COCO_SYNONYMS) == len(COCO_CLASSES) == 80
    assert COCO_CLASSES[0] == "person" and COCO_CLASSES[-1] == "toothbrush"
    assert len(SYNONYM_TO_NODE) == 403 and len(PHRASE_MAP) == 55
    assert set(SYNONYM_TO_NODE.values()) == set(COCO_CLASSES)
    for word, node in {
        "puppy": "dog",
        "people": "person",
        "table": "dining table",
        "monitor": "tv",
        "bow": "tie",
        "seat": "chair",
        "motorbike": "motorcycle",
        "doughnut": "donut",
        "teddybear": "teddy bear",
        "hot dog": "hot dog",
        "laptop computer": "laptop",
    }.items():
        assert SYNONYM_TO_NODE[word] == node
    # Reference quirks, reproduced: inert entries that never match a lower-cased token.
    assert SYNONYM_TO_NODE[" motor bike"] == "motorcycle" and "motor bike" not in SYNONYM_TO_NODE
    assert SYNONYM_TO_NODE[" cheesecake"] == "cake" and "cheesecake" not in SYNONYM_TO_NODE
    assert "iPhone" in SYNONYM_TO_NODE and "iphone" not in SYNONYM_TO_NODE
    assert "" not in SYNONYM_TO_NODE  # the reference's empty-line entry; cannot match a token
    assert PHRASE_MAP["bow tie"] == "tie" and PHRASE_MAP["toilet seat"] == "toilet"
    assert PHRASE_MAP["baby elephant"] == "elephant" and PHRASE_MAP["adult cub"] == "cub"
    assert PHRASE_MAP["passenger train"] == "train" and PHRASE_MAP["train track"] == "train track"
    assert PHRASE_MAP["motor bike"] == "motor bike" and PHRASE_MAP["wine glas"] == "wine glass"
    assert len(PUNKT_ENGLISH_ABBREVIATIONS) == 156
    assert {"mr", "dr", "st", "u.s"} <= PUNKT_ENGLISH_ABBREVIATIONS


# --- offline tokenisation ------------------------------------------------------------------------

# Expected tokens derived by hand for Punkt (sentence split) + Treebank (per sentence), on the
# lower-cased caption. Punkt breaks after a period-final token unless it is an abbreviation, an
# ellipsis, or a number/single letter followed by a lower-case word; Treebank splits a period only
# at the end of its input, so the split decides whether "horse." stays one token.
TOKEN_CASES = [
    (
        "A man is riding a horse. The horse is brown.",
        ["a", "man", "is", "riding", "a", "horse", ".", "the", "horse", "is", "brown", "."],
    ),
    (
        "There are two dogs on the couch.\n\nOne of them is sleeping.",
        ["there", "are", "two", "dogs", "on", "the", "couch", ".", "one", "of", "them", "is", "sleeping", "."],
    ),
    ("A cat, a dog and a bird", ["a", "cat", ",", "a", "dog", "and", "a", "bird"]),
    ("Is that a dog? Yes, it is!", ["is", "that", "a", "dog", "?", "yes", ",", "it", "is", "!"]),
    ("Mr. Smith rides a bike.", ["mr.", "smith", "rides", "a", "bike", "."]),
    ("The clock reads 10. The sky is blue.", ["the", "clock", "reads", "10.", "the", "sky", "is", "blue", "."]),
    ("A dog... A cat.", ["a", "dog", "...", "a", "cat", "."]),
    ("The man's hat isn't red.", ["the", "man", "'s", "hat", "is", "n't", "red", "."]),
    ("", []),
]


@pytest.mark.parametrize("caption,tokens", TOKEN_CASES)
def test_tokenize_caption_matches_punkt_plus_treebank(caption: str, tokens: list[str]) -> None:
    assert tokenize_caption(caption) == tokens


def test_sentence_split_is_needed() -> None:
    import nltk

    text = "a man is riding a horse. the horse is brown."
    assert split_sentences(text) == ["a man is riding a horse.", "the horse is brown."]
    # Without the split, Treebank keeps the inner period on the word, which would hide "horse".
    assert "horse." in nltk.word_tokenize(text, preserve_line=True)


def test_tokens_equal_real_punkt_when_installed() -> None:
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        pytest.skip("punkt_tab is not installed; the hand-derived fixtures above stand in for it")
    for caption, _ in TOKEN_CASES:
        assert tokenize_caption(caption) == nltk.word_tokenize(caption.lower())


# --- caption parsing ------------------------------------------------------------------------------

PARSE_CASES = [
    # caption, merged words (lemmas), mentions (word, node)
    ("Two puppies chase the dogs.", ["two", "puppy", "chase", "the", "dog", "."], [("puppy", "dog"), ("dog", "dog")]),
    (
        "A hot dog next to a teddy bear.",
        ["a", "hot dog", "next", "to", "a", "teddy bear", "."],
        [("hot dog", "hot dog"), ("teddy bear", "teddy bear")],
    ),
    (
        "A baby elephant and a passenger train.",
        ["a", "elephant", "and", "a", "train", "."],
        [("elephant", "elephant"), ("train", "train")],
    ),
    ("A toilet seat.", ["a", "toilet", "."], [("toilet", "toilet")]),
    ("The seat of the toilet.", ["the", "seat", "of", "the", "toilet", "."], [("toilet", "toilet")]),
    ("A chair with a seat.", ["a", "chair", "with", "a", "seat", "."], [("chair", "chair"), ("seat", "chair")]),
    ("A bow tie.", ["a", "tie", "."], [("tie", "tie")]),
    (
        "A cheesecake on the stove top oven.",
        ["a", "cheesecake", "on", "the", "stove", "top", "oven", "."],
        [("stove", "oven"), ("oven", "oven")],
    ),
    ("Train tracks and a motor bike.", ["train track", "and", "a", "motor bike", "."], []),
    # Every token is lemmatised as NLTK's WordNetLemmatizer does, not only those CHAIR compares.
    ("The sky is blue.", ["the", "sky", "be", "blue", "."], []),
    ("The women were running.", ["the", "woman", "be", "run", "."], [("woman", "person")]),
    (
        "Hair driers, toilet seats and mice.",
        ["hair drier", ",", "toilet", "and", "mouse", "."],
        [("hair drier", "hair drier"), ("toilet", "toilet"), ("mouse", "mouse")],
    ),
]


@pytest.mark.parametrize("caption,words,mentions", PARSE_CASES)
def test_parse_rules(parser: CaptionParser, caption: str, words: list[str], mentions: list[tuple[str, str]]) -> None:
    got = parser.parse(caption)
    assert list(got.words) == words
    assert list(got.mentions) == mentions


# --- ground truth and metrics on the fixture --------------------------------------------------------

# Ground truth = instances + reference-caption objects:
#   101 instances dog, person, frisbee; caption "A man walks his dog..." -> {dog, frisbee, person}
#   102 elephant; 103 toilet, sink; 104 train, person ("A passenger train" adds train only);
#   105 teddy bear + caption "A teddy bear on a bed." -> {bed, teddy bear}; 106 nothing -> {}.
EXPECTED_GT = {
    101: {"dog", "frisbee", "person"},
    102: {"elephant"},
    103: {"sink", "toilet"},
    104: {"person", "train"},
    105: {"bed", "teddy bear"},
    106: set(),
}

# Generated captions (generated.jsonl), counted by hand:
#   101 "A puppy and two dogs play with a man. The dogs chase a cat."  16 tokens;
#       mentions puppy,dog,man,dog,cat (5); hallucinated cat (1); recalled {dog, person} of 3
#   103 "The toilet seat is up and a hot dog is on the sink."  12 tokens ("toilet seat" -> toilet);
#       mentions toilet, hot dog, sink (3); hallucinated hot dog (1); recalled 2 of 2
#   102 "A baby elephant walks with a passenger train behind it."  9 tokens;
#       mentions elephant, train (2); hallucinated train (1); recalled 1 of 1
#   105 "Two teddy bears sit on a bed. A teddy bear is on the bed."  14 tokens;
#       mentions teddy bear, bed, teddy bear, bed (4, repeats count); hallucinated 0; recalled 2 of 2
#   106 "A view of the blue sky."  7 tokens; no mentions; recalled 0 of 0
#   104 "A woman and a child stand near the train and a motor bike."  13 tokens ("motor bike" is
#       inert); mentions woman, child, train (3); hallucinated 0; recalled 2 of 2
# CHAIR_s = 3/6, CHAIR_i = 3/17, recall = 9/10, len = 71/6.
EXPECTED_METRICS = {"chair_s": 0.5, "chair_i": 3 / 17, "recall": 0.9, "len": 71 / 6, "n": 6}


@pytest.fixture(scope="module")
def evaluator() -> ChairEvaluator:
    return ChairEvaluator.from_coco(INSTANCES, CAPTIONS)


def test_ground_truth_from_instances_and_captions(evaluator: ChairEvaluator) -> None:
    assert {k: set(v) for k, v in evaluator.ground_truth.items()} == EXPECTED_GT


def test_chair_metrics_hand_counted(evaluator: ChairEvaluator) -> None:
    result = evaluator.evaluate_file(GENERATED)
    got = result.as_dict()
    assert set(got) == {"chair_s", "chair_i", "recall", "len", "n"}
    for key, want in EXPECTED_METRICS.items():
        assert math.isclose(got[key], want), (key, got[key], want)
    assert (result.n_mentions, result.n_hallucinated, result.n_hallucinated_captions) == (17, 3, 3)
    assert (result.n_recalled, result.n_gt_objects, result.n_words) == (9, 10, 71)
    first = result.captions[0]
    assert first.mentions == (("puppy", "dog"), ("dog", "dog"), ("man", "person"), ("dog", "dog"), ("cat", "cat"))
    assert first.hallucinated == (("cat", "cat"),) and first.hallucination_idxs == (14,)
    assert first.recalled == ("dog", "person") and first.len == 16
    assert math.isclose(first.chair_i, 1 / 5) and math.isclose(first.recall, 2 / 3)
    ref = result.to_reference_dict()
    assert math.isclose(ref["overall_metrics"]["Len"], 0.01 * 71 / 6)
    assert ref["sentences"][1]["mscoco_hallucinated_words"] == [["hot dog", "hot dog"]]
    assert [len(c.words) for c in result.captions] == [16, 12, 9, 14, 7, 13]


def test_evaluate_in_memory_and_missing_images(evaluator: ChairEvaluator) -> None:
    caps = [{"id": "COCO_val2014_000000000102.jpg", "text": "An elephant."}]
    r = evaluator.evaluate(caps, image_id_key="id", caption_key="text")
    assert r.as_dict() == {"chair_s": 0.0, "chair_i": 0.0, "recall": 1.0, "len": 3.0, "n": 1}
    with pytest.raises(InputError, match="no CHAIR ground truth"):
        evaluator.evaluate([{"image_id": 999, "caption": "A dog."}])
    # missing="empty" is the reference's behaviour: no ground truth, so every mention is hallucinated.
    r = evaluator.evaluate([{"image_id": 999, "caption": "A dog."}], missing="empty")
    assert r.chair_s == 1.0 and r.recall == 0.0 and any("recall undefined" in n for n in r.notes)


def test_empty_input_reports_zero_with_notes(evaluator: ChairEvaluator) -> None:
    r = evaluator.evaluate([])
    assert r.as_dict() == {"chair_s": 0.0, "chair_i": 0.0, "recall": 0.0, "len": 0.0, "n": 0}
    assert r.notes


def test_load_captions_json_and_jsonl(tmp_path: Path) -> None:
    jsonl = load_captions(GENERATED)
    array = tmp_path / "caps.json"
    array.write_text(json.dumps([{"img": str(c["image_id"]), "cap": c["caption"]} for c in jsonl]))
    assert load_captions(array, image_id_key="img", caption_key="cap") == jsonl
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"image_id": 1, "caption": "a"}\n{"image_id": 2}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:2: missing key 'caption'"):
        load_captions(bad)


@pytest.mark.parametrize(
    "instances,captions,message",
    [
        ({"images": [{"id": "abc"}], "annotations": []}, [], r"inst\.json: images\[0\]\.id: must be an integer id"),
        # int(1.7) filed the dog under image 1; a non-digit string crashed with a bare ValueError
        ({"images": [], "annotations": [{"image_id": 1.7, "category_id": 18}]}, [], r"annotations\[0\]\.image_id"),
        ({"images": [], "annotations": [{"image_id": "x1", "category_id": 18}]}, [], r"annotations\[0\]\.image_id"),
        (
            {"images": [], "annotations": []},
            [{"image_id": 1, "caption": None}],
            r"caps\.json: annotations\[0\]\.caption",
        ),
    ],
)
def test_bad_coco_ids_and_captions_name_the_file(tmp_path: Path, instances: dict, captions: list, message: str) -> None:
    inst, caps = tmp_path / "inst.json", tmp_path / "caps.json"
    inst.write_text(json.dumps({"categories": [{"id": 18, "name": "dog"}], **instances}))
    caps.write_text(json.dumps({"images": [], "annotations": captions}))
    with pytest.raises(InputError, match=message):
        ChairEvaluator.from_coco(inst, caps)


def test_load_captions_keeps_unicode_line_separators(tmp_path: Path) -> None:
    # a caption may hold U+2028 / U+0085 raw in valid JSON Lines; str.splitlines cut the line there
    path = tmp_path / "caps.jsonl"
    rows = [{"image_id": 1, "caption": "A dog.\u2028A cat."}, {"image_id": 2, "caption": "A cup\x85"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert load_captions(path) == rows


def test_coco_image_id() -> None:
    assert coco_image_id(42) == 42 and coco_image_id("42") == 42
    assert coco_image_id("COCO_val2014_000000391895.jpg") == 391895
    assert coco_image_id("/data/val2014/COCO_val2014_000000000042.jpg") == 42
    with pytest.raises(ValueError):
        coco_image_id("dog.jpg")
    with pytest.raises(ValueError):
        coco_image_id(True)


# --- JSON cache ---------------------------------------------------------------------------------------


def test_json_cache_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first = ChairEvaluator.from_coco(INSTANCES, CAPTIONS, cache_dir=tmp_path)
    files = list(tmp_path.glob("chair_gt_*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())  # plain JSON, not a pickle
    assert data["images"]["101"] == ["dog", "frisbee", "person"]
    shas = {d["sha256"] for d in data["provenance"]["instances"]}
    assert shas == {chair_mod.file_sha256(p) for p in INSTANCES}

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("ground truth was rebuilt instead of read from the cache")

    monkeypatch.setattr(ChairEvaluator, "_build", no_build)
    with caplog.at_level(logging.INFO, logger="mmfast.eval.chair"):
        second = ChairEvaluator.from_coco(list(reversed(INSTANCES)), [CAPTIONS], cache_dir=tmp_path)
    assert "loaded from cache" in caplog.text
    assert second.ground_truth == first.ground_truth
    assert second.evaluate_file(GENERATED).as_dict() == first.evaluate_file(GENERATED).as_dict()

    saved = tmp_path / "gt.json"
    first.save_json(saved)
    assert ChairEvaluator.load_json(saved).ground_truth == first.ground_truth
    (tmp_path / "other.json").write_text('{"images": {}}')
    with pytest.raises(InputError, match="not an mmfast CHAIR ground-truth file"):
        ChairEvaluator.load_json(tmp_path / "other.json")


def test_cache_key_changes_with_inputs(tmp_path: Path) -> None:
    ChairEvaluator.from_coco(INSTANCES, CAPTIONS, cache_dir=tmp_path)
    ChairEvaluator.from_coco(INSTANCES[:1], CAPTIONS, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("chair_gt_*.json"))) == 2


def test_cache_key_changes_with_the_language_data_route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ChairEvaluator.from_coco(INSTANCES, CAPTIONS, cache_dir=tmp_path)
    shipped = load_shipped_resources()
    provenance = {**shipped.provenance, "route": "nltk", "lemmas": "WordNetLemmatizer (all of WordNet)"}
    other = ChairResources(shipped.tagger, shipped.lemmatize, "nltk", provenance)
    monkeypatch.setattr(chair_mod, "load_chair_resources", lambda nltk_data=None: other)
    ev = ChairEvaluator.from_coco(INSTANCES, CAPTIONS, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("chair_gt_*.json"))) == 2
    assert ev.provenance["language_data"]["route"] == "nltk"


# --- language data: shipped by default, NLTK data when asked for ------------------------------------------


def test_shipped_data_is_the_default_and_needs_no_nltk_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nothing")])
    res = load_chair_resources()
    assert res.route == "shipped" and res is load_shipped_resources()
    assert res.provenance["wordnet_version"] == "3.0"
    assert set(res.provenance["tagger_sha256"]) == {"weights", "tagdict", "classes"}
    assert res.lemmatize("mice", "n") == "mouse" and res.lemmatize("driers", "n") == "drier"
    assert res.lemmatize("drier", "a") == "dry"  # "hair drier" as an adjective is no phrase (as NLTK)
    assert res.lemmatize("is", "v") == "be" and res.lemmatize("geese", "n") == "goose"
    assert res.lemmatize("quickly", "r") == "quickly" and res.lemmatize("hardest", "r") == "hard"
    assert res.lemmatize("best", "r") == "best"  # itself an adverb, as short as its base "well": first wins
    assert res.lemmatize("xyzzies", "n") == "xyzzies"  # no lemma: the form itself
    assert [t for _, t in res.tagger.tag(["a", "dog", "runs", "."])] == ["DT", "NN", "VBZ", "."]
    # $NLTK_DATA without the tagger and WordNet is not an error: the shipped data is used.
    monkeypatch.setenv("NLTK_DATA", str(tmp_path))
    assert load_chair_resources().route == "shipped"


def test_missing_nltk_data_error_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nltk

    monkeypatch.setenv("NLTK_DATA", str(tmp_path))
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nothing")])
    with pytest.raises(NltkDataMissingError) as info:
        load_nltk_resources()
    msg = str(info.value)
    assert "NLTK_DATA" in msg and "../shared" not in msg
    assert "python -m nltk.downloader averaged_perceptron_tagger_eng wordnet" in msg
    assert "averaged_perceptron_tagger_eng" in msg and "wordnet" in msg and "shipped" in msg
    assert isinstance(info.value, LookupError)
    # NLTK data asked for explicitly must be there: the evaluator fails once it parses captions.
    ev = ChairEvaluator({1: ["dog"]}, nltk_data=tmp_path)
    with pytest.raises(NltkDataMissingError):
        ev.evaluate([{"image_id": 1, "caption": "A dog."}])
    # Without the request it uses the shipped data.
    assert ChairEvaluator({1: ["dog"]}).evaluate([{"image_id": 1, "caption": "A dog."}]).chair_i == 0.0


def test_shipped_data_errors_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gzip
    import shutil

    copy = tmp_path / "chair"
    shutil.copytree(chair_mod.SHIPPED_DATA, copy)
    morphy = copy / "wordnet_morphy.json.gz"
    doc = json.loads(gzip.decompress(morphy.read_bytes()))
    monkeypatch.setattr(chair_mod, "SHIPPED_DATA", copy)
    morphy.write_bytes(gzip.compress(json.dumps({**doc, "version": 0}).encode()))
    with pytest.raises(ShippedDataError, match="not an mmfast WordNet morphy table"):
        load_shipped_resources.__wrapped__()
    morphy.write_bytes(gzip.compress(json.dumps({k: v for k, v in doc.items() if k != "lemma_names"}).encode()))
    with pytest.raises(ShippedDataError, match="malformed"):
        load_shipped_resources.__wrapped__()
    morphy.write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert load_shipped_resources.__wrapped__().lemmatize("mice", "n") == "mouse"
    (copy / "averaged_perceptron_tagger_eng.classes.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ShippedDataError, match="cannot be read"):
        load_shipped_resources.__wrapped__()


def test_morphy_rules_on_a_toy_wordnet() -> None:
    """chair_morphy follows NLTK's _morphy: an exception form uses only its bases (no rules, even
    when none is a lemma); otherwise one pass of the rules; the form itself is a candidate first;
    the first shortest lemma wins; no lemma -> the form."""
    from mmfast.eval.chair_morphy import FORMAT, MorphyLemmatizer

    doc = {
        "format": FORMAT,
        "version": 1,
        "rules": {"n": [["s", ""], ["ses", "s"], ["men", "man"]], "v": [["ing", ""], ["ing", "e"]], "a": [], "r": []},
        "exceptions": {"n": {"oxen": ["ox"], "dices": ["dix"], "lens": []}, "v": {}, "a": {}, "r": {}},
        "lemma_names": {
            "n": ["ox", "dice", "bus", "buse", "len", "lens", "women", "woman", "cat"],
            "v": ["sing", "singe", "bake"],
            "a": [],
            "r": [],
        },
    }
    lem = MorphyLemmatizer.from_doc(doc)
    assert lem.lemmatize("oxen", "n") == "ox"
    assert lem.morphy("dices", "n") == [] and lem.lemmatize("dices", "n") == "dices"  # no rule fallback
    assert lem.morphy("lens", "n") == ["lens"]  # an exception form that is itself a lemma
    assert lem.morphy("buses", "n") == ["buse", "bus"] and lem.lemmatize("buses", "n") == "bus"
    assert lem.lemmatize("women", "n") == "women"  # itself a lemma, "woman" no shorter: first wins
    assert lem.lemmatize("cats", "n") == "cat" and lem.lemmatize("cat", "n") == "cat"
    assert lem.morphy("singing", "v") == ["sing", "singe"] and lem.lemmatize("singing", "v") == "sing"
    assert lem.lemmatize("baking", "v") == "bake" and lem.lemmatize("Cats", "n") == "Cats"  # no lower-casing
    with pytest.raises(ValueError, match="POS"):
        lem.lemmatize("cats", "s")
    with pytest.raises(ValueError):
        MorphyLemmatizer.from_doc({**doc, "rules": {**doc["rules"], "a": [["", "x"]]}})


def test_build_script_keeps_the_names_morphy_can_consult() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_chair_data", REPO / "scripts" / "build_chair_data.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    names = ["quickly", "well", "better", "ox", "woman", "axman"]
    assert script.consultable_names(names, {}, [("s", "")]) == sorted(names)  # every name + "s"
    assert script.consultable_names(names, {"best": ["well"], "better": ["well"]}, []) == ["better", "well"]
    # "axman" only as its own form, but a same-length rule can make it lose or win
    assert script.consultable_names(names, {}, [("man", "men")]) == ["axman", "woman"]
    assert script.consultable_names(names, {}, [("xes", "x")]) == ["ox"]


def test_shipped_route_serves_any_vocabulary() -> None:
    # The shipped lemmatiser is all of WordNet's (not a table cut to the reference vocabulary).
    parsed = CaptionParser(synonyms={**SYNONYM_TO_NODE, "gnu": "cow"}).parse("Two gnus are grazing.")
    assert parsed.mentions == (("gnu", "cow"),) and parsed.words == ("two", "gnu", "be", "graze", ".")


def test_product_names_no_data_outside_the_package() -> None:
    # CHAIR must not find the reference NLTK data by itself (tests/test_chair_identity.py loads it
    # explicitly) nor name this repository's neighbour folders.
    for path in (REPO / "mmfast").rglob("*"):
        if path.suffix in (".py", ".md", ".txt", ".yaml"):
            text = path.read_text(encoding="utf-8")
            assert "MMFAST_REFERENCE_NLTK_DATA" not in text and "../shared" not in text, path


def test_search_order_env_then_argument_then_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import nltk

    monkeypatch.setenv("NLTK_DATA", os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "d"), str(tmp_path / "a")])
    paths = chair_mod.nltk_search_paths(tmp_path / "c")
    assert paths == [str(tmp_path / x) for x in ("a", "b", "c", "d")]


# --- image sampling -----------------------------------------------------------------------------------------


def test_sample_image_ids_is_portable(tmp_path: Path) -> None:
    names = [f"COCO_val2014_{i:012d}.jpg" for i in (5, 3, 42, 7, 11, 2)]
    for name in reversed(names):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "README.txt").write_text("not an image")
    from_dir = sample_image_ids(tmp_path, 4, seed=0)
    from_ids = sample_image_ids([42, 7, 11, 2, 5, 3], 4, seed=0)
    import random

    pool = [2, 3, 5, 7, 11, 42]
    random.Random(0).shuffle(pool)
    assert from_dir == from_ids == pool[:4]
    with pytest.raises(ValueError, match="cannot draw"):
        sample_image_ids([1, 2], 3, seed=0)


def test_describe_records_the_protocol(evaluator: ChairEvaluator) -> None:
    info = evaluator.describe()
    assert info["wordnet_version"] == "3.0" and info["pipeline_version"] == chair_mod.PIPELINE_VERSION
    assert info["language_data"]["route"] == "shipped" and "table_sha256" in info["language_data"]["lemmas"]
    json.dumps(info)


def test_chair_task_refuses_one_image_id_under_two_file_names(tmp_path: Path) -> None:
    """An image folder holding one image id twice (the 2014 and the 2017 name): which file is meant is refused,
    naming both, not one of them kept silently (a file named by no image id is left out with a warning:
    ``test_bad_inputs.py::test_chair_image_dir_with_files_not_named_by_an_image_id``)."""
    from mmfast.config import load_recipe
    from mmfast.eval.data import EvalData
    from mmfast.eval.tasks.chair import ChairTask

    images = tmp_path / "images"
    images.mkdir()
    for i in (101, 102):
        (images / f"COCO_val2014_{i:012d}.jpg").write_bytes(b"")
    cfg = load_recipe({"eval": {"tasks": ["chair"], "chair": {"n_images": 2}}}).eval
    data = EvalData("coco", tmp_path, images, tuple(INSTANCES), (CAPTIONS,))
    assert sorted(ChairTask(cfg, data).image_ids) == [101, 102]
    (images / f"{101:012d}.jpg").write_bytes(b"")  # the same id under the 2017 name: which file is meant?
    with pytest.raises(InputError, match=r"holds image 101 twice \(000000000101\.jpg and COCO_val2014_000000000101"):
        ChairTask(cfg, data)


def test_chair_task_refuses_images_without_ground_truth_before_generating(tmp_path: Path) -> None:
    """CHAIR scores with ``missing="error"``: an image of the sample with no ground truth in the annotation
    files would only fail the run at scoring time, after every caption was generated; the task refuses
    it when it is built, naming the ids and the fix."""
    from mmfast.config import load_recipe
    from mmfast.eval.data import EvalData
    from mmfast.eval.tasks.chair import ChairTask

    images = tmp_path / "images"
    images.mkdir()
    for i in (101, 102, 7):  # 7: in no annotation file
        (images / f"COCO_val2014_{i:012d}.jpg").write_bytes(b"")
    cfg = load_recipe({"eval": {"tasks": ["chair"], "chair": {"n_images": 3}}}).eval
    data = EvalData("coco", tmp_path, images, tuple(INSTANCES), (CAPTIONS,))
    with pytest.raises(InputError, match=r"1 of the 3 CHAIR images have no ground truth.*\[7\]"):
        ChairTask(cfg, data)
    (images / "COCO_val2014_000000000007.jpg").unlink()
    task = ChairTask(cfg, data)
    recs = [{"target": i, "resps": [["A dog on a couch."]]} for i in task.image_ids]
    assert task.metrics({"chair": recs})["n"] == 2


def test_chair_task_names_an_image_folder_without_images(tmp_path: Path) -> None:
    """An image folder with no image files (val2014.zip unpacked one level too deep: val2014/val2014/) is an
    InputError naming the folder, not "cannot draw 0 images from a pool of 0" from inside the sampler."""
    from mmfast.config import load_recipe
    from mmfast.eval.data import EvalData
    from mmfast.eval.tasks.chair import ChairTask

    images = tmp_path / "val2014"
    (images / "val2014").mkdir(parents=True)
    (images / "val2014" / "COCO_val2014_000000000101.jpg").write_bytes(b"")
    cfg = load_recipe({"eval": {"tasks": ["chair"]}}).eval
    data = EvalData("coco", tmp_path, images, tuple(INSTANCES), (CAPTIONS,))
    with pytest.raises(InputError, match=r"val2014 holds no COCO image"):
        ChairTask(cfg, data)


@pytest.mark.parametrize(
    "captions_bytes, message",
    [
        (b'[{"image_id": 1, "caption": "a dog"}]', r"caps\.json: a JSON list, not a COCO annotation file"),
        (b'"hello"', r"caps\.json: a JSON str, not a COCO annotation file"),
        ('{"images": [], "annotations": [{"image_id": 1, "caption": "a caf\u00e9"}]}'.encode("latin-1"), "not UTF-8"),
    ],
)
def test_coco_files_that_are_not_annotation_objects(tmp_path: Path, captions_bytes: bytes, message: str) -> None:
    """A captions path naming a generated-captions array (or a non-UTF-8 file) crashed with AttributeError
    ('list' object has no attribute 'get') or UnicodeDecodeError instead of naming the file."""
    inst, caps = tmp_path / "inst.json", tmp_path / "caps.json"
    inst.write_text(json.dumps({"categories": [{"id": 18, "name": "dog"}], "images": [], "annotations": []}))
    caps.write_bytes(captions_bytes)
    with pytest.raises(InputError, match=message):
        ChairEvaluator.from_coco(inst, caps)


def test_coco_files_with_a_byte_order_mark(tmp_path: Path) -> None:
    """A UTF-8 BOM (as Windows editors save) was 'invalid JSON'; the POPE and caption readers accept it."""
    inst, caps = tmp_path / "inst.json", tmp_path / "caps.json"
    instances = {"categories": [{"id": 18, "name": "dog"}], "annotations": [{"image_id": 1, "category_id": 18}]}
    inst.write_bytes(b"\xef\xbb\xbf" + json.dumps(instances).encode())
    caps.write_bytes(b"\xef\xbb\xbf" + json.dumps({"annotations": [{"image_id": 1, "caption": "A cat."}]}).encode())
    assert ChairEvaluator.from_coco(inst, caps).ground_truth == {1: frozenset({"dog", "cat"})}
