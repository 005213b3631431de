"""transformers interop: a loaded model, generation keywords, per-call decoders, streamers, and
transformers' own generate inside a session."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoProcessor, GenerationConfig, TextStreamer

import mmfast
from mmfast.errors import IncompatibleRecipeError, InputError, ModelLoadError

N = 5


def _ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


# -- mmfast.load with an already loaded model ------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(tiny_dir):
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    return model, AutoProcessor.from_pretrained(tiny_dir)


def test_load_accepts_a_loaded_model(loaded, tiny_mm, images, prompts):
    model, processor = loaded
    mm = mmfast.load(model, processor=processor)
    assert mm.model is model and mm.name == str(model.name_or_path)
    assert _ids(mm.generate(images[:2], prompts[:2], max_new_tokens=N)) == _ids(
        tiny_mm.generate(images[:2], prompts[:2], max_new_tokens=N)
    )
    with mmfast.apply(mm, {"pruning": [{"method": "fastv", "params": {"keep": 5}}]}) as s:
        assert s.generate(images[:1], prompts[:1], max_new_tokens=2)[0].n_vision_tokens == 16


def test_load_loaded_model_refusals(loaded):
    model, processor = loaded
    with pytest.raises(InputError, match=r"processor=AutoProcessor.from_pretrained"):
        mmfast.load(model)
    with pytest.raises(InputError, match="not its tokenizer"):
        mmfast.load(model, processor=processor.tokenizer)
    with pytest.raises(InputError, match="device_map.*already loaded"):
        mmfast.load(model, processor=processor, device_map="auto")
    with pytest.raises(InputError, match="not a transformers model"):
        mmfast.load(torch.nn.Linear(2, 2), processor=processor)
    with pytest.raises(InputError, match="generation class LlavaForConditionalGeneration"):
        mmfast.load(model.model, processor=processor)
    with pytest.raises(InputError, match="got a int"):
        mmfast.load(3)


def test_apply_refuses_a_transformers_model(loaded):
    """mmfast.apply(hf_model, recipe) says to wrap the model with mmfast.load, not an AttributeError."""
    model, _ = loaded
    for thing in (model, None, "mmfast/tiny-world"):
        with pytest.raises(InputError, match=r"mmfast.load\(model, processor=processor\)"):
            mmfast.apply(thing, {"pruning": [{"method": "fastv", "params": {"keep": 5}}]})
    assert "generate" not in model.__dict__


def test_load_refuses_a_processor_of_another_geometry(loaded):
    """A processor of another checkpoint (another image size / patch size) is refused at load, naming both sizes,
    instead of a ValueError from the vision tower at the first generate."""
    from mmfast.models.factory import random_llava

    model, _ = loaded
    _, other = random_llava("world-tiny")  # 192 x 192 images, 32-pixel patches; the tiny tower takes 32 x 32, 8
    with pytest.raises(InputError, match=r"crops images to 192x192, the vision tower takes 32x32.*32-pixel patches"):
        mmfast.load(model, processor=other)


def test_load_loaded_model_in_training_mode_warns(tiny_dir, caplog):
    """mmfast runs a loaded model in eval mode; switching the caller's training-mode model is said, not silent."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32).train()
    with caplog.at_level("WARNING", logger="mmfast.model"):
        mmfast.load(model, processor=AutoProcessor.from_pretrained(tiny_dir))
    assert not model.training and "training mode; mmfast puts it in eval mode" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mmfast.model"):
        mmfast.load(model, processor=AutoProcessor.from_pretrained(tiny_dir))  # already in eval mode: nothing to say
    assert "training mode" not in caplog.text


def test_load_loaded_model_dtype_and_unsupported(tiny_dir, caplog):
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    with caplog.at_level("WARNING", logger="mmfast.model"):
        mm = mmfast.load(
            model, AutoProcessor.from_pretrained(tiny_dir), dtype="bfloat16", device="cpu"
        )  # processor positional
    assert mm.dtype == torch.bfloat16 and mm.device.type == "cpu"
    # the cast is the caller's model's too, and says so
    assert model.dtype == torch.bfloat16 and mm.model is model
    assert "dtype=bfloat16 casts your LlavaForConditionalGeneration in place, from torch.float32" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mmfast.model"):
        mmfast.load(
            model, AutoProcessor.from_pretrained(tiny_dir), dtype="bfloat16"
        )  # already bfloat16: nothing to say
    assert "in place" not in caplog.text
    model.config.model_type = "qwen2_vl"  # a supported family, but not this model's class
    with pytest.raises(mmfast.InputError, match="Qwen2VLForConditionalGeneration"):
        mmfast.load(model, processor=AutoProcessor.from_pretrained(tiny_dir))
    model.config.model_type = "idefics2"
    with pytest.raises(ModelLoadError, match="idefics2"):
        mmfast.load(model, processor=AutoProcessor.from_pretrained(tiny_dir))


# -- generation keywords ---------------------------------------------------------------------------
def test_keywords_map_to_decoders(tiny_mm, images, prompts):
    ims, ps = images[:2], prompts[:2]
    greedy = _ids(tiny_mm.generate(ims, ps, max_new_tokens=N))
    assert _ids(tiny_mm.generate(ims, ps, max_new_tokens=N, do_sample=False, num_beams=1)) == greedy
    beam = {"decoding": {"method": "beam", "params": {"num_beams": 3}}}
    assert _ids(tiny_mm.generate(ims, ps, max_new_tokens=N, num_beams=3)) == _ids(
        tiny_mm.generate(ims, ps, beam, max_new_tokens=N)
    )
    sample = {"decoding": {"method": "sample", "params": {"temperature": 0.7, "top_k": 5, "top_p": 0.9}}}
    want = _ids(tiny_mm.generate(ims, ps, sample, max_new_tokens=N, seed=3))
    got = _ids(tiny_mm.generate(ims, ps, max_new_tokens=N, seed=3, do_sample=True, temperature=0.7, top_k=5, top_p=0.9))
    assert got == want and got != greedy
    # transformers' defaults fill what the call leaves unset: top_k=50, temperature 1
    hf_default = {"decoding": {"method": "sample", "params": {"top_k": 50}}}
    assert _ids(tiny_mm.generate(ims, ps, max_new_tokens=N, seed=3, do_sample=True)) == _ids(
        tiny_mm.generate(ims, ps, hf_default, max_new_tokens=N, seed=3)
    )
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=N)
    assert _ids(tiny_mm.generate(ims, ps, seed=3, generation_config=cfg)) == want
    # an explicit keyword wins over the config
    assert _ids(tiny_mm.generate(ims, ps, seed=3, generation_config=cfg, do_sample=False)) == greedy


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tempreature": 0.5}, r"unknown keyword 'tempreature' \(did you mean 'temperature'\?\)"),
        ({"temperature": 0.5}, "no effect in greedy decoding; pass do_sample=True"),
        ({"length_penalty": 2.0}, r"no effect in greedy decoding; pass num_beams > 1"),
        ({"num_beams": 2, "do_sample": True}, "beam sampling"),
        ({"do_sample": True, "temperature": 0.0}, r"temperature=0\.0"),
        ({"num_beams": 0}, "num_beams must be a positive integer"),
        ({"do_sample": "yes"}, "do_sample must be True or False"),
        ({"generation_config": GenerationConfig(repetition_penalty=1.2)}, "repetition_penalty.*do not implement"),
        ({"generation_config": {"do_sample": True}}, "pass a transformers.GenerationConfig"),
        ({"generation_config": GenerationConfig(eos_token_id=7)}, "eos_token_id differs"),
        ({"decoding": "beam", "do_sample": True}, "either decoding= or sampling keywords"),
        ({"decoding": {"method": "beam", "max_new_tokens": 3}}, "only method and params"),
        ({"decoding": "bem"}, "bem"),
    ],
)
def test_keyword_refusals(tiny_mm, images, prompts, kwargs, match):
    with mmfast.apply(tiny_mm) as s, pytest.raises((InputError, mmfast.MMFastError), match=match):
        s.generate(images[:1], prompts[:1], max_new_tokens=2, **kwargs)


def test_model_generation_config_passed_back(tiny_mm, images, prompts):
    """A copy of the model's own generation_config (use_cache, output_* flags, its special tokens) is accepted;
    ``eos_token_id=[2]`` names the same stop token as the model's ``2``; a setting that would matter is refused."""
    import copy

    ims, ps = images[:2], prompts[:2]
    greedy = _ids(tiny_mm.generate(ims, ps, max_new_tokens=3))
    cfg = copy.deepcopy(tiny_mm.model.generation_config)
    cfg.max_new_tokens = 3
    assert _ids(tiny_mm.generate(ims, ps, generation_config=cfg)) == greedy
    eos = tiny_mm.model.generation_config.eos_token_id
    as_list = GenerationConfig(eos_token_id=[eos], max_new_tokens=3, output_scores=False)
    assert _ids(tiny_mm.generate(ims, ps, generation_config=as_list)) == greedy
    with pytest.raises(InputError, match="use_cache"):
        tiny_mm.generate(ims, ps, generation_config=GenerationConfig(use_cache=False, max_new_tokens=3))


def test_keywords_set_to_none_are_unset(tiny_mm, images, prompts):
    """``temperature=None`` / ``do_sample=None`` mean "unset" in transformers' generate (wrappers forward them)."""
    ims, ps = images[:2], prompts[:2]
    greedy = _ids(tiny_mm.generate(ims, ps, max_new_tokens=3))
    assert _ids(tiny_mm.generate(ims, ps, max_new_tokens=3, temperature=None, do_sample=None, top_p=None)) == greedy
    want = _ids(tiny_mm.generate(ims, ps, max_new_tokens=3, seed=2, do_sample=True))
    assert (
        _ids(tiny_mm.generate(ims, ps, max_new_tokens=3, seed=2, do_sample=True, top_k=None, temperature=None)) == want
    )


def test_greedy_leaves_the_global_rng(tiny_mm, images, prompts):
    """As transformers' greedy generate, a greedy / beam call draws nothing from torch's global RNG: a sampled call
    after it repeats the one made right after torch.manual_seed."""
    ims, ps = images[:1], prompts[:1]
    torch.manual_seed(0)
    want = _ids(tiny_mm.generate(ims, ps, max_new_tokens=4, do_sample=True))
    torch.manual_seed(0)
    tiny_mm.generate(ims, ps, max_new_tokens=2)
    tiny_mm.generate(ims, ps, max_new_tokens=2, num_beams=2)
    assert _ids(tiny_mm.generate(ims, ps, max_new_tokens=4, do_sample=True)) == want


def test_keywords_refused_with_a_decoder_of_its_own(tiny_mm, images, prompts):
    with mmfast.apply(tiny_mm, {"decoding": "vcd"}) as s:
        with pytest.raises(InputError, match="recipe decodes with 'vcd'.*decoding="):
            s.generate(images[:1], prompts[:1], max_new_tokens=2, do_sample=True)
        # replacing it for one call is explicit
        assert s.generate(images[:1], prompts[:1], max_new_tokens=2, decoding="greedy")


# -- per-call decoders -----------------------------------------------------------------------------
def test_per_call_decoder(tiny_mm, images, prompts):
    ims, ps = images[:2], prompts[:2]
    vcd = {"method": "vcd", "params": {"alpha": 0.5}}
    want = _ids(tiny_mm.generate(ims, ps, {"decoding": vcd}, max_new_tokens=N, seed=3))  # VCD samples: seeded
    with mmfast.apply(tiny_mm) as s:
        greedy = _ids(s.generate(ims, ps, max_new_tokens=N))
        assert _ids(s.generate(ims, ps, max_new_tokens=N, decoding=vcd, seed=3)) == want
        assert _ids(s.generate(ims, ps, max_new_tokens=N)) == greedy  # the recipe's decoder again
        assert _ids(s.generate(ims, ps, max_new_tokens=N, decoding="greedy")) == greedy
        with pytest.raises(IncompatibleRecipeError, match="installs hooks.*MMModel.generate"):
            s.generate(ims, ps, max_new_tokens=N, decoding="opera")
    # MMModel.generate opens a session per call, so hook-installing decoders work there
    opera = {"method": "opera", "params": {"num_beams": 2}}
    assert _ids(tiny_mm.generate(ims[:1], ps[:1], max_new_tokens=3, decoding=opera)) == _ids(
        tiny_mm.generate(ims[:1], ps[:1], {"decoding": opera}, max_new_tokens=3)
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"decoding": "greedy", "num_beams": 3},
        {"decoding": {"method": "sample", "params": {"temperature": 0.3}}, "do_sample": False},
        {"decoding": "beam", "generation_config": GenerationConfig(do_sample=True, max_new_tokens=2)},
    ],
)
def test_mm_generate_decoding_with_search_keywords_refused(tiny_mm, images, prompts, kwargs):
    """MMModel.generate folds decoding= into the recipe; search keywords beside it would silently replace it."""
    with pytest.raises(InputError, match="either decoding= or sampling keywords"):
        tiny_mm.generate(images[:1], prompts[:1], max_new_tokens=2, **kwargs)
    tiny_mm.generate(images[:1], prompts[:1], decoding="beam", generation_config=GenerationConfig(max_new_tokens=2))


def test_per_call_decoder_checked_against_the_recipe(tiny_mm, images, prompts):
    with mmfast.apply(tiny_mm, {"speculative": {"method": "prompt_lookup"}}) as s:
        with pytest.raises(IncompatibleRecipeError, match="speculative"):
            s.generate(images[:1], prompts[:1], max_new_tokens=2, num_beams=2)


# -- streaming -------------------------------------------------------------------------------------
class _Collect:
    def __init__(self) -> None:
        self.values: list[list] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        assert self.ended == 0
        self.values.append(value.tolist())

    def end(self) -> None:
        self.ended += 1


def _streamed_rows(st: _Collect, batch: int) -> list[list[int]]:
    steps = st.values[1:]  # the first put is the prompt, as in transformers
    return [[step[b] for step in steps] for b in range(batch)]


@pytest.mark.parametrize("decoding", ["greedy", "sample", "vcd", "m3id", "lqcd", "ritual", "damro", "vhr"])
def test_streamer_gets_every_token(tiny_mm, images, prompts, decoding):
    st = _Collect()
    res = tiny_mm.generate(images[:2], prompts[:2], max_new_tokens=N, decoding=decoding, streamer=st)
    assert st.ended == 1
    prompt = torch.tensor(st.values[0])
    assert prompt.shape[0] == 2 and tiny_mm.adapter.image_token_id in prompt[0].tolist()
    rows = _streamed_rows(st, 2)
    eos = set(tiny_mm.eos_token_ids)
    for row, r in zip(rows, res):
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        assert row[:cut] == r.token_ids


def test_text_streamer(tiny_mm, images, prompts, capsys):
    streamer = TextStreamer(tiny_mm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    res = tiny_mm.generate(images[:1], prompts[:1], max_new_tokens=8, streamer=streamer)
    assert capsys.readouterr().out.strip() == res[0].text


def test_streamer_refusals(tiny_mm, images, prompts):
    with pytest.raises(IncompatibleRecipeError, match="'beam'.*cannot stream"):
        tiny_mm.generate(images[:1], prompts[:1], max_new_tokens=2, num_beams=2, streamer=_Collect())
    with pytest.raises(IncompatibleRecipeError, match="speculative decoding.*does not stream"):
        tiny_mm.generate(
            images[:1], prompts[:1], {"speculative": {"method": "prompt_lookup"}}, max_new_tokens=2, streamer=_Collect()
        )
    with pytest.raises(InputError, match="without put"):
        tiny_mm.generate(images[:1], prompts[:1], max_new_tokens=2, streamer=object())


# -- transformers' generate inside a session -------------------------------------------------------
def test_hf_generate_inside_a_session_warns_once(tiny_mm, images, prompts, caplog):
    batch = tiny_mm.prepare(images[:1], prompts[:1])
    inputs = tiny_mm.processor(images=images[0], text=batch.texts[0], return_tensors="pt")
    before = tiny_mm.model.generate(**inputs, do_sample=False, max_new_tokens=4)
    with caplog.at_level(logging.WARNING, logger="mmfast.pipeline"):
        with mmfast.apply(tiny_mm) as s:  # nothing to run: no warning
            s.mm.model.generate(**inputs, do_sample=False, max_new_tokens=4)
        assert not caplog.records
        with mmfast.apply(tiny_mm, {"pruning": [{"method": "fastv", "params": {"keep": 5}}]}):
            inside = [tiny_mm.model.generate(**inputs, do_sample=False, max_new_tokens=4) for _ in range(2)]
    warnings = [r for r in caplog.records if "runs the unmodified model" in r.getMessage()]
    assert len(warnings) == 1 and "fastv" in warnings[0].getMessage()
    assert all(torch.equal(x, before) for x in inside)
    assert "generate" not in tiny_mm.model.__dict__  # the wrapper is gone after close()
