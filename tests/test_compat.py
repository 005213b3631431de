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
