"""HICom's guide on images (see :mod:`mmfast.pruning.hicom`): the instruction text it encodes and the CLIP
whose text tower encodes it (``clip_model``; the video path's SigLIP guide is in ``_hicom_video.py``).
Shared by the pruner and ``scripts/train_hicom.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError, ModelLoadError
from ..models.captured_tower import eager_call
from ._clip_text import clip_load_error

#: The CLIP that LLaVA-1.5's tower comes from (its text tower is the guide encoder for real LLaVA-1.5).
LLAVA15_CLIP = "openai/clip-vit-large-patch14-336"

# Answer-format suffixes that say nothing about the image (HICom's ``extract_guided_prompt`` strips
# the short-answer suffix and multiple-choice option lists the same way).
_SUFFIXES = (
    "Answer the question using a single word or phrase.",
    "Answer with the option's letter from the given choices directly.",
    "Please respond with only the letter of the correct answer.",
    "Please provide your answer by stating the letter followed by the full option.",
)


def guide_text(prompt: str) -> str:
    """The instruction used as the guide: the user prompt without image tags, answer-format
    suffixes and multiple-choice option lists."""
    text = prompt.replace("<image>", "").replace("<video>", "")
    for s in _SUFFIXES:
        text = text.replace(s, "")
    for marker in ("\nA. ", "\nOptions:", "\n(A)"):
        text = text.split(marker)[0]
    return text.strip()


# ------------------------------------------------------------------------------------ CLIP guide


class ClipGuide(nn.Module):
    """The CLIP parts HICom needs: the text tower (instruction -> ``text_embeds``) and the image head
    (patch tokens of the last vision layer -> ``visual_projection(post_layernorm(.))``, MaskCLIP-style).

    ``tokenizer`` is the CLIP tokenizer (hub CLIP: BOS ... EOS) or, for the embedded model's CLIP
    (trained on the LLaVA tokenizer), the LLaVA tokenizer with ``embedded=True`` (ids end with the
    appended ``</s>``, as ``mmfast.train.embedded.clip_text_ids``). Text is pooled at the last real
    token in both cases (CLIP's EOS pooling).
    """

    def __init__(self, clip, tokenizer, embedded: bool) -> None:
        super().__init__()
        self.text_model = clip.text_model
        self.text_projection = clip.text_projection
        self.post_layernorm = clip.vision_model.post_layernorm
        self.visual_projection = clip.visual_projection
        self.tokenizer = tokenizer
        self.embedded = embedded
        self.max_len = int(clip.config.text_config.max_position_embeddings)

    @property
    def dim(self) -> int:
        return int(self.text_projection.out_features)

    @property
    def device(self) -> torch.device:
        return self.text_projection.weight.device

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.embedded:
            from ..train.embedded import clip_text_ids

            ids, mask = clip_text_ids(self.tokenizer, texts, max_len=self.max_len)
        else:
            enc = self.tokenizer(
                texts, padding=True, truncation=True, max_length=self.max_len, padding_side="right", return_tensors="pt"
            )
            ids, mask = enc["input_ids"], enc["attention_mask"]
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def text_embeds(self, texts: list[str], run: Callable[..., torch.Tensor] = eager_call) -> torch.Tensor:
        """[B, P] projected text embeddings (fp32), pooled at each text's last real token.

        The ids are right-padded to the tower's full width (``max_len``) and the tower runs without a padding
        mask: it is causal, so no real token attends to a pad and the pooled rows are what a masked run of the
        unpadded ids gives (up to rounding); with no mask to inspect (transformers reads a padding mask to the
        host to decide whether it may skip it) and one shape per batch size, ``run`` (``MethodContext.captured``)
        can make it one captured graph."""
        ids, mask = self.tokenize(texts)  # [B, T] each, right-padded
        pad = self.max_len - ids.shape[1]
        ids, mask = (torch.nn.functional.pad(t, (0, pad)) for t in (ids, mask))  # [B, max_len]
        return run(("hicom clip text",), self._pooled, ids, mask.sum(1) - 1)

    def _pooled(self, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """[B, P] fp32: the causal text tower over ``ids`` [B, T], pooled at slot ``last`` [B], projected."""
        hidden = self.text_model(input_ids=ids).last_hidden_state  # [B, T, H]
        pooled = hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)  # [B, H]
        return self.text_projection(pooled).float()

    @torch.no_grad()
    def patch_embeds(self, last_hidden: torch.Tensor, post_layernorm: bool = True) -> torch.Tensor:
        """[..., P] text-aligned embeddings of last-layer vision tokens [..., Dv] (fp32); without
        ``post_layernorm`` as HICom's release (``visual_projection(last_hidden_state)``)."""
        x = last_hidden.to(self.device, self.post_layernorm.weight.dtype)
        return self.visual_projection(self.post_layernorm(x) if post_layernorm else x).float()


_CLIP_CACHE: dict[tuple[str, str], ClipGuide] = {}


def model_dir(model) -> Path | None:
    """The local directory a model was loaded from, if any."""
    p = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    return Path(p) if p and Path(p).is_dir() else None


def resolve_clip(spec: str | None, model) -> str:
    """The CLIP checkpoint to use: ``spec``, else ``<model dir>/clip``, else the LLaVA-1.5 CLIP when the
    tower has its geometry."""
    if spec:
        return spec
    d = model_dir(model)
    if d is not None and (d / "clip" / "config.json").is_file():
        return str(d / "clip")
    vc = model.config.vision_config
    if (vc.image_size, vc.patch_size, vc.hidden_size) == (336, 14, 1024):
        return LLAVA15_CLIP
    raise ConfigError(
        "clip_model",
        f"no CLIP text tower found for this model (looked for {d / 'clip' if d else '<model dir>/clip'}); "
        f"set clip_model to a CLIPModel directory or hub id whose vision tower is this model's "
        f"(LLaVA-1.5: {LLAVA15_CLIP})",
    )


def tiny_tower_configs(vc, tokenizer, *, vision_layers: int, text_width: int = 32, text_positions: int = 64, **text):
    """Config dicts (text, vision) of a tiny random guide encoder for tests: a 2-layer text tower of
    ``text_width`` on ``tokenizer`` and a vision tower with ``vc``'s sizes and ``vision_layers`` layers;
    ``text`` adds or overrides text-config keys."""
    text_cfg = dict(
        vocab_size=len(tokenizer),
        hidden_size=text_width,
        intermediate_size=2 * text_width,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=text_positions,
        pad_token_id=tokenizer.pad_token_id or 0,
        **text,
    )
    vision = dict(
        hidden_size=vc.hidden_size,
        intermediate_size=vc.intermediate_size,
        num_hidden_layers=vision_layers,
        num_attention_heads=vc.num_attention_heads,
        image_size=vc.image_size,
        patch_size=vc.patch_size,
    )
    return text_cfg, vision


def random_clip(model, tokenizer, seed: int = 0):
    """A tiny randomly initialised ``CLIPModel`` for tests: text tower on the LLaVA tokenizer, vision
    head sized like ``model``'s tower (whose post-layernorm it copies)."""
    from transformers import CLIPConfig, CLIPModel

    text, vision = tiny_tower_configs(
        model.config.vision_config,
        tokenizer,
        vision_layers=1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    tower = model.model.vision_tower
    post = tower.post_layernorm if hasattr(tower, "post_layernorm") else tower.vision_model.post_layernorm
    clip.vision_model.post_layernorm.load_state_dict(post.state_dict())
    return clip


def load_clip_guide(spec: str | None, model, llava_tokenizer) -> ClipGuide:
    """The guide encoder for ``model`` (cached per checkpoint and device). ``spec == "random"``: tests."""
    device = next(model.parameters()).device
    if spec == "random":
        return ClipGuide(random_clip(model, llava_tokenizer), llava_tokenizer, embedded=True).to(device)
    path = resolve_clip(spec, model)
    key = (path, str(device))
    if key in _CLIP_CACHE:
        return _CLIP_CACHE[key]
    from transformers import AutoTokenizer, CLIPModel

    try:
        clip = CLIPModel.from_pretrained(path, use_safetensors=True, dtype=torch.float32).eval()
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load the HICom guide CLIP {path!r} (config clip_model): {clip_load_error(path, exc)}"
        ) from None
    local = Path(path)
    has_tok = not local.is_dir() or any(
        (local / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")
    )
    if has_tok:
        guide = ClipGuide(clip, AutoTokenizer.from_pretrained(path), embedded=False)
    else:  # the embedded model's CLIP is trained on the LLaVA tokenizer
        guide = ClipGuide(clip, llava_tokenizer, embedded=True)
    guide = guide.to(device).requires_grad_(False)
    _CLIP_CACHE[key] = guide
    return guide
