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


QPROMPTS = [
    "Describe the image.",
    "Is there a cat in the image?",
    "What color is the car? Tell me now please.",
    "How many dogs are there?",
]


def _hf_inputs(mm, image, prompt):
    batch = mm.prepare([image], [prompt])
    return mm.processor(images=[image], text=[batch.texts[0]], return_tensors="pt")


def _hf_generate(mm, image, prompt, **kw):
    inputs = _hf_inputs(mm, image, prompt)
    out = mm.model.generate(**inputs, do_sample=False, **kw)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
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
        pos, _ = qmm.model.model.get_rope_index(
            hf_in["input_ids"],
            hf_in["mm_token_type_ids"],
            image_grid_thw=hf_in["image_grid_thw"],
            attention_mask=hf_in["attention_mask"],
        )
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
    s = Session(qmm, load_recipe({"pruning": [{"method": "fastv", "params": {"k": 1, "drop_ratio": 0.5}}]}))
    s.probe.watch("llm.1", qmm.adapter.layers[1].self_attn, rows=last_row)
    s.generate(qimages[:2], QPROMPTS[:2], max_new_tokens=3)
    s.close()
    assert count_hooks(qmm.model) == hooks
    with torch.no_grad():
        assert torch.equal(qmm.model(**hf_in).logits, before)


@pytest.mark.parametrize("pruner", ["fastv", "random", "zipvl"])
def test_noop_pruning_equals_baseline(qmm, qimages, pruner):
    from mmfast.capabilities import caps_of, unmet_need
    from mmfast.registry import PRUNERS

    cls = PRUNERS.get(pruner).cls
    assert unmet_need(caps_of(cls, None), qmm.adapter.features) is None
    base = qmm.generate(qimages[:2], QPROMPTS[:2], max_new_tokens=8)
    noop = qmm.generate(
        qimages[:2],
        QPROMPTS[:2],
        recipe={"pruning": [{"method": pruner, "params": cls.noop_params(qmm.adapter)}]},
        max_new_tokens=8,
    )
    assert [r.token_ids for r in noop] == [r.token_ids for r in base]


def test_in_llm_pruning_keeps_original_3d_positions(qmm, qimages):
    """FastV under M-RoPE: the kept slots carry their prefill (t, h, w) ids; decoding continues at
    max + 1 over the kept layout's valid positions (replicated on the 3 axes)."""
    recipe = load_recipe({"pruning": [{"method": "fastv", "params": {"k": 2, "drop_ratio": 0.5}}]})
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
        kw = dict(
            inputs_embeds=inputs.embeds,
            attention_mask=inputs.attention_mask,
            position_ids=qmm.adapter.lm_position_ids(inputs.position_ids),
        )
        with torch.no_grad():
            qmm.adapter.language_model(**kw)
            want = eager.adapter.language_model(**kw, output_attentions=True).attentions[1][:, :, rows]
        got = s.probe["llm.1"].probs
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-4)


def test_pre_llm_pruning_keeps_grid_positions(qmm, qimages):
    """Random drop before the LLM: each kept token has its grid cell's unpruned (t, h, w) ids and the
    text after the image keeps its unpruned position."""
    base, _, _ = _prefill(qmm, qimages[:2], QPROMPTS[:2])
    pruned, _, _ = _prefill(
        qmm, qimages[:2], QPROMPTS[:2], load_recipe({"pruning": [{"method": "random", "params": {"fraction": 0.4}}]})
    )
    for b in range(2):
        vb, vp = base.image_mask[b], pruned.image_mask[b]
        assert int(vp.sum()) == round(0.4 * int(vb.sum()))
        by_patch = dict(zip(base.patch_ids[b][vb].tolist(), base.position_ids[b][vb].tolist()))
        assert [by_patch[p] for p in pruned.patch_ids[b][vp].tolist()] == pruned.position_ids[b][vp].tolist()
        n_after = int(base.text_after_image[b].sum())
        assert torch.equal(pruned.position_ids[b, -n_after:], base.position_ids[b, -n_after:])


def test_budget_is_mapped_on_each_images_own_count_under_dynamic_resolution(qmm):
    """Under dynamic resolution a budget is a count per image, mapped on the image's own N (not on 576)."""
    from mmfast.pruning.fastv import FastV
    from mmfast.pruning.random_drop import RandomDrop

    cfg = FastV.Config(k=1)
    L = len(qmm.adapter.layers)
    for n in (300, 999):
        assert FastV.budget_params(300, n, qmm.adapter, cfg, "b") == {"keep": round((L * 300 - n) / (L - 1))}
    assert RandomDrop.budget_params(128, 999, qmm.adapter, RandomDrop.Config(), "b") == {"keep": 128}


def test_mrope_rules():
    from mmfast.models.mrope import compact_positions, grid_offsets, sample_positions

    offs = grid_offsets(torch.tensor([-1, 5, -1, 7]), (1, 3, 4))
    assert offs.tolist() == [[0, 0, 0], [0, 1, 1], [0, 1, 1], [0, 1, 3]]  # synthetic: previous real token
    pos = sample_positions([("text", 2), ("image", torch.arange(6), (1, 2, 3)), ("text", 2)], torch.device("cpu"))
    assert pos[:, 1].tolist()[2:8] == [2, 2, 2, 3, 3, 3] and pos[8].tolist() == [5, 5, 5]  # s + max(h, w)
    image_index = torch.tensor([[-1, -1, 0, 0, 0, 0, 0, 0, -1, -1]])
    full = torch.ones(1, 10, dtype=torch.bool)
    assert torch.equal(compact_positions(pos[None], image_index, full)[0], pos)  # nothing dropped: unchanged
    keep = full.clone()
    keep[0, [2, 3, 4]] = False  # the image's first row
    got = compact_positions(pos[None], image_index, keep)[0]
    assert got[5:8].tolist() == [[2, 2, 2], [2, 2, 3], [2, 2, 4]] and got[8].tolist() == [5, 5, 5]


def test_qwen3_deepstack_follows_pruned_tokens(family_dir, qmm, qimages):
    """Qwen3-VL: pruning at layer 1 (between the two deepstack levels) adds level 1 to the kept
    vision slots only, with their own rows: checked against a layer-by-layer computation."""
    if qmm.adapter.family != "qwen3_vl":
        pytest.skip("deepstack is Qwen3-VL's")
    from mmfast.models.qwen2_vl import DEEPSTACK

    drop = lambda view: ~(view.vision & (torch.arange(view.vision.shape[1]) % 3 == 0))  # noqa: E731
    with Session(qmm, Recipe()) as s:
        batch = qmm.prepare(qimages[:1], QPROMPTS[:1])
        inputs = s.build_inputs(batch, s.encode(batch))
        s.runner.prune_at(1, drop)
        state, out = s.runner.prefill(inputs)
    assert len(state.groups) == 2
    lm = qmm.adapter.language_model
    deep = inputs.tags[DEEPSTACK][0]  # [L, levels, d]
    vis = inputs.image_mask[0]

    def run(layer, h, pos):
        n = h.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        pe = lm.rotary_emb(h, position_ids=pos.permute(2, 0, 1))
        return lm.layers[layer](h, attention_mask=mask, position_embeddings=pe)

    with torch.no_grad():
        h = run(0, inputs.embeds, inputs.position_ids)
        h[0, vis] += deep[vis, 0]
        kept = (~(vis & (torch.arange(inputs.length) % 3 == 0))).nonzero().squeeze(1)
        h, pos = h[:, kept], inputs.position_ids[:, kept]
        for layer in range(1, len(lm.layers)):
            h = run(layer, h, pos)
            if layer == 1:
                h[0, vis[kept]] += deep[kept][vis[kept], 1]
        want = qmm.adapter.lm_head(lm.norm(h)[:, -1:]).float()
    torch.testing.assert_close(out.logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "recipe",
    [
        {"decoding": {"method": "vcd"}},
        {"pruning": [{"method": "random", "params": {"fraction": 0.5}}]},
        {
            "pruning": [{"method": "fastv", "params": {"k": 1, "drop_ratio": 0.5}}],
            "speculative": {"method": "prompt_lookup"},
        },
    ],
    ids=["vcd", "random", "fastv+prompt_lookup"],
)
def test_methods_batch_equals_single_with_mixed_sizes(qmm, qimages, recipe):
    """Per-image decisions (noise, random subsets, top-k) do not depend on the batch an image is in,
    although batch pixels are padded to the largest image's patches."""
    batched = qmm.generate(
        qimages[:3], QPROMPTS[:3], recipe=recipe, max_new_tokens=6, seed=0
    )  # VCD samples: one stream
    single = [
        qmm.generate([im], [p], recipe=recipe, max_new_tokens=6, seed=0)[0] for im, p in zip(qimages[:3], QPROMPTS[:3])
    ]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]


def test_compact_group_under_mrope(qmm, qimages):
    """A compact pruning group (positions renumbered) under M-RoPE: the layout of
    ``compact_positions`` on the kept slots, and decoding continues after its maximum."""
    from mmfast.models.mrope import compact_positions

    drop = lambda view: ~(view.vision & (torch.arange(view.vision.shape[1]) % 2 == 0))  # noqa: E731
    with Session(qmm, Recipe()) as s:
        batch = qmm.prepare(qimages[:2], QPROMPTS[:2])
        inputs = s.build_inputs(batch, s.encode(batch))
        s.runner.prune_at(2, drop, compact=True)
        state, _ = s.runner.prefill(inputs)
        g1 = state.groups[1]
        src = g1.source.clamp(min=0)
        orig = inputs.position_ids.gather(1, src[:, :, None].expand(-1, -1, 3))
        image_index = inputs.image_index.gather(1, src).masked_fill(g1.source < 0, -1)
        want = compact_positions(orig, image_index, g1.key_mask)
        assert torch.equal(g1.positions[g1.key_mask], want[g1.key_mask])
        assert int(g1.key_mask.sum()) < int(state.groups[0].key_mask.sum())
        s.runner.step(state, torch.tensor([[7], [7]]))
        assert torch.equal(
            g1.positions[:, -1],
            (want.masked_fill(~g1.key_mask[:, :-1, None], -1).amax((1, 2)) + 1)[:, None].expand(-1, 3),
        )


def test_image_only_processor_refuses_videos_and_miscounted_placeholders():
    """mmfast's Qwen-VL processor for installs without torchvision takes no video: a ``videos=`` it ignored
    left the ``<|video_pad|>`` slot as text, and the model answered without the video; a text whose image
    placeholders do not match the images is refused by name (it raised a bare StopIteration); images without
    text give their pixels, as transformers' processor does."""
    from mmfast.errors import InputError
    from mmfast.models.factory import random_qwen_vl
    from mmfast.models.qwen_processor import QwenVLImageProcessor

    _, proc = random_qwen_vl("qwen2_vl", seed=1)
    proc = QwenVLImageProcessor(proc.image_processor, proc.tokenizer, proc.chat_template)
    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 48, 3), dtype=np.uint8))
    with pytest.raises(InputError, match="takes images only"):
        proc(text=["<|vision_start|><|video_pad|><|vision_end|>Describe."], videos=[[im, im]])
    for text in ("<|image_pad|> and <|image_pad|>", "no placeholder"):
        with pytest.raises(InputError, match="1 image"):
            proc(images=[im], text=[text])
    out = proc(images=[im], text=["<|vision_start|><|image_pad|><|vision_end|>Describe."])
    assert int(out["mm_token_type_ids"].sum()) == int(out["image_grid_thw"].prod()) // 4
    alone = proc(images=[im])  # no text: the pixels and grids only (it raised an IndexError)
    assert sorted(alone) == ["image_grid_thw", "pixel_values"]
    assert torch.equal(alone["pixel_values"], out["pixel_values"])
