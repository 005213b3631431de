"""Build LLaVA models from configs: tiny random ones for tests, LLaVA-1.5-shaped ones for timings,
and the architecture of the embedded world model.

Everything is a real ``LlavaForConditionalGeneration`` (CLIP vision tower, MLP projector, Llama LM)
with a real processor (CLIP image processor, a ``tokenizers`` BPE tokenizer, the LLaVA-1.5 chat
template), so tests exercise the same code paths as a hub checkpoint. The other families' builders
(:func:`random_llava_next`, :func:`random_llava_onevision`: SigLIP without CLS, Qwen2 LM, anyres-max
tiles, ChatML template) are tiny random models of their real classes in the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", IMAGE_TOKEN]

#: The llava-hf LLaVA-1.5 chat template (system-less variant): "USER: <image>\n{text} ASSISTANT:".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@dataclass(frozen=True)
class LlavaShape:
    """Sizes of a LLaVA model built from config."""

    image_size: int = 32
    patch_size: int = 8
    vision_hidden: int = 32
    vision_layers: int = 3
    vision_heads: int = 4
    text_hidden: int = 64
    text_layers: int = 4
    text_heads: int = 4
    text_kv_heads: int = 4
    text_intermediate: int = 128
    vocab_size: int = 300
    max_positions: int = 2048
    vision_intermediate: int | None = None  # the tower's MLP width (None: 4 x vision_hidden)


SHAPES: dict[str, LlavaShape] = {
    # unit tests: 4x4 patch grid, 2 CPU seconds for the whole model
    "tiny": LlavaShape(),
    # the embedded world model: LLaVA-1.5 token geometry (24 x 24 = 576 patches + CLS)
    "world": LlavaShape(192, 8, 128, 5, 4, 256, 4, 4, 4, 768, 1024, 2048),
    # the world's 192 x 192 images on a 6 x 6 grid and small widths: the trainer's tests, in seconds
    "world-tiny": LlavaShape(192, 32, 32, 2, 4, 64, 4, 4, 4, 128, 1024, 2048),
    # LLaVA-1.5 geometry with small widths: the speed benchmarks of docs/ use these
    "llava-1.5-shaped-small": LlavaShape(336, 14, 384, 6, 6, 512, 8, 8, 8, 1376, 32064, 4096),
    "llava-1.5-shaped-medium": LlavaShape(336, 14, 512, 8, 8, 1024, 12, 16, 16, 2752, 32064, 4096),
    # the real CLIP-L/336 tower and four decoder layers at LLaVA-1.5-7B's width: on a CPU, prefill
    # behaves like the real model's (LLM-dominated), at 1/8 of its depth; four layers, as the embedded
    # world model's LLM, so in-LLM methods (proportional layer mapping) run the same token schedule
    "llava-1.5-7b-slice": LlavaShape(336, 14, 1024, 24, 16, 4096, 4, 32, 32, 11008, 32064, 4096),
    # the real LLaVA-1.5-7B sizes (for FLOPs accounting; too big to instantiate on CPU here)
    "llava-1.5-7b": LlavaShape(336, 14, 1024, 24, 16, 4096, 32, 32, 32, 11008, 32064, 4096),
    # LLaVA-OneVision-7B (llava-hf/llava-onevision-qwen2-7b-ov-hf; transformers' LlavaOnevisionConfig
    # defaults): SigLIP-so400m/14 at 384 cut to 26 layers (1152 wide, MLP 4304, 16 heads; 27 x 27 = 729
    # tokens per view, no CLS) and Qwen2-7B (28 layers at 3584, 28 heads, 4 KV heads, MLP 18944,
    # vocabulary 152064, context 32768)
    "llava-onevision-7b": LlavaShape(384, 14, 1152, 26, 16, 3584, 28, 28, 4, 18944, 152064, 32768, 4304),
}


def clip_tower_kwargs(shape: LlavaShape) -> dict:
    """``CLIPVisionConfig`` keywords of ``shape``'s vision tower: LLaVA's (:func:`llava_config`), and the CLIP
    model's the embedded model's tower is trained in (:mod:`mmfast.train.embedded`)."""
    return dict(
        hidden_size=shape.vision_hidden,
        intermediate_size=shape.vision_hidden * 4,
        num_hidden_layers=shape.vision_layers,
        num_attention_heads=shape.vision_heads,
        image_size=shape.image_size,
        patch_size=shape.patch_size,
        hidden_act="quick_gelu",
    )


def llava_config(
    shape: LlavaShape,
    *,
    vocab_size: int | None = None,
    init_std: float = 0.02,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
    image_id: int = 4,
):
    """A ``LlavaConfig`` with a CLIP vision tower and a Llama text model of ``shape``'s sizes."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(**clip_tower_kwargs(shape), projection_dim=shape.vision_hidden)
    text = LlamaConfig(
        vocab_size=vocab_size or shape.vocab_size,
        hidden_size=shape.text_hidden,
        intermediate_size=shape.text_intermediate,
        num_hidden_layers=shape.text_layers,
        num_attention_heads=shape.text_heads,
        num_key_value_heads=shape.text_kv_heads,
        max_position_embeddings=shape.max_positions,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        initializer_range=init_std,
    )
    n_patches = (shape.image_size // shape.patch_size) ** 2
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=n_patches,
        pad_token_id=pad_id,
    )


def train_bpe_tokenizer(
    corpus: Iterable[str], vocab_size: int, extra_tokens: list[str] | None = None, *, qwen: bool = False
):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with mmfast's special tokens at ids 0..4
    (``extra_tokens``, e.g. a video token, follow at 5...).

    BOS is added by a post-processor, as Llama tokenizers do; ``<image>`` is a single special token.
    ``qwen``: Qwen-VL's special tokens instead (ids 0..6, see ``QWEN_SPECIAL_TOKENS``), no BOS.
    """
    if qwen:
        return _qwen_tokenizer(corpus, vocab_size)
    special = SPECIAL_TOKENS + list(extra_tokens or [])
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _byte_level_bpe(corpus, vocab_size, special, unk="<unk>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={
            "image_token": IMAGE_TOKEN,
            **({"video_token": VIDEO_TOKEN} if VIDEO_TOKEN in special else {}),
        },
        padding_side="left",
    )
    for i, t in enumerate(special):
        assert fast.convert_tokens_to_ids(t) == i, f"special token {t} must have id {i}"
    return fast


def build_processor(tokenizer, image_size: int, patch_size: int):
    """A ``LlavaProcessor`` with a CLIP image processor at ``image_size`` (resize + center crop)."""
    from transformers import LlavaProcessor
    from transformers.models.clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLS, dropped by the "default" strategy (as llava-hf)
    )


_TEST_CORPUS = [
    "USER: Describe the image. ASSISTANT: A red dog sits next to a blue cup on a table.",
    "Is there a cat in the image? Yes. No. There is a person, a car and a clock.",
    "Please describe this image in detail. The kitchen has a bowl, a fork, a knife and a pizza.",
    "What color is the car? How many dogs are there? Two. Three. Where is the clock? On the left.",
]


def random_llava(
    shape: str | LlavaShape = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    corpus: Iterable[str] | None = None,
    init_std: float = 0.02,
):
    """A randomly initialised LLaVA model and processor (no downloads). Returns (model, processor).

    Tests use ``init_std`` ~0.2 so that random models produce varied (non-repeating) tokens.
    """
    from transformers import LlavaForConditionalGeneration

    shp = SHAPES[shape] if isinstance(shape, str) else shape
    text = list(corpus) if corpus is not None else _TEST_CORPUS
    tokenizer = train_bpe_tokenizer(text * 4, min(shp.vocab_size, 600))
    vocab = max(shp.vocab_size, len(tokenizer))
    config = llava_config(shp, vocab_size=vocab, init_std=init_std)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(dtype).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = 1
    return model, build_processor(tokenizer, shp.image_size, shp.patch_size)


def save_model(model, processor, path: str | Path) -> Path:
    """``save_pretrained`` both (safetensors) into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return path


def random_llava_next(
    shape: str | LlavaShape = "tiny", *, seed: int = 0, init_std: float = 0.2, pinpoints: list[list[int]] | None = None
):
    """A randomly initialised LLaVA-NeXT (anyres) model and processor for tests. Returns (model, processor).

    ``pinpoints``: the anyres resolutions (default: 1 x 1, 1 x 2, 2 x 1 and 2 x 2 tiles of the tower's input)."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next import LlavaNextImageProcessorPil

    shp = SHAPES[shape] if isinstance(shape, str) else shape
    tokenizer = train_bpe_tokenizer(_TEST_CORPUS * 4, min(shp.vocab_size, 600))
    base = llava_config(shp, vocab_size=max(shp.vocab_size, len(tokenizer)), init_std=init_std)
    s = shp.image_size
    pinpoints = pinpoints or [[s, s], [s, 2 * s], [2 * s, s], [2 * s, 2 * s]]
    config = LlavaNextConfig(
        vision_config=base.vision_config,
        text_config=base.text_config,
        image_token_index=base.image_token_id,
        image_grid_pinpoints=pinpoints,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": s}, crop_size={"height": s, "width": s}, image_grid_pinpoints=pinpoints
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=shp.patch_size,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    return model, processor


#: ChatML, as the llava-hf OneVision checkpoints template a user turn: images first, then videos, then the text.
ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VIDEO_TOKEN = "<video>"


def random_llava_onevision(
    shape: str | LlavaShape = "tiny",
    *,
    seed: int = 0,
    init_std: float = 0.2,
    max_tiles: int = 4,
    vision_aspect_ratio: str = "anyres_max_9",
):
    """A randomly initialised LLaVA-OneVision model (SigLIP tower without CLS, Qwen2 LLM, anyres-max
    tiles) and its processor, for tests. Returns (model, processor).

    The pinpoints are every (r x c) tiling of the tower's input size with r, c <= ``max_tiles``, as the
    hub checkpoints' (1..6 tiles of 384 px per side); with the tiny 4x4 grid, a 4x4 tiling holds more
    than 9 base views' worth of patches, so ``anyres_max_9`` also exercises the downscaling branch.
    """
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )
    from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil

    from .llava_onevision import image_processor_class

    shp = SHAPES[shape] if isinstance(shape, str) else shape
    tokenizer = train_bpe_tokenizer(_TEST_CORPUS * 4, min(shp.vocab_size, 600), extra_tokens=[VIDEO_TOKEN])
    s = shp.image_size
    vision = SiglipVisionConfig(
        hidden_size=shp.vision_hidden,
        intermediate_size=shp.vision_intermediate or shp.vision_hidden * 4,
        num_hidden_layers=shp.vision_layers,
        num_attention_heads=shp.vision_heads,
        image_size=s,
        patch_size=shp.patch_size,
        vision_use_head=False,
    )
    text = Qwen2Config(
        vocab_size=max(shp.vocab_size, len(tokenizer)),
        hidden_size=shp.text_hidden,
        intermediate_size=shp.text_intermediate,
        num_hidden_layers=shp.text_layers,
        num_attention_heads=shp.text_heads,
        num_key_value_heads=shp.text_kv_heads,
        max_position_embeddings=shp.max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=init_std,
    )
    pinpoints = [[s * r, s * c] for r in range(1, max_tiles + 1) for c in range(1, max_tiles + 1)]
    config = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        video_token_index=tokenizer.convert_tokens_to_ids(VIDEO_TOKEN),
        image_grid_pinpoints=pinpoints,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=vision_aspect_ratio,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = 1
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": s, "width": s}, image_grid_pinpoints=pinpoints)
    processor = image_processor_class()(
        image_processor=image_processor,
        tokenizer=tokenizer,
        num_image_tokens=(s // shp.patch_size) ** 2,
        vision_feature_select_strategy="full",
        chat_template=ONEVISION_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        video_token=VIDEO_TOKEN,
        vision_aspect_ratio=vision_aspect_ratio,
    )
    return model, processor


# -- Qwen-VL families -------------------------------------------------------------------------------
#: Qwen-VL's special tokens (pad, im_start, im_end = EOS, vision_start, vision_end, image, video) at ids 0..6
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

#: Qwen2-VL / Qwen2.5-VL / Qwen3-VL chat template (system-less): each image is
#: "<|vision_start|><|image_pad|><|vision_end|>" before the text, as the official template places it.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_bpe(corpus: Iterable[str], vocab_size: int, special: list[str], unk: str | None):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus``, ``special`` at ids 0, 1, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _qwen_tokenizer(corpus: Iterable[str], vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    tok = _byte_level_bpe(corpus, vocab_size, QWEN_SPECIAL_TOKENS, unk=None)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )
    for i, t in enumerate(QWEN_SPECIAL_TOKENS):
        assert fast.convert_tokens_to_ids(t) == i, f"special token {t} must have id {i}"
    return fast


@dataclass(frozen=True)
class QwenShape:
    """Sizes of a Qwen-VL model built from config (all three families)."""

    patch_size: int = 4
    vision_hidden: int = 32
    vision_layers: int = 3
    vision_heads: int = 4
    text_hidden: int = 64
    text_layers: int = 4
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 128
    vocab_size: int = 300
    window_size: int = 16  # Qwen2.5-VL tower window in pixels: 16 / 4 / 2 = 2 x 2 merged tokens
    mrope_section: tuple[int, int, int] = (2, 3, 3)  # half the head dim, split over (t, h, w)
    min_pixels: int = 16 * 16
    max_pixels: int = 64 * 64
    max_positions: int = 2048
    vision_intermediate: int | None = None  # default 2 x vision_hidden
    fullatt_blocks: tuple[int, ...] | None = None  # Qwen2.5-VL full-attention blocks (default: the last)
    bench_image: tuple[int, int] = (48, 64)  # (H, W) of the images the shaped prefill timing feeds
    rope_theta: float = 10000.0


#: Qwen2.5-VL-7B-Instruct's sizes (its config.json): the real tower (32 blocks of 1280, window 112,
#: full attention in 7/15/23/31, out 3584) and the LLM at width 3584 (28 layers, 28 heads, 4 KV heads,
#: MLP 18944, mrope_section 16/24/24), processor min/max pixels 56*56 .. 28*28*16384.
_QWEN25_7B = QwenShape(
    patch_size=14,
    vision_hidden=1280,
    vision_layers=32,
    vision_heads=16,
    text_hidden=3584,
    text_layers=28,
    text_heads=28,
    text_kv_heads=4,
    text_intermediate=18944,
    vocab_size=32064,
    window_size=112,
    mrope_section=(16, 24, 24),
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 16384,
    max_positions=32768,
    vision_intermediate=3420,
    fullatt_blocks=(7, 15, 23, 31),
    bench_image=(768, 1024),
    rope_theta=1000000.0,
)

QWEN_SHAPES: dict[str, QwenShape] = {
    "tiny": QwenShape(),
    # the bench's timing slice: the real tower and 4 of the 28 decoder layers at the real width; a
    # 1024 x 768 image is resized to 1036 x 756 = 74 x 54 patches -> 37 x 27 = 999 vision tokens
    # (vocabulary cut to 32064: only the embedding / LM-head size changes, not prefill FLOPs)
    "qwen2.5-vl-7b-slice": dataclasses.replace(_QWEN25_7B, text_layers=4),
    # a tiny stand-in with the same code path (tests of the shaped bench)
    "qwen2.5-vl-tiny-slice": QwenShape(),
    # the whole Qwen2.5-VL-7B (28 decoder layers, its 152064-token vocabulary): the GPU speed bench
    "qwen2.5-vl-7b": dataclasses.replace(_QWEN25_7B, vocab_size=152064),
}


def qwen_config(family: str, shape: QwenShape, *, vocab_size: int, init_std: float = 0.02):
    """The ``Qwen2VLConfig`` / ``Qwen2_5_VLConfig`` / ``Qwen3VLConfig`` of ``shape``'s sizes (ids as
    ``QWEN_SPECIAL_TOKENS``)."""
    import transformers as tf

    head_dim = shape.text_hidden // shape.text_heads
    rope = {"rope_type": "default", "rope_theta": shape.rope_theta, "mrope_section": list(shape.mrope_section)}
    text = dict(
        vocab_size=vocab_size,
        hidden_size=shape.text_hidden,
        intermediate_size=shape.text_intermediate,
        num_hidden_layers=shape.text_layers,
        num_attention_heads=shape.text_heads,
        num_key_value_heads=shape.text_kv_heads,
        max_position_embeddings=shape.max_positions,
        initializer_range=init_std,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
        rope_parameters=rope,
    )
    ids = dict(
        image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4, tie_word_embeddings=False
    )
    common_vision = dict(
        depth=shape.vision_layers,
        num_heads=shape.vision_heads,
        patch_size=shape.patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=init_std,
    )
    if family == "qwen2_vl":
        vision = dict(common_vision, embed_dim=shape.vision_hidden, hidden_size=shape.text_hidden, mlp_ratio=2)
        return tf.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen2_5_vl":
        vision = dict(
            common_vision,
            hidden_size=shape.vision_hidden,
            intermediate_size=shape.vision_intermediate or 2 * shape.vision_hidden,
            out_hidden_size=shape.text_hidden,
            window_size=shape.window_size,
            fullatt_block_indexes=list(shape.fullatt_blocks or [shape.vision_layers - 1]),
            tokens_per_second=2,
        )
        return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if family == "qwen3_vl":
        rope = dict(rope, mrope_interleaved=True)
        text = dict(text, head_dim=head_dim, rope_parameters=rope)
        vision = dict(
            common_vision,
            hidden_size=shape.vision_hidden,
            intermediate_size=2 * shape.vision_hidden,
            out_hidden_size=shape.text_hidden,
            num_position_embeddings=64,
            deepstack_visual_indexes=list(range(min(2, shape.vision_layers - 1))),
        )
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    raise ValueError(f"unknown Qwen-VL family {family!r} (qwen2_vl, qwen2_5_vl, qwen3_vl)")


QWEN_MODEL_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}
_QWEN_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


def random_qwen_vl(
    family: str = "qwen2_5_vl",
    shape: str | QwenShape = "tiny",
    *,
    seed: int = 0,
    init_std: float = 0.2,
    dtype: torch.dtype = torch.float32,
):
    """A randomly initialised Qwen2-VL / Qwen2.5-VL / Qwen3-VL model and processor (no downloads): the
    real model class, the real (PIL) Qwen2-VL image processor with dynamic resolution, a BPE tokenizer
    with Qwen's special tokens and the Qwen chat layout. Returns (model, processor)."""
    import transformers as tf
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    shp = QWEN_SHAPES[shape] if isinstance(shape, str) else shape
    tokenizer = _qwen_tokenizer(_TEST_CORPUS * 4, min(shp.vocab_size, 600))
    config = qwen_config(family, shp, vocab_size=max(shp.vocab_size, len(tokenizer)), init_std=init_std)
    torch.manual_seed(seed)
    model = getattr(tf, QWEN_MODEL_CLASSES[family])(config).to(dtype).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = None
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": shp.min_pixels, "longest_edge": shp.max_pixels},
        patch_size=shp.patch_size,
        temporal_patch_size=2,
        merge_size=2,
    )
    from .qwen_processor import QwenVLImageProcessor

    try:
        processor = getattr(tf, _QWEN_PROCESSORS[family])(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_CHAT_TEMPLATE
        )
    except (AttributeError, ImportError, TypeError):  # its video processor needs torchvision
        processor = QwenVLImageProcessor(image_processor, tokenizer, QWEN_CHAT_TEMPLATE)
    return model, processor


# -- full-depth models for the GPU speed bench ----------------------------------------------------
@dataclass(frozen=True)
class BenchModel:
    """A random-weight model of a real architecture for speed benchmarks: the family's builder, the
    sizes (a ``SHAPES`` / ``QWEN_SHAPES`` key), the (H, W) of the images it is timed on, the
    anyres pinpoints (LLaVA-NeXT), and the tiles per side of the anyres-max pinpoints (LLaVA-OneVision:
    every r x c tiling with r, c <= ``max_tiles``)."""

    family: str  # llava | llava_next | llava_onevision | qwen2_5_vl
    shape: str
    image: tuple[int, int]
    pinpoints: tuple[tuple[int, int], ...] = ()
    max_tiles: int = 4


#: LLaVA-NeXT-7B's anyres grid (llava-hf/llava-v1.6-vicuna-7b-hf): up to 2 x 2 tiles of 336 px
_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))

BENCH_MODELS: dict[str, BenchModel] = {
    # LLaVA-1.5-7B: CLIP-L/336 + 32 Llama layers at 4096; 576 vision tokens
    "llava-1.5-7b": BenchModel("llava", "llava-1.5-7b", (336, 336)),
    # LLaVA-NeXT-7B (Vicuna): the same sizes, anyres; a 672 x 672 image gives the base view (576) and
    # 2 x 2 tiles (48 x 48 unpadded + 48 newline tokens): 2,928 vision tokens (the 5 x 576 = 2,880 grid)
    "llava-next-7b": BenchModel("llava_next", "llava-1.5-7b", (672, 672), _NEXT_PINPOINTS),
    # Qwen2.5-VL-7B: a 1024 x 768 image -> 37 x 27 = 999 merged vision tokens
    "qwen2.5-vl-7b": BenchModel("qwen2_5_vl", "qwen2.5-vl-7b", (768, 1024)),
    # LLaVA-OneVision-7B: anyres_max_9 over 1..6 x 1..6 tiles of 384 px (the checkpoint's 36 pinpoints);
    # a 1024 x 768 image -> 4,725 vision tokens (the base view's 729, then the unpadded tile mosaic
    # with its row newlines)
    "llava-onevision-7b": BenchModel("llava_onevision", "llava-onevision-7b", (768, 1024), max_tiles=6),
    # tests: the tiny shapes through the same code paths
    "tiny": BenchModel("llava", "tiny", (32, 32)),
    "tiny-next": BenchModel("llava_next", "tiny", (64, 64), ((32, 32), (32, 64), (64, 32), (64, 64))),
    "tiny-qwen": BenchModel("qwen2_5_vl", "qwen2.5-vl-tiny-slice", (48, 64)),
    "tiny-onevision": BenchModel("llava_onevision", "tiny", (48, 64), max_tiles=2),
}


def reduced_shape(
    spec: BenchModel, text_layers: int | None = None, vision_layers: int | None = None
) -> LlavaShape | QwenShape:
    """``spec``'s sizes with ``text_layers`` LLM layers and ``vision_layers`` tower blocks (None: unchanged),
    every width as it is. A Qwen2.5-VL tower keeps its full-attention blocks that still exist (7, 15, ...)
    and makes its last block full attention when none does, so a reduced tower has windowed and full blocks.

    Raises:
        ValueError: for a depth below 1 or above the shape's own.
    """
    shape = QWEN_SHAPES[spec.shape] if spec.family == "qwen2_5_vl" else SHAPES[spec.shape]
    changes: dict[str, object] = {}
    for what, value, full in (
        ("text_layers", text_layers, shape.text_layers),
        ("vision_layers", vision_layers, shape.vision_layers),
    ):
        if value is None:
            continue
        if not 1 <= value <= full:
            raise ValueError(f"{what} must be in [1, {full}] for {spec.shape}, got {value}")
        changes[what] = value
    if isinstance(shape, QwenShape) and "vision_layers" in changes:
        depth = int(changes["vision_layers"])
        blocks = tuple(b for b in (shape.fullatt_blocks or ()) if b < depth)
        changes["fullatt_blocks"] = blocks or (depth - 1,)
    return dataclasses.replace(shape, **changes) if changes else shape


def build_bench_model(
    name: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    init_std: float = 0.02,
    text_layers: int | None = None,
    vision_layers: int | None = None,
):
    """A :data:`BENCH_MODELS` model with random weights, built directly on ``device`` (a 7B model's
    random init takes seconds on a GPU, minutes on a CPU) and cast to ``dtype``. Returns (model, processor).

    ``text_layers`` / ``vision_layers``: a reduced depth (LLM decoder layers / vision-tower blocks) at the
    shape's full widths, for CPU runs (None: the shape's own depth); :func:`reduced_shape` says how.

    EOS is moved outside the vocabulary, so every answer runs to ``max_new_tokens`` (fixed-length timings)."""
    spec = BENCH_MODELS[name]
    shape = reduced_shape(spec, text_layers, vision_layers)
    with torch.device(device):
        if spec.family == "llava":
            model, processor = random_llava(shape, seed=seed, init_std=init_std)
        elif spec.family == "llava_next":
            model, processor = random_llava_next(
                shape, seed=seed, init_std=init_std, pinpoints=[list(p) for p in spec.pinpoints] or None
            )
        elif spec.family == "llava_onevision":
            model, processor = random_llava_onevision(shape, seed=seed, init_std=init_std, max_tiles=spec.max_tiles)
        elif spec.family == "qwen2_5_vl":
            model, processor = random_qwen_vl("qwen2_5_vl", shape, seed=seed, init_std=init_std)
        else:
            raise ValueError(f"unknown bench model family {spec.family!r}")
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = model.config.get_text_config().vocab_size  # never generated
    return model, processor


def _available_memory() -> int | None:
    """Bytes of memory the kernel reports available (``MemAvailable``), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_cpu_build_fits(
    name: str,
    device: str | torch.device,
    *,
    text_layers: int | None = None,
    vision_layers: int | None = None,
    available: int | None = None,
) -> None:
    """Refuse, before any compute, a :func:`build_bench_model` of ``name`` on the CPU that cannot fit in
    memory: its random init runs in float32 (4 bytes a parameter, counted on the meta device) whatever the
    bench's dtype, and a build past the memory is killed by the kernel with no message. ``available``:
    bytes free (None: the kernel's ``MemAvailable``; unknown: no check). Nothing to check on a GPU.

    Raises:
        InputError: the build needs more memory than is available.
    """
    if torch.device(device).type != "cpu":
        return
    available = _available_memory() if available is None else available
    if available is None:
        return
    model, _ = build_bench_model(
        name, device="meta", dtype=torch.float32, text_layers=text_layers, vision_layers=vision_layers
    )
    n = sum(p.numel() for p in model.parameters())
    need = 4 * n  # float32 init
    if need > available:
        raise InputError(
            f"bench model {name!r} ({n / 1e9:.2f}B parameters) needs about {need / 2**30:.1f} GiB of memory to "
            f"build on the CPU (its random init is float32) and {available / 2**30:.1f} GiB is available: run the "
            "bench on a GPU (model.device: cuda), or choose smaller bench.params.shapes (video_cost: fewer "
            "bench.params.layers / tower_layers)"
        )
