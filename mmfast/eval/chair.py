"""CHAIR: object hallucination in image captions (Rohrbach et al., EMNLP 2018).

Reference: ``chair.py`` in shikiw/OPERA (Maxlinn's Python 3 port of LisaAnne/Hallucination
``utils/chair.py``; RITUAL ships the same file). A caption is lower-cased, tokenised, POS-tagged and
WordNet-lemmatised; two-word phrases are merged ("hot dog", "baby elephant" -> "elephant", "toilet
seat" -> "toilet", ...); "seat" is dropped when "toilet" occurs; the remaining tokens found in the
synonym table (``chair_vocab``) are object *mentions*, each mapped to its COCO class (node word).
Ground truth per image = node words of its COCO instance annotations plus those parsed from its
reference captions. Metrics (as the reference computes them):

* CHAIR_s = captions with >= 1 hallucinated mention / captions;
* CHAIR_i = hallucinated mentions / mentions (every mention counts, repeats included);
* recall  = sum over captions of |unique mentioned node words in GT| / sum of |GT|;
* len     = mean number of tokens after phrase merging, punctuation included (the reference stores
  ``0.01 * mean`` as "Len"; ``ChairResult.len`` is the mean itself, ``to_reference_dict`` the 0.01 form).

Language data: no NLTK data needed. The tagger (NLTK's ``averaged_perceptron_tagger_eng`` weights,
loaded into NLTK's ``PerceptronTagger``) and the WordNet tables NLTK's ``WordNetLemmatizer`` reads
(detachment rules, exception lists, lemma names; lemmatised by ``chair_morphy``) ship in
``mmfast/assets/chair`` (licences there; ``scripts/build_chair_data.py`` builds them), so every
output, ``words`` included, equals that with NLTK's full data (tests/test_chair_identity.py). NLTK
data is used instead when asked for: ``nltk_data=`` or ``$NLTK_DATA`` holding the tagger and WordNet
(see ``load_chair_resources``). Nothing is ever downloaded, and ``describe()["language_data"]``
(part of the ground-truth cache key) records which route ran, with versions and data digests.

The one deviation in tokenisation. The reference calls ``nltk.word_tokenize``, which needs the
Punkt sentence model (``punkt_tab``), which mmfast does not use. Sentences are split by NLTK's own
Punkt algorithm (``nltk.tokenize.punkt``, pure code) given the English model's abbreviation list
(``chair_vocab.PUNKT_ENGLISH_ABBREVIATIONS``) but not its collocation and orthographic statistics;
each sentence is then tokenised with ``nltk.word_tokenize(sentence, preserve_line=True)`` (the same
Treebank tokeniser). On lower-cased captions the trained statistics only matter after a number or a
single letter followed by a rare lower-case word, so the tokens equal the reference's for ordinary
captions (tested on fixtures). Other known differences from the reference, none of which changes a
metric: the ``'' -> ''`` synonym is dropped (see ``chair_vocab``); ``hallucination_idxs`` are
correct where the reference misaligns them after removing "seat"; the per-caption "Len" is the
token count (the reference leaves it 0); unknown image ids raise unless ``missing="empty"``
(the reference silently uses an empty ground truth). Lemmas can shift with NLTK/tagger versions:
two reference ground-truth pickles (RITUAL's and DAMRO's ``chair.pkl``) already differ on 1.4% of
COCO images, so record the NLTK version with every number.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import logging
import os
import random
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import InputError
from .chair_morphy import MorphyLemmatizer
from .chair_vocab import PHRASE_MAP, PUNKT_ENGLISH_ABBREVIATIONS, SEAT_RULE, SYNONYM_TO_NODE, vocabulary_digest

logger = logging.getLogger(__name__)

PIPELINE_VERSION = 1  # bump when caption processing changes; part of the ground-truth cache key
_CACHE_FORMAT = "mmfast.chair.ground_truth"
SHIPPED_DATA = Path(__file__).resolve().parents[1] / "assets" / "chair"
_TAGGER_NAME = "averaged_perceptron_tagger_eng"
_TAGGER_PARTS = ("weights", "tagdict", "classes")  # the order PerceptronTagger.decode_json_obj takes
_MORPHY_FILE = "wordnet_morphy.json.gz"
_TAGGER = ("taggers/averaged_perceptron_tagger_eng/",)
_WORDNET = ("corpora/wordnet/", "corpora/wordnet.zip/wordnet/")
_TAGGER_FILES = ("taggers/averaged_perceptron_tagger_eng", "taggers/averaged_perceptron_tagger_eng.zip")
_WORDNET_FILES = ("corpora/wordnet", "corpora/wordnet.zip")
_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
# COCO ("COCO_val2014_000000000042.jpg") and the embedded world ("WORLD_val_000000000042.png")
_COCO_FILE_RE = re.compile(r"^(?:[A-Za-z]+_[A-Za-z]+\d*_)?0*(\d+)\.(?:jpe?g|png)$", re.IGNORECASE)


class NltkDataMissingError(InputError, LookupError):
    """NLTK data was asked for (``nltk_data=``) but its POS tagger or WordNet is not there."""


class ShippedDataError(InputError):
    """The CHAIR data shipped in ``mmfast/assets/chair`` is missing, corrupt or out of date."""


# ---------------------------------------------------------------------------------------------
# Tagger and lemmatizer: the data shipped in the package, or NLTK data (never downloaded)
# ---------------------------------------------------------------------------------------------

#: A lemmatizer: ``(word, WordNet POS) -> lemma``.
Lemmatizer = Callable[[str, str], str]


@dataclass(frozen=True)
class ChairResources:
    """The POS tagger and lemmatizer CHAIR uses, and where they came from.

    ``route`` is ``"shipped"`` (``mmfast/assets/chair``: NLTK's tagger weights and the WordNet
    tables of ``chair_morphy``) or ``"nltk"`` (an NLTK data folder: the tagger and WordNet). Both
    lemmatise as ``WordNetLemmatizer().lemmatize``. ``provenance`` is JSON-safe and says which
    route, with versions and data digests. ``wordnet`` is NLTK's WordNet reader (route ``"nltk"``
    only).
    """

    tagger: Any
    lemmatize: Lemmatizer
    route: Literal["shipped", "nltk"]
    provenance: Mapping[str, Any]
    wordnet: Any = None

    @property
    def nltk_version(self) -> str:
        return str(self.provenance["nltk_version"])

    @property
    def wordnet_version(self) -> str:
        return str(self.provenance["wordnet_version"])

    def cache_key(self) -> dict[str, Any]:
        """``provenance`` without the folders it was read from (what a result depends on)."""
        return {k: v for k, v in self.provenance.items() if k not in _LOCATION_KEYS}


_LOCATION_KEYS = ("tagger_root", "wordnet_root", "shipped_dir")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wordnet_lemmatizer(wordnet: Any) -> Lemmatizer:
    def lemmatize(word: str, pos: str) -> str:
        # == WordNetLemmatizer().lemmatize(word, pos): the shortest WordNet lemma, else the word.
        lemmas = wordnet._morphy(word, pos)
        return min(lemmas, key=len) if lemmas else word

    return lemmatize


@functools.lru_cache(maxsize=1)
def load_shipped_resources() -> ChairResources:
    """The tagger and WordNet tables shipped in ``mmfast/assets/chair`` (no NLTK data needed).

    The tagger is NLTK's ``averaged_perceptron_tagger_eng`` (its JSON files, gzip-compressed),
    loaded into NLTK's ``PerceptronTagger``; the lemmatiser is ``chair_morphy.MorphyLemmatizer``
    on the tables ``scripts/build_chair_data.py`` takes from NLTK's WordNet reader.
    """
    import nltk
    from nltk.tag.perceptron import PerceptronTagger

    params: list[Any] = []
    tagger_sha: dict[str, str] = {}
    try:
        for part in _TAGGER_PARTS:
            raw = gzip.decompress((SHIPPED_DATA / f"{_TAGGER_NAME}.{part}.json.gz").read_bytes())
            tagger_sha[part] = _sha256(raw)
            params.append(json.loads(raw))
        raw = gzip.decompress((SHIPPED_DATA / _MORPHY_FILE).read_bytes())
        doc = json.loads(raw)
    except (OSError, EOFError, ValueError) as exc:  # missing file, bad gzip, bad JSON
        raise ShippedDataError(
            f"the CHAIR data shipped in {SHIPPED_DATA} cannot be read ({exc}); "
            "reinstall mmfast, or pass NLTK data (nltk_data= or NLTK_DATA)"
        ) from exc
    try:
        lemmatizer = MorphyLemmatizer.from_doc(doc)
        built = doc["built_with"]
        wordnet_version, built_nltk = str(built["wordnet"]), str(built["nltk"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ShippedDataError(
            f"{SHIPPED_DATA / _MORPHY_FILE}: {exc}; rebuild it with scripts/build_chair_data.py --nltk-data <folder>"
        ) from exc
    # NLTK's own constructor from (weights, tagdict, classes), as load_from_json reads them (nltk >= 3.9)
    tagger = PerceptronTagger.decode_json_obj(tuple(params))
    provenance = {
        "route": "shipped",
        "nltk_version": nltk.__version__,
        "wordnet_version": wordnet_version,
        "tagger": _TAGGER_NAME,
        "tagger_sha256": tagger_sha,
        "lemmas": {
            "table_sha256": _sha256(raw),
            "built_with_nltk": built_nltk,
            "lemma_names": {p: len(n) for p, n in lemmatizer.names.items()},
        },
        "shipped_dir": str(SHIPPED_DATA),
    }
    logger.info(
        "CHAIR: tagger and WordNet tables shipped with mmfast (WordNet %s, built with nltk %s)",
        wordnet_version,
        built_nltk,
    )
    return ChairResources(tagger, lemmatizer.lemmatize, "shipped", provenance)


def nltk_search_paths(nltk_data: str | Path | None = None) -> list[str]:
    """Folders ``load_nltk_resources`` searches, in order: ``$NLTK_DATA`` (read now,
    ``os.pathsep``-separated), then the explicit ``nltk_data`` argument, then ``nltk.data.path``
    (NLTK's defaults)."""
    import nltk

    roots = _env_roots()
    if nltk_data is not None:
        roots.append(str(nltk_data))
    roots.extend(str(p) for p in nltk.data.path)
    return list(dict.fromkeys(roots))  # first occurrence wins


def _env_roots() -> list[str]:
    return [p for p in os.environ.get("NLTK_DATA", "").split(os.pathsep) if p]


def _locate(roots: Sequence[str], files: Sequence[str]) -> str | None:
    for root in roots:
        if any(os.path.exists(os.path.join(root, f)) for f in files):
            return os.path.abspath(root)  # a relative $NLTK_DATA must not depend on a later chdir
    return None


def _pointer(root: str, names: Sequence[str]) -> Any:
    import nltk

    # NLTK only reads data under an entry of nltk.data.path (its pathsec sandbox), so the chosen
    # root is appended there; the resource itself is then resolved in that root only.
    if root not in nltk.data.path:
        nltk.data.path.append(root)
    errors = []
    for name in names:
        try:
            return nltk.data.find(name, paths=[root])
        except LookupError as exc:
            errors.append(str(exc).strip().splitlines()[0] if str(exc).strip() else name)
    raise NltkDataMissingError(f"NLTK data under {root} could not be opened as {list(names)}: {errors}")


def load_nltk_resources(nltk_data: str | Path | None = None) -> ChairResources:
    """The tagger and all of WordNet from NLTK data (route ``"nltk"``; cached per location).

    Searches ``nltk_search_paths(nltk_data)``. Raises ``NltkDataMissingError`` with the fix when
    either is missing; never downloads. CHAIR only comes here when asked (see
    ``load_chair_resources``).
    """
    roots = nltk_search_paths(nltk_data)
    tagger_root = _locate(roots, _TAGGER_FILES)
    wordnet_root = _locate(roots, _WORDNET_FILES)
    if tagger_root is None or wordnet_root is None:
        missing = [name for name, root in ((_TAGGER_NAME, tagger_root), ("wordnet", wordnet_root)) if root is None]
        raise NltkDataMissingError(
            f"NLTK data {missing} was asked for but is not installed in any of {roots}. "
            "Point nltk_data (or NLTK_DATA) at a folder that holds taggers/averaged_perceptron_tagger_eng "
            "and corpora/wordnet, or install them once with "
            "`python -m nltk.downloader averaged_perceptron_tagger_eng wordnet`; or pass no NLTK data "
            "at all to use the data shipped with mmfast (same CHAIR results). "
            "mmfast never downloads data at run time."
        )
    return _load_resources(tagger_root, wordnet_root)


@functools.lru_cache(maxsize=4)
def _load_resources(tagger_root: str, wordnet_root: str) -> ChairResources:
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader
    from nltk.tag.perceptron import PerceptronTagger

    loc = _pointer(tagger_root, _TAGGER)
    tagger = PerceptronTagger(loc=loc)
    tagger_sha: dict[str, str] = {}
    for part in _TAGGER_PARTS:
        with loc.join(f"{_TAGGER_NAME}.{part}.json").open() as fh:
            tagger_sha[part] = _sha256(fh.read())
    with warnings.catch_warnings():
        # Without the multilingual OMW data the reader warns; CHAIR only uses English lemmas.
        warnings.filterwarnings("ignore", message="The multilingual functions are not available")
        wordnet = WordNetCorpusReader(_pointer(wordnet_root, _WORDNET), None)
    logger.info(
        "CHAIR: NLTK data, tagger from %s, WordNet %s from %s (nltk %s)",
        tagger_root,
        wordnet.get_version(),
        wordnet_root,
        nltk.__version__,
    )
    provenance = {
        "route": "nltk",
        "nltk_version": nltk.__version__,
        "wordnet_version": str(wordnet.get_version()),
        "tagger": _TAGGER_NAME,
        "tagger_sha256": tagger_sha,
        "lemmas": "WordNetLemmatizer (all of WordNet)",
        "tagger_root": tagger_root,
        "wordnet_root": wordnet_root,
    }
    return ChairResources(tagger, _wordnet_lemmatizer(wordnet), "nltk", provenance, wordnet=wordnet)


def load_chair_resources(nltk_data: str | Path | None = None) -> ChairResources:
    """The tagger and lemmatizer CHAIR uses, by this precedence:

    1. ``nltk_data`` given: NLTK data (``load_nltk_resources(nltk_data)``; raises if it is missing);
    2. ``$NLTK_DATA`` set and its folders hold both the tagger and WordNet: NLTK data from there;
    3. otherwise the data shipped with mmfast (``load_shipped_resources``).

    NLTK's default folders (``~/nltk_data``, ``/usr/share/nltk_data``, ...) are never searched
    implicitly, so a result does not depend on what a machine happens to have installed; both
    routes give the same CHAIR results (tests/test_chair_identity.py) and ``provenance`` says which
    one ran.
    """
    if nltk_data is not None:
        return load_nltk_resources(nltk_data)
    env = _env_roots()
    if env:
        tagger_root, wordnet_root = _locate(env, _TAGGER_FILES), _locate(env, _WORDNET_FILES)
        if tagger_root is not None and wordnet_root is not None:
            return _load_resources(tagger_root, wordnet_root)
        logger.info(
            "CHAIR: NLTK_DATA=%s lacks the tagger or WordNet; using the data shipped with mmfast", os.pathsep.join(env)
        )
    return load_shipped_resources()


# ---------------------------------------------------------------------------------------------
# Caption processing
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _sentence_splitter() -> Any:
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    params = PunktParameters()
    params.abbrev_types = set(PUNKT_ENGLISH_ABBREVIATIONS)
    return PunktSentenceTokenizer(params)


def split_sentences(text: str) -> list[str]:
    """Split text into sentences with Punkt's algorithm and the English abbreviation list (see the
    module docstring); stands in for ``nltk.sent_tokenize`` without the ``punkt_tab`` data."""
    return _sentence_splitter().tokenize(text)


def tokenize_caption(caption: str) -> list[str]:
    """Lower-case and tokenise like the reference's ``nltk.word_tokenize(caption.lower())``."""
    import nltk

    return [tok for sent in split_sentences(caption.lower()) for tok in nltk.word_tokenize(sent, preserve_line=True)]


def _wordnet_pos(tag: str) -> str:
    # Reference get_wordnet_pos(), with its default of noun for every other tag.
    if tag.startswith("J"):
        return "a"
    if tag.startswith("V"):
        return "v"
    if tag.startswith("R"):
        return "r"
    return "n"


@dataclass(frozen=True)
class CaptionObjects:
    """Objects found in one caption.

    ``words``: tokens after lemmatisation and phrase merging (the reference's ``words`` output,
    whose length is the caption's "len"). ``mentions``: ``(word, node_word)`` per object mention in
    order. ``mention_idxs``: index of each mention's first token in the lemma list.
    """

    words: tuple[str, ...]
    mentions: tuple[tuple[str, str], ...]
    mention_idxs: tuple[int, ...]

    @property
    def node_words(self) -> tuple[str, ...]:
        return tuple(node for _, node in self.mentions)


class CaptionParser:
    """Caption -> object mentions, exactly as the reference ``CHAIR.caption_to_words``.

    ``resources`` defaults to ``load_chair_resources()``.
    """

    def __init__(
        self,
        resources: ChairResources | None = None,
        synonyms: Mapping[str, str] = SYNONYM_TO_NODE,
        phrases: Mapping[str, str] = PHRASE_MAP,
    ) -> None:
        self.resources = load_chair_resources() if resources is None else resources
        self.synonyms = synonyms
        self.phrases = phrases
        self._lemma_cache: dict[tuple[str, str], str] = {}

    def _lemmatize(self, word: str, pos: str) -> str:
        key = (word, pos)
        lemma = self._lemma_cache.get(key)
        if lemma is None:
            lemma = self._lemma_cache[key] = self.resources.lemmatize(word, pos)
        return lemma

    def lemmas(self, caption: str) -> list[str]:
        """Lower-case, tokenise, POS-tag the whole caption at once, and lemmatise."""
        tokens = tokenize_caption(caption)
        tagged = self.resources.tagger.tag(tokens) if tokens else []
        return [self._lemmatize(tok, _wordnet_pos(tag)) for tok, tag in tagged]

    def parse(self, caption: str) -> CaptionObjects:
        lemmas = self.lemmas(caption)
        merged: list[str] = []
        starts: list[int] = []
        i = 0
        while i < len(lemmas):  # greedy left-to-right merge of known two-word phrases
            starts.append(i)
            pair = " ".join(lemmas[i : i + 2])
            if pair in self.phrases:
                merged.append(self.phrases[pair])
                i += 2
            else:
                merged.append(lemmas[i])
                i += 1
        trigger, dropped = SEAT_RULE  # "the seat of the toilet" is no chair
        drop_seat = trigger in merged and dropped in merged
        mentions, idxs = [], []
        for word, start in zip(merged, starts):
            if drop_seat and word == dropped:
                continue
            node = self.synonyms.get(word)
            if node is not None:
                mentions.append((word, node))
                idxs.append(start)
        return CaptionObjects(tuple(merged), tuple(mentions), tuple(idxs))


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def coco_image_id(value: Any) -> int:
    """An image id from an int, a digit string or a COCO-style file name ("COCO_val2014_000000000042.jpg")."""
    if isinstance(value, bool):
        raise ValueError(f"not a COCO image id: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip()
        if s.isdigit():
            return int(s)
        m = _COCO_FILE_RE.match(os.path.basename(s))
        if m:
            return int(m.group(1))
    raise ValueError(f"not a COCO image id: {value!r} (expected an int, digits or a COCO file name)")


def _read_records(path: Path) -> list[tuple[str, Any]]:
    text = path.read_text(encoding="utf-8-sig")
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
        return [(f"{path}: item {i}", item) for i, item in enumerate(items)]
    out = []
    # Lines end at \n, \r\n or \r only (as the reference's file iteration): str.splitlines also splits
    # at U+2028, U+0085, \x0c ..., which a caption in a JSON string may hold raw.
    for lineno, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), start=1):
        if line.strip():
            try:
                out.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from exc
    return out


def load_captions(
    path: str | Path, *, image_id_key: str = "image_id", caption_key: str = "caption"
) -> list[dict[str, Any]]:
    """Read generated captions from a JSON array or JSON Lines file of objects.

    Returns ``[{"image_id": int, "caption": str}, ...]`` in file order; keys are configurable as in
    the reference (``--image_id_key``/``--caption_key``).
    """
    out = []
    for where, rec in _read_records(Path(path)):
        if not isinstance(rec, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        for key in (image_id_key, caption_key):
            if key not in rec:
                raise InputError(f"{where}: missing key {key!r}")
        if not isinstance(rec[caption_key], str):
            raise InputError(f"{where}: {caption_key} must be a string")
        try:
            image_id = coco_image_id(rec[image_id_key])
        except ValueError as exc:
            raise InputError(f"{where}: {exc}") from exc
        out.append({"image_id": image_id, "caption": rec[caption_key]})
    return out


def sample_image_ids(image_dir_or_ids: str | os.PathLike[str] | Iterable[Any], n: int, seed: int) -> list[int]:
    """Draw ``n`` COCO image ids reproducibly on any machine.

    Sorts the ids (a directory's image files are listed and sorted by name), then shuffles them
    with ``random.Random(seed)`` and keeps the first ``n``. OPERA's ``chair_eval.py`` shuffles the
    unsorted ``os.listdir`` order, which depends on the filesystem, so its draw cannot be
    reproduced; use its released id list when comparing with it. Save the ids you draw.
    """
    if isinstance(image_dir_or_ids, (str, os.PathLike)):
        folder = Path(image_dir_or_ids)
        if not folder.is_dir():
            raise InputError(f"{folder}: not a directory of images")
        names = sorted(f for f in os.listdir(folder) if f.lower().endswith(_IMAGE_EXTENSIONS))
        ids = [coco_image_id(name) for name in names]
    else:
        ids = sorted(coco_image_id(x) for x in image_dir_or_ids)
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate image ids in the pool")
    if not 0 < n <= len(ids):
        raise ValueError(f"cannot draw {n} images from a pool of {len(ids)}")
    random.Random(seed).shuffle(ids)
    return ids[:n]


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChairCaptionResult:
    """Per-caption details, like one entry of the reference's ``sentences`` output."""

    image_id: int
    caption: str
    words: tuple[str, ...]
    mentions: tuple[tuple[str, str], ...]
    hallucinated: tuple[tuple[str, str], ...]
    hallucination_idxs: tuple[int, ...]
    gt_objects: tuple[str, ...]
    recalled: tuple[str, ...]

    @property
    def chair_s(self) -> int:
        return int(bool(self.hallucinated))

    @property
    def chair_i(self) -> float:
        return len(self.hallucinated) / len(self.mentions) if self.mentions else 0.0

    @property
    def recall(self) -> float:
        return len(self.recalled) / len(self.gt_objects) if self.gt_objects else 0.0

    @property
    def len(self) -> int:
        return len(self.words)

    def to_reference_dict(self) -> dict[str, Any]:
        return {
            "image_id": self.image_id,
            "caption": self.caption,
            "mscoco_hallucinated_words": [list(p) for p in self.hallucinated],
            "mscoco_gt_words": list(self.gt_objects),
            "mscoco_generated_words": [node for _, node in self.mentions],
            "hallucination_idxs": list(self.hallucination_idxs),
            "words": list(self.words),
            "metrics": {"CHAIRs": self.chair_s, "CHAIRi": self.chair_i, "Recall": self.recall, "Len": self.len},
        }


@dataclass(frozen=True)
class ChairResult:
    """CHAIR over a set of captions. Ratios are fractions; ``len`` is the mean token count."""

    chair_s: float
    chair_i: float
    recall: float
    len: float
    n: int
    n_mentions: int
    n_hallucinated: int
    n_hallucinated_captions: int
    n_gt_objects: int
    n_recalled: int
    n_words: int
    captions: tuple[ChairCaptionResult, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, float | int]:
        """``{"chair_s", "chair_i", "recall", "len", "n"}``."""
        return {"chair_s": self.chair_s, "chair_i": self.chair_i, "recall": self.recall, "len": self.len, "n": self.n}

    def to_reference_dict(self) -> dict[str, Any]:
        """The reference's output layout (``Len`` stored as 0.01 x mean, as it does)."""
        return {
            "sentences": [c.to_reference_dict() for c in self.captions],
            "overall_metrics": {
                "CHAIRs": self.chair_s,
                "CHAIRi": self.chair_i,
                "Recall": self.recall,
                "Len": 0.01 * self.n_words / self.n if self.n else 0.0,
            },
        }


def _div(num: float, den: float, name: str, why: str, notes: list[str]) -> float:
    if den == 0:
        notes.append(f"{name} undefined ({why}); reported as 0.0")
        return 0.0
    return num / den


# ---------------------------------------------------------------------------------------------
# Evaluator
# ---------------------------------------------------------------------------------------------


def _as_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        return [Path(paths)]
    out = [Path(p) for p in paths]
    if not out:
        raise InputError("no annotation files given")
    return out


def _coco_int(value: Any, where: str) -> int:
    """A COCO id field, which must be a JSON integer (a digit string, float or bool is refused, not
    converted: ``int(1.7)`` would file an object under image 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: must be an integer id, got {value!r}")
    return value


def _load_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path`` (a COCO annotation file, or the ground-truth cache); UTF-8, BOM allowed."""
    if not path.is_file():
        raise InputError(f"{path}: COCO annotation file not found")
    try:
        data = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc}); a COCO annotation file is UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from exc
    if not isinstance(data, dict):
        raise InputError(
            f"{path}: a JSON {type(data).__name__}, not a COCO annotation file (a JSON object with 'annotations'); "
            "check which file the path names"
        )
    return data


class ChairEvaluator:
    """Ground truth (image id -> COCO node words) plus the caption parser; computes CHAIR.

    Build it with ``from_coco`` (optionally cached as JSON) or ``load_json``. The tagger and
    lemmatizer (``resources``, else ``load_chair_resources(nltk_data)``) are loaded lazily, when
    captions are first parsed.
    """

    def __init__(
        self,
        ground_truth: Mapping[int, Iterable[str]],
        *,
        nltk_data: str | Path | None = None,
        provenance: Mapping[str, Any] | None = None,
        resources: ChairResources | None = None,
    ) -> None:
        self.ground_truth: dict[int, frozenset[str]] = {int(k): frozenset(v) for k, v in ground_truth.items()}
        unknown = {w for objs in self.ground_truth.values() for w in objs} - set(SYNONYM_TO_NODE.values())
        if unknown:
            raise InputError(f"ground truth holds words that are not COCO node words: {sorted(unknown)[:10]}")
        self.provenance: dict[str, Any] = dict(provenance or {})
        self._nltk_data = nltk_data
        self._resources = resources
        self._parser: CaptionParser | None = None

    @property
    def parser(self) -> CaptionParser:
        if self._parser is None:
            self._parser = CaptionParser(self._resources or load_chair_resources(self._nltk_data))
        return self._parser

    def describe(self) -> dict[str, Any]:
        """The protocol facts to store next to a CHAIR number (loads the tagger and lemmatizer);
        ``language_data`` says which route they came from (shipped or NLTK data) with digests."""
        res = self.parser.resources
        return {
            "pipeline_version": PIPELINE_VERSION,
            "vocabulary": vocabulary_digest(),
            "nltk_version": res.nltk_version,
            "wordnet_version": res.wordnet_version,
            "language_data": dict(res.provenance),
            "tokenizer": "punkt-algorithm(english abbreviations)+treebank",
            "n_images_with_ground_truth": len(self.ground_truth),
            "ground_truth": {k: v for k, v in self.provenance.items() if k != "key"},
        }

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def from_coco(
        cls,
        instances_paths: str | Path | Sequence[str | Path],
        captions_paths: str | Path | Sequence[str | Path],
        *,
        cache_dir: str | Path | None = None,
        nltk_data: str | Path | None = None,
    ) -> ChairEvaluator:
        """Build the ground truth from COCO ``instances_*.json`` and ``captions_*.json`` files.

        The reference uses train2014 + val2014 of both (for val2014 images the val files alone give
        the same result). With ``cache_dir`` the ground truth is stored as JSON under a name derived
        from the inputs' sha256, the vocabulary, the pipeline version, the NLTK version and the
        tagger/lemmatizer route with its data digests (``ChairResources.cache_key``), and reused
        when all of them match.
        """
        inst, caps = _as_paths(instances_paths), _as_paths(captions_paths)
        for p in inst + caps:
            if not p.is_file():
                raise InputError(f"{p}: COCO annotation file not found")
        cache_file = None
        resources: ChairResources | None = None
        provenance: dict[str, Any] = {}
        if cache_dir is not None:
            import nltk

            resources = load_chair_resources(nltk_data)
            provenance = {
                "instances": sorted(
                    ({"file": p.name, "sha256": file_sha256(p)} for p in inst), key=lambda d: d["sha256"]
                ),
                "captions": sorted(
                    ({"file": p.name, "sha256": file_sha256(p)} for p in caps), key=lambda d: d["sha256"]
                ),
                "vocabulary": vocabulary_digest(),
                "pipeline_version": PIPELINE_VERSION,
                "nltk_version": nltk.__version__,
                "language_data": resources.cache_key(),
            }
            key_src = {
                k: ([d["sha256"] for d in v] if k in ("instances", "captions") else v) for k, v in provenance.items()
            }
            key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()
            provenance["key"] = key
            cache_file = Path(cache_dir) / f"chair_gt_{key[:16]}.json"
            if cache_file.is_file():
                cached = cls.load_json(cache_file, nltk_data=nltk_data, resources=resources)
                if cached.provenance.get("key") == key:
                    logger.info("CHAIR ground truth loaded from cache %s", cache_file)
                    return cached
                logger.warning("%s does not match its key; rebuilding", cache_file)
        evaluator = cls({}, nltk_data=nltk_data, provenance=provenance, resources=resources)
        gt = evaluator._build(inst, caps)
        evaluator.ground_truth = {k: frozenset(v) for k, v in gt.items()}
        if cache_file is not None:
            evaluator.save_json(cache_file)
            logger.info("CHAIR ground truth cached to %s", cache_file)
        return evaluator

    def _build(self, instances: Sequence[Path], captions: Sequence[Path]) -> dict[int, set[str]]:
        gt: dict[int, set[str]] = {}
        for path in instances:
            data = _load_json(path)
            try:
                names = {c["id"]: c["name"] for c in data["categories"]}
                for i, img in enumerate(data.get("images", [])):
                    gt.setdefault(_coco_int(img["id"], f"{path}: images[{i}].id"), set())
                for i, ann in enumerate(data["annotations"]):
                    name = names[ann["category_id"]]
                    node = SYNONYM_TO_NODE.get(name)
                    if node is None:
                        raise InputError(f"{path}: category {name!r} is not a COCO class of the CHAIR vocabulary")
                    gt.setdefault(_coco_int(ann["image_id"], f"{path}: annotations[{i}].image_id"), set()).add(node)
            except (KeyError, TypeError) as exc:
                raise InputError(f"{path}: not a COCO instances file ({exc!r})") from exc
            logger.info("CHAIR: %d instance annotations from %s", len(data["annotations"]), path)
        parser = self.parser
        for path in captions:
            data = _load_json(path)
            try:
                for i, img in enumerate(data.get("images", [])):
                    gt.setdefault(_coco_int(img["id"], f"{path}: images[{i}].id"), set())
                anns = [
                    (_coco_int(a["image_id"], f"{path}: annotations[{i}].image_id"), a["caption"])
                    for i, a in enumerate(data["annotations"])
                ]
                for i, (_, caption) in enumerate(anns):
                    if not isinstance(caption, str):
                        raise InputError(f"{path}: annotations[{i}].caption must be a string, got {caption!r}")
            except (KeyError, TypeError) as exc:
                raise InputError(f"{path}: not a COCO captions file ({exc!r})") from exc
            for i, (image_id, caption) in enumerate(anns):
                gt.setdefault(image_id, set()).update(parser.parse(caption).node_words)
                if (i + 1) % 50000 == 0:
                    logger.info("CHAIR: parsed %d/%d reference captions of %s", i + 1, len(anns), path)
            logger.info("CHAIR: %d reference captions from %s", len(anns), path)
        return gt

    # -- JSON cache ----------------------------------------------------------------------------
    def save_json(self, path: str | Path) -> None:
        """Write the ground truth as JSON (atomically)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": _CACHE_FORMAT,
            "version": 1,
            "provenance": self.provenance,
            "images": {str(k): sorted(v) for k, v in sorted(self.ground_truth.items())},
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(payload, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load_json(
        cls, path: str | Path, *, nltk_data: str | Path | None = None, resources: ChairResources | None = None
    ) -> ChairEvaluator:
        """Read ground truth written by ``save_json``."""
        data = _load_json(Path(path))
        if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT or data.get("version") != 1:
            raise InputError(f"{path}: not an mmfast CHAIR ground-truth file (format {_CACHE_FORMAT}, version 1)")
        provenance = data.get("provenance", {})
        import nltk

        built_with = provenance.get("nltk_version")
        if built_with and built_with != nltk.__version__:
            logger.warning(
                "%s was built with nltk %s but nltk %s is installed; lemmas may differ",
                path,
                built_with,
                nltk.__version__,
            )
        return cls(
            {int(k): v for k, v in data["images"].items()},
            nltk_data=nltk_data,
            provenance=provenance,
            resources=resources,
        )

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(
        self,
        captions: Iterable[Mapping[str, Any]],
        *,
        image_id_key: str = "image_id",
        caption_key: str = "caption",
        missing: Literal["error", "empty"] = "error",
    ) -> ChairResult:
        """Compute CHAIR for ``[{image_id, caption}, ...]`` (keys configurable).

        ``missing="error"`` refuses image ids without ground truth; ``"empty"`` treats them as
        having no objects, as the reference does (every mention then counts as hallucinated).
        """
        if missing not in ("error", "empty"):
            raise ValueError(f"missing must be 'error' or 'empty', got {missing!r}")
        items = []
        for i, rec in enumerate(captions):
            for key in (image_id_key, caption_key):
                if key not in rec:
                    raise InputError(f"caption {i}: missing key {key!r}")
            if not isinstance(rec[caption_key], str):
                raise InputError(f"caption {i}: {caption_key} must be a string")
            try:
                items.append((coco_image_id(rec[image_id_key]), rec[caption_key]))
            except ValueError as exc:
                raise InputError(f"caption {i}: {exc}") from exc
        absent = sorted({image_id for image_id, _ in items if image_id not in self.ground_truth})
        if absent and missing == "error":
            raise InputError(
                f"{len(absent)} image id(s) have no CHAIR ground truth, e.g. {absent[:10]}; "
                "check the annotation files (train+val 2014) or pass missing='empty'"
            )
        results = []
        for image_id, caption in items:
            parsed = self.parser.parse(caption)
            gt = self.ground_truth.get(image_id, frozenset())
            hallucinated = tuple(m for m in parsed.mentions if m[1] not in gt)
            idxs = tuple(idx for m, idx in zip(parsed.mentions, parsed.mention_idxs) if m[1] not in gt)
            recalled = tuple(sorted({node for _, node in parsed.mentions if node in gt}))
            results.append(
                ChairCaptionResult(
                    image_id, caption, parsed.words, parsed.mentions, hallucinated, idxs, tuple(sorted(gt)), recalled
                )
            )
        return summarize_chair(results)

    def evaluate_file(
        self,
        path: str | Path,
        *,
        image_id_key: str = "image_id",
        caption_key: str = "caption",
        missing: Literal["error", "empty"] = "error",
    ) -> ChairResult:
        """``evaluate`` on a JSON / JSON Lines caption file (see ``load_captions``)."""
        caps = load_captions(path, image_id_key=image_id_key, caption_key=caption_key)
        return self.evaluate(caps, missing=missing)


def summarize_chair(captions: Sequence[ChairCaptionResult]) -> ChairResult:
    """Aggregate per-caption results into CHAIR_s, CHAIR_i, recall and len (reference formulas)."""
    notes: list[str] = []
    n = len(captions)
    n_mentions = sum(len(c.mentions) for c in captions)
    n_hall = sum(len(c.hallucinated) for c in captions)
    n_hall_caps = sum(c.chair_s for c in captions)
    n_gt = sum(len(c.gt_objects) for c in captions)
    n_rec = sum(len(c.recalled) for c in captions)
    n_words = sum(c.len for c in captions)
    return ChairResult(
        chair_s=_div(n_hall_caps, n, "chair_s", "no captions", notes),
        chair_i=_div(n_hall, n_mentions, "chair_i", "no object mentions", notes),
        recall=_div(n_rec, n_gt, "recall", "no ground-truth objects", notes),
        len=_div(n_words, n, "len", "no captions", notes),
        n=n,
        n_mentions=n_mentions,
        n_hallucinated=n_hall,
        n_hallucinated_captions=n_hall_caps,
        n_gt_objects=n_gt,
        n_recalled=n_rec,
        n_words=n_words,
        captions=tuple(captions),
        notes=tuple(dict.fromkeys(notes)),
    )
