"""The shipped embedded model: loads offline from the package, sees its world, and the trained
method components (drafts, predictors, HICom's global branch) load and stay lossless/consistent."""

from __future__ import annotations

from pathlib import Path

import pytest

import mmfast
from mmfast.checkpoint import embedded_dir
from mmfast.config import load_recipe
from mmfast.model import ASSETS
from mmfast.pipeline import Session

MODEL = ASSETS / "tiny-world"
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="embedded model not built")


@pytest.fixture(scope="module")
def world_mm():
    return mmfast.load("mmfast/tiny-world", device="cpu")


@pytest.fixture(scope="module")
def val_images():
    from mmfast.world import render_image

    return [render_image(0, "val", i) for i in range(1, 9)]


def test_geometry_and_offline_load(world_mm):
    cfg = world_mm.model.config
    assert cfg.vision_config.image_size // cfg.vision_config.patch_size == 24
    assert cfg.vision_feature_layer == -2 and world_mm.adapter.n_image_tokens == 576
    assert world_mm.model.config.model_type == "llava"
    # the package ships the weights packed (mmfast/weights_pack.py); the model loads from their unpacked copy
    loaded = Path(world_mm.model.name_or_path)
    assert (MODEL / "weights.pack.xz").is_file() and not list(MODEL.rglob("*.safetensors"))
    assert loaded == embedded_dir() and (loaded / "model.safetensors").is_file() and not list(loaded.glob("*.bin"))


def test_answers_object_questions(world_mm):
    """Regression guard on the shipped weights: yes/no questions about held-out images are answered
    from the image. Measured when shipped (see the model card): 0.926 accuracy on POPE random (v6)."""
    from mmfast.world import CATEGORIES, render_image
    from mmfast.world.text import SHORT_ANSWER_SUFFIX, object_question

    records = [render_image(0, "val", i) for i in range(1, 17)]
    questions, labels = [], []
    for r in records:
        present = r.annotation.object_names()
        absent = [c.name for c in CATEGORIES if c.name not in present]
        for name, label in [(present[0], "Yes"), (present[1], "Yes"), (absent[0], "No"), (absent[7], "No")]:
            questions.append(f"{object_question(name)}\n{SHORT_ANSWER_SUFFIX}")
            labels.append(label)

    def accuracy(images) -> float:
        out = world_mm.generate(images, questions, max_new_tokens=4)
        return sum(o.text.startswith(lab) for o, lab in zip(out, labels)) / len(labels)

    own = accuracy([r.image for r in records for _ in range(4)])
    shifted = accuracy([records[(i // 4 + 1) % len(records)].image for i in range(len(questions))])
    # measured on the shipped v6 weights: own 0.95, shifted 0.50 (v5 and v4: 0.92 / 0.52; v3: 0.81 / 0.47, v2: 0.75 / 0.44,
    # v1: 0.69 / 0.53); chance is 0.5
    assert own >= 0.88, own
    assert own >= shifted + 0.3, (own, shifted)  # another image's answers are worse: it looks


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "msd", "params": {"depth": 6, "top_k": 4, "total_tokens": 8}},
        {"method": "flash", "params": {"top_k": 4, "total_tokens": 12}},
        {"method": "prompt_lookup"},
    ],
)
def test_trained_drafts_are_lossless(world_mm, val_images, spec):
    prompt = "Please describe this image in detail."
    images = [r.image for r in val_images[:2]]
    base = world_mm.generate(images, [prompt] * 2, max_new_tokens=48)
    with Session(world_mm, load_recipe({"speculative": spec})) as s:
        fast = s.generate(images, [prompt] * 2, max_new_tokens=48)
    assert [r.token_ids for r in fast] == [r.token_ids for r in base]
    if spec["method"] in ("msd", "flash"):
        assert fast[0].stats["speculative"]["tau"] > 1.5  # a trained draft is accepted


def test_trained_pruners_load_and_run(world_mm, val_images):
    images = [r.image for r in val_images[:2]]
    prompts = ["Is there a dog in the image?"] * 2
    for stage in (
        {"method": "dynamic_llava"},  # at layer 2, where its predictors were trained
        {"method": "hicom", "params": {"local_tokens": 96, "global_queries": 32}},
    ):
        out = world_mm.generate(images, prompts, recipe={"pruning": [stage]}, max_new_tokens=3)
        assert all(o.vision_tokens_layer_avg < 576 for o in out)
