"""``preset: release`` for OPERA and beam search: the released code's arithmetic (shikiw/OPERA on
transformers 4.29.2), checked against literal re-computations of its rules written here."""

from __future__ import annotations

import math

import pytest
import torch

from mmfast.config import load_recipe
from mmfast.decoding._opera_penalty import OverTrustHistory, phi_from_log
from mmfast.decoding.beam import BeamSearch
from mmfast.pipeline import Session

# --------------------------------------------------------------------------- fp16 over-trust score


def _literal_fp16_scores(square: torch.Tensor, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The released score loop on a renormalised response map [..., T, T] held in fp16: factors
    ``fp16(sigma * fp16(a))``, each column product rounded to fp16 (CUDA reduces half in higher
    precision; here exactly, in float64), ``1e-7 *`` it rounded to fp16 into an fp16 buffer, max over it."""
    local = (sigma * square.to(torch.float16).float()).to(torch.float16)  # [..., T, T]
    t = local.shape[-1]
    buf = torch.zeros(local.shape[:-1], dtype=torch.float16)  # [..., T]
    for j in range(t):
        prod = local[..., j:, j].double().prod(-1).to(torch.float16)
        buf[..., j] = (1e-7 * prod.float()).to(torch.float16)
    best, loc = buf.float().max(-1)
    return best, loc


def test_fp16_score_matches_literal_release_loop():
    g = torch.Generator().manual_seed(3)
    k, n, t, sigma = 3, 4, 14, 50.0
    logits = torch.randn(k, t + 1, t + 1, generator=g) * 3
    logits[:, :, 2] += torch.tensor([4.5, 1.0, 0.0])[
        :, None
    ]  # an attention sink in column 2: beam 0's product overflows fp16
    hist_rows = torch.softmax(logits.masked_fill(~torch.ones(t + 1, t + 1, dtype=torch.bool).tril(), -math.inf), -1)
    cands = torch.softmax(torch.randn(k, n, t + 1, generator=g) * 3, -1)  # [K, N, t+1]
    hist = OverTrustHistory(k, sigma, torch.device("cpu"), fp16_factors=True)
    for i in range(t):
        hist.append(hist_rows[:, i, : i + 1])
    phi, loc = phi_from_log(hist.candidate_log_scores(cands), fp16_saturation=True)  # [K, N]
    ref_phi = torch.zeros(k, n)
    ref_loc = torch.zeros(k, n, dtype=torch.long)
    saw_inf = saw_zero = saw_finite = False
    for c in range(n):
        square = torch.cat([hist_rows[:, :t], cands[:, c : c + 1]], 1)  # [K, t+1, t+1]
        ref_phi[:, c], ref_loc[:, c] = _literal_fp16_scores(square, sigma)
        local = (sigma * square.to(torch.float16).float()).to(torch.float16)
        for j in range(t + 1):
            p = local[..., j:, j].double().prod(-1).to(torch.float16)
            saw_inf |= bool(torch.isinf(p).any())
            saw_zero |= bool(((1e-7 * p.float()).to(torch.float16) == 0).any())
            saw_finite |= bool(((1e-7 * p.float()).to(torch.float16) > 0).any() & torch.isfinite(p).any())
    assert saw_inf and saw_zero and saw_finite, "the case must hit saturation, underflow and finite scores"
    assert torch.isinf(phi).any() and torch.isfinite(phi).any()  # some candidates excluded, some not
    assert torch.equal(phi, ref_phi)
    assert torch.equal(loc, ref_loc)
    # the exact (fp32 log-space) score differs: finite where the release saturates
    exact_phi, _ = phi_from_log(OverTrustHistory(k, sigma, torch.device("cpu")).candidate_log_scores(cands[..., :1]))
    assert torch.isfinite(exact_phi).all()


# --------------------------------------------------------------------------- beam scorer of 4.29.2


def _logp_fn(seed: int, vocab: int, eos: int, eos_boost: float):
    def logp(prefix: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed((seed * 1_000_003 + hash(tuple(prefix))) % 2**31)
        x = torch.randn(vocab, generator=g, dtype=torch.float64) * 2
        x[eos] += eos_boost
        return torch.log_softmax(x, -1)

    return logp


def _literal_4292(logp, prompt_len: int, k: int, max_new: int, lp: float, eos: int) -> list[int]:
    """transformers 4.29.2 ``beam_search`` + ``BeamSearchScorer`` + ``BeamHypotheses`` for one sample,
    written out on its own ``input_ids`` (the prompt's ``prompt_len`` ids, then the tokens):
    ``process`` sets ``cur_len = input_ids.shape[-1] + 1``; an EOS among the top K ranks ``add``s
    ``input_ids`` (without the EOS), scored ``sum_logprobs / hyp.shape[-1] ** lp``; ``is_done(best of
    the 2K scores, cur_len)`` with ``early_stopping=False``: ``worst_score >= best / cur_len ** lp``;
    ``finalize`` adds the running ``input_ids`` of an unfinished sample."""
    prompt = [-1] * prompt_len  # stand-ins for the prompt's ids: only their number matters
    input_ids = [list(prompt) for _ in range(k)]
    beam_scores = [0.0] + [-1e9] * (k - 1)
    hyps: list[tuple[float, list[int]]] = []
    worst = 1e9
    done = False

    def add(hyp: list[int], s: float) -> None:
        nonlocal worst
        score = s / len(hyp) ** lp
        if len(hyps) < k or score > worst:
            hyps.append((score, hyp))
            if len(hyps) > k:
                ranked = sorted((sc, i) for i, (sc, _) in enumerate(hyps))
                del hyps[ranked[0][1]]
                worst = ranked[1][0]
            else:
                worst = min(score, worst)

    for _ in range(max_new):  # max_length = prompt_len + max_new
        scores = torch.stack([beam_scores[i] + logp(input_ids[i][prompt_len:]) for i in range(k)])  # [K, V] float64
        vocab = scores.shape[1]
        top_s, top_i = scores.view(-1).topk(2 * k)
        cur_len = len(input_ids[0]) + 1
        nxt = []
        for rank, (s, idx) in enumerate(zip(top_s.tolist(), top_i.tolist())):
            b, tok = divmod(idx, vocab)
            if tok == eos:
                if rank >= k:
                    continue
                add(list(input_ids[b]), s)
            else:
                nxt.append((s, input_ids[b] + [tok]))
            if len(nxt) == k:
                break
        if len(hyps) >= k and worst >= max(top_s.tolist()) / cur_len**lp:
            done = True
        beam_scores = [s for s, _ in nxt]
        input_ids = [seq for _, seq in nxt]
        if done:
            break
    if not done:  # finalize: the running beams at the length limit
        for s, seq in zip(beam_scores, input_ids):
            add(seq, s)
    return sorted(hyps, key=lambda x: x[0])[-1][1][prompt_len:]


def _ours(logp, prompt_len, k, max_new, lp, eos, release: bool) -> list[int]:
    search = BeamSearch(
        1, k, max_new, lp, torch.device("cpu"), prompt_len=torch.tensor([prompt_len]) if release else None
    )
    while True:
        lps = torch.stack([logp(row) for row in search.running_tokens[0].tolist()]).float()  # [K, V]
        search.step(lps, torch.tensor([eos]))
        if search.done:
            break
    out = search.best()[0]
    return out[:-1] if out and out[-1] == eos else out


@pytest.mark.parametrize("lp", [1.0, 2.0])
def test_beam_release_equals_literal_transformers_4292(lp):
    differs = 0
    for seed in range(12):
        logp = _logp_fn(seed, vocab=7, eos=0, eos_boost=0.5)
        prompt_len, k, max_new = 20 + seed, 3, 9
        literal = _literal_4292(logp, prompt_len, k, max_new, lp, eos=0)
        assert _ours(logp, prompt_len, k, max_new, lp, 0, release=True) == literal, seed
        differs += _ours(logp, prompt_len, k, max_new, lp, 0, release=False) != literal
    assert differs > 0, "the cases must tell prompt + generated normalisation from generated-length normalisation"


@pytest.mark.parametrize("prompt_len", [1, 2])
def test_beam_release_early_stop_at_short_prompts(prompt_len):
    """At a short prompt the early-stop length matters: ``is_done`` divides the best candidate by
    ``cur_len`` = prompt + generated (not prompt + generated - 1, the finished hypotheses' length)."""
    for seed in range(40):
        logp = _logp_fn(100 + seed, vocab=6, eos=0, eos_boost=1.5)
        literal = _literal_4292(logp, prompt_len, 3, 8, 1.0, eos=0)
        assert _ours(logp, prompt_len, 3, 8, 1.0, 0, release=True) == literal, seed


# --------------------------------------------------------------------------- the presets end to end


def _gen(mm, images, prompts, method, params, n):
    with Session(mm, load_recipe({"decoding": {"method": method, "params": params}})) as s:
        return [r.token_ids for r in s.generate(images, prompts, max_new_tokens=n)]


def test_beam_release_preset_uses_prompt_length(tiny_mm, images, prompts, monkeypatch):
    import mmfast.decoding.beam as beam_mod

    seen = []
    real = beam_mod.BeamSearch

    class Spy(real):
        def __init__(self, *a, prompt_len=None, **kw):
            seen.append(None if prompt_len is None else prompt_len.tolist())
            super().__init__(*a, prompt_len=prompt_len, **kw)

    monkeypatch.setattr(beam_mod, "BeamSearch", Spy)
    batch = tiny_mm.prepare(images[:2], prompts[:2])
    out = _gen(tiny_mm, images[:2], prompts[:2], "beam", {"num_beams": 3, "preset": "release"}, 6)
    assert seen == [[len(ids) for ids in batch.token_ids]]  # one placeholder per image, BOS included
    single = [
        _gen(tiny_mm, [im], [p], "beam", {"num_beams": 3, "preset": "release"}, 6)[0]
        for im, p in zip(images[:2], prompts[:2])
    ]
    assert out == single


def test_opera_release_preset_runs_fp16_and_release_scorer(tiny_mm, images, prompts, monkeypatch):
    import mmfast.decoding.opera as opera_mod

    calls = {"fp16": [], "plen": []}
    real_phi = opera_mod.phi_from_log

    def spy_phi(log_phi, fp16_saturation=False):
        calls["fp16"].append(fp16_saturation)
        return real_phi(log_phi, fp16_saturation)

    monkeypatch.setattr(opera_mod, "phi_from_log", spy_phi)
    real_bs = opera_mod.BeamSearch

    class Spy(real_bs):
        def __init__(self, *a, prompt_len=None, **kw):
            calls["plen"].append(None if prompt_len is None else prompt_len.tolist())
            super().__init__(*a, prompt_len=prompt_len, **kw)

    monkeypatch.setattr(opera_mod, "BeamSearch", Spy)
    params = {"num_beams": 2, "num_attn_candidates": 2, "preset": "release"}
    _gen(tiny_mm, images[:1], prompts[:1], "opera", params, 14)
    assert calls["fp16"] and all(calls["fp16"])
    assert calls["plen"] == [[len(tiny_mm.prepare(images[:1], prompts[:1]).token_ids[0])]]
    calls["fp16"].clear()
    calls["plen"].clear()
    _gen(tiny_mm, images[:1], prompts[:1], "opera", {**params, "preset": "exact"}, 14)
    assert not any(calls["fp16"]) and calls["plen"] == [None]


def test_decoding_bench_states_the_preset():
    from mmfast.bench.common import variants
    from mmfast.bench.decoding import preset_notes

    recipe = load_recipe("configs/bench/decoding_greedy.yaml")
    results = {v.name: {"decoding": v.recipe.decoding._to_recipe()} for v in variants(recipe)}
    assert preset_notes({"results": results}) == "beam (beam) exact, opera (opera) exact"
    results["opera"]["decoding"]["params"]["preset"] = "release"
    assert "opera (opera) release" in preset_notes({"results": results})


def test_speculative_bench_says_flash_tau_is_not_the_release_tau():
    from mmfast.bench.speculative import FLASH_NOTE, speculative_notes

    rows = [["caption@T0", "baseline"], ["caption@T0", "flash"]]
    assert FLASH_NOTE in speculative_notes({"rows": rows})
    assert "EAGLE-1" in FLASH_NOTE and "mc_sim_7b_63" in FLASH_NOTE
    assert FLASH_NOTE not in speculative_notes({"rows": rows[:1]})
    # the release's mc_sim_7b_63 (flash/model/choices.py, EAGLE-1's) holds 25 drafts under the root, not Medusa's 63
    assert "63-node" not in FLASH_NOTE and "25 drafts" in FLASH_NOTE
