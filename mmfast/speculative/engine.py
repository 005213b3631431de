"""The lossless draft-and-verify loop.

Per cycle: the drafter proposes a tree under the root (the last committed token, not yet in the
target cache); the target scores root + tree in **one** forward (tree mask, tree positions); the
acceptance rule of :mod:`tree` picks a path and a bonus token; the target KV cache keeps only the
root and the accepted path (``LMRunner.keep_new``: a path gather plus a crop, one graph under captured steps); the drafter updates
its own state. The vision encoder runs once (prefill) and its features are shared with the drafter.

Under captured steps a cycle runs on the device where the drafter's proposal is one captured step
(:meth:`Drafter.propose_on_device`): the verify layout, the verdict (:func:`tree.greedy_accept`; sampling:
:func:`tree.sampled_accept`, the point-mass rule with the cycle's uniforms drawn before it), the keep and the
draft's accept read each other's outputs on the device and the host reads the verdict once a cycle
(:func:`_cycle_on_device`); otherwise the tree and the verdict are on the host (:func:`_cycle`), a sampled
point-mass tree's verdict by the same function and uniforms (the same tokens either way).

Reported per run: ``tau`` = tokens committed per target verification forward, *bonus included*
(FLASH's convention; MSD's ``acclen`` excludes the bonus: tau - 1), draft and target forward counts,
acceptance rate per depth. Batch > 1 is served one sample at a time (the cache rollback is per path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..decoding.base import DecodeOutput, DecodeRequest, now, sample_generator, sample_seed, state_accounting
from ..decoding.loop import warpers
from .tree import (
    DeviceTree,
    DraftTree,
    Verdict,
    greedy_accept,
    padded_nodes,
    sampled_accept,
    tree_depths,
    verify,
)

if TYPE_CHECKING:
    from ..context import MethodContext
    from ..decoding.base import Sampling
    from ..models.base import LMInputs
    from ..runtime import LMState, StepOutput
    from .base import Drafter

logger = logging.getLogger(__name__)


@dataclass
class SpecContext:
    """What a drafter sees: the target state, the tokens so far, and the sampling setup."""

    method: MethodContext
    state: LMState
    inputs: LMInputs  # [1, L] the prompt
    committed: list[int]  # generated tokens so far (the root is the last one)
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator
    prefill: StepOutput | None = None  # final hidden states of the prompt (drafters that need them)
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped target (or draft) probabilities from logits ([..., V])."""
        flat = logits.reshape(-1, logits.shape[-1]).float()
        procs = warpers(self.temperature, self.top_k, self.top_p)
        return torch.softmax(procs(None, flat), dim=-1).reshape(logits.shape)


@dataclass
class SpecStats:
    cycles: int = 0
    committed: int = 0  # tokens emitted by verification cycles (bonus included)
    draft_forwards: int = 0
    draft_tokens: int = 0
    tried: dict[int, int] = field(default_factory=dict)  # depth -> cycles that tried a child there
    accepted: dict[int, int] = field(default_factory=dict)  # depth -> cycles that accepted a child there

    def record(self, tried_depths: list[int], path_len: int) -> None:
        for d in tried_depths:
            self.tried[d] = self.tried.get(d, 0) + 1
        for d in range(1, path_len + 1):
            self.accepted[d] = self.accepted.get(d, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "tau": self.committed / self.cycles if self.cycles else 0.0,
            "tau_convention": "tokens per target verification forward, bonus token included",
            "cycles": self.cycles,
            "committed": self.committed,
            "target_forwards": self.cycles + 1,  # the sample's prefill, then one forward a cycle
            "draft_forwards": self.draft_forwards,
            "draft_tokens": self.draft_tokens,
            "acceptance_by_depth": {d: self.accepted.get(d, 0) / n for d, n in sorted(self.tried.items())},
            # the counts behind the rates, so that samples pool by cycles, not by averaging their rates
            "tried_by_depth": dict(sorted(self.tried.items())),
            "accepted_by_depth": {d: self.accepted.get(d, 0) for d in sorted(self.tried)},
        }


def _first_token(ctx: SpecContext, logits: torch.Tensor) -> int:
    if ctx.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(ctx.probs(logits), 1, generator=ctx.generator))


@dataclass
class _OneResult:
    tokens: list[int]
    prefill_acc: Any
    method_stats: dict[str, dict[str, Any]]
    kv_end: int
    prefill_s: float
    decode_s: float


@dataclass
class _VerdictInputs:
    """The greedy verdict graph's inputs (:func:`_cycle_on_device`)."""

    tree: torch.Tensor  # [2T] long: the tree's tokens, then its parents
    logits: torch.Tensor  # [W, V] the verify step's
    root: torch.Tensor  # [1] long
    u: torch.Tensor | None  # [W + 1] the cycle's uniforms (sampling)

    def tensors(self) -> list[torch.Tensor]:
        return [self.tree, self.logits, self.root] + ([] if self.u is None else [self.u])


def _verify_inputs(tree: DraftTree, root: int, width: int | None) -> tuple[torch.Tensor, ...]:
    """The verify step's tokens ([1, W]: the root, then the tree's nodes), depths ([W]) and tree mask
    ([W, W]); with ``width`` the step is padded to W >= N + 1 slots: copies of the root at depth 0 that
    see only themselves and that no node sees (their logits are not read; rollback drops their KV)."""
    pad = max(0, (width or 0) - tree.n - 1)
    head = torch.tensor([root] * (1 + pad), device=tree.tokens.device)
    nodes = torch.cat([head[:1], tree.tokens, head[1:]])  # [W]
    return nodes[None], tree.depth(width), tree.mask(width)


@torch.inference_mode()
def _decode_one(
    method: MethodContext, drafter: Drafter, inputs: LMInputs, max_new: int, ctx_kw: dict, stats: SpecStats
) -> _OneResult:
    runner, device = method.runner, method.device
    stop = set(method.special.eos)
    t0 = now(device)
    # the prompt's hidden states only for a drafter that will draft (a one-token answer runs no cycle)
    state, out = runner.prefill(inputs, all_hidden=drafter.needs_hidden and max_new > 1)
    ctx = SpecContext(method, state, inputs, [], prefill=out, **ctx_kw)
    root = _first_token(ctx, out.logits[0, -1])
    t1 = now(device)
    acc = state_accounting(state)
    method_stats = state.stats_rows(1)
    ctx.committed.append(root)
    if len(ctx.committed) < max_new and root not in stop:  # a cycle follows: the drafter reads the prompt (a draft
        drafter.begin(ctx)  # model runs over it); a one-token answer or a stop token first pays no drafting
    # captured verify steps: every tree padded to the drafter's largest, so one graph serves them all
    width = drafter.max_step_tokens() if runner.captures else None
    root_dev = None  # [1] the root on the device, while cycles run there
    # slots the last cycle kept for accepted tokens past the cut (max_new or a stop token): never emitted
    uncommitted = 0

    def commit(new: list[int], path_len: int, tried: list[int]) -> None:
        """A cycle's tokens (the accepted path's and the bonus) committed up to ``max_new`` or a stop token; its
        statistics recorded (before the drafter learns what was accepted: it reads the committed tokens)."""
        nonlocal uncommitted
        stats.cycles += 1
        stats.record(tried, path_len)
        taken = 0
        for t in new:
            if len(ctx.committed) >= max_new:
                break
            ctx.committed.append(t)
            stats.committed += 1
            taken += 1
            if t in stop:
                break
        # the cache holds the root and the path (new[:-1]); as in plain decoding, the last committed token is not
        # fed, so the path's slots after the last committed one hold tokens that are never emitted
        uncommitted = len(new) - taken

    while len(ctx.committed) < max_new and root not in stop:
        on_device = runner.captures and width is not None
        tree = drafter.propose_on_device(ctx) if on_device else None
        if tree is not None:
            if root_dev is None:
                root_dev = torch.tensor([root], device=device)
            root_dev = _cycle_on_device(ctx, drafter, tree, root_dev, width, commit)
        else:
            root_dev = None
            _cycle(ctx, drafter, root, width, commit)
        root = ctx.committed[-1]
    t2 = now(device)
    stats.draft_forwards += ctx.extras.get("draft_forwards", 0)
    stats.draft_tokens += ctx.extras.get("draft_tokens", 0)
    tokens = ctx.committed
    cut = next((i for i, t in enumerate(tokens) if t in stop), len(tokens))
    state.crop_last(uncommitted)  # the cache as plain decoding leaves it (kv_bytes_end)
    kv_end = state.kv_bytes_per_sample()[0]
    runner.finish(state)  # its static buffers (and graphs) serve the next sample
    return _OneResult(tokens[:cut], acc, method_stats, kv_end, t1 - t0, t2 - t1)


def _cycle(ctx: SpecContext, drafter: Drafter, root: int, width: int | None, commit: Callable) -> None:
    """One draft-verify cycle with the tree and the verdict on the host; ``commit(tokens, path length, depths
    tried)`` takes the accepted path's tokens and the bonus before the drafter learns them."""
    runner, state = ctx.method.runner, ctx.state
    tree = drafter.propose(ctx, root)
    nodes, depth, mask = _verify_inputs(tree, root, width)  # [1, W], [W], [W, W]
    step = runner.step(state, nodes, depth=depth, block_mask=mask)
    logits = step.logits[0, : tree.n + 1]  # [N+1, V]
    if not ctx.greedy and all(q is None for q in tree.q):  # point masses: the device's rule, run here
        verdict = _sampled_verdict(ctx, drafter, tree, root, logits)
    else:
        verdict = verify(tree, None if ctx.greedy else ctx.probs(logits), logits, ctx.generator)
    keep = [0, *verdict.path]
    runner.keep_new(state, nodes.shape[1], keep, prefix=verdict.path == list(range(1, len(verdict.path) + 1)))
    commit([tree.token_list[i - 1] for i in verdict.path] + [verdict.bonus], len(verdict.path), verdict.tried_depths)
    drafter.accept(ctx, tree, verdict.path, step.hidden[0, keep], verdict.bonus)  # [1 + len(path), d]


def _uniforms(ctx: SpecContext, drafter: Drafter, n: int) -> torch.Tensor:
    """[W + 1] a sampled cycle's uniforms (:func:`sampled_accept`), W the drafter's verify width (its bound, the
    same whether the cycle runs on the device or here; unbounded: the tree's N + 1)."""
    width = drafter.max_step_tokens() or n + 1
    return torch.rand(width + 1, generator=ctx.generator, device=ctx.generator.device)


def _sampled_verdict(ctx: SpecContext, drafter: Drafter, tree: DraftTree, root: int, logits: torch.Tensor) -> Verdict:
    """:func:`sampled_accept` of a point-mass ``tree`` (``logits`` [N + 1, V]) with the cycle's uniforms, eagerly,
    as a host verdict: the same tokens as the cycle on the device draws from the same generator."""
    u = _uniforms(ctx, drafter, tree.n)
    w = u.numel() - 1
    levels = max(1, *tree_depths(tree.parent_list))
    nodes = torch.tensor([*padded_nodes(tree.token_list, tree.parent_list, w, root), root], device=logits.device)
    rows = torch.cat([logits, logits.new_zeros(w - tree.n - 1, logits.shape[-1])])  # [W, V]; pads: never read
    out = sampled_accept(nodes[: w - 1], nodes[w - 1 : -1], ctx.probs(rows), nodes[-1:], u, levels)
    host = out.tolist()
    k, _, tried = _read_verdict(host, w)
    return Verdict(host[1:k], host[-1], tried)


def _read_verdict(host: list[int], width: int) -> tuple[int, list[int], list[int]]:
    """A verdict (:func:`greedy_accept`'s layout) read to the host: the kept count k (root + path), the committed
    tokens (the path's, then the bonus) and the depths at which a child was tried."""
    k = host[width]
    return k, host[width + 1 : width + 1 + k], [d + 1 for d in range(k) if host[2 * width + 2 + d]]


def _cycle_on_device(
    ctx: SpecContext, drafter: Drafter, tree: DeviceTree, root: torch.Tensor, width: int, commit: Callable
) -> torch.Tensor:
    """A cycle whose tree, verdict and rollback stay on the device (captured steps): the drafter's proposal, the
    verify step's graph, the verdict's graph (:func:`greedy_accept`; sampling: :func:`sampled_accept` on uniforms
    drawn before it), the target's keep graph and the draft's accept step run back to back from device tensors, and
    the host reads the verdict once, then follows with its counts and layouts. The same tokens and statistics as
    :func:`_cycle`. Returns the next root ([1], on the device)."""
    runner, state = ctx.method.runner, ctx.state
    n_tree = tree.tokens.numel()
    nodes = torch.cat([root, tree.tokens, root.expand(width - n_tree - 1)])[None]  # [1, W]
    step = runner.step(state, nodes, depth=tree.depth, block_mask=tree.mask)
    u = None if ctx.greedy else _uniforms(ctx, drafter, n_tree)  # [W + 1], drawn outside the graph

    def make() -> tuple[_VerdictInputs, Any]:
        tree_in = torch.cat([tree.tokens, tree.parents])
        inputs = _VerdictInputs(tree_in, step.logits[0].clone(), root.clone(), None if u is None else u.clone())

        def run() -> torch.Tensor:  # [3W + 3]
            tp, levels = inputs.tree, tree.levels
            if inputs.u is None:
                return greedy_accept(tp[:n_tree], tp[n_tree:], inputs.logits, inputs.root, levels)
            return sampled_accept(tp[:n_tree], tp[n_tree:], ctx.probs(inputs.logits), inputs.root, inputs.u, levels)

        return inputs, run

    def load(inputs: _VerdictInputs) -> None:
        inputs.tree[:n_tree].copy_(tree.tokens)
        inputs.tree[n_tree:].copy_(tree.parents)
        inputs.logits.copy_(step.logits[0])
        inputs.root.copy_(root)
        if u is not None:
            inputs.u.copy_(u)

    rule = ("greedy_accept",) if u is None else ("sampled_accept", ctx.temperature, ctx.top_k, ctx.top_p)
    # on no KV buffers (key[0] = ()): the pool keeps it across calls
    key = ((), *rule, width, n_tree, tree.levels, step.logits.shape[-1], str(step.logits.device))
    verdict = runner.run_captured(key, make, load)  # [3W + 3]
    w = width
    runner.keep_new_on_device(state, w, verdict[: w + 1])
    drafter.accept_on_device(ctx, verdict[w + 1 : 2 * w + 2], step.hidden[0].index_select(0, verdict[:w]))
    k, tokens, tried = _read_verdict(verdict.tolist(), w)  # the cycle's one read
    runner.kept_on_device(state, w, verdict[:k])
    commit(tokens, k - 1, tried)
    drafter.accepted_on_device(ctx, k)
    return verdict[3 * w + 2 :]


def speculative_decode(ctx: MethodContext, drafter: Drafter, req: DecodeRequest, sampling: Sampling) -> DecodeOutput:
    """Draft-and-verify decoding of ``req`` (samples one at a time). Output follows the target's
    ``sampling`` rule exactly (the session runs this when the recipe has a drafter)."""
    ctx_kw = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    per_sample: list[SpecStats] = []
    results = []
    for b in range(req.inputs.batch_size):
        # each sample its own generator, seeded by (seed, sample identity): batch-independent draws
        ctx_kw["generator"] = sample_generator(sample_seed(req.seed, req.batch, b), ctx.device)
        row = req.inputs.select(torch.tensor([b], device=req.inputs.input_ids.device))
        pad = int((row.attention_mask[0] == 0).sum())  # batch-1 verification needs no left padding
        row = row.crop_left(pad)
        per_sample.append(SpecStats())
        results.append(_decode_one(ctx, drafter, row, req.max_new_tokens, ctx_kw, per_sample[-1]))
    accs = [r.prefill_acc for r in results]
    rows = [st.as_dict() for st in per_sample]
    return DecodeOutput(
        tokens=[r.tokens for r in results],
        prefill_s=sum(r.prefill_s for r in results),
        decode_s=sum(r.decode_s for r in results),
        n_forwards=sum(st.cycles for st in per_sample),
        kv_bytes_prefill=[a.kv_bytes[0] for a in accs],
        kv_bytes_end=[r.kv_end for r in results],
        vision_tokens_layer_avg=[a.vision_layer_avg[0] for a in accs],
        flops_prefill=[a.flops[0] for a in accs],
        flops_prefill_7b=[a.flops_7b[0] for a in accs],
        # each sample's own statistics (a result's ``stats["speculative"]``): they sum over results
        stats={"speculative": {f"per_sample_{k}": [d[k] for d in rows] for k in rows[0]}} if rows else {},
        method_stats=_stack_rows([r.method_stats for r in results]),
    )


def _stack_rows(per_row: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One-row method statistics of consecutive samples as one batch's (``per_sample_*`` joined)."""
    out: dict[str, dict[str, Any]] = {}
    for stats in per_row:
        for name, d in stats.items():
            merged = out.setdefault(name, {})
            for k, v in d.items():
                if k.startswith("per_sample_") and isinstance(v, list):
                    merged.setdefault(k, []).extend(v)
                else:
                    merged[k] = v
    return out
