"""LLaVA-NeXT (anyres) as a second family: generation matches transformers, supported methods run,
grid-bound methods are rejected with a clear message."""

from __future__ import annotations

import pytest

import mmfast
from mmfast.config import load_recipe
from mmfast.errors import IncompatibleRecipeError
from mmfast.pipeline import Session


@pytest.fixture(scope="module")
def next_mm(tmp_path_factory):
    from mmfast.models.factory import random_llava_next, save_model

    model, processor = random_llava_next("tiny")
    path = save_model(model, processor, tmp_path_factory.mktemp("next"))
    return mmfast.load(path, device="cpu")


def test_next_matches_transformers_and_batches(next_mm, images, prompts):
    ours = next_mm.generate(images[:2], prompts[:2], max_new_tokens=8)
    assert next_mm.adapter.family == "llava_next"
    assert ours[0].n_vision_tokens > 16  # base view + unpadded tiles + newlines
    batch = next_mm.prepare([images[0]], [prompts[0]])
    inputs = next_mm.processor(images=images[0], text=batch.texts[0], return_tensors="pt")
    hf = next_mm.model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    hf = hf[: hf.index(2)] if 2 in hf else hf
    assert ours[0].token_ids == hf
    single = [next_mm.generate([im], [p], max_new_tokens=8)[0].token_ids for im, p in zip(images[:2], prompts[:2])]
    assert [r.token_ids for r in ours] == single


def test_next_llm_stage_pruning_and_decoders(next_mm, images, prompts):
    out = next_mm.generate(images[:2], prompts[:2], recipe={"pruning": [{"method": "fastv", "params": {"keep": 8}}]}, max_new_tokens=4)
    assert out[0].vision_tokens_layer_avg < out[0].n_vision_tokens
    for method in ("vcd", "m3id", "vhr"):
        next_mm.generate(images[:1], prompts[:1], recipe={"decoding": {"method": method}}, max_new_tokens=3)


@pytest.mark.parametrize("recipe, match", [
    ({"pruning": [{"method": "visionzip", "params": {"tokens": 8}}]}, "llava_next family"),
    ({"pruning": [{"method": "tome", "params": {"budget": 8}}]}, "llava_next family"),
    ({"decoding": {"method": "damro"}}, "llava_next family"),
])
def test_next_rejects_grid_methods(next_mm, recipe, match):
    with pytest.raises(IncompatibleRecipeError, match=match):
        Session(next_mm, load_recipe(recipe))
