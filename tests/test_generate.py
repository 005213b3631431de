"""Generation: batch > 1 equals batch 1, and mmfast's loops equal transformers' generate()."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import mmfast


@dataclass(frozen=True)
class Sample:
    """A bench sample: what the benches' timing functions read of one."""

    image: object
    prompt: str


def test_batch_equals_single(tiny_mm, images, prompts):
    batched = tiny_mm.generate(images, prompts, max_new_tokens=10)
    single = [tiny_mm.generate([im], [p], max_new_tokens=10)[0] for im, p in zip(images, prompts)]
    for b, s in zip(batched, single):
        assert b.token_ids == s.token_ids
        assert b.text == s.text
    assert len({len(tiny_mm.prepare([im], [p]).token_ids[0]) for im, p in zip(images, prompts)}) > 1  # padding used


def _hf_generate(mm, image, prompt, **kw):
    batch = mm.prepare([image], [prompt])
    inputs = mm.processor(images=image, text=batch.texts[0], return_tensors="pt")
    out = mm.model.generate(**inputs, do_sample=False, **kw)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    return [t for t in ids[: ids.index(2)] if True] if 2 in ids else ids


@pytest.mark.parametrize("i", [0, 2])
def test_greedy_matches_transformers(tiny_mm, images, prompts, i):
    ours = tiny_mm.generate([images[i]], [prompts[i]], max_new_tokens=12)[0]
    assert ours.token_ids == _hf_generate(tiny_mm, images[i], prompts[i], max_new_tokens=12)
    assert ours.n_vision_tokens == tiny_mm.adapter.n_image_tokens == 16


def test_beam_matches_transformers(tiny_mm, images, prompts):
    recipe = {"decoding": {"method": "beam", "params": {"num_beams": 3}}}
    for i in (0, 1):
        ours = tiny_mm.generate([images[i]], [prompts[i]], recipe=recipe, max_new_tokens=10)[0]
        assert ours.token_ids == _hf_generate(tiny_mm, images[i], prompts[i], max_new_tokens=10, num_beams=3)


def test_beam_kv_bytes_are_each_samples_own(tiny_mm, images, prompts, monkeypatch):
    """A sample whose beam search ends at the first step (its top candidates are stop tokens) while another sample's
    runs on: its KV bytes at the end are those of its own search, as decoded alone, not its rows' fed afterwards."""
    recipe = {"decoding": {"method": "beam", "params": {"num_beams": 2}}}
    with mmfast.apply(tiny_mm, recipe) as s:
        batch = tiny_mm.prepare(images[:1], prompts[:1])
        _, out = s.runner.prefill(s.build_inputs(batch, s.encode(batch)))
        top = out.logits[0, -1].topk(2).indices.tolist()  # sample 0's two best first tokens
    monkeypatch.setattr(tiny_mm, "eos_token_ids", [*tiny_mm.eos_token_ids, *top])
    with mmfast.apply(tiny_mm, recipe) as s:
        together = s.generate(images[:2], prompts[:2], max_new_tokens=6)
        alone = [s.generate(images[b : b + 1], prompts[b : b + 1], max_new_tokens=6)[0] for b in range(2)]
    assert together[0].token_ids == [] and len(together[1].token_ids) > 1  # the other sample decodes on
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.kv_bytes_end for r in together] == [r.kv_bytes_end for r in alone]


@pytest.mark.parametrize("method", ["dynamic_llava", "zipvl"])
def test_decode_time_statistics_of_a_finished_row_are_its_own(method, tiny_mm, images, prompts, monkeypatch):
    """A row that stops while the batch decodes on is fed padding; what a decode-time policy counts on it (Dynamic-
    LLaVA's generated and skipped tokens, ZipVL's bytes at the end) is not the sample's: its per-sample statistics
    are those it had when it stopped, as decoded alone."""
    from mmfast.registry import PRUNERS

    recipe = {"pruning": [{"method": method, "params": PRUNERS.get(method).cls.test_params(tiny_mm.adapter)}]}
    first = tiny_mm.generate(images[:1], prompts[:1], recipe=recipe, max_new_tokens=2)[0].token_ids
    monkeypatch.setattr(tiny_mm, "eos_token_ids", [*tiny_mm.eos_token_ids, first[1]])  # sample 0 stops at step 1
    with mmfast.apply(tiny_mm, recipe) as s:
        together = s.generate(images[:2], prompts[:2], max_new_tokens=6, seed=0)
        alone = [s.generate(images[b : b + 1], prompts[b : b + 1], max_new_tokens=6, seed=0)[0] for b in range(2)]
    assert len(together[0].token_ids) == 1 and len(together[1].token_ids) > 2
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids and a.stats[method] == b.stats[method]


def test_sampling_is_seeded(tiny_mm, images, prompts):
    recipe = {"decoding": {"method": "sample", "seed": 3}}
    a = tiny_mm.generate(images[:2], prompts[:2], recipe=recipe, max_new_tokens=8)
    b = tiny_mm.generate(images[:2], prompts[:2], recipe=recipe, max_new_tokens=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_result_accounting(tiny_mm, images, prompts):
    r = tiny_mm.generate([images[0]], [prompts[0]], max_new_tokens=5)[0]
    cfg = tiny_mm.model.config.text_config
    n_prompt = len(tiny_mm.prepare([images[0]], [prompts[0]]).token_ids[0]) - 1 + 16
    slot = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert r.kv_bytes_prefill == n_prompt * slot * cfg.num_hidden_layers
    assert r.vision_tokens_layer_avg == 16
    assert r.timings.prefill_s > 0 and r.timings.vision_s > 0


def test_decoding_bench_cost_per_token_counts_the_stop_tokens_step(tiny_mm, images, prompts, monkeypatch):
    """The decoding bench's cost per token divides the decode time by the forwards after the first token: an
    answer that ends on a stop token decoded that token too (stripped from token_ids), so n forwards for n kept
    tokens, not n - 1. Timed on a clock that advances one second per decode forward."""
    from mmfast.bench.common import Variant
    from mmfast.bench.decoding import cost_per_token
    from mmfast.config import load_recipe
    from mmfast.decoding import loop
    from mmfast.runtime import LMRunner

    clock = [0.0]
    step = LMRunner.step

    def counted(self, *args, **kwargs):
        clock[0] += 1.0
        return step(self, *args, **kwargs)

    answer = tiny_mm.generate([images[0]], [prompts[0]], max_new_tokens=8)[0].token_ids
    monkeypatch.setattr(LMRunner, "step", counted)
    monkeypatch.setattr(loop, "now", lambda device: clock[0])
    monkeypatch.setattr(tiny_mm, "eos_token_ids", [*tiny_mm.eos_token_ids, answer[3]])  # 3 tokens, then a stop
    cost = cost_per_token(tiny_mm, Variant("greedy", load_recipe({})), [Sample(images[0], prompts[0])], 8, 1)
    assert cost["decode_s_per_token"] == 1.0


def test_decoding_bench_cost_per_token_honours_bench_warmup(tiny_mm, images, prompts, monkeypatch):
    """``bench.warmup`` untimed runs before the timed ones: the decoding bench ran one warm-up whatever it said
    (``warmup: 0`` and ``warmup: 3`` timed as ``warmup: 1``)."""
    from mmfast.bench.common import Variant
    from mmfast.bench.decoding import cost_per_token
    from mmfast.config import load_recipe
    from mmfast.pipeline import Session

    calls = []
    run = Session.run
    monkeypatch.setattr(Session, "run", lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    samples = [Sample(images[0], prompts[0])]
    for warmup in (0, 3):
        calls.clear()
        cost_per_token(tiny_mm, Variant("greedy", load_recipe({})), samples, 4, 2, warmup=warmup)
        assert len(calls) == warmup + 2  # warm-ups, then 2 repeats x 1 sample


def test_decoding_bench_cost_per_token_is_the_median(tiny_mm, images, prompts, monkeypatch):
    """The cost per token is the median of the timed runs' per-token times: of two runs at 1 s and 3 s per decode
    forward it is 2 s, not the upper one (``values[len // 2]`` read 3 s)."""
    from mmfast.bench.common import Variant
    from mmfast.bench.decoding import cost_per_token
    from mmfast.config import load_recipe
    from mmfast.decoding import loop
    from mmfast.pipeline import Session
    from mmfast.runtime import LMRunner

    clock, per_step, runs = [0.0], [1.0], [0]
    step, run = LMRunner.step, Session.run

    def counted(self, *args, **kwargs):
        clock[0] += per_step[0]
        return step(self, *args, **kwargs)

    def timed_run(self, *args, **kwargs):
        per_step[0] = 1.0 + 2.0 * runs[0]  # 1 s per forward in the first run, 3 s in the second
        runs[0] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(LMRunner, "step", counted)
    monkeypatch.setattr(Session, "run", timed_run)
    monkeypatch.setattr(loop, "now", lambda device: clock[0])
    cost = cost_per_token(tiny_mm, Variant("greedy", load_recipe({})), [Sample(images[0], prompts[0])], 6, 2, warmup=0)
    assert cost["decode_s_per_token"] == pytest.approx(2.0)


def test_multi_image_prompt(tiny_mm, images):
    r = tiny_mm.generate([[images[0], images[1]]], ["Compare the two frames."], max_new_tokens=4)[0]
    assert r.n_vision_tokens == 32


def test_bad_image_path(tiny_mm, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(mmfast.InputError, match="cannot be read"):
        tiny_mm.generate([bad], ["Describe."])
    with pytest.raises(mmfast.InputError, match="not found"):
        tiny_mm.generate([tmp_path / "missing.png"], ["Describe."])


def test_load_errors(tmp_path, monkeypatch):
    with pytest.raises(mmfast.ModelLoadError, match="no config.json"):
        mmfast.load(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(mmfast.ModelLoadError, match="HF_HUB_OFFLINE"):
        mmfast.load("nobody/not-a-cached-model")


def test_unsupported_family_rejected(tmp_path):
    from transformers import PaliGemmaConfig

    PaliGemmaConfig().save_pretrained(tmp_path)
    with pytest.raises(mmfast.ModelLoadError, match="paligemma"):
        mmfast.load(tmp_path)


def test_eager_model_same_tokens(tiny_dir, tiny_mm, images, prompts):
    eager = mmfast.load(tiny_dir, device="cpu", attn_implementation="eager")
    a = eager.generate(images[:2], prompts[:2], max_new_tokens=8)
    b = tiny_mm.generate(images[:2], prompts[:2], max_new_tokens=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert torch.equal(eager.model.lm_head.weight, tiny_mm.model.lm_head.weight)


def test_load_model_with_device_map(tiny_dir, tiny_mm, images, prompts):
    """Big-model placement options pass through from the recipe (device_map, max_memory)."""
    from mmfast.config import load_recipe
    from mmfast.model import load_model

    cfg = load_recipe({"model": {"name": str(tiny_dir), "device_map": "auto", "max_memory": {"cpu": "2GiB"}}}).model
    mm = load_model(cfg)
    assert mm.device.type == "cpu"  # placed by from_pretrained, not moved by mmfast
    a = mm.generate(images[:1], prompts[:1], max_new_tokens=5)
    b = tiny_mm.generate(images[:1], prompts[:1], max_new_tokens=5)
    assert a[0].token_ids == b[0].token_ids
