#!/usr/bin/env python
"""Build the NLTK-derived data CHAIR ships inside the package (``mmfast/assets/chair/``).

    python scripts/build_chair_data.py --nltk-data /path/to/nltk_data          # (re)write the files
    python scripts/build_chair_data.py --nltk-data /path/to/nltk_data --check  # compare, exit 1 if stale

The folder must hold NLTK's ``taggers/averaged_perceptron_tagger_eng`` and ``corpora/wordnet``
(directories or zips, NLTK's layout). Only that folder is read: NLTK's default search path is
replaced, so nothing else on the machine can leak in. Two things are written:

1. ``averaged_perceptron_tagger_eng.{weights,tagdict,classes}.json.gz``: the tagger's three JSON
   files, byte for byte, gzip-compressed (level 9, no name or time stamp). mmfast loads them into
   NLTK's own ``PerceptronTagger`` class, so tags are those of ``nltk.pos_tag``.
2. ``chair_lemmas.json``: for each WordNet POS the parser uses (``n v a r``), a map
   ``form -> WordNetLemmatizer().lemmatize(form, pos)`` restricted to the forms below. At run time a
   form that is not in the map is its own lemma.

Why the restricted table gives the same CHAIR result as the full lemmatizer
------------------------------------------------------------------------

Notation: ``L(t, p)`` is ``WordNetLemmatizer().lemmatize(t, p)``, i.e. the shortest element of
``morphy(t, p)`` or ``t`` when that is empty; ``L'(t, p)`` is the table's value or ``t``.
``R`` (``chair_vocab.relevant_words()``) is every string the parser ever compares a single lemma
with: each synonym without whitespace (a lemma never holds whitespace: tokens are split on it and
WordNet lemma names join words with ``_``), each word of each two-word phrase key, and the
``toilet``/``seat`` rule words.

(a) What CHAIR reads from the lemmas. ``CaptionParser.parse`` merges ``l_i l_{i+1}`` when the
    pair is a phrase key; since neither lemma holds whitespace, that needs ``l_i`` and ``l_{i+1}``
    to be the two words of the key, both in ``R``. A single merged lemma is a mention iff it is a
    synonym (then in ``R``), and the seat rule tests ``toilet``/``seat`` (in ``R``). So merging,
    the token count, the mentions, their indices and the seat rule, hence every metric and the
    ground truth, depend on the lemmas only through ``g(l) = l if l in R else NONE``.
(b) It is therefore enough that ``g(L'(t, p)) == g(L(t, p))`` for every string ``t`` and POS
    ``p``, i.e. that the table holds ``(t, p)`` whenever ``L(t, p) != t`` and either
    ``L(t, p) in R`` or ``t in R``. (If ``L(t, p) == t`` the fallback is right; if neither
    ``L(t, p)`` nor ``t`` is in ``R``, both sides map to ``NONE``.)
(c) Which ``t`` can have ``L(t, p) in R``. NLTK's ``_morphy(t, p)`` returns the members of
    ``[t] + E_p[t]`` (``t`` in the exception list ``E_p``, ``{noun,verb,adj,adv}.exc``) or else
    ``[t] + [t[:-len(old)] + new for (old, new) in SUBSTITUTIONS[p] if t.endswith(old)]`` (one
    pass, no recursion) that are WordNet lemmas of POS ``p``. So ``L(t, p) = r in R`` needs
    ``t == r``, or ``t`` an exception form with ``r`` among its bases, or ``t = r[:-len(new)] + old``
    for a rule ``(old, new)`` with ``r.endswith(new)`` (inverting the detachment rule). The union
    of these three sets over ``r in R`` is finite; the script computes ``L`` on all of it with NLTK
    and keeps the entries that (b) requires. Nothing else is needed, for any input word.

Only the lemmas of the other tokens differ from NLTK's: ``CaptionObjects.words`` holds the token
itself there ("is" where NLTK gives "be"), which no metric reads. The argument depends on the
vocabulary tables and on NLTK's one-pass morphy; the table records the vocabulary digest (checked at
load time) and the NLTK version it was built with, and tests/test_chair_identity.py re-checks the
result against the full data (``MMFAST_REFERENCE_NLTK_DATA``).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's mmfast, not whichever one is installed

from mmfast.eval.chair_vocab import relevant_words, vocabulary_digest  # noqa: E402

logger = logging.getLogger("build_chair_data")

OUT = REPO / "mmfast" / "assets" / "chair"
POS = ("n", "v", "a", "r")  # the WordNet POS CaptionParser maps tags to
EXC_FILES = {"n": "noun.exc", "v": "verb.exc", "a": "adj.exc", "r": "adv.exc"}
INDEX_FILES = {"n": "index.noun", "v": "index.verb", "a": "index.adj", "r": "index.adv"}
TAGGER = "averaged_perceptron_tagger_eng"
TAGGER_FILES = tuple(f"{TAGGER}.{part}.json" for part in ("weights", "tagdict", "classes"))
LEMMA_FILE = "chair_lemmas.json"
LEMMA_FORMAT = "mmfast.chair.lemmas"


def candidate_forms(relevant: Iterable[str], exceptions: Mapping[str, Sequence[str]],
                    substitutions: Sequence[tuple[str, str]]) -> set[str]:
    """Every form whose lemma for one POS can be in ``relevant`` (step (c) of the module docstring)."""
    rel = set(relevant)
    forms = set(rel)
    forms.update(form for form, bases in exceptions.items() if rel.intersection(bases))
    for r in rel:
        for old, new in substitutions:
            if r.endswith(new):
                forms.add(r[:len(r) - len(new)] + old)
    return forms


def lemma_table(lemmatize: Callable[[str, str], str], relevant: Iterable[str],
                exceptions: Mapping[str, Mapping[str, Sequence[str]]],
                substitutions: Mapping[str, Sequence[tuple[str, str]]]) -> dict[str, dict[str, str]]:
    """``{pos: {form: lemma}}`` holding exactly the entries step (b) requires."""
    rel = frozenset(relevant)
    table: dict[str, dict[str, str]] = {}
    for pos in POS:
        entries = {}
        for form in sorted(candidate_forms(rel, exceptions[pos], substitutions[pos])):
            lemma = lemmatize(form, pos)
            if lemma != form and (lemma in rel or form in rel):
                entries[form] = lemma
        table[pos] = entries
    return table


def _read_exceptions(wordnet: Any) -> dict[str, dict[str, list[str]]]:
    # The same parse as NLTK's WordNetCorpusReader._load_exception_map.
    out: dict[str, dict[str, list[str]]] = {}
    for pos, name in EXC_FILES.items():
        with wordnet.open(name) as fh:
            out[pos] = {terms[0]: terms[1:] for terms in (line.split() for line in fh) if terms}
    return out


def _sha256_text(wordnet: Any, name: str) -> str:
    with wordnet.open(name) as fh:
        return hashlib.sha256(fh.read().encode("utf-8")).hexdigest()


def build(nltk_data: Path) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Read the folder; return the tagger's JSON files (raw bytes) and the lemma table document."""
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader
    from nltk.stem import WordNetLemmatizer

    root = str(nltk_data.resolve())
    nltk.data.path[:] = [root]  # only this folder: no ~/nltk_data, no /usr/share/nltk_data
    tagger_dir = nltk.data.find(f"taggers/{TAGGER}/", paths=[root])
    tagger = {name: tagger_dir.join(name).open().read() for name in TAGGER_FILES}

    from nltk.corpus import wordnet

    lemmatizer = WordNetLemmatizer()  # the reference's call, on the global reader (this folder only)
    relevant = relevant_words()
    exceptions = _read_exceptions(wordnet)
    table = lemma_table(lemmatizer.lemmatize, relevant, exceptions,
                        WordNetCorpusReader.MORPHOLOGICAL_SUBSTITUTIONS)
    doc = {
        "format": LEMMA_FORMAT, "version": 1,
        "about": "form -> WordNetLemmatizer().lemmatize(form, pos), restricted to the forms whose lemma "
                 "CHAIR can compare; any other form is its own lemma. Built by scripts/build_chair_data.py "
                 "(see its docstring for why this gives the same CHAIR result as the full lemmatizer).",
        "built_with": {"nltk": nltk.__version__, "wordnet": str(wordnet.get_version()),
                       "wordnet_files_sha256": {name: _sha256_text(wordnet, name)
                                                for name in (*INDEX_FILES.values(), *EXC_FILES.values())}},
        "vocabulary": vocabulary_digest(),
        "relevant": sorted(relevant),
        "lemmas": table,
    }
    logger.info("lemma table: %s entries for %d relevant words (nltk %s, WordNet %s)",
                {p: len(t) for p, t in table.items()}, len(relevant), nltk.__version__, wordnet.get_version())
    return tagger, doc


def _dump_lemmas(doc: Mapping[str, Any]) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write(out: Path, tagger: Mapping[str, bytes], doc: Mapping[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data in tagger.items():
        (out / f"{name}.gz").write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    (out / LEMMA_FILE).write_bytes(_dump_lemmas(doc))
    logger.info("wrote %s", ", ".join(sorted(p.name for p in out.iterdir())))


def stale_files(out: Path, tagger: Mapping[str, bytes], doc: Mapping[str, Any]) -> list[str]:
    """Names of the shipped files whose content differs from a fresh build (gz compared decompressed)."""
    stale = []
    for name, data in tagger.items():
        path = out / f"{name}.gz"
        if not path.is_file() or gzip.decompress(path.read_bytes()) != data:
            stale.append(path.name)
    path = out / LEMMA_FILE
    if not path.is_file() or path.read_bytes() != _dump_lemmas(doc):
        stale.append(LEMMA_FILE)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nltk-data", required=True, type=Path,
                   help="NLTK data folder with taggers/averaged_perceptron_tagger_eng and corpora/wordnet")
    p.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT.relative_to(REPO)})")
    p.add_argument("--check", action="store_true", help="compare with the files in --out; exit 1 if any differs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tagger, doc = build(args.nltk_data)
    if args.check:
        stale = stale_files(args.out, tagger, doc)
        if stale:
            logger.error("out of date in %s: %s (rerun without --check)", args.out, ", ".join(stale))
            return 1
        logger.info("%s is up to date", args.out)
        return 0
    write(args.out, tagger, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
