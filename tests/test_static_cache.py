"""The static KV cache (``model.compile: static``): per-layer preallocated buffers, fixed-shape decode
steps over the whole buffer, and exactness against the dynamic cache.

In fp32 on the CPU the static path must give the same tokens as the dynamic one for every decoder,
drafter and pruner it serves; methods whose decode hooks need the dynamic step declare it
(``Capabilities.dynamic_decode``) and fall back with one log line.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers.cache_utils import DynamicLayer

import mmfast
from mmfast import compat
from mmfast._graph_emulator import ReplayEmulator
from mmfast.capabilities import caps_of
from mmfast.config import Recipe, load_recipe
from mmfast.errors import ConfigError, InputError
from mmfast.registry import DECODERS, PRUNERS


@pytest.fixture
def padded_steps(monkeypatch):
    """Counts the decode steps that ran on a static cache with whole-buffer shapes."""
    count = [0]
    original = compat.set_padded

    def spy(cache, padded):
        count[0] += int(padded)
        original(cache, padded)

    monkeypatch.setattr(compat, "set_padded", spy)
    return count


def _tokens(mm, recipe: dict, images, prompts, compile: str, n: int = 8) -> list[list[int]]:
    with mmfast.apply(mm, load_recipe(recipe), compile=compile) as s:
        # seeded: an unseeded call follows torch's global RNG, so two calls of a sampling decoder differ
        return [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=n, seed=0)]


def _stage(name: str, mm) -> dict:
    return {"method": name, "params": PRUNERS.get(name).cls.test_params(mm.adapter)}


SERVED = {
    "greedy": {},
    "sample-seeded": {"decoding": {"method": "sample", "params": {"top_k": 20}, "seed": 5}},
    "vcd": {"decoding": {"method": "vcd", "params": {"sample": False}}},
    "beam": {"decoding": {"method": "beam", "params": {"num_beams": 3}}},
    "vhr": {"decoding": {"method": "vhr"}},
    "prompt_lookup": {"speculative": {"method": "prompt_lookup"}},
    "layer_skip": {"speculative": {"method": "layer_skip"}},
}
PRUNED = ["fastv", "pyramiddrop", "dart", "visionzip", "divprune"]


@pytest.mark.parametrize("name", list(SERVED))
def test_static_decoders_and_drafters_match_dynamic(name, tiny_mm, images, prompts, padded_steps):
    recipe = SERVED[name]
    dynamic = _tokens(tiny_mm, recipe, images, prompts, "off")
    assert padded_steps[0] == 0
    static = _tokens(tiny_mm, recipe, images, prompts, "static")
    assert padded_steps[0] > 0, "the static path did not run"
    assert static == dynamic


def test_layer_skip_draft_steps_and_target_steps_are_separate_graphs(tiny_mm, images, prompts):
    """A captured one-token step records the layer-skip branch it ran (the draft's skips or the full target): a
    draft step, a target step and a draft step again, each from the same slots, replay graphs with the eager
    logits of their own branch (keyed on ``runner.graph_variants``), not the first graph captured at that width."""
    recipe = load_recipe({"speculative": {"method": "layer_skip", "params": {"skip": [1, 2], "gamma": 2}}})
    with mmfast.apply(tiny_mm, recipe, compile="static") as s:
        batch = tiny_mm.prepare(images[:1], prompts[:1])
        inputs = s.build_inputs(batch, s.encode(batch))
        token = torch.tensor([[5]])

        def steps(capture) -> list[torch.Tensor]:
            out = []
            with torch.inference_mode(), s.runner.static_cache(8, capture):
                state, _ = s.runner.prefill(inputs)
                for draft in (True, False, True, False):
                    cp = state.checkpoint()
                    s.drafter.active = draft
                    try:
                        out.append(s.runner.step(state, token).logits)  # [1, 1, V]
                    finally:
                        s.drafter.active = False
                    state.rollback(cp)
                s.runner.finish(state)
            return out

        eager = steps(None)
        EmulatedGraph.made = []
        replayed = steps(EmulatedGraph)
    assert not torch.allclose(eager[0], eager[1], atol=1e-3), "the draft's skips must change the logits"
    for want, got in zip(eager, replayed):
        torch.testing.assert_close(got, want)
    # one graph per branch, each captured then replayed once (the prompt's captured prefill beside them)
    assert sorted(g.replays for g in EmulatedGraph.made if g.replays) == [1, 1]


@pytest.mark.parametrize("pruner", PRUNED)
@pytest.mark.parametrize("decoding", ["beam", "prompt_lookup"])  # greedy: test_every_pruner_...
def test_static_pruners_match_dynamic(pruner, decoding, tiny_mm, images, prompts, padded_steps):
    recipe: dict = {"pruning": [_stage(pruner, tiny_mm)]}
    if decoding == "beam":
        recipe["decoding"] = {"method": "beam", "params": {"num_beams": 2}}
    elif decoding == "prompt_lookup":
        recipe["speculative"] = {"method": "prompt_lookup"}
    dynamic = _tokens(tiny_mm, recipe, images, prompts, "off")
    static = _tokens(tiny_mm, recipe, images, prompts, "static")
    assert padded_steps[0] > 0
    assert static == dynamic


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "emulated"])
@pytest.mark.parametrize("name", ["msd", "flash", "flash-rounds-1"])
def test_static_trained_drafters_match_dynamic(name, captured, tiny_mm, images, prompts, padded_steps, monkeypatch):
    """Eager static steps, and captured ones (CUDA-graph semantics emulated; every verify tree padded to
    ``total_tokens``), with FastV's layer groups: MSD's tree and FLASH's blocks (one round, and two with their
    draft forward) are captured (greedy cycles on the device)."""
    from mmfast.pipeline import Session
    from mmfast.speculative._eagle_model import _model_dir, write_random_draft

    method = name.split("-")[0]
    d = _model_dir(tiny_mm)
    arch = {"sar_k": 3, "n_latents": 4} if method == "flash" else {}
    if not (d / method).exists():
        write_random_draft(tiny_mm, method, d / method, **arch)
    params = {
        "msd": {"depth": 3, "top_k": 4, "total_tokens": 16},
        "flash": {"top_k": 4, "total_tokens": 12, "rounds": 2},
        "flash-rounds-1": {"top_k": 4, "total_tokens": 12},
    }
    recipe = {"speculative": {"method": method, "params": params[name]}, "pruning": [_stage("fastv", tiny_mm)]}
    dynamic = _tokens(tiny_mm, recipe, images, prompts, "off", n=12)
    EmulatedGraph.made = []
    if captured:
        monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    assert _tokens(tiny_mm, recipe, images, prompts, "static", n=12) == dynamic
    assert padded_steps[0] > 0
    if captured:  # a cycle on the device: one verify width, the draft's proposal and accept step, the verdict and
        # the target's keep, and the tower; the second sample's longer prompt needs larger buffers than the first's (a
        # second verify graph; second draft graphs when the draft's grow). FastV's layer group laid out once per
        # prompt length (two)
        assert len(EmulatedGraph.made) <= 10 and sum(g.replays for g in EmulatedGraph.made) >= 3


@pytest.mark.parametrize("name", ["flash", "msd"])
def test_drafters_capture_their_own_steps(name, tiny_mm, images, prompts, monkeypatch, caplog):
    """Under captured steps (CUDA-graph semantics emulated) the drafter's accept step and its proposal (FLASH's
    one block, MSD's EAGLE-2 tree) are graphs of their own, replayed every cycle, with the dynamic cache's
    tokens, and the target's prefill, which hands the draft every slot's hidden state, is a captured segment too
    (its bucket's padding cut off the hidden states); a draft capture that raises leaves the draft's steps eager
    with one log line, tokens unchanged."""
    from mmfast.pipeline import Session
    from mmfast.speculative import _eagle
    from mmfast.speculative._eagle_model import _model_dir, write_random_draft

    d = _model_dir(tiny_mm)
    if not (d / name).exists():
        write_random_draft(tiny_mm, name, d / name, **({"sar_k": 3, "n_latents": 4} if name == "flash" else {}))
    params = {"flash": {"top_k": 4, "total_tokens": 12}, "msd": {"depth": 3, "top_k": 4, "total_tokens": 16}}
    recipe = load_recipe({"speculative": {"method": name, "params": params[name]}})
    dynamic = _tokens(tiny_mm, recipe.to_dict(), images, prompts, "off", n=12)
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    EmulatedGraph.made = []
    with mmfast.apply(tiny_mm, recipe, compile="static") as s:
        res = s.generate(images[:2], prompts[:2], max_new_tokens=12, seed=0)
        graphs = dict(s.drafter._graphs)
        assert any(key[1] == "prefill" for key in s.runner.pool.graphs)
        # a graph reads fixed addresses: weights, the draft's cache and rope table, the root buffer and the
        # draft's device counters, its inputs
        dr, model = s.drafter, s.runner.adapter.model
        owned = [*model.parameters(), *model.buffers(), *dr.model.parameters(), dr.cache.k, dr.cache.v, dr._root]
        owned.append(dr._meta)
        owned += [t for t in vars(dr.cache.f).values() if isinstance(t, torch.Tensor)] + list(dr.model._rope_table)
        owned += [t for g in graphs.values() for t in g.static.values()]
        allowed = {t.untyped_storage().data_ptr() for t in owned}
        reads = [t for g in graphs.values() for t in g.graph.inputs]
        strays = [tuple(t.shape) for t in reads if t.untyped_storage().data_ptr() not in allowed]
        assert reads
        assert not strays, f"a draft graph reads tensors the host owns: {strays}"
    assert [r.token_ids for r in res] == dynamic
    steps = {key[0] for key in graphs}
    assert steps == ({"accept", "sar"} if name == "flash" else {"accept", "eagle2"})
    cycles = sum(r.stats["speculative"]["cycles"] for r in res)  # the batch's (samples run one at a time)
    assert cycles >= 3
    # every cycle replays each draft step, but the one that captured it (the draft's buffers hold both samples)
    assert all(g.graph.replays == cycles - 1 for g in graphs.values()), (cycles, graphs)

    class Refused(EmulatedGraph):  # the draft's graphs only: the verify step still captures
        def capture(self, fn):
            raise RuntimeError("capture refused")

    factory = _eagle.EagleDrafter._factory
    monkeypatch.setattr(_eagle.EagleDrafter, "_factory", lambda self, ctx: factory(self, ctx) and Refused)
    with caplog.at_level(logging.INFO, logger="mmfast.speculative._eagle"):
        with mmfast.apply(tiny_mm, recipe, compile="static") as s:
            out = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=12, seed=0)]
            assert s.drafter._graphs == {} and s.drafter._capture_refused
    assert out == dynamic
    assert [r.getMessage() for r in caplog.records if "draft steps run without" in r.getMessage()] == [
        f"{name}: draft steps run without a captured graph (RuntimeError: capture refused)"
    ]


@pytest.mark.parametrize("decoding", ["greedy", "sample"])
@pytest.mark.parametrize("name", ["flash", "msd"])
def test_embedded_drafts_cycles_run_on_the_device(name, decoding, images, monkeypatch):
    """Greedy and seeded sampled cycles of the embedded model's trained drafts under captured steps run on the
    device (the proposal, verify, verdict, keep and draft-accept graphs back to back, one read a cycle; sampling:
    the point-mass verdict on uniforms drawn before it): the dynamic cache's tokens, and the same tokens and
    speculative statistics (tau, acceptance by depth, draft forwards) as the cycles with the tree and verdict on the
    host; the trained FLASH draft accepts branches that are not the tree's first chain, kept in the target's cache
    by the captured keep; every graph is replayed."""
    from mmfast.pipeline import Session
    from mmfast.registry import DRAFTERS
    from mmfast.runtime import LMRunner
    from mmfast.speculative import engine
    from mmfast.speculative.base import Drafter

    mm = mmfast.load("mmfast/tiny-world")
    params = {"flash": {"top_k": 4, "total_tokens": 12}, "msd": {"depth": 3, "top_k": 4, "total_tokens": 16}}
    sampled = {"decoding": {"method": "sample", "params": {"temperature": 0.7, "top_k": 20}, "seed": 3}}
    recipe = load_recipe({"speculative": {"method": name, "params": params[name]}, **sampled})
    if decoding == "greedy":
        recipe = load_recipe({"speculative": {"method": name, "params": params[name]}})
    prompts = ["Please describe this image in detail."] * 2
    dynamic = _tokens(mm, recipe.to_dict(), images, prompts, "off", n=40)
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)

    def run() -> tuple[list[list[int]], dict, list, int]:
        kept, on_device = [], []
        original, cycle = LMRunner.kept_on_device, engine._cycle_on_device

        def spy(self, state, n_new, keep):
            kept.append(keep.tolist())
            return original(self, state, n_new, keep)

        with monkeypatch.context() as m:
            m.setattr(LMRunner, "kept_on_device", spy)
            m.setattr(engine, "_cycle_on_device", lambda *a: on_device.append(1) or cycle(*a))
            EmulatedGraph.made = []
            with mmfast.apply(mm, recipe, compile="static") as s:
                res = s.generate(images[:2], prompts, max_new_tokens=40, seed=0)
        return [r.token_ids for r in res], [r.stats["speculative"] for r in res], kept, len(on_device)

    device, device_stats, kept, n_device = run()
    graphs = list(EmulatedGraph.made)
    monkeypatch.setattr(DRAFTERS.get(name).cls, "propose_on_device", Drafter.propose_on_device)
    host, host_stats, _, n_host = run()
    assert device == dynamic == host
    cycles = sum(st["cycles"] for st in device_stats)  # each result holds its own sample's
    assert device_stats == host_stats and cycles == n_device == len(kept) and n_host == 0
    if name == "flash":  # branches that are not the first chain
        assert sum(k != list(range(len(k))) for k in kept) >= 2
    assert sum(g.replays > 0 for g in graphs) >= 5  # proposal, verify, verdict, keep and accept, every cycle
    assert sum(st["committed"] for st in device_stats) / cycles > 1.5  # drafts were accepted (sampling too)


@pytest.mark.parametrize("decoding", ["greedy", "sample"])
def test_flash_rounds_propose_in_one_captured_step(decoding, images, monkeypatch):
    """FLASH with further rounds (a draft forward a round over the k best paths' distinct nodes, its rows' slots and
    positions from the draft's device counters) proposes in one captured step, so its cycles run on the device: every
    proposal's tree equals the eager proposal's (``sar_tree``, with its early stop and without), the tokens equal the
    dynamic cache's, and the proposal's graph is replayed each cycle."""
    from mmfast.pipeline import Session
    from mmfast.speculative import engine
    from mmfast.speculative._eagle import _tree_of
    from mmfast.speculative.flash import Flash

    mm = mmfast.load("mmfast/tiny-world")
    params = {"top_k": 4, "total_tokens": 20, "rounds": 3}
    recipe = {"speculative": {"method": "flash", "params": params}}
    if decoding == "sample":
        recipe["decoding"] = {"method": "sample", "params": {"temperature": 0.7, "top_k": 20}, "seed": 3}
    prompts = ["Please describe this image in detail."] * 2
    dynamic = _tokens(mm, recipe, images, prompts, "off", n=40)
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    compared, on_device = [], []
    captured, cycle = Flash._propose_captured, engine._cycle_on_device

    def spy(self, ctx, factory):
        packed = captured(self, ctx, factory)
        tree = _tree_of(packed.clone(), params["total_tokens"])
        for early_stop in (True, False):
            want, _ = self.sar_tree(params["rounds"], params["top_k"], params["total_tokens"], early_stop)
            compared.append(tree.token_list == want.token_list and tree.parent_list == want.parent_list)
        return packed

    monkeypatch.setattr(Flash, "_propose_captured", spy)
    monkeypatch.setattr(engine, "_cycle_on_device", lambda *a: on_device.append(1) or cycle(*a))
    EmulatedGraph.made = []
    with mmfast.apply(mm, load_recipe(recipe), compile="static") as s:
        res = s.generate(images[:2], prompts, max_new_tokens=40, seed=0)
        sar = [g.graph for key, g in s.drafter._graphs.items() if key[0] == "sar"]
    stats = [r.stats["speculative"] for r in res]  # each sample's own
    cycles = sum(st["cycles"] for st in stats)
    assert [r.token_ids for r in res] == dynamic
    assert len(compared) >= 10 and all(compared)
    assert len(on_device) == cycles and all(st["draft_forwards"] == st["cycles"] * 3 + 1 for st in stats)  # + begin
    assert len(sar) == 1 and sar[0].replays >= cycles - 2
    if decoding == "greedy":  # a second block was tried (the embedded draft: K = 5 levels a block)
        assert max(d for st in stats for d in st["acceptance_by_depth"]) > 5


def test_a_greedy_cycle_whose_verdict_cannot_be_captured_finishes_eagerly(images, monkeypatch, caplog):
    """A capture that fails inside a cycle on the device (here the verdict's, made to read the host) leaves the
    block's steps eager with one warning: the rest of that cycle runs its steps' functions eagerly, later cycles
    run on the host, and the tokens are the dynamic cache's."""
    from mmfast.pipeline import Session
    from mmfast.speculative import engine

    mm = mmfast.load("mmfast/tiny-world")
    recipe = {"speculative": {"method": "flash", "params": {"top_k": 4, "total_tokens": 12}}}
    prompts = ["Please describe this image in detail."]
    dynamic = _tokens(mm, recipe, images[:1], prompts, "off", n=24)
    verdict = engine.greedy_accept

    def reads_the_host(tokens, parents, logits, root, levels):
        float(logits.sum())  # a sync: a CUDA capture fails on it, as the emulator does
        return verdict(tokens, parents, logits, root, levels)

    monkeypatch.setattr(engine, "greedy_accept", reads_the_host)
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    with caplog.at_level(logging.WARNING, logger="mmfast.runtime"):
        got = _tokens(mm, recipe, images[:1], prompts, "static", n=24)
    assert got == dynamic
    failed = [r.getMessage() for r in caplog.records if "capturing the step failed" in r.getMessage()]
    assert len(failed) == 1 and "CaptureHostReadError" in failed[0]


@pytest.mark.parametrize("preset", ["exact", "release"])
def test_beam_reorders_and_steps_are_captured_graphs(preset, tiny_mm, images, prompts, monkeypatch):
    """Beam search under captured steps (CUDA-graph semantics emulated) reorders every layer's static K / V rows
    by one captured graph and runs its bookkeeping (:func:`beam_step`) as another, each replayed at each step, with
    the dynamic cache's tokens."""
    from mmfast.pipeline import Session

    recipe = {"decoding": {"method": "beam", "params": {"num_beams": 2, "preset": preset}}}
    dynamic = _tokens(tiny_mm, recipe, images[:2], prompts[:2], "off", n=8)
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        got = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=8, seed=0)]
        reorders = [g for key, g in s.runner.pool.graphs.items() if key[1] == "reorder"]
        steps = [g for key, g in s.ctx.captured.graphs.items() if key[0][0] == "beam"]
    assert got == dynamic
    assert len(reorders) == 1 and reorders[0].graph.replays >= 5
    assert len(steps) >= 1 and steps[0].graph.replays >= 5  # the steps before the length limit: one graph


DECODER_PARAMS = {"beam": {"num_beams": 2}, "opera": {"num_beams": 2, "num_attn_candidates": 2}}


def _served_or_named(mm, recipe: dict, where: str, images, prompts, padded_steps, caplog) -> None:
    """The static path ran and matched the dynamic one, or the recipe fell back with a line naming ``where``."""
    dynamic = _tokens(mm, recipe, images, prompts, "off", n=5)
    with caplog.at_level(logging.INFO, logger="mmfast.pipeline"):
        static = _tokens(mm, recipe, images, prompts, "static", n=5)
    fell_back = [r.getMessage() for r in caplog.records if "model.compile" in r.getMessage()]
    assert static == dynamic
    if padded_steps[0] == 0:
        assert len(fell_back) == 1 and where in fell_back[0], f"{where}: neither static steps nor a fallback line"
    else:
        assert not fell_back


@pytest.mark.parametrize("pruner", [e.name for e in PRUNERS.entries()])
def test_every_pruner_is_served_or_falls_back(pruner, tiny_mm, images, prompts, padded_steps, caplog):
    if caps_of(PRUNERS.get(pruner).cls, None).videos_only:
        pytest.skip(f"needs a video input: its no-op, batch and static-cache checks are in tests/test_{pruner}.py")
    recipe = {"pruning": [_stage(pruner, tiny_mm)]}
    _served_or_named(tiny_mm, recipe, f"pruning[0] ({pruner})", images, prompts, padded_steps, caplog)


@pytest.mark.parametrize("decoder", [e.name for e in DECODERS.entries()])
def test_every_decoder_is_served_or_falls_back(decoder, tiny_mm, images, prompts, padded_steps, caplog):
    recipe = {"decoding": {"method": decoder, "params": DECODER_PARAMS.get(decoder, {})}}
    _served_or_named(tiny_mm, recipe, f"decoding ({decoder})", images, prompts, padded_steps, caplog)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    from mmfast.models.factory import random_qwen_vl, save_model

    model, processor = random_qwen_vl("qwen2_vl")
    return mmfast.load(save_model(model, processor, tmp_path_factory.mktemp("qwen_static")), device="cpu")


@pytest.mark.parametrize("speculative", [False, True])
def test_static_mrope_matches_dynamic(speculative, qwen2_vl, images, prompts, padded_steps):
    """Multimodal RoPE (3-axis positions) through a pruned layer group, plain and with a verify tree."""
    mixed = [im if i % 2 == 0 else im.resize((32, 64)) for i, im in enumerate(images)]
    recipe: dict = {"pruning": [_stage("fastv", qwen2_vl)]}
    if speculative:
        recipe["speculative"] = {"method": "prompt_lookup"}
    assert _tokens(qwen2_vl, recipe, mixed, prompts, "static") == _tokens(qwen2_vl, recipe, mixed, prompts, "off")
    assert padded_steps[0] > 0


@pytest.mark.parametrize("speculative", [False, True])
def test_captured_mrope_matches_dynamic(speculative, qwen2_vl, images, prompts, monkeypatch):
    """The same under CUDA-graph semantics (:class:`EmulatedGraph`): a pruned group's 3-axis positions
    and rotary embeddings are computed inside the replayed step, not frozen at capture."""
    from mmfast.pipeline import Session

    mixed = [im if i % 2 == 0 else im.resize((32, 64)) for i, im in enumerate(images)]
    recipe: dict = {"pruning": [_stage("fastv", qwen2_vl)]}
    if speculative:
        recipe["speculative"] = {"method": "prompt_lookup"}
    dynamic = _tokens(qwen2_vl, recipe, mixed, prompts, "off")
    EmulatedGraph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    assert _tokens(qwen2_vl, recipe, mixed, prompts, "static") == dynamic
    assert sum(g.replays for g in EmulatedGraph.made) >= 5


def test_in_llm_pruning_gives_later_layers_smaller_buffers(tiny_mm, images, prompts):
    """Capacity is per layer: the prompt's length at that layer after pruning + max_new_tokens + 1."""
    caps = []
    with mmfast.apply(tiny_mm, {"pruning": [_stage("fastv", tiny_mm)]}, compile="static") as s:
        runner = s.runner
        original = runner.prefill

        def prefill(inputs, **kw):
            state, out = original(inputs, **kw)
            caps.append(
                (
                    [compat.static_capacity(state.cache, i) for i in range(state.n_layers)],
                    [g.length for g in state.groups],
                    [g.start for g in state.groups],
                )
            )
            return state, out

        runner.prefill = prefill
        s.generate(images[:1], prompts[:1], max_new_tokens=5)
    ((capacity, lengths, starts),) = caps
    assert len(lengths) == 2, "fastv made no second layer group"
    for layer, c in enumerate(capacity):
        g = 1 if layer >= starts[1] else 0
        assert c == lengths[g] + 5 + 1
    assert capacity[-1] < capacity[0]


@pytest.mark.parametrize(
    "decoding",
    [
        {"method": "opera", "params": {"num_beams": 2, "num_attn_candidates": 2, "lookahead": "clone"}},
    ],
)
def test_dynamic_only_methods_fall_back_with_one_log_line(decoding, tiny_mm, images, prompts, padded_steps, caplog):
    recipe = {"decoding": decoding}
    dynamic = _tokens(tiny_mm, recipe, images, prompts, "off", n=5)
    with caplog.at_level(logging.INFO, logger="mmfast.pipeline"):
        with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
            first = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=5)]
            s.generate(images[:2], prompts[:2], max_new_tokens=5)
    lines = [r.getMessage() for r in caplog.records if "model.compile" in r.getMessage()]
    assert len(lines) == 1 and f"decoding ({decoding['method']})" in lines[0] and "dynamic KV cache" in lines[0]
    assert padded_steps[0] == 0
    assert first == dynamic


def test_auto_is_static_on_cuda_only(tiny_mm, images, prompts, padded_steps):
    assert Recipe().model.compile == "auto"  # the default
    _tokens(tiny_mm, {}, images, prompts, "auto", n=3)
    assert padded_steps[0] == 0  # the CPU: the dynamic cache


def _python_every_step(s) -> None:
    """A plain pre-hook on an LLM layer's MLP (a user's or a method's Python that must run in every forward): not
    replayable, so it keeps decode steps and the prefill's segments out of captured graphs."""
    s.hooks.pre_hook(s.ctx.adapter.layers[1].mlp, lambda module, args: None)


def test_auto_captures_or_keeps_the_dynamic_cache(tiny_mm, images, prompts, padded_steps, monkeypatch, caplog):
    """On CUDA (here: a stand-in graph), auto captures the steps it can (FastV's probe records at prefill
    only; VHR's head-scaling pre-hooks read fixed memory, replayable); a session whose step cannot be captured
    (a plain hook on an LLM module: Python in every step) decodes on the dynamic cache, where eager static steps
    would only be slower (measured on an H100, FastV before its probe was prefill-only: 8.4 vs 5.2 ms per
    token), and says why once."""
    from mmfast.pipeline import Session

    monkeypatch.setattr(Session, "_captures", lambda self: self.recipe.model.compile == "auto")
    monkeypatch.setattr(Session, "_capture_factory", lambda self: ReplayGraph if self._captures() else None)
    monkeypatch.setattr(Session, "_tower_capture_factory", lambda self: None)  # the LLM's graphs only here
    ReplayGraph.made = []
    dynamic = _tokens(tiny_mm, {}, images, prompts, "off")
    assert _tokens(tiny_mm, {}, images, prompts, "auto") == dynamic
    assert padded_steps[0] > 0 and ReplayGraph.made
    for recipe in ({"pruning": [_stage("fastv", tiny_mm)]}, SERVED["vhr"]):
        steps, made = padded_steps[0], len(ReplayGraph.made)
        assert _tokens(tiny_mm, recipe, images, prompts, "auto") == _tokens(tiny_mm, recipe, images, prompts, "off")
        assert padded_steps[0] > steps and len(ReplayGraph.made) > made  # captured
    steps, made = padded_steps[0], len(ReplayGraph.made)
    with caplog.at_level(logging.INFO, logger="mmfast.pipeline"):
        for _ in range(2):
            with mmfast.apply(tiny_mm, load_recipe({}), compile="auto") as s:
                _python_every_step(s)
                got = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=8, seed=0)]
                assert got == dynamic
    assert padded_steps[0] == steps and len(ReplayGraph.made) == made  # the dynamic cache, no graph
    lines = [r.getMessage() for r in caplog.records if "dynamic KV cache" in r.getMessage()]
    assert len(lines) == 2 and all("no captured graph: hooks on the language model's modules" in x for x in lines)


def test_a_one_token_call_without_capturable_steps_or_prefill_keeps_the_dynamic_cache(
    tiny_mm, images, prompts, monkeypatch
):
    """A one-token call takes the static cache under auto where its prefill's segments can be captured even if
    its steps cannot (ZipVL: ``test_zipvl_one_token_call_prefills_in_captured_segments``); where neither can
    (a plain hook on an LLM layer), it keeps the dynamic cache and captures nothing."""
    from mmfast.pipeline import Session

    monkeypatch.setattr(Session, "_captures", lambda self: self.recipe.model.compile == "auto")
    monkeypatch.setattr(Session, "_capture_factory", lambda self: ReplayGraph if self._captures() else None)
    monkeypatch.setattr(Session, "_tower_capture_factory", lambda self: None)  # the LLM's graphs only here
    ReplayGraph.made = []
    with mmfast.apply(tiny_mm, load_recipe({}), compile="auto") as s:
        _python_every_step(s)
        assert s.runner.capture_blocker() is not None and s.runner.prefill_graph_blocker() is not None
        s.generate(images[:2], prompts[:2], max_new_tokens=1)
        assert s.runner.pool.kept_bytes == 0
    assert ReplayGraph.made == []


def test_vhrs_decode_steps_are_captured_with_each_calls_heads(tiny_mm, images, prompts, padded_steps, monkeypatch):
    """VHR's o_proj pre-hooks scale the heads chosen at the first token in every later step: they read the scales
    from fixed memory, refilled after each prefill, so the step is one captured graph (under the emulator: a
    replay runs only the recorded kernels). Tokens equal the dynamic cache's for two calls whose chosen heads
    differ. The joint prefill's rows (image and text-only streams) are cut to the image rows after it in place
    (views of the buffers), so the second call's cache takes the first's buffers and replays its step."""
    from mmfast.pipeline import Session

    recipe = load_recipe(SERVED["vhr"])
    calls = [(images[:2], prompts[:2]), (images[2:4], prompts[:2])]  # other images, prompts of the same lengths

    def run(s, which=calls):
        out = [s.generate(imgs, ps, max_new_tokens=8, seed=0) for imgs, ps in which]
        return [[(r.token_ids, r.stats["vhr"]["selected_heads"]) for r in res] for res in out]

    dynamic = []
    for call in calls:  # each call in a session of its own: nothing carried over from another call
        with mmfast.apply(tiny_mm, recipe, compile="off") as s:
            dynamic += run(s, [call])
    assert [h for _, h in dynamic[0]] != [h for _, h in dynamic[1]]  # the calls reinforce different heads
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    monkeypatch.setattr(Session, "_tower_capture_factory", lambda self: None)  # the LLM's graphs only here
    EmulatedGraph.made = []
    with mmfast.apply(tiny_mm, recipe, compile="static") as s:
        assert s.runner.capture_blocker() is None
        assert run(s) == dynamic
    assert padded_steps[0] > 0 and [g.replays for g in EmulatedGraph.made] == [13]  # 7 steps a call, 1 captured


@pytest.mark.parametrize("keep_rate", [None, 1.0], ids=["pruned", "no-prefill-group"])
def test_dynamic_llavas_decode_steps_are_captured(keep_rate, tiny_mm, images, prompts, padded_steps, monkeypatch):
    """Dynamic-LLaVA's text predictor decides at every step whether the new token's KV stays in layers >= K. On
    a static cache it runs inside the captured step (its decision carried out of each replay), the dropped slots
    are masked out of those layers' validity instead of cut from the fixed buffers, and a token generated after
    a drop keeps group 0's position there (the runner's rule in ``LMRunner.step``). Tokens and the per-sample
    generated / skipped counts equal the dynamic cache's (which cuts the slots), at batch 2 and 1, with and
    without a prefill layer group at K (the first step splits one off). Under the emulator only: the decision a
    replay puts back is the graph's memory, which :class:`ReplayGraph`'s re-run does not write."""
    from mmfast.pipeline import Session

    graph = EmulatedGraph
    stage = _stage("dynamic_llava", tiny_mm)
    if keep_rate is not None:
        stage["params"] = {**stage["params"], "vision_keep_rate": keep_rate}
    recipe = load_recipe({"pruning": [stage]})

    def run(s, lo, hi):
        out = s.generate(images[lo:hi], prompts[lo:hi], max_new_tokens=8, seed=0)
        return [(r.token_ids, r.stats["dynamic_llava"]) for r in out]

    with mmfast.apply(tiny_mm, recipe, compile="off") as s:
        dynamic, single = run(s, 0, 2), run(s, 2, 3)
    assert any(st["kv_skipped"] > 0 for _, st in dynamic + single)  # drops happened: the masking is exercised
    monkeypatch.setattr(Session, "_capture_factory", lambda self: graph)
    graph.made = []
    with mmfast.apply(tiny_mm, recipe, compile="static") as s:
        assert s.runner.capture_blocker() is None
        assert run(s, 0, 2) == dynamic and run(s, 2, 3) == single
    assert padded_steps[0] > 0 and sum(g.replays for g in graph.made) >= 10  # every step a replay but the first


@pytest.mark.parametrize("graph", ["ReplayGraph", "EmulatedGraph"], ids=["rerun", "emulated"])
def test_zipvl_one_token_call_prefills_in_captured_segments(graph, tiny_mm, images, prompts, monkeypatch, caplog):
    """ZipVL owns the KV cache (quantised after the prefill) and overrides every layer's attention, so its
    decode steps stay on the dynamic cache; a one-token call has none: under auto its prefill runs on the
    static cache as captured segments, the probe rows staged as the graph's input and the sparse prefill in
    fixed shapes (no host read: the emulator refuses one), and the cache is quantised after it. Tokens,
    selections and KV bytes equal the dynamic cache's; a second call replays the graphs on the pool's buffers."""
    from mmfast.pipeline import Session
    from mmfast.pruning._kv_quant import MixedPrecisionKVLayer

    graph = {"ReplayGraph": ReplayGraph, "EmulatedGraph": EmulatedGraph}[graph]
    recipe = load_recipe({"pruning": [_stage("zipvl", tiny_mm)]})

    def call(s, lo, hi):
        out = s.generate(images[lo:hi], prompts[lo:hi], max_new_tokens=1)
        return [(r.token_ids, r.stats["zipvl"], r.kv_bytes_prefill) for r in out]

    with mmfast.apply(tiny_mm, recipe, compile="off") as s:
        dynamic, single = call(s, 0, 2), call(s, 2, 3)
    with mmfast.apply(tiny_mm, recipe, compile="static") as s:  # the same fixed-shape prefill, eagerly
        assert call(s, 0, 2) == dynamic and call(s, 2, 3) == single
    assert any(min(st["keep_ratio"]) < 1 for _, st, _ in dynamic)  # tokens left the important set: a sparse prefill
    monkeypatch.setattr(Session, "_captures", lambda self: self.recipe.model.compile == "auto")
    monkeypatch.setattr(Session, "_capture_factory", lambda self: graph if self._captures() else None)
    monkeypatch.setattr(Session, "_tower_capture_factory", lambda self: None)  # the LLM's graphs only here
    graph.made = []
    with caplog.at_level(logging.INFO), mmfast.apply(tiny_mm, recipe, compile="auto") as s:
        assert s.runner.capture_blocker() is None and s.runner.prefill_graph_blocker() is None
        captured = call(s, 0, 2)
        made = len(graph.made)
        assert made > 0
        again, one = call(s, 0, 2), call(s, 2, 3)  # replayed on the pool's buffers; a new shape captured
        assert len(graph.made) > made and sum(g.replays for g in graph.made) >= 1
        kept = s.runner.pool.kept_bytes
    assert kept > 0  # the static buffers went back to the pool (the quantised cache is the call's own)
    assert not [r for r in caplog.records if "without a captured graph" in r.getMessage()]
    for got in (captured, again):
        assert [t for t, _, _ in got] == [t for t, _, _ in dynamic]
        assert [st for _, st, _ in got] == [st for _, st, _ in dynamic]
        assert [b for _, _, b in got] == [b for _, _, b in dynamic]
    assert one == single
    with mmfast.apply(tiny_mm, recipe, compile="auto") as s:  # outside a static block: the dynamic layers
        state, _ = s.runner.prefill(s.build_inputs(batch := s.mm.prepare(images[:2], prompts[:2]), s.encode(batch)))
        assert all(isinstance(lay, MixedPrecisionKVLayer) for lay in state.cache.layers)


@pytest.mark.parametrize("interval", [3, 100], ids=["requantised", "once"])
def test_zipvls_decode_steps_are_captured(interval, tiny_mm, images, prompts, padded_steps, monkeypatch, caplog):
    """On a static cache ZipVL's quantised layers sit over the prefill's buffers, each segment written back into its
    slots dequantised (before any step, and after each re-quantisation), and its override's decode work (the last
    query, for re-scoring) is carried out of the step: each decode step is the one captured graph, replayed by a
    later call on the same buffers. Tokens, keep ratios, re-quantisation events and end KV bytes equal the dynamic
    cache's at batch 2 (two calls) and 1 (emulated CUDA-graph semantics: a replay runs only the recorded kernels)."""
    from mmfast.pipeline import Session
    from mmfast.pruning._kv_static import StaticMixedPrecisionLayer

    stage = _stage("zipvl", tiny_mm)
    stage["params"] = {**stage["params"], "requant_interval": interval}
    recipe = load_recipe({"pruning": [stage]})
    calls = [(images[:2], prompts[:2]), (images[2:4], prompts[:2]), (images[3:4], prompts[2:3])]

    def run(s):
        out = [s.generate(imgs, ps, max_new_tokens=8) for imgs, ps in calls]
        return [[(r.token_ids, r.stats["zipvl"], r.kv_bytes_end) for r in res] for res in out]

    with mmfast.apply(tiny_mm, recipe, compile="off") as s:
        dynamic = run(s)
    events = dynamic[0][0][1]["requant_events"]
    assert events == (len(dynamic[0][0][0]) - 1) // interval * s.adapter.text_config.num_hidden_layers
    assert any(min(st["keep_ratio"]) < 1 for call in dynamic for _, st, _ in call)
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    monkeypatch.setattr(Session, "_tower_capture_factory", lambda self: None)  # the LLM's graphs only here
    seen = []
    original = StaticMixedPrecisionLayer.update

    def spy(self, *args, **kwargs):
        seen.append(self.padded)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StaticMixedPrecisionLayer, "update", spy)
    EmulatedGraph.made = []
    with caplog.at_level(logging.INFO), mmfast.apply(tiny_mm, recipe, compile="static") as s:
        assert s.runner.capture_blocker() is None
        assert run(s) == dynamic
    assert padded_steps[0] > 0 and seen and all(seen)  # the static steps ran on ZipVL's static layers
    assert not [r for r in caplog.records if "without a captured graph" in r.getMessage()]
    # a prefill segment and a decode step captured at batch 2 (the second call replays both) and again at batch 1
    assert len(EmulatedGraph.made) == 4
    assert sum(g.replays for g in EmulatedGraph.made) == 6 + (1 + 7) + 6


def test_recipe_key_and_api_value_are_checked():
    assert load_recipe({"model": {"compile": "static"}}).model.compile == "static"
    with pytest.raises(ConfigError) as err:
        load_recipe({"model": {"compile": "yes"}})
    assert "model.compile" in str(err.value)
    assert Recipe().hash() != load_recipe({"model": {"compile": "static"}}).hash()
    # off and auto give the same tokens on a CPU (and up to GPU kernels' last bit on CUDA): one identity
    assert Recipe().hash() == load_recipe({"model": {"compile": "off"}}).hash()
    # the default leaves the hash of every recipe written before the key as it was (resume)
    import hashlib
    import json

    before = {k: v for k, v in Recipe().to_dict().items() if k != "output"}
    del before["model"]["compile"], before["model"]["fused_vision_attention"]  # added after those runs
    del before["model"]["fuse_norms"]
    before["decoding"]["seed"] = 0  # an unset seed hashes as 0, the seed a run uses
    blob = json.dumps(before, sort_keys=True, separators=(",", ":"))
    assert Recipe().hash() == hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_api_compile_value_is_checked(tiny_mm):
    with pytest.raises(InputError, match="compile='on'"):
        mmfast.apply(tiny_mm, {}, compile="on")


# -- the layer itself, against transformers' DynamicLayer ---------------------------------------------


def _pair(reserve: int = 4):
    torch.manual_seed(0)
    dyn, sta = DynamicLayer(), compat.StaticSlotLayer(reserve)
    k, v = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    dyn.update(k, v)
    sta.update(k, v)
    return dyn, sta


def _same(dyn, sta):
    assert sta.keys.shape == dyn.keys.shape and torch.equal(sta.keys, dyn.keys) and torch.equal(sta.values, dyn.values)


def test_static_layer_edits_match_dynamic_layer():
    dyn, sta = _pair()
    assert sta.capacity == 5 + 4
    buf = sta._k
    for _ in range(3):  # appends, crop, reorder, slot gather: in place, no new buffer
        k, v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
        dyn.update(k, v)
        sta.update(k, v)
    _same(dyn, sta)
    dyn.crop(-2)
    sta.crop(-2)
    _same(dyn, sta)
    idx = torch.tensor([2, 0, 0])
    dyn.reorder_cache(idx)
    sta.reorder_cache(idx)
    _same(dyn, sta)
    gather = torch.tensor([0, 2, 3])[None, None, :, None].expand(3, 2, 3, 4)
    for lay in (dyn, sta):
        lay.keys, lay.values = lay.keys.gather(2, gather), lay.values.gather(2, gather)
    _same(dyn, sta)
    assert sta._k is buf
    # a static decode step writes the slots it was given (from the device write index) and sees the whole
    # buffer; the step then moves the device write index (a replayed graph runs no Python), the runner the host count
    assert int(sta._pos) == sta.length == 3
    cache = type("C", (), {"layers": [sta]})()
    compat.set_padded(cache, True)
    compat.set_write_slots(cache, range(1), sta._pos + torch.arange(1))
    k_new = torch.randn(3, 2, 1, 4)
    k_all, _ = sta.update(k_new, torch.randn(3, 2, 1, 4))
    assert k_all.shape[2] == sta.capacity and int(sta._pos) == 3 and sta.length == 3
    compat.move_write_indices(cache, 1)
    compat.set_padded(cache, False)
    assert int(sta._pos) == 4 and sta._write is None
    compat.advance_static(cache, 1)
    assert sta.length == 4 and torch.equal(sta.keys[:, :, 3:], k_new)


def test_static_layer_grows_past_capacity_keeping_slots(caplog):
    dyn, sta = _pair(reserve=1)
    k, v = torch.randn(3, 2, 3, 4), torch.randn(3, 2, 3, 4)
    with caplog.at_level(logging.INFO, logger="mmfast.compat"):
        dyn.update(k, v)
        sta.update(k, v)
    _same(dyn, sta)
    assert sta.capacity >= 8 and "grows" in caplog.text
    dyn.batch_repeat_interleave(2)
    sta.batch_repeat_interleave(2)
    _same(dyn, sta)


def test_rows_of_a_static_cache_fill_the_buffers_they_were_given():
    """``static_rows`` makes rows of their own (the source untouched); ``copy_static_rows`` refills them in place
    (the same addresses: the graphs on them serve the next sample), or refuses with nothing changed where a layer's
    buffer does not match (a layer grew)."""
    _, src = _pair()
    src.crop(-1)  # 4 held
    cache = type("C", (), {"layers": [src]})()
    rows = compat.static_rows(cache, torch.tensor([1, 1]))
    (lay,) = rows.layers
    assert lay._k.data_ptr() != src._k.data_ptr() and lay.length == 4 and int(lay._pos) == 4
    assert torch.equal(lay.keys, src.keys[[1, 1]]) and torch.equal(lay.values, src.values[[1, 1]])
    buf = lay._k
    lay.update(torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4))  # the beams go on; the source does not move
    assert src.length == 4
    assert compat.copy_static_rows(rows, cache, torch.tensor([2, 2]))
    assert lay._k is buf and lay.length == 4 and int(lay._pos) == 4
    assert torch.equal(lay.keys, src.keys[[2, 2]]) and torch.equal(lay.values, src.values[[2, 2]])
    before = lay._k.clone()
    assert not compat.copy_static_rows(rows, cache, torch.tensor([0, 0, 0]))  # another batch
    lay._grow(lay.capacity + 3)
    assert not compat.copy_static_rows(rows, cache, torch.tensor([0, 0]))
    assert torch.equal(lay._k[:, :, : before.shape[2]], before) and lay.length == 4


def test_out_of_memory_names_the_tokens_and_the_key(monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    layer = compat.StaticSlotLayer(reserve=64)
    monkeypatch.setattr(compat.torch, "zeros", oom)
    with pytest.raises(compat.StaticCacheCapacityError) as err:
        layer.update(torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4))
    msg = str(err.value)
    assert "2 x 74 tokens" in msg and "decoding.max_new_tokens" in msg and "model.compile: off" in msg


def test_cpu_allocation_failures_name_the_tokens_and_the_key(monkeypatch):
    """``compile: static`` runs on the CPU too, whose allocator refuses with a plain RuntimeError (not
    torch.OutOfMemoryError), and a capacity past the address space overflows before any allocation."""
    layer = compat.StaticSlotLayer(reserve=2**62)  # no allocation is tried: the size overflows
    with pytest.raises(compat.StaticCacheCapacityError) as err:
        layer.update(torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4))
    assert f"2 x {2**62 + 10} tokens" in str(err.value) and "decoding.max_new_tokens" in str(err.value)

    def refused(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(compat.torch, "zeros", refused)
    with pytest.raises(compat.StaticCacheCapacityError) as err:
        compat.StaticSlotLayer(reserve=64).update(torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4))
    assert "2 x 74 tokens" in str(err.value) and "model.compile: off" in str(err.value)


def test_beam_expansion_and_row_copies_name_the_tokens_when_out_of_memory(monkeypatch):
    """A beam search's B x K rows (``batch_repeat_interleave``, its largest static allocation) and OPERA's per-sample
    rows (``static_rows``) allocate as the layer does: the same rows as before, and an OOM names tokens and keys."""
    layer = compat.StaticSlotLayer(reserve=4)
    keys, values = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)  # [B, Hkv, T, D]
    layer.update(keys, values)
    whole = layer._k.clone()  # [2, 2, 7, 4]
    rows = compat.static_rows(compat.static_cache_of([layer]), torch.tensor([1, 1, 0]))
    assert torch.equal(rows.layers[0]._k, whole[[1, 1, 0]]) and rows.layers[0].length == 3
    layer.batch_repeat_interleave(3)
    assert torch.equal(layer._k, whole.repeat_interleave(3, dim=0)) and layer.capacity == 7

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(compat.torch, "zeros", oom)
    with pytest.raises(compat.StaticCacheCapacityError, match="18 x 7 tokens.*num_beams"):
        layer.batch_repeat_interleave(3)
    with pytest.raises(compat.StaticCacheCapacityError, match="2 x 7 tokens"):
        compat.static_rows(compat.static_cache_of([layer]), torch.tensor([0, 1]))


# -- captured steps (model.compile: auto on CUDA), with a stand-in graph on the CPU ---------------------


class ReplayGraph:
    """A StepGraph stand-in: capture keeps the function (the warm-up before it ran the step for real; a CUDA
    capture runs the Python but no kernel, so running it again here would apply a step that is not idempotent,
    the keep of a verified path or a draft's accept, twice), replay runs it again. What it checks on the CPU is
    the runner's side: static inputs copied in, the first step run for real, the device write index and host
    counts in step, one graph per cache and step shape. What it cannot check: values computed in Python at
    capture time that a real replay would reuse (:class:`EmulatedGraph` does)."""

    made: list = []

    def __init__(self) -> None:
        self.fn = None
        self.replays = 0
        self.capture_s = 0.0
        ReplayGraph.made.append(self)

    def warmup(self, fn):
        return fn()

    def capture(self, fn) -> None:
        assert self.fn is None
        self.fn = fn

    def replay(self):
        self.replays += 1
        return self.fn()


class EmulatedGraph(ReplayEmulator):
    """:class:`ReplayEmulator` (CUDA-graph semantics on the CPU: replays the recorded ops only, Python
    values frozen at capture, host reads refused), counting the graphs made."""

    made: list = []

    def __init__(self) -> None:
        super().__init__()
        EmulatedGraph.made.append(self)


@pytest.mark.parametrize(
    "decoding,pruning",
    [
        ({"method": "pai", "params": {"alpha": 3.0, "gamma": 1.0}}, False),
        ({"method": "pai", "params": {"alpha": 3.0, "gamma": 1.5}}, False),  # the image-free CFG branch beside
        ({"method": "pai", "params": {"alpha": 3.0, "gamma": 1.0, "start_layer": 0}}, True),  # two layer groups
        ({"method": "clearsight", "params": {"enhance": 3.0, "suppress": 0.2, "layers": [0, 1, 2, 3]}}, False),
        ({"method": "clearsight", "params": {"enhance": 3.0, "suppress": 0.2, "layers": [0, 1, 2, 3]}}, True),
        ({"method": "only", "params": {"sample": False, "gamma": 0.5, "alpha_pos": 20.0, "alpha_neg": 20.0}}, False),
        ({"method": "only", "params": {"sample": False, "gamma": 0.5, "alpha_pos": 20.0, "alpha_neg": 20.0}}, True),
    ],
    ids=["pai", "pai-cfg", "pai-fastv", "clearsight", "clearsight-fastv", "only", "only-fastv"],
)
def test_attention_editing_decoders_run_in_captured_steps(decoding, pruning, tiny_mm, images, prompts, monkeypatch):
    """PAI's, ClearSight's and ONLY's overrides in static decode steps read the slot classes staged before each step
    (``StagedSlotClasses``) over the whole buffer (ONLY's rows carried out for its last-layer pass), and in captured
    prefill segments those staged before the segment, so the steps and the prefill are captured graphs (CUDA-graph
    semantics emulated): tokens (and ONLY's counts) equal the dynamic cache's at
    batch 2, and a second call with other images and its rows' prompts
    swapped (other slot classes a row, the same buffers) replays the first call's step graph with its own classes.
    The classes themselves are a captured call a step (one shape: the layout padded to the buffer). The edits are strong enough to change greedy's tokens (a step that skipped them would not match)."""
    from mmfast.pipeline import Session

    recipe: dict = {"decoding": decoding}
    if pruning:
        recipe["pruning"] = [_stage("fastv", tiny_mm)]
    # the second call's rows swap prompts: the same buffers, each row's image and system slots elsewhere
    calls = [(images[:2], [prompts[0], prompts[2]]), (images[2:4], [prompts[2], prompts[0]])]

    def rows(results) -> list:  # tokens, and ONLY's per-sample counts
        return [(r.token_ids, r.stats.get("additive_steps"), r.stats.get("removed_heads_first")) for r in results]

    def run(compile: str) -> list:
        with mmfast.apply(tiny_mm, load_recipe(recipe), compile=compile) as s:
            return [rows(s.generate(im, pr, max_new_tokens=8, seed=0)) for im, pr in calls]

    dynamic = run("off")
    plain = {**recipe, "decoding": {"method": "greedy"}}
    with mmfast.apply(tiny_mm, load_recipe(plain), compile="off") as s:
        greedy = [[r.token_ids for r in s.generate(im, pr, max_new_tokens=8)] for im, pr in calls]
    assert greedy != [[t for t, _, _ in call] for call in dynamic]
    assert run("static") == dynamic  # eager static steps
    EmulatedGraph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)  # the tower's and ONLY's fusion too
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        assert s.runner.capture_blocker() is None
        assert s.runner.prefill_graph_blocker() is None  # their prefill reads classes staged before each segment
        first = rows(s.generate(*calls[0], max_new_tokens=8, seed=0))
        replays = [(g, g.replays) for g in EmulatedGraph.made]
        assert replays and sum(n for _, n in replays) >= 5
        second = rows(s.generate(*calls[1], max_new_tokens=8, seed=0))
        fusions = [c for key, c in s.ctx.captured.graphs.items() if key[0][0] == "only.fuse"]
        classes = [c for key, c in s.ctx.captured.graphs.items() if key[0][0] == "slot classes"]
    assert [first, second] == dynamic
    # the classes of a step (the layout padded to the buffer) and of a prefill segment: captured calls, replayed
    assert classes and max(c.graph.replays for c in classes) >= 7
    assert any(g.replays > n for g, n in replays)  # a step graph of the first call replayed in the second
    if decoding["method"] == "only":  # its last-layer pass and fusion: a captured call, replayed every step
        assert fusions and all(c.graph.replays >= 7 for c in fusions)
    # and nothing captured again: PAI's image-free CFG prompt (the call's second prefill) takes the pool's second set
    assert len(EmulatedGraph.made) == len(replays)


@pytest.mark.parametrize("graph", [ReplayGraph, EmulatedGraph], ids=["rerun", "emulated"])
@pytest.mark.parametrize(
    "name",
    [
        "greedy",
        "sample-seeded",
        "vcd",
        "beam",
        "pyramiddrop",
        "prompt_lookup",
        "pyramiddrop+prompt_lookup",
        "sample+prompt_lookup",
    ],
)
def test_captured_steps_match_dynamic(name, graph, tiny_mm, images, prompts, monkeypatch, caplog):
    from mmfast.pipeline import Session

    pdrop = {"pruning": [_stage("pyramiddrop", tiny_mm)]}
    recipe = {
        "pyramiddrop": pdrop,
        "pyramiddrop+prompt_lookup": {**pdrop, **SERVED["prompt_lookup"]},
        "sample+prompt_lookup": {**SERVED["sample-seeded"], **SERVED["prompt_lookup"]},  # cycles on the device
    }.get(name) or SERVED[name]
    dynamic = _tokens(tiny_mm, recipe, images, prompts, "off")
    graph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: graph)
    with caplog.at_level(logging.INFO, logger="mmfast.runtime"):
        assert _tokens(tiny_mm, recipe, images, prompts, "static") == dynamic
    assert not [r for r in caplog.records if "without a captured graph" in r.getMessage()]  # every step captured
    assert graph.made and sum(g.replays for g in graph.made) >= 5


def test_the_emulator_catches_a_host_value_frozen_at_capture(tiny_mm, images, prompts, monkeypatch):
    """A step that takes its new positions from the host's layout (``grp.positions``, a tensor replaced
    every step) instead of the graph's static input is right eagerly and under the re-running stand-in,
    and wrong under CUDA-graph semantics (the capture-time tensor is replayed): the emulator shows it."""
    from mmfast.pipeline import Session
    from mmfast.runtime import LMRunner

    original = LMRunner._static_masks

    def host_positions(self, state, valid, positions, block):
        q = positions[0].shape[1]
        original(self, state, valid, [grp.positions[:, -q:] for grp in state.groups], block)

    monkeypatch.setattr(LMRunner, "_static_masks", host_positions)
    dynamic = _tokens(tiny_mm, {}, images, prompts, "off")
    assert _tokens(tiny_mm, {}, images, prompts, "static") == dynamic  # eager static steps
    monkeypatch.setattr(Session, "_capture_factory", lambda self: ReplayGraph)
    assert _tokens(tiny_mm, {}, images, prompts, "static") == dynamic
    EmulatedGraph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    assert _tokens(tiny_mm, {}, images, prompts, "static") != dynamic
    assert sum(g.replays for g in EmulatedGraph.made) >= 5


@pytest.mark.parametrize("name", ["greedy", "pyramiddrop+prompt_lookup"])
def test_a_captured_step_reads_only_weights_cache_and_its_static_inputs(name, tiny_mm, images, prompts, monkeypatch):
    """A CUDA graph reads fixed addresses: a tensor the step reads that the host later replaces or frees
    (a layout tensor, a per-call mask) is stale or garbage at replay. Every tensor from outside the capture
    that the emulated graph's ops read is a weight, a cache buffer or write index, one of the graph's static
    inputs, or a runner constant."""
    from mmfast.pipeline import Session
    from mmfast.runtime import LMRunner

    recipe = {"pruning": [_stage("pyramiddrop", tiny_mm)], **SERVED["prompt_lookup"]} if name != "greedy" else {}
    allowed: set[int] = set()  # storages
    original = LMRunner._replay

    def spy(self, state, step, staged=()):
        out = original(self, state, step, staged)
        for c in self.pool.graphs.values():
            held = getattr(c.static, "valid", [])  # a decode step's slot validity (a prefill has none)
            allowed.update(t.untyped_storage().data_ptr() for t in c.static.tensors() + held)
        allowed.update(t.untyped_storage().data_ptr() for t in self._consts.values())
        allowed.update(compat.static_buffers(state.cache))
        return out

    monkeypatch.setattr(LMRunner, "_replay", spy)
    EmulatedGraph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        s.generate(images[:2], prompts[:2], max_new_tokens=8, seed=0)
        model = s.runner.adapter.model
        allowed.update(t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()])
        # the vision tower's and the selections' (PyramidDrop's scoring) graphs read their static inputs
        graphs = [*s.adapter.tower_graphs.graphs.values(), *s.ctx.captured.graphs.values()]
        graphs += s.runner.calls.graphs.values()  # and the layer groups' layouts
        allowed.update(t.untyped_storage().data_ptr() for c in graphs for t in c.static.inputs)
    inputs = [t for g in EmulatedGraph.made for t in g.inputs]
    assert inputs and sum(g.replays for g in EmulatedGraph.made) >= 5
    strays = [(tuple(t.shape), t.dtype) for t in inputs if t.untyped_storage().data_ptr() not in allowed]
    assert not strays, f"the captured step reads tensors the host owns: {strays}"


@pytest.mark.parametrize(
    "recipe,blocker",
    [
        ({}, None),
        ({"pruning": [{"method": "pyramiddrop"}]}, None),
        ({"pruning": [{"method": "fastv"}]}, None),  # probes and recorders that act at prefill only
        ({"pruning": [{"method": "dart"}]}, None),
        ({"pruning": [{"method": "sparsevlm"}]}, None),
        ({"pruning": [{"method": "mustdrop"}]}, None),
        ({"pruning": [{"method": "dynamic_llava"}]}, None),  # its decode decision is captured with the step
        ({"pruning": [{"method": "zipvl"}]}, None),  # its override's decode query is carried out of the step
        ({"decoding": {"method": "vhr"}}, None),  # its pre-hooks read the frozen scales from fixed memory
        ({"decoding": {"method": "pai"}}, None),  # its override reads the staged slot classes in a decode step
        ({"decoding": {"method": "clearsight"}}, None),
        ({"decoding": {"method": "only"}}, None),  # its override and hooks leave their rows through Carried
        ({"decoding": {"method": "opera", "params": DECODER_PARAMS["opera"]}}, None),  # its probe replays
    ],
)
def test_capture_blockers(recipe, blocker, tiny_mm):
    if "pruning" in recipe:
        recipe = {"pruning": [_stage(recipe["pruning"][0]["method"], tiny_mm)]}
    with mmfast.apply(tiny_mm, recipe) as s:
        got = s.runner.capture_blocker()
    assert got == blocker if blocker is None else blocker in got


def test_transformers_output_hooks_do_not_block_capture(tiny_mm):
    """``output_hidden_states=True`` leaves transformers' output-capturing hooks on the decoder layers
    for good (inert outside such a forward): they must not block the captured step (they did, for every
    test after one that asked a model for its hidden states)."""
    lm = tiny_mm.adapter.language_model
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        lm(input_ids=ids, output_hidden_states=True)
    assert any(m._forward_hooks for m in lm.modules())  # what transformers left behind
    with mmfast.apply(tiny_mm, {}) as s:
        assert s.runner.capture_blocker() is None
    # a hook of anyone else's still blocks
    handle = lm.layers[0].register_forward_hook(lambda *a: None)
    try:
        with mmfast.apply(tiny_mm, {}) as s:
            assert "hooks on the language model" in s.runner.capture_blocker()
    finally:
        handle.remove()


def test_auto_without_a_graph_says_why_once(tiny_mm, images, prompts, monkeypatch, caplog):
    from mmfast.pipeline import Session

    ReplayGraph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: ReplayGraph)
    monkeypatch.setattr(Session, "_tower_capture_factory", lambda self: None)  # the LLM's graphs only here
    with (
        caplog.at_level(logging.INFO, logger="mmfast.runtime"),
        mmfast.apply(tiny_mm, load_recipe({}), compile="static") as s,
    ):
        _python_every_step(s)
        static = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=8, seed=0)]
    lines = [r.getMessage() for r in caplog.records if "captured graph" in r.getMessage()]
    assert len(lines) == 1 and "hooks on the language model" in lines[0]
    assert not ReplayGraph.made
    assert static == _tokens(tiny_mm, {}, images, prompts, "off")


def test_a_replaced_llm_forward_keeps_decode_steps_eager_and_says_why_once(
    tiny_mm, images, prompts, monkeypatch, caplog
):
    """An instance ``forward`` on an LLM module that is not marked ``mmfast_graph_safe`` or ``replayable`` is Python
    that must run in every step (here: a per-call scale): the decode step stays eager, with one log line naming it,
    and the tokens are compile: off's (a captured step froze the scale at capture and changed the last token)."""
    from mmfast.pipeline import Session

    def python_forward(s) -> None:
        mlp = s.ctx.adapter.layers[1].mlp
        calls = [0]

        def forward(x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, T, d]
            calls[0] += 1
            return type(mlp).forward(mlp, x) * (1.0 + 0.5 * (calls[0] % 2))

        s.hooks.set_attr(mlp, "forward", forward)

    def run(mode: str) -> list[list[int]]:
        with mmfast.apply(tiny_mm, load_recipe({}), compile=mode) as s:
            python_forward(s)
            return [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=8, seed=0)]

    dynamic = run("off")
    EmulatedGraph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: EmulatedGraph)
    with caplog.at_level(logging.INFO, logger="mmfast.runtime"):
        captured = run("static")
    lines = [r.getMessage() for r in caplog.records if "decode steps run without a captured graph" in r.getMessage()]
    assert len(lines) == 1 and "a replaced forward on the language model" in lines[0]
    assert captured == dynamic


def test_generate_takes_compile(tiny_mm, images, prompts, padded_steps):
    out = tiny_mm.generate(images[:1], prompts[:1], compile="static", max_new_tokens=3)
    assert padded_steps[0] > 0 and len(out) == 1


class FailingGraph(ReplayGraph):
    """A capture that runs part of the step's Python and then raises (as a CUDA capture does when a
    kernel in the step syncs with the host)."""

    def capture(self, fn) -> None:
        fn()
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_eager_with_one_warning(tiny_mm, images, prompts, monkeypatch, caplog):
    from mmfast.pipeline import Session

    dynamic = _tokens(tiny_mm, SERVED["greedy"], images, prompts, "off")
    ReplayGraph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: FailingGraph)
    with caplog.at_level(logging.INFO, logger="mmfast.runtime"):
        assert _tokens(tiny_mm, SERVED["greedy"], images, prompts, "static") == dynamic
    lines = [r.getMessage() for r in caplog.records if "capturing the step failed" in r.getMessage()]
    assert len(lines) == 1 and "stream is capturing" in lines[0]
    prefill = [r.getMessage() for r in caplog.records if "the prefill runs without a captured graph" in r.getMessage()]
    assert len(prefill) == 1 and "stream is capturing" in prefill[0]
    tower = [r.getMessage() for r in caplog.records if "vision tower runs without" in r.getMessage()]
    assert len(tower) == 1 and "stream is capturing" in tower[0]
    # one try each for the tower and the prefill (then eager for the session) and one per block for the step
    assert len(ReplayGraph.made) == 3 and all(g.replays == 0 for g in ReplayGraph.made)


# -- prefill-only probes and hooks: the decode step is captured -------------------------------------

PREFILL_ONLY = ["fastv", "dart", "sparsevlm", "mustdrop"]  # read LLM attention to prune at prefill only


def _spy_prefill_recorders(s) -> list[str]:
    """Wraps every prefill-only attention recorder on the LLM layers; returns the runner phases they ran in."""
    phases: list[str] = []

    def spy(rec):
        def run(*args):
            phases.append(s.runner._phase)
            return rec(*args)

        return run

    for layer in s.ctx.adapter.layers:
        hooks = getattr(layer.self_attn, "_mmfast_attn", None)
        if hooks is not None:
            hooks.prefill_recorders[:] = [spy(r) for r in hooks.prefill_recorders]
    return phases


@pytest.mark.parametrize("graph", [ReplayGraph, EmulatedGraph], ids=["rerun", "emulated"])
@pytest.mark.parametrize("pruner", PREFILL_ONLY)
def test_prefill_only_probes_are_captured_and_match_dynamic(pruner, graph, tiny_mm, images, prompts, monkeypatch):
    """Their probes record at prefill only: nothing of theirs runs in a decode step (nor while it is
    captured), the step is one graph, and the tokens equal the dynamic cache's (greedy, batch 2 and 1). The
    other graphs are prefill segments without a probe (the spies here are Python in a probe's segment),
    SparseVLM's filters (``MethodContext.captured``) and the layer groups' layouts (``LMRunner.calls``), replayed by
    a repeated call."""
    from mmfast.pipeline import Session

    recipe = {"pruning": [_stage(pruner, tiny_mm)]}
    dynamic = _tokens(tiny_mm, recipe, images, prompts, "off")
    single = _tokens(tiny_mm, recipe, images[2:], prompts[2:], "off")[:1]
    graph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: graph)
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        assert s.runner.capture_blocker() is None
        phases = _spy_prefill_recorders(s)
        batch = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=8, seed=0)]
        one = [r.token_ids for r in s.generate(images[2:3], prompts[2:3], max_new_tokens=8, seed=0)]
        replays = {g: g.replays for g in graph.made}  # after two calls of other shapes
        again = [r.token_ids for r in s.generate(images[2:3], prompts[2:3], max_new_tokens=8, seed=0)]
        assert s.runner.capture_blocker() is None  # and after prefills
        selections = [c.graph for c in s.ctx.captured.graphs.values()]  # SparseVLM's filters
        towers = [c.graph for c in s.adapter.tower_graphs.graphs.values()]
        layouts = [c.graph for c in s.runner.calls.graphs.values()]  # the layer groups' layouts
    assert batch == dynamic and one == single and again == single
    assert layouts and any(g.replays for g in layouts)  # by the repeated call
    assert phases and set(phases) == {"prefill"}  # the recorders ran, at prefill only
    steps = [g for g, n in replays.items() if n >= 5]  # the decode step: one graph per call
    others = steps + selections + towers + layouts  # a layout serves every stage of the same shapes
    assert len(steps) == 2 and all(n == 0 for g, n in replays.items() if g not in others)
    if pruner == "sparsevlm":  # its filters are captured calls (one a filter for the batch), replayed by the last call
        assert selections and any(g.replays for g in selections)
    if pruner == "mustdrop":  # its merging tower: a graph per batch shape (a batch's images in one call)
        assert len(towers) == 2


@pytest.mark.parametrize("graph", [ReplayGraph, EmulatedGraph], ids=["rerun", "emulated"])
def test_prefill_only_probe_skips_verify_steps(graph, tiny_mm, images, prompts, monkeypatch):
    """A speculative verify step (Q > 1) is a decode step: FastV's probe (``when``: Q > 1) records there
    no more, and the verify steps are captured per tree size with tokens equal to the dynamic cache's."""
    from mmfast.pipeline import Session

    recipe = {"pruning": [_stage("fastv", tiny_mm)], **SERVED["prompt_lookup"]}
    dynamic = _tokens(tiny_mm, recipe, images, prompts, "off", n=12)
    graph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: graph)
    with mmfast.apply(tiny_mm, load_recipe(recipe), compile="static") as s:
        phases = _spy_prefill_recorders(s)
        got = [r.token_ids for r in s.generate(images[:2], prompts[:2], max_new_tokens=12, seed=0)]
    assert got == dynamic
    assert phases and set(phases) == {"prefill"}
    assert graph.made and sum(g.replays for g in graph.made) > 0


def test_prefill_only_hooks_are_skipped_while_decoding(tiny_mm):
    """``prefill_only`` module hooks and attention recorders do not run while ``HookSession.decoding``;
    every-forward ones do, and only they block capture."""
    from mmfast.hooks import HookSession
    from mmfast.hooks.attention import AttentionProbe, last_row
    from mmfast.runtime import LMRunner

    lm = tiny_mm.adapter.language_model
    ids = torch.tensor([[1, 2, 3]])
    calls: list[str] = []
    with HookSession(tiny_mm.model) as hooks:
        runner = LMRunner(tiny_mm.adapter, hooks)
        probe = AttentionProbe(hooks)
        hooks.pre_hook(lm.layers[0], lambda m, a: calls.append("pre"), prefill_only=True)
        hooks.forward_hook(lm.layers[0], lambda m, a, o: calls.append("fwd"), prefill_only=True)
        probe.watch("p", lm.layers[1].self_attn, rows=last_row, prefill_only=True)
        assert runner.capture_blocker() is None
        for decoding in (False, True):
            hooks.decoding = decoding
            probe.clear()
            with torch.inference_mode():
                lm(input_ids=ids)
            assert calls == ([] if decoding else ["pre", "fwd"]) and (probe.get("p") is None) == decoding
            calls.clear()
        probe.watch("q", lm.layers[1].self_attn, rows=last_row)  # every forward: decode steps included
        with torch.inference_mode():
            lm(input_ids=ids)
        assert probe.get("q") is not None and probe.get("p") is None
        assert "attention probes" in runner.capture_blocker()


@pytest.mark.parametrize(
    "kind,name",
    [("pruning", e.name) for e in PRUNERS.entries()] + [("decoding", e.name) for e in DECODERS.entries()],
)
def test_methods_that_act_in_decode_steps_declare_it(kind, name, tiny_mm):
    """A method's installed hooks keep the decode step from being captured exactly when it declares why
    (``Capabilities.eager_decode``), or needs the dynamic step anyway (``static_cache_blocker``)."""
    from mmfast.capabilities import static_cache_blocker

    if kind == "pruning":
        if caps_of(PRUNERS.get(name).cls, None).videos_only:
            pytest.skip("needs a video model (tests/test_dycoke.py)")
        recipe = {"pruning": [_stage(name, tiny_mm)]}
    else:
        recipe = {"decoding": {"method": name, "params": DECODER_PARAMS.get(name, {})}}
    with mmfast.apply(tiny_mm, recipe) as s:
        blocker = s.runner.capture_blocker()
        methods = s._method_caps(s.decoder)
    declared = [c.eager_decode for _, c in methods if c.eager_decode]
    assert (blocker is not None) == bool(declared or static_cache_blocker(methods)), (blocker, declared)


def test_qwen3_vl_deepstack_does_not_block_capture(tmp_path, images, prompts, monkeypatch):
    """Qwen3-VL's deepstack adds vision features after the first LLM layers at prefill only: its forward
    hooks are installed ``prefill_only`` and the decode step is captured, tokens equal to the dynamic cache's."""
    from mmfast.models.factory import random_qwen_vl, save_model
    from mmfast.pipeline import Session

    model, processor = random_qwen_vl("qwen3_vl")
    mm = mmfast.load(save_model(model, processor, tmp_path), device="cpu")
    dynamic = _tokens(mm, {}, images, prompts, "off", n=6)
    ReplayGraph.made = []
    monkeypatch.setattr(Session, "_capture_factory", lambda self: ReplayGraph)
    with mmfast.apply(mm, {}) as s:
        assert s.runner.deepstack_levels and s.runner.capture_blocker() is None
    assert _tokens(mm, {}, images, prompts, "static", n=6) == dynamic
    assert ReplayGraph.made and ReplayGraph.made[0].replays >= 4
