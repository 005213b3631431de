"""Diversity-based pruning peers (DivPrune, DART, CDPruner): each method's selections against a direct,
loop-by-loop computation of its rule on the tiny model; budgets; LLaVA-NeXT behaviour.

(The no-op == baseline and batch == per-sample checks of every registered pruner are in
tests/test_pruning_common.py; the compatibility matrix in tests/test_compat_matrix.py.)"""

from __future__ import annotations

import pytest
import torch

import mmfast
from mmfast.config import load_recipe
from mmfast.pipeline import Session


def _session(mm, method, **params):
    return Session(mm, load_recipe({"pruning": [{"method": method, "params": params}]}))


@pytest.fixture(scope="module")
def next_mm(tmp_path_factory):
    from mmfast.models.factory import random_llava_next, save_model

    model, processor = random_llava_next("tiny")
    return mmfast.load(save_model(model, processor, tmp_path_factory.mktemp("next_div")), device="cpu", dtype="float32")


def _full_projected(mm, batch):
    """Every image's LLM-input tokens without pruning: [N_i, d] each."""
    with Session(mm, load_recipe({})) as base, torch.inference_mode():
        vision = base.encode(batch)
        return [p.clone() for p in mm.adapter.project(vision)]


# -- DivPrune ------------------------------------------------------------------------------------


def _divprune_reference(x: torch.Tensor, k: int) -> list[int]:
    """The release's rule, written as plain loops: 1 - cos distances; first the token whose nearest
    other token is farthest; then repeatedly the token farthest from the selected set."""
    n = x.shape[0]
    xs = [v / v.norm() for v in x.double()]
    dist = [[1.0 - float(xs[i] @ xs[j]) for j in range(n)] for i in range(n)]
    first = max(range(n), key=lambda j: (sorted(dist[i][j] for i in range(n))[1], -j))
    chosen = [first]
    while len(chosen) < k:
        score = {j: min(dist[s][j] for s in chosen) for j in range(n) if j not in chosen}
        chosen.append(max(score, key=lambda j: (score[j], -j)))
    return sorted(chosen)


@pytest.mark.parametrize("family", ["llava", "llava_next"])
def test_divprune_selects_the_max_min_subset(family, tiny_mm, next_mm, images, prompts):
    mm = tiny_mm if family == "llava" else next_mm
    batch = mm.prepare(images[:3], prompts[:3])
    full = _full_projected(mm, batch)
    k = 6
    with _session(mm, "divprune", keep=k) as s:
        vision = s.encode(batch)
        res = s.generate(images[:3], prompts[:3], max_new_tokens=2)
    assert [r.n_vision_tokens for r in res] == [k] * 3
    for i in range(3):
        want = _divprune_reference(full[i], k)
        got = vision.projected[i]
        assert got.shape[0] == k
        # the kept tokens are exactly the reference's rows (the LLM-input embeddings, unchanged)
        torch.testing.assert_close(got, full[i][want], atol=0, rtol=0)
        if family == "llava":
            assert vision.patch_ids[i].tolist() == want


def _device_reads(fn):
    """(fn's result, how many values it read from tensors to the host: a GPU sync each)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    with Reads():
        out = fn()
    return out, Reads.n


def test_divprune_selection_never_reads_the_device():
    """The greedy loop keeps each pick on the device (a pick read to the host is a GPU sync per pick):
    no ``.item()`` while selecting, and the same picks as indexing with each pick (the old loop)."""
    from mmfast.pruning.divprune import cosine_distance, max_min_select

    g = torch.Generator().manual_seed(0)
    dist = cosine_distance(torch.randn(200, 16, generator=g))
    got, reads = _device_reads(lambda: max_min_select(dist, 40))
    assert reads == 0
    picked = [int(dist.topk(2, dim=0, largest=False).values[1].argmax())]
    closest = dist[picked[0]].clone()
    while len(picked) < 40:
        picked.append(int(closest.argmax()))
        closest = torch.minimum(closest, dist[picked[-1]])
    assert got.tolist() == picked


def test_divprune_decides_exact_duplicates_by_index_not_rounding_and_never_repicks():
    """Tokens in exact duplicate pairs (a flat region, a LLaVA-NeXT tile equal to its base view): the
    picks are the same whatever rounding noise (1e-6) the copies carry, ties go to the lower index, and
    when every token left duplicates a picked one the next pick is the lowest unpicked, not index 0 again."""
    from mmfast.pruning.divprune import cosine_distance, max_min_select

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g).repeat(2, 1)  # [12, 16]: token j + 6 duplicates token j
    exact = max_min_select(cosine_distance(x), 12).tolist()
    assert sorted(exact) == list(range(12))  # every token once
    assert sorted(exact[:6]) == list(range(6))  # the first copy of each before any second copy
    for seed in range(5):
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)) * 1e-6
        assert max_min_select(cosine_distance(x + noise), 12).tolist() == exact


def test_divprune_next_batch_equals_single_on_duplicate_tokens(next_mm):
    """A square image whose one anyres tile repeats its base view and a flat image: every token has an
    exact duplicate, and NeXT's tower differs by ~5e-7 between a batch and one image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    ims = [
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)),
        Image.new("RGB", (48, 40), (120, 60, 200)),
        Image.fromarray(rng.integers(0, 255, (100, 40, 3), dtype=np.uint8)),
    ]
    prompts = ["Describe the image.", "Is there a cat in the image? Tell me.", "What?"]
    rec = {"pruning": [{"method": "divprune", "budget": {"ratio": 0.5}}]}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite's one thread gives bitwise-equal towers; two give the batch's noise
    try:
        with Session(next_mm, load_recipe(rec)) as s, torch.inference_mode():
            batched = s.encode(next_mm.prepare(ims, prompts)).patch_ids  # the kept tokens of each image
            single = [s.encode(next_mm.prepare([im], [p])).patch_ids[0] for im, p in zip(ims, prompts)]
    finally:
        torch.set_num_threads(threads)
    assert [b.tolist() for b in batched] == [one.tolist() for one in single]
    out = next_mm.generate(ims, prompts, recipe=rec, max_new_tokens=4)
    alone = [next_mm.generate([im], [p], recipe=rec, max_new_tokens=4)[0] for im, p in zip(ims, prompts)]
    assert [r.token_ids for r in out] == [r.token_ids for r in alone]


def test_cdpruner_greedy_map_never_reads_the_device():
    """CDPruner's fast greedy MAP keeps each pick on the device, with the picks of the loop that indexed
    with each pick (three host reads per pick)."""
    import math

    from mmfast.pruning.cdpruner import dpp_kernel, greedy_map

    g = torch.Generator().manual_seed(0)
    kernel = dpp_kernel(torch.randn(150, 16, generator=g), torch.rand(150, generator=g))
    got, reads = _device_reads(lambda: greedy_map(kernel, 30))
    assert reads == 0
    cis, di2s, picked = torch.zeros(30, 150), kernel.diagonal().clone(), []
    for i in range(30):
        j = int(di2s.argmax())
        picked.append(j)
        eis = (kernel[j] - cis[:i, j] @ cis[:i]) / di2s[j].sqrt()
        cis[i] = eis
        di2s = di2s - eis.square()
        di2s[j] = -math.inf
    assert got.tolist() == picked
    assert greedy_map(kernel, 0).tolist() == []


def test_divprune_ratio_and_budget(tiny_mm, images, prompts):
    with _session(tiny_mm, "divprune", ratio=0.3) as s:  # round(0.3 * 16) = 5
        assert [r.n_vision_tokens for r in s.generate(images[:2], prompts[:2], max_new_tokens=1)] == [5, 5]
    rec = load_recipe({"pruning": [{"method": "divprune", "budget": {"tokens": 7}}]})
    with Session(tiny_mm, rec) as s:
        assert [r.n_vision_tokens for r in s.generate(images[:2], prompts[:2], max_new_tokens=1)] == [7, 7]


# -- DART ----------------------------------------------------------------------------------------


def _dart_reference(mm, inputs, layer, n_img_piv, n_txt_piv, per_pivot, order="sequence"):
    """DART's rule for one unpadded sample, from the plain HF forward: keys of layer K-1 (k_proj of
    its input norm, RoPE at the prompt positions), the final norm of the hidden state entering K.
    Pivots visited in ascending order, or (``order="release"``) as the release's loop
    ``for item in list(set(image_indices + query_indices))`` over sequence indices."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lm = mm.adapter.language_model
    with torch.inference_mode():
        out = lm(inputs_embeds=inputs.embeds, position_ids=inputs.position_ids, output_hidden_states=True)
        attn = mm.adapter.layers[layer - 1].self_attn
        x = mm.adapter.layers[layer - 1].input_layernorm(out.hidden_states[layer - 1])
        hd = attn.head_dim
        k = attn.k_proj(x).view(1, x.shape[1], -1, hd).transpose(1, 2)  # [1, Hkv, T, hd]
        q = attn.q_proj(x).view(1, x.shape[1], -1, hd).transpose(1, 2)
        cos, sin = lm.rotary_emb(x, position_ids=inputs.position_ids)
        _, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)  # repeat_kv, as the release's keys
        key_l1 = k[0].permute(1, 0, 2).reshape(x.shape[1], -1).abs().sum(-1)  # [T]
        feats = lm.norm(out.hidden_states[layer])[0]  # [T, d]
    image = inputs.image_mask[0].nonzero().squeeze(1).tolist()
    text = [t for t in range(image[-1] + 1, inputs.length)]
    img_piv = sorted(image, key=lambda t: -float(key_l1[t]))[:n_img_piv]
    txt_piv = sorted(text, key=lambda t: -float(key_l1[t]))[:n_txt_piv]
    valid = [t for t in image if t not in img_piv]
    kept = set(img_piv)
    for p in sorted(img_piv + txt_piv) if order == "sequence" else list(set(img_piv + txt_piv)):
        sims = {
            t: float(torch.nn.functional.cosine_similarity(feats[p].double(), feats[t].double(), dim=0)) for t in valid
        }
        picked = sorted(valid, key=lambda t: sims[t])[:per_pivot]  # least similar to the pivot
        kept.update(picked)
        valid = [t for t in valid if t not in picked]
    return sorted(kept)


def test_dart_keeps_the_least_duplicated_tokens(tiny_mm, images, prompts):
    layer, pi, pt, m = 2, 2, 3, 5  # per pivot: 5 // 5 = 1 -> 2 + 5 = 7 image tokens kept
    for b in range(3):
        batch = tiny_mm.prepare(images[b : b + 1], prompts[b : b + 1])
        with _session(tiny_mm, "dart", k=layer, pivot_image=pi, pivot_text=pt, truncation=m) as s:
            inputs = s.build_inputs(batch, s.encode(batch))
            state, _ = s.runner.prefill(inputs)
        want = _dart_reference(tiny_mm, inputs, layer, pi, pt, 1)
        grp = state.groups[-1]
        assert grp.start == layer
        src = grp.source[0][grp.key_mask[0]]
        got = src[inputs.image_mask[0][src]].tolist()
        assert got == want and len(got) == 7
        # text all kept, original positions
        assert int((~inputs.image_mask[0][src]).sum()) == int((~inputs.image_mask[0]).sum())
        assert torch.equal(grp.positions[0][grp.key_mask[0]], inputs.position_ids[0][src])


def test_dart_release_pivot_order_preset(tiny_mm, images, prompts):
    """preset: release visits the pivots in the release's set order; its kept tokens equal the
    release's rule computed directly, and differ from the sequence order's on some samples."""
    layer, pi, pt, m = 2, 3, 5, 8  # per pivot: 8 // 8 = 1 -> 3 + 8 = 11 image tokens kept
    asks = prompts + ["Is there a person next to the red car in this picture?", "What is on the table?"]
    differs = 0
    for b, ask in enumerate(asks):
        batch = tiny_mm.prepare(images[b % 4 : b % 4 + 1], [ask])
        got = {}
        for preset in ("sequence", "release"):
            with _session(tiny_mm, "dart", k=layer, pivot_image=pi, pivot_text=pt, truncation=m, preset=preset) as s:
                inputs = s.build_inputs(batch, s.encode(batch))
                state, _ = s.runner.prefill(inputs)
            grp = state.groups[-1]
            src = grp.source[0][grp.key_mask[0]]
            got[preset] = src[inputs.image_mask[0][src]].tolist()
            assert got[preset] == _dart_reference(tiny_mm, inputs, layer, pi, pt, 1, order=preset), (b, preset)
        differs += got["sequence"] != got["release"]
    assert differs > 0, "the samples must tell the release's pivot order from the ascending one"
    rec = {
        "pruning": [
            {"method": "dart", "params": {"pivot_image": pi, "pivot_text": pt, "truncation": m, "preset": "release"}}
        ]
    }
    batched = tiny_mm.generate(images[:3], asks[:3], recipe=rec, max_new_tokens=2)  # padded: sequence index, not slot
    single = [tiny_mm.generate([im], [p], recipe=rec, max_new_tokens=2)[0] for im, p in zip(images[:3], asks[:3])]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]


def test_dart_release_counts_and_budget(tiny_mm, images, prompts):
    from mmfast.pruning.dart import DART

    # per pivot t = M // (pi + pt); kept = pi + (pi + pt) t
    with _session(tiny_mm, "dart", pivot_image=1, pivot_text=1, truncation=7) as s:
        res = s.generate(images[:2], prompts[:2], max_new_tokens=1)
    assert [r.stats["dart"]["kept"] for r in res] == [1 + 2 * 3] * 2
    cfg = (
        load_recipe({"pruning": [{"method": "dart", "params": {"k": 8, "layer_mapping": "proportional"}}]})
        .pruning[0]
        .params
    )
    # 4-layer LLM: K = 1, N = 16; budget 12 -> keep = round((4 * 12 - 16) / 3) = 11 -> t = round((11 - 4) / 8) = 1
    assert DART.budget_params(12, 16, tiny_mm.adapter, cfg, "budget") == {"truncation": 8}
    rec = load_recipe(
        {"pruning": [{"method": "dart", "budget": {"tokens": 12}, "params": {"k": 8, "layer_mapping": "proportional"}}]}
    )
    with Session(tiny_mm, rec) as s:
        res = s.generate(images[:1], prompts[:1], max_new_tokens=1)
    assert res[0].stats["dart"]["kept"] == 12
    assert res[0].vision_tokens_layer_avg == pytest.approx((16 + 3 * 12) / 4)


def test_dart_without_pivots_is_refused(tiny_mm):
    """pivot_image = pivot_text = 0: DART splits M among no pivots, so every image token goes at layer K (the release
    divides by zero); a budget of 12 then landed silently at 4 layer-averaged tokens (K N / L)."""
    from mmfast.errors import ConfigError

    no_pivots = {"k": 1, "pivot_image": 0, "pivot_text": 0}
    for stage in ({"params": {**no_pivots, "truncation": 8}}, {"params": no_pivots, "budget": {"tokens": 12}}):
        with pytest.raises(ConfigError, match="pivot"):
            Session(tiny_mm, load_recipe({"pruning": [{"method": "dart", **stage}]}))
    _session(tiny_mm, "dart", k=1, pivot_image=0, pivot_text=2, truncation=4).close()  # text pivots alone: fine


# -- CDPruner ------------------------------------------------------------------------------------


def _greedy_map(kernel: torch.Tensor, k: int) -> list[int]:
    """Greedy MAP of the DPP with ``kernel`` [N, N]: each step adds the token that maximises det(L_S)."""
    chosen: list[int] = []
    for _ in range(k):
        dets = {
            j: float(torch.linalg.det(kernel[chosen + [j]][:, chosen + [j]]))
            for j in range(kernel.shape[0])
            if j not in chosen
        }
        chosen.append(max(dets, key=dets.get))
    return sorted(chosen)


def _cdpruner_reference(x: torch.Tensor, text: torch.Tensor, k: int, theta=None, negate=False) -> list[int]:
    """Conditional-DPP greedy MAP from its definition: L = diag(r) S diag(r) with r the min-max
    normalised cosine to the instruction embedding; each step adds the token that maximises det(L_S)."""
    xs = x.double() / x.double().norm(dim=-1, keepdim=True)
    t = text.double() / text.double().norm(dim=-1, keepdim=True)
    rel = (xs @ t.T).mean(-1) * (-1 if negate else 1)
    rel = (rel - rel.min() + 1e-6) / (rel.max() - rel.min())
    if theta is not None:
        rel = torch.exp(theta / (2 * (1 - theta)) * rel)
    return _greedy_map(rel[:, None] * (xs @ xs.T) * rel[None, :], k)


@pytest.mark.parametrize("params", [{}, {"theta": 0.5}, {"negate": True}])
def test_cdpruner_selects_the_greedy_map_subset(params, tiny_mm, images, prompts):
    batch = tiny_mm.prepare(images[:3], prompts[:3])
    full = _full_projected(tiny_mm, batch)
    k = 5
    with _session(tiny_mm, "cdpruner", keep=k, **params) as s:
        vision = s.encode(batch)
    with torch.inference_mode():
        for i in range(3):
            ids = tiny_mm.tokenizer(prompts[i], add_special_tokens=False)["input_ids"]
            text = tiny_mm.adapter.embed_tokens(torch.tensor(ids)).mean(0, keepdim=True)
            want = _cdpruner_reference(full[i], text, k, **params)
            assert vision.patch_ids[i].tolist() == want
            torch.testing.assert_close(vision.projected[i], full[i][want], atol=0, rtol=0)


def test_cdpruner_is_conditional_and_takes_a_budget(tiny_mm, images, prompts):
    with _session(tiny_mm, "cdpruner", keep=4) as s:
        picks = {p: s.encode(tiny_mm.prepare(images[:1], [p])).patch_ids[0].tolist() for p in prompts}
    assert len(set(map(tuple, picks.values()))) > 1  # the instruction changes the selection
    rec = load_recipe({"pruning": [{"method": "cdpruner", "budget": {"tokens": 6}}]})
    with Session(tiny_mm, rec) as s:
        assert [r.n_vision_tokens for r in s.generate(images[:2], prompts[:2], max_new_tokens=1)] == [6, 6]


def test_cdpruner_next_keeps_t_per_tile_and_every_row_separator(next_mm, images, prompts):
    """LLaVA-NeXT: relevance normalised over the image's tiles, one DPP per tile keeping T, the mask
    unpadded with the features, row separators kept. Checked by matching packed rows to tile tokens by value."""
    batch = next_mm.prepare(images[:2], prompts[:2])
    k = 3
    with Session(next_mm, load_recipe({})) as base, torch.inference_mode():
        full = base.encode(batch)
        packed_full = [p.clone() for p in full.projected]
        tile_feats = [f.clone() for f in full.features]
    with _session(next_mm, "cdpruner", keep=k) as s:
        vision = s.encode(batch)
    newline = next_mm.adapter.base.image_newline.detach()
    with torch.inference_mode():
        for i in range(2):
            n_t = full.extras["n_tiles"][i]
            tiles = next_mm.adapter.projector(tile_feats[i].reshape(n_t, 16, -1))  # [n_t, 16, d]
            ids = next_mm.tokenizer(prompts[i], add_special_tokens=False)["input_ids"]
            text = next_mm.adapter.embed_tokens(torch.tensor(ids)).mean(0, keepdim=True)
            flat = tiles.reshape(n_t * 16, -1).double()
            rel = (flat / flat.norm(dim=-1, keepdim=True) @ (text.double() / text.double().norm()).T).mean(-1)
            rel = ((rel - rel.min() + 1e-6) / (rel.max() - rel.min())).reshape(n_t, 16)
            picked = set()
            for t in range(n_t):
                xs = tiles[t].double() / tiles[t].double().norm(dim=-1, keepdim=True)
                kern = rel[t][:, None] * (xs @ xs.T) * rel[t][None, :]
                chosen: list[int] = []
                for _ in range(k):
                    dets = {
                        j: float(torch.linalg.det(kern[chosen + [j]][:, chosen + [j]]))
                        for j in range(16)
                        if j not in chosen
                    }
                    chosen.append(max(dets, key=dets.get))
                picked |= {t * 16 + j for j in chosen}
            want = []
            for r, row in enumerate(packed_full[i]):
                if torch.equal(row, newline):
                    want.append(r)
                elif int((flat - row.double()).norm(dim=-1).argmin()) in picked:
                    want.append(r)
            torch.testing.assert_close(vision.projected[i], packed_full[i][want], atol=0, rtol=0)
            assert len(want) < packed_full[i].shape[0]


@pytest.fixture(scope="module")
def tiny_clip_dir(tiny_mm, tmp_path_factory):
    """A tiny CLIP checkpoint paired with the tiny tower's width (text tower, projections, tokenizer)."""
    from transformers import CLIPConfig, CLIPModel

    from mmfast.models.factory import _TEST_CORPUS, train_bpe_tokenizer

    tok = train_bpe_tokenizer(_TEST_CORPUS * 4, 300)
    vis = tiny_mm.adapter.vision_config
    cfg = CLIPConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": 24,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 77,
            "eos_token_id": 2,
            "pad_token_id": 0,
        },
        vision_config={
            "hidden_size": vis.hidden_size,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": vis.image_size,
            "patch_size": vis.patch_size,
        },
        projection_dim=12,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("clip")
    CLIPModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_cdpruner_with_a_supplied_clip_text_tower(tiny_mm, tiny_clip_dir, images, prompts):
    """clip_model: relevance = -cos(visual_projection(post_layernorm(feature-layer patch)), pooled
    projected text of the zero-padded 77-token window), as the release; similarity on projected tokens."""
    from transformers import AutoTokenizer, CLIPModel

    clip = CLIPModel.from_pretrained(tiny_clip_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_clip_dir)
    batch = tiny_mm.prepare(images[:2], prompts[:2])
    full = _full_projected(tiny_mm, batch)
    with Session(tiny_mm, load_recipe({})) as base, torch.inference_mode():
        feats = [f.clone() for f in base.encode(batch).features]
    k = 5
    with _session(tiny_mm, "cdpruner", keep=k, clip_model=str(tiny_clip_dir)) as s:
        vision = s.encode(batch)
    post = tiny_mm.adapter.vision_tower.post_layernorm
    with torch.inference_mode():
        for i in range(2):
            ids = tok(prompts[i])["input_ids"]
            window = torch.tensor([ids + [0] * (77 - len(ids))])
            mask = torch.tensor([[1] * len(ids) + [0] * (77 - len(ids))])
            text = clip.text_projection(clip.text_model(input_ids=window, attention_mask=mask).pooler_output)  # [1, D]
            image = clip.visual_projection(post(feats[i]))  # [N, D]
            want = _cdpruner_reference_split(full[i], image, text, k)
            assert vision.patch_ids[i].tolist() == want


def _cdpruner_reference_split(tokens, image, text, k):
    """As _cdpruner_reference, with relevance -cos(image embedding, text) and similarity on tokens."""
    v = image.double() / image.double().norm(dim=-1, keepdim=True)
    t = text.double() / text.double().norm(dim=-1, keepdim=True)
    rel = -(v @ t.T).mean(-1)
    rel = (rel - rel.min() + 1e-6) / (rel.max() - rel.min())
    xs = tokens.double() / tokens.double().norm(dim=-1, keepdim=True)
    return _greedy_map(rel[:, None] * (xs @ xs.T) * rel[None, :], k)


def test_cdpruner_clip_model_must_exist(tiny_mm, tmp_path):
    from mmfast.errors import ConfigError

    with pytest.raises(ConfigError, match="clip_model"):
        _session(tiny_mm, "cdpruner", keep=4, clip_model=str(tmp_path / "missing"))


def test_cdpruner_embedded_clip_tells_instructions_apart():
    """The CLIP the embedded model ships (clip/, no tokenizer files: trained on the LLaVA tokenizer)
    embeds two different instructions differently (a 2-token CLIP tokenizer gave cosine 1.0), and the
    relevance, hence the selection, follows the instruction."""
    from mmfast.checkpoint import embedded_dir
    from mmfast.model import ASSETS
    from mmfast.pruning.cdpruner import relevance
    from mmfast.world import render_image

    if not (ASSETS / "tiny-world" / "config.json").is_file():
        pytest.skip("embedded model not built")
    world = mmfast.load("mmfast/tiny-world", device="cpu")
    image = render_image(0, "val", 1).image
    asks = ["Is there a dog in the image?", "What color is the car on the left?"]
    with _session(world, "cdpruner", keep=8, clip_model=str(embedded_dir() / "clip")) as s:
        pruner = s.pruners[0]
        assert pruner.clip.embedded and pruner.clip.tokenizer is world.tokenizer
        text = [pruner.instruction_embeddings(a) for a in asks]  # [1, D] each
        assert float(torch.nn.functional.cosine_similarity(text[0], text[1]).squeeze()) < 0.99
        vision = s.encode(world.prepare([image], asks[:1]))
    with Session(world, load_recipe({})) as base, torch.inference_mode():
        full = base.encode(world.prepare([image], asks[:1]))
        emb = pruner.image_embeddings(full, 0, None)
        rels = [relevance(emb, t, negate=True) for t in text]
    assert not torch.allclose(rels[0], rels[1], atol=1e-3)
    assert vision.patch_ids[0].numel() == 8


def test_cdpruner_clip_without_its_tokenizer_is_refused(tiny_mm, tiny_clip_dir, tmp_path):
    """A CLIP directory without tokenizer files whose vocabulary is not the model's, or whose tokenizer
    does not cover its vocabulary, is refused before compute (not run on a 2-token tokenizer)."""
    from transformers import CLIPConfig, CLIPModel

    from mmfast.errors import ConfigError

    cfg = CLIPModel.config_class.from_pretrained(tiny_clip_dir).to_dict()
    cfg["text_config"]["vocab_size"] = 64  # not the tiny model's 300
    bare = tmp_path / "bare"
    CLIPModel(CLIPConfig(**{k: cfg[k] for k in ("text_config", "vision_config", "projection_dim")})).save_pretrained(
        bare
    )
    assert len(tiny_mm.tokenizer) != 64
    with pytest.raises(ConfigError, match="clip_model.*no tokenizer"):
        _session(tiny_mm, "cdpruner", keep=4, clip_model=str(bare))
    from mmfast.models.factory import _TEST_CORPUS, train_bpe_tokenizer

    train_bpe_tokenizer(_TEST_CORPUS, 120).save_pretrained(bare)
    with pytest.raises(ConfigError, match="clip_model.*tokens but the text tower"):
        _session(tiny_mm, "cdpruner", keep=4, clip_model=str(bare))


@pytest.mark.parametrize(
    "suffix",
    [
        "\nAnswer the question using a single word or phrase.",
        "\nAnswer with the option's letter from the given choices directly.",
    ],
)
def test_cdpruner_relevance_text_drops_the_answer_suffix(suffix, tiny_mm, tiny_clip_dir, images):
    """As the release's eval scripts, the answer-format suffix is not part of the relevance text:
    a prompt with it selects exactly what the bare question selects (LLM-embedding and CLIP relevance)."""
    from mmfast.pruning.cdpruner import instruction_text

    ask = "Is there a cat in the image?"
    assert instruction_text(ask + suffix) == ask
    for extra in ({}, {"clip_model": str(tiny_clip_dir)}):
        with _session(tiny_mm, "cdpruner", keep=5, **extra) as s:
            bare = s.encode(tiny_mm.prepare(images[:1], [ask])).patch_ids[0].tolist()
            full = s.encode(tiny_mm.prepare(images[:1], [ask + suffix])).patch_ids[0].tolist()
            emb = [s.pruners[0].instruction_embeddings(p) for p in (ask, ask + suffix)]
        assert full == bare
        torch.testing.assert_close(emb[0], emb[1], atol=0, rtol=0)


# -- all three: several images per prompt, LLaVA-NeXT batches ------------------------------------


@pytest.mark.parametrize(
    "method, params, per_image",
    [
        ("divprune", {"keep": 4}, 4),
        ("cdpruner", {"keep": 4}, 4),
        ("dart", {"pivot_image": 1, "pivot_text": 1, "truncation": 4}, 1 + 2 * 2),
    ],
)
def test_each_image_of_a_prompt_is_reduced_on_its_own(method, params, per_image, tiny_mm, images):
    prompts = ["Compare the two images.", "Describe the image."]
    rec = {"pruning": [{"method": method, "params": params}]}
    out = tiny_mm.generate([images[:2], images[2]], prompts, recipe=rec, max_new_tokens=2)
    assert out[0].stats[method]["kept"] == 2 * per_image and out[1].stats[method]["kept"] == per_image


@pytest.mark.parametrize(
    "method, params",
    [
        ("divprune", {"keep": 7}),
        ("cdpruner", {"keep": 3}),
        ("dart", {"pivot_image": 2, "pivot_text": 2, "truncation": 8}),
    ],
)
def test_next_batch_equals_single(method, params, next_mm, images, prompts):
    rec = {"pruning": [{"method": method, "params": params}]}
    batched = next_mm.generate(images[:3], prompts[:3], recipe=rec, max_new_tokens=4)
    single = [next_mm.generate([im], [p], recipe=rec, max_new_tokens=4)[0] for im, p in zip(images[:3], prompts[:3])]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert [r.stats[method]["kept"] for r in batched] == [r.stats[method]["kept"] for r in single]
    if method == "divprune":  # before the LLM: 7 tokens of the packed sequence enter it
        assert [r.n_vision_tokens for r in batched] == [7, 7, 7]
    elif method == "cdpruner":  # 3 per tile plus the row separators
        assert all(r.n_vision_tokens < 40 for r in batched)
    else:  # in the LLM: all tokens enter, fewer after layer K
        assert all(r.vision_tokens_layer_avg < r.n_vision_tokens for r in batched)


def _dart_rule(feats, key_l1, image: list[int], text: list[int], pi: int, pt: int, per: int, order=None) -> list[int]:
    """DART's rule on lists (as ``_dart_reference`` after its forward): pivots by key norm, then each pivot's
    ``per`` least cosine-similar image tokens not chosen yet; ``order``: a function of the pivots' list."""
    img_piv = sorted(image, key=lambda t: -float(key_l1[t]))[:pi]
    txt_piv = sorted(text, key=lambda t: -float(key_l1[t]))[:pt]
    valid, kept = [t for t in image if t not in img_piv], set(img_piv)
    for p in sorted(img_piv + txt_piv) if order is None else order(img_piv + txt_piv):
        sims = {
            t: float(torch.nn.functional.cosine_similarity(feats[p].double(), feats[t].double(), dim=0)) for t in valid
        }
        picked = sorted(valid, key=lambda t: sims[t])[:per]
        kept.update(picked)
        valid = [t for t in valid if t not in picked]
    return sorted(kept)


@pytest.mark.parametrize("seed", range(6))
def test_dart_fixed_shape_selection_equals_the_rule(seed):
    """The per-image selection (``dart_keep``: masks and -inf top-k in fixed shapes, no host read, in slot order)
    keeps what DART's rule keeps, with fewer image or text tokens than pivots, picks running out of candidates and
    no picks at all; with ``seq_index`` (the release's preset) in the release's set order of the pivots."""
    from mmfast.pruning.dart import dart_keep

    g = torch.Generator().manual_seed(seed)
    t_len = 40
    feats, key_l1 = torch.randn(t_len, 8, generator=g), torch.rand(t_len, generator=g)
    seq_index = torch.randperm(t_len, generator=g) + 3  # each slot's sequence index (the release's set keys)
    for n_img, n_txt, pi, pt, per in [
        (16, 6, 2, 2, 3),
        (3, 6, 4, 2, 1),
        (16, 2, 2, 4, 2),
        (9, 5, 2, 2, 5),
        (12, 4, 3, 3, 0),
    ]:
        perm = torch.randperm(t_len, generator=g)
        image, text = torch.zeros(t_len, dtype=torch.bool), torch.zeros(t_len, dtype=torch.bool)
        image[perm[:n_img]], text[perm[n_img : n_img + n_txt]] = True, True
        img, txt = image.nonzero().squeeze(1).tolist(), text.nonzero().squeeze(1).tolist()

        def release(pivots: list[int]) -> list[int]:
            slot_of = {int(seq_index[p]): p for p in pivots}
            return [slot_of[i] for i in set(slot_of)]

        for idx, order in ((None, None), (seq_index, release)):
            got = dart_keep(feats, key_l1, image, text, pi, pt, per, seq_index=idx).nonzero().squeeze(1).tolist()
            assert got == _dart_rule(feats, key_l1, img, txt, pi, pt, per, order), (n_img, n_txt, pi, pt, per, idx)
