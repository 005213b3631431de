"""CDPruner's CLIP text side (``clip_model``): the release's relevance needs CLIP's text tower, text
and visual projections and tokenizer, loaded from a local path only (see ``cdpruner.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError

#: Files that make a directory's tokenizer loadable by ``AutoTokenizer`` (without one, transformers
#: builds an empty CLIP tokenizer of 2 tokens that maps every prompt to the same ids).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json")


class ClipText:
    """The parts of a CLIP checkpoint the release's relevance needs: text tower with projection,
    visual projection, tokenizer (loaded from a local path only).

    ``embedded``: the CLIP that ``mmfast/tiny-world`` ships in ``clip/``, trained on the LLaVA
    tokenizer (ids end with the appended ``</s>``, pooled at that last real token, as
    ``mmfast.train.embedded.clip_text_ids`` / ``text_features``); otherwise a CLIP with its own
    tokenizer, embedded as the release does."""

    def __init__(self, model, tokenizer, embedded: bool = False) -> None:
        self.text_model = model.text_model
        self.text_projection = model.text_projection
        self.visual_projection = model.visual_projection
        self.tokenizer = tokenizer
        self.embedded = embedded
        self.width = int(model.config.text_config.max_position_embeddings)

    @torch.inference_mode()
    def embed_text(self, text: str) -> torch.Tensor:
        """[M, D] pooled, projected embeddings of the text's zero-padded 77-token segments (as the
        release; ``embedded``: [1, D], the text truncated to the tower's width)."""
        dev = self.text_projection.weight.device
        if self.embedded:
            from ..train.embedded import clip_text_ids, text_features

            ids, mask = clip_text_ids(self.tokenizer, [text], max_len=self.width)
            return text_features(self, ids.to(dev), mask.to(dev))
        enc = self.tokenizer(text=text, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        pad = -ids.shape[1] % self.width
        ids = torch.cat([ids, ids.new_zeros(1, pad)], 1).reshape(-1, self.width)
        mask = torch.cat([mask, mask.new_zeros(1, pad)], 1).reshape(-1, self.width)
        pooled = self.text_model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).pooler_output  # [M, H]
        return self.text_projection(pooled)


def clip_load_error(path: str, exc: BaseException) -> str:
    """Why a CLIP checkpoint at ``path`` did not load, in the user's terms: a local path that does not exist, a
    directory without safetensors weights (mmfast never unpickles ``pytorch_model.bin``), or transformers' reason."""
    local = Path(path).expanduser()
    if local.is_absolute() or path.startswith((".", "~")) or path.count("/") > 1:
        if not local.exists():
            return "that path does not exist"
        if local.is_dir() and not any(local.glob("*.safetensors")):
            return (
                "the directory has no .safetensors weights (mmfast loads safetensors only, never a pickled "
                "pytorch_model.bin; re-save the model with save_pretrained(..., safe_serialization=True))"
            )
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def load_clip_text(path: str, device, dtype, llava_tokenizer) -> ClipText:
    """The CLIP at ``path`` with a tokenizer that covers its text tower's vocabulary: the directory's
    own, or (a directory without tokenizer files, as the embedded model's ``clip/``) the LLaVA
    tokenizer when its vocabulary is the text tower's. Anything else is refused (ConfigError)."""
    from transformers import AutoTokenizer, CLIPModel

    try:
        model = (
            CLIPModel.from_pretrained(path, local_files_only=True, use_safetensors=True, dtype=dtype).to(device).eval()
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "clip_model",
            f"cannot load a CLIP model (text tower, projections, tokenizer) from {path!r}: {clip_load_error(path, exc)}",
        ) from None
    vocab = int(model.config.text_config.vocab_size)
    local = Path(path)
    if local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES):
        if len(llava_tokenizer) != vocab:
            raise ConfigError(
                "clip_model",
                f"{path!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}) and its text tower's "
                f"vocabulary ({vocab}) is not the model's tokenizer's ({len(llava_tokenizer)}); point "
                f"clip_model at a CLIP directory that includes its tokenizer",
            )
        return ClipText(model, llava_tokenizer, embedded=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError("clip_model", f"cannot load the CLIP tokenizer from {path!r}: {exc}") from None
    if len(tokenizer) != vocab:
        raise ConfigError(
            "clip_model",
            f"the tokenizer in {path!r} has {len(tokenizer)} tokens but the text tower's "
            f"vocabulary has {vocab}; the CLIP directory needs its own complete tokenizer",
        )
    return ClipText(model, tokenizer)
