"""Lossless draft-and-verify: greedy output token-identical to greedy decoding (fp32), and the
sampling acceptance rule reproduces the target distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch

from mmfast.config import load_recipe
from mmfast.errors import IncompatibleRecipeError
from mmfast.pipeline import Session
from mmfast.speculative.engine import SpecStats
from mmfast.speculative.tree import DraftTree, verify

DRAFTERS = {
    "prompt_lookup": {},
    "layer_skip": {"skip": [2], "gamma": 3, "threshold": 0.0},
    # random (untrained) weights written into the tiny model's directory by the eagle_drafts fixture
    "msd": {"depth": 3, "top_k": 4, "total_tokens": 16},
    "flash": {"top_k": 4, "total_tokens": 12, "rounds": 2},
}


@pytest.fixture(scope="module")
def eagle_drafts(tiny_mm):
    """Random MSD / FLASH draft weights at their default location, ``<model dir>/{msd,flash}``."""
    from mmfast.speculative._eagle_model import _model_dir, write_random_draft

    d = _model_dir(tiny_mm)
    write_random_draft(tiny_mm, "msd", d / "msd")
    write_random_draft(tiny_mm, "flash", d / "flash", sar_k=3, n_latents=4)


def _run(mm, images, prompts, spec=None, n=24, decoding=None):
    data = {"decoding": decoding or {"method": "greedy"}}
    if spec:
        data["speculative"] = spec
    with Session(mm, load_recipe(data)) as s:
        return s.generate(images, prompts, max_new_tokens=n, seed=0)  # one stream for every call


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_lossless(name, tiny_mm, images, prompts, eagle_drafts):
    base = _run(tiny_mm, images, prompts)
    spec = _run(tiny_mm, images, prompts, {"method": name, "params": DRAFTERS[name]})
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
    st = spec[0].stats["speculative"]
    assert st["cycles"] >= 1 and st["tau"] >= 1.0


def test_layer_skip_calibration_and_restore(tiny_mm, images, prompts):

    layer = tiny_mm.adapter.layers[1]
    fwd = layer.forward
    with Session(
        tiny_mm,
        load_recipe(
            {"speculative": {"method": "layer_skip", "params": {"skip_fraction": 0.5, "calibration_tokens": 6}}}
        ),
    ) as s:
        out = s.generate(images[:1], prompts[:1], max_new_tokens=10)
        assert len(s.drafter.skip) == 2 and 0 not in s.drafter.skip
    base = _run(tiny_mm, images[:1], prompts[:1], n=10)
    assert out[0].token_ids == base[0].token_ids
    assert "forward" not in layer.__dict__ and layer.forward == fwd


def test_prompt_lookup_drafts_from_prompt(tiny_mm):
    from mmfast.config import Recipe
    from mmfast.pipeline import Session
    from mmfast.speculative.prompt_lookup import PromptLookup

    with Session(tiny_mm, Recipe()) as s:
        d = PromptLookup(PromptLookup.Config(num_tokens=3, max_ngram=2), s.ctx)
        d.install()
    assert d._lookup([5, 6, 7, 8, 9, 5, 6]) == [7, 8, 9]
    assert d._lookup([1, 2, 3]) is None


def test_prompt_lookup_equals_transformers_candidate_generator(tiny_mm):
    """Drafts equal transformers' PromptLookupCandidateGenerator on random sequences rich in EOS and
    repeats: the same match, cut before the first EOS (an EOS-first continuation drafts nothing)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    from mmfast.config import Recipe
    from mmfast.pipeline import Session
    from mmfast.speculative.prompt_lookup import PromptLookup

    eos = tiny_mm.eos_token_ids
    with Session(tiny_mm, Recipe()) as s:
        d = PromptLookup(PromptLookup.Config(num_tokens=4, max_ngram=2), s.ctx)
        d.install()
    ref = PromptLookupCandidateGenerator(
        torch.tensor(eos), num_output_tokens=4, max_matching_ngram_size=2, max_length=10**6
    )
    g = torch.Generator().manual_seed(0)
    alphabet = torch.tensor([eos[0], 5, 6, 7, 8])
    cut_cases = empty_cases = 0
    for _ in range(400):
        seq = alphabet[
            torch.randint(0, len(alphabet), (int(torch.randint(3, 14, (1,), generator=g)),), generator=g)
        ].tolist()
        cand, _ = ref.get_candidates(torch.tensor([seq]))
        expect = cand[0, len(seq) :].tolist()
        got = d._lookup(seq)
        assert (got or []) == expect, seq
        assert eos[0] not in (got or [])
        cut_cases += got is not None and 0 < len(got) < 4 and eos[0] in seq
        empty_cases += got == []
    assert cut_cases and empty_cases  # both EOS situations occurred


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    exp = probs * counts.sum()
    keep = exp > 0
    return float(chisquare(counts[keep].numpy(), exp[keep].numpy()).pvalue)


@pytest.mark.parametrize("kind", ["sampled_chain", "point_mass_siblings"])
def test_sampling_rule_is_lossless(kind):
    """The first emitted token after verification follows the target p exactly."""
    torch.manual_seed(0)
    vocab = 6
    p_root = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
    p_child = torch.softmax(torch.randn(vocab), 0)
    q = torch.tensor([0.05, 0.1, 0.4, 0.3, 0.1, 0.05])  # a poor draft distribution
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    n = 20000
    for _ in range(n):
        if kind == "sampled_chain":
            tok = int(torch.multinomial(q, 1, generator=gen))
            tree = DraftTree.chain([tok], [q])
        else:
            tree = DraftTree(torch.tensor([2, 3, 0]), torch.tensor([0, 0, 0]))  # three point-mass siblings
        probs = torch.stack([p_root] + [p_child] * tree.n)
        v = verify(tree, probs, probs.log(), gen)
        first = int(tree.tokens[v.path[0] - 1]) if v.path else v.bonus
        counts[first] += 1
    assert _chi2_pvalue(counts, p_root) > 1e-3


def _first_token_counts(q, p_root, p_child, sampling, n, declared):
    """Two sampled siblings drawn from q (``sampling``), verified with ``declared`` as the scheme."""
    gen = torch.Generator().manual_seed(2)
    counts = torch.zeros(len(q))
    for _ in range(n):
        toks = torch.multinomial(q, 2, replacement=(sampling == "iid"), generator=gen).tolist()
        tree = DraftTree(torch.tensor(toks), torch.tensor([0, 0]), [q, q], sibling_sampling=declared)
        probs = torch.stack([p_root, p_child, p_child])
        v = verify(tree, probs, probs.log(), gen)
        counts[int(tree.tokens[v.path[0] - 1]) if v.path else v.bonus] += 1
    return counts


@pytest.mark.parametrize("sampling", ["iid", "without_replacement"])
def test_sampled_siblings_are_lossless_when_declared(sampling):
    """Siblings sampled i.i.d. or without replacement (EAGLE-1) from a poor q: the first emitted token
    follows p exactly once the tree says how its siblings were drawn."""
    p_root = torch.tensor([0.1, 0.1, 0.5, 0.2, 0.05, 0.05])
    q = torch.tensor([0.6, 0.3, 0.04, 0.03, 0.02, 0.01])
    counts = _first_token_counts(q, p_root, torch.full((6,), 1 / 6), sampling, 20000, sampling)
    assert _chi2_pvalue(counts, p_root) > 1e-3


def test_without_replacement_siblings_verified_as_iid_are_lossy_and_undeclared_are_refused():
    """The guard matters: drafts sampled without replacement but verified with the i.i.d. rule are
    biased (the test above can fail), and a tree that does not declare its scheme is refused."""
    p_root = torch.tensor([0.1, 0.1, 0.5, 0.2, 0.05, 0.05])
    q = torch.tensor([0.6, 0.3, 0.04, 0.03, 0.02, 0.01])
    counts = _first_token_counts(q, p_root, torch.full((6,), 1 / 6), "without_replacement", 20000, "iid")
    assert _chi2_pvalue(counts, p_root) < 1e-6
    tree = DraftTree(torch.tensor([0, 1]), torch.tensor([0, 0]), [q, q])
    probs = torch.stack([p_root] * 3)
    with pytest.raises(ValueError, match="sibling_sampling"):
        verify(tree, probs, probs.log(), torch.Generator().manual_seed(0))
    tree = DraftTree(torch.tensor([1, 1]), torch.tensor([0, 0]), [q, q], sibling_sampling="without_replacement")
    with pytest.raises(ValueError, match="repeat"):
        verify(tree, probs, probs.log(), torch.Generator().manual_seed(0))
    verify(
        DraftTree.chain([1], [q]), probs[:2], probs[:2].log(), torch.Generator().manual_seed(0)
    )  # chains need no declaration


def test_greedy_rule():
    tree = DraftTree(torch.tensor([4, 1, 2]), torch.tensor([0, 0, 2]))  # root -> {4, 1}; 1 -> 2
    logits = torch.full((4, 6), -5.0)
    logits[0, 1] = 5  # root: argmax 1 -> node 2
    logits[2, 2] = 5  # node 2: argmax 2 -> node 3
    logits[3, 0] = 5  # node 3: argmax 0 -> bonus
    v = verify(tree, None, logits, None)
    assert v.path == [2, 3] and v.bonus == 0


def test_beam_with_drafter_refused():
    with pytest.raises(IncompatibleRecipeError, match="speculative"):
        load_recipe({"decoding": {"method": "beam"}, "speculative": {"method": "prompt_lookup"}})
    with pytest.raises(IncompatibleRecipeError, match="speculative"):
        load_recipe({"decoding": {"method": "vcd"}, "speculative": {"method": "prompt_lookup"}})


def test_sampling_with_drafter_runs(tiny_mm, images, prompts):
    out = _run(
        tiny_mm,
        images[:2],
        prompts[:2],
        {"method": "layer_skip", "params": {"skip": [1, 2]}},
        n=12,
        decoding={"method": "sample", "seed": 3},
    )
    assert all(len(r.token_ids) > 0 for r in out)


def test_bench_repeats_do_not_teach_a_stateful_drafter(tiny_mm, images):
    """Prompt lookup's trigram table learns across requests; a timing repeat must not replay answers
    it learned in an earlier repeat (tau of the last repeat = tau of a single fresh run)."""
    from mmfast.bench.speculative import _run_workload

    recipe = load_recipe({"speculative": {"method": "prompt_lookup"}})
    wl = {"name": "w", "prompt": "Describe the image.", "max_new_tokens": 24}
    once = _run_workload(tiny_mm, recipe, images[:2], wl, repeats=1)
    thrice = _run_workload(tiny_mm, recipe, images[:2], wl, repeats=3)
    assert thrice["tau"] == pytest.approx(once["tau"])
    assert thrice["n_new_tokens"] == once["n_new_tokens"]


def test_bench_workload_honours_bench_warmup(tiny_mm, images, monkeypatch):
    """``bench.warmup`` untimed runs before the timed repeats: the speculative bench ran one warm-up whatever it
    said (``warmup: 0`` and ``warmup: 3`` timed as ``warmup: 1``)."""
    from mmfast.bench.speculative import _run_workload
    from mmfast.pipeline import Session

    calls = []
    run = Session.run
    monkeypatch.setattr(Session, "run", lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    recipe = load_recipe({"speculative": {"method": "prompt_lookup"}})
    wl = {"name": "w", "prompt": "Describe the image.", "max_new_tokens": 4}
    for warmup in (0, 3):
        calls.clear()
        _run_workload(tiny_mm, recipe, images[:1], wl, repeats=2, warmup=warmup)
        assert len(calls) == warmup + 2  # warm-ups, then 2 repeats x 1 image


def _random_tree(gen: torch.Generator, n: int, vocab: int) -> DraftTree:
    """A random tree of ``n`` nodes (parents before children), siblings sometimes repeating a token."""
    parents = [int(torch.randint(0, i + 1, (), generator=gen)) for i in range(n)]  # node i + 1's parent in 0..i
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    return DraftTree(tokens, torch.tensor(parents))


def test_device_tree_layout_and_greedy_verdict_equal_the_host_rule():
    """:func:`tree_layout` equals :meth:`DraftTree.depth` / :meth:`DraftTree.mask` padded to the verify width, and
    :func:`greedy_accept` equals :func:`verify`'s greedy verdict (the first matching child, the bonus, the depths
    tried), on random trees whose logits often agree with the draft, padded slots included; so does a host-built
    tree sent in one copy with pad nodes (:meth:`DeviceTree.from_lists`)."""
    from mmfast.speculative.tree import DeviceTree, greedy_accept, tree_layout

    gen = torch.Generator().manual_seed(0)
    vocab, accepted = 5, 0
    for trial in range(300):
        n = int(torch.randint(1, 12, (), generator=gen))
        width = n + 1 + trial % 3
        tree = _random_tree(gen, n, vocab)
        levels = int(tree.depth().max())
        depth, mask = tree_layout(tree.parents, width, levels)
        assert torch.equal(depth, tree.depth(width)) and torch.equal(mask, tree.mask(width))
        logits = torch.randn(width, vocab, generator=gen)
        for i, p in enumerate(tree.parent_list):  # the draft right two times in three
            if torch.rand((), generator=gen) < 0.67:
                logits[p, tree.token_list[i]] += 10.0
        root = torch.tensor([3])
        ref = verify(tree, None, logits[: n + 1], None)
        out = greedy_accept(tree.tokens, tree.parents, logits, root, levels).tolist()
        # the host-built tree sent in one copy, padded with pad nodes (their own parents): the same verdict
        sent = DeviceTree.from_lists(tree.token_list, tree.parent_list, width, 3, levels, torch.device("cpu"))
        assert torch.equal(sent.depth, tree.depth(width)) and torch.equal(sent.mask, tree.mask(width))
        assert sent.tokens.numel() == width - 1
        assert greedy_accept(sent.tokens, sent.parents, logits, root, levels).tolist() == out
        k = len(ref.path) + 1
        keep = [0, *ref.path] + list(range(k, width))
        nxt = [tree.token_list[i - 1] for i in ref.path] + [ref.bonus]
        children = tree.children()
        tried = [d + 1 for d, node in enumerate([0, *ref.path]) if children[node]]
        assert out[: width + 1] == [*keep, k]
        assert out[width + 1 : 2 * width + 2] == [*nxt, *[0] * (width - k), k]
        assert [d + 1 for d, t in enumerate(out[2 * width + 2 : 3 * width + 2]) if t] == tried == ref.tried_depths
        assert out[-1] == ref.bonus
        accepted += len(ref.path)
    assert accepted > 300  # deep paths were exercised


def _sampled_rule(tree: DraftTree, probs: torch.Tensor, u: torch.Tensor) -> tuple[list[int], int, list[int]]:
    """The point-mass sampling rule walked node by node on the host with slot j's child test on ``u[j]`` and the
    bonus on ``u[-1]``: (path, bonus, depths tried)."""
    children, tokens = tree.children(), tree.token_list
    node, path, tried = 0, [], []
    while True:
        p = probs[node]
        if children[node]:
            tried.append(len(path) + 1)
        removed, gone, nxt = 0.0, set(), None
        for c in children[node]:
            t = tokens[c - 1]
            if t in gone:  # an earlier sibling's token: its mass is gone, rejected
                continue
            if float(u[c]) < float(p[t]) / (1.0 - removed):
                nxt = c
                break
            gone.add(t)
            removed += float(p[t])
        if nxt is None:
            residual = p.clone()
            residual[list(gone)] = 0.0
            cdf = residual.double().cumsum(0)
            bonus = int(torch.searchsorted(cdf, u[-1:].double() * cdf[-1], right=True))
            return path, bonus, tried
        path.append(nxt)
        node = nxt


def test_sampled_device_verdict_is_the_point_mass_rule():
    """:func:`sampled_accept` on random trees (siblings repeating a token, padded verify widths, the host-built tree
    sent in one copy) takes the path, bonus and depths that the rule walked node by node with the same uniforms
    gives: a child accepted with its residual probability, the bonus drawn from the residual by inverse CDF."""
    from mmfast.speculative.tree import DeviceTree, sampled_accept

    gen = torch.Generator().manual_seed(0)
    vocab, accepted, rejected_siblings = 5, 0, 0
    for trial in range(300):
        n = int(torch.randint(1, 10, (), generator=gen))
        width = n + 1 + trial % 3
        tree = _random_tree(gen, n, vocab)
        levels = int(tree.depth().max())
        logits = torch.randn(width, vocab, generator=gen)
        for i, p in enumerate(tree.parent_list):  # the draft likely two times in three
            if torch.rand((), generator=gen) < 0.67:
                logits[p, tree.token_list[i]] += 3.0
        probs = torch.softmax(logits, -1)
        u = torch.rand(width + 1, generator=gen)
        path, bonus, tried = _sampled_rule(tree, probs, u)
        root = torch.tensor([3])
        out = sampled_accept(tree.tokens, tree.parents, probs, root, u, levels).tolist()
        sent = DeviceTree.from_lists(tree.token_list, tree.parent_list, width, 3, levels, torch.device("cpu"))
        assert sampled_accept(sent.tokens, sent.parents, probs, root, u, levels).tolist() == out
        k = len(path) + 1
        assert out[: width + 1] == [0, *path, *range(k, width), k]
        nxt = [tree.token_list[i - 1] for i in path] + [bonus]
        assert out[width + 1 : 2 * width + 2] == [*nxt, *[0] * (width - k), k]
        assert [d + 1 for d, t in enumerate(out[2 * width + 2 : 3 * width + 2]) if t] == tried
        assert out[-1] == bonus
        accepted += len(path)
        rejected_siblings += any(len(c) > 1 for c in tree.children()) and bool(path)
    assert accepted > 150 and rejected_siblings > 30


def test_sampled_device_verdict_is_lossless():
    """The first token a cycle emits (an accepted child or the bonus) follows the target's p exactly, for
    point-mass siblings (one repeating a token) and a second level under the first child."""
    from mmfast.speculative.tree import sampled_accept

    p_root = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
    probs = torch.stack([p_root, torch.full((6,), 1 / 6), p_root.flip(0), p_root, p_root])  # [W = 5, V]
    tokens, parents = torch.tensor([2, 3, 2, 0]), torch.tensor([0, 0, 0, 1])  # root -> {2, 3, 2}; node 1 -> 0
    gen = torch.Generator().manual_seed(4)
    counts = torch.zeros(6)
    for _ in range(20000):
        out = sampled_accept(tokens, parents, probs, torch.tensor([1]), torch.rand(6, generator=gen), 2)
        counts[out[5 + 1]] += 1  # the first committed token
    assert _chi2_pvalue(counts, p_root) > 1e-3


@pytest.mark.parametrize("params", [{"skip_fraction": 0.9}, {"calibration_tokens": 0}, {"calibration_tokens": 1}])
def test_layer_skip_calibration_edge_settings_run(params, tiny_mm, images, prompts):
    """Calibration (``skip: null``) with settings the config allows: a fraction that rounds to every layer of a small
    model (layer 0 always runs: at most n - 1 are skipped) and one or no calibration token (the prefill's own); it
    runs and is lossless instead of failing after the prefill."""
    spec = _run(tiny_mm, images[:1], prompts[:1], {"method": "layer_skip", "params": params}, n=8)
    assert [r.token_ids for r in spec] == [r.token_ids for r in _run(tiny_mm, images[:1], prompts[:1], n=8)]


@pytest.mark.parametrize("compile", ["off", "static"])
def test_counts_and_end_cache_follow_plain_decoding(compile, tiny_mm, images, prompts, monkeypatch):
    """Each result carries its own sample's statistics (one prefill and its cycles; the engine serves a batch one
    sample at a time), and the end cache holds what plain decoding's does even when the last cycle's accepted path
    runs past max_new_tokens or a stop token (its extra slots are never emitted): a draft that is the target itself
    (nothing skipped) accepts whole chains."""
    greedy = _run(tiny_mm, images[:2], prompts[:2], n=12)
    stop = greedy[0].token_ids[4]  # a stop token inside an accepted chain of sample 0
    for eos in (None, [stop]):
        if eos is not None:
            monkeypatch.setattr(tiny_mm, "eos_token_ids", eos)
        data = {"model": {"compile": compile}}
        plain = _run(tiny_mm, images[:2], prompts[:2], n=12, decoding={"method": "greedy"})
        ls = {"method": "layer_skip", "params": {"skip": [], "gamma": 5, "threshold": 0.0}}
        with Session(tiny_mm, load_recipe({**data, "speculative": ls})) as s:
            spec = s.generate(images[:2], prompts[:2], max_new_tokens=12, seed=0)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        assert [r.kv_bytes_end for r in spec] == [r.kv_bytes_end for r in plain]
        for r in spec:
            st = r.stats["speculative"]
            stopped = eos is not None and len(r.token_ids) < 12  # the stop token: committed, not in the answer
            # every token after the prefill's first came from this sample's own cycles
            assert st["committed"] == round(st["tau"] * st["cycles"]) == len(r.token_ids) - 1 + stopped
            assert st["target_forwards"] == st["cycles"] + 1
    assert len(plain[0].token_ids) == 4  # the stop token was reached


def test_bench_pools_acceptance_counts_over_samples():
    """The bench's acceptance rate at a depth is accepted / tried over all samples' cycles, not the mean of each
    sample's rate: a sample of 2 cycles does not weigh as much as one of 200."""
    from mmfast.bench.speculative import _pool_depths

    short = SpecStats()
    for _ in range(2):
        short.record([1, 2], 0)  # depths 1 and 2 tried, nothing accepted
    long = SpecStats()
    for _ in range(200):
        long.record([1], 1)  # depth 1 tried and accepted
    pooled = _pool_depths([short.as_dict(), long.as_dict()])
    assert pooled["acceptance_by_depth"] == {"1": 200 / 202, "2": 0.0}
    assert pooled["tried_by_depth"] == {"1": 202, "2": 2} and pooled["accepted_by_depth"] == {"1": 200, "2": 0}


@pytest.mark.parametrize(
    "params, path",
    [
        ({"workloads": [{"name": "w", "prompt": "Describe it."}]}, "bench.params.workloads[0].max_new_tokens"),
        ({"workloads": ["caption"]}, "bench.params.workloads[0]"),
        (
            {"workloads": [{"name": "w", "prompt": "p", "max_new_tokens": 0}]},
            "bench.params.workloads[0].max_new_tokens",
        ),
        ({"workloads": [{"name": "w", "prompt": "p", "max_new_token": 4}]}, "bench.params.workloads[0].max_new_token"),
        (
            {
                "workloads": [
                    {"name": "w", "prompt": "p", "max_new_tokens": 4},
                    {"name": "w", "prompt": "q", "max_new_tokens": 8},
                ]
            },
            "bench.params.workloads[1].name",
        ),
        ({"workloads": [{"name": "short/vqa", "prompt": "p", "max_new_tokens": 4}]}, "bench.params.workloads[0].name"),
        ({"temperatures": [-1.0]}, "bench.params.temperatures[0]"),
        ({"temperatures": [0.0, 0]}, "bench.params.temperatures[1]"),
    ],
)
def test_speculative_bench_workloads_and_temperatures_are_checked(params, path):
    """A speculative bench's workloads and temperatures are checked when the recipe loads: a workload without its
    max_new_tokens (or with a typo, a bare name, a duplicate name) or a negative / repeated temperature used to load,
    then crash (KeyError, TypeError; a / in a name: the plot, before summary.json) or silently overwrite a result
    after the model loaded and the warm-up ran."""
    from mmfast.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        load_recipe({"bench": {"kind": "speculative", "params": params}})
    assert exc.value.path == path
    ok = {"workloads": [{"name": "w", "prompt": "p", "max_new_tokens": 4}], "temperatures": [0.0, 1.0]}
    assert load_recipe({"bench": {"kind": "speculative", "params": ok}}).bench.params == ok


def test_prompt_lookup_trigram_tree_bound_is_checked(tiny_mm, images, prompts):
    """The trigram tree's bound (branching^1 + ... + branching^depth drafts) is what a verify step reserves: the
    settings allowed a bound of ~10^14 nodes (branching 8, depth 16), which made sampled decoding allocate terabytes
    and a static cache refuse with advice about max_new_tokens; such settings are refused when the recipe loads,
    and the largest bound allowed decodes (sampled, and greedy on the static cache) losslessly."""
    from mmfast.errors import ConfigError

    for params in ({"branching": 8, "trigram_depth": 16}, {"branching": 4, "trigram_depth": 10}):
        with pytest.raises(ConfigError, match="trigram_depth"):
            load_recipe({"speculative": {"method": "prompt_lookup", "params": params}})
    largest = {"method": "prompt_lookup", "params": {"branching": 2, "trigram_depth": 9}}  # 1022 nodes
    sampled = {"method": "sample", "seed": 3}
    assert all(r.token_ids for r in _run(tiny_mm, images[:1], prompts[:1], largest, n=6, decoding=sampled))
    with Session(tiny_mm, load_recipe({"model": {"compile": "static"}, "speculative": largest})) as s:
        spec = s.generate(images[:1], prompts[:1], max_new_tokens=6, seed=0)
    assert [r.token_ids for r in spec] == [r.token_ids for r in _run(tiny_mm, images[:1], prompts[:1], n=6)]


def test_layer_skip_calibrates_once_when_it_skips_nothing(tiny_mm, images, prompts, monkeypatch):
    """``skip: null`` calibrates on the first sample served; a fraction that rounds to no layer (0.1 of 4) chose the
    empty set, which read as 'not calibrated yet', so every later sample ran the calibration again (a prefill and
    its greedy steps inside its decode time)."""
    from mmfast.speculative.layer_skip import LayerSkip

    calls = []
    calibrate = LayerSkip.calibrate
    monkeypatch.setattr(LayerSkip, "calibrate", lambda self, ctx: calls.append(1) or calibrate(self, ctx))
    spec = {"method": "layer_skip", "params": {"skip_fraction": 0.1, "calibration_tokens": 4}}
    out = _run(tiny_mm, images, prompts, spec, n=6)
    assert len(calls) == 1
    assert [r.token_ids for r in out] == [r.token_ids for r in _run(tiny_mm, images, prompts, n=6)]


def test_bench_times_no_layer_skip_calibration(tiny_mm, images, monkeypatch):
    """``skip: null`` calibrates on the first sample a session serves; the bench opens a fresh session per timed
    repeat, so each repeat calibrated again inside its timing (a prefill, its greedy steps and a forward per candidate
    layer: a large share of a short answer's time). The warm-up's calibration, on the same first sample, serves the
    timed repeats: the same skip set, the same tokens."""
    from mmfast.bench.speculative import _run_workload
    from mmfast.speculative.layer_skip import LayerSkip

    calls = []
    calibrate = LayerSkip.calibrate
    monkeypatch.setattr(LayerSkip, "calibrate", lambda self, ctx: calls.append(1) or calibrate(self, ctx))
    recipe = load_recipe({"speculative": {"method": "layer_skip", "params": {"calibration_tokens": 4}}})
    wl = {"name": "w", "prompt": "Describe the image.", "max_new_tokens": 8}
    timed = _run_workload(tiny_mm, recipe, images[:2], wl, repeats=2)
    assert len(calls) == 1  # the warm-up's
    with Session(tiny_mm, recipe) as s:  # a calibrating session of its own: the same answers
        alone = [s.generate([im], ["Describe the image."], max_new_tokens=8)[0].token_ids for im in images[:2]]
    assert timed["tokens"] == alone


def test_shaped_costs_scale_an_explicit_layer_skip_set():
    """The projected 7B cost of a layer-skip draft runs the unskipped fraction of the layers: an explicit empty skip
    set (the draft is the target itself) ran all of them, but was costed as ``1 - skip_fraction`` (half)."""
    import torch

    from mmfast.bench.common import variants
    from mmfast.bench.speculative import _shaped_costs

    recipe = load_recipe(
        {
            "bench": {
                "kind": "speculative",
                "shape": "tiny",
                "compare": [
                    {"name": "all", "speculative": {"method": "layer_skip", "params": {"skip": [], "gamma": 2}}},
                    {"name": "half", "speculative": {"method": "layer_skip", "params": {"skip": [1, 2], "gamma": 2}}},
                ],
            }
        }
    )
    per_cycle = {"tau": 2.0, "draft_forwards_per_cycle": 2.0}
    out = _shaped_costs(
        recipe, variants(recipe), {"caption@T0": {"all": per_cycle, "half": per_cycle}}, torch.device("cpu")
    )
    head, layer = out["t_head_s"], out["t_layer_s"]
    for name, unskipped in (("all", 1.0), ("half", 0.5)):
        assert out["drafters"][name]["propose_s"] == pytest.approx(2.0 * (head + unskipped * 32 * layer))


def test_shaped_costs_take_the_greedy_captions_tau():
    """The projection's tau is the caption workload's at T = 0: with ``temperatures: [0.7, 0]`` the first key
    starting with ``caption@T0`` was ``caption@T0.7`` (a sampled tau), reported as ``tau_embedded_caption_T0``."""
    import torch

    from mmfast.bench.common import variants
    from mmfast.bench.speculative import _shaped_costs

    recipe = load_recipe(
        {
            "bench": {
                "kind": "speculative",
                "shape": "tiny",
                "compare": [{"name": "pl", "speculative": {"method": "prompt_lookup"}}],
            }
        }
    )
    results = {"caption@T0.7": {"pl": {"tau": 1.5}}, "caption@T0": {"pl": {"tau": 2.5}}}
    out = _shaped_costs(recipe, variants(recipe), results, torch.device("cpu"))
    assert out["drafters"]["pl"]["tau_embedded_caption_T0"] == 2.5


@pytest.mark.parametrize("skip", [[0], [4]])
def test_layer_skip_refuses_a_layer_it_cannot_skip_before_compute(skip, tiny_mm):
    """Layer 0 always runs and a 4-layer LLM has no layer 4: refused from the model's facts (``mmfast validate``,
    before weights load) at the recipe path, as every other layer parameter."""
    from mmfast.capabilities import ModelFacts, check_model
    from mmfast.errors import ConfigError

    rec = load_recipe({"speculative": {"method": "layer_skip", "params": {"skip": skip}}})
    with pytest.raises(ConfigError) as exc:
        check_model(rec, ModelFacts.of_adapter(tiny_mm.adapter))
    assert exc.value.path == "speculative.params.skip" and str(skip[0]) in exc.value.detail


@pytest.mark.parametrize(
    "main, item",
    [
        ({"method": "greedy"}, {"method": "sample", "params": {"temperature": 0.5, "top_p": 0.5}}),
        ({"method": "sample", "params": {"top_p": 0.5}}, None),
    ],
)
def test_speculative_bench_refuses_a_decoding_section_it_does_not_read(tmp_path, main, item):
    """The speculative bench decodes every workload greedily and by sampling at bench.params.temperatures: a compare
    item's ``decoding`` (top-p sampling) or the recipe's top-p sampling ran as plain greedy / temperature sampling,
    silently. Refused before any weights load."""
    from mmfast.bench import run_bench
    from mmfast.errors import ConfigError

    compare = {"name": "pl", "speculative": {"method": "prompt_lookup"}, **({"decoding": item} if item else {})}
    recipe = load_recipe(
        {
            "model": {"name": "mmfast/tiny-world"},
            "decoding": main,
            "eval": {"tasks": ["chair"]},
            "bench": {"kind": "speculative", "n_samples": 1, "compare": [compare]},
        }
    )
    out = tmp_path / "bench"
    with pytest.raises(ConfigError, match="decoding"):
        run_bench(recipe, output=str(out))
    assert not out.exists()
