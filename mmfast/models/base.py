"""Model adapters: where each VLM family keeps its vision tower, projector, LLM layers and image tokens.

Everything in mmfast reaches the model through an adapter, so no method hard-codes a module path, an
image-token count or an image span. One adapter class per model family (``llava.py``, ...).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..inputs import PreparedBatch, VideoClip, VisionItem
from ..video import FrameRule
from .features import ModelFeatures


@dataclass
class VisionBatch:
    """Vision features of a batch of images, between the vision tower and the LLM.

    Feature-stage pruners and mergers (VisionZip, MustDrop stage 1, HICom, ...) edit this object.
    ``features[i]`` are the selected-layer patch features of image ``i`` *before* the projector
    ([N_i, Dv]); a stage that produces LLM-width tokens itself sets ``projected[i]`` ([N_i, d]).
    ``patch_ids[i]`` maps each token to its raster patch index in the original grid (-1 for merged
    or synthetic tokens), which keeps spatial bookkeeping honest after reordering. Families with
    dynamic resolution (Qwen-VL) index the image's own merged-token grid ``extras["grid_thw"][i]``
    (t, h, w) in raster order ``t * h * w``; their multimodal RoPE positions are derived from it.
    """

    features: list[torch.Tensor]  # per image [N_i, Dv]
    patch_ids: list[torch.Tensor]  # per image [N_i] long
    cls: torch.Tensor | None  # [n_images, Dv] CLS hidden state of the feature layer (None if the tower has none)
    grid: tuple[int, int]  # (rows, cols) of the patch grid
    pixel_values: torch.Tensor  # [n_images, 3, H, W] as fed to the tower
    projected: list[torch.Tensor | None] = field(default_factory=list)  # per image [N_i, d] or None
    extras: dict[str, Any] = field(default_factory=dict)  # probe results and per-method side data
    #: per-token data that travels with the tokens into ``LMInputs.tags``: name -> per image [N_i]
    #: (bool or long; text and padding get 0), or [N_i, ...] for per-token vectors (Qwen3-VL's
    #: deepstack features). A stage that selects rows must select these too.
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

    ``position_ids`` is [B, L] for 1-D RoPE families and [B, L, 3] (temporal, height, width) for
    multimodal-RoPE families (Qwen-VL); the adapter's ``lm_position_ids`` turns it into what the HF
    language model takes. Generated tokens continue at (max over the sample's valid positions and
    axes) + 1, replicated on the 3 axes: what HF's ``rope_deltas`` computes.
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

    @functools.cached_property
    def has_vision(self) -> bool:
        """Whether any row holds a vision token (read from the device once per inputs: a branch's image-free
        prompt holds none)."""
        return bool(self.image_mask.any())

    @functools.cached_property
    def text_after_image(self) -> torch.Tensor:
        """[B, L] bool: real tokens after the last vision token (the instruction + assistant prompt); computed once
        per inputs (each in-LLM pruning stage reads it), so not to be written to."""
        pos = torch.arange(self.length, device=self.image_mask.device).expand_as(self.image_mask)
        last_img = torch.where(self.image_mask, pos, torch.full_like(pos, -1)).max(1, keepdim=True).values
        return (pos > last_img) & self.attention_mask.bool()

    def append(self, ids: torch.Tensor, embeds: torch.Tensor) -> LMInputs:
        """The inputs with generated text tokens ``ids`` ([B, Q], embeddings [B, Q, d]) appended; they
        are marked in the ``GENERATED`` tag (decode-without-cache rules tell them from the prompt)."""
        bsz, q = ids.shape
        dev = ids.device
        if self.position_ids.dim() == 3:  # M-RoPE: next = max over valid positions and axes + 1
            valid = self.attention_mask.bool()[:, :, None]
            last = self.position_ids.masked_fill(~valid, -1).amax((1, 2))[:, None]  # [B, 1]
            new_pos = (last + torch.arange(1, q + 1, device=dev))[:, :, None].expand(
                -1, -1, self.position_ids.shape[-1]
            )
        else:
            new_pos = self.position_ids[:, -1:] + torch.arange(1, q + 1, device=dev)
        tags = {k: torch.cat([t, t.new_zeros(bsz, q, *t.shape[2:])], 1) for k, t in self.tags.items() if k != GENERATED}
        done = self.tags.get(GENERATED, torch.zeros_like(self.image_mask))
        tags[GENERATED] = torch.cat([done, torch.ones(bsz, q, dtype=torch.bool, device=dev)], 1)
        return LMInputs(
            torch.cat([self.embeds, embeds.to(self.embeds.dtype)], 1),
            torch.cat([self.input_ids, ids], 1),
            torch.cat([self.attention_mask, torch.ones(bsz, q, dtype=self.attention_mask.dtype, device=dev)], 1),
            torch.cat([self.position_ids, new_pos], 1),
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
            tags[k] = torch.cat(
                [p.tags[k] if k in p.tags else like.new_zeros(*p.input_ids.shape, *like.shape[2:]) for p in parts], 0
            )
        return LMInputs(*(torch.cat([getattr(p, f) for p in parts], 0) for f in _LMINPUT_FIELDS), tags)

    def pad_left(self, n: int, pad_id: int, pad_embed: torch.Tensor) -> LMInputs:
        """The inputs with ``n`` padding slots in front (``pad_embed``: [d], what HF feeds at padding);
        tags get 0 there."""
        if n == 0:
            return self
        bsz, dev = self.batch_size, self.input_ids.device
        zeros = torch.zeros(bsz, n, dtype=self.attention_mask.dtype, device=dev)
        neg = torch.full((bsz, n), -1, dtype=torch.long, device=dev)
        return LMInputs(
            torch.cat([pad_embed.to(self.embeds.dtype).expand(bsz, n, -1), self.embeds], 1),
            torch.cat([torch.full((bsz, n), pad_id, dtype=torch.long, device=dev), self.input_ids], 1),
            torch.cat([zeros, self.attention_mask], 1),
            torch.cat(
                [
                    torch.ones_like(zeros)
                    .view(bsz, n, *[1] * (self.position_ids.dim() - 2))
                    .expand(bsz, n, *self.position_ids.shape[2:]),
                    self.position_ids,
                ],
                1,
            ),
            torch.cat([torch.zeros(bsz, n, dtype=torch.bool, device=dev), self.image_mask], 1),
            torch.cat([neg, self.patch_ids], 1),
            torch.cat([neg, self.image_index], 1),
            {k: torch.cat([t.new_zeros(bsz, n, *t.shape[2:]), t], 1) for k, t in self.tags.items()},
        )

    def crop_left(self, n: int) -> LMInputs:
        """The inputs without their first ``n`` slots (padding of a single-row batch)."""
        if n == 0:
            return self
        return LMInputs(
            *(getattr(self, f)[:, n:] for f in _LMINPUT_FIELDS), {k: t[:, n:] for k, t in self.tags.items()}
        )

    def select(self, index: torch.Tensor) -> LMInputs:
        """Rows ``index`` of the batch (used to split or repeat branches)."""
        return LMInputs(
            *(getattr(self, f)[index] for f in _LMINPUT_FIELDS), {k: t[index] for k, t in self.tags.items()}
        )


GENERATED = "generated"  # LMInputs tag: tokens appended by decoding (bool)
#: VisionBatch / LMInputs tags of batches with a video (absent otherwise): ``VIDEO`` is 1 + the video's
#: number in its sample at a video's tokens (0 at images and text); ``FRAME`` is the token's temporal
#: index (merged frame group) within its video (0 at images and text)
VIDEO = "video"
FRAME = "frame"
_LMINPUT_FIELDS = ("embeds", "input_ids", "attention_mask", "position_ids", "image_mask", "patch_ids", "image_index")


@dataclass
class VideoItems:
    """A video as vision items (``VLMAdapter.video_items``)."""

    pixels: list[torch.Tensor]  # per item [1, ...] (the family's pixel row layout)
    sizes: list[torch.Tensor]  # per item [1, k] (the family's ``image_sizes`` row)
    items: list[VisionItem]
    text: str  # replaces the video placeholder in the templated prompt
    n_frames: int  # frames the video was given with (after sampling)
    tokens: int  # vision tokens the video makes (the processor's count)


def tag_video_tokens(vision: VisionBatch, items: list[VisionItem], tokens_per_frame: list[int]) -> None:
    """Set the ``VIDEO`` / ``FRAME`` tags of the items of a batch that has a video (all zero at the
    images; set on every part of such a batch, so per-image tower calls concatenate).

    A video token's frame is ``first_frame + patch_id // tokens_per_frame[i]``; a merged or synthetic
    token (patch id -1, e.g. OneVision's closing newline) takes the frame of the last real token
    before it."""
    vids, frames = [], []
    for pid, it, per in zip(vision.patch_ids, items, tokens_per_frame):
        pid = pid.long()
        if not it.is_video:
            vids.append(torch.zeros_like(pid))
            frames.append(torch.zeros_like(pid))
            continue
        real = pid >= 0
        idx = torch.where(real, torch.arange(pid.shape[0], device=pid.device), torch.full_like(pid, -1))
        last = idx.cummax(0).values.clamp(min=0)  # [N] last real token at or before each token
        frame = torch.where(real, pid, pid[last].clamp(min=0)) // max(per, 1)
        vids.append(torch.full_like(pid, it.video + 1))
        frames.append(frame + it.first_frame)
    vision.tags[VIDEO] = vids
    vision.tags[FRAME] = frames


class VLMAdapter:
    """Protocol every model family implements. Attribute access only; no forward logic of its own
    beyond encoding images and splicing features, which differ per family."""

    family: str = ""
    model: nn.Module
    #: what the family offers methods (CLS token, grid, tiles, RoPE, video, tower attention): declared
    #: once per family; the methods' needs are checked against it (docs/architecture.md, "Adding a
    #: model family"). A loaded adapter holds its model's (:meth:`features_of` its config).
    features: ModelFeatures
    #: what a family without video says to use instead (the refusal quotes it)
    video_alternative: str = (
        "pass the frames as images (a list of images per prompt; no time axis), or use a Qwen2-VL, Qwen2.5-VL, "
        "Qwen3-VL or LLaVA-OneVision checkpoint"
    )

    @classmethod
    def features_of(cls, config: Any) -> ModelFeatures:
        """The features of a model of this family with transformers config ``config`` (the declared
        ones, unless the config changes one, e.g. a LLaVA with a CLS-less tower)."""
        return cls.features

    @classmethod
    def config_shape(cls, config: Any) -> tuple[int, int, tuple[int, int]]:
        """(LLM layers, vision layers, base patch grid) from the config alone, before weights load."""
        raise NotImplementedError(f"{cls.__name__} reads no shape from its config")

    @classmethod
    def config_image_tokens(cls, config: Any) -> int | None:
        """The vision tokens every image has at the LLM input on a model with transformers config
        ``config`` (LLaVA-1.5: its grid, with the CLS token under the ``full`` strategy), or None where
        each image has its own count (anyres tiling, dynamic resolution)."""
        return None

    def counts_before_tower(self, batch: PreparedBatch) -> list[int] | None:
        """Each vision item's tokens at the tower's output, read from ``batch`` before the tower runs (Qwen-VL:
        from its ``grid_thw``), or None where only the tower's output says (anyres tiling, OneVision). The
        session refuses a ``tokens`` budget an item cannot meet from them, before any compute."""
        return None

    @property
    def n_image_tokens(self) -> int | None:
        """:meth:`config_image_tokens` of the loaded model."""
        return self.config_image_tokens(self.model.config)

    @property
    def rope_axes(self) -> int:
        """RoPE axes per token: 1, or 3 for multimodal RoPE (temporal, height, width)."""
        return 3 if self.features.rope == "mrope" else 1

    @property
    def supports_video(self) -> bool:
        """Takes ``videos=`` (the family's video path: ``video_items`` / ``encode_images(items=)``)."""
        return self.features.video

    @property
    def has_cls(self) -> bool:
        return self.features.cls_token

    @property
    def vision_slot_ids(self) -> frozenset[int]:
        """Token ids that stand for one vision item in ``PreparedBatch.token_ids`` (image, and video)."""
        return frozenset({self.image_token_id, self.video_token_id} if self.supports_video else {self.image_token_id})

    def frame_rule(self, settings: Any) -> FrameRule:
        """How the family's video processor rounds a sampled frame count."""
        return FrameRule()

    def video_items(self, clip: VideoClip, video: int, settings: Any) -> VideoItems:
        """One video's vision items: pixel rows, size rows, :class:`VisionItem` s and the text that
        replaces the chat template's video placeholder (one slot token per item)."""
        raise NotImplementedError(f"{self.family} has no video path")

    def lm_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """mmfast positions ([B, L] or [B, L, 3]) -> the ``position_ids`` the HF language model takes."""
        return positions

    def mrope_positions(self, pieces: list, device: torch.device) -> torch.Tensor:
        """[L, 3] positions of one sample from its pieces (M-RoPE families only); see ``build_lm_inputs``."""
        raise NotImplementedError

    def image_pixels(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor | None) -> torch.Tensor:
        """The real pixels (a view) of a one-image slice ``pixel_values[i:i+1]`` (``image_sizes[i:i+1]``):
        without the padding a family adds to batch images of different sizes."""
        return pixel_values

    def pack_pixels(self, processed: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(pixel_values, image_sizes) of a ``PreparedBatch`` from the image processor's output: one row
        per image (families whose processors flatten patches pad them per image)."""
        return processed["pixel_values"], processed.get("image_sizes")

    # -- structure -------------------------------------------------------------------------------
    @property
    def vision_layers(self) -> nn.ModuleList: ...

    # transformers' ``*ForConditionalGeneration`` classes of every family hold these alike
    @property
    def base(self) -> nn.Module:
        return self.model.model

    @property
    def language_model(self) -> nn.Module:
        return self.base.language_model

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    @property
    def text_config(self):
        return self.model.config.text_config

    @property
    def vision_config(self):
        return self.model.config.vision_config

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def video_token_id(self) -> int:
        """The video placeholder's id (families with video only)."""
        return int(self.model.config.video_token_id)

    @property
    def grid(self) -> tuple[int, int]: ...

    def vision_feature_layer_index(self) -> int:
        """0-based index of the vision encoder layer whose output feeds the projector."""
        ...

    # -- compute ---------------------------------------------------------------------------------
    def encode_images(
        self,
        pixel_values: torch.Tensor,
        image_sizes: torch.Tensor | None = None,
        items: list[VisionItem] | None = None,
    ) -> VisionBatch:
        """The tower on a batch of vision items (``items``: what each row is; None = all images)."""
        ...

    def project(self, vision: VisionBatch) -> list[torch.Tensor]: ...

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor: ...


def build_lm_inputs(
    adapter: VLMAdapter,
    token_ids: list[list[int]],
    image_tokens: list[list[torch.Tensor]],
    image_patch_ids: list[list[torch.Tensor]],
    pad_id: int,
    image_tags: dict[str, list[list[torch.Tensor]]] | None = None,
    image_grids: list[list[Any]] | None = None,
) -> LMInputs:
    """Splice projected image tokens into tokenised prompts and left-pad the batch.

    ``token_ids[b]`` holds one slot token (``adapter.vision_slot_ids``: the image token, or the video
    token of a video item) per vision item of sample ``b``; each is replaced by the
    ``image_tokens[b][j]`` rows ([N_j, d]) of that item (``input_ids`` keep the slot's token there), so pruned images of any length fit, and the
    placeholder run always equals the feature count. ``image_tags[name][b][j]`` ([N_j]) are spliced
    into ``LMInputs.tags[name]`` at the same slots (0 elsewhere). ``image_grids[b][j]`` is item j's
    merged-token grid (t, h, w), or (t, h, w, time_interval) for a video, for M-RoPE families (``adapter.rope_axes == 3``), whose [B, L, 3]
    positions ``adapter.mrope_positions`` derives from the pieces (text runs and images' patch ids).
    """
    image_tags = image_tags or {}
    slot_ids = adapter.vision_slot_ids  # image (and video) placeholders: one per vision item
    embed_layer = adapter.language_model.embed_tokens
    device, dtype = embed_layer.weight.device, embed_layer.weight.dtype
    # the layout on the host, from the prompts and the items' lengths (shapes: no read): each row's tokens (the slot
    # token at an item's places), and each item's sample, index in it and first place in the unpadded row
    rows: list[list[int]] = []
    items: list[tuple[int, int, int]] = []  # (sample, item, start)
    pos_rows: list[torch.Tensor] = []
    for b, ids in enumerate(token_ids):
        n_slots = sum(1 for t in ids if t in slot_ids)
        if n_slots != len(image_tokens[b]):
            raise ValueError(
                f"sample {b}: prompt has {n_slots} image slots but {len(image_tokens[b])} images were given"
            )
        row: list[int] = []
        layout: list = []  # ("text", n) or ("image", patch ids, grid) per piece, for M-RoPE positions
        text_run, j = 0, 0
        for t in ids:
            if t not in slot_ids:
                row.append(t)
                text_run += 1
                continue
            if text_run:
                layout.append(("text", text_run))
                text_run = 0
            items.append((b, j, len(row)))
            row.extend([t] * int(image_tokens[b][j].shape[0]))
            layout.append(("image", image_patch_ids[b][j], None if image_grids is None else image_grids[b][j]))
            j += 1
        if text_run:
            layout.append(("text", text_run))
        rows.append(row)
        if adapter.rope_axes != 1:
            pos_rows.append(adapter.mrope_positions(layout, device))  # [L_b, 3]

    length = max(len(r) for r in rows)
    bsz = len(rows)
    pads = [length - len(r) for r in rows]
    # [B, L] token ids (the pad id at padding, as HF feeds it), attention mask and each slot's item (-1: text and
    # padding), then every item's places in the flattened [B * L] batch: made on the host as one tensor and copied to
    # the device at once
    slot_item = [[-1] * length for _ in rows]
    places: list[int] = []
    for b, j, start in items:
        first = pads[b] + start
        n = int(image_tokens[b][j].shape[0])
        slot_item[b][first : first + n] = [j] * n
        places.extend(range(b * length + first, b * length + first + n))
    host = [t for p, r in zip(pads, rows) for t in [pad_id] * p + r]
    host += [m for p, r in zip(pads, rows) for m in [0] * p + [1] * len(r)]
    host += [j for row in slot_item for j in row]
    on_device = torch.tensor(host + places, dtype=torch.long).to(device)  # the one copy to the device
    input_ids, attn, image_index = on_device[: 3 * bsz * length].view(3, bsz, length)
    index = on_device[3 * bsz * length :]  # [N] every item's places
    image_mask = image_index >= 0
    # [B, L, d]; the items' places are overwritten below (their slot token may lie past the embedding table, as
    # HF's LLaVA allows: the pad id's row there)
    embeds = embed_layer(input_ids.masked_fill(image_mask, pad_id))
    patch_ids = torch.full((bsz, length), -1, dtype=torch.long, device=device)
    tags = {}
    for k, per in image_tags.items():
        like = next((t for row in per for t in row), torch.zeros(0, dtype=torch.long))
        tags[k] = torch.zeros(bsz, length, *like.shape[1:], dtype=like.dtype, device=device)
    if items:
        feats = torch.cat([image_tokens[b][j].to(device=device, dtype=dtype) for b, j, _ in items])  # [N, d]
        embeds.view(bsz * length, -1).index_copy_(0, index, feats)
        pids = torch.cat([image_patch_ids[b][j].to(device) for b, j, _ in items])  # [N]
        patch_ids.view(-1).index_copy_(0, index, pids)
        for k, per in image_tags.items():
            values = torch.cat([per[b][j].to(device) for b, j, _ in items])  # [N, ...]
            tags[k].view(bsz * length, *tags[k].shape[2:]).index_copy_(0, index, values.to(tags[k].dtype))
    position_ids = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)  # as HF generate does for left padding
    if adapter.rope_axes != 1:  # [B, L, 3]; padding 1 as above
        position_ids = position_ids[:, :, None].repeat(1, 1, adapter.rope_axes)
        for b, p in enumerate(pos_rows):
            position_ids[b, length - p.shape[0] :] = p
    return LMInputs(embeds, input_ids, attn, position_ids, image_mask, patch_ids, image_index, tags)
