"""OPERA: the no-op setting is beam search, the log-space column product is exact and finite, the
retrospection rollback fires at loc+1 with accumulating bans, the decoder equals a literal dense
implementation of the released algorithm, memory stays O(K x T^2), batches equal single samples, and it
composes with in-LLM pruning."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from mmfast._graph_emulator import ReplayEmulator
from mmfast.config import load_recipe
from mmfast.decoding import opera as opera_mod
from mmfast.decoding._opera_penalty import LOG_PHI_OFFSET, OverTrustHistory, column_log_scores, mode, phi_from_log
from mmfast.errors import IncompatibleRecipeError
from mmfast.pipeline import Session


@pytest.fixture(autouse=True)
def _one_thread():
    """Many small ops per step: on a shared, loaded CPU two intra-op threads make this file ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(mm, images, prompts, params, n, method="opera", pruning=None):
    data = {"decoding": {"method": method, "params": params}}
    if pruning:
        data["pruning"] = pruning
    with Session(mm, load_recipe(data)) as s:
        res = s.generate(images, prompts, max_new_tokens=n)
        return [r.token_ids for r in res], res, [r.stats.get("rollback_events") for r in res]


def test_noop_equals_beam(tiny_mm, images, prompts):
    vocab = tiny_mm.model.config.text_config.vocab_size
    noop = {"num_beams": 3, "penalty_weights": 0.0, "threshold": 10**6, "num_attn_candidates": vocab}
    beam, _, _ = _run(tiny_mm, images[:1], prompts[:1], {"num_beams": 3}, 6, method="beam")
    got, res, _ = _run(tiny_mm, images[:1], prompts[:1], noop, 6)
    assert got == beam
    assert all(r.stats["rollbacks"] == 0 for r in res)


def test_column_product_log_space():
    # hand-built 3 x 3 response map (rows = queries, lower triangle)
    a = torch.tensor([[1.0, 0.0, 0.0], [0.3, 0.7, 0.0], [0.1, 0.5, 0.4]])
    sigma = 50.0
    direct = torch.tensor(
        [1e-7 * (sigma * 1.0) * (sigma * 0.3) * (sigma * 0.1), 1e-7 * (sigma * 0.7) * (sigma * 0.5), 1e-7 * sigma * 0.4]
    )
    torch.testing.assert_close(column_log_scores(a, sigma).exp(), direct.float(), rtol=1e-5, atol=0)
    phi, loc = phi_from_log(column_log_scores(a, sigma))
    assert loc.item() == int(direct.argmax()) and math.isclose(phi.item(), direct.max().item(), rel_tol=1e-5)
    # incremental (running column log-sums + candidate rows) == dense, for every candidate
    g = torch.Generator().manual_seed(0)
    k, n, t = 2, 3, 6
    rows = torch.rand(k, t + 1, t + 1, generator=g).tril() + 1e-3
    rows = rows / rows.sum(-1, keepdim=True)
    hist = OverTrustHistory(k, sigma, torch.device("cpu"))
    for i in range(t):
        hist.append(rows[:, i, : i + 1])
    cands = torch.rand(k, n, t + 1, generator=g)
    cands = cands / cands.sum(-1, keepdim=True)
    for c in range(n):
        dense = torch.cat([rows[:, :t], cands[:, c : c + 1]], 1)  # [K, t+1, t+1]
        torch.testing.assert_close(
            hist.candidate_log_scores(cands)[:, c], column_log_scores(dense, sigma), rtol=1e-5, atol=1e-4
        )
    # a long map: the direct product underflows even in float64, the log-space score stays finite
    long = torch.full((600, 600), 1e-3).tril()
    assert (1e-7 * (sigma * long[:, 0].double()).prod()).item() == 0.0
    logs = column_log_scores(long, sigma)
    assert torch.isfinite(logs).all() and logs[0].item() == pytest.approx(
        LOG_PHI_OFFSET + 600 * math.log(0.05), rel=1e-5
    )
    # large products saturate to the fp32 range (no inf/NaN with a zero weight) unless fp16 emulation is on
    big = torch.tensor([[10.0, 300.0, 5.0]])
    assert torch.isfinite(phi_from_log(big)[0]).all() and phi_from_log(big)[1].item() == 1
    phi16, loc16 = phi_from_log(
        torch.tensor([[LOG_PHI_OFFSET + 12.0, LOG_PHI_OFFSET + 30.0, -40.0]]), fp16_saturation=True
    )
    assert phi16.item() == math.inf and loc16.item() == 0  # both products > 65504: the first column, as released
    assert mode(torch.tensor([[3, 1, 3, 1, 2]])).item() == 1  # ties: the smallest, as torch.mode


def _force_location(monkeypatch, loc=10):
    """Keep the real over-trust scores but report location ``loc`` for every candidate."""
    real = opera_mod.phi_from_log

    def fixed(log_phi, fp16_saturation=False):
        phi, _ = real(log_phi, fp16_saturation)
        return phi, torch.full(phi.shape, loc, dtype=torch.long)

    monkeypatch.setattr(opera_mod, "phi_from_log", fixed)


def test_rollback_forced_location(tiny_mm, images, prompts, monkeypatch):
    """Every candidate's over-trust location is 10: the trigger must fire once 11 tokens exist."""
    _force_location(monkeypatch)
    k, n_can = 3, 2
    _, res, trace = _run(
        tiny_mm, images[:1], prompts[:1], {"num_beams": k, "num_attn_candidates": n_can, "threshold": 2}, 16
    )
    events = trace[0]
    # loc + 1 = 11 twice (N_can times), then loc = 10 twice, then both exhausted: no more rollbacks
    assert [e["position"] for e in events] == [11, 11, 10, 10]
    assert all(e["location"] == 10 for e in events)
    assert [e["step"] for e in events] == [12, 12, 12, 11]
    assert [len(e["banned"]) for e in events] == [k, 2 * k, k, 2 * k]  # bans accumulate per position
    assert events[1]["banned"][:k] == events[0]["banned"] and events[1]["banned"][k:] == events[0]["chosen"]
    for e in events:
        assert not set(map(tuple, e["chosen"])) & set(map(tuple, e["banned"]))  # a banned pair is never re-chosen
    assert res[0].stats["rollbacks"] == 4 and res[0].stats["rollback_positions"] == [11, 11, 10, 10]
    assert len(res[0].token_ids) > 0
    # with a per-step KV policy installed: clone look-ahead, and the rollback rebuild replays the prefix token by token
    recipe = load_recipe(
        {"decoding": {"method": "opera", "params": {"num_beams": k, "num_attn_candidates": n_can, "threshold": 2}}}
    )
    with Session(tiny_mm, recipe) as s:
        s.runner.step_hooks.append(lambda state: None)
        replayed = s.generate(images[:1], prompts[:1], max_new_tokens=16)[0]
    assert replayed.token_ids == res[0].token_ids and replayed.stats["rollbacks"] == 4


def test_rollback_fires_naturally(tiny_mm, images, prompts):
    _, res, trace = _run(
        tiny_mm, images[:1], prompts[:1], {"num_beams": 3, "num_attn_candidates": 4, "threshold": 1}, 30
    )
    events = trace[0]
    assert events and res[0].stats["rollbacks"] == len(events)
    for e in events:
        assert e["location"] >= 10 and e["position"] in (e["location"] + 1, e["location"]) and e["position"] < e["step"]
        assert not set(map(tuple, e["chosen"])) & set(map(tuple, e["banned"]))
    first = events[0]
    assert first["position"] == first["location"] + 1


def _dense_reference(mm_eager, session, image, prompt, k, n_can, r, alpha, sigma, max_new, release=False):
    """The released algorithm, literally: eager attention, no KV cache, the full L x L map per beam,
    float64 column products, the released history stack (pop loops, restore of entry -2, bans of the
    choices stored in entry -1), index-range image span. (Differences documented in opera.py: the
    restored scorer is a copy, bans after the target are cleared.) ``release``: the fp16 score loop
    (factors fp16(sigma fp16(a)), product and 1e-7 x product rounded to fp16) and the 4.29.2 scorer."""
    import copy

    from mmfast.decoding.beam import BeamSearch

    batch = mm_eager.prepare([image], [prompt])
    inputs = session.build_inputs(batch, session.encode(batch))
    lm, head, emb = mm_eager.adapter.language_model, mm_eager.adapter.lm_head, mm_eager.adapter.embed_tokens
    prompt_emb, n_prompt = inputs.embeds[0], inputs.length
    img = inputs.image_mask[0].nonzero().squeeze(1)
    img_start, img_end = int(img[0]), int(img[-1])

    @torch.no_grad()
    def forward(ids):  # -> logits [V], last-layer attention max over heads [T, T]
        e = torch.cat([prompt_emb, emb(torch.tensor(ids, dtype=torch.long))]) if ids else prompt_emb
        o = lm(inputs_embeds=e[None], output_attentions=True)
        return head(o.last_hidden_state[0, -1]).float(), o.attentions[-1][0].amax(0).double()

    plen = torch.tensor([len(batch.token_ids[0])]) if release else None
    search = BeamSearch(1, k, max_new, 1.0, torch.device("cpu"), prompt_len=plen)
    states, hist_locs, times, rejects, events = [], [], {}, {}, []
    beam_tok = beam_idx = None
    while True:
        seqs = search.running_tokens[0].tolist()
        current = {"search": copy.deepcopy(search), "tok": beam_tok, "idx": beam_idx}
        outs = [forward(q) for q in seqs]
        logits = torch.stack([o[0] for o in outs])
        cand_scores, cand = logits.topk(n_can, -1)
        phi = torch.zeros(k, n_can, dtype=torch.float64)
        locs = torch.zeros(k, n_can, dtype=torch.long)
        img_attn = torch.zeros(k, n_can, dtype=torch.float64)
        for b in range(k):
            for c in range(n_can):
                _, a = forward(seqs[b] + [int(cand[b, c])])
                square = torch.zeros_like(a)
                square[:-1, :-1] = outs[b][1]
                square[-1] = a[-1]
                square = square / square.sum(-1, keepdim=True)
                if release:
                    local = (sigma * square[n_prompt:, n_prompt:].to(torch.float16).float()).to(torch.float16)
                    buf = torch.zeros(local.shape[-1], dtype=torch.float16)
                    for j in range(local.shape[-1]):
                        buf[j] = (1e-7 * local[j:, j].double().prod().to(torch.float16).float()).to(torch.float16)
                    phi[b, c], locs[b, c] = buf.double().max(0)
                else:
                    local = sigma * square[n_prompt:, n_prompt:]
                    lower = torch.ones_like(local, dtype=torch.bool).tril()
                    cols = 1e-7 * torch.where(lower, local, torch.ones_like(local)).prod(-2)  # prod_{i >= j}
                    phi[b, c], locs[b, c] = cols.max(0)
                img_attn[b, c] = square[-1, img_start : img_end + 1].sum()
        width = len(seqs[0]) + 1
        cand_scores = (cand_scores.double() - alpha * (-img_attn if width <= 10 else phi)).clamp(
            min=torch.finfo(torch.float32).min
        )
        hist_locs.append(torch.mode(locs, -1).values)
        loc = int(torch.mode(torch.mode(locs, -1).values).values)
        states.append(current)
        pos = None
        if all(int((g == loc).sum()) > r for g in torch.stack(hist_locs, 1)) and loc >= 10:
            pos = loc + 1
            if times.get(pos, 0) >= n_can:
                pos = loc if times.get(loc, 0) < n_can else None
            if pos is not None:
                times[pos] = times.get(pos, 0) + 1
        if pos is not None:
            for _ in range(width - pos - 2):
                states.pop(-1)
                hist_locs.pop(-1)
            search = copy.deepcopy(states[-2]["search"])
            beam_tok, beam_idx = states[-1]["tok"], states[-1]["idx"]
            states.pop(-1)
            hist_locs.pop(-1)
            logits = torch.stack([forward(q)[0] for q in search.running_tokens[0].tolist()])
            vocab = logits.shape[-1]
            for q in [q for q in rejects if q > pos]:
                del rejects[q]
            new = beam_idx * vocab + beam_tok
            rejects[pos] = torch.cat([rejects[pos], new]) if pos in rejects else new
            x = logits - (999.0 + logits.min(-1, keepdim=True).values)
            x = x.reshape(-1).scatter(0, rejects[pos], -999.0).view(k, vocab)
            events.append((loc, pos))
        else:
            x = torch.full_like(logits, -999.0).scatter(-1, cand, cand_scores.float())
        beam_idx, beam_tok = search.step(torch.log_softmax(x, -1), torch.tensor(mm_eager.eos_token_ids))
        if search.done:
            tokens = search.best()[0]
            return (tokens[: tokens.index(2)] if 2 in tokens else tokens), events


@pytest.mark.parametrize(
    "case", [(0, 3, 4, 34, "tree", "exact"), (3, 2, 2, 24, "clone", "exact"), (0, 3, 4, 34, "tree", "release")]
)
def test_matches_dense_reference(tiny_dir, tiny_mm, images, prompts, case):
    """The incremental decoder (sdpa probe rows, log-space column sums, snapshots, cache rebuilds)
    equals a literal dense implementation of the released algorithm, rollbacks included."""
    import mmfast

    i, k, n_can, n, lookahead, preset = case
    eager = mmfast.load(tiny_dir, device="cpu", attn_implementation="eager")
    with Session(eager, load_recipe({})) as s:
        ref, ref_events = _dense_reference(
            eager, s, images[i], prompts[i], k, n_can, 1, 1.0, 50.0, n, release=preset == "release"
        )
    params = {"num_beams": k, "num_attn_candidates": n_can, "threshold": 1, "lookahead": lookahead, "preset": preset}
    got, _, trace = _run(tiny_mm, [images[i]], [prompts[i]], params, n)
    assert ref_events, "the case must roll back"
    assert [(e["location"], e["position"]) for e in trace[0]] == ref_events
    assert got[0] == ref


def test_history_memory_bounded(tiny_mm, images, prompts):
    k, n = 3, 8
    batch = tiny_mm.prepare(images[:1], prompts[:1])
    prompt_len = len(batch.token_ids[0]) - 1 + tiny_mm.adapter.n_image_tokens
    _, res, _ = _run(tiny_mm, images[:1], prompts[:1], {"num_beams": k, "threshold": 10**6}, n)
    peak = res[0].stats["attn_history_bytes_peak"]
    assert 0 < peak <= k * n * n * 4  # beams x response_len^2 fp32
    assert peak < k * prompt_len**2 * 4  # never an L x L map
    hist = OverTrustHistory(k, 50.0, torch.device("cpu"))
    for i in range(20):
        hist.append(torch.full((k, i + 1), 1.0 / (i + 1)))
        hist.reorder(torch.tensor([0, 0, 2]))
    assert hist.col.shape == (k, 20)  # O(K x t) per step


@pytest.mark.parametrize("pruning,lookahead", [(None, "tree"), ("fastv", "tree"), ("fastv", "clone")])
def test_batch_equals_single(tiny_mm, images, prompts, pruning, lookahead, monkeypatch):
    from mmfast.registry import PRUNERS

    _force_location(monkeypatch)  # rollbacks in every sample (real penalties, forced locations)
    stages = None
    if pruning:
        stages = [{"method": pruning, "params": PRUNERS.get(pruning).cls.test_params(tiny_mm.adapter)}]
    params = {"num_beams": 2, "num_attn_candidates": 2, "threshold": 2, "lookahead": lookahead}
    batched, res, _ = _run(tiny_mm, images[:2], prompts[:2], params, 14, pruning=stages)
    single = [_run(tiny_mm, [im], [p], params, 14, pruning=stages)[0][0] for im, p in zip(images[:2], prompts[:2])]
    assert batched == single
    assert all(r.stats["rollbacks"] > 0 for r in res)  # per-sample rollbacks inside a batch
    if pruning:
        assert res[0].vision_tokens_layer_avg < tiny_mm.adapter.n_image_tokens


def test_refuses_speculative_and_decode_kv_policies():
    with pytest.raises(IncompatibleRecipeError, match="speculative"):
        load_recipe({"decoding": {"method": "opera"}, "speculative": {"method": "prompt_lookup"}})
    assert opera_mod.Opera.caps.search == "beam" and not opera_mod.Opera.caps.speculative
    with pytest.raises(IncompatibleRecipeError, match="beam search"):  # ZipVL refuses beam search
        load_recipe({"decoding": {"method": "opera"}, "pruning": [{"method": "zipvl"}]})
    with pytest.raises(IncompatibleRecipeError, match="text_keep"):
        load_recipe(
            {
                "decoding": {"method": "opera"},
                "pruning": [{"method": "dynamic_llava", "params": {"predictors": "random"}}],
            }
        )
    always = {"predictors": "random", "text_keep": "always"}
    load_recipe({"decoding": {"method": "opera"}, "pruning": [{"method": "dynamic_llava", "params": always}]})


class _Graphs(ReplayEmulator):
    """CUDA-graph semantics on the CPU (recorded ops replayed, Python frozen at capture), counting the graphs."""

    made: list = []

    def __init__(self) -> None:
        super().__init__()
        _Graphs.made.append(self)


@pytest.mark.parametrize("pruning", [None, "fastv"])
def test_static_and_captured_steps_equal_the_dynamic_cache(pruning, tiny_mm, images, prompts, monkeypatch, caplog):
    """OPERA on the static cache: eager static steps (``compile: static``) and captured ones (CUDA-graph semantics
    emulated: the beams' steps, the tree look-ahead with its last-layer rows carried out of each replay, the
    reorders; the rollback's re-forward eager). Tokens, rollbacks, candidate forwards and end KV bytes equal the
    dynamic cache's at batch 2 with rollbacks in every sample; the second sample's beams take the first's buffers,
    so a batch of 2 captures no more graphs than a batch of 1, and the next call's beams take them again (the pool's
    second set), so it captures none."""
    import mmfast
    from mmfast.registry import PRUNERS

    _force_location(monkeypatch)
    data: dict = {"decoding": {"method": "opera", "params": {"num_beams": 2, "num_attn_candidates": 2, "threshold": 2}}}
    if pruning:
        data["pruning"] = [{"method": pruning, "params": PRUNERS.get(pruning).cls.test_params(tiny_mm.adapter)}]

    def run(compile: str, n: int) -> list:
        with mmfast.apply(tiny_mm, load_recipe(data), compile=compile) as s:
            res = s.generate(images[:n], prompts[:n], max_new_tokens=14)
        return [
            (r.token_ids, r.stats["rollback_positions"], r.stats["candidate_forwards"], r.kv_bytes_end) for r in res
        ]

    dynamic = run("off", 2)
    assert all(positions for _, positions, _, _ in dynamic)  # every sample rolled back
    assert run("static", 2) == dynamic
    monkeypatch.setattr(Session, "_capture_factory", lambda self: _Graphs)
    _Graphs.made = []
    with caplog.at_level(logging.INFO, logger="mmfast.runtime"):
        assert run("static", 2) == dynamic
    assert not [r for r in caplog.records if "without a captured graph" in r.getMessage()]
    two = len(_Graphs.made)
    assert two and sum(g.replays for g in _Graphs.made) >= 20
    _Graphs.made = []
    run("static", 1)
    assert len(_Graphs.made) == two
    # the beams' buffers are the pool's second set: the next call takes them and captures nothing
    _Graphs.made = []
    with mmfast.apply(tiny_mm, load_recipe(data), compile="static") as s:
        first = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=14)]
        made = len(_Graphs.made)
        again = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=14)]
    assert first == again == [t for t, _, _, _ in dynamic] and len(_Graphs.made) == made


@pytest.mark.parametrize("release", [False, True])
def test_a_shallow_copy_of_the_beam_search_is_a_snapshot(release):
    """OPERA snapshots its search every step with ``copy.copy`` (no tensor clones): a step of the search leaves a
    copy taken before it exactly as it was (its tensors are replaced, never written), and a copy restored from it
    steps as the original did."""
    import copy

    from mmfast.decoding.beam import BeamSearch

    g = torch.Generator().manual_seed(0)
    stop = torch.tensor([0])
    prompt = torch.tensor([5, 7]) if release else None
    search = BeamSearch(2, 3, 4, 1.0, torch.device("cpu"), prompt_len=prompt)
    steps = [torch.log_softmax(torch.randn(6, 11, generator=g), -1) for _ in range(4)]
    search.step(steps[0], stop)
    snap = copy.copy(search)
    before = {k: v.clone() for k, v in vars(snap).items() if isinstance(v, torch.Tensor)}
    for lp in steps[1:]:
        search.step(lp, stop)
    assert all(torch.equal(getattr(snap, k), v) for k, v in before.items())
    again = copy.copy(snap)
    for lp in steps[1:]:
        again.step(lp, stop)
    assert again.best() == search.best()
    assert all(torch.equal(getattr(again, k), getattr(search, k)) for k in before)
