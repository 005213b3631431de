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
