"""Model adapters: where each VLM family keeps its vision tower, projector, LLM layers and image tokens.

Everything in mmfast reaches the model through an adapter, so no method hard-codes a module path, an
image-token count or an image span. One adapter class per model family (``llava.py``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class VisionBatch:
    """Vision features of a batch of images, between the vision tower and the LLM.

    Feature-stage pruners and mergers (VisionZip, MustDrop stage 1, HICom, ...) edit this object.
    ``features[i]`` are the selected-layer patch features of image ``i`` *before* the projector
    ([N_i, Dv]); a stage that produces LLM-width tokens itself sets ``projected[i]`` ([N_i, d]).
    ``patch_ids[i]`` maps each token to its raster patch index in the original grid (-1 for merged
    or synthetic tokens), which keeps spatial bookkeeping honest after reordering.
    """

    features: list[torch.Tensor]  # per image [N_i, Dv]
    patch_ids: list[torch.Tensor]  # per image [N_i] long
    cls: torch.Tensor | None  # [n_images, Dv] CLS hidden state of the feature layer (None if the tower has none)
    grid: tuple[int, int]  # (rows, cols) of the patch grid
    pixel_values: torch.Tensor  # [n_images, 3, H, W] as fed to the tower
    projected: list[torch.Tensor | None] = field(default_factory=list)  # per image [N_i, d] or None
    extras: dict[str, Any] = field(default_factory=dict)  # probe results and per-method side data
    #: per-token data that travels with the tokens into ``LMInputs.tags``: name -> per image [N_i]
    #: (bool or long; text and padding get 0). A stage that selects rows must select these too.
    tags: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: per-method statistics of this encoding (method name -> stats; ``per_sample_*`` lists)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the tower's output before any feature stage (set by the session; DAMRO's outlier branch)
    raw: Any = None

    def __post_init__(self) -> None:
        if not self.projected:
            self.projected = [None] * len(self.features)

    @property
    def n_images(self) -> int:
        return len(self.features)

    @staticmethod
    def concat(parts: list[VisionBatch]) -> VisionBatch:
        """Images of several encodings (one tower call each) as one batch. List-valued ``extras``
        and tags are joined per image; other extras must agree."""
        if len(parts) == 1:
            return parts[0]
        extras: dict[str, Any] = {}
        for p in parts:
            for k, v in p.extras.items():
                extras[k] = extras.get(k, []) + list(v) if isinstance(v, list) else v
        return VisionBatch(
            features=[f for p in parts for f in p.features],
            patch_ids=[i for p in parts for i in p.patch_ids],
            cls=None if parts[0].cls is None else torch.cat([p.cls for p in parts]),
            grid=parts[0].grid,
            pixel_values=torch.cat([p.pixel_values for p in parts]),
            projected=[x for p in parts for x in p.projected],
            extras=extras,
            tags={k: [t for p in parts for t in p.tags[k]] for k in parts[0].tags},
        )

    def counts(self) -> list[int]:
        return [int(p.shape[0]) if p is not None else int(f.shape[0]) for f, p in zip(self.features, self.projected)]


@dataclass
class LMInputs:
    """A left-padded batch ready for the language model.

    All tensors are [B, L]: ``input_ids`` holds the image token id at image positions and the pad id at
    padding; ``image_mask`` marks vision tokens; ``patch_ids`` maps a vision token to its patch (-1 for
    text); ``image_index`` says which image of the sample a vision token came from (-1 for text).
    """

    embeds: torch.Tensor  # [B, L, d]
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L] long (1 = real token)
    position_ids: torch.Tensor  # [B, L] long
    image_mask: torch.Tensor  # [B, L] bool
    patch_ids: torch.Tensor  # [B, L] long
    image_index: torch.Tensor  # [B, L] long
    #: per-token data of methods (e.g. MustDrop's key set), each [B, L]; 0 / False at text and padding.
    #: Concatenation, row selection and appends carry them, so they follow the tokens into every
    #: branch, beam and speculative rollback.
    tags: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def length(self) -> int:
        return int(self.embeds.shape[1])

    def n_vision_tokens(self) -> list[int]:
        return self.image_mask.sum(1).tolist()

    def text_after_image(self) -> torch.Tensor:
        """[B, L] bool: real tokens after the last vision token (the instruction + assistant prompt)."""
        pos = torch.arange(self.length, device=self.image_mask.device).expand_as(self.image_mask)
        last_img = torch.where(self.image_mask, pos, torch.full_like(pos, -1)).max(1, keepdim=True).values
        return (pos > last_img) & self.attention_mask.bool()

    def append(self, ids: torch.Tensor, embeds: torch.Tensor) -> LMInputs:
        """The inputs with generated text tokens ``ids`` ([B, Q], embeddings [B, Q, d]) appended; they
        are marked in the ``GENERATED`` tag (decode-without-cache rules tell them from the prompt)."""
        bsz, q = ids.shape
        dev = ids.device
        last = self.position_ids[:, -1:]
        tags = {k: torch.cat([t, t.new_zeros(bsz, q)], 1) for k, t in self.tags.items() if k != GENERATED}
        done = self.tags.get(GENERATED, torch.zeros_like(self.image_mask))
        tags[GENERATED] = torch.cat([done, torch.ones(bsz, q, dtype=torch.bool, device=dev)], 1)
        return LMInputs(
            torch.cat([self.embeds, embeds.to(self.embeds.dtype)], 1),
            torch.cat([self.input_ids, ids], 1),
            torch.cat([self.attention_mask, torch.ones(bsz, q, dtype=self.attention_mask.dtype, device=dev)], 1),
            torch.cat([self.position_ids, last + torch.arange(1, q + 1, device=dev)], 1),
            torch.cat([self.image_mask, torch.zeros(bsz, q, dtype=torch.bool, device=dev)], 1),
            torch.cat([self.patch_ids, torch.full((bsz, q), -1, dtype=torch.long, device=dev)], 1),
            torch.cat([self.image_index, torch.full((bsz, q), -1, dtype=torch.long, device=dev)], 1),
            tags,
        )

    @staticmethod
    def cat(parts: list[LMInputs]) -> LMInputs:
        """Concatenate equal-length inputs along the batch."""
        if len(parts) == 1:
            return parts[0]
        names = sorted({k for p in parts for k in p.tags})
        tags = {}
        for k in names:  # a branch without the tag (no such tokens) contributes zeros
            like = next(p.tags[k] for p in parts if k in p.tags)
            tags[k] = torch.cat([p.tags[k] if k in p.tags else like.new_zeros(p.input_ids.shape) for p in parts], 0)
        return LMInputs(*(torch.cat([getattr(p, f) for p in parts], 0) for f in _LMINPUT_FIELDS), tags)

    def crop_left(self, n: int) -> LMInputs:
        """The inputs without their first ``n`` slots (padding of a single-row batch)."""
        if n == 0:
            return self
        return LMInputs(*(getattr(self, f)[:, n:] for f in _LMINPUT_FIELDS), {k: t[:, n:] for k, t in self.tags.items()})

    def select(self, index: torch.Tensor) -> LMInputs:
        """Rows ``index`` of the batch (used to split or repeat branches)."""
        return LMInputs(*(getattr(self, f)[index] for f in _LMINPUT_FIELDS), {k: t[index] for k, t in self.tags.items()})


GENERATED = "generated"  # LMInputs tag: tokens appended by decoding (bool)
_LMINPUT_FIELDS = ("embeds", "input_ids", "attention_mask", "position_ids", "image_mask", "patch_ids", "image_index")


class VLMAdapter:
    """Protocol every model family implements. Attribute access only; no forward logic of its own
    beyond encoding images and splicing features, which differ per family."""

    family: str = ""
    model: nn.Module

    # -- structure -------------------------------------------------------------------------------
    @property
    def language_model(self) -> nn.Module: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def vision_layers(self) -> nn.ModuleList: ...

    @property
    def lm_head(self) -> nn.Module: ...

    @property
    def text_config(self): ...

    @property
    def vision_config(self): ...

    @property
    def image_token_id(self) -> int: ...

    @property
    def grid(self) -> tuple[int, int]: ...

    @property
    def has_cls(self) -> bool: ...

    def vision_feature_layer_index(self) -> int:
        """0-based index of the vision encoder layer whose output feeds the projector."""
        ...

    # -- compute ---------------------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None = None) -> VisionBatch: ...

    def project(self, vision: VisionBatch) -> list[torch.Tensor]: ...

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor: ...


def build_lm_inputs(
    adapter: VLMAdapter,
    token_ids: list[list[int]],
    image_tokens: list[list[torch.Tensor]],
    image_patch_ids: list[list[torch.Tensor]],
    pad_id: int,
    image_tags: dict[str, list[list[torch.Tensor]]] | None = None,
) -> LMInputs:
    """Splice projected image tokens into tokenised prompts and left-pad the batch.

    ``token_ids[b]`` holds one ``image_token_id`` per image of sample ``b``; each is replaced by the
    ``image_tokens[b][j]`` rows ([N_j, d]) of that image, so pruned images of any length fit, and the
    placeholder run always equals the feature count. ``image_tags[name][b][j]`` ([N_j]) are spliced
    into ``LMInputs.tags[name]`` at the same slots (0 elsewhere).
    """
    image_tags = image_tags or {}
    image_id = adapter.image_token_id
    embed_layer = adapter.language_model.embed_tokens
    device = embed_layer.weight.device
    rows = []
    tag_rows: dict[str, list[torch.Tensor]] = {}
    for b, ids in enumerate(token_ids):
        n_slots = sum(1 for t in ids if t == image_id)
        if n_slots != len(image_tokens[b]):
            raise ValueError(f"sample {b}: prompt has {n_slots} image slots but {len(image_tokens[b])} images were given")
        pieces, ids_out, img_mask, pids, img_idx = [], [], [], [], []
        tag_pieces: dict[str, list[torch.Tensor]] = {k: [] for k in image_tags}
        text_run: list[int] = []
        j = 0

        def flush() -> None:
            if text_run:
                t = torch.tensor(text_run, device=device)
                pieces.append(embed_layer(t))  # [n_text, d]
                ids_out.append(t)
                img_mask.append(torch.zeros(len(text_run), dtype=torch.bool, device=device))
                pids.append(torch.full((len(text_run),), -1, device=device))
                img_idx.append(torch.full((len(text_run),), -1, device=device))
                for k, per in image_tags.items():
                    tag_pieces[k].append(torch.zeros(len(text_run), dtype=per[b][0].dtype if per[b] else torch.long, device=device))
                text_run.clear()

        for t in ids:
            if t != image_id:
                text_run.append(t)
                continue
            flush()
            feats = image_tokens[b][j].to(device=device, dtype=embed_layer.weight.dtype)  # [N_j, d]
            n = feats.shape[0]
            pieces.append(feats)
            ids_out.append(torch.full((n,), image_id, device=device))
            img_mask.append(torch.ones(n, dtype=torch.bool, device=device))
            pids.append(image_patch_ids[b][j].to(device))
            img_idx.append(torch.full((n,), j, device=device))
            for k, per in image_tags.items():
                tag_pieces[k].append(per[b][j].to(device))
            j += 1
        flush()
        rows.append((torch.cat(pieces), torch.cat(ids_out), torch.cat(img_mask), torch.cat(pids), torch.cat(img_idx)))
        for k in image_tags:
            tag_rows.setdefault(k, []).append(torch.cat(tag_pieces[k]))

    length = max(r[0].shape[0] for r in rows)
    bsz, d = len(rows), rows[0][0].shape[-1]
    embeds = torch.zeros(bsz, length, d, device=device, dtype=rows[0][0].dtype)
    input_ids = torch.full((bsz, length), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros(bsz, length, dtype=torch.long, device=device)
    image_mask = torch.zeros(bsz, length, dtype=torch.bool, device=device)
    patch_ids = torch.full((bsz, length), -1, dtype=torch.long, device=device)
    image_index = torch.full((bsz, length), -1, dtype=torch.long, device=device)
    pad_embed = embed_layer(torch.tensor([pad_id], device=device))[0]  # what HF feeds at padding
    for b, (e, ids, im, pid, iidx) in enumerate(rows):
        n = e.shape[0]
        embeds[b, : length - n] = pad_embed
        embeds[b, length - n :] = e  # left padding
        input_ids[b, length - n :] = ids
        attn[b, length - n :] = 1
        image_mask[b, length - n :] = im
        patch_ids[b, length - n :] = pid
        image_index[b, length - n :] = iidx
    tags = {}
    for k, per_row in tag_rows.items():
        tags[k] = torch.zeros(bsz, length, dtype=per_row[0].dtype, device=device)
        for b, t in enumerate(per_row):
            tags[k][b, length - t.shape[0] :] = t
    position_ids = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)  # as HF generate does for left padding
    return LMInputs(embeds, input_ids, attn, position_ids, image_mask, patch_ids, image_index, tags)
