#!/usr/bin/env python
"""Build the NLTK-derived data CHAIR ships inside the package (``mmfast/assets/chair/``).

    python scripts/build_chair_data.py --nltk-data /path/to/nltk_data          # (re)write the files
    python scripts/build_chair_data.py --nltk-data /path/to/nltk_data --check  # compare, exit 1 if stale

The folder must hold NLTK's ``taggers/averaged_perceptron_tagger_eng`` and ``corpora/wordnet``
(directories or zips, NLTK's layout). Only that folder is read: NLTK's default search path is
replaced, so nothing else on the machine can leak in. Two things are written (gzip level 9, no
name or time stamp; ``--check`` compares them decompressed):

1. ``averaged_perceptron_tagger_eng.{weights,tagdict,classes}.json.gz``: the tagger's three JSON
   files, byte for byte. mmfast loads them into NLTK's own ``PerceptronTagger`` class, so tags are
   those of ``nltk.pos_tag``.
2. ``wordnet_morphy.json.gz``: what NLTK's ``WordNetLemmatizer`` reads from WordNet, for the POS
   CHAIR uses (``n v a r``), taken from NLTK's own ``WordNetCorpusReader``: the detachment rules
   (``MORPHOLOGICAL_SUBSTITUTIONS``), the exception maps (``_exception_map``, i.e. NLTK's parse of
   ``{noun,verb,adj,adv}.exc``, verbatim) and the lemma names (keys of ``_lemma_pos_offset_map``
   that have the POS) that ``_morphy`` can ever consult. ``mmfast.eval.chair_morphy`` re-implements
   ``_morphy`` + ``lemmatize`` on them (its docstring states the rules).

Which lemma names are needed
----------------------------

``_morphy(t, p)`` tests membership in the lemma names ``N_p`` only for the strings of
``[t] + E_p[t]`` (``t`` an exception form) or ``[t] + [t[:-len(old)] + new ...]`` (rules whose
``old`` ends ``t``). Dropping a name ``L`` from ``N_p`` changes no result iff ``L`` is never in such
a list in a way that matters. ``L`` is in the list of ``t`` iff ``L == t``, or ``L`` is a base in
``E_p`` (exception form ``t``), or ``L`` ends with the ``new`` of a rule (``t`` its inflection). And
when ``L`` is only ever its own form ``t`` (not an exception form), its membership matters only if
a rule with ``t.endswith(old)`` yields a candidate at least as long as ``t`` (else ``L`` is the
result whether or not it is a name: either the sole survivor, or the fallback, or beaten by a
shorter candidate either way). So ``N_p`` is restricted to the names that are an exception form or
base, or end with some rule's ``new``, or end with the ``old`` of a rule with
``len(new) >= len(old)``. For nouns, verbs and adjectives a rule has ``new == ""``, so every name is
kept; adverbs have no rules, so only those in ``adv.exc`` are. Everything else is shipped whole,
so the lemmatiser equals NLTK's for every string; tests/test_chair_identity.py checks it on every
WordNet lemma name, exception form and one-rule inflection of a name, in the four POS, against the
full data (``MMFAST_REFERENCE_NLTK_DATA``).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's mmfast, not whichever one is installed

from mmfast.eval.chair_morphy import FORMAT as MORPHY_FORMAT  # noqa: E402
from mmfast.eval.chair_morphy import POS  # noqa: E402
from mmfast.eval.chair_morphy import VERSION as MORPHY_VERSION  # noqa: E402

logger = logging.getLogger("build_chair_data")

OUT = REPO / "mmfast" / "assets" / "chair"
EXC_FILES = {"n": "noun.exc", "v": "verb.exc", "a": "adj.exc", "r": "adv.exc"}
INDEX_FILES = {"n": "index.noun", "v": "index.verb", "a": "index.adj", "r": "index.adv"}
TAGGER = "averaged_perceptron_tagger_eng"
TAGGER_FILES = tuple(f"{TAGGER}.{part}.json" for part in ("weights", "tagdict", "classes"))
MORPHY_FILE = "wordnet_morphy.json"


def consultable_names(
    names: Iterable[str], exceptions: Mapping[str, Sequence[str]], rules: Sequence[tuple[str, str]]
) -> list[str]:
    """The lemma names of one POS whose membership can change a ``_morphy`` result (module
    docstring), sorted."""
    in_exceptions = set(exceptions).union(*exceptions.values())
    news = {new for _, new in rules}
    lengthening = {old for old, new in rules if len(new) >= len(old)}
    return sorted(
        n
        for n in names
        if n in in_exceptions or any(n.endswith(s) for s in news) or any(n.endswith(s) for s in lengthening)
    )


def morphy_doc(wordnet: Any, rules: Mapping[str, Sequence[tuple[str, str]]]) -> dict[str, Any]:
    """The ``wordnet_morphy.json`` document from NLTK's WordNet reader and its rules."""
    lemma_map = wordnet._lemma_pos_offset_map  # name -> {pos: offsets}, what _morphy filters with
    exceptions = {p: {form: list(bases) for form, bases in wordnet._exception_map[p].items()} for p in POS}
    names = {
        p: consultable_names((n for n, by_pos in lemma_map.items() if p in by_pos), exceptions[p], rules[p])
        for p in POS
    }
    return {"rules": {p: [list(r) for r in rules[p]] for p in POS}, "exceptions": exceptions, "lemma_names": names}


def _sha256_text(wordnet: Any, name: str) -> str:
    with wordnet.open(name) as fh:
        return hashlib.sha256(fh.read().encode("utf-8")).hexdigest()


def build(nltk_data: Path) -> dict[str, bytes]:
    """Read the folder; return ``{file name (uncompressed): content}`` of every shipped file."""
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    root = str(nltk_data.resolve())
    nltk.data.path[:] = [root]  # only this folder: no ~/nltk_data, no /usr/share/nltk_data
    tagger_dir = nltk.data.find(f"taggers/{TAGGER}/", paths=[root])
    files = {name: tagger_dir.join(name).open().read() for name in TAGGER_FILES}

    from nltk.corpus import wordnet  # the reader WordNetLemmatizer uses (this folder only)

    doc = {
        "format": MORPHY_FORMAT,
        "version": MORPHY_VERSION,
        "about": "What nltk.stem.WordNetLemmatizer().lemmatize(form, pos) reads from WordNet for POS n v a r: "
        "NLTK's detachment rules, its parse of the exception lists, and the lemma names its _morphy can "
        "consult. Built by scripts/build_chair_data.py; used by mmfast.eval.chair_morphy. Derived from "
        "WordNet 3.0 (Princeton University; licence in LICENSE-WordNet-3.0.txt).",
        "built_with": {
            "nltk": nltk.__version__,
            "wordnet": str(wordnet.get_version()),
            "wordnet_files_sha256": {
                name: _sha256_text(wordnet, name) for name in (*INDEX_FILES.values(), *EXC_FILES.values())
            },
        },
        **morphy_doc(wordnet, WordNetCorpusReader.MORPHOLOGICAL_SUBSTITUTIONS),
    }
    files[MORPHY_FILE] = (json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n").encode(
        "utf-8"
    )
    logger.info(
        "morphy tables: lemma names %s, exception forms %s (nltk %s, WordNet %s)",
        {p: len(doc["lemma_names"][p]) for p in POS},
        {p: len(doc["exceptions"][p]) for p in POS},
        nltk.__version__,
        wordnet.get_version(),
    )
    return files


def write(out: Path, files: Mapping[str, bytes]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / f"{name}.gz").write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    logger.info("wrote %s", ", ".join(f"{name}.gz ({(out / f'{name}.gz').stat().st_size} bytes)" for name in files))


def stale_files(out: Path, files: Mapping[str, bytes]) -> list[str]:
    """Names of the shipped files whose content differs from a fresh build (compared decompressed)."""
    stale = []
    for name, data in files.items():
        path = out / f"{name}.gz"
        if not path.is_file() or gzip.decompress(path.read_bytes()) != data:
            stale.append(path.name)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nltk-data",
        required=True,
        type=Path,
        help="NLTK data folder with taggers/averaged_perceptron_tagger_eng and corpora/wordnet",
    )
    p.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT.relative_to(REPO)})")
    p.add_argument("--check", action="store_true", help="compare with the files in --out; exit 1 if any differs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    files = build(args.nltk_data)
    if args.check:
        stale = stale_files(args.out, files)
        if stale:
            logger.error("out of date in %s: %s (rerun without --check)", args.out, ", ".join(stale))
            return 1
        logger.info("%s is up to date", args.out)
        return 0
    write(args.out, files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
