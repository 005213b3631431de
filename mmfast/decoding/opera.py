"""OPERA: Over-trust Penalty and Retrospection-Allocation (Huang et al., CVPR 2024, arXiv 2311.17911).

Algorithm (one beam step; released code ``shikiw/OPERA`` ``transformers-4.29.2/.../generation/utils.py
::opera_beam_search``):

1. Run the K beams; per beam take the candidate set = the top-N_can tokens by raw logits, append each
   candidate (one cached look-ahead forward) and read its row of the last decoder layer's attention,
   max over heads, renormalised to sum to 1.
2. On the response part (rows/columns >= prompt length, the candidate's row last) scaled by sigma,
   phi_j = 1e-7 * prod_{i >= j} sigma * a_ij (column-wise product over the lower triangle); the
   over-trust score is phi = max_j phi_j, its location c = argmax_j.
3. Candidate score = logit - alpha * penalty, penalty = -(image attention of the candidate's row)
   while <= 10 response tokens exist (a bonus), phi afterwards; every other token -999; log-softmax;
   the standard beam update (top 2K, finished pool, transformers' early stop: :class:`BeamSearch`).
4. Record c per beam (mode over candidates) and per step (mode over beams). When every beam's
   history holds more than r entries equal to the current c, and c >= 10: roll back to response
   position c+1 (c if c+1 was already rolled back N_can times; skip if both were), restore that
   step's ids, beam bookkeeping and attention history, and re-choose the token there with plain beam
   logits in which every (beam, token) pair chosen there before is banned (bans accumulate).
   As released: the location history is kept per beam *slot* (not reordered with the beams), modes
   break ties towards the smallest location, and the redo step uses the full-vocabulary logits
   shifted so that their minimum is -999 (no candidate restriction, no penalty) with bans at -999.

Defaults (README / argparse / signature): num_beams 5, scale_factor 50, threshold r 15,
num_attn_candidates N_can 5, penalty_weights alpha 1, window_size 512 (rollback buffer only: phi
uses *all* response tokens). The README's "efficient" setting is ``threshold: 25, num_attn_candidates: 1``.

Hook points: ``session.probe.watch`` on the last decoder layer's attention (``reduce="max"`` over
heads, the new query rows of decode forwards only; the model keeps running sdpa); everything else is
the decoder's own loop over ``runner.prefill`` / ``runner.step`` and :class:`~mmfast.runtime.LMState`
clones. In-LLM pruning composes: the response start and the image span are read from the runner
state's last-layer group (its prefill length and its vision slots), not from the raw input.

Look-ahead (``lookahead``): ``tree`` (default) scores the N_can candidates of every beam as sibling tokens of one
forward and crops them back (no cache copy); ``clone`` runs K x N_can rows on cloned caches, and is taken whenever
the recipe has per-step KV policies. Both give the same rows up to float rounding and gave identical tokens in every
test; the rows are read by :mod:`._opera_lookahead`.

Static cache (``model.compile``; the ``tree`` look-ahead; the beams' step and look-ahead captured under ``auto``):
each sample's K beam rows get buffers of their own (the pool's second set: refilled for the next sample and taken by
the next call); a rollback cuts the beams back to the prompt and re-forwards the prefix eagerly.
``lookahead: clone`` keeps the dynamic cache.

Memory: O(K x t) running column log-sums per step, bounded rollback snapshots, no L x L map; details in
``docs/methods.md`` ("OPERA in detail").

Limits: beam search only (``check_recipe`` refuses speculative drafting, pruning stages that refuse
beam search, e.g. ZipVL, and Dynamic-LLaVA's decode-time text rule); needs the KV cache and every
generated token cached in the last layer (checked at every forward). Samples of a batch share one
prefill, then are decoded one after another (each has its own trigger and rollbacks). Per step:
1 forward of K rows + 1 look-ahead forward (tree) + a multi-token forward per rollback.
Deviations from the released code, with the reason for each: ``docs/methods.md`` ("OPERA in detail").

Presets: ``exact`` (default) keeps the penalty in fp32 log space and uses transformers 5's beam
scorer; ``release`` reproduces the release's arithmetic: attention rows rounded to fp16, factors
``fp16(sigma * a)``, the column product held in fp16 (above 65504 it is inf and excludes the
candidate; below fp16's range, 1e-7 x product is 0), the location taken on that fp16 buffer, and
transformers 4.29.2's beam scorer (finished beams normalised by prompt + generated length; see
:mod:`.beam`). ``fp16_saturation: true`` alone takes the fp16 score buffer with fp32 factors.

With ``penalty_weights: 0``, a threshold above ``max_new_tokens`` and ``num_attn_candidates`` >= the
vocabulary size, OPERA is exactly the ``beam`` decoder (tested). With N_can < vocabulary it is a
candidate-restricted beam search (the -999 fill renormalises each beam over its candidates).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .. import compat
from ..capabilities import Capabilities
from ..config import opt
from ..registry import DECODERS
from ._opera_lookahead import LastLayerRows
from ._opera_penalty import OverTrustHistory, mode, phi_from_log, rollback_target
from .base import DecodeOutput, Decoder, DecodeRequest, now, state_accounting
from .beam import BeamSearch, release_prompt_len
from .loop import finish

BONUS_TOKENS = 10  # image-attention bonus while the response part (candidate included) has <= 10 tokens
FILL = -999.0  # the released code's value for non-candidates and banned tokens
_F32_MIN = torch.finfo(torch.float32).min


@dataclass
class _Snapshot:
    search: BeamSearch
    history: torch.Tensor


@dataclass
class _SampleResult:
    tokens: list[int]
    kv_bytes_end: int
    n_forwards: int
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    penalty_steps: int = 0
    bonus_steps: int = 0
    candidate_forwards: int = 0
    history_bytes_peak: int = 0


@DECODERS.register(
    "opera", description="OPERA: beam search with an over-trust attention penalty and retrospection rollback"
)
class Opera(Decoder):
    """OPERA (over-trust penalty + retrospection-allocation beam search)."""

    # the tree look-ahead, the beams' steps and the rollback run on the static cache (captured under
    # model.compile: auto); the clone look-ahead does not (capabilities)
    caps = Capabilities(search="beam", needs_full_decode_cache=True)
    probe_key = "opera.last_layer"

    @classmethod
    def capabilities(cls, params) -> Capabilities:
        if params is not None and params.lookahead == "clone":
            return dataclasses.replace(cls.caps, dynamic_decode="its clone look-ahead deep-copies the cache every step")
        return cls.caps

    @dataclass(frozen=True)
    class Config:
        num_beams: int = opt(5, lo=1, hi=64, doc="beams per sample")
        scale_factor: float = opt(50.0, lo=1e-6, hi=1e6, doc="sigma: attention scale inside the column product")
        threshold: int = opt(15, lo=0, doc="r: rollback when every beam's location history has > r hits")
        num_attn_candidates: int = opt(5, lo=1, doc="N_can: candidates per beam (also the rollback limit per position)")
        penalty_weights: float = opt(
            1.0, lo=0.0, hi=1000.0, doc="alpha: weight of the over-trust penalty / image bonus"
        )
        window_size: int = opt(512, lo=1, doc="steps kept for rollback")
        length_penalty: float = opt(1.0, lo=-10.0, hi=10.0, doc="beam length penalty exponent (transformers)")
        lookahead: Literal["tree", "clone"] = opt(
            "tree",
            doc="clone: K*N_can rows on a cloned, repeated cache; tree: N_can sibling tokens per beam, no cache copy",
        )
        candidate_chunk: int = opt(
            0, lo=0, doc="clone look-ahead: candidate sets per forward (0: all N_can in one forward)"
        )
        fp16_saturation: bool = opt(False, doc="reproduce the released code's fp16 score buffer (inf above 65504)")
        preset: Literal["exact", "release"] = opt(
            "exact",
            doc="exact: fp32 log-space penalty, transformers 5's beam scorer; release: the released "
            "arithmetic (fp16 factors and score buffer, transformers 4.29.2's scorer: prompt + generated length)",
        )

    def install(self) -> None:
        cfg = self.config
        self.attn_rows = LastLayerRows(self.ctx, self.probe_key, cfg.lookahead, cfg.candidate_chunk)

    def max_step_tokens(self) -> int:
        """Slots a step appends beyond the generated tokens: the tree look-ahead's N_can siblings."""
        return self.config.num_attn_candidates

    def _rebuild(self, base, ids: torch.Tensor, first_logits: torch.Tensor, resp_start: int):
        """A fresh beam state: the post-prompt cache for K beams plus the generated prefix ``ids`` [K, p].

        Dynamic cache: ``base`` (the sample's post-prompt state) cloned and repeated. Static cache: ``base`` is
        the K beam rows themselves, cut back to the prompt (every row holds the sample's prompt, copied from
        one row, so this is the same cache), in the same buffers; the prefix is re-forwarded eagerly (a width
        that seldom recurs, not worth a graph of its own)."""
        runner = self.ctx.runner
        k, p = ids.shape
        static = compat.is_static(base.cache)
        if static:
            state = base
            state.crop_last(state.groups[-1].length - resp_start)
        else:
            state = base.clone()
            state.repeat_interleave(k)
        if p == 0:
            return state, first_logits.expand(k, -1).clone(), 0
        if not self.attn_rows.per_step_policies():
            return state, runner.step(state, ids, all_logits=False, graph=not static).logits[:, -1], 1
        for i in range(p):  # KV policies act once per token: replay the decode path
            logits = runner.step(state, ids[:, i : i + 1], all_logits=False).logits[:, -1]
        return state, logits, p

    # -- decode --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, req: DecodeRequest) -> DecodeOutput:
        runner = self.ctx.runner
        device = self.ctx.device
        inputs = req.inputs
        stop = torch.tensor(self.ctx.special.eos, device=device)
        t0 = now(device)
        state, out = runner.prefill(inputs)
        t1 = now(device)
        acc = state_accounting(state)
        method_stats = state.stats_rows(inputs.batch_size)
        g_last = state.group_of(state.n_layers - 1)
        resp_start = state.groups[g_last].length  # prompt length as the last layer caches it
        vision = state.vision_slots(g_last).float()  # [B, T0]
        results: list[_SampleResult] = []
        bsz = inputs.batch_size
        k = self.config.num_beams
        beams = None  # static cache: the K beam rows of the sample being decoded, one set of buffers for all
        for b in range(bsz):
            if compat.is_static(state.cache):  # the sample's row copied into the K beam rows' buffers
                base = beams = runner.rows(state, torch.full((k,), b, dtype=torch.long, device=device), into=beams)
            elif bsz == 1:
                base = state
            else:  # this sample's rows, on a copy (the batch state stays intact for the others)
                base = state.clone() if b < bsz - 1 else state
                base.reorder(torch.tensor([b], device=device))
            plen = release_prompt_len(req)[b : b + 1] if self.config.preset == "release" else None
            results.append(
                self._decode_sample(base, out.logits[b, -1], resp_start, vision[b], req.max_new_tokens, stop, plen)
            )
        t2 = now(device)
        stats = {
            "per_sample_rollbacks": [len(r.rollbacks) for r in results],
            "per_sample_rollback_events": [r.rollbacks for r in results],
            "per_sample_rollback_positions": [[e["position"] for e in r.rollbacks] for r in results],
            "per_sample_penalty_steps": [r.penalty_steps for r in results],
            "per_sample_bonus_steps": [r.bonus_steps for r in results],
            "per_sample_candidate_forwards": [r.candidate_forwards for r in results],
            "per_sample_attn_history_bytes_peak": [r.history_bytes_peak for r in results],
        }
        return finish(
            self.ctx,
            [r.tokens for r in results],
            times=(t0, t1, t2),
            acc=acc,
            method_stats=method_stats,
            kv_end=[r.kv_bytes_end for r in results],
            n_forwards=sum(r.n_forwards for r in results),
            stats=stats,
        )

    def _decode_sample(
        self,
        base,
        first_logits,
        resp_start: int,
        vision: torch.Tensor,
        max_new: int,
        stop,
        prompt_len: torch.Tensor | None = None,
    ) -> _SampleResult:
        cfg = self.config
        release = cfg.preset == "release"
        fp16 = cfg.fp16_saturation or release
        k, n_can = cfg.num_beams, cfg.num_attn_candidates
        alpha = cfg.penalty_weights
        device = first_logits.device
        vocab = int(first_logits.shape[-1])
        n_can = min(n_can, vocab)
        res = _SampleResult(tokens=[], kv_bytes_end=0, n_forwards=0)

        state, logits, _ = self._rebuild(
            base, torch.zeros(k, 0, dtype=torch.long, device=device), first_logits, resp_start
        )
        search = BeamSearch(1, k, max_new, cfg.length_penalty, device, prompt_len=prompt_len, run=self.ctx.captured)
        history = OverTrustHistory(k, cfg.scale_factor, device, fp16_factors=release)
        locs: list[torch.Tensor] = []  # per step: [K] location per beam slot (mode over candidates)
        snaps: dict[int, _Snapshot] = {}
        chosen: dict[int, torch.Tensor] = {}  # step -> [K] flat (source beam * V + token) chosen there
        bans: dict[int, torch.Tensor] = {}
        counts: dict[int, int] = {}
        step = 0
        while True:
            # BeamSearch replaces its tensors, never writes them: a shallow copy is the snapshot (no clones)
            snaps[step] = _Snapshot(copy.copy(search), history.snapshot())
            while next(iter(snaps)) <= step - cfg.window_size:  # keys increase in insertion order
                del snaps[next(iter(snaps))]
            held = history.nbytes() + sum(s.history.numel() * s.history.element_size() for s in snaps.values())
            res.history_bytes_peak = max(res.history_bytes_peak, held)

            # 1-2: candidates and their attention rows (one look-ahead forward)
            cand_scores, cand = logits.topk(n_can, dim=-1)  # [K, N]
            keys = resp_start + step + 1
            rows, n_fw = self.attn_rows.candidates(state, cand, keys)  # [K, N, keys]
            res.candidate_forwards += n_fw
            res.n_forwards += n_fw
            resp = rows[..., resp_start:]  # [K, N, step+1]
            phi, cand_loc = phi_from_log(history.candidate_log_scores(resp), fp16)
            # 3: penalty (image bonus while the response part has <= 10 tokens)
            if step + 1 <= BONUS_TOKENS:
                penalty = -(rows[..., :resp_start] * vision).sum(-1)
                res.bonus_steps += 1
            else:
                penalty = phi
                res.penalty_steps += int(alpha > 0)
            if alpha:
                cand_scores = (cand_scores - alpha * penalty).clamp(min=_F32_MIN)
            # 4: location history and the retrospection trigger
            beam_loc = mode(cand_loc)  # [K]
            locs.append(beam_loc)
            loc = int(mode(beam_loc))
            target = rollback_target(locs, loc, step, counts, next(iter(snaps)), cfg.threshold, cfg.num_attn_candidates)
            event = None
            if target is None:
                scores = torch.full_like(logits, FILL).scatter(-1, cand, cand_scores)
            else:
                pos = target
                snap = snaps[pos]
                search = copy.copy(snap.search)
                history.restore(snap.history)
                for d in [s for s in snaps if s > pos]:
                    del snaps[d]
                for d in [s for s in bans if s > pos]:
                    del bans[d]
                del locs[pos + 1 :]
                state, logits, n_fw = self._rebuild(base, search.running_tokens[0], first_logits, resp_start)
                res.n_forwards += n_fw
                bans[pos] = chosen[pos] if pos not in bans else torch.cat([bans[pos], chosen[pos]])
                for d in [s for s in chosen if s >= pos]:
                    del chosen[d]
                # the redo step: plain beam logits (shifted so that min = -999), banned pairs -999
                scores = logits - (-FILL + logits.min(-1, keepdim=True).values)
                scores = scores.reshape(-1).scatter(0, bans[pos], FILL).view(k, vocab)
                event = {
                    "step": step,
                    "location": loc,
                    "position": pos,
                    "banned": [divmod(int(x), vocab) for x in bans[pos]],
                }
                res.rollbacks.append(event)
                step = pos
            beam_idx, tokens = search.step(torch.log_softmax(scores, -1), stop)
            chosen[step] = beam_idx * vocab + tokens
            if event is not None:
                event["chosen"] = [divmod(int(x), vocab) for x in chosen[step]]
            if search.done:
                break
            self.ctx.runner.reorder(state, beam_idx)  # one captured graph under captured steps
            history.reorder(beam_idx)
            logits, row = self.attn_rows.step(state, tokens, resp_start + step + 1)
            res.n_forwards += 1
            history.append(row[:, resp_start:])
            step += 1

        kv_end = state.kv_bytes_per_sample()
        res.kv_bytes_end = int(sum(kv_end))
        res.tokens = search.best()[0]
        return res
