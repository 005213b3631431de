"""The attention probe equals eager attention weights, under sdpa, for LLM and vision layers."""

from __future__ import annotations

import pytest
import torch

import mmfast
from mmfast.config import Recipe
from mmfast.hooks import last_row
from mmfast.hooks.attention import all_rows
from mmfast.pipeline import Session


def _eager_attentions(model_dir, inputs):
    eager = mmfast.load(model_dir, device="cpu", attn_implementation="eager")
    with torch.no_grad():
        out = eager.adapter.language_model(
            inputs_embeds=inputs.embeds,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            output_attentions=True,
        )
    return out.attentions  # n_layers x [B, H, L, L]


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_gqa_dir"])
def test_llm_probe_equals_eager(request, fixture, images, prompts):
    model_dir = request.getfixturevalue(fixture)
    mm = mmfast.load(model_dir, device="cpu")  # sdpa
    with Session(mm, Recipe()) as s:
        batch = mm.prepare(images[:3], prompts[:3])
        inputs = s.build_inputs(batch, s.encode(batch))
        length = inputs.length
        rows = torch.tensor([length - 1, length - 3, 5])
        for layer in (0, 2):
            s.probe.watch(f"llm.{layer}", mm.adapter.layers[layer].self_attn, rows=lambda q, k: rows)
        with torch.no_grad():
            mm.adapter.language_model(
                inputs_embeds=inputs.embeds, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids
            )
        eager = _eager_attentions(model_dir, inputs)
        valid = inputs.attention_mask.bool()
        for layer in (0, 2):
            got = s.probe[f"llm.{layer}"].probs  # [B, H, R, L]
            want = eager[layer][:, :, rows]  # [B, H, R, L]
            for b in range(3):
                for r_i, r in enumerate(rows.tolist()):
                    if valid[b, r]:  # padded query rows are undefined in both
                        torch.testing.assert_close(got[b, :, r_i], want[b, :, r_i].float(), atol=1e-5, rtol=1e-4)


def test_vision_probe_equals_eager(tiny_dir, images, prompts):
    mm = mmfast.load(tiny_dir, device="cpu")
    eager = mmfast.load(tiny_dir, device="cpu", attn_implementation="eager")
    pixel_values = mm.prepare(images[:2], prompts[:2]).pixel_values
    with torch.no_grad():
        want = eager.adapter.vision_tower(pixel_values, output_attentions=True).attentions
    with Session(mm, Recipe()) as s:
        s.probe.watch("vis.cls", mm.adapter.vision_layers[1].self_attn, rows=lambda q, k: torch.tensor([0, 3]))
        with torch.no_grad():
            mm.adapter.vision_tower(pixel_values)
        got = s.probe["vis.cls"].probs
    torch.testing.assert_close(got, want[1][:, :, [0, 3]].float(), atol=1e-5, rtol=1e-4)


def test_probe_decode_rows_and_reduction(tiny_mm, images, prompts):
    with Session(tiny_mm, Recipe()) as s:
        s.probe.watch("last", tiny_mm.adapter.layers[-1].self_attn, rows=last_row, reduce="max")
        s.generate(images[:2], prompts[:2], max_new_tokens=3)
        rec = s.probe["last"]
    assert rec.probs.shape[:2] == (2, 1) and rec.q_len == 1  # last decode step, max over heads
    assert torch.all(rec.probs >= 0) and torch.all(rec.probs <= 1)


def test_a_decode_replayable_probe_needs_shape_only_rows_in_every_forward(tiny_mm):
    """A probe that a captured decode step replays carries its record out of the step (``Carried(decode=True)``);
    rows picked by Python at each forward, or a probe that skips decode steps, cannot be one."""
    attn = tiny_mm.adapter.layers[-1].self_attn
    with Session(tiny_mm, Recipe()) as s:
        s.probe.watch("rows", attn, rows=all_rows, decode_replayable=True)
        assert s.runner.capture_blocker() is None
        with pytest.raises(ValueError, match="shape-only rows"):
            s.probe.watch("python", attn, rows=lambda q, k: torch.tensor([0]), decode_replayable=True)
        with pytest.raises(ValueError, match="every forward"):
            s.probe.watch("prefill", attn, rows=last_row, prefill_only=True, decode_replayable=True)
        s.probe.watch("plain", attn, rows=all_rows)  # records in decode steps, nothing carried: blocks the capture
        assert "attention probes" in s.runner.capture_blocker()


def test_probe_under_eager_model(tiny_dir, images, prompts):
    """The probe wraps eager attention too (vision tower and LLM), with the same tokens as sdpa."""
    eager = mmfast.load(tiny_dir, device="cpu", attn_implementation="eager")
    sdpa = mmfast.load(tiny_dir, device="cpu")
    recipe = mmfast.load_recipe({"pruning": [{"method": "fastv", "params": {"keep": 5}}]})
    with Session(eager, recipe) as s:
        s.probe.watch("vis", eager.adapter.vision_layers[0].self_attn, rows=lambda q, k: torch.tensor([0]))
        a = s.generate(images[:2], prompts[:2], max_new_tokens=6)
    with Session(sdpa, recipe) as s:
        b = s.generate(images[:2], prompts[:2], max_new_tokens=6)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_probe_on_a_qwen_vision_block_is_refused(family, images, prompts):
    """A Qwen-VL vision block calls attention once per image (or window), B = 1 each: a probe's record was the last
    call's alone ([1, H, R, K] of the last image or window of the batch), silently. Refused, naming the recorder
    that sees every chunk; nothing is installed."""
    from mmfast.errors import InputError
    from mmfast.hooks.attention import cls_row
    from mmfast.models.factory import random_qwen_vl

    mm = mmfast.load(*random_qwen_vl(family, seed=1))
    attn = mm.adapter.vision_layers[0].attn
    with Session(mm, Recipe()) as s:
        with pytest.raises(InputError, match="once per image or window"):
            s.probe.watch("vis", attn, rows=cls_row)
        assert "_mmfast_attn" not in attn.__dict__
        s.probe.watch("llm", mm.adapter.layers[0].self_attn, rows=last_row)  # its LLM layers are probed as before


def test_a_row_past_the_forwards_queries_names_the_probe(tiny_mm, images, prompts):
    """Rows chosen for the whole prompt, asked of a layer after an in-LLM pruner shortened the sequence, lie past the
    forward's query rows: refused naming the probe and the row (was torch's index error inside the probe, a
    device-side assert on CUDA)."""
    from mmfast.config import load_recipe
    from mmfast.errors import InputError

    fastv = load_recipe({"pruning": [{"method": "fastv", "params": {"k": 1, "keep": 3}}]})
    with Session(tiny_mm, fastv) as s:
        batch = tiny_mm.prepare(images[:2], prompts[:2])
        full = s.build_inputs(batch, s.encode(batch)).length
        rows = torch.tensor([full - 1])  # the last prompt row of layer 0's sequence
        s.probe.watch("after", tiny_mm.adapter.layers[2].self_attn, rows=lambda q, k: rows, when=lambda q, k: q > 1)
        with pytest.raises(InputError, match=rf"probe 'after': row {full - 1} asked of a forward with \d+ query rows"):
            s.generate(images[:2], prompts[:2], max_new_tokens=2)
