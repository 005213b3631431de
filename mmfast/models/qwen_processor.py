"""A Qwen-VL processor for images only, for installs without torchvision.

transformers' ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor`` always build a
video processor, which needs torchvision. mmfast only needs the tokenizer, the image processor (the
PIL backend works without torchvision) and the chat template, so when ``AutoProcessor`` cannot be
built for a Qwen-VL checkpoint, :func:`load_qwen_processor` assembles this object from the same files.
``__call__`` expands every image placeholder to the image's merged-token count, as the official
processor does (tests compare against ``model(...)`` with it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import compat
from ..errors import InputError


class QwenVLImageProcessor:
    """Tokenizer + image processor + chat template of a Qwen-VL checkpoint (no video)."""

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)

    def apply_chat_template(
        self, conversation: list[dict], *, add_generation_prompt: bool = False, tokenize: bool = False, **kw: Any
    ):
        return self.tokenizer.apply_chat_template(
            conversation,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            **kw,
        )

    def __call__(
        self, images: Any = None, text: str | list[str] | None = None, return_tensors: str = "pt", **kw: Any
    ) -> dict:
        """Pixel patches, ``image_grid_thw`` and token ids with each placeholder expanded to
        ``t * h * w / merge_size**2`` tokens, plus ``mm_token_type_ids`` (1 at image tokens)."""
        if kw.get("videos") is not None:  # ignored, the model would read the video's slots as text
            raise InputError(
                "this Qwen-VL processor (mmfast's, for installs without torchvision) takes images only: pass the "
                "video to mmfast (generate(..., videos=...)), which processes its frames itself, or install "
                "torchvision for transformers' own processor"
            )
        out: dict[str, Any] = {}
        texts = [text] if isinstance(text, str) else list(text or [])
        if images is not None:
            out.update(self.image_processor(images=images, return_tensors="pt"))
            merge = self.image_processor.merge_size**2
            n_slots = sum(t.count(self.image_token) for t in texts)
            if texts and n_slots != len(out["image_grid_thw"]):
                raise InputError(
                    f"the text has {n_slots} image placeholder(s) {self.image_token!r} for "
                    f"{len(out['image_grid_thw'])} image(s); put one placeholder per image in the text"
                )
            counts = iter((out["image_grid_thw"].prod(-1) // merge).tolist())
            expanded = []
            for t in texts:
                parts = t.split(self.image_token)
                expanded.append(parts[0] + "".join(self.image_token * next(counts) + p for p in parts[1:]))
            texts = expanded
        if not texts:  # images only: their pixels and grids (as transformers' processor; tokenising none raised)
            return out
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        out.update(enc)
        out["mm_token_type_ids"] = (enc["input_ids"] == self.image_token_id).int()
        return out

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        self.image_processor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self.chat_template:
            (path / "chat_template.json").write_text(json.dumps({"chat_template": self.chat_template}))


def load_qwen_processor(path: str, **kwargs: Any) -> QwenVLImageProcessor:
    """The tokenizer, image processor and chat template saved at ``path`` (no video processor)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    image_processor = compat.load_image_processor(path, **kwargs)
    template = None
    for name in ("chat_template.json", "chat_template.jinja"):
        f = Path(path) / name
        if f.is_file():
            template = json.loads(f.read_text())["chat_template"] if name.endswith(".json") else f.read_text()
            break
    return QwenVLImageProcessor(image_processor, tokenizer, template)


def pad_patches(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """[sum_i P_i, D] flattened patches -> [n_images, max P_i, D] (zeros after each image's P_i rows),
    so that images can be sliced one by one like other families' pixel tensors."""
    counts = grid_thw.prod(-1).tolist()
    out = pixel_values.new_zeros(len(counts), max(counts), pixel_values.shape[-1])
    for i, part in enumerate(torch.split(pixel_values, counts)):
        out[i, : part.shape[0]] = part
    return out
