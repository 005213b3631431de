"""LLaVA-NeXT (anyres) as a second family: generation matches transformers, supported methods run,
grid-bound methods are rejected with a clear message."""

from __future__ import annotations

import pytest
import torch

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
    hf = next_mm.model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1] :].tolist()
    hf = hf[: hf.index(2)] if 2 in hf else hf
    assert ours[0].token_ids == hf
    single = [next_mm.generate([im], [p], max_new_tokens=8)[0].token_ids for im, p in zip(images[:2], prompts[:2])]
    assert [r.token_ids for r in ours] == single


def test_next_llm_stage_pruning_and_decoders(next_mm, images, prompts):
    out = next_mm.generate(
        images[:2], prompts[:2], recipe={"pruning": [{"method": "fastv", "params": {"keep": 8}}]}, max_new_tokens=4
    )
    assert out[0].vision_tokens_layer_avg < out[0].n_vision_tokens
    for method in ("vcd", "m3id", "vhr"):
        next_mm.generate(images[:1], prompts[:1], recipe={"decoding": {"method": method}}, max_new_tokens=3)


@pytest.mark.parametrize(
    "recipe, match",
    [
        (
            {"pruning": [{"method": "visionzip", "params": {"tokens": 8}}]},
            r"needs one tower input per image .*this model \(llava_next\)",
        ),
        (
            {"pruning": [{"method": "tome", "params": {"budget": 8}}]},
            r"needs one tower input per image .*this model \(llava_next\)",
        ),
        ({"decoding": {"method": "damro"}}, r"needs one tower input per image .*this model \(llava_next\)"),
    ],
)
def test_next_rejects_grid_methods(next_mm, recipe, match):
    with pytest.raises(IncompatibleRecipeError, match=match):
        Session(next_mm, load_recipe(recipe))


def _newline_slots(mm, inputs):
    """[B, L] the LLaVA-NeXT row separators (``image_newline`` embeddings) among the vision tokens."""
    nl = mm.model.model.image_newline.to(inputs.embeds.dtype)
    return inputs.image_mask & (inputs.embeds == nl).all(-1)


def test_next_row_separators_are_droppable_vision_tokens(next_mm, images, prompts, monkeypatch):
    """As the releases do (FastV ranks every token of the image span, Dynamic-LLaVA's image span holds
    the newline embeddings, ZipVL has no code), the row separators are vision tokens: FastV ranks them
    with the patches (a direct top-k over all vision slots) and drops the low-ranked ones."""
    from mmfast.pruning.fastv import FastV

    seen = []
    real = FastV.select

    def spy(self, view):
        keep = real(self, view)
        scores = self.ctx.probe[self.probe_key].probs[:, 0]  # [B, T] last row, head mean
        seen.append((view.state.inputs, view.vision.clone(), scores.clone(), keep.clone()))
        return keep

    monkeypatch.setattr(FastV, "select", spy)
    keep_n = 8
    next_mm.generate(
        images[:2], prompts[:2], recipe={"pruning": [{"method": "fastv", "params": {"keep": keep_n}}]}, max_new_tokens=2
    )
    inputs, vision, scores, keep = seen[0]
    newline = _newline_slots(next_mm, inputs)
    assert newline.sum(1).min() > 0 and bool((vision | ~newline).all())  # every separator is a vision slot
    dropped_newlines = 0
    for b in range(vision.shape[0]):
        vis = vision[b].nonzero().squeeze(1)
        top = vis[scores[b, vis].topk(keep_n).indices]  # direct rule: top-k over every vision slot
        kept_vis = (keep[b] & vision[b]).nonzero().squeeze(1)
        assert sorted(kept_vis.tolist()) == sorted(top.tolist())
        dropped_newlines += int((newline[b] & ~keep[b]).sum())
    assert dropped_newlines > 0


def test_a_video_method_is_refused_for_the_missing_video_input_first(next_mm):
    """A family without video input cannot run a video pruner whatever else it has: FastVID's refusal on
    LLaVA-NeXT named its Qwen grid need and advised ``siglip_head``, which only led to a second refusal."""
    for params in ({}, {"siglip_head": "/nowhere"}):
        with pytest.raises(IncompatibleRecipeError, match=r"needs video input, .*\(it takes no video input\)") as e:
            Session(next_mm, load_recipe({"pruning": [{"method": "fastvid", "params": params}]}))
        assert "siglip_head" not in str(e.value).split("; pruning methods that run there")[0]


def test_vcd_noise_of_an_images_tiles_does_not_depend_on_the_batch_padding():
    """VCD noises each image's row of the batch's pixel tensor; anyres rows are padded to the batch's most tiles.
    A tile of 3 x 30 x 30 values (not a multiple of 16) got other noise at its row's end when padding followed it
    (torch's CPU randn recomputes a trailing partial block of 16), so a batch gave an image other noise than alone."""
    from mmfast.decoding.vcd import ddpm_noise

    alone = torch.zeros(1, 2, 3, 30, 30)  # [1, tiles, 3, S, S]: the image's own tiles
    padded = torch.zeros(1, 5, 3, 30, 30)  # the same image in a batch whose largest image has 5 tiles
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    assert torch.equal(ddpm_noise(padded, 500, gen())[:, :2], ddpm_noise(alone, 500, gen()))
