"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL through mmfast's runtime: exact against transformers (fp32,
tiny random models built from configs), M-RoPE positions kept through pruning, batching, beams and
speculative decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import mmfast
from mmfast.config import Recipe, load_recipe
from mmfast.hooks import count_hooks, last_row
from mmfast.pipeline import Session

FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"]
_CACHE: dict[str, object] = {}


@pytest.fixture(params=FAMILIES, scope="module")
def family_dir(request, tmp_path_factory):
    from mmfast.models.factory import random_qwen_vl, save_model

    model, processor = random_qwen_vl(request.param, seed=1)
    return save_model(model, processor, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qmm(family_dir):
    return mmfast.load(family_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def qimages() -> list[Image.Image]:
    """Mixed sizes: different dynamic-resolution grids (and token counts) per image."""
    rng = np.random.default_rng(0)
    sizes = [(40, 48), (64, 32), (40, 40), (24, 56)]
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


QPROMPTS = ["Describe the image.", "Is there a cat in the image?", "What color is the car? Tell me now please.",
            "How many dogs are there?"]


def _hf_inputs(mm, image, prompt):
    batch = mm.prepare([image], [prompt])
    return mm.processor(images=[image], text=[batch.texts[0]], return_tensors="pt")


def _hf_generate(mm, image, prompt, **kw):
    inputs = _hf_inputs(mm, image, prompt)
    out = mm.model.generate(**inputs, do_sample=False, **kw)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    return ids[: ids.index(2)] if 2 in ids else ids


def _prefill(mm, images, prompts, recipe=None):
    with Session(mm, recipe or Recipe()) as s:
        batch = mm.prepare(images, prompts)
        inputs = s.build_inputs(batch, s.encode(batch))
        state, out = s.runner.prefill(inputs)
    return inputs, state, out


def test_positions_and_prefill_logits_equal_transformers(qmm, qimages):
    for image in qimages[:2]:
        inputs, _, out = _prefill(qmm, [image], [QPROMPTS[0]])
        hf_in = _hf_inputs(qmm, image, QPROMPTS[0])
        assert torch.equal(inputs.input_ids, hf_in["input_ids"])
        pos, _ = qmm.model.model.get_rope_index(hf_in["input_ids"], hf_in["mm_token_type_ids"],
                                                image_grid_thw=hf_in["image_grid_thw"], attention_mask=hf_in["attention_mask"])
        assert torch.equal(inputs.position_ids.permute(2, 0, 1), pos)  # HF's get_rope_index, axis by axis
        with torch.no_grad():
            want = qmm.model(**hf_in, logits_to_keep=1).logits[:, -1].float()  # same lm_head GEMM shape
        assert torch.equal(out.logits[:, -1], want)  # bitwise, fp32


@pytest.mark.parametrize("i", [0, 1])
def test_greedy_equals_transformers_generate(qmm, qimages, i):
    ours = qmm.generate([qimages[i]], [QPROMPTS[i]], max_new_tokens=10)[0]
    assert ours.token_ids == _hf_generate(qmm, qimages[i], QPROMPTS[i], max_new_tokens=10)
    thw = qmm.prepare([qimages[i]], [QPROMPTS[i]]).image_sizes[0]
    assert ours.n_vision_tokens == int(thw.prod()) // 4


def test_batch_mixed_sizes_equals_single(qmm, qimages):
    batched = qmm.generate(qimages, QPROMPTS, max_new_tokens=8)
    single = [qmm.generate([im], [p], max_new_tokens=8)[0] for im, p in zip(qimages, QPROMPTS)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert len({r.n_vision_tokens for r in batched}) > 1


def test_beam_equals_transformers(qmm, qimages):
    recipe = {"decoding": {"method": "beam", "params": {"num_beams": 3}}}
    ours = qmm.generate([qimages[0]], [QPROMPTS[0]], recipe=recipe, max_new_tokens=8)[0]
    assert ours.token_ids == _hf_generate(qmm, qimages[0], QPROMPTS[0], max_new_tokens=8, num_beams=3)


@pytest.mark.parametrize("drafter", ["prompt_lookup", "layer_skip"])
def test_speculative_equals_greedy(qmm, qimages, drafter):
    greedy = qmm.generate(qimages[:2], QPROMPTS[:2], max_new_tokens=12)
    spec = qmm.generate(qimages[:2], QPROMPTS[:2], recipe={"speculative": {"method": drafter}}, max_new_tokens=12)
    assert [r.token_ids for r in spec] == [r.token_ids for r in greedy]


def test_session_restores_model(qmm, qimages):
    hf_in = _hf_inputs(qmm, qimages[0], QPROMPTS[0])
    with torch.no_grad():
        before = qmm.model(**hf_in).logits
    hooks = count_hooks(qmm.model)
    s = Session(qmm, load_recipe({"pruning": [{"method": "fastv", "params": {"k": 1, "ratio": 0.5}}]}))
    s.probe.watch("llm.1", qmm.adapter.layers[1].self_attn, rows=last_row)
    s.generate(qimages[:2], QPROMPTS[:2], max_new_tokens=3)
    s.close()
    assert count_hooks(qmm.model) == hooks
    with torch.no_grad():
        assert torch.equal(qmm.model(**hf_in).logits, before)


def test_noop_pruning_equals_baseline(qmm, qimages):
    base = qmm.generate(qimages[:2], QPROMPTS[:2], max_new_tokens=8)
    noop = qmm.generate(qimages[:2], QPROMPTS[:2], recipe={"pruning": [{"method": "fastv", "params": {"k": 2, "ratio": 0.0}}]},
                        max_new_tokens=8)
    assert [r.token_ids for r in noop] == [r.token_ids for r in base]


def test_in_llm_pruning_keeps_original_3d_positions(qmm, qimages):
    """FastV under M-RoPE: the kept slots carry their prefill (t, h, w) ids; decoding continues at
    max + 1 over the kept layout's valid positions (replicated on the 3 axes)."""
    recipe = load_recipe({"pruning": [{"method": "fastv", "params": {"k": 2, "ratio": 0.5}}]})
    inputs, state, _ = _prefill(qmm, qimages[:2], QPROMPTS[:2], recipe)
    assert len(state.groups) == 2
    g0, g1 = state.groups
    src = g1.source.clamp(min=0)
    want = inputs.position_ids.gather(1, src[:, :, None].expand(-1, -1, 3))
    assert torch.equal(g1.positions[g1.key_mask], want[g1.key_mask])
    assert int(g1.key_mask.sum()) < int(g0.key_mask.sum())
    nxt = g1.positions.amax(-1).masked_fill(~g1.key_mask, -1).max(1).values + 1
    assert torch.equal(g1.next_positions(), nxt)
    out = qmm.generate(qimages[:2], QPROMPTS[:2], recipe=recipe, max_new_tokens=4)
    assert out[0].vision_tokens_layer_avg < out[0].n_vision_tokens


def test_llm_probe_equals_eager(family_dir, qmm, qimages):
    eager = mmfast.load(family_dir, device="cpu", attn_implementation="eager")
    with Session(qmm, Recipe()) as s:
        batch = qmm.prepare(qimages[:2], QPROMPTS[:2])
        inputs = s.build_inputs(batch, s.encode(batch))
        rows = torch.tensor([inputs.length - 1, inputs.length - 5])
        s.probe.watch("llm.1", qmm.adapter.layers[1].self_attn, rows=lambda q, k: rows)
        kw = dict(inputs_embeds=inputs.embeds, attention_mask=inputs.attention_mask,
                  position_ids=qmm.adapter.lm_position_ids(inputs.position_ids))
        with torch.no_grad():
            qmm.adapter.language_model(**kw)
            want = eager.adapter.language_model(**kw, output_attentions=True).attentions[1][:, :, rows]
        got = s.probe["llm.1"].probs
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-4)
