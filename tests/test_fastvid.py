"""FastVID (mmfast/pruning/fastvid.py): the kept tokens, merged tokens and frame attention equal direct
ports of the release's code (LunarShen/FastVID @a40a109, fastvid_qwen25vl) on the same tensors; the no-op
setting is the baseline; batch equals per sample; kept tokens keep their (t, h, w) ids; budgets; an
image-only batch and OneVision without ``siglip_head`` are refused before compute (Qwen3-VL videos:
tests/test_video_items.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mmfast
from mmfast.config import load_recipe
from mmfast.errors import ConfigError, IncompatibleRecipeError
from mmfast.models.base import VIDEO
from mmfast.pipeline import Session
from mmfast.pruning._fastvid_ops import FastVIDParams, select_video, select_video_ov

_MODELS: dict[str, object] = {}
RELEASE = dict(retention_ratio=0.27, c=8, tau=0.84, ignore=0.95, d=0.4, p=4, beta=0.6)


def _mm(family: str):
    if family not in _MODELS:
        from mmfast.models.factory import LlavaShape, random_llava_onevision, random_qwen_vl

        if family == "llava_onevision":  # a 12 x 12 patch grid: 36 pooled tokens per frame
            model, proc = random_llava_onevision(LlavaShape(image_size=48, patch_size=4), seed=1)
        else:
            model, proc = random_qwen_vl(family, seed=1)
        _MODELS[family] = mmfast.load(model, proc)
    return _MODELS[family]


@pytest.fixture(scope="module")
def siglip_head(tmp_path_factory) -> str:
    """A SigLIP checkpoint of the OneVision tower's width with a (random) attention-pooling head."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    tower = _mm("llava_onevision").adapter.vision_config
    cfg = SiglipVisionConfig(**{**tower.to_dict(), "vision_use_head": True})
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("siglip")
    SiglipVisionModel(cfg).save_pretrained(path)
    return str(path)


def _video(n: int, seed: int = 0, size: int = 28) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, size, size, 3), dtype=np.uint8)


def _recipe(**params) -> dict:
    return {"pruning": [{"method": "fastvid", "params": params}]}


# -- the release's code, ported line by line (Qwen2_5_VLForConditionalGeneration.forward, seq_length > 1) ---
def _release_prune(video_hidden_states, frame_attn_weights, frame_global_features, cfg):
    """``video_hidden_states`` [F, n, d]; returns (keep_indexs relative to the video's first slot, vision_tokens)."""
    frame_num, frm_len = frame_attn_weights.shape
    device_type = video_hidden_states.device
    keep_indexs = ()
    frame_global_features = frame_global_features / frame_global_features.norm(dim=1, keepdim=True)
    similarity_matrix = (frame_global_features[:-1] * frame_global_features[1:]).sum(dim=1)
    cut_indices = torch.topk(similarity_matrix, cfg["c"] - 1, largest=False).indices
    cos_indices = torch.nonzero(similarity_matrix < cfg["tau"]).squeeze(1)
    cut_indices = torch.unique(torch.cat([cut_indices, cos_indices]))
    cut_indices = cut_indices.sort().values
    segment_sizes = [cut_indices[0].item() + 1]
    for i in range(1, cut_indices.shape[0]):
        segment_sizes.append(cut_indices[i].item() - cut_indices[i - 1].item())
    segment_sizes.append(frame_num - cut_indices[-1].item() - 1)
    segments_hidden_states = torch.split(video_hidden_states, segment_sizes)
    segments_attn_weights = torch.split(frame_attn_weights, segment_sizes)
    segments_global_features = torch.split(frame_global_features, segment_sizes)
    vision_tokens = []
    frame_retain_num = int(frm_len * cfg["retention_ratio"])
    seg_index_start = 0
    for seg_i in range(len(segment_sizes)):
        cur_hidden_states = segments_hidden_states[seg_i]
        cur_attn_weights = segments_attn_weights[seg_i]
        cur_global_features = segments_global_features[seg_i]
        cur_seg_len, frm_len = cur_attn_weights.shape
        seg_retain_num = frame_retain_num * cur_seg_len
        seg_context_num = max(int(seg_retain_num * cfg["d"]), 1)
        seg_salient_num = seg_retain_num - seg_context_num
        if cur_seg_len == 1:
            frm_salient_num = [seg_salient_num]
            frm_context_num = [seg_context_num]
        else:
            cur_global_similarity_matrix = (cur_global_features[:-1] * cur_global_features[1:]).sum(dim=1)
            cur_cut_indices = torch.nonzero(cur_global_similarity_matrix < cfg["ignore"]).squeeze(1)
            cur_cut_indices = cur_cut_indices.sort().values
            if cur_cut_indices.shape[0] > 0:
                cur_segment_sizes = [cur_cut_indices[0].item() + 1]
                for i in range(1, cur_cut_indices.shape[0]):
                    cur_segment_sizes.append(cur_cut_indices[i].item() - cur_cut_indices[i - 1].item())
                cur_segment_sizes.append(cur_seg_len - cur_cut_indices[-1].item() - 1)
            else:
                cur_segment_sizes = [cur_seg_len]
            valid_seg_len = len(cur_segment_sizes)
            chunk_size = seg_salient_num // valid_seg_len
            remainder = seg_salient_num % valid_seg_len
            frm_salient_num = [chunk_size + (1 if i < remainder else 0) for i in range(valid_seg_len)]
            temp_num = (valid_seg_len + cfg["p"] - 1) // cfg["p"]
            chunk_size = seg_context_num // temp_num
            remainder = seg_context_num % temp_num
            temp_context_num = [chunk_size + (1 if i < remainder else 0) for i in range(temp_num)]
            tmp_ctx_idx = 0
            frm_context_num = []
            for tmp_i in range(valid_seg_len):
                if tmp_i % cfg["p"] == 0:
                    frm_context_num.append(min(temp_context_num[tmp_ctx_idx], frm_len // 2))
                    if temp_context_num[tmp_ctx_idx] + frm_context_num[-1] > frm_len:
                        temp_context_num[tmp_ctx_idx] = frm_len - frm_context_num[-1]
                    tmp_ctx_idx += 1
                else:
                    frm_context_num.append(0)
            frm_context_num.reverse()
            valid_frm_salient_num = []
            valid_frm_context_num = []
            for j in range(valid_seg_len):
                valid_frm_salient_num.extend([0] * (cur_segment_sizes[j] - 1))
                valid_frm_context_num.extend([0] * (cur_segment_sizes[j] - 1))
                if frm_context_num[j] == 0:
                    valid_frm_salient_num.append(min(frm_salient_num[j], frm_len))
                    valid_frm_context_num.append(0)
                elif frm_context_num[j] > 0:
                    valid_frm_context_num.append(min(frm_context_num[j], frm_len // 2))
                    valid_frm_salient_num.append(min(frm_salient_num[j], frm_len - valid_frm_context_num[-1]))
                else:
                    valid_frm_salient_num.append(frm_len - int(frm_len * cfg["d"]))
                    valid_frm_context_num.append(int(frm_len * cfg["d"]))
            frm_salient_num = valid_frm_salient_num
            frm_context_num = valid_frm_context_num
        cur_salient_indexs = []
        cur_context_indexs = []
        for frame_i in range(cur_seg_len):
            if frm_salient_num[frame_i] > 0:
                frm_top_indexes = torch.topk(cur_attn_weights[frame_i], frm_salient_num[frame_i]).indices
            else:
                frm_top_indexes = None
            if frm_context_num[frame_i] > 0:
                frm_all_indexs = torch.arange(frm_len, device=device_type)
                if frm_top_indexes is not None:
                    tmp_mask = torch.isin(frm_all_indexs, frm_top_indexes)
                    remaining_indexs = frm_all_indexs[~tmp_mask]
                else:
                    remaining_indexs = frm_all_indexs
                tmp_frm_hidden_states = cur_hidden_states[frame_i]
                tmp_frm_hidden_states = tmp_frm_hidden_states[remaining_indexs].unsqueeze(0)
                _, tmp_N, tmp_D = tmp_frm_hidden_states.shape
                dist_matrix = torch.cdist(tmp_frm_hidden_states.float(), tmp_frm_hidden_states.float()) / (tmp_D**0.5)
                dist_nearest, index_nearest = torch.topk(dist_matrix, k=4, dim=-1, largest=False)
                density = (-(dist_nearest**2).mean(dim=-1)).exp()
                density = density + torch.rand(density.shape, device=device_type, dtype=density.dtype) * 1e-6
                mask = density[:, None, :] > density[:, :, None]
                mask = mask.type(tmp_frm_hidden_states.dtype)
                dist_max = dist_matrix.flatten(1).max(dim=-1)[0][:, None, None]
                dist, index_parent = (dist_matrix * mask + dist_max * (1 - mask)).min(dim=-1)
                score = dist * density
                _, sampled_indexs = torch.topk(score, k=frm_context_num[frame_i], dim=-1)
                sampled_indexs = sampled_indexs[0].sort().values
                frm_context_indexes = remaining_indexs[sampled_indexs]
            else:
                frm_context_indexes = None
            if frm_top_indexes is not None:
                cur_salient_indexs.append(frm_top_indexes + frame_i * frm_len)
            if frm_context_indexes is not None:
                cur_context_indexs.append(frm_context_indexes + frame_i * frm_len)
        cur_tome_hidden_states = cur_hidden_states.reshape(cur_seg_len * frm_len, -1)
        cur_salient_indexs = torch.cat(cur_salient_indexs)
        cur_salient_hidden_states = cur_tome_hidden_states[cur_salient_indexs]
        cur_all_indexs = torch.arange(cur_seg_len * frm_len, device=device_type)
        cur_tome_tokens = cur_tome_hidden_states / cur_tome_hidden_states.norm(dim=-1, keepdim=True)
        cur_context_hidden_states = []
        for tmp_context_indexs in cur_context_indexs:
            tmp_retain_index = torch.cat([cur_salient_indexs, tmp_context_indexs])
            tmp_mask = torch.isin(cur_all_indexs, tmp_retain_index)
            tmp_merge_indexs = cur_all_indexs[~tmp_mask]
            tmp_target_tokens = cur_tome_tokens[tmp_context_indexs]
            tmp_to_merge_tokens = cur_tome_tokens[tmp_merge_indexs]
            similarity = torch.mm(tmp_to_merge_tokens, tmp_target_tokens.T)
            assign_one_hot = torch.zeros(
                tmp_to_merge_tokens.shape[0], tmp_context_indexs.shape[0], dtype=cur_hidden_states.dtype
            )
            assign_one_hot.scatter_(1, similarity.argmax(dim=1).unsqueeze(-1), 1)
            avg_weights = (1 / (assign_one_hot.sum(dim=0).unsqueeze(-1) + 1)).clamp(min=cfg["beta"])
            counts = assign_one_hot.sum(dim=0).clamp(min=1).unsqueeze(-1)
            hidden_to_merge = cur_tome_hidden_states[tmp_merge_indexs]
            aggregated_hidden = torch.mm(assign_one_hot.T, hidden_to_merge) / counts
            target_hidden = cur_tome_hidden_states[tmp_context_indexs]
            target_hidden = avg_weights * target_hidden + (1 - avg_weights) * aggregated_hidden
            cur_context_hidden_states.append(target_hidden)
        cur_context_indexs = torch.cat(cur_context_indexs)
        cur_context_hidden_states = torch.cat(cur_context_hidden_states, dim=0)
        cur_index_combined = torch.cat([cur_salient_indexs, cur_context_indexs])
        cur_hidden_combined = torch.cat([cur_salient_hidden_states, cur_context_hidden_states], dim=0)
        sorted_indexs = torch.argsort(cur_index_combined)
        vision_tokens.append(cur_hidden_combined[sorted_indexs])
        keep_indexs += (cur_index_combined[sorted_indexs] + seg_index_start,)
        seg_index_start = seg_index_start + cur_seg_len * frm_len
    return torch.cat(keep_indexs), torch.cat(vision_tokens, dim=0)


def _release_frame_attention(q, k, grid_t, grid_h, grid_w, num_heads):
    """``Qwen2_5_VLVisionFlashAttention2.forward``'s weights: q / k [S, H, D] after the vision RoPE, tower order."""
    q_attn, k_attn = q.transpose(0, 1), k.transpose(0, 1)
    q_attn = q_attn.reshape(num_heads, grid_t, grid_h * grid_w, -1).mean(-2, keepdim=True)
    k_attn = k_attn.reshape(num_heads, grid_t, grid_h * grid_w // 4, 4, -1).mean(-2)
    attn_weights = torch.matmul(q_attn, k_attn.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q_attn.dtype)
    return attn_weights.mean(2).mean(0)  # [T, hw / 4], tower (window) order of the units


def _video_tensors(n_frames: int, n: int, dim: int, seed: int):
    """Frames in runs of near-duplicates (so DySeg, the ignore rule and DTM's anchors all act)."""
    g = torch.Generator().manual_seed(seed)
    runs, frames = [3, 1, 5, 2, 4, 1, 6, 2], []
    for r in runs:
        base = torch.randn(n, dim, generator=g)
        frames += [base + 0.05 * i * torch.randn(n, dim, generator=g) for i in range(r)]
    video = torch.stack(frames[:n_frames])
    attn = torch.rand(n_frames, n, generator=g).softmax(-1)
    return video, attn, video.mean(1)


@pytest.mark.parametrize(
    ("n_frames", "n", "cfg"),
    [
        (16, 16, RELEASE),
        (24, 36, RELEASE),
        (24, 36, {**RELEASE, "c": 3, "tau": 0.3, "ignore": 0.999, "p": 2}),  # long segments, many anchors
        (12, 64, {**RELEASE, "retention_ratio": 0.1, "d": 0.6, "ignore": 0.9, "p": 1}),
        # every frame its own sub-segment, large context shares: the n // 2 and n caps bind
        (16, 16, {**RELEASE, "retention_ratio": 0.9, "d": 0.9, "c": 2, "tau": -1.0, "ignore": 2.0}),
    ],
)
def test_selection_and_merge_equal_the_release(n_frames, n, cfg):
    video, attn, glob = _video_tensors(n_frames, n, 24, seed=n_frames + n)
    torch.manual_seed(7)  # the release's noise comes from the global RNG
    want_idx, want_tok = _release_prune(video, attn, glob, cfg)
    got_idx, got_tok = select_video(video, attn, glob, FastVIDParams(**cfg), torch.Generator().manual_seed(7))
    assert torch.equal(got_idx, want_idx)
    torch.testing.assert_close(got_tok, want_tok, rtol=1e-5, atol=1e-6)
    assert got_idx.numel() < n_frames * n
    merged = ~torch.isclose(got_tok, video.reshape(-1, video.shape[-1])[got_idx]).all(1)
    assert bool(merged.any())  # DTM really merged some context tokens


def _spy(monkeypatch):
    """Record, per call of FastVID.prune_vision, the inputs (embeddings, A) and what it kept."""
    from mmfast.pruning.fastvid import ATTN_EXTRA, FastVID

    calls = []
    original = FastVID.prune_vision

    def spy(self, vision, batch):
        attn = list(vision.extras[ATTN_EXTRA])
        emb = [p.clone() for p in self.adapter.project(vision)]
        grids = list(vision.extras["grid_thw"])
        out = original(self, vision, batch)
        kept = [(p.clone(), ids.clone()) for p, ids in zip(out.projected, out.patch_ids)]
        calls.append((attn, emb, grids, kept, self.config))
        return out

    monkeypatch.setattr(FastVID, "prune_vision", spy)
    return calls


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_in_the_model_the_release_rule_on_the_models_tensors(family, monkeypatch):
    """On the model: A equals the release's weights from the last block's q / k (captured from the block's
    own input, RoPE'd by transformers' function, window order put back), and the kept ids / tokens equal
    the release's selection on the merger's output with that A."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qm

    from mmfast.pruning import _received

    mm = _mm(family)
    block = mm.adapter.vision_layers[-1].attn
    seen = []
    handle = block.register_forward_pre_hook(lambda m, a, kw: seen.append((a, kw)), with_kwargs=True)
    calls = _spy(monkeypatch)
    cfg = {**RELEASE, "retention_ratio": 0.5, "c": 2, "tau": 0.0, "ignore": 2.0}  # 2 segments, one of 3 frames
    try:
        mm.generate(None, ["Describe."], videos=[_video(8)], recipe=_recipe(**cfg), max_new_tokens=2)
    finally:
        handle.remove()
    (attn, emb, grids, kept, _), (args, kw) = calls[0], seen[0]
    hidden = args[0] if args else kw["hidden_states"]
    cos, sin = kw["position_embeddings"]
    heads = block.num_heads
    with torch.inference_mode():
        q, k, _ = block.qkv(hidden).reshape(hidden.shape[0], 3, heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = qm.apply_rotary_pos_emb_vision(q, k, cos, sin)
    t, h, w = grids[0]
    want = _release_frame_attention(q.double(), k.double(), t, h * 2, w * 2, heads)  # [T, n] tower order
    order = _received.window_order(mm.adapter.vision_tower, grids, mm.adapter.merge)
    if order is not None:  # Qwen2.5-VL: the release's reverse_indices over the flattened weights
        want = want.reshape(-1)[torch.argsort(order)].reshape(t, -1)
    torch.testing.assert_close(attn[0].double(), want, rtol=1e-4, atol=1e-6)
    video = emb[0].reshape(t, h * w, -1)
    torch.manual_seed(0)  # seed 0: the method's generator
    want_idx, want_tok = _release_prune(video, attn[0], video.mean(1), cfg)
    got_tok, got_ids = kept[0]
    assert torch.equal(got_ids.cpu(), want_idx) and want_idx.numel() < t * h * w
    assert not torch.allclose(want_tok, video.reshape(t * h * w, -1)[want_idx])  # DTM merged context tokens
    torch.testing.assert_close(got_tok, want_tok.to(got_tok.dtype), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_noop_setting_reproduces_the_baseline(family):
    mm = _mm(family)
    kw = dict(videos=[_video(8)], max_new_tokens=6)
    base = mm.generate(None, ["Describe."], **kw)[0]
    noop = mm.generate(None, ["Describe."], recipe=_recipe(retention_ratio=1.0, tau=2.0, beta=1.0), **kw)[0]
    assert noop.token_ids == base.token_ids and noop.n_vision_tokens == base.n_vision_tokens
    pruned = mm.generate(None, ["Describe."], recipe=_recipe(retention_ratio=0.5), **kw)[0]
    assert pruned.n_vision_tokens < base.n_vision_tokens


def test_batch_of_two_videos_equals_per_sample(monkeypatch):
    mm = _mm("qwen2_5_vl")
    prompts, videos = ["Describe.", "What happens here?"], [_video(8, 1), _video(6, 2)]
    batch = mm.generate(None, prompts, videos=videos, recipe=_recipe(retention_ratio=0.4), max_new_tokens=5)
    for i in range(2):
        alone = mm.generate(
            None, [prompts[i]], videos=[videos[i]], recipe=_recipe(retention_ratio=0.4), max_new_tokens=5
        )
        assert batch[i].token_ids == alone[0].token_ids
        assert batch[i].n_vision_tokens == alone[0].n_vision_tokens < (64 if i == 0 else 48)


def test_kept_tokens_keep_their_positions():
    """A video + an image: the image is untouched, every kept video token keeps its unpruned (t, h, w)
    ids, the text after keeps its positions."""
    from PIL import Image

    mm = _mm("qwen2_5_vl")
    image = Image.fromarray(np.random.default_rng(5).integers(0, 255, (36, 44, 3), dtype=np.uint8))
    args, kw = ([image], ["What?"]), dict(videos=[_video(8)], video_fps=1.0)
    built = []
    for recipe in ({}, _recipe(retention_ratio=0.4)):
        with Session(mm, load_recipe(recipe)) as s:
            batch = mm.prepare(*args, **kw)
            built.append(s.build_inputs(batch, s.encode(batch)))
    base, pruned = built
    vb, vp = base.image_mask[0], pruned.image_mask[0]
    key = lambda x, m: list(zip(x.image_index[0][m].tolist(), x.patch_ids[0][m].tolist()))  # noqa: E731
    where = dict(zip(key(base, vb), base.position_ids[0][vb].tolist()))
    assert [where[k] for k in key(pruned, vp)] == pruned.position_ids[0][vp].tolist()
    video_b, video_p = base.tags[VIDEO][0] > 0, pruned.tags[VIDEO][0] > 0
    assert 0 < int(video_p.sum()) < int(video_b.sum())
    assert int((vp & ~video_p).sum()) == int((vb & ~video_b).sum())  # the image keeps every token
    n_after = int(base.text_after_image[0].sum())
    assert torch.equal(pruned.position_ids[0, -n_after:], base.position_ids[0, -n_after:])


def test_budget_keeps_at_most_its_target_per_video():
    mm = _mm("qwen2_5_vl")
    kw = dict(videos=[_video(8)], max_new_tokens=2)  # 4 frame groups of 16 merged tokens
    for budget, most in (({"tokens": 24}, 24), ({"ratio": 0.25}, 16)):
        recipe = {"pruning": [{"method": "fastvid", "params": {"tau": 2.0}, "budget": budget}]}
        out = mm.generate(None, ["Describe."], recipe=recipe, **kw)[0]
        assert out.n_vision_tokens == 4 * (most // 4)  # one-frame segments: int(B / F) per frame
    out = mm.generate(None, ["Describe."], recipe={"pruning": [{"method": "fastvid", "budget": {"tokens": 24}}]}, **kw)
    assert 0 < out[0].n_vision_tokens <= 24


def test_a_budget_below_one_token_per_frame_is_refused_and_one_per_frame_keeps_one():
    """4 frame groups of 16: below 4 tokens a frame keeps int(16 B / 64) = 0 and the release's segments
    would each keep a context token (more than B); refused, naming the smallest budget. At 4 each keeps
    one, also on a grid where B / N alone rounds int(n B / N) down (7 x 7 per frame: int(49 x 2 / 98) = 0)."""
    mm = _mm("qwen2_5_vl")
    recipe = lambda b: {"pruning": [{"method": "fastvid", "params": {"tau": 2.0}, "budget": {"tokens": b}}]}  # noqa: E731
    kw = dict(videos=[_video(8)], max_new_tokens=1)
    for b in (1, 3):
        with pytest.raises(ConfigError, match="keeps int\\(16 x .*\\) = 0 .*at least 4 tokens") as exc:
            mm.generate(None, ["Describe."], recipe=recipe(b), **kw)
        assert exc.value.path == "pruning[0].budget.tokens"
    assert mm.generate(None, ["Describe."], recipe=recipe(4), **kw)[0].n_vision_tokens == 4
    with pytest.raises(ConfigError, match="params.retention_ratio.*at least 1 / 16"):
        mm.generate(None, ["Describe."], recipe=_recipe(retention_ratio=0.05), **kw)
    big = dict(videos=[_video(4, size=56)], max_new_tokens=1)  # 2 frame groups of 7 x 7 merged tokens
    assert mm.generate(None, ["Describe."], recipe=recipe(2), **big)[0].n_vision_tokens == 2


# -- the release's OneVision variant (fastvid_llavaonevision: modeling_qwen2.py Qwen2Model.forward, seq_length > 1) --
def _release_prune_ov(video_hidden_states, frame_attn_weights, frame_global_features, cfg):
    """``video_hidden_states`` [F, T, d]; returns (keep_indexs relative to the video's first slot, tokens)."""
    frame_num, frame_token_len, hidden_states_dim = video_hidden_states.shape
    device_type = video_hidden_states.device
    batchframe_indices = torch.arange(frame_num).unsqueeze(1)
    alltoken_indices = torch.arange(frame_num * frame_token_len).view(frame_num, frame_token_len)
    frame_global_features = frame_global_features / frame_global_features.norm(dim=1, keepdim=True)
    similarity_matrix = (frame_global_features[:-1] * frame_global_features[1:]).sum(dim=1)
    cut_indices_topk = torch.topk(similarity_matrix, cfg["c"] - 1, largest=False).indices
    cut_indices_cos = torch.nonzero(similarity_matrix < cfg["tau"], as_tuple=False).squeeze(1)
    cut_indices = torch.unique(torch.cat([cut_indices_topk, cut_indices_cos])).sort().values
    padded = F.pad(cut_indices, (1, 1), value=-1)
    padded[-1] = frame_num - 1
    segment_sizes = padded.diff().tolist()
    keep_indexs, final_tokens = (), []
    frame_retain_num = int(frame_token_len * cfg["retention_ratio"])
    frame_salient_num = frame_retain_num - int(frame_retain_num * cfg["d"])
    frm_context_num_list = torch.zeros(frame_num, dtype=torch.int)
    frame_context_num = frame_retain_num - frame_salient_num
    offset = 0
    for seg_i_len in segment_sizes:
        seg_context_num = frame_context_num * seg_i_len
        temp_num = (seg_i_len + cfg["p"] - 1) // cfg["p"]
        cur_frm_context_num = seg_context_num // temp_num
        end = offset + seg_i_len
        seg_indices = torch.arange(seg_i_len - 1, -1, -1)
        mask = seg_indices % cfg["p"] == 0
        frm_context_num_list[offset:end][mask] = cur_frm_context_num
        offset = end
    salient_indexes = torch.topk(frame_attn_weights, frame_salient_num, dim=1).indices
    batch_indices = batchframe_indices.expand(-1, frame_salient_num)
    salient_tokens = video_hidden_states[batch_indices, salient_indexes]
    salient_global_indexes = alltoken_indices[batch_indices, salient_indexes]
    final_tokens.append(salient_tokens.view(-1, hidden_states_dim))
    keep_indexs += (salient_global_indexes.view(-1),)
    all_indices = torch.arange(frame_token_len).unsqueeze(0).expand(frame_num, -1)
    all_indices_mask = torch.ones_like(all_indices, dtype=torch.bool)
    all_indices_mask.scatter_(1, salient_indexes, False)
    filtered_indices = all_indices[all_indices_mask].view(frame_num, frame_token_len - frame_salient_num)
    batch_indices = batchframe_indices.expand(-1, frame_token_len - frame_salient_num)
    token_filtered = video_hidden_states[batch_indices, filtered_indices]
    alltoken_filtered_indices = alltoken_indices[batch_indices, filtered_indices]
    tmp_frm_hidden_states = token_filtered
    dist_matrix = torch.cdist(tmp_frm_hidden_states.float(), tmp_frm_hidden_states.float()) / (hidden_states_dim**0.5)
    dist_nearest, index_nearest = torch.topk(dist_matrix, k=4, dim=-1, largest=False)
    density = (-(dist_nearest**2).mean(dim=-1)).exp()
    density = density + torch.rand(density.shape, device=device_type, dtype=density.dtype) * 1e-6
    density_mask = density[:, None, :] > density[:, :, None]
    density_mask = density_mask.type(tmp_frm_hidden_states.dtype)
    dist_max = dist_matrix.flatten(1).max(dim=-1)[0][:, None, None]
    dist_0, index_parent = (dist_matrix * density_mask + dist_max * (1 - density_mask)).min(dim=-1)
    density_score = dist_0 * density
    sampled_indexs = torch.topk(density_score, k=frame_context_num, dim=-1).indices
    batch_indices = batchframe_indices.expand(-1, frame_context_num)
    frm_context_tokens = token_filtered[batch_indices, sampled_indexs]
    frm_context_global_indexes = alltoken_filtered_indices[batch_indices, sampled_indexs]
    to_be_merge_tokens = token_filtered / token_filtered.norm(dim=-1, keepdim=True)
    merge_target_tokens = to_be_merge_tokens[batch_indices, sampled_indexs]
    similarity = torch.bmm(to_be_merge_tokens, merge_target_tokens.transpose(1, 2))
    assign_one_hot = torch.zeros(
        frame_num, frame_token_len - frame_salient_num, frame_context_num, dtype=token_filtered.dtype
    )
    assign_one_hot.scatter_(2, similarity.argmax(dim=2).unsqueeze(-1), 1)
    avg_weights = (1 / (assign_one_hot.sum(dim=1).unsqueeze(-1) + 1)).clamp(min=cfg["beta"])
    counts = assign_one_hot.sum(dim=1).clamp(min=1).unsqueeze(-1)
    aggregated_hidden = torch.bmm(assign_one_hot.transpose(1, 2), token_filtered) / counts
    frm_context_tokens = avg_weights * frm_context_tokens + (1 - avg_weights) * aggregated_hidden
    context_for_frame_mask = frm_context_num_list == frame_context_num
    final_tokens.append(frm_context_tokens[context_for_frame_mask].view(-1, hidden_states_dim))
    keep_indexs += (frm_context_global_indexes[context_for_frame_mask].view(-1),)
    idx_seg_start = 0
    for seg_i_len in segment_sizes:
        if seg_i_len > 1:
            cur_seg_context_num_list = frm_context_num_list[idx_seg_start : idx_seg_start + seg_i_len]
            cur_seg_context_num = cur_seg_context_num_list[-1]
            cur_seg_target_mask = cur_seg_context_num_list > frame_context_num
            cur_seg_target_num = cur_seg_target_mask.sum()
            cur_seg_density_score = density_score[idx_seg_start : idx_seg_start + seg_i_len][cur_seg_target_mask]
            cur_seg_token_filtered = token_filtered[idx_seg_start : idx_seg_start + seg_i_len]
            cur_seg_token_target = cur_seg_token_filtered[cur_seg_target_mask]
            cur_seg_token_filtered = cur_seg_token_filtered.view(1, -1, hidden_states_dim).expand(
                cur_seg_target_num, -1, -1
            )
            cur_seg_alltoken_indices = alltoken_filtered_indices[idx_seg_start : idx_seg_start + seg_i_len]
            cur_seg_alltoken_indices = cur_seg_alltoken_indices[cur_seg_target_mask]
            sampled_indexs = torch.topk(cur_seg_density_score, k=int(cur_seg_context_num), dim=-1).indices
            batch_indices = batchframe_indices[:cur_seg_target_num].expand(-1, int(cur_seg_context_num))
            cur_context_tokens = cur_seg_token_target[batch_indices, sampled_indexs]
            cur_context_global_indexes = cur_seg_alltoken_indices[batch_indices, sampled_indexs]
            to_be_merge_tokens = cur_seg_token_filtered / cur_seg_token_filtered.norm(dim=-1, keepdim=True)
            merge_target_tokens = cur_context_tokens / cur_context_tokens.norm(dim=-1, keepdim=True)
            similarity = torch.bmm(to_be_merge_tokens, merge_target_tokens.transpose(1, 2))
            assign_one_hot = torch.zeros(
                int(cur_seg_target_num),
                to_be_merge_tokens.shape[1],
                int(cur_seg_context_num),
                dtype=token_filtered.dtype,
            )
            assign_one_hot.scatter_(2, similarity.argmax(dim=2).unsqueeze(-1), 1)
            avg_weights = (1 / (assign_one_hot.sum(dim=1).unsqueeze(-1) + 1)).clamp(min=cfg["beta"])
            counts = assign_one_hot.sum(dim=1).clamp(min=1).unsqueeze(-1)
            aggregated_hidden = torch.bmm(assign_one_hot.transpose(1, 2), cur_seg_token_filtered) / counts
            cur_context_tokens = avg_weights * cur_context_tokens + (1 - avg_weights) * aggregated_hidden
            final_tokens.append(cur_context_tokens.view(-1, hidden_states_dim))
            keep_indexs += (cur_context_global_indexes.view(-1),)
        idx_seg_start += seg_i_len
    hidden_states, keep_indexs = torch.cat(final_tokens, dim=0), torch.cat(keep_indexs, dim=0)
    sorted_indexs = torch.argsort(keep_indexs)
    return keep_indexs[sorted_indexs], hidden_states[sorted_indexs]


OV_RELEASE = dict(retention_ratio=0.10, c=8, tau=0.9, ignore=0.95, d=0.4, p=4, beta=0.6)  # its eval.sh


@pytest.mark.parametrize(
    ("n_frames", "n", "cfg"),
    [
        (16, 196, OV_RELEASE),  # the release's 196 pooled tokens per frame
        (24, 36, {**OV_RELEASE, "retention_ratio": 0.4}),
        (24, 36, {**OV_RELEASE, "retention_ratio": 0.3, "c": 3, "tau": 0.3, "p": 2}),  # long segments
    ],
)
def test_onevision_selection_and_merge_equal_the_release(n_frames, n, cfg):
    video, attn, glob = _video_tensors(n_frames, n, 24, seed=n_frames + n)
    torch.manual_seed(7)
    want_idx, want_tok = _release_prune_ov(video, attn, glob, cfg)
    got_idx, got_tok = select_video_ov(video, attn, glob, FastVIDParams(**cfg), torch.Generator().manual_seed(7))
    assert torch.equal(got_idx, want_idx)
    torch.testing.assert_close(got_tok, want_tok, rtol=1e-5, atol=1e-6)
    assert got_idx.numel() < n_frames * n
    assert not torch.allclose(got_tok, video.reshape(-1, video.shape[-1])[got_idx])  # DTM merged


def test_onevision_in_the_model_the_release_rule(siglip_head, monkeypatch):
    """OneVision with ``siglip_head``: the kept tokens equal the release's selection on the model's pooled
    frame tokens, with G and A from the release's ``SigLipVisionAbstract`` (post_layernorm + pooling head
    on the tower's features) and ``get_attn_2dPool``; the closing newline stays."""
    from transformers import SiglipVisionModel

    mm = _mm("llava_onevision")
    calls = []
    from mmfast.pruning.fastvid import FastVID

    original = FastVID.prune_vision

    def spy(self, vision, batch):
        before = (vision.features[0].clone(), vision.projected[0].clone())
        out = original(self, vision, batch)
        calls.append((*before, out.projected[0].clone(), out.patch_ids[0].clone()))
        return out

    monkeypatch.setattr(FastVID, "prune_vision", spy)
    cfg = {**OV_RELEASE, "retention_ratio": 0.4, "c": 3, "tau": -1.0}  # 3 segments: multi-frame ones too
    out = mm.generate(
        None, ["Describe."], videos=[_video(8)], recipe=_recipe(siglip_head=siglip_head, **cfg), max_new_tokens=2
    )[0]
    feats, tokens, got, ids = calls[0]
    abstract = SiglipVisionModel.from_pretrained(siglip_head)  # the release's vision abstract
    abstract = getattr(abstract, "vision_model", abstract)
    rows, cols = mm.adapter.grid
    with torch.inference_mode():
        x = abstract.post_layernorm(feats.reshape(8, rows * cols, -1))
        probe = abstract.head.probe.repeat(8, 1, 1)
        pooled, weights = abstract.head.attention(probe, x, x)
        pooled = pooled + abstract.head.mlp(abstract.head.layernorm(pooled))
        attn = F.interpolate(
            weights.view(8, 1, rows, cols), size=[math.ceil(rows / 2), math.ceil(cols / 2)], mode="bilinear"
        )
    n = math.ceil(rows / 2) * math.ceil(cols / 2)
    torch.manual_seed(0)
    want_idx, want_tok = _release_prune_ov(tokens[:-1].reshape(8, n, -1), attn.view(8, n), pooled[:, 0], cfg)
    assert torch.equal(ids[:-1].cpu(), want_idx) and int(ids[-1]) == -1 and want_idx.numel() < 8 * n
    torch.testing.assert_close(got[:-1], want_tok.to(got.dtype), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[-1], tokens[-1])  # the newline
    assert out.n_vision_tokens == want_idx.numel() + 1


def test_onevision_noop_and_batch(siglip_head):
    mm = _mm("llava_onevision")
    kw = dict(videos=[_video(8)], max_new_tokens=5)
    base = mm.generate(None, ["Describe."], **kw)[0]
    noop = _recipe(siglip_head=siglip_head, retention_ratio=1.0, tau=2.0, beta=1.0)
    assert mm.generate(None, ["Describe."], recipe=noop, **kw)[0].token_ids == base.token_ids
    prompts, videos = ["Describe.", "What happens here?"], [_video(8, 1), _video(6, 2)]
    recipe = _recipe(siglip_head=siglip_head, retention_ratio=0.4)
    batch = mm.generate(None, prompts, videos=videos, recipe=recipe, max_new_tokens=5)
    for i in range(2):
        alone = mm.generate(None, [prompts[i]], videos=[videos[i]], recipe=recipe, max_new_tokens=5)[0]
        assert batch[i].token_ids == alone.token_ids
        assert batch[i].n_vision_tokens == alone.n_vision_tokens < (8 if i == 0 else 6) * 36 + 1
    budget = {"pruning": [{"method": "fastvid", "params": {"siglip_head": siglip_head}, "budget": {"tokens": 100}}]}
    kept = mm.generate(None, ["Describe."], recipe=budget, **kw)[0].n_vision_tokens
    assert 8 * int(36 * 100 / 289) + 1 >= kept > 50  # retention 100 / 289 (the newline counts), at most 100


def test_images_only_and_onevision_without_a_head_are_refused():
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(5).integers(0, 255, (36, 44, 3), dtype=np.uint8))
    with pytest.raises(IncompatibleRecipeError, match=r"fastvid.*needs a video.*videos="):
        _mm("qwen2_5_vl").generate([image], ["What?"], recipe=_recipe(), max_new_tokens=2)
    with pytest.raises(
        IncompatibleRecipeError, match=r"fastvid.*\(llava_onevision\).*attention-pooling head.*siglip_head"
    ):
        Session(_mm("llava_onevision"), load_recipe(_recipe()))
    with pytest.raises(IncompatibleRecipeError, match=r"fastvid.*\(qwen2_5_vl\).*leave it unset on Qwen-VL"):
        Session(_mm("qwen2_5_vl"), load_recipe(_recipe(siglip_head="/nonexistent")))
    with pytest.raises(IncompatibleRecipeError, match=r"fastvid.*needs a video.*videos="):  # Qwen3-VL: videos only
        _mm("qwen3_vl").generate([image], ["What?"], recipe=_recipe(), max_new_tokens=2)


DECODER_PARAMS = {"beam": {"num_beams": 2}, "opera": {"num_beams": 2, "num_attn_candidates": 2}}
#: refused on Qwen2.5-VL whatever the pruner (damro: CLS, ritual: family, lqcd: images only)
REFUSED = {"damro", "lqcd", "ritual", "divprune"}


def test_every_decoder_and_a_stacked_pruner_on_a_video():
    """The compatibility matrix feeds images (refused here); on a video batch of 2, FastVID with every
    decoder, and stacked with FastV / after DivPrune (refused: it needs whole frames), generates or is
    refused naming the method."""
    from mmfast.registry import DECODERS

    mm = _mm("qwen2_5_vl")
    kw = dict(videos=[_video(8, 1), _video(6, 2)], max_new_tokens=3)
    stage = _recipe(retention_ratio=0.5)["pruning"]
    recipes = {
        d: {"pruning": stage, "decoding": {"method": d, "params": DECODER_PARAMS.get(d, {})}}
        for d in DECODERS.names()
        if d != "m3id"  # it fails on any video, without FastVID too (see tests/test_dycoke.py)
    }
    recipes["+fastv"] = {"pruning": [*stage, {"method": "fastv", "params": {"k": 3, "drop_ratio": 0.5}}]}
    recipes["divprune"] = {"pruning": [{"method": "divprune", "params": {"ratio": 0.5}}, *stage]}
    refused, problems = set(), []
    for name, recipe in recipes.items():
        try:
            out = mm.generate(None, ["Describe.", "What?"], recipe=recipe, **kw)
        except IncompatibleRecipeError as exc:
            refused.add(name)
            if f"({name})" not in str(exc) and "(fastvid)" not in str(exc):
                problems.append(f"{name}: refusal does not name a method: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - report every combination that crashes
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        assert len(out) == 2 and all(r.n_vision_tokens < n for r, n in zip(out, (64, 48)))
    assert not problems, "\n".join(problems)
    assert refused == REFUSED


def test_static_cache_gives_the_tokens_of_compile_off():
    mm = _mm("qwen2_5_vl")
    kw = dict(videos=[_video(8, 1), _video(6, 2)], max_new_tokens=5)
    tokens = {}
    for mode in ("off", "static"):
        with mmfast.apply(mm, load_recipe(_recipe(retention_ratio=0.5)), compile=mode) as s:
            tokens[mode] = [r.token_ids for r in s.generate(None, ["Describe.", "What?"], **kw)]
    assert tokens["static"] == tokens["off"]


def test_a_siglip_head_path_without_a_head_or_of_another_width_is_refused(tmp_path):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from mmfast.errors import ConfigError

    mm = _mm("llava_onevision")
    tower = mm.adapter.vision_config.to_dict()
    for name, cfg, why in (
        ("nohead", {**tower, "vision_use_head": False}, "has no attention-pooling head"),
        ("wide", {**tower, "vision_use_head": True, "hidden_size": 48}, "has width 48, the model's tower 32"),
    ):
        SiglipVisionModel(SiglipVisionConfig(**cfg)).save_pretrained(tmp_path / name)
        with pytest.raises(ConfigError, match=why):
            Session(mm, load_recipe(_recipe(siglip_head=str(tmp_path / name))))
    with pytest.raises(ConfigError, match="cannot load a SigLIP vision model"):
        Session(mm, load_recipe(_recipe(siglip_head=str(tmp_path / "missing"))))
