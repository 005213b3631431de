"""POPE: file loading, version identification, the four answer parsers and the metrics.

Every expected number below was counted by hand from the fixture files in tests/fixtures/pope/.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from mmfast.eval.pope import (
    KNOWN_POPE_FILES,
    PARSER_MODES,
    PopeCounts,
    PopeFormatError,
    PopeRecord,
    UnknownPopeFileError,
    identify_pope_file,
    join_answers,
    load_pope_answers,
    load_pope_questions,
    metrics_from_counts,
    parse_answer,
    pope_file_info,
    score_pope,
    score_pope_files,
    summarize_pope,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pope"
QUESTIONS = FIXTURES / "questions.jsonl"
QUESTIONS_ARRAY = FIXTURES / "questions_array.json"
ANSWERS = FIXTURES / "answers.jsonl"


# --- answer parsers --------------------------------------------------------------------------

# (answer, pope, opera, lmms); each cell is (pred, unknown). Derived by hand from the rules:
# pope: first sentence, drop ",", split on " ", no if a token is No/not/no;
# opera: drop "." and ",", no if a token is No/no/NO/not or ends with "n't";
# lmms: exact "yes"/"no" after lower().strip(), else unscored.
PARSER_CASES = [
    ("No, there is not.", ("no", False), ("no", False), (None, True)),
    ("Yes.", ("yes", False), ("yes", False), (None, True)),
    ("There isn't a dog.", ("yes", True), ("no", False), (None, True)),
    ("I don't know", ("yes", True), ("no", False), (None, True)),
    ("", ("yes", True), ("yes", True), (None, True)),
    ("nothing", ("yes", True), ("yes", True), (None, True)),
    ("Yes. No.", ("yes", False), ("no", False), (None, True)),
    ("No. Yes.", ("no", False), ("no", False), (None, True)),
    ("No!", ("yes", True), ("yes", True), (None, True)),
    ("NO", ("yes", True), ("no", False), ("no", False)),
    (" Yes \n", ("yes", False), ("yes", False), ("yes", False)),
    ("no", ("no", False), ("no", False), ("no", False)),
    ("Yes, there is a dog in the image.", ("yes", False), ("yes", False), (None, True)),
    ("Yes, but it is not clear", ("no", False), ("no", False), (None, True)),
]


@pytest.mark.parametrize("answer,pope,opera,lmms", PARSER_CASES)
def test_parser_modes(answer: str, pope: tuple, opera: tuple, lmms: tuple) -> None:
    for mode, expected in (("pope", pope), ("opera", opera), ("lmms", lmms)):
        got = parse_answer(answer, mode)
        assert (got.pred, got.unknown) == expected, (mode, answer)


# VCD/DAMRO: substring rule that depends on the label: (answer, pred if label yes, pred if label no, unknown)
VCD_CASES = [
    ("No, there is not.", "no", "no", False),
    ("Yes.", "yes", "yes", False),  # a no-label "Yes." has no substring "no": FP
    ("There isn't a dog.", "no", "yes", True),
    ("I don't know", "no", "no", False),  # "know" contains "no"
    ("", "no", "yes", True),
    ("nothing", "no", "no", False),
    ("Yes. No.", "yes", "no", False),
    ("snow", "no", "no", False),
]


@pytest.mark.parametrize("answer,if_yes,if_no,unknown", VCD_CASES)
def test_vcd_parser_is_label_dependent(answer: str, if_yes: str, if_no: str, unknown: bool) -> None:
    assert parse_answer(answer, "vcd", label="yes").pred == if_yes
    assert parse_answer(answer, "vcd", label="no").pred == if_no
    assert parse_answer(answer, "vcd", label="yes").unknown is unknown


def test_parser_errors() -> None:
    with pytest.raises(ValueError, match="needs label"):
        parse_answer("yes", "vcd")
    with pytest.raises(ValueError, match="unknown POPE parser mode"):
        parse_answer("yes", "llava")  # type: ignore[arg-type]
    assert PARSER_MODES == ("pope", "opera", "vcd", "lmms")


# --- metrics on the fixture ------------------------------------------------------------------

# Fixture: 10 questions (4 yes, 6 no). Answers and the pope-mode cell of each:
#  1 yes "Yes, there is a dog."  TP     6 yes "No."            FN
#  2 no  "No, there is not."     TN     7 no  "No"             TN
#  3 yes "Yes."                  TP     8 yes "yes"            TP
#  4 no  "Yes."                  FP     9 no  "I don't know"   FP (unknown)
#  5 no  "There isn't a cat."    FP (unknown)    10 no "no."   TN
EXPECTED = {
    # mode: (tp, fp, tn, fn, n_unknown, n_unscored, accuracy, precision, recall, f1, yes_ratio)
    "pope": (3, 3, 3, 1, 2, 0, 0.6, 0.5, 0.75, 0.6, 0.6),
    "opera": (3, 1, 5, 1, 0, 0, 0.8, 0.75, 0.75, 0.75, 0.4),
    "vcd": (3, 2, 4, 1, 1, 0, 0.7, 0.6, 0.75, 2 * 0.6 * 0.75 / 1.35, 0.5),
    "lmms": (1, 0, 1, 0, 8, 8, 0.2, 1.0, 1.0, 1.0, 0.1),
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_metrics_hand_counted(mode: str) -> None:
    m = score_pope_files(QUESTIONS, ANSWERS, mode)  # type: ignore[arg-type]
    tp, fp, tn, fn, n_unknown, n_unscored, acc, prec, rec, f1, yes_ratio = EXPECTED[mode]
    assert m.counts == PopeCounts(tp, fp, tn, fn, n_unknown, n_unscored)
    assert m.n == 10
    for got, want in ((m.accuracy, acc), (m.precision, prec), (m.recall, rec), (m.f1, f1), (m.yes_ratio, yes_ratio)):
        assert math.isclose(got, want), (mode, got, want)
    assert len(m.unknown_ids) == n_unknown


def test_yes_ratio_comes_from_predictions_not_labels() -> None:
    m = score_pope_files(QUESTIONS, ANSWERS, "pope")
    labels_yes = sum(q.label == "yes" for q in load_pope_questions(QUESTIONS)) / 10
    assert labels_yes == 0.4 and m.yes_ratio == 0.6
    assert m.unknown_ids == (5, 9)
    assert any("2 of 10 answers had no yes/no word" in n for n in m.notes)


def test_zero_division_is_reported_as_zero_with_note() -> None:
    m = score_pope([PopeRecord(1, "yes", "No"), PopeRecord(2, "no", "no")])
    assert (m.precision, m.recall, m.f1) == (0.0, 0.0, 0.0)
    assert any(n.startswith("precision undefined") for n in m.notes)
    empty = metrics_from_counts(PopeCounts())
    assert empty.n == 0 and empty.accuracy == 0.0 and any("no records" in n for n in empty.notes)


def test_score_accepts_mappings_and_rejects_bad_labels() -> None:
    m = score_pope([{"label": "yes", "answer": "Yes"}, {"label": "no", "answer": "No"}])
    assert m.accuracy == 1.0
    with pytest.raises(PopeFormatError, match="bad label"):
        score_pope([{"label": "maybe", "answer": "Yes"}])


def test_summarize_pope_layout_and_means() -> None:
    per_split = {
        "random": score_pope_files(QUESTIONS, ANSWERS),
        "popular": score_pope([PopeRecord(1, "yes", "Yes"), PopeRecord(2, "no", "No")]),
    }
    out = summarize_pope(per_split)
    assert set(out) == {"random", "popular", "mean_f1", "mean_accuracy"}
    assert {"accuracy", "precision", "recall", "f1", "yes_ratio", "n"} <= set(out["random"])
    assert math.isclose(out["mean_f1"], (0.6 + 1.0) / 2)
    assert math.isclose(out["mean_accuracy"], (0.6 + 1.0) / 2)
    json.dumps(out)  # plain JSON types only
    with pytest.raises(ValueError, match="different parser modes"):
        summarize_pope({"a": per_split["random"], "b": score_pope([PopeRecord(1, "yes", "Yes")], "lmms")})


# --- loading -----------------------------------------------------------------------------------


def test_jsonl_and_json_array_load_identically() -> None:
    a = load_pope_questions(QUESTIONS)
    b = load_pope_questions(QUESTIONS_ARRAY)
    assert a == b and len(a) == 10
    assert a[0].question_id == 1 and a[0].label == "yes" and a[0].image == "COCO_val2014_000000000100.jpg"
    assert a[0].text == "Is there a dog in the image?" and a[0].image_id is None


def test_answers_join_by_question_id() -> None:
    qs = load_pope_questions(QUESTIONS)
    answers = load_pope_answers(ANSWERS)
    records = join_answers(qs, answers)
    assert [r.question_id for r in records] == list(range(1, 11))
    with pytest.raises(PopeFormatError, match="have no answer"):
        join_answers(qs, {1: "yes"})
    # ids match as the question loader reads them (1 and "1" are one doc id): string answer ids join int questions
    assert join_answers(qs, {str(k): v for k, v in answers.items()}) == records
    with pytest.raises(PopeFormatError, match="answer ids 1 and '1' name one question"):
        join_answers(qs, {**answers, "1": "no"})


def test_a_join_failure_names_both_files(tmp_path: Path) -> None:
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"question_id": 1, "text": "Yes"}\n')
    with pytest.raises(PopeFormatError, match=r"answers\.jsonl against .*: 9 question\(s\) have no answer"):
        score_pope_files(QUESTIONS, answers)


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"question_id": 1, "image": "a.jpg", "label": "yes"}', r"bad\.jsonl:2: missing key\(s\) \['text'\]"),
        ('{"question_id": 1, "image": "a.jpg", "text": "q", "label": "maybe"}', r"bad\.jsonl:2: bad label 'maybe'"),
        ('{"question_id": 0, "image": "a.jpg", "text": "q", "label": "no"}', r"bad\.jsonl:2: duplicate question_id 0"),
        # the same id as a string is the same sample (doc_id pope_<split>/0): named here, not as a planning clash
        ('{"question_id": "0", "image": "a.jpg", "text": "q", "label": "no"}', r"bad\.jsonl:2: duplicate question_id"),
        ('{"question_id": 1, "image": "a.jpg", "text": "q", "label": "yes"', r"bad\.jsonl:2: invalid JSON"),
        ("[1, 2]", r"bad\.jsonl:2: expected a JSON object"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    good = '{"question_id": 0, "image": "a.jpg", "text": "q", "label": "no"}'
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(PopeFormatError, match=message):
        load_pope_questions(path)


@pytest.mark.parametrize("qid", ["[2]", '{"a": 2}', "true", "2.0"])
def test_answer_ids_of_a_wrong_type_name_file_and_line(tmp_path: Path, qid: str) -> None:
    # an unhashable id crashed with a bare TypeError; a bool / float one joined question 1 / 2 silently
    path = tmp_path / "answers.jsonl"
    path.write_text('{"question_id": 1, "text": "Yes"}\n{"question_id": ' + qid + ', "text": "No"}\n')
    with pytest.raises(PopeFormatError, match=r"answers\.jsonl:2: question_id must be an int or a string"):
        load_pope_answers(path)


def test_answers_may_hold_unicode_line_separators(tmp_path: Path) -> None:
    # valid JSON Lines (json.dumps(..., ensure_ascii=False)); str.splitlines cut them mid-string
    path = tmp_path / "answers.jsonl"
    rows = [{"question_id": 1, "text": "Yes\u2028there is"}, {"question_id": 2, "text": "No\x85"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert load_pope_answers(path) == {1: "Yes\u2028there is", 2: "No\x85"}


def test_malformed_json_array_names_item(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            [
                {"question_id": 1, "image": "a.jpg", "text": "q", "label": "yes"},
                {"question_id": 2, "image": "a.jpg", "text": "q"},
            ],
            indent=4,
        )
    )
    with pytest.raises(PopeFormatError, match=r"bad\.json: item 1: missing key"):
        load_pope_questions(path)


# --- known versions ------------------------------------------------------------------------------


def test_tiny_file_is_unknown_and_strict_refuses_it(tmp_path: Path) -> None:
    path = tmp_path / "ours.jsonl"
    path.write_text('{"question_id": 1, "image": "a.jpg", "text": "Is there a cat?", "label": "yes"}\n')
    assert identify_pope_file(path) is None
    info = pope_file_info(path)
    assert re.fullmatch(r"[0-9a-f]{32}", info.md5) and re.fullmatch(r"[0-9a-f]{64}", info.sha256)
    assert len(load_pope_questions(path)) == 1  # accepted when not strict
    with pytest.raises(UnknownPopeFileError, match="not a known POPE question file"):
        load_pope_questions(path, strict=True)
    assert identify_pope_file(QUESTIONS) is None


def test_known_version_table_is_well_formed() -> None:
    md5s = [f.md5 for f in KNOWN_POPE_FILES]
    assert len(set(md5s)) == len(md5s) == 24
    assert len({f.sha256 for f in KNOWN_POPE_FILES}) == 24
    for f in KNOWN_POPE_FILES:
        assert re.fullmatch(r"[0-9a-f]{32}", f.md5) and re.fullmatch(r"[0-9a-f]{32}", f.md5_lf)
        assert re.fullmatch(r"[0-9a-f]{64}", f.sha256)
        assert re.fullmatch(r"[0-9a-f]{40}", f.commit)
        assert f.dataset in {"coco", "aokvqa", "gqa"} and f.split in {"random", "popular", "adversarial"}
        assert f.n_yes == 1500 and f.n_no in {1410, 1500}
        assert f.line_endings in {"crlf", "lf"} and (f.md5 == f.md5_lf) == (f.line_endings == "lf")
        if f.path.endswith("_seem_" + f.split + ".json"):  # pretty-printed JSON array: 6 lines/question + 1
            assert f.n_lines == 6 * f.n_questions + 1
        else:
            assert f.n_lines == f.n_questions
    old_random = [f for f in KNOWN_POPE_FILES if f.commit.startswith("e3e3926") and f.split == "random"]
    assert len(old_random) == 1 and old_random[0].n_lines == 2910 and old_random[0].n_typos == 144
    assert any("OPERA" in u for u in old_random[0].users) and any("LLaVA" in u for u in old_random[0].users)
    # Every CRLF row's LF twin is either itself unknown or a listed LF copy (VCD) of the same content.
    by_md5 = {f.md5: f for f in KNOWN_POPE_FILES}
    for f in KNOWN_POPE_FILES:
        twin = by_md5.get(f.md5_lf)
        if twin is not None:
            assert (twin.dataset, twin.split, twin.n_typos) == (f.dataset, f.split, f.n_typos)


def test_generated_world_files_are_recognised(tmp_path, caplog):
    """mmfast's own world POPE files are named as generated, not logged as unknown versions; an
    edited copy is unknown again."""
    import logging
    import shutil

    from mmfast.eval.pope import generated_by_world, load_pope_questions, pope_file_info
    from mmfast.world import write_world

    root = tmp_path / "w"
    write_world(root, seed=0, n_train=0, n_val=6, pope_images=4, progress=False)
    f = root / "pope" / "world_pope_random.json"
    assert "random split of the mmfast world" in generated_by_world(f, pope_file_info(f).sha256)
    with caplog.at_level(logging.INFO, logger="mmfast.eval.pope"):
        load_pope_questions(f)
    assert not any("unknown POPE file version" in r.getMessage() for r in caplog.records)
    edited = root / "pope" / "edited.json"
    shutil.copyfile(f, edited)
    edited.write_text(edited.read_text() + "\n")
    assert generated_by_world(edited, pope_file_info(edited).sha256) is None
