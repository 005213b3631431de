"""mmfast.compat against the installed transformers: the names it hands to model forwards are the ones
the installed release takes, and a generation through mmfast's own loop uses no deprecated spelling
(on 5.24 the old ``past_key_values`` keyword still worked, with a FutureWarning on every forward)."""

from __future__ import annotations

import inspect
import warnings

import torch
import transformers
from packaging.version import Version

from mmfast import compat


def test_installed_transformers_is_in_compat_range():
    v = Version(transformers.__version__)
    assert Version(compat.TRANSFORMERS_MIN) <= v < Version(compat.TRANSFORMERS_MAX_EXCLUSIVE)
    for tested in compat.TESTED_VERSIONS:
        assert Version(compat.TRANSFORMERS_MIN) <= Version(tested) < Version(compat.TRANSFORMERS_MAX_EXCLUSIVE)


def test_cache_kwarg_is_what_the_language_model_takes_and_returns(tiny_mm, images, prompts):
    lm = tiny_mm.adapter.language_model
    params = inspect.signature(inspect.unwrap(type(lm).forward)).parameters
    assert compat.CACHE_KWARG in params
    batch = tiny_mm.prepare(images[:1], prompts[:1])
    cache = compat.new_cache(tiny_mm.adapter.text_config)
    embeds = tiny_mm.adapter.embed_tokens(torch.tensor(batch.token_ids[:1]))  # [1, T, d]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = lm(inputs_embeds=embeds, use_cache=True, **compat.cache_kwargs(cache))
    assert compat.output_cache(out) is cache and compat.layer_length(cache, 0) == embeds.shape[1]


def test_generation_uses_no_deprecated_transformers_keyword(tiny_mm, images, prompts):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = tiny_mm.generate(images[:2], prompts[:2], max_new_tokens=4)
    assert all(r.token_ids for r in out)


def test_saved_qwen_image_processor_loads_without_torchvision(tmp_path, images):
    """A saved Qwen-VL directory loads its image processor on every release of the range, with the
    pixels of the processor it was saved from (5.17's AutoImageProcessor needs torchvision)."""
    from mmfast.models.factory import random_qwen_vl, save_model

    model, processor = random_qwen_vl("qwen2_vl", seed=1)
    path = save_model(model, processor, tmp_path / "q")
    loaded = compat.load_image_processor(str(path))
    want = processor.image_processor(images=images[:2], return_tensors="pt")
    got = loaded(images=images[:2], return_tensors="pt")
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
