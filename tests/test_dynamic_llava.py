"""Dynamic-LLaVA: predictor architectures, the prefill / decode / no-cache rules, checkpoint loading
(ours and the released key names) and the training step."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmfast.config import load_recipe
from mmfast.errors import ConfigError, ModelLoadError
from mmfast.hooks import count_hooks
from mmfast.pipeline import Session
from mmfast.pruning._dynamic_llava_modules import (
    Predictors,
    PredictorSpec,
    load_predictors,
    random_predictors,
    released_to_ours,
    save_predictors,
)

K = 2


def _recipe(**params):
    return load_recipe({"pruning": [{"method": "dynamic_llava", "params": params}]})


def _inputs(session, images, prompts):
    batch = session.mm.prepare(images, prompts)
    return session.build_inputs(batch, session.encode(batch))


def _predictor_dir(tmp_path, hidden, text_bias=None, name="pred"):
    """Random predictors saved as a trained directory; ``text_bias`` = (keep, drop) forces the text rule."""
    p = random_predictors(hidden)
    if text_bias is not None:
        with torch.no_grad():
            p.text.fc4.weight.zero_()
            p.text.fc4.bias.copy_(torch.tensor(text_bias, dtype=torch.float32))
    return save_predictors(p, tmp_path / name, {"sparse_layer": K}), p


class _RowText(nn.Module):
    """A text predictor that keeps on rows in ``keep_rows`` and drops elsewhere."""

    def __init__(self, keep_rows):
        super().__init__()
        self.keep_rows = keep_rows

    def forward(self, x):
        keep = torch.zeros(x.shape[:-1], dtype=torch.bool)
        keep[list(self.keep_rows)] = True
        return torch.stack([keep.float(), (~keep).float()], -1)


# ------------------------------------------------------------------------------------ predictors


def test_predictor_shapes_and_sizes():
    assert PredictorSpec.scaled(4096) == PredictorSpec(4096, 512, 8, 2048, 2)  # the released 7B sizes
    assert PredictorSpec.scaled(256) == PredictorSpec(256, 32, 1, 128, 2)  # the embedded world model
    torch.manual_seed(0)
    p = Predictors(PredictorSpec(64, 32, 2, 64, 2)).init_weights()
    x = torch.randn(2, 7, 64)
    valid = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    out = p.image(x, valid)
    assert out.shape == (2, 7, 2) and p.text(x).shape == (2, 7, 2)
    # padding is invisible to the valid tokens (masked attention and masked global mean)
    torch.testing.assert_close(out[1, :4], p.image(x[1:, :4])[0], atol=1e-6, rtol=1e-5)
    assert len(p.image.blocks) == 2 and p.image.blocks[0].qkv.bias is None
    assert [m.out_features for m in (p.image.head1, p.image.head2, p.image.head3)] == [16, 8, 2]
    assert [m.out_features for m in (p.text.fc1, p.text.fc2, p.text.fc3, p.text.fc4)] == [32, 16, 8, 2]


# ------------------------------------------------------------------------------------ prefill rule


def test_prefill_keeps_topk_image_tokens_with_original_positions(tiny_mm, images, prompts):
    rate = 0.25
    with Session(tiny_mm, _recipe(predictors="random", vision_keep_rate=rate, text_keep="always")) as s:
        inputs = _inputs(s, images[:2], [prompts[0], prompts[2]])  # different lengths: left padding
        state, _ = s.runner.prefill(inputs)
        pred = s.pruners[0].predictors
    with torch.no_grad():
        hs = tiny_mm.adapter.language_model(
            inputs_embeds=inputs.embeds,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            output_hidden_states=True,
        ).hidden_states[K]
    assert [g.start for g in state.groups] == [0, K]
    grp = state.groups[1]
    for b in range(2):
        img = inputs.image_mask[b].nonzero().squeeze(1)
        k = int(len(img) * rate)
        score = F.log_softmax(pred.image(hs[b : b + 1, img]), -1)[0, :, 0]
        want = img[score.topk(k).indices].sort().values
        src = grp.source[b][grp.key_mask[b]]
        got = src[inputs.image_mask[b, src]]
        assert torch.equal(got, want)  # exactly k image tokens: the predictor's top-k, in original order
        pos = grp.positions[b][grp.key_mask[b]]
        assert torch.equal(pos, inputs.position_ids[b, src])  # original position ids
        text = inputs.attention_mask[b].bool() & ~inputs.image_mask[b]
        assert int((~inputs.image_mask[b, src]).sum()) == int(text.sum())  # every text token kept


# ------------------------------------------------------------------------------------ decode with cache


def test_decode_skips_kv_appends_in_layers_from_k(tiny_mm, images, prompts, tmp_path):
    d = tiny_mm.adapter.text_config.hidden_size
    path, _ = _predictor_dir(tmp_path, d, text_bias=(0.0, 1.0))  # the text predictor always says "drop"
    n_steps = 4
    with Session(tiny_mm, _recipe(predictors=str(path))) as s:
        inputs = _inputs(s, images[:2], prompts[:2])
        state, out = s.runner.prefill(inputs)
        lens0 = [state.cache.layers[i].keys.shape[2] for i in range(4)]
        bytes0 = state.kv_bytes_per_sample()
        for _ in range(n_steps):
            out = s.runner.step(state, out.logits[:, -1].argmax(-1)[:, None])
        lens = [state.cache.layers[i].keys.shape[2] for i in range(4)]
        stats = state.stats_rows(2)["dynamic_llava"]
    assert lens[:K] == [n + n_steps for n in lens0[:K]]  # layers < K always append
    assert lens[K:] == lens0[K:]  # layers >= K never did: the whole batch dropped every token
    slot = 2 * 4 * 16 * 4  # K and V, 4 heads x 16 dims, fp32
    assert state.kv_bytes_per_sample() == [b + K * n_steps * slot for b in bytes0]
    assert stats["per_sample_kv_skipped"] == [n_steps] * 2 and stats["per_sample_kv_skipped_fraction"] == [1.0] * 2


def test_decode_partial_batch_drop_is_masked_and_matches_single(tiny_mm, images, prompts):
    with Session(tiny_mm, _recipe(predictors="random", vision_keep_rate=1.0)) as s:
        s.pruners[0].predictors.text = _RowText({0})  # sample 0 keeps every token, sample 1 drops every token
        inputs = _inputs(s, images[:2], prompts[:2])
        state, out = s.runner.prefill(inputs)
        assert len(state.groups) == 1  # keep rate 1: no prefill group
        lens0 = [state.cache.layers[i].keys.shape[2] for i in range(4)]
        toks = []
        for _ in range(3):
            nxt = out.logits[:, -1].argmax(-1)
            toks.append(nxt)
            out = s.runner.step(state, nxt[:, None])
        toks.append(out.logits[:, -1].argmax(-1))
        assert [g.start for g in state.groups] == [0, K]  # split off at the first drop
        grp = state.groups[1]
        assert [state.cache.layers[i].keys.shape[2] for i in range(4)] == [n + 3 for n in lens0]  # sample 0 keeps
        assert grp.key_mask[0, -3:].all() and not grp.key_mask[1, -3:].any()  # sample 1: masked out
        assert torch.equal(grp.positions[:, -3:], state.groups[0].positions[:, -3:])  # full-length positions
        assert state.stats_rows(2)["dynamic_llava"]["per_sample_kv_skipped"] == [0, 3]
        # sample 1 alone drops physically and decodes the same tokens
        s.pruners[0].predictors.text = _RowText(set())
        state1, out1 = s.runner.prefill(_inputs(s, images[1:2], prompts[1:2]))
        single = []
        for _ in range(3):
            nxt = out1.logits[:, -1].argmax(-1)
            single.append(nxt)
            out1 = s.runner.step(state1, nxt[:, None])
        single.append(out1.logits[:, -1].argmax(-1))
        assert state1.cache.layers[K].keys.shape[2] == state1.cache.layers[0].keys.shape[2] - 3
    assert [int(t[1]) for t in toks] == [int(t[0]) for t in single]


def test_cache_and_no_cache_rules_agree(tiny_mm, images, prompts):
    """Dropping a token's KV in layers >= K (cache) is what dropping it at layer K every step (no cache)
    computes: same tokens, same decisions (the positions rule included)."""
    outs = {}
    for use_cache in (True, False):
        with Session(tiny_mm, _recipe(predictors="random", use_cache=use_cache)) as s:
            assert s.runner.use_cache is use_cache
            res = s.generate(images[:2], prompts[:2], max_new_tokens=10)
            outs[use_cache] = ([r.token_ids for r in res], [r.stats["dynamic_llava"]["kv_skipped"] for r in res])
    assert outs[True][0] == outs[False][0]
    # the no-cache count cannot include the last fed token (always kept there), the cache count does
    assert all(0 <= c - n <= 1 for c, n in zip(outs[True][1], outs[False][1]))
    assert sum(outs[False][1]) > 0  # the random predictor does drop some generated tokens


# ------------------------------------------------------------------------------------ decode without cache


@pytest.mark.parametrize("drop", [True, False])
def test_no_cache_drops_generated_tokens_but_never_the_last(tiny_mm, images, prompts, tmp_path, drop):
    d = tiny_mm.adapter.text_config.hidden_size
    path, _ = _predictor_dir(tmp_path, d, text_bias=(0.0, 1.0) if drop else (1.0, 0.0))
    with Session(tiny_mm, _recipe(predictors=str(path), use_cache=False)) as s:
        inputs = _inputs(s, images[:2], prompts[:2])
        s.runner.prefill(inputs)  # the prompt
        n_gen = 4
        ids = torch.randint(5, 100, (2, n_gen))
        longer = inputs.append(ids, tiny_mm.adapter.embed_tokens(ids))
        state, _ = s.runner.prefill(longer)
        stats = state.stats["dynamic_llava"]
    length = inputs.length
    grp = state.groups[-1]
    assert grp.start == K
    for b in range(2):
        src = grp.source[b][grp.key_mask[b]]
        gen = src[src >= length].tolist()
        assert gen == ([length + n_gen - 1] if drop else list(range(length, length + n_gen)))
        assert int(inputs.image_mask[b, src[src < length]].sum()) == int(16 * 0.2)  # the image rule too
    assert stats["per_sample_kv_skipped"] == [n_gen - 1 if drop else 0] * 2


# ------------------------------------------------------------------------------------ loading


def _released_state_dict(spec: PredictorSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors under the released Dynamic-LLaVA names (VisionPredictor / TextPredictor / timm block)."""
    d, c, ff = spec.hidden_size, spec.d_model, spec.dim_feedforward
    shapes = {"down_mlp.0.weight": (d,), "down_mlp.0.bias": (d,), "down_mlp.1.weight": (c, d), "down_mlp.1.bias": (c,)}
    for i in range(spec.num_layers):
        t = f"transformer.{i}."
        shapes.update(
            {
                t + "norm1.weight": (c,),
                t + "norm1.bias": (c,),
                t + "attn.qkv.weight": (3 * c, c),
                t + "attn.proj.weight": (c, c),
                t + "attn.proj.bias": (c,),
                t + "norm2.weight": (c,),
                t + "norm2.bias": (c,),
                t + "mlp.fc1.weight": (ff, c),
                t + "mlp.fc1.bias": (ff,),
                t + "mlp.fc2.weight": (c, ff),
                t + "mlp.fc2.bias": (c,),
            }
        )
    for j, (o, i) in zip((0, 2, 4), ((c // 2, c), (c // 4, c // 2), (2, c // 4))):
        shapes[f"output_mlp.{j}.weight"], shapes[f"output_mlp.{j}.bias"] = (o, i), (o,)
    text = {"output_mlp.0.weight": (d,), "output_mlp.0.bias": (d,)}
    for j, (o, i) in zip((1, 3, 5, 7), ((c, d), (c // 2, c), (c // 4, c // 2), (2, c // 4))):
        text[f"output_mlp.{j}.weight"], text[f"output_mlp.{j}.bias"] = (o, i), (o,)
    sd = {"model.image_score_predictor." + k: torch.randn(s, generator=gen) * 0.3 for k, s in shapes.items()}
    sd.update({"model.output_text_score_predictor." + k: torch.randn(s, generator=gen) * 0.3 for k, s in text.items()})
    return sd


def _released_image_forward(sd, x, nhead, num_layers):
    """The released VisionPredictor computation, written from the paper/code description."""
    g = lambda k: sd["model.image_score_predictor." + k]  # noqa: E731
    h = F.gelu(
        F.linear(
            F.layer_norm(x, x.shape[-1:], g("down_mlp.0.weight"), g("down_mlp.0.bias")),
            g("down_mlp.1.weight"),
            g("down_mlp.1.bias"),
        )
    )
    b, n, c = h.shape
    for i in range(num_layers):
        t = f"transformer.{i}."
        y = F.layer_norm(h, (c,), g(t + "norm1.weight"), g(t + "norm1.bias"))
        q, k, v = F.linear(y, g(t + "attn.qkv.weight")).reshape(b, n, 3, nhead, c // nhead).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(c // nhead), -1) @ v
        h = h + F.linear(a.transpose(1, 2).reshape(b, n, c), g(t + "attn.proj.weight"), g(t + "attn.proj.bias"))
        y = F.layer_norm(h, (c,), g(t + "norm2.weight"), g(t + "norm2.bias"))
        h = h + F.linear(
            F.gelu(F.linear(y, g(t + "mlp.fc1.weight"), g(t + "mlp.fc1.bias"))),
            g(t + "mlp.fc2.weight"),
            g(t + "mlp.fc2.bias"),
        )
    h = torch.cat([h[..., : c // 2], h[..., c // 2 :].mean(1, keepdim=True).expand(b, n, c // 2)], -1)
    for j in (0, 2):
        h = F.gelu(F.linear(h, g(f"output_mlp.{j}.weight"), g(f"output_mlp.{j}.bias")))
    return F.linear(h, g("output_mlp.4.weight"), g("output_mlp.4.bias"))


def test_released_checkpoint_key_mapping(tmp_path, tiny_mm, images, prompts):
    from safetensors.torch import save_file

    spec = PredictorSpec(64, 32, 2, 64, 2)
    sd = _released_state_dict(spec, torch.Generator().manual_seed(0))
    llm = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2), "lm_head.weight": torch.zeros(2, 2)}
    ckpt = tmp_path / "Dynamic-LLaVA-tiny"
    ckpt.mkdir()
    keys = sorted(sd)
    shards = {
        "model-00001-of-00002.safetensors": {**llm, **{k: sd[k] for k in keys[:10]}},
        "model-00002-of-00002.safetensors": {k: sd[k] for k in keys[10:]},
    }
    for name, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(ckpt / name))
    index = {"weight_map": {k: name for name, tensors in shards.items() for k in tensors}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    sparse = {
        "d_model": 32,
        "nhead": 2,
        "dim_feedforward": 64,
        "num_layers": 2,
        "sparse_layer": K,
        "use_vision_predictor": True,
        "use_text_predictor": True,
        "use_output_text_predictor": True,
        "use_instruct_predictor": False,
        "vision_keep_rate": 0.2,
    }
    (ckpt / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DynamicLlavaLlamaForCausalLM"],
                "model_type": "llava_llama",
                "hidden_size": 64,
                "sparse_config": sparse,
            }
        )
    )

    assert released_to_ours("model.image_score_predictor.transformer.1.attn.qkv.weight") == "image.blocks.1.qkv.weight"
    assert released_to_ours("model.output_text_score_predictor.output_mlp.7.bias") == "text.fc4.bias"
    assert released_to_ours("model.layers.0.self_attn.q_proj.weight") is None
    pred, got_sparse = load_predictors(ckpt, 64)
    assert got_sparse["sparse_layer"] == K and pred.spec == spec
    ours = pred.state_dict()
    assert len(ours) == len(sd)
    for k, v in sd.items():
        assert torch.equal(ours[released_to_ours(k)], v)
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(pred.image(x), _released_image_forward(sd, x, 2, 2), atol=1e-5, rtol=1e-4)

    def t(j):
        return (
            sd[f"model.output_text_score_predictor.output_mlp.{j}.weight"],
            sd[f"model.output_text_score_predictor.output_mlp.{j}.bias"],
        )

    h = F.layer_norm(x, (64,), *t(0))
    for j in (1, 3, 5):
        h = F.gelu(F.linear(h, *t(j)))
    torch.testing.assert_close(pred.text(x), F.linear(h, *t(7)), atol=1e-5, rtol=1e-4)

    bin_ckpt = tmp_path / "Dynamic-LLaVA-bin"  # a single pytorch_model.bin
    bin_ckpt.mkdir()
    torch.save({**llm, **sd}, bin_ckpt / "pytorch_model.bin")
    (bin_ckpt / "config.json").write_text((ckpt / "config.json").read_text())
    assert all(torch.equal(v, ours[k]) for k, v in load_predictors(bin_ckpt, 64)[0].state_dict().items())

    with Session(tiny_mm, _recipe(predictors=str(ckpt))) as s:  # usable as a recipe param
        assert s.generate(images[:1], prompts[:1], max_new_tokens=2)[0].stats["dynamic_llava"]["kept"] == 3
    with pytest.raises(ConfigError, match="sparse_layer"):
        Session(tiny_mm, _recipe(predictors=str(ckpt), sparse_layer=1))
    with pytest.raises(ModelLoadError, match="64"):
        load_predictors(ckpt, 128)


def test_predictors_not_matching_their_config_name_the_file_and_the_fix(tmp_path):
    path, _ = _predictor_dir(tmp_path, 64)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sparse_config"].update(d_model=64, nhead=1)  # the tensors are 32 wide
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"pred .*shape mismatch .*train_dynamic_llava\.py"):
        load_predictors(path, 64)


def test_missing_weights_error_names_file_and_command(tiny_mm):
    with pytest.raises(ModelLoadError) as exc:
        Session(tiny_mm, _recipe())  # auto: <model dir>/dynamic_llava, which the tiny model lacks
    msg = str(exc.value)
    assert "dynamic_llava/predictors.safetensors" in msg and "scripts/train_dynamic_llava.py" in msg
    Session(tiny_mm, _recipe(vision_keep_rate=1.0, text_keep="always")).close()  # nothing to predict: no weights needed


# ------------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def tiny_llava(tiny_dir):
    from transformers import LlavaForConditionalGeneration

    m = LlavaForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return m.requires_grad_(False)


def _train_batch(llava, n_answer=12):
    image_id = llava.config.image_token_id
    gen = torch.Generator().manual_seed(0)
    rows, labels = [], []
    for b in range(2):
        prompt = [1] + [image_id] * 16 + torch.randint(5, 100, (6 + b,), generator=gen).tolist()
        answer = torch.randint(5, 100, (n_answer,), generator=gen).tolist() + [2]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    length = max(map(len, rows))
    ids = torch.zeros(2, length, dtype=torch.long)
    lab = torch.full((2, length), -100)
    mask = torch.zeros(2, length, dtype=torch.long)
    for b, (r, l) in enumerate(zip(rows, labels)):
        ids[b, : len(r)], lab[b, : len(l)], mask[b, : len(r)] = torch.tensor(r), torch.tensor(l), 1
    feats = torch.randn(2, 16, llava.config.vision_config.hidden_size, generator=gen)
    return feats, ids, lab, mask


def test_training_masked_attention_with_full_keep_is_the_model(tiny_llava):
    from mmfast.train.dynamic_llava import DynamicTrainConfig, DynamicTraining
    from mmfast.train.embedded import llava_forward

    feats, ids, lab, mask = _train_batch(tiny_llava)
    image_id = tiny_llava.config.image_token_id
    with torch.no_grad():
        want, _ = llava_forward(tiny_llava, feats, ids, mask, image_id)
        before = count_hooks(tiny_llava)
        tr = DynamicTraining(tiny_llava, Predictors(PredictorSpec.scaled(64)), K, DynamicTrainConfig())
        tr.begin(ids == image_id, lab, 1.0)
        tr.predictors.image.head3.bias.copy_(torch.tensor([1e4, -1e4]))  # keep everything
        tr.predictors.text.fc4.bias.copy_(torch.tensor([1e4, -1e4]))
        got, _ = llava_forward(tiny_llava, feats, ids, mask, image_id)
        out = tr.end()
        tr.close()
        again, _ = llava_forward(tiny_llava, feats, ids, mask, image_id)
    assert bool((out["image_keep"] == 1).all())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(again, want) and count_hooks(tiny_llava) == before


def test_training_step_lowers_loss_and_moves_keep_ratio(tiny_llava):
    from mmfast.train.dynamic_llava import DynamicTrainConfig, DynamicTraining, forward_loss

    cfg = DynamicTrainConfig(output_text_len_for_training=8, output_text_keep_rate=0.1)
    feats, ids, lab, mask = _train_batch(tiny_llava)
    image_id = tiny_llava.config.image_token_id
    torch.manual_seed(0)
    pred = Predictors(PredictorSpec.scaled(64)).init_weights()
    tr = DynamicTraining(tiny_llava, pred, K, cfg)
    opt = torch.optim.AdamW(pred.parameters(), lr=1e-2, weight_decay=0.0)

    def evaluate():
        torch.manual_seed(123)  # the same Gumbel noise each time
        with torch.no_grad():
            return forward_loss(tr, tiny_llava, feats, ids, lab, mask, image_id, tau=1.0)

    try:
        loss0, parts0 = evaluate()
        for step in range(20):
            torch.manual_seed(step)
            loss, _ = forward_loss(tr, tiny_llava, feats, ids, lab, mask, image_id, tau=1.0)
            opt.zero_grad()
            loss.backward()
            assert pred.image.down.weight.grad is not None and pred.text.fc1.weight.grad is not None
            opt.step()
        loss1, parts1 = evaluate()
    finally:
        tr.close()
    assert float(loss1) < float(loss0)
    # the keep probabilities the hard masks are sampled from move to r (0.2 images, 0.1 text here)
    assert abs(parts0["p_keep_v"] - 0.5) < 0.05 and abs(parts0["p_keep_t"] - 0.5) < 0.05
    assert abs(parts1["p_keep_v"] - 0.2) < 0.15 and abs(parts1["p_keep_t"] - 0.1) < 0.2
    assert abs(parts1["keep_v"] - 0.2) < abs(parts0["keep_v"] - 0.2)


@pytest.mark.parametrize("budget, per_image", [({"tokens": 10}, 10.0), ({"ratio": 0.5}, 8.0)])
def test_budget_holds_per_image_in_a_multi_image_sample(tiny_mm, images, budget, per_image):
    """A budget is layer-averaged tokens per image: a sample of m images of N tokens keeps m k after layer K
    (k the one-image keep), so it averages m B; a rate of (k + 0.5) / N kept m k + m // 2."""
    stage = {"method": "dynamic_llava", "params": {"predictors": "random"}, "budget": budget}
    samples = [[images[0], images[1]], images[2], [images[3], images[1], images[0]]]
    prompts = ["Compare them.", "Describe it.", "Which one?"]
    out = tiny_mm.generate(samples, prompts, recipe={"pruning": [stage]}, max_new_tokens=2)
    assert [r.vision_tokens_layer_avg for r in out] == [2 * per_image, per_image, 3 * per_image]


def test_budget_holds_per_image_in_a_multi_image_sample_of_different_counts():
    """LLaVA-NeXT (images of their own counts, the budget mapped per count): a sample of two images averages the
    sum of its images' one-image averages, as FastV; the budget was mapped once on the sample's joined count, so
    ``tokens: 40`` (feasible on each image) was refused as infeasible for one image of both images' tokens."""
    import numpy as np
    from PIL import Image

    import mmfast
    from mmfast.models.factory import random_llava_next

    model, processor = random_llava_next("tiny")
    mm = mmfast.load(model, processor)
    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(40, 48), (84, 40)]]
    for budget in ({"tokens": 40}, {"ratio": 0.7}):
        stage = {"method": "dynamic_llava", "params": {"predictors": "random"}, "budget": budget}
        one = [mm.generate([[im]], ["Describe."], recipe={"pruning": [stage]}, max_new_tokens=1)[0] for im in ims]
        assert one[0].n_vision_tokens != one[1].n_vision_tokens
        two = mm.generate([ims], ["Describe."], recipe={"pruning": [stage]}, max_new_tokens=1)[0]
        assert two.vision_tokens_layer_avg == sum(r.vision_tokens_layer_avg for r in one), budget
