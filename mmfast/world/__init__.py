"""A procedurally generated, COCO-like image world (deterministic from a seed).

mmfast ships a tiny LLaVA trained on this world so that token pruning, anti-hallucination
decoding and speculative decoding can be demonstrated fully offline. The world mimics the
properties of COCO that those methods depend on:

* objects of 50 real COCO categories (exact names and ids), drawn procedurally with intra-class
  variation; some pairs are confusable at small sizes (cup / bowl / wine glass, cat / dog,
  fork / knife / spoon, tv / laptop / microwave, remote / cell phone);
* small (10-18 px) and partly occluded instances, textured and cluttered backgrounds;
* seven scene types with co-occurrence statistics, so that a language prior toward
  "typical but absent" objects exists (POPE popular / adversarial, CHAIR);
* COCO instances / captions files, POPE files built with the official rule (version ``official``;
  the earlier files stay buildable as version ``v1``), a per-pixel
  label map for dense supervision, and text generators for instruction tuning.

Public API::

    render_image(seed, split, image_id, config=None) -> RenderedImage   # image + maps + annotation
    write_world(out_dir, seed=0, n_train=8000, n_val=500, image_size=192, ...) -> WorldSummary
    load_annotations / load_captions / load_label_map / load_world_info  # read a written world
    captions / detailed_description / yes_no_questions / short_qa / world_corpus  # text
    build_pope(annotations, version="official") / read_pope               # POPE files
    render_clip(seed, clip_id, VideoConfig(frames=16)) -> RenderedClip     # video world (mmfast.world.video)
    write_video_world(out_dir, seed=0, n_clips=32, ...) / load_clips / load_clip_frames
    CATEGORIES, SCENES, LABEL_NAMES, NUM_LABELS, CAPTION_PROMPTS, DETAIL_PROMPT, ...
"""

from __future__ import annotations

from .categories import CATEGORIES, CATEGORY_BY_ID, CATEGORY_BY_NAME, LABEL_NAMES, NUM_LABELS, Category, category
from .dataset import load_annotations, load_captions, load_label_map, load_world_info, world_config
from .pope_build import DEFAULT_POPE_VERSION, POPE_SPLITS, POPE_VERSIONS, PopeQuestion, build_pope, read_pope
from .render import (
    WORLD_VERSION,
    ImageAnnotation,
    Instance,
    RenderedImage,
    WorldConfig,
    file_name_for,
    image_seed,
    label_lut,
    render_image,
)
from .scenes import SCENE_BY_NAME, SCENES, SceneSpec
from .text import (
    CAPTION_PROMPTS,
    DETAIL_PROMPT,
    DETAIL_PROMPTS,
    SHORT_ANSWER_SUFFIX,
    QAPair,
    captions,
    detailed_description,
    image_texts,
    object_question,
    short_qa,
    static_texts,
    text_rng,
    world_corpus,
    yes_no_questions,
)
from .video_render import ClipAnnotation, RenderedClip, VideoConfig, render_clip

__all__ = [
    "CAPTION_PROMPTS",
    "CATEGORIES",
    "CATEGORY_BY_ID",
    "CATEGORY_BY_NAME",
    "Category",
    "ClipAnnotation",
    "DEFAULT_POPE_VERSION",
    "DETAIL_PROMPT",
    "DETAIL_PROMPTS",
    "ImageAnnotation",
    "Instance",
    "LABEL_NAMES",
    "NUM_LABELS",
    "POPE_SPLITS",
    "POPE_VERSIONS",
    "PopeQuestion",
    "QAPair",
    "RenderedClip",
    "RenderedImage",
    "SCENES",
    "SCENE_BY_NAME",
    "SHORT_ANSWER_SUFFIX",
    "SceneSpec",
    "VideoConfig",
    "VideoWorldSummary",
    "WORLD_VERSION",
    "WorldConfig",
    "WorldSummary",
    "build_pope",
    "captions",
    "category",
    "detailed_description",
    "file_name_for",
    "image_seed",
    "image_texts",
    "label_lut",
    "load_annotations",
    "load_captions",
    "load_clip_frames",
    "load_clips",
    "load_label_map",
    "load_world_info",
    "object_question",
    "read_pope",
    "render_clip",
    "render_image",
    "short_qa",
    "static_texts",
    "text_rng",
    "world_config",
    "world_corpus",
    "write_video_world",
    "write_world",
    "yes_no_questions",
]


def __getattr__(name: str) -> object:
    # Lazy so that ``python -m mmfast.world.generate`` (or ``.video``) does not import the module twice.
    if name in ("write_world", "WorldSummary"):
        from . import generate

        return getattr(generate, name)
    if name in ("write_video_world", "VideoWorldSummary", "load_clips", "load_clip_frames"):
        from . import video

        return getattr(video, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
