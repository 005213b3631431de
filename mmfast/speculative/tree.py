"""Draft trees and the lossless acceptance rule.

A draft is a tree whose node 0 is the *root*, the last committed token (not yet in the target's
cache), and whose nodes 1..N are draft tokens with parent indices. The target scores the whole tree in
one forward (each node sees the prefix, its ancestors and itself; position = prefix + depth), so the
logits at node i give the target distribution of i's children.

Acceptance walks down from the root:

- greedy: a child is accepted iff it equals the target argmax; the bonus token is the argmax at the
  last accepted node;
- sampling (lossless): at a node with children c_1..c_m tried in order against the residual target
  distribution r (initially the warped target p): a point-mass child (deterministic top-k / n-gram
  proposals, EAGLE-2's rule) is accepted with probability r(c), else r(c) = 0 and r is renormalised;
  a child drawn from a proposal q is accepted with probability min(1, r(c)/q(c)), else r = norm(max(0,
  r - q)) (Leviathan et al. / Chen et al.). If no child is accepted, the bonus token is drawn from r;
  at a leaf it is drawn from the target p there. Either way the emitted tokens follow the target
  distribution exactly.

Sampled siblings: the rule above needs the proposal each child was *actually* drawn from, given the
siblings tried before it. Siblings drawn independently from q (``sibling_sampling="iid"``) use q
itself; siblings drawn from q *without replacement* (EAGLE-1's ``multinomial(replacement=False)``)
were drawn from q with the earlier siblings' tokens removed and renormalised, and that is the q the
rule uses for them (recursive rejection sampling without replacement, Jeon et al. 2024); using the
plain q there would over-accept later siblings and silently bias the output. A tree with two or more
sampled children under one node must therefore say which (``sibling_sampling``); ``verify`` refuses it
otherwise, and refuses a "without_replacement" tree whose sampled siblings repeat a token.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass
class DraftTree:
    """Nodes 1..N of a draft (node 0, the root, is implicit)."""

    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, parent of node i+1 in 0..N (0 = root), parents before children
    q: list[torch.Tensor | None] = field(
        default_factory=list
    )  # per node: proposal distribution [V] or None (point mass)
    # how sampled siblings (>= 2 sampled children of one node) were drawn from their q; required then
    sibling_sampling: Literal["iid", "without_replacement"] | None = None

    def __post_init__(self) -> None:
        if not self.q:
            self.q = [None] * int(self.tokens.numel())

    @property
    def n(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def chain(tokens: list[int], q: list[torch.Tensor | None] | None = None, device=None) -> DraftTree:
        tree = DraftTree.of_lists(tokens, list(range(len(tokens))), device)
        tree.q = list(q) if q is not None else tree.q
        return tree

    @staticmethod
    def of_lists(tokens: list[int], parents: list[int], device=None) -> DraftTree:
        """A tree from host lists (one copy each), the lists kept (``token_list`` / ``parent_list`` read nothing back)."""
        as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
        tree = DraftTree(as_tensor(tokens), as_tensor(parents))
        tree.__dict__["token_list"], tree.__dict__["parent_list"] = list(tokens), list(parents)
        return tree

    @functools.cached_property
    def parent_list(self) -> list[int]:
        """``parents`` on the host (one device-to-host copy per tree)."""
        return self.parents.tolist()

    @functools.cached_property
    def token_list(self) -> list[int]:
        """``tokens`` on the host (one device-to-host copy per tree)."""
        return self.tokens.tolist()

    def depth(self, width: int | None = None) -> torch.Tensor:
        """[N + 1] depth of every node, root included (root = 0); with ``width``, [W] padded with 0."""
        return torch.tensor(tree_depths(self.parent_list, width), dtype=torch.long, device=self.tokens.device)

    def mask(self, width: int | None = None) -> torch.Tensor:
        """[N + 1, N + 1] bool: node i sees node j iff j is i or an ancestor of i; with ``width``,
        [W, W]: pad rows see only themselves and no node sees a pad. Built on the host, one copy."""
        return torch.tensor(_mask_rows(self.parent_list, width), dtype=torch.bool, device=self.tokens.device)

    def children(self) -> list[list[int]]:
        """Children of every node (0..N), in proposal order."""
        ch: list[list[int]] = [[] for _ in range(self.n + 1)]
        for i, p in enumerate(self.parent_list):
            ch[p].append(i + 1)
        return ch


def tree_depths(parents: list[int], width: int | None = None) -> list[int]:
    """:meth:`DraftTree.depth` on the host."""
    d = [0] * (len(parents) + 1)
    for i, p in enumerate(parents):
        d[i + 1] = d[p] + 1
    return d + [0] * max(0, (width or 0) - len(d))


def _mask_rows(parents: list[int], width: int | None) -> list[list[bool]]:
    """:meth:`DraftTree.mask` on the host."""
    n = max(len(parents) + 1, width or 0)
    rows = [[False] * n for _ in range(n)]
    rows[0][0] = True
    for i, p in enumerate(parents):
        rows[i + 1] = rows[p].copy()
        rows[i + 1][i + 1] = True
    for i in range(len(parents) + 1, n):
        rows[i][i] = True
    return rows


@dataclass
class DeviceTree:
    """A draft tree on the device with its verify step's layout, read back by nobody: nodes 1..T's tokens and
    parents (a pad node is its own parent), and the step's depths and tree mask for W slots (:func:`tree_layout`)."""

    tokens: torch.Tensor  # [T] long
    parents: torch.Tensor  # [T] long, 0 = root, parents before children
    depth: torch.Tensor  # [W] long: the root, the nodes, then pad slots at depth 0
    mask: torch.Tensor  # [W, W] bool: DraftTree.mask(W)
    levels: int  # >= the tree's depth (the fixed rounds of the device-side walks)

    @staticmethod
    def packed_nodes(packed: torch.Tensor, width: int) -> int:
        """T, the nodes of a tree packed as :meth:`unpack` reads it."""
        return (packed.numel() - 1 - width - width * width) // 2

    @staticmethod
    def unpack(packed: torch.Tensor, width: int, levels: int) -> DeviceTree:
        """Views of ``packed`` = [tokens (T); parents (T); a flag (1); depths (W); mask (W x W, as 0 / 1)]."""
        n = DeviceTree.packed_nodes(packed, width)
        layout = packed[2 * n + 1 :]
        return DeviceTree(
            packed[:n], packed[n : 2 * n], layout[:width], layout[width:].view(width, width).bool(), levels
        )

    @staticmethod
    def from_lists(
        tokens: list[int], parents: list[int], width: int, root: int, levels: int, device: torch.device
    ) -> DeviceTree:
        """A tree built on the host, sent in one copy as W - 1 nodes (:func:`padded_nodes`); ``levels`` >= its
        depth (a fixed bound keeps one verdict graph for every tree)."""
        mask = [int(b) for row in _mask_rows(parents, width) for b in row]
        packed = [*padded_nodes(tokens, parents, width, root), 0, *tree_depths(parents, width), *mask]
        return DeviceTree.unpack(torch.tensor(packed, device=device), width, levels)


def padded_nodes(tokens: list[int], parents: list[int], width: int, root: int) -> list[int]:
    """A host tree's W - 1 node tokens, then their parents: its nodes, then pad nodes up to the verify width W (the
    root's token, each its own parent: never accepted, seen by none)."""
    pads = range(len(tokens) + 1, width)
    return [*tokens, *[root] * len(pads), *parents, *pads]


def _slot_parents(parents: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[W] every verify slot's parent slot, from the T nodes' ``parents`` and ``slots`` = arange(W): the root and
    the slots after the nodes are their own parents."""
    return torch.cat([slots[:1], parents, slots[parents.numel() + 1 :]])


def _jumps(parents: torch.Tensor, levels: int) -> Iterator[torch.Tensor]:
    """Pointer doubling over ``parents`` ([W], the root and pads their own): each slot's 2^j-th ancestor for j = 0, 1,
    ... while 2^j <= ``levels``, so that rounds of "combine with the j-th jump's" reach every ancestor of a node at
    depth <= ``levels``."""
    up = parents
    for j in range(max(1, levels.bit_length())):
        if j:
            up = up.index_select(0, up)
        yield up


def tree_layout(parents: torch.Tensor, width: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`DraftTree.depth` and :meth:`DraftTree.mask` of a tree padded to ``width`` slots, computed on the
    device in fixed shapes (no host read) by pointer doubling (:func:`_jumps`; ``levels`` >= the tree's depth): a
    node sees what it sees and what its 2^j-th ancestor sees. Returns depths [W] and the mask [W, W]."""
    ar = torch.arange(width, device=parents.device)
    seen = ar[:, None] == ar[None, :]  # [W, W] the ancestors at distances below 2^j, and itself
    for up in _jumps(_slot_parents(parents, ar), levels):
        seen = seen | seen.index_select(0, up)
    return seen.sum(1) - 1, seen


def _slots(tokens: torch.Tensor, parents: torch.Tensor, root: torch.Tensor, w: int) -> tuple[torch.Tensor, ...]:
    """The verify step's W slots: their index (arange), token, parent slot and whether each is a node (not the root,
    not a pad: a pad is its own parent and is never accepted, since its parent never is). [W] each."""
    ar = torch.arange(w, device=tokens.device)
    node_tok = torch.cat([root, tokens, root.expand(w - tokens.numel() - 1)])
    return ar, node_tok, _slot_parents(parents, ar), (ar >= 1) & (ar <= tokens.numel())


def _earlier_siblings(par: torch.Tensor, ar: torch.Tensor) -> torch.Tensor:
    """[W, W] earlier[j, i]: slot i is tried before slot j under the same parent."""
    return (par[:, None] == par[None, :]) & (ar[None, :] < ar[:, None])


def _first(ok: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
    """[W] whether each slot is ``ok`` with no earlier ``ok`` sibling (``earlier``: :func:`_earlier_siblings`)."""
    return ok & ~(earlier & ok[None, :]).any(1)


def _walk(first: torch.Tensor, par: torch.Tensor, ar: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted path down from the root, each node the ``first`` child of an accepted parent (the nodes whose
    every ancestor below the root, and themselves, are ``first``; by pointer doubling, :func:`_jumps`): (k = root +
    path [1], keep [W]: the root, the path's slots in depth order, then the others' own)."""
    # [W] first at every distance below 2^j up the tree; the root is, a pad (its own parent, not the root) is not
    acc = torch.where(par == ar, ar == 0, first)
    for up in _jumps(par, levels):
        acc = acc & acc.index_select(0, up)
    k = acc.sum()[None]  # [1]
    order = torch.sort(torch.where(acc, ar, ar + ar.numel())).values  # accepted slots first, in index order
    return k, torch.where(ar < k, order, ar)


def _packed(
    keep: torch.Tensor,
    k: torch.Tensor,
    bonus: torch.Tensor,
    node_tok: torch.Tensor,
    par: torch.Tensor,
    ar: torch.Tensor,
    is_node: torch.Tensor,
) -> torch.Tensor:
    """The verdict as :func:`greedy_accept` returns it, [3W + 3]."""
    after = node_tok.index_select(0, torch.cat([keep[1:], keep[:1]]))  # [W] the token of the next kept slot
    nxt = torch.where(ar < k - 1, after, torch.where(ar == k - 1, bonus, torch.zeros_like(after)))
    has_kids = ((par[None, :] == ar[:, None]) & is_node[None, :]).any(1)  # [W]
    tried = has_kids.index_select(0, keep) & (ar < k)
    return torch.cat([keep, k, nxt, k, tried.long(), bonus])


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, root: torch.Tensor, levels: int):
    """Greedy :func:`verify` on the device in fixed shapes (no host read), for a tree of T nodes verified in a
    step of W slots (root, nodes, pads; a node that is its own parent is a pad): the first child (in proposal order) equal to its parent's target argmax
    is accepted, down from the root; the bonus is the argmax at the last accepted node.

    Args:
        tokens, parents: [T] the tree (parents before children, 0 = root); ``levels`` >= its depth.
        logits: [W, V] the target's logits at the step's slots. root: [1] the root token.

    Returns [3W + 3] long: ``keep`` (W: the root, the accepted path's nodes, then the other slots' own offsets)
    and the kept count k = path + 1 (what :meth:`LMRunner.keep_new_on_device` reads); the committed tokens (W: the
    path's, then the bonus, zero-padded) and their count k (what the draft's accept step reads); whether each kept
    node has children (W; the depths tried); the bonus (the next root).
    """
    ar, node_tok, par, is_node = _slots(tokens, parents, root, logits.shape[0])
    target = logits.argmax(-1)  # [W]
    match = is_node & (node_tok == target.index_select(0, par))  # [W] a node equals its parent's argmax
    first = _first(match, _earlier_siblings(par, ar))  # verify takes the first match
    k, keep = _walk(first, par, ar, levels)
    bonus = target.index_select(0, keep.index_select(0, k - 1))  # [1] the argmax at the deepest accepted node
    return _packed(keep, k, bonus, node_tok, par, ar, is_node)


def sampled_accept(
    tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, root: torch.Tensor, u: torch.Tensor, levels: int
) -> torch.Tensor:
    """The sampling rule of :func:`verify` for point-mass nodes (deterministic proposals: EAGLE-2's trees, n-gram
    drafts), on the device in fixed shapes (no host read), with uniforms drawn before it: slot j's child test uses
    ``u[j]``, the bonus ``u[W]`` (by inverse CDF), so the verdict is one function of its inputs, the same in a
    captured graph and eagerly.

    At an accepted node, its children are tried in proposal order; child j, whose earlier siblings were rejected, is
    accepted iff ``u[j] < r(c_j)``, r the target's warped distribution there with the rejected siblings' tokens
    removed and renormalised: ``p(c_j) / (1 - sum of p over the earlier siblings' distinct tokens)``, 0 when an
    earlier sibling holds the same token (its mass is gone). If none is accepted the bonus is drawn from that residual
    (every child removed; a leaf: p itself). Each emitted token follows the target distribution exactly (the rule
    of Leviathan et al. / Chen et al. for point-mass drafts, EAGLE-2's).

    Args:
        tokens, parents: [T] the tree (parents before children, 0 = root; a node that is its own parent is a pad).
        probs: [W, V] the target's warped probabilities at the step's slots. root: [1] the root token.
        u: [W + 1] uniforms in [0, 1). ``levels`` >= the tree's depth.

    Returns [3W + 3] long, laid out as :func:`greedy_accept`'s.
    """
    w, vocab = probs.shape
    ar, node_tok, par, is_node = _slots(tokens, parents, root, w)
    p = probs[par, node_tok]  # [W] each node's token under its parent's distribution
    # the child test: earlier siblings (nodes) rejected, their distinct tokens' mass removed
    earlier = _earlier_siblings(par, ar)  # [W, W]
    tried = earlier & is_node[None, :]  # the earlier siblings that are nodes
    repeat = (tried & (node_tok[:, None] == node_tok[None, :])).any(1)  # [W] an earlier sibling's token: gone
    left = 1.0 - (tried & ~repeat[None, :]).float() @ p  # [W]
    accept = torch.where(repeat, torch.zeros_like(p), torch.where(left > 0, p / left, p))  # [W]
    first = _first(is_node & (u[:w] < accept), earlier)
    k, keep = _walk(first, par, ar, levels)
    last = keep.index_select(0, k - 1)  # [1] the deepest accepted node: every child of it was rejected
    kids = is_node & (par == last)  # [W]
    gone = torch.zeros(vocab, device=probs.device).scatter_add(0, node_tok, kids.float()) > 0  # [V]
    dist = probs.index_select(0, last)[0]  # [V]
    residual = torch.where(gone, torch.zeros_like(dist), dist)
    residual = torch.where(residual.sum() > 0, residual, dist)  # unreachable for valid distributions: p itself
    cdf = residual.double().cumsum(0)  # [V]
    drawn = torch.searchsorted(cdf, u[w:].double() * cdf[-1], right=True).clamp(max=vocab - 1)  # [1]
    return _packed(keep, k, drawn, node_tok, par, ar, is_node)


@dataclass
class Verdict:
    path: list[int]  # accepted nodes (1..N), root to leaf
    bonus: int  # the token emitted after the path (correction or bonus)
    tried_depths: list[int]  # depths at which at least one child was tried


def verify(
    tree: DraftTree,
    probs: torch.Tensor | None,
    logits: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Accept a root-to-leaf path of ``tree`` given target scores at every node.

    Args:
        probs: [N + 1, V] warped target probabilities (sampling), or None for greedy.
        logits: [N + 1, V] target logits (greedy uses their argmax).
    """
    children = tree.children()
    tokens = tree.token_list
    # greedy: every node's target token in one device-to-host copy (instead of one per accepted depth)
    targets = logits.argmax(-1).tolist() if probs is None else []
    if probs is not None:
        _check_siblings(tree, children, tokens)
    without = tree.sibling_sampling == "without_replacement"
    node, path, tried = 0, [], []
    depth = 0
    while True:
        kids = children[node]
        if kids:
            tried.append(depth + 1)
        if probs is None:
            target = targets[node]
            nxt = next((c for c in kids if tokens[c - 1] == target), None)
            if nxt is None:
                return Verdict(path, target, tried)
        else:
            r = probs[node].clone().float()
            nxt = None
            drawn: list[int] = []  # tokens of the sampled siblings tried so far at this node
            for c in kids:
                t = tokens[c - 1]
                q = tree.q[c - 1]
                if q is not None:
                    q = q.float().to(r.device)
                    if without and drawn:  # drawn from q without the earlier siblings, renormalised
                        q = q.clone()
                        q[drawn] = 0.0
                        q = q / q.sum().clamp_min(1e-30)
                    drawn.append(t)
                u = float(torch.rand((), generator=generator, device=generator.device if generator else None))
                if q is None:
                    if u < float(r[t]):
                        nxt = c
                        break
                    r[t] = 0.0
                else:
                    if u < min(1.0, float(r[t]) / max(float(q[t]), 1e-30)):
                        nxt = c
                        break
                    r = (r - q).clamp(min=0)
                total = r.sum()
                if total <= 0:  # cannot happen for valid distributions; guard the renormalisation
                    r = probs[node].clone().float()
                    total = r.sum()
                r = r / total
            if nxt is None:
                bonus = int(torch.multinomial(r, 1, generator=generator))
                return Verdict(path, bonus, tried)
        path.append(nxt)
        node = nxt
        depth += 1


def _check_siblings(tree: DraftTree, children: list[list[int]], tokens: list[int]) -> None:
    """Refuse sampled siblings whose sampling scheme the acceptance rule cannot know."""
    for kids in children:
        sampled = [tokens[c - 1] for c in kids if tree.q[c - 1] is not None]
        if len(sampled) < 2:
            continue
        if tree.sibling_sampling is None:
            raise ValueError(
                "a draft node has several sampled children, but the DraftTree does not say how they were drawn "
                "(sibling_sampling='iid' or 'without_replacement'); the acceptance rule depends on it and would "
                "be lossy with the wrong one"
            )
        if tree.sibling_sampling == "without_replacement" and len(set(sampled)) < len(sampled):
            raise ValueError("sibling_sampling='without_replacement' but sampled siblings repeat a token")
