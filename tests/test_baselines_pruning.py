"""Baselines: random drop (seeded, original order, counts) and 2-D adaptive average pooling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmfast.config import load_recipe
from mmfast.pipeline import Session
from mmfast.pruning._grid import adaptive_bins, near_square_grid


def _session(mm, method, **params):
    return Session(mm, load_recipe({"pruning": [{"method": method, "params": params}]}))


def test_random_counts_order_and_seeding(tiny_mm, images, prompts):
    with _session(tiny_mm, "random", keep=6) as s:
        batch = tiny_mm.prepare(images[:3], prompts[:3])
        v1 = s.encode(batch)
        v_single = s.encode(tiny_mm.prepare(images[1:2], prompts[1:2]))
        res = s.generate(images[:3], prompts[:3], max_new_tokens=2)
    assert [r.n_vision_tokens for r in res] == [6, 6, 6]
    for ids in v1.patch_ids:
        assert ids.numel() == 6 and torch.all(ids[1:] > ids[:-1])  # original order
    assert torch.equal(v1.patch_ids[1], v_single.patch_ids[0])  # per image, whatever the batch
    assert not all(torch.equal(v1.patch_ids[0], p) for p in v1.patch_ids[1:])  # images differ
    with _session(tiny_mm, "random", keep=6, mask="shared") as s:
        v2 = s.encode(batch)
    assert all(torch.equal(v2.patch_ids[0], p) for p in v2.patch_ids)
    with _session(tiny_mm, "random", keep=6, seed=1) as s:
        v3 = s.encode(batch)
    assert not all(torch.equal(a, b) for a, b in zip(v1.patch_ids, v3.patch_ids))
    # the kept rows are the original features of those patches
    with Session(tiny_mm, load_recipe({})) as base:
        full = base.encode(batch)
    for i in range(3):
        assert torch.equal(v1.features[i], full.features[i][v1.patch_ids[i]])


def test_avgpool_grid_counts_and_values(tiny_mm, images, prompts):
    assert near_square_grid(64, 24, 24) == (8, 8)
    assert near_square_grid(128, 24, 24) == (11, 12)
    assert near_square_grid(192, 24, 24) == (14, 14)
    assert adaptive_bins(24, 8) == [(3 * i, 3 * i + 3) for i in range(8)]
    batch = tiny_mm.prepare(images[:2], prompts[:2])
    with Session(tiny_mm, load_recipe({})) as base:
        full = base.encode(batch)
    for keep, want in ((4, 4), (5, 4), (9, 9)):
        with _session(tiny_mm, "avgpool", keep=keep) as s:
            vision = s.encode(batch)
            res = s.generate(images[:2], prompts[:2], max_new_tokens=2)
        oh, ow = near_square_grid(keep, 4, 4)
        assert oh * ow == want and [r.n_vision_tokens for r in res] == [want, want]
        assert res[0].stats["avgpool"]["grid"] == [oh, ow]
        for i in range(2):
            grid = full.features[i].reshape(4, 4, -1).permute(2, 0, 1)
            ref = F.adaptive_avg_pool2d(grid, (oh, ow)).flatten(1).T
            torch.testing.assert_close(vision.features[i], ref)
            assert torch.all(vision.patch_ids[i] == -1)


_TILED: dict[str, object] = {}


def _tiled_mm(family: str):
    """Tiny LLaVA-NeXT / LLaVA-OneVision: images re-packed (base view, mosaic, newlines) after the projector."""
    if family not in _TILED:
        import mmfast
        from mmfast.models.factory import random_llava_next, random_llava_onevision

        model, proc = (random_llava_next if family == "llava_next" else random_llava_onevision)("tiny", seed=1)
        _TILED[family] = mmfast.load(model, proc)
    return _TILED[family]


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
def test_random_draws_from_the_packed_tokens_of_tiled_models(family, images, prompts):
    """On models that pack tiles after the projector, random drop keeps exactly ``keep`` of an image's
    LLM-input tokens, drawn by the seeded rule from the packed tokens, per image whatever the batch."""
    from mmfast.pruning.random_drop import image_seed

    mm = _tiled_mm(family)
    batch = mm.prepare(images[:2], prompts[:2])
    with Session(mm, load_recipe({})) as base:
        full = base.encode(batch)
        plain = [r.token_ids for r in base.generate(images[:2], prompts[:2], max_new_tokens=3)]
    with _session(mm, "random", keep=7) as s:
        vision = s.encode(batch)
        alone = s.encode(mm.prepare(images[1:2], prompts[1:2]))
        res = s.generate(images[:2], prompts[:2], max_new_tokens=3)
    assert [r.n_vision_tokens for r in res] == [7, 7]
    for i in range(2):
        n = full.projected[i].shape[0]  # the image's packed tokens (base view, mosaic, newlines)
        assert n > 7
        tiles = [int(t) for t in full.extras["n_tiles"]]  # the tower's input: every image's tiles in one list
        own = full.pixel_values[sum(tiles[:i]) : sum(tiles[: i + 1])]
        g = torch.Generator().manual_seed(image_seed(0, own))
        rows = torch.randperm(n, generator=g)[:7].sort().values  # the rule, computed directly
        assert torch.equal(vision.projected[i], full.projected[i][rows])
        assert torch.equal(vision.patch_ids[i], full.patch_ids[i][rows])
    assert torch.equal(alone.projected[0], vision.projected[1])  # per image, whatever the batch
    with _session(mm, "random", fraction=1.0) as s:  # the no-op setting: the baseline exactly
        assert [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=3)] == plain


def test_random_drops_onevision_video_tokens():
    """A OneVision video's pooled frame tokens (and its closing newline) are the candidates."""
    import numpy as np

    mm = _tiled_mm("llava_onevision")
    video = np.random.default_rng(0).integers(0, 255, (4, 28, 28, 3), dtype=np.uint8)
    full = mm.generate(None, "Go.", videos=video, max_new_tokens=2)[0].n_vision_tokens
    res = mm.generate(
        None, "Go.", {"pruning": [{"method": "random", "budget": {"ratio": 0.25}}]}, videos=video, max_new_tokens=2
    )
    assert res[0].n_vision_tokens == round(0.25 * full) < full
