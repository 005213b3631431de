"""M3ID (Favero et al., CVPR 2024, arXiv 2403.14003), as reimplemented by RITUAL.

Algorithm: an image-free branch (the same prompt without the image) gives ``l_u``; the fused logits
``l + (1 - g_t) / g_t (l - l_u)`` with ``g_t = exp(-lambda t)`` (lambda = 0.02, t = index of the
generated token) amplify what the image contributes more and more as the answer grows (at t = 0 the
weight is 0). Plausibility cutoff beta on the clean branch, then warpers and sampling (RITUAL's code).
Hook points: an image-free branch (shorter sequence: its own forward) via the branch manager.
Image-free prompt: RITUAL deletes only the image placeholder id (-200) from the prompt's ids, so the
newline that followed ``<image>`` stays (``USER: \n{question} ASSISTANT:``); here likewise the image
prompt's ids with the image placeholder removed (``ctx.text_only_inputs(batch, strip_image_tokens=True)``).
The separator tokens come from transformers' tokenizer of the whole templated text, where RITUAL's
``tokenizer_image_token`` tokenises the pieces around ``<image>`` separately (the ids at the seam can
differ by a space token on the original Llama tokenizer).
Deviation: the weight (1 - g_t) / g_t is capped at e^50 (lambda t > 50), where the formula divides by zero
(g_t underflows) or overflows fp32 into NaN; past it the contrast alone orders the tokens, the formula's limit
(the default lambda reaches it after 2,500 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capabilities import Capabilities
from ..config import opt
from ..registry import DECODERS
from .branches import Branch, MultiBranchDecoder, m3id


@DECODERS.register("m3id", description="M3ID: amplify the image's contribution against an image-free branch")
class M3ID(MultiBranchDecoder):
    """M3ID."""

    caps = Capabilities(search="branches")

    @dataclass(frozen=True)
    class Config:
        lam: float = opt(0.02, lo=0.0, hi=10.0, doc="decay rate of gamma_t = exp(-lambda t)")
        beta: float = opt(0.1, lo=0.0, hi=1.0, doc="adaptive plausibility cutoff (0 = off)")
        sample: bool = opt(True, doc="sample (true) or argmax (false)")
        temperature: float = opt(1.0, lo=1e-4, hi=100.0)
        top_p: float = opt(1.0, lo=0.0, hi=1.0)
        top_k: int = opt(0, lo=0)

    def branches(self, req):
        return [Branch("no_image", self.ctx.text_only_inputs(req.batch, strip_image_tokens=True))]

    def fuse(self, logits, step):
        return m3id(logits["clean"], logits["no_image"], step, self.config.lam)
