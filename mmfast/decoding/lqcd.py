"""LQCD: Leading Query Contrastive Decoding (Zhao et al., arXiv 2408.11261 v1).

Algorithm: the user's (neutral) query and a *leading* rewording of it (the same question with a
leading or deceptive cue) are decoded as two branches over the same image; the fused logits
``(1 + alpha) l(neutral) - alpha l(leading)`` suppress the tokens that the leading cue boosts
("sycophancy tokens"), restricted to the neutral branch's plausible set (beta), then sampled or argmax.
The paper applies it to neutral queries too, with a leading variant as the negative.

What was verified: the paper body and its curated templates were not retrievable here; the fusion
follows the abstract and the surveys' formula, and ``alpha = 1, beta = 0.1`` follow VCD-style
defaults (unverified). The leading templates below are mmfast's own, one drawn per query (seeded);
replace them with ``templates`` in the recipe to reproduce the paper's once available. v2 of the
paper (ITSM) adds an LLM query neutraliser and a sentiment scaler, which are not implemented.
Hook points: a second branch (a different prompt: its own cache) via the branch manager.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..capabilities import Capabilities
from ..config import opt
from ..registry import DECODERS
from .branches import Branch, MultiBranchDecoder, WarpedBranchConfig, contrastive, query_rng

#: Leading cues for yes/no questions ("{q}" = the question) ...
YES_NO_TEMPLATES: tuple[str, ...] = (
    "{q} I am sure the answer is yes.",
    "{q} Everyone says there is one, right?",
    "{q} It is obvious that there is, isn't it?",
)
#: ... and for open-ended requests ("{q}" = the request).
OPEN_TEMPLATES: tuple[str, ...] = (
    "{q} Be sure to mention every object that is usually found in such a scene.",
    "{q} I can see many things in it, including people and animals.",
)
_YES_NO = re.compile(r"^\s*(is|are|does|do|can|was|were|has|have)\b", re.IGNORECASE)


def leading_query(question: str, rng, yes_no: tuple[str, ...], open_ended: tuple[str, ...]) -> str:
    """A leading rewording of ``question`` (yes/no questions and open requests get different cues)."""
    first_line, _, rest = question.partition("\n")
    pool = yes_no if _YES_NO.match(first_line) else open_ended
    lead = rng.choice(pool).format(q=first_line.strip())
    return f"{lead}\n{rest}" if rest else lead


@DECODERS.register("lqcd", description="LQCD: contrast against a leading rewording of the query")
class LQCD(MultiBranchDecoder):
    """Leading Query Contrastive Decoding."""

    caps = Capabilities(search="branches", images_only="its branch re-prompts the images with a leading query")

    @dataclass(frozen=True)
    class Config(WarpedBranchConfig):
        alpha: float = opt(1.0, lo=0.0, hi=20.0, doc="contrast weight (unverified default)")
        yes_no_templates: tuple[str, ...] = opt(
            YES_NO_TEMPLATES, min_items=1, doc="leading cues for yes/no questions; {q} = question"
        )
        open_templates: tuple[str, ...] = opt(
            OPEN_TEMPLATES, min_items=1, doc="leading cues for open requests; {q} = request"
        )

        def __post_init__(self) -> None:
            for key in ("yes_no_templates", "open_templates"):
                for i, template in enumerate(getattr(self, key)):
                    try:
                        template.format(q="x")
                    except (KeyError, IndexError, ValueError) as exc:
                        raise ValueError(
                            f"{key}[{i}] {template!r} does not format with {{q}} alone ({type(exc).__name__}: "
                            f"{exc}); write the question as {{q}} and other braces doubled ({{{{ }}}})"
                        ) from None

    def branches(self, req):
        cfg = self.config
        leads = [
            leading_query(p, query_rng(req.seed, p, ims[0]), cfg.yes_no_templates, cfg.open_templates)
            for p, ims in zip(req.batch.prompts, req.batch.images)
        ]
        batch = self.ctx.reprompt(req.batch, leads)
        return [Branch("leading", self.ctx.build_inputs(batch, req.vision), {"per_sample_leading_query": leads})]

    def fuse(self, logits, step):
        return contrastive(logits["clean"], logits["leading"], self.config.alpha)
