"""NLTK's ``WordNetLemmatizer().lemmatize(form, pos)`` from tables shipped in the package.

CHAIR lemmatises every token with NLTK's ``WordNetLemmatizer``, which is WordNet's *morphy* as
NLTK's ``WordNetCorpusReader._morphy`` implements it, over the WordNet 3.0 database:

1. if ``form`` is a key of the POS's exception list (``{noun,verb,adj,adv}.exc``) the candidates
   are its bases ``E[form]``, and no detachment rule is applied (even when ``E[form]`` holds no
   lemma); otherwise they are ``form[:-len(old)] + new`` for each ``(old, new)`` of the POS's
   detachment rules (NLTK's ``MORPHOLOGICAL_SUBSTITUTIONS``, in that order) with
   ``form.endswith(old)``: one pass, no recursion;
2. ``[form] + candidates`` is filtered to the WordNet lemma names of that POS, keeping the first
   occurrence of each, in order (``form`` itself first);
3. ``lemmatize`` returns the first shortest survivor (``min(..., key=len)``), or ``form`` when
   none survives.

``MorphyLemmatizer`` does exactly that from ``mmfast/assets/chair/wordnet_morphy.json.gz`` (built
by ``scripts/build_chair_data.py`` from NLTK's reader; it holds the rules, NLTK's parse of the
exception lists and, per POS, the lemma names step 2 can ever consult). It is exact for every
string and POS ``n v a r`` (``tests/test_chair_identity.py`` compares it with NLTK on every WordNet
lemma name, exception form and one-rule inflection). Like NLTK's ``_morphy`` it does not
lower-case (CHAIR lower-cases captions before tokenising).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FORMAT = "mmfast.chair.wordnet_morphy"
VERSION = 1
POS = ("n", "v", "a", "r")  # the WordNet POS CHAIR's tag mapping produces


@dataclass(frozen=True)
class MorphyLemmatizer:
    """``lemmatize(form, pos)`` == ``nltk.stem.WordNetLemmatizer().lemmatize(form, pos)`` for POS
    ``n v a r``. ``rules[pos]``: ``(old, new)`` detachment rules in NLTK's order;
    ``exceptions[pos]``: exception form -> bases; ``names[pos]``: the WordNet lemma names of that POS
    that morphy can consult (see ``scripts/build_chair_data.py``)."""

    rules: Mapping[str, tuple[tuple[str, str], ...]]
    exceptions: Mapping[str, Mapping[str, tuple[str, ...]]]
    names: Mapping[str, frozenset[str]]

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> MorphyLemmatizer:
        """From the JSON document the build script writes (``ValueError`` if it is not one)."""
        if not isinstance(doc, Mapping) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"not an mmfast WordNet morphy table ({FORMAT}, version {VERSION})")
        try:
            rules = {p: tuple((str(old), str(new)) for old, new in doc["rules"][p]) for p in POS}
            exceptions = {
                p: {str(form): tuple(str(b) for b in bases) for form, bases in doc["exceptions"][p].items()}
                for p in POS
            }
            names = {p: frozenset(str(n) for n in doc["lemma_names"][p]) for p in POS}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed WordNet morphy table ({exc!r})") from exc
        if any(not old for rs in rules.values() for old, _ in rs):
            raise ValueError("malformed WordNet morphy table (a rule with an empty suffix)")
        return cls(rules, exceptions, names)

    def morphy(self, form: str, pos: str) -> list[str]:
        """NLTK's ``WordNetCorpusReader._morphy(form, pos)``: every lemma ``form`` can have."""
        if pos not in self.names:
            raise ValueError(f"WordNet POS must be one of {POS}, got {pos!r}")
        bases: Sequence[str] | None = self.exceptions[pos].get(form)
        if bases is None:
            bases = [form[: -len(old)] + new for old, new in self.rules[pos] if form.endswith(old)]
        names = self.names[pos]
        return list(dict.fromkeys(f for f in (form, *bases) if f in names))  # first occurrences, in order

    def lemmatize(self, form: str, pos: str) -> str:
        """The first shortest of ``morphy(form, pos)``, else ``form``."""
        lemmas = self.morphy(form, pos)
        return min(lemmas, key=len) if lemmas else form

    __call__ = lemmatize
