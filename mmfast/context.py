"""The narrow interface a method may use: :class:`MethodContext`.

Pruning stages, decoders and drafters are built against this context, never against the pipeline's
``Session``. It gives them the model's structure (``adapter``), the LLM runtime (``runner``), the
attention probe, the hook session that restores the model, the tokenizer and special token ids, and
a few input builders. What a method learns about one batch travels with that batch's data (tags on
``VisionBatch`` / ``LMInputs``, stats and extras on ``LMState``), so an auxiliary branch encoded with
:meth:`MethodContext.encode_branch` can never overwrite what the clean batch needs.

This module imports nothing from ``pipeline`` or the method packages: the session imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .errors import InputError
from .models.base import LMInputs, VisionBatch, build_lm_inputs
from .models.captured_tower import eager_call

if TYPE_CHECKING:
    from .hooks import AttentionProbe, HookSession
    from .inputs import PreparedBatch
    from .model import MMModel
    from .models.base import VLMAdapter
    from .runtime import LMRunner


@dataclass(frozen=True)
class SpecialIds:
    """Token ids a method may need."""

    pad: int
    eos: tuple[int, ...]
    image: int


@dataclass
class MethodContext:
    """Everything a pruning stage, decoder or drafter may touch.

    ``encode`` runs the vision tower and every feature stage on a batch and returns a fresh
    :class:`VisionBatch` (the session supplies it); methods reach it through :meth:`encode_branch`.
    """

    adapter: VLMAdapter
    runner: LMRunner
    probe: AttentionProbe
    hooks: HookSession
    tokenizer: Any
    image_processor: Any
    special: SpecialIds
    model_name: str  # what the user loaded (embedded name, hub id or directory)
    model_path: str  # where the weights came from (``name_or_path``), for methods with side files
    chat_text: Callable[[str, int], str]  # (prompt, n_images) -> chat-templated text
    encode: Callable[[PreparedBatch], VisionBatch]
    #: samples token budgets are calibrated on (``pruning._budget.CalibrationSet``; None: the default set)
    calibration_set: Any = None
    #: ``captured(key, fn, *tensors)``: a pure function of tensors (a pruner's selection) run as a captured graph
    #: where the session captures (:class:`~mmfast.models.captured_tower.CapturedCalls`), else eagerly; ``key``
    #: holds everything else ``fn`` depends on
    captured: Callable[..., torch.Tensor] = eager_call
    #: the decoder decoding the running call (``Session._decode``: the recipe's, or ``generate(decoding=...)``'s),
    #: None outside one; a recipe decoder whose hooks edit every forward (PAI, ClearSight) edits nothing while
    #: another decoder runs a call
    decoding: Any = None

    @classmethod
    def of(
        cls,
        mm: MMModel,
        runner: LMRunner,
        probe: AttentionProbe,
        hooks: HookSession,
        encode: Callable[[PreparedBatch], VisionBatch],
    ) -> MethodContext:
        return cls(
            adapter=mm.adapter,
            runner=runner,
            probe=probe,
            hooks=hooks,
            tokenizer=mm.tokenizer,
            image_processor=mm.image_processor,
            special=SpecialIds(mm.pad_token_id, tuple(mm.eos_token_ids), mm.adapter.image_token_id),
            model_name=mm.name,
            model_path=str(getattr(mm.model, "name_or_path", "") or ""),
            chat_text=mm.chat_text,
            encode=encode,
        )

    @property
    def device(self) -> torch.device:
        return self.adapter.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.lm_head.weight.dtype

    @property
    def name(self) -> str:
        return self.model_name

    # -- inputs ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def build_inputs(
        self, batch: PreparedBatch, vision: VisionBatch, token_ids: list[list[int]] | None = None
    ) -> LMInputs:
        """Project the (pruned) features and splice them, with their tags, into the prompts."""
        projected = self.adapter.project(vision)
        per_sample: list[list[torch.Tensor]] = [[] for _ in range(batch.batch_size)]
        per_ids: list[list[torch.Tensor]] = [[] for _ in range(batch.batch_size)]
        per_tags: dict[str, list[list[torch.Tensor]]] = {k: [[] for _ in range(batch.batch_size)] for k in vision.tags}
        for img, owner in enumerate(batch.image_owner):
            per_sample[owner].append(projected[img])
            per_ids[owner].append(vision.patch_ids[img])
            for k, tag in vision.tags.items():
                per_tags[k][owner].append(tag[img])
        grids = vision.extras.get("grid_thw")  # per image (t, h, w): M-RoPE families
        per_grid: list[list] | None = None if grids is None else [[] for _ in range(batch.batch_size)]
        if per_grid is not None:
            intervals = vision.extras.get("time_interval")  # per item: a video's temporal M-RoPE spacing
            for img, owner in enumerate(batch.image_owner):
                per_grid[owner].append(grids[img] if intervals is None else (*grids[img], intervals[img]))
        return build_lm_inputs(
            self.adapter, token_ids or batch.token_ids, per_sample, per_ids, self.special.pad, per_tags, per_grid
        )

    def encode_branch(self, batch: PreparedBatch) -> tuple[VisionBatch, LMInputs]:
        """Encode an auxiliary branch (a noised or transformed image): vision tower, feature stages
        and splicing, exactly as the clean batch was encoded. Everything the stages decide travels
        with the returned data, so the clean batch's tags and states are untouched."""
        vision = self.encode(batch)
        return vision, self.build_inputs(batch, vision)

    @torch.inference_mode()
    def text_only_inputs(self, batch: PreparedBatch, strip_image_tokens: bool = False) -> LMInputs:
        """The same prompts with no image at all (M3ID's unconditioned branch, VHR's text stream).

        Default: the chat template rendered for zero images (``USER: {q} ASSISTANT:`` on LLaVA-1.5).
        ``strip_image_tokens``: the image prompt's own ids with only the vision placeholders removed,
        so the separator after it stays (``USER: \n{q} ASSISTANT:``), as RITUAL's M3ID does."""
        if strip_image_tokens:  # every vision item's placeholder (image and video)
            slots = self.adapter.vision_slot_ids
            ids = [[t for t in row if t not in slots] for row in batch.token_ids]
        else:
            ids = [self.tokenizer(self.chat_text(p, 0), add_special_tokens=True)["input_ids"] for p in batch.prompts]
        empty: list[list[torch.Tensor]] = [[] for _ in ids]
        return build_lm_inputs(self.adapter, ids, empty, [[] for _ in ids], self.special.pad)

    def reprompt(self, batch: PreparedBatch, prompts: list[str]) -> PreparedBatch:
        """``batch`` with other prompts about the same images (pixels reused, no re-encoding needed)."""
        if batch.has_video:
            raise InputError(
                "this method re-prompts the batch, which mmfast does for images only; run it without videos"
            )
        texts = [self.chat_text(p, len(ims)) for p, ims in zip(prompts, batch.images)]
        ids = [self.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
        return dataclasses.replace(batch, prompts=list(prompts), texts=texts, token_ids=ids)
