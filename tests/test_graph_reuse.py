"""Captured decode steps outlive the call (issue 27: capture time amortised over a run): a session keeps
its last call's static KV buffers and the graphs captured on them (``compat.StaticBufferPool``), and the
next call whose cache fits those buffers replays the graphs instead of capturing again.

The graphs here are :class:`mmfast._graph_emulator.ReplayEmulator` (CUDA-graph semantics on the CPU: only
the recorded ops replay, on the tensors they were recorded on), so a graph that read anything of the
first call besides the kept buffers and its own static inputs would give the second call wrong tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

import mmfast
from mmfast import compat
from mmfast._graph_emulator import ReplayEmulator
from mmfast.config import load_recipe


class Counted(ReplayEmulator):
    made: list = []

    def __init__(self) -> None:
        super().__init__()
        Counted.made.append(self)


@pytest.fixture
def captured(monkeypatch):
    from mmfast.pipeline import Session

    Counted.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: Counted)
    return Counted


def _dynamic(mm, recipe, images, prompts, n=6):
    with mmfast.apply(mm, load_recipe(recipe), compile="off") as s:
        return [r.token_ids for r in s.generate(images, prompts, max_new_tokens=n, seed=0)]


def _replays() -> int:
    return sum(g.replays for g in Counted.made)


PDROP = "pyramiddrop"


@pytest.mark.parametrize("name", ["greedy", PDROP, "prompt_lookup"])
def test_the_next_call_replays_the_graphs_of_the_last(name, captured, tiny_mm, images, prompts):
    """Two calls with other images and prompts of similar length: the second replays the first call's
    graphs and captures nothing, and both equal the dynamic cache's tokens. Speculative decoding runs
    samples one at a time (the second sample takes the first's buffers: ``LMRunner.finish``) and pads
    every verify tree to the drafter's largest (one graph)."""
    from mmfast.registry import PRUNERS

    recipe = {
        "greedy": {},
        PDROP: {"pruning": [{"method": PDROP, "params": PRUNERS.get(PDROP).cls.test_params(tiny_mm.adapter)}]},
        "prompt_lookup": {"speculative": {"method": "prompt_lookup"}},
    }[name]
    first, second = (images[:2], prompts[:2]), (images[2:4], [prompts[1], prompts[0]])
    want = [_dynamic(tiny_mm, recipe, *first), _dynamic(tiny_mm, recipe, *second)]
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        got = [[r.token_ids for r in s.generate(*first, max_new_tokens=6, seed=0)]]
        kept, made = dict(s.runner.pool.graphs), len(captured.made)
        replays = {key: g.graph.replays for key, g in kept.items()}
        assert kept and s.runner.pool.kept_bytes > 0
        # the prefill is captured too: one graph, or one per segment between in-LLM pruning layers (PyramidDrop
        # prunes at three layers: four segments, its selections run eagerly between them)
        assert sum(key[1] == "prefill" for key in kept) == len(s.runner._select) + 1 == (4 if name == PDROP else 1)
        if name == "prompt_lookup":  # two samples one at a time, every verify tree padded to one width: one graph
            # (and one greedy verdict and one keep of the verified path: the cycles run on the device)
            steps = [c.static.q for key, c in kept.items() if key[1] not in ("prefill", "keep", "greedy_accept")]
            assert steps == [s.drafter.max_step_tokens()]
            assert sorted(key[1] for key in kept if key[1] in ("keep", "greedy_accept")) == ["greedy_accept", "keep"]
        got.append([r.token_ids for r in s.generate(*second, max_new_tokens=6, seed=0)])
        assert all(s.runner.pool.graphs.get(key) is g for key, g in kept.items()), "a kept graph was dropped"
        assert sum(g.graph.replays - replays[key] for key, g in kept.items()) >= 4
        assert len(captured.made) == made, "the second call captured again"
    assert got == want
    assert not s.runner.pool.graphs and s.runner.pool.kept_bytes == 0  # closing the session frees them


def test_a_cache_that_does_not_fit_captures_anew(captured, tiny_mm, images, prompts):
    """Another batch size, or a much shorter need (the buffer would be over 1.5x what the call needs),
    takes new buffers and new graphs; the tokens stay right."""
    runs = [(images[:2], prompts[:2], 6), (images[:1], prompts[:1], 6), (images[:1], prompts[:1], 200)]
    with mmfast.apply(tiny_mm, load_recipe({}), compile="static") as s:
        for imgs, ps, n in runs:
            made = len(captured.made)
            got = [r.token_ids for r in s.generate(imgs, ps, max_new_tokens=n, seed=0)]
            assert len(captured.made) > made
            assert got == _dynamic(tiny_mm, {}, imgs, ps, n)
        # back to a shorter call: the 200-token buffers are over 1.5x its need
        made = len(captured.made)
        s.generate(images[:1], prompts[:1], max_new_tokens=6, seed=0)
        assert len(captured.made) > made


def test_a_call_without_decode_steps_keeps_the_set(captured, tiny_mm, images, prompts, monkeypatch):
    """A one-token call (TTFT) has no decode step: it takes the kept buffers however large (no step attends
    over them), replays the kept prefill graph and leaves buffers and graphs to the next call."""
    with mmfast.apply(tiny_mm, load_recipe({}), compile="static") as s:
        s.generate(images[:2], prompts[:2], max_new_tokens=100)  # buffers of 192 slots: over 1.5x a TTFT's need
        graphs, made = dict(s.runner.pool.graphs), len(captured.made)
        replays = {key: g.graph.replays for key, g in graphs.items()}
        one = s.generate(images[:2], prompts[:2], max_new_tokens=1)
        assert s.runner.pool.graphs == graphs and len(captured.made) == made
        assert [g.graph.replays - replays[key] for key, g in graphs.items() if key[1] == "prefill"] == [1]
        s.generate(images[:2], prompts[:2], max_new_tokens=100)
        assert len(captured.made) == made
    assert [r.token_ids for r in one] == _dynamic(tiny_mm, {}, images[:2], prompts[:2], 1)


def _layer(pool, n=5, reserve=3, batch=2, dtype=torch.float32):
    lay = compat.StaticSlotLayer(reserve, pool, 0)
    k = torch.randn(batch, 2, n, 4, dtype=dtype)
    lay.update(k, k + 1)
    return lay


def test_pool_takes_zeroed_buffers_that_fit_and_drops_the_rest():
    pool = compat.StaticBufferPool()
    lay = _layer(pool)
    assert lay.capacity == pool.granularity  # 5 + 3 rounded up
    pool.graphs[(compat.static_buffers(type("C", (), {"layers": [lay]})()),)] = "graph"
    pool.keep(type("C", (), {"layers": [lay]})())
    assert pool.graphs and pool.kept_bytes == 2 * lay._k.numel() * 4
    k_ptr = lay._k.data_ptr()
    again = _layer(pool, n=40)  # needs 43 <= 64 <= 64
    assert again._k.data_ptr() == k_ptr and again.length == 40
    assert not again._k[:, :, 40:].any() and torch.equal(again.keys[:, :, :40], again._k[:, :, :40])
    assert pool.graphs  # taken: still valid
    pool.keep(type("C", (), {"layers": [again]})())
    big = _layer(pool, n=100)  # needs 103 > 64: new buffers (the old ones go first), every graph goes
    assert big.capacity == 128 and not pool.graphs
    pool.graphs[(compat.static_buffers(type("C", (), {"layers": [big]})()),)] = "graph"
    pool.keep(type("C", (), {"layers": [big]})())
    small = _layer(pool, n=2)  # needs 5: 128 is over 1.5 x 5 and over 5 rounded up
    assert small.capacity == 64 and not pool.graphs
    pool.keep(type("C", (), {"layers": [small]})())
    other = _layer(pool, n=2, batch=3)  # another batch
    assert other._k.shape[0] == 3
    pool.keep(type("C", (), {"layers": [other]})())
    half = _layer(pool, n=2, batch=3, dtype=torch.float64)  # another dtype
    assert half._k.dtype == torch.float64
    pool.clear()
    assert pool.kept_bytes == 0 and not pool.graphs


def test_the_pool_keeps_a_set_per_prefill_of_a_call():
    """A call's n-th static cache (a branch decoder's prompt of another length) takes the n-th kept set, so the
    graphs on every set of the last call stay; a set left out of the next call's keep goes with its graphs."""
    pool = compat.StaticBufferPool()

    def cache(*layers):
        return type("C", (), {"layers": list(layers)})()

    first, second = _layer(pool.set(0), n=5), _layer(pool.set(1), n=20, batch=1)
    for lay in (first, second):
        pool.graphs[(compat.static_buffers(cache(lay)),)] = "graph"
    pool.keep([cache(first), cache(second)])
    assert len(pool.graphs) == 2 and pool.kept_bytes == sum(2 * x._k.numel() * 4 for x in (first, second))
    again = [_layer(pool.set(0), n=5), _layer(pool.set(1), n=20, batch=1)]
    assert [x._k.data_ptr() for x in again] == [first._k.data_ptr(), second._k.data_ptr()]
    assert _layer(pool.set(2))._k.data_ptr() not in {first._k.data_ptr(), second._k.data_ptr()}  # none kept
    pool.keep(cache(again[0]))  # a call with one prefill: the second set and its graph go
    assert list(pool.graphs) == [(compat.static_buffers(cache(first)),)]
    assert _layer(pool.set(1), n=20, batch=1)._k.data_ptr() != second._k.data_ptr()


def test_a_copied_layer_does_not_carry_the_pool():
    pool = compat.StaticBufferPool()
    fresh = compat.StaticSlotLayer(2, pool, 0)
    lay = _layer(pool)
    assert copy.deepcopy(lay)._pool is None and lay._pool is None
    assert fresh._pool is pool


def test_a_verify_tree_is_padded_to_the_width():
    """Pads are copies of the root at depth 0 that see only themselves; no node sees a pad."""
    from mmfast.speculative.engine import _verify_inputs
    from mmfast.speculative.tree import DraftTree

    tree = DraftTree(torch.tensor([7, 8, 9]), torch.tensor([0, 1, 0]))  # root -> 7 -> 8, root -> 9
    nodes, depth, mask = _verify_inputs(tree, 5, None)
    assert nodes.tolist() == [[5, 7, 8, 9]] and torch.equal(mask, tree.mask())
    nodes, depth, mask = _verify_inputs(tree, 5, 6)
    assert nodes.tolist() == [[5, 7, 8, 9, 5, 5]] and depth.tolist() == [0, 1, 2, 1, 0, 0]
    assert torch.equal(mask[:4, :4], tree.mask()) and not mask[:4, 4:].any() and not mask[4:, :4].any()
    assert torch.equal(mask[4:, 4:], torch.eye(2, dtype=torch.bool))
    assert _verify_inputs(tree, 5, 3)[0].shape == (1, 4)  # never cut


def _prefill_lengths(session) -> list[int]:
    """The length of every prefilled (possibly left-padded) state of ``session``, appended as they run."""
    lengths: list[int] = []
    original = session.runner.prefill

    def prefill(inputs, **kw):
        state, out = original(inputs, **kw)
        lengths.append(state.inputs.length)
        return state, out

    session.runner.prefill = prefill
    return lengths


def test_a_pre_llm_prefill_is_one_captured_graph(captured, tiny_mm, images, prompts):
    """A pre-LLM pruner's prefill is a plain forward over the kept tokens: one graph (left-padded to a multiple
    of 16 slots), replayed by the next call, tokens equal."""
    from mmfast.registry import PRUNERS
    from mmfast.runtime import PREFILL_BUCKET

    recipe = {"pruning": [{"method": "divprune", "params": PRUNERS.get("divprune").cls.test_params(tiny_mm.adapter)}]}
    runs = [(images[:2], prompts[:2]), (images[2:4], [prompts[1], prompts[0]])]
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        lengths = _prefill_lengths(s)
        got = [[r.token_ids for r in s.generate(imgs, ps, max_new_tokens=6, seed=0)] for imgs, ps in runs]
        prefills = [key for key in s.runner.pool.graphs if key[1] == "prefill"]
    assert got == [_dynamic(tiny_mm, recipe, imgs, ps) for imgs, ps in runs]
    assert len(prefills) == 1 and all(n % PREFILL_BUCKET == 0 for n in lengths)


def _kept_positions(session, out: list) -> None:
    """Append, for every prefilled state of ``session``, the positions each sample keeps in each layer group
    (independent of how far the prompt was left-padded)."""
    original = session.runner.prefill

    def prefill(inputs, **kw):
        state, res = original(inputs, **kw)
        out.append([[g.positions[b][g.key_mask[b]].tolist() for b in range(len(g.key_mask))] for g in state.groups])
        return state, res

    session.runner.prefill = prefill


@pytest.mark.parametrize(
    ("name", "graphs", "same_decode"),
    [("fastv", 2, True), ("dart", 2, True), ("sparsevlm", 4, True), ("mustdrop", 4, False)],
)
def test_an_in_llm_pruner_prefills_in_captured_segments(name, graphs, same_decode, captured, tiny_mm, images, prompts):
    """An in-LLM pruner's prefill runs layer by layer in segments between its pruning layers, its selection
    eagerly between them. A segment is one graph unless a method's Python runs inside it: FastV's probe of
    layer K-1 (last row: rows from shapes only) and DART's key recorder are captured with their segment and
    their results put back after each replay; SparseVLM's and MustDrop's probes read text rows picked from the
    prompt, staged as the graph's input before each replay. The next call (other images, the prompts swapped)
    replays them and captures no prefill segment (nor a decode step, except MustDrop's, whose KV policy after
    the prefill makes layer groups that depend on the image); the kept tokens of every layer group and the
    output tokens equal the dynamic cache's."""
    from mmfast.registry import PRUNERS

    recipe = {"pruning": [{"method": name, "params": PRUNERS.get(name).cls.test_params(tiny_mm.adapter)}]}
    runs = [(images[:2], prompts[:2]), (images[2:4], [prompts[1], prompts[0]])]
    want_kept: list = []
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="off") as s:
        _kept_positions(s, want_kept)
        want = [[r.token_ids for r in s.generate(imgs, ps, max_new_tokens=6, seed=0)] for imgs, ps in runs]
    got_kept: list = []
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        _kept_positions(s, got_kept)
        got = [[r.token_ids for r in s.generate(*runs[0], max_new_tokens=6, seed=0)]]
        prefills = {key: c.graph.replays for key, c in s.runner.pool.graphs.items() if key[1] == "prefill"}
        made = len(captured.made)
        got.append([r.token_ids for r in s.generate(*runs[1], max_new_tokens=6, seed=0)])
        assert [key for key in s.runner.pool.graphs if key[1] == "prefill"] == list(prefills)
        assert len(captured.made) == made or not same_decode, "the second call captured again"
        assert all(s.runner.pool.graphs[key].graph.replays == n + 1 for key, n in prefills.items())
    assert len(prefills) == graphs and len(s.runner._select) + 1 >= graphs
    assert len(want_kept) == 2 and len(want_kept[0]) > 1  # a layer group was made
    assert got_kept == want_kept and got == want


def test_staged_probe_rows_key_their_graph_by_width(captured, tiny_mm, images, prompts):
    """SparseVLM's raters are staged as a captured segment's input, padded to a multiple of 16 rows: a call
    whose raters fit the same width replays the graphs, a prompt with more raters is another graph (captured,
    not a stale replay); the staged rows are dropped after each segment (an eager run never reads them); a
    call whose buffers were re-allocated keeps every segment it captured (only the old buffers' graphs go);
    every call's tokens equal the dynamic cache's."""
    from mmfast.hooks.attention import ROW_PAD
    from mmfast.registry import PRUNERS

    recipe = {"pruning": [{"method": "sparsevlm", "params": PRUNERS.get("sparsevlm").cls.test_params(tiny_mm.adapter)}]}
    long = " ".join(["Describe every object, its colour, its size and where it is in the image."] * 4)
    runs = [([images[0]], [prompts[1]]), ([images[1]], [prompts[3]]), ([images[2]], [long])]
    got, staged = [], []
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        for imgs, ps in runs:
            got.append([r.token_ids for r in s.generate(imgs, ps, max_new_tokens=6, seed=0)])
            assert s.probe._staged == {}
            keys = [key for key in s.runner.pool.graphs if key[1] == "prefill"]
            staged.append({key for key in keys if key[4]})
            assert {key[2] for key in keys} == {0, *s.runner._select}  # every segment of this call kept
    assert got == [_dynamic(tiny_mm, recipe, imgs, ps) for imgs, ps in runs]
    widths = [{w for key in keys for (_, w) in key[4]} for keys in staged]
    assert staged[1] == staged[0] and widths[0] == {ROW_PAD}  # the second call replayed the staged segments
    assert staged[2].isdisjoint(staged[1]) and min(widths[2]) > ROW_PAD and all(w % ROW_PAD == 0 for w in widths[2])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_captured_prefill_keeps_multimodal_positions(family, captured, tmp_path, images, prompts):
    """M-RoPE (3-axis positions) through a left-padded captured prefill, images of two sizes in a batch,
    and a second call that replays it: the dynamic cache's tokens."""
    from mmfast.models.factory import random_qwen_vl, save_model

    model, processor = random_qwen_vl(family)
    mm = mmfast.load(save_model(model, processor, tmp_path), device="cpu")
    mixed = [im if i % 2 == 0 else im.resize((32, 64)) for i, im in enumerate(images)]
    runs = [(mixed[:2], prompts[:2]), (mixed[2:4], prompts[2:4])]
    with mmfast.apply(mm, load_recipe({}), compile="static") as s:
        got = [[r.token_ids for r in s.generate(imgs, ps, max_new_tokens=6, seed=0)] for imgs, ps in runs]
        prefills = [key for key in s.runner.pool.graphs if key[1] == "prefill"]
    assert prefills and got == [_dynamic(mm, {}, imgs, ps) for imgs, ps in runs]


def test_static_pads_the_prefill_as_auto_does(tiny_mm, images, prompts):
    """``static`` (eager) runs the same padded prefill as a captured one, so the two launch the same kernels
    on the same shapes; tokens equal the dynamic cache's."""
    from mmfast.runtime import PREFILL_BUCKET

    with mmfast.apply(tiny_mm, load_recipe({}), compile="static") as s:
        lengths = _prefill_lengths(s)
        got = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=6, seed=0)]
        assert not s.runner.pool.graphs
    assert lengths and all(n % PREFILL_BUCKET == 0 for n in lengths)
    assert got == _dynamic(tiny_mm, {}, images[:2], prompts[:2])


def test_a_new_kept_set_is_said_once(captured, tiny_mm, images, prompts, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="mmfast.compat"), mmfast.apply(tiny_mm, {}, compile="static") as s:
        for _ in range(3):
            s.generate(images[:2], prompts[:2], max_new_tokens=6)
    lines = [r.getMessage() for r in caplog.records if "static KV buffers" in r.getMessage()]
    assert len(lines) == 1 and "batch 2" in lines[0] and "MiB" in lines[0], lines


@pytest.fixture(scope="module")
def family_models(tiny_mm, tmp_path_factory):
    from mmfast.models.factory import random_llava_next, random_llava_onevision, random_qwen_vl, save_model

    out = {"llava": tiny_mm}
    for family, build in (("llava_next", random_llava_next), ("llava_onevision", random_llava_onevision)):
        model, processor = build("tiny")
        out[family] = mmfast.load(save_model(model, processor, tmp_path_factory.mktemp(family)), device="cpu")
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        model, processor = random_qwen_vl(family)
        out[family] = mmfast.load(save_model(model, processor, tmp_path_factory.mktemp(family)), device="cpu")
    return out


@pytest.mark.parametrize("family", ["llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("name", ["fastv", "pyramiddrop"])
def test_segments_run_every_familys_layers_as_its_model_does(name, family, family_models, captured, images, prompts):
    """The runner calls each family's decoder layers itself (1-D RoPE on LLaVA / NeXT / OneVision's LLMs,
    M-RoPE on Qwen-VL, images of two sizes): captured segments give the dynamic cache's tokens. Qwen3-VL's
    deepstack additions keep the prefill on the model's own forward (not in segments)."""
    from mmfast.registry import PRUNERS

    mm = family_models[family]
    recipe = {"pruning": [{"method": name, "params": PRUNERS.get(name).cls.test_params(mm.adapter)}]}
    mixed = [im if i % 2 == 0 else im.resize((32, 64)) for i, im in enumerate(images[:2])]
    with mmfast.apply(mm, load_recipe(recipe), compile="static") as s:
        got = [r.token_ids for r in s.generate(mixed, prompts[:2], max_new_tokens=6, seed=0)]
        prefills = [key for key in s.runner.pool.graphs if key[1] == "prefill"]
        towers = getattr(getattr(s.adapter, "tower_graphs", None), "graphs", None)
    assert got == _dynamic(mm, recipe, mixed, prompts[:2])
    assert len(prefills) == (0 if family == "qwen3_vl" else len(s.runner._select) + 1)
    assert bool(towers) == family.startswith("llava")  # the LLaVA-style towers are captured too


def test_the_vision_tower_is_one_captured_graph_per_pixel_shape(captured, tiny_mm, images, prompts):
    """LLaVA's tower (and its feature layers) replays one graph per pixel-batch shape: captured by the first
    call, replayed by the next, tokens equal the dynamic cache's (whose tower ran eagerly)."""
    runs = [(images[:2], prompts[:2]), (images[2:4], [prompts[1], prompts[0]])]
    with mmfast.apply(tiny_mm, load_recipe({}), compile="static") as s:
        got = [[r.token_ids for r in s.generate(imgs, ps, max_new_tokens=4, seed=0)] for imgs, ps in runs]
        towers = dict(s.adapter.tower_graphs.graphs)
    assert got == [_dynamic(tiny_mm, {}, imgs, ps, 4) for imgs, ps in runs]
    assert len(towers) == 1 and next(iter(towers.values())).graph.replays == 1
    assert tiny_mm.adapter.tower_graphs is None  # the session's attribute is gone with it


def test_mustdrops_merging_tower_is_one_captured_graph(captured, tiny_mm, images, prompts):
    """MustDrop merges windows in the tower's layer 0 by a threshold (how many: the data's). Where the tower is
    captured the merge keeps the token count (padded, each image its own windows) and the later layers mask the
    padding: one graph for a batch's images at once (eager, the tower runs one image at a time), its merges,
    key-set attention and threshold (device memory: a new threshold replays the same graph) read back after each
    replay. The features
    equal the eager tower's within fp32 rounding (the masked attention sums the same terms plus zeros), the merged
    windows, patch ids and key sets exactly, and the tokens the dynamic cache's."""
    from mmfast.registry import PRUNERS

    params = {**PRUNERS.get("mustdrop").cls.test_params(tiny_mm.adapter), "sim_threshold": 0.2}
    recipe = {"pruning": [{"method": "mustdrop", "params": params}]}
    runs = [(images[:2], prompts[:2]), (images[2:4], [prompts[1], prompts[0]])]

    def encoded(s, threshold):
        s.pruners[0].sim_threshold = threshold
        out = []
        for imgs, ps in runs:
            v = s.encode(tiny_mm.prepare(imgs, ps))
            out.append((v.features, v.patch_ids, v.tags["mustdrop.key"], v.stats["mustdrop"]))
        return out

    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="off") as s:
        want = [encoded(s, t) for t in (0.2, -1.0)]
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        assert s.adapter.tower_graphs.factory() is not None
        got = [encoded(s, t) for t in (0.2, -1.0)]
        towers = dict(s.adapter.tower_graphs.graphs)
        s.pruners[0].sim_threshold = 0.2
        tokens = [[r.token_ids for r in s.generate(imgs, ps, max_new_tokens=4, seed=0)] for imgs, ps in runs]
    merged = [n for call in want[0] for n in call[3]["per_sample_merged_windows"]]
    assert len({m[0] for m in merged}) > 1 and max(m[0] for m in merged) > 0  # the images merge different counts
    # one graph for the batches of two (each image merges its own windows in it): every tower call after the first
    assert len(towers) == 1 and next(iter(towers.values())).graph.replays == 2 * 2 - 1 + 2
    for w_t, g_t in zip(want, got):
        for (wf, wi, wk, ws), (gf, gi, gk, gs) in zip(w_t, g_t):
            assert ws == gs and all(torch.equal(a, b) for a, b in [*zip(wi, gi), *zip(wk, gk)])
            for a, b in zip(wf, gf):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert want[0][0][3] != want[1][0][3]  # the second threshold merges otherwise
    assert tokens == [_dynamic(tiny_mm, recipe, imgs, ps, 4) for imgs, ps in runs]


def test_a_probe_watched_on_the_tower_after_its_capture_records(captured, tiny_mm, images, prompts):
    """A probe put on the captured tower between two calls records in the second, as one put on before the first:
    the tower's blocker and carried results are read at every call (they were read once: the replays skipped it)."""
    from mmfast.hooks import cls_row

    def record(late: bool):
        with mmfast.apply(tiny_mm, load_recipe({}), compile="static") as s:
            attn = s.adapter.vision_layers[1].self_attn
            if not late:
                s.probe.watch("vis", attn, rows=cls_row)
            s.generate(images[:1], prompts[:1], max_new_tokens=1)
            if late:
                s.probe.watch("vis", attn, rows=cls_row)
            s.generate(images[1:2], prompts[:1], max_new_tokens=1)
            assert len(s.adapter.tower_graphs.graphs) == 1
            return s.probe["vis"].probs.clone()  # [1, H, 1, 1 + N]

    torch.testing.assert_close(record(late=True), record(late=False))


def test_the_tower_keeps_a_few_shapes():
    """At most MAX_GRAPHS pixel shapes are kept, the least recently used let go first."""
    from mmfast.models.captured_tower import MAX_GRAPHS, CapturedTower
    from mmfast.runtime import LMRunner

    class Runner:
        capture_s = 0.0
        replay_or_capture = LMRunner.replay_or_capture

    tower = CapturedTower(torch.nn.Linear(2, 2), Runner(), lambda: ReplayEmulator)
    for n in [1, 2, 3, 4, 1, 5]:
        x = torch.randn(n, 2)
        assert torch.equal(tower(lambda t: t * 2 + 1, x), x * 2 + 1)
    assert [k[1][0][0] for k in tower.graphs] == [3, 4, 1, 5][-MAX_GRAPHS:]  # (key, (shape, dtype, device))


@pytest.mark.parametrize(
    "name", ["divprune", "cdpruner", "dart", "pyramiddrop", "sparsevlm", "mustdrop", "dynamic_llava"]
)
def test_a_pruners_selection_is_one_captured_graph(name, captured, tiny_mm, images, prompts):
    """DivPrune's and CDPruner's selections (the distance / DPP kernel and the greedy pick loop), DART's (pivots,
    then the least duplicated tokens of each, per image), PyramidDrop's
    scoring (the last instruction token's attention, recomputed at each stage), SparseVLM's filters (every image of
    the batch, recycling included), MustDrop's dual-attention filters and Dynamic-LLaVA's image predictor
    with its top-k run through ``MethodContext.captured``: one graph per key and input shape, captured by the first
    image (stage, batch) and replayed for every other of this call and the next, tokens equal to the dynamic cache's
    (whose selection ran eagerly). The layer groups the in-LLM ones make are laid out by the runner's captured
    calls (``LMRunner.calls``), the second call replaying the first's."""
    from mmfast.registry import PRUNERS

    recipe = {"pruning": [{"method": name, "params": PRUNERS.get(name).cls.test_params(tiny_mm.adapter)}]}
    runs = [(images[:2], prompts[:2]), (images[2:4], [prompts[1], prompts[0]])]
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        got = [[r.token_ids for r in s.generate(imgs, ps, max_new_tokens=4, seed=0)] for imgs, ps in runs]
        graphs, layouts = dict(s.ctx.captured.graphs), dict(s.runner.calls.graphs)
    assert got == [_dynamic(tiny_mm, recipe, imgs, ps, 4) for imgs, ps in runs]
    if s.runner._select:  # in-LLM: a layout per stage shape, each replayed by the second call
        assert {key[0][0] for key in layouts} == {"group"} and all(c.graph.replays >= 1 for c in layouts.values())
    else:
        assert not layouts
    if name in (
        "sparsevlm",
        "mustdrop",
    ):  # a filter of the batch per stage (SparseVLM's: two), replayed by the second call
        per_stage = 2 if name == "sparsevlm" else 1
        assert {key[0][0].split(".")[0] for key in graphs} == {name}
        assert len(graphs) == per_stage * (len(s.runner._select) - (name == "mustdrop"))
        assert all(c.graph.replays == 1 for c in graphs.values())
        return
    if name == "dynamic_llava":  # one prediction a batch: the second call's replays the first's
        assert [key[0][0] for key in graphs] == ["dynamic_llava.image"]
        assert next(iter(graphs.values())).graph.replays == 1
        return
    if name == PDROP:  # a graph per stage (both calls' prompts fill one prefill bucket): captured, then replayed
        assert {key[0][0] for key in graphs} == {PDROP} and len(graphs) == len(s.runner._select)
        assert all(c.graph.replays == 1 for c in graphs.values())
        return
    assert len(graphs) == 1 and next(iter(graphs.values())).graph.replays == 3  # images 2-4 of the 4


@pytest.mark.parametrize("name", ["divprune", "cdpruner", "cdpruner.tile"])
def test_a_replayed_selection_equals_the_eager_one(name):
    """The selection functions replayed on new inputs (CUDA-graph semantics: nothing computed in Python at
    capture is reused) pick what an eager call picks, on inputs whose picks differ from the captured ones'."""
    from functools import partial

    from mmfast.models.captured_tower import CapturedCalls
    from mmfast.pruning.cdpruner import dpp_picks, dpp_rows
    from mmfast.pruning.divprune import diverse_rows
    from mmfast.runtime import LMRunner

    fn = {
        "divprune": partial(diverse_rows, k=7),
        "cdpruner": partial(dpp_rows, k=7, negate=False, theta=None),
        "cdpruner.tile": partial(dpp_picks, k=7),
    }[name]
    shapes = {"divprune": [(40, 16)], "cdpruner": [(40, 16), (40, 12), (2, 12)], "cdpruner.tile": [(40, 16), (40,)]}
    runner = LMRunner.__new__(LMRunner)  # replay_or_capture needs only the capture-time counter
    runner.capture_s = 0.0
    calls = CapturedCalls(runner, lambda: Counted, "test selections run")
    picks = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        inputs = [torch.rand(sh, generator=g) + (0.1 if len(sh) == 1 else 0.0) for sh in shapes[name]]
        got = calls((name,), fn, *inputs)
        assert torch.equal(got, fn(*inputs))
        picks.append(got.tolist())
    assert picks[0] != picks[1] != picks[2]
    assert next(iter(calls.graphs.values())).graph.replays == 2


def test_a_replayed_sparsevlm_filter_equals_the_eager_one():
    """SparseVLM's filter over a batch (each image's top-k by the raters' score and its best deleted slots, then the
    DPC-kNN merge of their hidden states and the runner's edit) replayed on new attention, layouts and hidden states
    (CUDA-graph semantics) gives the eager functions' ranks, keep mask, merged tokens' slots, layout key and states."""
    from functools import partial

    from mmfast.models.captured_tower import CapturedCalls
    from mmfast.pruning._sparsevlm_ops import filter_edit, filter_ranks
    from mmfast.runtime import LMRunner

    runner = LMRunner.__new__(LMRunner)  # replay_or_capture needs only the capture-time counter
    runner.capture_s = 0.0
    calls = CapturedCalls(runner, lambda: Counted, "test selections run")
    plan = ((0, 1, 20, 6, 5, 2), (1, 0, 10, 4, 0, 0), (1, 1, 20, 6, 5, 2))  # (sample, image, n, k, top, clusters)
    ranks_fn, edit_fn = partial(filter_ranks, plan=plan), partial(filter_edit, plan=plan)
    outs = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        image = torch.full((2, 40), -1, dtype=torch.long)
        for b in range(2):
            slots = torch.randperm(40, generator=g)
            image[b, slots[:20]], image[b, slots[20:30]] = 1, 0  # where this seed puts the images' slots
        image[0][image[0] == 0] = -1  # sample 0 holds image 1 only
        probs, rows = torch.rand(2, 3, 40, generator=g), torch.tensor([[4, 5, -1], [3, 4, 5]])
        hidden = torch.randn(80, 8, generator=g)  # [B * T, d]
        ranks = calls(("ranks", plan), ranks_fn, probs, rows, image)
        assert torch.equal(ranks, ranks_fn(probs, rows, image))
        recycled = hidden.index_select(0, ranks[-10:])  # the 5 + 5 recycled slots' states
        got, want = calls(("edit", plan), edit_fn, ranks, recycled, image >= 0), edit_fn(ranks, recycled, image >= 0)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        outs.append(got[0].tolist())  # the keep mask
    assert outs[0] != outs[1] != outs[2]
    assert all(c.graph.replays == 2 for c in calls.graphs.values())


@pytest.mark.parametrize("ordered", [False, True], ids=["slot-order", "edit-order"])
def test_a_replayed_layer_group_layout_equals_the_eager_one(ordered):
    """The runner's layout of a new layer group (each row's kept slots first, in slot order or an edit's layout
    order, left-padded; positions compacted; source and the kept slots' index gathered), replayed on other keep masks and
    inputs, equals the eager function's (nothing of the first call's picks is frozen in the graph)."""
    from functools import partial

    from mmfast.models.captured_tower import CapturedCalls
    from mmfast.runtime import LMRunner, group_layout

    runner = LMRunner.__new__(LMRunner)
    runner.capture_s = 0.0
    calls = CapturedCalls(runner, lambda: Counted, "test layouts are built")
    fn = partial(group_layout, new_len=16, compact=True)
    outs = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        keep = torch.rand(2, 24, generator=g) < 0.5
        keep[:, :8] = True
        keep[:, 8:] &= torch.arange(16) % 2 == 0  # at most 8 + 8 kept: new_len
        inputs = [keep, torch.arange(24).expand(2, -1), torch.randperm(24, generator=g).expand(2, -1)]
        if ordered:
            inputs.append(torch.rand(2, 24, generator=g, dtype=torch.float64) * 24)
        got, want = calls(("group", 16, True, not ordered), fn, *inputs), fn(*inputs)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        outs.append(got[2].tolist())  # the source slots
    assert outs[0] != outs[1] != outs[2]
    assert next(iter(calls.graphs.values())).graph.replays == 2


@pytest.mark.parametrize("name", ["tome", "visionzip"])
def test_a_tower_with_shape_only_hooks_is_one_captured_graph(name, captured, tiny_mm, images, prompts):
    """ToMe's merges (a replaced layer forward, a key recorder, the proportional-attention override, a reset
    pre-hook) and VisionZip's CLS-row probe and key recorder depend on shapes only: the tower runs with them as
    captured graphs, and what the feature stage reads (ToMe's provenance and sizes, VisionZip's CLS attention and
    keys) comes back from each replay. Batches of two pixel shapes, interleaved (A, B, A: the third replays A's
    graph after B's ran), give the eager tower's pruned features, patch ids (and ToMe's token sizes), and
    generate the dynamic cache's tokens."""
    from mmfast.registry import PRUNERS

    recipe = {"pruning": [{"method": name, "params": PRUNERS.get(name).cls.test_params(tiny_mm.adapter)}]}
    runs = [(images[:2], prompts[:2]), (images[2:3], prompts[:1]), (images[1:3], [prompts[1], prompts[0]])]

    def encoded(s):
        out = []
        for imgs, ps in runs:
            v = s.encode(tiny_mm.prepare(imgs, ps))
            out.append((v.features, v.patch_ids, v.extras.get("tome.size", [])))
        return out

    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="off") as s:
        want = encoded(s)
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        got = encoded(s)
        towers = dict(s.adapter.tower_graphs.graphs)
        tokens = [[r.token_ids for r in s.generate(imgs, ps, max_new_tokens=4, seed=0)] for imgs, ps in runs]
    assert len(towers) == 2 and sorted(c.graph.replays for c in towers.values()) == [1, 3]  # B once, A thrice
    assert not torch.equal(want[0][1][0], want[2][1][0])  # the batches merge differently
    for (wf, wi, ws), (gf, gi, gs) in zip(want, got):
        for a, b in [*zip(wf, gf), *zip(wi, gi), *zip(ws, gs)]:
            assert torch.equal(a, b)
    assert tokens == [_dynamic(tiny_mm, recipe, imgs, ps, 4) for imgs, ps in runs]


def test_hicoms_guided_tower_is_captured_and_its_hook_carried(captured, tiny_mm, images, prompts):
    """HICom reads the last vision layer's output through a forward hook (shape-only): the tower is captured and
    the output the guide compares with the text comes back from each replay (the kept features equal the eager
    tower's over interleaved batch shapes). Its CLIP text guide is a captured graph too (ids padded to the text
    tower's width, no padding mask to read: one graph per batch size, the batch of two replayed)."""
    from mmfast.registry import PRUNERS

    recipe = {"pruning": [{"method": "hicom", "params": PRUNERS.get("hicom").cls.test_params(tiny_mm.adapter)}]}
    runs = [(images[:2], prompts[:2]), (images[2:3], prompts[:1]), (images[1:3], [prompts[1], prompts[0]])]

    def encoded(s):
        return [s.encode(tiny_mm.prepare(imgs, ps)).features for imgs, ps in runs]

    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="off") as s:
        want = encoded(s)
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        got = encoded(s)
        towers = dict(s.adapter.tower_graphs.graphs)
        guides = {key: c for key, c in s.ctx.captured.graphs.items() if key[0] == ("hicom clip text",)}
    assert len(towers) == 2
    assert sorted(c.graph.replays for c in guides.values()) == [0, 1]  # batch 2 (replayed once), batch 1
    for w, g in zip(want, got):
        assert all(torch.equal(a, b) for a, b in zip(w, g))


@pytest.mark.parametrize("release", [False, True], ids=["exact", "release"])
def test_a_replayed_beam_search_equals_the_eager_one(release):
    """Beam search's bookkeeping (:func:`~mmfast.decoding.beam.beam_step`: candidates, running beams, finished pool,
    early stop; the release scorer's finalize at the limit) replayed step after step on new scores (CUDA-graph
    semantics: the length and every state are inputs) gives the eager search's beams, tokens, stop and hypotheses:
    one graph for the steps before the limit, one for the last."""
    from mmfast.decoding.beam import BeamSearch
    from mmfast.models.captured_tower import CapturedCalls
    from mmfast.runtime import LMRunner

    runner = LMRunner.__new__(LMRunner)
    runner.capture_s = 0.0
    calls = CapturedCalls(runner, lambda: Counted, "test beam steps run")
    b, k, vocab, max_new = 2, 3, 40, 7
    stop = torch.tensor([3, 5])
    prompt_len = torch.tensor([9, 4]) if release else None
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        eager = BeamSearch(b, k, max_new, 1.3, torch.device("cpu"), prompt_len=prompt_len)
        replayed = BeamSearch(b, k, max_new, 1.3, torch.device("cpu"), prompt_len=prompt_len, run=calls)
        while not eager.done:
            logits = torch.randn(b * k, vocab, generator=g) * 3
            logits[:, 3] += 2.0 * seed  # the second call's beams stop sooner
            log_probs = torch.log_softmax(logits, -1)
            want, got = eager.step(log_probs, stop), replayed.step(log_probs, stop)
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)) and replayed.done == eager.done
            for x, y in zip(replayed.state.tensors(), eager.state.tensors(), strict=True):
                assert torch.equal(x, y)
        assert replayed.best() == eager.best() and all(eager.best())
    assert len(calls.graphs) == 2  # the steps before the limit, the last step
    assert sum(c.graph.replays for c in calls.graphs.values()) >= max_new
