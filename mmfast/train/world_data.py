"""Training data from the generated world: pixels, dense patch labels, and instruction conversations.

The train split is rendered in memory (``render_image`` is deterministic per image id), never the
val split that the evaluations use. Conversations follow the LLaVA-1.5 format the chat template
produces at inference (``USER: <image>\\n{q} ASSISTANT: {a}</s>USER: {q2} ASSISTANT: ...``).
"""

from __future__ import annotations

import logging
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from ..world import CATEGORIES, CATEGORY_BY_NAME, NUM_LABELS, ImageAnnotation, WorldConfig, render_image
from ..world.text import (
    CAPTION_PROMPTS,
    DETAIL_PROMPTS,
    SHORT_ANSWER_SUFFIX,
    captions,
    detailed_description,
    short_qa,
    text_rng,
    yes_no_questions,
)

logger = logging.getLogger(__name__)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
N_CATS = len(CATEGORIES)


@dataclass
class WorldImages:
    """Rendered images of one split with dense patch labels."""

    pixels: np.ndarray  # [N, H, W, 3] uint8
    patch_hist: np.ndarray  # [N, P, NUM_LABELS] uint8 pixel counts per patch and label
    present: np.ndarray  # [N, N_CATS] bool multi-hot of categories present
    annotations: list[ImageAnnotation]
    seed: int
    split: str

    def __len__(self) -> int:
        return len(self.annotations)


def _render_one(args: tuple[int, str, int, int]) -> tuple[np.ndarray, np.ndarray, ImageAnnotation]:
    seed, split, image_id, patch = args
    r = render_image(seed, split, image_id, WorldConfig())
    pix = np.asarray(r.image, dtype=np.uint8)
    lab = r.label_map.astype(np.int64)  # [H, W]
    h, w = lab.shape
    gh, gw = h // patch, w // patch
    blocks = lab[: gh * patch, : gw * patch].reshape(gh, patch, gw, patch).transpose(0, 2, 1, 3).reshape(gh * gw, -1)
    hist = np.zeros((gh * gw, NUM_LABELS), dtype=np.uint8)
    for p in range(gh * gw):
        hist[p] = np.bincount(blocks[p], minlength=NUM_LABELS)[:NUM_LABELS].clip(max=255)
    return pix, hist, r.annotation


def render_split(seed: int, split: str, n: int, patch: int, workers: int = 2, start: int = 1) -> WorldImages:
    """Render images ``start..start+n-1`` of ``split`` with their patch label histograms."""
    jobs = [(seed, split, i, patch) for i in range(start, start + n)]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            out = list(tqdm(pool.map(_render_one, jobs, chunksize=32), total=n, desc=f"render {split}"))
    else:
        out = [_render_one(j) for j in tqdm(jobs, desc=f"render {split}")]
    pixels = np.stack([o[0] for o in out])
    hist = np.stack([o[1] for o in out])
    anns = [o[2] for o in out]
    present = np.zeros((n, N_CATS), dtype=bool)
    for i, ann in enumerate(anns):
        for name in ann.object_names():
            present[i, CATEGORY_BY_NAME[name].label - 1] = True
    return WorldImages(pixels, hist, present, anns, seed, split)


def to_pixel_values(pixels: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> CLIP-normalised float [N, 3, H, W] (what the image processor does)."""
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255.0
    mean = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (x - mean) / std


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str
    kind: str  # detail / caption / yesno / count / color / place / where
    queried: int = -1  # category index (0-based) asked about in a yes/no turn


def conversation(ann: ImageAnnotation, rng: random.Random) -> list[Turn]:
    """One training conversation about an image.

    The first turn is a detailed description (35%), a caption (25%) or a question (40%), so that
    every evaluation format appears as the opening turn; 2-5 short questions follow, half of the
    yes/no ones with LLaVA's short-answer suffix.
    """

    def yn_turn(qa) -> Turn:
        name = qa.question.split(" in the image")[0].split(" ", 3)[-1]
        q = qa.question if rng.random() < 0.5 else f"{qa.question}\n{SHORT_ANSWER_SUFFIX}"
        return Turn(q, qa.answer, "yesno", CATEGORY_BY_NAME[name].label - 1)

    turns: list[Turn] = []
    u = rng.random()
    if u < 0.35:
        turns.append(Turn(rng.choice(DETAIL_PROMPTS), detailed_description(ann, rng), "detail"))
    elif u < 0.60:
        turns.append(Turn(rng.choice(CAPTION_PROMPTS), rng.choice(captions(ann, rng)), "caption"))
    yn = [yn_turn(qa) for qa in yes_no_questions(ann, rng)]
    qa = [Turn(q.question, q.answer, q.kind) for q in short_qa(ann, rng, k=3)]
    extra = yn[: rng.randint(2, 4)] + qa[: rng.randint(0, 2)]
    rng.shuffle(extra)
    if not turns and extra[0].kind != "yesno" and rng.random() < 0.7:
        j = next((i for i, t in enumerate(extra) if t.kind == "yesno"), 0)
        extra.insert(0, extra.pop(j))
    return turns + extra


@dataclass
class EncodedConversation:
    ids: list[int]  # with ONE image token (expanded to the patch count at collate time)
    labels: list[int]  # -100 outside answers
    probe_pos: list[int]  # index (in ids) of the position that predicts each yes/no turn's "Yes"/"No"
    probe_cat: list[int]  # queried category of each yes/no turn
    probe_yes: list[bool]  # whether that turn's answer is "Yes" (the object is present)
    mention_pos: list[int] = field(default_factory=list)  # positions predicting an object word in a caption
    mention_cat: list[int] = field(default_factory=list)  # that word's category index


# id(tokenizer) -> (the tokenizer, its noun sequences): the tokenizer is kept so that its id cannot be
# reused by another tokenizer while the entry exists (a freed tokenizer's id is often reused)
_NOUN_CACHE: dict[int, tuple[object, list[tuple[tuple[int, ...], int]]]] = {}


def object_words(tokenizer) -> list[tuple[tuple[int, ...], int]]:
    """Token sequences of every category noun (singular and plural, with a leading space), longest
    first, with the category index: used to find object mentions in captions."""
    key = id(tokenizer)
    cached = _NOUN_CACHE.get(key)
    if cached is None or cached[0] is not tokenizer:
        seqs = {}
        for ci, cat in enumerate(CATEGORIES):
            for pair in cat.nouns:
                for word in pair:
                    seqs[tuple(tokenizer(" " + word, add_special_tokens=False)["input_ids"])] = ci
        cached = _NOUN_CACHE[key] = (tokenizer, sorted(seqs.items(), key=lambda kv: -len(kv[0])))
    return cached[1]


def _mentions(tokenizer, answer_ids: list[int]) -> list[tuple[int, int]]:
    """(offset of the word's first token in ``answer_ids``, category) for each object noun."""
    out, i = [], 0
    words = object_words(tokenizer)
    while i < len(answer_ids):
        for seq, cat in words:
            if tuple(answer_ids[i : i + len(seq)]) == seq:
                out.append((i, cat))
                i += len(seq) - 1
                break
        i += 1
    return out


def encode_conversation(tokenizer, turns: list[Turn]) -> EncodedConversation:
    """Tokenise turns exactly as inference builds prompts; answers end with EOS."""
    ids: list[int] = []
    labels: list[int] = []
    probe_pos: list[int] = []
    probe_cat: list[int] = []
    probe_yes: list[bool] = []
    mention_pos: list[int] = []
    mention_cat: list[int] = []
    for i, t in enumerate(turns):
        prompt = f"USER: <image>\n{t.question} ASSISTANT:" if i == 0 else f"USER: {t.question} ASSISTANT:"
        p = tokenizer(prompt, add_special_tokens=(i == 0))["input_ids"]
        a = tokenizer(" " + t.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += p
        labels += [-100] * len(p)
        if t.kind == "yesno":
            # the decision is predicted where the answer's first *word* token is predicted: with a BPE
            # that splits " Yes" into a space token and "Yes", that is one position after the prompt
            probe_pos.append(len(ids) - 1 + _lead_len(tokenizer, t.answer))
            probe_cat.append(t.queried)
            probe_yes.append(t.answer == "Yes")
        if t.kind in ("detail", "caption"):
            for off, cat in _mentions(tokenizer, a):
                mention_pos.append(len(ids) + off - 1)  # the position that predicts the word
                mention_cat.append(cat)
        ids += a
        labels += a
    return EncodedConversation(ids, labels, probe_pos, probe_cat, probe_yes, mention_pos, mention_cat)


def _lead_len(tokenizer, answer: str) -> int:
    """Tokens of ``" " + answer`` before the one that starts the word (0 when the space is merged)."""
    pieces = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    alone = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return max(0, len(pieces) - len(alone))


def conversation_rng(seed: int, epoch: int, image_id: int) -> random.Random:
    return text_rng(seed, "train", image_id, f"conversation-{epoch}")
